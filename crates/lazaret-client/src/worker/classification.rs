//! The classification table shared with the Python and Node SDKs
//! (`clients/classification-cases.json`): each case's error is built as a
//! Rust handler would meet it (a returned `Failure`, a downstream reply, an
//! I/O error, tokio's `Elapsed`, a refused reqwest connection, a payload
//! serde refuses, a panic) and classified the way the worker does; the
//! class, kind and wait must be what the file says. Python's
//! `tests/test_classification.py` and Node's `test/classification.test.ts`
//! read the same file.

use std::path::Path;
use std::time::{Duration, SystemTime};

use lazaret_core::{JobType, WorkerId};
use serde_json::Value;

use super::{HANDBACK_DELAY_DEFAULT, hand_back_failure, no_handler_failure, panics};
use crate::failure::{Class, Failure, parse_retry_after};

fn cases() -> Vec<Value> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../clients/classification-cases.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let doc: Value = serde_json::from_str(&text).expect("the cases file is JSON");
    doc["cases"].as_array().expect("a cases array").clone()
}

fn class_of(v: &Value) -> Class {
    let retry_after = v["retry_after_ms"].as_u64().map(Duration::from_millis);
    match v["class"].as_str() {
        None => Class::ByKind,
        Some("transient") => Class::Transient,
        Some("permanent") => Class::Permanent,
        Some("deferred") => Class::Deferred { retry_after },
        Some(other) => panic!("unknown class in the cases file: {other}"),
    }
}

fn io_kind(name: &str) -> std::io::ErrorKind {
    use std::io::ErrorKind::*;
    match name {
        "timed_out" => TimedOut,
        "connection_reset" => ConnectionReset,
        "connection_refused" => ConnectionRefused,
        "broken_pipe" => BrokenPipe,
        "not_found" => NotFound,
        "permission_denied" => PermissionDenied,
        other => panic!("unknown io kind in the cases file: {other}"),
    }
}

#[derive(Debug, serde::Deserialize)]
struct Email {
    #[allow(dead_code)]
    to: String,
}

async fn classify(what: &str, arg: &Value) -> Option<Failure> {
    match what {
        "failure" => {
            let f = Failure::new(
                class_of(arg),
                arg["kind"].as_str().unwrap(),
                arg["message"].as_str().unwrap(),
            );
            panics::run_caught(async move { Err(f) }).await.err()
        }
        "http_status" => {
            let status = arg["status"].as_u64().unwrap() as u16;
            let now = match arg["now"].as_str() {
                Some(d) => httpdate::parse_http_date(d).unwrap(),
                None => SystemTime::now(),
            };
            let wait = arg["retry_after"]
                .as_str()
                .and_then(|v| parse_retry_after(v, now));
            let direct = Failure::from_status(status, wait, "x");
            if arg["now"].is_null() {
                // The same through a reqwest::Response, as a handler gets it.
                let mut reply = axum::http::Response::builder().status(status);
                if let Some(v) = arg["retry_after"].as_str() {
                    reply = reply.header("retry-after", v);
                }
                let reply = reqwest::Response::from(reply.body(Vec::<u8>::new()).unwrap());
                let via = Failure::from_response(&reply);
                assert_eq!(
                    via.as_ref().map(|f| (f.class, f.kind.to_string())),
                    direct.as_ref().map(|f| (f.class, f.kind.to_string())),
                    "from_response agrees with from_status"
                );
            }
            direct
        }
        "io" => Some(Failure::from(std::io::Error::from(io_kind(
            arg.as_str().unwrap(),
        )))),
        "timeout" => {
            let elapsed = tokio::time::timeout(Duration::ZERO, std::future::pending::<()>())
                .await
                .unwrap_err();
            Some(Failure::from(elapsed))
        }
        "http_client_connect_refused" => {
            let port = {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                l.local_addr().unwrap().port()
            };
            let e = reqwest::Client::new()
                .get(format!("http://127.0.0.1:{port}/"))
                .send()
                .await
                .unwrap_err();
            Some(Failure::from(e))
        }
        "parse" => {
            let e = serde_json::from_str::<Email>(arg.as_str().unwrap()).unwrap_err();
            Some(Failure::parse(e))
        }
        "panic" => {
            let text = arg.as_str().unwrap().to_owned();
            panics::run_caught(async move { panic!("{text}") })
                .await
                .err()
        }
        "no_handler" => Some(no_handler_failure(
            &WorkerId::new("w-1"),
            &JobType::new(arg.as_str().unwrap()),
        )),
        "shutdown" => Some(hand_back_failure(
            HANDBACK_DELAY_DEFAULT,
            "the worker is shutting down",
        )),
        other => panic!("the cases file has a raise kind this test does not know: {other}"),
    }
}

#[tokio::test]
async fn every_shared_classification_case() {
    let cases = cases();
    assert!(cases.len() > 30, "the cases file holds the whole table");
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let (what, arg) = case["raise"].as_object().unwrap().iter().next().unwrap();
        let got = classify(what, arg).await;
        let want = &case["expect"];
        if want.is_null() {
            assert!(got.is_none(), "{name}: no failure expected, got {got:?}");
            continue;
        }
        let got = got.unwrap_or_else(|| panic!("{name}: a failure expected, got none"));
        assert_eq!(got.class, class_of(want), "{name}: class");
        assert_eq!(
            got.kind.as_str(),
            want["kind"].as_str().unwrap(),
            "{name}: kind"
        );
        let wire = serde_json::to_value(&got).unwrap();
        assert_eq!(wire["class"], want["class"], "{name}: class on the wire");
        assert_eq!(
            wire["retry_after_ms"], want["retry_after_ms"],
            "{name}: retry_after_ms"
        );
        if let Some(part) = want["message_contains"].as_str() {
            assert!(
                got.message.contains(part),
                "{name}: {:?} lacks {part:?}",
                got.message
            );
        }
        if want["traceback"].as_bool() == Some(true) {
            assert!(
                got.traceback.as_deref().is_some_and(|t| !t.is_empty()),
                "{name}: a traceback is sent"
            );
        }
    }
}
