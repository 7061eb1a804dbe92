//! Fake servers for integration and end-to-end tests, each on 127.0.0.1:0: an
//! OpenAI-compatible Chat Completions server that plays scripted replies and records requests,
//! and an HTTP tool server that records every attempt and every execution per
//! `Idempotency-Key`, answers status queries, and can check at receipt that the call's intent
//! is already durable (a "witness").
//!
//! Both are stopped when dropped. Handlers that "hang" wait on a future that never completes,
//! so tests observe client timeouts without sleeping.
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

async fn serve(router: Router) -> (SocketAddr, CancellationToken) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let stopped = stop.clone();
    tokio::spawn(async move {
        let _ = axum::serve(listener, router)
            .with_graceful_shutdown(async move { stopped.cancelled().await })
            .await;
    });
    (addr, stop)
}

// ---------------------------------------------------------------- fake OpenAI server

/// One scripted answer of the fake model server.
#[derive(Debug, Clone)]
pub enum Scripted {
    /// `200` with this `chat.completion` body.
    Completion(Value),
    /// Any status, extra headers and a raw body.
    Status {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    },
    /// `200 text/event-stream` with these `data:` payloads (add `"[DONE]"` yourself).
    Sse(Vec<String>),
    /// Never answers (the client must time out).
    Hang,
}

impl Scripted {
    /// A plain text reply with usage.
    pub fn text(text: &str) -> Self {
        Scripted::Completion(json!({
            "id": "chatcmpl-1", "object": "chat.completion", "model": "fake",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
        }))
    }

    /// A tool-call reply: `(id, name, arguments JSON text)` each.
    pub fn tool_calls(calls: &[(&str, &str, &str)]) -> Self {
        let calls: Vec<Value> = calls
            .iter()
            .map(|(id, name, args)| {
                json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})
            })
            .collect();
        Scripted::Completion(json!({
            "choices": [{"index": 0, "finish_reason": "tool_calls",
                         "message": {"role": "assistant", "content": null, "tool_calls": calls}}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 9}
        }))
    }

    pub fn status(status: u16, body: &str) -> Self {
        Scripted::Status {
            status,
            headers: Vec::new(),
            body: body.to_owned(),
        }
    }

    /// `429` with `Retry-After`.
    pub fn rate_limited(retry_after: &str) -> Self {
        Scripted::Status {
            status: 429,
            headers: vec![("retry-after".into(), retry_after.into())],
            body: json!({"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}})
                .to_string(),
        }
    }
}

/// One request the fake model server received.
#[derive(Debug, Clone)]
pub struct RecordedRequest {
    pub body: Value,
    pub authorization: Option<String>,
    /// When the request arrived.
    pub at: std::time::Instant,
}

#[derive(Default)]
struct OpenAiState {
    script: Mutex<VecDeque<Scripted>>,
    fallback: Mutex<Option<Scripted>>,
    requests: Mutex<Vec<RecordedRequest>>,
    /// `(limit, window)`: more than `limit` requests in one fixed window answer `429`.
    rate_limit: Mutex<Option<(u32, std::time::Duration)>>,
    /// `(window start, requests admitted in it)`.
    window: Mutex<Option<(std::time::Instant, u32)>>,
    rejected: std::sync::atomic::AtomicU64,
    /// `Hang` handlers dropped because the client went away (its connection closed).
    abandoned: Arc<std::sync::atomic::AtomicU64>,
}

/// Counts a hanging handler dropped by the server, which happens when the client closes the
/// connection.
struct CountOnDrop(Arc<std::sync::atomic::AtomicU64>);

impl Drop for CountOnDrop {
    fn drop(&mut self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A fake OpenAI-compatible server: `POST /v1/chat/completions` pops the next scripted reply
/// (an empty script answers `500`).
pub struct FakeOpenAi {
    addr: SocketAddr,
    state: Arc<OpenAiState>,
    stop: CancellationToken,
}

impl FakeOpenAi {
    pub async fn start() -> Self {
        let state = Arc::new(OpenAiState::default());
        let router = Router::new()
            .route("/v1/chat/completions", post(chat))
            .with_state(Arc::clone(&state));
        let (addr, stop) = serve(router).await;
        FakeOpenAi { addr, state, stop }
    }

    /// The base URL to configure (`http://127.0.0.1:PORT/v1`).
    pub fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn push(&self, reply: Scripted) -> &Self {
        self.state.script.lock().unwrap().push_back(reply);
        self
    }

    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.state.requests.lock().unwrap().clone()
    }

    pub fn request_count(&self) -> usize {
        self.state.requests.lock().unwrap().len()
    }

    /// The reply given when the script is empty (default: `500 no scripted reply left`).
    pub fn set_fallback(&self, reply: Scripted) -> &Self {
        *self.state.fallback.lock().unwrap() = Some(reply);
        self
    }

    /// Answers `429` (with `retry-after-ms` = the rest of the window) to requests beyond
    /// `limit` in each fixed `window`, as a provider's rate limit would.
    pub fn set_rate_limit(&self, limit: u32, window: std::time::Duration) -> &Self {
        *self.state.rate_limit.lock().unwrap() = Some((limit, window));
        self
    }

    /// Requests answered `429` by the rate limit.
    pub fn rate_limited(&self) -> u64 {
        self.state
            .rejected
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Scripted replies not yet consumed.
    pub fn remaining(&self) -> usize {
        self.state.script.lock().unwrap().len()
    }

    /// Hanging requests whose client closed the connection.
    pub fn abandoned(&self) -> u64 {
        self.state
            .abandoned
            .load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for FakeOpenAi {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn chat(State(state): State<Arc<OpenAiState>>, headers: HeaderMap, body: String) -> Response {
    let body: Value = serde_json::from_str(&body).unwrap_or(Value::String(body));
    let now = std::time::Instant::now();
    state.requests.lock().unwrap().push(RecordedRequest {
        body,
        authorization: headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        at: now,
    });
    let limit = *state.rate_limit.lock().unwrap();
    if let Some((limit, window)) = limit {
        let mut w = state.window.lock().unwrap();
        let (start, count) = match *w {
            Some((start, count)) if now.duration_since(start) < window => (start, count),
            _ => (now, 0),
        };
        if count >= limit {
            *w = Some((start, count));
            drop(w);
            state
                .rejected
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let wait = window.saturating_sub(now.duration_since(start));
            return Response::builder()
                .status(429)
                .header("content-type", "application/json")
                .header("retry-after-ms", wait.as_millis().max(1).to_string())
                .body(Body::from(
                    json!({"error": {"message": "Rate limit reached", "code": "rate_limit_exceeded"}})
                        .to_string(),
                ))
                .unwrap();
        }
        *w = Some((start, count + 1));
    }
    let next = state.script.lock().unwrap().pop_front();
    let next = next.or_else(|| state.fallback.lock().unwrap().clone());
    match next {
        None => (StatusCode::INTERNAL_SERVER_ERROR, "no scripted reply left").into_response(),
        Some(Scripted::Completion(v)) => axum::Json(v).into_response(),
        Some(Scripted::Status {
            status,
            headers,
            body,
        }) => {
            let mut builder = Response::builder()
                .status(status)
                .header("content-type", "application/json");
            for (k, v) in headers {
                builder = builder.header(k, v);
            }
            builder.body(Body::from(body)).unwrap()
        }
        Some(Scripted::Sse(events)) => {
            let text: String = events.iter().map(|e| format!("data: {e}\n\n")).collect();
            Response::builder()
                .status(200)
                .header("content-type", "text/event-stream")
                .body(Body::from(text))
                .unwrap()
        }
        Some(Scripted::Hang) => {
            let _guard = CountOnDrop(Arc::clone(&state.abandoned));
            std::future::pending().await
        }
    }
}

// ---------------------------------------------------------------- recording tool server

/// What the tool server does with the next call.
#[derive(Debug, Clone)]
pub enum ToolBehavior {
    /// Apply (count an execution) and answer `200` with the result.
    Apply,
    /// Refuse without applying: this status and `{"error":{"message"}}`.
    Refuse(u16, String),
    /// Apply, then answer this (error) status.
    ApplyThenFail(u16),
    /// Apply, then never answer.
    ApplyThenHang,
    /// Never answer, without applying.
    Hang,
    /// Apply and answer `200` with a JSON string of this many bytes.
    ApplyLarge(usize),
    /// Apply and answer `200` with this body (as given: JSON or not).
    ApplyWith(String),
}

/// One request the tool server received.
#[derive(Debug, Clone)]
pub struct ToolRequest {
    pub idempotency_key: Option<String>,
    pub authorization: Option<String>,
    /// `X-Agentd-Tenant`: whom the call acts for.
    pub tenant: Option<String>,
    /// `X-Agentd-Run-Id`.
    pub run_id: Option<String>,
    pub body: Value,
    /// When the request arrived.
    pub received_at: std::time::Instant,
}

/// One request as a witness sees it, before the effect is applied.
#[derive(Debug, Clone)]
pub struct WitnessCall {
    /// `run_id` from the request body.
    pub run_id: String,
    pub key: String,
    /// How many requests with this key arrived so far, this one included (from 1).
    pub attempt: u32,
}

/// Checks a request at receipt (e.g. "its intent is already in the store"); an `Err` is
/// recorded as a violation and the request is served anyway.
pub type Witness = Arc<
    dyn Fn(WitnessCall) -> futures::future::BoxFuture<'static, Result<(), String>> + Send + Sync,
>;

#[derive(Default)]
struct ToolState {
    behaviors: Mutex<VecDeque<ToolBehavior>>,
    requests: Mutex<Vec<ToolRequest>>,
    executions: Mutex<HashMap<String, u32>>,
    results: Mutex<HashMap<String, Value>>,
    /// Every request with a key, applied or not, per key.
    attempts: Mutex<HashMap<String, u32>>,
    /// Simulated processing time `(min, max)` in ms, after the effect and before the answer.
    latency_ms: Mutex<(u64, u64)>,
    witness: Mutex<Option<Witness>>,
    violations: Mutex<Vec<String>>,
    /// Applying calls answered (after the simulated latency).
    answered: std::sync::atomic::AtomicU32,
    /// `GET /status` queries.
    status_queries: std::sync::atomic::AtomicU32,
}

/// A recording HTTP tool server. `POST /tool` takes the next behavior (default `Apply`);
/// `GET /status` answers the recorded result of the `Idempotency-Key`, or `404`.
///
/// `POST /tool` deliberately does not deduplicate (a *naive* tool): every applying request
/// counts as an execution, so tests can assert that a key ran exactly once. `POST /honouring`
/// is the same tool honouring keys: a repeated key gets the recorded result and is not applied
/// again (but is counted in `attempts`).
pub struct ToolServer {
    addr: SocketAddr,
    state: Arc<ToolState>,
    stop: CancellationToken,
}

impl ToolServer {
    pub async fn start() -> Self {
        let state = Arc::new(ToolState::default());
        let router = Router::new()
            .route("/tool", post(tool_call))
            .route("/honouring", post(tool_call_honouring))
            .route("/status", get(tool_status))
            .with_state(Arc::clone(&state));
        let (addr, stop) = serve(router).await;
        ToolServer { addr, state, stop }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn tool_url(&self) -> String {
        format!("http://{}/tool", self.addr)
    }

    pub fn status_url(&self) -> String {
        format!("http://{}/status", self.addr)
    }

    /// The URL of the key-honouring variant of the tool.
    pub fn honouring_url(&self) -> String {
        format!("http://{}/honouring", self.addr)
    }

    /// Adds a random processing time in `[min, max]` after applying and before answering, so a
    /// caller can die while the effect is applied and the answer not yet sent.
    pub fn set_latency(&self, min: std::time::Duration, max: std::time::Duration) -> &Self {
        *self.state.latency_ms.lock().unwrap() = (min.as_millis() as u64, max.as_millis() as u64);
        self
    }

    /// Checks every keyed request at receipt, before it is applied.
    pub fn set_witness(&self, witness: Witness) -> &Self {
        *self.state.witness.lock().unwrap() = Some(witness);
        self
    }

    /// Applying calls answered so far (the answer may still have found nobody listening).
    pub fn answered(&self) -> u32 {
        self.state
            .answered
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Status queries so far.
    pub fn status_queries(&self) -> u32 {
        self.state
            .status_queries
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// What witnesses rejected.
    pub fn violations(&self) -> Vec<String> {
        self.state.violations.lock().unwrap().clone()
    }

    /// How many requests carried this key (applied, deduplicated or refused).
    pub fn attempts(&self, key: &str) -> u32 {
        self.state
            .attempts
            .lock()
            .unwrap()
            .get(key)
            .copied()
            .unwrap_or(0)
    }

    /// Requests per key.
    pub fn all_attempts(&self) -> HashMap<String, u32> {
        self.state.attempts.lock().unwrap().clone()
    }

    /// Applied executions per key.
    pub fn all_executions(&self) -> HashMap<String, u32> {
        self.state.executions.lock().unwrap().clone()
    }

    pub fn push(&self, behavior: ToolBehavior) -> &Self {
        self.state.behaviors.lock().unwrap().push_back(behavior);
        self
    }

    /// How many times the call with this key was applied.
    pub fn executions(&self, key: &str) -> u32 {
        self.state
            .executions
            .lock()
            .unwrap()
            .get(key)
            .copied()
            .unwrap_or(0)
    }

    pub fn total_executions(&self) -> u32 {
        self.state.executions.lock().unwrap().values().sum()
    }

    pub fn requests(&self) -> Vec<ToolRequest> {
        self.state.requests.lock().unwrap().clone()
    }
}

impl Drop for ToolServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn key_of(headers: &HeaderMap) -> Option<String> {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

impl ToolState {
    /// The honouring tool: a key seen before gets its recorded result, unapplied.
    fn apply_once(&self, key: &str, body: &Value) -> Value {
        let applied = self.executions.lock().unwrap().contains_key(key);
        if applied && let Some(r) = self.results.lock().unwrap().get(key) {
            return r.clone();
        }
        self.apply(key, body)
    }

    async fn simulate_latency(&self) {
        let (min, max) = *self.latency_ms.lock().unwrap();
        if max > 0 {
            let ms = if max > min {
                min + rand::random::<u64>() % (max - min + 1)
            } else {
                min
            };
            // Simulated work, not synchronisation.
            tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
        }
    }

    fn apply(&self, key: &str, body: &Value) -> Value {
        let mut executions = self.executions.lock().unwrap();
        let n = executions.entry(key.to_owned()).or_insert(0);
        *n += 1;
        let result = json!({"applied": true, "execution": *n, "arguments": body.get("arguments")});
        self.results
            .lock()
            .unwrap()
            .insert(key.to_owned(), result.clone());
        result
    }
}

async fn tool_call(
    State(state): State<Arc<ToolState>>,
    headers: HeaderMap,
    body: String,
) -> Response {
    serve_call(state, headers, body, false).await
}

async fn tool_call_honouring(
    State(state): State<Arc<ToolState>>,
    headers: HeaderMap,
    body: String,
) -> Response {
    serve_call(state, headers, body, true).await
}

async fn serve_call(
    state: Arc<ToolState>,
    headers: HeaderMap,
    body: String,
    honouring: bool,
) -> Response {
    let body: Value = serde_json::from_str(&body).unwrap_or(Value::String(body));
    let key = key_of(&headers);
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    state.requests.lock().unwrap().push(ToolRequest {
        received_at: std::time::Instant::now(),
        idempotency_key: key.clone(),
        authorization: header("authorization"),
        tenant: header("x-agentd-tenant"),
        run_id: header("x-agentd-run-id"),
        body: body.clone(),
    });
    let Some(key) = key else {
        return (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"error": {"message": "missing Idempotency-Key"}})),
        )
            .into_response();
    };
    let attempt = {
        let mut attempts = state.attempts.lock().unwrap();
        let n = attempts.entry(key.clone()).or_insert(0);
        *n += 1;
        *n
    };
    let witness = state.witness.lock().unwrap().clone();
    if let Some(w) = witness {
        let call = WitnessCall {
            run_id: body
                .get("run_id")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            key: key.clone(),
            attempt,
        };
        if let Err(v) = w(call).await {
            state.violations.lock().unwrap().push(v);
        }
    }
    let behavior = state
        .behaviors
        .lock()
        .unwrap()
        .pop_front()
        .unwrap_or(ToolBehavior::Apply);
    match behavior {
        ToolBehavior::Apply => {
            let result = if honouring {
                state.apply_once(&key, &body)
            } else {
                state.apply(&key, &body)
            };
            state.simulate_latency().await;
            state
                .answered
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            axum::Json(result).into_response()
        }
        ToolBehavior::Refuse(status, message) => (
            StatusCode::from_u16(status).unwrap(),
            axum::Json(json!({"error": {"message": message}})),
        )
            .into_response(),
        ToolBehavior::ApplyThenFail(status) => {
            state.apply(&key, &body);
            (StatusCode::from_u16(status).unwrap(), "internal error").into_response()
        }
        ToolBehavior::ApplyThenHang => {
            state.apply(&key, &body);
            std::future::pending().await
        }
        ToolBehavior::Hang => std::future::pending().await,
        ToolBehavior::ApplyLarge(n) => {
            state.apply(&key, &body);
            axum::Json(Value::String("z".repeat(n))).into_response()
        }
        ToolBehavior::ApplyWith(answer) => {
            state.apply(&key, &body);
            Response::builder()
                .status(200)
                .header("content-type", "application/json")
                .body(Body::from(answer))
                .unwrap()
        }
    }
}

async fn tool_status(State(state): State<Arc<ToolState>>, headers: HeaderMap) -> Response {
    state
        .status_queries
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let Some(key) = key_of(&headers) else {
        return (StatusCode::BAD_REQUEST, "missing Idempotency-Key").into_response();
    };
    match state.results.lock().unwrap().get(&key) {
        Some(result) => axum::Json(result.clone()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

// ---------------------------------------------------------------- long-running tool server

/// How the long-running tool answers a poll of its status URL.
#[derive(Debug, Clone)]
pub enum PollAnswer {
    /// `202`: still running.
    Running,
    /// `200` with this body: the result.
    Done(Value),
    /// This status with `{"error":{"message"}}`.
    Fail(u16, String),
}

/// One call the long-running tool accepted.
#[derive(Debug, Clone)]
pub struct AcceptedCall {
    pub idempotency_key: Option<String>,
    pub tenant: Option<String>,
    pub callback_url: Option<String>,
    pub callback_token: Option<String>,
    pub body: Value,
}

struct LongState {
    calls: Mutex<Vec<AcceptedCall>>,
    answer: Mutex<PollAnswer>,
    polls: tokio::sync::watch::Sender<usize>,
    accepted: tokio::sync::watch::Sender<usize>,
}

/// A long-running HTTP tool: `POST /job` answers `202` with `{"status_url"}` (absolute),
/// `POST /job-location` answers `202` with a relative `Location` header, `POST /job-callback`
/// answers `202` with neither (only the callback completes it). `GET /status/{n}` answers the
/// current [`PollAnswer`] and counts every poll.
pub struct LongTool {
    addr: SocketAddr,
    state: Arc<LongState>,
    stop: CancellationToken,
}

fn header(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned)
}

async fn long_accept(
    State((state, mode, base)): State<(Arc<LongState>, &'static str, String)>,
    headers: HeaderMap,
    body: axum::Json<Value>,
) -> Response {
    let n = {
        let mut calls = state.calls.lock().unwrap();
        calls.push(AcceptedCall {
            idempotency_key: header(&headers, "idempotency-key"),
            tenant: header(&headers, "x-agentd-tenant"),
            callback_url: header(&headers, "x-agentd-callback-url"),
            callback_token: header(&headers, "x-agentd-callback-token"),
            body: body.0,
        });
        calls.len()
    };
    state.accepted.send_replace(n);
    match mode {
        "body" => (
            StatusCode::ACCEPTED,
            axum::Json(json!({"status_url": format!("{base}/status/{n}")})),
        )
            .into_response(),
        "location" => (
            StatusCode::ACCEPTED,
            [("location", format!("/status/{n}"))],
            "",
        )
            .into_response(),
        _ => (StatusCode::ACCEPTED, axum::Json(json!({"state": "queued"}))).into_response(),
    }
}

async fn long_status(State(state): State<Arc<LongState>>) -> Response {
    state.polls.send_modify(|n| *n += 1);
    match state.answer.lock().unwrap().clone() {
        PollAnswer::Running => (
            StatusCode::ACCEPTED,
            axum::Json(json!({"state": "running"})),
        )
            .into_response(),
        PollAnswer::Done(v) => (StatusCode::OK, axum::Json(v)).into_response(),
        PollAnswer::Fail(status, message) => (
            StatusCode::from_u16(status).unwrap(),
            axum::Json(json!({"error": {"message": message}})),
        )
            .into_response(),
    }
}

impl LongTool {
    /// Starts on `127.0.0.1:0`, answering polls with `Running`.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let base = format!("http://{addr}");
        let state = Arc::new(LongState {
            calls: Mutex::new(Vec::new()),
            answer: Mutex::new(PollAnswer::Running),
            polls: tokio::sync::watch::channel(0).0,
            accepted: tokio::sync::watch::channel(0).0,
        });
        let accept = |mode: &'static str| {
            Router::new().route("/", post(long_accept)).with_state((
                state.clone(),
                mode,
                base.clone(),
            ))
        };
        let router = Router::new()
            .nest("/job", accept("body"))
            .nest("/job-location", accept("location"))
            .nest("/job-callback", accept("callback"))
            .route("/status/{n}", get(long_status))
            .with_state(state.clone());
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, router)
                .with_graceful_shutdown(async move { stopped.cancelled().await })
                .await;
        });
        LongTool { addr, state, stop }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn answer(&self, answer: PollAnswer) {
        *self.state.answer.lock().unwrap() = answer;
    }

    pub fn polls(&self) -> usize {
        *self.state.polls.borrow()
    }

    pub fn calls(&self) -> Vec<AcceptedCall> {
        self.state.calls.lock().unwrap().clone()
    }

    /// Waits until at least `n` polls arrived (panics after `within`).
    pub async fn wait_polls(&self, n: usize, within: std::time::Duration) {
        let mut rx = self.state.polls.subscribe();
        tokio::time::timeout(within, rx.wait_for(|c| *c >= n))
            .await
            .unwrap_or_else(|_| panic!("fewer than {n} polls within {within:?}"))
            .unwrap();
    }

    /// Waits until at least `n` calls were accepted; returns the `n`-th.
    pub async fn wait_call(&self, n: usize, within: std::time::Duration) -> AcceptedCall {
        let mut rx = self.state.accepted.subscribe();
        tokio::time::timeout(within, rx.wait_for(|c| *c >= n))
            .await
            .unwrap_or_else(|_| panic!("fewer than {n} calls within {within:?}"))
            .unwrap();
        self.calls()[n - 1].clone()
    }
}

impl Drop for LongTool {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
