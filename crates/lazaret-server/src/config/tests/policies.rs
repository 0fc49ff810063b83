//! `[defaults]`, `[types.X]`, `[tenants]`, `[lanes.X]` and the ranges of values.

use super::*;

#[test]
fn a_type_inherits_every_key_it_does_not_set() {
    let cfg = parse(
        r#"
[defaults]
attempts_max = 7
backoff_floor_ms = 10
backoff_schedule_ms = [100, 1000]
kinds = { timeout = 3, parse = 2 }
kind_classes = { http_404 = "permanent" }

[defaults.breaker]
probes = 5

[types.bare]

[types.picky]
crash_loop_max = 1
backoff_schedule_ms = []
kinds = { parse = 1 }
kind_classes = { http_429 = "deferred" }
[types.picky.breaker]
failures_min = 3
"#,
    )
    .unwrap();
    let d = cfg.policies.defaults.clone();
    assert_eq!(d.attempts_max, 7);
    assert_eq!(d.backoff.schedule, [ms(100), ms(1000)]);
    assert_eq!(cfg.policies.for_type("bare"), &d);

    let picky = cfg.policies.for_type("picky");
    assert_eq!(picky.attempts_max, 7);
    assert_eq!(picky.crash_loop_max, 1);
    assert_eq!(picky.backoff.floor, ms(10));
    assert!(picky.backoff.schedule.is_empty(), "[] clears the schedule");
    let kinds: Vec<(&str, u32)> = picky.kinds.iter().map(|(k, n)| (k.as_str(), *n)).collect();
    assert_eq!(
        kinds,
        [("parse", 1), ("timeout", 3)],
        "merged, the type wins"
    );
    assert_eq!(picky.kind_classes.len(), 2);

    assert_eq!(cfg.breaker_default.unwrap().probes, 5);
    let b = cfg.breakers[&JobType::new("picky")];
    assert_eq!(
        (b.failures_min, b.probes),
        (3, 5),
        "inherits [defaults.breaker]"
    );
    assert!(
        !cfg.breakers.contains_key("bare"),
        "falls back to breaker_default at run time"
    );
    assert!(
        cfg.admission.types["bare"].is_empty(),
        "listed, so known, without schemas"
    );
}

#[test]
fn a_zero_count_is_refused_with_the_types_key_and_line() {
    let text = "[types.send_email]\nbackoff_base_ms = 50\nattempts_max = 0\n";
    assert_refused(text, "types.send_email.attempts_max", 3, "at least 1");
    let (_dir, file) = config_dir(text);
    let e = ServerConfig::load(&file).unwrap_err();
    let shown = e.to_string();
    assert!(
        shown.starts_with(&format!(
            "{}:3: types.send_email.attempts_max: ",
            file.display()
        )),
        "{shown}"
    );
    assert_refused(
        "[types.a]\nkinds = { parse = 0 }\n",
        "types.a.kinds.parse",
        2,
        "at least 1",
    );
    assert_refused(
        "[defaults]\ndeferrals_max = 0\n",
        "defaults.deferrals_max",
        2,
        "at least 1",
    );
    assert_refused(
        "[defaults]\nbackoff_floor_ms = 500\n[types.a]\nbackoff_cap_ms = 100\n",
        "types.a.backoff_cap_ms",
        4,
        "above backoff_cap_ms",
    );
}

#[test]
fn lane_reserves_and_breaker_behaviour_are_read_and_checked() {
    let cfg = parse(
        "[lanes.interactive]\nweight = 4\nreserve = 0.2\non_breaker_open = \"park\"\n\
         [lanes.batch]\nreserve = 0\non_breaker_open = \"shed\"\n[lanes.all]\nreserve = 1\n\
         [lanes.none]\n",
    );
    let e = cfg.expect_err("reserves adding up to 1.2 are refused");
    assert_eq!(e.key(), Some("lanes.interactive.reserve"), "{e}");
    assert!(e.to_string().contains("add up to 1.2"), "{e}");

    let cfg = parse(
        "[lanes.interactive]\nweight = 4\nreserve = 0.2\non_breaker_open = \"park\"\n\
         [lanes.batch]\nreserve = 0\non_breaker_open = \"shed\"\n[lanes.bulk]\nreserve = 0.8\n",
    )
    .unwrap();
    let reserve = |l: &str| cfg.scheduler.lane_reserve(&Lane::new(l)).parts();
    assert_eq!(reserve("interactive"), 200_000);
    assert_eq!(reserve("batch"), 0);
    assert_eq!(reserve("bulk"), 800_000);
    assert_eq!(reserve("default"), 0);
    assert_eq!(
        cfg.park_lanes.iter().map(Lane::as_str).collect::<Vec<_>>(),
        ["interactive"]
    );
    assert!(ServerConfig::default().park_lanes.is_empty());

    assert_refused(
        "[lanes.a]\nweight = 2\nreserve = 1.5\n",
        "lanes.a.reserve",
        3,
        "between 0 and 1",
    );
    assert_refused(
        "[lanes.a]\nreserve = -0.1\n",
        "lanes.a.reserve",
        2,
        "between 0 and 1",
    );
    assert_refused(
        "[lanes.a]\non_breaker_open = \"queue\"\n",
        "lanes.a.on_breaker_open",
        2,
        "\"park\"",
    );
    assert_refused("[lanes.a]\nreserve = \"20%\"\n", "lanes.a.reserve", 2, "");
}

#[test]
fn other_out_of_range_values_are_refused_where_they_are_written() {
    assert_refused(
        "[types.a.breaker]\nfailure_ratio = 1.5\n",
        "types.a.breaker.failure_ratio",
        2,
        "in (0, 1]",
    );
    assert_refused(
        "[defaults.breaker]\nprobes = 0\n",
        "defaults.breaker.probes",
        2,
        "at least 1",
    );
    assert_refused(
        "[lanes.a]\nweight = 1\n[lanes.b]\nweight = 0\n",
        "lanes.b.weight",
        4,
        "weight 0",
    );
    assert_refused(
        "[tenants]\ninflight_max = 0\n",
        "tenants.inflight_max",
        2,
        "[tenants.overrides]",
    );
    assert_refused(
        "[tenants]\ninflight_max = 2\nready_max = 0\n",
        "tenants.ready_max",
        3,
        "at least 1",
    );
    assert_refused(
        "payload_bytes_max = 0\n",
        "payload_bytes_max",
        1,
        "at least 1",
    );
    assert_refused(
        "lease_ms_max = 1000\n",
        "lease_ms_max",
        1,
        "above lease_ms_max",
    );
    assert_refused("durability = \"fast\"\n", "durability", 1, "\"normal\"");
    assert_refused(
        "[retention]\ncleaner_batch = 0\n",
        "retention.cleaner_batch",
        2,
        "at least 1",
    );
    assert_refused(
        "[defaults]\nschemas = { 1 = \"a.json\" }\n",
        "defaults.schemas",
        2,
        "[types.NAME]",
    );
    let cfg = parse("durability = \"normal\"\n[tenants.overrides]\n\"acme.corp\" = 0\n").unwrap();
    assert_eq!(cfg.durability, Durability::Normal);
    assert_eq!(
        cfg.scheduler.tenant_inflight_max[&TenantId::new("acme.corp")],
        0
    );
}

#[test]
fn a_missing_schema_file_is_named_by_its_resolved_path() {
    let text = "[types.send_email]\nschemas = { 1 = \"schemas/send_email.v1.json\", 3 = \"schemas/nope.json\" }\n";
    let (dir, file) = config_dir(text);
    let e = ServerConfig::load(&file).unwrap_err();
    assert_eq!(e.key(), Some("types.send_email.schemas.3"), "{e}");
    assert_eq!(e.line(), Some(2), "{e}");
    let resolved = dir.path().join("schemas/nope.json");
    assert!(
        e.to_string().contains(&resolved.display().to_string()),
        "{e}"
    );
}

#[test]
fn a_schema_that_does_not_compile_is_refused_with_its_version() {
    let (dir, file) = config_dir(
        "[types.a]\nschemas = { 1 = \"schemas/send_email.v1.json\", 2 = \"schemas/bad.json\" }\n",
    );
    std::fs::write(dir.path().join("schemas/bad.json"), r#"{"type": 12}"#).unwrap();
    let e = ServerConfig::load(&file).unwrap_err();
    assert_eq!(e.key(), Some("types.a.schemas.2"), "{e}");
    assert!(e.to_string().contains("not a usable JSON Schema"), "{e}");
    std::fs::write(dir.path().join("schemas/bad.json"), "{").unwrap();
    let e = ServerConfig::load(&file).unwrap_err();
    assert!(e.to_string().contains("not valid JSON"), "{e}");
    assert_refused(
        "[types.a]\nschemas = { v1 = \"x.json\" }\n",
        "types.a.schemas.v1",
        2,
        "whole number",
    );
}
