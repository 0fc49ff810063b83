//! The commands that need no server: `config check FILE`, `completions
//! SHELL` and `man`, run as the real binary.

use std::process::{Command, Output, Stdio};

/// Runs `lazaret ARGS` to its end.
fn lazaret(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lazaret"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("the lazaret binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn config_check_says_ok_for_a_file_serve_would_take() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("lazaret.toml");
    std::fs::write(
        &file,
        "lease_ms_default = \"30s\"\n\n[lanes.batch]\nweight = 1\n\n\
         [types.send_email]\nattempts_max = 4\nbackoff_base_ms = 250\n",
    )
    .unwrap();
    let out = lazaret(&["config", "check", file.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with(&format!("{}: OK (1 type, ", file.display())),
        "{stdout}"
    );
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
}

#[test]
fn config_check_names_the_file_line_and_key_of_an_error_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(
        &file,
        "[defaults]\nattempts_max = 3\nbackoff_base_ms = \"soon\"\n",
    )
    .unwrap();
    let out = lazaret(&["config", "check", file.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with(&format!(
            "error: {}:3: defaults.backoff_base_ms: \"soon\" is not a duration",
            file.display()
        )),
        "{stderr}"
    );

    // The same error as `serve` gives at start, word for word.
    let serve = lazaret(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--data",
        dir.path().join("data").to_str().unwrap(),
        "--config",
        file.to_str().unwrap(),
    ]);
    assert_eq!(serve.status.code(), Some(1));
    let said = stderr.trim_end().strip_prefix("error: ").unwrap();
    assert!(
        text(&serve.stderr).contains(said),
        "{}",
        text(&serve.stderr)
    );

    let missing = dir.path().join("nope.toml");
    let out = lazaret(&["config", "check", missing.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("cannot read config file"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn completions_are_printed_for_each_shell() {
    for (shell, marker) in [
        ("bash", "complete -F"),
        ("zsh", "#compdef lazaret"),
        ("fish", "complete -c lazaret"),
    ] {
        let out = lazaret(&["completions", shell]);
        assert!(out.status.success(), "{shell}: {}", text(&out.stderr));
        let script = text(&out.stdout);
        assert!(script.contains(marker), "{shell}: {script}");
        for word in ["serve", "dlq", "redrive", "log-format", "completions"] {
            assert!(script.contains(word), "{shell} completions lack {word}");
        }
    }
    let out = lazaret(&["completions", "tcsh"]);
    assert_eq!(out.status.code(), Some(2), "a shell clap_complete lacks");
}

#[test]
fn the_man_page_is_printed_or_written_one_page_per_command() {
    let out = lazaret(&["man"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let page = text(&out.stdout);
    assert!(
        page.starts_with(".ie \\n(.g .ds Aq"),
        "{}",
        &page[..80.min(page.len())]
    );
    assert!(page.contains(".TH lazaret 1"), "{page}");
    assert!(page.contains("serve"), "{page}");

    let dir = tempfile::tempdir().unwrap();
    let out = lazaret(&["man", "--dir", dir.path().to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for name in [
        "lazaret.1",
        "lazaret-serve.1",
        "lazaret-config-check.1",
        "lazaret-dlq-redrive.1",
    ] {
        let page = std::fs::read_to_string(dir.path().join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(page.contains(".TH"), "{name}: {page}");
    }
    let serve = std::fs::read_to_string(dir.path().join("lazaret-serve.1")).unwrap();
    for var in [
        "LAZARET_LISTEN",
        "LAZARET_DATA",
        "LAZARET_STORE",
        "LAZARET_CONFIG",
        "LAZARET_LOG_FORMAT",
    ] {
        assert!(serve.contains(var), "lazaret-serve.1 does not name {var}");
    }
}
