//! lazaret-guard's integration tests: one binary (ripgrep's layout). The
//! scenarios in `scenarios.rs` run against every broker through the
//! [`common::TestBroker`] each broker's file implements; tests that need a
//! broker read its URL from the environment and say they are skipped
//! without it (under `CI=true` a missing one fails).

mod common;
mod memory;
mod scenarios;

#[cfg(feature = "rabbitmq")]
mod hostile;
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
