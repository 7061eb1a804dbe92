//! Secret redaction: one `Redactor`, built from configured secret values and key/value patterns,
//! that scrubs strings and JSON values before they reach logs, events or API output.
//!
//! Three rules, applied together:
//! - **secret values**: every configured secret (API keys, bearer tokens, resolved `env:`
//!   values) is replaced by `[redacted]` wherever it appears inside a string — in values, in
//!   object keys, in error messages. Secrets shorter than [`MIN_SECRET_LEN`] are ignored,
//!   since redacting `"a"` everywhere would destroy text without protecting anything.
//! - **sensitive keys**: in a JSON object, the value under a key matching a key pattern
//!   (default [`DEFAULT_KEY_PATTERN`], e.g. `api_key`, `Authorization`, `refresh_token`) is
//!   replaced by `"[redacted]"` when it is a string, array or object. Numbers, booleans and
//!   null are kept: `"max_tokens": 100` or `"input_tokens": 1200` carry no secret, and the key
//!   pattern matches them.
//! - **value patterns**: text that looks like a credential (default: `Bearer <token>`,
//!   `sk-…` keys) is replaced inside any string.
//! - **sensitive keys in JSON text**: inside any string, a `"key": "value"` pair whose key is
//!   sensitive has its value replaced, also when the text was cut inside the value. So JSON
//!   that arrives as text (a body that was not valid JSON, a log line) keeps the key rule.
//!
//! Order: redact the whole text first, cut it to size after ([`Redactor::redact_then_cut`]).
//! A cut made first turns an object into a plain string and can split a secret so that no
//! rule sees it whole.

use std::borrow::Cow;

use regex::{Regex, RegexSet};
use serde_json::{Map, Value};

/// What a redacted secret is replaced with.
pub const REDACTED: &str = "[redacted]";

/// Shorter configured secrets are not redacted (they would match ordinary text).
pub const MIN_SECRET_LEN: usize = 6;

/// JSON object keys whose (non-scalar) values are always redacted.
pub const DEFAULT_KEY_PATTERN: &str = r"(?i)(api[_-]?key|token|secret|password|passwd|authorization|cookie|credential|private[_-]?key)";

/// Credential-looking text redacted inside any string.
pub const DEFAULT_VALUE_PATTERNS: &[&str] = &[
    r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}",
    r"\bsk-[A-Za-z0-9_-]{16,}",
];

/// A pattern given to the redactor did not compile.
#[derive(Debug, thiserror::Error)]
#[error("invalid redaction pattern {pattern:?}: {reason}")]
pub struct PatternError {
    /// The pattern as given.
    pub pattern: String,
    /// The regex compiler's error.
    pub reason: String,
}

/// Scrubs secrets from strings and JSON values. Cheap to clone behind an `Arc`; immutable once
/// built.
#[derive(Clone)]
pub struct Redactor {
    /// Longest first, so that a secret containing another is replaced whole.
    secrets: Vec<String>,
    key_patterns: Vec<String>,
    keys: RegexSet,
    values: Vec<Regex>,
}

/// A `"key": "value"` pair in JSON text (the value may run to the end of a cut text).
fn json_pair_pattern() -> Option<&'static Regex> {
    static PAIR: std::sync::OnceLock<Option<Regex>> = std::sync::OnceLock::new();
    PAIR.get_or_init(|| {
        Regex::new(r#""((?:[^"\\\n]|\\.){1,256})"(\s*:\s*)"(?:[^"\\]|\\.)*(?:"|\\?$)"#).ok()
    })
    .as_ref()
}

/// `text` cut to at most `max_chars` characters (on a character boundary), with `…` when cut.
pub fn cut_chars(text: &str, max_chars: usize) -> Cow<'_, str> {
    match text.char_indices().nth(max_chars) {
        Some((cut, _)) => Cow::Owned(format!("{}…", &text[..cut])),
        None => Cow::Borrowed(text),
    }
}

impl std::fmt::Debug for Redactor {
    // Never print the secrets themselves.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redactor")
            .field("secrets", &self.secrets.len())
            .field("key_patterns", &self.key_patterns)
            .field("value_patterns", &self.values.len())
            .finish()
    }
}

impl Default for Redactor {
    fn default() -> Self {
        Self::new()
    }
}

impl Redactor {
    /// A redactor with the default key and value patterns and no configured secrets.
    pub fn new() -> Self {
        let keys = RegexSet::new([DEFAULT_KEY_PATTERN]).unwrap_or_else(|_| RegexSet::empty());
        let values = DEFAULT_VALUE_PATTERNS
            .iter()
            .filter_map(|p| Regex::new(p).ok())
            .collect();
        Redactor {
            secrets: Vec::new(),
            key_patterns: vec![DEFAULT_KEY_PATTERN.to_owned()],
            keys,
            values,
        }
    }

    /// A redactor that changes nothing (no secrets, no patterns): the runtime's default when
    /// the embedding program configures none.
    pub fn none() -> Self {
        Redactor {
            secrets: Vec::new(),
            key_patterns: Vec::new(),
            keys: RegexSet::empty(),
            values: Vec::new(),
        }
    }

    /// Whether this redactor can change anything.
    pub fn is_noop(&self) -> bool {
        self.secrets.is_empty() && self.keys.is_empty() && self.values.is_empty()
    }

    /// A redactor that only knows these secret values (plus the default patterns).
    pub fn with_secrets<I, S>(secrets: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut r = Self::new();
        for s in secrets {
            r.add_secret(s);
        }
        r
    }

    /// Adds one secret value. Ignored when shorter than [`MIN_SECRET_LEN`].
    pub fn add_secret(&mut self, secret: impl Into<String>) {
        let secret = secret.into();
        if secret.chars().count() < MIN_SECRET_LEN || self.secrets.contains(&secret) {
            return;
        }
        self.secrets.push(secret);
        self.secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    }

    /// Adds a regular expression matched against JSON object keys.
    pub fn add_key_pattern(&mut self, pattern: &str) -> Result<(), PatternError> {
        let mut patterns = self.key_patterns.clone();
        patterns.push(pattern.to_owned());
        self.keys = RegexSet::new(&patterns).map_err(|e| PatternError {
            pattern: pattern.to_owned(),
            reason: e.to_string(),
        })?;
        self.key_patterns = patterns;
        Ok(())
    }

    /// Adds a regular expression whose matches are redacted inside any string.
    pub fn add_value_pattern(&mut self, pattern: &str) -> Result<(), PatternError> {
        let re = Regex::new(pattern).map_err(|e| PatternError {
            pattern: pattern.to_owned(),
            reason: e.to_string(),
        })?;
        self.values.push(re);
        Ok(())
    }

    /// Whether values under this JSON object key are redacted.
    pub fn is_sensitive_key(&self, key: &str) -> bool {
        self.keys.is_match(key)
    }

    /// The text with every secret and credential-looking span replaced by `[redacted]`.
    pub fn redact_str<'a>(&self, text: &'a str) -> Cow<'a, str> {
        if self.is_noop() {
            return Cow::Borrowed(text);
        }
        let mut out = Cow::Borrowed(text);
        for secret in &self.secrets {
            if out.contains(secret.as_str()) {
                out = Cow::Owned(out.replace(secret.as_str(), REDACTED));
            }
        }
        for re in &self.values {
            if re.is_match(&out) {
                out = Cow::Owned(re.replace_all(&out, REDACTED).into_owned());
            }
        }
        if let Some(pairs) = self.sensitive_pairs_in(&out) {
            out = Cow::Owned(pairs);
        }
        out
    }

    /// `text` with the value of every sensitive `"key": "value"` pair replaced, or `None` when
    /// it has none.
    fn sensitive_pairs_in(&self, text: &str) -> Option<String> {
        if self.keys.is_empty() || !text.contains('"') || !text.contains(':') {
            return None;
        }
        let pair = json_pair_pattern()?;
        let mut changed = false;
        let replaced = pair.replace_all(text, |c: &regex::Captures<'_>| {
            let key = &c[1];
            if self.is_sensitive_key(key) {
                changed = true;
                format!("\"{key}\"{}\"{REDACTED}\"", &c[2])
            } else {
                c[0].to_owned()
            }
        });
        changed.then(|| replaced.into_owned())
    }

    /// The whole text redacted, then cut to at most `max_chars` characters (with `…` when cut).
    /// Never the other way round: a cut can split a secret so that no rule sees it whole.
    pub fn redact_then_cut(&self, text: &str, max_chars: usize) -> String {
        cut_chars(&self.redact_str(text), max_chars).into_owned()
    }

    /// A redacted copy of a JSON value.
    pub fn redact_value(&self, value: &Value) -> Value {
        let mut v = value.clone();
        self.redact_value_in_place(&mut v);
        v
    }

    /// Redacts a JSON value in place: strings, object keys, and values under sensitive keys.
    pub fn redact_value_in_place(&self, value: &mut Value) {
        if self.is_noop() {
            return;
        }
        match value {
            Value::String(s) => {
                if let Cow::Owned(r) = self.redact_str(s) {
                    *s = r;
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|v| self.redact_value_in_place(v)),
            Value::Object(map) => {
                let old = std::mem::take(map);
                let mut new = Map::with_capacity(old.len());
                for (key, mut v) in old {
                    let sensitive = self.is_sensitive_key(&key);
                    if sensitive
                        && matches!(v, Value::String(_) | Value::Array(_) | Value::Object(_))
                    {
                        v = Value::String(REDACTED.to_owned());
                    } else {
                        self.redact_value_in_place(&mut v);
                    }
                    let key = self.redact_str(&key).into_owned();
                    new.insert(key, v);
                }
                *map = new;
            }
            Value::Null | Value::Bool(_) | Value::Number(_) => {}
        }
    }
}

// ---- log redaction ----

static LOG_REDACTOR: std::sync::RwLock<Option<std::sync::Arc<Redactor>>> =
    std::sync::RwLock::new(None);

/// Sets the redactor applied to every log line written through [`RedactingWriter`]. The daemon
/// installs its configured redactor at start; until then the default patterns apply.
pub fn install_log_redactor(redactor: std::sync::Arc<Redactor>) {
    if let Ok(mut slot) = LOG_REDACTOR.write() {
        *slot = Some(redactor);
    }
}

/// Redacts one formatted log line with the installed redactor (default patterns before one is
/// installed).
pub fn redact_log_line(line: &str) -> String {
    static DEFAULT: std::sync::OnceLock<Redactor> = std::sync::OnceLock::new();
    let installed = LOG_REDACTOR.read().ok().and_then(|g| g.clone());
    match installed {
        Some(r) => r.redact_str(line).into_owned(),
        None => DEFAULT
            .get_or_init(Redactor::new)
            .redact_str(line)
            .into_owned(),
    }
}

/// Replaces the panic hook with one that writes the panic's report (message and location)
/// redacted with the installed log redactor, then hands a backtrace to stderr as the default
/// hook would (when `RUST_BACKTRACE` asks for one). A panic message can quote any value the
/// code held (a request, a tool's output), so it is treated as a log line.
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let report = redacted_panic_report(info);
        let backtrace = std::backtrace::Backtrace::capture();
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("<unnamed>");
        let text = match backtrace.status() {
            std::backtrace::BacktraceStatus::Captured => {
                redact_log_line(&format!("\nstack backtrace:\n{backtrace}"))
            }
            _ => String::new(),
        };
        eprintln!("thread '{name}' {report}{text}");
    }));
}

/// `panicked at <location>:\n<message>`, redacted with the installed log redactor.
pub fn redacted_panic_report(info: &std::panic::PanicHookInfo<'_>) -> String {
    let payload = info.payload();
    let message = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "Box<dyn Any>".to_owned());
    let location = info
        .location()
        .map_or_else(|| "an unknown location".to_owned(), ToString::to_string);
    redact_log_line(&format!("panicked at {location}:\n{message}"))
}

/// A `tracing_subscriber` writer that buffers one formatted event and writes it redacted to
/// the inner writer when dropped: no log line leaves the process with a configured secret in
/// it, whatever a log call passed as a field.
pub struct RedactingWriter<W: std::io::Write> {
    inner: W,
    buffer: Vec<u8>,
}

impl<W: std::io::Write> RedactingWriter<W> {
    /// A writer in front of `inner`, with nothing buffered; lines are redacted with the
    /// installed log redactor (the default patterns before one is installed).
    pub fn new(inner: W) -> Self {
        RedactingWriter {
            inner,
            buffer: Vec::new(),
        }
    }
}

impl<W: std::io::Write> std::io::Write for RedactingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.buffer.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let text = String::from_utf8_lossy(&self.buffer);
        let line = redact_log_line(&text);
        self.buffer.clear();
        self.inner.write_all(line.as_bytes())?;
        self.inner.flush()
    }
}

impl<W: std::io::Write> Drop for RedactingWriter<W> {
    fn drop(&mut self) {
        let _ = std::io::Write::flush(self);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    const KEY: &str = "hunter2-planted-value-9f3a";

    #[test]
    fn the_log_writer_redacts_whole_lines_and_the_none_redactor_changes_nothing() {
        use std::io::Write as _;
        let mut out = Vec::new();
        {
            let mut w = RedactingWriter::new(&mut out);
            w.write_all(b"{\"msg\":\"auth Bearer abcdefgh12345678\"}\n")
                .unwrap();
        }
        let line = String::from_utf8(out).unwrap();
        assert!(!line.contains("abcdefgh12345678"), "{line}");
        assert!(line.contains(REDACTED));
        let none = Redactor::none();
        assert!(none.is_noop());
        let v = json!({"api_key": "sk-0123456789abcdef0123", "t": KEY});
        assert_eq!(none.redact_value(&v), v);
    }

    #[test]
    fn planted_secret_in_nested_json_is_redacted() {
        let r = Redactor::with_secrets([KEY]);
        let v = json!({
            "outer": {"list": [1, format!("prefix {KEY} suffix"), {"deep": KEY}]},
            "n": 3
        });
        let out = r.redact_value(&v);
        let text = out.to_string();
        assert!(!text.contains(KEY), "{text}");
        assert_eq!(out["outer"]["list"][1], json!("prefix [redacted] suffix"));
        assert_eq!(out["outer"]["list"][2]["deep"], json!("[redacted]"));
        assert_eq!(out["n"], json!(3));
    }

    #[test]
    fn secret_in_error_message_string_is_redacted() {
        let r = Redactor::with_secrets([KEY]);
        let msg = format!("401 Unauthorized: Incorrect API key provided: {KEY}.");
        assert_eq!(
            r.redact_str(&msg),
            "401 Unauthorized: Incorrect API key provided: [redacted]."
        );
        // Untouched text is borrowed, not copied.
        assert!(matches!(r.redact_str("all fine"), Cow::Borrowed(_)));
    }

    #[test]
    fn secret_used_as_a_key_and_sensitive_key_names_are_redacted() {
        let r = Redactor::with_secrets([KEY]);
        let v = json!({
            KEY: "value",
            "headers": {"Authorization": "Basic abcdef", "X-Api-Key": "whatever"},
            "config": {"db_password": {"nested": "x"}, "refresh_token": ["a"]},
            "usage": {"input_tokens": 1200, "max_tokens": 100}
        });
        let out = r.redact_value(&v);
        let text = out.to_string();
        assert!(!text.contains(KEY), "{text}");
        assert_eq!(out["[redacted]"], json!("value"));
        assert_eq!(out["headers"]["Authorization"], json!(REDACTED));
        assert_eq!(out["headers"]["X-Api-Key"], json!(REDACTED));
        assert_eq!(out["config"]["db_password"], json!(REDACTED));
        assert_eq!(out["config"]["refresh_token"], json!(REDACTED));
        // Numeric token counts are not secrets.
        assert_eq!(out["usage"]["input_tokens"], json!(1200));
        assert_eq!(out["usage"]["max_tokens"], json!(100));
    }

    #[test]
    fn credential_looking_text_is_redacted_without_configuration() {
        let r = Redactor::new();
        let s =
            "curl -H 'Authorization: Bearer abc.def-123456' with sk-proj_ABCDEFGHIJKLMNOPQRSTUV";
        let out = r.redact_str(s);
        assert!(!out.contains("abc.def-123456"), "{out}");
        assert!(!out.contains("sk-proj_"), "{out}");
    }

    #[test]
    fn overlapping_secrets_are_replaced_longest_first_and_short_ones_ignored() {
        let r = Redactor::with_secrets(["abcdefgh", "abcdefgh-ijkl", "abc"]);
        assert_eq!(r.redact_str("x abcdefgh-ijkl y abc"), "x [redacted] y abc");
        assert!(!format!("{r:?}").contains("abcdefgh"));
    }

    #[test]
    fn sensitive_keys_are_recognised_in_json_text_even_when_it_was_cut() {
        let r = Redactor::with_secrets([KEY]);
        let text = r#"{"id":7,"db_password":"pw-1f9e8d7c","note":"fine","api_key":"half-a-val"#;
        let out = r.redact_str(text);
        assert_eq!(
            out,
            r#"{"id":7,"db_password":"[redacted]","note":"fine","api_key":"[redacted]""#
        );
        // Escaped quotes inside a value do not end it early.
        let out = r.redact_str(r#"{"password" : "a\"b\"c", "x":"y"}"#);
        assert_eq!(out, r#"{"password" : "[redacted]", "x":"y"}"#);
        // Text without a sensitive pair is not copied.
        assert!(matches!(r.redact_str(r#"{"a":"b"}"#), Cow::Borrowed(_)));
    }

    #[test]
    fn redact_then_cut_never_leaves_part_of_a_secret() {
        let r = Redactor::with_secrets([KEY]);
        let text = format!("{}{KEY} and more", "x".repeat(20));
        // A cut at 25 characters falls inside the secret.
        let out = r.redact_then_cut(&text, 25);
        assert!(!out.contains(&KEY[..5]), "{out}");
        assert_eq!(out, format!("{}[reda…", "x".repeat(20)));
        assert_eq!(cut_chars("ééé", 2), "éé…");
        assert_eq!(cut_chars("ééé", 3), "ééé");
    }

    #[test]
    fn a_panic_report_is_redacted() {
        let planted = "panic-planted-secret-31a2";
        install_log_redactor(std::sync::Arc::new(Redactor::with_secrets([planted])));
        let report = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let seen = report.clone();
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            *seen.lock().unwrap() = redacted_panic_report(info);
        }));
        let caught = std::panic::catch_unwind(|| {
            panic!("request failed with {{\"password\": \"pw-77\"}} and key {planted}")
        });
        std::panic::set_hook(previous);
        assert!(caught.is_err());
        let report = report.lock().unwrap().clone();
        assert!(report.starts_with("panicked at src/redact.rs:"), "{report}");
        assert!(
            !report.contains(planted) && !report.contains("pw-77"),
            "{report}"
        );
        assert!(report.contains("key [redacted]"), "{report}");
    }

    #[test]
    fn custom_patterns_apply_and_bad_patterns_are_reported() {
        let mut r = Redactor::new();
        r.add_key_pattern("(?i)^pin$").unwrap();
        r.add_value_pattern(r"ACCT-\d{6}").unwrap();
        let out = r.redact_value(&json!({"pin": "1234", "note": "account ACCT-123456"}));
        assert_eq!(out, json!({"pin": REDACTED, "note": "account [redacted]"}));
        assert!(r.add_key_pattern("(").is_err());
    }
}
