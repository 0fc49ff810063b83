//! lazaret-store's integration tests, one binary (see STYLE.md §6): the
//! conformance suite (`lazaret-store-conformance`) run against each backend,
//! and what only one backend has.

mod faulty;
mod postgres;
mod simulation;
mod sqlite;
