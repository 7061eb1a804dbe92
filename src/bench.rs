//! `agentd bench`: a load generator for the runtime. N concurrent runs of K tool steps each, on
//! the scripted model and the bench's `emit` tool (a short call, an output of the asked size),
//! in this process; reports runs succeeded, steps per second, step latency percentiles, CPU per
//! step, peak RSS and memory per run, and on Redis what the store received per step, by turn.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use serde_json::{Value, json};

use crate::agent::AgentSpec;
use crate::ids::RunId;
use crate::model::scripted::{ScriptedModel, turn_of};
use crate::model::{ModelProvider, ModelReply, ModelToolCall};
use crate::pool::PoolSize;
use crate::run::{Budget, Status};
use crate::runtime::{NewRun, Runtime, RuntimeConfig, RuntimeParts};
use crate::store::SharedStore;
use crate::tool::registry::Registry;
use crate::tool::{Tool, ToolContext, ToolEffect, ToolError, ToolSpec};

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Concurrent runs, all created at the start.
    pub runs: usize,
    /// Creates in flight at once while the runs are created, as that many clients would send
    /// them (1: one after another, each waiting for the last).
    pub clients: usize,
    /// Tool steps per run: the model calls the `emit` tool this many times, then answers.
    pub steps: u32,
    /// Scripted model latency per call.
    pub model_delay: Duration,
    /// Workers of the model gateway pool (its queue holds twice the runs, at least 2048).
    pub model_workers: usize,
    /// Workers of the tool pool (its queue holds twice the runs, at least 2048).
    pub tool_workers: usize,
    /// Give up after this long.
    pub timeout: Duration,
    /// Instead of running steps: park every run in `waiting_input` (one model turn asking the
    /// user), measure the memory of N live, idle runs, then cancel them.
    pub park: bool,
    /// Bytes of the text of each tool output (the call itself stays short). 0: a short text.
    pub tool_output_bytes: usize,
    /// The runtime's `commit_window` (`None`: every transition committed on its own).
    pub commit_window: Option<Duration>,
    /// A single Redis server (`redis://…`) whose `INFO` is read before and after, to report
    /// bytes received and commands per step. Other clients of that server count too.
    pub redis_stats_url: Option<String>,
}

/// What Redis received while the runs were created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisCreates {
    /// Received from the start until the last create returned.
    pub traffic: RedisTraffic,
    /// Steps begun by then (the runs start as they are created).
    pub steps_begun: u64,
}

/// Bytes Redis received and commands it ran (`INFO stats` `total_net_input_bytes`, the sum of
/// `INFO commandstats` calls, Lua-internal calls included).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RedisTraffic {
    /// Bytes received from clients (`total_net_input_bytes`).
    pub input_bytes: u64,
    /// Commands run, summed over every `cmdstat_*` line's `calls`.
    pub commands: u64,
}

impl RedisTraffic {
    /// Reads both counters from `INFO` text (sections `stats` and `commandstats`).
    pub fn parse(info: &str) -> RedisTraffic {
        let mut t = RedisTraffic::default();
        for line in info.lines() {
            if let Some(v) = line.strip_prefix("total_net_input_bytes:") {
                t.input_bytes = v.trim().parse().unwrap_or(0);
            } else if line.starts_with("cmdstat_")
                && let Some(calls) = line
                    .split([':', ','])
                    .find_map(|f| f.strip_prefix("calls="))
            {
                t.commands += calls.trim().parse::<u64>().unwrap_or(0);
            }
        }
        t
    }
}

async fn redis_traffic(url: &str) -> Result<RedisTraffic, String> {
    // The server's counters do not depend on the namespace; the client rejects unknown
    // query parameters, so connect without them.
    let base = url.split('?').next().unwrap_or(url);
    let client = ::redis::Client::open(base).map_err(|e| format!("redis stats: {e}"))?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| format!("redis stats: {e}"))?;
    let mut info = String::new();
    for section in ["stats", "commandstats"] {
        let text: String = ::redis::cmd("INFO")
            .arg(section)
            .query_async(&mut conn)
            .await
            .map_err(|e| format!("redis stats: {e}"))?;
        info.push_str(&text);
    }
    Ok(RedisTraffic::parse(&info))
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            runs: 1_000,
            clients: 64,
            steps: 10,
            model_delay: Duration::ZERO,
            model_workers: 256,
            tool_workers: 256,
            timeout: Duration::from_secs(600),
            park: false,
            tool_output_bytes: 0,
            commit_window: Some(crate::runtime::DEFAULT_COMMIT_WINDOW),
            redis_stats_url: None,
        }
    }
}

/// What happened.
#[derive(Debug, Clone)]
pub struct BenchReport {
    /// Runs started.
    pub runs: usize,
    /// Runs that ended `succeeded` (with `park`: `cancelled`, as the bench cancels them).
    pub succeeded: usize,
    /// Tool calls made, summed over all runs.
    pub steps: u64,
    /// Wall time from the first create until every run had ended.
    pub elapsed: Duration,
    /// Median time between two model calls of the same run (one tool step and a turn).
    pub step_p50: Duration,
    /// 99th percentile of the same.
    pub step_p99: Duration,
    /// User plus system CPU of the whole process (all threads) while the runs ran, divided by
    /// `steps` (Linux; zero elsewhere).
    pub cpu_per_step: Duration,
    /// Resident memory in bytes before the first run was created.
    pub baseline_rss: u64,
    /// Peak resident memory of the process in bytes (`VmHWM`).
    pub peak_rss: u64,
    /// State transitions committed by the bench's runtime.
    pub transitions: u64,
    /// Commits that stored them (fewer when transitions waited in the commit window to be
    /// committed together, `runtime.commit_window`).
    pub commits: u64,
    /// With `park`: resident memory above the baseline while all runs were parked.
    pub parked_rss: Option<u64>,
    /// With `redis_stats_url`: what Redis received during the run (the two `INFO` reads
    /// between included).
    pub redis: Option<RedisTraffic>,
    /// With `redis_stats_url`: what Redis received per step in each tenth of the steps (about
    /// turns `k·K/10 + 1 ..= (k+1)·K/10` of every run, as the runs advance together), as
    /// (first turn, last turn, bytes per step, commands per step).
    pub redis_by_turn: Vec<(u32, u32, f64, f64)>,
    /// With `redis_stats_url`: what Redis received from the start until every run was
    /// created (the creates, and the steps begun meanwhile), measured apart from the tenths.
    pub redis_creates: Option<RedisCreates>,
    /// The first run's stored transcript entries and events, in bytes per step: what a step
    /// has to write at the least.
    pub stored_per_step: Option<f64>,
    /// Why the runs that did not succeed ended, with how many ended so.
    pub failures: Vec<(String, usize)>,
}

impl BenchReport {
    /// Tool steps per second of wall time (`steps / elapsed`).
    pub fn steps_per_second(&self) -> f64 {
        self.steps as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Peak resident memory above the baseline, divided by the runs.
    pub fn bytes_per_run(&self) -> u64 {
        self.peak_rss.saturating_sub(self.baseline_rss) / self.runs.max(1) as u64
    }
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "runs succeeded     {}/{}", self.succeeded, self.runs)?;
        for (why, n) in &self.failures {
            writeln!(f, "  {n} ended with    {why}")?;
        }
        writeln!(
            f,
            "steps              {} in {:.2?}",
            self.steps, self.elapsed
        )?;
        writeln!(f, "steps per second   {:.0}", self.steps_per_second())?;
        writeln!(
            f,
            "step latency       p50 {:.2?}  p99 {:.2?}",
            self.step_p50, self.step_p99
        )?;
        writeln!(
            f,
            "cpu per step       {:.1?} (user+system, all threads)",
            self.cpu_per_step
        )?;
        writeln!(
            f,
            "transitions        {} in {} commits",
            self.transitions, self.commits
        )?;
        writeln!(
            f,
            "peak rss           {:.1} MiB (baseline {:.1} MiB)",
            self.peak_rss as f64 / 1_048_576.0,
            self.baseline_rss as f64 / 1_048_576.0
        )?;
        write!(
            f,
            "memory per run     {:.1} KiB (peak above baseline / runs, messages included)",
            self.bytes_per_run() as f64 / 1024.0
        )?;
        if let Some(r) = self.redis {
            let steps = self.steps.max(1) as f64;
            write!(
                f,
                "\nredis per step     {:.2} KiB received, {:.1} commands (INFO total_net_input_bytes, commandstats calls incl. Lua; {} B, {} commands in all)",
                r.input_bytes as f64 / 1024.0 / steps,
                r.commands as f64 / steps,
                r.input_bytes,
                r.commands
            )?;
        }
        if let Some(stored) = self.stored_per_step {
            write!(
                f,
                "\nstored per step    {:.2} KiB of new transcript entries and events (first run)",
                stored / 1024.0
            )?;
            if let Some(r) = self.redis {
                let per_step = r.input_bytes as f64 / self.steps.max(1) as f64;
                write!(
                    f,
                    "; {:.2} KiB more reached Redis (checkpoint, keys, protocol)",
                    (per_step - stored) / 1024.0
                )?;
            }
        }
        if let Some(c) = self.redis_creates {
            let runs = self.runs.max(1) as f64;
            write!(
                f,
                "\nredis creates      {:.2} KiB, {:.1} commands per run (until every run was created; {} steps had begun)",
                c.traffic.input_bytes as f64 / 1024.0 / runs,
                c.traffic.commands as f64 / runs,
                c.steps_begun
            )?;
        }
        if !self.redis_by_turn.is_empty() {
            write!(f, "\nredis by turn      ")?;
            for (i, (from, to, bytes, commands)) in self.redis_by_turn.iter().enumerate() {
                if i > 0 {
                    write!(f, "\n                   ")?;
                }
                write!(
                    f,
                    "turns {from:>3}-{to:<3}  {:>6.2} KiB  {commands:>5.1} commands per step",
                    bytes / 1024.0
                )?;
            }
        }
        if let Some(parked) = self.parked_rss {
            write!(
                f,
                "\nparked run         {:.1} KiB per live idle run (waiting_input, 2 messages; store included)",
                parked as f64 / 1024.0 / self.runs.max(1) as f64
            )?;
        }
        Ok(())
    }
}

/// The largest tool output the bench can ask for (the tools' default output cap).
pub const MAX_TOOL_OUTPUT_BYTES: usize = 64 * 1024;

/// The bench's tool: `{"step": k, "bytes": n}` answers `{"text": …}` of n bytes. A short call
/// with a long output, like a fetch or a search.
struct Emit {
    spec: ToolSpec,
}

impl Emit {
    fn new() -> Self {
        Emit {
            spec: ToolSpec::new(
                "emit",
                "Return a text of the asked size (benchmark tool).",
                json!({
                    "type": "object",
                    "properties": {
                        "step": {"type": "integer", "minimum": 0},
                        "bytes": {"type": "integer", "minimum": 0, "maximum": MAX_TOOL_OUTPUT_BYTES}
                    },
                    "required": ["step", "bytes"],
                    "additionalProperties": false
                }),
            )
            .effect(ToolEffect::Read)
            // The envelope around the text must fit too.
            .max_output_bytes(MAX_TOOL_OUTPUT_BYTES + 1024),
        }
    }
}

#[async_trait::async_trait]
impl Tool for Emit {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn call(&self, _ctx: &ToolContext, arguments: Value) -> Result<Value, ToolError> {
        let step = arguments["step"].as_u64().unwrap_or(0) as u32;
        let bytes = arguments["bytes"].as_u64().unwrap_or(0) as usize;
        Ok(json!({ "text": step_text(step, bytes) }))
    }
}

/// The echo text of step `turn`: `bytes` long when `bytes > 0`.
fn step_text(turn: u32, bytes: usize) -> String {
    let mut text = format!("step {turn} ");
    if bytes > text.len() {
        text.extend(std::iter::repeat_n('x', bytes - text.len()));
    }
    text
}

fn proc_status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// User + system CPU time of this process (Linux; zero elsewhere).
fn cpu_time() -> Duration {
    let ticks = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let after = s.rsplit_once(')')?.1;
            let f: Vec<&str> = after.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0);
    // USER_HZ is 100 on Linux.
    Duration::from_millis(ticks * 10)
}

/// Bytes per step of the run's stored transcript entries and events.
async fn stored_bytes(store: &SharedStore, run: &RunId) -> Option<f64> {
    let cp = store.load(run).await.ok()??;
    let entries: usize = cp.transcript.iter().map(String::len).sum();
    let mut events = 0usize;
    let mut after = 0;
    loop {
        let page = store.read(run, after, 1_000).await.ok()?;
        let Some(last) = page.last() else { break };
        after = last.seq;
        events += page
            .iter()
            .map(|e| serde_json::to_string(e).map_or(0, |j| j.len()))
            .sum::<usize>();
    }
    let state = crate::runtime::actor::state_of(&cp).ok()?;
    Some((entries + events) as f64 / f64::from(state.usage.tool_calls.max(1)))
}

/// Runs the benchmark on `store`.
pub async fn run(opts: BenchOptions, store: SharedStore) -> Result<BenchReport, String> {
    let steps = opts.steps;
    let park = opts.park;
    let output_bytes = opts.tool_output_bytes;
    if output_bytes > MAX_TOOL_OUTPUT_BYTES {
        return Err(format!(
            "--tool-output-bytes {output_bytes} is above {MAX_TOOL_OUTPUT_BYTES}, the longest text the echo tool takes"
        ));
    }
    let last_call: Arc<DashMap<RunId, Instant>> = Arc::new(DashMap::new());
    let latencies: Arc<std::sync::Mutex<Vec<u32>>> = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (lc, lat) = (last_call.clone(), latencies.clone());
    // Steps begun (model replies that call the tool), for the by-turn Redis figures.
    let begun = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let begun_by_model = begun.clone();
    let model = ScriptedModel::from_fn("bench", move |req| {
        let now = Instant::now();
        if let Some(prev) = lc.insert(req.run_id.clone(), now)
            && let Ok(mut l) = lat.lock()
        {
            l.push(now.duration_since(prev).as_micros().min(u32::MAX as u128) as u32);
        }
        // Counted over the run's whole history: older turns are condensed in long runs.
        let turn = turn_of(req);
        if park {
            return Ok(ModelReply {
                text: None,
                tool_calls: vec![ModelToolCall {
                    id: "ask".into(),
                    name: "ask_user".into(),
                    arguments: json!({"question": "go on?"}).to_string(),
                }],
                usage: Default::default(),
            });
        }
        Ok(if turn <= steps {
            begun_by_model.fetch_add(1, Ordering::Relaxed);
            ModelReply {
                text: None,
                tool_calls: vec![ModelToolCall {
                    id: format!("c{turn}"),
                    name: "emit".into(),
                    arguments: json!({"step": turn, "bytes": output_bytes}).to_string(),
                }],
                usage: Default::default(),
            }
        } else {
            ModelReply {
                text: Some("done".into()),
                ..Default::default()
            }
        })
    })
    .with_delay(opts.model_delay);
    let mut registry = Registry::new();
    registry
        .register(Arc::new(Emit::new()))
        .map_err(|e| e.to_string())?;
    let mut config = RuntimeConfig {
        commit_window: opts.commit_window,
        ..RuntimeConfig::default()
    };
    config.gateway.size = PoolSize {
        workers: opts.model_workers,
        queue: opts.runs.max(1024) * 2,
    };
    config.tool_pool = PoolSize {
        workers: opts.tool_workers,
        queue: opts.runs.max(1024) * 2,
    };
    // Long runs with long outputs must not end on the token budget: steps are what is measured.
    let budget = Budget {
        max_turns: steps + 5,
        max_tool_calls: steps + 5,
        max_tokens: u64::MAX / 2,
        ..Budget::default()
    };
    let agent = AgentSpec::new("bench", "bench")
        .tools(["emit"])
        .budget(budget);
    let models: std::collections::HashMap<String, Arc<dyn ModelProvider>> = [(
        "bench".to_owned(),
        Arc::new(model) as Arc<dyn ModelProvider>,
    )]
    .into();
    let runtime = Runtime::start(
        config,
        RuntimeParts {
            store: store.clone(),
            registry,
            models,
            agents: vec![agent],
            faults: None,
            redactor: None,
        },
    )
    .await
    .map_err(|e| e.to_string())?;
    let handle = runtime.handle();
    let redis_before = match &opts.redis_stats_url {
        Some(url) => Some(redis_traffic(url).await?),
        None => None,
    };
    // Redis's counters once every run is created (what the creates cost is a run's, not a
    // step's), then at each tenth of the steps begun after that.
    let sampling_done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let all_created = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = match (&opts.redis_stats_url, redis_before) {
        (Some(url), Some(_)) if !park => {
            let (url, begun, stop) = (url.clone(), begun.clone(), sampling_done.clone());
            let created = all_created.clone();
            let total = opts.runs as u64 * u64::from(steps);
            Some(tokio::spawn(async move {
                let mut samples = Vec::new();
                while !created.load(Ordering::Relaxed) {
                    if stop.load(Ordering::Relaxed) {
                        return samples;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                let first = begun.load(Ordering::Relaxed);
                match redis_traffic(&url).await {
                    Ok(t) => samples.push((first, t)),
                    Err(_) => return samples,
                }
                for k in 1..=10u64 {
                    let due = first + total.saturating_sub(first) * k / 10;
                    while begun.load(Ordering::Relaxed) < due {
                        if stop.load(Ordering::Relaxed) {
                            return samples;
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    let at = begun.load(Ordering::Relaxed);
                    match redis_traffic(&url).await {
                        Ok(t) => samples.push((at, t)),
                        Err(_) => break,
                    }
                }
                samples
            }))
        }
        _ => None,
    };
    let baseline_rss = proc_status_kib("VmRSS:") * 1024;
    let cpu_before = cpu_time();
    let started = Instant::now();
    // Created by `clients` at once, in order: a store's round trip per create is then paid
    // by many creates together, as a daemon's clients would send them.
    let ids: Vec<RunId> = {
        use futures::StreamExt;
        futures::stream::iter(0..opts.runs)
            .map(|i| {
                let handle = handle.clone();
                async move {
                    handle
                        .create_run(NewRun {
                            tenant: "bench".into(),
                            agent: "bench".into(),
                            input: Value::String(format!("bench run {i}")),
                            client_key: None,
                            budget: Default::default(),
                            metadata: Value::Null,
                            scopes: None,
                        })
                        .await
                        .map(|(run, _)| run.id)
                        .map_err(|e| format!("create run {i}: {e}"))
                }
            })
            .buffered(opts.clients.max(1))
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()?
    };
    all_created.store(true, Ordering::Relaxed);
    // Wait until every run has ended, polling the counters (cheap; no per-run waiters that
    // would add their own cost to what is measured).
    let metrics = handle.metrics().clone();
    let ended = || {
        [Status::Succeeded, Status::Failed, Status::Cancelled]
            .iter()
            .map(|s| {
                let i = Status::ALL.iter().position(|x| x == s).unwrap_or(0);
                metrics.runs_entered[i].load(Ordering::Relaxed)
            })
            .sum::<u64>()
    };
    let deadline = Instant::now() + opts.timeout;
    let mut parked_rss = None;
    if park {
        let waiting = Status::ALL
            .iter()
            .position(|x| *x == Status::WaitingInput)
            .unwrap_or(0);
        while metrics.runs_entered[waiting].load(Ordering::Relaxed) < opts.runs as u64 {
            if Instant::now() > deadline {
                return Err("timed out parking runs".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        parked_rss = Some((proc_status_kib("VmRSS:") * 1024).saturating_sub(baseline_rss));
        for id in &ids {
            handle
                .cancel("bench", id, None)
                .await
                .map_err(|e| format!("cancel {id}: {e}"))?;
        }
    }
    while ended() < opts.runs as u64 {
        if Instant::now() > deadline {
            return Err(format!(
                "timed out with {} of {} runs ended",
                ended(),
                opts.runs
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();
    let cpu = cpu_time().saturating_sub(cpu_before);
    let peak_rss = proc_status_kib("VmHWM:") * 1024;
    let redis = match (&opts.redis_stats_url, redis_before) {
        (Some(url), Some(before)) => {
            let after = redis_traffic(url).await?;
            Some(RedisTraffic {
                input_bytes: after.input_bytes.saturating_sub(before.input_bytes),
                commands: after.commands.saturating_sub(before.commands),
            })
        }
        _ => None,
    };
    // The last tenth's sample is read once every step has begun; the rest of its steps'
    // commits came after, so that window is closed by the final reading.
    let mut redis_by_turn = Vec::new();
    let mut redis_creates = None;
    sampling_done.store(true, Ordering::Relaxed);
    if let (Some(task), Some(after)) = (sampler, redis) {
        let mut samples = match tokio::time::timeout(Duration::from_secs(30), task).await {
            Ok(Ok(s)) => s,
            _ => Vec::new(),
        };
        if samples.len() == 11
            && let Some(before) = redis_before
        {
            let (begun_then, at_created) = samples[0];
            redis_creates = Some(RedisCreates {
                traffic: RedisTraffic {
                    input_bytes: at_created.input_bytes.saturating_sub(before.input_bytes),
                    commands: at_created.commands.saturating_sub(before.commands),
                },
                steps_begun: begun_then,
            });
            if let Some(last) = samples.last_mut() {
                last.1 = RedisTraffic {
                    input_bytes: before.input_bytes + after.input_bytes,
                    commands: before.commands + after.commands,
                };
                last.0 = opts.runs as u64 * u64::from(steps);
            }
            // A tenth's turns: the steps begun in it, spread over the runs.
            let runs = opts.runs.max(1) as u64;
            for pair in samples.windows(2) {
                let ((s0, t0), (s1, t1)) = (pair[0], pair[1]);
                let n = s1.saturating_sub(s0).max(1) as f64;
                redis_by_turn.push((
                    (s0 / runs + 1) as u32,
                    (s1 / runs).max(s0 / runs + 1) as u32,
                    t1.input_bytes.saturating_sub(t0.input_bytes) as f64 / n,
                    t1.commands.saturating_sub(t0.commands) as f64 / n,
                ));
            }
        }
    }
    let stored_per_step = match ids.first() {
        Some(first) if !park => stored_bytes(&store, first).await,
        _ => None,
    };
    let mut succeeded = 0;
    let mut steps_done = 0u64;
    let mut failures: std::collections::BTreeMap<String, usize> = Default::default();
    for id in &ids {
        let run = handle
            .get_run("bench", id)
            .await
            .map_err(|e| e.to_string())?;
        if run.status == Status::Succeeded || (park && run.status == Status::Cancelled) {
            succeeded += 1;
        } else if let Some(e) = &run.error {
            *failures
                .entry(format!("{}: {}", e.code, e.message))
                .or_insert(0) += 1;
        }
        steps_done += u64::from(run.usage.tool_calls);
    }
    let mut l = latencies.lock().map(|l| l.clone()).unwrap_or_default();
    l.sort_unstable();
    let pct = |p: f64| -> Duration {
        if l.is_empty() {
            return Duration::ZERO;
        }
        let i = ((l.len() as f64 - 1.0) * p).round() as usize;
        Duration::from_micros(u64::from(l[i]))
    };
    let report = BenchReport {
        runs: opts.runs,
        succeeded,
        steps: steps_done,
        elapsed,
        step_p50: pct(0.50),
        step_p99: pct(0.99),
        cpu_per_step: cpu / (steps_done.max(1) as u32),
        baseline_rss,
        peak_rss,
        transitions: metrics.transitions.load(Ordering::Relaxed),
        commits: metrics.commits.load(Ordering::Relaxed),
        parked_rss,
        redis,
        redis_by_turn,
        redis_creates,
        stored_per_step,
        failures: failures.into_iter().collect(),
    };
    runtime.shutdown(Duration::from_secs(30)).await;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_traffic_sums_every_command_and_reads_input_bytes() {
        let info = "# Stats\r\ntotal_connections_received:3\r\ntotal_net_input_bytes:12345\r\n\
                    # Commandstats\r\ncmdstat_get:calls=7,usec=10,usec_per_call=1.4\r\n\
                    cmdstat_evalsha:calls=5,usec=99,usec_per_call=19.8,rejected_calls=0\r\n";
        assert_eq!(
            RedisTraffic::parse(info),
            RedisTraffic {
                input_bytes: 12345,
                commands: 12
            }
        );
    }

    #[test]
    fn step_text_has_the_asked_size() {
        assert_eq!(
            step_text(3, MAX_TOOL_OUTPUT_BYTES).len(),
            MAX_TOOL_OUTPUT_BYTES
        );
        assert_eq!(step_text(3, 0), "step 3 ");
    }
}
