//! The `agentd` command line: `serve` (in `main.rs`), and the client commands that talk to a
//! daemon over HTTP (`run`, `runs …`, `agents`, `healthcheck`) plus `config check`.
//!
//! Exit codes of `run --follow` and `runs events --follow` (see `EXIT_CODES`).
//!
//! Output goes through `outln!`, which returns a write error instead of panicking: a closed
//! stdout (`agentd … | head -3`) ends the command quietly with [`EXIT_CLOSED_OUTPUT`].

/// `println!` on stdout that returns the `io::Result` instead of panicking when stdout is
/// closed.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)
    }};
}

pub mod check;
pub mod client;
pub mod timeline;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand, ValueEnum};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use reqwest::Method;
use serde_json::{Value, json};

use crate::api::dto::{AgentListDto, ApprovalListDto, EventListDto, RunDto, RunListDto};
use crate::config::Config;
use client::Client;

/// Exit codes, shown in `--help`.
pub const EXIT_CODES: &str = "\
Exit codes:
  0  success (with --follow: the run succeeded)
  1  with --follow: the run failed
  2  with --follow: the run was cancelled
  3  with --follow: the run waits for an operator (approval or input); the commands to run are printed
  4  the request failed otherwise (API error, bad config, bad input)
  5  unauthorised: missing, unknown or insufficient token (401, 403)
  6  not found: no such run, call or agent (404)
  7  conflict: the run's state does not allow it (409)
  8  overloaded: too many active runs, try later (429)
  9  unavailable: the daemon is unreachable, starting, draining or its store is down (503)
  64 usage error
  141 stdout was closed before the output was complete (e.g. `| head`), as for SIGPIPE
With --output json, an error is printed to stdout as {\"error\": {\"code\", \"message\", \"http_status\"}}.";

/// Exit code: the run failed.
pub const EXIT_FAILED: i32 = 1;
/// Exit code: the run was cancelled.
pub const EXIT_CANCELLED: i32 = 2;
/// Exit code: the run waits for an operator.
pub const EXIT_WAITING: i32 = 3;
/// Exit code: the command could not complete.
pub const EXIT_ERROR: i32 = 4;
/// Exit code: the token is missing, unknown or lacks the scope.
pub const EXIT_UNAUTHORISED: i32 = 5;
/// Exit code: no such run, call or agent.
pub const EXIT_NOT_FOUND: i32 = 6;
/// Exit code: the run's state does not allow the request.
pub const EXIT_CONFLICT: i32 = 7;
/// Exit code: the daemon refused for load (429).
pub const EXIT_OVERLOADED: i32 = 8;
/// Exit code: the daemon is unreachable or unavailable (503).
pub const EXIT_UNAVAILABLE: i32 = 9;
/// Exit code: bad usage.
pub const EXIT_USAGE: i32 = 64;
/// Exit code: stdout was closed before the output was complete (128 + SIGPIPE, what a shell
/// reports for a tool the signal stopped).
pub const EXIT_CLOSED_OUTPUT: i32 = 141;

/// Whether `e` is a write to a closed stdout (a reader such as `head` went away).
pub fn is_closed_output(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// The exit code of a failed command (see [`EXIT_CODES`]).
pub fn exit_code_of(err: &anyhow::Error) -> i32 {
    if let Some(f) = err.downcast_ref::<client::ApiFailure>() {
        return match f.status.as_u16() {
            401 | 403 => EXIT_UNAUTHORISED,
            404 => EXIT_NOT_FOUND,
            409 => EXIT_CONFLICT,
            429 => EXIT_OVERLOADED,
            503 => EXIT_UNAVAILABLE,
            _ => EXIT_ERROR,
        };
    }
    if err.downcast_ref::<client::Unreachable>().is_some() {
        return EXIT_UNAVAILABLE;
    }
    EXIT_ERROR
}

/// Prints a failed command's error: a line on stderr, and with `--output json` the error
/// object on stdout (its `code` is the API's, or `unreachable`, or `error`).
pub fn print_error(err: &anyhow::Error, output: Output) {
    if output == Output::Json {
        let (code, status, message) = match err.downcast_ref::<client::ApiFailure>() {
            Some(f) => (f.code.clone(), Some(f.status.as_u16()), f.message.clone()),
            None if err.downcast_ref::<client::Unreachable>().is_some() => {
                ("unreachable".to_owned(), None, format!("{err:#}"))
            }
            None => ("error".to_owned(), None, format!("{err:#}")),
        };
        let mut e = json!({ "code": code, "message": message, "http_status": status });
        if let Some(st) = err
            .downcast_ref::<client::ApiFailure>()
            .and_then(|f| f.run_status.clone())
        {
            e["status"] = json!(st);
        }
        let _ = outln!("{}", json!({ "error": e }));
    }
    eprintln!("error: {err:#}");
}

/// `-` means "read it from stdin" (at most 1 MiB).
fn arg_or_stdin(value: String, what: &str) -> anyhow::Result<String> {
    if value != "-" {
        return Ok(value);
    }
    use std::io::Read as _;
    let mut text = String::new();
    std::io::stdin()
        .take((1 << 20) + 1)
        .read_to_string(&mut text)
        .with_context(|| format!("could not read {what} from stdin"))?;
    anyhow::ensure!(
        text.len() <= 1 << 20,
        "{what} on stdin is larger than 1 MiB"
    );
    Ok(text.trim_end_matches(['\n', '\r']).to_owned())
}

/// How results are printed.
// The variants' docs are for readers of the API: `help = None` keeps `--help` as it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Tables and lines for people.
    #[value(help = None)]
    Table,
    /// JSON for scripts (errors too).
    #[value(help = None)]
    Json,
}

/// Log line format of `serve`.
// The variants' docs are for readers of the API: `help = None` keeps `--help` as it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[value(help = None)]
    Text,
    /// One JSON object per line.
    #[value(help = None)]
    Json,
}

/// The version line: package version and git commit.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("AGENTD_COMMIT"),
    ")"
);

/// agentd: runs many LLM agent runs at once and keeps each one safe.
///
/// `serve` runs the daemon; every other command is a client of a running daemon
/// (`--url`, `--token`).
#[derive(Debug, Parser)]
#[command(
    name = "agentd",
    version = VERSION,
    after_help = EXIT_CODES,
    subcommand_help_heading = "Commands"
)]
pub struct Cli {
    /// URL of the daemon (client commands).
    #[arg(
        long,
        global = true,
        env = "AGENTD_URL",
        default_value = "http://127.0.0.1:7700",
        help_heading = "Global options"
    )]
    pub url: String,
    /// Bearer token of your tenant (client commands).
    #[arg(
        long,
        global = true,
        env = "AGENTD_TOKEN",
        hide_env_values = true,
        help_heading = "Global options"
    )]
    pub token: Option<String>,
    /// Output format of client commands: a table for people, JSON for scripts (errors too).
    #[arg(
        long,
        global = true,
        value_enum,
        default_value = "table",
        help_heading = "Global options"
    )]
    pub output: Output,
    /// Log format (logs go to stdout for `serve`, stderr otherwise; filter with RUST_LOG).
    #[arg(
        long,
        global = true,
        value_enum,
        env = "AGENTD_LOG_FORMAT",
        default_value = "text",
        help_heading = "Global options"
    )]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands of `agentd`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon. Without --config: the built-in demo (agents `demo`, `demo_approval` and `demo_input`,
    /// tenant `dev` whose token is $AGENTD_TOKEN or a generated one printed at start).
    Serve(ServeArgs),
    /// Start a run of AGENT with INPUT; with --follow, stream its timeline until it ends.
    Run(RunArgs),
    /// Inspect and control runs.
    #[command(subcommand)]
    Runs(RunsCommand),
    /// The approvals inbox: every call waiting for an operator, oldest first; approve or
    /// reject them.
    Approvals(ApprovalsArgs),
    /// The configured agents and their tools.
    Agents,
    /// Exit 0 when GET /healthz answers 200 (for container health checks).
    Healthcheck {
        /// Give up after this long.
        #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
        timeout: Duration,
    },
    /// Configuration tools.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Load generator: N concurrent runs of K tool steps on the scripted model and a tool
    /// with outputs of a chosen size, in this process; prints steps per second, step latency,
    /// memory per run, and on Redis the bytes and commands per step, by turn.
    Bench(BenchArgs),
    /// Print a shell completion script: `agentd completions bash > /etc/bash_completion.d/agentd`.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
    /// Print the version and the git commit it was built from.
    Version,
}

/// `agentd bench`: the in-process load generator.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Concurrent runs.
    #[arg(long, default_value_t = 1000)]
    pub runs: usize,
    /// Runs created at once at the start, as that many clients would (1: one after another).
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// Tool steps per run.
    #[arg(long, default_value_t = 10)]
    pub steps: u32,
    /// Store: memory:, file:DIR or redis://HOST:PORT/DB (a fresh namespace is used).
    #[arg(long, default_value = "memory:")]
    pub store: String,
    /// Scripted model latency per call, e.g. 50ms (0 measures the runtime alone).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    pub model_delay: Duration,
    /// Model pool size.
    #[arg(long, default_value_t = 256)]
    pub model_workers: usize,
    /// Tool pool size.
    #[arg(long, default_value_t = 256)]
    pub tool_workers: usize,
    /// Measure memory instead: park every run in waiting_input, sample RSS, cancel them.
    #[arg(long)]
    pub park: bool,
    /// Bytes of each tool output, at most 65536 (0: a short text). On a redis:// store, bytes
    /// and commands Redis received per step are printed, in all and for each tenth of the
    /// turns (from INFO; other clients of the server count too).
    #[arg(long, default_value_t = 0)]
    pub tool_output_bytes: usize,
    /// The runtime's commit window (runtime.commit_window): how long transitions with only
    /// read-only calls, model calls or a verification to carry out may wait to be committed
    /// together; 0s commits every transition on its own.
    #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
    pub commit_window: Duration,
}

/// `agentd serve`: where the configuration comes from, and what overrides it.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// TOML configuration file (see config/default.toml).
    #[arg(long, env = "AGENTD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Listen address; overrides the config's server.listen.
    #[arg(long)]
    pub listen: Option<String>,
    /// Store URL; overrides the config's store.url.
    #[arg(long)]
    pub store: Option<String>,
    /// Create a `file:` store's directory if it does not exist (otherwise that is an error;
    /// the built-in demo creates its default ./data).
    #[arg(long)]
    pub create_store: bool,
}

/// `agentd run`: the run to start, and whether to follow it.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The agent to run (`agentd agents` lists them).
    pub agent: String,
    /// The goal (text; with --json-input, a JSON value; `-` reads it from stdin).
    pub input: String,
    /// Parse INPUT as JSON.
    #[arg(long)]
    pub json_input: bool,
    /// Stream the run's timeline until it ends or waits for an operator.
    #[arg(long)]
    pub follow: bool,
    /// With --follow: keep following while the run waits for an operator.
    #[arg(long, requires = "follow")]
    pub wait: bool,
    /// The same key returns the same run.
    #[arg(long)]
    pub idempotency_key: Option<String>,
    /// Budget: most model turns (default: the agent's).
    #[arg(long)]
    pub max_turns: Option<u32>,
    /// Budget: most tool calls (default: the agent's).
    #[arg(long)]
    pub max_tool_calls: Option<u32>,
    /// Budget: most tokens, input and output (default: the agent's).
    #[arg(long)]
    pub max_tokens: Option<u64>,
    /// Wall-clock limit, e.g. "5m".
    #[arg(long)]
    pub deadline: Option<String>,
}

/// `agentd runs …`: inspect and control runs.
#[derive(Debug, Subcommand)]
pub enum RunsCommand {
    /// The tenant's runs, newest first.
    List {
        /// Only runs with this status: created, running, waiting_approval, waiting_input,
        /// succeeded, failed, cancelled.
        #[arg(long)]
        status: Option<String>,
        /// Only runs of this agent.
        #[arg(long)]
        agent: Option<String>,
        /// Most runs to list (the daemon caps it at limits.max_page_size).
        #[arg(long)]
        limit: Option<usize>,
        /// Continue after this cursor (printed under a full page).
        #[arg(long)]
        cursor: Option<String>,
    },
    /// One run, with its input, pending approvals, output or error.
    Get {
        /// The run (`run_…`).
        id: String,
    },
    /// The run's events; with --follow, live until it ends (NDJSON with --output json, each
    /// line with its run_id).
    Events {
        /// The run (`run_…`).
        id: String,
        /// Only events after this sequence number.
        #[arg(long, default_value_t = 0)]
        after: u64,
        /// Stream the run's timeline until it ends or waits for an operator.
        #[arg(long)]
        follow: bool,
        /// With --follow: keep following while the run waits for an operator.
        #[arg(long, requires = "follow")]
        wait: bool,
    },
    /// Cancel a run (idempotent).
    Cancel {
        /// The run (`run_…`).
        id: String,
        /// Why (kept in the run's events).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Approve a pending tool call (optionally with edited arguments).
    Approve {
        /// The run (`run_…`).
        id: String,
        /// The call (`call_…`).
        call_id: String,
        /// Edited arguments, as JSON (`-` reads them from stdin).
        #[arg(long)]
        arguments: Option<String>,
        /// Why (kept in the run's events).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Reject a pending tool call (a held failing call is skipped; the model is told).
    Reject {
        /// The run (`run_…`).
        id: String,
        /// The call (`call_…`).
        call_id: String,
        /// Why (the model sees it).
        #[arg(long)]
        reason: Option<String>,
    },
    /// End the run `failed` at a pending call (e.g. a tool that keeps failing).
    Fail {
        /// The run (`run_…`).
        id: String,
        /// The call (`call_…`).
        call_id: String,
        /// Why (kept in the run's error).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Answer a run waiting for input (or queue input for a running run).
    Input {
        /// The run (`run_…`).
        id: String,
        /// The answer (`-` reads it from stdin).
        text: String,
    },
}

/// `agentd approvals [list|approve|reject|fail]`: without a subcommand, the list.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct ApprovalsArgs {
    /// The action; `None`: list the inbox with `limit` and `cursor`.
    #[command(subcommand)]
    pub command: Option<ApprovalsCommand>,
    /// Most calls to list (the daemon caps it at limits.max_page_size).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Continue after this cursor (printed under a full page).
    #[arg(long)]
    pub cursor: Option<String>,
}

/// `agentd approvals …`: list the inbox or decide one call.
#[derive(Debug, Subcommand)]
pub enum ApprovalsCommand {
    /// List the calls waiting for an operator, oldest first (the default).
    List {
        /// Most calls to list.
        #[arg(long)]
        limit: Option<usize>,
        /// Continue after this cursor.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Approve one waiting call (optionally with edited arguments).
    Approve {
        /// The run (`run_…`).
        run_id: String,
        /// The call (`call_…`).
        call_id: String,
        /// Edited arguments, as JSON (`-` reads them from stdin).
        #[arg(long)]
        arguments: Option<String>,
        /// Why (kept in the run's events).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Reject one waiting call; the model is told it was rejected (or skipped).
    Reject {
        /// The run (`run_…`).
        run_id: String,
        /// The call (`call_…`).
        call_id: String,
        /// Why (the model sees it).
        #[arg(long)]
        reason: Option<String>,
    },
    /// End the run `failed` at one waiting call (e.g. a tool that keeps failing).
    Fail {
        /// The run (`run_…`).
        run_id: String,
        /// The call (`call_…`).
        call_id: String,
        /// Why (kept in the run's error).
        #[arg(long)]
        reason: Option<String>,
    },
}

/// `agentd config …`: configuration tools.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Report every problem `serve` would refuse, or print the effective configuration
    /// (secrets redacted).
    Check {
        /// TOML configuration file (without one: the built-in demo).
        #[arg(long, env = "AGENTD_CONFIG")]
        config: Option<PathBuf>,
    },
}

fn print_json(v: &impl serde::Serialize) -> anyhow::Result<()> {
    outln!("{}", serde_json::to_string_pretty(v)?)?;
    Ok(())
}

fn short(v: &Value, max: usize) -> String {
    let s = match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    };
    if s.chars().count() > max {
        let cut: String = s.chars().take(max.saturating_sub(1)).collect();
        format!("{cut}…")
    } else {
        s
    }
}

fn print_run(run: &RunDto, output: Output) -> anyhow::Result<()> {
    if output == Output::Json {
        return print_json(run);
    }
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    let row = |t: &mut Table, k: &str, v: String| {
        t.add_row(vec![k.to_owned(), v]);
    };
    row(&mut t, "id", run.id.clone());
    row(&mut t, "agent", run.agent.clone());
    row(
        &mut t,
        "status",
        match &run.phase {
            Some(p) => format!("{} ({p})", run.status),
            None => run.status.clone(),
        },
    );
    row(&mut t, "input", short(&run.input, 200));
    row(&mut t, "turn", run.turn.to_string());
    row(
        &mut t,
        "usage",
        format!(
            "{} turns, {} tool calls, {} in / {} out tokens",
            run.usage.turns, run.usage.tool_calls, run.usage.input_tokens, run.usage.output_tokens
        ),
    );
    // A finished run's leftover calls cannot be decided any more: no hints for them.
    let decidable = run.status == "waiting_approval";
    for p in run.pending_approvals.iter().filter(|_| decidable) {
        row(
            &mut t,
            "pending",
            format!(
                "{} {}({}) [{}]\napprove: agentd runs approve {} {}",
                p.call_id,
                p.tool,
                short(&p.arguments, 80),
                p.reason,
                run.id,
                p.call_id
            ),
        );
    }
    if let Some(q) = &run.awaiting_input {
        row(&mut t, "question", q.clone());
    }
    if let Some(o) = &run.output {
        row(&mut t, "output", short(o, 400));
    }
    if let Some(e) = &run.error {
        row(&mut t, "error", format!("{}: {}", e.code, e.message));
    }
    row(&mut t, "created", run.created_at.clone());
    row(&mut t, "updated", run.updated_at.clone());
    outln!("{t}")?;
    Ok(())
}

fn print_runs(list: &RunListDto, output: Output) -> anyhow::Result<()> {
    if output == Output::Json {
        return print_json(list);
    }
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    t.set_header(vec![
        "ID",
        "AGENT",
        "STATUS",
        "TURN",
        "TOOL CALLS",
        "UPDATED",
    ]);
    for r in &list.runs {
        t.add_row(vec![
            r.id.clone(),
            r.agent.clone(),
            r.status.clone(),
            r.turn.to_string(),
            r.usage.tool_calls.to_string(),
            r.updated_at.clone(),
        ]);
    }
    outln!("{t}")?;
    if let Some(c) = &list.next_cursor {
        outln!("more: --cursor {c}")?;
    }
    Ok(())
}

fn print_approvals(list: &ApprovalListDto, output: Output) -> anyhow::Result<()> {
    if output == Output::Json {
        return print_json(list);
    }
    if list.approvals.is_empty() {
        outln!("no calls wait for an operator")?;
        return Ok(());
    }
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED);
    t.set_header(vec![
        "RUN",
        "CALL",
        "AGENT",
        "TOOL(ARGUMENTS)",
        "REASON",
        "WAITING SINCE",
        "EXPIRES",
    ]);
    for a in &list.approvals {
        t.add_row(vec![
            a.run_id.clone(),
            a.call_id.clone(),
            a.agent.clone(),
            format!("{}({})", a.tool, short(&a.arguments, 60)),
            a.reason.clone(),
            a.requested_at.clone(),
            a.expires_at.clone().unwrap_or_else(|| "never".to_owned()),
        ]);
    }
    outln!("{t}")?;
    outln!("approve: agentd approvals approve RUN CALL [--arguments JSON]")?;
    outln!("reject:  agentd approvals reject RUN CALL --reason \"…\"")?;
    outln!("fail:    agentd approvals fail RUN CALL --reason \"…\"  (ends the run failed)")?;
    if let Some(c) = &list.next_cursor {
        outln!("more: agentd approvals --cursor {c}")?;
    }
    Ok(())
}

fn query(pairs: &[(&str, Option<String>)]) -> String {
    let parts: Vec<String> = pairs
        .iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={}", url_escape(v))))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    }
}

fn url_escape(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn path_segment(s: &str) -> String {
    url_escape(s)
}

/// Runs a client command; returns the process exit code.
pub async fn exec(cli: Cli) -> anyhow::Result<i32> {
    let output = cli.output;
    let client = || Client::new(&cli.url, cli.token.clone());
    match cli.command {
        Command::Serve(_) | Command::Bench(_) => {
            anyhow::bail!("`serve` and `bench` are handled by main")
        }
        Command::Version => {
            if output == Output::Json {
                print_json(&json!({
                    "version": env!("CARGO_PKG_VERSION"),
                    "commit": env!("AGENTD_COMMIT"),
                }))?;
            } else {
                outln!("agentd {VERSION}")?;
            }
            Ok(0)
        }
        Command::Completions { shell } => {
            use clap::CommandFactory as _;
            clap_complete::generate(shell, &mut Cli::command(), "agentd", &mut std::io::stdout());
            Ok(0)
        }
        Command::Config(ConfigCommand::Check { config }) => {
            let cfg = Config::load(config.as_deref(), std::env::vars())?;
            let text = match &config {
                Some(p) => Some(std::fs::read_to_string(p)?),
                None => None,
            };
            let problems = check::problems(&cfg, text.as_deref(), |name| std::env::var(name).ok());
            if !problems.is_empty() {
                if output == Output::Json {
                    print_json(&json!({ "error": {
                        "code": "invalid_config",
                        "message": format!("{} problem(s) in the configuration", problems.len()),
                        "problems": problems,
                    }}))?;
                }
                for p in &problems {
                    eprintln!("error: {p}");
                }
                eprintln!(
                    "{} problem(s); `serve` would refuse this configuration",
                    problems.len()
                );
                return Ok(EXIT_ERROR);
            }
            if output == Output::Json {
                print_json(&cfg.redacted())?;
            } else {
                {
                    use std::io::Write as _;
                    write!(std::io::stdout().lock(), "{}", cfg.to_redacted_toml()?)?;
                }
            }
            eprintln!("configuration is valid");
            Ok(0)
        }
        Command::Healthcheck { timeout } => {
            let status = client()?.status("/healthz", timeout).await?;
            if status.is_success() {
                Ok(0)
            } else {
                eprintln!("unhealthy: /healthz answered {status}");
                Ok(EXIT_ERROR)
            }
        }
        Command::Agents => {
            let list: AgentListDto = client()?.call(Method::GET, "/v1/agents", None).await?;
            if output == Output::Json {
                print_json(&list)?;
            } else {
                let mut t = Table::new();
                t.load_style(UTF8_FULL_CONDENSED);
                t.set_header(vec!["AGENT", "MODEL", "TOOLS"]);
                for a in &list.agents {
                    let tools: Vec<&str> = a.tools.iter().map(|t| t.name.as_str()).collect();
                    t.add_row(vec![a.name.clone(), a.model.clone(), tools.join(", ")]);
                }
                outln!("{t}")?;
            }
            Ok(0)
        }
        Command::Run(args) => {
            let c = client()?;
            let text = arg_or_stdin(args.input.clone(), "INPUT")?;
            let input = if args.json_input {
                serde_json::from_str::<Value>(&text).context("INPUT is not valid JSON")?
            } else {
                Value::String(text)
            };
            let mut body = json!({ "agent": args.agent, "input": input });
            if let Some(k) = &args.idempotency_key {
                body["idempotency_key"] = json!(k);
            }
            let mut budget = serde_json::Map::new();
            if let Some(v) = args.max_turns {
                budget.insert("max_turns".into(), json!(v));
            }
            if let Some(v) = args.max_tool_calls {
                budget.insert("max_tool_calls".into(), json!(v));
            }
            if let Some(v) = args.max_tokens {
                budget.insert("max_tokens".into(), json!(v));
            }
            if let Some(v) = &args.deadline {
                budget.insert("deadline".into(), json!(v));
            }
            if !budget.is_empty() {
                body["budget"] = Value::Object(budget);
            }
            let run: RunDto = c.call(Method::POST, "/v1/runs", Some(&body)).await?;
            if !args.follow {
                print_run(&run, output)?;
                return Ok(0);
            }
            timeline::follow(&c, &run.id, 0, args.wait, output).await
        }
        Command::Approvals(args) => {
            let c = client()?;
            match args.command {
                None => list_approvals(&c, args.limit, args.cursor, output).await,
                Some(ApprovalsCommand::List { limit, cursor }) => {
                    list_approvals(&c, limit.or(args.limit), cursor.or(args.cursor), output).await
                }
                Some(ApprovalsCommand::Approve {
                    run_id,
                    call_id,
                    arguments,
                    reason,
                }) => {
                    let mut body = json!({ "decision": "approve", "reason": reason });
                    if let Some(a) = arguments {
                        body["arguments"] = serde_json::from_str(&arg_or_stdin(a, "--arguments")?)
                            .context("--arguments is not valid JSON")?;
                    }
                    decide(&c, &run_id, &call_id, &body, output).await
                }
                Some(ApprovalsCommand::Reject {
                    run_id,
                    call_id,
                    reason,
                }) => {
                    let body = json!({ "decision": "reject", "reason": reason });
                    decide(&c, &run_id, &call_id, &body, output).await
                }
                Some(ApprovalsCommand::Fail {
                    run_id,
                    call_id,
                    reason,
                }) => {
                    let body = json!({ "decision": "fail", "reason": reason });
                    decide(&c, &run_id, &call_id, &body, output).await
                }
            }
        }
        Command::Runs(cmd) => {
            let c = client()?;
            match cmd {
                RunsCommand::List {
                    status,
                    agent,
                    limit,
                    cursor,
                } => {
                    let q = query(&[
                        ("status", status),
                        ("agent", agent),
                        ("limit", limit.map(|l| l.to_string())),
                        ("cursor", cursor),
                    ]);
                    let list: RunListDto =
                        c.call(Method::GET, &format!("/v1/runs{q}"), None).await?;
                    print_runs(&list, output)?;
                    Ok(0)
                }
                RunsCommand::Get { id } => {
                    let run: RunDto = c
                        .call(
                            Method::GET,
                            &format!("/v1/runs/{}", path_segment(&id)),
                            None,
                        )
                        .await?;
                    print_run(&run, output)?;
                    Ok(0)
                }
                RunsCommand::Events {
                    id,
                    after,
                    follow,
                    wait,
                } => {
                    if follow {
                        return timeline::follow(&c, &path_segment(&id), after, wait, output).await;
                    }
                    let list: EventListDto = c
                        .call(
                            Method::GET,
                            &format!("/v1/runs/{}/events?after={after}", path_segment(&id)),
                            None,
                        )
                        .await?;
                    if output == Output::Json {
                        print_json(&list)?;
                    } else {
                        let mut t = Table::new();
                        t.load_style(UTF8_FULL_CONDENSED);
                        t.set_header(vec!["SEQ", "AT", "TYPE", "DATA"]);
                        for e in &list.events {
                            t.add_row(vec![
                                e.seq.to_string(),
                                e.at.clone(),
                                e.kind.clone(),
                                short(&e.data, 100),
                            ]);
                        }
                        outln!("{t}")?;
                    }
                    Ok(0)
                }
                RunsCommand::Cancel { id, reason } => {
                    let body = json!({ "reason": reason });
                    let run: RunDto = c
                        .call(
                            Method::POST,
                            &format!("/v1/runs/{}/cancel", path_segment(&id)),
                            Some(&body),
                        )
                        .await?;
                    print_run(&run, output)?;
                    Ok(0)
                }
                RunsCommand::Approve {
                    id,
                    call_id,
                    arguments,
                    reason,
                } => {
                    let mut body = json!({ "decision": "approve", "reason": reason });
                    if let Some(a) = arguments {
                        body["arguments"] = serde_json::from_str(&arg_or_stdin(a, "--arguments")?)
                            .context("--arguments is not valid JSON")?;
                    }
                    decide(&c, &id, &call_id, &body, output).await
                }
                RunsCommand::Reject {
                    id,
                    call_id,
                    reason,
                } => {
                    let body = json!({ "decision": "reject", "reason": reason });
                    decide(&c, &id, &call_id, &body, output).await
                }
                RunsCommand::Fail {
                    id,
                    call_id,
                    reason,
                } => {
                    let body = json!({ "decision": "fail", "reason": reason });
                    decide(&c, &id, &call_id, &body, output).await
                }
                RunsCommand::Input { id, text } => {
                    let body = json!({ "text": arg_or_stdin(text, "TEXT")? });
                    let run: RunDto = c
                        .call(
                            Method::POST,
                            &format!("/v1/runs/{}/input", path_segment(&id)),
                            Some(&body),
                        )
                        .await?;
                    print_run(&run, output)?;
                    Ok(0)
                }
            }
        }
    }
}

async fn list_approvals(
    c: &Client,
    limit: Option<usize>,
    cursor: Option<String>,
    output: Output,
) -> anyhow::Result<i32> {
    let q = query(&[("limit", limit.map(|l| l.to_string())), ("cursor", cursor)]);
    let list: ApprovalListDto = c
        .call(Method::GET, &format!("/v1/approvals{q}"), None)
        .await?;
    print_approvals(&list, output)?;
    Ok(0)
}

async fn decide(
    c: &Client,
    id: &str,
    call_id: &str,
    body: &Value,
    output: Output,
) -> anyhow::Result<i32> {
    let run: RunDto = c
        .call(
            Method::POST,
            &format!(
                "/v1/runs/{}/approvals/{}",
                path_segment(id),
                path_segment(call_id)
            ),
            Some(body),
        )
        .await?;
    print_run(&run, output)?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_of_failure_has_its_exit_code() {
        let api = |status: u16| {
            anyhow::Error::from(client::ApiFailure {
                status: reqwest::StatusCode::from_u16(status).unwrap(),
                code: "x".into(),
                message: "y".into(),
                run_status: None,
            })
        };
        let codes: Vec<i32> = [400, 401, 403, 404, 409, 429, 503, 500]
            .into_iter()
            .map(|s| exit_code_of(&api(s)))
            .collect();
        assert_eq!(codes, [4, 5, 5, 6, 7, 8, 9, 4]);
        assert_eq!(exit_code_of(&anyhow::anyhow!("bad input")), EXIT_ERROR);
    }
}
