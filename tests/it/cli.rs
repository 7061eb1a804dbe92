//! The CLI binary against a live in-process daemon: run --follow with its exit codes, runs
//! commands, healthcheck, and config check.

use std::time::Duration;

use tokio::process::Command;

use crate::daemon_support::{ALPHA, TestDaemon};

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn agentd(d: Option<&TestDaemon>, args: &[&str]) -> Out {
    let mut c = Command::new(env!("CARGO_BIN_EXE_agentd"));
    c.env_remove("AGENTD_URL")
        .env_remove("AGENTD_TOKEN")
        .env("NO_COLOR", "1");
    if let Some(d) = d {
        c.args(["--url", &d.base(), "--token", ALPHA]);
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
    assert_eq!(o.code, 4);
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
    assert_eq!(o.code, 4);
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
    assert_eq!(o.code, 4);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn env_tokens_get_the_length_and_duplicate_checks_of_literal_ones() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agentd.toml");
    let p = path.to_str().unwrap().to_owned();
    let check = |env: Vec<(&'static str, String)>, serve: bool| {
        let p = p.clone();
        async move {
            let mut c = Command::new(env!("CARGO_BIN_EXE_agentd"));
            c.env_remove("AGENTD_TOKEN").envs(env);
            if serve {
                c.args(["serve", "--config", &p, "--listen", "127.0.0.1:0"]);
            } else {
                c.args(["config", "check", "--config", &p]);
            }
            let out = tokio::time::timeout(Duration::from_secs(30), c.kill_on_drop(true).output())
                .await
                .expect("the command did not end")
                .unwrap();
            (
                out.status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    let with_beta_token = |beta: &str| {
        crate::daemon_support::file_config().replace(
            r#"tokens = ["beta-token-0123456789ab"]"#,
            &format!("tokens = [{beta:?}]"),
        )
    };
    std::fs::write(&path, with_beta_token("env:AGENTD_IT_BETA_TOKEN")).unwrap();
    // Too short from the environment: refused by config check and by serve.
    for serve in [false, true] {
        let (code, stderr) = check(vec![("AGENTD_IT_BETA_TOKEN", "short".into())], serve).await;
        assert_ne!(code, 0, "{stderr}");
        assert!(
            stderr.contains("tenants[1].tokens[0]: a token (the value of AGENTD_IT_BETA_TOKEN) must be at least 16 characters"),
            "{stderr}"
        );
    }
    // Alpha's literal token given to beta through the environment: refused, token not shown.
    for serve in [false, true] {
        let (code, stderr) = check(vec![("AGENTD_IT_BETA_TOKEN", ALPHA.into())], serve).await;
        assert_ne!(code, 0, "{stderr}");
        assert!(
            stderr.contains(r#"tenants[1].tokens[0]: the same token (the value of AGENTD_IT_BETA_TOKEN) is configured for tenants "alpha" and "beta""#),
            "{stderr}"
        );
        assert!(!stderr.contains(ALPHA), "{stderr}");
    }
    // Two literal tokens shared by two tenants: refused as well.
    std::fs::write(&path, with_beta_token(ALPHA)).unwrap();
    let (code, stderr) = check(vec![], false).await;
    assert_eq!(code, 4, "{stderr}");
    assert!(
        stderr.contains(r#"is configured for tenants "alpha" and "beta""#),
        "{stderr}"
    );
    // A long, distinct env token is fine.
    std::fs::write(&path, with_beta_token("env:AGENTD_IT_BETA_TOKEN")).unwrap();
    let (code, stderr) = check(
        vec![("AGENTD_IT_BETA_TOKEN", "beta-from-env-0123456789".into())],
        false,
    )
    .await;
    assert_eq!(code, 0, "{stderr}");
}
