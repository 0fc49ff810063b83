//! A seeded simulation on the real store: the core's gates (admission,
//! breakers) and the real SQLite store, wrapped in the fault-injecting
//! backend (`lazaret_store::faulty`), driven by producers, logical workers
//! and an operator under a fake clock, every operation recorded in the
//! testkit's history and judged by its checker after a drain
//! (`docs/reliability.md`, "Simulation on the real store").
//!
//! One seed draws every setting (workers, types, tenants, lanes, poison,
//! transient failures, crashes, late acks, breakers, lease length, fault
//! rates, durability) and then every step. The driver is one task that
//! awaits one store call at a time, so the SQLite writer sees one request
//! per group and the same seed gives the same history; workers are
//! logical, interleaved by the seeded scheduler. Time is the fake clock's:
//! a step advances it, a slow commit advances it inside the store call
//! (`Fault::Slow`), and lease expiry, backoff and breaker cooldowns happen
//! because it moved, never by sleeping.
//!
//! `cargo test -p lazaret-store --test it simulation` runs
//! [`CI_SEEDS`] seeds; `LAZARET_SIM_SEEDS=N` runs N, `LAZARET_SIM_SEED=S`
//! replays one (a failure prints the command), `LAZARET_SIM_FIRST=F`
//! starts the range at F (a soak in slices).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use lazaret_core::{
    AdmissionConfig, AdmissionRequest, Backoff, BreakerConfig, Breakers, DeadLetterReason, Entropy,
    ErrorKind, Event, Failure, FailureClass, FairScheduler, Gate, JobId, JobState, JobType, Lane,
    Paused, Policies, SchedulerConfig, SplitMix64, Timestamp, Transition, TypePolicy, Verdict,
    WorkerId, admit, payload_preview,
};
use lazaret_store::{
    AdmissionRecord, Completed, Completion, DeadLetterId, Durability, EnqueueOutcome, FaultRates,
    Faults, FaultyStore, ItemError, JobQuery, LeaseRequest, NewJob, PolicyDecider, SqliteStore,
    Store, StoreError, sqlite::Sqlite,
};
use lazaret_testkit::history::{Handled, History, Op, Recorder, Report, payload_hash};

/// Seeds a plain `cargo test` runs (about a minute in a debug build on
/// two cores; `docs/reliability.md` has the measurement).
pub const CI_SEEDS: u64 = 1_000;
/// Replays one seed.
pub const SEED_VAR: &str = "LAZARET_SIM_SEED";
/// How many seeds to run.
pub const SEEDS_VAR: &str = "LAZARET_SIM_SEEDS";
/// The first seed of the range.
pub const FIRST_VAR: &str = "LAZARET_SIM_FIRST";

/// The fake clock starts here (ms since the epoch; never the wall clock).
const T0_MS: i64 = 1_700_000_000_000;
/// Steps before a run that has not drained is a failure (liveness).
const STEPS_MAX: u64 = 50_000;
/// Redrives of one job at most, so every run ends.
const REDRIVES_MAX: u32 = 2;
/// Tries of one ack whose answer failed, before the worker gives up.
const ACK_TRIES_MAX: u32 = 3;

/// The command that replays `seed`.
fn replay(seed: u64) -> String {
    format!("{SEED_VAR}={seed} cargo test -p lazaret-store --test it simulation -- --nocapture")
}

// ---------------------------------------------------------------------------
// Settings, drawn from the seed.

/// What a seed draws before the first step.
#[derive(Clone, Debug)]
struct Settings {
    seed: u64,
    workers: usize,
    jobs: usize,
    types: usize,
    tenants: usize,
    lanes: usize,
    inflight_max: u32,
    /// Per cent of payloads that are not JSON: poison at the door.
    malformed_pct: u64,
    /// Per cent of jobs that never succeed (permanent, transient or
    /// crashing every time).
    poison_pct: u64,
    /// Per cent of deliveries of a healthy job failing transiently.
    transient_pct: u64,
    /// Per cent asking to be deferred.
    defer_pct: u64,
    /// Per cent where the worker vanishes (the lease expires).
    vanish_pct: u64,
    /// Per cent where the worker acks after its lease ran out.
    late_pct: u64,
    /// Per cent of dead letters the operator redrives (once or twice).
    redrive_pct: u64,
    attempts_max: u32,
    crash_loop_max: u32,
    deferrals_max: u32,
    backoff_ms: u64,
    breaker: Option<BreakerConfig>,
    lease_ms: u64,
    /// The largest step of the clock between two actions.
    step_ms: u64,
    faults: FaultRates,
    /// How far a slow commit moves the clock at most.
    slow_ms: u64,
    /// Per mille of steps that start an outage: every write refused for a
    /// few requests (a countdown of `Faults::fail_after`), then healed.
    outage_permille: u64,
    durability: Durability,
}

fn pick(rng: &mut SplitMix64, lo: u64, hi: u64) -> u64 {
    lo + rng.below_inclusive(hi - lo)
}

fn chance(rng: &mut SplitMix64, pct: u64) -> bool {
    rng.below_inclusive(99) < pct
}

impl Settings {
    fn draw(seed: u64) -> Settings {
        let mut r = SplitMix64::new(seed ^ 0x5e77_1265_0000_0000);
        let r = &mut r;
        let faulty = chance(r, 80);
        let rate = |r: &mut SplitMix64, max: u64| {
            if faulty { pick(r, 0, max) as u32 } else { 0 }
        };
        let breaker = chance(r, 60).then(|| BreakerConfig {
            failures_min: pick(r, 2, 6) as u32,
            failure_ratio: pick(r, 3, 9) as f64 / 10.0,
            window: Duration::from_millis(pick(r, 2_000, 20_000)),
            cooldown: Duration::from_millis(pick(r, 200, 5_000)),
            probes: pick(r, 1, 3) as u32,
        });
        Settings {
            seed,
            workers: pick(r, 1, 8) as usize,
            jobs: pick(r, 8, 30) as usize,
            types: pick(r, 1, 3) as usize,
            tenants: pick(r, 1, 3) as usize,
            lanes: pick(r, 1, 2) as usize,
            inflight_max: pick(r, 1, 4) as u32,
            malformed_pct: pick(r, 0, 10),
            poison_pct: pick(r, 0, 20),
            transient_pct: pick(r, 0, 40),
            defer_pct: pick(r, 0, 5),
            vanish_pct: pick(r, 0, 10),
            late_pct: pick(r, 0, 10),
            redrive_pct: pick(r, 0, 60),
            attempts_max: pick(r, 1, 5) as u32,
            crash_loop_max: pick(r, 1, 3) as u32,
            deferrals_max: pick(r, 1, 3) as u32,
            backoff_ms: pick(r, 10, 2_000),
            breaker,
            lease_ms: pick(r, 100, 3_000),
            step_ms: pick(r, 1, 200),
            faults: FaultRates {
                not_applied: rate(r, 60_000),
                answer_lost: rate(r, 60_000),
                slow: rate(r, 60_000),
            },
            slow_ms: pick(r, 1, 5_000),
            outage_permille: if faulty { pick(r, 0, 5) } else { 0 },
            durability: if chance(r, 50) {
                Durability::Full
            } else {
                Durability::Normal
            },
        }
    }

    fn policy(&self) -> TypePolicy {
        TypePolicy {
            attempts_max: self.attempts_max,
            backoff: Backoff {
                base: Duration::from_millis(self.backoff_ms),
                cap: Duration::from_millis(self.backoff_ms * 8),
                floor: Duration::ZERO,
                schedule: Vec::new(),
            },
            crash_loop_max: self.crash_loop_max,
            deferrals_max: self.deferrals_max,
            ..TypePolicy::default()
        }
    }
}

impl fmt::Display for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

// ---------------------------------------------------------------------------
// Jobs and workers.

/// How a job behaves every time it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Nature {
    /// Succeeds unless a drawn transient failure, deferral, crash or late
    /// ack gets in the way.
    Healthy,
    /// Fails permanently every time.
    PoisonPermanent,
    /// Fails transiently every time, until its attempts run out.
    PoisonTransient,
    /// Kills its worker every time, until the crash loop ends it.
    PoisonCrash,
}

#[derive(Clone, Debug)]
struct JobSpec {
    ty: String,
    tenant: String,
    lane: String,
    payload: Vec<u8>,
    malformed: bool,
    nature: Nature,
    /// A redrive (the operator fixed the cause) makes it healthy.
    fixed_by_redrive: bool,
}

/// What a worker does with the job it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Act {
    Succeed,
    Transient,
    Permanent,
    Defer,
    /// Dies with the lease held.
    Vanish,
    /// Succeeds, but acks after the lease ran out.
    Late,
}

#[derive(Clone, Debug)]
struct Held {
    key: String,
    id: JobId,
    token: lazaret_store::LeaseToken,
    act: Act,
    /// When the handler is done and the ack goes out.
    done_at: i64,
    /// Acks tried whose answer failed.
    tries: u32,
}

/// A deliberately broken client, reachable only from these tests, to
/// prove the checker catches what it would do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Breakage {
    /// Takes a lost answer (an error whose request may have been applied)
    /// for a refusal, so it records `Fail` where it should say `Info`, and
    /// drops a job whose enqueue it believes refused.
    LostAnswerIsRefusal,
}

/// What one seed's run gives back.
pub struct Run {
    settings: Settings,
    history: History,
    report: Report,
    /// Faults the wrapper injected.
    injected: u64,
    /// Liveness: the run ended without draining.
    stuck: Option<String>,
}

// ---------------------------------------------------------------------------
// The simulation.

struct Sim {
    s: Settings,
    rng: SplitMix64,
    clock: Arc<AtomicI64>,
    store: FaultyStore<Sqlite>,
    faults: Faults,
    history: Recorder,
    breakers: Breakers,
    admission: AdmissionConfig,
    specs: BTreeMap<String, JobSpec>,
    /// Keys the producer still has to enqueue (again), and not before when.
    to_enqueue: VecDeque<(String, i64)>,
    /// Keys whose enqueue was acknowledged or may have been applied.
    sent: BTreeSet<String>,
    ids: BTreeMap<JobId, String>,
    workers: Vec<Option<Held>>,
    /// Dead letters the operator knows of, not yet redriven or left.
    dead_letters: Vec<(DeadLetterId, String)>,
    redrives: BTreeMap<String, u32>,
    /// An outage in progress: the step it ends at.
    outage_until: Option<u64>,
    steps: u64,
    breakage: Option<Breakage>,
}

fn now_of(clock: &AtomicI64) -> Timestamp {
    Timestamp::from_millis(clock.load(Ordering::SeqCst))
}

impl Sim {
    fn open(s: Settings, breakage: Option<Breakage>, dir: &std::path::Path) -> Sim {
        let mut rng = SplitMix64::new(s.seed);
        let clock = Arc::new(AtomicI64::new(T0_MS));
        let policies = Policies {
            defaults: s.policy(),
            types: std::collections::HashMap::new(),
        };
        let decider = PolicyDecider::with_seed(policies, s.seed.rotate_left(17));
        let scheduler = FairScheduler::new(SchedulerConfig::new(s.inflight_max))
            .expect("a valid scheduler config");
        let store = SqliteStore::open(dir, s.durability, scheduler, Arc::new(decider))
            .expect("open the SQLite store");
        let (store, faults) = store.with_faults();
        faults.at_random(rng.next_u64(), s.faults);
        let (slow_clock, slow_max) = (clock.clone(), s.slow_ms);
        let slow_rng = std::sync::Mutex::new(SplitMix64::new(rng.next_u64()));
        faults.on_slow(move || {
            let d = slow_rng
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .below_inclusive(slow_max - 1)
                + 1;
            slow_clock.fetch_add(d as i64, Ordering::SeqCst);
        });
        let history_clock = clock.clone();
        let history = Recorder::with_clock(move || {
            let ms = history_clock.load(Ordering::SeqCst) - T0_MS;
            u64::try_from(ms).unwrap_or(0) * 1_000_000
        });
        let breakers = Breakers::new(s.breaker, BTreeMap::new());
        let mut specs = BTreeMap::new();
        let mut to_enqueue = VecDeque::new();
        for n in 0..s.jobs {
            let key = format!("k{n:03}");
            let malformed = chance(&mut rng, s.malformed_pct);
            let nature = if chance(&mut rng, s.poison_pct) {
                match rng.below_inclusive(2) {
                    0 => Nature::PoisonPermanent,
                    1 => Nature::PoisonTransient,
                    _ => Nature::PoisonCrash,
                }
            } else {
                Nature::Healthy
            };
            let payload = if malformed {
                format!("{{\"n\": {n}, ").into_bytes()
            } else {
                format!("{{\"n\":{n},\"seed\":{}}}", s.seed).into_bytes()
            };
            let spec = JobSpec {
                ty: format!("t{}", rng.below_inclusive(s.types as u64 - 1)),
                tenant: format!("tenant{}", rng.below_inclusive(s.tenants as u64 - 1)),
                lane: format!("lane{}", rng.below_inclusive(s.lanes as u64 - 1)),
                payload,
                malformed,
                nature,
                fixed_by_redrive: chance(&mut rng, 50),
            };
            specs.insert(key.clone(), spec);
            to_enqueue.push_back((key, T0_MS));
        }
        let workers = vec![None; s.workers];
        Sim {
            s,
            rng,
            clock,
            store,
            faults,
            history,
            breakers,
            admission: AdmissionConfig::default(),
            specs,
            to_enqueue,
            sent: BTreeSet::new(),
            ids: BTreeMap::new(),
            workers,
            dead_letters: Vec::new(),
            redrives: BTreeMap::new(),
            outage_until: None,
            steps: 0,
            breakage,
        }
    }

    fn now(&self) -> Timestamp {
        now_of(&self.clock)
    }

    fn ms(&self) -> i64 {
        self.clock.load(Ordering::SeqCst)
    }

    fn advance(&self, ms: u64) {
        self.clock.fetch_add(ms as i64, Ordering::SeqCst);
    }

    fn gate<T>(&mut self, f: impl FnOnce(&mut Gate<'_>) -> T) -> T {
        let paused = Paused::default();
        let park_lanes = BTreeSet::new();
        f(&mut Gate {
            paused: &paused,
            breakers: &mut self.breakers,
            park_lanes: &park_lanes,
        })
    }

    /// Feeds applied outcomes to the breakers, as the server's `observe`.
    fn observe(&mut self, done: &[Completed]) {
        let now = self.now();
        for c in done {
            self.breakers
                .observe(&c.job_type, c.transition, c.class, c.kind.as_ref(), now);
        }
        while self.breakers.poll_transition().is_some() {}
    }

    /// Whether an error left the request's fate unknown (`Info`), or
    /// (`false`) it was surely not applied.
    fn unknown(&self, e: &StoreError) -> bool {
        match e {
            StoreError::NotApplied(_) => false,
            _ => self.breakage != Some(Breakage::LostAnswerIsRefusal),
        }
    }

    /// Records the dead letter an outcome or expiry wrote, as the store
    /// shows it.
    async fn record_dead_letter(&mut self, key: &str, dl: DeadLetterId) {
        let read = self
            .store
            .dead_letter(dl)
            .await
            .expect("read a dead letter");
        let Some(d) = read else {
            // Gone already: nothing was recorded, the checker's observation
            // after the drain decides.
            return;
        };
        let payload = self
            .store
            .dead_letter_payload(dl)
            .await
            .expect("read a dead letter's payload")
            .flatten();
        self.history.observe(Op::DeadLetter {
            id: key.to_owned(),
            dead_letter_id: dl.to_string(),
            has_history: !d.history.is_empty(),
            has_payload: payload.is_some(),
            payload_hash: payload.as_deref().map(payload_hash),
        });
        if chance(&mut self.rng, self.s.redrive_pct)
            && self.redrives.get(key).copied().unwrap_or(0) < REDRIVES_MAX
        {
            self.dead_letters.push((dl, key.to_owned()));
        }
    }

    async fn after_completions(&mut self, done: Vec<Completed>) {
        self.observe(&done);
        for c in done {
            let (Transition::DeadLetter { .. }, Some(dl)) = (c.transition, c.dead_letter) else {
                continue;
            };
            // A job only the store knows (every answer about it lost):
            // its key is in its envelope.
            if !self.ids.contains_key(&c.id)
                && let Some(v) = self.store.job(c.id).await.expect("read a job")
                && let Some(key) = v.envelope.idempotency_key
            {
                self.ids.insert(c.id, key);
            }
            if let Some(key) = self.ids.get(&c.id).cloned() {
                self.record_dead_letter(&key, dl).await;
            }
        }
    }

    // -- The producer ------------------------------------------------------

    async fn produce(&mut self) {
        let Some(i) = self.to_enqueue.iter().position(|(_, at)| *at <= self.ms()) else {
            return;
        };
        let (key, _) = self.to_enqueue.remove(i).expect("a position found");
        let spec = self.specs[&key].clone();
        let now = self.now();
        let shed = self.gate(|g| g.shed(&JobType::new(&spec.ty), &Lane::new(&spec.lane), now));
        let verdict = admit(
            &self.admission,
            &AdmissionRequest {
                job_type: Some(&spec.ty),
                tenant: Some(&spec.tenant),
                schema_version: None,
                payload: &spec.payload,
                declared_size: None,
                shed,
            },
        );
        let call = self.history.invoke(Op::Enqueue {
            id: key.clone(),
            payload_hash: payload_hash(&spec.payload),
        });
        match verdict {
            Verdict::Admitted { schema_version } => {
                let job = NewJob {
                    job_type: spec.ty.as_str().into(),
                    tenant: spec.tenant.as_str().into(),
                    lane: spec.lane.as_str().into(),
                    payload: spec.payload.clone(),
                    idempotency_key: Some(key.clone()),
                    schema_version,
                    run_at: now,
                    now,
                    enqueued_by: None,
                    traceparent: None,
                };
                match self.store.enqueue(vec![job]).await {
                    Ok(out) => match out[..] {
                        [
                            EnqueueOutcome::Created { id, .. }
                            | EnqueueOutcome::Duplicate { id, .. },
                        ] => {
                            call.ok();
                            self.ids.insert(id, key.clone());
                            self.sent.insert(key);
                        }
                        _ => {
                            call.fail();
                            self.retry_enqueue(key, 100);
                        }
                    },
                    Err(e) => {
                        if self.unknown(&e) {
                            call.info();
                            self.sent.insert(key.clone());
                        } else {
                            call.fail();
                            if self.breakage == Some(Breakage::LostAnswerIsRefusal) {
                                // It believes nothing was written, and
                                // drops the job.
                                return;
                            }
                        }
                        // A producer that saw an error sends again, with
                        // the same idempotency key.
                        self.retry_enqueue(key, 50);
                    }
                }
            }
            Verdict::Poison {
                reason, message, ..
            } => {
                call.fail();
                assert!(spec.malformed, "{key} admitted as poison: {message}");
                // The admission record; its loss is the server's to log.
                let _ = self
                    .store
                    .record_admission(AdmissionRecord {
                        job_type: Some(spec.ty.clone()),
                        tenant: Some(spec.tenant.clone()),
                        lane: Some(spec.lane.clone()),
                        reason: DeadLetterReason::from_poison(reason),
                        message,
                        payload_size: spec.payload.len() as u64,
                        payload_sha256: None,
                        payload_preview: payload_preview(&spec.payload, 64).into_owned(),
                        payload: Some(spec.payload.clone()),
                        idempotency_key: Some(key),
                        now,
                    })
                    .await;
            }
            Verdict::Shed { retry_after, .. } => {
                call.fail();
                // Shed while a breaker is open or half-open: sent again
                // after `Retry-After`. A half-open breaker with nothing
                // left to probe closes after a cooldown (seed 990 found
                // one that never did, and the type was shed for good).
                self.retry_enqueue(key, retry_after.as_millis() as u64);
            }
            other => panic!("{key}: unexpected verdict {other:?}"),
        }
    }

    fn retry_enqueue(&mut self, key: String, after_ms: u64) {
        let at = self.ms() + after_ms as i64;
        self.to_enqueue.push_back((key, at));
    }

    // -- Workers -----------------------------------------------------------

    fn act_for(&mut self, spec: &JobSpec, redriven: bool) -> Act {
        let nature = if redriven && spec.fixed_by_redrive {
            Nature::Healthy
        } else {
            spec.nature
        };
        match nature {
            Nature::PoisonPermanent => Act::Permanent,
            Nature::PoisonTransient => Act::Transient,
            Nature::PoisonCrash => Act::Vanish,
            Nature::Healthy => {
                let s = &self.s;
                let (v, l, t, d) = (s.vanish_pct, s.late_pct, s.transient_pct, s.defer_pct);
                let roll = self.rng.below_inclusive(99);
                if roll < v {
                    Act::Vanish
                } else if roll < v + l {
                    Act::Late
                } else if roll < v + l + t {
                    Act::Transient
                } else if roll < v + l + t + d {
                    Act::Defer
                } else {
                    Act::Succeed
                }
            }
        }
    }

    async fn lease(&mut self, w: usize) {
        let now = self.now();
        let filters = self.gate(|g| g.lease_filter(None, 1, now));
        let req = LeaseRequest {
            worker_id: WorkerId::new(format!("w{w}")),
            lanes: None,
            types: None,
            exclude_types: filters.exclude_types,
            exclude_lanes: filters.exclude_lanes,
            type_limits: filters.type_limits,
            max_jobs: 1,
            lease: Duration::from_millis(self.s.lease_ms),
            now,
        };
        // Invoked before the call with what is known; completed with the
        // job it got, or failed when it got none.
        let call = self.history.invoke(Op::Lease {
            id: String::new(),
            token: String::new(),
            attempt: 0,
            ttl_ms: Some(self.s.lease_ms),
            payload_hash: None,
        });
        let leased = self.store.lease(req).await;
        {
            let jobs = leased.as_deref().unwrap_or_default();
            for r in filters.reservations {
                let used = jobs.iter().filter(|j| &j.job_type == r.job_type()).count();
                self.breakers.refund(r, used as u32);
            }
        }
        let job = match leased {
            Ok(mut jobs) if !jobs.is_empty() => jobs.remove(0),
            // No job, or refused: nothing this worker holds.
            Ok(_) => return call.fail(),
            // A lost answer: a lease may have been granted, whose job
            // nobody knows; it expires like a vanished worker's.
            Err(e) if self.unknown(&e) => return call.info(),
            Err(_) => return call.fail(),
        };
        let key = job
            .idempotency_key
            .clone()
            .expect("every simulated job has a key");
        call.ok_with(Op::Lease {
            id: key.clone(),
            token: job.lease_token.0.to_string(),
            attempt: job.attempt,
            ttl_ms: Some(self.s.lease_ms),
            payload_hash: Some(payload_hash(&job.payload)),
        });
        self.ids.insert(job.id, key.clone());
        let spec = self.specs[&key].clone();
        let redriven = self.redrives.get(&key).copied().unwrap_or(0) > 0;
        let act = self.act_for(&spec, redriven);
        let lease_ms = self.s.lease_ms as i64;
        let run = match act {
            Act::Late => lease_ms + pick(&mut self.rng, 0, 500) as i64,
            _ => pick(&mut self.rng, 0, (self.s.lease_ms * 3 / 4).max(1)) as i64,
        };
        self.workers[w] = Some(Held {
            key,
            id: job.id,
            token: job.lease_token,
            act,
            done_at: self.ms() + run,
            tries: 0,
        });
    }

    async fn finish(&mut self, w: usize) {
        let Some(mut held) = self.workers[w].take() else {
            return;
        };
        if held.done_at > self.ms() {
            self.workers[w] = Some(held);
            return;
        }
        let (event, result) = match held.act {
            // The worker died: no ack, the lease expires.
            Act::Vanish => return,
            Act::Succeed | Act::Late => (Event::Succeeded, Handled::Success),
            Act::Transient => (
                Event::Failed(Failure {
                    class: Some(FailureClass::Transient),
                    ..Failure::new(ErrorKind::new("timeout"), "the downstream timed out")
                }),
                Handled::Transient,
            ),
            Act::Permanent => (
                Event::Failed(Failure {
                    class: Some(FailureClass::Permanent),
                    ..Failure::new(ErrorKind::new("bad_input"), "the input cannot be handled")
                }),
                Handled::Permanent,
            ),
            Act::Defer => (
                Event::Failed(Failure {
                    class: Some(FailureClass::Deferred),
                    retry_after: Some(Duration::from_millis(pick(&mut self.rng, 10, 1_000))),
                    ..Failure::new(ErrorKind::new("rate_limited"), "asked to wait")
                }),
                Handled::Deferred,
            ),
        };
        let call = self.history.invoke(Op::Ack {
            id: held.key.clone(),
            token: held.token.0.to_string(),
            result,
            answer: None,
        });
        let now = self.now();
        let done = self
            .store
            .complete(
                vec![Completion {
                    id: held.id,
                    token: held.token,
                    event,
                }],
                now,
            )
            .await;
        match done {
            Ok(mut results) => match results.remove(0) {
                Ok(c) => {
                    call.ok();
                    self.after_completions(vec![c]).await;
                }
                Err(e) => {
                    let answer = match e {
                        ItemError::LeaseLost => "LEASE_LOST",
                        ItemError::NotFound => "NOT_FOUND",
                    };
                    call.complete_with(
                        lazaret_testkit::history::Outcome::Fail,
                        Op::Ack {
                            id: held.key.clone(),
                            token: held.token.0.to_string(),
                            result,
                            answer: Some(answer.into()),
                        },
                    );
                }
            },
            Err(e) => {
                if self.unknown(&e) {
                    call.info();
                } else {
                    call.fail();
                }
                // As the worker runtime does on an error answer: try the
                // ack again, a few times.
                held.tries += 1;
                if held.tries < ACK_TRIES_MAX {
                    self.workers[w] = Some(held);
                }
            }
        }
    }

    // -- Housekeeping and the operator ---------------------------------------

    async fn tick(&mut self) {
        let now = self.now();
        if let Ok(t) = self.store.tick(now).await {
            self.after_completions(t.expired).await;
        }
        let _ = self.breakers.snapshot(now);
        while self.breakers.poll_transition().is_some() {}
    }

    async fn redrive(&mut self) {
        if self.dead_letters.is_empty() {
            return;
        }
        let i = self.rng.below_inclusive(self.dead_letters.len() as u64 - 1) as usize;
        let (dl, key) = self.dead_letters.swap_remove(i);
        let call = self.history.invoke(Op::Redrive { id: key.clone() });
        let applied = match self.store.redrive(vec![dl], self.now(), None).await {
            Ok(ids) => !ids.is_empty(),
            Err(StoreError::NotApplied(_)) => false,
            // A lost answer: resolved by looking before anything else
            // happens (an unknown redrive must not be recorded `Ok`).
            Err(_) => self
                .store
                .dead_letter(dl)
                .await
                .expect("read a dead letter")
                .is_none(),
        };
        if applied {
            call.ok();
            *self.redrives.entry(key).or_insert(0) += 1;
        } else {
            call.fail();
            self.dead_letters.push((dl, key));
        }
    }

    fn nemesis(&mut self) {
        match self.outage_until {
            Some(end) if self.steps >= end => {
                self.outage_until = None;
                self.faults.heal();
                self.faults.at_random(self.rng.next_u64(), self.s.faults);
            }
            None if self.rng.below_inclusive(999) < self.s.outage_permille => {
                let fault = if chance(&mut self.rng, 50) {
                    lazaret_store::Fault::NotApplied
                } else {
                    lazaret_store::Fault::AnswerLost
                };
                self.faults.fail_after(0, fault);
                self.history.observe(Op::Fault {
                    what: format!("outage: every write {fault:?}"),
                });
                self.outage_until = Some(self.steps + pick(&mut self.rng, 1, 20));
            }
            _ => {}
        }
    }

    // -- The loop ------------------------------------------------------------

    /// One step: the clock moves, then one actor acts.
    async fn step(&mut self, draining: bool) {
        self.steps += 1;
        // The drain takes longer strides: a small step would spend its
        // budget of steps waiting out backoffs and leases.
        let stride = if draining {
            self.s.step_ms.max(100)
        } else {
            self.s.step_ms
        };
        let step_ms = pick(&mut self.rng, 1, stride);
        self.advance(step_ms);
        if !draining {
            self.nemesis();
        }
        let roll = self.rng.below_inclusive(99);
        if roll < 25 && !self.to_enqueue.is_empty() {
            self.produce().await;
        } else if roll < 35 {
            self.tick().await;
        } else if roll < 40 {
            self.redrive().await;
        } else {
            let w = self.rng.below_inclusive(self.s.workers as u64 - 1) as usize;
            if self.workers[w].is_some() {
                self.finish(w).await;
            } else {
                self.lease(w).await;
            }
        }
    }

    /// Whether nothing is left to do: nothing to enqueue, no worker
    /// holding a job, no operator work, and no job the store still holds
    /// in line.
    async fn drained(&self) -> bool {
        if !self.to_enqueue.is_empty()
            || self.workers.iter().any(Option::is_some)
            || !self.dead_letters.is_empty()
        {
            return false;
        }
        for state in [JobState::Queued, JobState::Scheduled, JobState::Leased] {
            let (page, _) = self
                .store
                .jobs(JobQuery {
                    state: Some(state),
                    limit: 1,
                    ..JobQuery::default()
                })
                .await
                .expect("list jobs");
            if !page.is_empty() {
                return false;
            }
        }
        true
    }

    /// After the drain: what became of every job that may exist.
    async fn observe_final(&mut self) {
        let mut by_key: BTreeMap<String, JobId> =
            self.ids.iter().map(|(id, k)| (k.clone(), *id)).collect();
        // A job whose enqueue and leases all lost their answers is known
        // to the store only: found by its key, so it is judged too.
        let (all, _) = self
            .store
            .jobs(JobQuery {
                limit: 10_000,
                ..JobQuery::default()
            })
            .await
            .expect("list jobs");
        for v in all {
            if let Some(key) = v.envelope.idempotency_key.clone() {
                by_key.entry(key).or_insert(v.envelope.id);
            }
        }
        for key in &self.sent {
            let Some(&id) = by_key.get(key) else {
                continue;
            };
            let view = self.store.job(id).await.expect("read a job");
            let Some(v) = view else { continue };
            match v.state {
                JobState::Succeeded => self
                    .history
                    .observe(Op::ObservedCompleted { id: key.clone() }),
                JobState::DeadLettered => {
                    // A dead-lettered job without its letter is observed as
                    // nothing: the checker calls it lost.
                    let Some(dl) = v.dead_letter_id else { continue };
                    let Some(d) = self
                        .store
                        .dead_letter(dl)
                        .await
                        .expect("read a dead letter")
                    else {
                        continue;
                    };
                    let payload = self
                        .store
                        .dead_letter_payload(dl)
                        .await
                        .expect("read a payload")
                        .flatten();
                    self.history.observe(Op::ObservedDeadLetter {
                        id: key.clone(),
                        dead_letter_id: dl.to_string(),
                        has_history: !d.history.is_empty(),
                        has_payload: payload.is_some(),
                        payload_hash: payload.as_deref().map(payload_hash),
                    });
                }
                _ => self
                    .history
                    .observe(Op::ObservedRemaining { id: key.clone() }),
            }
        }
    }

    async fn run(mut self) -> Run {
        let mut stuck = None;
        // The load: until every job was sent and the workers are idle.
        while !self.to_enqueue.is_empty() && self.steps < STEPS_MAX {
            self.step(false).await;
        }
        // The drain: faults healed (a store that keeps failing never
        // drains), the clock moving until nothing is left in line.
        self.faults.heal();
        self.outage_until = None;
        loop {
            if self.steps >= STEPS_MAX {
                stuck = Some(format!(
                    "not drained after {STEPS_MAX} steps: to enqueue {:?}, workers {:?}, \
                     dead letters to redrive {:?}",
                    self.to_enqueue, self.workers, self.dead_letters
                ));
                break;
            }
            if self.steps % 16 == 0 && self.drained().await {
                break;
            }
            self.step(true).await;
        }
        // Every expired lease reaped, so each job's state is final.
        self.advance(self.s.lease_ms + 1);
        self.tick().await;
        self.observe_final().await;
        let injected = self.faults.injected();
        self.store.close().await.expect("close the store");
        let history = self.history.history();
        let report = history.check();
        Run {
            settings: self.s,
            history,
            report,
            injected,
            stuck,
        }
    }
}

/// Runs one seed to its report.
pub async fn run_seed(seed: u64, breakage: Option<Breakage>) -> Run {
    run_settings(Settings::draw(seed), breakage).await
}

async fn run_settings(settings: Settings, breakage: Option<Breakage>) -> Run {
    let shm = std::path::Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        tempfile::TempDir::new_in(shm)
    } else {
        tempfile::TempDir::new()
    }
    .expect("a temporary directory");
    Sim::open(settings, breakage, dir.path()).run().await
}

impl Run {
    /// Leases of one job in one generation at most: every lease charges
    /// an attempt but a deferred one, and `deferrals_max` deferrals
    /// reschedule (the next dead-letters).
    fn deliveries_max(&self) -> usize {
        (self.settings.attempts_max + self.settings.deferrals_max + 1) as usize
    }

    fn failed(&self) -> bool {
        !self.report.is_ok()
            || self.stuck.is_some()
            || self.report.deliveries_max > self.deliveries_max()
    }

    /// What a failing seed prints: the seed, its settings, the report and
    /// the replay command.
    fn explain(&self) -> String {
        let path = lazaret_testkit::history::dump_path(&format!("sim-{}", self.settings.seed));
        let saved = match self.history.write_jsonl(&path) {
            Ok(()) => format!("history written to {}", path.display()),
            Err(e) => format!("could not write the history: {e}"),
        };
        let looped = (self.report.deliveries_max > self.deliveries_max()).then(|| {
            format!(
                "a job was leased {} times in one generation, more than its budget of {}",
                self.report.deliveries_max,
                self.deliveries_max()
            )
        });
        let why: Vec<&str> = self
            .stuck
            .iter()
            .chain(&looped)
            .map(String::as_str)
            .collect();
        format!(
            "seed {} failed{}\nsettings: {}\n{}\n{saved}\nreplay: {}",
            self.settings.seed,
            if why.is_empty() {
                String::new()
            } else {
                format!(" ({})", why.join("; "))
            },
            self.settings,
            self.report,
            replay(self.settings.seed)
        )
    }
}

fn env_u64(var: &str) -> Option<u64> {
    let v = std::env::var(var).ok()?;
    Some(
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{var}={v:?} is not a whole number")),
    )
}

/// The seeds to run: the one of `LAZARET_SIM_SEED`, or `LAZARET_SIM_SEEDS`
/// (default [`CI_SEEDS`]) from `LAZARET_SIM_FIRST` (default 0).
fn seeds() -> std::ops::Range<u64> {
    if let Some(seed) = env_u64(SEED_VAR) {
        return seed..seed + 1;
    }
    let first = env_u64(FIRST_VAR).unwrap_or(0);
    first..first + env_u64(SEEDS_VAR).unwrap_or(CI_SEEDS)
}

/// Runs `seeds` on `threads` threads (each its own runtime and stores);
/// the failures, and the totals.
fn run_many(seeds: std::ops::Range<u64>, threads: u64) -> (Vec<String>, Totals) {
    let next = Arc::new(AtomicI64::new(seeds.start as i64));
    let end = seeds.end as i64;
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let next = next.clone();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime");
                let mut failures = Vec::new();
                let mut totals = Totals::default();
                loop {
                    let seed = next.fetch_add(1, Ordering::SeqCst);
                    if seed >= end {
                        break;
                    }
                    let run = rt.block_on(run_seed(seed as u64, None));
                    totals.add(&run);
                    if run.failed() {
                        failures.push(run.explain());
                    }
                }
                (failures, totals)
            })
        })
        .collect();
    let mut failures = Vec::new();
    let mut totals = Totals::default();
    for h in handles {
        let (f, t) = h.join().expect("a simulation thread panicked");
        failures.extend(f);
        totals.merge(&t);
    }
    (failures, totals)
}

#[derive(Debug, Default)]
struct Totals {
    seeds: u64,
    operations: u64,
    acknowledged: u64,
    completed: u64,
    dead_lettered: u64,
    recovered: u64,
    indeterminate: u64,
    faults: u64,
    anomalies: u64,
}

impl Totals {
    fn add(&mut self, r: &Run) {
        self.seeds += 1;
        self.operations += r.report.operations as u64;
        self.acknowledged += r.report.acknowledged as u64;
        self.completed += r.report.completed as u64;
        self.dead_lettered += r.report.dead_lettered as u64;
        self.recovered += r.report.recovered as u64;
        self.indeterminate += r.report.indeterminate as u64;
        self.faults += r.injected;
        self.anomalies += r.report.anomalies.len() as u64;
    }

    fn merge(&mut self, o: &Totals) {
        self.seeds += o.seeds;
        self.operations += o.operations;
        self.acknowledged += o.acknowledged;
        self.completed += o.completed;
        self.dead_lettered += o.dead_lettered;
        self.recovered += o.recovered;
        self.indeterminate += o.indeterminate;
        self.faults += o.faults;
        self.anomalies += o.anomalies;
    }
}

impl fmt::Display for Totals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} seeds, {} operations: {} jobs acknowledged, {} completed, {} dead-lettered, \
             {} recovered, {} indeterminate; {} faults injected; {} anomalies",
            self.seeds,
            self.operations,
            self.acknowledged,
            self.completed,
            self.dead_lettered,
            self.recovered,
            self.indeterminate,
            self.faults,
            self.anomalies
        )
    }
}

#[test]
fn seeds_pass_the_checker() {
    let seeds = seeds();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get() as u64);
    let started = Instant::now();
    let (failures, totals) = run_many(seeds.clone(), threads.clamp(1, 8));
    eprintln!(
        "simulation: seeds {}..{}: {totals} in {:.1?}",
        seeds.start,
        seeds.end,
        started.elapsed()
    );
    assert!(
        failures.is_empty(),
        "{} of {} seeds failed:\n\n{}",
        failures.len(),
        totals.seeds,
        failures.join("\n\n")
    );
    assert_eq!(totals.anomalies, 0);
}

#[tokio::test]
async fn one_seed_twice_gives_one_history() {
    // A seed with faults, breakers and several workers.
    let seed = (0..)
        .find(|&s| {
            let d = Settings::draw(s);
            d.workers >= 3 && d.breaker.is_some() && d.faults.answer_lost > 0 && d.faults.slow > 0
        })
        .expect("such a seed");
    let first = run_seed(seed, None).await;
    let second = run_seed(seed, None).await;
    assert!(!first.failed(), "{}", first.explain());
    assert!(first.report.operations > 50, "{}", first.report);
    assert_eq!(
        first.history.to_jsonl(),
        second.history.to_jsonl(),
        "seed {seed} gave two histories; replay: {}",
        replay(seed)
    );
}

#[tokio::test]
async fn a_client_taking_lost_answers_for_refusals_is_caught() {
    // Many lost answers, so enqueues and acks are applied while the broken
    // client records them as refused.
    let mut caught = 0;
    for seed in 0..5 {
        let mut s = Settings::draw(seed);
        s.faults = FaultRates {
            not_applied: 0,
            answer_lost: 200_000,
            slow: 0,
        };
        s.malformed_pct = 0;
        let run = run_settings(s, Some(Breakage::LostAnswerIsRefusal)).await;
        let unexpected = run
            .report
            .count(lazaret_testkit::history::AnomalyKind::Unexpected);
        assert!(
            unexpected > 0,
            "seed {seed}: the checker missed an enqueue recorded failed yet applied\n{}",
            run.report
        );
        caught += unexpected;
    }
    assert!(caught >= 5);
}
