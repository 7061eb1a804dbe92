//! The stored checkpoint format across upgrades: golden fixtures of every format (1, 2, 3, 4) load,
//! resume and finish; a record of a future format is refused, not misread.

use std::sync::Arc;

use agentd::agent::AgentSpec;
use agentd::model::scripted::{ScriptedModel, turn_of};
use agentd::run::Status;
use agentd::store::{Checkpoint, EventRecord};
use agentd::tool::builtin::CountingTool;
use agentd::tool::{ApprovalRule, ToolEffect};
use serde_json::json;

use crate::support::{Builder, TENANT, WAIT, calls, text};

fn deploy_model() -> ScriptedModel {
    ScriptedModel::from_fn("m", |req| {
        Ok(match turn_of(req) {
            1 => calls(&[("deploy", json!({"item": "v2"}))]),
            _ => text("deployed"),
        })
    })
}

/// A fixture file: the stored checkpoint, its transcript (stored apart from format 3 on;
/// absent before) and its event log.
fn fixture(text: &str) -> (Checkpoint, Vec<EventRecord>) {
    let v: serde_json::Value = serde_json::from_str(text).unwrap();
    let mut cp: Checkpoint = serde_json::from_value(v["checkpoint"].clone()).unwrap();
    if let Some(t) = v.get("transcript") {
        cp.transcript = serde_json::from_value(t.clone()).unwrap();
    }
    (cp, serde_json::from_value(v["events"].clone()).unwrap())
}

/// The fixture: a run of format version 1 (captured from the code before the version field,
/// commit 6e211ec) waiting for approval of its `deploy` call, with its event log.
fn fixture_v1() -> (Checkpoint, Vec<EventRecord>) {
    fixture(include_str!("fixtures/checkpoint-v1-waiting-approval.json"))
}

/// The fixture of format version 2 (the transcript inline, after the version field): the same
/// run as written by the release before the transcript moved out of the body.
fn fixture_v2() -> (Checkpoint, Vec<EventRecord>) {
    fixture(include_str!("fixtures/checkpoint-v2-waiting-approval.json"))
}

fn harness() -> (Builder, Arc<agentd::tool::builtin::Ledger>) {
    let deploy = CountingTool::new("deploy", ToolEffect::Unsafe)
        .with_spec(|s| s.approval(ApprovalRule::Always));
    let ledger = deploy.ledger();
    let b = Builder::new()
        .tool(Arc::new(deploy))
        .model(deploy_model())
        .agent(AgentSpec::new("a", "m").tools(["deploy"]));
    (b, ledger)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_1_run_waiting_for_approval_resumes_and_finishes_after_the_upgrade() {
    let (cp, events) = fixture_v1();
    assert_eq!(agentd::run::format::version_of(&cp.body).unwrap(), 1);
    let (builder, ledger) = harness();
    builder.store.create(&cp, &events, None).await.unwrap();
    let h = builder.start().await;

    let run = h
        .handle
        .wait_until(TENANT, &cp.run_id, WAIT, |r| {
            r.status == Status::WaitingApproval
        })
        .await
        .unwrap();
    let call = run.pending_approvals().next().unwrap().call_id.clone();
    assert_eq!(ledger.total(), 0, "nothing ran before the approval");
    h.handle
        .decide(TENANT, &cp.run_id, &call, true, None, None, None)
        .await
        .unwrap();
    let run = h.finish(&cp.run_id).await;
    assert_eq!(run.status, Status::Succeeded);
    assert_eq!(run.output, Some(json!("deployed")));
    assert_eq!(ledger.total(), 1);
    // The log continued the fixture's without a gap, and the run was rewritten in the
    // current format.
    let kinds = h.kinds(&cp.run_id).await;
    assert_eq!(
        kinds[..events.len()],
        ["run_created", "run_started", "model_replied"]
    );
    assert_eq!(kinds.last().map(String::as_str), Some("run_succeeded"));
    let stored = h.store.load(&cp.run_id).await.unwrap().unwrap();
    assert_eq!(
        agentd::run::format::version_of(&stored.body).unwrap(),
        u64::from(agentd::run::format::CURRENT)
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_2_run_resumes_and_its_transcript_moves_out_of_the_body() {
    let (cp, events) = fixture_v2();
    assert_eq!(agentd::run::format::version_of(&cp.body).unwrap(), 2);
    let (builder, ledger) = harness();
    builder.store.create(&cp, &events, None).await.unwrap();
    let h = builder.start().await;
    let run = h
        .handle
        .wait_until(TENANT, &cp.run_id, WAIT, |r| {
            r.status == Status::WaitingApproval
        })
        .await
        .unwrap();
    assert_eq!(run.messages.len(), 2, "the inline transcript is read");
    let call = run.pending_approvals().next().unwrap().call_id.clone();
    h.handle
        .decide(TENANT, &cp.run_id, &call, true, None, None, None)
        .await
        .unwrap();
    let run = h.finish(&cp.run_id).await;
    assert_eq!(run.status, Status::Succeeded);
    assert_eq!(ledger.total(), 1);
    // Rewritten in the current format: the body holds no message, the store holds the
    // whole transcript (the two inline messages included) apart.
    let stored = h.store.load(&cp.run_id).await.unwrap().unwrap();
    assert_eq!(
        agentd::run::format::version_of(&stored.body).unwrap(),
        u64::from(agentd::run::format::CURRENT)
    );
    assert!(
        !stored.body.contains(r#""content":"deploy v2""#),
        "{}",
        stored.body
    );
    assert_eq!(stored.transcript.len(), run.messages.len());
    assert!(stored.transcript[0].contains("deploy v2"));
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_of_a_future_format_version_is_refused_and_quarantined_not_misread() {
    let (mut cp, events) = fixture_v1();
    cp.body = cp.body.replacen('{', r#"{"format_version":99,"#, 1);
    let (builder, ledger) = harness();
    builder.store.create(&cp, &events, None).await.unwrap();
    let h = builder.start().await;

    let err = h.handle.get_run(TENANT, &cp.run_id).await.unwrap_err();
    let message = err.to_string();
    assert!(message.contains("version 99"), "{message}");
    assert!(
        message.contains(&format!("1 to {}", agentd::run::format::CURRENT)),
        "{message}"
    );
    let (runs, _) = h
        .handle
        .list_runs(TENANT, &Default::default(), None, 50)
        .await
        .unwrap();
    assert!(
        runs.iter().all(|r| r.id != cp.run_id),
        "left out of listings"
    );
    let quarantined = h.handle.quarantined();
    assert!(
        quarantined
            .iter()
            .any(|(id, why)| *id == cp.run_id && why.contains("version 99")),
        "{quarantined:?}"
    );
    assert_eq!(ledger.total(), 0, "nothing of that run was executed");
    // The record is left as it was for a newer build to read.
    assert_eq!(
        h.store.load(&cp.run_id).await.unwrap().unwrap().body,
        cp.body
    );
    h.shutdown().await;
}

/// The fixture of format version 3 (the transcript stored apart; captured from this build's
/// first release of it): the same kind of run, waiting for approval.
fn fixture_v3() -> (Checkpoint, Vec<EventRecord>) {
    fixture(include_str!("fixtures/checkpoint-v3-waiting-approval.json"))
}

/// Stores a fixture run that waits for approval (two transcript entries), starts the runtime,
/// approves the call and waits for the run to succeed; checks that the stored transcript was
/// read, then appended to and never rewritten. Returns the run's final stored record.
async fn approve_and_finish(cp: Checkpoint, events: Vec<EventRecord>) -> Checkpoint {
    let fixture_transcript = cp.transcript.clone();
    assert_eq!(fixture_transcript.len(), 2);
    let (builder, ledger) = harness();
    builder.store.create(&cp, &events, None).await.unwrap();
    let h = builder.start().await;
    let run = h
        .handle
        .wait_until(TENANT, &cp.run_id, WAIT, |r| {
            r.status == Status::WaitingApproval
        })
        .await
        .unwrap();
    assert_eq!(run.messages.len(), 2, "the stored transcript is read");
    let call = run.pending_approvals().next().unwrap().call_id.clone();
    h.handle
        .decide(TENANT, &cp.run_id, &call, true, None, None, None)
        .await
        .unwrap();
    let run = h.finish(&cp.run_id).await;
    assert_eq!(run.status, Status::Succeeded);
    assert_eq!(run.output, Some(json!("deployed")));
    assert_eq!(ledger.total(), 1);
    let stored = h.store.load(&cp.run_id).await.unwrap().unwrap();
    assert_eq!(stored.transcript.len(), run.messages.len());
    assert_eq!(
        stored.transcript[..2],
        fixture_transcript[..],
        "appended to, never rewritten"
    );
    h.shutdown().await;
    stored
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_3_run_resumes_and_appends_to_its_stored_transcript() {
    let (cp, events) = fixture_v3();
    assert_eq!(agentd::run::format::version_of(&cp.body).unwrap(), 3);
    approve_and_finish(cp, events).await;
}

/// The fixture of format version 4 (the progress tracker's lists compact): the version 3
/// fixture as this build writes it, with two calls' fingerprints tracked.
fn fixture_v4() -> (Checkpoint, Vec<EventRecord>) {
    fixture(include_str!("fixtures/checkpoint-v4-waiting-approval.json"))
}

/// The fixture of format version 5 (the body as small as every commit writes it): the
/// version 4 fixture as this build writes it, with a call seen 200 times (a two-byte count).
fn fixture_v5() -> (Checkpoint, Vec<EventRecord>) {
    fixture(include_str!("fixtures/checkpoint-v5-waiting-approval.json"))
}

/// The current build writes the version 5 fixture byte for byte (so a change of the stored
/// format cannot slip in without a new version), reads its base64 lists and left-out
/// defaults, and resumes and finishes the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_5_run_is_written_byte_for_byte_and_resumes_and_finishes() {
    let (cp, events) = fixture_v5();
    assert_eq!(agentd::run::format::version_of(&cp.body).unwrap(), 5);
    let mut before = agentd::runtime::actor::state_of(&cp).unwrap();
    assert_eq!(before.progress.seen, [(0x5be2a1f3, 1), (0x9c01d2e4, 200)]);
    assert_eq!(
        before.progress.results_seen,
        [(0x0a1b2c3d, 1), (0x77aa88bb, 1)]
    );
    assert_eq!(
        (before.corrections, before.restarts, before.force_final),
        (0, 0, false)
    );
    assert_eq!(agentd::run::format::encode(&mut before).unwrap(), cp.body);
    // Format 4's body of the same run is written as this one.
    let (v4, _) = fixture_v4();
    let mut from_v4 = agentd::runtime::actor::state_of(&v4).unwrap();
    from_v4.progress.seen[1].1 = 200;
    assert_eq!(agentd::run::format::encode(&mut from_v4).unwrap(), cp.body);
    let stored = approve_and_finish(cp, events).await;
    let after = agentd::runtime::actor::state_of(&stored).unwrap();
    assert_eq!(after.progress.seen[..2], before.progress.seen[..]);
    assert_eq!(agentd::run::format::version_of(&stored.body).unwrap(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_4_run_with_compact_progress_lists_resumes_and_finishes() {
    let (cp, events) = fixture_v4();
    assert_eq!(agentd::run::format::version_of(&cp.body).unwrap(), 4);
    let before = agentd::runtime::actor::state_of(&cp).unwrap();
    assert_eq!(before.progress.seen, [(0x5be2a1f3, 1), (0x9c01d2e4, 1)]);
    let stored = approve_and_finish(cp, events).await;
    // The tracker went on from the stored lists and is written back compactly.
    let after = agentd::runtime::actor::state_of(&stored).unwrap();
    assert_eq!(after.progress.seen[..2], before.progress.seen[..]);
    // Written back in the current format: base64 lists, not format 4's dotted ones.
    assert_eq!(
        agentd::run::format::version_of(&stored.body).unwrap(),
        u64::from(agentd::run::format::CURRENT)
    );
    assert!(!stored.body.contains("5be2a1f3.1"), "{}", stored.body);
}
