//! The `code` of an API error body (the contract's error table): one enum
//! that the server answers with and the client reads.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The `code` of an API error body. The server answers only the named
/// codes; a client keeps a word it does not know as [`ErrorCode::Other`]
/// (the contract may add codes).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorCode {
    /// Payload refused at the door (`reason` says why).
    Poison,
    /// Tenant missing or empty.
    NoTenant,
    /// Job type not configured.
    UnknownType,
    /// Breaker open or type/lane paused; comes with a `Retry-After`.
    Shed,
    /// Ack/fail/heartbeat with a lease token that is no longer the job's.
    LeaseLost,
    /// No such job or dead letter.
    NotFound,
    /// Missing or unknown token.
    Unauthorized,
    /// The token's role may not do this.
    Forbidden,
    /// Anything else malformed.
    BadRequest,
    /// The request clashes with what exists (a token name already in use).
    Conflict,
    /// The job's state does not allow it (cancelling a finished job).
    BadState,
    /// The server failed.
    Internal,
    /// The server is shutting down, or its store cannot take the request now.
    Unavailable,
    /// A new tenant's job, with as many tenants holding jobs ready as
    /// `[tenants] ready_max` allows.
    TooManyTenants,
    /// A code this build does not know (a newer server's); never answered
    /// by this server.
    Other(String),
}

impl ErrorCode {
    /// Every code the server answers: the contract's table, and those added since.
    pub const KNOWN: [ErrorCode; 14] = [
        ErrorCode::Poison,
        ErrorCode::NoTenant,
        ErrorCode::UnknownType,
        ErrorCode::Shed,
        ErrorCode::LeaseLost,
        ErrorCode::NotFound,
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::BadRequest,
        ErrorCode::Conflict,
        ErrorCode::BadState,
        ErrorCode::Internal,
        ErrorCode::Unavailable,
        ErrorCode::TooManyTenants,
    ];

    /// The word in the body.
    pub fn as_str(&self) -> &str {
        match self {
            ErrorCode::Other(word) => word,
            known => known.word().unwrap_or_default(),
        }
    }

    /// The word of a named code, for labels that must live as long as the
    /// program (metrics); `None` for [`ErrorCode::Other`].
    pub const fn word(&self) -> Option<&'static str> {
        Some(match self {
            ErrorCode::Poison => "POISON",
            ErrorCode::NoTenant => "NO_TENANT",
            ErrorCode::UnknownType => "UNKNOWN_TYPE",
            ErrorCode::Shed => "SHED",
            ErrorCode::LeaseLost => "LEASE_LOST",
            ErrorCode::NotFound => "NOT_FOUND",
            ErrorCode::Unauthorized => "UNAUTHORIZED",
            ErrorCode::Forbidden => "FORBIDDEN",
            ErrorCode::BadRequest => "BAD_REQUEST",
            ErrorCode::Conflict => "CONFLICT",
            ErrorCode::BadState => "BAD_STATE",
            ErrorCode::Internal => "INTERNAL",
            ErrorCode::Unavailable => "UNAVAILABLE",
            ErrorCode::TooManyTenants => "TOO_MANY_TENANTS",
            ErrorCode::Other(_) => return None,
        })
    }

    /// Reads a code word; an unknown word is kept as [`ErrorCode::Other`].
    pub fn parse(s: &str) -> Self {
        ErrorCode::KNOWN
            .into_iter()
            .find(|c| c.word() == Some(s))
            .unwrap_or_else(|| ErrorCode::Other(s.to_owned()))
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(ErrorCode::parse(&String::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_code_round_trips_and_other_words_are_kept() {
        for c in ErrorCode::KNOWN {
            let word = c.word().expect("a named code has a word");
            assert_eq!(c.as_str(), word);
            assert_eq!(ErrorCode::parse(word), c);
            assert_eq!(serde_json::to_value(&c).unwrap(), serde_json::json!(word));
            assert_eq!(
                serde_json::from_value::<ErrorCode>(serde_json::json!(word)).unwrap(),
                c
            );
            // Words are upper-case with underscores, as the contract writes them.
            assert!(word.bytes().all(|b| b.is_ascii_uppercase() || b == b'_'));
        }
        let new = ErrorCode::parse("NEW_ONE");
        assert_eq!(new, ErrorCode::Other("NEW_ONE".into()));
        assert_eq!((new.as_str(), new.word()), ("NEW_ONE", None));
        assert_eq!(
            ErrorCode::parse("poison"),
            ErrorCode::Other("poison".into())
        );
    }
}
