//! The stored checkpoint body's format: its version, how the current one is written, and how
//! every earlier one is read (migration on read). A body of a version newer than this build
//! knows is refused, never misread.
//!
//! Versions:
//! - 1: the JSON of `RunState` with no version field (every release before the field existed).
//! - 2: the same fields, with `"format_version": 2` first. `messages` stays the last field, so
//!   `runtime::actor::CheckpointWriter` can still splice the transcript in.
//! - 3: long-running tool calls: phase `awaiting_tool`, call status `awaiting_result` and the
//!   call's `task` (status URL, deadline). Every version 2 body reads unchanged; a build that
//!   knows only version 2 refuses a version 3 body instead of failing on the new names.

use serde::{Deserialize, Serialize};

use crate::run::RunState;

/// The version this build writes.
pub const CURRENT: u32 = 3;
/// The oldest version this build reads.
pub const OLDEST: u32 = 1;
/// The body's field that names its version; a body without it is version 1.
pub const FIELD: &str = "format_version";

/// Why a stored body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error(
        "checkpoint format version {found} is not supported by this build (it reads versions {OLDEST} to {CURRENT}); upgrade agentd to read it"
    )]
    UnsupportedVersion { found: u64 },
    #[error("checkpoint body does not decode: {0}")]
    Malformed(#[from] serde_json::Error),
}

#[derive(Serialize)]
struct Versioned<'a> {
    format_version: u32,
    #[serde(flatten)]
    run: &'a RunState,
}

/// Only the version field; serde skips every other field of the body.
#[derive(Deserialize)]
struct Header {
    format_version: Option<u64>,
}

/// The body of `run` in the current format.
pub fn encode(run: &RunState) -> Result<String, serde_json::Error> {
    serde_json::to_string(&Versioned {
        format_version: CURRENT,
        run,
    })
}

/// The version a body declares (1 when it has no version field).
pub fn version_of(body: &str) -> Result<u64, FormatError> {
    let header: Header = serde_json::from_str(body)?;
    Ok(header.format_version.unwrap_or(1))
}

/// Reads a body of any supported version into the current `RunState`.
pub fn decode(body: &str) -> Result<RunState, FormatError> {
    match version_of(body)? {
        // Version 2 only added the version field, which `RunState` does not carry (serde
        // ignores it), and version 3 only new optional fields and names, so all read the same
        // way. A later version that changes fields migrates here, from the oldest up.
        1..=3 => Ok(serde_json::from_str(body)?),
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

    #[test]
    fn the_current_format_names_its_version_first_and_reads_back() {
        let run = run();
        let body = encode(&run).unwrap();
        assert!(body.starts_with(r#"{"format_version":3,"#), "{body}");
        assert!(
            body.ends_with(r#""messages":[]}"#),
            "messages stay last: {body}"
        );
        assert_eq!(version_of(&body).unwrap(), 3);
        assert_eq!(decode(&body).unwrap(), run);
    }

    #[test]
    fn a_body_without_a_version_is_version_1() {
        let run = run();
        let body = serde_json::to_string(&run).unwrap();
        assert_eq!(version_of(&body).unwrap(), 1);
        assert_eq!(decode(&body).unwrap(), run);
    }

    #[test]
    fn a_future_version_is_refused_naming_both_versions() {
        let body =
            encode(&run())
                .unwrap()
                .replacen(r#""format_version":3"#, r#""format_version":4"#, 1);
        let err = decode(&body).unwrap_err();
        assert!(matches!(err, FormatError::UnsupportedVersion { found: 4 }));
        let message = err.to_string();
        assert!(message.contains("version 4"), "{message}");
        assert!(message.contains("1 to 3"), "{message}");
    }

    #[test]
    fn a_malformed_body_is_an_error_not_a_default() {
        assert!(matches!(decode("{"), Err(FormatError::Malformed(_))));
        assert!(matches!(
            decode(r#"{"format_version":"two"}"#),
            Err(FormatError::Malformed(_))
        ));
    }
}
