//! The `Store` contract, written once and run against every backend (STYLE.md §2).
//!
//! A library other crates import, as River's `riverdrivertest` is: a
//! backend implements [`Backend`] (a factory: a fresh, empty place to keep
//! a store, and an async `open` on it that a case may call again to
//! restart), says where it differs through [`Capabilities`], and runs the
//! whole suite with one line, one `#[tokio::test]` per case:
//!
//! ```text
//! lazaret_store_conformance::conformance_suite!(crate::sqlite::backend);
//! ```
//!
//! where `backend()` returns `Option<impl Backend>`: `None` skips every
//! case (a backend whose service is not configured says so itself, and
//! fails under `CI=true`). Each case takes `&impl Backend`, opens its
//! stores through it and drives them with explicit [`Timestamp`]s, so
//! nothing sleeps and nothing reads the wall clock. Cases are split by
//! concern, one module each, as River splits its driver tests.
//!
//! A backend opens its stores with [`scheduler_config`] and a
//! [`seeded_decider`]: the cases' timings (backoff, crash loop, caps) rely on
//! exactly that policy. A backend with a clock of its own (PostgreSQL's)
//! runs the suite with the caller's clock: the cases pass the times.
//!
//! What it deliberately does not test: anything only one backend has (its
//! files, its schema version, its group-commit failure modes); those live
//! beside the backend.

pub mod audit;
pub mod cancel;
pub mod dead_letters;
pub mod duties;
pub mod enqueue;
pub mod groups;
pub mod housekeeping;
pub mod lease;
pub mod lifecycle;
pub mod listing;
pub mod outcomes;
pub mod redrive;
pub mod signals;
pub mod sources;
pub mod stats;
pub mod tokens;
pub mod traces;

use std::fmt::Write as _;
use std::future::Future;
use std::time::Duration;

use lazaret_core::{
    Backoff, Event, Failure, FailureClass, JobId, SchedulerConfig, Timestamp, TypePolicy,
};
use lazaret_store::{
    Completed, Completion, EnqueueOutcome, ItemError, JobView, LaneCounts, LeaseRequest, LeasedJob,
    NewJob, PolicyDecider, Store, StoreStats,
};

/// What a backend under test provides: fresh places and stores on them.
pub trait Backend: Send + Sync + 'static {
    /// The store it opens.
    type Store: Store;
    /// Where a store keeps its data (a temporary directory, a schema of
    /// its own); dropped at the end of the case, which may clean it up.
    type Place: Send + Sync + 'static;

    /// Where this backend differs from the others.
    fn capabilities(&self) -> Capabilities;

    /// A fresh, empty place, shared with no other case (cases run in
    /// parallel).
    fn place(&self) -> impl Future<Output = Self::Place> + Send;

    /// Opens a store on `place` with [`scheduler_config`] and a
    /// [`seeded_decider`]; panics if it cannot. Called again on the same
    /// place after a close or a drop, it must find everything committed.
    fn open(&self, place: &Self::Place) -> impl Future<Output = Self::Store> + Send;
}

/// Where backends may differ; a case asks instead of assuming.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// `StoreStats::group_commit` is kept, and counts every call that goes
    /// through the writer (enqueue, lease, stats) as one command, and a
    /// call alone as one commit.
    pub group_commit_stats: bool,
    /// Several stores may be open on one place at once (nodes of a
    /// cluster), and [`Store::lead`] gives each duty to one of them.
    pub several_nodes: bool,
}

impl Capabilities {
    /// No optional behaviour.
    pub const fn none() -> Self {
        Capabilities {
            group_commit_stats: false,
            several_nodes: false,
        }
    }

    /// The same, with several nodes on one place.
    pub const fn with_several_nodes(mut self, yes: bool) -> Self {
        self.several_nodes = yes;
        self
    }

    /// The same, with group-commit counters.
    pub const fn with_group_commit_stats(mut self, yes: bool) -> Self {
        self.group_commit_stats = yes;
        self
    }
}

/// Instantiates every conformance case as a `#[tokio::test]` for the backend
/// that the given function (absolute path, e.g. `crate::sqlite::backend`)
/// returns; a `None` skips the cases.
#[macro_export]
macro_rules! conformance_suite {
    ($backend:path) => {
        $crate::conformance_suite!(@concerns $backend;
            enqueue: [
                enqueue_then_lease_gives_the_payload_byte_for_byte,
                idempotent_enqueue_returns_the_first_job,
                duplicate_within_one_batch,
                delayed_job_waits_for_its_time,
                enqueue_reports_the_tenants_inflight,
            ],
            lease: [
                lease_respects_lanes,
                lease_respects_exclude_lanes,
                lease_respects_types,
                a_lease_for_several_types_takes_the_oldest_across_them,
                lease_respects_exclude_types,
                lease_respects_type_limits,
                type_limits_leave_room_for_other_types,
                lease_respects_max_jobs,
                a_new_tenant_is_served_in_the_first_round,
                a_tenant_never_exceeds_its_inflight_cap,
                tenants_take_turns_in_name_order_across_rounds,
                a_lease_looks_at_a_few_tenants_of_thousands,
                concurrent_requests_each_get_their_own_answer,
            ],
            outcomes: [
                ack_marks_succeeded_with_one_history_record,
                wrong_token_is_lease_lost_and_changes_nothing,
                unknown_id_is_not_found,
                transient_failure_retries_after_the_backoff,
                attempts_max_failures_dead_letter_as_exhausted,
                permanent_failure_dead_letters_in_the_same_call,
                deferral_does_not_advance_the_attempt,
                history_reads_right_after_every_step,
                every_lease_of_a_job_gets_a_new_token,
                an_outcome_at_or_after_the_lease_end_is_lease_lost_and_changes_nothing,
            ],
            housekeeping: [
                lease_expiry_charges_an_attempt,
                crash_loop_after_crash_loop_max_expiries,
                heartbeat_extends_the_lease,
                remove_succeeded_deletes_only_old_succeeded_jobs_in_batches,
            ],
            dead_letters: [
                admission_records_are_listed_with_stage_admission,
                dead_letters_page_newest_first_with_cursor_and_filters,
                reasons_group_by_reason_and_type,
                dead_letters_after_an_id_are_read_lowest_first_with_their_failure,
            ],
            redrive: [
                redrive_keeps_id_key_and_history_with_a_fresh_budget,
                redrive_skips_admission_records,
                purge_removes_the_dead_letter_and_its_job,
                a_corrected_redrive_replaces_the_payload_and_keeps_the_original,
            ],
            groups: [
                dead_letters_fall_into_groups_whatever_their_data,
                archived_dead_letters_are_kept_hidden_and_restorable,
                a_redrive_report_follows_its_jobs_to_success_and_failure_again,
                a_lineage_lists_each_redrive_with_its_group_edit_and_redirect,
                a_redirect_never_gives_a_type_two_jobs_with_one_key,
                groups_count_the_dead_letters_held_after_redrives_max,
                the_group_summary_follows_every_change_to_its_dead_letters,
            ],
            sources: [
                a_broker_message_is_quarantined_once_with_its_source_and_payload,
                a_batch_of_quarantines_answers_each_in_order,
                held_retries_come_due_in_order_and_are_replaced_or_dropped,
                held_retries_and_broker_dead_letters_survive_a_restart,
                a_message_reusing_a_quarantined_id_is_a_dead_letter_of_its_own,
                a_message_reusing_a_held_id_is_held_as_a_retry_of_its_own,
                held_retries_are_counted_by_source,
                a_held_retry_is_claimed_by_one_caller_until_its_claim_expires,
                a_redrive_report_follows_broker_messages_to_success_and_failure_again,
                a_copy_seen_back_before_its_dead_letter_leaves_keeps_its_outcome,
            ],
            audit: [
                audit_entries_are_listed_newest_first,
                the_audit_log_pages_by_cursor_and_filters_by_action_and_actor,
                redrive_and_purge_count_onto_their_audit_entry,
            ],
            stats: [
                stats_count_jobs_per_lane,
                stats_count_commits_and_the_commands_in_them,
                stats_time_when_jobs_became_ready_and_were_leased,
            ],
            signals: [
                a_sampling_counts_its_minute_never_lowers_a_count_and_survives_a_restart,
            ],
            tokens: [
                created_tokens_are_listed_oldest_first_and_survive_a_restart,
                a_taken_name_or_secret_is_refused_and_changes_nothing,
                revoke_deletes_the_token_and_audits_it,
                the_enqueuing_tokens_name_is_kept_with_the_job,
            ],
            cancel: [
                a_waiting_job_is_cancelled_at_once_and_never_leased,
                a_leased_job_asked_to_cancel_hears_it_and_ends_cancelled_at_a_fail,
                a_permanent_failure_of_a_cancel_requested_job_writes_no_dead_letter,
                an_ack_after_a_cancel_request_stands,
                a_cancel_requested_lease_that_expires_ends_cancelled,
                a_finished_or_unknown_job_is_refused_and_nothing_is_written,
                retention_removes_old_cancelled_jobs_like_succeeded_ones,
                cancels_survive_a_restart,
            ],
            listing: [
                jobs_page_newest_first_with_cursor_and_filters,
                a_listed_job_shows_its_dead_letter_and_its_cancel,
                pauses_are_kept_across_a_restart_and_audited,
            ],
            duties: [
                one_store_leads_every_duty_and_a_second_takes_over_when_it_goes,
            ],
            traces: [
                a_traceparent_goes_from_enqueue_to_lease_outcome_and_dead_letter,
                a_job_without_a_traceparent_has_none_anywhere,
                a_broker_dead_letter_keeps_its_messages_traceparent,
            ],
            lifecycle: [
                restart_after_close_keeps_everything,
                restart_after_drop_keeps_everything,
                closed_store_refuses_calls,
            ],
        );
    };
    (@concerns $backend:path; $($concern:ident: [$($case:ident),+ $(,)?]),+ $(,)?) => {$(
        mod $concern {$(
            #[::tokio::test]
            async fn $case() {
                if let Some(backend) = $backend() {
                    $crate::$concern::$case(&backend).await;
                }
            }
        )+}
    )+};
}

// ---------------------------------------------------------------------------
// The policy every backend is opened with.

/// Every tenant may hold this many leases per lane (`SchedulerConfig::new(2)`).
pub const INFLIGHT_MAX: u32 = 2;
/// Deliveries before `exhausted`.
pub const ATTEMPTS_MAX: u32 = 5;
/// Lease expiries before `crash_loop`.
pub const CRASH_LOOP_MAX: u32 = 3;
/// The backoff after every failed attempt: an exact schedule, no jitter.
pub const RETRY_DELAY: Duration = Duration::from_secs(1);
/// The lease length the cases ask for.
pub const LEASE: Duration = Duration::from_secs(30);
/// The decider's seed (the schedule makes the backoff exact anyway).
pub const SEED: u64 = 0x1a2a_7e75;

/// The fair scheduler's config: weight 1 for every lane, cap [`INFLIGHT_MAX`].
pub fn scheduler_config() -> SchedulerConfig {
    SchedulerConfig::new(INFLIGHT_MAX)
}

/// The one type policy of the suite: short, exact backoffs.
pub fn policy() -> TypePolicy {
    TypePolicy {
        attempts_max: ATTEMPTS_MAX,
        backoff: Backoff {
            base: RETRY_DELAY,
            cap: Duration::from_secs(10),
            floor: Duration::ZERO,
            schedule: vec![RETRY_DELAY],
        },
        crash_loop_max: CRASH_LOOP_MAX,
        ..TypePolicy::default()
    }
}

/// The decider the suite expects: the shared [`PolicyDecider`] with
/// [`policy`] for every type and the suite's seed.
pub fn seeded_decider() -> PolicyDecider {
    PolicyDecider::with_seed(
        lazaret_core::Policies {
            defaults: policy(),
            types: std::collections::HashMap::new(),
        },
        SEED,
    )
}

// ---------------------------------------------------------------------------
// Fixtures.

/// A fixed instant the cases count from (never the wall clock).
const T0: i64 = 1_700_000_000_000;

/// `ms` milliseconds after the suite's epoch.
pub fn at(ms: i64) -> Timestamp {
    Timestamp::from_millis(T0 + ms)
}

/// A queued job at `at(0)`; vary it with struct update syntax.
pub fn new_job(job_type: &str, tenant: &str, lane: &str) -> NewJob {
    NewJob {
        job_type: job_type.into(),
        tenant: tenant.into(),
        lane: lane.into(),
        payload: br#"{"n":1}"#.to_vec(),
        idempotency_key: None,
        schema_version: None,
        run_at: at(0),
        now: at(0),
        enqueued_by: None,
        traceparent: None,
    }
}

/// A lease of up to `max_jobs` from every lane and type, by worker `w-1`.
pub fn lease_req(now: Timestamp, max_jobs: u32) -> LeaseRequest {
    LeaseRequest {
        worker_id: "w-1".into(),
        lanes: None,
        types: None,
        exclude_types: Vec::new(),
        exclude_lanes: Vec::new(),
        type_limits: Vec::new(),
        max_jobs,
        lease: LEASE,
        now,
    }
}

/// A transient failure of `kind`.
pub fn transient(kind: &str) -> Failure {
    Failure::new(kind, "upstream answered 503").with_class(FailureClass::Transient)
}

/// A permanent failure.
pub fn permanent() -> Failure {
    Failure::new("bad_input", "the image is not a PNG")
        .with_class(FailureClass::Permanent)
        .with_traceback("Traceback (most recent call last):\n  resize.py:12\nValueError")
}

/// The id of a `Created` outcome; panics on anything else.
pub fn created(outcome: &EnqueueOutcome) -> JobId {
    match outcome {
        EnqueueOutcome::Created { id, .. } => *id,
        other => panic!("expected Created, got {other:?}"),
    }
}

/// Enqueues one job that must be created; returns its id.
pub async fn enqueue_one<S: Store>(s: &S, job: NewJob) -> JobId {
    let out = s.enqueue(vec![job]).await.expect("enqueue");
    assert_eq!(out.len(), 1, "one outcome per job: {out:?}");
    created(&out[0])
}

/// Leases; the store must not fail.
pub async fn lease<S: Store>(s: &S, req: LeaseRequest) -> Vec<LeasedJob> {
    s.lease(req).await.expect("lease")
}

/// Leases exactly one job and returns it.
pub async fn lease_one<S: Store>(s: &S, req: LeaseRequest) -> LeasedJob {
    let mut got = lease(s, req).await;
    assert_eq!(got.len(), 1, "expected one job, got {got:?}");
    got.pop().expect("one job")
}

/// Applies one outcome with the job's own token; it must be accepted.
pub async fn complete<S: Store>(s: &S, job: &LeasedJob, event: Event, now: Timestamp) -> Completed {
    let item = Completion {
        id: job.id,
        token: job.lease_token,
        event,
    };
    try_complete(s, item, now)
        .await
        .expect("the job's own token is accepted")
}

/// Applies one outcome; returns the item's result.
pub async fn try_complete<S: Store>(
    s: &S,
    item: Completion,
    now: Timestamp,
) -> Result<Completed, ItemError> {
    let mut out = s.complete(vec![item], now).await.expect("complete");
    assert_eq!(out.len(), 1, "one result per item");
    out.pop().expect("one result")
}

/// The job, which must exist.
pub async fn job_view<S: Store>(s: &S, id: JobId) -> JobView {
    s.job(id).await.expect("job").expect("the job exists")
}

/// One lane's counts; a lane the stats leave out counts zero.
pub fn lane_counts(stats: &StoreStats, lane: &str) -> LaneCounts {
    stats
        .lanes
        .iter()
        .find(|(l, _)| l.as_str() == lane)
        .map(|(_, c)| *c)
        .unwrap_or_default()
}

/// Enqueues `job`, leases it and fails it permanently at `now`; returns the
/// job and its dead letter. Nothing else may be queued in its lane and type.
pub async fn dead_letter_job<S: Store>(
    s: &S,
    job: NewJob,
    now: Timestamp,
) -> (JobId, lazaret_store::DeadLetterId) {
    let req = LeaseRequest {
        lanes: Some(vec![job.lane.clone()]),
        types: Some(vec![job.job_type.clone()]),
        ..lease_req(now, 1)
    };
    let id = enqueue_one(s, job).await;
    let leased = lease_one(s, req).await;
    assert_eq!(leased.id, id, "the helper leases the job it enqueued");
    let done = complete(s, &leased, Event::Failed(permanent()), now).await;
    (
        id,
        done.dead_letter
            .expect("a permanent failure writes a dead letter"),
    )
}

/// Lower-case hex SHA-256 of `bytes`, as the store records it.
pub fn sha256_hex(bytes: &[u8]) -> String {
    lazaret_core::payload_sha256(bytes)
        .iter()
        .fold(String::with_capacity(64), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// The ids of leased jobs, sorted.
pub fn ids(jobs: &[LeasedJob]) -> Vec<JobId> {
    let mut v: Vec<JobId> = jobs.iter().map(|j| j.id).collect();
    v.sort();
    v
}
