//! The follow stream: a run's stored events, then its live ones from the hub, each exactly once
//! and in order, until the terminal event or until the reader goes away.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;

use super::actor::RunDeps;
use super::{Error, is_terminal_kind};
use crate::ids::RunId;
use crate::store::EventRecord;

/// Every event of `id` with seq > `after`, stored then live; the stream ends after the terminal
/// event (or when the receiver is dropped).
pub(super) fn stream(
    deps: Arc<RunDeps>,
    id: RunId,
    after: u64,
) -> ReceiverStream<Result<EventRecord, Error>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        // Subscribe before reading the store, so nothing falls between the two.
        let mut live = deps.hub.subscribe(&id);
        let mut last = after;
        loop {
            // Catch up from the store.
            loop {
                let batch = match deps.store.read(&id, last, 256).await {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = tx.send(Err(e.into())).await;
                        return;
                    }
                };
                let n = batch.len();
                for e in batch {
                    last = e.seq;
                    let end = is_terminal_kind(&e.kind);
                    if tx.send(Ok(e)).await.is_err() || end {
                        return;
                    }
                }
                if n < 256 {
                    break;
                }
            }
            // A finished run whose every event has been sent: nothing more will come (this
            // also covers a client resuming after the terminal event).
            if let Ok(Some(cp)) = deps.store.load(&id).await
                && cp.terminal
                && last >= cp.version
            {
                return;
            }
            // Then live, until a gap or a lag sends us back to the store.
            loop {
                // Events of a run owned by another node never reach this node's hub: read the
                // store often then; a run owned here is published live, the store only checked
                // now and then.
                let quiet = if deps.leases.holds(&id) {
                    Duration::from_secs(15)
                } else {
                    Duration::from_millis(500)
                };
                let next = tokio::time::timeout(quiet, live.recv()).await;
                match next {
                    Ok(Ok(e)) if e.seq <= last => continue,
                    Ok(Ok(e)) if e.seq == last + 1 => {
                        last = e.seq;
                        let end = is_terminal_kind(&e.kind);
                        if tx.send(Ok(e)).await.is_err() || end {
                            return;
                        }
                    }
                    Ok(Ok(_)) | Ok(Err(broadcast::error::RecvError::Lagged(_))) => break,
                    Ok(Err(broadcast::error::RecvError::Closed)) => {
                        // The run ended (or the hub dropped us): finish from the store.
                        live = deps.hub.subscribe(&id);
                        break;
                    }
                    Err(_) => {
                        // Quiet for a while: check the store (and the client) again.
                        if tx.is_closed() {
                            return;
                        }
                        break;
                    }
                }
            }
        }
    });
    ReceiverStream::new(rx)
}
