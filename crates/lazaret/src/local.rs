//! Commands that need no server: `config check`, `completions`, `man`.
//!
//! `config check` runs the checks `serve` runs on a config file before it
//! opens the store, and nothing else (no store, no port, no broker), so an
//! operator can check a file before a restart. Completions and the man page
//! are generated from the same clap command the binary parses, so they
//! never lag behind a flag.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::Context as _;

/// `lazaret config …`
#[derive(Debug, clap::Subcommand)]
pub enum ConfigCommand {
    /// Parse and check a config file as `serve --config FILE` would: prints
    /// `FILE: OK` and exits 0, or the error (file, line and key) on stderr
    /// and exits 1.
    Check {
        /// The TOML file; schema paths in it are relative to it.
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
}

/// `lazaret completions SHELL`
#[derive(Debug, clap::Args)]
pub struct CompletionsArgs {
    /// The shell: bash, zsh, fish, elvish or powershell.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

/// `lazaret man [--dir DIR]`
#[derive(Debug, clap::Args)]
pub struct ManArgs {
    /// Write `lazaret.1` and a page per subcommand (`lazaret-serve.1`, …)
    /// into this directory instead of printing `lazaret.1`.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

/// `lazaret config check FILE`: 0 and `FILE: OK`, or 1 and the error.
#[allow(clippy::print_stdout, clippy::print_stderr)] // the verdict is the output
pub fn config(cmd: ConfigCommand) -> anyhow::Result<()> {
    let ConfigCommand::Check { file } = cmd;
    match check(&file) {
        Ok(summary) => {
            println!("{}: OK ({summary})", file.display());
            Ok(())
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1)
        }
    }
}

/// What `serve` checks before it opens the store: the file itself
/// (`ServerConfig::load`) and the scheduler built from it.
fn check(file: &std::path::Path) -> Result<String, String> {
    let cfg = lazaret_server::config::ServerConfig::load(file).map_err(|e| e.to_string())?;
    // The words of `serve`'s ServeError::Scheduler.
    lazaret_core::FairScheduler::new(cfg.scheduler.clone())
        .map_err(|e| format!("invalid scheduler configuration: {e}"))?;
    let n = |count: usize, one: &str, many: &str| {
        format!("{count} {}", if count == 1 { one } else { many })
    };
    Ok([
        n(cfg.policies.types.len(), "type", "types"),
        n(cfg.scheduler.lane_weights.len(), "lane", "lanes"),
        n(cfg.tokens.len(), "token", "tokens"),
        n(cfg.sources.len(), "source", "sources"),
        n(cfg.alerts.len(), "alert target", "alert targets"),
    ]
    .join(", "))
}

/// `lazaret completions SHELL`: the script on stdout.
pub fn completions(args: CompletionsArgs, mut cmd: clap::Command) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    clap_complete::generate(args.shell, &mut cmd, "lazaret", &mut out);
    out.flush()
        .context("cannot write the completion script to stdout")
}

/// `lazaret man`: `lazaret.1` on stdout, or every page into `--dir`.
#[allow(clippy::print_stdout)] // the files written are the output
pub fn man(args: ManArgs, cmd: clap::Command) -> anyhow::Result<()> {
    match args.dir {
        Some(dir) => {
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            clap_mangen::generate_to(cmd, &dir)
                .with_context(|| format!("cannot write the man pages into {}", dir.display()))?;
            println!("man pages written to {}", dir.display());
            Ok(())
        }
        None => {
            let mut out = std::io::stdout().lock();
            clap_mangen::Man::new(cmd)
                .render(&mut out)
                .context("cannot write the man page to stdout")?;
            out.flush().context("cannot write the man page to stdout")
        }
    }
}
