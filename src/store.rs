//! The persistence boundary: `CheckpointStore` (run checkpoints, leases, control inbox, indexes)
//! and `EventLog` (each run's append-only, gap-free event sequence), their stored record types,
//! and `store::Error`.
//!
//! Architecture invariant: a state change and the event that records it are committed together
//! by `CheckpointStore::commit`, as one compare-and-set on the run's version, fenced by the
//! writer's lease. No other write path exists for a live run.

pub mod file;
pub mod keys;
mod local;
pub mod memory;
pub mod redis;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::{CallId, RunId};

/// One entry of a run's event log. `seq` starts at 1 and has no gaps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventRecord {
    /// Position in the run's log, from 1 and gap-free.
    pub seq: u64,
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// snake_case event type, e.g. `run_created`, `tool_call_started`, `run_succeeded`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The event's own fields as JSON (what they are depends on `kind`).
    pub data: Value,
}

/// The stored form of a run: indexed fields the store needs, plus the opaque serialized
/// `RunState` in `body`. `version` equals the seq of the last event committed with it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The run this record is for.
    pub run_id: RunId,
    /// Tenant that owns the run, for the tenant's listing and its indexes.
    pub tenant: String,
    /// Name of the configured agent the run uses, for the per-agent listing index.
    pub agent: String,
    /// The public status (`created`, `running`, …), for listing and the active index.
    pub status: String,
    /// Whether `status` is final; a terminal commit takes the run out of the active and due
    /// indexes.
    pub terminal: bool,
    /// Seq of the last event committed with this record; the next commit expects it.
    pub version: u64,
    /// When the run was created, ms since the Unix epoch.
    pub created_at_ms: u64,
    /// When the last transition was applied, ms since the Unix epoch.
    pub updated_at_ms: u64,
    /// JSON of `run::RunState` without its transcript (format 3; earlier formats hold the
    /// transcript inline).
    pub body: String,
    /// Transcript entries (one message's JSON each), stored append-only beside the record,
    /// never inside it. On a create or commit: the entries to append, the first at index
    /// `transcript_from`, which must be the number the store holds (a mismatch is a torn
    /// record, refused as corrupt). On a load: the whole transcript (`transcript_from` 0). In
    /// a listing: empty.
    #[serde(skip)]
    pub transcript: Vec<String>,
    /// Index in the stored transcript of the first entry of `transcript`.
    #[serde(skip)]
    pub transcript_from: u64,
}

/// A commit or create that does not continue the stored transcript where it ends.
pub(crate) fn torn_transcript(run: &RunId, from: u64, stored: u64) -> Error {
    Error::Corrupt(format!(
        "run {run}: the write continues the transcript at entry {from} but the store holds {stored}"
    ))
}

/// Proof of ownership of one run. `token` grows each time the run changes owner, so a writer
/// holding an older token is fenced out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The run leased.
    pub run_id: RunId,
    /// Node id of the holder.
    pub owner: String,
    /// Fencing token, checked by every commit of the holder.
    pub token: u64,
}

/// A control message from a client, stored before it is delivered so a crash cannot lose it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Control {
    /// Cancel the run.
    Cancel {
        /// Why, as the client gave it; recorded in the event.
        #[serde(default)]
        reason: Option<String>,
    },
    /// Approve a call waiting for a decision: it is sent (again).
    Approve {
        /// The call decided on.
        call_id: CallId,
        /// Edited arguments; validated again before use.
        #[serde(default)]
        arguments: Option<Value>,
        /// The configured name of the token that decided (never the token).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        by: Option<String>,
    },
    /// Reject a call waiting for a decision: it is not sent, and the model is told.
    Reject {
        /// The call decided on.
        call_id: CallId,
        /// Why; the model gets it in the refusal.
        #[serde(default)]
        reason: Option<String>,
        /// The configured name of the token that decided (never the token).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        by: Option<String>,
    },
    /// Operator input: the answer to a pending question, or else queued for the next turn.
    Input {
        /// The text, given to the model as a user message.
        text: String,
    },
    /// A long-running tool's result for one call, sent through the callback route (its
    /// per-call token was checked before the entry was stored; the token is not stored).
    CallResult {
        /// The call the result is for.
        call_id: CallId,
        /// The tool's result as the callback delivered it.
        result: crate::tool::ToolResult,
    },
    /// An operator's decision `fail` on a call waiting for one: end the run `failed`.
    Fail {
        /// The call waiting for an operator.
        call_id: CallId,
        /// Why; appended to the run's error message.
        #[serde(default)]
        reason: Option<String>,
        /// The configured name of the token that decided (never the token).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        by: Option<String>,
    },
}

/// A stored control message with its position in the run's inbox (from 1, gap-free).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControlRecord {
    /// Position in the run's inbox, from 1 and gap-free.
    pub seq: u64,
    /// When the store took the message, ms since the Unix epoch.
    pub at_ms: u64,
    /// The message itself.
    pub control: Control,
}

/// Result of creating a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CreateOutcome {
    /// The run was stored (also when this create is a retry of one that was applied).
    Created,
    /// The tenant already created a run with this client idempotency key.
    Existing(RunId),
}

/// Filters for listing a tenant's runs.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    /// Only runs with this public status (`running`, `succeeded`, …); `None`: any.
    pub status: Option<String>,
    /// Only runs of this agent; `None`: any.
    pub agent: Option<String>,
}

/// One page of runs, newest first; `next_cursor` continues after the last item.
#[derive(Debug, Clone, Default)]
pub struct RunPage {
    /// The runs of this page, newest first, at most the asked limit.
    pub items: Vec<Checkpoint>,
    /// Id of the page's last run, to pass as `cursor` for the next page; `None`: no more.
    pub next_cursor: Option<String>,
    /// Runs the listing met whose stored record does not decode, with why: left out of
    /// `items` (the rest of the page is served) for the caller to quarantine.
    pub unreadable: Vec<(RunId, String)>,
}

impl RunPage {
    /// A page from items already sorted newest first, holding up to `limit + 1` of them: the
    /// extra one only says that another page follows.
    pub fn from_newest_first(mut items: Vec<Checkpoint>, limit: usize) -> Self {
        let more = items.len() > limit;
        items.truncate(limit);
        let next_cursor = if more {
            items.last().map(|c| c.run_id.to_string())
        } else {
            None
        };
        RunPage {
            items,
            next_cursor,
            unreadable: Vec::new(),
        }
    }
}

/// Checks that event seqs continue a log whose last seq is `last`, without gaps.
pub fn check_seq(run: &RunId, last: u64, seqs: impl IntoIterator<Item = u64>) -> Result<()> {
    for (i, seq) in seqs.into_iter().enumerate() {
        if seq != last + 1 + i as u64 {
            return Err(Error::SequenceGap {
                run: run.clone(),
                seq,
            });
        }
    }
    Ok(())
}

/// A `Corrupt` error naming the run and what was being done.
pub(crate) fn corrupt(run: &RunId, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Corrupt(format!("run {run}: {what}: {e}"))
}

/// Events as (seq, JSON), as the file and Redis stores write them.
pub(crate) fn encode_events(run: &RunId, events: &[EventRecord]) -> Result<Vec<(u64, String)>> {
    events
        .iter()
        .map(|e| {
            serde_json::to_string(e)
                .map(|json| (e.seq, json))
                .map_err(|err| corrupt(run, "encoding event", err))
        })
        .collect()
}

/// Store failures. Every variant says what happened to the write: conflicts and fencing mean
/// it was not applied; `Unavailable` means it may or may not have been.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// No run with this id is stored.
    #[error("run {0} not found")]
    NotFound(RunId),
    /// The stored version is not the one the write expected; nothing was written.
    #[error("run {run}: version conflict (expected {expected}, found {found})")]
    VersionConflict {
        /// The run written.
        run: RunId,
        /// The version the write expected.
        expected: u64,
        /// The version stored (0 when no checkpoint is).
        found: u64,
    },
    /// The write's lease token is no longer current (the run was claimed again since, or the
    /// lease released); nothing was written.
    #[error("run {run}: lease token {token} is no longer current")]
    Fenced {
        /// The run written.
        run: RunId,
        /// The stale token the write carried.
        token: u64,
    },
    /// Another owner holds a live lease on the run.
    #[error("run {run}: leased by {owner}")]
    LeaseHeld {
        /// The run asked for.
        run: RunId,
        /// Node id of the holder.
        owner: String,
    },
    /// The events written do not continue the log's seq without a gap; nothing was written.
    #[error("run {run}: event seq {seq} does not follow the log")]
    SequenceGap {
        /// The run written.
        run: RunId,
        /// The first seq that does not follow.
        seq: u64,
    },
    /// The store could not be reached or answered with a transient fault (also: a store URL
    /// `open` cannot use); a write may or may not have been applied. The only retryable one.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// Stored data does not decode, or a write does not fit what is stored (e.g. a torn
    /// transcript).
    #[error("store data is corrupt: {0}")]
    Corrupt(String),
    /// Another live process holds the node id asked for.
    #[error("node id {node} is held by another live process")]
    NodeIdInUse {
        /// The node id asked for.
        node: String,
        /// The holder's instance string (as it registered), so a starting process can tell a
        /// dead holder on its own host from a live one.
        holder: String,
    },
}

impl Error {
    /// Whether retrying the same operation later may succeed: true for every transient fault
    /// (refused, reset, timeout, and Redis `LOADING`, `BUSY`, `TRYAGAIN`, `CLUSTERDOWN`,
    /// `MASTERDOWN`, redirections), which the stores all report as `Unavailable`. Conflicts,
    /// fencing, `NotFound`, `Corrupt` and `NodeIdInUse` are answers, not faults.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::Unavailable(_))
    }

    /// Stable snake_case code for logs and metrics.
    pub fn code(&self) -> &'static str {
        match self {
            Error::NotFound(_) => "not_found",
            Error::VersionConflict { .. } => "version_conflict",
            Error::Fenced { .. } => "fenced",
            Error::LeaseHeld { .. } => "lease_held",
            Error::SequenceGap { .. } => "sequence_gap",
            Error::Unavailable(_) => "store_unavailable",
            Error::Corrupt(_) => "store_corrupt",
            Error::NodeIdInUse { .. } => "node_id_in_use",
        }
    }
}

/// How long an index entry for a run whose checkpoint does not exist is given for its create
/// to land (indexes are written before the checkpoint); older such entries are dangling (the
/// creator crashed in between) and are removed when read.
pub const DANGLING_AFTER: Duration = Duration::from_secs(60);

/// The creation time (ms since the Unix epoch) a run id carries in its UUIDv7, if any.
pub(crate) fn run_created_ms(run: &RunId) -> Option<u64> {
    let hex = run.as_str().strip_prefix("run_")?;
    u64::from_str_radix(hex.get(..12)?, 16).ok()
}

/// Whether an index entry for `run`, whose checkpoint is missing, is dangling (see
/// [`DANGLING_AFTER`]) rather than a create in flight.
pub(crate) fn is_dangling(run: &RunId, now_ms: u64) -> bool {
    run_created_ms(run).is_none_or(|t| now_ms.saturating_sub(t) > DANGLING_AFTER.as_millis() as u64)
}

/// Wall-clock ms `ttl` from now: due times are wall clock so that every node agrees on them.
pub(crate) fn due_in(ttl: Duration) -> u64 {
    crate::clock::now_ms().saturating_add(ttl.as_millis() as u64)
}

/// Result of a store operation.
pub type Result<T> = std::result::Result<T, Error>;

/// Run checkpoints, leases, control inbox and indexes.
#[async_trait]
pub trait CheckpointStore: Send + Sync + 'static {
    /// Stores a new run with its first events. With `client_key`, a second create by the same
    /// tenant with the same key returns `Existing` and writes nothing.
    ///
    /// The key is recorded first (the stores cannot write it atomically with the checkpoint
    /// on Redis Cluster), so `Existing(id)` may name a run whose checkpoint does not exist
    /// yet: its creator crashed in between. The caller then creates that run itself with the
    /// id given (a `create` of run `id` with the same key is accepted and writes the
    /// checkpoint) and starts it. A create of the run the key already maps to is a retry and
    /// proceeds like one.
    async fn create(
        &self,
        checkpoint: &Checkpoint,
        events: &[EventRecord],
        client_key: Option<&str>,
    ) -> Result<CreateOutcome>;

    /// `create`, and when it stored the run (`Created`), the run's first lease for `owner`
    /// as `claim` would take it (its due time set to now + `ttl` too), so that the creating
    /// node owns its new run without a second write. `None` for the lease when the create was
    /// a retry of one already applied, or the claim did not land: the caller then claims as
    /// any node would. (This default creates, then claims; the stores do both in one write.)
    async fn create_claimed(
        &self,
        checkpoint: &Checkpoint,
        events: &[EventRecord],
        client_key: Option<&str>,
        owner: &str,
        ttl: Duration,
    ) -> Result<(CreateOutcome, Option<Lease>)> {
        let outcome = self.create(checkpoint, events, client_key).await?;
        if outcome != CreateOutcome::Created {
            return Ok((outcome, None));
        }
        let lease = self.claim(&checkpoint.run_id, owner, ttl).await.ok();
        Ok((outcome, lease))
    }

    /// The run's checkpoint, its whole transcript included; `None` if no such run is stored.
    async fn load(&self, run: &RunId) -> Result<Option<Checkpoint>>;

    /// One entry of the run's stored transcript, by its index (from 0): a stored value read
    /// by reference, e.g. the whole of a tool output the run keeps only in part. `None` if
    /// the run or the entry is not stored. (This default reads the whole run; the stores
    /// read the one entry.)
    async fn transcript_entry(&self, run: &RunId, index: u64) -> Result<Option<String>> {
        let usize_index = usize::try_from(index).unwrap_or(usize::MAX);
        Ok(self.load(run).await?.and_then(|mut c| {
            (usize_index < c.transcript.len()).then(|| c.transcript.swap_remove(usize_index))
        }))
    }

    /// Atomically: checks the stored version is `expected_version` and `lease` is current,
    /// replaces the checkpoint, appends `events` (which must continue the log's seq), and keeps
    /// the active index (a terminal checkpoint leaves it, and leaves the due index).
    async fn commit(
        &self,
        lease: &Lease,
        checkpoint: &Checkpoint,
        expected_version: u64,
        events: &[EventRecord],
    ) -> Result<()>;

    /// `commit` of a terminal checkpoint that also gives the lease up, in the same write (a
    /// run that ends with nothing in flight: no late result will need the lease). A release
    /// that does not land is not an error: the lease expires. (This default commits, then
    /// releases; the stores do both in one write.)
    async fn commit_final(
        &self,
        lease: &Lease,
        checkpoint: &Checkpoint,
        expected_version: u64,
        events: &[EventRecord],
    ) -> Result<()> {
        self.commit(lease, checkpoint, expected_version, events)
            .await?;
        if let Err(e) = self.release(lease).await {
            tracing::debug!(run = %lease.run_id, error = %e, "lease release failed; it will expire");
        }
        Ok(())
    }

    /// Takes the run's lease for `ttl` and returns a new token, larger than every token issued
    /// before for this run — also when `owner` already held it (a restarted process or actor is
    /// a new incarnation and must fence out the old one). A live lease of another owner gives
    /// `LeaseHeld`. Commits check the token only, not the expiry: an expired lease stays valid
    /// until someone else claims the run.
    ///
    /// A claim also sets the run's due time (see [`CheckpointStore::due_runs`]) to now + `ttl`,
    /// so that if the owner dies its runs become due when their leases lapse.
    async fn claim(&self, run: &RunId, owner: &str, ttl: Duration) -> Result<Lease>;

    /// Gives the lease up if still held; a no-op otherwise. The due time stays as it is.
    async fn release(&self, lease: &Lease) -> Result<()>;

    /// Extends every lease of `leases` still held by (`owner`, its token) to now + `ttl`, and
    /// moves each renewed run's due time to now + `ttl`, in one round trip (on Redis Cluster,
    /// one per master, concurrently). An expired lease whose token is still current is
    /// renewed too (nobody took the run). Returns the runs whose lease is no longer ours: the
    /// token changed (another owner claimed it, or it was released) or the run is gone.
    async fn renew_leases(
        &self,
        owner: &str,
        leases: &[Lease],
        ttl: Duration,
    ) -> Result<Vec<RunId>>;

    /// Releases each lease still held (by token) and sets that run's due time to `due_at_ms`:
    /// `Some(now)` for another node to take it at once (shutdown), `Some(t)` for a passivated
    /// run's next timer, `None` to leave the due index (nothing will happen to the run until
    /// a control arrives). Leases no longer held are skipped, due time included.
    async fn release_many(&self, leases: &[Lease], due_at_ms: Option<u64>) -> Result<()>;

    /// Puts the run in the due index at `at_ms` (ms since the Unix epoch), or (`None`) takes it
    /// out. For example a new run its node has no room for is made due now, for any node
    /// with room to take.
    async fn set_due(&self, run: &RunId, at_ms: Option<u64>) -> Result<()>;

    /// Runs whose due time is `<= now_ms`, earliest first, at most `limit`. A due run may
    /// still be leased (its owner is late renewing): claiming it tells. Terminal runs never
    /// appear: a terminal commit leaves the index, and a stale entry (for a terminal run, or a
    /// dangling one for a missing run) is removed when read and not returned.
    async fn due_runs(&self, now_ms: u64, limit: usize) -> Result<Vec<RunId>>;

    /// The owner (node id) of the run's live lease; `None` if there is none or it expired.
    async fn lease_holder(&self, run: &RunId) -> Result<Option<String>>;

    /// Takes the node id `node_id` for the process `instance` (a random id per process) for
    /// `ttl`: succeeds if the id is free, expired, or already held by `instance`; otherwise
    /// `NodeIdInUse`. The holder keeps it with [`CheckpointStore::heartbeat_node`].
    async fn register_node(&self, node_id: &str, instance: &str, ttl: Duration) -> Result<()>;

    /// Extends `instance`'s hold on `node_id` to now + `ttl` (taking it again if it lapsed and
    /// is free); `NodeIdInUse` if another instance holds it now.
    async fn heartbeat_node(&self, node_id: &str, instance: &str, ttl: Duration) -> Result<()>;

    /// Gives the node id up if `instance` holds it; a no-op otherwise.
    async fn unregister_node(&self, node_id: &str, instance: &str) -> Result<()>;

    /// Wakes node `node_id` for `run` (a control was stored for a run that node owns).
    /// Wake-ups are a hint: the run's inbox in the store stays the source of truth.
    async fn notify_node(&self, node_id: &str, run: &RunId) -> Result<()>;

    /// Wake-ups for `node_id` after `cursor` (`""`: only those arriving from now on), waiting
    /// up to `block` while there are none. Returns them (possibly none, on timeout) and the
    /// cursor to pass next time. Only the most recent wake-ups are kept (about 10,000 per
    /// node); a reader that falls further behind reads its runs' inboxes anyway.
    async fn wakeups(
        &self,
        node_id: &str,
        cursor: &str,
        block: Duration,
    ) -> Result<(Vec<RunId>, String)>;

    /// Runs not yet terminal, for recovery at start.
    async fn active_runs(&self) -> Result<Vec<RunId>>;

    /// The tenant's runs, newest first. A filtered listing reads only the runs its filter
    /// selects, from an index per (tenant, status) and per (tenant, agent) that every store
    /// keeps with its commits: its cost follows the page, not the tenant's history.
    async fn list_runs(
        &self,
        tenant: &str,
        filter: &RunFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<RunPage>;

    /// Appends a control message to the run's inbox; returns its seq.
    async fn push_control(&self, run: &RunId, control: &Control) -> Result<u64>;

    /// Inbox entries with seq > `after`, in order.
    async fn controls(&self, run: &RunId, after: u64) -> Result<Vec<ControlRecord>>;

    /// Cheap reachability check for `/readyz`.
    async fn ping(&self) -> Result<()>;

    /// The store's epoch marker: a random id written once when the store (or Redis namespace)
    /// is initialised. If it changes, or differs from the value the daemon recorded while it
    /// knew of runs, the data was lost (e.g. Redis restarted empty) and runs must not be
    /// restarted from scratch. Stores without a marker return an empty string.
    async fn epoch(&self) -> Result<String> {
        Ok(String::new())
    }
}

/// Each run's event log (appended only through `CheckpointStore::commit`/`create`).
#[async_trait]
pub trait EventLog: Send + Sync + 'static {
    /// Events with seq > `after`, in order, at most `limit`.
    async fn read(&self, run: &RunId, after: u64, limit: usize) -> Result<Vec<EventRecord>>;
}

/// A backend that is both.
pub trait Store: CheckpointStore + EventLog {}
impl<T: CheckpointStore + EventLog> Store for T {}

/// The store as the runtime holds it.
pub type SharedStore = Arc<dyn Store>;

/// Opens a store from a URL:
/// - `memory:` — the in-memory store (nothing survives the process);
/// - `file:<dir>` — the embedded file store in `<dir>/agentd.redb` (created if missing);
/// - `redis://host:port/db`, `redis+unix:///path/to/sock` (also `unix:///…`), each optionally
///   with `?ns=<prefix>` for the key namespace (default `agentd`);
/// - `redis+cluster://host:port[,host:port…][?ns=<prefix>]` — Redis Cluster, from any of its
///   nodes.
pub async fn open(url: &str) -> Result<SharedStore> {
    if url == "memory:" || url == "memory://" {
        return Ok(Arc::new(memory::MemoryStore::new()));
    }
    if let Some(dir) = url.strip_prefix("file:") {
        let dir = dir.strip_prefix("//").unwrap_or(dir);
        if dir.is_empty() {
            return Err(Error::Unavailable(format!(
                "store url {url:?}: file store needs a directory, e.g. file:./data"
            )));
        }
        return Ok(Arc::new(file::FileStore::open(dir).await?));
    }
    if ["redis://", "redis+unix://", "unix://", "redis+cluster://"]
        .iter()
        .any(|p| url.starts_with(p))
    {
        let (base, ns) = split_namespace(url);
        let mut cfg = self::redis::RedisConfig::new(base);
        if let Some(ns) = ns {
            cfg = cfg.namespace(ns);
        }
        return Ok(Arc::new(self::redis::RedisStore::open(cfg).await?));
    }
    Err(Error::Unavailable(format!(
        "unsupported store url {url:?} (expected memory:, file:<dir>, redis://host:port/db, \
         redis+unix:///path or redis+cluster://host:port,…)"
    )))
}

/// Splits `?ns=…` off a Redis URL, keeping every other query parameter for the redis crate.
fn split_namespace(url: &str) -> (String, Option<String>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), None);
    };
    let mut ns = None;
    let rest: Vec<&str> = query
        .split('&')
        .filter(|kv| match kv.split_once('=') {
            Some(("ns", v)) => {
                ns = Some(v.to_owned());
                false
            }
            _ => !kv.is_empty(),
        })
        .collect();
    if rest.is_empty() {
        (base.to_owned(), ns)
    } else {
        (format!("{base}?{}", rest.join("&")), ns)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn redis_urls_lose_only_the_namespace_parameter() {
        assert_eq!(
            split_namespace("redis://h:1/2?ns=t1"),
            ("redis://h:1/2".to_owned(), Some("t1".to_owned()))
        );
        assert_eq!(
            split_namespace("redis+unix:///s.sock?db=3&ns=x&protocol=resp3"),
            (
                "redis+unix:///s.sock?db=3&protocol=resp3".to_owned(),
                Some("x".to_owned())
            )
        );
        assert_eq!(split_namespace("redis://h"), ("redis://h".to_owned(), None));
    }

    #[test]
    fn only_transient_faults_are_retryable() {
        let run: RunId = "run_0192abc".parse().unwrap();
        assert!(Error::Unavailable("redis: connection refused".into()).is_retryable());
        for e in [
            Error::NotFound(run.clone()),
            Error::VersionConflict {
                run: run.clone(),
                expected: 1,
                found: 2,
            },
            Error::Fenced {
                run: run.clone(),
                token: 1,
            },
            Error::LeaseHeld {
                run: run.clone(),
                owner: "n".into(),
            },
            Error::Corrupt("x".into()),
            Error::NodeIdInUse {
                node: "n1".into(),
                holder: "i1".into(),
            },
        ] {
            assert!(!e.is_retryable(), "{e:?}");
        }
        assert_eq!(
            Error::NodeIdInUse {
                node: "n1".into(),
                holder: "i1".into()
            }
            .to_string(),
            "node id n1 is held by another live process"
        );
    }

    #[test]
    fn run_ids_carry_their_creation_time() {
        let before = crate::clock::now_ms();
        let run = RunId::generate();
        let t = run_created_ms(&run).unwrap();
        assert!(t >= before && t <= crate::clock::now_ms(), "{t}");
        assert!(!is_dangling(&run, t + 1000));
        assert!(is_dangling(&run, t + DANGLING_AFTER.as_millis() as u64 + 1));
        let odd: RunId = "run_zz".parse().unwrap();
        assert!(is_dangling(&odd, 0));
    }

    #[tokio::test]
    async fn unknown_store_urls_are_rejected_clearly() {
        for url in ["postgres://x", "file:", "", "mem"] {
            let err = open(url)
                .await
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(err.contains("store url"), "{url:?}: {err}");
        }
        let s = open("memory:").await.unwrap();
        s.ping().await.unwrap();
    }
}
