//! The core runtime driven through `RuntimeHandle`: tool calls, corrections, budgets, no
//! progress, verifiers, approvals, cancellation, crashes and scale.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use agentd::agent::AgentSpec;
use agentd::model::scripted::{ScriptedModel, turn_of};
use agentd::model::{Message, ModelRequest};
use agentd::run::verify::Verifier;
use agentd::run::{Budget, RunEvent, RunState, Status};
use agentd::runtime::actor::FaultInjector;
use agentd::runtime::{BudgetRequest, NewRun};
use agentd::tool::builtin::{CountingTool, Echo};
use agentd::tool::{ApprovalRule, ToolEffect};
use serde_json::{Value, json};

use crate::support::{Builder, Harness, TENANT, WAIT, calls, text};

fn last_tool_result(req: &ModelRequest) -> Option<Value> {
    req.messages.iter().rev().find_map(|m| match m {
        Message::Tool { content, .. } => serde_json::from_str(content).ok(),
        _ => None,
    })
}

/// Checks the event-log invariants: seq 1..n without gaps, exactly one terminal event, and
/// nothing but ignored late results after it.
async fn check_log(h: &Harness, id: &agentd::ids::RunId) -> Vec<String> {
    let events = h.handle.events(TENANT, id, 0, 100_000).await.unwrap();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.seq, i as u64 + 1, "gap in the log of {id}");
    }
    let terminal: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| {
            matches!(
                e.kind.as_str(),
                "run_succeeded" | "run_failed" | "run_cancelled"
            )
        })
        .map(|(i, _)| i)
        .collect();
    assert_eq!(
        terminal.len(),
        1,
        "exactly one terminal event in {id}: {events:?}"
    );
    for e in &events[terminal[0] + 1..] {
        assert_eq!(e.kind, "late_result_ignored");
    }
    events.into_iter().map(|e| e.kind).collect()
}

fn two_steps_model() -> ScriptedModel {
    ScriptedModel::from_fn("m", |req| {
        Ok(match turn_of(req) {
            1 => calls(&[("echo", json!({"text": "one"}))]),
            2 => calls(&[("record", json!({"item": "two"}))]),
            _ => text("done"),
        })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_with_two_tool_calls_succeeds() {
    let record = CountingTool::new("record", ToolEffect::Unsafe);
    let ledger = record.ledger();
    let h = Builder::new()
        .tool(Arc::new(Echo::new()))
        .tool(Arc::new(record))
        .model(two_steps_model())
        .agent(AgentSpec::new("a", "m").tools(["echo", "record"]))
        .start()
        .await;
    let id = h.start_run("a", "do two things").await;
    let run = h.finish(&id).await;
    assert_eq!(run.status, Status::Succeeded, "{:?}", run.error);
    assert_eq!(run.output, Some(json!("done")));
    assert_eq!(run.usage.tool_calls, 2);
    assert_eq!(run.usage.turns, 3);
    assert_eq!(ledger.total(), 1);
    // Following a finished run from its last event ends at once, with nothing.
    use futures::StreamExt;
    let rest = h.handle.follow(TENANT, &id, run.version).await.unwrap();
    let rest: Vec<_> = tokio::time::timeout(Duration::from_secs(5), rest.collect())
        .await
        .expect("the follow stream of a finished run did not end");
    assert!(rest.is_empty());
    let kinds = check_log(&h, &id).await;
    assert_eq!(
        kinds,
        [
            "run_created",
            "run_started",
            "model_replied",
            "tool_call_finished",
            "model_replied",
            "tool_call_finished",
            "model_replied",
            "run_succeeded"
        ]
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_invalid_argument_is_corrected_on_the_next_turn() {
    let model = ScriptedModel::from_fn("m", |req| {
        Ok(match turn_of(req) {
            1 => calls(&[("echo", json!({"text": 5}))]),
            2 => {
                // The model sees a structured invalid_argument error with the failing path.
                let r = last_tool_result(req).unwrap();
                assert_eq!(r["ok"], json!(false));
                assert_eq!(r["error"]["code"], json!("invalid_argument"));
                assert!(
                    r["error"]["message"].as_str().unwrap().contains("/text"),
                    "{r}"
                );
                calls(&[("echo", json!({"text": "five"}))])
            }
            _ => text("fixed"),
        })
    });
    let h = Builder::new()
        .tool(Arc::new(Echo::new()))
        .model(model)
        .agent(AgentSpec::new("a", "m").tools(["echo"]))
        .start()
        .await;
    let id = h.start_run("a", "echo five").await;
    let run = h.finish(&id).await;
    assert_eq!(run.status, Status::Succeeded, "{:?}", run.error);
    assert_eq!(run.usage.tool_calls, 1, "the invalid call never ran");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_replies_end_with_invalid_model_output() {
    let model = ScriptedModel::from_fn("m", |_| Ok(calls(&[("nope", json!({}))])));
    let h = Builder::new()
        .tool(Arc::new(Echo::new()))
        .model(model)
        .agent(AgentSpec::new("a", "m").tools(["echo"]))
        .start()
        .await;
    let id = h.start_run("a", "x").await;
    let run = h.finish(&id).await;
    assert_eq!(run.status, Status::Failed);
    assert_eq!(run.error.unwrap().code, "invalid_model_output");
    h.shutdown().await;
}

async fn budget_case(budget: BudgetRequest, model: ScriptedModel, which: &str) {
    let h = Builder::new()
        .tool(Arc::new(Echo::new()))
        .tool(Arc::new(
            CountingTool::new("slow", ToolEffect::Read).delay(Duration::from_secs(30)),
        ))
        .model(model)
        .agent(AgentSpec::new("a", "m").tools(["echo", "slow"]))
        .start()
        .await;
    let id = h
        .start_with(NewRun {
            tenant: TENANT.into(),
            agent: "a".into(),
            input: json!("go"),
            client_key: None,
            budget,
            metadata: Value::Null,
            scopes: None,
        })
        .await;
    let run = h.finish(&id).await;
    assert_eq!(run.status, Status::Failed);
    let err = run.error.unwrap();
    assert_eq!(err.code, "budget_exceeded");
    assert!(err.message.contains(which), "{which}: {}", err.message);
    check_log(&h, &id).await;
    h.shutdown().await;
}

fn counting_echo() -> ScriptedModel {
    ScriptedModel::from_fn("m", |req| {
        Ok(calls(&[(
            "echo",
            json!({"text": format!("step {}", turn_of(req))}),
        )]))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_budget_ends_the_run_with_budget_exceeded() {
    budget_case(
        BudgetRequest {
            max_turns: Some(3),
            ..Default::default()
        },
        counting_echo(),
        "turns",
    )
    .await;
    budget_case(
        BudgetRequest {
            max_tool_calls: Some(2),
            max_turns: Some(50),
            ..Default::default()
        },
        counting_echo(),
        "tool_calls",
    )
    .await;
    let big = ScriptedModel::from_fn("m", |req| {
        let mut r = calls(&[("echo", json!({"text": format!("step {}", turn_of(req))}))]);
        r.usage.input_tokens = 400;
        Ok(r)
    });
    budget_case(
        BudgetRequest {
            max_tokens: Some(1000),
            ..Default::default()
        },
        big,
        "tokens",
    )
    .await;
    let slow = ScriptedModel::from_fn("m", |_| Ok(calls(&[("slow", json!({"item": "wait"}))])));
    budget_case(
        BudgetRequest {
            deadline: Some(Duration::from_millis(300)),
            ..Default::default()
        },
        slow,
        "deadline",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_progress_is_nudged_then_forced_then_failed() {
    // Always the same call: nudge at the 3rd repeat, forced final at the 4th; the model keeps
    // calling tools even without tools offered, so the run fails with no_progress.
    let model = ScriptedModel::from_fn("m", |_| Ok(calls(&[("echo", json!({"text": "again"}))])));
    let h = Builder::new()
        .tool(Arc::new(Echo::new()))
        .model(model)
        .agent(AgentSpec::new("a", "m").tools(["echo"]))
        .start()
        .await;
    let id = h.start_run("a", "loop").await;
    let run = h.finish(&id).await;
    assert_eq!(run.status, Status::Failed);
    assert_eq!(run.error.as_ref().unwrap().code, "no_progress");
    let notes: Vec<&str> = run
        .messages
        .iter()
        .filter_map(|m| match m {
            Message::User { content } if content.starts_with("[agentd] no progress") => {
                Some(content.as_str())
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        notes.len(),
        2,
        "a nudge, then the forced final turn: {notes:?}"
    );
    assert!(notes[1].contains("Tools are now disabled"));
    h.shutdown().await;

    // A model that answers once tools are disabled succeeds.
    let model = ScriptedModel::from_fn("m", |req| {
        if req.tools.is_empty() {
            Ok(text("giving up: best answer"))
        } else {
            Ok(calls(&[("echo", json!({"text": "again"}))]))
        }
    });
    let h = Builder::new()
        .tool(Arc::new(Echo::new()))
        .model(model)
        .agent(AgentSpec::new("a", "m").tools(["echo"]))
        .start()
        .await;
    let id = h.start_run("a", "loop").await;
    let run = h.finish(&id).await;
    assert_eq!(run.status, Status::Succeeded);
    assert!(run.force_final);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verifier_rejects_then_accepts() {
    let model = ScriptedModel::from_fn("m", |req| {
        Ok(match turn_of(req) {
            1 => text("not json"),
            2 => text(r#"{"answer": 42}"#),
            _ => text("unreachable"),
        })
    });
    let schema = Verifier::json_schema(&json!({"type": "object", "required": ["answer"]})).unwrap();
    let h = Builder::new()
        .model(model)
        .agent(AgentSpec::new("a", "m").verifier(schema))
        .start()
        .await;
    let id = h.start_run("a", "answer in JSON").await;
    let run = h.finish(&id).await;
    assert_eq!(run.status, Status::Succeeded, "{:?}", run.error);
    assert_eq!(run.output, Some(json!({"answer": 42})));
    assert_eq!(run.verify_rejections, 1);
    assert!(
        h.kinds(&id)
            .await
            .contains(&"verification_rejected".to_owned())
    );
    h.shutdown().await;
}

fn approval_harness_model() -> ScriptedModel {
    ScriptedModel::from_fn("m", |req| {
        Ok(match turn_of(req) {
            1 => calls(&[("deploy", json!({"item": "v2"}))]),
            _ => {
                let r = last_tool_result(req).unwrap();
                text(if r["ok"] == json!(true) {
                    "deployed"
                } else {
                    "not deployed"
                })
            }
        })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approve_runs_the_call_and_reject_tells_the_model() {
    let deploy = CountingTool::new("deploy", ToolEffect::Unsafe)
        .with_spec(|s| s.approval(ApprovalRule::Always));
    let ledger = deploy.ledger();
    let h = Builder::new()
        .tool(Arc::new(deploy))
        .model(approval_harness_model())
        .agent(AgentSpec::new("a", "m").tools(["deploy"]))
        .start()
        .await;

    let id = h.start_run("a", "deploy v2").await;
    let run = h
        .handle
        .wait_until(TENANT, &id, WAIT, |r| r.status == Status::WaitingApproval)
        .await
        .unwrap();
    let call = run.pending_approvals().next().unwrap().call_id.clone();
    assert_eq!(ledger.total(), 0, "nothing runs before approval");
    h.handle
        .decide(TENANT, &id, &call, true, None, None, None)
        .await
        .unwrap();
    // A replayed approval answers the same and runs nothing more.
    h.handle
        .decide(TENANT, &id, &call, true, None, None, None)
        .await
        .unwrap();
    let run = h.finish(&id).await;
    assert_eq!(run.output, Some(json!("deployed")));
    assert_eq!(ledger.total(), 1);
    // Rejecting an approved call is a conflict.
    let err = h
        .handle
        .decide(TENANT, &id, &call, false, None, None, None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), "invalid_state");

    let id = h.start_run("a", "deploy v2 again").await;
    let run = h
        .handle
        .wait_until(TENANT, &id, WAIT, |r| r.status == Status::WaitingApproval)
        .await
        .unwrap();
    let call = run.pending_approvals().next().unwrap().call_id.clone();
    let unknown: agentd::ids::CallId = "call_99_0".parse().unwrap();
    assert_eq!(
        h.handle
            .decide(TENANT, &id, &unknown, true, None, None, None)
            .await
            .unwrap_err()
            .code(),
        "not_found"
    );
    // Edited arguments are validated again.
    let bad = h
        .handle
        .decide(
            TENANT,
            &id,
            &call,
            true,
            Some(json!({"item": 7})),
            None,
            None,
        )
        .await;
    assert_eq!(bad.unwrap_err().code(), "invalid_argument");
    h.handle
        .decide(
            TENANT,
            &id,
            &call,
            false,
            None,
            Some("not today".into()),
            None,
        )
        .await
        .unwrap();
    let run = h.finish(&id).await;
    assert_eq!(run.output, Some(json!("not deployed")));
    assert_eq!(ledger.total(), 1, "the rejected call never ran");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_during_a_slow_model_call_and_a_slow_tool_call() {
    // Slow model: cancel is handled at once, while the model call is in flight.
    let slow_model =
        ScriptedModel::from_fn("slow", |_| Ok(text("late"))).with_delay(Duration::from_secs(30));
    let slow_tool =
        CountingTool::new("slow_tool", ToolEffect::Idempotent).delay(Duration::from_millis(400));
    let h = Builder::new()
        .tool(Arc::new(slow_tool))
        .model(slow_model)
        .model(ScriptedModel::from_fn("m", |req| {
            Ok(match turn_of(req) {
                1 => calls(&[("slow_tool", json!({"item": "x"}))]),
                _ => text("done"),
            })
        }))
        .agent(AgentSpec::new("slowmodel", "slow"))
        .agent(AgentSpec::new("slowtool", "m").tools(["slow_tool"]))
        .start()
        .await;
    let id = h.start_run("slowmodel", "think").await;
    h.handle
        .wait_until(TENANT, &id, WAIT, |r| {
            r.phase == Some(agentd::run::Phase::AwaitingModel)
        })
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let run = h
        .handle
        .cancel(TENANT, &id, Some("changed my mind".into()))
        .await
        .unwrap();
    assert_eq!(run.status, Status::Cancelled);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "cancel waited for the model call"
    );
    // Cancelling twice answers the same.
    assert_eq!(
        h.handle.cancel(TENANT, &id, None).await.unwrap().status,
        Status::Cancelled
    );
    check_log(&h, &id).await;

    // Slow tool: the run is cancelled while the tool runs; its late result is recorded as
    // ignored and changes nothing.
    let id = h.start_run("slowtool", "work").await;
    h.handle
        .wait_until(TENANT, &id, WAIT, |r| {
            r.phase == Some(agentd::run::Phase::ExecutingTools)
        })
        .await
        .unwrap();
    let run = h.handle.cancel(TENANT, &id, None).await.unwrap();
    assert_eq!(run.status, Status::Cancelled);
    // A follower's stream ends with the run, so the late result (which comes after the end,
    // and later still on a loaded machine) is awaited in the log itself.
    let deadline = std::time::Instant::now() + WAIT;
    while !h
        .kinds(&id)
        .await
        .iter()
        .any(|k| k == "late_result_ignored")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no late result recorded: {:?}",
            h.kinds(&id).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let run = h.handle.get_run(TENANT, &id).await.unwrap();
    assert_eq!(run.status, Status::Cancelled);
    let kinds = check_log(&h, &id).await;
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("late_result_ignored"),
        "{kinds:?}"
    );
    h.shutdown().await;
}

/// Panics the first time a run is about to apply its second tool result.
struct PanicOnce {
    fired: AtomicU32,
    at_tool_result: u32,
}

impl FaultInjector for PanicOnce {
    fn panic_before(&self, run: &RunState, event: &RunEvent) -> bool {
        matches!(event, RunEvent::ToolFinished { .. })
            && run.turn == self.at_tool_result
            && self.fired.fetch_add(1, Ordering::SeqCst) == 0
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_restarts_the_run_from_its_checkpoint_without_repeating_tool_calls() {
    let tool = CountingTool::new("record", ToolEffect::Idempotent);
    let ledger = tool.ledger();
    let model = ScriptedModel::from_fn("m", |req| {
        Ok(match turn_of(req) {
            n @ 1..=3 => calls(&[("record", json!({"item": format!("step {n}")}))]),
            _ => text("done"),
        })
    });
    let mut b = Builder::new()
        .tool(Arc::new(tool))
        .model(model)
        .agent(AgentSpec::new("a", "m").tools(["record"]));
    b.faults = Some(Arc::new(PanicOnce {
        fired: AtomicU32::new(0),
        at_tool_result: 2,
    }));
    let h = b.start().await;
    let id = h.start_run("a", "three steps").await;
    let run = h.finish(&id).await;
    assert_eq!(run.status, Status::Succeeded, "{:?}", run.error);
    assert_eq!(run.restarts, 1);
    // Step 1 ran once. Step 2's result was lost with the crash: as an idempotent call it was
    // resent under the same key. Step 3 ran once.
    assert_eq!(
        ledger.duplicates().len(),
        1,
        "only the in-flight idempotent call is resent"
    );
    assert_eq!(ledger.total(), 4);
    let kinds = check_log(&h, &id).await;
    assert!(kinds.contains(&"run_resumed".to_owned()));
    assert_eq!(h.handle.metrics().restarts.load(Ordering::Relaxed), 1);
    // The live-run gauge counts actors, crashed ones included: it returns to zero.
    let deadline = std::time::Instant::now() + WAIT;
    while h.handle.metrics().live_runs.load(Ordering::Relaxed) != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "live_runs gauge stuck"
        );
        tokio::task::yield_now().await;
    }
    h.shutdown().await;
}

/// Panics on every model reply.
struct AlwaysPanic;

impl FaultInjector for AlwaysPanic {
    fn panic_before(&self, _run: &RunState, event: &RunEvent) -> bool {
        matches!(event, RunEvent::ModelReplied { .. })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_ends_the_run_failed() {
    let mut b = Builder::new()
        .model(ScriptedModel::from_fn("m", |_| Ok(text("hi"))))
        .agent(AgentSpec::new("a", "m"));
    b.faults = Some(Arc::new(AlwaysPanic));
    let h = b.start().await;
    let id = h.start_run("a", "crash").await;
    let run = h.finish(&id).await;
    assert_eq!(run.status, Status::Failed);
    assert_eq!(run.error.as_ref().unwrap().code, "crash_loop");
    assert_eq!(run.restarts, 3, "three restarts, then failed");
    check_log(&h, &id).await;
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ask_the_user_waits_for_input() {
    let model = ScriptedModel::from_fn("m", |req| {
        Ok(match turn_of(req) {
            1 => calls(&[("ask_user", json!({"question": "which environment?"}))]),
            _ => {
                let r = last_tool_result(req).unwrap();
                text(&format!(
                    "deploying to {}",
                    r["data"]["answer"].as_str().unwrap()
                ))
            }
        })
    });
    let h = Builder::new()
        .model(model)
        .agent(AgentSpec::new("a", "m"))
        .start()
        .await;
    let id = h.start_run("a", "deploy").await;
    let run = h
        .handle
        .wait_until(TENANT, &id, WAIT, |r| r.status == Status::WaitingInput)
        .await
        .unwrap();
    assert_eq!(run.question.as_ref().unwrap().0, "which environment?");
    h.handle.input(TENANT, &id, "staging".into()).await.unwrap();
    let run = h.finish(&id).await;
    assert_eq!(run.output, Some(json!("deploying to staging")));
    // Another tenant sees nothing.
    assert_eq!(
        h.handle.get_run("other", &id).await.unwrap_err().code(),
        "not_found"
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_concurrent_runs_all_succeed() {
    let steps = 3;
    let model = ScriptedModel::from_fn("m", move |req| {
        let t = turn_of(req);
        Ok(if t <= steps {
            calls(&[("echo", json!({"text": format!("step {t}")}))])
        } else {
            text("ok")
        })
    });
    let h = Builder::new()
        .tool(Arc::new(Echo::new()))
        .model(model)
        .agent(
            AgentSpec::new("a", "m")
                .tools(["echo"])
                .budget(Budget::default()),
        )
        .start()
        .await;
    let n = 10_000;
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        ids.push(h.start_run("a", &format!("run {i}")).await);
    }
    let waits = ids
        .iter()
        .map(|id| h.handle.wait_terminal(TENANT, id, Duration::from_secs(120)));
    let runs = futures::future::join_all(waits).await;
    let succeeded = runs
        .iter()
        .filter(|r| r.as_ref().is_ok_and(|r| r.status == Status::Succeeded))
        .count();
    assert_eq!(succeeded, n);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_run_gives_up_its_actor_and_is_rehydrated_by_its_next_message() {
    let model = ScriptedModel::from_fn("m", |req| {
        Ok(match turn_of(req) {
            1 => calls(&[("ask_user", json!({"question": "which color?"}))]),
            _ => text(&format!(
                "you said {}",
                last_tool_result(req).unwrap()["data"]["answer"]
                    .as_str()
                    .unwrap()
            )),
        })
    });
    let mut b = Builder::new().model(model).agent(AgentSpec::new("a", "m"));
    b.config.passivate_after = Some(Duration::from_millis(50));
    let h = b.start().await;
    let id = h.start_run("a", "pick a color").await;
    h.handle
        .wait_until(TENANT, &id, WAIT, |r| r.status == Status::WaitingInput)
        .await
        .unwrap();
    // Poll (bounded) until the supervisor no longer holds an actor for it.
    let deadline = std::time::Instant::now() + WAIT;
    while h.handle.live_runs().await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the waiting run was never passivated"
        );
        tokio::task::yield_now().await;
    }
    assert_eq!(h.handle.metrics().live_runs.load(Ordering::Relaxed), 0);
    // Its next message brings it back, exactly where it was.
    let run = h.handle.input(TENANT, &id, "blue".into()).await.unwrap();
    assert_eq!(run.status, Status::Running);
    let run = h.finish(&id).await;
    assert_eq!(run.output, Some(json!("you said blue")));
    assert_eq!(run.restarts, 0, "rehydration is not a restart");
    let kinds = check_log(&h, &id).await;
    assert!(!kinds.contains(&"run_resumed".to_owned()), "{kinds:?}");
    // A cancel also reaches a passivated run.
    let id = h.start_run("a", "again").await;
    h.handle
        .wait_until(TENANT, &id, WAIT, |r| r.status == Status::WaitingInput)
        .await
        .unwrap();
    while h.handle.live_runs().await > 0 {
        assert!(
            std::time::Instant::now() < deadline + WAIT,
            "never passivated"
        );
        tokio::task::yield_now().await;
    }
    assert_eq!(
        h.handle.cancel(TENANT, &id, None).await.unwrap().status,
        Status::Cancelled
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passivated_run_is_woken_by_its_deadline() {
    let model = ScriptedModel::from_fn("m", |_| {
        Ok(calls(&[("ask_user", json!({"question": "anyone there?"}))]))
    });
    let mut b = Builder::new().model(model).agent(AgentSpec::new("a", "m"));
    b.config.passivate_after = Some(Duration::from_millis(20));
    let h = b.start().await;
    let id = h
        .start_with(NewRun {
            tenant: TENANT.into(),
            agent: "a".into(),
            input: json!("wait for me"),
            client_key: None,
            budget: BudgetRequest {
                deadline: Some(Duration::from_millis(700)),
                ..Default::default()
            },
            metadata: Value::Null,
            scopes: None,
        })
        .await;
    h.handle
        .wait_until(TENANT, &id, WAIT, |r| r.status == Status::WaitingInput)
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    while h.handle.live_runs().await > 0 {
        assert!(std::time::Instant::now() < deadline, "never passivated");
        tokio::task::yield_now().await;
    }
    // Nobody sends it anything: its deadline alone brings it back, to fail it.
    let run = h.finish(&id).await;
    assert_eq!(run.status, Status::Failed);
    assert!(run.error.unwrap().message.contains("deadline"));
    check_log(&h, &id).await;
    h.shutdown().await;
}

/// A node whose definition of a run's agent differs leaves the run alone (the run keeps
/// waiting, counted as a mismatch), and the run's inbox is bounded: controls sent meanwhile
/// are stored up to `MAX_PENDING_CONTROLS`, then refused with `inbox_full`. Once a node with
/// the run's own definition starts, it takes the run and applies them in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_another_agent_definition_leaves_the_run_and_its_inbox_is_bounded() {
    let asker = || {
        ScriptedModel::from_fn("m", |req| {
            Ok(match turn_of(req) {
                1 => calls(&[("ask_user", json!({"question": "which environment?"}))]),
                _ => text("deploying"),
            })
        })
    };
    let store: agentd::store::SharedStore = Arc::new(agentd::store::memory::MemoryStore::new());
    let mut b = Builder::new()
        .model(asker())
        .agent(AgentSpec::new("a", "m").instructions("version 1"));
    b.store = store.clone();
    let a = b.start().await;
    let id = a.start_run("a", "deploy").await;
    a.handle
        .wait_until(TENANT, &id, WAIT, |r| r.status == Status::WaitingInput)
        .await
        .unwrap();
    a.shutdown().await;

    // Node B's agent `a` has other instructions: it must not continue this run.
    let mut b = Builder::new()
        .model(asker())
        .agent(AgentSpec::new("a", "m").instructions("version 2"));
    b.store = store.clone();
    b.config.control_timeout = Duration::from_millis(20);
    let other = b.start().await;
    let limit = agentd::runtime::MAX_PENDING_CONTROLS;
    for i in 0..limit {
        let run = other
            .handle
            .input(TENANT, &id, format!("answer {i}"))
            .await
            .unwrap();
        assert_eq!(run.status, Status::WaitingInput, "B must not apply it");
    }
    let err = other
        .handle
        .input(TENANT, &id, "one too many".into())
        .await
        .unwrap_err();
    assert_eq!(err.code(), "inbox_full", "{err}");
    let run = other.handle.get_run(TENANT, &id).await.unwrap();
    assert_eq!(
        (run.status, run.controls_applied),
        (Status::WaitingInput, 0)
    );
    other.shutdown().await;

    // A node with the run's own definition takes it and applies the inbox in order: the first
    // input answers the question, the rest are queued for the next turn, and the run ends.
    let mut b = Builder::new()
        .model(asker())
        .agent(AgentSpec::new("a", "m").instructions("version 1"));
    b.store = store.clone();
    let c = b.start().await;
    let run = c.finish(&id).await;
    assert_eq!(run.status, Status::Succeeded, "{:?}", run.error);
    assert_eq!(run.controls_applied, limit as u64);
    c.shutdown().await;
}

/// A tool that runs until its call is cancelled, and says when it was.
struct UntilCancelled {
    spec: agentd::tool::ToolSpec,
    started: Arc<tokio::sync::Notify>,
    cancelled: Arc<tokio::sync::Notify>,
}

#[async_trait::async_trait]
impl agentd::tool::Tool for UntilCancelled {
    fn spec(&self) -> &agentd::tool::ToolSpec {
        &self.spec
    }

    async fn call(
        &self,
        ctx: &agentd::tool::ToolContext,
        _arguments: Value,
    ) -> Result<Value, agentd::tool::ToolError> {
        self.started.notify_one();
        ctx.cancel.cancelled().await;
        self.cancelled.notify_one();
        Err(agentd::tool::ToolError::new(
            agentd::tool::ToolErrorCode::Retryable,
            "cancelled",
        ))
    }
}

/// Panics on the first input the run gets.
struct PanicOnInput(AtomicU32);

impl FaultInjector for PanicOnInput {
    fn panic_before(&self, _run: &RunState, event: &RunEvent) -> bool {
        matches!(event, RunEvent::Input { .. }) && self.0.fetch_add(1, Ordering::SeqCst) == 0
    }
}

/// After an actor panic, the requests it had in flight are cancelled (they would otherwise
/// race the restarted run's resend of the same call).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_actor_cancels_its_calls_in_flight() {
    let cancelled = Arc::new(tokio::sync::Notify::new());
    let started = Arc::new(tokio::sync::Notify::new());
    let tool = UntilCancelled {
        started: started.clone(),
        spec: agentd::tool::ToolSpec::new("wait", "Waits.", json!({"type": "object"}))
            .effect(ToolEffect::Read)
            .timeout(Duration::from_secs(60)),
        cancelled: cancelled.clone(),
    };
    let mut b = Builder::new()
        .tool(Arc::new(tool))
        .model(ScriptedModel::from_fn("m", |req| {
            Ok(match turn_of(req) {
                1 => calls(&[("wait", json!({}))]),
                _ => text("done"),
            })
        }))
        .agent(AgentSpec::new("a", "m").tools(["wait"]));
    b.faults = Some(Arc::new(PanicOnInput(AtomicU32::new(0))));
    let h = b.start().await;
    let id = h.start_run("a", "wait").await;
    // The call has reached the tool (a call cancelled while still queued is never sent).
    tokio::time::timeout(WAIT, started.notified())
        .await
        .expect("the call did not reach the tool");
    // The input makes the actor panic while the call is in flight.
    let _ = h.handle.input(TENANT, &id, "note".into()).await;
    tokio::time::timeout(WAIT, cancelled.notified())
        .await
        .expect("the panicked actor's call was not cancelled");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_a_state_a_run_ends_without_answers_at_once_with_its_status() {
    let h = Builder::new()
        .model(ScriptedModel::from_fn("m", |_| Ok(text("done"))))
        .agent(AgentSpec::new("quick", "m"))
        .start()
        .await;
    let id = h.start_run("quick", "go").await;
    let started = std::time::Instant::now();
    let waited = h
        .handle
        .wait_until(TENANT, &id, WAIT, |r| r.status == Status::WaitingInput)
        .await;
    match waited {
        Err(agentd::runtime::Error::InvalidState { status, .. }) => {
            assert_eq!(status, Status::Succeeded)
        }
        other => panic!("expected the run's end, got {other:?}"),
    }
    assert!(
        started.elapsed() < WAIT / 2,
        "answered without waiting out the timeout"
    );
    h.shutdown().await;
}

/// A node owns the run it creates from the create itself (the create takes the lease: no
/// second write, no moment without an owner); a node with no room for another live run
/// creates it unowned and due, for any node with room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_created_run_is_owned_by_its_node_from_the_create_on() {
    for room in [true, false] {
        let mut b = Builder::new()
            .model(ScriptedModel::from_fn("m", |_| {
                Ok(calls(&[("ask_user", json!({"question": "which?"}))]))
            }))
            .agent(AgentSpec::new("a", "m"));
        if !room {
            b.config.max_live_runs = 0;
        }
        let node = b.config.node_id.clone();
        let h = b.start().await;
        let id = h.start_run("a", "go").await;
        let holder = h.store.lease_holder(&id).await.unwrap();
        if room {
            assert_eq!(holder.as_deref(), Some(node.as_str()));
            let run = h
                .handle
                .wait_until(TENANT, &id, WAIT, |r| r.status == Status::WaitingInput)
                .await
                .unwrap();
            assert_eq!(run.restarts, 0);
        } else {
            assert_eq!(holder, None);
            let due = h.store.due_runs(u64::MAX, 10).await.unwrap();
            assert!(due.contains(&id), "{due:?}");
            assert_eq!(
                h.handle.get_run(TENANT, &id).await.unwrap().status,
                Status::Created
            );
        }
        h.shutdown().await;
    }
}
