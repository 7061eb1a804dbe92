//! Serde for durations written as humantime strings ("30s", "5m", "250ms").

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

/// Writes `d` as a humantime string (`"1m 30s"`), for `#[serde(with = …)]`.
pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_duration(*d).to_string())
}

/// Reads a humantime string; text humantime rejects is an error that quotes it and shows the
/// syntax (`"30s"`).
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text).map_err(|e| {
        serde::de::Error::custom(format!(
            "invalid duration {text:?}: {e} (write e.g. \"30s\")"
        ))
    })
}

/// The same for `Option<Duration>`.
pub mod option {
    use super::*;

    /// `Some` as a humantime string, `None` as none.
    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => super::serialize(d, s),
            None => s.serialize_none(),
        }
    }

    /// A humantime string as `Some`; a none value (JSON `null`) as `None`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text = Option::<String>::deserialize(d)?;
        text.map(|t| {
            humantime::parse_duration(&t).map_err(|e| {
                serde::de::Error::custom(format!(
                    "invalid duration {t:?}: {e} (write e.g. \"30s\")"
                ))
            })
        })
        .transpose()
    }
}
