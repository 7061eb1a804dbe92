//! Turns a model's raw reply into exactly one decision: a final answer, tool calls, or a
//! question for the user. Pure.
//!
//! Rules, in order:
//! 1. A reply with tool calls is a tool-call decision, even if it also carries text: the text is
//!    kept in the transcript as the assistant's commentary and is never taken as the final
//!    answer (the model has not finished while it is still asking for tools).
//! 2. A call to the reserved tool `ask_user` asks the user; it must be the only call of its
//!    reply, with a string `question` argument, or the reply is malformed.
//! 3. A reply with no tool calls and non-blank text is a final-answer candidate.
//! 4. Anything else (no calls, blank text) is malformed: `empty_reply`.

use serde_json::Value;

use crate::model::{ModelReply, ModelToolCall};

/// The name of the reserved pseudo-tool through which a model asks the user a question.
pub const ASK_USER_TOOL: &str = "ask_user";

/// What the model decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// A final-answer candidate: the reply's non-blank text, still to be verified.
    Final(String),
    /// Tool calls to validate and run, in the model's order (none is `ask_user`).
    ToolCalls(Vec<ModelToolCall>),
    /// The model asks the user a question; the run waits for input.
    AskUser {
        /// The model's id of the `ask_user` call; the answer is sent back under it.
        model_call_id: String,
        /// The non-blank question, as the model wrote it.
        question: String,
    },
    /// The reply cannot be acted on; the message goes back to the model as a correction.
    Malformed {
        /// Machine-readable reason: `empty_reply`, `invalid_ask_user` (or `ask_user_disabled`,
        /// set by the machine).
        code: &'static str,
        /// The correction shown to the model.
        message: String,
    },
}

/// Applies the rules of the module doc.
pub fn decide(reply: &ModelReply) -> Decision {
    if !reply.tool_calls.is_empty() {
        let asks = reply
            .tool_calls
            .iter()
            .filter(|c| c.name == ASK_USER_TOOL)
            .count();
        if asks == 0 {
            return Decision::ToolCalls(reply.tool_calls.clone());
        }
        if reply.tool_calls.len() > 1 {
            return Decision::Malformed {
                code: "invalid_ask_user",
                message: "ask_user must be the only tool call of its reply".to_owned(),
            };
        }
        let call = &reply.tool_calls[0];
        let question = serde_json::from_str::<Value>(&call.arguments)
            .ok()
            .and_then(|v| v.get("question").and_then(Value::as_str).map(str::to_owned));
        return match question {
            Some(q) if !q.trim().is_empty() => Decision::AskUser {
                model_call_id: call.id.clone(),
                question: q,
            },
            _ => Decision::Malformed {
                code: "invalid_ask_user",
                message: "ask_user needs arguments {\"question\": \"<non-empty text>\"}".to_owned(),
            },
        };
    }
    match &reply.text {
        Some(t) if !t.trim().is_empty() => Decision::Final(t.clone()),
        _ => Decision::Malformed {
            code: "empty_reply",
            message: "the reply had neither text nor tool calls; answer or call a tool".to_owned(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, args: &str) -> ModelToolCall {
        ModelToolCall {
            id: format!("m_{name}"),
            name: name.to_owned(),
            arguments: args.to_owned(),
        }
    }

    fn reply(text: Option<&str>, calls: Vec<ModelToolCall>) -> ModelReply {
        ModelReply {
            text: text.map(str::to_owned),
            tool_calls: calls,
            usage: Default::default(),
        }
    }

    #[test]
    fn decision_table() {
        let rows: Vec<(ModelReply, &str)> = vec![
            (reply(Some("done"), vec![]), "final"),
            (reply(None, vec![call("echo", "{}")]), "tools"),
            // Text and tool calls together: the tool calls win (rule 1).
            (
                reply(Some("let me check"), vec![call("echo", "{}")]),
                "tools",
            ),
            (
                reply(None, vec![call("ask_user", r#"{"question":"which env?"}"#)]),
                "ask",
            ),
            (
                reply(
                    None,
                    vec![call("ask_user", r#"{"question":"?"}"#), call("echo", "{}")],
                ),
                "malformed",
            ),
            (reply(None, vec![call("ask_user", "not json")]), "malformed"),
            (
                reply(None, vec![call("ask_user", r#"{"question":"  "}"#)]),
                "malformed",
            ),
            (reply(None, vec![]), "malformed"),
            (reply(Some("   "), vec![]), "malformed"),
        ];
        for (r, want) in rows {
            let got = match decide(&r) {
                Decision::Final(_) => "final",
                Decision::ToolCalls(_) => "tools",
                Decision::AskUser { .. } => "ask",
                Decision::Malformed { .. } => "malformed",
            };
            assert_eq!(got, want, "{r:?}");
        }
    }
}
