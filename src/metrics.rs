//! Runtime counters and latency histograms, lock-free, rendered in the Prometheus text format.

#![warn(missing_docs)]

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use crate::run::Status;
use crate::telemetry::Tracer;

mod labelled;
pub use labelled::{LabelNames, Labelled, MAX_SERIES, OTHER};

/// Upper bounds of the latency buckets, in microseconds.
const BUCKETS_US: [u64; 16] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 5_000_000, 30_000_000,
];

/// A latency histogram with fixed buckets; also keeps exact quantiles' raw material in buckets.
#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS_US.len() + 1],
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    /// Records one duration.
    pub fn observe(&self, d: Duration) {
        let us = d.as_micros().min(u128::from(u64::MAX)) as u64;
        let i = BUCKETS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(BUCKETS_US.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Durations recorded.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        self.render_samples(out, name, "");
    }

    /// The samples of this histogram, each with `labels` (`k="v",…` or empty) before `le`.
    pub(crate) fn render_samples(&self, out: &mut String, name: &str, labels: &str) {
        let (open, sep) = if labels.is_empty() {
            ("", "")
        } else {
            (labels, ",")
        };
        let mut cumulative = 0;
        for (i, b) in BUCKETS_US.iter().enumerate() {
            cumulative += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{name}_bucket{{{open}{sep}le=\"{}\"}} {cumulative}",
                *b as f64 / 1e6
            );
        }
        cumulative += self.counts[BUCKETS_US.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{open}{sep}le=\"+Inf\"}} {cumulative}");
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(
            out,
            "{name}_sum{braces} {}\n{name}_count{braces} {}",
            self.sum_us.load(Ordering::Relaxed) as f64 / 1e6,
            self.count.load(Ordering::Relaxed)
        );
    }
}

/// The runtime's metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Runs that reached each status, indexed like `Status::ALL`.
    pub runs_entered: [AtomicU64; 7],
    /// State transitions committed.
    pub transitions: AtomicU64,
    /// Checkpoint commits that landed; one may carry several transitions (those that waited
    /// in the commit window, `runtime.commit_window`).
    pub commits: AtomicU64,
    /// Run actors restarted after a crash.
    pub restarts: AtomicU64,
    /// Runs failed with `crash_loop`.
    pub crash_loops: AtomicU64,
    /// Commits retried because the store was unavailable.
    pub store_retries: AtomicU64,
    /// Times the store's epoch marker was seen to change (data lost).
    pub store_resets: AtomicU64,
    /// Run actors alive now (kept by the run supervisor).
    pub live_runs: AtomicU64,
    /// One model turn and its tool batch.
    pub step_latency: Histogram,
    /// Model requests that failed after the gateway's retries.
    pub model_errors: AtomicU64,
    /// Tool calls that returned an error.
    pub tool_errors: AtomicU64,
    /// Polls of long-running calls' status URLs (each one short pool job).
    pub tool_polls: AtomicU64,
    /// Runs paused now because the store does not answer (they continue when it does).
    pub paused_runs: AtomicI64,
    /// Runs this node took over from another node (dead owner, released, or queued).
    pub takeovers: AtomicU64,
    /// Runs this node left to others because its definition of their agent differs.
    pub agent_mismatches: AtomicU64,
    /// Lease renewal rounds that failed (store unavailable).
    pub lease_renewal_failures: AtomicU64,
    /// Runs whose lease this node found taken by another node.
    pub leases_lost: AtomicU64,
    /// Runs left out because their stored record cannot be read.
    pub runs_quarantined: AtomicU64,
    /// Families labelled by model, tool, outcome and (when enabled) tenant.
    pub labelled: Labelled,
    /// Spans of runs, turns, model calls and tool calls (`[telemetry]`; off by default).
    pub traces: Arc<Tracer>,
}

fn status_index(s: Status) -> usize {
    Status::ALL.iter().position(|x| *x == s).unwrap_or(0)
}

impl Metrics {
    /// The metrics of a runtime whose label values are limited to `names`, with `traces`.
    pub fn new(names: &LabelNames, traces: Arc<Tracer>) -> Self {
        Metrics {
            labelled: Labelled::new(names),
            traces,
            ..Metrics::default()
        }
    }

    /// A run entered `s`.
    pub fn entered(&self, s: Status) {
        self.runs_entered[status_index(s)].fetch_add(1, Ordering::Relaxed);
    }

    /// A run of `tenant` entered `s` (also counted by tenant when tenant labels are on).
    pub fn entered_by(&self, tenant: &str, s: Status) {
        self.entered(s);
        self.labelled.run_entered(tenant, s);
    }

    /// Appends the Prometheus text for these metrics.
    pub fn render(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP agentd_runs_entered_total Runs that entered each status.\n# TYPE agentd_runs_entered_total counter"
        );
        for s in Status::ALL {
            let _ = writeln!(
                out,
                "agentd_runs_entered_total{{status=\"{}\"}} {}",
                s.as_str(),
                self.runs_entered[status_index(s)].load(Ordering::Relaxed)
            );
        }
        for (name, help, v) in [
            (
                "agentd_transitions_total",
                "State transitions committed.",
                &self.transitions,
            ),
            (
                "agentd_store_commits_total",
                "Checkpoint commits that landed (one may carry several transitions).",
                &self.commits,
            ),
            (
                "agentd_run_restarts_total",
                "Run actors restarted after a crash.",
                &self.restarts,
            ),
            (
                "agentd_crash_loops_total",
                "Runs failed with crash_loop.",
                &self.crash_loops,
            ),
            (
                "agentd_store_retries_total",
                "Commits retried because the store was unavailable.",
                &self.store_retries,
            ),
            (
                "agentd_model_errors_total",
                "Model requests that failed after the gateway's retries.",
                &self.model_errors,
            ),
            (
                "agentd_tool_errors_total",
                "Tool calls that returned an error.",
                &self.tool_errors,
            ),
            (
                "agentd_tool_polls_total",
                "Polls of the status URLs of long-running tool calls.",
                &self.tool_polls,
            ),
            (
                "agentd_runs_quarantined_total",
                "Runs left out because their stored record cannot be read (see /readyz).",
                &self.runs_quarantined,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP agentd_live_runs Run actors alive now.\n# TYPE agentd_live_runs gauge\nagentd_live_runs {}",
            self.live_runs.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP agentd_paused_runs Runs paused because the store does not answer.\n# TYPE agentd_paused_runs gauge\nagentd_paused_runs {}",
            self.paused_runs.load(Ordering::Relaxed).max(0)
        );
        for (name, help, v) in [
            (
                "agentd_run_takeovers_total",
                "Runs this node took over from another node or from the queue of new runs.",
                &self.takeovers,
            ),
            (
                "agentd_agent_mismatch_total",
                "Runs left to other nodes because this node's agent definition differs.",
                &self.agent_mismatches,
            ),
            (
                "agentd_lease_renewal_failures_total",
                "Lease renewal rounds that failed because the store did not answer.",
                &self.lease_renewal_failures,
            ),
            (
                "agentd_leases_lost_total",
                "Runs whose lease this node found taken by another node.",
                &self.leases_lost,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
        self.step_latency.render(
            out,
            "agentd_step_latency_seconds",
            "One model turn plus its tool calls.",
        );
        self.labelled.render(out);
        self.traces.render_metrics(out);
    }
}
