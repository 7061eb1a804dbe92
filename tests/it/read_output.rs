//! Long outputs and long runs (issue 9): a tool output the context cuts names the
//! `read_output` call that reads on, and the model reads the whole stored output back in
//! bounded pages; a reference of another run is refused and reads nothing. A run whose older
//! turns are condensed keeps its place in a scripted cassette. Through the daemon's HTTP API, with
//! the real OpenAI-compatible provider against `FakeOpenAi` and an HTTP tool against the
//! recording `ToolServer`.

use agentd::config::Config;
use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::daemon_support::{ALPHA, TestDaemon, alpha_on_memory};
use crate::fakes::{FakeOpenAi, Scripted, ToolBehavior, ToolServer};

fn config(model: &FakeOpenAi, tools: &ToolServer) -> Config {
    let text = format!(
        r#"{header}
[models.fake]
kind = "openai"
base_url = "{model_url}"
model = "fake-model"
timeout = "2s"

[tools.report]
kind = "http"
url = "{tool_url}"
description = "Fetch the report"
parameters = {{ type = "object", properties = {{}} }}
effect = "read"
timeout = "2s"

[agents.reader]
model = "fake"
instructions = "Read the report."
tools = ["report"]
max_turns = 12
context_tool_output_bytes = 8192
"#,
        header = alpha_on_memory(),
        model_url = model.url(),
        tool_url = tools.tool_url(),
    );
    Config::from_toml(&text).unwrap()
}

/// The JSON of the tool messages (role `tool`) of a recorded model request, with their ids.
fn tool_messages(body: &Value) -> Vec<(String, String)> {
    body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            (
                m["tool_call_id"].as_str().unwrap_or_default().to_owned(),
                m["content"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_cut_output_is_read_back_whole_in_pages_and_other_runs_are_refused() {
    let model = FakeOpenAi::start().await;
    let tools = ToolServer::start().await;
    // A 40,000-byte text: its envelope is cut at 8 KiB in the request.
    let report: String = (0..40_000u32)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    tools.push(ToolBehavior::ApplyWith(
        json!({ "report": report }).to_string(),
    ));
    let page =
        |offset: u64| json!({"call_id": "r1", "offset": offset, "max_bytes": 16384}).to_string();
    model.push(Scripted::tool_calls(&[("r1", "report", "{}")]));
    for (i, offset) in [0u64, 16384, 32768].into_iter().enumerate() {
        model.push(Scripted::tool_calls(&[(
            &format!("p{i}"),
            "read_output",
            &page(offset),
        )]));
    }
    let other_run = json!({"call_id": "r1", "run_id": "run_0193a1b2c3d4e5f60718293a4b5c6d7e"});
    model.push(Scripted::tool_calls(&[(
        "x1",
        "read_output",
        &other_run.to_string(),
    )]));
    let unknown_call = json!({"call_id": "c_of_another_run"});
    model.push(Scripted::tool_calls(&[(
        "x2",
        "read_output",
        &unknown_call.to_string(),
    )]));
    model.push(Scripted::text("I read the whole report."));

    let d = TestDaemon::start_config(config(&model, &tools)).await;
    let id = d.create(ALPHA, "reader").await;
    let run = d.wait_status(ALPHA, &id, "succeeded").await;
    assert_eq!(run["output"], "I read the whole report.", "{run}");
    assert_eq!(
        tools.total_executions(),
        1,
        "the tool ran once; pages never call it"
    );

    // The stored output, as the transcript endpoint serves it.
    let (s, v) = d
        .get(&format!("/v1/runs/{id}/messages?limit=100"), ALPHA)
        .await;
    assert_eq!(s, StatusCode::OK);
    let stored = v["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "tool" && m["tool_call_id"] == "r1")
        .and_then(|m| m["content"].as_str())
        .expect("the stored output of r1")
        .to_owned();
    assert!(stored.len() > 40_000, "{}", stored.len());

    let requests = model.requests();
    // The request after the tool ran shows the cut output and how to read on.
    let second = tool_messages(&requests[1].body);
    let (_, cut) = &second[0];
    assert!(cut.len() < 9_000, "{} bytes sent", cut.len());
    let pointer = r#"read the rest with read_output {"call_id":"r1","offset":8192}"#;
    assert!(
        cut.contains(pointer),
        "{}",
        &cut[cut.len().saturating_sub(200)..]
    );

    // The pages, as the model received them, rejoin to the stored output exactly.
    let last = tool_messages(&requests.last().unwrap().body);
    let result = |id: &str| -> Value {
        let (_, content) = last.iter().find(|(c, _)| c == id).unwrap();
        serde_json::from_str(content).unwrap()
    };
    let mut joined = String::new();
    let total = result("p0")["data"]["total_bytes"].as_u64().unwrap();
    assert!(total > 40_000 && total == stored.len() as u64, "{total}");
    for (i, offset) in [0u64, 16384, 32768].into_iter().enumerate() {
        let r = result(&format!("p{i}"));
        assert_eq!(r["ok"], true, "{}", r["error"]);
        assert_eq!(r["data"]["offset"], offset);
        assert_eq!(r["data"]["total_bytes"], total);
        assert!(r["data"]["bytes"].as_u64().unwrap() <= 16384);
        joined.push_str(r["data"]["text"].as_str().unwrap());
        let next = &r["data"]["next_offset"];
        if i < 2 {
            assert_eq!(next, &json!(offset + 16384));
        } else {
            assert!(next.is_null(), "{next}");
        }
    }
    // The transcript endpoint serves a result envelope re-encoded (as parsed JSON, redacted):
    // the pages rejoin to the same value.
    let joined: Value = serde_json::from_str(&joined).expect("the pages rejoin to JSON");
    let stored: Value = serde_json::from_str(&stored).unwrap();
    assert!(joined == stored, "the pages rejoin to the stored output");
    assert_eq!(
        joined["data"]["report"].as_str().map(str::len),
        Some(40_000)
    );

    // A reference of another run is refused; so is a call this run never made.
    let refused = result("x1");
    assert_eq!(refused["ok"], false);
    assert_eq!(refused["error"]["code"], "permission_denied", "{refused}");
    let unknown = result("x2");
    assert_eq!(unknown["ok"], false);
    assert!(
        unknown["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no output of call"),
        "{unknown}"
    );
    d.stop().await;
}

/// A long run whose older turns are condensed keeps its place in a scripted cassette: the
/// request shows fewer replies than the run made, and the scripted model counts the run's.
#[tokio::test]
async fn a_scripted_run_keeps_its_place_after_older_turns_are_condensed() {
    let steps = 12;
    let replies: Vec<String> = (1..=steps)
        .map(|i| format!(r#"{{ tool_calls = [ {{ name = "echo", arguments = {{ text = "step {i} {}" }} }} ] }}"#, "x".repeat(200)))
        .chain([r#"{ text = "done" }"#.to_owned()])
        .collect();
    let text = format!(
        r#"{}
[models.long]
kind = "scripted"
replies = [
{}
]

[tools.echo]
kind = "builtin"
builtin = "echo"

[agents.long]
model = "long"
tools = ["echo"]
max_turns = 20
context_tokens = 600
"#,
        alpha_on_memory(),
        replies.join(",\n")
    );
    let d = TestDaemon::start_config(Config::from_toml(&text).unwrap()).await;
    let id = d.create(ALPHA, "long").await;
    let run = d
        .wait_run(ALPHA, &id, |v| {
            ["succeeded", "failed"].contains(&v["status"].as_str().unwrap_or_default())
        })
        .await;
    assert_eq!(run["status"], "succeeded", "{run}");
    assert_eq!(run["output"], "done");
    let (s, v) = d
        .get(&format!("/v1/runs/{id}/events?limit=500"), ALPHA)
        .await;
    assert_eq!(s, StatusCode::OK);
    let events = v["events"].as_array().unwrap();
    // The context (600 tokens) holds only the newest turns, yet every step was asked once, in
    // order: counted from the requests alone, the cassette started over and the run ended
    // `no_progress`.
    let texts: Vec<String> = events
        .iter()
        .filter(|e| e["type"] == "model_replied")
        .flat_map(|e| e["data"]["calls"].as_array().cloned().unwrap_or_default())
        .map(|c| {
            c["arguments"]["text"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    let expected: Vec<String> = (1..=steps)
        .map(|i| format!("step {i} {}", "x".repeat(200)))
        .collect();
    assert_eq!(texts, expected);
    d.stop().await;
}

mod kept_in_part {
    //! On the runtime directly: a stored output longer than what the context shows is kept
    //! in the run's memory only as far as it is shown; `read_output` pages beyond that are
    //! read from the stored transcript entry, and rejoin exactly to the output as stored.

    use std::sync::{Arc, Mutex};

    use agentd::agent::AgentSpec;
    use agentd::context::ContextBudget;
    use agentd::model::scripted::ScriptedModel;
    use agentd::model::{Message, ModelReply, ModelToolCall};
    use agentd::run::{RunEvent, RunState, Status};
    use agentd::runtime::actor::FaultInjector;
    use agentd::tool::{Tool, ToolContext, ToolEffect, ToolError, ToolSpec};
    use serde_json::{Value, json};

    use crate::support::{Builder, TENANT, WAIT};

    const CUT: usize = 1024;

    /// Answers one long text, about 37,000 bytes with wide characters in it.
    struct Long {
        spec: ToolSpec,
    }

    #[async_trait::async_trait]
    impl Tool for Long {
        fn spec(&self) -> &ToolSpec {
            &self.spec
        }

        async fn call(&self, _ctx: &ToolContext, _arguments: Value) -> Result<Value, ToolError> {
            Ok(json!({"text": "é·report·".repeat(3_077)}))
        }
    }

    fn call(id: &str, name: &str, arguments: Value) -> ModelReply {
        ModelReply {
            tool_calls: vec![ModelToolCall {
                id: id.into(),
                name: name.into(),
                arguments: arguments.to_string(),
            }],
            ..Default::default()
        }
    }

    /// Reads the long output: the pointer of the cut, then page after page until the last,
    /// then answers with the pages joined.
    fn reader() -> ScriptedModel {
        ScriptedModel::from_fn("m", |req| {
            let last = req.messages.iter().rev().find_map(|m| match m {
                Message::Tool { call_id, content } => Some((call_id.clone(), content.clone())),
                _ => None,
            });
            let pages: Vec<Value> = req
                .messages
                .iter()
                .filter_map(|m| match m {
                    Message::Tool { call_id, content } if call_id.starts_with("page") => {
                        serde_json::from_str::<Value>(content).ok()
                    }
                    _ => None,
                })
                .collect();
            Ok(match last {
                None => call("long", "long", json!({})),
                Some((id, content)) if id == "long" => {
                    let pointer = content
                        .split("read_output ")
                        .nth(1)
                        .and_then(|rest| rest.strip_suffix(']'))
                        .expect("the cut names the read_output call");
                    let mut args: Value = serde_json::from_str(pointer).unwrap();
                    // The pointer reads on after the cut (on a character boundary).
                    let after = args["offset"].as_u64().unwrap_or(0) as usize;
                    assert!(after > CUT - 4 && after <= CUT, "{after}");
                    // From the start, so the pages make the whole output.
                    args["offset"] = json!(0);
                    args["max_bytes"] = json!(16 * 1024);
                    call("page0", "read_output", args)
                }
                Some(_) => {
                    let data = &pages.last().unwrap()["data"];
                    match data["next_offset"].as_u64() {
                        Some(next) => call(
                            &format!("page{}", pages.len()),
                            "read_output",
                            json!({"call_id": "long", "offset": next, "max_bytes": 16 * 1024}),
                        ),
                        None => ModelReply {
                            text: Some(
                                pages
                                    .iter()
                                    .map(|p| p["data"]["text"].as_str().unwrap())
                                    .collect::<String>(),
                            ),
                            ..Default::default()
                        },
                    }
                }
            })
        })
    }

    /// What the run held in memory of the long output at each read_output result.
    #[derive(Default)]
    struct Watch(Mutex<Vec<(usize, Option<usize>)>>);

    impl FaultInjector for Watch {
        fn panic_before(&self, run: &RunState, event: &RunEvent) -> bool {
            if let RunEvent::ToolFinished { .. } = event
                && let Some((i, len)) = run.messages.iter().enumerate().find_map(|(i, m)| match m {
                    Message::Tool { call_id, content } if call_id == "long" => {
                        Some((i, content.len()))
                    }
                    _ => None,
                })
            {
                self.0
                    .lock()
                    .unwrap()
                    .push((len, run.trimmed_outputs.get(&i).copied()));
            }
            false
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_long_output_is_kept_as_far_as_shown_and_read_back_whole_from_the_store() {
        let watch = Arc::new(Watch::default());
        let mut b = Builder::new()
            .tool(Arc::new(Long {
                spec: ToolSpec::new("long", "A long report.", json!({"type": "object"}))
                    .effect(ToolEffect::Read),
            }))
            .model(reader())
            .agent(
                AgentSpec::new("a", "m")
                    .tools(["long"])
                    .context(ContextBudget {
                        max_tokens: 100_000,
                        max_tool_output_bytes: CUT,
                        read_output: true,
                    }),
            );
        b.faults = Some(watch.clone());
        let h = b.start().await;
        let id = h.start_run("a", "read the report").await;
        let run = h.handle.wait_terminal(TENANT, &id, WAIT).await.unwrap();
        assert_eq!(run.status, Status::Succeeded, "{:?}", run.error);
        // The output as stored, whole.
        let (messages, _) = h.handle.messages(TENANT, &id, 0, 100).await.unwrap();
        let stored = messages
            .iter()
            .find_map(|(_, m)| match m {
                Message::Tool { call_id, content } if call_id == "long" => Some(content.clone()),
                _ => None,
            })
            .unwrap();
        assert!(stored.len() > 36_000, "{}", stored.len());
        // Read back page by page (from the store: memory kept only the head), it is whole.
        // (The joined pages are the envelope's JSON, so the run's output is that JSON.)
        let whole: Value = serde_json::from_str(&stored).unwrap();
        assert!(
            run.output.as_ref() == Some(&whole),
            "the pages did not rejoin to the output"
        );
        let seen = watch.0.lock().unwrap().clone();
        // One observation per page (the long output's own result came before its message).
        assert_eq!(seen.len(), 3, "{seen:?}");
        for (len, whole) in &seen {
            assert!(*len <= CUT, "kept {len} bytes of it in memory");
            assert_eq!(*whole, Some(stored.len()));
        }
        h.shutdown().await;
    }
}
