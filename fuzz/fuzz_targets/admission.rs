//! `admit`: the door every job passes (payload cap, type, tenant, JSON,
//! schema version, schema).
//!
//! Input, one field a line: job type, tenant, `schema_version` (a number,
//! else none), `payload_bytes_max`, flags (`u`: accept unknown types, `s`:
//! the type is shedding), the announced size (a number, else none), then
//! the payload's bytes to the end. The configured type is `send_email` with
//! the two schemas of docs/api.md.
//!
//! Properties: never a panic; the same verdict twice; nothing over the cap
//! (what arrived or what was announced) is admitted, and over the cap is
//! always `POISON payload_too_large`; an admitted job has a type and a
//! tenant that are not blank, a payload that is JSON, and for `send_email`
//! a version it has and an object with the fields that version requires;
//! every refusal says why.
#![no_main]

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Duration;

use lazaret_core::{
    admit, AdmissionConfig, AdmissionRequest, JobType, PoisonReason, TypeSchemas, Verdict,
};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

fn schemas() -> &'static TypeSchemas {
    static S: OnceLock<TypeSchemas> = OnceLock::new();
    S.get_or_init(|| {
        let v1 = json!({"type": "object", "required": ["to"],
                        "properties": {"to": {"type": "string"}}});
        let v2 = json!({"type": "object", "required": ["to", "subject"],
                        "properties": {"to": {"type": "string"}, "subject": {"type": "string"}}});
        TypeSchemas::compile(
            &JobType::new("send_email"),
            BTreeMap::from([(1, v1), (2, v2)]),
        )
        .expect("the docs' schemas compile")
    })
}

fn line<'a>(rest: &mut &'a [u8]) -> &'a [u8] {
    match rest.iter().position(|&b| b == b'\n') {
        Some(i) => {
            let l = &rest[..i];
            *rest = &rest[i + 1..];
            l
        }
        None => std::mem::take(rest),
    }
}

fn number<T: std::str::FromStr>(b: &[u8]) -> Option<T> {
    std::str::from_utf8(b).ok()?.trim().parse().ok()
}

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    let job_type = String::from_utf8_lossy(line(&mut rest)).into_owned();
    let tenant = String::from_utf8_lossy(line(&mut rest)).into_owned();
    let schema_version: Option<u32> = number(line(&mut rest));
    // A small cap, so that the fuzzer reaches it.
    let cap = number::<usize>(line(&mut rest)).map_or(1024, |c| c % 8192);
    let flags = line(&mut rest);
    let declared_size: Option<u64> = number(line(&mut rest));
    let payload = rest;

    let mut config = AdmissionConfig {
        payload_bytes_max: cap,
        accept_unknown_types: flags.contains(&b'u'),
        types: BTreeMap::new(),
    };
    config
        .types
        .insert(JobType::new("send_email"), schemas().clone());
    let req = AdmissionRequest {
        job_type: Some(job_type.as_str()).filter(|t| !t.is_empty() || flags.contains(&b'e')),
        tenant: Some(tenant.as_str()).filter(|t| !t.is_empty() || flags.contains(&b'e')),
        schema_version,
        payload,
        declared_size,
        shed: flags.contains(&b's').then(|| Duration::from_millis(1500)),
    };
    let verdict = admit(&config, &req);
    assert_eq!(verdict, admit(&config, &req), "admit is deterministic");

    let size = (payload.len() as u64).max(declared_size.unwrap_or(0));
    if size > cap as u64 {
        assert_eq!(
            verdict.poison_reason(),
            Some(PoisonReason::PayloadTooLarge),
            "{size} bytes over a cap of {cap}: {verdict:?}"
        );
    }
    match &verdict {
        Verdict::Admitted { schema_version: v } => {
            assert!(
                size <= cap as u64,
                "admitted {size} bytes over a cap of {cap}"
            );
            assert!(!job_type.trim().is_empty() && !tenant.trim().is_empty());
            assert!(req.shed.is_none(), "admitted while shedding");
            let parsed: Value =
                serde_json::from_slice(payload).expect("an admitted payload is JSON");
            if job_type == "send_email" {
                let v = v.expect("a type with schemas admits against a version");
                assert!(v == 1 || v == 2, "version {v} is not one send_email has");
                assert!(schema_version.is_none_or(|asked| asked == v));
                assert!(parsed["to"].is_string(), "v{v} requires `to`: {parsed}");
                if v == 2 {
                    assert!(
                        parsed["subject"].is_string(),
                        "v2 requires `subject`: {parsed}"
                    );
                }
            } else {
                assert!(config.accept_unknown_types, "an unknown type admitted");
                assert_eq!(*v, schema_version);
            }
        }
        refused => {
            let m = refused.message().expect("a refusal has a message");
            assert!(!m.trim().is_empty(), "an empty message: {refused:?}");
        }
    }
});
