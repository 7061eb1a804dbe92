//! The approvals inbox: `GET /v1/approvals`, every call of the tenant's runs that waits for an
//! operator, oldest first, with a cursor.

use axum::Extension;
use axum::Json;
use axum::extract::State;

use super::AppState;
use super::auth::Tenant;
use super::dto::{ApprovalDto, ApprovalListDto, ApprovalsQuery};
use super::error::ApiError;
use super::extract::Query;
use crate::clock::rfc3339;
use crate::ids::check_id_charset;
use crate::runtime::AwaitingCall;

/// Default page of `GET /v1/approvals`.
const APPROVALS_PAGE: usize = 50;

/// Where a page continues: the sort key of the last item shown, `{ms}-{run_id}-{call_id}`.
fn cursor_of(c: &AwaitingCall) -> String {
    format!("{}-{}-{}", c.requested_at_ms, c.run_id, c.call_id)
}

fn parse_cursor(s: &str) -> Option<(u64, &str, &str)> {
    check_id_charset(s).ok()?;
    let mut parts = s.splitn(3, '-');
    let ms = parts.next()?.parse().ok()?;
    Some((ms, parts.next()?, parts.next()?))
}

/// `GET /v1/approvals?limit=&cursor=`: the tenant's pending approvals, oldest first.
pub async fn list(
    State(s): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    Query(q): Query<ApprovalsQuery>,
) -> Result<Json<ApprovalListDto>, ApiError> {
    let limit = match q.limit {
        Some(0) => return Err(ApiError::invalid_query("limit must be at least 1")),
        Some(n) => n.min(s.limits.max_page_size),
        None => APPROVALS_PAGE.min(s.limits.max_page_size),
    };
    let after = match &q.cursor {
        None => None,
        Some(c) => {
            Some(parse_cursor(c).ok_or_else(|| ApiError::invalid_query("malformed cursor"))?)
        }
    };
    let all = s.runtime.awaiting_calls(&tenant).await?;
    if all.truncated {
        tracing::warn!(
            tenant = %tenant,
            "approvals inbox: more runs wait for approval than one listing reads"
        );
    }
    let mut page: Vec<&AwaitingCall> = all
        .calls
        .iter()
        .filter(|c| {
            after.is_none_or(|(ms, run, call)| {
                (c.requested_at_ms, c.run_id.as_str(), c.call_id.as_str()) > (ms, run, call)
            })
        })
        .take(limit + 1)
        .collect();
    let next_cursor = if page.len() > limit {
        page.truncate(limit);
        page.last().map(|c| cursor_of(c))
    } else {
        None
    };
    let redactor = s.runtime.redactor();
    let approvals = page
        .into_iter()
        .map(|c| {
            let mut arguments = c.arguments.clone();
            if !redactor.is_noop() {
                redactor.redact_value_in_place(&mut arguments);
            }
            ApprovalDto {
                run_id: c.run_id.to_string(),
                call_id: c.call_id.to_string(),
                agent: c.agent.clone(),
                tool: c.tool.clone(),
                arguments,
                reason: c.reason.as_str().to_owned(),
                requested_at: rfc3339(c.requested_at_ms),
                expires_at: c.expires_at_ms.map(rfc3339),
            }
        })
        .collect();
    Ok(Json(ApprovalListDto {
        approvals,
        next_cursor,
    }))
}
