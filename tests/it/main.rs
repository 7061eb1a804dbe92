//! The single integration-test binary (`cargo test --test it`): the runtime through its handle,
//! the daemon through HTTP and the CLI, the stores through one contract, and the providers
//! against fake servers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

/// Every route and every error code of the HTTP API.
mod api;
/// kill -9 chaos on a real daemon process over a private redis-server (I1–I4).
mod chaos;
/// Durability harness: a daemon child process, the event-log oracle, the intent witness.
mod chaos_support;
/// The CLI binary against a live daemon.
mod cli;
/// A local three-master Redis Cluster for the store contract and chaos tests.
mod cluster_support;
/// The commit window: a read-only step's reply committed with its result, on its own when
/// the window closes, and asked again after a crash in it.
mod commit_window;
/// Compensation: a cancelled or failed run undoes its successful unsafe calls, newest first,
/// exactly once, also across a kill -9.
mod compensation;
/// The web console in headless Chromium (playwright-core).
mod console;
/// Control routes: cancel, approvals, input — idempotency and conflicts.
mod control;
/// Daemon harness: `TestDaemon`, the test configuration, HTTP helpers, polling with deadlines.
mod daemon_support;
/// Runtime-level durability on Redis: fencing a stale owner, Redis killed and restarted with
/// or without its data.
mod durability;
/// End to end through the HTTP API: the OpenAI provider, HTTP and MCP tools, faults,
/// approvals, prompt injection, secret canaries and the retry-amplification figure.
mod e2e;
/// Model and tool calls that fail or run long: bounded generations, retries by class,
/// progress by results.
mod failures;
/// Fake OpenAI-compatible server and recording HTTP tool server.
mod fakes;
/// The stored checkpoint format across upgrades (golden fixtures).
mod format;
/// Hostile inputs: oversized outputs with secrets, calls cancelled while queued, bodies that
/// are not objects, slow clients.
mod hardening;
/// HTTP tools against the recording tool server.
mod http_tool;
/// The tenant-isolation matrix, generated from `api::ROUTES`.
mod isolation;
/// Long-running HTTP tools: `202` + polling, the callback route, restart, cancel, deadline.
mod long_running;
/// MCP tools against the npm reference server.
mod mcp;
/// Several daemons on one Redis: node identity, controls through any node, takeover after
/// SIGKILL and SIGTERM.
mod nodes;
/// The OpenAI-compatible provider against the fake server.
mod openai;
/// The daemon's own OpenAPI document: named schemas, enums, answers that fit, exact strictness.
mod openapi;
/// Run ownership on real daemon processes: controls in inbox order, store outages as pauses.
mod ownership;
/// A store wrapper whose lease renewals fail, as behind a partition.
mod partition;
/// Scopes × tools × routes, approver roles, agents per tenant, injection against guards,
/// result projection, whom tools act for.
mod permissions;
/// `read_output`: a cut tool output read back whole in pages, other runs' references refused;
/// a condensed long run keeps its place in a cassette.
mod read_output;
/// A run against a real small model, when `AGENTD_REAL_MODEL_URL` is set (else skipped).
mod real_model;
/// Store-test helpers: builders, Redis namespaces, a private redis-server.
mod redis_support;
/// The core runtime through `RuntimeHandle`.
mod runtime;
/// SIGTERM on a real child process.
mod shutdown;
/// SSE streaming and resume with `Last-Event-ID`.
mod sse;
/// One contract suite for the memory, file and Redis stores.
mod store_contract;
/// Runtime harness: in-process runtime on the memory store.
mod support;
/// OpenTelemetry traces over OTLP/HTTP against a receiver in the test.
mod telemetry;
/// Docs and code stay in step: module docs, the codemap, a pure core, no stubs.
mod tidy;
/// A tool that keeps failing waits for an operator (retry, skip, fail); permission errors of
/// tools.
mod tool_failing;
