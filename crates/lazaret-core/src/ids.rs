//! Names of things, as newtypes so that a tenant is never passed as a lane.

use std::borrow::Borrow;
use std::fmt;

use serde::{Deserialize, Serialize};

/// A job's id: assigned by the store at admission, kept across redrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct JobId(pub u64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            /// Wraps a name.
            pub fn new(name: impl Into<String>) -> Self {
                $name(name.into())
            }

            /// The name as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> Self {
                $name(s.to_owned())
            }
        }

        impl From<String> for $name {
            fn from(s: String) -> Self {
                $name(s)
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

name_type!(
    /// A tenant: the unit of fairness and of in-flight caps.
    TenantId
);
name_type!(
    /// A lane (`interactive`, `batch`, …): fixed at enqueue, never hops.
    Lane
);
name_type!(
    /// A job type (`send_email`): selects the policy and the schemas.
    JobType
);
name_type!(
    /// A worker's self-chosen id, recorded in the attempt history.
    WorkerId
);
name_type!(
    /// A failure kind (`timeout`, `http_503`, `parse`, …): selects a budget.
    ErrorKind
);

impl Lane {
    /// The lane every job lands in when it names none; it always exists.
    pub fn default_lane() -> Self {
        Lane::new("default")
    }
}

impl ErrorKind {
    /// The kind recorded when a lease expires without ack or fail.
    pub const LEASE_EXPIRED: &'static str = "lease_expired";

    /// The kind of a lease expiry.
    pub fn lease_expired() -> Self {
        ErrorKind::new(Self::LEASE_EXPIRED)
    }
}

/// Longest job type, tenant, lane, worker id or error kind, in bytes. These
/// names travel on every job, land in every attempt record of its history
/// and in indexes, so a client must not be able to make them arbitrarily
/// large.
pub const NAME_BYTES_MAX: usize = 128;

/// Longest idempotency key, in bytes: room for a URL or two hashes.
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 256;

/// Why a client-chosen name (a type, tenant, lane, worker id, error kind,
/// idempotency key, token name) was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// Longer than its limit.
    #[error("{field} is {len} bytes; it may be at most {max} bytes")]
    TooLong {
        /// The field, as the API names it (`worker_id`, `error.kind`, …).
        field: String,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Holds a control character (NUL, newline, tab, DEL, …), which would
    /// break logs, metric labels and terminals that show it.
    #[error(
        "{field} holds the control character {found:?} at byte {at}; it may hold at most {max} bytes and no control characters"
    )]
    ControlCharacter {
        /// The field, as the API names it.
        field: String,
        /// The character found.
        found: char,
        /// Its byte offset.
        at: usize,
        /// The field's length limit (named in the message, so one refusal
        /// tells the whole rule).
        max: usize,
    },
}

/// Checks a client-chosen name: at most `max` bytes and no control
/// character (Unicode category Cc: C0, DEL and C1). An empty name is the
/// caller's to judge (some fields have a default, some are required).
pub fn check_name(field: &str, value: &str, max: usize) -> Result<(), NameError> {
    if value.len() > max {
        return Err(NameError::TooLong {
            field: field.to_owned(),
            len: value.len(),
            max,
        });
    }
    if let Some((at, found)) = value.char_indices().find(|(_, c)| c.is_control()) {
        return Err(NameError::ControlCharacter {
            field: field.to_owned(),
            found,
            at,
            max,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_bounded_and_free_of_control_characters() {
        assert_eq!(check_name("tenant", "acme-é", NAME_BYTES_MAX), Ok(()));
        assert_eq!(check_name("tenant", "", NAME_BYTES_MAX), Ok(()));
        let at_max = "x".repeat(NAME_BYTES_MAX);
        assert_eq!(check_name("lane", &at_max, NAME_BYTES_MAX), Ok(()));
        let e = check_name("lane", &format!("{at_max}y"), NAME_BYTES_MAX).unwrap_err();
        assert_eq!(
            e.to_string(),
            "lane is 129 bytes; it may be at most 128 bytes"
        );
        for bad in ["a\0b", "a\nb", "a\tb", "a\u{7f}b", "a\u{85}b"] {
            let e = check_name("worker_id", bad, NAME_BYTES_MAX).unwrap_err();
            assert!(
                matches!(e, NameError::ControlCharacter { at: 1, .. }),
                "{bad:?}: {e}"
            );
            assert!(e.to_string().contains("worker_id"), "{e}");
            assert!(e.to_string().contains("128 bytes"), "{e}");
        }
    }
}
