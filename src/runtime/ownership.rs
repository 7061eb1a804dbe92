//! This node's share of the runs: its identity in the store, the leases it holds (renewed in one
//! batch per interval), the runs it takes over (a dead owner's, released ones, new runs another
//! node had no room for), and the wake-ups other nodes send it when they store a control for one
//! of its runs.
//!
//! The store is the only meeting point between nodes: leases are compare-and-set per run and
//! fenced by tokens, the due index says which runs need an owner, and wake-ups travel through
//! the store too. There is no membership protocol: a node that stops renewing simply loses its
//! runs when their leases lapse.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use dashmap::DashMap;
use ractor::ActorRef;
use tokio_util::sync::CancellationToken;

use super::actor::RunDeps;
use super::supervisor::SupervisorMsg;
use crate::clock::now_ms;
use crate::ids::RunId;
use crate::store::Lease;

/// The leases this node holds, with when each was last known to be valid.
#[derive(Debug, Default)]
pub struct LeaseBook {
    leases: DashMap<RunId, (Lease, u64)>,
}

impl LeaseBook {
    /// Records a lease just claimed (valid from `now_ms`).
    pub fn insert(&self, lease: Lease, now_ms: u64) {
        self.leases.insert(lease.run_id.clone(), (lease, now_ms));
    }

    /// Forgets the run's lease (the run was released, passivated or lost); no longer renewed.
    pub fn remove(&self, run: &RunId) {
        self.leases.remove(run);
    }

    /// Whether this node holds a lease on the run (as of its last renewal; not checked against the
    /// store).
    pub fn holds(&self, run: &RunId) -> bool {
        self.leases.contains_key(run)
    }

    /// How many leases this node holds.
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    /// Whether this node holds no lease.
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// A copy of every lease held, for a renewal round or a release at shutdown.
    pub fn snapshot(&self) -> Vec<Lease> {
        self.leases.iter().map(|e| e.value().0.clone()).collect()
    }

    /// Whether the run's lease was confirmed recently enough that it cannot lapse before the
    /// next renewal: within half the TTL. A run whose lease is not fresh sends no tool calls.
    pub fn fresh(&self, run: &RunId, ttl: Duration, now_ms: u64) -> bool {
        self.leases
            .get(run)
            .is_some_and(|e| now_ms.saturating_sub(e.value().1) < ttl.as_millis() as u64 / 2)
    }

    fn renewed(&self, leases: &[Lease], at_ms: u64) {
        for l in leases {
            if let Some(mut e) = self.leases.get_mut(&l.run_id)
                && e.value().0.token == l.token
            {
                e.value_mut().1 = at_ms;
            }
        }
    }
}

/// How often the node renews its leases and its identity: a quarter of the TTL, so one failed
/// round still leaves time before anything lapses.
pub fn renew_interval(ttl: Duration) -> Duration {
    (ttl / 4).max(Duration::from_millis(50))
}

/// How often the node looks for runs that need an owner.
pub fn scan_interval(ttl: Duration) -> Duration {
    (ttl / 10).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// A process-unique node identity: host, process id and a random suffix.
pub fn generated_node_id() -> String {
    let host = host_name();
    format!(
        "{host}-{}-{:04x}",
        std::process::id(),
        rand::random::<u16>()
    )
}

/// This process's instance string for the node registry, `host:pid:nonce`: node ids may be
/// reused by a later process, instances never are.
pub fn instance_id() -> String {
    format!(
        "{}:{}:{:016x}",
        host_name(),
        std::process::id(),
        rand::random::<u64>()
    )
}

/// Whether a registered instance is a process of this host that no longer exists (it was
/// killed without unregistering), so its node id may be taken at once instead of after its
/// registration lapses. Holders on other hosts, or in this process, count as alive.
pub fn holder_is_dead(holder: &str) -> bool {
    let mut parts = holder.split(':');
    let (Some(host), Some(pid)) = (parts.next(), parts.next()) else {
        return false;
    };
    let Ok(pid) = pid.parse::<u32>() else {
        return false;
    };
    host == host_name()
        && pid != std::process::id()
        && !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

fn host_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let host: String = host
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .take(40)
        .collect();
    if host.is_empty() {
        "agentd".into()
    } else {
        host
    }
}

/// The background loops of one node; they stop with `stop`.
pub struct Ownership {
    /// Cancelled at shutdown to end the loops.
    pub stop: CancellationToken,
    /// This process's instance string (see [`instance_id`]), under which the node id is registered.
    pub instance: String,
}

/// Starts the renewal, takeover and wake-up loops.
pub fn start(
    deps: Arc<RunDeps>,
    supervisor: ActorRef<SupervisorMsg>,
    instance: String,
    max_live_runs: usize,
) -> Ownership {
    let stop = CancellationToken::new();
    tokio::spawn(renew_loop(
        deps.clone(),
        supervisor.clone(),
        instance.clone(),
        stop.clone(),
    ));
    tokio::spawn(takeover_loop(
        deps.clone(),
        supervisor.clone(),
        max_live_runs,
        stop.clone(),
    ));
    tokio::spawn(wakeup_loop(deps, supervisor, stop.clone()));
    Ownership { stop, instance }
}

/// Renews every lease this node holds and its identity, once per interval, in one round trip
/// each. Runs whose lease turned out to be someone else's stop at once.
async fn renew_loop(
    deps: Arc<RunDeps>,
    supervisor: ActorRef<SupervisorMsg>,
    instance: String,
    stop: CancellationToken,
) {
    let ttl = deps.lease_ttl;
    let mut tick = tokio::time::interval(renew_interval(ttl));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if let Err(e) = deps
            .store
            .heartbeat_node(&deps.node_id, &instance, ttl)
            .await
        {
            tracing::warn!(node = %deps.node_id, error = %e, "could not renew this node's registration");
        }
        let leases = deps.leases.snapshot();
        if leases.is_empty() {
            continue;
        }
        let started = now_ms();
        let renewed = tokio::time::timeout(
            ttl / 4,
            deps.store.renew_leases(&deps.node_id, &leases, ttl),
        )
        .await;
        match renewed {
            Ok(Ok(lost)) => {
                deps.leases.renewed(&leases, started);
                if !lost.is_empty() {
                    tracing::warn!(
                        runs = lost.len(),
                        "leases taken by another node; stopping those runs here"
                    );
                    deps.metrics
                        .leases_lost
                        .fetch_add(lost.len() as u64, Ordering::Relaxed);
                }
                for run in lost {
                    deps.leases.remove(&run);
                    let _ = supervisor.cast(SupervisorMsg::LeaseLost(run));
                }
            }
            Ok(Err(e)) => {
                deps.metrics
                    .lease_renewal_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(leases = leases.len(), error = %e, "lease renewal failed; runs send no tool calls until it succeeds");
            }
            Err(_) => {
                deps.metrics
                    .lease_renewal_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    leases = leases.len(),
                    "lease renewal timed out; runs send no tool calls until it succeeds"
                );
            }
        }
    }
}

/// Takes runs that need an owner (their lease lapsed, was released, or they were queued for any
/// node), as many as this node has room for.
async fn takeover_loop(
    deps: Arc<RunDeps>,
    supervisor: ActorRef<SupervisorMsg>,
    max_live_runs: usize,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(scan_interval(deps.lease_ttl));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let live = deps.metrics.live_runs.load(Ordering::Relaxed) as usize;
        let room = max_live_runs.saturating_sub(live).min(256);
        if room == 0 {
            continue;
        }
        let due = match deps.store.due_runs(now_ms(), room).await {
            Ok(due) => due,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the runs that need an owner");
                continue;
            }
        };
        for id in due {
            if deps.leases.holds(&id) || deps.mismatched.contains_key(&id) {
                continue;
            }
            let _ = supervisor.cast(SupervisorMsg::TakeOver(id));
        }
    }
}

/// Delivers the wake-ups other nodes send this one (a control stored for one of its runs).
async fn wakeup_loop(
    deps: Arc<RunDeps>,
    supervisor: ActorRef<SupervisorMsg>,
    stop: CancellationToken,
) {
    let mut cursor = String::new();
    let mut failures = 0u32;
    loop {
        let next = tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            next = deps.store.wakeups(&deps.node_id, &cursor, Duration::from_secs(5)) => next,
        };
        match next {
            Ok((runs, next_cursor)) => {
                failures = 0;
                cursor = next_cursor;
                for run in runs {
                    let _ = supervisor.cast(SupervisorMsg::Wake(run));
                }
            }
            Err(e) => {
                failures += 1;
                let wait = Duration::from_millis(100u64 << failures.min(5));
                tracing::debug!(error = %e, ?wait, "cannot read wake-ups; retrying");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn lease(run: &str, token: u64) -> Lease {
        Lease {
            run_id: run.parse().unwrap(),
            owner: "n".into(),
            token,
        }
    }

    #[test]
    fn a_lease_is_fresh_for_half_its_ttl_and_renewal_refreshes_only_the_same_token() {
        let book = LeaseBook::default();
        let ttl = Duration::from_secs(10);
        book.insert(lease("run_01", 1), 1_000);
        let id: RunId = "run_01".parse().unwrap();
        assert!(book.fresh(&id, ttl, 5_999));
        assert!(!book.fresh(&id, ttl, 6_000));
        book.renewed(&[lease("run_01", 2)], 6_000);
        assert!(!book.fresh(&id, ttl, 6_000), "another token renews nothing");
        book.renewed(&[lease("run_01", 1)], 6_000);
        assert!(book.fresh(&id, ttl, 6_000));
        book.remove(&id);
        assert!(!book.fresh(&id, ttl, 6_000));
        assert!(book.is_empty());
    }

    #[test]
    fn intervals_leave_room_before_a_lease_lapses() {
        for secs in [1, 5, 30, 300] {
            let ttl = Duration::from_secs(secs);
            assert!(renew_interval(ttl) * 2 <= ttl / 2 + Duration::from_millis(50));
            assert!(scan_interval(ttl) <= Duration::from_secs(1));
        }
    }

    #[test]
    fn only_a_vanished_process_of_this_host_is_a_dead_holder() {
        let me = instance_id();
        assert!(!holder_is_dead(&me), "this process is alive");
        let host = host_name();
        // Pids are below 2^22 on Linux: this one cannot exist.
        assert!(holder_is_dead(&format!("{host}:4294967295:00")));
        assert!(!holder_is_dead("another-host:4294967295:00"));
        assert!(!holder_is_dead("garbage"));
        assert!(!holder_is_dead(&format!("{host}:1:00")), "pid 1 is alive");
    }

    #[test]
    fn generated_node_ids_are_valid_names_and_differ() {
        let a = generated_node_id();
        let b = generated_node_id();
        assert!(a.len() <= 64 && !a.is_empty());
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_'),
            "{a}"
        );
        // A random suffix: two ids in one process differ with overwhelming probability.
        assert!(a != b || generated_node_id() != a);
    }
}
