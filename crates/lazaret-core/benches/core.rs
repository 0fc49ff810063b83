//! Criterion benchmarks of the hot decisions: `decide` and `pick`.
//!
//! Run with `cargo bench -p lazaret-core --bench core`; medians go in
//! `docs/benchmarks.md`.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use lazaret_core::{
    Envelope, Event, Failure, JobId, Lane, SplitMix64, Timestamp, TypePolicy, decide, grant_lease,
};

fn bench_decide(c: &mut Criterion) {
    let policy = TypePolicy::default();
    let base = Envelope::new(
        JobId(1),
        "send_email".into(),
        "acme".into(),
        Lane::default_lane(),
        b"{}",
        Timestamp::EPOCH,
    );
    let worker = "w-1".into();
    let mut rng = SplitMix64::new(1);

    c.bench_function("decide/success", |b| {
        b.iter_batched_ref(
            || {
                let mut env = base.clone();
                grant_lease(&mut env, Some(&worker), Timestamp::from_millis(1));
                env
            },
            |env| {
                black_box(decide(
                    env,
                    &policy,
                    Event::Succeeded,
                    Timestamp::from_millis(2),
                    &mut rng,
                ))
            },
            criterion::BatchSize::SmallInput,
        )
    });
    c.bench_function("decide/transient_failure", |b| {
        b.iter_batched_ref(
            || {
                let mut env = base.clone();
                grant_lease(&mut env, Some(&worker), Timestamp::from_millis(1));
                (
                    env,
                    Event::Failed(Failure::new("timeout", "timeout after 30s")),
                )
            },
            |(env, ev)| {
                let ev = std::mem::replace(ev, Event::Succeeded);
                black_box(decide(
                    env,
                    &policy,
                    ev,
                    Timestamp::from_millis(2),
                    &mut rng,
                ))
            },
            criterion::BatchSize::SmallInput,
        )
    });
}

criterion_group!(benches, bench_decide);
criterion_main!(benches);
