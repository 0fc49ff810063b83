//! A seeded simulation: many tenants, thousands of jobs, a fake clock, faults.
//!
//! The real core decides; a tiny in-memory store applies its transitions;
//! workers lease, run scripted outcomes, vanish, or crash between `decide`
//! and persisting it; operators cancel jobs at random. At the end every job
//! must be succeeded or dead-lettered (none lost, none looping) with the
//! reason an independent oracle predicts from the job's script and the
//! policy, or cancelled: at once if it was waiting, at its next outcome if
//! it was leased (unless that was an ack), and never delivered again.
//!
//! `cargo test` runs a fixed set of seeds. `LAZARET_SIM_SEEDS=N` runs N more;
//! `LAZARET_SIM_SEED=S` replays one.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use lazaret_core::{
    Backoff, CancelDecision, DeadLetterReason, Demand, Entropy, Envelope, Event, Failure,
    FailureClass, FairScheduler, JobId, JobState, Lane, SchedulerConfig, SplitMix64, TenantId,
    Timestamp, Transition, TypePolicy, cancel, decide, grant_lease, settle,
};

/// What one delivery of a job does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Act {
    Succeed,
    Transient,
    Parse,
    Permanent,
    Defer,
    /// The worker vanishes: the lease expires.
    Vanish,
    /// The worker calls decide but dies before the store persists it: the
    /// outcome is lost and the lease expires.
    LoseOutcome,
}

#[derive(Debug)]
struct SimJob {
    env: Envelope,
    state: JobState,
    run_at: Timestamp,
    lease: Option<(u64, Timestamp)>, // (token, expires_at)
    script: Vec<Act>,
    delivery: usize,
    reason: Option<DeadLetterReason>,
    /// An accepted cancel: what it did and how many deliveries had started.
    cancelled: Option<(CancelDecision, usize)>,
}

impl SimJob {
    /// The act for the next delivery (the last act repeats).
    fn next_act(&self) -> Act {
        *self
            .script
            .get(self.delivery)
            .unwrap_or_else(|| self.script.last().expect("scripts are not empty"))
    }
}

/// Predicts the end of a script from the documented rules, independently of
/// `decide`: returns `None` for success or the dead-letter reason.
fn oracle(script: &[Act], p: &TypePolicy, parse_budget: u32) -> Option<DeadLetterReason> {
    let (mut attempts, mut crashes, mut deferrals, mut parses) = (0u32, 0u32, 0u32, 0u32);
    for i in 0.. {
        let act = *script.get(i).unwrap_or_else(|| script.last().unwrap());
        attempts += 1;
        match act {
            Act::Succeed => return None,
            Act::Permanent => return Some(DeadLetterReason::Permanent),
            Act::Defer => {
                attempts -= 1;
                deferrals += 1;
                if deferrals > p.deferrals_max {
                    return Some(DeadLetterReason::DeferralsExhausted);
                }
            }
            Act::Vanish | Act::LoseOutcome => {
                crashes += 1;
                if crashes >= p.crash_loop_max {
                    return Some(DeadLetterReason::CrashLoop);
                }
                if attempts >= p.attempts_max {
                    return Some(DeadLetterReason::Exhausted);
                }
            }
            Act::Parse => {
                parses += 1;
                if parses >= parse_budget {
                    return Some(DeadLetterReason::KindExhausted);
                }
                if attempts >= p.attempts_max {
                    return Some(DeadLetterReason::Exhausted);
                }
            }
            Act::Transient => {
                if attempts >= p.attempts_max {
                    return Some(DeadLetterReason::Exhausted);
                }
            }
        }
    }
    unreachable!()
}

struct Sim {
    rng: SplitMix64,
    policy: TypePolicy,
    parse_budget: u32,
    jobs: BTreeMap<JobId, SimJob>,
    now: Timestamp,
    next_token: u64,
    /// Leases held per worker: (job, token).
    workers: Vec<Vec<(JobId, u64)>>,
    tenants: Vec<String>,
    lease: Duration,
    scheduler: FairScheduler,
    inflight_max: u32,
}

const LANES: [&str; 2] = ["interactive", "batch"];

impl Sim {
    fn new(seed: u64, job_count: usize) -> Self {
        let mut rng = SplitMix64::new(seed);
        let parse_budget = 1 + rng.below_inclusive(2) as u32;
        let mut policy = TypePolicy {
            attempts_max: 2 + rng.below_inclusive(5) as u32,
            crash_loop_max: 1 + rng.below_inclusive(3) as u32,
            deferrals_max: 1 + rng.below_inclusive(6) as u32,
            backoff: Backoff {
                base: Duration::from_millis(10 + rng.below_inclusive(200)),
                cap: Duration::from_millis(5_000),
                floor: Duration::from_millis(rng.below_inclusive(5)),
                schedule: Vec::new(),
            },
            ..TypePolicy::default()
        };
        policy.kinds.insert("parse".into(), parse_budget);
        let inflight_max = 1 + rng.below_inclusive(3) as u32;
        let tenants: Vec<String> = (0..(3 + rng.below_inclusive(20)))
            .map(|i| format!("tenant-{i}"))
            .collect();
        let mut sim = Sim {
            policy,
            parse_budget,
            jobs: BTreeMap::new(),
            now: Timestamp::from_millis(1_700_000_000_000),
            next_token: 1,
            workers: vec![Vec::new(); 2 + rng.below_inclusive(6) as usize],
            tenants,
            lease: Duration::from_millis(500),
            scheduler: FairScheduler::new(
                SchedulerConfig::new(inflight_max)
                    .with_lane_weight("interactive", 4)
                    .with_lane_weight("batch", 1),
            )
            .expect("a valid scheduler config"),
            inflight_max,
            rng,
        };
        for i in 0..job_count {
            sim.admit(JobId(i as u64 + 1));
        }
        sim
    }

    fn admit(&mut self, id: JobId) {
        // Skewed tenants: tenant-0 enqueues a swarm.
        let tenant = if self.rng.below_inclusive(3) == 0 {
            self.tenants[0].clone()
        } else {
            self.tenants[self.rng.below_inclusive(self.tenants.len() as u64 - 1) as usize].clone()
        };
        let lane = LANES[self.rng.below_inclusive(1) as usize];
        let len = 1 + self.rng.below_inclusive(8) as usize;
        let script = (0..len)
            .map(|_| match self.rng.below_inclusive(99) {
                0..=39 => Act::Succeed,
                40..=59 => Act::Transient,
                60..=66 => Act::Parse,
                67..=72 => Act::Permanent,
                73..=84 => Act::Defer,
                85..=92 => Act::Vanish,
                _ => Act::LoseOutcome,
            })
            .collect();
        let env = Envelope::new(
            id,
            "job".into(),
            tenant.as_str().into(),
            Lane::new(lane),
            b"{}",
            self.now,
        );
        self.jobs.insert(
            id,
            SimJob {
                env,
                state: JobState::Queued,
                run_at: self.now,
                lease: None,
                script,
                delivery: 0,
                reason: None,
                cancelled: None,
            },
        );
    }

    /// Ready jobs as the core's fair scheduler picks them (weighted lanes,
    /// round-robin tenants, in-flight caps), oldest first within a pair.
    fn pick(&mut self, max: usize) -> Vec<JobId> {
        let mut ready: BTreeMap<(Lane, TenantId), Vec<JobId>> = BTreeMap::new();
        let mut inflight: BTreeMap<(Lane, TenantId), u32> = BTreeMap::new();
        for (id, j) in &self.jobs {
            let key = (j.env.lane.clone(), j.env.tenant.clone());
            match j.state {
                JobState::Queued if j.run_at <= self.now => ready.entry(key).or_default().push(*id),
                JobState::Leased => *inflight.entry(key).or_default() += 1,
                _ => {}
            }
        }
        let keys: Vec<(Lane, TenantId)> = ready.keys().cloned().collect();
        let demand: Vec<Demand<'_>> = keys
            .iter()
            .map(|k| Demand {
                lane: &k.0,
                tenant: &k.1,
                ready: ready[k].len() as u32,
                inflight: inflight.get(k).copied().unwrap_or(0),
            })
            .collect();
        let mut grants = Vec::new();
        self.scheduler.pick(&demand, max as u32, &mut grants);
        let mut out = Vec::new();
        for g in &grants {
            let key = &keys[g.demand_index];
            let held = inflight.get(key).copied().unwrap_or(0) + g.count;
            assert!(
                held <= self.inflight_max,
                "tenant {} holds {held} leases in lane {}, over its cap",
                key.1,
                key.0
            );
            out.extend(ready[key].iter().take(g.count as usize).copied());
        }
        out
    }

    fn apply(&mut self, id: JobId, event: Event) {
        let now = self.now;
        let job = self.jobs.get_mut(&id).unwrap();
        let from = job.state;
        let decided = decide(&mut job.env, &self.policy, event, now, &mut self.rng);
        let requested = job.cancelled.is_some();
        let tr = settle(&mut job.env, decided, requested);
        let to = tr.next_state(now);
        assert!(
            from.can_become(to),
            "{from} -> {to} is not an edge of the state machine"
        );
        job.state = to;
        job.lease = None;
        match tr {
            Transition::Retry { at, .. } | Transition::Defer { until: at } => job.run_at = at,
            Transition::DeadLetter { reason } => job.reason = Some(reason),
            Transition::Succeeded | Transition::Cancelled => {}
        }
    }

    /// An operator cancels job `id`, as the store applies `cancel`.
    fn cancel(&mut self, id: JobId) {
        let job = self.jobs.get_mut(&id).unwrap();
        let requested = job.cancelled.is_some();
        let decision = cancel(job.state, requested);
        match decision {
            CancelDecision::CancelNow => {
                assert!(job.state.can_become(JobState::Cancelled));
                job.state = JobState::Cancelled;
            }
            CancelDecision::Request => assert_eq!(job.state, JobState::Leased),
            CancelDecision::AlreadyRequested => return,
            CancelDecision::Refuse { state } => {
                assert!(state.is_terminal(), "job {id}: {state} refused a cancel");
                return;
            }
        }
        job.cancelled = Some((decision, job.delivery));
    }

    fn step(&mut self) {
        // Now and then an operator cancels a job, whatever its state.
        if self.rng.below_inclusive(7) == 0 {
            let id = JobId(1 + self.rng.below_inclusive(self.jobs.len() as u64 - 1));
            self.cancel(id);
        }
        // The clock passes run_at: scheduled → queued.
        let now = self.now;
        for j in self.jobs.values_mut() {
            if j.state == JobState::Scheduled && j.run_at <= now {
                j.state = JobState::Queued;
            }
        }
        // Reap expired leases: the attempt is charged to the job that held it.
        let expired: Vec<JobId> = self
            .jobs
            .iter()
            .filter(|(_, j)| {
                j.state == JobState::Leased && j.lease.is_some_and(|(_, exp)| exp <= now)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.apply(id, Event::LeaseExpired);
        }
        // Workers lease what fits, then answer (or not).
        for w in 0..self.workers.len() {
            self.workers[w].clear();
            let want = 1 + self.rng.below_inclusive(3) as usize;
            for id in self.pick(want) {
                let token = self.next_token;
                self.next_token += 1;
                let job = self.jobs.get_mut(&id).unwrap();
                assert!(job.lease.is_none(), "job {id} leased twice");
                let attempt =
                    grant_lease(&mut job.env, Some(&format!("w-{w}").as_str().into()), now);
                assert!(
                    attempt <= self.policy.attempts_max,
                    "job {id} leased as attempt {attempt}"
                );
                job.state = JobState::Leased;
                job.lease = Some((token, now.saturating_add(self.lease)));
                self.workers[w].push((id, token));
            }
            for (id, token) in std::mem::take(&mut self.workers[w]) {
                let job = &self.jobs[&id];
                assert_eq!(
                    job.lease.map(|l| l.0),
                    Some(token),
                    "job {id} is held by two workers"
                );
                let act = job.next_act();
                self.jobs.get_mut(&id).unwrap().delivery += 1;
                // Now and then a cancel arrives while the job runs.
                if self.rng.below_inclusive(19) == 0 {
                    self.cancel(id);
                }
                let event = match act {
                    Act::Succeed => Event::Succeeded,
                    Act::Transient => Event::Failed(Failure::new("timeout", "timeout after 30s")),
                    Act::Parse => Event::Failed(Failure::new("parse", "unexpected token")),
                    Act::Permanent => Event::Failed(
                        Failure::new("validation", "bad").with_class(FailureClass::Permanent),
                    ),
                    Act::Defer => Event::Failed(
                        Failure::new("http_429", "slow down")
                            .with_class(FailureClass::Deferred)
                            .with_retry_after(Duration::from_millis(self.rng.below_inclusive(300))),
                    ),
                    Act::Vanish => continue,
                    Act::LoseOutcome => {
                        // decide ran, the process died before the store persisted it.
                        let mut scratch = self.jobs[&id].env.clone();
                        let _ = decide(
                            &mut scratch,
                            &self.policy,
                            Event::Succeeded,
                            now,
                            &mut self.rng,
                        );
                        continue;
                    }
                };
                self.apply(id, event);
            }
        }
        self.now = self.now.saturating_add(Duration::from_millis(50));
    }

    fn run(&mut self, seed: u64) {
        let replay = format!(
            "replay with: LAZARET_SIM_SEED={seed} cargo test -p lazaret-core --test it sim"
        );
        let mut steps = 0;
        while self.jobs.values().any(|j| !j.state.is_terminal()) {
            self.step();
            steps += 1;
            assert!(
                steps < 200_000,
                "seed {seed}: jobs still looping after {steps} steps; {replay}"
            );
        }
        let mut reasons: HashMap<Option<DeadLetterReason>, usize> = HashMap::new();
        let mut cancels: HashMap<(JobState, bool), usize> = HashMap::new();
        for (id, j) in &self.jobs {
            if let Some((decision, started)) = j.cancelled {
                // Never delivered again once cancelled or asked to cancel.
                assert_eq!(
                    j.delivery, started,
                    "seed {seed}: job {id} was delivered after its cancel; {replay}"
                );
                match (decision, j.state) {
                    (CancelDecision::CancelNow | CancelDecision::Request, JobState::Cancelled) => {}
                    // A leased job's ack stands.
                    (CancelDecision::Request, JobState::Succeeded) => assert_eq!(
                        j.script
                            .get(started - 1)
                            .unwrap_or_else(|| j.script.last().unwrap()),
                        &Act::Succeed,
                        "seed {seed}: job {id} succeeded without an ack; {replay}"
                    ),
                    other => panic!("seed {seed}: job {id} cancelled ({other:?}); {replay}"),
                }
                assert_eq!(
                    j.reason, None,
                    "seed {seed}: job {id} dead-lettered after a cancel"
                );
                *cancels
                    .entry((j.state, decision == CancelDecision::Request))
                    .or_default() += 1;
                continue;
            }
            let predicted = oracle(&j.script, &self.policy, self.parse_budget);
            assert_eq!(
                j.reason, predicted,
                "seed {seed}: job {id} (script {:?}, policy {:?}) ended {:?}, the rules predict {:?}; {replay}",
                j.script, self.policy, j.reason, predicted
            );
            let expected_state = if predicted.is_some() {
                JobState::DeadLettered
            } else {
                JobState::Succeeded
            };
            assert_eq!(j.state, expected_state, "seed {seed}: job {id}; {replay}");
            assert!(
                j.env.attempts <= self.policy.attempts_max,
                "seed {seed}: job {id} over budget; {replay}"
            );
            *reasons.entry(j.reason).or_default() += 1;
        }
        // The run must exercise success and several dead-letter reasons,
        // and cancels of waiting and of leased jobs.
        assert!(
            reasons.len() >= 4,
            "seed {seed}: too few outcomes exercised: {reasons:?}"
        );
        assert!(
            cancels.contains_key(&(JobState::Cancelled, false))
                && cancels.contains_key(&(JobState::Cancelled, true)),
            "seed {seed}: too few cancels exercised: {cancels:?}"
        );
    }
}

fn seeds() -> Vec<u64> {
    if let Ok(s) = std::env::var("LAZARET_SIM_SEED") {
        return vec![s.parse().expect("LAZARET_SIM_SEED must be an integer")];
    }
    let mut seeds: Vec<u64> = (1..=8).collect();
    if let Ok(n) = std::env::var("LAZARET_SIM_SEEDS") {
        let n: u64 = n.parse().expect("LAZARET_SIM_SEEDS must be an integer");
        let mut r = SplitMix64::new(0x5EED);
        seeds.extend((0..n).map(|_| r.next_u64()));
    }
    seeds
}

#[test]
fn every_job_ends_as_the_policy_predicts() {
    for seed in seeds() {
        Sim::new(seed, 2_000).run(seed);
    }
}

#[test]
fn oracle_agrees_with_the_documented_examples() {
    let p = TypePolicy {
        attempts_max: 3,
        crash_loop_max: 2,
        deferrals_max: 2,
        ..TypePolicy::default()
    };
    assert_eq!(oracle(&[Act::Transient, Act::Succeed], &p, 2), None);
    assert_eq!(
        oracle(&[Act::Transient], &p, 2),
        Some(DeadLetterReason::Exhausted)
    );
    assert_eq!(
        oracle(&[Act::Parse], &p, 2),
        Some(DeadLetterReason::KindExhausted)
    );
    assert_eq!(
        oracle(&[Act::Vanish], &p, 2),
        Some(DeadLetterReason::CrashLoop)
    );
    assert_eq!(
        oracle(&[Act::Defer], &p, 2),
        Some(DeadLetterReason::DeferralsExhausted)
    );
    assert_eq!(
        oracle(&[Act::Transient, Act::Permanent], &p, 2),
        Some(DeadLetterReason::Permanent)
    );
}
