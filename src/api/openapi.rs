//! The OpenAPI 3.1 document of the API, written by hand next to API.md. A test checks that its
//! paths and methods are exactly those of `api::ROUTES`.

use serde_json::{Value, json};

use crate::config::LimitsConfig;

fn err(desc: &str) -> Value {
    json!({ "description": desc, "content": { "application/json": { "schema": { "$ref": "#/components/schemas/Error" } } } })
}

fn run_ok(desc: &str) -> Value {
    json!({ "description": desc, "content": { "application/json": { "schema": { "$ref": "#/components/schemas/Run" } } } })
}

fn body(schema: &str, required: bool) -> Value {
    json!({ "required": required, "content": { "application/json": { "schema": { "$ref": format!("#/components/schemas/{schema}") } } } })
}

fn id_param() -> Value {
    json!({ "name": "id", "in": "path", "required": true, "schema": { "type": "string", "pattern": "^run_[A-Za-z0-9_-]+$" } })
}

fn control_responses() -> Value {
    json!({
        "200": run_ok("The run after the request was applied (the same answer when repeated)."),
        "400": err("Invalid JSON."),
        "401": err("Missing or unknown token."),
        "404": err("No such run (or another tenant's), or no such call."),
        "409": err("The run's state does not allow this (`error.status` is the current status)."),
        "413": err("Body too large."),
        "422": err("Wrong shape or value."),
        "503": err("Store unavailable or shutting down.")
    })
}

/// A decision's answers: a control's, plus 403 for a token without the approver scope.
fn decide_responses() -> Value {
    let mut r = control_responses();
    r["403"] = err("The token has scopes, but not `approve` or `approve:<tool>`.");
    r
}

/// Every event type a run's log may hold (`Event.type`).
pub const EVENT_TYPES: &[&str] = &[
    "run_created",
    "run_started",
    "run_resumed",
    "model_replied",
    "model_failed",
    "model_retry",
    "model_retrying",
    "tool_call_accepted",
    "compensation_started",
    "compensation_finished",
    "compensation_retrying",
    "tool_call_finished",
    "tool_retry",
    "tool_retrying",
    "call_approved",
    "call_rejected",
    "call_failed",
    "call_reconciled",
    "approval_expired",
    "input_requested",
    "input_received",
    "input_queued",
    "verification_rejected",
    "control_refused",
    "late_result_ignored",
    "run_succeeded",
    "run_failed",
    "run_cancelled",
];

/// Every `error.code` the API answers (the table of `api/error.rs`).
pub const ERROR_CODES: &[&str] = &[
    "invalid_json",
    "invalid_query",
    "unauthenticated",
    "forbidden",
    "not_found",
    "method_not_allowed",
    "request_timeout",
    "invalid_state",
    "input_queue_full",
    "payload_too_large",
    "invalid_request",
    "invalid_argument",
    "unknown_agent",
    "idempotency_key_mismatch",
    "too_many_active_runs",
    "too_many_streams",
    "inbox_full",
    "internal",
    "store_unavailable",
    "store_reset",
    "shutting_down",
    "timeout",
    "not_ready",
];

/// Phases of a running run (`Run.phase`).
const PHASES: &[&str] = &[
    "building_context",
    "awaiting_model",
    "validating_calls",
    "executing_tools",
    "awaiting_tool",
    "compensating",
    "reconciling",
    "verifying",
];

fn schema_ref(name: &str) -> Value {
    json!({ "$ref": format!("#/components/schemas/{name}") })
}

fn ok_json(desc: &str, schema: &str) -> Value {
    json!({ "description": desc, "content": { "application/json": { "schema": schema_ref(schema) } } })
}

/// The document with the default limits and no agent names (the daemon serves
/// [`document_for`] its own configuration).
pub fn document() -> Value {
    document_for(&LimitsConfig::default(), &[])
}

/// The document for a daemon with these `limits` and `agents` (`CreateRun.agent` is one of
/// them; empty: any name).
pub fn document_for(limits: &LimitsConfig, agents: &[String]) -> Value {
    let mut doc = json!({
        "openapi": "3.1.0",
        "info": {
            "title": "agentd",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Runs LLM agent runs safely: start, follow, cancel, approve and give input."
        },
        "servers": [{ "url": "/", "description": "This daemon (the document is served by it)." }],
        "components": {
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } },
            "schemas": schemas(limits, agents)
        },
        "security": [{ "bearer": [] }],
        "paths": paths(limits)
    });
    if let Some(p) = doc["paths"]["/v1/runs/{id}/messages"]["get"]["responses"].as_object_mut() {
        p.insert("200".into(), ok_json("Messages in order.", "MessageList"));
    }
    doc["components"]["securitySchemes"]["callToken"] = json!({
        "type": "http", "scheme": "bearer",
        "description": "The per-call secret agentd sent to a long-running tool as X-Agentd-Callback-Token; valid for that one call only."
    });
    doc["paths"]["/v1/runs/{id}/calls/{call_id}/result"] = callback_path();
    let (result, taken) = callback_schemas();
    doc["components"]["schemas"]["CallResult"] = result;
    doc["components"]["schemas"]["CallResultTaken"] = taken;
    doc
}

/// `POST /v1/runs/{id}/calls/{call_id}/result` (its own function: one `json!` would nest past
/// the macro's recursion limit).
fn callback_path() -> Value {
    json!({ "post": {
        "operationId": "completeCall",
        "summary": "A long-running tool completes a call it accepted (202); authenticated by that call's callback token only",
        "security": [{ "callToken": [] }],
        "parameters": [id_param(), { "name": "call_id", "in": "path", "required": true, "schema": { "type": "string", "pattern": "^call_[A-Za-z0-9_-]+$" } }],
        "requestBody": body("CallResult", true),
        "responses": {
            "200": ok_json("The result was taken: it is the call's result.", "CallResultTaken"),
            "400": err("Invalid JSON."),
            "401": err("Missing or wrong callback token (a tenant token is not one)."),
            "404": err("No such run or call."),
            "409": err("The call already has its result (the first one wins), or the run has ended."),
            "413": err("Body too large."),
            "422": err("Wrong shape."),
            "503": err("Store unavailable or shutting down.")
        }
    } })
}

/// The callback route's body and answer.
fn callback_schemas() -> (Value, Value) {
    let result = json!({
        "type": "object", "required": ["ok"], "additionalProperties": false,
        "properties": {
            "ok": { "type": "boolean" },
            "data": { "description": "The result (ok: true)." },
            "error": { "type": "object", "required": ["code", "message"], "additionalProperties": false,
                "properties": { "code": { "type": "string" }, "message": { "type": "string" } } }
        }
    });
    let taken = json!({
        "type": "object", "required": ["run_id", "call_id", "accepted"],
        "properties": { "run_id": { "type": "string" }, "call_id": { "type": "string" }, "accepted": { "const": true } }
    });
    (result, taken)
}

fn schemas(limits: &LimitsConfig, agents: &[String]) -> Value {
    let mut agent =
        json!({ "type": "string", "description": "A configured agent (GET /v1/agents)." });
    if !agents.is_empty() {
        agent["enum"] = json!(agents);
    }
    let nullable_int =
        |max: u64| json!({ "type": ["integer", "null"], "minimum": 1, "maximum": max });
    let mut s = json!({
        "ErrorCode": { "type": "string", "enum": ERROR_CODES, "description": "Stable error codes (see docs/api.md)." },
        "Error": {
            "type": "object", "required": ["error"],
            "properties": { "error": { "type": "object", "required": ["code", "message"], "properties": {
                "code": schema_ref("ErrorCode"), "message": { "type": "string" },
                "status": { "allOf": [schema_ref("RunStatus")], "description": "The run's current status (invalid_state only)." } } } }
        },
        "RunStatus": { "type": "string", "enum": crate::run::Status::ALL.map(crate::run::Status::as_str) },
        "Phase": { "type": "string", "enum": PHASES },
        "EventType": { "type": "string", "enum": EVENT_TYPES },
        "Budget": {
            "type": "object", "additionalProperties": false,
            "description": "Caps for this run (null or absent: the agent's own).",
            "properties": {
                "max_turns": nullable_int(u64::from(limits.max_turns)),
                "max_tool_calls": nullable_int(u64::from(limits.max_tool_calls)),
                "max_tokens": nullable_int(limits.max_tokens),
                "deadline": { "type": ["string", "null"], "examples": ["5m"],
                    "description": format!("A duration (e.g. \"90s\", \"5m\", \"1h\"), more than 0s and at most {}.", humantime::format_duration(limits.max_deadline)) } }
        },
        "CreateRun": {
            "type": "object", "required": ["agent", "input"], "additionalProperties": false,
            "properties": {
                "agent": agent,
                "input": { "not": { "type": "null" }, "description": format!("The goal: text or any JSON value (at most {} bytes of JSON).", limits.max_input_bytes) },
                "idempotency_key": { "type": ["string", "null"], "minLength": 1, "maxLength": 255, "pattern": "^[!-~]+$",
                    "description": "Printable ASCII without spaces: the same key returns the same run (200)." },
                "budget": { "oneOf": [schema_ref("Budget"), { "type": "null" }] },
                "metadata": { "description": format!("Any JSON, at most {} bytes.", limits.max_metadata_bytes) }
            }
        },
        "Cancel": { "type": "object", "additionalProperties": false, "properties": {
            "reason": { "type": ["string", "null"], "maxLength": 4096 } } },
        "Decision": {
            "description": "approve (optionally with edited arguments, validated again), reject, or fail: end the run failed (code by why the call waits, e.g. tool_failing).",
            "oneOf": [
                { "type": "object", "required": ["decision"], "additionalProperties": false, "properties": {
                    "decision": { "const": "approve" },
                    "reason": { "type": ["string", "null"], "maxLength": 4096 },
                    "arguments": { "type": ["object", "null"] } } },
                { "type": "object", "required": ["decision"], "additionalProperties": false, "properties": {
                    "decision": { "type": "string", "enum": ["reject", "fail"] },
                    "reason": { "type": ["string", "null"], "maxLength": 4096 },
                    "arguments": { "type": "null", "description": "Arguments may only come with approve." } } }
            ]
        },
        "Input": { "type": "object", "required": ["text"], "additionalProperties": false, "properties": {
            "text": { "type": "string", "minLength": 1, "maxLength": limits.max_input_text_bytes } } },
        "Usage": { "type": "object", "required": ["turns", "tool_calls", "input_tokens", "output_tokens"], "properties": {
            "turns": { "type": "integer", "minimum": 0 }, "tool_calls": { "type": "integer", "minimum": 0 },
            "input_tokens": { "type": "integer", "minimum": 0 }, "output_tokens": { "type": "integer", "minimum": 0 } } },
        "RunBudget": { "type": "object", "required": ["max_turns", "max_tool_calls", "max_tokens", "deadline"], "properties": {
            "max_turns": { "type": "integer" }, "max_tool_calls": { "type": "integer" },
            "max_tokens": { "type": "integer" }, "deadline": { "type": ["string", "null"], "format": "date-time" } } },
        "PendingApproval": { "type": "object", "required": ["call_id", "tool", "arguments", "reason"], "properties": {
            "call_id": { "type": "string" }, "tool": { "type": "string" }, "arguments": {},
            "reason": { "type": "string", "enum": ["approval", "outcome_unknown", "tool_failing", "permission_error"] } } },
        "RunError": { "type": "object", "required": ["code", "message"], "properties": {
            "code": { "type": "string", "description": "e.g. budget_exceeded, no_progress, crash_loop, model_unavailable, approval_denied, verification_failed, outcome_unknown, tool_failing, permission_denied" },
            "message": { "type": "string" } } },
        "Event": {
            "type": "object", "required": ["seq", "at", "type", "data"],
            "properties": { "seq": { "type": "integer", "minimum": 1 }, "at": { "type": "string", "format": "date-time" }, "type": schema_ref("EventType"), "data": {} }
        },
        "EventList": { "type": "object", "required": ["events"], "properties": {
            "events": { "type": "array", "items": schema_ref("Event") } } },
        "Approval": {
            "type": "object",
            "required": ["run_id", "call_id", "agent", "tool", "arguments", "reason", "requested_at", "expires_at"],
            "properties": {
                "run_id": { "type": "string" }, "call_id": { "type": "string" },
                "agent": { "type": "string" }, "tool": { "type": "string" }, "arguments": {},
                "reason": { "type": "string", "enum": ["policy", "outcome_unknown", "tool_failing", "permission_error"] },
                "requested_at": { "type": "string", "format": "date-time" },
                "expires_at": { "type": ["string", "null"], "format": "date-time", "description": "When the tool's approval_timeout decides the call; null: never." }
            }
        },
        "ApprovalList": {
            "type": "object", "required": ["approvals", "next_cursor"],
            "properties": { "approvals": { "type": "array", "items": schema_ref("Approval") }, "next_cursor": { "type": ["string", "null"] } }
        },
        "Tool": { "type": "object", "required": ["name", "description", "parameters"], "properties": {
            "name": { "type": "string" }, "description": { "type": "string" }, "parameters": {} } },
        "Agent": { "type": "object", "required": ["name", "model", "tools"], "properties": {
            "name": { "type": "string" }, "model": { "type": "string" }, "tools": { "type": "array", "items": schema_ref("Tool") } } },
        "AgentList": { "type": "object", "required": ["agents"], "properties": {
            "agents": { "type": "array", "items": schema_ref("Agent") } } },
        "Health": { "type": "object", "required": ["status"], "properties": {
            "status": { "type": "string", "enum": ["ok", "ready"] },
            "quarantined": { "type": "array", "items": { "type": "object", "required": ["id", "reason"], "properties": {
                "id": { "type": "string" }, "reason": { "type": "string" } } } } } }
    });
    s["Run"] = run_schema();
    let (message, list) = message_schemas();
    s["Message"] = message;
    s["MessageList"] = list;
    s["RunList"] = json!({ "type": "object", "required": ["runs", "next_cursor"], "properties": {
        "runs": { "type": "array", "items": schema_ref("Run") }, "next_cursor": { "type": ["string", "null"] } } });
    s
}

fn run_schema() -> Value {
    json!({
        "type": "object",
        "required": ["id", "agent", "status", "phase", "turn", "usage", "budget", "pending_approvals", "awaiting_input", "output", "error", "created_at", "updated_at", "version"],
        "properties": {
            "id": { "type": "string" },
            "agent": { "type": "string" },
            "input": { "description": "The goal as given: text or any JSON value." },
            "status": schema_ref("RunStatus"),
            "phase": { "oneOf": [schema_ref("Phase"), { "type": "null" }] },
            "turn": { "type": "integer", "minimum": 0 },
            "usage": schema_ref("Usage"),
            "budget": schema_ref("RunBudget"),
            "pending_approvals": { "type": "array", "items": schema_ref("PendingApproval") },
            "awaiting_input": { "type": ["string", "null"] },
            "output": {},
            "error": { "oneOf": [schema_ref("RunError"), { "type": "null" }] },
            "compensations": compensations(),
            "ending": ending(),
            "metadata": {},
            "scopes": { "type": "array", "items": { "type": "string" }, "description": "The scopes of the token that created the run (absent: every scope)." },
            "created_at": { "type": "string", "format": "date-time" },
            "updated_at": { "type": "string", "format": "date-time" },
            "version": { "type": "integer", "minimum": 1 }
        }
    })
}

/// A query value the daemon reads as an id: letters, digits, `_` and `-`.
fn id_chars() -> Value {
    json!({ "type": "string", "pattern": format!("^[A-Za-z0-9_-]{{1,{}}}$", crate::ids::MAX_ID_LEN) })
}

fn paths(limits: &LimitsConfig) -> Value {
    json!({
        "/v1/runs": {
            "post": {
                "operationId": "createRun", "summary": "Start a run",
                "requestBody": body("CreateRun", true),
                "responses": {
                    "201": run_ok("The new run, durably stored."),
                    "200": run_ok("The run this idempotency_key already started."),
                    "400": err("Invalid JSON."), "401": err("Missing or unknown token."),
                    "413": err("Body or input too large."),
                    "422": err("Wrong shape, unknown agent, budget out of range, or idempotency key reused with another input."),
                    "429": err("Too many active runs for the tenant (Retry-After)."),
                    "503": err("Store unavailable.")
                }
            },
            "get": {
                "operationId": "listRuns", "summary": "The tenant's runs, newest first",
                "parameters": [
                    { "name": "status", "in": "query", "schema": schema_ref("RunStatus") },
                    { "name": "agent", "in": "query", "schema": id_chars() },
                    { "name": "limit", "in": "query", "schema": { "type": "integer", "minimum": 1, "maximum": u64::MAX, "default": 20 },
                      "description": format!("At most {} are returned.", limits.max_page_size) },
                    { "name": "cursor", "in": "query", "schema": id_chars() }
                ],
                "responses": {
                    "200": ok_json("One page.", "RunList"),
                    "400": err("Malformed query."), "401": err("Missing or unknown token.")
                }
            }
        },
        "/v1/runs/{id}": {
            "get": {
                "operationId": "getRun", "summary": "One run",
                "parameters": [id_param()],
                "responses": { "200": run_ok("The run."), "401": err("Missing or unknown token."), "404": err("No such run.") }
            }
        },
        "/v1/runs/{id}/events": {
            "get": {
                "operationId": "runEvents", "summary": "The run's events; live as SSE with Accept: text/event-stream",
                "parameters": [
                    id_param(),
                    { "name": "after", "in": "query", "schema": { "type": "integer", "minimum": 0, "maximum": u64::MAX } },
                    { "name": "limit", "in": "query", "schema": { "type": "integer", "minimum": 1, "maximum": u64::MAX }, "description": "At most 1000 are returned." },
                    { "name": "Last-Event-ID", "in": "header", "schema": { "type": "string" }, "description": "SSE resume: events after this seq, each once." }
                ],
                "responses": {
                    "200": { "description": "Events in order.", "content": {
                        "application/json": { "schema": schema_ref("EventList") },
                        "text/event-stream": { "schema": { "type": "string", "description": "id: seq, event: type, data: the Event JSON; ends after the terminal event." } } } },
                    "400": err("Malformed after or Last-Event-ID."), "401": err("Missing or unknown token."), "404": err("No such run.")
                }
            }
        },
        "/v1/runs/{id}/messages": {
            "get": {
                "operationId": "runMessages", "summary": "The run's transcript as the model saw it (redacted), paginated",
                "parameters": [
                    id_param(),
                    { "name": "after", "in": "query", "schema": { "type": "integer", "minimum": 0, "maximum": u64::MAX }, "description": "Messages after this index (from 1); the previous page's next_cursor." },
                    { "name": "limit", "in": "query", "schema": { "type": "integer", "minimum": 1, "maximum": u64::MAX }, "description": format!("At most {} are returned.", limits.max_page_size) }
                ],
                "responses": {
                    "400": err("Malformed after or limit."), "401": err("Missing or unknown token."), "404": err("No such run.")
                }
            }
        },
        "/v1/runs/{id}/cancel": {
            "post": {
                "operationId": "cancelRun", "summary": "Cancel a run (idempotent)",
                "parameters": [id_param()],
                "requestBody": body("Cancel", false),
                "responses": control_responses()
            }
        },
        "/v1/runs/{id}/approvals/{call_id}": {
            "post": {
                "operationId": "decideCall", "summary": "Approve or reject one pending tool call, once",
                "parameters": [id_param(), { "name": "call_id", "in": "path", "required": true, "schema": { "type": "string", "pattern": "^call_[A-Za-z0-9_-]+$" } }],
                "requestBody": body("Decision", true),
                "responses": decide_responses()
            }
        },
        "/v1/runs/{id}/input": {
            "post": {
                "operationId": "giveInput", "summary": "Answer waiting_input, or queue input for a running run",
                "parameters": [id_param()],
                "requestBody": body("Input", true),
                "responses": control_responses()
            }
        },
        "/v1/approvals": {
            "get": {
                "operationId": "listApprovals", "summary": "The tenant's pending approvals across all runs, oldest first",
                "parameters": [
                    { "name": "limit", "in": "query", "schema": { "type": "integer", "minimum": 1, "maximum": u64::MAX, "default": 50 } },
                    { "name": "cursor", "in": "query", "schema": { "type": "string", "maxLength": crate::ids::MAX_ID_LEN, "pattern": "^[0-9]{1,19}-[A-Za-z0-9_]*-[A-Za-z0-9_-]*$" },
                      "description": "The previous page's next_cursor." }
                ],
                "responses": {
                    "200": ok_json("One page.", "ApprovalList"),
                    "400": err("Malformed query."), "401": err("Missing or unknown token.")
                }
            }
        },
        "/v1/agents": {
            "get": {
                "operationId": "listAgents", "summary": "The configured agents and their tools",
                "responses": {
                    "200": ok_json("Agents.", "AgentList"),
                    "401": err("Missing or unknown token.")
                }
            }
        },
        "/": { "get": { "operationId": "console", "summary": "The web console (HTML; its script and stylesheet are under /console/)", "security": [],
            "responses": { "200": { "description": "The console page.", "content": { "text/html": { "schema": { "type": "string" } } } } } } },
        "/console/app.js": { "get": { "operationId": "consoleScript", "summary": "The web console's script", "security": [],
            "responses": { "200": { "description": "An ES module.", "content": { "text/javascript": { "schema": { "type": "string" } } } } } } },
        "/console/style.css": { "get": { "operationId": "consoleStyle", "summary": "The web console's stylesheet", "security": [],
            "responses": { "200": { "description": "CSS.", "content": { "text/css": { "schema": { "type": "string" } } } } } } },
        "/healthz": { "get": { "operationId": "healthz", "summary": "The process is alive", "security": [],
            "responses": { "200": ok_json("Alive.", "Health") } } },
        "/readyz": { "get": { "operationId": "readyz", "summary": "Ready: started, not draining, store reachable", "security": [],
            "responses": { "200": ok_json("Ready.", "Health"), "503": err("Not ready.") } } },
        "/metrics": { "get": { "operationId": "metrics", "summary": "Prometheus metrics", "security": [],
            "responses": { "200": { "description": "Prometheus text.", "content": { "text/plain": { "schema": { "type": "string" } } } } } } },
        "/openapi.json": { "get": { "operationId": "openapi", "summary": "This document", "security": [],
            "responses": { "200": { "description": "OpenAPI 3.1." } } } }
    })
}

/// The run's `compensations` (its own function: one `json!` would nest past the macro's
/// recursion limit).
fn compensations() -> Value {
    let item = json!({ "type": "object", "properties": {
        "call_id": { "type": "string" }, "for_call": { "type": "string" }, "for_tool": { "type": "string" },
        "tool": { "type": "string" }, "arguments": {}, "key": { "type": "string" },
        "status": { "enum": ["pending", "dispatched", "reconciling", "done", "failed", "skipped", "outcome_unknown"] },
        "attempts": { "type": "integer" },
        "error": { "type": ["object", "null"] }, "reason": { "type": ["string", "null"] } } });
    json!({ "type": "array", "items": item, "description": "The compensating calls of the run's successful calls of tools with a compensate rule, in the order those calls completed; run newest first when the run ends cancelled or failed." })
}

/// The run's `ending`, set while its phase is `compensating`.
fn ending() -> Value {
    json!({ "type": ["object", "null"], "description": "While phase is compensating: the status (and error) the run ends with once its compensations are over.", "properties": {
        "status": { "enum": ["failed", "cancelled"] }, "error": { "type": ["object", "null"] } } })
}

/// `Message` and `MessageList`, the answer of `GET /v1/runs/{id}/messages`.
fn message_schemas() -> (Value, Value) {
    let call = json!({ "type": "object", "required": ["id", "name", "arguments"], "properties": {
        "id": { "type": "string" }, "name": { "type": "string" },
        "arguments": { "type": "string", "description": "The JSON text the model gave." } } });
    let message = json!({ "type": "object", "required": ["index", "role", "content", "tool_calls", "tool_call_id"], "properties": {
        "index": { "type": "integer", "minimum": 1 },
        "role": { "type": "string", "enum": ["system", "user", "assistant", "tool"] },
        "content": { "type": ["string", "null"] },
        "tool_calls": { "type": "array", "items": call },
        "tool_call_id": { "type": ["string", "null"] } } });
    let list = json!({ "type": "object", "required": ["messages", "next_cursor"], "properties": {
        "messages": { "type": "array", "items": schema_ref("Message") },
        "next_cursor": { "type": ["integer", "null"], "description": "The after of the next page; null on the last." } } });
    (message, list)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    #[test]
    fn every_route_is_documented_and_every_documented_route_exists() {
        let doc = super::document();
        let mut documented = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for method in item.as_object().unwrap().keys() {
                documented.insert((method.to_uppercase(), path.clone()));
            }
        }
        let routed: BTreeSet<(String, String)> = crate::api::ROUTES
            .iter()
            .map(|r| (r.method.to_owned(), r.path.to_owned()))
            .collect();
        assert_eq!(documented, routed);
        for r in crate::api::ROUTES {
            let op = &doc["paths"][r.path][r.method.to_lowercase()];
            assert_eq!(
                op["security"] == serde_json::json!([]),
                r.auth == crate::api::Access::Open,
                "{}",
                r.path
            );
            assert_eq!(
                op["security"] == serde_json::json!([{ "callToken": [] }]),
                r.auth == crate::api::Access::CallToken,
                "{}",
                r.path
            );
        }
    }
}
