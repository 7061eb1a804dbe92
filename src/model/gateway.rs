//! The model gateway: the shared pool through which every run calls its model. Limits are
//! applied inside the workers (governor: requests per second and tokens per minute per model),
//! so a job over the rate waits in the bounded queue instead of being dropped. Provider faults
//! are retried here, honouring `Retry-After`, with capped jittered backoff, up to
//! `max_attempts` and within `retry_window` from the first failure: what reaches a run is final
//! for that turn. Every failed attempt is logged at WARN with the run id, and each retry is
//! reported to the run (`ModelRetryNotice`) before its wait, so it is an event on the run.
//!
//! Fairness between tenants: requests are admitted to the pool's workers through per-tenant
//! queues served round-robin (`Fair`), and optionally capped per tenant
//! (`tenant_max_in_flight`). A burst of a thousand runs from one tenant queues behind its own
//! requests only: another tenant's request takes the next free worker. Provider-wide limits
//! (requests and tokens per minute, the number of workers, the queue bound) stay shared by
//! every run.

use std::collections::{HashMap, VecDeque};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::{ModelError, ModelErrorKind, ModelProvider, ModelReply, ModelRequest};
use crate::pool::{Pool, PoolJob, PoolSize, ReplyOnce};

/// Limits shared by every run using one model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelLimits {
    /// Attempts per minute, spread evenly (burst of one second's share); `None`: no limit.
    pub requests_per_minute: Option<NonZeroU32>,
    /// Tokens per minute, estimated before each attempt as a quarter of the request's JSON
    /// bytes; `None`: no limit.
    pub tokens_per_minute: Option<NonZeroU32>,
}

/// How the gateway calls providers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatewayConfig {
    /// Workers (requests in flight at once) and the bound of the waiting queue.
    pub size: PoolSize,
    /// Per attempt.
    pub timeout: Duration,
    /// Attempts per request, the first included.
    pub max_attempts: u32,
    /// Backoff before the first retry; doubled per attempt, jittered to 50–100 %.
    pub retry_base: Duration,
    /// Cap of one backoff wait (a longer `Retry-After` still wins).
    pub retry_max: Duration,
    /// Retries stop once this much time has passed since the request's first failed attempt:
    /// long enough to ride out a provider restart, short enough that a dead provider fails
    /// the run.
    pub retry_window: Duration,
    /// Requests of one tenant in the workers at once; 0 = no cap (round-robin only).
    pub tenant_max_in_flight: usize,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            size: PoolSize {
                workers: 256,
                queue: 65_536,
            },
            timeout: Duration::from_secs(60),
            max_attempts: 10,
            retry_base: Duration::from_millis(250),
            retry_max: Duration::from_secs(5),
            retry_window: Duration::from_secs(30),
            tenant_max_in_flight: 0,
        }
    }
}

/// Gateway counters for `/metrics` and the retry-amplification figure.
#[derive(Debug, Default)]
pub struct GatewayStats {
    /// Requests a worker took up (one per turn), whatever their number of attempts.
    pub requests: AtomicU64,
    /// Attempts sent to providers, retries included.
    pub attempts: AtomicU64,
    /// Failed attempts that were tried again.
    pub retries: AtomicU64,
    /// Requests given up on (not retryable, out of attempts or out of retry window).
    pub failures: AtomicU64,
    /// Total time attempts waited on the rate limiters, in microseconds.
    pub rate_limit_wait_us: AtomicU64,
    /// Total time of all attempts with the provider (timeouts included), in microseconds.
    pub latency_us_total: AtomicU64,
    /// Requests waiting in the per-tenant queues now.
    pub queued: AtomicU64,
}

struct ModelLimiters {
    requests: Option<DefaultDirectRateLimiter>,
    /// Token limiter and its burst (the most tokens one wait can ask for).
    tokens: Option<(DefaultDirectRateLimiter, NonZeroU32)>,
}

struct Shared {
    providers: HashMap<String, Arc<dyn ModelProvider>>,
    limiters: HashMap<String, ModelLimiters>,
    config: GatewayConfig,
    stats: Arc<GatewayStats>,
}

/// One failed model attempt the gateway is about to try again: the attempt (from 1), its
/// error and the wait before the next attempt.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelRetryNotice {
    /// The attempt that failed, counted from 1.
    pub attempt: u32,
    /// Why it failed.
    pub error: ModelError,
    /// The wait before the next attempt: the backoff, or `Retry-After` if longer.
    pub wait: Duration,
}

/// Where retry notices of one request go.
pub type OnModelRetry = Box<dyn Fn(ModelRetryNotice) + Send + Sync>;

/// One model request in the pool.
pub struct ModelJob {
    shared: Arc<Shared>,
    request: ModelRequest,
    cancel: CancellationToken,
    on_retry: Option<OnModelRetry>,
    reply: ReplyOnce<Result<ModelReply, ModelError>>,
    /// Holds one worker slot of the tenant in `Fair`; released when the job is dropped.
    ticket: Option<Ticket>,
}

/// Per-tenant admission to the pool's workers: at most `workers` jobs are handed to the pool;
/// the rest wait in one queue per tenant, served round-robin.
struct Fair {
    state: Mutex<FairState>,
    pool: Pool<ModelJob>,
    workers: usize,
    queue_cap: usize,
    tenant_cap: usize,
    stats: Arc<GatewayStats>,
}

#[derive(Default)]
struct FairState {
    in_flight: usize,
    per_tenant: HashMap<String, usize>,
    queues: HashMap<String, VecDeque<ModelJob>>,
    /// Tenants with queued jobs, in serving order.
    ring: VecDeque<String>,
    queued: usize,
    stopped: bool,
}

impl FairState {
    fn under_cap(&self, tenant: &str, cap: usize) -> bool {
        cap == 0 || self.per_tenant.get(tenant).copied().unwrap_or(0) < cap
    }

    fn take_slot(&mut self, tenant: &str) {
        self.in_flight += 1;
        *self.per_tenant.entry(tenant.to_owned()).or_insert(0) += 1;
    }

    /// The next queued job whose tenant may take a worker, round-robin.
    fn pick(&mut self, cap: usize) -> Option<(String, ModelJob)> {
        for _ in 0..self.ring.len() {
            let tenant = self.ring.pop_front()?;
            if !self.under_cap(&tenant, cap) {
                self.ring.push_back(tenant);
                continue;
            }
            let queue = self.queues.get_mut(&tenant)?;
            let job = queue.pop_front();
            if queue.is_empty() {
                self.queues.remove(&tenant);
            } else {
                self.ring.push_back(tenant.clone());
            }
            if let Some(job) = job {
                self.queued -= 1;
                self.take_slot(&tenant);
                return Some((tenant, job));
            }
        }
        None
    }
}

/// A tenant's worker slot; dropping it lets the next queued job in.
struct Ticket {
    fair: Arc<Fair>,
    tenant: String,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.fair.release(&self.tenant);
    }
}

impl Fair {
    fn send(self: &Arc<Self>, tenant: String, mut job: ModelJob) {
        let key = job.request.run_id.clone();
        job.ticket = Some(Ticket {
            fair: Arc::clone(self),
            tenant,
        });
        self.pool.submit(key, job);
    }

    fn submit(self: &Arc<Self>, mut job: ModelJob) {
        let tenant = job.request.tenant.clone();
        let admitted = {
            let Ok(mut st) = self.state.lock() else {
                job.shed();
                return;
            };
            if st.stopped {
                Err(job)
            } else if st.in_flight < self.workers && st.under_cap(&tenant, self.tenant_cap) {
                st.take_slot(&tenant);
                Ok(Some(job))
            } else if st.queued >= self.queue_cap {
                Err(job)
            } else {
                st.queued += 1;
                let queue = st.queues.entry(tenant.clone()).or_default();
                let first = queue.is_empty();
                queue.push_back(job);
                if first {
                    st.ring.push_back(tenant.clone());
                }
                Ok(None)
            }
        };
        match admitted {
            Ok(Some(job)) => self.send(tenant, job),
            Ok(None) => {
                self.stats.queued.fetch_add(1, Ordering::Relaxed);
            }
            Err(mut job) => {
                let stats = self.pool.stats();
                stats.submitted.fetch_add(1, Ordering::Relaxed);
                stats.shed.fetch_add(1, Ordering::Relaxed);
                job.shed();
            }
        }
    }

    fn release(self: &Arc<Self>, tenant: &str) {
        let next = {
            let Ok(mut st) = self.state.lock() else {
                return;
            };
            st.in_flight = st.in_flight.saturating_sub(1);
            if let Some(n) = st.per_tenant.get_mut(tenant) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    st.per_tenant.remove(tenant);
                }
            }
            if st.stopped {
                None
            } else {
                st.pick(self.tenant_cap)
            }
        };
        if let Some((tenant, job)) = next {
            self.stats.queued.fetch_sub(1, Ordering::Relaxed);
            self.send(tenant, job);
        }
    }

    /// Refuses new jobs and sheds the queued ones.
    fn stop(&self) {
        let queued: Vec<ModelJob> = match self.state.lock() {
            Ok(mut st) => {
                st.stopped = true;
                st.ring.clear();
                st.queued = 0;
                st.queues.drain().flat_map(|(_, q)| q).collect()
            }
            Err(_) => Vec::new(),
        };
        self.stats.queued.store(0, Ordering::Relaxed);
        for mut job in queued {
            job.shed();
        }
    }
}

/// A cheap-to-clone handle to the model pool.
#[derive(Clone)]
pub struct ModelGateway {
    pool: Pool<ModelJob>,
    fair: Arc<Fair>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ModelGateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelGateway").finish()
    }
}

impl ModelGateway {
    /// Starts the pool with `providers` and `limits`, both keyed by configured model name (a
    /// model without limits is unlimited). Returns the handle and the join handle of the
    /// pool's actor; fails only if that actor cannot be spawned.
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
                        .map(|n| RateLimiter::direct(smooth_per_minute(n))),
                    tokens: l.tokens_per_minute.map(|n| {
                        let q = smooth_per_minute(n);
                        (RateLimiter::direct(q), q.burst_size())
                    }),
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
        let fair = Arc::new(Fair {
            state: Mutex::new(FairState::default()),
            pool: pool.clone(),
            workers: config.size.workers.max(1),
            queue_cap: config.size.queue.max(1),
            tenant_cap: config.tenant_max_in_flight,
            stats: Arc::clone(&shared.stats),
        });
        Ok((ModelGateway { pool, fair, shared }, join))
    }

    /// Sends a request; `reply` is called exactly once, unless `cancel` fires first.
    pub fn submit(
        &self,
        request: ModelRequest,
        cancel: CancellationToken,
        reply: impl FnOnce(Result<ModelReply, ModelError>) + Send + Sync + 'static,
    ) {
        self.submit_observed(request, cancel, None, reply);
    }

    /// Like `submit`; `on_retry` hears of every retry of the request before its wait.
    pub fn submit_observed(
        &self,
        request: ModelRequest,
        cancel: CancellationToken,
        on_retry: Option<OnModelRetry>,
        reply: impl FnOnce(Result<ModelReply, ModelError>) + Send + Sync + 'static,
    ) {
        self.fair.submit(ModelJob {
            shared: self.shared.clone(),
            request,
            cancel,
            on_retry,
            reply: ReplyOnce::new(reply),
            ticket: None,
        });
    }

    /// The underlying worker pool, for its counters (`/metrics`).
    pub fn pool(&self) -> &Pool<ModelJob> {
        &self.pool
    }

    /// The gateway's counters, shared with `/metrics`.
    pub fn stats(&self) -> &Arc<GatewayStats> {
        &self.shared.stats
    }

    /// Whether a provider is configured under the model name `name`.
    pub fn has_model(&self, name: &str) -> bool {
        self.shared.providers.contains_key(name)
    }

    /// Refuses new requests and answers the queued ones `overloaded`, then stops the pool.
    pub fn stop(&self) {
        self.fair.stop();
        self.pool.stop();
    }
}

/// A per-minute quota whose burst is one second's share, so a burst of runs is spread over the
/// minute instead of sending the whole minute's quota at once.
fn smooth_per_minute(n: NonZeroU32) -> Quota {
    let burst = NonZeroU32::new(n.get().div_ceil(60)).unwrap_or(NonZeroU32::MIN);
    Quota::per_minute(n).allow_burst(burst)
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
    on_retry: Option<&OnModelRetry>,
) -> Result<ModelReply, ModelError> {
    let config = &shared.config;
    let stats = &shared.stats;
    let limiters = shared.limiters.get(&request.model);
    let mut attempt = 0;
    let mut first_failure: Option<Instant> = None;
    loop {
        attempt += 1;
        if let Some(l) = limiters {
            let waited = Instant::now();
            if let Some(r) = &l.requests {
                r.until_ready().await;
            }
            if let Some((t, burst)) = &l.tokens {
                // A request larger than the burst waits for a whole burst (it cannot wait for
                // more at once); smaller ones wait for their own estimate.
                let n = NonZeroU32::new(estimate_tokens(request))
                    .unwrap_or(NonZeroU32::MIN)
                    .min(*burst);
                let _ = t.until_n_ready(n).await;
            }
            stats
                .rate_limit_wait_us
                .fetch_add(waited.elapsed().as_micros() as u64, Ordering::Relaxed);
        }
        stats.attempts.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        // On timeout the attempt's future is dropped, and with it the HTTP connection: the
        // provider sees the client go away and stops generating, so a retry does not queue
        // behind an abandoned generation.
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
        let e = match outcome {
            Ok(reply) => return Ok(reply),
            Err(e) => e,
        };
        let since_failure = first_failure.get_or_insert_with(Instant::now).elapsed();
        let wait = backoff(config, attempt).max(e.retry_after.unwrap_or_default());
        match retry_decision(config, &e.error, attempt, since_failure, wait) {
            Retry::Again => {
                stats.retries.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(run_id = %request.run_id, model = %request.model, attempt, ?wait, error = %e.error, "model attempt failed; retrying");
                if let Some(notify) = on_retry {
                    notify(ModelRetryNotice {
                        attempt,
                        error: e.error.clone(),
                        wait,
                    });
                }
                tokio::time::sleep(wait).await;
            }
            Retry::GiveUp(why) => {
                stats.failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(run_id = %request.run_id, model = %request.model, attempt, error = %e.error, why, "model call failed; giving up");
                return Err(e.error);
            }
        }
    }
}

/// Whether a failed attempt is tried again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retry {
    Again,
    /// Why not (for the log line).
    GiveUp(&'static str),
}

/// A retryable failure is tried again while attempts remain and the next attempt would start
/// within the retry window (counted from the first failure).
fn retry_decision(
    config: &GatewayConfig,
    error: &ModelError,
    attempt: u32,
    since_first_failure: Duration,
    wait: Duration,
) -> Retry {
    if !error.kind.is_retryable() {
        Retry::GiveUp("not retryable")
    } else if attempt >= config.max_attempts {
        Retry::GiveUp("no attempts left")
    } else if since_first_failure.saturating_add(wait) > config.retry_window {
        Retry::GiveUp("retry window exhausted")
    } else {
        Retry::Again
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
            r = call_with_retries(&self.shared, provider.as_ref(), &self.request, self.on_retry.as_ref()) => r,
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::ids::RunId;
    use crate::model::ToolChoice;

    /// Records the tenant of every attempt; answers once `gate` gives a permit.
    struct Recorder {
        order: Mutex<Vec<String>>,
        gate: tokio::sync::Semaphore,
    }

    #[async_trait]
    impl ModelProvider for Recorder {
        fn name(&self) -> &str {
            "m"
        }

        async fn complete(
            &self,
            request: &ModelRequest,
        ) -> Result<ModelReply, super::super::AttemptError> {
            self.order.lock().unwrap().push(request.tenant.clone());
            if let Ok(p) = self.gate.acquire().await {
                p.forget();
            }
            Ok(ModelReply::default())
        }
    }

    fn request(tenant: &str) -> ModelRequest {
        ModelRequest {
            prior_replies: 0,
            run_id: RunId::generate(),
            tenant: tenant.into(),
            model: "m".into(),
            messages: Vec::new(),
            tools: Vec::new().into(),
            tool_choice: ToolChoice::Auto,
        }
    }

    async fn gateway(
        workers: usize,
        tenant_cap: usize,
        permits: usize,
    ) -> (ModelGateway, Arc<Recorder>) {
        let recorder = Arc::new(Recorder {
            order: Mutex::new(Vec::new()),
            gate: tokio::sync::Semaphore::new(permits),
        });
        let config = GatewayConfig {
            size: PoolSize {
                workers,
                queue: 1000,
            },
            tenant_max_in_flight: tenant_cap,
            ..GatewayConfig::default()
        };
        let providers: HashMap<String, Arc<dyn ModelProvider>> =
            HashMap::from([("m".to_owned(), recorder.clone() as Arc<dyn ModelProvider>)]);
        let (g, _join) = ModelGateway::start(config, providers, HashMap::new())
            .await
            .unwrap();
        (g, recorder)
    }

    #[tokio::test]
    async fn a_burst_of_one_tenant_does_not_starve_another() {
        let (g, rec) = gateway(2, 0, 1000).await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let submit = |tenant: &str| {
            let tx = tx.clone();
            g.submit(request(tenant), CancellationToken::new(), move |r| {
                let _ = tx.send(r.is_ok());
            });
        };
        for _ in 0..20 {
            submit("burst");
        }
        submit("quiet");
        for _ in 0..21 {
            let ok = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .unwrap()
                .unwrap();
            assert!(ok);
        }
        let order = rec.order.lock().unwrap().clone();
        let at = order.iter().position(|t| t == "quiet").unwrap();
        assert!(
            at <= 3,
            "the quiet tenant waited behind the burst: {at} ({order:?})"
        );
        g.stop();
    }

    #[tokio::test]
    async fn the_per_tenant_cap_leaves_workers_for_others() {
        let (g, rec) = gateway(4, 1, 0).await;
        for t in ["a", "a", "a", "b"] {
            g.submit(request(t), CancellationToken::new(), |_| {});
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while rec.order.lock().unwrap().len() < 2 {
            assert!(Instant::now() < deadline, "calls did not start");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let mut started = rec.order.lock().unwrap().clone();
        started.sort();
        assert_eq!(started, ["a", "b"], "one call per tenant while capped");
        assert_eq!(g.stats().queued.load(Ordering::Relaxed), 2);
        rec.gate.add_permits(10);
        g.stop();
    }
}

#[cfg(test)]
mod quota_tests {
    use super::*;

    #[test]
    fn retries_stop_at_the_attempt_cap_or_the_window() {
        let config = GatewayConfig {
            max_attempts: 5,
            retry_window: Duration::from_secs(30),
            ..GatewayConfig::default()
        };
        let down = ModelError::new(ModelErrorKind::Unavailable, "refused");
        let refused = ModelError::new(ModelErrorKind::Rejected, "bad request");
        let s = Duration::from_secs;
        // (error, attempt, since the first failure, wait, expected)
        let rows = [
            (&down, 1, s(0), s(1), Retry::Again),
            (&down, 4, s(10), s(5), Retry::Again),
            (&down, 5, s(1), s(1), Retry::GiveUp("no attempts left")),
            (
                &down,
                2,
                s(28),
                s(3),
                Retry::GiveUp("retry window exhausted"),
            ),
            (&down, 2, s(25), s(5), Retry::Again),
            (&refused, 1, s(0), s(1), Retry::GiveUp("not retryable")),
        ];
        for (error, attempt, since, wait, want) in rows {
            assert_eq!(
                retry_decision(&config, error, attempt, since, wait),
                want,
                "{error} attempt {attempt} after {since:?} + {wait:?}"
            );
        }
    }

    #[test]
    fn per_minute_limits_admit_one_seconds_share_at_once() {
        let n = NonZeroU32::new(600).unwrap();
        let limiter = RateLimiter::direct(smooth_per_minute(n));
        let admitted = (0..600).filter(|_| limiter.check().is_ok()).count();
        assert_eq!(admitted, 10, "600/min admits 10 at once, not 600");
        let one = RateLimiter::direct(smooth_per_minute(NonZeroU32::new(5).unwrap()));
        assert_eq!((0..5).filter(|_| one.check().is_ok()).count(), 1);
    }
}
