//! One test per row of the transition table, the invalid pairs, and property tests over random
//! event sequences.

#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;
use crate::ids::RunId;
use crate::model::{ModelErrorKind, ModelToolCall, TokenUsage};
use crate::run::budget::Budget;

/// Tools: `echo` (read), `idem` (idempotent), `unsafe_tool`, `recon` (unsafe, reconcilable),
/// `gate` (needs approval), `gate_auto` (needs approval, approved when it expires), `poll`
/// (polling), `hidden` (registered, not allowed), `perm_ask` (read; a 401/403 waits for an
/// operator), `sturdy` (read; never held however often it fails). Every other tool is held for
/// an operator after 3 failures in a row.
struct Catalog;

impl ToolCatalog for Catalog {
    fn lookup(&self, name: &str) -> ToolLookup {
        let info = |effect, polling, reconcilable| {
            ToolLookup::Allowed(ToolInfo {
                effect,
                polling,
                reconcilable,
            })
        };
        match name {
            "echo" | "gate" | "gate_auto" | "perm_ask" | "sturdy" => {
                info(ToolEffect::Read, false, false)
            }
            "poll" => info(ToolEffect::Read, true, false),
            "idem" => info(ToolEffect::Idempotent, false, false),
            "unsafe_tool" => info(ToolEffect::Unsafe, false, false),
            "recon" => info(ToolEffect::Unsafe, false, true),
            "hidden" => ToolLookup::NotAllowed,
            _ => ToolLookup::Unknown,
        }
    }

    fn validate(&self, _name: &str, arguments: &Value) -> Result<(), ArgumentError> {
        match arguments.get("text") {
            Some(v) if !v.is_string() => Err(ArgumentError {
                path: "/text".into(),
                message: "not a string".into(),
            }),
            _ => Ok(()),
        }
    }

    fn needs_approval(&self, name: &str, _arguments: &Value) -> bool {
        name == "gate" || name == "gate_auto"
    }

    fn on_approval_timeout(&self, name: &str) -> ApprovalTimeoutAction {
        if name == "gate_auto" || name == "idem" {
            ApprovalTimeoutAction::Approve
        } else {
            ApprovalTimeoutAction::Reject
        }
    }

    fn max_failures(&self, name: &str) -> u32 {
        if name == "sturdy" { 0 } else { 3 }
    }

    fn on_permission_error(&self, name: &str) -> OnPermissionError {
        if name == "perm_ask" {
            OnPermissionError::Operator
        } else {
            OnPermissionError::Fail
        }
    }
}

const POLICY: Policy = Policy {
    max_corrections: 2,
    max_model_retries: 2,
    max_verify_rejections: 1,
    max_tool_retries: 1,
    retry_base_ms: 10,
    retry_max_ms: 100,
    max_queued_input: 2,
    progress: ProgressPolicy {
        repeat_limit: 3,
        failure_limit: 3,
        stale_turn_limit: 0,
    },
};

fn cx(now_ms: u64) -> StepContext<'static> {
    StepContext {
        now_ms,
        policy: &POLICY,
        tools: &Catalog,
    }
}

fn new_run() -> RunState {
    let id: RunId = "run_00000000000000000000000000000001".parse().unwrap();
    let mut r = RunState::new(
        id,
        "t".into(),
        "a".into(),
        json!("goal"),
        Budget::default(),
        0,
    );
    r.budget.deadline_ms = Some(1_000_000);
    r
}

fn go(s: &mut RunState, e: RunEvent) -> Transition {
    step(s, e, &cx(10)).unwrap()
}

fn running() -> RunState {
    let mut s = new_run();
    go(&mut s, RunEvent::Start);
    s
}

fn reply_calls(calls: &[(&str, &str)]) -> ModelReply {
    ModelReply {
        text: None,
        tool_calls: calls
            .iter()
            .enumerate()
            .map(|(i, (n, a))| ModelToolCall {
                id: format!("m{i}"),
                name: (*n).into(),
                arguments: (*a).into(),
            })
            .collect(),
        usage: TokenUsage {
            input_tokens: 10,
            output_tokens: 5,
        },
    }
}

fn reply_text(t: &str) -> ModelReply {
    ModelReply {
        text: Some(t.into()),
        ..Default::default()
    }
}

fn replied(s: &mut RunState, r: ModelReply) -> Transition {
    let epoch = s.epoch;
    go(s, RunEvent::ModelReplied { epoch, reply: r })
}

fn finish_tool(s: &mut RunState, call: &str, result: ToolResult) -> Transition {
    let epoch = s.epoch;
    go(
        s,
        RunEvent::ToolFinished {
            epoch,
            call_id: call.parse().unwrap(),
            result,
        },
    )
}

fn ok() -> ToolResult {
    ToolResult::success(json!({"fine": true}))
}

fn err(code: ToolErrorCode) -> ToolResult {
    ToolResult::failure(ToolError::new(code, "x"))
}

fn where_(s: &RunState) -> (Status, Option<Phase>) {
    (s.status, s.phase)
}

fn has_call_model(t: &Transition, choice: ToolChoice) -> bool {
    t.effects
        .iter()
        .any(|e| matches!(e, Effect::CallModel { tool_choice, .. } if *tool_choice == choice))
}

fn terminal_effects(t: &Transition) -> bool {
    t.effects.contains(&Effect::AbortInFlight) && t.effects.contains(&Effect::Finish)
}

// ---- created ----

#[test]
fn created_start_calls_the_model() {
    let mut s = new_run();
    let t = go(&mut s, RunEvent::Start);
    assert_eq!(t.kind, "run_started");
    assert_eq!(where_(&s), (Status::Running, Some(Phase::AwaitingModel)));
    assert!(has_call_model(&t, ToolChoice::Auto));
    assert_eq!((s.usage.turns, s.turn, s.version), (1, 1, 2));
    assert_eq!(t.data["status"], json!("running"));
}

#[test]
fn created_resume_calls_the_model() {
    let mut s = new_run();
    let t = go(&mut s, RunEvent::Resume);
    assert_eq!(t.kind, "run_resumed");
    assert!(has_call_model(&t, ToolChoice::Auto));
    assert_eq!(s.restarts, 1);
}

#[test]
fn input_is_queued_while_busy_and_delivered_at_the_next_turn() {
    let mut s = new_run();
    assert_eq!(
        go(
            &mut s,
            RunEvent::Input {
                text: "early".into()
            }
        )
        .kind,
        "input_queued"
    );
    go(&mut s, RunEvent::Start);
    assert!(matches!(s.messages.last(), Some(Message::User { content }) if content == "early"));
    assert_eq!(
        go(&mut s, RunEvent::Input { text: "a".into() }).kind,
        "input_queued"
    );
    go(&mut s, RunEvent::Input { text: "b".into() });
    let full = step(&mut s, RunEvent::Input { text: "c".into() }, &cx(10)).unwrap_err();
    assert_eq!(full.code, "input_queue_full");
}

// ---- awaiting_model ----

#[test]
fn final_reply_goes_to_verifying() {
    let mut s = running();
    let t = replied(&mut s, reply_text(r#"{"answer": 1}"#));
    assert_eq!(t.kind, "model_replied");
    assert_eq!(where_(&s), (Status::Running, Some(Phase::Verifying)));
    assert!(
        matches!(&t.effects[..], [Effect::Verify { candidate, .. }] if candidate == &json!({"answer": 1}))
    );
}

#[test]
fn tool_calls_are_validated_and_dispatched_with_intents() {
    let mut s = running();
    let t = replied(
        &mut s,
        reply_calls(&[("echo", r#"{"text":"a"}"#), ("idem", "{}")]),
    );
    assert_eq!(where_(&s), (Status::Running, Some(Phase::ExecutingTools)));
    assert_eq!(t.effects.len(), 2);
    assert_eq!(t.data["dispatched"].as_array().unwrap().len(), 2);
    assert!(
        s.calls
            .iter()
            .all(|c| c.status == CallStatus::Dispatched && c.key.starts_with("idk_"))
    );
    assert_eq!(s.usage.tool_calls, 2);
    assert_eq!((s.usage.input_tokens, s.usage.output_tokens), (10, 5));
}

#[test]
fn text_with_tool_calls_is_a_tool_call_decision() {
    let mut s = running();
    let mut r = reply_calls(&[("echo", r#"{"text":"a"}"#)]);
    r.text = Some("let me look".into());
    replied(&mut s, r);
    assert_eq!(s.phase, Some(Phase::ExecutingTools));
    assert!(s.candidate.is_none());
}

#[test]
fn a_call_needing_approval_parks_the_batch() {
    let mut s = running();
    let t = replied(
        &mut s,
        reply_calls(&[("gate", "{}"), ("echo", r#"{"text":"a"}"#)]),
    );
    assert_eq!(where_(&s), (Status::WaitingApproval, None));
    assert!(
        t.effects.is_empty(),
        "nothing runs until every approval is decided"
    );
    assert_eq!(s.pending_approvals().count(), 1);
}

#[test]
fn ask_user_waits_for_input() {
    let mut s = running();
    let t = replied(
        &mut s,
        reply_calls(&[("ask_user", r#"{"question":"which?"}"#)]),
    );
    assert_eq!(t.kind, "input_requested");
    assert_eq!(where_(&s), (Status::WaitingInput, None));
    let t = go(
        &mut s,
        RunEvent::Input {
            text: "this".into(),
        },
    );
    assert_eq!(t.kind, "input_received");
    assert!(has_call_model(&t, ToolChoice::Auto));
    assert!(matches!(s.messages.last(), Some(Message::Tool { call_id, .. }) if call_id == "m0"));
}

#[test]
fn malformed_replies_are_corrected_then_fail() {
    let mut s = running();
    for (i, r) in [
        reply_text(""),
        reply_calls(&[("nope", "{}")]),
        reply_calls(&[("echo", "{not json")]),
    ]
    .into_iter()
    .enumerate()
    {
        let t = replied(&mut s, r);
        if i < 2 {
            assert!(has_call_model(&t, ToolChoice::Auto), "correction {i}");
        } else {
            assert_eq!(t.kind, "run_failed");
            assert_eq!(t.data["cause"], json!("model_replied"));
            assert_eq!(s.error.as_ref().unwrap().code, "invalid_model_output");
        }
    }
}

#[test]
fn unknown_and_disallowed_tools_and_bad_arguments_get_structured_errors() {
    let mut s = running();
    replied(
        &mut s,
        reply_calls(&[
            ("nope", "{}"),
            ("hidden", "{}"),
            ("echo", r#"{"text":5}"#),
            ("echo", "[1]"),
        ]),
    );
    // Nothing valid: the batch is answered at once and the next turn starts.
    assert_eq!(s.phase, Some(Phase::AwaitingModel));
    let codes: Vec<String> = s
        .messages
        .iter()
        .filter_map(|m| match m {
            Message::Tool { content, .. } => {
                let v: Value = serde_json::from_str(content).unwrap();
                Some(format!(
                    "{}:{}",
                    v["error"]["code"].as_str().unwrap(),
                    v["error"]["message"].as_str().unwrap()
                ))
            }
            _ => None,
        })
        .collect();
    assert!(codes[0].starts_with("tool_not_allowed:unknown tool"));
    assert!(codes[1].starts_with("tool_not_allowed:tool `hidden` is not allowed"));
    assert!(codes[2].starts_with("invalid_argument:at `/text`"));
    assert!(codes[3].starts_with("invalid_argument:arguments must be a JSON object"));
    assert_eq!(s.usage.tool_calls, 0);
}

#[test]
fn overloaded_model_is_retried_then_fails() {
    let mut s = running();
    for attempt in 1..=3 {
        let epoch = s.epoch;
        let t = go(
            &mut s,
            RunEvent::ModelFailed {
                epoch,
                error: ModelError::new(ModelErrorKind::Overloaded, "full"),
            },
        );
        if attempt <= 2 {
            assert!(matches!(t.effects[..], [Effect::ScheduleRetry { .. }]));
            let t = go(&mut s, RunEvent::RetryDue { epoch });
            assert_eq!(t.kind, "model_retry");
            assert!(has_call_model(&t, ToolChoice::Auto));
            assert_eq!(s.usage.turns, 1, "a retry is not a new turn");
        } else {
            assert!(terminal_effects(&t));
            assert_eq!(s.error.as_ref().unwrap().code, "model_unavailable");
        }
    }
}

#[test]
fn provider_failures_after_the_gateway_are_final() {
    for (kind, code) in [
        (ModelErrorKind::Unavailable, "model_unavailable"),
        (ModelErrorKind::RateLimited, "model_unavailable"),
        (ModelErrorKind::Rejected, "model_rejected"),
    ] {
        let mut s = running();
        let epoch = s.epoch;
        let t = go(
            &mut s,
            RunEvent::ModelFailed {
                epoch,
                error: ModelError::new(kind, "x"),
            },
        );
        assert_eq!(t.kind, "run_failed");
        assert_eq!(s.error.as_ref().unwrap().code, code);
    }
}

#[test]
fn a_context_overflow_rebuilds_once_then_fails_as_such() {
    let mut s = running();
    let turn = s.turn;
    let epoch = s.epoch;
    let overflow = || ModelError::new(ModelErrorKind::ContextLengthExceeded, "too long");
    let t = go(
        &mut s,
        RunEvent::ModelFailed {
            epoch,
            error: overflow(),
        },
    );
    assert_eq!(t.kind, "model_failed");
    assert!(has_call_model(&t, ToolChoice::Auto), "{t:?}");
    assert_eq!(t.data["context_rebuild"], 1);
    assert_eq!(s.context_rebuilds, 1);
    assert_eq!(s.turn, turn, "the same turn, rebuilt");
    let epoch = s.epoch;
    let t = go(
        &mut s,
        RunEvent::ModelFailed {
            epoch,
            error: overflow(),
        },
    );
    assert_eq!(t.kind, "run_failed");
    assert_eq!(s.error.as_ref().unwrap().code, "context_length_exceeded");
}

// ---- executing_tools and reconciling ----

#[test]
fn finished_batch_starts_the_next_turn() {
    let mut s = running();
    replied(
        &mut s,
        reply_calls(&[("echo", r#"{"text":"a"}"#), ("echo", r#"{"text":"b"}"#)]),
    );
    let t = finish_tool(&mut s, "call_1_1", ok());
    assert_eq!(t.kind, "tool_call_finished");
    assert!(t.effects.is_empty(), "still waiting for call_1_0");
    let t = finish_tool(&mut s, "call_1_0", ok());
    assert!(has_call_model(&t, ToolChoice::Auto));
    // Results are appended in call order, each answering its model call id.
    let ids: Vec<&str> = s
        .messages
        .iter()
        .filter_map(|m| match m {
            Message::Tool { call_id, .. } => Some(call_id.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(ids, ["m0", "m1"]);
    assert_eq!(s.succeeded_tools, ["echo"]);
}

#[test]
fn unknown_outcomes_follow_the_tool_policy() {
    // idempotent: resent with the same key, within the retry bound
    let mut s = running();
    replied(&mut s, reply_calls(&[("idem", "{}")]));
    let key = s.calls[0].key.clone();
    let t = finish_tool(&mut s, "call_1_0", err(ToolErrorCode::Timeout));
    assert!(matches!(&t.effects[..], [Effect::ExecuteTool { .. }]));
    assert_eq!((s.calls[0].key.clone(), s.calls[0].attempts), (key, 2));
    assert_eq!(s.usage.tool_calls, 1, "a resend is not a new call");
    let t = finish_tool(&mut s, "call_1_0", err(ToolErrorCode::OutcomeUnknown));
    assert!(
        has_call_model(&t, ToolChoice::Auto),
        "retries exhausted: the model is told"
    );

    // unsafe with a status check: reconcile
    let mut s = running();
    replied(&mut s, reply_calls(&[("recon", "{}")]));
    let t = finish_tool(&mut s, "call_1_0", err(ToolErrorCode::OutcomeUnknown));
    assert!(matches!(&t.effects[..], [Effect::CheckStatus { .. }]));
    assert_eq!(s.phase, Some(Phase::Reconciling));

    // unsafe without: an operator decides
    let mut s = running();
    replied(&mut s, reply_calls(&[("unsafe_tool", "{}")]));
    finish_tool(&mut s, "call_1_0", err(ToolErrorCode::Timeout));
    assert_eq!(where_(&s), (Status::WaitingApproval, None));
    assert_eq!(s.calls[0].status, CallStatus::OutcomeUnknown);

    // read: the error goes to the model
    let mut s = running();
    replied(&mut s, reply_calls(&[("echo", r#"{"text":"a"}"#)]));
    let t = finish_tool(&mut s, "call_1_0", err(ToolErrorCode::Timeout));
    assert!(has_call_model(&t, ToolChoice::Auto));
}

#[test]
fn overloaded_tool_calls_are_rescheduled() {
    let mut s = running();
    replied(&mut s, reply_calls(&[("idem", "{}")]));
    let t = finish_tool(&mut s, "call_1_0", err(ToolErrorCode::Overloaded));
    assert!(matches!(t.effects[..], [Effect::ScheduleRetry { .. }]));
    let epoch = s.epoch;
    let t = go(&mut s, RunEvent::RetryDue { epoch });
    assert_eq!(t.kind, "tool_retry");
    assert!(matches!(&t.effects[..], [Effect::ExecuteTool { .. }]));
    assert_eq!(t.data["dispatched"][0]["key"], json!(s.calls[0].key));
}

#[test]
fn status_checks_resolve_reconciliation() {
    for (outcome, expect) in [
        (Ok(Some(ok())), "ran"),
        (Ok(None), "never_ran"),
        (Err(ToolError::new(ToolErrorCode::Failed, "x")), "unknown"),
    ] {
        let mut s = running();
        replied(&mut s, reply_calls(&[("recon", "{}")]));
        finish_tool(&mut s, "call_1_0", err(ToolErrorCode::OutcomeUnknown));
        let epoch = s.epoch;
        let t = go(
            &mut s,
            RunEvent::StatusChecked {
                epoch,
                call_id: "call_1_0".parse().unwrap(),
                outcome,
            },
        );
        assert_eq!(t.kind, "call_reconciled");
        assert_eq!(t.data["found"], json!(expect));
        // Every send is listed with its key in the event that committed it.
        assert_eq!(t.data.get("dispatched").is_some(), expect == "never_ran");
        match expect {
            "ran" => assert!(has_call_model(&t, ToolChoice::Auto)),
            "never_ran" => assert!(matches!(&t.effects[..], [Effect::ExecuteTool { .. }])),
            _ => assert_eq!(s.status, Status::WaitingApproval),
        }
    }
}

// ---- verifying ----

#[test]
fn verification_accepts_rejects_and_gives_up() {
    let mut s = running();
    replied(&mut s, reply_text("x"));
    let epoch = s.epoch;
    let t = go(
        &mut s,
        RunEvent::VerificationDone {
            epoch,
            verdict: Err("too short".into()),
        },
    );
    assert_eq!(t.kind, "verification_rejected");
    assert!(has_call_model(&t, ToolChoice::Auto));
    replied(&mut s, reply_text("longer"));
    let epoch = s.epoch;
    let t = go(
        &mut s,
        RunEvent::VerificationDone {
            epoch,
            verdict: Err("still".into()),
        },
    );
    assert_eq!(t.kind, "run_failed");
    assert_eq!(s.error.as_ref().unwrap().code, "verification_failed");

    let mut s = running();
    replied(&mut s, reply_text("fine"));
    let epoch = s.epoch;
    let t = go(
        &mut s,
        RunEvent::VerificationDone {
            epoch,
            verdict: Ok(()),
        },
    );
    assert_eq!(t.kind, "run_succeeded");
    assert_eq!(t.effects, [Effect::Finish]);
    assert_eq!(s.output, Some(json!("fine")));
}

// ---- waiting_approval ----

#[test]
fn approve_dispatches_and_reject_answers_the_model() {
    let mut s = running();
    replied(&mut s, reply_calls(&[("gate", r#"{"text":"a"}"#)]));
    let key = s.calls[0].key.clone();
    let t = go(
        &mut s,
        RunEvent::Approve {
            call_id: "call_1_0".parse().unwrap(),
            arguments: Some(json!({"text": "b"})),
            by: None,
        },
    );
    assert_eq!(t.kind, "call_approved");
    assert!(matches!(&t.effects[..], [Effect::ExecuteTool { .. }]));
    assert_ne!(s.calls[0].key, key, "edited arguments get their own key");
    assert_eq!(s.decided, [("call_1_0".parse().unwrap(), true)]);

    let mut s = running();
    replied(&mut s, reply_calls(&[("gate", "{}")]));
    let bad = step(
        &mut s,
        RunEvent::Approve {
            call_id: "call_1_0".parse().unwrap(),
            arguments: Some(json!({"text": 1})),
            by: None,
        },
        &cx(10),
    );
    assert_eq!(bad.unwrap_err().code, "invalid_argument");
    let unknown = step(
        &mut s,
        RunEvent::Approve {
            call_id: "call_9_9".parse().unwrap(),
            arguments: None,
            by: None,
        },
        &cx(10),
    );
    assert_eq!(unknown.unwrap_err().code, "unknown_call");
    let t = go(
        &mut s,
        RunEvent::Reject {
            call_id: "call_1_0".parse().unwrap(),
            reason: Some("no".into()),
            by: None,
        },
    );
    assert_eq!(t.kind, "call_rejected");
    assert!(has_call_model(&t, ToolChoice::Auto));
    assert!(
        matches!(s.messages.last(), Some(Message::Tool { content, .. }) if content.contains("approval_denied"))
    );
}

#[test]
fn an_expired_approval_takes_the_tools_default_decision() {
    let mut s = running();
    replied(&mut s, reply_calls(&[("gate", "{}"), ("gate_auto", "{}")]));
    assert_eq!(s.status, Status::WaitingApproval);
    assert_eq!(s.calls[0].awaiting_since_ms, Some(10));
    let (c0, c1): (CallId, CallId) = ("call_1_0".parse().unwrap(), "call_1_1".parse().unwrap());
    let t = go(
        &mut s,
        RunEvent::ApprovalExpired {
            call_id: c0.clone(),
        },
    );
    assert_eq!(t.kind, "approval_expired");
    assert_eq!(t.data["action"], "reject");
    assert!(t.effects.is_empty(), "the other call still waits");
    assert_eq!(s.status, Status::WaitingApproval);
    let t = go(
        &mut s,
        RunEvent::ApprovalExpired {
            call_id: c1.clone(),
        },
    );
    assert_eq!(t.data["action"], "approve");
    assert!(matches!(&t.effects[..], [Effect::ExecuteTool { .. }]));
    assert_eq!(s.decided, [(c0.clone(), false), (c1.clone(), true)]);
    // A timer for a call already decided changes nothing; nor can an operator decide it again.
    let t = go(&mut s, RunEvent::ApprovalExpired { call_id: c0 });
    assert_eq!(t.kind, "late_result_ignored");
    let again = step(
        &mut s,
        RunEvent::Approve {
            call_id: c1,
            arguments: None,
            by: None,
        },
        &cx(10),
    );
    assert_eq!(again.unwrap_err().code, "invalid_state");
    let finished = finish_tool(&mut s, "call_1_1", ToolResult::success(json!("ok")));
    assert!(has_call_model(&finished, ToolChoice::Auto));
    assert!(
        s.messages.iter().any(
            |m| matches!(m, Message::Tool { content, .. } if content.contains("approval_denied"))
        ),
        "the expired call is answered to the model as rejected"
    );
}

// ---- resume ----

#[test]
fn resume_reissues_in_flight_work_by_policy() {
    let mut s = running();
    let t = go(&mut s, RunEvent::Resume);
    assert!(
        has_call_model(&t, ToolChoice::Auto),
        "awaiting_model: ask again"
    );
    assert_eq!(s.usage.turns, 1, "the lost call is not a new turn");

    let mut s = running();
    replied(
        &mut s,
        reply_calls(&[
            ("echo", r#"{"text":"a"}"#),
            ("idem", "{}"),
            ("recon", "{}"),
            ("unsafe_tool", "{}"),
        ]),
    );
    finish_tool(&mut s, "call_1_0", ok());
    let t = go(&mut s, RunEvent::Resume);
    let kinds: Vec<&str> = t
        .effects
        .iter()
        .map(|e| match e {
            Effect::ExecuteTool { .. } => "execute",
            Effect::CheckStatus { .. } => "check",
            _ => "other",
        })
        .collect();
    // Done calls are kept; idempotent resent; reconcilable checked; unsafe parked for an
    // operator, which holds back the resend until it is decided. The status check in flight
    // is answered before the run waits for the operator (its reply needs `running`).
    assert_eq!(kinds, ["check"]);
    assert_eq!(where_(&s), (Status::Running, Some(Phase::Reconciling)));
    assert_eq!(s.calls[0].status, CallStatus::Done);
    assert_eq!(s.calls[1].status, CallStatus::Ready);
    assert_eq!(s.calls[3].status, CallStatus::OutcomeUnknown);
    assert_eq!(t.data["outcome_unknown"], json!(["call_1_3"]));
    assert_eq!(s.usage.tool_calls, 4, "nothing is charged twice");
    let epoch = s.epoch;
    let t = go(
        &mut s,
        RunEvent::StatusChecked {
            epoch,
            call_id: "call_1_2".parse().unwrap(),
            outcome: Ok(Some(ok())),
        },
    );
    assert_eq!(t.kind, "call_reconciled");
    assert_eq!(s.status, Status::WaitingApproval);
    assert_eq!(s.calls[2].status, CallStatus::Done);

    let mut s = running();
    replied(&mut s, reply_text("final"));
    let t = go(&mut s, RunEvent::Resume);
    assert!(matches!(t.effects[..], [Effect::Verify { .. }]));

    let mut s = running();
    replied(&mut s, reply_calls(&[("gate", "{}")]));
    assert!(go(&mut s, RunEvent::Resume).effects.is_empty());
}

// ---- any non-terminal ----

#[test]
fn cancel_abort_and_deadline_end_any_live_run() {
    let setups: Vec<fn() -> RunState> = vec![
        new_run,
        running,
        || {
            let mut s = running();
            replied(&mut s, reply_calls(&[("gate", "{}")]));
            s
        },
        || {
            let mut s = running();
            replied(&mut s, reply_calls(&[("ask_user", r#"{"question":"q"}"#)]));
            s
        },
    ];
    for setup in setups {
        let mut s = setup();
        let t = go(&mut s, RunEvent::Cancel { reason: None });
        assert_eq!((t.kind, s.status), ("run_cancelled", Status::Cancelled));
        assert!(terminal_effects(&t));

        let mut s = setup();
        let t = go(
            &mut s,
            RunEvent::Abort {
                code: "crash_loop".into(),
                message: "x".into(),
            },
        );
        assert_eq!(
            (t.kind, s.error.as_ref().unwrap().code.as_str()),
            ("run_failed", "crash_loop")
        );

        let mut s = setup();
        go(&mut s, RunEvent::DeadlineReached);
        assert_eq!(s.error.as_ref().unwrap().code, "budget_exceeded");
    }
}

#[test]
fn budgets_are_checked_before_model_and_tool_calls() {
    // Turns: the reserve turn is made without tools; its answer is the output of a failed run.
    let mut s = new_run();
    s.budget.max_turns = 1;
    go(&mut s, RunEvent::Start);
    let t = replied(&mut s, reply_calls(&[("echo", r#"{"text":"a"}"#)]));
    assert_eq!(t.effects.len(), 1);
    let t = finish_tool(&mut s, "call_1_0", ok());
    assert_eq!(t.kind, "tool_call_finished");
    assert!(has_call_model(&t, ToolChoice::None), "{t:?}");
    assert_eq!(s.budget_final, Some(Exhausted::Turns));
    let Some(Message::User { content }) = s.messages.last() else {
        panic!("no note: {:?}", s.messages.last());
    };
    assert!(content.contains("turns budget is exhausted"), "{content}");
    let t = replied(&mut s, reply_text("partial: a"));
    assert_eq!(t.kind, "run_failed");
    assert!(terminal_effects(&t));
    assert_eq!(s.error.as_ref().unwrap().code, "budget_exceeded");
    assert!(s.error.as_ref().unwrap().message.contains("turns"));
    assert_eq!(s.output, Some(json!("partial: a")));

    // Tool calls: none of the batch runs, each is answered, then the reserve turn.
    let mut s = new_run();
    s.budget.max_tool_calls = 1;
    go(&mut s, RunEvent::Start);
    let t = replied(
        &mut s,
        reply_calls(&[("echo", r#"{"text":"a"}"#), ("echo", r#"{"text":"b"}"#)]),
    );
    assert!(has_call_model(&t, ToolChoice::None), "{t:?}");
    assert!(s.calls.is_empty());
    let answered = s
        .messages
        .iter()
        .filter(|m| matches!(m, Message::Tool { content, .. } if content.contains("not run")))
        .count();
    assert_eq!(answered, 2);
    // A reserve turn that still asks for tools ends the run without an output.
    let t = replied(&mut s, reply_calls(&[("echo", r#"{"text":"c"}"#)]));
    assert_eq!(t.kind, "run_failed");
    assert!(s.error.as_ref().unwrap().message.contains("tool_calls"));
    assert_eq!(s.output, None);
    assert_eq!(s.usage.tool_calls, 0, "nothing was dispatched");

    // Tokens, with a JSON answer.
    let mut s = new_run();
    s.budget.max_tokens = 10;
    go(&mut s, RunEvent::Start);
    let mut r = reply_calls(&[("echo", r#"{"text":"a"}"#)]);
    r.usage.input_tokens = 10;
    replied(&mut s, r);
    let t = finish_tool(&mut s, "call_1_0", ok());
    assert!(has_call_model(&t, ToolChoice::None), "{t:?}");
    replied(&mut s, reply_text(r#"{"found": "a"}"#));
    assert_eq!(s.status, Status::Failed);
    assert!(s.error.as_ref().unwrap().message.contains("tokens"));
    assert_eq!(s.output, Some(json!({"found": "a"})));

    // The deadline has no reserve.
    let mut s = new_run();
    let late = step(&mut s, RunEvent::Start, &cx(2_000_000)).unwrap();
    assert_eq!(late.kind, "run_failed");
    assert!(s.error.as_ref().unwrap().message.contains("deadline"));
}

#[test]
fn stale_replies_are_ignored() {
    let mut s = running();
    let before = s.clone();
    let t = go(
        &mut s,
        RunEvent::ModelReplied {
            epoch: 0,
            reply: reply_text("old"),
        },
    );
    assert_eq!(t.kind, "late_result_ignored");
    assert_eq!(s.status, before.status);
    assert_eq!(s.messages, before.messages);
    assert_eq!(s.version, before.version + 1);
}

#[test]
fn terminal_runs_record_late_results_and_reject_everything_else() {
    let mut s = running();
    replied(&mut s, reply_calls(&[("echo", r#"{"text":"a"}"#)]));
    let epoch = s.epoch;
    go(&mut s, RunEvent::Cancel { reason: None });
    let t = go(
        &mut s,
        RunEvent::ToolFinished {
            epoch,
            call_id: "call_1_0".parse().unwrap(),
            result: ok(),
        },
    );
    assert_eq!(t.kind, "late_result_ignored");
    assert_eq!(s.status, Status::Cancelled);
    for e in [
        RunEvent::Start,
        RunEvent::Resume,
        RunEvent::Cancel { reason: None },
        RunEvent::Input { text: "x".into() },
        RunEvent::Approve {
            call_id: "call_1_0".parse().unwrap(),
            arguments: None,
            by: None,
        },
        RunEvent::Abort {
            code: "x".into(),
            message: "y".into(),
        },
    ] {
        let before = s.clone();
        let err = step(&mut s, e, &cx(10)).unwrap_err();
        assert_eq!(err.code, "invalid_state");
        assert_eq!(s, before, "an error changes nothing");
    }
}

#[test]
fn controls_that_do_not_fit_are_errors() {
    let mut s = new_run();
    for e in [
        RunEvent::Approve {
            call_id: "call_1_0".parse().unwrap(),
            arguments: None,
            by: None,
        },
        RunEvent::Reject {
            call_id: "call_1_0".parse().unwrap(),
            reason: None,
            by: None,
        },
    ] {
        assert_eq!(step(&mut s, e, &cx(10)).unwrap_err().code, "invalid_state");
    }
    let mut s = running();
    assert!(step(&mut s, RunEvent::Start, &cx(10)).is_err());
    assert!(
        step(
            &mut s,
            RunEvent::Approve {
                call_id: "call_1_0".parse().unwrap(),
                arguments: None,
                by: None,
            },
            &cx(10)
        )
        .is_err()
    );
}

#[test]
fn no_progress_escalates_to_a_forced_final_turn_then_fails() {
    let mut s = running();
    let mut kinds = Vec::new();
    for _ in 0..5 {
        if s.is_terminal() {
            break;
        }
        let t = replied(&mut s, reply_calls(&[("echo", r#"{"text":"same"}"#)]));
        kinds.push(t.kind);
        if s.is_terminal() {
            break;
        }
        let call = s.calls[0].call_id.to_string();
        let t = finish_tool(&mut s, &call, ok());
        if has_call_model(&t, ToolChoice::None) {
            kinds.push("forced_final");
        }
    }
    assert!(kinds.contains(&"forced_final"), "{kinds:?}");
    assert_eq!(s.error.as_ref().unwrap().code, "no_progress");
}

// ---- a tool that keeps failing, permission errors, retries ----

/// One turn calling `tool`, answered with `result`. Arguments and error messages differ per
/// turn, so the repeat rules of no-progress stay out of the way.
fn call_turn(s: &mut RunState, tool: &str, mut result: ToolResult) -> Transition {
    let args = json!({ "text": format!("turn {}", s.turn) }).to_string();
    replied(s, reply_calls(&[(tool, &args)]));
    if let Some(e) = &mut result.error {
        e.message = format!("{} (turn {})", e.message, s.turn);
    }
    let call = s.calls[0].call_id.to_string();
    finish_tool(s, &call, result)
}

/// The content of the newest tool message.
fn last_tool_message(s: &RunState) -> Value {
    let content = s
        .messages
        .iter()
        .rev()
        .find_map(|m| match m {
            Message::Tool { content, .. } => Some(content.clone()),
            _ => None,
        })
        .unwrap();
    serde_json::from_str(&content).unwrap()
}

fn failed() -> ToolResult {
    ToolResult::failure(ToolError::new(ToolErrorCode::Failed, "the tool broke"))
}

/// `echo` failed twice (answered to the model) and a third time: held for an operator.
fn held_after_three_failures() -> RunState {
    let mut s = running();
    for n in 1..=2 {
        let t = call_turn(&mut s, "echo", failed());
        assert_eq!(t.kind, "tool_call_finished");
        assert!(t.data.get("held").is_none(), "{}", t.data);
        assert!(
            has_call_model(&t, ToolChoice::Auto),
            "failure {n} goes to the model"
        );
        assert_eq!(last_tool_message(&s)["error"]["code"], "failed");
        assert_eq!(s.tool_failures, [("echo".to_owned(), n)]);
    }
    let t = call_turn(&mut s, "echo", failed());
    assert_eq!(t.kind, "tool_call_finished");
    assert_eq!(t.data["held"], "tool_failing");
    assert_eq!(t.data["failures"], 3);
    assert_eq!(t.data["status"], "waiting_approval");
    assert!(t.effects.is_empty());
    assert_eq!(where_(&s), (Status::WaitingApproval, None));
    let c = &s.calls[0];
    assert_eq!(
        (c.status, c.hold),
        (CallStatus::AwaitingApproval, Some(HoldReason::ToolFailing))
    );
    assert_eq!(c.awaiting_since_ms, Some(10));
    assert_eq!(
        c.result.as_ref().unwrap().error_code(),
        Some(ToolErrorCode::Failed)
    );
    assert_eq!(s.pending_approvals().count(), 1);
    // The operator's decision replaces the no-progress escalation for these failures.
    assert_eq!((s.progress.failure_streak, s.progress.stale_turns), (0, 0));
    s
}

#[test]
fn a_tool_failing_three_times_in_a_row_waits_for_an_operator_who_retries_it() {
    let mut s = held_after_three_failures();
    let messages = s.messages.len();
    let key = s.calls[0].key.clone();
    let t = go(
        &mut s,
        RunEvent::Approve {
            call_id: "call_3_0".parse().unwrap(),
            arguments: None,
            by: Some("ops".into()),
        },
    );
    assert_eq!(t.kind, "call_approved");
    assert_eq!(t.data["held"], "tool_failing");
    assert!(
        matches!(&t.effects[..], [Effect::ExecuteTool { call_id, .. }] if call_id.to_string() == "call_3_0")
    );
    assert_eq!(t.data["dispatched"][0]["key"], json!(key), "the same key");
    assert_eq!(where_(&s), (Status::Running, Some(Phase::ExecutingTools)));
    assert_eq!((s.calls[0].attempts, s.calls[0].hold), (2, None));
    assert_eq!(s.usage.tool_calls, 3, "a retry is not a new tool call");
    assert_eq!(
        s.messages.len(),
        messages,
        "the model heard nothing of the held failure"
    );
    let t = finish_tool(&mut s, "call_3_0", ok());
    assert!(has_call_model(&t, ToolChoice::Auto));
    assert_eq!(last_tool_message(&s)["ok"], true);
    assert!(s.tool_failures.is_empty(), "a success clears the count");
}

#[test]
fn a_failed_retry_is_held_again_and_a_skip_tells_the_model() {
    let mut s = held_after_three_failures();
    go(
        &mut s,
        RunEvent::Approve {
            call_id: "call_3_0".parse().unwrap(),
            arguments: None,
            by: None,
        },
    );
    let t = finish_tool(&mut s, "call_3_0", failed());
    assert_eq!(
        t.data["held"], "tool_failing",
        "still failing: back to the operator"
    );
    assert_eq!(t.data["failures"], 4);
    assert_eq!(s.status, Status::WaitingApproval);
    let t = go(
        &mut s,
        RunEvent::Reject {
            call_id: "call_3_0".parse().unwrap(),
            reason: Some("the service is down for the day".into()),
            by: None,
        },
    );
    assert_eq!(t.kind, "call_rejected");
    assert_eq!(t.data["held"], "tool_failing");
    assert!(has_call_model(&t, ToolChoice::Auto));
    let seen = last_tool_message(&s);
    assert_eq!(seen["ok"], false);
    assert_eq!(seen["error"]["code"], "skipped", "{seen}");
    let message = seen["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("an operator skipped this call")
            && message.contains("failed 4 times in a row")
            && message.contains("the tool broke")
            && message.contains("down for the day"),
        "{message}"
    );
    assert!(
        s.tool_failures.is_empty(),
        "after a skip the count starts over"
    );
    // The model tries again: two more failures go to it, the third is held again.
    call_turn(&mut s, "echo", failed());
    assert_eq!(s.status, Status::Running);
    call_turn(&mut s, "echo", failed());
    assert_eq!(s.status, Status::Running);
    call_turn(&mut s, "echo", failed());
    assert_eq!(s.status, Status::WaitingApproval);
}

#[test]
fn an_operator_can_fail_the_run_at_a_held_call() {
    let mut s = held_after_three_failures();
    let t = go(
        &mut s,
        RunEvent::Fail {
            call_id: "call_3_0".parse().unwrap(),
            reason: Some("broken upstream".into()),
            by: Some("ops".into()),
        },
    );
    assert_eq!(t.kind, "run_failed");
    assert_eq!(t.data["cause"], "call_failed");
    assert_eq!(t.data["held"], "tool_failing");
    assert!(terminal_effects(&t));
    let e = s.error.clone().unwrap();
    assert_eq!(e.code, "tool_failing");
    assert!(
        e.message.contains("broken upstream") && e.message.contains("the tool broke"),
        "{}",
        e.message
    );
    assert_eq!(s.failed_call, Some("call_3_0".parse().unwrap()));
    // Through the inbox: the same decision again is a repeat, anything else is refused.
    let fail = Control::Fail {
        call_id: "call_3_0".parse().unwrap(),
        reason: None,
        by: None,
    };
    assert_eq!(
        apply_control(&mut s, 1, fail, &cx(10)),
        ControlStep::Repeated
    );
    let reject = Control::Reject {
        call_id: "call_3_0".parse().unwrap(),
        reason: None,
        by: None,
    };
    assert!(matches!(
        apply_control(&mut s, 2, reject, &cx(10)),
        ControlStep::Refused(None, _)
    ));
}

#[test]
fn fail_fits_only_a_call_waiting_for_an_operator_and_names_why_it_waited() {
    // A policy approval failed by the operator: approval_denied.
    let mut s = running();
    replied(&mut s, reply_calls(&[("gate", "{}")]));
    let t = go(
        &mut s,
        RunEvent::Fail {
            call_id: "call_1_0".parse().unwrap(),
            reason: None,
            by: None,
        },
    );
    assert_eq!(t.kind, "run_failed");
    assert_eq!(s.error.unwrap().code, "approval_denied");
    // Not waiting: refused, nothing changes.
    let mut s = running();
    replied(&mut s, reply_calls(&[("echo", "{}")]));
    let before = s.clone();
    let e = step(
        &mut s,
        RunEvent::Fail {
            call_id: "call_1_0".parse().unwrap(),
            reason: None,
            by: None,
        },
        &cx(10),
    )
    .unwrap_err();
    assert_eq!(e.code, "invalid_state");
    assert_eq!(s, before);
    let mut s = held_after_three_failures();
    let e = step(
        &mut s,
        RunEvent::Fail {
            call_id: "call_9_0".parse().unwrap(),
            reason: None,
            by: None,
        },
        &cx(10),
    )
    .unwrap_err();
    assert_eq!(e.code, "unknown_call");
}

#[test]
fn only_failures_of_the_same_tool_in_a_row_count() {
    // (results of each turn's one call, as (tool, result); whether the last is held)
    let ok_echo = || ("echo", ok());
    let fail = |tool| (tool, failed());
    let code = |tool, c| (tool, err(c));
    let rows: Vec<(Vec<(&str, ToolResult)>, bool)> = vec![
        (vec![fail("echo"), fail("echo"), fail("echo")], true),
        (
            vec![
                fail("echo"),
                fail("echo"),
                ok_echo(),
                fail("echo"),
                fail("echo"),
            ],
            false,
        ),
        (
            vec![fail("echo"), fail("idem"), fail("echo"), fail("idem")],
            false,
        ),
        (
            vec![
                fail("echo"),
                fail("idem"),
                fail("echo"),
                fail("idem"),
                fail("echo"),
            ],
            true,
        ),
        // Transient classes count (after the executor's own retries).
        (
            vec![
                code("echo", ToolErrorCode::Retryable),
                code("echo", ToolErrorCode::Timeout),
                code("echo", ToolErrorCode::Failed),
            ],
            true,
        ),
        // The model's mistakes and the runtime's refusals are not the tool failing.
        (
            vec![
                code("echo", ToolErrorCode::InvalidArgument),
                code("echo", ToolErrorCode::InvalidArgument),
                code("echo", ToolErrorCode::InvalidArgument),
            ],
            false,
        ),
        // max_failures = 0: never held.
        (vec![fail("sturdy"), fail("sturdy"), fail("sturdy")], false),
    ];
    for (turns, held) in rows {
        let mut s = running();
        let n = turns.len();
        for (i, (tool, result)) in turns.into_iter().enumerate() {
            let t = call_turn(&mut s, tool, result);
            let is_held = s.status == Status::WaitingApproval;
            if i + 1 < n {
                assert!(!is_held, "held too early at turn {}: {}", i + 1, t.data);
            } else {
                assert_eq!(is_held, held, "{}", t.data);
            }
            if s.is_terminal() {
                break;
            }
        }
    }
}

#[test]
fn a_tool_that_is_never_held_still_meets_the_no_progress_rules() {
    let mut s = running();
    let mut nudged = false;
    for _ in 0..3 {
        call_turn(&mut s, "sturdy", failed());
        nudged |= s
            .messages
            .iter()
            .any(|m| matches!(m, Message::User { content } if content.contains("failed in a row")));
    }
    assert!(nudged, "failure_limit = 3 nudges the model");
    assert_eq!(s.status, Status::Running);
}

#[test]
fn calls_in_flight_are_answered_before_the_run_waits_for_the_operator() {
    let mut s = running();
    call_turn(&mut s, "echo", failed());
    call_turn(&mut s, "echo", failed());
    replied(
        &mut s,
        reply_calls(&[("echo", r#"{"text":"b"}"#), ("idem", r#"{"text":"c"}"#)]),
    );
    let t = finish_tool(&mut s, "call_3_0", failed());
    assert_eq!(t.data["held"], "tool_failing");
    assert_eq!(where_(&s), (Status::Running, Some(Phase::ExecutingTools)));
    let t = finish_tool(&mut s, "call_3_1", ok());
    assert_eq!(t.data["status"], "waiting_approval");
    assert_eq!(s.calls[1].status, CallStatus::Done);
    // Skipping the held call finishes the batch: both answers reach the model, in order.
    go(
        &mut s,
        RunEvent::Reject {
            call_id: "call_3_0".parse().unwrap(),
            reason: None,
            by: None,
        },
    );
    assert_eq!(where_(&s), (Status::Running, Some(Phase::AwaitingModel)));
    let tools: Vec<&Message> = s
        .messages
        .iter()
        .rev()
        .filter(|m| matches!(m, Message::Tool { .. }))
        .take(2)
        .collect();
    assert!(matches!(tools[1], Message::Tool { content, .. } if content.contains("skipped")));
    assert!(matches!(tools[0], Message::Tool { content, .. } if content.contains(r#""ok":true"#)));
}

#[test]
fn an_expired_hold_takes_the_tools_default_decision() {
    // echo: reject on expiry, i.e. skip.
    let mut s = held_after_three_failures();
    let t = go(
        &mut s,
        RunEvent::ApprovalExpired {
            call_id: "call_3_0".parse().unwrap(),
        },
    );
    assert_eq!(t.kind, "approval_expired");
    assert_eq!(t.data["held"], "tool_failing");
    assert_eq!(t.data["action"], "reject");
    let seen = last_tool_message(&s);
    assert_eq!(seen["error"]["code"], "skipped");
    assert!(
        seen["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no operator decided in time")
    );
    // idem: approve on expiry, i.e. run it again with the same key.
    let mut s = running();
    for _ in 0..3 {
        call_turn(&mut s, "idem", failed());
    }
    assert_eq!(s.status, Status::WaitingApproval);
    let key = s.calls[0].key.clone();
    let t = go(
        &mut s,
        RunEvent::ApprovalExpired {
            call_id: "call_3_0".parse().unwrap(),
        },
    );
    assert_eq!(t.data["action"], "approve");
    assert!(matches!(&t.effects[..], [Effect::ExecuteTool { .. }]));
    assert_eq!(t.data["dispatched"][0]["key"], json!(key));
    assert_eq!(s.calls[0].hold, None);
}

#[test]
fn a_held_call_survives_a_checkpoint_and_a_restart() {
    let mut s = held_after_three_failures();
    let body = crate::run::format::encode(&mut s).unwrap();
    let transcript: Vec<String> = s
        .messages
        .iter()
        .map(|m| serde_json::to_string(m).unwrap())
        .collect();
    let mut back = crate::run::format::decode(&body, &transcript).unwrap();
    assert_eq!(back, s);
    let t = go(&mut back, RunEvent::Resume);
    assert_eq!(t.kind, "run_resumed");
    assert!(t.effects.is_empty());
    assert_eq!(back.calls[0].hold, Some(HoldReason::ToolFailing));
    let t = go(
        &mut back,
        RunEvent::Approve {
            call_id: "call_3_0".parse().unwrap(),
            arguments: None,
            by: None,
        },
    );
    assert!(matches!(&t.effects[..], [Effect::ExecuteTool { .. }]));
    go(&mut s, RunEvent::Cancel { reason: None });
}

#[test]
fn a_permission_error_ends_the_run_or_waits_by_the_tools_policy() {
    let denied = || {
        ToolResult::failure(ToolError::new(
            ToolErrorCode::Permission,
            "HTTP 403: forbidden",
        ))
    };
    // Default: the run ends permission_denied at once.
    let mut s = running();
    let t = call_turn(&mut s, "echo", denied());
    assert_eq!(t.kind, "run_failed");
    assert_eq!(t.data["cause"], "tool_call_finished");
    assert!(terminal_effects(&t));
    let e = s.error.clone().unwrap();
    assert_eq!(e.code, "permission_denied");
    assert!(e.message.contains("HTTP 403"), "{}", e.message);
    assert!(
        s.tool_failures.is_empty(),
        "not counted as the tool failing"
    );

    // on_permission_error = "operator": held, reason permission_error.
    let mut s = running();
    let t = call_turn(&mut s, "perm_ask", denied());
    assert_eq!(t.data["held"], "permission_error");
    assert!(t.data.get("failures").is_none());
    assert_eq!(s.status, Status::WaitingApproval);
    assert_eq!(s.calls[0].hold, Some(HoldReason::PermissionError));
    let mut skipped = s.clone();
    go(
        &mut skipped,
        RunEvent::Reject {
            call_id: "call_1_0".parse().unwrap(),
            reason: None,
            by: None,
        },
    );
    let seen = last_tool_message(&skipped);
    assert_eq!(seen["error"]["code"], "skipped");
    assert!(
        seen["error"]["message"]
            .as_str()
            .unwrap()
            .contains("lack of permission")
    );
    let mut retried = s.clone();
    let t = go(
        &mut retried,
        RunEvent::Approve {
            call_id: "call_1_0".parse().unwrap(),
            arguments: None,
            by: None,
        },
    );
    assert!(matches!(&t.effects[..], [Effect::ExecuteTool { .. }]));
    go(
        &mut s,
        RunEvent::Fail {
            call_id: "call_1_0".parse().unwrap(),
            reason: None,
            by: None,
        },
    );
    assert_eq!(s.error.unwrap().code, "permission_denied");
}

#[test]
fn retries_of_the_pools_are_recorded_and_change_nothing_else() {
    let mut s = running();
    replied(&mut s, reply_calls(&[("echo", "{}")]));
    let before = s.clone();
    let epoch = s.epoch;
    let retrying = |epoch, call: &str| RunEvent::ToolRetrying {
        epoch,
        call_id: call.parse().unwrap(),
        attempt: 1,
        error: ToolError::new(
            ToolErrorCode::Retryable,
            "HTTP 503: ".to_owned() + &"x".repeat(900),
        ),
        wait_ms: 120,
    };
    let t = go(&mut s, retrying(epoch, "call_1_0"));
    assert_eq!(t.kind, "tool_retrying");
    assert!(t.effects.is_empty());
    assert_eq!(t.data["call_id"], "call_1_0");
    assert_eq!(t.data["tool"], "echo");
    assert_eq!(t.data["attempt"], 1);
    assert_eq!(t.data["wait_ms"], 120);
    assert_eq!(t.data["error"]["code"], "retryable");
    assert!(
        t.data["error"]["message"].as_str().unwrap().chars().count() <= 501,
        "bounded"
    );
    assert_eq!(t.data["status"], "running");
    assert_eq!(s.version, before.version + 1);
    s.version = before.version;
    s.updated_at_ms = before.updated_at_ms;
    assert_eq!(s, before, "nothing but the version changes");
    // A stale epoch, an unknown call, or the wrong phase: ignored.
    assert_eq!(
        go(&mut s, retrying(epoch - 1, "call_1_0")).kind,
        "late_result_ignored"
    );
    assert_eq!(
        go(&mut s, retrying(epoch, "call_1_5")).kind,
        "late_result_ignored"
    );
    let model_retry = |epoch| RunEvent::ModelRetrying {
        epoch,
        attempt: 2,
        error: ModelError::new(ModelErrorKind::Unavailable, "connection refused"),
        wait_ms: 300,
    };
    assert_eq!(go(&mut s, model_retry(epoch)).kind, "late_result_ignored");
    // The model's turn.
    finish_tool(&mut s, "call_1_0", ok());
    let epoch = s.epoch;
    let t = go(&mut s, model_retry(epoch));
    assert_eq!(t.kind, "model_retrying");
    assert_eq!(t.data["attempt"], 2);
    assert_eq!(t.data["error"]["kind"], "unavailable");
    assert_eq!(t.data["wait_ms"], 300);
    assert_eq!(where_(&s), (Status::Running, Some(Phase::AwaitingModel)));
    assert_eq!(
        go(&mut s, model_retry(epoch - 1)).kind,
        "late_result_ignored"
    );
    // After the end: recorded as late.
    go(&mut s, RunEvent::Cancel { reason: None });
    assert_eq!(go(&mut s, model_retry(epoch)).kind, "late_result_ignored");
}

// ---- properties ----

fn arb_event() -> impl Strategy<Value = RunEvent> {
    let call = (1u32..4, 0usize..3).prop_map(|(t, i)| CallId::new(t, i));
    let tool = prop::sample::select(vec![
        "echo",
        "idem",
        "unsafe_tool",
        "recon",
        "gate",
        "poll",
        "hidden",
        "nope",
        "ask_user",
        "perm_ask",
        "sturdy",
    ]);
    let args = prop::sample::select(vec![
        r#"{"text":"a"}"#,
        r#"{"text":1}"#,
        "{}",
        "not json",
        r#"{"question":"q"}"#,
    ]);
    let reply = prop_oneof![
        Just(reply_text("final")),
        Just(reply_text("")),
        prop::collection::vec((tool, args), 1..3).prop_map(|v| {
            let calls: Vec<(&str, &str)> = v.clone();
            reply_calls(&calls)
        }),
    ];
    let code = prop::sample::select(vec![
        ToolErrorCode::Timeout,
        ToolErrorCode::OutcomeUnknown,
        ToolErrorCode::Overloaded,
        ToolErrorCode::Failed,
        ToolErrorCode::Retryable,
        ToolErrorCode::Permission,
    ]);
    let result = prop_oneof![Just(ok()), code.prop_map(err)];
    prop_oneof![
        Just(RunEvent::Start),
        Just(RunEvent::Resume),
        (0u64..6, reply).prop_map(|(epoch, reply)| RunEvent::ModelReplied { epoch, reply }),
        (0u64..6).prop_map(|epoch| RunEvent::ModelFailed {
            epoch,
            error: ModelError::new(ModelErrorKind::Overloaded, "x")
        }),
        (0u64..6).prop_map(|epoch| RunEvent::RetryDue { epoch }),
        (0u64..6, call.clone(), result.clone()).prop_map(|(epoch, call_id, result)| {
            RunEvent::ToolFinished {
                epoch,
                call_id,
                result,
            }
        }),
        (0u64..6, call.clone(), prop::option::of(result)).prop_map(|(epoch, call_id, r)| {
            RunEvent::StatusChecked {
                epoch,
                call_id,
                outcome: Ok(r),
            }
        }),
        (0u64..6, any::<bool>()).prop_map(|(epoch, okay)| RunEvent::VerificationDone {
            epoch,
            verdict: if okay { Ok(()) } else { Err("no".into()) }
        }),
        Just(RunEvent::Cancel { reason: None }),
        call.clone().prop_map(|call_id| RunEvent::Approve {
            call_id,
            arguments: None,
            by: None,
        }),
        call.clone().prop_map(|call_id| RunEvent::Reject {
            call_id,
            reason: None,
            by: None,
        }),
        call.clone().prop_map(|call_id| RunEvent::Fail {
            call_id,
            reason: None,
            by: None,
        }),
        call.clone()
            .prop_map(|call_id| RunEvent::ApprovalExpired { call_id }),
        (0u64..6, call).prop_map(|(epoch, call_id)| RunEvent::ToolRetrying {
            epoch,
            call_id,
            attempt: 1,
            error: ToolError::new(ToolErrorCode::Retryable, "503"),
            wait_ms: 5,
        }),
        (0u64..6).prop_map(|epoch| RunEvent::ModelRetrying {
            epoch,
            attempt: 1,
            error: ModelError::new(ModelErrorKind::Unavailable, "503"),
            wait_ms: 5,
        }),
        Just(RunEvent::Input { text: "hi".into() }),
        Just(RunEvent::DeadlineReached),
        long_running_event(),
    ]
}

fn long_running_event() -> impl Strategy<Value = RunEvent> {
    let call = (1u32..4, 0usize..3).prop_map(|(t, i)| CallId::new(t, i));
    let result = prop_oneof![Just(ok()), Just(err(ToolErrorCode::Failed))];
    prop_oneof![
        (0u64..6, call.clone(), any::<bool>()).prop_map(|(epoch, call_id, url)| {
            RunEvent::ToolAccepted {
                epoch,
                call_id,
                status_url: url.then(|| "http://t/s".to_owned()),
                timeout_ms: 1000,
            }
        }),
        (0u64..6, call.clone(), result.clone()).prop_map(|(epoch, call_id, result)| {
            RunEvent::ToolPolled {
                epoch,
                call_id,
                result,
            }
        }),
        (call.clone(), result)
            .prop_map(|(call_id, result)| RunEvent::CallbackResult { call_id, result }),
        (0u64..6, call).prop_map(|(epoch, call_id)| RunEvent::CallDeadline { epoch, call_id }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_event_sequences_keep_the_invariants(events in prop::collection::vec(arb_event(), 1..60)) {
        let mut a = new_run();
        let mut b = new_run();
        let mut terminal_events = 0;
        for e in events {
            let was_terminal = a.is_terminal();
            let before = a.clone();
            let ra = step(&mut a, e.clone(), &cx(10));
            let rb = step(&mut b, e, &cx(10));
            // Deterministic.
            prop_assert_eq!(&ra, &rb);
            prop_assert_eq!(&a, &b);
            match ra {
                Ok(t) => {
                    prop_assert_eq!(a.version, before.version + 1);
                    if matches!(t.kind, "run_succeeded" | "run_failed" | "run_cancelled") {
                        terminal_events += 1;
                    }
                    if was_terminal {
                        prop_assert_eq!(t.kind, "late_result_ignored");
                        prop_assert_eq!(a.status, before.status);
                        prop_assert!(t.effects.is_empty());
                    }
                }
                // An error changes nothing.
                Err(_) => prop_assert_eq!(&a, &before),
            }
            // Terminal states stay terminal.
            prop_assert!(!was_terminal || a.is_terminal());
            // The phase is set exactly while running.
            prop_assert_eq!(a.phase.is_some(), a.status == Status::Running);
        }
        prop_assert!(terminal_events <= 1);
        prop_assert_eq!(terminal_events == 1, a.is_terminal());
    }
}

// ---- guards: scopes, argument rules, projection ----

/// `Catalog` plus guards: `unsafe_tool` needs `deploy:prod` (refused calls go back to the
/// model), `idem` needs `admin` (a safety stop), `echo` refuses `/text` = "rm -rf" and confines
/// `/path` to `/srv`, `gate` refuses `/text` = "x", `recon` shows the model only `/id`.
struct Guarded {
    guards: std::collections::HashMap<&'static str, Guard>,
}

impl Guarded {
    fn new() -> Self {
        use crate::run::guard::{DenyRule, GuardConfig, PathRule};
        let deny = |pointer: &str, v: Value| DenyRule {
            pointer: pointer.into(),
            equals: None,
            one_of: Some(vec![v]),
            prefix: None,
            regex: None,
            max_length: None,
        };
        let g = |c: GuardConfig| Guard::new(&c).unwrap();
        let mut guards = std::collections::HashMap::new();
        guards.insert(
            "unsafe_tool",
            g(GuardConfig {
                permissions: vec!["deploy:prod".into()],
                ..GuardConfig::default()
            }),
        );
        guards.insert(
            "idem",
            g(GuardConfig {
                permissions: vec!["admin".into()],
                on_permission_denied: OnPermissionDenied::Stop,
                ..GuardConfig::default()
            }),
        );
        guards.insert(
            "echo",
            g(GuardConfig {
                deny: vec![deny("/text", json!("rm -rf"))],
                paths: vec![PathRule {
                    pointer: "/path".into(),
                    root: "/srv".into(),
                }],
                ..GuardConfig::default()
            }),
        );
        guards.insert(
            "gate",
            g(GuardConfig {
                deny: vec![deny("/text", json!("x"))],
                ..GuardConfig::default()
            }),
        );
        guards.insert(
            "recon",
            g(GuardConfig {
                project: vec!["/id".into()],
                ..GuardConfig::default()
            }),
        );
        Guarded { guards }
    }
}

impl ToolCatalog for Guarded {
    fn lookup(&self, name: &str) -> ToolLookup {
        Catalog.lookup(name)
    }
    fn validate(&self, name: &str, arguments: &Value) -> Result<(), ArgumentError> {
        Catalog.validate(name, arguments)
    }
    fn needs_approval(&self, name: &str, arguments: &Value) -> bool {
        Catalog.needs_approval(name, arguments)
    }
    fn guard(&self, name: &str) -> Option<&Guard> {
        self.guards.get(name)
    }
}

fn guarded_step(s: &mut RunState, e: RunEvent, tools: &Guarded) -> Transition {
    step(
        s,
        e,
        &StepContext {
            now_ms: 10,
            policy: &POLICY,
            tools,
        },
    )
    .unwrap()
}

fn guarded_reply(s: &mut RunState, tools: &Guarded, calls: &[(&str, &str)]) -> Transition {
    let epoch = s.epoch;
    guarded_step(
        s,
        RunEvent::ModelReplied {
            epoch,
            reply: reply_calls(calls),
        },
        tools,
    )
}

fn executes(t: &Transition) -> usize {
    t.effects
        .iter()
        .filter(|e| matches!(e, Effect::ExecuteTool { .. }))
        .count()
}

#[test]
fn a_call_needing_a_scope_the_run_lacks_is_refused_before_it_runs() {
    let tools = Guarded::new();
    for (scopes, allowed) in [
        (None, true),
        (Some(vec!["deploy".to_owned()]), true),
        (Some(vec!["deploy:prod".to_owned()]), true),
        (Some(vec!["deploy:staging".to_owned()]), false),
        (Some(vec![]), false),
    ] {
        let mut s = running();
        s.scopes = scopes.clone();
        let t = guarded_reply(&mut s, &tools, &[("unsafe_tool", "{}")]);
        if allowed {
            assert_eq!(executes(&t), 1, "{scopes:?}");
            continue;
        }
        assert_eq!(executes(&t), 0, "{scopes:?}");
        assert_eq!(t.data["calls"][0]["error"]["code"], "permission_denied");
        assert!(has_call_model(&t, ToolChoice::Auto), "the model hears why");
        assert!(matches!(
            s.messages.last(),
            Some(Message::Tool { content, .. }) if content.contains("permission_denied") && content.contains("deploy:prod")
        ));
        assert_eq!(s.status, Status::Running);
    }
}

#[test]
fn a_stop_policy_ends_the_run_before_anything_of_the_batch_runs() {
    let tools = Guarded::new();
    let mut s = running();
    s.scopes = Some(vec!["deploy".into()]);
    let t = guarded_reply(&mut s, &tools, &[("unsafe_tool", "{}"), ("idem", "{}")]);
    assert_eq!(t.kind, "run_failed");
    assert_eq!(t.data["cause"], "model_replied");
    assert_eq!(executes(&t), 0, "not even the permitted call runs");
    assert!(terminal_effects(&t));
    assert_eq!(s.error.as_ref().unwrap().code, "permission_denied");
    assert_eq!(t.data["calls"][1]["error"]["code"], "permission_denied");
}

#[test]
fn argument_rules_refuse_or_normalise_before_approval_and_execution() {
    let tools = Guarded::new();
    let mut s = running();
    let t = guarded_reply(
        &mut s,
        &tools,
        &[
            ("echo", r#"{"text":"rm -rf"}"#),
            ("echo", r#"{"path":"%2e%2e/etc"}"#),
            ("echo", r#"{"path":"./a//b"}"#),
        ],
    );
    assert_eq!(t.data["calls"][0]["error"]["code"], "argument_denied");
    assert_eq!(t.data["calls"][1]["error"]["code"], "argument_denied");
    assert_eq!(executes(&t), 1);
    let c = &s.calls[2];
    assert_eq!(c.arguments, json!({"path": "/srv/a/b"}));
    assert_eq!(
        c.key,
        idempotency_key(&s.id, 1, 2, "echo", &json!({"path": "/srv/a/b"})),
        "the key is derived from the arguments that run"
    );
    // A refused call that would need approval never reaches an operator.
    let mut s = running();
    guarded_reply(&mut s, &tools, &[("gate", r#"{"text":"x"}"#)]);
    assert_eq!(s.pending_approvals().count(), 0);
}

#[test]
fn edited_arguments_meet_the_same_rules_and_the_decider_is_recorded() {
    let tools = Guarded::new();
    let mut s = running();
    guarded_reply(&mut s, &tools, &[("gate", r#"{"text":"a"}"#)]);
    assert_eq!(s.status, Status::WaitingApproval);
    let before = s.clone();
    let refused = step(
        &mut s,
        RunEvent::Approve {
            call_id: "call_1_0".parse().unwrap(),
            arguments: Some(json!({"text": "x"})),
            by: Some("ops".into()),
        },
        &StepContext {
            now_ms: 10,
            policy: &POLICY,
            tools: &tools,
        },
    );
    assert_eq!(refused.unwrap_err().code, "invalid_argument");
    assert_eq!(s, before, "a refused edit changes nothing");
    let t = guarded_step(
        &mut s,
        RunEvent::Approve {
            call_id: "call_1_0".parse().unwrap(),
            arguments: None,
            by: Some("ops".into()),
        },
        &tools,
    );
    assert_eq!(t.data["by"], "ops");
    let mut s = running();
    guarded_reply(&mut s, &tools, &[("gate", r#"{"text":"a"}"#)]);
    let t = guarded_step(
        &mut s,
        RunEvent::Reject {
            call_id: "call_1_0".parse().unwrap(),
            reason: None,
            by: Some("night-shift".into()),
        },
        &tools,
    );
    assert_eq!(
        (t.kind, &t.data["by"]),
        ("call_rejected", &json!("night-shift"))
    );
    // Controls stored before `by` existed still read.
    let old: Control =
        serde_json::from_value(json!({"type": "approve", "call_id": "call_1_0"})).unwrap();
    assert!(matches!(
        RunEvent::from(old),
        RunEvent::Approve { by: None, .. }
    ));
}

#[test]
fn a_projected_result_reaches_the_model_cut_down_and_the_event_keeps_all_of_it() {
    let tools = Guarded::new();
    let mut s = running();
    guarded_reply(&mut s, &tools, &[("recon", "{}")]);
    let epoch = s.epoch;
    let t = guarded_step(
        &mut s,
        RunEvent::ToolFinished {
            epoch,
            call_id: "call_1_0".parse().unwrap(),
            result: ToolResult::success(json!({"id": 7, "internal": "do not show"})),
        },
        &tools,
    );
    assert_eq!(
        t.data["result"],
        json!({"id": 7, "internal": "do not show"})
    );
    let Some(Message::Tool { content, .. }) = s.messages.last() else {
        panic!("no tool message");
    };
    let seen: Value = serde_json::from_str(content).unwrap();
    assert_eq!(seen["data"], json!({"id": 7}));
    assert!(!content.contains("do not show"));
}

#[test]
fn scopes_persist_with_the_run_and_old_checkpoints_hold_every_scope() {
    let mut s = new_run();
    s.scopes = Some(vec!["deploy:staging".into()]);
    let text = serde_json::to_string(&s).unwrap();
    let back: RunState = serde_json::from_str(&text).unwrap();
    assert_eq!(back.scopes, s.scopes);
    let mut old = serde_json::to_value(new_run()).unwrap();
    old.as_object_mut().unwrap().remove("scopes");
    let old: RunState = serde_json::from_value(old).unwrap();
    assert_eq!(old.scopes, None);
}

mod long_running;
