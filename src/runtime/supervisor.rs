//! `RunSupervisor`: parent of every run actor. It starts runs, routes control messages to them,
//! and restarts a crashed run from its last checkpoint within a restart budget.
//!
//! ```text
//! RunSupervisor
//!  ├─ RunActor run_…   (one per live run; restarted here after a panic or handler error)
//!  └─ …
//! ModelGateway, ToolExecutor: separate pools, not children, so this supervisor only ever sees
//! run actors.
//! ```
//!
//! Its handlers never fail and never block: no store calls here (the run actor loads its own
//! checkpoint in `post_start`), backoff through timers. Control messages that arrive while a run
//! is down wait here and are delivered after the restart; they are also in the store, so even
//! losing them here loses nothing.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use serde::{Deserialize, Serialize};

use super::actor::{
    Boot, ControlReply, CreatedRun, RunActor, RunArgs, RunDeps, RunMsg, StopReason,
};
use crate::ids::RunId;

/// How often a crashing run is restarted before it fails with `crash_loop`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartPolicy {
    /// Crashes allowed within `window`; one more fails the run.
    pub max_restarts: u32,
    /// How far back crashes are counted (a sliding window).
    #[serde(with = "crate::config_duration")]
    pub window: Duration,
    /// Wait before the first restart; it doubles with each further crash in the window.
    #[serde(with = "crate::config_duration")]
    pub backoff_base: Duration,
    /// Longest wait before a restart (before the ±20 % jitter).
    #[serde(with = "crate::config_duration")]
    pub backoff_max: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            max_restarts: 3,
            window: Duration::from_secs(600),
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
        }
    }
}

impl RestartPolicy {
    /// Exponential backoff for the `n`-th restart, with ±20 % jitter.
    pub fn backoff(&self, n: u32) -> Duration {
        let exp = self
            .backoff_base
            .saturating_mul(1u32 << n.saturating_sub(1).min(16));
        exp.min(self.backoff_max)
            .mul_f64(0.8 + rand::random::<f64>() * 0.4)
    }
}

/// The supervisor.
#[derive(Debug)]
pub struct RunSupervisor;

/// What the supervisor handles.
pub enum SupervisorMsg {
    /// Start (or adopt) a run's actor.
    Start {
        /// The run.
        id: RunId,
        /// How its actor begins.
        boot: Boot,
    },
    /// Start the actor of a run this node has just created, from the checkpoint it stored
    /// (so the actor does not read it back) and with the lease the create took.
    StartCreated {
        /// The run.
        id: RunId,
        /// What the create stored and took.
        created: Box<CreatedRun>,
    },
    /// A control was stored at inbox `seq`: wake the run's actor (bringing it back if it is
    /// not live); the reply comes from the actor once that entry is consumed.
    Control {
        /// The run the control is for.
        id: RunId,
        /// The control's position in the run's inbox.
        seq: u64,
        /// Gets the run's state once the entry is consumed, or why it did not apply.
        reply: RpcReplyPort<ControlReply>,
    },
    /// Controls were stored for the run (through another node): wake its actor.
    Wake(RunId),
    /// The run needs an owner and this node has room: take it over.
    TakeOver(RunId),
    /// Another node holds the run's lease now: stop its actor here.
    LeaseLost(RunId),
    /// A backoff timer fired: start the run again from its checkpoint.
    Respawn(RunId),
    /// Number of runs with a live or restarting actor.
    Count(RpcReplyPort<usize>),
}

/// Start arguments.
pub struct SupervisorArgs {
    /// The dependencies every run actor it starts shares.
    pub deps: Arc<RunDeps>,
    /// When a crashing run is restarted, and when it fails `crash_loop` instead.
    pub restart: RestartPolicy,
}

#[derive(Default)]
struct Entry {
    actor: Option<ActorRef<RunMsg>>,
    crashes: VecDeque<Instant>,
    /// Messages for the run while it is down.
    pending: Vec<RunMsg>,
    /// A crash_loop abort is in progress: a further crash gives up.
    aborting: bool,
}

/// The supervisor's state.
pub struct SupervisorState {
    deps: Arc<RunDeps>,
    restart: RestartPolicy,
    runs: HashMap<RunId, Entry>,
    by_actor: HashMap<ActorId, RunId>,
}

impl SupervisorState {
    /// One run actor fewer (the gauge is kept here, where every start and end is seen).
    fn actor_gone(&self) {
        self.deps
            .metrics
            .live_runs
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }

    async fn spawn(&mut self, myself: &ActorRef<SupervisorMsg>, id: RunId, boot: Boot) {
        self.spawn_for(myself, id, boot, false, None).await;
    }

    /// `spawn`; `wake_owner`: the actor is started for a stored control, so if another node
    /// owns the run it wakes that node instead.
    async fn spawn_for(
        &mut self,
        myself: &ActorRef<SupervisorMsg>,
        id: RunId,
        boot: Boot,
        wake_owner: bool,
        created: Option<Box<CreatedRun>>,
    ) {
        let args = RunArgs {
            id: id.clone(),
            boot,
            deps: self.deps.clone(),
            wake_owner,
            created,
        };
        match Actor::spawn_linked(None, RunActor, args, myself.get_cell()).await {
            Ok((actor, _join)) => {
                let entry = self.runs.entry(id.clone()).or_default();
                for msg in entry.pending.drain(..) {
                    if let Err(e) = actor.send_message(msg) {
                        tracing::warn!(run = %id, error = %e, "could not deliver a buffered message");
                    }
                }
                self.by_actor.insert(actor.get_id(), id);
                entry.actor = Some(actor);
                self.deps
                    .metrics
                    .live_runs
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Err(e) => {
                // pre_start does no I/O, so this is a bug; count it as a crash.
                tracing::error!(run = %id, error = %e, "run actor failed to start");
                self.crashed(myself, id, e.to_string());
            }
        }
    }

    /// Sends `msg` to the run's actor; keeps it while the run restarts, and brings a run that is
    /// not live here (passivated, or waiting since before a restart) back from its checkpoint.
    async fn deliver(&mut self, myself: &ActorRef<SupervisorMsg>, id: RunId, msg: RunMsg) {
        match self.runs.get_mut(&id) {
            Some(Entry {
                actor: Some(actor), ..
            }) => {
                if let Err(ractor::MessagingErr::SendErr(msg)) = actor.send_message(msg) {
                    // The actor just died; its failure event is on its way.
                    if let Some(e) = self.runs.get_mut(&id) {
                        e.pending.push(msg);
                    }
                }
            }
            Some(entry) => entry.pending.push(msg),
            None => {
                self.runs.entry(id.clone()).or_default().pending.push(msg);
                self.spawn_for(myself, id, Boot::Rehydrate, true, None)
                    .await;
            }
        }
    }

    fn crashed(&mut self, myself: &ActorRef<SupervisorMsg>, id: RunId, error: String) {
        self.deps
            .metrics
            .restarts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let now = Instant::now();
        let window = self.restart.window;
        let entry = self.runs.entry(id.clone()).or_default();
        entry.actor = None;
        entry.crashes.push_back(now);
        while entry
            .crashes
            .front()
            .is_some_and(|t| now.duration_since(*t) > window)
        {
            entry.crashes.pop_front();
        }
        let n = entry.crashes.len() as u32;
        if entry.aborting {
            tracing::error!(run = %id, %error, "run crashed while being failed for crash_loop; leaving it for the next start");
            self.runs.remove(&id);
            return;
        }
        if n > self.restart.max_restarts {
            tracing::error!(run = %id, crashes = n, %error, "run keeps crashing; failing it with crash_loop");
            entry.aborting = true;
            self.deps
                .metrics
                .crash_loops
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let boot = Boot::Abort {
                code: "crash_loop".into(),
                message: format!("the run crashed {n} times within {window:?}; last: {error}"),
            };
            let me = myself.clone();
            // Through the mailbox, so this handler stays short.
            let _ = me.cast(SupervisorMsg::Start { id, boot });
            return;
        }
        let wait = self.restart.backoff(n);
        tracing::warn!(run = %id, crash = n, ?wait, %error, "run crashed; restarting from its checkpoint");
        myself.send_after(wait, move || SupervisorMsg::Respawn(id));
    }
}

impl Actor for RunSupervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<SupervisorMsg>,
        args: SupervisorArgs,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        Ok(SupervisorState {
            deps: args.deps,
            restart: args.restart,
            runs: HashMap::new(),
            by_actor: HashMap::new(),
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        st: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::Start { id, boot } => {
                let live = st.runs.get(&id).is_some_and(|e| e.actor.is_some());
                if !live {
                    st.spawn(&myself, id, boot).await;
                }
            }
            SupervisorMsg::StartCreated { id, created } => {
                let live = st.runs.get(&id).is_some_and(|e| e.actor.is_some());
                if !live {
                    st.spawn_for(&myself, id, Boot::Start, false, Some(created))
                        .await;
                }
            }
            SupervisorMsg::Respawn(id) => {
                if st.runs.get(&id).is_some_and(|e| e.actor.is_none()) {
                    st.spawn(&myself, id, Boot::Recover).await;
                }
            }
            SupervisorMsg::Control { id, seq, reply } => {
                let msg = RunMsg::Controls {
                    reply: Some((seq, reply)),
                };
                st.deliver(&myself, id, msg).await;
            }
            SupervisorMsg::Wake(id) => {
                st.deliver(&myself, id, RunMsg::Controls { reply: None })
                    .await;
            }
            SupervisorMsg::TakeOver(id) => {
                if !st.runs.contains_key(&id) {
                    st.spawn(&myself, id, Boot::TakeOver).await;
                }
            }
            SupervisorMsg::LeaseLost(id) => {
                if let Some(actor) = st.runs.get(&id).and_then(|e| e.actor.as_ref()) {
                    actor.stop(Some(StopReason::LeaseLost.encode()));
                }
            }
            SupervisorMsg::Count(reply) => {
                let _ = reply.send(st.runs.len());
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupervisorMsg>,
        evt: SupervisionEvent,
        st: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match evt {
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                if let Some(id) = st.by_actor.remove(&cell.get_id()) {
                    st.actor_gone();
                    let still_this_actor = st
                        .runs
                        .get(&id)
                        .and_then(|e| e.actor.as_ref())
                        .is_some_and(|a| a.get_id() == cell.get_id());
                    if still_this_actor {
                        let pending = st.runs.remove(&id).map(|e| e.pending).unwrap_or_default();
                        let reason = StopReason::decode(reason.as_deref());
                        let passivated = match reason {
                            Some(StopReason::Passivated { wake_at_ms }) => Some(wake_at_ms),
                            _ => None,
                        };
                        if !pending.is_empty() && passivated.is_some() {
                            // Mail arrived while it was stopping: bring it straight back.
                            st.runs.entry(id.clone()).or_default().pending = pending;
                            st.spawn_for(&myself, id, Boot::Rehydrate, true, None).await;
                        } else if let Some(Some(wake_at)) = passivated {
                            // Its deadline or an approval expiry will need it.
                            let wait = Duration::from_millis(
                                wake_at.saturating_sub(crate::clock::now_ms()),
                            );
                            myself.send_after(wait, move || SupervisorMsg::Start {
                                id,
                                boot: Boot::Rehydrate,
                            });
                        } else if !pending.is_empty() {
                            tracing::debug!(run = %id, ?reason, n = pending.len(), "run stopped with messages pending");
                        }
                    }
                }
            }
            SupervisionEvent::ActorFailed(cell, err) => {
                if let Some(id) = st.by_actor.remove(&cell.get_id()) {
                    st.actor_gone();
                    st.crashed(&myself, id, err.to_string());
                }
            }
            _ => {}
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<SupervisorMsg>,
        _st: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        // Let every run actor run its post_stop (cancel in-flight work) before we are gone.
        myself
            .stop_children_and_wait(
                Some(StopReason::Shutdown.encode()),
                Some(Duration::from_secs(10)),
            )
            .await;
        Ok(())
    }
}
