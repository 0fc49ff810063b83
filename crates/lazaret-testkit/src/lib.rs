//! What every test suite of the workspace shares: one way to skip a test
//! that needs something this machine may not have (a broker, PostgreSQL,
//! a browser, a built binary, an interpreter).
//!
//! A skip says so on stderr, past the test harness's capture, so a passing
//! run shows it; under `CI=true` it is a failure instead, since `.ci/run`
//! provides everything and a test that silently did nothing there would
//! be a lie. Every skip site in the workspace goes through [`skip`].
//!
//! [`history`] is the recorder and checker the fault batteries judge a
//! run with: what clients did and saw, checked after a drain for lost,
//! unexpected and duplicated deliveries and the rest of Jepsen's
//! vocabulary.
//!
//! A test that waits for something to happen waits on a signal with
//! [`eventually`], not for a fixed time: a state polled until it holds,
//! within a deadline generous enough for a loaded machine. A test that
//! asserts something did *not* happen first waits for proof that the
//! system went past the point where it would have (a later message
//! handled, a gate that looked and refused), then asserts.

pub mod faults;
pub mod history;

use std::future::Future;
use std::io::Write;
use std::time::{Duration, Instant};

/// Whether this run is CI's (`CI=true`), where nothing may be skipped.
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Skips `test` because of `why` (what is missing and how to provide it):
/// says `SKIPPED test: why` on stderr and returns, so the caller returns
/// too. Under `CI=true` it panics with the same words instead.
pub fn skip(test: &str, why: &str) {
    assert!(
        !under_ci(),
        "under CI=true this test must run: {test}: {why}"
    );
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// The value of the environment variable `var` that points `test` at a
/// service, or `None` after [`skip`]ping it (`how` says what to set it to,
/// e.g. `"redis://127.0.0.1:6379"`).
pub fn service(var: &str, how: &str, test: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Some(v),
        _ => {
            skip(
                test,
                &format!("set {var} ({how}) to run it against the real service"),
            );
            None
        }
    }
}

/// How long [`eventually`] waits before it fails the test.
pub const EVENTUALLY_WITHIN: Duration = Duration::from_secs(20);

/// Polls `check` until it holds; panics naming `what` when it has not
/// within [`EVENTUALLY_WITHIN`]. No timing is asserted: the deadline only
/// bounds a test that would otherwise hang.
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + EVENTUALLY_WITHIN;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "{what}: not within {EVENTUALLY_WITHIN:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_variable_is_the_service() {
        // PATH is set wherever tests run.
        assert!(service("PATH", "a path", "t").is_some());
    }

    #[test]
    fn a_missing_service_is_a_skip_or_under_ci_a_failure() {
        let r =
            std::panic::catch_unwind(|| service("LAZARET_TESTKIT_SURELY_UNSET", "anything", "t"));
        if under_ci() {
            assert!(r.is_err(), "CI=true: a skip fails the test");
        } else {
            assert_eq!(r.ok(), Some(None), "skipped, with a message");
        }
    }
}
