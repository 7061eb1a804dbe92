//! Compensation (issue 11, item 4), through the daemon's HTTP API with the OpenAI-compatible
//! provider against `FakeOpenAi` and HTTP tools against the recording `ToolServer`:
//! `restart_service` (unsafe, the naive `/tool` route) names `undo_restart` (idempotent, the
//! key-honouring `/honouring` route) as its compensation, with `service` mapped from the
//! original call's arguments and a literal `reason`. A run with two successful restarts that
//! is cancelled, or fails, undoes both, newest first, each once with its own key, before its
//! terminal event; a compensation that fails is recorded `failed`; and across a kill -9 of a
//! real daemon process (`ChildDaemon`) while a compensation is in flight, a finished one is
//! never sent again and the one in flight is resent with the same key (the tool honours
//! keys, so each compensation is applied exactly once; the raw requests are asserted too);
//! with an `unsafe`, naive compensating tool, the one in flight is recorded `outcome_unknown`
//! and never sent again, and the older call is still undone.

use std::path::Path;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::chaos_support::{ChildDaemon, tail};
use crate::daemon_support::{ALPHA, TestDaemon};
use crate::fakes::{FakeOpenAi, Scripted, ToolBehavior, ToolRequest, ToolServer};

fn config_text(model: &FakeOpenAi, tools: &ToolServer, store: &str, undo_attempts: u32) -> String {
    config_with_undo(
        model,
        tools,
        store,
        undo_attempts,
        "idempotent",
        &tools.honouring_url(),
    )
}

/// `config_text` with the compensating tool's effect and URL.
fn config_with_undo(
    model: &FakeOpenAi,
    tools: &ToolServer,
    store: &str,
    undo_attempts: u32,
    undo_effect: &str,
    undo_url: &str,
) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
shutdown_timeout = "5s"

[store]
url = "{store}"

[[tenants]]
id = "alpha"
tokens = ["{ALPHA}"]

[models.fake]
kind = "openai"
base_url = "{model_url}"
model = "fake-model"
timeout = "5s"

[tools.restart_service]
kind = "http"
url = "{tool_url}"
description = "Restart one service"
parameters = {{ type = "object", properties = {{ service = {{ type = "string" }} }}, required = ["service"] }}
effect = "unsafe"
timeout = "30s"
compensate = {{ tool = "undo_restart", arguments = {{ service = "/service", reason = {{ value = "compensation" }} }} }}

[tools.undo_restart]
kind = "http"
url = "{undo_url}"
description = "Undo a restart"
parameters = {{ type = "object", properties = {{ service = {{ type = "string" }}, reason = {{ type = "string" }} }}, required = ["service"] }}
effect = "{undo_effect}"
max_attempts = {undo_attempts}
timeout = "30s"

[agents.ops]
model = "fake"
instructions = "Restart what is asked."
tools = ["restart_service"]
max_turns = 8
"#,
        model_url = model.url(),
        tool_url = tools.tool_url(),
    )
}

/// Two restarts (`api`, then `db`), then the model asks the user (so the run waits, ready to
/// be cancelled).
fn two_restarts_then_ask(model: &FakeOpenAi) {
    for (i, service) in ["api", "db"].into_iter().enumerate() {
        let args = json!({ "service": service }).to_string();
        model.push(Scripted::tool_calls(&[(
            &format!("c{i}"),
            "restart_service",
            &args,
        )]));
    }
    model.push(Scripted::tool_calls(&[(
        "q",
        "ask_user",
        r#"{"question":"anything else?"}"#,
    )]));
}

fn requests_of(tools: &ToolServer, tool: &str) -> Vec<ToolRequest> {
    tools
        .requests()
        .into_iter()
        .filter(|r| r.body["tool"] == tool)
        .collect()
}

fn service(r: &ToolRequest) -> &str {
    r.body["arguments"]["service"].as_str().unwrap()
}

fn key(r: &ToolRequest) -> String {
    r.idempotency_key.clone().unwrap()
}

/// The two restarts ran once each, with two distinct keys; returns them (api, db).
fn restarts(tools: &ToolServer) -> (String, String) {
    let r = requests_of(tools, "restart_service");
    assert_eq!(r.len(), 2, "{r:?}");
    assert_eq!((service(&r[0]), service(&r[1])), ("api", "db"));
    assert_ne!(key(&r[0]), key(&r[1]));
    (key(&r[0]), key(&r[1]))
}

/// The run's record: both compensations with their mapped arguments, their own keys and
/// `status`, newest call first in execution, listed in the order the originals completed.
fn check_record(run: &Value, statuses: [&str; 2]) -> (String, String) {
    let k = run["compensations"].as_array().unwrap();
    assert_eq!(k.len(), 2, "{run}");
    for (i, (svc, call)) in [("api", "call_1_0"), ("db", "call_2_0")].iter().enumerate() {
        assert_eq!(k[i]["for_call"], *call, "{run}");
        assert_eq!(k[i]["call_id"], format!("{call}_undo"), "{run}");
        assert_eq!(k[i]["for_tool"], "restart_service");
        assert_eq!(k[i]["tool"], "undo_restart");
        assert_eq!(
            k[i]["arguments"],
            json!({"service": svc, "reason": "compensation"})
        );
        assert_eq!(k[i]["status"], statuses[i], "{run}");
    }
    assert!(run["ending"].is_null(), "{run}");
    (
        k[0]["key"].as_str().unwrap().to_owned(),
        k[1]["key"].as_str().unwrap().to_owned(),
    )
}

fn kinds(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect()
}

/// Exactly one terminal event, the last one, after every compensation's events.
fn check_log(events: &[Value], terminal: &str) {
    let k = kinds(events);
    let terminals: Vec<&String> = k
        .iter()
        .filter(|t| matches!(t.as_str(), "run_succeeded" | "run_failed" | "run_cancelled"))
        .collect();
    assert_eq!(terminals, [terminal], "{k:?}");
    assert_eq!(k.last().unwrap(), terminal, "{k:?}");
    assert_eq!(
        k.iter().filter(|t| *t == "compensation_started").count(),
        1,
        "{k:?}"
    );
    let last = events.last().unwrap();
    assert_eq!(last["data"]["cause"], "compensation_finished", "{last}");
    assert_eq!(last["data"]["compensations"].as_array().unwrap().len(), 2);
}

async fn events(d: &TestDaemon, id: &str) -> Vec<Value> {
    let (s, v) = d.get(&format!("/v1/runs/{id}/events"), ALPHA).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["events"].as_array().unwrap().clone()
}

async fn start(model: &FakeOpenAi, tools: &ToolServer, undo_attempts: u32) -> (TestDaemon, String) {
    let config =
        agentd::config::Config::from_toml(&config_text(model, tools, "memory:", undo_attempts))
            .unwrap();
    let d = TestDaemon::start_config(config).await;
    let id = d.create(ALPHA, "ops").await;
    (d, id)
}

#[tokio::test]
async fn a_cancelled_run_undoes_both_restarts_newest_first_exactly_once() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    two_restarts_then_ask(&model);
    let (d, id) = start(&model, &tools, 3).await;
    let waiting = d.wait_status(ALPHA, &id, "waiting_input").await;
    // While running, the record already says what a cancel would undo.
    let pending: Vec<&Value> = waiting["compensations"]
        .as_array()
        .unwrap()
        .iter()
        .collect();
    assert_eq!(pending.len(), 2, "{waiting}");
    assert!(
        pending.iter().all(|k| k["status"] == "pending"),
        "{waiting}"
    );
    assert!(requests_of(&tools, "undo_restart").is_empty());

    let (s, cancelled) = d
        .post(
            &format!("/v1/runs/{id}/cancel"),
            ALPHA,
            json!({"reason": "stop"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{cancelled}");
    // Honest: not cancelled yet, but compensating on its way to `cancelled`.
    assert_eq!(cancelled["status"], "running", "{cancelled}");
    assert_eq!(cancelled["phase"], "compensating", "{cancelled}");
    assert_eq!(cancelled["ending"]["status"], "cancelled", "{cancelled}");
    // A repeated cancel is answered like the first.
    let (s, again) = d
        .post(&format!("/v1/runs/{id}/cancel"), ALPHA, json!({}))
        .await;
    assert_eq!(s, StatusCode::OK, "{again}");

    // The first poll that sees `cancelled` sees every compensation finished.
    let run = d.wait_status(ALPHA, &id, "cancelled").await;
    let (k_api, k_db) = check_record(&run, ["done", "done"]);
    let (r_api, r_db) = restarts(&tools);
    let undo = requests_of(&tools, "undo_restart");
    assert_eq!(
        undo.len(),
        2,
        "each compensation reached the tool once: {undo:?}"
    );
    // Reverse order of the originals' completion: db first, then api.
    assert_eq!((service(&undo[0]), service(&undo[1])), ("db", "api"));
    assert_eq!(undo[0].body["arguments"]["reason"], "compensation");
    assert_eq!(
        (key(&undo[0]), key(&undo[1])),
        (k_db.clone(), k_api.clone())
    );
    // Their own keys: not the originals', not each other's.
    for k in [&k_api, &k_db] {
        assert!(k != &r_api && k != &r_db);
    }
    assert_ne!(k_api, k_db);
    assert_eq!(tools.executions(&k_db), 1);
    assert_eq!(tools.executions(&k_api), 1);
    assert_eq!(undo[0].body["call_id"], "call_2_0_undo");

    let ev = events(&d, &id).await;
    check_log(&ev, "run_cancelled");
    let started = ev
        .iter()
        .find(|e| e["type"] == "compensation_started")
        .unwrap();
    assert_eq!(started["data"]["cause"], "run_cancelled");
    assert_eq!(started["data"]["dispatched"][0]["key"], json!(k_db));
    let finished: Vec<&Value> = ev
        .iter()
        .filter(|e| e["type"] == "compensation_finished")
        .collect();
    assert_eq!(
        finished.len(),
        1,
        "the last one is recorded in the terminal event"
    );
    assert_eq!(finished[0]["data"]["call_id"], "call_2_0_undo");
    assert_eq!(finished[0]["data"]["outcome"], "done");
    assert_eq!(finished[0]["data"]["dispatched"][0]["key"], json!(k_api));
    assert_eq!(ev.last().unwrap()["data"]["call_id"], "call_1_0_undo");
    d.stop().await;
}

#[tokio::test]
async fn a_failed_run_undoes_its_successful_restarts_but_not_the_refused_one() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    for (i, service) in ["api", "db", "cache"].into_iter().enumerate() {
        let args = json!({ "service": service }).to_string();
        model.push(Scripted::tool_calls(&[(
            &format!("c{i}"),
            "restart_service",
            &args,
        )]));
    }
    // The third restart is refused with 403: the run fails `permission_denied`.
    tools
        .push(ToolBehavior::Apply)
        .push(ToolBehavior::Apply)
        .push(ToolBehavior::Refuse(403, "not allowed".into()));
    let (d, id) = start(&model, &tools, 3).await;
    let run = d.wait_status(ALPHA, &id, "failed").await;
    assert_eq!(run["error"]["code"], "permission_denied", "{run}");
    check_record(&run, ["done", "done"]);
    let undo = requests_of(&tools, "undo_restart");
    assert_eq!(undo.len(), 2, "{undo:?}");
    assert_eq!((service(&undo[0]), service(&undo[1])), ("db", "api"));
    let ev = events(&d, &id).await;
    check_log(&ev, "run_failed");
    let started = ev
        .iter()
        .find(|e| e["type"] == "compensation_started")
        .unwrap();
    assert_eq!(
        started["data"]["ending"]["error"]["code"],
        "permission_denied"
    );
    assert_eq!(
        ev.last().unwrap()["data"]["error"]["code"],
        "permission_denied"
    );
    d.stop().await;
}

#[tokio::test]
async fn a_compensation_that_keeps_failing_is_retried_by_class_then_recorded_failed() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    two_restarts_then_ask(&model);
    // Both restarts apply; the undo of `db` gets a 503 (retried by class, same key), then a
    // 422 (a final error); the undo of `api` succeeds.
    tools
        .push(ToolBehavior::Apply)
        .push(ToolBehavior::Apply)
        .push(ToolBehavior::Refuse(503, "undo unavailable".into()))
        .push(ToolBehavior::Refuse(422, "nothing to undo here".into()));
    let (d, id) = start(&model, &tools, 2).await;
    d.wait_status(ALPHA, &id, "waiting_input").await;
    let (s, v) = d
        .post(&format!("/v1/runs/{id}/cancel"), ALPHA, json!({}))
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let run = d.wait_status(ALPHA, &id, "cancelled").await;
    let (k_api, k_db) = check_record(&run, ["done", "failed"]);
    let failed = &run["compensations"][1];
    assert_eq!(
        failed["attempts"], 1,
        "one send; the executor's retry is within it"
    );
    assert_eq!(failed["error"]["code"], "failed", "{run}");
    assert!(
        failed["error"]["message"]
            .as_str()
            .unwrap()
            .contains("nothing to undo"),
        "{run}"
    );
    assert_eq!(
        tools.attempts(&k_db),
        2,
        "retried by class with the same key"
    );
    assert_eq!(tools.executions(&k_db), 0);
    assert_eq!(tools.executions(&k_api), 1);
    let ev = events(&d, &id).await;
    check_log(&ev, "run_cancelled");
    let retrying: Vec<&Value> = ev
        .iter()
        .filter(|e| e["type"] == "compensation_retrying")
        .collect();
    assert_eq!(retrying.len(), 1, "{:?}", kinds(&ev));
    assert_eq!(retrying[0]["data"]["call_id"], "call_2_0_undo");
    d.stop().await;
}

// ---- kill -9 of a real daemon process ----

async fn wait_run_child(
    d: &ChildDaemon,
    id: &str,
    log: &Path,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (s, v) = d.get(&format!("/v1/runs/{id}"), ALPHA).await;
        if s == StatusCode::OK && done(&v) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "run {id} stuck at {v}; log:\n{}",
            tail(log, 40)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (bounded) until the tool server has received `n` requests for `tool`.
async fn wait_requests(tools: &ToolServer, tool: &str, n: usize, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while requests_of(tools, tool).len() < n {
        assert!(
            Instant::now() < deadline,
            "{tool} got {} of {n} requests; log:\n{}",
            requests_of(tools, tool).len(),
            tail(log, 40)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Cancels after two restarts, SIGKILLs the daemon while compensation number `hang` (0: the
/// first, `db`; 1: the second, `api`) is applied by the tool but not answered, restarts it on
/// the same store, and checks that the run ends `cancelled` with both undone: the one finished
/// before the kill never sent again, the one in flight resent once with the same key.
async fn kill9_during_compensation(hang: usize) {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    two_restarts_then_ask(&model);
    tools.push(ToolBehavior::Apply).push(ToolBehavior::Apply);
    if hang == 1 {
        tools.push(ToolBehavior::Apply);
    }
    tools.push(ToolBehavior::ApplyThenHang);
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("data")).unwrap();
    let store = format!("file:{}", dir.path().join("data").display());
    let cfg = dir.path().join("agentd.toml");
    let log = dir.path().join("agentd.log");
    std::fs::write(&cfg, config_text(&model, &tools, &store, 3)).unwrap();
    let d = ChildDaemon::start(&cfg, &log).await;
    let (s, v) = d
        .post(
            "/v1/runs",
            ALPHA,
            &json!({"agent": "ops", "input": "restart api and db"}),
        )
        .await
        .unwrap();
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().unwrap().to_owned();
    wait_run_child(&d, &id, &log, |v| v["status"] == "waiting_input").await;
    let (s, v) = d
        .post(&format!("/v1/runs/{id}/cancel"), ALPHA, &json!({}))
        .await
        .unwrap();
    assert_eq!(s, StatusCode::OK, "{v}");
    // The compensation `hang` has reached the tool (and was applied), its answer never comes.
    wait_requests(&tools, "undo_restart", hang + 1, &log).await;
    d.kill9();

    let d = ChildDaemon::start(&cfg, &log).await;
    let run = wait_run_child(&d, &id, &log, |v| v["status"] == "cancelled").await;
    let (k_api, k_db) = check_record(&run, ["done", "done"]);
    let (in_flight, before) = if hang == 0 {
        (&k_db, None)
    } else {
        (&k_api, Some(&k_db))
    };
    // The one in flight: resent after the restart with the same key, applied once (the tool
    // honours keys).
    assert_eq!(tools.attempts(in_flight), 2, "{:?}", tools.all_attempts());
    assert_eq!(tools.executions(in_flight), 1);
    // The one finished before the kill: never sent again.
    if let Some(k) = before {
        assert_eq!(tools.attempts(k), 1, "{:?}", tools.all_attempts());
        assert_eq!(tools.executions(k), 1);
    }
    // Every compensation applied exactly once, newest first; the restarts never repeated.
    let undo = requests_of(&tools, "undo_restart");
    assert_eq!(undo.len(), 3, "{undo:?}");
    let mut order: Vec<&str> = undo.iter().map(service).collect();
    order.dedup();
    assert_eq!(order, ["db", "api"]);
    assert_eq!(tools.executions(&k_db) + tools.executions(&k_api), 2);
    let (r_api, r_db) = restarts(&tools);
    assert_eq!((tools.executions(&r_api), tools.executions(&r_db)), (1, 1));
    let (s, v) = d.get(&format!("/v1/runs/{id}/events"), ALPHA).await;
    assert_eq!(s, StatusCode::OK);
    let ev = v["events"].as_array().unwrap().clone();
    check_log(&ev, "run_cancelled");
    assert!(
        kinds(&ev).contains(&"run_resumed".to_owned()),
        "{:?}",
        kinds(&ev)
    );
    d.kill9();
}

#[tokio::test]
async fn kill9_while_the_first_compensation_is_in_flight_resends_it_with_its_key() {
    kill9_during_compensation(0).await;
}

#[tokio::test]
async fn kill9_during_the_second_compensation_never_repeats_the_first() {
    kill9_during_compensation(1).await;
}

#[tokio::test]
async fn kill9_during_an_unsafe_compensation_records_it_outcome_unknown_and_never_resends_it() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    two_restarts_then_ask(&model);
    // The undo of `db` is applied, then never answered; the tool is naive and `unsafe`.
    tools
        .push(ToolBehavior::Apply)
        .push(ToolBehavior::Apply)
        .push(ToolBehavior::ApplyThenHang);
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("data")).unwrap();
    let store = format!("file:{}", dir.path().join("data").display());
    let cfg = dir.path().join("agentd.toml");
    let log = dir.path().join("agentd.log");
    let text = config_with_undo(&model, &tools, &store, 1, "unsafe", &tools.tool_url());
    std::fs::write(&cfg, text).unwrap();
    let d = ChildDaemon::start(&cfg, &log).await;
    let (s, v) = d
        .post(
            "/v1/runs",
            ALPHA,
            &json!({"agent": "ops", "input": "restart"}),
        )
        .await
        .unwrap();
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["id"].as_str().unwrap().to_owned();
    wait_run_child(&d, &id, &log, |v| v["status"] == "waiting_input").await;
    let (s, v) = d
        .post(&format!("/v1/runs/{id}/cancel"), ALPHA, &json!({}))
        .await
        .unwrap();
    assert_eq!(s, StatusCode::OK, "{v}");
    wait_requests(&tools, "undo_restart", 1, &log).await;
    d.kill9();

    let d = ChildDaemon::start(&cfg, &log).await;
    let run = wait_run_child(&d, &id, &log, |v| v["status"] == "cancelled").await;
    let (k_api, k_db) = check_record(&run, ["done", "outcome_unknown"]);
    // Never sent blindly a second time; the older call is still undone.
    assert_eq!(tools.attempts(&k_db), 1, "{:?}", tools.all_attempts());
    assert_eq!(tools.executions(&k_db), 1);
    assert_eq!(tools.attempts(&k_api), 1);
    assert_eq!(tools.executions(&k_api), 1);
    let (s, v) = d.get(&format!("/v1/runs/{id}/events"), ALPHA).await;
    assert_eq!(s, StatusCode::OK);
    let ev = v["events"].as_array().unwrap().clone();
    check_log(&ev, "run_cancelled");
    let resumed = ev.iter().find(|e| e["type"] == "run_resumed").unwrap();
    assert_eq!(
        resumed["data"]["compensations_outcome_unknown"],
        json!(["call_2_0_undo"])
    );
    d.kill9();
}
