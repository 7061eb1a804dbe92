//! The wire shapes of the HTTP API (and only those): request bodies, query strings and the
//! JSON the API answers with. Conversions from runtime types live here too.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::clock::rfc3339;
use crate::run::{CallStatus, RunError, RunState};
use crate::runtime::AgentInfo;
use crate::store::EventRecord;

/// `POST /v1/runs`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateRunRequest {
    /// Name of a configured agent the token may use (another tenant's agent answers as unknown).
    pub agent: String,
    /// The goal: text or any JSON value.
    pub input: Value,
    /// Client key, 1 to 255 printable ASCII characters without spaces: a repeat with the same
    /// key returns the run it made (200) instead of a new one; with another agent or input it
    /// is `422 idempotency_key_mismatch`.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// Limits for this run, each capped by the daemon's `limits`; `None`: the agent's defaults.
    #[serde(default, deserialize_with = "budget_object")]
    pub budget: Option<BudgetRequest>,
    /// Any JSON kept with the run and shown back on it, bounded by `limits.max_metadata_bytes`.
    #[serde(default)]
    pub metadata: Option<Value>,
}

/// `budget`: an object (or null), never the array form serde would also take for a struct; a
/// count written as a float with no fraction (`12.0`, a JSON Schema integer) is that integer.
fn budget_object<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<BudgetRequest>, D::Error> {
    use serde::de::Error as _;
    match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(mut m)) => {
            for key in ["max_turns", "max_tool_calls", "max_tokens"] {
                if let Some(Value::Number(n)) = m.get(key)
                    && n.as_u64().is_none()
                    && let Some(f) = n.as_f64()
                    && f.fract() == 0.0
                    && (0.0..=u64::MAX as f64).contains(&f)
                {
                    m.insert(key.into(), Value::from(f as u64));
                }
            }
            serde_json::from_value(Value::Object(m))
                .map(Some)
                .map_err(D::Error::custom)
        }
        Some(other) => Err(D::Error::custom(format!(
            "budget must be an object, not {}",
            match other {
                Value::Array(_) => "an array",
                Value::String(_) => "a string",
                Value::Number(_) => "a number",
                _ => "a boolean",
            }
        ))),
    }
}

/// Budget a client asks for; unset fields take the agent's defaults.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetRequest {
    /// Most model calls (turns), from 1 to `limits.max_turns`.
    #[serde(default)]
    pub max_turns: Option<u32>,
    /// Most tool calls dispatched, from 1 to `limits.max_tool_calls`.
    #[serde(default)]
    pub max_tool_calls: Option<u32>,
    /// Most input plus output tokens, from 1 to `limits.max_tokens`.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// From the run's creation, e.g. "5m".
    #[serde(default)]
    pub deadline: Option<String>,
}

/// `POST /v1/runs/{id}/cancel` (the body is optional).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CancelRequest {
    /// Why, at most 4096 bytes; recorded in the `run_cancelled` event.
    #[serde(default)]
    pub reason: Option<String>,
}

/// An operator's decision on one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// Run the call, or send it again (a held or `outcome_unknown` call), with `arguments` in
    /// place of the model's when given.
    Approve,
    /// Do not run the call: the model gets an error result for it (`approval_denied`, or
    /// `skipped` for a held call) and the run goes on.
    Reject,
    /// End the run `failed` (e.g. a tool that keeps failing will not recover).
    Fail,
}

/// `POST /v1/runs/{id}/approvals/{call_id}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionRequest {
    /// What to do with the call.
    pub decision: Decision,
    /// Why, at most 4096 bytes; with `fail`, it goes into the run error's message.
    #[serde(default)]
    pub reason: Option<String>,
    /// Approve with edited arguments, a JSON object (validated again against the tool's
    /// schema); refused with any other decision. Any other JSON type is `invalid_request`.
    #[serde(default)]
    pub arguments: Option<serde_json::Map<String, Value>>,
}

/// `POST /v1/runs/{id}/input`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputRequest {
    /// The answer or message for the model: not empty, at most `limits.max_input_text_bytes`.
    pub text: String,
}

/// `GET /v1/runs` query.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ListQuery {
    /// Only runs with this status (`created`, `running`, …); an unknown one is `400`.
    #[serde(default)]
    pub status: Option<String>,
    /// Only runs of this agent.
    #[serde(default)]
    pub agent: Option<String>,
    /// Page size, from 1; default 20, capped at `limits.max_page_size`.
    #[serde(default)]
    pub limit: Option<usize>,
    /// The `next_cursor` of the previous page; `None`: the newest runs.
    #[serde(default)]
    pub cursor: Option<String>,
}

/// `GET /v1/runs/{id}/events` query.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct EventsQuery {
    /// Only events with a larger seq; `None`: from the first. With SSE, `Last-Event-ID` wins.
    #[serde(default)]
    pub after: Option<u64>,
    /// Most events returned (JSON only), from 1; default and cap 1000.
    #[serde(default)]
    pub limit: Option<usize>,
}

/// Token and call counts of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageDto {
    /// Model calls made (one per turn).
    pub turns: u32,
    /// Tool calls dispatched.
    pub tool_calls: u32,
    /// Prompt tokens the provider reported, summed over the run's model calls.
    pub input_tokens: u64,
    /// Completion tokens the provider reported, summed over the run's model calls.
    pub output_tokens: u64,
}

/// A run's limits; `deadline` is an RFC 3339 time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BudgetDto {
    /// Most model calls (turns).
    pub max_turns: u32,
    /// Most tool calls dispatched.
    pub max_tool_calls: u32,
    /// Most input plus output tokens.
    pub max_tokens: u64,
    /// When the run fails `budget_exceeded`; `None`: no deadline.
    pub deadline: Option<String>,
}

/// A call waiting for an operator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingApprovalDto {
    /// agentd's id of the call (`call_<turn>_<index>`), the `{call_id}` of the decision route.
    pub call_id: String,
    /// The tool the call is for.
    pub tool: String,
    /// The arguments the call would run with (redacted).
    pub arguments: Value,
    /// `approval` (the tool needs one), `outcome_unknown` (a crash left it unknown),
    /// `tool_failing` (the tool keeps failing) or `permission_error` (the tool refused it).
    pub reason: String,
}

/// One compensating call of a run: what undoes which successful call, and how it went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompensationDto {
    /// The compensating call's own id (the original's with `_undo`).
    pub call_id: String,
    /// The call it undoes, and that call's tool.
    pub for_call: String,
    /// The tool of the call it undoes (`for_call`).
    pub for_tool: String,
    /// The tool that undoes it (the `compensate` rule's tool).
    pub tool: String,
    /// The compensating call's arguments (redacted).
    pub arguments: Value,
    /// Its `Idempotency-Key` (derived from the original call's).
    pub key: String,
    /// `pending`, `dispatched`, `reconciling` (while it runs); `done`, `failed`, `skipped`,
    /// `outcome_unknown` (final).
    pub status: String,
    /// Times it was sent to the tool so far.
    pub attempts: u32,
    /// The compensating tool's error (`failed`, `outcome_unknown`).
    pub error: Option<crate::tool::ToolError>,
    /// Why it was `skipped`.
    pub reason: Option<String>,
}

/// While a run is compensating: how it ends once its compensations are over.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EndingDto {
    /// `cancelled` or `failed`.
    pub status: String,
    /// The error it ends `failed` with (redacted); `None` for a cancel.
    pub error: Option<RunError>,
}

/// The run as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunDto {
    /// The run id (`run_…`).
    pub id: String,
    /// The agent it runs.
    pub agent: String,
    /// The goal as given (text or JSON).
    #[serde(default)]
    pub input: Value,
    /// `created`, `running`, `waiting_approval`, `waiting_input`, `succeeded`, `failed` or
    /// `cancelled`.
    pub status: String,
    /// Where a `running` run is in its step (`awaiting_model`, `executing_tools`,
    /// `compensating`, …); `None` in the other statuses.
    pub phase: Option<String>,
    /// Model turns started.
    pub turn: u32,
    /// What the run has used so far.
    pub usage: UsageDto,
    /// The run's limits.
    pub budget: BudgetDto,
    /// Calls waiting for an operator; always empty once the run ended or is ending.
    pub pending_approvals: Vec<PendingApprovalDto>,
    /// The model's question while `waiting_input`.
    pub awaiting_input: Option<String>,
    /// The final answer (redacted); also set on `budget_exceeded` when the reserve turn
    /// answered.
    pub output: Option<Value>,
    /// Why the run `failed` (redacted).
    pub error: Option<RunError>,
    /// The compensating calls of its successful calls (see docs/api.md, "Compensation").
    #[serde(default)]
    pub compensations: Vec<CompensationDto>,
    /// Set while `phase` is `compensating`: the end the run is heading for.
    #[serde(default)]
    pub ending: Option<EndingDto>,
    /// The client's `metadata` as given; `null` (left out) when none was.
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub metadata: Value,
    /// The creating token's scopes; absent: every scope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scopes: Option<Vec<String>>,
    /// RFC 3339 time of creation.
    pub created_at: String,
    /// RFC 3339 time of the last transition.
    pub updated_at: String,
    /// The seq of the run's last event; it grows by one per transition.
    pub version: u64,
}

impl From<&RunState> for RunDto {
    fn from(r: &RunState) -> Self {
        RunDto {
            id: r.id.to_string(),
            agent: r.agent.clone(),
            input: r.input.clone(),
            status: r.status.as_str().to_owned(),
            phase: r.phase.map(|p| p.as_str().to_owned()),
            turn: r.turn,
            usage: UsageDto {
                turns: r.usage.turns,
                tool_calls: r.usage.tool_calls,
                input_tokens: r.usage.input_tokens,
                output_tokens: r.usage.output_tokens,
            },
            budget: BudgetDto {
                max_turns: r.budget.max_turns,
                max_tool_calls: r.budget.max_tool_calls,
                max_tokens: r.budget.max_tokens,
                deadline: r.budget.deadline_ms.map(rfc3339),
            },
            // A finished run's leftover calls can no longer be decided.
            pending_approvals: r
                .pending_approvals()
                .filter(|_| !r.status.is_terminal() && r.ending.is_none())
                .map(|c| PendingApprovalDto {
                    call_id: c.call_id.to_string(),
                    tool: c.tool.clone(),
                    arguments: c.arguments.clone(),
                    reason: match (c.status, c.hold) {
                        (CallStatus::OutcomeUnknown, _) => "outcome_unknown",
                        (_, Some(h)) => h.as_str(),
                        (_, None) => "approval",
                    }
                    .to_owned(),
                })
                .collect(),
            awaiting_input: r.question.as_ref().map(|(q, _)| q.clone()),
            output: r.output.clone(),
            error: r.error.clone(),
            compensations: r
                .compensations
                .iter()
                .map(|k| CompensationDto {
                    call_id: k.call_id.to_string(),
                    for_call: k.for_call.to_string(),
                    for_tool: k.for_tool.clone(),
                    tool: k.tool.clone(),
                    arguments: k.arguments.clone(),
                    key: k.key.clone(),
                    status: serde_json::to_value(k.status)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default(),
                    attempts: k.attempts,
                    error: k.result.as_ref().and_then(|r| r.error.clone()),
                    reason: k.reason.clone(),
                })
                .collect(),
            ending: r.ending.as_ref().map(|e| EndingDto {
                status: e.status.as_str().to_owned(),
                error: e.error.clone(),
            }),
            metadata: r.metadata.clone(),
            scopes: r.scopes.clone(),
            created_at: rfc3339(r.created_at_ms),
            updated_at: rfc3339(r.updated_at_ms),
            version: r.version,
        }
    }
}

impl RunDto {
    /// The run as the API shows it, scrubbed of secrets: output, error message, pending
    /// approval arguments and the model's question.
    pub fn redacted(run: &RunState, redactor: &crate::redact::Redactor) -> Self {
        let mut dto = RunDto::from(run);
        if redactor.is_noop() {
            return dto;
        }
        if let Some(o) = &mut dto.output {
            redactor.redact_value_in_place(o);
        }
        redactor.redact_value_in_place(&mut dto.input);
        if let Some(e) = &mut dto.error {
            e.message = redactor.redact_str(&e.message).into_owned();
        }
        for p in &mut dto.pending_approvals {
            redactor.redact_value_in_place(&mut p.arguments);
        }
        for k in &mut dto.compensations {
            redactor.redact_value_in_place(&mut k.arguments);
            if let Some(e) = &mut k.error {
                e.message = redactor.redact_str(&e.message).into_owned();
            }
        }
        if let Some(e) = dto.ending.as_mut().and_then(|e| e.error.as_mut()) {
            e.message = redactor.redact_str(&e.message).into_owned();
        }
        if let Some(q) = &mut dto.awaiting_input {
            *q = redactor.redact_str(q).into_owned();
        }
        dto
    }
}

/// One page of `GET /v1/runs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunListDto {
    /// The runs, newest first (redacted).
    pub runs: Vec<RunDto>,
    /// The `cursor` of the next page; `None`: this is the last page.
    pub next_cursor: Option<String>,
}

/// One event of a run's log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventDto {
    /// Position in the log, from 1, without gaps (the SSE `id`).
    pub seq: u64,
    /// RFC 3339 time it was recorded.
    pub at: String,
    /// snake_case event type (`run_created`, `tool_call_started`, …), `type` on the wire.
    #[serde(rename = "type")]
    pub kind: String,
    /// The event's own fields, by type.
    pub data: Value,
}

impl From<&EventRecord> for EventDto {
    fn from(e: &EventRecord) -> Self {
        EventDto {
            seq: e.seq,
            at: rfc3339(e.at_ms),
            kind: e.kind.clone(),
            data: e.data.clone(),
        }
    }
}

/// `GET /v1/runs/{id}/events`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventListDto {
    /// The events after `after`, in seq order.
    pub events: Vec<EventDto>,
}

/// `GET /v1/runs/{id}/messages?after=&limit=`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessagesQuery {
    /// Start after this position (`next_cursor` of the previous page); `None`: from the first.
    #[serde(default)]
    pub after: Option<u64>,
    /// Page size, from 1; default 100, capped at `limits.max_page_size`.
    #[serde(default)]
    pub limit: Option<usize>,
}

/// One message of a run's transcript, as the model saw it (redacted).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessageDto {
    /// Position in the transcript, from 1; `after` continues after it.
    pub index: u64,
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text (redacted); `None` for an assistant message with only tool calls.
    pub content: Option<String>,
    /// The calls an assistant message asked for (empty otherwise).
    pub tool_calls: Vec<MessageToolCallDto>,
    /// The model's id of the call a `tool` message answers.
    pub tool_call_id: Option<String>,
}

/// A tool call as the model wrote it: `arguments` is the JSON text it gave.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessageToolCallDto {
    /// The model's id of the call (not agentd's `call_…`).
    pub id: String,
    /// The tool it asked for.
    pub name: String,
    /// The arguments as JSON text (redacted).
    pub arguments: String,
}

/// `GET /v1/runs/{id}/messages`: `next_cursor` is the `after` of the next page.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessageListDto {
    /// The page, in transcript order.
    pub messages: Vec<MessageDto>,
    /// The position of the page's last message; `None`: no message follows.
    pub next_cursor: Option<u64>,
}

/// Redacts text that may be JSON (a tool envelope, call arguments): as JSON when it parses,
/// so secret-looking keys are caught too, as text otherwise.
fn redact_text(text: &str, redactor: &crate::redact::Redactor) -> String {
    if redactor.is_noop() {
        return text.to_owned();
    }
    match serde_json::from_str::<Value>(text) {
        Ok(mut v) if v.is_object() || v.is_array() => {
            redactor.redact_value_in_place(&mut v);
            v.to_string()
        }
        _ => redactor.redact_str(text).into_owned(),
    }
}

impl MessageDto {
    /// `message` at transcript position `index`, scrubbed of secrets: its content and call
    /// arguments are redacted as JSON when they parse, as text otherwise.
    pub fn redacted(
        index: u64,
        message: &crate::model::Message,
        redactor: &crate::redact::Redactor,
    ) -> Self {
        use crate::model::Message;
        let (role, content, tool_calls, tool_call_id) = match message {
            Message::System { content } => ("system", Some(content.as_str()), &[][..], None),
            Message::User { content } => ("user", Some(content.as_str()), &[][..], None),
            Message::Assistant {
                content,
                tool_calls,
            } => ("assistant", content.as_deref(), &tool_calls[..], None),
            Message::Tool { call_id, content } => (
                "tool",
                Some(content.as_str()),
                &[][..],
                Some(call_id.clone()),
            ),
        };
        MessageDto {
            index,
            role: role.to_owned(),
            content: content.map(|c| redact_text(c, redactor)),
            tool_calls: tool_calls
                .iter()
                .map(|c| MessageToolCallDto {
                    id: c.id.clone(),
                    name: c.name.clone(),
                    arguments: redact_text(&c.arguments, redactor),
                })
                .collect(),
            tool_call_id,
        }
    }
}

/// A tool as an agent offers it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDto {
    /// The name the model calls it by.
    pub name: String,
    /// What the model is told it does.
    pub description: String,
    /// JSON Schema of its arguments.
    pub parameters: Value,
}

/// A configured agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentDto {
    /// The agent's name (the `agent` of a new run).
    pub name: String,
    /// Key of its model provider (a `[models.X]` entry), not the upstream model name.
    pub model: String,
    /// The tools the model is offered.
    pub tools: Vec<ToolDto>,
}

impl From<&AgentInfo> for AgentDto {
    fn from(a: &AgentInfo) -> Self {
        AgentDto {
            name: a.name.clone(),
            model: a.model.clone(),
            tools: a
                .tools
                .iter()
                .map(|t| ToolDto {
                    name: t.name.clone(),
                    description: t.description.clone(),
                    parameters: t.parameters.clone(),
                })
                .collect(),
        }
    }
}

/// `GET /v1/agents`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentListDto {
    /// The agents the token may use, by name.
    pub agents: Vec<AgentDto>,
}

/// `GET /healthz`, `GET /readyz`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthDto {
    /// `ok` (`/healthz`) or `ready` (`/readyz`).
    pub status: String,
    /// `/readyz`: runs whose stored record cannot be read; every other run is served.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quarantined: Vec<QuarantinedRunDto>,
}

/// A run left out because its stored record cannot be read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuarantinedRunDto {
    /// The run id.
    pub id: String,
    /// Why its record cannot be read (redacted, at most 300 characters).
    pub reason: String,
}

/// `GET /v1/approvals` query.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ApprovalsQuery {
    /// Page size, from 1; default 50, capped at `limits.max_page_size`.
    #[serde(default)]
    pub limit: Option<usize>,
    /// The `next_cursor` of the previous page; `None`: the oldest waiting calls.
    #[serde(default)]
    pub cursor: Option<String>,
}

/// One call waiting for an operator, in the approvals inbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalDto {
    /// The run the call belongs to.
    pub run_id: String,
    /// agentd's id of the call, the `{call_id}` of the decision route.
    pub call_id: String,
    /// The run's agent.
    pub agent: String,
    /// The tool the call is for.
    pub tool: String,
    /// The arguments the call would run with (redacted).
    pub arguments: Value,
    /// `policy` (the tool's approval rule), `outcome_unknown` (a crash left it unknown),
    /// `tool_failing` (a tool that keeps failing waits for a decision) or `permission_error`
    /// (the tool refused the call with 401/403 and its policy asks an operator).
    pub reason: String,
    /// RFC 3339 time the call began waiting.
    pub requested_at: String,
    /// When the tool's `approval_timeout` decides the call; `null`: it waits for ever.
    pub expires_at: Option<String>,
}

/// `GET /v1/approvals`: oldest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApprovalListDto {
    /// The page, oldest first.
    pub approvals: Vec<ApprovalDto>,
    /// The `cursor` of the next page; `None`: this is the last page.
    pub next_cursor: Option<String>,
}
