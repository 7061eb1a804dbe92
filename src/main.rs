//! The agentd binary: parses arguments, loads configuration, sets up tracing, binds, and hands
//! over to `daemon::run` (serve) or `cli::exec` (client commands).

use std::process::ExitCode;

/// Runs allocate many small, short-lived objects (messages, events, JSON values); mimalloc
/// spends markedly less CPU and memory on that pattern than the system allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use agentd::cli::{self, Cli, Command, LogFormat, ServeArgs};
use agentd::config::{Config, Secret};
use agentd::redact::RedactingWriter;
use anyhow::Context as _;
use clap::Parser as _;
use tracing_subscriber::EnvFilter;

fn init_tracing(format: LogFormat, serve: bool) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(if serve { "info" } else { "warn" }));
    // Every line passes the configured redactor (installed by the daemon at start).
    let stdout = || RedactingWriter::new(std::io::stdout());
    let stderr = || RedactingWriter::new(std::io::stderr());
    // Colour only for a person at a terminal: files and pipes get plain text.
    use std::io::IsTerminal as _;
    let ansi = if serve {
        std::io::stdout().is_terminal()
    } else {
        std::io::stderr().is_terminal()
    } && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi);
    let _ = match (format, serve) {
        (LogFormat::Json, true) => builder
            .json()
            .with_current_span(true)
            .with_writer(stdout)
            .try_init(),
        (LogFormat::Json, false) => builder.json().with_writer(stderr).try_init(),
        (LogFormat::Text, true) => builder.with_writer(stdout).try_init(),
        (LogFormat::Text, false) => builder.with_writer(stderr).try_init(),
    };
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("SIGINT received"),
        () = term => tracing::info!("SIGTERM received"),
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = Config::load(args.config.as_deref(), std::env::vars())?;
    if let Some(l) = args.listen {
        config.server.listen = l;
    }
    let store_given = args.store.is_some();
    if let Some(s) = args.store {
        config.store.url = s;
    }
    let demo = args.config.is_none();
    config.validate()?;
    // The built-in demo keeps its store where it is documented (./data); anything else must
    // exist already, so a typo in a path is an error rather than a new, empty store.
    let store_dir = file_store_dir(&config.store.url);
    if let Some(dir) = &store_dir
        && !dir.is_dir()
    {
        if args.create_store || (demo && !store_given) {
            std::fs::create_dir_all(dir).with_context(|| {
                format!("could not create the store directory {}", dir.display())
            })?;
        } else {
            anyhow::bail!(
                "store directory {} does not exist (create it, or pass --create-store)",
                dir.display()
            );
        }
    }
    if demo && std::env::var("AGENTD_TOKEN").is_err() {
        let token = dev_token(store_dir.as_deref())?;
        if let Some(t) = config.tenants.iter_mut().find(|t| t.id == "dev") {
            t.tokens = vec![Secret(token.clone()).into()];
        }
        eprintln!(
            "agentd: dev tenant token (set AGENTD_TOKEN to choose one):\n  export AGENTD_TOKEN={token}"
        );
    }
    let listener = tokio::net::TcpListener::bind(&config.server.listen)
        .await
        .with_context(|| format!("could not listen on {}", config.server.listen))?;
    let addr = listener.local_addr()?;
    let embedded = agentd::daemon::Embedded {
        on_ready: Some(Box::new(move || {
            eprintln!("agentd listening on http://{addr}");
        })),
        ..Default::default()
    };
    agentd::daemon::run_with(config, embedded, listener, shutdown_signal()).await?;
    Ok(())
}

/// The directory of a `file:` store URL.
fn file_store_dir(url: &str) -> Option<std::path::PathBuf> {
    let dir = url.strip_prefix("file:")?;
    let dir = dir.strip_prefix("//").unwrap_or(dir);
    (!dir.is_empty()).then(|| std::path::PathBuf::from(dir))
}

/// The demo tenant's token: kept in the store directory (`dev-token`, mode 0600) so an
/// exported `AGENTD_TOKEN` keeps working across restarts; generated on first use. Without a
/// directory (`memory:` or Redis) a new one each start.
fn dev_token(dir: Option<&std::path::Path>) -> anyhow::Result<String> {
    let fresh = || format!("agentd_dev_{}", hex::encode(rand::random::<[u8; 24]>()));
    let Some(dir) = dir else {
        return Ok(fresh());
    };
    let path = dir.join("dev-token");
    match std::fs::read_to_string(&path) {
        Ok(t) if t.trim().starts_with("agentd_dev_") => return Ok(t.trim().to_owned()),
        Ok(_) => anyhow::bail!("{} does not hold a dev token; remove it", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("could not read {}", path.display())),
    }
    let token = fresh();
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    use std::io::Write as _;
    opts.open(&path)
        .and_then(|mut f| writeln!(f, "{token}"))
        .with_context(|| format!("could not write {}", path.display()))?;
    Ok(token)
}

async fn bench(args: agentd::cli::BenchArgs) -> anyhow::Result<()> {
    let url = bench_store_url(&args.store);
    let store = agentd::store::open(&url).await?;
    let opts = agentd::bench::BenchOptions {
        tool_output_bytes: args.tool_output_bytes,
        commit_window: (!args.commit_window.is_zero()).then_some(args.commit_window),
        redis_stats_url: url.starts_with("redis://").then(|| url.clone()),
        runs: args.runs,
        clients: args.clients,
        steps: args.steps,
        model_delay: args.model_delay,
        model_workers: args.model_workers,
        tool_workers: args.tool_workers,
        park: args.park,
        ..Default::default()
    };
    eprintln!(
        "agentd bench: {} runs x {} steps on {}",
        opts.runs, opts.steps, args.store
    );
    let report = agentd::bench::run(opts, store)
        .await
        .map_err(|e| anyhow::anyhow!(e))?;
    println!("{report}");
    Ok(())
}

/// Gives a Redis benchmark its own namespace so it never touches real runs: random, and
/// about as long as the default `agentd`, so keys (and the bytes per step) are as a
/// daemon's.
fn bench_store_url(url: &str) -> String {
    if url.starts_with("redis") && !url.contains("ns=") {
        let sep = if url.contains('?') { '&' } else { '?' };
        let random = uuid::Uuid::new_v4().simple().to_string();
        format!("{url}{sep}ns=b{}", &random[..8])
    } else {
        url.to_owned()
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let usage = e.use_stderr();
            let _ = e.print();
            return ExitCode::from(if usage { cli::EXIT_USAGE as u8 } else { 0 });
        }
    };
    let is_serve = matches!(cli.command, Command::Serve(_));
    let output = cli.output;
    init_tracing(cli.log_format, is_serve);
    agentd::redact::install_panic_hook();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: could not start the async runtime: {e}");
            return ExitCode::from(cli::EXIT_ERROR as u8);
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Serve(args) => serve(args).await.map(|()| 0),
            Command::Bench(args) => bench(args).await.map(|()| 0),
            _ => cli::exec(cli).await,
        }
    });
    // Do not wait for detached tasks (e.g. event followers) after the work is done.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        // The reader went away (`| head`): nothing to say, and nobody to say it to.
        Err(e) if cli::is_closed_output(&e) => ExitCode::from(cli::EXIT_CLOSED_OUTPUT as u8),
        Err(e) => {
            cli::print_error(&e, output);
            ExitCode::from(cli::exit_code_of(&e) as u8)
        }
    }
}
