//! SIGTERM on a real `agentd serve` process: it exits 0 within the shutdown bound while runs
//! are in flight, and open SSE streams are closed.
//! (With the durable store, this extends to "a restart finishes them".)

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use eventsource_stream::Eventsource;
use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::json;

use crate::daemon_support::{ALPHA, file_config};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_zero_within_the_bound_with_runs_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agentd.toml");
    std::fs::write(&path, file_config()).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentd"))
        .args([
            "serve",
            "--config",
            path.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ])
        .env_remove("AGENTD_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(15);
    let base = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx
            .recv_timeout(left)
            .expect("the daemon did not report its address");
        if let Some(addr) = line.strip_prefix("agentd listening on ") {
            break addr.trim().to_owned();
        }
    };
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
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    // The SSE stream is closed by the server.
    let ended = tokio::time::timeout(Duration::from_secs(6), async {
        while let Some(Ok(_)) = sse.next().await {}
    })
    .await;
    assert!(ended.is_ok(), "SSE stream still open after SIGTERM");
    // The process exits 0 within the configured bound (5s) plus process teardown.
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if sent.elapsed() > Duration::from_secs(8) {
            let _ = child.kill();
            panic!("agentd did not exit within the shutdown bound");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(status.code(), Some(0), "exit status {status:?}");
    let logs: Vec<String> = rx.try_iter().collect();
    assert!(
        logs.iter().all(|l| !l.contains(ALPHA)),
        "the token was printed: {logs:?}"
    );
}
