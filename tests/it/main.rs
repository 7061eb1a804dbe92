//! The single integration-test binary; each module is one area (run `cargo test --test it`).
#![allow(clippy::unwrap_used)]

mod store_contract;
mod support;
