//! MCP tools through rmcp: one `McpServer` per configured server (a stdio child process or a
//! streamable-HTTP URL), tool discovery with schema checks, and one `McpTool` per discovered
//! tool, named `<server>__<tool>`.
//!
//! - Discovery: `tools/list` (all pages); each `inputSchema` is checked against its
//!   meta-schema (`jsonschema::meta::validate`). A tool whose schema is invalid, or whose
//!   namespaced name does not fit `^[a-zA-Z0-9_-]{1,64}$` or collides, is skipped and reported
//!   in [`McpDiscovery::skipped`].
//! - Calls: carry `_meta` `{"agentd/tenant", "agentd/run_id"}` (whom the call acts for), and are
//!   wrapped in `tokio::time::timeout` (the tool's timeout; rmcp has none). A result
//!   with `isError: true` is `failed` with its text (uncut: the executor redacts it, then cuts
//!   it); a JSON-RPC error is `invalid_argument`
//!   (`-32602`) or `failed`; a timeout, a lost connection or a cancelled call may have run, so
//!   it is `outcome_unknown` for non-`read` tools and `retryable` for `read` tools. A call that
//!   found no running server (nothing was sent) is `retryable`.
//! - Restarts: a server whose transport closed (a crashed child, a dropped HTTP session) is
//!   reconnected on the next call. Failed reconnects back off exponentially (capped); calls
//!   inside the backoff window fail fast with `retryable`.
//! - Effects: MCP annotations are hints from the server, not a contract, so every tool takes
//!   the server's configured `effect` unless `effects` overrides it by (MCP) tool name, or
//!   `trust_annotations` is set (`readOnlyHint` → `read`, `idempotentHint` → `idempotent`).
//! - A child's stderr is forwarded to tracing (`debug`, per server, lines redacted then capped); the child
//!   runs in its own process group and is killed when its connection is dropped.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use rmcp::model::{CallToolRequestParams, CallToolResult, ErrorCode, Tool as RemoteTool};
use rmcp::service::{Peer, RoleClient, RunningService, ServiceError, ServiceExt};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use serde_json::{Map, Value};
use tokio::io::AsyncBufReadExt;
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::{
    ApprovalRule, RiskLevel, Tool, ToolContext, ToolEffect, ToolError, ToolErrorCode, ToolSpec,
};

/// The daemon's environment variables a stdio server gets (when present) without
/// `inherit_env`.
pub const INHERITED_ENV: &[&str] = &["PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER", "TZ"];

/// Separator between the server and the tool name.
pub const NAME_SEPARATOR: &str = "__";
/// Longest stderr line forwarded to tracing.
const MAX_STDERR_LINE: usize = 2048;

/// How to reach an MCP server.
#[derive(Debug, Clone)]
pub enum McpTransport {
    /// A child process speaking MCP on stdin/stdout. Its environment is `env` plus only the
    /// daemon's [`INHERITED_ENV`] variables — the daemon's secrets (model API keys, tokens)
    /// are not handed to third-party servers — unless `inherit_env` is set.
    Stdio {
        /// The program to run.
        command: String,
        /// Its arguments.
        args: Vec<String>,
        /// Environment variables set for the child, over the inherited ones.
        env: Vec<(String, String)>,
        /// Its working directory; `None`: the daemon's.
        cwd: Option<std::path::PathBuf>,
        /// Hand the child the daemon's whole environment, not only [`INHERITED_ENV`].
        inherit_env: bool,
    },
    /// A streamable-HTTP endpoint, e.g. `http://127.0.0.1:3001/mcp`.
    Http {
        /// The endpoint's URL.
        url: String,
        /// Sent as `Authorization: Bearer …`; never logged.
        bearer_token: Option<String>,
    },
}

/// One `[tools.*]` entry of kind `mcp`.
#[derive(Debug, Clone)]
pub struct McpServerConfig {
    /// Prefix of every tool name; `^[a-zA-Z0-9_-]+$` without `__`.
    pub name: String,
    /// How to reach the server.
    pub transport: McpTransport,
    /// Per-call timeout of every tool of this server.
    pub timeout: Duration,
    /// Bound on spawning/connecting plus the `initialize` handshake.
    pub startup_timeout: Duration,
    /// Effect of every tool unless overridden.
    pub effect: ToolEffect,
    /// Per-tool effect overrides, keyed by the server's own tool name (e.g. `get-sum`).
    pub effects: HashMap<String, ToolEffect>,
    /// Take a tool's effect from its annotations when `effects` does not name it
    /// (`readOnlyHint` → `read`, `idempotentHint` → `idempotent`; otherwise `effect`).
    pub trust_annotations: bool,
    /// Declared risk of every tool of this server.
    pub risk: RiskLevel,
    /// Approval rule of every tool of this server.
    pub approval: ApprovalRule,
    /// Output cap of every tool of this server, in bytes of serialized result data.
    pub max_output_bytes: usize,
    /// First wait after a failed reconnect; doubles up to `restart_backoff_max`.
    pub restart_backoff: Duration,
    /// Longest wait between reconnect attempts.
    pub restart_backoff_max: Duration,
}

impl McpServerConfig {
    /// A server reached by `transport`, with defaults: `unsafe`, `medium` risk, no approval,
    /// 30 s call and startup timeouts, 64 KiB output, no trust in annotations, reconnect
    /// backoff from 500 ms to 30 s.
    pub fn new(name: impl Into<String>, transport: McpTransport) -> Self {
        McpServerConfig {
            name: name.into(),
            transport,
            timeout: Duration::from_secs(30),
            startup_timeout: Duration::from_secs(30),
            effect: ToolEffect::Unsafe,
            effects: HashMap::new(),
            trust_annotations: false,
            risk: RiskLevel::Medium,
            approval: ApprovalRule::Never,
            max_output_bytes: 64 * 1024,
            restart_backoff: Duration::from_millis(500),
            restart_backoff_max: Duration::from_secs(30),
        }
    }

    /// A stdio server from a command line.
    pub fn stdio(name: impl Into<String>, command: impl Into<String>, args: &[&str]) -> Self {
        Self::new(
            name,
            McpTransport::Stdio {
                command: command.into(),
                args: args.iter().map(|a| (*a).to_owned()).collect(),
                env: Vec::new(),
                cwd: None,
                inherit_env: false,
            },
        )
    }

    /// A streamable-HTTP server.
    pub fn http(name: impl Into<String>, url: impl Into<String>) -> Self {
        Self::new(
            name,
            McpTransport::Http {
                url: url.into(),
                bearer_token: None,
            },
        )
    }
}

/// Failure to start or query an MCP server.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum McpError {
    /// The configuration is invalid (e.g. the server name): why.
    #[error("invalid MCP server config: {0}")]
    Config(String),
    /// Spawning or connecting, or the `initialize` handshake, failed or timed out.
    #[error("MCP server {server}: {message}")]
    Connect {
        /// The server's configured name.
        server: String,
        /// What went wrong.
        message: String,
    },
    /// `tools/list` failed or timed out (`startup_timeout`).
    #[error("MCP server {server}: listing tools failed: {message}")]
    List {
        /// The server's configured name.
        server: String,
        /// What went wrong.
        message: String,
    },
}

type Client = RunningService<RoleClient, ()>;

struct Conn {
    client: Option<Client>,
    pid: Option<u32>,
    /// Bumped on every (re)connection, so a late failure report about an old connection
    /// cannot close a fresh one.
    generation: u64,
    failed_reconnects: u32,
    retry_at: Option<Instant>,
}

/// A connection to one MCP server, shared by all its tools.
pub struct McpServer {
    config: McpServerConfig,
    conn: Mutex<Conn>,
    restarts: AtomicU64,
}

impl std::fmt::Debug for McpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpServer")
            .field("name", &self.config.name)
            .finish_non_exhaustive()
    }
}

/// The result of tool discovery.
#[derive(Debug)]
pub struct McpDiscovery {
    /// The tools exposed, named `<server>__<tool>`.
    pub tools: Vec<Arc<McpTool>>,
    /// `(server's tool name, reason)` of every tool not exposed.
    pub skipped: Vec<(String, String)>,
}

fn valid_tool_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl McpServer {
    /// Connects (spawning the child for stdio) and performs the `initialize` handshake.
    pub async fn start(config: McpServerConfig) -> Result<Arc<Self>, McpError> {
        if !valid_tool_name(&config.name) || config.name.contains(NAME_SEPARATOR) {
            return Err(McpError::Config(format!(
                "server name {:?} must match ^[a-zA-Z0-9_-]{{1,64}}$ without \"__\"",
                config.name
            )));
        }
        let (client, pid) = connect(&config)
            .await
            .map_err(|message| McpError::Connect {
                server: config.name.clone(),
                message,
            })?;
        Ok(Arc::new(McpServer {
            config,
            conn: Mutex::new(Conn {
                client: Some(client),
                pid,
                generation: 0,
                failed_reconnects: 0,
                retry_at: None,
            }),
            restarts: AtomicU64::new(0),
        }))
    }

    /// The server's configured name (the prefix of its tools' names).
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// How many times the connection was re-established after a failure.
    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }

    /// The current child's process id (stdio servers).
    pub async fn child_pid(&self) -> Option<u32> {
        self.conn.lock().await.pid
    }

    /// Lists the server's tools and wraps each valid one as an `McpTool`.
    pub async fn discover(self: &Arc<Self>) -> Result<McpDiscovery, McpError> {
        let list_error = |message: String| McpError::List {
            server: self.config.name.clone(),
            message,
        };
        let (peer, _) = self.peer().await.map_err(|e| list_error(e.message))?;
        let remote = tokio::time::timeout(self.config.startup_timeout, peer.list_all_tools())
            .await
            .map_err(|_| {
                list_error(format!(
                    "no answer within {:?}",
                    self.config.startup_timeout
                ))
            })?
            .map_err(|e| list_error(e.to_string()))?;
        let mut tools = Vec::new();
        let mut skipped = Vec::new();
        let mut seen = HashSet::new();
        for t in remote {
            match self.wrap(&t, &mut seen) {
                Ok(tool) => tools.push(Arc::new(tool)),
                Err(reason) => {
                    tracing::warn!(server = %self.config.name, tool = %t.name, %reason, "MCP tool skipped");
                    skipped.push((t.name.to_string(), reason));
                }
            }
        }
        Ok(McpDiscovery { tools, skipped })
    }

    fn wrap(
        self: &Arc<Self>,
        t: &RemoteTool,
        seen: &mut HashSet<String>,
    ) -> Result<McpTool, String> {
        let name = format!("{}{NAME_SEPARATOR}{}", self.config.name, t.name);
        if !valid_tool_name(&name) {
            return Err(format!(
                "name {name:?} does not match ^[a-zA-Z0-9_-]{{1,64}}$"
            ));
        }
        if !seen.insert(name.clone()) {
            return Err(format!("duplicate tool name {name:?}"));
        }
        let schema = Value::Object(t.input_schema.as_ref().clone());
        jsonschema::meta::validate(&schema).map_err(|e| format!("invalid inputSchema: {e}"))?;
        let hints = t.annotations.as_ref();
        let effect = match self.config.effects.get(t.name.as_ref()) {
            Some(e) => *e,
            None if self.config.trust_annotations
                && hints.and_then(|a| a.read_only_hint) == Some(true) =>
            {
                ToolEffect::Read
            }
            None if self.config.trust_annotations
                && hints.and_then(|a| a.idempotent_hint) == Some(true) =>
            {
                ToolEffect::Idempotent
            }
            None => self.config.effect,
        };
        let description = t
            .description
            .as_deref()
            .or(t.title.as_deref())
            .unwrap_or_default()
            .to_owned();
        let spec = ToolSpec::new(name, description, schema)
            .effect(effect)
            .risk(self.config.risk)
            .approval(self.config.approval.clone())
            .timeout(self.config.timeout)
            .max_output_bytes(self.config.max_output_bytes);
        Ok(McpTool {
            spec,
            remote_name: t.name.to_string(),
            server: Arc::clone(self),
        })
    }

    /// A live peer and its connection generation, reconnecting if the transport closed
    /// (subject to backoff).
    async fn peer(&self) -> Result<(Peer<RoleClient>, u64), ToolError> {
        let mut conn = self.conn.lock().await;
        if let Some(client) = &conn.client
            && !client.is_closed()
            && !client.peer().is_transport_closed()
        {
            return Ok((client.peer().clone(), conn.generation));
        }
        if let Some(at) = conn.retry_at
            && Instant::now() < at
        {
            return Err(ToolError::new(
                ToolErrorCode::Retryable,
                format!(
                    "MCP server {} is down; next restart attempt in {:?}",
                    self.config.name,
                    at.saturating_duration_since(Instant::now())
                ),
            ));
        }
        // Drop (and so kill) the old connection before starting a new one.
        conn.client = None;
        conn.pid = None;
        tracing::warn!(server = %self.config.name, "MCP server connection lost; restarting");
        match connect(&self.config).await {
            Ok((client, pid)) => {
                let peer = client.peer().clone();
                conn.client = Some(client);
                conn.pid = pid;
                conn.generation += 1;
                conn.failed_reconnects = 0;
                conn.retry_at = None;
                self.restarts.fetch_add(1, Ordering::Relaxed);
                Ok((peer, conn.generation))
            }
            Err(message) => {
                let exp = conn.failed_reconnects.min(16);
                conn.failed_reconnects = conn.failed_reconnects.saturating_add(1);
                let wait = self
                    .config
                    .restart_backoff
                    .saturating_mul(1 << exp)
                    .min(self.config.restart_backoff_max);
                conn.retry_at = Some(Instant::now() + wait);
                Err(ToolError::new(
                    ToolErrorCode::Retryable,
                    format!(
                        "MCP server {} could not be restarted: {message}",
                        self.config.name
                    ),
                ))
            }
        }
    }

    /// Marks connection `generation` dead so that the next call reconnects. A newer
    /// connection is left alone.
    async fn mark_dead(&self, generation: u64) {
        let mut conn = self.conn.lock().await;
        if conn.generation == generation {
            conn.client = None;
            conn.pid = None;
        }
    }

    /// Closes the connection (for stdio: closes stdin, waits, then kills the child).
    pub async fn shutdown(&self) {
        let client = self.conn.lock().await.client.take();
        if let Some(mut client) = client {
            let _ = client.close_with_timeout(Duration::from_secs(5)).await;
        }
    }
}

/// Spawns or connects, then runs the `initialize` handshake within `startup_timeout`.
async fn connect(config: &McpServerConfig) -> Result<(Client, Option<u32>), String> {
    let startup = config.startup_timeout;
    let (client, pid) = match &config.transport {
        McpTransport::Stdio {
            command,
            args,
            env,
            cwd,
            inherit_env,
        } => {
            let mut cmd = tokio::process::Command::new(command);
            cmd.args(args);
            if !inherit_env {
                cmd.env_clear();
                for name in INHERITED_ENV {
                    if let Some(value) = std::env::var_os(name) {
                        cmd.env(name, value);
                    }
                }
            }
            cmd.envs(env.iter().map(|(k, v)| (k, v)));
            if let Some(dir) = cwd {
                cmd.current_dir(dir);
            }
            let (transport, stderr) = TokioChildProcess::builder(cmd)
                .stderr(std::process::Stdio::piped())
                .spawn()
                .map_err(|e| format!("cannot start {command:?}: {e}"))?;
            let pid = transport.id();
            if let Some(stderr) = stderr {
                tokio::spawn(forward_stderr(config.name.clone(), stderr));
            }
            let client = tokio::time::timeout(startup, ().serve(transport))
                .await
                .map_err(|_| format!("no initialize answer within {startup:?}"))?
                .map_err(|e| format!("initialize failed: {e}"))?;
            (client, pid)
        }
        McpTransport::Http { url, bearer_token } => {
            let mut transport_config = StreamableHttpClientTransportConfig::with_uri(url.as_str());
            if let Some(token) = bearer_token {
                transport_config = transport_config.auth_header(token.clone());
            }
            let http = reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .connect_timeout(startup.min(Duration::from_secs(10)))
                .build()
                .map_err(|e| format!("cannot build HTTP client: {e}"))?;
            let transport = StreamableHttpClientTransport::with_client(http, transport_config);
            let client = tokio::time::timeout(startup, ().serve(transport))
                .await
                .map_err(|_| format!("no initialize answer within {startup:?}"))?
                .map_err(|e| format!("initialize failed: {e}"))?;
            (client, None)
        }
    };
    // Callers must see failures, not a stale cached tool list.
    client
        .peer()
        .set_response_cache_config(
            rmcp::ClientCacheConfig::default().with_serve_stale_on_error(false),
        )
        .await;
    Ok((client, pid))
}

async fn forward_stderr(server: String, stderr: tokio::process::ChildStderr) {
    let mut lines = tokio::io::BufReader::new(stderr).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        // Redacted whole before the cut, so a secret at the limit does not leak in part.
        let line = crate::redact::redact_log_line(&line);
        let line = crate::redact::cut_chars(&line, MAX_STDERR_LINE);
        tracing::debug!(server = %server, "mcp stderr: {line}");
    }
}

/// One tool of an MCP server.
pub struct McpTool {
    spec: ToolSpec,
    remote_name: String,
    server: Arc<McpServer>,
}

impl std::fmt::Debug for McpTool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpTool")
            .field("name", &self.spec.name)
            .field("remote_name", &self.remote_name)
            .finish_non_exhaustive()
    }
}

impl McpTool {
    /// The tool's name on its server (e.g. `get-sum`).
    pub fn remote_name(&self) -> &str {
        &self.remote_name
    }

    fn maybe_applied(&self) -> ToolErrorCode {
        match self.spec.effect {
            ToolEffect::Read => ToolErrorCode::Retryable,
            ToolEffect::Idempotent | ToolEffect::Unsafe => ToolErrorCode::OutcomeUnknown,
        }
    }

    async fn service_error(&self, e: ServiceError, generation: u64) -> ToolError {
        match e {
            ServiceError::McpError(data) => {
                let code = if data.code == ErrorCode::INVALID_PARAMS {
                    ToolErrorCode::InvalidArgument
                } else {
                    ToolErrorCode::Failed
                };
                ToolError::new(code, data.message.to_string())
            }
            ServiceError::TransportClosed | ServiceError::TransportSend(_) => {
                self.server.mark_dead(generation).await;
                ToolError::new(
                    self.maybe_applied(),
                    "the connection to the MCP server was lost during the call",
                )
            }
            other => ToolError::new(self.maybe_applied(), other.to_string()),
        }
    }
}

/// The value of a successful result: `structuredContent` when present, else the text of
/// all-text content, else the content blocks as JSON.
fn result_value(result: &CallToolResult) -> Value {
    if let Some(structured) = &result.structured_content {
        return structured.clone();
    }
    let texts: Option<Vec<&str>> = result
        .content
        .iter()
        .map(|c| c.as_text().map(|t| t.text.as_str()))
        .collect();
    match texts {
        Some(texts) if !texts.is_empty() => Value::String(texts.join("\n")),
        _ => serde_json::to_value(&result.content).unwrap_or(Value::Null),
    }
}

/// `_meta` key of the tenant a call acts for.
pub const META_TENANT: &str = "agentd/tenant";
/// `_meta` key of the run a call belongs to.
pub const META_RUN_ID: &str = "agentd/run_id";

/// The request `_meta` of a call: whom it acts for.
fn call_meta(ctx: &ToolContext) -> rmcp::model::RequestMetaObject {
    let mut meta = Map::new();
    meta.insert(META_TENANT.into(), Value::String(ctx.tenant.clone()));
    meta.insert(
        META_RUN_ID.into(),
        Value::String(ctx.run_id.as_str().to_owned()),
    );
    rmcp::model::RequestMetaObject(rmcp::model::MetaObject(meta))
}

#[async_trait]
impl Tool for McpTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn call(&self, ctx: &ToolContext, arguments: Value) -> Result<Value, ToolError> {
        let arguments: Option<Map<String, Value>> = match arguments {
            Value::Object(map) => Some(map),
            Value::Null => None,
            _ => {
                return Err(ToolError::new(
                    ToolErrorCode::InvalidArgument,
                    "arguments must be a JSON object",
                ));
            }
        };
        let (peer, generation) = self.server.peer().await?;
        let mut params = CallToolRequestParams::new(self.remote_name.clone());
        if let Some(args) = arguments {
            params = params.with_arguments(args);
        }
        params.meta = Some(call_meta(ctx));
        let timeout = self.spec.timeout;
        // Dropping the call future (timeout or cancel) sends `notifications/cancelled`.
        // Biased: a call cancelled before it starts is never sent.
        let outcome = tokio::select! {
            biased;
            () = ctx.cancel.cancelled() => {
                return Err(ToolError::new(self.maybe_applied(), "the call was cancelled before the tool answered"));
            }
            r = tokio::time::timeout(timeout, peer.call_tool(params)) => r,
        };
        let result = match outcome {
            Err(_) => {
                return Err(ToolError::new(
                    self.maybe_applied(),
                    format!("no reply within {timeout:?}"),
                ));
            }
            Ok(Err(e)) => return Err(self.service_error(e, generation).await),
            Ok(Ok(result)) => result,
        };
        if result.is_error == Some(true) {
            let text = match result_value(&result) {
                Value::String(s) => s,
                other => other.to_string(),
            };
            return Err(ToolError::new(ToolErrorCode::Failed, text));
        }
        Ok(result_value(&result))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn tool_names_are_checked() {
        assert!(valid_tool_name("everything__get-sum"));
        assert!(!valid_tool_name("a.b"));
        assert!(!valid_tool_name(""));
        assert!(!valid_tool_name(&"x".repeat(65)));
    }

    #[tokio::test]
    async fn bad_server_names_and_missing_commands_are_reported() {
        let err = McpServer::start(McpServerConfig::stdio("a__b", "true", &[]))
            .await
            .unwrap_err();
        assert!(matches!(err, McpError::Config(_)));
        let err = McpServer::start(McpServerConfig::stdio(
            "x",
            "/nonexistent/agentd-no-such-binary",
            &[],
        ))
        .await
        .unwrap_err();
        assert!(matches!(err, McpError::Connect { .. }), "{err}");
    }
}
