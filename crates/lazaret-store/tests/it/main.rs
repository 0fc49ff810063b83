//! lazaret-store's integration tests, one binary (see STYLE.md §6): the
//! backend-independent conformance suite and its instantiation per backend.

mod conformance;
mod sqlite;
