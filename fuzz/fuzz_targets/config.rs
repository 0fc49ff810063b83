//! `ServerConfig::from_toml_str`: the config file (`lazaret.toml`), every
//! section and key, with schema paths relative to a directory holding the
//! two schemas of docs/api.md.
//!
//! Properties: never a panic; a config is either accepted, and then the
//! server can start with it (its scheduler builds, as `serve` builds it), or
//! refused with a message that says something and a line that is in the
//! text.
//!
//! Inputs whose strings name a special file (`/dev`, `/proc`, `/sys`) are
//! skipped: a schema path may point anywhere, and reading `/dev/zero` never
//! ends; that is the operator's file, not a parser's bug.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use lazaret_core::FairScheduler;
use lazaret_server::config::{ConfigError, ServerConfig};
use lazaret_store::PolicyDecider;
use libfuzzer_sys::fuzz_target;

fn base_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary directory").keep();
        let schemas = dir.join("schemas");
        std::fs::create_dir_all(&schemas).expect("schemas/");
        std::fs::write(
            schemas.join("send_email.v1.json"),
            r#"{"type": "object", "required": ["to"], "properties": {"to": {"type": "string"}}}"#,
        )
        .expect("v1");
        std::fs::write(
            schemas.join("send_email.v2.json"),
            r#"{"type": "object", "required": ["to", "subject"],
               "properties": {"to": {"type": "string"}, "subject": {"type": "string"}}}"#,
        )
        .expect("v2");
        dir
    })
}

/// Whether any string of the TOML (a schema path among them) could name a
/// special file.
fn names_special_file(v: &toml::Value) -> bool {
    match v {
        toml::Value::String(s) => ["dev", "proc", "sys"].iter().any(|w| s.contains(w)),
        toml::Value::Array(a) => a.iter().any(names_special_file),
        toml::Value::Table(t) => t.values().any(names_special_file),
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if text
        .parse::<toml::Table>()
        .is_ok_and(|t| t.values().any(names_special_file))
    {
        return;
    }
    match ServerConfig::from_toml_str(text, base_dir()) {
        Ok(config) => {
            if let Err(e) = FairScheduler::new(config.scheduler.clone()) {
                panic!("an accepted config whose scheduler does not build: {e}\n{text}");
            }
            let _ = PolicyDecider::new(config.policies.clone());
        }
        Err(e) => {
            let shown = e.to_string();
            assert!(!shown.trim().is_empty(), "an empty error for {text:?}");
            if let ConfigError::Invalid { line, message, .. } = &e {
                assert!(!message.trim().is_empty(), "an empty message: {shown}");
                if let Some(line) = *line {
                    let lines = text.matches('\n').count() + 1;
                    assert!(
                        (1..=lines).contains(&line),
                        "line {line} of a {lines}-line text: {shown}"
                    );
                }
            }
        }
    }
});
