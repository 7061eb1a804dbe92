//! Model and tool calls that fail or run long (issue 11), through the daemon's HTTP API with
//! the real OpenAI-compatible provider against `FakeOpenAi` and HTTP tools against the
//! recording `ToolServer`: bounded generations reach the provider, a timed-out attempt drops
//! its connection, transient tool errors are retried by the runtime before the model hears of
//! them, drifting arguments with identical results end `no_progress`.

use std::time::{Duration, Instant};

use agentd::config::Config;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::daemon_support::{ALPHA, TestDaemon, alpha_on_memory};
use crate::fakes::{FakeOpenAi, Scripted, ToolBehavior, ToolServer};

/// Model `fake` (openai kind, bounded generations) and the read tool `lookup`.
fn config_text(model: &FakeOpenAi, tools: &ToolServer) -> String {
    let header = alpha_on_memory();
    format!(
        r#"{header}

[runtime]
model_timeout = "5s"
model_retry_base = "20ms"
model_retry_max = "200ms"

[models.fake]
kind = "openai"
base_url = "{model_url}"
model = "fake-model"
timeout = "400ms"
max_tokens = 64
temperature = 0.0
stream = false
context_window = 4096

[tools.lookup]
kind = "http"
url = "{tool_url}"
description = "Look a city up"
parameters = {{ type = "object", properties = {{ city = {{ type = "string" }} }}, required = ["city"] }}
effect = "read"
max_attempts = 3
timeout = "2s"

[agents.ops]
model = "fake"
instructions = "Use the tools."
tools = ["lookup"]
max_turns = 8
"#,
        model_url = model.url(),
        tool_url = tools.tool_url(),
    )
}

async fn start(
    model: &FakeOpenAi,
    tools: &ToolServer,
    edit: impl FnOnce(&mut Config),
) -> TestDaemon {
    let mut config = Config::from_toml(&config_text(model, tools)).unwrap();
    edit(&mut config);
    TestDaemon::start_config(config).await
}

async fn create(d: &TestDaemon, input: &str) -> String {
    let (s, v) = d
        .post("/v1/runs", ALPHA, json!({"agent": "ops", "input": input}))
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    v["id"].as_str().unwrap().to_owned()
}

async fn events(d: &TestDaemon, id: &str) -> Vec<Value> {
    let (s, v) = d.get(&format!("/v1/runs/{id}/events"), ALPHA).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["events"].as_array().unwrap().clone()
}

/// Waits (bounded) until `ready` holds.
async fn wait_until(what: &str, ready: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn max_tokens_and_temperature_reach_the_provider() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    model.push(Scripted::text("bounded"));
    let d = start(&model, &tools, |_| {}).await;
    let id = create(&d, "hi").await;
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "bounded");
    let requests = model.requests();
    assert_eq!(requests.len(), 1);
    let body = &requests[0].body;
    assert_eq!(body["max_tokens"], 64, "{body}");
    assert_eq!(body["temperature"], 0.0, "{body}");
    assert!(body.get("stream").is_none(), "{body}");
    d.stop().await;
}

#[tokio::test]
async fn a_timed_out_attempt_drops_its_connection_and_is_retried() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    model
        .push(Scripted::Hang)
        .push(Scripted::text("after the retry"));
    let d = start(&model, &tools, |_| {}).await;
    let id = create(&d, "hi").await;
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "after the retry");
    // The provider saw the abandoned request's connection close: it can stop generating.
    wait_until("the hanging request to be dropped", || {
        model.abandoned() == 1
    })
    .await;
    assert_eq!(model.request_count(), 2);
    // The gateway's retry is an event on the run.
    let retries: Vec<Value> = events(&d, &id)
        .await
        .into_iter()
        .filter(|e| e["type"] == "model_retrying")
        .collect();
    assert_eq!(retries.len(), 1, "{retries:?}");
    assert_eq!(retries[0]["data"]["attempt"], 1);
    assert_eq!(retries[0]["data"]["error"]["kind"], "unavailable");
    assert!(retries[0]["data"]["wait_ms"].as_u64().is_some());
    d.stop().await;
}

/// The tool messages of a recorded model request.
fn tool_messages(body: &Value) -> Vec<Value> {
    body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| serde_json::from_str(m["content"].as_str().unwrap()).unwrap())
        .collect()
}

#[tokio::test]
async fn a_read_tool_failing_twice_with_503_is_retried_before_the_model_hears_of_it() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    model
        .push(Scripted::tool_calls(&[(
            "c1",
            "lookup",
            r#"{"city":"Paris"}"#,
        )]))
        .push(Scripted::text("found it"));
    tools
        .push(ToolBehavior::Refuse(503, "restarting".into()))
        .push(ToolBehavior::Refuse(503, "restarting".into()));
    let d = start(&model, &tools, |_| {}).await;
    let id = create(&d, "find Paris").await;
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "found it");
    let requests = tools.requests();
    assert_eq!(requests.len(), 3, "two 503s, then the success");
    let key = requests[0].idempotency_key.clone().unwrap();
    assert!(
        requests
            .iter()
            .all(|r| r.idempotency_key.as_deref() == Some(key.as_str())),
        "every attempt carries the same key"
    );
    let seen = tool_messages(&model.requests()[1].body);
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0]["ok"], true, "{seen:?}");
    assert!(
        seen[0].get("error").is_none(),
        "the model saw an error: {seen:?}"
    );
    // The run's record has one finished call, a success, after an event per retry.
    let log = events(&d, &id).await;
    let finished: Vec<&Value> = log
        .iter()
        .filter(|e| e["type"] == "tool_call_finished")
        .collect();
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0]["data"]["ok"], true);
    let retries: Vec<&Value> = log
        .iter()
        .filter(|e| e["type"] == "tool_retrying")
        .collect();
    assert_eq!(retries.len(), 2, "one event per retry: {log:?}");
    for (i, r) in retries.iter().enumerate() {
        let data = &r["data"];
        assert_eq!(data["attempt"], i + 1, "{data}");
        assert_eq!(data["call_id"], "call_1_0", "{data}");
        assert_eq!(data["tool"], "lookup", "{data}");
        assert_eq!(data["error"]["code"], "retryable", "{data}");
        assert!(
            data["error"]["message"]
                .as_str()
                .unwrap()
                .contains("restarting"),
            "{data}"
        );
        assert!(data["wait_ms"].as_u64().is_some(), "{data}");
        assert!(r["seq"].as_u64() < finished[0]["seq"].as_u64(), "{log:?}");
    }
    d.stop().await;
}

#[tokio::test]
async fn a_read_tool_that_stays_down_reaches_the_model_after_max_attempts() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    model
        .push(Scripted::tool_calls(&[(
            "c1",
            "lookup",
            r#"{"city":"Paris"}"#,
        )]))
        .push(Scripted::text("it is down"));
    for _ in 0..3 {
        tools.push(ToolBehavior::Refuse(503, "down".into()));
    }
    let d = start(&model, &tools, |_| {}).await;
    let id = create(&d, "find Paris").await;
    d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(tools.requests().len(), 3, "max_attempts = 3");
    let seen = tool_messages(&model.requests()[1].body);
    assert_eq!(seen[0]["ok"], false, "{seen:?}");
    assert_eq!(seen[0]["error"]["code"], "retryable", "{seen:?}");
    d.stop().await;
}

#[tokio::test]
async fn drifting_arguments_with_identical_results_end_no_progress() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    // Each turn the arguments change, the sum does not.
    for a in 1..=7 {
        let args = json!({"a": a, "b": 10 - a}).to_string();
        model.push(Scripted::tool_calls(&[("c", "add", &args)]));
    }
    let d = start(&model, &tools, |c| {
        c.tools
            .insert("add".into(), agentd::config::ToolConfig::builtin("add"));
        c.agents.get_mut("ops").unwrap().tools.push("add".into());
    })
    .await;
    let id = create(&d, "add things").await;
    let run = d.wait_status(ALPHA, &id, "failed").await;
    assert_eq!(run["error"]["code"], "no_progress", "{run}");
    let nudged = model.requests().iter().any(|r| {
        r.body["messages"].as_array().unwrap().iter().any(|m| {
            m["content"]
                .as_str()
                .is_some_and(|c| c.contains("the same result came back"))
        })
    });
    assert!(nudged, "the model was told why");
    d.stop().await;
}

#[tokio::test]
async fn the_budget_reserve_gives_a_final_answer() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    for city in ["Paris", "Lyon"] {
        let args = json!({ "city": city }).to_string();
        model.push(Scripted::tool_calls(&[("c", "lookup", &args)]));
    }
    model.push(Scripted::text("Paris and Lyon were found"));
    let d = start(&model, &tools, |c| {
        c.agents.get_mut("ops").unwrap().max_turns = 2;
    })
    .await;
    let id = create(&d, "find the cities").await;
    let run = d.wait_status(ALPHA, &id, "failed").await;
    assert_eq!(run["error"]["code"], "budget_exceeded", "{run}");
    assert_eq!(run["output"], "Paris and Lyon were found", "{run}");
    let requests = model.requests();
    assert_eq!(requests.len(), 3, "two turns and the reserve");
    let last = &requests[2].body;
    assert!(
        last.get("tools").is_none() || last["tool_choice"] == "none",
        "the reserve turn offers no tools: {last}"
    );
    assert_eq!(tools.requests().len(), 2);
    d.stop().await;
}

#[tokio::test]
async fn an_oversized_context_is_rebuilt_once() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    let overflow = json!({"error": {"message": "This model's maximum context length is 4096 tokens",
                                    "type": "invalid_request_error", "code": "context_length_exceeded"}})
    .to_string();
    model
        .push(Scripted::status(400, &overflow))
        .push(Scripted::text("fits now"));
    let d = start(&model, &tools, |_| {}).await;
    let id = create(&d, "hi").await;
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "fits now");
    assert_eq!(model.request_count(), 2);
    let rebuilt: Vec<Value> = events(&d, &id)
        .await
        .into_iter()
        .filter(|e| e["type"] == "model_failed")
        .collect();
    assert_eq!(rebuilt.len(), 1);
    assert_eq!(rebuilt[0]["data"]["kind"], "context_length_exceeded");
    assert_eq!(rebuilt[0]["data"]["context_rebuild"], 1);

    // Twice: the run fails, classified as such (not "the model refused the request").
    model
        .push(Scripted::status(400, &overflow))
        .push(Scripted::status(400, &overflow));
    let id = create(&d, "hi again").await;
    let run = d.wait_status(ALPHA, &id, "failed").await;
    assert_eq!(run["error"]["code"], "context_length_exceeded", "{run}");
    d.stop().await;
}

#[tokio::test]
async fn ask_user_and_read_output_can_be_switched_off_per_agent() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    model
        .push(Scripted::tool_calls(&[(
            "q1",
            "ask_user",
            r#"{"question":"which city?"}"#,
        )]))
        .push(Scripted::text("Paris, decided alone"));
    let d = start(&model, &tools, |c| {
        let ops = c.agents.get_mut("ops").unwrap();
        ops.ask_user = false;
        ops.read_output = false;
    })
    .await;
    let id = create(&d, "pick a city").await;
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "Paris, decided alone");
    let requests = model.requests();
    let offered: Vec<&str> = requests[0].body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        offered,
        ["lookup"],
        "neither ask_user nor read_output is offered"
    );
    let corrected = tool_messages(&requests[1].body);
    assert_eq!(
        corrected[0]["error"]["code"], "invalid_argument",
        "{corrected:?}"
    );
    assert!(
        corrected[0]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("switched off"),
        "{corrected:?}"
    );
    d.stop().await;
}
