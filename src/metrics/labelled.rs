//! Labelled metric families with bounded cardinality: label values come only from configured
//! names (models, tools, tenants) or fixed vocabularies (statuses, error codes), and each family
//! holds at most [`MAX_SERIES`] series.
//!
//! A value that is not a configured name (a model or tool the runtime was not told about, a
//! tenant of an embedding program) is recorded as [`OTHER`]; so is every new combination once a
//! family is full. Nothing a client or a model sends becomes a label value.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::Histogram;
use crate::run::Status;

/// Series one labelled family holds at most; further combinations are counted under
/// [`OTHER`] in every label (that series is always kept).
pub const MAX_SERIES: usize = 1000;

/// The label value of a name that is not configured, and of combinations past the cap.
pub const OTHER: &str = "_other";

/// The configured names label values may take.
#[derive(Debug, Clone, Default)]
pub struct LabelNames {
    /// `[models.*]` keys.
    pub models: Vec<String>,
    /// Tool names of the registry.
    pub tools: Vec<String>,
    /// `[[tenants]] id`s; `None`: no family carries a tenant label (the default, because
    /// `/metrics` needs no token).
    pub tenants: Option<Vec<String>>,
}

/// One family's series, keyed by their label values (interned configured names).
struct Family<T, const N: usize> {
    series: Mutex<BTreeMap<[Arc<str>; N], Arc<T>>>,
}

impl<T: Default, const N: usize> Default for Family<T, N> {
    fn default() -> Self {
        Family {
            series: Mutex::new(BTreeMap::new()),
        }
    }
}

impl<T: Default, const N: usize> Family<T, N> {
    /// The series of `key`, created if the family has room; otherwise the overflow series.
    fn get(&self, key: [Arc<str>; N], other: &Arc<str>) -> Arc<T> {
        let Ok(mut series) = self.series.lock() else {
            return Arc::new(T::default());
        };
        if let Some(s) = series.get(&key) {
            return s.clone();
        }
        let key = if series.len() + 1 >= MAX_SERIES {
            std::array::from_fn(|_| other.clone())
        } else {
            key
        };
        series.entry(key).or_default().clone()
    }

    fn snapshot(&self) -> Vec<([Arc<str>; N], Arc<T>)> {
        self.series
            .lock()
            .map(|s| s.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }

    fn len(&self) -> usize {
        self.series.lock().map(|s| s.len()).unwrap_or(0)
    }
}

/// A set of configured names, interned.
#[derive(Default)]
struct Vocabulary(HashMap<String, Arc<str>>);

impl Vocabulary {
    fn new<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        Vocabulary(
            names
                .into_iter()
                .map(|n| (n.to_owned(), Arc::from(n)))
                .collect(),
        )
    }

    fn resolve(&self, name: &str, other: &Arc<str>) -> Arc<str> {
        self.0.get(name).cloned().unwrap_or_else(|| other.clone())
    }
}

/// The labelled families.
pub struct Labelled {
    other: Arc<str>,
    models: Vocabulary,
    tools: Vocabulary,
    /// `None`: tenant labels are off.
    tenants: Option<Vocabulary>,
    /// Fixed vocabulary: statuses, token kinds, tool outcomes.
    fixed: Vocabulary,
    tokens: Family<AtomicU64, 3>,
    model_latency: Family<Histogram, 1>,
    tool_latency: Family<Histogram, 2>,
    tool_calls: Family<AtomicU64, 2>,
    tenant_runs: Family<AtomicU64, 2>,
}

impl std::fmt::Debug for Labelled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Labelled")
            .field("tenant_labels", &self.tenants.is_some())
            .finish_non_exhaustive()
    }
}

impl Default for Labelled {
    fn default() -> Self {
        Labelled::new(&LabelNames::default())
    }
}

/// The tool outcomes a label may take: `ok`, or a tool error code.
const OUTCOMES: [&str; 13] = [
    "ok",
    "invalid_argument",
    "retryable",
    "failed",
    "permission",
    "outcome_unknown",
    "timeout",
    "tool_not_allowed",
    "approval_denied",
    "overloaded",
    "permission_denied",
    "argument_denied",
    "skipped",
];

impl Labelled {
    /// Families whose label values are limited to `names`.
    pub fn new(names: &LabelNames) -> Self {
        let mut fixed: HashSet<&str> = OUTCOMES.into_iter().collect();
        fixed.extend(["prompt", "completion", "error"]);
        fixed.extend(Status::ALL.iter().map(|s| s.as_str()));
        Labelled {
            other: Arc::from(OTHER),
            models: Vocabulary::new(names.models.iter().map(String::as_str)),
            tools: Vocabulary::new(names.tools.iter().map(String::as_str)),
            tenants: names
                .tenants
                .as_ref()
                .map(|t| Vocabulary::new(t.iter().map(String::as_str))),
            fixed: Vocabulary::new(fixed),
            tokens: Family::default(),
            model_latency: Family::default(),
            tool_latency: Family::default(),
            tool_calls: Family::default(),
            tenant_runs: Family::default(),
        }
    }

    fn tenant(&self, tenant: &str) -> Arc<str> {
        match &self.tenants {
            Some(v) => v.resolve(tenant, &self.other),
            None => Arc::from(""),
        }
    }

    /// Tokens of one model reply.
    pub fn tokens(&self, model: &str, tenant: &str, prompt: u64, completion: u64) {
        let model = self.models.resolve(model, &self.other);
        let tenant = self.tenant(tenant);
        for (kind, n) in [("prompt", prompt), ("completion", completion)] {
            if n == 0 {
                continue;
            }
            let kind = self.fixed.resolve(kind, &self.other);
            self.tokens
                .get([model.clone(), kind, tenant.clone()], &self.other)
                .fetch_add(n, Ordering::Relaxed);
        }
    }

    /// One model call's latency (queueing and the gateway's retries included).
    pub fn model_call(&self, model: &str, took: Duration) {
        let model = self.models.resolve(model, &self.other);
        self.model_latency.get([model], &self.other).observe(took);
    }

    /// One tool call (or status check) and its outcome: `ok` or the tool error code.
    pub fn tool_call(&self, tool: &str, outcome: &str, took: Duration) {
        let tool = self.tools.resolve(tool, &self.other);
        let outcome = self.fixed.resolve(outcome, &self.other);
        let key = [tool, outcome];
        self.tool_latency
            .get(key.clone(), &self.other)
            .observe(took);
        self.tool_calls
            .get(key, &self.other)
            .fetch_add(1, Ordering::Relaxed);
    }

    /// A run of `tenant` entered `status` (only with tenant labels on).
    pub fn run_entered(&self, tenant: &str, status: Status) {
        if self.tenants.is_none() {
            return;
        }
        let tenant = self.tenant(tenant);
        let status = self.fixed.resolve(status.as_str(), &self.other);
        self.tenant_runs
            .get([tenant, status], &self.other)
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Series held now by the largest family (for tests and the cap's documentation).
    pub fn max_family_len(&self) -> usize {
        [
            self.tokens.len(),
            self.model_latency.len(),
            self.tool_latency.len(),
            self.tool_calls.len(),
            self.tenant_runs.len(),
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
    }

    /// Appends the Prometheus text of every labelled family (HELP and TYPE even when empty).
    pub fn render(&self, out: &mut String) {
        let tenant_label = self.tenants.is_some();
        let _ = writeln!(
            out,
            "# HELP agentd_model_tokens_total Tokens reported by model replies, by model and kind (prompt or completion).\n# TYPE agentd_model_tokens_total counter"
        );
        for ([model, kind, tenant], v) in self.tokens.snapshot() {
            let tenant = if tenant_label {
                format!(",tenant=\"{tenant}\"")
            } else {
                String::new()
            };
            let _ = writeln!(
                out,
                "agentd_model_tokens_total{{model=\"{model}\",kind=\"{kind}\"{tenant}}} {}",
                v.load(Ordering::Relaxed)
            );
        }
        render_histograms(
            out,
            "agentd_model_call_latency_seconds",
            "Model calls by model, queueing and retries included.",
            self.model_latency
                .snapshot()
                .into_iter()
                .map(|([m], h)| (format!("model=\"{m}\""), h)),
        );
        render_histograms(
            out,
            "agentd_tool_call_latency_seconds",
            "Tool calls by tool and outcome (ok or the error code), queueing included.",
            self.tool_latency
                .snapshot()
                .into_iter()
                .map(|([t, o], h)| (format!("tool=\"{t}\",outcome=\"{o}\""), h)),
        );
        let _ = writeln!(
            out,
            "# HELP agentd_tool_calls_total Tool calls and status checks by tool and outcome (ok or the error code).\n# TYPE agentd_tool_calls_total counter"
        );
        for ([tool, outcome], v) in self.tool_calls.snapshot() {
            let _ = writeln!(
                out,
                "agentd_tool_calls_total{{tool=\"{tool}\",outcome=\"{outcome}\"}} {}",
                v.load(Ordering::Relaxed)
            );
        }
        if tenant_label {
            let _ = writeln!(
                out,
                "# HELP agentd_tenant_runs_entered_total Runs that entered each status, by tenant.\n# TYPE agentd_tenant_runs_entered_total counter"
            );
            for ([tenant, status], v) in self.tenant_runs.snapshot() {
                let _ = writeln!(
                    out,
                    "agentd_tenant_runs_entered_total{{tenant=\"{tenant}\",status=\"{status}\"}} {}",
                    v.load(Ordering::Relaxed)
                );
            }
        }
    }
}

fn render_histograms(
    out: &mut String,
    name: &str,
    help: &str,
    series: impl Iterator<Item = (String, Arc<Histogram>)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (labels, h) in series {
        h.render_samples(out, name, &labels);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn names() -> LabelNames {
        LabelNames {
            models: vec!["local".into()],
            tools: vec!["echo".into()],
            tenants: Some(vec!["acme".into()]),
        }
    }

    #[test]
    fn unknown_names_are_other_and_never_become_labels() {
        let l = Labelled::new(&names());
        l.tokens("local", "acme", 10, 3);
        l.tokens("gpt-from-a-client", "evil\"tenant", 1, 0);
        l.tool_call("echo", "ok", Duration::from_millis(1));
        l.tool_call("made_up", "weird\ncode", Duration::from_millis(1));
        let mut out = String::new();
        l.render(&mut out);
        assert!(
            out.contains(
                r#"agentd_model_tokens_total{model="local",kind="prompt",tenant="acme"} 10"#
            ),
            "{out}"
        );
        assert!(out.contains(
            r#"agentd_model_tokens_total{model="local",kind="completion",tenant="acme"} 3"#
        ));
        assert!(out.contains(
            r#"agentd_model_tokens_total{model="_other",kind="prompt",tenant="_other"} 1"#
        ));
        assert!(out.contains(r#"agentd_tool_calls_total{tool="_other",outcome="_other"} 1"#));
        assert!(out.contains(r#"agentd_tool_calls_total{tool="echo",outcome="ok"} 1"#));
        assert!(!out.contains("gpt-from") && !out.contains("evil") && !out.contains("weird"));
    }

    #[test]
    fn a_family_never_holds_more_than_the_cap() {
        let many: Vec<String> = (0..MAX_SERIES * 2).map(|i| format!("t{i}")).collect();
        let l = Labelled::new(&LabelNames {
            models: vec!["m".into()],
            tools: many.clone(),
            tenants: Some(many.clone()),
        });
        for t in &many {
            l.tool_call(t, "ok", Duration::from_millis(1));
            l.run_entered(t, Status::Running);
        }
        assert_eq!(l.max_family_len(), MAX_SERIES);
        let mut out = String::new();
        l.render(&mut out);
        let calls = out
            .lines()
            .filter(|l| l.starts_with("agentd_tool_calls_total{"))
            .count();
        assert_eq!(calls, MAX_SERIES);
        // Every call is counted: the ones past the cap under _other.
        let other = format!("agentd_tool_calls_total{{tool=\"{OTHER}\",outcome=\"{OTHER}\"}} ");
        let folded: u64 = out
            .lines()
            .find_map(|l| l.strip_prefix(&other))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(folded as usize, many.len() - (MAX_SERIES - 1));
    }

    #[test]
    fn without_tenant_labels_no_tenant_appears() {
        let l = Labelled::new(&LabelNames {
            tenants: None,
            ..names()
        });
        l.tokens("local", "acme", 5, 5);
        l.run_entered("acme", Status::Running);
        let mut out = String::new();
        l.render(&mut out);
        assert!(!out.contains("acme") && !out.contains("tenant"), "{out}");
        assert!(out.contains(r#"agentd_model_tokens_total{model="local",kind="prompt"} 5"#));
    }
}
