//! One run's lifecycle: the pure core (`state`, `machine`, `decision`, `budget`, `progress`,
//! `verify`) and the actors that carry out its effects (`actor`, `supervisor`).

pub mod actor;
pub mod budget;
pub mod decision;
pub mod machine;
pub mod progress;
pub mod state;
pub mod supervisor;
pub mod verify;

pub use budget::{Budget, Usage};
pub use machine::{Effect, InvalidTransition, Policy, RunEvent, StepContext, Transition, step};
pub use state::{CallStatus, PendingCall, Phase, RunError, RunState, Status};
