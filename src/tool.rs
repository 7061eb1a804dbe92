//! What a tool is to the runtime: the `Tool` trait, its declared policy (`ToolSpec`), the
//! result envelope the model sees, and the classified errors.
//!
//! Kinds of tools: native Rust (`builtin`), and — added by later modules — HTTP and MCP. Every
//! kind is checked the same way: one JSON Schema per tool, validated in `registry` before
//! anything runs; execution goes through the shared pool in `executor`.

pub mod approval;
pub mod builtin;
pub mod callback;
pub mod executor;
pub mod http;
pub mod mcp;
pub mod registry;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::ids::{CallId, RunId};
use crate::run::guard::Guard;

/// Longest error message of a tool result, in characters (cut after redaction).
pub const MAX_ERROR_MESSAGE_CHARS: usize = 500;

/// What running the tool does to the world, which decides what recovery may do with a call
/// whose outcome is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolEffect {
    /// No side effect: may be repeated freely.
    Read,
    /// Repeating with the same idempotency key is safe: resent after a crash.
    Idempotent,
    /// Repeating may double the effect: reconciled, or parked for an operator.
    Unsafe,
}

/// How much harm a wrong call of the tool can do; approval rules may key on it.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum RiskLevel {
    /// The lowest level.
    Low,
    /// The default.
    #[default]
    Medium,
    /// Above `medium`.
    High,
    /// The highest level (what `ApprovalRule::requires` assumes of an unknown tool).
    Critical,
}

/// When a call needs an operator's approval before it runs. Evaluated by
/// [`ApprovalRule::requires`] / [`ToolSpec::requires_approval`] (see `approval`).
///
/// In TOML: `approval = "never"`, `approval = "always"`,
/// `approval = { by_risk = { at_least = "high" } }`,
/// `approval = { when_argument = { pointer = "/env", equals = "prod" } }`,
/// `approval = { any_of = [ … ] }`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalRule {
    /// No call needs approval.
    Never,
    /// Every call needs approval.
    Always,
    /// Approval when the tool's declared `risk` is at least `at_least`.
    ByRisk {
        /// The lowest risk that needs approval.
        at_least: RiskLevel,
    },
    /// Approval when the argument at the JSON Pointer `pointer` is present and satisfies every
    /// condition given (`equals`, `one_of`, `matches` — a regular expression tested against a
    /// string argument). With no condition, presence alone requires approval.
    WhenArgument {
        /// Where the argument is (`""`: the whole arguments object).
        pointer: String,
        /// Met by a value equal to this one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        equals: Option<Value>,
        /// Met by a value equal to one of these.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        one_of: Option<Vec<Value>>,
        /// Met by a string this regular expression matches anywhere; a pattern that does not
        /// compile is met by every value (fail closed).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        matches: Option<String>,
    },
    /// Approval when any of the rules requires it.
    AnyOf(Vec<ApprovalRule>),
}

/// What happens to a call nobody approved or rejected within the tool's `approval_timeout`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalTimeoutAction {
    /// Answer the model as if an operator rejected the call (the default: fail closed).
    #[default]
    Reject,
    /// Run the call as if an operator approved it unchanged.
    Approve,
}

/// What a 401/403 answer of a tool (error code `permission`) does to the run. Never retried.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnPermissionError {
    /// The run ends `failed` with `permission_denied` (the default).
    #[default]
    Fail,
    /// The run waits for an operator (`waiting_approval`, reason `permission_error`): approve
    /// runs the call again, reject skips it (the model is told), fail ends the run.
    Operator,
}

/// Calls of one tool failing in a row in one run before the run waits for an operator
/// (`tool_failing`), unless the tool sets its own `max_failures`.
pub const DEFAULT_MAX_FAILURES: u32 = 3;

/// A tool's declared contract. The runtime enforces it whatever the model says.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    /// Unique name, `^[a-zA-Z0-9_-]{1,64}$`.
    pub name: String,
    /// What the tool does, as offered to the model.
    pub description: String,
    /// JSON Schema of the arguments (draft 2020-12).
    pub parameters: Value,
    /// What a call does to the world: decides retries and crash recovery.
    pub effect: ToolEffect,
    /// Declared harm potential (default `medium`); `ApprovalRule::ByRisk` keys on it.
    pub risk: RiskLevel,
    /// When a call needs an operator's approval before it runs.
    pub approval: ApprovalRule,
    /// How long a call of this tool waits for an operator's decision; `None` = forever.
    pub approval_timeout: Option<Duration>,
    /// The decision taken when `approval_timeout` passes.
    pub on_approval_timeout: ApprovalTimeoutAction,
    /// Bound of one attempt (also of one status check or poll); a slower attempt fails
    /// `timeout`.
    pub timeout: Duration,
    /// Serialized output larger than this is cut and marked `truncated`.
    pub max_output_bytes: usize,
    /// A polling tool (e.g. "check job status") may repeat the same call without counting as
    /// no progress.
    pub polling: bool,
    /// The tool can answer "did the call with this key run?" (see `Tool::status`).
    pub reconcilable: bool,
    /// Permissions, argument deny and path rules, and result projection (`run::guard`),
    /// checked by the runtime before approval and execution.
    pub guard: Arc<Guard>,
    /// Attempts of one call, the first included, when a `read` or `idempotent` tool fails
    /// transiently (retried by the executor with the same key; `unsafe` tools are never
    /// retried blindly).
    pub max_attempts: u32,
    /// The deadline of a call the tool accepted to finish later (`202`), counted from its
    /// acceptance; `None`: the tool's `timeout`.
    pub task_timeout: Option<Duration>,
    /// The first wait before polling an accepted call's status URL; later waits grow (with
    /// jitter) up to `poll_max_interval`.
    pub poll_interval: Duration,
    /// The longest wait between two polls of an accepted call.
    pub poll_max_interval: Duration,
    /// Calls of this tool (after the executor's retries) failing in a row in one run before
    /// the run waits for an operator with reason `tool_failing`; 0 = never (the model hears of
    /// every failure, and the no-progress rules apply).
    pub max_failures: u32,
    /// What a 401/403 answer does (see [`OnPermissionError`]).
    pub on_permission_error: OnPermissionError,
    /// The call that undoes a successful call of this tool when its run ends `cancelled` or
    /// `failed` (see [`Compensate`]).
    pub compensate: Option<Compensate>,
}

/// The most attempts a tool may configure for one call.
pub const MAX_CALL_ATTEMPTS: u32 = 10;

impl ToolSpec {
    /// A spec with conservative defaults: `unsafe`, `medium` risk, no approval, 30 s, 64 KiB
    /// output.
    pub fn new(name: impl Into<String>, description: impl Into<String>, parameters: Value) -> Self {
        ToolSpec {
            name: name.into(),
            description: description.into(),
            parameters,
            effect: ToolEffect::Unsafe,
            risk: RiskLevel::Medium,
            approval: ApprovalRule::Never,
            approval_timeout: None,
            on_approval_timeout: ApprovalTimeoutAction::Reject,
            timeout: Duration::from_secs(30),
            max_output_bytes: 64 * 1024,
            polling: false,
            reconcilable: false,
            guard: Arc::new(Guard::default()),
            max_attempts: 3,
            task_timeout: None,
            poll_interval: Duration::from_secs(1),
            poll_max_interval: Duration::from_secs(30),
            max_failures: DEFAULT_MAX_FAILURES,
            on_permission_error: OnPermissionError::Fail,
            compensate: None,
        }
    }

    /// How long an accepted call may take before it fails with `timeout`.
    pub fn task_deadline(&self) -> Duration {
        self.task_timeout.unwrap_or(self.timeout)
    }

    /// Declares the tool's effect.
    pub fn effect(mut self, effect: ToolEffect) -> Self {
        self.effect = effect;
        self
    }

    /// Declares the tool's risk.
    pub fn risk(mut self, risk: RiskLevel) -> Self {
        self.risk = risk;
        self
    }

    /// Sets when calls need approval.
    pub fn approval(mut self, approval: ApprovalRule) -> Self {
        self.approval = approval;
        self
    }

    /// Decide a pending approval with `action` after `after`.
    pub fn approval_timeout(mut self, after: Duration, action: ApprovalTimeoutAction) -> Self {
        self.approval_timeout = Some(after);
        self.on_approval_timeout = action;
        self
    }

    /// Sets the bound of one attempt.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the output cap, in bytes of serialized result data.
    pub fn max_output_bytes(mut self, n: usize) -> Self {
        self.max_output_bytes = n;
        self
    }

    /// Marks the tool as a polling tool (repeats are not counted as no progress).
    pub fn polling(mut self, polling: bool) -> Self {
        self.polling = polling;
        self
    }

    /// Sets the tool's permissions, argument rules and result projection.
    pub fn guard(mut self, guard: Guard) -> Self {
        self.guard = Arc::new(guard);
        self
    }

    /// Sets the attempts of one call, clamped to 1..=`MAX_CALL_ATTEMPTS`.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.clamp(1, MAX_CALL_ATTEMPTS);
        self
    }

    /// Failures in a row before an operator decides (0: never).
    pub fn max_failures(mut self, n: u32) -> Self {
        self.max_failures = n;
        self
    }

    /// Sets what a 401/403 answer does to the run.
    pub fn on_permission_error(mut self, action: OnPermissionError) -> Self {
        self.on_permission_error = action;
        self
    }

    /// Undo a successful call with `compensate` when the run ends `cancelled` or `failed`.
    pub fn compensate(mut self, compensate: Compensate) -> Self {
        self.compensate = Some(compensate);
        self
    }
}

/// Where one argument of a compensating call comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompensateArg {
    /// A JSON Pointer (RFC 6901) into the original call's arguments; `""` is all of them. A
    /// pointer that finds nothing leaves the argument out.
    Pointer(String),
    /// A fixed value (`{ value = … }` in config).
    Literal(Value),
}

/// `[tools.X] compensate = { tool = "undo_x", arguments = { name = "/pointer" | { value = … } } }`:
/// the call the runtime makes to undo a successful call of tool X.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Compensate {
    /// The compensating tool (any registered tool; it need not be on the agent's list).
    pub tool: String,
    /// The compensating call's arguments, by name.
    pub arguments: Vec<(String, CompensateArg)>,
}

impl Compensate {
    /// Parses the config form of the mapping: a string is a JSON Pointer (it must be `""` or
    /// start with `/`), `{ value = … }` a literal. On error: (argument name, message).
    pub fn parse(
        tool: &str,
        arguments: &std::collections::BTreeMap<String, Value>,
    ) -> Result<Self, (String, String)> {
        let mut out = Vec::with_capacity(arguments.len());
        for (name, v) in arguments {
            let arg = match v {
                Value::String(p) if p.is_empty() || p.starts_with('/') => {
                    CompensateArg::Pointer(p.clone())
                }
                Value::Object(m) if m.len() == 1 && m.contains_key("value") => {
                    CompensateArg::Literal(m["value"].clone())
                }
                _ => {
                    return Err((
                        name.clone(),
                        "must be a JSON Pointer into the call's arguments (\"/service\", \"\" for all of them) or a literal { value = … }".into(),
                    ));
                }
            };
            out.push((name.clone(), arg));
        }
        Ok(Compensate {
            tool: tool.to_owned(),
            arguments: out,
        })
    }

    /// The compensating call's arguments for a call made with `original`.
    pub fn arguments_for(&self, original: &Value) -> Value {
        let mut m = serde_json::Map::new();
        for (name, arg) in &self.arguments {
            let v = match arg {
                CompensateArg::Pointer(p) => original.pointer(p).cloned(),
                CompensateArg::Literal(v) => Some(v.clone()),
            };
            if let Some(v) = v {
                m.insert(name.clone(), v);
            }
        }
        Value::Object(m)
    }
}

/// Everything a tool gets besides its arguments.
#[derive(Debug, Clone)]
pub struct ToolContext {
    /// The tenant the call acts for (sent to HTTP tools as `X-Agentd-Tenant`, to MCP servers in
    /// the request's `_meta`).
    pub tenant: String,
    /// The run making the call.
    pub run_id: RunId,
    /// The call's id in its run (`PendingCall::call_id`, or a compensation's).
    pub call_id: CallId,
    /// Server-derived; identical on every attempt of this logical call.
    pub idempotency_key: String,
    /// Cancelled when the run is cancelled or the call times out.
    pub cancel: CancellationToken,
    /// How a tool may finish the call later (`202 Accepted`): the callback route and token,
    /// and where the tool notes that it accepted the call.
    pub long_running: LongRunning,
}

/// The long-running side of one call: the callback a tool may use to complete it, and the
/// note a tool leaves when it accepted the call to finish it later (read by the executor,
/// which then answers the run "accepted" instead of a result).
#[derive(Debug, Clone, Default)]
pub struct LongRunning {
    /// `None` when the daemon has no callback route (e.g. a runtime without HTTP API).
    pub callback: Option<callback::Callback>,
    accepted: Arc<std::sync::OnceLock<Accepted>>,
}

/// The tool accepted the call (`202 Accepted`) and finishes it later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    /// Where its status is polled (`None`: the tool only calls back).
    pub status_url: Option<String>,
}

impl LongRunning {
    /// A call's long-running side with `callback` (`None`: no callback route), not accepted.
    pub fn new(callback: Option<callback::Callback>) -> Self {
        LongRunning {
            callback,
            accepted: Arc::default(),
        }
    }

    /// Notes that the tool accepted the call; the first note counts.
    pub fn accept(&self, status_url: Option<String>) {
        let _ = self.accepted.set(Accepted { status_url });
    }

    /// The tool's note that it accepted the call; `None`: it did not (a plain result).
    pub fn accepted(&self) -> Option<&Accepted> {
        self.accepted.get()
    }
}

/// Classified tool failure codes, as the model and operators see them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolErrorCode {
    /// The arguments did not match the schema (also produced before execution).
    InvalidArgument,
    /// A transient failure that did not apply the effect (e.g. 429, connection refused).
    Retryable,
    /// The tool refused or failed definitively.
    Failed,
    /// The caller lacks permission.
    Permission,
    /// The call may or may not have taken effect (timeout, connection lost mid-call).
    OutcomeUnknown,
    /// The call exceeded its timeout.
    Timeout,
    /// The tool is not known, or not allowed for this agent.
    ToolNotAllowed,
    /// An operator rejected the call.
    ApprovalDenied,
    /// The tool pool was full; the call was not started.
    Overloaded,
    /// The run does not hold a scope the tool needs; the call was not started.
    PermissionDenied,
    /// An argument value is refused by the tool's deny or path rules; the call was not started.
    ArgumentDenied,
    /// The call kept failing (or was refused for lack of permission) and an operator chose to
    /// skip it: it is not run again.
    Skipped,
}

impl ToolErrorCode {
    /// The snake_case name the model and the API see (`invalid_argument`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            ToolErrorCode::InvalidArgument => "invalid_argument",
            ToolErrorCode::Retryable => "retryable",
            ToolErrorCode::Failed => "failed",
            ToolErrorCode::Permission => "permission",
            ToolErrorCode::OutcomeUnknown => "outcome_unknown",
            ToolErrorCode::Timeout => "timeout",
            ToolErrorCode::ToolNotAllowed => "tool_not_allowed",
            ToolErrorCode::ApprovalDenied => "approval_denied",
            ToolErrorCode::Overloaded => "overloaded",
            ToolErrorCode::PermissionDenied => "permission_denied",
            ToolErrorCode::ArgumentDenied => "argument_denied",
            ToolErrorCode::Skipped => "skipped",
        }
    }
}

/// A tool failure: a code and one short sentence for the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{}: {message}", code.as_str())]
pub struct ToolError {
    /// The class of the failure (decides retries and what the run does).
    pub code: ToolErrorCode,
    /// One short sentence for the model (redacted and cut before it leaves the executor).
    pub message: String,
    /// A tool-given minimum wait before another attempt (`Retry-After`); used by the
    /// executor's retries, never shown to the model.
    #[serde(skip)]
    pub retry_after: Option<Duration>,
}

impl ToolError {
    /// An error of `code` with `message`, and no `Retry-After`.
    pub fn new(code: ToolErrorCode, message: impl Into<String>) -> Self {
        ToolError {
            code,
            message: message.into(),
            retry_after: None,
        }
    }
}

/// The envelope a tool result travels in, to the model and into the event log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolResult {
    /// The call succeeded: `data` is set and `error` is not.
    pub ok: bool,
    /// The tool's output on success (a string prefix of it when `truncated`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// The failure, when `ok` is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ToolError>,
    /// The output was longer than the tool's `max_output_bytes` and was cut.
    #[serde(default)]
    pub truncated: bool,
}

impl ToolResult {
    /// A success carrying `data`.
    pub fn success(data: Value) -> Self {
        ToolResult {
            ok: true,
            data: Some(data),
            error: None,
            truncated: false,
        }
    }

    /// A failure carrying `error`.
    pub fn failure(error: ToolError) -> Self {
        ToolResult {
            ok: false,
            data: None,
            error: Some(error),
            truncated: false,
        }
    }

    /// The error's code; `None` for a success.
    pub fn error_code(&self) -> Option<ToolErrorCode> {
        self.error.as_ref().map(|e| e.code)
    }

    /// Caps the serialized size of `data` at `max_bytes`: a longer output is replaced by its
    /// first bytes (cut on a UTF-8 boundary) as a string, and `truncated` is set.
    pub fn capped(mut self, max_bytes: usize) -> Self {
        if let Some(data) = &self.data {
            let text = data.to_string();
            if text.len() > max_bytes {
                let mut cut = max_bytes;
                while cut > 0 && !text.is_char_boundary(cut) {
                    cut -= 1;
                }
                self.data = Some(Value::String(text[..cut].to_owned()));
                self.truncated = true;
            }
        }
        self
    }

    /// The result as it leaves the executor: redacted whole first, then its data capped at
    /// `max_bytes` and its error message at [`MAX_ERROR_MESSAGE_CHARS`]. In this order because
    /// a capped output is a plain string whose sensitive keys no rule recognises any more, and
    /// a secret cut at the limit would leak in part.
    pub fn sanitized(mut self, redactor: &crate::redact::Redactor, max_bytes: usize) -> Self {
        self.redact(redactor);
        if let Some(e) = &mut self.error
            && let std::borrow::Cow::Owned(m) =
                crate::redact::cut_chars(&e.message, MAX_ERROR_MESSAGE_CHARS)
        {
            e.message = m;
        }
        self.capped(max_bytes)
    }

    /// Removes secrets from the data and the error message (see `redact`).
    pub fn redact(&mut self, redactor: &crate::redact::Redactor) {
        if let Some(d) = &mut self.data {
            redactor.redact_value_in_place(d);
        }
        if let Some(e) = &mut self.error
            && let std::borrow::Cow::Owned(m) = redactor.redact_str(&e.message)
        {
            e.message = m;
        }
    }

    /// The text of the tool message the model receives.
    pub fn to_message_content(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| r#"{"ok":false}"#.to_owned())
    }
}

/// A tool the runtime can call.
#[async_trait]
pub trait Tool: Send + Sync + 'static {
    /// The tool's declared contract (name, schema, effect, policy).
    fn spec(&self) -> &ToolSpec;

    /// Runs the call. Arguments have already been validated against `spec().parameters`.
    async fn call(&self, ctx: &ToolContext, arguments: Value) -> Result<Value, ToolError>;

    /// Reconciliation: did the call with `ctx.idempotency_key` run? `Ok(Some(result))` if it
    /// did, `Ok(None)` if it never ran. Only asked when `spec().reconcilable`.
    async fn status(&self, ctx: &ToolContext) -> Result<Option<Value>, ToolError> {
        let _ = ctx;
        Err(ToolError::new(
            ToolErrorCode::Failed,
            "this tool cannot report the status of a call",
        ))
    }

    /// Long-running calls: asks `status_url` how the accepted call stands. `Ok(None)`: still
    /// running; `Ok(Some(result))`: finished; `Err` with `retryable` or `timeout`: ask again
    /// later; any other `Err`: the call failed with it.
    async fn poll(&self, ctx: &ToolContext, status_url: &str) -> Result<Option<Value>, ToolError> {
        let _ = (ctx, status_url);
        Err(ToolError::new(
            ToolErrorCode::Failed,
            "this tool cannot be polled",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn capping_cuts_on_char_boundary_and_marks_truncated() {
        let r = ToolResult::success(json!("ééééé")).capped(4);
        assert!(r.truncated);
        assert_eq!(r.data, Some(json!("\"é")));
        let small = ToolResult::success(json!({"a": 1})).capped(100);
        assert!(!small.truncated);
    }

    #[test]
    fn sanitizing_redacts_the_whole_output_before_cutting_it() {
        let secret = "planted-secret-4c1d9e";
        let redactor = crate::redact::Redactor::with_secrets([secret]);
        let filler = "z".repeat(200);
        // The cap falls inside the secret and far before the end: cut first, the password
        // would be a plain string and half the secret would stay.
        let data = json!({"db_password": "pw-0a9b8c7d", "log": format!("{}{secret}{filler}", "y".repeat(40))});
        let cap = data.to_string().find(secret).unwrap() + 6;
        let r = ToolResult::success(data).sanitized(&redactor, cap);
        assert!(r.truncated);
        let text = r.data.unwrap().to_string();
        assert!(
            !text.contains("pw-0a9b8c7d") && !text.contains(&secret[..6]),
            "{text}"
        );
        let long = format!("{}{secret}", "e".repeat(MAX_ERROR_MESSAGE_CHARS - 3));
        let failed = ToolResult::failure(ToolError::new(ToolErrorCode::Failed, long))
            .sanitized(&redactor, cap);
        let message = failed.error.unwrap().message;
        assert!(!message.contains(&secret[..3]), "{message}");
        assert_eq!(message.chars().count(), MAX_ERROR_MESSAGE_CHARS + 1);
    }
}
