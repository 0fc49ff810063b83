//! Bearer tokens and roles: who may do what.

use axum::http::{HeaderMap, StatusCode, header};
use sha2::{Digest, Sha256};

use crate::config::{Role, TokenConfig};
use crate::error::{ApiError, Code};

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
}

impl Action {
    /// Whether `role` may do this.
    pub fn allowed_for(self, role: Role) -> bool {
        matches!(
            (role, self),
            (Role::Admin, _)
                | (_, Action::Observe)
                | (Role::Producer, Action::Produce | Action::ReadJob)
                | (Role::Worker, Action::Work | Action::ReadJob)
                | (
                    Role::Operator,
                    Action::ReadDeadLetters | Action::Operate | Action::ReadJob
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

/// Checks the bearer token against the configured ones.
pub fn authenticate(tokens: &[TokenConfig], headers: &HeaderMap) -> Result<Caller, ApiError> {
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
    let token = text
        .strip_prefix("Bearer ")
        .ok_or_else(|| unauthorized("the Authorization header must be `Bearer <token>`"))?
        .trim();
    let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
    tokens
        .iter()
        .find(|t| t.sha256 == digest)
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
    fn tokens_are_checked_by_hash() {
        let tokens = vec![TokenConfig {
            name: "ops".into(),
            role: Role::Operator,
            sha256: Sha256::digest(b"s3cret").into(),
        }];
        let mut h = HeaderMap::new();
        assert_eq!(
            authenticate(&tokens, &h).unwrap_err().code,
            Code::Unauthorized
        );
        h.insert(header::AUTHORIZATION, "Bearer nope".parse().unwrap());
        assert_eq!(
            authenticate(&tokens, &h).unwrap_err().code,
            Code::Unauthorized
        );
        h.insert(header::AUTHORIZATION, "Bearer s3cret".parse().unwrap());
        assert_eq!(authenticate(&tokens, &h).unwrap().name, "ops");
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
}
