//! Criterion benchmarks of the hot decisions: `decide` and `pick`.
//!
//! Run with `cargo bench -p lazaret-core --bench core`; medians go in
//! `docs/benchmarks.md`.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use lazaret_core::{
    Demand, Envelope, Event, Failure, FairScheduler, JobId, Lane, SchedulerConfig, SplitMix64,
    TenantId, Timestamp, TypePolicy, decide, grant_lease,
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

fn bench_pick(c: &mut Criterion) {
    for tenants in [10usize, 1000] {
        let lanes = [Lane::new("interactive"), Lane::new("batch")];
        let names: Vec<TenantId> = (0..tenants)
            .map(|i| TenantId::new(format!("tenant-{i}")))
            .collect();
        let demand: Vec<Demand<'_>> = lanes
            .iter()
            .flat_map(|lane| {
                names.iter().map(move |tenant| Demand {
                    lane,
                    tenant,
                    ready: 1000,
                    inflight: 1,
                })
            })
            .collect();
        let config = SchedulerConfig::new(4)
            .with_lane_weight("interactive", 4)
            .with_lane_weight("batch", 1);
        let mut scheduler = FairScheduler::new(config).expect("valid config");
        let mut grants = Vec::new();
        c.bench_function(&format!("pick/100_of_{}_rows", demand.len()), |b| {
            b.iter(|| {
                scheduler.pick(black_box(&demand), 100, &mut grants);
                black_box(grants.len())
            })
        });
    }
}

criterion_group!(benches, bench_decide, bench_pick);
criterion_main!(benches);
