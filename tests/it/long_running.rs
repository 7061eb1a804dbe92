//! Long-running HTTP tools (API.md "Long-running HTTP tools") against the fake `LongTool`: a
//! call answered `202` waits in `awaiting_tool` and is completed by polling its status URL or
//! by the callback route with its per-call token; the call survives a daemon restart;
//! cancelling stops the polling; the call's own deadline answers the model with a timeout.

use std::time::Duration;

use agentd::config::Config;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::daemon_support::{ALPHA, BETA, CONFIG, TestDaemon, assert_error};
use crate::fakes::{AcceptedCall, LongTool, PollAnswer};

const WAIT: Duration = Duration::from_secs(10);

/// The test configuration plus the `long` agent, whose model calls `long_job` once and then
/// says what the tool's result was.
fn config(tool_url: &str, tool_extra: &str, store: &str) -> Config {
    let text = format!(
        r#"{CONFIG}
[models.long]
kind = "scripted"
rules = [
  {{ when = {{ last_tool_contains = "result-42" }}, reply = {{ text = "got 42" }} }},
  {{ when = {{ last_tool_contains = "\"timeout\"" }}, reply = {{ text = "timed out" }} }},
  {{ when = {{ last_tool_contains = "\"ok\"" }}, reply = {{ text = "other" }} }},
]
default_reply = {{ tool_calls = [ {{ name = "long_job", arguments = {{ job = "build" }} }} ] }}

[tools.long_job]
kind = "http"
url = "{tool_url}"
effect = "unsafe"
timeout = "5s"
task_timeout = "30s"
poll_interval = "50ms"
poll_max_interval = "200ms"
parameters = {{ type = "object", properties = {{ job = {{ type = "string" }} }} }}
{tool_extra}

[agents.long]
model = "long"
tools = ["long_job"]
"#
    );
    let mut c = Config::from_toml(&text).unwrap();
    c.store.url = store.to_owned();
    c
}

async fn events(d: &TestDaemon, id: &str) -> Vec<Value> {
    let (s, v) = d.get(&format!("/v1/runs/{id}/events"), ALPHA).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["events"].as_array().unwrap().clone()
}

fn of_type<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["type"] == kind).collect()
}

/// `POST <path>` with `Authorization: Bearer <token>` (if any) and `body`.
async fn callback(
    d: &TestDaemon,
    path: &str,
    token: Option<&str>,
    body: Value,
) -> (StatusCode, Value) {
    let (s, _, v) = d.send(Method::POST, path, token, Some(body)).await;
    (s, v)
}

fn path_of(url: &str) -> String {
    let u = reqwest::Url::parse(url).unwrap();
    u.path().to_owned()
}

/// Posts `body` as the result of `call`, to its own callback route with its own token.
async fn answer(d: &TestDaemon, call: &AcceptedCall, body: Value) -> (StatusCode, Value) {
    let path = path_of(call.callback_url.as_deref().unwrap());
    callback(d, &path, call.callback_token.as_deref(), body).await
}

/// Nothing of the token is in the run's events, transcript or record.
async fn assert_token_hidden(d: &TestDaemon, id: &str, token: &str) {
    let evs = serde_json::to_string(&events(d, id).await).unwrap();
    let (_, run) = d.get(&format!("/v1/runs/{id}"), ALPHA).await;
    let (_, messages) = d.get(&format!("/v1/runs/{id}/messages"), ALPHA).await;
    for (what, text) in [
        ("events", evs),
        ("run", run.to_string()),
        ("messages", messages.to_string()),
    ] {
        assert!(!text.contains(token), "the callback token is in the {what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_202_call_is_completed_by_polling_its_status_url() {
    let tool = LongTool::start().await;
    // A relative `Location` header this time (the callback test uses the body).
    let d = TestDaemon::start_config(config(&tool.url("/job-location"), "", "memory:")).await;
    let id = d.create(ALPHA, "long").await;
    let call = tool.wait_call(1, WAIT).await;
    // What the tool was sent: whom it acts for, where and with what to call back.
    assert_eq!(call.tenant.as_deref(), Some("alpha"));
    assert_eq!(
        call.callback_url.as_deref(),
        Some(
            d.url(&format!("/v1/runs/{id}/calls/call_1_0/result"))
                .as_str()
        )
    );
    let token = call.callback_token.clone().unwrap();
    assert_eq!(token.len(), 64, "{token}");
    let run = d
        .wait_run(ALPHA, &id, |v| v["phase"] == "awaiting_tool")
        .await;
    assert_eq!(run["status"], "running");
    // Polled with backoff while it runs, without a result yet.
    tool.wait_polls(3, WAIT).await;
    let (_, run) = d.get(&format!("/v1/runs/{id}"), ALPHA).await;
    assert_eq!(run["phase"], "awaiting_tool", "{run}");

    tool.answer(PollAnswer::Done(json!({"value": "result-42"})));
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "got 42", "{run}");
    let evs = events(&d, &id).await;
    let accepted = of_type(&evs, "tool_call_accepted");
    assert_eq!(accepted.len(), 1, "{evs:?}");
    assert_eq!(accepted[0]["data"]["phase"], "awaiting_tool");
    let finished = of_type(&evs, "tool_call_finished");
    assert_eq!(finished.len(), 1, "{evs:?}");
    assert_eq!(finished[0]["data"]["via"], "poll");
    assert_eq!(finished[0]["data"]["ok"], true);
    // One call, never resent; every poll went to the status URL of that call.
    assert_eq!(tool.calls().len(), 1);
    assert!(tool.polls() >= 4, "{}", tool.polls());
    let metrics = d
        .http
        .get(d.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let sent: usize = metrics
        .lines()
        .find_map(|l| l.strip_prefix("agentd_tool_polls_total "))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(sent, tool.polls(), "{metrics}");
    assert_token_hidden(&d, &id, &token).await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_poll_fails_the_call_with_the_tools_error() {
    let tool = LongTool::start().await;
    let d = TestDaemon::start_config(config(&tool.url("/job"), "", "memory:")).await;
    let id = d.create(ALPHA, "long").await;
    tool.wait_polls(1, WAIT).await;
    tool.answer(PollAnswer::Fail(422, "the build broke".into()));
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "other", "{run}");
    let evs = events(&d, &id).await;
    let finished = of_type(&evs, "tool_call_finished");
    assert_eq!(finished[0]["data"]["ok"], false, "{evs:?}");
    assert_eq!(finished[0]["data"]["error"]["code"], "failed");
    let (_, messages) = d.get(&format!("/v1/runs/{id}/messages"), ALPHA).await;
    assert!(
        messages.to_string().contains("the build broke"),
        "{messages}"
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_202_call_is_completed_by_callback_once() {
    let tool = LongTool::start().await;
    // No status URL: only the callback can complete it.
    let d = TestDaemon::start_config(config(&tool.url("/job-callback"), "", "memory:")).await;
    let id = d.create(ALPHA, "long").await;
    let call = tool.wait_call(1, WAIT).await;
    let token = call.callback_token.clone().unwrap();
    let path = path_of(call.callback_url.as_deref().unwrap());
    d.wait_run(ALPHA, &id, |v| v["phase"] == "awaiting_tool")
        .await;
    let result = json!({"ok": true, "data": {"value": "result-42"}});

    // Only the call's own token is accepted: not a wrong one, not a tenant's token, not none,
    // not this token for another call.
    let other_call = path.replace("call_1_0", "call_1_1");
    for (p, t) in [
        (path.as_str(), Some("0".repeat(64))),
        (path.as_str(), Some(ALPHA.to_owned())),
        (path.as_str(), Some(BETA.to_owned())),
        (path.as_str(), None),
        (other_call.as_str(), Some(token.clone())),
    ] {
        let (s, v) = callback(&d, p, t.as_deref(), result.clone()).await;
        assert_error(s, &v, StatusCode::UNAUTHORIZED, "unauthenticated");
    }
    let (_, run) = d.get(&format!("/v1/runs/{id}"), ALPHA).await;
    assert_eq!(
        run["phase"], "awaiting_tool",
        "refused callbacks changed nothing: {run}"
    );
    // A malformed body with the right token: 422, nothing changed.
    let (s, v) = callback(&d, &path, Some(&token), json!({"ok": false})).await;
    assert_error(s, &v, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request");

    let (s, v) = callback(&d, &path, Some(&token), result.clone()).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["accepted"], true);
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "got 42", "{run}");
    // The first result won; a later one is a conflict.
    let (s, v) = callback(
        &d,
        &path,
        Some(&token),
        json!({"ok": true, "data": "again"}),
    )
    .await;
    assert_error(s, &v, StatusCode::CONFLICT, "invalid_state");
    let evs = events(&d, &id).await;
    let finished = of_type(&evs, "tool_call_finished");
    assert_eq!(finished.len(), 1, "{evs:?}");
    assert_eq!(finished[0]["data"]["via"], "callback");
    assert_eq!(tool.polls(), 0);
    assert_token_hidden(&d, &id, &token).await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_awaiting_call_survives_a_daemon_restart_and_completes_by_callback() {
    let tool = LongTool::start().await;
    let dir = tempfile::tempdir().unwrap();
    let store = format!("file:{}", dir.path().join("data").display());
    let cfg = || config(&tool.url("/job"), "", &store);
    let d = TestDaemon::start_config(cfg()).await;
    let id = d.create(ALPHA, "long").await;
    let call = tool.wait_call(1, WAIT).await;
    let token = call.callback_token.clone().unwrap();
    let path = path_of(call.callback_url.as_deref().unwrap());
    d.wait_run(ALPHA, &id, |v| v["phase"] == "awaiting_tool")
        .await;
    tool.wait_polls(2, WAIT).await;
    d.stop().await;

    let polls_before = tool.polls();
    let d = TestDaemon::start_config(cfg()).await;
    let run = d
        .wait_run(ALPHA, &id, |v| v["phase"] == "awaiting_tool")
        .await;
    assert_eq!(run["status"], "running");
    // Polling resumed from the checkpoint (status URL and deadline were stored) ...
    tool.wait_polls(polls_before + 2, WAIT).await;
    // ... and the call's token still works after the restart.
    let (s, v) = callback(
        &d,
        &path,
        Some(&token),
        json!({"ok": true, "data": "result-42"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "got 42", "{run}");
    // Accepted calls are never resent: the tool saw one call.
    assert_eq!(tool.calls().len(), 1);
    let evs = events(&d, &id).await;
    let finished = of_type(&evs, "tool_call_finished");
    assert_eq!(finished.len(), 1, "{evs:?}");
    assert_eq!(finished[0]["data"]["via"], "callback");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_an_awaiting_run_stops_polling_and_refuses_a_later_result() {
    let tool = LongTool::start().await;
    let d = TestDaemon::start_config(config(&tool.url("/job"), "", "memory:")).await;
    let id = d.create(ALPHA, "long").await;
    let call = tool.wait_call(1, WAIT).await;
    tool.wait_polls(2, WAIT).await;
    let (s, v) = d
        .post(&format!("/v1/runs/{id}/cancel"), ALPHA, json!({}))
        .await;
    assert_eq!(
        (s, v["status"].as_str()),
        (StatusCode::OK, Some("cancelled")),
        "{v}"
    );
    let after_cancel = tool.polls();
    // Polls come every 50–200 ms while a call waits; after the cancel none may start (one
    // already on the wire when the cancel was applied is tolerated). Wait for one more than
    // that, bounded: it must not come.
    let more = tokio::time::timeout(
        Duration::from_millis(1500),
        tool.wait_polls(after_cancel + 2, Duration::from_secs(3)),
    )
    .await;
    assert!(
        more.is_err(),
        "polls went on after the cancel: {} then {}",
        after_cancel,
        tool.polls()
    );
    assert!(tool.polls() <= after_cancel + 1);
    // A result after the cancel is refused and changes nothing.
    let (s, v) = answer(&d, &call, json!({"ok": true, "data": "late"})).await;
    assert_error(s, &v, StatusCode::CONFLICT, "invalid_state");
    assert_eq!(v["error"]["status"], "cancelled");
    let evs = events(&d, &id).await;
    assert!(of_type(&evs, "tool_call_finished").is_empty(), "{evs:?}");
    assert_eq!(
        evs.iter().filter(|e| e["type"] == "run_cancelled").count(),
        1
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_calls_own_deadline_gives_the_model_a_timeout() {
    let tool = LongTool::start().await;
    // A short deadline for accepted calls; the tool never finishes.
    let mut c = config(&tool.url("/job"), "", "memory:");
    c.tools.get_mut("long_job").unwrap().task_timeout = Some(Duration::from_millis(600));
    let d = TestDaemon::start_config(c).await;
    let id = d.create(ALPHA, "long").await;
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "timed out", "{run}");
    let evs = events(&d, &id).await;
    let finished = of_type(&evs, "tool_call_finished");
    assert_eq!(finished.len(), 1, "{evs:?}");
    assert_eq!(finished[0]["data"]["via"], "deadline");
    assert_eq!(finished[0]["data"]["error"]["code"], "timeout");
    let (_, messages) = d.get(&format!("/v1/runs/{id}/messages"), ALPHA).await;
    assert!(messages.to_string().contains("timeout"), "{messages}");
    // It was polled while it waited, and not after its deadline answered it.
    assert!(tool.polls() >= 1);
    d.stop().await;
}

/// `agentd_live_runs` from `/metrics`.
async fn live_runs(d: &TestDaemon) -> u64 {
    let text = d
        .http
        .get(d.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("agentd_live_runs "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap()
}

async fn wait_passivated(d: &TestDaemon) {
    let deadline = std::time::Instant::now() + WAIT;
    while live_runs(d).await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the run did not passivate"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_awaiting_run_passivates_and_is_woken_by_its_poll_timer_and_by_a_callback() {
    let tool = LongTool::start().await;
    let mut c = config(&tool.url("/job"), "", "memory:");
    c.runtime.passivate_after = Duration::from_millis(100);
    let t = c.tools.get_mut("long_job").unwrap();
    t.poll_interval = Some(Duration::from_millis(600));
    t.poll_max_interval = Some(Duration::from_millis(600));
    let d = TestDaemon::start_config(c).await;
    let id = d.create(ALPHA, "long").await;
    let call = tool.wait_call(1, WAIT).await;
    d.wait_run(ALPHA, &id, |v| v["phase"] == "awaiting_tool")
        .await;
    // Between polls the run gives up its actor ...
    wait_passivated(&d).await;
    let polls = tool.polls();
    // ... and its next poll timer brings it back, again and again.
    tool.wait_polls(polls + 2, WAIT).await;
    wait_passivated(&d).await;
    let (_, run) = d.get(&format!("/v1/runs/{id}"), ALPHA).await;
    assert_eq!(run["phase"], "awaiting_tool", "{run}");
    // A callback to the passivated run completes the call.
    let (s, v) = answer(&d, &call, json!({"ok": true, "data": "result-42"})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "got 42", "{run}");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_tool_reads_202_answers_and_classifies_polls() {
    use agentd::ids::{CallId, RunId};
    use agentd::tool::http::HttpTool;
    use agentd::tool::{LongRunning, Tool, ToolContext, ToolErrorCode, ToolSpec};

    let server = LongTool::start().await;
    let spec =
        ToolSpec::new("long_job", "d", json!({"type": "object"})).timeout(Duration::from_secs(2));
    let ctx = || ToolContext {
        tenant: "alpha".into(),
        run_id: RunId::generate(),
        call_id: CallId::new(1, 0),
        idempotency_key: "k".into(),
        cancel: tokio_util::sync::CancellationToken::new(),
        long_running: LongRunning::default(),
    };
    // `Location` relative to the tool's URL; `status_url` in the body; neither.
    for (path, want) in [
        ("/job-location", Some(server.url("/status/1"))),
        ("/job", Some(server.url("/status/2"))),
        ("/job-callback", None),
    ] {
        let tool = HttpTool::new(spec.clone(), &server.url(path), None).unwrap();
        let c = ctx();
        assert_eq!(tool.call(&c, json!({})).await.unwrap(), Value::Null);
        let accepted = c
            .long_running
            .accepted()
            .expect("a 202 is noted as accepted");
        assert_eq!(accepted.status_url, want, "{path}");
    }
    // Without a callback route, no callback headers are sent.
    assert!(server.calls().iter().all(|c| c.callback_url.is_none()));

    let tool = HttpTool::new(spec, &server.url("/job"), None).unwrap();
    let status = server.url("/status/1");
    assert_eq!(tool.poll(&ctx(), &status).await.unwrap(), None);
    server.answer(PollAnswer::Done(json!({"value": 1})));
    assert_eq!(
        tool.poll(&ctx(), &status).await.unwrap(),
        Some(json!({"value": 1}))
    );
    for (code, want) in [
        (404, ToolErrorCode::Failed),
        (422, ToolErrorCode::Failed),
        (401, ToolErrorCode::Permission),
        (429, ToolErrorCode::Retryable),
        (503, ToolErrorCode::Retryable),
    ] {
        server.answer(PollAnswer::Fail(code, "nope".into()));
        let e = tool.poll(&ctx(), &status).await.unwrap_err();
        assert_eq!(e.code, want, "{code}");
    }
    // Unreachable: asked again later.
    let e = tool
        .poll(&ctx(), "http://127.0.0.1:1/status")
        .await
        .unwrap_err();
    assert_eq!(e.code, ToolErrorCode::Retryable);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callback_through_another_node_completes_the_call() {
    use crate::redis_support::{shared_redis_url, unique_ns};
    let probe = redis::Client::open(shared_redis_url()).unwrap();
    if probe.get_multiplexed_async_connection().await.is_err() {
        crate::redis_support::skip_or_fail("no Redis at AGENTD_TEST_REDIS_URL");
        return;
    }
    let tool = LongTool::start().await;
    let store = format!("{}?ns={}", shared_redis_url(), unique_ns());
    let node = |name: &str| {
        let mut c = config(&tool.url("/job-callback"), "", &store);
        c.runtime.node_id = Some(name.to_owned());
        c
    };
    let a = TestDaemon::start_config(node("long-a")).await;
    let b = TestDaemon::start_config(node("long-b")).await;
    let id = a.create(ALPHA, "long").await;
    let call = tool.wait_call(1, WAIT).await;
    a.wait_run(ALPHA, &id, |v| v["phase"] == "awaiting_tool")
        .await;
    // The result goes to node b, which does not own the run: it is stored in the run's inbox
    // and applied by its owner.
    let (s, v) = answer(&b, &call, json!({"ok": true, "data": "result-42"})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let run = b.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "got 42", "{run}");
    let (s, v) = answer(&a, &call, json!({"ok": true, "data": "again"})).await;
    assert_error(s, &v, StatusCode::CONFLICT, "invalid_state");
    b.stop().await;
    a.stop().await;
}

/// Panics the run's actor once, right before the first final poll answer is applied.
struct PanicOnFirstPoll(std::sync::atomic::AtomicBool);

impl agentd::runtime::actor::FaultInjector for PanicOnFirstPoll {
    fn panic_before(&self, _run: &agentd::run::RunState, event: &agentd::run::RunEvent) -> bool {
        matches!(event, agentd::run::RunEvent::ToolPolled { .. })
            && !self.0.swap(true, std::sync::atomic::Ordering::SeqCst)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_crash_while_awaiting_resumes_polling_and_never_resends_the_call() {
    use std::sync::Arc;

    use agentd::agent::AgentSpec;
    use agentd::model::scripted::{ScriptedModel, turn_of};
    use agentd::tool::ToolSpec;
    use agentd::tool::http::HttpTool;

    use crate::support::{Builder, calls, text};

    let server = LongTool::start().await;
    server.answer(PollAnswer::Done(json!({"value": "result-42"})));
    let spec =
        ToolSpec::new("long_job", "d", json!({"type": "object"})).timeout(Duration::from_secs(2));
    let spec = ToolSpec {
        poll_interval: Duration::from_millis(20),
        poll_max_interval: Duration::from_millis(50),
        ..spec
    };
    let tool = HttpTool::new(spec, &server.url("/job"), None).unwrap();
    let model = ScriptedModel::from_fn("m", |req| {
        Ok(match turn_of(req) {
            1 => calls(&[("long_job", json!({}))]),
            _ => text("done"),
        })
    });
    let mut b = Builder::new()
        .tool(Arc::new(tool))
        .model(model)
        .agent(AgentSpec::new("a", "m").tools(["long_job"]));
    b.faults = Some(Arc::new(PanicOnFirstPoll(Default::default())));
    let h = b.start().await;
    let id = h.start_run("a", "go").await;
    let run = h.finish(&id).await;
    assert_eq!(run.status, agentd::run::Status::Succeeded, "{run:?}");
    let kinds = h.kinds(&id).await;
    assert!(kinds.contains(&"run_resumed".to_owned()), "{kinds:?}");
    assert_eq!(
        kinds.iter().filter(|k| *k == "tool_call_accepted").count(),
        1
    );
    // The crashed incarnation's poll was lost; the resumed one polled again, and the call
    // itself was sent once.
    assert!(server.polls() >= 2, "{}", server.polls());
    assert_eq!(server.calls().len(), 1);
    h.shutdown().await;
}
