//! The only place errors become HTTP responses: `ApiError` → `{"error": {"code", "message"}}`
//! with the fitting status. 4xx carry detail; 5xx are generic (the cause is logged).
//!
//! | code | status | when |
//! |---|---|---|
//! | `invalid_json` | 400 | the body is not JSON (the message gives line and column) |
//! | `invalid_query` | 400 | a query parameter or `Last-Event-ID` is malformed |
//! | `unauthenticated` | 401 | missing, malformed or unknown bearer token (`WWW-Authenticate: Bearer`); on the callback route, anything but the call's own callback token |
//! | `forbidden` | 403 | the token has scopes, and none that allows this (approving needs `approve` or `approve:<tool>`) |
//! | `not_found` | 404 | no such run, call or route — also another tenant's run, and malformed ids |
//! | `method_not_allowed` | 405 | the route exists, the method does not |
//! | `request_timeout` | 408 | a non-SSE request took longer than `limits.request_timeout` |
//! | `invalid_state` | 409 | the run's state does not allow this (also: a callback for a call that already has its result); `error.status` is the current status |
//! | `input_queue_full` | 409 | a busy run already holds the most queued inputs |
//! | `payload_too_large` | 413 | the body (or an input text) is over its limit |
//! | `invalid_request` | 422 | valid JSON of the wrong shape: wrong types, missing or unknown fields |
//! | `invalid_argument` | 422 | a value out of range (budget caps, edited arguments that fail the schema, input size) |
//! | `unknown_agent` | 422 | `agent` names no configured agent |
//! | `idempotency_key_mismatch` | 422 | an `idempotency_key` reused with a different agent or input |
//! | `too_many_active_runs` | 429 | the tenant's active-run quota is full (`Retry-After`) |
//! | `too_many_streams` | 429 | the tenant holds `limits.max_streams_per_tenant` open event streams (`Retry-After`) |
//! | `inbox_full` | 429 | the run holds 64 controls it has not applied yet; nothing is stored (`Retry-After`) |
//! | `internal` | 500 | a bug (a panic is caught here); nothing of it is shown |
//! | `store_unavailable` | 503 | the store does not answer (`Retry-After`) |
//! | `shutting_down` | 503 | the daemon is stopping (`Retry-After`) |
//! | `timeout` | 503 | the run did not answer a control in time; its state is unchanged or the control is queued (`Retry-After`) |
//! | `store_reset` | 503 | the store lost its data since the daemon started (its epoch marker changed) |
//! | `not_ready` | 503 | `/readyz` while starting or draining |

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::run::Status;
use crate::runtime;

/// An error answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status answered.
    pub status: StatusCode,
    /// Stable snake_case code clients match on (the table above), `error.code` on the wire.
    pub code: &'static str,
    /// One sentence for people, `error.message` on the wire; never a secret or a stack trace.
    pub message: String,
    /// The run's current status, for `invalid_state` (`error.status` on the wire).
    pub run_status: Option<Status>,
    /// Seconds, for 429 and 503: sent as `Retry-After`.
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// An error with no run status and no `Retry-After`.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            run_status: None,
            retry_after: None,
        }
    }

    /// 404 `not_found` for a route or resource that does not exist.
    pub fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", "no such resource")
    }

    /// 404 `not_found` for a run that does not exist or is another tenant's.
    pub fn run_not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", "run not found")
    }

    /// 401 `unauthenticated` (answered with `WWW-Authenticate: Bearer`).
    pub fn unauthenticated() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
            "a valid bearer token is required",
        )
    }

    /// 400 `invalid_json`: the body is not JSON.
    pub fn invalid_json(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_json", message)
    }

    /// 400 `invalid_query`: a query parameter or `Last-Event-ID` is malformed.
    pub fn invalid_query(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_query", message)
    }

    /// 422 `invalid_request`: JSON of the wrong shape.
    pub fn invalid_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request", message)
    }

    /// 422 `invalid_argument`: a value out of range or failing its schema.
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_argument",
            message,
        )
    }

    /// 413 `payload_too_large` for a body over `limit` bytes.
    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("the body is larger than {limit} bytes"),
        )
    }

    /// 500 `internal`, with a generic message (the cause is logged, not shown).
    pub fn internal() -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "internal error; the request may be retried",
        )
    }

    /// 503 with `code` and `Retry-After: 1`.
    pub fn unavailable(code: &'static str, message: &str) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, code, message);
        e.retry_after = Some(1);
        e
    }
}

impl From<runtime::Error> for ApiError {
    fn from(e: runtime::Error) -> Self {
        use runtime::Error as E;
        match e {
            E::NotFound => ApiError::run_not_found(),
            E::UnknownCall(_) => ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                "no such call in this run",
            ),
            E::UnknownAgent(name) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "unknown_agent",
                format!("agent {name:?} is not configured (see GET /v1/agents)"),
            ),
            E::InvalidState { status, message } => {
                let mut a = ApiError::new(StatusCode::CONFLICT, "invalid_state", message);
                a.run_status = Some(status);
                a
            }
            E::InvalidArgument(m) => ApiError::invalid_argument(m),
            E::InputQueueFull(m) => ApiError::new(StatusCode::CONFLICT, "input_queue_full", m),
            E::InboxFull(n) => {
                let mut a = ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "inbox_full",
                    format!("the run has {n} controls not yet applied; retry once it catches up"),
                );
                a.retry_after = Some(1);
                a
            }
            E::TooManyActiveRuns(n) => {
                let mut a = ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "too_many_active_runs",
                    format!("the tenant already has {n} active runs, the most allowed"),
                );
                a.retry_after = Some(5);
                a
            }
            E::Store(cause) => {
                tracing::error!(error = %cause, "store error");
                ApiError::unavailable("store_unavailable", "the store is unavailable; retry later")
            }
            E::ShuttingDown => {
                ApiError::unavailable("shutting_down", "the daemon is shutting down; retry later")
            }
            E::Timeout => ApiError::unavailable(
                "timeout",
                "the run did not answer in time; its state is unchanged or the request is queued",
            ),
            E::StoreReset { .. } => ApiError::unavailable(
                "store_reset",
                "the store lost its data since the daemon started; an operator must check it",
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut error = json!({ "code": self.code, "message": self.message });
        if let (Some(s), Some(obj)) = (self.run_status, error.as_object_mut()) {
            obj.insert("status".into(), json!(s.as_str()));
        }
        let mut res = (self.status, Json(json!({ "error": error }))).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            res.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(secs) = self.retry_after {
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        res
    }
}
