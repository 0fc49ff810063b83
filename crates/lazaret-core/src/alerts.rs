//! Alerts: when a built-in alert fires, decided from what the server observes.
//!
//! The server hands [`Alerts::poll`] an [`Observation`] (the dead letters
//! held now, the recent dead letters, the [`FailureStats`] and the breaker
//! changes since the last poll) and gets back the [`Alert`]s to deliver.
//! Delivering them (HTTP, retries, the queue) is the server's part; every
//! *decision* — which condition holds, whether it is new, whether its
//! cooldown has run out, whether it is systemic — is here, with `now` as an
//! argument like everywhere in the core.
//!
//! The six events ([`AlertEvent`]):
//!
//! | event | fires when | `type` | `reason` | `count` / `window_ms` |
//! |---|---|---|---|---|
//! | `dead_letters_appeared` | a type's dead letters go from none to some (between two polls) | the type | null | held now / 0 |
//! | `poison_rate` | a type dead-letters at least `poison_rate_per_min` in the last minute | the type | null | in the last minute / 60000 |
//! | `reason_surge` | [`FailureStats::surges_by_type`]: one failure holds `surge_share` of at least `surge_min` of a type's recent dead letters | the type | its dead-letter reason | the surging failure's / the surge window |
//! | `breaker_opened` | a breaker turns open | the type | the error kind | the type's recent dead letters / [`RECENT_SPAN`] |
//! | `breaker_closed` | a breaker turns closed again | the type | the error kind | as above |
//! | `dead_letters_over_warn` | the dead letters held outnumber `dead_letters_warn` | null | null | held now / 0 |
//!
//! Dedup: one alert per (event, type, reason) per `cooldown`. The two edge
//! events (appeared, breakers) fire on the change only; the three level
//! events (poison rate, surge, over warn) fire again after the cooldown
//! while their condition still holds. The first poll only learns which
//! types already have dead letters: a restart does not page for dead
//! letters that were there before it.
//!
//! `systemic` is true on a `reason_surge`, and on any other alert of a type
//! (or, for an alert of no type, of any type) that the surge rule currently
//! flags: one failure dominating means one bug or one outage, not
//! scattered bad data.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::breaker::{BreakerState, BreakerTransition};
use crate::failure::DeadLetterReason;
use crate::ids::{ErrorKind, JobType};
use crate::stats::{FailureCause, FailureStats, Surge};
use crate::time::{Timestamp, duration_ms};

/// The window of the `poison_rate` event.
pub const POISON_WINDOW: Duration = Duration::from_secs(60);

/// How far back [`RecentDeadLetters`] keeps dead letters: the surge window
/// of the default [`crate::StatsConfig`] (5 one-minute buckets).
pub const RECENT_SPAN: Duration = Duration::from_secs(5 * 60);

/// Most dead letters [`RecentDeadLetters`] keeps; past it the oldest go.
/// Thresholds (`poison_rate_per_min`) are capped at this, so a count that
/// reaches a threshold is still seen exactly.
pub const RECENT_MAX: usize = 10_000;

/// Entries of [`Alert::top_reasons`].
pub const TOP_REASONS_MAX: usize = 5;

/// Alerts one poll may return per target: a flood of new types is not a
/// flood of pages (the rest wait for the next poll).
pub const ALERTS_PER_POLL_MAX: usize = 100;

/// One of the built-in alert events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AlertEvent {
    /// A type's dead letters went from none to some.
    DeadLettersAppeared,
    /// A type dead-letters faster than `poison_rate_per_min`.
    PoisonRate,
    /// One failure dominates the recent dead letters.
    ReasonSurge,
    /// A breaker opened.
    BreakerOpened,
    /// A breaker closed again.
    BreakerClosed,
    /// The dead letters held outnumber `dead_letters_warn`.
    DeadLettersOverWarn,
}

impl AlertEvent {
    /// Every event, in documentation order.
    pub const ALL: [AlertEvent; 6] = [
        AlertEvent::DeadLettersAppeared,
        AlertEvent::PoisonRate,
        AlertEvent::ReasonSurge,
        AlertEvent::BreakerOpened,
        AlertEvent::BreakerClosed,
        AlertEvent::DeadLettersOverWarn,
    ];

    /// The word used in the config file and the alert body.
    pub const fn as_str(self) -> &'static str {
        match self {
            AlertEvent::DeadLettersAppeared => "dead_letters_appeared",
            AlertEvent::PoisonRate => "poison_rate",
            AlertEvent::ReasonSurge => "reason_surge",
            AlertEvent::BreakerOpened => "breaker_opened",
            AlertEvent::BreakerClosed => "breaker_closed",
            AlertEvent::DeadLettersOverWarn => "dead_letters_over_warn",
        }
    }
}

impl fmt::Display for AlertEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A word that is not an [`AlertEvent`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown alert event `{0}`: use dead_letters_appeared, poison_rate, reason_surge, breaker_opened, breaker_closed or dead_letters_over_warn"
)]
pub struct UnknownAlertEvent(pub String);

impl FromStr for AlertEvent {
    type Err = UnknownAlertEvent;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        AlertEvent::ALL
            .into_iter()
            .find(|e| e.as_str() == s)
            .ok_or_else(|| UnknownAlertEvent(s.to_owned()))
    }
}

/// One alert target's rule: which events, how often, which thresholds.
#[derive(Clone, Debug, PartialEq)]
pub struct AlertRule {
    /// The events this target is sent.
    pub events: BTreeSet<AlertEvent>,
    /// One alert per (event, type, reason) per this long.
    pub cooldown: Duration,
    /// Dead letters of one type in a minute that fire `poison_rate`.
    pub poison_rate_per_min: u64,
    /// Fewest dead letters in the surge window for `reason_surge`.
    pub surge_min: u64,
    /// Smallest share of them under one failure for `reason_surge`.
    pub surge_share: f64,
}

impl Default for AlertRule {
    /// Every event, a five-minute cooldown, 10 dead letters a minute, and
    /// the surge thresholds of [`crate::StatsConfig::default`] (20, 0.8).
    fn default() -> Self {
        AlertRule {
            events: AlertEvent::ALL.into_iter().collect(),
            cooldown: Duration::from_secs(300),
            poison_rate_per_min: 10,
            surge_min: 20,
            surge_share: 0.8,
        }
    }
}

/// An [`AlertRule`] field outside its allowed range.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum AlertRuleError {
    /// No events.
    #[error("events is empty; list at least one event, or remove the [[alerts]] entry")]
    NoEvents,
    /// `cooldown` under a second.
    #[error(
        "cooldown_ms is {0}; at least 1000 (one alert per second per condition is already a flood)"
    )]
    Cooldown(u64),
    /// `poison_rate_per_min` out of range.
    #[error("poison_rate_per_min is {0}; allowed range is 1..={max}", max = RECENT_MAX)]
    PoisonRate(u64),
    /// `surge_min` out of range.
    #[error("surge_min is {0}; allowed range is 1..={max}", max = RECENT_MAX)]
    SurgeMin(u64),
    /// `surge_share` out of range.
    #[error("surge_share is {0}; allowed range is above 0.5 up to 1.0 (0.5 < x <= 1.0)")]
    SurgeShare(f64),
}

impl AlertRule {
    /// Checks every field against its allowed range.
    pub fn validate(&self) -> Result<(), AlertRuleError> {
        if self.events.is_empty() {
            return Err(AlertRuleError::NoEvents);
        }
        if self.cooldown < Duration::from_secs(1) {
            return Err(AlertRuleError::Cooldown(duration_ms(self.cooldown)));
        }
        if !(1..=RECENT_MAX as u64).contains(&self.poison_rate_per_min) {
            return Err(AlertRuleError::PoisonRate(self.poison_rate_per_min));
        }
        if !(1..=RECENT_MAX as u64).contains(&self.surge_min) {
            return Err(AlertRuleError::SurgeMin(self.surge_min));
        }
        if !(self.surge_share > 0.5 && self.surge_share <= 1.0) {
            return Err(AlertRuleError::SurgeShare(self.surge_share));
        }
        Ok(())
    }
}

/// One dead letter as [`RecentDeadLetters`] keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Recent {
    at: Timestamp,
    job_type: Option<JobType>,
    reason: DeadLetterReason,
    kind: Option<ErrorKind>,
}

/// The last dead letters (at most [`RECENT_MAX`], none older than
/// [`RECENT_SPAN`]), for rates and top reasons per type.
///
/// The server records every dead letter here as it records it in
/// [`FailureStats`]: processing, admission and broker ones alike.
#[derive(Clone, Debug, Default)]
pub struct RecentDeadLetters {
    items: VecDeque<Recent>,
}

impl RecentDeadLetters {
    /// Counts one dead letter of `ty` (`None`: the type could not be read)
    /// at `now`.
    pub fn record(
        &mut self,
        ty: Option<&JobType>,
        reason: DeadLetterReason,
        kind: Option<&ErrorKind>,
        now: Timestamp,
    ) {
        if self.items.len() >= RECENT_MAX {
            self.items.pop_front();
        }
        self.items.push_back(Recent {
            at: now,
            job_type: ty.filter(|t| !t.as_str().is_empty()).cloned(),
            reason,
            kind: kind.cloned(),
        });
        self.forget_before(now.saturating_sub(RECENT_SPAN));
    }

    fn forget_before(&mut self, cutoff: Timestamp) {
        while self.items.front().is_some_and(|r| r.at < cutoff) {
            self.items.pop_front();
        }
    }

    /// How many are kept now.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    fn within<'a>(
        &'a self,
        ty: Option<&'a JobType>,
        now: Timestamp,
        window: Duration,
    ) -> impl Iterator<Item = &'a Recent> + 'a {
        let from = now.saturating_sub(window);
        self.items
            .iter()
            .rev()
            .take_while(move |r| r.at > from)
            .filter(move |r| r.at <= now && ty.is_none_or(|t| r.job_type.as_ref() == Some(t)))
    }

    /// Dead letters of `ty` (`None`: of every type) in the `window` ending at `now`.
    pub fn count(&self, ty: Option<&JobType>, now: Timestamp, window: Duration) -> u64 {
        self.within(ty, now, window).count() as u64
    }

    /// Types with at least `min` dead letters in the `window` ending at
    /// `now`, with their counts, in type order.
    pub fn types_at_least(
        &self,
        min: u64,
        now: Timestamp,
        window: Duration,
    ) -> Vec<(JobType, u64)> {
        let mut by_type: BTreeMap<&JobType, u64> = BTreeMap::new();
        for r in self.within(None, now, window) {
            if let Some(t) = &r.job_type {
                *by_type.entry(t).or_default() += 1;
            }
        }
        by_type
            .into_iter()
            .filter(|(_, n)| *n >= min)
            .map(|(t, n)| (t.clone(), n))
            .collect()
    }

    /// The most frequent (reason, kind) of `ty`'s (`None`: every type's)
    /// dead letters in the `window` ending at `now`, most first (ties in
    /// reason, then kind order), at most `n`.
    pub fn top_reasons(
        &self,
        ty: Option<&JobType>,
        now: Timestamp,
        window: Duration,
        n: usize,
    ) -> Vec<TopReason> {
        let mut counts: BTreeMap<(DeadLetterReason, Option<&ErrorKind>), u64> = BTreeMap::new();
        for r in self.within(ty, now, window) {
            *counts.entry((r.reason, r.kind.as_ref())).or_default() += 1;
        }
        let mut all: Vec<TopReason> = counts
            .into_iter()
            .map(|((reason, kind), count)| TopReason {
                reason,
                kind: kind.cloned(),
                count,
            })
            .collect();
        // Stable: equal counts keep the map's (reason, kind) order.
        all.sort_by_key(|r| std::cmp::Reverse(r.count));
        all.truncate(n);
        all
    }

    /// The dead-letter reason most of `ty`'s recent dead letters with this
    /// cause carry (a cause is a kind or, without one, a reason).
    fn reason_of(
        &self,
        ty: &JobType,
        cause: &FailureCause,
        now: Timestamp,
        window: Duration,
    ) -> Option<DeadLetterReason> {
        if let FailureCause::Reason(r) = cause {
            return Some(*r);
        }
        let mut counts: BTreeMap<DeadLetterReason, u64> = BTreeMap::new();
        for r in self.within(Some(ty), now, window) {
            if FailureCause::of(r.reason, r.kind.as_ref()) == *cause {
                *counts.entry(r.reason).or_default() += 1;
            }
        }
        let mut best: Option<(DeadLetterReason, u64)> = None;
        for (reason, n) in counts {
            if best.is_none_or(|(_, m)| n > m) {
                best = Some((reason, n));
            }
        }
        best.map(|(r, _)| r)
    }
}

/// One type's surge ([`FailureStats::surges_by_type`]) with the dead-letter
/// reason its dominant failure's dead letters carry.
#[derive(Clone, Debug, PartialEq)]
pub struct TypeSurge {
    /// The surge: its key names the type, the cause and the fingerprint.
    pub surge: Surge,
    /// The dead-letter reason most of the failure's recent dead letters
    /// carry (`None`: none of them is among the recent ones kept).
    pub reason: Option<DeadLetterReason>,
}

/// The surge rule per type, each surge with its dead-letter reason: what
/// `reason_surge` fires for, and what `/v1/stats` lists as
/// `dead_letters.surges` (so the dashboard marks the same rows the alerts
/// name). `count_min` and `share_min` are `surge_min` and `surge_share`.
pub fn type_surges(
    failures: &FailureStats,
    recent: &RecentDeadLetters,
    now: Timestamp,
    count_min: u64,
    share_min: f64,
) -> Vec<TypeSurge> {
    failures
        .surges_by_type(now, count_min, share_min)
        .into_iter()
        .map(|surge| TypeSurge {
            reason: recent.reason_of(surge.key.job_type(), surge.key.cause(), now, surge.window),
            surge,
        })
        .collect()
}

/// One entry of [`Alert::top_reasons`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopReason {
    /// The dead-letter reason.
    pub reason: DeadLetterReason,
    /// The last failure's kind, if a worker reported one.
    pub kind: Option<ErrorKind>,
    /// Dead letters with this reason and kind in the window.
    pub count: u64,
}

/// What the server saw since the last poll.
#[derive(Clone, Copy, Debug)]
pub struct Observation<'a> {
    /// Dead letters held now, by (type, reason); `None`: type unreadable.
    pub held: &'a [(Option<JobType>, DeadLetterReason, u64)],
    /// `dead_letters_warn`.
    pub warn_at: u64,
    /// The recent dead letters.
    pub recent: &'a RecentDeadLetters,
    /// Fingerprints and the surge signal.
    pub failures: &'a FailureStats,
    /// Breaker changes since the last poll, oldest first.
    pub breaker_changes: &'a [BreakerTransition],
}

/// One alert to deliver.
#[derive(Clone, Debug, PartialEq)]
pub struct Alert {
    /// What happened.
    pub event: AlertEvent,
    /// When it was decided.
    pub at: Timestamp,
    /// The job type, if the event is about one.
    pub job_type: Option<JobType>,
    /// The dead-letter reason (`reason_surge`) or error kind (breakers).
    pub reason: Option<String>,
    /// See the table in the module doc.
    pub count: u64,
    /// The window `count` was taken over (zero: a depth now).
    pub window: Duration,
    /// One failure dominates: likely one bug or outage, not scattered data.
    pub systemic: bool,
    /// The type's (or every type's) most frequent recent reasons.
    pub top_reasons: Vec<TopReason>,
    /// One line for a human.
    pub summary: String,
    /// The dashboard view to open: a URL path (see [`link`]).
    pub link: String,
}

/// The dashboard path an alert links to: `/#/dead-letters` with `type` and
/// `reason` as query parameters when known (percent-encoded), or for the
/// breaker events `/#/breakers?type=T`.
pub fn link(event: AlertEvent, ty: Option<&JobType>, reason: Option<&str>) -> String {
    let mut params = Vec::new();
    if let Some(t) = ty {
        params.push(format!("type={}", percent_encode(t.as_str())));
    }
    let view = match event {
        AlertEvent::BreakerOpened | AlertEvent::BreakerClosed => "breakers",
        _ => {
            if let Some(r) = reason {
                params.push(format!("reason={}", percent_encode(r)));
            }
            "dead-letters"
        }
    };
    if params.is_empty() {
        format!("/#/{view}")
    } else {
        format!("/#/{view}?{}", params.join("&"))
    }
}

/// Percent-encodes everything but unreserved characters (RFC 3986).
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// What an alert is deduplicated by.
type DedupKey = (AlertEvent, Option<JobType>, Option<String>);

/// Dedup entries kept before the expired ones are swept.
const FIRED_SWEEP_AT: usize = 4096;

/// One target's alert decisions: its [`AlertRule`] and what it already sent.
///
/// **Input and output:** [`poll`](Self::poll), at a steady pace, with what
/// the server observed; it returns the alerts to send now, and remembers
/// them for dedup.
#[derive(Clone, Debug)]
pub struct Alerts {
    rule: AlertRule,
    fired: BTreeMap<DedupKey, Timestamp>,
    /// Types that held dead letters at the last poll; `None` before the first.
    with_dead_letters: Option<BTreeSet<Option<JobType>>>,
}

impl Alerts {
    /// A target with `rule`, which nothing has been sent to yet.
    pub fn new(rule: AlertRule) -> Self {
        Alerts {
            rule,
            fired: BTreeMap::new(),
            with_dead_letters: None,
        }
    }

    /// The rule.
    pub fn rule(&self) -> &AlertRule {
        &self.rule
    }

    /// The alerts to send at `now` given `obs`, in event order.
    pub fn poll(&mut self, now: Timestamp, obs: &Observation<'_>) -> Vec<Alert> {
        let mut out = Vec::new();
        // Per type: one failure dominating a type's recent dead letters.
        let surges = type_surges(
            obs.failures,
            obs.recent,
            now,
            self.rule.surge_min,
            self.rule.surge_share,
        );
        let systemic = |ty: Option<&JobType>| match ty {
            None => !surges.is_empty(),
            Some(t) => surges.iter().any(|s| s.surge.key.job_type() == t),
        };
        let mut candidates: Vec<Candidate> = Vec::new();

        // dead_letters_appeared: the set of types holding some, against the last poll's.
        let mut now_with: BTreeMap<Option<JobType>, u64> = BTreeMap::new();
        for (t, _, n) in obs.held {
            if *n > 0 {
                let t = t.clone().filter(|t| !t.as_str().is_empty());
                *now_with.entry(t).or_default() += n;
            }
        }
        if let Some(before) = &self.with_dead_letters {
            for (t, n) in &now_with {
                if !before.contains(t) {
                    candidates.push(Candidate {
                        event: AlertEvent::DeadLettersAppeared,
                        job_type: t.clone(),
                        reason: None,
                        count: *n,
                        window: Duration::ZERO,
                    });
                }
            }
        }
        self.with_dead_letters = Some(now_with.keys().cloned().collect());

        // poison_rate: per type, over the last minute.
        for (t, n) in obs
            .recent
            .types_at_least(self.rule.poison_rate_per_min, now, POISON_WINDOW)
        {
            candidates.push(Candidate {
                event: AlertEvent::PoisonRate,
                job_type: Some(t),
                reason: None,
                count: n,
                window: POISON_WINDOW,
            });
        }

        // reason_surge: the surge rule of /v1/stats per type, with this target's thresholds.
        for TypeSurge { surge: s, reason } in &surges {
            let t = s.key.job_type();
            candidates.push(Candidate {
                event: AlertEvent::ReasonSurge,
                job_type: (!t.as_str().is_empty()).then(|| t.clone()),
                reason: reason.map(|r| r.as_str().to_owned()),
                count: s.count,
                window: s.window,
            });
        }

        // Breakers: each change to open or back to closed.
        for tr in obs.breaker_changes {
            let event = match (tr.from, tr.to) {
                (BreakerState::Open { .. }, BreakerState::Open { .. }) => continue,
                (_, BreakerState::Open { .. }) => AlertEvent::BreakerOpened,
                (BreakerState::Closed, BreakerState::Closed) => continue,
                (_, BreakerState::Closed) => AlertEvent::BreakerClosed,
                _ => continue,
            };
            candidates.push(Candidate {
                event,
                job_type: Some(tr.ty.clone()),
                reason: Some(tr.kind.as_str().to_owned()),
                count: obs.recent.count(Some(&tr.ty), now, RECENT_SPAN),
                window: RECENT_SPAN,
            });
        }

        // dead_letters_over_warn: a level, repeated after each cooldown.
        let held: u64 = obs.held.iter().map(|(_, _, n)| n).sum();
        if held > obs.warn_at {
            candidates.push(Candidate {
                event: AlertEvent::DeadLettersOverWarn,
                job_type: None,
                reason: None,
                count: held,
                window: Duration::ZERO,
            });
        }

        candidates.sort_by_key(|c| c.event);
        for c in candidates {
            if out.len() >= ALERTS_PER_POLL_MAX {
                // Left for the next poll; an edge is only an edge once, so
                // a type not announced yet must still look new then.
                if c.event == AlertEvent::DeadLettersAppeared {
                    if let Some(seen) = &mut self.with_dead_letters {
                        seen.remove(&c.job_type);
                    }
                }
                continue;
            }
            if !self.rule.events.contains(&c.event) {
                continue;
            }
            let key: DedupKey = (c.event, c.job_type.clone(), c.reason.clone());
            if let Some(last) = self.fired.get(&key) {
                if now.saturating_since(*last) < self.rule.cooldown && *last <= now {
                    continue;
                }
            }
            self.fired.insert(key, now);
            let top_window = if c.window.is_zero() {
                RECENT_SPAN
            } else {
                c.window
            };
            let top_reasons =
                obs.recent
                    .top_reasons(c.job_type.as_ref(), now, top_window, TOP_REASONS_MAX);
            let is_systemic = c.event == AlertEvent::ReasonSurge || systemic(c.job_type.as_ref());
            let surge = surges
                .iter()
                .map(|s| &s.surge)
                .find(|s| Some(s.key.job_type()) == c.job_type.as_ref());
            let summary = summary(&c, is_systemic, &self.rule, obs, surge);
            out.push(Alert {
                link: link(c.event, c.job_type.as_ref(), c.reason.as_deref()),
                event: c.event,
                at: now,
                job_type: c.job_type,
                reason: c.reason,
                count: c.count,
                window: c.window,
                systemic: is_systemic,
                top_reasons,
                summary,
            });
        }
        if self.fired.len() > FIRED_SWEEP_AT {
            let cooldown = self.rule.cooldown;
            self.fired
                .retain(|_, at| now.saturating_since(*at) < cooldown || *at > now);
        }
        out
    }
}

/// A condition that holds now, before dedup.
#[derive(Debug)]
struct Candidate {
    event: AlertEvent,
    job_type: Option<JobType>,
    reason: Option<String>,
    count: u64,
    window: Duration,
}

fn summary(
    c: &Candidate,
    systemic: bool,
    rule: &AlertRule,
    obs: &Observation<'_>,
    surge: Option<&Surge>,
) -> String {
    let ty = c
        .job_type
        .as_ref()
        .map_or("(unknown type)", JobType::as_str);
    let secs = c.window.as_secs();
    let text = match c.event {
        AlertEvent::DeadLettersAppeared => {
            format!("{ty}: {} dead letter(s) where there were none", c.count)
        }
        AlertEvent::PoisonRate => format!(
            "{ty}: {} dead letters in the last {secs} s (alert at {} a minute)",
            c.count, rule.poison_rate_per_min
        ),
        AlertEvent::ReasonSurge => {
            let (total, fp) = surge.map_or((c.count, ""), |s| (s.total, s.key.fingerprint()));
            format!(
                "{ty}: {} of the last {total} dead letters in {secs} s share one failure ({}: \"{fp}\"): likely one bug or one outage, not scattered bad data",
                c.count,
                c.reason.as_deref().unwrap_or("?"),
            )
        }
        AlertEvent::BreakerOpened => format!(
            "{ty}: the breaker for {} opened; its jobs are parked (no attempts spent) until it half-opens",
            c.reason.as_deref().unwrap_or("?")
        ),
        AlertEvent::BreakerClosed => format!(
            "{ty}: the breaker for {} closed; its jobs flow again",
            c.reason.as_deref().unwrap_or("?")
        ),
        AlertEvent::DeadLettersOverWarn => format!(
            "{} dead letters held, more than dead_letters_warn ({})",
            c.count, obs.warn_at
        ),
    };
    if systemic && c.event != AlertEvent::ReasonSurge {
        format!("{text}; one failure dominates (systemic)")
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::breaker::{BreakerConfig, Breakers};
    use expect_test::expect;
    use proptest::prelude::*;

    const S: i64 = 1000;

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn ty(s: &str) -> JobType {
        JobType::new(s)
    }

    /// The server's state as tests drive it.
    #[derive(Default)]
    struct World {
        held: BTreeMap<(Option<JobType>, DeadLetterReason), u64>,
        recent: RecentDeadLetters,
        failures: FailureStats,
        changes: Vec<BreakerTransition>,
        warn_at: u64,
    }

    impl World {
        fn new() -> Self {
            World {
                warn_at: 1_000_000,
                ..World::default()
            }
        }

        fn dead_letter(
            &mut self,
            t: &str,
            reason: DeadLetterReason,
            kind: &str,
            msg: &str,
            now: i64,
        ) {
            let k = ErrorKind::new(kind);
            *self.held.entry((Some(ty(t)), reason)).or_default() += 1;
            self.recent.record(Some(&ty(t)), reason, Some(&k), at(now));
            self.failures
                .record_dead_letter(&ty(t), reason, Some(&k), msg, at(now));
        }

        fn purge(&mut self) {
            self.held.clear();
        }

        fn poll(&mut self, alerts: &mut Alerts, now: i64) -> Vec<Alert> {
            let held: Vec<_> = self
                .held
                .iter()
                .map(|((t, r), n)| (t.clone(), *r, *n))
                .collect();
            let changes = std::mem::take(&mut self.changes);
            alerts.poll(
                at(now),
                &Observation {
                    held: &held,
                    warn_at: self.warn_at,
                    recent: &self.recent,
                    failures: &self.failures,
                    breaker_changes: &changes,
                },
            )
        }
    }

    fn names(alerts: &[Alert]) -> Vec<String> {
        alerts
            .iter()
            .map(|a| {
                format!(
                    "{} {} {} count={} systemic={}",
                    a.event,
                    a.job_type.as_ref().map_or("-", JobType::as_str),
                    a.reason.as_deref().unwrap_or("-"),
                    a.count,
                    a.systemic
                )
            })
            .collect()
    }

    fn rule() -> AlertRule {
        AlertRule {
            cooldown: Duration::from_secs(60),
            ..AlertRule::default()
        }
    }

    #[test]
    fn events_round_trip_their_words() {
        for e in AlertEvent::ALL {
            assert_eq!(e.as_str().parse::<AlertEvent>(), Ok(e));
        }
        assert_eq!(
            "dead_letters"
                .parse::<AlertEvent>()
                .unwrap_err()
                .to_string(),
            "unknown alert event `dead_letters`: use dead_letters_appeared, poison_rate, reason_surge, breaker_opened, breaker_closed or dead_letters_over_warn"
        );
    }

    #[test]
    fn rule_validation_names_the_key_and_range() {
        assert_eq!(AlertRule::default().validate(), Ok(()));
        let bad = |f: fn(&mut AlertRule)| {
            let mut r = AlertRule::default();
            f(&mut r);
            r.validate().unwrap_err().to_string()
        };
        assert_eq!(
            bad(|r| r.cooldown = Duration::from_millis(10)),
            "cooldown_ms is 10; at least 1000 (one alert per second per condition is already a flood)"
        );
        assert_eq!(
            bad(|r| r.poison_rate_per_min = 0),
            "poison_rate_per_min is 0; allowed range is 1..=10000"
        );
        assert_eq!(
            bad(|r| r.surge_min = 20_000),
            "surge_min is 20000; allowed range is 1..=10000"
        );
        assert_eq!(
            bad(|r| r.surge_share = 0.5),
            "surge_share is 0.5; allowed range is above 0.5 up to 1.0 (0.5 < x <= 1.0)"
        );
        assert!(bad(|r| r.events.clear()).starts_with("events is empty"));
    }

    #[test]
    fn the_first_poll_learns_and_a_new_type_with_dead_letters_fires_once() {
        let mut w = World::new();
        let mut a = Alerts::new(rule());
        w.dead_letter("old", DeadLetterReason::Permanent, "bad", "x", 0);
        assert_eq!(
            names(&w.poll(&mut a, 0)),
            Vec::<String>::new(),
            "held before the start: no page"
        );
        w.dead_letter("send_email", DeadLetterReason::Exhausted, "timeout", "t", S);
        let fired = w.poll(&mut a, 2 * S);
        assert_eq!(
            names(&fired),
            ["dead_letters_appeared send_email - count=1 systemic=false"]
        );
        assert_eq!(fired[0].link, "/#/dead-letters?type=send_email");
        assert_eq!(
            fired[0].top_reasons,
            [TopReason {
                reason: DeadLetterReason::Exhausted,
                kind: Some(ErrorKind::new("timeout")),
                count: 1
            }]
        );
        // More of them: not new.
        w.dead_letter(
            "send_email",
            DeadLetterReason::Exhausted,
            "timeout",
            "t",
            3 * S,
        );
        assert!(w.poll(&mut a, 4 * S).is_empty());
        // Purged and back within the cooldown: one alert per cooldown.
        w.purge();
        assert!(w.poll(&mut a, 5 * S).is_empty());
        w.dead_letter(
            "send_email",
            DeadLetterReason::Exhausted,
            "timeout",
            "t",
            6 * S,
        );
        assert!(w.poll(&mut a, 7 * S).is_empty());
        // Purged and back after it: a new alert.
        w.purge();
        assert!(w.poll(&mut a, 70 * S).is_empty());
        w.dead_letter(
            "send_email",
            DeadLetterReason::Exhausted,
            "timeout",
            "t",
            71 * S,
        );
        assert_eq!(
            names(&w.poll(&mut a, 72 * S)),
            ["dead_letters_appeared send_email - count=1 systemic=false"]
        );
    }

    #[test]
    fn poison_rate_fires_at_the_threshold_per_type_and_again_after_the_cooldown() {
        let mut w = World::new();
        let mut a = Alerts::new(AlertRule {
            events: [AlertEvent::PoisonRate].into(),
            poison_rate_per_min: 5,
            ..rule()
        });
        for i in 0..4 {
            w.dead_letter(
                "a",
                DeadLetterReason::Permanent,
                "bad",
                &format!("field {} missing", ["x", "y", "z", "w"][i]),
                i as i64 * S,
            );
            w.dead_letter("b", DeadLetterReason::Permanent, "bad", "x", i as i64 * S);
        }
        assert!(w.poll(&mut a, 4 * S).is_empty(), "4 a minute is under 5");
        w.dead_letter(
            "a",
            DeadLetterReason::Permanent,
            "bad",
            "field v missing",
            5 * S,
        );
        assert_eq!(
            names(&w.poll(&mut a, 5 * S)),
            ["poison_rate a - count=5 systemic=false"]
        );
        assert!(w.poll(&mut a, 6 * S).is_empty(), "once per cooldown");
        // A minute later the window is empty: nothing holds, nothing fires.
        assert!(w.poll(&mut a, 66 * S).is_empty());
        for i in 0..5 {
            w.dead_letter(
                "a",
                DeadLetterReason::Permanent,
                "bad",
                "field u missing",
                70 * S + i,
            );
        }
        assert_eq!(
            names(&w.poll(&mut a, 71 * S)),
            ["poison_rate a - count=5 systemic=false"]
        );
    }

    #[test]
    fn a_surge_in_one_type_fires_through_a_scatter_in_another() {
        // 25 of one failure in `charge`, 75 scattered ones in `export`: over
        // all types the failure holds only a quarter, but it is all of
        // `charge`'s.
        let mut w = World::new();
        let mut a = Alerts::new(rule());
        w.poll(&mut a, 0);
        for i in 0..100 {
            if i % 4 == 0 {
                w.dead_letter(
                    "charge",
                    DeadLetterReason::KindExhausted,
                    "timeout",
                    "timeout",
                    S + i,
                );
            } else {
                let msg = format!("row {i} has no column {}", i * 7919);
                w.dead_letter(
                    "export",
                    DeadLetterReason::Permanent,
                    &format!("parse_{i}"),
                    &msg,
                    S + i,
                );
            }
        }
        let fired = w.poll(&mut a, 2 * S);
        let surges: Vec<_> = fired
            .iter()
            .filter(|f| f.event == AlertEvent::ReasonSurge)
            .map(|f| {
                (
                    f.job_type.as_ref().map(JobType::as_str),
                    f.reason.as_deref(),
                    f.count,
                )
            })
            .collect();
        assert_eq!(surges, [(Some("charge"), Some("kind_exhausted"), 25)]);
        for f in &fired {
            let ty = f.job_type.as_ref().map(JobType::as_str);
            assert_eq!(f.systemic, ty == Some("charge"), "{f:?}");
        }
    }

    #[test]
    fn type_surges_name_each_surging_type_with_its_dead_letter_reason() {
        // `charge`: 24 timeouts that exhausted their kind's budget and one
        // permanent failure; `export`: a scatter. Only `charge` surges, and
        // its reason is the one its timeouts carry, not the other row's.
        let mut w = World::new();
        for i in 0..24 {
            w.dead_letter(
                "charge",
                DeadLetterReason::KindExhausted,
                "timeout",
                "timeout",
                S + i,
            );
        }
        w.dead_letter(
            "charge",
            DeadLetterReason::Permanent,
            "declined",
            "declined",
            S + 30,
        );
        for i in 0..30 {
            let msg = format!("row {i} has no column {}", i * 7919);
            w.dead_letter(
                "export",
                DeadLetterReason::Permanent,
                &format!("parse_{i}"),
                &msg,
                S + i,
            );
        }
        let surges = type_surges(&w.failures, &w.recent, at(2 * S), 20, 0.8);
        let got: Vec<_> = surges
            .iter()
            .map(|s| {
                (
                    s.surge.key.job_type().as_str(),
                    s.reason,
                    s.surge.count,
                    s.surge.total,
                )
            })
            .collect();
        assert_eq!(
            got,
            [("charge", Some(DeadLetterReason::KindExhausted), 24, 25)]
        );
        // Over all types the same failure holds under half: no single surge.
        assert_eq!(w.failures.surge_with(at(2 * S), 20, 0.8), None);
    }

    #[test]
    fn one_reason_surging_is_systemic_and_a_scatter_is_not() {
        // One failure, 25 times.
        let mut w = World::new();
        let mut a = Alerts::new(rule());
        w.poll(&mut a, 0);
        for i in 0..25 {
            w.dead_letter(
                "charge",
                DeadLetterReason::KindExhausted,
                "timeout",
                &format!("timeout after {i}ms"),
                S + i,
            );
        }
        let fired = w.poll(&mut a, 2 * S);
        expect![[r#"
            dead_letters_appeared charge - count=25 systemic=true
            poison_rate charge - count=25 systemic=true
            reason_surge charge kind_exhausted count=25 systemic=true
        "#]]
        .assert_eq(&(names(&fired).join("\n") + "\n"));
        let surge = &fired[2];
        assert_eq!(
            surge.link,
            "/#/dead-letters?type=charge&reason=kind_exhausted"
        );
        assert_eq!(surge.window, Duration::from_secs(300));
        expect![[r#"charge: 25 of the last 25 dead letters in 300 s share one failure (kind_exhausted: "timeout after <n>"): likely one bug or one outage, not scattered bad data"#]]
            .assert_eq(&surge.summary);

        // 25 different failures.
        let mut w = World::new();
        let mut a = Alerts::new(rule());
        w.poll(&mut a, 0);
        let words = ["alpha", "beta", "gamma", "delta", "epsilon"];
        for i in 0..25 {
            let msg = format!("field {} of {} missing", words[i % 5], words[i / 5]);
            w.dead_letter(
                "charge",
                DeadLetterReason::Permanent,
                "validation",
                &msg,
                S + i as i64,
            );
        }
        expect![[r#"
            dead_letters_appeared charge - count=25 systemic=false
            poison_rate charge - count=25 systemic=false
        "#]]
        .assert_eq(&(names(&w.poll(&mut a, 2 * S)).join("\n") + "\n"));
    }

    #[test]
    fn breakers_fire_on_opening_and_on_closing() {
        let mut b = Breakers::new(
            None,
            [(
                ty("pay"),
                BreakerConfig {
                    failures_min: 2,
                    failure_ratio: 0.5,
                    window: Duration::from_secs(60),
                    cooldown: Duration::from_secs(10),
                    probes: 1,
                },
            )]
            .into(),
        );
        let mut w = World::new();
        let mut a = Alerts::new(rule());
        let drain = |b: &mut Breakers, w: &mut World| {
            w.changes.extend(std::iter::from_fn(|| b.poll_transition()))
        };
        let k = ErrorKind::new("http_503");
        b.record_failure(&ty("pay"), &k, at(0));
        b.record_failure(&ty("pay"), &k, at(1));
        drain(&mut b, &mut w);
        let fired = w.poll(&mut a, 2);
        assert_eq!(
            names(&fired),
            ["breaker_opened pay http_503 count=0 systemic=false"]
        );
        assert_eq!(fired[0].link, "/#/breakers?type=pay");
        // Half-open after the cooldown: nothing; a probe succeeds: closed.
        b.snapshot(at(11 * S));
        drain(&mut b, &mut w);
        assert!(w.poll(&mut a, 11 * S).is_empty());
        b.record_success(&ty("pay"), at(12 * S));
        drain(&mut b, &mut w);
        assert_eq!(
            names(&w.poll(&mut a, 12 * S)),
            ["breaker_closed pay http_503 count=0 systemic=false"]
        );
        // Opening again within the cooldown is deduplicated.
        b.record_failure(&ty("pay"), &k, at(13 * S));
        b.record_failure(&ty("pay"), &k, at(13 * S + 1));
        drain(&mut b, &mut w);
        assert!(w.poll(&mut a, 14 * S).is_empty());
    }

    #[test]
    fn over_warn_repeats_after_each_cooldown_while_it_holds() {
        let mut w = World::new();
        w.warn_at = 2;
        let mut a = Alerts::new(AlertRule {
            events: [AlertEvent::DeadLettersOverWarn].into(),
            ..rule()
        });
        for i in 0..3 {
            w.dead_letter("t", DeadLetterReason::Permanent, "bad", "x", i);
        }
        let fired = w.poll(&mut a, S);
        assert_eq!(
            names(&fired),
            ["dead_letters_over_warn - - count=3 systemic=false"]
        );
        assert_eq!(fired[0].link, "/#/dead-letters");
        assert_eq!(
            fired[0].summary,
            "3 dead letters held, more than dead_letters_warn (2)"
        );
        assert!(w.poll(&mut a, 30 * S).is_empty());
        assert_eq!(w.poll(&mut a, 61 * S).len(), 1);
        w.purge();
        assert!(w.poll(&mut a, 200 * S).is_empty());
    }

    #[test]
    fn a_flood_of_new_types_is_announced_over_several_polls_not_lost() {
        let mut w = World::new();
        let mut a = Alerts::new(AlertRule {
            events: [AlertEvent::DeadLettersAppeared].into(),
            ..rule()
        });
        w.poll(&mut a, 0);
        let n = ALERTS_PER_POLL_MAX + 50;
        for i in 0..n {
            w.dead_letter(
                &format!("t{i:03}"),
                DeadLetterReason::Permanent,
                "bad",
                "x",
                S,
            );
        }
        let first = w.poll(&mut a, 2 * S);
        let second = w.poll(&mut a, 3 * S);
        assert_eq!((first.len(), second.len()), (ALERTS_PER_POLL_MAX, 50));
        let types: BTreeSet<_> = first
            .iter()
            .chain(&second)
            .map(|a| a.job_type.clone())
            .collect();
        assert_eq!(types.len(), n, "each type once");
        assert!(w.poll(&mut a, 4 * S).is_empty());
    }

    #[test]
    fn links_encode_their_parameters() {
        assert_eq!(
            link(
                AlertEvent::ReasonSurge,
                Some(&ty("a b&c")),
                Some("kind_exhausted")
            ),
            "/#/dead-letters?type=a%20b%26c&reason=kind_exhausted"
        );
        assert_eq!(link(AlertEvent::PoisonRate, None, None), "/#/dead-letters");
    }

    #[test]
    fn recent_dead_letters_are_bounded_and_age_out() {
        let mut r = RecentDeadLetters::default();
        for i in 0..(RECENT_MAX as i64 + 10) {
            r.record(Some(&ty("t")), DeadLetterReason::Permanent, None, at(i));
        }
        assert_eq!(r.len(), RECENT_MAX);
        r.record(
            None,
            DeadLetterReason::InvalidJson,
            None,
            at(RECENT_SPAN.as_millis() as i64 + 20_000),
        );
        assert_eq!(r.len(), 1, "everything older than the span is gone");
    }

    proptest! {
        /// Whatever happens, no (event, type, reason) is sent twice within a cooldown,
        /// and every alert names an enabled event.
        #[test]
        fn never_twice_within_a_cooldown(
            steps in prop::collection::vec((0u8..4, 0u8..3, 0u8..3, 0i64..40_000), 1..120),
            events in prop::collection::btree_set(0usize..6, 1..6),
            cooldown_s in 1u64..120,
        ) {
            let events: BTreeSet<AlertEvent> = events.into_iter().map(|i| AlertEvent::ALL[i]).collect();
            let r = AlertRule { events: events.clone(), cooldown: Duration::from_secs(cooldown_s), poison_rate_per_min: 3, surge_min: 4, surge_share: 0.8 };
            let mut a = Alerts::new(r);
            let mut b = Breakers::new(Some(BreakerConfig { failures_min: 2, failure_ratio: 0.5, window: Duration::from_secs(10), cooldown: Duration::from_secs(5), probes: 1 }), BTreeMap::new());
            let mut w = World::new();
            w.warn_at = 5;
            let mut now = 0i64;
            let mut sent: BTreeMap<DedupKey, i64> = BTreeMap::new();
            for (what, t, m, step) in steps {
                now += step;
                let t = ["a", "b", "c"][usize::from(t)];
                match what {
                    0 => w.dead_letter(t, DeadLetterReason::Exhausted, "timeout", ["x", "y", "z"][usize::from(m)], now),
                    1 => b.record_failure(&ty(t), &ErrorKind::new("http_503"), at(now)),
                    2 => b.record_success(&ty(t), at(now)),
                    _ => w.purge(),
                }
                b.snapshot(at(now));
                w.changes.extend(std::iter::from_fn(|| b.poll_transition()));
                for alert in w.poll(&mut a, now) {
                    prop_assert!(events.contains(&alert.event));
                    let key = (alert.event, alert.job_type.clone(), alert.reason.clone());
                    if let Some(last) = sent.get(&key) {
                        prop_assert!(now - last >= cooldown_s as i64 * 1000, "{key:?} at {last} and {now}");
                    }
                    sent.insert(key, now);
                }
            }
        }
    }
}
