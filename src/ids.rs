//! Typed, prefixed identifiers (`run_…`) and the rules that keep them safe to use as store keys.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Longest id accepted from outside (paths, bodies); longer input is rejected, never truncated.
pub const MAX_ID_LEN: usize = 128;

/// Why a string is not a valid id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// Empty, or longer than [`MAX_ID_LEN`] bytes.
    #[error("id is empty or longer than {MAX_ID_LEN} bytes")]
    Length,
    /// Does not start with the id type's prefix (carried), or is the bare prefix.
    #[error("id must start with `{0}`")]
    Prefix(&'static str),
    /// Holds a byte other than an ASCII letter, digit, `_` or `-`.
    #[error("id may contain only ASCII letters, digits, `_` and `-`")]
    Charset,
}

/// Checks the charset shared by every id: no `/`, `.`, `:`, `{`, `}` or spaces, so an id can
/// never escape its place in a store key or a URL path.
pub fn check_id_charset(s: &str) -> Result<(), IdError> {
    if s.is_empty() || s.len() > MAX_ID_LEN {
        return Err(IdError::Length);
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(IdError::Charset);
    }
    Ok(())
}

/// The id of one run: `run_` followed by a time-ordered UUIDv7 in simple (hex) form.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RunId(String);

impl RunId {
    /// What every run id starts with.
    pub const PREFIX: &'static str = "run_";

    /// A new, time-ordered run id.
    pub fn generate() -> Self {
        RunId(format!("{}{}", Self::PREFIX, uuid::Uuid::now_v7().simple()))
    }

    /// The id as text, prefix included.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for RunId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        check_id_charset(s)?;
        if !s.starts_with(Self::PREFIX) || s.len() == Self::PREFIX.len() {
            return Err(IdError::Prefix(Self::PREFIX));
        }
        Ok(RunId(s.to_owned()))
    }
}

impl TryFrom<String> for RunId {
    type Error = IdError;
    fn try_from(s: String) -> Result<Self, IdError> {
        s.parse()
    }
}

impl From<RunId> for String {
    fn from(id: RunId) -> String {
        id.0
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The server-assigned id of one tool call: `call_<turn>_<index>`, stable across restarts
/// because it is derived from the run's own turn counter, never from the model.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct CallId(String);

impl CallId {
    /// What every call id starts with.
    pub const PREFIX: &'static str = "call_";

    /// The id of call number `index` (from 0, in the model's order) of model turn `turn`.
    pub fn new(turn: u32, index: usize) -> Self {
        CallId(format!("{}{turn}_{index}", Self::PREFIX))
    }

    /// The id as text, prefix included.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id of the call that compensates this one: `call_3_1` → `call_3_1_undo`.
    pub fn compensation(&self) -> CallId {
        CallId(format!("{}_undo", self.0))
    }
}

impl FromStr for CallId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        check_id_charset(s)?;
        if !s.starts_with(Self::PREFIX) {
            return Err(IdError::Prefix(Self::PREFIX));
        }
        Ok(CallId(s.to_owned()))
    }
}

impl TryFrom<String> for CallId {
    type Error = IdError;
    fn try_from(s: String) -> Result<Self, IdError> {
        s.parse()
    }
}

impl From<CallId> for String {
    fn from(id: CallId) -> String {
        id.0
    }
}

impl fmt::Display for CallId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for CallId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_round_trip_and_reject_injection() {
        let id = RunId::generate();
        assert_eq!(id.as_str().parse::<RunId>().unwrap(), id);
        for bad in [
            "", "run_", "job_1", "run_../x", "run_a/b", "run_{x}", "run_a:b", "run_a b", "run_a.b",
        ] {
            assert!(bad.parse::<RunId>().is_err(), "{bad:?} must be rejected");
        }
        let long = format!("run_{}", "a".repeat(MAX_ID_LEN));
        assert_eq!(long.parse::<RunId>(), Err(IdError::Length));
    }

    #[test]
    fn call_ids_are_derived_from_turn_and_index() {
        assert_eq!(CallId::new(3, 1).as_str(), "call_3_1");
        assert!("call_3_1".parse::<CallId>().is_ok());
        assert!("call_3/1".parse::<CallId>().is_err());
    }
}
