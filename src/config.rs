//! The daemon's configuration: one `Config` tree (TOML file, then `AGENTD__SECTION__KEY`
//! environment overrides, then CLI flags), `validate()` with errors that name the key, the
//! built-in demo configuration, and the mapping of `[runtime]` onto `RuntimeConfig`.
//!
//! Every key is documented with its default in `config/default.toml`. Unknown keys are an
//! error. Secrets (tenant tokens, API keys) may be written `"env:NAME"` to read them from the
//! environment; they are resolved when the daemon starts and never printed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::model::gateway::{GatewayConfig, ModelLimits};
use crate::model::scripted::{CassetteReply, Rule};
use crate::pool::PoolSize;
use crate::run::Policy;
use crate::run::progress::ProgressPolicy;
use crate::runtime::RuntimeConfig;
use crate::runtime::supervisor::RestartPolicy;

/// Prefix of environment overrides: `AGENTD__SERVER__LISTEN=0.0.0.0:7700`.
pub const ENV_PREFIX: &str = "AGENTD__";

/// Names accepted by `[tools.NAME] kind = "builtin"`, `builtin = "…"`.
pub const BUILTINS: &[&str] = &["echo", "add", "counting"];

/// What is wrong with a configuration. Messages name the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The config file could not be read.
    #[error("could not read config file {path}: {message}")]
    Read {
        /// The file as given.
        path: String,
        /// The I/O error.
        message: String,
    },
    /// Not TOML, or TOML that does not fit the `Config` tree (wrong type, unknown key), after
    /// environment overrides; also a failure to print the configuration.
    #[error("invalid config: {0}")]
    Parse(String),
    /// A value that parses but is not allowed.
    #[error("{key}: {message}")]
    Invalid {
        /// The key, as written in the file (`tools.deploy.url`, `tenants[0].tokens[1]`) or
        /// the environment variable of a malformed override.
        key: String,
        /// What is wrong with it.
        message: String,
    },
}

fn invalid(key: impl Into<String>, message: impl Into<String>) -> Error {
    Error::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

/// Whether the JSON Pointer `pointer` can name a value of arguments that fit `schema`: each
/// segment must be a declared property where the schema declares properties (and allows no
/// others), or an array index where it declares items.
fn pointer_fits(schema: &Value, pointer: &str) -> Result<(), String> {
    let mut node = schema;
    let mut path = String::new();
    for raw in pointer.split('/').skip(1) {
        let seg = raw.replace("~1", "/").replace("~0", "~");
        path.push('/');
        path.push_str(raw);
        if let Some(props) = node.get("properties").and_then(Value::as_object) {
            match props.get(&seg) {
                Some(next) => {
                    node = next;
                    continue;
                }
                None if node.get("additionalProperties") == Some(&Value::Bool(false))
                    || !props.is_empty() =>
                {
                    return Err(format!(
                        "`{path}` is not a property of the tool's parameters (they declare {})",
                        props
                            .keys()
                            .map(|k| format!("`{k}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                }
                None => return Ok(()),
            }
        }
        if let Some(items) = node.get("items") {
            if seg.parse::<usize>().is_err() {
                return Err(format!("`{path}` must be an array index"));
            }
            node = items;
            continue;
        }
        // The schema says nothing more about this part: any pointer may fit.
        return Ok(());
    }
    Ok(())
}

/// The whole configuration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `[server]`: the HTTP listener, shutdown and callback URL.
    pub server: ServerConfig,
    /// `[store]`: where runs are kept.
    pub store: StoreConfig,
    /// `[[tenants]]`: who may call the API, with which tokens. A file must define at least one.
    pub tenants: Vec<TenantConfig>,
    /// `[models.NAME]`: model providers by name (what an agent's `model` names).
    pub models: BTreeMap<String, ModelConfig>,
    /// `[tools.NAME]`: tools by the name the model calls (an MCP entry is a whole server).
    pub tools: BTreeMap<String, ToolConfig>,
    /// `[agents.NAME]`: agents by the name a run is created with.
    pub agents: BTreeMap<String, AgentConfig>,
    /// `[runtime]`: pools, retries, leases and run policies.
    pub runtime: RuntimeSection,
    /// `[limits]`: bounds of the HTTP edge and per-tenant quotas.
    pub limits: LimitsConfig,
    /// `[secrets]`: extra values and patterns to redact.
    pub secrets: SecretsConfig,
    /// `[telemetry]`: OTLP traces and the tenant label of metrics.
    pub telemetry: TelemetrySection,
}

/// `[telemetry]`: OpenTelemetry traces over OTLP/HTTP (off unless `otlp_endpoint` is set) and
/// the tenant label of metrics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetrySection {
    /// The OTLP/HTTP collector's base URL (e.g. `http://127.0.0.1:4318`); spans are posted as
    /// JSON to `{otlp_endpoint}/v1/traces`. Unset: no traces.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported spans.
    pub service_name: String,
    /// Upper bound of one export request.
    #[serde(with = "crate::config_duration")]
    pub export_timeout: Duration,
    /// A partial batch of spans is sent after this long.
    #[serde(with = "crate::config_duration")]
    pub export_interval: Duration,
    /// Spans waiting to be sent at most; more are dropped (`agentd_trace_spans_dropped_total`).
    pub queue_size: usize,
    /// Spans per export request at most.
    pub max_batch: usize,
    /// Label metrics by tenant id too (`/metrics` needs no token, so off by default).
    pub tenant_labels: bool,
}

impl Default for TelemetrySection {
    fn default() -> Self {
        let o = crate::telemetry::OtlpConfig::new("");
        TelemetrySection {
            otlp_endpoint: None,
            service_name: "agentd".into(),
            export_timeout: o.timeout,
            export_interval: o.interval,
            queue_size: o.queue_size,
            max_batch: o.max_batch,
            tenant_labels: false,
        }
    }
}

impl TelemetrySection {
    fn validate(&self) -> Result<(), Error> {
        if let Some(url) = &self.otlp_endpoint {
            let parsed = reqwest::Url::parse(url).map_err(|e| {
                invalid(
                    "telemetry.otlp_endpoint",
                    format!("{e} (write e.g. \"http://127.0.0.1:4318\")"),
                )
            })?;
            if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
                return Err(invalid(
                    "telemetry.otlp_endpoint",
                    "must be an http:// or https:// URL with a host (write e.g. \"http://127.0.0.1:4318\")",
                ));
            }
        }
        if self.service_name.trim().is_empty() {
            return Err(invalid("telemetry.service_name", "must not be empty"));
        }
        for (key, d) in [
            ("telemetry.export_timeout", self.export_timeout),
            ("telemetry.export_interval", self.export_interval),
        ] {
            if d.is_zero() {
                return Err(invalid(key, "must be more than 0s"));
            }
        }
        for (key, n) in [
            ("telemetry.queue_size", self.queue_size),
            ("telemetry.max_batch", self.max_batch),
        ] {
            if n == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        Ok(())
    }
}

/// `[secrets]`: extra values and patterns the redactor removes from events, API output, logs
/// and tool results (besides the model API keys, tenant tokens and tool tokens, which it always
/// knows).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SecretsConfig {
    /// Secret values (literal or `env:NAME`); each is replaced by `[redacted]` wherever it
    /// appears.
    pub values: Vec<Secret>,
    /// Regular expressions whose matches are redacted inside any string.
    pub patterns: Vec<String>,
}

/// `[server]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address the HTTP API listens on.
    pub listen: String,
    /// Upper bound of a graceful shutdown (HTTP drain plus stopping the runs).
    #[serde(with = "crate::config_duration")]
    pub shutdown_timeout: Duration,
    /// Interval of SSE keep-alive comments.
    #[serde(with = "crate::config_duration")]
    pub sse_keep_alive: Duration,
    /// A request's headers must arrive within this, counted from when the connection is ready
    /// for one (accepted, or idle after a response): it bounds slow senders and idle
    /// keep-alive connections alike.
    #[serde(with = "crate::config_duration")]
    pub header_read_timeout: Duration,
    /// Open HTTP connections at most; beyond that new ones wait in the listen backlog.
    pub max_connections: usize,
    /// A connection whose client takes no bytes for this long, while there are some to send,
    /// is closed (a reader that stopped reading, e.g. an SSE client).
    #[serde(with = "crate::config_duration")]
    pub write_timeout: Duration,
    /// The base URL tools reach this daemon at, for the callback route of long-running tools
    /// (`X-Agentd-Callback-Url`). Default: `http://` and the address the daemon listens on
    /// (`127.0.0.1` for an unspecified address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_url: Option<String>,
    /// The key of per-call callback tokens (literal or `env:NAME`); every node of a cluster
    /// needs the same. Default: derived from the configured tenant tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub callback_secret: Option<Secret>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: "127.0.0.1:7700".into(),
            shutdown_timeout: Duration::from_secs(10),
            sse_keep_alive: Duration::from_secs(15),
            header_read_timeout: Duration::from_secs(10),
            max_connections: 4096,
            write_timeout: Duration::from_secs(30),
            public_url: None,
            callback_secret: None,
        }
    }
}

/// `[store]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// `memory:` (nothing survives a restart), `file:./data` (embedded), `redis://…` or
    /// `redis+cluster://host:port,…`.
    pub url: String,
}

/// The store used when none is configured.
pub const DEFAULT_STORE_URL: &str = "file:./data";

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            url: DEFAULT_STORE_URL.into(),
        }
    }
}

/// A secret value: literal, or `env:NAME`. Its `Debug` never shows a literal.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.env_name().is_some() {
            write!(f, "{:?}", self.0)
        } else {
            f.write_str("\"<redacted>\"")
        }
    }
}

impl Secret {
    /// The variable name of an `env:NAME` reference.
    pub fn env_name(&self) -> Option<&str> {
        self.0.strip_prefix("env:")
    }

    /// The value, reading the environment for `env:NAME`. `key` names the setting in errors.
    pub fn resolve(&self, key: &str) -> Result<String, Error> {
        match self.env_name() {
            Some(name) => match std::env::var(name) {
                Ok(v) if !v.is_empty() => Ok(v),
                _ => Err(invalid(
                    key,
                    format!("environment variable {name} is not set (or is empty)"),
                )),
            },
            None => Ok(self.0.clone()),
        }
    }

    fn redacted(&self) -> Secret {
        if self.env_name().is_some() {
            self.clone()
        } else {
            Secret("<redacted>".into())
        }
    }
}

/// `[[tenants]]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// The tenant's id (`^[a-zA-Z0-9_-]{1,64}$`, unique); runs are kept under it.
    pub id: String,
    /// The agents this tenant may see and run; `None`: every agent. Another agent is
    /// `unknown_agent` to it, exactly like a missing one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agents: Option<Vec<String>>,
    /// Its bearer tokens, at least one, each at least 16 characters and configured once only.
    pub tokens: Vec<TokenConfig>,
}

/// One tenant token: a plain string (every scope, no name), or a table with a `name` (recorded
/// as who approved or rejected a call) and optional `scopes` (absent: every scope).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenConfig {
    /// `"a-long-random-token"` or `"env:NAME"`: every scope, no name.
    Plain(Secret),
    /// `{ name = …, token = …, scopes = […] }`.
    Named(NamedToken),
}

/// `{ name = "ci-bot", token = "env:CI_TOKEN", scopes = ["deploy:staging"] }`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedToken {
    /// Who the token is (`^[a-zA-Z0-9_-]{1,64}$`, unique within the tenant), recorded as who
    /// decided an approval.
    pub name: String,
    /// The token itself, literal or `env:NAME`.
    pub token: Secret,
    /// The scopes it grants (each also grants what it prefixes up to a `:`); `None`: every
    /// scope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scopes: Option<Vec<String>>,
}

impl TokenConfig {
    /// The token, as configured (not yet resolved).
    pub fn secret(&self) -> &Secret {
        match self {
            TokenConfig::Plain(s) => s,
            TokenConfig::Named(n) => &n.token,
        }
    }

    /// The token's name; `None` for a plain token.
    pub fn name(&self) -> Option<&str> {
        match self {
            TokenConfig::Plain(_) => None,
            TokenConfig::Named(n) => Some(&n.name),
        }
    }

    /// `None`: every scope.
    pub fn scopes(&self) -> Option<&[String]> {
        match self {
            TokenConfig::Plain(_) => None,
            TokenConfig::Named(n) => n.scopes.as_deref(),
        }
    }

    fn redacted(&self) -> TokenConfig {
        match self {
            TokenConfig::Plain(s) => TokenConfig::Plain(s.redacted()),
            TokenConfig::Named(n) => TokenConfig::Named(NamedToken {
                token: n.token.redacted(),
                ..n.clone()
            }),
        }
    }
}

impl From<Secret> for TokenConfig {
    fn from(s: Secret) -> Self {
        TokenConfig::Plain(s)
    }
}

/// `kind` of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    /// An OpenAI-compatible Chat Completions server (`base_url` and `model` required).
    Openai,
    /// Replies from a cassette, inline `replies` or `rules`, or a built-in demo `script`.
    Scripted,
}

/// `[models.NAME]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Which provider this is.
    pub kind: ModelKind,
    /// openai: base URL of the Chat Completions API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// openai: the model name sent upstream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// openai: sent as a bearer token (literal or `env:NAME`); never logged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<Secret>,
    /// Requests per minute to this model, shared by every run; `None`: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<NonZeroU32>,
    /// Tokens per minute to this model, shared by every run; `None`: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<NonZeroU32>,
    /// openai: per attempt; `None`: `runtime.model_timeout`, which bounds every attempt anyway.
    #[serde(
        default,
        with = "crate::config_duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub timeout: Option<Duration>,
    /// openai: output cap per call (sent as `max_tokens` or the dialect's field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// openai: sampling temperature, 0 to 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    /// openai: stream replies (SSE).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// The server's context limit in tokens: requests are built to fit under it, leaving room
    /// for `max_tokens` of output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_window: Option<usize>,
    /// scripted: path of a JSON cassette.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cassette: Option<PathBuf>,
    /// scripted: inline replies (reply `i` answers turn `i + 1`; the last repeats).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replies: Option<Vec<CassetteReply>>,
    /// scripted: inline rules (the first matching rule answers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rules: Option<Vec<Rule>>,
    /// scripted: the reply when no rule matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_reply: Option<CassetteReply>,
    /// scripted: a built-in demo script instead of a cassette (`calculator`, `recorder`,
    /// `interviewer`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub script: Option<crate::model::scripted::DemoScript>,
    /// scripted: delay before each reply.
    #[serde(
        default,
        with = "crate::config_duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub delay: Option<Duration>,
}

impl ModelConfig {
    /// A scripted model with inline replies.
    pub fn scripted(replies: Vec<CassetteReply>) -> Self {
        ModelConfig {
            kind: ModelKind::Scripted,
            base_url: None,
            model: None,
            api_key: None,
            requests_per_minute: None,
            tokens_per_minute: None,
            timeout: None,
            max_tokens: None,
            temperature: None,
            stream: None,
            context_window: None,
            cassette: None,
            replies: Some(replies),
            rules: None,
            default_reply: None,
            script: None,
            delay: None,
        }
    }
}

/// `kind` of a tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolKind {
    /// Calls are POSTed to `url` with an `Idempotency-Key`.
    Http,
    /// One MCP server (stdio `command` or streamable-HTTP `url`); each of its tools is
    /// registered as `<key>__<tool>`.
    Mcp,
    /// A tool built into agentd (`builtin`: `echo`, `add`, `counting`).
    Builtin,
}

/// `[tools.NAME]`. Unset policy keys keep the tool's own defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolConfig {
    /// How the tool is reached.
    pub kind: ToolKind,
    /// http: the URL calls are POSTed to; mcp: a streamable-HTTP server URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// http: `GET` with the same `Idempotency-Key` reconciles an unknown outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_url: Option<String>,
    /// What the model is told the tool does; `None`: the tool's own (builtin) or empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON Schema of the arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    /// "read" | "idempotent" | "unsafe".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effect: Option<crate::tool::ToolEffect>,
    /// "never" | "always" | { by_risk = … } | { when_argument = … } | { any_of = […] }.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<crate::tool::ApprovalRule>,
    /// "low" | "medium" | "high" | "critical"; `approval = { by_risk = … }` keys on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub risk: Option<crate::tool::RiskLevel>,
    /// How long a call waits for an operator before `on_approval_timeout` decides it.
    #[serde(
        default,
        with = "crate::config_duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub approval_timeout: Option<Duration>,
    /// "reject" | "approve".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_approval_timeout: Option<crate::tool::ApprovalTimeoutAction>,
    /// http, mcp (url): sent as `Authorization: Bearer …`; literal or `env:NAME`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bearer_token: Option<Secret>,
    /// Bound on one call (default 30s; builtin echo/add 5s).
    #[serde(
        default,
        with = "crate::config_duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub timeout: Option<Duration>,
    /// Output larger than this is cut and marked truncated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<usize>,
    /// Calls per second across every run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_second: Option<NonZeroU32>,
    /// A polling tool may repeat the same call without counting as no progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub polling: Option<bool>,
    /// Attempts of one call (the first included) when a `read` or `idempotent` tool fails
    /// transiently; the runtime retries with the same idempotency key before the model hears
    /// of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// http: the deadline of a call the tool accepted to finish later (`202`), from its
    /// acceptance. Default: `timeout`.
    #[serde(
        default,
        with = "crate::config_duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub task_timeout: Option<Duration>,
    /// http: the first wait before polling an accepted call's status URL (default 1s); later
    /// waits grow by half, with jitter, up to `poll_max_interval` (default 30s).
    #[serde(
        default,
        with = "crate::config_duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub poll_interval: Option<Duration>,
    /// http: the longest wait between two polls of an accepted call (default 30s).
    #[serde(
        default,
        with = "crate::config_duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub poll_max_interval: Option<Duration>,
    /// Calls of the tool failing in a row in one run (after those retries) before the run
    /// waits for an operator with reason `tool_failing` (default 3; 0 = never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_failures: Option<u32>,
    /// A 401/403 answer: "fail" (the run fails `permission_denied`, the default) | "operator"
    /// (the run waits for an operator, reason `permission_error`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_permission_error: Option<crate::tool::OnPermissionError>,
    /// mcp (stdio): the server's command and arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// mcp (stdio): the arguments of `command`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// mcp: per-tool effect overrides, keyed by the tool's name on the server.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub effects: BTreeMap<String, crate::tool::ToolEffect>,
    /// mcp: bound on starting the server and listing its tools.
    #[serde(
        default,
        with = "crate::config_duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub startup_timeout: Option<Duration>,
    /// builtin: which built-in tool ("echo", "add", "counting").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub builtin: Option<String>,
    /// Scopes a run must hold to call the tool (see `run::guard`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub permissions: Vec<String>,
    /// "refuse" (answer the model `permission_denied`) | "stop" (fail the run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_permission_denied: Option<crate::run::guard::OnPermissionDenied>,
    /// Argument values refused before approval and execution.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<crate::run::guard::DenyRule>,
    /// Path arguments confined to a root.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<crate::run::guard::PathRule>,
    /// JSON Pointers of the result parts the model sees (default: all of it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub project: Vec<String>,
    /// The call that undoes a successful call of this tool when its run ends `cancelled` or
    /// `failed`: `{ tool = "undo_x", arguments = { name = "/pointer" | { value = … } } }`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensate: Option<CompensateConfig>,
}

/// `[tools.X] compensate`: the compensating tool and its arguments, each a JSON Pointer into
/// the original call's arguments (`"/service"`; `""` = all of them) or a literal
/// (`{ value = … }`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompensateConfig {
    /// The compensating tool: a key of `[tools]`, needing no approval and with no
    /// `compensate` of its own.
    pub tool: String,
    /// Its arguments by name: a JSON Pointer string, or `{ value = … }`; every required
    /// argument of `tool` must be mapped.
    #[serde(default)]
    pub arguments: BTreeMap<String, Value>,
}

impl CompensateConfig {
    /// The runtime's form of the rule (checked by `Config::validate`).
    pub fn rule(&self) -> Result<crate::tool::Compensate, (String, String)> {
        crate::tool::Compensate::parse(&self.tool, &self.arguments)
    }
}

impl ToolConfig {
    /// A built-in tool with its own defaults.
    pub fn builtin(which: &str) -> Self {
        ToolConfig {
            kind: ToolKind::Builtin,
            url: None,
            status_url: None,
            description: None,
            parameters: None,
            effect: None,
            approval: None,
            risk: None,
            approval_timeout: None,
            on_approval_timeout: None,
            bearer_token: None,
            timeout: None,
            max_output_bytes: None,
            requests_per_second: None,
            polling: None,
            max_attempts: None,
            task_timeout: None,
            poll_interval: None,
            poll_max_interval: None,
            max_failures: None,
            on_permission_error: None,
            command: None,
            args: Vec::new(),
            effects: BTreeMap::new(),
            startup_timeout: None,
            builtin: Some(which.into()),
            permissions: Vec::new(),
            on_permission_denied: None,
            deny: Vec::new(),
            paths: Vec::new(),
            project: Vec::new(),
            compensate: None,
        }
    }

    /// The guard keys of this tool, to build its `run::guard::Guard` from.
    pub fn guard_config(&self) -> crate::run::guard::GuardConfig {
        crate::run::guard::GuardConfig {
            permissions: self.permissions.clone(),
            on_permission_denied: self.on_permission_denied.unwrap_or_default(),
            deny: self.deny.clone(),
            paths: self.paths.clone(),
            project: self.project.clone(),
        }
    }
}

/// `[agents.NAME]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// The model provider: a key of `[models]`.
    pub model: String,
    /// The system message.
    #[serde(default)]
    pub instructions: String,
    /// Allow-list of tools: keys of `[tools]` (an MCP server's key offers all its tools).
    #[serde(default)]
    pub tools: Vec<String>,
    /// Default model-call budget of a run (a run may ask for another, up to `limits`).
    #[serde(default = "default_max_turns")]
    pub max_turns: u32,
    /// Default tool-call budget of a run.
    #[serde(default = "default_max_tool_calls")]
    pub max_tool_calls: u32,
    /// Default token budget of a run (input plus output tokens).
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u64,
    /// Default wall-clock limit of a run, from its creation; `None`: no deadline.
    #[serde(
        default,
        with = "crate::config_duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub deadline: Option<Duration>,
    /// JSON Schema the final answer must match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<Value>,
    /// Target size of each model request, in estimated tokens (the context builder condenses
    /// older turns to fit).
    #[serde(default = "default_context_tokens")]
    pub context_tokens: usize,
    /// A tool output longer than this is cut in the request; the model reads the rest with
    /// `read_output` (the full output stays in the run's stored transcript).
    #[serde(default = "default_context_tool_output_bytes")]
    pub context_tool_output_bytes: usize,
    /// Offer the model the `ask_user` pseudo-tool (the run waits for the user's input).
    #[serde(default = "default_ask_user")]
    pub ask_user: bool,
    /// Offer the model the runtime's `read_output` tool (pages of an earlier, truncated tool
    /// output of the same run).
    #[serde(default = "default_ask_user")]
    pub read_output: bool,
}

fn default_ask_user() -> bool {
    true
}

fn default_context_tokens() -> usize {
    crate::context::ContextBudget::default().max_tokens
}
fn default_context_tool_output_bytes() -> usize {
    crate::context::ContextBudget::default().max_tool_output_bytes
}

fn default_max_turns() -> u32 {
    crate::run::Budget::default().max_turns
}
fn default_max_tool_calls() -> u32 {
    crate::run::Budget::default().max_tool_calls
}
fn default_max_tokens() -> u64 {
    crate::run::Budget::default().max_tokens
}

impl AgentConfig {
    /// An agent on the model named `model`, with no tools and every other key at its default.
    pub fn new(model: &str) -> Self {
        AgentConfig {
            model: model.into(),
            instructions: String::new(),
            tools: Vec::new(),
            max_turns: default_max_turns(),
            max_tool_calls: default_max_tool_calls(),
            max_tokens: default_max_tokens(),
            deadline: None,
            output_schema: None,
            context_tokens: default_context_tokens(),
            context_tool_output_bytes: default_context_tool_output_bytes(),
            ask_user: default_ask_user(),
            read_output: default_ask_user(),
        }
    }
}

/// `[runtime]`: pools, retries, restart policy and run-level policies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeSection {
    /// This node's identity (lease owner name). Unset: unique per process. A configured one
    /// that another live process holds is refused at start.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// Runs this node keeps live at once; new runs beyond that wait for any node with room.
    pub max_live_runs: usize,
    /// Model calls in flight at once, across every run.
    pub model_workers: usize,
    /// Model calls queued beyond `model_workers`; more are shed.
    pub model_queue: usize,
    /// Model calls of one tenant in the workers at once (0 = no cap; tenants are always
    /// served round-robin).
    pub model_max_in_flight_per_tenant: usize,
    /// Per model attempt.
    #[serde(with = "crate::config_duration")]
    pub model_timeout: Duration,
    /// Attempts per model request, the first included.
    pub model_max_attempts: u32,
    /// First wait of the jittered exponential backoff between model attempts.
    #[serde(with = "crate::config_duration")]
    pub model_retry_base: Duration,
    /// Longest wait between two model attempts.
    #[serde(with = "crate::config_duration")]
    pub model_retry_max: Duration,
    /// Model retries stop this long after a request's first failed attempt.
    #[serde(with = "crate::config_duration")]
    pub model_retry_window: Duration,
    /// Tool calls in flight at once, across every run.
    pub tool_workers: usize,
    /// Tool calls queued beyond `tool_workers`.
    pub tool_queue: usize,
    /// Lifetime of a run's ownership lease, renewed every quarter of it; a dead node's runs
    /// move to other nodes once it lapses.
    #[serde(with = "crate::config_duration")]
    pub lease_ttl: Duration,
    /// How long a control request waits for the run to apply it.
    #[serde(with = "crate::config_duration")]
    pub control_timeout: Duration,
    /// A run waiting for approval, input or long-running tool calls this long gives up its
    /// actor; "0s" = never.
    #[serde(with = "crate::config_duration")]
    pub passivate_after: Duration,
    /// A model reply whose only effects are read-only tool calls is committed together with
    /// their results when they arrive within this window (one store write per step instead
    /// of two), and on its own when they do not; "0s" = commit every transition on its own.
    #[serde(with = "crate::config_duration")]
    pub commit_window: Duration,
    /// `[runtime.restart]`: restarts of a crashing run.
    pub restart: RestartSection,
    /// Malformed model replies in a row before the run fails `invalid_model_output`.
    pub max_corrections: u32,
    /// `overloaded` answers of the model pool in a row before `model_unavailable`.
    pub max_model_retries: u32,
    /// Verifier rejections of the final answer before `verification_failed`.
    pub max_verify_rejections: u32,
    /// Resends of an idempotent call whose outcome is unknown, or of a call the tool pool
    /// was too busy to take.
    pub max_tool_retries: u32,
    /// Inputs held for a busy run; more are refused (`input_queue_full`).
    pub max_queued_input: usize,
    /// No-progress detection: the same call this many times.
    pub repeat_limit: u32,
    /// No-progress detection: failed calls in a row.
    pub failure_limit: u32,
    /// No-progress detection: turns without a new successful call.
    pub stale_turn_limit: u32,
}

impl Default for RuntimeSection {
    fn default() -> Self {
        let r = RuntimeConfig::default();
        let p = Policy::default();
        RuntimeSection {
            node_id: None,
            max_live_runs: r.max_live_runs,
            model_workers: r.gateway.size.workers,
            model_queue: r.gateway.size.queue,
            model_max_in_flight_per_tenant: r.gateway.tenant_max_in_flight,
            model_timeout: r.gateway.timeout,
            model_max_attempts: r.gateway.max_attempts,
            model_retry_base: r.gateway.retry_base,
            model_retry_max: r.gateway.retry_max,
            model_retry_window: r.gateway.retry_window,
            tool_workers: r.tool_pool.workers,
            tool_queue: r.tool_pool.queue,
            lease_ttl: r.lease_ttl,
            control_timeout: r.control_timeout,
            passivate_after: r.passivate_after.unwrap_or_default(),
            commit_window: r.commit_window.unwrap_or_default(),
            restart: RestartSection {
                max_restarts: r.restart.max_restarts,
                window: r.restart.window,
                backoff_base: r.restart.backoff_base,
                backoff_max: r.restart.backoff_max,
            },
            max_corrections: p.max_corrections,
            max_model_retries: p.max_model_retries,
            max_verify_rejections: p.max_verify_rejections,
            max_tool_retries: p.max_tool_retries,
            max_queued_input: p.max_queued_input,
            repeat_limit: p.progress.repeat_limit,
            failure_limit: p.progress.failure_limit,
            stale_turn_limit: p.progress.stale_turn_limit,
        }
    }
}

/// `[runtime.restart]`: how often a crashing run is restarted before it fails `crash_loop`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RestartSection {
    /// Crashes allowed within `window`; one more fails the run.
    pub max_restarts: u32,
    /// How far back crashes are counted.
    #[serde(with = "crate::config_duration")]
    pub window: Duration,
    /// Wait before the first restart; it doubles with each further one (±20 % jitter).
    #[serde(with = "crate::config_duration")]
    pub backoff_base: Duration,
    /// Longest wait before a restart.
    #[serde(with = "crate::config_duration")]
    pub backoff_max: Duration,
}

impl Default for RestartSection {
    fn default() -> Self {
        let r = RestartPolicy::default();
        RestartSection {
            max_restarts: r.max_restarts,
            window: r.window,
            backoff_base: r.backoff_base,
            backoff_max: r.backoff_max,
        }
    }
}

/// `[limits]`: bounds of the HTTP edge and per-tenant quotas.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Largest run goal (`input`), in bytes of JSON.
    pub max_input_bytes: usize,
    /// Largest `text` of `POST /v1/runs/{id}/input`.
    pub max_input_text_bytes: usize,
    /// Largest `metadata` of a run, in bytes of JSON (it is returned in every list item).
    pub max_metadata_bytes: usize,
    /// Non-SSE requests taking longer are answered 408.
    #[serde(with = "crate::config_duration")]
    pub request_timeout: Duration,
    /// Non-terminal runs per tenant; more are refused with 429. 0 = no limit.
    pub max_active_runs_per_tenant: usize,
    /// Open SSE event streams per tenant; more are refused with 429. 0 = no limit.
    pub max_streams_per_tenant: usize,
    /// Largest `limit` of the paged lists (`GET /v1/runs`, `/v1/runs/{id}/messages`,
    /// `/v1/approvals`).
    pub max_page_size: usize,
    /// Caps on the budget a client may ask for: the most `budget.max_turns` (422 above).
    pub max_turns: u32,
    /// The most `budget.max_tool_calls` a client may ask for.
    pub max_tool_calls: u32,
    /// The most `budget.max_tokens` a client may ask for.
    pub max_tokens: u64,
    /// The longest `budget.deadline` a client may ask for.
    #[serde(with = "crate::config_duration")]
    pub max_deadline: Duration,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_body_bytes: 1024 * 1024,
            max_input_bytes: RuntimeConfig::default().max_input_bytes,
            max_input_text_bytes: 64 * 1024,
            max_metadata_bytes: 4 * 1024,
            request_timeout: Duration::from_secs(30),
            max_active_runs_per_tenant: 0,
            max_streams_per_tenant: 64,
            max_page_size: 100,
            max_turns: 1_000,
            max_tool_calls: 10_000,
            max_tokens: 10_000_000,
            max_deadline: Duration::from_secs(24 * 3600),
        }
    }
}

/// `[models.X]` generation options: an output cap, a temperature and a context window that
/// leaves room for the output.
fn validate_model_options(key: &str, m: &ModelConfig) -> Result<(), Error> {
    if m.max_tokens == Some(0) {
        return Err(invalid(format!("{key}.max_tokens"), "must be at least 1"));
    }
    if let Some(t) = m.temperature
        && !(t.is_finite() && (0.0..=2.0).contains(&t))
    {
        return Err(invalid(
            format!("{key}.temperature"),
            "must be between 0 and 2",
        ));
    }
    if let Some(w) = m.context_window {
        let output = m.max_tokens.unwrap_or(0) as usize;
        if w <= output {
            return Err(invalid(
                format!("{key}.context_window"),
                "must be larger than max_tokens (the output needs room in the window)",
            ));
        }
    }
    if m.kind == ModelKind::Scripted {
        for (k, set) in [
            ("max_tokens", m.max_tokens.is_some()),
            ("temperature", m.temperature.is_some()),
            ("stream", m.stream.is_some()),
        ] {
            if set {
                return Err(invalid(
                    format!("{key}.{k}"),
                    "applies only to kind \"openai\"",
                ));
            }
        }
    }
    Ok(())
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Sets `table[path…] = value`, creating tables on the way.
fn set_path(table: &mut toml::Table, path: &[String], value: toml::Value) -> Result<(), Error> {
    let Some((last, parents)) = path.split_last() else {
        return Ok(());
    };
    let mut cur = table;
    for (i, p) in parents.iter().enumerate() {
        let entry = cur
            .entry(p.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = match entry {
            toml::Value::Table(t) => t,
            _ => {
                return Err(invalid(
                    path[..=i].join("."),
                    "an environment override addresses a key inside a value that is not a table",
                ));
            }
        };
    }
    cur.insert(last.clone(), value);
    Ok(())
}

/// An override value: TOML if it parses as one (`42`, `true`, `["a"]`), else a string.
fn env_value(raw: &str) -> toml::Value {
    match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").unwrap_or(toml::Value::String(raw.into())),
        Err(_) => toml::Value::String(raw.into()),
    }
}

impl Config {
    /// Parses TOML text (no environment overrides).
    pub fn from_toml(text: &str) -> Result<Config, Error> {
        toml::from_str(text).map_err(|e| Error::Parse(e.to_string()))
    }

    /// Loads the file (or, without one, the built-in demo configuration), then applies
    /// `AGENTD__SECTION__KEY` overrides from `env`. Does not validate.
    pub fn load(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, Error> {
        let mut table: toml::Table = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| Error::Read {
                    path: p.display().to_string(),
                    message: e.to_string(),
                })?;
                text.parse()
                    .map_err(|e: toml::de::Error| Error::Parse(format!("{}: {e}", p.display())))?
            }
            None => toml::Table::try_from(Config::demo())
                .map_err(|e| Error::Parse(format!("demo config: {e}")))?,
        };
        let mut overrides: Vec<(String, String)> = env
            .into_iter()
            .filter(|(k, _)| k.starts_with(ENV_PREFIX))
            .collect();
        overrides.sort();
        for (k, v) in overrides {
            let path: Vec<String> = k[ENV_PREFIX.len()..]
                .split("__")
                .map(str::to_ascii_lowercase)
                .collect();
            if path.iter().any(String::is_empty) {
                return Err(invalid(k, "malformed override (use AGENTD__SECTION__KEY)"));
            }
            set_path(&mut table, &path, env_value(&v))?;
        }
        Config::deserialize(toml::Value::Table(table)).map_err(|e| Error::Parse(e.to_string()))
    }

    /// The built-in configuration used when no file is given: a `demo` agent on a scripted
    /// model with built-in tools, and a `dev` tenant whose token is `AGENTD_TOKEN`.
    pub fn demo() -> Config {
        use crate::model::scripted::DemoScript;
        let mut c = Config::default();
        c.tenants.push(TenantConfig {
            id: "dev".into(),
            agents: None,
            tokens: vec![Secret("env:AGENTD_TOKEN".into()).into()],
        });
        let scripted = |script: DemoScript| {
            let mut m = ModelConfig::scripted(Vec::new());
            m.replies = None;
            m.script = Some(script);
            m.delay = Some(Duration::from_millis(300));
            m
        };
        c.models
            .insert("demo".into(), scripted(DemoScript::Calculator));
        c.models
            .insert("demo_approval".into(), scripted(DemoScript::Recorder));
        c.models
            .insert("demo_input".into(), scripted(DemoScript::Interviewer));
        c.tools.insert("echo".into(), ToolConfig::builtin("echo"));
        c.tools.insert("add".into(), ToolConfig::builtin("add"));
        let mut record = ToolConfig::builtin("counting");
        record.description = Some("Record an action in the ledger (needs approval).".into());
        record.effect = Some(crate::tool::ToolEffect::Unsafe);
        record.approval = Some(crate::tool::ApprovalRule::Always);
        c.tools.insert("record".into(), record);
        let mut agent = AgentConfig::new("demo");
        agent.instructions = "You are the agentd demo calculator: add or subtract the two \
                              numbers in the question with the tools, then answer."
            .into();
        agent.tools = vec!["add".into(), "echo".into()];
        agent.max_turns = 6;
        c.agents.insert("demo".into(), agent);
        let mut agent = AgentConfig::new("demo_approval");
        agent.instructions = "You record actions; each one needs an operator's approval.".into();
        agent.tools = vec!["record".into()];
        agent.max_turns = 6;
        c.agents.insert("demo_approval".into(), agent);
        let mut agent = AgentConfig::new("demo_input");
        agent.instructions = "You ask the user where a change should go, then confirm.".into();
        agent.max_turns = 4;
        c.agents.insert("demo_input".into(), agent);
        c
    }

    /// Checks the whole tree; the error names the first bad key. `extra_tools` are native tools
    /// supplied by an embedding program, which agents may list too.
    pub fn validate_with(&self, extra_tools: &[String]) -> Result<(), Error> {
        self.telemetry.validate()?;
        self.server
            .listen
            .parse::<std::net::SocketAddr>()
            .map_err(|e| {
                invalid(
                    "server.listen",
                    format!("{e} (write e.g. \"127.0.0.1:7700\")"),
                )
            })?;
        if self.server.shutdown_timeout.is_zero() {
            return Err(invalid("server.shutdown_timeout", "must be more than 0s"));
        }
        if self.server.header_read_timeout.is_zero() {
            return Err(invalid(
                "server.header_read_timeout",
                "must be more than 0s",
            ));
        }
        if self.server.write_timeout <= self.server.sse_keep_alive {
            return Err(invalid(
                "server.write_timeout",
                "must be longer than server.sse_keep_alive",
            ));
        }
        if let Some(u) = &self.server.public_url
            && !(u.starts_with("http://") || u.starts_with("https://"))
        {
            return Err(invalid("server.public_url", "must be an http(s) URL"));
        }
        if self.server.max_connections == 0 {
            return Err(invalid("server.max_connections", "must be at least 1"));
        }
        if self.server.sse_keep_alive.is_zero() {
            return Err(invalid("server.sse_keep_alive", "must be more than 0s"));
        }
        let url = &self.store.url;
        if !(url.starts_with("memory:") || url.starts_with("file:") || url.starts_with("redis")) {
            return Err(invalid(
                "store.url",
                format!(
                    "unsupported store {url:?} (use \"memory:\", \"file:PATH\" or \"redis://…\")"
                ),
            ));
        }
        if self.tenants.is_empty() {
            return Err(invalid(
                "tenants",
                "at least one [[tenants]] entry is required",
            ));
        }
        let mut ids = HashSet::new();
        // Token value → the tenant it belongs to. `env:` tokens are checked by their value
        // when the variable is set (start-up refuses an unset one when it resolves them).
        let mut tokens: HashMap<String, &str> = HashMap::new();
        let mut token_names = HashSet::new();
        for (i, t) in self.tenants.iter().enumerate() {
            if !valid_name(&t.id) {
                return Err(invalid(
                    format!("tenants[{i}].id"),
                    format!("{:?} must match ^[a-zA-Z0-9_-]{{1,64}}$", t.id),
                ));
            }
            if !ids.insert(t.id.as_str()) {
                return Err(invalid(
                    format!("tenants[{i}].id"),
                    format!("tenant {:?} is defined twice", t.id),
                ));
            }
            if t.tokens.is_empty() {
                return Err(invalid(
                    format!("tenants[{i}].tokens"),
                    "at least one token is required",
                ));
            }
            for (j, entry) in t.tokens.iter().enumerate() {
                let key = format!("tenants[{i}].tokens[{j}]");
                let tok = entry.secret();
                let resolved = match tok.env_name() {
                    Some(name) => tok
                        .resolve(&key)
                        .ok()
                        .map(|v| (v, format!(" (the value of {name})"))),
                    None => Some((tok.0.clone(), String::new())),
                };
                if let Some((value, source)) = resolved {
                    if value.chars().count() < 16 {
                        return Err(invalid(
                            key,
                            format!("a token{source} must be at least 16 characters"),
                        ));
                    }
                    if let Some(owner) = tokens.insert(value, &t.id) {
                        let message = if owner == t.id {
                            format!("the same token{source} is configured twice")
                        } else {
                            format!(
                                "the same token{source} is configured for tenants {owner:?} and {:?}",
                                t.id
                            )
                        };
                        return Err(invalid(key, message));
                    }
                }
                if let Some(name) = entry.name() {
                    if !valid_name(name) {
                        return Err(invalid(
                            format!("{key}.name"),
                            format!("{name:?} must match ^[a-zA-Z0-9_-]{{1,64}}$"),
                        ));
                    }
                    if !token_names.insert((t.id.as_str(), name)) {
                        return Err(invalid(
                            format!("{key}.name"),
                            format!("tenant {:?} has two tokens named {name:?}", t.id),
                        ));
                    }
                }
                for (k, scope) in entry.scopes().unwrap_or_default().iter().enumerate() {
                    if !crate::run::guard::valid_scope(scope) {
                        return Err(invalid(
                            format!("{key}.scopes[{k}]"),
                            format!(
                                "{scope:?} must be 1 to 128 of [a-zA-Z0-9_.:-], not starting or ending with `:`"
                            ),
                        ));
                    }
                }
            }
            for (k, agent) in t.agents.iter().flatten().enumerate() {
                if !self.agents.contains_key(agent) {
                    return Err(invalid(
                        format!("tenants[{i}].agents[{k}]"),
                        format!("agent {agent:?} is not defined in [agents]"),
                    ));
                }
            }
        }
        for (name, m) in &self.models {
            let key = format!("models.{name}");
            if !valid_name(name) {
                return Err(invalid(
                    key,
                    "a model name must match ^[a-zA-Z0-9_-]{1,64}$",
                ));
            }
            validate_model_options(&key, m)?;
            match m.kind {
                ModelKind::Openai => {
                    let Some(u) = &m.base_url else {
                        return Err(invalid(
                            format!("{key}.base_url"),
                            "is required for kind \"openai\"",
                        ));
                    };
                    if !(u.starts_with("http://") || u.starts_with("https://")) {
                        return Err(invalid(format!("{key}.base_url"), "must be an http(s) URL"));
                    }
                    if m.model.as_deref().is_none_or(str::is_empty) {
                        return Err(invalid(
                            format!("{key}.model"),
                            "is required for kind \"openai\"",
                        ));
                    }
                    for (k, set) in [
                        ("cassette", m.cassette.is_some()),
                        ("replies", m.replies.is_some()),
                        ("rules", m.rules.is_some()),
                        ("default_reply", m.default_reply.is_some()),
                        ("script", m.script.is_some()),
                        ("delay", m.delay.is_some()),
                    ] {
                        if set {
                            return Err(invalid(
                                format!("{key}.{k}"),
                                "applies only to kind \"scripted\"",
                            ));
                        }
                    }
                }
                ModelKind::Scripted => {
                    let sources = [
                        m.cassette.is_some(),
                        m.replies.is_some(),
                        m.rules.is_some(),
                        m.script.is_some(),
                    ]
                    .into_iter()
                    .filter(|b| *b)
                    .count();
                    if sources != 1 {
                        return Err(invalid(
                            key,
                            "a scripted model needs exactly one of `cassette`, `replies`, `rules` or `script`",
                        ));
                    }
                    if m.replies.as_ref().is_some_and(Vec::is_empty) {
                        return Err(invalid(format!("{key}.replies"), "must not be empty"));
                    }
                    for (k, set) in [
                        ("base_url", m.base_url.is_some()),
                        ("model", m.model.is_some()),
                        ("api_key", m.api_key.is_some()),
                    ] {
                        if set {
                            return Err(invalid(
                                format!("{key}.{k}"),
                                "applies only to kind \"openai\"",
                            ));
                        }
                    }
                }
            }
        }
        for (name, t) in &self.tools {
            let key = format!("tools.{name}");
            if !valid_name(name) {
                return Err(invalid(key, "a tool name must match ^[a-zA-Z0-9_-]{1,64}$"));
            }
            if name == crate::run::decision::ASK_USER_TOOL
                || name == crate::run::read_output::READ_OUTPUT_TOOL
            {
                return Err(invalid(key, format!("the name `{name}` is reserved")));
            }
            let need_url = |u: &Option<String>, k: &str| -> Result<(), Error> {
                match u {
                    Some(u) if u.starts_with("http://") || u.starts_with("https://") => Ok(()),
                    Some(_) => Err(invalid(format!("{key}.{k}"), "must be an http(s) URL")),
                    None => Ok(()),
                }
            };
            need_url(&t.url, "url")?;
            need_url(&t.status_url, "status_url")?;
            if let Some(n) = t.max_attempts
                && !(1..=crate::tool::MAX_CALL_ATTEMPTS).contains(&n)
            {
                return Err(invalid(
                    format!("{key}.max_attempts"),
                    format!("must be between 1 and {}", crate::tool::MAX_CALL_ATTEMPTS),
                ));
            }
            for (k, d) in [
                ("task_timeout", t.task_timeout),
                ("poll_interval", t.poll_interval),
                ("poll_max_interval", t.poll_max_interval),
            ] {
                if d.is_some_and(|d| d.is_zero()) {
                    return Err(invalid(format!("{key}.{k}"), "must be more than 0s"));
                }
            }
            if let Some(p) = &t.parameters {
                jsonschema::draft202012::options().build(p).map_err(|e| {
                    invalid(
                        format!("{key}.parameters"),
                        format!("invalid JSON Schema: {e}"),
                    )
                })?;
            }
            match t.kind {
                ToolKind::Http => {
                    if t.url.is_none() {
                        return Err(invalid(
                            format!("{key}.url"),
                            "is required for kind \"http\"",
                        ));
                    }
                    if t.parameters.is_none() {
                        return Err(invalid(
                            format!("{key}.parameters"),
                            "is required for kind \"http\"",
                        ));
                    }
                }
                ToolKind::Mcp => {
                    if t.command.is_some() == t.url.is_some() {
                        return Err(invalid(
                            key,
                            "kind \"mcp\" needs exactly one of `command` or `url`",
                        ));
                    }
                    if name.contains(crate::tool::mcp::NAME_SEPARATOR) {
                        return Err(invalid(key, "an MCP server name must not contain \"__\""));
                    }
                    for (k, set) in [
                        ("description", t.description.is_some()),
                        ("parameters", t.parameters.is_some()),
                        ("status_url", t.status_url.is_some()),
                        ("polling", t.polling.is_some()),
                        ("requests_per_second", t.requests_per_second.is_some()),
                    ] {
                        if set {
                            return Err(invalid(
                                format!("{key}.{k}"),
                                "does not apply to kind \"mcp\" (each tool comes from the server)",
                            ));
                        }
                    }
                    if t.bearer_token.is_some() && t.url.is_none() {
                        return Err(invalid(
                            format!("{key}.bearer_token"),
                            "applies only to an MCP server with `url`",
                        ));
                    }
                }
                ToolKind::Builtin => match t.builtin.as_deref() {
                    Some(b) if BUILTINS.contains(&b) => {}
                    Some(b) => {
                        return Err(invalid(
                            format!("{key}.builtin"),
                            format!("unknown built-in {b:?} (one of {})", BUILTINS.join(", ")),
                        ));
                    }
                    None => {
                        return Err(invalid(
                            format!("{key}.builtin"),
                            "is required for kind \"builtin\"",
                        ));
                    }
                },
            }
            if t.kind != ToolKind::Builtin && t.builtin.is_some() {
                return Err(invalid(
                    format!("{key}.builtin"),
                    "applies only to kind \"builtin\"",
                ));
            }
            if t.timeout.is_some_and(|d| d.is_zero()) {
                return Err(invalid(format!("{key}.timeout"), "must be more than 0s"));
            }
            if let Some(a) = &t.approval {
                a.validate()
                    .map_err(|e| invalid(format!("{key}.approval"), e))?;
            }
            if t.kind != ToolKind::Mcp && !t.effects.is_empty() {
                return Err(invalid(
                    format!("{key}.effects"),
                    "applies only to kind \"mcp\"",
                ));
            }
            if t.kind == ToolKind::Builtin && t.bearer_token.is_some() {
                return Err(invalid(
                    format!("{key}.bearer_token"),
                    "does not apply to kind \"builtin\"",
                ));
            }
            if t.approval_timeout.is_some_and(|d| d.is_zero()) {
                return Err(invalid(
                    format!("{key}.approval_timeout"),
                    "must be more than 0s",
                ));
            }
            crate::run::guard::Guard::new(&t.guard_config())
                .map_err(|e| invalid(format!("{key}.{}", e.key), e.message))?;
            if let Some(c) = &t.compensate {
                self.validate_compensate(&key, t, c, extra_tools)?;
            }
        }
        for (name, a) in &self.agents {
            let key = format!("agents.{name}");
            if !valid_name(name) {
                return Err(invalid(
                    key,
                    "an agent name must match ^[a-zA-Z0-9_-]{1,64}$",
                ));
            }
            if !self.models.contains_key(&a.model) {
                return Err(invalid(
                    format!("{key}.model"),
                    format!("model {:?} is not defined in [models]", a.model),
                ));
            }
            for t in &a.tools {
                // `server__tool` names one tool of an MCP server (checked after discovery).
                let mcp_tool =
                    t.split_once(crate::tool::mcp::NAME_SEPARATOR)
                        .is_some_and(|(server, _)| {
                            self.tools
                                .get(server)
                                .is_some_and(|s| s.kind == ToolKind::Mcp)
                        });
                if !mcp_tool && !self.tools.contains_key(t) && !extra_tools.contains(t) {
                    return Err(invalid(
                        format!("{key}.tools"),
                        format!("tool {t:?} is not defined in [tools]"),
                    ));
                }
            }
            if a.max_turns == 0 {
                return Err(invalid(format!("{key}.max_turns"), "must be at least 1"));
            }
            if a.context_tokens == 0 {
                return Err(invalid(
                    format!("{key}.context_tokens"),
                    "must be at least 1",
                ));
            }
            if let Some(s) = &a.output_schema {
                crate::run::verify::Verifier::json_schema(s)
                    .map_err(|e| invalid(format!("{key}.output_schema"), e))?;
            }
        }
        let r = &self.runtime;
        for (k, v) in [
            ("runtime.model_workers", r.model_workers),
            ("runtime.tool_workers", r.tool_workers),
            ("runtime.model_max_attempts", r.model_max_attempts as usize),
        ] {
            if v == 0 {
                return Err(invalid(k, "must be at least 1"));
            }
        }
        if r.max_live_runs == 0 {
            return Err(invalid("runtime.max_live_runs", "must be at least 1"));
        }
        if r.model_retry_window.is_zero() {
            return Err(invalid(
                "runtime.model_retry_window",
                "must be longer than 0s (it is the time model retries may take)",
            ));
        }
        if let Some(node) = &r.node_id
            && !valid_name(node)
        {
            return Err(invalid(
                "runtime.node_id",
                "must match ^[a-zA-Z0-9_-]{1,64}$",
            ));
        }
        let l = &self.limits;
        for (k, v) in [
            ("limits.max_body_bytes", l.max_body_bytes),
            ("limits.max_input_bytes", l.max_input_bytes),
            ("limits.max_input_text_bytes", l.max_input_text_bytes),
            ("limits.max_page_size", l.max_page_size),
        ] {
            if v == 0 {
                return Err(invalid(k, "must be at least 1"));
            }
        }
        if l.request_timeout.is_zero() {
            return Err(invalid("limits.request_timeout", "must be more than 0s"));
        }
        for (i, p) in self.secrets.patterns.iter().enumerate() {
            regex::Regex::new(p)
                .map_err(|e| invalid(format!("secrets.patterns[{i}]"), e.to_string()))?;
        }
        Ok(())
    }

    /// `[tools.X] compensate`: the compensating tool exists (it is allowed implicitly: the
    /// agents that use X need not list it), needs no approval and has no rule of its own; X has
    /// side effects; each mapped argument is a pointer X's schema can hold, or a literal; the
    /// compensating tool's required arguments are all mapped.
    fn validate_compensate(
        &self,
        key: &str,
        t: &ToolConfig,
        c: &CompensateConfig,
        extra_tools: &[String],
    ) -> Result<(), Error> {
        let key = format!("{key}.compensate");
        if t.kind == ToolKind::Mcp {
            return Err(invalid(
                key,
                "does not apply to kind \"mcp\" (set it on a tool of its own)",
            ));
        }
        if t.effect == Some(crate::tool::ToolEffect::Read) {
            return Err(invalid(
                key,
                "a `read` tool has no effect to undo (compensate applies to `unsafe` and `idempotent` tools)",
            ));
        }
        let undo = self.tools.get(&c.tool);
        let mcp_tool = c
            .tool
            .split_once(crate::tool::mcp::NAME_SEPARATOR)
            .is_some_and(|(server, _)| {
                self.tools
                    .get(server)
                    .is_some_and(|s| s.kind == ToolKind::Mcp)
            });
        if undo.is_none_or(|u| u.kind == ToolKind::Mcp)
            && !mcp_tool
            && !extra_tools.contains(&c.tool)
        {
            return Err(invalid(
                format!("{key}.tool"),
                format!("tool {:?} is not defined in [tools]", c.tool),
            ));
        }
        if let Some(u) = undo {
            if u.approval
                .as_ref()
                .is_some_and(|a| *a != crate::tool::ApprovalRule::Never)
            {
                return Err(invalid(
                    format!("{key}.tool"),
                    format!(
                        "the compensating tool {:?} must not need approval (nobody would be asked while the run ends)",
                        c.tool
                    ),
                ));
            }
            if u.compensate.is_some() {
                return Err(invalid(
                    format!("{key}.tool"),
                    format!(
                        "the compensating tool {:?} has a compensate rule of its own; compensations are not compensated",
                        c.tool
                    ),
                ));
            }
            if let Some(required) = u
                .parameters
                .as_ref()
                .and_then(|p| p.get("required"))
                .and_then(Value::as_array)
            {
                for r in required.iter().filter_map(Value::as_str) {
                    if !c.arguments.contains_key(r) {
                        return Err(invalid(
                            format!("{key}.arguments"),
                            format!(
                                "the compensating tool {:?} requires {r:?}, which is not mapped",
                                c.tool
                            ),
                        ));
                    }
                }
            }
        }
        c.rule()
            .map_err(|(arg, message)| invalid(format!("{key}.arguments.{arg}"), message))?;
        for (arg, v) in &c.arguments {
            if let (Value::String(p), Some(schema)) = (v, &t.parameters)
                && let Err(message) = pointer_fits(schema, p)
            {
                return Err(invalid(format!("{key}.arguments.{arg}"), message));
            }
        }
        Ok(())
    }

    /// `validate_with` no extra tools.
    pub fn validate(&self) -> Result<(), Error> {
        self.validate_with(&[])
    }

    /// A copy safe to print: literal tokens and API keys replaced (`env:NAME` references stay).
    pub fn redacted(&self) -> Config {
        let mut c = self.clone();
        for t in &mut c.tenants {
            t.tokens = t.tokens.iter().map(TokenConfig::redacted).collect();
        }
        for m in c.models.values_mut() {
            m.api_key = m.api_key.as_ref().map(Secret::redacted);
        }
        for t in c.tools.values_mut() {
            t.bearer_token = t.bearer_token.as_ref().map(Secret::redacted);
        }
        c.secrets.values = c.secrets.values.iter().map(Secret::redacted).collect();
        c.server.callback_secret = c.server.callback_secret.as_ref().map(Secret::redacted);
        c
    }

    /// TOML text of the (redacted) effective configuration.
    pub fn to_redacted_toml(&self) -> Result<String, Error> {
        toml::to_string_pretty(&self.redacted()).map_err(|e| Error::Parse(e.to_string()))
    }

    /// The runtime's tunables.
    pub fn runtime_config(&self) -> RuntimeConfig {
        let r = &self.runtime;
        let model_limits: HashMap<String, ModelLimits> = self
            .models
            .iter()
            .map(|(name, m)| {
                (
                    name.clone(),
                    ModelLimits {
                        requests_per_minute: m.requests_per_minute,
                        tokens_per_minute: m.tokens_per_minute,
                    },
                )
            })
            .collect();
        let per_tool_rps = self
            .tools
            .iter()
            .filter(|(_, t)| t.kind != ToolKind::Mcp)
            .filter_map(|(n, t)| t.requests_per_second.map(|r| (n.clone(), r)))
            .collect();
        RuntimeConfig {
            node_id: r
                .node_id
                .clone()
                .unwrap_or_else(crate::runtime::ownership::generated_node_id),
            max_live_runs: r.max_live_runs,
            gateway: GatewayConfig {
                size: PoolSize {
                    workers: r.model_workers,
                    queue: r.model_queue,
                },
                timeout: r.model_timeout,
                max_attempts: r.model_max_attempts,
                retry_base: r.model_retry_base,
                retry_max: r.model_retry_max,
                retry_window: r.model_retry_window,
                tenant_max_in_flight: r.model_max_in_flight_per_tenant,
            },
            tool_pool: PoolSize {
                workers: r.tool_workers,
                queue: r.tool_queue,
            },
            per_tool_rps,
            model_limits,
            restart: RestartPolicy {
                max_restarts: r.restart.max_restarts,
                window: r.restart.window,
                backoff_base: r.restart.backoff_base,
                backoff_max: r.restart.backoff_max,
            },
            policy: Policy {
                max_corrections: r.max_corrections,
                max_model_retries: r.max_model_retries,
                max_verify_rejections: r.max_verify_rejections,
                max_tool_retries: r.max_tool_retries,
                max_queued_input: r.max_queued_input,
                progress: ProgressPolicy {
                    repeat_limit: r.repeat_limit,
                    failure_limit: r.failure_limit,
                    stale_turn_limit: r.stale_turn_limit,
                },
                ..Policy::default()
            },
            lease_ttl: r.lease_ttl,
            control_timeout: r.control_timeout,
            passivate_after: (!r.passivate_after.is_zero()).then_some(r.passivate_after),
            commit_window: (!r.commit_window.is_zero()).then_some(r.commit_window),
            max_active_runs_per_tenant: match self.limits.max_active_runs_per_tenant {
                0 => None,
                n => Some(n),
            },
            max_input_bytes: self.limits.max_input_bytes,
            // Needs the address the daemon listens on: set by `daemon::run`.
            callbacks: None,
            telemetry: self.telemetry_config(),
        }
    }

    /// `[telemetry]` with the configured models and tenants the runtime needs.
    pub fn telemetry_config(&self) -> crate::telemetry::TelemetryConfig {
        let t = &self.telemetry;
        crate::telemetry::TelemetryConfig {
            otlp: t
                .otlp_endpoint
                .as_ref()
                .map(|e| crate::telemetry::OtlpConfig {
                    endpoint: e.clone(),
                    timeout: t.export_timeout,
                    interval: t.export_interval,
                    queue_size: t.queue_size,
                    max_batch: t.max_batch,
                }),
            service_name: t.service_name.clone(),
            tenant_labels: t
                .tenant_labels
                .then(|| self.tenants.iter().map(|t| t.id.clone()).collect()),
            models: self
                .models
                .iter()
                .map(|(name, m)| {
                    (
                        name.clone(),
                        crate::telemetry::ModelInfo {
                            provider: match m.kind {
                                ModelKind::Openai => "openai",
                                ModelKind::Scripted => "scripted",
                            }
                            .into(),
                            model: m.model.clone().unwrap_or_else(|| name.clone()),
                        },
                    )
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests;
