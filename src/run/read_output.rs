//! `read_output`, the runtime-provided tool that lets a model read an earlier tool output of
//! its own run in bounded pages, by the call id the context builder's truncation note names.
//! Pure: it reads the run's transcript (the stored, append-only record of every tool result)
//! and nothing else, so it can never reach another run's data. An output the run keeps only
//! in part (`RunState::trimmed_outputs`) is paged from its stored transcript entry, which the
//! run's actor reads (`Lookup::Stored`, `page_of_entry`).

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::ids::RunId;
use crate::model::{Message, ToolDefinition};
use crate::tool::{ToolError, ToolErrorCode, ToolResult};

/// The reserved tool name.
pub const READ_OUTPUT_TOOL: &str = "read_output";
/// Bytes of one page when the call does not say.
pub const DEFAULT_PAGE_BYTES: usize = 8 * 1024;
/// The largest page a call may ask for: a page must fit a request comfortably.
pub const MAX_PAGE_BYTES: usize = 16 * 1024;

/// The definition offered to the model.
pub fn definition() -> ToolDefinition {
    ToolDefinition {
        name: READ_OUTPUT_TOOL.to_owned(),
        description: "Read the full output of an earlier tool call of this run whose output was truncated, one page at a time. Pass the call id from the truncation note and the offset it gives; continue with next_offset until it is null.".to_owned(),
        parameters: parameters(),
    }
}

/// The JSON Schema of the arguments.
pub fn parameters() -> Value {
    json!({
        "type": "object",
        "properties": {
            "call_id": {"type": "string", "minLength": 1, "maxLength": 256},
            "offset": {"type": "integer", "minimum": 0},
            "max_bytes": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE_BYTES},
            "run_id": {"type": "string", "maxLength": 64}
        },
        "required": ["call_id"],
        "additionalProperties": false
    })
}

/// Where the page a call asks for comes from.
#[derive(Debug)]
pub enum Lookup {
    /// Answered from the messages (or refused).
    Answered(ToolResult),
    /// The output is one the run keeps only in part (`RunState::trimmed_outputs`): read the
    /// stored transcript entry `index` and answer with [`page_of_entry`].
    Stored {
        /// The message's index in the transcript.
        index: usize,
        /// The call whose output it is.
        call_id: String,
        /// The page's first byte.
        offset: usize,
        /// The page's most bytes.
        max_bytes: usize,
    },
}

/// The page of the output of call `call_id` that a `read_output` call asks for, from
/// `messages` (the run's transcript): the newest tool message answering that call id.
/// `offset` counts bytes of the output as stored (the result envelope the model was given),
/// and pages end on character boundaries. A `run_id` other than `own_run` is refused:
/// references are valid only inside the run that holds them. `trimmed` maps a message that
/// keeps only the head of its output to the output's whole length
/// (`RunState::trimmed_outputs`); such an output's pages are read from the store.
pub fn lookup(
    messages: &[Message],
    trimmed: &BTreeMap<usize, usize>,
    own_run: &RunId,
    arguments: &Value,
) -> Lookup {
    let fail = |code, message: String| {
        Lookup::Answered(ToolResult::failure(ToolError::new(code, message)))
    };
    if let Some(other) = arguments.get("run_id").and_then(Value::as_str)
        && other != own_run.as_str()
    {
        return fail(
            ToolErrorCode::PermissionDenied,
            format!("run {other} is not this run: read_output reads only this run's outputs"),
        );
    }
    let Some(call_id) = arguments.get("call_id").and_then(Value::as_str) else {
        return fail(ToolErrorCode::InvalidArgument, "call_id is required".into());
    };
    let offset = arguments.get("offset").and_then(Value::as_u64).unwrap_or(0) as usize;
    let max_bytes = arguments
        .get("max_bytes")
        .and_then(Value::as_u64)
        .map_or(DEFAULT_PAGE_BYTES, |n| {
            (n as usize).clamp(1, MAX_PAGE_BYTES)
        });
    let Some((index, content)) = messages
        .iter()
        .enumerate()
        .rev()
        .find_map(|(i, m)| match m {
            Message::Tool {
                call_id: id,
                content,
            } if id == call_id => Some((i, content)),
            _ => None,
        })
    else {
        return fail(
            ToolErrorCode::Failed,
            format!("this run has no output of call {call_id}"),
        );
    };
    if trimmed.contains_key(&index) {
        return Lookup::Stored {
            index,
            call_id: call_id.to_owned(),
            offset,
            max_bytes,
        };
    }
    Lookup::Answered(page(call_id, content, offset, max_bytes))
}

/// The page of a stored transcript entry (one message's JSON) that [`Lookup::Stored`] asked
/// for; `None` (the entry is missing) is an error, not an empty page.
pub fn page_of_entry(
    entry: Option<&str>,
    call_id: &str,
    offset: usize,
    max_bytes: usize,
) -> ToolResult {
    match entry.map(serde_json::from_str::<Message>) {
        Some(Ok(Message::Tool {
            call_id: id,
            content,
        })) if id == call_id => page(call_id, &content, offset, max_bytes),
        _ => ToolResult::failure(ToolError::new(
            ToolErrorCode::Failed,
            format!("the stored output of call {call_id} could not be read"),
        )),
    }
}

/// The page of `content` from `offset` (at most `max_bytes`, on character boundaries).
fn page(call_id: &str, content: &str, offset: usize, max_bytes: usize) -> ToolResult {
    let total = content.len();
    if offset > total {
        return ToolResult::failure(ToolError::new(
            ToolErrorCode::InvalidArgument,
            format!("offset {offset} is beyond the output's {total} bytes"),
        ));
    }
    let start = floor_char_boundary(content, offset);
    let end = floor_char_boundary(content, start.saturating_add(max_bytes).min(total));
    // A page always advances, even when one character is wider than `max_bytes`.
    let end = if end == start && start < total {
        ceil_char_boundary(content, start + 1)
    } else {
        end
    };
    ToolResult::success(json!({
        "call_id": call_id,
        "offset": start,
        "bytes": end - start,
        "total_bytes": total,
        "next_offset": if end < total { Value::from(end) } else { Value::Null },
        "text": &content[start..end],
    }))
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn ceil_char_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while i < s.len() && !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run() -> RunId {
        "run_0193a1b2c3d4e5f60718293a4b5c6d7e".parse().unwrap()
    }

    /// A page from messages that hold their outputs whole.
    fn read(messages: &[Message], own_run: &RunId, arguments: &Value) -> ToolResult {
        match lookup(messages, &BTreeMap::new(), own_run, arguments) {
            Lookup::Answered(result) => result,
            other => panic!("nothing is trimmed, yet {other:?}"),
        }
    }

    fn transcript(call_id: &str, content: &str) -> Vec<Message> {
        vec![
            Message::User {
                content: "goal".into(),
            },
            Message::Tool {
                call_id: call_id.into(),
                content: content.into(),
            },
        ]
    }

    fn data(r: &ToolResult) -> &Value {
        r.data.as_ref().expect("a page")
    }

    /// Reads every page of call `c` with `max_bytes` and joins them.
    fn read_all(messages: &[Message], c: &str, max_bytes: usize) -> (String, usize) {
        let (mut text, mut offset, mut pages) = (String::new(), 0u64, 0);
        loop {
            let r = read(
                messages,
                &run(),
                &json!({"call_id": c, "offset": offset, "max_bytes": max_bytes}),
            );
            assert!(r.ok, "{r:?}");
            let d = data(&r);
            assert!(d["bytes"].as_u64().unwrap() as usize <= max_bytes.max(4));
            text.push_str(d["text"].as_str().unwrap());
            pages += 1;
            match d["next_offset"].as_u64() {
                Some(n) => offset = n,
                None => return (text, pages),
            }
        }
    }

    #[test]
    fn pages_join_to_the_whole_output() {
        let big = "0123456789".repeat(5_000);
        let m = transcript("c1", &big);
        let (text, pages) = read_all(&m, "c1", MAX_PAGE_BYTES);
        assert_eq!(text, big);
        assert_eq!(pages, 50_000usize.div_ceil(MAX_PAGE_BYTES));
    }

    #[test]
    fn refusals_table() {
        let m = transcript("c1", "hello");
        let cases = [
            (
                json!({"call_id": "c1", "run_id": "run_0000000000000000000000000000000a"}),
                "permission_denied",
            ),
            (json!({"call_id": "c9"}), "failed"),
            (json!({"call_id": "c1", "offset": 6}), "invalid_argument"),
            (json!({}), "invalid_argument"),
        ];
        for (args, code) in cases {
            let r = read(&m, &run(), &args);
            assert!(!r.ok, "{args}");
            assert_eq!(r.error.as_ref().unwrap().code.as_str(), code, "{args}");
        }
        // Its own run id is accepted.
        let own = json!({"call_id": "c1", "run_id": run().as_str()});
        assert_eq!(data(&read(&m, &run(), &own))["text"], "hello");
    }

    #[test]
    fn the_newest_output_of_a_reused_call_id_is_read() {
        let mut m = transcript("c1", "old");
        m.push(Message::Tool {
            call_id: "c1".into(),
            content: "new".into(),
        });
        assert_eq!(
            data(&read(&m, &run(), &json!({"call_id": "c1"})))["text"],
            "new"
        );
    }

    proptest! {
        #[test]
        fn pages_of_any_text_rejoin_exactly(text in "\\PC{0,400}", max in 1usize..64) {
            let m = transcript("c", &text);
            let (joined, _) = read_all(&m, "c", max);
            prop_assert_eq!(joined, text);
        }
    }
}
