//! The scripted model provider: replays a cassette (a list of replies, or rules on the
//! conversation) with an optional per-call delay. For tests, the demo and the benchmark.
//!
//! It is stateless per run: the reply for a request is chosen from the conversation itself (how
//! many assistant turns it holds, what the last tool result says), so a restarted run gets the
//! same replies — exactly like a recorded cassette.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dashmap::DashMap;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{
    AttemptError, Message, ModelError, ModelErrorKind, ModelProvider, ModelReply, ModelRequest,
    ModelToolCall, TokenUsage,
};

/// A tool call as written in a cassette: arguments as JSON (or a raw string to test malformed
/// arguments).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CassetteCall {
    /// The tool to call.
    pub name: String,
    /// The arguments, sent as their JSON text; a JSON string is sent verbatim instead.
    #[serde(default)]
    pub arguments: Value,
}

/// A scripted failure, returned `times` times for the same (run, turn) before the reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CassetteError {
    /// The class of the failure (decides whether the gateway retries it).
    pub kind: ModelErrorKind,
    /// The error's message (default empty).
    #[serde(default)]
    pub message: String,
    /// Attempts that fail before the reply is given (default 1).
    #[serde(default = "one")]
    pub times: u32,
    /// `Retry-After` carried by the failure, in ms; `None`: none.
    #[serde(default)]
    pub retry_after_ms: Option<u64>,
}

fn one() -> u32 {
    1
}

/// One scripted reply.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CassetteReply {
    /// The reply's text; `None`: no text.
    #[serde(default)]
    pub text: Option<String>,
    /// Tool calls, given the ids `m<turn>_<index>`.
    #[serde(default)]
    pub tool_calls: Vec<CassetteCall>,
    /// Fail first, then reply.
    #[serde(default)]
    pub error: Option<CassetteError>,
    /// Input tokens reported; `None`: a quarter of the conversation's bytes.
    #[serde(default)]
    pub input_tokens: Option<u64>,
    /// Output tokens reported; `None`: a quarter of the reply's bytes, at least 1.
    #[serde(default)]
    pub output_tokens: Option<u64>,
}

/// When a rule applies. All given conditions must hold.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Condition {
    /// The turn number (1 = the first model call of the run).
    #[serde(default)]
    pub turn: Option<u32>,
    /// The last tool result contains this text.
    #[serde(default)]
    pub last_tool_contains: Option<String>,
    /// The last user message contains this text.
    #[serde(default)]
    pub last_user_contains: Option<String>,
    /// Tools are disabled for this turn (a forced final turn).
    #[serde(default)]
    pub tools_disabled: Option<bool>,
}

/// A rule: the first matching rule's reply is used.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rule {
    /// When the rule applies (default: always).
    #[serde(default)]
    pub when: Condition,
    /// The reply it gives.
    pub reply: CassetteReply,
}

/// A cassette.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Cassette {
    /// Reply `i` answers turn `i + 1`; past the end, the last reply repeats.
    Replies {
        /// The replies, in turn order.
        replies: Vec<CassetteReply>,
    },
    /// The first rule whose condition holds; `default` otherwise.
    Rules {
        /// The rules, tried in order.
        rules: Vec<Rule>,
        /// The reply when no rule holds; `None`: the attempt fails as `Rejected`.
        #[serde(default)]
        default: Option<CassetteReply>,
    },
}

/// Chooses replies by code (for tests that need more than a cassette).
pub type ScriptFn = dyn Fn(&ModelRequest) -> Result<ModelReply, ModelError> + Send + Sync;

enum Script {
    Cassette(Cassette),
    Fn(Arc<ScriptFn>),
    Demo(DemoScript),
}

/// The scripted provider.
pub struct ScriptedModel {
    name: String,
    script: Script,
    delay: Duration,
    /// Failures already returned per (run, turn).
    failures: DashMap<(String, u32), u32>,
}

impl std::fmt::Debug for ScriptedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScriptedModel")
            .field("name", &self.name)
            .finish()
    }
}

/// The turn a request is for: the model's replies so far + 1. Counted over the run's whole
/// history (`prior_replies`), or over the request's messages when that is larger (a request
/// built by hand, in tests), so a long run whose older turns were condensed keeps its place in
/// a cassette.
pub fn turn_of(request: &ModelRequest) -> u32 {
    let shown = request
        .messages
        .iter()
        .filter(|m| matches!(m, Message::Assistant { .. }))
        .count() as u32;
    shown.max(request.prior_replies) + 1
}

impl ScriptedModel {
    /// A model named `name` that plays `cassette`, with no delay.
    pub fn new(name: impl Into<String>, cassette: Cassette) -> Self {
        ScriptedModel {
            name: name.into(),
            script: Script::Cassette(cassette),
            delay: Duration::ZERO,
            failures: DashMap::new(),
        }
    }

    /// A model named `name` whose replies `f` computes (its errors carry no `Retry-After`).
    pub fn from_fn(
        name: impl Into<String>,
        f: impl Fn(&ModelRequest) -> Result<ModelReply, ModelError> + Send + Sync + 'static,
    ) -> Self {
        ScriptedModel {
            name: name.into(),
            script: Script::Fn(Arc::new(f)),
            delay: Duration::ZERO,
            failures: DashMap::new(),
        }
    }

    /// Parses a cassette from JSON text.
    pub fn parse_cassette(json: &str) -> Result<Cassette, String> {
        serde_json::from_str(json).map_err(|e| format!("invalid cassette: {e}"))
    }

    /// Sleeps `delay` before every attempt (to simulate model latency).
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    fn pick(&self, request: &ModelRequest) -> Option<CassetteReply> {
        let Script::Cassette(cassette) = &self.script else {
            return None;
        };
        let turn = turn_of(request);
        match cassette {
            Cassette::Replies { replies } => replies
                .get(turn as usize - 1)
                .or_else(|| replies.last())
                .cloned(),
            Cassette::Rules { rules, default } => rules
                .iter()
                .find(|r| matches(&r.when, turn, request))
                .map(|r| r.reply.clone())
                .or_else(|| default.clone()),
        }
    }

    fn render(
        &self,
        request: &ModelRequest,
        reply: CassetteReply,
    ) -> Result<ModelReply, AttemptError> {
        let turn = turn_of(request);
        if let Some(err) = &reply.error {
            let mut seen = self
                .failures
                .entry((request.run_id.to_string(), turn))
                .or_insert(0);
            if *seen < err.times {
                *seen += 1;
                return Err(AttemptError {
                    error: ModelError::new(err.kind, err.message.clone()),
                    retry_after: err.retry_after_ms.map(Duration::from_millis),
                });
            }
        }
        let input_estimate: u64 = request.messages.iter().map(message_len).sum::<u64>() / 4;
        let tool_calls: Vec<ModelToolCall> = reply
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, c)| ModelToolCall {
                id: format!("m{turn}_{i}"),
                name: c.name.clone(),
                arguments: match &c.arguments {
                    // A string is sent verbatim: cassettes use it for malformed JSON.
                    Value::String(raw) => raw.clone(),
                    other => other.to_string(),
                },
            })
            .collect();
        let output_estimate = (reply.text.as_ref().map_or(0, String::len)
            + tool_calls
                .iter()
                .map(|c| c.arguments.len() + c.name.len())
                .sum::<usize>()) as u64
            / 4;
        Ok(ModelReply {
            text: reply.text,
            tool_calls,
            usage: TokenUsage {
                input_tokens: reply.input_tokens.unwrap_or(input_estimate),
                output_tokens: reply.output_tokens.unwrap_or(output_estimate.max(1)),
            },
        })
    }
}

/// A built-in script of the demo (`[models.X] kind = "scripted", script = "…"`): replies
/// computed from the conversation, deterministic, so the demo agents use their input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DemoScript {
    /// Reads two whole numbers in the question, adds (or subtracts) them with the `add` tool,
    /// echoes the answer with `echo`, then answers.
    Calculator,
    /// Records the goal with the `record` tool (which needs an approval) and reports whether
    /// it was done or rejected.
    Recorder,
    /// Asks the user a question (`ask_user`) about the goal and answers with the reply.
    Interviewer,
}

/// The last message, if it is a tool result: the tool's name (from the assistant call it
/// answers) and the parsed result envelope.
fn last_tool_result(request: &ModelRequest) -> Option<(String, Value)> {
    let Some(Message::Tool { call_id, content }) = request.messages.last() else {
        return None;
    };
    let tool = request
        .messages
        .iter()
        .rev()
        .find_map(|m| match m {
            Message::Assistant { tool_calls, .. } => tool_calls
                .iter()
                .find(|c| &c.id == call_id)
                .map(|c| c.name.clone()),
            _ => None,
        })
        .unwrap_or_default();
    Some((tool, serde_json::from_str(content).unwrap_or(Value::Null)))
}

/// The run's goal: the first user message.
fn goal_of(request: &ModelRequest) -> String {
    request
        .messages
        .iter()
        .find_map(|m| match m {
            Message::User { content } => Some(content.trim().to_owned()),
            _ => None,
        })
        .unwrap_or_default()
}

/// The first two whole numbers of `text` and the operation between them: `(a, b, '+'|'-')`.
/// `b` is negated for a subtraction, so `a + b` is always the answer.
pub fn two_numbers(text: &str) -> Option<(i64, i64, char)> {
    let bytes = text.as_bytes();
    let mut found: Vec<(i64, usize, usize)> = Vec::new();
    let mut i = 0;
    while i < bytes.len() && found.len() < 2 {
        if bytes[i].is_ascii_digit() {
            let start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            // A '-' right before the digits, not after another number, is a sign.
            let signed = start > 0
                && bytes[start - 1] == b'-'
                && (start < 2 || !bytes[start - 2].is_ascii_digit())
                && found.last().is_none_or(|&(_, _, end)| {
                    end < start - 1 && !text[end..start - 1].trim().is_empty()
                });
            let from = if signed { start - 1 } else { start };
            found.push((text[from..i].parse().ok()?, from, i));
        } else {
            i += 1;
        }
    }
    let [(a, _, a_end), (b, b_start, _)] = found[..] else {
        return None;
    };
    let between = text[a_end..b_start].to_ascii_lowercase();
    if between.contains('-') || between.contains("minus") {
        Some((a, b.checked_neg()?, '-'))
    } else {
        Some((a, b, '+'))
    }
}

impl DemoScript {
    /// The reply to `request`: a final text or tool calls.
    pub fn reply(self, request: &ModelRequest) -> (Option<String>, Vec<CassetteCall>) {
        let call = |name: &str, arguments: Value| {
            (
                None,
                vec![CassetteCall {
                    name: name.into(),
                    arguments,
                }],
            )
        };
        let text = |t: String| (Some(t), Vec::new());
        let goal = goal_of(request);
        let failed = |tool: &str, r: &Value| {
            format!(
                "The {tool} call failed ({}): {}",
                r["error"]["code"].as_str().unwrap_or("error"),
                r["error"]["message"].as_str().unwrap_or("no message")
            )
        };
        match self {
            DemoScript::Calculator => {
                let Some((a, b, op)) = two_numbers(&goal) else {
                    return text(format!(
                        "I add or subtract two whole numbers; ask e.g. \"what is 20 + 22?\" \
                         (I found no two numbers in {goal:?})."
                    ));
                };
                let expr = if op == '-' {
                    format!("{a} - {}", -i128::from(b))
                } else {
                    format!("{a} + {b}")
                };
                match last_tool_result(request) {
                    None => call("add", serde_json::json!({ "a": a, "b": b })),
                    Some((tool, r)) if r["ok"] != true => text(failed(&tool, &r)),
                    Some((tool, r)) if tool == "add" => call(
                        "echo",
                        serde_json::json!({ "text": format!("the answer is {}", r["data"]["sum"]) }),
                    ),
                    Some(_) => match a.checked_add(b) {
                        Some(sum) => text(format!(
                            "{expr} = {sum}. I checked it with the add tool and echoed it back."
                        )),
                        None => text(format!("{expr} does not fit in a 64-bit integer.")),
                    },
                }
            }
            DemoScript::Recorder => {
                let item: String = goal.chars().take(200).collect();
                match last_tool_result(request) {
                    None => call("record", serde_json::json!({ "item": item })),
                    // What the tool recorded: an operator may have edited the arguments.
                    Some((_, r)) if r["ok"] == true => match r["data"]["recorded"].as_str() {
                        Some(recorded) => text(format!("Done: recorded {recorded:?} once.")),
                        None => text(format!("Done: recorded {item:?} once.")),
                    },
                    Some((_, r)) if r["error"]["code"] == "approval_denied" => text(format!(
                        "Not done: an operator rejected recording {item:?} ({}).",
                        r["error"]["message"].as_str().unwrap_or("no reason given")
                    )),
                    Some((tool, r)) => text(format!("Not done. {}", failed(&tool, &r))),
                }
            }
            DemoScript::Interviewer => match last_tool_result(request) {
                None => call(
                    "ask_user",
                    serde_json::json!({
                        "question": format!("Where should {goal:?} go: staging or prod?")
                    }),
                ),
                Some((_, r)) => match r["data"]["answer"].as_str() {
                    Some(answer) => {
                        text(format!("Going ahead with {goal:?} on {}.", answer.trim()))
                    }
                    None => text(format!("I did not get an answer about {goal:?}.")),
                },
            },
        }
    }
}

impl ScriptedModel {
    /// A model that plays `script`.
    pub fn demo(name: impl Into<String>, script: DemoScript) -> Self {
        ScriptedModel {
            name: name.into(),
            script: Script::Demo(script),
            delay: Duration::ZERO,
            failures: DashMap::new(),
        }
    }
}

fn message_len(m: &Message) -> u64 {
    (match m {
        Message::System { content } | Message::User { content } => content.len(),
        Message::Assistant {
            content,
            tool_calls,
        } => {
            content.as_ref().map_or(0, String::len)
                + tool_calls.iter().map(|c| c.arguments.len()).sum::<usize>()
        }
        Message::Tool { content, .. } => content.len(),
    }) as u64
}

fn matches(c: &Condition, turn: u32, request: &ModelRequest) -> bool {
    let last_tool = request.messages.iter().rev().find_map(|m| match m {
        Message::Tool { content, .. } => Some(content.as_str()),
        _ => None,
    });
    let last_user = request.messages.iter().rev().find_map(|m| match m {
        Message::User { content } => Some(content.as_str()),
        _ => None,
    });
    c.turn.is_none_or(|t| t == turn)
        && c.last_tool_contains
            .as_ref()
            .is_none_or(|s| last_tool.is_some_and(|t| t.contains(s.as_str())))
        && c.last_user_contains
            .as_ref()
            .is_none_or(|s| last_user.is_some_and(|t| t.contains(s.as_str())))
        && c.tools_disabled
            .is_none_or(|d| d == (request.tool_choice == super::ToolChoice::None))
}

#[async_trait]
impl ModelProvider for ScriptedModel {
    fn name(&self) -> &str {
        &self.name
    }

    async fn complete(&self, request: &ModelRequest) -> Result<ModelReply, AttemptError> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        match &self.script {
            Script::Fn(f) => f(request).map_err(AttemptError::from),
            Script::Demo(d) => {
                let (text, tool_calls) = d.reply(request);
                self.render(
                    request,
                    CassetteReply {
                        text,
                        tool_calls,
                        ..CassetteReply::default()
                    },
                )
            }
            Script::Cassette(_) => match self.pick(request) {
                Some(reply) => self.render(request, reply),
                None => Err(AttemptError::from(ModelError::new(
                    ModelErrorKind::Rejected,
                    "the cassette has no reply for this conversation",
                ))),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_calculator_reads_two_numbers_and_the_operation() {
        assert_eq!(two_numbers("what is 20 + 22?"), Some((20, 22, '+')));
        assert_eq!(two_numbers("7 minus 10"), Some((7, -10, '-')));
        assert_eq!(two_numbers("100-1"), Some((100, -1, '-')));
        assert_eq!(two_numbers("add -5 and 3"), Some((-5, 3, '+')));
        assert_eq!(two_numbers("20 + -5"), Some((20, -5, '+')));
        assert_eq!(two_numbers("just 42"), None);
        assert_eq!(two_numbers("no numbers"), None);
    }
    use crate::ids::RunId;
    use crate::model::ToolChoice;

    fn request(messages: Vec<Message>) -> ModelRequest {
        ModelRequest {
            prior_replies: 0,
            run_id: RunId::generate(),
            tenant: "t".into(),
            model: "m".into(),
            messages,
            tools: Vec::new().into(),
            tool_choice: ToolChoice::Auto,
        }
    }

    #[tokio::test]
    async fn replays_by_turn_and_rules() {
        let cassette = ScriptedModel::parse_cassette(
            r#"{"replies": [{"tool_calls": [{"name": "echo", "arguments": {"text": "a"}}]}, {"text": "done"}]}"#,
        )
        .unwrap();
        let m = ScriptedModel::new("s", cassette);
        let first = m.complete(&request(vec![])).await.unwrap();
        assert_eq!(first.tool_calls[0].arguments, r#"{"text":"a"}"#);
        let second = m
            .complete(&request(vec![Message::Assistant {
                content: None,
                tool_calls: first.tool_calls.clone(),
            }]))
            .await
            .unwrap();
        assert_eq!(second.text.as_deref(), Some("done"));

        let rules = ScriptedModel::parse_cassette(
            r#"{"rules": [{"when": {"last_tool_contains": "boom"}, "reply": {"text": "saw boom"}}], "default": {"text": "fine"}}"#,
        )
        .unwrap();
        let m = ScriptedModel::new("r", rules);
        let boom = request(vec![Message::Tool {
            call_id: "x".into(),
            content: "boom".into(),
        }]);
        assert_eq!(
            m.complete(&boom).await.unwrap().text.as_deref(),
            Some("saw boom")
        );
        assert_eq!(
            m.complete(&request(vec![])).await.unwrap().text.as_deref(),
            Some("fine")
        );
    }

    #[tokio::test]
    async fn scripted_errors_repeat_then_reply() {
        let c = ScriptedModel::parse_cassette(
            r#"{"replies": [{"text": "ok", "error": {"kind": "rate_limited", "times": 2, "retry_after_ms": 5}}]}"#,
        )
        .unwrap();
        let m = ScriptedModel::new("e", c);
        let r = request(vec![]);
        assert_eq!(
            m.complete(&r).await.unwrap_err().error.kind,
            ModelErrorKind::RateLimited
        );
        assert!(m.complete(&r).await.is_err());
        assert_eq!(m.complete(&r).await.unwrap().text.as_deref(), Some("ok"));
    }
}
