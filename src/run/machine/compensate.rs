//! Compensation: undoing a run's successful calls when it ends `cancelled` or `failed`.
//!
//! A successful call of a tool with a `compensate` rule records its compensating call at once
//! (`record`: arguments mapped from the original call's, validated against the compensating
//! tool's schema and its deny and path rules — a call refused there is `skipped` — and a key
//! derived from the original call's key). When a transition would end the run `cancelled` or
//! `failed` while some compensation is `pending`, `on_end` keeps the run `running` in phase
//! `compensating` instead, with the end it was heading for in `RunState::ending`, and records
//! `compensation_started` (the would-be terminal type as `cause`). The compensations then run
//! one at a time, newest first (reverse order of the original calls' completion), each with
//! its intent committed before it is sent. When the last one is over, the run ends as
//! recorded: its terminal event comes after every compensation, so there is still exactly one.
//!
//! While compensating, budgets and the deadline do not apply, a repeated `cancel` is
//! answered like the first (the end is `cancelled` anyway), other controls are refused, and an
//! `Abort` (the supervisor's `crash_loop`) ends the run `failed` at once, the compensations
//! not yet run recorded `skipped` (or `outcome_unknown` for one in flight). A compensation's
//! result: success `done`; `overloaded` (the pool was full) is sent again after a backoff, up
//! to the policy's tool retries; a timeout or unknown outcome of an `idempotent` tool is sent
//! again with the same key (as many times), of a reconcilable tool is reconciled through its
//! status check, of any other `outcome_unknown`; any other error `failed` (the executor has
//! already retried transient errors of `read` and `idempotent` tools by class). After a crash
//! (`Resume`), a compensation in flight is sent again with the same key if its tool is `read`
//! or `idempotent`, reconciled if it can be, and otherwise recorded `outcome_unknown`; never
//! sent blindly a second time, and one that is over is never sent again.

use serde_json::{Value, json};

use super::{
    Effect, InvalidTransition, Phase, RunEvent, RunState, StepContext, Transition, backoff_ms,
    bounded, ignored, invalid, out,
};
use crate::idempotency::compensation_key;
use crate::ids::CallId;
use crate::run::state::{CallStatus, Compensation, CompensationStatus as C, Ending, Status};
use crate::tool::{ToolEffect, ToolErrorCode, ToolResult};

/// After a call settled: if it succeeded and its tool has a `compensate` rule, records its
/// compensating call (`pending`, or `skipped` when its arguments are refused).
pub(super) fn record(s: &mut RunState, call_id: &CallId, cx: &StepContext<'_>) {
    let Some(c) = s.call(call_id) else {
        return;
    };
    if c.status != CallStatus::Done || !c.result.as_ref().is_some_and(|r| r.ok) {
        return;
    }
    if s.compensations.iter().any(|k| &k.for_call == call_id) {
        return;
    }
    let Some(plan) = cx.tools.compensation(&c.tool) else {
        return;
    };
    let mut arguments = plan.rule.arguments_for(&c.arguments);
    let mut reason = cx
        .tools
        .validate(&plan.rule.tool, &arguments)
        .err()
        .map(|e| {
            format!(
                "its arguments do not fit the tool `{}` at `{}`: {}",
                plan.rule.tool,
                if e.path.is_empty() { "/" } else { &e.path },
                e.message
            )
        });
    if reason.is_none()
        && let Some(g) = plan.guard
    {
        let mut checked = arguments.clone();
        match g.check_arguments(&mut checked) {
            Ok(()) => arguments = checked,
            Err(e) => reason = Some(format!("refused by policy: {}", e.message)),
        }
    }
    let k = Compensation {
        call_id: call_id.compensation(),
        for_call: call_id.clone(),
        for_tool: c.tool.clone(),
        tool: plan.rule.tool.clone(),
        arguments,
        key: compensation_key(&c.key),
        effect: plan.info.effect,
        reconcilable: plan.info.reconcilable,
        status: if reason.is_some() {
            C::Skipped
        } else {
            C::Pending
        },
        attempts: 0,
        result: None,
        reason,
    };
    s.compensations.push(k);
}

/// A transition (not in the compensating phase) ended the run. A succeeded run needs no
/// compensation (its list is cleared); a cancelled or failed one with pending compensations
/// starts them instead of ending now.
pub(super) fn on_end(s: &mut RunState, t: &mut Transition, cx: &StepContext<'_>) {
    if s.status == Status::Succeeded {
        s.compensations.clear();
        return;
    }
    // Compensable calls in flight (or unknown) when the run ended: whether they ran is not
    // known, so they are not undone; the record says so.
    let unknown: Vec<Compensation> = s
        .calls
        .iter()
        .filter(|c| {
            matches!(
                c.status,
                CallStatus::Dispatched
                    | CallStatus::AwaitingResult
                    | CallStatus::Reconciling
                    | CallStatus::OutcomeUnknown
            )
        })
        .filter_map(|c| {
            let plan = cx.tools.compensation(&c.tool)?;
            Some(Compensation {
                call_id: c.call_id.compensation(),
                for_call: c.call_id.clone(),
                for_tool: c.tool.clone(),
                tool: plan.rule.tool.clone(),
                arguments: plan.rule.arguments_for(&c.arguments),
                key: compensation_key(&c.key),
                effect: plan.info.effect,
                reconcilable: plan.info.reconcilable,
                status: C::Skipped,
                attempts: 0,
                result: None,
                reason: Some(
                    "the call was in flight when the run ended: whether it ran is unknown".into(),
                ),
            })
        })
        .collect();
    s.compensations.extend(unknown);
    if !s.compensations.iter().any(|k| k.status == C::Pending) {
        if !s.compensations.is_empty() {
            set(t, "compensations", summary(s));
        }
        return;
    }
    s.ending = Some(Ending {
        status: s.status,
        error: s.error.take(),
    });
    s.status = Status::Running;
    s.phase = Some(Phase::Compensating);
    t.effects.retain(|e| !matches!(e, Effect::Finish));
    let cause = t.kind;
    set(t, "cause", json!(cause));
    t.kind = "compensation_started";
    set(t, "ending", json!(s.ending));
    let effects = advance(s);
    t.effects.extend(effects);
    set(t, "compensations", summary(s));
    add_dispatched(s, t);
}

/// Every event of a run in the compensating phase.
pub(super) fn dispatch(
    s: &mut RunState,
    event: RunEvent,
    cx: &StepContext<'_>,
) -> Result<Transition, InvalidTransition> {
    use RunEvent as E;
    let ending = s.ending.as_ref().map_or("failed", |e| e.status.as_str());
    match event {
        E::Resume => {
            s.restarts += 1;
            Ok(resume(s))
        }
        E::Abort { code, message } => {
            for k in s.compensations.iter_mut() {
                match k.status {
                    C::Pending => {
                        k.status = C::Skipped;
                        k.reason = Some(format!("the run was aborted ({code}) first"));
                    }
                    C::Dispatched | C::Reconciling => k.status = C::OutcomeUnknown,
                    _ => {}
                }
            }
            s.ending = None;
            s.status = Status::Failed;
            s.phase = None;
            s.error = Some(crate::run::state::RunError { code, message });
            s.epoch += 1;
            Ok(out(
                "run_failed",
                json!({ "compensations": summary(s) }),
                vec![Effect::AbortInFlight, Effect::Finish],
            ))
        }
        E::ToolFinished {
            epoch,
            call_id,
            result,
        } if epoch == s.epoch && status_of(s, &call_id) == Some(C::Dispatched) => {
            Ok(on_finished(s, call_id, result, cx))
        }
        E::ToolRetrying {
            epoch,
            call_id,
            attempt,
            error,
            wait_ms,
        } if epoch == s.epoch && status_of(s, &call_id) == Some(C::Dispatched) => {
            let tool = find(s, &call_id).map(|k| k.tool.clone());
            Ok(out(
                "compensation_retrying",
                json!({
                    "call_id": call_id,
                    "tool": tool,
                    "attempt": attempt,
                    "error": { "code": error.code, "message": bounded(&error.message) },
                    "wait_ms": wait_ms,
                }),
                vec![],
            ))
        }
        E::StatusChecked {
            epoch,
            call_id,
            outcome,
        } if epoch == s.epoch && status_of(s, &call_id) == Some(C::Reconciling) => {
            let found = match &outcome {
                Ok(Some(_)) => "ran",
                Ok(None) => "never_ran",
                Err(_) => "unknown",
            };
            if let Some(k) = find_mut(s, &call_id) {
                match outcome {
                    Ok(Some(result)) => {
                        k.status = if result.ok { C::Done } else { C::Failed };
                        k.result = Some(result);
                    }
                    // It never ran: sending it now (same key) is its first execution.
                    Ok(None) => k.status = C::Pending,
                    Err(_) => k.status = C::OutcomeUnknown,
                }
            }
            let effects = advance(s);
            let mut t = out(
                "compensation_reconciled",
                json!({ "call_id": call_id, "found": found }),
                effects,
            );
            add_dispatched(s, &mut t);
            Ok(t)
        }
        E::RetryDue { epoch } if epoch == s.epoch => {
            let effects = advance(s);
            let mut t = out("compensation_retry", json!({}), effects);
            add_dispatched(s, &mut t);
            Ok(t)
        }
        // Budgets do not block compensation: the deadline changes nothing now.
        E::DeadlineReached => Ok(ignored(&E::DeadlineReached, "compensating")),
        ev if ev.is_reply() => Ok(ignored(&ev, "stale")),
        ev => Err(invalid(
            s,
            "invalid_state",
            format!(
                "the run is ending {ending} and is running its compensations; it accepts no {}",
                ev.name()
            ),
        )),
    }
}

fn on_finished(
    s: &mut RunState,
    call_id: CallId,
    result: ToolResult,
    cx: &StepContext<'_>,
) -> Transition {
    let max_retries = cx.policy.max_tool_retries;
    let epoch = s.epoch;
    let Some(k) = find_mut(s, &call_id) else {
        return ignored(&RunEvent::Start, "unknown_call");
    };
    let mut data = json!({
        "call_id": call_id, "for_call": k.for_call, "tool": k.tool, "ok": result.ok,
        "attempt": k.attempts,
    });
    if let (Value::Object(m), Some(e)) = (&mut data, &result.error) {
        m.insert("error".into(), json!(e));
    }
    let retries_left = k.attempts <= max_retries;
    match result.error_code() {
        None => {
            k.status = C::Done;
            k.result = Some(result);
        }
        Some(ToolErrorCode::Overloaded) if retries_left => {
            // Not started: send again later with the same key.
            k.status = C::Pending;
            let after_ms = backoff_ms(cx.policy, k.attempts, k.key.as_str());
            set(&mut data, "outcome", json!(C::Pending));
            set(&mut data, "retry_in_ms", json!(after_ms));
            return out(
                "compensation_finished",
                data,
                vec![Effect::ScheduleRetry { epoch, after_ms }],
            );
        }
        Some(ToolErrorCode::OutcomeUnknown | ToolErrorCode::Timeout)
            if k.effect != ToolEffect::Read =>
        {
            match (k.effect, k.reconcilable) {
                (ToolEffect::Idempotent, _) if retries_left => k.status = C::Pending,
                (_, true) => k.status = C::Reconciling,
                _ => {
                    k.status = C::OutcomeUnknown;
                    k.result = Some(result);
                }
            }
        }
        Some(_) => {
            k.status = C::Failed;
            k.result = Some(result);
        }
    }
    let status = k.status;
    set(&mut data, "outcome", json!(status));
    let mut effects = Vec::new();
    if status == C::Reconciling {
        effects.push(Effect::CheckCompensation { epoch, call_id });
    } else {
        effects = advance(s);
    }
    let mut t = out("compensation_finished", data, effects);
    if !s.is_terminal() {
        add_dispatched(s, &mut t);
    } else {
        set(&mut t.data, "compensations", summary(s));
    }
    t
}

/// Re-issues what a crashed incarnation had in flight, by the compensating tool's effect.
fn resume(s: &mut RunState) -> Transition {
    s.epoch += 1;
    let epoch = s.epoch;
    let mut effects = Vec::new();
    let mut unknown = Vec::new();
    for k in s.compensations.iter_mut() {
        if k.status == C::Dispatched {
            match (k.effect, k.reconcilable) {
                (ToolEffect::Read | ToolEffect::Idempotent, _) => k.status = C::Pending,
                (ToolEffect::Unsafe, true) => k.status = C::Reconciling,
                (ToolEffect::Unsafe, false) => {
                    k.status = C::OutcomeUnknown;
                    unknown.push(k.call_id.clone());
                }
            }
        }
        if k.status == C::Reconciling {
            effects.push(Effect::CheckCompensation {
                epoch,
                call_id: k.call_id.clone(),
            });
        }
    }
    effects.extend(advance(s));
    let mut t = out(
        "run_resumed",
        json!({ "compensations_outcome_unknown": unknown }),
        effects,
    );
    if s.is_terminal() {
        set(&mut t.data, "compensations", summary(s));
    } else {
        add_dispatched(s, &mut t);
    }
    t
}

/// Sends the newest pending compensation, unless one is in flight; when none is left, ends
/// the run as recorded in `ending`.
fn advance(s: &mut RunState) -> Vec<Effect> {
    if s.compensations
        .iter()
        .any(|k| matches!(k.status, C::Dispatched | C::Reconciling))
    {
        return vec![];
    }
    let epoch = s.epoch;
    if let Some(k) = s
        .compensations
        .iter_mut()
        .rev()
        .find(|k| k.status == C::Pending)
    {
        k.status = C::Dispatched;
        k.attempts += 1;
        return vec![Effect::Compensate {
            epoch,
            call_id: k.call_id.clone(),
        }];
    }
    let ending = s.ending.take().unwrap_or(Ending {
        status: Status::Failed,
        error: None,
    });
    s.status = ending.status;
    s.error = ending.error;
    s.phase = None;
    s.epoch += 1;
    vec![Effect::Finish]
}

fn find<'a>(s: &'a RunState, call_id: &CallId) -> Option<&'a Compensation> {
    s.compensations.iter().find(|k| &k.call_id == call_id)
}

fn find_mut<'a>(s: &'a mut RunState, call_id: &CallId) -> Option<&'a mut Compensation> {
    s.compensations.iter_mut().find(|k| &k.call_id == call_id)
}

fn status_of(s: &RunState, call_id: &CallId) -> Option<C> {
    find(s, call_id).map(|k| k.status)
}

fn set(v: &mut impl SetField, key: &str, value: Value) {
    v.set_field(key, value);
}

trait SetField {
    fn set_field(&mut self, key: &str, value: Value);
}

impl SetField for Value {
    fn set_field(&mut self, key: &str, value: Value) {
        if let Value::Object(m) = self {
            m.insert(key.into(), value);
        }
    }
}

impl SetField for Transition {
    fn set_field(&mut self, key: &str, value: Value) {
        self.data.set_field(key, value);
    }
}

/// The compensations as events show them.
fn summary(s: &RunState) -> Value {
    Value::Array(
        s.compensations
            .iter()
            .map(|k| {
                let mut v = json!({
                    "call_id": k.call_id, "for_call": k.for_call, "tool": k.tool,
                    "status": k.status, "attempts": k.attempts,
                });
                if let Some(e) = k.result.as_ref().and_then(|r| r.error.as_ref()) {
                    v.set_field("error", json!(e));
                }
                if let Some(r) = &k.reason {
                    v.set_field("reason", json!(r));
                }
                v
            })
            .collect(),
    )
}

/// Lists the compensations this transition sends (their intents are in the same commit).
fn add_dispatched(s: &RunState, t: &mut Transition) {
    let sent: Vec<Value> = t
        .effects
        .iter()
        .filter_map(|e| match e {
            Effect::Compensate { call_id, .. } => find(s, call_id),
            _ => None,
        })
        .map(|k| {
            json!({
                "call_id": k.call_id, "for_call": k.for_call, "tool": k.tool,
                "arguments": k.arguments, "key": k.key, "attempt": k.attempts,
            })
        })
        .collect();
    if !sent.is_empty() {
        t.data.set_field("dispatched", Value::Array(sent));
    }
}

#[cfg(test)]
mod tests;
