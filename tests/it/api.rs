//! Every route and every error code of the HTTP API.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::daemon_support::{ALPHA, BETA, TestDaemon, assert_error};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_get_list_events_and_agents() {
    let d = TestDaemon::start().await;
    let (s, h, run) = d
        .send(
            Method::POST,
            "/v1/runs",
            Some(ALPHA),
            Some(
                json!({"agent": "quick", "input": "1+2?", "metadata": {"ticket": 7},
                        "budget": {"max_turns": 5, "deadline": "5m"}}),
            ),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{run}");
    let id = run["id"].as_str().unwrap();
    assert!(id.starts_with("run_"));
    assert_eq!(h["location"], format!("/v1/runs/{id}").as_str());
    for key in [
        "id",
        "agent",
        "status",
        "phase",
        "turn",
        "usage",
        "budget",
        "pending_approvals",
        "awaiting_input",
        "output",
        "error",
        "created_at",
        "updated_at",
        "version",
    ] {
        assert!(run.get(key).is_some(), "missing {key} in {run}");
    }
    assert_eq!(run["budget"]["max_turns"], 5);
    assert!(run["budget"]["deadline"].as_str().unwrap().ends_with('Z'));
    assert_eq!(run["metadata"]["ticket"], 7);

    let done = d.wait_status(ALPHA, id, "succeeded").await;
    assert_eq!(done["output"], "3");
    assert_eq!(done["usage"]["tool_calls"], 1);
    assert!(done["error"].is_null());

    let (s, ev) = d.get(&format!("/v1/runs/{id}/events"), ALPHA).await;
    assert_eq!(s, StatusCode::OK);
    let events = ev["events"].as_array().unwrap();
    let seqs: Vec<u64> = events.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
    assert_eq!(events[0]["type"], "run_created");
    assert_eq!(events.last().unwrap()["type"], "run_succeeded");
    assert_eq!(seqs.len() as u64, done["version"].as_u64().unwrap());
    let (_, after) = d.get(&format!("/v1/runs/{id}/events?after=2"), ALPHA).await;
    assert_eq!(after["events"][0]["seq"], 3);

    // Listing: newest first, filters, pagination.
    let second = d.create(ALPHA, "hang").await;
    let (s, list) = d.get("/v1/runs", ALPHA).await;
    assert_eq!(s, StatusCode::OK);
    let ids: Vec<&str> = list["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![second.as_str(), id]);
    let (_, page) = d.get("/v1/runs?limit=1", ALPHA).await;
    assert_eq!(page["runs"].as_array().unwrap().len(), 1);
    let cursor = page["next_cursor"].as_str().unwrap();
    let (_, page2) = d
        .get(&format!("/v1/runs?limit=1&cursor={cursor}"), ALPHA)
        .await;
    assert_eq!(page2["runs"][0]["id"], id);
    assert!(page2["next_cursor"].is_null());
    let (_, f) = d.get("/v1/runs?status=succeeded", ALPHA).await;
    assert_eq!(f["runs"].as_array().unwrap().len(), 1);
    let (_, f) = d.get("/v1/runs?agent=hang", ALPHA).await;
    assert_eq!(f["runs"][0]["id"], second.as_str());
    let (s, b) = d.get("/v1/runs?status=bogus", ALPHA).await;
    assert_error(s, &b, StatusCode::BAD_REQUEST, "invalid_query");
    let (s, b) = d.get("/v1/runs?limit=abc", ALPHA).await;
    assert_error(s, &b, StatusCode::BAD_REQUEST, "invalid_query");
    let (s, b) = d
        .get(&format!("/v1/runs/{id}/events?after=-1"), ALPHA)
        .await;
    assert_error(s, &b, StatusCode::BAD_REQUEST, "invalid_query");

    let (s, agents) = d.get("/v1/agents", ALPHA).await;
    assert_eq!(s, StatusCode::OK);
    let quick = agents["agents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["name"] == "quick")
        .unwrap();
    assert_eq!(quick["model"], "quick");
    assert!(
        quick["tools"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["name"] == "add" && t["parameters"].is_object())
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_key_returns_the_same_run() {
    let d = TestDaemon::start().await;
    let body = json!({"agent": "hang", "input": "x", "idempotency_key": "k-1"});
    let (s1, r1) = d.post("/v1/runs", ALPHA, body.clone()).await;
    let (s2, r2) = d.post("/v1/runs", ALPHA, body.clone()).await;
    assert_eq!((s1, s2), (StatusCode::CREATED, StatusCode::OK));
    assert_eq!(r1["id"], r2["id"]);
    // Another tenant's key space is its own.
    let (s3, r3) = d.post("/v1/runs", BETA, body).await;
    assert_eq!(s3, StatusCode::CREATED);
    assert_ne!(r3["id"], r1["id"]);
    // The same key with another input.
    let (s, b) = d
        .post(
            "/v1/runs",
            ALPHA,
            json!({"agent": "hang", "input": "other", "idempotency_key": "k-1"}),
        )
        .await;
    assert_error(
        s,
        &b,
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency_key_mismatch",
    );
    let (s, b) = d
        .post(
            "/v1/runs",
            ALPHA,
            json!({"agent": "hang", "input": "x", "idempotency_key": "bad key\n"}),
        )
        .await;
    assert_error(s, &b, StatusCode::UNPROCESSABLE_ENTITY, "invalid_argument");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_the_documented_codes() {
    let d = TestDaemon::start().await;
    let raw = |body: &'static str| {
        d.http
            .post(d.url("/v1/runs"))
            .bearer_auth(ALPHA)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    for body in [
        r#"{"agent":"#,
        "not json",
        r#"{"agent":"quick","input":"x"} trailing"#,
        "",
    ] {
        let res = raw(body).await.unwrap();
        let s = res.status();
        let v: Value = res.json().await.unwrap();
        assert_error(s, &v, StatusCode::BAD_REQUEST, "invalid_json");
    }
    for body in [
        json!({"agent": 5, "input": "x"}),
        json!({"input": "x"}),
        json!({"agent": "quick", "input": "x", "surprise": 1}),
        json!({"agent": "quick", "input": "x", "budget": {"max_turns": -1}}),
        json!({"agent": "quick", "input": "x", "budget": {"max_turns": 1.5}}),
        json!({"agent": "quick", "input": "x", "budget": {"max_turns": 1e10}}),
        json!({"agent": "quick", "input": "x", "budget": [null, null]}),
        json!({"agent": "quick", "input": "x", "budget": "5m"}),
        json!([1, 2]),
    ] {
        let (s, b) = d.post("/v1/runs", ALPHA, body.clone()).await;
        assert_error(s, &b, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request");
    }
    for body in [
        json!({"agent": "quick", "input": "x", "budget": {"max_turns": 0}}),
        json!({"agent": "quick", "input": "x", "budget": {"max_turns": 100000}}),
        // A JSON Schema integer written with a fraction of zero is that integer.
        json!({"agent": "quick", "input": "x", "budget": {"max_turns": 1e9}}),
        json!({"agent": "quick", "input": "x", "budget": {"deadline": "soon"}}),
        json!({"agent": "quick", "input": "x", "budget": {"deadline": "1000d"}}),
        json!({"agent": "quick", "input": null}),
    ] {
        let (s, b) = d.post("/v1/runs", ALPHA, body.clone()).await;
        assert_error(s, &b, StatusCode::UNPROCESSABLE_ENTITY, "invalid_argument");
    }
    let (s, b) = d
        .post("/v1/runs", ALPHA, json!({"agent": "nope", "input": "x"}))
        .await;
    assert_error(s, &b, StatusCode::UNPROCESSABLE_ENTITY, "unknown_agent");

    // Oversized: declared length, and a streamed (chunked) body without a length.
    let big = format!(r#"{{"agent":"quick","input":"{}"}}"#, "a".repeat(70_000));
    let res = d
        .http
        .post(d.url("/v1/runs"))
        .bearer_auth(ALPHA)
        .body(big.clone())
        .send()
        .await
        .unwrap();
    let s = res.status();
    assert_error(
        s,
        &res.json().await.unwrap(),
        StatusCode::PAYLOAD_TOO_LARGE,
        "payload_too_large",
    );
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = big
        .into_bytes()
        .chunks(8192)
        .map(|c| Ok(c.to_vec()))
        .collect();
    let res = d
        .http
        .post(d.url("/v1/runs"))
        .bearer_auth(ALPHA)
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await;
    // The limit is enforced while streaming: either the 413 arrives, or the server closes the
    // connection before the client finished sending (hyper's behaviour for unread bodies).
    if let Ok(res) = res {
        let s = res.status();
        assert_error(
            s,
            &res.json().await.unwrap(),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        );
    }
    let (s, _, _) = d.send(Method::GET, "/healthz", None, None).await;
    assert_eq!(s, StatusCode::OK);

    // Ids with traversal or key-breaking characters never reach the store: 404.
    for path in [
        "/v1/runs/run_..%2F..",
        "/v1/runs/run_a%7Bb%7D",
        "/v1/runs/..%2F..%2Fetc%2Fpasswd",
        "/v1/runs/run_a:b",
        "/v1/runs/job_1",
        "/v1/runs/run_..%2F../events",
    ] {
        let (s, b) = d.get(path, ALPHA).await;
        assert_error(s, &b, StatusCode::NOT_FOUND, "not_found");
    }
    let long = format!("/v1/runs/run_{}", "a".repeat(10_000));
    let (s, b) = d.get(&long, ALPHA).await;
    assert_error(s, &b, StatusCode::NOT_FOUND, "not_found");
    let (s, b) = d
        .post(
            "/v1/runs/run_..%2F../approvals/call_1_0",
            ALPHA,
            json!({"decision": "approve"}),
        )
        .await;
    assert_error(s, &b, StatusCode::NOT_FOUND, "not_found");
    // Unknown route and wrong method.
    let (s, b) = d.get("/v1/nothing", ALPHA).await;
    assert_error(s, &b, StatusCode::NOT_FOUND, "not_found");
    let (s, _, b) = d.send(Method::DELETE, "/v1/runs", Some(ALPHA), None).await;
    assert_error(s, &b, StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_requests_get_401_with_the_same_body() {
    let d = TestDaemon::start().await;
    let mut bodies = Vec::new();
    for auth in [
        None,
        Some("Bearer"),
        Some("Bearer "),
        Some("Basic YWxwaGE6eA=="),
        Some("Bearer wrong-token-000000000"),
        Some("Bearer alpha-token-012345678"),
    ] {
        let mut b = d.http.get(d.url("/v1/runs"));
        if let Some(a) = auth {
            b = b.header("authorization", a);
        }
        let res = b.send().await.unwrap();
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED, "{auth:?}");
        assert_eq!(res.headers()["www-authenticate"], "Bearer");
        bodies.push(res.text().await.unwrap());
    }
    assert!(bodies.windows(2).all(|w| w[0] == w[1]));
    let v: Value = serde_json::from_str(&bodies[0]).unwrap();
    assert_eq!(v["error"]["code"], "unauthenticated");
    let huge = format!("Bearer {}", "x".repeat(64 * 1024));
    let res = d
        .http
        .get(d.url("/v1/runs"))
        .header("authorization", huge)
        .send()
        .await
        .unwrap();
    assert!(res.status() == StatusCode::UNAUTHORIZED || res.status().as_u16() == 431);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operational_routes_need_no_token_and_leak_nothing() {
    let d = TestDaemon::start().await;
    let id = d.create(ALPHA, "quick").await;
    d.wait_status(ALPHA, &id, "succeeded").await;
    let (s, _, v) = d.send(Method::GET, "/healthz", None, None).await;
    assert_eq!((s, v["status"].as_str()), (StatusCode::OK, Some("ok")));
    let (s, _, v) = d.send(Method::GET, "/readyz", None, None).await;
    assert_eq!((s, v["status"].as_str()), (StatusCode::OK, Some("ready")));
    let (s, _, v) = d.send(Method::GET, "/openapi.json", None, None).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["openapi"], "3.1.0");
    for r in agentd::api::ROUTES {
        assert!(
            v["paths"][r.path][r.method.to_lowercase()].is_object(),
            "{} {}",
            r.method,
            r.path
        );
    }
    let res = d.http.get(d.url("/metrics")).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(
        res.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let text = res.text().await.unwrap();
    assert!(text.contains("agentd_runs_entered_total"), "{text}");
    assert!(
        text.contains(
            r#"agentd_http_requests_total{method="POST",route="/v1/runs",status="201"} 1"#
        ),
        "{text}"
    );
    assert!(text.contains("agentd_ready 1"));
    // Every family has HELP and TYPE before its samples, and its samples are together.
    let mut described: std::collections::HashMap<String, (bool, bool)> = Default::default();
    let mut done: std::collections::HashSet<String> = Default::default();
    let mut current = String::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            described
                .entry(rest.split(' ').next().unwrap().to_owned())
                .or_default()
                .0 = true;
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            described
                .entry(rest.split(' ').next().unwrap().to_owned())
                .or_default()
                .1 = true;
        } else if !line.is_empty() {
            let name = line.split(['{', ' ']).next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| described.contains_key(*f)))
                .unwrap_or(name)
                .to_owned();
            assert_eq!(
                described.get(&family),
                Some(&(true, true)),
                "{family} lacks HELP or TYPE"
            );
            if family != current {
                assert!(done.insert(family.clone()), "{family}'s samples are split");
                current = family;
            }
        }
    }
    assert!(done.len() >= 20, "{done:?}");
    for secret in ["alpha", "beta", ALPHA, BETA] {
        assert!(!text.contains(secret), "metrics mention {secret}");
    }
    // Labelled by configured names only: the run's model and tool, no tenant by default.
    for family in [
        "agentd_model_tokens_total",
        "agentd_model_call_latency_seconds",
        "agentd_tool_call_latency_seconds",
        "agentd_tool_calls_total",
        "agentd_trace_spans_dropped_total",
    ] {
        assert!(done.contains(family), "{family} missing: {done:?}");
    }
    assert!(
        sample(
            &text,
            r#"agentd_model_tokens_total{model="quick",kind="prompt"}"#
        ) > 0.0,
        "{text}"
    );
    assert!(
        sample(
            &text,
            r#"agentd_model_tokens_total{model="quick",kind="completion"}"#
        ) > 0.0
    );
    assert_eq!(
        sample(
            &text,
            r#"agentd_model_call_latency_seconds_count{model="quick"}"#
        ),
        2.0
    );
    assert_eq!(
        sample(&text, r#"agentd_tool_calls_total{tool="add",outcome="ok"}"#),
        1.0
    );
    assert_eq!(
        sample(
            &text,
            r#"agentd_tool_call_latency_seconds_bucket{tool="add",outcome="ok",le="+Inf"}"#
        ),
        1.0
    );
    assert!(!text.contains("tenant="), "{text}");
    // Request ids: generated, or echoed back.
    let res = d
        .http
        .get(d.url("/healthz"))
        .header("x-request-id", "req-42")
        .send()
        .await
        .unwrap();
    assert_eq!(res.headers()["x-request-id"], "req-42");
    let res = d.http.get(d.url("/healthz")).send().await.unwrap();
    assert!(!res.headers()["x-request-id"].is_empty());
    d.stop().await;
}

/// The value of the sample whose name and labels are exactly `series`.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no sample {series}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_carry_configured_tenant_labels_only_when_asked() {
    let d = TestDaemon::start_with(|c| c.telemetry.tenant_labels = true).await;
    let a = d.create(ALPHA, "quick").await;
    d.wait_status(ALPHA, &a, "succeeded").await;
    let b = d.create(BETA, "slow").await;
    d.wait_status(BETA, &b, "succeeded").await;
    let text = d
        .http
        .get(d.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        sample(
            &text,
            r#"agentd_model_tokens_total{model="quick",kind="prompt",tenant="alpha"}"#
        ) > 0.0,
        "{text}"
    );
    assert!(
        sample(
            &text,
            r#"agentd_model_tokens_total{model="slow",kind="prompt",tenant="beta"}"#
        ) > 0.0
    );
    assert_eq!(
        sample(
            &text,
            r#"agentd_tenant_runs_entered_total{tenant="alpha",status="succeeded"}"#
        ),
        1.0
    );
    assert_eq!(
        sample(
            &text,
            r#"agentd_tenant_runs_entered_total{tenant="beta",status="created"}"#
        ),
        1.0
    );
    assert_eq!(
        sample(
            &text,
            r#"agentd_tool_calls_total{tool="echo",outcome="ok"}"#
        ),
        3.0
    );
    assert!(text.contains("# TYPE agentd_tenant_runs_entered_total counter"));
    assert!(!text.contains(ALPHA) && !text.contains(BETA));
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_active_runs_is_429_with_retry_after_per_tenant() {
    let d = TestDaemon::start_with(|c| c.limits.max_active_runs_per_tenant = 1).await;
    d.create(ALPHA, "hang").await;
    let (s, h, b) = d
        .send(
            Method::POST,
            "/v1/runs",
            Some(ALPHA),
            Some(json!({"agent": "hang", "input": "x"})),
        )
        .await;
    assert_error(s, &b, StatusCode::TOO_MANY_REQUESTS, "too_many_active_runs");
    assert!(h["retry-after"].to_str().unwrap().parse::<u64>().unwrap() > 0);
    d.create(BETA, "hang").await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_are_the_transcript_redacted_paginated_and_tenant_isolated() {
    let d = TestDaemon::start_with(|c| c.secrets.patterns = vec!["sk-[a-z0-9]{6,}".into()]).await;
    let (s, _, run) = d
        .send(
            Method::POST,
            "/v1/runs",
            Some(ALPHA),
            Some(json!({"agent": "quick", "input": "1+2? key sk-abc123def"})),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{run}");
    let id = run["id"].as_str().unwrap();
    d.wait_status(ALPHA, id, "succeeded").await;

    let (s, all) = d.get(&format!("/v1/runs/{id}/messages"), ALPHA).await;
    assert_eq!(s, StatusCode::OK, "{all}");
    assert!(!all.to_string().contains("sk-abc123def"), "redacted: {all}");
    assert!(all["next_cursor"].is_null(), "{all}");
    let messages = all["messages"].as_array().unwrap();
    let roles: Vec<&str> = messages
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"], "{all}");
    let indexes: Vec<u64> = messages
        .iter()
        .map(|m| m["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indexes, [1, 2, 3, 4]);
    for m in messages {
        for key in ["index", "role", "content", "tool_calls", "tool_call_id"] {
            assert!(m.get(key).is_some(), "missing {key} in {m}");
        }
    }
    assert!(messages[0]["content"].as_str().unwrap().starts_with("1+2?"));
    let call = &messages[1]["tool_calls"][0];
    assert_eq!(call["name"], "add");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"a": 1, "b": 2}));
    assert_eq!(messages[2]["tool_call_id"], call["id"]);
    assert!(messages[2]["content"].as_str().unwrap().contains('3'));
    assert_eq!(messages[3]["content"], "3");
    assert_eq!(messages[3]["tool_calls"], json!([]));

    // Pages: next_cursor is the `after` of the next page, and the pages add up to the whole.
    let mut paged = Vec::new();
    let mut after = 0;
    loop {
        let (s, page) = d
            .get(
                &format!("/v1/runs/{id}/messages?limit=3&after={after}"),
                ALPHA,
            )
            .await;
        assert_eq!(s, StatusCode::OK, "{page}");
        paged.extend(page["messages"].as_array().unwrap().iter().cloned());
        match page["next_cursor"].as_u64() {
            Some(next) => after = next,
            None => break,
        }
    }
    assert_eq!(&paged, messages);
    let (_, past) = d
        .get(&format!("/v1/runs/{id}/messages?after=99"), ALPHA)
        .await;
    assert_eq!(past["messages"], json!([]));

    for bad in ["limit=0", "limit=x", "after=-1", "colour=red"] {
        let (s, body) = d.get(&format!("/v1/runs/{id}/messages?{bad}"), ALPHA).await;
        assert_error(s, &body, StatusCode::BAD_REQUEST, "invalid_query");
    }
    let (s, body) = d.get(&format!("/v1/runs/{id}/messages"), BETA).await;
    assert_error(s, &body, StatusCode::NOT_FOUND, "not_found");
    d.stop().await;
}
