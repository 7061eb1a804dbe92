//! No-progress detection: repeated call fingerprints, repeated results, failure streaks, and
//! turns without any state change, answered with a graduated response (nudge, then a forced
//! final turn without tools, then `no_progress`). Pure.
//!
//! Progress means new state: a call counts as a change only when both its (tool, arguments)
//! and its (tool, result) fingerprints are new. A model that drifts its arguments
//! ("Paris, France" → "Paris, France," → …) while the tool answers the same thing repeats the
//! same result, and that is a repeat like any other.

use serde::{Deserialize, Serialize};

/// Thresholds; a value of 0 turns that signal off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgressPolicy {
    /// The same (tool, canonical arguments), or the same (tool, result), this many times is a
    /// signal.
    pub repeat_limit: u32,
    /// This many failed tool calls in a row is a signal.
    pub failure_limit: u32,
    /// This many turns in a row without a new successful call is a signal.
    pub stale_turn_limit: u32,
}

impl Default for ProgressPolicy {
    fn default() -> Self {
        ProgressPolicy {
            repeat_limit: 3,
            failure_limit: 4,
            stale_turn_limit: 4,
        }
    }
}

/// How far escalation has gone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Escalation {
    /// No signal yet.
    #[default]
    None,
    /// The model was nudged once; the next signal forces a final turn.
    Nudged,
    /// A final turn was forced; the next signal fails the run.
    ForcedFinal,
}

/// What the run should do after a tool batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No signal: carry on.
    Continue,
    /// Tell the model it is repeating itself (the reason is the nudge text).
    Nudge(String),
    /// Next turn: no tools, the model must answer.
    ForceFinal(String),
    /// Fail the run with `no_progress`.
    Fail(String),
}

/// One finished call as progress tracking sees it.
#[derive(Debug, Clone, Copy)]
pub struct CallOutcome {
    /// Of (tool, canonical arguments).
    pub fingerprint: u64,
    /// Of (tool, result envelope).
    pub result_fingerprint: u64,
    /// The tool is a polling tool: no fingerprint or failure counting, a success is progress.
    pub polling: bool,
    /// The call succeeded.
    pub ok: bool,
}

/// Tracker state, kept in the run's checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Progress {
    /// (fingerprint, times seen), least recently seen first; at most
    /// [`MAX_TRACKED_FINGERPRINTS`]. Stored compactly (see [`compact`]).
    #[serde(with = "compact")]
    pub seen: Vec<(u64, u32)>,
    /// (result fingerprint, times seen), least recently seen first; at most
    /// [`MAX_TRACKED_FINGERPRINTS`]. Absent in checkpoints written before results were tracked.
    #[serde(default, with = "compact")]
    pub results_seen: Vec<(u64, u32)>,
    /// Non-polling calls failed in a row; reset by a success and by each escalation.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failure_streak: u32,
    /// Turns in a row without a new successful call; reset by each escalation.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub stale_turns: u32,
    /// How far the graduated response has gone.
    #[serde(default, skip_serializing_if = "is_not_escalated")]
    pub escalation: Escalation,
}

impl Progress {
    /// Records one turn's finished calls and decides the response.
    pub fn record_turn(&mut self, calls: &[CallOutcome], policy: &ProgressPolicy) -> Verdict {
        let mut signal: Option<String> = None;
        let mut changed = false;
        for call in calls {
            if call.polling {
                // Polling tools repeat by design; a success still counts as a change.
                changed |= call.ok;
                continue;
            }
            let count = bump(&mut self.seen, call.fingerprint);
            let results = bump(&mut self.results_seen, call.result_fingerprint);
            changed |= call.ok && count == 1 && results == 1;
            if policy.repeat_limit > 0 && count >= policy.repeat_limit {
                signal.get_or_insert(format!("the same call was made {count} times"));
            }
            if policy.repeat_limit > 0 && results >= policy.repeat_limit {
                signal.get_or_insert(format!(
                    "the same result came back {results} times (different arguments, nothing new)"
                ));
            }
            if call.ok {
                self.failure_streak = 0;
            } else {
                self.failure_streak += 1;
            }
        }
        if policy.failure_limit > 0 && self.failure_streak >= policy.failure_limit {
            signal.get_or_insert(format!(
                "{} tool calls failed in a row",
                self.failure_streak
            ));
        }
        self.stale_turns = if changed { 0 } else { self.stale_turns + 1 };
        if policy.stale_turn_limit > 0 && self.stale_turns >= policy.stale_turn_limit {
            signal.get_or_insert(format!("{} turns without progress", self.stale_turns));
        }
        let Some(reason) = signal else {
            return Verdict::Continue;
        };
        // Streaks restart after each escalation; fingerprint counts do not, so repeating the
        // same call again escalates at once.
        self.failure_streak = 0;
        self.stale_turns = 0;
        match self.escalation {
            Escalation::None => {
                self.escalation = Escalation::Nudged;
                Verdict::Nudge(reason)
            }
            Escalation::Nudged => {
                self.escalation = Escalation::ForcedFinal;
                Verdict::ForceFinal(reason)
            }
            Escalation::ForcedFinal => Verdict::Fail(reason),
        }
    }
}

/// Fingerprints remembered per list. The checkpoint is rewritten at every commit, so what it
/// holds must not grow with the run: a repeat is detected among the last this many distinct
/// calls (and results), which is more than a model's repeating loop spans.
pub const MAX_TRACKED_FINGERPRINTS: usize = 32;

/// The tracked part of a fingerprint: 32 bits. Within a window of
/// [`MAX_TRACKED_FINGERPRINTS`] the chance that two different calls share it is about one in
/// ten million, and a share only makes a call look repeated.
fn tracked(fingerprint: u64) -> u64 {
    fingerprint & 0xFFFF_FFFF
}

/// Counts one more sighting of `fingerprint` and moves it to the most recent end; returns the
/// count. A new fingerprint beyond [`MAX_TRACKED_FINGERPRINTS`] evicts the least recently seen.
/// Zero counters and no escalation are left out of a body (format 5).
fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn is_not_escalated(e: &Escalation) -> bool {
    *e == Escalation::None
}

fn bump(seen: &mut Vec<(u64, u32)>, fingerprint: u64) -> u32 {
    let fingerprint = tracked(fingerprint);
    let count = match seen.iter().position(|(f, _)| *f == fingerprint) {
        Some(i) => seen.remove(i).1 + 1,
        None => 1,
    };
    seen.push((fingerprint, count));
    if seen.len() > MAX_TRACKED_FINGERPRINTS {
        seen.remove(0);
    }
    count
}

/// The stored form of a fingerprint list: one string of URL-safe base64 (no padding) of the
/// entries back to back, each a 32-bit fingerprint (4 bytes, big-endian) and its count as a
/// LEB128 varint (1 byte below 128): about 7 characters an entry (format 5). Also read: the
/// `"<hex>.<count> …"` string of format 4 (it has a `.` in every entry, which base64 never
/// has) and the `[[fingerprint, count], …]` arrays of full 64-bit fingerprints written before,
/// cut to 32 bits and to the window.
pub mod compact {
    use serde::{Deserialize, Deserializer, Serializer};

    use super::{MAX_TRACKED_FINGERPRINTS, tracked};

    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

    /// The list's bytes: fingerprint then varint count, entry after entry.
    fn to_bytes(list: &[(u64, u32)]) -> Vec<u8> {
        let mut out = Vec::with_capacity(list.len() * 5);
        for (f, n) in list {
            out.extend_from_slice(&(tracked(*f) as u32).to_be_bytes());
            let mut n = *n;
            loop {
                let low = (n & 0x7f) as u8;
                n >>= 7;
                if n == 0 {
                    out.push(low);
                    break;
                }
                out.push(low | 0x80);
            }
        }
        out
    }

    fn from_bytes(bytes: &[u8]) -> Option<Vec<(u64, u32)>> {
        let mut list = Vec::new();
        let mut rest = bytes;
        while !rest.is_empty() {
            let (f, after) = rest.split_first_chunk::<4>()?;
            rest = after;
            let mut n: u32 = 0;
            for shift in (0..35).step_by(7) {
                let (&b, after) = rest.split_first()?;
                rest = after;
                n |= u32::from(b & 0x7f).checked_shl(shift)?;
                if b & 0x80 == 0 {
                    break;
                }
                if shift == 28 {
                    return None;
                }
            }
            list.push((u64::from(u32::from_be_bytes(*f)), n));
        }
        Some(list)
    }

    /// URL-safe base64 without padding.
    pub(super) fn encode_base64(bytes: &[u8]) -> String {
        let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
        for chunk in bytes.chunks(3) {
            let b = [
                chunk[0],
                *chunk.get(1).unwrap_or(&0),
                *chunk.get(2).unwrap_or(&0),
            ];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            for i in 0..=chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 0x3f) as usize] as char);
            }
        }
        out
    }

    pub(super) fn decode_base64(text: &str) -> Option<Vec<u8>> {
        let sextet = |c: u8| ALPHABET.iter().position(|&a| a == c).map(|p| p as u32);
        let mut out = Vec::with_capacity(text.len() * 3 / 4);
        for chunk in text.as_bytes().chunks(4) {
            if chunk.len() == 1 {
                return None;
            }
            let mut n = 0u32;
            for (i, &c) in chunk.iter().enumerate() {
                n |= sextet(c)? << (18 - 6 * i);
            }
            for i in 0..chunk.len() - 1 {
                out.push((n >> (16 - 8 * i)) as u8);
            }
        }
        Some(out)
    }

    /// Writes the list as one string.
    pub fn serialize<S: Serializer>(list: &[(u64, u32)], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&encode_base64(&to_bytes(list)))
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Stored {
        Compact(String),
        Pairs(Vec<(u64, u32)>),
    }

    /// Format 4's `"<hex>.<count> …"`.
    fn from_dotted(text: &str) -> Option<Vec<(u64, u32)>> {
        text.split_ascii_whitespace()
            .map(|entry| {
                let (f, n) = entry.split_once('.')?;
                Some((u64::from_str_radix(f, 16).ok()?, n.parse().ok()?))
            })
            .collect()
    }

    /// Reads any stored form.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(u64, u32)>, D::Error> {
        let mut list = match Stored::deserialize(d)? {
            Stored::Pairs(pairs) => pairs.into_iter().map(|(f, n)| (tracked(f), n)).collect(),
            Stored::Compact(text) => if text.contains('.') {
                from_dotted(&text)
            } else {
                decode_base64(&text).and_then(|b| from_bytes(&b))
            }
            .ok_or_else(|| serde::de::Error::custom("bad fingerprint list"))?,
        };
        if list.len() > MAX_TRACKED_FINGERPRINTS {
            list.drain(..list.len() - MAX_TRACKED_FINGERPRINTS);
        }
        Ok(list)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call whose result is as new as its arguments.
    fn call(fingerprint: u64, ok: bool) -> CallOutcome {
        CallOutcome {
            fingerprint,
            result_fingerprint: fingerprint + 1_000,
            polling: false,
            ok,
        }
    }

    fn answered(fingerprint: u64, result_fingerprint: u64) -> CallOutcome {
        CallOutcome {
            fingerprint,
            result_fingerprint,
            polling: false,
            ok: true,
        }
    }

    #[test]
    fn progress_is_judged_by_results_table() {
        let p = ProgressPolicy::default();
        // (calls of each turn as (arguments, result) fingerprints, verdict kinds in order)
        type Turns<'a> = &'a [(u64, u64)];
        let rows: [(Turns, &[&str]); 4] = [
            // New arguments, new results: progress.
            (&[(1, 10), (2, 20), (3, 30), (4, 40)], &["c", "c", "c", "c"]),
            // Drifting arguments, the same result: a repeat.
            (
                &[(1, 10), (2, 10), (3, 10), (4, 10), (5, 10)],
                &["c", "c", "n", "f", "x"],
            ),
            // The same arguments, the same result: a repeat.
            (&[(1, 10), (1, 10), (1, 10)], &["c", "c", "n"]),
            // A result seen before, then new ones: the streak of new state resumes.
            (&[(1, 10), (2, 10), (3, 30), (4, 40)], &["c", "c", "c", "c"]),
        ];
        for (turns, want) in rows {
            let mut t = Progress::default();
            let got: Vec<&str> = turns
                .iter()
                .map(|&(f, r)| match t.record_turn(&[answered(f, r)], &p) {
                    Verdict::Continue => "c",
                    Verdict::Nudge(_) => "n",
                    Verdict::ForceFinal(_) => "f",
                    Verdict::Fail(_) => "x",
                })
                .collect();
            assert_eq!(got, want, "{turns:?}");
        }
    }

    #[test]
    fn the_same_result_counts_as_no_state_change() {
        let p = ProgressPolicy {
            repeat_limit: 0,
            failure_limit: 0,
            stale_turn_limit: 2,
        };
        let mut t = Progress::default();
        assert_eq!(t.record_turn(&[answered(1, 10)], &p), Verdict::Continue);
        assert_eq!(t.record_turn(&[answered(2, 10)], &p), Verdict::Continue);
        assert!(matches!(
            t.record_turn(&[answered(3, 10)], &p),
            Verdict::Nudge(r) if r.contains("turns without progress")
        ));
    }

    #[test]
    fn old_checkpoints_without_results_still_load() {
        let old = r#"{"seen":[[1,2]],"failure_streak":0,"stale_turns":1,"escalation":"none"}"#;
        let t: Progress = serde_json::from_str(old).unwrap();
        assert!(t.results_seen.is_empty());
        assert_eq!(t.seen, vec![(1, 2)]);
    }

    #[test]
    fn repeats_escalate_nudge_force_fail() {
        let p = ProgressPolicy::default();
        let mut t = Progress::default();
        assert_eq!(t.record_turn(&[call(1, true)], &p), Verdict::Continue);
        assert_eq!(t.record_turn(&[call(1, true)], &p), Verdict::Continue);
        assert!(matches!(
            t.record_turn(&[call(1, true)], &p),
            Verdict::Nudge(_)
        ));
        assert!(matches!(
            t.record_turn(&[call(1, true)], &p),
            Verdict::ForceFinal(_)
        ));
        assert!(matches!(
            t.record_turn(&[call(1, true)], &p),
            Verdict::Fail(_)
        ));
    }

    #[test]
    fn new_successful_calls_are_progress() {
        let p = ProgressPolicy::default();
        let mut t = Progress::default();
        for f in 0..20 {
            assert_eq!(t.record_turn(&[call(f, true)], &p), Verdict::Continue);
        }
    }

    #[test]
    fn failure_streak_signals() {
        let p = ProgressPolicy::default();
        let mut t = Progress::default();
        for f in 0..3 {
            assert_eq!(t.record_turn(&[call(f, false)], &p), Verdict::Continue);
        }
        assert!(
            matches!(t.record_turn(&[call(9, false)], &p), Verdict::Nudge(r) if r.contains("failed"))
        );
    }

    #[test]
    fn polling_tools_are_exempt_from_repeats() {
        let p = ProgressPolicy::default();
        let mut t = Progress::default();
        let poll = CallOutcome {
            fingerprint: 7,
            result_fingerprint: 7,
            polling: true,
            ok: true,
        };
        for _ in 0..10 {
            assert_eq!(t.record_turn(&[poll], &p), Verdict::Continue);
        }
    }

    #[test]
    fn tracked_fingerprints_stay_bounded_and_recent_repeats_still_count() {
        let policy = ProgressPolicy::default();
        let mut t = Progress::default();
        // A repeated call kept recent by being made again between many new ones.
        for i in 0..1_000u64 {
            t.record_turn(&[call(10_000 + i, true)], &policy);
            assert!(t.seen.len() <= MAX_TRACKED_FINGERPRINTS);
            assert!(t.results_seen.len() <= MAX_TRACKED_FINGERPRINTS);
        }
        assert_eq!(t.seen.len(), MAX_TRACKED_FINGERPRINTS);
        // The newest are the ones kept.
        assert_eq!(t.seen.last(), Some(&(10_999, 1)));
        assert_eq!(t.seen.first(), Some(&(10_000 + 1_000 - 32, 1)));
        // A repeat within the window is still counted.
        assert_eq!(bump(&mut t.seen, 10_990), 2);
        assert_eq!(t.seen.last(), Some(&(10_990, 2)));
        // Stored compactly: the whole tracker of a long run stays under 500 bytes (two full
        // lists of about 7 characters an entry).
        let json = serde_json::to_string(&t).unwrap();
        assert!(json.len() < 500, "{} bytes: {json}", json.len());
        assert_eq!(serde_json::from_str::<Progress>(&json).unwrap(), t);
    }

    #[test]
    fn earlier_fingerprint_lists_load_cut_to_the_window() {
        let pairs: Vec<String> = (0..40u64)
            .map(|i| format!("[{},1]", (i << 40) | (i + 7)))
            .collect();
        let old = format!(
            r#"{{"seen":[{}],"failure_streak":0,"stale_turns":0,"escalation":"none"}}"#,
            pairs.join(",")
        );
        let t: Progress = serde_json::from_str(&old).unwrap();
        assert_eq!(t.seen.len(), MAX_TRACKED_FINGERPRINTS);
        assert_eq!(t.seen.last(), Some(&(46, 1)), "high bits cut, newest kept");
        assert!(
            serde_json::from_str::<Progress>(
                r#"{"seen":"zz.1","failure_streak":0,"stale_turns":0,"escalation":"none"}"#
            )
            .is_err()
        );
        // Format 4's dotted string, and a base64 string that does not decode.
        let v4: Progress = serde_json::from_str(
            r#"{"seen":"5be2a1f3.1 9c01d2e4.3","failure_streak":0,"stale_turns":0,"escalation":"none"}"#,
        )
        .unwrap();
        assert_eq!(v4.seen, [(0x5be2a1f3, 1), (0x9c01d2e4, 3)]);
        for bad in ["A", "AAAAAA", "!!!!!!!!", "AAAAgA"] {
            let json = format!(r#"{{"seen":"{bad}"}}"#);
            assert!(serde_json::from_str::<Progress>(&json).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_fresh_tracker_writes_nothing_but_its_lists() {
        let json = serde_json::to_string(&Progress::default()).unwrap();
        assert_eq!(json, r#"{"seen":"","results_seen":""}"#);
        let t = Progress {
            seen: vec![(0x5be2a1f3, 1)],
            ..Progress::default()
        };
        // 4 bytes of fingerprint and a 1-byte count: 7 characters.
        assert_eq!(
            serde_json::to_string(&t).unwrap(),
            r#"{"seen":"W-Kh8wE","results_seen":""}"#
        );
    }

    proptest::proptest! {
        #[test]
        fn base64_round_trips(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
            let text = compact::encode_base64(&bytes);
            proptest::prop_assert!(!text.contains('.'));
            proptest::prop_assert_eq!(compact::decode_base64(&text), Some(bytes));
        }

        #[test]
        fn compact_lists_round_trip(list in proptest::collection::vec((0u64..=u64::from(u32::MAX), proptest::prelude::any::<u32>()), 0..32)) {
            let t = Progress { seen: list.clone(), results_seen: list, ..Progress::default() };
            let json = serde_json::to_string(&t).unwrap();
            proptest::prop_assert_eq!(serde_json::from_str::<Progress>(&json).unwrap(), t);
        }
    }

    #[test]
    fn zero_disables_a_signal() {
        let p = ProgressPolicy {
            repeat_limit: 0,
            failure_limit: 0,
            stale_turn_limit: 0,
        };
        let mut t = Progress::default();
        for _ in 0..10 {
            assert_eq!(t.record_turn(&[call(1, false)], &p), Verdict::Continue);
        }
    }
}
