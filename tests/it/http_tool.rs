//! `HttpTool` against the recording tool server: the wire contract, classification by what
//! may have been applied, output capping, and reconciliation through the status URL.

use std::time::Duration;

use agentd::ids::{CallId, RunId};
use agentd::tool::http::HttpTool;
use agentd::tool::{Tool, ToolContext, ToolEffect, ToolErrorCode, ToolResult, ToolSpec};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::fakes::{ToolBehavior, ToolServer};

fn spec(effect: ToolEffect) -> ToolSpec {
    ToolSpec::new(
        "restart_service",
        "Restart one service",
        json!({"type": "object"}),
    )
    .effect(effect)
    .timeout(Duration::from_millis(400))
    .max_output_bytes(256)
}

fn ctx(key: &str) -> ToolContext {
    ToolContext {
        tenant: "alpha".into(),
        run_id: RunId::generate(),
        call_id: CallId::new(1, 0),
        idempotency_key: key.to_owned(),
        cancel: CancellationToken::new(),
        long_running: Default::default(),
    }
}

fn tool(server: &ToolServer, effect: ToolEffect) -> HttpTool {
    HttpTool::new(spec(effect), &server.tool_url(), Some(&server.status_url())).unwrap()
}

/// Every test call is bounded, whatever the tool does.
async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .expect("call must end")
}

#[tokio::test]
async fn success_sends_the_contract_and_returns_the_json() {
    let server = ToolServer::start().await;
    let t = tool(&server, ToolEffect::Unsafe).with_bearer_token("tool-token-123");
    assert!(t.spec().reconcilable);
    assert!(!format!("{t:?}").contains("tool-token-123"));
    let c = ctx("key-1");
    let out = bounded(t.call(&c, json!({"service": "api"})))
        .await
        .unwrap();
    assert_eq!(out["applied"], true);
    assert_eq!(out["arguments"], json!({"service": "api"}));
    let reqs = server.requests();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].idempotency_key.as_deref(), Some("key-1"));
    assert_eq!(
        reqs[0].authorization.as_deref(),
        Some("Bearer tool-token-123")
    );
    assert_eq!(
        reqs[0].body,
        json!({"tool": "restart_service", "arguments": {"service": "api"},
               "run_id": c.run_id.as_str(), "call_id": c.call_id.as_str()})
    );
    assert_eq!(server.executions("key-1"), 1);
}

#[tokio::test]
async fn client_errors_fail_with_the_server_message_and_refusals_are_retryable() {
    let server = ToolServer::start().await;
    server
        .push(ToolBehavior::Refuse(
            400,
            "service \"x\" does not exist".into(),
        ))
        .push(ToolBehavior::Refuse(403, "not allowed".into()))
        .push(ToolBehavior::Refuse(429, "slow down".into()))
        .push(ToolBehavior::Refuse(408, "request timeout".into()))
        .push(ToolBehavior::Refuse(422, "x".repeat(5000)));
    let t = tool(&server, ToolEffect::Unsafe);
    let expected = [
        ToolErrorCode::Failed,
        ToolErrorCode::Permission,
        ToolErrorCode::Retryable,
        ToolErrorCode::Retryable,
        ToolErrorCode::Failed,
    ];
    let mut errors = Vec::new();
    for code in expected {
        let err = bounded(t.call(&ctx("k"), json!({}))).await.unwrap_err();
        assert_eq!(err.code, code, "{err}");
        errors.push(err);
    }
    assert_eq!(errors[0].message, "HTTP 400: service \"x\" does not exist");
    // The tool passes the message on whole (bounded by its 16 KiB error-body read); the
    // executor redacts it, then cuts it.
    assert!(
        errors[4].message.len() <= 16 * 1024 + 16,
        "bounded by the read"
    );
    let sent = agentd::tool::ToolResult::failure(errors[4].clone())
        .sanitized(&agentd::redact::Redactor::new(), 1024);
    assert!(
        sent.error.unwrap().message.chars().count() <= agentd::tool::MAX_ERROR_MESSAGE_CHARS + 1,
        "message must be bounded"
    );
    assert_eq!(server.total_executions(), 0);
}

#[tokio::test]
async fn server_errors_after_applying_are_outcome_unknown_unless_read() {
    let server = ToolServer::start().await;
    server
        .push(ToolBehavior::ApplyThenFail(500))
        .push(ToolBehavior::ApplyThenFail(502));
    let err = bounded(tool(&server, ToolEffect::Unsafe).call(&ctx("u"), json!({})))
        .await
        .unwrap_err();
    assert_eq!(err.code, ToolErrorCode::OutcomeUnknown);
    let err = bounded(tool(&server, ToolEffect::Read).call(&ctx("r"), json!({})))
        .await
        .unwrap_err();
    assert_eq!(err.code, ToolErrorCode::Retryable);
    assert_eq!(server.executions("u"), 1);
}

#[tokio::test]
async fn timeout_after_applying_is_reconciled_through_the_status_url() {
    let server = ToolServer::start().await;
    server.push(ToolBehavior::ApplyThenHang);
    let t = tool(&server, ToolEffect::Unsafe);
    let c = ctx("slow-key");
    let err = bounded(t.call(&c, json!({"service": "db"})))
        .await
        .unwrap_err();
    assert_eq!(err.code, ToolErrorCode::OutcomeUnknown, "{err}");
    // The effect happened: reconciliation finds it, and nothing re-executes.
    let status = bounded(t.status(&c)).await.unwrap();
    assert_eq!(status.unwrap()["arguments"], json!({"service": "db"}));
    assert_eq!(server.executions("slow-key"), 1);
    // A key that never ran is reported as such.
    assert_eq!(bounded(t.status(&ctx("never-ran"))).await.unwrap(), None);
}

#[tokio::test]
async fn a_hanging_read_tool_is_retryable() {
    let server = ToolServer::start().await;
    server.push(ToolBehavior::Hang);
    let err = bounded(tool(&server, ToolEffect::Read).call(&ctx("h"), json!({})))
        .await
        .unwrap_err();
    assert_eq!(err.code, ToolErrorCode::Retryable);
}

#[tokio::test]
async fn refused_connection_is_retryable_even_for_unsafe_tools() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let t = HttpTool::new(
        spec(ToolEffect::Unsafe),
        &format!("http://{addr}/tool"),
        Some(&format!("http://{addr}/status")),
    )
    .unwrap();
    let err = bounded(t.call(&ctx("k"), json!({}))).await.unwrap_err();
    assert_eq!(err.code, ToolErrorCode::Retryable, "{err}");
    let err = bounded(t.status(&ctx("k"))).await.unwrap_err();
    assert_eq!(err.code, ToolErrorCode::Retryable);
}

#[tokio::test]
async fn large_output_is_read_bounded_and_marked_truncated_by_the_envelope() {
    let server = ToolServer::start().await;
    server.push(ToolBehavior::ApplyLarge(1_000_000));
    let t = tool(&server, ToolEffect::Unsafe);
    let out = bounded(t.call(&ctx("big"), json!({}))).await.unwrap();
    let text = out.as_str().unwrap();
    assert!(text.len() <= 256 + agentd::tool::http::OUTPUT_MARGIN_BYTES);
    let envelope = ToolResult::success(out).capped(t.spec().max_output_bytes);
    assert!(envelope.truncated);
}

#[tokio::test]
async fn cancellation_ends_the_call() {
    let server = ToolServer::start().await;
    server.push(ToolBehavior::ApplyThenHang);
    let mut t_spec = spec(ToolEffect::Idempotent);
    t_spec.timeout = Duration::from_secs(60);
    let t = HttpTool::new(t_spec, &server.tool_url(), None).unwrap();
    let c = ctx("cancel-me");
    let cancel = c.cancel.clone();
    let call = t.call(&c, json!({}));
    let (res, ()) = bounded(async { tokio::join!(call, async { cancel.cancel() }) }).await;
    assert_eq!(res.unwrap_err().code, ToolErrorCode::OutcomeUnknown);
}
