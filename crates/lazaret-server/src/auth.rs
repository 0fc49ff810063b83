//! Bearer tokens and roles: who may do what.
//!
//! Tokens come from two places: `[[tokens]]` in the config file (fixed for
//! the life of the process) and tokens created through `POST /v1/tokens`,
//! which the store keeps and the server mirrors in an [`ApiTokens`] table,
//! so that authenticating a request never touches the database.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use axum::http::{HeaderMap, StatusCode, header};
use lazaret_store::ApiToken;
use sha2::{Digest, Sha256};

use crate::error::{ApiError, Code};

/// Longest name of a token created through the API, in bytes.
pub const TOKEN_NAME_BYTES_MAX: usize = 64;
/// Random bytes in a token secret created through the API.
const SECRET_BYTES: usize = 32;
/// Prefix of API-created secrets, so secret scanners and people can tell
/// one when they see it.
const SECRET_PREFIX: &str = "lzt_";

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

/// What a request wants to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Enqueue.
    Produce,
    /// Read a job.
    ReadJob,
    /// Lease, ack, fail, heartbeat.
    Work,
    /// Read dead letters, payloads, reasons, audit.
    ReadDeadLetters,
    /// Redrive, pause, resume.
    Operate,
    /// Purge, tokens.
    Administer,
    /// Stats and breakers.
    Observe,
    /// List jobs (a producer sees only its own).
    ListJobs,
    /// Cancel a job (a producer only its own).
    Cancel,
}

impl Action {
    /// Every action, in the order `GET /v1/whoami` lists them.
    pub const ALL: [Action; 9] = [
        Action::Observe,
        Action::Produce,
        Action::ReadJob,
        Action::ListJobs,
        Action::Work,
        Action::ReadDeadLetters,
        Action::Operate,
        Action::Administer,
        Action::Cancel,
    ];

    /// The word `GET /v1/whoami` (and so the dashboard) names it by.
    /// `read_jobs` is one job by id (a worker may); `list_jobs` is
    /// `GET /v1/jobs` (a worker may not).
    pub const fn as_str(self) -> &'static str {
        match self {
            Action::Observe => "observe",
            Action::Produce => "produce",
            Action::ReadJob => "read_jobs",
            Action::ListJobs => "list_jobs",
            Action::Work => "work",
            Action::ReadDeadLetters => "read_dead_letters",
            Action::Operate => "operate",
            Action::Administer => "administer",
            Action::Cancel => "cancel",
        }
    }

    /// Whether `role` may do this.
    pub fn allowed_for(self, role: Role) -> bool {
        matches!(
            (role, self),
            (Role::Admin, _)
                | (_, Action::Observe)
                | (
                    Role::Producer,
                    Action::Produce | Action::ReadJob | Action::ListJobs | Action::Cancel
                )
                | (Role::Worker, Action::Work | Action::ReadJob)
                | (
                    Role::Operator,
                    Action::ReadDeadLetters
                        | Action::Operate
                        | Action::ReadJob
                        | Action::ListJobs
                        | Action::Cancel
                )
        )
    }
}

/// Who is calling.
#[derive(Clone, Debug)]
pub struct Caller {
    /// The token's name, or `anonymous` when no tokens are configured.
    pub name: String,
    /// The role (admin when no tokens are configured: loopback only).
    pub role: Role,
}

impl Caller {
    /// Whether this caller may read a job enqueued by the token named
    /// `enqueued_by` (`None`: enqueued while auth was off). A producer reads
    /// only the jobs it enqueued; every other role reads every job.
    pub fn may_read_job(&self, enqueued_by: Option<&str>) -> bool {
        self.role != Role::Producer || enqueued_by == Some(self.name.as_str())
    }
}

/// The tokens created through the API that are in force now, by the
/// SHA-256 of their secret.
#[derive(Debug, Default)]
pub struct ApiTokens {
    by_hash: HashMap<[u8; 32], TokenConfig>,
}

impl ApiTokens {
    /// Puts a token in force.
    pub fn insert(&mut self, token: TokenConfig) {
        self.by_hash.insert(token.sha256, token);
    }

    /// Takes the token named `name` out of force; whether there was one.
    pub fn remove(&mut self, name: &str) -> bool {
        let before = self.by_hash.len();
        self.by_hash.retain(|_, t| t.name != name);
        self.by_hash.len() != before
    }

    /// The token whose secret hashes to `sha256`.
    pub fn find(&self, sha256: &[u8; 32]) -> Option<&TokenConfig> {
        self.by_hash.get(sha256)
    }

    /// How many are in force.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// Whether none is in force.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

/// A stored API token as the server holds it; `Err` says what is wrong with
/// the stored row.
pub fn api_token_entry(t: &ApiToken) -> Result<TokenConfig, String> {
    let role: Role = t
        .role
        .parse()
        .map_err(|e| format!("stored token {:?}: {e}", t.name))?;
    let mut sha256 = [0u8; 32];
    hex::decode_to_slice(&t.token_sha256, &mut sha256).map_err(|_| {
        format!(
            "stored token {:?}: token_sha256 is not 64 hex digits",
            t.name
        )
    })?;
    Ok(TokenConfig {
        name: t.name.clone(),
        role,
        sha256,
    })
}

/// Checks the name asked for a new API token; `Err` says what to send.
pub fn check_token_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(
            "name is required: send \"name\": \"...\" (it is the actor in the audit log)".into(),
        );
    }
    if name == "." || name == ".." {
        return Err(format!(
            "token name {name:?} is not allowed: it is a path segment of its own in \
             /v1/tokens/{{name}}; use letters or digits as well"
        ));
    }
    if name.len() > TOKEN_NAME_BYTES_MAX
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(format!(
            "token name {name:?} is not allowed: use 1 to {TOKEN_NAME_BYTES_MAX} letters, digits, '-', '_' or '.' \
             (it appears in URLs and in the audit log)"
        ));
    }
    Ok(())
}

/// A new random token secret: `lzt_` and 64 hex digits (256 bits from the
/// operating system's generator).
pub fn new_secret() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; SECRET_BYTES];
    getrandom::fill(&mut bytes)?;
    Ok(format!("{SECRET_PREFIX}{}", hex::encode(bytes)))
}

/// The token of an `Authorization` value of the `Bearer` scheme, trimmed;
/// `None` for another scheme. The scheme is case-insensitive (RFC 7235
/// §2.1): `bearer` and `BEARER` are `Bearer`.
fn bearer_token(value: &str) -> Option<&str> {
    let value = value.trim_start();
    let scheme = value.get(..6)?;
    let rest = &value[6..];
    (scheme.eq_ignore_ascii_case("bearer") && (rest.is_empty() || rest.starts_with([' ', '\t'])))
        .then(|| rest.trim())
}

/// Checks the bearer token against the configured ones and those created
/// through the API. With no configured tokens, auth is off: every caller is
/// `anonymous` and admin (API tokens are then not in force).
pub fn authenticate(
    tokens: &[TokenConfig],
    api: &ApiTokens,
    headers: &HeaderMap,
) -> Result<Caller, ApiError> {
    if tokens.is_empty() {
        return Ok(Caller {
            name: "anonymous".into(),
            role: Role::Admin,
        });
    }
    let unauthorized = |m: &str| ApiError::new(StatusCode::UNAUTHORIZED, Code::Unauthorized, m);
    let value = headers.get(header::AUTHORIZATION).ok_or_else(|| {
        unauthorized("missing Authorization header; send `Authorization: Bearer <token>`")
    })?;
    let text = value
        .to_str()
        .map_err(|_| unauthorized("the Authorization header is not text"))?;
    let token = bearer_token(text)
        .ok_or_else(|| unauthorized("the Authorization header must be `Bearer <token>`"))?;
    if token.is_empty() {
        return Err(unauthorized(
            "the bearer token is empty; send `Authorization: Bearer <token>`",
        ));
    }
    let digest = token_sha256(token);
    tokens
        .iter()
        .find(|t| t.sha256 == digest)
        .or_else(|| api.find(&digest))
        .map(|t| Caller {
            name: t.name.clone(),
            role: t.role,
        })
        .ok_or_else(|| unauthorized("unknown token; ask an admin for a token of the right role"))
}

/// The 403 for a caller whose role may not do `action`.
pub fn forbidden(caller: &Caller, action: Action) -> ApiError {
    ApiError::new(
        StatusCode::FORBIDDEN,
        Code::Forbidden,
        format!(
            "token {:?} has role {}, which may not {:?}; use a token with the right role",
            caller.name,
            caller.role.as_str(),
            action
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_allow_what_the_contract_says() {
        assert!(Action::Produce.allowed_for(Role::Producer));
        assert!(!Action::Work.allowed_for(Role::Producer));
        assert!(!Action::ReadDeadLetters.allowed_for(Role::Producer));
        assert!(Action::Work.allowed_for(Role::Worker));
        assert!(!Action::Operate.allowed_for(Role::Worker));
        assert!(Action::Operate.allowed_for(Role::Operator));
        assert!(!Action::Administer.allowed_for(Role::Operator));
        assert!(Action::Administer.allowed_for(Role::Admin));
    }

    #[test]
    fn every_action_is_listed_once_with_a_word_of_its_own() {
        let words: std::collections::BTreeSet<&str> =
            Action::ALL.iter().map(|a| a.as_str()).collect();
        assert_eq!(words.len(), Action::ALL.len());
        // A new action is a compile error here until it is in ALL.
        for a in Action::ALL {
            match a {
                Action::Produce
                | Action::ReadJob
                | Action::Work
                | Action::ReadDeadLetters
                | Action::Operate
                | Action::Administer
                | Action::Observe
                | Action::ListJobs
                | Action::Cancel => {}
            }
        }
    }

    #[test]
    fn jobs_are_listed_and_cancelled_by_operators_admins_and_their_producers() {
        for action in [Action::ListJobs, Action::Cancel] {
            assert!(
                action.allowed_for(Role::Producer),
                "{action:?}: own jobs only"
            );
            assert!(action.allowed_for(Role::Operator), "{action:?}");
            assert!(action.allowed_for(Role::Admin), "{action:?}");
            assert!(!action.allowed_for(Role::Worker), "{action:?}");
        }
    }

    #[test]
    fn tokens_are_checked_by_hash() {
        let tokens = vec![TokenConfig {
            name: "ops".into(),
            role: Role::Operator,
            sha256: Sha256::digest(b"s3cret").into(),
        }];
        let api = ApiTokens::default();
        let mut h = HeaderMap::new();
        assert_eq!(
            authenticate(&tokens, &api, &h).unwrap_err().code,
            Code::Unauthorized
        );
        h.insert(header::AUTHORIZATION, "Bearer nope".parse().unwrap());
        assert_eq!(
            authenticate(&tokens, &api, &h).unwrap_err().code,
            Code::Unauthorized
        );
        h.insert(header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert_eq!(authenticate(&tokens, &api, &h).unwrap().name, "ops");
    }

    fn bearer(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            format!("Bearer {token}").parse().unwrap(),
        );
        h
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        let tokens = vec![TokenConfig {
            name: "ops".into(),
            role: Role::Operator,
            sha256: Sha256::digest(b"s3cret").into(),
        }];
        let api = ApiTokens::default();
        let with = |value: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, value.parse().unwrap());
            authenticate(&tokens, &api, &h)
        };
        for ok in [
            "Bearer s3cret",
            "bearer s3cret",
            "BEARER s3cret",
            "bEaReR s3cret",
            "Bearer  s3cret ",
            "Bearer\ts3cret",
        ] {
            assert_eq!(
                with(ok).map(|c| c.name).ok().as_deref(),
                Some("ops"),
                "{ok:?}"
            );
        }
        for bad in [
            "Basic s3cret",
            "Bearers3cret",
            "Bearerx s3cret",
            "s3cret",
            "Bear s3cret",
        ] {
            let e = with(bad).unwrap_err();
            assert_eq!(e.code, Code::Unauthorized, "{bad:?}");
        }
        for empty in ["Bearer", "Bearer ", "bearer    ", "Bearer \t "] {
            let e = with(empty).unwrap_err();
            assert_eq!(e.code, Code::Unauthorized, "{empty:?}");
            assert!(e.message.contains("empty"), "{empty:?}: {}", e.message);
        }
    }

    #[test]
    fn api_tokens_authenticate_while_in_force() {
        let config = vec![TokenConfig {
            name: "root".into(),
            role: Role::Admin,
            sha256: Sha256::digest(b"root-secret").into(),
        }];
        let mut api = ApiTokens::default();
        let secret = new_secret().unwrap();
        api.insert(TokenConfig {
            name: "ci".into(),
            role: Role::Producer,
            sha256: Sha256::digest(secret.as_bytes()).into(),
        });
        let caller = authenticate(&config, &api, &bearer(&secret)).unwrap();
        assert_eq!((caller.name.as_str(), caller.role), ("ci", Role::Producer));
        assert!(api.remove("ci"));
        assert!(!api.remove("ci"), "already gone");
        assert_eq!(
            authenticate(&config, &api, &bearer(&secret))
                .unwrap_err()
                .code,
            Code::Unauthorized
        );
    }

    #[test]
    fn with_auth_off_api_tokens_are_not_in_force() {
        let mut api = ApiTokens::default();
        api.insert(TokenConfig {
            name: "ci".into(),
            role: Role::Producer,
            sha256: Sha256::digest(b"s").into(),
        });
        let caller = authenticate(&[], &api, &bearer("s")).unwrap();
        assert_eq!(
            (caller.name.as_str(), caller.role),
            ("anonymous", Role::Admin)
        );
    }

    #[test]
    fn secrets_are_random_prefixed_hex() {
        let a = new_secret().unwrap();
        let b = new_secret().unwrap();
        assert_ne!(a, b);
        let hex = a.strip_prefix("lzt_").expect("the lzt_ prefix");
        assert_eq!(hex.len(), 64);
        assert!(hex.bytes().all(|c| c.is_ascii_hexdigit()), "{a}");
    }

    #[test]
    fn producers_read_only_their_own_jobs() {
        let who = |name: &str, role| Caller {
            name: name.into(),
            role,
        };
        let shop = who("shop", Role::Producer);
        assert!(shop.may_read_job(Some("shop")));
        assert!(!shop.may_read_job(Some("billing")));
        assert!(!shop.may_read_job(None), "enqueued while auth was off");
        for role in [Role::Worker, Role::Operator, Role::Admin] {
            let r = who("x", role);
            assert!(r.may_read_job(Some("shop")) && r.may_read_job(None));
        }
    }

    #[test]
    fn api_token_names_are_url_and_log_safe() {
        for ok in ["ci", "ci-producer.2", "A_b-9"] {
            assert_eq!(check_token_name(ok), Ok(()), "{ok}");
        }
        let long = "x".repeat(TOKEN_NAME_BYTES_MAX + 1);
        for bad in ["", ".", "..", " ", "\t", "a b", "a/b", "é", long.as_str()] {
            assert!(check_token_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn stored_tokens_are_read_back_or_refused_with_a_reason() {
        let stored = ApiToken {
            name: "ci".into(),
            role: "worker".into(),
            token_sha256: hex::encode(Sha256::digest(b"s")),
            created_at: lazaret_core::Timestamp::from_millis(0),
            created_by: "root".into(),
        };
        let entry = api_token_entry(&stored).unwrap();
        assert_eq!(entry.role, Role::Worker);
        assert_eq!(entry.sha256, <[u8; 32]>::from(Sha256::digest(b"s")));
        let bad_role = ApiToken {
            role: "root".into(),
            ..stored.clone()
        };
        assert!(
            api_token_entry(&bad_role)
                .unwrap_err()
                .contains("unknown role")
        );
        let bad_hash = ApiToken {
            token_sha256: "abc".into(),
            ..stored
        };
        assert!(api_token_entry(&bad_hash).unwrap_err().contains("64 hex"));
    }
}
