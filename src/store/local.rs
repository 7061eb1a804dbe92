//! In-process node registry and wake-ups, shared by the stores that live in one process (memory
//! and file): the same contract as Redis's node keys and wake-up streams, for nodes that can
//! only ever be in this process.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::{Error, Result};
use crate::ids::RunId;

/// Wake-ups kept per node; older ones are dropped (readers that far behind rescan anyway).
pub(crate) const WAKEUPS_KEPT: usize = 10_000;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Node id → (instance, expiry), on the monotonic clock.
#[derive(Debug, Default)]
pub(crate) struct NodeRegistry {
    held: Mutex<HashMap<String, (String, Instant)>>,
}

impl NodeRegistry {
    /// Takes or keeps `node` for `instance` (register and heartbeat are the same operation
    /// here: a lapsed hold that nobody took is simply taken again).
    pub(crate) fn hold(&self, node: &str, instance: &str, ttl: Duration) -> Result<()> {
        let now = Instant::now();
        let mut held = lock(&self.held);
        match held.get(node) {
            Some((other, until)) if other != instance && *until > now => Err(Error::NodeIdInUse {
                node: node.to_owned(),
                holder: other.clone(),
            }),
            _ => {
                held.insert(node.to_owned(), (instance.to_owned(), now + ttl));
                Ok(())
            }
        }
    }

    pub(crate) fn release(&self, node: &str, instance: &str) {
        let mut held = lock(&self.held);
        if held.get(node).is_some_and(|(i, _)| i == instance) {
            held.remove(node);
        }
    }
}

/// One node's recent wake-ups: (seq, run), seq from 1, and a notifier for blocked readers.
#[derive(Debug, Default)]
struct Queue {
    last: u64,
    entries: VecDeque<(u64, RunId)>,
}

#[derive(Debug, Default)]
struct NodeQueue {
    queue: Mutex<Queue>,
    arrived: Notify,
}

/// Per-node wake-up queues. A cursor is the seq of the last wake-up read, in decimal.
#[derive(Debug, Default)]
pub(crate) struct Wakeups {
    nodes: Mutex<HashMap<String, Arc<NodeQueue>>>,
}

impl Wakeups {
    fn node(&self, node: &str) -> Arc<NodeQueue> {
        lock(&self.nodes)
            .entry(node.to_owned())
            .or_default()
            .clone()
    }

    pub(crate) fn notify(&self, node: &str, run: &RunId) {
        let q = self.node(node);
        {
            let mut queue = lock(&q.queue);
            queue.last += 1;
            let seq = queue.last;
            queue.entries.push_back((seq, run.clone()));
            while queue.entries.len() > WAKEUPS_KEPT {
                queue.entries.pop_front();
            }
        }
        q.arrived.notify_waiters();
    }

    pub(crate) async fn read(
        &self,
        node: &str,
        cursor: &str,
        block: Duration,
    ) -> Result<(Vec<RunId>, String)> {
        let q = self.node(node);
        let mut after = if cursor.is_empty() {
            lock(&q.queue).last
        } else {
            cursor.parse::<u64>().map_err(|_| {
                Error::Corrupt(format!(
                    "wake-up cursor {cursor:?} is not one of this store's"
                ))
            })?
        };
        let deadline = tokio::time::Instant::now() + block;
        loop {
            // Registered before looking, so a wake-up between the look and the wait is seen.
            let arrived = q.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            {
                let queue = lock(&q.queue);
                if after > queue.last {
                    // A cursor from before this process (a file store reopened): start over.
                    after = 0;
                }
                let runs: Vec<RunId> = queue
                    .entries
                    .iter()
                    .filter(|(seq, _)| *seq > after)
                    .map(|(_, run)| run.clone())
                    .collect();
                if !runs.is_empty() {
                    return Ok((runs, queue.last.to_string()));
                }
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                return Ok((Vec::new(), after.to_string()));
            }
        }
    }
}
