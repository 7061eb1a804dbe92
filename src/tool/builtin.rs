//! Built-in native tools: `echo` (the benchmark's tool), `clock`, `add`, and `CountingTool`, a
//! configurable tool that records every execution (for tests, demos and chaos runs).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use dashmap::DashMap;
use serde_json::{Value, json};

use super::{Tool, ToolContext, ToolEffect, ToolError, ToolErrorCode, ToolSpec};

/// Returns its `text` argument. Read-only.
#[derive(Debug)]
pub struct Echo {
    spec: ToolSpec,
}

impl Echo {
    /// The `echo` tool: `{"text": …}` (at most 4096 characters) in, the same out; 5 s timeout.
    pub fn new() -> Self {
        Echo {
            spec: ToolSpec::new(
                "echo",
                "Return the given text unchanged.",
                json!({
                    "type": "object",
                    "properties": {"text": {"type": "string", "maxLength": 4096}},
                    "required": ["text"],
                    "additionalProperties": false
                }),
            )
            .effect(ToolEffect::Read)
            .timeout(Duration::from_secs(5)),
        }
    }
}

impl Default for Echo {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Tool for Echo {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn call(&self, _ctx: &ToolContext, arguments: Value) -> Result<Value, ToolError> {
        Ok(json!({ "text": arguments.get("text").cloned().unwrap_or(Value::Null) }))
    }
}

/// Adds two integers. Read-only.
#[derive(Debug)]
pub struct Add {
    spec: ToolSpec,
}

impl Add {
    /// The `add` tool: integers `a` and `b` in, `{"sum": …}` out (fails on overflow); 5 s
    /// timeout.
    pub fn new() -> Self {
        Add {
            spec: ToolSpec::new(
                "add",
                "Add two integers.",
                json!({
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                    "additionalProperties": false
                }),
            )
            .effect(ToolEffect::Read)
            .timeout(Duration::from_secs(5)),
        }
    }
}

impl Default for Add {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Tool for Add {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn call(&self, _ctx: &ToolContext, arguments: Value) -> Result<Value, ToolError> {
        let a = arguments.get("a").and_then(Value::as_i64).unwrap_or(0);
        let b = arguments.get("b").and_then(Value::as_i64).unwrap_or(0);
        a.checked_add(b)
            .map(|sum| json!({ "sum": sum }))
            .ok_or_else(|| {
                ToolError::new(ToolErrorCode::Failed, "the sum overflows a 64-bit integer")
            })
    }
}

/// Executions per idempotency key, shared between a `CountingTool` and whoever checks it.
#[derive(Debug, Default)]
pub struct Ledger {
    by_key: DashMap<String, u64>,
    total: AtomicU64,
}

impl Ledger {
    /// Times a call with idempotency key `key` ran to success (0 if never).
    pub fn executions(&self, key: &str) -> u64 {
        self.by_key.get(key).map_or(0, |v| *v)
    }

    /// Successful executions of every key together.
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::SeqCst)
    }

    /// Keys executed more than once.
    pub fn duplicates(&self) -> Vec<String> {
        self.by_key
            .iter()
            .filter(|e| *e.value() > 1)
            .map(|e| e.key().clone())
            .collect()
    }
}

/// A tool whose behaviour tests choose: effect, delay, a failure on given attempts, and a ledger
/// of executions per idempotency key.
#[derive(Debug)]
pub struct CountingTool {
    spec: ToolSpec,
    delay: Duration,
    ledger: Arc<Ledger>,
    /// Fail with this error when the argument `fail` is true.
    failure: ToolErrorCode,
}

impl CountingTool {
    /// A tool named `name` with `effect` (other spec fields `ToolSpec::new`'s), no delay, and
    /// a fresh ledger. Arguments `{"item": …, "fail"?: bool}`; it answers
    /// `{"recorded": item, "execution": n}`.
    pub fn new(name: &str, effect: ToolEffect) -> Self {
        CountingTool {
            spec: ToolSpec::new(
                name,
                "Record an action (test tool).",
                json!({
                    "type": "object",
                    "properties": {
                        "item": {"type": "string", "maxLength": 256},
                        "fail": {"type": "boolean"}
                    },
                    "required": ["item"],
                    "additionalProperties": false
                }),
            )
            .effect(effect),
            delay: Duration::ZERO,
            ledger: Arc::new(Ledger::default()),
            failure: ToolErrorCode::Failed,
        }
    }

    /// Changes the spec with `f` (e.g. approval, `max_attempts`).
    pub fn with_spec(mut self, f: impl FnOnce(ToolSpec) -> ToolSpec) -> Self {
        self.spec = f(self.spec);
        self
    }

    /// Waits `delay` before each execution (a cancelled call fails `failed`, unrecorded).
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// The error code of a call with `"fail": true` (default `failed`).
    pub fn failure(mut self, code: ToolErrorCode) -> Self {
        self.failure = code;
        self
    }

    /// The ledger of this tool's executions, shared.
    pub fn ledger(&self) -> Arc<Ledger> {
        self.ledger.clone()
    }
}

#[async_trait]
impl Tool for CountingTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn call(&self, ctx: &ToolContext, arguments: Value) -> Result<Value, ToolError> {
        if !self.delay.is_zero() {
            tokio::select! {
                _ = tokio::time::sleep(self.delay) => {}
                _ = ctx.cancel.cancelled() => {
                    return Err(ToolError::new(ToolErrorCode::Failed, "cancelled before it ran"));
                }
            }
        }
        if arguments.get("fail").and_then(Value::as_bool) == Some(true) {
            return Err(ToolError::new(self.failure, "failed as asked"));
        }
        *self
            .ledger
            .by_key
            .entry(ctx.idempotency_key.clone())
            .or_insert(0) += 1;
        let n = self.ledger.total.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(json!({ "recorded": arguments.get("item"), "execution": n }))
    }
}
