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
//! redrives_max = 3                    # a job dead-lettered again after this many redrives is held for a
//!                                     # person: filter and group redrives skip it, a redrive by id moves it
//!                                     # (at least 1; compared with the job's redrive count when read)
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
//! series_sample_ms = 15000           # how often the charts' signals are sampled (100..=60000; kept 25 h)
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
//! Durations (`*_ms`) are integer milliseconds or a string with a unit
//! (`"30s"`, `"5m"`, `"250ms"`, `"1h 30m"`), down to whole milliseconds.
//! Two tokens may not share a name or a secret, two
//! sources not a name.
//!
//! # Where things are
//!
//! This file holds [`ServerConfig`], the top-level keys and the order the
//! sections are checked in; each section's raw table and checks are in a
//! file of its own (`http.rs`, `scheduling.rs` for `[tenants]` and
//! `[lanes.X]`, `policies.rs` for `[defaults]` and `[types.X]`, `store.rs`
//! for `durability` and `[retention]`, `sources.rs`, `alerts.rs`,
//! `tokens.rs`), and `locate.rs` turns a TOML span into the error's file,
//! line and dotted key. Durations are read as integer milliseconds or
//! `humantime` strings (`ms.rs`) and held as [`Duration`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use lazaret_core::{
    AdmissionConfig, AlertRule, BreakerConfig, JobType, Lane, Policies, SchedulerConfig,
};
use lazaret_guard::SourceSpec;
use lazaret_store::Durability;
use serde::Deserialize;

mod alerts;
mod http;
mod locate;
mod ms;
mod policies;
mod scheduling;
mod sources;
mod store;
#[cfg(test)]
mod tests;
mod tokens;

pub use alerts::AlertTarget;
pub use http::HttpConfig;
pub use locate::ConfigError;
pub use scheduling::INFLIGHT_UNCAPPED;
pub use store::RetentionConfig;

use crate::auth::TokenConfig;
use alerts::RawAlert;
use http::RawHttp;
use locate::{Ctx, KeyPath, root};
use ms::Ms;
pub(crate) use ms::millis;
use policies::RawPolicy;
use scheduling::{RawLane, RawTenants};
use sources::RawSource;
use store::RawRetention;
use tokens::RawToken;

/// Default `redrives_max`: redrives of one job before it is held for a person.
pub const REDRIVES_MAX_DEFAULT: u32 = 3;

/// Default cap on a whole batch body (`batch_bytes_max`): 16 MiB.
pub const BATCH_BYTES_MAX_DEFAULT: usize = 16 * 1024 * 1024;

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
    /// A dead letter whose job was redriven this many times or more is
    /// held for a person (`redrives_max`): redrives by filter or group
    /// skip it, a redrive naming its id moves it.
    pub redrives_max: u32,
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
    /// A lease's length when the worker asks for none (`lease_ms_default`).
    pub lease_default: Duration,
    /// The longest lease a worker may ask for (`lease_ms_max`).
    pub lease_max: Duration,
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
            redrives_max: REDRIVES_MAX_DEFAULT,
            surge_min: 20,
            surge_share: 0.8,
            admission_records_per_minute: 60,
            admission_records_all_per_minute: 600,
            durability: Durability::Full,
            lease_default: Duration::from_millis(30_000),
            lease_max: Duration::from_millis(3_600_000),
            sources: Vec::new(),
            http: HttpConfig::default(),
            allowed_hosts: Vec::new(),
            park_lanes: BTreeSet::new(),
            alerts: Vec::new(),
        }
    }
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
pub(super) struct RawConfig {
    payload_bytes_max: Option<usize>,
    batch_bytes_max: Option<usize>,
    accept_unknown_types: Option<bool>,
    dead_letters_warn: Option<u64>,
    redrives_max: Option<u32>,
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

impl Ctx<'_> {
    /// From the raw file to the core's types: the top-level keys, then each
    /// section in turn; the first error found is the one reported.
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
        if let Some(v) = raw.redrives_max {
            if v == 0 {
                return Err(self.invalid(
                    &root("redrives_max"),
                    "redrives_max must be at least 1 (got 0): it is how many redrives a job gets \
                     before it is held for a person; redrives are never automatic, so a large \
                     number means never hold",
                ));
            }
            cfg.redrives_max = v;
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
            cfg.durability = self.durability(d)?;
        }
        if let Some(Ms(v)) = raw.lease_ms_default {
            at_least_1("lease_ms_default", v)?;
            cfg.lease_default = Duration::from_millis(v);
        }
        if let Some(Ms(v)) = raw.lease_ms_max {
            at_least_1("lease_ms_max", v)?;
            cfg.lease_max = Duration::from_millis(v);
        }
        if cfg.lease_default > cfg.lease_max {
            let key = if raw.lease_ms_default.is_some() {
                "lease_ms_default"
            } else {
                "lease_ms_max"
            };
            return Err(self.invalid(
                &root(key),
                format!(
                    "lease_ms_default ({}) is above lease_ms_max ({}); lower the default or raise the maximum",
                    cfg.lease_default.as_millis(),
                    cfg.lease_max.as_millis()
                ),
            ));
        }
        if let Some(r) = &raw.retention {
            self.retention(r, &mut cfg.retention)?;
        }

        if let Some(h) = &raw.http {
            self.http(h, &mut cfg)?;
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
}
