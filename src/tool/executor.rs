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

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;

use async_trait::async_trait;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use serde_json::Value;

use super::{MAX_ERROR_MESSAGE_CHARS, Tool, ToolContext, ToolError, ToolErrorCode, ToolResult};
use crate::pool::{Pool, PoolJob, PoolSize, ReplyOnce};
use crate::redact::Redactor;

/// What a tool job asks.
#[derive(Debug)]
pub enum ToolWork {
    Call {
        arguments: Value,
    },
    /// Reconcile: did the call with `ctx.idempotency_key` run?
    Status,
}

/// What comes back.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolOutcome {
    Result(ToolResult),
    Status(Result<Option<ToolResult>, ToolError>),
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
        let key = ctx.run_id.clone();
        self.pool.submit(
            key,
            ToolJob {
                shared: self.shared.clone(),
                tool,
                ctx,
                work,
                reply: ReplyOnce::new(reply),
            },
        );
    }

    pub fn pool(&self) -> &Pool<ToolJob> {
        &self.pool
    }

    pub fn stop(&self) {
        self.pool.stop();
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
            });
            return;
        }
        let outcome = match work {
            ToolWork::Call { arguments } => {
                let result =
                    match tokio::time::timeout(timeout, self.tool.call(&self.ctx, arguments)).await
                    {
                        Ok(Ok(data)) => ToolResult::success(data),
                        Ok(Err(e)) => ToolResult::failure(e),
                        Err(_) => {
                            // Tell a tool that watches its token to stop; its outcome is unknown.
                            self.ctx.cancel.cancel();
                            ToolResult::failure(ToolError::new(
                                ToolErrorCode::Timeout,
                                format!("no result within {timeout:?}"),
                            ))
                        }
                    };
                ToolOutcome::Result(result.sanitized(redactor, max_bytes))
            }
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
        };
        self.reply.send(outcome);
    }
}
