//! Failure statistics: dead letters counted by fingerprint, as a rate, and as a surge signal.
//!
//! The dead-letter quarantine is a signal, not only a place: how fast it grows
//! (the poison rate) and how many distinct reasons fill it tell two different
//! incidents apart. *One* reason exploding is a systemic bug (a deploy broke a
//! dependency, a schema changed under the producers); *many scattered*
//! reasons are data quality. This module keeps the numbers that make that
//! call, in fixed memory, from the dead letters the core already decides on.
//!
//! - [`fingerprint`] normalises an error message so that the same failure with
//!   different data (ids, numbers, quoted values) reads the same.
//! - [`FailureKey`] is (job type, cause, fingerprint): what is counted.
//! - [`FailureStats`] counts keys under a cardinality guard
//!   ([`StatsConfig::keys_max`]), keeps a [`DeadLetterSeries`] of dead letters
//!   per time bucket, and reports a [`Surge`] when one key dominates the
//!   recent window.
//!
//! Like the rest of the core it reads no clock: every query that depends on
//! time takes `now`. Time that goes backwards is tolerated (nothing panics,
//! nothing grows), not made meaningful.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

use crate::failure::DeadLetterReason;
use crate::ids::{ErrorKind, JobType};
use crate::time::Timestamp;

// ---------------------------------------------------------------------------
// Fingerprints
// ---------------------------------------------------------------------------

/// Longest fingerprint, in chars; a longer one is cut at a token boundary
/// and ends with `…`.
pub const FINGERPRINT_CHARS_MAX: usize = 200;

/// What a number (`42`, `-1.5`, `0x1f`, `30ms`, `10.0.0.7:443`, a date) becomes.
pub const PLACEHOLDER_NUMBER: &str = "<n>";
/// What an id (a UUID, a long hex or random token, an e-mail address) becomes.
pub const PLACEHOLDER_ID: &str = "<id>";
/// What a quoted value (`'bob'`, `"x"`, `` `y` ``) becomes.
pub const PLACEHOLDER_QUOTED: &str = "<q>";

/// Marks a fingerprint cut at [`FINGERPRINT_CHARS_MAX`].
const ELLIPSIS: char = '…';
/// A word with a digit longer than this is an id; a word without one is kept,
/// in chunks of this many chars so that the cap can fall between them.
const WORD_CHARS_MAX: usize = 64;
/// A hex word at least this long (with a digit and a letter) is an id.
const HEX_ID_CHARS_MIN: usize = 8;
/// An ASCII alphanumeric word at least this long with a digit is an id
/// (API keys, base62 ids); shorter ones (`sha256`, `http2`) are vocabulary.
const RANDOM_ID_CHARS_MIN: usize = 16;
/// The length of `8-4-4-4-12` UUID text.
const UUID_BYTES: usize = 36;

/// Normalises an error message so that the same failure with different data
/// gives the same text.
///
/// Replaced, left to right:
/// - quoted values `'…'`, `"…"`, `` `…` `` by `<q>`. A quote opens only at
///   the start, after whitespace or one of `([{=,:`, and closes only before
///   the end, whitespace or one of `)]},.;:!?`, so that `can't` and `5'` are
///   not quotes;
/// - UUIDs, e-mail-ish tokens (`local@domain.tld`), words of 8+ hex chars
///   with a digit (`4f9c2e1a`, `deadbeef01`), ASCII words of 16+ chars with a
///   digit, and words with a digit longer than 64 chars, by `<id>`;
/// - numbers by `<n>`: a word that starts with a digit (`42`, `30ms`, `0x1f`,
///   `3rd`), joined with following digit-words across `.,:-/` (`1.5`,
///   `10.0.0.7:443`, `2024-01-02`), with a sign when one stands before it.
///
/// Words that start with a letter and are not ids are kept as they are
/// (`http_503`, `sha256`, `user42`): a digit inside a word is more often
/// vocabulary than data. Whitespace runs become one space, the ends are
/// trimmed, and the result is at most [`FINGERPRINT_CHARS_MAX`] chars.
///
/// Guarantees, checked by property tests: it never panics, the result is at
/// most the cap, and it is idempotent (`fingerprint(&fingerprint(x)) ==
/// fingerprint(x)`), so a fingerprint can be stored and normalised again. It
/// runs in time linear in the message.
pub fn fingerprint(message: &str) -> String {
    let mut out = String::new();
    fingerprint_into(message, &mut out);
    out
}

/// [`fingerprint`], written into `out` (cleared first) to reuse its buffer.
pub fn fingerprint_into(message: &str, out: &mut String) {
    out.clear();
    let mut w = Writer {
        out,
        chars: 0,
        space_pending: false,
        fit_len: 0,
        full: false,
    };
    let s = message;
    let mut i = 0;
    let mut prev: Option<char> = None;
    // Once a quote char has no closer after some position it has none after
    // any later one; remembering that keeps the whole pass linear.
    let mut closer_absent = [false; 3];
    while let Some(c) = s[i..].chars().next() {
        if w.full {
            break;
        }
        let next = i + c.len_utf8();
        if c.is_whitespace() {
            w.space();
        } else if let Some(q) = quote_slot(c) {
            let opens = prev.is_none_or(opens_quote_after) && !closer_absent[q];
            if opens {
                if let Some(end) = find_closer(s, next, c) {
                    w.piece(PLACEHOLDER_QUOTED);
                    prev = Some(c);
                    i = end;
                    continue;
                }
                closer_absent[q] = true;
            }
            w.piece_char(c);
        } else if (c == '-' || c == '+')
            && !prev.is_some_and(is_word_char)
            && s[next..].starts_with(|d: char| d.is_ascii_digit())
        {
            let (end, class) = classify_token(s, next);
            match class {
                Token::Number => w.piece(PLACEHOLDER_NUMBER),
                _ => {
                    w.piece_char(c);
                    w.token(&s[next..end], class);
                }
            }
            prev = s[..end].chars().next_back();
            i = end;
            continue;
        } else if is_word_char(c) {
            let (end, class) = classify_token(s, i);
            w.token(&s[i..end], class);
            prev = s[..end].chars().next_back();
            i = end;
            continue;
        } else {
            w.piece_char(c);
        }
        prev = Some(c);
        i = next;
    }
}

/// Appends whole pieces and cuts at a piece boundary, which is what keeps
/// the cap idempotent: a cut never splits a token into a different token.
struct Writer<'a> {
    out: &'a mut String,
    chars: usize,
    space_pending: bool,
    /// Byte length of the longest prefix that ends at a piece boundary and
    /// leaves room for the ellipsis.
    fit_len: usize,
    full: bool,
}

impl Writer<'_> {
    fn space(&mut self) {
        self.space_pending = true;
    }

    fn piece_char(&mut self, c: char) {
        let mut buf = [0u8; 4];
        self.piece(c.encode_utf8(&mut buf));
    }

    fn piece(&mut self, piece: &str) {
        if self.full {
            return;
        }
        let lead = usize::from(self.space_pending && !self.out.is_empty());
        let chars = self.chars + lead + piece.chars().count();
        if chars > FINGERPRINT_CHARS_MAX {
            self.out.truncate(self.fit_len);
            self.out.push(ELLIPSIS);
            self.full = true;
            return;
        }
        if lead == 1 {
            self.out.push(' ');
        }
        self.out.push_str(piece);
        self.space_pending = false;
        self.chars = chars;
        if chars < FINGERPRINT_CHARS_MAX {
            self.fit_len = self.out.len();
        }
    }

    fn token(&mut self, text: &str, class: Token) {
        match class {
            Token::Number => self.piece(PLACEHOLDER_NUMBER),
            Token::Id => self.piece(PLACEHOLDER_ID),
            Token::Word => {
                // Only digit-free words get here long; any prefix of one is
                // again a digit-free word, so cutting between chunks is stable.
                let mut rest = text;
                while !rest.is_empty() {
                    let cut = rest
                        .char_indices()
                        .nth(WORD_CHARS_MAX)
                        .map_or(rest.len(), |(b, _)| b);
                    self.piece(&rest[..cut]);
                    rest = &rest[cut..];
                }
            }
        }
    }
}

/// What a token starting at a word char turned out to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Token {
    Number,
    Id,
    Word,
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

fn quote_slot(c: char) -> Option<usize> {
    match c {
        '\'' => Some(0),
        '"' => Some(1),
        '`' => Some(2),
        _ => None,
    }
}

/// Chars a quote may open after. None of them is ever consumed into a token
/// when a quote follows, so the decision reads the same on a fingerprint.
fn opens_quote_after(prev: char) -> bool {
    prev.is_whitespace() || matches!(prev, '(' | '[' | '{' | '=' | ',' | ':')
}

/// Chars a quote may close before (or the end); same reasoning as above.
fn closes_quote_before(next: Option<char>) -> bool {
    next.is_none_or(|c| {
        c.is_whitespace() || matches!(c, ')' | ']' | '}' | ',' | '.' | ';' | ':' | '!' | '?')
    })
}

/// The byte just past the first closing `quote` at or after `from`.
fn find_closer(s: &str, from: usize, quote: char) -> Option<usize> {
    let rest = &s[from..];
    let mut it = rest.char_indices().peekable();
    while let Some((j, c)) = it.next() {
        if c == quote && closes_quote_before(it.peek().map(|&(_, n)| n)) {
            return Some(from + j + c.len_utf8());
        }
    }
    None
}

fn word_end(s: &str, start: usize) -> usize {
    s[start..]
        .char_indices()
        .find(|&(_, c)| !is_word_char(c))
        .map_or(s.len(), |(j, _)| start + j)
}

/// Classifies the token starting at `start` (a word char) and returns its end.
fn classify_token(s: &str, start: usize) -> (usize, Token) {
    if let Some(end) = uuid_at(s, start).or_else(|| email_at(s, start)) {
        return (end, Token::Id);
    }
    let end = word_end(s, start);
    let word = &s[start..end];
    let first_is_digit = word.starts_with(|c: char| c.is_ascii_digit());
    let has_digit = word.bytes().any(|b| b.is_ascii_digit());
    let all_hex = word.bytes().all(|b| b.is_ascii_hexdigit());
    let len = word.chars().count();
    if first_is_digit {
        if all_hex && len >= HEX_ID_CHARS_MIN && word.bytes().any(|b| b.is_ascii_alphabetic()) {
            return (end, Token::Id);
        }
        let mut end = end;
        // Join `1.5`, `10.0.0.7:443`, `2024-01-02`, `1/2`, `1,000`.
        loop {
            let mut rest = s[end..].chars();
            match (rest.next(), rest.next()) {
                (Some(j @ ('.' | ',' | ':' | '-' | '/')), Some(d)) if d.is_ascii_digit() => {
                    end = word_end(s, end + j.len_utf8());
                }
                _ => break,
            }
        }
        return (end, Token::Number);
    }
    if has_digit {
        let ascii_alnum = word.bytes().all(|b| b.is_ascii_alphanumeric());
        if len > WORD_CHARS_MAX
            || (all_hex && len >= HEX_ID_CHARS_MIN)
            || (ascii_alnum && len >= RANDOM_ID_CHARS_MIN)
        {
            return (end, Token::Id);
        }
    }
    (end, Token::Word)
}

/// The end of an `8-4-4-4-12` hex UUID at `start` that is not part of a longer word.
fn uuid_at(s: &str, start: usize) -> Option<usize> {
    let b = s.as_bytes().get(start..start + UUID_BYTES)?;
    let shaped = b.iter().enumerate().all(|(j, &c)| match j {
        8 | 13 | 18 | 23 => c == b'-',
        _ => c.is_ascii_hexdigit(),
    });
    let end = start + UUID_BYTES;
    // The bytes are ASCII, so `end` is a char boundary.
    (shaped && !s[end..].starts_with(is_word_char)).then_some(end)
}

/// The end of an e-mail-ish token `local@domain.tld` at `start`.
///
/// Deliberately loose (a domain needs one dot, not a real TLD): it is here to
/// hide addresses, not to validate them.
fn email_at(s: &str, start: usize) -> Option<usize> {
    let is_local = |c: char| c.is_alphanumeric() || matches!(c, '.' | '_' | '+' | '%' | '-');
    let is_domain = |c: char| c.is_alphanumeric() || matches!(c, '.' | '-');
    let at = s[start..]
        .char_indices()
        .find(|&(_, c)| !is_local(c))
        .map(|(j, c)| (start + j, c))?;
    if at.1 != '@' {
        return None;
    }
    let domain_start = at.0 + 1;
    let raw_end = s[domain_start..]
        .char_indices()
        .find(|&(_, c)| !is_domain(c))
        .map_or(s.len(), |(j, _)| domain_start + j);
    let domain = s[domain_start..raw_end].trim_end_matches(['.', '-']);
    domain.contains('.').then_some(domain_start + domain.len())
}

// ---------------------------------------------------------------------------
// Keys
// ---------------------------------------------------------------------------

/// What a dead letter is counted under, besides its job type and fingerprint.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FailureCause {
    /// The worker's failure kind (`timeout`, `http_503`): the same whichever
    /// budget ran out, so `exhausted` and `kind_exhausted` of one bug count
    /// together.
    Kind(ErrorKind),
    /// The dead-letter reason, for admission verdicts (no worker ran) and for
    /// dead letters that carry no kind.
    Reason(DeadLetterReason),
}

impl FailureCause {
    /// The cause of a dead letter: its kind if a worker reported one, else its reason.
    pub fn of(reason: DeadLetterReason, kind: Option<&ErrorKind>) -> Self {
        match kind {
            Some(kind) if !reason.is_admission() => FailureCause::Kind(kind.clone()),
            _ => FailureCause::Reason(reason),
        }
    }
}

impl fmt::Display for FailureCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailureCause::Kind(kind) => f.write_str(kind.as_str()),
            FailureCause::Reason(reason) => f.write_str(reason.as_str()),
        }
    }
}

/// (job type, cause, fingerprint): the unit dead letters are counted by.
///
/// The fingerprint is always normalised ([`fingerprint`]), which is why the
/// fields are read through accessors.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FailureKey {
    job_type: JobType,
    cause: FailureCause,
    fingerprint: String,
}

impl FailureKey {
    /// The key of a dead letter of type `ty` with this reason, kind and message.
    pub fn new(
        ty: &JobType,
        reason: DeadLetterReason,
        kind: Option<&ErrorKind>,
        message: &str,
    ) -> Self {
        FailureKey {
            job_type: ty.clone(),
            cause: FailureCause::of(reason, kind),
            fingerprint: fingerprint(message),
        }
    }

    /// The job type.
    pub fn job_type(&self) -> &JobType {
        &self.job_type
    }

    /// The failure kind or, without one, the dead-letter reason.
    pub fn cause(&self) -> &FailureCause {
        &self.cause
    }

    /// The normalised message.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }
}

impl fmt::Display for FailureKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}: {}", self.job_type, self.cause, self.fingerprint)
    }
}

// ---------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------

/// Largest allowed [`StatsConfig::keys_max`].
pub const KEYS_MAX_LIMIT: usize = 10_000;
/// Largest allowed [`StatsConfig::buckets`] (a week of minutes).
pub const BUCKETS_LIMIT: usize = 10_080;
/// Largest allowed [`StatsConfig::surge_buckets`]; every tracked key keeps
/// this many counters, so it bounds memory as `keys_max` does.
pub const SURGE_BUCKETS_LIMIT: usize = 60;
/// Widest allowed [`StatsConfig::bucket_width`].
pub const BUCKET_WIDTH_LIMIT: Duration = Duration::from_secs(24 * 60 * 60);

/// Bounds and thresholds of [`FailureStats`].
#[derive(Clone, Debug, PartialEq)]
pub struct StatsConfig {
    /// Most distinct keys counted individually; the rest count as `other`.
    pub keys_max: usize,
    /// Width of one time bucket (whole milliseconds; a sub-millisecond rest
    /// is ignored).
    pub bucket_width: Duration,
    /// Number of buckets in the dead-letter series: the series spans
    /// `buckets × bucket_width`.
    pub buckets: usize,
    /// The surge window, in buckets (the current one included).
    pub surge_buckets: usize,
    /// Fewest dead letters in the surge window for a surge to be reported:
    /// three of three is not an incident.
    pub surge_count_min: u64,
    /// Smallest share of the window one key must hold, above one half so that
    /// the dominant key is unique.
    pub surge_share_min: f64,
}

impl Default for StatsConfig {
    /// 100 keys; an hour of one-minute buckets; a surge is 20 or more dead
    /// letters in five minutes, 80 % of them under one key.
    fn default() -> Self {
        StatsConfig {
            keys_max: 100,
            bucket_width: Duration::from_secs(60),
            buckets: 60,
            surge_buckets: 5,
            surge_count_min: 20,
            surge_share_min: 0.8,
        }
    }
}

impl StatsConfig {
    /// Checks every field against its allowed range.
    pub fn validate(&self) -> Result<(), StatsConfigError> {
        if !(1..=KEYS_MAX_LIMIT).contains(&self.keys_max) {
            return Err(StatsConfigError::KeysMax(self.keys_max));
        }
        if self.bucket_width.as_millis() < 1 || self.bucket_width > BUCKET_WIDTH_LIMIT {
            return Err(StatsConfigError::BucketWidth(self.bucket_width));
        }
        if !(1..=BUCKETS_LIMIT).contains(&self.buckets) {
            return Err(StatsConfigError::Buckets(self.buckets));
        }
        let surge_max = self.buckets.min(SURGE_BUCKETS_LIMIT);
        if !(1..=surge_max).contains(&self.surge_buckets) {
            return Err(StatsConfigError::SurgeBuckets {
                value: self.surge_buckets,
                max: surge_max,
            });
        }
        if self.surge_count_min == 0 {
            return Err(StatsConfigError::SurgeCountMin(self.surge_count_min));
        }
        if !(self.surge_share_min > 0.5 && self.surge_share_min <= 1.0) {
            return Err(StatsConfigError::SurgeShareMin(self.surge_share_min));
        }
        Ok(())
    }
}

/// A [`StatsConfig`] field outside its allowed range.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum StatsConfigError {
    /// `keys_max` out of range.
    #[error("keys_max is {0}; allowed range is 1..={max}", max = KEYS_MAX_LIMIT)]
    KeysMax(usize),
    /// `bucket_width` out of range.
    #[error("bucket_width is {0:?}; allowed range is 1ms..=24h")]
    BucketWidth(Duration),
    /// `buckets` out of range.
    #[error("buckets is {0}; allowed range is 1..={max}", max = BUCKETS_LIMIT)]
    Buckets(usize),
    /// `surge_buckets` out of range.
    #[error(
        "surge_buckets is {value}; allowed range is 1..={max} (at most buckets and at most {limit})",
        limit = SURGE_BUCKETS_LIMIT
    )]
    SurgeBuckets {
        /// The value given.
        value: usize,
        /// The largest value allowed with this `buckets`.
        max: usize,
    },
    /// `surge_count_min` out of range.
    #[error("surge_count_min is {0}; allowed range is 1..={max}", max = u64::MAX)]
    SurgeCountMin(u64),
    /// `surge_share_min` out of range.
    #[error("surge_share_min is {0}; allowed range is above 0.5 up to 1.0 (0.5 < x <= 1.0)")]
    SurgeShareMin(f64),
}

// ---------------------------------------------------------------------------
// Time buckets
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
struct Slot {
    /// Which bucket (`ms / width`) the count belongs to; a slot whose bucket
    /// is not the one asked for reads as zero, so nothing is ever swept.
    bucket: i64,
    count: u64,
}

/// A ring of per-bucket counters, `len` buckets long.
#[derive(Clone, Debug)]
struct Ring {
    slots: Box<[Slot]>,
}

impl Ring {
    fn new(len: usize) -> Self {
        let empty = Slot {
            bucket: i64::MIN,
            count: 0,
        };
        Ring {
            slots: vec![empty; len.max(1)].into_boxed_slice(),
        }
    }

    fn position(&self, bucket: i64) -> usize {
        // `len` is at most BUCKETS_LIMIT, so both conversions are lossless.
        bucket.rem_euclid(self.slots.len() as i64) as usize
    }

    /// Counts one in `bucket`; false when the slot already moved on to a
    /// later bucket (time went backwards further than the ring reaches).
    fn record(&mut self, bucket: i64) -> bool {
        let pos = self.position(bucket);
        let slot = &mut self.slots[pos];
        if slot.bucket < bucket {
            *slot = Slot { bucket, count: 0 };
        }
        if slot.bucket == bucket {
            slot.count = slot.count.saturating_add(1);
            true
        } else {
            false
        }
    }

    fn count_at(&self, bucket: i64) -> u64 {
        let slot = self.slots[self.position(bucket)];
        if slot.bucket == bucket { slot.count } else { 0 }
    }

    /// The count of the `n` buckets ending with `last` (clamped to the ring).
    fn count_back(&self, last: i64, n: usize) -> u64 {
        (0..n.min(self.slots.len()))
            .map_while(|j| last.checked_sub(j as i64))
            .fold(0u64, |sum, b| sum.saturating_add(self.count_at(b)))
    }
}

/// Dead letters per time bucket over a fixed span: `buckets` buckets of
/// `bucket_width`, the last one holding `now`.
///
/// Memory is fixed at construction; old buckets are overwritten as time
/// moves on and read as zero once they fall out of the span.
#[derive(Clone, Debug)]
pub struct DeadLetterSeries {
    width_ms: i64,
    ring: Ring,
}

impl DeadLetterSeries {
    fn new(bucket_width: Duration, buckets: usize) -> Self {
        let width_ms = i64::try_from(bucket_width.as_millis())
            .unwrap_or(i64::MAX)
            .max(1);
        DeadLetterSeries {
            width_ms,
            ring: Ring::new(buckets),
        }
    }

    fn bucket_of(&self, now: Timestamp) -> i64 {
        now.as_millis().div_euclid(self.width_ms)
    }

    /// The width of one bucket.
    pub fn bucket_width(&self) -> Duration {
        Duration::from_millis(self.width_ms.unsigned_abs())
    }

    /// The number of buckets.
    pub fn buckets(&self) -> usize {
        self.ring.slots.len()
    }

    /// Dead letters in the last `buckets` buckets, the one holding `now`
    /// included (clamped to the series).
    pub fn count_within(&self, now: Timestamp, buckets: usize) -> u64 {
        self.ring.count_back(self.bucket_of(now), buckets)
    }

    /// Dead letters per bucket over the whole span, oldest first; the last
    /// entry is the (partial) bucket holding `now`.
    pub fn recent(&self, now: Timestamp) -> Vec<u64> {
        let last = self.bucket_of(now);
        (0..self.buckets())
            .rev()
            .map(|j| {
                last.checked_sub(j as i64)
                    .map_or(0, |b| self.ring.count_at(b))
            })
            .collect()
    }

    /// Dead letters per minute, averaged over the series' full span
    /// (`buckets × bucket_width`) ending at `now`.
    ///
    /// The current bucket is partial, so a sudden burst shows up at once but
    /// diluted by the span; [`FailureStats::surge`] is the sharper signal.
    pub fn rate_per_min(&self, now: Timestamp) -> f64 {
        let count = self.count_within(now, self.buckets());
        let span_ms = self.width_ms as f64 * self.buckets() as f64;
        count as f64 * 60_000.0 / span_ms
    }
}

// ---------------------------------------------------------------------------
// FailureStats
// ---------------------------------------------------------------------------

/// A tracked key's count, as [`FailureStats::top`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyCount {
    /// The key.
    pub key: FailureKey,
    /// Dead letters counted under this key since it was last admitted to the
    /// table: exact for that period, a lower bound of its true count.
    pub count: u64,
    /// How many dead letters before its admission may also have been this
    /// key: the true count lies in `count..=count + error_max`.
    pub error_max: u64,
}

/// One key dominates the recent dead letters: a systemic failure rather than
/// scattered poison.
#[derive(Clone, Debug, PartialEq)]
pub struct Surge {
    /// The dominant key.
    pub key: FailureKey,
    /// Its dead letters in the window.
    pub count: u64,
    /// All dead letters in the window.
    pub total: u64,
    /// `count / total`, in `surge_share_min..=1.0`.
    pub share: f64,
    /// The window's length (`surge_buckets × bucket_width`; the current
    /// bucket may be partial).
    pub window: Duration,
}

#[derive(Clone, Debug)]
struct Entry {
    key: FailureKey,
    /// Counted since admission.
    count: u64,
    /// Inherited from the evicted entry (space-saving's overestimate).
    error_max: u64,
    last_seen: Timestamp,
    /// This key's dead letters per bucket over the surge window.
    recent: Ring,
}

impl Entry {
    /// Eviction order: smallest estimate first, then least recently seen,
    /// then slot, so the choice is deterministic.
    fn rank(&self, slot: usize) -> (u64, i64, usize) {
        (
            self.count.saturating_add(self.error_max),
            self.last_seen.as_millis(),
            slot,
        )
    }
}

/// Dead-letter statistics in fixed memory: counts by [`FailureKey`], a
/// [`DeadLetterSeries`], and a [`Surge`] signal.
///
/// **Input:** [`record_dead_letter`](Self::record_dead_letter) (or
/// [`record`](Self::record) with a prepared key) once per dead letter, in the
/// order they happen. **Queries:** [`top`](Self::top),
/// [`other`](Self::other), [`total`](Self::total),
/// [`rate_per_min`](Self::rate_per_min), [`recent`](Self::recent),
/// [`surge`](Self::surge); they take `now` where time matters and never
/// change the stats.
///
/// # Cardinality guard: space-saving with an `other` bucket
///
/// At most [`StatsConfig::keys_max`] keys are tracked. When a new key arrives
/// and the table is full, the key with the smallest estimate (count plus
/// inherited error; ties: least recently seen) is evicted: its count moves to
/// `other`, and the newcomer inherits its estimate as `error_max`
/// (Metwally et al., *space-saving*). Chosen over "first K, then other"
/// because the failures worth seeing are often the *new* ones: after a day of
/// scattered poison has filled the table, first-K would hide tomorrow's
/// systemic bug in `other` forever, whereas space-saving admits every
/// newcomer and keeps any key holding more than `total / keys_max` of the
/// dead letters. Recording is O(log keys_max); memory is
/// `keys_max × (key + surge_buckets counters)` plus `buckets` counters.
///
/// Invariant: the counts of the tracked keys plus [`other`](Self::other)
/// equal [`total`](Self::total).
#[derive(Clone, Debug)]
pub struct FailureStats {
    config: StatsConfig,
    series: DeadLetterSeries,
    entries: Vec<Entry>,
    by_key: BTreeMap<FailureKey, usize>,
    by_rank: BTreeSet<(u64, i64, usize)>,
    other: u64,
    total: u64,
}

impl Default for FailureStats {
    /// Stats with [`StatsConfig::default`].
    fn default() -> Self {
        FailureStats::build(StatsConfig::default())
    }
}

impl FailureStats {
    /// Empty stats, after checking `config`.
    pub fn new(config: StatsConfig) -> Result<Self, StatsConfigError> {
        config.validate()?;
        Ok(FailureStats::build(config))
    }

    fn build(config: StatsConfig) -> Self {
        FailureStats {
            series: DeadLetterSeries::new(config.bucket_width, config.buckets),
            entries: Vec::with_capacity(config.keys_max),
            by_key: BTreeMap::new(),
            by_rank: BTreeSet::new(),
            other: 0,
            total: 0,
            config,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &StatsConfig {
        &self.config
    }

    /// Counts one dead letter of type `ty`, dead-lettered for `reason`, whose
    /// last failure had `kind` and `message`, at `now`.
    pub fn record_dead_letter(
        &mut self,
        ty: &JobType,
        reason: DeadLetterReason,
        kind: Option<&ErrorKind>,
        message: &str,
        now: Timestamp,
    ) {
        self.record(FailureKey::new(ty, reason, kind, message), now);
    }

    /// Counts one dead letter under `key` at `now`.
    pub fn record(&mut self, key: FailureKey, now: Timestamp) {
        self.total = self.total.saturating_add(1);
        let bucket = self.series.bucket_of(now);
        // A record too old for the series is kept out of the key's window
        // too, so a key's window count never exceeds the window's total.
        let in_series = self.series.ring.record(bucket);
        let slot = match self.by_key.get(&key) {
            Some(&slot) => slot,
            None => self.admit(key),
        };
        let entry = &mut self.entries[slot];
        self.by_rank.remove(&entry.rank(slot));
        entry.count = entry.count.saturating_add(1);
        entry.last_seen = now;
        if in_series {
            entry.recent.record(bucket);
        }
        self.by_rank.insert(entry.rank(slot));
    }

    /// Gives `key` a slot, evicting the smallest estimate when full.
    fn admit(&mut self, key: FailureKey) -> usize {
        let mut entry = Entry {
            key: key.clone(),
            count: 0,
            error_max: 0,
            last_seen: Timestamp::EPOCH,
            recent: Ring::new(self.config.surge_buckets),
        };
        let victim = if self.entries.len() < self.config.keys_max {
            None
        } else {
            self.by_rank.pop_first()
        };
        let slot = match victim {
            None => {
                self.entries.push(entry);
                self.entries.len() - 1
            }
            Some((estimate, _, slot)) => {
                entry.error_max = estimate;
                let old = std::mem::replace(&mut self.entries[slot], entry);
                self.by_key.remove(&old.key);
                self.other = self.other.saturating_add(old.count);
                slot
            }
        };
        self.by_key.insert(key, slot);
        self.by_rank.insert(self.entries[slot].rank(slot));
        slot
    }

    /// The `n` tracked keys with the most dead letters, most first (ties in
    /// key order).
    pub fn top(&self, n: usize) -> Vec<KeyCount> {
        let mut all: Vec<&Entry> = self.entries.iter().collect();
        all.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.key.cmp(&b.key)));
        all.into_iter()
            .take(n)
            .map(|e| KeyCount {
                key: e.key.clone(),
                count: e.count,
                error_max: e.error_max,
            })
            .collect()
    }

    /// Dead letters not attributed to a tracked key (evicted keys' counts).
    pub fn other(&self) -> u64 {
        self.other
    }

    /// All dead letters recorded.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// How many distinct keys are tracked (at most `keys_max`).
    pub fn tracked(&self) -> usize {
        self.entries.len()
    }

    /// The dead-letter series.
    pub fn series(&self) -> &DeadLetterSeries {
        &self.series
    }

    /// Dead letters per minute over the series' span ending at `now`.
    pub fn rate_per_min(&self, now: Timestamp) -> f64 {
        self.series.rate_per_min(now)
    }

    /// Dead letters per bucket, oldest first, the last holding `now`.
    pub fn recent(&self, now: Timestamp) -> Vec<u64> {
        self.series.recent(now)
    }

    /// The dominant key of the surge window ending at `now`, if the window
    /// holds at least `surge_count_min` dead letters and that key at least
    /// `surge_share_min` of them.
    ///
    /// `None` with many dead letters means they are scattered over many keys:
    /// data quality rather than one broken dependency. O(keys_max × surge_buckets).
    pub fn surge(&self, now: Timestamp) -> Option<Surge> {
        self.surge_with(
            now,
            self.config.surge_count_min,
            self.config.surge_share_min,
        )
    }

    /// The surge rule per type: each type whose tracked dead letters in the
    /// window number at least `count_min`, with one failure (cause and
    /// fingerprint) holding at least `share_min` of them, in type order.
    /// A surge of one type is not diluted by a scatter in another (what
    /// the alerts' `reason_surge` asks). Dead letters of no readable type
    /// surge nowhere.
    pub fn surges_by_type(&self, now: Timestamp, count_min: u64, share_min: f64) -> Vec<Surge> {
        let share_min = if share_min > 0.5 {
            share_min
        } else {
            0.5 + f64::EPSILON
        };
        let last = self.series.bucket_of(now);
        let window = self.config.surge_buckets;
        // Per type: its total, and its largest entry (ties: the smaller key).
        let mut per: BTreeMap<&JobType, (u64, u64, &Entry)> = BTreeMap::new();
        for e in &self.entries {
            let n = e.recent.count_back(last, window);
            if n == 0 || e.key.job_type().as_str().is_empty() {
                continue;
            }
            let slot = per.entry(e.key.job_type()).or_insert((0, 0, e));
            slot.0 += n;
            if n > slot.1 || (n == slot.1 && e.key < slot.2.key) {
                slot.1 = n;
                slot.2 = e;
            }
        }
        per.into_values()
            .filter(|(total, count, _)| {
                *total >= count_min.max(1) && *count as f64 >= share_min * *total as f64
            })
            .map(|(total, count, e)| Surge {
                key: e.key.clone(),
                count,
                total,
                share: count as f64 / total as f64,
                window: self.series.bucket_width() * window as u32,
            })
            .collect()
    }

    /// [`surge`](Self::surge) with other thresholds: at least `count_min`
    /// dead letters in the window and one key holding at least `share_min`
    /// of them (the alerts' `surge_min` and `surge_share`). A `share_min`
    /// of one half or less is taken as just above it, so that the dominant
    /// key stays unique.
    pub fn surge_with(&self, now: Timestamp, count_min: u64, share_min: f64) -> Option<Surge> {
        let share_min = if share_min > 0.5 {
            share_min
        } else {
            0.5 + f64::EPSILON
        };
        let last = self.series.bucket_of(now);
        let window = self.config.surge_buckets;
        let total = self.series.ring.count_back(last, window);
        if total < count_min.max(1) {
            return None;
        }
        let (count, entry) = self
            .entries
            .iter()
            .map(|e| (e.recent.count_back(last, window), e))
            .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.key.cmp(&a.1.key)))?;
        // Only time going backwards could make `count > total`; clamp.
        let total = total.max(count);
        let share = count as f64 / total as f64;
        (share >= share_min).then(|| Surge {
            key: entry.key.clone(),
            count,
            total,
            share,
            window: self.series.bucket_width() * window as u32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use expect_test::expect;
    use proptest::prelude::*;

    const MIN: i64 = 60_000;

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn ty(name: &str) -> JobType {
        JobType::new(name)
    }

    fn same(a: &str, b: &str) {
        assert_eq!(fingerprint(a), fingerprint(b), "{a:?} vs {b:?}");
    }

    fn differ(a: &str, b: &str) {
        assert_ne!(fingerprint(a), fingerprint(b), "{a:?} vs {b:?}");
    }

    #[test]
    fn fingerprint_collapses_data_and_keeps_failures_apart() {
        same(
            "timeout after 30012ms calling 10.0.0.7:443",
            "timeout after 5ms calling 192.168.1.20:8080",
        );
        same("user 'bob' not found", "user 'alice o''brien' not found");
        same("user 'bob' not found", "user \"carol\" not found");
        same(
            "order 4f9c2e1a-7b3d-4c1e-9a2f-0e1d2c3b4a59 failed",
            "order 00000000-0000-0000-0000-000000000000 failed",
        );
        same("retry in 1.5s", "retry in 30s");
        same("offset -1 out of range", "offset 42 out of range");
        same("bad flags 0x1f", "bad flags 0xdeadbeef");
        same(
            "mail to bob@example.com bounced",
            "mail to a.b+x@mail.co.uk bounced",
        );
        same(
            "blob deadbeef01234567 missing",
            "blob a1b2c3d4e5f60718 missing",
        );
        same("  lots   of\twhite\nspace ", "lots of white space");

        differ("user 'bob' not found", "order 'bob' not found");
        differ("timeout after 30ms", "connection refused after 30ms");
        differ("http_503 from upstream", "http_404 from upstream");
        differ("sha256 mismatch", "md5 mismatch");
    }

    #[test]
    fn apostrophes_are_not_quotes() {
        assert_eq!(fingerprint("can't parse 'x'"), "can't parse <q>");
        assert_eq!(fingerprint("it's 5' long"), "it's <n>' long");
        assert_eq!(fingerprint("unclosed 'quote here"), "unclosed 'quote here");
    }

    #[test]
    fn long_messages_are_cut_at_a_token_boundary() {
        let long = "word ".repeat(100);
        let fp = fingerprint(&long);
        assert!(fp.chars().count() <= FINGERPRINT_CHARS_MAX);
        assert!(fp.ends_with("word…"), "{fp}");
        assert_eq!(fingerprint(&fp), fp);
        // A long digit-free word is kept in chunks, and cut between them.
        let word = "x".repeat(500);
        let fp = fingerprint(&word);
        assert_eq!(fp.chars().count(), 3 * WORD_CHARS_MAX + 1);
        assert_eq!(fingerprint(&fp), fp);
    }

    #[test]
    fn fingerprint_table() {
        let table = [
            "timeout after 30012ms calling 10.0.0.7:443",
            "user 'bob' not found",
            "order 4f9c2e1a-7b3d-4c1e-9a2f-0e1d2c3b4a59 failed",
            "HTTP 503 Service Unavailable (retry-after: 120)",
            "invalid value \"abc\" for field `amount` at line 3, column 17",
            "expected 2024-01-02T10:00:00Z to be before 1970-01-01",
            "ECONNREFUSED 127.0.0.1:5432",
            "mail to bob.smith+tag@example.com bounced: mailbox full",
            "key AKIAIOSFODNN7EXAMPLE1 rejected; sha256 c0ffee42c0ffee42 != a1b2",
            "can't decode payload: got -12.5e3, want u32",
            "{\"id\":17,\"name\":\"x\"} does not match schema",
            "lease expired before ack or fail (the worker died or stalled)",
            "message…[truncated 1234 bytes]",
            "  \t ",
        ];
        let rendered: String = table
            .iter()
            .map(|m| format!("{m:?}\n  => {:?}\n", fingerprint(m)))
            .collect();
        expect![[r#"
            "timeout after 30012ms calling 10.0.0.7:443"
              => "timeout after <n> calling <n>"
            "user 'bob' not found"
              => "user <q> not found"
            "order 4f9c2e1a-7b3d-4c1e-9a2f-0e1d2c3b4a59 failed"
              => "order <id> failed"
            "HTTP 503 Service Unavailable (retry-after: 120)"
              => "HTTP <n> Service Unavailable (retry-after: <n>)"
            "invalid value \"abc\" for field `amount` at line 3, column 17"
              => "invalid value <q> for field <q> at line <n>, column <n>"
            "expected 2024-01-02T10:00:00Z to be before 1970-01-01"
              => "expected <n> to be before <n>"
            "ECONNREFUSED 127.0.0.1:5432"
              => "ECONNREFUSED <n>"
            "mail to bob.smith+tag@example.com bounced: mailbox full"
              => "mail to <id> bounced: mailbox full"
            "key AKIAIOSFODNN7EXAMPLE1 rejected; sha256 c0ffee42c0ffee42 != a1b2"
              => "key <id> rejected; sha256 <id> != a1b2"
            "can't decode payload: got -12.5e3, want u32"
              => "can't decode payload: got <n>, want u32"
            "{\"id\":17,\"name\":\"x\"} does not match schema"
              => "{<q>:<n>,<q>:<q>} does not match schema"
            "lease expired before ack or fail (the worker died or stalled)"
              => "lease expired before ack or fail (the worker died or stalled)"
            "message…[truncated 1234 bytes]"
              => "message…[truncated <n> bytes]"
            "  \t "
              => ""
        "#]]
        .assert_eq(&rendered);
    }

    #[test]
    fn key_uses_the_kind_for_worker_failures_and_the_reason_for_admission() {
        let t = ty("send_email");
        let timeout = ErrorKind::new("timeout");
        let a = FailureKey::new(&t, DeadLetterReason::Exhausted, Some(&timeout), "after 5ms");
        let b = FailureKey::new(
            &t,
            DeadLetterReason::KindExhausted,
            Some(&timeout),
            "after 9ms",
        );
        assert_eq!(a, b);
        assert_eq!(a.to_string(), "send_email/timeout: after <n>");
        let c = FailureKey::new(&t, DeadLetterReason::SchemaInvalid, Some(&timeout), "x");
        assert_eq!(
            c.cause(),
            &FailureCause::Reason(DeadLetterReason::SchemaInvalid)
        );
        let d = FailureKey::new(&t, DeadLetterReason::Permanent, None, "x");
        assert_eq!(
            d.cause(),
            &FailureCause::Reason(DeadLetterReason::Permanent)
        );
    }

    fn small(keys_max: usize) -> FailureStats {
        FailureStats::new(StatsConfig {
            keys_max,
            ..StatsConfig::default()
        })
        .unwrap()
    }

    fn record_n(stats: &mut FailureStats, message: &str, n: usize, now: Timestamp) {
        for _ in 0..n {
            stats.record_dead_letter(&ty("t"), DeadLetterReason::Permanent, None, message, now);
        }
    }

    /// A distinct letters-only word for each `i`, so that each is its own key.
    fn letters(mut i: usize) -> String {
        let mut word = String::new();
        loop {
            word.push(char::from(b'a' + (i % 26) as u8));
            i /= 26;
            if i == 0 {
                return word;
            }
        }
    }

    #[test]
    fn cardinality_guard_holds_at_keys_max_with_the_rest_in_other() {
        let mut stats = small(3);
        record_n(&mut stats, "alpha", 10, at(0));
        record_n(&mut stats, "beta", 8, at(0));
        for word in ["gamma", "delta", "epsilon", "zeta", "eta"] {
            record_n(&mut stats, word, 1, at(0));
        }
        assert_eq!(stats.tracked(), 3);
        assert_eq!(stats.total(), 10 + 8 + 5);
        let top = stats.top(10);
        let counted: u64 = top.iter().map(|k| k.count).sum();
        assert_eq!(counted + stats.other(), stats.total());
        // The heavy keys stay; each light newcomer displaced the previous
        // one, inheriting its estimate as error, and the displaced went to other.
        let summary: Vec<String> = top
            .iter()
            .map(|k| format!("{} {}+{}", k.key.fingerprint(), k.count, k.error_max))
            .collect();
        assert_eq!(summary, ["alpha 10+0", "beta 8+0", "eta 1+4"]);
        assert_eq!(stats.other(), 4);
        assert_eq!(stats.top(1).len(), 1);
    }

    #[test]
    fn a_late_heavy_key_gets_in_where_first_k_would_hide_it() {
        let mut stats = small(10);
        for i in 0..50 {
            record_n(
                &mut stats,
                &format!("missing field {}", letters(i)),
                1,
                at(0),
            );
        }
        assert_eq!(stats.tracked(), 10);
        record_n(&mut stats, "the new bug", 30, at(MIN));
        let top = stats.top(1);
        assert_eq!(top[0].key.fingerprint(), "the new bug");
        assert_eq!(top[0].count, 30);
    }

    #[test]
    fn series_buckets_roll_over() {
        let mut stats = FailureStats::new(StatsConfig {
            buckets: 3,
            surge_buckets: 1,
            ..StatsConfig::default()
        })
        .unwrap();
        record_n(&mut stats, "x", 1, at(0));
        record_n(&mut stats, "x", 2, at(MIN + 5));
        record_n(&mut stats, "x", 3, at(2 * MIN + 59_999));
        assert_eq!(stats.recent(at(2 * MIN)), [1, 2, 3]);
        assert_eq!(stats.rate_per_min(at(2 * MIN)), 2.0);
        // Minute 3 reuses minute 0's slot; minute 0 has left the span.
        record_n(&mut stats, "x", 4, at(3 * MIN));
        assert_eq!(stats.recent(at(3 * MIN)), [2, 3, 4]);
        assert_eq!(stats.series().count_within(at(3 * MIN), 2), 7);
        // Reading later without recording: old buckets read as zero.
        assert_eq!(stats.recent(at(5 * MIN)), [4, 0, 0]);
        assert_eq!(stats.recent(at(100 * MIN)), [0, 0, 0]);
        assert_eq!(stats.rate_per_min(at(100 * MIN)), 0.0);
        // Time that runs back beyond the ring is not counted in the series.
        record_n(&mut stats, "x", 1, at(0));
        assert_eq!(stats.recent(at(3 * MIN)), [2, 3, 4]);
        assert_eq!(stats.total(), 11);
    }

    #[test]
    fn negative_timestamps_bucket_by_floor() {
        let mut stats = FailureStats::new(StatsConfig {
            buckets: 3,
            surge_buckets: 1,
            ..StatsConfig::default()
        })
        .unwrap();
        record_n(&mut stats, "x", 1, at(-1));
        record_n(&mut stats, "x", 2, at(0));
        assert_eq!(stats.recent(at(0)), [0, 1, 2]);
        assert_eq!(stats.recent(at(-MIN)), [0, 0, 1]);
    }

    #[test]
    fn surge_fires_for_one_dominant_reason() {
        let mut stats = FailureStats::default();
        record_n(&mut stats, "scattered 'a'", 3, at(0));
        record_n(
            &mut stats,
            "db pool exhausted after 30000ms",
            45,
            at(2 * MIN),
        );
        record_n(
            &mut stats,
            "db pool exhausted after 29000ms",
            45,
            at(3 * MIN),
        );
        record_n(&mut stats, "something else", 5, at(4 * MIN));
        let surge = stats.surge(at(4 * MIN)).expect("one key holds 90 of 98");
        assert_eq!(surge.key.fingerprint(), "db pool exhausted after <n>");
        assert_eq!((surge.count, surge.total), (90, 98));
        assert!(surge.share > 0.9);
        assert_eq!(surge.window, Duration::from_secs(5 * 60));
        // Ten minutes on, the window is empty again.
        assert_eq!(stats.surge(at(14 * MIN)), None);
    }

    #[test]
    fn surge_stays_quiet_for_scattered_reasons_with_the_same_total() {
        let mut stats = FailureStats::default();
        for i in 0..50 {
            let word: String = (0..=i).map(|j| char::from(b'a' + (j % 26) as u8)).collect();
            record_n(
                &mut stats,
                &format!("field {word} is missing"),
                2,
                at(3 * MIN),
            );
        }
        assert_eq!(stats.series().count_within(at(3 * MIN), 5), 100);
        assert_eq!(stats.tracked(), 50);
        assert_eq!(stats.surge(at(3 * MIN)), None);
    }

    #[test]
    fn surge_needs_the_minimum_count() {
        let mut stats = FailureStats::default();
        record_n(&mut stats, "boom", 19, at(0));
        assert_eq!(stats.surge(at(0)), None);
        record_n(&mut stats, "boom", 1, at(0));
        assert!(stats.surge(at(0)).is_some());
    }

    #[test]
    fn config_validation_names_the_field_and_range() {
        assert_eq!(StatsConfig::default().validate(), Ok(()));
        let bad = |f: fn(&mut StatsConfig)| {
            let mut c = StatsConfig::default();
            f(&mut c);
            c.validate().unwrap_err().to_string()
        };
        assert_eq!(
            bad(|c| c.keys_max = 0),
            "keys_max is 0; allowed range is 1..=10000"
        );
        assert_eq!(
            bad(|c| c.bucket_width = Duration::from_micros(10)),
            "bucket_width is 10µs; allowed range is 1ms..=24h"
        );
        assert_eq!(
            bad(|c| c.buckets = 20_000),
            "buckets is 20000; allowed range is 1..=10080"
        );
        assert_eq!(
            bad(|c| c.surge_buckets = 61),
            "surge_buckets is 61; allowed range is 1..=60 (at most buckets and at most 60)"
        );
        assert_eq!(
            bad(|c| {
                c.buckets = 3;
                c.surge_buckets = 4;
            }),
            "surge_buckets is 4; allowed range is 1..=3 (at most buckets and at most 60)"
        );
        assert!(
            bad(|c| c.surge_count_min = 0)
                .starts_with("surge_count_min is 0; allowed range is 1..=")
        );
        assert_eq!(
            bad(|c| c.surge_share_min = 0.5),
            "surge_share_min is 0.5; allowed range is above 0.5 up to 1.0 (0.5 < x <= 1.0)"
        );
        assert!(bad(|c| c.surge_share_min = f64::NAN).starts_with("surge_share_min is NaN"));
        assert!(
            FailureStats::new(StatsConfig {
                keys_max: 0,
                ..StatsConfig::default()
            })
            .is_err()
        );
    }

    /// Text built from the characters the normaliser cares about, so that
    /// quotes, ids, numbers and their neighbours meet often.
    fn tricky_text() -> impl Strategy<Value = String> {
        const ALPHABET: &[char] = &[
            'a', 'b', 'f', 'x', 'z', 'é', '0', '1', '9', '.', ',', ':', '-', '+', '/', '@', '_',
            '%', '\'', '"', '`', '(', ')', '=', '<', '>', '…', ' ', '\t', '\n', '!',
        ];
        const TOKENS: &[&str] = &[
            "4f9c2e1a-7b3d-4c1e-9a2f-0e1d2c3b4a59",
            "c3d4e5f6-7b3d-4c1e-9a2f-0e1d2c3b4a5",
            "bob@example.com",
            "a.b@c",
            "deadbeef01",
            "AKIAIOSFODNN7EXAMPLE",
            "x86_64",
            "0x1f",
            "1.5",
            "10.0.0.7:443",
            "can't",
            "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
            "q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1q1",
            "<n>",
            "<id>",
            "<q>",
        ];
        let chars = prop::sample::select(ALPHABET).prop_map(String::from);
        let tokens = prop::sample::select(TOKENS).prop_map(String::from);
        prop::collection::vec(prop_oneof![3 => chars, 1 => tokens], 0..300)
            .prop_map(|parts| parts.concat())
    }

    proptest! {
        #[test]
        fn fingerprint_is_idempotent_and_capped_on_any_unicode(s in any::<String>()) {
            let fp = fingerprint(&s);
            prop_assert!(fp.chars().count() <= FINGERPRINT_CHARS_MAX);
            prop_assert_eq!(fingerprint(&fp), fp);
        }

        #[test]
        fn fingerprint_is_idempotent_and_capped_on_tricky_text(s in tricky_text()) {
            let fp = fingerprint(&s);
            prop_assert!(fp.chars().count() <= FINGERPRINT_CHARS_MAX);
            prop_assert_eq!(fingerprint(&fp), fp);
        }

        #[test]
        fn memory_is_bounded_and_counts_add_up(
            keys_max in 1usize..8,
            events in prop::collection::vec(
                (0u8..3, 0usize..9, prop::option::of(0u8..3), tricky_text(), -5i64..200),
                0..200,
            ),
        ) {
            let mut stats = FailureStats::new(StatsConfig {
                keys_max,
                buckets: 4,
                surge_buckets: 2,
                surge_count_min: 1,
                ..StatsConfig::default()
            }).unwrap();
            let kinds = [ErrorKind::new("timeout"), ErrorKind::new("parse"), ErrorKind::new("io")];
            let mut now = 0i64;
            for (recorded, (t, reason, kind, message, step)) in events.iter().enumerate() {
                // Mostly forward, sometimes backwards in time.
                now += step * 1_000;
                stats.record_dead_letter(
                    &ty(&format!("type{t}")),
                    DeadLetterReason::ALL[*reason],
                    kind.map(|k| &kinds[usize::from(k)]),
                    message,
                    at(now),
                );
                prop_assert!(stats.tracked() <= keys_max);
                prop_assert_eq!(stats.by_key.len(), stats.tracked());
                prop_assert_eq!(stats.by_rank.len(), stats.tracked());
                let counted: u64 = stats.top(usize::MAX).iter().map(|k| k.count).sum();
                prop_assert_eq!(counted + stats.other(), recorded as u64 + 1);
                if let Some(surge) = stats.surge(at(now)) {
                    prop_assert!(surge.count <= surge.total);
                    prop_assert!(surge.share <= 1.0);
                }
            }
            prop_assert_eq!(stats.total(), events.len() as u64);
        }
    }
}
