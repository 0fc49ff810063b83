//! The config's tests: whole files here (the contract's example, the
//! documented one, defaults, where errors are located), a section each in
//! the files beside.

use std::path::{Path, PathBuf};
use std::time::Duration;

use lazaret_core::{
    AlertEvent, AlertRule, BreakerConfig, ErrorKind, FailureClass, JobType, Lane, TenantId,
    TypePolicy,
};
use lazaret_guard::{BrokerKind, DeliverFormat, Mode, TenantFrom};

use super::*;
use crate::auth::{Role, token_sha256};

mod alerts;
mod http;
mod policies;
mod sources;
mod tokens;

/// The example of the API contract's "Configuration file (TOML)" section, verbatim.
pub(super) const CONTRACT_EXAMPLE: &str = r#"
payload_bytes_max = 262144          # admission byte cap on the payload
batch_bytes_max = 16777216          # cap on a whole batch body (413 POISON payload_too_large over it)
accept_unknown_types = true         # false: UNKNOWN_TYPE for types not listed below

[tenants]
inflight_max = 2                    # default per-tenant in-flight cap in each lane

[lanes.interactive]
weight = 4                          # share of leases when several lanes have work
[lanes.batch]
weight = 1

[defaults]                          # policy for types not listed, and the base for listed ones
attempts_max = 5                    # deliveries in all, the first included
backoff_base_ms = 1000
backoff_cap_ms = 300000
crash_loop_max = 3                  # lease expiries before dead-lettering as crash_loop

deferrals_max = 50                  # deferred outcomes before dead-lettering as deferrals_exhausted

[types.send_email]
attempts_max = 4
backoff_base_ms = 50
kinds = { parse = 2, validation = 1 } # attempts a failure of that kind may spend
schemas = { 1 = "schemas/send_email.v1.json", 2 = "schemas/send_email.v2.json" }

[types.send_email.breaker]          # per (type, error kind)
failures_min = 20                   # failures in the window before it may open
failure_ratio = 0.5                 # and at least this share of outcomes failing
window_ms = 30000
cooldown_ms = 10000                 # open → half-open
probes = 2                          # leases allowed while half-open

[[tokens]]
name = "ops-alice"
role = "operator"                   # producer | worker | operator | admin
token = "..."                       # or token_sha256 = "hex"
"#;

/// A config directory holding `text` as `lazaret.toml` and the example's schemas.
pub(super) fn config_dir(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("schemas")).unwrap();
    let v1 = r#"{"type": "object", "required": ["to"], "properties": {"to": {"type": "string"}}}"#;
    let v2 = r#"{"type": "object", "required": ["to", "subject"]}"#;
    std::fs::write(dir.path().join("schemas/send_email.v1.json"), v1).unwrap();
    std::fs::write(dir.path().join("schemas/send_email.v2.json"), v2).unwrap();
    let file = dir.path().join("lazaret.toml");
    std::fs::write(&file, text).unwrap();
    (dir, file)
}

pub(super) fn parse(text: &str) -> Result<ServerConfig, ConfigError> {
    ServerConfig::from_toml_str(text, Path::new("/nonexistent"))
}

/// Asserts that `text` is refused about `key` on `line`, with a message containing `words`.
#[track_caller]
pub(super) fn assert_refused(text: &str, key: &str, line: usize, words: &str) -> ConfigError {
    let e = parse(text).expect_err("config should be refused");
    assert_eq!(e.key(), Some(key), "{e}");
    assert_eq!(e.line(), Some(line), "{e}");
    assert!(e.to_string().contains(words), "`{words}` not in: {e}");
    e
}

pub(super) fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn the_contract_example_loads_with_its_schemas() {
    let (_dir, file) = config_dir(CONTRACT_EXAMPLE);
    let cfg = ServerConfig::load(&file).unwrap();

    let send = cfg.policies.for_type("send_email");
    assert_eq!(send.attempts_max, 4);
    assert_eq!(send.backoff.base, ms(50));
    assert_eq!(send.backoff.cap, Duration::from_secs(300), "inherited");
    assert_eq!(send.crash_loop_max, 3);
    assert_eq!(send.deferrals_max, 50);
    let kinds: Vec<(&str, u32)> = send.kinds.iter().map(|(k, n)| (k.as_str(), *n)).collect();
    assert_eq!(kinds, [("parse", 2), ("validation", 1)]);
    assert_eq!(cfg.policies.defaults, TypePolicy::default());
    assert_eq!(cfg.policies.for_type("other"), &TypePolicy::default());

    assert_eq!(cfg.scheduler.inflight_max, 2);
    let lanes: Vec<(&str, u32)> = cfg
        .scheduler
        .lane_weights
        .iter()
        .map(|(l, w)| (l.as_str(), *w))
        .collect();
    assert_eq!(lanes, [("batch", 1), ("default", 1), ("interactive", 4)]);

    assert_eq!(cfg.breaker_default, None);
    let breaker = cfg.breakers[&JobType::new("send_email")];
    assert_eq!(
        breaker,
        BreakerConfig {
            failures_min: 20,
            failure_ratio: 0.5,
            window: Duration::from_secs(30),
            cooldown: Duration::from_secs(10),
            probes: 2,
        }
    );

    assert_eq!(cfg.tokens.len(), 1);
    assert_eq!(cfg.tokens[0].name, "ops-alice");
    assert_eq!(cfg.tokens[0].role, Role::Operator);
    assert_eq!(cfg.tokens[0].sha256, token_sha256("..."));
    assert!(!format!("{:?}", cfg.tokens[0]).contains("..."));

    assert_eq!(cfg.payload_bytes_max, 262_144);
    assert_eq!(cfg.batch_bytes_max, 16 * 1024 * 1024);
    assert!(cfg.admission.accept_unknown_types);
    assert_eq!(cfg.admission.payload_bytes_max, 262_144);
    let schemas = &cfg.admission.types[&JobType::new("send_email")];
    assert_eq!(schemas.versions().collect::<Vec<_>>(), [1, 2]);
    let (violations, total) = schemas.violations(2, &serde_json::json!({"to": "a@b"}));
    assert_eq!((violations.len(), total), (1, 1), "v2 requires a subject");
}

#[test]
fn the_documented_example_loads_and_sets_every_key() {
    // The module doc is the key reference copied into docs: it must parse.
    let source = include_str!("../mod.rs");
    let doc: Vec<&str> = source
        .lines()
        .take_while(|l| l.starts_with("//!"))
        .map(|l| l.strip_prefix("//! ").unwrap_or(""))
        .skip_while(|l| *l != "```toml")
        .skip(1)
        .take_while(|l| *l != "```")
        .collect();
    let (_dir, file) = config_dir(&doc.join("\n"));
    let cfg = ServerConfig::load(&file).unwrap();
    assert_eq!(
        cfg.scheduler.tenant_inflight_max[&TenantId::new("big-customer")],
        8
    );
    assert_eq!(cfg.alerts.len(), 1);
    assert_eq!(cfg.alerts[0].rule, AlertRule::default());
    assert_eq!(cfg.breaker_default.unwrap().failures_min, 20);
    assert_eq!(cfg.tokens.len(), 2);
    assert_eq!(cfg.tokens[1].role, Role::Producer);
    assert_eq!(cfg.tokens[1].sha256, token_sha256("hello"));
    let d = &cfg.policies.defaults;
    assert_eq!(
        d.kind_classes[&ErrorKind::new("http_404")],
        FailureClass::Permanent
    );
    let send = cfg.policies.for_type("send_email");
    assert_eq!(
        send.kinds.len(),
        3,
        "timeout inherited, parse and validation added"
    );
    assert_eq!(send.kind_classes, d.kind_classes);
    let names: Vec<&str> = cfg.sources.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["orders", "celery-dlq"]);
    let orders = &cfg.sources[0];
    assert_eq!(orders.broker, BrokerKind::RabbitMq);
    assert_eq!(
        orders.deliver.as_deref(),
        Some("http://127.0.0.1:8080/orders")
    );
    assert_eq!(orders.redrive_to.as_deref(), Some("orders"));
    let dlq = &cfg.sources[1];
    assert_eq!(dlq.mode, Mode::Watch);
    assert_eq!(dlq.tenant, TenantFrom::Header("x-tenant".into()));
    assert_eq!(
        dlq.job_type.as_str(),
        "celery-dlq",
        "the type defaults to the name"
    );
}

#[test]
fn an_empty_file_gives_the_defaults() {
    let cfg = parse("").unwrap();
    let d = ServerConfig::default();
    assert_eq!(cfg.payload_bytes_max, 262_144);
    assert_eq!(cfg.batch_bytes_max, 16 * 1024 * 1024);
    assert!(cfg.accept_unknown_types);
    assert_eq!(cfg.scheduler, d.scheduler);
    assert_eq!(cfg.scheduler.inflight_max, INFLIGHT_UNCAPPED, "no cap");
    assert!(
        !cfg.scheduler.at_cap(&TenantId::new("acme"), 1_000_000),
        "no FAIR_QUEUE without a configured cap"
    );
    assert!(cfg.scheduler.tenant_inflight_max.is_empty());
    assert_eq!(cfg.scheduler.lane_weights[&Lane::default_lane()], 1);
    assert_eq!(cfg.policies.defaults, TypePolicy::default());
    assert_eq!(cfg.policies.defaults.attempts_max, 5);
    assert_eq!(cfg.policies.defaults.backoff.base, ms(1000));
    assert_eq!(cfg.policies.defaults.backoff.cap, ms(300_000));
    assert_eq!(cfg.policies.defaults.crash_loop_max, 3);
    assert_eq!(cfg.policies.defaults.deferrals_max, 50);
    assert!(cfg.policies.types.is_empty());
    assert!(cfg.admission.types.is_empty());
    assert_eq!(cfg.breaker_default, None);
    assert!(cfg.breakers.is_empty());
    assert!(cfg.tokens.is_empty());
    assert_eq!(cfg.retention, d.retention);
    assert_eq!(
        (
            cfg.retention.succeeded,
            cfg.retention.cleaner_batch,
            cfg.retention.cleaner_interval
        ),
        (ms(86_400_000), 500, ms(1000))
    );
    assert_eq!(cfg.dead_letters_warn, 100_000);
    assert_eq!(cfg.redrives_max, 3);
    assert_eq!(cfg.admission_records_per_minute, 60);
    assert_eq!(cfg.admission_records_all_per_minute, 600);
    assert_eq!(cfg.durability, Durability::Full);
    assert_eq!(
        (cfg.lease_default, cfg.lease_max),
        (ms(30_000), ms(3_600_000))
    );
}

#[test]
fn redrives_max_is_read_and_zero_is_refused_naming_it() {
    let cfg = ServerConfig::from_toml_str("redrives_max = 5\n", Path::new(".")).unwrap();
    assert_eq!(cfg.redrives_max, 5);
    assert_refused(
        "\nredrives_max = 0\n",
        "redrives_max",
        2,
        "redrives_max must be at least 1",
    );
}

#[test]
fn an_unknown_key_is_refused_with_its_path_and_line() {
    let e = assert_refused(
        "[types.send_email]\nattempts_max = 4\natempts_max = 3\n",
        "types.send_email.atempts_max",
        3,
        "unknown field `atempts_max`",
    );
    assert!(
        e.to_string()
            .starts_with("config line 3: types.send_email.atempts_max: "),
        "{e}"
    );
    assert_refused(
        "payload_byte_max = 1\n",
        "payload_byte_max",
        1,
        "fix its spelling",
    );
    assert_refused(
        "\n[types.a]\nbreaker = { window_ms = 5, probs = 1 }\n",
        "types.a.breaker.probs",
        3,
        "unknown field `probs`",
    );
    assert_refused(
        "[[tokens]]\nname = \"a\"\nrol = \"admin\"\n",
        "tokens[0].rol",
        3,
        "rol",
    );
    assert_refused(
        "[lanes.fast]\nweigth = 2\n",
        "lanes.fast.weigth",
        2,
        "weigth",
    );
}

#[test]
fn a_wrongly_typed_value_is_refused_with_its_path_and_line() {
    assert_refused(
        "[defaults]\n\nattempts_max = \"five\"\n",
        "defaults.attempts_max",
        3,
        "invalid type",
    );
    assert_refused(
        "[types.a]\nbackoff_schedule_ms = [10, -1]\n",
        "types.a.backoff_schedule_ms[1]",
        2,
        "negative",
    );
    assert_refused(
        "[types.a]\nkind_classes = { http_404 = \"fatal\" }\n",
        "types.a.kind_classes.http_404",
        2,
        "`permanent`",
    );
    assert_refused(
        "lease_ms_default = \"thirty seconds\"\n",
        "lease_ms_default",
        1,
        "is not a duration",
    );
    assert_refused(
        "[types.a]\nbackoff_schedule_ms = [\"1s\", \"1500us\"]\n",
        "types.a.backoff_schedule_ms[1]",
        2,
        "finer than a millisecond",
    );
    assert_refused(
        "[http]\n\nidle_timeout_ms = \"5\"\n",
        "http.idle_timeout_ms",
        3,
        "\"30s\", \"5m\"",
    );
}

#[test]
fn durations_may_be_written_with_a_unit() {
    let cfg = parse(
        "lease_ms_default = \"30s\"\nlease_ms_max = \"1h\"\n\
         [http]\nidle_timeout_ms = \"5m\"\nshutdown_grace_ms = 2500\n\
         [retention]\nsucceeded_ms = \"1day\"\n\
         [types.a]\nbackoff_base_ms = \"250ms\"\nbackoff_schedule_ms = [\"1s\", 2000, \"1m 30s\"]\n\
         [types.a.breaker]\ncooldown_ms = \"10s\"\n",
    )
    .unwrap();
    assert_eq!(cfg.lease_default, Duration::from_secs(30));
    assert_eq!(cfg.lease_max, Duration::from_secs(3600));
    assert_eq!(cfg.http.idle_timeout, Duration::from_secs(300));
    assert_eq!(cfg.http.shutdown_grace, ms(2500));
    assert_eq!(cfg.retention.succeeded, Duration::from_secs(86_400));
    let a = cfg.policies.for_type("a");
    assert_eq!(a.backoff.base, ms(250));
    assert_eq!(a.backoff.schedule, vec![ms(1000), ms(2000), ms(90_000)]);
    assert_eq!(
        cfg.breakers[&JobType::new("a")].cooldown,
        Duration::from_secs(10)
    );
}

#[test]
fn invalid_toml_is_refused_with_its_line() {
    let e = parse("a = 1\n[types\n").unwrap_err();
    assert_eq!(e.line(), Some(2), "{e}");
    assert!(e.to_string().contains("not valid TOML"), "{e}");
}

#[test]
fn an_unreadable_config_file_is_named() {
    let e = ServerConfig::load(Path::new("/nonexistent/lazaret.toml")).unwrap_err();
    assert!(matches!(e, ConfigError::Read { .. }));
    assert!(e.to_string().contains("/nonexistent/lazaret.toml"), "{e}");
}
