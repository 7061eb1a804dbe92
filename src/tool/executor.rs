//! The tool executor: the shared pool through which every run calls its tools. Each call gets
//! its tool's timeout and output cap; per-tool rate limits (governor) are applied inside the
//! workers, so calls over the rate wait in the bounded queue.
//!
//! Two rules hold for every job:
//! - **A cancelled call is not sent.** The cancel token is checked after any rate-limit wait,
//!   right before the tool is called, and the wait itself ends on cancellation: a call
//!   cancelled while it was queued never reaches the tool.
//! - **Redact, then cut.** A result is redacted whole (data and error message) before its data
//!   is capped at `max_output_bytes` and its message at [`MAX_ERROR_MESSAGE_CHARS`], so no cut
//!   hides a sensitive key or splits a secret (see `ToolResult::sanitized`).
//!
//! Retries by class: a transient failure (`retryable`: refused, 408, 429, 5xx of a read tool;
//! `timeout`; `outcome_unknown` of an idempotent tool) of a `read` or `idempotent` tool is
//! tried again here, with capped jittered backoff (at least the tool's `Retry-After`) and the
//! same idempotency key, up to the tool's `max_attempts`, before the run — and the model —
//! hear of it. `unsafe` tools are never retried here: their unknown outcomes go to the run's
//! reconcile / operator path. Business errors (other 4xx) and permission errors are final.
//! Each retry is reported to the run (`RetryNotice`, redacted and cut) before its wait, so it
//! is an event on the run; the result the run gets is still only the last attempt's.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use serde_json::Value;

use super::{
    MAX_ERROR_MESSAGE_CHARS, Tool, ToolContext, ToolEffect, ToolError, ToolErrorCode, ToolResult,
};
use crate::pool::{Pool, PoolJob, PoolSize, ReplyOnce};
use crate::redact::Redactor;

/// What a tool job asks.
#[derive(Debug)]
pub enum ToolWork {
    /// Run the call, with the executor's retries by class.
    Call {
        /// The checked arguments.
        arguments: Value,
    },
    /// Reconcile: did the call with `ctx.idempotency_key` run?
    Status,
    /// Long-running call: one poll of the accepted call's status URL (a short job; the wait
    /// between polls is a timer of the run, not a worker).
    Poll {
        /// The URL the tool gave when it accepted the call.
        status_url: String,
    },
}

/// One failed attempt the executor is about to try again: the attempt (from 1), its error
/// (redacted, message cut) and the wait before the next attempt.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryNotice {
    /// The attempt that failed, counted from 1.
    pub attempt: u32,
    /// Why it failed (redacted, message cut).
    pub error: ToolError,
    /// The wait before the next attempt: the backoff, or `Retry-After` if longer.
    pub wait: Duration,
}

/// Where retry notices of one call go.
pub type OnRetry = Box<dyn Fn(RetryNotice) + Send + Sync>;

/// What comes back.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolOutcome {
    /// The answer to `Call`: the last attempt's result, sanitized.
    Result(ToolResult),
    /// The answer to `Status`, as `Tool::status`: `Ok(Some)` it ran, `Ok(None)` it never ran.
    Status(Result<Option<ToolResult>, ToolError>),
    /// The tool accepted the call (`202`) and finishes it later.
    Accepted {
        /// Where its status is polled; `None`: the tool only calls back.
        status_url: Option<String>,
    },
    /// One poll: `Ok(None)` still running, `Ok(Some)` the result, `Err` as `Tool::poll`.
    Polled(Result<Option<ToolResult>, ToolError>),
}

struct Shared {
    limiters: HashMap<String, DefaultDirectRateLimiter>,
    redactor: Arc<Redactor>,
}

/// One tool job in the pool.
pub struct ToolJob {
    shared: Arc<Shared>,
    tool: Arc<dyn Tool>,
    ctx: ToolContext,
    work: ToolWork,
    on_retry: Option<OnRetry>,
    reply: ReplyOnce<ToolOutcome>,
}

/// A cheap-to-clone handle to the tool pool.
#[derive(Clone)]
pub struct ToolExecutor {
    pool: Pool<ToolJob>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ToolExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolExecutor").finish()
    }
}

impl ToolExecutor {
    /// `per_tool_rps`: calls per second allowed for each named tool. `redactor` scrubs every
    /// result before it is cut to size.
    pub async fn start(
        size: PoolSize,
        per_tool_rps: HashMap<String, NonZeroU32>,
        redactor: Arc<Redactor>,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ractor::SpawnErr> {
        let shared = Arc::new(Shared {
            limiters: per_tool_rps
                .into_iter()
                .map(|(t, n)| (t, RateLimiter::direct(Quota::per_second(n))))
                .collect(),
            redactor,
        });
        let (pool, join) = Pool::start("tool", size).await?;
        Ok((ToolExecutor { pool, shared }, join))
    }

    /// Sends a job; `reply` is called exactly once.
    pub fn submit(
        &self,
        tool: Arc<dyn Tool>,
        ctx: ToolContext,
        work: ToolWork,
        reply: impl FnOnce(ToolOutcome) + Send + Sync + 'static,
    ) {
        self.submit_observed(tool, ctx, work, None, reply);
    }

    /// Like `submit`; `on_retry` hears of every retry of the call before its wait.
    pub fn submit_observed(
        &self,
        tool: Arc<dyn Tool>,
        ctx: ToolContext,
        work: ToolWork,
        on_retry: Option<OnRetry>,
        reply: impl FnOnce(ToolOutcome) + Send + Sync + 'static,
    ) {
        let key = ctx.run_id.clone();
        self.pool.submit(
            key,
            ToolJob {
                shared: self.shared.clone(),
                tool,
                ctx,
                work,
                on_retry,
                reply: ReplyOnce::new(reply),
            },
        );
    }

    /// The underlying worker pool, for its counters (`/metrics`).
    pub fn pool(&self) -> &Pool<ToolJob> {
        &self.pool
    }

    /// Stops the pool; queued jobs are answered `overloaded`.
    pub fn stop(&self) {
        self.pool.stop();
    }
}

/// Backoff between attempts of one call: the first retry waits about this long.
const RETRY_BASE: Duration = Duration::from_millis(100);
/// No wait between attempts is longer than this (a longer `Retry-After` gives up instead).
const RETRY_MAX: Duration = Duration::from_secs(5);

/// One attempt, bounded by the tool's timeout. A timed-out attempt has its own token
/// cancelled (a tool that watches it stops), not the call's.
async fn attempt(tool: &dyn Tool, ctx: &ToolContext, arguments: Value) -> ToolResult {
    let spec = tool.spec();
    let timeout = spec.timeout;
    let ctx = ToolContext {
        cancel: ctx.cancel.child_token(),
        ..ctx.clone()
    };
    match tokio::time::timeout(timeout, tool.call(&ctx, arguments)).await {
        Ok(Ok(data)) => ToolResult::success(data),
        Ok(Err(e)) => ToolResult::failure(e),
        Err(_) => {
            ctx.cancel.cancel();
            ToolResult::failure(ToolError::new(
                ToolErrorCode::Timeout,
                format!("no result within {timeout:?}"),
            ))
        }
    }
}

/// Whether a failed call of a tool with `effect` may be sent again with the same key.
pub fn is_transient(effect: ToolEffect, code: ToolErrorCode) -> bool {
    match effect {
        ToolEffect::Read => matches!(code, ToolErrorCode::Retryable | ToolErrorCode::Timeout),
        ToolEffect::Idempotent => matches!(
            code,
            ToolErrorCode::Retryable | ToolErrorCode::Timeout | ToolErrorCode::OutcomeUnknown
        ),
        ToolEffect::Unsafe => false,
    }
}

/// Capped exponential backoff with jitter between 50 % and 100 %, never shorter than the
/// tool's `Retry-After`; `None` when that is longer than `RETRY_MAX`.
fn retry_wait(attempt: u32, retry_after: Option<Duration>) -> Option<Duration> {
    let exp = RETRY_BASE.saturating_mul(1u32 << attempt.saturating_sub(1).min(16));
    let jittered = exp
        .min(RETRY_MAX)
        .mul_f64(0.5 + rand::random::<f64>() * 0.5);
    let wait = jittered.max(retry_after.unwrap_or_default());
    (wait <= RETRY_MAX).then_some(wait)
}

/// Runs the call, retrying transient failures by the tool's class (see the module doc).
async fn call_with_retries(
    tool: &dyn Tool,
    ctx: &ToolContext,
    arguments: Value,
    redactor: &Redactor,
    on_retry: Option<&OnRetry>,
) -> ToolResult {
    let spec = tool.spec();
    let mut tries = 0;
    loop {
        tries += 1;
        let result = attempt(tool, ctx, arguments.clone()).await;
        let Some(error) = &result.error else {
            return result;
        };
        if !is_transient(spec.effect, error.code) || tries >= spec.max_attempts {
            return result;
        }
        let Some(wait) = retry_wait(tries, error.retry_after) else {
            return result;
        };
        if ctx.cancel.is_cancelled() {
            // The run no longer waits for this call: report the last failure, retry nothing.
            return result;
        }
        let mut shown = ToolError::new(
            error.code,
            redactor.redact_then_cut(&error.message, MAX_ERROR_MESSAGE_CHARS),
        );
        shown.retry_after = error.retry_after;
        tracing::warn!(
            run_id = %ctx.run_id, call_id = %ctx.call_id, tool = %spec.name, attempt = tries,
            ?wait, error = %shown, "tool attempt failed; retrying with the same key"
        );
        if let Some(notify) = on_retry {
            notify(RetryNotice {
                attempt: tries,
                error: shown,
                wait,
            });
        }
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            // The run no longer waits for this call: report the last failure.
            () = ctx.cancel.cancelled() => return result,
        }
    }
}

/// One poll of an accepted call, bounded by the tool's timeout; a result is sanitized like
/// any other (redacted whole, then cut).
async fn poll_once(
    tool: &dyn Tool,
    ctx: &ToolContext,
    status_url: &str,
    redactor: &Redactor,
) -> Result<Option<ToolResult>, ToolError> {
    let spec = tool.spec();
    match tokio::time::timeout(spec.timeout, tool.poll(ctx, status_url)).await {
        Ok(Ok(found)) => {
            Ok(found.map(|d| ToolResult::success(d).sanitized(redactor, spec.max_output_bytes)))
        }
        Ok(Err(mut e)) => {
            e.message = redactor.redact_then_cut(&e.message, MAX_ERROR_MESSAGE_CHARS);
            Err(e)
        }
        Err(_) => Err(ToolError::new(
            ToolErrorCode::Timeout,
            format!("no poll answer within {:?}", spec.timeout),
        )),
    }
}

#[async_trait]
impl PoolJob for ToolJob {
    async fn run(mut self) {
        let spec = self.tool.spec();
        let cancel = self.ctx.cancel.clone();
        if let Some(l) = self.shared.limiters.get(&spec.name) {
            tokio::select! {
                biased;
                () = cancel.cancelled() => {}
                () = l.until_ready() => {}
            }
        }
        let redactor = &self.shared.redactor;
        let max_bytes = spec.max_output_bytes;
        let timeout = spec.timeout;
        let work = std::mem::replace(&mut self.work, ToolWork::Status);
        // Checked last thing before the call: the run may have been cancelled while this job
        // was queued or waiting on the rate limit. Nothing was sent, so nothing was applied.
        if cancel.is_cancelled() {
            let error = ToolError::new(
                ToolErrorCode::Retryable,
                "the call was cancelled before it was sent",
            );
            self.reply.send(match work {
                ToolWork::Call { .. } => ToolOutcome::Result(ToolResult::failure(error)),
                ToolWork::Status => ToolOutcome::Status(Err(error)),
                ToolWork::Poll { .. } => ToolOutcome::Polled(Err(error)),
            });
            return;
        }
        let outcome = match work {
            ToolWork::Call { arguments } => {
                let result = call_with_retries(
                    self.tool.as_ref(),
                    &self.ctx,
                    arguments,
                    redactor,
                    self.on_retry.as_ref(),
                )
                .await;
                match self.ctx.long_running.accepted() {
                    Some(a) if result.ok => ToolOutcome::Accepted {
                        status_url: a.status_url.clone(),
                    },
                    _ => ToolOutcome::Result(result.sanitized(redactor, max_bytes)),
                }
            }
            ToolWork::Poll { status_url } => ToolOutcome::Polled(
                poll_once(self.tool.as_ref(), &self.ctx, &status_url, redactor).await,
            ),
            ToolWork::Status => {
                let status = match tokio::time::timeout(timeout, self.tool.status(&self.ctx)).await
                {
                    Ok(Ok(found)) => {
                        Ok(found.map(|d| ToolResult::success(d).sanitized(redactor, max_bytes)))
                    }
                    Ok(Err(mut e)) => {
                        e.message = redactor.redact_then_cut(&e.message, MAX_ERROR_MESSAGE_CHARS);
                        Err(e)
                    }
                    Err(_) => Err(ToolError::new(
                        ToolErrorCode::Timeout,
                        format!("no status within {timeout:?}"),
                    )),
                };
                ToolOutcome::Status(status)
            }
        };
        self.reply.send(outcome);
    }

    fn shed(&mut self) {
        let error = ToolError::new(ToolErrorCode::Overloaded, "the tool pool queue is full");
        let outcome = match self.work {
            ToolWork::Call { .. } => ToolOutcome::Result(ToolResult::failure(error)),
            ToolWork::Status => ToolOutcome::Status(Err(error)),
            ToolWork::Poll { .. } => ToolOutcome::Polled(Err(error)),
        };
        self.reply.send(outcome);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_failures_by_effect() {
        use ToolEffect::{Idempotent, Read, Unsafe};
        use ToolErrorCode as C;
        // (effect, code, retried here)
        let rows = [
            (Read, C::Retryable, true),
            (Read, C::Timeout, true),
            (Read, C::Failed, false),
            (Read, C::Permission, false),
            (Read, C::InvalidArgument, false),
            (Idempotent, C::OutcomeUnknown, true),
            (Idempotent, C::Timeout, true),
            (Idempotent, C::Retryable, true),
            (Idempotent, C::Failed, false),
            (Unsafe, C::Retryable, false),
            (Unsafe, C::OutcomeUnknown, false),
            (Unsafe, C::Timeout, false),
            (Read, C::Overloaded, false),
        ];
        for (effect, code, want) in rows {
            assert_eq!(is_transient(effect, code), want, "{effect:?} {code:?}");
        }
    }

    #[test]
    fn waits_are_capped_and_honour_retry_after() {
        for attempt in 1..20 {
            let w = retry_wait(attempt, None).unwrap();
            assert!(w <= RETRY_MAX, "{attempt}: {w:?}");
            assert!(w >= RETRY_BASE / 2, "{attempt}: {w:?}");
        }
        let w = retry_wait(1, Some(Duration::from_secs(2))).unwrap();
        assert!(w >= Duration::from_secs(2), "{w:?}");
        assert_eq!(retry_wait(1, Some(Duration::from_secs(60))), None);
    }
}
