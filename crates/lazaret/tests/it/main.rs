//! lazaret's end-to-end tests: the real server, started as a child process, held to `API-CONTRACT.md`.
//!
//! One binary (STYLE.md §6). Each module is one part of the contract; every
//! test starts its own server (see `harness`).

mod admission;
mod alerts;
mod audit;
mod auth;
mod bench;
mod brokers;
mod browser;
mod celery;
mod charts;
mod cli;
mod cluster;
mod connections;
mod dashboard;
mod data_dir;
mod dead_letters;
mod errors;
mod fairness;
mod fields;
mod full_disk;
mod groups;
mod harness;
mod hostile;
mod hostile_sources;
mod hostile_suite;
mod kafka_sources;
mod kill9;
mod lanes;
mod live_jobs;
mod local_commands;
mod logs;
mod metrics;
mod observing;
mod outcome_next;
mod power_loss;
mod python_worker;
mod restart;
mod retries;
mod running;
mod service;
mod shutdown;
mod smaller;
mod sockets;
mod source_nodes;
mod sources;
#[cfg(feature = "sqs")]
mod sqs_source;
mod team_handler;
mod tokens;
mod traces;
mod web_security;
mod workers;
