//! One run's lifecycle as pure functions: `state`, `machine`, `decision`, `guard`, `budget`,
//! `progress`, `verify`. Nothing under `run/` does I/O; the actors that carry out effects live in `runtime/`.

pub mod budget;
pub mod decision;
pub mod format;
pub mod guard;
pub mod machine;
pub mod progress;
pub mod read_output;
pub mod state;
pub mod verify;

pub use budget::{Budget, Usage};
pub use machine::{
    ControlStep, Effect, InvalidTransition, Policy, RunEvent, StepContext, Transition,
    apply_control, step,
};
pub use state::{
    CallStatus, ControlRefusal, HoldReason, PendingCall, Phase, RunError, RunState, Status,
};
