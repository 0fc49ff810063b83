//! The `lazaret` binary: thin glue over the libraries; `anyhow` lives only here.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

mod bench;
mod cli;

/// lazaret: a job queue where one bad message never stalls the line.
#[derive(Debug, Parser)]
#[command(name = "lazaret", version, about)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the server (embedded SQLite by default).
    Serve(ServeArgs),
    /// Drive a server over loopback HTTP and print jobs/s and latency percentiles.
    Bench(bench::BenchArgs),
    #[command(flatten)]
    Client(cli::ClientCommand),
}

/// Options of `lazaret serve`.
#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Address to listen on; port 0 picks a free one (printed at start).
    #[arg(long, default_value = "127.0.0.1:7433")]
    listen: SocketAddr,
    /// Directory of the embedded database.
    #[arg(long, default_value = "./lazaret-data")]
    data: PathBuf,
    /// A store URL instead of --data (`sqlite:///path/to/dir`).
    #[arg(long)]
    store: Option<String>,
    /// TOML configuration file (see docs/api.md).
    #[arg(long)]
    config: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    match args.command {
        Command::Serve(_serve) => anyhow::bail!("serve is not wired yet"),
        Command::Bench(b) => bench::run(b),
        Command::Client(c) => cli::run(c),
    }
}
