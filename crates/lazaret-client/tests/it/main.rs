//! Integration tests of the client and the worker runtime against a real
//! `lazaret serve` started per test (one binary, as STYLE.md §6 asks).

mod audit;
mod crash;
mod heartbeats;
mod jobs;
mod next;
mod panics;
mod parse;
mod shutdown;
mod support;
mod traces;
