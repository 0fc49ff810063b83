//! `lazaret bench`: drive a server over loopback HTTP and report throughput.

/// Options of `lazaret bench` (placeholder until the bench lands).
#[derive(Debug, clap::Args)]
pub struct BenchArgs {}

/// Runs the benchmark.
pub fn run(_args: BenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
