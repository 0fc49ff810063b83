//! lazaret-core's integration tests, one binary (see STYLE.md §6).

mod decide;
mod sim;
mod tidy;
