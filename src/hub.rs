//! Live event fan-out: after an event is committed, its run's actor publishes it here, and SSE
//! streams and waiters receive it. A lagging subscriber falls back to the store, so the hub may
//! drop nothing that matters: the store is the source of truth, the hub only wakes readers.

use dashmap::DashMap;
use tokio::sync::broadcast;

use crate::ids::RunId;
use crate::store::EventRecord;

/// Per-run broadcast channels, created on first subscription.
#[derive(Debug, Default)]
pub struct Hub {
    channels: DashMap<RunId, broadcast::Sender<EventRecord>>,
}

/// Events buffered per run for slow subscribers before they fall back to the store.
const CAPACITY: usize = 256;

impl Hub {
    pub fn new() -> Self {
        Self::default()
    }

    /// Subscribes to the run's future events.
    pub fn subscribe(&self, run: &RunId) -> broadcast::Receiver<EventRecord> {
        self.channels
            .entry(run.clone())
            .or_insert_with(|| broadcast::channel(CAPACITY).0)
            .subscribe()
    }

    /// Publishes a committed event. Cheap when nobody listens.
    pub fn publish(&self, run: &RunId, event: &EventRecord, terminal: bool) {
        if terminal {
            // Receivers still get the buffered events, then `Closed`.
            if let Some((_, tx)) = self.channels.remove(run) {
                let _ = tx.send(event.clone());
            }
            return;
        }
        let stale = match self.channels.get(run) {
            Some(tx) => tx.send(event.clone()).is_err(),
            None => false,
        };
        if stale {
            self.channels
                .remove_if(run, |_, tx| tx.receiver_count() == 0);
        }
    }
}
