//! Runs each [`Request`] with the writer's function of its name (in the
//! file named for its concern), generated from the table of requests
//! ([`with_requests`](crate::request::with_requests)), and the writer's
//! own commands.
//!
//! A SQLite request function takes its arguments by value: the writer owns
//! the request.

use super::*;

impl Writer {
    /// Runs one command; returns its held-back answer and whether it succeeded.
    pub(super) fn execute(&mut self, cmd: Cmd) -> (Pending, bool) {
        macro_rules! run {
            ($tx:expr, $e:expr) => {{
                let r = $e;
                let ok = r.is_ok();
                (pend($tx, r), ok)
            }};
        }
        match cmd {
            Cmd::Request(r) => self.run_request(r),
            Cmd::Close(tx) => run!(tx, Ok(())),
            #[cfg(test)]
            Cmd::Sql(sql, gate, tx) => {
                let _ = gate.recv();
                run!(tx, db(self.conn.execute_batch(&sql)))
            }
            #[cfg(any(test, feature = "test-hooks"))]
            Cmd::Hold(held, resume) => {
                let _ = held.send(());
                let _ = resume.recv();
                (Box::new(|_: Option<StoreError>| {}), true)
            }
            #[cfg(any(test, feature = "test-hooks"))]
            Cmd::Crash => panic!("the writer crashed (a test hook)"),
        }
    }
}

/// `Writer::run_request` from the table: one arm a request, calling the
/// writer's function of the request's name.
macro_rules! run_requests {
    ($(
        $(#[$doc:meta])*
        $how:ident $variant:ident: $method:ident($($arg:ident: $ty:ty),* $(,)?) -> $answer:ty;
    )*) => {
        impl Writer {
            /// Runs one request; returns its held-back answer and whether
            /// it succeeded.
            fn run_request(&mut self, r: Request) -> (Pending, bool) {
                match r {
                    $(Request::$variant { $($arg,)* reply } => {
                        let r = self.$method($($arg),*);
                        let ok = r.is_ok();
                        (pend(reply, r), ok)
                    })*
                }
            }
        }
    };
}
crate::request::with_requests!(run_requests);
