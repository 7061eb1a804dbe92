//! Tidy checks that keep the docs true: every file says what it owns, ARCHITECTURE.md names
//! every module, the pure core stays pure, and nothing is left as a stub.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n == "node_modules") {
                continue;
            }
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn every_rust_file_opens_with_a_module_doc() {
    let mut files = Vec::new();
    for dir in ["src", "tests", "benches"] {
        rust_files(&root().join(dir), &mut files);
    }
    let missing: Vec<_> = files
        .iter()
        .filter(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            !text.starts_with("//!")
        })
        .collect();
    assert!(
        missing.is_empty(),
        "files without a leading //! line: {missing:?}"
    );
}

#[test]
fn architecture_md_names_every_top_level_module() {
    let arch = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(root().join("src")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "rs") {
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if !arch.contains(&format!("`{name}`")) && !arch.contains(&format!("`{name}`,")) {
                missing.push(name);
            }
        }
    }
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md does not mention: {missing:?}"
    );
}

#[test]
fn the_pure_core_does_no_io_and_reads_no_clock() {
    let forbidden = [
        "tokio",
        "ractor",
        "SystemTime",
        "Instant::now",
        "now_ms()",
        "rand::",
        "std::fs",
        "std::net",
        ".await",
    ];
    // Everything under src/run/ is the pure core, plus these shared pure helpers.
    let mut files = Vec::new();
    rust_files(&root().join("src/run"), &mut files);
    // Unit-test modules kept in their own file (`machine/tests.rs`) are tests, not the core.
    files.retain(|f| f.file_name().is_none_or(|n| n != "tests.rs"));
    files.push(root().join("src/run.rs"));
    files.push(root().join("src/idempotency.rs"));
    files.push(root().join("src/context.rs"));
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        // Only the code, not the tests at the bottom.
        let code = text.split("#[cfg(test)]").next().unwrap();
        for word in forbidden {
            assert!(
                !code.contains(word),
                "{} uses `{word}`: the pure core must not",
                file.display()
            );
        }
    }
}

#[test]
fn no_stubs_or_ignored_tests() {
    let mut files = Vec::new();
    for dir in ["src", "tests"] {
        rust_files(&root().join(dir), &mut files);
    }
    let stub = ["todo!", "(", ")"].concat();
    let unimpl = ["unimplemented!", "(", ")"].concat();
    let ignore = ["#[", "ignore"].concat();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for bad in [&stub, &unimpl, &ignore] {
            assert!(!text.contains(bad.as_str()), "{f:?} contains {bad}");
        }
    }
}
