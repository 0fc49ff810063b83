//! lazaret's HTTP server: gateway, leases, dead letters, auth, metrics.
//!
//! A thin shell: handlers parse and answer HTTP, `lazaret-core` decides
//! (admission, scheduling, outcomes, breakers), `lazaret-store` applies.
//! `[[alerts]]` (`alerts.rs`) deliver webhooks from background tasks.
//! `[[sources]]` (`sources.rs`) run `lazaret-guard`'s guards and watches
//! on the same `App`. What it deliberately does not do: decide policy in a
//! handler, or read the wall clock anywhere but `app::now` (the sources'
//! runtime reads its own, `lazaret_guard::guard::now`; `Instant` measures
//! durations in `conn.rs` and `error.rs`).

pub mod alerts;
pub mod api;
pub mod app;
pub mod auth;
pub mod config;
pub mod conn;
pub mod error;
pub mod metrics;
pub mod ready;
pub mod serve;
pub mod sources;
pub mod systemd;
pub mod views;

pub use serve::{ServeError, ServeOptions, serve};
