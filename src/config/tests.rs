//! Tests of the configuration tree: the documented defaults, unknown keys, env overrides and
//! validation messages.

use super::*;

const MINIMAL: &str = r#"
[[tenants]]
id = "acme"
tokens = ["a-long-random-token"]

[models.m]
kind = "scripted"
replies = [{ text = "done" }]

[tools.restart_service]
kind = "http"
url = "http://127.0.0.1:9000/restart"
status_url = "http://127.0.0.1:9000/status"
description = "Restart one service"
parameters = { type = "object", properties = { service = { type = "string" } }, required = ["service"] }
effect = "unsafe"
approval = "always"
timeout = "10s"

[agents.triage]
model = "m"
instructions = "You diagnose failed deploys."
tools = ["restart_service"]
max_turns = 12
max_tool_calls = 20
"#;

fn default_toml() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/default.toml")).unwrap()
}

#[test]
fn default_toml_parses_to_the_defaults() {
    let c = Config::from_toml(&default_toml()).unwrap();
    assert_eq!(c, Config::default());
}

#[test]
fn default_toml_documents_every_key() {
    // Every key of the serialized demo config (which sets every section) and of the defaults
    // appears in default.toml, commented or not.
    let text = default_toml();
    let mut c = Config::demo();
    let mut model = ModelConfig::scripted(vec![]);
    model.base_url = Some("x".into());
    model.model = Some("x".into());
    model.api_key = Some(Secret("x".into()));
    model.requests_per_minute = NonZeroU32::new(1);
    model.tokens_per_minute = NonZeroU32::new(1);
    model.timeout = Some(Duration::from_secs(1));
    model.cassette = Some("x".into());
    model.rules = Some(vec![]);
    model.default_reply = Some(CassetteReply::default());
    model.delay = Some(Duration::from_secs(1));
    model.max_tokens = Some(1);
    model.temperature = Some(0.0);
    model.stream = Some(false);
    model.context_window = Some(2);
    c.models.insert("all".into(), model);
    let mut tool = ToolConfig::builtin("echo");
    tool.url = Some("x".into());
    tool.status_url = Some("x".into());
    tool.description = Some("x".into());
    tool.parameters = Some(serde_json::json!({}));
    tool.effect = Some(crate::tool::ToolEffect::Read);
    tool.approval = Some(crate::tool::ApprovalRule::Never);
    tool.timeout = Some(Duration::from_secs(1));
    tool.max_output_bytes = Some(1);
    tool.requests_per_second = NonZeroU32::new(1);
    tool.polling = Some(true);
    tool.max_attempts = Some(1);
    tool.task_timeout = Some(Duration::from_secs(1));
    tool.poll_interval = Some(Duration::from_secs(1));
    tool.poll_max_interval = Some(Duration::from_secs(1));
    tool.command = Some("x".into());
    tool.args = vec!["x".into()];
    tool.risk = Some(crate::tool::RiskLevel::High);
    tool.approval_timeout = Some(Duration::from_secs(1));
    tool.on_approval_timeout = Some(crate::tool::ApprovalTimeoutAction::Reject);
    tool.bearer_token = Some(Secret("x".into()));
    tool.effects
        .insert("x".into(), crate::tool::ToolEffect::Read);
    tool.startup_timeout = Some(Duration::from_secs(1));
    tool.permissions = vec!["x".into()];
    tool.on_permission_denied = Some(crate::run::guard::OnPermissionDenied::Stop);
    tool.deny = vec![crate::run::guard::DenyRule {
        pointer: "/x".into(),
        equals: None,
        one_of: None,
        prefix: None,
        regex: None,
        max_length: None,
    }];
    tool.paths = vec![crate::run::guard::PathRule {
        pointer: "/x".into(),
        root: "/x".into(),
    }];
    tool.project = vec!["/x".into()];
    tool.compensate = Some(CompensateConfig {
        tool: "x".into(),
        arguments: [("x".to_owned(), serde_json::json!("/x"))].into(),
    });
    c.tools.insert("all".into(), tool);
    c.tenants[0].agents = Some(vec!["demo".into()]);
    c.secrets.values = vec![Secret("env:X".into())];
    c.secrets.patterns = vec!["x".into()];
    c.server.public_url = Some("http://x".into());
    c.server.callback_secret = Some(Secret("env:X".into()));
    c.telemetry.otlp_endpoint = Some("http://x".into());
    let mut agent = AgentConfig::new("all");
    agent.deadline = Some(Duration::from_secs(1));
    agent.output_schema = Some(serde_json::json!({}));
    c.agents.insert("all".into(), agent);
    let table = toml::Table::try_from(&c).unwrap();
    fn walk(t: &toml::Table, prefix: &str, text: &str) {
        for (k, v) in t {
            let path = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            if ["models", "tools", "agents"].contains(&k.as_str()) && prefix.is_empty() {
                if let toml::Value::Table(named) = v {
                    for inner in named.values() {
                        if let toml::Value::Table(inner) = inner {
                            walk_keys(inner, text);
                        }
                    }
                }
                continue;
            }
            match v {
                toml::Value::Table(inner) => {
                    assert!(
                        text.contains(&format!("[{path}]")),
                        "section {path} undocumented"
                    );
                    walk(inner, &path, text);
                }
                toml::Value::Array(items) if k == "tenants" => {
                    assert!(text.contains("# [[tenants]]"));
                    for i in items {
                        walk_keys(i.as_table().unwrap(), text);
                    }
                }
                _ => assert!(
                    text.contains(&format!("# {k} = ")),
                    "key {path} undocumented"
                ),
            }
        }
    }
    fn walk_keys(t: &toml::Table, text: &str) {
        for k in t.keys() {
            assert!(text.contains(&format!("# {k} = ")), "key {k} undocumented");
        }
    }
    walk(&table, "", &text);
}

#[test]
fn unknown_keys_are_rejected() {
    for bad in [
        "[server]\nlisten = \"127.0.0.1:1\"\nlisen = 1\n",
        "[nope]\n",
        "[runtime.restart]\nmax_restart = 1\n",
        &format!("{MINIMAL}\n[agents.other]\nmodel = \"m\"\ntool = []\n"),
    ] {
        let err = Config::from_toml(bad).unwrap_err().to_string();
        assert!(err.contains("unknown field"), "{bad:?}: {err}");
    }
}

#[test]
fn api_md_example_parses_and_validates() {
    let c = Config::from_toml(MINIMAL).unwrap();
    c.validate().unwrap();
    assert_eq!(c.agents["triage"].max_turns, 12);
    assert_eq!(
        c.tools["restart_service"].timeout,
        Some(Duration::from_secs(10))
    );
}

#[test]
fn the_demo_config_validates() {
    Config::demo().validate().unwrap();
}

#[test]
fn validation_names_the_key() {
    let mut c = Config::from_toml(MINIMAL).unwrap();
    c.agents.get_mut("triage").unwrap().model = "x".into();
    assert_eq!(
        c.validate().unwrap_err().to_string(),
        r#"agents.triage.model: model "x" is not defined in [models]"#
    );
    let mut c = Config::from_toml(MINIMAL).unwrap();
    c.agents
        .get_mut("triage")
        .unwrap()
        .tools
        .push("nope".into());
    assert!(
        c.validate()
            .unwrap_err()
            .to_string()
            .starts_with("agents.triage.tools:")
    );
    let mut c = Config::from_toml(MINIMAL).unwrap();
    c.tools.get_mut("restart_service").unwrap().url = None;
    assert!(
        c.validate()
            .unwrap_err()
            .to_string()
            .starts_with("tools.restart_service.url:")
    );
    let mut c = Config::from_toml(MINIMAL).unwrap();
    c.tenants[0].tokens = vec![Secret("short".into()).into()];
    assert!(
        c.validate()
            .unwrap_err()
            .to_string()
            .starts_with("tenants[0].tokens[0]:")
    );
    let err = Config::from_toml("[server]\nshutdown_timeout = \"soon\"\n").unwrap_err();
    assert!(err.to_string().contains("invalid duration"), "{err}");
}

#[test]
fn model_and_tool_call_bounds_are_validated() {
    let openai = |edit: &dyn Fn(&mut ModelConfig)| -> Result<(), String> {
        let mut c = Config::from_toml(MINIMAL).unwrap();
        let mut m = ModelConfig::scripted(vec![]);
        m.kind = ModelKind::Openai;
        m.replies = None;
        m.base_url = Some("http://127.0.0.1:1/v1".into());
        m.model = Some("x".into());
        edit(&mut m);
        c.models.insert("m".into(), m);
        c.validate().map_err(|e| e.to_string())
    };
    openai(&|m| {
        m.max_tokens = Some(512);
        m.temperature = Some(0.7);
        m.stream = Some(true);
        m.context_window = Some(4096);
    })
    .unwrap();
    type Edit<'a> = &'a dyn Fn(&mut ModelConfig);
    let rows: [(Edit, &str); 4] = [
        (&|m| m.max_tokens = Some(0), "models.m.max_tokens:"),
        (&|m| m.temperature = Some(2.5), "models.m.temperature:"),
        (&|m| m.temperature = Some(f32::NAN), "models.m.temperature:"),
        (
            &|m| {
                m.max_tokens = Some(512);
                m.context_window = Some(512);
            },
            "models.m.context_window:",
        ),
    ];
    for (edit, key) in rows {
        let err = openai(edit).unwrap_err();
        assert!(err.starts_with(key), "{err}");
    }
    let mut c = Config::from_toml(MINIMAL).unwrap();
    c.models.get_mut("m").unwrap().max_tokens = Some(10);
    let err = c.validate().unwrap_err().to_string();
    assert!(err.starts_with("models.m.max_tokens:"), "{err}");
    for n in [0, crate::tool::MAX_CALL_ATTEMPTS + 1] {
        let mut c = Config::from_toml(MINIMAL).unwrap();
        c.tools.get_mut("restart_service").unwrap().max_attempts = Some(n);
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.starts_with("tools.restart_service.max_attempts:"),
            "{err}"
        );
    }
    let mut c = Config::from_toml(MINIMAL).unwrap();
    c.tools.get_mut("restart_service").unwrap().poll_interval = Some(Duration::ZERO);
    let err = c.validate().unwrap_err().to_string();
    assert!(
        err.starts_with("tools.restart_service.poll_interval:"),
        "{err}"
    );
    let mut c = Config::from_toml(MINIMAL).unwrap();
    c.server.public_url = Some("agentd.internal:7700".into());
    let err = c.validate().unwrap_err().to_string();
    assert!(err.starts_with("server.public_url:"), "{err}");
    let mut c = Config::from_toml(MINIMAL).unwrap();
    c.runtime.model_retry_window = Duration::ZERO;
    let err = c.validate().unwrap_err().to_string();
    assert!(err.starts_with("runtime.model_retry_window:"), "{err}");
}

#[test]
fn env_overrides_apply_over_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(&path, MINIMAL).unwrap();
    let env = [
        ("AGENTD__SERVER__LISTEN", "0.0.0.0:9999"),
        ("AGENTD__LIMITS__MAX_BODY_BYTES", "4096"),
        ("AGENTD__RUNTIME__RESTART__WINDOW", "1m"),
        ("AGENTD__AGENTS__TRIAGE__MAX_TURNS", "3"),
        ("AGENTD_TOKEN", "ignored"),
        ("OTHER", "ignored"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()));
    let c = Config::load(Some(&path), env).unwrap();
    assert_eq!(c.server.listen, "0.0.0.0:9999");
    assert_eq!(c.limits.max_body_bytes, 4096);
    assert_eq!(c.runtime.restart.window, Duration::from_secs(60));
    assert_eq!(c.agents["triage"].max_turns, 3);
    let bad = [("AGENTD__SERVER__NOPE".to_owned(), "1".to_owned())];
    assert!(Config::load(Some(&path), bad).is_err());
}

#[test]
fn secrets_are_redacted_and_resolved() {
    let mut c = Config::from_toml(MINIMAL).unwrap();
    c.tenants[0]
        .tokens
        .push(Secret("env:AGENTD_TEST_NEVER_SET_X".into()).into());
    let text = c.to_redacted_toml().unwrap();
    assert!(!text.contains("a-long-random-token"), "{text}");
    assert!(text.contains("env:AGENTD_TEST_NEVER_SET_X"));
    assert!(!format!("{c:?}").contains("a-long-random-token"));
    let err = c.tenants[0].tokens[1]
        .secret()
        .resolve("tenants[0].tokens[1]")
        .unwrap_err();
    assert!(err.to_string().contains("AGENTD_TEST_NEVER_SET_X"));
}

#[test]
fn runtime_section_maps_onto_runtime_config() {
    let c = Config::from_toml(
        "[runtime]\nmodel_workers = 7\ntool_queue = 9\n[limits]\nmax_active_runs_per_tenant = 2\n",
    )
    .unwrap();
    let r = c.runtime_config();
    assert_eq!(r.gateway.size.workers, 7);
    assert_eq!(r.tool_pool.queue, 9);
    assert_eq!(r.max_active_runs_per_tenant, Some(2));
    assert_eq!(
        Config::default()
            .runtime_config()
            .max_active_runs_per_tenant,
        None
    );
}

#[test]
fn the_compose_config_validates() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/compose.toml"))
        .unwrap();
    let c = Config::from_toml(&text).unwrap();
    c.validate().unwrap();
    assert!(c.store.url.starts_with("redis://"));
}

#[test]
fn mcp_servers_approval_rules_and_secrets_are_checked() {
    let with = |extra: &str| Config::from_toml(&format!("{MINIMAL}\n{extra}")).unwrap();
    let server = "[tools.everything]\nkind = \"mcp\"\ncommand = \"mcp-server-everything\"\nargs = [\"stdio\"]\n";
    // An agent names one tool of a server as `server__tool`, or the whole server.
    let mut c = with(server);
    c.agents.get_mut("triage").unwrap().tools =
        vec!["everything__get-sum".into(), "everything".into()];
    c.validate().unwrap();
    let mut c = with(server);
    c.agents.get_mut("triage").unwrap().tools = vec!["restart_service__get-sum".into()];
    assert!(
        c.validate()
            .unwrap_err()
            .to_string()
            .starts_with("agents.triage.tools:")
    );
    let err = with(&format!("{server}parameters = {{ type = \"object\" }}\n"))
        .validate()
        .unwrap_err();
    assert!(
        err.to_string().starts_with("tools.everything.parameters:"),
        "{err}"
    );
    let err = with(&format!("{server}bearer_token = \"a-long-token-value\"\n"))
        .validate()
        .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("tools.everything.bearer_token:"),
        "{err}"
    );
    // Approval rules compile at load time; the expiry keys parse.
    let mut c = with("");
    let t = c.tools.get_mut("restart_service").unwrap();
    t.approval = Some(crate::tool::ApprovalRule::WhenArgument {
        pointer: "/env".into(),
        equals: None,
        one_of: None,
        matches: Some("(".into()),
    });
    assert!(
        c.validate()
            .unwrap_err()
            .to_string()
            .starts_with("tools.restart_service.approval:")
    );
    let c = Config::from_toml(&MINIMAL.replace(
        "approval = \"always\"",
        "approval = { when_argument = { pointer = \"/service\", equals = \"db\" } }\napproval_timeout = \"10m\"\non_approval_timeout = \"approve\"",
    ))
    .unwrap();
    c.validate().unwrap();
    let t = &c.tools["restart_service"];
    assert_eq!(t.approval_timeout, Some(Duration::from_secs(600)));
    assert_eq!(
        t.on_approval_timeout,
        Some(crate::tool::ApprovalTimeoutAction::Approve)
    );
    let err = with("[secrets]\npatterns = [\"(\"]\n")
        .validate()
        .unwrap_err();
    assert!(err.to_string().starts_with("secrets.patterns[0]:"), "{err}");
    // Literal secrets never print.
    let c = with("[secrets]\nvalues = [\"planted-secret-value\"]\n");
    assert!(
        !c.to_redacted_toml()
            .unwrap()
            .contains("planted-secret-value")
    );
}

const SCOPED: &str = r#"
[[tenants]]
id = "acme"
agents = ["triage"]
tokens = ["plain-token-has-every-scope",
          { name = "ci-bot", token = "env:CI_TOKEN", scopes = ["deploy:staging"] },
          { name = "ops", token = "ops-token-0123456789abc" }]

[[tenants]]
id = "other"
tokens = [{ name = "ci-bot", token = "other-token-0123456789", scopes = [] }]

[models.m]
kind = "scripted"
replies = [{ text = "done" }]

[tools.restart_service]
kind = "builtin"
builtin = "echo"
permissions = ["deploy:prod"]
on_permission_denied = "stop"
deny = [{ pointer = "/service", one_of = ["prod-db"] }, { pointer = "/note", regex = "(?i)drop", max_length = 100 }]
paths = [{ pointer = "/file", root = "/srv/data" }]
project = ["/id", "/items/*/title"]

[agents.triage]
model = "m"
tools = ["restart_service"]

[agents.other]
model = "m"
"#;

#[test]
fn scoped_tokens_agent_lists_and_tool_guards_parse_and_validate() {
    let c = Config::from_toml(SCOPED).unwrap();
    c.validate().unwrap();
    let t = &c.tenants[0];
    assert_eq!(t.agents.as_deref(), Some(&["triage".to_owned()][..]));
    assert_eq!(t.tokens[0].name(), None);
    assert_eq!(t.tokens[0].scopes(), None);
    assert_eq!(t.tokens[1].name(), Some("ci-bot"));
    assert_eq!(
        t.tokens[1].scopes(),
        Some(&["deploy:staging".to_owned()][..])
    );
    assert_eq!(
        t.tokens[2].scopes(),
        None,
        "a named token without scopes has every scope"
    );
    assert_eq!(c.tenants[1].tokens[0].scopes(), Some(&[][..]));
    let g = crate::run::guard::Guard::new(&c.tools["restart_service"].guard_config()).unwrap();
    assert_eq!(g.permissions, ["deploy:prod"]);
    assert!(g.projects());
    // Literal named tokens are redacted; `env:` references stay.
    let text = c.to_redacted_toml().unwrap();
    assert!(!text.contains("ops-token-0123456789abc"), "{text}");
    assert!(text.contains("env:CI_TOKEN") && text.contains("ci-bot"));
}

#[test]
fn bad_scopes_names_agents_and_guards_name_their_key() {
    let cases: &[(&str, &str, &str)] = &[
        (
            r#"scopes = ["deploy:staging"]"#,
            r#"scopes = ["bad scope"]"#,
            "tenants[0].tokens[1].scopes[0]:",
        ),
        (
            r#"name = "ops""#,
            r#"name = "ci-bot""#,
            "tenants[0].tokens[2].name:",
        ),
        (
            r#"name = "ops""#,
            r#"name = "o p s""#,
            "tenants[0].tokens[2].name:",
        ),
        (
            r#"agents = ["triage"]"#,
            r#"agents = ["nope"]"#,
            "tenants[0].agents[0]:",
        ),
        (
            r#"permissions = ["deploy:prod"]"#,
            r#"permissions = ["deploy:"]"#,
            "tools.restart_service.permissions[0]:",
        ),
        (
            r#"regex = "(?i)drop""#,
            r#"regex = "(""#,
            "tools.restart_service.deny[1].regex:",
        ),
        (
            r#"pointer = "/service""#,
            r#"pointer = "service""#,
            "tools.restart_service.deny[0].pointer:",
        ),
        (
            r#"root = "/srv/data""#,
            r#"root = "/srv/../etc""#,
            "tools.restart_service.paths[0].root:",
        ),
        (
            r#"project = ["/id", "/items/*/title"]"#,
            r#"project = ["id"]"#,
            "tools.restart_service.project[0]:",
        ),
    ];
    for (from, to, key) in cases {
        let text = SCOPED.replacen(from, to, 1);
        assert_ne!(text, SCOPED, "{from}");
        let err = Config::from_toml(&text)
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.starts_with(key), "{to}: {err}");
    }
    let bad = SCOPED.replacen(
        r#"on_permission_denied = "stop""#,
        r#"on_permission_denied = "ignore""#,
        1,
    );
    assert!(Config::from_toml(&bad).is_err());
}

#[test]
fn telemetry_is_off_by_default_and_its_keys_are_checked() {
    let c = Config::demo();
    assert_eq!(c.runtime_config().telemetry.otlp, None);
    assert_eq!(c.runtime_config().telemetry.tenant_labels, None);
    for (toml_text, key) in [
        (
            "otlp_endpoint = \"localhost:4318\"",
            "telemetry.otlp_endpoint",
        ),
        ("otlp_endpoint = \"ftp://h:1\"", "telemetry.otlp_endpoint"),
        ("export_timeout = \"0s\"", "telemetry.export_timeout"),
        ("queue_size = 0", "telemetry.queue_size"),
        ("max_batch = 0", "telemetry.max_batch"),
        ("service_name = \" \"", "telemetry.service_name"),
    ] {
        let mut c = Config::demo();
        c.telemetry = toml::from_str(toml_text).unwrap();
        match c.validate() {
            Err(Error::Invalid { key: k, .. }) => assert_eq!(k, key, "{toml_text}"),
            other => panic!("{toml_text}: {other:?}"),
        }
    }
    let mut c = Config::demo();
    c.telemetry = toml::from_str(
        "otlp_endpoint = \"http://127.0.0.1:4318\"\nexport_interval = \"100ms\"\ntenant_labels = true",
    )
    .unwrap();
    c.validate().unwrap();
    let t = c.runtime_config().telemetry;
    let otlp = t.otlp.unwrap();
    assert_eq!(otlp.endpoint, "http://127.0.0.1:4318");
    assert_eq!(otlp.interval, Duration::from_millis(100));
    assert_eq!(t.tenant_labels, Some(vec![c.tenants[0].id.clone()]));
    assert!(t.models.contains_key("scripted") || !t.models.is_empty());
}

fn comp(c: &mut Config) -> &mut CompensateConfig {
    c.tools
        .get_mut("restart_service")
        .unwrap()
        .compensate
        .as_mut()
        .unwrap()
}

const COMPENSATED: &str = r#"
[[tenants]]
id = "acme"
tokens = ["a-long-random-token"]

[models.m]
kind = "scripted"
replies = [{ text = "done" }]

[tools.restart_service]
kind = "http"
url = "http://127.0.0.1:9000/restart"
parameters = { type = "object", properties = { service = { type = "string" }, opts = { type = "object", properties = { force = { type = "boolean" } } } }, required = ["service"] }
effect = "unsafe"
compensate = { tool = "undo_restart", arguments = { service = "/service", reason = { value = "rollback" } } }

[tools.undo_restart]
kind = "http"
url = "http://127.0.0.1:9000/undo"
parameters = { type = "object", properties = { service = { type = "string" }, reason = { type = "string" } }, required = ["service"] }
effect = "idempotent"

[agents.triage]
model = "m"
tools = ["restart_service"]
"#;

#[test]
fn compensate_rules_parse_and_are_validated_naming_the_key() {
    let c = Config::from_toml(COMPENSATED).unwrap();
    // The compensating tool is allowed implicitly: the agent does not list it.
    c.validate().unwrap();
    let rule = c.tools["restart_service"]
        .compensate
        .as_ref()
        .unwrap()
        .rule()
        .unwrap();
    assert_eq!(rule.tool, "undo_restart");
    assert_eq!(
        rule.arguments_for(&serde_json::json!({"service": "api", "other": 1})),
        serde_json::json!({"service": "api", "reason": "rollback"})
    );
    let check = |edit: &dyn Fn(&mut Config)| -> String {
        let mut c = Config::from_toml(COMPENSATED).unwrap();
        edit(&mut c);
        c.validate().unwrap_err().to_string()
    };
    let err = check(&|c| comp(c).tool = "nope".into());
    assert_eq!(
        err,
        r#"tools.restart_service.compensate.tool: tool "nope" is not defined in [tools]"#
    );
    let err = check(&|c| {
        comp(c)
            .arguments
            .insert("service".into(), serde_json::json!("service"));
    });
    assert!(
        err.starts_with(
            "tools.restart_service.compensate.arguments.service: must be a JSON Pointer"
        ),
        "{err}"
    );
    let err = check(&|c| {
        comp(c)
            .arguments
            .insert("service".into(), serde_json::json!("/name"));
    });
    assert!(
        err.starts_with(
            "tools.restart_service.compensate.arguments.service: `/name` is not a property"
        ),
        "{err}"
    );
    // Nested pointers follow the schema.
    let mut ok = Config::from_toml(COMPENSATED).unwrap();
    comp(&mut ok)
        .arguments
        .insert("force".into(), serde_json::json!("/opts/force"));
    ok.validate().unwrap();
    let err = check(&|c| {
        comp(c)
            .arguments
            .insert("force".into(), serde_json::json!("/opts/hard"));
    });
    assert!(err.contains("`/opts/hard` is not a property"), "{err}");
    let err = check(&|c| {
        comp(c).arguments.remove("service");
    });
    assert!(
        err.starts_with("tools.restart_service.compensate.arguments: the compensating tool \"undo_restart\" requires \"service\""),
        "{err}"
    );
    let err = check(&|c| {
        c.tools.get_mut("undo_restart").unwrap().approval = Some(crate::tool::ApprovalRule::Always);
    });
    assert!(
        err.starts_with("tools.restart_service.compensate.tool: the compensating tool"),
        "{err}"
    );
    let err = check(&|c| {
        c.tools.get_mut("restart_service").unwrap().effect = Some(crate::tool::ToolEffect::Read);
    });
    assert!(
        err.starts_with("tools.restart_service.compensate: a `read` tool"),
        "{err}"
    );
    let err = Config::from_toml(
        &COMPENSATED.replace("compensate = { tool", "compensate = { undo = 1, tool"),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("unknown field"), "{err}");
}
