//! Microbenchmarks of the pure core (divan): one transition of the run machine, checkpoint
//! serialization, idempotency-key derivation, and a tool guard's checks (scopes, deny rules,
//! path rule). Run with `cargo bench --bench core`.

use agentd::ids::RunId;
use agentd::model::{ModelReply, ModelToolCall};
use agentd::run::machine::{
    ArgumentError, Policy, RunEvent, StepContext, ToolCatalog, ToolInfo, ToolLookup, step,
};
use agentd::run::{Budget, RunState};
use agentd::runtime::actor::{CheckpointWriter, checkpoint_of};
use agentd::tool::{ToolEffect, ToolResult};
use serde_json::{Value, json};

fn main() {
    divan::main();
}

struct Catalog;

impl ToolCatalog for Catalog {
    fn lookup(&self, _name: &str) -> ToolLookup {
        ToolLookup::Allowed(ToolInfo {
            effect: ToolEffect::Read,
            polling: false,
            reconcilable: false,
        })
    }
    fn validate(&self, _name: &str, _arguments: &Value) -> Result<(), ArgumentError> {
        Ok(())
    }
    fn needs_approval(&self, _name: &str, _arguments: &Value) -> bool {
        false
    }
}

fn run_id() -> RunId {
    "run_0192f0c1a2b37c4d8e9f000000000001"
        .parse()
        .unwrap_or_else(|_| RunId::generate())
}

/// A run driven through `turns` full steps (model reply with one call, tool result).
fn run_after(turns: u32) -> RunState {
    let policy = Policy::default();
    let cx = StepContext {
        now_ms: 1,
        policy: &policy,
        tools: &Catalog,
    };
    let budget = Budget {
        max_turns: 1_000,
        max_tool_calls: 1_000,
        ..Budget::default()
    };
    let mut s = RunState::new(run_id(), "t".into(), "a".into(), json!("goal"), budget, 0);
    let _ = step(&mut s, RunEvent::Start, &cx);
    for t in 0..turns {
        let event = reply(&s, t);
        let _ = step(&mut s, event, &cx);
        let call_id = s.calls[0].call_id.clone();
        let epoch = s.epoch;
        let result = ToolResult::success(json!({"text": format!("step {t}")}));
        let _ = step(
            &mut s,
            RunEvent::ToolFinished {
                epoch,
                call_id,
                result,
            },
            &cx,
        );
    }
    s
}

fn reply(s: &RunState, t: u32) -> RunEvent {
    RunEvent::ModelReplied {
        epoch: s.epoch,
        reply: ModelReply {
            text: None,
            tool_calls: vec![ModelToolCall {
                id: format!("m{t}"),
                name: "echo".into(),
                arguments: format!(r#"{{"text":"step {t}"}}"#),
            }],
            usage: Default::default(),
        },
    }
}

/// One full step: a model reply with one tool call, then the tool result (two transitions).
#[divan::bench(args = [1, 10, 50])]
fn step_pair(bencher: divan::Bencher, turns: u32) {
    let policy = Policy {
        progress: agentd::run::progress::ProgressPolicy {
            repeat_limit: 0,
            failure_limit: 0,
            stale_turn_limit: 0,
        },
        ..Policy::default()
    };
    bencher
        .with_inputs(|| run_after(turns))
        .bench_local_values(|mut s| {
            let cx = StepContext {
                now_ms: 1,
                policy: &policy,
                tools: &Catalog,
            };
            let event = reply(&s, turns);
            let _ = step(&mut s, event, &cx);
            let call_id = s.calls[0].call_id.clone();
            let epoch = s.epoch;
            let result = ToolResult::success(json!({"text": "x"}));
            let t = step(
                &mut s,
                RunEvent::ToolFinished {
                    epoch,
                    call_id,
                    result,
                },
                &cx,
            );
            (s, t)
        });
}

/// Serializing the checkpoint from scratch, as a naive writer would on every transition.
#[divan::bench(args = [1, 10, 50])]
fn checkpoint_full(bencher: divan::Bencher, turns: u32) {
    let mut s = run_after(turns);
    bencher.bench_local(|| checkpoint_of(&mut s));
}

/// The incremental writer the actor uses: only messages added since the last commit are
/// serialized, and only those are sent (the transcript is stored apart).
#[divan::bench(args = [1, 10, 50])]
fn checkpoint_incremental(bencher: divan::Bencher, turns: u32) {
    let mut s = run_after(turns);
    let mut w = CheckpointWriter::default();
    let _ = w.checkpoint(&mut s);
    // The store holds the transcript: a commit sends the body and no entries.
    w.committed();
    bencher.bench_local(|| w.checkpoint(&mut s).map(|c| c.body.len()));
}

#[divan::bench]
fn idempotency_key() -> String {
    agentd::idempotency::idempotency_key(
        &run_id(),
        3,
        0,
        "restart_service",
        &json!({"service": "api", "force": false, "reason": "deploy 42 failed"}),
    )
}

/// A guard as a production tool might have: one permission, three deny rules (one a regex),
/// one path rule.
fn typical_guard() -> agentd::run::guard::Guard {
    use agentd::run::guard::{DenyRule, Guard, GuardConfig, PathRule};
    let rule = |pointer: &str| DenyRule {
        pointer: pointer.into(),
        equals: None,
        one_of: None,
        prefix: None,
        regex: None,
        max_length: None,
    };
    let config = GuardConfig {
        permissions: vec!["deploy:staging".into()],
        deny: vec![
            DenyRule {
                one_of: Some(vec![json!("prod-db"), json!("billing")]),
                ..rule("/service")
            },
            DenyRule {
                regex: Some("(?i)\\b(drop|truncate)\\b".into()),
                ..rule("/note")
            },
            DenyRule {
                max_length: Some(256),
                ..rule("/note")
            },
        ],
        paths: vec![PathRule {
            pointer: "/file".into(),
            root: "/srv/data".into(),
        }],
        ..GuardConfig::default()
    };
    Guard::new(&config).unwrap_or_default()
}

/// Every check one call of a guarded tool goes through before approval and execution.
#[divan::bench]
fn guard_check(bencher: divan::Bencher) {
    let guard = typical_guard();
    let scopes = vec!["deploy".to_owned()];
    let arguments = json!({"service": "web", "note": "restart after the deploy", "file": "logs/./today//web.log"});
    bencher.bench(|| {
        let mut a = arguments.clone();
        divan::black_box(guard.check("restart", Some(&scopes), &mut a)).is_ok()
    });
}

/// The path rule alone on a typical relative path.
#[divan::bench]
fn guard_check_path() -> bool {
    agentd::run::guard::check_path("/srv/data", divan::black_box("logs/./today//web%2Elog")).is_ok()
}
