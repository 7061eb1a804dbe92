//! `FileStore`: the embedded single-machine store on redb (one file, `<dir>/agentd.redb`), the
//! default when no Redis URL is given. Every operation is one redb transaction run on the
//! blocking pool; redb's single serializable writer makes the version CAS plain code.
//!
//! Lease tokens and fences are durable (tokens never go back, even across restarts); lease
//! liveness (owner + expiry) is kept in memory on the monotonic clock, because the database
//! file is locked by one process, so leases of a previous process are void by construction.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redb::{
    Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
    WriteTransaction,
};
use serde::{Deserialize, Serialize};

use super::{
    Checkpoint, CheckpointStore, Control, ControlRecord, CreateOutcome, Error, EventLog,
    EventRecord, Lease, Result, RunFilter, RunPage,
};
use crate::clock::now_ms;
use crate::ids::RunId;

/// File name inside the store directory.
pub const FILE_NAME: &str = "agentd.redb";

/// run id → checkpoint JSON.
const RUNS: TableDefinition<&str, &str> = TableDefinition::new("runs");
/// (run id, seq) → event JSON.
const EVENTS: TableDefinition<(&str, u64), &str> = TableDefinition::new("events");
/// (run id, seq) → stored control JSON.
const CONTROLS: TableDefinition<(&str, u64), &str> = TableDefinition::new("controls");
/// run id → (current fence token or 0, last issued token).
const TOKENS: TableDefinition<&str, (u64, u64)> = TableDefinition::new("tokens");
/// run id → () for runs not yet terminal.
const ACTIVE: TableDefinition<&str, ()> = TableDefinition::new("active");
/// (tenant, run id) → () for listing.
const TENANT_RUNS: TableDefinition<(&str, &str), ()> = TableDefinition::new("tenant_runs");
/// (tenant, client key) → run id.
const CLIENT_KEYS: TableDefinition<(&str, &str), &str> = TableDefinition::new("client_keys");
/// Store metadata (`epoch`).
const META: TableDefinition<&str, &str> = TableDefinition::new("meta");

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

struct Inner {
    db: Database,
    leases: Mutex<HashMap<RunId, LiveLease>>,
    path: PathBuf,
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

fn corrupt(run: &RunId, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Corrupt(format!("run {run}: {what}: {e}"))
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

fn check_seq(run: &RunId, last: u64, events: &[EventRecord]) -> Result<()> {
    for (i, e) in events.iter().enumerate() {
        if e.seq != last + 1 + i as u64 {
            return Err(Error::SequenceGap {
                run: run.clone(),
                seq: e.seq,
            });
        }
    }
    Ok(())
}

fn append_events(txn: &WriteTransaction, run: &RunId, events: &[EventRecord]) -> Result<()> {
    let mut t = txn
        .open_table(EVENTS)
        .map_err(|e| db_err("opening events", e))?;
    for e in events {
        let json = serde_json::to_string(e).map_err(|err| corrupt(run, "encoding event", err))?;
        t.insert((run.as_str(), e.seq), json.as_str())
            .map_err(|err| db_err("appending an event", err))?;
    }
    Ok(())
}

fn set_active(txn: &WriteTransaction, c: &Checkpoint) -> Result<()> {
    let mut t = txn
        .open_table(ACTIVE)
        .map_err(|e| db_err("opening the active index", e))?;
    if c.terminal {
        t.remove(c.run_id.as_str())
            .map_err(|e| db_err("updating the active index", e))?;
    } else {
        t.insert(c.run_id.as_str(), ())
            .map_err(|e| db_err("updating the active index", e))?;
    }
    Ok(())
}

fn decode(run: &RunId, json: &str) -> Result<Checkpoint> {
    serde_json::from_str(json).map_err(|e| corrupt(run, "decoding checkpoint", e))
}

impl FileStore {
    /// Opens (or creates) `<dir>/agentd.redb`, creating `dir` if needed.
    pub async fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        tokio::task::spawn_blocking(move || Self::open_blocking(&dir))
            .await
            .map_err(|e| db_err("opening", e))?
    }

    fn open_blocking(dir: &Path) -> Result<Self> {
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
            txn.open_table(CONTROLS).map_err(init)?;
            txn.open_table(TOKENS).map_err(init)?;
            txn.open_table(ACTIVE).map_err(init)?;
            txn.open_table(TENANT_RUNS).map_err(init)?;
            txn.open_table(CLIENT_KEYS).map_err(init)?;
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
        Ok(FileStore {
            inner: Arc::new(Inner {
                db,
                leases: Mutex::new(HashMap::new()),
                path,
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
}

impl Inner {
    fn leases(&self) -> std::sync::MutexGuard<'_, HashMap<RunId, LiveLease>> {
        // A poisoned map only means a panic elsewhere mid-update of a plain map; keep going.
        self.leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[async_trait]
impl CheckpointStore for FileStore {
    async fn create(
        &self,
        checkpoint: &Checkpoint,
        events: &[EventRecord],
        client_key: Option<&str>,
    ) -> Result<CreateOutcome> {
        let c = checkpoint.clone();
        let events = events.to_vec();
        let key = client_key.map(str::to_owned);
        self.blocking(move |inner| {
            let run = &c.run_id;
            check_seq(run, 0, &events)?;
            let json =
                serde_json::to_string(&c).map_err(|e| corrupt(run, "encoding checkpoint", e))?;
            let what = format!("creating run {run}");
            let txn = inner.db.begin_write().map_err(|e| db_err(&what, e))?;
            {
                let mut keys = txn.open_table(CLIENT_KEYS).map_err(|e| db_err(&what, e))?;
                if let Some(k) = &key {
                    let existing = keys
                        .get((c.tenant.as_str(), k.as_str()))
                        .map_err(|e| db_err(&what, e))?
                        .map(|v| v.value().to_owned());
                    if let Some(id) = existing {
                        let id = id
                            .parse()
                            .map_err(|e| corrupt(run, "client key maps to a bad run id", e))?;
                        return Ok(CreateOutcome::Existing(id));
                    }
                    keys.insert((c.tenant.as_str(), k.as_str()), run.as_str())
                        .map_err(|e| db_err(&what, e))?;
                }
                let mut runs = txn.open_table(RUNS).map_err(|e| db_err(&what, e))?;
                let found = runs
                    .get(run.as_str())
                    .map_err(|e| db_err(&what, e))?
                    .map(|v| v.value().to_owned());
                if let Some(found) = found {
                    if found == json {
                        // A retry of an applied create (reply lost).
                        return Ok(CreateOutcome::Created);
                    }
                    return Err(Error::VersionConflict {
                        run: run.clone(),
                        expected: 0,
                        found: decode(run, &found)?.version,
                    });
                }
                runs.insert(run.as_str(), json.as_str())
                    .map_err(|e| db_err(&what, e))?;
                txn.open_table(TENANT_RUNS)
                    .map_err(|e| db_err(&what, e))?
                    .insert((c.tenant.as_str(), run.as_str()), ())
                    .map_err(|e| db_err(&what, e))?;
            }
            append_events(&txn, run, &events)?;
            set_active(&txn, &c)?;
            txn.commit().map_err(|e| db_err(&what, e))?;
            Ok(CreateOutcome::Created)
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
            json.map(|j| decode(&run, &j)).transpose()
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
        let c = checkpoint.clone();
        let events = events.to_vec();
        let token = lease.token;
        self.blocking(move |inner| {
            let run = &c.run_id;
            let what = format!("committing run {run}");
            let json =
                serde_json::to_string(&c).map_err(|e| corrupt(run, "encoding checkpoint", e))?;
            let txn = inner.db.begin_write().map_err(|e| db_err(&what, e))?;
            {
                let mut runs = txn.open_table(RUNS).map_err(|e| db_err(&what, e))?;
                let stored = runs
                    .get(run.as_str())
                    .map_err(|e| db_err(&what, e))?
                    .map(|v| v.value().to_owned())
                    .ok_or_else(|| Error::NotFound(run.clone()))?;
                let fence = txn
                    .open_table(TOKENS)
                    .map_err(|e| db_err(&what, e))?
                    .get(run.as_str())
                    .map_err(|e| db_err(&what, e))?
                    .map_or(0, |v| v.value().0);
                if fence == 0 || fence != token {
                    return Err(Error::Fenced {
                        run: run.clone(),
                        token,
                    });
                }
                let last = last_seq(&txn.open_table(EVENTS).map_err(|e| db_err(&what, e))?, run)?;
                let found = decode(run, &stored)?.version;
                if found != expected_version {
                    let replay = stored == json && events.last().is_none_or(|e| e.seq == last);
                    if replay {
                        return Ok(());
                    }
                    return Err(Error::VersionConflict {
                        run: run.clone(),
                        expected: expected_version,
                        found,
                    });
                }
                check_seq(run, last, &events)?;
                runs.insert(run.as_str(), json.as_str())
                    .map_err(|e| db_err(&what, e))?;
            }
            append_events(&txn, run, &events)?;
            set_active(&txn, &c)?;
            txn.commit().map_err(|e| db_err(&what, e))?;
            Ok(())
        })
        .await
    }

    async fn claim(&self, run: &RunId, owner: &str, ttl: Duration) -> Result<Lease> {
        let run = run.clone();
        let owner = owner.to_owned();
        self.blocking(move |inner| {
            let what = format!("claiming run {run}");
            // Held across the transaction so claims of one process are serialised with the
            // in-memory liveness map.
            let mut leases = inner.leases();
            let now = Instant::now();
            if let Some(l) = leases.get(&run) {
                // The same owner claiming again is a new incarnation: it gets a new token too.
                if l.owner != owner && l.expires > now {
                    return Err(Error::LeaseHeld {
                        run: run.clone(),
                        owner: l.owner.clone(),
                    });
                }
            }
            let txn = inner.db.begin_write().map_err(|e| db_err(&what, e))?;
            let token = {
                let exists = txn
                    .open_table(RUNS)
                    .map_err(|e| db_err(&what, e))?
                    .get(run.as_str())
                    .map_err(|e| db_err(&what, e))?
                    .is_some();
                if !exists {
                    return Err(Error::NotFound(run.clone()));
                }
                let mut tokens = txn.open_table(TOKENS).map_err(|e| db_err(&what, e))?;
                let last = tokens
                    .get(run.as_str())
                    .map_err(|e| db_err(&what, e))?
                    .map_or(0, |v| v.value().1);
                let token = last + 1;
                tokens
                    .insert(run.as_str(), (token, token))
                    .map_err(|e| db_err(&what, e))?;
                token
            };
            txn.commit().map_err(|e| db_err(&what, e))?;
            leases.insert(
                run.clone(),
                LiveLease {
                    owner: owner.clone(),
                    token,
                    expires: now + ttl,
                },
            );
            Ok(Lease {
                run_id: run,
                owner,
                token,
            })
        })
        .await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let lease = lease.clone();
        self.blocking(move |inner| {
            let run = &lease.run_id;
            let what = format!("releasing run {run}");
            let mut leases = inner.leases();
            let txn = inner.db.begin_write().map_err(|e| db_err(&what, e))?;
            {
                let mut tokens = txn.open_table(TOKENS).map_err(|e| db_err(&what, e))?;
                let cur = tokens
                    .get(run.as_str())
                    .map_err(|e| db_err(&what, e))?
                    .map(|v| v.value());
                match cur {
                    Some((fence, last)) if fence == lease.token => {
                        tokens
                            .insert(run.as_str(), (0, last))
                            .map_err(|e| db_err(&what, e))?;
                    }
                    _ => return Ok(()),
                }
            }
            txn.commit().map_err(|e| db_err(&what, e))?;
            if leases.get(run).is_some_and(|l| l.token == lease.token) {
                leases.remove(run);
            }
            Ok(())
        })
        .await
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
                ids.push(
                    id.parse::<RunId>()
                        .map_err(|e| Error::Corrupt(format!("active index holds {id:?}: {e}")))?,
                );
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
            let index = txn.open_table(TENANT_RUNS).map_err(|e| db_err(what, e))?;
            let runs = txn.open_table(RUNS).map_err(|e| db_err(what, e))?;
            let lower = (tenant.as_str(), "");
            let range = match &cursor {
                Some(c) => index.range(lower..(tenant.as_str(), c.as_str())),
                // Run ids start with `run_`, so every one sorts below `~`.
                None => index.range(lower..(tenant.as_str(), "~")),
            }
            .map_err(|e| db_err(what, e))?;
            let mut items = Vec::new();
            for entry in range.rev() {
                let (k, _) = entry.map_err(|e| db_err(what, e))?;
                let id = k.value().1.to_owned();
                let run: RunId = id
                    .parse()
                    .map_err(|e| Error::Corrupt(format!("tenant index holds {id:?}: {e}")))?;
                let Some(json) = runs
                    .get(id.as_str())
                    .map_err(|e| db_err(what, e))?
                    .map(|v| v.value().to_owned())
                else {
                    continue;
                };
                let c = decode(&run, &json)?;
                let keep = c.tenant == tenant
                    && filter.status.as_ref().is_none_or(|s| &c.status == s)
                    && filter.agent.as_ref().is_none_or(|a| &c.agent == a);
                if keep {
                    items.push(c);
                    if items.len() > limit {
                        break;
                    }
                }
            }
            let more = items.len() > limit;
            items.truncate(limit);
            let next_cursor = if more {
                items.last().map(|c| c.run_id.to_string())
            } else {
                None
            };
            Ok(RunPage { items, next_cursor })
        })
        .await
    }

    async fn push_control(&self, run: &RunId, control: &Control) -> Result<u64> {
        let run = run.clone();
        let json = serde_json::to_string(&StoredControl {
            at_ms: now_ms(),
            control: control.clone(),
        })
        .map_err(|e| corrupt(&run, "encoding control", e))?;
        self.blocking(move |inner| {
            let what = format!("storing a control for run {run}");
            let txn = inner.db.begin_write().map_err(|e| db_err(&what, e))?;
            let seq = {
                let exists = txn
                    .open_table(RUNS)
                    .map_err(|e| db_err(&what, e))?
                    .get(run.as_str())
                    .map_err(|e| db_err(&what, e))?
                    .is_some();
                if !exists {
                    return Err(Error::NotFound(run.clone()));
                }
                let mut t = txn.open_table(CONTROLS).map_err(|e| db_err(&what, e))?;
                let seq = last_seq(&t, &run)? + 1;
                t.insert((run.as_str(), seq), json.as_str())
                    .map_err(|e| db_err(&what, e))?;
                seq
            };
            txn.commit().map_err(|e| db_err(&what, e))?;
            Ok(seq)
        })
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
