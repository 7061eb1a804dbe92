//! Every Redis key the store uses, in one place. All keys of one run share the hash tag
//! `{run:<id>}`, and all keys of one node the hash tag `{node:<id>}`, so that every Lua script
//! touches keys of one hash slot only (Redis Cluster). The indexes (active, due, tenant runs,
//! client keys) are other slots: scripts never touch them; the store updates them with plain
//! commands, ordered so that a crash in between leaves only entries that readers skip and
//! clean. Every key starts with the deployment namespace so several deployments (and tests)
//! can share one Redis.
//!
//! Layout (`<ns>` is the namespace, default `agentd`):
//!
//! | key | type | holds |
//! |---|---|---|
//! | `<ns>:{run:<id>}:ckpt` | hash | `v` version, `body` the run's state (its format's JSON), `meta` tenant, agent and creation time (written once, by the create), `u` update time, `seq` last event seq, `tl` transcript length, `status`, `terminal`, `fence` current lease token, `tokens` last issued token (a record of the first layout has `doc`, the whole checkpoint as JSON, instead of `body`, `meta` and `u`, until its next load rewrites it) |
//! | `<ns>:{run:<id>}:events` | stream | one entry per commit, id `<seq of its last event>-0`, field `e` once per event (event JSON, in seq order); entries written before this layout hold one event each, which reads the same |
//! | `<ns>:{run:<id>}:transcript` | list | the run's transcript, one message JSON per entry, append-only; the checkpoint body records its length |
//! | `<ns>:{run:<id>}:controls` | list | control inbox; position + 1 is the seq |
//! | `<ns>:{run:<id>}:lease` | hash (PX ttl) | `owner`, `token` of the live lease |
//! | `<ns>:active` | set | run ids not yet terminal (a superset: readers check the checkpoint) |
//! | `<ns>:due` | sorted set (score = wall-clock ms) | runs some node should take at that time: lease expiry, a passivated run's timer, or now |
//! | `<ns>:{node:<id>}:owner` | string (PX ttl) | the process instance holding the node id |
//! | `<ns>:{node:<id>}:wake` | stream (MAXLEN ~ 10000) | wake-ups for the node, field `r` = run id |
//! | `<ns>:tenant:<tenant>:runs` | sorted set (score 0) | the tenant's run ids, lexical = time order |
//! | `<ns>:tenant:<tenant>:status:<status>:runs` | sorted set (score 0) | the tenant's runs in that status (a superset: readers check the checkpoint) |
//! | `<ns>:tenant:<tenant>:agent:<agent>:runs` | sorted set (score 0) | the tenant's runs of that agent |
//! | `<ns>:tenant:<tenant>:list-indexed` | string | present once the two indexes above cover every run of the tenant |
//! | `<ns>:tenant:<tenant>:ckey:<sha256(key)>` | string | client idempotency key → run id |
//! | `<ns>:epoch` | string | random id written once when the namespace is initialised |
//!
//! User-supplied parts never reach a key unescaped: run ids have a charset without `{`, `}`, `:`
//! (see `ids`), tenants, statuses, agents and node ids are percent-escaped, client keys are
//! hashed.

use sha2::{Digest, Sha256};

use crate::ids::RunId;

/// Namespace used when none is configured.
pub const DEFAULT_NAMESPACE: &str = "agentd";

/// Longest accepted namespace.
pub const MAX_NAMESPACE_LEN: usize = 64;

/// Why a namespace is rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("store namespace {0:?} must be 1..=64 ASCII letters, digits, `_`, `-` or `.`")]
pub struct BadNamespace(pub String);

/// Builds the keys of one namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    ns: String,
}

impl Keys {
    /// Checks the namespace: it must not contain `{`, `}`, `:` or glob characters, so it can
    /// neither change a key's hash slot nor widen a SCAN pattern.
    pub fn new(ns: &str) -> Result<Self, BadNamespace> {
        let ok = !ns.is_empty()
            && ns.len() <= MAX_NAMESPACE_LEN
            && ns
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
        if ok {
            Ok(Keys { ns: ns.to_owned() })
        } else {
            Err(BadNamespace(ns.to_owned()))
        }
    }

    /// The key prefix every key starts with (checked by [`Keys::new`]).
    pub fn namespace(&self) -> &str {
        &self.ns
    }

    fn run_key(&self, run: &RunId, suffix: &str) -> String {
        format!("{}:{{run:{}}}:{suffix}", self.ns, run.as_str())
    }

    /// The run's checkpoint hash (version, body, constant fields, fence, token counter).
    pub fn ckpt(&self, run: &RunId) -> String {
        self.run_key(run, "ckpt")
    }

    /// The run's event stream.
    pub fn events(&self, run: &RunId) -> String {
        self.run_key(run, "events")
    }

    /// The run's transcript: one list entry per message, append-only.
    pub fn transcript(&self, run: &RunId) -> String {
        self.run_key(run, "transcript")
    }

    /// The run's control inbox.
    pub fn controls(&self, run: &RunId) -> String {
        self.run_key(run, "controls")
    }

    /// The run's live lease (expires with PX).
    pub fn lease(&self, run: &RunId) -> String {
        self.run_key(run, "lease")
    }

    /// Set of non-terminal runs.
    pub fn active(&self) -> String {
        format!("{}:active", self.ns)
    }

    /// Sorted set of runs by due time.
    pub fn due(&self) -> String {
        format!("{}:due", self.ns)
    }

    fn node_key(&self, node: &str, suffix: &str) -> String {
        format!("{}:{{node:{}}}:{suffix}", self.ns, escape(node))
    }

    /// Which process instance holds the node id (expires with PX).
    pub fn node_owner(&self, node: &str) -> String {
        self.node_key(node, "owner")
    }

    /// The node's wake-up stream.
    pub fn node_wake(&self, node: &str) -> String {
        self.node_key(node, "wake")
    }

    /// Sorted set of one tenant's run ids.
    pub fn tenant_runs(&self, tenant: &str) -> String {
        format!("{}:tenant:{}:runs", self.ns, escape(tenant))
    }

    /// Sorted set of one tenant's run ids in one status (the status filter's index).
    pub fn tenant_status_runs(&self, tenant: &str, status: &str) -> String {
        format!(
            "{}:tenant:{}:status:{}:runs",
            self.ns,
            escape(tenant),
            escape(status)
        )
    }

    /// Sorted set of one tenant's run ids of one agent (the agent filter's index).
    pub fn tenant_agent_runs(&self, tenant: &str, agent: &str) -> String {
        format!(
            "{}:tenant:{}:agent:{}:runs",
            self.ns,
            escape(tenant),
            escape(agent)
        )
    }

    /// Marker: the tenant's status and agent indexes cover every run of the tenant.
    pub fn tenant_list_indexed(&self, tenant: &str) -> String {
        format!("{}:tenant:{}:list-indexed", self.ns, escape(tenant))
    }

    /// One tenant's client idempotency key → run id.
    pub fn client_key(&self, tenant: &str, key: &str) -> String {
        let digest = hex::encode(Sha256::digest(key.as_bytes()));
        format!("{}:tenant:{}:ckey:{digest}", self.ns, escape(tenant))
    }

    /// The namespace's epoch marker.
    pub fn epoch(&self) -> String {
        format!("{}:epoch", self.ns)
    }
}

/// Percent-escapes everything outside `[A-Za-z0-9_-]` (including `%`), so the mapping is
/// injective and the result holds no `{`, `}`, `:`, `*`, `?` or `[`.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Redis Cluster's hash tag of a key: the part inside the first `{…}` if non-empty, else the
/// whole key. Used by tests to prove a run's keys share one slot.
pub fn hash_tag(key: &str) -> &str {
    if let Some(open) = key.find('{')
        && let Some(len) = key[open + 1..].find('}')
        && len > 0
    {
        return &key[open + 1..open + 1 + len];
    }
    key
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn run() -> RunId {
        "run_0192abc".parse().unwrap()
    }

    #[test]
    fn run_keys_are_pinned_and_share_one_hash_tag() {
        let k = Keys::new("agentd").unwrap();
        let r = run();
        assert_eq!(k.ckpt(&r), "agentd:{run:run_0192abc}:ckpt");
        assert_eq!(k.events(&r), "agentd:{run:run_0192abc}:events");
        assert_eq!(k.controls(&r), "agentd:{run:run_0192abc}:controls");
        assert_eq!(k.lease(&r), "agentd:{run:run_0192abc}:lease");
        for key in [k.ckpt(&r), k.events(&r), k.controls(&r), k.lease(&r)] {
            assert_eq!(hash_tag(&key), "run:run_0192abc");
        }
    }

    #[test]
    fn global_keys_are_pinned() {
        let k = Keys::new("t-1.x").unwrap();
        assert_eq!(k.active(), "t-1.x:active");
        assert_eq!(k.due(), "t-1.x:due");
        assert_eq!(k.epoch(), "t-1.x:epoch");
        assert_eq!(k.tenant_runs("acme"), "t-1.x:tenant:acme:runs");
        assert_eq!(
            k.client_key("acme", "abc"),
            format!(
                "t-1.x:tenant:acme:ckey:{}",
                "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
            )
        );
    }

    #[test]
    fn node_keys_are_pinned_escaped_and_share_one_hash_tag() {
        let k = Keys::new("agentd").unwrap();
        assert_eq!(k.node_owner("node-1"), "agentd:{node:node-1}:owner");
        assert_eq!(k.node_wake("node-1"), "agentd:{node:node-1}:wake");
        assert_eq!(k.node_owner("a}:{b"), "agentd:{node:a%7D%3A%7Bb}:owner");
        for key in [k.node_owner("n.2"), k.node_wake("n.2")] {
            assert_eq!(hash_tag(&key), "node:n%2E2");
        }
    }

    #[test]
    fn tenants_are_escaped_injectively() {
        assert_eq!(escape("a{b}:c*"), "a%7Bb%7D%3Ac%2A");
        assert_eq!(escape("50%"), "50%25");
        assert_ne!(escape("a%3A"), escape("a:"));
        let k = Keys::new("ns").unwrap();
        assert_eq!(k.tenant_runs("x}:{y"), "ns:tenant:x%7D%3A%7By:runs");
        assert_eq!(
            k.tenant_status_runs("t:1", "waiting_approval"),
            "ns:tenant:t%3A1:status:waiting_approval:runs"
        );
        assert_eq!(
            k.tenant_agent_runs("t", "a:runs"),
            "ns:tenant:t:agent:a%3Aruns:runs"
        );
        assert_eq!(k.tenant_list_indexed("t"), "ns:tenant:t:list-indexed");
    }

    #[test]
    fn namespaces_cannot_inject() {
        for bad in ["", "a{b", "a}b", "a:b", "a*", "a b", &"n".repeat(65)] {
            assert!(Keys::new(bad).is_err(), "{bad:?} must be rejected");
        }
        assert!(Keys::new("agentd-test_1.2").is_ok());
    }
}
