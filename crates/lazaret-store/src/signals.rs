//! The charts' samples (issue 33, part 5; `lazaret_core::series`): what a
//! backend reads to sample the signals ([`Readings`], on a reader
//! connection, never the writer), how that becomes the rows of one minute
//! ([`Readings::samples`]), and the SQL both backends share in spirit.
//!
//! A sampling at `now` writes the minute `now` is in: the gauges as of
//! now (replacing that minute's earlier gauges) and the counts of the
//! minute so far; and the counts of the minute before, whole. A count is
//! never lowered (`max` on conflict): a dead letter redriven or purged, a
//! succeeded job removed by retention, leaves its minute's count as it was
//! first seen. Rows of minutes older than the caller's `keep_after` go in
//! the same transaction, so the table holds about a day.
//!
//! Where each value comes from (all durable rows every node shares):
//! depth and failure reasons from the groups' summary
//! (`dead_letter_groups`, `dead_letter_group_names`: a row per group, not
//! per dead letter); dead-lettered and failed again from `dead_letters` by
//! `dead_lettered_at` (a dead letter of a redriven job, or a broker copy
//! carrying a redrive id, failed again); redrives sent from the audit
//! entries of the minute's redrives (`redrive_jobs`; all of a redrive's
//! jobs count in the minute it began) and `redrive_messages.sent_at`;
//! succeeded from `jobs.finished_at` (a job with `redrives > 0`: a redrive
//! succeeded) and `redrive_messages.outcome_at`; the oldest age from the
//! ready jobs' `run_at`.

use std::collections::BTreeMap;

use lazaret_core::Timestamp;
use lazaret_core::series::{By, MINUTE_MS, Sample, Signal, minute_of};

/// What one sampling read.
#[derive(Clone, Debug, Default)]
pub(crate) struct Readings {
    /// When it read.
    pub now: Timestamp,
    /// Per type and per source (`""`: none): dead letters held and their
    /// distinct failure groups.
    pub held: Vec<(By, String, u64, u64)>,
    /// Per lane with jobs ready: when its longest-waiting one became ready.
    pub oldest: Vec<(String, Timestamp)>,
    /// What happened in the minute `now` is in, so far.
    pub current: Events,
    /// What happened in the minute before it.
    pub previous: Events,
}

/// What happened in one minute, as read.
#[derive(Clone, Debug, Default)]
pub(crate) struct Events {
    /// Dead letters written: (type, source, of a redriven job or message, count).
    pub dead: Vec<(String, String, bool, u64)>,
    /// Jobs succeeded: (type, lane, redriven before, count).
    pub succeeded: Vec<(String, String, bool, u64)>,
    /// Jobs redriven: (type, count).
    pub sent_jobs: Vec<(String, u64)>,
    /// Broker messages: (source, republished by a redrive, redriven copies succeeded).
    pub messages: Vec<(String, u64, u64)>,
}

impl Events {
    /// The counts of the minute starting at `minute`.
    fn samples(&self, minute: Timestamp) -> Vec<Sample> {
        let mut counts: BTreeMap<(Signal, By, String), u64> = BTreeMap::new();
        let mut add = |signal: Signal, by: By, name: &str, n: u64| {
            if n > 0 {
                *counts.entry((signal, by, name.to_owned())).or_default() += n;
            }
        };
        for (ty, source, again, n) in &self.dead {
            add(Signal::DeadLettered, By::Type, ty, *n);
            add(Signal::DeadLettered, By::Source, source, *n);
            if *again {
                add(Signal::RedriveFailedAgain, By::Type, ty, *n);
                add(Signal::RedriveFailedAgain, By::Source, source, *n);
            }
        }
        for (ty, lane, redriven, n) in &self.succeeded {
            add(Signal::Throughput, By::Lane, lane, *n);
            if *redriven {
                add(Signal::RedriveSucceeded, By::Type, ty, *n);
                add(Signal::RedriveSucceeded, By::Source, "", *n);
            }
        }
        for (ty, n) in &self.sent_jobs {
            add(Signal::RedriveSent, By::Type, ty, *n);
            add(Signal::RedriveSent, By::Source, "", *n);
        }
        for (source, sent, succeeded) in &self.messages {
            add(Signal::RedriveSent, By::Source, source, *sent);
            add(Signal::RedriveSucceeded, By::Source, source, *succeeded);
        }
        counts
            .into_iter()
            .map(|((signal, by, name), value)| Sample {
                minute,
                signal,
                by,
                name,
                value,
            })
            .collect()
    }
}

impl Readings {
    /// The minute sampled, its rows (gauges and counts so far), and the
    /// counts of the minute before.
    pub fn samples(&self) -> (Timestamp, Vec<Sample>, Vec<Sample>) {
        let minute = minute_of(self.now);
        let mut rows = Vec::new();
        for (by, name, depth, groups) in &self.held {
            for (signal, value) in [
                (Signal::DlqDepth, *depth),
                (Signal::FailureReasons, *groups),
            ] {
                if value > 0 {
                    rows.push(Sample {
                        minute,
                        signal,
                        by: *by,
                        name: name.clone(),
                        value,
                    });
                }
            }
        }
        for (lane, since) in &self.oldest {
            rows.push(Sample {
                minute,
                signal: Signal::OldestAge,
                by: By::Lane,
                name: lane.clone(),
                value: u64::try_from(self.now.as_millis() - since.as_millis()).unwrap_or(0),
            });
        }
        rows.extend(self.current.samples(minute));
        let before = Timestamp::from_millis(minute.as_millis() - MINUTE_MS);
        (minute, rows, self.previous.samples(before))
    }
}

/// Deletes a minute's gauges (SQLite), before a sampling writes them anew.
pub(crate) const DELETE_GAUGES_SQLITE: &str = "DELETE FROM signal_samples WHERE minute = ?1 \
     AND signal IN ('dlq_depth', 'failure_reasons', 'oldest_age_ms')";

/// [`DELETE_GAUGES_SQLITE`] for PostgreSQL.
pub(crate) const DELETE_GAUGES_PG: &str = "DELETE FROM signal_samples WHERE minute = $1 \
     AND signal IN ('dlq_depth', 'failure_reasons', 'oldest_age_ms')";

/// The words of the gauges, as an SQL list: `'dlq_depth', ...`.
#[cfg(test)]
fn gauge_words() -> String {
    Signal::ALL
        .into_iter()
        .filter(|s| s.is_gauge())
        .map(|s| format!("'{}'", s.as_str()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A stored row back as a sample; `None` for a word this build does not
/// know (a newer build's signal) or the sampled mark.
pub(crate) fn sample_of(
    minute: i64,
    signal: &str,
    axis: &str,
    name: String,
    value: i64,
) -> Option<Sample> {
    Some(Sample {
        minute: Timestamp::from_millis(minute),
        signal: Signal::parse(signal)?,
        by: By::parse(axis)?,
        name,
        value: u64::try_from(value).unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gauges_deleted_are_every_gauge() {
        let list = format!("IN ({})", gauge_words());
        assert!(DELETE_GAUGES_SQLITE.ends_with(&list), "{list}");
        assert!(DELETE_GAUGES_PG.ends_with(&list), "{list}");
    }

    #[test]
    fn a_minutes_events_become_counts_by_type_source_and_lane() {
        let e = Events {
            dead: vec![
                ("send_email".into(), String::new(), false, 3),
                ("send_email".into(), String::new(), true, 1),
                ("orders".into(), "orders".into(), true, 2),
            ],
            succeeded: vec![
                ("send_email".into(), "default".into(), false, 10),
                ("send_email".into(), "default".into(), true, 2),
            ],
            sent_jobs: vec![("send_email".into(), 4)],
            messages: vec![("orders".into(), 5, 1)],
        };
        let got: Vec<(Signal, By, String, u64)> = e
            .samples(Timestamp::from_millis(0))
            .into_iter()
            .map(|s| (s.signal, s.by, s.name, s.value))
            .collect();
        let want = |signal, by, name: &str, n| (signal, by, name.to_owned(), n);
        assert_eq!(
            got,
            vec![
                want(Signal::DeadLettered, By::Type, "orders", 2),
                want(Signal::DeadLettered, By::Type, "send_email", 4),
                want(Signal::DeadLettered, By::Source, "", 4),
                want(Signal::DeadLettered, By::Source, "orders", 2),
                want(Signal::RedriveSent, By::Type, "send_email", 4),
                want(Signal::RedriveSent, By::Source, "", 4),
                want(Signal::RedriveSent, By::Source, "orders", 5),
                want(Signal::RedriveSucceeded, By::Type, "send_email", 2),
                want(Signal::RedriveSucceeded, By::Source, "", 2),
                want(Signal::RedriveSucceeded, By::Source, "orders", 1),
                want(Signal::RedriveFailedAgain, By::Type, "orders", 2),
                want(Signal::RedriveFailedAgain, By::Type, "send_email", 1),
                want(Signal::RedriveFailedAgain, By::Source, "", 1),
                want(Signal::RedriveFailedAgain, By::Source, "orders", 2),
                want(Signal::Throughput, By::Lane, "default", 12),
            ]
        );
    }

    #[test]
    fn a_sampling_writes_its_minute_and_the_counts_of_the_one_before() {
        let r = Readings {
            now: Timestamp::from_millis(5 * MINUTE_MS + 30_000),
            held: vec![
                (By::Type, "a".into(), 3, 2),
                (By::Source, String::new(), 0, 0),
            ],
            oldest: vec![("default".into(), Timestamp::from_millis(5 * MINUTE_MS))],
            current: Events::default(),
            previous: Events {
                sent_jobs: vec![("a".into(), 1)],
                ..Events::default()
            },
        };
        let (minute, now, before) = r.samples();
        assert_eq!(minute, Timestamp::from_millis(5 * MINUTE_MS));
        let now: Vec<(Signal, u64)> = now.iter().map(|s| (s.signal, s.value)).collect();
        assert_eq!(
            now,
            vec![
                (Signal::DlqDepth, 3),
                (Signal::FailureReasons, 2),
                (Signal::OldestAge, 30_000)
            ]
        );
        assert_eq!(before.len(), 2);
        assert!(
            before
                .iter()
                .all(|s| s.minute == Timestamp::from_millis(4 * MINUTE_MS))
        );
    }
}
