//! agentd: the runtime under the agent. The model proposes; agentd decides, executes, records
//! and verifies.
//!
//! Layout (see ARCHITECTURE.md for the full map):
//! - `run`: the pure run state machine (no I/O); `runtime`: the actors that carry out its
//!   effects, the supervisor, leases and ownership;
//! - `model`, `tool`: providers, tools and the shared rate-limited pools;
//! - `store`: checkpoints, leases, control inbox and event logs;
//! - `ids`, `idempotency`, `clock`: small shared pieces.

#![warn(missing_docs)]

pub mod agent;
pub mod api;
pub mod bench;
pub mod cli;
pub mod clock;
pub mod config;
pub mod config_duration;
pub mod context;
pub mod daemon;
pub mod hub;
pub mod idempotency;
pub mod ids;
pub mod metrics;
pub mod model;
pub mod pool;
pub mod redact;
pub mod run;
pub mod runtime;
pub mod store;
pub mod telemetry;
pub mod tool;
