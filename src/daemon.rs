//! The daemon as a library call: `daemon::run(config, listener, shutdown)` opens the store,
//! builds the runtime from the configuration, serves the HTTP API on `listener`, and on
//! `shutdown` stops in order, bounded by `server.shutdown_timeout`:
//! readiness goes false → new connections are refused and SSE streams end → in-flight requests
//! drain (at most half the bound) → the runtime checkpoints and stops every run → return.
//!
//! `main.rs` only parses arguments, loads the config, sets up tracing, binds and waits for
//! SIGTERM/SIGINT. Tests call this directly on `127.0.0.1:0`.

pub mod parts;
pub mod serve;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::api::{self, AppState, HttpMetrics, auth::Auth};
use crate::config::{self, Config};
use crate::runtime::{Runtime, StartError};
use crate::tool::Tool;

/// How often the store's epoch marker is compared with the one seen at start.
const STORE_EPOCH_CHECK: std::time::Duration = std::time::Duration::from_secs(5);
pub use parts::{BuildError, Built, build_parts, build_redactor, open_store};

/// What an embedding program adds to the configuration.
#[derive(Default)]
pub struct Embedded {
    /// Native tools, registered beside the configured ones; agents may list them by name.
    pub tools: Vec<Arc<dyn Tool>>,
    /// Called once the daemon serves and is ready (e.g. to print "listening").
    pub on_ready: Option<Box<dyn FnOnce() + Send>>,
}

/// Why the daemon could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration does not validate, or its tenant tokens do not resolve.
    #[error(transparent)]
    Config(#[from] config::Error),
    /// The store, a tool, a model or the callback settings could not be built from it.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// The runtime did not start (e.g. an agent names an unknown model or tool, the node id
    /// is taken, the runs to recover could not be read).
    #[error("could not start the runtime: {0}")]
    Start(#[from] StartError),
    /// The listener's address could not be read, or the HTTP server failed or panicked.
    #[error("the HTTP server failed: {0}")]
    Serve(#[from] std::io::Error),
}

/// Runs the daemon until `shutdown` completes, then stops gracefully.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), Error> {
    run_with(config, Embedded::default(), listener, shutdown).await
}

/// `run` with native tools from the embedding program.
pub async fn run_with(
    config: Config,
    embedded: Embedded,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), Error> {
    let on_ready = embedded.on_ready;
    let extra: Vec<String> = embedded
        .tools
        .iter()
        .map(|t| t.spec().name.clone())
        .collect();
    config.validate_with(&extra)?;
    let auth = Auth::from_tenants(&config.tenants)?;
    let store = open_store(&config.store.url).await?;
    let built = build_parts(&config, store, embedded.tools).await?;
    // Log lines written through `redact::RedactingWriter` are scrubbed of every configured
    // secret from here on.
    crate::redact::install_log_redactor(built.redactor.clone());
    let mcp_servers = built.mcp_servers;
    let mut runtime_config = config.runtime_config();
    // From here on a failed start stops the MCP servers it started.
    let started = match listener.local_addr() {
        Ok(addr) => match parts::build_callbacks(&config, addr) {
            Ok(callbacks) => {
                runtime_config.callbacks = Some(Arc::new(callbacks));
                Runtime::start(runtime_config, built.parts)
                    .await
                    .map_err(Error::from)
            }
            Err(e) => Err(e.into()),
        },
        Err(e) => Err(e.into()),
    };
    let runtime = match started {
        Ok(r) => r,
        Err(e) => {
            for s in &mcp_servers {
                s.shutdown().await;
            }
            return Err(e);
        }
    };
    let state = AppState {
        runtime: runtime.handle(),
        auth: Arc::new(auth),
        limits: Arc::new(config.limits.clone()),
        sse_keep_alive: config.server.sse_keep_alive,
        ready: Arc::new(AtomicBool::new(false)),
        shutdown: CancellationToken::new(),
        http: Arc::new(HttpMetrics::default()),
        open_streams: Arc::default(),
    };
    let app = api::router(state.clone());
    let addr = listener.local_addr()?;
    let stop = state.shutdown.clone();
    let limits = serve::ServerLimits {
        header_read_timeout: config.server.header_read_timeout,
        max_connections: config.server.max_connections,
        write_timeout: config.server.write_timeout,
    };
    let mut server = tokio::spawn(serve::serve(listener, app, limits, stop.clone()));
    state.ready.store(true, Ordering::SeqCst);
    if let Some(ready) = on_ready {
        ready();
    }
    // Watch the store's epoch marker, so a store that lost its data is noticed even when no
    // one probes /readyz.
    let watch = {
        let handle = runtime.handle();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(STORE_EPOCH_CHECK);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = stop.cancelled() => return,
                }
                if let Err(crate::runtime::Error::StoreReset { .. }) =
                    handle.check_store_epoch().await
                {
                    return;
                }
            }
        })
    };
    tracing::info!(%addr, store = %config.store.url.split(':').next().unwrap_or(""), agents = config.agents.len(), "agentd is serving");

    let early = tokio::select! {
        () = shutdown => None,
        r = &mut server => Some(r),
    };
    let bound = config.server.shutdown_timeout;
    let started = Instant::now();
    tracing::info!(timeout = ?bound, "shutting down");
    state.ready.store(false, Ordering::SeqCst);
    stop.cancel();
    watch.abort();
    let served = match early {
        Some(r) => r,
        None => match tokio::time::timeout(bound / 2, &mut server).await {
            Ok(r) => r,
            Err(_) => {
                tracing::warn!("HTTP connections did not drain in time; closing them");
                server.abort();
                Ok(Ok(()))
            }
        },
    };
    let remaining = bound.saturating_sub(started.elapsed());
    if tokio::time::timeout(remaining, runtime.shutdown(remaining / 2))
        .await
        .is_err()
    {
        tracing::warn!("runs did not stop in time; exiting anyway (they resume from checkpoints)");
    }
    for s in &mcp_servers {
        s.shutdown().await;
    }
    tracing::info!(took = ?started.elapsed(), "agentd stopped");
    match served {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(Error::Serve(e)),
        Err(join) => Err(Error::Serve(std::io::Error::other(join.to_string()))),
    }
}
