//! A bounded worker pool on a ractor factory, shared by all runs: the pool size caps concurrent
//! jobs, the queue is bounded, and a job that does not fit is handed back to its requester as
//! `overloaded` (never dropped silently). The model gateway and the tool executor are pools.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use ractor::factory::queues::DefaultQueue;
use ractor::factory::routing::QueuerRouting;
use ractor::factory::{
    DiscardHandler, DiscardMode, DiscardReason, DiscardSettings, Factory, FactoryArguments,
    FactoryMessage, Job, JobOptions, Worker, WorkerBuilder, WorkerId,
};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde::{Deserialize, Serialize};

use crate::ids::RunId;

/// A unit of work for a pool.
#[async_trait]
pub trait PoolJob: Send + Sync + 'static {
    /// Does the work and delivers the reply.
    async fn run(self);
    /// The pool cannot take the job: deliver an `overloaded` reply instead.
    fn shed(&mut self);
}

/// Size and queue bound of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSize {
    /// Jobs run at once (the concurrency cap).
    pub workers: usize,
    /// Jobs waiting beyond that; more are shed as `overloaded`.
    pub queue: usize,
}

/// Counters of one pool, read by `/metrics` and the benchmark.
#[derive(Debug, Default)]
pub struct PoolStats {
    /// Jobs handed to `submit`, shed ones included.
    pub submitted: AtomicU64,
    /// Jobs a worker began.
    pub started: AtomicU64,
    /// Jobs a worker completed.
    pub finished: AtomicU64,
    /// Jobs handed back as `overloaded`: the queue was full or the pool stopped.
    pub shed: AtomicU64,
}

impl PoolStats {
    /// Jobs accepted but not yet started.
    pub fn queue_depth(&self) -> u64 {
        let submitted = self.submitted.load(Ordering::Relaxed);
        let started = self.started.load(Ordering::Relaxed);
        let shed = self.shed.load(Ordering::Relaxed);
        submitted.saturating_sub(started + shed)
    }

    /// Jobs started but not yet finished.
    pub fn in_flight(&self) -> u64 {
        self.started
            .load(Ordering::Relaxed)
            .saturating_sub(self.finished.load(Ordering::Relaxed))
    }
}

struct PoolWorker<J> {
    stats: Arc<PoolStats>,
    _job: std::marker::PhantomData<fn() -> J>,
}

impl<J: PoolJob> Worker for PoolWorker<J> {
    type Key = RunId;
    type Message = J;
    type State = ();
    type Arguments = ();

    async fn pre_start(
        &self,
        _wid: WorkerId,
        _factory: &ActorRef<FactoryMessage<RunId, J>>,
        _args: (),
    ) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle(
        &self,
        _wid: WorkerId,
        _factory: &ActorRef<FactoryMessage<RunId, J>>,
        job: Job<RunId, J>,
        _state: &mut (),
    ) -> Result<RunId, ActorProcessingErr> {
        self.stats.started.fetch_add(1, Ordering::Relaxed);
        let Job { key, msg, .. } = job;
        msg.run().await;
        self.stats.finished.fetch_add(1, Ordering::Relaxed);
        Ok(key)
    }
}

struct ShedToRequester<J> {
    stats: Arc<PoolStats>,
    _job: std::marker::PhantomData<fn() -> J>,
}

impl<J: PoolJob> DiscardHandler<RunId, J> for ShedToRequester<J> {
    fn discard(&self, reason: DiscardReason, job: &mut Job<RunId, J>) {
        self.stats.shed.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(run = %job.key, ?reason, "pool job shed");
        job.msg.shed();
    }
}

/// A running pool: a handle to submit jobs.
pub struct Pool<J: PoolJob> {
    factory: ActorRef<FactoryMessage<RunId, J>>,
    stats: Arc<PoolStats>,
    name: &'static str,
}

impl<J: PoolJob> Clone for Pool<J> {
    fn clone(&self) -> Self {
        Pool {
            factory: self.factory.clone(),
            stats: self.stats.clone(),
            name: self.name,
        }
    }
}

impl<J: PoolJob> std::fmt::Debug for Pool<J> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("name", &self.name).finish()
    }
}

impl<J: PoolJob> Pool<J> {
    /// Starts the pool's factory actor and workers.
    pub async fn start(
        name: &'static str,
        size: PoolSize,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), ractor::SpawnErr> {
        let stats = Arc::new(PoolStats::default());
        let worker_stats = stats.clone();
        let builder = ractor::factory::worker_builder(move |_wid| {
            (
                PoolWorker::<J> {
                    stats: worker_stats.clone(),
                    _job: std::marker::PhantomData,
                },
                (),
            )
        });
        let builder: Box<dyn WorkerBuilder<PoolWorker<J>, ()>> = Box::new(builder);
        let args = FactoryArguments::builder()
            .worker_builder(builder)
            .queue(DefaultQueue::<RunId, J>::default())
            .router(QueuerRouting::<RunId, J>::default())
            .num_initial_workers(size.workers.max(1))
            .discard_settings(DiscardSettings::Static {
                limit: size.queue.max(1),
                mode: DiscardMode::Newest,
            })
            .discard_handler(Arc::new(ShedToRequester::<J> {
                stats: stats.clone(),
                _job: std::marker::PhantomData,
            }))
            .build();
        let factory = Factory::<RunId, J, (), PoolWorker<J>, _, _>::default();
        let (factory, join) = Actor::spawn(None, factory, args).await?;
        Ok((
            Pool {
                factory,
                stats,
                name,
            },
            join,
        ))
    }

    /// Queues a job. If the pool is stopped, the job is shed to its requester at once.
    pub fn submit(&self, key: RunId, job: J) {
        self.stats.submitted.fetch_add(1, Ordering::Relaxed);
        let msg = FactoryMessage::Dispatch(Job {
            key,
            msg: job,
            options: JobOptions::default(),
            accepted: None,
        });
        if let Err(err) = self.factory.send_message(msg) {
            self.stats.shed.fetch_add(1, Ordering::Relaxed);
            if let ractor::MessagingErr::SendErr(FactoryMessage::Dispatch(mut job)) = err {
                job.msg.shed();
            }
        }
    }

    /// The pool's counters, shared with its workers.
    pub fn stats(&self) -> &Arc<PoolStats> {
        &self.stats
    }

    /// The name it was started with (`model`, `tool`).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Stops the pool; queued jobs are shed.
    pub fn stop(&self) {
        self.factory.stop(Some("shutdown".into()));
    }
}

/// A reply channel used once: a boxed callback, so pools need not know the requester's type.
pub struct ReplyOnce<T>(Option<Box<dyn FnOnce(T) + Send + Sync>>);

impl<T> ReplyOnce<T> {
    /// A reply that calls `f` with the value, once.
    pub fn new(f: impl FnOnce(T) + Send + Sync + 'static) -> Self {
        ReplyOnce(Some(Box::new(f)))
    }

    /// Delivers the reply; later calls do nothing.
    pub fn send(&mut self, value: T) {
        if let Some(f) = self.0.take() {
            f(value);
        }
    }
}

impl<T> std::fmt::Debug for ReplyOnce<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReplyOnce")
    }
}
