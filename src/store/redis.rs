//! `RedisStore`: the production store on Redis or Redis Cluster. Each write of a run is one Lua
//! script over keys of that run (see `keys`), so it is atomic and touches one hash slot;
//! concurrent commits are group-committed by a background task; every call is bounded by a
//! timeout.
//!
//! The indexes (active runs, due runs, tenant runs, client keys) live in other slots, so no
//! script touches them; they are kept with plain commands, ordered so that a crash in between
//! is harmless: a run enters its indexes before its checkpoint is written (readers skip, and
//! later clean, entries of runs that never appeared), and leaves them after its terminal
//! commit (readers check the checkpoint and clean stale entries). On a single Redis a batch of
//! commands is one pipeline; on a cluster the commands of a batch go out concurrently over the
//! cluster connection's per-node connections (one round trip per master), since a cluster
//! pipeline must stay within one slot.
//!
//! Semantics match the in-memory reference: a create or commit retried after an ambiguous
//! failure (the same checkpoint is already stored) succeeds instead of reporting a false
//! conflict. Every Redis failure, transient by nature (refused, reset, timeout, `LOADING`,
//! `BUSY`, `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, redirections), is `Unavailable`.

use std::sync::Arc;
use std::time::Duration;

use ::redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use ::redis::cluster::ClusterClient;
use ::redis::cluster_async::ClusterConnection;
use ::redis::{
    AsyncConnectionConfig, Client, Cmd, ErrorKind, RedisError, RedisFuture, Script,
    ServerErrorKind, Value,
};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::keys::{DEFAULT_NAMESPACE, Keys};
use super::{
    Checkpoint, CheckpointStore, Control, ControlRecord, CreateOutcome, Error, EventLog,
    EventRecord, Lease, Result, RunFilter, RunPage, check_seq, corrupt, due_in, encode_events,
    is_dangling, torn_transcript,
};
use crate::clock::now_ms;
use crate::ids::RunId;

/// How to reach Redis and how long to wait for it.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// A redis crate URL: `redis://host:port/db` or `redis+unix:///path/to/sock`; or
    /// `redis+cluster://host:port[,host:port…]` for Redis Cluster.
    pub url: String,
    /// Key prefix (see `keys::Keys::new` for the charset).
    pub namespace: String,
    /// Upper bound for one store operation, reconnects included (not the crate's 500 ms).
    pub op_timeout: Duration,
    /// Upper bound for establishing one connection.
    pub connect_timeout: Duration,
    /// Batch concurrent commits into pipelines. Off: one EVALSHA round trip per commit. Single
    /// Redis only: on a cluster a pipeline cannot span slots, and commits sent directly (each
    /// its own command, concurrent ones sharing the per-node connections) measured faster
    /// than batches of concurrent commands.
    pub group_commit: bool,
    /// Capacity of the group-commit queue; a full queue makes callers wait (up to
    /// `op_timeout`), never grow memory.
    pub queue_capacity: usize,
    /// Most commits in one pipeline.
    pub max_batch: usize,
    /// Most pipelines in flight at once.
    pub max_inflight: usize,
}

impl RedisConfig {
    /// A config for `url` with the defaults: namespace `agentd`, 5 s per operation, 2 s to connect,
    /// group commit on (queue of 4096, up to 256 commits per pipeline, 4 pipelines in flight).
    pub fn new(url: impl Into<String>) -> Self {
        RedisConfig {
            url: url.into(),
            namespace: DEFAULT_NAMESPACE.to_owned(),
            op_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            group_commit: true,
            queue_capacity: 4096,
            max_batch: 256,
            max_inflight: 4,
        }
    }

    /// Sets the key prefix (checked when the store opens).
    pub fn namespace(mut self, ns: impl Into<String>) -> Self {
        self.namespace = ns.into();
        self
    }

    /// Sets the upper bound for one store operation, reconnects included.
    pub fn op_timeout(mut self, d: Duration) -> Self {
        self.op_timeout = d;
        self
    }

    /// Turns batching of concurrent commits into pipelines on or off (single Redis only).
    pub fn group_commit(mut self, on: bool) -> Self {
        self.group_commit = on;
        self
    }
}

// Script replies are `{code, detail}`; the scripts never raise, so one bad commit cannot fail
// the other commits of its pipeline. Every script touches the keys of one run (or one node)
// only: one hash slot, as Redis Cluster requires.
const OK: i64 = 0;
const REPLAYED: i64 = 1;
const NOT_FOUND: i64 = 2;
const FENCED: i64 = 3;
const CONFLICT: i64 = 4;
const GAP: i64 = 5;
const TORN: i64 = 6;
const HELD: i64 = 7;
const LEGACY: i64 = 8;
const NODE_HELD: i64 = 9;

/// KEYS: ckpt, events, transcript, and to claim the run, its lease.
/// ARGV: version, body, status, terminal(0|1), updated_at_ms, meta, n, then n × (seq, event
/// json), m, then m transcript entries, and to claim the run, owner and ttl_ms.
/// Answers OK with the lease token when it claimed the run (empty when asked not to, or when
/// another owner holds the lease of a run this create already stored).
const CREATE_LUA: &str = r#"
local n = tonumber(ARGV[7])
local m = tonumber(ARGV[8 + 2 * n])
local owner, ttl = ARGV[9 + 2 * n + m], ARGV[10 + 2 * n + m]
if redis.call('EXISTS', KEYS[1]) == 1 then
  -- A retry of an applied create (reply lost) is not a conflict; it claims as CLAIM_LUA.
  if redis.call('HGET', KEYS[1], 'body') ~= ARGV[2] then
    return {4, tostring(redis.call('HGET', KEYS[1], 'v') or '0')}
  end
  if not owner then return {0, ''} end
  local held = redis.call('HGET', KEYS[4], 'owner')
  if held and held ~= owner then return {0, ''} end
  local t = redis.call('HINCRBY', KEYS[1], 'tokens', 1)
  redis.call('HSET', KEYS[1], 'fence', t)
  redis.call('HSET', KEYS[4], 'owner', owner, 'token', t)
  redis.call('PEXPIRE', KEYS[4], ttl)
  return {0, tostring(t)}
end
for i = 1, n do
  if tonumber(ARGV[6 + 2 * i]) ~= i then return {5, ARGV[6 + 2 * i]} end
end
local llen = redis.call('LLEN', KEYS[3])
if llen ~= 0 then return {6, tostring(llen)} end
-- The create's events in one stream entry (the id is its last event's seq).
for i = 1, n, 500 do
  local last = math.min(i + 499, n)
  local x = {'XADD', KEYS[2], ARGV[6 + 2 * last] .. '-0'}
  for j = i, last do x[#x + 1] = 'e'; x[#x + 1] = ARGV[7 + 2 * j] end
  redis.call(unpack(x))
end
-- One RPUSH per chunk (unpack is bounded by Lua's stack).
for i = 1, m, 500 do
  redis.call('RPUSH', KEYS[3], unpack(ARGV, 8 + 2 * n + i, 8 + 2 * n + math.min(i + 499, m)))
end
if not owner then
  redis.call('HSET', KEYS[1], 'v', ARGV[1], 'body', ARGV[2], 'status', ARGV[3],
    'terminal', ARGV[4], 'u', ARGV[5], 'meta', ARGV[6], 'seq', n, 'tokens', 0, 'tl', m)
  return {0, ''}
end
-- The creating node owns the new run: token 1, as its first claim would give.
redis.call('HSET', KEYS[1], 'v', ARGV[1], 'body', ARGV[2], 'status', ARGV[3],
  'terminal', ARGV[4], 'u', ARGV[5], 'meta', ARGV[6], 'seq', n, 'tokens', 1, 'tl', m,
  'fence', 1)
redis.call('HSET', KEYS[4], 'owner', owner, 'token', 1)
redis.call('PEXPIRE', KEYS[4], ttl)
return {0, '1'}
"#;

/// KEYS: ckpt, events, transcript, and to give the lease up with the commit (`commit_final`),
/// the lease.
/// ARGV: token, expected, new_version, body, status, terminal(0|1), updated_at_ms, n, then
/// n × (seq, json), then transcript_from, m, and m transcript entries.
/// The record's constant fields (`meta`) were written by the create, so a commit sends only
/// what changes; a record of the first layout (one `doc` field) is upgraded when it is
/// loaded, and a commit that finds one answers `LEGACY`.
/// Answers OK with the status the commit replaced. The record's hash keeps `tl`, the length
/// of the transcript list, written with it, so the commit reads one hash and no list (records
/// written before `tl` existed ask the list once).
const COMMIT_LUA: &str = r#"
local h = redis.call('HMGET', KEYS[1], 'fence', 'v', 'seq', 'status', 'tl', 'meta')
if not h[2] then return {2, ''} end
if h[1] ~= ARGV[1] then return {3, ''} end
local v = tonumber(h[2])
local last = tonumber(h[3])
local n = tonumber(ARGV[8])
if v ~= tonumber(ARGV[2]) then
  -- The body is read only here (rare path): it can be large.
  if v == tonumber(ARGV[3]) and (n == 0 or tonumber(ARGV[7 + 2 * n]) == last)
     and redis.call('HGET', KEYS[1], 'body') == ARGV[4] then
    return {1, tostring(v)}
  end
  return {4, tostring(v)}
end
if not h[6] then return {8, ''} end
for i = 1, n do
  if tonumber(ARGV[7 + 2 * i]) ~= last + i then return {5, ARGV[7 + 2 * i]} end
end
-- The transcript continues where it ends, or the write is torn.
local llen = tonumber(h[5]) or redis.call('LLEN', KEYS[3])
if llen ~= tonumber(ARGV[9 + 2 * n]) then return {6, tostring(llen)} end
-- A commit's events in one stream entry, id its last event's seq: one command per commit
-- however many transitions it carries (chunks of 500 events stay within Lua's stack).
for i = 1, n, 500 do
  local last = math.min(i + 499, n)
  local x = {'XADD', KEYS[2], ARGV[7 + 2 * last] .. '-0'}
  for j = i, last do x[#x + 1] = 'e'; x[#x + 1] = ARGV[8 + 2 * j] end
  redis.call(unpack(x))
end
local m = tonumber(ARGV[10 + 2 * n])
for i = 1, m, 500 do
  redis.call('RPUSH', KEYS[3], unpack(ARGV, 10 + 2 * n + i, 10 + 2 * n + math.min(i + 499, m)))
end
redis.call('HSET', KEYS[1], 'v', ARGV[3], 'body', ARGV[4], 'status', ARGV[5],
  'terminal', ARGV[6], 'u', ARGV[7], 'seq', last + n, 'tl', llen + m)
if KEYS[4] then
  -- The fence was checked above: the lease is ours to give up (as RELEASE_LUA).
  redis.call('HDEL', KEYS[1], 'fence')
  redis.call('DEL', KEYS[4])
end
-- The status it replaced, for the listing index.
return {0, h[4] or ''}
"#;

/// KEYS: ckpt, transcript. The record's fields (`RECORD_FIELDS`, in order; nil where
/// absent) and its transcript, read together; nothing for a missing record.
const LOAD_LUA: &str = r#"
local h = redis.call('HMGET', KEYS[1], 'meta', 'body', 'v', 'status', 'terminal', 'u', 'doc')
if not h[1] and not h[7] then return {} end
local t = redis.call('LRANGE', KEYS[2], 0, -1)
for i = 7, 1, -1 do table.insert(t, 1, h[i]) end
return t
"#;

/// KEYS: ckpt. ARGV: doc, meta, body, updated_at_ms. Upgrades a record of the first layout
/// (the whole checkpoint as one JSON `doc`) to the current one, if it is still the one read.
const UPGRADE_LUA: &str = r#"
if redis.call('HGET', KEYS[1], 'doc') ~= ARGV[1] then return {4, ''} end
redis.call('HSET', KEYS[1], 'meta', ARGV[2], 'body', ARGV[3], 'u', ARGV[4])
redis.call('HDEL', KEYS[1], 'doc')
return {0, ''}
"#;

/// The hash fields a record is read from (`decode_record`), in this order: the current
/// layout's constant `meta`, its `body`, version, status, terminal flag and update time, and
/// the first layout's `doc`.
const RECORD_FIELDS: [&str; 7] = ["meta", "body", "v", "status", "terminal", "u", "doc"];

/// The fields of a record that never change after its create, written once.
#[derive(Serialize, Deserialize)]
struct RecordMeta {
    tenant: String,
    agent: String,
    created_at_ms: u64,
}

/// KEYS: ckpt, lease. ARGV: owner, ttl_ms.
const CLAIM_LUA: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 0 then return {2, ''} end
local l = redis.call('HMGET', KEYS[2], 'owner', 'token')
if l[1] and l[1] ~= ARGV[1] then return {7, l[1]} end
local t = redis.call('HINCRBY', KEYS[1], 'tokens', 1)
redis.call('HSET', KEYS[1], 'fence', t)
redis.call('HSET', KEYS[2], 'owner', ARGV[1], 'token', t)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return {0, tostring(t)}
"#;

/// KEYS: ckpt, lease. ARGV: owner, token, ttl_ms. The lease is ours while the fence is our
/// token (claims set fence and lease together); an expired lease key is written again.
const RENEW_LUA: &str = r#"
if redis.call('HGET', KEYS[1], 'fence') ~= ARGV[2] then return {3, ''} end
local o = redis.call('HGET', KEYS[2], 'owner')
if o and o ~= ARGV[1] then return {7, o} end
redis.call('HSET', KEYS[2], 'owner', ARGV[1], 'token', ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return {0, ''}
"#;

/// KEYS: ckpt, lease. ARGV: token. Detail `1` if released, `0` if the lease was not held.
const RELEASE_LUA: &str = r#"
if redis.call('HGET', KEYS[1], 'fence') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'fence')
  redis.call('DEL', KEYS[2])
  return {0, '1'}
end
return {0, '0'}
"#;

/// KEYS: ckpt, controls. ARGV: record json.
const PUSH_CONTROL_LUA: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 0 then return {2, ''} end
return {0, tostring(redis.call('RPUSH', KEYS[2], ARGV[1]))}
"#;

/// KEYS: epoch. ARGV: fresh random id, used only if the marker is missing.
const EPOCH_LUA: &str = r#"
redis.call('SET', KEYS[1], ARGV[1], 'NX')
return {0, redis.call('GET', KEYS[1])}
"#;

/// KEYS: node owner. ARGV: instance, ttl_ms. Register and heartbeat alike.
const NODE_HOLD_LUA: &str = r#"
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return {9, cur} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {0, ''}
"#;

/// KEYS: node owner. ARGV: instance.
const NODE_RELEASE_LUA: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return {0, ''}
"#;

/// Wake-ups kept per node stream (approximate trim).
const WAKE_STREAM_LEN: usize = 10_000;
/// Most wake-ups returned by one read.
const WAKE_READ_COUNT: usize = 1000;

/// Longest wait of one `wakeups` read (a longer `block` is cut to this).
pub const MAX_WAKE_BLOCK: Duration = Duration::from_secs(60);

/// A control as stored in the inbox list; its seq is its position.
#[derive(Serialize, Deserialize)]
struct StoredControl {
    at_ms: u64,
    control: Control,
}

struct Scripts {
    create: Script,
    commit: Script,
    load: Script,
    upgrade: Script,
    claim: Script,
    renew: Script,
    release: Script,
    push_control: Script,
    epoch: Script,
    node_hold: Script,
    node_release: Script,
}

impl Scripts {
    fn new() -> Self {
        Scripts {
            create: Script::new(CREATE_LUA),
            commit: Script::new(COMMIT_LUA),
            load: Script::new(LOAD_LUA),
            upgrade: Script::new(UPGRADE_LUA),
            claim: Script::new(CLAIM_LUA),
            renew: Script::new(RENEW_LUA),
            release: Script::new(RELEASE_LUA),
            push_control: Script::new(PUSH_CONTROL_LUA),
            epoch: Script::new(EPOCH_LUA),
            node_hold: Script::new(NODE_HOLD_LUA),
            node_release: Script::new(NODE_RELEASE_LUA),
        }
    }

    fn all(&self) -> [&Script; 11] {
        [
            &self.create,
            &self.commit,
            &self.load,
            &self.upgrade,
            &self.claim,
            &self.renew,
            &self.release,
            &self.push_control,
            &self.epoch,
            &self.node_hold,
            &self.node_release,
        ]
    }
}

/// A connection to Redis: the shared reconnecting one of a single server, a cluster connection
/// (one multiplexed connection per node, routing by slot, following redirections), or a
/// dedicated connection for blocking reads.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Dedicated(MultiplexedConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Dedicated(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a ::redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Dedicated(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
            Conn::Dedicated(c) => c.get_db(),
        }
    }
}

/// How to open more connections (for blocking reads).
enum Source {
    Single(Client),
    /// A client whose response timeout allows for `MAX_WAKE_BLOCK`.
    Cluster(Box<ClusterClient>),
}

/// What one command of a batch answered.
enum Answer {
    Value(Value),
    NoScript,
    Failed(String),
}

impl Answer {
    fn of_value(v: Value) -> Self {
        match v {
            Value::ServerError(e) if e.kind() == Some(ServerErrorKind::NoScript) => {
                Answer::NoScript
            }
            Value::ServerError(e) => Answer::Failed(format!("{e:?}")),
            v => Answer::Value(v),
        }
    }

    fn of_result(r: ::redis::RedisResult<Value>) -> Self {
        match r {
            Ok(v) => Self::of_value(v),
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => Answer::NoScript,
            Err(e) => Answer::Failed(e.to_string()),
        }
    }

    /// The value, or `Unavailable` naming `what`.
    fn value(self, what: &str) -> Result<Value> {
        match self {
            Answer::Value(v) => Ok(v),
            Answer::NoScript => Err(Error::Unavailable(format!(
                "redis: {what}: script cache lost"
            ))),
            Answer::Failed(e) => Err(Error::Unavailable(format!("redis: {what}: {e}"))),
        }
    }

    /// A script's `{code, detail}`.
    fn reply(self, what: &str) -> Result<(i64, String)> {
        parse_reply(self.value(what)?).map_err(|e| Error::Corrupt(format!("{what}: {e}")))
    }
}

/// Commands as [`Core::send`] sent them, for a resend.
enum Sent {
    Pipeline(::redis::Pipeline),
    Commands(Vec<Cmd>),
}

impl Sent {
    /// A copy of the `i`-th command sent.
    fn command(&self, i: usize) -> Option<Cmd> {
        match self {
            Sent::Pipeline(p) => p.cmd_iter().nth(i).cloned(),
            Sent::Commands(c) => c.get(i).cloned(),
        }
    }
}

/// What the store and its group committer share.
struct Core {
    con: Conn,
    keys: Keys,
    cfg: RedisConfig,
    scripts: Scripts,
    source: Source,
    /// Idle dedicated connections for blocking reads.
    blocking: tokio::sync::Mutex<Vec<Conn>>,
    /// Per run, the (version, status) this store last wrote: a commit from that version in
    /// the same status needs no status-index entry (it is there), any other one adds it first.
    listed: dashmap::DashMap<RunId, (u64, String)>,
    /// Tenants whose status and agent indexes are known to cover every run.
    indexed_tenants: dashmap::DashSet<String>,
}

/// Beyond this many remembered (version, status) pairs the memory is dropped: it only saves
/// index writes, so forgetting costs one idempotent ZADD per run.
const MAX_LISTED: usize = 200_000;

/// One commit waiting for the group committer.
struct CommitJob {
    run: RunId,
    tenant: String,
    status: String,
    /// On a single server: the status-index write that goes before the script, in the same
    /// pipeline (a cluster sends it first, on its own).
    index_first: Option<Cmd>,
    expected: u64,
    token: u64,
    terminal: bool,
    cmd: Cmd,
    reply: oneshot::Sender<Result<()>>,
}

/// The Redis [`CheckpointStore`] + [`EventLog`].
pub struct RedisStore {
    core: Arc<Core>,
    queue: Option<mpsc::Sender<CommitJob>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("namespace", &self.core.keys.namespace())
            .field("cluster", &self.is_cluster())
            .field("group_commit", &self.queue.is_some())
            .finish()
    }
}

fn unavailable(what: &str, e: &RedisError) -> Error {
    Error::Unavailable(format!("redis: {what}: {e}"))
}

fn timed_out(what: &str, d: Duration) -> Error {
    Error::Unavailable(format!("redis: {what}: no reply within {d:?}"))
}

/// Parses a script's `{code, detail}` reply.
fn parse_reply(v: Value) -> std::result::Result<(i64, String), String> {
    ::redis::from_redis_value::<(i64, String)>(v)
        .map_err(|e| format!("unexpected script reply: {e}"))
}

fn commit_outcome(run: &RunId, expected: u64, token: u64, code: i64, detail: &str) -> Result<()> {
    match code {
        OK | REPLAYED => Ok(()),
        NOT_FOUND => Err(Error::NotFound(run.clone())),
        FENCED => Err(Error::Fenced {
            run: run.clone(),
            token,
        }),
        CONFLICT => Err(Error::VersionConflict {
            run: run.clone(),
            expected,
            found: detail.parse().unwrap_or(0),
        }),
        GAP => Err(Error::SequenceGap {
            run: run.clone(),
            seq: detail.parse().unwrap_or(0),
        }),
        LEGACY => Err(Error::Corrupt(format!(
            "run {run}: the record is in the first layout and was not upgraded by a load"
        ))),
        // The expected start is not in the answer; the stored length is.
        TORN => Err(Error::Corrupt(format!(
            "run {run}: the commit does not continue the transcript, which holds {detail} entries"
        ))),
        other => Err(Error::Corrupt(format!(
            "run {run}: commit script answered code {other}"
        ))),
    }
}

fn terminal_arg(c: &Checkpoint) -> &'static str {
    if c.terminal { "1" } else { "0" }
}

fn parse_run(id: &str, index: &str) -> Result<RunId> {
    id.parse::<RunId>()
        .map_err(|e| Error::Corrupt(format!("{index} index holds {id:?}: {e}")))
}

/// The node URLs of `redis+cluster://h1:p1,h2:p2[?query]`, each as `redis://h:p[?query]`.
fn cluster_nodes(url: &str) -> Option<Vec<String>> {
    let rest = url.strip_prefix("redis+cluster://")?;
    let (hosts, query) = match rest.split_once('?') {
        Some((h, q)) => (h, format!("?{q}")),
        None => (rest, String::new()),
    };
    Some(
        hosts
            .trim_end_matches('/')
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|h| format!("redis://{h}{query}"))
            .collect(),
    )
}

impl Core {
    /// Remembers the status a run was written with (see `listed`); a finished run is
    /// forgotten, since it is written at most with late results, in the same status.
    fn remember_listed(&self, c: &Checkpoint) {
        if c.terminal {
            self.listed.remove(&c.run_id);
            return;
        }
        if self.listed.len() >= MAX_LISTED {
            self.listed.clear();
        }
        self.listed
            .insert(c.run_id.clone(), (c.version, c.status.clone()));
    }

    fn is_cluster(&self) -> bool {
        matches!(self.con, Conn::Cluster(_))
    }

    /// Runs one Redis future under `op_timeout`, mapping failures to `Unavailable`.
    async fn bounded<T>(
        &self,
        what: &str,
        fut: impl Future<Output = ::redis::RedisResult<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(self.cfg.op_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(unavailable(what, &e)),
            Err(_) => Err(timed_out(what, self.cfg.op_timeout)),
        }
    }

    async fn query<T: ::redis::FromRedisValue>(&self, what: &str, cmd: &Cmd) -> Result<T> {
        let mut con = self.con.clone();
        self.bounded(what, cmd.query_async(&mut con)).await
    }

    async fn script(
        &self,
        what: &str,
        inv: ::redis::ScriptInvocation<'_>,
    ) -> Result<(i64, String)> {
        let mut con = self.con.clone();
        let v: Value = self.bounded(what, inv.invoke_async(&mut con)).await?;
        parse_reply(v).map_err(|e| Error::Corrupt(format!("{what}: {e}")))
    }

    async fn load_scripts(&self) -> Result<()> {
        for script in self.scripts.all() {
            let mut con = self.con.clone();
            // On a cluster, SCRIPT LOAD goes to every primary.
            self.bounded("loading scripts", script.load_async(&mut con))
                .await?;
        }
        Ok(())
    }

    /// Sends independent commands in one round trip: one pipeline on a single server; on a
    /// cluster, all at once over the per-node connections (commands of different slots cannot
    /// share a cluster pipeline). Each command answers for itself.
    async fn exec_many(&self, what: &str, cmds: Vec<Cmd>) -> Result<Vec<Answer>> {
        Ok(self.send(what, cmds).await?.0)
    }

    /// [`Core::exec_many`], keeping what was sent: the commands are moved into the pipeline,
    /// not copied (a commit's carries its body and new transcript entries), and only a resend
    /// copies the ones it needs back out.
    async fn send(&self, what: &str, cmds: Vec<Cmd>) -> Result<(Vec<Answer>, Sent)> {
        if cmds.is_empty() {
            return Ok((Vec::new(), Sent::Commands(cmds)));
        }
        if let Conn::Cluster(c) = &self.con {
            let all = futures::future::join_all(cmds.iter().map(|cmd| {
                let mut c = c.clone();
                async move { c.req_packed_command(cmd).await }
            }));
            return match tokio::time::timeout(self.cfg.op_timeout, all).await {
                Ok(results) => Ok((
                    results.into_iter().map(Answer::of_result).collect(),
                    Sent::Commands(cmds),
                )),
                Err(_) => Err(timed_out(what, self.cfg.op_timeout)),
            };
        }
        let mut pipe = ::redis::Pipeline::with_capacity(cmds.len());
        pipe.ignore_errors();
        for c in cmds {
            pipe.add_command(c);
        }
        let mut con = self.con.clone();
        let values: Vec<Value> = self.bounded(what, pipe.query_async(&mut con)).await?;
        Ok((
            values.into_iter().map(Answer::of_value).collect(),
            Sent::Pipeline(pipe),
        ))
    }

    /// [`Core::exec_many`], and if a script was missing (Redis restarted and lost its script
    /// cache) loads the scripts and resends those commands once. Resending is safe: an applied
    /// create or commit is recognised as a replay, and the other scripts are idempotent.
    async fn exec_scripts(&self, what: &str, cmds: Vec<Cmd>) -> Result<Vec<Answer>> {
        let (mut answers, sent) = self.send(what, cmds).await?;
        let missing: Vec<usize> = answers
            .iter()
            .enumerate()
            .filter(|(_, a)| matches!(a, Answer::NoScript))
            .map(|(i, _)| i)
            .collect();
        if missing.is_empty() {
            return Ok(answers);
        }
        self.load_scripts().await?;
        let (at, again): (Vec<usize>, Vec<Cmd>) = missing
            .into_iter()
            .filter_map(|i| sent.command(i).map(|c| (i, c)))
            .unzip();
        let resent = self.exec_many(what, again).await?;
        for (i, a) in at.into_iter().zip(resent) {
            answers[i] = a;
        }
        Ok(answers)
    }

    /// Sends `first`, then `then`, so that `then` is applied only after every command of
    /// `first` (one pipeline on a single server, two round trips on a cluster). Any failure of
    /// `first` stops before `then`.
    async fn exec_ordered(&self, what: &str, first: Vec<Cmd>, then: Cmd) -> Result<Answer> {
        if self.is_cluster() {
            for a in self.exec_many(what, first).await? {
                a.value(what)?;
            }
            let mut last = self.exec_scripts(what, vec![then]).await?;
            return last
                .pop()
                .ok_or_else(|| Error::Corrupt(format!("{what}: empty reply")));
        }
        let n = first.len();
        let mut all = first;
        all.push(then);
        let mut answers = self.exec_scripts(what, all).await?;
        let last = answers
            .pop()
            .ok_or_else(|| Error::Corrupt(format!("{what}: empty reply")))?;
        // In one pipeline `then` ran anyway; a failed index write is still reported, and the
        // caller's retry writes it again.
        for a in answers.into_iter().take(n) {
            a.value(what)?;
        }
        Ok(last)
    }

    fn evalsha(&self, script: &Script, keys: &[String]) -> Cmd {
        let mut cmd = ::redis::cmd("EVALSHA");
        cmd.arg(script.get_hash()).arg(keys.len()).arg(keys);
        cmd
    }

    /// Removes runs that reached a terminal state from the active and due indexes, after their
    /// terminal commit. A failure leaves stale entries, which readers filter and clean.
    async fn leave_indexes(&self, runs: &[RunId]) {
        if runs.is_empty() {
            return;
        }
        let ids: Vec<&str> = runs.iter().map(RunId::as_str).collect();
        let mut srem = ::redis::cmd("SREM");
        srem.arg(self.keys.active()).arg(&ids);
        let mut zrem = ::redis::cmd("ZREM");
        zrem.arg(self.keys.due()).arg(&ids);
        let what = "removing finished runs from the indexes";
        let ok = match self.exec_many(what, vec![srem, zrem]).await {
            Ok(answers) => answers.into_iter().all(|a| a.value(what).is_ok()),
            Err(_) => false,
        };
        if !ok {
            tracing::debug!(
                runs = runs.len(),
                "redis store: finished runs stay in the indexes until read"
            );
        }
    }

    /// Sends a batch of commit commands and answers each job.
    async fn commit_batch(&self, mut batch: Vec<CommitJob>) {
        // Index writes first, then the scripts, in one pipeline: one round trip per batch.
        // The commands are moved out of the jobs, not copied (a script carries the body and
        // the new transcript entries).
        let (firsts, mut cmds): (Vec<usize>, Vec<Cmd>) = batch
            .iter_mut()
            .enumerate()
            .filter_map(|(i, j)| j.index_first.take().map(|c| (i, c)))
            .unzip();
        cmds.extend(
            batch
                .iter_mut()
                .map(|j| std::mem::replace(&mut j.cmd, Cmd::new())),
        );
        match self.exec_scripts("committing", cmds).await {
            Ok(mut answers) => {
                let scripts = answers.split_off(firsts.len());
                // The script ran anyway; a failed index write is reported so that the caller
                // retries, which replays the commit and writes the index again.
                let mut index_failed = vec![false; batch.len()];
                for (&i, a) in firsts.iter().zip(answers) {
                    index_failed[i] = a.value("indexing a run by status").is_err();
                }
                let answers = scripts;
                // The status indexes the committed runs left (the script answers the status
                // each commit replaced); removed after the commit, so a crash in between
                // leaves only entries that readers skip.
                let mut left = Vec::new();
                let outcomes: Vec<Result<()>> = batch
                    .iter()
                    .zip(answers)
                    .zip(index_failed)
                    .map(|((job, a), index_failed)| {
                        if index_failed {
                            return Err(Error::Unavailable(format!(
                                "redis: committing run {}: the status index write failed",
                                job.run
                            )));
                        }
                        a.reply("committing").and_then(|(code, detail)| {
                            if code == OK && !detail.is_empty() && detail != job.status {
                                let mut c = ::redis::cmd("ZREM");
                                c.arg(self.keys.tenant_status_runs(&job.tenant, &detail))
                                    .arg(job.run.as_str());
                                left.push(c);
                            }
                            commit_outcome(&job.run, job.expected, job.token, code, &detail)
                        })
                    })
                    .collect();
                if !left.is_empty() {
                    let what = "moving committed runs between status indexes";
                    if self.exec_many(what, left).await.is_err() {
                        tracing::debug!("redis store: stale status-index entries stay until read");
                    }
                }
                let finished: Vec<RunId> = batch
                    .iter()
                    .zip(&outcomes)
                    .filter(|(j, r)| j.terminal && r.is_ok())
                    .map(|(j, _)| j.run.clone())
                    .collect();
                self.leave_indexes(&finished).await;
                for (job, out) in batch.into_iter().zip(outcomes) {
                    let _ = job.reply.send(out);
                }
            }
            Err(e) => {
                for job in batch {
                    let _ = job.reply.send(Err(e.clone()));
                }
            }
        }
    }

    /// Of `ids` (from an index), the runs whose checkpoint exists and is not terminal, in the
    /// same order; entries of terminal runs and dangling entries (runs never created) are
    /// returned separately, for the caller to remove.
    async fn live_runs(&self, ids: Vec<RunId>) -> Result<(Vec<RunId>, Vec<RunId>)> {
        let what = "checking indexed runs";
        let cmds: Vec<Cmd> = ids
            .iter()
            .map(|r| {
                let mut c = ::redis::cmd("HGET");
                c.arg(self.keys.ckpt(r)).arg("terminal");
                c
            })
            .collect();
        let answers = self.exec_many(what, cmds).await?;
        let now = now_ms();
        let (mut live, mut stale) = (Vec::new(), Vec::new());
        for (run, a) in ids.into_iter().zip(answers) {
            let terminal: Option<String> = ::redis::from_redis_value(a.value(what)?)
                .map_err(|e| corrupt(&run, "reading the terminal flag", e))?;
            match terminal.as_deref() {
                Some("0") => live.push(run),
                Some(_) => stale.push(run),
                None if is_dangling(&run, now) => stale.push(run),
                None => {}
            }
        }
        Ok((live, stale))
    }

    /// A dedicated connection for a blocking read: an idle one, or a new one.
    async fn blocking_conn(&self) -> Result<Conn> {
        if let Some(c) = self.blocking.lock().await.pop() {
            return Ok(c);
        }
        let wait = self.cfg.connect_timeout + self.cfg.op_timeout;
        let what = "opening a connection for blocking reads";
        match &self.source {
            Source::Single(client) => {
                let c = AsyncConnectionConfig::new()
                    .set_response_timeout(None)
                    .set_connection_timeout(Some(self.cfg.connect_timeout));
                let con = tokio::time::timeout(
                    wait,
                    client.get_multiplexed_async_connection_with_config(&c),
                )
                .await
                .map_err(|_| timed_out(what, wait))?
                .map_err(|e| unavailable(what, &e))?;
                Ok(Conn::Dedicated(con))
            }
            Source::Cluster(client) => {
                let con = tokio::time::timeout(wait, client.get_async_connection())
                    .await
                    .map_err(|_| timed_out(what, wait))?
                    .map_err(|e| unavailable(what, &e))?;
                Ok(Conn::Cluster(con))
            }
        }
    }
}

impl RedisStore {
    /// Connects (bounded by `connect_timeout` + `op_timeout`), loads the scripts and writes the
    /// namespace's epoch marker if it is missing. A `redis+cluster://` URL opens a cluster.
    pub async fn open(cfg: RedisConfig) -> Result<Self> {
        let keys = Keys::new(&cfg.namespace).map_err(|e| Error::Unavailable(e.to_string()))?;
        let wait = cfg.connect_timeout + cfg.op_timeout;
        let (con, source) = if let Some(nodes) = cluster_nodes(&cfg.url) {
            if nodes.is_empty() {
                return Err(Error::Unavailable(format!(
                    "redis: bad url {:?}: a cluster url names at least one host:port",
                    cfg.url
                )));
            }
            let build = |response: Duration| {
                ClusterClient::builder(nodes.clone())
                    .connection_timeout(cfg.connect_timeout)
                    .response_timeout(response)
                    .retries(3)
                    .build()
                    .map_err(|e| Error::Unavailable(format!("redis: bad cluster url: {e}")))
            };
            let client = build(cfg.op_timeout)?;
            let blocking = build(MAX_WAKE_BLOCK + cfg.op_timeout)?;
            let con = tokio::time::timeout(wait, client.get_async_connection())
                .await
                .map_err(|_| timed_out("connecting to the cluster", wait))?
                .map_err(|e| unavailable("connecting to the cluster", &e))?;
            (Conn::Cluster(con), Source::Cluster(Box::new(blocking)))
        } else {
            let client = Client::open(cfg.url.as_str())
                .map_err(|e| Error::Unavailable(format!("redis: bad url: {e}")))?;
            let mgr_cfg = ::redis::aio::ConnectionManagerConfig::new()
                .set_response_timeout(Some(cfg.op_timeout))
                .set_connection_timeout(Some(cfg.connect_timeout))
                .set_number_of_retries(3)
                .set_max_delay(Duration::from_secs(1));
            let con =
                tokio::time::timeout(wait, client.get_connection_manager_with_config(mgr_cfg))
                    .await
                    .map_err(|_| timed_out("connecting", wait))?
                    .map_err(|e| unavailable("connecting", &e))?;
            (Conn::Single(con), Source::Single(client))
        };
        let core = Arc::new(Core {
            con,
            keys,
            cfg: cfg.clone(),
            scripts: Scripts::new(),
            source,
            blocking: tokio::sync::Mutex::new(Vec::new()),
            listed: dashmap::DashMap::new(),
            indexed_tenants: dashmap::DashSet::new(),
        });
        let queue = if cfg.group_commit && !core.is_cluster() {
            let (tx, rx) = mpsc::channel(cfg.queue_capacity.max(1));
            tokio::spawn(group_committer(rx, core.clone()));
            Some(tx)
        } else {
            None
        };
        let store = RedisStore { core, queue };
        store.core.load_scripts().await?;
        store.epoch_marker().await?;
        Ok(store)
    }

    /// The key layout in use.
    pub fn keys(&self) -> &Keys {
        &self.core.keys
    }

    /// Whether this store runs on Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.core.is_cluster()
    }

    /// Makes sure the tenant's status and agent indexes cover every run, once per tenant and
    /// process: a namespace written before they existed gets them at its first filtered
    /// listing. Concurrent builders and commits only add entries, which readers check.
    async fn ensure_list_indexes(&self, tenant: &str) -> Result<()> {
        if self.core.indexed_tenants.contains(tenant) {
            return Ok(());
        }
        let keys = &self.core.keys;
        let what = "building the listing indexes";
        let mark = keys.tenant_list_indexed(tenant);
        let done: Option<String> = self
            .core
            .query(what, ::redis::cmd("GET").arg(&mark))
            .await?;
        if done.is_none() {
            let mut lower = "-".to_owned();
            let mut indexed = 0usize;
            loop {
                let ids: Vec<String> = self
                    .core
                    .query(
                        what,
                        ::redis::cmd("ZRANGEBYLEX")
                            .arg(keys.tenant_runs(tenant))
                            .arg(&lower)
                            .arg("+")
                            .arg("LIMIT")
                            .arg(0)
                            .arg(500),
                    )
                    .await?;
                let Some(last) = ids.last() else { break };
                lower = format!("({last}");
                let runs: Vec<RunId> = ids.iter().filter_map(|id| id.parse().ok()).collect();
                let reads: Vec<Cmd> = runs.iter().map(|r| self.record_read(r)).collect();
                let mut adds: std::collections::HashMap<String, Vec<&str>> = Default::default();
                for (r, a) in runs.iter().zip(self.core.exec_many(what, reads).await?) {
                    let fields: Vec<Option<String>> = ::redis::from_redis_value(a.value(what)?)
                        .map_err(|e| corrupt(r, "reading the checkpoint", e))?;
                    let Ok(Some((c, _))) = Self::decode_record(r, fields) else {
                        continue;
                    };
                    for key in [
                        keys.tenant_status_runs(tenant, &c.status),
                        keys.tenant_agent_runs(tenant, &c.agent),
                    ] {
                        adds.entry(key).or_default().push(r.as_str());
                    }
                    indexed += 1;
                }
                let writes: Vec<Cmd> = adds
                    .into_iter()
                    .map(|(key, ids)| {
                        let mut c = ::redis::cmd("ZADD");
                        c.arg(key);
                        for id in ids {
                            c.arg(0).arg(id);
                        }
                        c
                    })
                    .collect();
                for a in self.core.exec_many(what, writes).await? {
                    a.value(what)?;
                }
                if ids.len() < 500 {
                    break;
                }
            }
            let _: Value = self
                .core
                .query(what, ::redis::cmd("SET").arg(&mark).arg(1))
                .await?;
            if indexed > 0 {
                tracing::info!(
                    tenant,
                    runs = indexed,
                    "redis store: built the listing indexes"
                );
            }
        }
        self.core.indexed_tenants.insert(tenant.to_owned());
        Ok(())
    }

    async fn epoch_marker(&self) -> Result<String> {
        let fresh = uuid::Uuid::new_v4().simple().to_string();
        let mut inv = self.core.scripts.epoch.prepare_invoke();
        inv.key(self.core.keys.epoch()).arg(fresh);
        let (_, epoch) = self.core.script("reading the epoch marker", inv).await?;
        Ok(epoch)
    }

    fn commit_cmd(
        &self,
        lease: &Lease,
        checkpoint: &Checkpoint,
        expected: u64,
        events: &[EventRecord],
        release: bool,
    ) -> Result<Cmd> {
        let run = &checkpoint.run_id;
        let events = encode_events(run, events)?;
        let keys = &self.core.keys;
        let mut script_keys = vec![keys.ckpt(run), keys.events(run), keys.transcript(run)];
        if release {
            script_keys.push(keys.lease(run));
        }
        let mut cmd = self.core.evalsha(&self.core.scripts.commit, &script_keys);
        cmd.arg(lease.token)
            .arg(expected)
            .arg(checkpoint.version)
            .arg(&checkpoint.body)
            .arg(&checkpoint.status)
            .arg(terminal_arg(checkpoint))
            .arg(checkpoint.updated_at_ms)
            .arg(events.len());
        for (seq, json) in events {
            cmd.arg(seq).arg(json);
        }
        cmd.arg(checkpoint.transcript_from)
            .arg(checkpoint.transcript.len());
        for entry in &checkpoint.transcript {
            cmd.arg(entry);
        }
        Ok(cmd)
    }

    fn decode_checkpoint(run: &RunId, doc: &str) -> Result<Checkpoint> {
        serde_json::from_str(doc).map_err(|e| corrupt(run, "decoding checkpoint", e))
    }

    /// `HMGET` of a record's `RECORD_FIELDS`.
    fn record_read(&self, run: &RunId) -> Cmd {
        let mut c = ::redis::cmd("HMGET");
        c.arg(self.core.keys.ckpt(run)).arg(&RECORD_FIELDS[..]);
        c
    }

    /// The record from its `RECORD_FIELDS` (either layout), without its transcript; `None`
    /// if it does not exist. The second value is the first layout's `doc`, for `upgrade`.
    fn decode_record(
        run: &RunId,
        fields: Vec<Option<String>>,
    ) -> Result<Option<(Checkpoint, Option<String>)>> {
        let Ok([meta, body, v, status, terminal, u, doc]) = <[Option<String>; 7]>::try_from(fields)
        else {
            return Err(Error::Corrupt(format!(
                "run {run}: the record's fields were not all answered"
            )));
        };
        let Some(meta) = meta else {
            return match doc {
                Some(doc) => Ok(Some((Self::decode_checkpoint(run, &doc)?, Some(doc)))),
                None => Ok(None),
            };
        };
        let missing = |field: &str| Error::Corrupt(format!("run {run}: the record has no {field}"));
        let number = |field: &str, value: Option<String>| -> Result<u64> {
            value
                .ok_or_else(|| missing(field))?
                .parse()
                .map_err(|e| corrupt(run, &format!("reading the record's {field}"), e))
        };
        let meta: RecordMeta =
            serde_json::from_str(&meta).map_err(|e| corrupt(run, "decoding the record", e))?;
        Ok(Some((
            Checkpoint {
                run_id: run.clone(),
                tenant: meta.tenant,
                agent: meta.agent,
                status: status.ok_or_else(|| missing("status"))?,
                terminal: terminal.as_deref() == Some("1"),
                version: number("version", v)?,
                created_at_ms: meta.created_at_ms,
                updated_at_ms: number("update time", u)?,
                body: body.ok_or_else(|| missing("body"))?,
                transcript: Vec::new(),
                transcript_from: 0,
            },
            None,
        )))
    }

    /// The constant fields of a record, as its create writes them.
    fn record_meta(run: &RunId, checkpoint: &Checkpoint) -> Result<String> {
        serde_json::to_string(&RecordMeta {
            tenant: checkpoint.tenant.clone(),
            agent: checkpoint.agent.clone(),
            created_at_ms: checkpoint.created_at_ms,
        })
        .map_err(|e| corrupt(run, "encoding the record", e))
    }

    /// Rewrites a record read in the first layout (`doc`) in the current one, unless it
    /// changed since it was read (then the caller reads it again).
    async fn upgrade(&self, checkpoint: &Checkpoint, doc: &str) -> Result<()> {
        let run = &checkpoint.run_id;
        let what = format!("upgrading the record of run {run}");
        let mut inv = self.core.scripts.upgrade.prepare_invoke();
        inv.key(self.core.keys.ckpt(run))
            .arg(doc)
            .arg(Self::record_meta(run, checkpoint)?)
            .arg(&checkpoint.body)
            .arg(checkpoint.updated_at_ms);
        match self.core.script(&what, inv).await? {
            (OK, _) => Ok(()),
            _ => Err(Error::Unavailable(format!(
                "redis: {what}: it changed while it was read; read it again"
            ))),
        }
    }

    fn due_cmd(&self, runs: &[&RunId], at_ms: Option<u64>) -> Cmd {
        match at_ms {
            Some(at) => {
                let mut c = ::redis::cmd("ZADD");
                c.arg(self.core.keys.due());
                for r in runs {
                    c.arg(at).arg(r.as_str());
                }
                c
            }
            None => {
                let mut c = ::redis::cmd("ZREM");
                c.arg(self.core.keys.due());
                for r in runs {
                    c.arg(r.as_str());
                }
                c
            }
        }
    }

    /// Sets the due time of `runs` (none: nothing to do).
    async fn set_due_many(&self, what: &str, runs: &[&RunId], at_ms: Option<u64>) -> Result<()> {
        if runs.is_empty() {
            return Ok(());
        }
        let _: Value = self.core.query(what, &self.due_cmd(runs, at_ms)).await?;
        Ok(())
    }

    async fn node_hold(&self, node_id: &str, instance: &str, ttl: Duration) -> Result<()> {
        let mut inv = self.core.scripts.node_hold.prepare_invoke();
        inv.key(self.core.keys.node_owner(node_id))
            .arg(instance)
            .arg(ttl.as_millis().max(1) as u64);
        let (code, holder) = self
            .core
            .script(&format!("holding node id {node_id}"), inv)
            .await?;
        match code {
            OK => Ok(()),
            NODE_HELD => Err(Error::NodeIdInUse {
                node: node_id.to_owned(),
                holder,
            }),
            other => Err(Error::Corrupt(format!(
                "node {node_id}: node script answered code {other}"
            ))),
        }
    }

    /// The id of the newest entry of a stream, or `0-0` if it is empty.
    async fn stream_tail(con: &mut Conn, key: &str) -> ::redis::RedisResult<String> {
        let last: Vec<(String, Vec<String>)> = ::redis::cmd("XREVRANGE")
            .arg(key)
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1)
            .query_async(con)
            .await?;
        Ok(last
            .into_iter()
            .next()
            .map_or_else(|| "0-0".to_owned(), |(id, _)| id))
    }

    /// `commit`, and with `release` the lease given up in the same script.
    async fn commit_maybe_final(
        &self,
        lease: &Lease,
        checkpoint: &Checkpoint,
        expected_version: u64,
        events: &[EventRecord],
        release: bool,
    ) -> Result<()> {
        let run = checkpoint.run_id.clone();
        let cmd = self.commit_cmd(lease, checkpoint, expected_version, events, release)?;
        let indexed = self.core.listed.get(&run).is_some_and(|known| {
            let (version, status) = known.value();
            *version == expected_version && *status == checkpoint.status
        });
        // Into the new status's index before the checkpoint says so.
        let mut index_first = None;
        if !indexed {
            let mut zadd = ::redis::cmd("ZADD");
            zadd.arg(
                self.core
                    .keys
                    .tenant_status_runs(&checkpoint.tenant, &checkpoint.status),
            )
            .arg(0)
            .arg(run.as_str());
            if self.is_cluster() {
                let _: Value = self
                    .core
                    .query(&format!("indexing run {run} by status"), &zadd)
                    .await?;
            } else {
                index_first = Some(zadd);
            }
        }
        let (reply, wait) = oneshot::channel();
        let job = CommitJob {
            run: run.clone(),
            tenant: checkpoint.tenant.clone(),
            status: checkpoint.status.clone(),
            index_first,
            expected: expected_version,
            token: lease.token,
            terminal: checkpoint.terminal,
            cmd,
            reply,
        };
        let limit = self.core.cfg.op_timeout * 2;
        match &self.queue {
            None => {
                self.core.commit_batch(vec![job]).await;
            }
            Some(queue) => {
                let t = self.core.cfg.op_timeout;
                queue.send_timeout(job, t).await.map_err(|_| {
                    Error::Unavailable(format!(
                        "redis: committing run {run}: commit queue full for {t:?}"
                    ))
                })?;
            }
        }
        // The batch's own timeout is `op_timeout`; allow it to queue behind other batches.
        match tokio::time::timeout(limit, wait).await {
            Ok(Ok(r)) => {
                if r.is_ok() {
                    self.core.remember_listed(checkpoint);
                }
                r
            }
            Ok(Err(_)) => Err(Error::Unavailable(format!(
                "redis: committing run {run}: group committer stopped"
            ))),
            Err(_) => Err(timed_out(&format!("committing run {run}"), limit)),
        }
    }

    /// `create`, and with `claim` (owner, ttl) the new run's first lease, in the same script.
    async fn create_maybe_claimed(
        &self,
        checkpoint: &Checkpoint,
        events: &[EventRecord],
        client_key: Option<&str>,
        claim: Option<(&str, Duration)>,
    ) -> Result<(CreateOutcome, Option<Lease>)> {
        let run = &checkpoint.run_id;
        // Checked here too, so that a bad create does not use up its client key.
        check_seq(run, 0, events.iter().map(|e| e.seq))?;
        let keys = &self.core.keys;
        let what = format!("creating run {run}");
        if let Some(k) = client_key {
            // The key first: a concurrent create with the same key loses here. SET NX and GET
            // touch one key, so they share a pipeline even on a cluster.
            let key = keys.client_key(&checkpoint.tenant, k);
            let mut pipe = ::redis::pipe();
            pipe.cmd("SET")
                .arg(&key)
                .arg(run.as_str())
                .arg("NX")
                .ignore()
                .cmd("GET")
                .arg(&key);
            let mut con = self.core.con.clone();
            let (owner,): (Option<String>,) =
                self.core.bounded(&what, pipe.query_async(&mut con)).await?;
            let owner = owner.ok_or_else(|| {
                Error::Unavailable(format!("redis: {what}: the client key vanished"))
            })?;
            let owner: RunId = owner
                .parse()
                .map_err(|e| corrupt(run, "client key maps to a bad run id", e))?;
            if &owner != run {
                return Ok((CreateOutcome::Existing(owner), None));
            }
        }
        let meta = Self::record_meta(run, checkpoint)?;
        if checkpoint.transcript_from != 0 {
            return Err(torn_transcript(run, checkpoint.transcript_from, 0));
        }
        let mut script_keys = vec![keys.ckpt(run), keys.events(run), keys.transcript(run)];
        if claim.is_some() {
            script_keys.push(keys.lease(run));
        }
        let mut script = self.core.evalsha(&self.core.scripts.create, &script_keys);
        script
            .arg(checkpoint.version)
            .arg(&checkpoint.body)
            .arg(&checkpoint.status)
            .arg(terminal_arg(checkpoint))
            .arg(checkpoint.updated_at_ms)
            .arg(meta)
            .arg(events.len());
        for (seq, json) in encode_events(run, events)? {
            script.arg(seq).arg(json);
        }
        script.arg(checkpoint.transcript.len());
        for entry in &checkpoint.transcript {
            script.arg(entry);
        }
        if let Some((owner, ttl)) = claim {
            script.arg(owner).arg(ttl.as_millis().max(1) as u64);
        }
        // Indexes before the checkpoint: a crash in between leaves entries readers skip.
        let mut indexes = Vec::new();
        if !checkpoint.terminal {
            let mut c = ::redis::cmd("SADD");
            c.arg(keys.active()).arg(run.as_str());
            indexes.push(c);
        }
        for key in [
            keys.tenant_runs(&checkpoint.tenant),
            keys.tenant_status_runs(&checkpoint.tenant, &checkpoint.status),
            keys.tenant_agent_runs(&checkpoint.tenant, &checkpoint.agent),
        ] {
            let mut c = ::redis::cmd("ZADD");
            c.arg(key).arg(0).arg(run.as_str());
            indexes.push(c);
        }
        if let Some((_, ttl)) = claim {
            // The due time a claim sets (now + ttl: if this node dies, the run is due when
            // its lease lapses); before the script, like the other indexes.
            indexes.push(self.due_cmd(&[run], Some(due_in(ttl))));
        }
        let (code, detail) = self
            .core
            .exec_ordered(&what, indexes, script)
            .await?
            .reply(&what)?;
        match code {
            OK => {
                self.core.remember_listed(checkpoint);
                let lease = match (claim, detail.as_str()) {
                    (Some((owner, _)), token) if !token.is_empty() => Some(Lease {
                        run_id: run.clone(),
                        owner: owner.to_owned(),
                        token: token
                            .parse()
                            .map_err(|e| corrupt(run, "bad lease token", e))?,
                    }),
                    _ => None,
                };
                Ok((CreateOutcome::Created, lease))
            }
            CONFLICT => Err(Error::VersionConflict {
                run: run.clone(),
                expected: 0,
                found: detail.parse().unwrap_or(0),
            }),
            GAP => Err(Error::SequenceGap {
                run: run.clone(),
                seq: detail.parse().unwrap_or(0),
            }),
            TORN => Err(torn_transcript(run, 0, detail.parse().unwrap_or(0))),
            other => Err(Error::Corrupt(format!(
                "run {run}: create script answered code {other}"
            ))),
        }
    }
}

/// Collects queued commits into batches and sends each batch in one round trip, with at most
/// `max_inflight` batches outstanding. Ends when the store (the queue's sender) is dropped.
async fn group_committer(mut rx: mpsc::Receiver<CommitJob>, core: Arc<Core>) {
    let inflight = Arc::new(Semaphore::new(core.cfg.max_inflight.max(1)));
    let max_batch = core.cfg.max_batch.max(1);
    while let Some(first) = rx.recv().await {
        // Wait for a free slot first: while every slot is busy, arriving commits pile up in
        // the queue and go out together in the next batch.
        let Ok(permit) = inflight.clone().acquire_owned().await else {
            break;
        };
        let mut batch = vec![first];
        while batch.len() < max_batch {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let core = core.clone();
        tokio::spawn(async move {
            core.commit_batch(batch).await;
            drop(permit);
        });
    }
}

#[async_trait]
impl CheckpointStore for RedisStore {
    async fn create(
        &self,
        checkpoint: &Checkpoint,
        events: &[EventRecord],
        client_key: Option<&str>,
    ) -> Result<CreateOutcome> {
        Ok(self
            .create_maybe_claimed(checkpoint, events, client_key, None)
            .await?
            .0)
    }

    async fn create_claimed(
        &self,
        checkpoint: &Checkpoint,
        events: &[EventRecord],
        client_key: Option<&str>,
        owner: &str,
        ttl: Duration,
    ) -> Result<(CreateOutcome, Option<Lease>)> {
        self.create_maybe_claimed(checkpoint, events, client_key, Some((owner, ttl)))
            .await
    }

    async fn load(&self, run: &RunId) -> Result<Option<Checkpoint>> {
        let what = format!("loading run {run}");
        let keys = &self.core.keys;
        let cmd = self.core.evalsha(
            &self.core.scripts.load,
            &[keys.ckpt(run), keys.transcript(run)],
        );
        let answer = self
            .core
            .exec_scripts(&what, vec![cmd])
            .await?
            .pop()
            .ok_or_else(|| Error::Corrupt(format!("{what}: empty reply")))?;
        let mut parts: Vec<Option<String>> = ::redis::from_redis_value(answer.value(&what)?)
            .map_err(|e| corrupt(run, "reading the checkpoint", e))?;
        if parts.is_empty() {
            return Ok(None);
        }
        if parts.len() < RECORD_FIELDS.len() {
            return Err(Error::Corrupt(format!("{what}: a short answer")));
        }
        let transcript = parts.split_off(RECORD_FIELDS.len());
        let Some((mut c, first_layout)) = Self::decode_record(run, parts)? else {
            return Ok(None);
        };
        if let Some(doc) = first_layout {
            self.upgrade(&c, &doc).await?;
        }
        c.transcript = transcript
            .into_iter()
            .map(|e| e.ok_or_else(|| Error::Corrupt(format!("{what}: a nil transcript entry"))))
            .collect::<Result<_>>()?;
        Ok(Some(c))
    }

    async fn transcript_entry(&self, run: &RunId, index: u64) -> Result<Option<String>> {
        let what = format!("reading transcript entry {index} of run {run}");
        let Ok(index) = i64::try_from(index) else {
            return Ok(None);
        };
        let mut c = ::redis::cmd("LINDEX");
        c.arg(self.core.keys.transcript(run)).arg(index);
        self.core.query(&what, &c).await
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
        let mut inv = self.core.scripts.claim.prepare_invoke();
        inv.key(self.core.keys.ckpt(run))
            .key(self.core.keys.lease(run))
            .arg(owner)
            .arg(ttl.as_millis().max(1) as u64);
        let what = format!("claiming run {run}");
        let (code, detail) = self.core.script(&what, inv).await?;
        match code {
            OK => {
                let lease = Lease {
                    run_id: run.clone(),
                    owner: owner.to_owned(),
                    token: detail
                        .parse()
                        .map_err(|e| corrupt(run, "bad lease token", e))?,
                };
                // After the claim: if this fails the caller claims again (a newer token).
                self.set_due_many(&what, &[run], Some(due_in(ttl))).await?;
                Ok(lease)
            }
            NOT_FOUND => Err(Error::NotFound(run.clone())),
            HELD => Err(Error::LeaseHeld {
                run: run.clone(),
                owner: detail,
            }),
            other => Err(Error::Corrupt(format!(
                "run {run}: claim script answered code {other}"
            ))),
        }
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let run = &lease.run_id;
        let mut inv = self.core.scripts.release.prepare_invoke();
        inv.key(self.core.keys.ckpt(run))
            .key(self.core.keys.lease(run))
            .arg(lease.token);
        self.core
            .script(&format!("releasing run {run}"), inv)
            .await?;
        Ok(())
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
        let keys = &self.core.keys;
        let ttl_ms = ttl.as_millis().max(1) as u64;
        let mut cmds: Vec<Cmd> = leases
            .iter()
            .map(|l| {
                let mut c = self.core.evalsha(
                    &self.core.scripts.renew,
                    &[keys.ckpt(&l.run_id), keys.lease(&l.run_id)],
                );
                c.arg(owner).arg(l.token).arg(ttl_ms);
                c
            })
            .collect();
        // Due times move in the same round trip, for every lease: one whose renewal fails has
        // another owner (who set its own due time moments ago, so this moves it by at most the
        // renewal interval) or is gone (readers clean such entries).
        let runs: Vec<&RunId> = leases.iter().map(|l| &l.run_id).collect();
        cmds.push(self.due_cmd(&runs, Some(due_in(ttl))));
        let what = format!("renewing {} leases", leases.len());
        let mut answers = self.core.exec_scripts(&what, cmds).await?;
        if let Some(due) = answers.pop() {
            due.value(&what)?;
        }
        let mut lost = Vec::new();
        for (l, a) in leases.iter().zip(answers) {
            match a.reply(&what)? {
                (OK, _) => {}
                (FENCED | HELD, _) => lost.push(l.run_id.clone()),
                (other, _) => {
                    return Err(Error::Corrupt(format!(
                        "run {}: renew script answered code {other}",
                        l.run_id
                    )));
                }
            }
        }
        Ok(lost)
    }

    async fn release_many(&self, leases: &[Lease], due_at_ms: Option<u64>) -> Result<()> {
        if leases.is_empty() {
            return Ok(());
        }
        let keys = &self.core.keys;
        let cmds: Vec<Cmd> = leases
            .iter()
            .map(|l| {
                let mut c = self.core.evalsha(
                    &self.core.scripts.release,
                    &[keys.ckpt(&l.run_id), keys.lease(&l.run_id)],
                );
                c.arg(l.token);
                c
            })
            .collect();
        let what = format!("releasing {} leases", leases.len());
        let answers = self.core.exec_scripts(&what, cmds).await?;
        let mut released = Vec::new();
        for (l, a) in leases.iter().zip(answers) {
            if a.reply(&what)?.1 == "1" {
                released.push(&l.run_id);
            }
        }
        // A second round trip, only for the leases that were still ours: the due time of a
        // run someone else owns now is theirs.
        self.set_due_many(&what, &released, due_at_ms).await
    }

    async fn set_due(&self, run: &RunId, at_ms: Option<u64>) -> Result<()> {
        self.set_due_many(&format!("setting the due time of run {run}"), &[run], at_ms)
            .await
    }

    async fn due_runs(&self, now_ms: u64, limit: usize) -> Result<Vec<RunId>> {
        let key = self.core.keys.due();
        let batch = (limit + 1).clamp(16, 1000);
        let mut out = Vec::new();
        // Entries passed over and kept (live runs, creates in flight), so later pages start
        // after them.
        let mut kept = 0usize;
        for _ in 0..16 {
            if out.len() >= limit {
                break;
            }
            let ids: Vec<String> = self
                .core
                .query(
                    "listing due runs",
                    ::redis::cmd("ZRANGE")
                        .arg(&key)
                        .arg("-inf")
                        .arg(now_ms)
                        .arg("BYSCORE")
                        .arg("LIMIT")
                        .arg(kept)
                        .arg(batch),
                )
                .await?;
            let full = ids.len() == batch;
            let runs = ids
                .iter()
                .map(|id| parse_run(id, "due"))
                .collect::<Result<Vec<_>>>()?;
            let n = runs.len();
            let (live, stale) = self.core.live_runs(runs).await?;
            kept += n - stale.len();
            let stale: Vec<&RunId> = stale.iter().collect();
            self.set_due_many("cleaning the due index", &stale, None)
                .await?;
            out.extend(live);
            if !full {
                break;
            }
        }
        out.truncate(limit);
        Ok(out)
    }

    async fn lease_holder(&self, run: &RunId) -> Result<Option<String>> {
        self.core
            .query(
                &format!("reading the lease of run {run}"),
                ::redis::cmd("HGET")
                    .arg(self.core.keys.lease(run))
                    .arg("owner"),
            )
            .await
    }

    async fn register_node(&self, node_id: &str, instance: &str, ttl: Duration) -> Result<()> {
        self.node_hold(node_id, instance, ttl).await
    }

    async fn heartbeat_node(&self, node_id: &str, instance: &str, ttl: Duration) -> Result<()> {
        self.node_hold(node_id, instance, ttl).await
    }

    async fn unregister_node(&self, node_id: &str, instance: &str) -> Result<()> {
        let mut inv = self.core.scripts.node_release.prepare_invoke();
        inv.key(self.core.keys.node_owner(node_id)).arg(instance);
        self.core
            .script(&format!("releasing node id {node_id}"), inv)
            .await?;
        Ok(())
    }

    async fn notify_node(&self, node_id: &str, run: &RunId) -> Result<()> {
        let _: Value = self
            .core
            .query(
                &format!("waking node {node_id}"),
                ::redis::cmd("XADD")
                    .arg(self.core.keys.node_wake(node_id))
                    .arg("MAXLEN")
                    .arg("~")
                    .arg(WAKE_STREAM_LEN)
                    .arg("*")
                    .arg("r")
                    .arg(run.as_str()),
            )
            .await?;
        Ok(())
    }

    async fn wakeups(
        &self,
        node_id: &str,
        cursor: &str,
        block: Duration,
    ) -> Result<(Vec<RunId>, String)> {
        let key = self.core.keys.node_wake(node_id);
        let block = block.min(MAX_WAKE_BLOCK);
        let what = format!("reading wake-ups of node {node_id}");
        let mut con = self.core.blocking_conn().await?;
        let read = async {
            let from = if cursor.is_empty() {
                Self::stream_tail(&mut con, &key).await?
            } else {
                cursor.to_owned()
            };
            let mut cmd = ::redis::cmd("XREAD");
            cmd.arg("COUNT").arg(WAKE_READ_COUNT);
            if !block.is_zero() {
                cmd.arg("BLOCK").arg(block.as_millis().max(1) as u64);
            }
            cmd.arg("STREAMS").arg(&key).arg(&from);
            type Reply = Option<Vec<(String, Vec<(String, Vec<String>)>)>>;
            let reply: Reply = cmd.query_async(&mut con).await?;
            ::redis::RedisResult::Ok((from, reply))
        };
        let limit = block + self.core.cfg.op_timeout;
        // On a failure or timeout the connection is dropped: its state is unknown.
        let (from, reply) = match tokio::time::timeout(limit, read).await {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => return Err(unavailable(&what, &e)),
            Err(_) => return Err(timed_out(&what, limit)),
        };
        self.core.blocking.lock().await.push(con);
        let mut next = from;
        let mut runs = Vec::new();
        for (_, entries) in reply.unwrap_or_default() {
            for (id, fields) in entries {
                let run = fields
                    .chunks(2)
                    .find(|kv| kv.first().is_some_and(|k| k == "r"))
                    .and_then(|kv| kv.get(1))
                    .map(|r| parse_run(r, "wake-up"))
                    .transpose()?;
                runs.extend(run);
                next = id;
            }
        }
        Ok((runs, next))
    }

    async fn active_runs(&self) -> Result<Vec<RunId>> {
        // SSCAN rather than SMEMBERS: a large set must not block Redis.
        let key = self.core.keys.active();
        let mut cursor: u64 = 0;
        let mut ids = Vec::new();
        loop {
            let (next, batch): (u64, Vec<String>) = self
                .core
                .query(
                    "listing active runs",
                    ::redis::cmd("SSCAN")
                        .arg(&key)
                        .arg(cursor)
                        .arg("COUNT")
                        .arg(1000),
                )
                .await?;
            // One bad entry must not stop the daemon's start: skip it, say so.
            let runs = batch
                .iter()
                .filter_map(|id| {
                    parse_run(id, "active")
                        .inspect_err(
                            |e| tracing::error!(error = %e, "skipping a bad active-index entry"),
                        )
                        .ok()
                })
                .collect::<Vec<_>>();
            let (live, stale) = self.core.live_runs(runs).await?;
            ids.extend(live);
            if !stale.is_empty() {
                let _: Value = self
                    .core
                    .query(
                        "cleaning the active index",
                        ::redis::cmd("SREM")
                            .arg(&key)
                            .arg(stale.iter().map(RunId::as_str).collect::<Vec<_>>()),
                    )
                    .await?;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
        ids.sort();
        ids.dedup();
        Ok(ids)
    }

    async fn list_runs(
        &self,
        tenant: &str,
        filter: &RunFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<RunPage> {
        let keys = &self.core.keys;
        // The narrowest index the filter allows: by status (checking the agent on the way),
        // by agent, or every run of the tenant.
        let key = match (&filter.status, &filter.agent) {
            (Some(status), _) => keys.tenant_status_runs(tenant, status),
            (None, Some(agent)) => keys.tenant_agent_runs(tenant, agent),
            (None, None) => keys.tenant_runs(tenant),
        };
        if filter.status.is_some() || filter.agent.is_some() {
            self.ensure_list_indexes(tenant).await?;
        }
        let batch = (limit + 1).clamp(16, 500);
        let mut items: Vec<Checkpoint> = Vec::new();
        let mut unreadable = Vec::new();
        let mut upper = match cursor {
            // Ids have no `[`/`(`/`-`/`+` prefix issues: they all start with `run_`.
            Some(c) => format!("({c}"),
            None => "+".to_owned(),
        };
        let what = "listing runs";
        loop {
            let ids: Vec<String> = self
                .core
                .query(
                    what,
                    ::redis::cmd("ZREVRANGEBYLEX")
                        .arg(&key)
                        .arg(&upper)
                        .arg("-")
                        .arg("LIMIT")
                        .arg(0)
                        .arg(batch),
                )
                .await?;
            if ids.is_empty() {
                break;
            }
            let mut stale: Vec<&str> = Vec::new();
            let mut runs = Vec::with_capacity(ids.len());
            for id in &ids {
                match parse_run(id, "tenant") {
                    Ok(r) => runs.push(r),
                    Err(e) => {
                        tracing::error!(entry = ?id, error = %e, "a listing index holds an entry that is not a run id; removing it");
                        stale.push(id);
                    }
                }
            }
            let cmds: Vec<Cmd> = runs.iter().map(|r| self.record_read(r)).collect();
            let answers = self.core.exec_many(what, cmds).await?;
            let now = now_ms();
            for (r, a) in runs.iter().zip(answers) {
                let fields: Vec<Option<String>> = ::redis::from_redis_value(a.value(what)?)
                    .map_err(|e| corrupt(r, "reading the checkpoint", e))?;
                let c = match Self::decode_record(r, fields) {
                    Ok(Some((c, _))) => c,
                    Ok(None) => {
                        if is_dangling(r, now) {
                            stale.push(r.as_str());
                        }
                        continue;
                    }
                    Err(e) => {
                        unreadable.push((r.clone(), e.to_string()));
                        continue;
                    }
                };
                let status_ok = filter.status.as_ref().is_none_or(|s| &c.status == s);
                // A finished run never changes status again: its entry in another status's
                // index is stale for good. (A live run's may be the next status, written
                // just before its commit.)
                if !status_ok && c.terminal {
                    stale.push(r.as_str());
                }
                let keep = c.tenant == tenant
                    && status_ok
                    && filter.agent.as_ref().is_none_or(|a| &c.agent == a);
                if keep {
                    items.push(c);
                    if items.len() > limit {
                        break;
                    }
                }
            }
            if !stale.is_empty() {
                let _: Value = self
                    .core
                    .query(
                        "cleaning a listing index",
                        ::redis::cmd("ZREM").arg(&key).arg(&stale),
                    )
                    .await?;
            }
            if items.len() > limit || ids.len() < batch {
                break;
            }
            if let Some(last) = ids.last() {
                upper = format!("({last}");
            }
        }
        let mut page = RunPage::from_newest_first(items, limit);
        page.unreadable = unreadable;
        Ok(page)
    }

    async fn push_control(&self, run: &RunId, control: &Control) -> Result<u64> {
        let record = serde_json::to_string(&StoredControl {
            at_ms: now_ms(),
            control: control.clone(),
        })
        .map_err(|e| corrupt(run, "encoding control", e))?;
        let mut inv = self.core.scripts.push_control.prepare_invoke();
        inv.key(self.core.keys.ckpt(run))
            .key(self.core.keys.controls(run))
            .arg(record);
        let (code, detail) = self
            .core
            .script(&format!("storing a control for run {run}"), inv)
            .await?;
        match code {
            OK => detail
                .parse()
                .map_err(|e| corrupt(run, "bad control seq", e)),
            NOT_FOUND => Err(Error::NotFound(run.clone())),
            other => Err(Error::Corrupt(format!(
                "run {run}: push_control script answered code {other}"
            ))),
        }
    }

    async fn controls(&self, run: &RunId, after: u64) -> Result<Vec<ControlRecord>> {
        let raw: Vec<String> = self
            .core
            .query(
                &format!("reading controls of run {run}"),
                ::redis::cmd("LRANGE")
                    .arg(self.core.keys.controls(run))
                    .arg(after)
                    .arg(-1),
            )
            .await?;
        raw.iter()
            .enumerate()
            .map(|(i, json)| {
                let s: StoredControl =
                    serde_json::from_str(json).map_err(|e| corrupt(run, "decoding control", e))?;
                Ok(ControlRecord {
                    seq: after + 1 + i as u64,
                    at_ms: s.at_ms,
                    control: s.control,
                })
            })
            .collect()
    }

    async fn ping(&self) -> Result<()> {
        let _: String = self.core.query("ping", &::redis::cmd("PING")).await?;
        Ok(())
    }

    async fn epoch(&self) -> Result<String> {
        self.epoch_marker().await
    }
}

#[async_trait]
impl EventLog for RedisStore {
    async fn read(&self, run: &RunId, after: u64, limit: usize) -> Result<Vec<EventRecord>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let entries: Vec<(String, Vec<String>)> = self
            .core
            .query(
                &format!("reading events of run {run}"),
                ::redis::cmd("XRANGE")
                    .arg(self.core.keys.events(run))
                    .arg(format!("{}-0", after.saturating_add(1)))
                    .arg("+")
                    .arg("COUNT")
                    .arg(limit),
            )
            .await?;
        // An entry holds the events of one commit (field `e` once per event, in order) and is
        // named after the last of them, so the first entry may begin at or before `after`.
        let mut events = Vec::new();
        for (id, fields) in entries {
            let mut payloads = fields
                .chunks(2)
                .filter(|kv| kv.first().is_some_and(|k| k == "e"))
                .filter_map(|kv| kv.get(1))
                .peekable();
            if payloads.peek().is_none() {
                return Err(corrupt(run, "event entry without payload", &id));
            }
            for json in payloads {
                let event: EventRecord =
                    serde_json::from_str(json).map_err(|e| corrupt(run, "decoding event", e))?;
                if event.seq > after && events.len() < limit {
                    events.push(event);
                }
            }
        }
        Ok(events)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_name_every_node() {
        assert_eq!(
            cluster_nodes("redis+cluster://a:1,b:2"),
            Some(vec!["redis://a:1".to_owned(), "redis://b:2".to_owned()])
        );
        assert_eq!(
            cluster_nodes("redis+cluster://h:7000/?protocol=resp3"),
            Some(vec!["redis://h:7000?protocol=resp3".to_owned()])
        );
        assert_eq!(cluster_nodes("redis://h:1"), None);
        assert_eq!(cluster_nodes("redis+cluster://"), Some(vec![]));
    }
}
