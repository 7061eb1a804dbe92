//! Table-driven tests of scopes, deny rules, path rules and projection, and a property test of
//! the path rule over generated hostile paths.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;

const ROOT: &str = "/srv/data";

fn scopes(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn scopes_grant_themselves_and_what_they_prefix_up_to_a_colon() {
    let cases: &[(Option<&[&str]>, &str, bool)] = &[
        (None, "deploy:prod", true),
        (None, "approve", true),
        (Some(&[]), "approve", false),
        (Some(&["approve"]), "approve", true),
        (Some(&["approve"]), "approve:restart", true),
        (Some(&["approve:restart"]), "approve", false),
        (Some(&["approve:restart"]), "approve:restart", true),
        (Some(&["approve:restart"]), "approve:restart_all", false),
        (Some(&["deploy"]), "deploy:prod", true),
        (Some(&["deploy:staging"]), "deploy:prod", false),
        (Some(&["deploy"]), "deployer", false),
        (Some(&["deploy:"]), "deploy::x", true),
    ];
    for (held, want, expected) in cases {
        let held = held.map(scopes);
        assert_eq!(
            grants(held.as_deref(), want),
            *expected,
            "{held:?} grants {want}"
        );
    }
    assert!(valid_scope("deploy:prod"));
    assert!(valid_scope("approve"));
    for bad in ["", ":x", "x:", "a b", "é", &"x".repeat(129)] {
        assert!(!valid_scope(bad), "{bad:?}");
    }
}

fn guard(config: GuardConfig) -> Guard {
    Guard::new(&config).unwrap()
}

fn deny(pointer: &str, rule: Value) -> DenyRule {
    let mut v = rule;
    v["pointer"] = json!(pointer);
    serde_json::from_value(v).unwrap()
}

#[test]
fn deny_rules_refuse_matching_values_and_pass_the_rest() {
    let g = guard(GuardConfig {
        deny: vec![
            deny("/service", json!({"one_of": ["prod-db", "billing"]})),
            deny("/query", json!({"max_length": 5})),
            deny("/url", json!({"prefix": "file:"})),
            deny("/sql", json!({"regex": "(?i)\\bdrop\\b"})),
            deny("/env", json!({"equals": "prod"})),
            deny("/items/*/id", json!({"equals": 0})),
            deny("/admin", json!({})),
            deny("/tag", json!({"prefix": "x-", "max_length": 4})),
        ],
        ..GuardConfig::default()
    });
    let cases: &[(Value, Option<&str>)] = &[
        (json!({"service": "web"}), None),
        (json!({"service": "prod-db"}), Some("/service")),
        (json!({"service": "billing"}), Some("/service")),
        // Full-width look-alikes meet the same rule (NFKC).
        (json!({"service": "ｐｒｏｄ-ｄｂ"}), Some("/service")),
        (json!({"service": "prod-db2"}), None),
        (json!({"query": "abcde"}), None),
        (json!({"query": "abcdef"}), Some("/query")),
        (json!({"query": "ééééé"}), None),
        (json!({"query": [1, 2, 3, 4, 5, 6]}), Some("/query")),
        (json!({"url": "https://x"}), None),
        (json!({"url": "file:///etc/passwd"}), Some("/url")),
        (json!({"sql": "select 1"}), None),
        (json!({"sql": "Drop table users"}), Some("/sql")),
        (json!({"sql": "dropped"}), None),
        (json!({"env": "prod"}), Some("/env")),
        (json!({"env": "staging"}), None),
        (json!({"env": 1}), None),
        (json!({"items": [{"id": 1}, {"id": 2}]}), None),
        (
            json!({"items": [{"id": 1}, {"id": 0}]}),
            Some("/items/*/id"),
        ),
        (json!({"admin": false}), Some("/admin")),
        (json!({"tag": "x-abc"}), Some("/tag")),
        (json!({"tag": "x-a"}), None),
        (json!({"tag": "yyyyyy"}), None),
        (json!({}), None),
    ];
    for (args, refused_at) in cases {
        let mut a = args.clone();
        let r = g.check("t", None, &mut a);
        match refused_at {
            None => assert!(r.is_ok(), "{args} was refused: {r:?}"),
            Some(at) => {
                let e = r.unwrap_err();
                assert_eq!(e.code, ToolErrorCode::ArgumentDenied, "{args}");
                assert!(e.message.contains(at), "{args}: {}", e.message);
            }
        }
    }
}

#[test]
fn permissions_are_checked_before_arguments() {
    let g = guard(GuardConfig {
        permissions: scopes(&["deploy:prod"]),
        deny: vec![deny("/service", json!({"equals": "db"}))],
        ..GuardConfig::default()
    });
    let mut a = json!({"service": "db"});
    let held = scopes(&["deploy:staging"]);
    let e = g.check("restart", Some(&held), &mut a).unwrap_err();
    assert_eq!(e.code, ToolErrorCode::PermissionDenied);
    assert!(e.message.contains("deploy:prod"), "{}", e.message);
    let held = scopes(&["deploy"]);
    let e = g.check("restart", Some(&held), &mut a).unwrap_err();
    assert_eq!(e.code, ToolErrorCode::ArgumentDenied);
    let mut ok = json!({"service": "web"});
    assert!(g.check("restart", None, &mut ok).is_ok());
    assert_eq!(g.missing_permission(Some(&[])), Some("deploy:prod"));
}

#[test]
fn the_path_rule_table() {
    let long = "a/".repeat(MAX_PATH_BYTES);
    let cases: &[(&str, Result<&str, PathError>)] = &[
        ("a.txt", Ok("/srv/data/a.txt")),
        ("./docs//a.txt", Ok("/srv/data/docs/a.txt")),
        ("docs/./a.txt/", Ok("/srv/data/docs/a.txt")),
        ("", Ok("/srv/data")),
        ("/srv/data", Ok("/srv/data")),
        ("/srv/data/x/y", Ok("/srv/data/x/y")),
        ("//srv//data//x", Ok("/srv/data/x")),
        ("docs%2Fa.txt", Ok("/srv/data/docs/a.txt")),
        ("résumé.pdf", Ok("/srv/data/résumé.pdf")),
        // Full-width letters fold to ASCII (NFKC).
        ("ａ.txt", Ok("/srv/data/a.txt")),
        ("a..b", Ok("/srv/data/a..b")),
        (".hidden", Ok("/srv/data/.hidden")),
        ("/srv/database/x", Err(PathError::OutsideRoot(ROOT.into()))),
        ("/srv", Err(PathError::OutsideRoot(ROOT.into()))),
        ("/etc/passwd", Err(PathError::OutsideRoot(ROOT.into()))),
        ("%2Fetc%2Fpasswd", Err(PathError::OutsideRoot(ROOT.into()))),
        ("../etc", Err(PathError::ParentSegment)),
        ("docs/../a.txt", Err(PathError::ParentSegment)),
        ("/srv/data/../data/x", Err(PathError::ParentSegment)),
        ("%2e%2e/etc", Err(PathError::ParentSegment)),
        ("%2E%2e%2fetc", Err(PathError::ParentSegment)),
        ("...", Err(PathError::ParentSegment)),
        (".. /x", Err(PathError::ParentSegment)),
        (". ./x", Err(PathError::ParentSegment)),
        ("．．／etc", Err(PathError::ParentSegment)),
        ("\u{2025}/etc", Err(PathError::ParentSegment)),
        ("%252e%252e/etc", Err(PathError::DoubleEncoded)),
        ("100%25", Err(PathError::DoubleEncoded)),
        ("％2e％2e/etc", Err(PathError::DoubleEncoded)),
        ("a\u{fe6a}", Err(PathError::DoubleEncoded)),
        ("%ff%fe", Err(PathError::NotUtf8)),
        ("..\u{2215}etc", Err(PathError::Suspicious(0x2215))),
        ("a\u{2044}b", Err(PathError::Suspicious(0x2044))),
        ("a\u{200b}b", Err(PathError::Suspicious(0x200B))),
        ("a\u{202e}b", Err(PathError::Suspicious(0x202E))),
        ("a\u{0}b", Err(PathError::Suspicious(0))),
        ("a%00b", Err(PathError::Suspicious(0))),
        ("a\nb", Err(PathError::Suspicious(0x0A))),
        ("\u{3002}\u{3002}/etc", Err(PathError::Suspicious(0x3002))),
        ("a\\..\\b", Err(PathError::Backslash)),
        ("＼etc", Err(PathError::Backslash)),
        ("~/x", Err(PathError::HomeRelative)),
        ("~root", Err(PathError::HomeRelative)),
        (&long, Err(PathError::TooLong)),
    ];
    for (raw, want) in cases {
        let got = check_path(ROOT, raw);
        assert_eq!(
            got.as_deref().map_err(Clone::clone),
            want.clone(),
            "{raw:?}"
        );
    }
    assert_eq!(check_path("/", "/etc/passwd").as_deref(), Ok("/etc/passwd"));
    assert_eq!(check_path("/", "../x"), Err(PathError::ParentSegment));
}

#[test]
fn path_rules_rewrite_arguments_to_the_checked_path() {
    let g = guard(GuardConfig {
        paths: vec![
            PathRule {
                pointer: "/file".into(),
                root: ROOT.into(),
            },
            PathRule {
                pointer: "/more/*".into(),
                root: ROOT.into(),
            },
        ],
        ..GuardConfig::default()
    });
    let mut a = json!({"file": "./docs//a.txt", "more": ["b", "/srv/data/c"], "other": "../x"});
    g.check("read_file", None, &mut a).unwrap();
    assert_eq!(
        a,
        json!({"file": "/srv/data/docs/a.txt", "more": ["/srv/data/b", "/srv/data/c"], "other": "../x"})
    );
    let mut bad = json!({"file": "a", "more": ["ok", "%2e%2e/etc"]});
    let e = g.check("read_file", None, &mut bad).unwrap_err();
    assert_eq!(e.code, ToolErrorCode::ArgumentDenied);
    assert!(e.message.contains("/more/*"), "{}", e.message);
    let mut not_string = json!({"file": 7});
    assert!(g.check("read_file", None, &mut not_string).is_err());
    let mut absent = json!({});
    assert!(g.check("read_file", None, &mut absent).is_ok());
}

#[test]
fn bad_guards_name_their_key() {
    let cases: &[(GuardConfig, &str)] = &[
        (
            GuardConfig {
                permissions: scopes(&["ok", "not ok"]),
                ..GuardConfig::default()
            },
            "permissions[1]",
        ),
        (
            GuardConfig {
                deny: vec![deny("service", json!({}))],
                ..GuardConfig::default()
            },
            "deny[0].pointer",
        ),
        (
            GuardConfig {
                deny: vec![deny("/a~2", json!({}))],
                ..GuardConfig::default()
            },
            "deny[0].pointer",
        ),
        (
            GuardConfig {
                deny: vec![deny("/a", json!({"regex": "("}))],
                ..GuardConfig::default()
            },
            "deny[0].regex",
        ),
        (
            GuardConfig {
                paths: vec![PathRule {
                    pointer: "/p".into(),
                    root: "srv/data".into(),
                }],
                ..GuardConfig::default()
            },
            "paths[0].root",
        ),
        (
            GuardConfig {
                paths: vec![PathRule {
                    pointer: "/p".into(),
                    root: "/srv/../etc".into(),
                }],
                ..GuardConfig::default()
            },
            "paths[0].root",
        ),
        (
            GuardConfig {
                project: vec!["/ok".into(), "nope".into()],
                ..GuardConfig::default()
            },
            "project[1]",
        ),
    ];
    for (config, key) in cases {
        let e = Guard::new(config).unwrap_err();
        assert_eq!(e.key, *key, "{e}");
    }
}

#[test]
fn projection_keeps_only_the_selected_parts_in_place() {
    let data = json!({
        "id": 7,
        "secret_notes": "internal",
        "items": [{"title": "a", "body": "long a"}, {"title": "b", "body": "long b"}],
        "meta": {"total": 2, "cursor": "xyz"},
        "a/b": 1,
    });
    let cases: &[(&[&str], Value)] = &[
        (&["/id"], json!({"id": 7})),
        (
            &["/id", "/items/*/title", "/meta/total"],
            json!({"id": 7, "items": [{"title": "a"}, {"title": "b"}], "meta": {"total": 2}}),
        ),
        (
            &["/items/1/title"],
            json!({"items": [null, {"title": "b"}]}),
        ),
        (
            &["/items/0/title", "/items/1/body"],
            json!({"items": [{"title": "a"}, {"body": "long b"}]}),
        ),
        (&["/a~1b"], json!({"a/b": 1})),
        (&["/missing"], json!({})),
        (&[""], data.clone()),
    ];
    for (pointers, want) in cases {
        let g = guard(GuardConfig {
            project: pointers.iter().map(|p| (*p).to_owned()).collect(),
            ..GuardConfig::default()
        });
        assert!(g.projects());
        assert_eq!(g.project(&data).as_ref(), want, "{pointers:?}");
    }
    let none = Guard::default();
    assert!(!none.projects());
    assert_eq!(none.project(&data).as_ref(), &data);
}

// ------------------------------------------------------------ property test of the path rule

/// A lenient resolver, as a careless tool might read a path: percent-decode and NFKC-fold until
/// it stops changing, fold look-alikes to `/` and `.`, treat `\` as a separator, then resolve
/// `..` lexically. Returns the absolute path it lands on.
fn lenient_resolve(root: &str, raw: &str) -> String {
    let mut text = raw.to_owned();
    for _ in 0..8 {
        let next: String = percent_encoding::percent_decode_str(&text)
            .decode_utf8_lossy()
            .nfkc()
            .collect();
        if next == text {
            break;
        }
        text = next;
    }
    let text: String = text
        .chars()
        .map(|c| match c {
            '\\' | '\u{2215}' | '\u{2044}' | '\u{29F8}' | '\u{2571}' | '\u{FE68}' => '/',
            '\u{3002}' | '\u{2024}' | '\u{FF0E}' | '\u{FF61}' => '.',
            c => c,
        })
        .filter(|c| !matches!(c, '\u{200B}'..='\u{200F}' | '\u{FEFF}'))
        .collect();
    let mut parts: Vec<String> = if text.starts_with('/') {
        Vec::new()
    } else {
        root.split('/')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    };
    for seg in text.split('/') {
        if seg.is_empty() || seg == "." {
            continue;
        }
        // Some systems drop trailing dots and spaces: `...` and `.. ` read as `..`.
        if seg.chars().all(|c| c == '.' || c == ' ') {
            if seg.matches('.').count() >= 2 {
                parts.pop();
            }
            continue;
        }
        parts.push(seg.to_owned());
    }
    format!("/{}", parts.join("/"))
}

fn inside(root: &str, path: &str) -> bool {
    path == root || path.starts_with(&format!("{root}/"))
}

fn hostile_path() -> impl Strategy<Value = String> {
    let segment = prop::sample::select(vec![
        "a",
        "b.txt",
        "..",
        ".",
        "",
        "...",
        ".. ",
        "%2e%2e",
        "%2E.",
        "%252e%252e",
        "．．",
        "‥",
        "~",
        "~root",
        "srv",
        "data",
        "database",
        "etc",
        "passwd",
        "\u{200b}..",
        "é",
        "e\u{301}",
        "c d",
        "%00",
        "%ff",
        "a%2fb",
        "%5c..",
        "。。",
        "link",
        "self",
        "proc",
        "％2e％2e",
        "\u{fe6a}2e\u{fe6a}2e",
    ]);
    let sep = prop::sample::select(vec![
        "/", "/", "/", "//", "%2f", "%2F", "\\", "／", "∕", "%5c",
    ]);
    let lead = prop::sample::select(vec!["", "", "/", "/srv/data/", "/srv/", "%2f", "~/"]);
    (lead, prop::collection::vec((segment, sep), 0..8)).prop_map(|(lead, parts)| {
        let mut s = lead.to_owned();
        for (i, (seg, sep)) in parts.iter().enumerate() {
            if i > 0 {
                s.push_str(sep);
            }
            s.push_str(seg);
        }
        s
    })
}

fn assert_normal(root: &str, raw: &str, out: &str) {
    assert!(inside(root, out), "{raw:?} → {out:?} is outside {root}");
    assert!(!out.contains("//") && !out.contains('\\') && !out.contains('%'));
    assert!(
        out.split('/')
            .skip(1)
            .all(|s| !s.is_empty() && s != "." && s != ".."),
        "{raw:?} → {out:?} is not normal"
    );
    assert!(!out.chars().any(suspicious), "{raw:?} → {out:?}");
    // What was checked passes again unchanged.
    assert_eq!(check_path(root, out).as_deref(), Ok(out), "{raw:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Whatever a hostile path is made of, an accepted one is normal, inside the root, and
    /// lands inside the root even for a careless reader; one a careless reader would resolve
    /// outside the root is refused.
    #[test]
    fn accepted_paths_stay_inside_the_root(raw in hostile_path()) {
        let lenient = lenient_resolve(ROOT, &raw);
        if let Ok(out) = check_path(ROOT, &raw) {
            assert_normal(ROOT, &raw, &out);
            prop_assert!(inside(ROOT, &lenient), "{raw:?}: accepted as {out:?}, but a lenient reader lands on {lenient:?}");
        }
        if !inside(ROOT, &lenient) {
            prop_assert!(check_path(ROOT, &raw).is_err(), "{raw:?} escapes to {lenient:?} but was accepted");
        }
    }

    /// Any string at all: an accepted path is normal and inside the root.
    #[test]
    fn arbitrary_strings_are_refused_or_confined(raw in any::<String>()) {
        if let Ok(out) = check_path(ROOT, &raw) {
            assert_normal(ROOT, &raw, &out);
        }
    }
}
