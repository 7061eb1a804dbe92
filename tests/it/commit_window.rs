//! The commit window (`runtime.commit_window`): transitions whose only effects are read-only
//! tool calls, model calls or a verification wait to be committed together (one store write
//! for many steps), no longer than the window and no more than its bound of transitions; a
//! call that writes is sent only once what led to it is stored; a control's requester is
//! answered with what is stored; and a crash in the window loses only what the resumed run
//! asks the model and the read-only tools for again.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use agentd::agent::AgentSpec;
use agentd::ids::RunId;
use agentd::model::scripted::{ScriptedModel, turn_of};
use agentd::run::{RunEvent, RunState, Status};
use agentd::runtime::actor::FaultInjector;
use agentd::tool::builtin::Echo;
use agentd::tool::{Tool, ToolContext, ToolEffect, ToolError, ToolSpec};
use serde_json::{Value, json};

use crate::support::{Builder, Harness, TENANT, WAIT, calls, text};

/// Three echo steps, then the answer.
fn three_steps(calls_made: Arc<AtomicU32>) -> ScriptedModel {
    ScriptedModel::from_fn("m", move |req| {
        calls_made.fetch_add(1, Ordering::SeqCst);
        let turn = turn_of(req);
        Ok(if turn <= 3 {
            calls(&[("echo", json!({"text": format!("step {turn}")}))])
        } else {
            text("done")
        })
    })
}

fn kinds(events: &[agentd::store::EventRecord]) -> Vec<&str> {
    events.iter().map(|e| e.kind.as_str()).collect()
}

async fn finished(h: &Harness, id: &RunId) -> RunState {
    let run = h.handle.wait_terminal(TENANT, id, WAIT).await.unwrap();
    assert_eq!(run.status, Status::Succeeded, "{:?}", run.error);
    run
}

/// Checks the stored log: seq 1..n without gaps, and the events of a three-step run.
async fn stored_log(h: &Harness, id: &RunId) -> Vec<String> {
    let events = h.store.read(id, 0, 1_000).await.unwrap();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.seq, i as u64 + 1, "gap in the log: {:?}", kinds(&events));
    }
    events.into_iter().map(|e| e.kind).collect()
}

/// With a window longer than the run, the start is stored at once (a status change), and
/// every transition after it, to the end, waits in one window that the end commits: two
/// commits for the whole run (every transition on its own without a window), and the log is
/// the same, gap-free, with every event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_step_is_committed_once_with_its_result() {
    for window in [Some(Duration::from_secs(30)), None] {
        let mut b = Builder::new()
            .tool(Arc::new(Echo::new()))
            .model(three_steps(Arc::default()))
            .agent(AgentSpec::new("a", "m").tools(["echo"]));
        b.config.commit_window = window;
        let h = b.start().await;
        let metrics = h.handle.metrics().clone();
        let id = h.start_run("a", "go").await;
        finished(&h, &id).await;
        let log = stored_log(&h, &id).await;
        let replies = log.iter().filter(|k| *k == "model_replied").count();
        let results = log.iter().filter(|k| *k == "tool_call_finished").count();
        assert_eq!((replies, results), (4, 3), "{log:?}");
        // Transitions after the create: every stored event but `run_created`.
        let transitions = metrics.transitions.load(Ordering::SeqCst);
        let commits = metrics.commits.load(Ordering::SeqCst);
        assert_eq!(transitions, log.len() as u64 - 1, "{log:?}");
        match window {
            Some(_) => assert_eq!(commits, 2, "{log:?}"),
            None => assert_eq!(commits, transitions, "{log:?}"),
        }
        h.shutdown().await;
    }
}

/// A read-only tool that answers only when released.
struct Gate {
    spec: ToolSpec,
    started: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::Notify>,
}

#[async_trait::async_trait]
impl Tool for Gate {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn call(&self, _ctx: &ToolContext, _arguments: Value) -> Result<Value, ToolError> {
        self.started.notify_one();
        self.release.notified().await;
        Ok(json!({"opened": true}))
    }
}

/// A reply whose read-only call does not answer within the window is committed on its own
/// when the window closes: it is stored (and streamed) while the call still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_waits_no_longer_than_its_window() {
    let started = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let gate = Gate {
        spec: ToolSpec::new("gate", "Waits to be opened.", json!({"type": "object"}))
            .effect(ToolEffect::Read)
            .timeout(Duration::from_secs(60)),
        started: started.clone(),
        release: release.clone(),
    };
    let mut b = Builder::new()
        .tool(Arc::new(gate))
        .model(ScriptedModel::from_fn("m", |req| {
            Ok(match turn_of(req) {
                1 => calls(&[("gate", json!({}))]),
                _ => text("done"),
            })
        }))
        .agent(AgentSpec::new("a", "m").tools(["gate"]));
    b.config.commit_window = Some(Duration::from_millis(20));
    let h = b.start().await;
    let id = h.start_run("a", "go").await;
    tokio::time::timeout(WAIT, started.notified())
        .await
        .expect("the call did not reach the tool");
    // The call is held at the tool: the reply is stored anyway, once its window closed.
    let stored = h
        .handle
        .wait_until(TENANT, &id, WAIT, |r| {
            r.calls
                .iter()
                .any(|c| c.status == agentd::run::CallStatus::Dispatched)
        })
        .await
        .unwrap();
    assert_eq!(stored.status, Status::Running);
    let log = stored_log(&h, &id).await;
    assert_eq!(
        log.last().map(String::as_str),
        Some("model_replied"),
        "{log:?}"
    );
    release.notify_one();
    finished(&h, &id).await;
    let log = stored_log(&h, &id).await;
    assert!(log.contains(&"tool_call_finished".to_owned()), "{log:?}");
    h.shutdown().await;
}

/// Panics the run's actor once, just before the first tool result is applied: the reply
/// waiting in its window was not stored.
struct PanicBeforeFirstResult(AtomicU32);

impl FaultInjector for PanicBeforeFirstResult {
    fn panic_before(&self, _run: &RunState, event: &RunEvent) -> bool {
        matches!(event, RunEvent::ToolFinished { .. }) && self.0.fetch_add(1, Ordering::SeqCst) == 0
    }
}

/// A crash inside the window loses only the reply that waited in it: the restarted run
/// resumes from the last stored checkpoint, asks the model again, and finishes with a
/// gap-free log holding each step once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_in_the_window_asks_the_model_again_and_loses_nothing_stored() {
    let model_calls = Arc::new(AtomicU32::new(0));
    let mut b = Builder::new()
        .tool(Arc::new(Echo::new()))
        .model(three_steps(model_calls.clone()))
        .agent(AgentSpec::new("a", "m").tools(["echo"]));
    b.config.commit_window = Some(Duration::from_secs(30));
    b.faults = Some(Arc::new(PanicBeforeFirstResult(AtomicU32::new(0))));
    let h = b.start().await;
    let id = h.start_run("a", "go").await;
    let run = finished(&h, &id).await;
    assert_eq!(run.output, Some(json!("done")));
    assert_eq!(run.restarts, 1, "the actor crashed once");
    // Four replies were used; the one lost in the crash was asked for again.
    assert_eq!(model_calls.load(Ordering::SeqCst), 5);
    let log = stored_log(&h, &id).await;
    let replies = log.iter().filter(|k| *k == "model_replied").count();
    let results = log.iter().filter(|k| *k == "tool_call_finished").count();
    assert_eq!((replies, results), (4, 3), "{log:?}");
    h.shutdown().await;
}

/// `steps` echo steps, then the answer.
fn echo_steps(steps: u32) -> ScriptedModel {
    ScriptedModel::from_fn("m", move |req| {
        let turn = turn_of(req);
        Ok(if turn <= steps {
            calls(&[("echo", json!({"text": format!("step {turn}")}))])
        } else {
            text("done")
        })
    })
}

/// However fast the model and tools answer, a window holds at most 64 transitions: after its
/// start, a long run commits in windows of 64, each one commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_holds_a_bounded_number_of_transitions() {
    let mut b = Builder::new()
        .tool(Arc::new(Echo::new()))
        .model(echo_steps(60))
        .agent(
            AgentSpec::new("a", "m")
                .tools(["echo"])
                .budget(agentd::run::Budget {
                    max_turns: 70,
                    max_tool_calls: 70,
                    ..Default::default()
                }),
        );
    b.config.commit_window = Some(Duration::from_secs(30));
    let h = b.start().await;
    let metrics = h.handle.metrics().clone();
    let id = h.start_run("a", "go").await;
    finished(&h, &id).await;
    let log = stored_log(&h, &id).await;
    let transitions = metrics.transitions.load(Ordering::SeqCst);
    assert_eq!(transitions, log.len() as u64 - 1);
    assert!(transitions > 64, "{transitions} transitions");
    assert_eq!(
        metrics.commits.load(Ordering::SeqCst),
        1 + (transitions - 1).div_ceil(64)
    );
    h.shutdown().await;
}

/// A tool that writes, and records what the store held when it was called.
struct StoredWhenCalled {
    spec: ToolSpec,
    store: agentd::store::SharedStore,
    seen: Arc<std::sync::Mutex<Vec<Vec<String>>>>,
}

#[async_trait::async_trait]
impl Tool for StoredWhenCalled {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn call(&self, ctx: &ToolContext, _arguments: Value) -> Result<Value, ToolError> {
        let log = self.store.read(&ctx.run_id, 0, 1_000).await.unwrap();
        self.seen
            .lock()
            .unwrap()
            .push(log.into_iter().map(|e| e.kind).collect());
        Ok(json!({"written": true}))
    }
}

/// A call that writes leaves only once the reply asking for it, and everything the window
/// held before it, is stored: the window before it (a read-only step) is committed with the
/// write's dispatch. Its result is stored at once too (lost, it would be an unknown outcome):
/// start, that window, the result, and the answer with its verdict are four commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_is_sent_only_once_the_reply_asking_for_it_is_stored() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut b = Builder::new();
    let write = StoredWhenCalled {
        spec: ToolSpec::new("write", "Writes.", json!({"type": "object"}))
            .effect(ToolEffect::Idempotent),
        store: b.store.clone(),
        seen: seen.clone(),
    };
    b = b
        .tool(Arc::new(Echo::new()))
        .tool(Arc::new(write))
        .model(ScriptedModel::from_fn("m", |req| {
            Ok(match turn_of(req) {
                1 => calls(&[("echo", json!({"text": "look first"}))]),
                2 => calls(&[("write", json!({}))]),
                _ => text("done"),
            })
        }))
        .agent(AgentSpec::new("a", "m").tools(["echo", "write"]));
    b.config.commit_window = Some(Duration::from_secs(30));
    let h = b.start().await;
    let metrics = h.handle.metrics().clone();
    let id = h.start_run("a", "go").await;
    finished(&h, &id).await;
    assert_eq!(metrics.commits.load(Ordering::SeqCst), 4);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    let replies = seen[0].iter().filter(|k| *k == "model_replied").count();
    let results = seen[0]
        .iter()
        .filter(|k| *k == "tool_call_finished")
        .count();
    assert_eq!(
        (replies, results),
        (2, 1),
        "stored when called: {:?}",
        seen[0]
    );
    h.shutdown().await;
}

/// A control's requester is answered with a stored state: input that resumes the run opens
/// a window (the next model call), and the answer waits for its commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_is_answered_with_what_is_stored() {
    let mut b = Builder::new()
        .tool(Arc::new(Echo::new()))
        .model(ScriptedModel::from_fn("m", |req| {
            Ok(match turn_of(req) {
                1 => calls(&[("ask_user", json!({"question": "which?"}))]),
                2 => calls(&[("echo", json!({"text": "this one"}))]),
                _ => text("done"),
            })
        }))
        .agent(AgentSpec::new("a", "m").tools(["echo"]));
    b.config.commit_window = Some(Duration::from_secs(30));
    let h = b.start().await;
    let id = h.start_run("a", "go").await;
    h.handle
        .wait_until(TENANT, &id, WAIT, |r| r.status == Status::WaitingInput)
        .await
        .unwrap();
    let answered = h.handle.input(TENANT, &id, "that".into()).await.unwrap();
    let stored = h.store.load(&id).await.unwrap().expect("stored");
    assert!(
        stored.version >= answered.version,
        "answered with version {} while the store holds {}",
        answered.version,
        stored.version
    );
    finished(&h, &id).await;
    h.shutdown().await;
}
