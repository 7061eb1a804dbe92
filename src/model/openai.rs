//! The OpenAI-compatible Chat Completions provider (OpenAI, vLLM, Ollama `/v1`, llama.cpp):
//! wire mapping, tolerant reply parsing, optional SSE streaming, and the classification of
//! every failure into the `AttemptError` the gateway acts on.
//!
//! One `complete` call is one HTTP attempt; retries, rate limits and backoff belong to the
//! gateway. Classification:
//! - `429` → `RateLimited` with `retry_after` from `retry-after-ms` or `Retry-After` (seconds
//!   or HTTP-date), except `insufficient_quota` → `Rejected` (billing does not heal);
//! - `408`, `5xx` (including `529`), timeouts, connection and mid-stream failures →
//!   `Unavailable`;
//! - other `4xx`, and replies too large to accept → `Rejected`;
//! - a `2xx` that is not a usable completion (bad JSON, no choices, an `error` object) →
//!   `Unavailable`.
//!
//! Tool calls are recognised whenever the reply carries them, whatever `finish_reason` says.
//! Malformed tool-call argument JSON is passed through verbatim: the run's decision step turns
//! it into a correction request for the model. The API key is sent as a bearer token and never
//! logged; provider error messages are redacted of it (and of every configured secret, see
//! `with_redactor`) before they travel anywhere, and only then cut to
//! [`MAX_ERROR_MESSAGE_CHARS`]. Streamed replies are bounded like non-streamed ones: at most
//! [`MAX_REPLY_BYTES`] of a stream is read.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use eventsource_stream::Eventsource;
use futures::StreamExt;
use reqwest::header::HeaderMap;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::{
    AttemptError, Message, ModelError, ModelErrorKind, ModelProvider, ModelReply, ModelRequest,
    ModelToolCall, TokenUsage, ToolChoice,
};
use crate::ids::RunId;
use crate::redact::Redactor;
use crate::tool::http::read_body_capped;

/// Largest reply accepted, streamed or not, in bytes of the body (a completion is far smaller).
pub const MAX_REPLY_BYTES: usize = 8 * 1024 * 1024;
/// Longest provider error message carried into a `ModelError`.
pub const MAX_ERROR_MESSAGE_CHARS: usize = 512;
/// Error bodies are read up to this size only.
const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;

/// An API key. Its `Debug` never shows the value.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// Wraps the secret `key`.
    pub fn new(key: impl Into<String>) -> Self {
        ApiKey(key.into())
    }

    /// The key itself, for the `Authorization` header and the redactor only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey([redacted])")
    }
}

/// Which request field carries the output-token limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MaxTokensField {
    /// `max_tokens`: older OpenAI models, vLLM, Ollama, llama.cpp.
    #[default]
    MaxTokens,
    /// `max_completion_tokens`: newer OpenAI models refuse `max_tokens`.
    MaxCompletionTokens,
}

/// Per-server differences of the "OpenAI-compatible" dialects.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OpenAiCompat {
    /// Which field carries `max_output_tokens` (default `max_tokens`).
    pub max_tokens_field: MaxTokensField,
    /// Use SSE streaming (`stream: true`).
    pub stream: bool,
    /// Stream even when tools are offered. Off for Ollama, whose streaming path can lose calls.
    pub stream_with_tools: bool,
    /// Send `stream_options.include_usage` (OpenAI, vLLM, Ollama ≥ 0.5.2).
    pub stream_usage: bool,
    /// Send `tool_choice`. Off for servers that reject it (vLLM without
    /// `--enable-auto-tool-choice`); `ToolChoice::None` is then honoured by offering no tools.
    pub send_tool_choice: bool,
    /// `parallel_tool_calls`, when set.
    pub parallel_tool_calls: Option<bool>,
}

impl Default for OpenAiCompat {
    fn default() -> Self {
        OpenAiCompat {
            max_tokens_field: MaxTokensField::MaxTokens,
            stream: false,
            stream_with_tools: true,
            stream_usage: true,
            send_tool_choice: true,
            parallel_tool_calls: None,
        }
    }
}

/// Configuration of one `[models.*]` entry of kind `openai`.
#[derive(Debug, Clone)]
pub struct OpenAiConfig {
    /// The configured name (key of `[models.*]`), for logs and metrics.
    pub name: String,
    /// E.g. `http://127.0.0.1:8000/v1`; requests go to `<base_url>/chat/completions`.
    pub base_url: String,
    /// The model name sent on the wire.
    pub model: String,
    /// Sent as a bearer token; `None`: no `Authorization` header (local servers).
    pub api_key: Option<ApiKey>,
    /// Whole-attempt deadline: connect, send, and read the full reply (or stream).
    pub timeout: Duration,
    /// Output-token limit sent with every request; `None`: the server's default.
    pub max_output_tokens: Option<u32>,
    /// Sampling temperature sent with every request; `None`: the server's default.
    pub temperature: Option<f32>,
    /// The server's dialect.
    pub compat: OpenAiCompat,
}

impl OpenAiConfig {
    /// A config with no API key, a 60 s timeout, server defaults for tokens and temperature,
    /// and the default dialect.
    pub fn new(
        name: impl Into<String>,
        base_url: impl Into<String>,
        model: impl Into<String>,
    ) -> Self {
        OpenAiConfig {
            name: name.into(),
            base_url: base_url.into(),
            model: model.into(),
            api_key: None,
            timeout: Duration::from_secs(60),
            max_output_tokens: None,
            temperature: None,
            compat: OpenAiCompat::default(),
        }
    }
}

/// Receives streamed text deltas: `(run, piece of text)`. Called in order, from the task
/// running the attempt; must not block.
pub type TextDeltaSink = Arc<dyn Fn(&RunId, &str) + Send + Sync>;

/// A Chat Completions client for one configured model.
pub struct OpenAiProvider {
    config: OpenAiConfig,
    endpoint: String,
    client: reqwest::Client,
    redactor: Redactor,
    delta_sink: Option<TextDeltaSink>,
}

impl std::fmt::Debug for OpenAiProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiProvider")
            .field("name", &self.config.name)
            .field("endpoint", &self.endpoint)
            .field("model", &self.config.model)
            .finish_non_exhaustive()
    }
}

impl OpenAiProvider {
    /// A client for `config`, posting to `<base_url>/chat/completions`. Fails (`Rejected`)
    /// only if the HTTP client cannot be built.
    pub fn new(config: OpenAiConfig) -> Result<Self, ModelError> {
        let client = reqwest::Client::builder()
            .connect_timeout(config.timeout.min(Duration::from_secs(10)))
            .build()
            .map_err(|e| {
                ModelError::new(
                    ModelErrorKind::Rejected,
                    format!("cannot build HTTP client: {e}"),
                )
            })?;
        let endpoint = format!("{}/chat/completions", config.base_url.trim_end_matches('/'));
        let mut redactor = Redactor::new();
        if let Some(key) = &config.api_key {
            redactor.add_secret(key.expose());
        }
        Ok(OpenAiProvider {
            config,
            endpoint,
            client,
            redactor,
            delta_sink: None,
        })
    }

    /// Error messages are redacted with `redactor` (every configured secret) as well as this
    /// model's own API key.
    pub fn with_redactor(mut self, redactor: &Redactor) -> Self {
        let mut redactor = redactor.clone();
        if let Some(key) = &self.config.api_key {
            redactor.add_secret(key.expose());
        }
        self.redactor = redactor;
        self
    }

    /// Streamed text deltas of every run go to `sink` (only when streaming is on).
    pub fn with_delta_sink(mut self, sink: TextDeltaSink) -> Self {
        self.delta_sink = Some(sink);
        self
    }

    /// The configuration the provider was built with.
    pub fn config(&self) -> &OpenAiConfig {
        &self.config
    }

    /// Whether this request would be streamed.
    pub fn streams(&self, request: &ModelRequest) -> bool {
        self.config.compat.stream
            && (request.tools.is_empty() || self.config.compat.stream_with_tools)
    }

    /// The JSON body sent for `request`.
    pub fn request_body(&self, request: &ModelRequest, stream: bool) -> Value {
        let compat = &self.config.compat;
        let mut body = Map::new();
        body.insert("model".into(), json!(self.config.model));
        body.insert(
            "messages".into(),
            Value::Array(request.messages.iter().map(wire_message).collect()),
        );
        let offer_tools = !request.tools.is_empty()
            && (compat.send_tool_choice || request.tool_choice == ToolChoice::Auto);
        if offer_tools {
            let tools = request
                .tools
                .iter()
                .map(|t| {
                    json!({"type": "function", "function": {
                        "name": t.name, "description": t.description, "parameters": t.parameters}})
                })
                .collect();
            body.insert("tools".into(), Value::Array(tools));
            if compat.send_tool_choice {
                let choice = match request.tool_choice {
                    ToolChoice::Auto => "auto",
                    ToolChoice::None => "none",
                };
                body.insert("tool_choice".into(), json!(choice));
            }
            if let Some(p) = compat.parallel_tool_calls {
                body.insert("parallel_tool_calls".into(), json!(p));
            }
        }
        if let Some(n) = self.config.max_output_tokens {
            let field = match compat.max_tokens_field {
                MaxTokensField::MaxTokens => "max_tokens",
                MaxTokensField::MaxCompletionTokens => "max_completion_tokens",
            };
            body.insert(field.into(), json!(n));
        }
        if let Some(t) = self.config.temperature {
            body.insert("temperature".into(), json!(t));
        }
        if stream {
            body.insert("stream".into(), json!(true));
            if compat.stream_usage {
                body.insert("stream_options".into(), json!({"include_usage": true}));
            }
        }
        Value::Object(body)
    }

    /// One attempt, streamed: text deltas go to `on_delta` as they arrive.
    pub async fn complete_streaming(
        &self,
        request: &ModelRequest,
        on_delta: &(dyn Fn(&str) + Send + Sync),
    ) -> Result<ModelReply, AttemptError> {
        let response = self.send(request, true).await?;
        // The stream ends (and the reply is refused below) once it passes MAX_REPLY_BYTES, so
        // a provider that never stops cannot grow the buffer or the reply without bound.
        let over = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let over_seen = over.clone();
        let bounded = response.bytes_stream().scan(0usize, move |read, chunk| {
            if let Ok(bytes) = &chunk {
                *read = read.saturating_add(bytes.len());
                if *read > MAX_REPLY_BYTES {
                    over_seen.store(true, std::sync::atomic::Ordering::Relaxed);
                    return futures::future::ready(None);
                }
            }
            futures::future::ready(Some(chunk))
        });
        let mut events = Box::pin(bounded.eventsource());
        let mut acc = StreamAccumulator::default();
        while let Some(event) = events.next().await {
            let event = event.map_err(|e| {
                self.unavailable(format!("stream interrupted: {}", describe_stream_error(&e)))
            })?;
            let data = event.data.trim();
            if data.is_empty() {
                continue;
            }
            if data == "[DONE]" {
                acc.done = true;
                break;
            }
            let chunk: Value = serde_json::from_str(data)
                .map_err(|e| self.unavailable(format!("unparseable stream chunk: {e}")))?;
            if let Some(err) = chunk.get("error") {
                let (message, _) = error_fields(err);
                return Err(self.unavailable(format!("error in stream: {message}")));
            }
            if let Some(delta) = acc.apply(&chunk)
                && !delta.is_empty()
            {
                on_delta(&delta);
            }
        }
        if over.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(self.error(
                ModelErrorKind::Rejected,
                format!("streamed reply larger than {MAX_REPLY_BYTES} bytes"),
            ));
        }
        if !acc.done && !acc.finished {
            return Err(self.unavailable("stream ended before the reply was complete".to_owned()));
        }
        Ok(acc.into_reply())
    }

    async fn complete_once(&self, request: &ModelRequest) -> Result<ModelReply, AttemptError> {
        let mut response = self.send(request, false).await?;
        let (bytes, truncated) = read_body_capped(&mut response, MAX_REPLY_BYTES)
            .await
            .map_err(|e| self.transport_error(&e))?;
        if truncated {
            return Err(self.error(
                ModelErrorKind::Rejected,
                format!("reply larger than {MAX_REPLY_BYTES} bytes"),
            ));
        }
        parse_completion(&bytes).map_err(|m| self.unavailable(m))
    }

    /// Sends the request; a non-2xx status becomes a classified error here.
    async fn send(
        &self,
        request: &ModelRequest,
        stream: bool,
    ) -> Result<reqwest::Response, AttemptError> {
        let body = self.request_body(request, stream);
        let mut builder = self
            .client
            .post(&self.endpoint)
            .timeout(self.config.timeout)
            .json(&body);
        if let Some(key) = &self.config.api_key {
            builder = builder.bearer_auth(key.expose());
        }
        if stream {
            builder = builder.header(reqwest::header::ACCEPT, "text/event-stream");
        }
        let mut response = builder.send().await.map_err(|e| self.transport_error(&e))?;
        let status = response.status();
        tracing::debug!(
            provider = %self.config.name,
            model = %self.config.model,
            run_id = %request.run_id,
            status = status.as_u16(),
            stream,
            "model attempt answered"
        );
        if status.is_success() {
            return Ok(response);
        }
        let headers = response.headers().clone();
        let body = read_body_capped(&mut response, MAX_ERROR_BODY_BYTES)
            .await
            .map(|(b, _)| b)
            .unwrap_or_default();
        let mut err = classify_status(status.as_u16(), &headers, &body, SystemTime::now());
        err.error.message = format!(
            "{} ({}): {}",
            self.config.name,
            status.as_u16(),
            self.redactor
                .redact_then_cut(&err.error.message, MAX_ERROR_MESSAGE_CHARS)
        );
        Err(err)
    }

    fn error(&self, kind: ModelErrorKind, message: String) -> AttemptError {
        let message = self
            .redactor
            .redact_then_cut(&message, MAX_ERROR_MESSAGE_CHARS);
        ModelError::new(kind, format!("{}: {message}", self.config.name)).into()
    }

    fn unavailable(&self, message: String) -> AttemptError {
        self.error(ModelErrorKind::Unavailable, message)
    }

    fn transport_error(&self, e: &reqwest::Error) -> AttemptError {
        let what = if e.is_timeout() {
            format!("timed out after {:?}", self.config.timeout)
        } else if e.is_connect() {
            "connection failed".to_owned()
        } else {
            "transport error".to_owned()
        };
        // Only the causes, never the URL (a proxy URL may carry a key in its query).
        self.unavailable(format!("{what}: {}", source_chain(e)))
    }
}

#[async_trait]
impl ModelProvider for OpenAiProvider {
    fn name(&self) -> &str {
        &self.config.name
    }

    async fn complete(&self, request: &ModelRequest) -> Result<ModelReply, AttemptError> {
        if self.streams(request) {
            let sink = self.delta_sink.clone();
            let run = request.run_id.clone();
            let on_delta = move |d: &str| {
                if let Some(sink) = &sink {
                    sink(&run, d);
                }
            };
            self.complete_streaming(request, &on_delta).await
        } else {
            self.complete_once(request).await
        }
    }
}

/// The innermost causes of a reqwest error, without its URL.
fn source_chain(e: &reqwest::Error) -> String {
    use std::error::Error;
    let mut parts = Vec::new();
    let mut cur: Option<&dyn Error> = e.source();
    while let Some(err) = cur {
        parts.push(err.to_string());
        cur = err.source();
    }
    if parts.is_empty() {
        "request failed".to_owned()
    } else {
        parts.join(": ")
    }
}

fn describe_stream_error<E: std::fmt::Display>(e: &E) -> String {
    // Cut later, after redaction (`OpenAiProvider::error`).
    e.to_string()
}

/// One provider-neutral message in the Chat Completions shape.
fn wire_message(message: &Message) -> Value {
    match message {
        Message::System { content } => json!({"role": "system", "content": content}),
        Message::User { content } => json!({"role": "user", "content": content}),
        Message::Assistant {
            content,
            tool_calls,
        } => {
            let mut m = Map::new();
            m.insert("role".into(), json!("assistant"));
            if tool_calls.is_empty() {
                // Some servers reject a null content on a plain assistant turn.
                m.insert("content".into(), json!(content.clone().unwrap_or_default()));
            } else {
                m.insert("content".into(), json!(content));
                let calls = tool_calls
                    .iter()
                    .map(|c| {
                        json!({"id": c.id, "type": "function",
                               "function": {"name": c.name, "arguments": c.arguments}})
                    })
                    .collect();
                m.insert("tool_calls".into(), Value::Array(calls));
            }
            Value::Object(m)
        }
        Message::Tool { call_id, content } => {
            json!({"role": "tool", "tool_call_id": call_id, "content": content})
        }
    }
}

// ---- reply parsing (tolerant: unknown fields ignored, nulls and omissions accepted) ----

#[derive(Debug, Default, Deserialize)]
struct WireCompletion {
    #[serde(default)]
    choices: Option<Vec<WireChoice>>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
struct WireChoice {
    #[serde(default)]
    message: Option<WireMessage>,
}

#[derive(Debug, Default, Deserialize)]
struct WireMessage {
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    tool_calls: Option<Vec<WireToolCall>>,
    /// The legacy single `function_call` some old servers still send.
    #[serde(default)]
    function_call: Option<WireFunction>,
}

#[derive(Debug, Default, Deserialize)]
struct WireToolCall {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<WireFunction>,
}

#[derive(Debug, Default, Deserialize)]
struct WireFunction {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

impl WireUsage {
    fn to_usage(&self) -> TokenUsage {
        TokenUsage {
            input_tokens: self.prompt_tokens.unwrap_or(0),
            output_tokens: self.completion_tokens.unwrap_or(0),
        }
    }
}

/// A tool call's arguments as the string the model wrote. Some servers (older Ollama) send an
/// object instead of a string: it is re-serialized.
fn arguments_text(arguments: Option<&Value>) -> String {
    match arguments {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// Message content: a string, or an array of `{"type":"text","text":…}` parts.
fn content_text(content: Option<&Value>) -> Option<String> {
    let text = match content? {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| match p {
                Value::String(s) => Some(s.as_str()),
                Value::Object(o) => o.get("text").and_then(Value::as_str),
                _ => None,
            })
            .collect::<String>(),
        _ => return None,
    };
    (!text.is_empty()).then_some(text)
}

/// Parses a non-streamed `chat.completion` body. `Err` carries a message for `Unavailable`.
pub fn parse_completion(body: &[u8]) -> Result<ModelReply, String> {
    let wire: WireCompletion =
        serde_json::from_slice(body).map_err(|e| format!("unparseable completion: {e}"))?;
    if let Some(err) = &wire.error {
        let (message, _) = error_fields(err);
        return Err(format!("error in completion: {message}"));
    }
    let usage = wire
        .usage
        .as_ref()
        .map(WireUsage::to_usage)
        .unwrap_or_default();
    let message = wire
        .choices
        .unwrap_or_default()
        .into_iter()
        .next()
        .and_then(|c| c.message)
        .ok_or_else(|| "completion has no choices[0].message".to_owned())?;
    let mut tool_calls: Vec<ModelToolCall> = message
        .tool_calls
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .filter_map(|(i, c)| {
            let f = c.function?;
            Some(ModelToolCall {
                id: c
                    .id
                    .filter(|id| !id.is_empty())
                    .unwrap_or_else(|| format!("call_{i}")),
                name: f.name.unwrap_or_default(),
                arguments: arguments_text(f.arguments.as_ref()),
            })
        })
        .collect();
    if tool_calls.is_empty()
        && let Some(f) = message.function_call
    {
        tool_calls.push(ModelToolCall {
            id: "call_0".to_owned(),
            name: f.name.unwrap_or_default(),
            arguments: arguments_text(f.arguments.as_ref()),
        });
    }
    Ok(ModelReply {
        text: content_text(message.content.as_ref()),
        tool_calls,
        usage,
    })
}

/// Accumulates `chat.completion.chunk`s: text, tool-call fragments keyed by `index`, usage.
#[derive(Debug, Default)]
pub struct StreamAccumulator {
    text: String,
    calls: BTreeMap<u64, PartialCall>,
    usage: Option<TokenUsage>,
    /// A `finish_reason` was seen (any value, even `""`).
    pub finished: bool,
    /// `data: [DONE]` was seen.
    pub done: bool,
}

#[derive(Debug, Default)]
struct PartialCall {
    id: String,
    name: String,
    arguments: String,
}

impl StreamAccumulator {
    /// Applies one chunk; returns its text delta, if any.
    pub fn apply(&mut self, chunk: &Value) -> Option<String> {
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null())
            && let Ok(u) = serde_json::from_value::<WireUsage>(usage.clone())
        {
            self.usage = Some(u.to_usage());
        }
        let choice = chunk.get("choices")?.as_array()?.first()?;
        if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
            self.finished = true;
        }
        let delta = choice.get("delta").or_else(|| choice.get("message"))?;
        if let Some(fragments) = delta.get("tool_calls").and_then(Value::as_array) {
            for (pos, fragment) in fragments.iter().enumerate() {
                self.apply_tool_fragment(pos, fragment);
            }
        }
        let text = content_text(delta.get("content"))?;
        self.text.push_str(&text);
        Some(text)
    }

    fn apply_tool_fragment(&mut self, pos: usize, fragment: &Value) {
        let id = fragment
            .get("id")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty());
        let index = match fragment.get("index").and_then(Value::as_u64) {
            Some(i) => i,
            // No index: a new id starts a new call; otherwise continue the last one.
            None => match id {
                Some(id) if !self.calls.values().any(|c| c.id == id) => {
                    self.calls.keys().next_back().map_or(pos as u64, |k| k + 1)
                }
                Some(id) => self
                    .calls
                    .iter()
                    .find(|(_, c)| c.id == id)
                    .map_or(0, |(k, _)| *k),
                None => self.calls.keys().next_back().copied().unwrap_or(pos as u64),
            },
        };
        let call = self.calls.entry(index).or_default();
        if let Some(id) = id
            && call.id.is_empty()
        {
            call.id = id.to_owned();
        }
        if let Some(f) = fragment.get("function") {
            if let Some(name) = f.get("name").and_then(Value::as_str)
                && call.name.is_empty()
            {
                call.name = name.to_owned();
            }
            match f.get("arguments") {
                Some(Value::String(piece)) => call.arguments.push_str(piece),
                Some(Value::Null) | None => {}
                Some(other) => call.arguments = other.to_string(),
            }
        }
    }

    /// The reply so far. Tool calls count whatever `finish_reason` said.
    pub fn into_reply(self) -> ModelReply {
        let tool_calls = self
            .calls
            .into_iter()
            .map(|(index, c)| ModelToolCall {
                id: if c.id.is_empty() {
                    format!("call_{index}")
                } else {
                    c.id
                },
                name: c.name,
                arguments: c.arguments,
            })
            .collect();
        ModelReply {
            text: (!self.text.is_empty()).then_some(self.text),
            tool_calls,
            usage: self.usage.unwrap_or_default(),
        }
    }
}

// ---- failure classification ----

/// `(message, code-or-type)` of an OpenAI-style error object, or of a bare string error.
fn error_fields(err: &Value) -> (String, Option<String>) {
    match err {
        Value::String(s) => (s.clone(), None),
        Value::Object(o) => {
            let message = o
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("no message");
            let code = ["code", "type"]
                .iter()
                .filter_map(|k| o.get(*k).and_then(Value::as_str))
                .find(|s| *s == "insufficient_quota")
                .or_else(|| o.get("code").and_then(Value::as_str))
                .or_else(|| o.get("type").and_then(Value::as_str))
                .map(str::to_owned);
            (message.to_owned(), code)
        }
        other => (other.to_string(), None),
    }
}

/// Classifies a non-2xx reply. The message is the provider's, bounded only by the error body
/// read (64 KiB): not yet redacted, so not yet cut (the caller redacts, then cuts).
pub fn classify_status(
    status: u16,
    headers: &HeaderMap,
    body: &[u8],
    now: SystemTime,
) -> AttemptError {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let (message, code) = match parsed.as_ref().and_then(|v| v.get("error").or(Some(v))) {
        Some(Value::Object(o)) if !o.contains_key("message") && !o.contains_key("code") => {
            (String::from_utf8_lossy(body).into_owned(), None)
        }
        Some(v) => error_fields(v),
        None => (String::from_utf8_lossy(body).into_owned(), None),
    };
    let message = message.trim().to_owned();
    let message = if message.is_empty() {
        format!("HTTP {status}")
    } else {
        message
    };
    let quota = code.as_deref() == Some("insufficient_quota");
    let (kind, retry_after) = match status {
        429 if quota => (ModelErrorKind::Rejected, None),
        429 => (ModelErrorKind::RateLimited, parse_retry_after(headers, now)),
        408 | 500..=599 => (ModelErrorKind::Unavailable, parse_retry_after(headers, now)),
        400 | 413 if is_context_overflow(code.as_deref(), &message) => {
            (ModelErrorKind::ContextLengthExceeded, None)
        }
        _ => (ModelErrorKind::Rejected, None),
    };
    AttemptError {
        error: ModelError::new(kind, message),
        retry_after,
    }
}

/// Whether a refusal says the prompt is longer than the model's context: OpenAI's code
/// `context_length_exceeded`, or the wording of vLLM ("maximum context length"), llama.cpp
/// ("exceeds the available context size") and llama-cpp-python ("exceed context window").
pub fn is_context_overflow(code: Option<&str>, message: &str) -> bool {
    if matches!(
        code,
        Some("context_length_exceeded" | "exceed_context_size_error")
    ) {
        return true;
    }
    let m = message.to_ascii_lowercase();
    ["context length", "context window", "context size"]
        .iter()
        .any(|p| m.contains(p))
}

/// Longest `Retry-After` honoured (a misbehaving server must not park a run for days).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// The provider-given minimum wait: `retry-after-ms` (milliseconds, OpenAI), else
/// `Retry-After` as delay-seconds or an HTTP-date (relative to `now`). Capped at
/// [`MAX_RETRY_AFTER`].
pub fn parse_retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|s| !s.is_empty())
    };
    let from_ms = header("retry-after-ms")
        .and_then(|v| v.parse::<f64>().ok())
        .and_then(|ms| Duration::try_from_secs_f64(ms / 1000.0).ok());
    let wait = from_ms.or_else(|| {
        let v = header("retry-after")?;
        if let Ok(secs) = v.parse::<f64>() {
            return Duration::try_from_secs_f64(secs).ok();
        }
        let at = httpdate::parse_http_date(v).ok()?;
        Some(at.duration_since(now).unwrap_or(Duration::ZERO))
    })?;
    Some(wait.min(MAX_RETRY_AFTER))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::model::ToolDefinition;
    use reqwest::header::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn retry_after_parses_seconds_ms_and_http_date() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777); // Sun, 06 Nov 1994 08:49:37 GMT
        assert_eq!(
            parse_retry_after(&headers(&[("retry-after", "7")]), now),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            parse_retry_after(&headers(&[("retry-after", "1.5")]), now),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(
            parse_retry_after(
                &headers(&[("retry-after-ms", "250"), ("retry-after", "9")]),
                now
            ),
            Some(Duration::from_millis(250))
        );
        assert_eq!(
            parse_retry_after(
                &headers(&[("retry-after", "Sun, 06 Nov 1994 08:50:07 GMT")]),
                now
            ),
            Some(Duration::from_secs(30))
        );
        // A date in the past means "now".
        assert_eq!(
            parse_retry_after(
                &headers(&[("retry-after", "Sun, 06 Nov 1994 08:00:00 GMT")]),
                now
            ),
            Some(Duration::ZERO)
        );
        assert_eq!(
            parse_retry_after(&headers(&[("retry-after", "soon")]), now),
            None
        );
        assert_eq!(
            parse_retry_after(&headers(&[("retry-after", "-3")]), now),
            None
        );
        assert_eq!(
            parse_retry_after(&headers(&[("retry-after", "99999999")]), now),
            Some(MAX_RETRY_AFTER)
        );
        assert_eq!(parse_retry_after(&HeaderMap::new(), now), None);
    }

    #[test]
    fn context_overflows_are_classified_as_such() {
        let now = SystemTime::now();
        let bodies: [&[u8]; 4] = [
            br#"{"error":{"message":"too long","type":"invalid_request_error","code":"context_length_exceeded"}}"#,
            br#"{"error":{"message":"This model's maximum context length is 2048 tokens. However, you requested 3000 tokens"}}"#,
            br#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error"}}"#,
            br#"{"error":{"message":"Requested tokens (5000) exceed context window of 2048"}}"#,
        ];
        for body in bodies {
            let e = classify_status(400, &HeaderMap::new(), body, now);
            assert_eq!(
                e.error.kind,
                ModelErrorKind::ContextLengthExceeded,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        let other = classify_status(
            400,
            &HeaderMap::new(),
            br#"{"error":{"message":"bad tool schema"}}"#,
            now,
        );
        assert_eq!(other.error.kind, ModelErrorKind::Rejected);
        assert!(!ModelErrorKind::ContextLengthExceeded.is_retryable());
    }

    #[test]
    fn statuses_are_classified() {
        let now = SystemTime::now();
        let h = headers(&[("retry-after", "3")]);
        let rl = classify_status(
            429,
            &h,
            br#"{"error":{"message":"slow down","type":"requests"}}"#,
            now,
        );
        assert_eq!(rl.error.kind, ModelErrorKind::RateLimited);
        assert_eq!(rl.retry_after, Some(Duration::from_secs(3)));
        assert_eq!(rl.error.message, "slow down");
        let quota = classify_status(
            429,
            &h,
            br#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#,
            now,
        );
        assert_eq!(quota.error.kind, ModelErrorKind::Rejected);
        assert_eq!(quota.retry_after, None);
        for s in [500, 502, 503, 529, 408] {
            assert_eq!(
                classify_status(s, &HeaderMap::new(), b"", now).error.kind,
                ModelErrorKind::Unavailable
            );
        }
        for s in [400, 401, 403, 404, 413, 422] {
            assert_eq!(
                classify_status(s, &HeaderMap::new(), b"oops", now)
                    .error
                    .kind,
                ModelErrorKind::Rejected
            );
        }
        // Ollama / llama.cpp style bare errors.
        let e = classify_status(
            400,
            &HeaderMap::new(),
            br#"{"error":"model not found"}"#,
            now,
        );
        assert_eq!(e.error.message, "model not found");
    }

    #[test]
    fn error_messages_are_redacted_whole_then_cut() {
        let key = "sk-provider-key-5e4d3c2b1a";
        let planted = "planted-config-secret-77";
        let mut config = OpenAiConfig::new("m", "http://127.0.0.1:1/v1", "x");
        config.api_key = Some(ApiKey::new(key));
        let provider = OpenAiProvider::new(config)
            .unwrap()
            .with_redactor(&Redactor::with_secrets([planted]));
        // Both secrets straddle the cut: cut first, their first characters would remain.
        for secret in [key, planted] {
            let long = format!(
                "{}{secret}{}",
                "x".repeat(MAX_ERROR_MESSAGE_CHARS - 4),
                "y".repeat(5000)
            );
            let e = classify_status(400, &HeaderMap::new(), long.as_bytes(), SystemTime::now());
            assert_eq!(
                e.error.message.len(),
                long.len(),
                "classification does not cut"
            );
            let AttemptError { error, .. } = provider.error(ModelErrorKind::Rejected, long);
            assert!(!error.message.contains(&secret[..4]), "{}", error.message);
            assert!(error.message.chars().count() <= MAX_ERROR_MESSAGE_CHARS + 4);
        }
    }

    #[test]
    fn completion_parsing_is_tolerant() {
        // Tool calls with finish_reason "stop", null content, unknown fields, missing usage.
        let r = parse_completion(
            br#"{"id":"x","object":"chat.completion","service_tier":"weird","choices":[{"index":0,"finish_reason":"stop",
                "message":{"role":"assistant","content":null,"reasoning_content":"hmm","tool_calls":[
                  {"id":"call_a","type":"function","function":{"name":"lookup","arguments":"{\"q\":1}"}},
                  {"function":{"name":"other","arguments":{"k":"v"}}}]}}]}"#,
        )
        .unwrap();
        assert_eq!(r.text, None);
        assert_eq!(r.tool_calls.len(), 2);
        assert_eq!(r.tool_calls[0].id, "call_a");
        assert_eq!(r.tool_calls[0].arguments, r#"{"q":1}"#);
        assert_eq!(r.tool_calls[1].id, "call_1");
        assert_eq!(r.tool_calls[1].arguments, r#"{"k":"v"}"#);
        assert_eq!(r.usage, TokenUsage::default());

        let r = parse_completion(
            br#"{"choices":[{"message":{"content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},"finish_reason":""}],
                "usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12,"prompt_tokens_details":{"cached_tokens":0}}}"#,
        )
        .unwrap();
        assert_eq!(r.text.as_deref(), Some("ab"));
        assert_eq!(
            r.usage,
            TokenUsage {
                input_tokens: 10,
                output_tokens: 2
            }
        );

        assert!(parse_completion(b"not json").is_err());
        assert!(parse_completion(br#"{"choices":[]}"#).is_err());
        assert!(parse_completion(br#"{"error":{"message":"boom"}}"#).is_err());
    }

    #[test]
    fn stream_fragments_accumulate_by_index_even_interleaved() {
        let mut acc = StreamAccumulator::default();
        let chunks = [
            json!({"choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"}}]}),
            json!({"choices":[{"index":0,"delta":{"content":"lo"}}]}),
            json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c0","type":"function","function":{"name":"a","arguments":""}}]}}]}),
            json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"c1","type":"function","function":{"name":"b","arguments":"{\"y\""}}]}}]}),
            json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"x\":"}}]}}]}),
            json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"function":{"arguments":":2}"}}]}}]}),
            json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"1}"}}]}}]}),
            json!({"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}),
            json!({"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}),
        ];
        let deltas: Vec<String> = chunks.iter().filter_map(|c| acc.apply(c)).collect();
        assert_eq!(deltas, ["Hel", "lo"]);
        assert!(acc.finished);
        let r = acc.into_reply();
        assert_eq!(r.text.as_deref(), Some("Hello"));
        assert_eq!(
            r.tool_calls,
            vec![
                ModelToolCall {
                    id: "c0".into(),
                    name: "a".into(),
                    arguments: r#"{"x":1}"#.into()
                },
                ModelToolCall {
                    id: "c1".into(),
                    name: "b".into(),
                    arguments: r#"{"y":2}"#.into()
                },
            ]
        );
        assert_eq!(
            r.usage,
            TokenUsage {
                input_tokens: 5,
                output_tokens: 7
            }
        );
    }

    #[test]
    fn request_body_maps_messages_tools_and_compat_flags() {
        let mut cfg = OpenAiConfig::new("local", "http://h/v1/", "m1");
        cfg.max_output_tokens = Some(256);
        cfg.compat.max_tokens_field = MaxTokensField::MaxCompletionTokens;
        cfg.compat.parallel_tool_calls = Some(false);
        let p = OpenAiProvider::new(cfg).unwrap();
        assert_eq!(p.endpoint, "http://h/v1/chat/completions");
        let req = ModelRequest {
            prior_replies: 0,
            run_id: RunId::generate(),
            tenant: "t".into(),
            model: "local".into(),
            messages: vec![
                Message::System {
                    content: "sys".into(),
                },
                Message::User {
                    content: "goal".into(),
                },
                Message::Assistant {
                    content: None,
                    tool_calls: vec![ModelToolCall {
                        id: "c1".into(),
                        name: "t".into(),
                        arguments: "{}".into(),
                    }],
                },
                Message::Tool {
                    call_id: "c1".into(),
                    content: "{\"ok\":true}".into(),
                },
                Message::Assistant {
                    content: None,
                    tool_calls: vec![],
                },
            ],
            tools: vec![ToolDefinition {
                name: "t".into(),
                description: "d".into(),
                parameters: json!({"type":"object"}),
            }]
            .into(),
            tool_choice: ToolChoice::None,
        };
        let body = p.request_body(&req, true);
        assert_eq!(
            body,
            json!({
                "model": "m1",
                "messages": [
                    {"role":"system","content":"sys"},
                    {"role":"user","content":"goal"},
                    {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"t","arguments":"{}"}}]},
                    {"role":"tool","tool_call_id":"c1","content":"{\"ok\":true}"},
                    {"role":"assistant","content":""}
                ],
                "tools": [{"type":"function","function":{"name":"t","description":"d","parameters":{"type":"object"}}}],
                "tool_choice": "none",
                "parallel_tool_calls": false,
                "max_completion_tokens": 256,
                "stream": true,
                "stream_options": {"include_usage": true}
            })
        );
        // Without tool_choice support, "none" is honoured by offering no tools.
        let mut cfg = OpenAiConfig::new("local", "http://h/v1", "m1");
        cfg.compat.send_tool_choice = false;
        let p = OpenAiProvider::new(cfg).unwrap();
        let body = p.request_body(&req, false);
        assert!(body.get("tools").is_none() && body.get("tool_choice").is_none());
        assert!(body.get("stream").is_none());
    }

    #[test]
    fn api_key_never_shows_in_debug() {
        let mut cfg = OpenAiConfig::new("m", "http://h", "x");
        cfg.api_key = Some(ApiKey::new("sk-secret-secret-secret"));
        let p = OpenAiProvider::new(cfg.clone()).unwrap();
        assert!(!format!("{cfg:?}{p:?}").contains("sk-secret"));
    }
}
