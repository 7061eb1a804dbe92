//! HTTP tools: `POST <url>` with the headers `Idempotency-Key`, `X-Agentd-Tenant` and
//! `X-Agentd-Run-Id` and the body `{"tool","arguments","run_id","call_id"}`, failure
//! classification by what may have been applied, and reconciliation through
//! `GET <status url>` with the same key (API.md "Tools over HTTP").
//!
//! Long-running calls (API.md "Long-running HTTP tools"): every call also carries
//! `X-Agentd-Callback-Url` and `X-Agentd-Callback-Token` when the daemon has a callback route.
//! A `202 Accepted` answer with `{"status_url": …}` or a `Location` header (relative to the
//! tool's URL) means the tool finishes the call later: the call notes it in
//! `ctx.long_running` and the run polls `GET <status url>` (`Tool::poll`: `202` still running,
//! other `2xx` the result, `408`/`429`/`5xx`/transport errors ask again, other `4xx` failed),
//! or the tool posts the result to the callback route. The tool's bearer token is sent to a
//! status URL only on the tool's own origin.
//!
//! Classification (the question is always "could the effect have been applied?"):
//!
//! | outcome | `read` tool | `idempotent` / `unsafe` tool |
//! |---|---|---|
//! | `2xx` | result | result |
//! | `401`, `403` | `permission` | `permission` |
//! | other `4xx` except `408`/`429` | `failed` with the server's message | same |
//! | `408`, `429` (the server refused before processing) | `retryable` | `retryable` |
//! | connection refused / connect timeout (nothing sent) | `retryable` | `retryable` |
//! | `5xx`, timeout after connecting, connection lost, body lost after `2xx` | `retryable` | `outcome_unknown` |
//! | cancelled mid-call | as a timeout | as a timeout |
//!
//! Redirects are not followed (a `POST` must not be replayed elsewhere): a `3xx` is `failed`.
//!
//! Output size: at most `max_output_bytes + OUTPUT_MARGIN_BYTES` of the body is read. A body
//! that was cut, or is not JSON, comes back as a JSON string of its (lossy UTF-8) text; the
//! executor redacts it whole, then cuts it to size and sets `truncated`
//! (`ToolResult::sanitized`). The margin is larger than any secret, so a secret that straddles
//! the cap is read whole and redacted before the cut. Error messages are passed on uncut (the
//! error body is read up to 16 KiB) for the same reason.

use std::time::Duration;

use async_trait::async_trait;
use reqwest::StatusCode;
use serde_json::{Value, json};

use super::{Tool, ToolContext, ToolEffect, ToolError, ToolErrorCode, ToolSpec};

/// The tenant a call acts for, on every call and status query.
pub const TENANT_HEADER: &str = "X-Agentd-Tenant";
/// The run a call belongs to, on every call and status query.
pub const RUN_ID_HEADER: &str = "X-Agentd-Run-Id";
/// Where a long-running tool posts the call's result.
pub const CALLBACK_URL_HEADER: &str = "X-Agentd-Callback-Url";
/// The secret of that one call, as `Authorization: Bearer …` of the callback.
pub const CALLBACK_TOKEN_HEADER: &str = "X-Agentd-Callback-Token";
/// Longest `202` body read for its `status_url`.
const MAX_ACCEPTED_BODY_BYTES: usize = 16 * 1024;

/// Read beyond `max_output_bytes` by this much, so the caller can tell "exactly at the cap"
/// from "cut".
pub const OUTPUT_MARGIN_BYTES: usize = 1024;
/// Error bodies are read up to this size only.
const MAX_ERROR_BODY_BYTES: usize = 16 * 1024;

/// Reads at most `cap` bytes of a response body. Returns the bytes and whether the body was
/// longer (the rest is not read).
pub async fn read_body_capped(
    response: &mut reqwest::Response,
    cap: usize,
) -> Result<(Vec<u8>, bool), reqwest::Error> {
    let mut out = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        let room = cap.saturating_sub(out.len());
        if chunk.len() > room {
            out.extend_from_slice(&chunk[..room]);
            return Ok((out, true));
        }
        out.extend_from_slice(&chunk);
    }
    Ok((out, false))
}

/// A tool served over HTTP.
#[derive(Debug, Clone)]
pub struct HttpTool {
    spec: ToolSpec,
    url: reqwest::Url,
    status_url: Option<reqwest::Url>,
    client: reqwest::Client,
    bearer_token: Option<BearerToken>,
}

/// A token sent as `Authorization: Bearer …` to the tool server. Its `Debug` hides it.
#[derive(Clone)]
struct BearerToken(String);

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BearerToken([redacted])")
    }
}

impl HttpTool {
    /// A tool posting to `url`. With a `status_url`, the spec is marked `reconcilable`.
    pub fn new(mut spec: ToolSpec, url: &str, status_url: Option<&str>) -> Result<Self, ToolError> {
        let parse = |u: &str| {
            reqwest::Url::parse(u).map_err(|e| {
                ToolError::new(
                    ToolErrorCode::Failed,
                    format!("invalid tool URL {u:?}: {e}"),
                )
            })
        };
        let url = parse(url)?;
        let status_url = status_url.map(parse).transpose()?;
        spec.reconcilable = status_url.is_some();
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(spec.timeout.min(Duration::from_secs(5)))
            .build()
            .map_err(|e| {
                ToolError::new(
                    ToolErrorCode::Failed,
                    format!("cannot build HTTP client: {e}"),
                )
            })?;
        Ok(HttpTool {
            spec,
            url,
            status_url,
            client,
            bearer_token: None,
        })
    }

    /// Sends `Authorization: Bearer <token>` on calls and status queries. Never logged.
    pub fn with_bearer_token(mut self, token: impl Into<String>) -> Self {
        self.bearer_token = Some(BearerToken(token.into()));
        self
    }

    fn authorized(&self, builder: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.bearer_token {
            Some(BearerToken(token)) => builder.bearer_auth(token),
            None => builder,
        }
    }

    /// Shares a client (and its connection pool) between tools. The client should not follow
    /// redirects.
    pub fn with_client(mut self, client: reqwest::Client) -> Self {
        self.client = client;
        self
    }

    /// The code for "the request may have reached the server and been applied".
    fn maybe_applied(&self) -> ToolErrorCode {
        match self.spec.effect {
            ToolEffect::Read => ToolErrorCode::Retryable,
            ToolEffect::Idempotent | ToolEffect::Unsafe => ToolErrorCode::OutcomeUnknown,
        }
    }

    fn transport_error(&self, e: &reqwest::Error, during: &str) -> ToolError {
        if e.is_connect() {
            // Refused, unreachable, DNS or TLS failure, connect timeout: nothing was sent.
            ToolError::new(
                ToolErrorCode::Retryable,
                format!("could not connect to the tool server ({during})"),
            )
        } else if e.is_timeout() {
            ToolError::new(
                self.maybe_applied(),
                format!("no reply within {:?} ({during})", self.spec.timeout),
            )
        } else {
            ToolError::new(
                self.maybe_applied(),
                format!("connection lost ({during}): {}", cause(e)),
            )
        }
    }

    async fn post(&self, ctx: &ToolContext, arguments: Value) -> Result<Value, ToolError> {
        let body = json!({
            "tool": self.spec.name,
            "arguments": arguments,
            "run_id": ctx.run_id.as_str(),
            "call_id": ctx.call_id.as_str(),
        });
        let mut request = self
            .authorized(self.client.post(self.url.clone()))
            .timeout(self.spec.timeout)
            .header("Idempotency-Key", &ctx.idempotency_key)
            .header(TENANT_HEADER, &ctx.tenant)
            .header(RUN_ID_HEADER, ctx.run_id.as_str());
        if let Some(cb) = &ctx.long_running.callback {
            request = request
                .header(CALLBACK_URL_HEADER, &cb.url)
                .header(CALLBACK_TOKEN_HEADER, cb.token.expose());
        }
        let mut response = request
            .json(&body)
            .send()
            .await
            .map_err(|e| self.transport_error(&e, "sending the call"))?;
        let status = response.status();
        tracing::debug!(tool = %self.spec.name, call_id = %ctx.call_id, status = status.as_u16(), "http tool answered");
        if status == StatusCode::ACCEPTED {
            let status_url = self.accepted_status_url(&mut response).await;
            ctx.long_running.accept(status_url);
            return Ok(Value::Null);
        }
        if status.is_success() {
            let cap = self
                .spec
                .max_output_bytes
                .saturating_add(OUTPUT_MARGIN_BYTES);
            let (bytes, cut) = read_body_capped(&mut response, cap)
                .await
                .map_err(|e| self.transport_error(&e, "reading the result"))?;
            return Ok(body_value(&bytes, cut));
        }
        let retry_after = retry_after(response.headers());
        let message = server_message(&mut response).await;
        let mut error = ToolError::new(self.classify_status(status), message);
        error.retry_after = retry_after;
        Err(error)
    }

    /// The status URL of a `202` answer: the body's `status_url`, else the `Location` header,
    /// either resolved against the tool's URL.
    async fn accepted_status_url(&self, response: &mut reqwest::Response) -> Option<String> {
        let location = response
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = read_body_capped(response, MAX_ACCEPTED_BODY_BYTES)
            .await
            .map(|(b, _)| b)
            .unwrap_or_default();
        let from_body = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v.get("status_url")?.as_str().map(str::to_owned));
        let raw = from_body.or(location)?;
        self.url.join(&raw).ok().map(String::from)
    }

    async fn get_status(&self, ctx: &ToolContext, url: &str) -> Result<Option<Value>, ToolError> {
        let url = reqwest::Url::parse(url).map_err(|e| {
            ToolError::new(ToolErrorCode::Failed, format!("invalid status URL: {e}"))
        })?;
        // The tool's bearer token goes only to the tool's own origin: a status URL elsewhere
        // is asked without it.
        let same_origin = url.origin() == self.url.origin();
        let request = self.client.get(url);
        let request = if same_origin {
            self.authorized(request)
        } else {
            request
        };
        let mut response = request
            .timeout(self.spec.timeout)
            .header("Idempotency-Key", &ctx.idempotency_key)
            .header(TENANT_HEADER, &ctx.tenant)
            .header(RUN_ID_HEADER, ctx.run_id.as_str())
            .send()
            .await
            .map_err(|e| status_transport_error(&e))?;
        let status = response.status();
        if status == StatusCode::ACCEPTED {
            return Ok(None);
        }
        if status.is_success() {
            let cap = self
                .spec
                .max_output_bytes
                .saturating_add(OUTPUT_MARGIN_BYTES);
            let (bytes, cut) = read_body_capped(&mut response, cap)
                .await
                .map_err(|e| status_transport_error(&e))?;
            return Ok(Some(body_value(&bytes, cut)));
        }
        let message = server_message(&mut response).await;
        // A poll changes nothing: every transient failure is asked again.
        let code = match status.as_u16() {
            408 | 429 | 500..=599 => ToolErrorCode::Retryable,
            401 | 403 => ToolErrorCode::Permission,
            _ => ToolErrorCode::Failed,
        };
        Err(ToolError::new(code, message))
    }

    fn classify_status(&self, status: StatusCode) -> ToolErrorCode {
        match status.as_u16() {
            408 | 429 => ToolErrorCode::Retryable,
            401 | 403 => ToolErrorCode::Permission,
            500..=599 => self.maybe_applied(),
            _ => ToolErrorCode::Failed,
        }
    }
}

#[async_trait]
impl Tool for HttpTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn call(&self, ctx: &ToolContext, arguments: Value) -> Result<Value, ToolError> {
        // Biased: a call cancelled before it starts is never sent.
        tokio::select! {
            biased;
            () = ctx.cancel.cancelled() => Err(ToolError::new(
                self.maybe_applied(),
                "the call was cancelled before the tool answered",
            )),
            result = self.post(ctx, arguments) => result,
        }
    }

    async fn poll(&self, ctx: &ToolContext, status_url: &str) -> Result<Option<Value>, ToolError> {
        tokio::select! {
            biased;
            () = ctx.cancel.cancelled() => {
                Err(ToolError::new(ToolErrorCode::Retryable, "poll cancelled"))
            }
            r = self.get_status(ctx, status_url) => r,
        }
    }

    async fn status(&self, ctx: &ToolContext) -> Result<Option<Value>, ToolError> {
        let Some(url) = &self.status_url else {
            return Err(ToolError::new(
                ToolErrorCode::Failed,
                "this tool has no status URL",
            ));
        };
        let request = self
            .authorized(self.client.get(url.clone()))
            .timeout(self.spec.timeout)
            .header("Idempotency-Key", &ctx.idempotency_key)
            .header(TENANT_HEADER, &ctx.tenant)
            .header(RUN_ID_HEADER, ctx.run_id.as_str())
            .send();
        let mut response = tokio::select! {
            biased;
            () = ctx.cancel.cancelled() => {
                return Err(ToolError::new(ToolErrorCode::Retryable, "status query cancelled"));
            }
            r = request => r.map_err(|e| status_transport_error(&e))?,
        };
        match response.status() {
            StatusCode::NOT_FOUND => Ok(None),
            s if s.is_success() => {
                let cap = self
                    .spec
                    .max_output_bytes
                    .saturating_add(OUTPUT_MARGIN_BYTES);
                let (bytes, cut) = read_body_capped(&mut response, cap)
                    .await
                    .map_err(|e| status_transport_error(&e))?;
                Ok(Some(body_value(&bytes, cut)))
            }
            s => {
                let message = server_message(&mut response).await;
                // A status query changes nothing: every transient failure may be retried.
                let code = match s.as_u16() {
                    408 | 429 | 500..=599 => ToolErrorCode::Retryable,
                    401 | 403 => ToolErrorCode::Permission,
                    _ => ToolErrorCode::Failed,
                };
                Err(ToolError::new(code, format!("status query: {message}")))
            }
        }
    }
}

fn status_transport_error(e: &reqwest::Error) -> ToolError {
    ToolError::new(
        ToolErrorCode::Retryable,
        format!("status query failed: {}", cause(e)),
    )
}

/// The innermost cause of a reqwest error, without the URL.
fn cause(e: &reqwest::Error) -> String {
    use std::error::Error;
    let mut last: Option<&dyn Error> = None;
    let mut cur = e.source();
    while let Some(err) = cur {
        last = Some(err);
        cur = err.source();
    }
    last.map_or_else(|| "request failed".to_owned(), |err| err.to_string())
}

/// A success body as a JSON value: the parsed JSON, `null` when empty, or the text as a string
/// when it is not JSON or was cut.
fn body_value(bytes: &[u8], cut: bool) -> Value {
    if bytes.is_empty() && !cut {
        return Value::Null;
    }
    if !cut && let Ok(v) = serde_json::from_slice(bytes) {
        return v;
    }
    Value::String(String::from_utf8_lossy(bytes).into_owned())
}

/// The server's error message (bounded by the body read): `{"error":{"message"}}`, `{"error":"…"}`,
/// `{"message":"…"}`, or the body text.
/// `Retry-After` in seconds (the HTTP-date form is not used by tool servers we know of).
fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<std::time::Duration> {
    headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(std::time::Duration::from_secs)
}

async fn server_message(response: &mut reqwest::Response) -> String {
    let status = response.status();
    let bytes = read_body_capped(response, MAX_ERROR_BODY_BYTES)
        .await
        .map(|(b, _)| b)
        .unwrap_or_default();
    let parsed: Option<Value> = serde_json::from_slice(&bytes).ok();
    let from_json = parsed.as_ref().and_then(|v| {
        v.pointer("/error/message")
            .or_else(|| v.get("error"))
            .or_else(|| v.get("message"))
            .and_then(Value::as_str)
            .map(str::to_owned)
    });
    let text = from_json.unwrap_or_else(|| String::from_utf8_lossy(&bytes).trim().to_owned());
    let text = if text.is_empty() {
        status.canonical_reason().unwrap_or("no message").to_owned()
    } else {
        text
    };
    // Not cut here: the executor redacts the whole message, then cuts it.
    format!("HTTP {}: {text}", status.as_u16())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn bodies_become_values() {
        assert_eq!(body_value(b"", false), Value::Null);
        assert_eq!(body_value(br#"{"a":1}"#, false), json!({"a": 1}));
        assert_eq!(body_value(b"plain", false), json!("plain"));
        assert_eq!(body_value(br#"{"a":"#, true), json!(r#"{"a":"#));
    }

    #[test]
    fn reconcilable_follows_the_status_url() {
        let spec = ToolSpec::new("t", "d", json!({"type": "object"}));
        let t = HttpTool::new(spec.clone(), "http://127.0.0.1:1/x", None).unwrap();
        assert!(!t.spec().reconcilable);
        let t = HttpTool::new(
            spec.clone(),
            "http://127.0.0.1:1/x",
            Some("http://127.0.0.1:1/s"),
        )
        .unwrap();
        assert!(t.spec().reconcilable);
        assert!(HttpTool::new(spec, "not a url", None).is_err());
    }

    #[test]
    fn statuses_are_classified_by_effect() {
        let spec = ToolSpec::new("t", "d", json!({"type": "object"}));
        let unsafe_tool = HttpTool::new(spec.clone(), "http://127.0.0.1:1/x", None).unwrap();
        let read_tool =
            HttpTool::new(spec.effect(ToolEffect::Read), "http://127.0.0.1:1/x", None).unwrap();
        let cases = [
            (400, ToolErrorCode::Failed, ToolErrorCode::Failed),
            (404, ToolErrorCode::Failed, ToolErrorCode::Failed),
            (401, ToolErrorCode::Permission, ToolErrorCode::Permission),
            (408, ToolErrorCode::Retryable, ToolErrorCode::Retryable),
            (429, ToolErrorCode::Retryable, ToolErrorCode::Retryable),
            (500, ToolErrorCode::OutcomeUnknown, ToolErrorCode::Retryable),
            (503, ToolErrorCode::OutcomeUnknown, ToolErrorCode::Retryable),
            (307, ToolErrorCode::Failed, ToolErrorCode::Failed),
        ];
        for (status, unsafe_code, read_code) in cases {
            let s = StatusCode::from_u16(status).unwrap();
            assert_eq!(unsafe_tool.classify_status(s), unsafe_code, "{status}");
            assert_eq!(read_tool.classify_status(s), read_code, "{status}");
        }
    }
}
