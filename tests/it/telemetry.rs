//! OpenTelemetry traces over OTLP/HTTP against a small receiver: one trace per run, spans for
//! the run, its turns, model calls and tool calls with GenAI attributes, nothing secret.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentd::ids::RunId;
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use serde_json::Value;
use tokio::sync::watch;

use crate::daemon_support::{ALPHA, TestDaemon};

/// An OTLP/HTTP JSON receiver: keeps every body posted to `/v1/traces`.
struct Receiver {
    addr: SocketAddr,
    bodies: Arc<Mutex<Vec<String>>>,
    changed: watch::Receiver<usize>,
}

#[derive(Clone)]
struct Sink {
    bodies: Arc<Mutex<Vec<String>>>,
    tx: Arc<watch::Sender<usize>>,
}

async fn traces(State(s): State<Sink>, headers: HeaderMap, body: String) -> StatusCode {
    let json = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !json || serde_json::from_str::<Value>(&body).is_err() {
        return StatusCode::BAD_REQUEST;
    }
    let n = {
        let mut b = s.bodies.lock().unwrap();
        b.push(body);
        b.len()
    };
    s.tx.send_replace(n);
    StatusCode::OK
}

impl Receiver {
    async fn start() -> Receiver {
        let (tx, changed) = watch::channel(0);
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let router = Router::new()
            .route("/v1/traces", post(traces))
            .with_state(Sink {
                bodies: bodies.clone(),
                tx: Arc::new(tx),
            });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Receiver {
            addr,
            bodies,
            changed,
        }
    }

    /// Every span received so far, flattened (with the resource's attributes beside each).
    fn spans(&self) -> Vec<(Value, Value)> {
        let mut out = Vec::new();
        for body in self.bodies.lock().unwrap().iter() {
            let v: Value = serde_json::from_str(body).unwrap();
            for rs in v["resourceSpans"].as_array().unwrap() {
                for ss in rs["scopeSpans"].as_array().unwrap() {
                    for s in ss["spans"].as_array().unwrap() {
                        out.push((s.clone(), rs["resource"].clone()));
                    }
                }
            }
        }
        out
    }

    fn raw(&self) -> String {
        self.bodies.lock().unwrap().join("\n")
    }

    /// Waits (bounded) until a span satisfies `done`, woken by each received batch.
    async fn wait_for(&mut self, done: impl Fn(&Value) -> bool) {
        let wait = async {
            loop {
                if self.spans().iter().any(|(s, _)| done(s)) {
                    return;
                }
                self.changed.changed().await.unwrap();
            }
        };
        tokio::time::timeout(Duration::from_secs(20), wait)
            .await
            .expect("the span did not arrive in time");
    }
}

fn attr<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)
        .map(|a| &a["value"])
}

fn str_attr<'a>(span: &'a Value, key: &str) -> &'a str {
    attr(span, key)
        .and_then(|v| v["stringValue"].as_str())
        .unwrap_or_else(|| panic!("{key} missing on {span}"))
}

fn int_attr(span: &Value, key: &str) -> i64 {
    attr(span, key)
        .and_then(|v| v["intValue"].as_str())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{key} missing on {span}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_is_one_trace_with_turn_model_and_tool_spans() {
    let mut receiver = Receiver::start().await;
    let endpoint = format!("http://{}", receiver.addr);
    let d = TestDaemon::start_with(|c| {
        c.telemetry.otlp_endpoint = Some(endpoint);
        c.telemetry.service_name = "agentd-under-test".into();
        c.telemetry.export_interval = Duration::from_millis(50);
    })
    .await;
    let (s, v) = d
        .post(
            "/v1/runs",
            ALPHA,
            serde_json::json!({"agent": "slow", "input": "marker-goal-7f3e"}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().unwrap().to_owned();
    d.wait_status(ALPHA, &id, "succeeded").await;
    let run_id: RunId = id.parse().unwrap();
    let trace_id = hex::encode(agentd::telemetry::trace_id(&run_id));
    let root_id = hex::encode(agentd::telemetry::run_span_id(&run_id));
    receiver.wait_for(|s| s["spanId"] == root_id.as_str()).await;

    let spans: Vec<Value> = receiver
        .spans()
        .into_iter()
        .filter(|(s, resource)| {
            let svc = resource["attributes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|a| a["key"] == "service.name")
                .map(|a| a["value"]["stringValue"].clone());
            assert_eq!(svc, Some(Value::from("agentd-under-test")));
            s["traceId"] == trace_id.as_str()
        })
        .map(|(s, _)| s)
        .collect();
    let by_id: HashMap<&str, &Value> = spans
        .iter()
        .map(|s| (s["spanId"].as_str().unwrap(), s))
        .collect();
    assert_eq!(by_id.len(), spans.len(), "span ids are unique: {spans:#?}");
    let named = |prefix: &str| -> Vec<&Value> {
        spans
            .iter()
            .filter(|s| s["name"].as_str().unwrap().starts_with(prefix))
            .collect()
    };

    // The root: the whole run, no parent.
    let roots: Vec<&Value> = spans
        .iter()
        .filter(|s| s.get("parentSpanId").is_none())
        .collect();
    assert_eq!(roots.len(), 1, "{spans:#?}");
    let root = roots[0];
    assert_eq!(root["name"], "invoke_agent slow");
    assert_eq!(root["spanId"], root_id.as_str());
    assert_eq!(str_attr(root, "gen_ai.operation.name"), "invoke_agent");
    assert_eq!(str_attr(root, "gen_ai.agent.name"), "slow");
    assert_eq!(str_attr(root, "agentd.run.id"), id);
    assert_eq!(str_attr(root, "agentd.run.status"), "succeeded");
    assert_eq!(int_attr(root, "agentd.run.turns"), 4);
    assert!(int_attr(root, "gen_ai.usage.input_tokens") > 0);

    // Four turns under the root; each model call and tool call under a turn.
    let turns = named("turn");
    assert_eq!(turns.len(), 4, "{spans:#?}");
    for t in &turns {
        assert_eq!(t["parentSpanId"], root_id.as_str());
    }
    let chats = named("chat ");
    assert_eq!(chats.len(), 4, "{spans:#?}");
    for c in &chats {
        assert_eq!(c["name"], "chat slow");
        assert_eq!(c["kind"], 3);
        let parent = by_id[c["parentSpanId"].as_str().unwrap()];
        assert_eq!(parent["name"], "turn");
        assert_eq!(int_attr(parent, "agentd.turn"), int_attr(c, "agentd.turn"));
        assert_eq!(str_attr(c, "gen_ai.operation.name"), "chat");
        assert_eq!(str_attr(c, "gen_ai.request.model"), "slow");
        assert_eq!(str_attr(c, "gen_ai.provider.name"), "scripted");
        assert!(int_attr(c, "gen_ai.usage.input_tokens") > 0);
        assert!(int_attr(c, "gen_ai.usage.output_tokens") >= 0);
        assert_eq!(c["status"]["code"], 0);
    }
    let tools = named("execute_tool ");
    assert_eq!(tools.len(), 3, "{spans:#?}");
    let (_, events) = d.get(&format!("/v1/runs/{id}/events?after=0"), ALPHA).await;
    let call_ids: Vec<&str> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "tool_call_finished")
        .map(|e| e["data"]["call_id"].as_str().unwrap())
        .collect();
    assert_eq!(call_ids.len(), 3, "{events}");
    for t in &tools {
        assert_eq!(t["name"], "execute_tool echo");
        assert_eq!(str_attr(t, "gen_ai.operation.name"), "execute_tool");
        assert_eq!(str_attr(t, "gen_ai.tool.name"), "echo");
        assert!(call_ids.contains(&str_attr(t, "gen_ai.tool.call.id")));
        assert_eq!(str_attr(t, "agentd.tool.outcome"), "ok");
        let parent = by_id[t["parentSpanId"].as_str().unwrap()];
        assert_eq!(parent["name"], "turn");
        // A tool call belongs to the turn whose model call asked for it.
        assert_eq!(int_attr(parent, "agentd.turn"), int_attr(t, "agentd.turn"));
        let start: u64 = t["startTimeUnixNano"].as_str().unwrap().parse().unwrap();
        let end: u64 = t["endTimeUnixNano"].as_str().unwrap().parse().unwrap();
        assert!(start <= end && start > 1_600_000_000_000_000_000);
    }

    // Nothing of the goal, the arguments, the results or the tokens leaves in a span.
    let raw = receiver.raw();
    for secret in [
        "marker-goal-7f3e",
        ALPHA,
        "\"one\"",
        "\"two\"",
        "\"three\"",
        "arguments",
    ] {
        assert!(!raw.contains(secret), "a span carries {secret}: {raw}");
    }
    let m = d
        .http
        .get(d.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(m.contains("agentd_trace_spans_dropped_total 0\n"), "{m}");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_never_holds_a_run_and_drops_are_counted() {
    // Nothing listens on this port: every export fails (bounded by export_timeout).
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let d = TestDaemon::start_with(|c| {
        c.telemetry.otlp_endpoint = Some(format!("http://{closed}"));
        c.telemetry.export_interval = Duration::from_millis(20);
        c.telemetry.export_timeout = Duration::from_millis(500);
    })
    .await;
    let id = d.create(ALPHA, "quick").await;
    d.wait_status(ALPHA, &id, "succeeded").await;
    let dropped = || async {
        let m = d
            .http
            .get(d.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        m.lines()
            .find_map(|l| l.strip_prefix("agentd_trace_spans_dropped_total "))
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    // The run's 6 spans (root, 2 turns, 2 model calls, 1 tool call) end up dropped once their
    // batches fail.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if dropped().await >= 6 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "drops not counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_daemon_continues_the_same_trace() {
    let mut receiver = Receiver::start().await;
    let endpoint = format!("http://{}", receiver.addr);
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file:{}", dir.path().join("data").display());
    let configure = |c: &mut agentd::config::Config| {
        c.store.url = url.clone();
        c.telemetry.otlp_endpoint = Some(endpoint.clone());
        c.telemetry.export_interval = Duration::from_millis(50);
    };
    // The first daemon: the run's first turn asks for a call that needs approval.
    let d = TestDaemon::start_with(configure).await;
    let id = d.create(ALPHA, "approver").await;
    let run = d.wait_status(ALPHA, &id, "waiting_approval").await;
    let call = run["pending_approvals"][0]["call_id"]
        .as_str()
        .unwrap()
        .to_owned();
    d.stop().await;
    let run_id: RunId = id.parse().unwrap();
    let trace_id = hex::encode(agentd::telemetry::trace_id(&run_id));
    let root_id = hex::encode(agentd::telemetry::run_span_id(&run_id));
    // Its actor stopped mid-turn: that turn was sent, marked interrupted, before it exited.
    receiver
        .wait_for(|s| s["name"] == "turn" && attr(s, "agentd.turn.interrupted").is_some())
        .await;

    // The second daemon on the same store: approve, the call runs, the run ends.
    let d = TestDaemon::start_with(configure).await;
    let (s, v) = d
        .post(
            &format!("/v1/runs/{id}/approvals/{call}"),
            ALPHA,
            serde_json::json!({"decision": "approve"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    d.wait_status(ALPHA, &id, "succeeded").await;
    receiver.wait_for(|s| s["spanId"] == root_id.as_str()).await;
    d.stop().await;

    let spans: Vec<(Value, Value)> = receiver
        .spans()
        .into_iter()
        .filter(|(s, _)| str_attr(s, "agentd.run.id") == id)
        .collect();
    assert!(
        spans.iter().all(|(s, _)| s["traceId"] == trace_id.as_str()),
        "{spans:#?}"
    );
    let instances: std::collections::HashSet<String> = spans
        .iter()
        .map(|(_, r)| {
            r["attributes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|a| a["key"] == "service.instance.id")
                .unwrap()["value"]["stringValue"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(instances.len(), 2, "spans from both daemons: {instances:?}");
    let by_id: HashMap<&str, &Value> = spans
        .iter()
        .map(|(s, _)| (s["spanId"].as_str().unwrap(), s))
        .collect();
    let roots: Vec<&&Value> = by_id
        .values()
        .filter(|s| s.get("parentSpanId").is_none())
        .collect();
    assert_eq!(roots.len(), 1);
    for (s, _) in &spans {
        if let Some(p) = s["parentSpanId"].as_str() {
            assert!(by_id.contains_key(p), "{} has no parent here", s["name"]);
        }
    }
    // The approved call ran in the first turn, continued by the second daemon.
    let tool = spans
        .iter()
        .map(|(s, _)| s)
        .find(|s| s["name"] == "execute_tool charge")
        .expect("the tool call's span");
    assert_eq!(str_attr(tool, "gen_ai.tool.call.id"), call);
    let parent = by_id[tool["parentSpanId"].as_str().unwrap()];
    assert_eq!(int_attr(parent, "agentd.turn"), 1);
    assert!(attr(parent, "agentd.turn.resumed").is_some(), "{parent}");
}
