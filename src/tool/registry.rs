//! The one registry of tools: each tool with its compiled argument validator, and the per-agent
//! view (`AgentTools`) that the pure run machine consults for allow-lists, schemas, approval,
//! and each tool's guard (permissions, argument rules, result projection).

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;

use super::{Tool, ToolSpec};
use crate::model::ToolDefinition;
use crate::run::decision::ASK_USER_TOOL;
use crate::run::machine::{ArgumentError, ToolCatalog, ToolInfo, ToolLookup};
use crate::run::read_output::READ_OUTPUT_TOOL;

/// A tool and its compiled schema.
pub struct RegisteredTool {
    /// The tool itself.
    pub tool: Arc<dyn Tool>,
    validator: jsonschema::Validator,
}

impl std::fmt::Debug for RegisteredTool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredTool")
            .field("name", &self.tool.spec().name)
            .finish()
    }
}

/// Why a tool could not be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The name does not match `^[a-zA-Z0-9_-]{1,64}$`: the name.
    #[error("tool name `{0}` must match ^[a-zA-Z0-9_-]{{1,64}}$")]
    BadName(String),
    /// A tool of this name is already registered: the name.
    #[error("tool `{0}` is registered twice")]
    Duplicate(String),
    /// The name is the runtime's own (`ask_user`): the name.
    #[error("tool name `{0}` is reserved")]
    Reserved(String),
    /// The parameters schema does not compile (draft 2020-12).
    #[error("tool `{name}`: invalid parameters schema: {message}")]
    BadSchema {
        /// The tool's name.
        name: String,
        /// The compiler's error.
        message: String,
    },
}

/// Every tool the daemon knows, by name.
#[derive(Debug, Default)]
pub struct Registry {
    tools: HashMap<String, RegisteredTool>,
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a tool after checking its name and compiling its schema.
    pub fn register(&mut self, tool: Arc<dyn Tool>) -> Result<(), Error> {
        let spec = tool.spec();
        let name = spec.name.clone();
        if !valid_name(&name) {
            return Err(Error::BadName(name));
        }
        if name == ASK_USER_TOOL || name == READ_OUTPUT_TOOL {
            return Err(Error::Reserved(name));
        }
        if self.tools.contains_key(&name) {
            return Err(Error::Duplicate(name));
        }
        let validator = jsonschema::draft202012::options()
            .should_validate_formats(true)
            .build(&spec.parameters)
            .map_err(|e| Error::BadSchema {
                name: name.clone(),
                message: e.to_string(),
            })?;
        self.tools.insert(name, RegisteredTool { tool, validator });
        Ok(())
    }

    /// The tool registered as `name`, if any.
    pub fn get(&self, name: &str) -> Option<&RegisteredTool> {
        self.tools.get(name)
    }

    /// The names of every registered tool, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tools.keys().map(String::as_str)
    }

    /// Checks `arguments` against the tool's schema; the first error with its JSON pointer.
    pub fn validate(&self, name: &str, arguments: &Value) -> Result<(), ArgumentError> {
        let Some(t) = self.tools.get(name) else {
            return Err(ArgumentError {
                path: String::new(),
                message: format!("unknown tool `{name}`"),
            });
        };
        t.validator.validate(arguments).map_err(|e| ArgumentError {
            path: e.instance_path().to_string(),
            message: e.to_string(),
        })
    }
}

/// The definition of the reserved `ask_user` pseudo-tool offered to every agent.
pub fn ask_user_definition() -> ToolDefinition {
    ToolDefinition {
        name: ASK_USER_TOOL.to_owned(),
        description: "Ask the user a question and wait for the answer. Must be the only tool call of its reply.".to_owned(),
        parameters: serde_json::json!({
            "type": "object",
            "properties": {"question": {"type": "string", "minLength": 1}},
            "required": ["question"],
            "additionalProperties": false
        }),
    }
}

/// One agent's view of the registry: only its allow-listed tools are usable.
#[derive(Debug, Clone)]
pub struct AgentTools {
    registry: Arc<Registry>,
    allowed: Arc<[String]>,
    /// Whether `ask_user` is offered (per agent; default on).
    ask_user: bool,
    /// Whether the runtime's `read_output` tool is offered (per agent; default on).
    read_output: bool,
}

/// The compiled schema of `read_output`'s arguments.
fn read_output_validator() -> &'static jsonschema::Validator {
    static V: std::sync::OnceLock<jsonschema::Validator> = std::sync::OnceLock::new();
    V.get_or_init(|| {
        jsonschema::draft202012::new(&crate::run::read_output::parameters())
            .expect("read_output's schema compiles")
    })
}

impl AgentTools {
    /// The view of `registry` for an agent allowed the tools `allowed`, with `ask_user`
    /// offered.
    pub fn new(registry: Arc<Registry>, allowed: Arc<[String]>) -> Self {
        AgentTools {
            registry,
            allowed,
            ask_user: true,
            read_output: true,
        }
    }

    /// Offers the runtime's `read_output` tool or not.
    pub fn with_read_output(mut self, offered: bool) -> Self {
        self.read_output = offered;
        self
    }

    /// Whether `read_output` is offered.
    pub fn offers_read_output(&self) -> bool {
        self.read_output
    }

    /// Offers `ask_user` or not.
    pub fn with_ask_user(mut self, offered: bool) -> Self {
        self.ask_user = offered;
        self
    }

    fn allowed_spec(&self, name: &str) -> Option<&ToolSpec> {
        if !self.allowed.iter().any(|a| a == name) {
            return None;
        }
        self.registry.get(name).map(|t| t.tool.spec())
    }

    /// The tool definitions offered to the model (allow-listed tools plus `ask_user` unless it
    /// is switched off).
    pub fn definitions(&self) -> Vec<ToolDefinition> {
        let mut defs: Vec<ToolDefinition> = self
            .allowed
            .iter()
            .filter_map(|n| self.registry.get(n))
            .map(|t| {
                let s = t.tool.spec();
                ToolDefinition {
                    name: s.name.clone(),
                    description: s.description.clone(),
                    parameters: s.parameters.clone(),
                }
            })
            .collect();
        if self.ask_user {
            defs.push(ask_user_definition());
        }
        if self.read_output {
            defs.push(crate::run::read_output::definition());
        }
        defs
    }

    /// The tool behind an allow-listed name.
    pub fn tool(&self, name: &str) -> Option<Arc<dyn Tool>> {
        self.allowed_spec(name)?;
        self.registry.get(name).map(|t| t.tool.clone())
    }

    /// The tool behind a name that an allow-listed tool names as its compensating tool (the
    /// runtime may call it to undo a call; the model is not offered it unless it is listed).
    pub fn compensating_tool(&self, name: &str) -> Option<Arc<dyn Tool>> {
        self.allowed
            .iter()
            .filter_map(|a| self.registry.get(a))
            .any(|t| {
                t.tool
                    .spec()
                    .compensate
                    .as_ref()
                    .is_some_and(|c| c.tool == name)
            })
            .then(|| self.registry.get(name).map(|t| t.tool.clone()))
            .flatten()
    }
}

impl ToolCatalog for AgentTools {
    fn offers_ask_user(&self) -> bool {
        self.ask_user
    }

    fn lookup(&self, name: &str) -> ToolLookup {
        if name == READ_OUTPUT_TOOL && self.read_output {
            // Runtime-provided: it reads the run's own transcript and changes nothing.
            return ToolLookup::Allowed(ToolInfo {
                effect: crate::tool::ToolEffect::Read,
                polling: false,
                reconcilable: false,
            });
        }
        match self.allowed_spec(name) {
            Some(s) => ToolLookup::Allowed(ToolInfo {
                effect: s.effect,
                polling: s.polling,
                reconcilable: s.reconcilable,
            }),
            None if self.registry.get(name).is_some() => ToolLookup::NotAllowed,
            None => ToolLookup::Unknown,
        }
    }

    fn validate(&self, name: &str, arguments: &Value) -> Result<(), ArgumentError> {
        if name == READ_OUTPUT_TOOL && self.read_output {
            return read_output_validator()
                .validate(arguments)
                .map_err(|e| ArgumentError {
                    path: e.instance_path().to_string(),
                    message: e.to_string(),
                });
        }
        self.registry.validate(name, arguments)
    }

    fn needs_approval(&self, name: &str, arguments: &Value) -> bool {
        self.allowed_spec(name)
            .is_some_and(|s| s.requires_approval(arguments))
    }

    fn on_approval_timeout(&self, name: &str) -> crate::tool::ApprovalTimeoutAction {
        self.allowed_spec(name)
            .map(|s| s.on_approval_timeout)
            .unwrap_or_default()
    }

    fn guard(&self, name: &str) -> Option<&crate::run::guard::Guard> {
        self.allowed_spec(name).map(|s| &*s.guard)
    }

    fn max_failures(&self, name: &str) -> u32 {
        self.allowed_spec(name)
            .map_or(crate::tool::DEFAULT_MAX_FAILURES, |s| s.max_failures)
    }

    fn on_permission_error(&self, name: &str) -> crate::tool::OnPermissionError {
        self.allowed_spec(name)
            .map(|s| s.on_permission_error)
            .unwrap_or_default()
    }

    fn compensation(&self, name: &str) -> Option<crate::run::machine::CompensationPlan<'_>> {
        let rule = self.allowed_spec(name)?.compensate.as_ref()?;
        let undo = self.registry.get(&rule.tool)?.tool.spec();
        Some(crate::run::machine::CompensationPlan {
            rule,
            info: ToolInfo {
                effect: undo.effect,
                polling: undo.polling,
                reconcilable: undo.reconcilable,
            },
            guard: Some(&*undo.guard),
        })
    }
}
