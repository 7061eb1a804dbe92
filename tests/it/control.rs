//! Control routes: idempotent cancel, approvals (replayed, rejected, unknown, after cancel) and
//! input, each checked against the run's state.

use reqwest::StatusCode;
use serde_json::json;

use crate::daemon_support::{ALPHA, TestDaemon, assert_error};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_is_idempotent_and_approve_after_cancel_conflicts() {
    let d = TestDaemon::start().await;
    let id = d.create(ALPHA, "approver").await;
    let waiting = d.wait_status(ALPHA, &id, "waiting_approval").await;
    let pending = &waiting["pending_approvals"][0];
    assert_eq!(pending["call_id"], "call_1_0");
    assert_eq!(pending["tool"], "charge");
    assert_eq!(pending["arguments"], json!({"item": "order-1"}));
    assert_eq!(pending["reason"], "approval");

    let (s1, r1) = d
        .post(
            &format!("/v1/runs/{id}/cancel"),
            ALPHA,
            json!({"reason": "changed my mind"}),
        )
        .await;
    assert_eq!(
        (s1, r1["status"].as_str()),
        (StatusCode::OK, Some("cancelled"))
    );
    let (s2, r2) = d
        .post(&format!("/v1/runs/{id}/cancel"), ALPHA, json!({}))
        .await;
    assert_eq!(s2, StatusCode::OK);
    assert_eq!(r1, r2, "a repeated cancel answers the same");
    // An empty body is fine too.
    let res = d
        .http
        .post(d.url(&format!("/v1/runs/{id}/cancel")))
        .bearer_auth(ALPHA)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);

    let (_, events) = d.get(&format!("/v1/runs/{id}/events"), ALPHA).await;
    let cancels = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"] == "run_cancelled")
        .count();
    assert_eq!(cancels, 1);

    let (s, b) = d
        .post(
            &format!("/v1/runs/{id}/approvals/call_1_0"),
            ALPHA,
            json!({"decision": "approve"}),
        )
        .await;
    assert_error(s, &b, StatusCode::CONFLICT, "invalid_state");
    assert_eq!(b["error"]["status"], "cancelled");
    let (s, b) = d
        .post(
            &format!("/v1/runs/{id}/input"),
            ALPHA,
            json!({"text": "hello"}),
        )
        .await;
    assert_error(s, &b, StatusCode::CONFLICT, "invalid_state");
    assert_eq!(d.ledger.total(), 0);

    // Cancelling a run that succeeded is a conflict.
    let q = d.create(ALPHA, "quick").await;
    d.wait_status(ALPHA, &q, "succeeded").await;
    let (s, b) = d
        .post(&format!("/v1/runs/{q}/cancel"), ALPHA, json!({}))
        .await;
    assert_error(s, &b, StatusCode::CONFLICT, "invalid_state");
    assert_eq!(b["error"]["status"], "succeeded");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_approval_answers_the_same_and_runs_the_tool_once() {
    let d = TestDaemon::start().await;
    let id = d.create(ALPHA, "approver").await;
    d.wait_status(ALPHA, &id, "waiting_approval").await;
    let path = format!("/v1/runs/{id}/approvals/call_1_0");
    let (s1, _) = d
        .post(&path, ALPHA, json!({"decision": "approve", "reason": "ok"}))
        .await;
    assert_eq!(s1, StatusCode::OK);
    let (s2, _) = d.post(&path, ALPHA, json!({"decision": "approve"})).await;
    assert_eq!(s2, StatusCode::OK);
    let done = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(done["output"], "finished");
    let (s3, r3) = d.post(&path, ALPHA, json!({"decision": "approve"})).await;
    assert_eq!(
        (s3, r3["status"].as_str()),
        (StatusCode::OK, Some("succeeded"))
    );
    assert_eq!(d.ledger.total(), 1, "the tool ran exactly once");
    assert!(d.ledger.duplicates().is_empty());
    // The opposite decision afterwards conflicts.
    let (s, b) = d.post(&path, ALPHA, json!({"decision": "reject"})).await;
    assert_error(s, &b, StatusCode::CONFLICT, "invalid_state");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_unknown_calls_and_bad_decisions() {
    let d = TestDaemon::start().await;
    let id = d.create(ALPHA, "approver").await;
    d.wait_status(ALPHA, &id, "waiting_approval").await;
    let (s, b) = d
        .post(
            &format!("/v1/runs/{id}/approvals/call_9_9"),
            ALPHA,
            json!({"decision": "approve"}),
        )
        .await;
    assert_error(s, &b, StatusCode::NOT_FOUND, "not_found");
    let (s, b) = d
        .post(
            &format!("/v1/runs/{id}/approvals/call_a%7Bb%7D"),
            ALPHA,
            json!({"decision": "approve"}),
        )
        .await;
    assert_error(s, &b, StatusCode::NOT_FOUND, "not_found");
    let (s, b) = d
        .post(
            &format!("/v1/runs/{id}/approvals/call_1_0"),
            ALPHA,
            json!({"decision": "maybe"}),
        )
        .await;
    assert_error(s, &b, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request");
    let (s, b) = d
        .post(
            &format!("/v1/runs/{id}/approvals/call_1_0"),
            ALPHA,
            json!({"decision": "reject", "arguments": {}}),
        )
        .await;
    assert_error(s, &b, StatusCode::UNPROCESSABLE_ENTITY, "invalid_argument");
    let (s, b) = d
        .post(
            &format!("/v1/runs/{id}/approvals/call_1_0"),
            ALPHA,
            json!({"decision": "approve", "arguments": {"item": 5}}),
        )
        .await;
    assert_error(s, &b, StatusCode::UNPROCESSABLE_ENTITY, "invalid_argument");
    // Edited arguments are an object: a number, string or list is the wrong shape, even
    // for a tool whose schema would take any object.
    for not_an_object in [json!(0.0), json!("x"), json!([1]), json!(true)] {
        let (s, b) = d
            .post(
                &format!("/v1/runs/{id}/approvals/call_1_0"),
                ALPHA,
                json!({"decision": "approve", "arguments": not_an_object}),
            )
            .await;
        assert_error(s, &b, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request");
    }
    let before = d.get(&format!("/v1/runs/{id}"), ALPHA).await.1;
    assert_eq!(
        before["status"], "waiting_approval",
        "bad requests changed nothing"
    );

    let (s, r) = d
        .post(
            &format!("/v1/runs/{id}/approvals/call_1_0"),
            ALPHA,
            json!({"decision": "reject", "reason": "no"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{r}");
    d.wait_run(ALPHA, &id, |v| v["status"] != "waiting_approval")
        .await;
    let (s, _) = d
        .post(
            &format!("/v1/runs/{id}/approvals/call_1_0"),
            ALPHA,
            json!({"decision": "reject", "reason": "no"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "a repeated rejection answers the same");
    d.wait_run(ALPHA, &id, |v| {
        v["status"] == "succeeded" || v["status"] == "failed"
    })
    .await;
    assert_eq!(d.ledger.total(), 0, "a rejected call never runs");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_answers_a_waiting_run() {
    let d = TestDaemon::start().await;
    let id = d.create(ALPHA, "asker").await;
    let w = d.wait_status(ALPHA, &id, "waiting_input").await;
    assert_eq!(w["awaiting_input"], "which color?");
    let (s, b) = d
        .post(
            &format!("/v1/runs/{id}/input"),
            ALPHA,
            json!({"text": "x".repeat(2000)}),
        )
        .await;
    assert_error(s, &b, StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large");
    let (s, b) = d
        .post(
            &format!("/v1/runs/{id}/input"),
            ALPHA,
            json!({"txt": "blue"}),
        )
        .await;
    assert_error(s, &b, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request");
    let (s, _) = d
        .post(
            &format!("/v1/runs/{id}/input"),
            ALPHA,
            json!({"text": "blue"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let done = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(done["output"], "you said blue");
    assert!(done["awaiting_input"].is_null());
    let (s, b) = d
        .post(
            &format!("/v1/runs/{id}/input"),
            ALPHA,
            json!({"text": "again"}),
        )
        .await;
    assert_error(s, &b, StatusCode::CONFLICT, "invalid_state");
    d.stop().await;
}
