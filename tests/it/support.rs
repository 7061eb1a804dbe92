//! Shared helpers: an in-process runtime on the memory store with scripted models and
//! recording tools.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use agentd::agent::AgentSpec;
use agentd::model::scripted::ScriptedModel;
use agentd::model::{ModelProvider, ModelReply, ModelToolCall};
use agentd::runtime::actor::FaultInjector;
use agentd::runtime::{NewRun, Runtime, RuntimeConfig, RuntimeHandle, RuntimeParts};
use agentd::store::SharedStore;
use agentd::store::memory::MemoryStore;
use agentd::tool::Tool;
use agentd::tool::registry::Registry;
use serde_json::Value;

pub const TENANT: &str = "acme";
pub const WAIT: Duration = Duration::from_secs(20);

/// A reply with tool calls; arguments as JSON values.
pub fn calls(list: &[(&str, Value)]) -> ModelReply {
    ModelReply {
        text: None,
        tool_calls: list
            .iter()
            .enumerate()
            .map(|(i, (name, args))| ModelToolCall {
                id: format!("m{i}"),
                name: (*name).to_owned(),
                arguments: args.to_string(),
            })
            .collect(),
        usage: Default::default(),
    }
}

/// A final-answer reply.
pub fn text(t: &str) -> ModelReply {
    ModelReply {
        text: Some(t.to_owned()),
        ..Default::default()
    }
}

/// A runtime under test.
pub struct Harness {
    pub runtime: Option<Runtime>,
    pub handle: RuntimeHandle,
    /// The store the runtime writes to, for checks that read it directly.
    #[allow(dead_code)]
    pub store: SharedStore,
}

/// Builds a harness.
pub struct Builder {
    pub config: RuntimeConfig,
    pub registry: Registry,
    pub models: HashMap<String, Arc<dyn ModelProvider>>,
    pub agents: Vec<AgentSpec>,
    pub faults: Option<Arc<dyn FaultInjector>>,
    pub store: SharedStore,
}

impl Builder {
    pub fn new() -> Self {
        let mut config = RuntimeConfig::default();
        config.restart.backoff_base = Duration::from_millis(10);
        config.restart.backoff_max = Duration::from_millis(50);
        config.policy.retry_base_ms = 5;
        config.policy.retry_max_ms = 50;
        config.gateway.retry_base = Duration::from_millis(5);
        config.gateway.retry_max = Duration::from_millis(50);
        Builder {
            config,
            registry: Registry::new(),
            models: HashMap::new(),
            agents: Vec::new(),
            faults: None,
            store: Arc::new(MemoryStore::new()),
        }
    }

    pub fn tool(mut self, t: Arc<dyn Tool>) -> Self {
        self.registry.register(t).unwrap();
        self
    }

    pub fn model(mut self, m: ScriptedModel) -> Self {
        let name = agentd::model::ModelProvider::name(&m).to_owned();
        self.models.insert(name, Arc::new(m));
        self
    }

    pub fn agent(mut self, a: AgentSpec) -> Self {
        self.agents.push(a);
        self
    }

    pub async fn start(self) -> Harness {
        let store = self.store.clone();
        let runtime = Runtime::start(
            self.config,
            RuntimeParts {
                store: self.store,
                registry: self.registry,
                models: self.models,
                agents: self.agents,
                faults: self.faults,
                redactor: None,
            },
        )
        .await
        .unwrap();
        Harness {
            handle: runtime.handle(),
            runtime: Some(runtime),
            store,
        }
    }
}

impl Harness {
    pub async fn start_run(&self, agent: &str, input: &str) -> agentd::ids::RunId {
        self.start_with(NewRun {
            tenant: TENANT.into(),
            agent: agent.into(),
            input: Value::String(input.into()),
            client_key: None,
            budget: Default::default(),
            metadata: Value::Null,
            scopes: None,
        })
        .await
    }

    pub async fn start_with(&self, req: NewRun) -> agentd::ids::RunId {
        self.handle.create_run(req).await.unwrap().0.id
    }

    pub async fn finish(&self, id: &agentd::ids::RunId) -> agentd::run::RunState {
        self.handle.wait_terminal(TENANT, id, WAIT).await.unwrap()
    }

    /// Event types of the run, in order.
    pub async fn kinds(&self, id: &agentd::ids::RunId) -> Vec<String> {
        self.handle
            .events(TENANT, id, 0, 10_000)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.kind)
            .collect()
    }

    pub async fn shutdown(mut self) {
        if let Some(r) = self.runtime.take() {
            r.shutdown(Duration::from_secs(10)).await;
        }
    }
}
