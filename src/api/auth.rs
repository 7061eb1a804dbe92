//! Bearer-token authentication: each configured token's SHA-256 maps to a [`Principal`] (its
//! tenant, its configured name, its scopes, the tenant's agents); a presented token is hashed
//! and compared with every configured hash in constant time. Tokens are never stored in clear,
//! logged or echoed.

use std::sync::Arc;

use axum::http::{HeaderMap, header};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::TenantConfig;
use crate::run::guard;

/// Longest `Authorization` value looked at.
const MAX_AUTHORIZATION_BYTES: usize = 4096;

/// The tenant a request acts for (a request extension on `/v1` routes).
#[derive(Debug, Clone)]
pub struct Tenant(pub Arc<str>);

/// Who a request acts for (a request extension on `/v1` routes, next to [`Tenant`]).
#[derive(Debug, Clone)]
pub struct Principal {
    /// The tenant the token belongs to; every run it touches must be this tenant's.
    pub tenant: Arc<str>,
    /// The token's configured `name` (recorded as who decided an approval); plain tokens have
    /// none. Never the token itself.
    pub name: Option<Arc<str>>,
    /// `None`: every scope (a plain token).
    pub scopes: Option<Arc<[String]>>,
    /// The agents the tenant may see and run; `None`: every agent.
    pub agents: Option<Arc<[String]>>,
}

impl Principal {
    /// A principal with every scope and every agent.
    pub fn full(tenant: &str) -> Self {
        Principal {
            tenant: Arc::from(tenant),
            name: None,
            scopes: None,
            agents: None,
        }
    }

    /// Whether the token's scopes grant `permission` (see `run::guard::grants`).
    pub fn grants(&self, permission: &str) -> bool {
        guard::grants(self.scopes.as_deref(), permission)
    }

    /// Whether the tenant may see and run `agent`.
    pub fn may_use(&self, agent: &str) -> bool {
        self.agents
            .as_deref()
            .is_none_or(|list| list.iter().any(|a| a == agent))
    }
}

/// The token of a request's `Authorization: Bearer <token>`: exactly one header, the `Bearer`
/// scheme (any case), one space, a non-empty token without whitespace.
pub fn bearer_token(headers: &HeaderMap) -> Option<&str> {
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
    Some(token)
}

/// Token hashes and their principals.
#[derive(Default)]
pub struct Auth {
    tokens: Vec<([u8; 32], Principal)>,
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
    /// From (tenant, resolved token) pairs: plain tokens, every scope, every agent.
    pub fn new<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        Auth {
            tokens: pairs
                .into_iter()
                .map(|(tenant, token)| (digest(token), Principal::full(tenant)))
                .collect(),
        }
    }

    /// From the configured tenants, resolving `env:NAME` tokens.
    pub fn from_tenants(tenants: &[TenantConfig]) -> Result<Self, crate::config::Error> {
        let mut tokens = Vec::new();
        for (i, t) in tenants.iter().enumerate() {
            let tenant: Arc<str> = Arc::from(t.id.as_str());
            let agents: Option<Arc<[String]>> = t.agents.as_deref().map(Arc::from);
            for (j, tok) in t.tokens.iter().enumerate() {
                let secret = tok.secret().resolve(&format!("tenants[{i}].tokens[{j}]"))?;
                tokens.push((
                    digest(&secret),
                    Principal {
                        tenant: tenant.clone(),
                        name: tok.name().map(Arc::from),
                        scopes: tok.scopes().map(Arc::from),
                        agents: agents.clone(),
                    },
                ));
            }
        }
        Ok(Auth { tokens })
    }

    /// The principal of a request's `Authorization: Bearer <token>`, if any. Exactly one
    /// header, the `Bearer` scheme (any case), one space, a non-empty token without whitespace.
    pub fn authenticate(&self, headers: &HeaderMap) -> Option<Principal> {
        let presented = digest(bearer_token(headers)?);
        // Compare with every hash, so timing does not depend on which one matched.
        let mut found: Option<&Principal> = None;
        for (hash, principal) in &self.tokens {
            if bool::from(hash.ct_eq(&presented)) {
                found = Some(principal);
            }
        }
        found.cloned()
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
                .map(|p| p.tenant)
                .as_deref(),
            Some("a")
        );
        assert_eq!(
            auth.authenticate(&headers(&["bearer token-bbbbbbbbbbbbbbbb"]))
                .map(|p| p.tenant)
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

    #[test]
    fn configured_tokens_carry_their_name_scopes_and_agents() {
        let tenants: Vec<TenantConfig> = toml::from_str::<toml::Table>(
            r#"
            [[t]]
            id = "acme"
            agents = ["triage"]
            tokens = ["plain-token-0123456789",
                      { name = "ci-bot", token = "ci-token-0123456789", scopes = ["deploy:staging"] },
                      { name = "ops", token = "ops-token-0123456789" }]
            "#,
        )
        .unwrap()["t"]
            .clone()
            .try_into()
            .unwrap();
        let auth = Auth::from_tenants(&tenants).unwrap();
        let who = |t: &str| {
            auth.authenticate(&headers(&[&format!("Bearer {t}")]))
                .unwrap()
        };
        let plain = who("plain-token-0123456789");
        assert_eq!(&*plain.tenant, "acme");
        assert!(plain.name.is_none() && plain.grants("approve") && plain.grants("x:y"));
        assert!(plain.may_use("triage") && !plain.may_use("other"));
        let bot = who("ci-token-0123456789");
        assert_eq!(bot.name.as_deref(), Some("ci-bot"));
        assert!(bot.grants("deploy:staging") && !bot.grants("approve"));
        let ops = who("ops-token-0123456789");
        assert_eq!(ops.name.as_deref(), Some("ops"));
        assert!(ops.grants("approve:anything"));
    }
}
