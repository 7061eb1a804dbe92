//! `FileStore`: the embedded single-machine store on redb (one file, `<dir>/agentd.redb`), the
//! default when no Redis URL is given. Reads are one redb read transaction each, on the blocking
//! pool. Writes (create, commit, claim, release, push_control) go through a bounded queue to ONE
//! writer thread that group-commits: it takes everything queued (up to `max_batch`), applies each
//! write's checks and then its writes in order inside one redb write transaction, commits that
//! transaction once (one fsync, `Durability::Immediate`), and only then answers each caller.
//!
//! Each write in a batch is checked completely before any of its data is written, so a rejected
//! write (conflict, fence, gap, …) is that caller's error only and leaves nothing behind; later
//! writes in the batch see the earlier ones, exactly as if they had run one after another. A
//! storage failure (any redb error) aborts the whole transaction and every caller in the batch
//! gets `Unavailable`: nothing of the batch was applied.
//!
//! Lease tokens and fences are durable (tokens never go back, even across restarts); lease
//! liveness (owner + expiry) is kept in memory by the writer thread, on the monotonic clock,
//! because the database file is locked by one process, so leases of a previous process are void
//! by construction. Liveness changes take effect only once their transaction is committed.
//!
//! Single-node by design: redb holds the file exclusively, so one process is the only node.
//! Leases of a previous process are stale when the file is opened (claims succeed at once),
//! the node registry and the wake-ups between nodes live in this process (`local`), and the
//! due index is a redb table written in the same transactions as the leases and commits.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redb::{
    Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, Table, TableDefinition,
    WriteTransaction,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use super::local::{NodeRegistry, Wakeups};
use super::{
    Checkpoint, CheckpointStore, Control, ControlRecord, CreateOutcome, Error, EventLog,
    EventRecord, Lease, Result, RunFilter, RunPage, check_seq, corrupt, due_in, encode_events,
    torn_transcript,
};
use crate::clock::now_ms;
use crate::ids::RunId;

/// File name inside the store directory.
pub const FILE_NAME: &str = "agentd.redb";

/// run id → checkpoint JSON.
const RUNS: TableDefinition<&str, &str> = TableDefinition::new("runs");
/// (run id, seq) → event JSON.
const EVENTS: TableDefinition<(&str, u64), &str> = TableDefinition::new("events");
/// (run id, index) → one transcript entry (a message's JSON), append-only.
const TRANSCRIPT: TableDefinition<(&str, u64), &str> = TableDefinition::new("transcript");
/// (run id, seq) → stored control JSON.
const CONTROLS: TableDefinition<(&str, u64), &str> = TableDefinition::new("controls");
/// run id → (current fence token or 0, last issued token).
const TOKENS: TableDefinition<&str, (u64, u64)> = TableDefinition::new("tokens");
/// run id → () for runs not yet terminal.
const ACTIVE: TableDefinition<&str, ()> = TableDefinition::new("active");
/// (tenant, run id) → () for listing.
const TENANT_RUNS: TableDefinition<(&str, &str), ()> = TableDefinition::new("tenant_runs");
/// (tenant, status, run id) → (): the listing index of a status filter.
const TENANT_STATUS_RUNS: TableDefinition<(&str, &str, &str), ()> =
    TableDefinition::new("tenant_status_runs");
/// (tenant, agent, run id) → (): the listing index of an agent filter.
const TENANT_AGENT_RUNS: TableDefinition<(&str, &str, &str), ()> =
    TableDefinition::new("tenant_agent_runs");
/// (tenant, client key) → run id.
const CLIENT_KEYS: TableDefinition<(&str, &str), &str> = TableDefinition::new("client_keys");
/// (due time in wall-clock ms, run id) → (): runs by due time.
const DUE: TableDefinition<(u64, &str), ()> = TableDefinition::new("due");
/// run id → its due time, to find its entry in `DUE`.
const DUE_BY_RUN: TableDefinition<&str, u64> = TableDefinition::new("due_by_run");
/// Store metadata (`epoch`; `list_index` once the listing indexes cover every run).
const META: TableDefinition<&str, &str> = TableDefinition::new("meta");

/// How long dropping the store waits for the writer thread to finish its last batch and close
/// the file.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// Tuning of the group committer.
#[derive(Debug, Clone)]
pub struct FileConfig {
    /// Writes that may wait for the writer thread.
    pub queue_capacity: usize,
    /// Most writes applied in one transaction. Each transaction ends in one fsync (about 2 ms
    /// here), so under load the batch is what amortizes it: at 256, a thousand busy runs
    /// filled nearly every batch and the writer spent a third of its time in fsync;
    /// 1024 gave `agentd bench --runs 1000 --store file:…` about 30 % more steps per second.
    pub max_batch: usize,
    /// How long a write waits for room in a full queue before `Unavailable`.
    pub queue_wait: Duration,
    /// How long a queued write waits for its answer before `Unavailable` (it may or may not
    /// have been applied then).
    pub reply_wait: Duration,
}

impl Default for FileConfig {
    fn default() -> Self {
        FileConfig {
            queue_capacity: 4096,
            max_batch: 1024,
            queue_wait: Duration::from_secs(5),
            reply_wait: Duration::from_secs(30),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct StoredControl {
    at_ms: u64,
    control: Control,
}

#[derive(Debug, Clone)]
struct LiveLease {
    owner: String,
    token: u64,
    expires: Instant,
}

/// Waits (bounded) in `drop` until the writer thread has ended, so the database file is closed
/// when the store is gone and can be opened again at once.
struct WriterExit {
    /// Disconnects when the writer thread ends.
    done: Mutex<std::sync::mpsc::Receiver<()>>,
}

impl Drop for WriterExit {
    fn drop(&mut self) {
        let done = self
            .done
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = done.recv_timeout(SHUTDOWN_WAIT) {
            tracing::warn!(
                "file store: the writer thread did not end within {SHUTDOWN_WAIT:?} of closing"
            );
        }
    }
}

// Field order matters: dropping `queue` first ends the writer thread once it has drained the
// queue; `writer` (last) then waits for it.
struct Inner {
    queue: mpsc::Sender<Job>,
    db: Arc<Database>,
    leases: LiveLeases,
    nodes: NodeRegistry,
    wakeups: Wakeups,
    path: PathBuf,
    cfg: FileConfig,
    _writer: WriterExit,
}

/// The redb [`CheckpointStore`] + [`EventLog`].
#[derive(Clone)]
pub struct FileStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for FileStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileStore")
            .field("path", &self.inner.path)
            .finish()
    }
}

fn db_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Unavailable(format!("file store: {what}: {e}"))
}

fn last_seq<T: ReadableTable<(&'static str, u64), &'static str>>(
    table: &T,
    run: &RunId,
) -> Result<u64> {
    let mut range = table
        .range((run.as_str(), 0u64)..=(run.as_str(), u64::MAX))
        .map_err(|e| db_err("reading a log", e))?;
    match range.next_back() {
        Some(entry) => {
            let (k, _) = entry.map_err(|e| db_err("reading a log", e))?;
            Ok(k.value().1)
        }
        None => Ok(0),
    }
}

fn decode(run: &RunId, json: &str) -> Result<Checkpoint> {
    serde_json::from_str(json).map_err(|e| corrupt(run, "decoding checkpoint", e))
}

/// The fields of a stored checkpoint a commit checks, read without copying its body.
#[derive(Deserialize)]
struct Head<'a> {
    version: u64,
    #[serde(borrow)]
    status: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    tenant: std::borrow::Cow<'a, str>,
}

fn decode_head<'a>(run: &RunId, json: &'a str) -> Result<Head<'a>> {
    serde_json::from_str(json).map_err(|e| corrupt(run, "decoding checkpoint", e))
}

/// The `META` entry saying the listing indexes cover every run.
const LIST_INDEX_MARK: &str = "list_index";

/// Fills the (tenant, status) and (tenant, agent) listing indexes from the stored runs, once:
/// a store written before they existed gets them at its first open by this version. A record
/// that does not decode is left out (listings quarantine it when they meet it unfiltered).
fn build_list_indexes(txn: &WriteTransaction) -> Result<()> {
    let what = "building the listing indexes";
    let mut meta = txn.open_table(META).map_err(|x| db_err(what, x))?;
    if meta
        .get(LIST_INDEX_MARK)
        .map_err(|x| db_err(what, x))?
        .is_some()
    {
        return Ok(());
    }
    let runs = txn.open_table(RUNS).map_err(|x| db_err(what, x))?;
    let mut by_status = txn
        .open_table(TENANT_STATUS_RUNS)
        .map_err(|x| db_err(what, x))?;
    let mut by_agent = txn
        .open_table(TENANT_AGENT_RUNS)
        .map_err(|x| db_err(what, x))?;
    let mut indexed = 0u64;
    for entry in runs.iter().map_err(|x| db_err(what, x))? {
        let (k, v) = entry.map_err(|x| db_err(what, x))?;
        let Ok(c) = serde_json::from_str::<Checkpoint>(v.value()) else {
            tracing::warn!(
                run_id = k.value(),
                "a stored run does not decode; it stays out of the listing indexes"
            );
            continue;
        };
        let (tenant, run) = (c.tenant.as_str(), k.value());
        by_status
            .insert((tenant, c.status.as_str(), run), ())
            .map_err(|x| db_err(what, x))?;
        by_agent
            .insert((tenant, c.agent.as_str(), run), ())
            .map_err(|x| db_err(what, x))?;
        indexed += 1;
    }
    if indexed > 0 {
        tracing::info!(runs = indexed, "file store: built the listing indexes");
    }
    meta.insert(LIST_INDEX_MARK, "1")
        .map_err(|x| db_err(what, x))?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The writer: jobs, their application inside a shared transaction, and the thread.

struct CreateJob {
    run: RunId,
    transcript: Vec<String>,
    tenant: String,
    agent: String,
    status: String,
    terminal: bool,
    json: String,
    events: Vec<(u64, String)>,
    key: Option<String>,
}

struct CommitJob {
    run: RunId,
    transcript_from: u64,
    transcript: Vec<String>,
    status: String,
    token: u64,
    expected: u64,
    terminal: bool,
    json: String,
    events: Vec<(u64, String)>,
    /// `commit_final`: the lease given up in the same transaction.
    release: Option<Lease>,
}

struct ClaimJob {
    run: RunId,
    owner: String,
    ttl: Duration,
}

struct PushControlJob {
    run: RunId,
    json: String,
}

struct RenewJob {
    owner: String,
    leases: Vec<Lease>,
    ttl: Duration,
}

struct ReleaseManyJob {
    leases: Vec<Lease>,
    due: Option<u64>,
}

struct SetDueJob {
    runs: Vec<RunId>,
    due: Option<u64>,
}

/// A caller's answer channel and, once its write has been applied in the open transaction, the
/// answer to send if that transaction commits.
struct Reply<T> {
    tx: oneshot::Sender<Result<T>>,
    out: Option<Result<T>>,
}

impl<T> Reply<T> {
    fn new(tx: oneshot::Sender<Result<T>>) -> Self {
        Reply { tx, out: None }
    }

    /// Records the outcome of applying the write. An `Unavailable` (a storage failure, possibly
    /// after part of this write) is not recorded but returned: it aborts the whole batch.
    fn settle(&mut self, r: Result<T>) -> Result<()> {
        match r {
            Err(e @ Error::Unavailable(_)) => Err(e),
            r => {
                self.out = Some(r);
                Ok(())
            }
        }
    }

    fn send(self) {
        let out = self.out.unwrap_or_else(|| {
            Err(Error::Unavailable(
                "file store: write was not applied".to_owned(),
            ))
        });
        // The caller may have given up waiting; the outcome stands either way.
        let _ = self.tx.send(out);
    }

    fn fail(self, e: &Error) {
        let _ = self.tx.send(Err(e.clone()));
    }
}

enum Job {
    Create(CreateJob, Reply<CreateOutcome>),
    /// A create and, if it stored the run, the first claim of it, in one transaction.
    CreateClaimed(CreateJob, ClaimJob, Reply<(CreateOutcome, Option<Lease>)>),
    Commit(CommitJob, Reply<()>),
    Claim(ClaimJob, Reply<Lease>),
    Release(Lease, Reply<()>),
    PushControl(PushControlJob, Reply<u64>),
    Renew(RenewJob, Reply<Vec<RunId>>),
    ReleaseMany(ReleaseManyJob, Reply<()>),
    SetDue(SetDueJob, Reply<()>),
}

impl Job {
    fn apply(&mut self, t: &mut Tables<'_>, leases: &mut Leases<'_>) -> Result<()> {
        match self {
            Job::Create(j, r) => r.settle(t.create(j)),
            Job::CreateClaimed(j, c, r) => {
                let created = t.create(j).and_then(|outcome| {
                    if outcome != CreateOutcome::Created {
                        return Ok((outcome, None));
                    }
                    match t.claim(c, leases) {
                        Ok(lease) => Ok((outcome, Some(lease))),
                        // Storage failed: the whole batch is aborted and fails.
                        Err(e @ Error::Unavailable(_)) => Err(e),
                        // Claimed elsewhere already (this create was a retry): the caller
                        // claims as any node would.
                        Err(_) => Ok((outcome, None)),
                    }
                });
                r.settle(created)
            }
            Job::Commit(j, r) => r.settle(t.commit(j).and_then(|()| match &j.release {
                Some(lease) => t.release(lease, leases),
                None => Ok(()),
            })),
            Job::Claim(j, r) => r.settle(t.claim(j, leases)),
            Job::Release(l, r) => r.settle(t.release(l, leases)),
            Job::PushControl(j, r) => r.settle(t.push_control(j)),
            Job::Renew(j, r) => r.settle(t.renew(j, leases)),
            Job::ReleaseMany(j, r) => r.settle(t.release_many(j, leases)),
            Job::SetDue(j, r) => r.settle(j.runs.iter().try_for_each(|run| t.set_due(run, j.due))),
        }
    }

    fn send(self) {
        match self {
            Job::Create(_, r) => r.send(),
            Job::CreateClaimed(_, _, r) => r.send(),
            Job::Commit(_, r) => r.send(),
            Job::Claim(_, r) => r.send(),
            Job::Release(_, r) => r.send(),
            Job::PushControl(_, r) => r.send(),
            Job::Renew(_, r) => r.send(),
            Job::ReleaseMany(_, r) => r.send(),
            Job::SetDue(_, r) => r.send(),
        }
    }

    fn fail(self, e: &Error) {
        match self {
            Job::Create(_, r) => r.fail(e),
            Job::CreateClaimed(_, _, r) => r.fail(e),
            Job::Commit(_, r) => r.fail(e),
            Job::Claim(_, r) => r.fail(e),
            Job::Release(_, r) => r.fail(e),
            Job::PushControl(_, r) => r.fail(e),
            Job::Renew(_, r) => r.fail(e),
            Job::ReleaseMany(_, r) => r.fail(e),
            Job::SetDue(_, r) => r.fail(e),
        }
    }
}

/// Lease liveness as the open transaction sees it: the committed map plus this batch's changes
/// (`None` = released), which are merged only once the transaction has committed.
struct Leases<'a> {
    committed: &'a HashMap<RunId, LiveLease>,
    pending: HashMap<RunId, Option<LiveLease>>,
}

impl Leases<'_> {
    fn get(&self, run: &RunId) -> Option<&LiveLease> {
        match self.pending.get(run) {
            Some(l) => l.as_ref(),
            None => self.committed.get(run),
        }
    }
}

/// Every table, opened once per batch.
struct Tables<'t> {
    runs: Table<'t, &'static str, &'static str>,
    events: Table<'t, (&'static str, u64), &'static str>,
    transcript: Table<'t, (&'static str, u64), &'static str>,
    controls: Table<'t, (&'static str, u64), &'static str>,
    tokens: Table<'t, &'static str, (u64, u64)>,
    active: Table<'t, &'static str, ()>,
    tenant_runs: Table<'t, (&'static str, &'static str), ()>,
    tenant_status_runs: Table<'t, (&'static str, &'static str, &'static str), ()>,
    tenant_agent_runs: Table<'t, (&'static str, &'static str, &'static str), ()>,
    client_keys: Table<'t, (&'static str, &'static str), &'static str>,
    due: Table<'t, (u64, &'static str), ()>,
    due_by_run: Table<'t, &'static str, u64>,
}

const W: &str = "writing";

fn w(e: impl std::fmt::Display) -> Error {
    db_err(W, e)
}

impl<'t> Tables<'t> {
    fn open(txn: &'t WriteTransaction) -> Result<Self> {
        let o = |e: redb::TableError| db_err("opening tables", e);
        Ok(Tables {
            runs: txn.open_table(RUNS).map_err(o)?,
            events: txn.open_table(EVENTS).map_err(o)?,
            transcript: txn.open_table(TRANSCRIPT).map_err(o)?,
            controls: txn.open_table(CONTROLS).map_err(o)?,
            tokens: txn.open_table(TOKENS).map_err(o)?,
            active: txn.open_table(ACTIVE).map_err(o)?,
            tenant_runs: txn.open_table(TENANT_RUNS).map_err(o)?,
            tenant_status_runs: txn.open_table(TENANT_STATUS_RUNS).map_err(o)?,
            tenant_agent_runs: txn.open_table(TENANT_AGENT_RUNS).map_err(o)?,
            client_keys: txn.open_table(CLIENT_KEYS).map_err(o)?,
            due: txn.open_table(DUE).map_err(o)?,
            due_by_run: txn.open_table(DUE_BY_RUN).map_err(o)?,
        })
    }

    fn stored(&self, run: &RunId) -> Result<Option<String>> {
        Ok(self
            .runs
            .get(run.as_str())
            .map_err(w)?
            .map(|v| v.value().to_owned()))
    }

    fn append_events(&mut self, run: &RunId, events: &[(u64, String)]) -> Result<()> {
        for (seq, json) in events {
            self.events
                .insert((run.as_str(), *seq), json.as_str())
                .map_err(w)?;
        }
        Ok(())
    }

    /// Appends transcript entries at `from`, which must be where the run's transcript ends.
    fn append_transcript(&mut self, run: &RunId, from: u64, entries: &[String]) -> Result<()> {
        let stored = last_seq(&self.transcript, run)?;
        // `last_seq` answers the last key (0 when empty); entries are keyed from 1.
        if stored != from {
            return Err(torn_transcript(run, from, stored));
        }
        for (i, json) in entries.iter().enumerate() {
            self.transcript
                .insert((run.as_str(), from + 1 + i as u64), json.as_str())
                .map_err(w)?;
        }
        Ok(())
    }

    fn set_active(&mut self, run: &RunId, terminal: bool) -> Result<()> {
        if terminal {
            self.active.remove(run.as_str()).map_err(w)?;
        } else {
            self.active.insert(run.as_str(), ()).map_err(w)?;
        }
        Ok(())
    }

    fn set_due(&mut self, run: &RunId, at: Option<u64>) -> Result<()> {
        let old = self
            .due_by_run
            .remove(run.as_str())
            .map_err(w)?
            .map(|v| v.value());
        if let Some(old) = old {
            self.due.remove((old, run.as_str())).map_err(w)?;
        }
        if let Some(at) = at {
            self.due_by_run.insert(run.as_str(), at).map_err(w)?;
            self.due.insert((at, run.as_str()), ()).map_err(w)?;
        }
        Ok(())
    }

    fn is_active(&self, run: &RunId) -> Result<bool> {
        Ok(self.active.get(run.as_str()).map_err(w)?.is_some())
    }

    /// The run's current fence token (0: none).
    fn fence(&self, run: &RunId) -> Result<u64> {
        Ok(self
            .tokens
            .get(run.as_str())
            .map_err(w)?
            .map_or(0, |v| v.value().0))
    }

    fn renew(&mut self, j: &RenewJob, leases: &mut Leases<'_>) -> Result<Vec<RunId>> {
        let expires = Instant::now() + j.ttl;
        let due = due_in(j.ttl);
        let mut lost = Vec::new();
        for l in &j.leases {
            let run = &l.run_id;
            let held = leases
                .get(run)
                .is_some_and(|live| live.token == l.token && live.owner == j.owner)
                && self.fence(run)? == l.token;
            if !held {
                lost.push(run.clone());
                continue;
            }
            leases.pending.insert(
                run.clone(),
                Some(LiveLease {
                    owner: j.owner.clone(),
                    token: l.token,
                    expires,
                }),
            );
            if self.is_active(run)? {
                self.set_due(run, Some(due))?;
            }
        }
        Ok(lost)
    }

    fn release_many(&mut self, j: &ReleaseManyJob, leases: &mut Leases<'_>) -> Result<()> {
        for l in &j.leases {
            if self.fence(&l.run_id)? != l.token {
                continue;
            }
            self.release(l, leases)?;
            let due = if self.is_active(&l.run_id)? {
                j.due
            } else {
                None
            };
            self.set_due(&l.run_id, due)?;
        }
        Ok(())
    }

    fn create(&mut self, j: &CreateJob) -> Result<CreateOutcome> {
        let run = &j.run;
        // Checks first: a rejected create writes nothing (and does not use up its key).
        if let Some(k) = &j.key {
            let existing = self
                .client_keys
                .get((j.tenant.as_str(), k.as_str()))
                .map_err(w)?
                .map(|v| v.value().to_owned());
            if let Some(id) = existing {
                let id: RunId = id
                    .parse()
                    .map_err(|e| corrupt(run, "client key maps to a bad run id", e))?;
                // The key maps to this very run: a retry of this create, which proceeds.
                if &id != run {
                    return Ok(CreateOutcome::Existing(id));
                }
            }
        }
        if let Some(found) = self.stored(run)? {
            if found == j.json {
                // A retry of an applied create (reply lost).
                return Ok(CreateOutcome::Created);
            }
            return Err(Error::VersionConflict {
                run: run.clone(),
                expected: 0,
                found: decode(run, &found)?.version,
            });
        }
        if let Some(k) = &j.key {
            self.client_keys
                .insert((j.tenant.as_str(), k.as_str()), run.as_str())
                .map_err(w)?;
        }
        self.append_transcript(run, 0, &j.transcript)?;
        self.runs.insert(run.as_str(), j.json.as_str()).map_err(w)?;
        self.tenant_runs
            .insert((j.tenant.as_str(), run.as_str()), ())
            .map_err(w)?;
        self.tenant_status_runs
            .insert((j.tenant.as_str(), j.status.as_str(), run.as_str()), ())
            .map_err(w)?;
        self.tenant_agent_runs
            .insert((j.tenant.as_str(), j.agent.as_str(), run.as_str()), ())
            .map_err(w)?;
        self.append_events(run, &j.events)?;
        self.set_active(run, j.terminal)?;
        Ok(CreateOutcome::Created)
    }

    fn commit(&mut self, j: &CommitJob) -> Result<()> {
        let run = &j.run;
        // Checks first: a rejected commit writes nothing.
        let stored = self
            .stored(run)?
            .ok_or_else(|| Error::NotFound(run.clone()))?;
        let fence = self
            .tokens
            .get(run.as_str())
            .map_err(w)?
            .map_or(0, |v| v.value().0);
        if fence == 0 || fence != j.token {
            return Err(Error::Fenced {
                run: run.clone(),
                token: j.token,
            });
        }
        let last = last_seq(&self.events, run)?;
        let before = decode_head(run, &stored)?;
        let found = before.version;
        if found != j.expected {
            let replay = stored == j.json && j.events.last().is_none_or(|(seq, _)| *seq == last);
            if replay {
                return Ok(());
            }
            return Err(Error::VersionConflict {
                run: run.clone(),
                expected: j.expected,
                found,
            });
        }
        check_seq(run, last, j.events.iter().map(|(seq, _)| *seq))?;
        self.append_transcript(run, j.transcript_from, &j.transcript)?;
        self.runs.insert(run.as_str(), j.json.as_str()).map_err(w)?;
        if before.status != j.status {
            let tenant: &str = &before.tenant;
            self.tenant_status_runs
                .remove((tenant, &*before.status, run.as_str()))
                .map_err(w)?;
            self.tenant_status_runs
                .insert((tenant, j.status.as_str(), run.as_str()), ())
                .map_err(w)?;
        }
        self.append_events(run, &j.events)?;
        // Only a run that ends leaves the active set: rewriting its entry at every commit
        // would dirty (and write) one more page per commit.
        if j.terminal {
            self.set_active(run, true)?;
            self.set_due(run, None)?;
        }
        Ok(())
    }

    fn claim(&mut self, j: &ClaimJob, leases: &mut Leases<'_>) -> Result<Lease> {
        let run = &j.run;
        let now = Instant::now();
        if let Some(l) = leases.get(run) {
            // The same owner claiming again is a new incarnation: it gets a new token too.
            if l.owner != j.owner && l.expires > now {
                return Err(Error::LeaseHeld {
                    run: run.clone(),
                    owner: l.owner.clone(),
                });
            }
        }
        if self.runs.get(run.as_str()).map_err(w)?.is_none() {
            return Err(Error::NotFound(run.clone()));
        }
        let last = self
            .tokens
            .get(run.as_str())
            .map_err(w)?
            .map_or(0, |v| v.value().1);
        let token = last + 1;
        self.tokens
            .insert(run.as_str(), (token, token))
            .map_err(w)?;
        leases.pending.insert(
            run.clone(),
            Some(LiveLease {
                owner: j.owner.clone(),
                token,
                expires: now + j.ttl,
            }),
        );
        if self.is_active(run)? {
            self.set_due(run, Some(due_in(j.ttl)))?;
        }
        Ok(Lease {
            run_id: run.clone(),
            owner: j.owner.clone(),
            token,
        })
    }

    fn release(&mut self, lease: &Lease, leases: &mut Leases<'_>) -> Result<()> {
        let run = &lease.run_id;
        let cur = self.tokens.get(run.as_str()).map_err(w)?.map(|v| v.value());
        match cur {
            Some((fence, last)) if fence == lease.token => {
                self.tokens.insert(run.as_str(), (0, last)).map_err(w)?;
            }
            _ => return Ok(()),
        }
        if leases.get(run).is_some_and(|l| l.token == lease.token) {
            leases.pending.insert(run.clone(), None);
        }
        Ok(())
    }

    fn push_control(&mut self, j: &PushControlJob) -> Result<u64> {
        let run = &j.run;
        if self.runs.get(run.as_str()).map_err(w)?.is_none() {
            return Err(Error::NotFound(run.clone()));
        }
        let seq = last_seq(&self.controls, run)? + 1;
        self.controls
            .insert((run.as_str(), seq), j.json.as_str())
            .map_err(w)?;
        Ok(seq)
    }
}

/// A copy of the writer's committed lease liveness, updated after each committed batch (under
/// a short lock), read by `lease_holder`.
type LiveLeases = Arc<Mutex<HashMap<RunId, LiveLease>>>;

fn lock_leases(l: &LiveLeases) -> std::sync::MutexGuard<'_, HashMap<RunId, LiveLease>> {
    l.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The writer thread's state: the database and the committed lease liveness map (only the
/// writer reads or changes it, so it needs no lock), and the copy others read.
struct Writer {
    db: Arc<Database>,
    leases: HashMap<RunId, LiveLease>,
    shared: LiveLeases,
}

impl Writer {
    /// Drains the queue batch by batch until every sender (the store) is gone.
    fn run(mut self, mut rx: mpsc::Receiver<Job>, max_batch: usize) {
        let max_batch = max_batch.max(1);
        let mut batch = Vec::with_capacity(max_batch);
        while let Some(first) = rx.blocking_recv() {
            batch.push(first);
            while batch.len() < max_batch {
                match rx.try_recv() {
                    Ok(job) => batch.push(job),
                    Err(_) => break,
                }
            }
            let n = batch.len();
            match self.apply(&mut batch) {
                Ok(()) => batch.drain(..).for_each(Job::send),
                Err(e) => {
                    tracing::warn!(writes = n, error = %e, "file store: batch not committed");
                    batch.drain(..).for_each(|j| j.fail(&e));
                }
            }
        }
    }

    /// Applies the batch in one transaction and commits it. On error nothing of the batch is
    /// stored (the transaction is dropped, i.e. aborted) and the lease map is unchanged.
    fn apply(&mut self, batch: &mut [Job]) -> Result<()> {
        let what = format!("committing a batch of {} writes", batch.len());
        let txn = self.db.begin_write().map_err(|e| db_err(&what, e))?;
        let mut leases = Leases {
            committed: &self.leases,
            pending: HashMap::new(),
        };
        {
            let mut tables = Tables::open(&txn)?;
            for job in batch.iter_mut() {
                job.apply(&mut tables, &mut leases)?;
            }
        }
        let pending = leases.pending;
        txn.commit().map_err(|e| db_err(&what, e))?;
        let mut shared = lock_leases(&self.shared);
        for (run, l) in pending {
            match l {
                Some(l) => {
                    shared.insert(run.clone(), l.clone());
                    self.leases.insert(run, l)
                }
                None => {
                    shared.remove(&run);
                    self.leases.remove(&run)
                }
            };
        }
        Ok(())
    }
}

impl FileStore {
    /// Opens (or creates) `<dir>/agentd.redb`, creating `dir` if needed.
    pub async fn open(dir: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(dir, FileConfig::default()).await
    }

    /// [`FileStore::open`] with explicit group-commit tuning.
    pub async fn open_with(dir: impl AsRef<Path>, cfg: FileConfig) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        tokio::task::spawn_blocking(move || Self::open_blocking(&dir, cfg))
            .await
            .map_err(|e| db_err("opening", e))?
    }

    fn open_blocking(dir: &Path, cfg: FileConfig) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .map_err(|e| db_err(&format!("creating {}", dir.display()), e))?;
        let path = dir.join(FILE_NAME);
        let db = Database::create(&path)
            .map_err(|e| db_err(&format!("opening {}", path.display()), e))?;
        let txn = db.begin_write().map_err(|e| db_err("initialising", e))?;
        {
            let init = |e: redb::TableError| db_err("initialising", e);
            txn.open_table(RUNS).map_err(init)?;
            txn.open_table(EVENTS).map_err(init)?;
            txn.open_table(TRANSCRIPT).map_err(init)?;
            txn.open_table(CONTROLS).map_err(init)?;
            txn.open_table(TOKENS).map_err(init)?;
            txn.open_table(ACTIVE).map_err(init)?;
            txn.open_table(TENANT_RUNS).map_err(init)?;
            txn.open_table(CLIENT_KEYS).map_err(init)?;
            build_list_indexes(&txn)?;
            txn.open_table(DUE).map_err(init)?;
            txn.open_table(DUE_BY_RUN).map_err(init)?;
            let mut meta = txn.open_table(META).map_err(init)?;
            let has_epoch = meta
                .get("epoch")
                .map_err(|e| db_err("initialising", e))?
                .is_some();
            if !has_epoch {
                let epoch = uuid::Uuid::new_v4().simple().to_string();
                meta.insert("epoch", epoch.as_str())
                    .map_err(|e| db_err("initialising", e))?;
            }
        }
        txn.commit().map_err(|e| db_err("initialising", e))?;

        let db = Arc::new(db);
        let (queue, rx) = mpsc::channel(cfg.queue_capacity.max(1));
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let leases = LiveLeases::default();
        let writer = Writer {
            db: db.clone(),
            leases: HashMap::new(),
            shared: leases.clone(),
        };
        let max_batch = cfg.max_batch;
        std::thread::Builder::new()
            .name("agentd-file-writer".to_owned())
            .spawn(move || {
                // Dropped when the thread ends, also by a panic: that wakes `WriterExit`.
                let _done = done_tx;
                writer.run(rx, max_batch);
            })
            .map_err(|e| db_err("starting the writer thread", e))?;
        Ok(FileStore {
            inner: Arc::new(Inner {
                queue,
                db,
                leases,
                nodes: NodeRegistry::default(),
                wakeups: Wakeups::default(),
                path,
                cfg,
                _writer: WriterExit {
                    done: Mutex::new(done_rx),
                },
            }),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Runs `f` on the blocking pool.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .map_err(|e| db_err("worker task", e))?
    }

    /// Queues one write for the writer thread and waits (bounded) for its outcome.
    async fn write<T>(
        &self,
        what: impl FnOnce() -> String,
        job: impl FnOnce(Reply<T>) -> Job,
    ) -> Result<T> {
        let cfg = &self.inner.cfg;
        let (tx, rx) = oneshot::channel();
        if let Err(e) = self
            .inner
            .queue
            .send_timeout(job(Reply::new(tx)), cfg.queue_wait)
            .await
        {
            let why = match e {
                mpsc::error::SendTimeoutError::Timeout(_) => {
                    format!("write queue full for {:?}", cfg.queue_wait)
                }
                mpsc::error::SendTimeoutError::Closed(_) => "writer stopped".to_owned(),
            };
            // Not queued, so certainly not applied.
            return Err(Error::Unavailable(format!("file store: {}: {why}", what())));
        }
        match tokio::time::timeout(cfg.reply_wait, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Error::Unavailable(format!(
                "file store: {}: writer stopped",
                what()
            ))),
            Err(_) => Err(Error::Unavailable(format!(
                "file store: {}: no answer within {:?}",
                what(),
                cfg.reply_wait
            ))),
        }
    }
}

impl FileStore {
    /// `commit`, and with `release` the lease given up in the same transaction.
    async fn commit_maybe_final(
        &self,
        lease: &Lease,
        checkpoint: &Checkpoint,
        expected_version: u64,
        events: &[EventRecord],
        release: bool,
    ) -> Result<()> {
        let run = &checkpoint.run_id;
        let job = CommitJob {
            run: run.clone(),
            transcript_from: checkpoint.transcript_from,
            transcript: checkpoint.transcript.clone(),
            status: checkpoint.status.clone(),
            token: lease.token,
            expected: expected_version,
            terminal: checkpoint.terminal,
            json: serde_json::to_string(checkpoint)
                .map_err(|e| corrupt(run, "encoding checkpoint", e))?,
            events: encode_events(run, events)?,
            release: release.then(|| lease.clone()),
        };
        self.write(|| format!("committing run {run}"), |r| Job::Commit(job, r))
            .await
    }
}

/// The write job of a create, checked: its events start the log, its transcript at 0.
fn create_job(
    checkpoint: &Checkpoint,
    events: &[EventRecord],
    client_key: Option<&str>,
) -> Result<CreateJob> {
    let run = &checkpoint.run_id;
    check_seq(run, 0, events.iter().map(|e| e.seq))?;
    if checkpoint.transcript_from != 0 {
        return Err(torn_transcript(run, checkpoint.transcript_from, 0));
    }
    Ok(CreateJob {
        run: run.clone(),
        transcript: checkpoint.transcript.clone(),
        tenant: checkpoint.tenant.clone(),
        agent: checkpoint.agent.clone(),
        status: checkpoint.status.clone(),
        terminal: checkpoint.terminal,
        json: serde_json::to_string(checkpoint)
            .map_err(|e| corrupt(run, "encoding checkpoint", e))?,
        events: encode_events(run, events)?,
        key: client_key.map(str::to_owned),
    })
}

#[async_trait]
impl CheckpointStore for FileStore {
    async fn create(
        &self,
        checkpoint: &Checkpoint,
        events: &[EventRecord],
        client_key: Option<&str>,
    ) -> Result<CreateOutcome> {
        let run = &checkpoint.run_id;
        let job = create_job(checkpoint, events, client_key)?;
        self.write(|| format!("creating run {run}"), |r| Job::Create(job, r))
            .await
    }

    async fn create_claimed(
        &self,
        checkpoint: &Checkpoint,
        events: &[EventRecord],
        client_key: Option<&str>,
        owner: &str,
        ttl: Duration,
    ) -> Result<(CreateOutcome, Option<Lease>)> {
        let run = &checkpoint.run_id;
        let job = create_job(checkpoint, events, client_key)?;
        let claim = ClaimJob {
            run: run.clone(),
            owner: owner.to_owned(),
            ttl,
        };
        self.write(
            || format!("creating run {run}"),
            |r| Job::CreateClaimed(job, claim, r),
        )
        .await
    }

    async fn transcript_entry(&self, run: &RunId, index: u64) -> Result<Option<String>> {
        let run = run.clone();
        self.blocking(move |inner| {
            let what = format!("reading transcript entry {index} of run {run}");
            let txn = inner.db.begin_read().map_err(|e| db_err(&what, e))?;
            let t = txn.open_table(TRANSCRIPT).map_err(|e| db_err(&what, e))?;
            // Entries are keyed from 1.
            let Some(key) = index.checked_add(1) else {
                return Ok(None);
            };
            Ok(t.get((run.as_str(), key))
                .map_err(|e| db_err(&what, e))?
                .map(|v| v.value().to_owned()))
        })
        .await
    }

    async fn load(&self, run: &RunId) -> Result<Option<Checkpoint>> {
        let run = run.clone();
        self.blocking(move |inner| {
            let what = format!("loading run {run}");
            let txn = inner.db.begin_read().map_err(|e| db_err(&what, e))?;
            let t = txn.open_table(RUNS).map_err(|e| db_err(&what, e))?;
            let json = t
                .get(run.as_str())
                .map_err(|e| db_err(&what, e))?
                .map(|v| v.value().to_owned());
            let Some(mut c) = json.map(|j| decode(&run, &j)).transpose()? else {
                return Ok(None);
            };
            // One read transaction: the record and its transcript agree.
            let t = txn.open_table(TRANSCRIPT).map_err(|e| db_err(&what, e))?;
            for entry in t
                .range((run.as_str(), 1)..=(run.as_str(), u64::MAX))
                .map_err(|e| db_err(&what, e))?
            {
                let (_, v) = entry.map_err(|e| db_err(&what, e))?;
                c.transcript.push(v.value().to_owned());
            }
            Ok(Some(c))
        })
        .await
    }

    async fn commit(
        &self,
        lease: &Lease,
        checkpoint: &Checkpoint,
        expected_version: u64,
        events: &[EventRecord],
    ) -> Result<()> {
        self.commit_maybe_final(lease, checkpoint, expected_version, events, false)
            .await
    }

    async fn commit_final(
        &self,
        lease: &Lease,
        checkpoint: &Checkpoint,
        expected_version: u64,
        events: &[EventRecord],
    ) -> Result<()> {
        self.commit_maybe_final(lease, checkpoint, expected_version, events, true)
            .await
    }

    async fn claim(&self, run: &RunId, owner: &str, ttl: Duration) -> Result<Lease> {
        let job = ClaimJob {
            run: run.clone(),
            owner: owner.to_owned(),
            ttl,
        };
        self.write(|| format!("claiming run {run}"), |r| Job::Claim(job, r))
            .await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let l = lease.clone();
        self.write(
            || format!("releasing run {}", lease.run_id),
            |r| Job::Release(l, r),
        )
        .await
    }

    async fn renew_leases(
        &self,
        owner: &str,
        leases: &[Lease],
        ttl: Duration,
    ) -> Result<Vec<RunId>> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let job = RenewJob {
            owner: owner.to_owned(),
            leases: leases.to_vec(),
            ttl,
        };
        self.write(
            || format!("renewing {} leases", leases.len()),
            |r| Job::Renew(job, r),
        )
        .await
    }

    async fn release_many(&self, leases: &[Lease], due_at_ms: Option<u64>) -> Result<()> {
        if leases.is_empty() {
            return Ok(());
        }
        let job = ReleaseManyJob {
            leases: leases.to_vec(),
            due: due_at_ms,
        };
        self.write(
            || format!("releasing {} leases", leases.len()),
            |r| Job::ReleaseMany(job, r),
        )
        .await
    }

    async fn set_due(&self, run: &RunId, at_ms: Option<u64>) -> Result<()> {
        let job = SetDueJob {
            runs: vec![run.clone()],
            due: at_ms,
        };
        self.write(
            || format!("setting the due time of run {run}"),
            |r| Job::SetDue(job, r),
        )
        .await
    }

    async fn due_runs(&self, now_ms: u64, limit: usize) -> Result<Vec<RunId>> {
        let (due, stale) = self
            .blocking(move |inner| {
                let what = "listing due runs";
                let txn = inner.db.begin_read().map_err(|e| db_err(what, e))?;
                let due = txn.open_table(DUE).map_err(|e| db_err(what, e))?;
                let active = txn.open_table(ACTIVE).map_err(|e| db_err(what, e))?;
                let (mut out, mut stale) = (Vec::new(), Vec::new());
                for entry in due
                    .range((0u64, "")..=(now_ms, "~"))
                    .map_err(|e| db_err(what, e))?
                {
                    if out.len() >= limit {
                        break;
                    }
                    let (k, _) = entry.map_err(|e| db_err(what, e))?;
                    let id = k.value().1;
                    let run: RunId = id
                        .parse()
                        .map_err(|e| Error::Corrupt(format!("due index holds {id:?}: {e}")))?;
                    // A run and its indexes change in one transaction, so a run that is not
                    // active is terminal or gone: its entry is stale.
                    if active.get(id).map_err(|e| db_err(what, e))?.is_some() {
                        out.push(run);
                    } else {
                        stale.push(run);
                    }
                }
                Ok((out, stale))
            })
            .await?;
        if !stale.is_empty() {
            let n = stale.len();
            let job = SetDueJob {
                runs: stale,
                due: None,
            };
            self.write(
                || format!("removing {n} stale due entries"),
                |r| Job::SetDue(job, r),
            )
            .await?;
        }
        Ok(due)
    }

    async fn lease_holder(&self, run: &RunId) -> Result<Option<String>> {
        let now = Instant::now();
        Ok(lock_leases(&self.inner.leases)
            .get(run)
            .filter(|l| l.expires > now)
            .map(|l| l.owner.clone()))
    }

    async fn register_node(&self, node_id: &str, instance: &str, ttl: Duration) -> Result<()> {
        self.inner.nodes.hold(node_id, instance, ttl)
    }

    async fn heartbeat_node(&self, node_id: &str, instance: &str, ttl: Duration) -> Result<()> {
        self.inner.nodes.hold(node_id, instance, ttl)
    }

    async fn unregister_node(&self, node_id: &str, instance: &str) -> Result<()> {
        self.inner.nodes.release(node_id, instance);
        Ok(())
    }

    async fn notify_node(&self, node_id: &str, run: &RunId) -> Result<()> {
        self.inner.wakeups.notify(node_id, run);
        Ok(())
    }

    async fn wakeups(
        &self,
        node_id: &str,
        cursor: &str,
        block: Duration,
    ) -> Result<(Vec<RunId>, String)> {
        self.inner.wakeups.read(node_id, cursor, block).await
    }

    async fn active_runs(&self) -> Result<Vec<RunId>> {
        self.blocking(|inner| {
            let what = "listing active runs";
            let txn = inner.db.begin_read().map_err(|e| db_err(what, e))?;
            let t = txn.open_table(ACTIVE).map_err(|e| db_err(what, e))?;
            let mut ids = Vec::with_capacity(t.len().unwrap_or(0) as usize);
            for entry in t.iter().map_err(|e| db_err(what, e))? {
                let (k, _) = entry.map_err(|e| db_err(what, e))?;
                let id = k.value();
                match id.parse::<RunId>() {
                    Ok(run) => ids.push(run),
                    // One bad entry must not stop the daemon's start: skip it, say so.
                    Err(e) => tracing::error!(entry = ?id, error = %e, "the active index holds an entry that is not a run id; skipping it"),
                }
            }
            Ok(ids)
        })
        .await
    }

    async fn list_runs(
        &self,
        tenant: &str,
        filter: &RunFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<RunPage> {
        let tenant = tenant.to_owned();
        let filter = filter.clone();
        let cursor = cursor.map(str::to_owned);
        self.blocking(move |inner| {
            let what = "listing runs";
            let txn = inner.db.begin_read().map_err(|e| db_err(what, e))?;
            let runs = txn.open_table(RUNS).map_err(|e| db_err(what, e))?;
            let t = tenant.as_str();
            // Run ids start with `run_`, so every one sorts below `~`.
            let upper = cursor.as_deref().unwrap_or("~");
            let mut items = Vec::new();
            let mut unreadable = Vec::new();
            // Reads one indexed run; `true` once the page (plus the one that says more follow)
            // is full.
            let mut visit = |id: &str| -> Result<bool> {
                let run: RunId = match id.parse() {
                    Ok(run) => run,
                    Err(e) => {
                        tracing::error!(entry = ?id, error = %e, "a listing index holds an entry that is not a run id; skipping it");
                        return Ok(false);
                    }
                };
                let Some(json) = runs
                    .get(id)
                    .map_err(|e| db_err(what, e))?
                    .map(|v| v.value().to_owned())
                else {
                    return Ok(false);
                };
                match decode(&run, &json) {
                    Ok(c) => {
                        let keep = c.tenant == tenant
                            && filter.status.as_ref().is_none_or(|s| &c.status == s)
                            && filter.agent.as_ref().is_none_or(|a| &c.agent == a);
                        if keep {
                            items.push(c);
                        }
                    }
                    Err(e) => unreadable.push((run, e.to_string())),
                }
                Ok(items.len() > limit)
            };
            // The narrowest index the filter allows: by status (checking the agent on the
            // way), by agent, or every run of the tenant.
            if let Some(status) = &filter.status {
                let index = txn
                    .open_table(TENANT_STATUS_RUNS)
                    .map_err(|e| db_err(what, e))?;
                let s = status.as_str();
                for entry in index
                    .range((t, s, "")..(t, s, upper))
                    .map_err(|e| db_err(what, e))?
                    .rev()
                {
                    let (k, _) = entry.map_err(|e| db_err(what, e))?;
                    if visit(k.value().2)? {
                        break;
                    }
                }
            } else if let Some(agent) = &filter.agent {
                let index = txn
                    .open_table(TENANT_AGENT_RUNS)
                    .map_err(|e| db_err(what, e))?;
                let a = agent.as_str();
                for entry in index
                    .range((t, a, "")..(t, a, upper))
                    .map_err(|e| db_err(what, e))?
                    .rev()
                {
                    let (k, _) = entry.map_err(|e| db_err(what, e))?;
                    if visit(k.value().2)? {
                        break;
                    }
                }
            } else {
                let index = txn.open_table(TENANT_RUNS).map_err(|e| db_err(what, e))?;
                for entry in index
                    .range((t, "")..(t, upper))
                    .map_err(|e| db_err(what, e))?
                    .rev()
                {
                    let (k, _) = entry.map_err(|e| db_err(what, e))?;
                    if visit(k.value().1)? {
                        break;
                    }
                }
            }
            let mut page = RunPage::from_newest_first(items, limit);
            page.unreadable = unreadable;
            Ok(page)
        })
        .await
    }

    async fn push_control(&self, run: &RunId, control: &Control) -> Result<u64> {
        let json = serde_json::to_string(&StoredControl {
            at_ms: now_ms(),
            control: control.clone(),
        })
        .map_err(|e| corrupt(run, "encoding control", e))?;
        let job = PushControlJob {
            run: run.clone(),
            json,
        };
        self.write(
            || format!("storing a control for run {run}"),
            |r| Job::PushControl(job, r),
        )
        .await
    }

    async fn controls(&self, run: &RunId, after: u64) -> Result<Vec<ControlRecord>> {
        let run = run.clone();
        self.blocking(move |inner| {
            let what = format!("reading controls of run {run}");
            let txn = inner.db.begin_read().map_err(|e| db_err(&what, e))?;
            let t = txn.open_table(CONTROLS).map_err(|e| db_err(&what, e))?;
            let mut out = Vec::new();
            let start = after.saturating_add(1);
            for entry in t
                .range((run.as_str(), start)..=(run.as_str(), u64::MAX))
                .map_err(|e| db_err(&what, e))?
            {
                let (k, v) = entry.map_err(|e| db_err(&what, e))?;
                let s: StoredControl = serde_json::from_str(v.value())
                    .map_err(|e| corrupt(&run, "decoding control", e))?;
                out.push(ControlRecord {
                    seq: k.value().1,
                    at_ms: s.at_ms,
                    control: s.control,
                });
            }
            Ok(out)
        })
        .await
    }

    async fn ping(&self) -> Result<()> {
        if self.inner.queue.is_closed() {
            return Err(Error::Unavailable(
                "file store: the writer thread has stopped".to_owned(),
            ));
        }
        self.blocking(|inner| {
            inner
                .db
                .begin_read()
                .map(|_| ())
                .map_err(|e| db_err("ping", e))
        })
        .await
    }

    async fn epoch(&self) -> Result<String> {
        self.blocking(|inner| {
            let txn = inner
                .db
                .begin_read()
                .map_err(|e| db_err("reading epoch", e))?;
            let t = txn
                .open_table(META)
                .map_err(|e| db_err("reading epoch", e))?;
            let v = t
                .get("epoch")
                .map_err(|e| db_err("reading epoch", e))?
                .map(|v| v.value().to_owned());
            v.ok_or_else(|| Error::Corrupt("file store has no epoch marker".to_owned()))
        })
        .await
    }
}

#[async_trait]
impl EventLog for FileStore {
    async fn read(&self, run: &RunId, after: u64, limit: usize) -> Result<Vec<EventRecord>> {
        let run = run.clone();
        self.blocking(move |inner| {
            let what = format!("reading events of run {run}");
            let txn = inner.db.begin_read().map_err(|e| db_err(&what, e))?;
            let t = txn.open_table(EVENTS).map_err(|e| db_err(&what, e))?;
            let mut out = Vec::new();
            let start = after.saturating_add(1);
            for entry in t
                .range((run.as_str(), start)..=(run.as_str(), u64::MAX))
                .map_err(|e| db_err(&what, e))?
                .take(limit)
            {
                let (_, v) = entry.map_err(|e| db_err(&what, e))?;
                out.push(
                    serde_json::from_str(v.value())
                        .map_err(|e| corrupt(&run, "decoding event", e))?,
                );
            }
            Ok(out)
        })
        .await
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn checkpoint(run: &RunId, status: &str, agent: &str) -> Checkpoint {
        Checkpoint {
            run_id: run.clone(),
            tenant: "acme".into(),
            agent: agent.into(),
            status: status.into(),
            terminal: status == "succeeded",
            version: 1,
            created_at_ms: 1,
            updated_at_ms: 1,
            body: "{}".into(),
            transcript: Vec::new(),
            transcript_from: 0,
        }
    }

    fn created(seq: u64) -> EventRecord {
        EventRecord {
            seq,
            at_ms: 1,
            kind: "run_created".into(),
            data: serde_json::json!({}),
        }
    }

    /// A store written before the listing indexes existed (no index tables, no marker) gets
    /// them at its next open, and a record that does not decode stays out of them (the
    /// unfiltered listing reports it, the filtered ones never read it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn listing_indexes_are_built_for_an_older_store() {
        let dir = tempfile::tempdir().unwrap();
        let mut runs: Vec<RunId> = (0..4).map(|_| RunId::generate()).collect();
        runs.sort();
        {
            let s = FileStore::open(dir.path()).await.unwrap();
            for (i, r) in runs.iter().enumerate() {
                let status = if i == 0 { "succeeded" } else { "waiting_input" };
                let agent = if i == 3 { "triage" } else { "demo" };
                s.create(&checkpoint(r, status, agent), &[created(1)], None)
                    .await
                    .unwrap();
            }
        }
        {
            // Back to the earlier layout, and one unreadable record.
            let db = Database::create(dir.path().join(FILE_NAME)).unwrap();
            let txn = db.begin_write().unwrap();
            txn.delete_table(TENANT_STATUS_RUNS).unwrap();
            txn.delete_table(TENANT_AGENT_RUNS).unwrap();
            txn.open_table(META)
                .unwrap()
                .remove(LIST_INDEX_MARK)
                .unwrap();
            txn.open_table(RUNS)
                .unwrap()
                .insert(runs[0].as_str(), "{not json")
                .unwrap();
            txn.commit().unwrap();
        }
        let s = FileStore::open(dir.path()).await.unwrap();
        let waiting = RunFilter {
            status: Some("waiting_input".into()),
            agent: None,
        };
        let page = s.list_runs("acme", &waiting, None, 10).await.unwrap();
        let ids: Vec<&RunId> = page.items.iter().map(|c| &c.run_id).collect();
        assert_eq!(ids, vec![&runs[3], &runs[2], &runs[1]]);
        assert!(page.unreadable.is_empty());
        let triage = RunFilter {
            status: None,
            agent: Some("triage".into()),
        };
        let page = s.list_runs("acme", &triage, None, 10).await.unwrap();
        assert_eq!(page.items.len(), 1);
        assert_eq!(page.items[0].run_id, runs[3]);
        let all = s
            .list_runs("acme", &RunFilter::default(), None, 10)
            .await
            .unwrap();
        assert_eq!(all.items.len(), 3);
        assert_eq!(all.unreadable.len(), 1);
        assert_eq!(all.unreadable[0].0, runs[0]);
    }
}
