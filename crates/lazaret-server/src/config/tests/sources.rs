//! `[[sources]]`.

use super::*;

const GUARD: &str = "[[sources]]\nname = \"orders\"\nbroker = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\nqueue = \"orders\"\n";

#[test]
fn a_source_gets_the_contracts_defaults() {
    let cfg = parse(&format!("{GUARD}deliver = \"http://127.0.0.1:9/h\"\n")).unwrap();
    let s = &cfg.sources[0];
    assert_eq!(s.name, "orders");
    assert_eq!(s.broker, BrokerKind::Redis);
    assert_eq!(s.url, "redis://127.0.0.1:6379");
    assert_eq!(s.queue, "orders");
    assert_eq!(s.group, "lazaret");
    assert_eq!(s.mode, Mode::Guard);
    assert_eq!(s.job_type.as_str(), "orders");
    assert_eq!(s.lane.as_str(), "default");
    assert_eq!(s.tenant, TenantFrom::Fixed("default".into()));
    assert_eq!(s.concurrency, 16);
    assert_eq!(s.settling, None);
    assert_eq!(s.settling_max(), 240, "15 settling per handler slot");
    assert_eq!(
        s.unsettled_max(),
        256,
        "RabbitMQ's prefetch: 16 × concurrency"
    );
    assert_eq!(s.delivery_timeout, Duration::from_secs(30));
    assert_eq!(s.redrive_to, None);
    assert!(parse("").unwrap().sources.is_empty());
    let cfg = parse(&format!(
        "{GUARD}deliver = \"http://127.0.0.1:9/h\"\nconcurrency = 4\n"
    ))
    .unwrap();
    assert_eq!(
        cfg.sources[0].settling_max(),
        60,
        "the settling allowance follows concurrency"
    );
}

#[test]
fn every_source_key_is_read() {
    let cfg = parse(
        "[[sources]]\nname = \"a.b-c_1\"\nbroker = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\n\
         queue = \"ORDERS\"\ngroup = \"g\"\nmode = \"guard\"\ndeliver = \"https://h/x\"\n\
         type = \"t\"\ntenant = \"acme\"\nlane = \"batch\"\nconcurrency = 3\nsettling = 0\n\
         delivery_timeout_ms = 1500\nredrive_to = \"ORDERS.retry\"\ndeliver_format = \"envelope\"\n",
    )
    .unwrap();
    let s = &cfg.sources[0];
    assert_eq!(s.deliver_format, DeliverFormat::Envelope);
    assert_eq!(s.broker, BrokerKind::Nats);
    assert_eq!(s.group, "g");
    assert_eq!(s.job_type.as_str(), "t");
    assert_eq!(s.tenant, TenantFrom::Fixed("acme".into()));
    assert_eq!(s.lane.as_str(), "batch");
    assert_eq!(s.concurrency, 3);
    assert_eq!(s.settling, Some(0));
    assert_eq!(s.settling_max(), 0);
    assert_eq!(s.delivery_timeout, ms(1500));
    assert_eq!(s.redrive_to.as_deref(), Some("ORDERS.retry"));
}

#[test]
fn a_guard_needs_somewhere_to_deliver_and_a_watch_has_none() {
    assert_refused(
        GUARD,
        "sources[0].deliver",
        1,
        "a guard source needs deliver",
    );
    assert_refused(
        &format!("{GUARD}deliver = \"127.0.0.1:8080\"\n"),
        "sources[0].deliver",
        6,
        "not an http:// or https:// URL",
    );
    assert_refused(
        &format!("{GUARD}mode = \"watch\"\ndeliver = \"http://h/\"\n"),
        "sources[0].deliver",
        7,
        "a watch source delivers nothing",
    );
    let cfg = parse(&format!("{GUARD}mode = \"watch\"\n")).unwrap();
    assert_eq!(cfg.sources[0].mode, Mode::Watch);
    assert_refused(
        &format!("{GUARD}mode = \"tail\"\n"),
        "sources[0].mode",
        6,
        "\"guard\"",
    );
}

#[test]
fn source_names_are_unique_and_header_safe() {
    let twice = format!("{GUARD}deliver = \"http://h/\"\n{GUARD}deliver = \"http://h/\"\n");
    let e = assert_refused(
        &twice,
        "sources[1].name",
        8,
        "already used by sources[0] (line 2)",
    );
    assert!(e.to_string().contains("`orders`"), "{e}");
    assert_refused(
        "[[sources]]\nname = \"ordres été\"\n",
        "sources[0].name",
        2,
        "ASCII letters",
    );
    assert_refused(
        "[[sources]]\nbroker = \"redis\"\n",
        "sources[0].name",
        1,
        "every source needs name",
    );
    assert_refused(
        "[[sources]]\nname = \" \"\n",
        "sources[0].name",
        2,
        "name is empty",
    );
}

#[test]
fn a_guard_and_a_watch_on_one_queue_are_refused_naming_both() {
    // The same broker, written with other credentials and a trailing slash.
    let text = format!(
        "{GUARD}deliver = \"http://h/\"\n[[sources]]\nname = \"orders-dlq\"\nbroker = \"redis\"\n\
         url = \"redis://user:pw@127.0.0.1:6379/\"\nqueue = \"orders\"\nmode = \"watch\"\n"
    );
    let e = assert_refused(&text, "sources[1].queue", 11, "(line 5)");
    let why = e.to_string();
    assert!(
        why.contains("`orders` (guard)") && why.contains("`orders-dlq` (watch)"),
        "{why}"
    );
    // Its dead-letter queue is fine, and the guard's queue is a redrive
    // target the watch may use.
    let ok = text.replace("queue = \"orders\"\nmode", "queue = \"orders.dlq\"\nmode");
    let cfg = parse(&ok).unwrap();
    assert_eq!(cfg.sources[1].redrive_allow, vec!["orders".to_owned()]);
    let listed = format!("{ok}redrive_allow = [\"orders.v2\"]\n");
    assert_eq!(
        parse(&listed).unwrap().sources[1].redrive_allow,
        vec!["orders.v2".to_owned(), "orders".to_owned()]
    );
    assert_refused(
        &format!("{GUARD}deliver = \"http://h/\"\nredrive_allow = [\"x\"]\n"),
        "sources[0].redrive_allow",
        7,
        "for watch sources",
    );
}

#[test]
fn a_kafka_source_is_a_topic_a_group_and_host_port() {
    let cfg = parse(
        "[[sources]]\nname = \"orders\"\nbroker = \"kafka\"\nurl = \"127.0.0.1:9092\"\n\
         queue = \"orders\"\ngroup = \"shop\"\ndeliver = \"http://127.0.0.1:9/h\"\n",
    )
    .unwrap();
    let s = &cfg.sources[0];
    assert_eq!(s.broker, BrokerKind::Kafka);
    assert_eq!(
        (s.url.as_str(), s.queue.as_str(), s.group.as_str()),
        ("127.0.0.1:9092", "orders", "shop")
    );
    assert_refused(
        &GUARD.replace("\"redis\"", "\"kafka\""),
        "sources[0].url",
        4,
        "this is a redis URL but broker = \"kafka\"",
    );
}

#[test]
fn an_unknown_broker_is_refused() {
    assert_refused(
        &GUARD.replace("\"redis\"", "\"kinesis\""),
        "sources[0].broker",
        3,
        "unknown broker \"kinesis\"",
    );
}

#[test]
fn an_sqs_source_takes_an_endpoint_url_and_a_queue_url() {
    let cfg = parse(
        "[[sources]]\nname = \"orders\"\nbroker = \"sqs\"\nurl = \"http://127.0.0.1:4566\"\nqueue = \"http://127.0.0.1:4566/000000000000/orders.fifo\"\nmode = \"watch\"\n",
    )
    .unwrap();
    let s = &cfg.sources[0];
    assert_eq!(s.broker, BrokerKind::Sqs);
    assert_eq!(s.url, "http://127.0.0.1:4566");
    assert_eq!(s.queue, "http://127.0.0.1:4566/000000000000/orders.fifo");
}

#[test]
fn an_sqs_source_sets_its_receives_in_flight() {
    let base = "[[sources]]\nname = \"orders\"\nbroker = \"sqs\"\nurl = \"http://127.0.0.1:4566\"\nqueue = \"orders\"\ndeliver = \"http://h/\"\n";
    let cfg = parse(base).unwrap();
    assert_eq!(cfg.sources[0].receives_in_flight, 2, "the default");
    let cfg = parse(&format!("{base}receives_in_flight = 4\n")).unwrap();
    assert_eq!(cfg.sources[0].receives_in_flight, 4);
    assert_refused(
        &format!("{base}receives_in_flight = 0\n"),
        "sources[0].receives_in_flight",
        7,
        "at least 1",
    );
}

#[test]
fn an_unknown_source_key_is_refused_where_it_is() {
    let e = assert_refused(
        &format!("{GUARD}deliver = \"http://h/\"\ndelivr = \"http://h/\"\n"),
        "sources[0].delivr",
        7,
        "unknown field `delivr`",
    );
    assert!(e.to_string().contains("fix its spelling"), "{e}");
    let (_dir, file) = config_dir(&format!("{GUARD}deliver = \"http://h/\"\nretries = 3\n"));
    let e = ServerConfig::load(&file).unwrap_err();
    assert!(
        e.to_string()
            .starts_with(&format!("{}:7: sources[0].retries: ", file.display())),
        "{e}"
    );
}

#[test]
fn other_source_mistakes_are_refused_with_their_key() {
    let base = format!("{GUARD}deliver = \"http://h/\"\n");
    assert_refused(
        &format!("{base}tenant = \"a\"\ntenant_header = \"x-tenant\"\n"),
        "sources[0].tenant_header",
        8,
        "not both",
    );
    assert_refused(
        &format!("{base}concurrency = 0\n"),
        "sources[0].concurrency",
        7,
        "at least 1",
    );
    assert_refused(
        &format!("{base}delivery_timeout_ms = 0\n"),
        "sources[0].delivery_timeout_ms",
        7,
        "at least 1",
    );
    assert_refused(
        &format!("{base}delivery_timeout_ms = \"five seconds\"\n"),
        "sources[0].delivery_timeout_ms",
        7,
        "is not a duration",
    );
    let (_dir, file) = config_dir(&format!("{base}delivery_timeout_ms = \"5s\"\n"));
    let cfg = ServerConfig::load(&file).unwrap();
    assert_eq!(cfg.sources[0].delivery_timeout, Duration::from_secs(5));
    assert_refused(
        &GUARD.replace("redis://127.0.0.1:6379", "amqp://guest:guest@h/%2f"),
        "sources[0].url",
        4,
        "a rabbitmq URL but broker = \"redis\"",
    );
    assert_refused(
        "[[sources]]\nname = \"a\"\nbroker = \"redis\"\nurl = \"redis://h\"\n",
        "sources[0].queue",
        1,
        "every source needs queue",
    );
    assert_refused(
        &format!("{base}lane = \"\"\n"),
        "sources[0].lane",
        7,
        "lane is empty",
    );
    assert_refused(
        &format!("{base}deliver_format = \"json\"\n"),
        "sources[0].deliver_format",
        7,
        "unknown deliver_format \"json\"",
    );
    assert_refused(
        &format!(
            "{base}tenant_header = \"x-tenant\"\ntype = \"{}\"\n",
            "t".repeat(129)
        ),
        "sources[0].type",
        8,
        "the job type name is 129 bytes",
    );
    assert_refused(
        "[tenants.overrides]\n\"a\\u0007b\" = 2\n",
        "tenants.overrides.\"a\\u{7}b\"",
        2,
        "control character",
    );
}
