//! Placeholder of the configuration (replaced by the full TOML loader).

use std::collections::BTreeMap;
use std::path::Path;

use lazaret_core::{AdmissionConfig, BreakerConfig, JobType, Policies, SchedulerConfig};

/// Roles a token can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Enqueue, read jobs.
    Producer,
    /// Lease, ack, fail, heartbeat.
    Worker,
    /// Dead letters, redrive, pause.
    Operator,
    /// Everything.
    Admin,
}

impl Role {
    /// The word.
    pub const fn as_str(self) -> &'static str {
        match self {
            Role::Producer => "producer",
            Role::Worker => "worker",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

/// A configured token.
#[derive(Clone, Debug)]
pub struct TokenConfig {
    /// Name (the audit actor).
    pub name: String,
    /// Role.
    pub role: Role,
    /// SHA-256 of the secret.
    pub sha256: [u8; 32],
}

/// Durability.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// Survives power loss.
    #[default]
    Full,
    /// Survives a process crash.
    Normal,
}

/// Retention.
#[derive(Clone, Debug)]
pub struct RetentionConfig {
    /// Keep succeeded jobs this long.
    pub succeeded_ms: u64,
    /// Rows per cleaner batch.
    pub cleaner_batch: u32,
    /// Pause between cleaner runs.
    pub cleaner_interval_ms: u64,
}

/// The server's configuration.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Payload cap.
    pub payload_bytes_max: usize,
    /// Batch body cap.
    pub batch_bytes_max: usize,
    /// Accept unknown types.
    pub accept_unknown_types: bool,
    /// Scheduler.
    pub scheduler: SchedulerConfig,
    /// Policies.
    pub policies: Policies,
    /// Admission.
    pub admission: AdmissionConfig,
    /// Default breaker.
    pub breaker_default: Option<BreakerConfig>,
    /// Breakers per type.
    pub breakers: BTreeMap<JobType, BreakerConfig>,
    /// Tokens.
    pub tokens: Vec<TokenConfig>,
    /// Retention.
    pub retention: RetentionConfig,
    /// Dead letters warning size.
    pub dead_letters_warn: u64,
    /// Admission records per tenant per minute.
    pub admission_records_per_minute: u32,
    /// Durability.
    pub durability: Durability,
    /// Default lease.
    pub lease_ms_default: u64,
    /// Longest lease.
    pub lease_ms_max: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            payload_bytes_max: 262_144,
            batch_bytes_max: 16 * 1024 * 1024,
            accept_unknown_types: true,
            scheduler: SchedulerConfig::new(2),
            policies: Policies::default(),
            admission: AdmissionConfig::default(),
            breaker_default: None,
            breakers: BTreeMap::new(),
            tokens: Vec::new(),
            retention: RetentionConfig {
                succeeded_ms: 86_400_000,
                cleaner_batch: 500,
                cleaner_interval_ms: 1000,
            },
            dead_letters_warn: 100_000,
            admission_records_per_minute: 60,
            durability: Durability::Full,
            lease_ms_default: 30_000,
            lease_ms_max: 3_600_000,
        }
    }
}

/// A configuration error.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(String);

impl ServerConfig {
    /// Loads a file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Err(ConfigError(format!(
            "cannot load {}: config files are not supported yet",
            path.display()
        )))
    }
}
