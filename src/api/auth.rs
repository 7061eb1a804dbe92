//! Bearer-token authentication: each configured token's SHA-256 maps to a tenant; a presented
//! token is hashed and compared with every configured hash in constant time. Tokens are never
//! stored in clear, logged or echoed.

use std::sync::Arc;

use axum::http::{HeaderMap, header};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Longest `Authorization` value looked at.
const MAX_AUTHORIZATION_BYTES: usize = 4096;

/// The tenant a request acts for (a request extension on `/v1` routes).
#[derive(Debug, Clone)]
pub struct Tenant(pub Arc<str>);

/// Token hashes and their tenants.
#[derive(Default)]
pub struct Auth {
    tokens: Vec<([u8; 32], Arc<str>)>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("tokens", &self.tokens.len())
            .finish()
    }
}

fn digest(token: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(&Sha256::digest(token.as_bytes()));
    out
}

impl Auth {
    /// From (tenant, resolved token) pairs.
    pub fn new<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        Auth {
            tokens: pairs
                .into_iter()
                .map(|(tenant, token)| (digest(token), Arc::from(tenant)))
                .collect(),
        }
    }

    /// The tenant of a request's `Authorization: Bearer <token>`, if any. Exactly one header,
    /// the `Bearer` scheme (any case), one space, a non-empty token without whitespace.
    pub fn authenticate(&self, headers: &HeaderMap) -> Option<Arc<str>> {
        let mut values = headers.get_all(header::AUTHORIZATION).iter();
        let value = values.next()?;
        if values.next().is_some() || value.len() > MAX_AUTHORIZATION_BYTES {
            return None;
        }
        let value = value.to_str().ok()?;
        let (scheme, token) = value.split_once(' ')?;
        if !scheme.eq_ignore_ascii_case("bearer")
            || token.is_empty()
            || token.bytes().any(|b| b.is_ascii_whitespace())
        {
            return None;
        }
        let presented = digest(token);
        // Compare with every hash, so timing does not depend on which one matched.
        let mut found: Option<Arc<str>> = None;
        for (hash, tenant) in &self.tokens {
            if bool::from(hash.ct_eq(&presented)) {
                found = Some(tenant.clone());
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(v: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in v {
            h.append(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn bearer_tokens_map_to_tenants() {
        let auth = Auth::new([
            ("a", "token-aaaaaaaaaaaaaaaa"),
            ("b", "token-bbbbbbbbbbbbbbbb"),
        ]);
        assert_eq!(
            auth.authenticate(&headers(&["Bearer token-aaaaaaaaaaaaaaaa"]))
                .as_deref(),
            Some("a")
        );
        assert_eq!(
            auth.authenticate(&headers(&["bearer token-bbbbbbbbbbbbbbbb"]))
                .as_deref(),
            Some("b")
        );
        for bad in [
            vec![],
            vec!["Bearer"],
            vec!["Bearer "],
            vec!["Basic token-aaaaaaaaaaaaaaaa"],
            vec!["Bearer  token-aaaaaaaaaaaaaaaa"],
            vec!["Bearer token-aaaaaaaaaaaaaaaa "],
            vec!["Bearer wrong"],
            vec![
                "Bearer token-aaaaaaaaaaaaaaaa",
                "Bearer token-aaaaaaaaaaaaaaaa",
            ],
        ] {
            assert!(auth.authenticate(&headers(&bad)).is_none(), "{bad:?}");
        }
    }
}
