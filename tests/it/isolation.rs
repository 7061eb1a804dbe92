//! Tenant isolation, generated from `api::ROUTES`: every authenticated route is tried with the
//! owner's token, another tenant's token, no token and a bad token. A route without a row here
//! fails the test. A route authenticated by a per-call callback token refuses every tenant
//! token.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::daemon_support::{ALPHA, BETA, TestDaemon};

/// How to exercise one route against alpha's run `id` (waiting for approval of `call_1_0`).
struct Row {
    path: String,
    body: Option<Value>,
    sse: bool,
}

fn row(method: &str, path: &str, id: &str) -> Vec<Row> {
    let p = |s: &str| s.replace("{id}", id).replace("{call_id}", "call_1_0");
    match (method, path) {
        ("POST", "/v1/runs") => vec![Row {
            path: p(path),
            body: Some(json!({"agent": "hang", "input": "x"})),
            sse: false,
        }],
        ("GET", "/v1/runs") => vec![Row {
            path: p(path),
            body: None,
            sse: false,
        }],
        ("GET", "/v1/runs/{id}") => vec![Row {
            path: p(path),
            body: None,
            sse: false,
        }],
        ("GET", "/v1/runs/{id}/events") => vec![
            Row {
                path: p(path),
                body: None,
                sse: false,
            },
            Row {
                path: p(path),
                body: None,
                sse: true,
            },
        ],
        ("POST", "/v1/runs/{id}/cancel") => vec![Row {
            path: p(path),
            body: Some(json!({})),
            sse: false,
        }],
        ("POST", "/v1/runs/{id}/approvals/{call_id}") => vec![
            Row {
                path: p(path),
                body: Some(json!({"decision": "reject"})),
                sse: false,
            },
            Row {
                path: p(path),
                body: Some(json!({"decision": "approve"})),
                sse: false,
            },
        ],
        ("POST", "/v1/runs/{id}/input") => vec![Row {
            path: p(path),
            body: Some(json!({"text": "hi"})),
            sse: false,
        }],
        ("GET", "/v1/runs/{id}/messages") => vec![Row {
            path: p(path),
            body: None,
            sse: false,
        }],
        ("GET", "/v1/approvals") => vec![Row {
            path: p(path),
            body: None,
            sse: false,
        }],
        ("GET", "/v1/agents") => vec![Row {
            path: p(path),
            body: None,
            sse: false,
        }],
        other => panic!("no isolation row for route {other:?}: add one"),
    }
}

async fn send(d: &TestDaemon, method: &str, r: &Row, auth: Option<&str>) -> (StatusCode, String) {
    let mut b = d.http.request(
        Method::from_bytes(method.as_bytes()).unwrap(),
        d.url(&r.path),
    );
    if let Some(a) = auth {
        b = b.header("authorization", a);
    }
    if r.sse {
        b = b.header("accept", "text/event-stream");
    }
    if let Some(body) = &r.body {
        b = b.json(body);
    }
    let res = b.send().await.unwrap();
    let status = res.status();
    if r.sse && status.is_success() {
        // Don't read an open stream; the status is what matters.
        return (status, String::new());
    }
    (status, res.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_tenants_see_404_exactly_like_a_missing_run() {
    let d = TestDaemon::start().await;
    let id = d.create(ALPHA, "approver").await;
    d.wait_status(ALPHA, &id, "waiting_approval").await;
    let missing = "run_0000000000000000000000000000dead";
    let before = d.get(&format!("/v1/runs/{id}"), ALPHA).await.1;
    let mut checked = 0;
    for route in agentd::api::ROUTES
        .iter()
        .filter(|r| r.auth == agentd::api::Access::Tenant)
    {
        for r in row(route.method, route.path, &id) {
            let label = format!("{} {} sse={}", route.method, r.path, r.sse);
            // No token, a bad token: 401.
            for auth in [None, Some("Bearer not-a-real-token-at-all")] {
                let (s, _) = send(&d, route.method, &r, auth).await;
                assert_eq!(s, StatusCode::UNAUTHORIZED, "{label} with {auth:?}");
            }
            let beta = format!("Bearer {BETA}");
            let (s_other, body_other) = send(&d, route.method, &r, Some(&beta)).await;
            if route.path.contains("{id}") {
                // Another tenant's run answers exactly like a run that does not exist.
                let missing_row = Row {
                    path: r.path.replace(&id, missing),
                    body: r.body.clone(),
                    sse: r.sse,
                };
                let (s_missing, body_missing) =
                    send(&d, route.method, &missing_row, Some(&beta)).await;
                assert_eq!(s_other, StatusCode::NOT_FOUND, "{label}: {body_other}");
                assert_eq!(
                    (s_other, &body_other),
                    (s_missing, &body_missing),
                    "{label}"
                );
            } else if route.method == "GET"
                && (route.path == "/v1/runs" || route.path == "/v1/approvals")
            {
                assert_eq!(s_other, StatusCode::OK);
                assert!(!body_other.contains(&id), "{label}: beta lists alpha's run");
                // The owner does see it: the check above is not vacuous.
                let (s_own, body_own) =
                    send(&d, route.method, &r, Some(&format!("Bearer {ALPHA}"))).await;
                assert_eq!(s_own, StatusCode::OK, "{label}");
                assert!(
                    body_own.contains(&id),
                    "{label}: alpha does not list its run"
                );
            } else {
                assert!(s_other.is_success(), "{label}: {s_other} {body_other}");
            }
            checked += 1;
        }
    }
    // A route authenticated by a per-call callback token takes no tenant token at all: the
    // owner's, another tenant's, a bad one or none are all 401, for this run or a missing one.
    for route in agentd::api::ROUTES
        .iter()
        .filter(|r| r.auth == agentd::api::Access::CallToken)
    {
        for run in [id.as_str(), missing] {
            let r = Row {
                path: route
                    .path
                    .replace("{id}", run)
                    .replace("{call_id}", "call_1_0"),
                body: Some(json!({"ok": true, "data": 1})),
                sse: false,
            };
            let (alpha, beta) = (format!("Bearer {ALPHA}"), format!("Bearer {BETA}"));
            for auth in [
                None,
                Some("Bearer not-a-real-token-at-all"),
                Some(alpha.as_str()),
                Some(beta.as_str()),
            ] {
                let (s, body) = send(&d, route.method, &r, auth).await;
                assert_eq!(s, StatusCode::UNAUTHORIZED, "{} {auth:?}: {body}", r.path);
            }
            checked += 1;
        }
    }
    assert!(checked >= 10);
    // Nothing another tenant did changed alpha's run.
    let after = d.get(&format!("/v1/runs/{id}"), ALPHA).await.1;
    assert_eq!(before["version"], after["version"], "{after}");
    assert_eq!(after["status"], "waiting_approval");
    // The owner still sees it.
    let (s, _) = d.get(&format!("/v1/runs/{id}"), ALPHA).await;
    assert_eq!(s, StatusCode::OK);
    d.stop().await;
}
