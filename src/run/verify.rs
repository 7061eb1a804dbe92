//! Completion verifiers: a model's final answer is a candidate until every verifier of its agent
//! accepts it. Verifiers are deterministic and run in the verifying phase.

use std::sync::Arc;

use serde_json::Value;

use super::state::RunState;

/// A closure verifier: `Err(reason)` sends the run back to the model with the reason.
pub type VerifyFn = dyn Fn(&Value, &RunState) -> Result<(), String> + Send + Sync;

/// One check on a candidate final answer.
#[derive(Clone)]
pub enum Verifier {
    /// The answer must be JSON matching this schema.
    JsonSchema(Arc<jsonschema::Validator>),
    /// This tool must have succeeded at least once in the run.
    ToolSucceeded(String),
    /// A Rust closure.
    Custom {
        /// A label for the verifier, shown by `Debug`.
        name: String,
        /// The check: `Err(reason)` rejects the candidate.
        check: Arc<VerifyFn>,
    },
}

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Verifier::JsonSchema(_) => f.write_str("JsonSchema"),
            Verifier::ToolSucceeded(t) => write!(f, "ToolSucceeded({t})"),
            Verifier::Custom { name, .. } => write!(f, "Custom({name})"),
        }
    }
}

impl Verifier {
    /// Compiles a JSON Schema verifier.
    pub fn json_schema(schema: &Value) -> Result<Self, String> {
        jsonschema::draft202012::options()
            .build(schema)
            .map(|v| Verifier::JsonSchema(Arc::new(v)))
            .map_err(|e| format!("invalid output schema: {e}"))
    }

    /// A closure verifier named `name`; `check` gets the candidate and the run's state.
    pub fn custom(
        name: impl Into<String>,
        check: impl Fn(&Value, &RunState) -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        Verifier::Custom {
            name: name.into(),
            check: Arc::new(check),
        }
    }

    fn check(&self, candidate: &Value, run: &RunState) -> Result<(), String> {
        match self {
            Verifier::JsonSchema(v) => v.validate(candidate).map_err(|e| {
                let path = e.instance_path().to_string();
                format!(
                    "the answer does not match the output schema at `{}`: {e}",
                    if path.is_empty() { "/" } else { &path }
                )
            }),
            Verifier::ToolSucceeded(tool) => {
                if run.succeeded_tools.iter().any(|t| t == tool) {
                    Ok(())
                } else {
                    Err(format!(
                        "the tool `{tool}` has not succeeded in this run yet"
                    ))
                }
            }
            Verifier::Custom { check, .. } => check(candidate, run),
        }
    }
}

/// Runs every verifier in order; the first rejection wins.
pub fn verify_all(verifiers: &[Verifier], candidate: &Value, run: &RunState) -> Result<(), String> {
    verifiers.iter().try_for_each(|v| v.check(candidate, run))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::RunId;
    use serde_json::json;

    fn run() -> RunState {
        RunState::new(
            RunId::generate(),
            "t".into(),
            "a".into(),
            json!("goal"),
            Default::default(),
            0,
        )
    }

    #[test]
    fn verifier_table() {
        let schema =
            Verifier::json_schema(&json!({"type": "object", "required": ["answer"]})).unwrap();
        let tool = Verifier::ToolSucceeded("echo".into());
        let custom = Verifier::custom("non-empty", |v, _| {
            if v.as_str().is_some_and(str::is_empty) {
                Err("empty".into())
            } else {
                Ok(())
            }
        });
        let mut r = run();
        assert!(verify_all(std::slice::from_ref(&schema), &json!({"answer": 1}), &r).is_ok());
        assert!(verify_all(std::slice::from_ref(&schema), &json!("text"), &r).is_err());
        assert!(verify_all(std::slice::from_ref(&tool), &json!("x"), &r).is_err());
        r.succeeded_tools.push("echo".into());
        assert!(verify_all(std::slice::from_ref(&tool), &json!("x"), &r).is_ok());
        assert_eq!(verify_all(&[custom], &json!(""), &r), Err("empty".into()));
    }
}
