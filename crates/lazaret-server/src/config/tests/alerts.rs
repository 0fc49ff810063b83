//! `[[alerts]]` and the top-level surge thresholds.

use super::*;

#[test]
fn alerts_load_the_contract_example_with_defaults_for_the_rest() {
    let cfg = parse(
        r#"
[[alerts]]
url = "http://127.0.0.1:9099/hook"
events = ["dead_letters_appeared", "poison_rate", "reason_surge",
      "breaker_opened", "breaker_closed", "dead_letters_over_warn"]
cooldown_ms = 300000
poison_rate_per_min = 10

[[alerts]]
url = "http://ops.internal:8080/lazaret"
events = ["reason_surge"]
surge_min = 5
surge_share = 0.9
"#,
    )
    .unwrap();
    assert_eq!(cfg.alerts.len(), 2);
    assert_eq!(cfg.alerts[0].url, "http://127.0.0.1:9099/hook");
    assert_eq!(cfg.alerts[0].rule, AlertRule::default());
    let second = &cfg.alerts[1].rule;
    assert_eq!(second.events, [AlertEvent::ReasonSurge].into());
    assert_eq!((second.surge_min, second.surge_share), (5, 0.9));
    assert_eq!(second.cooldown, Duration::from_secs(300));
    assert!(parse("").unwrap().alerts.is_empty());
}

#[test]
fn top_level_surge_thresholds_are_every_targets_default() {
    let cfg = parse(
        "surge_min = 7\nsurge_share = 0.9\n[[alerts]]\nurl = \"http://h/a\"\n[[alerts]]\nurl = \"http://h/b\"\nsurge_min = 3\n",
    )
    .unwrap();
    assert_eq!((cfg.surge_min, cfg.surge_share), (7, 0.9));
    assert_eq!(
        (cfg.alerts[0].rule.surge_min, cfg.alerts[0].rule.surge_share),
        (7, 0.9)
    );
    assert_eq!(
        (cfg.alerts[1].rule.surge_min, cfg.alerts[1].rule.surge_share),
        (3, 0.9)
    );
    assert_refused(
        "surge_share = 1.5\n",
        "surge_share",
        1,
        "above 0.5 up to 1.0",
    );
    assert_refused("surge_min = 0\n", "surge_min", 1, "surge_min is 0");
}

#[test]
fn alert_mistakes_are_named_with_their_key() {
    assert_refused(
        "[[alerts]]\nevents = [\"poison_rate\"]\n",
        "alerts[0].url",
        1,
        "every [[alerts]] entry needs url",
    );
    assert_refused(
        "[[alerts]]\nurl = \"https://hooks.example.com/x\"\n",
        "alerts[0].url",
        2,
        "https targets are not supported yet",
    );
    assert_refused(
        "[[alerts]]\nurl = \"127.0.0.1:9099\"\n",
        "alerts[0].url",
        2,
        "write it as http://HOST:PORT/PATH",
    );
    assert_refused(
        "[[alerts]]\nurl = \"http://h/\"\nevents = [\"poison_rate\", \"dlq_depth\"]\n",
        "alerts[0].events[1]",
        3,
        "unknown alert event `dlq_depth`: use dead_letters_appeared",
    );
    assert_refused(
        "[[alerts]]\nurl = \"http://h/\"\nevents = []\n",
        "alerts[0].events",
        3,
        "events is empty",
    );
    assert_refused(
        "[[alerts]]\nurl = \"http://h/\"\ncooldown_ms = 10\n",
        "alerts[0].cooldown_ms",
        3,
        "at least 1000",
    );
    assert_refused(
        "[[alerts]]\nurl = \"http://h/\"\nsurge_share = 0.4\n",
        "alerts[0].surge_share",
        3,
        "above 0.5 up to 1.0",
    );
    assert_refused(
        "[[alerts]]\nurl = \"http://h/\"\nsurge_min = 0\n",
        "alerts[0].surge_min",
        3,
        "surge_min is 0",
    );
    assert_refused(
        "[[alerts]]\nurl = \"http://h/\"\nwebhook = 1\n",
        "alerts[0].webhook",
        3,
        "unknown field `webhook`",
    );
}
