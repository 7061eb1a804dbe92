//! `agentd config check`: everything `serve` would refuse, reported at once, each problem with
//! its key and (for a file) its line: the validation of the tree, `env:` secrets whose variable
//! is unset, MCP commands not found, a `file:` store directory that does not exist.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::config::Config;

/// One problem: the key, its line in the file when known, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Problem {
    /// The dotted key at fault (`models.local.api_key`), or `config` for a problem that names
    /// no key.
    pub key: String,
    /// The 1-based line in the file of the key's section or `env:` reference; `None` without
    /// a file, or when it is not found there.
    pub line: Option<usize>,
    /// What is wrong, in one sentence.
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.line {
            Some(l) => write!(f, "line {l}: {}: {}", self.key, self.message),
            None => write!(f, "{}: {}", self.key, self.message),
        }
    }
}

/// The 1-based line of the first occurrence of `needle` in `text`.
fn line_of(text: Option<&str>, needle: &str) -> Option<usize> {
    let text = text?;
    let at = text.find(needle)?;
    Some(text[..at].matches('\n').count() + 1)
}

/// The line of a dotted key's section header (`models.local.api_key` → `[models.local]`).
fn line_of_key(text: Option<&str>, key: &str) -> Option<usize> {
    let parts: Vec<&str> = key.split('.').collect();
    (1..=parts.len().min(2))
        .rev()
        .find_map(|n| line_of(text, &format!("[{}]", parts[..n].join("."))))
}

/// Every string `env:NAME` in the tree, with its dotted path.
fn env_refs(v: &Value, path: &str, out: &mut Vec<(String, String)>) {
    match v {
        Value::String(s) => {
            if let Some(name) = s.strip_prefix("env:") {
                out.push((path.to_owned(), name.to_owned()));
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                env_refs(item, &format!("{path}[{i}]"), out);
            }
        }
        Value::Object(map) => {
            for (k, item) in map {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                env_refs(item, &p, out);
            }
        }
        _ => {}
    }
}

/// Where `command` would be found: a path as written, or the first match on `PATH`.
pub fn find_command(command: &str) -> Option<PathBuf> {
    let is_file = |p: &Path| p.is_file();
    if command.contains('/') {
        let p = PathBuf::from(command);
        return is_file(&p).then_some(p);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(command))
            .find(|p| is_file(p))
    })
}

/// Every problem of `config`; `text` is the file it came from, for line numbers.
/// `lookup` reads an environment variable.
pub fn problems(
    config: &Config,
    text: Option<&str>,
    lookup: impl Fn(&str) -> Option<String>,
) -> Vec<Problem> {
    let mut out = Vec::new();
    if let Err(e) = config.validate() {
        let (key, message) = match &e {
            crate::config::Error::Invalid { key, message } => (key.clone(), message.clone()),
            other => ("config".to_owned(), other.to_string()),
        };
        out.push(Problem {
            line: line_of_key(text, &key),
            key,
            message,
        });
    }
    let tree = serde_json::to_value(config).unwrap_or(Value::Null);
    let mut refs = Vec::new();
    env_refs(&tree, "", &mut refs);
    for (key, name) in refs {
        // The demo's dev token falls back to a generated one.
        if text.is_none() && name == "AGENTD_TOKEN" {
            continue;
        }
        if lookup(&name).is_none_or(|v| v.is_empty()) {
            out.push(Problem {
                line: line_of(text, &format!("env:{name}")),
                key,
                message: format!("environment variable {name} is not set"),
            });
        }
    }
    if let Some(tools) = tree["tools"].as_object() {
        for (name, t) in tools {
            if t["kind"] != "mcp" {
                continue;
            }
            if let Some(cmd) = t["command"].as_str()
                && find_command(cmd).is_none()
            {
                out.push(Problem {
                    key: format!("tools.{name}.command"),
                    line: line_of(text, &format!("[tools.{name}]")),
                    message: format!("MCP server command {cmd:?} is not found (PATH or a path)"),
                });
            }
        }
    }
    if let Some(dir) = config.store.url.strip_prefix("file:") {
        let dir = dir.strip_prefix("//").unwrap_or(dir);
        if !dir.is_empty() && !Path::new(dir).is_dir() && text.is_some() {
            out.push(Problem {
                key: "store.url".into(),
                line: line_of(text, "[store]"),
                message: format!(
                    "store directory {dir} does not exist (create it, or serve --create-store)"
                ),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_problem_is_reported_with_its_line() {
        let text = r#"
[[tenants]]
id = "acme"
tokens = ["env:CHECK_TEST_TOKEN"]

[models.local]
kind = "openai"
base_url = "http://127.0.0.1:8000/v1"
model = "m"
api_key = "env:CHECK_TEST_KEY"

[tools.everything]
kind = "mcp"
command = "no-such-mcp-server-anywhere"

[agents.a]
model = "local"
"#;
        let config = Config::from_toml(text).unwrap();
        let found = problems(&config, Some(text), |_| None);
        let shown: Vec<String> = found.iter().map(ToString::to_string).collect();
        assert!(
            shown.contains(
                &"line 4: tenants[0].tokens[0]: environment variable CHECK_TEST_TOKEN is not set"
                    .to_owned()
            ),
            "{shown:?}"
        );
        assert!(
            shown.contains(
                &"line 10: models.local.api_key: environment variable CHECK_TEST_KEY is not set"
                    .to_owned()
            ),
            "{shown:?}"
        );
        assert!(
            shown
                .iter()
                .any(|s| s.starts_with("line 12: tools.everything.command: MCP server command")),
            "{shown:?}"
        );
        let set = problems(&config, Some(text), |_| Some("x".into()));
        assert!(
            set.iter().all(|p| !p.message.contains("environment")),
            "{set:?}"
        );
    }
}
