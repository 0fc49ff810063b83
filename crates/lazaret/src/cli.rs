//! Client subcommands: talk to a running server over its HTTP API.

/// Client subcommands (placeholder until the CLI lands).
#[derive(Debug, clap::Subcommand)]
pub enum ClientCommand {
    /// Print the server's stats.
    Stats,
}

/// Runs a client subcommand.
pub fn run(_cmd: ClientCommand) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
