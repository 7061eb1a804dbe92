//! Run routes: create, get, list, events (JSON and SSE), messages, cancel, approvals, input.

use std::convert::Infallible;
use std::time::Duration;

use axum::Extension;
use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use futures::stream::BoxStream;
use serde_json::Value;

use super::AppState;
use super::auth::{Principal, Tenant};
use super::dto::{
    CancelRequest, CreateRunRequest, Decision, DecisionRequest, EventDto, EventListDto,
    EventsQuery, InputRequest, ListQuery, MessageDto, MessageListDto, MessagesQuery, RunDto,
    RunListDto,
};
use super::error::ApiError;
use super::extract::{CallPath, JsonBody, OptionalJsonBody, Query, RunPath};
use crate::ids::check_id_charset;
use crate::run::Status;
use crate::runtime::{BudgetRequest, Error as RuntimeError, NewRun};
use crate::store::{EventRecord, RunFilter};

/// The scope that lets a token with scopes approve or reject calls (`approve:<tool>` for one
/// tool's calls only).
pub const APPROVE_SCOPE: &str = "approve";
/// Longest client idempotency key (as Stripe).
const MAX_IDEMPOTENCY_KEY: usize = 255;
/// Longest cancel/reject reason kept.
const MAX_REASON_BYTES: usize = 4096;
/// Default and largest page of `GET /v1/runs/{id}/events`.
const EVENTS_PAGE: usize = 1000;
/// Default page of `GET /v1/runs/{id}/messages` (the largest is `limits.max_page_size`).
const MESSAGES_PAGE: usize = 100;
/// Default page of `GET /v1/runs`.
const RUNS_PAGE: usize = 20;
/// Client reconnect delay announced on SSE streams.
const SSE_RETRY: Duration = Duration::from_secs(2);

fn run_json(s: &AppState, run: &crate::run::RunState) -> Json<RunDto> {
    Json(RunDto::redacted(run, s.runtime.redactor()))
}

fn check_reason(reason: &Option<String>) -> Result<(), ApiError> {
    match reason {
        Some(r) if r.len() > MAX_REASON_BYTES => Err(ApiError::invalid_argument(format!(
            "reason is longer than {MAX_REASON_BYTES} bytes"
        ))),
        _ => Ok(()),
    }
}

fn budget_of(
    state: &AppState,
    b: Option<crate::api::dto::BudgetRequest>,
) -> Result<BudgetRequest, ApiError> {
    let Some(b) = b else {
        return Ok(BudgetRequest::default());
    };
    let l = &state.limits;
    let deadline = match &b.deadline {
        None => None,
        Some(text) => {
            let d = humantime::parse_duration(text).map_err(|e| {
                ApiError::invalid_argument(format!(
                    "budget.deadline {text:?}: {e} (write e.g. \"5m\")"
                ))
            })?;
            if d.is_zero() || d > l.max_deadline {
                return Err(ApiError::invalid_argument(format!(
                    "budget.deadline must be more than 0s and at most {}",
                    humantime::format_duration(l.max_deadline)
                )));
            }
            Some(d)
        }
    };
    let range = |name: &str, v: Option<u64>, max: u64| -> Result<(), ApiError> {
        match v {
            Some(n) if n == 0 || n > max => Err(ApiError::invalid_argument(format!(
                "budget.{name} must be between 1 and {max}"
            ))),
            _ => Ok(()),
        }
    };
    range(
        "max_turns",
        b.max_turns.map(u64::from),
        u64::from(l.max_turns),
    )?;
    range(
        "max_tool_calls",
        b.max_tool_calls.map(u64::from),
        u64::from(l.max_tool_calls),
    )?;
    range("max_tokens", b.max_tokens, l.max_tokens)?;
    Ok(BudgetRequest {
        max_turns: b.max_turns,
        max_tool_calls: b.max_tool_calls,
        max_tokens: b.max_tokens,
        deadline,
    })
}

/// `POST /v1/runs`: 201 with a new run, 200 with the run an idempotency key already made.
pub async fn create(
    State(s): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    Extension(principal): Extension<Principal>,
    JsonBody(req): JsonBody<CreateRunRequest>,
) -> Result<Response, ApiError> {
    // Another tenant's agent answers exactly like a missing one.
    if !principal.may_use(&req.agent) {
        return Err(RuntimeError::UnknownAgent(req.agent).into());
    }
    if let Some(k) = &req.idempotency_key
        && (k.is_empty()
            || k.len() > MAX_IDEMPOTENCY_KEY
            || !k.bytes().all(|b| b.is_ascii_graphic()))
    {
        return Err(ApiError::invalid_argument(format!(
            "idempotency_key must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters"
        )));
    }
    let input_len = match &req.input {
        Value::String(t) => t.len(),
        Value::Null => return Err(ApiError::invalid_argument("input is required")),
        other => other.to_string().len(),
    };
    if input_len > s.limits.max_input_bytes {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!(
                "input is {input_len} bytes; the limit is {}",
                s.limits.max_input_bytes
            ),
        ));
    }
    // Metadata comes back in every list item: bounded much tighter than the body.
    if let Some(m) = &req.metadata {
        let len = m.to_string().len();
        if len > s.limits.max_metadata_bytes {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                format!(
                    "metadata is {len} bytes of JSON; the limit is {}",
                    s.limits.max_metadata_bytes
                ),
            ));
        }
    }
    let budget = budget_of(&s, req.budget)?;
    let (run, created) = s
        .runtime
        .create_run(NewRun {
            tenant: tenant.to_string(),
            agent: req.agent.clone(),
            input: req.input.clone(),
            client_key: req.idempotency_key.clone(),
            budget,
            metadata: req.metadata.unwrap_or(Value::Null),
            scopes: principal.scopes.as_deref().map(<[String]>::to_vec),
        })
        .await?;
    if !created && (run.agent != req.agent || run.input != req.input) {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "idempotency_key_mismatch",
            "this idempotency_key was used for a run with a different agent or input",
        ));
    }
    tracing::info!(run_id = %run.id, agent = %run.agent, created, "run accepted");
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let mut res = (status, run_json(&s, &run)).into_response();
    if let Ok(v) = HeaderValue::from_str(&format!("/v1/runs/{}", run.id)) {
        res.headers_mut().insert(header::LOCATION, v);
    }
    Ok(res)
}

/// `GET /v1/runs/{id}`.
pub async fn get_run(
    State(s): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    RunPath(id): RunPath,
) -> Result<Json<RunDto>, ApiError> {
    let run = s.runtime.get_run(&tenant, &id).await?;
    Ok(run_json(&s, &run))
}

/// `GET /v1/runs?status=&agent=&limit=&cursor=`: newest first.
pub async fn list(
    State(s): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    Query(q): Query<ListQuery>,
) -> Result<Json<RunListDto>, ApiError> {
    if let Some(st) = &q.status
        && st.parse::<Status>().is_err()
    {
        return Err(ApiError::invalid_query(format!(
            "status must be one of {}",
            Status::ALL.map(Status::as_str).join(", ")
        )));
    }
    for (name, v) in [("agent", &q.agent), ("cursor", &q.cursor)] {
        if let Some(v) = v
            && check_id_charset(v).is_err()
        {
            return Err(ApiError::invalid_query(format!("malformed {name}")));
        }
    }
    let limit = match q.limit {
        Some(0) => return Err(ApiError::invalid_query("limit must be at least 1")),
        Some(n) => n.min(s.limits.max_page_size),
        None => RUNS_PAGE.min(s.limits.max_page_size),
    };
    let filter = RunFilter {
        status: q.status,
        agent: q.agent,
    };
    let (runs, next_cursor) = s
        .runtime
        .list_runs(&tenant, &filter, q.cursor.as_deref(), limit)
        .await?;
    Ok(Json(RunListDto {
        runs: runs
            .iter()
            .map(|r| RunDto::redacted(r, s.runtime.redactor()))
            .collect(),
        next_cursor,
    }))
}

fn sse_event(e: &EventRecord, first: bool) -> Event {
    let dto = EventDto::from(e);
    let ev = Event::default()
        .id(e.seq.to_string())
        .event(dto.kind.clone());
    let ev = if first { ev.retry(SSE_RETRY) } else { ev };
    ev.json_data(&dto)
        .unwrap_or_else(|_| Event::default().comment("unserializable event"))
}

/// One open SSE stream of a tenant, counted against `limits.max_streams_per_tenant` until it
/// is dropped (with its response body, when the client goes or its connection is closed).
struct StreamSlot {
    tenant: String,
    open: std::sync::Arc<dashmap::DashMap<String, usize>>,
}

impl StreamSlot {
    fn take(s: &AppState, tenant: &str) -> Result<Self, ApiError> {
        let max = s.limits.max_streams_per_tenant;
        let mut n = s.open_streams.entry(tenant.to_owned()).or_insert(0);
        if max > 0 && *n >= max {
            let mut e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_streams",
                format!(
                    "the tenant has {max} open event streams, the most allowed; close one first"
                ),
            );
            e.retry_after = Some(1);
            return Err(e);
        }
        *n += 1;
        Ok(StreamSlot {
            tenant: tenant.to_owned(),
            open: s.open_streams.clone(),
        })
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        if let Some(mut n) = self.open.get_mut(&self.tenant) {
            *n = n.saturating_sub(1);
        }
        self.open.remove_if(&self.tenant, |_, n| *n == 0);
    }
}

/// `GET /v1/runs/{id}/messages?after=&limit=`: the run's transcript as the model saw it,
/// redacted, from position `after + 1`.
pub async fn messages(
    State(s): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    RunPath(id): RunPath,
    Query(q): Query<MessagesQuery>,
) -> Result<Json<MessageListDto>, ApiError> {
    let limit = match q.limit {
        Some(0) => return Err(ApiError::invalid_query("limit must be at least 1")),
        Some(n) => n.min(s.limits.max_page_size),
        None => MESSAGES_PAGE.min(s.limits.max_page_size),
    };
    let (page, next_cursor) = s
        .runtime
        .messages(&tenant, &id, q.after.unwrap_or(0), limit)
        .await?;
    let redactor = s.runtime.redactor();
    Ok(Json(MessageListDto {
        messages: page
            .iter()
            .map(|(index, m)| MessageDto::redacted(*index, m, redactor))
            .collect(),
        next_cursor,
    }))
}

/// `GET /v1/runs/{id}/events?after=N`: JSON, or SSE with `Accept: text/event-stream` (resume
/// with `Last-Event-ID`, which wins over `after`). At most `limits.max_streams_per_tenant`
/// streams per tenant are open at once (429 `too_many_streams`).
pub async fn events(
    State(s): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    RunPath(id): RunPath,
    Query(q): Query<EventsQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    if !super::wants_sse(&headers) {
        let limit = match q.limit {
            Some(0) => return Err(ApiError::invalid_query("limit must be at least 1")),
            Some(n) => n.min(EVENTS_PAGE),
            None => EVENTS_PAGE,
        };
        let events = s
            .runtime
            .events(&tenant, &id, q.after.unwrap_or(0), limit)
            .await?;
        return Ok(Json(EventListDto {
            events: events.iter().map(EventDto::from).collect(),
        })
        .into_response());
    }
    let last_event_id = match headers.get("last-event-id") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| ApiError::invalid_query("Last-Event-ID must be an event seq"))?,
        ),
    };
    let after = last_event_id.or(q.after).unwrap_or(0);
    let slot = StreamSlot::take(&s, &tenant)?;
    tracing::debug!(run_id = %id, after, "SSE stream opened");
    // The stream ends by itself after the terminal event (or at once when the client resumes
    // after it).
    let stream: BoxStream<'static, Result<Event, Infallible>> = {
        let follow = s.runtime.follow(&tenant, &id, after).await?;
        follow
            .enumerate()
            .scan(false, |failed, (i, item)| {
                if *failed {
                    return futures::future::ready(None);
                }
                let ev = match item {
                    Ok(e) => sse_event(&e, i == 0),
                    Err(err) => {
                        *failed = true;
                        let api = ApiError::from(err);
                        Event::default()
                            .event("error")
                            .json_data(
                                serde_json::json!({"code": api.code, "message": api.message}),
                            )
                            .unwrap_or_default()
                    }
                };
                futures::future::ready(Some(Ok(ev)))
            })
            .take_until(s.shutdown.clone().cancelled_owned())
            // The slot lives as long as the stream.
            .map(move |ev| {
                let _held = &slot;
                ev
            })
            .boxed()
    };
    Ok(Sse::new(stream)
        .keep_alive(
            KeepAlive::new()
                .interval(s.sse_keep_alive)
                .text("keep-alive"),
        )
        .into_response())
}

/// `POST /v1/runs/{id}/cancel`: idempotent; 409 if the run already ended otherwise.
pub async fn cancel(
    State(s): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    RunPath(id): RunPath,
    OptionalJsonBody(req): OptionalJsonBody<CancelRequest>,
) -> Result<Json<RunDto>, ApiError> {
    check_reason(&req.reason)?;
    let run = s.runtime.cancel(&tenant, &id, req.reason).await?;
    tracing::info!(run_id = %id, status = %run.status, "cancel requested");
    Ok(run_json(&s, &run))
}

/// `POST /v1/runs/{id}/approvals/{call_id}`: approve (optionally with edited arguments),
/// reject, or fail the run at one pending call, once. The same decision again answers the same.
pub async fn decide(
    State(s): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    Extension(principal): Extension<Principal>,
    CallPath(id, call_id): CallPath,
    JsonBody(req): JsonBody<DecisionRequest>,
) -> Result<Json<RunDto>, ApiError> {
    check_reason(&req.reason)?;
    let approve = req.decision == Decision::Approve;
    if !approve && req.arguments.is_some() {
        return Err(ApiError::invalid_argument(
            "arguments may only be given with decision \"approve\"",
        ));
    }
    if principal.scopes.is_some() {
        // Checked before the control is stored, so a refused decision changes nothing.
        let run = s.runtime.get_run(&tenant, &id).await?;
        let needed = match run.call(&call_id) {
            Some(c) => format!("{APPROVE_SCOPE}:{}", c.tool),
            None => APPROVE_SCOPE.to_owned(),
        };
        if !principal.grants(&needed) {
            tracing::info!(run_id = %id, call_id = %call_id, "decision refused: the token lacks the approve scope");
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                if needed == APPROVE_SCOPE {
                    format!("deciding this call needs the scope `{APPROVE_SCOPE}`")
                } else {
                    format!("deciding this call needs the scope `{APPROVE_SCOPE}` or `{needed}`")
                },
            ));
        }
    }
    let by = principal.name.as_deref().map(str::to_owned);
    let decided = match req.decision {
        Decision::Fail => {
            s.runtime
                .fail_call(&tenant, &id, &call_id, req.reason, by)
                .await
        }
        _ => {
            s.runtime
                .decide(
                    &tenant,
                    &id,
                    &call_id,
                    approve,
                    req.arguments.map(Value::Object),
                    req.reason,
                    by,
                )
                .await
        }
    };
    let run = decided.map_err(|e| {
        // A schema violation of edited arguments may quote them: scrub the message.
        let mut api = ApiError::from(e);
        api.message = s.runtime.redactor().redact_str(&api.message).into_owned();
        api
    })?;
    tracing::info!(run_id = %id, call_id = %call_id, decision = ?req.decision, "decision recorded");
    Ok(run_json(&s, &run))
}

/// `POST /v1/runs/{id}/input`: answers `waiting_input`, or queues for a running run.
pub async fn input(
    State(s): State<AppState>,
    Extension(Tenant(tenant)): Extension<Tenant>,
    RunPath(id): RunPath,
    JsonBody(req): JsonBody<InputRequest>,
) -> Result<Json<RunDto>, ApiError> {
    if req.text.len() > s.limits.max_input_text_bytes {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!(
                "text is {} bytes; the limit is {}",
                req.text.len(),
                s.limits.max_input_text_bytes
            ),
        ));
    }
    if req.text.is_empty() {
        return Err(ApiError::invalid_argument("text must not be empty"));
    }
    let run = s.runtime.input(&tenant, &id, req.text).await?;
    tracing::info!(run_id = %id, status = %run.status, "input delivered");
    Ok(run_json(&s, &run))
}
