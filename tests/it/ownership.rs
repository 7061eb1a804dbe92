//! Run ownership through real daemon processes over HTTP: every accepted control applies, in
//! inbox order, exactly once (concurrent approvals, repeated approvals, a cancel racing
//! approvals, refused controls to a passivated run), and a store outage is a pause, not a
//! crash (Redis stopped while passivated runs' approval expiries fall due).

use std::path::Path;
use std::time::{Duration, Instant};

use futures::future::join_all;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::chaos_support::{ChildDaemon, tail};
use crate::fakes::ToolServer;
use crate::redis_support::{PrivateRedis, shared_redis_url, skip_or_fail, unique_ns};

const TOKEN: &str = "owner-token-0123456789";
/// How long the runs of one test may take to settle.
const SETTLE: Duration = Duration::from_secs(90);

/// A daemon configuration: agents `three` and `eight` ask, in their first turn, for 3 or 8
/// calls of the approval-gated unsafe HTTP tool `record` (on the naive recording endpoint, so
/// a repeated execution would show), then answer.
fn config(store_url: &str, tools: &ToolServer, runtime: &str, record_extra: &str) -> String {
    let calls = |n: usize| {
        (0..n)
            .map(|i| format!("{{ name = \"record\", arguments = {{ item = \"i{i}\" }} }}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
shutdown_timeout = "5s"

[store]
url = "{store_url}"

[[tenants]]
id = "owners"
tokens = ["{TOKEN}"]

[runtime]
{runtime}

[runtime.restart]
backoff_base = "20ms"
backoff_max = "200ms"

[models.three]
kind = "scripted"
replies = [ {{ tool_calls = [ {three} ] }}, {{ text = "done" }} ]

[models.eight]
kind = "scripted"
replies = [ {{ tool_calls = [ {eight} ] }}, {{ text = "done" }} ]

[tools.record]
kind = "http"
url = "{url}"
parameters = {{ type = "object", properties = {{ item = {{ type = "string" }} }}, required = ["item"] }}
effect = "unsafe"
approval = "always"
timeout = "10s"
{record_extra}

[agents.three]
model = "three"
tools = ["record"]

[agents.eight]
model = "eight"
tools = ["record"]
"#,
        three = calls(3),
        eight = calls(8),
        url = tools.tool_url(),
    )
}

struct Daemon {
    child: ChildDaemon,
    _dir: tempfile::TempDir,
    log: std::path::PathBuf,
}

async fn start(config: String) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agentd.toml");
    std::fs::write(&path, config).unwrap();
    let log = dir.path().join("agentd.log");
    let child = ChildDaemon::start(&path, &log).await;
    Daemon {
        child,
        _dir: dir,
        log,
    }
}

fn file_url(dir: &Path) -> String {
    format!("file:{}", dir.display())
}

/// The shared Redis with a fresh namespace, or `None` (skip outside CI) without one.
async fn redis_url() -> Option<String> {
    let url = format!("{}?ns={}", shared_redis_url(), unique_ns());
    match agentd::store::open(&url).await {
        Ok(s) if s.ping().await.is_ok() => Some(url),
        _ => {
            skip_or_fail("Redis at 127.0.0.1:6379 is not reachable");
            None
        }
    }
}

impl Daemon {
    async fn create(&self, agent: &str) -> String {
        let (s, b) = self
            .post("/v1/runs", json!({"agent": agent, "input": "go"}))
            .await;
        assert_eq!(s, StatusCode::CREATED, "{b}");
        b["id"].as_str().unwrap().to_owned()
    }

    async fn run(&self, id: &str) -> Value {
        let (s, b) = self.child.get(&format!("/v1/runs/{id}"), TOKEN).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        b
    }

    /// Polls the run until `done` holds, within `SETTLE`.
    async fn wait(&self, id: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + SETTLE;
        loop {
            let run = self.run(id).await;
            if done(&run) {
                return run;
            }
            assert!(
                Instant::now() < deadline,
                "run {id} not {what} within {SETTLE:?}: {run}\nlog:\n{}",
                tail(&self.log, 40)
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    async fn wait_pending(&self, id: &str, n: usize) -> Vec<String> {
        let run = self
            .wait(id, "waiting for its approvals", |r| {
                r["status"] == "waiting_approval"
                    && r["pending_approvals"].as_array().map(Vec::len) == Some(n)
            })
            .await;
        run["pending_approvals"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["call_id"].as_str().unwrap().to_owned())
            .collect()
    }

    async fn events(&self, id: &str) -> Vec<Value> {
        let (s, b) = self
            .child
            .get(&format!("/v1/runs/{id}/events?limit=1000"), TOKEN)
            .await;
        assert_eq!(s, StatusCode::OK, "{b}");
        b["events"].as_array().unwrap().clone()
    }

    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.child.post(path, TOKEN, &body).await.unwrap()
    }

    async fn approve(&self, id: &str, call: &str, body: Value) -> (StatusCode, Value) {
        self.post(&format!("/v1/runs/{id}/approvals/{call}"), body)
            .await
    }

    /// A Prometheus sample's value from `/metrics`.
    async fn metric(&self, name: &str) -> Option<f64> {
        let text = self
            .child
            .http
            .get(format!("{}/metrics", self.child.base))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
    }

    /// Waits until no run actor is live (every waiting run has passivated).
    async fn wait_passivated(&self) {
        let deadline = Instant::now() + SETTLE;
        while self.metric("agentd_live_runs").await != Some(0.0) {
            assert!(Instant::now() < deadline, "runs did not passivate");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

fn count(events: &[Value], kind: &str) -> usize {
    events.iter().filter(|e| e["type"] == kind).count()
}

fn terminal_count(events: &[Value]) -> usize {
    events
        .iter()
        .filter(|e| {
            matches!(
                e["type"].as_str(),
                Some("run_succeeded" | "run_failed" | "run_cancelled")
            )
        })
        .count()
}

/// 40 runs, each asking for 3 or 8 approval-gated calls in one turn, every call approved at
/// the same moment: every run succeeds and every approved call runs exactly once.
async fn concurrent_approvals_all_apply(store_url: String) {
    let tools = ToolServer::start().await;
    let d = start(config(&store_url, &tools, "", "")).await;
    let agents: Vec<(&str, usize)> = (0..40)
        .map(|i| {
            if i % 2 == 0 {
                ("three", 3)
            } else {
                ("eight", 8)
            }
        })
        .collect();
    let ids = join_all(agents.iter().map(|(a, _)| d.create(a))).await;
    let pending = join_all(
        ids.iter()
            .zip(&agents)
            .map(|(id, (_, n))| d.wait_pending(id, *n)),
    )
    .await;
    let d = &d;
    let approvals = ids.iter().zip(&pending).flat_map(|(id, calls)| {
        calls
            .iter()
            .map(move |c| d.approve(id, c, json!({"decision": "approve"})))
    });
    for (s, b) in join_all(approvals).await {
        assert_eq!(s, StatusCode::OK, "{b}");
    }
    for (id, (_, n)) in ids.iter().zip(&agents) {
        let run = d
            .wait(id, "finished", |r| {
                r["status"] != "waiting_approval" && r["status"] != "running"
            })
            .await;
        assert_eq!(run["status"], "succeeded", "{run}");
        let events = d.events(id).await;
        assert_eq!(count(&events, "call_approved"), *n, "{id}: {events:?}");
        assert_eq!(terminal_count(&events), 1);
    }
    let executions = tools.all_executions();
    assert_eq!(executions.len(), 20 * 3 + 20 * 8, "{executions:?}");
    assert!(
        executions.values().all(|n| *n == 1),
        "a call ran twice: {executions:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_approvals_all_apply_on_the_file_store() {
    let data = tempfile::tempdir().unwrap();
    concurrent_approvals_all_apply(file_url(data.path())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_approvals_all_apply_on_redis() {
    let Some(url) = redis_url().await else { return };
    concurrent_approvals_all_apply(url).await;
}

/// The same approval sent 10 times at the same moment: every answer is 200 with the same
/// outcome, and the run records one `call_approved` for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_approval_ten_times_at_once_answers_the_same() {
    let tools = ToolServer::start().await;
    let data = tempfile::tempdir().unwrap();
    let d = start(config(&file_url(data.path()), &tools, "", "")).await;
    let id = d.create("three").await;
    let calls = d.wait_pending(&id, 3).await;
    let answers =
        join_all((0..10).map(|_| d.approve(&id, &calls[0], json!({"decision": "approve"})))).await;
    for (s, b) in &answers {
        assert_eq!(*s, StatusCode::OK, "{b}");
        let still_pending = b["pending_approvals"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["call_id"] == calls[0].as_str());
        assert!(
            !still_pending,
            "the answer must show the call approved: {b}"
        );
    }
    let events = d.events(&id).await;
    let approved: Vec<_> = events
        .iter()
        .filter(|e| e["type"] == "call_approved" && e["data"]["call_id"] == calls[0].as_str())
        .collect();
    assert_eq!(approved.len(), 1, "{events:?}");
    // The opposite decision afterwards is a conflict, not a silent 200.
    let (s, b) = d
        .approve(&id, &calls[0], json!({"decision": "reject"}))
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{b}");
}

/// Controls sent to a passivated run that do not fit it get their error answer (never a 200
/// while the control is dropped), and the refusal is recorded in the run's log.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refused_controls_to_a_passivated_run_get_their_error() {
    let tools = ToolServer::start().await;
    let data = tempfile::tempdir().unwrap();
    let runtime = "passivate_after = \"50ms\"\nmax_queued_input = 2";
    let d = start(config(&file_url(data.path()), &tools, runtime, "")).await;
    let id = d.create("three").await;
    let calls = d.wait_pending(&id, 3).await;
    d.wait_passivated().await;

    // Edited arguments that fail the tool's schema.
    let (s, b) = d
        .approve(
            &id,
            &calls[0],
            json!({"decision": "approve", "arguments": {"item": 7}}),
        )
        .await;
    assert_eq!(b["error"]["code"], "invalid_argument", "{s} {b}");
    assert_ne!(s, StatusCode::OK);

    // A full input queue: two are queued, the third is refused.
    d.wait_passivated().await;
    for i in 0..2 {
        let (s, b) = d
            .post(
                &format!("/v1/runs/{id}/input"),
                json!({"text": format!("note {i}")}),
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{b}");
        d.wait_passivated().await;
    }
    let (s, b) = d
        .post(
            &format!("/v1/runs/{id}/input"),
            json!({"text": "one too many"}),
        )
        .await;
    assert_eq!(b["error"]["code"], "input_queue_full", "{s} {b}");
    assert_ne!(s, StatusCode::OK);

    let events = d.events(&id).await;
    assert_eq!(count(&events, "control_refused"), 2, "{events:?}");
    assert_eq!(count(&events, "input_queued"), 2, "{events:?}");
    let run = d.run(&id).await;
    assert_eq!(run["status"], "waiting_approval");
    assert_eq!(tools.total_executions(), 0);
}

/// A cancel racing a run's approvals: exactly one terminal outcome, and no tool call reaches
/// the tool after the cancel was answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_racing_approvals_has_one_outcome() {
    let tools = ToolServer::start().await;
    let data = tempfile::tempdir().unwrap();
    let d = start(config(&file_url(data.path()), &tools, "", "")).await;
    for _ in 0..10 {
        let id = d.create("eight").await;
        let calls = d.wait_pending(&id, 8).await;
        let approvals = join_all(
            calls
                .iter()
                .map(|c| d.approve(&id, c, json!({"decision": "approve"}))),
        );
        let cancel = async {
            let answer = d.post(&format!("/v1/runs/{id}/cancel"), json!({})).await;
            (answer, Instant::now())
        };
        let (answers, ((s, b), cancelled_at)) = tokio::join!(approvals, cancel);
        for (s, b) in answers {
            // Approved before the cancel, or refused because the run was cancelled.
            assert!(
                s == StatusCode::OK || b["error"]["code"] == "invalid_state",
                "{s} {b}"
            );
        }
        let run = d
            .wait(&id, "finished", |r| {
                matches!(r["status"].as_str(), Some("succeeded" | "cancelled"))
            })
            .await;
        let events = d.events(&id).await;
        assert_eq!(terminal_count(&events), 1, "{events:?}");
        if s == StatusCode::OK {
            assert_eq!(run["status"], "cancelled", "{b}");
            // A call sent before the cancel may still be received after its answer on a
            // loaded machine; none may be sent after it: every call the tool received late
            // was dispatched (its intent stored) by an event before `run_cancelled`.
            let cancelled_seq = events
                .iter()
                .find(|e| e["type"] == "run_cancelled")
                .and_then(|e| e["seq"].as_u64())
                .expect("a run_cancelled event");
            let dispatched_before: Vec<&str> = events
                .iter()
                .filter(|e| e["seq"].as_u64().is_some_and(|seq| seq < cancelled_seq))
                .filter_map(|e| e["data"]["dispatched"].as_array())
                .flatten()
                .filter_map(|d| d["call_id"].as_str())
                .collect();
            let late: Vec<_> = tools
                .requests()
                .into_iter()
                .filter(|r| r.body["run_id"] == id.as_str() && r.received_at > cancelled_at)
                .filter(|r| {
                    !r.body["call_id"]
                        .as_str()
                        .is_some_and(|c| dispatched_before.contains(&c))
                })
                .collect();
            assert!(late.is_empty(), "calls sent after the cancel: {late:?}");
        } else {
            assert_eq!(run["status"], "succeeded", "{s} {b}");
        }
    }
    let executions = tools.all_executions();
    assert!(executions.values().all(|n| *n == 1), "{executions:?}");
}

/// Redis stopped while 20 passivated runs' approval expiries fall due, then restarted with
/// its data: every run reaches its expected end (the expiry rejects the call, the model
/// answers) and none ends `crash_loop`; meanwhile `/readyz` says the store is down and the
/// runs that tried to start count as paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_outage_is_a_pause_for_waiting_runs() {
    let Some(mut redis) = PrivateRedis::start_persistent().await else {
        return;
    };
    let tools = ToolServer::start().await;
    let extra = "approval_timeout = \"3s\"\non_approval_timeout = \"reject\"";
    let d = start(config(
        &redis.url(),
        &tools,
        "passivate_after = \"50ms\"",
        extra,
    ))
    .await;
    let ids = join_all((0..20).map(|_| d.create("three"))).await;
    join_all(ids.iter().map(|id| d.wait_pending(id, 3))).await;
    d.wait_passivated().await;

    redis.kill();
    let down_since = Instant::now();
    // The outage outlasts the approval expiries (3 s from when the calls began waiting).
    let mut saw_not_ready = false;
    let mut saw_paused = false;
    while down_since.elapsed() < Duration::from_secs(8) {
        let ready = d
            .child
            .http
            .get(format!("{}/readyz", d.child.base))
            .send()
            .await
            .map(|r| r.status());
        saw_not_ready |= matches!(ready, Ok(s) if s == StatusCode::SERVICE_UNAVAILABLE);
        saw_paused |= d.metric("agentd_paused_runs").await.unwrap_or(0.0) > 0.0;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(saw_not_ready, "/readyz must report the store as down");
    assert!(
        saw_paused,
        "runs woken during the outage must count as paused"
    );
    redis.restart().await;

    for id in &ids {
        let run = d
            .wait(id, "finished after the outage", |r| {
                matches!(
                    r["status"].as_str(),
                    Some("succeeded" | "failed" | "cancelled")
                )
            })
            .await;
        assert_eq!(run["status"], "succeeded", "{run}\n{}", tail(&d.log, 30));
        let events = d.events(id).await;
        assert_eq!(count(&events, "approval_expired"), 3, "{events:?}");
        assert_eq!(terminal_count(&events), 1);
    }
    assert_eq!(tools.total_executions(), 0, "rejected calls never run");
}
