//! Broker messages: their dead letters and their held retries are unique
//! per (source, message id, payload SHA-256, redrive id); dead letters carry
//! the source, payload and history; held retries come due in order, are
//! replaced, dropped, and dropped with their quarantine; all of it survives
//! a restart.

use lazaret_core::{
    DeadLetterReason, Envelope, Failure, FailureClass, JobId, Timestamp, grant_lease,
};
use lazaret_store::{
    ClaimedRetry, DeadLetterFilter, Held, HeldRetry, MessageKey, Selector, SourceDeadLetter,
    SourceRef, Stage, Store,
};
use serde_json::json;

use super::at;
use crate::Backend;

fn source(name: &str, id: &str) -> SourceRef {
    SourceRef {
        name: name.into(),
        broker: "rabbitmq".into(),
        queue: "orders".into(),
        message_id: id.into(),
        headers: json!({"x-app": "shop", "bin": {"base64": "/wA="}})
            .as_object()
            .cloned()
            .unwrap_or_default(),
        position: json!({"exchange": "", "routing_key": "orders"}),
        content_type: Some("application/json".into()),
        redrive_id: None,
    }
}

/// The body [`quarantined`] gives its dead letters and [`retry_of`] its held
/// retries.
const BODY: &[u8] = b"\xff binary \x00 body";

/// The key of a message of `name` and `id` with [`BODY`].
fn key(name: &str, id: &str) -> MessageKey {
    MessageKey::of(name, id, BODY, None)
}

fn envelope(ms: i64, attempts: u32) -> Envelope {
    let mut env = Envelope::new(
        JobId(0),
        "orders".into(),
        "acme".into(),
        "default".into(),
        b"{\"order\": 1}",
        at(ms),
    );
    for _ in 0..attempts {
        grant_lease(&mut env, None, at(ms));
    }
    env
}

pub(crate) fn quarantined(name: &str, id: &str, stage: Stage, ms: i64) -> SourceDeadLetter {
    SourceDeadLetter {
        source: source(name, id),
        job_type: Some("orders".into()),
        tenant: Some("acme".into()),
        lane: Some("default".into()),
        reason: if stage == Stage::Broker {
            DeadLetterReason::DeliveryLimit
        } else {
            DeadLetterReason::Exhausted
        },
        stage,
        attempts: 2,
        error: Some(Failure::new("http_503", "down").with_class(FailureClass::Transient)),
        envelope: Some(envelope(ms, 2)),
        idempotency_key: Some(format!("{name}:{id}")),
        created_at: at(ms),
        now: at(ms + 5),
        payload: BODY.to_vec(),
        may_be_held: true,
    }
}

fn retry_of(name: &str, id: &str, due: Timestamp) -> HeldRetry {
    HeldRetry {
        source: source(name, id),
        due_at: due,
        envelope: envelope(0, 1),
        body: BODY.to_vec(),
    }
}

pub async fn a_broker_message_is_quarantined_once_with_its_source_and_payload<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let first = s
        .quarantine_message(quarantined("orders-src", "m-1", Stage::Processing, 0))
        .await
        .expect("quarantine");
    assert!(first.created);
    let again = s
        .quarantine_message(quarantined("orders-src", "m-1", Stage::Processing, 100))
        .await
        .expect("quarantine again");
    assert_eq!((again.id, again.created), (first.id, false));
    // The same id from another source is another message.
    let other = s
        .quarantine_message(quarantined("other-src", "m-1", Stage::Broker, 0))
        .await
        .expect("quarantine");
    assert!(other.created);
    assert_ne!(other.id, first.id);

    let dl = s
        .dead_letter(first.id)
        .await
        .unwrap()
        .expect("the dead letter");
    assert_eq!(dl.job_id, None);
    assert_eq!(dl.stage, Stage::Processing);
    assert_eq!(dl.reason, DeadLetterReason::Exhausted);
    assert_eq!(dl.attempts, 2);
    assert_eq!(dl.history.len(), 2, "the envelope's history is kept");
    assert_eq!(dl.source, Some(source("orders-src", "m-1")));
    assert_eq!(dl.payload_size, 15);
    assert_eq!(
        s.dead_letter_payload(first.id).await.unwrap(),
        Some(Some(b"\xff binary \x00 body".to_vec()))
    );
    assert_eq!(
        s.message_held(key("orders-src", "m-1")).await.unwrap(),
        Held::Quarantined(first.id)
    );
    assert_eq!(
        s.message_held(key("orders-src", "m-2")).await.unwrap(),
        Held::Nothing
    );

    let by = |f: DeadLetterFilter| async { s.dead_letters(f, 10, None).await.unwrap().0 };
    let of_source = by(DeadLetterFilter {
        source: Some("other-src".into()),
        ..DeadLetterFilter::default()
    })
    .await;
    assert_eq!(
        of_source.iter().map(|d| d.id).collect::<Vec<_>>(),
        vec![other.id]
    );
    let broker_stage = by(DeadLetterFilter {
        stage: Some("broker".into()),
        ..DeadLetterFilter::default()
    })
    .await;
    assert_eq!(
        broker_stage.iter().map(|d| d.id).collect::<Vec<_>>(),
        vec![other.id]
    );
    assert_eq!(
        s.match_dead_letters(Selector::Filter(DeadLetterFilter {
            source: Some("orders-src".into()),
            ..DeadLetterFilter::default()
        }))
        .await
        .unwrap(),
        vec![(first.id, Stage::Processing)]
    );
    assert_eq!(
        s.match_dead_letters(Selector::Ids(vec![other.id]))
            .await
            .unwrap(),
        vec![(other.id, Stage::Broker)]
    );
    // Purged, the same message may be quarantined anew (after a redrive).
    assert_eq!(s.purge(vec![first.id], None).await.unwrap(), 1);
    let anew = s
        .quarantine_message(quarantined("orders-src", "m-1", Stage::Processing, 200))
        .await
        .unwrap();
    assert!(anew.created);
}

pub async fn a_batch_of_quarantines_answers_each_in_order<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    assert_eq!(s.quarantine_messages(Vec::new()).await.unwrap(), Vec::new());
    let before = s
        .quarantine_message(quarantined("orders-src", "m-2", Stage::Processing, 0))
        .await
        .unwrap();
    s.hold_retry(retry_of("orders-src", "m-3", at(1_000)))
        .await
        .unwrap();
    let batch = s
        .quarantine_messages(vec![
            quarantined("orders-src", "m-1", Stage::Processing, 10),
            quarantined("orders-src", "m-2", Stage::Processing, 10),
            quarantined("orders-src", "m-3", Stage::Processing, 10),
            // The same message twice in one batch: one dead letter.
            quarantined("orders-src", "m-1", Stage::Processing, 20),
        ])
        .await
        .expect("quarantine a batch");
    let got: Vec<(bool, bool)> = batch
        .iter()
        .map(|q| (q.created, q.id == before.id))
        .collect();
    assert_eq!(
        got,
        vec![(true, false), (false, true), (true, false), (false, false)],
        "each answer is the one its message would get alone: {batch:?}"
    );
    assert_eq!(batch[3].id, batch[0].id);
    assert_ne!(batch[2].id, batch[0].id);
    // The held retry of m-3 left with its quarantine, as for one message.
    assert_eq!(
        s.message_held(key("orders-src", "m-3")).await.unwrap(),
        Held::Quarantined(batch[2].id)
    );
    assert!(
        s.due_held_retries("orders-src".into(), at(10_000), 10)
            .await
            .unwrap()
            .is_empty()
    );
}

pub async fn held_retries_come_due_in_order_and_are_replaced_or_dropped<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    s.hold_retry(retry_of("src", "late", at(3_000)))
        .await
        .unwrap();
    s.hold_retry(retry_of("src", "early", at(1_000)))
        .await
        .unwrap();
    s.hold_retry(retry_of("other", "x", at(0))).await.unwrap();
    assert_eq!(
        s.message_held(key("src", "early")).await.unwrap(),
        Held::Retry
    );
    assert!(
        s.due_held_retries("src".into(), at(999), 10)
            .await
            .unwrap()
            .is_empty()
    );
    let due = s
        .due_held_retries("src".into(), at(5_000), 10)
        .await
        .unwrap();
    assert_eq!(
        due.iter()
            .map(|p| p.source.message_id.as_str())
            .collect::<Vec<_>>(),
        vec!["early", "late"]
    );
    assert_eq!(
        due[0],
        retry_of("src", "early", at(1_000)),
        "read back as written"
    );
    assert_eq!(
        s.due_held_retries("src".into(), at(5_000), 1)
            .await
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        s.next_held_retry_due("src".into()).await.unwrap(),
        Some(at(1_000))
    );

    assert_eq!(
        s.held_retry(key("src", "early")).await.unwrap(),
        Some(retry_of("src", "early", at(1_000))),
        "one held retry read back by its key"
    );
    assert_eq!(
        s.held_retry(key("src", "x")).await.unwrap(),
        None,
        "another source's message is not this one's"
    );

    // Held again (the next retry): replaced, not added.
    let mut again = retry_of("src", "early", at(9_000));
    again.envelope = envelope(0, 2);
    s.hold_retry(again.clone()).await.unwrap();
    assert_eq!(
        s.held_retry(key("src", "early")).await.unwrap(),
        Some(again.clone())
    );
    let due = s
        .due_held_retries("src".into(), at(10_000), 10)
        .await
        .unwrap();
    assert_eq!(due.len(), 2);
    assert_eq!(due[1], again);

    assert!(s.release_held_retry(key("src", "late")).await.unwrap());
    assert!(!s.release_held_retry(key("src", "late")).await.unwrap());
    // Quarantining a held message drops its retry in the same call.
    s.quarantine_message(quarantined("src", "early", Stage::Processing, 0))
        .await
        .unwrap();
    assert!(
        s.due_held_retries("src".into(), at(10_000), 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(s.next_held_retry_due("src".into()).await.unwrap(), None);
    assert_eq!(
        s.due_held_retries("other".into(), at(0), 10)
            .await
            .unwrap()
            .len(),
        1
    );
}

pub async fn held_retries_and_broker_dead_letters_survive_a_restart<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    s.hold_retry(retry_of("src", "p", at(1_000))).await.unwrap();
    let q = s
        .quarantine_message(quarantined("src", "q", Stage::Broker, 0))
        .await
        .unwrap();
    s.close().await.unwrap();
    drop(s);
    let s = b.open(&place).await;
    assert_eq!(
        s.due_held_retries("src".into(), at(1_000), 10)
            .await
            .unwrap(),
        vec![retry_of("src", "p", at(1_000))]
    );
    assert_eq!(
        s.message_held(key("src", "q")).await.unwrap(),
        Held::Quarantined(q.id)
    );
    assert_eq!(
        s.dead_letter(q.id).await.unwrap().and_then(|d| d.source),
        Some(source("src", "q"))
    );
}

pub async fn a_message_reusing_a_quarantined_id_is_a_dead_letter_of_its_own<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let first = s
        .quarantine_message(quarantined("src", "order-7", Stage::Broker, 0))
        .await
        .unwrap();
    assert!(first.created);
    // Another body under the same id (an order id used as message id): a
    // message of its own, kept.
    let mut other = quarantined("src", "order-7", Stage::Broker, 10);
    other.payload = b"{\"order\": 8}".to_vec();
    let second = s.quarantine_message(other.clone()).await.unwrap();
    assert!(second.created, "a different body is another dead letter");
    assert_ne!(second.id, first.id);
    // Its own redelivery is still recognised.
    let again = s.quarantine_message(other).await.unwrap();
    assert_eq!((again.id, again.created), (second.id, false));
    assert_eq!(
        s.message_held(key("src", "order-7")).await.unwrap(),
        Held::Quarantined(first.id)
    );
    assert_eq!(
        s.message_held(MessageKey::of("src", "order-7", b"{\"order\": 8}", None))
            .await
            .unwrap(),
        Held::Quarantined(second.id)
    );
    assert_eq!(
        s.message_held(MessageKey::of("src", "order-7", b"{\"order\": 9}", None))
            .await
            .unwrap(),
        Held::Nothing,
        "a body never quarantined is not held"
    );

    // A redriven copy (same id, same body, a redrive id) is never the dead
    // letter it was redriven from, which the redrive removes only after
    // the broker confirmed the copy.
    let mut copy = quarantined("src", "order-7", Stage::Broker, 20);
    copy.source.redrive_id = Some("r-1".into());
    let third = s.quarantine_message(copy.clone()).await.unwrap();
    assert!(third.created, "a redriven copy is a dead letter of its own");
    assert_ne!(third.id, first.id);
    assert_eq!(
        s.quarantine_message(copy).await.unwrap(),
        lazaret_store::Quarantined {
            id: third.id,
            created: false
        }
    );
    assert_eq!(
        s.message_held(MessageKey::of("src", "order-7", BODY, Some("r-1".into())))
            .await
            .unwrap(),
        Held::Quarantined(third.id)
    );
    assert_eq!(
        s.message_held(MessageKey::of("src", "order-7", BODY, Some("r-2".into())))
            .await
            .unwrap(),
        Held::Nothing
    );
    let dl = s.dead_letter(third.id).await.unwrap().expect("the copy's");
    assert_eq!(dl.source.and_then(|s| s.redrive_id).as_deref(), Some("r-1"));
}

pub async fn held_retries_are_counted_by_source<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    assert!(s.stats().await.unwrap().held_retries.is_empty());
    s.hold_retry(retry_of("src", "a", at(1_000))).await.unwrap();
    s.hold_retry(retry_of("src", "b", at(2_000))).await.unwrap();
    s.hold_retry(retry_of("other", "a", at(1_000)))
        .await
        .unwrap();
    // Held again (replaced): still one.
    s.hold_retry(retry_of("src", "a", at(3_000))).await.unwrap();
    assert_eq!(
        s.stats().await.unwrap().held_retries,
        vec![("other".to_owned(), 1), ("src".to_owned(), 2)]
    );
    s.release_held_retry(key("src", "b")).await.unwrap();
    assert_eq!(
        s.stats().await.unwrap().held_retries,
        vec![("other".to_owned(), 1), ("src".to_owned(), 1)]
    );
}

/// A different message reusing a held message's id (another body, or a
/// redriven copy) is held as a retry of its own beside it: holding one never
/// replaces the other, each is read, dropped and quarantined by its own key,
/// and a body never held is not taken for a held one.
pub async fn a_message_reusing_a_held_id_is_held_as_a_retry_of_its_own<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    const OTHER: &[u8] = b"{\"order\": 8}";
    let first = retry_of("src", "order-7", at(1_000));
    s.hold_retry(first.clone()).await.unwrap();
    let other_key = MessageKey::of("src", "order-7", OTHER, None);
    assert_eq!(
        s.message_held(other_key.clone()).await.unwrap(),
        Held::Nothing,
        "another body under a held id is new to lazaret"
    );
    assert_eq!(s.held_retry(other_key.clone()).await.unwrap(), None);

    let mut second = retry_of("src", "order-7", at(2_000));
    second.body = OTHER.to_vec();
    s.hold_retry(second.clone()).await.unwrap();
    let mut copy = retry_of("src", "order-7", at(3_000));
    copy.source.redrive_id = Some("r-1".into());
    s.hold_retry(copy.clone()).await.unwrap();
    assert_eq!(
        s.due_held_retries("src".into(), at(10_000), 10)
            .await
            .unwrap(),
        vec![first.clone(), second.clone(), copy.clone()],
        "three messages held, none replaced by another"
    );
    assert_eq!(
        s.stats().await.unwrap().held_retries,
        vec![("src".to_owned(), 3)]
    );
    for (k, p) in [
        (key("src", "order-7"), &first),
        (other_key.clone(), &second),
        (
            MessageKey::of("src", "order-7", BODY, Some("r-1".into())),
            &copy,
        ),
    ] {
        assert_eq!(s.message_held(k.clone()).await.unwrap(), Held::Retry);
        assert_eq!(s.held_retry(k).await.unwrap().as_ref(), Some(p));
    }
    assert_eq!(
        s.message_held(MessageKey::of("src", "order-7", BODY, Some("r-2".into())))
            .await
            .unwrap(),
        Held::Nothing
    );

    // Held again (its next retry): only that message's retry is replaced.
    let mut again = second.clone();
    again.due_at = at(9_000);
    again.envelope = envelope(0, 2);
    s.hold_retry(again.clone()).await.unwrap();
    assert_eq!(
        s.held_retry(key("src", "order-7")).await.unwrap(),
        Some(first.clone())
    );
    assert_eq!(s.held_retry(other_key.clone()).await.unwrap(), Some(again));

    // Dropped by its key: the others stay.
    assert!(s.release_held_retry(other_key.clone()).await.unwrap());
    assert_eq!(s.message_held(other_key).await.unwrap(), Held::Nothing);
    assert_eq!(
        s.due_held_retries("src".into(), at(10_000), 10)
            .await
            .unwrap(),
        vec![first.clone(), copy.clone()]
    );

    // A quarantine drops the retry of its own key only: a third body's dead
    // letter leaves both held, the first message's takes its retry along.
    let mut third = quarantined("src", "order-7", Stage::Processing, 0);
    third.payload = b"{\"order\": 9}".to_vec();
    s.quarantine_message(third).await.unwrap();
    assert_eq!(
        s.due_held_retries("src".into(), at(10_000), 10)
            .await
            .unwrap(),
        vec![first, copy.clone()]
    );
    let q = s
        .quarantine_message(quarantined("src", "order-7", Stage::Processing, 0))
        .await
        .unwrap();
    assert_eq!(
        s.message_held(key("src", "order-7")).await.unwrap(),
        Held::Quarantined(q.id)
    );
    assert_eq!(
        s.due_held_retries("src".into(), at(10_000), 10)
            .await
            .unwrap(),
        vec![copy]
    );
}

/// Claims `src`'s due held retries at `now` for `who`, for 60 s.
async fn claim<S: Store>(
    store: &S,
    who: &str,
    now: i64,
    limit: u32,
) -> Result<Vec<ClaimedRetry>, lazaret_store::StoreError> {
    store
        .claim_held_retries("src".into(), at(now), limit, who.into(), at(now + 60_000))
        .await
}

/// The message ids of held retries, in the order given.
fn ids_of(held: &[ClaimedRetry]) -> Vec<&str> {
    held.iter()
        .map(|c| c.retry.source.message_id.as_str())
        .collect()
}

/// Whose expired claim each claimed retry was taken from, in order.
fn lapsed(held: &[ClaimedRetry]) -> Vec<Option<&str>> {
    held.iter().map(|c| c.lapsed_claim.as_deref()).collect()
}

/// A due held retry is claimed by one caller (a node delivering it) until
/// its claim expires: another caller — a second store on the same place
/// where the backend has several nodes, else a second caller of the same
/// store — is not given it before, and is after; holding it again or releasing it
/// (the outcome of its delivery) clears the claim. Two callers claiming at
/// the same moment share the due retries without overlap.
pub async fn a_held_retry_is_claimed_by_one_caller_until_its_claim_expires<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let second = if b.capabilities().several_nodes {
        Some(b.open(&place).await)
    } else {
        None
    };
    s.hold_retry(retry_of("src", "b", at(2_000))).await.unwrap();
    s.hold_retry(retry_of("src", "a", at(1_000))).await.unwrap();
    s.hold_retry(retry_of("src", "later", at(100_000)))
        .await
        .unwrap();
    s.hold_retry(retry_of("other", "x", at(0))).await.unwrap();
    let first = claim(&s, "n1", 5_000, 10).await.unwrap();
    assert_eq!(ids_of(&first), vec!["a", "b"], "due ones, earliest first");
    assert_eq!(
        first[0].retry,
        retry_of("src", "a", at(1_000)),
        "read back as written"
    );
    assert_eq!(lapsed(&first), vec![None, None], "nobody had claimed them");
    let other = second.as_ref().unwrap_or(&s);
    assert!(
        claim(other, "n2", 6_000, 10).await.unwrap().is_empty(),
        "claimed by n1 until 65 s: given to no one else"
    );
    assert!(claim(&s, "n1", 6_000, 10).await.unwrap().is_empty());
    // n1 died: its claims expire, and n2 takes them (once).
    let taken = claim(other, "n2", 65_000, 10).await.unwrap();
    assert_eq!(
        ids_of(&taken),
        vec!["a", "b"],
        "expired claims are free again"
    );
    assert_eq!(
        lapsed(&taken),
        vec![Some("n1"), Some("n1")],
        "taken from n1's expired claims (charged as a crash by the runtime)"
    );
    assert!(claim(&s, "n1", 65_001, 10).await.unwrap().is_empty());
    // The outcomes clear the claim: `a` held again (a retry's retry) is
    // claimable once due; `b` succeeded and is gone.
    other
        .hold_retry(retry_of("src", "a", at(70_000)))
        .await
        .unwrap();
    assert!(other.release_held_retry(key("src", "b")).await.unwrap());
    let again = claim(&s, "n1", 70_000, 10).await.unwrap();
    assert_eq!(ids_of(&again), vec!["a"]);
    assert_eq!(lapsed(&again), vec![None], "its outcome cleared the claim");
    assert_eq!(
        ids_of(&claim(&s, "n1", 100_000, 10).await.unwrap()),
        vec!["later"],
        "a is still n1's until 130 s"
    );
    // A quarantine of a claimed retry drops it with its claim.
    let dl = quarantined("src", "a", Stage::Processing, 71_000);
    s.quarantine_message(dl).await.unwrap();
    assert!(
        claim(other, "n2", 150_000, 10).await.unwrap().is_empty(),
        "a is gone, later is n1's until 160 s"
    );
    // Many due at once, claimed by two callers at the same moment: each
    // retry goes to exactly one of them.
    assert!(s.release_held_retry(key("src", "later")).await.unwrap());
    for i in 0..40 {
        s.hold_retry(retry_of("src", &format!("m{i:02}"), at(600_000 + i)))
            .await
            .unwrap();
    }
    let (one, two) = tokio::join!(
        claim(&s, "n1", 700_000, 25),
        claim(other, "n2", 700_000, 25)
    );
    let (one, two) = (one.unwrap(), two.unwrap());
    let mut all: Vec<&str> = ids_of(&one).into_iter().chain(ids_of(&two)).collect();
    all.sort_unstable();
    let mut unique = all.clone();
    unique.dedup();
    assert_eq!(all, unique, "no retry claimed by both: {one:?} / {two:?}");
    assert_eq!(all.len(), 40, "between them they claimed every due retry");
    assert_eq!(
        s.due_held_retries("other".into(), at(0), 10)
            .await
            .unwrap()
            .len(),
        1,
        "another source's retries are not claimed"
    );
}

/// Message `id` of `orders-src` as the redrive `redrive` republished it.
fn copy_of(redrive: &str, id: &str) -> SourceRef {
    SourceRef {
        redrive_id: Some(redrive.into()),
        ..source("orders-src", id)
    }
}

/// The copy of message `id` that `redrive` republished fails again at
/// `ms`, for another reason than the first time (another group): its
/// dead letter.
async fn copy_fails_again<S: Store>(
    s: &S,
    redrive: &str,
    id: &str,
    ms: i64,
) -> lazaret_store::Quarantined {
    s.quarantine_message(SourceDeadLetter {
        source: copy_of(redrive, id),
        error: Some(
            Failure::new("schema", "field total missing").with_class(FailureClass::Permanent),
        ),
        ..quarantined("orders-src", id, Stage::Processing, ms)
    })
    .await
    .unwrap()
}

/// Three broker dead letters of `orders-src` (messages m-1, m-2, m-3, in
/// one group) and the audited redrive `redrive` about to republish them:
/// their ids and the redrive's audit entry.
async fn redrive_of_three_messages<S: Store>(
    s: &S,
    redrive: &str,
) -> (Vec<lazaret_store::DeadLetterId>, lazaret_store::AuditId) {
    let mut ids = Vec::new();
    for m in ["m-1", "m-2", "m-3"] {
        ids.push(
            s.quarantine_message(quarantined("orders-src", m, Stage::Processing, 0))
                .await
                .unwrap()
                .id,
        );
    }
    let entry = s
        .audit(lazaret_store::AuditEntry {
            at: at(1_000),
            actor: "op".into(),
            action: "redrive".into(),
            request: json!({}),
            count: 0,
        })
        .await
        .unwrap();
    s.record_redrive(redrive.into(), entry).await.unwrap();
    (ids, entry)
}

/// A redrive's broker messages: each republished copy is noted as its
/// dead letter leaves (the audit entry counting it), then counted as
/// running until a guard source handles it (succeeded, its held retry
/// dropped) or it is dead-lettered again under the redrive id (failed
/// again, in the group it fell into, still so once that dead letter is
/// purged). The rows carry what a dead letter's lineage needs.
pub async fn a_redrive_report_follows_broker_messages_to_success_and_failure_again<B: Backend>(
    b: &B,
) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let (ids, entry) = redrive_of_three_messages(&s, "r-m").await;
    let from = s.dead_letter(ids[0]).await.unwrap().unwrap().group_id;
    for id in &ids {
        assert!(
            s.redrove_message(*id, "r-m".into(), at(2_000), Some(entry))
                .await
                .unwrap()
        );
        assert!(s.dead_letter(*id).await.unwrap().is_none(), "it left");
    }
    // Gone already, or no broker message: nothing changes.
    assert!(
        !s.redrove_message(ids[0], "r-m".into(), at(2_000), Some(entry))
            .await
            .unwrap()
    );
    let r = s
        .redrive_report("r-m".into())
        .await
        .unwrap()
        .expect("known");
    assert_eq!((r.audit.count, r.jobs, r.messages), (3, 0, 3));
    assert_eq!((r.running, r.succeeded, r.failed_again), (3, 0, 0));
    assert_eq!(r.from_groups, vec![(from.clone(), 3)]);

    // m-1's copy is retried once, then succeeds: its held retry is dropped.
    let held = HeldRetry {
        source: copy_of("r-m", "m-1"),
        ..retry_of("orders-src", "m-1", at(3_000))
    };
    s.hold_retry(held.clone()).await.unwrap();
    assert_eq!(s.message_held(held.key()).await.unwrap(), Held::Retry);
    s.redriven_message_succeeded(held.key(), at(3_500))
        .await
        .unwrap();
    assert_eq!(s.message_held(held.key()).await.unwrap(), Held::Nothing);
    // A success of another redrive's copy, or of no redrive, changes nothing.
    s.redriven_message_succeeded(
        MessageKey::of("orders-src", "m-2", BODY, Some("r-x".into())),
        at(3_600),
    )
    .await
    .unwrap();
    s.redriven_message_succeeded(key("orders-src", "m-2"), at(3_600))
        .await
        .unwrap();
    let r = s.redrive_report("r-m".into()).await.unwrap().unwrap();
    assert_eq!((r.running, r.succeeded, r.failed_again), (2, 1, 0));

    // m-2's copy fails again, into another group.
    let again = copy_fails_again(&s, "r-m", "m-2", 4_000).await;
    assert!(again.created, "a copy is a dead letter of its own");
    let new_group = s.dead_letter(again.id).await.unwrap().unwrap().group_id;
    assert_ne!(new_group, from);
    let r = s.redrive_report("r-m".into()).await.unwrap().unwrap();
    assert_eq!((r.running, r.succeeded, r.failed_again), (1, 1, 1));
    assert_eq!(r.failed_again_groups, vec![(new_group.clone(), 1)]);
    // Its lineage: the redrive that republished m-2, from the first group.
    let lineage = s.message_lineage(again.id).await.unwrap();
    assert_eq!(
        lineage
            .iter()
            .map(|e| (e.redrive_id.as_deref(), e.from_group.as_str(), e.edited))
            .collect::<Vec<_>>(),
        vec![(Some("r-m"), from.as_str(), false)]
    );
    assert!(
        s.message_lineage(ids[0]).await.unwrap().is_empty(),
        "a dead letter no redrive led to has none"
    );
    // Purged, it still failed again.
    s.purge(vec![again.id], None).await.unwrap();
    let r = s.redrive_report("r-m".into()).await.unwrap().unwrap();
    assert_eq!(
        (r.messages, r.running, r.succeeded, r.failed_again),
        (3, 1, 1, 1)
    );
    assert_eq!(r.failed_again_groups, vec![(new_group, 1)]);
    assert_eq!(r.from_groups, vec![(from, 3)]);
}

/// A redriven copy can be handled before its redrive removes the dead
/// letter (the broker has it as soon as it is published): the copy is
/// noted before it goes, so an outcome written meanwhile is kept when the
/// dead letter leaves, and a republish that failed takes its note back.
pub async fn a_copy_seen_back_before_its_dead_letter_leaves_keeps_its_outcome<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let (ids, entry) = redrive_of_three_messages(&s, "r-e").await;
    for id in &ids {
        s.note_redrive_copy(*id, "r-e".into(), at(2_000))
            .await
            .unwrap();
    }
    // m-1's copy succeeds and m-2's fails again, both before the redrive
    // has removed their dead letters.
    s.redriven_message_succeeded(
        MessageKey::of("orders-src", "m-1", BODY, Some("r-e".into())),
        at(2_100),
    )
    .await
    .unwrap();
    let again = copy_fails_again(&s, "r-e", "m-2", 2_200).await;
    assert!(again.created);
    // m-3's republish failed: its note goes, its dead letter stays.
    s.forget_redrive_copy(ids[2], "r-e".into()).await.unwrap();
    for id in &ids[..2] {
        assert!(
            s.redrove_message(*id, "r-e".into(), at(2_300), Some(entry))
                .await
                .unwrap(),
            "the dead letter leaves"
        );
        assert!(s.dead_letter(*id).await.unwrap().is_none());
    }
    assert!(s.dead_letter(ids[2]).await.unwrap().is_some(), "m-3 stays");
    let r = s.redrive_report("r-e".into()).await.unwrap().unwrap();
    assert_eq!(
        (
            r.audit.count,
            r.messages,
            r.running,
            r.succeeded,
            r.failed_again
        ),
        (2, 2, 0, 1, 1),
        "the outcomes written before the dead letters left are kept"
    );
    // A note forgotten after its copy was seen back keeps its outcome.
    s.forget_redrive_copy(ids[0], "r-e".into()).await.unwrap();
    let r = s.redrive_report("r-e".into()).await.unwrap().unwrap();
    assert_eq!((r.messages, r.succeeded), (2, 1));
}
