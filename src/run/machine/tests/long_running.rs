//! The rows of long-running calls: a tool that accepts a call (`202`) and finishes it later,
//! by poll, by callback or not at all (its deadline).

use super::*;

const URL: &str = "http://tool/status/1";

fn call(id: &str) -> CallId {
    id.parse().unwrap()
}

/// A run whose model called `tools` (one batch, every call dispatched).
fn dispatched(tools: &[&str]) -> RunState {
    let mut s = running();
    let calls: Vec<(&str, &str)> = tools.iter().map(|t| (*t, r#"{"text":"a"}"#)).collect();
    let t = replied(&mut s, reply_calls(&calls));
    assert_eq!(
        t.effects
            .iter()
            .filter(|e| matches!(e, Effect::ExecuteTool { .. }))
            .count(),
        tools.len()
    );
    s
}

fn accept(s: &mut RunState, id: &str, status_url: Option<&str>) -> Transition {
    let epoch = s.epoch;
    step(
        s,
        RunEvent::ToolAccepted {
            epoch,
            call_id: call(id),
            status_url: status_url.map(str::to_owned),
            timeout_ms: 5_000,
        },
        &cx(100),
    )
    .unwrap()
}

fn polled(s: &mut RunState, id: &str, result: ToolResult) -> Transition {
    let epoch = s.epoch;
    go(
        s,
        RunEvent::ToolPolled {
            epoch,
            call_id: call(id),
            result,
        },
    )
}

fn last_tool_message(s: &RunState) -> String {
    s.messages
        .iter()
        .rev()
        .find_map(|m| match m {
            Message::Tool { content, .. } => Some(content.clone()),
            _ => None,
        })
        .unwrap()
}

#[test]
fn an_accepted_call_waits_in_awaiting_tool_until_a_poll_gives_its_result() {
    let mut s = dispatched(&["echo"]);
    let t = accept(&mut s, "call_1_0", Some(URL));
    assert_eq!(t.kind, "tool_call_accepted");
    assert_eq!(where_(&s), (Status::Running, Some(Phase::AwaitingTool)));
    assert_eq!(t.data["phase"], "awaiting_tool");
    assert_eq!(t.data["polling"], true);
    assert_eq!(
        t.effects,
        vec![Effect::PollTool {
            epoch: s.epoch,
            call_id: call("call_1_0")
        }]
    );
    let c = s.call(&call("call_1_0")).unwrap();
    assert_eq!(c.status, CallStatus::AwaitingResult);
    let task = c.task.clone().unwrap();
    assert_eq!(task.status_url.as_deref(), Some(URL));
    assert_eq!((task.accepted_at_ms, task.deadline_ms), (100, 5_100));
    // The state survives the checkpoint round trip.
    let back: RunState = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
    assert_eq!(back, s);

    let t = polled(&mut s, "call_1_0", ToolResult::success(json!({"done": 42})));
    assert_eq!(t.kind, "tool_call_finished");
    assert_eq!(t.data["via"], "poll");
    assert!(has_call_model(&t, ToolChoice::Auto));
    assert_eq!(where_(&s), (Status::Running, Some(Phase::AwaitingModel)));
    assert!(last_tool_message(&s).contains("42"));
    assert_eq!(s.usage.tool_calls, 1, "polls are not tool calls");
}

#[test]
fn a_polled_failure_is_the_calls_result() {
    let mut s = dispatched(&["echo"]);
    accept(&mut s, "call_1_0", Some(URL));
    let t = polled(&mut s, "call_1_0", err(ToolErrorCode::Failed));
    assert_eq!(t.data["ok"], false);
    assert!(last_tool_message(&s).contains("\"failed\""));
}

#[test]
fn a_callback_completes_the_call_and_the_second_one_is_late() {
    let mut s = dispatched(&["echo"]);
    accept(&mut s, "call_1_0", None);
    let applied = s.controls_applied;
    let control = Control::CallResult {
        call_id: call("call_1_0"),
        result: ToolResult::success(json!("by callback")),
    };
    let ControlStep::Applied(t) = apply_control(&mut s, applied + 1, control.clone(), &cx(20))
    else {
        panic!("the first result applies");
    };
    assert_eq!(
        (t.kind, &t.data["via"]),
        ("tool_call_finished", &json!("callback"))
    );
    assert_eq!(where_(&s), (Status::Running, Some(Phase::AwaitingModel)));
    assert!(last_tool_message(&s).contains("by callback"));
    // The same call again: consumed, recorded as late, answered `invalid_state`.
    let version = s.version;
    let ControlStep::Refused(Some(t), e) = apply_control(&mut s, applied + 2, control, &cx(30))
    else {
        panic!("a second result is refused");
    };
    assert_eq!(t.kind, "late_result_ignored");
    assert_eq!(e.code, "invalid_state");
    assert_eq!(s.version, version + 1);
    assert_eq!(s.refusal(applied + 2).unwrap().code, "invalid_state");
}

#[test]
fn a_callback_before_the_202_is_processed_wins_and_the_202_is_late() {
    let mut s = dispatched(&["echo"]);
    let t = go(
        &mut s,
        RunEvent::CallbackResult {
            call_id: call("call_1_0"),
            result: ok(),
        },
    );
    assert_eq!(t.data["via"], "callback");
    let t = accept(&mut s, "call_1_0", Some(URL));
    assert_eq!(t.kind, "late_result_ignored");
    assert!(t.effects.is_empty());
}

#[test]
fn the_calls_deadline_answers_the_model_with_a_timeout() {
    let mut s = dispatched(&["echo"]);
    accept(&mut s, "call_1_0", Some(URL));
    let epoch = s.epoch;
    let t = go(
        &mut s,
        RunEvent::CallDeadline {
            epoch,
            call_id: call("call_1_0"),
        },
    );
    assert_eq!(
        (t.kind, &t.data["via"]),
        ("tool_call_finished", &json!("deadline"))
    );
    assert_eq!(t.data["error"]["code"], "timeout");
    assert!(has_call_model(&t, ToolChoice::Auto));
    assert!(last_tool_message(&s).contains("\"timeout\""));
    // A poll answering afterwards changes nothing.
    let t = polled(&mut s, "call_1_0", ok());
    assert_eq!(t.kind, "late_result_ignored");
}

#[test]
fn awaiting_tool_waits_for_calls_still_in_flight_first() {
    let mut s = dispatched(&["echo", "idem"]);
    accept(&mut s, "call_1_0", Some(URL));
    assert_eq!(where_(&s), (Status::Running, Some(Phase::ExecutingTools)));
    let t = finish_tool(&mut s, "call_1_1", ok());
    assert!(t.effects.is_empty());
    assert_eq!(where_(&s), (Status::Running, Some(Phase::AwaitingTool)));
    let t = polled(&mut s, "call_1_0", ok());
    assert!(has_call_model(&t, ToolChoice::Auto));
}

#[test]
fn resume_polls_accepted_calls_again_and_never_resends_them() {
    let mut s = dispatched(&["unsafe_tool"]);
    accept(&mut s, "call_1_0", Some(URL));
    let old = s.epoch;
    let t = go(&mut s, RunEvent::Resume);
    assert_eq!(t.kind, "run_resumed");
    assert_eq!(
        t.effects,
        vec![Effect::PollTool {
            epoch: s.epoch,
            call_id: call("call_1_0")
        }]
    );
    assert!(s.epoch > old);
    assert_eq!(where_(&s), (Status::Running, Some(Phase::AwaitingTool)));
    assert_eq!(s.call(&call("call_1_0")).unwrap().attempts, 1);
    // A poll of the previous incarnation is stale.
    let t = go(
        &mut s,
        RunEvent::ToolPolled {
            epoch: old,
            call_id: call("call_1_0"),
            result: ok(),
        },
    );
    assert_eq!(t.kind, "late_result_ignored");
    assert_eq!(
        s.call(&call("call_1_0")).unwrap().status,
        CallStatus::AwaitingResult
    );
}

#[test]
fn an_accepted_call_goes_on_while_an_operator_decides_another() {
    let mut s = dispatched(&["echo", "unsafe_tool"]);
    accept(&mut s, "call_1_0", Some(URL));
    finish_tool(&mut s, "call_1_1", err(ToolErrorCode::OutcomeUnknown));
    assert_eq!(s.status, Status::WaitingApproval);
    let t = go(&mut s, RunEvent::Resume);
    assert!(matches!(&t.effects[..], [Effect::PollTool { .. }]), "{t:?}");
    let t = polled(&mut s, "call_1_0", ok());
    assert_eq!(t.kind, "tool_call_finished");
    assert_eq!(s.status, Status::WaitingApproval);
    let t = go(
        &mut s,
        RunEvent::Reject {
            call_id: call("call_1_1"),
            reason: None,
            by: None,
        },
    );
    assert!(has_call_model(&t, ToolChoice::Auto));
}

#[test]
fn cancel_while_awaiting_makes_every_later_result_late() {
    let mut s = dispatched(&["echo"]);
    accept(&mut s, "call_1_0", Some(URL));
    let epoch = s.epoch;
    let t = go(&mut s, RunEvent::Cancel { reason: None });
    assert!(terminal_effects(&t));
    let t = go(
        &mut s,
        RunEvent::ToolPolled {
            epoch,
            call_id: call("call_1_0"),
            result: ok(),
        },
    );
    assert_eq!(t.kind, "late_result_ignored");
    assert_eq!(s.status, Status::Cancelled);
    let e = step(
        &mut s,
        RunEvent::CallbackResult {
            call_id: call("call_1_0"),
            result: ok(),
        },
        &cx(10),
    )
    .unwrap_err();
    assert_eq!(e.code, "invalid_state");
}

#[test]
fn a_callback_for_a_call_that_is_not_waiting_is_refused() {
    let mut s = running();
    let before = s.clone();
    let e = step(
        &mut s,
        RunEvent::CallbackResult {
            call_id: call("call_1_0"),
            result: ok(),
        },
        &cx(10),
    )
    .unwrap_err();
    assert_eq!(e.code, "invalid_state");
    assert_eq!(s, before);
}

#[test]
fn long_running_results_are_judged_like_any_result_of_a_call_that_ran() {
    // A 401/403 by poll ends the run `permission_denied` (the tool's default policy).
    let mut s = dispatched(&["echo"]);
    accept(&mut s, "call_1_0", Some(URL));
    let t = polled(&mut s, "call_1_0", err(ToolErrorCode::Permission));
    assert_eq!(t.kind, "run_failed");
    assert_eq!(s.error.as_ref().unwrap().code, "permission_denied");
    // A failure by callback counts towards the tool's failures in a row.
    let mut s = dispatched(&["echo"]);
    go(
        &mut s,
        RunEvent::CallbackResult {
            call_id: call("call_1_0"),
            result: err(ToolErrorCode::Failed),
        },
    );
    assert_eq!(s.tool_failures, vec![("echo".to_owned(), 1)]);
}
