//! From configuration to `RuntimeParts`: the store, the tools, the model providers, the agents
//! and the redactor.
//!
//! - `[models.X] kind = "openai"` → `OpenAiProvider` (its limits reach the gateway through
//!   `Config::runtime_config`); `kind = "scripted"` → `ScriptedModel`.
//! - `[tools.X] kind = "http"` → `HttpTool`; `kind = "builtin"` → a built-in tool.
//! - `[tools.S] kind = "mcp"` is one MCP **server**: it is started (stdio child or streamable
//!   HTTP) and its tools are listed here, within `startup_timeout`, and each is registered as
//!   `S__<tool name on the server>` in the one registry (same name and schema checks as every
//!   other tool). An agent lists `S__echo` for one tool, or `S` for all of them. A server that
//!   does not start, or a listed tool it does not offer, fails the start.
//! - Every tool kind gets its `[tools.X]` guard (`permissions`, `on_permission_denied`,
//!   `deny`, `paths`, `project`); an MCP server's guard covers each of its tools.
//! - The redactor knows every configured secret: model API keys, tenant tokens, tool bearer
//!   tokens, `[secrets] values`, plus `[secrets] patterns` and the default credential patterns.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde_json::Value;

use crate::agent::AgentSpec;
use crate::config::{Config, ModelConfig, ModelKind, ToolConfig, ToolKind};
use crate::context::ContextBudget;
use crate::model::ModelProvider;
use crate::model::openai::{ApiKey, OpenAiConfig, OpenAiProvider};
use crate::model::scripted::{Cassette, ScriptedModel};
use crate::redact::Redactor;
use crate::run::Budget;
use crate::run::guard::Guard;
use crate::run::verify::Verifier;
use crate::runtime::RuntimeParts;
use crate::store::SharedStore;
use crate::tool::builtin::{Add, CountingTool, Echo};
use crate::tool::callback::{CallbackKey, Callbacks};
use crate::tool::http::HttpTool;
use crate::tool::mcp::{McpServer, McpServerConfig, McpTransport, NAME_SEPARATOR};
use crate::tool::registry::Registry;
use crate::tool::{Tool, ToolContext, ToolEffect, ToolError, ToolSpec};

/// Why the configured parts could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// A configured part could not be built: a store that does not open; a tool, model, agent
    /// `output_schema`, redaction pattern or `public_url` that does not work; an MCP server
    /// that does not start or lacks a listed tool.
    #[error("{key}: {message}")]
    Invalid {
        /// The configuration key at fault (`store.url`, `tools.deploy.url`,
        /// `secrets.patterns[0]`, …).
        key: String,
        /// What went wrong.
        message: String,
    },
    /// A configured feature this build of agentd does not include.
    #[error("{what} is not available in this build")]
    Unavailable {
        /// The feature asked for.
        what: String,
    },
    /// A `config::Error` met while building, e.g. an `env:NAME` secret whose variable is not
    /// set.
    #[error("{key}: {message}")]
    Config {
        /// The key it names (`config` for an error that names none).
        key: String,
        /// What is wrong.
        message: String,
    },
}

impl From<crate::config::Error> for BuildError {
    fn from(e: crate::config::Error) -> Self {
        match e {
            crate::config::Error::Invalid { key, message } => BuildError::Config { key, message },
            other => BuildError::Config {
                key: "config".into(),
                message: other.to_string(),
            },
        }
    }
}

/// The parts, plus the MCP servers started for them (shut down with the daemon).
pub struct Built {
    /// What `Runtime::start` takes: the store, tools, models, agents and redactor.
    pub parts: RuntimeParts,
    /// The MCP servers started for the configured `kind = "mcp"` tools; the caller shuts them
    /// down.
    pub mcp_servers: Vec<Arc<McpServer>>,
    /// The redactor also given to the runtime, for the API and the logs.
    pub redactor: Arc<Redactor>,
}

fn invalid(key: impl Into<String>, message: impl Into<String>) -> BuildError {
    BuildError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

/// Opens the store named by `url`. The single place store kinds are chosen.
pub async fn open_store(url: &str) -> Result<SharedStore, BuildError> {
    crate::store::open(url)
        .await
        .map_err(|e| BuildError::Invalid {
            key: "store.url".into(),
            message: format!("{url}: {e}"),
        })
}

/// A tool whose spec (name, description, policy) comes from configuration.
struct Configured {
    inner: Arc<dyn Tool>,
    spec: ToolSpec,
}

#[async_trait]
impl Tool for Configured {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn call(&self, ctx: &ToolContext, arguments: Value) -> Result<Value, ToolError> {
        self.inner.call(ctx, arguments).await
    }

    async fn status(&self, ctx: &ToolContext) -> Result<Option<Value>, ToolError> {
        self.inner.status(ctx).await
    }
}

/// The guard of a configured tool (permissions, deny and path rules, projection).
fn guard_of(name: &str, t: &ToolConfig) -> Result<Arc<Guard>, BuildError> {
    Guard::new(&t.guard_config())
        .map(Arc::new)
        .map_err(|e| invalid(format!("tools.{name}.{}", e.key), e.message))
}

/// Applies the configured policy keys to a spec.
fn apply(name: &str, t: &ToolConfig, mut spec: ToolSpec) -> Result<ToolSpec, BuildError> {
    spec.name = name.to_owned();
    spec.guard = guard_of(name, t)?;
    if let Some(d) = &t.description {
        spec.description = d.clone();
    }
    if let Some(p) = &t.parameters {
        spec.parameters = p.clone();
    }
    if let Some(e) = t.effect {
        spec.effect = e;
    }
    if let Some(a) = &t.approval {
        spec.approval = a.clone();
    }
    if let Some(r) = t.risk {
        spec.risk = r;
    }
    if let Some(d) = t.approval_timeout {
        spec.approval_timeout = Some(d);
    }
    if let Some(a) = t.on_approval_timeout {
        spec.on_approval_timeout = a;
    }
    if let Some(d) = t.timeout {
        spec.timeout = d;
    }
    if let Some(n) = t.max_output_bytes {
        spec.max_output_bytes = n;
    }
    if let Some(p) = t.polling {
        spec.polling = p;
    }
    if let Some(n) = t.max_attempts {
        spec.max_attempts = n;
    }
    if let Some(d) = t.task_timeout {
        spec.task_timeout = Some(d);
    }
    if let Some(d) = t.poll_interval {
        spec.poll_interval = d;
    }
    if let Some(d) = t.poll_max_interval {
        spec.poll_max_interval = d;
    }
    if let Some(n) = t.max_failures {
        spec.max_failures = n;
    }
    if let Some(a) = t.on_permission_error {
        spec.on_permission_error = a;
    }
    if let Some(c) = &t.compensate {
        spec.compensate = Some(c.rule().map_err(|(arg, message)| {
            invalid(format!("tools.{name}.compensate.arguments.{arg}"), message)
        })?);
    }
    Ok(spec)
}

fn resolve(
    secret: &Option<crate::config::Secret>,
    key: &str,
) -> Result<Option<String>, BuildError> {
    secret
        .as_ref()
        .map(|s| s.resolve(key))
        .transpose()
        .map_err(BuildError::from)
}

fn build_tool(name: &str, t: &ToolConfig) -> Result<Arc<dyn Tool>, BuildError> {
    let key = format!("tools.{name}");
    match t.kind {
        ToolKind::Http => {
            let url = t
                .url
                .as_deref()
                .ok_or_else(|| invalid(format!("{key}.url"), "is required for kind \"http\""))?;
            let parameters = t
                .parameters
                .clone()
                .unwrap_or_else(|| serde_json::json!({"type": "object"}));
            let spec = apply(name, t, ToolSpec::new(name, "", parameters))?;
            let mut tool = HttpTool::new(spec, url, t.status_url.as_deref())
                .map_err(|e| invalid(format!("{key}.url"), e.message))?;
            if let Some(token) = resolve(&t.bearer_token, &format!("{key}.bearer_token"))? {
                tool = tool.with_bearer_token(token);
            }
            Ok(Arc::new(tool))
        }
        ToolKind::Mcp => Err(invalid(key, "an MCP server is started by `start_mcp`")),
        ToolKind::Builtin => {
            let inner: Arc<dyn Tool> = match t.builtin.as_deref() {
                Some("echo") => Arc::new(Echo::new()),
                Some("add") => Arc::new(Add::new()),
                Some("counting") => Arc::new(CountingTool::new(
                    name,
                    t.effect.unwrap_or(ToolEffect::Unsafe),
                )),
                other => {
                    return Err(invalid(
                        format!("{key}.builtin"),
                        format!("unknown built-in {other:?}"),
                    ));
                }
            };
            let spec = apply(name, t, inner.spec().clone())?;
            Ok(Arc::new(Configured { inner, spec }))
        }
    }
}

/// Bound on starting an MCP server, and on listing its tools, when not configured.
const DEFAULT_MCP_STARTUP: std::time::Duration = std::time::Duration::from_secs(30);

/// Starts one configured MCP server and lists its tools (bounded by its startup timeout).
async fn start_mcp(name: &str, t: &ToolConfig) -> Result<Arc<McpServer>, BuildError> {
    let key = format!("tools.{name}");
    let transport = match (&t.command, &t.url) {
        (Some(command), None) => McpTransport::Stdio {
            command: command.clone(),
            args: t.args.clone(),
            env: Vec::new(),
            cwd: None,
            inherit_env: false,
        },
        (None, Some(url)) => McpTransport::Http {
            url: url.clone(),
            bearer_token: resolve(&t.bearer_token, &format!("{key}.bearer_token"))?,
        },
        _ => {
            return Err(invalid(
                key,
                "kind \"mcp\" needs exactly one of `command` or `url`",
            ));
        }
    };
    let mut config = McpServerConfig::new(name, transport);
    if let Some(d) = t.timeout {
        config.timeout = d;
    }
    config.startup_timeout = t.startup_timeout.unwrap_or(DEFAULT_MCP_STARTUP);
    if let Some(e) = t.effect {
        config.effect = e;
    }
    config.effects = t.effects.iter().map(|(k, v)| (k.clone(), *v)).collect();
    if let Some(r) = t.risk {
        config.risk = r;
    }
    if let Some(a) = &t.approval {
        config.approval = a.clone();
    }
    if let Some(n) = t.max_output_bytes {
        config.max_output_bytes = n;
    }
    let startup = config.startup_timeout;
    // `start` and `discover` are each bounded by `startup_timeout`; this bounds the pair.
    let server = tokio::time::timeout(startup.saturating_mul(2), McpServer::start(config))
        .await
        .map_err(|_| invalid(key.clone(), format!("did not start within {startup:?}")))?
        .map_err(|e| invalid(key.clone(), e.to_string()))?;
    Ok(server)
}

/// Registers the tools of a started MCP server, with the tool-level policy keys of its config.
async fn register_mcp(
    name: &str,
    t: &ToolConfig,
    server: &Arc<McpServer>,
    registry: &mut Registry,
) -> Result<Vec<String>, BuildError> {
    let key = format!("tools.{name}");
    let startup = t.startup_timeout.unwrap_or(DEFAULT_MCP_STARTUP);
    let found = tokio::time::timeout(startup.saturating_mul(2), server.discover())
        .await
        .map_err(|_| {
            invalid(
                key.clone(),
                format!("listing tools took longer than {startup:?}"),
            )
        })?
        .map_err(|e| invalid(key.clone(), e.to_string()))?;
    for (tool, reason) in &found.skipped {
        tracing::warn!(server = %name, %tool, %reason, "MCP tool not registered");
    }
    let mut names = Vec::new();
    // The server's guard keys apply to every one of its tools.
    let guard = guard_of(name, t)?;
    for tool in found.tools {
        let mut spec = tool.spec().clone();
        spec.guard = guard.clone();
        if let Some(d) = t.approval_timeout {
            spec.approval_timeout = Some(d);
        }
        if let Some(a) = t.on_approval_timeout {
            spec.on_approval_timeout = a;
        }
        if let Some(n) = t.max_attempts {
            spec.max_attempts = n;
        }
        if let Some(n) = t.max_failures {
            spec.max_failures = n;
        }
        if let Some(a) = t.on_permission_error {
            spec.on_permission_error = a;
        }
        names.push(spec.name.clone());
        let inner: Arc<dyn Tool> = tool;
        registry
            .register(Arc::new(Configured { inner, spec }))
            .map_err(|e| invalid(key.clone(), e.to_string()))?;
    }
    tracing::info!(server = %name, tools = names.len(), "MCP server started");
    Ok(names)
}

/// The agent's context target, capped by its model's `context_window` minus the room kept for
/// the output (`max_tokens`).
fn fit_context(context_tokens: usize, model: Option<&ModelConfig>) -> usize {
    match model.and_then(|m| m.context_window.map(|w| (w, m.max_tokens))) {
        Some((window, output)) => {
            context_tokens.min(window.saturating_sub(output.unwrap_or(0) as usize).max(1))
        }
        None => context_tokens,
    }
}

fn build_model(
    name: &str,
    m: &ModelConfig,
    default_timeout: std::time::Duration,
    redactor: &Redactor,
) -> Result<Arc<dyn ModelProvider>, BuildError> {
    let key = format!("models.{name}");
    match m.kind {
        ModelKind::Openai => {
            let base_url = m.base_url.clone().ok_or_else(|| {
                invalid(format!("{key}.base_url"), "is required for kind \"openai\"")
            })?;
            let model = m.model.clone().ok_or_else(|| {
                invalid(format!("{key}.model"), "is required for kind \"openai\"")
            })?;
            let mut config = OpenAiConfig::new(name, base_url, model);
            config.api_key = resolve(&m.api_key, &format!("{key}.api_key"))?.map(ApiKey::new);
            config.timeout = m.timeout.unwrap_or(default_timeout);
            config.max_output_tokens = m.max_tokens;
            config.temperature = m.temperature;
            if let Some(stream) = m.stream {
                config.compat.stream = stream;
            }
            let provider = OpenAiProvider::new(config)
                .map_err(|e| invalid(key, e.message))?
                .with_redactor(redactor);
            Ok(Arc::new(provider))
        }
        ModelKind::Scripted => {
            if let Some(script) = m.script {
                let mut model = ScriptedModel::demo(name, script);
                if let Some(d) = m.delay {
                    model = model.with_delay(d);
                }
                return Ok(Arc::new(model));
            }
            let cassette = if let Some(path) = &m.cassette {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    invalid(
                        format!("{key}.cassette"),
                        format!("could not read {}: {e}", path.display()),
                    )
                })?;
                ScriptedModel::parse_cassette(&text)
                    .map_err(|e| invalid(format!("{key}.cassette"), e))?
            } else if let Some(replies) = &m.replies {
                Cassette::Replies {
                    replies: replies.clone(),
                }
            } else if let Some(rules) = &m.rules {
                Cassette::Rules {
                    rules: rules.clone(),
                    default: m.default_reply.clone(),
                }
            } else {
                return Err(invalid(key, "needs `cassette`, `replies` or `rules`"));
            };
            let mut model = ScriptedModel::new(name, cassette);
            if let Some(d) = m.delay {
                model = model.with_delay(d);
            }
            Ok(Arc::new(model))
        }
    }
}

/// The redactor of this configuration: every configured secret value and pattern.
pub fn build_redactor(config: &Config) -> Result<Redactor, BuildError> {
    let mut r = Redactor::new();
    for (i, t) in config.tenants.iter().enumerate() {
        for (j, tok) in t.tokens.iter().enumerate() {
            r.add_secret(tok.secret().resolve(&format!("tenants[{i}].tokens[{j}]"))?);
        }
    }
    for (name, m) in &config.models {
        if let Some(k) = resolve(&m.api_key, &format!("models.{name}.api_key"))? {
            r.add_secret(k);
        }
    }
    for (name, t) in &config.tools {
        if let Some(k) = resolve(&t.bearer_token, &format!("tools.{name}.bearer_token"))? {
            r.add_secret(k);
        }
    }
    for (i, v) in config.secrets.values.iter().enumerate() {
        r.add_secret(v.resolve(&format!("secrets.values[{i}]"))?);
    }
    if let Some(k) = resolve(&config.server.callback_secret, "server.callback_secret")? {
        r.add_secret(k);
    }
    for (i, p) in config.secrets.patterns.iter().enumerate() {
        r.add_value_pattern(p)
            .map_err(|e| invalid(format!("secrets.patterns[{i}]"), e.to_string()))?;
    }
    Ok(r)
}

/// The callback route of long-running tools: `server.public_url` (default: `http://` and the
/// address the daemon listens on, `127.0.0.1` for an unspecified one) and the token key
/// (`server.callback_secret`, else derived from the tenant tokens, else random).
pub fn build_callbacks(
    config: &Config,
    listening: std::net::SocketAddr,
) -> Result<Callbacks, BuildError> {
    let public_url = match &config.server.public_url {
        Some(u) => {
            reqwest::Url::parse(u)
                .map_err(|e| invalid("server.public_url", format!("is not a URL: {e}")))?;
            u.clone()
        }
        None => {
            let mut addr = listening;
            if addr.ip().is_unspecified() {
                addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
            }
            format!("http://{addr}")
        }
    };
    let key = match resolve(&config.server.callback_secret, "server.callback_secret")? {
        Some(secret) => CallbackKey::derive([secret.as_bytes()]),
        None => {
            let mut tokens = Vec::new();
            for (i, t) in config.tenants.iter().enumerate() {
                for (j, tok) in t.tokens.iter().enumerate() {
                    tokens.push(tok.secret().resolve(&format!("tenants[{i}].tokens[{j}]"))?);
                }
            }
            tokens.sort();
            if tokens.is_empty() {
                CallbackKey::random()
            } else {
                CallbackKey::derive(tokens.iter().map(String::as_bytes))
            }
        }
    };
    Ok(Callbacks::new(&public_url, key))
}

/// Builds everything the runtime runs from `config` (already validated) on `store`, plus native
/// tools supplied by an embedding program. Starts the configured MCP servers.
pub async fn build_parts(
    config: &Config,
    store: SharedStore,
    native_tools: Vec<Arc<dyn Tool>>,
) -> Result<Built, BuildError> {
    let redactor = Arc::new(build_redactor(config)?);
    let mut registry = Registry::new();
    for tool in native_tools {
        let name = tool.spec().name.clone();
        registry
            .register(tool)
            .map_err(|e| invalid(format!("native tool {name}"), e.to_string()))?;
    }
    let mut mcp_servers = Vec::new();
    let mut mcp_tools: HashMap<String, Vec<String>> = HashMap::new();
    let result = register_all(config, &mut registry, &mut mcp_servers, &mut mcp_tools).await;
    if let Err(e) = result {
        for s in &mcp_servers {
            s.shutdown().await;
        }
        return Err(e);
    }
    let mut models: HashMap<String, Arc<dyn ModelProvider>> = HashMap::new();
    for (name, m) in &config.models {
        models.insert(
            name.clone(),
            build_model(name, m, config.runtime.model_timeout, &redactor)?,
        );
    }
    let mut agents = Vec::new();
    for (name, a) in &config.agents {
        let mut tools = Vec::new();
        for t in &a.tools {
            match mcp_tools.get(t) {
                // A whole MCP server: every tool it offered at start.
                Some(all) => tools.extend(all.iter().cloned()),
                None => {
                    if t.contains(NAME_SEPARATOR) && registry.get(t).is_none() {
                        return Err(invalid(
                            format!("agents.{name}.tools"),
                            format!("the MCP server does not offer tool {t:?}"),
                        ));
                    }
                    tools.push(t.clone());
                }
            }
        }
        let mut spec = AgentSpec::new(name, &a.model)
            .instructions(&a.instructions)
            .tools(tools)
            .budget(Budget {
                max_turns: a.max_turns,
                max_tool_calls: a.max_tool_calls,
                max_tokens: a.max_tokens,
                deadline_ms: None,
            })
            .context(ContextBudget {
                max_tokens: fit_context(a.context_tokens, config.models.get(&a.model)),
                max_tool_output_bytes: a.context_tool_output_bytes,
                read_output: a.read_output,
            })
            .ask_user(a.ask_user)
            .read_output(a.read_output);
        if let Some(d) = a.deadline {
            spec = spec.deadline(d);
        }
        if let Some(schema) = &a.output_schema {
            spec = spec.verifier(
                Verifier::json_schema(schema)
                    .map_err(|e| invalid(format!("agents.{name}.output_schema"), e))?,
            );
        }
        agents.push(spec);
    }
    Ok(Built {
        parts: RuntimeParts {
            store,
            registry,
            models,
            agents,
            faults: None,
            redactor: Some(redactor.clone()),
        },
        mcp_servers,
        redactor,
    })
}

async fn register_all(
    config: &Config,
    registry: &mut Registry,
    mcp_servers: &mut Vec<Arc<McpServer>>,
    mcp_tools: &mut HashMap<String, Vec<String>>,
) -> Result<(), BuildError> {
    for (name, t) in &config.tools {
        if t.kind == ToolKind::Mcp {
            let server = start_mcp(name, t).await?;
            mcp_servers.push(server.clone());
            let names = register_mcp(name, t, &server, registry).await?;
            mcp_tools.insert(name.clone(), names);
        } else {
            registry
                .register(build_tool(name, t)?)
                .map_err(|e| invalid(format!("tools.{name}"), e.to_string()))?;
        }
    }
    Ok(())
}
