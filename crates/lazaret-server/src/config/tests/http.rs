//! `[http]`.

use super::*;

#[test]
fn the_http_table_sets_timeouts_cap_and_grace_and_refuses_zero_timeouts() {
    let d = parse("").unwrap().http;
    assert_eq!(d, HttpConfig::default());
    assert_eq!(d.connections_max, None);
    let c = parse(
        "[http]\nheader_read_timeout_ms = 5\nbody_read_timeout_ms = 6\nidle_timeout_ms = 7\n\
         connections_max = 8\nshutdown_grace_ms = 0\n",
    )
    .unwrap()
    .http;
    assert_eq!(
        c,
        HttpConfig {
            header_read_timeout: ms(5),
            body_read_timeout: ms(6),
            idle_timeout: ms(7),
            connections_max: Some(8),
            shutdown_grace: ms(0),
        }
    );
    assert_eq!(
        parse("[http]\nconnections_max = 0\n")
            .unwrap()
            .http
            .connections_max,
        None
    );
    let e = parse("[http]\nidle_timeout_ms = 0\n").unwrap_err();
    assert!(e.to_string().contains("http.idle_timeout_ms"), "{e}");
    let e = parse("[http]\nidle_timeout = 5\n").unwrap_err();
    assert!(e.to_string().contains("idle_timeout"), "{e}");
}

#[test]
fn allowed_hosts_are_host_names_with_or_without_a_port() {
    assert!(parse("").unwrap().allowed_hosts.is_empty());
    let c = parse("[http]\nallowed_hosts = [\"Lazaret.Example.com\", \"proxy:8443\", \"[::1]:9\", \"10.0.0.5\"]\n")
        .unwrap();
    assert_eq!(
        c.allowed_hosts,
        ["lazaret.example.com", "proxy:8443", "[::1]:9", "10.0.0.5"]
    );
    for (bad, says) in [
        ("https://lazaret.example.com", "without a scheme"),
        ("lazaret.example.com/ui", "without a scheme"),
        ("*.example.com", "wildcard"),
        ("", "empty"),
        ("host:port", "not a host name"),
        ("a b", "not a host name"),
        ("[zz]", "IPv6"),
    ] {
        let e = parse(&format!("[http]\nallowed_hosts = [\"{bad}\"]\n")).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("http.allowed_hosts") && text.contains(says),
            "{bad:?}: {text}"
        );
    }
}
