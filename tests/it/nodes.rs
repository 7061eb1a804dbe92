//! Several daemons on one Redis, as real processes over HTTP: each has its own identity (a
//! configured one is refused while a live process holds it), a control sent through any node
//! reaches the run's owner at once, a SIGKILLed node's runs finish on the others once their
//! leases lapse, and a SIGTERMed node's runs continue elsewhere at once — with no effect
//! applied twice and every log gap-free with exactly one terminal event.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agentd::ids::RunId;
use agentd::store::SharedStore;
use futures::future::join_all;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::chaos_support::{ChildDaemon, check_stored_run, tail};
use crate::cluster_support::LocalCluster;
use crate::fakes::ToolServer;
use crate::redis_support::{shared_redis_url, skip_or_fail, unique_ns};

const TOKEN: &str = "nodes-token-0123456789";

/// Runs of agent `work`: three 0.5 s model turns around an idempotent call (honouring keys)
/// and an unsafe one with a status URL (naive, so a repeated execution would show). Agent
/// `gate` waits for an approval.
fn config(store_url: &str, tools: &ToolServer, runtime: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
shutdown_timeout = "5s"

[store]
url = "{store_url}"

[[tenants]]
id = "nodes"
tokens = ["{TOKEN}"]

[runtime]
lease_ttl = "5s"
passivate_after = "0s"
{runtime}

[runtime.restart]
backoff_base = "20ms"
backoff_max = "200ms"

[models.work]
kind = "scripted"
delay = "500ms"
replies = [
  {{ tool_calls = [ {{ name = "credit", arguments = {{ amount = 1 }} }} ] }},
  {{ tool_calls = [ {{ name = "ship", arguments = {{ item = "a" }} }} ] }},
  {{ text = "done" }},
]

[models.gate]
kind = "scripted"
replies = [
  {{ tool_calls = [ {{ name = "ship_gated", arguments = {{ item = "gated" }} }} ] }},
  {{ text = "done" }},
]

[tools.credit]
kind = "http"
url = "{honouring}"
parameters = {{ type = "object", properties = {{ amount = {{ type = "integer" }} }}, required = ["amount"] }}
effect = "idempotent"
timeout = "10s"

[tools.ship]
kind = "http"
url = "{naive}"
status_url = "{status}"
parameters = {{ type = "object", properties = {{ item = {{ type = "string" }} }}, required = ["item"] }}
effect = "unsafe"
timeout = "10s"

[tools.ship_gated]
kind = "http"
url = "{naive}"
parameters = {{ type = "object", properties = {{ item = {{ type = "string" }} }}, required = ["item"] }}
effect = "unsafe"
approval = "always"
timeout = "10s"

[agents.work]
model = "work"
tools = ["credit", "ship"]

[agents.gate]
model = "gate"
tools = ["ship_gated"]
"#,
        honouring = tools.honouring_url(),
        naive = tools.tool_url(),
        status = tools.status_url(),
    )
}

struct Cluster {
    dir: tempfile::TempDir,
    store_url: String,
    store: SharedStore,
    /// The local Redis Cluster the daemons share, when they run on one.
    _redis_cluster: Option<LocalCluster>,
}

impl Cluster {
    /// A fresh namespace on the shared Redis, or `None` (skip outside CI) without one.
    async fn new() -> Option<Cluster> {
        Self::on(format!("{}?ns={}", shared_redis_url(), unique_ns()), None).await
    }

    /// Daemons on a local three-master Redis Cluster (`redis+cluster://`).
    async fn on_redis_cluster() -> Option<Cluster> {
        let redis = LocalCluster::start().await?;
        let url = format!("{}?ns={}", redis.url(), unique_ns());
        Self::on(url, Some(redis)).await
    }

    async fn on(store_url: String, redis_cluster: Option<LocalCluster>) -> Option<Cluster> {
        let store = match agentd::store::open(&store_url).await {
            Ok(s) if s.ping().await.is_ok() => s,
            _ => {
                skip_or_fail(&format!("Redis at {store_url} is not reachable"));
                return None;
            }
        };
        Some(Cluster {
            dir: tempfile::tempdir().unwrap(),
            store_url,
            store,
            _redis_cluster: redis_cluster,
        })
    }

    fn write_config(&self, name: &str, text: String) -> PathBuf {
        let path = self.dir.path().join(format!("{name}.toml"));
        std::fs::write(&path, text).unwrap();
        path
    }

    fn log(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.log"))
    }

    async fn node(&self, name: &str, tools: &ToolServer, runtime: &str) -> ChildDaemon {
        let path = self.write_config(name, config(&self.store_url, tools, runtime));
        ChildDaemon::start(&path, &self.log(name)).await
    }

    fn logs(&self) -> String {
        ["a", "b", "c"]
            .iter()
            .map(|n| format!("--- {n}\n{}", tail(&self.log(n), 25)))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

async fn post(d: &ChildDaemon, path: &str, body: Value) -> (StatusCode, Value) {
    d.post(path, TOKEN, &body).await.unwrap()
}

async fn create(d: &ChildDaemon, agent: &str) -> String {
    let (s, b) = post(d, "/v1/runs", json!({"agent": agent, "input": "go"})).await;
    assert_eq!(s, StatusCode::CREATED, "{b}");
    b["id"].as_str().unwrap().to_owned()
}

async fn status(d: &ChildDaemon, id: &str) -> String {
    let (s, b) = d.get(&format!("/v1/runs/{id}"), TOKEN).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    b["status"].as_str().unwrap().to_owned()
}

/// Polls until every run is terminal; returns when each was first seen terminal.
async fn wait_all_terminal(
    d: &ChildDaemon,
    ids: &[String],
    within: Duration,
    logs: impl Fn() -> String,
) -> HashMap<String, Instant> {
    let deadline = Instant::now() + within;
    let mut done = HashMap::new();
    while done.len() < ids.len() {
        let left: Vec<&String> = ids.iter().filter(|id| !done.contains_key(*id)).collect();
        for id in left {
            let s = status(d, id).await;
            if matches!(s.as_str(), "succeeded" | "failed" | "cancelled") {
                assert_eq!(s, "succeeded", "run {id}");
                done.insert(id.clone(), Instant::now());
            }
        }
        if Instant::now() > deadline {
            let left: Vec<_> = ids.iter().filter(|id| !done.contains_key(*id)).collect();
            panic!("runs not finished within {within:?}: {left:?}\n{}", logs());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    done
}

/// Every effect applied once, every log sound.
async fn check_effects_and_logs(c: &Cluster, tools: &ToolServer, ids: &[String]) {
    let executions = tools.all_executions();
    assert!(
        executions.values().all(|n| *n == 1),
        "an effect was applied twice: {executions:?}"
    );
    for id in ids {
        let id: RunId = id.parse().unwrap();
        let facts = check_stored_run(&c.store, &id).await.unwrap();
        assert!(facts.violations.is_empty(), "{:?}", facts.violations);
        assert_eq!(facts.terminal.as_deref(), Some("run_succeeded"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_configured_node_id_held_by_a_live_process_is_refused() {
    let Some(c) = Cluster::new().await else {
        return;
    };
    let tools = ToolServer::start().await;
    let _a = c.node("a", &tools, "node_id = \"twin\"").await;
    let path = c.write_config("b", config(&c.store_url, &tools, "node_id = \"twin\""));
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_agentd"))
            .args(["serve", "--config", path.to_str().unwrap()])
            .args(["--listen", "127.0.0.1:0"])
            .env_remove("AGENTD_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
    });
    let out = tokio::time::timeout(Duration::from_secs(30), out)
        .await
        .expect("the second daemon must exit, not wait")
        .unwrap()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("node id \"twin\" is held by another live process"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_control_sent_through_another_node_reaches_the_owner_at_once() {
    let Some(c) = Cluster::new().await else {
        return;
    };
    let tools = ToolServer::start().await;
    let a = c.node("a", &tools, "").await;
    let b = c.node("b", &tools, "").await;
    let id = create(&a, "gate").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while status(&a, &id).await != "waiting_approval" {
        assert!(Instant::now() < deadline, "{}", c.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Approve through b, which does not own the run: the answer reports the applied control.
    let sent = Instant::now();
    let (s, body) = post(
        &b,
        &format!("/v1/runs/{id}/approvals/call_1_0"),
        json!({"decision": "approve"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{body}");
    assert_eq!(body["pending_approvals"], json!([]), "{body}");
    wait_all_terminal(
        &b,
        std::slice::from_ref(&id),
        Duration::from_secs(10),
        || c.logs(),
    )
    .await;
    let took = sent.elapsed();
    assert!(
        took < Duration::from_secs(4),
        "the control took {took:?}: it must not wait for the lease (5 s) to lapse"
    );
    // A refused control through b gets its error too.
    let (s, body) = post(
        &b,
        &format!("/v1/runs/{id}/approvals/call_1_0"),
        json!({"decision": "reject"}),
    )
    .await;
    assert_eq!(s, StatusCode::CONFLICT, "{body}");
    assert_eq!(tools.total_executions(), 1);
}

/// Three daemons, 60 runs spread over them; one is stopped with `signal` mid-flight. Returns,
/// for the stopped node's runs, how long after the stop each finished.
async fn lose_a_node(c: Cluster, signal: &str) -> Option<Vec<Duration>> {
    let tools = ToolServer::start().await;
    let nodes = vec![
        c.node("a", &tools, "").await,
        c.node("b", &tools, "").await,
        c.node("c", &tools, "").await,
    ];
    let per_node = join_all(
        nodes
            .iter()
            .map(|n| join_all((0..20).map(|_| create(n, "work")))),
    )
    .await;
    // Mid-flight: the first model turn (0.5 s) has begun everywhere.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let mut nodes = nodes;
    let victim = nodes.remove(0);
    let stopped_at = Instant::now();
    if signal == "KILL" {
        victim.kill9();
    } else {
        let mut victim = victim;
        victim.signal(signal);
        assert!(
            victim.wait_exit(Duration::from_secs(10)).await.is_some(),
            "the node did not stop"
        );
    }
    let all: Vec<String> = per_node.iter().flatten().cloned().collect();
    let finished = wait_all_terminal(&nodes[0], &all, Duration::from_secs(60), || c.logs()).await;
    check_effects_and_logs(&c, &tools, &all).await;
    let mut took: Vec<Duration> = per_node[0]
        .iter()
        .map(|id| finished[id].saturating_duration_since(stopped_at))
        .collect();
    took.sort();
    // A figure for the notes (`cargo test --test it nodes:: -- --nocapture`), not asserted.
    println!(
        "SIG{signal}: the stopped node's 20 runs finished elsewhere after median {:?}, max {:?}",
        took[took.len() / 2],
        took[took.len() - 1]
    );
    Some(took)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_nodes_runs_finish_on_the_others() {
    let Some(c) = Cluster::new().await else {
        return;
    };
    let Some(took) = lose_a_node(c, "KILL").await else {
        return;
    };
    let worst = took.iter().max().copied().unwrap_or_default();
    // lease_ttl (5 s) for the leases to lapse, + 5 s for the rest of the run (two 0.5 s
    // turns and the calls).
    assert!(
        worst <= Duration::from_secs(10),
        "the last run finished {worst:?} after the kill"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_terminated_nodes_runs_continue_elsewhere_at_once() {
    let Some(c) = Cluster::new().await else {
        return;
    };
    let Some(took) = lose_a_node(c, "TERM").await else {
        return;
    };
    let worst = took.iter().max().copied().unwrap_or_default();
    // Released at shutdown: no lease to wait for; at most the rest of the run (about 1.5 s of
    // model turns) plus 2 s.
    assert!(
        worst <= Duration::from_millis(3_500),
        "the last run finished {worst:?} after SIGTERM"
    );
}

/// The same on a local three-master Redis Cluster: the daemons run on `redis+cluster://`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_nodes_runs_finish_on_the_others_on_a_redis_cluster() {
    let Some(c) = Cluster::on_redis_cluster().await else {
        return;
    };
    let Some(took) = lose_a_node(c, "KILL").await else {
        return;
    };
    let worst = took.iter().max().copied().unwrap_or_default();
    assert!(
        worst <= Duration::from_secs(10),
        "the last run finished {worst:?} after the kill"
    );
}
