//! The single integration-test binary: one module per area, shared fakes in `fakes`.
#![allow(clippy::unwrap_used)]

mod fakes;
mod http_tool;
mod mcp;
mod openai;
