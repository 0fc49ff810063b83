//! Runs each [`Request`] with the writer's function of its name (in the
//! file named for its concern), generated from the table of requests
//! ([`with_requests`](crate::request::with_requests)).
//!
//! A PostgreSQL request function takes its arguments by reference (a group
//! runs its requests by reference, and may run them again one by one), a
//! `Copy` one as a pattern (`&now: &Timestamp`), and reads times on the
//! group's clock with [`Writer::now_of`] and [`Writer::rebase`].

use super::*;

/// `Writer::run_request` from the table: one arm a request, calling the
/// writer's function of the request's name.
macro_rules! run_requests {
    ($(
        $(#[$doc:meta])*
        $how:ident $variant:ident: $method:ident($($arg:ident: $ty:ty),* $(,)?) -> $answer:ty;
    )*) => {
        impl Writer {
            /// Runs one request of the group; its answer is held until the
            /// group commits.
            pub(super) async fn run_request<'a>(
                &mut self,
                op: &'a Request,
            ) -> Result<Held<'a>, StoreError> {
                Ok(match op {
                    $(Request::$variant { $($arg,)* reply } => {
                        held(reply, self.$method($($arg),*).await?)
                    })*
                })
            }
        }
    };
}
crate::request::with_requests!(run_requests);

impl Writer {
    /// `now`, a caller's time, on the group's clock.
    pub(super) fn now_of(&self, now: Timestamp) -> Timestamp {
        self.group.db_now.unwrap_or(now)
    }

    /// A caller's time `t`, given at the caller's `now`, on the group's
    /// clock: the same distance from now.
    pub(super) fn rebase(&self, t: Timestamp, now: Timestamp) -> Timestamp {
        rebase(self.group.db_now, t, now)
    }
}
