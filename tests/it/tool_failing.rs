//! A tool that keeps failing goes to a person (issue 11, item 2), and permission errors of a
//! tool (item 1): through the daemon's HTTP API and the CLI, with the real OpenAI-compatible
//! provider against `FakeOpenAi` and an HTTP tool against the recording `ToolServer`. The
//! third failure in a row of the same tool holds its call (`waiting_approval`, reason
//! `tool_failing`); the operator retries it, skips it (the model is told) or fails the run,
//! also after the run passivated or the daemon restarted. A 401/403 ends the run
//! `permission_denied`, or waits for an operator when the tool's policy says so.

use std::time::{Duration, Instant};

use agentd::config::Config;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::daemon_support::{ALPHA, TestDaemon};
use crate::fakes::{FakeOpenAi, Scripted, ToolBehavior, ToolServer};

/// Model `fake` and the read tool `lookup` (one attempt per call, so each failure reaches the
/// run at once), on `store`.
fn config(model: &FakeOpenAi, tools: &ToolServer, store: &str, runtime: &str) -> Config {
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
shutdown_timeout = "5s"

[store]
url = "{store}"

[[tenants]]
id = "alpha"
tokens = ["{ALPHA}"]

[runtime]
model_retry_base = "20ms"
model_retry_max = "200ms"
{runtime}

[models.fake]
kind = "openai"
base_url = "{model_url}"
model = "fake-model"
timeout = "2s"

[tools.lookup]
kind = "http"
url = "{tool_url}"
description = "Look a city up"
parameters = {{ type = "object", properties = {{ city = {{ type = "string" }} }}, required = ["city"] }}
effect = "read"
max_attempts = 1
timeout = "2s"

[agents.ops]
model = "fake"
instructions = "Use the tools."
tools = ["lookup"]
max_turns = 8
"#,
        model_url = model.url(),
        tool_url = tools.tool_url(),
    );
    Config::from_toml(&text).unwrap()
}

fn memory(model: &FakeOpenAi, tools: &ToolServer) -> Config {
    config(model, tools, "memory:", "")
}

/// The model calls `lookup` for three cities, then answers `answer`.
fn three_lookups_then(model: &FakeOpenAi, answer: &str) {
    for (i, city) in ["Paris", "Lyon", "Nice"].into_iter().enumerate() {
        let args = json!({ "city": city }).to_string();
        model.push(Scripted::tool_calls(&[(&format!("c{i}"), "lookup", &args)]));
    }
    model.push(Scripted::text(answer));
}

/// The tool fails three times with 500.
fn three_failures(tools: &ToolServer) {
    for _ in 0..3 {
        tools.push(ToolBehavior::Refuse(500, "database unavailable".into()));
    }
}

async fn create(d: &TestDaemon) -> String {
    let (s, v) = d
        .post(
            "/v1/runs",
            ALPHA,
            json!({"agent": "ops", "input": "find the cities"}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    v["id"].as_str().unwrap().to_owned()
}

async fn events(d: &TestDaemon, id: &str) -> Vec<Value> {
    let (s, v) = d.get(&format!("/v1/runs/{id}/events"), ALPHA).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["events"].as_array().unwrap().clone()
}

async fn decide(d: &TestDaemon, id: &str, call: &str, body: Value) -> (StatusCode, Value) {
    d.post(&format!("/v1/runs/{id}/approvals/{call}"), ALPHA, body)
        .await
}

/// The tool messages of a recorded model request, parsed.
fn tool_messages(body: &Value) -> Vec<Value> {
    body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| serde_json::from_str(m["content"].as_str().unwrap()).unwrap())
        .collect()
}

/// Waits for the run to hold its third call for an operator; checks how the run, the
/// approvals inbox and the events show it. Returns the held call's id.
async fn wait_held(d: &TestDaemon, id: &str, reason: &str) -> String {
    let run = d.wait_status(ALPHA, id, "waiting_approval").await;
    let pending = run["pending_approvals"].as_array().unwrap();
    assert_eq!(pending.len(), 1, "{run}");
    assert_eq!(pending[0]["reason"], reason, "{run}");
    assert_eq!(pending[0]["tool"], "lookup", "{run}");
    let call = pending[0]["call_id"].as_str().unwrap().to_owned();
    let (s, inbox) = d.get("/v1/approvals", ALPHA).await;
    assert_eq!(s, StatusCode::OK, "{inbox}");
    let mine: Vec<&Value> = inbox["approvals"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["run_id"] == id)
        .collect();
    assert_eq!(mine.len(), 1, "{inbox}");
    assert_eq!(mine[0]["reason"], reason, "{inbox}");
    assert_eq!(mine[0]["call_id"], call.as_str(), "{inbox}");
    assert_eq!(mine[0]["tool"], "lookup", "{inbox}");
    let held: Vec<Value> = events(d, id)
        .await
        .into_iter()
        .filter(|e| e["type"] == "tool_call_finished" && e["data"]["held"] == reason)
        .collect();
    assert_eq!(held.len(), 1, "one event holds the call");
    assert_eq!(held[0]["data"]["call_id"], call.as_str());
    call
}

/// A Prometheus sample's value from `/metrics`.
async fn metric(d: &TestDaemon, name: &str) -> Option<f64> {
    let text = d
        .http
        .get(d.url("/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Waits (bounded) until no run actor is live: every waiting run has passivated.
async fn wait_passivated(d: &TestDaemon) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(d, "agentd_live_runs").await != Some(0.0) {
        assert!(Instant::now() < deadline, "the run did not passivate");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_tool_failing_three_times_waits_for_an_operator_who_retries_it() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    three_lookups_then(&model, "Nice found");
    three_failures(&tools);
    let c = config(&model, &tools, "memory:", r#"passivate_after = "50ms""#);
    // The no-progress failure streak would fire at 4; the operator comes first, at 3 (the
    // default `max_failures`).
    assert_eq!(c.runtime.failure_limit, 4);
    assert_eq!(c.tools["lookup"].max_failures, None);
    let d = TestDaemon::start_config(c).await;
    let id = create(&d).await;
    let call = wait_held(&d, &id, "tool_failing").await;
    assert_eq!(call, "call_3_0");
    // The model heard of the first two failures only.
    assert_eq!(model.request_count(), 3);
    let seen = tool_messages(&model.requests()[2].body);
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen.iter().all(|m| m["ok"] == false), "{seen:?}");

    // The held run gives up its actor like any waiting run; the decision brings it back.
    wait_passivated(&d).await;
    let (s, v) = decide(&d, &id, &call, json!({"decision": "approve"})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "Nice found");

    // The call was sent again with the same key; the model saw its success, nothing else.
    let requests = tools.requests();
    assert_eq!(requests.len(), 4, "three failures, then the retry");
    assert_eq!(requests[3].idempotency_key, requests[2].idempotency_key);
    assert_ne!(requests[2].idempotency_key, requests[1].idempotency_key);
    let seen = tool_messages(&model.requests()[3].body);
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert_eq!(seen[2]["ok"], true, "{seen:?}");
    assert!(seen[2].get("error").is_none(), "{seen:?}");
    let kinds: Vec<String> = events(&d, &id)
        .await
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        kinds
            .windows(2)
            .any(|w| w[0] == "call_approved" && w[1] == "tool_call_finished"),
        "{kinds:?}"
    );
    assert!(!kinds.iter().any(|k| k == "run_failed"), "{kinds:?}");
    d.stop().await;
}

#[tokio::test]
async fn an_operator_who_skips_a_failing_call_has_the_model_told() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    three_lookups_then(&model, "Nice is unknown today");
    three_failures(&tools);
    let d = TestDaemon::start_config(memory(&model, &tools)).await;
    let id = create(&d).await;
    let call = wait_held(&d, &id, "tool_failing").await;
    let (s, v) = decide(
        &d,
        &id,
        &call,
        json!({"decision": "reject", "reason": "the city database is down until noon"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "Nice is unknown today");
    assert_eq!(
        tools.requests().len(),
        3,
        "a skipped call is not sent again"
    );
    let seen = tool_messages(&model.requests()[3].body);
    assert_eq!(seen.len(), 3, "{seen:?}");
    let skip = &seen[2];
    assert_eq!(skip["ok"], false, "{skip}");
    assert_eq!(skip["error"]["code"], "skipped", "{skip}");
    let message = skip["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("an operator skipped this call")
            && message.contains("failed 3 times in a row")
            && message.contains("down until noon"),
        "{message}"
    );
    let rejected: Vec<Value> = events(&d, &id)
        .await
        .into_iter()
        .filter(|e| e["type"] == "call_rejected")
        .collect();
    assert_eq!(rejected.len(), 1);
    assert_eq!(rejected[0]["data"]["held"], "tool_failing");
    d.stop().await;
}

/// The CLI against the in-process daemon.
async fn cli(d: &TestDaemon, args: &[&str]) -> (i32, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_agentd"))
            .env_remove("AGENTD_URL")
            .env_remove("AGENTD_TOKEN")
            .env("NO_COLOR", "1")
            .args(["--url", &d.base(), "--token", ALPHA])
            .args(args)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the CLI did not finish in time")
    .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_can_fail_the_run_at_a_failing_call_from_the_cli() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    three_lookups_then(&model, "never asked");
    three_failures(&tools);
    let d = TestDaemon::start_config(memory(&model, &tools)).await;
    let id = create(&d).await;
    let call = wait_held(&d, &id, "tool_failing").await;
    let (code, out) = cli(&d, &["approvals"]).await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&id) && out.contains("tool_failing") && out.contains("agentd approvals fail"),
        "{out}"
    );
    let (code, out) = cli(&d, &["runs", "get", &id]).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("[tool_failing]"), "{out}");
    let (code, out) = cli(
        &d,
        &["runs", "fail", &id, &call, "--reason", "upstream is gone"],
    )
    .await;
    assert_eq!(code, 0, "{out}");
    let run = d.wait_status(ALPHA, &id, "failed").await;
    assert_eq!(run["error"]["code"], "tool_failing", "{run}");
    let message = run["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("upstream is gone") && message.contains("database unavailable"),
        "{message}"
    );
    assert_eq!(model.request_count(), 3, "the model is not asked again");
    // The same decision again answers the same; another one no longer fits.
    let (s, v) = decide(&d, &id, &call, json!({"decision": "fail"})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["status"], "failed");
    let (s, v) = decide(&d, &id, &call, json!({"decision": "approve"})).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    let ended: Vec<Value> = events(&d, &id)
        .await
        .into_iter()
        .filter(|e| e["type"] == "run_failed")
        .collect();
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0]["data"]["cause"], "call_failed");
    assert_eq!(ended[0]["data"]["call_id"], call.as_str());
    d.stop().await;
}

#[tokio::test]
async fn a_held_call_survives_a_daemon_restart() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    three_lookups_then(&model, "found after the restart");
    three_failures(&tools);
    let data = tempfile::tempdir().unwrap();
    let store = format!("file:{}", data.path().display());
    let d = TestDaemon::start_config(config(&model, &tools, &store, "")).await;
    let id = create(&d).await;
    let call = wait_held(&d, &id, "tool_failing").await;
    d.stop().await;

    let d = TestDaemon::start_config(config(&model, &tools, &store, "")).await;
    let again = wait_held(&d, &id, "tool_failing").await;
    assert_eq!(again, call);
    let (s, v) = decide(&d, &id, &call, json!({"decision": "approve"})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "found after the restart");
    let requests = tools.requests();
    assert_eq!(requests.len(), 4);
    assert_eq!(requests[3].idempotency_key, requests[2].idempotency_key);
    d.stop().await;
}

#[tokio::test]
async fn a_403_of_a_tool_ends_the_run_permission_denied_without_a_retry() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    three_lookups_then(&model, "never asked");
    tools.push(ToolBehavior::Refuse(
        403,
        "this token may not read cities".into(),
    ));
    let mut c = memory(&model, &tools);
    // Even with retries configured, a permission error is final.
    c.tools.get_mut("lookup").unwrap().max_attempts = Some(3);
    let d = TestDaemon::start_config(c).await;
    let id = create(&d).await;
    let run = d.wait_status(ALPHA, &id, "failed").await;
    assert_eq!(run["error"]["code"], "permission_denied", "{run}");
    assert!(
        run["error"]["message"].as_str().unwrap().contains("lookup"),
        "{run}"
    );
    assert_eq!(tools.requests().len(), 1, "never retried");
    assert_eq!(model.request_count(), 1, "the model is not asked again");
    let retried = events(&d, &id)
        .await
        .iter()
        .filter(|e| e["type"] == "tool_retrying")
        .count();
    assert_eq!(retried, 0);
    d.stop().await;
}

#[tokio::test]
async fn a_401_waits_for_an_operator_when_the_tool_says_so() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    model
        .push(Scripted::tool_calls(&[(
            "c0",
            "lookup",
            r#"{"city":"Paris"}"#,
        )]))
        .push(Scripted::text("Paris found"));
    tools.push(ToolBehavior::Refuse(401, "token expired".into()));
    let mut c = memory(&model, &tools);
    c.tools.get_mut("lookup").unwrap().on_permission_error =
        Some(agentd::tool::OnPermissionError::Operator);
    let d = TestDaemon::start_config(c).await;
    let id = create(&d).await;
    let call = wait_held(&d, &id, "permission_error").await;
    // The credentials were fixed: run it again.
    let (s, v) = decide(&d, &id, &call, json!({"decision": "approve"})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "Paris found");
    assert_eq!(tools.requests().len(), 2);
    let seen = tool_messages(&model.requests()[1].body);
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0]["ok"], true, "{seen:?}");
    d.stop().await;
}
