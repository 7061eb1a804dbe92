//! Embedding agentd as a library: a program registers its own native tool, starts the runtime
//! in-process on the memory store, starts a run through `RuntimeHandle` and follows its events
//! until it ends. Run it with `cargo run --example embed`; it exits non-zero unless the run
//! succeeds with the tool's answer.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use agentd::agent::AgentSpec;
use agentd::model::ModelProvider;
use agentd::model::scripted::{Cassette, CassetteCall, CassetteReply, ScriptedModel};
use agentd::runtime::{NewRun, Runtime, RuntimeConfig, RuntimeParts};
use agentd::store::memory::MemoryStore;
use agentd::tool::registry::Registry;
use agentd::tool::{Tool, ToolContext, ToolEffect, ToolError, ToolErrorCode, ToolSpec};
use async_trait::async_trait;
use futures::StreamExt as _;
use serde_json::{Value, json};

/// A native tool: the forecast of a city, from a table this program owns.
struct Forecast {
    spec: ToolSpec,
}

impl Forecast {
    fn new() -> Self {
        let parameters = json!({
            "type": "object",
            "properties": { "city": { "type": "string" } },
            "required": ["city"],
            "additionalProperties": false
        });
        Forecast {
            spec: ToolSpec::new("forecast", "Tomorrow's weather in a city.", parameters)
                .effect(ToolEffect::Read),
        }
    }
}

#[async_trait]
impl Tool for Forecast {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn call(&self, _ctx: &ToolContext, arguments: Value) -> Result<Value, ToolError> {
        let city = arguments["city"].as_str().unwrap_or_default();
        match city {
            "Lisbon" => Ok(json!({ "city": city, "sky": "sunny", "high_c": 24 })),
            "Oslo" => Ok(json!({ "city": city, "sky": "snow", "high_c": -3 })),
            _ => Err(ToolError::new(
                ToolErrorCode::Failed,
                format!("no forecast for {city:?}"),
            )),
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut registry = Registry::new();
    registry.register(Arc::new(Forecast::new()))?;
    // A scripted model stands in for a real one: it calls the tool, then answers.
    let model = ScriptedModel::new(
        "scripted",
        Cassette::Replies {
            replies: vec![
                CassetteReply {
                    tool_calls: vec![CassetteCall {
                        name: "forecast".into(),
                        arguments: json!({ "city": "Lisbon" }),
                    }],
                    ..CassetteReply::default()
                },
                CassetteReply {
                    text: Some("Tomorrow in Lisbon: sunny, 24 °C.".into()),
                    ..CassetteReply::default()
                },
            ],
        },
    );
    let mut models: HashMap<String, Arc<dyn ModelProvider>> = HashMap::new();
    models.insert("scripted".into(), Arc::new(model));
    let runtime = Runtime::start(
        RuntimeConfig::default(),
        RuntimeParts {
            store: Arc::new(MemoryStore::new()),
            registry,
            models,
            agents: vec![
                AgentSpec::new("weather", "scripted")
                    .instructions("Answer weather questions with the forecast tool.")
                    .tools(["forecast"]),
            ],
            faults: None,
            redactor: None,
        },
    )
    .await?;
    let handle = runtime.handle();
    let (run, _created) = handle
        .create_run(NewRun {
            tenant: "example".into(),
            agent: "weather".into(),
            input: json!("What is the weather in Lisbon tomorrow?"),
            client_key: None,
            budget: Default::default(),
            metadata: Value::Null,
            scopes: None,
        })
        .await?;
    println!("run {}", run.id);
    let mut events = handle.follow("example", &run.id, 0).await?;
    let outcome = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(e) = events.next().await {
            let e = e?;
            println!("{:>3} {} {}", e.seq, e.kind, e.data);
            if matches!(
                e.kind.as_str(),
                "run_succeeded" | "run_failed" | "run_cancelled"
            ) {
                return Ok::<_, agentd::runtime::Error>(e);
            }
        }
        Err(agentd::runtime::Error::NotFound)
    })
    .await??;
    runtime.shutdown(Duration::from_secs(5)).await;
    if outcome.kind != "run_succeeded" || !outcome.data["output"].to_string().contains("sunny") {
        return Err(format!("the run ended {}: {}", outcome.kind, outcome.data).into());
    }
    println!("output: {}", outcome.data["output"]);
    Ok(())
}
