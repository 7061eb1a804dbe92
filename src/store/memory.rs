//! The in-memory store: the reference implementation of the store contract, for unit tests,
//! the benchmark and embedding. Nothing survives the process.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use dashmap::DashMap;

use super::local::{NodeRegistry, Wakeups};
use super::{
    Checkpoint, CheckpointStore, Control, ControlRecord, CreateOutcome, Error, EventLog,
    EventRecord, Lease, Result, RunFilter, RunPage, check_seq, due_in, torn_transcript,
};
use crate::clock::now_ms;
use crate::ids::RunId;

#[derive(Debug, Default)]
struct RunEntry {
    /// The record, without its transcript (kept apart, append-only, as the other stores do).
    checkpoint: Option<Checkpoint>,
    transcript: Vec<String>,
    events: Vec<EventRecord>,
    controls: Vec<ControlRecord>,
    lease: Option<HeldLease>,
    /// Highest token ever issued for this run; tokens only grow.
    last_token: u64,
}

#[derive(Debug, Clone)]
struct HeldLease {
    owner: String,
    token: u64,
    expires: Instant,
}

/// Runs by due time (wall-clock ms), and each run's entry.
#[derive(Debug, Default)]
struct DueIndex {
    by_time: BTreeSet<(u64, RunId)>,
    by_run: HashMap<RunId, u64>,
}

impl DueIndex {
    fn set(&mut self, run: &RunId, at: Option<u64>) {
        if let Some(old) = self.by_run.remove(run) {
            self.by_time.remove(&(old, run.clone()));
        }
        if let Some(at) = at {
            self.by_run.insert(run.clone(), at);
            self.by_time.insert((at, run.clone()));
        }
    }
}

/// An in-memory [`CheckpointStore`] + [`EventLog`].
#[derive(Debug)]
pub struct MemoryStore {
    runs: DashMap<RunId, RunEntry>,
    /// (tenant, client key) → run.
    client_keys: DashMap<(String, String), RunId>,
    /// Lock order: a `runs` entry may be held while taking this, never the other way round.
    due: Mutex<DueIndex>,
    nodes: NodeRegistry,
    wakeups: Wakeups,
    /// Random per instance: a new process is a new (empty) store.
    epoch: String,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore {
            runs: DashMap::new(),
            client_keys: DashMap::new(),
            due: Mutex::default(),
            nodes: NodeRegistry::default(),
            wakeups: Wakeups::default(),
            epoch: uuid::Uuid::new_v4().simple().to_string(),
        }
    }
}

impl MemoryStore {
    /// An empty store with a fresh random epoch marker.
    pub fn new() -> Self {
        Self::default()
    }

    fn due(&self) -> MutexGuard<'_, DueIndex> {
        self.due
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether `entry`'s current lease is `token` held by `owner` (expired or not: an expired
    /// lease stays current until someone else claims the run).
    fn holds(entry: &RunEntry, owner: Option<&str>, token: u64) -> bool {
        entry
            .lease
            .as_ref()
            .is_some_and(|l| l.token == token && owner.is_none_or(|o| o == l.owner))
    }
}

/// The record as stored (no transcript) and the transcript entries a write appends.
fn split_transcript(c: &Checkpoint) -> (Checkpoint, Vec<String>) {
    let record = Checkpoint {
        run_id: c.run_id.clone(),
        tenant: c.tenant.clone(),
        agent: c.agent.clone(),
        status: c.status.clone(),
        terminal: c.terminal,
        version: c.version,
        created_at_ms: c.created_at_ms,
        updated_at_ms: c.updated_at_ms,
        body: c.body.clone(),
        transcript: Vec::new(),
        transcript_from: 0,
    };
    (record, c.transcript.clone())
}

#[async_trait]
impl CheckpointStore for MemoryStore {
    async fn create(
        &self,
        checkpoint: &Checkpoint,
        events: &[EventRecord],
        client_key: Option<&str>,
    ) -> Result<CreateOutcome> {
        let run = &checkpoint.run_id;
        check_seq(run, 0, events.iter().map(|e| e.seq))?;
        if let Some(key) = client_key {
            match self
                .client_keys
                .entry((checkpoint.tenant.clone(), key.to_owned()))
            {
                // The key maps to this very run: a retry of this create, which proceeds.
                dashmap::Entry::Occupied(o) if o.get() != run => {
                    return Ok(CreateOutcome::Existing(o.get().clone()));
                }
                dashmap::Entry::Occupied(_) => {}
                dashmap::Entry::Vacant(v) => {
                    v.insert(run.clone());
                }
            }
        }
        let (record, appended) = split_transcript(checkpoint);
        let mut entry = self.runs.entry(run.clone()).or_default();
        if entry.checkpoint.as_ref() == Some(&record) && entry.events == events {
            // A retry of a create that was applied (its reply lost).
            return Ok(CreateOutcome::Created);
        }
        if entry.checkpoint.is_some() {
            return Err(Error::VersionConflict {
                run: run.clone(),
                expected: 0,
                found: entry.checkpoint.as_ref().map_or(0, |c| c.version),
            });
        }
        if checkpoint.transcript_from != 0 {
            return Err(torn_transcript(run, checkpoint.transcript_from, 0));
        }
        entry.checkpoint = Some(record);
        entry.transcript = appended;
        entry.events = events.to_vec();
        Ok(CreateOutcome::Created)
    }

    async fn load(&self, run: &RunId) -> Result<Option<Checkpoint>> {
        Ok(self.runs.get(run).and_then(|e| {
            e.checkpoint.clone().map(|mut c| {
                c.transcript = e.transcript.clone();
                c
            })
        }))
    }

    async fn transcript_entry(&self, run: &RunId, index: u64) -> Result<Option<String>> {
        Ok(self.runs.get(run).and_then(|e| {
            usize::try_from(index)
                .ok()
                .and_then(|i| e.transcript.get(i).cloned())
        }))
    }

    async fn commit(
        &self,
        lease: &Lease,
        checkpoint: &Checkpoint,
        expected_version: u64,
        events: &[EventRecord],
    ) -> Result<()> {
        let run = &checkpoint.run_id;
        let mut entry = self
            .runs
            .get_mut(run)
            .ok_or_else(|| Error::NotFound(run.clone()))?;
        let current = entry.lease.as_ref().map(|l| l.token);
        if current != Some(lease.token) {
            return Err(Error::Fenced {
                run: run.clone(),
                token: lease.token,
            });
        }
        let found = entry.checkpoint.as_ref().map_or(0, |c| c.version);
        let last = entry.events.last().map_or(0, |e| e.seq);
        let (record, appended) = split_transcript(checkpoint);
        // A retry of a commit that was applied (its reply lost) is not a conflict.
        let replay = entry.checkpoint.as_ref() == Some(&record)
            && events.last().is_none_or(|e| e.seq == last);
        if found != expected_version && replay {
            return Ok(());
        }
        if found != expected_version {
            return Err(Error::VersionConflict {
                run: run.clone(),
                expected: expected_version,
                found,
            });
        }
        check_seq(run, last, events.iter().map(|e| e.seq))?;
        let stored = entry.transcript.len() as u64;
        if checkpoint.transcript_from != stored {
            return Err(torn_transcript(run, checkpoint.transcript_from, stored));
        }
        entry.checkpoint = Some(record);
        entry.transcript.extend(appended);
        entry.events.extend_from_slice(events);
        if checkpoint.terminal {
            self.due().set(run, None);
        }
        Ok(())
    }

    async fn claim(&self, run: &RunId, owner: &str, ttl: Duration) -> Result<Lease> {
        let mut entry = self
            .runs
            .get_mut(run)
            .ok_or_else(|| Error::NotFound(run.clone()))?;
        let now = Instant::now();
        match &entry.lease {
            Some(l) if l.owner != owner && l.expires > now => {
                return Err(Error::LeaseHeld {
                    run: run.clone(),
                    owner: l.owner.clone(),
                });
            }
            _ => {}
        }
        let token = entry.last_token + 1;
        entry.last_token = token;
        entry.lease = Some(HeldLease {
            owner: owner.to_owned(),
            token,
            expires: now + ttl,
        });
        self.due().set(run, Some(due_in(ttl)));
        Ok(Lease {
            run_id: run.clone(),
            owner: owner.to_owned(),
            token,
        })
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        if let Some(mut entry) = self.runs.get_mut(&lease.run_id)
            && entry.lease.as_ref().map(|l| l.token) == Some(lease.token)
        {
            entry.lease = None;
        }
        Ok(())
    }

    async fn renew_leases(
        &self,
        owner: &str,
        leases: &[Lease],
        ttl: Duration,
    ) -> Result<Vec<RunId>> {
        let (expires, due) = (Instant::now() + ttl, due_in(ttl));
        let mut lost = Vec::new();
        for l in leases {
            let renewed = match self.runs.get_mut(&l.run_id) {
                Some(mut entry) if Self::holds(&entry, Some(owner), l.token) => {
                    if let Some(held) = entry.lease.as_mut() {
                        held.expires = expires;
                    }
                    if !entry.checkpoint.as_ref().is_some_and(|c| c.terminal) {
                        self.due().set(&l.run_id, Some(due));
                    }
                    true
                }
                _ => false,
            };
            if !renewed {
                lost.push(l.run_id.clone());
            }
        }
        Ok(lost)
    }

    async fn release_many(&self, leases: &[Lease], due_at_ms: Option<u64>) -> Result<()> {
        for l in leases {
            if let Some(mut entry) = self.runs.get_mut(&l.run_id)
                && Self::holds(&entry, None, l.token)
            {
                entry.lease = None;
                let terminal = entry.checkpoint.as_ref().is_some_and(|c| c.terminal);
                self.due().set(&l.run_id, due_at_ms.filter(|_| !terminal));
            }
        }
        Ok(())
    }

    async fn set_due(&self, run: &RunId, at_ms: Option<u64>) -> Result<()> {
        self.due().set(run, at_ms);
        Ok(())
    }

    async fn due_runs(&self, now_ms: u64, limit: usize) -> Result<Vec<RunId>> {
        let candidates: Vec<RunId> = self
            .due()
            .by_time
            .iter()
            .take_while(|(at, _)| *at <= now_ms)
            .map(|(_, run)| run.clone())
            .collect();
        let mut out = Vec::new();
        for run in candidates {
            if out.len() >= limit {
                break;
            }
            let live = self
                .runs
                .get(&run)
                .and_then(|e| e.checkpoint.as_ref().map(|c| !c.terminal));
            match live {
                Some(true) => out.push(run),
                Some(false) => self.due().set(&run, None),
                None if super::is_dangling(&run, now_ms) => self.due().set(&run, None),
                None => {}
            }
        }
        Ok(out)
    }

    async fn lease_holder(&self, run: &RunId) -> Result<Option<String>> {
        let now = Instant::now();
        Ok(self.runs.get(run).and_then(|e| {
            e.lease
                .as_ref()
                .filter(|l| l.expires > now)
                .map(|l| l.owner.clone())
        }))
    }

    async fn register_node(&self, node_id: &str, instance: &str, ttl: Duration) -> Result<()> {
        self.nodes.hold(node_id, instance, ttl)
    }

    async fn heartbeat_node(&self, node_id: &str, instance: &str, ttl: Duration) -> Result<()> {
        self.nodes.hold(node_id, instance, ttl)
    }

    async fn unregister_node(&self, node_id: &str, instance: &str) -> Result<()> {
        self.nodes.release(node_id, instance);
        Ok(())
    }

    async fn notify_node(&self, node_id: &str, run: &RunId) -> Result<()> {
        self.wakeups.notify(node_id, run);
        Ok(())
    }

    async fn wakeups(
        &self,
        node_id: &str,
        cursor: &str,
        block: Duration,
    ) -> Result<(Vec<RunId>, String)> {
        self.wakeups.read(node_id, cursor, block).await
    }

    async fn active_runs(&self) -> Result<Vec<RunId>> {
        let mut ids: Vec<RunId> = self
            .runs
            .iter()
            .filter(|e| e.checkpoint.as_ref().is_some_and(|c| !c.terminal))
            .map(|e| e.key().clone())
            .collect();
        ids.sort();
        Ok(ids)
    }

    async fn list_runs(
        &self,
        tenant: &str,
        filter: &RunFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<RunPage> {
        // The reference store holds decoded records, so it filters them in place and copies
        // only what it returns.
        let mut items: Vec<Checkpoint> = self
            .runs
            .iter()
            .filter_map(|e| {
                e.checkpoint
                    .as_ref()
                    .filter(|c| {
                        c.tenant == tenant
                            && filter.status.as_ref().is_none_or(|s| &c.status == s)
                            && filter.agent.as_ref().is_none_or(|a| &c.agent == a)
                            && cursor.is_none_or(|cur| c.run_id.as_str() < cur)
                    })
                    .cloned()
            })
            .collect();
        items.sort_by(|a, b| b.run_id.cmp(&a.run_id));
        Ok(RunPage::from_newest_first(items, limit))
    }

    async fn push_control(&self, run: &RunId, control: &Control) -> Result<u64> {
        let mut entry = self
            .runs
            .get_mut(run)
            .ok_or_else(|| Error::NotFound(run.clone()))?;
        let seq = entry.controls.len() as u64 + 1;
        entry.controls.push(ControlRecord {
            seq,
            at_ms: now_ms(),
            control: control.clone(),
        });
        Ok(seq)
    }

    async fn controls(&self, run: &RunId, after: u64) -> Result<Vec<ControlRecord>> {
        Ok(self
            .runs
            .get(run)
            .map(|e| {
                e.controls
                    .iter()
                    .filter(|c| c.seq > after)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default())
    }

    async fn ping(&self) -> Result<()> {
        Ok(())
    }

    async fn epoch(&self) -> Result<String> {
        Ok(self.epoch.clone())
    }
}

#[async_trait]
impl EventLog for MemoryStore {
    async fn read(&self, run: &RunId, after: u64, limit: usize) -> Result<Vec<EventRecord>> {
        Ok(self
            .runs
            .get(run)
            .map(|e| {
                // seq is gap-free from 1, so the index of seq s is s - 1.
                let start = (after as usize).min(e.events.len());
                e.events[start..].iter().take(limit).cloned().collect()
            })
            .unwrap_or_default())
    }
}
