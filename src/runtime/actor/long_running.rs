//! Long-running tool calls in the run actor: polling a call its tool accepted (`202`) without
//! holding a pool worker, and its own deadline.
//!
//! The machine records the call as `awaiting_result` (status URL and deadline in the
//! checkpoint) and asks for `Effect::PollTool`. Here each such call gets a timer: when it is
//! due, one short pool job asks the status URL once (`ToolWork::Poll`). "Still running" and
//! transient failures only re-arm the timer, with capped, jittered backoff, and commit
//! nothing. The wait is half the call's age (time since the tool accepted it), at least the
//! tool's `poll_interval` and at most its `poll_max_interval`, ±20 %: so waits grow by about
//! half each poll, and since the age comes from the checkpoint, the backoff carries on across
//! restarts and passivation;
//! a final answer becomes `RunEvent::ToolPolled`. A second timer delivers
//! `RunEvent::CallDeadline` at the call's deadline. Every timer and reply carries the epoch
//! it was issued in, so cancelling the run (or resuming it) stops the old polls: a stale
//! timer submits nothing, and the cancelled run's in-flight poll is cancelled with it.
//!
//! The poll state here is memory only: after a restart or a passivation, polling starts again
//! from the checkpoint's task (`Resume` asks for `PollTool` again; a rehydrated run polls at
//! once, since its wake-up time was its next poll).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ractor::ActorRef;

use super::{Live, RunDeps, RunMsg};
use crate::clock::now_ms;
use crate::ids::CallId;
use crate::run::machine::RunEvent;
use crate::run::state::{CallStatus, Phase, Status};
use crate::tool::executor::{ToolOutcome, ToolWork};
use crate::tool::{LongRunning, ToolContext, ToolError, ToolErrorCode, ToolResult, ToolSpec};

/// The calls of this incarnation being polled.
#[derive(Debug, Default)]
pub(super) struct Polls {
    slots: HashMap<CallId, Slot>,
}

#[derive(Debug)]
struct Slot {
    epoch: u64,
    /// When the next poll is due (wall ms), while a timer is armed.
    due_at_ms: Option<u64>,
    in_flight: bool,
}

impl Polls {
    /// Whether `call_id` is polled in `epoch` (its slot was not replaced by a later one).
    fn is_current(&self, call_id: &CallId, epoch: u64) -> bool {
        self.slots.get(call_id).is_some_and(|s| s.epoch == epoch)
    }
}

/// How long a poll waits for a lease that was not confirmed recently.
const LEASE_RECHECK: Duration = Duration::from_millis(100);

/// The wait before the next poll of a call accepted `age` ago: half its age, at least
/// `poll_interval`, at most `poll_max_interval`, with ±20 % jitter (still capped).
pub(super) fn poll_delay(spec: &ToolSpec, age: Duration) -> Duration {
    let cap = spec.poll_max_interval.max(spec.poll_interval);
    let grown = (age / 2).clamp(spec.poll_interval, cap);
    let jittered = grown.mul_f64(0.8 + 0.4 * rand::random::<f64>());
    jittered.min(cap)
}

fn age_of(task: &crate::run::state::CallTask) -> Duration {
    Duration::from_millis(now_ms().saturating_sub(task.accepted_at_ms))
}

/// `Effect::PollTool`: start polling `call_id` (once per epoch) and arm its deadline.
pub(super) fn start(
    myself: &ActorRef<RunMsg>,
    live: &mut Live,
    epoch: u64,
    call_id: CallId,
    first_in: Option<Duration>,
) {
    let Some(call) = live.run.call(&call_id) else {
        return;
    };
    let Some(task) = call.task.clone() else {
        return;
    };
    if live
        .polls
        .slots
        .get(&call_id)
        .is_some_and(|s| s.epoch == epoch)
    {
        return;
    }
    let now = now_ms();
    let deadline_in = Duration::from_millis(task.deadline_ms.saturating_sub(now));
    let id = call_id.clone();
    myself.send_after(deadline_in, move || {
        RunMsg::Event(RunEvent::CallDeadline { epoch, call_id: id })
    });
    let mut slot = Slot {
        epoch,
        due_at_ms: None,
        in_flight: false,
    };
    if task.status_url.is_some() {
        let spec = live.agent.tools.tool(&call.tool).map(|t| t.spec().clone());
        let wait = first_in
            .or_else(|| spec.as_ref().map(|s| poll_delay(s, age_of(&task))))
            .unwrap_or_default();
        arm(myself, &mut slot, &call_id, wait);
    }
    live.polls.slots.insert(call_id, slot);
}

/// A run brought back while waiting (rehydrated or taken over): poll every accepted call now.
pub(super) fn resume_all(myself: &ActorRef<RunMsg>, live: &mut Live) {
    let epoch = live.run.epoch;
    let awaiting: Vec<CallId> = live
        .run
        .calls
        .iter()
        .filter(|c| c.status == CallStatus::AwaitingResult)
        .map(|c| c.call_id.clone())
        .collect();
    for call_id in awaiting {
        start(myself, live, epoch, call_id, Some(Duration::ZERO));
    }
}

fn arm(myself: &ActorRef<RunMsg>, slot: &mut Slot, call_id: &CallId, wait: Duration) {
    slot.due_at_ms = Some(now_ms().saturating_add(wait.as_millis() as u64));
    let (epoch, call_id) = (slot.epoch, call_id.clone());
    myself.send_after(wait, move || RunMsg::PollDue { epoch, call_id });
}

/// Whether `call_id` still waits for its result in `epoch`.
fn still_awaiting(live: &Live, epoch: u64, call_id: &CallId) -> bool {
    !live.run.is_terminal()
        && live.run.epoch == epoch
        && live.run.call(call_id).map(|c| c.status) == Some(CallStatus::AwaitingResult)
}

/// `RunMsg::PollDue`: send one poll (a short pool job), unless the call no longer waits.
pub(super) fn on_due(
    myself: &ActorRef<RunMsg>,
    deps: &Arc<RunDeps>,
    live: &mut Live,
    epoch: u64,
    call_id: CallId,
) {
    // A timer of an earlier epoch (before a resume) neither polls nor touches the new slot.
    if !live.polls.is_current(&call_id, epoch) {
        return;
    }
    if !still_awaiting(live, epoch, &call_id) {
        live.polls.slots.remove(&call_id);
        return;
    }
    let Some(slot) = live.polls.slots.get_mut(&call_id) else {
        return;
    };
    if slot.in_flight {
        return;
    }
    // A poll is read-only, but the run is not this node's to drive on an unconfirmed lease.
    if !deps.leases.fresh(&live.run.id, deps.lease_ttl, now_ms()) {
        arm(myself, slot, &call_id, LEASE_RECHECK);
        return;
    }
    let run = &live.run;
    let Some(call) = run.call(&call_id) else {
        return;
    };
    let Some(status_url) = call.task.as_ref().and_then(|t| t.status_url.clone()) else {
        return;
    };
    let Some(tool) = live.agent.tools.tool(&call.tool) else {
        let _ = myself.cast(RunMsg::Event(RunEvent::ToolPolled {
            epoch,
            call_id,
            result: super::tool_gone(&call.tool),
        }));
        return;
    };
    slot.in_flight = true;
    slot.due_at_ms = None;
    deps.metrics
        .tool_polls
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let ctx = ToolContext {
        tenant: run.tenant.clone(),
        run_id: run.id.clone(),
        call_id: call_id.clone(),
        idempotency_key: call.key.clone(),
        cancel: live.cancel.child_token(),
        long_running: LongRunning::default(),
    };
    let me = myself.clone();
    deps.tools
        .submit(tool, ctx, ToolWork::Poll { status_url }, move |outcome| {
            if let ToolOutcome::Polled(outcome) = outcome {
                let _ = me.cast(RunMsg::Polled {
                    epoch,
                    call_id,
                    outcome,
                });
            }
        });
}

/// Whether a failed poll is asked again (the call is not failed by it).
fn transient(e: &ToolError) -> bool {
    matches!(
        e.code,
        ToolErrorCode::Retryable | ToolErrorCode::Timeout | ToolErrorCode::Overloaded
    )
}

/// `RunMsg::Polled`: a final answer goes to the machine; "still running" and transient
/// failures re-arm the timer with backoff.
pub(super) fn on_polled(
    myself: &ActorRef<RunMsg>,
    live: &mut Live,
    epoch: u64,
    call_id: CallId,
    outcome: Result<Option<ToolResult>, ToolError>,
) {
    if let Some(slot) = live.polls.slots.get_mut(&call_id)
        && slot.epoch == epoch
    {
        slot.in_flight = false;
    }
    let result = match outcome {
        Ok(Some(result)) => Some(result),
        Err(e) if !transient(&e) => Some(ToolResult::failure(e)),
        Ok(None) | Err(_) => None,
    };
    if let Some(result) = result {
        // The machine decides: the call's result, or late (stale epoch, finished run).
        let _ = myself.cast(RunMsg::Event(RunEvent::ToolPolled {
            epoch,
            call_id,
            result,
        }));
        return;
    }
    if !live.polls.is_current(&call_id, epoch) {
        return;
    }
    if !still_awaiting(live, epoch, &call_id) {
        live.polls.slots.remove(&call_id);
        return;
    }
    let Some(call) = live.run.call(&call_id) else {
        return;
    };
    let Some((spec, task)) = live
        .agent
        .tools
        .tool(&call.tool)
        .map(|t| t.spec().clone())
        .zip(call.task.clone())
    else {
        return;
    };
    let Some(slot) = live.polls.slots.get_mut(&call_id) else {
        return;
    };
    if slot.epoch != epoch {
        return;
    }
    let wait = poll_delay(&spec, age_of(&task));
    tracing::debug!(run = %live.run.id, %call_id, ?wait, "long-running call still running");
    arm(myself, slot, &call_id, wait);
}

/// Whether the run only waits for calls its tools accepted (it may be passivated).
pub(super) fn is_awaiting_tool(live: &Live) -> bool {
    live.run.status == Status::Running && live.run.phase == Some(Phase::AwaitingTool)
}

/// Whether a poll is out right now (the run is not passivated meanwhile).
pub(super) fn polling_now(live: &Live) -> bool {
    live.polls.slots.values().any(|s| s.in_flight)
}

/// When a passivated run must be back for its accepted calls: the next poll, or a deadline.
pub(super) fn wake_at_ms(live: &Live) -> Option<u64> {
    let next_poll = live.polls.slots.values().filter_map(|s| s.due_at_ms).min();
    let deadline = live
        .run
        .calls
        .iter()
        .filter(|c| c.status == CallStatus::AwaitingResult)
        .filter_map(|c| c.task.as_ref().map(|t| t.deadline_ms))
        .min();
    match (next_poll, deadline) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_waits_grow_and_stay_capped() {
        let spec = ToolSpec::new("t", "d", serde_json::json!({"type": "object"}));
        let spec = ToolSpec {
            poll_interval: Duration::from_millis(100),
            poll_max_interval: Duration::from_millis(1000),
            ..spec
        };
        let first = poll_delay(&spec, Duration::ZERO);
        assert!(first >= Duration::from_millis(80) && first <= Duration::from_millis(120));
        let mid = poll_delay(&spec, Duration::from_millis(1000));
        assert!(mid >= Duration::from_millis(400) && mid <= Duration::from_millis(600));
        for ms in (0..100_000).step_by(997) {
            assert!(poll_delay(&spec, Duration::from_millis(ms)) <= Duration::from_millis(1000));
        }
        assert!(poll_delay(&spec, Duration::from_secs(3600)) >= Duration::from_millis(800));
    }
}
