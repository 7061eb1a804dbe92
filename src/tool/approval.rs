//! Approval policy evaluation: whether one call, with these arguments, needs an operator's
//! approval before it runs (`ApprovalRule` is declared in `tool`).
//!
//! The evaluation is pure and fails closed: a rule that cannot be evaluated (an invalid
//! regular expression) requires approval. Check configured rules once at load time with
//! [`ApprovalRule::validate`].

use regex::Regex;
use serde_json::Value;

use super::{ApprovalRule, RiskLevel, ToolSpec};

impl ApprovalRule {
    /// Whether a call with `arguments` needs approval. `ByRisk` does not know the tool here and
    /// assumes the highest risk (it requires approval): use [`ToolSpec::requires_approval`],
    /// which evaluates it against the tool's declared risk.
    pub fn requires(&self, arguments: &Value) -> bool {
        self.requires_at(RiskLevel::Critical, arguments)
    }

    /// Whether a call with `arguments` of a tool of risk `risk` needs approval.
    pub fn requires_at(&self, risk: RiskLevel, arguments: &Value) -> bool {
        match self {
            ApprovalRule::Never => false,
            ApprovalRule::Always => true,
            ApprovalRule::ByRisk { at_least } => risk >= *at_least,
            ApprovalRule::WhenArgument {
                pointer,
                equals,
                one_of,
                matches,
            } => {
                let Some(value) = arguments.pointer(pointer) else {
                    return false;
                };
                let equals_ok = equals.as_ref().is_none_or(|e| e == value);
                let one_of_ok = one_of.as_ref().is_none_or(|set| set.contains(value));
                let matches_ok = matches.as_ref().is_none_or(|pattern| {
                    match (Regex::new(pattern), value) {
                        (Ok(re), Value::String(s)) => re.is_match(s),
                        (Ok(_), _) => false,
                        // Fail closed: a broken rule must not wave calls through.
                        (Err(_), _) => true,
                    }
                });
                equals_ok && one_of_ok && matches_ok
            }
            ApprovalRule::AnyOf(rules) => rules.iter().any(|r| r.requires_at(risk, arguments)),
        }
    }

    /// Checks a configured rule: pointers are JSON Pointers, patterns compile.
    pub fn validate(&self) -> Result<(), String> {
        match self {
            ApprovalRule::Never | ApprovalRule::Always | ApprovalRule::ByRisk { .. } => Ok(()),
            ApprovalRule::WhenArgument {
                pointer, matches, ..
            } => {
                if !pointer.is_empty() && !pointer.starts_with('/') {
                    return Err(format!(
                        "approval pointer {pointer:?} must be a JSON Pointer starting with '/'"
                    ));
                }
                if let Some(p) = matches {
                    Regex::new(p).map_err(|e| format!("approval pattern {p:?}: {e}"))?;
                }
                Ok(())
            }
            ApprovalRule::AnyOf(rules) => rules.iter().try_for_each(ApprovalRule::validate),
        }
    }
}

impl ToolSpec {
    /// Whether a call of this tool with `arguments` needs approval, under its declared risk.
    pub fn requires_approval(&self, arguments: &Value) -> bool {
        self.approval.requires_at(self.risk, arguments)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn when(pointer: &str) -> ApprovalRule {
        ApprovalRule::WhenArgument {
            pointer: pointer.into(),
            equals: None,
            one_of: None,
            matches: None,
        }
    }

    #[test]
    fn never_and_always_keep_their_serde_names() {
        assert_eq!(
            serde_json::to_value(ApprovalRule::Never).unwrap(),
            json!("never")
        );
        assert_eq!(
            serde_json::to_value(ApprovalRule::Always).unwrap(),
            json!("always")
        );
        let r: ApprovalRule = serde_json::from_value(json!("always")).unwrap();
        assert_eq!(r, ApprovalRule::Always);
    }

    #[test]
    fn rules_parse_from_toml() {
        #[derive(serde::Deserialize)]
        struct T {
            a: ApprovalRule,
            b: ApprovalRule,
            c: ApprovalRule,
            d: ApprovalRule,
        }
        let t: T = toml::from_str(
            r#"
            a = "never"
            b = { by_risk = { at_least = "high" } }
            c = { when_argument = { pointer = "/env", equals = "prod" } }
            d = { any_of = ["never", { when_argument = { pointer = "/count", one_of = [10, 100] } }] }
            "#,
        )
        .unwrap();
        assert_eq!(t.a, ApprovalRule::Never);
        assert_eq!(
            t.b,
            ApprovalRule::ByRisk {
                at_least: RiskLevel::High
            }
        );
        assert!(t.c.requires(&json!({"env": "prod"})));
        assert!(t.d.requires(&json!({"count": 100})));
        assert!(!t.d.requires(&json!({"count": 5})));
    }

    #[test]
    fn table_of_evaluations() {
        let prod = ApprovalRule::WhenArgument {
            pointer: "/target/env".into(),
            equals: Some(json!("prod")),
            one_of: None,
            matches: None,
        };
        let pattern = ApprovalRule::WhenArgument {
            pointer: "/service".into(),
            equals: None,
            one_of: None,
            matches: Some("^(db|auth)-".into()),
        };
        let high = ApprovalRule::ByRisk {
            at_least: RiskLevel::High,
        };
        let cases: Vec<(&ApprovalRule, RiskLevel, Value, bool)> = vec![
            (&ApprovalRule::Never, RiskLevel::Critical, json!({}), false),
            (&ApprovalRule::Always, RiskLevel::Low, json!({}), true),
            (&high, RiskLevel::Medium, json!({}), false),
            (&high, RiskLevel::High, json!({}), true),
            (&high, RiskLevel::Critical, json!({}), true),
            (
                &prod,
                RiskLevel::Low,
                json!({"target": {"env": "prod"}}),
                true,
            ),
            (
                &prod,
                RiskLevel::Low,
                json!({"target": {"env": "staging"}}),
                false,
            ),
            (&prod, RiskLevel::Low, json!({"target": {}}), false),
            (
                &pattern,
                RiskLevel::Low,
                json!({"service": "db-main"}),
                true,
            ),
            (&pattern, RiskLevel::Low, json!({"service": "web"}), false),
            (&pattern, RiskLevel::Low, json!({"service": 7}), false),
        ];
        for (i, (rule, risk, args, expected)) in cases.iter().enumerate() {
            assert_eq!(
                rule.requires_at(*risk, args),
                *expected,
                "case {i}: {rule:?} {args}"
            );
        }
        // Presence alone, and a combination.
        assert!(when("/force").requires(&json!({"force": false})));
        assert!(!when("/force").requires(&json!({})));
        let any = ApprovalRule::AnyOf(vec![prod.clone(), high.clone()]);
        assert!(any.requires_at(RiskLevel::High, &json!({})));
        assert!(!any.requires_at(RiskLevel::Low, &json!({"target": {"env": "dev"}})));
    }

    #[test]
    fn by_risk_uses_the_spec_risk_and_fails_closed_without_it() {
        let high = ApprovalRule::ByRisk {
            at_least: RiskLevel::High,
        };
        let spec = ToolSpec::new("t", "d", json!({"type": "object"})).approval(high.clone());
        assert_eq!(spec.risk, RiskLevel::Medium);
        assert!(!spec.requires_approval(&json!({})));
        assert!(
            spec.clone()
                .risk(RiskLevel::High)
                .requires_approval(&json!({}))
        );
        assert!(high.requires(&json!({})));
    }

    #[test]
    fn broken_rules_fail_closed_and_are_reported() {
        let bad = ApprovalRule::WhenArgument {
            pointer: "/x".into(),
            equals: None,
            one_of: None,
            matches: Some("(".into()),
        };
        assert!(bad.requires(&json!({"x": "anything"})));
        assert!(bad.validate().is_err());
        assert!(when("x").validate().is_err());
        assert!(ApprovalRule::AnyOf(vec![when("/ok")]).validate().is_ok());
    }
}
