//! The four signals seed 003 asks operators to watch, over time (issue 33,
//! part 5): DLQ depth, the dead-lettering (poison) rate, redrive outcomes
//! and failure-reason cardinality, per type and per source, plus
//! throughput and the oldest ready job's age per lane.
//!
//! The store keeps one value per (minute, [`Signal`], [`By`], name) — a
//! [`Sample`] — and marks the minutes it sampled; this module says which
//! minute an instant falls in ([`minute_of`]) and turns the stored samples
//! of a [`Window`] into a chart's points ([`series`]): a gauge's point is
//! the largest value sampled in its step, a count's the sum, a step with
//! no sampled minute is a gap (`None`), and a name missing from a sampled
//! minute counts 0 there. Pure: no clock, the caller passes `now`.

use std::collections::BTreeMap;

use crate::Timestamp;

/// One bucket's length: a minute.
pub const MINUTE_MS: i64 = 60_000;

/// How long samples are kept: a day of minutes and one more hour, so the
/// day's chart is always whole.
pub const KEEP_MS: i64 = 25 * 3_600_000;

/// The word the store marks a sampled minute with (not a [`Signal`]).
pub const SAMPLED: &str = "sampled";

/// A charted signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Signal {
    /// Dead letters held (not archived) when sampled: a gauge.
    DlqDepth,
    /// Dead letters written in the minute (the poison rate): a count.
    DeadLettered,
    /// Jobs and broker messages a redrive sent in the minute: a count.
    RedriveSent,
    /// Redriven jobs and messages that succeeded in the minute: a count.
    RedriveSucceeded,
    /// Redriven jobs and messages dead-lettered again in the minute: a count.
    RedriveFailedAgain,
    /// Distinct failure groups (reason, kind, error fingerprint) among the
    /// dead letters held when sampled: a gauge.
    FailureReasons,
    /// Jobs that succeeded in the minute: a count.
    Throughput,
    /// Milliseconds the longest-waiting ready job had waited when sampled:
    /// a gauge.
    OldestAge,
}

impl Signal {
    /// Every signal, in the order charts and the API list them.
    pub const ALL: [Signal; 8] = [
        Signal::DlqDepth,
        Signal::DeadLettered,
        Signal::RedriveSent,
        Signal::RedriveSucceeded,
        Signal::RedriveFailedAgain,
        Signal::FailureReasons,
        Signal::Throughput,
        Signal::OldestAge,
    ];

    /// Its word in the API and in the store.
    pub const fn as_str(self) -> &'static str {
        match self {
            Signal::DlqDepth => "dlq_depth",
            Signal::DeadLettered => "dead_lettered",
            Signal::RedriveSent => "redrive_sent",
            Signal::RedriveSucceeded => "redrive_succeeded",
            Signal::RedriveFailedAgain => "redrive_failed_again",
            Signal::FailureReasons => "failure_reasons",
            Signal::Throughput => "throughput",
            Signal::OldestAge => "oldest_age_ms",
        }
    }

    /// The signal named `word`.
    pub fn parse(word: &str) -> Option<Signal> {
        Signal::ALL.into_iter().find(|s| s.as_str() == word)
    }

    /// A value as of the sampling (`true`), or a count of what happened
    /// in the minute (`false`).
    pub const fn is_gauge(self) -> bool {
        matches!(
            self,
            Signal::DlqDepth | Signal::FailureReasons | Signal::OldestAge
        )
    }

    /// What it is broken down by.
    pub const fn axes(self) -> &'static [By] {
        match self {
            Signal::Throughput | Signal::OldestAge => &[By::Lane],
            _ => &[By::Type, By::Source],
        }
    }
}

/// What a signal is broken down by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum By {
    /// The job type (empty name: an admission record whose type was not read).
    Type,
    /// The broker source (empty name: lazaret's own jobs and admission records).
    Source,
    /// The lane.
    Lane,
}

impl By {
    /// Every axis.
    pub const ALL: [By; 3] = [By::Type, By::Source, By::Lane];

    /// Its word in the API and in the store.
    pub const fn as_str(self) -> &'static str {
        match self {
            By::Type => "type",
            By::Source => "source",
            By::Lane => "lane",
        }
    }

    /// The axis named `word`.
    pub fn parse(word: &str) -> Option<By> {
        By::ALL.into_iter().find(|b| b.as_str() == word)
    }
}

/// The minute bucket `t` falls in: its start.
pub fn minute_of(t: Timestamp) -> Timestamp {
    Timestamp::from_millis(t.as_millis().div_euclid(MINUTE_MS) * MINUTE_MS)
}

/// A chart's span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// The last hour, a point per minute.
    Hour,
    /// The last day, a point per five minutes.
    Day,
}

impl Window {
    /// Its word in the API: `1h` or `24h`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Window::Hour => "1h",
            Window::Day => "24h",
        }
    }

    /// The window named `word`.
    pub fn parse(word: &str) -> Option<Window> {
        match word {
            "1h" => Some(Window::Hour),
            "24h" => Some(Window::Day),
            _ => None,
        }
    }

    /// Its length in milliseconds.
    pub const fn span_ms(self) -> i64 {
        match self {
            Window::Hour => 3_600_000,
            Window::Day => 86_400_000,
        }
    }

    /// One point's length in milliseconds (a whole number of minutes).
    pub const fn step_ms(self) -> i64 {
        match self {
            Window::Hour => MINUTE_MS,
            Window::Day => 5 * MINUTE_MS,
        }
    }

    /// Its points: `span / step`.
    pub const fn points(self) -> usize {
        (self.span_ms() / self.step_ms()) as usize
    }

    /// The minutes it covers at `now`: `[from, to)`, `to` the end of the
    /// step `now` is in (so the last point is the one under way).
    pub fn range(self, now: Timestamp) -> (Timestamp, Timestamp) {
        let step = self.step_ms();
        let to = (now.as_millis().div_euclid(step) + 1) * step;
        (
            Timestamp::from_millis(to - self.span_ms()),
            Timestamp::from_millis(to),
        )
    }
}

/// One stored value: `signal` by `by` for `name`, in the minute starting
/// at `minute`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    /// The minute's start ([`minute_of`]).
    pub minute: Timestamp,
    /// Which signal.
    pub signal: Signal,
    /// Broken down by what.
    pub by: By,
    /// The type, source or lane; empty for none (see [`By`]).
    pub name: String,
    /// The value: a count, or milliseconds for [`Signal::OldestAge`].
    pub value: u64,
}

/// One line of a chart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Series {
    /// Which signal.
    pub signal: Signal,
    /// Broken down by what.
    pub by: By,
    /// The type, source or lane; empty for none.
    pub name: String,
    /// A value per step of the window, oldest first; `None` where no
    /// minute of the step was sampled.
    pub points: Vec<Option<u64>>,
}

/// The lines of `window` ending with the step `now` is in, from the
/// stored `samples` and the `sampled` minutes (samples outside the window
/// are left out): one line per (signal, by, name) seen in the window, in
/// [`Signal::ALL`] order, then by axis, then by name.
pub fn series(
    samples: &[Sample],
    sampled: &[Timestamp],
    window: Window,
    now: Timestamp,
) -> Vec<Series> {
    let (from, to) = window.range(now);
    let step = window.step_ms();
    let n = window.points();
    let index = |minute: Timestamp| -> Option<usize> {
        let m = minute.as_millis();
        (m >= from.as_millis() && m < to.as_millis())
            .then(|| ((m - from.as_millis()) / step) as usize)
    };
    let mut covered = vec![false; n];
    for &m in sampled {
        if let Some(i) = index(m) {
            covered[i] = true;
        }
    }
    let mut lines: BTreeMap<(Signal, By, &str), Vec<Option<u64>>> = BTreeMap::new();
    for s in samples {
        let Some(i) = index(s.minute) else { continue };
        let points = lines
            .entry((s.signal, s.by, s.name.as_str()))
            .or_insert_with(|| vec![None; n]);
        points[i] = Some(match points[i] {
            None => s.value,
            Some(v) if s.signal.is_gauge() => v.max(s.value),
            Some(v) => v.saturating_add(s.value),
        });
    }
    lines
        .into_iter()
        .map(|((signal, by, name), mut points)| {
            for (p, &c) in points.iter_mut().zip(&covered) {
                if c && p.is_none() {
                    *p = Some(0);
                }
            }
            Series {
                signal,
                by,
                name: name.to_owned(),
                points,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(minutes: i64) -> Timestamp {
        Timestamp::from_millis(minutes * MINUTE_MS)
    }

    fn sample(minute: i64, signal: Signal, name: &str, value: u64) -> Sample {
        Sample {
            minute: at(minute),
            signal,
            by: signal.axes()[0],
            name: name.into(),
            value,
        }
    }

    #[test]
    fn an_instant_falls_in_the_minute_that_starts_at_or_before_it() {
        assert_eq!(minute_of(Timestamp::from_millis(0)), at(0));
        assert_eq!(minute_of(Timestamp::from_millis(59_999)), at(0));
        assert_eq!(minute_of(Timestamp::from_millis(60_000)), at(1));
        assert_eq!(minute_of(Timestamp::from_millis(-1)), at(-1));
    }

    #[test]
    fn words_read_back_as_what_they_name() {
        for s in Signal::ALL {
            assert_eq!(Signal::parse(s.as_str()), Some(s));
        }
        for b in By::ALL {
            assert_eq!(By::parse(b.as_str()), Some(b));
        }
        assert_eq!(Signal::parse(SAMPLED), None);
        assert_eq!(Window::parse("1h"), Some(Window::Hour));
        assert_eq!(Window::parse("24h"), Some(Window::Day));
        assert_eq!(Window::parse("2h"), None);
    }

    #[test]
    fn a_window_ends_with_the_step_under_way() {
        let now = Timestamp::from_millis(at(100).as_millis() + 5_000);
        assert_eq!(Window::Hour.range(now), (at(41), at(101)));
        assert_eq!(Window::Hour.points(), 60);
        // Five-minute steps: minute 100 is in the step [100, 105).
        assert_eq!(Window::Day.range(now), (at(105 - 1440), at(105)));
        assert_eq!(Window::Day.points(), 288);
    }

    #[test]
    fn an_hour_has_a_point_per_minute_zero_where_sampled_and_a_gap_where_not() {
        let now = at(59);
        let samples = [
            sample(57, Signal::DlqDepth, "send_email", 3),
            sample(59, Signal::DlqDepth, "send_email", 5),
            sample(-10, Signal::DlqDepth, "send_email", 99), // before the window
        ];
        let lines = series(&samples, &[at(57), at(58), at(59)], Window::Hour, now);
        assert_eq!(lines.len(), 1);
        let p = &lines[0].points;
        assert_eq!(p.len(), 60);
        assert_eq!(&p[56..], &[None, Some(3), Some(0), Some(5)]);
        assert_eq!(p[0], None);
    }

    #[test]
    fn a_day_sums_counts_and_keeps_the_largest_gauge_of_each_five_minutes() {
        let now = at(9); // the last step is [5, 10)
        let samples = [
            sample(5, Signal::DeadLettered, "a", 2),
            sample(6, Signal::DeadLettered, "a", 3),
            sample(9, Signal::DeadLettered, "a", 1),
            sample(5, Signal::DlqDepth, "a", 7),
            sample(7, Signal::DlqDepth, "a", 4),
            sample(3, Signal::DlqDepth, "a", 1),
        ];
        let lines = series(&samples, &[at(3), at(5), at(7)], Window::Day, now);
        let depth = lines.iter().find(|l| l.signal == Signal::DlqDepth).unwrap();
        let rate = lines
            .iter()
            .find(|l| l.signal == Signal::DeadLettered)
            .unwrap();
        assert_eq!(depth.points[287], Some(7));
        assert_eq!(depth.points[286], Some(1));
        assert_eq!(rate.points[287], Some(6));
        // Sampled (minute 3) but no dead letter then: zero, not a gap.
        assert_eq!(rate.points[286], Some(0));
        assert_eq!(rate.points[285], None);
    }

    #[test]
    fn lines_come_in_signal_then_axis_then_name_order() {
        let samples = [
            sample(0, Signal::Throughput, "default", 1),
            sample(0, Signal::DlqDepth, "b", 1),
            sample(0, Signal::DlqDepth, "", 1),
            Sample {
                by: By::Source,
                ..sample(0, Signal::DlqDepth, "orders", 1)
            },
        ];
        let keys: Vec<(Signal, By, String)> = series(&samples, &[at(0)], Window::Hour, at(0))
            .into_iter()
            .map(|l| (l.signal, l.by, l.name))
            .collect();
        assert_eq!(
            keys,
            vec![
                (Signal::DlqDepth, By::Type, String::new()),
                (Signal::DlqDepth, By::Type, "b".into()),
                (Signal::DlqDepth, By::Source, "orders".into()),
                (Signal::Throughput, By::Lane, "default".into()),
            ]
        );
    }
}
