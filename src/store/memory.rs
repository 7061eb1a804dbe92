//! The in-memory store: the reference implementation of the store contract, for unit tests,
//! the benchmark and embedding. Nothing survives the process.

use std::time::{Duration, Instant};

use async_trait::async_trait;
use dashmap::DashMap;

use super::{
    Checkpoint, CheckpointStore, Control, ControlRecord, CreateOutcome, Error, EventLog,
    EventRecord, Lease, Result, RunFilter, RunPage, check_seq,
};
use crate::clock::now_ms;
use crate::ids::RunId;

#[derive(Debug, Default)]
struct RunEntry {
    checkpoint: Option<Checkpoint>,
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

/// An in-memory [`CheckpointStore`] + [`EventLog`].
#[derive(Debug)]
pub struct MemoryStore {
    runs: DashMap<RunId, RunEntry>,
    /// (tenant, client key) → run.
    client_keys: DashMap<(String, String), RunId>,
    /// Random per instance: a new process is a new (empty) store.
    epoch: String,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore {
            runs: DashMap::new(),
            client_keys: DashMap::new(),
            epoch: uuid::Uuid::new_v4().simple().to_string(),
        }
    }
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }
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
                dashmap::Entry::Occupied(o) => return Ok(CreateOutcome::Existing(o.get().clone())),
                dashmap::Entry::Vacant(v) => {
                    v.insert(run.clone());
                }
            }
        }
        let mut entry = self.runs.entry(run.clone()).or_default();
        if entry.checkpoint.as_ref() == Some(checkpoint) && entry.events == events {
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
        entry.checkpoint = Some(checkpoint.clone());
        entry.events = events.to_vec();
        Ok(CreateOutcome::Created)
    }

    async fn load(&self, run: &RunId) -> Result<Option<Checkpoint>> {
        Ok(self.runs.get(run).and_then(|e| e.checkpoint.clone()))
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
        // A retry of a commit that was applied (its reply lost) is not a conflict.
        let replay = entry.checkpoint.as_ref() == Some(checkpoint)
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
        entry.checkpoint = Some(checkpoint.clone());
        entry.events.extend_from_slice(events);
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
        let mut items: Vec<Checkpoint> = self
            .runs
            .iter()
            .filter_map(|e| e.checkpoint.clone())
            .filter(|c| c.tenant == tenant)
            .filter(|c| filter.status.as_ref().is_none_or(|s| &c.status == s))
            .filter(|c| filter.agent.as_ref().is_none_or(|a| &c.agent == a))
            .filter(|c| cursor.is_none_or(|cur| c.run_id.as_str() < cur))
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
