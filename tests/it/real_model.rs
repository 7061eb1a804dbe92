//! A run against a real small model behind an OpenAI-compatible server, opt-in: it runs only
//! when `AGENTD_REAL_MODEL_URL` is set (e.g. `http://127.0.0.1:8765/v1`, served by
//! `scripts/real-model-server.py`; see README, "Testing against a real model"), and otherwise
//! returns at once, saying so.
//!
//! The daemon talks to the model through a timing proxy in this test, and the agent's one tool,
//! `get_weather`, is an HTTP tool served by the same test server. The test asserts the protocol
//! path only: a real `tool_calls` reply reached the tool, its `role:"tool"` result went back,
//! and the run ended `succeeded` with a non-empty answer. The small model keeps calling the
//! tool after it has seen the result; what ends the loop is the runtime's own no-progress guard
//! (nudge, then a final turn with `tool_choice:"none"`), so the test sets no script and pins no
//! wording. It prints the events, the answer, the model calls and the runtime's own overhead:
//! the run's wall time less the time spent inside model and tool calls.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentd::config::Config;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{OriginalUri, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use serde_json::{Value, json};

use crate::daemon_support::{ALPHA, TestDaemon, alpha_on_memory};

/// The model name the recipe's server answers to (`--model_alias`).
const DEFAULT_MODEL: &str = "smollm2-135m";

/// How long the whole run may take.
const RUN_BOUND: Duration = Duration::from_secs(300);

/// One request through the proxy or to the tool.
#[derive(Debug, Clone)]
struct Timed {
    started: Instant,
    took: Duration,
    request: Value,
    status: u16,
    reply: Value,
}

struct Recorder {
    upstream: String,
    http: reqwest::Client,
    model_calls: Mutex<Vec<Timed>>,
    tool_calls: Mutex<Vec<Timed>>,
}

/// Forwards `/v1/...` to the model server, timing each request.
async fn forward(
    State(rec): State<Arc<Recorder>>,
    OriginalUri(uri): OriginalUri,
    body: Bytes,
) -> Response {
    let path = uri.path().strip_prefix("/v1").unwrap_or(uri.path());
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let started = Instant::now();
    let res = rec
        .http
        .post(format!("{}{path}", rec.upstream))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await;
    let (status, text) = match res {
        Ok(r) => {
            let status = r.status().as_u16();
            (status, r.text().await.unwrap_or_default())
        }
        Err(e) => (
            502,
            json!({"error": {"message": e.to_string()}}).to_string(),
        ),
    };
    let took = started.elapsed();
    rec.model_calls.lock().unwrap().push(Timed {
        started,
        took,
        request,
        status,
        reply: serde_json::from_str(&text).unwrap_or(Value::String(text.clone())),
    });
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    (status, [("content-type", "application/json")], text).into_response()
}

/// The agent's tool: the weather, the same whatever the city.
async fn weather(State(rec): State<Arc<Recorder>>, body: Bytes) -> Response {
    let started = Instant::now();
    let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let reply = json!({"temperature_c": 18, "condition": "sunny"});
    rec.tool_calls.lock().unwrap().push(Timed {
        started,
        took: started.elapsed(),
        request,
        status: 200,
        reply: reply.clone(),
    });
    axum::Json(reply).into_response()
}

fn config(model_url: &str, model: &str, tool_url: &str) -> String {
    let header = alpha_on_memory();
    format!(
        r#"{header}

[models.real]
kind = "openai"
base_url = "{model_url}"
model = "{model}"
max_tokens = 64
temperature = 0.0
stream = false
context_window = 4096
timeout = "120s"

[tools.get_weather]
kind = "http"
url = "{tool_url}"
description = "Get the current weather for a city."
parameters = {{ type = "object", properties = {{ location = {{ type = "string", description = "City name, e.g. Paris" }} }}, required = ["location"] }}
effect = "read"
timeout = "10s"

[agents.weather]
model = "real"
instructions = "You are a helpful assistant. Use the provided functions when they can answer the user."
tools = ["get_weather"]
ask_user = false
"#
    )
}

fn secs(d: Duration) -> String {
    format!("{:.3} s", d.as_secs_f64())
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    match v.len() {
        0 => Duration::ZERO,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2,
    }
}

/// What one model reply was, in a line.
fn reply_summary(t: &Timed) -> String {
    let msg = &t.reply["choices"][0]["message"];
    let calls: Vec<String> = msg["tool_calls"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| {
                    format!(
                        "{}({})",
                        c["function"]["name"].as_str().unwrap_or("?"),
                        c["function"]["arguments"].as_str().unwrap_or("?")
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let usage = &t.reply["usage"];
    format!(
        "HTTP {} tool_choice={} messages={} -> finish={} tool_calls=[{}] text={:?} tokens {}+{}",
        t.status,
        t.request["tool_choice"],
        t.request["messages"].as_array().map_or(0, Vec::len),
        t.reply["choices"][0]["finish_reason"],
        calls.join(", "),
        msg["content"].as_str().unwrap_or(""),
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
}

#[tokio::test]
async fn a_real_model_calls_a_tool_and_answers() {
    let Ok(upstream) = std::env::var("AGENTD_REAL_MODEL_URL") else {
        eprintln!(
            "real_model: skipped (set AGENTD_REAL_MODEL_URL, e.g. http://127.0.0.1:8765/v1, \
             to run it against a real model; see README)"
        );
        return;
    };
    let upstream = upstream.trim_end_matches('/').to_owned();
    let model = std::env::var("AGENTD_REAL_MODEL_NAME").unwrap_or_else(|_| DEFAULT_MODEL.into());

    let rec = Arc::new(Recorder {
        upstream: upstream.clone(),
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(180))
            .build()
            .unwrap(),
        model_calls: Mutex::default(),
        tool_calls: Mutex::default(),
    });
    let router = Router::new()
        .route("/v1/{*rest}", any(forward))
        .route("/weather", post(weather))
        .with_state(Arc::clone(&rec));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, router).await });

    let toml = config(
        &format!("http://{addr}/v1"),
        &model,
        &format!("http://{addr}/weather"),
    );
    let d = TestDaemon::start_config(Config::from_toml(&toml).unwrap()).await;

    let started = Instant::now();
    let (s, v) = d
        .post(
            "/v1/runs",
            ALPHA,
            json!({"agent": "weather", "input": "What is the weather like in Paris right now?"}),
        )
        .await;
    assert_eq!(s, reqwest::StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().unwrap().to_owned();
    let run = loop {
        let (s, v) = d.get(&format!("/v1/runs/{id}"), ALPHA).await;
        assert_eq!(s, reqwest::StatusCode::OK, "{v}");
        if matches!(
            v["status"].as_str(),
            Some("succeeded" | "failed" | "cancelled")
        ) {
            break v;
        }
        assert!(
            started.elapsed() < RUN_BOUND,
            "run {id} did not end within {RUN_BOUND:?}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let wall = started.elapsed();

    let (s, ev) = d.get(&format!("/v1/runs/{id}/events"), ALPHA).await;
    assert_eq!(s, reqwest::StatusCode::OK, "{ev}");
    let events = ev["events"].as_array().cloned().unwrap_or_default();
    let model_calls = rec.model_calls.lock().unwrap().clone();
    let tool_calls = rec.tool_calls.lock().unwrap().clone();

    eprintln!("real_model: server {upstream}, model {model}");
    eprintln!("real_model: events ({}):", events.len());
    for e in &events {
        let mut detail = e["data"].to_string();
        if let Some((cut, _)) = detail.char_indices().nth(220) {
            detail.truncate(cut);
            detail.push('…');
        }
        eprintln!("  {:>3} {} {} {detail}", e["seq"], e["at"], e["type"]);
    }
    eprintln!("real_model: model calls ({}):", model_calls.len());
    for (i, t) in model_calls.iter().enumerate() {
        eprintln!(
            "  #{} at +{} took {}: {}",
            i + 1,
            secs(t.started.saturating_duration_since(started)),
            secs(t.took),
            reply_summary(t)
        );
    }
    eprintln!("real_model: tool calls ({}):", tool_calls.len());
    for t in &tool_calls {
        eprintln!("  arguments {} -> {}", t.request["arguments"], t.reply);
    }
    let in_model: Duration = model_calls.iter().map(|t| t.took).sum();
    let in_tools: Duration = tool_calls.iter().map(|t| t.took).sum();
    let overhead = wall.saturating_sub(in_model + in_tools);
    eprintln!(
        "real_model: status {} answer {}",
        run["status"],
        serde_json::to_string(&run["output"]).unwrap()
    );
    eprintln!(
        "real_model: wall {} | model calls {} (median {}, total {}) | tool calls {} (total {}) \
         | runtime overhead {} ({:.1} ms per model call)",
        secs(wall),
        model_calls.len(),
        secs(median(model_calls.iter().map(|t| t.took).collect())),
        secs(in_model),
        tool_calls.len(),
        secs(in_tools),
        secs(overhead),
        overhead.as_secs_f64() * 1000.0 / model_calls.len().max(1) as f64,
    );

    assert!(
        !tool_calls.is_empty(),
        "no tool call reached the tool; run {run}"
    );
    assert!(
        model_calls.iter().all(|t| t.status == 200),
        "a model call failed"
    );
    let sent_back = model_calls.iter().any(|t| {
        t.request["messages"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m["role"] == "tool"))
    });
    assert!(sent_back, "no request carried the tool's result back");
    assert_eq!(run["status"], "succeeded", "{run}");
    let answer = match &run["output"] {
        Value::String(s) => s.trim().to_owned(),
        Value::Null => String::new(),
        other => other.to_string(),
    };
    assert!(!answer.is_empty(), "empty answer: {run}");

    d.stop().await;
    server.abort();
}
