//! `--follow`: streams a run's events over SSE (resuming with `Last-Event-ID` if the
//! connection drops) and prints a readable live timeline; returns the exit code of the run's
//! outcome (see `cli::EXIT_CODES`).

use std::io::Write as _;
use std::time::Duration;

use futures::StreamExt;
use reqwest::Method;
use serde_json::Value;

use super::client::Client;
use super::{EXIT_CANCELLED, EXIT_FAILED, EXIT_WAITING, Output};
use crate::api::dto::{EventDto, RunDto};

/// Reconnects allowed after the stream breaks before the run ends: with the backoff below,
/// about a minute, so a follower rides out a daemon restart.
const MAX_RECONNECTS: u32 = 30;

/// The wait before reconnect number `n` (from 1): 0.5 s more each time, at most 2 s.
fn backoff(n: u32) -> Duration {
    Duration::from_millis((500 * u64::from(n)).min(2000))
}

fn ms_of(at: &str) -> Option<i128> {
    time::OffsetDateTime::parse(at, &time::format_description::well_known::Rfc3339)
        .ok()
        .map(|t| t.unix_timestamp_nanos() / 1_000_000)
}

fn compact(v: &Value) -> String {
    let s = match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if s.chars().count() > 200 {
        format!("{}…", s.chars().take(199).collect::<String>())
    } else {
        s
    }
}

/// One line (or a few) for an event; `None` for events not worth a line.
pub fn describe(e: &EventDto) -> Option<String> {
    let d = &e.data;
    let s = |k: &str| d[k].as_str().unwrap_or("").to_owned();
    Some(match e.kind.as_str() {
        "run_created" => format!("created (agent {})", s("agent")),
        "run_started" => format!("started · turn {}", d["turn"]),
        "run_resumed" => "resumed from its checkpoint".to_owned(),
        "model_replied" => match d["decision"].as_str() {
            Some("final") => "model proposed a final answer; verifying".to_owned(),
            Some("tool_calls") => {
                let calls: Vec<String> = d["calls"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|c| {
                                format!(
                                    "{}({}) [{}]",
                                    c["tool"].as_str().unwrap_or("?"),
                                    compact(&c["arguments"]),
                                    c["call_id"].as_str().unwrap_or("?")
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                format!("model calls {}", calls.join(", "))
            }
            Some("malformed") => format!("model reply unusable: {}", s("message")),
            _ => "model replied".to_owned(),
        },
        "tool_call_finished" if d["held"].is_string() => format!(
            "tool {} [{}] error {}: {}\nwaiting for an operator ({})",
            s("tool"),
            s("call_id"),
            d["error"]["code"].as_str().unwrap_or("?"),
            d["error"]["message"].as_str().unwrap_or(""),
            s("held")
        ),
        "tool_call_finished" => {
            if d["ok"].as_bool() == Some(true) {
                format!("tool {} [{}] ok", s("tool"), s("call_id"))
            } else {
                format!(
                    "tool {} [{}] error {}: {}",
                    s("tool"),
                    s("call_id"),
                    d["error"]["code"].as_str().unwrap_or("?"),
                    d["error"]["message"].as_str().unwrap_or("")
                )
            }
        }
        "call_approved" => format!("call {} approved", s("call_id")),
        "call_rejected" => format!("call {} rejected", s("call_id")),
        "input_requested" => format!("model asks: {}", s("question")),
        "input_received" => "input received".to_owned(),
        "input_queued" => "input queued for the next turn".to_owned(),
        "verification_rejected" => "verifier rejected the answer; back to the model".to_owned(),
        "model_failed" => "model call failed; retrying".to_owned(),
        "model_retry" | "tool_retry" => "retrying".to_owned(),
        "tool_retrying" => format!(
            "tool {} [{}] attempt {} failed ({}: {}); retrying in {} ms",
            s("tool"),
            s("call_id"),
            d["attempt"],
            d["error"]["code"].as_str().unwrap_or("?"),
            d["error"]["message"].as_str().unwrap_or(""),
            d["wait_ms"]
        ),
        "model_retrying" => format!(
            "model attempt {} failed ({}: {}); retrying in {} ms",
            d["attempt"],
            d["error"]["kind"].as_str().unwrap_or("?"),
            d["error"]["message"].as_str().unwrap_or(""),
            d["wait_ms"]
        ),
        "call_reconciled" => format!("call {} reconciled", s("call_id")),
        "run_succeeded" => format!("succeeded\noutput: {}", compact(&d["output"])),
        "run_failed" => format!(
            "failed: {}: {}",
            d["error"]["code"].as_str().unwrap_or("?"),
            d["error"]["message"].as_str().unwrap_or("")
        ),
        "run_cancelled" => match d["reason"].as_str() {
            Some(r) => format!("cancelled ({r})"),
            None => "cancelled".to_owned(),
        },
        "late_result_ignored" => return None,
        other => other.to_owned(),
    })
}

/// The commands an operator can run for a waiting run; `stopping`: the follow ends here, so
/// say how to follow again.
fn print_waiting(run: &RunDto, output: Output, stopping: bool) -> std::io::Result<()> {
    if output == Output::Json {
        return Ok(());
    }
    for p in &run.pending_approvals {
        outln!(
            "  waiting for approval: {}({}) [{}]{}",
            p.tool,
            compact(&p.arguments),
            p.call_id,
            match p.reason.as_str() {
                "outcome_unknown" => " — its outcome is unknown after a crash",
                "tool_failing" => " — its tool keeps failing (approve: retry; reject: skip)",
                "permission_error" => " — its tool refused it (401/403)",
                _ => "",
            }
        )?;
        outln!("    approve: agentd runs approve {} {}", run.id, p.call_id)?;
        outln!(
            "    reject:  agentd runs reject {} {} --reason \"…\"",
            run.id,
            p.call_id
        )?;
        if p.reason == "tool_failing" || p.reason == "permission_error" {
            outln!("    fail:    agentd runs fail {} {}", run.id, p.call_id)?;
        }
    }
    if let Some(q) = &run.awaiting_input {
        outln!("  waiting for input: {q}")?;
        outln!("    answer: agentd runs input {} \"…\"", run.id)?;
    }
    if stopping {
        outln!("  follow again: agentd runs events {} --follow", run.id)?;
    } else {
        outln!("  still following (--wait); Ctrl-C stops")?;
    }
    Ok(())
}

/// Follows the run from `after`; returns the exit code.
pub async fn follow(
    c: &Client,
    run_id: &str,
    after: u64,
    wait: bool,
    output: Output,
) -> anyhow::Result<i32> {
    let mut last = after;
    let mut start_ms: Option<i128> = None;
    let mut reconnects = 0;
    if output == Output::Table {
        outln!("run {run_id}")?;
    }
    loop {
        let mut stream = match c.events_stream(run_id, last).await {
            Ok(s) => Box::pin(s),
            Err(e) if last > after && reconnects < MAX_RECONNECTS => {
                reconnects += 1;
                eprintln!("stream lost ({e}); reconnecting");
                tokio::time::sleep(backoff(reconnects)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        while let Some(item) = stream.next().await {
            let e = item?;
            if e.seq <= last {
                continue;
            }
            last = e.seq;
            if output == Output::Json {
                // NDJSON: each line stands alone, so it names its run.
                let mut line = serde_json::to_value(&e)?;
                line["run_id"] = Value::String(run_id.to_owned());
                outln!("{line}")?;
            } else if let Some(line) = describe(&e) {
                let at = ms_of(&e.at);
                let base = *start_ms.get_or_insert(at.unwrap_or(0));
                let secs = at.map_or(0.0, |a| (a - base) as f64 / 1000.0);
                outln!("[+{secs:>6.2}s] {line}")?;
            }
            std::io::stdout().flush()?;
            match e.kind.as_str() {
                "run_succeeded" => return Ok(0),
                "run_failed" => return Ok(EXIT_FAILED),
                "run_cancelled" => return Ok(EXIT_CANCELLED),
                _ => {}
            }
            let status = e.data["status"].as_str().unwrap_or("");
            if status == "waiting_approval" || status == "waiting_input" {
                // Replayed history may show a wait that is over: ask for the run as it is now.
                let run: RunDto = c
                    .call(Method::GET, &format!("/v1/runs/{run_id}"), None)
                    .await?;
                if run.status == status && run.version == e.seq {
                    print_waiting(&run, output, !wait)?;
                    let _ = std::io::stdout().flush();
                    if !wait {
                        return Ok(EXIT_WAITING);
                    }
                }
            }
        }
        // The stream ended before the run did (a restart or a dropped connection).
        if reconnects >= MAX_RECONNECTS {
            anyhow::bail!("the event stream kept ending before the run did");
        }
        reconnects += 1;
        tokio::time::sleep(backoff(reconnects)).await;
    }
}
