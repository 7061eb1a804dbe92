//! Operational routes: agents, health, readiness, metrics and the OpenAPI document.

use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use super::AppState;
use super::auth::Principal;
use super::dto::{AgentDto, AgentListDto, HealthDto, QuarantinedRunDto};
use super::error::ApiError;

/// `GET /v1/agents`: the agents the tenant may use (`[[tenants]] agents`, default all), with
/// their tools.
pub async fn agents(
    State(s): State<AppState>,
    Extension(principal): Extension<Principal>,
) -> Json<AgentListDto> {
    Json(AgentListDto {
        agents: s
            .runtime
            .agents()
            .iter()
            .filter(|a| principal.may_use(&a.name))
            .map(AgentDto::from)
            .collect(),
    })
}

/// `GET /healthz`: the process answers.
pub async fn healthz() -> Json<HealthDto> {
    Json(HealthDto {
        status: "ok".into(),
        quarantined: Vec::new(),
    })
}

/// `GET /readyz`: started, not draining, and the store answers; lists quarantined runs.
pub async fn readyz(State(s): State<AppState>) -> Result<Json<HealthDto>, ApiError> {
    if !s.ready.load(Ordering::SeqCst) {
        return Err(ApiError::unavailable(
            "not_ready",
            "the daemon is starting or shutting down",
        ));
    }
    s.runtime.ready().await.map_err(|e| {
        tracing::warn!(error = %e, "readiness check failed");
        match e {
            crate::runtime::Error::StoreReset { .. } => ApiError::unavailable(
                "store_reset",
                "the store lost its data since the daemon started; restart the daemon after checking it",
            ),
            _ => ApiError::unavailable("store_unavailable", "the store is unreachable"),
        }
    })?;
    let quarantined = s
        .runtime
        .quarantined()
        .into_iter()
        .map(|(id, reason)| QuarantinedRunDto {
            id: id.to_string(),
            reason: s.runtime.redactor().redact_then_cut(&reason, 300),
        })
        .collect();
    Ok(Json(HealthDto {
        status: "ready".into(),
        quarantined,
    }))
}

/// `GET /metrics`: Prometheus text (runtime, pools, HTTP). No tenant names appear here.
pub async fn metrics(State(s): State<AppState>) -> Response {
    let mut out = s.runtime.render_metrics();
    s.http.render(&mut out);
    out.push_str(&format!(
        "# HELP agentd_ready Whether the daemon takes traffic.\n# TYPE agentd_ready gauge\nagentd_ready {}\n",
        u8::from(s.ready.load(Ordering::SeqCst))
    ));
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
        .into_response()
}

/// `GET /openapi.json`: the document for this daemon's limits and agents.
pub async fn openapi(State(s): State<AppState>) -> Response {
    let agents: Vec<String> = s.runtime.agents().into_iter().map(|a| a.name).collect();
    (
        [(header::CONTENT_TYPE, "application/json")],
        super::openapi::document_for(&s.limits, &agents).to_string(),
    )
        .into_response()
}
