//! The stored checkpoint body's format: its version, how the current one is written, and how
//! every earlier one is read (migration on read). A body of a version newer than this build
//! knows is refused, never misread.
//!
//! Versions:
//! - 1: the JSON of `RunState` with no version field (every release before the field existed).
//! - 2: the same fields, with `"format_version": 2` first; the transcript inline.
//! - 3: the transcript is no longer in the body: it is stored apart, append-only, one entry
//!   per message, and the body records `transcript_len`, how many entries belong to it (so a
//!   body whose transcript is shorter is torn, refused as corrupt; entries beyond it belong to
//!   a later version). `messages` is written empty. Also new in 3: long-running tool calls
//!   (phase `awaiting_tool`, call status `awaiting_result` and the call's `task`: status URL,
//!   deadline), names a build that knows only version 2 refuses instead of misreading.
//! - 4: the no-progress tracker's fingerprint lists (`progress.seen`, `progress.results_seen`)
//!   are one compact string each, of at most 32 entries of 32-bit fingerprints
//!   (`run::progress::compact`), so the body no longer grows with the run. Read like 3; the
//!   array lists of earlier versions are read too.
//! - 5: smaller, as every commit writes it: the fingerprint lists are base64 of 4-byte
//!   fingerprints and varint counts (about 7 characters an entry, not 11), and counters at
//!   zero, flags that are off, no escalation and the empty `messages` are left out (they
//!   read as their defaults). Read like 4; format 4's dotted lists are read too.

use serde::{Deserialize, Serialize};

use crate::model::Message;
use crate::run::RunState;

/// The version this build writes.
pub const CURRENT: u32 = 5;
/// The oldest version this build reads.
pub const OLDEST: u32 = 1;
/// The body's field that names its version; a body without it is version 1.
pub const FIELD: &str = "format_version";

/// Why a stored body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The body declares a version outside `OLDEST..=CURRENT`.
    #[error(
        "checkpoint format version {found} is not supported by this build (it reads versions {OLDEST} to {CURRENT}); upgrade agentd to read it"
    )]
    UnsupportedVersion {
        /// The version the body declares.
        found: u64,
    },
    /// The body, or one of its transcript entries, is not valid JSON of its version.
    #[error("checkpoint body does not decode: {0}")]
    Malformed(#[from] serde_json::Error),
    /// Fewer transcript entries are stored than the body's `transcript_len` records.
    #[error(
        "the checkpoint records {expected} transcript entries but only {found} are stored (a torn write)"
    )]
    TornTranscript {
        /// The body's `transcript_len`.
        expected: u64,
        /// The entries actually stored.
        found: usize,
    },
}

#[derive(Serialize)]
struct Versioned<'a> {
    format_version: u32,
    #[serde(flatten)]
    run: &'a RunState,
    transcript_len: usize,
}

/// Only the version field and the transcript length; serde skips every other field.
#[derive(Deserialize)]
struct Header {
    format_version: Option<u64>,
    transcript_len: Option<u64>,
}

/// The body of `run` in the current format: every field but the transcript, whose length it
/// records (`run.messages` is taken out while it is written and put back).
pub fn encode(run: &mut RunState) -> Result<String, serde_json::Error> {
    let messages = std::mem::take(&mut run.messages);
    let body = serde_json::to_string(&Versioned {
        format_version: CURRENT,
        run,
        transcript_len: messages.len(),
    });
    run.messages = messages;
    body
}

/// The version a body declares (1 when it has no version field).
pub fn version_of(body: &str) -> Result<u64, FormatError> {
    let header: Header = serde_json::from_str(body)?;
    Ok(header.format_version.unwrap_or(1))
}

/// Reads a body of any supported version, with the run's stored transcript (entries of
/// message JSON; ignored by versions that hold it inline), into the current `RunState`.
pub fn decode(body: &str, transcript: &[String]) -> Result<RunState, FormatError> {
    let header: Header = serde_json::from_str(body)?;
    match header.format_version.unwrap_or(1) {
        // Version 2 only added the version field, which `RunState` does not carry (serde
        // ignores it), so both read the same way. A later version that changes fields
        // migrates here, from the oldest up.
        1 | 2 => Ok(serde_json::from_str(body)?),
        // 4 and 5 changed only how fields are written (the tracker's lists, defaults left
        // out), which reads every way.
        3..=5 => {
            let mut run: RunState = serde_json::from_str(body)?;
            let expected = header.transcript_len.unwrap_or(0);
            let len = usize::try_from(expected).unwrap_or(usize::MAX);
            let Some(entries) = transcript.get(..len) else {
                return Err(FormatError::TornTranscript {
                    expected,
                    found: transcript.len(),
                });
            };
            run.messages = entries
                .iter()
                .map(|m| serde_json::from_str::<Message>(m))
                .collect::<Result<_, _>>()?;
            Ok(run)
        }
        found => Err(FormatError::UnsupportedVersion { found }),
    }
}

/// How many of the run's stored transcript entries a body of this version owns: its
/// `transcript_len` from version 3 on, none before (those hold the transcript inline, and
/// their first rewrite stores it from entry 0).
pub fn stored_transcript_len(body: &str) -> Result<usize, FormatError> {
    let header: Header = serde_json::from_str(body)?;
    Ok(match header.format_version.unwrap_or(1) {
        1 | 2 => 0,
        _ => usize::try_from(header.transcript_len.unwrap_or(0)).unwrap_or(usize::MAX),
    })
}

/// Reads a body without its transcript (a listing, which shows no messages): earlier
/// versions still bring theirs, version 3 leaves `messages` empty.
pub fn decode_without_transcript(body: &str) -> Result<RunState, FormatError> {
    match version_of(body)? {
        1..=5 => Ok(serde_json::from_str(body)?),
        found => Err(FormatError::UnsupportedVersion { found }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::RunId;
    use serde_json::json;

    fn run() -> RunState {
        RunState::new(
            RunId::generate(),
            "t".into(),
            "a".into(),
            json!("g"),
            Default::default(),
            1,
        )
    }

    fn entries(run: &RunState) -> Vec<String> {
        run.messages
            .iter()
            .map(|m| serde_json::to_string(m).unwrap())
            .collect()
    }

    fn talking() -> RunState {
        let mut run = run();
        run.messages.push(Message::User {
            content: "hello".into(),
        });
        run.messages.push(Message::Assistant {
            content: Some("hi".into()),
            tool_calls: Vec::new(),
        });
        run
    }

    #[test]
    fn the_current_format_names_its_version_first_and_keeps_the_transcript_apart() {
        let mut run = talking();
        let body = encode(&mut run).unwrap();
        assert!(body.starts_with(r#"{"format_version":5,"#), "{body}");
        assert!(!body.contains("hello"), "no message in the body: {body}");
        assert!(!body.contains("messages"), "{body}");
        assert!(body.ends_with(r#","transcript_len":2}"#), "{body}");
        assert_eq!(run.messages.len(), 2, "the messages are put back");
        assert_eq!(version_of(&body).unwrap(), CURRENT as u64);
        assert_eq!(stored_transcript_len(&body).unwrap(), 2);
        assert_eq!(decode(&body, &entries(&run)).unwrap(), run);
        // Entries beyond the body's length belong to a later version.
        let mut longer = entries(&run);
        longer.push(r#"{"role":"user","content":"later"}"#.into());
        assert_eq!(decode(&body, &longer).unwrap(), run);
        assert!(
            decode_without_transcript(&body)
                .unwrap()
                .messages
                .is_empty()
        );
    }

    #[test]
    fn a_shorter_transcript_is_a_torn_write() {
        let mut run = talking();
        let body = encode(&mut run).unwrap();
        let err = decode(&body, &entries(&run)[..1]).unwrap_err();
        assert!(matches!(
            err,
            FormatError::TornTranscript {
                expected: 2,
                found: 1
            }
        ));
    }

    #[test]
    fn a_body_without_a_version_is_version_1_with_its_transcript_inline() {
        let run = talking();
        let body = serde_json::to_string(&run).unwrap();
        assert_eq!(version_of(&body).unwrap(), 1);
        assert_eq!(stored_transcript_len(&body).unwrap(), 0);
        assert_eq!(decode(&body, &[]).unwrap(), run);
        assert_eq!(decode_without_transcript(&body).unwrap(), run);
    }

    #[test]
    fn version_2_holds_its_transcript_inline() {
        let run = talking();
        let v1 = serde_json::to_string(&run).unwrap();
        let body = v1.replacen('{', r#"{"format_version":2,"#, 1);
        assert_eq!(version_of(&body).unwrap(), 2);
        assert_eq!(stored_transcript_len(&body).unwrap(), 0);
        assert_eq!(decode(&body, &[]).unwrap(), run);
    }

    #[test]
    fn a_future_version_is_refused_naming_both_versions() {
        let body = encode(&mut run()).unwrap().replacen(
            r#""format_version":5"#,
            r#""format_version":6"#,
            1,
        );
        let err = decode(&body, &[]).unwrap_err();
        assert!(matches!(err, FormatError::UnsupportedVersion { found: 6 }));
        let message = err.to_string();
        assert!(message.contains("version 6"), "{message}");
        assert!(message.contains("1 to 5"), "{message}");
        assert!(decode_without_transcript(&body).is_err());
    }

    #[test]
    fn a_malformed_body_is_an_error_not_a_default() {
        assert!(matches!(decode("{", &[]), Err(FormatError::Malformed(_))));
        assert!(matches!(
            decode(r#"{"format_version":"two"}"#, &[]),
            Err(FormatError::Malformed(_))
        ));
    }
}
