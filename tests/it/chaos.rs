//! kill -9 chaos (catalog A7, with A2/A3/A6): a real `agentd serve` child process on a
//! private `redis-server`, agents on a scripted model calling side-effecting HTTP tools on the
//! recording `ToolServer` (an idempotent tool that honours keys, an unsafe one with a status
//! URL, an unsafe one without). Each trial starts runs over HTTP, SIGKILLs the daemon after a
//! random delay (sometimes again while it recovers), restarts it, waits for every run to
//! settle, and checks the oracle:
//!
//! - I1: every acknowledged run exists and reaches a terminal or waiting state; creations cut
//!   off by the kill are retried with their idempotency key and exist exactly once;
//! - I2: no key is applied twice by the naive (non-deduplicating) endpoint;
//! - I3: every request reaches the tool with one durable `dispatched` intent per attempt
//!   (checked at receipt by a witness reading the store, and again at the end);
//! - I4: every log is gap-free with `run_created` first, one `run_started`, exactly one
//!   terminal event for a terminal run, and a checkpoint version equal to the last seq.
//!
//! The same trials run on a local three-master Redis Cluster (`redis+cluster://`).
//!
//! `CHAOS_TRIALS` (default 20; `CHAOS_CLUSTER_TRIALS` on the cluster, default 10), `CHAOS_RUNS`
//! (runs started per trial, default 8) and `CHAOS_SEED` tune it; the seed is printed. `scripts/chaos-soak.sh` runs long soaks.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use agentd::ids::RunId;
use agentd::store::SharedStore;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::chaos_support::{
    ChildDaemon, LogFacts, check_stored_run, intent_witness, is_settled, tail,
};
use crate::cluster_support::LocalCluster;
use crate::fakes::ToolServer;
use crate::redis_support::PrivateRedis;

const TOKEN: &str = "chaos-token-0123456789";
/// How long the runs of one trial may take to settle after the last restart.
const SETTLE: Duration = Duration::from_secs(60);

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn config(store_url: &str, tools: &ToolServer) -> String {
    let schema = |field: &str, ty: &str| {
        format!(
            "{{ type = \"object\", properties = {{ {field} = {{ type = \"{ty}\" }} }}, required = [\"{field}\"] }}"
        )
    };
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
shutdown_timeout = "5s"

[store]
url = "{store_url}"

[[tenants]]
id = "chaos"
tokens = ["{TOKEN}"]

[runtime]
node_id = "chaos-node"

[runtime.restart]
backoff_base = "20ms"
backoff_max = "200ms"

[models.chaos]
kind = "scripted"
delay = "20ms"
replies = [
  {{ tool_calls = [ {{ name = "credit", arguments = {{ amount = 1 }} }}, {{ name = "ship", arguments = {{ item = "a" }} }} ] }},
  {{ tool_calls = [ {{ name = "notify", arguments = {{ text = "shipped" }} }} ] }},
  {{ tool_calls = [ {{ name = "credit", arguments = {{ amount = 2 }} }}, {{ name = "ship", arguments = {{ item = "b" }} }} ] }},
  {{ text = "done" }},
]

[tools.credit]
kind = "http"
url = "{honouring}"
parameters = {credit}
effect = "idempotent"
timeout = "10s"

[tools.ship]
kind = "http"
url = "{naive}"
status_url = "{status}"
parameters = {ship}
effect = "unsafe"
timeout = "10s"

[tools.notify]
kind = "http"
url = "{naive}"
parameters = {notify}
effect = "unsafe"
timeout = "10s"

[agents.chaos]
model = "chaos"
tools = ["credit", "ship", "notify"]
"#,
        honouring = tools.honouring_url(),
        naive = tools.tool_url(),
        status = tools.status_url(),
        credit = schema("amount", "integer"),
        ship = schema("item", "string"),
        notify = schema("text", "string"),
    )
}

/// Figures over the whole test.
#[derive(Debug, Default)]
struct Tally {
    trials: u64,
    runs: u64,
    kills: u64,
    kills_during_recovery: u64,
    creates_retried: u64,
    creates_found: u64,
    lost_runs: u64,
    log_violations: u64,
    parked_unknown: u64,
    resumed: u64,
    statuses: HashMap<String, u64>,
}

/// One creation: POST /v1/runs with an idempotency key; the run id and whether it was new
/// (`201`) or already stored under that key (`200`); `None` when the daemon died first.
async fn create(http: reqwest::Client, base: String, key: String) -> Option<(String, bool)> {
    let res = http
        .post(format!("{base}/v1/runs"))
        .bearer_auth(TOKEN)
        .json(&json!({"agent": "chaos", "input": "ship it", "idempotency_key": key}))
        .send()
        .await
        .ok()?;
    let created = match res.status() {
        reqwest::StatusCode::CREATED => true,
        reqwest::StatusCode::OK => false,
        _ => return None,
    };
    let v: Value = res.json().await.ok()?;
    v["id"].as_str().map(|id| (id.to_owned(), created))
}

/// Polls every run until it is terminal or waiting. Returns the status per run.
async fn settle(d: &ChildDaemon, ids: &[String], log: &Path) -> HashMap<String, String> {
    let deadline = Instant::now() + SETTLE;
    let mut done: HashMap<String, String> = HashMap::new();
    loop {
        for id in ids {
            if done.contains_key(id) {
                continue;
            }
            let (s, v) = d.get(&format!("/v1/runs/{id}"), TOKEN).await;
            if s == reqwest::StatusCode::NOT_FOUND {
                // Lost: reported by the checks.
                done.insert(id.clone(), "lost".into());
                continue;
            }
            if let Some(st) = v["status"].as_str()
                && is_settled(st)
            {
                done.insert(id.clone(), st.to_owned());
            }
        }
        if done.len() == ids.len() {
            return done;
        }
        if Instant::now() >= deadline {
            let stuck: Vec<&String> = ids.iter().filter(|i| !done.contains_key(*i)).collect();
            panic!(
                "I1: runs not settled within {SETTLE:?}: {stuck:?}\nlog:\n{}",
                tail(log, 60)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The tool-side oracle over every request so far: I2 on the naive endpoint, I3 post hoc.
fn check_tools(tools: &ToolServer, dispatched: &HashMap<String, u32>) -> Vec<String> {
    let mut v = tools.violations();
    for (key, n) in tools.all_executions() {
        if n > 1 {
            v.push(format!("I2: key {key} applied {n} times"));
        }
    }
    for (key, n) in tools.all_attempts() {
        let durable = dispatched.get(&key).copied().unwrap_or(0);
        if n > durable {
            v.push(format!(
                "I3: key {key} sent {n} times with {durable} durable intents"
            ));
        }
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_chaos_loses_no_run_and_repeats_no_effect() {
    let Some(redis) = PrivateRedis::start().await else {
        return;
    };
    chaos_on(&redis.url(), env_num("CHAOS_TRIALS", 20)).await;
    drop(redis);
}

/// The same chaos on a local three-master Redis Cluster (`CHAOS_CLUSTER_TRIALS`, default 10).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_chaos_on_redis_cluster() {
    let Some(cluster) = LocalCluster::start().await else {
        return;
    };
    chaos_on(&cluster.url(), env_num("CHAOS_CLUSTER_TRIALS", 10)).await;
    drop(cluster);
}

/// Runs `trials` kill -9 trials of a daemon on the Redis at `redis_url` (no `?ns=`).
async fn chaos_on(redis_url: &str, trials: u64) {
    let per_trial = env_num("CHAOS_RUNS", 8) as usize;
    let seed = env_num("CHAOS_SEED", rand::random::<u32>() as u64);
    eprintln!(
        "chaos on {redis_url}: seed {seed} (CHAOS_SEED={seed} replays the kill schedule), \
         {trials} trials"
    );
    let mut rng = StdRng::seed_from_u64(seed);

    let ns = format!("chaos{seed}");
    let store_url = format!("{redis_url}?ns={ns}");
    let store: SharedStore = agentd::store::open(&store_url).await.unwrap();
    let tools = ToolServer::start().await;
    tools.set_latency(Duration::from_millis(10), Duration::from_millis(250));
    tools.set_witness(intent_witness(store.clone()));

    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("agentd.toml");
    let log = dir.path().join("agentd.log");
    std::fs::write(&cfg, config(&store_url, &tools)).unwrap();

    let started = Instant::now();
    let mut tally = Tally::default();
    let mut known: Vec<String> = Vec::new();
    let mut facts: HashMap<String, LogFacts> = HashMap::new();
    let mut daemon = ChildDaemon::start(&cfg, &log).await;
    for trial in 0..trials {
        tally.trials += 1;
        // Start the runs concurrently; the kill may land in the middle of creating them.
        let keys: Vec<String> = (0..per_trial)
            .map(|i| format!("s{seed}-t{trial}-r{i}"))
            .collect();
        let creating: Vec<_> = keys
            .iter()
            .map(|k| {
                let offset = Duration::from_millis(rng.random_range(0..500));
                let (http, base, k) = (daemon.http.clone(), daemon.base.clone(), k.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(offset).await; // staggered arrivals, not a synchronisation
                    create(http, base, k).await
                })
            })
            .collect();
        let delay = Duration::from_millis(rng.random_range(0..900));
        tokio::time::sleep(delay).await; // the chaos schedule, not a synchronisation
        daemon.kill9();
        tally.kills += 1;
        let mut ids = Vec::new();
        let mut cut_off = Vec::new();
        for (k, c) in keys.iter().zip(creating) {
            match c.await.unwrap() {
                Some((id, _)) => ids.push(id),
                None => cut_off.push(k.clone()),
            }
        }
        // Restart; sometimes kill it again while it is recovering.
        daemon = ChildDaemon::spawn(&cfg, &log).await;
        if rng.random_bool(0.35) {
            let again = Duration::from_millis(rng.random_range(0..400));
            tokio::time::sleep(again).await;
            daemon.kill9();
            tally.kills += 1;
            tally.kills_during_recovery += 1;
            daemon = ChildDaemon::spawn(&cfg, &log).await;
        }
        daemon.wait_ready(Duration::from_secs(30)).await;
        // A6: a creation cut off by the kill, retried with its key, exists exactly once.
        for k in cut_off {
            tally.creates_retried += 1;
            let (id, created) = create(daemon.http.clone(), daemon.base.clone(), k.clone())
                .await
                .unwrap_or_else(|| panic!("retrying creation {k} failed"));
            if !created {
                // The first attempt was stored, but its answer died with the daemon.
                tally.creates_found += 1;
            }
            ids.push(id);
        }
        let statuses = settle(&daemon, &ids, &log).await;
        tally.runs += ids.len() as u64;
        for id in &ids {
            let st = &statuses[id];
            *tally.statuses.entry(st.clone()).or_insert(0) += 1;
            if st == "lost" {
                tally.lost_runs += 1;
            }
        }
        known.extend(ids.iter().cloned());
        // The oracle over every run so far (earlier runs must not have changed either).
        let mut violations = Vec::new();
        for id in &known {
            let rid: RunId = id.parse().unwrap();
            match check_stored_run(&store, &rid).await {
                Ok(f) => {
                    violations.extend(f.violations.iter().cloned());
                    facts.insert(id.clone(), f);
                }
                Err(e) => violations.push(e),
            }
        }
        tally.log_violations = violations.len() as u64;
        let mut dispatched: HashMap<String, u32> = HashMap::new();
        for f in facts.values() {
            for (k, n) in &f.dispatched {
                *dispatched.entry(k.clone()).or_insert(0) += n;
            }
        }
        violations.extend(check_tools(&tools, &dispatched));
        assert!(
            violations.is_empty() && tally.lost_runs == 0,
            "seed {seed}, trial {trial} (kill after {delay:?}): {violations:#?}\n{tally:?}\nlog:\n{}",
            tail(&log, 60)
        );
    }

    // No run exists twice or unannounced: the tenant's list is exactly the runs we know.
    let mut listed: HashSet<String> = HashSet::new();
    let mut cursor: Option<String> = None;
    loop {
        let q = match &cursor {
            Some(c) => format!("/v1/runs?limit=100&cursor={c}"),
            None => "/v1/runs?limit=100".to_owned(),
        };
        let (s, v) = daemon.get(&q, TOKEN).await;
        assert_eq!(s, reqwest::StatusCode::OK, "{v}");
        for r in v["runs"].as_array().unwrap() {
            listed.insert(r["id"].as_str().unwrap().to_owned());
        }
        match v["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    let known_set: HashSet<String> = known.iter().cloned().collect();
    assert_eq!(
        known_set.len(),
        known.len(),
        "a creation retry returned a second run"
    );
    assert_eq!(
        listed, known_set,
        "the store holds runs nobody acknowledged, or lost some"
    );

    let attempts = tools.all_attempts();
    let executions = tools.all_executions();
    let total_attempts: u32 = attempts.values().sum();
    let applied: u32 = executions.values().sum();
    let duplicates: u32 = executions.values().map(|n| n.saturating_sub(1)).sum();
    for f in facts.values() {
        tally.parked_unknown += u64::from(f.parked_unknown);
        tally.resumed += u64::from(f.resumed);
    }
    let mut statuses: Vec<_> = tally.statuses.iter().collect();
    statuses.sort();
    eprintln!(
        "chaos figures (seed {seed}): trials {} | runs {} | kills {} ({} during recovery) | \
         creations retried after a kill {} ({} had been stored before the kill) | tool attempts {total_attempts} | applied effects \
         {applied} | deduplicated resends {} | duplicate effects {duplicates} | outcome_unknown \
         parks {} | run_resumed events {} | lost runs {} | log violations {} | statuses {statuses:?} \
         | {:.1}s",
        tally.trials,
        tally.runs,
        tally.kills,
        tally.kills_during_recovery,
        tally.creates_retried,
        tally.creates_found,
        total_attempts - applied,
        tally.parked_unknown,
        tally.resumed,
        tally.lost_runs,
        tally.log_violations,
        started.elapsed().as_secs_f64(),
    );
    assert_eq!(duplicates, 0);
    daemon.kill9();
}
