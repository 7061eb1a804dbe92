//! Agents: what a run is an instance of — a model, instructions, an allow-list of tools, budget
//! defaults and completion verifiers.

use std::sync::Arc;
use std::time::Duration;

use crate::model::{Message, ToolDefinition};
use crate::run::Budget;
use crate::run::state::RunState;
use crate::run::verify::Verifier;
use crate::tool::registry::{AgentTools, Registry};

/// An agent as configured.
#[derive(Debug, Clone)]
pub struct AgentSpec {
    pub name: String,
    /// Key of the model provider.
    pub model: String,
    pub instructions: String,
    pub tools: Vec<String>,
    /// Budget defaults; `deadline_ms` here is ignored, see `deadline`.
    pub budget: Budget,
    /// Wall-clock limit of a run, from its creation.
    pub deadline: Option<Duration>,
    pub verifiers: Vec<Verifier>,
}

impl AgentSpec {
    pub fn new(name: impl Into<String>, model: impl Into<String>) -> Self {
        AgentSpec {
            name: name.into(),
            model: model.into(),
            instructions: String::new(),
            tools: Vec::new(),
            budget: Budget::default(),
            deadline: None,
            verifiers: Vec::new(),
        }
    }

    pub fn instructions(mut self, text: impl Into<String>) -> Self {
        self.instructions = text.into();
        self
    }

    pub fn tools<S: Into<String>>(mut self, tools: impl IntoIterator<Item = S>) -> Self {
        self.tools = tools.into_iter().map(Into::into).collect();
        self
    }

    pub fn budget(mut self, budget: Budget) -> Self {
        self.budget = budget;
        self
    }

    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    pub fn verifier(mut self, v: Verifier) -> Self {
        self.verifiers.push(v);
        self
    }
}

/// Why an agent cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("agent `{agent}` uses tool `{tool}`, which is not registered")]
    UnknownTool { agent: String, tool: String },
    #[error("agent name `{0}` must match ^[a-zA-Z0-9_-]{{1,64}}$")]
    BadName(String),
}

/// An agent ready for runs: its spec, its view of the tools and the definitions offered.
#[derive(Debug)]
pub struct Agent {
    pub spec: AgentSpec,
    pub tools: AgentTools,
    pub definitions: Arc<[ToolDefinition]>,
}

impl Agent {
    /// Checks the spec against the registry.
    pub fn new(spec: AgentSpec, registry: &Arc<Registry>) -> Result<Self, Error> {
        if spec.name.is_empty()
            || spec.name.len() > 64
            || !spec
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(Error::BadName(spec.name));
        }
        if let Some(t) = spec.tools.iter().find(|t| registry.get(t).is_none()) {
            return Err(Error::UnknownTool {
                agent: spec.name.clone(),
                tool: t.clone(),
            });
        }
        let tools = AgentTools::new(registry.clone(), spec.tools.clone().into());
        let definitions = tools.definitions().into();
        Ok(Agent {
            spec,
            tools,
            definitions,
        })
    }

    /// The messages of the next model request: the instructions as the only system message,
    /// then the conversation. Tool output never enters the system message.
    pub fn context(&self, run: &RunState) -> Vec<Message> {
        let mut messages = Vec::with_capacity(run.messages.len() + 1);
        if !self.spec.instructions.is_empty() {
            messages.push(Message::System {
                content: self.spec.instructions.clone(),
            });
        }
        messages.extend(run.messages.iter().cloned());
        messages
    }
}
