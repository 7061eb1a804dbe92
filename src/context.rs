//! The pure context builder (in progress).
