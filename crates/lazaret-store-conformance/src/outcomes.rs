//! Outcomes: ack, fail (transient, permanent, deferred), fencing by lease token.

use std::time::Duration;

use lazaret_core::{
    AttemptOutcome, DeadLetterReason, Event, Failure, FailureClass, JobId, JobState, Transition,
};
use lazaret_store::{Completion, ItemError, LeaseToken, NewJob, Stage, Store};

use crate::Backend;

use super::{
    ATTEMPTS_MAX, RETRY_DELAY, at, complete, enqueue_one, job_view, lease, lease_one, lease_req,
    new_job, permanent, sha256_hex, transient, try_complete,
};

pub async fn ack_marks_succeeded_with_one_history_record<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let leased = lease_one(&s, lease_req(at(10), 1)).await;

    let done = complete(&s, &leased, Event::Succeeded, at(20)).await;
    assert_eq!(done.id, id);
    assert_eq!(done.job_type.as_str(), "resize");
    assert_eq!(done.lane.as_str(), "default");
    assert_eq!(done.transition, Transition::Succeeded);
    assert_eq!(done.attempt, 1);
    assert_eq!(
        (done.kind, done.class, done.dead_letter),
        (None, None, None)
    );

    let view = job_view(&s, id).await;
    assert_eq!(view.state, JobState::Succeeded);
    assert_eq!(view.lease_expires_at, None);
    assert_eq!(view.envelope.attempts, 1);
    assert_eq!(
        view.envelope.history.len(),
        1,
        "{:?}",
        view.envelope.history
    );
    let record = &view.envelope.history[0];
    assert_eq!(record.attempt, 1);
    assert_eq!(record.outcome, AttemptOutcome::Succeeded);
    assert_eq!(record.started_at, at(10));
    assert_eq!(record.ended_at, Some(at(20)));
    assert_eq!(record.error, None);

    let stats = s.stats().await.unwrap();
    assert_eq!(stats.succeeded, 1);
    assert_eq!(super::lane_counts(&stats, "default").leased, 0);

    let again = Completion {
        id,
        token: leased.lease_token,
        event: Event::Succeeded,
    };
    assert_eq!(
        try_complete(&s, again, at(21)).await.unwrap_err(),
        ItemError::LeaseLost,
        "a second ack finds no lease"
    );
    assert!(lease(&s, lease_req(at(22), 10)).await.is_empty());
}

pub async fn wrong_token_is_lease_lost_and_changes_nothing<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    enqueue_one(&s, new_job("resize", "acme", "default")).await;
    enqueue_one(&s, new_job("resize", "globex", "default")).await;
    let held = lease(&s, lease_req(at(10), 2)).await;
    assert_eq!(held.len(), 2);
    let (mine, theirs) = (&held[0], &held[1]);
    let before = job_view(&s, mine.id).await;

    let forged = LeaseToken(mine.lease_token.0.wrapping_add(1_000_000));
    // One call: the bad item is refused, the good one goes through.
    let out = s
        .complete(
            vec![
                Completion {
                    id: mine.id,
                    token: forged,
                    event: Event::Succeeded,
                },
                Completion {
                    id: mine.id,
                    token: theirs.lease_token,
                    event: Event::Failed(permanent()),
                },
                Completion {
                    id: theirs.id,
                    token: theirs.lease_token,
                    event: Event::Succeeded,
                },
            ],
            at(20),
        )
        .await
        .unwrap();
    assert_eq!(out.len(), 3);
    assert_eq!(out[0].as_ref().unwrap_err(), &ItemError::LeaseLost);
    assert_eq!(
        out[1].as_ref().unwrap_err(),
        &ItemError::LeaseLost,
        "another job's token"
    );
    assert_eq!(out[2].as_ref().unwrap().transition, Transition::Succeeded);

    let hb = s
        .heartbeat(mine.id, forged, at(90_000), at(20))
        .await
        .unwrap();
    assert_eq!(hb, Err(ItemError::LeaseLost));

    let after = job_view(&s, mine.id).await;
    assert_eq!(after.state, JobState::Leased);
    assert_eq!(after.lease_expires_at, before.lease_expires_at);
    assert_eq!(after.envelope, before.envelope, "nothing changed");
    assert!(
        s.dead_letters(Default::default(), 10, None)
            .await
            .unwrap()
            .0
            .is_empty()
    );

    let done = complete(&s, mine, Event::Succeeded, at(30)).await;
    assert_eq!(done.transition, Transition::Succeeded);
}

pub async fn unknown_id_is_not_found<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let leased = lease_one(&s, lease_req(at(1), 1)).await;
    let ghost = JobId(leased.id.0 + 1_000);

    let out = s
        .complete(
            vec![
                Completion {
                    id: ghost,
                    token: leased.lease_token,
                    event: Event::Succeeded,
                },
                Completion {
                    id: ghost,
                    token: leased.lease_token,
                    event: Event::Failed(transient("http_503")),
                },
            ],
            at(2),
        )
        .await
        .unwrap();
    assert_eq!(
        out.into_iter().map(|r| r.unwrap_err()).collect::<Vec<_>>(),
        vec![ItemError::NotFound, ItemError::NotFound]
    );
    let hb = s
        .heartbeat(ghost, leased.lease_token, at(60_000), at(2))
        .await
        .unwrap();
    assert_eq!(hb, Err(ItemError::NotFound));
    assert!(s.job(ghost).await.unwrap().is_none());
    assert_eq!(job_view(&s, leased.id).await.state, JobState::Leased);
}

pub async fn transient_failure_retries_after_the_backoff<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let first = lease_one(&s, lease_req(at(10), 1)).await;

    let done = complete(&s, &first, Event::Failed(transient("http_503")), at(20)).await;
    let due = at(20).saturating_add(RETRY_DELAY);
    assert_eq!(
        done.transition,
        Transition::Retry {
            at: due,
            attempt: 1
        }
    );
    assert_eq!(done.attempt, 1);
    assert_eq!(done.kind.as_ref().map(|k| k.as_str()), Some("http_503"));
    assert_eq!(done.class, Some(FailureClass::Transient));
    assert_eq!(done.dead_letter, None);

    let view = job_view(&s, id).await;
    assert_eq!(view.state, JobState::Scheduled);
    assert_eq!(view.run_at, Some(due));
    assert_eq!(view.lease_expires_at, None);
    assert_eq!(view.envelope.attempts, 1);

    let before_due = due.saturating_sub(Duration::from_millis(1));
    assert!(
        lease(&s, lease_req(before_due, 10)).await.is_empty(),
        "not before its run_at"
    );
    let tick = s.tick(before_due).await.unwrap();
    assert_eq!((tick.promoted, tick.next_due), (0, Some(due)));
    assert!(lease(&s, lease_req(before_due, 10)).await.is_empty());

    let tick = s.tick(due).await.unwrap();
    assert_eq!(tick.promoted, 1);
    let second = lease_one(&s, lease_req(due, 1)).await;
    assert_eq!((second.id, second.attempt), (id, 2));
    assert_ne!(second.lease_token, first.lease_token);

    let stale = Completion {
        id,
        token: first.lease_token,
        event: Event::Succeeded,
    };
    assert_eq!(
        try_complete(&s, stale, due).await.unwrap_err(),
        ItemError::LeaseLost
    );

    let history = job_view(&s, id).await.envelope.history;
    assert_eq!(history.len(), 2, "{history:?}");
    assert_eq!(history[0].outcome, AttemptOutcome::RetryScheduled);
    let error = history[0].error.as_ref().expect("the failure is kept");
    assert_eq!(error.kind.as_str(), "http_503");
    assert_eq!(error.class, Some(FailureClass::Transient));
    assert_eq!(
        (history[1].attempt, history[1].outcome),
        (2, AttemptOutcome::Running)
    );
}

pub async fn attempts_max_failures_dead_letter_as_exhausted<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let mut now = at(0);
    for attempt in 1..=ATTEMPTS_MAX {
        s.tick(now).await.unwrap();
        let leased = lease_one(&s, lease_req(now, 1)).await;
        assert_eq!((leased.id, leased.attempt), (id, attempt));
        let done = complete(&s, &leased, Event::Failed(transient("timeout")), now).await;
        if attempt < ATTEMPTS_MAX {
            now = now.saturating_add(RETRY_DELAY);
            assert_eq!(done.transition, Transition::Retry { at: now, attempt });
        } else {
            assert_eq!(
                done.transition,
                Transition::DeadLetter {
                    reason: DeadLetterReason::Exhausted
                }
            );
            let dl = s
                .dead_letter(done.dead_letter.expect("a dead letter"))
                .await
                .unwrap()
                .expect("listed");
            assert_eq!(dl.attempts, ATTEMPTS_MAX);
            assert_eq!(dl.history.len(), ATTEMPTS_MAX as usize);
        }
    }
    assert_eq!(job_view(&s, id).await.state, JobState::DeadLettered);
}

pub async fn permanent_failure_dead_letters_in_the_same_call<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let payload = br#"{"image": "cat.gif", "width": 64}"#.to_vec();
    let id = enqueue_one(
        &s,
        NewJob {
            payload: payload.clone(),
            idempotency_key: Some("img-7".into()),
            schema_version: Some(2),
            ..new_job("resize", "acme", "default")
        },
    )
    .await;
    let leased = lease_one(&s, lease_req(at(10), 1)).await;

    let done = complete(&s, &leased, Event::Failed(permanent()), at(20)).await;
    assert_eq!(
        done.transition,
        Transition::DeadLetter {
            reason: DeadLetterReason::Permanent
        }
    );
    assert_eq!(done.class, Some(FailureClass::Permanent));
    assert_eq!(done.kind.as_ref().map(|k| k.as_str()), Some("bad_input"));
    let dl_id = done.dead_letter.expect("written in the same call");

    assert_eq!(job_view(&s, id).await.state, JobState::DeadLettered);
    let dl = s
        .dead_letter(dl_id)
        .await
        .unwrap()
        .expect("the dead letter exists");
    assert_eq!(dl.id, dl_id);
    assert_eq!(dl.job_id, Some(id));
    assert_eq!(dl.stage, Stage::Processing);
    assert_eq!(dl.reason, DeadLetterReason::Permanent);
    assert_eq!(dl.job_type.as_deref(), Some("resize"));
    assert_eq!(dl.tenant.as_deref(), Some("acme"));
    assert_eq!(dl.lane.as_deref(), Some("default"));
    assert_eq!(dl.attempts, 1);
    assert_eq!(dl.idempotency_key.as_deref(), Some("img-7"));
    assert_eq!(dl.schema_version, Some(2));
    assert_eq!(dl.created_at, at(0));
    assert_eq!(dl.dead_lettered_at, at(20));
    assert_eq!(dl.redrive_count, 0);
    assert_eq!(dl.payload_size, payload.len() as u64);
    assert_eq!(
        dl.payload_sha256.as_deref(),
        Some(sha256_hex(&payload).as_str())
    );
    assert_eq!(dl.payload_preview.as_bytes(), payload.as_slice());
    let error = dl.error.as_ref().expect("the last failure");
    let mut expected: Failure = permanent();
    expected.class = Some(FailureClass::Permanent);
    assert_eq!(error, &expected);
    assert_eq!(dl.history.len(), 1);
    assert_eq!(dl.history[0].outcome, AttemptOutcome::DeadLettered);
    assert_eq!(dl.history[0].error.as_ref(), Some(&expected));

    assert_eq!(
        s.dead_letter_payload(dl_id).await.unwrap(),
        Some(Some(payload))
    );
    let stats = s.stats().await.unwrap();
    assert_eq!(
        stats.dead_letters,
        vec![(Some("resize".to_owned()), DeadLetterReason::Permanent, 1)]
    );
    assert!(
        lease(&s, lease_req(at(30), 10)).await.is_empty(),
        "never leased again"
    );
}

pub async fn deferral_does_not_advance_the_attempt<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let first = lease_one(&s, lease_req(at(10), 1)).await;
    assert_eq!(first.attempt, 1);

    let wait = Duration::from_secs(5);
    let deferred = Failure::new("rate_limited", "429 from the CDN")
        .with_class(FailureClass::Deferred)
        .with_retry_after(wait);
    let done = complete(&s, &first, Event::Failed(deferred), at(20)).await;
    let until = at(20).saturating_add(wait);
    assert_eq!(done.transition, Transition::Defer { until });
    assert_eq!(done.dead_letter, None);

    let view = job_view(&s, id).await;
    assert_eq!(view.state, JobState::Scheduled);
    assert_eq!(view.run_at, Some(until));
    assert_eq!(view.envelope.attempts, 0, "a deferral is not charged");
    assert_eq!(view.envelope.deferrals, 1);

    assert_eq!(s.tick(until).await.unwrap().promoted, 1);
    let again = lease_one(&s, lease_req(until, 1)).await;
    assert_eq!((again.id, again.attempt), (id, 1), "the same attempt again");
    let history = job_view(&s, id).await.envelope.history;
    assert_eq!(
        history.iter().map(|r| r.outcome).collect::<Vec<_>>(),
        vec![AttemptOutcome::Deferred, AttemptOutcome::Running]
    );
}

/// The envelope a reader sees at every step carries each attempt as the core
/// records it: who ran it, from when to when, how it ended; and the
/// admission facts (size, digest, key, schema version).
pub async fn history_reads_right_after_every_step<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let payload = br#"{"to":"a@example.com"}"#;
    let id = enqueue_one(
        &s,
        NewJob {
            payload: payload.to_vec(),
            idempotency_key: Some("k-7".into()),
            schema_version: Some(3),
            ..new_job("send", "acme", "default")
        },
    )
    .await;
    let fresh = job_view(&s, id).await.envelope;
    assert_eq!(
        (fresh.attempts, fresh.history.len(), fresh.redrive_count),
        (0, 0, 0)
    );
    assert_eq!(fresh.payload_size, payload.len() as u64);
    assert_eq!(fresh.payload_sha256, sha256_hex(payload));
    assert_eq!(fresh.idempotency_key.as_deref(), Some("k-7"));
    assert_eq!(fresh.schema_version, Some(3));
    assert_eq!(fresh.created_at, at(0));

    let first = lease_one(
        &s,
        lazaret_store::LeaseRequest {
            worker_id: "w-7".into(),
            ..lease_req(at(10), 1)
        },
    )
    .await;
    let running = job_view(&s, id).await.envelope;
    assert_eq!(running.attempts, 1);
    let r = &running.history[..];
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].attempt, r[0].outcome, r[0].started_at, r[0].ended_at),
        (1, AttemptOutcome::Running, at(10), None)
    );
    assert_eq!(r[0].worker_id.as_ref().map(|w| w.as_str()), Some("w-7"));

    complete(&s, &first, Event::Failed(transient("timeout")), at(20)).await;
    s.tick(at(20).saturating_add(RETRY_DELAY)).await.unwrap();
    let second = lease_one(
        &s,
        lazaret_store::LeaseRequest {
            worker_id: "w-8".into(),
            ..lease_req(at(20).saturating_add(RETRY_DELAY), 1)
        },
    )
    .await;
    assert_eq!(second.attempt, 2);
    let done_at = at(20).saturating_add(RETRY_DELAY + Duration::from_millis(5));
    complete(&s, &second, Event::Succeeded, done_at).await;

    let view = job_view(&s, id).await;
    assert_eq!(view.state, JobState::Succeeded);
    let env = view.envelope;
    assert_eq!(env.attempts, 2);
    let h = &env.history[..];
    assert_eq!(h.len(), 2, "{h:?}");
    assert_eq!(
        (h[0].attempt, h[0].outcome, h[0].ended_at),
        (1, AttemptOutcome::RetryScheduled, Some(at(20)))
    );
    assert_eq!(
        h[0].error.as_ref().map(|e| e.kind.as_str()),
        Some("timeout")
    );
    assert_eq!(
        (h[1].attempt, h[1].outcome, h[1].started_at, h[1].ended_at),
        (
            2,
            AttemptOutcome::Succeeded,
            at(20).saturating_add(RETRY_DELAY),
            Some(done_at)
        )
    );
    assert_eq!(h[1].worker_id.as_ref().map(|w| w.as_str()), Some("w-8"));
    assert_eq!(h[1].error, None);
    assert_eq!(env.payload_sha256, sha256_hex(payload));
}

/// A token fences one lease of one job: every lease of a job, after a
/// retry, an expiry or a redrive, gets a new one, and the old ones are
/// refused.
pub async fn every_lease_of_a_job_gets_a_new_token<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = enqueue_one(&s, new_job("send", "acme", "default")).await;
    let mut held = Vec::new();
    let mut now = at(10);
    // A retry, then an expiry.
    let j = lease_one(&s, lease_req(now, 1)).await;
    held.push(j.clone());
    complete(&s, &j, Event::Failed(transient("timeout")), now).await;
    now = now.saturating_add(RETRY_DELAY);
    s.tick(now).await.unwrap();
    let j = lease_one(&s, lease_req(now, 1)).await;
    held.push(j.clone());
    now = j.lease_expires_at;
    s.tick(now).await.unwrap();
    now = now.saturating_add(RETRY_DELAY);
    s.tick(now).await.unwrap();
    // Then a dead letter and a redrive.
    let j = lease_one(&s, lease_req(now, 1)).await;
    held.push(j.clone());
    let dl = complete(&s, &j, Event::Failed(permanent()), now)
        .await
        .dead_letter
        .expect("dead-lettered");
    assert_eq!(s.redrive(vec![dl], now, None).await.unwrap(), vec![id]);
    let j = lease_one(&s, lease_req(now, 1)).await;
    held.push(j.clone());

    let tokens: std::collections::HashSet<LeaseToken> =
        held.iter().map(|j| j.lease_token).collect();
    assert_eq!(tokens.len(), held.len(), "{held:?}");
    for old in &held[..held.len() - 1] {
        let out = try_complete(
            &s,
            Completion {
                id: old.id,
                token: old.lease_token,
                event: Event::Succeeded,
            },
            now,
        )
        .await;
        assert_eq!(
            out.map(|c| c.transition),
            Err(ItemError::LeaseLost),
            "token {}",
            old.lease_token
        );
    }
    complete(&s, &held[held.len() - 1], Event::Succeeded, now).await;
}

pub async fn an_outcome_at_or_after_the_lease_end_is_lease_lost_and_changes_nothing<B: Backend>(
    b: &B,
) {
    let place = b.place().await;
    let s = b.open(&place).await;
    enqueue_one(&s, new_job("resize", "acme", "default")).await;
    enqueue_one(&s, new_job("resize", "globex", "default")).await;
    let held = lease(&s, lease_req(at(10), 2)).await;
    assert_eq!(held.len(), 2);
    let (late, kept) = (&held[0], &held[1]);
    let end = late.lease_expires_at;
    assert_eq!(end, at(10).saturating_add(super::LEASE));
    let before = job_view(&s, late.id).await;

    // The reaper has not run: the lease is still `leased` in the table, but
    // its end has come. Ack, fail and heartbeat at the end and after it
    // are all refused, alone or beside an accepted item.
    let past = end.saturating_add(Duration::from_secs(5));
    for now in [end, past] {
        for event in [
            Event::Succeeded,
            Event::Failed(transient("http_503")),
            Event::Failed(permanent()),
        ] {
            let item = Completion {
                id: late.id,
                token: late.lease_token,
                event,
            };
            assert_eq!(
                try_complete(&s, item, now).await.map(|c| c.transition),
                Err(ItemError::LeaseLost),
                "an outcome at {now:?}, the lease ended at {end:?}"
            );
        }
        let hb = s
            .heartbeat(
                late.id,
                late.lease_token,
                now.saturating_add(super::LEASE),
                now,
            )
            .await
            .unwrap();
        assert_eq!(hb, Err(ItemError::LeaseLost), "a heartbeat at {now:?}");
    }
    let after = job_view(&s, late.id).await;
    assert_eq!(after.state, JobState::Leased);
    assert_eq!(after.lease_expires_at, Some(end));
    assert_eq!(after.envelope, before.envelope, "nothing changed");
    assert!(
        s.dead_letters(Default::default(), 10, None)
            .await
            .unwrap()
            .0
            .is_empty()
    );

    // One millisecond before its end a lease is still good: a heartbeat
    // extends it, and an ack before the new end is accepted.
    let last = end.saturating_sub(Duration::from_millis(1));
    let extended = at(90_000);
    let hb = s
        .heartbeat(kept.id, kept.lease_token, extended, last)
        .await
        .unwrap();
    assert_eq!(hb.map(|h| h.lease_expires_at), Ok(extended));

    // The reaper then does what it would have done had it run first.
    let tick = s.tick(past).await.unwrap();
    assert_eq!(
        tick.expired.iter().map(|c| c.id).collect::<Vec<_>>(),
        vec![late.id]
    );
    assert_eq!(
        tick.expired[0].kind.as_ref().map(|k| k.as_str()),
        Some("lease_expired")
    );
    let reaped = job_view(&s, late.id).await;
    assert_ne!(reaped.state, JobState::Leased);
    assert_eq!(reaped.envelope.attempts, 1);
    assert_eq!(reaped.envelope.history.len(), 1);

    let done = complete(
        &s,
        kept,
        Event::Succeeded,
        extended.saturating_sub(Duration::from_millis(1)),
    )
    .await;
    assert_eq!(done.transition, Transition::Succeeded);
    let ack_at_end = Completion {
        id: kept.id,
        token: kept.lease_token,
        event: Event::Succeeded,
    };
    assert_eq!(
        try_complete(&s, ack_at_end, extended).await.unwrap_err(),
        ItemError::LeaseLost
    );
}
