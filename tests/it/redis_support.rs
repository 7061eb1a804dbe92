//! Store-test helpers: checkpoint/event builders, store constructors for each backend (Redis on
//! 127.0.0.1:6379 with a unique namespace; skipped outside CI when unreachable, a failure under
//! `CI=true`), a private `redis-server` on a unix socket for fault tests, and deadline polling.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agentd::ids::RunId;
use agentd::store::redis::{RedisConfig, RedisStore};
use agentd::store::{Checkpoint, EventRecord};
use serde_json::json;

/// The shared Redis used by contract tests (override with `AGENTD_TEST_REDIS_URL`).
pub fn shared_redis_url() -> String {
    std::env::var("AGENTD_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/0".into())
}

pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// Skips (outside CI) or fails (under CI) a test whose Redis prerequisite is missing.
/// Returns `true` when the caller should return early.
pub fn skip_or_fail(what: &str) -> bool {
    if in_ci() {
        panic!("{what} (CI=true: Redis tests must not be skipped)");
    }
    eprintln!("SKIPPED: {what} (set CI=true to make this a failure)");
    true
}

pub fn unique_ns() -> String {
    format!("it-{}", uuid::Uuid::new_v4().simple())
}

/// A Redis store on the shared server with a fresh namespace, or `None` (skip) when it is
/// unreachable outside CI.
pub async fn shared_redis(cfg: impl FnOnce(RedisConfig) -> RedisConfig) -> Option<RedisStore> {
    let ns = unique_ns();
    let url = shared_redis_url();
    let config = cfg(RedisConfig::new(&url)
        .namespace(&ns)
        .op_timeout(Duration::from_secs(5)));
    match RedisStore::open(config).await {
        Ok(s) => Some(s),
        Err(e) => {
            skip_or_fail(&format!("redis at {url} unreachable: {e}"));
            None
        }
    }
}

/// Deletes every key of a namespace (SCAN with a pattern built only from the checked namespace).
pub async fn drop_namespace(ns: &str) {
    let Ok(client) = redis::Client::open(shared_redis_url()) else {
        return;
    };
    let Ok(mut con) = client.get_multiplexed_async_connection().await else {
        return;
    };
    let mut cursor: u64 = 0;
    loop {
        let r: redis::RedisResult<(u64, Vec<String>)> = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{ns}:*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut con)
            .await;
        let Ok((next, keys)) = r else { return };
        if !keys.is_empty() {
            let _: redis::RedisResult<()> =
                redis::cmd("DEL").arg(&keys).query_async(&mut con).await;
        }
        if next == 0 {
            return;
        }
        cursor = next;
    }
}

pub fn ckpt(run: &RunId, tenant: &str, version: u64) -> Checkpoint {
    Checkpoint {
        run_id: run.clone(),
        tenant: tenant.to_owned(),
        agent: "demo".to_owned(),
        status: "running".to_owned(),
        terminal: false,
        version,
        created_at_ms: 1_700_000_000_000,
        updated_at_ms: 1_700_000_000_000 + version,
        body: json!({"turn": version, "note": "opaque"}).to_string(),
        transcript: Vec::new(),
        transcript_from: 0,
    }
}

pub fn ev(seq: u64) -> EventRecord {
    EventRecord {
        seq,
        at_ms: 1_700_000_000_000 + seq,
        kind: if seq == 1 { "run_created" } else { "step" }.to_owned(),
        data: json!({"seq": seq}),
    }
}

/// Polls `f` until it returns `Some`, or panics at the deadline. Use instead of sleeping.
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A private `redis-server` on a unix socket in a temp dir, without persistence, so a restart
/// comes back empty (or, from `start_persistent`, with an append-only file fsynced on every
/// write, so a restart — even after SIGKILL — comes back with every acknowledged write).
pub struct PrivateRedis {
    child: Option<Child>,
    dir: tempfile::TempDir,
    persistent: bool,
}

impl PrivateRedis {
    /// Starts the server, or `None` (skip outside CI) when `redis-server` is not installed.
    pub async fn start() -> Option<Self> {
        Self::start_with(false).await
    }

    /// Starts a server with `appendonly yes` and `appendfsync always` in its temp dir.
    pub async fn start_persistent() -> Option<Self> {
        Self::start_with(true).await
    }

    async fn start_with(persistent: bool) -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let mut me = PrivateRedis {
            child: None,
            dir,
            persistent,
        };
        match me.spawn() {
            Ok(()) => {}
            Err(e) => {
                skip_or_fail(&format!("cannot start redis-server: {e}"));
                return None;
            }
        }
        me.wait_ready().await;
        Some(me)
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("redis.sock")
    }

    pub fn url(&self) -> String {
        format!("redis+unix://{}", self.socket().display())
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let sock = self.socket();
        let _ = std::fs::remove_file(&sock);
        let persistence: &[&str] = if self.persistent {
            &["--appendonly", "yes", "--appendfsync", "always"]
        } else {
            &["--appendonly", "no"]
        };
        let child = Command::new("redis-server")
            .args(["--port", "0", "--unixsocket"])
            .arg(&sock)
            .args(["--save", ""])
            .args(persistence)
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    async fn wait_ready(&self) {
        let sock = self.socket();
        eventually(
            "redis-server to accept connections",
            Duration::from_secs(10),
            || {
                let sock = sock.clone();
                async move { ping_socket(&sock).then_some(()) }
            },
        )
        .await;
    }

    /// SIGKILLs the server and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same socket and data dir: empty, or (persistent) with
    /// its data.
    pub async fn restart(&mut self) {
        self.kill();
        self.spawn().unwrap();
        self.wait_ready().await;
    }

    /// Sends a signal (`STOP`, `CONT`) to the server.
    pub fn signal(&self, sig: &str) {
        if let Some(c) = &self.child {
            let ok = Command::new("kill")
                .arg(format!("-{sig}"))
                .arg(c.id().to_string())
                .status()
                .unwrap()
                .success();
            assert!(ok, "kill -{sig} failed");
        }
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.signal_quiet("CONT");
        self.kill();
    }
}

impl PrivateRedis {
    fn signal_quiet(&self, sig: &str) {
        if let Some(c) = &self.child {
            let _ = Command::new("kill")
                .arg(format!("-{sig}"))
                .arg(c.id().to_string())
                .status();
        }
    }
}

fn ping_socket(sock: &Path) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::os::unix::net::UnixStream::connect(sock) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 16];
    matches!(s.read(&mut buf), Ok(n) if buf[..n].starts_with(b"+PONG"))
}
