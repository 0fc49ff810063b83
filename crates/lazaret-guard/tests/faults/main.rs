//! Broker faults under a running guard (issue 29): for each broker, 10,000
//! messages (10% poison, 10% transient, 80% fine) flow through a guard
//! while the battery kills the guard's connections from the broker's side,
//! pauses the broker (SIGSTOP, longer than the guard's timeouts) and
//! restarts it; after a drain the history checker
//! (`lazaret_testkit::history`) judges the run: nothing lost, nothing
//! dead-lettered twice, nothing acked unhandled, every message handled or
//! quarantined. See docs/reliability.md, "Broker faults under the guard".
//! One more test runs the battery on RabbitMQ with a deliberately broken
//! guard (it acknowledges a poison message before its dead letter, then
//! crashes) and no broker fault, and requires the checker to catch it.
//!
//! These tests stop, pause and restart the machine's shared brokers, so
//! they are their own test binary and run only when `LAZARET_FAULTS=1` is
//! set, one at a time:
//!
//! ```text
//! LAZARET_FAULTS=1 cargo test -p lazaret-guard --test faults -- --test-threads=1
//! ```
//!
//! Without `LAZARET_FAULTS=1` each test says it is skipped and passes, even
//! under `CI=true`: `cargo test --workspace` must not restart a broker
//! under the other broker tests running in parallel, and `.ci/run` runs
//! this binary by itself afterwards with `LAZARET_FAULTS=1`, where a
//! missing broker fails. `LAZARET_FAULTS_MESSAGES` changes the number of
//! messages per broker (10,000 by default).

mod battery;

#[cfg(feature = "kafka")]
mod kafka;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "sqs")]
mod sqs;
