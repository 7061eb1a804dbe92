//! From configuration to `RuntimeParts`: the store, the tools, the model providers and the
//! agents. Kinds this build does not contain yet fail at start with a clear error.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde_json::Value;

use crate::agent::AgentSpec;
use crate::config::{Config, ModelConfig, ModelKind, ToolConfig, ToolKind};
use crate::model::ModelProvider;
use crate::model::scripted::{Cassette, ScriptedModel};
use crate::run::Budget;
use crate::run::verify::Verifier;
use crate::runtime::RuntimeParts;
use crate::store::SharedStore;
use crate::tool::builtin::{Add, CountingTool, Echo};
use crate::tool::http::HttpTool;
use crate::tool::registry::Registry;
use crate::tool::{Tool, ToolContext, ToolEffect, ToolError, ToolSpec};

/// Why the configured parts could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("{key}: {message}")]
    Invalid { key: String, message: String },
    #[error("{what} is not available in this build")]
    Unavailable { what: String },
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
            message: e.to_string(),
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

/// Applies the configured policy keys to a spec.
fn apply(name: &str, t: &ToolConfig, mut spec: ToolSpec) -> ToolSpec {
    spec.name = name.to_owned();
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
    if let Some(d) = t.timeout {
        spec.timeout = d;
    }
    if let Some(n) = t.max_output_bytes {
        spec.max_output_bytes = n;
    }
    if let Some(p) = t.polling {
        spec.polling = p;
    }
    spec
}

fn build_tool(name: &str, t: &ToolConfig) -> Result<Arc<dyn Tool>, BuildError> {
    let key = format!("tools.{name}");
    match t.kind {
        // At merge: `crate::tool::mcp`.
        ToolKind::Http => {
            let url = t
                .url
                .as_deref()
                .ok_or_else(|| invalid(format!("{key}.url"), "is required for kind \"http\""))?;
            let parameters = t
                .parameters
                .clone()
                .unwrap_or_else(|| serde_json::json!({"type": "object"}));
            let spec = apply(name, t, ToolSpec::new(name, "", parameters));
            let tool = HttpTool::new(spec, url, t.status_url.as_deref())
                .map_err(|e| invalid(format!("{key}.url"), e.message))?;
            Ok(Arc::new(tool))
        }
        ToolKind::Mcp => Err(BuildError::Unavailable {
            what: format!("{key}: tool kind \"mcp\""),
        }),
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
            let spec = apply(name, t, inner.spec().clone());
            Ok(Arc::new(Configured { inner, spec }))
        }
    }
}

fn build_model(name: &str, m: &ModelConfig) -> Result<Arc<dyn ModelProvider>, BuildError> {
    let key = format!("models.{name}");
    match m.kind {
        // At merge: `crate::model::openai::OpenAiProvider`.
        ModelKind::Openai => Err(BuildError::Unavailable {
            what: format!("{key}: model kind \"openai\""),
        }),
        ModelKind::Scripted => {
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

/// Builds everything the runtime runs from `config` (already validated) on `store`, plus native
/// tools supplied by an embedding program.
pub fn build_parts(
    config: &Config,
    store: SharedStore,
    native_tools: Vec<Arc<dyn Tool>>,
) -> Result<RuntimeParts, BuildError> {
    let mut registry = Registry::new();
    for tool in native_tools {
        let name = tool.spec().name.clone();
        registry
            .register(tool)
            .map_err(|e| invalid(format!("native tool {name}"), e.to_string()))?;
    }
    for (name, t) in &config.tools {
        registry
            .register(build_tool(name, t)?)
            .map_err(|e| invalid(format!("tools.{name}"), e.to_string()))?;
    }
    let mut models: HashMap<String, Arc<dyn ModelProvider>> = HashMap::new();
    for (name, m) in &config.models {
        models.insert(name.clone(), build_model(name, m)?);
    }
    let mut agents = Vec::new();
    for (name, a) in &config.agents {
        let mut spec = AgentSpec::new(name, &a.model)
            .instructions(&a.instructions)
            .tools(a.tools.iter().cloned())
            .budget(Budget {
                max_turns: a.max_turns,
                max_tool_calls: a.max_tool_calls,
                max_tokens: a.max_tokens,
                deadline_ms: None,
            });
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
    Ok(RuntimeParts {
        store,
        registry,
        models,
        agents,
        faults: None,
    })
}
