//! A store as seen from a node cut off from it for lease renewals only: every call goes
//! through, but `renew_leases` answers `Unavailable` while `renewals_fail` is set — so the
//! node's leases lapse as they would behind a partition, and another node can take its runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use agentd::ids::RunId;
use agentd::store::{
    Checkpoint, CheckpointStore, Control, ControlRecord, CreateOutcome, Error, EventLog,
    EventRecord, Lease, Result, RunFilter, RunPage, SharedStore,
};
use async_trait::async_trait;

pub struct PartitionedRenewals {
    pub inner: SharedStore,
    pub renewals_fail: AtomicBool,
}

impl PartitionedRenewals {
    pub fn new(inner: SharedStore) -> Arc<Self> {
        Arc::new(PartitionedRenewals {
            inner,
            renewals_fail: AtomicBool::new(true),
        })
    }
}

#[async_trait]
impl CheckpointStore for PartitionedRenewals {
    async fn create(
        &self,
        checkpoint: &Checkpoint,
        events: &[EventRecord],
        client_key: Option<&str>,
    ) -> Result<CreateOutcome> {
        self.inner.create(checkpoint, events, client_key).await
    }
    async fn load(&self, run: &RunId) -> Result<Option<Checkpoint>> {
        self.inner.load(run).await
    }
    async fn commit(
        &self,
        lease: &Lease,
        checkpoint: &Checkpoint,
        expected_version: u64,
        events: &[EventRecord],
    ) -> Result<()> {
        self.inner
            .commit(lease, checkpoint, expected_version, events)
            .await
    }
    async fn claim(&self, run: &RunId, owner: &str, ttl: Duration) -> Result<Lease> {
        self.inner.claim(run, owner, ttl).await
    }
    async fn release(&self, lease: &Lease) -> Result<()> {
        self.inner.release(lease).await
    }
    async fn renew_leases(
        &self,
        owner: &str,
        leases: &[Lease],
        ttl: Duration,
    ) -> Result<Vec<RunId>> {
        if self.renewals_fail.load(Ordering::SeqCst) {
            return Err(Error::Unavailable("partitioned (test)".into()));
        }
        self.inner.renew_leases(owner, leases, ttl).await
    }
    async fn release_many(&self, leases: &[Lease], due_at_ms: Option<u64>) -> Result<()> {
        self.inner.release_many(leases, due_at_ms).await
    }
    async fn set_due(&self, run: &RunId, at_ms: Option<u64>) -> Result<()> {
        self.inner.set_due(run, at_ms).await
    }
    async fn due_runs(&self, now_ms: u64, limit: usize) -> Result<Vec<RunId>> {
        self.inner.due_runs(now_ms, limit).await
    }
    async fn lease_holder(&self, run: &RunId) -> Result<Option<String>> {
        self.inner.lease_holder(run).await
    }
    async fn register_node(&self, node_id: &str, instance: &str, ttl: Duration) -> Result<()> {
        self.inner.register_node(node_id, instance, ttl).await
    }
    async fn heartbeat_node(&self, node_id: &str, instance: &str, ttl: Duration) -> Result<()> {
        self.inner.heartbeat_node(node_id, instance, ttl).await
    }
    async fn unregister_node(&self, node_id: &str, instance: &str) -> Result<()> {
        self.inner.unregister_node(node_id, instance).await
    }
    async fn notify_node(&self, node_id: &str, run: &RunId) -> Result<()> {
        self.inner.notify_node(node_id, run).await
    }
    async fn wakeups(
        &self,
        node_id: &str,
        cursor: &str,
        block: Duration,
    ) -> Result<(Vec<RunId>, String)> {
        self.inner.wakeups(node_id, cursor, block).await
    }
    async fn active_runs(&self) -> Result<Vec<RunId>> {
        self.inner.active_runs().await
    }
    async fn list_runs(
        &self,
        tenant: &str,
        filter: &RunFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<RunPage> {
        self.inner.list_runs(tenant, filter, cursor, limit).await
    }
    async fn push_control(&self, run: &RunId, control: &Control) -> Result<u64> {
        self.inner.push_control(run, control).await
    }
    async fn controls(&self, run: &RunId, after: u64) -> Result<Vec<ControlRecord>> {
        self.inner.controls(run, after).await
    }
    async fn ping(&self) -> Result<()> {
        self.inner.ping().await
    }
    async fn epoch(&self) -> Result<String> {
        self.inner.epoch().await
    }
}

#[async_trait]
impl EventLog for PartitionedRenewals {
    async fn read(&self, run: &RunId, after: u64, limit: usize) -> Result<Vec<EventRecord>> {
        self.inner.read(run, after, limit).await
    }
}
