//! The HTTP API (see `/openapi.json` and API.md): the route table, the shared `AppState`, and
//! the middleware stack. Handlers parse a DTO, call `RuntimeHandle`, and answer a DTO.
//!
//! Middleware, outermost first: sensitive `Authorization` (never logged), request id
//! (`x-request-id`, generated as a UUIDv7 when absent, echoed back), the trace span (request id,
//! method, route, tenant), HTTP request counters, panic catcher (500 `internal`), request
//! timeout (408; only an SSE stream of the events route is exempt), and on `/v1` routes the
//! bearer-token check. HTTP metrics label standard methods by name and any other as `other`.

pub mod approvals;
pub mod auth;
pub mod calls;
pub mod console;
pub mod dto;
pub mod error;
pub mod extract;
pub mod openapi;
pub mod ops;
pub mod runs;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use dashmap::DashMap;
use tokio_util::sync::CancellationToken;
use tower::ServiceBuilder;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{
    MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer,
};
use tower_http::sensitive_headers::SetSensitiveRequestHeadersLayer;
use tower_http::trace::TraceLayer;

use crate::config::LimitsConfig;
use crate::runtime::RuntimeHandle;
use auth::{Auth, Tenant};
use error::ApiError;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    /// The runtime the handlers act on.
    pub runtime: RuntimeHandle,
    /// The configured tokens, checked on every `/v1` tenant route.
    pub auth: Arc<Auth>,
    /// Request limits (`[limits]`): body and page sizes, budget caps, the request timeout.
    pub limits: Arc<LimitsConfig>,
    /// Interval of the keep-alive comment on SSE streams (`server.sse_keep_alive`).
    pub sse_keep_alive: Duration,
    /// False while starting and once shutdown begins (`/readyz` answers 503).
    pub ready: Arc<AtomicBool>,
    /// Cancelled when shutdown begins: SSE streams end.
    pub shutdown: CancellationToken,
    /// HTTP request counters, rendered into `/metrics`.
    pub http: Arc<HttpMetrics>,
    /// Open SSE streams per tenant (bounded by `limits.max_streams_per_tenant`).
    pub open_streams: Arc<DashMap<String, usize>>,
}

/// One route of the API. The router, the OpenAPI test and the tenant-isolation test are all
/// driven by [`ROUTES`].
pub struct Route {
    /// The HTTP method in capitals (`GET`, `POST`).
    pub method: &'static str,
    /// axum path syntax (`/v1/runs/{id}`), identical to the OpenAPI path.
    pub path: &'static str,
    /// Who may call it.
    pub auth: Access,
    make: fn() -> MethodRouter<AppState>,
}

/// How a route is authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// No token (operations, the console).
    Open,
    /// A tenant's bearer token (every other `/v1` route); the run must be the tenant's.
    Tenant,
    /// The per-call callback token of a long-running tool call, and nothing else: a tenant
    /// token is refused (`401`). Checked by the handler (`api::calls`).
    CallToken,
}

/// Every route, in the order of API.md.
pub const ROUTES: &[Route] = &[
    Route {
        method: "POST",
        path: "/v1/runs",
        auth: Access::Tenant,
        make: || post(runs::create),
    },
    Route {
        method: "GET",
        path: "/v1/runs",
        auth: Access::Tenant,
        make: || get(runs::list),
    },
    Route {
        method: "GET",
        path: "/v1/runs/{id}",
        auth: Access::Tenant,
        make: || get(runs::get_run),
    },
    Route {
        method: "GET",
        path: "/v1/runs/{id}/events",
        auth: Access::Tenant,
        make: || get(runs::events),
    },
    Route {
        method: "GET",
        path: "/v1/runs/{id}/messages",
        auth: Access::Tenant,
        make: || get(runs::messages),
    },
    Route {
        method: "POST",
        path: "/v1/runs/{id}/cancel",
        auth: Access::Tenant,
        make: || post(runs::cancel),
    },
    Route {
        method: "POST",
        path: "/v1/runs/{id}/approvals/{call_id}",
        auth: Access::Tenant,
        make: || post(runs::decide),
    },
    Route {
        method: "POST",
        path: "/v1/runs/{id}/input",
        auth: Access::Tenant,
        make: || post(runs::input),
    },
    Route {
        method: "POST",
        path: "/v1/runs/{id}/calls/{call_id}/result",
        auth: Access::CallToken,
        make: || post(calls::complete),
    },
    Route {
        method: "GET",
        path: "/v1/approvals",
        auth: Access::Tenant,
        make: || get(approvals::list),
    },
    Route {
        method: "GET",
        path: "/v1/agents",
        auth: Access::Tenant,
        make: || get(ops::agents),
    },
    Route {
        method: "GET",
        path: "/",
        auth: Access::Open,
        make: || get(console::index),
    },
    Route {
        method: "GET",
        path: "/console/app.js",
        auth: Access::Open,
        make: || get(console::app_js),
    },
    Route {
        method: "GET",
        path: "/console/style.css",
        auth: Access::Open,
        make: || get(console::style_css),
    },
    Route {
        method: "GET",
        path: "/healthz",
        auth: Access::Open,
        make: || get(ops::healthz),
    },
    Route {
        method: "GET",
        path: "/readyz",
        auth: Access::Open,
        make: || get(ops::readyz),
    },
    Route {
        method: "GET",
        path: "/metrics",
        auth: Access::Open,
        make: || get(ops::metrics),
    },
    Route {
        method: "GET",
        path: "/openapi.json",
        auth: Access::Open,
        make: || get(ops::openapi),
    },
];

/// Request counters by method, route and status, rendered into `/metrics`.
#[derive(Debug, Default)]
pub struct HttpMetrics {
    requests: DashMap<(String, String, u16), AtomicU64>,
}

impl HttpMetrics {
    fn record(&self, method: &str, route: &str, status: u16) {
        self.requests
            .entry((method.to_owned(), route.to_owned(), status))
            .or_default()
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Prometheus text.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write as _;
        let _ = writeln!(
            out,
            "# HELP agentd_http_requests_total HTTP requests answered.\n# TYPE agentd_http_requests_total counter"
        );
        let mut rows: Vec<(String, String, u16, u64)> = self
            .requests
            .iter()
            .map(|e| {
                let (m, r, s) = e.key();
                (m.clone(), r.clone(), *s, e.value().load(Ordering::Relaxed))
            })
            .collect();
        rows.sort();
        for (m, r, s, n) in rows {
            let _ = writeln!(
                out,
                "agentd_http_requests_total{{method=\"{m}\",route=\"{r}\",status=\"{s}\"}} {n}"
            );
        }
    }
}

/// Request ids: UUIDv7, time-ordered.
#[derive(Clone, Copy, Default)]
struct MakeUuidV7;

impl MakeRequestId for MakeUuidV7 {
    fn make_request_id<B>(&mut self, _req: &axum::http::Request<B>) -> Option<RequestId> {
        HeaderValue::from_str(&uuid::Uuid::now_v7().to_string())
            .ok()
            .map(RequestId::new)
    }
}

/// Whether the client asks for an SSE stream.
pub fn wants_sse(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("text/event-stream"))
}

/// The one route that streams (SSE) when asked to.
const STREAMING_ROUTE: &str = "/v1/runs/{id}/events";

/// Whether this request opens an SSE stream: the streaming route, asked for a stream. Only
/// such a request may outlive the request timeout.
fn opens_stream(req: &Request) -> bool {
    req.method() == axum::http::Method::GET
        && req
            .extensions()
            .get::<MatchedPath>()
            .is_some_and(|p| p.as_str() == STREAMING_ROUTE)
        && wants_sse(req.headers())
}

async fn timeout_unless_sse(State(s): State<AppState>, req: Request, next: Next) -> Response {
    if opens_stream(&req) {
        return next.run(req).await;
    }
    match tokio::time::timeout(s.limits.request_timeout, next.run(req)).await {
        Ok(res) => res,
        Err(_) => ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "the request took too long",
        )
        .into_response(),
    }
}

/// The method as a metric label: the standard ones by name, any other as `other`, so invented
/// methods cannot grow `/metrics`.
fn method_label(method: &axum::http::Method) -> &'static str {
    use axum::http::Method as M;
    match *method {
        M::GET => "GET",
        M::POST => "POST",
        M::PUT => "PUT",
        M::DELETE => "DELETE",
        M::PATCH => "PATCH",
        M::HEAD => "HEAD",
        M::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

async fn count_requests(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let method = method_label(req.method());
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let res = next.run(req).await;
    s.http.record(method, &route, res.status().as_u16());
    res
}

async fn require_tenant(State(s): State<AppState>, mut req: Request, next: Next) -> Response {
    match s.auth.authenticate(req.headers()) {
        Some(principal) => {
            tracing::Span::current().record("tenant", principal.tenant.as_ref());
            req.extensions_mut()
                .insert(Tenant(principal.tenant.clone()));
            req.extensions_mut().insert(principal);
            next.run(req).await
        }
        None => ApiError::unauthenticated().into_response(),
    }
}

fn panic_response(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    tracing::error!("a request handler panicked");
    ApiError::internal().into_response()
}

async fn not_found() -> ApiError {
    ApiError::not_found()
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this route does not accept this method",
    )
}

/// The API router over `state`.
pub fn router(state: AppState) -> Router {
    let mut authed: Router<AppState> = Router::new();
    let mut open: Router<AppState> = Router::new();
    for r in ROUTES {
        if r.auth == Access::Tenant {
            authed = authed.route(r.path, (r.make)());
        } else {
            open = open.route(r.path, (r.make)());
        }
    }
    let authed = authed.route_layer(middleware::from_fn_with_state(
        state.clone(),
        require_tenant,
    ));
    let x_request_id = HeaderName::from_static("x-request-id");
    let stack = ServiceBuilder::new()
        .layer(SetSensitiveRequestHeadersLayer::new([
            header::AUTHORIZATION,
        ]))
        .layer(SetRequestIdLayer::new(x_request_id.clone(), MakeUuidV7))
        .layer(PropagateRequestIdLayer::new(x_request_id))
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(|req: &axum::http::Request<_>| {
                    let request_id = req
                        .headers()
                        .get("x-request-id")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("");
                    // Every log line of the request carries these; keep them few.
                    tracing::info_span!(
                        "http",
                        request_id,
                        method = %req.method(),
                        path = %req.uri().path(),
                        tenant = tracing::field::Empty,
                    )
                })
                // One short line per request at info; headers and the rest at debug.
                .on_response(|res: &Response, latency: Duration, _span: &tracing::Span| {
                    tracing::info!(
                        status = res.status().as_u16(),
                        ms = latency.as_millis() as u64,
                        "answered"
                    );
                    tracing::debug!(headers = ?res.headers(), "response headers");
                }),
        )
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .layer(CatchPanicLayer::custom(panic_response))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            timeout_unless_sse,
        ));
    authed
        .merge(open)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(stack)
        .with_state(state)
}
