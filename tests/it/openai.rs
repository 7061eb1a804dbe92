//! `OpenAiProvider` against the fake OpenAI-compatible server: wire format, tool calls,
//! classification of 429/5xx/4xx/timeouts, malformed tool-call JSON, streaming.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentd::ids::RunId;
use agentd::model::openai::{ApiKey, OpenAiConfig, OpenAiProvider};
use agentd::model::{
    Message, ModelErrorKind, ModelProvider, ModelRequest, ModelToolCall, ToolChoice, ToolDefinition,
};
use serde_json::json;

use crate::fakes::{FakeOpenAi, Scripted};

const KEY: &str = "sk-test-planted-key-0123456789";

fn provider(fake: &FakeOpenAi, timeout: Duration) -> OpenAiProvider {
    let mut cfg = OpenAiConfig::new("fake", fake.url(), "fake-model");
    cfg.api_key = Some(ApiKey::new(KEY));
    cfg.timeout = timeout;
    OpenAiProvider::new(cfg).unwrap()
}

fn request(tools: bool) -> ModelRequest {
    ModelRequest {
        prior_replies: 0,
        run_id: RunId::generate(),
        tenant: "t".into(),
        model: "fake".into(),
        messages: vec![
            Message::System {
                content: "be brief".into(),
            },
            Message::User {
                content: "what is 2+40?".into(),
            },
        ],
        tools: if tools {
            vec![ToolDefinition {
                name: "add".into(),
                description: "adds".into(),
                parameters: json!({"type": "object", "properties": {"a": {"type": "number"}}}),
            }]
            .into()
        } else {
            Vec::new().into()
        },
        tool_choice: ToolChoice::Auto,
    }
}

#[tokio::test]
async fn text_and_tool_call_replies_round_trip() {
    let fake = FakeOpenAi::start().await;
    fake.push(Scripted::tool_calls(&[(
        "call_1",
        "add",
        r#"{"a":2,"b":40}"#,
    )]))
    .push(Scripted::text("42"));
    let p = provider(&fake, Duration::from_secs(5));

    let reply = p.complete(&request(true)).await.unwrap();
    assert_eq!(
        reply.tool_calls,
        vec![ModelToolCall {
            id: "call_1".into(),
            name: "add".into(),
            arguments: r#"{"a":2,"b":40}"#.into()
        }]
    );
    assert_eq!(reply.usage.input_tokens, 20);

    let mut req = request(true);
    req.messages.push(Message::Assistant {
        content: None,
        tool_calls: reply.tool_calls.clone(),
    });
    req.messages.push(Message::Tool {
        call_id: "call_1".into(),
        content: r#"{"ok":true,"data":42}"#.into(),
    });
    let reply = p.complete(&req).await.unwrap();
    assert_eq!(reply.text.as_deref(), Some("42"));
    assert_eq!(
        (reply.usage.input_tokens, reply.usage.output_tokens),
        (11, 3)
    );

    let sent = fake.requests();
    assert_eq!(sent.len(), 2);
    assert_eq!(
        sent[0].authorization.as_deref(),
        Some(&*format!("Bearer {KEY}"))
    );
    assert_eq!(sent[0].body["model"], "fake-model");
    assert_eq!(sent[0].body["tool_choice"], "auto");
    assert_eq!(sent[0].body["tools"][0]["function"]["name"], "add");
    assert_eq!(sent[1].body["messages"][2]["tool_calls"][0]["id"], "call_1");
    assert_eq!(
        sent[1].body["messages"][3],
        json!({"role": "tool", "tool_call_id": "call_1", "content": "{\"ok\":true,\"data\":42}"})
    );
}

#[tokio::test]
async fn tool_calls_count_even_when_finish_reason_says_stop() {
    let fake = FakeOpenAi::start().await;
    fake.push(Scripted::Completion(json!({
        "choices": [{"finish_reason": "stop", "message": {"content": "", "tool_calls": [
            {"id": "c9", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}}]
    })));
    let reply = provider(&fake, Duration::from_secs(5))
        .complete(&request(true))
        .await
        .unwrap();
    assert_eq!(reply.tool_calls.len(), 1);
    assert_eq!(reply.text, None);
}

#[tokio::test]
async fn malformed_tool_call_json_is_passed_through_verbatim() {
    let fake = FakeOpenAi::start().await;
    fake.push(Scripted::tool_calls(&[("c1", "add", r#"{"a": 2, "b": "#)]));
    let reply = provider(&fake, Duration::from_secs(5))
        .complete(&request(true))
        .await
        .unwrap();
    assert_eq!(reply.tool_calls[0].arguments, r#"{"a": 2, "b": "#);
}

#[tokio::test]
async fn rate_limit_is_classified_with_retry_after() {
    let fake = FakeOpenAi::start().await;
    fake.push(Scripted::rate_limited("2"));
    fake.push(Scripted::Status {
        status: 429,
        headers: vec![("retry-after-ms".into(), "1500".into())],
        body: "{}".into(),
    });
    let p = provider(&fake, Duration::from_secs(5));
    let err = p.complete(&request(false)).await.unwrap_err();
    assert_eq!(err.error.kind, ModelErrorKind::RateLimited);
    assert_eq!(err.retry_after, Some(Duration::from_secs(2)));
    assert!(
        err.error.message.contains("Rate limit reached"),
        "{}",
        err.error.message
    );
    let err = p.complete(&request(false)).await.unwrap_err();
    assert_eq!(err.retry_after, Some(Duration::from_millis(1500)));
}

#[tokio::test]
async fn quota_server_errors_and_rejections_are_classified() {
    let fake = FakeOpenAi::start().await;
    fake.push(Scripted::status(429, r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#))
        .push(Scripted::status(500, r#"{"error":{"message":"boom"}}"#))
        .push(Scripted::status(503, "Loading model"))
        .push(Scripted::status(400, &format!(r#"{{"error":{{"message":"context too long; key was {KEY}"}}}}"#)))
        .push(Scripted::status(401, r#"{"error":{"message":"Incorrect API key provided"}}"#));
    let p = provider(&fake, Duration::from_secs(5));
    let kinds = [
        ModelErrorKind::Rejected,
        ModelErrorKind::Unavailable,
        ModelErrorKind::Unavailable,
        ModelErrorKind::Rejected,
        ModelErrorKind::Rejected,
    ];
    for (i, kind) in kinds.iter().enumerate() {
        let err = p.complete(&request(false)).await.unwrap_err();
        assert_eq!(err.error.kind, *kind, "reply {i}: {}", err.error);
        assert!(
            !err.error.message.contains(KEY),
            "key leaked: {}",
            err.error.message
        );
    }
    // The 400 kept the server's message, minus the key.
    assert_eq!(fake.request_count(), 5);
}

#[tokio::test]
async fn unusable_success_bodies_are_unavailable() {
    let fake = FakeOpenAi::start().await;
    fake.push(Scripted::Status {
        status: 200,
        headers: vec![],
        body: "<html>proxy</html>".into(),
    })
    .push(Scripted::Completion(json!({"choices": []})));
    let p = provider(&fake, Duration::from_secs(5));
    for _ in 0..2 {
        let err = p.complete(&request(false)).await.unwrap_err();
        assert_eq!(err.error.kind, ModelErrorKind::Unavailable);
    }
}

#[tokio::test]
async fn slow_server_times_out_as_unavailable() {
    let fake = FakeOpenAi::start().await;
    fake.push(Scripted::Hang);
    let p = provider(&fake, Duration::from_millis(300));
    let started = std::time::Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(10), p.complete(&request(false)))
        .await
        .expect("the provider's own timeout must fire")
        .unwrap_err();
    assert_eq!(err.error.kind, ModelErrorKind::Unavailable);
    assert!(
        err.error.message.contains("timed out"),
        "{}",
        err.error.message
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn refused_connection_is_unavailable() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let mut cfg = OpenAiConfig::new("gone", format!("http://{addr}/v1"), "m");
    cfg.timeout = Duration::from_secs(5);
    let err = OpenAiProvider::new(cfg)
        .unwrap()
        .complete(&request(false))
        .await
        .unwrap_err();
    assert_eq!(err.error.kind, ModelErrorKind::Unavailable);
}

#[tokio::test]
async fn streaming_accumulates_text_and_interleaved_tool_calls() {
    let fake = FakeOpenAi::start().await;
    let chunks = [
        json!({"choices":[{"index":0,"delta":{"role":"assistant","content":"Let me "}}]}),
        json!({"choices":[{"index":0,"delta":{"content":"add."}}]}),
        json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c0","type":"function","function":{"name":"add","arguments":"{\"a\":"}}]}}]}),
        json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"c1","type":"function","function":{"name":"add","arguments":"{\"a\":3}"}}]}}]}),
        json!({"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"2}"}}]}}]}),
        json!({"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}),
        json!({"choices":[],"usage":{"prompt_tokens":30,"completion_tokens":12}}),
    ];
    let mut events: Vec<String> = chunks.iter().map(|c| c.to_string()).collect();
    events.push("[DONE]".into());
    fake.push(Scripted::Sse(events));
    // A stream cut before [DONE] and before any finish_reason is a failed attempt.
    fake.push(Scripted::Sse(vec![chunks[0].to_string()]));

    let mut cfg = OpenAiConfig::new("fake", fake.url(), "fake-model");
    cfg.compat.stream = true;
    cfg.timeout = Duration::from_secs(5);
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink_seen = Arc::clone(&seen);
    let p = OpenAiProvider::new(cfg).unwrap().with_delta_sink(Arc::new(
        move |_run: &RunId, d: &str| sink_seen.lock().unwrap().push(d.to_owned()),
    ));

    let reply = p.complete(&request(true)).await.unwrap();
    assert_eq!(reply.text.as_deref(), Some("Let me add."));
    assert_eq!(reply.tool_calls.len(), 2);
    assert_eq!(reply.tool_calls[0].arguments, r#"{"a":2}"#);
    assert_eq!(reply.tool_calls[1].id, "c1");
    assert_eq!(
        (reply.usage.input_tokens, reply.usage.output_tokens),
        (30, 12)
    );
    assert_eq!(
        *seen.lock().unwrap(),
        vec!["Let me ".to_owned(), "add.".to_owned()]
    );
    let body = &fake.requests()[0].body;
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"]["include_usage"], true);

    let err = p.complete(&request(true)).await.unwrap_err();
    assert_eq!(err.error.kind, ModelErrorKind::Unavailable);
}

#[tokio::test]
async fn a_streamed_reply_larger_than_the_reply_cap_is_refused() {
    use agentd::model::openai::MAX_REPLY_BYTES;
    let fake = FakeOpenAi::start().await;
    let piece = "x".repeat(64 * 1024);
    let chunk = json!({"choices":[{"index":0,"delta":{"content": piece}}]}).to_string();
    // Never a finish: without the cap, the reply would grow for as long as the stream lasts.
    let events = vec![chunk; MAX_REPLY_BYTES / (64 * 1024) + 2];
    fake.push(Scripted::Sse(events));
    let mut cfg = OpenAiConfig::new("fake", fake.url(), "fake-model");
    cfg.compat.stream = true;
    cfg.timeout = Duration::from_secs(20);
    let p = OpenAiProvider::new(cfg).unwrap();
    let err = p.complete(&request(false)).await.unwrap_err();
    assert_eq!(
        err.error.kind,
        ModelErrorKind::Rejected,
        "{}",
        err.error.message
    );
    assert!(
        err.error.message.contains("larger than"),
        "{}",
        err.error.message
    );
}
