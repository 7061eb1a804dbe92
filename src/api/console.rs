//! The web console at `/`: three static files compiled into the binary (`src/console/`), served
//! with their content type, a strict Content-Security-Policy (nothing but this origin) and an
//! ETag. The console is a client of the `/v1` API like any other; it holds no secrets.

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("../console/index.html");
const APP_JS: &str = include_str!("../console/app.js");
const STYLE_CSS: &str = include_str!("../console/style.css");

/// Only this origin: no CDN, no inline script, no framing.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                   img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// The ETag of a file: its length and FNV-1a hash (stable across builds of the same file).
fn etag(body: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in body.bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("\"{:x}-{hash:016x}\"", body.len())
}

fn asset(headers: &HeaderMap, body: &'static str, content_type: &'static str) -> Response {
    let tag = etag(body);
    let fresh = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == tag));
    let mut res = if fresh {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        ([(header::CONTENT_TYPE, content_type)], body).into_response()
    };
    let h = res.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&tag) {
        h.insert(header::ETAG, v);
    }
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    res
}

/// `GET /`: the console page.
pub async fn index(headers: HeaderMap) -> Response {
    asset(&headers, INDEX, "text/html; charset=utf-8")
}

/// `GET /console/app.js`.
pub async fn app_js(headers: HeaderMap) -> Response {
    asset(&headers, APP_JS, "text/javascript; charset=utf-8")
}

/// `GET /console/style.css`.
pub async fn style_css(headers: HeaderMap) -> Response {
    asset(&headers, STYLE_CSS, "text/css; charset=utf-8")
}

/// Bytes of the console's three files, uncompressed (what a first visit transfers, plus
/// headers).
pub fn size() -> usize {
    INDEX.len() + APP_JS.len() + STYLE_CSS.len()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_console_loads_nothing_from_elsewhere() {
        for (name, text) in [
            ("index.html", super::INDEX),
            ("app.js", super::APP_JS),
            ("style.css", super::STYLE_CSS),
        ] {
            assert!(!text.contains("http://"), "{name} names an http:// URL");
            assert!(!text.contains("https://"), "{name} names an https:// URL");
            assert!(!text.contains("innerHTML"), "{name} inserts HTML");
        }
        assert!(super::size() < 64 * 1024, "{} bytes", super::size());
    }
}
