//! The data of one run: public status, phase inside `running`, the current batch of tool calls,
//! budgets, progress tracking and the conversation. This whole struct is the checkpoint.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::budget::{Budget, Usage};
use super::progress::Progress;
use crate::ids::{CallId, RunId};
use crate::model::Message;
use crate::tool::{ToolEffect, ToolResult};

/// Public status of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Stored, not started yet.
    Created,
    /// Working: waiting for the model, tools, a timer or the verifiers (see `Phase`).
    Running,
    /// Waiting for an operator's decision on a call of the batch.
    WaitingApproval,
    /// Waiting for the user's answer to the model's `ask_user` question.
    WaitingInput,
    /// Over: a final answer passed every verifier (`RunState::output`).
    Succeeded,
    /// Over with an error (`RunState::error`).
    Failed,
    /// Over: an operator cancelled it.
    Cancelled,
}

impl Status {
    /// Every status, in lifecycle order (the order of per-status metrics).
    pub const ALL: [Status; 7] = [
        Status::Created,
        Status::Running,
        Status::WaitingApproval,
        Status::WaitingInput,
        Status::Succeeded,
        Status::Failed,
        Status::Cancelled,
    ];

    /// Whether the run is over: `succeeded`, `failed` or `cancelled`.
    pub fn is_terminal(self) -> bool {
        matches!(self, Status::Succeeded | Status::Failed | Status::Cancelled)
    }

    /// The API's name (`created`, `waiting_approval`, …); `FromStr` parses it back.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Created => "created",
            Status::Running => "running",
            Status::WaitingApproval => "waiting_approval",
            Status::WaitingInput => "waiting_input",
            Status::Succeeded => "succeeded",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Status {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        Status::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or(())
    }
}

/// Where a `running` run is inside its step.
///
/// `building_context` and `validating_calls` are passed through within one transition (they
/// have no outside input to wait for); the others wait for a pool reply or a timer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Building the next model request; the machine never leaves a run in it (the actor
    /// builds the request for `CallModel`).
    BuildingContext,
    /// A model request, or its scheduled retry, is out.
    AwaitingModel,
    /// Checking the reply's tool calls (schema, guard, approval); left in the same step.
    ValidatingCalls,
    /// Calls of the batch are with the tool pool, or wait for a resend.
    ExecutingTools,
    /// Tools are asked whether calls whose outcome is unknown ran.
    Reconciling,
    /// The verifiers are checking a candidate final answer.
    Verifying,
    /// The run is ending (`cancelled` or `failed`, recorded in `RunState::ending`) and undoes
    /// its successful calls first, one compensating call at a time, newest first.
    Compensating,
    /// Every call of the batch that is not done was accepted by its tool (`202`) and is being
    /// finished in the background: polled at its status URL, or completed through the
    /// callback route, until its own deadline.
    AwaitingTool,
}

impl Phase {
    /// The API's name (`awaiting_model`, …), as in events.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::BuildingContext => "building_context",
            Phase::AwaitingModel => "awaiting_model",
            Phase::ValidatingCalls => "validating_calls",
            Phase::ExecutingTools => "executing_tools",
            Phase::Reconciling => "reconciling",
            Phase::Verifying => "verifying",
            Phase::Compensating => "compensating",
            Phase::AwaitingTool => "awaiting_tool",
        }
    }
}

/// Where one tool call of the current batch stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallStatus {
    /// Waiting for an operator's approve or reject.
    AwaitingApproval,
    /// Cleared to run, not yet sent.
    Ready,
    /// Sent to the tool pool; its intent (key, arguments) is in the committed checkpoint.
    Dispatched,
    /// Asking the tool whether a call with this key already ran.
    Reconciling,
    /// A crash left its outcome unknown and the tool cannot be asked: an operator decides.
    OutcomeUnknown,
    /// The tool accepted the call (`202`) and finishes it later: polled at its status URL or
    /// completed through the callback route (`PendingCall::task`).
    AwaitingResult,
    /// Has its result.
    Done,
}

/// A call its tool accepted to finish later (`202 Accepted`): what polling needs after a
/// restart. The callback token is not here: it is derived from the run and call ids with the
/// daemon's callback key whenever it is needed (`tool::callback`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallTask {
    /// Where the call's status is polled (`None`: the tool only calls back).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_url: Option<String>,
    /// When the tool accepted the call.
    pub accepted_at_ms: u64,
    /// When the call fails with `timeout` if no result came.
    pub deadline_ms: u64,
}

/// One tool call of the current batch: its intent and, once known, its result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingCall {
    /// The runtime's id of the call, from its turn and index in the reply (`call_<turn>_<i>`).
    pub call_id: CallId,
    /// The model's id for the call, echoed back on the tool message.
    pub model_call_id: String,
    /// The tool called, as the model named it.
    pub tool: String,
    /// The arguments the call runs with: normalised by path rules, or as an operator edited
    /// them. Arguments that are not JSON are kept as a string (the call is refused).
    pub arguments: Value,
    /// Server-derived idempotency key (see `idempotency::idempotency_key`).
    pub key: String,
    /// The tool's declared effect (`read` for a call refused before it could run).
    pub effect: ToolEffect,
    /// The tool is a polling tool (not counted by no-progress detection).
    pub polling: bool,
    /// The tool can say whether a call with this key ran.
    pub reconcilable: bool,
    /// Where the call stands.
    pub status: CallStatus,
    /// Times sent to the tool.
    pub attempts: u32,
    /// Of (tool, canonical arguments), for no-progress detection.
    pub fingerprint: u64,
    /// The result once known (a refusal is known at once); a held call keeps its last one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<ToolResult>,
    /// When the call began waiting for an operator (the approval expiry counts from here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub awaiting_since_ms: Option<u64>,
    /// Set while the call is `awaiting_result`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<CallTask>,
    /// Why a call that ran waits for an operator (`AwaitingApproval`) instead of being answered:
    /// its tool keeps failing, or refused it for lack of permission. `None`: an approval the
    /// tool's policy asks for (or no wait at all). Its last result stays in `result`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold: Option<HoldReason>,
}

/// Why a call that ran was held for an operator's decision (approve: run it again; reject:
/// skip it, the model is told; fail: end the run).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldReason {
    /// Calls of this tool failed `max_failures` times in a row in this run.
    ToolFailing,
    /// The tool answered 401/403 and its policy is `on_permission_error = "operator"`.
    PermissionError,
}

impl HoldReason {
    /// The API's name (the approvals inbox's `reason`).
    pub fn as_str(self) -> &'static str {
        match self {
            HoldReason::ToolFailing => "tool_failing",
            HoldReason::PermissionError => "permission_error",
        }
    }
}

/// Where one compensating call stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompensationStatus {
    /// Recorded when its original call succeeded; runs if the run ends cancelled or failed.
    Pending,
    /// Sent; its intent (key, arguments) is in the committed checkpoint.
    Dispatched,
    /// Asking the compensating tool whether the call with this key ran.
    Reconciling,
    /// The compensating call succeeded.
    Done,
    /// It ran and failed (after the runtime's retries by class).
    Failed,
    /// It was never sent (why: `reason`).
    Skipped,
    /// A crash left its outcome unknown and the tool could not be asked; not sent again.
    OutcomeUnknown,
}

impl CompensationStatus {
    /// Whether nothing more happens to it.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            CompensationStatus::Done
                | CompensationStatus::Failed
                | CompensationStatus::Skipped
                | CompensationStatus::OutcomeUnknown
        )
    }
}

/// The call that undoes one successful call of an `unsafe` tool with a `compensate` rule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Compensation {
    /// Its own id: the original call's id with `_undo`.
    pub call_id: CallId,
    /// The call it undoes, and that call's tool.
    pub for_call: CallId,
    /// The original call's tool.
    pub for_tool: String,
    /// The compensating tool and its arguments (mapped from the original call's).
    pub tool: String,
    /// The compensating call's arguments, mapped from the original call's.
    pub arguments: Value,
    /// Derived from the original call's key (`idempotency::compensation_key`).
    pub key: String,
    /// The compensating tool's declared effect (decides resend or reconcile after a crash).
    pub effect: ToolEffect,
    /// The compensating tool can say whether a call with this key ran.
    #[serde(default)]
    pub reconcilable: bool,
    /// Where it stands.
    pub status: CompensationStatus,
    /// Times sent to the tool.
    #[serde(default)]
    pub attempts: u32,
    /// Its result, once it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<ToolResult>,
    /// Why it was skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// How a run that is compensating will end once its compensations are over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ending {
    /// `cancelled` or `failed`.
    pub status: Status,
    /// The error of a `failed` ending; `None` for `cancelled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<RunError>,
}

/// Why a run failed: a stable snake_case code and one sentence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunError {
    /// Stable snake_case code (`budget_exceeded`, `no_progress`, `model_unavailable`, …).
    pub code: String,
    /// One sentence for people.
    pub message: String,
}

impl RunError {
    /// An error with `code` and `message`.
    pub fn new(code: &str, message: impl Into<String>) -> Self {
        RunError {
            code: code.to_owned(),
            message: message.into(),
        }
    }
}

/// How many refused controls a run remembers (older ones are answered from the event log).
pub const MAX_CONTROL_REFUSALS: usize = 64;

/// A control the run consumed without applying it: it did not fit the run's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlRefusal {
    /// The control's position in the run's inbox.
    pub seq: u64,
    /// The `InvalidTransition` code (`invalid_state`, `unknown_call`, …).
    pub code: String,
    /// The `InvalidTransition` message.
    pub message: String,
}

/// The whole state of one run. Serialized as the checkpoint body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// The run's id.
    pub id: RunId,
    /// The tenant that owns the run (of the token that created it).
    pub tenant: String,
    /// The name of the agent the run runs (a key of `[agents.*]`).
    pub agent: String,
    /// The goal as given.
    pub input: Value,
    /// The creator's JSON metadata, returned with the run; `null`: none.
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub metadata: Value,
    /// The scopes of the token that created the run, never widened; `None` (a plain token, or
    /// a checkpoint from before scopes existed): every scope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scopes: Option<Vec<String>>,
    /// Public status.
    pub status: Status,
    /// Where a `running` run is; `None` in every other status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// The run's limits, fixed at creation.
    pub budget: Budget,
    /// What the run has consumed so far.
    pub usage: Usage,
    /// The current batch of tool calls (empty outside a batch).
    #[serde(default)]
    pub calls: Vec<PendingCall>,
    /// Increases with every request sent to a pool or timer; replies carry it, and one with an
    /// older epoch is stale and changes nothing.
    pub epoch: u64,
    /// Model turns started (the `turn` of the API).
    pub turn: u32,
    /// Malformed replies in a row.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub corrections: u32,
    /// Retryable model failures in a row.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub model_retries: u32,
    /// Verifier rejections so far.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub verify_rejections: u32,
    /// The next model call is made without tools (no-progress escalation).
    #[serde(default, skip_serializing_if = "is_false")]
    pub force_final: bool,
    /// The budget that ran out, once the run is in its reserve turn: one final model call
    /// without tools, after which it ends `budget_exceeded` with that answer as its output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_final: Option<super::budget::Exhausted>,
    /// Context rebuilds after the provider said the request did not fit (at most one).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub context_rebuilds: u32,
    /// No-progress tracking.
    pub progress: Progress,
    /// The candidate final answer being verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate: Option<Value>,
    /// The final answer of a `succeeded` run, or the reserve turn's answer of a run that
    /// failed `budget_exceeded`; JSON when the answer is a JSON object or array, else text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<Value>,
    /// Why a `failed` run failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<RunError>,
    /// The model's question while `waiting_input`, with the model's id for the ask call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub question: Option<(String, String)>,
    /// Input given while the run was busy, delivered at its next model turn.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub queued_input: Vec<String>,
    /// Names of tools that succeeded in this run (for `tool_succeeded` verifiers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub succeeded_tools: Vec<String>,
    /// Operator decisions on calls of this run (call, approved?), so a repeated decision gets
    /// the same answer after its batch is over.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decided: Vec<(CallId, bool)>,
    /// Tools whose calls failed in a row in this run, with how many times (a success of the
    /// tool, or an operator skipping its held call, clears its entry).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_failures: Vec<(String, u32)>,
    /// The call whose operator decision `fail` ended the run (so a repeated `fail` answers
    /// the same).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_call: Option<CallId>,
    /// Highest control-inbox seq already consumed (applied, repeated or refused).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub controls_applied: u64,
    /// The most recent refused controls (inbox seq, code, message), so the answer to a control
    /// can be read back after a crash or from another node. Bounded by `MAX_CONTROL_REFUSALS`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub control_refusals: Vec<ControlRefusal>,
    /// The compensating calls of this run's successful calls of tools with a `compensate`
    /// rule, in the order those calls completed (run newest first, while `compensating`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub compensations: Vec<Compensation>,
    /// While `compensating`: how the run ends when its compensations are over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ending: Option<Ending>,
    /// Digest of the agent definition the run started with (instructions, model, tool schemas,
    /// budgets); a node whose definition differs does not take the run over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_digest: Option<String>,
    /// Times this run was restarted after a crash.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub restarts: u32,
    /// When the run was created, ms since the Unix epoch.
    pub created_at_ms: u64,
    /// When the last transition was applied, ms since the Unix epoch.
    pub updated_at_ms: u64,
    /// Equals the seq of the last event: one per transition.
    pub version: u64,
    /// The conversation so far (instructions are added by the context builder, not stored).
    /// Append-only. Stored apart from the body from format 3 (`run::format`), so a body
    /// leaves it out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub messages: Vec<Message>,
    /// Tool outputs kept in memory only as far as the context shows them, by reference to
    /// the stored transcript: message index → the stored output's whole length in bytes. The
    /// whole output is the stored transcript entry at that index, read back by `read_output`
    /// when a page goes beyond what is kept. Set by the run's actor for stored messages only
    /// (`trim_stored_outputs`); never stored itself.
    #[serde(skip)]
    pub trimmed_outputs: std::collections::BTreeMap<usize, usize>,
    /// Messages before this index were looked at by `trim_stored_outputs`. Never stored.
    #[serde(skip)]
    pub trim_checked: usize,
}

/// Whether the tool call `call_id` answered after `before` was a `read_output` call: the
/// nearest assistant message that made a call with that id says.
fn issued_by_read_output(before: &[Message], call_id: &str) -> bool {
    before
        .iter()
        .rev()
        .find_map(|m| match m {
            Message::Assistant { tool_calls, .. } => tool_calls
                .iter()
                .find(|c| c.id == call_id)
                .map(|c| c.name == crate::run::read_output::READ_OUTPUT_TOOL),
            _ => None,
        })
        .unwrap_or(false)
}

impl RunState {
    /// Keeps of each stored tool output (messages before `stored`) longer than `keep` bytes
    /// only its first `keep` bytes (cut on a character boundary, as the context builder cuts
    /// it) and records its whole length in `trimmed_outputs`, so a run's memory holds what
    /// the model is shown, not every output whole. Messages from `stored` on are not touched
    /// (they are not in the store yet), nor are `read_output`'s pages (shown whole). Each
    /// message is looked at once (`trim_checked`), so a commit's cost does not grow with the
    /// run. Pure; returns the bytes given back.
    pub fn trim_stored_outputs(&mut self, stored: usize, keep: usize) -> usize {
        let stored = stored.min(self.messages.len());
        let mut freed = 0;
        for i in self.trim_checked.min(stored)..stored {
            let (before, rest) = self.messages.split_at_mut(i);
            let Message::Tool { call_id, content } = &mut rest[0] else {
                continue;
            };
            if content.len() <= keep || issued_by_read_output(before, call_id) {
                continue;
            }
            let mut cut = keep;
            while cut > 0 && !content.is_char_boundary(cut) {
                cut -= 1;
            }
            self.trimmed_outputs.insert(i, content.len());
            freed += content.len() - cut;
            content.truncate(cut);
            content.shrink_to_fit();
        }
        self.trim_checked = self.trim_checked.max(stored);
        freed
    }

    /// Why the control at inbox `seq` was refused, if it was (and is still remembered).
    pub fn refusal(&self, seq: u64) -> Option<&ControlRefusal> {
        self.control_refusals.iter().find(|r| r.seq == seq)
    }

    /// A new run in `created`, at version 1 (its `run_created` event).
    pub fn new(
        id: RunId,
        tenant: String,
        agent: String,
        input: Value,
        budget: Budget,
        now_ms: u64,
    ) -> Self {
        RunState {
            id,
            tenant,
            agent,
            input,
            metadata: Value::Null,
            scopes: None,
            status: Status::Created,
            phase: None,
            budget,
            usage: Usage::default(),
            messages: Vec::new(),
            calls: Vec::new(),
            epoch: 0,
            turn: 0,
            corrections: 0,
            model_retries: 0,
            verify_rejections: 0,
            force_final: false,
            budget_final: None,
            context_rebuilds: 0,
            progress: Progress::default(),
            candidate: None,
            output: None,
            error: None,
            question: None,
            queued_input: Vec::new(),
            succeeded_tools: Vec::new(),
            decided: Vec::new(),
            tool_failures: Vec::new(),
            failed_call: None,
            controls_applied: 0,
            control_refusals: Vec::new(),
            compensations: Vec::new(),
            ending: None,
            agent_digest: None,
            restarts: 0,
            created_at_ms: now_ms,
            updated_at_ms: now_ms,
            version: 1,
            trimmed_outputs: Default::default(),
            trim_checked: 0,
        }
    }

    /// Whether the run is over (its status is terminal).
    pub fn is_terminal(&self) -> bool {
        self.status.is_terminal()
    }

    /// The call `call_id` of the current batch, if it is in it.
    pub fn call(&self, call_id: &CallId) -> Option<&PendingCall> {
        self.calls.iter().find(|c| &c.call_id == call_id)
    }

    /// Calls waiting for an operator (approval, or an unknown outcome).
    pub fn pending_approvals(&self) -> impl Iterator<Item = &PendingCall> {
        self.calls.iter().filter(|c| {
            matches!(
                c.status,
                CallStatus::AwaitingApproval | CallStatus::OutcomeUnknown
            )
        })
    }
}

/// Counters at zero and flags that are off are left out of a body (format 5).
fn is_zero<T: Default + PartialEq>(n: &T) -> bool {
    *n == T::default()
}

fn is_false(b: &bool) -> bool {
    !*b
}
