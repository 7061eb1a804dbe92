//! Per-call callback tokens of long-running tools (API.md "Long-running HTTP tools").
//!
//! Every call to an HTTP tool carries `X-Agentd-Callback-Url` (the route
//! `POST /v1/runs/{id}/calls/{call_id}/result` under the daemon's `server.public_url`) and
//! `X-Agentd-Callback-Token`, a secret for that one call. The token is never stored: it is
//! `HMAC-SHA256(callback key, run id, call id)`, so every node with the same key derives and
//! checks it (a result may arrive through any node, and after a restart), and the checkpoint,
//! events, logs, the model's context and API answers never hold it. A presented token is
//! compared in constant time.
//!
//! The key is `server.callback_secret` when configured; otherwise it is derived from the
//! configured tenant tokens (so nodes with the same configuration agree, and a restart keeps
//! outstanding callbacks valid), or random for a daemon without configured tokens.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::ids::{CallId, RunId};

/// The daemon's key for callback tokens. Its `Debug` hides it.
#[derive(Clone)]
pub struct CallbackKey([u8; 32]);

impl std::fmt::Debug for CallbackKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallbackKey([redacted])")
    }
}

const DOMAIN: &[u8] = b"agentd callback token v1";

impl CallbackKey {
    /// A key derived from secret material (a configured secret, or the tenant tokens).
    pub fn derive<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> Self {
        let mut h = Sha256::new();
        h.update(DOMAIN);
        for p in parts {
            // Length-prefixed, so different splits of the same bytes give different keys.
            h.update((p.len() as u64).to_be_bytes());
            h.update(p);
        }
        let mut key = [0u8; 32];
        key.copy_from_slice(&h.finalize());
        CallbackKey(key)
    }

    /// A key of this process only: callbacks do not survive a restart.
    pub fn random() -> Self {
        CallbackKey(rand::random())
    }

    /// The token of one call.
    pub fn token(&self, run: &RunId, call: &CallId) -> CallbackToken {
        CallbackToken(hex::encode(self.mac(run, call)))
    }

    /// Whether `presented` is the token of this call (constant time).
    pub fn verify(&self, run: &RunId, call: &CallId, presented: &str) -> bool {
        let Ok(bytes) = hex::decode(presented.trim()) else {
            return false;
        };
        bytes.len() == 32 && bool::from(bytes.ct_eq(&self.mac(run, call)))
    }

    fn mac(&self, run: &RunId, call: &CallId) -> [u8; 32] {
        let mut msg = Vec::with_capacity(64);
        msg.extend_from_slice(run.as_str().as_bytes());
        msg.push(0);
        msg.extend_from_slice(call.as_str().as_bytes());
        hmac_sha256(&self.0, &msg)
    }
}

/// HMAC-SHA256 (RFC 2104) for keys of at most one block.
fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let ipad: Vec<u8> = block.iter().map(|b| b ^ 0x36).collect();
    let opad: Vec<u8> = block.iter().map(|b| b ^ 0x5c).collect();
    let mut inner = Sha256::new();
    inner.update(&ipad);
    inner.update(msg);
    let inner = inner.finalize();
    let mut outer = Sha256::new();
    outer.update(&opad);
    outer.update(inner);
    let mut out = [0u8; 32];
    out.copy_from_slice(&outer.finalize());
    out
}

/// One call's token, sent only as `X-Agentd-Callback-Token`. Its `Debug` hides it.
#[derive(Clone, PartialEq, Eq)]
pub struct CallbackToken(String);

impl CallbackToken {
    /// The token itself (64 hex digits), for the `X-Agentd-Callback-Token` header only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for CallbackToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallbackToken([redacted])")
    }
}

/// Where and how a tool completes one call.
#[derive(Debug, Clone)]
pub struct Callback {
    /// The call's result route: `<public_url>/v1/runs/{id}/calls/{call_id}/result`.
    pub url: String,
    /// The call's secret token, presented with the result.
    pub token: CallbackToken,
}

/// The daemon's callback route: its public base URL and key.
#[derive(Debug, Clone)]
pub struct Callbacks {
    /// Without a trailing slash, e.g. `http://127.0.0.1:7700`.
    public_url: String,
    key: CallbackKey,
}

impl Callbacks {
    /// The route under `public_url` (a trailing `/` is dropped), with tokens from `key`.
    pub fn new(public_url: &str, key: CallbackKey) -> Self {
        Callbacks {
            public_url: public_url.trim_end_matches('/').to_owned(),
            key,
        }
    }

    /// The callback of one call.
    pub fn for_call(&self, run: &RunId, call: &CallId) -> Callback {
        Callback {
            url: format!(
                "{}/v1/runs/{}/calls/{}/result",
                self.public_url,
                run.as_str(),
                call.as_str()
            ),
            token: self.key.token(run, call),
        }
    }

    /// Whether `presented` is the token of this call (constant time).
    pub fn verify(&self, run: &RunId, call: &CallId, presented: &str) -> bool {
        self.key.verify(run, call, presented)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231_case_2() {
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(mac),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn tokens_are_bound_to_run_call_and_key() {
        let key = CallbackKey::derive([b"secret".as_slice()]);
        let run = RunId::generate();
        let (c1, c2) = (CallId::new(1, 0), CallId::new(1, 1));
        let t = key.token(&run, &c1);
        assert!(key.verify(&run, &c1, t.expose()));
        assert!(!key.verify(&run, &c2, t.expose()));
        assert!(!key.verify(&RunId::generate(), &c1, t.expose()));
        let other = CallbackKey::derive([b"other".as_slice()]);
        assert!(!other.verify(&run, &c1, t.expose()));
        assert!(!key.verify(&run, &c1, "not hex"));
        assert!(!key.verify(&run, &c1, &t.expose()[..10]));
        // The same material gives the same key (another node, or after a restart).
        let again = CallbackKey::derive([b"secret".as_slice()]);
        assert!(again.verify(&run, &c1, t.expose()));
        assert!(!format!("{t:?} {key:?}").contains(t.expose()));
        let cb = Callbacks::new("http://h:1/", key).for_call(&run, &c1);
        assert_eq!(
            cb.url,
            format!("http://h:1/v1/runs/{}/calls/call_1_0/result", run.as_str())
        );
    }
}
