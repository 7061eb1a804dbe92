//! Who may call a tool with which arguments, as pure functions: scopes and the permissions a
//! tool needs, deny rules on argument values, path rules for path-like arguments, and the
//! projection of a tool result onto the parts the model may see.
//!
//! The machine evaluates a tool's [`Guard`] for every call before approval and execution
//! (`machine::validate_call`) and again on arguments an operator edits; a refused call never
//! reaches the tool. No I/O: paths are checked lexically (symlinks inside the root are the
//! tool's business), regular expressions are compiled once when the guard is built.
//!
//! - **Scopes.** A run holds the scopes of the token that created it; `None` means every scope
//!   (a plain token). A scope grants a permission equal to it, or one it prefixes up to a `:`
//!   (`approve` grants `approve:restart`, `deploy` grants `deploy:prod`).
//! - **Deny rules** (`deny = [{ pointer, equals, one_of, prefix, regex, max_length }]`): a rule
//!   refuses a call when the value at `pointer` is present and meets every condition given
//!   (none given: presence alone). `max_length` is met by a string longer than that many
//!   characters, or an array with more items. Strings are compared as given and in Unicode NFKC
//!   form, so full-width look-alikes (`ｐｒｏｄ`) meet the same rules.
//! - **Path rules** (`paths = [{ pointer, root }]`): the string at `pointer` is percent-decoded
//!   once (a `%` left after that, or made by NFKC from `％`, is refused: no double encoding),
//!   NFKC-normalised, refused if it
//!   holds control, invisible or slash/dot look-alike characters, a backslash, a `..` segment
//!   (or one only of dots and spaces), or a leading `~`; then it is resolved against `root` and
//!   refused unless it lies inside it. The tool receives the normalised absolute path: what was
//!   checked is what runs.
//! - **Pointers** are JSON Pointers (RFC 6901, `""` is the whole document) where a `*` segment
//!   stands for every member of an object or item of an array.
//! - **Projection** (`project = ["/id", "/items/*/title"]`): a successful result is cut down to
//!   the values at these pointers, in their places; the rest never enters the model's context.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use unicode_normalization::UnicodeNormalization;

use crate::tool::{ToolError, ToolErrorCode};

/// Longest path argument looked at (bytes, before and after normalisation).
pub const MAX_PATH_BYTES: usize = 4096;
/// Longest `regex` of a deny rule, and the compiled size bound.
const MAX_REGEX_BYTES: usize = 1024;
const REGEX_SIZE_LIMIT: usize = 1 << 20;

/// Whether `scopes` grant `permission`. `None` is every scope.
pub fn grants(scopes: Option<&[String]>, permission: &str) -> bool {
    let Some(scopes) = scopes else {
        return true;
    };
    scopes.iter().any(|s| {
        permission == s
            || permission
                .strip_prefix(s.as_str())
                .is_some_and(|rest| rest.starts_with(':'))
    })
}

/// Whether a scope name is well formed: 1 to 128 of `[a-zA-Z0-9_.:-]`, not starting or ending
/// with `:`.
pub fn valid_scope(scope: &str) -> bool {
    !scope.is_empty()
        && scope.len() <= 128
        && !scope.starts_with(':')
        && !scope.ends_with(':')
        && scope
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
}

/// What a call whose run lacks a needed scope does to the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnPermissionDenied {
    /// The call is answered `permission_denied` and the model carries on.
    #[default]
    Refuse,
    /// A safety stop: the run fails `permission_denied` and nothing of the batch runs.
    Stop,
}

/// `deny = [{ pointer = "/service", one_of = ["prod-db"] }]` as configured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DenyRule {
    /// Where the checked value is in the arguments (a pointer, `*` allowed).
    pub pointer: String,
    /// Met by a value equal to this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub equals: Option<Value>,
    /// Met by a value equal to one of these.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub one_of: Option<Vec<Value>>,
    /// Met by a string starting with this text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// Met by a string this expression matches anywhere (unanchored; at most 1024 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
    /// Met by a string of more characters, or an array of more items, than this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_length: Option<usize>,
}

/// `paths = [{ pointer = "/file", root = "/srv/data" }]` as configured.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathRule {
    /// Where the path argument is (a pointer, `*` allowed); the value there must be a string.
    pub pointer: String,
    /// An absolute, already normal directory (`/srv/data`).
    pub root: String,
}

/// What a guard is built from (the `[tools.X]` keys of the same names).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GuardConfig {
    /// Scopes a run must hold to call the tool (each a `valid_scope`).
    pub permissions: Vec<String>,
    /// What a call lacking a scope does to the run.
    pub on_permission_denied: OnPermissionDenied,
    /// Rules refusing argument values.
    pub deny: Vec<DenyRule>,
    /// Rules confining path arguments to a root.
    pub paths: Vec<PathRule>,
    /// Pointers of the result parts the model sees; empty: the whole result.
    pub project: Vec<String>,
}

/// A guard that could not be built: the sub-key (`deny[0].regex`) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct GuardError {
    /// The offending sub-key, e.g. `deny[0].regex` or `permissions[1]`.
    pub key: String,
    /// What is wrong with it.
    pub message: String,
}

fn guard_error(key: impl Into<String>, message: impl Into<String>) -> GuardError {
    GuardError {
        key: key.into(),
        message: message.into(),
    }
}

/// One segment of a parsed pointer.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Key(String),
    Any,
}

/// A parsed JSON Pointer with `*` wildcards.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pointer {
    text: String,
    segments: Vec<Segment>,
}

impl Pointer {
    fn parse(text: &str) -> Result<Pointer, String> {
        if text.is_empty() {
            return Ok(Pointer {
                text: String::new(),
                segments: Vec::new(),
            });
        }
        let Some(rest) = text.strip_prefix('/') else {
            return Err(format!(
                "{text:?} is not a JSON Pointer (write e.g. \"/service\")"
            ));
        };
        let mut segments = Vec::new();
        for raw in rest.split('/') {
            if raw == "*" {
                segments.push(Segment::Any);
                continue;
            }
            let mut out = String::with_capacity(raw.len());
            let mut chars = raw.chars();
            while let Some(ch) = chars.next() {
                if ch != '~' {
                    out.push(ch);
                    continue;
                }
                match chars.next() {
                    Some('0') => out.push('~'),
                    Some('1') => out.push('/'),
                    _ => return Err(format!("{text:?}: `~` must be followed by 0 or 1")),
                }
            }
            segments.push(Segment::Key(out));
        }
        Ok(Pointer {
            text: text.to_owned(),
            segments,
        })
    }
}

fn child<'v>(value: &'v Value, key: &str) -> Option<&'v Value> {
    match value {
        Value::Object(m) => m.get(key),
        Value::Array(a) => key.parse::<usize>().ok().and_then(|i| a.get(i)),
        _ => None,
    }
}

fn child_mut<'v>(value: &'v mut Value, key: &str) -> Option<&'v mut Value> {
    match value {
        Value::Object(m) => m.get_mut(key),
        Value::Array(a) => key.parse::<usize>().ok().and_then(|i| a.get_mut(i)),
        _ => None,
    }
}

/// Every value at `segments` below `value`.
fn collect<'v>(value: &'v Value, segments: &[Segment], out: &mut Vec<&'v Value>) {
    let Some((first, rest)) = segments.split_first() else {
        out.push(value);
        return;
    };
    match first {
        Segment::Key(k) => {
            if let Some(v) = child(value, k) {
                collect(v, rest, out);
            }
        }
        Segment::Any => match value {
            Value::Object(m) => m.values().for_each(|v| collect(v, rest, out)),
            Value::Array(a) => a.iter().for_each(|v| collect(v, rest, out)),
            _ => {}
        },
    }
}

/// Calls `f` on every value at `segments` below `value`; stops at the first error.
fn visit_mut<E>(
    value: &mut Value,
    segments: &[Segment],
    f: &mut impl FnMut(&mut Value) -> Result<(), E>,
) -> Result<(), E> {
    let Some((first, rest)) = segments.split_first() else {
        return f(value);
    };
    match first {
        Segment::Key(k) => match child_mut(value, k) {
            Some(v) => visit_mut(v, rest, f),
            None => Ok(()),
        },
        Segment::Any => match value {
            Value::Object(m) => m.values_mut().try_for_each(|v| visit_mut(v, rest, f)),
            Value::Array(a) => a.iter_mut().try_for_each(|v| visit_mut(v, rest, f)),
            _ => Ok(()),
        },
    }
}

/// A deny rule, compiled.
#[derive(Debug, Clone)]
struct CompiledDeny {
    pointer: Pointer,
    rule: DenyRule,
    regex: Option<regex::Regex>,
}

impl CompiledDeny {
    /// Whether the value meets every condition of the rule.
    fn matches(&self, v: &Value) -> bool {
        let r = &self.rule;
        let nfkc: Option<Value> = v
            .as_str()
            .map(|s| s.nfkc().collect::<String>())
            .filter(|n| Some(n.as_str()) != v.as_str())
            .map(Value::String);
        let forms: Vec<&Value> = std::iter::once(v).chain(nfkc.as_ref()).collect();
        let any_form = |test: &dyn Fn(&Value) -> bool| forms.iter().any(|f| test(f));
        if let Some(e) = &r.equals
            && !any_form(&|f| f == e)
        {
            return false;
        }
        if let Some(list) = &r.one_of
            && !any_form(&|f| list.contains(f))
        {
            return false;
        }
        if let Some(p) = &r.prefix
            && !any_form(&|f| f.as_str().is_some_and(|s| s.starts_with(p.as_str())))
        {
            return false;
        }
        if let Some(re) = &self.regex
            && !any_form(&|f| f.as_str().is_some_and(|s| re.is_match(s)))
        {
            return false;
        }
        if let Some(max) = r.max_length {
            let longer = match v {
                Value::String(s) => s.chars().count() > max,
                Value::Array(a) => a.len() > max,
                _ => false,
            };
            if !longer {
                return false;
            }
        }
        true
    }

    /// The conditions of the rule, named for the refusal message.
    fn describe(&self) -> String {
        let r = &self.rule;
        let names: Vec<&str> = [
            ("equals", r.equals.is_some()),
            ("one_of", r.one_of.is_some()),
            ("prefix", r.prefix.is_some()),
            ("regex", r.regex.is_some()),
            ("max_length", r.max_length.is_some()),
        ]
        .into_iter()
        .filter_map(|(n, set)| set.then_some(n))
        .collect();
        if names.is_empty() {
            "present".to_owned()
        } else {
            names.join(", ")
        }
    }
}

/// A path rule with its root split into segments.
#[derive(Debug, Clone)]
struct CompiledPath {
    pointer: Pointer,
    root: String,
}

/// Why a path argument was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// Longer than `MAX_PATH_BYTES`, as given, normalised or resolved.
    #[error("is longer than {MAX_PATH_BYTES} bytes")]
    TooLong,
    /// A `%` is left after one percent-decoding (or made by NFKC).
    #[error("is percent-encoded more than once")]
    DoubleEncoded,
    /// The percent-decoded bytes are not UTF-8.
    #[error("is not valid UTF-8 once percent-decoded")]
    NotUtf8,
    /// Holds a control, invisible, or slash or dot look-alike character: its code point.
    #[error("contains a control, invisible or look-alike character (U+{0:04X})")]
    Suspicious(u32),
    /// Holds a backslash.
    #[error("contains a backslash")]
    Backslash,
    /// Holds a segment of only dots and spaces with at least two dots (`..`, `...`, `. .`).
    #[error("contains a `..` segment")]
    ParentSegment,
    /// A relative path starting with `~`.
    #[error("starts with `~`")]
    HomeRelative,
    /// An absolute path not under the root: the root.
    #[error("lies outside {0}")]
    OutsideRoot(String),
}

/// Characters refused in a path after NFKC: they are invisible, reorder text, or look like a
/// slash or a dot without being one.
fn suspicious(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{00AD}' | '\u{034F}' | '\u{061C}' | '\u{115F}' | '\u{1160}' | '\u{17B4}' | '\u{17B5}'
            | '\u{180B}'..='\u{180F}'
            | '\u{200B}'..='\u{200F}'
            | '\u{2028}'..='\u{202E}'
            | '\u{2060}'..='\u{206F}'
            | '\u{FE00}'..='\u{FE0F}'
            | '\u{FEFF}'
            | '\u{FFF9}'..='\u{FFFB}'
            // slash and backslash look-alikes NFKC keeps
            | '\u{0338}' | '\u{0337}' | '\u{20E5}' | '\u{2044}' | '\u{2215}' | '\u{2216}'
            | '\u{2571}' | '\u{2572}' | '\u{29F5}' | '\u{29F8}' | '\u{29F9}' | '\u{FE68}'
            | '\u{1735}' | '\u{2CC6}' | '\u{3033}' | '\u{30FB}' | '\u{31D3}' | '\u{4E3F}'
            // dot look-alikes NFKC keeps
            | '\u{0701}' | '\u{0702}' | '\u{2E31}' | '\u{2E33}' | '\u{3002}' | '\u{A4F8}'
            | '\u{A60E}' | '\u{10A50}' | '\u{1D16D}' | '\u{00B7}' | '\u{0387}' | '\u{2022}'
            | '\u{2027}' | '\u{2219}' | '\u{22C5}' | '\u{FF65}'
            | '\u{E0000}'..='\u{E007F}')
}

/// Whether `root` is an absolute, normal directory path (no `.`, `..`, `//`, trailing `/` or
/// suspicious characters).
fn valid_root(root: &str) -> bool {
    if root == "/" {
        return true;
    }
    root.starts_with('/')
        && !root.ends_with('/')
        && root.len() <= MAX_PATH_BYTES
        && root[1..]
            .split('/')
            .all(|s| !s.is_empty() && s != "." && s != "..")
        && !root.chars().any(|c| c == '\\' || c == '%' || suspicious(c))
        && root.nfkc().eq(root.chars())
}

/// Checks the path argument `raw` against `root` (see the module doc) and returns the
/// normalised absolute path inside `root`.
pub fn check_path(root: &str, raw: &str) -> Result<String, PathError> {
    if raw.len() > MAX_PATH_BYTES {
        return Err(PathError::TooLong);
    }
    let decoded = percent_encoding::percent_decode_str(raw)
        .decode_utf8()
        .map_err(|_| PathError::NotUtf8)?;
    if decoded.contains('%') {
        return Err(PathError::DoubleEncoded);
    }
    let normal: String = decoded.nfkc().collect();
    if normal.len() > MAX_PATH_BYTES {
        return Err(PathError::TooLong);
    }
    // A `%` that NFKC made (from `％` or `﹪`) would be decoded by the next reader.
    if normal.contains('%') {
        return Err(PathError::DoubleEncoded);
    }
    if let Some(c) = normal.chars().find(|&c| suspicious(c)) {
        return Err(PathError::Suspicious(u32::from(c)));
    }
    if normal.contains('\\') {
        return Err(PathError::Backslash);
    }
    let absolute = normal.starts_with('/');
    let mut segments: Vec<&str> = Vec::new();
    for (i, seg) in normal.split('/').enumerate() {
        if seg.is_empty() || seg == "." {
            continue;
        }
        // `..`, and what some systems read as `..` (`...`, `.. `, `. .`).
        if seg.chars().all(|c| c == '.' || c == ' ') && seg.matches('.').count() >= 2 {
            return Err(PathError::ParentSegment);
        }
        if i == 0 && seg.starts_with('~') {
            return Err(PathError::HomeRelative);
        }
        segments.push(seg);
    }
    let root_segments: Vec<&str> = root.split('/').filter(|s| !s.is_empty()).collect();
    let full: Vec<&str> = if absolute {
        if segments.len() < root_segments.len()
            || segments[..root_segments.len()] != root_segments[..]
        {
            return Err(PathError::OutsideRoot(root.to_owned()));
        }
        segments
    } else {
        root_segments.iter().copied().chain(segments).collect()
    };
    let out = format!("/{}", full.join("/"));
    if out.len() > MAX_PATH_BYTES {
        return Err(PathError::TooLong);
    }
    Ok(out)
}

/// A tool's guard: what the run must hold, which argument values are refused, which path
/// arguments are confined, and what of a result the model sees. The default guards nothing.
#[derive(Debug, Clone, Default)]
pub struct Guard {
    /// Scopes a run must hold to call the tool.
    pub permissions: Vec<String>,
    /// What a call lacking one of `permissions` does to the run.
    pub on_permission_denied: OnPermissionDenied,
    deny: Vec<CompiledDeny>,
    paths: Vec<CompiledPath>,
    project: Vec<Pointer>,
}

impl Guard {
    /// Builds a guard, checking every pointer, regex, root and scope.
    pub fn new(config: &GuardConfig) -> Result<Guard, GuardError> {
        for (i, p) in config.permissions.iter().enumerate() {
            if !valid_scope(p) {
                return Err(guard_error(
                    format!("permissions[{i}]"),
                    format!(
                        "{p:?} must be 1 to 128 of [a-zA-Z0-9_.:-], not starting or ending with `:`"
                    ),
                ));
            }
        }
        let mut deny = Vec::new();
        for (i, rule) in config.deny.iter().enumerate() {
            let pointer = Pointer::parse(&rule.pointer)
                .map_err(|m| guard_error(format!("deny[{i}].pointer"), m))?;
            let regex = match &rule.regex {
                None => None,
                Some(r) if r.len() > MAX_REGEX_BYTES => {
                    return Err(guard_error(
                        format!("deny[{i}].regex"),
                        format!("is longer than {MAX_REGEX_BYTES} bytes"),
                    ));
                }
                Some(r) => Some(
                    regex::RegexBuilder::new(r)
                        .size_limit(REGEX_SIZE_LIMIT)
                        .build()
                        .map_err(|e| guard_error(format!("deny[{i}].regex"), e.to_string()))?,
                ),
            };
            deny.push(CompiledDeny {
                pointer,
                rule: rule.clone(),
                regex,
            });
        }
        let mut paths = Vec::new();
        for (i, rule) in config.paths.iter().enumerate() {
            let pointer = Pointer::parse(&rule.pointer)
                .map_err(|m| guard_error(format!("paths[{i}].pointer"), m))?;
            if !valid_root(&rule.root) {
                return Err(guard_error(
                    format!("paths[{i}].root"),
                    format!(
                        "{:?} must be an absolute, normal directory path (e.g. \"/srv/data\")",
                        rule.root
                    ),
                ));
            }
            paths.push(CompiledPath {
                pointer,
                root: rule.root.clone(),
            });
        }
        let project = config
            .project
            .iter()
            .enumerate()
            .map(|(i, p)| Pointer::parse(p).map_err(|m| guard_error(format!("project[{i}]"), m)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Guard {
            permissions: config.permissions.clone(),
            on_permission_denied: config.on_permission_denied,
            deny,
            paths,
            project,
        })
    }

    /// The first permission `scopes` do not grant.
    pub fn missing_permission(&self, scopes: Option<&[String]>) -> Option<&str> {
        self.permissions
            .iter()
            .find(|p| !grants(scopes, p))
            .map(String::as_str)
    }

    /// Checks a call: scopes first, then deny rules, then path rules (which rewrite each path
    /// argument to its normalised form). A refusal is `permission_denied` or
    /// `argument_denied`; on refusal `arguments` may be partly rewritten and must be dropped.
    pub fn check(
        &self,
        tool: &str,
        scopes: Option<&[String]>,
        arguments: &mut Value,
    ) -> Result<(), ToolError> {
        if let Some(p) = self.missing_permission(scopes) {
            return Err(ToolError::new(
                ToolErrorCode::PermissionDenied,
                format!("tool `{tool}` needs the scope `{p}`, which this run does not hold"),
            ));
        }
        self.check_arguments(arguments)
    }

    /// Deny rules and path rules only (scopes are checked by `check`).
    pub fn check_arguments(&self, arguments: &mut Value) -> Result<(), ToolError> {
        for rule in &self.deny {
            let mut found = Vec::new();
            collect(arguments, &rule.pointer.segments, &mut found);
            if found.iter().any(|v| rule.matches(v)) {
                return Err(ToolError::new(
                    ToolErrorCode::ArgumentDenied,
                    format!(
                        "the value at `{}` is refused by policy ({})",
                        pointer_text(&rule.pointer),
                        rule.describe()
                    ),
                ));
            }
        }
        for rule in &self.paths {
            let at = pointer_text(&rule.pointer);
            visit_mut(arguments, &rule.pointer.segments, &mut |v| {
                let Value::String(raw) = v else {
                    return Err(ToolError::new(
                        ToolErrorCode::ArgumentDenied,
                        format!("the path at `{at}` must be a string"),
                    ));
                };
                match check_path(&rule.root, raw) {
                    Ok(normal) => {
                        *raw = normal;
                        Ok(())
                    }
                    Err(e) => Err(ToolError::new(
                        ToolErrorCode::ArgumentDenied,
                        format!("the path at `{at}` is refused: it {e}"),
                    )),
                }
            })?;
        }
        Ok(())
    }

    /// Whether results are projected.
    pub fn projects(&self) -> bool {
        !self.project.is_empty()
    }

    /// The parts of `data` at the projection pointers, in their places (all of it without a
    /// projection). Values at no pointer are left out; an empty projection is `{}`.
    pub fn project<'v>(&self, data: &'v Value) -> Cow<'v, Value> {
        if self.project.is_empty() {
            return Cow::Borrowed(data);
        }
        let mut out: Option<Value> = None;
        for p in &self.project {
            if let Some(part) = select(data, &p.segments) {
                out = Some(match out {
                    None => part,
                    Some(acc) => merge(acc, part),
                });
            }
        }
        Cow::Owned(out.unwrap_or_else(|| Value::Object(Map::new())))
    }
}

fn pointer_text(p: &Pointer) -> &str {
    if p.text.is_empty() { "/" } else { &p.text }
}

/// The value at `segments` kept in its place within a skeleton of its parents.
fn select(value: &Value, segments: &[Segment]) -> Option<Value> {
    let Some((first, rest)) = segments.split_first() else {
        return Some(value.clone());
    };
    match (first, value) {
        (Segment::Key(k), Value::Object(m)) => {
            let v = select(m.get(k)?, rest)?;
            let mut out = Map::new();
            out.insert(k.clone(), v);
            Some(Value::Object(out))
        }
        (Segment::Key(k), Value::Array(a)) => {
            // One item of an array keeps its index: earlier items become `null`.
            let i = k.parse::<usize>().ok()?;
            let v = select(a.get(i)?, rest)?;
            let mut out = vec![Value::Null; i];
            out.push(v);
            Some(Value::Array(out))
        }
        (Segment::Any, Value::Object(m)) => {
            let out: Map<String, Value> = m
                .iter()
                .filter_map(|(k, v)| select(v, rest).map(|s| (k.clone(), s)))
                .collect();
            Some(Value::Object(out))
        }
        (Segment::Any, Value::Array(a)) => Some(Value::Array(
            a.iter()
                .map(|v| select(v, rest).unwrap_or(Value::Null))
                .collect(),
        )),
        _ => None,
    }
}

/// Deep merge of two projections of the same document.
fn merge(a: Value, b: Value) -> Value {
    match (a, b) {
        (Value::Object(mut x), Value::Object(y)) => {
            for (k, v) in y {
                let merged = match x.remove(&k) {
                    Some(old) => merge(old, v),
                    None => v,
                };
                x.insert(k, merged);
            }
            Value::Object(x)
        }
        (Value::Array(x), Value::Array(y)) => {
            let n = x.len().max(y.len());
            let mut xs = x.into_iter();
            let mut ys = y.into_iter();
            Value::Array(
                (0..n)
                    .map(|_| match (xs.next(), ys.next()) {
                        (Some(Value::Null) | None, Some(v)) => v,
                        (Some(u), Some(Value::Null) | None) => u,
                        (Some(u), Some(v)) => merge(u, v),
                        (None, None) => Value::Null,
                    })
                    .collect(),
            )
        }
        // The same place selected twice holds the same value.
        (_, b) => b,
    }
}

#[cfg(test)]
mod tests;
