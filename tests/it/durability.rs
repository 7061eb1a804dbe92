//! Durability at the runtime level, on Redis: fencing of a stale owner (catalog B5), Redis
//! killed mid-flight and restarted with its data (B1/B2), and Redis restarted empty (B7).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use agentd::agent::AgentSpec;
use agentd::ids::RunId;
use agentd::model::scripted::{ScriptedModel, turn_of};
use agentd::model::{AttemptError, ModelProvider, ModelReply, ModelRequest};
use agentd::run::Status;
use agentd::runtime::{Error as RuntimeError, NewRun};
use agentd::store::redis::{RedisConfig, RedisStore};
use agentd::store::{EventRecord, Lease, SharedStore};
use agentd::tool::builtin::CountingTool;
use agentd::tool::http::HttpTool;
use agentd::tool::{ToolEffect, ToolSpec};
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use crate::chaos_support::check_stored_run;
use crate::fakes::ToolServer;
use crate::redis_support::{PrivateRedis, eventually, shared_redis_url, skip_or_fail, unique_ns};
use crate::support::{Builder, Harness, TENANT, WAIT, calls, text};

/// Turn 1 asks for one `charge`, turn 2 answers.
fn charge_reply(req: &ModelRequest) -> ModelReply {
    match turn_of(req) {
        1 => calls(&[("charge", json!({"item": "order-7"}))]),
        _ => text("charged"),
    }
}

/// A model whose replies wait for a gate the test opens; counts calls that reached it.
struct GatedModel {
    gate: Arc<Semaphore>,
    entered: Arc<AtomicU32>,
}

#[async_trait::async_trait]
impl ModelProvider for GatedModel {
    fn name(&self) -> &str {
        "m"
    }

    async fn complete(&self, request: &ModelRequest) -> Result<ModelReply, AttemptError> {
        self.entered.fetch_add(1, Ordering::SeqCst);
        if let Ok(p) = self.gate.acquire().await {
            p.forget();
        }
        Ok(charge_reply(request))
    }
}

async fn open_shared(ns: &str) -> Option<SharedStore> {
    let url = format!("{}?ns={ns}", shared_redis_url());
    match agentd::store::open(&url).await {
        Ok(s) => Some(s),
        Err(e) => {
            skip_or_fail(&format!("redis at {url} unreachable: {e}"));
            None
        }
    }
}

/// B5: node A owns a run and is stuck in a model call; its lease expires; node B (same Redis
/// namespace, its own connection) adopts the run with a newer token and finishes it. When A's
/// model reply finally arrives, A cannot commit it (fenced), so it never starts the tool call,
/// and its actor stops (`lease_lost`). The run's log shows only B's work after A's start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_owner_can_neither_commit_nor_call_a_tool() {
    let ns = unique_ns();
    let Some(store_a) = open_shared(&ns).await else {
        return;
    };
    let store_b = open_shared(&ns).await.unwrap();

    let gate = Arc::new(Semaphore::new(0));
    let entered = Arc::new(AtomicU32::new(0));
    let charge_a = CountingTool::new("charge", ToolEffect::Unsafe);
    let ledger_a = charge_a.ledger();
    let mut b = Builder::new()
        .tool(Arc::new(charge_a))
        .agent(AgentSpec::new("a", "m").tools(["charge"]));
    b.models.insert(
        "m".into(),
        Arc::new(GatedModel {
            gate: gate.clone(),
            entered: entered.clone(),
        }),
    );
    b.config.node_id = "node-a".into();
    b.config.lease_ttl = Duration::from_millis(300);
    // A is cut off from the store for lease renewals, so its lease lapses while it waits.
    b.store = crate::partition::PartitionedRenewals::new(store_a.clone());
    let a = b.start().await;
    let id = a.start_run("a", "charge it").await;
    eventually("A's model call", WAIT, || {
        let n = entered.load(Ordering::SeqCst);
        async move { (n >= 1).then_some(()) }
    })
    .await;

    // A's lease expires (its renewals do not reach the store).
    let lease_key = agentd::store::keys::Keys::new(&ns).unwrap().lease(&id);
    let client = redis::Client::open(shared_redis_url()).unwrap();
    let con = client.get_multiplexed_async_connection().await.unwrap();
    eventually("A's lease to expire", WAIT, || {
        let mut con = con.clone();
        let key = lease_key.clone();
        async move {
            let n: i64 = redis::cmd("EXISTS")
                .arg(&key)
                .query_async(&mut con)
                .await
                .unwrap();
            (n == 0).then_some(())
        }
    })
    .await;

    // B adopts the run at start and finishes it.
    let charge_b = CountingTool::new("charge", ToolEffect::Unsafe);
    let ledger_b = charge_b.ledger();
    let mut b = Builder::new()
        .tool(Arc::new(charge_b))
        .model(ScriptedModel::from_fn("m", |req| Ok(charge_reply(req))))
        .agent(AgentSpec::new("a", "m").tools(["charge"]));
    b.config.node_id = "node-b".into();
    b.store = store_b.clone();
    let nb = b.start().await;
    let run = nb.finish(&id).await;
    assert_eq!(run.status, Status::Succeeded, "{:?}", run.error);

    // Now A's model reply arrives: its commit is fenced and its actor stops.
    gate.add_permits(16);
    eventually("A's actor to stop after losing the lease", WAIT, || async {
        (a.handle.live_runs().await == 0).then_some(())
    })
    .await;
    assert_eq!(ledger_a.total(), 0, "the stale owner started a tool call");
    assert_eq!(ledger_b.total(), 1);
    assert!(ledger_b.duplicates().is_empty());

    // The log: one start (A), one resume (B), B's two model replies, one terminal event.
    let f = check_stored_run(&store_b, &id).await.unwrap();
    assert!(f.violations.is_empty(), "{:?}", f.violations);
    let events = store_b.read(&id, 0, 1000).await.unwrap();
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "run_created",
            "run_started",
            "run_resumed",
            "model_replied",
            "tool_call_finished",
            "model_replied",
            "run_succeeded"
        ],
        "{events:#?}"
    );

    // Directly: a commit with A's (older) token is refused, whatever version it claims.
    let cp = store_b.load(&id).await.unwrap().unwrap();
    let stale = Lease {
        run_id: id.clone(),
        owner: "node-a".into(),
        token: 1,
    };
    let next = EventRecord {
        seq: cp.version + 1,
        at_ms: 0,
        kind: "model_replied".into(),
        data: Value::Null,
    };
    let mut forged = cp.clone();
    forged.version += 1;
    let err = store_a
        .commit(&stale, &forged, cp.version, &[next])
        .await
        .unwrap_err();
    assert!(
        matches!(err, agentd::store::Error::Fenced { .. }),
        "stale commit: {err:?}"
    );
    a.shutdown().await;
    nb.shutdown().await;
    crate::redis_support::drop_namespace(&ns).await;
}

/// Runs paused by an outage resume after a backoff of up to 5 s; allow for a loaded machine.
const SLOW_WAIT: Duration = Duration::from_secs(60);

const SCHEMA_AMOUNT: &str =
    r#"{"type":"object","properties":{"amount":{"type":"integer"}},"required":["amount"]}"#;
const SCHEMA_ITEM: &str =
    r#"{"type":"object","properties":{"item":{"type":"string"}},"required":["item"]}"#;

/// A runtime on `store` whose agent `a` calls `credit` (idempotent, honouring keys) and
/// `ship` (unsafe, with a status URL) on the recording tool server, over HTTP.
async fn http_harness(store: SharedStore, tools: &ToolServer, model_delay: Duration) -> Harness {
    let schema = |s: &str| serde_json::from_str::<Value>(s).unwrap();
    let credit = HttpTool::new(
        ToolSpec::new("credit", "credit an account", schema(SCHEMA_AMOUNT))
            .effect(ToolEffect::Idempotent),
        &tools.honouring_url(),
        None,
    )
    .unwrap();
    let ship = HttpTool::new(
        ToolSpec::new("ship", "ship an item", schema(SCHEMA_ITEM)).effect(ToolEffect::Unsafe),
        &tools.tool_url(),
        Some(&tools.status_url()),
    )
    .unwrap();
    let model = ScriptedModel::from_fn("m", |req| {
        Ok(match turn_of(req) {
            1 => calls(&[
                ("credit", json!({"amount": 1})),
                ("ship", json!({"item": "a"})),
            ]),
            2 => calls(&[("credit", json!({"amount": 2}))]),
            3 => calls(&[("ship", json!({"item": "b"}))]),
            _ => text("done"),
        })
    })
    .with_delay(model_delay);
    let mut b = Builder::new()
        .tool(Arc::new(credit))
        .tool(Arc::new(ship))
        .model(model)
        .agent(AgentSpec::new("a", "m").tools(["credit", "ship"]));
    b.store = store;
    b.start().await
}

async fn private_store(redis: &PrivateRedis, ns: &str) -> SharedStore {
    Arc::new(
        RedisStore::open(
            RedisConfig::new(redis.url())
                .namespace(ns)
                .op_timeout(Duration::from_secs(1)),
        )
        .await
        .unwrap(),
    )
}

fn new_run(input: &str) -> NewRun {
    NewRun {
        tenant: TENANT.into(),
        agent: "a".into(),
        input: Value::String(input.into()),
        client_key: None,
        budget: Default::default(),
        metadata: Value::Null,
        scopes: None,
    }
}

/// Every request the tool server saw is covered by one durable intent per attempt, and the
/// naive endpoint applied no key twice.
async fn check_tool_ledger(store: &SharedStore, ids: &[RunId], tools: &ToolServer) {
    let mut dispatched = std::collections::HashMap::<String, u32>::new();
    for id in ids {
        let f = check_stored_run(store, id).await.unwrap();
        assert!(f.violations.is_empty(), "{:?}", f.violations);
        for (k, n) in f.dispatched {
            *dispatched.entry(k).or_insert(0) += n;
        }
    }
    for (key, n) in tools.all_attempts() {
        let durable = dispatched.get(&key).copied().unwrap_or(0);
        assert!(
            n <= durable,
            "I3: key {key} reached the tool {n} times with {durable} durable intents"
        );
    }
    for (key, n) in tools.all_executions() {
        assert!(n <= 1, "I2: key {key} applied {n} times");
    }
}

/// B1/B2: Redis (AOF, fsync always) is SIGKILLed while runs have tool calls in flight. While
/// it is down the store is reported unavailable, new runs are refused, and results that come
/// back cannot be committed (the runs pause). Restarted with its data, every run resumes and
/// succeeds; no tool call reached the tool without a durable intent; nothing applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_mid_flight_and_restarted_with_its_data_loses_nothing() {
    let Some(mut redis) = PrivateRedis::start_persistent().await else {
        return;
    };
    let tools = ToolServer::start().await;
    tools.set_latency(Duration::from_millis(200), Duration::from_millis(500));
    let store = private_store(&redis, "b1").await;
    let h = http_harness(store.clone(), &tools, Duration::from_millis(30)).await;
    let mut ids = Vec::new();
    for i in 0..8 {
        ids.push(h.start_with(new_run(&format!("order {i}"))).await);
    }
    eventually("tool calls in flight", WAIT, || {
        let n: u32 = tools.all_attempts().values().sum();
        async move { (n >= 4).then_some(()) }
    })
    .await;

    redis.kill();
    let sent_before: u32 = tools.all_attempts().values().sum();
    let err = h.handle.ready().await.unwrap_err();
    assert_eq!(err.code(), "store_unavailable", "{err}");
    let refused = h.handle.create_run(new_run("during the outage")).await;
    assert!(
        matches!(&refused, Err(e) if e.code() == "store_unavailable"),
        "{refused:?}"
    );
    // Every call in flight is answered while Redis is down: those results cannot be
    // committed, so the runs pause (and resume from their checkpoints later).
    eventually("the calls in flight to be answered", WAIT, || {
        let answered = tools.answered();
        async move { (answered >= sent_before).then_some(()) }
    })
    .await;
    // Long enough that commits give up (not just wait for a reconnect) and runs pause.
    eventually("commits to fail while Redis is down", WAIT, || async {
        (h.handle.metrics().store_retries.load(Ordering::Relaxed) >= 8).then_some(())
    })
    .await;
    let during: u32 = tools.all_attempts().values().sum::<u32>() - sent_before;

    redis.restart().await;
    let restarted = std::time::Instant::now();
    eventually("the store to be ready again", WAIT, || async {
        h.handle.ready().await.ok()
    })
    .await;
    h.handle.check_store_epoch().await.unwrap();
    for id in &ids {
        // Poll: right after the outage a read may still fail transiently (1 s op timeout).
        let run = eventually(&format!("{id} to finish"), SLOW_WAIT, || async {
            h.handle
                .get_run(TENANT, id)
                .await
                .ok()
                .filter(|r| r.is_terminal())
        })
        .await;
        assert_eq!(run.status, Status::Succeeded, "{id}: {:?}", run.error);
    }
    check_tool_ledger(&store, &ids, &tools).await;
    let resumed_in = restarted.elapsed();
    let attempts: u32 = tools.all_attempts().values().sum();
    let applied: u32 = tools.all_executions().values().sum();
    eprintln!(
        "redis kill: every run finished {resumed_in:?} after the restart; {sent_before} tool requests before the kill, {during} during the outage, \
         {attempts} in all, {applied} applied ({} deduplicated resends, {} status checks); \
         {} store retries",
        attempts - applied,
        tools.status_queries(),
        h.handle.metrics().store_retries.load(Ordering::Relaxed)
    );
    assert_eq!(applied, 32, "8 runs x 4 calls, each applied once");
    h.shutdown().await;
}

/// B7: Redis restarts empty while the runtime has live runs. The epoch check reports
/// `store_reset` and readiness fails from then on; the runs are not started again from
/// scratch (no checkpoint, no event, no tool call for the old ids), their actors stop, and
/// the old ids answer "not found".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_empty_is_detected_and_runs_are_not_restarted_from_scratch() {
    let Some(mut redis) = PrivateRedis::start().await else {
        return;
    };
    let store = private_store(&redis, "b7").await;
    let charge = CountingTool::new("charge", ToolEffect::Unsafe);
    let ledger = charge.ledger();
    let entered = Arc::new(AtomicU32::new(0));
    let gate = Arc::new(Semaphore::new(0));
    let mut b = Builder::new()
        .tool(Arc::new(charge))
        .agent(AgentSpec::new("a", "m").tools(["charge"]));
    b.models.insert(
        "m".into(),
        Arc::new(GatedModel {
            gate: gate.clone(),
            entered: entered.clone(),
        }),
    );
    b.store = store.clone();
    let h = b.start().await;
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(h.start_with(new_run(&format!("order {i}"))).await);
    }
    eventually("every run to call the model", WAIT, || {
        let n = entered.load(Ordering::SeqCst);
        async move { (n >= 4).then_some(()) }
    })
    .await;
    h.handle.check_store_epoch().await.unwrap();

    redis.restart().await;
    // The first commands after the restart may fail while the connection is re-established.
    let err = eventually("the reset to be detected", WAIT, || async {
        match h.handle.check_store_epoch().await {
            Err(e @ RuntimeError::StoreReset { .. }) => Some(e),
            _ => None,
        }
    })
    .await;
    assert!(matches!(err, RuntimeError::StoreReset { .. }), "{err:?}");
    assert_eq!(err.code(), "store_reset");
    let not_ready = h.handle.ready().await.unwrap_err();
    assert_eq!(not_ready.code(), "store_reset", "{not_ready}");

    // The model replies now: nothing may be committed or executed for the lost runs.
    gate.add_permits(64);
    eventually("the lost runs' actors to stop", WAIT, || async {
        (h.handle.live_runs().await == 0).then_some(())
    })
    .await;
    assert_eq!(ledger.total(), 0, "a lost run called its tool");
    for id in &ids {
        assert!(
            store.load(id).await.unwrap().is_none(),
            "{id} was recreated"
        );
        assert!(
            store.read(id, 0, 100).await.unwrap().is_empty(),
            "{id} logged events"
        );
        let got = h.handle.get_run(TENANT, id).await;
        assert!(matches!(got, Err(RuntimeError::NotFound)), "{got:?}");
    }
    assert!(store.active_runs().await.unwrap().is_empty());
    // Readiness stays failed until an operator restarts the daemon.
    assert_eq!(h.handle.ready().await.unwrap_err().code(), "store_reset");
    h.shutdown().await;
}
