//! Keeps the codebase honest: a pure core, a `//!` line atop every file, no leftovers.

use std::path::{Path, PathBuf};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy();
        if path.is_dir() && name != "target" && !name.starts_with('.') {
            rust_files(&path, out);
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

#[test]
fn core_reads_no_clock_draws_no_randomness_and_does_no_io() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let forbidden = [
        "SystemTime::now",
        "Instant::now",
        "thread_rng",
        "rand::rng",
        "thread::sleep",
        "std::fs",
        "std::net",
        "tokio",
        "rusqlite",
        "sqlx",
        "axum",
    ];
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        // Doc comments may name what the core avoids; code may not use it.
        let code: Vec<&str> = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect();
        let code = code.join("\n");
        for word in forbidden {
            assert!(
                !code.contains(word),
                "{} uses `{word}`: the core must stay pure (inject time and randomness)",
                f.display()
            );
        }
    }
}

#[test]
fn core_depends_on_no_runtime_or_database() {
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")).unwrap();
    let deps = manifest.split("[dev-dependencies]").next().unwrap();
    for word in [
        "tokio", "axum", "rusqlite", "sqlx", "rand", "hyper", "reqwest",
    ] {
        assert!(
            !deps.lines().any(|l| l.trim_start().starts_with(word)),
            "lazaret-core must not depend on {word}: it decides, the shells do I/O"
        );
    }
}

#[test]
fn every_rust_file_says_what_it_is_and_leaves_no_debris() {
    let mut files = Vec::new();
    rust_files(&workspace_root().join("crates"), &mut files);
    assert!(!files.is_empty());
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        assert!(
            first.starts_with("//!"),
            "{} must start with a `//!` line saying what it is",
            f.display()
        );
        for debris in ["dbg!(", "todo!(", "#[ignore"] {
            // Spelled in pieces so this file does not trip itself.
            assert!(
                !text.contains(debris) || f.ends_with("tidy.rs"),
                "{} contains {debris}",
                f.display()
            );
        }
    }
}

#[test]
fn every_crate_is_on_the_map() {
    let root = workspace_root();
    let map = std::fs::read_to_string(root.join("ARCHITECTURE.md"))
        .expect("ARCHITECTURE.md at the repo root");
    for entry in std::fs::read_dir(root.join("crates")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(
            map.contains(&format!("`{name}`")),
            "ARCHITECTURE.md does not describe the crate `{name}`"
        );
    }
}
