//! The model gateway: the shared pool through which every run calls its model. Limits are
//! applied inside the workers (governor: requests per second and tokens per minute per model),
//! so a job over the rate waits in the bounded queue instead of being dropped. Provider faults
//! are retried here, honouring `Retry-After`, with capped jittered backoff: what reaches a run
//! is final for that turn.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::{ModelError, ModelErrorKind, ModelProvider, ModelReply, ModelRequest};
use crate::ids::RunId;
use crate::pool::{Pool, PoolJob, PoolSize, ReplyOnce};

/// Limits shared by every run using one model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelLimits {
    pub requests_per_minute: Option<NonZeroU32>,
    pub tokens_per_minute: Option<NonZeroU32>,
}

/// How the gateway calls providers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatewayConfig {
    pub size: PoolSize,
    /// Per attempt.
    pub timeout: Duration,
    /// Attempts per request, the first included.
    pub max_attempts: u32,
    pub retry_base: Duration,
    pub retry_max: Duration,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            size: PoolSize {
                workers: 256,
                queue: 65_536,
            },
            timeout: Duration::from_secs(60),
            max_attempts: 4,
            retry_base: Duration::from_millis(250),
            retry_max: Duration::from_secs(20),
        }
    }
}

/// Gateway counters for `/metrics` and the retry-amplification figure.
#[derive(Debug, Default)]
pub struct GatewayStats {
    pub requests: AtomicU64,
    pub attempts: AtomicU64,
    pub retries: AtomicU64,
    pub failures: AtomicU64,
    pub rate_limit_wait_us: AtomicU64,
    pub latency_us_total: AtomicU64,
}

struct ModelLimiters {
    requests: Option<DefaultDirectRateLimiter>,
    tokens: Option<DefaultDirectRateLimiter>,
}

struct Shared {
    providers: HashMap<String, Arc<dyn ModelProvider>>,
    limiters: HashMap<String, ModelLimiters>,
    config: GatewayConfig,
    stats: Arc<GatewayStats>,
}

/// One model request in the pool.
pub struct ModelJob {
    shared: Arc<Shared>,
    request: ModelRequest,
    cancel: CancellationToken,
    reply: ReplyOnce<Result<ModelReply, ModelError>>,
}

/// A cheap-to-clone handle to the model pool.
#[derive(Clone)]
pub struct ModelGateway {
    pool: Pool<ModelJob>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ModelGateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelGateway").finish()
    }
}

impl ModelGateway {
    pub async fn start(
        config: GatewayConfig,
        providers: HashMap<String, Arc<dyn ModelProvider>>,
        limits: HashMap<String, ModelLimits>,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ractor::SpawnErr> {
        let limiters = limits
            .into_iter()
            .map(|(name, l)| {
                let lim = ModelLimiters {
                    requests: l
                        .requests_per_minute
                        .map(|n| RateLimiter::direct(Quota::per_minute(n))),
                    tokens: l
                        .tokens_per_minute
                        .map(|n| RateLimiter::direct(Quota::per_minute(n))),
                };
                (name, lim)
            })
            .collect();
        let shared = Arc::new(Shared {
            providers,
            limiters,
            config,
            stats: Arc::new(GatewayStats::default()),
        });
        let (pool, join) = Pool::start("model", config.size).await?;
        Ok((ModelGateway { pool, shared }, join))
    }

    /// Sends a request; `reply` is called exactly once, unless `cancel` fires first.
    pub fn submit(
        &self,
        request: ModelRequest,
        cancel: CancellationToken,
        reply: impl FnOnce(Result<ModelReply, ModelError>) + Send + Sync + 'static,
    ) {
        let key: RunId = request.run_id.clone();
        self.pool.submit(
            key,
            ModelJob {
                shared: self.shared.clone(),
                request,
                cancel,
                reply: ReplyOnce::new(reply),
            },
        );
    }

    pub fn pool(&self) -> &Pool<ModelJob> {
        &self.pool
    }

    pub fn stats(&self) -> &Arc<GatewayStats> {
        &self.shared.stats
    }

    pub fn has_model(&self, name: &str) -> bool {
        self.shared.providers.contains_key(name)
    }

    pub fn stop(&self) {
        self.pool.stop();
    }
}

/// Capped exponential backoff with full jitter between 50 % and 100 %.
fn backoff(config: &GatewayConfig, attempt: u32) -> Duration {
    let exp = config
        .retry_base
        .saturating_mul(1u32 << attempt.saturating_sub(1).min(16));
    let capped = exp.min(config.retry_max);
    capped.mul_f64(0.5 + rand::random::<f64>() * 0.5)
}

fn estimate_tokens(request: &ModelRequest) -> u32 {
    let bytes: usize = request
        .messages
        .iter()
        .map(|m| serde_json::to_string(m).map_or(0, |s| s.len()))
        .sum();
    (bytes / 4).max(1).min(u32::MAX as usize) as u32
}

async fn call_with_retries(
    shared: &Shared,
    provider: &dyn ModelProvider,
    request: &ModelRequest,
) -> Result<ModelReply, ModelError> {
    let config = &shared.config;
    let stats = &shared.stats;
    let limiters = shared.limiters.get(&request.model);
    let mut attempt = 0;
    loop {
        attempt += 1;
        if let Some(l) = limiters {
            let waited = Instant::now();
            if let Some(r) = &l.requests {
                r.until_ready().await;
            }
            if let Some(t) = &l.tokens {
                let n = NonZeroU32::new(estimate_tokens(request)).unwrap_or(NonZeroU32::MIN);
                // A request larger than the whole per-minute quota can never fit: let it go
                // rather than wait forever.
                let _ = t.until_n_ready(n).await;
            }
            stats
                .rate_limit_wait_us
                .fetch_add(waited.elapsed().as_micros() as u64, Ordering::Relaxed);
        }
        stats.attempts.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let outcome = match tokio::time::timeout(config.timeout, provider.complete(request)).await {
            Ok(r) => r,
            Err(_) => Err(ModelError::new(
                ModelErrorKind::Unavailable,
                format!("no reply within {:?}", config.timeout),
            )
            .into()),
        };
        stats
            .latency_us_total
            .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        match outcome {
            Ok(reply) => return Ok(reply),
            Err(e) if e.error.kind.is_retryable() && attempt < config.max_attempts => {
                stats.retries.fetch_add(1, Ordering::Relaxed);
                let wait = backoff(config, attempt).max(e.retry_after.unwrap_or_default());
                tracing::debug!(run = %request.run_id, model = %request.model, attempt, ?wait, error = %e.error, "model attempt failed; retrying");
                tokio::time::sleep(wait).await;
            }
            Err(e) => {
                stats.failures.fetch_add(1, Ordering::Relaxed);
                return Err(e.error);
            }
        }
    }
}

#[async_trait]
impl PoolJob for ModelJob {
    async fn run(mut self) {
        if self.cancel.is_cancelled() {
            return;
        }
        self.shared.stats.requests.fetch_add(1, Ordering::Relaxed);
        let Some(provider) = self.shared.providers.get(&self.request.model).cloned() else {
            self.reply.send(Err(ModelError::new(
                ModelErrorKind::Rejected,
                format!("model `{}` is not configured", self.request.model),
            )));
            return;
        };
        let outcome = tokio::select! {
            r = call_with_retries(&self.shared, provider.as_ref(), &self.request) => r,
            // The run no longer waits (cancelled or ended): free the worker at once.
            _ = self.cancel.cancelled() => return,
        };
        self.reply.send(outcome);
    }

    fn shed(&mut self) {
        self.reply.send(Err(ModelError::new(
            ModelErrorKind::Overloaded,
            "the model pool queue is full",
        )));
    }
}
