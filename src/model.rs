//! What a model provider is to the runtime: the `ModelProvider` trait, the provider-neutral
//! conversation types, and the classified errors the gateway acts on.
//!
//! Providers: `scripted` (cassettes, for tests, the demo and the benchmark). The shared pool
//! that calls them is `gateway`.

pub mod gateway;
pub mod openai;
pub mod scripted;

use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::RunId;

/// One message of a run's conversation, in a provider-neutral shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Message {
    /// Operator-controlled instructions. Never carries tool output.
    System {
        /// The instruction text.
        content: String,
    },
    /// The goal, operator input, and runtime notes (corrections, nudges, verifier reasons).
    User {
        /// The message text.
        content: String,
    },
    /// What the model said: text, tool calls, or both.
    Assistant {
        /// The text the model wrote; `None` when it only called tools.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        content: Option<String>,
        /// The tool calls of the reply, in the model's order; empty for a plain answer.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<ModelToolCall>,
    },
    /// The envelope of one tool result, answering the assistant call with `call_id`.
    Tool {
        /// The `ModelToolCall::id` this message answers.
        call_id: String,
        /// The result envelope as JSON text (see `ToolResult::to_message_content`).
        content: String,
    },
}

/// A tool call as the model wrote it: the arguments are still an unparsed JSON string.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelToolCall {
    /// The id the model gave the call (echoed back on the tool message).
    pub id: String,
    /// The name of the tool called, as offered in `ToolDefinition::name`; not yet checked.
    pub name: String,
    /// The arguments as the model wrote them: JSON text, possibly invalid.
    pub arguments: String,
}

/// A tool as offered to the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDefinition {
    /// The name the model calls the tool by.
    pub name: String,
    /// What the tool does, shown to the model.
    pub description: String,
    /// JSON Schema of the tool's arguments object.
    pub parameters: Value,
}

/// Whether the model may call tools on this turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoice {
    /// The model may answer or call any offered tool.
    Auto,
    /// Used for the forced final turn of no-progress escalation.
    None,
}

/// One request to a model.
#[derive(Debug, Clone)]
pub struct ModelRequest {
    /// The run the request belongs to: the pool key, the key of streamed deltas, and a log field.
    pub run_id: RunId,
    /// The run's tenant: the gateway queues requests per tenant so that one tenant's burst
    /// cannot starve another.
    pub tenant: String,
    /// The configured model name (key of `[models.*]`).
    pub model: String,
    /// The conversation to complete, oldest first, as built by the run's context.
    pub messages: Vec<Message>,
    /// Shared by every request of the agent: schemas are not copied per call.
    pub tools: std::sync::Arc<[ToolDefinition]>,
    /// Whether tools may be called on this turn (`None` on a forced final turn).
    pub tool_choice: ToolChoice,
    /// How many replies of the model the run's whole history holds. `messages` may show fewer
    /// once older turns are condensed, so this, not a count of `messages`, says which turn the
    /// request is for (`scripted::turn_of`).
    pub prior_replies: u32,
}

/// Tokens a reply consumed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenUsage {
    /// Prompt tokens, as the provider reported them (0 when it reported none).
    pub input_tokens: u64,
    /// Completion tokens, as the provider reported them (0 when it reported none).
    pub output_tokens: u64,
}

/// A model's raw reply. Parsed into a decision by `run::decision`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelReply {
    /// The reply's text; `None` when the model wrote none.
    #[serde(default)]
    pub text: Option<String>,
    /// The tool calls of the reply, in the model's order.
    #[serde(default)]
    pub tool_calls: Vec<ModelToolCall>,
    /// Tokens this reply consumed; added to the run's usage and token budget.
    #[serde(default)]
    pub usage: TokenUsage,
}

/// A classified model failure. The gateway retries what is retryable; what reaches the run is
/// final for that attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct ModelError {
    /// How the failure is handled (retried or not).
    pub kind: ModelErrorKind,
    /// Human-readable detail, for logs and the run's error.
    pub message: String,
}

impl ModelError {
    /// A failure of `kind` with the detail `message`.
    pub fn new(kind: ModelErrorKind, message: impl Into<String>) -> Self {
        ModelError {
            kind,
            message: message.into(),
        }
    }
}

/// How a model failure is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelErrorKind {
    /// The gateway's queue was full: the run retries later with backoff.
    Overloaded,
    /// The provider said 429; `retry_after` is honoured by the gateway.
    RateLimited,
    /// Timeout, 5xx or connection failure.
    Unavailable,
    /// The request itself was refused (4xx other than 408/429, auth): retrying cannot help.
    Rejected,
    /// The request does not fit the model's context window: the run rebuilds its context
    /// once with a smaller budget; retrying the same request cannot help.
    ContextLengthExceeded,
}

impl std::fmt::Display for ModelErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ModelErrorKind::Overloaded => "overloaded",
            ModelErrorKind::RateLimited => "rate_limited",
            ModelErrorKind::Unavailable => "unavailable",
            ModelErrorKind::Rejected => "rejected",
            ModelErrorKind::ContextLengthExceeded => "context_length_exceeded",
        })
    }
}

impl ModelErrorKind {
    /// Whether another attempt of the same request may succeed.
    pub fn is_retryable(self) -> bool {
        !matches!(
            self,
            ModelErrorKind::Rejected | ModelErrorKind::ContextLengthExceeded
        )
    }
}

/// A failed attempt as seen by the gateway's retry loop.
#[derive(Debug, Clone)]
pub struct AttemptError {
    /// The classified failure of the attempt.
    pub error: ModelError,
    /// A provider-given minimum wait (from `Retry-After`).
    pub retry_after: Option<Duration>,
}

impl From<ModelError> for AttemptError {
    fn from(error: ModelError) -> Self {
        AttemptError {
            error,
            retry_after: None,
        }
    }
}

/// A model backend: OpenAI-compatible HTTP, or a scripted cassette.
#[async_trait]
pub trait ModelProvider: Send + Sync + 'static {
    /// The provider's configured name, for logs and metrics.
    fn name(&self) -> &str;

    /// One attempt at a completion. Must not retry by itself: the gateway owns retries so that
    /// every attempt is counted and rate-limited.
    async fn complete(&self, request: &ModelRequest) -> Result<ModelReply, AttemptError>;
}
