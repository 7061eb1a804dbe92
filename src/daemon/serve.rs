//! The HTTP server: an accept loop over hyper with the bounds a hostile client cannot get
//! around. At most `max_connections` connections are open (beyond that, new ones wait in the
//! listen backlog); a connection whose request headers do not arrive within
//! `header_read_timeout` — counted from accept (also for a client that sends nothing at all),
//! or from the end of the previous response, so idle keep-alive connections too — is closed. A connection whose client takes no bytes for
//! `write_timeout` while there are some to send (a reader that stopped reading, e.g. an SSE
//! client that never reads) is closed too, which ends its stream and frees what it held. On
//! `stop`, no new connection is accepted and every open one shuts down gracefully (in-flight
//! requests finish); the future ends once all are closed.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;

/// The bounds of the server (from `[server]`).
#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    /// A connection's request headers must arrive within this, from accept or from the end
    /// of the previous response; also the HTTP/2 keep-alive ping interval and timeout.
    pub header_read_timeout: Duration,
    /// Connections open at once; further ones wait in the listen backlog.
    pub max_connections: usize,
    /// A connection whose client takes no bytes for this long while some are waiting is
    /// closed.
    pub write_timeout: Duration,
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
            // A client that connects and sends nothing: hyper's header timer and its protocol
            // detection both start at the first byte, so the loop bounds that wait itself.
            // (`peek`, not `readable`: readiness may be reported before any byte is there.)
            let mut first = [0u8; 1];
            let first_byte = tokio::select! {
                biased;
                () = stop.cancelled() => false,
                peeked = tokio::time::timeout(limits.header_read_timeout, stream.peek(&mut first)) => {
                    matches!(peeked, Ok(Ok(n)) if n > 0)
                }
            };
            if !first_byte {
                tracing::trace!(%peer, "closing a connection that sent nothing in time");
                drop(slot);
                drop(open);
                return;
            }
            let io = TokioIo::new(StallLimit::new(stream, limits.write_timeout));
            let conn = builder.serve_connection_with_upgrades(io, service);
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

/// An I/O stream whose writes fail with `TimedOut` once one has waited `limit` for the peer to
/// take bytes: a client that stops reading cannot hold a connection (and the response it is
/// not reading) open forever.
struct StallLimit<T> {
    inner: T,
    limit: Duration,
    /// Armed while a write waits; cleared by any progress.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> StallLimit<T> {
    fn new(inner: T, limit: Duration) -> Self {
        StallLimit {
            inner,
            limit,
            stalled: None,
        }
    }

    /// `Ready(Err)` once the current wait exceeded the limit, `Pending` before.
    fn check<R>(
        &mut self,
        polled: Poll<std::io::Result<R>>,
        cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<R>> {
        match polled {
            Poll::Ready(r) => {
                self.stalled = None;
                Poll::Ready(r)
            }
            Poll::Pending => {
                let limit = self.limit;
                let wait = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                if wait.as_mut().poll(cx).is_ready() {
                    Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the client stopped reading",
                    )))
                } else {
                    Poll::Pending
                }
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StallLimit<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallLimit<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.check(polled, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.check(polled, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.check(polled, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_stops_reading_fails_the_write_after_the_limit() {
        let (near, mut far) = tokio::io::duplex(16);
        let mut io = StallLimit::new(near, Duration::from_secs(30));
        io.write_all(&[1; 16]).await.unwrap();
        // The buffer is full and nobody reads: the write waits, then fails.
        let started = tokio::time::Instant::now();
        let err = io.write_all(&[2; 16]).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(30));
        // A peer that reads, however slowly, keeps the connection.
        let mut io = StallLimit::new(io.inner, Duration::from_secs(30));
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 8];
            let mut got = 0;
            while got < 16 + 64 {
                tokio::time::sleep(Duration::from_secs(20)).await;
                got += far.read(&mut buf).await.unwrap();
            }
            got
        });
        io.write_all(&[3; 64]).await.unwrap();
        assert_eq!(reader.await.unwrap(), 16 + 64);
    }
}
