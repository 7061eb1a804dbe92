//! The web console in headless Chromium: the built-in demo daemon (a real `agentd serve`
//! process) and `tests/console/console.test.mjs` driven by playwright-core against Debian's
//! `chromium`. Outside CI a missing Chromium skips the test with a notice; under `CI=true` it
//! fails.

use std::path::PathBuf;
use std::time::Duration;

use crate::chaos_support::ChildDaemon;

const CHROMIUM: &str = "/usr/bin/chromium";

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// `tests/console` with playwright-core installed from its lockfile (`npm ci`), or `None`.
fn console_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/console");
    if !dir.join("node_modules/playwright-core").exists() {
        eprintln!(
            "installing playwright-core: npm ci --prefix {}",
            dir.display()
        );
        let _ = std::process::Command::new("timeout")
            .args(["300", "npm", "ci", "--no-audit", "--no-fund", "--prefix"])
            .arg(&dir)
            .status();
    }
    dir.join("node_modules/playwright-core")
        .exists()
        .then_some(dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_approves_cancels_and_answers_runs_in_chromium() {
    if !std::path::Path::new(CHROMIUM).exists() {
        assert!(
            !in_ci(),
            "{CHROMIUM} is missing (apt-get install -y chromium)"
        );
        eprintln!("NOTICE: skipping the console test: {CHROMIUM} is missing");
        return;
    }
    let Some(dir) = console_dir() else {
        assert!(
            !in_ci(),
            "playwright-core could not be installed in tests/console"
        );
        eprintln!("NOTICE: skipping the console test: playwright-core is not installed");
        return;
    };
    let data = tempfile::tempdir().unwrap();
    let log = data.path().join("agentd.log");
    let d = ChildDaemon::spawn_serve(&[], Some(data.path()), &log, &[], "info").await;
    d.wait_ready(Duration::from_secs(30)).await;
    let token = d
        .banner
        .iter()
        .find_map(|l| l.trim().strip_prefix("export AGENTD_TOKEN="))
        .expect("the demo token is printed")
        .to_owned();
    let screenshot = std::env::var("CONSOLE_SCREENSHOT")
        .unwrap_or_else(|_| data.path().join("run.png").display().to_string());
    let run = tokio::process::Command::new("node")
        .arg(dir.join("console.test.mjs"))
        .env("AGENTD_URL", &d.base)
        .env("AGENTD_TOKEN", &token)
        .env("CHROMIUM", CHROMIUM)
        .env("SCREENSHOT", &screenshot)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(180), run)
        .await
        .expect("the console test did not finish in 180 s")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "console test failed:\n{stdout}\n{stderr}"
    );
    let facts: serde_json::Value = serde_json::from_str(
        stdout
            .lines()
            .last()
            .expect("the console test printed no facts"),
    )
    .unwrap();
    assert_eq!(facts["ok"], true, "{facts}");
    println!("console facts: {facts}");
    // Each run the page drove ended as the page said.
    for (key, status) in [
        ("approved", "succeeded"),
        ("cancelled", "cancelled"),
        ("answered", "succeeded"),
        ("rejected", "succeeded"),
    ] {
        let id = facts[key].as_str().unwrap();
        let (s, run) = d.get(&format!("/v1/runs/{id}"), &token).await;
        assert_eq!(s, 200);
        assert_eq!(run["status"], status, "{key}: {run}");
    }
}
