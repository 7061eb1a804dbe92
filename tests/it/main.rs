//! The single integration-test binary; each module is one area (run `cargo test --test it`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod fakes;
mod http_tool;
mod mcp;
mod openai;
mod redis_support;
mod runtime;
mod store_contract;
mod support;
