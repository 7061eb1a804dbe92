//! The run state machine: one pure transition function, `step(state, event, context)`.
//!
//! No I/O, no clock reads, no randomness: `context` carries `now_ms`, the agent's tool catalog
//! and the policy; backoff jitter is derived from the run id and attempt. The actor carries out
//! the returned effects after the new state and its one event are committed.
//!
//! On `Err` the state is left exactly as it was.
//!
//! ## Transition table
//!
//! `*` is any non-terminal status. "next turn" = deliver queued input, check the model budget
//! (turns, tokens, deadline), then `running/awaiting_model` + `CallModel`; when turns or tokens
//! ran out (or a batch would pass the tool-call budget, whose calls are then answered "not
//! run"), the next turn is the **reserve**: one model call without tools, after which the run
//! ends `failed` (`budget_exceeded`) with that reply's answer as its `output`; with the
//! deadline passed or the reserve spent, `failed` (`budget_exceeded`) at once. "advance batch" = if any call awaits an operator → wait for
//! the calls still in flight, then `waiting_approval`; else dispatch `ready` calls
//! (`ExecuteTool`) → `running/executing_tools`; else wait for in-flight calls
//! (`executing_tools`, `reconciling`, then `awaiting_tool` while only calls accepted by their
//! tool wait for a result); else (all done)
//! append the tool messages, run no-progress detection (continue, nudge, force final, or
//! `failed`/`no_progress`) and take the next turn.
//!
//! "judge the result" = a final result of a call that ran: a success clears its tool's failure
//! count; a `permission` error (401/403) ends the run `failed` (`permission_denied`), or — with
//! the tool's `on_permission_error = "operator"` — **holds** the call (reason
//! `permission_error`); a `retryable`, `failed`, `timeout` or `outcome_unknown` error counts
//! one more failure of the tool in a row, and the tool's `max_failures`-th (default 3; 0 =
//! never) holds the call (reason `tool_failing`) and resets the no-progress failure and stale
//! streaks (the operator's decision replaces that escalation); anything else answers the
//! model. A held call is `awaiting_approval` with its last result kept: approve runs it again
//! (same key), reject answers the model `skipped` (and the tool's failure count starts over),
//! fail ends the run; its approval expiry is its tool's, as for any approval.
//!
//! | from | event | to | effects | event type |
//! |---|---|---|---|---|
//! | created | Start | next turn | CallModel | run_started |
//! | created | Resume | next turn | CallModel | run_resumed |
//! | created, running, waiting_approval | Input | same | — | input_queued |
//! | running/awaiting_model | ModelReplied: final | running/verifying | Verify | model_replied |
//! | running/awaiting_model | ModelReplied in the reserve turn | failed (`budget_exceeded`, output = its answer) | AbortInFlight, Finish | run_failed |
//! | running/awaiting_model | ModelReplied: tool calls | validating_calls → advance batch | ExecuteTool… | model_replied |
//! | running/awaiting_model | ModelReplied: ask_user | waiting_input | — | input_requested |
//! | running/awaiting_model | ModelReplied: malformed | next turn with a correction, or failed (`invalid_model_output`) | CallModel | model_replied |
//! | running/awaiting_model | ModelFailed: overloaded | same, or failed (`model_unavailable`) | ScheduleRetry | model_failed |
//! | running/awaiting_model | ModelFailed: context_length_exceeded | same (context rebuilt smaller, once), or failed (`context_length_exceeded`) | CallModel | model_failed |
//! | running/awaiting_model | ModelFailed: other (the gateway gave up) | failed (`model_unavailable`, `model_rejected`) | AbortInFlight, Finish | run_failed |
//! | running/awaiting_model | RetryDue | same | CallModel | model_retry |
//! | running/executing_tools | ToolFinished | judge the result, then advance batch (unknown outcome: resend, reconcile or park; held: `waiting_approval`; permission error: failed `permission_denied`) | … | tool_call_finished |
//! | running/executing_tools | ToolRetrying (the executor retries the dispatched call) | same | — | tool_retrying |
//! | running/awaiting_model | ModelRetrying (the gateway retries the request) | same | — | model_retrying |
//! | running/executing_tools | RetryDue | advance batch | ExecuteTool… | tool_retry |
//! | running/reconciling | StatusChecked | advance batch | … | call_reconciled |
//! | running/executing_tools | ToolAccepted (call dispatched) | advance batch, the call `awaiting_result` (status URL, deadline = now + `timeout_ms`); nothing else in flight → running/awaiting_tool | PollTool, … | tool_call_accepted |
//! | running, waiting_approval | ToolPolled (call awaiting its result) | advance batch, the polled result judged ("judge the result") | … | tool_call_finished (`via: poll`) |
//! | running, waiting_approval | CallbackResult (call dispatched or awaiting its result) | advance batch, the tool's result judged (first result wins) | … | tool_call_finished (`via: callback`) |
//! | running, waiting_approval | CallDeadline (call awaiting its result) | advance batch, a `timeout` error judged | … | tool_call_finished (`via: deadline`) |
//! | * | CallbackResult for a call that already has its result (`apply_control`) | same, the control consumed | — | late_result_ignored |
//! | running/verifying | VerificationDone: ok | succeeded | Finish | run_succeeded |
//! | running/verifying | VerificationDone: rejected | next turn, or failed (`verification_failed`) | CallModel | verification_rejected |
//! | waiting_approval | Approve | advance batch (a held call runs again) | ExecuteTool… | call_approved |
//! | waiting_approval | Reject | advance batch (a held call is answered `skipped`) | … | call_rejected |
//! | waiting_approval | Fail (operator decision `fail`) | failed (`tool_failing`, `permission_denied`, `outcome_unknown` or `approval_denied`, by why the call waited) | AbortInFlight, Finish | run_failed |
//! | waiting_approval | ApprovalExpired (call still awaiting) | advance batch, the call approved or rejected by its tool's `on_approval_timeout` | ExecuteTool… | approval_expired |
//! | waiting_input | Input | next turn | CallModel | input_received |
//! | running, waiting_* | Resume | re-issue in-flight work by tool policy; accepted calls are polled again, never resent | CallModel / ExecuteTool / CheckStatus / PollTool / Verify | run_resumed |
//! | * | Cancel | cancelled | AbortInFlight, Finish | run_cancelled |
//! | * | a control that does not fit (`apply_control`) | same, the control consumed | — | control_refused |
//! | * | Abort | failed (given code) | AbortInFlight, Finish | run_failed |
//! | * | DeadlineReached | failed (`budget_exceeded`) | AbortInFlight, Finish | run_failed |
//! | * | any transition above that would end the run `cancelled` or `failed` while a compensation is pending | running/compensating, the end kept in `ending` | AbortInFlight, Compensate (the newest) | compensation_started (`cause` = the type it would have had) |
//! | running/compensating | ToolFinished (of the compensation in flight) | the next compensation, or the recorded end | Compensate, or Finish | compensation_finished; the last one the terminal type (`cause` = compensation_finished) |
//! | running/compensating | ToolRetrying (the executor retries it) | same | — | compensation_retrying |
//! | running/compensating | RetryDue (after `overloaded`) | same | Compensate | compensation_retry |
//! | running/compensating | StatusChecked | the next compensation, or the recorded end | Compensate / Finish | compensation_reconciled |
//! | running/compensating | Resume | resend the one in flight (read/idempotent, same key), reconcile it, or `outcome_unknown` | Compensate / CheckCompensation | run_resumed |
//! | running/compensating | Abort | failed (given code); compensations not run `skipped` | AbortInFlight, Finish | run_failed |
//! | running/compensating | DeadlineReached (budgets do not block compensation) | same | — | late_result_ignored |
//! | running/compensating | Cancel (ending `cancelled`: repeated, like the first); any other control | same | — | control_refused |
//! | * | a reply with a stale epoch or for another phase | same | — | late_result_ignored |
//! | succeeded, failed, cancelled | a pool or timer reply | same | — | late_result_ignored |
//!
//! "compensation": a call of a tool with a `compensate` rule that succeeded recorded its
//! compensating call (`RunState::compensations`, `pending`); a run that succeeds drops them.
//! The compensating phase and its rules are in `machine::compensate`.
//!
//! Every other (status, event) pair is `Err(InvalidTransition)`. A transition that ends the run
//! records the terminal event type (`run_succeeded`, `run_failed`, `run_cancelled`) with the
//! type it would otherwise have had as `data.cause`, so a log has exactly one terminal event.
//! A run that compensates records it after its last compensation, never before.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::budget::{self, Exhausted};
use super::decision::{Decision, decide};
use super::guard::{Guard, OnPermissionDenied};
use super::progress::{CallOutcome, ProgressPolicy, Verdict};
use super::state::{
    CallStatus, CallTask, ControlRefusal, HoldReason, MAX_CONTROL_REFUSALS, PendingCall, Phase,
    RunError, RunState, Status,
};
use crate::idempotency::{call_fingerprint, idempotency_key};
use crate::ids::CallId;
use crate::model::{Message, ModelError, ModelErrorKind, ModelReply, ToolChoice};
use crate::store::Control;
use crate::tool::{
    ApprovalTimeoutAction, DEFAULT_MAX_FAILURES, OnPermissionError, ToolEffect, ToolError,
    ToolErrorCode, ToolResult,
};

/// What happens to a run. Pool replies and timers carry the epoch they were issued with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum RunEvent {
    /// A `created` run takes its first turn.
    Start,
    /// The run's actor was (re)started from a checkpoint of a non-terminal run.
    Resume,
    /// The model gateway's reply to `CallModel`.
    ModelReplied {
        /// The epoch of the request it answers; an older one than the run's is stale.
        epoch: u64,
        /// The raw reply; the machine turns it into one `Decision`.
        reply: ModelReply,
    },
    /// The gateway gave up on a `CallModel` request (its own retries are over), or shed it
    /// as `overloaded`.
    ModelFailed {
        /// The epoch of the request it answers; an older one than the run's is stale.
        epoch: u64,
        /// The final, classified failure.
        error: ModelError,
    },
    /// The delay of a `ScheduleRetry` has passed.
    RetryDue {
        /// The epoch of the `ScheduleRetry`; an older one than the run's is stale.
        epoch: u64,
    },
    /// The model gateway is about to try the request again after a failed attempt (its own
    /// retries, reported so the run's record shows why it is slow). Changes nothing else.
    ModelRetrying {
        /// The epoch of the request it answers; an older one than the run's is stale.
        epoch: u64,
        /// The attempt that failed (from 1).
        attempt: u32,
        /// Why the attempt failed.
        error: ModelError,
        /// How long the gateway waits before the next attempt.
        wait_ms: u64,
    },
    /// The tool executor is about to send `call_id` again (same key) after a transient failure.
    /// Changes nothing else: the model never hears of a retried call that then succeeds.
    ToolRetrying {
        /// The epoch of the request it answers; an older one than the run's is stale.
        epoch: u64,
        /// The dispatched call that is sent again.
        call_id: CallId,
        /// The attempt that failed (from 1).
        attempt: u32,
        /// Why it failed (redacted, message cut).
        error: ToolError,
        /// How long the executor waits before the next attempt, in ms.
        wait_ms: u64,
    },
    /// The tool pool's final result for the dispatched call `call_id` (after the executor's
    /// retries).
    ToolFinished {
        /// The epoch of the request it answers; an older one than the run's is stale.
        epoch: u64,
        /// The call it answers.
        call_id: CallId,
        /// Its result: data, or a classified error.
        result: ToolResult,
    },
    /// The answer to `CheckStatus`: whether the call with the key of `call_id` already ran.
    StatusChecked {
        /// The epoch of the request it answers; an older one than the run's is stale.
        epoch: u64,
        /// The reconciled call.
        call_id: CallId,
        /// `Ok(Some(result))`: it ran, with this result; `Ok(None)`: it never ran (it is sent
        /// now, same key); `Err`: the tool could not tell (the outcome stays unknown).
        outcome: Result<Option<ToolResult>, ToolError>,
    },
    /// The answer to `Verify`.
    VerificationDone {
        /// The epoch of the request it answers; an older one than the run's is stale.
        epoch: u64,
        /// `Ok`: every verifier accepted the candidate; `Err(reason)`: the first rejection,
        /// which goes back to the model.
        verdict: Result<(), String>,
    },
    /// An operator cancels the run.
    Cancel {
        /// Why, as given; recorded in the event.
        reason: Option<String>,
    },
    /// An operator approves `call_id`, a call waiting for a decision (approval, hold, or
    /// unknown outcome): it is sent (again).
    Approve {
        /// The call decided on.
        call_id: CallId,
        /// Edited arguments to run instead, checked by the tool's schema, deny and path
        /// rules (a new key); `None`: as proposed.
        arguments: Option<Value>,
        /// Who decided: the token's configured name (recorded in the event).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        by: Option<String>,
    },
    /// An operator rejects `call_id`: it is not sent, and the model is told.
    Reject {
        /// The call decided on.
        call_id: CallId,
        /// Why; the model gets it in the refusal (an approval's, or a held call's `skipped`).
        reason: Option<String>,
        /// Who decided: the token's configured name (recorded in the event).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        by: Option<String>,
    },
    /// Operator input: the answer to a pending `ask_user` question, or else queued for the
    /// next turn.
    Input {
        /// The text, given to the model as a user message (as `{"answer": …}` to a question).
        text: String,
    },
    /// An operator's decision `fail` on a call waiting for one: the run ends `failed`.
    Fail {
        /// The call waiting for an operator.
        call_id: CallId,
        /// Why; appended to the run's error message.
        reason: Option<String>,
        /// Who decided: the token's configured name (recorded in the event).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        by: Option<String>,
    },
    /// The run's deadline (`Budget::deadline_ms`) passed: it fails `budget_exceeded`.
    DeadlineReached,
    /// The approval timer of `call_id` fired (armed by the actor from the tool's
    /// `approval_timeout`); a call already decided ignores it.
    ApprovalExpired {
        /// The call whose timer fired.
        call_id: CallId,
    },
    /// Ends the run as failed from outside (e.g. the supervisor's `crash_loop`).
    Abort {
        /// The code of the run's error (`RunError::code`).
        code: String,
        /// The message of the run's error.
        message: String,
    },
    /// The tool accepted the dispatched call `call_id` to finish it later (`202 Accepted`):
    /// poll `status_url` (if any) until `timeout_ms` from now, the call's own deadline.
    ToolAccepted {
        /// The epoch of the request it answers; an older one than the run's is stale.
        epoch: u64,
        /// The dispatched call the tool accepted.
        call_id: CallId,
        /// Where its status is polled; `None`: the tool only calls back.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        status_url: Option<String>,
        /// The call's deadline from now, in ms (the tool's `task_timeout`, else `timeout`).
        timeout_ms: u64,
    },
    /// A poll of the accepted call `call_id` got its final answer (`200` with the result, or a
    /// `4xx` failure). "Still running" and transient failures never reach the machine.
    ToolPolled {
        /// The epoch of the request it answers; an older one than the run's is stale.
        epoch: u64,
        /// The accepted call that was polled.
        call_id: CallId,
        /// Its final result.
        result: ToolResult,
    },
    /// The tool completed `call_id` through the callback route (a control from the inbox;
    /// the API checked the call's token before storing it).
    CallbackResult {
        /// The call the tool completed.
        call_id: CallId,
        /// The result the tool posted.
        result: ToolResult,
    },
    /// The deadline of the accepted call `call_id` passed without a result.
    CallDeadline {
        /// The epoch of the `PollTool` that armed the deadline; an older one is stale.
        epoch: u64,
        /// The accepted call whose deadline passed.
        call_id: CallId,
    },
}

impl RunEvent {
    /// The event's snake_case name, for errors and `control_refused` events.
    pub fn name(&self) -> &'static str {
        match self {
            RunEvent::Start => "start",
            RunEvent::Resume => "resume",
            RunEvent::ModelReplied { .. } => "model_replied",
            RunEvent::ModelFailed { .. } => "model_failed",
            RunEvent::RetryDue { .. } => "retry_due",
            RunEvent::ModelRetrying { .. } => "model_retrying",
            RunEvent::ToolRetrying { .. } => "tool_retrying",
            RunEvent::ToolFinished { .. } => "tool_finished",
            RunEvent::StatusChecked { .. } => "status_checked",
            RunEvent::VerificationDone { .. } => "verification_done",
            RunEvent::Cancel { .. } => "cancel",
            RunEvent::Approve { .. } => "approve",
            RunEvent::Reject { .. } => "reject",
            RunEvent::Input { .. } => "input",
            RunEvent::Fail { .. } => "fail",
            RunEvent::DeadlineReached => "deadline_reached",
            RunEvent::ApprovalExpired { .. } => "approval_expired",
            RunEvent::Abort { .. } => "abort",
            RunEvent::ToolAccepted { .. } => "tool_accepted",
            RunEvent::ToolPolled { .. } => "tool_polled",
            RunEvent::CallbackResult { .. } => "callback_result",
            RunEvent::CallDeadline { .. } => "call_deadline",
        }
    }

    /// Replies from pools and timers (as opposed to control messages).
    fn is_reply(&self) -> bool {
        matches!(
            self,
            RunEvent::ModelReplied { .. }
                | RunEvent::ModelFailed { .. }
                | RunEvent::RetryDue { .. }
                | RunEvent::ModelRetrying { .. }
                | RunEvent::ToolRetrying { .. }
                | RunEvent::ToolFinished { .. }
                | RunEvent::StatusChecked { .. }
                | RunEvent::VerificationDone { .. }
                | RunEvent::DeadlineReached
                | RunEvent::ApprovalExpired { .. }
                | RunEvent::ToolAccepted { .. }
                | RunEvent::ToolPolled { .. }
                | RunEvent::CallDeadline { .. }
        )
    }
}

impl From<Control> for RunEvent {
    fn from(c: Control) -> Self {
        match c {
            Control::Cancel { reason } => RunEvent::Cancel { reason },
            Control::Approve {
                call_id,
                arguments,
                by,
            } => RunEvent::Approve {
                call_id,
                arguments,
                by,
            },
            Control::Reject {
                call_id,
                reason,
                by,
            } => RunEvent::Reject {
                call_id,
                reason,
                by,
            },
            Control::Input { text } => RunEvent::Input { text },
            Control::CallResult { call_id, result } => RunEvent::CallbackResult { call_id, result },
            Control::Fail {
                call_id,
                reason,
                by,
            } => RunEvent::Fail {
                call_id,
                reason,
                by,
            },
        }
    }
}

/// Work the actor must carry out after committing the transition.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Build the run's context from the committed state and send one model request.
    CallModel {
        /// The epoch its reply must carry.
        epoch: u64,
        /// `None` on a forced final or reserve turn: no tools are offered.
        tool_choice: ToolChoice,
    },
    /// Send the batch call `call_id` (its intent is in the committed state).
    ExecuteTool {
        /// The epoch its reply must carry.
        epoch: u64,
        /// The call of `RunState::calls` to send.
        call_id: CallId,
    },
    /// Ask the tool whether the call with this key already ran.
    CheckStatus {
        /// The epoch its reply must carry.
        epoch: u64,
        /// The call of `RunState::calls` being reconciled.
        call_id: CallId,
    },
    /// Run the agent's verifiers on a candidate final answer.
    Verify {
        /// The epoch its reply must carry.
        epoch: u64,
        /// The answer: its JSON if the text is a JSON object or array, else the text.
        candidate: Value,
    },
    /// Deliver `RetryDue { epoch }` after a delay.
    ScheduleRetry {
        /// The epoch `RetryDue` must carry.
        epoch: u64,
        /// The delay, in ms.
        after_ms: u64,
    },
    /// Send the compensating call `call_id` (its intent is in `RunState::compensations`).
    Compensate {
        /// The epoch its reply must carry.
        epoch: u64,
        /// The `Compensation::call_id` to send.
        call_id: CallId,
    },
    /// Ask the compensating tool whether the compensating call `call_id` already ran.
    CheckCompensation {
        /// The epoch its reply must carry.
        epoch: u64,
        /// The `Compensation::call_id` being reconciled.
        call_id: CallId,
    },
    /// Poll the accepted call `call_id` (its `task` is in the committed state) with backoff
    /// until it has a result, and deliver `CallDeadline` at its deadline.
    PollTool {
        /// The epoch its replies (and `CallDeadline`) must carry.
        epoch: u64,
        /// The call of `RunState::calls` awaiting its result.
        call_id: CallId,
    },
    /// Cancel every request in flight for this run.
    AbortInFlight,
    /// The run is over: stop its actor.
    Finish,
}

/// The outcome of one step: the event to record and the effects to carry out.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    /// Event type, snake_case.
    pub kind: &'static str,
    /// Event data; always has `status` and `phase` after the transition.
    pub data: Value,
    /// Work to carry out, in order, once the transition is committed.
    pub effects: Vec<Effect>,
}

/// An event that does not fit the run's current state. Nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct InvalidTransition {
    /// `invalid_state`, `unknown_call`, `invalid_argument` or `input_queue_full`.
    pub code: &'static str,
    /// What did not fit, in one sentence.
    pub message: String,
    /// The run's status when the event came.
    pub status: Status,
}

/// How the catalog sees a tool name for this agent.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolLookup {
    /// On the agent's list: the tool's policy facts.
    Allowed(ToolInfo),
    /// Registered, but not on this agent's allow-list.
    NotAllowed,
    /// No tool of that name is registered.
    Unknown,
}

/// The policy facts of one tool that the machine needs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ToolInfo {
    /// What a call does to the world (decides resend, reconcile or park after a crash).
    pub effect: ToolEffect,
    /// Repeated calls are not counted as no progress (`ToolSpec::polling`).
    pub polling: bool,
    /// The tool can say whether a call with a given key ran (`ToolSpec::reconcilable`).
    pub reconcilable: bool,
}

/// A schema violation, with the JSON pointer of the failing value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArgumentError {
    /// JSON Pointer of the failing value (`""`: the whole arguments object).
    pub path: String,
    /// What is wrong there (the validator's message).
    pub message: String,
}

/// The tools of one agent, as the pure core sees them. Implementations must be deterministic.
pub trait ToolCatalog {
    /// Whether `name` is a tool this agent may call, and its policy facts.
    fn lookup(&self, name: &str) -> ToolLookup;
    /// Checks arguments against the tool's JSON Schema.
    fn validate(&self, name: &str, arguments: &Value) -> Result<(), ArgumentError>;
    /// Whether this call needs an operator's approval (may depend on the arguments).
    fn needs_approval(&self, name: &str, arguments: &Value) -> bool;
    /// Whether the agent may ask the user (`ask_user`); when not, such a call is answered as
    /// a correction.
    fn offers_ask_user(&self) -> bool {
        true
    }
    /// The decision taken for a call of `name` whose approval expired (default: reject).
    fn on_approval_timeout(&self, name: &str) -> ApprovalTimeoutAction {
        let _ = name;
        ApprovalTimeoutAction::Reject
    }
    /// The tool's permissions, argument rules and result projection (default: none).
    fn guard(&self, name: &str) -> Option<&Guard> {
        let _ = name;
        None
    }
    /// Calls of `name` failing in a row (in one run) before the run waits for an operator
    /// with reason `tool_failing`; 0 = never.
    fn max_failures(&self, name: &str) -> u32 {
        let _ = name;
        DEFAULT_MAX_FAILURES
    }
    /// What a 401/403 answer of `name` does (default: the run fails `permission_denied`).
    fn on_permission_error(&self, name: &str) -> OnPermissionError {
        let _ = name;
        OnPermissionError::Fail
    }
    /// The call that undoes a successful call of `name`, with the compensating tool's facts
    /// (default: none). The compensating tool need not be on the agent's list.
    fn compensation(&self, name: &str) -> Option<CompensationPlan<'_>> {
        let _ = name;
        None
    }
}

/// How a successful call of one tool is undone (see `machine::compensate`).
#[derive(Debug, Clone, Copy)]
pub struct CompensationPlan<'a> {
    /// The tool's `compensate` rule: the compensating tool and its argument mapping.
    pub rule: &'a crate::tool::Compensate,
    /// The compensating tool's policy facts.
    pub info: ToolInfo,
    /// The compensating tool's deny and path rules (its scopes are not checked: it undoes
    /// what the run was allowed to do).
    pub guard: Option<&'a Guard>,
}

/// Bounds the machine enforces besides the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// Malformed replies in a row before `invalid_model_output`.
    pub max_corrections: u32,
    /// `overloaded` replies (the model pool's queue was full) in a row before
    /// `model_unavailable`. Provider faults are retried by the gateway, not here.
    pub max_model_retries: u32,
    /// Verifier rejections before `verification_failed`.
    pub max_verify_rejections: u32,
    /// Resends of an idempotent call with an unknown outcome, or of an overloaded call.
    pub max_tool_retries: u32,
    /// Backoff before the first retry (model `overloaded`, tool `overloaded`), in ms;
    /// doubled per attempt, ±20 % jitter.
    pub retry_base_ms: u64,
    /// Cap of one backoff, in ms.
    pub retry_max_ms: u64,
    /// Input messages held for a busy run.
    pub max_queued_input: usize,
    /// Thresholds of no-progress detection.
    pub progress: ProgressPolicy,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            max_corrections: 3,
            max_model_retries: 5,
            max_verify_rejections: 3,
            max_tool_retries: 3,
            retry_base_ms: 200,
            retry_max_ms: 10_000,
            max_queued_input: 32,
            progress: ProgressPolicy::default(),
        }
    }
}

/// Everything besides the state and the event that a step may look at.
pub struct StepContext<'a> {
    /// The current time, ms since the Unix epoch (the step reads no clock).
    pub now_ms: u64,
    /// Bounds besides the budget.
    pub policy: &'a Policy,
    /// The agent's tools.
    pub tools: &'a dyn ToolCatalog,
}

/// Capped exponential backoff with ±20 % jitter derived from `seed` (no randomness, so the
/// step stays deterministic).
pub fn backoff_ms(policy: &Policy, attempt: u32, seed: &str) -> u64 {
    let exp = policy
        .retry_base_ms
        .saturating_mul(1u64 << attempt.saturating_sub(1).min(20));
    let base = exp.min(policy.retry_max_ms);
    let h = call_fingerprint(seed, &json!(attempt));
    let frac = (h % 1000) as f64 / 1000.0; // 0..1
    ((base as f64) * (0.8 + 0.4 * frac)) as u64
}

const NOTE: &str = "[agentd]";

/// Applies `event` to `state`. See the module doc for the table.
pub fn step(
    state: &mut RunState,
    event: RunEvent,
    cx: &StepContext<'_>,
) -> Result<Transition, InvalidTransition> {
    let was_terminal = state.is_terminal();
    let was_compensating = state.phase == Some(Phase::Compensating);
    let mut t = if was_terminal {
        if !event.is_reply() {
            return Err(invalid(
                state,
                "invalid_state",
                format!(
                    "run is {}; it accepts no {}",
                    state.status.as_str(),
                    event.name()
                ),
            ));
        }
        ignored(&event, "run_terminal")
    } else {
        dispatch(state, event, cx)?
    };
    if !was_terminal && !was_compensating && state.is_terminal() {
        compensate::on_end(state, &mut t, cx);
    }
    if !was_terminal && state.is_terminal() {
        let terminal_kind = match state.status {
            Status::Succeeded => "run_succeeded",
            Status::Cancelled => "run_cancelled",
            _ => "run_failed",
        };
        if t.kind != terminal_kind {
            if let Value::Object(m) = &mut t.data {
                m.insert("cause".into(), Value::String(t.kind.to_owned()));
            }
            t.kind = terminal_kind;
        }
        if let (Value::Object(m), Some(e)) = (&mut t.data, &state.error) {
            m.insert("error".into(), json!(e));
        }
    }
    if let Value::Object(m) = &mut t.data {
        m.insert("status".into(), json!(state.status.as_str()));
        m.insert("phase".into(), json!(state.phase.map(Phase::as_str)));
    }
    state.version += 1;
    state.updated_at_ms = cx.now_ms;
    Ok(t)
}

/// What one control from the run's inbox does to the run.
#[derive(Debug, Clone, PartialEq)]
pub enum ControlStep {
    /// It applied: commit this transition (it has already consumed the control).
    Applied(Transition),
    /// The same decision was already taken (a repeated approval or rejection, a cancel of a
    /// cancelled run): the control is consumed and answered like the first one; nothing to
    /// commit on its own.
    Repeated,
    /// It does not fit the run: consumed and answered with the error. With a transition
    /// (`control_refused`) to commit, so the answer survives a crash; a finished run commits
    /// nothing (its terminal event stays its last one).
    Refused(Option<Transition>, InvalidTransition),
}

/// Applies the control stored at inbox position `seq`. Controls must be applied strictly in
/// inbox order, each once: `seq` must be the next one after `controls_applied`.
pub fn apply_control(
    state: &mut RunState,
    seq: u64,
    control: Control,
    cx: &StepContext<'_>,
) -> ControlStep {
    debug_assert!(
        seq > state.controls_applied,
        "controls apply in inbox order"
    );
    if is_repeat(state, &control) {
        state.controls_applied = seq;
        return ControlStep::Repeated;
    }
    let event = RunEvent::from(control);
    let name = event.name();
    match step(state, event, cx) {
        Ok(mut t) => {
            state.controls_applied = seq;
            if let Value::Object(m) = &mut t.data {
                m.insert("control_seq".into(), json!(seq));
            }
            ControlStep::Applied(t)
        }
        Err(e) => {
            state.controls_applied = seq;
            if state.is_terminal() {
                return ControlStep::Refused(None, e);
            }
            state.control_refusals.push(ControlRefusal {
                seq,
                code: e.code.to_owned(),
                message: e.message.clone(),
            });
            let excess = state
                .control_refusals
                .len()
                .saturating_sub(MAX_CONTROL_REFUSALS);
            state.control_refusals.drain(..excess);
            state.version += 1;
            state.updated_at_ms = cx.now_ms;
            // A tool's result for a call that already has one (or no longer waits) is late.
            let kind = if name == "callback_result" {
                "late_result_ignored"
            } else {
                "control_refused"
            };
            let t = out(
                kind,
                json!({
                    "control": name, "control_seq": seq, "code": e.code, "message": e.message,
                    "status": state.status.as_str(), "phase": state.phase.map(Phase::as_str),
                }),
                vec![],
            );
            ControlStep::Refused(Some(t), e)
        }
    }
}

/// Whether `control` repeats a decision the run already took.
fn is_repeat(state: &RunState, control: &Control) -> bool {
    match control {
        Control::Cancel { .. } => {
            state.status == Status::Cancelled
                || state
                    .ending
                    .as_ref()
                    .is_some_and(|e| e.status == Status::Cancelled)
        }
        Control::Approve { call_id, .. } => state.decided.contains(&(call_id.clone(), true)),
        Control::Reject { call_id, .. } => state.decided.contains(&(call_id.clone(), false)),
        Control::Fail { call_id, .. } => state.failed_call.as_ref() == Some(call_id),
        Control::Input { .. } | Control::CallResult { .. } => false,
    }
}

fn invalid(state: &RunState, code: &'static str, message: String) -> InvalidTransition {
    InvalidTransition {
        code,
        message,
        status: state.status,
    }
}

fn ignored(event: &RunEvent, reason: &str) -> Transition {
    let mut data = Map::new();
    data.insert("reason".into(), json!(reason));
    data.insert("ignored".into(), json!(event.name()));
    match event {
        RunEvent::ToolFinished {
            call_id, result, ..
        } => {
            data.insert("call_id".into(), json!(call_id));
            data.insert("ok".into(), json!(result.ok));
        }
        RunEvent::ApprovalExpired { call_id } => {
            data.insert("call_id".into(), json!(call_id));
        }
        RunEvent::ToolAccepted { epoch, call_id, .. }
        | RunEvent::CallDeadline { epoch, call_id } => {
            data.insert("call_id".into(), json!(call_id));
            data.insert("epoch".into(), json!(epoch));
        }
        RunEvent::ToolPolled {
            epoch,
            call_id,
            result,
        } => {
            data.insert("call_id".into(), json!(call_id));
            data.insert("epoch".into(), json!(epoch));
            data.insert("ok".into(), json!(result.ok));
        }
        RunEvent::ToolRetrying { epoch, call_id, .. } => {
            data.insert("call_id".into(), json!(call_id));
            data.insert("epoch".into(), json!(epoch));
        }
        RunEvent::ModelReplied { epoch, .. }
        | RunEvent::ModelRetrying { epoch, .. }
        | RunEvent::ModelFailed { epoch, .. }
        | RunEvent::RetryDue { epoch }
        | RunEvent::StatusChecked { epoch, .. }
        | RunEvent::VerificationDone { epoch, .. } => {
            data.insert("epoch".into(), json!(epoch));
        }
        _ => {}
    }
    Transition {
        kind: "late_result_ignored",
        data: Value::Object(data),
        effects: vec![],
    }
}

fn out(kind: &'static str, data: Value, effects: Vec<Effect>) -> Transition {
    Transition {
        kind,
        data,
        effects,
    }
}

fn dispatch(
    s: &mut RunState,
    event: RunEvent,
    cx: &StepContext<'_>,
) -> Result<Transition, InvalidTransition> {
    use RunEvent as E;
    let phase = s.phase;
    if phase == Some(Phase::Compensating) {
        return compensate::dispatch(s, event, cx);
    }
    match (s.status, event) {
        (_, E::Cancel { reason }) => {
            s.status = Status::Cancelled;
            s.phase = None;
            s.epoch += 1;
            Ok(out(
                "run_cancelled",
                json!({ "reason": reason }),
                vec![Effect::AbortInFlight, Effect::Finish],
            ))
        }
        (_, E::Abort { code, message }) => {
            let effects = fail(s, RunError { code, message });
            Ok(out("run_failed", json!({}), effects))
        }
        (_, E::DeadlineReached) => {
            let effects = fail_budget(s, Exhausted::Deadline);
            Ok(out("run_failed", json!({}), effects))
        }
        (Status::Created, E::Start) => Ok(next_turn(s, cx, "run_started", json!({}))),
        (Status::Created, E::Resume) => {
            s.restarts += 1;
            Ok(next_turn(s, cx, "run_resumed", json!({})))
        }
        (Status::Created | Status::Running | Status::WaitingApproval, E::Input { text }) => {
            if s.queued_input.len() >= cx.policy.max_queued_input {
                return Err(invalid(
                    s,
                    "input_queue_full",
                    format!("{} inputs are already queued", s.queued_input.len()),
                ));
            }
            s.queued_input.push(text);
            Ok(out(
                "input_queued",
                json!({ "queued": s.queued_input.len() }),
                vec![],
            ))
        }
        (Status::WaitingInput, E::Input { text }) => {
            let Some((question, model_call_id)) = s.question.take() else {
                return Err(invalid(s, "invalid_state", "no question is pending".into()));
            };
            s.messages.push(Message::Tool {
                call_id: model_call_id,
                content: ToolResult::success(json!({ "answer": text })).to_message_content(),
            });
            Ok(next_turn(
                s,
                cx,
                "input_received",
                json!({ "question": question }),
            ))
        }
        (Status::Running, E::Resume) => {
            s.restarts += 1;
            Ok(resume_running(s, cx))
        }
        (Status::WaitingApproval | Status::WaitingInput, E::Resume) => {
            s.restarts += 1;
            // Calls accepted by their tool go on being polled while an operator decides.
            let effects = poll_awaiting(s);
            Ok(out("run_resumed", json!({}), effects))
        }
        (Status::Running, E::ModelReplied { epoch, reply })
            if phase == Some(Phase::AwaitingModel) && epoch == s.epoch =>
        {
            Ok(on_model_reply(s, reply, cx))
        }
        (Status::Running, E::ModelFailed { epoch, error })
            if phase == Some(Phase::AwaitingModel) && epoch == s.epoch =>
        {
            Ok(on_model_failed(s, error, cx))
        }
        (Status::Running, E::RetryDue { epoch })
            if phase == Some(Phase::AwaitingModel) && epoch == s.epoch =>
        {
            s.epoch += 1;
            let tool_choice = tool_choice(s);
            Ok(out(
                "model_retry",
                json!({ "attempt": s.model_retries + 1 }),
                vec![Effect::CallModel {
                    epoch: s.epoch,
                    tool_choice,
                }],
            ))
        }
        (
            Status::Running,
            E::ModelRetrying {
                epoch,
                attempt,
                error,
                wait_ms,
            },
        ) if phase == Some(Phase::AwaitingModel) && epoch == s.epoch => Ok(out(
            "model_retrying",
            json!({
                "attempt": attempt,
                "error": { "kind": error.kind, "message": bounded(&error.message) },
                "wait_ms": wait_ms,
            }),
            vec![],
        )),
        (
            Status::Running,
            E::ToolRetrying {
                epoch,
                call_id,
                attempt,
                error,
                wait_ms,
            },
        ) if phase == Some(Phase::ExecutingTools)
            && epoch == s.epoch
            && s.call(&call_id).map(|c| c.status) == Some(CallStatus::Dispatched) =>
        {
            let tool = s.call(&call_id).map(|c| c.tool.clone());
            Ok(out(
                "tool_retrying",
                json!({
                    "call_id": call_id,
                    "tool": tool,
                    "attempt": attempt,
                    "error": { "code": error.code, "message": bounded(&error.message) },
                    "wait_ms": wait_ms,
                }),
                vec![],
            ))
        }
        (Status::Running, E::RetryDue { epoch })
            if phase == Some(Phase::ExecutingTools) && epoch == s.epoch =>
        {
            let effects = advance_batch(s, cx);
            let mut t = out("tool_retry", json!({}), effects);
            add_dispatched(s, &mut t);
            Ok(t)
        }
        (
            Status::Running,
            E::ToolFinished {
                epoch,
                call_id,
                result,
            },
        ) if phase == Some(Phase::ExecutingTools)
            && epoch == s.epoch
            && s.call(&call_id).map(|c| c.status) == Some(CallStatus::Dispatched) =>
        {
            Ok(on_tool_finished(s, call_id, result, cx))
        }
        (
            Status::Running,
            E::StatusChecked {
                epoch,
                call_id,
                outcome,
            },
        ) if epoch == s.epoch
            && s.call(&call_id).map(|c| c.status) == Some(CallStatus::Reconciling) =>
        {
            let found = match &outcome {
                Ok(Some(_)) => "ran",
                Ok(None) => "never_ran",
                Err(_) => "unknown",
            };
            if let Some(c) = s.calls.iter_mut().find(|c| c.call_id == call_id) {
                match outcome {
                    Ok(Some(result)) => {
                        c.status = CallStatus::Done;
                        c.result = Some(result);
                    }
                    // It never ran: sending it now (same key) is the first execution.
                    Ok(None) => c.status = CallStatus::Ready,
                    Err(_) => c.status = CallStatus::OutcomeUnknown,
                }
            }
            compensate::record(s, &call_id, cx);
            let effects = advance_batch(s, cx);
            let mut t = out(
                "call_reconciled",
                json!({ "call_id": call_id, "found": found }),
                effects,
            );
            add_dispatched(s, &mut t);
            Ok(t)
        }
        (Status::Running, E::VerificationDone { epoch, verdict })
            if phase == Some(Phase::Verifying) && epoch == s.epoch =>
        {
            Ok(on_verified(s, verdict, cx))
        }
        (
            Status::WaitingApproval,
            E::Approve {
                call_id,
                arguments,
                by,
            },
        ) => approve(s, call_id, arguments, by, cx),
        (
            Status::WaitingApproval,
            E::Reject {
                call_id,
                reason,
                by,
            },
        ) => reject(s, call_id, reason, by, cx),
        (
            Status::WaitingApproval,
            E::Fail {
                call_id,
                reason,
                by,
            },
        ) => fail_call(s, call_id, reason, by),
        (Status::WaitingApproval, E::ApprovalExpired { call_id })
            if s.call(&call_id).map(|c| c.status) == Some(CallStatus::AwaitingApproval) =>
        {
            Ok(expire_approval(s, call_id, cx))
        }
        (
            Status::Running,
            E::ToolAccepted {
                epoch,
                call_id,
                status_url,
                timeout_ms,
            },
        ) if phase == Some(Phase::ExecutingTools)
            && epoch == s.epoch
            && s.call(&call_id).map(|c| c.status) == Some(CallStatus::Dispatched) =>
        {
            Ok(on_tool_accepted(s, call_id, status_url, timeout_ms, cx))
        }
        (
            Status::Running | Status::WaitingApproval,
            E::ToolPolled {
                epoch,
                call_id,
                result,
            },
        ) if epoch == s.epoch
            && s.call(&call_id).map(|c| c.status) == Some(CallStatus::AwaitingResult) =>
        {
            Ok(complete_task(s, call_id, result, "poll", cx))
        }
        (Status::Running | Status::WaitingApproval, E::CallDeadline { epoch, call_id })
            if epoch == s.epoch
                && s.call(&call_id).map(|c| c.status) == Some(CallStatus::AwaitingResult) =>
        {
            let timeout_ms = s
                .call(&call_id)
                .and_then(|c| c.task.as_ref())
                .map_or(0, |t| t.deadline_ms.saturating_sub(t.accepted_at_ms));
            let result = ToolResult::failure(ToolError::new(
                ToolErrorCode::Timeout,
                format!(
                    "the tool accepted the call but gave no result within its deadline ({} s)",
                    timeout_ms.div_ceil(1000)
                ),
            ));
            Ok(complete_task(s, call_id, result, "deadline", cx))
        }
        (Status::Running | Status::WaitingApproval, E::CallbackResult { call_id, result }) => {
            let waiting = matches!(
                s.call(&call_id).map(|c| c.status),
                Some(CallStatus::Dispatched | CallStatus::AwaitingResult)
            );
            if !waiting {
                return Err(invalid(
                    s,
                    "invalid_state",
                    format!("call {call_id} already has its result"),
                ));
            }
            Ok(complete_task(s, call_id, result, "callback", cx))
        }
        (_, ev) if ev.is_reply() => Ok(ignored(&ev, "stale")),
        (status, ev) => Err(invalid(
            s,
            "invalid_state",
            format!("run is {}; it accepts no {}", status.as_str(), ev.name()),
        )),
    }
}

fn tool_choice(s: &RunState) -> ToolChoice {
    if s.force_final || s.budget_final.is_some() {
        ToolChoice::None
    } else {
        ToolChoice::Auto
    }
}

fn fail(s: &mut RunState, error: RunError) -> Vec<Effect> {
    s.status = Status::Failed;
    s.phase = None;
    s.error = Some(error);
    s.epoch += 1;
    vec![Effect::AbortInFlight, Effect::Finish]
}

fn fail_budget(s: &mut RunState, which: Exhausted) -> Vec<Effect> {
    fail(
        s,
        RunError::new(
            "budget_exceeded",
            format!("the {} budget is exhausted", which.as_str()),
        ),
    )
}

/// Delivers queued input and starts the next model turn, or fails on the budget.
fn next_turn(
    s: &mut RunState,
    cx: &StepContext<'_>,
    kind: &'static str,
    data: Value,
) -> Transition {
    for text in s.queued_input.drain(..) {
        s.messages.push(Message::User { content: text });
    }
    if let Err(which) = budget::check_model_call(&s.budget, &s.usage, cx.now_ms) {
        // The deadline has no reserve (its timer ends the run wherever it is); every other
        // budget keeps one final turn without tools for the answer.
        if which == Exhausted::Deadline || s.budget_final.is_some() {
            let effects = fail_budget(s, which);
            return out(kind, data, effects);
        }
        grant_reserve(s, which);
    }
    s.usage.turns += 1;
    s.turn += 1;
    s.epoch += 1;
    s.status = Status::Running;
    s.phase = Some(Phase::AwaitingModel);
    let effects = vec![Effect::CallModel {
        epoch: s.epoch,
        tool_choice: tool_choice(s),
    }];
    let mut t = out(kind, data, effects);
    if let Value::Object(m) = &mut t.data {
        m.insert("turn".into(), json!(s.turn));
        if let Some(which) = s.budget_final {
            m.insert("budget_reserve".into(), json!(which));
        }
    }
    t
}

/// The `which` budget ran out: the next turn is the reserve, made without tools, and the run
/// ends after it with `budget_exceeded` and the model's answer as its output.
fn grant_reserve(s: &mut RunState, which: Exhausted) {
    s.budget_final = Some(which);
    s.messages.push(Message::User {
        content: format!(
            "{NOTE} the {} budget is exhausted: tools are disabled. Give your final answer now, \
             from what you have found so far.",
            which.as_str()
        ),
    });
}

/// The reply to the reserve turn ends the run: `failed` with `budget_exceeded`, and whatever
/// answer the model gave as the output (tool calls are not run).
fn on_reserve_reply(
    s: &mut RunState,
    reply: ModelReply,
    which: Exhausted,
    usage: Value,
) -> Transition {
    let answer = match decide(&reply) {
        Decision::Final(text) => Some(text),
        _ => reply.text.clone().filter(|t| !t.trim().is_empty()),
    };
    if let Some(text) = &answer {
        s.messages.push(Message::Assistant {
            content: Some(text.clone()),
            tool_calls: vec![],
        });
    }
    let output = answer.map(|text| {
        serde_json::from_str::<Value>(&text)
            .ok()
            .filter(|v| v.is_object() || v.is_array())
            .unwrap_or(Value::String(text))
    });
    let message = match output {
        Some(_) => format!(
            "the {} budget is exhausted; the output is the model's answer from its final turn",
            which.as_str()
        ),
        None => format!(
            "the {} budget is exhausted and the final turn gave no answer",
            which.as_str()
        ),
    };
    let effects = fail(s, RunError::new("budget_exceeded", message));
    s.output = output;
    out(
        "model_replied",
        json!({ "decision": "budget_final", "output": s.output, "usage": usage }),
        effects,
    )
}

fn on_model_reply(s: &mut RunState, reply: ModelReply, cx: &StepContext<'_>) -> Transition {
    s.usage.input_tokens += reply.usage.input_tokens;
    s.usage.output_tokens += reply.usage.output_tokens;
    s.model_retries = 0;
    let usage = json!({ "input_tokens": reply.usage.input_tokens, "output_tokens": reply.usage.output_tokens });
    if let Some(which) = s.budget_final {
        return on_reserve_reply(s, reply, which, usage);
    }
    let decision = match decide(&reply) {
        Decision::AskUser { .. } if !cx.tools.offers_ask_user() => Decision::Malformed {
            code: "ask_user_disabled",
            message: "`ask_user` is switched off for this agent: decide with what you have, \
                      or give your final answer"
                .to_owned(),
        },
        d => d,
    };
    match decision {
        Decision::Final(text) => {
            s.corrections = 0;
            s.messages.push(Message::Assistant {
                content: Some(text.clone()),
                tool_calls: vec![],
            });
            let candidate = serde_json::from_str::<Value>(&text)
                .ok()
                .filter(|v| v.is_object() || v.is_array())
                .unwrap_or(Value::String(text));
            s.candidate = Some(candidate.clone());
            s.phase = Some(Phase::Verifying);
            s.epoch += 1;
            out(
                "model_replied",
                json!({ "decision": "final", "usage": usage }),
                vec![Effect::Verify {
                    epoch: s.epoch,
                    candidate,
                }],
            )
        }
        Decision::AskUser {
            model_call_id,
            question,
        } => {
            s.corrections = 0;
            s.messages.push(Message::Assistant {
                content: reply.text.clone(),
                tool_calls: reply.tool_calls.clone(),
            });
            s.question = Some((question.clone(), model_call_id));
            s.status = Status::WaitingInput;
            s.phase = None;
            out(
                "input_requested",
                json!({ "decision": "ask_user", "question": question, "usage": usage }),
                vec![],
            )
        }
        Decision::Malformed { code, message } => {
            s.messages.push(Message::Assistant {
                content: reply.text.clone(),
                tool_calls: reply.tool_calls.clone(),
            });
            let correction = ToolResult::failure(ToolError::new(
                ToolErrorCode::InvalidArgument,
                message.clone(),
            ))
            .to_message_content();
            // Every call the model made gets an answer, so call/result pairs stay whole.
            for c in &reply.tool_calls {
                s.messages.push(Message::Tool {
                    call_id: c.id.clone(),
                    content: correction.clone(),
                });
            }
            if reply.tool_calls.is_empty() {
                s.messages.push(Message::User {
                    content: format!("{NOTE} correction ({code}): {message}"),
                });
            }
            correct_or_fail(
                s,
                cx,
                json!({ "decision": "malformed", "code": code, "message": message, "usage": usage }),
            )
        }
        Decision::ToolCalls(calls) => {
            if s.force_final {
                let effects = fail(
                    s,
                    RunError::new(
                        "no_progress",
                        "the model kept calling tools after it was told to give its final answer",
                    ),
                );
                return out(
                    "model_replied",
                    json!({ "decision": "tool_calls" }),
                    effects,
                );
            }
            s.messages.push(Message::Assistant {
                content: reply.text.clone(),
                tool_calls: calls.clone(),
            });
            s.phase = Some(Phase::ValidatingCalls);
            let batch: Vec<PendingCall> = calls
                .iter()
                .enumerate()
                .map(|(i, c)| validate_call(s, i, c, cx))
                .collect();
            let invalid = batch
                .iter()
                .filter(|c| c.status == CallStatus::Done)
                .count();
            let valid = (batch.len() - invalid) as u32;
            let summary: Vec<Value> = batch.iter().map(call_summary).collect();
            let stop = batch.iter().find_map(|c| safety_stop(c, cx));
            s.calls = batch;
            let data = json!({ "decision": "tool_calls", "calls": summary, "usage": usage });
            if let Some(error) = stop {
                let effects = fail(s, error);
                return out("model_replied", data, effects);
            }
            if invalid > 0 {
                s.corrections += 1;
                if s.corrections > cx.policy.max_corrections {
                    let effects = fail(s, too_many_corrections(s.corrections));
                    return out("model_replied", data, effects);
                }
            } else {
                s.corrections = 0;
            }
            if let Err(which) = budget::check_tool_calls(&s.budget, &s.usage, valid, cx.now_ms) {
                if which == Exhausted::Deadline {
                    let effects = fail_budget(s, which);
                    return out("model_replied", data, effects);
                }
                // None of the batch runs; every call is answered, so pairs stay whole.
                let not_run = ToolResult::failure(ToolError::new(
                    ToolErrorCode::Failed,
                    "not run: the tool-call budget is exhausted",
                ));
                for c in std::mem::take(&mut s.calls) {
                    let result = c.result.unwrap_or_else(|| not_run.clone());
                    s.messages.push(Message::Tool {
                        call_id: c.model_call_id,
                        content: result.to_message_content(),
                    });
                }
                grant_reserve(s, which);
                return next_turn(s, cx, "model_replied", data);
            }
            let effects = advance_batch(s, cx);
            let mut t = out("model_replied", data, effects);
            add_dispatched(s, &mut t);
            t
        }
    }
}

/// A call refused `permission_denied` whose tool says `on_permission_denied = "stop"` ends the
/// run before anything of its batch runs.
fn safety_stop(c: &PendingCall, cx: &StepContext<'_>) -> Option<RunError> {
    let error = c.result.as_ref()?.error.as_ref()?;
    if error.code != ToolErrorCode::PermissionDenied {
        return None;
    }
    let g = cx.tools.guard(&c.tool)?;
    (g.on_permission_denied == OnPermissionDenied::Stop).then(|| {
        RunError::new(
            "permission_denied",
            format!("safety stop: {}", error.message),
        )
    })
}

fn too_many_corrections(n: u32) -> RunError {
    RunError::new(
        "invalid_model_output",
        format!("the model produced {n} unusable replies in a row"),
    )
}

fn correct_or_fail(s: &mut RunState, cx: &StepContext<'_>, data: Value) -> Transition {
    s.corrections += 1;
    if s.corrections > cx.policy.max_corrections {
        let effects = fail(s, too_many_corrections(s.corrections));
        return out("model_replied", data, effects);
    }
    next_turn(s, cx, "model_replied", data)
}

fn call_summary(c: &PendingCall) -> Value {
    let mut v = json!({
        "call_id": c.call_id,
        "tool": c.tool,
        "arguments": c.arguments,
        "status": c.status,
        "effect": c.effect,
    });
    if let (Value::Object(m), Some(r)) = (&mut v, &c.result)
        && let Some(e) = &r.error
    {
        m.insert("error".into(), json!(e));
    }
    v
}

/// Lists the intents dispatched by this transition (write-ahead: they are in the same commit).
fn add_dispatched(s: &RunState, t: &mut Transition) {
    let dispatched: Vec<Value> = t
        .effects
        .iter()
        .filter_map(|e| match e {
            Effect::ExecuteTool { call_id, .. } => s.call(call_id),
            _ => None,
        })
        .map(|c| json!({ "call_id": c.call_id, "tool": c.tool, "key": c.key, "attempt": c.attempts }))
        .collect();
    if !dispatched.is_empty()
        && let Value::Object(m) = &mut t.data
    {
        m.insert("dispatched".into(), Value::Array(dispatched));
    }
}

fn validate_call(
    s: &RunState,
    index: usize,
    c: &crate::model::ModelToolCall,
    cx: &StepContext<'_>,
) -> PendingCall {
    let call_id = CallId::new(s.turn, index);
    let parsed = serde_json::from_str::<Value>(&c.arguments);
    let arguments = match &parsed {
        Ok(v) => v.clone(),
        Err(_) => Value::String(c.arguments.clone()),
    };
    let mut info = ToolInfo {
        effect: ToolEffect::Read,
        polling: false,
        reconcilable: false,
    };
    let error = match (cx.tools.lookup(&c.name), &parsed) {
        (ToolLookup::Unknown, _) => Some(ToolError::new(
            ToolErrorCode::ToolNotAllowed,
            format!("unknown tool `{}`", c.name),
        )),
        (ToolLookup::NotAllowed, _) => Some(ToolError::new(
            ToolErrorCode::ToolNotAllowed,
            format!("tool `{}` is not allowed for this agent", c.name),
        )),
        (ToolLookup::Allowed(_), Err(e)) => Some(ToolError::new(
            ToolErrorCode::InvalidArgument,
            format!("arguments are not valid JSON: {e}"),
        )),
        (ToolLookup::Allowed(_), Ok(v)) if !v.is_object() => Some(ToolError::new(
            ToolErrorCode::InvalidArgument,
            "arguments must be a JSON object",
        )),
        (ToolLookup::Allowed(i), Ok(v)) => {
            info = i;
            cx.tools.validate(&c.name, v).err().map(|e| {
                ToolError::new(
                    ToolErrorCode::InvalidArgument,
                    format!(
                        "at `{}`: {}",
                        if e.path.is_empty() { "/" } else { &e.path },
                        e.message
                    ),
                )
            })
        }
    };
    // Scopes, deny rules and path rules: before approval and execution, on the arguments the
    // call would run with (path rules normalise them).
    let mut arguments = arguments;
    let error = match (error, cx.tools.guard(&c.name)) {
        (None, Some(g)) => {
            let mut checked = arguments.clone();
            match g.check(&c.name, s.scopes.as_deref(), &mut checked) {
                Ok(()) => {
                    arguments = checked;
                    None
                }
                Err(e) => Some(e),
            }
        }
        (error, _) => error,
    };
    let (status, result) = match error {
        Some(e) => (CallStatus::Done, Some(ToolResult::failure(e))),
        None if cx.tools.needs_approval(&c.name, &arguments) => {
            (CallStatus::AwaitingApproval, None)
        }
        None => (CallStatus::Ready, None),
    };
    PendingCall {
        key: idempotency_key(&s.id, s.turn, index, &c.name, &arguments),
        fingerprint: call_fingerprint(&c.name, &arguments),
        call_id,
        model_call_id: c.id.clone(),
        tool: c.name.clone(),
        arguments,
        effect: info.effect,
        polling: info.polling,
        reconcilable: info.reconcilable,
        awaiting_since_ms: (status == CallStatus::AwaitingApproval).then_some(cx.now_ms),
        status,
        attempts: 0,
        result,
        task: None,
        hold: None,
    }
}

/// Moves the current batch forward; see "advance batch" in the module doc.
fn advance_batch(s: &mut RunState, cx: &StepContext<'_>) -> Vec<Effect> {
    if s.pending_approvals().next().is_some() {
        // Calls still in flight are answered first (their replies need `running`).
        if s.calls.iter().any(|c| c.status == CallStatus::Dispatched) {
            s.status = Status::Running;
            s.phase = Some(Phase::ExecutingTools);
            return vec![];
        }
        if s.calls.iter().any(|c| c.status == CallStatus::Reconciling) {
            s.status = Status::Running;
            s.phase = Some(Phase::Reconciling);
            return vec![];
        }
        s.status = Status::WaitingApproval;
        s.phase = None;
        return vec![];
    }
    let ready: Vec<usize> = (0..s.calls.len())
        .filter(|&i| s.calls[i].status == CallStatus::Ready)
        .collect();
    if !ready.is_empty() {
        let first_time = ready.iter().filter(|&&i| s.calls[i].attempts == 0).count() as u32;
        if let Err(which) = budget::check_tool_calls(&s.budget, &s.usage, first_time, cx.now_ms) {
            return fail_budget(s, which);
        }
        s.usage.tool_calls += first_time;
        s.status = Status::Running;
        s.phase = Some(Phase::ExecutingTools);
        let epoch = s.epoch;
        return ready
            .into_iter()
            .map(|i| {
                let c = &mut s.calls[i];
                c.status = CallStatus::Dispatched;
                c.attempts += 1;
                Effect::ExecuteTool {
                    epoch,
                    call_id: c.call_id.clone(),
                }
            })
            .collect();
    }
    s.status = Status::Running;
    if s.calls.iter().any(|c| c.status == CallStatus::Dispatched) {
        s.phase = Some(Phase::ExecutingTools);
        return vec![];
    }
    if s.calls.iter().any(|c| c.status == CallStatus::Reconciling) {
        s.phase = Some(Phase::Reconciling);
        return vec![];
    }
    if s.calls
        .iter()
        .any(|c| c.status == CallStatus::AwaitingResult)
    {
        s.phase = Some(Phase::AwaitingTool);
        return vec![];
    }
    finish_batch(s, cx)
}

/// Of (tool, result envelope as the model sees it): the same answer from the same tool is no
/// new state, whatever the arguments were.
fn result_fingerprint(tool: &str, result: &ToolResult) -> u64 {
    call_fingerprint(tool, &serde_json::to_value(result).unwrap_or(Value::Null))
}

/// All calls are done: answer each in order, judge progress, take the next turn.
fn finish_batch(s: &mut RunState, cx: &StepContext<'_>) -> Vec<Effect> {
    let calls = std::mem::take(&mut s.calls);
    let mut outcomes = Vec::with_capacity(calls.len());
    for c in calls {
        let result = c.result.unwrap_or_else(|| {
            ToolResult::failure(ToolError::new(ToolErrorCode::Failed, "no result"))
        });
        if result.ok && !s.succeeded_tools.contains(&c.tool) {
            s.succeeded_tools.push(c.tool.clone());
        }
        outcomes.push(CallOutcome {
            fingerprint: c.fingerprint,
            result_fingerprint: result_fingerprint(&c.tool, &result),
            polling: c.polling,
            ok: result.ok,
        });
        // A projected tool's result reaches the model cut down to its declared parts (the
        // whole result is in its `tool_call_finished` event).
        let content = match cx.tools.guard(&c.tool) {
            Some(g) if g.projects() && result.data.is_some() => {
                let mut seen = result.clone();
                seen.data = seen.data.as_ref().map(|d| g.project(d).into_owned());
                seen.to_message_content()
            }
            _ => result.to_message_content(),
        };
        s.messages.push(Message::Tool {
            call_id: c.model_call_id,
            content,
        });
    }
    match s.progress.record_turn(&outcomes, &cx.policy.progress) {
        Verdict::Continue => {}
        Verdict::Nudge(reason) => s.messages.push(Message::User {
            content: format!(
                "{NOTE} no progress: {reason}. Change your approach, or give your final answer."
            ),
        }),
        Verdict::ForceFinal(reason) => {
            s.force_final = true;
            s.messages.push(Message::User {
                content: format!(
                    "{NOTE} no progress: {reason}. Tools are now disabled: give your final answer."
                ),
            });
        }
        Verdict::Fail(reason) => {
            return fail(
                s,
                RunError::new("no_progress", format!("the run made no progress: {reason}")),
            );
        }
    }
    next_turn(s, cx, "", Value::Null).effects
}

fn on_model_failed(s: &mut RunState, error: ModelError, cx: &StepContext<'_>) -> Transition {
    let data = json!({ "kind": error.kind, "message": error.message });
    if error.kind == ModelErrorKind::ContextLengthExceeded {
        if s.context_rebuilds == 0 {
            // The same turn again, its context built under a smaller budget (the builder
            // halves it per rebuild).
            s.context_rebuilds += 1;
            s.epoch += 1;
            let mut t = out(
                "model_failed",
                data,
                vec![Effect::CallModel {
                    epoch: s.epoch,
                    tool_choice: tool_choice(s),
                }],
            );
            if let Value::Object(m) = &mut t.data {
                m.insert("context_rebuild".into(), json!(s.context_rebuilds));
            }
            return t;
        }
        let effects = fail(
            s,
            RunError::new(
                "context_length_exceeded",
                format!(
                    "the request does not fit the model's context window, even rebuilt smaller: {}",
                    error.message
                ),
            ),
        );
        return out("model_failed", data, effects);
    }
    if !error.kind.is_retryable() {
        let effects = fail(
            s,
            RunError::new(
                "model_rejected",
                format!("the model refused the request: {}", error.message),
            ),
        );
        return out("model_failed", data, effects);
    }
    if error.kind != ModelErrorKind::Overloaded {
        // The gateway already retried this attempt with backoff; what reaches the run is final.
        let effects = fail(
            s,
            RunError::new(
                "model_unavailable",
                format!("the model is unavailable: {}", error.message),
            ),
        );
        return out("model_failed", data, effects);
    }
    s.model_retries += 1;
    if s.model_retries > cx.policy.max_model_retries {
        let effects = fail(
            s,
            RunError::new(
                "model_unavailable",
                format!(
                    "the model failed {} times in a row: {}",
                    s.model_retries, error.message
                ),
            ),
        );
        return out("model_failed", data, effects);
    }
    let after_ms = backoff_ms(cx.policy, s.model_retries, s.id.as_str());
    let mut t = out(
        "model_failed",
        data,
        vec![Effect::ScheduleRetry {
            epoch: s.epoch,
            after_ms,
        }],
    );
    if let Value::Object(m) = &mut t.data {
        m.insert("retry_in_ms".into(), json!(after_ms));
        m.insert("attempt".into(), json!(s.model_retries));
    }
    t
}

fn on_tool_finished(
    s: &mut RunState,
    call_id: CallId,
    result: ToolResult,
    cx: &StepContext<'_>,
) -> Transition {
    let mut data = json!({ "call_id": call_id, "ok": result.ok, "truncated": result.truncated });
    let max_retries = cx.policy.max_tool_retries;
    let mut effects = Vec::new();
    let Some(c) = s.calls.iter_mut().find(|c| c.call_id == call_id) else {
        return ignored(&RunEvent::Start, "unknown_call");
    };
    if let Value::Object(m) = &mut data {
        m.insert("tool".into(), json!(c.tool));
        if let Some(e) = &result.error {
            m.insert("error".into(), json!(e));
        }
        // The model sees only a projection of this result: the event keeps all of it.
        if let (Some(d), Some(g)) = (&result.data, cx.tools.guard(&c.tool))
            && g.projects()
        {
            m.insert("result".into(), d.clone());
        }
    }
    let code = result.error_code();
    let retries_left = c.attempts <= max_retries;
    // The result that answers the call, once it is final.
    let mut settled = None;
    match code {
        Some(ToolErrorCode::Overloaded) if retries_left => {
            // Not started: send again later with the same key.
            c.status = CallStatus::Ready;
            let after_ms = backoff_ms(cx.policy, c.attempts, c.key.as_str());
            effects.push(Effect::ScheduleRetry {
                epoch: s.epoch,
                after_ms,
            });
            s.phase = Some(Phase::ExecutingTools);
            return out("tool_call_finished", data, effects);
        }
        Some(ToolErrorCode::OutcomeUnknown | ToolErrorCode::Timeout)
            if c.effect != ToolEffect::Read =>
        {
            match (c.effect, c.reconcilable) {
                (ToolEffect::Idempotent, _) if retries_left => c.status = CallStatus::Ready,
                (ToolEffect::Idempotent, _) => settled = Some(result),
                (_, true) => {
                    c.status = CallStatus::Reconciling;
                    effects.push(Effect::CheckStatus {
                        epoch: s.epoch,
                        call_id: c.call_id.clone(),
                    });
                }
                _ => c.status = CallStatus::OutcomeUnknown,
            }
        }
        _ => settled = Some(result),
    }
    if let Some(result) = settled {
        let tool = c.tool.clone();
        if let Some(effects) = settle_judged(s, &call_id, &tool, result, &mut data, cx) {
            return out("tool_call_finished", data, effects);
        }
    }
    effects.extend(advance_batch(s, cx));
    let mut t = out("tool_call_finished", data, effects);
    add_dispatched(s, &mut t);
    t
}

/// What the final result of a call that ran does to the run.
enum Judged {
    /// The model gets it.
    Answer,
    /// An operator decides first (with the tool's failures in a row, for `tool_failing`).
    Hold(HoldReason, Option<u32>),
    /// The run ends.
    Stop(RunError),
}

/// Whether an error says the tool is failing (as opposed to the model asking for something
/// wrong, or the runtime refusing the call before it ran).
fn counts_as_tool_failure(code: ToolErrorCode) -> bool {
    matches!(
        code,
        ToolErrorCode::Retryable
            | ToolErrorCode::Failed
            | ToolErrorCode::Timeout
            | ToolErrorCode::OutcomeUnknown
    )
}

/// Settles a call's final result as `judge_result` decides: the answer goes to the model (and
/// records the call's compensation), a hold waits for an operator (noted in the event's
/// `data`), a stop ends the run — its effects are returned for the caller's transition.
fn settle_judged(
    s: &mut RunState,
    call_id: &CallId,
    tool: &str,
    result: ToolResult,
    data: &mut Value,
    cx: &StepContext<'_>,
) -> Option<Vec<Effect>> {
    match judge_result(s, tool, &result, cx) {
        Judged::Answer => {
            settle(s, call_id, result, None, cx.now_ms);
            compensate::record(s, call_id, cx);
            None
        }
        Judged::Hold(reason, failures) => {
            if let Value::Object(m) = data {
                m.insert("held".into(), json!(reason.as_str()));
                if let Some(n) = failures {
                    m.insert("failures".into(), json!(n));
                }
            }
            settle(s, call_id, result, Some(reason), cx.now_ms);
            None
        }
        Judged::Stop(error) => {
            settle(s, call_id, result, None, cx.now_ms);
            Some(fail(s, error))
        }
    }
}

/// Tracks the tool's failures in a row and applies its permission-error policy.
fn judge_result(s: &mut RunState, tool: &str, result: &ToolResult, cx: &StepContext<'_>) -> Judged {
    let Some(code) = result.error_code() else {
        s.tool_failures.retain(|(t, _)| t != tool);
        return Judged::Answer;
    };
    if code == ToolErrorCode::Permission {
        // 401/403: never retried, never counted as the tool failing.
        return match cx.tools.on_permission_error(tool) {
            OnPermissionError::Operator => Judged::Hold(HoldReason::PermissionError, None),
            OnPermissionError::Fail => Judged::Stop(RunError::new(
                "permission_denied",
                format!(
                    "the tool `{tool}` refused the call for lack of permission: {}",
                    result.error.as_ref().map_or("", |e| e.message.as_str())
                ),
            )),
        };
    }
    if !counts_as_tool_failure(code) {
        return Judged::Answer;
    }
    let limit = cx.tools.max_failures(tool);
    let n = match s.tool_failures.iter_mut().find(|(t, _)| t == tool) {
        Some((_, n)) => {
            *n += 1;
            *n
        }
        None => {
            s.tool_failures.push((tool.to_owned(), 1));
            1
        }
    };
    if limit == 0 || n < limit {
        return Judged::Answer;
    }
    // An operator decides now: that replaces the no-progress escalation for these failures.
    s.progress.failure_streak = 0;
    s.progress.stale_turns = 0;
    Judged::Hold(HoldReason::ToolFailing, Some(n))
}

/// Gives the call its final result, or holds it (with that result) for an operator, waiting
/// from `since_ms`.
fn settle(
    s: &mut RunState,
    call_id: &CallId,
    result: ToolResult,
    hold: Option<HoldReason>,
    since_ms: u64,
) {
    if let Some(c) = s.calls.iter_mut().find(|c| &c.call_id == call_id) {
        c.result = Some(result);
        c.hold = hold;
        if hold.is_some() {
            c.status = CallStatus::AwaitingApproval;
            // Destructured: the purity check would read `c` dot `awaiting…` as an await.
            let PendingCall {
                awaiting_since_ms, ..
            } = c;
            *awaiting_since_ms = Some(since_ms);
        } else {
            c.status = CallStatus::Done;
        }
    }
}

/// An error message as an event carries it: at most 500 characters.
fn bounded(message: &str) -> String {
    const MAX: usize = 500;
    if message.chars().count() <= MAX {
        message.to_owned()
    } else {
        let mut cut: String = message.chars().take(MAX).collect();
        cut.push('…');
        cut
    }
}

fn on_verified(s: &mut RunState, verdict: Result<(), String>, cx: &StepContext<'_>) -> Transition {
    match verdict {
        Ok(()) => {
            s.status = Status::Succeeded;
            s.phase = None;
            s.output = s.candidate.take();
            out(
                "run_succeeded",
                json!({ "output": s.output }),
                vec![Effect::Finish],
            )
        }
        Err(reason) => {
            s.candidate = None;
            s.verify_rejections += 1;
            let data = json!({ "reason": reason, "rejections": s.verify_rejections });
            if s.verify_rejections > cx.policy.max_verify_rejections {
                let effects = fail(
                    s,
                    RunError::new(
                        "verification_failed",
                        format!(
                            "the final answer was rejected {} times; last: {reason}",
                            s.verify_rejections
                        ),
                    ),
                );
                return out("verification_rejected", data, effects);
            }
            s.messages.push(Message::User {
                content: format!(
                    "{NOTE} your final answer was rejected: {reason}. Fix it and answer again."
                ),
            });
            next_turn(s, cx, "verification_rejected", data)
        }
    }
}

fn approve(
    s: &mut RunState,
    call_id: CallId,
    arguments: Option<Value>,
    by: Option<String>,
    cx: &StepContext<'_>,
) -> Result<Transition, InvalidTransition> {
    let Some(c) = s.call(&call_id) else {
        return Err(invalid(
            s,
            "unknown_call",
            format!("no call {call_id} in this run"),
        ));
    };
    if !matches!(
        c.status,
        CallStatus::AwaitingApproval | CallStatus::OutcomeUnknown
    ) {
        return Err(invalid(
            s,
            "invalid_state",
            format!("call {call_id} is not awaiting approval"),
        ));
    }
    let mut arguments = arguments;
    if let Some(args) = &mut arguments {
        if !args.is_object() {
            return Err(invalid(
                s,
                "invalid_argument",
                "arguments must be a JSON object".into(),
            ));
        }
        if let Err(e) = cx.tools.validate(&c.tool, args) {
            return Err(invalid(
                s,
                "invalid_argument",
                format!(
                    "at `{}`: {}",
                    if e.path.is_empty() { "/" } else { &e.path },
                    e.message
                ),
            ));
        }
        // Edited arguments meet the same deny and path rules as the model's.
        if let Some(g) = cx.tools.guard(&c.tool) {
            let mut checked = args.clone();
            if let Err(e) = g.check_arguments(&mut checked) {
                return Err(invalid(s, "invalid_argument", e.message));
            }
            *args = checked;
        }
    }
    let (run, turn) = (s.id.clone(), s.turn);
    let index = s
        .calls
        .iter()
        .position(|c| c.call_id == call_id)
        .unwrap_or(0);
    let edited = arguments.is_some();
    let mut held = None;
    if let Some(c) = s.calls.iter_mut().find(|c| c.call_id == call_id) {
        if let Some(args) = arguments {
            c.key = idempotency_key(&run, turn, index, &c.tool, &args);
            c.fingerprint = call_fingerprint(&c.tool, &args);
            c.arguments = args;
        }
        // A held call runs again (its key unchanged unless the arguments were edited).
        held = c.hold.take();
        if held.is_some() {
            c.result = None;
        }
        c.status = CallStatus::Ready;
    }
    s.decided.push((call_id.clone(), true));
    let effects = advance_batch(s, cx);
    let mut data = json!({ "call_id": call_id, "edited": edited, "by": by });
    if let (Value::Object(m), Some(h)) = (&mut data, held) {
        m.insert("held".into(), json!(h.as_str()));
    }
    let mut t = out("call_approved", data, effects);
    add_dispatched(s, &mut t);
    Ok(t)
}

fn reject(
    s: &mut RunState,
    call_id: CallId,
    reason: Option<String>,
    by: Option<String>,
    cx: &StepContext<'_>,
) -> Result<Transition, InvalidTransition> {
    let Some(c) = s.call(&call_id) else {
        return Err(invalid(
            s,
            "unknown_call",
            format!("no call {call_id} in this run"),
        ));
    };
    let error = match c.status {
        CallStatus::AwaitingApproval if c.hold.is_some() => skipped(s, c, reason.as_deref()),
        CallStatus::AwaitingApproval => ToolError::new(
            ToolErrorCode::ApprovalDenied,
            reason
                .clone()
                .unwrap_or_else(|| "an operator rejected this call".into()),
        ),
        CallStatus::OutcomeUnknown => ToolError::new(
            ToolErrorCode::OutcomeUnknown,
            "the call may or may not have run; an operator chose not to send it again",
        ),
        _ => {
            return Err(invalid(
                s,
                "invalid_state",
                format!("call {call_id} is not awaiting approval"),
            ));
        }
    };
    let held = skip_held(s, &call_id, error);
    s.decided.push((call_id.clone(), false));
    let effects = advance_batch(s, cx);
    let mut data = json!({ "call_id": call_id, "reason": reason, "by": by });
    if let (Value::Object(m), Some(h)) = (&mut data, held) {
        m.insert("held".into(), json!(h.as_str()));
    }
    let mut t = out("call_rejected", data, effects);
    add_dispatched(s, &mut t);
    Ok(t)
}

/// The tool error the model gets for a held call an operator skipped.
fn skipped(s: &RunState, c: &PendingCall, reason: Option<&str>) -> ToolError {
    let last = c
        .result
        .as_ref()
        .and_then(|r| r.error.as_ref())
        .map(|e| format!(" (last error: {}: {})", e.code.as_str(), e.message))
        .unwrap_or_default();
    let why = match c.hold {
        Some(HoldReason::PermissionError) => {
            format!("the tool `{}` refused it for lack of permission", c.tool)
        }
        _ => {
            let n = s
                .tool_failures
                .iter()
                .find(|(t, _)| *t == c.tool)
                .map_or(0, |(_, n)| *n);
            format!("the tool `{}` failed {n} times in a row", c.tool)
        }
    };
    let mut message =
        format!("an operator skipped this call after {why}{last}; it was not run again");
    if let Some(r) = reason {
        message.push_str(": ");
        message.push_str(r);
    }
    ToolError::new(ToolErrorCode::Skipped, message)
}

/// Answers the call with `error` (a held call's failure streak starts over). Returns why it
/// was held, if it was.
fn skip_held(s: &mut RunState, call_id: &CallId, error: ToolError) -> Option<HoldReason> {
    let c = s.calls.iter_mut().find(|c| &c.call_id == call_id)?;
    c.status = CallStatus::Done;
    c.result = Some(ToolResult::failure(error));
    let held = c.hold.take();
    if held == Some(HoldReason::ToolFailing) {
        let tool = c.tool.clone();
        s.tool_failures.retain(|(t, _)| *t != tool);
    }
    held
}

/// An operator's decision `fail`: the run ends `failed`, with a code that says why the call
/// waited (`tool_failing`, `permission_denied`, `outcome_unknown`, `approval_denied`).
fn fail_call(
    s: &mut RunState,
    call_id: CallId,
    reason: Option<String>,
    by: Option<String>,
) -> Result<Transition, InvalidTransition> {
    let Some(c) = s.call(&call_id) else {
        return Err(invalid(
            s,
            "unknown_call",
            format!("no call {call_id} in this run"),
        ));
    };
    let code = match (c.status, c.hold) {
        (CallStatus::AwaitingApproval, Some(HoldReason::ToolFailing)) => "tool_failing",
        (CallStatus::AwaitingApproval, Some(HoldReason::PermissionError)) => "permission_denied",
        (CallStatus::AwaitingApproval, None) => "approval_denied",
        (CallStatus::OutcomeUnknown, _) => "outcome_unknown",
        _ => {
            return Err(invalid(
                s,
                "invalid_state",
                format!("call {call_id} is not awaiting approval"),
            ));
        }
    };
    let last = c
        .result
        .as_ref()
        .and_then(|r| r.error.as_ref())
        .map(|e| format!(" (last error: {}: {})", e.code.as_str(), e.message))
        .unwrap_or_default();
    let mut message = format!(
        "an operator failed the run at call {call_id} of the tool `{}`{last}",
        c.tool
    );
    if let Some(r) = &reason {
        message.push_str(": ");
        message.push_str(r);
    }
    let held = c.hold;
    s.failed_call = Some(call_id.clone());
    let effects = fail(s, RunError::new(code, message));
    let mut data = json!({ "call_id": call_id, "reason": reason, "by": by });
    if let (Value::Object(m), Some(h)) = (&mut data, held) {
        m.insert("held".into(), json!(h.as_str()));
    }
    Ok(out("call_failed", data, effects))
}

/// Nobody decided a call within its tool's approval timeout: take the tool's default decision.
/// The caller checked that the call is still awaiting approval.
fn expire_approval(s: &mut RunState, call_id: CallId, cx: &StepContext<'_>) -> Transition {
    let mut action = ApprovalTimeoutAction::Reject;
    let mut held = None;
    if let Some(c) = s.call(&call_id) {
        action = cx.tools.on_approval_timeout(&c.tool);
        held = c.hold;
        let error = match held {
            Some(_) => skipped(s, c, Some("no operator decided in time")),
            None => ToolError::new(
                ToolErrorCode::ApprovalDenied,
                "no operator decided on this call in time; it was not run",
            ),
        };
        match action {
            // A held call runs again, like an approved one.
            ApprovalTimeoutAction::Approve => {
                if let Some(c) = s.calls.iter_mut().find(|c| c.call_id == call_id) {
                    c.status = CallStatus::Ready;
                    if c.hold.take().is_some() {
                        c.result = None;
                    }
                }
            }
            ApprovalTimeoutAction::Reject => {
                skip_held(s, &call_id, error);
            }
        }
    }
    s.decided
        .push((call_id.clone(), action == ApprovalTimeoutAction::Approve));
    let effects = advance_batch(s, cx);
    let mut data = json!({ "call_id": call_id, "action": action });
    if let (Value::Object(m), Some(h)) = (&mut data, held) {
        m.insert("held".into(), json!(h.as_str()));
    }
    let mut t = out("approval_expired", data, effects);
    add_dispatched(s, &mut t);
    t
}

/// Re-issues the work a crashed incarnation had in flight, by each call's declared policy.
fn resume_running(s: &mut RunState, cx: &StepContext<'_>) -> Transition {
    s.epoch += 1;
    match s.phase {
        Some(Phase::Verifying) => {
            if let Some(candidate) = s.candidate.clone() {
                return out(
                    "run_resumed",
                    json!({}),
                    vec![Effect::Verify {
                        epoch: s.epoch,
                        candidate,
                    }],
                );
            }
            // A verifying run always has a candidate; without one, ask the model again.
            s.phase = Some(Phase::AwaitingModel);
            let tool_choice = tool_choice(s);
            out(
                "run_resumed",
                json!({}),
                vec![Effect::CallModel {
                    epoch: s.epoch,
                    tool_choice,
                }],
            )
        }
        Some(Phase::ExecutingTools | Phase::Reconciling | Phase::AwaitingTool) => {
            // Accepted calls are not resent: their polling resumes from the checkpoint.
            let mut effects = poll_awaiting(s);
            let mut unknown = Vec::new();
            for c in s.calls.iter_mut() {
                // A call in flight when the previous incarnation died: never blindly resent.
                if c.status == CallStatus::Dispatched {
                    match (c.effect, c.reconcilable) {
                        (ToolEffect::Read | ToolEffect::Idempotent, _) => {
                            c.status = CallStatus::Ready;
                        }
                        (ToolEffect::Unsafe, true) => {
                            c.status = CallStatus::Reconciling;
                        }
                        (ToolEffect::Unsafe, false) => {
                            c.status = CallStatus::OutcomeUnknown;
                            unknown.push(c.call_id.clone());
                        }
                    }
                }
                if c.status == CallStatus::Reconciling {
                    effects.push(Effect::CheckStatus {
                        epoch: s.epoch,
                        call_id: c.call_id.clone(),
                    });
                }
            }
            // Resends are not new tool calls: don't charge the budget twice.
            effects.extend(advance_batch(s, cx));
            let mut t = out(
                "run_resumed",
                json!({ "outcome_unknown": unknown }),
                effects,
            );
            add_dispatched(s, &mut t);
            t
        }
        _ => {
            s.phase = Some(Phase::AwaitingModel);
            let tool_choice = tool_choice(s);
            out(
                "run_resumed",
                json!({}),
                vec![Effect::CallModel {
                    epoch: s.epoch,
                    tool_choice,
                }],
            )
        }
    }
}

/// `PollTool` for every call of the batch its tool accepted to finish later.
fn poll_awaiting(s: &RunState) -> Vec<Effect> {
    s.calls
        .iter()
        .filter(|c| c.status == CallStatus::AwaitingResult)
        .map(|c| Effect::PollTool {
            epoch: s.epoch,
            call_id: c.call_id.clone(),
        })
        .collect()
}

/// The tool answered `202 Accepted` for a dispatched call: it waits for its result (polled,
/// or by callback) until its own deadline.
fn on_tool_accepted(
    s: &mut RunState,
    call_id: CallId,
    status_url: Option<String>,
    timeout_ms: u64,
    cx: &StepContext<'_>,
) -> Transition {
    let deadline_ms = cx.now_ms.saturating_add(timeout_ms);
    let mut data =
        json!({ "call_id": call_id, "polling": status_url.is_some(), "deadline_ms": deadline_ms });
    if let Some(c) = s.calls.iter_mut().find(|c| c.call_id == call_id) {
        c.status = CallStatus::AwaitingResult;
        c.task = Some(CallTask {
            status_url,
            accepted_at_ms: cx.now_ms,
            deadline_ms,
        });
        if let Value::Object(m) = &mut data {
            m.insert("tool".into(), json!(c.tool));
        }
    }
    let mut effects = vec![Effect::PollTool {
        epoch: s.epoch,
        call_id,
    }];
    effects.extend(advance_batch(s, cx));
    let mut t = out("tool_call_accepted", data, effects);
    add_dispatched(s, &mut t);
    t
}

/// An accepted (or, by callback, a dispatched) call got its result: by a poll, the callback
/// route, or its deadline (`via`). The first result wins; the caller checked the call waits.
/// The result is judged like any final result of a call that ran ("judge the result").
fn complete_task(
    s: &mut RunState,
    call_id: CallId,
    result: ToolResult,
    via: &str,
    cx: &StepContext<'_>,
) -> Transition {
    let mut data =
        json!({ "call_id": call_id, "ok": result.ok, "truncated": result.truncated, "via": via });
    let Some(c) = s.calls.iter_mut().find(|c| c.call_id == call_id) else {
        return ignored(&RunEvent::Start, "unknown_call");
    };
    if let Value::Object(m) = &mut data {
        m.insert("tool".into(), json!(c.tool));
        if let Some(e) = &result.error {
            m.insert("error".into(), json!(e));
        }
        if let (Some(d), Some(g)) = (&result.data, cx.tools.guard(&c.tool))
            && g.projects()
        {
            m.insert("result".into(), d.clone());
        }
    }
    c.task = None;
    let tool = c.tool.clone();
    if let Some(effects) = settle_judged(s, &call_id, &tool, result, &mut data, cx) {
        return out("tool_call_finished", data, effects);
    }
    let effects = advance_batch(s, cx);
    let mut t = out("tool_call_finished", data, effects);
    add_dispatched(s, &mut t);
    t
}

mod compensate;

#[cfg(test)]
mod tests;
