//! Extractors whose rejections are `ApiError`: bounded JSON bodies (invalid JSON → 400, wrong
//! shape → 422, too large → 413), query strings (→ 400) and path ids parsed with the id types
//! (a malformed id → 404 without touching the store).
//!
//! Every body is a JSON object. serde would fill a struct from an array by position
//! (`["demo", "x"]` as `{"agent": "demo", "input": "x"}`), so anything else valid JSON is
//! refused (422 `invalid_request`) before it is deserialized.

use std::collections::HashMap;

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::header;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use super::AppState;
use super::error::ApiError;
use crate::ids::{CallId, RunId};

/// Reads the body, at most `limit` bytes.
pub(super) async fn read_body(req: Request, limit: usize) -> Result<axum::body::Bytes, ApiError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::payload_too_large(limit));
    }
    axum::body::to_bytes(req.into_body(), limit)
        .await
        .map_err(|e| {
            let mut too_large = false;
            let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            while let Some(err) = cur {
                too_large |= err.to_string().contains("length limit exceeded");
                cur = err.source();
            }
            if too_large {
                ApiError::payload_too_large(limit)
            } else {
                ApiError::invalid_json("the body could not be read")
            }
        })
}

/// Parses a JSON object, classifying syntax errors (400) and shape errors (422): a body that
/// is valid JSON but not an object is a shape error.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let classify = |e: serde_json::Error| {
        use serde_json::error::Category;
        match e.classify() {
            Category::Data => ApiError::invalid_request(e.to_string()),
            Category::Syntax | Category::Eof | Category::Io => {
                ApiError::invalid_json(format!("the body is not valid JSON: {e}"))
            }
        }
    };
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        // Valid JSON of another kind is a shape error; anything else a syntax error.
        serde_json::from_slice::<serde::de::IgnoredAny>(bytes).map_err(classify)?;
        let kind = match first {
            Some(b'[') => "an array",
            Some(b'"') => "a string",
            Some(b'n') => "null",
            Some(b't' | b'f') => "a boolean",
            _ => "a number",
        };
        return Err(ApiError::invalid_request(format!(
            "the body must be a JSON object, not {kind}"
        )));
    }
    serde_json::from_slice(bytes).map_err(classify)
}

/// A JSON body (required).
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let bytes = read_body(req, state.limits.max_body_bytes).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(ApiError::invalid_json(
                "the body is empty; a JSON object is required",
            ));
        }
        parse_json(&bytes).map(JsonBody)
    }
}

/// A JSON body that may be absent (an empty body is `T::default()`).
pub struct OptionalJsonBody<T>(pub T);

impl<T: DeserializeOwned + Default> FromRequest<AppState> for OptionalJsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let bytes = read_body(req, state.limits.max_body_bytes).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(OptionalJsonBody(T::default()));
        }
        parse_json(&bytes).map(OptionalJsonBody)
    }
}

/// A query string.
pub struct Query<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        axum::extract::Query::<T>::try_from_uri(&parts.uri)
            .map(|axum::extract::Query(v)| Query(v))
            .map_err(|e| ApiError::invalid_query(e.body_text()))
    }
}

async fn path_params<S: Send + Sync>(
    parts: &mut Parts,
    state: &S,
) -> Result<HashMap<String, String>, ApiError> {
    axum::extract::Path::<HashMap<String, String>>::from_request_parts(parts, state)
        .await
        .map(|axum::extract::Path(p)| p)
        .map_err(|_| ApiError::run_not_found())
}

/// `{id}`: a run id. Anything that is not a well-formed run id is a missing run.
pub struct RunPath(pub RunId);

impl<S: Send + Sync> FromRequestParts<S> for RunPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let p = path_params(parts, state).await?;
        let id = p.get("id").ok_or_else(ApiError::run_not_found)?;
        id.parse::<RunId>()
            .map(RunPath)
            .map_err(|_| ApiError::run_not_found())
    }
}

/// `{id}` and `{call_id}`.
pub struct CallPath(pub RunId, pub CallId);

impl<S: Send + Sync> FromRequestParts<S> for CallPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let p = path_params(parts, state).await?;
        let id = p
            .get("id")
            .and_then(|s| s.parse::<RunId>().ok())
            .ok_or_else(ApiError::run_not_found)?;
        let call = p
            .get("call_id")
            .and_then(|s| s.parse::<CallId>().ok())
            .ok_or_else(|| {
                ApiError::new(
                    axum::http::StatusCode::NOT_FOUND,
                    "not_found",
                    "no such call in this run",
                )
            })?;
        Ok(CallPath(id, call))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    struct Pair {
        #[allow(dead_code)]
        agent: String,
        #[allow(dead_code)]
        input: String,
    }

    #[test]
    fn only_objects_are_bodies() {
        assert!(parse_json::<Pair>(br#" {"agent":"demo","input":"x"}"#).is_ok());
        for (body, kind) in [
            (&br#"["demo", "x"]"#[..], "an array"),
            (b"  \"demo\"", "a string"),
            (b"null", "null"),
            (b"true", "a boolean"),
            (b"12", "a number"),
        ] {
            let e = parse_json::<Pair>(body).unwrap_err();
            assert_eq!(e.code, "invalid_request", "{body:?}");
            assert!(e.message.ends_with(kind), "{}", e.message);
        }
        assert_eq!(parse_json::<Pair>(b"[1,").unwrap_err().code, "invalid_json");
    }
}
