//! The server's configuration file: TOML in, checked core types out.
//!
//! [`ServerConfig::load`] reads a file, [`ServerConfig::from_toml_str`] a
//! string; both return the core's own types ([`Policies`], [`SchedulerConfig`],
//! [`AdmissionConfig`], [`BreakerConfig`]) already merged and validated, so
//! the rest of the server never sees a raw TOML value. Every key is optional;
//! an empty file gives [`ServerConfig::default`], which is what
//! `lazaret serve` runs with when no `--config` is given.
//!
//! Unknown keys are errors (a typo must not silently leave a default in
//! place), and every error names the file, the line and the key as a dotted
//! path (`types.send_email.attempts_max`), and says what to do.
//!
//! # Every key
//!
//! ```toml
//! payload_bytes_max = 262144          # admission byte cap on one payload (at least 1)
//! batch_bytes_max = 16777216          # cap on a whole batch body (413 POISON payload_too_large over it)
//! accept_unknown_types = true         # false: UNKNOWN_TYPE for types not listed under [types]
//! dead_letters_warn = 100000          # warn (log + metric + alert) once the dead letters outnumber this
//! surge_min = 20                      # a surge: at least this many dead letters in 5 minutes (1..=10000) …
//! surge_share = 0.8                   # … this share of them with one failure (0.5 < x <= 1); /v1/stats
//!                                     # dead_letters.surge and the default of every [[alerts]] entry
//! admission_records_per_minute = 60   # per tenant: admission (POISON) dead-letter records kept per minute
//! admission_records_all_per_minute = 600 # all tenants together: the same records kept per minute
//! durability = "full"                 # "full": a commit survives power loss; "normal": faster,
//!                                     # survives a process crash, may lose the last commits on power loss
//! lease_ms_default = 30000            # a lease's length when the worker asks for none (at least 1)
//! lease_ms_max = 3600000              # the longest lease a worker may ask for (>= lease_ms_default)
//!
//! [http]                            # connections (docs/reliability.md, "Connections")
//! header_read_timeout_ms = 10000      # from a request's first byte to the end of its headers
//! body_read_timeout_ms = 30000        # longest wait for the next piece of a request body
//! idle_timeout_ms = 75000             # a connection with no request running and no bytes moving is closed
//! connections_max = 0                 # open connections at most (0: from the file-descriptor limit);
//!                                     # one more is answered 503 UNAVAILABLE with Retry-After and closed
//! shutdown_grace_ms = 10000           # after SIGTERM, how long requests under way may take to finish
//! allowed_hosts = ["lazaret.example.com"] # without tokens: Host names answered besides the listen
//!                                     # address, localhost, 127.0.0.1 and [::1] (with the port): a
//!                                     # reverse proxy's name; "name" any port, "name:port" that one
//!
//! [tenants]                         # a tenant is whoever a job is for (a customer, a team);
//!                                     # tenants take turns, so one tenant's backlog never holds up another's
//! inflight_max = 2                    # per-tenant in-flight cap in each lane (at least 1); absent: no cap
//! ready_max = 100000                  # distinct tenants with jobs ready at most (at least 1); absent: no
//!                                     # bound; a job of one more is refused 429 TOO_MANY_TENANTS
//! [tenants.overrides]                 # per-tenant caps (also without a default cap); 0 pauses that tenant
//! big-customer = 8
//!
//! [lanes.interactive]                 # the lane "default" always exists, with weight 1
//! weight = 4                          # share of leases when several lanes have work (at least 1)
//! reserve = 0.2                       # share of the leases held kept for this lane while it has
//!                                     # work, lent to the others while it is idle (0 to 1; all
//!                                     # lanes' reserves add up to 1 at most; default 0)
//! on_breaker_open = "park"            # "shed" (default): 503 SHED while the job's type's breaker
//!                                     # is open; "park": accept, and run it once the breaker closes
//! [lanes.batch]
//! weight = 1
//!
//! [retention]
//! succeeded_ms = 86400000             # how long succeeded jobs are kept before the cleaner deletes them
//! cleaner_batch = 500                 # rows the cleaner deletes per transaction (at least 1)
//! cleaner_interval_ms = 1000          # pause between cleaner passes (at least 1)
//!
//! [defaults]                          # policy for types not listed, and the base for listed ones
//! attempts_max = 5                    # deliveries in all, the first included
//! backoff_base_ms = 1000              # first backoff ceiling; doubles per attempt, full jitter
//! backoff_cap_ms = 300000             # no backoff is longer
//! backoff_floor_ms = 0                # no backoff is shorter (<= backoff_cap_ms)
//! backoff_schedule_ms = []            # exact delays per attempt (last repeats), no jitter; [] = the curve
//! crash_loop_max = 3                  # lease expiries before dead-lettering as crash_loop
//! deferrals_max = 50                  # deferred outcomes before dead-lettering as deferrals_exhausted
//! kinds = { timeout = 4 }             # attempts a failure of that kind may spend
//! kind_classes = { http_404 = "permanent", http_429 = "deferred" } # class of a kind reported without one
//!
//! [defaults.breaker]                  # breaker of every type without its own [types.X.breaker]
//! failures_min = 20                   # same keys and meaning as [types.X.breaker] below
//!
//! [types.send_email]                  # a known type; each key absent here inherits [defaults]
//! attempts_max = 4                    # kinds and kind_classes merge with the defaults', this table wins
//! backoff_base_ms = 50
//! kinds = { parse = 2, validation = 1 }
//! schemas = { 1 = "schemas/send_email.v1.json", 2 = "schemas/send_email.v2.json" } # relative to this file
//!
//! [types.send_email.breaker]          # per (type, error kind); absent keys inherit [defaults.breaker]
//! failures_min = 20                   # failures in the window before it may open (at least 1)
//! failure_ratio = 0.5                 # and at least this share of outcomes failing, in (0, 1]
//! window_ms = 30000                   # how far back outcomes count (at least 1)
//! cooldown_ms = 10000                 # open → half-open (at least 1)
//! probes = 2                          # leases allowed while half-open (at least 1)
//!
//! [[tokens]]                          # no tokens: the server serves loopback only
//! name = "ops-alice"                  # the actor in the audit log; unique
//! role = "operator"                   # producer | worker | operator | admin
//! token = "a-long-random-secret"      # the bearer token; only its SHA-256 is kept in memory
//!
//! [[tokens]]
//! name = "ingest"
//! role = "producer"
//! token_sha256 = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824" # instead of token
//!
//! [[sources]]                         # a queue on a broker the team already runs (docs/brokers.md)
//! name = "orders"                     # unique; letters, digits, _ - . (at most 64); dead letters and metrics carry it
//! broker = "rabbitmq"                 # rabbitmq | nats | redis | kafka | sqs
//! url = "amqp://guest:guest@127.0.0.1:5672/%2f" # nats://…, redis://…, host:port for kafka, the endpoint URL for sqs; logs show it without its user info (***)
//! queue = "orders"                    # RabbitMQ queue · JetStream stream · Redis stream · Kafka topic · SQS queue URL
//! group = "lazaret"                   # JetStream durable consumer · Redis consumer group · Kafka group id
//! mode = "guard"                      # guard: deliver each message to `deliver`; watch: take in a dead-letter queue
//! deliver = "http://127.0.0.1:8080/orders" # guard (required there, refused for watch): each message is POSTed here
//! deliver_format = "raw"              # guard: raw (the body byte for byte, headers in Lazaret-Headers cut at 6 KiB) | envelope (one JSON object: body or body_base64, every header)
//! type = "orders"                     # the job type whose policy applies ([types.orders]); default: the name
//! tenant = "default"                  # every message's tenant; or tenant_header = "x-tenant" (not both)
//! lane = "default"                    # the lane its dead letters are filed under; pausing the lane holds the source
//! concurrency = 16                    # guard: deliveries in flight (at least 1)
//! settling = 240                      # guard: messages whose outcome is decided and whose write and ack are under way, beyond concurrency (default: 15 × concurrency, so RabbitMQ's prefetch is 16 × concurrency; 0 holds a delivery's slot until its ack)
//! delivery_timeout_ms = 30000         # guard: a slower delivery failed with kind "timeout" (at least 1)
//! receives_in_flight = 2              # guard, sqs: ReceiveMessage calls at once (at least 1; a FIFO queue uses 1; other brokers ignore it)
//! redrive_to = "orders"               # optional: where a redrive republishes (default: where the message came from)
//!
//! [[alerts]]                          # a webhook target; several may be listed (docs/alerts.md)
//! url = "http://127.0.0.1:9099/hook"  # POSTed one JSON body per alert (http:// only)
//! events = ["dead_letters_appeared", "poison_rate", "reason_surge",
//!           "breaker_opened", "breaker_closed", "dead_letters_over_warn"] # default: all six
//! cooldown_ms = 300000                # one alert per (event, type, reason) per cooldown (at least 1000)
//! poison_rate_per_min = 10            # poison_rate: dead letters of one type in the last minute (1..=10000)
//! surge_min = 20                      # reason_surge: dead letters in the surge window, 5 min (1..=10000)
//! surge_share = 0.8                   # reason_surge: share of them with one failure (0.5 < x <= 1)
//!
//! [[sources]]
//! name = "celery-dlq"
//! broker = "redis"
//! url = "redis://127.0.0.1:6379"
//! queue = "celery-dead"
//! mode = "watch"
//! tenant_header = "x-tenant"          # absent or empty on a message: tenant "default"
//! redrive_allow = ["orders.v2"]       # watch: more queues a redrive may go back to, besides redrive_to and the queues of this file's sources on the same broker (never the watched queue); the queue a message names comes from the message
//! ```
//!
//! Durations are integer milliseconds (`*_ms`); `"30s"` is refused with the
//! number to write instead. Two tokens may not share a name or a secret, two
//! sources not a name.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use lazaret_core::{
    AdmissionConfig, AlertEvent, AlertRule, Backoff, BreakerConfig, BreakerConfigError, ErrorKind,
    FailureClass, JobType, Lane, Policies, PolicyError, SchedulerConfig, SchedulerConfigError,
    Share, TenantId, TypePolicy, TypeSchemas,
};
use lazaret_guard::{BrokerKind, DeliverFormat, Mode, SourceSpec, TenantFrom};
use serde::Deserialize;
use serde::de::{self, Deserializer};
use sha2::{Digest, Sha256};
use toml::Spanned;
use toml::de::{DeTable, DeValue};

/// Default cap on a whole batch body (`batch_bytes_max`): 16 MiB.
pub const BATCH_BYTES_MAX_DEFAULT: usize = 16 * 1024 * 1024;

/// `[http]`: connection timeouts, the connection cap and the shutdown grace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpConfig {
    /// From a request's first byte to the end of its headers, in ms.
    pub header_read_timeout_ms: u64,
    /// Longest wait for the next piece of a request body, in ms.
    pub body_read_timeout_ms: u64,
    /// A connection with no request running and no bytes moving for this
    /// long is closed, in ms.
    pub idle_timeout_ms: u64,
    /// Open connections at most; `None`: derived from the file-descriptor
    /// limit at start.
    pub connections_max: Option<usize>,
    /// After SIGTERM, how long requests under way may take, in ms.
    pub shutdown_grace_ms: u64,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            idle_timeout_ms: 75_000,
            connections_max: None,
            shutdown_grace_ms: 10_000,
        }
    }
}

/// Everything `lazaret serve` is configured with, checked and merged.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Admission byte cap on one payload (`payload_bytes_max`).
    pub payload_bytes_max: usize,
    /// Cap on a whole batch body (`batch_bytes_max`).
    pub batch_bytes_max: usize,
    /// Whether types not listed under `[types]` are admitted.
    pub accept_unknown_types: bool,
    /// Lane weights and tenants' in-flight caps (`[tenants]`, `[lanes.X]`).
    pub scheduler: SchedulerConfig,
    /// `[defaults]`, and every `[types.X]` merged over it.
    pub policies: Policies,
    /// The byte cap, `accept_unknown_types`, and every listed type with its compiled schemas.
    pub admission: AdmissionConfig,
    /// `[defaults.breaker]`, if present: the breaker of types without their own.
    pub breaker_default: Option<BreakerConfig>,
    /// `[types.X.breaker]`, merged over `[defaults.breaker]`.
    pub breakers: BTreeMap<JobType, BreakerConfig>,
    /// `[[tokens]]`, in file order. Empty: the server serves loopback only.
    pub tokens: Vec<TokenConfig>,
    /// `[retention]`: when succeeded jobs are deleted.
    pub retention: RetentionConfig,
    /// Warn once the dead letters outnumber this (`dead_letters_warn`).
    pub dead_letters_warn: u64,
    /// The surge rule's thresholds (`surge_min`, `surge_share`): for
    /// `/v1/stats` and as every `[[alerts]]` entry's default.
    pub surge_min: u64,
    /// See [`ServerConfig::surge_min`].
    pub surge_share: f64,
    /// Admission (POISON) dead-letter records kept per tenant per minute.
    pub admission_records_per_minute: u32,
    /// Admission dead-letter records kept per minute over all tenants
    /// together, so many tenants cannot multiply the per-tenant cap.
    pub admission_records_all_per_minute: u32,
    /// What a commit survives (`durability`).
    pub durability: Durability,
    /// A lease's length when the worker asks for none, in ms.
    pub lease_ms_default: u64,
    /// The longest lease a worker may ask for, in ms.
    pub lease_ms_max: u64,
    /// `[[sources]]`, in file order: the broker queues `lazaret serve`
    /// guards or watches next to its own queue.
    pub sources: Vec<SourceSpec>,
    /// `[http]`: connections and shutdown.
    pub http: HttpConfig,
    /// `[http] allowed_hosts`: on a server without tokens, the `Host`
    /// names answered besides the server's own (lower case; `name` with any
    /// port, `name:port` with that one). Kept apart from [`HttpConfig`],
    /// which is `Copy`.
    pub allowed_hosts: Vec<String>,
    /// Lanes with `on_breaker_open = "park"`: they admit jobs of a type
    /// whose breaker is open (the jobs wait until it closes) instead of
    /// answering `503 SHED`.
    pub park_lanes: BTreeSet<Lane>,
    /// `[[alerts]]`, in file order: webhook targets and their rules.
    pub alerts: Vec<AlertTarget>,
}

/// One `[[alerts]]` entry: where alerts go and which.
#[derive(Clone, Debug, PartialEq)]
pub struct AlertTarget {
    /// The webhook, `http://host:port/path`.
    pub url: String,
    /// Events, cooldown and thresholds.
    pub rule: AlertRule,
}

/// The in-flight cap when `[tenants] inflight_max` is absent: none. Tenants
/// still take turns (round robin needs no cap); a cap is for a tenant whose
/// jobs must not hold every worker at once.
pub const INFLIGHT_UNCAPPED: u32 = u32::MAX;

impl Default for ServerConfig {
    fn default() -> Self {
        let payload_bytes_max = lazaret_core::admission::PAYLOAD_BYTES_MAX_DEFAULT;
        ServerConfig {
            payload_bytes_max,
            batch_bytes_max: BATCH_BYTES_MAX_DEFAULT,
            accept_unknown_types: true,
            scheduler: SchedulerConfig::new(INFLIGHT_UNCAPPED)
                .with_lane_weight(Lane::default_lane(), 1),
            policies: Policies::default(),
            admission: AdmissionConfig {
                payload_bytes_max,
                accept_unknown_types: true,
                types: BTreeMap::new(),
            },
            breaker_default: None,
            breakers: BTreeMap::new(),
            tokens: Vec::new(),
            retention: RetentionConfig::default(),
            dead_letters_warn: 100_000,
            surge_min: 20,
            surge_share: 0.8,
            admission_records_per_minute: 60,
            admission_records_all_per_minute: 600,
            durability: Durability::Full,
            lease_ms_default: 30_000,
            lease_ms_max: 3_600_000,
            sources: Vec::new(),
            http: HttpConfig::default(),
            allowed_hosts: Vec::new(),
            park_lanes: BTreeSet::new(),
            alerts: Vec::new(),
        }
    }
}

/// What a token may do. Each role's rights are listed in the API contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Enqueue, read its own jobs.
    Producer,
    /// Lease, ack, fail, heartbeat.
    Worker,
    /// Read dead letters and payloads, redrive, pause and resume.
    Operator,
    /// Everything, purge and tokens included.
    Admin,
}

impl Role {
    /// Every role, least powerful first.
    pub const ALL: [Role; 4] = [Role::Producer, Role::Worker, Role::Operator, Role::Admin];

    /// The word used in the config file and the API.
    pub const fn as_str(self) -> &'static str {
        match self {
            Role::Producer => "producer",
            Role::Worker => "worker",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A word that is not a [`Role`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown role `{0}`: use one of producer, worker, operator, admin")]
pub struct UnknownRole(pub String);

impl FromStr for Role {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownRole(s.to_owned()))
    }
}

/// One `[[tokens]]` entry. Only the token's SHA-256 is kept, never the token.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenConfig {
    /// The actor named in the audit log.
    pub name: String,
    /// What the token may do.
    pub role: Role,
    /// SHA-256 of the bearer token; compare with [`token_sha256`] of the one presented.
    pub sha256: [u8; 32],
}

impl fmt::Debug for TokenConfig {
    // A hash of a short token can be brute-forced: logs get a fingerprint only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TokenConfig")
            .field("name", &self.name)
            .field("role", &self.role)
            .field(
                "sha256",
                &format_args!("{}…", hex::encode(&self.sha256[..4])),
            )
            .finish()
    }
}

/// The SHA-256 of a bearer token, as kept in [`TokenConfig::sha256`].
pub fn token_sha256(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// What a committed transaction survives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// Power loss: every commit is synced to disk.
    #[default]
    Full,
    /// A process crash only; the last commits may be lost on power loss.
    Normal,
}

impl Durability {
    /// The word used in the config file.
    pub const fn as_str(self) -> &'static str {
        match self {
            Durability::Full => "full",
            Durability::Normal => "normal",
        }
    }
}

/// `[retention]`: how long finished work is kept and how the cleaner paces itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetentionConfig {
    /// How long a succeeded job is kept, in ms.
    pub succeeded_ms: u64,
    /// Rows deleted per cleaner transaction.
    pub cleaner_batch: u32,
    /// Pause between cleaner passes, in ms.
    pub cleaner_interval_ms: u64,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            succeeded_ms: 86_400_000,
            cleaner_batch: 500,
            cleaner_interval_ms: 1000,
        }
    }
}

/// A config that cannot be used, and where and why.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The config file itself could not be read.
    #[error("cannot read config file {}: {source}; check the path given to --config", path.display())]
    Read {
        /// The file, as given.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A key or value is wrong (or the TOML is), located as precisely as possible.
    #[error("{}", render_invalid(.file.as_deref(), *.line, .key.as_deref(), .message))]
    Invalid {
        /// The config file, when loaded from one.
        file: Option<PathBuf>,
        /// 1-based line of the key (or of the nearest enclosing table that is written out).
        line: Option<usize>,
        /// The key as a dotted path, `types.send_email.attempts_max`, `tokens[0].role`.
        key: Option<String>,
        /// What is wrong and what to do about it.
        message: String,
    },
}

impl ConfigError {
    /// The dotted key the error is about, if any.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { key, .. } => key.as_deref(),
            ConfigError::Read { .. } => None,
        }
    }

    /// The 1-based line the error is about, if any.
    pub fn line(&self) -> Option<usize> {
        match self {
            ConfigError::Invalid { line, .. } => *line,
            ConfigError::Read { .. } => None,
        }
    }
}

fn render_invalid(
    file: Option<&Path>,
    line: Option<usize>,
    key: Option<&str>,
    message: &str,
) -> String {
    // `file:line: key: message`, the shape editors and terminals link to.
    let mut out = String::new();
    match (file, line) {
        (Some(f), Some(l)) => out.push_str(&format!("{}:{l}: ", f.display())),
        (Some(f), None) => out.push_str(&format!("{}: ", f.display())),
        (None, Some(l)) => out.push_str(&format!("config line {l}: ")),
        (None, None) => out.push_str("config: "),
    }
    if let Some(k) = key {
        out.push_str(k);
        out.push_str(": ");
    }
    out.push_str(message);
    out
}

impl ServerConfig {
    /// Reads and checks the config file at `path`; schema paths are relative
    /// to its directory.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Read`] if the file cannot be read, else as
    /// [`from_toml_str`](Self::from_toml_str), with the file named.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let base_dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        Ctx::parse(&text, Some(path))?.build(base_dir)
    }

    /// Parses and checks config text; schema paths are relative to `base_dir`.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Invalid`] for TOML syntax, an unknown key, a value of
    /// the wrong type or out of range, a schema file that cannot be read or
    /// compiled, or a bad token entry; it names the line and the key.
    pub fn from_toml_str(text: &str, base_dir: &Path) -> Result<Self, ConfigError> {
        Ctx::parse(text, None)?.build(base_dir)
    }
}

// ---------------------------------------------------------------------------
// The file as written: every key optional, unknown keys refused.

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "the config's top-level table")]
struct RawConfig {
    payload_bytes_max: Option<usize>,
    batch_bytes_max: Option<usize>,
    accept_unknown_types: Option<bool>,
    dead_letters_warn: Option<u64>,
    surge_min: Option<u64>,
    surge_share: Option<f64>,
    admission_records_per_minute: Option<u32>,
    admission_records_all_per_minute: Option<u32>,
    durability: Option<String>,
    lease_ms_default: Option<Ms>,
    lease_ms_max: Option<Ms>,
    tenants: Option<RawTenants>,
    #[serde(default)]
    lanes: BTreeMap<String, RawLane>,
    retention: Option<RawRetention>,
    http: Option<RawHttp>,
    defaults: Option<RawPolicy>,
    #[serde(default)]
    types: BTreeMap<String, RawPolicy>,
    #[serde(default)]
    tokens: Vec<RawToken>,
    #[serde(default)]
    sources: Vec<RawSource>,
    #[serde(default)]
    alerts: Vec<RawAlert>,
}

/// `[[alerts]]`: the contract's keys.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an alert table with url, events, cooldown_ms, poison_rate_per_min, surge_min, surge_share"
)]
struct RawAlert {
    url: Option<String>,
    events: Option<Vec<String>>,
    cooldown_ms: Option<Ms>,
    poison_rate_per_min: Option<u64>,
    surge_min: Option<u64>,
    surge_share: Option<f64>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table with inflight_max, ready_max and overrides"
)]
struct RawTenants {
    inflight_max: Option<u32>,
    ready_max: Option<u32>,
    #[serde(default)]
    overrides: BTreeMap<String, u32>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table such as { weight = 4, reserve = 0.2, on_breaker_open = \"park\" }"
)]
struct RawLane {
    weight: Option<u32>,
    reserve: Option<f64>,
    on_breaker_open: Option<String>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table with succeeded_ms, cleaner_batch, cleaner_interval_ms"
)]
struct RawRetention {
    succeeded_ms: Option<Ms>,
    cleaner_batch: Option<u32>,
    cleaner_interval_ms: Option<Ms>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table with header_read_timeout_ms, body_read_timeout_ms, idle_timeout_ms, connections_max, shutdown_grace_ms, allowed_hosts"
)]
struct RawHttp {
    header_read_timeout_ms: Option<Ms>,
    body_read_timeout_ms: Option<Ms>,
    idle_timeout_ms: Option<Ms>,
    connections_max: Option<usize>,
    shutdown_grace_ms: Option<Ms>,
    allowed_hosts: Option<Vec<String>>,
}

/// An `[http] allowed_hosts` entry, checked and in lower case: a host name
/// or address as a browser sends it in `Host`, with or without a port.
fn allowed_host(entry: &str) -> Result<String, String> {
    let e = entry.trim();
    let example = "write it as it appears in the Host header, e.g. \"lazaret.example.com\" or \"lazaret.example.com:8443\"";
    if e.is_empty() {
        return Err(format!("an allowed_hosts entry is empty; {example}"));
    }
    if e.contains('*') {
        return Err(format!(
            "allowed_hosts entry {e:?} holds a wildcard, which would answer every name a rebinding \
             page could use; list each name ({example})"
        ));
    }
    if e.contains("://") || e.contains('/') {
        return Err(format!(
            "allowed_hosts entry {e:?} must be a host name without a scheme or path; {example}"
        ));
    }
    let (name, port) = match e.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((v6, tail))
                if v6
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() || b":.".contains(&b)) =>
            {
                (
                    v6,
                    tail.strip_prefix(':')
                        .or(if tail.is_empty() { None } else { Some(tail) }),
                )
            }
            _ => {
                return Err(format!(
                    "allowed_hosts entry {e:?} is not a [IPv6] address; {example}"
                ));
            }
        },
        None => match e.rsplit_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (e, None),
        },
    };
    let name_ok = e.starts_with('[')
        || (!name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b)));
    let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok());
    if !name_ok || !port_ok {
        return Err(format!(
            "allowed_hosts entry {e:?} is not a host name or host:port; {example}"
        ));
    }
    Ok(e.to_ascii_lowercase())
}

/// `[defaults]` or `[types.X]`: the same keys, but only a type has schemas.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a policy table such as { attempts_max = 4 }"
)]
struct RawPolicy {
    attempts_max: Option<u32>,
    backoff_base_ms: Option<Ms>,
    backoff_cap_ms: Option<Ms>,
    backoff_floor_ms: Option<Ms>,
    backoff_schedule_ms: Option<Vec<Ms>>,
    crash_loop_max: Option<u32>,
    deferrals_max: Option<u32>,
    #[serde(default)]
    kinds: BTreeMap<String, u32>,
    #[serde(default)]
    kind_classes: BTreeMap<String, FailureClass>,
    schemas: Option<BTreeMap<String, String>>,
    breaker: Option<RawBreaker>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a breaker table such as { failures_min = 20, window_ms = 30000 }"
)]
struct RawBreaker {
    failures_min: Option<u32>,
    failure_ratio: Option<f64>,
    window_ms: Option<Ms>,
    cooldown_ms: Option<Ms>,
    probes: Option<u32>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a token table with name, role and token or token_sha256"
)]
struct RawToken {
    name: Option<String>,
    role: Option<String>,
    token: Option<String>,
    token_sha256: Option<String>,
}

/// `[[sources]]`: exactly the contract's keys, plus `lane`.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a source table with name, broker, url, queue and (for a guard) deliver"
)]
struct RawSource {
    name: Option<String>,
    broker: Option<String>,
    url: Option<String>,
    queue: Option<String>,
    group: Option<String>,
    mode: Option<String>,
    deliver: Option<String>,
    deliver_format: Option<String>,
    #[serde(rename = "type")]
    job_type: Option<String>,
    tenant: Option<String>,
    tenant_header: Option<String>,
    lane: Option<String>,
    concurrency: Option<u32>,
    settling: Option<u32>,
    delivery_timeout_ms: Option<Ms>,
    redrive_to: Option<String>,
    redrive_allow: Option<Vec<String>>,
    receives_in_flight: Option<u32>,
}

/// Integer milliseconds; a string like `"30s"` is refused with the number to write.
#[derive(Clone, Copy)]
struct Ms(u64);

impl Ms {
    fn duration(self) -> Duration {
        Duration::from_millis(self.0)
    }
}

impl<'de> Deserialize<'de> for Ms {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Ms;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("integer milliseconds")
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Ms, E> {
                Ok(Ms(v))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Ms, E> {
                u64::try_from(v).map(Ms).map_err(|_| {
                    E::custom(format!(
                        "{v} is negative; a duration in milliseconds is 0 or more"
                    ))
                })
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Ms, E> {
                Err(E::custom(match humantime::parse_duration(v) {
                    Ok(d) => format!(
                        "durations are integer milliseconds: write {} instead of \"{v}\"",
                        d.as_millis()
                    ),
                    Err(_) => format!(
                        "durations are integer milliseconds (30000 for 30 s), not the string \"{v}\""
                    ),
                }))
            }
        }
        d.deserialize_any(V)
    }
}

// ---------------------------------------------------------------------------
// Key paths and their lines.

#[derive(Clone, Debug, PartialEq, Eq)]
enum Seg {
    Key(String),
    Index(usize),
}

/// A dotted key path, as TOML would write it: `types.send_email.kinds.parse`, `tokens[1].role`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct KeyPath(Vec<Seg>);

impl KeyPath {
    fn key(&self, k: &str) -> KeyPath {
        let mut p = self.clone();
        p.0.push(Seg::Key(k.to_owned()));
        p
    }

    fn index(&self, i: usize) -> KeyPath {
        let mut p = self.clone();
        p.0.push(Seg::Index(i));
        p
    }
}

fn root(k: &str) -> KeyPath {
    KeyPath::default().key(k)
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Seg::Key(k) => {
                    if i > 0 {
                        f.write_str(".")?;
                    }
                    let bare = !k.is_empty()
                        && k.chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
                    if bare {
                        f.write_str(k)?;
                    } else {
                        write!(f, "{k:?}")?;
                    }
                }
                Seg::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// The text, its spanned tree and where it came from: what every error needs.
struct Ctx<'a> {
    text: &'a str,
    tree: Spanned<DeTable<'a>>,
    file: Option<&'a Path>,
}

enum Node<'t, 'a> {
    Table(&'t DeTable<'a>),
    Array(&'t [Spanned<DeValue<'a>>]),
    Leaf,
}

fn node<'t, 'a>(v: &'t DeValue<'a>) -> Node<'t, 'a> {
    match v {
        DeValue::Table(t) => Node::Table(t),
        DeValue::Array(a) => Node::Array(a),
        _ => Node::Leaf,
    }
}

impl<'a> Ctx<'a> {
    fn parse(text: &'a str, file: Option<&'a Path>) -> Result<Self, ConfigError> {
        let tree = DeTable::parse(text).map_err(|e| {
            let line = e.span().map(|s| line_at(text, s.start));
            ConfigError::Invalid {
                file: file.map(Path::to_owned),
                line,
                key: None,
                message: format!(
                    "this is not valid TOML: {}; fix the syntax on this line",
                    e.message()
                ),
            }
        })?;
        Ok(Ctx { text, tree, file })
    }

    fn error(&self, line: Option<usize>, key: Option<String>, message: String) -> ConfigError {
        ConfigError::Invalid {
            file: self.file.map(Path::to_owned),
            line,
            key,
            message,
        }
    }

    /// An error about `path`, on the line of its key, or of the nearest
    /// enclosing key written in the file when `path` itself is inherited.
    fn invalid(&self, path: &KeyPath, message: impl Into<String>) -> ConfigError {
        self.error(self.line_of(path), Some(path.to_string()), message.into())
    }

    fn line_of(&self, path: &KeyPath) -> Option<usize> {
        let mut at = Node::Table(self.tree.get_ref());
        let mut best: Option<Range<usize>> = None;
        for seg in &path.0 {
            let next = match (seg, at) {
                (Seg::Key(k), Node::Table(t)) => t
                    .get_key_value(k.as_str())
                    .map(|(key, v)| (key.span(), v.get_ref())),
                (Seg::Index(i), Node::Array(a)) => a.get(*i).map(|v| (v.span(), v.get_ref())),
                _ => None,
            };
            let Some((span, v)) = next else { break };
            best = Some(span);
            at = node(v);
        }
        best.map(|s| line_at(self.text, s.start))
    }

    /// The key path whose key or value most tightly encloses byte `offset`.
    fn path_at(&self, offset: usize) -> Option<KeyPath> {
        fn consider(
            span: Range<usize>,
            p: &KeyPath,
            offset: usize,
            best: &mut Option<(usize, KeyPath)>,
        ) {
            let inside = span.contains(&offset) || (span.is_empty() && span.start == offset);
            // `<=`: on a tie the later, deeper candidate wins.
            if inside && best.as_ref().is_none_or(|(l, _)| span.len() <= *l) {
                *best = Some((span.len(), p.clone()));
            }
        }
        fn walk(
            at: Node<'_, '_>,
            path: &KeyPath,
            offset: usize,
            best: &mut Option<(usize, KeyPath)>,
        ) {
            match at {
                Node::Table(t) => {
                    for (k, v) in t.iter() {
                        let p = path.key(k.get_ref());
                        consider(k.span(), &p, offset, best);
                        consider(v.span(), &p, offset, best);
                        walk(node(v.get_ref()), &p, offset, best);
                    }
                }
                Node::Array(a) => {
                    for (i, v) in a.iter().enumerate() {
                        let p = path.index(i);
                        consider(v.span(), &p, offset, best);
                        walk(node(v.get_ref()), &p, offset, best);
                    }
                }
                Node::Leaf => {}
            }
        }
        let mut best = None;
        walk(
            Node::Table(self.tree.get_ref()),
            &KeyPath::default(),
            offset,
            &mut best,
        );
        best.map(|(_, p)| p)
    }

    fn toml_error(&self, e: &toml::de::Error) -> ConfigError {
        let Some(span) = e.span() else {
            return self.error(None, None, e.message().to_owned());
        };
        let msg = e.message();
        let hint = if msg.starts_with("unknown field") {
            "remove the key or fix its spelling"
        } else if msg.starts_with("invalid type") || msg.starts_with("invalid value") {
            "change the value to what is expected"
        } else if msg.starts_with("unknown variant") {
            "use one of the values listed"
        } else {
            ""
        };
        let message = if hint.is_empty() {
            msg.to_owned()
        } else {
            format!("{msg}; {hint}")
        };
        let key = self.path_at(span.start).map(|p| p.to_string());
        self.error(Some(line_at(self.text, span.start)), key, message)
    }

    // -----------------------------------------------------------------------
    // From the raw file to the core's types.

    fn build(self, base_dir: &Path) -> Result<ServerConfig, ConfigError> {
        let raw = RawConfig::deserialize(toml::de::Deserializer::from(self.tree.clone()))
            .map_err(|e| self.toml_error(&e))?;
        let mut cfg = ServerConfig::default();

        let at_least_1 = |key: &str, v: u64| {
            if v == 0 {
                Err(self.invalid(&root(key), format!("{key} must be at least 1 (got 0)")))
            } else {
                Ok(())
            }
        };

        if let Some(v) = raw.payload_bytes_max {
            at_least_1("payload_bytes_max", v as u64)?;
            cfg.payload_bytes_max = v;
        }
        if let Some(v) = raw.batch_bytes_max {
            at_least_1("batch_bytes_max", v as u64)?;
            cfg.batch_bytes_max = v;
        }
        if let Some(v) = raw.accept_unknown_types {
            cfg.accept_unknown_types = v;
        }
        if let Some(v) = raw.dead_letters_warn {
            cfg.dead_letters_warn = v;
        }
        {
            // Checked with the alerts' own rule, so the ranges are the same.
            let probe = AlertRule {
                surge_min: raw.surge_min.unwrap_or(cfg.surge_min),
                surge_share: raw.surge_share.unwrap_or(cfg.surge_share),
                ..AlertRule::default()
            };
            match probe.validate() {
                Err(e @ lazaret_core::AlertRuleError::SurgeMin(_)) => {
                    return Err(self.invalid(&root("surge_min"), e.to_string()));
                }
                Err(e @ lazaret_core::AlertRuleError::SurgeShare(_)) => {
                    return Err(self.invalid(&root("surge_share"), e.to_string()));
                }
                _ => {}
            }
            cfg.surge_min = probe.surge_min;
            cfg.surge_share = probe.surge_share;
        }
        if let Some(v) = raw.admission_records_per_minute {
            cfg.admission_records_per_minute = v;
        }
        if let Some(v) = raw.admission_records_all_per_minute {
            cfg.admission_records_all_per_minute = v;
        }
        if let Some(d) = &raw.durability {
            cfg.durability = match d.as_str() {
                "full" => Durability::Full,
                "normal" => Durability::Normal,
                other => {
                    return Err(self.invalid(
                        &root("durability"),
                        format!(
                            "unknown durability \"{other}\": use \"full\" (survives power loss) or \"normal\" (faster; survives a process crash)"
                        ),
                    ));
                }
            };
        }
        if let Some(Ms(v)) = raw.lease_ms_default {
            at_least_1("lease_ms_default", v)?;
            cfg.lease_ms_default = v;
        }
        if let Some(Ms(v)) = raw.lease_ms_max {
            at_least_1("lease_ms_max", v)?;
            cfg.lease_ms_max = v;
        }
        if cfg.lease_ms_default > cfg.lease_ms_max {
            let key = if raw.lease_ms_default.is_some() {
                "lease_ms_default"
            } else {
                "lease_ms_max"
            };
            return Err(self.invalid(
                &root(key),
                format!(
                    "lease_ms_default ({}) is above lease_ms_max ({}); lower the default or raise the maximum",
                    cfg.lease_ms_default, cfg.lease_ms_max
                ),
            ));
        }
        if let Some(r) = &raw.retention {
            let path = root("retention");
            if let Some(Ms(v)) = r.succeeded_ms {
                cfg.retention.succeeded_ms = v;
            }
            if let Some(v) = r.cleaner_batch {
                if v == 0 {
                    return Err(self.invalid(
                        &path.key("cleaner_batch"),
                        "cleaner_batch must be at least 1 (got 0), or the cleaner never deletes anything",
                    ));
                }
                cfg.retention.cleaner_batch = v;
            }
            if let Some(Ms(v)) = r.cleaner_interval_ms {
                if v == 0 {
                    return Err(self.invalid(
                        &path.key("cleaner_interval_ms"),
                        "cleaner_interval_ms must be at least 1 (got 0), or the cleaner spins",
                    ));
                }
                cfg.retention.cleaner_interval_ms = v;
            }
        }

        if let Some(h) = &raw.http {
            let path = root("http");
            let positive = |key: &str, v: u64| {
                if v == 0 {
                    Err(self.invalid(
                        &path.key(key),
                        format!("{key} must be at least 1 (got 0); leave it out for the default"),
                    ))
                } else {
                    Ok(v)
                }
            };
            if let Some(Ms(v)) = h.header_read_timeout_ms {
                cfg.http.header_read_timeout_ms = positive("header_read_timeout_ms", v)?;
            }
            if let Some(Ms(v)) = h.body_read_timeout_ms {
                cfg.http.body_read_timeout_ms = positive("body_read_timeout_ms", v)?;
            }
            if let Some(Ms(v)) = h.idle_timeout_ms {
                cfg.http.idle_timeout_ms = positive("idle_timeout_ms", v)?;
            }
            if let Some(Ms(v)) = h.shutdown_grace_ms {
                cfg.http.shutdown_grace_ms = v;
            }
            if let Some(v) = h.connections_max {
                cfg.http.connections_max = (v > 0).then_some(v);
            }
            for entry in h.allowed_hosts.iter().flatten() {
                cfg.allowed_hosts.push(
                    allowed_host(entry)
                        .map_err(|why| self.invalid(&path.key("allowed_hosts"), why))?,
                );
            }
        }

        cfg.scheduler = self.scheduler(&raw)?;
        cfg.park_lanes = self.park_lanes(&raw)?;
        self.policies_and_breakers(&raw, &mut cfg)?;
        cfg.admission = AdmissionConfig {
            payload_bytes_max: cfg.payload_bytes_max,
            accept_unknown_types: cfg.accept_unknown_types,
            types: self.schemas(&raw, base_dir)?,
        };
        cfg.tokens = self.tokens(&raw)?;
        cfg.sources = self.sources(&raw)?;
        cfg.alerts = self.alerts(&raw, &cfg)?;
        Ok(cfg)
    }

    /// A name the config gives (a type, tenant or lane): not blank, and
    /// the API's name rule (at most 128 bytes, no control characters), so
    /// nothing the config names could not also be named over the API.
    fn not_blank(&self, path: &KeyPath, name: &str, what: &str) -> Result<(), ConfigError> {
        if name.trim().is_empty() {
            return Err(self.invalid(
                path,
                format!("a {what} name cannot be blank; give it a name"),
            ));
        }
        if let Err(e) = lazaret_core::bound::check_config_name(&format!("the {what} name"), name) {
            return Err(self.invalid(
                path,
                format!("{e}; {what} names follow the API's rule, so rename it"),
            ));
        }
        Ok(())
    }

    fn scheduler(&self, raw: &RawConfig) -> Result<SchedulerConfig, ConfigError> {
        let mut s = ServerConfig::default().scheduler;
        if let Some(t) = &raw.tenants {
            if let Some(n) = t.inflight_max {
                s.inflight_max = n;
            }
            if let Some(n) = t.ready_max {
                if n == 0 {
                    return Err(self.invalid(
                        &root("tenants").key("ready_max"),
                        "ready_max is 0, so no job could ever be queued; set it to at least 1 (it bounds how many distinct tenants may have jobs ready at once), or leave it out for no bound",
                    ));
                }
                s.tenants_ready_max = Some(n);
            }
            for (name, n) in &t.overrides {
                self.not_blank(&root("tenants").key("overrides").key(name), name, "tenant")?;
                s.tenant_inflight_max
                    .insert(TenantId::new(name.as_str()), *n);
            }
        }
        for (name, lane) in &raw.lanes {
            self.not_blank(&root("lanes").key(name), name, "lane")?;
            s.lane_weights
                .insert(Lane::new(name.as_str()), lane.weight.unwrap_or(1));
            if let Some(r) = lane.reserve {
                let share = Share::from_fraction(r).ok_or_else(|| {
                    self.invalid(
                        &root("lanes").key(name).key("reserve"),
                        format!(
                            "reserve must be a share between 0 and 1, such as 0.2 for a fifth of the leases held (got {r})"
                        ),
                    )
                })?;
                s.lane_reserves.insert(Lane::new(name.as_str()), share);
            }
        }
        s.validate().map_err(|e| match e {
            SchedulerConfigError::ZeroLaneWeight { lane } => self.invalid(
                &root("lanes").key(lane.as_str()).key("weight"),
                format!(
                    "lane `{lane}` has weight 0; a weight is the lane's share of leases while lanes compete, so it must be at least 1 (to shrink this lane's share, raise the other lanes' weights)"
                ),
            ),
            SchedulerConfigError::ZeroInflightMax => self.invalid(
                &root("tenants").key("inflight_max"),
                "inflight_max is 0, so no tenant could ever lease a job; set it to at least 1 (to pause one tenant, set it to 0 under [tenants.overrides])",
            ),
            SchedulerConfigError::ReservesOverOne { .. } => {
                let last = s.lane_reserves.keys().next_back().map(Lane::as_str);
                self.invalid(
                    &root("lanes").key(last.unwrap_or_default()).key("reserve"),
                    e.to_string(),
                )
            }
            other => self.error(None, None, other.to_string()),
        })?;
        Ok(s)
    }

    /// The lanes with `on_breaker_open = "park"`.
    fn park_lanes(&self, raw: &RawConfig) -> Result<BTreeSet<Lane>, ConfigError> {
        let mut park = BTreeSet::new();
        for (name, lane) in &raw.lanes {
            match lane.on_breaker_open.as_deref() {
                None | Some("shed") => {}
                Some("park") => {
                    park.insert(Lane::new(name.as_str()));
                }
                Some(other) => {
                    return Err(self.invalid(
                        &root("lanes").key(name).key("on_breaker_open"),
                        format!(
                            "on_breaker_open is \"shed\" (answer 503 SHED while the type's breaker is open, the default) or \"park\" (accept the job and run it once the breaker closes); got {other:?}"
                        ),
                    ));
                }
            }
        }
        Ok(park)
    }

    fn policies_and_breakers(
        &self,
        raw: &RawConfig,
        cfg: &mut ServerConfig,
    ) -> Result<(), ConfigError> {
        let defaults_path = root("defaults");
        let mut defaults = TypePolicy::default();
        let mut breaker_default = None;
        if let Some(d) = &raw.defaults {
            if d.schemas.is_some() {
                return Err(self.invalid(
                    &defaults_path.key("schemas"),
                    "schemas belong to one type: move them under [types.NAME]",
                ));
            }
            defaults = self.policy(&defaults, d, &defaults_path)?;
            if let Some(b) = &d.breaker {
                breaker_default =
                    Some(self.breaker(BreakerConfig::default(), b, &defaults_path)?);
            }
        }
        let mut types = std::collections::HashMap::new();
        let mut breakers = BTreeMap::new();
        for (name, t) in &raw.types {
            let path = root("types").key(name);
            self.not_blank(&path, name, "job type")?;
            types.insert(
                JobType::new(name.as_str()),
                self.policy(&defaults, t, &path)?,
            );
            if let Some(b) = &t.breaker {
                let base = breaker_default.unwrap_or_default();
                breakers.insert(JobType::new(name.as_str()), self.breaker(base, b, &path)?);
            }
        }
        cfg.policies = Policies { defaults, types };
        cfg.breaker_default = breaker_default;
        cfg.breakers = breakers;
        Ok(())
    }

    /// `raw` merged over `base`, then validated; errors are located under `path`.
    fn policy(
        &self,
        base: &TypePolicy,
        raw: &RawPolicy,
        path: &KeyPath,
    ) -> Result<TypePolicy, ConfigError> {
        let mut p = base.clone();
        let ms = |v: Option<Ms>, d: Duration| v.map_or(d, Ms::duration);
        p.attempts_max = raw.attempts_max.unwrap_or(p.attempts_max);
        p.crash_loop_max = raw.crash_loop_max.unwrap_or(p.crash_loop_max);
        p.deferrals_max = raw.deferrals_max.unwrap_or(p.deferrals_max);
        p.backoff = Backoff {
            base: ms(raw.backoff_base_ms, p.backoff.base),
            cap: ms(raw.backoff_cap_ms, p.backoff.cap),
            floor: ms(raw.backoff_floor_ms, p.backoff.floor),
            schedule: match &raw.backoff_schedule_ms {
                Some(s) => s.iter().map(|m| m.duration()).collect(),
                None => p.backoff.schedule,
            },
        };
        for (kind, n) in &raw.kinds {
            self.not_blank(&path.key("kinds").key(kind), kind, "failure kind")?;
            p.kinds.insert(ErrorKind::new(kind.as_str()), *n);
        }
        for (kind, class) in &raw.kind_classes {
            self.not_blank(&path.key("kind_classes").key(kind), kind, "failure kind")?;
            p.kind_classes.insert(ErrorKind::new(kind.as_str()), *class);
        }
        p.validate().map_err(|e| {
            let key = match &e {
                PolicyError::ZeroCount { field } => {
                    field.split('.').fold(path.clone(), |p, k| p.key(k))
                }
                PolicyError::FloorAboveCap { .. } if raw.backoff_floor_ms.is_some() => {
                    path.key("backoff_floor_ms")
                }
                PolicyError::FloorAboveCap { .. } => path.key("backoff_cap_ms"),
                _ => path.clone(),
            };
            self.invalid(&key, e.to_string())
        })?;
        Ok(p)
    }

    fn breaker(
        &self,
        base: BreakerConfig,
        raw: &RawBreaker,
        path: &KeyPath,
    ) -> Result<BreakerConfig, ConfigError> {
        let b = BreakerConfig {
            failures_min: raw.failures_min.unwrap_or(base.failures_min),
            failure_ratio: raw.failure_ratio.unwrap_or(base.failure_ratio),
            window: raw.window_ms.map_or(base.window, Ms::duration),
            cooldown: raw.cooldown_ms.map_or(base.cooldown, Ms::duration),
            probes: raw.probes.unwrap_or(base.probes),
        };
        b.validate().map_err(|e: BreakerConfigError| {
            self.invalid(&path.key("breaker").key(e.field), e.to_string())
        })?;
        Ok(b)
    }

    /// Every listed type, with its schema files read and compiled.
    fn schemas(
        &self,
        raw: &RawConfig,
        base_dir: &Path,
    ) -> Result<BTreeMap<JobType, TypeSchemas>, ConfigError> {
        let mut out = BTreeMap::new();
        for (name, t) in &raw.types {
            let ty = JobType::new(name.as_str());
            let path = root("types").key(name).key("schemas");
            let mut versions = BTreeMap::new();
            let mut files = BTreeMap::new();
            for (version, file) in t.schemas.iter().flatten() {
                let key = path.key(version);
                let n: u32 = version.trim().parse().map_err(|_| {
                    self.invalid(
                        &key,
                        format!(
                            "schema version \"{version}\" is not a whole number; write schemas = {{ 1 = \"file.json\" }}"
                        ),
                    )
                })?;
                let resolved = base_dir.join(file);
                let text = std::fs::read_to_string(&resolved).map_err(|e| {
                    self.invalid(
                        &key,
                        format!(
                            "cannot read schema file {}: {e}; schema paths are relative to the config file's directory",
                            resolved.display()
                        ),
                    )
                })?;
                let schema: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                    self.invalid(
                        &key,
                        format!(
                            "schema file {} is not valid JSON: {e}; fix the file",
                            resolved.display()
                        ),
                    )
                })?;
                if versions.insert(n, schema).is_some() {
                    return Err(
                        self.invalid(&key, format!("schema version {n} is given twice; keep one"))
                    );
                }
                files.insert(n, (key, resolved));
            }
            let compiled = TypeSchemas::compile(&ty, versions).map_err(|e| {
                let (key, file) = &files[&e.version];
                self.invalid(
                    key,
                    format!(
                        "schema file {} is not a usable JSON Schema: {}; fix the file",
                        file.display(),
                        e.reason
                    ),
                )
            })?;
            out.insert(ty, compiled);
        }
        Ok(out)
    }

    fn tokens(&self, raw: &RawConfig) -> Result<Vec<TokenConfig>, ConfigError> {
        let mut out: Vec<TokenConfig> = Vec::with_capacity(raw.tokens.len());
        for (i, t) in raw.tokens.iter().enumerate() {
            let path = root("tokens").index(i);
            let name = t.name.as_deref().unwrap_or("");
            if name.trim().is_empty() {
                return Err(self.invalid(
                    &path.key("name"),
                    "every token needs a name (it is the actor in the audit log): add name = \"...\"",
                ));
            }
            if name == "." || name == ".." {
                return Err(self.invalid(
                    &path.key("name"),
                    format!(
                        "token name {name:?} is not allowed: it is a path segment of its own in \
                         /v1/tokens/{{name}}; use letters or digits as well"
                    ),
                ));
            }
            if let Err(e) =
                lazaret_core::check_name("name", name, crate::auth::TOKEN_NAME_BYTES_MAX)
            {
                return Err(self.invalid(
                    &path.key("name"),
                    format!("{e}; the name is the actor in the audit log"),
                ));
            }
            let role = match t.role.as_deref() {
                None => {
                    return Err(self.invalid(
                        &path.key("role"),
                        "every token needs a role: add role = \"producer\", \"worker\", \"operator\" or \"admin\"",
                    ));
                }
                Some(r) => r
                    .parse::<Role>()
                    .map_err(|e| self.invalid(&path.key("role"), e.to_string()))?,
            };
            let (secret_key, sha256) = match (&t.token, &t.token_sha256) {
                (Some(_), Some(_)) => {
                    return Err(self.invalid(
                        &path.key("token_sha256"),
                        "set either token or token_sha256, not both: keep token_sha256 to keep the secret out of the file",
                    ));
                }
                (None, None) => {
                    return Err(self.invalid(
                        &path,
                        "a token needs its secret: add token = \"...\" or token_sha256 = \"<64 hex digits>\"",
                    ));
                }
                (Some(token), None) => {
                    if token.trim().is_empty() {
                        return Err(self.invalid(
                            &path.key("token"),
                            "the token is empty or only whitespace (a client cannot send it: \
                             the Authorization header's value is trimmed); give a long random secret",
                        ));
                    }
                    ("token", token_sha256(token))
                }
                (None, Some(h)) => {
                    let mut sha = [0u8; 32];
                    hex::decode_to_slice(h.trim(), &mut sha).map_err(|_| {
                        self.invalid(
                            &path.key("token_sha256"),
                            "token_sha256 must be 64 hex digits, the SHA-256 of the token (printf %s \"$TOKEN\" | sha256sum)",
                        )
                    })?;
                    ("token_sha256", sha)
                }
            };
            if let Some(j) = out.iter().position(|o| o.name == name) {
                return Err(self.invalid(
                    &path.key("name"),
                    format!(
                        "token name `{name}` is already used by tokens[{j}]{}; names identify the actor in the audit log, so rename one",
                        self.on_line(&root("tokens").index(j).key("name"))
                    ),
                ));
            }
            if let Some(other) = out.iter().find(|o| o.sha256 == sha256) {
                return Err(self.invalid(
                    &path.key(secret_key),
                    format!(
                        "this token's secret is also the secret of token `{}`; give each token its own, or the audit log cannot tell who acted",
                        other.name
                    ),
                ));
            }
            out.push(TokenConfig {
                name: name.to_owned(),
                role,
                sha256,
            });
        }
        Ok(out)
    }

    /// Every `[[sources]]` entry as a [`SourceSpec`], with the contract's
    /// defaults filled in.
    fn alerts(&self, raw: &RawConfig, cfg: &ServerConfig) -> Result<Vec<AlertTarget>, ConfigError> {
        let mut out = Vec::with_capacity(raw.alerts.len());
        for (i, a) in raw.alerts.iter().enumerate() {
            let path = root("alerts").index(i);
            let url = match a.url.as_deref().map(str::trim) {
                None | Some("") => {
                    return Err(self.invalid(
                        &path.key("url"),
                        "every [[alerts]] entry needs url: add url = \"http://127.0.0.1:9099/hook\" (POSTed one JSON body per alert)",
                    ));
                }
                Some(u) => u.to_owned(),
            };
            let host_ok = url
                .strip_prefix("http://")
                .is_some_and(|rest| !rest.is_empty() && !rest.starts_with('/'));
            if !host_ok {
                let hint = if url.starts_with("https://") {
                    "https targets are not supported yet; send to an http:// relay on this host"
                } else {
                    "write it as http://HOST:PORT/PATH"
                };
                return Err(self.invalid(
                    &path.key("url"),
                    format!("url {url:?} is not an http:// URL with a host: {hint}"),
                ));
            }
            let mut rule = AlertRule {
                surge_min: cfg.surge_min,
                surge_share: cfg.surge_share,
                ..AlertRule::default()
            };
            if let Some(events) = &a.events {
                rule.events.clear();
                for (j, e) in events.iter().enumerate() {
                    let event: AlertEvent =
                        e.parse()
                            .map_err(|err: lazaret_core::alerts::UnknownAlertEvent| {
                                self.invalid(&path.key("events").index(j), err.to_string())
                            })?;
                    rule.events.insert(event);
                }
            }
            if let Some(Ms(v)) = a.cooldown_ms {
                rule.cooldown = Duration::from_millis(v);
            }
            if let Some(v) = a.poison_rate_per_min {
                rule.poison_rate_per_min = v;
            }
            if let Some(v) = a.surge_min {
                rule.surge_min = v;
            }
            if let Some(v) = a.surge_share {
                rule.surge_share = v;
            }
            rule.validate().map_err(|e| {
                use lazaret_core::AlertRuleError as E;
                let key = match e {
                    E::NoEvents => "events",
                    E::Cooldown(_) => "cooldown_ms",
                    E::PoisonRate(_) => "poison_rate_per_min",
                    E::SurgeMin(_) => "surge_min",
                    _ => "surge_share",
                };
                self.invalid(&path.key(key), e.to_string())
            })?;
            out.push(AlertTarget { url, rule });
        }
        Ok(out)
    }

    fn sources(&self, raw: &RawConfig) -> Result<Vec<SourceSpec>, ConfigError> {
        let mut out: Vec<SourceSpec> = Vec::with_capacity(raw.sources.len());
        for (i, s) in raw.sources.iter().enumerate() {
            let path = root("sources").index(i);
            // A present key that is blank is as wrong as a missing one, but
            // is reported on its own line.
            let text = |key: &str, v: &Option<String>| -> Result<Option<String>, ConfigError> {
                match v {
                    Some(t) if t.trim().is_empty() => Err(self.invalid(
                        &path.key(key),
                        format!("{key} is empty; give a value or remove the key"),
                    )),
                    Some(t) => Ok(Some(t.clone())),
                    None => Ok(None),
                }
            };
            let required = |key: &str, v: &Option<String>, hint: &str| {
                text(key, v)?.ok_or_else(|| {
                    self.invalid(
                        &path.key(key),
                        format!("every source needs {key}: add {key} = {hint}"),
                    )
                })
            };

            let name = required(
                "name",
                &s.name,
                "\"orders\" (unique; dead letters and metrics carry it)",
            )?;
            let name_ok = name.len() <= 64
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
            if !name_ok {
                return Err(self.invalid(
                    &path.key("name"),
                    format!(
                        "source name {name:?} may hold only ASCII letters, digits, `_`, `-` and `.`, at most 64 of them: it travels in HTTP headers (Lazaret-Source) and metric labels; rename it"
                    ),
                ));
            }
            if let Some(j) = out.iter().position(|o| o.name == name) {
                return Err(self.invalid(
                    &path.key("name"),
                    format!(
                        "source name `{name}` is already used by sources[{j}]{}; dead letters are filed and redriven by source name, so rename one",
                        self.on_line(&root("sources").index(j).key("name"))
                    ),
                ));
            }

            let word = required(
                "broker",
                &s.broker,
                "\"rabbitmq\", \"nats\", \"redis\", \"kafka\" or \"sqs\"",
            )?;
            let broker = match BrokerKind::parse(&word) {
                Some(b) => b,
                None => {
                    return Err(self.invalid(
                        &path.key("broker"),
                        format!(
                            "unknown broker \"{word}\": use \"rabbitmq\", \"nats\", \"redis\", \"kafka\" or \"sqs\""
                        ),
                    ));
                }
            };

            let url = required(
                "url",
                &s.url,
                "\"amqp://…\", \"nats://…\", \"redis://…\", \"host:port\" (kafka) or \"http(s)://…\" (sqs)",
            )?;
            if let Some(other) = url_broker(&url).filter(|b| *b != broker) {
                return Err(self.invalid(
                    &path.key("url"),
                    format!(
                        "this is a {} URL but broker = \"{}\": fix the url or the broker",
                        other.as_str(),
                        broker.as_str()
                    ),
                ));
            }
            let queue = required(
                "queue",
                &s.queue,
                "\"orders\" (the RabbitMQ queue, JetStream stream or Redis stream)",
            )?;

            let mode = match s.mode.as_deref() {
                None | Some("guard") => Mode::Guard,
                Some("watch") => Mode::Watch,
                Some(other) => {
                    return Err(self.invalid(
                        &path.key("mode"),
                        format!(
                            "unknown mode \"{other}\": use \"guard\" (deliver each message to `deliver`) or \"watch\" (take in a dead-letter queue)"
                        ),
                    ));
                }
            };
            let deliver = text("deliver", &s.deliver)?;
            match (mode, &deliver) {
                (Mode::Guard, None) => {
                    return Err(self.invalid(
                        &path.key("deliver"),
                        "a guard source needs deliver = \"http://…\", the URL each message is POSTed to (or mode = \"watch\" for a dead-letter queue)",
                    ));
                }
                (Mode::Guard, Some(d))
                    if !(d.starts_with("http://") || d.starts_with("https://")) =>
                {
                    return Err(self.invalid(
                        &path.key("deliver"),
                        format!("deliver {d:?} is not an http:// or https:// URL; give the URL of the team's handler"),
                    ));
                }
                (Mode::Watch, Some(_)) => {
                    return Err(self.invalid(
                        &path.key("deliver"),
                        "a watch source delivers nothing (it takes a dead-letter queue in): remove deliver, or set mode = \"guard\"",
                    ));
                }
                _ => {}
            }

            let job_type = text("type", &s.job_type)?.unwrap_or_else(|| name.clone());
            if s.job_type.is_some() {
                self.not_blank(&path.key("type"), &job_type, "job type")?;
            }
            let deliver_format = match s.deliver_format.as_deref() {
                None => DeliverFormat::Raw,
                Some(word) => DeliverFormat::parse(word).ok_or_else(|| {
                    self.invalid(
                        &path.key("deliver_format"),
                        format!(
                            "unknown deliver_format {word:?}: use \"raw\" (the body byte for byte, the default) or \"envelope\" (one JSON object with the body and every header)"
                        ),
                    )
                })?,
            };
            if mode == Mode::Watch && s.deliver_format.is_some() {
                return Err(self.invalid(
                    &path.key("deliver_format"),
                    "a watch source delivers nothing: remove deliver_format, or set mode = \"guard\"",
                ));
            }
            let mut spec = match mode {
                Mode::Guard => SourceSpec::guard(&name, broker, &url, &queue, job_type),
                Mode::Watch => SourceSpec::watch(&name, broker, &url, &queue, job_type),
            };
            spec.deliver = deliver;
            spec.deliver_format = deliver_format;
            if let Some(g) = text("group", &s.group)? {
                spec.group = g;
            }
            spec.tenant = match (
                text("tenant", &s.tenant)?,
                text("tenant_header", &s.tenant_header)?,
            ) {
                (Some(_), Some(_)) => {
                    return Err(self.invalid(
                        &path.key("tenant_header"),
                        "set either tenant (one tenant for every message) or tenant_header (read from each message), not both",
                    ));
                }
                (Some(t), None) => {
                    self.not_blank(&path.key("tenant"), &t, "tenant")?;
                    TenantFrom::Fixed(t)
                }
                (None, Some(h)) => TenantFrom::Header(h),
                (None, None) => TenantFrom::Fixed("default".into()),
            };
            if let Some(l) = text("lane", &s.lane)? {
                self.not_blank(&path.key("lane"), &l, "lane")?;
                spec.lane = Lane::new(l.as_str());
            }
            if let Some(n) = s.concurrency {
                if n == 0 {
                    return Err(self.invalid(
                        &path.key("concurrency"),
                        "concurrency must be at least 1 (got 0), or nothing is ever delivered; to hold a source, pause its type or lane",
                    ));
                }
                spec.concurrency = n;
            }
            spec.settling = s.settling;
            if let Some(n) = s.receives_in_flight {
                if n == 0 {
                    return Err(self.invalid(
                        &path.key("receives_in_flight"),
                        "receives_in_flight must be at least 1 (got 0), or nothing is ever received; the default is 2",
                    ));
                }
                spec.receives_in_flight = n;
            }
            if let Some(Ms(v)) = s.delivery_timeout_ms {
                if v == 0 {
                    return Err(self.invalid(
                        &path.key("delivery_timeout_ms"),
                        "delivery_timeout_ms must be at least 1 (got 0), or every delivery times out",
                    ));
                }
                spec.delivery_timeout = Duration::from_millis(v);
            }
            spec.redrive_to = text("redrive_to", &s.redrive_to)?;
            if let Some(allow) = &s.redrive_allow {
                if mode == Mode::Guard {
                    return Err(self.invalid(
                        &path.key("redrive_allow"),
                        "redrive_allow is for watch sources (a guard redrives to its own queue, or redrive_to): remove it",
                    ));
                }
                if let Some(bad) = allow.iter().find(|q| q.trim().is_empty()) {
                    return Err(self.invalid(
                        &path.key("redrive_allow"),
                        format!("redrive_allow lists an empty queue name ({bad:?}): remove it"),
                    ));
                }
                spec.redrive_allow.clone_from(allow);
            }
            // A guard and a watch on one queue: the watch would take half
            // the healthy traffic in as dead letters.
            if let Some(j) = out.iter().position(|o| {
                o.mode != spec.mode
                    && o.broker == spec.broker
                    && o.queue == spec.queue
                    && same_server(&o.url, &spec.url)
            }) {
                let (guard, watch) = match spec.mode {
                    Mode::Guard => (&spec.name, &out[j].name),
                    Mode::Watch => (&out[j].name, &spec.name),
                };
                return Err(self.invalid(
                    &path.key("queue"),
                    format!(
                        "sources `{guard}` (guard) and `{watch}` (watch) both read queue {:?} on the same broker{}: the watch would take the guard's healthy messages in as dead letters; point the watch source at the dead-letter queue",
                        spec.queue,
                        self.on_line(&root("sources").index(j).key("queue"))
                    ),
                ));
            }
            out.push(spec);
        }
        // A watch source may redrive to the queues of the config's own
        // sources on its broker (besides `redrive_to` and its list).
        let queues: Vec<(BrokerKind, String)> =
            out.iter().map(|s| (s.broker, s.queue.clone())).collect();
        for spec in out.iter_mut().filter(|s| s.mode == Mode::Watch) {
            for (broker, queue) in &queues {
                if *broker == spec.broker
                    && *queue != spec.queue
                    && !spec.redrive_allow.contains(queue)
                {
                    spec.redrive_allow.push(queue.clone());
                }
            }
        }
        Ok(out)
    }

    fn on_line(&self, path: &KeyPath) -> String {
        self.line_of(path)
            .map_or_else(String::new, |l| format!(" (line {l})"))
    }
}

/// The broker a URL's scheme names, when it names one: a `redis://` URL
/// under `broker = "rabbitmq"` is a copy-paste slip worth refusing at start
/// rather than a connection that fails for ever in the background.
fn url_broker(url: &str) -> Option<BrokerKind> {
    let (scheme, _) = url.split_once("://")?;
    match scheme.to_ascii_lowercase().as_str() {
        "amqp" | "amqps" => Some(BrokerKind::RabbitMq),
        "nats" => Some(BrokerKind::Nats),
        "redis" | "rediss" | "redis+unix" => Some(BrokerKind::Redis),
        "kafka" => Some(BrokerKind::Kafka),
        _ => None,
    }
}

/// Whether two source URLs name the same broker: equal once the user
/// info (credentials) is left out and the scheme and host lower-cased.
fn same_server(a: &str, b: &str) -> bool {
    fn norm(url: &str) -> String {
        let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        format!(
            "{}://{}{}",
            scheme.to_ascii_lowercase(),
            host.to_ascii_lowercase(),
            path.trim_end_matches('/')
        )
    }
    norm(a) == norm(b)
}

/// 1-based line of byte `offset` in `text`.
fn line_at(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of the API contract's "Configuration file (TOML)" section, verbatim.
    const CONTRACT_EXAMPLE: &str = r#"
payload_bytes_max = 262144          # admission byte cap on the payload
batch_bytes_max = 16777216          # cap on a whole batch body (413 POISON payload_too_large over it)
accept_unknown_types = true         # false: UNKNOWN_TYPE for types not listed below

[tenants]
inflight_max = 2                    # default per-tenant in-flight cap in each lane

[lanes.interactive]
weight = 4                          # share of leases when several lanes have work
[lanes.batch]
weight = 1

[defaults]                          # policy for types not listed, and the base for listed ones
attempts_max = 5                    # deliveries in all, the first included
backoff_base_ms = 1000
backoff_cap_ms = 300000
crash_loop_max = 3                  # lease expiries before dead-lettering as crash_loop

deferrals_max = 50                  # deferred outcomes before dead-lettering as deferrals_exhausted

[types.send_email]
attempts_max = 4
backoff_base_ms = 50
kinds = { parse = 2, validation = 1 } # attempts a failure of that kind may spend
schemas = { 1 = "schemas/send_email.v1.json", 2 = "schemas/send_email.v2.json" }

[types.send_email.breaker]          # per (type, error kind)
failures_min = 20                   # failures in the window before it may open
failure_ratio = 0.5                 # and at least this share of outcomes failing
window_ms = 30000
cooldown_ms = 10000                 # open → half-open
probes = 2                          # leases allowed while half-open

[[tokens]]
name = "ops-alice"
role = "operator"                   # producer | worker | operator | admin
token = "..."                       # or token_sha256 = "hex"
"#;

    /// A config directory holding `text` as `lazaret.toml` and the example's schemas.
    fn config_dir(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("schemas")).unwrap();
        let v1 =
            r#"{"type": "object", "required": ["to"], "properties": {"to": {"type": "string"}}}"#;
        let v2 = r#"{"type": "object", "required": ["to", "subject"]}"#;
        std::fs::write(dir.path().join("schemas/send_email.v1.json"), v1).unwrap();
        std::fs::write(dir.path().join("schemas/send_email.v2.json"), v2).unwrap();
        let file = dir.path().join("lazaret.toml");
        std::fs::write(&file, text).unwrap();
        (dir, file)
    }

    fn parse(text: &str) -> Result<ServerConfig, ConfigError> {
        ServerConfig::from_toml_str(text, Path::new("/nonexistent"))
    }

    /// Asserts that `text` is refused about `key` on `line`, with a message containing `words`.
    #[track_caller]
    fn assert_refused(text: &str, key: &str, line: usize, words: &str) -> ConfigError {
        let e = parse(text).expect_err("config should be refused");
        assert_eq!(e.key(), Some(key), "{e}");
        assert_eq!(e.line(), Some(line), "{e}");
        assert!(e.to_string().contains(words), "`{words}` not in: {e}");
        e
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_contract_example_loads_with_its_schemas() {
        let (_dir, file) = config_dir(CONTRACT_EXAMPLE);
        let cfg = ServerConfig::load(&file).unwrap();

        let send = cfg.policies.for_type("send_email");
        assert_eq!(send.attempts_max, 4);
        assert_eq!(send.backoff.base, ms(50));
        assert_eq!(send.backoff.cap, Duration::from_secs(300), "inherited");
        assert_eq!(send.crash_loop_max, 3);
        assert_eq!(send.deferrals_max, 50);
        let kinds: Vec<(&str, u32)> = send.kinds.iter().map(|(k, n)| (k.as_str(), *n)).collect();
        assert_eq!(kinds, [("parse", 2), ("validation", 1)]);
        assert_eq!(cfg.policies.defaults, TypePolicy::default());
        assert_eq!(cfg.policies.for_type("other"), &TypePolicy::default());

        assert_eq!(cfg.scheduler.inflight_max, 2);
        let lanes: Vec<(&str, u32)> = cfg
            .scheduler
            .lane_weights
            .iter()
            .map(|(l, w)| (l.as_str(), *w))
            .collect();
        assert_eq!(lanes, [("batch", 1), ("default", 1), ("interactive", 4)]);

        assert_eq!(cfg.breaker_default, None);
        let breaker = cfg.breakers[&JobType::new("send_email")];
        assert_eq!(
            breaker,
            BreakerConfig {
                failures_min: 20,
                failure_ratio: 0.5,
                window: Duration::from_secs(30),
                cooldown: Duration::from_secs(10),
                probes: 2,
            }
        );

        assert_eq!(cfg.tokens.len(), 1);
        assert_eq!(cfg.tokens[0].name, "ops-alice");
        assert_eq!(cfg.tokens[0].role, Role::Operator);
        assert_eq!(cfg.tokens[0].sha256, token_sha256("..."));
        assert!(!format!("{:?}", cfg.tokens[0]).contains("..."));

        assert_eq!(cfg.payload_bytes_max, 262_144);
        assert_eq!(cfg.batch_bytes_max, 16 * 1024 * 1024);
        assert!(cfg.admission.accept_unknown_types);
        assert_eq!(cfg.admission.payload_bytes_max, 262_144);
        let schemas = &cfg.admission.types[&JobType::new("send_email")];
        assert_eq!(schemas.versions().collect::<Vec<_>>(), [1, 2]);
        let (violations, total) = schemas.violations(2, &serde_json::json!({"to": "a@b"}));
        assert_eq!((violations.len(), total), (1, 1), "v2 requires a subject");
    }

    #[test]
    fn alerts_load_the_contract_example_with_defaults_for_the_rest() {
        let cfg = parse(
            r#"
[[alerts]]
url = "http://127.0.0.1:9099/hook"
events = ["dead_letters_appeared", "poison_rate", "reason_surge",
          "breaker_opened", "breaker_closed", "dead_letters_over_warn"]
cooldown_ms = 300000
poison_rate_per_min = 10

[[alerts]]
url = "http://ops.internal:8080/lazaret"
events = ["reason_surge"]
surge_min = 5
surge_share = 0.9
"#,
        )
        .unwrap();
        assert_eq!(cfg.alerts.len(), 2);
        assert_eq!(cfg.alerts[0].url, "http://127.0.0.1:9099/hook");
        assert_eq!(cfg.alerts[0].rule, AlertRule::default());
        let second = &cfg.alerts[1].rule;
        assert_eq!(second.events, [AlertEvent::ReasonSurge].into());
        assert_eq!((second.surge_min, second.surge_share), (5, 0.9));
        assert_eq!(second.cooldown, Duration::from_secs(300));
        assert!(parse("").unwrap().alerts.is_empty());
    }

    #[test]
    fn top_level_surge_thresholds_are_every_targets_default() {
        let cfg = parse(
            "surge_min = 7\nsurge_share = 0.9\n[[alerts]]\nurl = \"http://h/a\"\n[[alerts]]\nurl = \"http://h/b\"\nsurge_min = 3\n",
        )
        .unwrap();
        assert_eq!((cfg.surge_min, cfg.surge_share), (7, 0.9));
        assert_eq!(
            (cfg.alerts[0].rule.surge_min, cfg.alerts[0].rule.surge_share),
            (7, 0.9)
        );
        assert_eq!(
            (cfg.alerts[1].rule.surge_min, cfg.alerts[1].rule.surge_share),
            (3, 0.9)
        );
        assert_refused(
            "surge_share = 1.5\n",
            "surge_share",
            1,
            "above 0.5 up to 1.0",
        );
        assert_refused("surge_min = 0\n", "surge_min", 1, "surge_min is 0");
    }

    #[test]
    fn alert_mistakes_are_named_with_their_key() {
        assert_refused(
            "[[alerts]]\nevents = [\"poison_rate\"]\n",
            "alerts[0].url",
            1,
            "every [[alerts]] entry needs url",
        );
        assert_refused(
            "[[alerts]]\nurl = \"https://hooks.example.com/x\"\n",
            "alerts[0].url",
            2,
            "https targets are not supported yet",
        );
        assert_refused(
            "[[alerts]]\nurl = \"127.0.0.1:9099\"\n",
            "alerts[0].url",
            2,
            "write it as http://HOST:PORT/PATH",
        );
        assert_refused(
            "[[alerts]]\nurl = \"http://h/\"\nevents = [\"poison_rate\", \"dlq_depth\"]\n",
            "alerts[0].events[1]",
            3,
            "unknown alert event `dlq_depth`: use dead_letters_appeared",
        );
        assert_refused(
            "[[alerts]]\nurl = \"http://h/\"\nevents = []\n",
            "alerts[0].events",
            3,
            "events is empty",
        );
        assert_refused(
            "[[alerts]]\nurl = \"http://h/\"\ncooldown_ms = 10\n",
            "alerts[0].cooldown_ms",
            3,
            "at least 1000",
        );
        assert_refused(
            "[[alerts]]\nurl = \"http://h/\"\nsurge_share = 0.4\n",
            "alerts[0].surge_share",
            3,
            "above 0.5 up to 1.0",
        );
        assert_refused(
            "[[alerts]]\nurl = \"http://h/\"\nsurge_min = 0\n",
            "alerts[0].surge_min",
            3,
            "surge_min is 0",
        );
        assert_refused(
            "[[alerts]]\nurl = \"http://h/\"\nwebhook = 1\n",
            "alerts[0].webhook",
            3,
            "unknown field `webhook`",
        );
    }

    #[test]
    fn the_documented_example_loads_and_sets_every_key() {
        // The module doc is the key reference copied into docs: it must parse.
        let source = include_str!("config.rs");
        let doc: Vec<&str> = source
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .map(|l| l.strip_prefix("//! ").unwrap_or(""))
            .skip_while(|l| *l != "```toml")
            .skip(1)
            .take_while(|l| *l != "```")
            .collect();
        let (_dir, file) = config_dir(&doc.join("\n"));
        let cfg = ServerConfig::load(&file).unwrap();
        assert_eq!(
            cfg.scheduler.tenant_inflight_max[&TenantId::new("big-customer")],
            8
        );
        assert_eq!(cfg.alerts.len(), 1);
        assert_eq!(cfg.alerts[0].rule, AlertRule::default());
        assert_eq!(cfg.breaker_default.unwrap().failures_min, 20);
        assert_eq!(cfg.tokens.len(), 2);
        assert_eq!(cfg.tokens[1].role, Role::Producer);
        assert_eq!(cfg.tokens[1].sha256, token_sha256("hello"));
        let d = &cfg.policies.defaults;
        assert_eq!(
            d.kind_classes[&ErrorKind::new("http_404")],
            FailureClass::Permanent
        );
        let send = cfg.policies.for_type("send_email");
        assert_eq!(
            send.kinds.len(),
            3,
            "timeout inherited, parse and validation added"
        );
        assert_eq!(send.kind_classes, d.kind_classes);
        let names: Vec<&str> = cfg.sources.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["orders", "celery-dlq"]);
        let orders = &cfg.sources[0];
        assert_eq!(orders.broker, BrokerKind::RabbitMq);
        assert_eq!(
            orders.deliver.as_deref(),
            Some("http://127.0.0.1:8080/orders")
        );
        assert_eq!(orders.redrive_to.as_deref(), Some("orders"));
        let dlq = &cfg.sources[1];
        assert_eq!(dlq.mode, Mode::Watch);
        assert_eq!(dlq.tenant, TenantFrom::Header("x-tenant".into()));
        assert_eq!(
            dlq.job_type.as_str(),
            "celery-dlq",
            "the type defaults to the name"
        );
    }

    const GUARD: &str = "[[sources]]\nname = \"orders\"\nbroker = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\nqueue = \"orders\"\n";

    #[test]
    fn a_source_gets_the_contracts_defaults() {
        let cfg = parse(&format!("{GUARD}deliver = \"http://127.0.0.1:9/h\"\n")).unwrap();
        let s = &cfg.sources[0];
        assert_eq!(s.name, "orders");
        assert_eq!(s.broker, BrokerKind::Redis);
        assert_eq!(s.url, "redis://127.0.0.1:6379");
        assert_eq!(s.queue, "orders");
        assert_eq!(s.group, "lazaret");
        assert_eq!(s.mode, Mode::Guard);
        assert_eq!(s.job_type.as_str(), "orders");
        assert_eq!(s.lane.as_str(), "default");
        assert_eq!(s.tenant, TenantFrom::Fixed("default".into()));
        assert_eq!(s.concurrency, 16);
        assert_eq!(s.settling, None);
        assert_eq!(s.settling_max(), 240, "15 settling per handler slot");
        assert_eq!(
            s.unsettled_max(),
            256,
            "RabbitMQ's prefetch: 16 × concurrency"
        );
        assert_eq!(s.delivery_timeout, Duration::from_secs(30));
        assert_eq!(s.redrive_to, None);
        assert!(parse("").unwrap().sources.is_empty());
        let cfg = parse(&format!(
            "{GUARD}deliver = \"http://127.0.0.1:9/h\"\nconcurrency = 4\n"
        ))
        .unwrap();
        assert_eq!(
            cfg.sources[0].settling_max(),
            60,
            "the settling allowance follows concurrency"
        );
    }

    #[test]
    fn every_source_key_is_read() {
        let cfg = parse(
            "[[sources]]\nname = \"a.b-c_1\"\nbroker = \"nats\"\nurl = \"nats://127.0.0.1:4222\"\n\
             queue = \"ORDERS\"\ngroup = \"g\"\nmode = \"guard\"\ndeliver = \"https://h/x\"\n\
             type = \"t\"\ntenant = \"acme\"\nlane = \"batch\"\nconcurrency = 3\nsettling = 0\n\
             delivery_timeout_ms = 1500\nredrive_to = \"ORDERS.retry\"\ndeliver_format = \"envelope\"\n",
        )
        .unwrap();
        let s = &cfg.sources[0];
        assert_eq!(s.deliver_format, DeliverFormat::Envelope);
        assert_eq!(s.broker, BrokerKind::Nats);
        assert_eq!(s.group, "g");
        assert_eq!(s.job_type.as_str(), "t");
        assert_eq!(s.tenant, TenantFrom::Fixed("acme".into()));
        assert_eq!(s.lane.as_str(), "batch");
        assert_eq!(s.concurrency, 3);
        assert_eq!(s.settling, Some(0));
        assert_eq!(s.settling_max(), 0);
        assert_eq!(s.delivery_timeout, ms(1500));
        assert_eq!(s.redrive_to.as_deref(), Some("ORDERS.retry"));
    }

    #[test]
    fn a_guard_needs_somewhere_to_deliver_and_a_watch_has_none() {
        assert_refused(
            GUARD,
            "sources[0].deliver",
            1,
            "a guard source needs deliver",
        );
        assert_refused(
            &format!("{GUARD}deliver = \"127.0.0.1:8080\"\n"),
            "sources[0].deliver",
            6,
            "not an http:// or https:// URL",
        );
        assert_refused(
            &format!("{GUARD}mode = \"watch\"\ndeliver = \"http://h/\"\n"),
            "sources[0].deliver",
            7,
            "a watch source delivers nothing",
        );
        let cfg = parse(&format!("{GUARD}mode = \"watch\"\n")).unwrap();
        assert_eq!(cfg.sources[0].mode, Mode::Watch);
        assert_refused(
            &format!("{GUARD}mode = \"tail\"\n"),
            "sources[0].mode",
            6,
            "\"guard\"",
        );
    }

    #[test]
    fn source_names_are_unique_and_header_safe() {
        let twice = format!("{GUARD}deliver = \"http://h/\"\n{GUARD}deliver = \"http://h/\"\n");
        let e = assert_refused(
            &twice,
            "sources[1].name",
            8,
            "already used by sources[0] (line 2)",
        );
        assert!(e.to_string().contains("`orders`"), "{e}");
        assert_refused(
            "[[sources]]\nname = \"ordres été\"\n",
            "sources[0].name",
            2,
            "ASCII letters",
        );
        assert_refused(
            "[[sources]]\nbroker = \"redis\"\n",
            "sources[0].name",
            1,
            "every source needs name",
        );
        assert_refused(
            "[[sources]]\nname = \" \"\n",
            "sources[0].name",
            2,
            "name is empty",
        );
    }

    #[test]
    fn a_guard_and_a_watch_on_one_queue_are_refused_naming_both() {
        // The same broker, written with other credentials and a trailing slash.
        let text = format!(
            "{GUARD}deliver = \"http://h/\"\n[[sources]]\nname = \"orders-dlq\"\nbroker = \"redis\"\n\
             url = \"redis://user:pw@127.0.0.1:6379/\"\nqueue = \"orders\"\nmode = \"watch\"\n"
        );
        let e = assert_refused(&text, "sources[1].queue", 11, "(line 5)");
        let why = e.to_string();
        assert!(
            why.contains("`orders` (guard)") && why.contains("`orders-dlq` (watch)"),
            "{why}"
        );
        // Its dead-letter queue is fine, and the guard's queue is a redrive
        // target the watch may use.
        let ok = text.replace("queue = \"orders\"\nmode", "queue = \"orders.dlq\"\nmode");
        let cfg = parse(&ok).unwrap();
        assert_eq!(cfg.sources[1].redrive_allow, vec!["orders".to_owned()]);
        let listed = format!("{ok}redrive_allow = [\"orders.v2\"]\n");
        assert_eq!(
            parse(&listed).unwrap().sources[1].redrive_allow,
            vec!["orders.v2".to_owned(), "orders".to_owned()]
        );
        assert_refused(
            &format!("{GUARD}deliver = \"http://h/\"\nredrive_allow = [\"x\"]\n"),
            "sources[0].redrive_allow",
            7,
            "for watch sources",
        );
    }

    #[test]
    fn a_kafka_source_is_a_topic_a_group_and_host_port() {
        let cfg = parse(
            "[[sources]]\nname = \"orders\"\nbroker = \"kafka\"\nurl = \"127.0.0.1:9092\"\n\
             queue = \"orders\"\ngroup = \"shop\"\ndeliver = \"http://127.0.0.1:9/h\"\n",
        )
        .unwrap();
        let s = &cfg.sources[0];
        assert_eq!(s.broker, BrokerKind::Kafka);
        assert_eq!(
            (s.url.as_str(), s.queue.as_str(), s.group.as_str()),
            ("127.0.0.1:9092", "orders", "shop")
        );
        assert_refused(
            &GUARD.replace("\"redis\"", "\"kafka\""),
            "sources[0].url",
            4,
            "this is a redis URL but broker = \"kafka\"",
        );
    }

    #[test]
    fn an_unknown_broker_is_refused() {
        assert_refused(
            &GUARD.replace("\"redis\"", "\"kinesis\""),
            "sources[0].broker",
            3,
            "unknown broker \"kinesis\"",
        );
    }

    #[test]
    fn an_sqs_source_takes_an_endpoint_url_and_a_queue_url() {
        let cfg = parse(
            "[[sources]]\nname = \"orders\"\nbroker = \"sqs\"\nurl = \"http://127.0.0.1:4566\"\nqueue = \"http://127.0.0.1:4566/000000000000/orders.fifo\"\nmode = \"watch\"\n",
        )
        .unwrap();
        let s = &cfg.sources[0];
        assert_eq!(s.broker, BrokerKind::Sqs);
        assert_eq!(s.url, "http://127.0.0.1:4566");
        assert_eq!(s.queue, "http://127.0.0.1:4566/000000000000/orders.fifo");
    }

    #[test]
    fn an_sqs_source_sets_its_receives_in_flight() {
        let base = "[[sources]]\nname = \"orders\"\nbroker = \"sqs\"\nurl = \"http://127.0.0.1:4566\"\nqueue = \"orders\"\ndeliver = \"http://h/\"\n";
        let cfg = parse(base).unwrap();
        assert_eq!(cfg.sources[0].receives_in_flight, 2, "the default");
        let cfg = parse(&format!("{base}receives_in_flight = 4\n")).unwrap();
        assert_eq!(cfg.sources[0].receives_in_flight, 4);
        assert_refused(
            &format!("{base}receives_in_flight = 0\n"),
            "sources[0].receives_in_flight",
            7,
            "at least 1",
        );
    }

    #[test]
    fn an_unknown_source_key_is_refused_where_it_is() {
        let e = assert_refused(
            &format!("{GUARD}deliver = \"http://h/\"\ndelivr = \"http://h/\"\n"),
            "sources[0].delivr",
            7,
            "unknown field `delivr`",
        );
        assert!(e.to_string().contains("fix its spelling"), "{e}");
        let (_dir, file) = config_dir(&format!("{GUARD}deliver = \"http://h/\"\nretries = 3\n"));
        let e = ServerConfig::load(&file).unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("{}:7: sources[0].retries: ", file.display())),
            "{e}"
        );
    }

    #[test]
    fn other_source_mistakes_are_refused_with_their_key() {
        let base = format!("{GUARD}deliver = \"http://h/\"\n");
        assert_refused(
            &format!("{base}tenant = \"a\"\ntenant_header = \"x-tenant\"\n"),
            "sources[0].tenant_header",
            8,
            "not both",
        );
        assert_refused(
            &format!("{base}concurrency = 0\n"),
            "sources[0].concurrency",
            7,
            "at least 1",
        );
        assert_refused(
            &format!("{base}delivery_timeout_ms = 0\n"),
            "sources[0].delivery_timeout_ms",
            7,
            "at least 1",
        );
        assert_refused(
            &format!("{base}delivery_timeout_ms = \"5s\"\n"),
            "sources[0].delivery_timeout_ms",
            7,
            "write 5000",
        );
        assert_refused(
            &GUARD.replace("redis://127.0.0.1:6379", "amqp://guest:guest@h/%2f"),
            "sources[0].url",
            4,
            "a rabbitmq URL but broker = \"redis\"",
        );
        assert_refused(
            "[[sources]]\nname = \"a\"\nbroker = \"redis\"\nurl = \"redis://h\"\n",
            "sources[0].queue",
            1,
            "every source needs queue",
        );
        assert_refused(
            &format!("{base}lane = \"\"\n"),
            "sources[0].lane",
            7,
            "lane is empty",
        );
        assert_refused(
            &format!("{base}deliver_format = \"json\"\n"),
            "sources[0].deliver_format",
            7,
            "unknown deliver_format \"json\"",
        );
        assert_refused(
            &format!(
                "{base}tenant_header = \"x-tenant\"\ntype = \"{}\"\n",
                "t".repeat(129)
            ),
            "sources[0].type",
            8,
            "the job type name is 129 bytes",
        );
        assert_refused(
            "[tenants.overrides]\n\"a\\u0007b\" = 2\n",
            "tenants.overrides.\"a\\u{7}b\"",
            2,
            "control character",
        );
    }

    #[test]
    fn an_empty_file_gives_the_defaults() {
        let cfg = parse("").unwrap();
        let d = ServerConfig::default();
        assert_eq!(cfg.payload_bytes_max, 262_144);
        assert_eq!(cfg.batch_bytes_max, 16 * 1024 * 1024);
        assert!(cfg.accept_unknown_types);
        assert_eq!(cfg.scheduler, d.scheduler);
        assert_eq!(cfg.scheduler.inflight_max, INFLIGHT_UNCAPPED, "no cap");
        assert!(
            !cfg.scheduler.at_cap(&TenantId::new("acme"), 1_000_000),
            "no FAIR_QUEUE without a configured cap"
        );
        assert!(cfg.scheduler.tenant_inflight_max.is_empty());
        assert_eq!(cfg.scheduler.lane_weights[&Lane::default_lane()], 1);
        assert_eq!(cfg.policies.defaults, TypePolicy::default());
        assert_eq!(cfg.policies.defaults.attempts_max, 5);
        assert_eq!(cfg.policies.defaults.backoff.base, ms(1000));
        assert_eq!(cfg.policies.defaults.backoff.cap, ms(300_000));
        assert_eq!(cfg.policies.defaults.crash_loop_max, 3);
        assert_eq!(cfg.policies.defaults.deferrals_max, 50);
        assert!(cfg.policies.types.is_empty());
        assert!(cfg.admission.types.is_empty());
        assert_eq!(cfg.breaker_default, None);
        assert!(cfg.breakers.is_empty());
        assert!(cfg.tokens.is_empty());
        assert_eq!(cfg.retention, d.retention);
        assert_eq!(
            (
                cfg.retention.succeeded_ms,
                cfg.retention.cleaner_batch,
                cfg.retention.cleaner_interval_ms
            ),
            (86_400_000, 500, 1000)
        );
        assert_eq!(cfg.dead_letters_warn, 100_000);
        assert_eq!(cfg.admission_records_per_minute, 60);
        assert_eq!(cfg.admission_records_all_per_minute, 600);
        assert_eq!(cfg.durability, Durability::Full);
        assert_eq!(
            (cfg.lease_ms_default, cfg.lease_ms_max),
            (30_000, 3_600_000)
        );
    }

    #[test]
    fn a_type_inherits_every_key_it_does_not_set() {
        let cfg = parse(
            r#"
[defaults]
attempts_max = 7
backoff_floor_ms = 10
backoff_schedule_ms = [100, 1000]
kinds = { timeout = 3, parse = 2 }
kind_classes = { http_404 = "permanent" }

[defaults.breaker]
probes = 5

[types.bare]

[types.picky]
crash_loop_max = 1
backoff_schedule_ms = []
kinds = { parse = 1 }
kind_classes = { http_429 = "deferred" }
[types.picky.breaker]
failures_min = 3
"#,
        )
        .unwrap();
        let d = cfg.policies.defaults.clone();
        assert_eq!(d.attempts_max, 7);
        assert_eq!(d.backoff.schedule, [ms(100), ms(1000)]);
        assert_eq!(cfg.policies.for_type("bare"), &d);

        let picky = cfg.policies.for_type("picky");
        assert_eq!(picky.attempts_max, 7);
        assert_eq!(picky.crash_loop_max, 1);
        assert_eq!(picky.backoff.floor, ms(10));
        assert!(picky.backoff.schedule.is_empty(), "[] clears the schedule");
        let kinds: Vec<(&str, u32)> = picky.kinds.iter().map(|(k, n)| (k.as_str(), *n)).collect();
        assert_eq!(
            kinds,
            [("parse", 1), ("timeout", 3)],
            "merged, the type wins"
        );
        assert_eq!(picky.kind_classes.len(), 2);

        assert_eq!(cfg.breaker_default.unwrap().probes, 5);
        let b = cfg.breakers[&JobType::new("picky")];
        assert_eq!(
            (b.failures_min, b.probes),
            (3, 5),
            "inherits [defaults.breaker]"
        );
        assert!(
            !cfg.breakers.contains_key("bare"),
            "falls back to breaker_default at run time"
        );
        assert!(
            cfg.admission.types["bare"].is_empty(),
            "listed, so known, without schemas"
        );
    }

    #[test]
    fn an_unknown_key_is_refused_with_its_path_and_line() {
        let e = assert_refused(
            "[types.send_email]\nattempts_max = 4\natempts_max = 3\n",
            "types.send_email.atempts_max",
            3,
            "unknown field `atempts_max`",
        );
        assert!(
            e.to_string()
                .starts_with("config line 3: types.send_email.atempts_max: "),
            "{e}"
        );
        assert_refused(
            "payload_byte_max = 1\n",
            "payload_byte_max",
            1,
            "fix its spelling",
        );
        assert_refused(
            "\n[types.a]\nbreaker = { window_ms = 5, probs = 1 }\n",
            "types.a.breaker.probs",
            3,
            "unknown field `probs`",
        );
        assert_refused(
            "[[tokens]]\nname = \"a\"\nrol = \"admin\"\n",
            "tokens[0].rol",
            3,
            "rol",
        );
        assert_refused(
            "[lanes.fast]\nweigth = 2\n",
            "lanes.fast.weigth",
            2,
            "weigth",
        );
    }

    #[test]
    fn a_wrongly_typed_value_is_refused_with_its_path_and_line() {
        assert_refused(
            "[defaults]\n\nattempts_max = \"five\"\n",
            "defaults.attempts_max",
            3,
            "invalid type",
        );
        assert_refused(
            "[types.a]\nbackoff_schedule_ms = [10, -1]\n",
            "types.a.backoff_schedule_ms[1]",
            2,
            "negative",
        );
        assert_refused(
            "[types.a]\nkind_classes = { http_404 = \"fatal\" }\n",
            "types.a.kind_classes.http_404",
            2,
            "`permanent`",
        );
        assert_refused(
            "lease_ms_default = \"30s\"\n",
            "lease_ms_default",
            1,
            "write 30000 instead of \"30s\"",
        );
    }

    #[test]
    fn invalid_toml_is_refused_with_its_line() {
        let e = parse("a = 1\n[types\n").unwrap_err();
        assert_eq!(e.line(), Some(2), "{e}");
        assert!(e.to_string().contains("not valid TOML"), "{e}");
    }

    #[test]
    fn a_zero_count_is_refused_with_the_types_key_and_line() {
        let text = "[types.send_email]\nbackoff_base_ms = 50\nattempts_max = 0\n";
        assert_refused(text, "types.send_email.attempts_max", 3, "at least 1");
        let (_dir, file) = config_dir(text);
        let e = ServerConfig::load(&file).unwrap_err();
        let shown = e.to_string();
        assert!(
            shown.starts_with(&format!(
                "{}:3: types.send_email.attempts_max: ",
                file.display()
            )),
            "{shown}"
        );
        assert_refused(
            "[types.a]\nkinds = { parse = 0 }\n",
            "types.a.kinds.parse",
            2,
            "at least 1",
        );
        assert_refused(
            "[defaults]\ndeferrals_max = 0\n",
            "defaults.deferrals_max",
            2,
            "at least 1",
        );
        assert_refused(
            "[defaults]\nbackoff_floor_ms = 500\n[types.a]\nbackoff_cap_ms = 100\n",
            "types.a.backoff_cap_ms",
            4,
            "above backoff_cap_ms",
        );
    }

    #[test]
    fn lane_reserves_and_breaker_behaviour_are_read_and_checked() {
        let cfg = parse(
            "[lanes.interactive]\nweight = 4\nreserve = 0.2\non_breaker_open = \"park\"\n\
             [lanes.batch]\nreserve = 0\non_breaker_open = \"shed\"\n[lanes.all]\nreserve = 1\n\
             [lanes.none]\n",
        );
        let e = cfg.expect_err("reserves adding up to 1.2 are refused");
        assert_eq!(e.key(), Some("lanes.interactive.reserve"), "{e}");
        assert!(e.to_string().contains("add up to 1.2"), "{e}");

        let cfg = parse(
            "[lanes.interactive]\nweight = 4\nreserve = 0.2\non_breaker_open = \"park\"\n\
             [lanes.batch]\nreserve = 0\non_breaker_open = \"shed\"\n[lanes.bulk]\nreserve = 0.8\n",
        )
        .unwrap();
        let reserve = |l: &str| cfg.scheduler.lane_reserve(&Lane::new(l)).parts();
        assert_eq!(reserve("interactive"), 200_000);
        assert_eq!(reserve("batch"), 0);
        assert_eq!(reserve("bulk"), 800_000);
        assert_eq!(reserve("default"), 0);
        assert_eq!(
            cfg.park_lanes.iter().map(Lane::as_str).collect::<Vec<_>>(),
            ["interactive"]
        );
        assert!(ServerConfig::default().park_lanes.is_empty());

        assert_refused(
            "[lanes.a]\nweight = 2\nreserve = 1.5\n",
            "lanes.a.reserve",
            3,
            "between 0 and 1",
        );
        assert_refused(
            "[lanes.a]\nreserve = -0.1\n",
            "lanes.a.reserve",
            2,
            "between 0 and 1",
        );
        assert_refused(
            "[lanes.a]\non_breaker_open = \"queue\"\n",
            "lanes.a.on_breaker_open",
            2,
            "\"park\"",
        );
        assert_refused("[lanes.a]\nreserve = \"20%\"\n", "lanes.a.reserve", 2, "");
    }

    #[test]
    fn other_out_of_range_values_are_refused_where_they_are_written() {
        assert_refused(
            "[types.a.breaker]\nfailure_ratio = 1.5\n",
            "types.a.breaker.failure_ratio",
            2,
            "in (0, 1]",
        );
        assert_refused(
            "[defaults.breaker]\nprobes = 0\n",
            "defaults.breaker.probes",
            2,
            "at least 1",
        );
        assert_refused(
            "[lanes.a]\nweight = 1\n[lanes.b]\nweight = 0\n",
            "lanes.b.weight",
            4,
            "weight 0",
        );
        assert_refused(
            "[tenants]\ninflight_max = 0\n",
            "tenants.inflight_max",
            2,
            "[tenants.overrides]",
        );
        assert_refused(
            "[tenants]\ninflight_max = 2\nready_max = 0\n",
            "tenants.ready_max",
            3,
            "at least 1",
        );
        assert_refused(
            "payload_bytes_max = 0\n",
            "payload_bytes_max",
            1,
            "at least 1",
        );
        assert_refused(
            "lease_ms_max = 1000\n",
            "lease_ms_max",
            1,
            "above lease_ms_max",
        );
        assert_refused("durability = \"fast\"\n", "durability", 1, "\"normal\"");
        assert_refused(
            "[retention]\ncleaner_batch = 0\n",
            "retention.cleaner_batch",
            2,
            "at least 1",
        );
        assert_refused(
            "[defaults]\nschemas = { 1 = \"a.json\" }\n",
            "defaults.schemas",
            2,
            "[types.NAME]",
        );
        let cfg =
            parse("durability = \"normal\"\n[tenants.overrides]\n\"acme.corp\" = 0\n").unwrap();
        assert_eq!(cfg.durability, Durability::Normal);
        assert_eq!(
            cfg.scheduler.tenant_inflight_max[&TenantId::new("acme.corp")],
            0
        );
    }

    #[test]
    fn a_bad_role_is_refused() {
        let e = assert_refused(
            "[[tokens]]\nname = \"a\"\nrole = \"root\"\ntoken = \"s\"\n",
            "tokens[0].role",
            3,
            "unknown role `root`",
        );
        assert!(
            e.to_string().contains("producer, worker, operator, admin"),
            "{e}"
        );
        assert_eq!("admin".parse::<Role>(), Ok(Role::Admin));
        for r in Role::ALL {
            assert_eq!(r.as_str().parse::<Role>(), Ok(r));
        }
    }

    #[test]
    fn a_token_needs_exactly_one_secret() {
        assert_refused(
            "[[tokens]]\nname = \"a\"\nrole = \"admin\"\ntoken = \"s\"\ntoken_sha256 = \"00\"\n",
            "tokens[0].token_sha256",
            5,
            "not both",
        );
        let e = parse("[[tokens]]\nname = \"a\"\nrole = \"admin\"\n").unwrap_err();
        assert_eq!(e.key(), Some("tokens[0]"), "{e}");
        assert!(e.to_string().contains("token_sha256 = "), "{e}");
        assert_refused(
            "[[tokens]]\nname = \"a\"\nrole = \"admin\"\ntoken_sha256 = \"abc\"\n",
            "tokens[0].token_sha256",
            4,
            "64 hex digits",
        );
        let upper = hex::encode_upper(token_sha256("s"));
        let cfg = parse(&format!(
            "[[tokens]]\nname = \"a\"\nrole = \"admin\"\ntoken_sha256 = \"{upper}\"\n"
        ))
        .unwrap();
        assert_eq!(cfg.tokens[0].sha256, token_sha256("s"));
    }

    #[test]
    fn two_tokens_may_share_neither_name_nor_secret() {
        let e = assert_refused(
            "[[tokens]]\nname = \"a\"\nrole = \"admin\"\ntoken = \"s1\"\n\
             [[tokens]]\nname = \"a\"\nrole = \"worker\"\ntoken = \"s2\"\n",
            "tokens[1].name",
            6,
            "already used by tokens[0] (line 2)",
        );
        assert!(!e.to_string().contains("s1"), "{e}");
        let hash = hex::encode(token_sha256("s1"));
        let e = assert_refused(
            &format!(
                "[[tokens]]\nname = \"a\"\nrole = \"admin\"\ntoken = \"s1\"\n\
                 [[tokens]]\nname = \"b\"\nrole = \"worker\"\ntoken_sha256 = \"{hash}\"\n"
            ),
            "tokens[1].token_sha256",
            8,
            "secret of token `a`",
        );
        assert!(!e.to_string().contains("s1"), "{e}");
    }

    #[test]
    fn a_missing_schema_file_is_named_by_its_resolved_path() {
        let text = "[types.send_email]\nschemas = { 1 = \"schemas/send_email.v1.json\", 3 = \"schemas/nope.json\" }\n";
        let (dir, file) = config_dir(text);
        let e = ServerConfig::load(&file).unwrap_err();
        assert_eq!(e.key(), Some("types.send_email.schemas.3"), "{e}");
        assert_eq!(e.line(), Some(2), "{e}");
        let resolved = dir.path().join("schemas/nope.json");
        assert!(
            e.to_string().contains(&resolved.display().to_string()),
            "{e}"
        );
    }

    #[test]
    fn a_schema_that_does_not_compile_is_refused_with_its_version() {
        let (dir, file) = config_dir(
            "[types.a]\nschemas = { 1 = \"schemas/send_email.v1.json\", 2 = \"schemas/bad.json\" }\n",
        );
        std::fs::write(dir.path().join("schemas/bad.json"), r#"{"type": 12}"#).unwrap();
        let e = ServerConfig::load(&file).unwrap_err();
        assert_eq!(e.key(), Some("types.a.schemas.2"), "{e}");
        assert!(e.to_string().contains("not a usable JSON Schema"), "{e}");
        std::fs::write(dir.path().join("schemas/bad.json"), "{").unwrap();
        let e = ServerConfig::load(&file).unwrap_err();
        assert!(e.to_string().contains("not valid JSON"), "{e}");
        assert_refused(
            "[types.a]\nschemas = { v1 = \"x.json\" }\n",
            "types.a.schemas.v1",
            2,
            "whole number",
        );
    }

    #[test]
    fn an_unreadable_config_file_is_named() {
        let e = ServerConfig::load(Path::new("/nonexistent/lazaret.toml")).unwrap_err();
        assert!(matches!(e, ConfigError::Read { .. }));
        assert!(e.to_string().contains("/nonexistent/lazaret.toml"), "{e}");
    }

    #[test]
    fn the_http_table_sets_timeouts_cap_and_grace_and_refuses_zero_timeouts() {
        let d = parse("").unwrap().http;
        assert_eq!(d, HttpConfig::default());
        assert_eq!(d.connections_max, None);
        let c = parse(
            "[http]\nheader_read_timeout_ms = 5\nbody_read_timeout_ms = 6\nidle_timeout_ms = 7\n\
             connections_max = 8\nshutdown_grace_ms = 0\n",
        )
        .unwrap()
        .http;
        assert_eq!(
            c,
            HttpConfig {
                header_read_timeout_ms: 5,
                body_read_timeout_ms: 6,
                idle_timeout_ms: 7,
                connections_max: Some(8),
                shutdown_grace_ms: 0,
            }
        );
        assert_eq!(
            parse("[http]\nconnections_max = 0\n")
                .unwrap()
                .http
                .connections_max,
            None
        );
        let e = parse("[http]\nidle_timeout_ms = 0\n").unwrap_err();
        assert!(e.to_string().contains("http.idle_timeout_ms"), "{e}");
        let e = parse("[http]\nidle_timeout = 5\n").unwrap_err();
        assert!(e.to_string().contains("idle_timeout"), "{e}");
    }

    #[test]
    fn allowed_hosts_are_host_names_with_or_without_a_port() {
        assert!(parse("").unwrap().allowed_hosts.is_empty());
        let c = parse("[http]\nallowed_hosts = [\"Lazaret.Example.com\", \"proxy:8443\", \"[::1]:9\", \"10.0.0.5\"]\n")
            .unwrap();
        assert_eq!(
            c.allowed_hosts,
            ["lazaret.example.com", "proxy:8443", "[::1]:9", "10.0.0.5"]
        );
        for (bad, says) in [
            ("https://lazaret.example.com", "without a scheme"),
            ("lazaret.example.com/ui", "without a scheme"),
            ("*.example.com", "wildcard"),
            ("", "empty"),
            ("host:port", "not a host name"),
            ("a b", "not a host name"),
            ("[zz]", "IPv6"),
        ] {
            let e = parse(&format!("[http]\nallowed_hosts = [\"{bad}\"]\n")).unwrap_err();
            let text = e.to_string();
            assert!(
                text.contains("http.allowed_hosts") && text.contains(says),
                "{bad:?}: {text}"
            );
        }
    }
}
