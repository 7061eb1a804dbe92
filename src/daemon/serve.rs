//! The HTTP server: an accept loop over hyper with the bounds a hostile client cannot get
//! around. At most `max_connections` connections are open (beyond that, new ones wait in the
//! listen backlog); a connection whose request headers do not arrive within
//! `header_read_timeout` — counted from accept, or from the end of the previous response, so
//! idle keep-alive connections too — is closed. On `stop`, no new connection is accepted and
//! every open one shuts down gracefully (in-flight requests finish); the future ends once all
//! are closed.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;

/// The bounds of the server (from `[server]`).
#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    pub header_read_timeout: Duration,
    pub max_connections: usize,
}

/// How long the loop pauses after a failed accept (e.g. out of file descriptors), so it does
/// not spin while the condition lasts.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// Serves `app` on `listener` until `stop` is cancelled and every connection has closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ServerLimits,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    // Every connection task holds a receiver; `closed()` completes when the last one ends.
    let (open_tx, open_rx) = watch::channel(());
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(limits.header_read_timeout)
        .keep_alive_timeout(limits.header_read_timeout);
    let builder = Arc::new(builder);
    loop {
        let slot = tokio::select! {
            biased;
            () = stop.cancelled() => break,
            slot = slots.clone().acquire_owned() => match slot {
                Ok(s) => s,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            biased;
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let builder = builder.clone();
        let stop = stop.clone();
        let open = open_rx.clone();
        tokio::spawn(async move {
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            tokio::pin!(conn);
            let mut stopping = false;
            loop {
                tokio::select! {
                    result = conn.as_mut() => {
                        if let Err(e) = result {
                            tracing::trace!(%peer, error = %e, "connection ended with an error");
                        }
                        break;
                    }
                    () = stop.cancelled(), if !stopping => {
                        stopping = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(slot);
            drop(open);
        });
    }
    drop(listener);
    drop(open_rx);
    open_tx.closed().await;
    Ok(())
}
