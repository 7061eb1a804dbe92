//! The callback route of long-running HTTP tools (API.md "Long-running HTTP tools"):
//! `POST /v1/runs/{id}/calls/{call_id}/result` completes one call the tool accepted (`202`).
//!
//! It is authenticated by the call's own token (`X-Agentd-Callback-Token`, sent as
//! `Authorization: Bearer …`), never by a tenant token: the token is checked (constant time,
//! `tool::callback`) before the body is read or the store is touched, so a wrong or missing
//! token is `401` whatever the run. The result is stored in the run's inbox like a control and
//! applied on whichever node owns the run; the first result wins (`200`), a call that already
//! has one, or a run that ended, is `409` (`invalid_state`).

use axum::Json;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};

use super::AppState;
use super::auth::bearer_token;
use super::error::ApiError;
use super::extract::{CallPath, parse_json, read_body};
use crate::tool::{ToolError, ToolErrorCode, ToolResult};

/// Longest error code and message a tool may report.
const MAX_CODE_BYTES: usize = 64;

/// The body: `{"ok": true, "data": …}` or `{"ok": false, "error": {"code", "message"}}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallResultRequest {
    /// Whether the call succeeded; `false` needs `error`, `true` refuses it.
    pub ok: bool,
    /// What the call returned when `ok` (absent: `null`).
    #[serde(default)]
    pub data: Option<Value>,
    /// Why the call failed, when not `ok`.
    #[serde(default)]
    pub error: Option<CallErrorBody>,
}

/// The `error` of a failed call's result, as the tool reports it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallErrorBody {
    /// A tool error code (`failed`, `timeout`, …), at most 64 bytes; an unknown one is recorded
    /// as `failed`, with this code at the front of the message.
    pub code: String,
    /// What went wrong, for the model and the run's events.
    pub message: String,
}

impl CallResultRequest {
    /// The result the run records. A tool's own error code becomes the closest known one;
    /// an unknown code is `failed`, with the tool's code kept in the message.
    fn into_result(self) -> Result<ToolResult, ApiError> {
        if self.ok {
            if self.error.is_some() {
                return Err(ApiError::invalid_request(
                    "a result with \"ok\": true has no \"error\"",
                ));
            }
            return Ok(ToolResult::success(self.data.unwrap_or(Value::Null)));
        }
        let Some(e) = self.error else {
            return Err(ApiError::invalid_request(
                "a result with \"ok\": false needs \"error\": {\"code\", \"message\"}",
            ));
        };
        if e.code.len() > MAX_CODE_BYTES {
            return Err(ApiError::invalid_argument(format!(
                "error.code is longer than {MAX_CODE_BYTES} bytes"
            )));
        }
        let known: Option<ToolErrorCode> =
            serde_json::from_value(Value::String(e.code.clone())).ok();
        let error = match known {
            Some(code) => ToolError::new(code, e.message),
            None => ToolError::new(ToolErrorCode::Failed, format!("{}: {}", e.code, e.message)),
        };
        Ok(ToolResult::failure(error))
    }
}

fn bad_token() -> ApiError {
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthenticated",
        "a valid callback token for this call is required",
    )
}

/// `POST /v1/runs/{id}/calls/{call_id}/result`.
pub async fn complete(
    State(s): State<AppState>,
    CallPath(id, call_id): CallPath,
    req: Request,
) -> Result<Json<Value>, ApiError> {
    let token = bearer_token(req.headers()).ok_or_else(bad_token)?;
    if !s.runtime.verify_callback(&id, &call_id, token) {
        return Err(bad_token());
    }
    let bytes = read_body(req, s.limits.max_body_bytes).await?;
    let body: CallResultRequest = parse_json(&bytes)?;
    let result = body.into_result()?;
    let ok = result.ok;
    s.runtime.complete_call(&id, &call_id, result).await?;
    tracing::info!(run_id = %id, %call_id, ok, "long-running call completed by callback");
    Ok(Json(
        json!({ "run_id": id, "call_id": call_id, "accepted": true }),
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<ToolResult, ApiError> {
        serde_json::from_value::<CallResultRequest>(v)
            .unwrap()
            .into_result()
    }

    #[test]
    fn bodies_become_results() {
        let r = parse(json!({"ok": true, "data": {"n": 1}})).unwrap();
        assert_eq!(r, ToolResult::success(json!({"n": 1})));
        let r =
            parse(json!({"ok": false, "error": {"code": "timeout", "message": "slow"}})).unwrap();
        assert_eq!(r.error_code(), Some(ToolErrorCode::Timeout));
        let r = parse(json!({"ok": false, "error": {"code": "disk_full", "message": "no room"}}))
            .unwrap();
        assert_eq!(r.error_code(), Some(ToolErrorCode::Failed));
        assert_eq!(r.error.unwrap().message, "disk_full: no room");
        assert_eq!(
            parse(json!({"ok": false})).unwrap_err().code,
            "invalid_request"
        );
        assert!(
            serde_json::from_value::<CallResultRequest>(json!({"ok": true, "extra": 1})).is_err()
        );
    }
}
