//! OpenTelemetry traces of runs, exported over OTLP/HTTP (JSON) when `[telemetry]
//! otlp_endpoint` is set, and the hooks the run actor calls around turns, model calls and tool
//! calls (they also feed the labelled metrics).
//!
//! - **One trace per run.** Its trace id is derived from the run id alone (and so is the id of
//!   the run's root span), so every node and every restart that works on the run adds to the
//!   same trace. The root span (`invoke_agent {agent}`) is sent by the node that finishes the
//!   run, starting at the run's creation.
//! - **Spans:** `turn` (a model call and the tool calls it asked for; one ended early by a
//!   stopped actor carries `agentd.turn.interrupted`), `chat {model}` (a model call, queueing
//!   and retries included) and `execute_tool {tool}` (a tool call or a status check), with the
//!   GenAI semantic-convention attributes (`gen_ai.operation.name`, `gen_ai.request.model`,
//!   `gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`, `gen_ai.tool.name`,
//!   `gen_ai.tool.call.id`, `error.type`).
//! - **Never in a span:** arguments, results, messages, inputs, outputs, error messages and
//!   secrets. Attribute values are configured names, ids, counts and stable codes.
//! - **Never blocking a run:** spans go into a bounded queue (`queue_size`); a span that does
//!   not fit is dropped and counted (`agentd_trace_spans_dropped_total`). A background task
//!   sends them in batches (`max_batch`, at least every `export_interval`), each request
//!   bounded by `export_timeout`; a batch that fails is dropped and counted too.

#![warn(missing_docs)]

pub mod otlp;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::ids::{CallId, RunId};
use crate::metrics::Metrics;
use crate::model::{ModelError, ModelReply};
use crate::run::state::RunState;
use crate::tool::{ToolError, ToolResult};

/// Where and how spans are exported.
#[derive(Debug, Clone, PartialEq)]
pub struct OtlpConfig {
    /// The collector's base URL; spans are posted to `{endpoint}/v1/traces`.
    pub endpoint: String,
    /// Upper bound of one export request.
    pub timeout: Duration,
    /// A partial batch is sent after this long.
    pub interval: Duration,
    /// Spans waiting to be sent at most; more are dropped (and counted).
    pub queue_size: usize,
    /// Spans per export request at most.
    pub max_batch: usize,
}

impl OtlpConfig {
    /// Defaults for `endpoint`.
    pub fn new(endpoint: impl Into<String>) -> Self {
        OtlpConfig {
            endpoint: endpoint.into(),
            timeout: Duration::from_secs(5),
            interval: Duration::from_secs(2),
            queue_size: 4096,
            max_batch: 512,
        }
    }
}

/// What a configured model is, for the model call spans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// The provider kind (`openai`, `scripted`): `gen_ai.provider.name`.
    pub provider: String,
    /// The model the provider is asked for: `gen_ai.request.model`.
    pub model: String,
}

/// `[telemetry]` as the runtime uses it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TelemetryConfig {
    /// `None`: no traces (the default).
    pub otlp: Option<OtlpConfig>,
    /// `service.name` of the exported resource (default `agentd`).
    pub service_name: String,
    /// Configured tenant ids that label metrics; `None`: no tenant label (the default).
    pub tenant_labels: Option<Vec<String>>,
    /// Configured models by `[models.*]` key.
    pub models: HashMap<String, ModelInfo>,
}

/// An attribute value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `stringValue`.
    Str(String),
    /// `intValue` (sent as a decimal string, as the protobuf JSON mapping has it).
    Int(i64),
    /// `boolValue`.
    Bool(bool),
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::Str(s.to_owned())
    }
}

impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::Str(s)
    }
}

impl From<u64> for Value {
    fn from(n: u64) -> Self {
        Value::Int(i64::try_from(n).unwrap_or(i64::MAX))
    }
}

impl From<u32> for Value {
    fn from(n: u32) -> Self {
        Value::Int(i64::from(n))
    }
}

impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}

/// The span kind (OTLP numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    /// Work inside the daemon.
    Internal = 1,
    /// A request to another service (a model provider).
    Client = 3,
}

/// One finished span.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    /// The run's trace.
    pub trace_id: [u8; 16],
    /// This span.
    pub span_id: [u8; 8],
    /// `None`: the run's root span.
    pub parent_span_id: Option<[u8; 8]>,
    /// `invoke_agent {agent}`, `turn`, `chat {model}` or `execute_tool {tool}`.
    pub name: String,
    /// Internal, or client for a model call.
    pub kind: SpanKind,
    /// Start, in nanoseconds since the Unix epoch.
    pub start_ns: u64,
    /// End, in nanoseconds since the Unix epoch.
    pub end_ns: u64,
    /// Configured names, ids, counts and stable codes only.
    pub attributes: Vec<(&'static str, Value)>,
    /// `Some(error type)`: the span's status is `ERROR` with that message (a stable code).
    pub error: Option<String>,
}

/// The trace id of a run's trace: the same on every node and after every restart.
pub fn trace_id(run: &RunId) -> [u8; 16] {
    let d = Sha256::digest(format!("agentd trace {}", run.as_str()));
    let mut id = [0u8; 16];
    id.copy_from_slice(&d[..16]);
    id
}

/// The span id of a run's root span, derived like its trace id.
pub fn run_span_id(run: &RunId) -> [u8; 8] {
    let d = Sha256::digest(format!("agentd run span {}", run.as_str()));
    let mut id = [0u8; 8];
    id.copy_from_slice(&d[..8]);
    id
}

fn random_span_id() -> [u8; 8] {
    loop {
        let id: [u8; 8] = rand::random();
        if id != [0; 8] {
            return id;
        }
    }
}

/// Nanoseconds since the Unix epoch.
pub fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos().min(u128::from(u64::MAX)) as u64)
        .unwrap_or(0)
}

/// Export counters, rendered into `/metrics`.
#[derive(Debug, Default)]
pub struct ExportStats {
    /// Spans the collector accepted.
    pub exported: AtomicU64,
    /// Spans dropped: the queue was full, or their batch failed.
    pub dropped: AtomicU64,
    /// Export requests that failed (error status, refused connection or timeout).
    pub failed_exports: AtomicU64,
}

/// The span sink: a bounded queue in front of the exporter task, or nothing when traces are
/// off.
#[derive(Default)]
pub struct Tracer {
    sender: Option<tokio::sync::mpsc::Sender<Span>>,
    stop: CancellationToken,
    task: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    stats: Arc<ExportStats>,
    models: HashMap<String, ModelInfo>,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracer")
            .field("enabled", &self.enabled())
            .finish_non_exhaustive()
    }
}

impl Tracer {
    /// Starts the exporter task when `config.otlp` is set (inside a tokio runtime); otherwise a
    /// tracer that records nothing. `node_id` becomes `service.instance.id`.
    pub fn start(config: &TelemetryConfig, node_id: &str) -> Arc<Tracer> {
        let Some(otlp) = config.otlp.clone() else {
            return Arc::new(Tracer::default());
        };
        let (tx, rx) = tokio::sync::mpsc::channel(otlp.queue_size.max(1));
        let stats = Arc::new(ExportStats::default());
        let stop = CancellationToken::new();
        let service = if config.service_name.is_empty() {
            "agentd".to_owned()
        } else {
            config.service_name.clone()
        };
        let resource = vec![
            ("service.name", Value::Str(service)),
            ("service.instance.id", Value::from(node_id)),
            ("service.version", Value::from(env!("CARGO_PKG_VERSION"))),
        ];
        let task = tokio::spawn(otlp::export_loop(
            otlp,
            resource,
            rx,
            stop.clone(),
            stats.clone(),
        ));
        Arc::new(Tracer {
            sender: Some(tx),
            stop,
            task: std::sync::Mutex::new(Some(task)),
            stats,
            models: config.models.clone(),
        })
    }

    /// Whether spans are recorded at all.
    pub fn enabled(&self) -> bool {
        self.sender.is_some()
    }

    /// Queues a span for export; never waits (a full queue drops it).
    pub fn emit(&self, span: Span) {
        if let Some(tx) = &self.sender
            && tx.try_send(span).is_err()
        {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The export counters.
    pub fn stats(&self) -> &Arc<ExportStats> {
        &self.stats
    }

    /// Sends what is queued (bounded by `grace`) and stops the exporter task.
    pub async fn shutdown(&self, grace: Duration) {
        self.stop.cancel();
        let task = self.task.lock().ok().and_then(|mut t| t.take());
        if let Some(task) = task
            && tokio::time::timeout(grace, task).await.is_err()
        {
            tracing::warn!("the trace exporter did not finish within the shutdown grace");
        }
    }

    /// Appends the export counters' Prometheus text.
    pub fn render_metrics(&self, out: &mut String) {
        use std::fmt::Write as _;
        for (name, help, v) in [
            (
                "agentd_trace_spans_exported_total",
                "Spans the OTLP collector accepted.",
                &self.stats.exported,
            ),
            (
                "agentd_trace_spans_dropped_total",
                "Spans dropped because the export queue was full or their batch failed.",
                &self.stats.dropped,
            ),
            (
                "agentd_trace_export_failures_total",
                "OTLP export requests that failed or timed out.",
                &self.stats.failed_exports,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
    }
}

/// A run actor's open turn span (its `Live` holds one). Dropped while open (the actor stopped:
/// passivation, shutdown, lost lease, crash), the turn is sent as interrupted.
#[derive(Default)]
pub struct RunTrace {
    turn: Option<OpenTurn>,
}

struct OpenTurn {
    tracer: Arc<Tracer>,
    trace_id: [u8; 16],
    run_span: [u8; 8],
    span_id: [u8; 8],
    number: u32,
    run_id: String,
    start_ns: u64,
    resumed: bool,
}

impl OpenTurn {
    fn end(mut self, interrupted: bool) {
        let mut attributes = vec![
            ("agentd.turn", Value::from(self.number)),
            (
                "agentd.run.id",
                Value::Str(std::mem::take(&mut self.run_id)),
            ),
        ];
        if self.resumed {
            attributes.push(("agentd.turn.resumed", Value::Bool(true)));
        }
        if interrupted {
            attributes.push(("agentd.turn.interrupted", Value::Bool(true)));
        }
        self.tracer.emit(Span {
            trace_id: self.trace_id,
            span_id: self.span_id,
            parent_span_id: Some(self.run_span),
            name: "turn".into(),
            kind: SpanKind::Internal,
            start_ns: self.start_ns,
            end_ns: unix_nanos(),
            attributes,
            error: None,
        });
    }
}

impl Drop for RunTrace {
    fn drop(&mut self) {
        if let Some(t) = self.turn.take() {
            t.end(true);
        }
    }
}

impl RunTrace {
    /// The span id of the run's turn `run.turn`, opening it if needed (`resumed`: opened for a
    /// call of a turn that began in an earlier actor).
    fn turn(&mut self, tracer: &Arc<Tracer>, run: &RunState, resumed: bool) -> Option<[u8; 8]> {
        if !tracer.enabled() {
            return None;
        }
        if let Some(t) = &self.turn
            && t.number == run.turn
        {
            return Some(t.span_id);
        }
        if let Some(t) = self.turn.take() {
            t.end(false);
        }
        let span_id = random_span_id();
        self.turn = Some(OpenTurn {
            tracer: tracer.clone(),
            trace_id: trace_id(&run.id),
            run_span: run_span_id(&run.id),
            span_id,
            number: run.turn,
            run_id: run.id.as_str().to_owned(),
            start_ns: unix_nanos(),
            resumed,
        });
        Some(span_id)
    }
}

/// A model call in flight: `finish` records its latency, tokens and span.
pub struct ModelCallObs {
    metrics: Arc<Metrics>,
    model: String,
    tenant: String,
    sent: Instant,
    span: Option<(Span, String)>,
}

impl ModelCallObs {
    /// Records the call's outcome.
    pub fn finish(self, outcome: &Result<ModelReply, ModelError>) {
        let took = self.sent.elapsed();
        let l = &self.metrics.labelled;
        l.model_call(&self.model, took);
        if let Ok(reply) = outcome {
            l.tokens(
                &self.model,
                &self.tenant,
                reply.usage.input_tokens,
                reply.usage.output_tokens,
            );
        }
        let Some((mut span, _)) = self.span else {
            return;
        };
        span.end_ns = unix_nanos();
        match outcome {
            Ok(reply) => {
                span.attributes.push((
                    "gen_ai.usage.input_tokens",
                    Value::from(reply.usage.input_tokens),
                ));
                span.attributes.push((
                    "gen_ai.usage.output_tokens",
                    Value::from(reply.usage.output_tokens),
                ));
                span.attributes.push((
                    "agentd.model.tool_calls",
                    Value::from(reply.tool_calls.len() as u64),
                ));
            }
            Err(e) => {
                let kind = e.kind.to_string();
                span.attributes
                    .push(("error.type", Value::from(kind.clone())));
                span.error = Some(kind);
            }
        }
        self.metrics.traces.emit(span);
    }
}

/// A tool call (or status check) in flight: `finish_*` records its latency, outcome and span.
pub struct ToolCallObs {
    metrics: Arc<Metrics>,
    tool: String,
    sent: Instant,
    span: Option<Span>,
}

impl ToolCallObs {
    /// Records a call's result.
    pub fn finish_result(self, result: &ToolResult) {
        let code = match (&result.error, result.ok) {
            (_, true) => None,
            (Some(e), false) => Some(e.code.as_str()),
            (None, false) => Some("failed"),
        };
        self.finish(code);
    }

    /// Records a status check's outcome (`Ok(None)`: the call never ran).
    pub fn finish_status(self, outcome: &Result<Option<ToolResult>, ToolError>) {
        let code = match outcome {
            Ok(Some(r)) if !r.ok => Some(r.error.as_ref().map_or("failed", |e| e.code.as_str())),
            Ok(_) => None,
            Err(e) => Some(e.code.as_str()),
        };
        self.finish(code);
    }

    fn finish(self, code: Option<&str>) {
        let outcome = code.unwrap_or("ok");
        self.metrics
            .labelled
            .tool_call(&self.tool, outcome, self.sent.elapsed());
        let Some(mut span) = self.span else {
            return;
        };
        span.end_ns = unix_nanos();
        span.attributes
            .push(("agentd.tool.outcome", Value::from(outcome)));
        if let Some(code) = code {
            span.attributes.push(("error.type", Value::from(code)));
            span.error = Some(code.to_owned());
        }
        self.metrics.traces.emit(span);
    }
}

/// Cuts an id to a bounded attribute value.
fn bounded(s: &str) -> String {
    s.chars().take(128).collect()
}

/// The hooks the run actor calls.
impl Metrics {
    /// A model call of `run` (its turn `run.turn`) to the configured model `model` begins.
    pub fn model_call(
        self: &Arc<Self>,
        trace: &mut RunTrace,
        run: &RunState,
        model: &str,
    ) -> ModelCallObs {
        let span = trace.turn(&self.traces, run, false).map(|turn| {
            let info = self.traces.models.get(model);
            let requested = info.map_or(model, |i| i.model.as_str());
            let mut attributes = vec![
                ("gen_ai.operation.name", Value::from("chat")),
                ("gen_ai.request.model", Value::from(requested)),
                ("agentd.model", Value::from(model)),
                ("agentd.run.id", Value::from(run.id.as_str())),
                ("agentd.turn", Value::from(run.turn)),
            ];
            if let Some(i) = info {
                attributes.push(("gen_ai.provider.name", Value::from(i.provider.as_str())));
            }
            (
                Span {
                    trace_id: trace_id(&run.id),
                    span_id: random_span_id(),
                    parent_span_id: Some(turn),
                    name: format!("chat {requested}"),
                    kind: SpanKind::Client,
                    start_ns: unix_nanos(),
                    end_ns: 0,
                    attributes,
                    error: None,
                },
                model.to_owned(),
            )
        });
        ModelCallObs {
            metrics: self.clone(),
            model: model.to_owned(),
            tenant: run.tenant.clone(),
            sent: Instant::now(),
            span,
        }
    }

    /// A tool call (or, with `status_check`, its status check) of `run` begins.
    pub fn tool_call(
        self: &Arc<Self>,
        trace: &mut RunTrace,
        run: &RunState,
        tool: &str,
        call_id: &CallId,
        status_check: bool,
    ) -> ToolCallObs {
        let span = trace.turn(&self.traces, run, true).map(|turn| {
            let mut attributes = vec![
                ("gen_ai.operation.name", Value::from("execute_tool")),
                ("gen_ai.tool.name", Value::from(tool)),
                (
                    "gen_ai.tool.call.id",
                    Value::from(bounded(call_id.as_str())),
                ),
                ("gen_ai.tool.type", Value::from("function")),
                ("agentd.run.id", Value::from(run.id.as_str())),
                ("agentd.turn", Value::from(run.turn)),
            ];
            if status_check {
                attributes.push(("agentd.tool.status_check", Value::Bool(true)));
            }
            Span {
                trace_id: trace_id(&run.id),
                span_id: random_span_id(),
                parent_span_id: Some(turn),
                name: format!("execute_tool {tool}"),
                kind: SpanKind::Internal,
                start_ns: unix_nanos(),
                end_ns: 0,
                attributes,
                error: None,
            }
        });
        ToolCallObs {
            metrics: self.clone(),
            tool: tool.to_owned(),
            sent: Instant::now(),
            span,
        }
    }

    /// `run` ended: closes its open turn and sends its root span (from its creation to now).
    pub fn run_finished(&self, trace: &mut RunTrace, run: &RunState) {
        if let Some(t) = trace.turn.take() {
            t.end(false);
        }
        if !self.traces.enabled() {
            return;
        }
        let u = &run.usage;
        let mut attributes = vec![
            ("gen_ai.operation.name", Value::from("invoke_agent")),
            ("gen_ai.agent.name", Value::from(run.agent.as_str())),
            ("agentd.run.id", Value::from(run.id.as_str())),
            ("agentd.tenant", Value::from(run.tenant.as_str())),
            ("agentd.run.status", Value::from(run.status.as_str())),
            ("agentd.run.turns", Value::from(u.turns)),
            ("agentd.run.tool_calls", Value::from(u.tool_calls)),
            ("gen_ai.usage.input_tokens", Value::from(u.input_tokens)),
            ("gen_ai.usage.output_tokens", Value::from(u.output_tokens)),
        ];
        let error = run.error.as_ref().map(|e| bounded(&e.code));
        if let Some(code) = &error {
            attributes.push(("error.type", Value::from(code.clone())));
        }
        self.traces.emit(Span {
            trace_id: trace_id(&run.id),
            span_id: run_span_id(&run.id),
            parent_span_id: None,
            name: format!("invoke_agent {}", run.agent),
            kind: SpanKind::Internal,
            start_ns: run.created_at_ms.saturating_mul(1_000_000),
            end_ns: unix_nanos(),
            attributes,
            error,
        });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_runs_trace_and_root_span_ids_depend_on_its_id_only() {
        let a = RunId::generate();
        let b = RunId::generate();
        assert_eq!(trace_id(&a), trace_id(&a.clone()));
        assert_ne!(trace_id(&a), trace_id(&b));
        assert_eq!(run_span_id(&a), run_span_id(&a));
        assert_ne!(run_span_id(&a), [0; 8]);
    }

    #[test]
    fn a_disabled_tracer_records_nothing_and_never_fails() {
        let t = Arc::new(Tracer::default());
        assert!(!t.enabled());
        t.emit(Span {
            trace_id: [1; 16],
            span_id: [1; 8],
            parent_span_id: None,
            name: "x".into(),
            kind: SpanKind::Internal,
            start_ns: 1,
            end_ns: 2,
            attributes: Vec::new(),
            error: None,
        });
        assert_eq!(t.stats().dropped.load(Ordering::Relaxed), 0);
    }
}
