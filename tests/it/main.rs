//! Integration tests: the daemon started in-process with `daemon::run` on 127.0.0.1:0 (or as a
//! child process), driven only through HTTP and the CLI binary.
#![allow(clippy::unwrap_used)]

/// Shared harness: `TestDaemon`, the test configuration, HTTP helpers, polling with deadlines.
mod support;

/// Every route and every error code of the HTTP API.
mod api;
/// The CLI binary against a live daemon.
mod cli;
/// Control routes: cancel, approvals, input — idempotency and conflicts.
mod control;
/// The tenant-isolation matrix, generated from `api::ROUTES`.
mod isolation;
/// SIGTERM on a real child process.
mod shutdown;
/// SSE streaming and resume with `Last-Event-ID`.
mod sse;
