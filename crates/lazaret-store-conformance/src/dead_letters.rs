//! Dead letters: admission records, paging and filters, grouping by reason.

use lazaret_core::{DeadLetterReason, Failure, FailureClass, Timestamp};
use lazaret_store::{
    AdmissionRecord, DeadLetterFilter, DeadLetterId, ReasonCount, Selector, Stage, Store,
};

use crate::Backend;

use super::{at, dead_letter_job, new_job, sha256_hex};

/// An admission record of `reason` for `job_type` (payload kept whole).
pub fn admission(
    job_type: Option<&str>,
    tenant: Option<&str>,
    reason: DeadLetterReason,
    now: Timestamp,
) -> AdmissionRecord {
    let payload = br#"{"width": "wide"}"#.to_vec();
    AdmissionRecord {
        job_type: job_type.map(str::to_owned),
        tenant: tenant.map(str::to_owned),
        lane: Some("default".into()),
        reason,
        message: "/width: \"wide\" is not of type \"integer\"".into(),
        payload_size: payload.len() as u64,
        payload_sha256: Some(sha256_hex(&payload)),
        payload_preview: String::from_utf8(payload.clone()).unwrap(),
        payload: Some(payload),
        idempotency_key: Some("adm-1".into()),
        now,
    }
}

pub async fn admission_records_are_listed_with_stage_admission<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let rec = admission(
        Some("resize"),
        Some("acme"),
        DeadLetterReason::SchemaInvalid,
        at(100),
    );
    let whole = s.record_admission(rec.clone()).await.unwrap();
    let dl = s.dead_letter(whole).await.unwrap().expect("recorded");
    assert_eq!(dl.id, whole);
    assert_eq!(dl.stage, Stage::Admission);
    assert_eq!(dl.job_id, None);
    assert_eq!(dl.reason, DeadLetterReason::SchemaInvalid);
    assert_eq!(dl.job_type.as_deref(), Some("resize"));
    assert_eq!(dl.tenant.as_deref(), Some("acme"));
    assert_eq!(dl.lane.as_deref(), Some("default"));
    assert_eq!(dl.attempts, 0);
    assert!(dl.history.is_empty());
    assert_eq!(dl.idempotency_key.as_deref(), Some("adm-1"));
    assert_eq!((dl.created_at, dl.dead_lettered_at), (at(100), at(100)));
    assert_eq!(dl.payload_size, rec.payload_size);
    assert_eq!(dl.payload_sha256, rec.payload_sha256);
    assert_eq!(dl.payload_preview, rec.payload_preview);
    assert_eq!(dl.redrive_count, 0);
    assert_eq!(
        dl.error,
        Some(
            Failure::new("schema_invalid", rec.message.clone()).with_class(FailureClass::Permanent)
        ),
        "an admission record's error: kind = the reason"
    );
    assert_eq!(
        s.dead_letter_payload(whole).await.unwrap(),
        Some(rec.payload.clone())
    );

    // Too large to read whole: no payload, no hash, nothing but a preview.
    let cut = s
        .record_admission(AdmissionRecord {
            job_type: None,
            tenant: None,
            lane: None,
            payload_size: 50_000_000,
            payload_sha256: None,
            payload_preview: "{\"blob\": \"AAAA".into(),
            payload: None,
            idempotency_key: None,
            ..admission(None, None, DeadLetterReason::PayloadTooLarge, at(200))
        })
        .await
        .unwrap();
    assert_eq!(s.dead_letter_payload(cut).await.unwrap(), Some(None));
    let dl = s.dead_letter(cut).await.unwrap().expect("recorded");
    assert_eq!((dl.job_type, dl.tenant, dl.lane), (None, None, None));
    assert_eq!(dl.payload_size, 50_000_000);

    let (page, next) = s
        .dead_letters(DeadLetterFilter::default(), 10, None)
        .await
        .unwrap();
    assert_eq!(
        page.iter().map(|d| (d.id, d.stage)).collect::<Vec<_>>(),
        vec![(cut, Stage::Admission), (whole, Stage::Admission)]
    );
    assert_eq!(next, None);
    assert_eq!(
        s.match_dead_letters(Selector::Filter(DeadLetterFilter::default()))
            .await
            .unwrap(),
        vec![(whole, Stage::Admission), (cut, Stage::Admission)]
    );

    let unknown = DeadLetterId(cut.0 + 1_000);
    assert!(s.dead_letter(unknown).await.unwrap().is_none());
    assert_eq!(s.dead_letter_payload(unknown).await.unwrap(), None);
}

pub async fn dead_letters_page_newest_first_with_cursor_and_filters<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let (_, d1) = dead_letter_job(&s, new_job("resize", "a", "default"), at(100)).await;
    let (_, d2) = dead_letter_job(&s, new_job("resize", "b", "bulk"), at(200)).await;
    let d3 = s
        .record_admission(admission(
            Some("resize"),
            Some("a"),
            DeadLetterReason::SchemaInvalid,
            at(300),
        ))
        .await
        .unwrap();
    let (_, d4) = dead_letter_job(&s, new_job("email", "a", "default"), at(400)).await;
    let d5 = s
        .record_admission(admission(
            None,
            None,
            DeadLetterReason::InvalidJson,
            at(500),
        ))
        .await
        .unwrap();

    // Every page, following the cursor.
    let pages = |filter: DeadLetterFilter, limit: u32| {
        let s = &s;
        async move {
            let mut pages = Vec::new();
            let mut cursor = None;
            loop {
                let (page, next) = s.dead_letters(filter.clone(), limit, cursor).await.unwrap();
                assert!(page.len() <= limit as usize);
                pages.push(page.iter().map(|d| d.id).collect::<Vec<_>>());
                match next {
                    Some(c) => cursor = Some(c),
                    None => return pages,
                }
                assert!(pages.len() < 10, "the cursor must make progress");
            }
        }
    };
    let all = DeadLetterFilter::default();
    assert_eq!(
        pages(all.clone(), 2).await,
        vec![vec![d5, d4], vec![d3, d2], vec![d1]]
    );
    assert_eq!(pages(all.clone(), 5).await, vec![vec![d5, d4, d3, d2, d1]]);

    let by = |ty: Option<&str>, tenant: Option<&str>, lane: Option<&str>, reason: Option<&str>| {
        DeadLetterFilter {
            job_type: ty.map(str::to_owned),
            tenant: tenant.map(str::to_owned),
            lane: lane.map(str::to_owned),
            reason: reason.map(str::to_owned),
            ..DeadLetterFilter::default()
        }
    };
    let resize = by(Some("resize"), None, None, None);
    assert_eq!(pages(resize, 10).await, vec![vec![d3, d2, d1]]);
    assert_eq!(
        pages(by(None, Some("a"), None, None), 2).await,
        vec![vec![d4, d3], vec![d1]]
    );
    assert_eq!(
        pages(by(None, None, Some("bulk"), None), 10).await,
        vec![vec![d2]]
    );
    assert_eq!(
        pages(by(None, None, None, Some("schema_invalid")), 10).await,
        vec![vec![d3]]
    );
    assert_eq!(
        pages(by(None, Some("a"), None, Some("permanent")), 10).await,
        vec![vec![d4, d1]]
    );
    assert_eq!(
        pages(by(Some("nope"), None, None, None), 10).await,
        vec![Vec::new()]
    );

    let tenant_a = Selector::Filter(by(None, Some("a"), None, None));
    assert_eq!(
        s.match_dead_letters(tenant_a).await.unwrap(),
        vec![
            (d1, Stage::Processing),
            (d3, Stage::Admission),
            (d4, Stage::Processing)
        ],
        "oldest first"
    );
    let listed = Selector::Ids(vec![d5, d1, DeadLetterId(d5.0 + 1_000)]);
    assert_eq!(
        s.match_dead_letters(listed).await.unwrap(),
        vec![(d1, Stage::Processing), (d5, Stage::Admission)],
        "unknown ids are left out"
    );
}

pub async fn reasons_group_by_reason_and_type<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    dead_letter_job(&s, new_job("resize", "a", "default"), at(100)).await;
    dead_letter_job(&s, new_job("resize", "b", "default"), at(200)).await;
    dead_letter_job(&s, new_job("email", "a", "default"), at(300)).await;
    for (ty, reason, now) in [
        (Some("resize"), DeadLetterReason::SchemaInvalid, 400),
        (None, DeadLetterReason::InvalidJson, 500),
        (None, DeadLetterReason::InvalidJson, 600),
    ] {
        s.record_admission(admission(ty, None, reason, at(now)))
            .await
            .unwrap();
    }

    let mut got = s.reasons().await.unwrap();
    got.sort_by(|a, b| (a.reason, &a.job_type).cmp(&(b.reason, &b.job_type)));
    let group = |reason, ty: Option<&str>, count, first, last| ReasonCount {
        reason,
        job_type: ty.map(str::to_owned),
        count,
        first_at: at(first),
        last_at: at(last),
    };
    assert_eq!(
        got,
        vec![
            group(DeadLetterReason::Permanent, Some("email"), 1, 300, 300),
            group(DeadLetterReason::Permanent, Some("resize"), 2, 100, 200),
            group(DeadLetterReason::InvalidJson, None, 2, 500, 600),
            group(DeadLetterReason::SchemaInvalid, Some("resize"), 1, 400, 400),
        ]
    );
}

pub async fn dead_letters_after_an_id_are_read_lowest_first_with_their_failure<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    assert!(
        s.dead_letters_after(DeadLetterId(0), 10)
            .await
            .unwrap()
            .is_empty()
    );
    let (_, first) = dead_letter_job(&s, new_job("resize", "a", "default"), at(100)).await;
    let admitted = s
        .record_admission(admission(
            None,
            None,
            DeadLetterReason::InvalidJson,
            at(200),
        ))
        .await
        .unwrap();
    let (_, third) = dead_letter_job(&s, new_job("email", "b", "default"), at(300)).await;

    let all = s.dead_letters_after(DeadLetterId(0), 10).await.unwrap();
    let ids: Vec<DeadLetterId> = all.iter().map(|d| d.id).collect();
    assert_eq!(ids, vec![first, admitted, third], "lowest id first");
    let d = &all[0];
    assert_eq!(
        (
            d.at,
            d.job_type.as_deref(),
            d.reason,
            d.kind.as_deref(),
            d.message.as_str()
        ),
        (
            at(100),
            Some("resize"),
            DeadLetterReason::Permanent,
            Some("bad_input"),
            "the image is not a PNG"
        )
    );
    assert_eq!(
        (
            all[1].job_type.as_deref(),
            all[1].reason,
            all[1].kind.as_deref()
        ),
        (None, DeadLetterReason::InvalidJson, Some("invalid_json")),
        "an admission record's kind is its reason"
    );
    let after_first = s.dead_letters_after(first, 1).await.unwrap();
    assert_eq!(
        after_first.iter().map(|d| d.id).collect::<Vec<_>>(),
        vec![admitted],
        "above the id given, at most the limit"
    );
    assert!(s.dead_letters_after(third, 10).await.unwrap().is_empty());
}
