//! lazaret-server's integration tests: the router over a real SQLite store, without sockets.

mod backpressure;
mod browser;
mod openapi;
mod redrive;
mod roles;
mod stats;
