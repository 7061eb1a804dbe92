//! SIGTERM on a real `agentd serve` process: it exits 0 within the shutdown bound while runs
//! are in flight, and open SSE streams are closed; on the durable file store, a restart
//! finishes every run without applying a tool call twice.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use eventsource_stream::Eventsource;
use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::json;

use crate::chaos_support::{ChildDaemon, check_stored_run, is_settled, is_terminal_kind, tail};
use crate::daemon_support::{ALPHA, file_config};
use crate::fakes::ToolServer;
use crate::redis_support::eventually;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_zero_within_the_bound_with_runs_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agentd.toml");
    std::fs::write(&path, file_config()).unwrap();
    let log = dir.path().join("agentd.log");
    let mut daemon = ChildDaemon::spawn(&path, &log).await;
    let base = daemon.base.clone();
    let http = reqwest::Client::new();
    let mut ids = Vec::new();
    for agent in ["hang", "hang", "slow"] {
        let res = http
            .post(format!("{base}/v1/runs"))
            .bearer_auth(ALPHA)
            .json(&json!({"agent": agent, "input": "x"}))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::CREATED);
        ids.push(
            res.json::<serde_json::Value>().await.unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
    }
    let res = http
        .get(format!("{base}/v1/runs/{}/events", ids[0]))
        .bearer_auth(ALPHA)
        .header("accept", "text/event-stream")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let mut sse = res.bytes_stream().eventsource();
    let first = tokio::time::timeout(Duration::from_secs(5), sse.next())
        .await
        .unwrap();
    assert!(first.unwrap().is_ok());
    let run: serde_json::Value = http
        .get(format!("{base}/v1/runs/{}", ids[0]))
        .bearer_auth(ALPHA)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(!["succeeded", "failed", "cancelled"].contains(&run["status"].as_str().unwrap()));

    let sent = Instant::now();
    daemon.signal("TERM");
    // The SSE stream is closed by the server.
    let ended = tokio::time::timeout(Duration::from_secs(6), async {
        while let Some(Ok(_)) = sse.next().await {}
    })
    .await;
    assert!(ended.is_ok(), "SSE stream still open after SIGTERM");
    // The process exits 0 within the configured bound (5s) plus process teardown.
    let status = daemon
        .wait_exit(Duration::from_secs(8).saturating_sub(sent.elapsed()))
        .await
        .expect("agentd did not exit within the shutdown bound");
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
    let logs = std::fs::read_to_string(&log).unwrap();
    assert!(!logs.contains(ALPHA), "the token was printed: {logs}");
}

/// A config on the file store at `data`, with a slow scripted agent calling an idempotent HTTP
/// tool that honours keys and an unsafe one with a status URL.
fn durable_config(data: &std::path::Path, tools: &ToolServer) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
shutdown_timeout = "5s"

[store]
url = "file:{data}"

[[tenants]]
id = "alpha"
tokens = ["{ALPHA}"]

[runtime]
node_id = "term-node"

[models.slow]
kind = "scripted"
delay = "120ms"
replies = [
  {{ tool_calls = [ {{ name = "credit", arguments = {{ amount = 1 }} }}, {{ name = "ship", arguments = {{ item = "a" }} }} ] }},
  {{ tool_calls = [ {{ name = "credit", arguments = {{ amount = 2 }} }} ] }},
  {{ tool_calls = [ {{ name = "ship", arguments = {{ item = "b" }} }} ] }},
  {{ text = "done" }},
]

[tools.credit]
kind = "http"
url = "{honouring}"
parameters = {{ type = "object", properties = {{ amount = {{ type = "integer" }} }}, required = ["amount"] }}
effect = "idempotent"

[tools.ship]
kind = "http"
url = "{naive}"
status_url = "{status}"
parameters = {{ type = "object", properties = {{ item = {{ type = "string" }} }}, required = ["item"] }}
effect = "unsafe"

[agents.slow]
model = "slow"
tools = ["credit", "ship"]
"#,
        data = data.display(),
        honouring = tools.honouring_url(),
        naive = tools.tool_url(),
        status = tools.status_url(),
    )
}

/// Issue 4: SIGTERM with runs in flight exits 0 within the bound; the next start on the same
/// file store resumes every run (`run_resumed`) to success, and no tool call is applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_then_restart_finishes_every_run_without_repeating_a_tool_call() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let cfg = dir.path().join("agentd.toml");
    let log = dir.path().join("agentd.log");
    let tools = ToolServer::start().await;
    tools.set_latency(Duration::from_millis(100), Duration::from_millis(300));
    std::fs::write(&cfg, durable_config(&data, &tools)).unwrap();

    let mut d = ChildDaemon::start(&cfg, &log).await;
    let mut ids = Vec::new();
    for i in 0..6 {
        let (s, v) = d
            .post(
                "/v1/runs",
                ALPHA,
                &json!({"agent": "slow", "input": format!("order {i}")}),
            )
            .await
            .unwrap();
        assert_eq!(s, StatusCode::CREATED, "{v}");
        ids.push(v["id"].as_str().unwrap().to_owned());
    }
    // In flight: tool calls have reached the tool, and no run has finished.
    eventually("tool calls in flight", Duration::from_secs(10), || {
        let n: u32 = tools.all_attempts().values().sum();
        async move { (n >= 3).then_some(()) }
    })
    .await;
    for id in &ids {
        let (_, v) = d.get(&format!("/v1/runs/{id}"), ALPHA).await;
        assert!(
            !is_terminal_kind(&format!("run_{}", v["status"].as_str().unwrap())),
            "{v}"
        );
    }

    let sent = Instant::now();
    d.signal("TERM");
    let status = d
        .wait_exit(Duration::from_secs(8))
        .await
        .unwrap_or_else(|| panic!("no exit within the bound; log:\n{}", tail(&log, 40)));
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
    eprintln!("SIGTERM to exit: {:?}", sent.elapsed());
    drop(d);

    // Start again on the same store: every run resumes and succeeds.
    let d = ChildDaemon::start(&cfg, &log).await;
    for id in &ids {
        eventually(
            &format!("run {id} to succeed"),
            Duration::from_secs(30),
            || {
                let d = &d;
                async move {
                    let (_, v) = d.get(&format!("/v1/runs/{id}"), ALPHA).await;
                    match v["status"].as_str() {
                        Some("succeeded") => Some(()),
                        Some(s) if is_settled(s) => panic!("run {id} ended {s}: {v}"),
                        _ => None,
                    }
                }
            },
        )
        .await;
    }
    let mut d = d;
    d.signal("TERM");
    let status = d.wait_exit(Duration::from_secs(8)).await.unwrap();
    assert_eq!(status.code(), Some(0));
    drop(d);

    // The logs, read from the store itself.
    let store = agentd::store::open(&format!("file:{}", data.display()))
        .await
        .unwrap();
    let mut dispatched: HashMap<String, u32> = HashMap::new();
    for id in &ids {
        let f = check_stored_run(&store, &id.parse().unwrap())
            .await
            .unwrap();
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        assert_eq!(f.terminal.as_deref(), Some("run_succeeded"));
        assert!(f.resumed >= 1, "run {id} has no run_resumed");
        for (k, n) in f.dispatched {
            *dispatched.entry(k).or_insert(0) += n;
        }
    }
    // 6 runs x (2 credits + 2 ships), each applied exactly once.
    let executions = tools.all_executions();
    assert_eq!(executions.len(), 24, "{executions:?}");
    assert!(executions.values().all(|&n| n == 1), "{executions:?}");
    for (key, n) in tools.all_attempts() {
        let durable = dispatched.get(&key).copied().unwrap_or(0);
        assert!(
            n <= durable,
            "key {key}: {n} requests, {durable} durable intents"
        );
    }
}
