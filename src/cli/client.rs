//! The CLI's HTTP client: JSON requests with the bearer token, API errors decoded from the
//! `{"error": {…}}` body, and SSE event streams resumed with `Last-Event-ID`.

use std::time::Duration;

use anyhow::Context as _;
use eventsource_stream::Eventsource as _;
use futures::{Stream, StreamExt};
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::api::dto::EventDto;

/// Per-request timeout of non-streaming requests.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// An error answer of the API.
#[derive(Debug, thiserror::Error)]
#[error("{status}: {code}: {message}")]
pub struct ApiFailure {
    /// The HTTP status of the answer.
    pub status: StatusCode,
    /// The API's `error.code`; `http_error` when the body carried none.
    pub code: String,
    /// The API's `error.message`; the status's reason phrase when the body carried none.
    pub message: String,
    /// The run's status, for `invalid_state`.
    pub run_status: Option<String>,
}

/// The daemon could not be reached (connection refused, timeout, DNS).
#[derive(Debug, thiserror::Error)]
#[error("could not reach agentd at {base}: {source}")]
pub struct Unreachable {
    /// The daemon's base URL, as the client was given it (without a trailing `/`).
    pub base: String,
    /// Why the request was not answered.
    #[source]
    pub source: reqwest::Error,
}

/// A client of one daemon.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Client {
    /// A client of the daemon at `base` (a trailing `/` is dropped) that sends `token` as its
    /// bearer token when given. Connecting is bounded at 5s, a silent read at 90s.
    pub fn new(base: &str, token: Option<String>) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .read_timeout(Duration::from_secs(90))
            .build()
            .context("could not build the HTTP client")?;
        Ok(Client {
            http,
            base: base.trim_end_matches('/').to_owned(),
            token,
        })
    }

    fn builder(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        let b = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => b.bearer_auth(t),
            None => b,
        }
    }

    async fn decode<T: DeserializeOwned>(res: reqwest::Response) -> anyhow::Result<T> {
        let status = res.status();
        let bytes = res.bytes().await.context("could not read the response")?;
        if status.is_success() {
            return serde_json::from_slice(&bytes)
                .with_context(|| format!("unexpected response ({status})"));
        }
        let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let e = &v["error"];
        Err(ApiFailure {
            status,
            code: e["code"].as_str().unwrap_or("http_error").to_owned(),
            message: e["message"]
                .as_str()
                .unwrap_or_else(|| status.canonical_reason().unwrap_or("error"))
                .to_owned(),
            run_status: e["status"].as_str().map(str::to_owned),
        }
        .into())
    }

    /// A JSON request; `body` is sent as JSON when given.
    pub async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<T> {
        let mut b = self.builder(method, path).timeout(REQUEST_TIMEOUT);
        if let Some(body) = body {
            b = b.json(body);
        }
        let res = b.send().await.map_err(|source| Unreachable {
            base: self.base.clone(),
            source,
        })?;
        Self::decode(res).await
    }

    /// `GET` returning the status code only (for the health check).
    pub async fn status(&self, path: &str, timeout: Duration) -> anyhow::Result<StatusCode> {
        let res = self
            .builder(Method::GET, path)
            .timeout(timeout)
            .send()
            .await
            .map_err(|source| Unreachable {
                base: self.base.clone(),
                source,
            })?;
        Ok(res.status())
    }

    /// The run's events after `after` as an SSE stream; it ends after the terminal event or
    /// when the connection ends.
    pub async fn events_stream(
        &self,
        run_id: &str,
        after: u64,
    ) -> anyhow::Result<impl Stream<Item = anyhow::Result<EventDto>> + use<>> {
        let mut b = self
            .builder(Method::GET, &format!("/v1/runs/{run_id}/events"))
            .header(reqwest::header::ACCEPT, "text/event-stream");
        if after > 0 {
            b = b.header("Last-Event-ID", after.to_string());
        }
        let res = b.send().await.map_err(|source| Unreachable {
            base: self.base.clone(),
            source,
        })?;
        if !res.status().is_success() {
            return Err(Self::decode::<Value>(res).await.err().unwrap_or_else(|| {
                anyhow::anyhow!("unexpected response to the event stream request")
            }));
        }
        Ok(res
            .bytes_stream()
            .eventsource()
            .filter_map(|item| async move {
                match item {
                    Ok(ev) if ev.event == "error" => {
                        Some(Err(anyhow::anyhow!("the event stream failed: {}", ev.data)))
                    }
                    Ok(ev) if ev.data.is_empty() => None,
                    Ok(ev) => Some(
                        serde_json::from_str::<EventDto>(&ev.data)
                            .context("malformed event on the stream"),
                    ),
                    Err(e) => Some(Err(anyhow::anyhow!("the event stream broke: {e}"))),
                }
            }))
    }
}
