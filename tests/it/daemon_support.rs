//! Test harness: a daemon on 127.0.0.1:0 with a test configuration (scripted models, builtin
//! tools, a native `CountingTool` needing approval, two tenants), plus HTTP helpers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentd::config::Config;
use agentd::daemon::{self, Embedded};
use agentd::tool::builtin::{CountingTool, Ledger};
use agentd::tool::{ApprovalRule, ToolEffect};
use reqwest::{Method, StatusCode};
use serde_json::Value;
use tokio::sync::oneshot;

pub const ALPHA: &str = "alpha-token-0123456789";
pub const BETA: &str = "beta-token-0123456789ab";

/// The test configuration.
pub const CONFIG: &str = r#"
[server]
listen = "127.0.0.1:0"
shutdown_timeout = "5s"
sse_keep_alive = "1s"

[store]
url = "memory:"

[[tenants]]
id = "alpha"
tokens = ["alpha-token-0123456789"]

[[tenants]]
id = "beta"
tokens = ["beta-token-0123456789ab"]

[limits]
max_body_bytes = 65536
max_input_text_bytes = 1024

[models.quick]
kind = "scripted"
replies = [
  { tool_calls = [ { name = "add", arguments = { a = 1, b = 2 } } ] },
  { text = "3" },
]

[models.slow]
kind = "scripted"
delay = "80ms"
replies = [
  { tool_calls = [ { name = "echo", arguments = { text = "one" } } ] },
  { tool_calls = [ { name = "echo", arguments = { text = "two" } } ] },
  { tool_calls = [ { name = "echo", arguments = { text = "three" } } ] },
  { text = "done" },
]

[models.charge]
kind = "scripted"
replies = [
  { tool_calls = [ { name = "charge", arguments = { item = "order-1" } } ] },
  { text = "finished" },
]

[models.ask]
kind = "scripted"
rules = [ { when = { last_tool_contains = "blue" }, reply = { text = "you said blue" } } ]
default_reply = { tool_calls = [ { name = "ask_user", arguments = { question = "which color?" } } ] }

[models.hang]
kind = "scripted"
delay = "30s"
replies = [ { text = "late" } ]

[tools.add]
kind = "builtin"
builtin = "add"

[tools.echo]
kind = "builtin"
builtin = "echo"

[agents.quick]
model = "quick"
tools = ["add"]

[agents.slow]
model = "slow"
tools = ["echo"]

[agents.approver]
model = "charge"
tools = ["charge"]

[agents.asker]
model = "ask"

[agents.hang]
model = "hang"
"#;

/// A daemon running in this process.
pub struct TestDaemon {
    pub addr: SocketAddr,
    pub http: reqwest::Client,
    pub ledger: Arc<Ledger>,
    stop: Option<oneshot::Sender<()>>,
    join: Option<tokio::task::JoinHandle<Result<(), daemon::Error>>>,
}

impl TestDaemon {
    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    /// Starts with the test configuration changed by `edit`.
    pub async fn start_with(edit: impl FnOnce(&mut Config)) -> Self {
        let mut config = Config::from_toml(CONFIG).unwrap();
        edit(&mut config);
        Self::start_config(config).await
    }

    /// Starts with `config` (plus the native `charge` tool, needing approval).
    pub async fn start_config(config: Config) -> Self {
        let charge = CountingTool::new("charge", ToolEffect::Unsafe)
            .with_spec(|s| s.approval(ApprovalRule::Always));
        let ledger = charge.ledger();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let join = tokio::spawn(daemon::run_with(
            config,
            Embedded {
                tools: vec![Arc::new(charge)],
                ..Default::default()
            },
            listener,
            async move {
                let _ = rx.await;
            },
        ));
        let d = TestDaemon {
            addr,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(20))
                .build()
                .unwrap(),
            ledger,
            stop: Some(tx),
            join: Some(join),
        };
        d.wait_ready().await;
        d
    }

    async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(r) = self.http.get(self.url("/readyz")).send().await
                && r.status() == StatusCode::OK
            {
                return;
            }
            assert!(Instant::now() < deadline, "daemon not ready in time");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn base(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A request with `token` (if any) and a JSON body (if any).
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (StatusCode, reqwest::header::HeaderMap, Value) {
        let mut b = self.http.request(method, self.url(path));
        if let Some(t) = token {
            b = b.bearer_auth(t);
        }
        if let Some(body) = body {
            b = b.json(&body);
        }
        let res = b.send().await.unwrap();
        let status = res.status();
        let headers = res.headers().clone();
        let text = res.text().await.unwrap();
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, headers, v)
    }

    pub async fn get(&self, path: &str, token: &str) -> (StatusCode, Value) {
        let (s, _, v) = self.send(Method::GET, path, Some(token), None).await;
        (s, v)
    }

    pub async fn post(&self, path: &str, token: &str, body: Value) -> (StatusCode, Value) {
        let (s, _, v) = self.send(Method::POST, path, Some(token), Some(body)).await;
        (s, v)
    }

    /// Starts a run of `agent` as `token`'s tenant; returns its id.
    pub async fn create(&self, token: &str, agent: &str) -> String {
        let (s, v) = self
            .post(
                "/v1/runs",
                token,
                serde_json::json!({"agent": agent, "input": "go"}),
            )
            .await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        v["id"].as_str().unwrap().to_owned()
    }

    /// Polls the run until `done` holds (20 s deadline).
    pub async fn wait_run(&self, token: &str, id: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (s, v) = self.get(&format!("/v1/runs/{id}"), token).await;
            assert_eq!(s, StatusCode::OK, "{v}");
            if done(&v) {
                return v;
            }
            assert!(Instant::now() < deadline, "run {id} stuck at {v}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub async fn wait_status(&self, token: &str, id: &str, status: &str) -> Value {
        self.wait_run(token, id, |v| v["status"] == status).await
    }

    /// Stops the daemon; it must return within the bound.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(j) = self.join.take() {
            let r = tokio::time::timeout(Duration::from_secs(10), j)
                .await
                .expect("daemon did not stop in time")
                .unwrap();
            r.unwrap();
        }
    }
}

impl Drop for TestDaemon {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

/// Asserts an error answer: status, code, and the `{"error": {code, message}}` shape.
pub fn assert_error(status: StatusCode, body: &Value, want: StatusCode, code: &str) {
    assert_eq!(status, want, "{body}");
    assert_eq!(body["error"]["code"], code, "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");
}

/// The start of a one-tenant configuration (tenant `alpha`, token [`ALPHA`], memory store, any
/// free port): a test appends its models, tools and agents.
pub fn alpha_on_memory() -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
shutdown_timeout = "5s"

[store]
url = "memory:"

[[tenants]]
id = "alpha"
tokens = ["{ALPHA}"]
"#
    )
}

/// The test configuration for a daemon in another process (no native `charge` tool there).
pub fn file_config() -> String {
    CONFIG.replace(r#"tools = ["charge"]"#, r#"tools = ["add"]"#)
}
