//! Lease: the request's filters and limits, fairness between tenants, in-flight caps.

use std::collections::HashMap;

use lazaret_core::{Event, JobId, TenantId};
use lazaret_store::{LeaseRequest, LeasedJob, NewJob, Store};

use crate::Backend;

use super::{
    INFLIGHT_MAX, at, complete, enqueue_one, ids, lane_counts, lease, lease_req, new_job, transient,
};

/// One job per (type, tenant, lane); returns the ids in the same order.
async fn one_each<S: Store>(s: &S, jobs: &[(&str, &str, &str)]) -> Vec<JobId> {
    let out = s
        .enqueue(
            jobs.iter()
                .map(|(ty, tenant, lane)| new_job(ty, tenant, lane))
                .collect(),
        )
        .await
        .unwrap();
    out.iter().map(super::created).collect()
}

fn sorted(mut v: Vec<JobId>) -> Vec<JobId> {
    v.sort();
    v
}

pub async fn lease_respects_lanes<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = one_each(
        &s,
        &[
            ("resize", "a", "fast"),
            ("resize", "b", "slow"),
            ("resize", "c", "bulk"),
        ],
    )
    .await;
    let req = |lanes: &[&str]| LeaseRequest {
        lanes: Some(lanes.iter().map(|l| (*l).into()).collect()),
        ..lease_req(at(1), 10)
    };
    assert_eq!(
        ids(&lease(&s, req(&["fast", "bulk"])).await),
        sorted(vec![id[0], id[2]])
    );
    assert!(lease(&s, req(&["fast", "bulk"])).await.is_empty());
    assert!(lease(&s, req(&[])).await.is_empty(), "no lanes: nothing");
    assert_eq!(ids(&lease(&s, req(&["slow"])).await), vec![id[1]]);
}

pub async fn lease_respects_exclude_lanes<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = one_each(
        &s,
        &[
            ("resize", "a", "fast"),
            ("resize", "b", "slow"),
            ("resize", "c", "bulk"),
        ],
    )
    .await;
    let exclude_slow = LeaseRequest {
        exclude_lanes: vec!["slow".into()],
        ..lease_req(at(1), 10)
    };
    assert_eq!(
        ids(&lease(&s, exclude_slow.clone()).await),
        sorted(vec![id[0], id[2]])
    );
    assert!(lease(&s, exclude_slow.clone()).await.is_empty());
    let both = LeaseRequest {
        lanes: Some(vec!["slow".into()]),
        ..exclude_slow
    };
    assert!(
        lease(&s, both).await.is_empty(),
        "an excluded lane stays excluded when named"
    );
    assert_eq!(ids(&lease(&s, lease_req(at(1), 10)).await), vec![id[1]]);
}

pub async fn lease_respects_types<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    // Same tenant and lane, and the unwanted type is first in line.
    let id = one_each(
        &s,
        &[
            ("resize", "a", "default"),
            ("email", "a", "default"),
            ("sms", "b", "default"),
        ],
    )
    .await;
    let req = |types: &[&str]| LeaseRequest {
        types: Some(types.iter().map(|t| (*t).into()).collect()),
        ..lease_req(at(1), 10)
    };
    assert_eq!(
        ids(&lease(&s, req(&["email", "sms"])).await),
        sorted(vec![id[1], id[2]])
    );
    assert!(lease(&s, req(&["email", "sms"])).await.is_empty());
    assert!(lease(&s, req(&[])).await.is_empty(), "no types: nothing");
    assert_eq!(ids(&lease(&s, lease_req(at(1), 10)).await), vec![id[0]]);
}

/// Within a (lane, tenant), a lease for several types takes the oldest
/// jobs across them, in line order, whatever the types' names.
pub async fn a_lease_for_several_types_takes_the_oldest_across_them<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = one_each(
        &s,
        &[
            ("sms", "a", "default"),
            ("bulk", "a", "default"),
            ("email", "a", "default"),
            ("sms", "a", "default"),
            ("email", "a", "default"),
        ],
    )
    .await;
    let req = |max_jobs| LeaseRequest {
        types: Some(vec!["email".into(), "sms".into()]),
        ..lease_req(at(1), max_jobs)
    };
    let first = lease(&s, req(2)).await;
    assert_eq!(
        first.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![id[0], id[2]],
        "the two oldest of email and sms, in line order"
    );
    // The suite's cap is 2 per tenant: done with those, the next two.
    for job in &first {
        super::complete(&s, job, lazaret_core::Event::Succeeded, at(2)).await;
    }
    let rest = lease(&s, req(10)).await;
    assert_eq!(
        rest.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![id[3], id[4]]
    );
    for job in &rest {
        super::complete(&s, job, lazaret_core::Event::Succeeded, at(2)).await;
    }
    assert_eq!(ids(&lease(&s, lease_req(at(3), 10)).await), vec![id[1]]);
}

pub async fn lease_respects_exclude_types<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = one_each(
        &s,
        &[
            ("resize", "a", "default"),
            ("email", "a", "default"),
            ("resize", "b", "other"),
        ],
    )
    .await;
    let exclude_resize = LeaseRequest {
        exclude_types: vec!["resize".into()],
        ..lease_req(at(1), 10)
    };
    assert_eq!(ids(&lease(&s, exclude_resize.clone()).await), vec![id[1]]);
    assert!(lease(&s, exclude_resize.clone()).await.is_empty());
    let both = LeaseRequest {
        types: Some(vec!["resize".into()]),
        ..exclude_resize
    };
    assert!(
        lease(&s, both).await.is_empty(),
        "an excluded type stays excluded when named"
    );
    assert_eq!(
        ids(&lease(&s, lease_req(at(1), 10)).await),
        sorted(vec![id[0], id[2]])
    );
}

pub async fn lease_respects_type_limits<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = one_each(
        &s,
        &[
            ("probe", "a", "default"),
            ("probe", "b", "default"),
            ("probe", "c", "default"),
            ("email", "d", "default"),
        ],
    )
    .await;
    let limited = |n: u32| LeaseRequest {
        type_limits: vec![("probe".into(), n)],
        ..lease_req(at(1), 10)
    };
    let got = lease(&s, limited(1)).await;
    let probes = got
        .iter()
        .filter(|j| j.job_type.as_str() == "probe")
        .count();
    assert_eq!(probes, 1, "one probe: {got:?}");
    assert!(
        ids(&got).contains(&id[3]),
        "other types are not limited: {got:?}"
    );
    assert_eq!(got.len(), 2);

    assert!(
        lease(&s, limited(0)).await.is_empty(),
        "a limit of 0 parks the type"
    );
    assert_eq!(
        lease(&s, lease_req(at(1), 10)).await.len(),
        2,
        "the other two probes"
    );
}

pub async fn type_limits_leave_room_for_other_types<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    // One tenant: two probes first in line, then an email. With one probe
    // allowed and a cap of 2, the lease can hold a probe and the email.
    let id = one_each(
        &s,
        &[
            ("probe", "a", "default"),
            ("probe", "a", "default"),
            ("email", "a", "default"),
        ],
    )
    .await;
    let got = lease(
        &s,
        LeaseRequest {
            type_limits: vec![("probe".into(), 1)],
            ..lease_req(at(1), 10)
        },
    )
    .await;
    assert_eq!(
        ids(&got),
        vec![id[0], id[2]],
        "the first probe and the email (the second probe is over its limit)"
    );
}

pub async fn lease_respects_max_jobs<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    one_each(
        &s,
        &[
            ("resize", "a", "default"),
            ("resize", "b", "default"),
            ("resize", "c", "default"),
            ("resize", "d", "default"),
            ("resize", "e", "default"),
        ],
    )
    .await;
    assert!(lease(&s, lease_req(at(1), 0)).await.is_empty());
    assert_eq!(lease(&s, lease_req(at(1), 3)).await.len(), 3);
    assert_eq!(lease(&s, lease_req(at(1), 1)).await.len(), 1);
    assert_eq!(
        lease(&s, lease_req(at(1), 10)).await.len(),
        1,
        "what is left"
    );
}

pub async fn a_new_tenant_is_served_in_the_first_round<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let big: Vec<NewJob> = (0..100)
        .map(|_| new_job("resize", "tenant-a", "default"))
        .collect();
    let big_ids: Vec<JobId> = s
        .enqueue(big)
        .await
        .unwrap()
        .iter()
        .map(super::created)
        .collect();
    let small = enqueue_one(&s, new_job("resize", "tenant-b", "default")).await;

    let got = lease(&s, lease_req(at(1), 2)).await;
    assert_eq!(
        ids(&got),
        vec![big_ids[0], small],
        "one job each: the big tenant's oldest and the small tenant's only job"
    );
}

pub async fn a_tenant_never_exceeds_its_inflight_cap<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let mut jobs: Vec<NewJob> = (0..5)
        .map(|_| new_job("resize", "acme", "default"))
        .collect();
    jobs.extend((0..3).map(|_| new_job("resize", "acme", "bulk")));
    s.enqueue(jobs).await.unwrap();

    let mut held: Vec<LeasedJob> = lease(&s, lease_req(at(1), 10)).await;
    assert_inflight(&held);
    assert_eq!(held.len(), 2 * INFLIGHT_MAX as usize, "the cap is per lane");
    assert!(
        lease(&s, lease_req(at(2), 10)).await.is_empty(),
        "at the cap"
    );

    let stats = s.stats().await.unwrap();
    assert_eq!(
        lane_counts(&stats, "default").leased,
        u64::from(INFLIGHT_MAX)
    );
    assert_eq!(lane_counts(&stats, "default").queued, 3);

    // An ack frees one slot in its lane, a retry another.
    let i = held
        .iter()
        .position(|j| j.lane.as_str() == "default")
        .unwrap();
    let done = held.remove(i);
    complete(&s, &done, Event::Succeeded, at(3)).await;
    let i = held
        .iter()
        .position(|j| j.lane.as_str() == "default")
        .unwrap();
    let failed = held.remove(i);
    complete(&s, &failed, Event::Failed(transient("http_503")), at(3)).await;

    let more = lease(&s, lease_req(at(4), 10)).await;
    assert_eq!(more.len(), 2, "two slots freed in `default`: {more:?}");
    assert!(more.iter().all(|j| j.lane.as_str() == "default"));
    held.extend(more);
    assert_inflight(&held);
    assert!(
        lease(&s, lease_req(at(5), 10)).await.is_empty(),
        "at the cap again"
    );
}

/// No tenant holds more than the cap in any lane.
fn assert_inflight(held: &[LeasedJob]) {
    let mut per: HashMap<(TenantId, String), u32> = HashMap::new();
    for j in held {
        *per.entry((j.tenant.clone(), j.lane.as_str().to_owned()))
            .or_default() += 1;
    }
    for (key, n) in per {
        assert!(n <= INFLIGHT_MAX, "{key:?} holds {n} leases");
    }
}

/// Tenants take turns in name order, round after round, wrapping past the
/// last name; a tenant that arrives behind the round's position waits for
/// the next round, one ahead of it is served in this one (issue 32: a
/// lease walks the tenants from the round's position, not all of them).
pub async fn tenants_take_turns_in_name_order_across_rounds<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let mut jobs = Vec::new();
    for _ in 0..2 {
        for t in ["t1", "t3", "t5", "t7"] {
            jobs.push(new_job("resize", t, "default"));
        }
    }
    s.enqueue(jobs).await.unwrap();
    let mut order = Vec::new();
    for i in 0..8 {
        if i == 2 {
            // The round is past t3: t2 waits for the next round, t6 not.
            s.enqueue(vec![
                new_job("resize", "t2", "default"),
                new_job("resize", "t6", "default"),
            ])
            .await
            .unwrap();
        }
        let got = lease(&s, lease_req(at(1), 1)).await;
        assert_eq!(got.len(), 1, "lease {i}");
        order.push(got[0].tenant.to_string());
        // Acked at once, so no tenant is held at its cap.
        complete(&s, &got[0], Event::Succeeded, at(1)).await;
    }
    assert_eq!(
        order,
        ["t1", "t3", "t5", "t6", "t7", "t1", "t2", "t3"],
        "one per tenant per round, in name order from where the round is"
    );
}

/// A lease looks at about as many (lane, tenant) pairs as it leases jobs,
/// with 2,000 tenants waiting (issue 32: it looked at every one of them);
/// a lease filtered by type does not look at the tenants of other types.
pub async fn a_lease_looks_at_a_few_tenants_of_thousands<B: Backend>(b: &B) {
    if !b.capabilities().group_commit_stats {
        return;
    }
    let place = b.place().await;
    let s = b.open(&place).await;
    let mut jobs: Vec<NewJob> = (0..2000)
        .map(|i| new_job("resize", &format!("t{i:04}"), "default"))
        .collect();
    jobs.extend((0..5).map(|i| new_job("email", &format!("u{i}"), "default")));
    for chunk in jobs.chunks(500) {
        s.enqueue(chunk.to_vec()).await.unwrap();
    }
    let looked = || async {
        s.stats()
            .await
            .unwrap()
            .group_commit
            .map_or(0, |g| g.lease_pairs)
    };
    let before = looked().await;
    for _ in 0..5 {
        assert_eq!(lease(&s, lease_req(at(1), 1)).await.len(), 1);
    }
    let unfiltered = looked().await - before;
    assert!(
        unfiltered <= 10,
        "5 leases of one job looked at {unfiltered} pairs of 2,005"
    );
    let before = looked().await;
    let emails = lease(
        &s,
        LeaseRequest {
            types: Some(vec!["email".into()]),
            ..lease_req(at(1), 3)
        },
    )
    .await;
    assert_eq!(emails.len(), 3);
    let filtered = looked().await - before;
    assert!(
        filtered <= 5,
        "a lease of 3 emails looked at {filtered} pairs, of which 5 have emails"
    );
}

/// Requests that arrive together (a store may apply them as one) each get
/// their own answer: every enqueue its job, every lease its own job with
/// its own worker and lease end, every ack its job, and no job twice.
pub async fn concurrent_requests_each_get_their_own_answer<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let job = |tenant: &str| new_job("resize", tenant, "default");
    let (a, b_, c, d, e, f) = tokio::join!(
        enqueue_one(&s, job("t0")),
        enqueue_one(&s, job("t1")),
        enqueue_one(&s, job("t2")),
        enqueue_one(&s, job("t3")),
        enqueue_one(&s, job("t4")),
        enqueue_one(&s, job("t5")),
    );
    let mut enqueued = vec![a, b_, c, d, e, f];
    enqueued.sort();
    enqueued.dedup();
    assert_eq!(enqueued.len(), 6, "six jobs: {enqueued:?}");

    // Worker i asks for one job with a lease of i + 1 seconds.
    let req = |i: u64| LeaseRequest {
        worker_id: format!("w-{i}").into(),
        lease: std::time::Duration::from_secs(i + 1),
        ..lease_req(at(10), 1)
    };
    let (l0, l1, l2, l3, l4, l5, l6) = tokio::join!(
        lease(&s, req(0)),
        lease(&s, req(1)),
        lease(&s, req(2)),
        lease(&s, req(3)),
        lease(&s, req(4)),
        lease(&s, req(5)),
        lease(&s, req(6)),
    );
    let answers = [l0, l1, l2, l3, l4, l5, l6];
    let mut leased: Vec<(u64, LeasedJob)> = Vec::new();
    for (i, got) in answers.into_iter().enumerate() {
        assert!(got.len() <= 1, "worker {i} asked for one job: {got:?}");
        leased.extend(got.into_iter().map(|j| (i as u64, j)));
    }
    let mut ids: Vec<JobId> = leased.iter().map(|(_, j)| j.id).collect();
    ids.sort();
    assert_eq!(ids, enqueued, "each job leased once, all six leased");
    for (i, j) in &leased {
        let end = at(10).saturating_add(std::time::Duration::from_secs(i + 1));
        assert_eq!(j.lease_expires_at, end, "worker {i}'s own lease end");
        assert_eq!(
            super::job_view(&s, j.id).await.lease_expires_at,
            Some(end),
            "stored: worker {i}'s own lease end"
        );
    }

    let ack = |k: usize| complete(&s, &leased[k].1, Event::Succeeded, at(500));
    let (a0, a1, a2, a3, a4, a5) = tokio::join!(ack(0), ack(1), ack(2), ack(3), ack(4), ack(5));
    for (k, done) in [a0, a1, a2, a3, a4, a5].into_iter().enumerate() {
        let (worker, job) = &leased[k];
        assert_eq!(done.id, job.id);
        let view = super::job_view(&s, job.id).await;
        assert_eq!(view.state, lazaret_core::JobState::Succeeded);
        let record = view.envelope.history.last().expect("one attempt");
        assert_eq!(
            record.worker_id.as_ref().map(|w| w.as_str()),
            Some(format!("w-{worker}").as_str()),
            "the attempt names the worker that leased it"
        );
    }
    assert!(lease(&s, lease_req(at(600), 10)).await.is_empty());
}
