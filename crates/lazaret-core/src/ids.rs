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
