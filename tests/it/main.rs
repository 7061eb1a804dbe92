//! The single integration-test binary. Each module drives agentd the way its users do.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod runtime;
mod support;
