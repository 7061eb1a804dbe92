//! Hostile inputs through the daemon: an oversized tool output carrying a secret and a
//! `"password"`, calls cancelled while queued, bodies that are not JSON objects, and clients
//! that read or write slowly.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use agentd::config::Config;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::daemon_support::{ALPHA, TestDaemon, alpha_on_memory, assert_error};
use crate::fakes::{FakeOpenAi, Scripted, ToolBehavior, ToolServer};

/// A configured secret (`[secrets] values`).
const CANARY: &str = "canary-hardening-5a6b7c8d9e";
/// The value of a `"db_password"` field: no configured secret, only the key says it is one.
const PASSWORD: &str = "pw-value-0f1e2d3c4b5a";
/// A leak is any run of this many bytes of a secret.
const LEAK_WINDOW: usize = 8;

/// The first piece (of [`LEAK_WINDOW`] bytes) of `secret` found in `text`.
fn leaked<'a>(text: &str, secret: &'a str) -> Option<&'a str> {
    (0..=secret.len() - LEAK_WINDOW)
        .map(|i| &secret[i..i + LEAK_WINDOW])
        .find(|piece| text.contains(piece))
}

fn oversized_config(model: &FakeOpenAi, tools: &ToolServer, data: &std::path::Path) -> String {
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
model_timeout = "5s"

[secrets]
values = ["{CANARY}"]

[models.fake]
kind = "openai"
base_url = "{model_url}"
model = "fake-model"
timeout = "2s"

[tools.dump]
kind = "http"
url = "{tool_url}"
description = "Dump a table"
parameters = {{ type = "object" }}
effect = "read"
timeout = "2s"

[agents.dumper]
model = "fake"
tools = ["dump"]
max_turns = 4
"#,
        data = data.display(),
        model_url = model.url(),
        tool_url = tools.tool_url(),
    )
}

/// A 70 KiB output: `{"db_password": …, "zfiller": "…"}` with the canary placed where the
/// 64 KiB cap cuts the serialized output (a JSON string, so its quotes are escaped).
fn oversized_output() -> String {
    let prefix = format!(r#"{{"db_password":"{PASSWORD}","zfiller":""#);
    // Serialized as a JSON string: one opening quote plus one backslash per quote before.
    let shift = 1 + prefix.matches('"').count();
    let cap = 64 * 1024;
    let canary_at = cap - shift - CANARY.len() / 2;
    let mut body = prefix.clone();
    body.push_str(&"z".repeat(canary_at - prefix.len()));
    body.push_str(CANARY);
    body.push_str(&"z".repeat(70 * 1024 - body.len() - 2));
    body.push_str(r#""}"#);
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_output_leaks_neither_a_secret_nor_a_password_anywhere() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    let output = oversized_output();
    assert_eq!(output.len(), 70 * 1024);
    assert!(serde_json::from_str::<Value>(&output).is_ok());
    // The error text puts the canary where the old 300- and 500-character cuts fell.
    let refusal = format!(
        "{}{CANARY} {}{CANARY} tail",
        "e".repeat(296),
        "f".repeat(180)
    );
    model
        .push(Scripted::tool_calls(&[("c1", "dump", "{}")]))
        .push(Scripted::tool_calls(&[("c2", "dump", "{}")]))
        .push(Scripted::text("done"));
    tools
        .push(ToolBehavior::ApplyWith(output))
        .push(ToolBehavior::Refuse(400, refusal));
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let config = dir.path().join("agentd.toml");
    let log = dir.path().join("agentd.log");
    std::fs::write(&config, oversized_config(&model, &tools, &data)).unwrap();
    let daemon = crate::chaos_support::ChildDaemon::spawn_with(
        &config,
        &log,
        &["--log-format", "json"],
        "trace,hyper=info,h2=info,reqwest=info,tower=info",
    )
    .await;
    daemon.wait_ready(Duration::from_secs(20)).await;
    let base = daemon.base.clone();
    let http = &daemon.http;
    let get = |path: String| {
        let url = format!("{base}{path}");
        async move {
            let res = http.get(url).bearer_auth(ALPHA).send().await.unwrap();
            assert_eq!(res.status(), StatusCode::OK);
            res.text().await.unwrap()
        }
    };
    let created = http
        .post(format!("{base}/v1/runs"))
        .bearer_auth(ALPHA)
        .json(&json!({"agent": "dumper", "input": "dump the users table"}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), StatusCode::CREATED);
    let mut sinks = vec![("api", created.text().await.unwrap())];
    let id = serde_json::from_str::<Value>(&sinks[0].1).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let body = get(format!("/v1/runs/{id}")).await;
        let v: Value = serde_json::from_str(&body).unwrap();
        if v["status"] == "succeeded" {
            sinks.push(("api", body));
            break;
        }
        assert!(v["status"] != "failed", "{v}");
        assert!(Instant::now() < deadline, "run stuck: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sinks.push(("api", get(format!("/v1/runs/{id}/events")).await));
    sinks.push(("api", get("/v1/runs".to_owned()).await));
    daemon.kill9();
    sinks.push(("logs", std::fs::read_to_string(&log).unwrap()));
    let store = agentd::store::open(&format!("file:{}", data.display()))
        .await
        .unwrap();
    let run_id: agentd::ids::RunId = id.parse().unwrap();
    let checkpoint = store.load(&run_id).await.unwrap().unwrap();
    // The stored run: its body and its transcript, stored beside it.
    let stored = format!("{}\n{}", checkpoint.body, checkpoint.transcript.join("\n"));
    sinks.push(("checkpoint", stored.clone()));
    let events = store.read(&run_id, 0, 1000).await.unwrap();
    sinks.push(("events", serde_json::to_string(&events).unwrap()));
    let requests = model.requests();
    assert_eq!(requests.len(), 3);
    for r in &requests {
        sinks.push(("model request", r.body.to_string()));
    }

    // Checkpoint, events, model requests, API answers, logs: not a piece of either.
    for (sink, text) in &sinks {
        for secret in [CANARY, PASSWORD] {
            if let Some(piece) = leaked(text, secret) {
                let at = text.find(piece).unwrap();
                let around = text
                    .get(at.saturating_sub(60)..(at + 60).min(text.len()))
                    .unwrap_or(piece);
                panic!("{piece:?} of {secret} leaked into the {sink}: …{around}…");
            }
        }
    }

    // The output was really cut, and redacted before it was cut.
    let events_text = &sinks.iter().find(|(s, _)| *s == "events").unwrap().1;
    assert!(
        events_text.contains(r#""truncated":true"#),
        "output not cut"
    );
    assert!(
        stored.contains("zzzz[redacted]zzzz"),
        "the canary was not there"
    );
    let at = stored.find("db_password").unwrap();
    let after = &stored[at..at + 60];
    assert!(after.contains("[redacted]"), "{after}");
    let error_message = requests[2].body.to_string();
    assert!(error_message.contains("HTTP 400"), "refusal not seen");
}

/// Blocker and victim tools on two servers, one tool worker: every victim call queues behind
/// the blocker's hanging call. Victims call either the unsafe HTTP tool `charge_card` or the
/// native `charge` (after its approval), which ignores its cancel token: only the executor's
/// own check keeps it from running.
fn queue_config(blocker: &ToolServer, victim: &ToolServer) -> Config {
    let header = alpha_on_memory();
    let text = format!(
        r#"{header}

[runtime]
tool_workers = 1
tool_queue = 4096

[models.block]
kind = "scripted"
replies = [ {{ tool_calls = [ {{ name = "block", arguments = {{}} }} ] }}, {{ text = "released" }} ]

[models.charge]
kind = "scripted"
replies = [ {{ tool_calls = [ {{ name = "charge_card", arguments = {{}} }} ] }}, {{ text = "charged" }} ]

[models.charge_native]
kind = "scripted"
replies = [ {{ tool_calls = [ {{ name = "charge", arguments = {{ item = "x" }} }} ] }}, {{ text = "charged" }} ]

[models.probe]
kind = "scripted"
replies = [ {{ tool_calls = [ {{ name = "probe", arguments = {{}} }} ] }}, {{ text = "probed" }} ]

[tools.block]
kind = "http"
url = "{blocker_url}"
parameters = {{ type = "object" }}
effect = "read"
timeout = "60s"

[tools.charge_card]
kind = "http"
url = "{victim_url}"
parameters = {{ type = "object" }}
effect = "unsafe"
timeout = "60s"

[tools.probe]
kind = "http"
url = "{probe_url}"
parameters = {{ type = "object" }}
effect = "read"

[agents.blocker]
model = "block"
tools = ["block"]

[agents.victim]
model = "charge"
tools = ["charge_card"]

[agents.native_victim]
model = "charge_native"
tools = ["charge"]

[agents.probe]
model = "probe"
tools = ["probe"]
"#,
        blocker_url = blocker.tool_url(),
        victim_url = victim.tool_url(),
        probe_url = victim.honouring_url(),
    );
    Config::from_toml(&text).unwrap()
}

async fn wait_until(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cancelled_while_queued_never_reaches_the_tool_over_a_thousand_trials() {
    const BATCHES: usize = 20;
    const PER_BATCH: usize = 50;
    let blocker = ToolServer::start().await;
    let victim = ToolServer::start().await;
    let d = TestDaemon::start_config(queue_config(&blocker, &victim)).await;
    let mut cancelled = HashSet::new();
    for batch in 0..BATCHES {
        blocker.push(ToolBehavior::Hang);
        let block = d.create(ALPHA, "blocker").await;
        let want = batch + 1;
        wait_until("the blocker's call", async || {
            blocker.requests().len() == want
        })
        .await;
        let mut victims = Vec::new();
        for i in 0..PER_BATCH {
            let native = i % 2 == 1;
            let id = d
                .create(ALPHA, if native { "native_victim" } else { "victim" })
                .await;
            if native {
                let v = d.wait_status(ALPHA, &id, "waiting_approval").await;
                let call = v["pending_approvals"][0]["call_id"].as_str().unwrap();
                let (s, v) = d
                    .post(
                        &format!("/v1/runs/{id}/approvals/{call}"),
                        ALPHA,
                        json!({"decision": "approve"}),
                    )
                    .await;
                assert_eq!(s, StatusCode::OK, "{v}");
            }
            victims.push(id);
        }
        for id in &victims {
            d.wait_run(ALPHA, id, |v| v["phase"] == "executing_tools")
                .await;
            let (s, v) = d
                .post(&format!("/v1/runs/{id}/cancel"), ALPHA, json!({}))
                .await;
            assert_eq!(s, StatusCode::OK, "{v}");
            assert_eq!(v["status"], "cancelled", "{v}");
            cancelled.insert(id.clone());
        }
        let (s, v) = d
            .post(&format!("/v1/runs/{block}/cancel"), ALPHA, json!({}))
            .await;
        assert_eq!(s, StatusCode::OK, "{v}");
        // The probe queues behind every cancelled call: once it arrives, they all had their turn.
        let probe = d.create(ALPHA, "probe").await;
        d.wait_status(ALPHA, &probe, "succeeded").await;
    }
    assert_eq!(cancelled.len(), BATCHES * PER_BATCH);
    let reached: Vec<String> = victim
        .requests()
        .iter()
        .filter_map(|r| r.body["run_id"].as_str().map(str::to_owned))
        .filter(|run| cancelled.contains(run))
        .collect();
    assert_eq!(victim.requests().len(), BATCHES, "only the probes arrived");
    assert!(
        reached.is_empty() && d.ledger.total() == 0,
        "of {} cancelled calls, {} reached the HTTP tool and {} the native one",
        cancelled.len(),
        reached.len(),
        d.ledger.total()
    );
    d.stop().await;
}

#[tokio::test]
async fn bodies_that_are_not_json_objects_are_refused() {
    let d = TestDaemon::start().await;
    let (s, v) = d.post("/v1/runs", ALPHA, json!(["quick", "x"])).await;
    assert_error(s, &v, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request");
    let (s, v) = d.get("/v1/runs", ALPHA).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["runs"], json!([]), "no run was created");
    let id = d.create(ALPHA, "hang").await;
    for body in [json!([]), json!("stop"), json!(null)] {
        let (s, v) = d.post(&format!("/v1/runs/{id}/cancel"), ALPHA, body).await;
        assert_error(s, &v, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request");
    }
    let (_, v) = d.get(&format!("/v1/runs/{id}"), ALPHA).await;
    assert_eq!(v["status"], "running", "{v}");
    d.stop().await;
}

/// Writes a request head one byte every `every` and never finishes it; returns how long the
/// server kept the connection open (`None`: still open after `give_up`).
async fn trickle_headers(
    addr: std::net::SocketAddr,
    every: Duration,
    give_up: Duration,
) -> Option<Duration> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let started = Instant::now();
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: ";
    let mut sent = 0usize;
    let mut buf = [0u8; 256];
    let mut tick = tokio::time::interval(every);
    let deadline = tokio::time::Instant::now() + give_up;
    loop {
        tokio::select! {
            () = tokio::time::sleep_until(deadline) => return None,
            _ = tick.tick() => {
                let byte = head.get(sent).copied().unwrap_or(b'a');
                sent += 1;
                if stream.write_all(&[byte]).await.is_err() {
                    return Some(started.elapsed());
                }
            }
            read = stream.read(&mut buf) => match read {
                // Closed by the server (an answer such as 408 may come first).
                Ok(0) | Err(_) => return Some(started.elapsed()),
                Ok(_) => {}
            },
        }
    }
}

/// A connection that sends nothing at all, kept until the server closes it; returns how long
/// that took from `started` (`None`: still open after `give_up`).
async fn silent_connection(
    mut stream: tokio::net::TcpStream,
    started: Instant,
    give_up: Duration,
) -> Option<Duration> {
    use tokio::io::AsyncReadExt as _;
    let mut buf = [0u8; 64];
    let closed = tokio::time::timeout(give_up, async {
        while !matches!(stream.read(&mut buf).await, Ok(0) | Err(_)) {}
    })
    .await;
    closed.ok().map(|()| started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_header_senders_are_closed_in_time_and_healthz_keeps_answering() {
    const SLOW: usize = 1000;
    let header_timeout = Duration::from_secs(1);
    let d = TestDaemon::start_with(|c| c.server.header_read_timeout = header_timeout).await;
    let addr = d.addr;
    // Clients that connect and never send a byte. Opened one after another before the flood:
    // in a flood, the kernel may complete a handshake whose connection it then drops from a
    // full accept queue, which a client that never sends cannot notice.
    let mut slow = Vec::new();
    for _ in 0..SLOW / 10 {
        let started = Instant::now();
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.push(tokio::spawn(silent_connection(
            stream,
            started,
            Duration::from_secs(15),
        )));
    }
    slow.extend((0..SLOW).map(|_| {
        tokio::spawn(trickle_headers(
            addr,
            Duration::from_millis(100),
            Duration::from_secs(15),
        ))
    }));
    // Meanwhile the daemon keeps answering (latency is measured by the hostile-load script).
    let mut answered = 0;
    let until = Instant::now() + header_timeout;
    while Instant::now() < until {
        // Bounded: a daemon whose slots the slow clients hold would never answer.
        let res = d
            .http
            .get(d.url("/healthz"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .expect("/healthz answered while slow clients held connections");
        assert_eq!(res.status(), StatusCode::OK);
        answered += 1;
    }
    assert!(answered > 0);
    let mut open_for = Vec::new();
    for (i, t) in slow.into_iter().enumerate() {
        let kind = if i < SLOW / 10 { "silent" } else { "trickling" };
        open_for.push(
            t.await
                .unwrap()
                .unwrap_or_else(|| panic!("a {kind} connection (#{i}) was never closed")),
        );
    }
    let longest = open_for.iter().max().unwrap();
    // The timer starts at accept; allow for a loaded machine, not for "never".
    assert!(
        *longest < header_timeout * 4,
        "a slow connection stayed open {longest:?}"
    );
    d.stop().await;
}

#[tokio::test]
async fn asking_for_a_stream_does_not_lift_the_request_timeout_elsewhere() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let d = TestDaemon::start_with(|c| c.limits.request_timeout = Duration::from_millis(300)).await;
    // A body that never completes, on a route that does not stream.
    let mut stream = tokio::net::TcpStream::connect(d.addr).await.unwrap();
    let head = format!(
        "POST /v1/runs HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {ALPHA}\r\n\
         Accept: text/event-stream\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"agent\":"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let n = stream.read(&mut buf).await.unwrap_or(0);
            answer.extend_from_slice(&buf[..n]);
            if n == 0 || answer.windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
    })
    .await;
    assert!(read.is_ok(), "no answer: the request timeout was skipped");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    d.stop().await;
}

#[tokio::test]
async fn invented_methods_share_one_metrics_label() {
    let d = TestDaemon::start().await;
    for i in 0..20 {
        let method = reqwest::Method::from_bytes(format!("INVENTED{i}").as_bytes()).unwrap();
        let res = d
            .http
            .request(method, d.url("/healthz"))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::METHOD_NOT_ALLOWED);
    }
    let text = d
        .http
        .get(d.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!text.contains("INVENTED"), "{text}");
    assert!(
        text.contains(
            r#"agentd_http_requests_total{method="other",route="/healthz",status="405"} 20"#
        ),
        "{text}"
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_checkpoint_is_quarantined_and_every_other_run_is_served() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file:{}", dir.path().join("data").display());
    let configure = |c: &mut Config| {
        c.store.url = url.clone();
        // Under a limit, start-up reads every active checkpoint (to count them).
        c.limits.max_active_runs_per_tenant = 100;
    };
    let d = TestDaemon::start_with(configure).await;
    let done = d.create(ALPHA, "quick").await;
    d.wait_status(ALPHA, &done, "succeeded").await;
    let waiting = d.create(ALPHA, "hang").await;
    d.stop().await;

    // A run whose record is there but whose state does not decode, active and listed.
    let bad = agentd::ids::RunId::generate();
    {
        let store = agentd::store::open(&url).await.unwrap();
        let checkpoint = agentd::store::Checkpoint {
            run_id: bad.clone(),
            tenant: "alpha".into(),
            agent: "quick".into(),
            status: "running".into(),
            terminal: false,
            version: 1,
            created_at_ms: 1,
            updated_at_ms: 1,
            body: r#"{"not":"a run"}"#.into(),
            transcript: Vec::new(),
            transcript_from: 0,
        };
        let created = agentd::store::EventRecord {
            seq: 1,
            at_ms: 1,
            kind: "run_created".into(),
            data: json!({}),
        };
        store.create(&checkpoint, &[created], None).await.unwrap();
    }

    let d = TestDaemon::start_with(configure).await;
    let (s, v) = d.get("/v1/runs", ALPHA).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let ids: Vec<&str> = v["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 2, "{v}");
    assert!(ids.contains(&done.as_str()) && ids.contains(&waiting.as_str()));
    let (s, v) = d.get(&format!("/v1/runs/{waiting}"), ALPHA).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, ready) = d.get("/readyz", ALPHA).await;
    assert_eq!(s, StatusCode::OK, "{ready}");
    assert_eq!(ready["quarantined"][0]["id"], bad.to_string(), "{ready}");
    assert!(ready["quarantined"][0]["reason"].is_string(), "{ready}");
    let metrics = d
        .http
        .get(d.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("agentd_runs_quarantined_total 1\n"),
        "{metrics}"
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_event_streams_are_capped_per_tenant() {
    let d = TestDaemon::start_with(|c| c.limits.max_streams_per_tenant = 3).await;
    let alpha_run = d.create(ALPHA, "hang").await;
    let beta_run = d.create(crate::daemon_support::BETA, "hang").await;
    let open = |token: &'static str, run: String| {
        let req = d
            .http
            .get(d.url(&format!("/v1/runs/{run}/events")))
            .bearer_auth(token)
            .header("accept", "text/event-stream");
        async move { req.send().await.unwrap() }
    };
    let mut streams = Vec::new();
    for _ in 0..3 {
        let res = open(ALPHA, alpha_run.clone()).await;
        assert_eq!(res.status(), StatusCode::OK);
        streams.push(res);
    }
    let refused = open(ALPHA, alpha_run.clone()).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.headers().contains_key("retry-after"));
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["error"]["code"], "too_many_streams", "{body}");
    // Another tenant is not affected.
    let beta = open(crate::daemon_support::BETA, beta_run).await;
    assert_eq!(beta.status(), StatusCode::OK);
    // A closed stream gives its slot back (once the server notices, at the next keep-alive).
    drop(streams.pop());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let res = open(ALPHA, alpha_run.clone()).await;
        if res.status() == StatusCode::OK {
            break;
        }
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(Instant::now() < deadline, "the slot never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(streams);
    d.stop().await;
}

#[tokio::test]
async fn run_metadata_is_bounded() {
    let d = TestDaemon::start().await;
    let big = json!({"note": "m".repeat(5000)});
    let (s, v) = d
        .post(
            "/v1/runs",
            ALPHA,
            json!({"agent": "quick", "input": "x", "metadata": big}),
        )
        .await;
    assert_error(s, &v, StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("metadata"),
        "{v}"
    );
    let small = json!({"ticket": "T-1"});
    let (s, v) = d
        .post(
            "/v1/runs",
            ALPHA,
            json!({"agent": "quick", "input": "x", "metadata": small}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["metadata"], small);
    d.stop().await;
}
