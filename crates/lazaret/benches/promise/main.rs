//! The promise scenarios (issue 15), kept out of the shipped `lazaret`
//! binary: `cargo bench -p lazaret --bench promise -- --scenario lane-flood`
//! (`-- --help` lists the options). Each run starts the `lazaret` binary
//! cargo built beside this bench. See `scenarios.rs` and
//! `docs/benchmarks.md` ("The promise under pressure").

// Without libtest (`harness = false`) a test build of this bench drops the
// modules' `#[test]` functions, leaving their imports unused; those tests
// run in `tests/it`, which includes `scenarios.rs`.
#![cfg_attr(test, allow(unused_imports))]

use std::io::Write as _;

use anyhow::Context as _;
use clap::Parser as _;

mod scenarios;

/// The clients run on one thread, as `lazaret bench`'s do (see its `run`).
fn main() -> anyhow::Result<()> {
    let args = scenarios::Args::parse();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    // The human tables go to stdout, or to stderr when stdout is for --json.
    let mut human: Box<dyn std::io::Write> = if args.json {
        Box::new(std::io::stderr())
    } else {
        Box::new(std::io::stdout())
    };
    let report = rt.block_on(scenarios::run(&args, &mut human))?;
    if args.json {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{}", report.json)?;
        stdout.flush()?;
    }
    report.check(args.scenario)
}
