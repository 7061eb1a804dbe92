//! Live event fan-out: after an event is committed, its run's actor publishes it here, and SSE
//! streams and waiters receive it. A lagging subscriber falls back to the store, so the hub may
//! drop nothing that matters: the store is the source of truth, the hub only wakes readers.
//!
//! A run's channel exists only while someone listens or the run is live: the terminal event
//! removes it, and so does the last [`Subscription`] to go away. Following a finished run (whose
//! terminal event was published long ago) therefore leaves nothing behind.

use std::sync::Arc;

use dashmap::DashMap;
use tokio::sync::broadcast;

use crate::ids::RunId;
use crate::store::EventRecord;

type Channels = DashMap<RunId, broadcast::Sender<EventRecord>>;

/// Per-run broadcast channels, created on first subscription.
#[derive(Debug, Default)]
pub struct Hub {
    channels: Arc<Channels>,
}

/// Events buffered per run for slow subscribers before they fall back to the store.
const CAPACITY: usize = 256;

/// One subscriber to a run's live events. Dropping the last one removes the run's channel.
#[derive(Debug)]
pub struct Subscription {
    rx: broadcast::Receiver<EventRecord>,
    run: RunId,
    channels: Arc<Channels>,
}

impl Subscription {
    /// The next live event (see `broadcast::Receiver::recv`).
    pub async fn recv(&mut self) -> Result<EventRecord, broadcast::error::RecvError> {
        self.rx.recv().await
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        // Checked under the map's shard lock, so a concurrent `subscribe` either keeps the
        // channel alive or creates a new one.
        // Only our own channel, and only when we are its last receiver: after the run ended,
        // the entry may already be a newer channel of other subscribers.
        let ours = &self.rx;
        self.channels.remove_if(&self.run, |_, tx| {
            tx.receiver_count() <= 1 && tx.subscribe().same_channel(ours)
        });
    }
}

impl Hub {
    /// A hub with no channels.
    pub fn new() -> Self {
        Self::default()
    }

    /// Subscribes to the run's future events.
    pub fn subscribe(&self, run: &RunId) -> Subscription {
        let rx = self
            .channels
            .entry(run.clone())
            .or_insert_with(|| broadcast::channel(CAPACITY).0)
            .subscribe();
        Subscription {
            rx,
            run: run.clone(),
            channels: self.channels.clone(),
        }
    }

    /// Runs with a channel (someone listens, or a live run published to listeners).
    pub fn len(&self) -> usize {
        self.channels.len()
    }

    /// Whether no run has a channel.
    pub fn is_empty(&self) -> bool {
        self.channels.is_empty()
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn event(seq: u64, kind: &str) -> EventRecord {
        EventRecord {
            seq,
            at_ms: 0,
            kind: kind.into(),
            data: serde_json::Value::Null,
        }
    }

    #[tokio::test]
    async fn following_a_finished_run_leaves_no_channel_behind() {
        let hub = Hub::new();
        let run = RunId::generate();
        // A finished run: its terminal event went out before anyone subscribed.
        hub.publish(&run, &event(3, "run_succeeded"), true);
        for _ in 0..100 {
            let s = hub.subscribe(&run);
            assert_eq!(hub.len(), 1);
            drop(s);
        }
        assert!(hub.is_empty(), "{} channels left", hub.len());
    }

    #[tokio::test]
    async fn the_channel_lives_while_anyone_listens_and_a_new_one_is_left_alone() {
        let hub = Hub::new();
        let run = RunId::generate();
        let first = hub.subscribe(&run);
        let mut second = hub.subscribe(&run);
        drop(first);
        assert_eq!(hub.len(), 1, "the second subscriber still listens");
        hub.publish(&run, &event(1, "run_started"), false);
        assert_eq!(second.recv().await.unwrap().seq, 1);
        // The run ends; a new follower subscribes before the old one goes away.
        hub.publish(&run, &event(2, "run_succeeded"), true);
        let mut newer = hub.subscribe(&run);
        drop(second);
        assert_eq!(
            hub.len(),
            1,
            "the newer channel is not the old one's to remove"
        );
        hub.publish(&run, &event(3, "late_result_ignored"), false);
        assert_eq!(newer.recv().await.unwrap().seq, 3);
        drop(newer);
        assert!(hub.is_empty());
    }
}
