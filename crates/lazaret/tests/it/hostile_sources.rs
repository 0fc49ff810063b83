//! Hostile values around `[[sources]]`, through the real binary (issue
//! #32): credentials in broker and `deliver` URLs never reach the output or
//! a dead letter, and names in the config follow the API's name rule,
//! refused naming file, line and key.
//!
//! The credentials test needs Redis (`LAZARET_TEST_REDIS_URL`) and uses
//! NATS and RabbitMQ when their URLs are set; without Redis it is skipped
//! with a message, and fails under `CI=true`.

use std::time::{Duration, Instant};

use lazaret_testkit::eventually;

use crate::harness::{EVENTUALLY, QUICK, Server, serve_refused};
use crate::team_handler::service;

/// Credentials written into the config: none may be printed or stored.
const SECRETS: [&str; 5] = [
    "deliveruser",
    "DeliverSecret9",
    "NatsToken7Secret",
    "rabbituser",
    "RabbitSecret3",
];

/// `host:port` of a URL like `scheme://host:port/…`.
fn authority(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    rest.split(['/', '?']).next().unwrap_or(rest)
}

/// Finding 14: the whole user info of every URL is masked — a NATS token,
/// an AMQP user and password, the `deliver` URL's credentials — at start,
/// in connect errors, and in the dead letter of a delivery refused by the
/// handler's host (reqwest quotes the URL it was given).
#[tokio::test]
async fn credentials_in_urls_reach_neither_the_output_nor_a_dead_letter() {
    let test = "credentials_in_urls_reach_neither_the_output_nor_a_dead_letter";
    let Some(redis_url) = service("LAZARET_TEST_REDIS_URL", "redis://127.0.0.1:6379", test) else {
        return;
    };
    let nats =
        std::env::var("LAZARET_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let amqp = std::env::var("LAZARET_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let stream = format!("lz-creds-{}", std::process::id());
    let config = format!(
        r#"{QUICK}
[[sources]]
name = "orders"
broker = "redis"
url = "{redis_url}"
queue = "{stream}"
deliver = "http://deliveruser:DeliverSecret9@127.0.0.1:1/orders"
delivery_timeout_ms = 2000

[[sources]]
name = "nats-dlq"
broker = "nats"
url = "nats://NatsToken7Secret@{nats_host}"
queue = "lz-creds-missing-{pid}"
mode = "watch"

[[sources]]
name = "rabbit-orders"
broker = "rabbitmq"
url = "amqp://rabbituser:RabbitSecret3@{amqp_host}/%2f"
queue = "lz-creds-missing-{pid}"
deliver = "http://127.0.0.1:1/orders"
"#,
        nats_host = authority(&nats),
        amqp_host = authority(&amqp),
        pid = std::process::id(),
    );
    let server = Server::start(&config).await;
    server
        .wait_output("source nats-dlq: watch nats nats://***@")
        .await;
    server
        .wait_output("source rabbit-orders: guard rabbitmq amqp://***@")
        .await;

    let client = redis::Client::open(redis_url.as_str()).expect("a valid Redis URL");
    let mut con = client
        .get_multiplexed_async_connection()
        .await
        .expect("Redis answers");
    let _: String = redis::cmd("XADD")
        .arg(&stream)
        .arg("*")
        .arg("body")
        .arg("{}")
        .arg("message_id")
        .arg("m-creds")
        .query_async(&mut con)
        .await
        .expect("XADD");

    // The handler's host refuses every attempt: exhausted, quoting the URL.
    let api = server.api();
    let deadline = Instant::now() + EVENTUALLY;
    let dead = loop {
        let r = api.get("/v1/dead-letters?source=orders").await;
        let text = r.text();
        if text.contains("m-creds") {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "no dead letter within {EVENTUALLY:?}:\n{}",
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _: i64 = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut con)
        .await
        .unwrap_or(0);
    assert!(
        dead.contains("http://***@127.0.0.1:1/orders"),
        "the error names the handler, masked: {dead}"
    );
    // Connect attempts to RabbitMQ with the wrong user are logged too:
    // wait for one.
    eventually("a refused RabbitMQ connect logged", || async {
        server.output().lines().any(|l| {
            l.contains("cannot reach the rabbitmq broker") && l.contains("source=rabbit-orders")
        })
    })
    .await;
    let output = server.output();
    for secret in SECRETS {
        assert!(
            !dead.contains(secret),
            "{secret} is in the dead letter: {dead}"
        );
        assert!(
            !output.contains(secret),
            "{secret} is in the output:\n{output}"
        );
    }
}

/// Finding 11: names the config gives — `[types]` and `[lanes]` keys, a
/// source's `type`, `tenant` and `lane` — follow the API's rule (at most
/// 128 bytes, no control characters), refused naming file, line and key.
#[tokio::test]
async fn config_names_follow_the_name_rule_naming_file_line_and_key() {
    let long = "n".repeat(129);
    let source = |extra: &str| {
        format!(
            "\n[[sources]]\nname = \"orders\"\nbroker = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\nqueue = \"orders\"\ndeliver = \"http://127.0.0.1:9/orders\"\n{extra}"
        )
    };
    let cases = [
        (
            "[types.\"send\\nmail\"]\nattempts_max = 3\n".to_owned(),
            "types.\"send\\nmail\"",
            1,
            "control character",
        ),
        (
            format!("[lanes.{long}]\nweight = 2\n"),
            &*format!("lanes.{long}"),
            1,
            "129 bytes",
        ),
        (
            source("type = \"orders\\u0000x\"\n"),
            "sources[0].type",
            8,
            "control character",
        ),
        (
            source(&format!("tenant = \"{long}\"\n")),
            "sources[0].tenant",
            8,
            "at most 128 bytes",
        ),
        (
            source("lane = \"a\\tb\"\n"),
            "sources[0].lane",
            8,
            "control character",
        ),
    ];
    for (config, key, line, words) in cases {
        let (status, printed) = serve_refused(&config, "127.0.0.1:0").await;
        assert!(
            !status.success(),
            "started with:\n{config}\nprinted:\n{printed}"
        );
        assert!(
            printed.contains(&format!("lazaret.toml:{line}: {key}: ")),
            "names file, line {line} and {key}:\n{printed}"
        );
        assert!(printed.contains(words), "says {words:?}:\n{printed}");
        assert!(
            !printed.contains("lazaret listening on"),
            "refused before listening:\n{printed}"
        );
    }
}
