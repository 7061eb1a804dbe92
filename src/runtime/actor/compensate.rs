//! Sends a run's compensating calls (`Effect::Compensate`, `Effect::CheckCompensation`) to the
//! tool pool, like the batch's calls: with the compensation's own call id and its key derived
//! from the original call's, and the reply delivered back as `ToolFinished` / `StatusChecked`
//! (the executor's retries by class as `ToolRetrying`), so the machine steps them like any
//! other reply. The compensating tool need not be on the agent's list.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use ractor::ActorRef;

use super::{Live, RunDeps, RunMsg, redact_status, retry_events, tool_gone};
use crate::ids::CallId;
use crate::run::machine::RunEvent;
use crate::tool::executor::{ToolOutcome, ToolWork};
use crate::tool::{ToolContext, ToolError, ToolErrorCode, ToolResult};

/// Sends the compensating call `call_id` (or, with `status_check`, asks whether it ran).
pub(super) fn execute(
    myself: &ActorRef<RunMsg>,
    deps: &Arc<RunDeps>,
    live: &mut Live,
    epoch: u64,
    call_id: CallId,
    status_check: bool,
) {
    let run = &live.run;
    let Some(k) = run.compensations.iter().find(|k| k.call_id == call_id) else {
        tracing::error!(run = %run.id, %call_id, "effect names a compensation the run does not have");
        return;
    };
    let me = myself.clone();
    let tool = live
        .agent
        .tools
        .compensating_tool(&k.tool)
        .or_else(|| live.agent.tools.tool(&k.tool));
    let Some(tool) = tool else {
        // Config changed since the compensation was recorded: answer it without running it.
        let _ = me.cast(RunMsg::Event(RunEvent::ToolFinished {
            epoch,
            call_id,
            result: tool_gone(&k.tool),
        }));
        return;
    };
    tracing::info!(run = %run.id, %call_id, tool = %k.tool, for_call = %k.for_call, status_check, "compensating");
    let ctx = ToolContext {
        tenant: run.tenant.clone(),
        run_id: run.id.clone(),
        call_id: call_id.clone(),
        idempotency_key: k.key.clone(),
        cancel: live.cancel.child_token(),
        // Compensations are not long-running: no callback is offered.
        long_running: crate::tool::LongRunning::default(),
    };
    let work = if status_check {
        ToolWork::Status
    } else {
        ToolWork::Call {
            arguments: k.arguments.clone(),
        }
    };
    let metrics = deps.metrics.clone();
    let tool_name = k.tool.clone();
    let redactor = deps.redactor.clone();
    let sent = Instant::now();
    live.tools_in_flight += 1;
    let on_retry = retry_events(myself, epoch, &call_id);
    deps.tools
        .submit_observed(tool, ctx, work, Some(on_retry), move |outcome| {
            let event = match outcome {
                ToolOutcome::Result(mut result) => {
                    result.redact(&redactor);
                    let outcome = result.error.as_ref().map_or("ok", |e| e.code.as_str());
                    metrics
                        .labelled
                        .tool_call(&tool_name, outcome, sent.elapsed());
                    if !result.ok {
                        metrics.tool_errors.fetch_add(1, Ordering::Relaxed);
                    }
                    RunEvent::ToolFinished {
                        epoch,
                        call_id,
                        result,
                    }
                }
                // A compensating tool that answers `202` is not followed: its outcome is
                // unknown (resent with the same key if it is idempotent, up to the policy).
                ToolOutcome::Accepted { .. } | ToolOutcome::Polled(_) => RunEvent::ToolFinished {
                    epoch,
                    call_id,
                    result: ToolResult::failure(ToolError::new(
                        ToolErrorCode::OutcomeUnknown,
                        "the compensating tool accepted the call to finish it later; long-running compensations are not followed",
                    )),
                },
                ToolOutcome::Status(mut outcome) => {
                    redact_status(&mut outcome, &redactor);
                    RunEvent::StatusChecked {
                        epoch,
                        call_id,
                        outcome,
                    }
                }
            };
            let _ = me.cast(RunMsg::Event(event));
        });
}
