//! `RunActor`: one ractor actor per live run. It owns the run's state, feeds every input through
//! the pure `step`, commits the new checkpoint and its one event before anything else, then
//! carries out the effects.
//!
//! It never awaits a model or tool call in a handler: requests go to the shared pools with the
//! actor's address and the run's epoch, and replies come back as messages, so cancel, approve
//! and input are handled while a slow call is in flight. The only awaits are store writes.
//!
//! Secrets: every event's data passes the runtime's redactor before it is committed, and so
//! does every tool result before it enters the run (so configured secrets never reach the
//! checkpoint, the model or the event log). A call waiting for approval whose tool has an
//! `approval_timeout` gets a timer that delivers `RunEvent::ApprovalExpired`.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio_util::sync::CancellationToken;

use crate::agent::Agent;
use crate::clock::now_ms;
use crate::hub::Hub;
use crate::ids::{CallId, RunId};
use crate::metrics::Metrics;
use crate::model::gateway::ModelGateway;
use crate::model::{ModelRequest, ToolChoice};
use crate::redact::Redactor;
use crate::run::machine::{Effect, InvalidTransition, Policy, RunEvent, StepContext, step};
use crate::run::state::RunState;
use crate::run::verify::verify_all;
use crate::store::{self, Checkpoint, Control, EventRecord, Lease, SharedStore};
use crate::tool::executor::{ToolExecutor, ToolOutcome, ToolWork};
use crate::tool::{ToolContext, ToolError, ToolErrorCode, ToolResult};

/// One run's actor.
#[derive(Debug)]
pub struct RunActor;

/// What a run actor handles.
pub enum RunMsg {
    /// A pool reply or a timer.
    Event(RunEvent),
    /// A control message already stored in the run's inbox at `seq`.
    Control {
        seq: u64,
        control: Control,
        reply: Option<RpcReplyPort<ControlReply>>,
    },
    /// The run's current state.
    Get(RpcReplyPort<RunState>),
    /// After a failed commit: read the checkpoint back and continue from it.
    Reload,
    /// The run has been waiting (approval or input) since `version`: if nothing changed, stop
    /// the actor; the run stays in the store and is rehydrated by its next message.
    Passivate { version: u64 },
}

/// The answer to a control message: the state after it, or why it did not apply.
pub type ControlReply = Result<RunState, InvalidTransition>;

/// How the actor begins.
#[derive(Debug, Clone, PartialEq)]
pub enum Boot {
    /// A new run: `Start`.
    Start,
    /// A restart from the checkpoint (crash, or daemon start): `Resume`.
    Recover,
    /// Fail the run from its checkpoint (e.g. `crash_loop`).
    Abort { code: String, message: String },
    /// Bring a passivated run back for a message or a timer: a waiting run continues as it
    /// was (no `Resume`: nothing was in flight); any other run resumes.
    Rehydrate,
}

/// The stop reason of a passivated run: `passivated:<wake_at_ms>` (0 = no timer due), so the
/// supervisor can bring it back when its deadline or an approval expiry falls due.
pub const PASSIVATED: &str = "passivated";

/// Encodes a passivation stop reason.
pub fn passivated_reason(wake_at_ms: Option<u64>) -> String {
    format!("{PASSIVATED}:{}", wake_at_ms.unwrap_or(0))
}

/// Decodes a stop reason: `Some(wake_at)` if the run was passivated.
pub fn parse_passivated(reason: &str) -> Option<Option<u64>> {
    let at = reason
        .strip_prefix(PASSIVATED)?
        .strip_prefix(':')?
        .parse::<u64>()
        .ok()?;
    Some((at > 0).then_some(at))
}

/// Deliberate faults for chaos and supervision tests.
pub trait FaultInjector: Send + Sync + 'static {
    /// Return true to panic in the run's handler just before `event` is applied.
    fn panic_before(&self, run: &RunState, event: &RunEvent) -> bool;
}

/// Everything a run actor needs, shared by all runs.
pub struct RunDeps {
    pub store: SharedStore,
    pub hub: Arc<Hub>,
    pub gateway: ModelGateway,
    pub tools: ToolExecutor,
    pub agents: HashMap<String, Arc<Agent>>,
    pub policy: Policy,
    /// Lease owner name of this runtime instance.
    pub node_id: String,
    pub lease_ttl: Duration,
    pub faults: Option<Arc<dyn FaultInjector>>,
    pub metrics: Arc<Metrics>,
    /// Stop the actor of a run that has waited for approval or input this long (`None`: never).
    pub passivate_after: Option<Duration>,
    /// Non-terminal runs per tenant (for the per-tenant limit); a run leaves it when it ends.
    pub active: dashmap::DashMap<String, std::sync::atomic::AtomicI64>,
    /// Applied to event data before commit and to tool results before they enter the run.
    pub redactor: Arc<Redactor>,
}

/// Start arguments.
pub struct RunArgs {
    pub id: RunId,
    pub boot: Boot,
    pub deps: Arc<RunDeps>,
}

/// The actor's state: empty until `post_start` has loaded the checkpoint.
pub struct RunActorState {
    id: RunId,
    boot: Boot,
    deps: Arc<RunDeps>,
    live: Option<Live>,
}

struct Live {
    run: RunState,
    lease: Lease,
    agent: Arc<Agent>,
    /// Cancels the requests of the current incarnation; replaced after each abort.
    cancel: CancellationToken,
    deadline_timer: Option<tokio::task::AbortHandle>,
    turn_started: Option<Instant>,
    store_failures: u32,
    /// Tool jobs sent and not yet answered. A finished run waits for them (bounded), so their
    /// late results are recorded as ignored instead of vanishing.
    tools_in_flight: u32,
    finishing: bool,
    /// A commit failed, so `run` may differ from the store: messages wait in `held` until the
    /// checkpoint has been read back (`RunMsg::Reload`).
    reloading: bool,
    held: Vec<RunMsg>,
    writer: CheckpointWriter,
    /// Calls whose approval-expiry timer is armed in this incarnation.
    approval_timers: HashSet<CallId>,
}

/// How long a finished run waits for tool results still in flight.
const LATE_RESULT_GRACE: Duration = Duration::from_secs(60);

/// Why a run actor stopped itself or failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("run {0}: checkpoint not found")]
    Missing(RunId),
    #[error("run {run}: checkpoint is unreadable: {message}")]
    Corrupt { run: RunId, message: String },
    #[error("run {run}: {source}")]
    Store { run: RunId, source: store::Error },
}

/// Serializes the run into its stored form.
pub fn checkpoint_of(run: &RunState) -> Result<Checkpoint, serde_json::Error> {
    Ok(checkpoint_with_body(run, serde_json::to_string(run)?))
}

fn checkpoint_with_body(run: &RunState, body: String) -> Checkpoint {
    Checkpoint {
        run_id: run.id.clone(),
        tenant: run.tenant.clone(),
        agent: run.agent.clone(),
        status: run.status.as_str().to_owned(),
        terminal: run.is_terminal(),
        version: run.version,
        created_at_ms: run.created_at_ms,
        updated_at_ms: run.updated_at_ms,
        body,
    }
}

/// Writes checkpoints of one run, serializing each message once: the transcript only grows,
/// so the JSON of messages already written is kept and spliced in. Without this, every step
/// would re-serialize the whole conversation.
#[derive(Debug, Default)]
pub struct CheckpointWriter {
    /// JSON of `messages[..n]`, comma-separated.
    messages_json: String,
    n: usize,
}

impl CheckpointWriter {
    /// Forgets the cache (after the state was replaced by one read back from the store).
    pub fn reset(&mut self) {
        self.messages_json.clear();
        self.n = 0;
    }

    pub fn checkpoint(&mut self, run: &mut RunState) -> Result<Checkpoint, serde_json::Error> {
        if self.n > run.messages.len() {
            self.reset();
        }
        for m in &run.messages[self.n..] {
            if self.n > 0 {
                self.messages_json.push(',');
            }
            serde_json::to_writer(string_writer(&mut self.messages_json), m)?;
            self.n += 1;
        }
        // `messages` is the last field: serialize the rest with it empty, then splice.
        let messages = std::mem::take(&mut run.messages);
        let head = serde_json::to_string(run);
        run.messages = messages;
        let head = head?;
        let Some(prefix) = head.strip_suffix("[]}") else {
            return checkpoint_of(run);
        };
        let mut body = String::with_capacity(prefix.len() + self.messages_json.len() + 2);
        body.push_str(prefix);
        body.push('[');
        body.push_str(&self.messages_json);
        body.push_str("]}");
        Ok(checkpoint_with_body(run, body))
    }
}

/// Adapts a `String` as an `io::Write` sink for serde_json (which only writes valid UTF-8).
fn string_writer(s: &mut String) -> StringWriter<'_> {
    StringWriter(s)
}

struct StringWriter<'a>(&'a mut String);

impl std::io::Write for StringWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = std::str::from_utf8(buf)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        self.0.push_str(text);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Reads the run back from its stored form.
pub fn state_of(cp: &Checkpoint) -> Result<RunState, serde_json::Error> {
    serde_json::from_str(&cp.body)
}

enum Applied {
    Done,
    Rejected(InvalidTransition),
    /// The store could not take the commit; nothing changed. Try again later.
    StoreDown,
    /// Another writer owns the run now: stop.
    LostOwnership,
}

impl Actor for RunActor {
    type Msg = RunMsg;
    type State = RunActorState;
    type Arguments = RunArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<RunMsg>,
        args: RunArgs,
    ) -> Result<RunActorState, ActorProcessingErr> {
        // No I/O here: the supervisor waits for pre_start.
        Ok(RunActorState {
            id: args.id,
            boot: args.boot,
            deps: args.deps,
            live: None,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<RunMsg>,
        st: &mut RunActorState,
    ) -> Result<(), ActorProcessingErr> {
        let deps = st.deps.clone();
        let id = st.id.clone();
        let store_err = |source| Error::Store {
            run: id.clone(),
            source,
        };
        let cp = deps
            .store
            .load(&id)
            .await
            .map_err(store_err)?
            .ok_or_else(|| Error::Missing(id.clone()))?;
        let run = state_of(&cp).map_err(|e| Error::Corrupt {
            run: id.clone(),
            message: e.to_string(),
        })?;
        if run.is_terminal() {
            myself.stop(Some("terminal".into()));
            return Ok(());
        }
        let lease = match deps.store.claim(&id, &deps.node_id, deps.lease_ttl).await {
            Ok(l) => l,
            Err(store::Error::LeaseHeld { owner, .. }) => {
                tracing::info!(run = %id, %owner, "run is owned by another node");
                myself.stop(Some("leased_elsewhere".into()));
                return Ok(());
            }
            Err(e) => return Err(store_err(e).into()),
        };
        let Some(agent) = deps.agents.get(&run.agent).cloned() else {
            // The agent was removed from config: the run cannot continue.
            let mut live = Live::new(run, lease, Arc::new(placeholder_agent()));
            let event = RunEvent::Abort {
                code: "unknown_agent".into(),
                message: "the run's agent is no longer configured".into(),
            };
            deliver(&myself, &deps, &mut live, RunMsg::Event(event)).await?;
            st.live = Some(live);
            return Ok(());
        };
        let mut live = Live::new(run, lease, agent);
        if let Some(deadline) = live.run.budget.deadline_ms {
            let wait = Duration::from_millis(deadline.saturating_sub(now_ms()));
            live.deadline_timer = Some(
                myself
                    .send_after(wait, || RunMsg::Event(RunEvent::DeadlineReached))
                    .abort_handle(),
            );
        }
        let waiting = matches!(
            live.run.status,
            crate::run::state::Status::WaitingApproval | crate::run::state::Status::WaitingInput
        );
        let boot = match std::mem::replace(&mut st.boot, Boot::Recover) {
            Boot::Start => Some(RunEvent::Start),
            Boot::Recover => Some(RunEvent::Resume),
            Boot::Rehydrate if waiting => None,
            Boot::Rehydrate => Some(RunEvent::Resume),
            Boot::Abort { code, message } => Some(RunEvent::Abort { code, message }),
        };
        match boot {
            Some(event) => deliver(&myself, &deps, &mut live, RunMsg::Event(event)).await?,
            None => {
                // Rehydrated while waiting: re-arm its timers and let it passivate again.
                arm_approval_timers(&myself, &mut live, now_ms());
                schedule_passivation(&myself, &deps, &live);
            }
        }
        // Control messages stored but not yet applied (e.g. sent while the run was down).
        if !live.run.is_terminal() {
            let after = live.run.controls_applied;
            let pending = deps.store.controls(&id, after).await.map_err(store_err)?;
            for c in pending {
                if live.run.is_terminal() {
                    break;
                }
                let msg = RunMsg::Control {
                    seq: c.seq,
                    control: c.control,
                    reply: None,
                };
                deliver(&myself, &deps, &mut live, msg).await?;
            }
        }
        st.live = Some(live);
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<RunMsg>,
        msg: RunMsg,
        st: &mut RunActorState,
    ) -> Result<(), ActorProcessingErr> {
        let deps = st.deps.clone();
        let Some(live) = st.live.as_mut() else {
            return Ok(());
        };
        if let RunMsg::Event(RunEvent::ToolFinished { .. } | RunEvent::StatusChecked { .. }) = &msg
        {
            live.tools_in_flight = live.tools_in_flight.saturating_sub(1);
        }
        deliver(&myself, &deps, live, msg).await?;
        if live.finishing && live.tools_in_flight == 0 {
            myself.stop(Some("finished".into()));
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<RunMsg>,
        st: &mut RunActorState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(live) = st.live.take() {
            live.cancel.cancel();
            if let Some(t) = live.deadline_timer {
                t.abort();
            }
            if live.run.is_terminal() {
                // Late results have been recorded (or waited for long enough): let go.
                let store = st.deps.store.clone();
                let lease = live.lease;
                tokio::spawn(async move {
                    if let Err(e) = store.release(&lease).await {
                        tracing::debug!(run = %lease.run_id, error = %e, "lease release failed; it will expire");
                    }
                });
            }
        }
        Ok(())
    }
}

/// An agent with no tools, standing in for one removed from config, so such a run can be
/// failed through the normal path.
fn placeholder_agent() -> Agent {
    let registry = Arc::new(crate::tool::registry::Registry::new());
    let spec = crate::agent::AgentSpec::new("unknown", "none");
    Agent {
        tools: crate::tool::registry::AgentTools::new(registry, Arc::from(Vec::<String>::new())),
        definitions: Vec::new().into(),
        spec,
    }
}

impl Live {
    fn new(run: RunState, lease: Lease, agent: Arc<Agent>) -> Self {
        Live {
            run,
            lease,
            agent,
            cancel: CancellationToken::new(),
            deadline_timer: None,
            turn_started: None,
            store_failures: 0,
            tools_in_flight: 0,
            finishing: false,
            reloading: false,
            held: Vec::new(),
            writer: CheckpointWriter::default(),
            approval_timers: HashSet::new(),
        }
    }
}

/// Handles one message: applies it, holds it while the state is being reloaded, or answers a
/// query. An `Err` is a bug (it fails the actor, and the supervisor restarts the run).
async fn deliver(
    myself: &ActorRef<RunMsg>,
    deps: &Arc<RunDeps>,
    live: &mut Live,
    msg: RunMsg,
) -> Result<(), ActorProcessingErr> {
    if live.reloading && !matches!(msg, RunMsg::Reload | RunMsg::Get(_)) {
        live.held.push(msg);
        return Ok(());
    }
    match msg {
        RunMsg::Get(reply) => {
            let _ = reply.send(live.run.clone());
        }
        RunMsg::Passivate { version } => passivate(myself, live, version),
        RunMsg::Reload => reload(myself, deps, live).await?,
        RunMsg::Event(event) => {
            let copy = event.clone();
            match apply(myself, deps, live, event, None).await? {
                Applied::Done | Applied::LostOwnership => {}
                Applied::Rejected(e) => {
                    tracing::debug!(run = %live.run.id, error = %e, "event did not apply");
                }
                Applied::StoreDown => hold(myself, deps, live, RunMsg::Event(copy)),
            }
        }
        RunMsg::Control {
            seq,
            control,
            reply,
        } => {
            if seq <= live.run.controls_applied {
                // Already applied (read from the inbox at start): the same outcome again.
                if let Some(r) = reply {
                    let _ = r.send(Ok(live.run.clone()));
                }
                return Ok(());
            }
            let event = RunEvent::from(control.clone());
            match apply(myself, deps, live, event, Some(seq)).await? {
                Applied::Done => {
                    if let Some(r) = reply {
                        let _ = r.send(Ok(live.run.clone()));
                    }
                }
                Applied::Rejected(e) => {
                    // Consumed: not re-applied after a restart (persisted with the next commit).
                    live.run.controls_applied = live.run.controls_applied.max(seq);
                    if let Some(r) = reply {
                        let _ = r.send(Err(e));
                    }
                }
                Applied::StoreDown => {
                    let msg = RunMsg::Control {
                        seq,
                        control,
                        reply,
                    };
                    hold(myself, deps, live, msg);
                }
                Applied::LostOwnership => {}
            }
        }
    }
    Ok(())
}

/// After a transition that leaves the run waiting for an operator, schedules its passivation.
fn schedule_passivation(myself: &ActorRef<RunMsg>, deps: &RunDeps, live: &Live) {
    let Some(after) = deps.passivate_after else {
        return;
    };
    if is_idle_waiting(live) {
        let version = live.run.version;
        myself.send_after(after, move || RunMsg::Passivate { version });
    }
}

fn is_idle_waiting(live: &Live) -> bool {
    matches!(
        live.run.status,
        crate::run::state::Status::WaitingApproval | crate::run::state::Status::WaitingInput
    ) && live.tools_in_flight == 0
        && !live.reloading
        && !live.finishing
}

/// Stops the actor of a run that is still waiting, unchanged since `version`. Its checkpoint
/// holds everything; the supervisor wakes it for its next control message, or when its
/// deadline or an approval expiry falls due.
fn passivate(myself: &ActorRef<RunMsg>, live: &Live, version: u64) {
    if live.run.version != version || !is_idle_waiting(live) {
        return;
    }
    let approval_due = live
        .run
        .calls
        .iter()
        .filter(|c| c.status == crate::run::state::CallStatus::AwaitingApproval)
        .filter_map(|c| {
            let after = live.agent.tools.tool(&c.tool)?.spec().approval_timeout?;
            Some(
                c.awaiting_since_ms?
                    .saturating_add(after.as_millis() as u64),
            )
        })
        .min();
    let wake_at = match (live.run.budget.deadline_ms, approval_due) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    tracing::debug!(run = %live.run.id, ?wake_at, "passivating a waiting run");
    myself.stop(Some(passivated_reason(wake_at)));
}

/// A commit failed: keep `msg`, stop taking new work, and read the checkpoint back later.
fn hold(myself: &ActorRef<RunMsg>, deps: &RunDeps, live: &mut Live, msg: RunMsg) {
    live.held.push(msg);
    if !live.reloading {
        live.reloading = true;
        // Requests in flight were issued by a state that may not have been stored.
        live.cancel.cancel();
        live.cancel = CancellationToken::new();
        let after = store_backoff(deps, live);
        myself.send_after(after, || RunMsg::Reload);
    }
}

/// Reads the checkpoint back after a failed commit (which may or may not have landed), resumes
/// from it — re-issuing in-flight work by each tool's policy — then replays the held messages.
async fn reload(
    myself: &ActorRef<RunMsg>,
    deps: &Arc<RunDeps>,
    live: &mut Live,
) -> Result<(), ActorProcessingErr> {
    if !live.reloading {
        return Ok(());
    }
    let loaded = match deps.store.load(&live.run.id).await {
        Ok(Some(cp)) => state_of(&cp).map_err(|e| Error::Corrupt {
            run: live.run.id.clone(),
            message: e.to_string(),
        })?,
        Ok(None) => return Err(Error::Missing(live.run.id.clone()).into()),
        Err(e) => {
            tracing::warn!(run = %live.run.id, error = %e, "store still unavailable; the run stays paused");
            let after = store_backoff(deps, live);
            myself.send_after(after, || RunMsg::Reload);
            return Ok(());
        }
    };
    tracing::info!(run = %live.run.id, version = loaded.version, "store is back; resuming the run");
    live.run = loaded;
    live.writer.reset();
    live.reloading = false;
    live.store_failures = 0;
    live.tools_in_flight = 0;
    if !live.run.is_terminal() {
        Box::pin(deliver(myself, deps, live, RunMsg::Event(RunEvent::Resume))).await?;
    }
    for msg in std::mem::take(&mut live.held) {
        // Replies to requests issued before the failure carry an old epoch now (Resume moved
        // it on) and are recorded as ignored.
        Box::pin(deliver(myself, deps, live, msg)).await?;
    }
    Ok(())
}

fn store_backoff(deps: &RunDeps, live: &mut Live) -> Duration {
    deps.metrics.store_retries.fetch_add(1, Ordering::Relaxed);
    live.store_failures += 1;
    let ms = 100u64
        .saturating_mul(1 << live.store_failures.min(6))
        .min(5_000);
    Duration::from_millis(ms / 2 + rand::random::<u64>() % (ms / 2 + 1))
}

/// Steps, commits, publishes, then carries out the effects.
async fn apply(
    myself: &ActorRef<RunMsg>,
    deps: &Arc<RunDeps>,
    live: &mut Live,
    event: RunEvent,
    control_seq: Option<u64>,
) -> Result<Applied, ActorProcessingErr> {
    if let Some(f) = &deps.faults
        && f.panic_before(&live.run, &event)
    {
        panic!(
            "injected fault in run {} before {}",
            live.run.id,
            event.name()
        );
    }
    let now = now_ms();
    let (prev_version, prev_status) = (live.run.version, live.run.status);
    let stepped = {
        let cx = StepContext {
            now_ms: now,
            policy: &deps.policy,
            tools: &live.agent.tools,
        };
        step(&mut live.run, event, &cx)
    };
    let transition = match stepped {
        Ok(t) => t,
        Err(e) => return Ok(Applied::Rejected(e)),
    };
    if let Some(seq) = control_seq {
        live.run.controls_applied = live.run.controls_applied.max(seq);
    }
    let mut data = transition.data;
    deps.redactor.redact_value_in_place(&mut data);
    let record = EventRecord {
        seq: live.run.version,
        at_ms: now,
        kind: transition.kind.to_owned(),
        data,
    };
    let checkpoint = live
        .writer
        .checkpoint(&mut live.run)
        .map_err(|e| Error::Corrupt {
            run: live.run.id.clone(),
            message: format!("cannot serialize the run: {e}"),
        })?;
    let committed = deps
        .store
        .commit(
            &live.lease,
            &checkpoint,
            prev_version,
            std::slice::from_ref(&record),
        )
        .await;
    match committed {
        Ok(()) => live.store_failures = 0,
        Err(e) if e.is_retryable() => {
            // `live.run` now holds a state that may or may not be stored: it is replaced by
            // the checkpoint read back on reload.
            tracing::warn!(run = %live.run.id, error = %e, "commit failed; pausing the run until the store answers");
            return Ok(Applied::StoreDown);
        }
        Err(e) => {
            tracing::warn!(run = %live.run.id, error = %e, "lost ownership of the run; stopping its actor");
            live.cancel.cancel();
            myself.stop(Some("lease_lost".into()));
            return Ok(Applied::LostOwnership);
        }
    }
    deps.metrics.transitions.fetch_add(1, Ordering::Relaxed);
    if live.run.status != prev_status {
        deps.metrics.entered(live.run.status);
    }
    let terminal = live.run.is_terminal();
    deps.hub.publish(&live.run.id, &record, terminal);
    for effect in transition.effects {
        execute(myself, deps, live, effect);
    }
    schedule_passivation(myself, deps, live);
    arm_approval_timers(myself, live, now);
    Ok(Applied::Done)
}

/// Arms one expiry timer per call awaiting approval whose tool has an `approval_timeout`,
/// counted from when the call began waiting (so a restart does not extend it).
fn arm_approval_timers(myself: &ActorRef<RunMsg>, live: &mut Live, now: u64) {
    if live.run.status != crate::run::state::Status::WaitingApproval {
        return;
    }
    for c in &live.run.calls {
        if c.status != crate::run::state::CallStatus::AwaitingApproval
            || live.approval_timers.contains(&c.call_id)
        {
            continue;
        }
        let Some(after) = live
            .agent
            .tools
            .tool(&c.tool)
            .and_then(|t| t.spec().approval_timeout)
        else {
            continue;
        };
        let since = c.awaiting_since_ms.unwrap_or(now);
        let due = since.saturating_add(after.as_millis() as u64);
        let call_id = c.call_id.clone();
        live.approval_timers.insert(call_id.clone());
        myself.send_after(Duration::from_millis(due.saturating_sub(now)), move || {
            RunMsg::Event(RunEvent::ApprovalExpired { call_id })
        });
    }
}

fn execute(myself: &ActorRef<RunMsg>, deps: &Arc<RunDeps>, live: &mut Live, effect: Effect) {
    let run = &live.run;
    match effect {
        Effect::CallModel { epoch, tool_choice } => {
            if let Some(t) = live.turn_started.replace(Instant::now()) {
                deps.metrics.step_latency.observe(t.elapsed());
            }
            let request = ModelRequest {
                run_id: run.id.clone(),
                tenant: run.tenant.clone(),
                model: live.agent.spec.model.clone(),
                messages: live.agent.context(run),
                tools: match tool_choice {
                    ToolChoice::Auto => live.agent.definitions.clone(),
                    ToolChoice::None => Vec::new().into(),
                },
                tool_choice,
            };
            let me = myself.clone();
            let metrics = deps.metrics.clone();
            let sent = Instant::now();
            deps.gateway
                .submit(request, live.cancel.clone(), move |outcome| {
                    metrics.model_latency.observe(sent.elapsed());
                    let event = match outcome {
                        Ok(reply) => RunEvent::ModelReplied { epoch, reply },
                        Err(error) => {
                            metrics.model_errors.fetch_add(1, Ordering::Relaxed);
                            RunEvent::ModelFailed { epoch, error }
                        }
                    };
                    let _ = me.cast(RunMsg::Event(event));
                });
        }
        Effect::ExecuteTool { epoch, call_id } | Effect::CheckStatus { epoch, call_id } => {
            let status_check = matches!(
                effect_kind(&call_id, run),
                Some(crate::run::state::CallStatus::Reconciling)
            );
            let Some(call) = run.call(&call_id) else {
                tracing::error!(run = %run.id, %call_id, "effect names a call that is not in the batch");
                return;
            };
            let me = myself.clone();
            let Some(tool) = live.agent.tools.tool(&call.tool) else {
                // Config changed since the call was validated: answer it without running it.
                let result = ToolResult::failure(ToolError::new(
                    ToolErrorCode::ToolNotAllowed,
                    format!("tool `{}` is no longer available", call.tool),
                ));
                let _ = me.cast(RunMsg::Event(RunEvent::ToolFinished {
                    epoch,
                    call_id,
                    result,
                }));
                return;
            };
            let ctx = ToolContext {
                run_id: run.id.clone(),
                call_id: call_id.clone(),
                idempotency_key: call.key.clone(),
                cancel: live.cancel.child_token(),
            };
            let work = if status_check {
                ToolWork::Status
            } else {
                ToolWork::Call {
                    arguments: call.arguments.clone(),
                }
            };
            let metrics = deps.metrics.clone();
            let redactor = deps.redactor.clone();
            let sent = Instant::now();
            live.tools_in_flight += 1;
            deps.tools.submit(tool, ctx, work, move |outcome| {
                metrics.tool_latency.observe(sent.elapsed());
                let event = match outcome {
                    ToolOutcome::Result(mut result) => {
                        result.redact(&redactor);
                        if !result.ok {
                            metrics.tool_errors.fetch_add(1, Ordering::Relaxed);
                        }
                        RunEvent::ToolFinished {
                            epoch,
                            call_id,
                            result,
                        }
                    }
                    ToolOutcome::Status(mut outcome) => {
                        match &mut outcome {
                            Ok(Some(result)) => result.redact(&redactor),
                            Err(e) => e.message = redactor.redact_str(&e.message).into_owned(),
                            Ok(None) => {}
                        }
                        RunEvent::StatusChecked {
                            epoch,
                            call_id,
                            outcome,
                        }
                    }
                };
                let _ = me.cast(RunMsg::Event(event));
            });
        }
        Effect::Verify { epoch, candidate } => {
            let verdict = verify_all(&live.agent.spec.verifiers, &candidate, run);
            let _ = myself.cast(RunMsg::Event(RunEvent::VerificationDone { epoch, verdict }));
        }
        Effect::ScheduleRetry { epoch, after_ms } => {
            myself.send_after(Duration::from_millis(after_ms), move || {
                RunMsg::Event(RunEvent::RetryDue { epoch })
            });
        }
        Effect::AbortInFlight => {
            live.cancel.cancel();
            live.cancel = CancellationToken::new();
        }
        Effect::Finish => {
            if let Some(t) = live.turn_started.take() {
                deps.metrics.step_latency.observe(t.elapsed());
            }
            if let Some(t) = live.deadline_timer.take() {
                t.abort();
            }
            if let Some(n) = deps.active.get(&live.run.tenant) {
                n.fetch_sub(1, Ordering::SeqCst);
            }
            if live.tools_in_flight == 0 {
                myself.stop(Some("finished".into()));
            } else {
                live.finishing = true;
                myself.exit_after(LATE_RESULT_GRACE);
            }
        }
    }
}

fn effect_kind(
    call_id: &crate::ids::CallId,
    run: &RunState,
) -> Option<crate::run::state::CallStatus> {
    run.call(call_id).map(|c| c.status)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::model::Message;
    use serde_json::json;

    #[test]
    fn the_checkpoint_writer_matches_plain_serialization() {
        let mut run = RunState::new(
            RunId::generate(),
            "t".into(),
            "a".into(),
            json!("g"),
            Default::default(),
            1,
        );
        let mut w = CheckpointWriter::default();
        assert_eq!(
            w.checkpoint(&mut run).unwrap().body,
            checkpoint_of(&run).unwrap().body
        );
        for i in 0..3 {
            run.messages.push(Message::User {
                content: format!("say \"{i}\" \\ é"),
            });
            run.messages.push(Message::Tool {
                call_id: format!("c{i}"),
                content: r#"{"ok":true}"#.into(),
            });
            run.version += 1;
            let body = w.checkpoint(&mut run).unwrap().body;
            assert_eq!(body, checkpoint_of(&run).unwrap().body);
            assert_eq!(state_of(&checkpoint_of(&run).unwrap()).unwrap(), run);
        }
        w.reset();
        assert_eq!(
            w.checkpoint(&mut run).unwrap().body,
            checkpoint_of(&run).unwrap().body
        );
    }
}
