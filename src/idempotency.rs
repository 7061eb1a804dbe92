//! Canonical JSON (RFC 8785) and the server-side derivation of idempotency keys and call
//! fingerprints. Golden tests pin the derivation: changing it would make a restarted daemon
//! send a second effect under a new key.

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::ids::RunId;

/// RFC 8785 canonical form of a JSON value: key order and number format are fixed.
pub fn canonical_json(value: &Value) -> String {
    // serde_jcs only fails on non-finite floats, which serde_json::Value cannot hold.
    serde_jcs::to_string(value).unwrap_or_else(|_| value.to_string())
}

/// The idempotency key for one tool call, derived only from stable inputs:
/// `hex(sha256("agentd.v1\n" run "\n" turn "\n" index "\n" tool "\n" canonical(args)))`,
/// prefixed `idk_`. The model never chooses it.
pub fn idempotency_key(run: &RunId, turn: u32, index: usize, tool: &str, args: &Value) -> String {
    let mut h = Sha256::new();
    h.update(b"agentd.v1\n");
    for part in [run.as_str(), &turn.to_string(), &index.to_string(), tool] {
        h.update(part.as_bytes());
        h.update(b"\n");
    }
    h.update(canonical_json(args).as_bytes());
    format!("idk_{}", hex::encode(h.finalize()))
}

/// The idempotency key of the call that compensates the call with key `original`:
/// `hex(sha256("agentd.compensate.v1\n" original))`, prefixed `idk_`. Derived only from the
/// original's key, so every attempt and every restart sends the same one, and it never
/// equals the original's.
pub fn compensation_key(original: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"agentd.compensate.v1\n");
    h.update(original.as_bytes());
    format!("idk_{}", hex::encode(h.finalize()))
}

/// A short fingerprint of (tool, canonical arguments), used by no-progress detection.
pub fn call_fingerprint(tool: &str, args: &Value) -> u64 {
    let mut h = Sha256::new();
    h.update(tool.as_bytes());
    h.update(b"\n");
    h.update(canonical_json(args).as_bytes());
    let digest = h.finalize();
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn canonical_json_sorts_keys_and_normalises_numbers() {
        assert_eq!(
            canonical_json(&json!({"b": 1.0, "a": [true, null], "c": {"z": "x", "y": 1e2}})),
            r#"{"a":[true,null],"b":1,"c":{"y":100,"z":"x"}}"#
        );
    }

    #[test]
    fn idempotency_key_golden_values() {
        let run: RunId = "run_0192f0c1a2b37c4d8e9f000000000001".parse().unwrap();
        // Golden values: if these change, keys of calls written by an older daemon no longer
        // match and a recovered call could be sent twice under two keys.
        assert_eq!(
            idempotency_key(&run, 1, 0, "echo", &json!({"text": "hi"})),
            idempotency_key(&run, 1, 0, "echo", &json!({"text": "hi"}))
        );
        let k = idempotency_key(
            &run,
            1,
            0,
            "restart_service",
            &json!({"service": "api", "force": false}),
        );
        assert_eq!(
            k,
            "idk_".to_owned() + &hex::encode(Sha256::digest(
                b"agentd.v1\nrun_0192f0c1a2b37c4d8e9f000000000001\n1\n0\nrestart_service\n{\"force\":false,\"service\":\"api\"}"
            ))
        );
        assert_eq!(k, GOLDEN_RESTART_KEY);
        // Argument key order does not matter; every other input does.
        let reordered = idempotency_key(
            &run,
            1,
            0,
            "restart_service",
            &json!({"force": false, "service": "api"}),
        );
        assert_eq!(k, reordered);
        assert_ne!(
            k,
            idempotency_key(
                &run,
                2,
                0,
                "restart_service",
                &json!({"service": "api", "force": false})
            )
        );
        assert_ne!(
            k,
            idempotency_key(
                &run,
                1,
                1,
                "restart_service",
                &json!({"service": "api", "force": false})
            )
        );
        assert_ne!(
            k,
            idempotency_key(
                &run,
                1,
                0,
                "restart",
                &json!({"service": "api", "force": false})
            )
        );
    }

    #[test]
    fn compensation_key_golden_value() {
        // Golden: a restarted daemon must resend a compensation under the key it was first
        // sent with.
        let k = compensation_key(GOLDEN_RESTART_KEY);
        assert_eq!(
            k,
            "idk_".to_owned()
                + &hex::encode(Sha256::digest(
                    format!("agentd.compensate.v1\n{GOLDEN_RESTART_KEY}").as_bytes()
                ))
        );
        assert_eq!(k, GOLDEN_COMPENSATION_KEY);
        assert_ne!(k, GOLDEN_RESTART_KEY);
        assert_ne!(k, compensation_key(&k));
    }

    const GOLDEN_COMPENSATION_KEY: &str =
        "idk_4918997edb474c0844facc5c8e5146cd3166a4e5a4ccbba033664eaae2dedb47";

    const GOLDEN_RESTART_KEY: &str =
        "idk_3f3e659d0e69b58a945a3b013bb102c733d65f77c37957647151eed25387d92d";
}
