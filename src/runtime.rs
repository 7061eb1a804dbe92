//! The runtime as a library: `Runtime::start` builds the actor tree (run supervisor, model
//! gateway, tool executor) on a store, recovers the runs that were not finished, and hands out
//! `RuntimeHandle`, the one public way to start, observe and control runs. The HTTP API and the
//! tests use nothing else.

pub mod actor;
pub mod follow;
pub mod ownership;
pub mod supervisor;

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use ractor::concurrency::JoinHandle;
use ractor::rpc::CallResult;
use ractor::{Actor, ActorRef};
use serde_json::Value;
use tokio_stream::wrappers::ReceiverStream;

use crate::agent::{self, Agent, AgentSpec};
use crate::clock::now_ms;
use crate::hub::Hub;
use crate::ids::{CallId, RunId};
use crate::metrics::Metrics;
use crate::model::gateway::{GatewayConfig, ModelGateway, ModelLimits};
use crate::model::{Message, ModelProvider, ToolDefinition};
use crate::pool::PoolSize;
use crate::redact::Redactor;
use crate::run::machine::InvalidTransition;
use crate::run::{Budget, Policy, RunState, Status};
use crate::runtime::actor::{Boot, CreatedRun, FaultInjector, RunDeps, checkpoint_of, state_of};
use crate::runtime::supervisor::{RestartPolicy, RunSupervisor, SupervisorArgs, SupervisorMsg};
use crate::store::{self, Control, CreateOutcome, EventRecord, RunFilter, SharedStore};
use crate::tool::ToolResult;
use crate::tool::executor::ToolExecutor;
use crate::tool::registry::Registry;

/// Tunables of the runtime (the `[runtime]` part of the config).
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    /// This node's identity, the owner name of its leases. Unique per process by default; a
    /// configured one is refused at start while another live process holds it.
    pub node_id: String,
    /// Runs this node keeps live at once; beyond that, new runs wait for any node with room.
    pub max_live_runs: usize,
    /// How the shared model pool calls providers (workers, queue, timeouts, retries).
    pub gateway: GatewayConfig,
    /// Workers and queue bound of the shared tool pool.
    pub tool_pool: PoolSize,
    /// Calls per second allowed for each named tool; a tool not named is unlimited.
    pub per_tool_rps: HashMap<String, NonZeroU32>,
    /// Rate limits per configured model name; a model not named is unlimited.
    pub model_limits: HashMap<String, ModelLimits>,
    /// How often a crashing run actor is restarted before the run fails `crash_loop`.
    pub restart: RestartPolicy,
    /// Bounds every run's machine enforces besides its budget.
    pub policy: Policy,
    /// How long a run's lease (and this node's registration) lasts unrenewed; a run whose
    /// lease lapsed is taken over by another node.
    pub lease_ttl: Duration,
    /// How long a control request waits for the run to apply it.
    pub control_timeout: Duration,
    /// Non-terminal runs a tenant may have at once.
    pub max_active_runs_per_tenant: Option<usize>,
    /// Largest goal (`input`) accepted, in bytes of JSON.
    pub max_input_bytes: usize,
    /// A run waiting for approval, input or long-running tool calls this long gives up its
    /// actor (its state stays in the store) and is rehydrated by its next message or timer.
    /// `None`: never.
    pub passivate_after: Option<Duration>,
    /// How long a transition whose only effects are read-only tool calls may wait to be
    /// committed together with the next one (their results, usually): one store write per
    /// step instead of two. `None`: every transition is committed on its own.
    pub commit_window: Option<Duration>,
    /// The callback route of long-running tools (`server.public_url` and the callback key);
    /// `None`: calls carry no callback and results arrive by polling only.
    pub callbacks: Option<Arc<crate::tool::callback::Callbacks>>,
    /// Traces and metric labels (`[telemetry]`): no traces and no tenant label by default.
    pub telemetry: crate::telemetry::TelemetryConfig,
}

/// The default of [`RuntimeConfig::commit_window`]: long enough for an in-process or local
/// read tool to answer also while the tool pool is busy (at 5 ms, a third of the steps of
/// `agentd bench --runs 1000` missed it), short enough that a crash loses at most that much
/// of a run's model replies and read-only results.
pub const DEFAULT_COMMIT_WINDOW: Duration = Duration::from_millis(20);

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            node_id: ownership::generated_node_id(),
            max_live_runs: 10_000,
            gateway: GatewayConfig::default(),
            tool_pool: PoolSize {
                workers: 256,
                queue: 65_536,
            },
            per_tool_rps: HashMap::new(),
            model_limits: HashMap::new(),
            restart: RestartPolicy::default(),
            policy: Policy::default(),
            lease_ttl: Duration::from_secs(30),
            control_timeout: Duration::from_secs(10),
            max_active_runs_per_tenant: None,
            max_input_bytes: 256 * 1024,
            passivate_after: Some(Duration::from_secs(60)),
            commit_window: Some(DEFAULT_COMMIT_WINDOW),
            callbacks: None,
            telemetry: Default::default(),
        }
    }
}

/// What the runtime runs: the store, tools, model providers and agents.
pub struct RuntimeParts {
    /// Where checkpoints, events, leases and inboxes live.
    pub store: SharedStore,
    /// Every tool the agents may use.
    pub registry: Registry,
    /// Model providers by configured name (the `model` of an agent).
    pub models: HashMap<String, Arc<dyn ModelProvider>>,
    /// The agents runs can be started for; each must name a provider of `models`.
    pub agents: Vec<AgentSpec>,
    /// Deliberate faults for chaos and supervision tests; `None` in production.
    pub faults: Option<Arc<dyn FaultInjector>>,
    /// Scrubs secrets from every event before it is committed and from tool results before
    /// they enter the run (`None`: nothing is redacted).
    pub redactor: Option<Arc<Redactor>>,
}

/// Runtime failures, each with a stable code.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// No such run for this tenant (`not_found`).
    #[error("run not found")]
    NotFound,
    /// No agent of this name is configured (`unknown_agent`): the name.
    #[error("agent `{0}` is not configured")]
    UnknownAgent(String),
    /// The request does not fit the run's state (`invalid_state`), e.g. it has ended or the
    /// call was already decided.
    #[error("run is {status}: {message}")]
    InvalidState {
        /// The run's status when the request was refused.
        status: Status,
        /// What did not fit.
        message: String,
    },
    /// No call of that id in the run's current batch (`not_found`): why.
    #[error("{0}")]
    UnknownCall(String),
    /// A request value is refused (`invalid_argument`), e.g. edited arguments or an input too
    /// large: why.
    #[error("{0}")]
    InvalidArgument(String),
    /// The run already holds `Policy::max_queued_input` inputs (`input_queue_full`): why.
    #[error("{0}")]
    InputQueueFull(String),
    /// The run's inbox holds `MAX_PENDING_CONTROLS` controls not yet applied (`inbox_full`):
    /// how many.
    #[error("the run has {0} controls not yet applied, the most allowed; retry once it catches up")]
    InboxFull(usize),
    /// The tenant has `max_active_runs_per_tenant` non-terminal runs (`too_many_active_runs`):
    /// the limit.
    #[error("tenant has {0} active runs, the most allowed")]
    TooManyActiveRuns(usize),
    /// The store failed or holds a record that does not decode (`store_unavailable`).
    #[error("the store is unavailable: {0}")]
    Store(store::Error),
    /// The runtime's actors are stopping (`shutting_down`).
    #[error("the runtime is shutting down")]
    ShuttingDown,
    /// A wait (`wait_until`, `wait_terminal`) ran out (`timeout`).
    #[error("the run did not reach the awaited state in time")]
    Timeout,
    /// The store's epoch marker changed since start: it lost its data (`store_reset`).
    #[error(
        "the store lost its data (its epoch changed from {was:?} to {now:?}); runs are not restarted from scratch"
    )]
    StoreReset {
        /// The marker seen at start.
        was: String,
        /// The marker the store holds now.
        now: String,
    },
}

impl Error {
    /// Stable snake_case code.
    pub fn code(&self) -> &'static str {
        match self {
            Error::NotFound => "not_found",
            Error::UnknownAgent(_) => "unknown_agent",
            Error::InvalidState { .. } => "invalid_state",
            Error::UnknownCall(_) => "not_found",
            Error::InvalidArgument(_) => "invalid_argument",
            Error::InputQueueFull(_) => "input_queue_full",
            Error::InboxFull(_) => "inbox_full",
            Error::TooManyActiveRuns(_) => "too_many_active_runs",
            Error::Store(_) => "store_unavailable",
            Error::ShuttingDown => "shutting_down",
            Error::Timeout => "timeout",
            Error::StoreReset { .. } => "store_reset",
        }
    }
}

impl From<store::Error> for Error {
    fn from(e: store::Error) -> Self {
        match e {
            store::Error::NotFound(_) => Error::NotFound,
            other => Error::Store(other),
        }
    }
}

impl From<InvalidTransition> for Error {
    fn from(e: InvalidTransition) -> Self {
        Error::from_refusal(e.code, e.message, e.status)
    }
}

impl Error {
    /// The error for a control the run refused with `code`.
    fn from_refusal(code: &str, message: String, status: Status) -> Self {
        match code {
            "unknown_call" => Error::UnknownCall(message),
            "invalid_argument" => Error::InvalidArgument(message),
            "input_queue_full" => Error::InputQueueFull(message),
            _ => Error::InvalidState { status, message },
        }
    }
}

/// Controls a run's inbox may hold that the run has not applied yet.
pub const MAX_PENDING_CONTROLS: usize = 64;

/// The answer to the control stored at inbox `seq`, read from the run's committed state.
fn control_outcome(run: RunState, seq: u64) -> Result<RunState, Error> {
    if let Some(r) = run.refusal(seq) {
        return Err(Error::from_refusal(&r.code, r.message.clone(), run.status));
    }
    if seq > run.controls_applied && run.is_terminal() {
        return Err(Error::InvalidState {
            status: run.status,
            message: "the run has already ended".into(),
        });
    }
    Ok(run)
}

/// Budget fields a client may set on a new run (each capped by nothing but itself).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BudgetRequest {
    /// Model calls allowed; `None`: the agent's.
    pub max_turns: Option<u32>,
    /// Tool calls allowed; `None`: the agent's.
    pub max_tool_calls: Option<u32>,
    /// Input plus output tokens allowed; `None`: the agent's.
    pub max_tokens: Option<u64>,
    /// Wall-clock limit from creation; `None`: the agent's deadline, if it has one.
    pub deadline: Option<Duration>,
}

/// A request to start a run.
#[derive(Debug, Clone)]
pub struct NewRun {
    /// The tenant that owns the run.
    pub tenant: String,
    /// The configured agent to run.
    pub agent: String,
    /// The goal: text or any JSON value.
    pub input: Value,
    /// The same key from the same tenant returns the same run.
    pub client_key: Option<String>,
    /// Budget overrides; unset fields take the agent's.
    pub budget: BudgetRequest,
    /// The caller's JSON kept with the run and returned with it; `null`: none.
    pub metadata: Value,
    /// The scopes of the creating token, kept with the run; `None`: every scope.
    pub scopes: Option<Vec<String>>,
}

/// Most runs in `waiting_approval` one [`RuntimeHandle::awaiting_calls`] reads.
pub const MAX_INBOX_RUNS: usize = 2000;

/// Why a call waits for an operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AwaitingReason {
    /// The tool's approval rule asks for a decision.
    Policy,
    /// A crash left the call's outcome unknown and the tool cannot be asked.
    OutcomeUnknown,
    /// Calls of the tool failed `max_failures` times in a row in this run.
    ToolFailing,
    /// The tool refused the call (401/403) and its policy asks an operator.
    PermissionError,
}

impl AwaitingReason {
    /// The API's name (`policy`, `outcome_unknown`, `tool_failing`, `permission_error`).
    pub fn as_str(self) -> &'static str {
        match self {
            AwaitingReason::Policy => "policy",
            AwaitingReason::OutcomeUnknown => "outcome_unknown",
            AwaitingReason::ToolFailing => "tool_failing",
            AwaitingReason::PermissionError => "permission_error",
        }
    }

    /// Why the call `c` waits.
    pub fn of(c: &crate::run::PendingCall) -> Self {
        match (c.status, c.hold) {
            (crate::run::CallStatus::OutcomeUnknown, _) => AwaitingReason::OutcomeUnknown,
            (_, Some(crate::run::HoldReason::ToolFailing)) => AwaitingReason::ToolFailing,
            (_, Some(crate::run::HoldReason::PermissionError)) => AwaitingReason::PermissionError,
            (_, None) => AwaitingReason::Policy,
        }
    }
}

/// One call waiting for an operator, as the approvals inbox lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct AwaitingCall {
    /// The run the call belongs to.
    pub run_id: RunId,
    /// The run's agent.
    pub agent: String,
    /// The call, as decisions name it.
    pub call_id: CallId,
    /// The tool called.
    pub tool: String,
    /// The arguments the call would run with.
    pub arguments: Value,
    /// Why it waits.
    pub reason: AwaitingReason,
    /// When the call began waiting.
    pub requested_at_ms: u64,
    /// When the tool's `approval_timeout` decides it (`None`: it waits for ever).
    pub expires_at_ms: Option<u64>,
}

/// The answer of [`RuntimeHandle::awaiting_calls`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AwaitingCalls {
    /// Oldest first.
    pub calls: Vec<AwaitingCall>,
    /// More than [`MAX_INBOX_RUNS`] runs were waiting; the oldest ones were not read.
    pub truncated: bool,
}

/// An agent as listed by `GET /v1/agents`.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentInfo {
    /// The agent's configured name.
    pub name: String,
    /// The configured model it calls.
    pub model: String,
    /// The tools offered to its model, `ask_user` included when on.
    pub tools: Vec<ToolDefinition>,
}

struct Inner {
    deps: Arc<RunDeps>,
    supervisor: ActorRef<SupervisorMsg>,
    config: RuntimeConfig,
    /// The store's epoch marker when this runtime started; a different one later means the
    /// store lost its data (e.g. Redis restarted empty).
    store_epoch: String,
    /// Set once a reset is seen; readiness fails from then on.
    store_reset: std::sync::Mutex<Option<String>>,
    /// Stops this node's lease, takeover and wake-up loops.
    ownership: ownership::Ownership,
    /// Runs whose stored record cannot be read, with why: skipped, everything else served.
    quarantined: std::sync::Mutex<std::collections::BTreeMap<RunId, String>>,
}

/// A cheap-to-clone handle to a running runtime.
#[derive(Clone)]
pub struct RuntimeHandle {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RuntimeHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeHandle").finish()
    }
}

/// The running actor tree.
pub struct Runtime {
    handle: RuntimeHandle,
    joins: Vec<JoinHandle<()>>,
}

/// Why the runtime could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// An agent is invalid (its name, or a tool it names is not registered).
    #[error(transparent)]
    Agent(#[from] agent::Error),
    /// An agent names a model that has no provider.
    #[error("agent `{agent}` uses model `{model}`, which is not configured")]
    UnknownModel {
        /// The agent's name.
        agent: String,
        /// The model it names.
        model: String,
    },
    /// An actor (a pool or the run supervisor) could not be spawned.
    #[error("could not start an actor: {0}")]
    Spawn(#[from] ractor::SpawnErr),
    /// The store failed at start (registering the node, its epoch, the runs to recover).
    #[error("could not read runs to recover: {0}")]
    Store(#[from] store::Error),
    /// Another live process holds this node id: the id.
    #[error(
        "node id {0:?} is held by another live process (runtime.node_id must be unique per process)"
    )]
    NodeIdInUse(String),
}

fn is_terminal_kind(kind: &str) -> bool {
    matches!(kind, "run_succeeded" | "run_failed" | "run_cancelled")
}

impl Runtime {
    /// Builds the actor tree and adopts every non-terminal run in the store.
    pub async fn start(config: RuntimeConfig, parts: RuntimeParts) -> Result<Runtime, StartError> {
        let registry = Arc::new(parts.registry);
        let mut agents = HashMap::new();
        for spec in parts.agents {
            if !parts.models.contains_key(&spec.model) {
                return Err(StartError::UnknownModel {
                    agent: spec.name.clone(),
                    model: spec.model.clone(),
                });
            }
            let agent = Agent::new(spec, &registry)?;
            agents.insert(agent.spec.name.clone(), Arc::new(agent));
        }
        let model_names: Vec<String> = parts.models.keys().cloned().collect();
        let (gateway, gateway_join) =
            ModelGateway::start(config.gateway, parts.models, config.model_limits.clone()).await?;
        let redactor = parts.redactor.unwrap_or_else(|| Arc::new(Redactor::none()));
        let (tools, tools_join) = ToolExecutor::start(
            config.tool_pool,
            config.per_tool_rps.clone(),
            redactor.clone(),
        )
        .await?;
        let names = crate::metrics::LabelNames {
            models: model_names,
            tools: registry.names().map(str::to_owned).collect(),
            tenants: config.telemetry.tenant_labels.clone(),
        };
        let metrics = Arc::new(Metrics::new(
            &names,
            crate::telemetry::Tracer::start(&config.telemetry, &config.node_id),
        ));
        let deps = Arc::new(RunDeps {
            store: parts.store,
            hub: Arc::new(Hub::new()),
            gateway,
            tools,
            agents,
            policy: config.policy,
            node_id: config.node_id.clone(),
            lease_ttl: config.lease_ttl,
            faults: parts.faults,
            metrics,
            passivate_after: config.passivate_after,
            commit_window: config.commit_window,
            active: DashMap::new(),
            redactor,
            leases: ownership::LeaseBook::default(),
            mismatched: DashMap::new(),
            callbacks: config.callbacks.clone(),
        });
        let instance = ownership::instance_id();
        let store = &deps.store;
        let (node, ttl) = (&config.node_id, config.lease_ttl);
        match store.register_node(node, &instance, ttl).await {
            Ok(()) => {}
            Err(store::Error::NodeIdInUse { holder, .. }) if ownership::holder_is_dead(&holder) => {
                // Its previous process on this host was killed before it could unregister.
                tracing::info!(%node, %holder, "taking over the node id of a process that no longer runs");
                store.unregister_node(node, &holder).await?;
                store
                    .register_node(node, &instance, ttl)
                    .await
                    .map_err(|e| match e {
                        store::Error::NodeIdInUse { .. } => StartError::NodeIdInUse(node.clone()),
                        e => e.into(),
                    })?;
            }
            Err(store::Error::NodeIdInUse { .. }) => {
                return Err(StartError::NodeIdInUse(node.clone()));
            }
            Err(e) => return Err(e.into()),
        }
        tracing::info!(node = %config.node_id, "node registered");
        let (supervisor, sup_join) = Actor::spawn(
            None,
            RunSupervisor,
            SupervisorArgs {
                deps: deps.clone(),
                restart: config.restart,
            },
        )
        .await?;
        let store_epoch = deps.store.epoch().await?;
        let ownership = ownership::start(
            deps.clone(),
            supervisor.clone(),
            instance,
            config.max_live_runs,
        );
        let inner = Arc::new(Inner {
            deps,
            supervisor,
            config,
            store_epoch,
            store_reset: std::sync::Mutex::new(None),
            quarantined: std::sync::Mutex::new(std::collections::BTreeMap::new()),
            ownership,
        });
        let handle = RuntimeHandle { inner };
        handle.recover().await?;
        Ok(Runtime {
            handle,
            joins: vec![sup_join, gateway_join, tools_join],
        })
    }

    /// A handle to start, observe and control runs (cheap to clone).
    pub fn handle(&self) -> RuntimeHandle {
        self.handle.clone()
    }

    /// Stops every run actor (runs stay as checkpointed and continue on the next start), then
    /// the pools. Bounded by `grace`.
    /// Leases are released, due at once, so other nodes continue these runs without waiting
    /// for them to lapse.
    pub async fn shutdown(self, grace: Duration) {
        let inner = &self.handle.inner;
        inner.ownership.stop.cancel();
        let held = inner.deps.leases.snapshot();
        let _ = inner
            .supervisor
            .stop_and_wait(Some("shutdown".into()), Some(grace))
            .await;
        let store = &inner.deps.store;
        if !held.is_empty() {
            match tokio::time::timeout(grace, store.release_many(&held, Some(now_ms()))).await {
                Ok(Ok(())) => tracing::info!(runs = held.len(), "released this node's runs"),
                Ok(Err(e)) => {
                    tracing::warn!(runs = held.len(), error = %e, "could not release leases; they lapse after lease_ttl")
                }
                Err(_) => tracing::warn!(
                    runs = held.len(),
                    "releasing leases timed out; they lapse after lease_ttl"
                ),
            }
        }
        let node = &inner.deps.node_id;
        if let Err(e) = store.unregister_node(node, &inner.ownership.instance).await {
            tracing::debug!(%node, error = %e, "could not unregister the node; its registration lapses");
        }
        inner.deps.gateway.stop();
        inner.deps.tools.stop();
        for j in self.joins {
            let _ = tokio::time::timeout(grace, j).await;
        }
        inner.deps.metrics.traces.shutdown(grace).await;
    }
}

impl RuntimeHandle {
    /// Adopts every unfinished run: a running one resumes (its in-flight work re-issued by
    /// policy); a waiting one just comes back waiting, timers re-armed, and is passivated again.
    async fn recover(&self) -> Result<(), store::Error> {
        let ids = self.inner.deps.store.active_runs().await?;
        if !ids.is_empty() {
            tracing::info!(runs = ids.len(), "recovering runs that were not finished");
        }
        // The per-tenant count only matters under a limit; without one, start-up does not read
        // every checkpoint twice (the run's actor reads it anyway).
        let counted = self.inner.config.max_active_runs_per_tenant.is_some();
        for id in ids {
            if counted {
                // An unreadable checkpoint is quarantined, not a reason to refuse to start.
                match self.inner.deps.store.load(&id).await {
                    Ok(Some(cp)) => match state_of(&cp) {
                        Ok(_) => {
                            self.count_active(&cp.tenant, 1);
                        }
                        Err(e) => {
                            self.quarantine(&id, format!("its checkpoint does not decode: {e}"));
                            continue;
                        }
                    },
                    Ok(None) => {}
                    Err(store::Error::Corrupt(e)) => {
                        self.quarantine(&id, e);
                        continue;
                    }
                    Err(e) => return Err(e),
                }
            }
            let _ = self.inner.supervisor.cast(SupervisorMsg::Start {
                id,
                boot: Boot::Rehydrate,
            });
        }
        Ok(())
    }

    fn count_active(&self, tenant: &str, delta: i64) -> i64 {
        self.inner
            .deps
            .active
            .entry(tenant.to_owned())
            .or_insert_with(|| AtomicI64::new(0))
            .fetch_add(delta, Ordering::SeqCst)
            + delta
    }

    /// Starts a run. Returns the run and whether it was created now (`false`: the client key
    /// was seen before, and this is that run).
    pub async fn create_run(&self, req: NewRun) -> Result<(RunState, bool), Error> {
        self.create_run_as(req, None).await
    }

    /// `create_run`, under `id` when given (one a client key already maps to).
    async fn create_run_as(
        &self,
        req: NewRun,
        id: Option<RunId>,
    ) -> Result<(RunState, bool), Error> {
        let inner = &self.inner;
        let Some(agent) = inner.deps.agents.get(&req.agent) else {
            return Err(Error::UnknownAgent(req.agent));
        };
        let input_text = match &req.input {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        if input_text.len() > inner.config.max_input_bytes {
            return Err(Error::InvalidArgument(format!(
                "input is {} bytes; the limit is {}",
                input_text.len(),
                inner.config.max_input_bytes
            )));
        }
        let limit = inner.config.max_active_runs_per_tenant;
        let now = now_ms();
        let d = &agent.spec.budget;
        let b = &req.budget;
        let deadline = b.deadline.or(agent.spec.deadline);
        let budget = Budget {
            max_turns: b.max_turns.unwrap_or(d.max_turns),
            max_tool_calls: b.max_tool_calls.unwrap_or(d.max_tool_calls),
            max_tokens: b.max_tokens.unwrap_or(d.max_tokens),
            deadline_ms: deadline.map(|d| now + d.as_millis() as u64),
        };
        let mut run = RunState::new(
            id.unwrap_or_else(RunId::generate),
            req.tenant.clone(),
            req.agent.clone(),
            req.input.clone(),
            budget,
            now,
        );
        run.metadata = req.metadata.clone();
        run.agent_digest = Some(agent.digest.clone());
        run.scopes = req.scopes.clone();
        run.messages.push(Message::User {
            content: input_text,
        });
        let checkpoint =
            checkpoint_of(&mut run).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let mut data = serde_json::json!({
            "agent": run.agent, "input": run.input, "budget": run.budget, "status": "created", "phase": null,
        });
        inner.deps.redactor.redact_value_in_place(&mut data);
        let created = EventRecord {
            seq: 1,
            at_ms: now,
            kind: "run_created".into(),
            data,
        };
        if let Some(limit) = limit {
            let n = self.count_active(&req.tenant, 1);
            if n > limit as i64 {
                self.count_active(&req.tenant, -1);
                return Err(Error::TooManyActiveRuns(limit));
            }
        } else {
            self.count_active(&req.tenant, 1);
        }
        // With room for its actor here, the create also takes the run's lease: this node
        // owns the new run from its first write (one write instead of two).
        let deps = &inner.deps;
        let has_room =
            (deps.metrics.live_runs.load(Ordering::Relaxed) as usize) < inner.config.max_live_runs;
        let claimed_at = now_ms();
        let events = std::slice::from_ref(&created);
        let key = req.client_key.as_deref();
        let outcome = if has_room {
            deps.store
                .create_claimed(&checkpoint, events, key, &deps.node_id, deps.lease_ttl)
                .await
        } else {
            deps.store
                .create(&checkpoint, events, key)
                .await
                .map(|o| (o, None))
        };
        match outcome {
            Ok((CreateOutcome::Created, lease)) => {
                inner.deps.metrics.entered_by(&req.tenant, Status::Created);
                let created = CreatedRun {
                    checkpoint,
                    lease: lease.map(|l| (l, claimed_at)),
                };
                self.start_new(&run.id, Some(created)).await?;
                Ok((run, true))
            }
            Ok((CreateOutcome::Existing(id), _)) => {
                self.count_active(&req.tenant, -1);
                let existing = match self.get_run(&req.tenant, &id).await {
                    Err(Error::NotFound) if id != run.id => {
                        // The key was taken by a create that stopped before storing its run
                        // (a crash between the two writes): store this one under that id.
                        return Box::pin(self.create_run_as(req, Some(id))).await;
                    }
                    other => other?,
                };
                if existing.status == Status::Created {
                    // Stored but never started (its first node died in between): start it. If
                    // it is starting elsewhere, the lease decides and this is a no-op.
                    self.start_new(&existing.id, None).await?;
                }
                Ok((existing, false))
            }
            Err(e) => {
                self.count_active(&req.tenant, -1);
                Err(e.into())
            }
        }
    }

    /// Starts a new run here, or — when this node has no room — leaves it due for any node.
    /// `created`: what this node's create just stored (so the actor need not read it back)
    /// and the lease it took (then the run starts here: this node owns it).
    async fn start_new(&self, id: &RunId, created: Option<CreatedRun>) -> Result<(), Error> {
        let inner = &self.inner;
        let live = inner.deps.metrics.live_runs.load(Ordering::Relaxed) as usize;
        let owned = created.as_ref().is_some_and(|c| c.lease.is_some());
        if live >= inner.config.max_live_runs && !owned {
            tracing::debug!(run = %id, live, "no room on this node; the run waits for any node with room");
            inner.deps.store.set_due(id, Some(now_ms())).await?;
            return Ok(());
        }
        let msg = match created {
            Some(created) => SupervisorMsg::StartCreated {
                id: id.clone(),
                created: Box::new(created),
            },
            None => SupervisorMsg::Start {
                id: id.clone(),
                boot: Boot::Start,
            },
        };
        inner.supervisor.cast(msg).map_err(|_| Error::ShuttingDown)
    }

    /// The run as last committed, if it belongs to `tenant`.
    pub async fn get_run(&self, tenant: &str, id: &RunId) -> Result<RunState, Error> {
        let cp = self
            .inner
            .deps
            .store
            .load(id)
            .await?
            .filter(|cp| cp.tenant == tenant)
            .ok_or(Error::NotFound)?;
        state_of(&cp).map_err(|e| Error::Store(store::Error::Corrupt(e.to_string())))
    }

    /// A page of the run's transcript as stored (what the model was given), read from its
    /// checkpoint: the messages at positions `after + 1 ..` (positions count from 1), at most
    /// `limit`, each with its position, and the `after` of the next page if there is one.
    pub async fn messages(
        &self,
        tenant: &str,
        id: &RunId,
        after: u64,
        limit: usize,
    ) -> Result<(Vec<(u64, Message)>, Option<u64>), Error> {
        let mut run = self.get_run(tenant, id).await?;
        let total = run.messages.len();
        let start = usize::try_from(after).unwrap_or(usize::MAX).min(total);
        let end = start.saturating_add(limit).min(total);
        let page = run
            .messages
            .drain(start..end)
            .enumerate()
            .map(|(i, m)| ((start + i + 1) as u64, m))
            .collect();
        Ok((page, (end < total).then_some(end as u64)))
    }

    /// The tenant's runs, newest first.
    pub async fn list_runs(
        &self,
        tenant: &str,
        filter: &RunFilter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<(Vec<RunState>, Option<String>), Error> {
        let page = self
            .inner
            .deps
            .store
            .list_runs(tenant, filter, cursor, limit)
            .await?;
        // A run whose record or checkpoint does not decode is quarantined and left out; the
        // rest of the page is served.
        for (id, reason) in &page.unreadable {
            self.quarantine(id, format!("its stored record does not decode: {reason}"));
        }
        let runs = page
            .items
            .iter()
            // A listing shows no messages: the transcript is not read.
            .filter_map(
                |cp| match crate::run::format::decode_without_transcript(&cp.body) {
                    Ok(run) => Some(run),
                    Err(e) => {
                        self.quarantine(&cp.run_id, format!("its checkpoint does not decode: {e}"));
                        None
                    }
                },
            )
            .collect();
        Ok((runs, page.next_cursor))
    }

    /// Records a run whose stored record cannot be read: logged and counted once, reported by
    /// [`RuntimeHandle::quarantined`] (and so by `/readyz`).
    fn quarantine(&self, id: &RunId, reason: String) {
        let mut q = self
            .inner
            .quarantined
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if q.contains_key(id) {
            return;
        }
        tracing::error!(run_id = %id, %reason, "quarantined a run whose record cannot be read; every other run is served");
        self.inner
            .deps
            .metrics
            .runs_quarantined
            .fetch_add(1, Ordering::Relaxed);
        q.insert(id.clone(), reason);
    }

    /// Runs quarantined since start, with why (bounded by what the store holds).
    pub fn quarantined(&self) -> Vec<(RunId, String)> {
        self.inner
            .quarantined
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|(id, why)| (id.clone(), why.clone()))
            .collect()
    }

    /// Every call of the tenant's runs that waits for an operator (the approvals inbox), oldest
    /// first by the time it began waiting. Reads at most [`MAX_INBOX_RUNS`] runs in
    /// `waiting_approval` (newest first from the store, so a longer backlog shows its newest
    /// part); `truncated` says when more were left out.
    pub async fn awaiting_calls(&self, tenant: &str) -> Result<AwaitingCalls, Error> {
        const PAGE: usize = 200;
        let filter = RunFilter {
            status: Some(Status::WaitingApproval.as_str().to_owned()),
            agent: None,
        };
        let mut out = AwaitingCalls::default();
        let mut cursor: Option<String> = None;
        let mut scanned = 0;
        loop {
            let (runs, next) = self
                .list_runs(tenant, &filter, cursor.as_deref(), PAGE)
                .await?;
            for run in &runs {
                let agent = self.inner.deps.agents.get(&run.agent);
                for c in run.pending_approvals() {
                    let requested_at_ms = c.awaiting_since_ms.unwrap_or(run.updated_at_ms);
                    let timeout = agent
                        .and_then(|a| a.tools.tool(&c.tool))
                        .and_then(|t| t.spec().approval_timeout)
                        .filter(|_| c.status == crate::run::CallStatus::AwaitingApproval);
                    out.calls.push(AwaitingCall {
                        run_id: run.id.clone(),
                        agent: run.agent.clone(),
                        call_id: c.call_id.clone(),
                        tool: c.tool.clone(),
                        arguments: c.arguments.clone(),
                        reason: AwaitingReason::of(c),
                        requested_at_ms,
                        expires_at_ms: timeout
                            .map(|t| requested_at_ms.saturating_add(t.as_millis() as u64)),
                    });
                }
            }
            scanned += runs.len();
            match next {
                Some(n) if scanned < MAX_INBOX_RUNS => cursor = Some(n),
                Some(_) => {
                    out.truncated = true;
                    break;
                }
                None => break,
            }
        }
        out.calls.sort_by(|a, b| {
            (a.requested_at_ms, &a.run_id, &a.call_id).cmp(&(
                b.requested_at_ms,
                &b.run_id,
                &b.call_id,
            ))
        });
        Ok(out)
    }

    /// Stored events with seq > `after`.
    pub async fn events(
        &self,
        tenant: &str,
        id: &RunId,
        after: u64,
        limit: usize,
    ) -> Result<Vec<EventRecord>, Error> {
        self.get_run(tenant, id).await?;
        Ok(self.inner.deps.store.read(id, after, limit).await?)
    }

    /// Every event with seq > `after`, stored then live, each exactly once and in order; the
    /// stream ends after the terminal event (or when the receiver is dropped).
    pub async fn follow(
        &self,
        tenant: &str,
        id: &RunId,
        after: u64,
    ) -> Result<ReceiverStream<Result<EventRecord, Error>>, Error> {
        self.get_run(tenant, id).await?;
        Ok(follow::stream(self.inner.deps.clone(), id.clone(), after))
    }

    /// Waits until the run satisfies `done` (checked after every event), or `timeout`. A run
    /// that ends without satisfying it is `InvalidState` with its final status, at once: the
    /// events followed end with the run (a late tool result recorded after the end is seen
    /// in `events`, not here).
    pub async fn wait_until(
        &self,
        tenant: &str,
        id: &RunId,
        timeout: Duration,
        done: impl Fn(&RunState) -> bool,
    ) -> Result<RunState, Error> {
        use futures::StreamExt;
        let run = self.get_run(tenant, id).await?;
        if done(&run) {
            return Ok(run);
        }
        let mut events = self.follow(tenant, id, run.version).await?;
        let waited = tokio::time::timeout(timeout, async {
            while let Some(e) = events.next().await {
                e?;
                let run = self.get_run(tenant, id).await?;
                if done(&run) {
                    return Ok(run);
                }
            }
            let run = self.get_run(tenant, id).await?;
            if done(&run) {
                Ok(run)
            } else if run.is_terminal() {
                Err(Error::InvalidState {
                    status: run.status,
                    message: "the run ended without reaching the awaited state".into(),
                })
            } else {
                Err(Error::Timeout)
            }
        })
        .await;
        waited.unwrap_or(Err(Error::Timeout))
    }

    /// Waits for a terminal status.
    pub async fn wait_terminal(
        &self,
        tenant: &str,
        id: &RunId,
        timeout: Duration,
    ) -> Result<RunState, Error> {
        self.wait_until(tenant, id, timeout, RunState::is_terminal)
            .await
    }

    /// Stores the control in the run's inbox, wakes the run, and answers with what happened to
    /// that control: applied (the state after it), refused (why), or — when the run could not
    /// answer within `control_timeout` — stored, to be applied in inbox order.
    /// A run's inbox holds at most `MAX_PENDING_CONTROLS` entries not yet applied (concurrent
    /// requests may pass the check together, so the bound is this plus their number).
    async fn control(&self, run: &RunState, control: Control) -> Result<RunState, Error> {
        let inner = &self.inner;
        let (tenant, id) = (run.tenant.as_str(), &run.id);
        let pending = inner.deps.store.controls(id, run.controls_applied).await?;
        if pending.len() >= MAX_PENDING_CONTROLS {
            return Err(Error::InboxFull(pending.len()));
        }
        let seq = inner.deps.store.push_control(id, &control).await?;
        let deadline = tokio::time::Instant::now() + inner.config.control_timeout;
        let sent = inner
            .supervisor
            .call(
                |reply| SupervisorMsg::Control {
                    id: id.clone(),
                    seq,
                    reply,
                },
                Some(inner.config.control_timeout),
            )
            .await;
        match sent {
            Ok(CallResult::Success(Ok(run))) => Ok(run),
            Ok(CallResult::Success(Err(e))) => Err(e.into()),
            // Stored durably, and the run is not live here (another node owns it and was
            // woken) or did not answer in time: answer with what the store says happened.
            Ok(CallResult::Timeout) | Ok(CallResult::SenderError) => {
                self.stored_outcome(tenant, id, seq, deadline).await
            }
            Err(_) => Err(Error::ShuttingDown),
        }
    }

    /// Reads the run until the control at `seq` is consumed (or the run ended), or `deadline`:
    /// then it is stored, and will be applied in inbox order by whichever node owns the run.
    async fn stored_outcome(
        &self,
        tenant: &str,
        id: &RunId,
        seq: u64,
        deadline: tokio::time::Instant,
    ) -> Result<RunState, Error> {
        let mut wait = Duration::from_millis(5);
        loop {
            let run = self.get_run(tenant, id).await?;
            if run.controls_applied >= seq
                || run.is_terminal()
                || tokio::time::Instant::now() + wait > deadline
            {
                return control_outcome(run, seq);
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_millis(100));
        }
    }

    /// Cancels the run. Cancelling a cancelled run answers the same; cancelling one that
    /// ended otherwise is `InvalidState`.
    pub async fn cancel(
        &self,
        tenant: &str,
        id: &RunId,
        reason: Option<String>,
    ) -> Result<RunState, Error> {
        let run = self.get_run(tenant, id).await?;
        match run.status {
            Status::Cancelled => return Ok(run),
            s if s.is_terminal() => {
                return Err(Error::InvalidState {
                    status: s,
                    message: "the run has already ended".into(),
                });
            }
            _ => {}
        }
        self.control(&run, Control::Cancel { reason }).await
    }

    /// Approves (optionally with edited arguments) or rejects one pending call, once. Repeating
    /// the same decision answers the same; the opposite decision is a conflict. `by` (the
    /// deciding token's configured name) goes into the decision's event.
    #[allow(clippy::too_many_arguments)]
    pub async fn decide(
        &self,
        tenant: &str,
        id: &RunId,
        call_id: &CallId,
        approve: bool,
        arguments: Option<Value>,
        reason: Option<String>,
        by: Option<String>,
    ) -> Result<RunState, Error> {
        let run = self.get_run(tenant, id).await?;
        if let Some((_, approved)) = run.decided.iter().find(|(c, _)| c == call_id) {
            return if *approved == approve {
                Ok(run)
            } else {
                Err(Error::InvalidState {
                    status: run.status,
                    message: format!(
                        "call {call_id} was already {}",
                        if *approved { "approved" } else { "rejected" }
                    ),
                })
            };
        }
        if run.is_terminal() {
            return Err(Error::InvalidState {
                status: run.status,
                message: "the run has already ended".into(),
            });
        }
        let Some(call) = run.call(call_id) else {
            return Err(Error::UnknownCall(format!("no call {call_id} in this run")));
        };
        if !matches!(
            call.status,
            crate::run::CallStatus::AwaitingApproval | crate::run::CallStatus::OutcomeUnknown
        ) {
            return Err(Error::InvalidState {
                status: run.status,
                message: format!("call {call_id} is not awaiting approval"),
            });
        }
        let control = if approve {
            Control::Approve {
                call_id: call_id.clone(),
                arguments,
                by,
            }
        } else {
            Control::Reject {
                call_id: call_id.clone(),
                reason,
                by,
            }
        };
        self.control(&run, control).await
    }

    /// Whether `token` is the callback token of `call_id` in run `id` (constant time; false
    /// when this runtime offers no callback route).
    pub fn verify_callback(&self, id: &RunId, call_id: &CallId, token: &str) -> bool {
        self.inner
            .deps
            .callbacks
            .as_ref()
            .is_some_and(|c| c.verify(id, call_id, token))
    }

    /// A long-running tool's result for one call, through the callback route (the caller
    /// checked the call's token with [`Self::verify_callback`]). Stored in the run's inbox, so
    /// it reaches the run on whichever node owns it, and wakes a passivated run. The first
    /// result wins; a call that already has one, or a run that ended, is `InvalidState`.
    pub async fn complete_call(
        &self,
        id: &RunId,
        call_id: &CallId,
        result: ToolResult,
    ) -> Result<RunState, Error> {
        let cp = self
            .inner
            .deps
            .store
            .load(id)
            .await?
            .ok_or(Error::NotFound)?;
        let run = state_of(&cp).map_err(|e| Error::Store(store::Error::Corrupt(e.to_string())))?;
        if run.is_terminal() {
            return Err(Error::InvalidState {
                status: run.status,
                message: "the run has already ended; the result is not used".into(),
            });
        }
        let Some(call) = run.call(call_id).filter(|c| {
            matches!(
                c.status,
                crate::run::CallStatus::Dispatched | crate::run::CallStatus::AwaitingResult
            )
        }) else {
            return Err(Error::InvalidState {
                status: run.status,
                message: format!("call {call_id} already has its result"),
            });
        };
        // Like any tool result: redacted whole, then cut to the tool's output cap.
        let max_bytes = self
            .inner
            .deps
            .agents
            .get(&run.agent)
            .and_then(|a| a.tools.tool(&call.tool))
            .map_or(64 * 1024, |t| t.spec().max_output_bytes);
        let result = result.sanitized(&self.inner.deps.redactor, max_bytes);
        let control = Control::CallResult {
            call_id: call_id.clone(),
            result,
        };
        self.control(&run, control).await
    }

    /// An operator's decision `fail` on one call waiting for a decision: the run ends `failed`,
    /// with a code saying why the call waited (`tool_failing`, `permission_denied`,
    /// `outcome_unknown`, `approval_denied`). Repeating it answers the same; after an approve
    /// or reject of the call it is a conflict.
    pub async fn fail_call(
        &self,
        tenant: &str,
        id: &RunId,
        call_id: &CallId,
        reason: Option<String>,
        by: Option<String>,
    ) -> Result<RunState, Error> {
        let run = self.get_run(tenant, id).await?;
        if run.failed_call.as_ref() == Some(call_id) {
            return Ok(run);
        }
        if let Some((_, approved)) = run.decided.iter().find(|(c, _)| c == call_id) {
            return Err(Error::InvalidState {
                status: run.status,
                message: format!(
                    "call {call_id} was already {}",
                    if *approved { "approved" } else { "rejected" }
                ),
            });
        }
        if run.is_terminal() {
            return Err(Error::InvalidState {
                status: run.status,
                message: "the run has already ended".into(),
            });
        }
        let Some(call) = run.call(call_id) else {
            return Err(Error::UnknownCall(format!("no call {call_id} in this run")));
        };
        if !matches!(
            call.status,
            crate::run::CallStatus::AwaitingApproval | crate::run::CallStatus::OutcomeUnknown
        ) {
            return Err(Error::InvalidState {
                status: run.status,
                message: format!("call {call_id} is not awaiting approval"),
            });
        }
        let control = Control::Fail {
            call_id: call_id.clone(),
            reason,
            by,
        };
        self.control(&run, control).await
    }

    /// Answers a run waiting for input, or queues the text for a running run's next turn.
    pub async fn input(&self, tenant: &str, id: &RunId, text: String) -> Result<RunState, Error> {
        let run = self.get_run(tenant, id).await?;
        if run.is_terminal() {
            return Err(Error::InvalidState {
                status: run.status,
                message: "the run has already ended".into(),
            });
        }
        self.control(&run, Control::Input { text }).await
    }

    /// The configured agents.
    pub fn agents(&self) -> Vec<AgentInfo> {
        let mut list: Vec<AgentInfo> = self
            .inner
            .deps
            .agents
            .values()
            .map(|a| AgentInfo {
                name: a.spec.name.clone(),
                model: a.spec.model.clone(),
                tools: a.definitions.to_vec(),
            })
            .collect();
        list.sort_by(|a, b| a.name.cmp(&b.name));
        list
    }

    /// Whether the store answers and still holds the data this runtime started with.
    pub async fn ready(&self) -> Result<(), Error> {
        self.inner.deps.store.ping().await?;
        self.check_store_epoch().await
    }

    /// Compares the store's epoch marker with the one seen at start. A change means the store
    /// lost its data: runs it held are gone, and the ones still live here cannot commit (their
    /// checkpoints are missing), so they stop instead of starting over. Readiness stays failed
    /// until an operator restarts the daemon.
    pub async fn check_store_epoch(&self) -> Result<(), Error> {
        let inner = &self.inner;
        let was = inner.store_epoch.clone();
        if let Ok(guard) = inner.store_reset.lock()
            && let Some(now) = guard.clone()
        {
            return Err(Error::StoreReset { was, now });
        }
        let now = inner.deps.store.epoch().await?;
        if now != was {
            tracing::error!(was = %was, now = %now, "the store's epoch marker changed: it lost its data");
            inner
                .deps
                .metrics
                .store_resets
                .fetch_add(1, Ordering::Relaxed);
            if let Ok(mut guard) = inner.store_reset.lock() {
                *guard = Some(now.clone());
            }
            return Err(Error::StoreReset { was, now });
        }
        Ok(())
    }

    /// Runs with a live (or restarting) actor.
    pub async fn live_runs(&self) -> usize {
        match self
            .inner
            .supervisor
            .call(SupervisorMsg::Count, Some(Duration::from_secs(5)))
            .await
        {
            Ok(CallResult::Success(n)) => n,
            _ => 0,
        }
    }

    /// The runtime's metrics, shared with `/metrics` and telemetry.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.deps.metrics
    }

    /// The redactor applied to events; the API applies it to what it shows of a run.
    pub fn redactor(&self) -> &Arc<Redactor> {
        &self.inner.deps.redactor
    }

    /// Prometheus text of the runtime and its pools.
    pub fn render_metrics(&self) -> String {
        use std::fmt::Write as _;
        let deps = &self.inner.deps;
        let mut out = String::new();
        deps.metrics.render(&mut out);
        // Each family once, with HELP and TYPE, its samples together (the text format's rule).
        let pools = [
            ("model", deps.gateway.pool().stats()),
            ("tool", deps.tools.pool().stats()),
        ];
        type PoolValue = fn(&crate::pool::PoolStats) -> u64;
        let families: [(&str, &str, &str, PoolValue); 3] = [
            (
                "agentd_pool_queue_depth",
                "gauge",
                "Jobs waiting for a worker of the pool.",
                |s| s.queue_depth(),
            ),
            (
                "agentd_pool_in_flight",
                "gauge",
                "Jobs a worker of the pool is running.",
                |s| s.in_flight(),
            ),
            (
                "agentd_pool_shed_total",
                "counter",
                "Jobs refused because the pool's queue was full (overloaded).",
                |s| s.shed.load(Ordering::Relaxed),
            ),
        ];
        for (name, kind, help, value) in families {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (pool, stats) in &pools {
                let _ = writeln!(out, "{name}{{pool=\"{pool}\"}} {}", value(stats));
            }
        }
        let g = deps.gateway.stats();
        for (name, kind, help, value) in [
            (
                "agentd_model_requests_total",
                "counter",
                "Model requests (one per turn), whatever their number of attempts.",
                g.requests.load(Ordering::Relaxed) as f64,
            ),
            (
                "agentd_model_attempts_total",
                "counter",
                "Model attempts sent to providers, retries included.",
                g.attempts.load(Ordering::Relaxed) as f64,
            ),
            (
                "agentd_model_retries_total",
                "counter",
                "Model attempts retried by the gateway (429, 5xx, timeouts).",
                g.retries.load(Ordering::Relaxed) as f64,
            ),
            (
                "agentd_model_rate_limit_wait_seconds_total",
                "counter",
                "Time model requests waited for the per-model rate limits.",
                g.rate_limit_wait_us.load(Ordering::Relaxed) as f64 / 1e6,
            ),
            (
                "agentd_model_tenant_queued",
                "gauge",
                "Model requests queued in the gateway's per-tenant queues.",
                g.queued.load(Ordering::Relaxed) as f64,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        }
        out
    }
}
