//! The `lazaret` binary: thin glue over the libraries; `anyhow` lives only here.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// mimalloc: malloc and free were a sixth of the store's writer thread in
/// profiles under load with the system allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod bench;
mod cli;
mod local;
#[cfg(feature = "otlp")]
mod otlp;
mod progress;

/// lazaret: a job queue where one bad message never stalls the line.
#[derive(Debug, Parser)]
#[command(name = "lazaret", version, about)]
struct Args {
    /// `--server`, `--token`, `--ca-cert`, `--json`: accepted anywhere on
    /// the line, before or after the subcommand.
    #[command(flatten)]
    global: cli::GlobalOpts,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the server (embedded SQLite by default).
    Serve(ServeArgs),
    /// Bring a PostgreSQL store's schema up to this build's version (`serve`
    /// does it too, at start), for operators who run migrations themselves.
    Migrate(MigrateArgs),
    /// Drive a server over loopback HTTP and print jobs/s and latency percentiles.
    Bench(bench::BenchArgs),
    /// Work with a config file without a server: `config check FILE`.
    Config {
        #[command(subcommand)]
        command: local::ConfigCommand,
    },
    /// Print a shell's completion script for lazaret to stdout.
    Completions(local::CompletionsArgs),
    /// Print lazaret's man page (roff) to stdout, or write one page per
    /// command into a directory with --dir.
    Man(local::ManArgs),
    #[command(flatten)]
    Client(cli::ClientCommand),
}

/// Options of `lazaret serve`.
#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Address to listen on; port 0 picks a free one (printed at start).
    #[arg(long, env = "LAZARET_LISTEN", default_value = "127.0.0.1:7433")]
    listen: SocketAddr,
    /// Directory of the embedded database.
    #[arg(long, env = "LAZARET_DATA", default_value = "./lazaret-data")]
    data: PathBuf,
    /// A store URL instead of --data: `sqlite:///path/to/dir`, or
    /// `postgres://USER@HOST:PORT/DB[?schema=NAME]` for several nodes on one
    /// database (docs/deploy.md).
    #[arg(long, env = "LAZARET_STORE")]
    store: Option<String>,
    /// TOML configuration file (see docs/api.md); `lazaret config check
    /// FILE` checks one without starting the server.
    #[arg(long, env = "LAZARET_CONFIG")]
    config: Option<PathBuf>,
    /// The log's format on stderr: `text` (coloured only on a terminal,
    /// never with NO_COLOR) or `json` (one object per line). LAZARET_LOG
    /// (else RUST_LOG) filters, default `info`.
    #[arg(long, env = "LAZARET_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// `lazaret serve --log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human lines: time, level, target, message, `key=value` fields.
    Text,
    /// One JSON object per line, `timestamp`, `level`, `target`, `message`
    /// and the event's fields at the top level, the spans under `span`/`spans`.
    Json,
}

/// Options of `lazaret migrate`.
#[derive(Debug, clap::Args)]
struct MigrateArgs {
    /// The PostgreSQL store: `postgres://USER@HOST:PORT/DB[?schema=NAME]`.
    #[arg(long, env = "LAZARET_STORE")]
    store: String,
}

fn main() -> anyhow::Result<()> {
    let matches = Args::command().get_matches();
    let args = Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    match args.command {
        Command::Serve(serve) => {
            if let Some(Err(e)) = matches
                .subcommand_matches("serve")
                .map(refuse_client_options)
            {
                e.exit();
            }
            // Says which fail points LAZARET_FAILPOINTS armed (a build
            // without them, as a release build, says it ignores it).
            lazaret_guard::failpoint::announce();
            run_serve(serve)
        }
        Command::Migrate(m) => run_migrate(m),
        Command::Bench(b) => bench::run(b, args.global),
        Command::Config { command } => local::config(command),
        Command::Completions(c) => local::completions(c, Args::command()),
        Command::Man(m) => local::man(m, Args::command()),
        Command::Client(c) => cli::run(args.global, c),
    }
}

/// `serve --server …` is a mistake (the address to listen on is
/// `--listen`): say so rather than ignore it. The environment (an
/// operator's LAZARET_TOKEN) is not a mistake and is ignored.
fn refuse_client_options(matches: &clap::ArgMatches) -> Result<(), clap::Error> {
    for (id, flag) in [
        ("server", "--server"),
        ("token", "--token"),
        ("ca_cert", "--ca-cert"),
        ("json", "--json"),
    ] {
        if matches.value_source(id) == Some(ValueSource::CommandLine) {
            return Err(Args::command().error(
                clap::error::ErrorKind::ArgumentConflict,
                format!(
                    "{flag} is an option of the client commands, not of `serve` \
                     (serve listens on --listen ADDR; tokens go in the config file)"
                ),
            ));
        }
    }
    Ok(())
}

/// `lazaret serve`: logs go to stderr so that stdout's first line stays the
/// `lazaret listening on http://ADDR` that scripts read.
fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    let (filter, filter_problem) = log_filter()?;
    let format = args.log_format;
    // Held to the end of `serve`: dropping it flushes the spans batched.
    let _export = init_log(format, filter)?;
    if let Some(problem) = filter_problem {
        tracing::warn!("{problem}");
    }
    match serve(args) {
        // A shipper reading JSON lines gets the fatal error as one too,
        // not as main's `Error: …` text.
        Err(e) if format == LogFormat::Json => {
            tracing::error!("{e:#}");
            std::process::exit(1)
        }
        other => other,
    }
}

/// The log filter: `LAZARET_LOG`, else `RUST_LOG`, else `info`. A bad
/// `LAZARET_LOG` is refused (it was set for lazaret); a bad `RUST_LOG`,
/// often set for other programs, falls back to `info` with a warning
/// (returned, to log once the log is up).
fn log_filter() -> anyhow::Result<(tracing_subscriber::EnvFilter, Option<String>)> {
    use tracing_subscriber::EnvFilter;

    let parse = |text: &str| EnvFilter::builder().parse(text);
    if let Some(text) = std::env::var("LAZARET_LOG")
        .ok()
        .filter(|t| !t.trim().is_empty())
    {
        let filter = parse(&text).map_err(|e| {
            anyhow::anyhow!(
                "LAZARET_LOG={text:?} is not a log filter ({e}): give a level (error, warn, info, \
                 debug, trace) or target=level pairs, e.g. `info,lazaret_server=debug`"
            )
        })?;
        return Ok((filter, None));
    }
    if let Some(text) = std::env::var("RUST_LOG")
        .ok()
        .filter(|t| !t.trim().is_empty())
    {
        return Ok(match parse(&text) {
            Ok(filter) => (filter, None),
            Err(e) => (
                EnvFilter::new("info"),
                Some(format!(
                    "RUST_LOG={text:?} is not a log filter ({e}); logging at info \
                     (set LAZARET_LOG to choose lazaret's filter)"
                )),
            ),
        });
    }
    Ok((EnvFilter::new("info"), None))
}

/// Sets up the log on stderr in `format`. Text is coloured only when
/// stderr is a terminal and `NO_COLOR` is not set (to any value): on a
/// file or a pipe, colour codes are noise a log shipper must strip.
///
/// With the `otlp` feature, spans are also exported when the `OTEL_*`
/// environment asks for it (`otlp.rs`, its own filter); the returned value
/// flushes that export when dropped.
fn init_log(format: LogFormat, filter: tracing_subscriber::EnvFilter) -> anyhow::Result<Export> {
    use std::io::IsTerminal as _;
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;

    #[cfg(feature = "otlp")]
    let (otel, export) = match otlp::layer::<tracing_subscriber::Registry>()? {
        Some((layer, export)) => (Some(layer), Some(export)),
        None => (None, None),
    };
    #[cfg(not(feature = "otlp"))]
    let (otel, export): (Option<tracing_subscriber::layer::Identity>, Export) = (None, None);
    let registry = tracing_subscriber::registry().with(otel);
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    match format {
        LogFormat::Text => {
            let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
            registry
                .with(fmt.with_ansi(colour).with_filter(filter))
                .init();
        }
        LogFormat::Json => registry
            .with(
                fmt.with_ansi(false)
                    .json()
                    .flatten_event(true)
                    .with_current_span(true)
                    .with_span_list(true)
                    .with_filter(filter),
            )
            .init(),
    }
    Ok(export)
}

/// What `init_log` set up that must live as long as the server: the span
/// export (`otlp` feature), if on.
#[cfg(feature = "otlp")]
type Export = Option<otlp::Export>;
#[cfg(not(feature = "otlp"))]
type Export = Option<std::convert::Infallible>;

/// `lazaret serve` once the log is up.
fn serve(args: ServeArgs) -> anyhow::Result<()> {
    use anyhow::Context as _;

    let config = match &args.config {
        Some(path) => lazaret_server::config::ServerConfig::load(path)?,
        None => lazaret_server::config::ServerConfig::default(),
    };
    let (data, postgres) = match args.store.as_deref() {
        None => (args.data, None),
        Some(url) => match url.strip_prefix("sqlite://") {
            Some(dir) => (PathBuf::from(dir), None),
            None if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
                (args.data, Some(url.to_owned()))
            }
            None => anyhow::bail!(
                "--store {url:?} names no store this build knows: use sqlite:///path/to/dir or postgres://USER@HOST:PORT/DB"
            ),
        },
    };
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    // The store's writer thread keeps a core busy under load: leave it one.
    // On two cores a second HTTP worker only competes with the writer (the
    // unbatched bench made x1.13 with one, see docs/benchmarks.md).
    // TOKIO_WORKER_THREADS still overrides.
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        builder.worker_threads(cores.saturating_sub(1).max(1));
    }
    let runtime = builder
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(lazaret_server::serve(lazaret_server::ServeOptions {
        listen: args.listen,
        data,
        postgres,
        config,
    }))?;
    Ok(())
}

/// `lazaret migrate --store postgres://…`: runs the migrations and says
/// what it found.
#[allow(clippy::print_stdout)] // the report is the command's output
fn run_migrate(args: MigrateArgs) -> anyhow::Result<()> {
    use anyhow::Context as _;

    if !(args.store.starts_with("postgres://") || args.store.starts_with("postgresql://")) {
        anyhow::bail!(
            "lazaret migrate is for a PostgreSQL store (--store postgres://USER@HOST:PORT/DB); \
             a SQLite store migrates itself when `lazaret serve` opens it"
        );
    }
    let opts = lazaret_store::PgOptions::from_url(&args.store)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let before = {
        let _spinner =
            crate::progress::Progress::spinner(false, format!("migrating schema {}", opts.schema));
        runtime.block_on(lazaret_store::postgres::migrate(&opts))?
    };
    let now = lazaret_store::postgres::SCHEMA_VERSION;
    if before == now {
        println!("schema {}: at version {now}, nothing to do", opts.schema);
    } else {
        println!(
            "schema {}: migrated from version {before} to {now}",
            opts.schema
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(args: &[&str]) -> clap::ArgMatches {
        Args::command()
            .try_get_matches_from(std::iter::once("lazaret").chain(args.iter().copied()))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    #[test]
    fn the_command_line_is_consistent() {
        Args::command().debug_assert();
    }

    #[test]
    fn global_options_reach_bench_and_the_client_commands_from_either_side() {
        for line in [
            &["--json", "--server", "http://h:1", "bench", "--jobs", "5"][..],
            &["bench", "--jobs", "5", "--server", "http://h:1", "--json"],
        ] {
            let args = Args::from_arg_matches(&matches(line)).unwrap();
            assert!(matches!(args.command, Command::Bench(_)), "{line:?}");
            assert_eq!(args.global.server.as_deref(), Some("http://h:1"));
            assert!(args.global.json);
        }
        let args = Args::from_arg_matches(&matches(&["--json", "stats"])).unwrap();
        assert!(matches!(
            args.command,
            Command::Client(cli::ClientCommand::Stats)
        ));
        assert!(args.global.json);
    }

    #[test]
    fn serve_refuses_client_options_on_its_line_but_not_from_the_environment() {
        let m = matches(&["serve", "--server", "http://h:1"]);
        let err = refuse_client_options(m.subcommand_matches("serve").unwrap()).unwrap_err();
        assert!(err.to_string().contains("--listen"), "{err}");
        let m = matches(&["--json", "serve"]);
        assert!(refuse_client_options(m.subcommand_matches("serve").unwrap()).is_err());
        let m = matches(&["serve", "--listen", "127.0.0.1:0"]);
        assert!(refuse_client_options(m.subcommand_matches("serve").unwrap()).is_ok());
    }

    /// A unit file or a container sets the environment, not the command
    /// line: every option of `serve` (not the client's globals, which
    /// `serve` refuses) has a LAZARET_* variable.
    #[test]
    fn every_serve_option_has_an_environment_variable() {
        let cmd = Args::command();
        let serve = cmd.find_subcommand("serve").unwrap();
        let mut seen = Vec::new();
        for arg in serve.get_arguments() {
            if arg.is_global_set() || ["help", "version"].contains(&arg.get_id().as_str()) {
                continue;
            }
            let env = arg
                .get_env()
                .unwrap_or_else(|| panic!("serve --{} has no environment variable", arg.get_id()));
            assert!(env.to_string_lossy().starts_with("LAZARET_"), "{env:?}");
            seen.push(env.to_string_lossy().into_owned());
        }
        seen.sort();
        assert_eq!(
            seen,
            [
                "LAZARET_CONFIG",
                "LAZARET_DATA",
                "LAZARET_LISTEN",
                "LAZARET_LOG_FORMAT",
                "LAZARET_STORE"
            ]
        );
    }

    #[test]
    fn serve_takes_a_log_format() {
        let args = Args::from_arg_matches(&matches(&["serve", "--log-format", "json"])).unwrap();
        let Command::Serve(serve) = args.command else {
            panic!("serve: {:?}", args.command)
        };
        assert_eq!(serve.log_format, LogFormat::Json);
        let err = Args::command()
            .try_get_matches_from(["lazaret", "serve", "--log-format", "xml"])
            .unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::InvalidValue, "{err}");
    }
}
