//! lazaret's end-to-end tests: the real server, started as a child process, held to `API-CONTRACT.md`.
//!
//! One binary (STYLE.md §6). Each module is one part of the contract; every
//! test starts its own server (see `harness`).

mod admission;
mod auth;
mod bench;
mod celery;
mod data_dir;
mod dead_letters;
mod errors;
mod fairness;
mod harness;
mod hostile;
mod kafka_sources;
mod observing;
mod python_worker;
mod restart;
mod retries;
mod running;
mod smaller;
mod sources;
mod tokens;
mod workers;
