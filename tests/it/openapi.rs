//! The daemon's own `/openapi.json`: named schemas and enums for code generators, every answer
//! the daemon gives valid against them, and requests the document refuses refused by the
//! daemon too (and the other way round).

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::daemon_support::{ALPHA, TestDaemon};

/// A validator for the component schema `name` of `doc` (its `$ref`s resolve in `doc`).
fn validator(doc: &Value, name: &str) -> jsonschema::Validator {
    let mut root = doc.clone();
    root["$ref"] = json!(format!("#/components/schemas/{name}"));
    jsonschema::draft202012::options()
        .build(&root)
        .unwrap_or_else(|e| panic!("schema {name} does not compile: {e}"))
}

fn assert_valid(doc: &Value, name: &str, instance: &Value) {
    let v = validator(doc, name);
    let errors: Vec<String> = v.iter_errors(instance).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{name}: {errors:?}\n{instance:#}");
}

/// Every `$ref` of `v` names an existing component schema.
fn check_refs(doc: &Value, v: &Value) {
    match v {
        Value::Object(m) => {
            if let Some(r) = m.get("$ref").and_then(Value::as_str) {
                let name = r.strip_prefix("#/components/schemas/").unwrap();
                assert!(
                    doc["components"]["schemas"][name].is_object(),
                    "dangling {r}"
                );
            }
            m.values().for_each(|x| check_refs(doc, x));
        }
        Value::Array(a) => a.iter().for_each(|x| check_refs(doc, x)),
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_names_its_schemas_and_every_answer_fits_them() {
    let d = TestDaemon::start().await;
    let (s, _, doc) = d.send(Method::GET, "/openapi.json", None, None).await;
    assert_eq!(s, StatusCode::OK);
    check_refs(&doc, &doc);
    assert_eq!(doc["servers"][0]["url"], "/");
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    for name in schemas.keys() {
        validator(&doc, name);
    }
    let list = &doc["paths"]["/v1/runs"]["get"];
    assert_eq!(
        list["parameters"][0]["schema"]["$ref"],
        "#/components/schemas/RunStatus"
    );
    assert_eq!(
        schemas["RunStatus"]["enum"],
        json!([
            "created",
            "running",
            "waiting_approval",
            "waiting_input",
            "succeeded",
            "failed",
            "cancelled"
        ])
    );
    assert_eq!(
        schemas["EventType"]["enum"].as_array().unwrap().len(),
        agentd::api::openapi::EVENT_TYPES.len()
    );
    // The agent of a new run is one of this daemon's agents, so generated requests name one.
    let mut agents: Vec<&str> = schemas["CreateRun"]["properties"]["agent"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    agents.sort_unstable();
    assert_eq!(agents, ["approver", "asker", "hang", "quick", "slow"]);
    // Bodies and answers are named schemas, not inline ones.
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            if let Some(b) = op.get("requestBody") {
                assert!(
                    b["content"]["application/json"]["schema"]["$ref"].is_string(),
                    "{method} {path}"
                );
            }
            for (code, r) in op["responses"].as_object().unwrap() {
                if let Some(s) = r.pointer("/content/application~1json/schema") {
                    assert!(s["$ref"].is_string(), "{method} {path} {code}");
                }
            }
        }
    }

    // Real answers, every event type of several runs included, fit the document.
    let quick = d.create(ALPHA, "quick").await;
    d.wait_status(ALPHA, &quick, "succeeded").await;
    let asker = d.create(ALPHA, "asker").await;
    d.wait_status(ALPHA, &asker, "waiting_input").await;
    let (s, run) = d
        .post(
            &format!("/v1/runs/{asker}/input"),
            ALPHA,
            json!({"text": "blue"}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{run}");
    assert_valid(&doc, "Run", &run);
    d.wait_status(ALPHA, &asker, "succeeded").await;
    let approver = d.create(ALPHA, "approver").await;
    d.wait_status(ALPHA, &approver, "waiting_approval").await;
    let (_, approvals) = d.get("/v1/approvals", ALPHA).await;
    assert_valid(&doc, "ApprovalList", &approvals);
    let (_, run) = d.get(&format!("/v1/runs/{approver}"), ALPHA).await;
    assert_valid(&doc, "Run", &run);
    let call = run["pending_approvals"][0]["call_id"].as_str().unwrap();
    let (s, _) = d
        .post(
            &format!("/v1/runs/{approver}/approvals/{call}"),
            ALPHA,
            json!({"decision": "reject", "reason": null}),
        )
        .await;
    assert_eq!(s, StatusCode::OK);
    let hang = d.create(ALPHA, "hang").await;
    let (s, run) = d
        .post(&format!("/v1/runs/{hang}/cancel"), ALPHA, json!({}))
        .await;
    assert_eq!(s, StatusCode::OK);
    assert_valid(&doc, "Run", &run);
    for id in [&quick, &asker, &approver, &hang] {
        let run = d
            .wait_run(ALPHA, id, |r| {
                ["succeeded", "failed", "cancelled"].contains(&r["status"].as_str().unwrap())
            })
            .await;
        assert_valid(&doc, "Run", &run);
        let (_, events) = d.get(&format!("/v1/runs/{id}/events"), ALPHA).await;
        assert_valid(&doc, "EventList", &events);
        let (_, messages) = d.get(&format!("/v1/runs/{id}/messages"), ALPHA).await;
        assert_valid(&doc, "MessageList", &messages);
    }
    let (_, runs) = d.get("/v1/runs?limit=2", ALPHA).await;
    assert_valid(&doc, "RunList", &runs);
    let (_, agents) = d.get("/v1/agents", ALPHA).await;
    assert_valid(&doc, "AgentList", &agents);
    for path in ["/healthz", "/readyz"] {
        let (_, _, v) = d.send(Method::GET, path, None, None).await;
        assert_valid(&doc, "Health", &v);
    }
    for (method, path, token) in [
        (Method::GET, "/v1/runs", None),
        (Method::GET, "/v1/runs/run_nope", Some(ALPHA)),
        (Method::GET, "/v1/runs?status=bogus", Some(ALPHA)),
    ] {
        let (s, _, v) = d.send(method, path, token, None).await;
        assert!(s.is_client_error(), "{path}: {s}");
        assert_valid(&doc, "Error", &v);
    }
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_is_exactly_as_strict_as_the_daemon() {
    let d = TestDaemon::start().await;
    let (_, _, doc) = d.send(Method::GET, "/openapi.json", None, None).await;
    let create = validator(&doc, "CreateRun");
    let max_turns = agentd::config::LimitsConfig::default().max_turns;
    let bodies = [
        json!({"agent": "quick", "input": "go"}),
        json!({"agent": "quick", "input": {"any": ["json"]}}),
        json!({"agent": "quick", "input": "go", "budget": null}),
        json!({"agent": "quick", "input": "go", "idempotency_key": null}),
        json!({"agent": "quick", "input": "go", "budget": {"max_turns": null, "max_tool_calls": null, "max_tokens": null, "deadline": null}}),
        json!({"agent": "quick", "input": "go", "budget": {"max_turns": max_turns}}),
        json!({"agent": "quick", "input": "go", "budget": {"max_turns": max_turns + 1}}),
        json!({"agent": "quick", "input": "go", "budget": {"max_turns": 0}}),
        json!({"agent": "quick", "input": "go", "budget": {"max_turns": 12.0}}),
        json!({"agent": "quick", "input": "go", "budget": {"max_turns": 1.5}}),
        json!({"agent": "quick", "input": "go", "budget": [null, null]}),
        json!({"agent": "quick", "input": "go", "budget": {"max_tokens": 10_000_001}}),
        json!({"agent": "quick", "input": "go", "budget": {"colour": 1}}),
        json!({"agent": "quick", "input": "go", "idempotency_key": "ok-key_1.2:3"}),
        json!({"agent": "quick", "input": "go", "idempotency_key": "has space"}),
        json!({"agent": "quick", "input": "go", "idempotency_key": ""}),
        json!({"agent": "quick", "input": "go", "idempotency_key": "é"}),
        json!({"agent": "quick", "input": "go", "idempotency_key": "k".repeat(256)}),
        json!({"agent": "quick", "input": null}),
        json!({"agent": "quick"}),
        json!({"agent": "no_such_agent", "input": "go"}),
        json!({"agent": "quick", "input": "go", "extra": 1}),
    ];
    for body in bodies {
        let (s, v) = d.post("/v1/runs", ALPHA, body.clone()).await;
        assert_eq!(
            create.is_valid(&body),
            s.is_success(),
            "document and daemon disagree on {body}: {s} {v}"
        );
        if !s.is_success() {
            assert_valid(&doc, "Error", &v);
        }
    }
    let id = d.create(ALPHA, "asker").await;
    d.wait_status(ALPHA, &id, "waiting_input").await;
    let input = validator(&doc, "Input");
    for body in [json!({"text": ""}), json!({"text": 1}), json!({})] {
        let (s, _) = d
            .post(&format!("/v1/runs/{id}/input"), ALPHA, body.clone())
            .await;
        assert!(!input.is_valid(&body) && s.is_client_error(), "{body}: {s}");
    }
    let params = doc["paths"]["/v1/runs/{id}/events"]["get"]["parameters"]
        .as_array()
        .unwrap();
    let limit = params.iter().find(|p| p["name"] == "limit").unwrap();
    let limit_schema = jsonschema::draft202012::options()
        .build(&limit["schema"])
        .unwrap();
    for (q, n) in [("limit=0", 0u64), ("limit=1", 1), ("limit=5000", 5000)] {
        let (s, _) = d.get(&format!("/v1/runs/{id}/events?{q}"), ALPHA).await;
        assert_eq!(limit_schema.is_valid(&json!(n)), s.is_success(), "{q}: {s}");
    }
    d.stop().await;
}

/// Every error code the API answers has its row in `docs/api.md` (and in `api/error.rs`).
#[test]
fn every_error_code_is_documented_with_its_status() {
    let docs = include_str!("../../docs/api.md");
    let source = include_str!("../../src/api/error.rs");
    for code in agentd::api::openapi::ERROR_CODES {
        let row = format!("| `{code}` | ");
        assert!(docs.contains(&row), "docs/api.md has no row for {code}");
        assert!(
            source.contains(&row),
            "src/api/error.rs has no row for {code}"
        );
    }
}
