//! Durability harness: `ChildDaemon` (a real `agentd serve` process that can be SIGKILLed,
//! SIGTERMed and restarted on the same store), and the event-log oracle shared by the chaos,
//! shutdown and durability tests (I4 integrity, the intents each log made durable, parks).
#![allow(dead_code)]

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use agentd::ids::RunId;
use agentd::store::{EventRecord, SharedStore};
use serde_json::Value;

/// An `agentd serve` child process. Logs (stdout) are appended to a file; stderr is read for
/// the address line. Killed (SIGKILL) when dropped.
pub struct ChildDaemon {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub base: String,
    pub http: reqwest::Client,
    log: std::path::PathBuf,
    /// What it printed to stderr before its address line (e.g. the demo token).
    pub banner: Vec<String>,
}

impl ChildDaemon {
    /// Starts `agentd serve --config <config>` and returns once it has printed its address (its
    /// runtime may still be recovering: see `wait_ready`).
    pub async fn spawn(config: &Path, log: &Path) -> ChildDaemon {
        Self::spawn_with(config, log, &[], "info").await
    }

    /// `spawn` with extra global arguments (e.g. `--log-format json`) and a `RUST_LOG` filter.
    pub async fn spawn_with(
        config: &Path,
        log: &Path,
        global_args: &[&str],
        rust_log: &str,
    ) -> ChildDaemon {
        let serve = ["--config", config.to_str().unwrap()];
        Self::spawn_serve(&serve, None, log, global_args, rust_log).await
    }

    /// `agentd [global_args] serve [serve_args] --listen 127.0.0.1:0` in `cwd`, returning once
    /// it has printed its address.
    pub async fn spawn_serve(
        serve_args: &[&str],
        cwd: Option<&Path>,
        log: &Path,
        global_args: &[&str],
        rust_log: &str,
    ) -> ChildDaemon {
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_agentd"));
        if let Some(dir) = cwd {
            cmd.current_dir(dir);
        }
        let mut child = cmd
            .args(global_args)
            .arg("serve")
            .args(serve_args)
            .args(["--listen", "127.0.0.1:0"])
            .env_remove("AGENTD_TOKEN")
            .env("RUST_LOG", rust_log)
            .stdout(Stdio::from(out))
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel::<String>();
        let mut err_log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let base = tokio::task::spawn_blocking(move || {
            let deadline = Instant::now() + Duration::from_secs(30);
            let mut banner = Vec::new();
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left) {
                    Ok(line) => {
                        if let Some(addr) = line.strip_prefix("agentd listening on ") {
                            // Keep draining stderr (into the log) so the child never blocks.
                            std::thread::spawn(move || {
                                use std::io::Write;
                                for line in rx {
                                    let _ = writeln!(err_log, "[stderr] {line}");
                                }
                            });
                            return Ok((addr.trim().to_owned(), banner));
                        }
                        banner.push(line);
                    }
                    Err(e) => return Err(format!("no address line from agentd: {e}")),
                }
            }
        })
        .await
        .unwrap();
        let (base, banner) = match base {
            Ok(b) => b,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{e}; log: {}", tail(log, 40));
            }
        };
        ChildDaemon {
            child,
            base,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(20))
                .build()
                .unwrap(),
            log: log.to_owned(),
            banner,
        }
    }

    /// `spawn`, then `wait_ready`.
    pub async fn start(config: &Path, log: &Path) -> ChildDaemon {
        let d = Self::spawn(config, log).await;
        d.wait_ready(Duration::from_secs(30)).await;
        d
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Polls `/readyz` until it answers 200.
    pub async fn wait_ready(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(r) = self.http.get(format!("{}/readyz", self.base)).send().await
                && r.status() == reqwest::StatusCode::OK
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "agentd not ready within {within:?}; log:\n{}",
                tail(&self.log, 40)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL, and reap the process.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} failed");
    }

    /// Waits for the process to exit (polling), or `None` at the deadline.
    pub async fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn get(&self, path: &str, token: &str) -> (reqwest::StatusCode, Value) {
        let r = self
            .http
            .get(format!("{}{path}", self.base))
            .bearer_auth(token)
            .send()
            .await
            .unwrap();
        let s = r.status();
        (s, r.json().await.unwrap_or(Value::Null))
    }

    pub async fn post(
        &self,
        path: &str,
        token: &str,
        body: &Value,
    ) -> Result<(reqwest::StatusCode, Value), reqwest::Error> {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(token)
            .json(body)
            .send()
            .await?;
        let s = r.status();
        Ok((s, r.json().await?))
    }
}

impl Drop for ChildDaemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The last `n` lines of a file, for failure messages.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

pub fn is_terminal_kind(kind: &str) -> bool {
    matches!(kind, "run_succeeded" | "run_failed" | "run_cancelled")
}

pub fn is_settled(status: &str) -> bool {
    matches!(
        status,
        "succeeded" | "failed" | "cancelled" | "waiting_approval" | "waiting_input"
    )
}

/// What one run's event log says.
#[derive(Debug, Default, Clone)]
pub struct LogFacts {
    pub events: usize,
    /// `dispatched` intents per idempotency key.
    pub dispatched: HashMap<String, u32>,
    pub resumed: u32,
    pub started: u32,
    /// Calls parked as `outcome_unknown` by a resume.
    pub parked_unknown: u32,
    pub terminal: Option<String>,
    /// I4 violations (empty when the log is sound).
    pub violations: Vec<String>,
}

/// Checks a run's log (I4: seq 1..n without gaps or duplicates, `run_created` first, exactly
/// one `run_started`, at most one terminal event and nothing but ignored late results after
/// it, exactly one when the run is terminal) and collects the intents it made durable.
pub fn check_log(id: &RunId, events: &[EventRecord], terminal_status: bool) -> LogFacts {
    let mut f = LogFacts {
        events: events.len(),
        ..Default::default()
    };
    for (i, e) in events.iter().enumerate() {
        if e.seq != i as u64 + 1 {
            f.violations
                .push(format!("{id}: event #{} has seq {}", i + 1, e.seq));
            break;
        }
    }
    if events.first().map(|e| e.kind.as_str()) != Some("run_created") {
        f.violations
            .push(format!("{id}: first event is not run_created"));
    }
    for e in events {
        match e.kind.as_str() {
            "run_started" => f.started += 1,
            "run_resumed" => {
                f.resumed += 1;
                f.parked_unknown += e.data["outcome_unknown"]
                    .as_array()
                    .map_or(0, |a| a.len() as u32);
            }
            _ => {}
        }
        if let Some(list) = e.data.get("dispatched").and_then(Value::as_array) {
            for d in list {
                if let Some(k) = d.get("key").and_then(Value::as_str) {
                    *f.dispatched.entry(k.to_owned()).or_insert(0) += 1;
                }
            }
        }
    }
    if f.started > 1 {
        f.violations
            .push(format!("{id}: {} run_started events", f.started));
    }
    let terminal: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| is_terminal_kind(&e.kind))
        .map(|(i, _)| i)
        .collect();
    match (terminal.as_slice(), terminal_status) {
        ([], false) => {}
        ([i], true) => {
            f.terminal = Some(events[*i].kind.clone());
            if let Some(e) = events[i + 1..]
                .iter()
                .find(|e| e.kind != "late_result_ignored")
            {
                f.violations.push(format!(
                    "{id}: {} (seq {}) after the terminal event",
                    e.kind, e.seq
                ));
            }
        }
        (t, _) => f.violations.push(format!(
            "{id}: {} terminal events for a run that is {}terminal",
            t.len(),
            if terminal_status { "" } else { "not " }
        )),
    }
    f
}

/// Reads a run's whole log and checkpoint from the store and checks them; the checkpoint's
/// version must equal the last seq.
pub async fn check_stored_run(store: &SharedStore, id: &RunId) -> Result<LogFacts, String> {
    let cp = store
        .load(id)
        .await
        .map_err(|e| format!("{id}: load: {e}"))?
        .ok_or_else(|| format!("{id}: lost (no checkpoint)"))?;
    let events = store
        .read(id, 0, 1_000_000)
        .await
        .map_err(|e| format!("{id}: read: {e}"))?;
    let mut f = check_log(id, &events, cp.terminal);
    if cp.version != events.len() as u64 {
        f.violations.push(format!(
            "{id}: checkpoint version {} but {} events",
            cp.version,
            events.len()
        ));
    }
    Ok(f)
}

/// Dispatched intents per key in the stored log of `run_id` (a witness's view).
pub async fn durable_intents(store: &SharedStore, run_id: &str, key: &str) -> Result<u32, String> {
    let id: RunId = run_id
        .parse()
        .map_err(|e| format!("request with a bad run_id {run_id:?}: {e}"))?;
    let events = store
        .read(&id, 0, 1_000_000)
        .await
        .map_err(|e| format!("{id}: read: {e}"))?;
    Ok(check_log(&id, &events, false)
        .dispatched
        .get(key)
        .copied()
        .unwrap_or(0))
}

/// A witness for `ToolServer::set_witness`: the request's intent (and one intent per attempt
/// of the key) must already be in the run's durable log when the request arrives (I3).
pub fn intent_witness(store: SharedStore) -> crate::fakes::Witness {
    std::sync::Arc::new(move |call: crate::fakes::WitnessCall| {
        let store = store.clone();
        Box::pin(async move {
            let durable = durable_intents(&store, &call.run_id, &call.key).await?;
            if durable < call.attempt {
                return Err(format!(
                    "I3: attempt {} of key {} (run {}) arrived with {durable} durable intents",
                    call.attempt, call.key, call.run_id
                ));
            }
            Ok(())
        })
    })
}
