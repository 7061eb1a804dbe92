//! Agents: what a run is an instance of — a model, instructions, an allow-list of tools, budget
//! defaults and completion verifiers.

use std::sync::Arc;
use std::time::Duration;

use crate::context::{ContextBudget, ContextInput, build_context};
use crate::model::{Message, ToolDefinition};
use crate::run::Budget;
use crate::run::state::RunState;
use crate::run::verify::Verifier;
use crate::tool::registry::{AgentTools, Registry};

/// An agent as configured.
#[derive(Debug, Clone)]
pub struct AgentSpec {
    /// The agent's name (`^[a-zA-Z0-9_-]{1,64}$`), what a run is created with.
    pub name: String,
    /// Key of the model provider.
    pub model: String,
    /// The system message of every request (none when empty).
    pub instructions: String,
    /// Allow-list of registered tool names; the compensating tools of those are allowed
    /// implicitly.
    pub tools: Vec<String>,
    /// Budget defaults; `deadline_ms` here is ignored, see `deadline`.
    pub budget: Budget,
    /// Wall-clock limit of a run, from its creation.
    pub deadline: Option<Duration>,
    /// Checks a candidate final answer must pass, in order; the first rejection sends the run
    /// back to the model.
    pub verifiers: Vec<Verifier>,
    /// Size of each model request (see `context`).
    pub context: ContextBudget,
    /// Whether the model is offered `ask_user` (a question to the user; the run waits for
    /// input). Off: only the allow-listed tools, and an `ask_user` call is corrected.
    pub ask_user: bool,
    /// Whether the model is offered the runtime's `read_output` tool, which pages through an
    /// earlier tool output of the run that the context cut.
    pub read_output: bool,
}

impl AgentSpec {
    /// An agent on model provider `model` with no instructions, no tools, the default budget
    /// and context, no deadline or verifiers, and `ask_user` offered.
    pub fn new(name: impl Into<String>, model: impl Into<String>) -> Self {
        AgentSpec {
            name: name.into(),
            model: model.into(),
            instructions: String::new(),
            tools: Vec::new(),
            budget: Budget::default(),
            deadline: None,
            verifiers: Vec::new(),
            context: ContextBudget::default(),
            ask_user: true,
            read_output: true,
        }
    }

    /// Offers `read_output` or not (the context's truncation notes follow).
    pub fn read_output(mut self, offered: bool) -> Self {
        self.read_output = offered;
        self.context.read_output = offered;
        self
    }

    /// Whether the model is offered `ask_user`.
    pub fn ask_user(mut self, offered: bool) -> Self {
        self.ask_user = offered;
        self
    }

    /// Sets the system message.
    pub fn instructions(mut self, text: impl Into<String>) -> Self {
        self.instructions = text.into();
        self
    }

    /// Replaces the allow-list of tools.
    pub fn tools<S: Into<String>>(mut self, tools: impl IntoIterator<Item = S>) -> Self {
        self.tools = tools.into_iter().map(Into::into).collect();
        self
    }

    /// Sets the budget defaults (its `deadline_ms` is ignored; see [`AgentSpec::deadline`]).
    pub fn budget(mut self, budget: Budget) -> Self {
        self.budget = budget;
        self
    }

    /// Sets the wall-clock limit of each run, from its creation.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// Sets the size of each model request.
    pub fn context(mut self, budget: ContextBudget) -> Self {
        // Whether the notes offer `read_output` follows whether the agent offers it.
        self.context = ContextBudget {
            read_output: self.read_output,
            ..budget
        };
        self
    }

    /// Adds a verifier after the ones already set.
    pub fn verifier(mut self, v: Verifier) -> Self {
        self.verifiers.push(v);
        self
    }
}

/// Why an agent cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The agent lists a tool (or a listed tool names a compensating tool) that the registry
    /// does not hold.
    #[error("agent `{agent}` uses tool `{tool}`, which is not registered")]
    UnknownTool {
        /// The agent's name.
        agent: String,
        /// The missing tool.
        tool: String,
    },
    /// The agent's name (carried) is empty, longer than 64 bytes or has other characters than
    /// ASCII letters, digits, `_` and `-`.
    #[error("agent name `{0}` must match ^[a-zA-Z0-9_-]{{1,64}}$")]
    BadName(String),
}

/// An agent ready for runs: its spec, its view of the tools and the definitions offered.
#[derive(Debug)]
pub struct Agent {
    /// The agent as configured.
    pub spec: AgentSpec,
    /// The registry as this agent sees it: only its allow-listed tools.
    pub tools: AgentTools,
    /// The tool definitions offered to the model with every request (`ask_user` included
    /// when offered).
    pub definitions: Arc<[ToolDefinition]>,
    /// Digest of what a run depends on (model, instructions, tool schemas, budgets): a run
    /// records it at creation, and a node whose definition differs does not take the run over.
    pub digest: String,
    /// Estimated tokens of the tool definitions sent with every request: they count against
    /// the context budget.
    pub schema_tokens: usize,
}

/// SHA-256 over the parts of an agent's definition that a run's behaviour depends on.
fn definition_digest(spec: &AgentSpec, definitions: &[ToolDefinition]) -> String {
    use sha2::{Digest, Sha256};
    // `read_output` belongs to the runtime, not to the agent's definition: offering it (from
    // this release on) must not make runs started before look like another agent's.
    let tools: Vec<_> = definitions
        .iter()
        .filter(|d| d.name != crate::run::read_output::READ_OUTPUT_TOOL)
        .map(|d| serde_json::json!([d.name, d.description, d.parameters]))
        .collect();
    let doc = serde_json::json!({
        "model": spec.model,
        "instructions": spec.instructions,
        "tools": tools,
        "budget": spec.budget,
        "deadline_ms": spec.deadline.map(|d| d.as_millis() as u64),
    });
    hex::encode(Sha256::digest(doc.to_string().as_bytes()))
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
        // A compensating tool is allowed implicitly, but it must exist.
        if let Some(c) = spec
            .tools
            .iter()
            .filter_map(|t| registry.get(t)?.tool.spec().compensate.clone())
            .find(|c| registry.get(&c.tool).is_none())
        {
            return Err(Error::UnknownTool {
                agent: spec.name.clone(),
                tool: c.tool,
            });
        }
        let tools = AgentTools::new(registry.clone(), spec.tools.clone().into())
            .with_ask_user(spec.ask_user)
            .with_read_output(spec.read_output);
        let definitions: Arc<[ToolDefinition]> = tools.definitions().into();
        let digest = definition_digest(&spec, &definitions);
        let schema_tokens = definitions
            .iter()
            .map(|d| {
                crate::context::estimate_tokens(&d.name)
                    + crate::context::estimate_tokens(&d.description)
                    + crate::context::estimate_tokens(&d.parameters.to_string())
                    + crate::context::MESSAGE_OVERHEAD_TOKENS
            })
            .sum();
        Ok(Agent {
            spec,
            tools,
            definitions,
            digest,
            schema_tokens,
        })
    }

    /// The budget of the run's next request: the agent's target minus the tool schemas sent
    /// with it, halved for each rebuild after the provider said a request did not fit.
    pub fn context_budget(&self, run: &RunState) -> ContextBudget {
        let target = self
            .spec
            .context
            .max_tokens
            .saturating_sub(self.schema_tokens);
        let shrunk = target >> run.context_rebuilds.min(8);
        ContextBudget {
            max_tokens: shrunk.max(1),
            ..self.spec.context
        }
    }

    /// The messages of the next model request, built by `context::build_context` within the
    /// agent's budget: the instructions as the only system message (omitted when empty), the
    /// goal (never dropped), then as much recent history as fits, older turns condensed into a
    /// note; tool call/result pairs are never split. Tool output never enters the system
    /// message. Deterministic: the same run gives the same messages.
    pub fn context(&self, run: &RunState) -> Vec<Message> {
        let (goal, history, skipped): (String, &[Message], usize) = match run.messages.split_first()
        {
            Some((Message::User { content }, rest)) => (content.clone(), rest, 1),
            _ => (
                match &run.input {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                },
                &run.messages[..],
                0,
            ),
        };
        // Trimmed outputs by history index (the goal is not in `history`).
        let whole_lengths: std::collections::BTreeMap<usize, usize> = run
            .trimmed_outputs
            .iter()
            .filter_map(|(&i, &len)| Some((i.checked_sub(skipped)?, len)))
            .collect();
        let input = ContextInput {
            instructions: &self.spec.instructions,
            goal: &goal,
            obligations: &[],
            history,
            seqs: None,
            whole_lengths: (!whole_lengths.is_empty()).then_some(&whole_lengths),
        };
        let mut messages = build_context(&input, &self.context_budget(run));
        if self.spec.instructions.is_empty() {
            messages.retain(|m| !matches!(m, Message::System { .. }));
        }
        messages
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::ids::RunId;
    use crate::model::ModelToolCall;

    #[test]
    fn tool_schemas_count_against_the_budget_and_a_rebuild_halves_it() {
        use crate::tool::builtin::{Add, Echo};
        let mut registry = Registry::new();
        registry.register(Arc::new(Echo::new())).unwrap();
        registry.register(Arc::new(Add::new())).unwrap();
        let registry = Arc::new(registry);
        let budget = ContextBudget {
            max_tokens: 1000,
            max_tool_output_bytes: 64,
            read_output: true,
        };
        let bare = Agent::new(AgentSpec::new("a", "m").context(budget), &registry).unwrap();
        let tooled = Agent::new(
            AgentSpec::new("a", "m")
                .tools(["echo", "add"])
                .context(budget),
            &registry,
        )
        .unwrap();
        // Even a bare agent is offered `ask_user`.
        assert!(bare.schema_tokens > 0);
        assert!(tooled.schema_tokens > bare.schema_tokens);
        let sent: usize = tooled
            .definitions
            .iter()
            .map(|d| serde_json::to_string(d).unwrap().len() / 4)
            .sum();
        assert!(
            tooled.schema_tokens >= sent / 2,
            "{} for ~{sent}",
            tooled.schema_tokens
        );
        let mut run = RunState::new(
            RunId::generate(),
            "t".into(),
            "a".into(),
            serde_json::json!("goal"),
            Budget::default(),
            0,
        );
        assert_eq!(
            bare.context_budget(&run).max_tokens,
            1000 - bare.schema_tokens
        );
        let with_schemas = tooled.context_budget(&run).max_tokens;
        assert_eq!(with_schemas, 1000 - tooled.schema_tokens);
        run.context_rebuilds = 1;
        assert_eq!(tooled.context_budget(&run).max_tokens, with_schemas / 2);
    }

    /// A new run whose transcript holds its goal, "the goal".
    fn run_with_goal() -> RunState {
        let mut run = RunState::new(
            RunId::generate(),
            "t".into(),
            "a".into(),
            serde_json::json!("the goal"),
            Budget::default(),
            0,
        );
        run.messages.push(Message::User {
            content: "the goal".into(),
        });
        run
    }

    /// Bytes of tool output the run holds in memory.
    fn tool_bytes(run: &RunState) -> usize {
        run.messages
            .iter()
            .map(|m| match m {
                Message::Tool { content, .. } => content.len(),
                _ => 0,
            })
            .sum()
    }

    /// A run that keeps its stored outputs only as far as the context shows them gives the
    /// model exactly the context the whole outputs would: the same cut, the same note with
    /// the whole length and the pointer, condensed turns alike, and `read_output` pages whole.
    #[test]
    fn trimmed_outputs_build_the_same_context_as_whole_ones() {
        let spec = AgentSpec::new("a", "m").context(ContextBudget {
            max_tokens: 3_000,
            max_tool_output_bytes: 100,
            read_output: true,
        });
        let agent = Agent::new(spec, &Arc::new(Registry::new())).unwrap();
        for keep_multibyte in [false, true] {
            let mut run = run_with_goal();
            for i in 0..12 {
                let name = if i == 11 { "read_output" } else { "fetch" };
                run.messages.push(Message::Assistant {
                    content: None,
                    tool_calls: vec![ModelToolCall {
                        id: format!("c{i}"),
                        name: name.into(),
                        arguments: "{}".into(),
                    }],
                });
                // Outputs of every size around the cut, some with a wide character on it.
                let body = if keep_multibyte {
                    "é".repeat(40 + i * 20)
                } else {
                    "x".repeat(60 + i * 20)
                };
                run.messages.push(Message::Tool {
                    call_id: format!("c{i}"),
                    content: format!("{{\"ok\":true,\"data\":\"{body}\"}}"),
                });
            }
            let whole = agent.context(&run);
            let before = tool_bytes(&run);
            // Only what is stored is trimmed: the newest two messages are not yet.
            let stored = run.messages.len() - 2;
            let freed = run.trim_stored_outputs(stored, 100);
            assert!(freed > 0 && !run.trimmed_outputs.is_empty());
            assert!(run.trimmed_outputs.keys().all(|&i| i < stored));
            let after = tool_bytes(&run);
            assert_eq!(before - after, freed);
            assert_eq!(agent.context(&run), whole, "multibyte: {keep_multibyte}");
            // Trimming again changes nothing; the read_output page (c11) is never trimmed.
            assert_eq!(run.trim_stored_outputs(run.messages.len(), 100), 0);
            assert!(
                matches!(run.messages.last(), Some(Message::Tool { content, .. }) if content.len() > 100)
            );
        }
    }

    #[test]
    fn the_context_keeps_instructions_and_goal_and_condenses_old_turns() {
        let spec = AgentSpec::new("a", "m")
            .instructions("rules")
            .context(ContextBudget {
                max_tokens: 400,
                max_tool_output_bytes: 64,
                read_output: true,
            });
        let agent = Agent::new(spec, &Arc::new(Registry::new())).unwrap();
        let mut run = run_with_goal();
        for i in 0..30 {
            run.messages.push(Message::Assistant {
                content: None,
                tool_calls: vec![ModelToolCall {
                    id: format!("c{i}"),
                    name: "echo".into(),
                    arguments: "{}".into(),
                }],
            });
            run.messages.push(Message::Tool {
                call_id: format!("c{i}"),
                content: "x".repeat(200),
            });
        }
        let built = agent.context(&run);
        assert_eq!(built, agent.context(&run), "deterministic");
        assert!(built.len() < run.messages.len());
        assert_eq!(
            built[0],
            Message::System {
                content: "rules".into()
            }
        );
        assert_eq!(
            built[1],
            Message::User {
                content: "the goal".into()
            }
        );
        assert!(matches!(&built[2], Message::User { content } if content.contains("condensed")));
        // The newest call and its result are both there.
        assert!(matches!(built.last(), Some(Message::Tool { call_id, .. }) if call_id == "c29"));
        let no_rules = Agent::new(AgentSpec::new("b", "m"), &Arc::new(Registry::new())).unwrap();
        assert!(
            !no_rules
                .context(&run)
                .iter()
                .any(|m| matches!(m, Message::System { .. }))
        );
    }
}
