//! lazaret's HTTP server: gateway, leases, dead letters, auth, metrics.

pub mod config;
