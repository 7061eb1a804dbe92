//! Run budgets (turns, tool calls, tokens, wall-clock deadline) and the checks made before every
//! model call and tool call. Pure: the caller passes `now_ms`.

use serde::{Deserialize, Serialize};

/// Limits of one run. Kept in the run's state, so they survive restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    /// Model calls allowed (default 20).
    pub max_turns: u32,
    /// Tool calls that may be dispatched (default 50).
    pub max_tool_calls: u32,
    /// Input plus output tokens allowed; no model call starts once they are reached (default
    /// 200 000).
    pub max_tokens: u64,
    /// Absolute deadline, milliseconds since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            max_turns: 20,
            max_tool_calls: 50,
            max_tokens: 200_000,
            deadline_ms: None,
        }
    }
}

/// What a run has consumed so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Model calls made (one per turn).
    pub turns: u32,
    /// Tool calls dispatched.
    pub tool_calls: u32,
    /// Input tokens of every model reply, as the provider reported them.
    pub input_tokens: u64,
    /// Output tokens of every model reply, as the provider reported them.
    pub output_tokens: u64,
}

/// Which budget ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Exhausted {
    /// `max_turns` model calls were made.
    Turns,
    /// The calls asked for would pass `max_tool_calls`.
    ToolCalls,
    /// `max_tokens` tokens were consumed.
    Tokens,
    /// `deadline_ms` has passed.
    Deadline,
}

impl Exhausted {
    /// The wire name (`turns`, `tool_calls`, `tokens`, `deadline`), as used in errors and
    /// events.
    pub fn as_str(self) -> &'static str {
        match self {
            Exhausted::Turns => "turns",
            Exhausted::ToolCalls => "tool_calls",
            Exhausted::Tokens => "tokens",
            Exhausted::Deadline => "deadline",
        }
    }
}

fn check_deadline(budget: &Budget, now_ms: u64) -> Result<(), Exhausted> {
    match budget.deadline_ms {
        Some(d) if now_ms >= d => Err(Exhausted::Deadline),
        _ => Ok(()),
    }
}

/// May the run make one more model call?
pub fn check_model_call(budget: &Budget, usage: &Usage, now_ms: u64) -> Result<(), Exhausted> {
    check_deadline(budget, now_ms)?;
    if usage.turns >= budget.max_turns {
        return Err(Exhausted::Turns);
    }
    if usage.input_tokens + usage.output_tokens >= budget.max_tokens {
        return Err(Exhausted::Tokens);
    }
    Ok(())
}

/// May the run dispatch `n` more tool calls?
pub fn check_tool_calls(
    budget: &Budget,
    usage: &Usage,
    n: u32,
    now_ms: u64,
) -> Result<(), Exhausted> {
    check_deadline(budget, now_ms)?;
    if usage.tool_calls.saturating_add(n) > budget.max_tool_calls {
        return Err(Exhausted::ToolCalls);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_table() {
        let b = Budget {
            max_turns: 2,
            max_tool_calls: 3,
            max_tokens: 100,
            deadline_ms: Some(1_000),
        };
        let u = |turns, tool_calls, tokens| Usage {
            turns,
            tool_calls,
            input_tokens: tokens,
            output_tokens: 0,
        };
        // (usage, now, expected model check, tool calls wanted, expected tool check)
        let rows = [
            (u(0, 0, 0), 0, Ok(()), 3, Ok(())),
            (u(2, 0, 0), 0, Err(Exhausted::Turns), 1, Ok(())),
            (u(1, 3, 0), 0, Ok(()), 1, Err(Exhausted::ToolCalls)),
            (u(1, 1, 100), 0, Err(Exhausted::Tokens), 2, Ok(())),
            (
                u(0, 0, 0),
                1_000,
                Err(Exhausted::Deadline),
                1,
                Err(Exhausted::Deadline),
            ),
        ];
        for (usage, now, model, n, tools) in rows {
            assert_eq!(
                check_model_call(&b, &usage, now),
                model,
                "{usage:?} at {now}"
            );
            assert_eq!(
                check_tool_calls(&b, &usage, n, now),
                tools,
                "{usage:?} +{n}"
            );
        }
    }
}
