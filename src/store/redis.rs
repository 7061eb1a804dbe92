//! `RedisStore`: the production store on Redis. Each write is one Lua script over keys of one
//! run (see `keys`), so it is atomic; concurrent commits are group-committed into pipelines of
//! EVALSHA calls by a background task; every call is bounded by a timeout.
//!
//! Semantics match the in-memory reference: a create or commit retried after an ambiguous
//! failure (the same checkpoint is already stored) succeeds instead of reporting a false
//! conflict. Not Redis Cluster-ready yet: the create/commit scripts also touch the global
//! `active` and per-tenant index keys, which live in other slots.

use std::sync::Arc;
use std::time::Duration;

use ::redis::aio::ConnectionManager;
use ::redis::{AsyncConnectionConfig, Client, Cmd, RedisError, Script, ServerErrorKind, Value};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::keys::{DEFAULT_NAMESPACE, Keys};
use super::{
    Checkpoint, CheckpointStore, Control, ControlRecord, CreateOutcome, Error, EventLog,
    EventRecord, Lease, Result, RunFilter, RunPage, corrupt, encode_events,
};
use crate::clock::now_ms;
use crate::ids::RunId;

/// How to reach Redis and how long to wait for it.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// A redis crate URL: `redis://host:port/db` or `redis+unix:///path/to/sock`.
    pub url: String,
    /// Key prefix (see `keys::Keys::new` for the charset).
    pub namespace: String,
    /// Upper bound for one store operation, reconnects included (not the crate's 500 ms).
    pub op_timeout: Duration,
    /// Upper bound for establishing one connection.
    pub connect_timeout: Duration,
    /// Batch concurrent commits into pipelines. Off: one EVALSHA round trip per commit.
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

    pub fn namespace(mut self, ns: impl Into<String>) -> Self {
        self.namespace = ns.into();
        self
    }

    pub fn op_timeout(mut self, d: Duration) -> Self {
        self.op_timeout = d;
        self
    }

    pub fn group_commit(mut self, on: bool) -> Self {
        self.group_commit = on;
        self
    }
}

// Script replies are `{code, detail}`; the scripts never raise, so one bad commit cannot fail
// the other commits of its pipeline.
const OK: i64 = 0;
const REPLAYED: i64 = 1;
const NOT_FOUND: i64 = 2;
const FENCED: i64 = 3;
const CONFLICT: i64 = 4;
const GAP: i64 = 5;
const EXISTING: i64 = 6;
const HELD: i64 = 7;

/// KEYS: ckpt, events, active, tenant_runs, [client_key].
/// ARGV: run_id, version, doc, status, terminal(0|1), n, then n × (seq, event json).
const CREATE_LUA: &str = r#"
if #KEYS >= 5 then
  local existing = redis.call('GET', KEYS[5])
  if existing then return {6, existing} end
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  -- A retry of an applied create (reply lost) is not a conflict.
  if redis.call('HGET', KEYS[1], 'doc') == ARGV[3] then return {0, ''} end
  return {4, tostring(redis.call('HGET', KEYS[1], 'v') or '0')}
end
local n = tonumber(ARGV[6])
for i = 1, n do
  if tonumber(ARGV[5 + 2 * i]) ~= i then return {5, ARGV[5 + 2 * i]} end
end
for i = 1, n do
  redis.call('XADD', KEYS[2], ARGV[5 + 2 * i] .. '-0', 'e', ARGV[6 + 2 * i])
end
redis.call('HSET', KEYS[1], 'v', ARGV[2], 'doc', ARGV[3], 'status', ARGV[4],
  'terminal', ARGV[5], 'seq', n, 'tokens', 0)
if ARGV[5] ~= '1' then redis.call('SADD', KEYS[3], ARGV[1]) end
redis.call('ZADD', KEYS[4], 0, ARGV[1])
if #KEYS >= 5 then redis.call('SET', KEYS[5], ARGV[1]) end
return {0, ''}
"#;

/// KEYS: ckpt, events, active.
/// ARGV: token, expected, new_version, doc, status, terminal(0|1), run_id, n, then n × (seq, json).
const COMMIT_LUA: &str = r#"
if redis.call('EXISTS', KEYS[1]) == 0 then return {2, ''} end
local h = redis.call('HMGET', KEYS[1], 'fence', 'v', 'seq')
if h[1] ~= ARGV[1] then return {3, ''} end
local v = tonumber(h[2])
local last = tonumber(h[3])
local n = tonumber(ARGV[8])
if v ~= tonumber(ARGV[2]) then
  -- The document is read only here (rare path): it can be large.
  if v == tonumber(ARGV[3]) and (n == 0 or tonumber(ARGV[7 + 2 * n]) == last)
     and redis.call('HGET', KEYS[1], 'doc') == ARGV[4] then
    return {1, tostring(v)}
  end
  return {4, tostring(v)}
end
for i = 1, n do
  if tonumber(ARGV[7 + 2 * i]) ~= last + i then return {5, ARGV[7 + 2 * i]} end
end
for i = 1, n do
  redis.call('XADD', KEYS[2], ARGV[7 + 2 * i] .. '-0', 'e', ARGV[8 + 2 * i])
end
redis.call('HSET', KEYS[1], 'v', ARGV[3], 'doc', ARGV[4], 'status', ARGV[5],
  'terminal', ARGV[6], 'seq', last + n)
if ARGV[6] == '1' then
  redis.call('SREM', KEYS[3], ARGV[7])
else
  redis.call('SADD', KEYS[3], ARGV[7])
end
return {0, ARGV[3]}
"#;

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

/// KEYS: ckpt, lease. ARGV: token.
const RELEASE_LUA: &str = r#"
if redis.call('HGET', KEYS[1], 'fence') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'fence')
  redis.call('DEL', KEYS[2])
end
return {0, ''}
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

/// A control as stored in the inbox list; its seq is its position.
#[derive(Serialize, Deserialize)]
struct StoredControl {
    at_ms: u64,
    control: Control,
}

struct Scripts {
    create: Script,
    commit: Script,
    claim: Script,
    release: Script,
    push_control: Script,
    epoch: Script,
}

impl Scripts {
    fn new() -> Self {
        Scripts {
            create: Script::new(CREATE_LUA),
            commit: Script::new(COMMIT_LUA),
            claim: Script::new(CLAIM_LUA),
            release: Script::new(RELEASE_LUA),
            push_control: Script::new(PUSH_CONTROL_LUA),
            epoch: Script::new(EPOCH_LUA),
        }
    }
}

/// One commit waiting for the group committer.
struct CommitJob {
    run: RunId,
    expected: u64,
    token: u64,
    cmd: Cmd,
    reply: oneshot::Sender<Result<()>>,
}

/// The Redis [`CheckpointStore`] + [`EventLog`].
pub struct RedisStore {
    con: ConnectionManager,
    keys: Keys,
    cfg: RedisConfig,
    scripts: Arc<Scripts>,
    queue: Option<mpsc::Sender<CommitJob>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("namespace", &self.keys.namespace())
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
        other => Err(Error::Corrupt(format!(
            "run {run}: commit script answered code {other}"
        ))),
    }
}

fn terminal_arg(c: &Checkpoint) -> &'static str {
    if c.terminal { "1" } else { "0" }
}

impl RedisStore {
    /// Connects (bounded by `connect_timeout` + `op_timeout`), loads the scripts and writes the
    /// namespace's epoch marker if it is missing.
    pub async fn open(cfg: RedisConfig) -> Result<Self> {
        let keys = Keys::new(&cfg.namespace).map_err(|e| Error::Unavailable(e.to_string()))?;
        let client = Client::open(cfg.url.as_str())
            .map_err(|e| Error::Unavailable(format!("redis: bad url: {e}")))?;
        let mgr_cfg = ::redis::aio::ConnectionManagerConfig::new()
            .set_response_timeout(Some(cfg.op_timeout))
            .set_connection_timeout(Some(cfg.connect_timeout))
            .set_number_of_retries(3)
            .set_max_delay(Duration::from_secs(1));
        let wait = cfg.connect_timeout + cfg.op_timeout;
        let con = tokio::time::timeout(wait, client.get_connection_manager_with_config(mgr_cfg))
            .await
            .map_err(|_| timed_out("connecting", wait))?
            .map_err(|e| unavailable("connecting", &e))?;
        let scripts = Arc::new(Scripts::new());
        let queue = if cfg.group_commit {
            let (tx, rx) = mpsc::channel(cfg.queue_capacity.max(1));
            tokio::spawn(group_committer(
                rx,
                con.clone(),
                scripts.clone(),
                cfg.clone(),
            ));
            Some(tx)
        } else {
            None
        };
        let store = RedisStore {
            con,
            keys,
            cfg,
            scripts,
            queue,
        };
        store.load_scripts().await?;
        store.epoch_marker().await?;
        Ok(store)
    }

    /// The key layout in use.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// A dedicated connection (for blocking reads such as `XREAD BLOCK`) with no response
    /// timeout; never use the shared manager for those.
    pub async fn blocking_connection(&self) -> Result<::redis::aio::MultiplexedConnection> {
        let client = Client::open(self.cfg.url.as_str())
            .map_err(|e| Error::Unavailable(format!("redis: bad url: {e}")))?;
        let c = AsyncConnectionConfig::new()
            .set_response_timeout(None)
            .set_connection_timeout(Some(self.cfg.connect_timeout));
        tokio::time::timeout(
            self.cfg.connect_timeout,
            client.get_multiplexed_async_connection_with_config(&c),
        )
        .await
        .map_err(|_| timed_out("connecting", self.cfg.connect_timeout))?
        .map_err(|e| unavailable("connecting", &e))
    }

    async fn load_scripts(&self) -> Result<()> {
        let s = &self.scripts;
        for script in [
            &s.create,
            &s.commit,
            &s.claim,
            &s.release,
            &s.push_control,
            &s.epoch,
        ] {
            let mut con = self.con.clone();
            self.bounded("loading scripts", script.load_async(&mut con))
                .await?;
        }
        Ok(())
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

    async fn script(
        &self,
        what: &str,
        inv: ::redis::ScriptInvocation<'_>,
    ) -> Result<(i64, String)> {
        let mut con = self.con.clone();
        let v: Value = self.bounded(what, inv.invoke_async(&mut con)).await?;
        parse_reply(v).map_err(|e| Error::Corrupt(format!("{what}: {e}")))
    }

    async fn epoch_marker(&self) -> Result<String> {
        let fresh = uuid::Uuid::new_v4().simple().to_string();
        let mut inv = self.scripts.epoch.prepare_invoke();
        inv.key(self.keys.epoch()).arg(fresh);
        let (_, epoch) = self.script("reading the epoch marker", inv).await?;
        Ok(epoch)
    }

    fn commit_cmd(
        &self,
        lease: &Lease,
        checkpoint: &Checkpoint,
        expected: u64,
        events: &[EventRecord],
    ) -> Result<Cmd> {
        let run = &checkpoint.run_id;
        let doc = serde_json::to_string(checkpoint)
            .map_err(|e| corrupt(run, "encoding checkpoint", e))?;
        let events = encode_events(run, events)?;
        let mut cmd = ::redis::cmd("EVALSHA");
        cmd.arg(self.scripts.commit.get_hash())
            .arg(3)
            .arg(self.keys.ckpt(run))
            .arg(self.keys.events(run))
            .arg(self.keys.active())
            .arg(lease.token)
            .arg(expected)
            .arg(checkpoint.version)
            .arg(doc)
            .arg(&checkpoint.status)
            .arg(terminal_arg(checkpoint))
            .arg(run.as_str())
            .arg(events.len());
        for (seq, json) in events {
            cmd.arg(seq).arg(json);
        }
        Ok(cmd)
    }

    async fn commit_direct(&self, job: CommitJob) -> Result<()> {
        let CommitJob {
            run,
            expected,
            token,
            cmd,
            ..
        } = job;
        let mut results = run_batch(&self.con, &self.scripts, &self.cfg, vec![cmd]).await?;
        let v = results
            .pop()
            .ok_or_else(|| Error::Corrupt(format!("run {run}: empty commit reply")))?;
        let (code, detail) = v?;
        commit_outcome(&run, expected, token, code, &detail)
    }

    fn decode_checkpoint(run: &RunId, doc: &str) -> Result<Checkpoint> {
        serde_json::from_str(doc).map_err(|e| corrupt(run, "decoding checkpoint", e))
    }
}

/// Sends one pipeline of EVALSHA commands and returns each command's `{code, detail}`. A
/// NOSCRIPT (Redis restarted and lost its script cache) loads the scripts and resends once;
/// resending is safe because a commit that did apply is recognised as a replay.
async fn run_batch(
    con: &ConnectionManager,
    scripts: &Scripts,
    cfg: &RedisConfig,
    cmds: Vec<Cmd>,
) -> Result<Vec<Result<(i64, String)>>> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let mut pipe = ::redis::pipe();
        pipe.ignore_errors();
        for c in &cmds {
            pipe.add_command(c.clone());
        }
        let mut c = con.clone();
        let values: Vec<Value> =
            match tokio::time::timeout(cfg.op_timeout, pipe.query_async(&mut c)).await {
                Ok(Ok(v)) => v,
                Ok(Err(e)) => return Err(unavailable("committing", &e)),
                Err(_) => return Err(timed_out("committing", cfg.op_timeout)),
            };
        let noscript = values.iter().any(
            |v| matches!(v, Value::ServerError(e) if e.kind() == Some(ServerErrorKind::NoScript)),
        );
        if noscript && attempt == 1 {
            let mut c = con.clone();
            match tokio::time::timeout(cfg.op_timeout, scripts.commit.load_async(&mut c)).await {
                Ok(Ok(_)) => continue,
                Ok(Err(e)) => return Err(unavailable("loading the commit script", &e)),
                Err(_) => return Err(timed_out("loading the commit script", cfg.op_timeout)),
            }
        }
        return Ok(values
            .into_iter()
            .map(|v| match v {
                Value::ServerError(e) => Err(Error::Unavailable(format!("redis: commit: {e:?}"))),
                v => parse_reply(v).map_err(Error::Corrupt),
            })
            .collect());
    }
}

/// Collects queued commits into batches and sends each batch as one pipeline, with at most
/// `max_inflight` pipelines outstanding. Ends when the store (the queue's sender) is dropped.
async fn group_committer(
    mut rx: mpsc::Receiver<CommitJob>,
    con: ConnectionManager,
    scripts: Arc<Scripts>,
    cfg: RedisConfig,
) {
    let inflight = Arc::new(Semaphore::new(cfg.max_inflight.max(1)));
    let max_batch = cfg.max_batch.max(1);
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
        let con = con.clone();
        let scripts = scripts.clone();
        let cfg = cfg.clone();
        tokio::spawn(async move {
            let cmds: Vec<Cmd> = batch.iter().map(|j| j.cmd.clone()).collect();
            match run_batch(&con, &scripts, &cfg, cmds).await {
                Ok(results) => {
                    for (job, r) in batch.into_iter().zip(results) {
                        let out = r.and_then(|(code, detail)| {
                            commit_outcome(&job.run, job.expected, job.token, code, &detail)
                        });
                        let _ = job.reply.send(out);
                    }
                }
                Err(e) => {
                    for job in batch {
                        let _ = job.reply.send(Err(e.clone()));
                    }
                }
            }
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
        let run = &checkpoint.run_id;
        let doc = serde_json::to_string(checkpoint)
            .map_err(|e| corrupt(run, "encoding checkpoint", e))?;
        let mut inv = self.scripts.create.prepare_invoke();
        inv.key(self.keys.ckpt(run))
            .key(self.keys.events(run))
            .key(self.keys.active())
            .key(self.keys.tenant_runs(&checkpoint.tenant));
        if let Some(k) = client_key {
            inv.key(self.keys.client_key(&checkpoint.tenant, k));
        }
        inv.arg(run.as_str())
            .arg(checkpoint.version)
            .arg(doc)
            .arg(&checkpoint.status)
            .arg(terminal_arg(checkpoint))
            .arg(events.len());
        for (seq, json) in encode_events(run, events)? {
            inv.arg(seq).arg(json);
        }
        let what = format!("creating run {run}");
        let (code, detail) = self.script(&what, inv).await?;
        match code {
            OK => Ok(CreateOutcome::Created),
            EXISTING => detail
                .parse()
                .map(CreateOutcome::Existing)
                .map_err(|e| corrupt(run, "client key maps to a bad run id", e)),
            CONFLICT => Err(Error::VersionConflict {
                run: run.clone(),
                expected: 0,
                found: detail.parse().unwrap_or(0),
            }),
            GAP => Err(Error::SequenceGap {
                run: run.clone(),
                seq: detail.parse().unwrap_or(0),
            }),
            other => Err(Error::Corrupt(format!(
                "run {run}: create script answered code {other}"
            ))),
        }
    }

    async fn load(&self, run: &RunId) -> Result<Option<Checkpoint>> {
        let mut con = self.con.clone();
        let what = format!("loading run {run}");
        let doc: Option<String> = self
            .bounded(
                &what,
                ::redis::cmd("HGET")
                    .arg(self.keys.ckpt(run))
                    .arg("doc")
                    .query_async(&mut con),
            )
            .await?;
        doc.map(|d| Self::decode_checkpoint(run, &d)).transpose()
    }

    async fn commit(
        &self,
        lease: &Lease,
        checkpoint: &Checkpoint,
        expected_version: u64,
        events: &[EventRecord],
    ) -> Result<()> {
        let run = checkpoint.run_id.clone();
        let cmd = self.commit_cmd(lease, checkpoint, expected_version, events)?;
        let (reply, wait) = oneshot::channel();
        let job = CommitJob {
            run: run.clone(),
            expected: expected_version,
            token: lease.token,
            cmd,
            reply,
        };
        let Some(queue) = &self.queue else {
            return self.commit_direct(job).await;
        };
        let t = self.cfg.op_timeout;
        queue.send_timeout(job, t).await.map_err(|_| {
            Error::Unavailable(format!(
                "redis: committing run {run}: commit queue full for {t:?}"
            ))
        })?;
        // The batch's own timeout is `op_timeout`; allow it to queue behind other batches.
        let limit = t * 2;
        match tokio::time::timeout(limit, wait).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Error::Unavailable(format!(
                "redis: committing run {run}: group committer stopped"
            ))),
            Err(_) => Err(timed_out(&format!("committing run {run}"), limit)),
        }
    }

    async fn claim(&self, run: &RunId, owner: &str, ttl: Duration) -> Result<Lease> {
        let mut inv = self.scripts.claim.prepare_invoke();
        inv.key(self.keys.ckpt(run))
            .key(self.keys.lease(run))
            .arg(owner)
            .arg(ttl.as_millis().max(1) as u64);
        let (code, detail) = self.script(&format!("claiming run {run}"), inv).await?;
        match code {
            OK => Ok(Lease {
                run_id: run.clone(),
                owner: owner.to_owned(),
                token: detail
                    .parse()
                    .map_err(|e| corrupt(run, "bad lease token", e))?,
            }),
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
        let mut inv = self.scripts.release.prepare_invoke();
        inv.key(self.keys.ckpt(run))
            .key(self.keys.lease(run))
            .arg(lease.token);
        self.script(&format!("releasing run {run}"), inv).await?;
        Ok(())
    }

    async fn active_runs(&self) -> Result<Vec<RunId>> {
        // SSCAN rather than SMEMBERS: a large set must not block Redis.
        let key = self.keys.active();
        let mut cursor: u64 = 0;
        let mut ids = Vec::new();
        loop {
            let mut con = self.con.clone();
            let (next, batch): (u64, Vec<String>) = self
                .bounded(
                    "listing active runs",
                    ::redis::cmd("SSCAN")
                        .arg(&key)
                        .arg(cursor)
                        .arg("COUNT")
                        .arg(1000)
                        .query_async(&mut con),
                )
                .await?;
            for id in batch {
                ids.push(
                    id.parse::<RunId>()
                        .map_err(|e| Error::Corrupt(format!("active index holds {id:?}: {e}")))?,
                );
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
        let key = self.keys.tenant_runs(tenant);
        let batch = (limit + 1).clamp(16, 500);
        let mut items: Vec<Checkpoint> = Vec::new();
        let mut upper = match cursor {
            // Ids have no `[`/`(`/`-`/`+` prefix issues: they all start with `run_`.
            Some(c) => format!("({c}"),
            None => "+".to_owned(),
        };
        loop {
            let mut con = self.con.clone();
            let ids: Vec<String> = self
                .bounded(
                    "listing runs",
                    ::redis::cmd("ZREVRANGEBYLEX")
                        .arg(&key)
                        .arg(&upper)
                        .arg("-")
                        .arg("LIMIT")
                        .arg(0)
                        .arg(batch)
                        .query_async(&mut con),
                )
                .await?;
            if ids.is_empty() {
                break;
            }
            let runs: Vec<RunId> = ids
                .iter()
                .map(|id| {
                    id.parse::<RunId>()
                        .map_err(|e| Error::Corrupt(format!("tenant index holds {id:?}: {e}")))
                })
                .collect::<Result<_>>()?;
            let mut pipe = ::redis::pipe();
            for r in &runs {
                pipe.cmd("HGET").arg(self.keys.ckpt(r)).arg("doc");
            }
            let mut con = self.con.clone();
            let docs: Vec<Option<String>> = self
                .bounded("listing runs", pipe.query_async(&mut con))
                .await?;
            for (r, doc) in runs.iter().zip(docs) {
                let Some(doc) = doc else { continue };
                let c = Self::decode_checkpoint(r, &doc)?;
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
            if items.len() > limit || ids.len() < batch {
                break;
            }
            if let Some(last) = ids.last() {
                upper = format!("({last}");
            }
        }
        Ok(RunPage::from_newest_first(items, limit))
    }

    async fn push_control(&self, run: &RunId, control: &Control) -> Result<u64> {
        let record = serde_json::to_string(&StoredControl {
            at_ms: now_ms(),
            control: control.clone(),
        })
        .map_err(|e| corrupt(run, "encoding control", e))?;
        let mut inv = self.scripts.push_control.prepare_invoke();
        inv.key(self.keys.ckpt(run))
            .key(self.keys.controls(run))
            .arg(record);
        let (code, detail) = self
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
        let mut con = self.con.clone();
        let raw: Vec<String> = self
            .bounded(
                &format!("reading controls of run {run}"),
                ::redis::cmd("LRANGE")
                    .arg(self.keys.controls(run))
                    .arg(after)
                    .arg(-1)
                    .query_async(&mut con),
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
        let mut con = self.con.clone();
        let _: String = self
            .bounded("ping", ::redis::cmd("PING").query_async(&mut con))
            .await?;
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
        let mut con = self.con.clone();
        let entries: Vec<(String, Vec<String>)> = self
            .bounded(
                &format!("reading events of run {run}"),
                ::redis::cmd("XRANGE")
                    .arg(self.keys.events(run))
                    .arg(format!("{}-0", after.saturating_add(1)))
                    .arg("+")
                    .arg("COUNT")
                    .arg(limit)
                    .query_async(&mut con),
            )
            .await?;
        entries
            .into_iter()
            .map(|(id, fields)| {
                let json = fields
                    .chunks(2)
                    .find(|kv| kv.first().is_some_and(|k| k == "e"))
                    .and_then(|kv| kv.get(1))
                    .ok_or_else(|| corrupt(run, "event entry without payload", &id))?;
                serde_json::from_str(json).map_err(|e| corrupt(run, "decoding event", e))
            })
            .collect()
    }
}
