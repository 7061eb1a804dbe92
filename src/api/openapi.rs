//! The OpenAPI 3.1 document of the API, written by hand next to API.md. A test checks that its
//! paths and methods are exactly those of `api::ROUTES`.

use serde_json::{Value, json};

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

/// The document.
pub fn document() -> Value {
    let mut doc = base();
    doc["components"]["securitySchemes"]["callToken"] = json!({
        "type": "http", "scheme": "bearer",
        "description": "The per-call secret agentd sent to a long-running tool as X-Agentd-Callback-Token; valid for that one call only."
    });
    doc["paths"]["/v1/runs/{id}/calls/{call_id}/result"] = callback_path();
    doc
}

/// `POST /v1/runs/{id}/calls/{call_id}/result` (its own function: one `json!` would nest past
/// the macro's recursion limit).
fn callback_path() -> Value {
    let result = json!({
        "type": "object", "required": ["ok"], "additionalProperties": false,
        "properties": {
            "ok": { "type": "boolean" },
            "data": { "description": "The result (ok: true)." },
            "error": { "type": "object", "required": ["code", "message"], "additionalProperties": false,
                "properties": { "code": { "type": "string" }, "message": { "type": "string" } } }
        }
    });
    json!({ "post": {
        "operationId": "completeCall",
        "summary": "A long-running tool completes a call it accepted (202); authenticated by that call's callback token only",
        "security": [{ "callToken": [] }],
        "parameters": [id_param(), { "name": "call_id", "in": "path", "required": true, "schema": { "type": "string", "pattern": "^call_[A-Za-z0-9_-]+$" } }],
        "requestBody": { "required": true, "content": { "application/json": { "schema": result } } },
        "responses": {
            "200": { "description": "The result was taken: it is the call's result.", "content": { "application/json": { "schema": {
                "type": "object", "properties": { "run_id": { "type": "string" }, "call_id": { "type": "string" }, "accepted": { "const": true } } } } } },
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

fn base() -> Value {
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "agentd",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Runs LLM agent runs safely: start, follow, cancel, approve and give input."
        },
        "components": {
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } },
            "schemas": {
                "Error": {
                    "type": "object", "required": ["error"],
                    "properties": { "error": { "type": "object", "required": ["code", "message"], "properties": {
                        "code": { "type": "string" }, "message": { "type": "string" },
                        "status": { "type": "string", "description": "The run's current status (invalid_state only)." } } } }
                },
                "CreateRun": {
                    "type": "object", "required": ["agent", "input"], "additionalProperties": false,
                    "properties": {
                        "agent": { "type": "string" },
                        "input": { "description": "The goal: text or any JSON value." },
                        "idempotency_key": { "type": "string", "maxLength": 255 },
                        "budget": { "type": "object", "additionalProperties": false, "properties": {
                            "max_turns": { "type": "integer", "minimum": 1 },
                            "max_tool_calls": { "type": "integer", "minimum": 1 },
                            "max_tokens": { "type": "integer", "minimum": 1 },
                            "deadline": { "type": "string", "examples": ["5m"] } } },
                        "metadata": {}
                    }
                },
                "Cancel": { "type": "object", "additionalProperties": false, "properties": { "reason": { "type": "string" } } },
                "Decision": {
                    "type": "object", "required": ["decision"], "additionalProperties": false,
                    "properties": {
                        "decision": { "enum": ["approve", "reject", "fail"], "description": "fail: end the run failed (code by why the call waits, e.g. tool_failing)." },
                        "reason": { "type": "string" },
                        "arguments": { "type": "object", "description": "Approve with edited arguments (validated again)." }
                    }
                },
                "Input": { "type": "object", "required": ["text"], "additionalProperties": false, "properties": { "text": { "type": "string" } } },
                "Run": {
                    "type": "object",
                    "required": ["id", "agent", "status", "phase", "turn", "usage", "budget", "pending_approvals", "awaiting_input", "output", "error", "created_at", "updated_at", "version"],
                    "properties": {
                        "id": { "type": "string" },
                        "agent": { "type": "string" },
                        "input": { "description": "The goal as given: text or any JSON value." },
                        "status": { "enum": ["created", "running", "waiting_approval", "waiting_input", "succeeded", "failed", "cancelled"] },
                        "phase": { "type": ["string", "null"] },
                        "turn": { "type": "integer" },
                        "usage": { "type": "object", "properties": {
                            "turns": { "type": "integer" }, "tool_calls": { "type": "integer" },
                            "input_tokens": { "type": "integer" }, "output_tokens": { "type": "integer" } } },
                        "budget": { "type": "object", "properties": {
                            "max_turns": { "type": "integer" }, "max_tool_calls": { "type": "integer" },
                            "max_tokens": { "type": "integer" }, "deadline": { "type": ["string", "null"], "format": "date-time" } } },
                        "pending_approvals": { "type": "array", "items": { "type": "object", "properties": {
                            "call_id": { "type": "string" }, "tool": { "type": "string" }, "arguments": {},
                            "reason": { "enum": ["approval", "outcome_unknown", "tool_failing", "permission_error"] } } } },
                        "awaiting_input": { "type": ["string", "null"] },
                        "output": {},
                        "error": { "type": ["object", "null"], "properties": { "code": { "type": "string" }, "message": { "type": "string" } } },
                        "compensations": compensations(),
                        "ending": ending(),
                        "metadata": {},
                        "scopes": { "type": "array", "items": { "type": "string" }, "description": "The scopes of the token that created the run (absent: every scope)." },
                        "created_at": { "type": "string", "format": "date-time" },
                        "updated_at": { "type": "string", "format": "date-time" },
                        "version": { "type": "integer" }
                    }
                },
                "Event": {
                    "type": "object", "required": ["seq", "at", "type", "data"],
                    "properties": { "seq": { "type": "integer" }, "at": { "type": "string", "format": "date-time" }, "type": { "type": "string" }, "data": {} }
                },
                "Approval": {
                    "type": "object",
                    "required": ["run_id", "call_id", "agent", "tool", "arguments", "reason", "requested_at", "expires_at"],
                    "properties": {
                        "run_id": { "type": "string" }, "call_id": { "type": "string" },
                        "agent": { "type": "string" }, "tool": { "type": "string" }, "arguments": {},
                        "reason": { "enum": ["policy", "outcome_unknown", "tool_failing", "permission_error"] },
                        "requested_at": { "type": "string", "format": "date-time" },
                        "expires_at": { "type": ["string", "null"], "format": "date-time", "description": "When the tool's approval_timeout decides the call; null: never." }
                    }
                },
                "ApprovalList": {
                    "type": "object", "required": ["approvals", "next_cursor"],
                    "properties": { "approvals": { "type": "array", "items": { "$ref": "#/components/schemas/Approval" } }, "next_cursor": { "type": ["string", "null"] } }
                },
                "Agent": {
                    "type": "object",
                    "properties": { "name": { "type": "string" }, "model": { "type": "string" }, "tools": { "type": "array", "items": {
                        "type": "object", "properties": { "name": { "type": "string" }, "description": { "type": "string" }, "parameters": {} } } } }
                }
            }
        },
        "security": [{ "bearer": [] }],
        "paths": {
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
                        { "name": "status", "in": "query", "schema": { "type": "string" } },
                        { "name": "agent", "in": "query", "schema": { "type": "string" } },
                        { "name": "limit", "in": "query", "schema": { "type": "integer", "minimum": 1, "default": 20 } },
                        { "name": "cursor", "in": "query", "schema": { "type": "string" } }
                    ],
                    "responses": {
                        "200": { "description": "One page.", "content": { "application/json": { "schema": {
                            "type": "object", "properties": { "runs": { "type": "array", "items": { "$ref": "#/components/schemas/Run" } }, "next_cursor": { "type": ["string", "null"] } } } } } },
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
                        { "name": "after", "in": "query", "schema": { "type": "integer", "minimum": 0 } },
                        { "name": "limit", "in": "query", "schema": { "type": "integer", "minimum": 1, "maximum": 1000 } },
                        { "name": "Last-Event-ID", "in": "header", "schema": { "type": "string" }, "description": "SSE resume: events after this seq, each once." }
                    ],
                    "responses": {
                        "200": { "description": "Events in order.", "content": {
                            "application/json": { "schema": { "type": "object", "properties": { "events": { "type": "array", "items": { "$ref": "#/components/schemas/Event" } } } } },
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
                        { "name": "after", "in": "query", "schema": { "type": "integer", "minimum": 0 }, "description": "Messages after this index (from 1); the previous page's next_cursor." },
                        { "name": "limit", "in": "query", "schema": { "type": "integer", "minimum": 1 } }
                    ],
                    "responses": {
                        "200": messages_page(),
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
                        { "name": "limit", "in": "query", "schema": { "type": "integer", "minimum": 1, "default": 50 } },
                        { "name": "cursor", "in": "query", "schema": { "type": "string" } }
                    ],
                    "responses": {
                        "200": { "description": "One page.", "content": { "application/json": { "schema": { "$ref": "#/components/schemas/ApprovalList" } } } },
                        "400": err("Malformed query."), "401": err("Missing or unknown token.")
                    }
                }
            },
            "/v1/agents": {
                "get": {
                    "operationId": "listAgents", "summary": "The configured agents and their tools",
                    "responses": {
                        "200": { "description": "Agents.", "content": { "application/json": { "schema": {
                            "type": "object", "properties": { "agents": { "type": "array", "items": { "$ref": "#/components/schemas/Agent" } } } } } } },
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
                "responses": { "200": { "description": "Alive." } } } },
            "/readyz": { "get": { "operationId": "readyz", "summary": "Ready: started, not draining, store reachable", "security": [],
                "responses": { "200": { "description": "Ready." }, "503": err("Not ready.") } } },
            "/metrics": { "get": { "operationId": "metrics", "summary": "Prometheus metrics", "security": [],
                "responses": { "200": { "description": "Prometheus text.", "content": { "text/plain": { "schema": { "type": "string" } } } } } } },
            "/openapi.json": { "get": { "operationId": "openapi", "summary": "This document", "security": [],
                "responses": { "200": { "description": "OpenAPI 3.1." } } } }
        }
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

/// The 200 answer of `GET /v1/runs/{id}/messages` (its own function: one `json!` would nest
/// past the macro's recursion limit).
fn messages_page() -> Value {
    let call = json!({ "type": "object", "required": ["id", "name", "arguments"], "properties": {
        "id": { "type": "string" }, "name": { "type": "string" },
        "arguments": { "type": "string", "description": "The JSON text the model gave." } } });
    let message = json!({ "type": "object", "required": ["index", "role", "content", "tool_calls", "tool_call_id"], "properties": {
        "index": { "type": "integer", "minimum": 1 },
        "role": { "type": "string", "enum": ["system", "user", "assistant", "tool"] },
        "content": { "type": ["string", "null"] },
        "tool_calls": { "type": "array", "items": call },
        "tool_call_id": { "type": ["string", "null"] } } });
    json!({ "description": "Messages in order.", "content": { "application/json": { "schema": {
        "type": "object", "required": ["messages", "next_cursor"], "properties": {
            "messages": { "type": "array", "items": message },
            "next_cursor": { "type": ["integer", "null"], "description": "The after of the next page; null on the last." } } } } } })
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
