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
//! `approval_timeout` gets a timer that delivers `RunEvent::ApprovalExpired`. Calls a tool
//! accepted to finish later are polled by timers and short pool jobs (`long_running`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio_util::sync::CancellationToken;

mod long_running;

use super::ownership::LeaseBook;
use crate::agent::Agent;
use crate::clock::now_ms;
use crate::hub::Hub;
use crate::ids::{CallId, RunId};
use crate::metrics::Metrics;
use crate::model::gateway::ModelGateway;
use crate::model::{Message, ModelRequest, ToolChoice};
use crate::redact::Redactor;
use crate::run::format;
use crate::run::machine::{
    ControlStep, Effect, InvalidTransition, Policy, RunEvent, StepContext, Transition,
    apply_control, step,
};
use crate::run::state::RunState;
use crate::run::verify::verify_all;
use crate::store::{self, Checkpoint, EventRecord, Lease, SharedStore};
use crate::tool::executor::{ToolExecutor, ToolOutcome, ToolWork};
use crate::tool::{ToolContext, ToolError, ToolErrorCode, ToolResult};

mod compensate;

/// One run's actor.
#[derive(Debug)]
pub struct RunActor;

/// What a run actor handles.
pub enum RunMsg {
    /// A pool reply or a timer.
    Event(RunEvent),
    /// Controls were stored in the run's inbox. A wake-up only: the actor reads every entry
    /// after its applied mark and applies them strictly in inbox order; `reply` is answered
    /// once the entry at its seq has been consumed.
    Controls {
        /// With a request waiting: the seq of its inbox entry, and where to send the state after it
        /// (or the refusal); `None`: a bare wake-up.
        reply: Option<(u64, RpcReplyPort<ControlReply>)>,
    },
    /// The run's current state.
    Get(RpcReplyPort<RunState>),
    /// After a failed commit: read the checkpoint back and continue from it.
    Reload,
    /// The commit window opened on the stored version `expected_version` closed: commit what
    /// waits in it, if that window is still open.
    CommitWindowClosed {
        /// The stored version the window's commit expects (it names the window).
        expected_version: u64,
    },
    /// The store did not answer while the actor was starting: try again.
    RetryBoot,
    /// Tool calls were held back while the lease was not confirmed: send them if it is now.
    RetryDeferred,
    /// The run has been waiting (approval or input) since `version`: if nothing changed, stop
    /// the actor; the run stays in the store and is rehydrated by its next message.
    Passivate {
        /// The run's version when this was scheduled; if it has changed since, nothing happens.
        version: u64,
    },
    /// A long-running call's poll timer fired (`long_running`).
    PollDue {
        /// The run's epoch when the timer was armed; one of an older epoch does nothing.
        epoch: u64,
        /// The long-running call to poll.
        call_id: CallId,
    },
    /// A poll of a long-running call answered.
    Polled {
        /// The run's epoch when the poll was sent; one of an older epoch changes nothing.
        epoch: u64,
        /// The long-running call polled.
        call_id: CallId,
        /// `Ok(Some(result))`: the call finished; `Ok(None)`: still running (polled again with
        /// backoff); `Err`: the poll failed (asked again if transient, else the call fails with
        /// it).
        outcome: Result<Option<ToolResult>, ToolError>,
    },
}

/// The answer to a control: the state after it was consumed, or why it did not apply.
pub type ControlReply = Result<RunState, InvalidTransition>;

/// How the actor begins.
#[derive(Debug, Clone, PartialEq)]
pub enum Boot {
    /// A new run: `Start`.
    Start,
    /// A restart from the checkpoint (crash, or daemon start): `Resume`.
    Recover,
    /// Fail the run from its checkpoint (e.g. `crash_loop`).
    Abort {
        /// The code of the run's error (`RunError::code`), e.g. `crash_loop`.
        code: String,
        /// The message of the run's error.
        message: String,
    },
    /// Bring a passivated run back for a message or a timer: a waiting run continues as it
    /// was (no `Resume`: nothing was in flight); any other run resumes.
    Rehydrate,
    /// Take over a run that needs an owner (its owner died or released it, or it was queued for
    /// any node): like `Rehydrate`, counted as a takeover.
    TakeOver,
}

/// Why a run actor stopped itself. ractor carries stop reasons as strings, so this is encoded
/// by `encode` and read back by `decode`; nothing else parses them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The run ended (and late results were waited for).
    Finished,
    /// The checkpoint was already terminal when the actor started.
    AlreadyTerminal,
    /// The run waits for an operator and gave up its actor; `wake_at_ms` is when its deadline
    /// or an approval expiry needs it back.
    Passivated {
        /// When a timer needs the run back, ms since the Unix epoch; `None`: only a control does.
        wake_at_ms: Option<u64>,
    },
    /// Another node holds the run's lease.
    LeasedElsewhere,
    /// Another writer fenced this one out: the run belongs to someone else now.
    LeaseLost,
    /// This node's definition of the run's agent differs from the one the run started with.
    AgentMismatch,
    /// The runtime is shutting down; the run stays checkpointed.
    Shutdown,
}

impl StopReason {
    /// The stop reason string ractor carries (`finished`, `passivated:<ms>`, …; 0 for no wake
    /// time).
    pub fn encode(self) -> String {
        match self {
            StopReason::Finished => "finished".into(),
            StopReason::AlreadyTerminal => "terminal".into(),
            StopReason::Passivated { wake_at_ms } => {
                format!("passivated:{}", wake_at_ms.unwrap_or(0))
            }
            StopReason::LeasedElsewhere => "leased_elsewhere".into(),
            StopReason::LeaseLost => "lease_lost".into(),
            StopReason::AgentMismatch => "agent_mismatch".into(),
            StopReason::Shutdown => "shutdown".into(),
        }
    }

    /// Reads back what `encode` wrote; `None` for no reason or one it did not write (e.g. a panic).
    pub fn decode(reason: Option<&str>) -> Option<StopReason> {
        Some(match reason? {
            "finished" => StopReason::Finished,
            "terminal" => StopReason::AlreadyTerminal,
            "leased_elsewhere" => StopReason::LeasedElsewhere,
            "lease_lost" => StopReason::LeaseLost,
            "agent_mismatch" => StopReason::AgentMismatch,
            "shutdown" => StopReason::Shutdown,
            other => {
                let at = other.strip_prefix("passivated:")?.parse::<u64>().ok()?;
                StopReason::Passivated {
                    wake_at_ms: (at > 0).then_some(at),
                }
            }
        })
    }

    fn stop(self, myself: &ActorRef<RunMsg>) {
        myself.stop(Some(self.encode()));
    }
}

/// Deliberate faults for chaos and supervision tests.
pub trait FaultInjector: Send + Sync + 'static {
    /// Return true to panic in the run's handler just before `event` is applied.
    fn panic_before(&self, run: &RunState, event: &RunEvent) -> bool;
}

/// Everything a run actor needs, shared by all runs.
pub struct RunDeps {
    /// Where checkpoints, events, leases and inboxes are kept.
    pub store: SharedStore,
    /// Live fan-out of committed events to SSE streams and waiters.
    pub hub: Arc<Hub>,
    /// The shared model pool model requests go to.
    pub gateway: ModelGateway,
    /// The shared tool pool tool calls go to.
    pub tools: ToolExecutor,
    /// The configured agents by name; a run whose agent is missing or differs is left to another
    /// node.
    pub agents: HashMap<String, Arc<Agent>>,
    /// Bounds the machine enforces besides the budget.
    pub policy: Policy,
    /// Lease owner name of this runtime instance.
    pub node_id: String,
    /// How long each claim or renewal of a run's lease holds.
    pub lease_ttl: Duration,
    /// Deliberate faults for tests; `None` in production.
    pub faults: Option<Arc<dyn FaultInjector>>,
    /// Counters the actors update.
    pub metrics: Arc<Metrics>,
    /// Stop the actor of a run that has waited for approval or input this long (`None`: never).
    pub passivate_after: Option<Duration>,
    /// How long transitions that may wait (`may_wait_in_window`) wait to be committed
    /// together, from the first (`None`: never held).
    pub commit_window: Option<Duration>,
    /// Non-terminal runs per tenant (for the per-tenant limit); a run leaves it when it ends.
    pub active: dashmap::DashMap<String, std::sync::atomic::AtomicI64>,
    /// Applied to event data before commit and to tool results before they enter the run.
    pub redactor: Arc<Redactor>,
    /// The leases this node holds (renewed by `runtime::ownership`).
    pub leases: LeaseBook,
    /// Runs this node left alone because its definition of their agent differs.
    pub mismatched: dashmap::DashMap<RunId, ()>,
    /// The callback route long-running tools complete calls through (`None`: not offered).
    pub callbacks: Option<Arc<crate::tool::callback::Callbacks>>,
}

/// Start arguments.
pub struct RunArgs {
    /// The run to drive.
    pub id: RunId,
    /// How to begin: start, recover, abort, rehydrate or take over.
    pub boot: Boot,
    /// The dependencies shared by every run.
    pub deps: Arc<RunDeps>,
    /// The actor was started for a stored control: if another node owns the run, wake it.
    pub wake_owner: bool,
    /// A run this node has just created: the checkpoint its create stored, used instead of
    /// reading it back, and the lease the create took (`Boot::Start` only; a retried boot
    /// reads the store).
    pub created: Option<Box<CreatedRun>>,
}

/// A run this node has just created, as its create left it.
#[derive(Debug)]
pub struct CreatedRun {
    /// The checkpoint the create stored.
    pub checkpoint: Checkpoint,
    /// The lease the create took with it (`CheckpointStore::create_claimed`), and a time no
    /// later than when the store granted it (ms since the epoch); `None`: the actor claims.
    pub lease: Option<(Lease, u64)>,
}

/// The actor's state: empty until `post_start` has loaded the checkpoint.
pub struct RunActorState {
    id: RunId,
    boot: Boot,
    wake_owner: bool,
    created: Option<Box<CreatedRun>>,
    deps: Arc<RunDeps>,
    live: Option<Live>,
    /// Messages that arrived before the run was loaded (the store did not answer yet).
    early: Vec<RunMsg>,
    /// Start attempts that found the store down; the run is paused while this is non-zero.
    boot_failures: u32,
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
    /// The lease was given up with the run's last commit (`commit_final`).
    released: bool,
    /// A commit failed, so `run` may differ from the store: messages wait in `held` until the
    /// checkpoint has been read back (`RunMsg::Reload`).
    reloading: bool,
    held: Vec<RunMsg>,
    /// Transitions applied but not committed yet: the open commit window (at most
    /// `commit_window` from its first transition, at most `MAX_WINDOW_EVENTS`).
    uncommitted: Option<Uncommitted>,
    writer: CheckpointWriter,
    /// Calls whose approval-expiry timer is armed in this incarnation.
    approval_timers: HashSet<CallId>,
    /// Control requests waiting for their inbox entry to be consumed.
    waiters: Vec<(u64, RpcReplyPort<ControlReply>)>,
    /// Refusals of this incarnation that are not in the state (a finished run commits none).
    refused_here: HashMap<u64, InvalidTransition>,
    /// Tool effects held back because the lease was not confirmed recently enough.
    deferred: Vec<Effect>,
    /// Long-running calls being polled in this incarnation.
    polls: long_running::Polls,
    /// The open turn span (`telemetry`).
    trace: crate::telemetry::RunTrace,
}

/// How long a stopping actor tries to store a transition still in its commit window.
const UNCOMMITTED_FLUSH_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a finished run waits for tool results still in flight.
const LATE_RESULT_GRACE: Duration = Duration::from_secs(60);

/// Why a run actor stopped itself or failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The store holds no checkpoint for the run.
    #[error("run {0}: checkpoint not found")]
    Missing(RunId),
    /// The checkpoint does not decode into a `RunState`.
    #[error("run {run}: checkpoint is unreadable: {message}")]
    Corrupt {
        /// The run.
        run: RunId,
        /// Why it does not decode.
        message: String,
    },
    /// The store failed with an error that retrying does not cure.
    #[error("run {run}: {source}")]
    Store {
        /// The run.
        run: RunId,
        /// The store's error.
        source: store::Error,
    },
    /// An internal invariant did not hold.
    #[error("{0}")]
    Bug(String),
}

/// Serializes the run into its stored form, in the current format (`run::format`), with its
/// whole transcript to store from entry 0 (a run being created).
pub fn checkpoint_of(run: &mut RunState) -> Result<Checkpoint, serde_json::Error> {
    let body = format::encode(run)?;
    let mut c = checkpoint_with_body(run, body);
    c.transcript = run
        .messages
        .iter()
        .map(serde_json::to_string)
        .collect::<Result<_, _>>()?;
    Ok(c)
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
        transcript: Vec::new(),
        transcript_from: 0,
    }
}

/// Writes checkpoints of one run. The transcript only grows, and the store keeps it apart,
/// append-only: each commit sends the small body and only the messages the store does not
/// hold yet, each serialized once (again only for a commit asked for twice). So the bytes of a
/// commit do not grow with the run, and neither does the writer: it keeps only the JSON of
/// messages not handed to a commit yet.
#[derive(Debug, Default)]
pub struct CheckpointWriter {
    /// JSON of the messages from `stored` on, serialized and not yet handed to a commit.
    pending: Vec<String>,
    /// How many of the run's messages are stored or in `pending`.
    serialized: usize,
    /// How many transcript entries the store holds, as of the last commit or load.
    stored: usize,
}

impl CheckpointWriter {
    /// Starts over from a checkpoint read back from the store.
    pub fn loaded(&mut self, cp: &Checkpoint) {
        self.pending.clear();
        self.stored = format::stored_transcript_len(&cp.body).unwrap_or(0);
        self.serialized = self.stored;
    }

    /// How many transcript entries the store holds, as of the last commit or load.
    pub fn stored(&self) -> usize {
        self.stored
    }

    /// The last checkpoint handed out was committed: the store holds its transcript.
    pub fn committed(&mut self) {
        self.stored = self.serialized;
        self.pending.clear();
    }

    /// The run's checkpoint to commit next: its body and only the transcript entries the store does
    /// not hold yet (`transcript_from` where they begin). Call `committed` once it is stored.
    pub fn checkpoint(&mut self, run: &mut RunState) -> Result<Checkpoint, serde_json::Error> {
        if self.serialized > run.messages.len() {
            // Never expected (the transcript only grows): serialize again from what is stored.
            self.stored = self.stored.min(run.messages.len());
            self.serialized = self.stored;
            self.pending.clear();
        }
        if self.pending.len() != self.serialized - self.stored {
            // The last checkpoint took them and was not committed: serialize them again.
            self.pending = run.messages[self.stored..self.serialized]
                .iter()
                .map(serde_json::to_string)
                .collect::<Result<_, _>>()?;
        }
        for m in &run.messages[self.serialized..] {
            self.pending.push(serde_json::to_string(m)?);
        }
        self.serialized = run.messages.len();
        let body = format::encode(run)?;
        let mut c = checkpoint_with_body(run, body);
        c.transcript_from = self.stored as u64;
        // Handed over, not copied (they are the bulk of a commit): once this checkpoint is
        // committed the store holds them; if it is asked for again first, they are serialized
        // again above.
        c.transcript = std::mem::take(&mut self.pending);
        Ok(c)
    }
}

/// Reads the run back from its stored form, of any supported format version; a newer one is
/// refused (the caller treats it as corrupt: the run is quarantined, not misread).
pub fn state_of(cp: &Checkpoint) -> Result<RunState, format::FormatError> {
    format::decode(&cp.body, &cp.transcript)
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
            wake_owner: args.wake_owner,
            created: args.created,
            deps: args.deps,
            live: None,
            early: Vec::new(),
            boot_failures: 0,
        })
    }

    async fn post_start(
        &self,
        myself: ActorRef<RunMsg>,
        st: &mut RunActorState,
    ) -> Result<(), ActorProcessingErr> {
        try_boot(&myself, st).await
    }

    async fn handle(
        &self,
        myself: ActorRef<RunMsg>,
        msg: RunMsg,
        st: &mut RunActorState,
    ) -> Result<(), ActorProcessingErr> {
        let deps = st.deps.clone();
        let Some(live) = st.live.as_mut() else {
            match msg {
                RunMsg::RetryBoot => try_boot(&myself, st).await?,
                // Still waiting for the store to load the run: keep it for afterwards.
                msg if st.boot_failures > 0 => st.early.push(msg),
                _ => {}
            }
            return Ok(());
        };
        if let RunMsg::Event(
            RunEvent::ToolFinished { .. }
            | RunEvent::StatusChecked { .. }
            | RunEvent::ToolAccepted { .. },
        ) = &msg
        {
            live.tools_in_flight = live.tools_in_flight.saturating_sub(1);
        }
        deliver(&myself, &deps, live, msg).await?;
        if live.finishing && live.tools_in_flight == 0 {
            StopReason::Finished.stop(&myself);
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<RunMsg>,
        st: &mut RunActorState,
    ) -> Result<(), ActorProcessingErr> {
        if st.boot_failures > 0 {
            st.deps.metrics.paused_runs.fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(mut live) = st.live.take() {
            if live.uncommitted.is_some() && !live.reloading {
                // Stopped (a shutdown) while a read-only dispatch waited for its window: store
                // it, so a graceful stop loses nothing. Fenced like every commit; bounded.
                let flushed = tokio::time::timeout(
                    UNCOMMITTED_FLUSH_TIMEOUT,
                    commit_uncommitted(&myself, &st.deps, &mut live),
                )
                .await;
                if !matches!(flushed, Ok(Ok(()))) {
                    tracing::debug!(run = %live.run.id, "a transition waiting to be committed was not stored before the actor stopped; the run resumes from its previous checkpoint");
                }
            }
            st.deps.leases.remove(&live.run.id);
            if live.reloading {
                st.deps.metrics.paused_runs.fetch_sub(1, Ordering::Relaxed);
            }
            live.cancel.cancel();
            if let Some(t) = live.deadline_timer.take() {
                t.abort();
            }
            if live.run.is_terminal() && !live.released {
                // Late results have been recorded (or waited for long enough): let go.
                let store = st.deps.store.clone();
                let lease = live.lease.clone();
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

/// Why loading a run did not finish.
enum BootError {
    /// The store did not answer: try again later; this is a wait, not a crash.
    StoreDown(store::Error),
    /// Missing or corrupt data, or a bug: the actor fails and the supervisor counts a crash.
    Fatal(Error),
}

impl From<Error> for BootError {
    fn from(e: Error) -> Self {
        BootError::Fatal(e)
    }
}

/// Loads and claims the run; while the store is down, retries with capped backoff (the run is
/// counted as paused meanwhile) and keeps the messages that arrive.
async fn try_boot(
    myself: &ActorRef<RunMsg>,
    st: &mut RunActorState,
) -> Result<(), ActorProcessingErr> {
    match boot(myself, st).await {
        Ok(()) => {
            if st.boot_failures > 0 {
                st.boot_failures = 0;
                st.deps.metrics.paused_runs.fetch_sub(1, Ordering::Relaxed);
                tracing::info!(run = %st.id, "store is back; the run continues");
            }
            let early = std::mem::take(&mut st.early);
            if let Some(live) = st.live.as_mut() {
                for msg in early {
                    deliver(myself, &st.deps, live, msg).await?;
                }
            }
            Ok(())
        }
        Err(BootError::StoreDown(e)) => {
            if st.boot_failures == 0 {
                st.deps.metrics.paused_runs.fetch_add(1, Ordering::Relaxed);
            }
            st.boot_failures += 1;
            st.deps
                .metrics
                .store_retries
                .fetch_add(1, Ordering::Relaxed);
            let wait = capped_backoff(st.boot_failures);
            tracing::warn!(run = %st.id, error = %e, ?wait, "store unavailable while starting the run; it is paused until the store answers");
            myself.send_after(wait, || RunMsg::RetryBoot);
            Ok(())
        }
        Err(BootError::Fatal(e)) => Err(e.into()),
    }
}

async fn boot(myself: &ActorRef<RunMsg>, st: &mut RunActorState) -> Result<(), BootError> {
    let deps = st.deps.clone();
    let id = st.id.clone();
    let down = |e: store::Error| -> BootError {
        if e.is_retryable() {
            BootError::StoreDown(e)
        } else {
            BootError::Fatal(Error::Store {
                run: id.clone(),
                source: e,
            })
        }
    };
    let (cp, created_lease) = match st.created.take() {
        // Just stored by this node's create, and nobody can have committed since: a commit
        // needs the lease, which the create took or this boot claims next (a version conflict
        // would reload).
        Some(created) if st.boot == Boot::Start => {
            let CreatedRun { checkpoint, lease } = *created;
            (checkpoint, lease)
        }
        _ => (
            deps.store
                .load(&id)
                .await
                .map_err(down)?
                .ok_or_else(|| Error::Missing(id.clone()))?,
            None,
        ),
    };
    let run = state_of(&cp).map_err(|e| Error::Corrupt {
        run: id.clone(),
        message: e.to_string(),
    })?;
    if run.is_terminal() {
        StopReason::AlreadyTerminal.stop(myself);
        return Ok(());
    }
    // A node whose definition of the run's agent differs (or that lacks it) leaves the run
    // to a node that matches, instead of continuing it with other instructions or tools.
    let agent = deps.agents.get(&run.agent).cloned();
    let matches = match (&agent, &run.agent_digest) {
        (None, _) => false,
        (Some(a), Some(d)) => a.digest == *d,
        (Some(_), None) => true,
    };
    if !matches {
        if deps.mismatched.insert(id.clone(), ()).is_none() {
            deps.metrics
                .agent_mismatches
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(run = %id, agent = %run.agent, "this node's definition of the run's agent differs from the one it started with; leaving the run to a node that matches");
        }
        StopReason::AgentMismatch.stop(myself);
        return Ok(());
    }
    let Some(agent) = agent else {
        return Err(BootError::Fatal(Error::Bug("agent checked above".into())));
    };
    let claimed = match created_lease {
        Some(taken) => Ok(taken),
        None => {
            let at = now_ms();
            deps.store
                .claim(&id, &deps.node_id, deps.lease_ttl)
                .await
                .map(|l| (l, at))
        }
    };
    let lease = match claimed {
        Ok((lease, at)) => {
            deps.leases.insert(lease.clone(), at);
            lease
        }
        Err(store::Error::LeaseHeld { owner, .. }) => {
            tracing::debug!(run = %id, %owner, "run is owned by another node");
            if st.wake_owner
                && let Err(e) = deps.store.notify_node(&owner, &id).await
            {
                tracing::warn!(run = %id, %owner, error = %e, "could not wake the run's owner; it reads the control at its next step");
            }
            StopReason::LeasedElsewhere.stop(myself);
            return Ok(());
        }
        Err(e) => return Err(down(e)),
    };
    if st.boot == Boot::TakeOver {
        deps.metrics.takeovers.fetch_add(1, Ordering::Relaxed);
        tracing::info!(run = %id, node = %deps.node_id, "took the run over");
    }
    let mut live = Live::new(run, lease, agent);
    live.writer.loaded(&cp);
    trim_outputs(&mut live);
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
    ) || long_running::is_awaiting_tool(&live);
    let boot = match std::mem::replace(&mut st.boot, Boot::Recover) {
        Boot::Start => Some(RunEvent::Start),
        Boot::Recover => Some(RunEvent::Resume),
        Boot::Rehydrate | Boot::TakeOver if waiting => None,
        Boot::Rehydrate | Boot::TakeOver => Some(RunEvent::Resume),
        Boot::Abort { code, message } => Some(RunEvent::Abort { code, message }),
    };
    let bug = |e: ActorProcessingErr| BootError::Fatal(Error::Bug(e.to_string()));
    match boot {
        Some(event) => deliver(myself, &deps, &mut live, RunMsg::Event(event))
            .await
            .map_err(bug)?,
        None => {
            // Rehydrated while waiting: re-arm its timers and let it passivate again.
            arm_approval_timers(myself, &mut live, now_ms());
            long_running::resume_all(myself, &mut live);
            schedule_passivation(myself, &deps, &live);
        }
    }
    // Controls stored but not yet applied (e.g. sent while the run was down).
    deliver(myself, &deps, &mut live, RunMsg::Controls { reply: None })
        .await
        .map_err(bug)?;
    st.live = Some(live);
    Ok(())
}

/// Exponential backoff from 200 ms to 5 s with jitter, for waits on the store.
fn capped_backoff(failures: u32) -> Duration {
    let ms = 100u64.saturating_mul(1 << failures.min(6)).min(5_000);
    Duration::from_millis(ms / 2 + rand::random::<u64>() % (ms / 2 + 1))
}

/// However the actor ends — stopped, or failed by a panic (ractor runs no `post_stop` then) —
/// the requests it issued are cancelled, so they cannot race the restarted run's own resend.
impl Drop for Live {
    fn drop(&mut self) {
        self.cancel.cancel();
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
            released: false,
            finishing: false,
            reloading: false,
            held: Vec::new(),
            uncommitted: None,
            writer: CheckpointWriter::default(),
            approval_timers: HashSet::new(),
            waiters: Vec::new(),
            refused_here: HashMap::new(),
            deferred: Vec::new(),
            polls: long_running::Polls::default(),
            trace: Default::default(),
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
        if !matches!(msg, RunMsg::CommitWindowClosed { .. }) {
            live.held.push(msg);
        }
        return Ok(());
    }
    match msg {
        RunMsg::Get(reply) => {
            // What a reader sees is stored: a transition still waiting is committed first.
            if live.uncommitted.is_some() && !live.reloading {
                commit_uncommitted(myself, deps, live).await?;
            }
            let _ = reply.send(live.run.clone());
        }
        RunMsg::CommitWindowClosed { expected_version } => {
            if live
                .uncommitted
                .as_ref()
                .is_some_and(|u| u.expected_version == expected_version)
            {
                commit_uncommitted(myself, deps, live).await?;
            }
        }
        RunMsg::Passivate { version } => passivate(myself, deps, live, version),
        RunMsg::RetryDeferred => run_deferred(myself, deps, live),
        RunMsg::PollDue { epoch, call_id } => {
            long_running::on_due(myself, deps, live, epoch, call_id);
        }
        RunMsg::Polled {
            epoch,
            call_id,
            outcome,
        } => long_running::on_polled(myself, live, epoch, call_id, outcome),
        RunMsg::Reload => reload(myself, deps, live).await?,
        RunMsg::Event(event) => {
            let copy = event.clone();
            match apply(myself, deps, live, event).await? {
                Applied::Done | Applied::LostOwnership => {}
                Applied::Rejected(e) => {
                    tracing::debug!(run = %live.run.id, error = %e, "event did not apply");
                }
                Applied::StoreDown => hold(myself, deps, live, Some(RunMsg::Event(copy))),
            }
        }
        RunMsg::Controls { reply } => {
            if let Some(waiter) = reply {
                live.waiters.push(waiter);
            }
            drain_inbox(myself, deps, live).await?;
        }
        // Only meaningful before the run is loaded (handled by the actor itself).
        RunMsg::RetryBoot => {}
    }
    Ok(())
}

/// Applies every inbox entry after the applied mark, strictly in inbox order, then answers
/// the waiters whose entries are consumed. Reads the inbox only when a waiter's entry is not
/// consumed yet (or for a bare wake-up), so concurrent requests cost one read, not one each.
async fn drain_inbox(
    myself: &ActorRef<RunMsg>,
    deps: &Arc<RunDeps>,
    live: &mut Live,
) -> Result<(), ActorProcessingErr> {
    let must_read = live.waiters.is_empty()
        || live
            .waiters
            .iter()
            .any(|(seq, _)| *seq > live.run.controls_applied);
    if must_read && !live.run.is_terminal() {
        let entries = match deps
            .store
            .controls(&live.run.id, live.run.controls_applied)
            .await
        {
            Ok(entries) => entries,
            Err(e) if e.is_retryable() => {
                tracing::warn!(run = %live.run.id, error = %e, "cannot read the control inbox; retrying when the store answers");
                let wait = store_backoff(deps, live);
                myself.send_after(wait, || RunMsg::Controls { reply: None });
                return Ok(());
            }
            Err(e) => {
                return Err(Error::Store {
                    run: live.run.id.clone(),
                    source: e,
                }
                .into());
            }
        };
        for entry in entries {
            if entry.seq <= live.run.controls_applied {
                continue;
            }
            if live.run.is_terminal() {
                // A finished run takes no more controls; what is left is refused below.
                break;
            }
            inject_fault(deps, live, &RunEvent::from(entry.control.clone()));
            let (prev_version, prev_status) = (live.run.version, live.run.status);
            let stepped = {
                let cx = StepContext {
                    now_ms: now_ms(),
                    policy: &deps.policy,
                    tools: &live.agent.tools,
                };
                apply_control(&mut live.run, entry.seq, entry.control, &cx)
            };
            let transition = match stepped {
                ControlStep::Applied(t) => Some(t),
                ControlStep::Repeated => None,
                ControlStep::Refused(t, e) => {
                    tracing::debug!(run = %live.run.id, seq = entry.seq, error = %e, "control refused");
                    if t.is_none() {
                        live.refused_here.insert(entry.seq, e);
                    }
                    t
                }
            };
            if let Some(t) = transition {
                match commit_transition(
                    myself,
                    deps,
                    live,
                    t,
                    Cause::Control,
                    prev_version,
                    prev_status,
                )
                .await?
                {
                    Applied::Done | Applied::Rejected(_) => {}
                    Applied::StoreDown => {
                        // Read back and drain again once the store answers (waiters stay).
                        hold(myself, deps, live, Some(RunMsg::Controls { reply: None }));
                        return Ok(());
                    }
                    Applied::LostOwnership => return Ok(()),
                }
            }
        }
    }
    if !live.waiters.is_empty()
        && let Some(pending) = live.uncommitted.take()
    {
        // A control's requester is answered with what is stored, never with a state still in
        // the commit window.
        match commit_pending(myself, deps, live, pending).await? {
            Applied::Done | Applied::Rejected(_) => {}
            Applied::StoreDown => {
                hold(myself, deps, live, Some(RunMsg::Controls { reply: None }));
                return Ok(());
            }
            Applied::LostOwnership => return Ok(()),
        }
    }
    answer_waiters(live);
    Ok(())
}

/// Answers every waiter whose inbox entry has been consumed (or can no longer be applied
/// because the run ended).
fn answer_waiters(live: &mut Live) {
    let applied = live.run.controls_applied;
    let terminal = live.run.is_terminal();
    let waiters = std::mem::take(&mut live.waiters);
    for (seq, reply) in waiters {
        let answer = if let Some(r) = live.run.refusal(seq) {
            Err(InvalidTransition {
                code: refusal_code(&r.code),
                message: r.message.clone(),
                status: live.run.status,
            })
        } else if let Some(e) = live.refused_here.get(&seq) {
            Err(e.clone())
        } else if seq <= applied {
            Ok(live.run.clone())
        } else if terminal {
            Err(InvalidTransition {
                code: "invalid_state",
                message: format!(
                    "run is {}; it accepts no controls",
                    live.run.status.as_str()
                ),
                status: live.run.status,
            })
        } else {
            live.waiters.push((seq, reply));
            continue;
        };
        let _ = reply.send(answer);
    }
}

/// The machine's static code for a stored refusal code.
fn refusal_code(code: &str) -> &'static str {
    match code {
        "unknown_call" => "unknown_call",
        "invalid_argument" => "invalid_argument",
        "input_queue_full" => "input_queue_full",
        _ => "invalid_state",
    }
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
    (matches!(
        live.run.status,
        crate::run::state::Status::WaitingApproval | crate::run::state::Status::WaitingInput
    ) || long_running::is_awaiting_tool(live))
        && live.tools_in_flight == 0
        && !live.reloading
        && !live.finishing
}

/// Stops the actor of a run that is still waiting, unchanged since `version`. Its checkpoint
/// holds everything; the supervisor wakes it for its next control message, or when its
/// deadline or an approval expiry falls due.
fn passivate(myself: &ActorRef<RunMsg>, deps: &Arc<RunDeps>, live: &Live, version: u64) {
    if live.run.version != version || !is_idle_waiting(live) {
        return;
    }
    if long_running::polling_now(live) {
        // Not while a poll is out: try again once it has answered.
        myself.send_after(Duration::from_secs(1), move || RunMsg::Passivate {
            version,
        });
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
    let wake_at = [
        live.run.budget.deadline_ms,
        approval_due,
        long_running::wake_at_ms(live),
    ]
    .into_iter()
    .flatten()
    .min();
    tracing::debug!(run = %live.run.id, ?wake_at, "passivating a waiting run");
    // Give the lease up, due when a timer needs the run: whichever node has room then (this
    // one, or another if this one is gone) brings it back; a control brings it back sooner.
    deps.leases.remove(&live.run.id);
    let store = deps.store.clone();
    let lease = live.lease.clone();
    tokio::spawn(async move {
        if let Err(e) = store
            .release_many(std::slice::from_ref(&lease), wake_at)
            .await
        {
            tracing::debug!(run = %lease.run_id, error = %e, "lease release failed; it will expire");
        }
    });
    StopReason::Passivated {
        wake_at_ms: wake_at,
    }
    .stop(myself);
}

/// A commit failed: keep `msg`, stop taking new work, and read the checkpoint back later.
fn hold(myself: &ActorRef<RunMsg>, deps: &RunDeps, live: &mut Live, msg: Option<RunMsg>) {
    live.held.extend(msg);
    // What waited to be committed may or may not be stored: the reload tells.
    live.uncommitted = None;
    if !live.reloading {
        live.reloading = true;
        deps.metrics.paused_runs.fetch_add(1, Ordering::Relaxed);
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
    let (loaded, cp) = match deps.store.load(&live.run.id).await {
        Ok(Some(cp)) => (
            state_of(&cp).map_err(|e| Error::Corrupt {
                run: live.run.id.clone(),
                message: e.to_string(),
            })?,
            cp,
        ),
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
    live.writer.loaded(&cp);
    trim_outputs(live);
    live.reloading = false;
    deps.metrics.paused_runs.fetch_sub(1, Ordering::Relaxed);
    live.store_failures = 0;
    live.tools_in_flight = 0;
    live.deferred.clear();
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
    capped_backoff(live.store_failures)
}

/// Steps, commits, publishes, then carries out the effects.
async fn apply(
    myself: &ActorRef<RunMsg>,
    deps: &Arc<RunDeps>,
    live: &mut Live,
    event: RunEvent,
) -> Result<Applied, ActorProcessingErr> {
    inject_fault(deps, live, &event);
    let (prev_version, prev_status) = (live.run.version, live.run.status);
    let cause = Cause::of(&event, &live.run);
    let stepped = {
        let cx = StepContext {
            now_ms: now_ms(),
            policy: &deps.policy,
            tools: &live.agent.tools,
        };
        step(&mut live.run, event, &cx)
    };
    match stepped {
        Ok(t) => commit_transition(myself, deps, live, t, cause, prev_version, prev_status).await,
        Err(e) => Ok(Applied::Rejected(e)),
    }
}

/// Panics where a test's fault injector asks for it, before `event` is applied.
fn inject_fault(deps: &RunDeps, live: &Live, event: &RunEvent) {
    if let Some(f) = &deps.faults
        && f.panic_before(&live.run, event)
    {
        panic!(
            "injected fault in run {} before {}",
            live.run.id,
            event.name()
        );
    }
}

/// What a transition answers, as far as the commit window cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    /// A result the run may ask for again if it is lost: a model reply, a read-only call's
    /// result, a verdict. Only these may wait in the commit window.
    Work,
    /// A start or restart (a restart's count must survive the next crash), the result of a
    /// call that writes (lost, it would be an unknown outcome), a timer, an abort.
    Lifecycle,
    /// A client's control: its requester is answered with what is stored.
    Control,
}

impl Cause {
    fn of(event: &RunEvent, run: &RunState) -> Cause {
        match event {
            RunEvent::ModelReplied { .. } | RunEvent::VerificationDone { .. } => Cause::Work,
            RunEvent::ToolFinished { call_id, .. }
                if run
                    .call(call_id)
                    .is_some_and(|c| c.effect == crate::tool::ToolEffect::Read) =>
            {
                Cause::Work
            }
            _ => Cause::Lifecycle,
        }
    }
}

/// Most transitions one commit window holds: the next one is committed with them at once, so
/// a commit stays bounded however fast a run's model and tools answer.
const MAX_WINDOW_EVENTS: usize = 64;

/// What `commit_transition` holds back: events of transitions applied to `live.run` but not
/// committed yet, with the version and status the store holds.
struct Uncommitted {
    /// The stored version the next commit expects.
    expected_version: u64,
    /// The status the store holds (for the per-status metric).
    stored_status: crate::run::state::Status,
    /// The events in order, first seq `expected_version + 1`.
    events: Vec<EventRecord>,
}

/// Whether a message not stored yet holds a tool output longer than the context shows: its
/// run commits at once, so the output is trimmed in memory (`trim_outputs`) instead of being
/// held whole for the window.
fn holds_untrimmed_output(live: &Live) -> bool {
    let keep = live.agent.spec.context.max_tool_output_bytes;
    let from = live.writer.stored().min(live.run.messages.len());
    live.run.messages[from..]
        .iter()
        .any(|m| matches!(m, Message::Tool { content, .. } if content.len() > keep))
}

/// Whether a transition may wait in the commit window, to be committed with the transitions
/// that follow it: it asks only for read-only tool calls to be sent (no intent has to be
/// durable before a call that may be repeated freely), for the model to be called (a model
/// call changes nothing outside the run), or for a candidate answer to be verified (the
/// verifiers run in this process and touch nothing). So a crash in the window loses only
/// model replies and read-only results, which the resumed run asks for again from the last
/// commit. Every other effect (a call that writes, a retry timer, compensation, the end of
/// the run) waits for its transition, and the window with it, to be stored.
fn may_wait_in_window(effects: &[Effect], run: &RunState) -> bool {
    !effects.is_empty()
        && effects.iter().all(|e| match e {
            Effect::ExecuteTool { call_id, .. } => run.call(call_id).is_some_and(|c| {
                c.effect == crate::tool::ToolEffect::Read
                    && c.status == crate::run::state::CallStatus::Dispatched
            }),
            Effect::Verify { .. } | Effect::CallModel { .. } => true,
            _ => false,
        })
}

/// Commits the state `live.run` reached by `transition` with its one event (and the events of
/// transitions still waiting), publishes them, then carries out the effects. A transition that
/// may wait (`may_wait_in_window`) instead joins the commit window, opening it if none is
/// open: its effects are carried out at once, and it is committed with the transitions after
/// it, at the latest when the window closes. Nothing is published before it is stored.
async fn commit_transition(
    myself: &ActorRef<RunMsg>,
    deps: &Arc<RunDeps>,
    live: &mut Live,
    transition: Transition,
    cause: Cause,
    prev_version: u64,
    prev_status: crate::run::state::Status,
) -> Result<Applied, ActorProcessingErr> {
    let now = live.run.updated_at_ms;
    let mut data = transition.data;
    deps.redactor.redact_value_in_place(&mut data);
    let record = EventRecord {
        seq: live.run.version,
        at_ms: now,
        kind: transition.kind.to_owned(),
        data,
    };
    let mut pending = live.uncommitted.take().unwrap_or(Uncommitted {
        expected_version: prev_version,
        stored_status: prev_status,
        events: Vec::new(),
    });
    pending.events.push(record);
    if let Some(window) = deps.commit_window
        && cause == Cause::Work
        && pending.events.len() < MAX_WINDOW_EVENTS
        && live.run.status == pending.stored_status
        && may_wait_in_window(&transition.effects, &live.run)
        && !holds_untrimmed_output(live)
    {
        // The window's timer runs from its first transition: later ones join it and close
        // with it, so nothing waits longer than `commit_window`.
        let opens = pending.events.len() == 1;
        let expected_version = pending.expected_version;
        live.uncommitted = Some(pending);
        if opens {
            myself.send_after(window, move || RunMsg::CommitWindowClosed {
                expected_version,
            });
        }
        for effect in transition.effects {
            execute(myself, deps, live, effect);
        }
        return Ok(Applied::Done);
    }
    match commit_pending(myself, deps, live, pending).await? {
        Applied::Done => {}
        other => return Ok(other),
    }
    for effect in transition.effects {
        execute(myself, deps, live, effect);
    }
    schedule_passivation(myself, deps, live);
    arm_approval_timers(myself, live, now);
    Ok(Applied::Done)
}

/// Keeps of each stored tool output only what the context shows of it (the agent's
/// `max_tool_output_bytes`): the whole output stays in the stored transcript, read by
/// reference when `read_output` pages beyond it. So a run's memory follows what its model is
/// shown, not the size of every output it got.
fn trim_outputs(live: &mut Live) {
    let keep = live.agent.spec.context.max_tool_output_bytes;
    live.run.trim_stored_outputs(live.writer.stored(), keep);
}

/// Commits the transitions still waiting in `live.uncommitted` on their own (their window
/// closed, or a reader asks for the state).
async fn commit_uncommitted(
    myself: &ActorRef<RunMsg>,
    deps: &Arc<RunDeps>,
    live: &mut Live,
) -> Result<(), ActorProcessingErr> {
    let Some(pending) = live.uncommitted.take() else {
        return Ok(());
    };
    if let Applied::StoreDown = commit_pending(myself, deps, live, pending).await? {
        hold(myself, deps, live, None);
    }
    Ok(())
}

/// Stores `live.run` with `pending`'s events in one commit and publishes them. On a failure the
/// caller holds what it was doing (`StoreDown`) or the actor stops (`LostOwnership`).
async fn commit_pending(
    myself: &ActorRef<RunMsg>,
    deps: &Arc<RunDeps>,
    live: &mut Live,
    pending: Uncommitted,
) -> Result<Applied, ActorProcessingErr> {
    let checkpoint = live
        .writer
        .checkpoint(&mut live.run)
        .map_err(|e| Error::Corrupt {
            run: live.run.id.clone(),
            message: format!("cannot serialize the run: {e}"),
        })?;
    // A run that ends with nothing in flight gives its lease up with its last commit: no late
    // result will need it.
    let last_write = checkpoint.terminal && live.tools_in_flight == 0;
    let committed = if last_write {
        deps.store
            .commit_final(
                &live.lease,
                &checkpoint,
                pending.expected_version,
                &pending.events,
            )
            .await
    } else {
        deps.store
            .commit(
                &live.lease,
                &checkpoint,
                pending.expected_version,
                &pending.events,
            )
            .await
    };
    match committed {
        Ok(()) => {
            if last_write {
                live.released = true;
                deps.leases.remove(&live.run.id);
            }
            live.store_failures = 0;
            live.writer.committed();
            trim_outputs(live);
        }
        Err(e) if e.is_retryable() || matches!(e, store::Error::VersionConflict { .. }) => {
            // `live.run` now holds a state that may or may not be stored (a conflict: the
            // store holds a newer one): it is replaced by the checkpoint read back on reload.
            tracing::warn!(run = %live.run.id, error = %e, "commit failed; pausing the run until its checkpoint is read back");
            return Ok(Applied::StoreDown);
        }
        Err(e) => {
            tracing::warn!(run = %live.run.id, error = %e, "lost ownership of the run; stopping its actor");
            live.cancel.cancel();
            StopReason::LeaseLost.stop(myself);
            return Ok(Applied::LostOwnership);
        }
    }
    deps.metrics
        .transitions
        .fetch_add(pending.events.len() as u64, Ordering::Relaxed);
    deps.metrics.commits.fetch_add(1, Ordering::Relaxed);
    if live.run.status != pending.stored_status {
        deps.metrics.entered_by(&live.run.tenant, live.run.status);
    }
    let terminal = live.run.is_terminal();
    let last = pending.events.len() - 1;
    for (i, record) in pending.events.iter().enumerate() {
        deps.hub
            .publish(&live.run.id, record, terminal && i == last);
    }
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

/// Sends the tool calls held back for the lease, once it is confirmed again.
fn run_deferred(myself: &ActorRef<RunMsg>, deps: &Arc<RunDeps>, live: &mut Live) {
    if live.deferred.is_empty() {
        return;
    }
    if !deps.leases.fresh(&live.run.id, deps.lease_ttl, now_ms()) {
        myself.send_after(DEFERRED_RECHECK, || RunMsg::RetryDeferred);
        return;
    }
    for effect in std::mem::take(&mut live.deferred) {
        execute(myself, deps, live, effect);
    }
}

/// How often a run with held-back tool calls looks at its lease again.
const DEFERRED_RECHECK: Duration = Duration::from_millis(100);

fn execute(myself: &ActorRef<RunMsg>, deps: &Arc<RunDeps>, live: &mut Live, effect: Effect) {
    if matches!(
        effect,
        Effect::ExecuteTool { .. }
            | Effect::CheckStatus { .. }
            | Effect::Compensate { .. }
            | Effect::CheckCompensation { .. }
    ) && !deps.leases.fresh(&live.run.id, deps.lease_ttl, now_ms())
    {
        // The lease could lapse before the call is answered and another node could take the
        // run: send nothing until the renewal confirms it (the intent is committed either way).
        if live.deferred.is_empty() {
            tracing::warn!(run = %live.run.id, "lease not confirmed recently; holding tool calls until it is");
            myself.send_after(DEFERRED_RECHECK, || RunMsg::RetryDeferred);
        }
        live.deferred.push(effect);
        return;
    }
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
                prior_replies: run
                    .messages
                    .iter()
                    .filter(|m| matches!(m, Message::Assistant { .. }))
                    .count() as u32,
                tools: match tool_choice {
                    ToolChoice::Auto => live.agent.definitions.clone(),
                    ToolChoice::None => Vec::new().into(),
                },
                tool_choice,
            };
            let me = myself.clone();
            let metrics = deps.metrics.clone();
            let observed = metrics.model_call(&mut live.trace, run, &live.agent.spec.model);
            // Each gateway retry becomes an event on the run (through the machine).
            let notify = myself.clone();
            let on_retry: crate::model::gateway::OnModelRetry = Box::new(move |n| {
                let _ = notify.cast(RunMsg::Event(RunEvent::ModelRetrying {
                    epoch,
                    attempt: n.attempt,
                    error: n.error,
                    wait_ms: n.wait.as_millis() as u64,
                }));
            });
            deps.gateway.submit_observed(
                request,
                live.cancel.clone(),
                Some(on_retry),
                move |outcome| {
                    observed.finish(&outcome);
                    let event = match outcome {
                        Ok(reply) => RunEvent::ModelReplied { epoch, reply },
                        Err(error) => {
                            metrics.model_errors.fetch_add(1, Ordering::Relaxed);
                            RunEvent::ModelFailed { epoch, error }
                        }
                    };
                    let _ = me.cast(RunMsg::Event(event));
                },
            );
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
            if call.tool == crate::run::read_output::READ_OUTPUT_TOOL && !status_check {
                // Runtime-provided: a page of the run's own transcript, answered here, or for
                // an output the run keeps only in part, from its stored transcript entry.
                use crate::run::read_output::{Lookup, lookup, page_of_entry};
                // Its answer is a `ToolFinished` like any tool's, counted the same way.
                live.tools_in_flight += 1;
                match lookup(
                    &run.messages,
                    &run.trimmed_outputs,
                    &run.id,
                    &call.arguments,
                ) {
                    Lookup::Answered(result) => {
                        let _ = me.cast(RunMsg::Event(RunEvent::ToolFinished {
                            epoch,
                            call_id,
                            result,
                        }));
                    }
                    Lookup::Stored {
                        index,
                        call_id: of,
                        offset,
                        max_bytes,
                    } => {
                        let (store, run_id) = (deps.store.clone(), run.id.clone());
                        // Always answered (the store bounds the read): a run waits for its
                        // answers before it stops, and one of an older epoch is ignored.
                        tokio::spawn(async move {
                            let read = store.transcript_entry(&run_id, index as u64).await;
                            let result = match read {
                                Ok(entry) => {
                                    page_of_entry(entry.as_deref(), &of, offset, max_bytes)
                                }
                                Err(e) => ToolResult::failure(ToolError::new(
                                    if e.is_retryable() {
                                        ToolErrorCode::Retryable
                                    } else {
                                        ToolErrorCode::Failed
                                    },
                                    format!(
                                        "the stored output of call {of} could not be read: {}",
                                        e.code()
                                    ),
                                )),
                            };
                            let _ = me.cast(RunMsg::Event(RunEvent::ToolFinished {
                                epoch,
                                call_id,
                                result,
                            }));
                        });
                    }
                }
                return;
            }
            let Some(tool) = live.agent.tools.tool(&call.tool) else {
                // Config changed since the call was validated: answer it without running it.
                live.tools_in_flight += 1;
                let _ = me.cast(RunMsg::Event(RunEvent::ToolFinished {
                    epoch,
                    call_id,
                    result: tool_gone(&call.tool),
                }));
                return;
            };
            let ctx = ToolContext {
                tenant: run.tenant.clone(),
                run_id: run.id.clone(),
                call_id: call_id.clone(),
                idempotency_key: call.key.clone(),
                cancel: live.cancel.child_token(),
                long_running: crate::tool::LongRunning::new(
                    deps.callbacks
                        .as_ref()
                        .filter(|_| !status_check)
                        .map(|c| c.for_call(&run.id, &call_id)),
                ),
            };
            let task_timeout_ms = tool.spec().task_deadline().as_millis() as u64;
            let work = if status_check {
                ToolWork::Status
            } else {
                ToolWork::Call {
                    arguments: call.arguments.clone(),
                }
            };
            let metrics = deps.metrics.clone();
            let redactor = deps.redactor.clone();
            let observed =
                metrics.tool_call(&mut live.trace, run, &call.tool, &call_id, status_check);
            live.tools_in_flight += 1;
            let on_retry = retry_events(myself, epoch, &call_id);
            deps.tools
                .submit_observed(tool, ctx, work, Some(on_retry), move |outcome| {
                    let event = match outcome {
                        ToolOutcome::Result(mut result) => {
                            observed.finish_result(&result);
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
                            observed.finish_status(&outcome);
                            redact_status(&mut outcome, &redactor);
                            RunEvent::StatusChecked {
                                epoch,
                                call_id,
                                outcome,
                            }
                        }
                        ToolOutcome::Accepted { status_url } => RunEvent::ToolAccepted {
                            epoch,
                            call_id,
                            status_url,
                            timeout_ms: task_timeout_ms,
                        },
                        // Only poll jobs answer this (`long_running`).
                        ToolOutcome::Polled(_) => return,
                    };
                    let _ = me.cast(RunMsg::Event(event));
                });
        }
        Effect::Compensate { epoch, call_id } => {
            compensate::execute(myself, deps, live, epoch, call_id, false);
        }
        Effect::CheckCompensation { epoch, call_id } => {
            compensate::execute(myself, deps, live, epoch, call_id, true);
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
        Effect::PollTool { epoch, call_id } => {
            long_running::start(myself, live, epoch, call_id, None);
        }
        Effect::AbortInFlight => {
            live.deferred.clear();
            live.cancel.cancel();
            live.cancel = CancellationToken::new();
        }
        Effect::Finish => {
            deps.metrics.run_finished(&mut live.trace, &live.run);
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
                StopReason::Finished.stop(myself);
            } else {
                live.finishing = true;
                myself.exit_after(LATE_RESULT_GRACE);
            }
        }
    }
}

/// The answer to a call whose tool the configuration no longer has: it is not run.
fn tool_gone(tool: &str) -> ToolResult {
    ToolResult::failure(ToolError::new(
        ToolErrorCode::ToolNotAllowed,
        format!("tool `{tool}` is no longer available"),
    ))
}

/// Each executor retry of call `call_id` becomes a `ToolRetrying` event on the run (through
/// the machine).
fn retry_events(
    myself: &ActorRef<RunMsg>,
    epoch: u64,
    call_id: &crate::ids::CallId,
) -> crate::tool::executor::OnRetry {
    let notify = myself.clone();
    let call_id = call_id.clone();
    Box::new(move |n| {
        let _ = notify.cast(RunMsg::Event(RunEvent::ToolRetrying {
            epoch,
            call_id: call_id.clone(),
            attempt: n.attempt,
            error: n.error,
            wait_ms: n.wait.as_millis() as u64,
        }));
    })
}

/// A status check's answer redacted like a result before it enters the run.
fn redact_status(
    outcome: &mut Result<Option<ToolResult>, ToolError>,
    redactor: &crate::redact::Redactor,
) {
    match outcome {
        Ok(Some(result)) => result.redact(redactor),
        Err(e) => e.message = redactor.redact_str(&e.message).into_owned(),
        Ok(None) => {}
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
    use serde_json::json;

    #[test]
    fn the_checkpoint_writer_sends_only_what_the_store_lacks() {
        let mut run = RunState::new(
            RunId::generate(),
            "t".into(),
            "a".into(),
            json!("g"),
            Default::default(),
            1,
        );
        let mut w = CheckpointWriter::default();
        let first = w.checkpoint(&mut run).unwrap();
        assert_eq!(first.body, checkpoint_of(&mut run).unwrap().body);
        w.committed();
        // What the store holds, entry by entry, as the commits append it.
        let mut stored: Vec<String> = first.transcript.clone();
        for i in 0..3 {
            run.messages.push(Message::User {
                content: format!("say \"{i}\" \\ é"),
            });
            run.messages.push(Message::Tool {
                call_id: format!("c{i}"),
                content: r#"{"ok":true}"#.into(),
            });
            run.version += 1;
            let c = w.checkpoint(&mut run).unwrap();
            assert_eq!(c.body, checkpoint_of(&mut run).unwrap().body);
            assert_eq!(c.transcript_from as usize, stored.len());
            assert_eq!(c.transcript.len(), 2, "only the new messages");
            // A failed commit is retried with the same entries.
            let again = w.checkpoint(&mut run).unwrap();
            assert_eq!(again.transcript_from, c.transcript_from);
            assert_eq!(again.transcript, c.transcript);
            stored.extend(c.transcript.clone());
            w.committed();
            assert!(w.pending.is_empty(), "nothing stored is kept");
            let mut back = c.clone();
            back.transcript = stored.clone();
            assert_eq!(state_of(&back).unwrap(), run);
        }
        // After a load, it continues from what the store holds.
        let mut loaded = checkpoint_of(&mut run).unwrap();
        loaded.transcript = stored.clone();
        w.loaded(&loaded);
        run.messages.push(Message::User {
            content: "more".into(),
        });
        let c = w.checkpoint(&mut run).unwrap();
        assert_eq!(c.transcript_from as usize, stored.len());
        assert_eq!(c.transcript.len(), 1);
    }
}
