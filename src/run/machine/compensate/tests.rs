//! The compensation rows of the transition table, and a property test: over random event
//! sequences, each compensation is sent at most once (again only after a crash, with the same
//! key, to a tool that may repeat it), newest first, and the run ends only after all of them.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::LazyLock;

use proptest::prelude::*;
use serde_json::{Value, json};

use super::super::*;
use crate::ids::RunId;
use crate::model::{ModelToolCall, TokenUsage};
use crate::run::budget::Budget;
use crate::run::state::{CompensationStatus as C, Ending};
use crate::tool::{Compensate, ToolError};

/// Tools: `restart` (unsafe; undone by `undo`, idempotent, which requires a string
/// `service`), `deploy` (unsafe; undone by `undo_unsafe`, unsafe), `charge` (unsafe; undone
/// by `refund`, unsafe and reconcilable), `echo` (read, nothing to undo).
struct Cat {
    restart: Compensate,
    deploy: Compensate,
    charge: Compensate,
}

static CAT: LazyLock<Cat> = LazyLock::new(|| {
    let rule = |tool: &str, args: Value| {
        let m: BTreeMap<String, Value> = serde_json::from_value(args).unwrap();
        Compensate::parse(tool, &m).unwrap()
    };
    Cat {
        restart: rule(
            "undo",
            json!({"service": "/service", "why": {"value": "compensation"}}),
        ),
        deploy: rule("undo_unsafe", json!({"service": "/service"})),
        charge: rule("refund", json!({"all": ""})),
    }
});

fn info(effect: ToolEffect, reconcilable: bool) -> ToolInfo {
    ToolInfo {
        effect,
        polling: false,
        reconcilable,
    }
}

impl ToolCatalog for Cat {
    fn lookup(&self, name: &str) -> ToolLookup {
        match name {
            "restart" | "deploy" | "charge" => ToolLookup::Allowed(info(ToolEffect::Unsafe, false)),
            "echo" => ToolLookup::Allowed(info(ToolEffect::Read, false)),
            _ => ToolLookup::Unknown,
        }
    }

    fn validate(&self, name: &str, arguments: &Value) -> Result<(), ArgumentError> {
        if name == "undo" && !arguments.get("service").is_some_and(Value::is_string) {
            return Err(ArgumentError {
                path: "/service".into(),
                message: "required string".into(),
            });
        }
        Ok(())
    }

    fn needs_approval(&self, _name: &str, _arguments: &Value) -> bool {
        false
    }

    fn compensation(&self, name: &str) -> Option<CompensationPlan<'_>> {
        let (rule, info) = match name {
            "restart" => (&self.restart, info(ToolEffect::Idempotent, false)),
            "deploy" => (&self.deploy, info(ToolEffect::Unsafe, false)),
            "charge" => (&self.charge, info(ToolEffect::Unsafe, true)),
            _ => return None,
        };
        Some(CompensationPlan {
            rule,
            info,
            guard: None,
        })
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
    progress: crate::run::progress::ProgressPolicy {
        repeat_limit: 3,
        failure_limit: 3,
        stale_turn_limit: 0,
    },
};

fn cx() -> StepContext<'static> {
    StepContext {
        now_ms: 10,
        policy: &POLICY,
        tools: &*CAT,
    }
}

fn go(s: &mut RunState, e: RunEvent) -> Transition {
    step(s, e, &cx()).unwrap()
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

fn calls(list: &[(&str, Value)]) -> ModelReply {
    ModelReply {
        text: None,
        tool_calls: list
            .iter()
            .enumerate()
            .map(|(i, (n, a))| ModelToolCall {
                id: format!("m{i}"),
                name: (*n).into(),
                arguments: a.to_string(),
            })
            .collect(),
        usage: TokenUsage {
            input_tokens: 1,
            output_tokens: 1,
        },
    }
}

fn ok() -> ToolResult {
    ToolResult::success(json!({"fine": true}))
}

fn err(code: ToolErrorCode) -> ToolResult {
    ToolResult::failure(ToolError::new(code, "x"))
}

fn finished(s: &mut RunState, call: &str, result: ToolResult) -> Transition {
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

/// A running run whose turns 1 and 2 each ran one successful call: `first` then `second`.
fn after_two(first: (&str, Value), second: (&str, Value)) -> RunState {
    let mut s = new_run();
    go(&mut s, RunEvent::Start);
    for (turn, call) in [(1, first), (2, second)] {
        let epoch = s.epoch;
        go(
            &mut s,
            RunEvent::ModelReplied {
                epoch,
                reply: calls(&[call]),
            },
        );
        finished(&mut s, &format!("call_{turn}_0"), ok());
    }
    assert_eq!(s.phase, Some(Phase::AwaitingModel));
    s
}

fn two_restarts() -> RunState {
    after_two(
        ("restart", json!({"service": "api"})),
        ("restart", json!({"service": "db"})),
    )
}

fn sent(t: &Transition) -> Vec<String> {
    t.effects
        .iter()
        .filter_map(|e| match e {
            Effect::Compensate { call_id, .. } => Some(call_id.to_string()),
            _ => None,
        })
        .collect()
}

fn cancel() -> RunEvent {
    RunEvent::Cancel { reason: None }
}

#[test]
fn a_successful_call_records_its_compensation_with_mapped_arguments_and_a_derived_key() {
    let s = two_restarts();
    assert_eq!(s.compensations.len(), 2);
    let k = &s.compensations[0];
    assert_eq!(k.call_id.as_str(), "call_1_0_undo");
    assert_eq!(k.for_call.as_str(), "call_1_0");
    assert_eq!((k.tool.as_str(), k.for_tool.as_str()), ("undo", "restart"));
    assert_eq!(
        k.arguments,
        json!({"service": "api", "why": "compensation"})
    );
    let original = idempotency_key(&s.id, 1, 0, "restart", &json!({"service": "api"}));
    assert_eq!(k.key, crate::idempotency::compensation_key(&original));
    assert_ne!(k.key, original);
    assert_eq!((k.status, k.effect), (C::Pending, ToolEffect::Idempotent));
    // A read call, and a failed call, record nothing.
    let mut s = after_two(("echo", json!({})), ("restart", json!({"service": "x"})));
    assert_eq!(s.compensations.len(), 1);
    let epoch = s.epoch;
    go(
        &mut s,
        RunEvent::ModelReplied {
            epoch,
            reply: calls(&[("restart", json!({"service": "y"}))]),
        },
    );
    finished(&mut s, "call_3_0", err(ToolErrorCode::Failed));
    assert_eq!(s.compensations.len(), 1);
}

#[test]
fn cancel_after_two_calls_compensates_newest_first_then_ends_cancelled() {
    let mut s = two_restarts();
    let t = go(&mut s, cancel());
    assert_eq!(t.kind, "compensation_started");
    assert_eq!(t.data["cause"], "run_cancelled");
    assert_eq!(t.data["ending"]["status"], "cancelled");
    assert_eq!(
        (s.status, s.phase),
        (Status::Running, Some(Phase::Compensating))
    );
    assert_eq!(t.data["status"], "running");
    assert_eq!(t.data["phase"], "compensating");
    assert!(t.effects.contains(&Effect::AbortInFlight));
    assert!(!t.effects.contains(&Effect::Finish));
    // The second call is undone first; its intent is in this very commit.
    assert_eq!(sent(&t), ["call_2_0_undo"]);
    assert_eq!(
        t.data["dispatched"][0]["key"],
        json!(s.compensations[1].key)
    );
    assert_eq!(s.compensations[1].status, C::Dispatched);
    assert_eq!(s.compensations[0].status, C::Pending);

    let t = finished(&mut s, "call_2_0_undo", ok());
    assert_eq!(t.kind, "compensation_finished");
    assert_eq!(t.data["outcome"], "done");
    assert_eq!(sent(&t), ["call_1_0_undo"]);
    assert_eq!(s.phase, Some(Phase::Compensating));

    let t = finished(&mut s, "call_1_0_undo", ok());
    assert_eq!(t.kind, "run_cancelled");
    assert_eq!(t.data["cause"], "compensation_finished");
    assert_eq!(t.effects, vec![Effect::Finish]);
    assert_eq!(s.status, Status::Cancelled);
    assert_eq!(s.phase, None);
    assert!(s.ending.is_none());
    assert!(s.compensations.iter().all(|k| k.status == C::Done));
    assert_eq!(t.data["compensations"].as_array().unwrap().len(), 2);
    // Late: ignored.
    let t = finished(&mut s, "call_1_0_undo", ok());
    assert_eq!(t.kind, "late_result_ignored");
}

#[test]
fn a_failure_ends_failed_after_the_compensations_with_its_error() {
    let mut s = two_restarts();
    let epoch = s.epoch;
    let t = go(
        &mut s,
        RunEvent::ModelFailed {
            epoch,
            error: crate::model::ModelError::new(crate::model::ModelErrorKind::Unavailable, "down"),
        },
    );
    assert_eq!(t.kind, "compensation_started");
    assert_eq!(t.data["cause"], "model_failed");
    assert_eq!(t.data["ending"]["error"]["code"], "model_unavailable");
    // The error is the ending's until the run ends.
    assert!(s.error.is_none());
    finished(&mut s, "call_2_0_undo", ok());
    let t = finished(&mut s, "call_1_0_undo", ok());
    assert_eq!(t.kind, "run_failed");
    assert_eq!(s.status, Status::Failed);
    assert_eq!(s.error.as_ref().unwrap().code, "model_unavailable");
    assert_eq!(t.data["error"]["code"], "model_unavailable");
}

#[test]
fn a_failing_compensation_is_recorded_failed_and_the_others_still_run() {
    let mut s = two_restarts();
    go(&mut s, cancel());
    let t = finished(&mut s, "call_2_0_undo", err(ToolErrorCode::Failed));
    assert_eq!(t.data["outcome"], "failed");
    assert_eq!(sent(&t), ["call_1_0_undo"]);
    let t = finished(&mut s, "call_1_0_undo", ok());
    assert_eq!(t.kind, "run_cancelled");
    assert_eq!(s.compensations[1].status, C::Failed);
    assert_eq!(
        s.compensations[1].result.as_ref().unwrap().error_code(),
        Some(ToolErrorCode::Failed)
    );
    assert_eq!(s.compensations[0].status, C::Done);
}

#[test]
fn an_overloaded_compensation_is_sent_again_after_a_backoff_then_given_up() {
    let mut s = two_restarts();
    go(&mut s, cancel());
    let t = finished(&mut s, "call_2_0_undo", err(ToolErrorCode::Overloaded));
    assert!(matches!(t.effects[..], [Effect::ScheduleRetry { .. }]));
    assert_eq!(s.compensations[1].status, C::Pending);
    let epoch = s.epoch;
    let t = go(&mut s, RunEvent::RetryDue { epoch });
    assert_eq!(t.kind, "compensation_retry");
    assert_eq!(sent(&t), ["call_2_0_undo"]);
    assert_eq!(s.compensations[1].attempts, 2);
    // Past the policy's tool retries (1): failed, not an endless loop.
    let t = finished(&mut s, "call_2_0_undo", err(ToolErrorCode::Overloaded));
    assert_eq!(t.data["outcome"], "failed");
    assert_eq!(sent(&t), ["call_1_0_undo"]);
}

#[test]
fn a_timeout_resends_an_idempotent_compensation_with_the_same_key_a_bounded_number_of_times() {
    let mut s = two_restarts();
    go(&mut s, cancel());
    let key = s.compensations[1].key.clone();
    let t = finished(&mut s, "call_2_0_undo", err(ToolErrorCode::Timeout));
    assert_eq!(sent(&t), ["call_2_0_undo"]);
    assert_eq!(t.data["dispatched"][0]["key"], json!(key));
    let t = finished(&mut s, "call_2_0_undo", err(ToolErrorCode::Timeout));
    assert_eq!(t.data["outcome"], "outcome_unknown");
    assert_eq!(sent(&t), ["call_1_0_undo"]);
}

#[test]
fn resume_resends_an_idempotent_compensation_with_its_key_and_never_repeats_a_finished_one() {
    let mut s = two_restarts();
    go(&mut s, cancel());
    finished(&mut s, "call_2_0_undo", ok());
    let key = s.compensations[0].key.clone();
    let t = go(&mut s, RunEvent::Resume);
    assert_eq!(t.kind, "run_resumed");
    assert_eq!(sent(&t), ["call_1_0_undo"]);
    assert_eq!(t.data["dispatched"][0]["key"], json!(key));
    assert_eq!(s.compensations[1].status, C::Done);
    // The old incarnation's reply is stale.
    let stale = s.epoch - 1;
    let t = finished_at(&mut s, stale, "call_1_0_undo", ok());
    assert_eq!(t.kind, "late_result_ignored");
    let t = finished(&mut s, "call_1_0_undo", ok());
    assert_eq!(t.kind, "run_cancelled");
}

fn finished_at(s: &mut RunState, epoch: u64, call: &str, result: ToolResult) -> Transition {
    go(
        s,
        RunEvent::ToolFinished {
            epoch,
            call_id: call.parse().unwrap(),
            result,
        },
    )
}

#[test]
fn resume_parks_an_unsafe_compensation_in_flight_and_reconciles_a_reconcilable_one() {
    let mut s = after_two(
        ("deploy", json!({"service": "api"})),
        ("charge", json!({"amount": 5})),
    );
    assert_eq!(s.compensations[1].arguments, json!({"all": {"amount": 5}}));
    go(&mut s, cancel());
    // `refund` (reconcilable) in flight at the crash: asked, not resent.
    let t = go(&mut s, RunEvent::Resume);
    assert!(matches!(t.effects[..], [Effect::CheckCompensation { .. }]));
    assert_eq!(s.compensations[1].status, C::Reconciling);
    let epoch = s.epoch;
    let t = go(
        &mut s,
        RunEvent::StatusChecked {
            epoch,
            call_id: "call_2_0_undo".parse().unwrap(),
            outcome: Ok(Some(ok())),
        },
    );
    assert_eq!(t.kind, "compensation_reconciled");
    assert_eq!(s.compensations[1].status, C::Done);
    assert_eq!(sent(&t), ["call_1_0_undo"]);
    // `undo_unsafe` in flight at the crash: never sent blindly again.
    let t = go(&mut s, RunEvent::Resume);
    assert_eq!(t.kind, "run_cancelled");
    assert_eq!(
        t.data["compensations_outcome_unknown"],
        json!(["call_1_0_undo"])
    );
    assert_eq!(s.compensations[0].status, C::OutcomeUnknown);
    assert!(sent(&t).is_empty());
}

#[test]
fn while_compensating_cancel_repeats_other_controls_are_refused_and_the_deadline_waits() {
    let mut s = two_restarts();
    go(&mut s, cancel());
    let before = s.clone();
    assert_eq!(
        apply_control(
            &mut s,
            1,
            crate::store::Control::Cancel { reason: None },
            &cx()
        ),
        ControlStep::Repeated
    );
    let e = step(&mut s, RunEvent::Input { text: "x".into() }, &cx()).unwrap_err();
    assert_eq!(e.code, "invalid_state");
    let t = go(&mut s, RunEvent::DeadlineReached);
    assert_eq!(t.kind, "late_result_ignored");
    assert_eq!(s.phase, before.phase);
    assert_eq!(s.compensations, before.compensations);
    // A run ending `failed` refuses a cancel instead.
    let mut f = two_restarts();
    go(&mut f, RunEvent::DeadlineReached);
    assert_eq!(f.ending.as_ref().unwrap().status, Status::Failed);
    assert!(step(&mut f, cancel(), &cx()).is_err());
}

#[test]
fn abort_while_compensating_ends_failed_and_records_what_was_not_undone() {
    let mut s = two_restarts();
    go(&mut s, cancel());
    let t = go(
        &mut s,
        RunEvent::Abort {
            code: "crash_loop".into(),
            message: "m".into(),
        },
    );
    assert_eq!(t.kind, "run_failed");
    assert!(t.effects.contains(&Effect::Finish));
    assert_eq!(s.compensations[1].status, C::OutcomeUnknown);
    assert_eq!(s.compensations[0].status, C::Skipped);
    assert_eq!(s.error.as_ref().unwrap().code, "crash_loop");
}

#[test]
fn a_succeeded_run_compensates_nothing() {
    let mut s = two_restarts();
    let epoch = s.epoch;
    go(
        &mut s,
        RunEvent::ModelReplied {
            epoch,
            reply: ModelReply {
                text: Some("done".into()),
                ..Default::default()
            },
        },
    );
    let epoch = s.epoch;
    let t = go(
        &mut s,
        RunEvent::VerificationDone {
            epoch,
            verdict: Ok(()),
        },
    );
    assert_eq!(t.kind, "run_succeeded");
    assert!(s.compensations.is_empty());
}

#[test]
fn a_call_in_flight_at_the_end_and_refused_arguments_are_skipped() {
    let mut s = new_run();
    go(&mut s, RunEvent::Start);
    let epoch = s.epoch;
    // `undo` requires /service: the first call's compensation cannot be made.
    go(
        &mut s,
        RunEvent::ModelReplied {
            epoch,
            reply: calls(&[
                ("restart", json!({"name": "api"})),
                ("deploy", json!({"service": "b"})),
            ]),
        },
    );
    finished(&mut s, "call_1_0", ok());
    assert_eq!(s.compensations[0].status, C::Skipped);
    assert!(
        s.compensations[0]
            .reason
            .as_ref()
            .unwrap()
            .contains("/service")
    );
    // `deploy` is still in flight: nothing to run, the run ends at once, and says so.
    let t = go(&mut s, cancel());
    assert_eq!(t.kind, "run_cancelled");
    assert_eq!(s.compensations.len(), 2);
    assert_eq!(s.compensations[1].status, C::Skipped);
    assert_eq!(t.data["compensations"][1]["for_call"], "call_1_1");
}

#[test]
fn a_long_running_call_is_undone_once_its_result_came_and_skipped_while_it_is_awaited() {
    let mut s = new_run();
    go(&mut s, RunEvent::Start);
    let epoch = s.epoch;
    go(
        &mut s,
        RunEvent::ModelReplied {
            epoch,
            reply: calls(&[
                ("restart", json!({"service": "api"})),
                ("restart", json!({"service": "db"})),
            ]),
        },
    );
    for call in ["call_1_0", "call_1_1"] {
        let epoch = s.epoch;
        go(
            &mut s,
            RunEvent::ToolAccepted {
                epoch,
                call_id: call.parse().unwrap(),
                status_url: Some("http://t/status".into()),
                timeout_ms: 1_000,
            },
        );
    }
    let epoch = s.epoch;
    go(
        &mut s,
        RunEvent::ToolPolled {
            epoch,
            call_id: "call_1_0".parse().unwrap(),
            result: ok(),
        },
    );
    assert_eq!(s.compensations.len(), 1);
    assert_eq!(s.compensations[0].status, C::Pending);
    let t = go(&mut s, cancel());
    assert_eq!(t.kind, "compensation_started");
    assert_eq!(sent(&t), ["call_1_0_undo"]);
    // The call still awaited has no known outcome: not undone, and the record says so.
    assert_eq!(s.compensations[1].for_call.as_str(), "call_1_1");
    assert_eq!(s.compensations[1].status, C::Skipped);
    let t = finished(&mut s, "call_1_0_undo", ok());
    assert_eq!(t.kind, "run_cancelled");
}

#[test]
fn an_ending_is_kept_in_the_checkpoint() {
    let mut s = two_restarts();
    go(&mut s, cancel());
    let body = serde_json::to_string(&s).unwrap();
    let back: RunState = serde_json::from_str(&body).unwrap();
    assert_eq!(back, s);
    assert_eq!(
        back.ending,
        Some(Ending {
            status: Status::Cancelled,
            error: None
        })
    );
}

// ---- property ----

/// What happens next, resolved against the run when it is applied (`resolve`), so random
/// sequences actually reach and go through the compensating phase.
#[derive(Debug, Clone)]
enum Act {
    /// The model asks for one call of this tool.
    Reply(&'static str, &'static str),
    /// The call or compensation in flight finishes with this result (`stale`: with the
    /// previous epoch).
    Finish(ToolResult, bool),
    /// The reconciling call or compensation is answered.
    Checked(Option<ToolResult>),
    Retry,
    Resume,
    Cancel,
    Deadline,
    ModelDown,
    Abort,
}

fn arb_act() -> impl Strategy<Value = Act> {
    let tool = prop::sample::select(vec!["restart", "deploy", "charge", "restart", "echo"]);
    let service = prop::sample::select(vec!["a", "b"]);
    let code = prop::sample::select(vec![
        ToolErrorCode::Timeout,
        ToolErrorCode::OutcomeUnknown,
        ToolErrorCode::Overloaded,
        ToolErrorCode::Failed,
    ]);
    let result = prop_oneof![3 => Just(ok()), 1 => code.prop_map(err)];
    prop_oneof![
        4 => (tool, service).prop_map(|(t, v)| Act::Reply(t, v)),
        8 => (result.clone(), prop::bool::weighted(0.1)).prop_map(|(r, stale)| Act::Finish(r, stale)),
        1 => prop::option::of(result).prop_map(Act::Checked),
        1 => Just(Act::Retry),
        1 => Just(Act::Resume),
        // Ends, rarer, so that most sequences get some calls done first.
        1 => prop_oneof![
            3 => Just(Act::Cancel),
            2 => Just(Act::Deadline),
            2 => Just(Act::ModelDown),
            1 => Just(Act::Abort),
        ],
    ]
}

/// The call or compensation in `status`-like state: the batch's, then the compensations'.
fn in_flight(s: &RunState, reconciling: bool) -> Option<CallId> {
    let want_call = if reconciling {
        CallStatus::Reconciling
    } else {
        CallStatus::Dispatched
    };
    let want_comp = if reconciling {
        C::Reconciling
    } else {
        C::Dispatched
    };
    s.calls
        .iter()
        .find(|c| c.status == want_call)
        .map(|c| c.call_id.clone())
        .or_else(|| {
            s.compensations
                .iter()
                .find(|k| k.status == want_comp)
                .map(|k| k.call_id.clone())
        })
}

fn resolve(s: &RunState, a: Act) -> RunEvent {
    let epoch = s.epoch;
    let fallback: CallId = "call_1_0".parse().unwrap();
    match a {
        Act::Reply(tool, service) => RunEvent::ModelReplied {
            epoch,
            reply: calls(&[(tool, json!({"service": service}))]),
        },
        Act::Finish(result, stale) => RunEvent::ToolFinished {
            epoch: if stale {
                epoch.saturating_sub(1)
            } else {
                epoch
            },
            call_id: in_flight(s, false).unwrap_or(fallback),
            result,
        },
        Act::Checked(r) => RunEvent::StatusChecked {
            epoch,
            call_id: in_flight(s, true).unwrap_or(fallback),
            outcome: Ok(r),
        },
        Act::Retry => RunEvent::RetryDue { epoch },
        Act::Resume => RunEvent::Resume,
        Act::Cancel => RunEvent::Cancel { reason: None },
        Act::Deadline => RunEvent::DeadlineReached,
        Act::ModelDown => RunEvent::ModelFailed {
            epoch,
            error: crate::model::ModelError::new(crate::model::ModelErrorKind::Unavailable, "down"),
        },
        Act::Abort => RunEvent::Abort {
            code: "crash_loop".into(),
            message: "m".into(),
        },
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn compensations_run_at_most_once_each_newest_first(acts in prop::collection::vec(arb_act(), 1..80)) {
        let mut s = new_run();
        go(&mut s, RunEvent::Start);
        // Sends per compensation, and whether the previous send of it was cut off by a resume.
        let mut sends: std::collections::HashMap<String, (u32, bool)> = Default::default();
        let mut order: Vec<String> = Vec::new();
        let mut terminal = 0;
        for a in acts {
            let e = resolve(&s, a);
            let resume = matches!(e, RunEvent::Resume);
            let was_terminal = s.is_terminal();
            let before = s.clone();
            let Ok(t) = step(&mut s, e, &cx()) else {
                prop_assert_eq!(&s, &before);
                continue;
            };
            if matches!(t.kind, "run_succeeded" | "run_failed" | "run_cancelled") {
                terminal += 1;
                prop_assert!(!was_terminal);
                // The run ends only when every compensation is over.
                prop_assert!(s.compensations.iter().all(|k| k.status.is_final()));
            }
            if resume {
                for k in &before.compensations {
                    if k.status == C::Dispatched
                        && let Some(v) = sends.get_mut(k.call_id.as_str())
                    {
                        v.1 = true;
                    }
                }
            }
            for e in &t.effects {
                let Effect::Compensate { call_id, .. } = e else { continue };
                let k = s.compensations.iter().find(|k| &k.call_id == call_id).unwrap();
                let entry = sends.entry(call_id.to_string()).or_insert((0, false));
                if entry.0 > 0 {
                    // Sent again: only to a tool that may repeat it (same key), or when the
                    // pool never started it (`overloaded`: pending) or its status check said
                    // it never ran (reconciling).
                    let before_k = before.compensations.iter().find(|b| b.call_id == k.call_id).unwrap();
                    prop_assert!(
                        k.effect != ToolEffect::Unsafe
                            || matches!(before_k.status, C::Pending | C::Reconciling),
                        "an unsafe compensation was sent blindly again: {:?}", before_k
                    );
                } else {
                    order.push(call_id.to_string());
                }
                entry.0 += 1;
                entry.1 = false;
                prop_assert!(!was_terminal);
            }
            // At most one compensation in flight.
            prop_assert!(s.compensations.iter().filter(|k| matches!(k.status, C::Dispatched | C::Reconciling)).count() <= 1);
            prop_assert_eq!(s.phase.is_some(), s.status == Status::Running);
        }
        prop_assert!(terminal <= 1);
        // First sends follow reverse order of recording.
        let recorded: Vec<String> = s.compensations.iter().map(|k| k.call_id.to_string()).collect();
        let positions: Vec<usize> = order
            .iter()
            .map(|c| recorded.iter().position(|r| r == c).unwrap())
            .collect();
        prop_assert!(positions.windows(2).all(|w| w[0] > w[1]), "{:?} of {:?}", order, recorded);
        // Bounded sends: a compensation is sent at most 1 + retries + resumes times.
        for (c, (n, _)) in &sends {
            let k = s.compensations.iter().find(|k| k.call_id.as_str() == c).unwrap();
            prop_assert!(*n >= 1 && k.attempts >= 1);
        }
    }
}
