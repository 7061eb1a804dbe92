//! The CLI binary against a live in-process daemon: run --follow with its exit codes, runs
//! commands, healthcheck, and config check.

use std::path::Path;
use std::time::Duration;

use tokio::process::Command;

use crate::daemon_support::{ALPHA, TestDaemon};

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn agentd(d: Option<&TestDaemon>, args: &[&str]) -> Out {
    match d {
        Some(d) => agentd_at(Some((&d.base(), ALPHA)), None, args).await,
        None => agentd_at(None, None, args).await,
    }
}

/// The CLI with `--url URL --token TOKEN` when given, in `cwd` when given.
async fn agentd_at(daemon: Option<(&str, &str)>, cwd: Option<&Path>, args: &[&str]) -> Out {
    let mut c = Command::new(env!("CARGO_BIN_EXE_agentd"));
    c.env_remove("AGENTD_URL")
        .env_remove("AGENTD_TOKEN")
        .env("NO_COLOR", "1");
    if let Some(dir) = cwd {
        c.current_dir(dir);
    }
    if let Some((url, token)) = daemon {
        c.args(["--url", url, "--token", token]);
    }
    c.args(args).kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(30), c.output())
        .await
        .expect("the CLI did not finish in time")
        .unwrap();
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_follow_prints_a_timeline_and_exits_by_outcome() {
    let d = TestDaemon::start().await;
    let o = agentd(Some(&d), &["run", "quick", "what is 1+2?", "--follow"]).await;
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    assert!(
        o.stdout.contains("model calls add({\"a\":1,\"b\":2})"),
        "{}",
        o.stdout
    );
    assert!(o.stdout.contains("tool add [call_1_0] ok"), "{}", o.stdout);
    assert!(o.stdout.contains("succeeded\noutput: 3"), "{}", o.stdout);

    // Waiting for approval: exit 3 with the exact command to run.
    let o = agentd(Some(&d), &["run", "approver", "charge it", "--follow"]).await;
    assert_eq!(o.code, 3, "{}{}", o.stdout, o.stderr);
    let line = o
        .stdout
        .lines()
        .find(|l| l.contains("approve: agentd runs approve"))
        .unwrap();
    let cmd: Vec<&str> = line.split_whitespace().skip(2).collect();
    assert_eq!(cmd[0..2], ["runs", "approve"]);
    let id = cmd[2].to_owned();
    assert_eq!(cmd[3], "call_1_0");
    let o = agentd(Some(&d), &cmd).await;
    assert_eq!(o.code, 0, "{}", o.stderr);
    let o = agentd(Some(&d), &["runs", "events", &id, "--follow"]).await;
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("call call_1_0 approved"), "{}", o.stdout);
    assert_eq!(d.ledger.total(), 1);

    // A conflict is an error exit with the API's code.
    let o = agentd(Some(&d), &["runs", "reject", &id, "call_1_0"]).await;
    assert_eq!(o.code, 7, "conflict");
    assert!(o.stderr.contains("invalid_state"), "{}", o.stderr);

    // Cancelled: exit 2.
    let hang = d.create(ALPHA, "hang").await;
    let o = agentd(Some(&d), &["runs", "cancel", &hang, "--reason", "test"]).await;
    assert_eq!(o.code, 0, "{}", o.stderr);
    let o = agentd(Some(&d), &["runs", "events", &hang, "--follow"]).await;
    assert_eq!(o.code, 2, "{}{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("cancelled (test)"));

    let o = agentd(Some(&d), &["--output", "json", "runs", "list"]).await;
    assert_eq!(o.code, 0);
    let list: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(list["runs"].as_array().unwrap().len(), 3);
    let o = agentd(Some(&d), &["--output", "json", "runs", "get", &id]).await;
    let run: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(run["status"], "succeeded");
    let o = agentd(Some(&d), &["runs", "get", "run_nope"]).await;
    assert_eq!(o.code, 6, "not found");
    assert!(o.stderr.contains("not_found"));
    let o = agentd(Some(&d), &["agents"]).await;
    assert!(o.stdout.contains("approver"));
    let o = agentd(Some(&d), &["healthcheck"]).await;
    assert_eq!(o.code, 0);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthcheck_fails_without_a_daemon_and_usage_errors_exit_64() {
    let o = agentd(
        None,
        &[
            "--url",
            "http://127.0.0.1:9",
            "healthcheck",
            "--timeout",
            "1s",
        ],
    )
    .await;
    assert_eq!(o.code, 9, "unavailable: {}", o.stderr);
    let o = agentd(None, &["runs", "frobnicate"]).await;
    assert_eq!(o.code, 64);
    let o = agentd(None, &["--help"]).await;
    assert_eq!(o.code, 0);
    assert!(o.stdout.contains("Exit codes"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_check_validates_and_redacts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agentd.toml");
    std::fs::write(&path, crate::daemon_support::file_config()).unwrap();
    let p = path.to_str().unwrap();
    let o = agentd(None, &["config", "check", "--config", p]).await;
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(o.stdout.contains("<redacted>"));
    assert!(!o.stdout.contains(ALPHA), "{}", o.stdout);
    assert!(o.stdout.contains("[agents.approver]"));

    std::fs::write(&path, "[server]\nlisen = \"x\"\n").unwrap();
    let o = agentd(None, &["config", "check", "--config", p]).await;
    assert_eq!(o.code, 4);
    assert!(o.stderr.contains("unknown field"), "{}", o.stderr);

    let bad =
        crate::daemon_support::file_config().replace("model = \"hang\"", "model = \"nowhere\"");
    std::fs::write(&path, bad).unwrap();
    let o = agentd(None, &["config", "check", "--config", p]).await;
    assert_eq!(o.code, 4);
    assert!(
        o.stderr
            .contains(r#"agents.hang.model: model "nowhere" is not defined in [models]"#),
        "{}",
        o.stderr
    );
    // Without a file: the demo configuration.
    let o = agentd(None, &["config", "check"]).await;
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(o.stdout.contains("[agents.demo]"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvals_inbox_lists_every_waiting_call_oldest_first_and_decides_them() {
    use crate::daemon_support::BETA;
    let d = TestDaemon::start().await;
    let first = d.create(ALPHA, "approver").await;
    d.wait_status(ALPHA, &first, "waiting_approval").await;
    let second = d.create(ALPHA, "approver").await;
    d.wait_status(ALPHA, &second, "waiting_approval").await;
    let other = d.create(BETA, "approver").await;
    d.wait_status(BETA, &other, "waiting_approval").await;

    // The API: oldest first, tenant-isolated, paged by cursor.
    let (s, v) = d.get("/v1/approvals", ALPHA).await;
    assert_eq!(s, 200, "{v}");
    let ids: Vec<&str> = v["approvals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["run_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [first.as_str(), second.as_str()], "{v}");
    let a = &v["approvals"][0];
    assert_eq!(a["call_id"], "call_1_0");
    assert_eq!(a["agent"], "approver");
    assert_eq!(a["tool"], "charge");
    assert_eq!(a["arguments"]["item"], "order-1");
    assert_eq!(a["reason"], "policy");
    assert!(a["requested_at"].as_str().unwrap().ends_with('Z'), "{a}");
    assert!(a["expires_at"].is_null(), "{a}");
    assert!(v["next_cursor"].is_null());
    let (_, page1) = d.get("/v1/approvals?limit=1", ALPHA).await;
    assert_eq!(page1["approvals"][0]["run_id"], first.as_str());
    let cursor = page1["next_cursor"].as_str().unwrap();
    let (_, page2) = d
        .get(&format!("/v1/approvals?limit=1&cursor={cursor}"), ALPHA)
        .await;
    assert_eq!(page2["approvals"][0]["run_id"], second.as_str(), "{page2}");
    assert!(page2["next_cursor"].is_null(), "{page2}");
    let (s, _) = d.get("/v1/approvals?cursor=..%2F", ALPHA).await;
    assert_eq!(s, 400);
    let (_, theirs) = d.get("/v1/approvals", BETA).await;
    assert_eq!(theirs["approvals"].as_array().unwrap().len(), 1);
    assert_eq!(theirs["approvals"][0]["run_id"], other.as_str());

    // The CLI lists the same calls and decides them.
    let o = agentd(Some(&d), &["approvals"]).await;
    assert_eq!(o.code, 0, "{}", o.stderr);
    println!("agentd approvals:\n{}", o.stdout);
    let first_line = o.stdout.lines().position(|l| l.contains(&first)).unwrap();
    let second_line = o.stdout.lines().position(|l| l.contains(&second)).unwrap();
    assert!(first_line < second_line, "{}", o.stdout);
    assert!(
        o.stdout.contains("charge({\"item\":\"order-1\"})"),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout
            .contains("approve: agentd approvals approve RUN CALL")
    );
    assert!(!o.stdout.contains(&other), "{}", o.stdout);
    let o = agentd(Some(&d), &["approvals", "approve", &first, "call_1_0"]).await;
    assert_eq!(o.code, 0, "{}", o.stderr);
    d.wait_status(ALPHA, &first, "succeeded").await;
    assert_eq!(d.ledger.total(), 1);
    let o = agentd(
        Some(&d),
        &["approvals", "reject", &second, "call_1_0", "--reason", "no"],
    )
    .await;
    assert_eq!(o.code, 0, "{}", o.stderr);
    d.wait_status(ALPHA, &second, "succeeded").await;
    assert_eq!(d.ledger.total(), 1, "a rejected call never runs");
    let o = agentd(Some(&d), &["--output", "json", "approvals", "list"]).await;
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["approvals"], serde_json::json!([]), "{v}");
    let o = agentd(Some(&d), &["approvals"]).await;
    assert!(
        o.stdout.contains("no calls wait for an operator"),
        "{}",
        o.stdout
    );

    // A cancelled run shows no approve hints.
    let o = agentd(Some(&d), &["runs", "cancel", &other, "--reason", "gone"]).await;
    assert_eq!(o.code, 6, "beta's run is not alpha's: {}", o.stderr);
    let cancelled = d.create(ALPHA, "approver").await;
    d.wait_status(ALPHA, &cancelled, "waiting_approval").await;
    let o = agentd(Some(&d), &["runs", "cancel", &cancelled]).await;
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(!o.stdout.contains("approve:"), "{}", o.stdout);
    let o = agentd(Some(&d), &["runs", "get", &cancelled]).await;
    assert!(!o.stdout.contains("approve:"), "{}", o.stdout);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follow_wait_prints_the_hints_while_it_waits() {
    use tokio::io::{AsyncBufReadExt as _, BufReader};
    let d = TestDaemon::start().await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentd"))
        .env_remove("AGENTD_URL")
        .env_remove("AGENTD_TOKEN")
        .args(["--url", &d.base(), "--token", ALPHA])
        .args(["run", "approver", "charge it", "--follow", "--wait"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    let approve = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            seen.push(line.clone());
            if line.contains("approve: agentd runs approve") {
                return line;
            }
        }
        panic!("the stream ended without hints: {seen:?}");
    })
    .await
    .expect("no approve hint while waiting");
    let cmd: Vec<&str> = approve.split_whitespace().skip(2).collect();
    let o = agentd(Some(&d), &cmd).await;
    assert_eq!(o.code, 0, "{}", o.stderr);
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .expect("--follow --wait did not end with the run")
        .unwrap();
    assert_eq!(status.code(), Some(0));
    let mut rest = String::new();
    while let Ok(Some(l)) = lines.next_line().await {
        rest.push_str(&l);
        rest.push('\n');
    }
    assert!(rest.contains("succeeded"), "{rest}");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_ends_the_cli_quietly_with_its_exit_code() {
    use tokio::io::AsyncBufReadExt as _;
    let d = TestDaemon::start().await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentd"))
        .env_remove("AGENTD_URL")
        .env_remove("AGENTD_TOKEN")
        .args(["--url", &d.base(), "--token", ALPHA])
        .args(["run", "slow", "echo three times", "--follow"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Like `| head -1`: read one line, then close the pipe while the run still has events.
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next_line().await.unwrap().unwrap();
    assert!(first.starts_with("run run_"), "{first}");
    drop(lines);
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("the CLI did not end after its stdout closed")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(agentd::cli::EXIT_CLOSED_OUTPUT),
        "{stderr}"
    );
    assert!(stderr.trim().is_empty(), "not quiet: {stderr}");
    d.stop().await;
}

/// The id in the first line `run run_…` of a `--follow` timeline.
fn run_id_of(timeline: &str) -> String {
    timeline
        .lines()
        .find_map(|l| l.strip_prefix("run "))
        .expect("no run line")
        .trim()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_builtin_demo_uses_its_input_keeps_its_token_and_names_its_conflicts() {
    use crate::chaos_support::ChildDaemon;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("agentd.log");
    // The README's set-up command on a fresh directory: no ./data yet.
    let d = ChildDaemon::spawn_serve(&[], Some(dir.path()), &log, &[], "info").await;
    let token = d
        .banner
        .iter()
        .find_map(|l| l.trim().strip_prefix("export AGENTD_TOKEN="))
        .expect("the demo token is printed")
        .to_owned();
    assert!(dir.path().join("data").is_dir());
    let at = Some((d.base.as_str(), token.as_str()));

    // The calculator reads the question.
    let o = agentd_at(at, None, &["run", "demo", "what is 7 + 5?", "--follow"]).await;
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    assert!(o.stdout.contains(r#"add({"a":7,"b":5})"#), "{}", o.stdout);
    assert!(o.stdout.contains("output: 7 + 5 = 12."), "{}", o.stdout);
    let o = agentd_at(at, None, &["run", "demo", "100 minus 1", "--follow"]).await;
    assert!(o.stdout.contains("output: 100 - 1 = 99."), "{}", o.stdout);

    // A rejected call is reported as rejected.
    let o = agentd_at(
        at,
        None,
        &["run", "demo_approval", "restart deploy 7", "--follow"],
    )
    .await;
    assert_eq!(o.code, 3, "{}{}", o.stdout, o.stderr);
    assert!(
        o.stdout.contains(r#"record({"item":"restart deploy 7"})"#),
        "{}",
        o.stdout
    );
    let id = run_id_of(&o.stdout);
    let o = agentd_at(
        at,
        None,
        &[
            "approvals",
            "reject",
            &id,
            "call_1_0",
            "--reason",
            "not today",
        ],
    )
    .await;
    assert_eq!(o.code, 0, "{}", o.stderr);
    let o = agentd_at(at, None, &["runs", "events", &id, "--follow"]).await;
    assert!(o.stdout.contains("call call_1_0 rejected"), "{}", o.stdout);
    assert!(
        o.stdout.contains(
            r#"output: Not done: an operator rejected recording "restart deploy 7" (not today)."#
        ),
        "{}",
        o.stdout
    );

    // demo_input asks, and uses the answer.
    let o = agentd_at(at, None, &["run", "demo_input", "ship v2", "--follow"]).await;
    assert_eq!(o.code, 3, "{}{}", o.stdout, o.stderr);
    assert!(
        o.stdout.contains("model asks: Where should \"ship v2\" go"),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout.contains("answer: agentd runs input"),
        "{}",
        o.stdout
    );
    let id = run_id_of(&o.stdout);
    let o = agentd_at(at, None, &["runs", "input", &id, "staging"]).await;
    assert_eq!(o.code, 0, "{}", o.stderr);
    let o = agentd_at(at, None, &["runs", "events", &id, "--follow"]).await;
    assert!(
        o.stdout
            .contains(r#"output: Going ahead with "ship v2" on staging."#),
        "{}",
        o.stdout
    );

    // A second daemon on the same data directory names it.
    let o = agentd_at(
        None,
        Some(dir.path()),
        &["serve", "--listen", "127.0.0.1:0"],
    )
    .await;
    assert_eq!(o.code, 4, "{}", o.stderr);
    assert!(o.stderr.contains("file:./data"), "{}", o.stderr);
    assert!(!o.stderr.contains("listening"), "{}", o.stderr);
    // ...and one on the same port names the address.
    let port_taken = d.base.trim_start_matches("http://").to_owned();
    let other = tempfile::tempdir().unwrap();
    let o = agentd_at(
        None,
        Some(other.path()),
        &["serve", "--listen", &port_taken],
    )
    .await;
    assert_eq!(o.code, 4, "{}", o.stderr);
    assert!(
        o.stderr
            .contains(&format!("could not listen on {port_taken}")),
        "{}",
        o.stderr
    );

    // Logs written to a file carry no colour codes, and one line per request.
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!text.contains('\u{1b}'), "ANSI codes in the log file");
    let answered: Vec<&str> = text.lines().filter(|l| l.contains("answered")).collect();
    assert!(!answered.is_empty(), "{text}");
    assert!(answered.iter().all(|l| l.len() < 240), "{answered:?}");

    // Restarted, the demo keeps its token: an exported AGENTD_TOKEN keeps working.
    d.signal("TERM");
    let mut d = d;
    assert!(d.wait_exit(Duration::from_secs(15)).await.is_some());
    let d = ChildDaemon::spawn_serve(&[], Some(dir.path()), &log, &[], "info").await;
    assert!(
        d.banner.iter().any(|l| l.contains(&token)),
        "{:?}",
        d.banner
    );
    let (s, _) = d.get("/v1/runs", &token).await;
    assert_eq!(s, 200);
    drop(d);

    // A store directory that does not exist is an error unless asked for.
    let o = agentd_at(
        None,
        Some(other.path()),
        &[
            "serve",
            "--store",
            "file:./typo/path",
            "--listen",
            "127.0.0.1:0",
        ],
    )
    .await;
    assert_eq!(o.code, 4, "{}", o.stderr);
    assert!(
        o.stderr.contains(
            "store directory ./typo/path does not exist (create it, or pass --create-store)"
        ),
        "{}",
        o.stderr
    );
    assert!(!other.path().join("typo").exists());
}

/// Every ```toml block of README.md.
fn readme_toml_blocks() -> Vec<String> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in readme.lines() {
        match (&mut current, line.trim_end()) {
            (None, "```toml") => current = Some(String::new()),
            (Some(b), "```") => {
                blocks.push(std::mem::take(b));
                current = None;
            }
            (Some(b), l) => {
                b.push_str(l);
                b.push('\n');
            }
            (None, _) => {}
        }
    }
    blocks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_readme_toml_block_is_a_whole_configuration_that_checks() {
    let blocks = readme_toml_blocks();
    assert!(blocks.len() >= 2, "README has {} toml blocks", blocks.len());
    let Some(mcp_bin) = crate::mcp::server_bin() else {
        return;
    };
    let path = format!(
        "{}:{}",
        mcp_bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("data")).unwrap();
    for (i, block) in blocks.iter().enumerate() {
        let config = agentd::config::Config::from_toml(block)
            .unwrap_or_else(|e| panic!("README toml block {i} does not parse: {e}\n{block}"));
        config
            .validate()
            .unwrap_or_else(|e| panic!("README toml block {i} is not valid: {e}\n{block}"));
        let file = dir.path().join(format!("block{i}.toml"));
        std::fs::write(&file, block).unwrap();
        let names: Vec<&str> = block
            .split("\"env:")
            .skip(1)
            .filter_map(|rest| rest.split('"').next())
            .collect();
        let run = |with_env: bool| {
            let mut c = Command::new(env!("CARGO_BIN_EXE_agentd"));
            c.current_dir(dir.path()).env("PATH", &path).args([
                "config",
                "check",
                "--config",
                file.to_str().unwrap(),
            ]);
            for n in &names {
                c.env_remove(n);
                if with_env {
                    c.env(n, "a-secret-value-0123456789");
                }
            }
            c.output()
        };
        let o = run(true).await.unwrap();
        assert!(
            o.status.success(),
            "README toml block {i}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        // Without its variables, every one of them is reported at once, with its line.
        if !names.is_empty() {
            let o = run(false).await.unwrap();
            assert_eq!(o.status.code(), Some(4));
            let err = String::from_utf8_lossy(&o.stderr);
            for n in &names {
                assert!(
                    err.contains(&format!("environment variable {n} is not set")),
                    "block {i}: {err}"
                );
            }
            assert!(err.contains("line "), "{err}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_scripts_well_json_errors_exit_codes_ndjson_stdin_version_completions() {
    let d = TestDaemon::start().await;
    // JSON errors with the API's code, and distinct exit codes.
    let o = agentd(Some(&d), &["--output", "json", "runs", "get", "run_nope"]).await;
    assert_eq!(o.code, 6);
    let e: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(e["error"]["code"], "not_found", "{e}");
    assert_eq!(e["error"]["http_status"], 404, "{e}");
    let o = agentd_at(
        Some((&d.base(), "not-a-token-at-all")),
        None,
        &["--output", "json", "runs", "list"],
    )
    .await;
    assert_eq!(o.code, 5, "unauthorised: {}", o.stderr);
    let e: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(e["error"]["code"], "unauthenticated", "{e}");
    let o = agentd_at(
        Some(("http://127.0.0.1:9", ALPHA)),
        None,
        &["--output", "json", "runs", "list"],
    )
    .await;
    assert_eq!(o.code, 9, "unavailable: {}", o.stderr);
    let e: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(e["error"]["code"], "unreachable", "{e}");

    // `-` reads stdin; the run shows its input; NDJSON lines name their run.
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentd"))
        .env_remove("AGENTD_URL")
        .env_remove("AGENTD_TOKEN")
        .args(["--url", &d.base(), "--token", ALPHA, "--output", "json"])
        .args(["run", "quick", "-", "--follow"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    {
        use tokio::io::AsyncWriteExt as _;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"add these from stdin\n").await.unwrap();
    }
    let out = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(lines.len() >= 3, "{lines:?}");
    let id = lines[0]["run_id"].as_str().unwrap().to_owned();
    assert!(
        lines
            .iter()
            .all(|l| l["run_id"] == id.as_str() && l["seq"].is_u64())
    );
    let o = agentd(Some(&d), &["--output", "json", "runs", "get", &id]).await;
    let run: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(run["input"], "add these from stdin", "{run}");
    let o = agentd(Some(&d), &["runs", "get", &id]).await;
    assert!(o.stdout.contains("add these from stdin"), "{}", o.stdout);

    // version with the commit; completions; grouped help.
    let o = agentd(None, &["version"]).await;
    assert_eq!(o.code, 0);
    assert!(
        o.stdout
            .starts_with(&format!("agentd {} (commit ", env!("CARGO_PKG_VERSION"))),
        "{}",
        o.stdout
    );
    for shell in ["bash", "zsh", "fish"] {
        let o = agentd(None, &["completions", shell]).await;
        assert_eq!(o.code, 0, "{shell}: {}", o.stderr);
        assert!(o.stdout.contains("approvals"), "{shell}");
    }
    let o = agentd(None, &["--help"]).await;
    assert!(o.stdout.contains("Global options:"), "{}", o.stdout);
    assert!(o.stdout.contains("5  unauthorised"), "{}", o.stdout);
    let o = agentd(None, &["runs", "get", "--help"]).await;
    assert!(o.stdout.contains("The run (`run_…`)"), "{}", o.stdout);
    d.stop().await;
}

#[test]
fn readme_and_architecture_point_only_inside_the_repository() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for doc in ["README.md", "ARCHITECTURE.md"] {
        let text = std::fs::read_to_string(root.join(doc)).unwrap();
        assert!(!text.contains("../"), "{doc} points outside the repository");
        assert!(
            !text.contains("API.md"),
            "{doc} names an API.md: the API is docs/api.md"
        );
        // Every relative link `](path)` names a file of the repository.
        for part in text.split("](").skip(1) {
            let target = part.split(')').next().unwrap().split('#').next().unwrap();
            if target.is_empty() || target.contains("://") {
                continue;
            }
            assert!(
                root.join(target).exists(),
                "{doc} links to missing {target}"
            );
        }
    }
}
