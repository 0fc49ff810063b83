//! Client subcommands: talk to a running server over its HTTP API, through
//! `lazaret_client::Client` (the workspace's one HTTP client, with TLS).
//!
//! `args` is what clap parses and the request bodies it turns into,
//! `errors` the client set-up, the error messages and the exit status,
//! `render` the readable output, `table` the column layout. This file wires
//! them: one current-thread runtime per command, replies to stdout, errors
//! to stderr as `error: …`.
//!
//! Exit status (`errors::ExitCode`, docs/api.md#cli): 0 done; 1 the server
//! answered with an error, or the command did not do all it was asked (a
//! redrive or purge naming ids that match nothing, or dead letters a broker
//! did not take back); 2 the command line was wrong or the command was refused
//! before anything changed (an empty redrive or purge selection, a purge
//! without `--confirm`, a payload that is not JSON, an unreadable
//! `--ca-cert`; clap's usage errors exit
//! 2 too); 3 the server could not be reached (refused, no such host, TLS
//! handshake failed).

mod args;
mod errors;
mod render;
mod table;

use std::fs::File;
use std::io::{self, BufWriter, IsTerminal, Read, Write};

use anyhow::{Context, anyhow};
use serde_json::Value;

pub use args::{ClientCommand, GlobalOpts};
use args::{
    DlqArchiveArgs, DlqCommand, DlqLsArgs, DlqPayloadArgs, DlqPurgeArgs, DlqRedriveArgs,
    EnqueueArgs, JobsCommand, PurgeBody, RedirectTo, RedriveBody, Selection, TokensCommand,
};
use errors::{Cli, ExitCode, Refused, Reply, ServerError};

use crate::progress::Progress;

/// Page size used to count what a purge would delete.
const PURGE_COUNT_PAGE: &str = "500";
/// Dead letters listed before "… and N more" when a purge is not confirmed.
const PURGE_SHOWN_MAX: usize = 20;

type Out<'a> = &'a mut dyn Write;

/// Runs a client subcommand; on failure prints `error: …` and exits with
/// the status documented above.
pub fn run(global: GlobalOpts, cmd: ClientCommand) -> anyhow::Result<()> {
    let json = global.json;
    let stdout = io::stdout();
    let mut out = stdout.lock();
    let result = errors::client(&global)
        .map_err(anyhow::Error::new)
        .and_then(|cli| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("cannot start the async runtime")?;
            rt.block_on(execute(cmd, &cli, json, &mut out, width()))
        })
        .and_then(|()| out.flush().map_err(Into::into));
    let code = match result {
        Ok(()) => ExitCode::Ok,
        // `lazaret dlq ls | head`: the reader left, which is not a failure.
        Err(err) if is_broken_pipe(&err) => ExitCode::Ok,
        Err(err) => {
            if json {
                if let Some(body) = err.downcast_ref::<ServerError>().map(|e| &e.body) {
                    let _ = write_raw(&mut out, body).and_then(|()| out.flush());
                }
            }
            eprintln!("error: {err:#}");
            errors::exit_code(&err)
        }
    };
    if code != ExitCode::Ok {
        std::process::exit(code as i32);
    }
    Ok(())
}

fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain()
        .filter_map(|e| e.downcast_ref::<io::Error>())
        .any(|e| e.kind() == io::ErrorKind::BrokenPipe)
}

/// Terminal width from `COLUMNS` when the shell exports it; tables are
/// otherwise only bounded per column.
fn width() -> Option<usize> {
    std::env::var("COLUMNS")
        .ok()?
        .trim()
        .parse()
        .ok()
        .filter(|w| *w >= 40)
}

async fn execute(
    cmd: ClientCommand,
    cli: &Cli,
    json: bool,
    out: Out<'_>,
    width: Option<usize>,
) -> anyhow::Result<()> {
    match cmd {
        ClientCommand::Enqueue(a) => enqueue(cli, &a, json, out).await,
        ClientCommand::Jobs { command } => match command {
            JobsCommand::Ls(a) => {
                let query = a.query();
                let reply = cli.get(&["v1", "jobs"], &pairs(&query)).await?;
                emit(out, json, &reply, |o, v| render::jobs(o, v, width))
            }
            JobsCommand::Show(a) => {
                let reply = cli.get(&["v1", "jobs", &a.id], &[]).await?;
                emit(out, json, &reply, |o, v| render::job(o, v, width))
            }
            JobsCommand::Cancel(a) => {
                let reply = cli
                    .post(&["v1", "jobs", &a.id, "cancel"], &serde_json::json!({}))
                    .await?;
                emit(out, json, &reply, |o, v| render::cancelled(o, v, &a.id))
            }
        },
        ClientCommand::Stats => {
            let reply = cli.get(&["v1", "stats"], &[]).await?;
            emit(out, json, &reply, |o, v| render::stats(o, v, width))
        }
        ClientCommand::Pause(a) => {
            let reply = cli.post(&["v1", "pause"], &a).await?;
            emit(out, json, &reply, |o, _| {
                writeln!(
                    o,
                    "paused {}: its jobs stay queued and are not leased until `lazaret resume`",
                    a.target()
                )
            })
        }
        ClientCommand::Resume(a) => {
            let reply = cli.post(&["v1", "resume"], &a).await?;
            emit(out, json, &reply, |o, _| {
                writeln!(o, "resumed {}", a.target())
            })
        }
        ClientCommand::Breakers => {
            let reply = cli.get(&["v1", "breakers"], &[]).await?;
            emit(out, json, &reply, |o, v| render::breakers(o, v, width))
        }
        ClientCommand::Audit(a) => {
            let query = a.query();
            let reply = cli.get(&["v1", "audit"], &pairs(&query)).await?;
            emit(out, json, &reply, |o, v| render::audit(o, v, width))
        }
        ClientCommand::Dlq { command } => match command {
            DlqCommand::Ls(a) => dlq_ls(cli, &a, json, out, width).await,
            DlqCommand::Report(a) if a.follow => follow_report(cli, &a.id, json, out).await,
            DlqCommand::Report(a) => {
                let reply = cli.get(&["v1", "redrives", &a.id], &[]).await?;
                emit(out, json, &reply, render::redrive_report)
            }
            DlqCommand::Show(a) => {
                let reply = cli.get(&["v1", "dead-letters", &a.id], &[]).await?;
                emit(out, json, &reply, |o, v| render::dead_letter(o, v, width))
            }
            DlqCommand::Payload(a) => dlq_payload(cli, &a, out).await,
            DlqCommand::Reasons => {
                let reply = cli.get(&["v1", "dead-letters", "reasons"], &[]).await?;
                emit(out, json, &reply, |o, v| render::reasons(o, v, width))
            }
            DlqCommand::Redrive(a) => dlq_redrive(cli, &a, json, out).await,
            DlqCommand::Purge(a) => dlq_purge(cli, &a, json, out, width).await,
            DlqCommand::Groups(a) => {
                let limit = a.limit.map(|l| l.to_string());
                let mut query: Vec<(&str, &str)> = [
                    ("type", &a.job_type),
                    ("reason", &a.reason),
                    ("source", &a.source),
                    ("tenant", &a.tenant),
                    ("since", &a.since),
                    ("limit", &limit),
                    ("cursor", &a.cursor),
                ]
                .into_iter()
                .filter_map(|(k, v)| v.as_deref().map(|v| (k, v)))
                .collect();
                if a.archived {
                    query.push(("archived", "true"));
                }
                let reply = cli.get(&["v1", "dead-letters", "groups"], &query).await?;
                emit(out, json, &reply, |o, v| render::groups(o, v, width))
            }
            DlqCommand::Archive(a) => dlq_archive(cli, &a, "archive", json, out).await,
            DlqCommand::Restore(a) => dlq_archive(cli, &a, "restore", json, out).await,
            DlqCommand::Correct(a) => {
                let payload = read_payload(a.payload.as_deref(), a.payload_file.as_deref())?;
                let body = args::CorrectBody {
                    payload: &payload,
                    reason: &a.reason,
                    schema_version: a.schema_version,
                };
                let reply = cli
                    .post(&["v1", "dead-letters", &a.id, "redrive"], &body)
                    .await?;
                emit(out, json, &reply, render::corrected)
            }
        },
        ClientCommand::Tokens { command } => match command {
            TokensCommand::Ls => {
                let reply = cli.get(&["v1", "tokens"], &[]).await?;
                emit(out, json, &reply, |o, v| render::tokens(o, v, width))
            }
            TokensCommand::Create(a) => {
                let reply = cli.post(&["v1", "tokens"], &a).await?;
                emit(out, json, &reply, render::token_created)
            }
            TokensCommand::Revoke(a) => {
                let reply = cli.delete(&["v1", "tokens", &a.name]).await?;
                emit(out, json, &reply, render::token_revoked)
            }
        },
    }
}

/// Borrows owned query pairs for the client.
fn pairs<'a>(query: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    query.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// Prints a reply: as is with `--json`, else through its renderer.
fn emit(
    out: Out,
    json: bool,
    reply: &Reply,
    human: impl FnOnce(Out, &Value) -> io::Result<()>,
) -> anyhow::Result<()> {
    if json {
        write_raw(out, reply.raw())?;
    } else {
        human(out, &reply.json::<Value>()?)?;
    }
    Ok(())
}

fn write_raw(out: Out, body: &[u8]) -> io::Result<()> {
    out.write_all(body)?;
    if !body.ends_with(b"\n") {
        out.write_all(b"\n")?;
    }
    Ok(())
}

async fn enqueue(client: &Cli, a: &EnqueueArgs, json: bool, out: Out<'_>) -> anyhow::Result<()> {
    let payload = read_payload(a.payload.as_deref(), a.payload_file.as_deref())?;
    let reply = client.post(&["v1", "jobs"], &a.body(&payload)).await?;
    emit(out, json, &reply, render::enqueued)
}

/// A payload from `--payload`, `--payload-file` or stdin, checked to be
/// one JSON value before anything is sent (else refused: exit 2).
fn read_payload(
    payload: Option<&str>,
    file: Option<&std::path::Path>,
) -> anyhow::Result<Box<serde_json::value::RawValue>> {
    let (text, from) = match (payload, file) {
        (Some(p), _) => (p.to_owned(), "--payload".to_owned()),
        (None, Some(path)) => (
            std::fs::read_to_string(path).map_err(|e| {
                Refused(format!(
                    "cannot read the payload file {}: {e}",
                    path.display()
                ))
            })?,
            path.display().to_string(),
        ),
        (None, None) => {
            let mut stdin = io::stdin().lock();
            if stdin.is_terminal() {
                eprintln!("reading the payload from stdin (end with Ctrl-D; or use --payload)");
            }
            let mut text = String::new();
            stdin
                .read_to_string(&mut text)
                .context("cannot read the payload from stdin")?;
            (text, "stdin".to_owned())
        }
    };
    EnqueueArgs::parse_payload(text, &from).map_err(|e| Refused(format!("{e:#}")).into())
}

async fn dlq_ls(
    client: &Cli,
    a: &DlqLsArgs,
    json: bool,
    out: Out<'_>,
    width: Option<usize>,
) -> anyhow::Result<()> {
    let limit = a.limit.map(|l| l.to_string());
    let mut query = a.filter.pairs();
    if let Some(job_id) = &a.job_id {
        query.push(("job_id", job_id));
    }
    if let Some(limit) = &limit {
        query.push(("limit", limit));
    }
    if let Some(cursor) = &a.cursor {
        query.push(("cursor", cursor));
    }
    let reply = client.get(&["v1", "dead-letters"], &query).await?;
    emit(out, json, &reply, |o, v| render::dead_letters(o, v, width))
}

/// Streams the payload chunk by chunk: a 50 MB payload is never held whole.
async fn dlq_payload(client: &Cli, a: &DlqPayloadArgs, out: Out<'_>) -> anyhow::Result<()> {
    let mut resp = client
        .stream(&["v1", "dead-letters", &a.id, "payload"])
        .await?;
    let Some(path) = &a.output else {
        copy_body(&mut resp, out).await?;
        return Ok(());
    };
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut file = BufWriter::new(file);
    let copied = match copy_body(&mut resp, &mut file).await {
        Ok(n) => file.flush().map(|()| n).map_err(Into::into),
        Err(e) => Err(e),
    };
    match copied {
        Ok(n) => {
            eprintln!("wrote {n} bytes to {}", path.display());
            Ok(())
        }
        Err(e) => {
            // A cut-off payload must not pass for the real one.
            drop(file);
            let _ = std::fs::remove_file(path);
            Err(e.context(format!(
                "{} removed: the payload did not arrive whole",
                path.display()
            )))
        }
    }
}

async fn copy_body(
    resp: &mut lazaret_client::BodyStream,
    out: &mut dyn Write,
) -> anyhow::Result<u64> {
    let mut n = 0u64;
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| anyhow!("the payload stream broke off: {e}"))?
    {
        out.write_all(&chunk)?;
        n += chunk.len() as u64;
    }
    Ok(n)
}

async fn dlq_redrive(
    client: &Cli,
    a: &DlqRedriveArgs,
    json: bool,
    out: Out<'_>,
) -> anyhow::Result<()> {
    let selection = a
        .select
        .selection("redrive")
        .map_err(|e| Refused(e.to_string()))?;
    let to = (a.to_type.is_some() || a.to_lane.is_some()).then_some(RedirectTo {
        job_type: a.to_type.as_deref(),
        lane: a.to_lane.as_deref(),
    });
    let body = RedriveBody {
        selection: &selection,
        dry_run: a.dry_run,
        rate_per_sec: a.rate,
        to,
    };
    let reply = {
        let _spinner = Progress::spinner(
            json,
            if a.dry_run {
                "matching the dead letters a redrive would move"
            } else {
                "redriving"
            },
        );
        client
            .post(&["v1", "dead-letters", "redrive"], &body)
            .await?
    };
    emit(out, json, &reply, |o, v| render::redriven(o, v, a.dry_run))?;
    let v: Value = reply.json()?;
    // Ids that match nothing redrivable: a typo, or already redriven or
    // purged. Scripts must see that the command did not do what it named.
    let missing = render::redrive_not_found(&v);
    if !missing.is_empty() {
        return Err(anyhow!(
            "{} id(s) match no dead letter that can be redriven: {}; {}check them with \
             `lazaret dlq show ID` (an id already redriven or purged is gone; an admission \
             record cannot be redriven)",
            missing.len(),
            table::clean_line(&missing.join(", ")),
            if a.dry_run {
                ""
            } else {
                "the others were redriven; "
            }
        ));
    }
    // A broker that did not confirm leaves its dead letters in place: the
    // command did not do all it was asked, and scripts must see that.
    let refused = render::items(&v, "refused").len();
    if refused > 0 && !a.dry_run {
        return Err(anyhow!(
            "{refused} job(s) were refused by the admission of the type they were sent to and \
             stay in the dead letters; the reason is given for each (--json: `refused`); \
             correct their payloads (`lazaret dlq correct`) or send them elsewhere"
        ));
    }
    let failed = render::redrive_failures(&v);
    if failed > 0 {
        return Err(anyhow!(
            "{failed} dead letter(s) were not redriven and stay in the dead letters; \
             the reason is given for each (--json: `error`); run the redrive again once it is fixed"
        ));
    }
    if a.follow {
        if let Some(id) = v.get("redrive_id").and_then(Value::as_str) {
            follow_report(client, id, json, out).await?;
        }
    }
    Ok(())
}

/// How often `--follow` reads a redrive's report.
const FOLLOW_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// `dlq report --follow` (and `dlq redrive --follow`): reads the redrive's
/// report until none of what it sent is running, a bar of the finished
/// (succeeded, failed again, cancelled, gone) on a terminal, then prints
/// the report as `dlq report` does.
async fn follow_report(client: &Cli, id: &str, json: bool, out: Out<'_>) -> anyhow::Result<()> {
    let bar = Progress::bar(json, 0, format!("redrive {id}"));
    loop {
        let reply = client.get(&["v1", "redrives", id], &[]).await?;
        let v: Value = reply.json()?;
        let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
        let (sent, running) = (n("sent"), n("running"));
        bar.set(
            sent.saturating_sub(running),
            sent,
            format!(
                "redrive {id}: {} succeeded, {} failed again, {running} running",
                n("succeeded"),
                n("failed_again")
            ),
        );
        if running == 0 {
            drop(bar);
            return emit(out, json, &reply, render::redrive_report);
        }
        tokio::time::sleep(FOLLOW_EVERY).await;
    }
}

/// `dlq archive` / `dlq restore`: the same body as a redrive.
async fn dlq_archive(
    client: &Cli,
    a: &DlqArchiveArgs,
    verb: &str,
    json: bool,
    out: Out<'_>,
) -> anyhow::Result<()> {
    let selection = a
        .select
        .selection(verb)
        .map_err(|e| Refused(e.to_string()))?;
    let body = RedriveBody {
        selection: &selection,
        dry_run: a.dry_run,
        rate_per_sec: a.rate,
        to: None,
    };
    let reply = client.post(&["v1", "dead-letters", verb], &body).await?;
    let done = if verb == "archive" {
        "archived"
    } else {
        "restored"
    };
    emit(out, json, &reply, |o, v| render::archived(o, v, done))?;
    let v: Value = reply.json()?;
    let missing = render::redrive_not_found(&v);
    if !missing.is_empty() {
        return Err(anyhow!(
            "{} id(s) match no dead letter that could be {done}: {}; check them with \
             `lazaret dlq show ID` (it may be {done} already, or gone)",
            missing.len(),
            table::clean_line(&missing.join(", ")),
        ));
    }
    Ok(())
}

async fn dlq_purge(
    client: &Cli,
    a: &DlqPurgeArgs,
    json: bool,
    out: Out<'_>,
    width: Option<usize>,
) -> anyhow::Result<()> {
    let selection = a
        .select
        .selection("purge")
        .map_err(|e| Refused(e.to_string()))?;
    if a.confirm {
        let body = PurgeBody {
            selection: &selection,
            confirm: true,
        };
        let reply = {
            let _spinner = Progress::spinner(json, "purging");
            client.post(&["v1", "dead-letters", "purge"], &body).await?
        };
        emit(out, json, &reply, render::purged)?;
        let v: Value = reply.json()?;
        // Ids that matched nothing: a typo, or already redriven or purged.
        // As with redrive, scripts must see that the command did not do
        // all it named.
        let missing = render::redrive_not_found(&v);
        if let (Selection::Ids(ids), None) = (&selection, v.get("not_found")) {
            // An older server does not name them: say how many.
            let purged = v.get("purged").and_then(Value::as_u64).unwrap_or(0);
            let unmatched = (ids.len() as u64).saturating_sub(purged);
            if unmatched > 0 {
                return Err(anyhow!(
                    "{unmatched} of the {} id(s) given match no dead letter (this server does not \
                     say which); the others were purged; check them with `lazaret dlq show ID`",
                    ids.len()
                ));
            }
        }
        if !missing.is_empty() {
            return Err(anyhow!(
                "{} id(s) match no dead letter: {}; the others were purged; check them with \
                 `lazaret dlq show ID` (an id already redriven or purged is gone)",
                missing.len(),
                table::clean_line(&missing.join(", ")),
            ));
        }
        return Ok(());
    }

    let preview = purge_preview(client, &selection).await?;
    if !json {
        writeln!(
            out,
            "would purge {} dead letter(s) matching {selection}",
            preview.count
        )?;
        if !preview.sample.is_empty() {
            render::dead_letters_sample(out, &preview.sample, width)?;
        }
        if preview.count > preview.sample.len() as u64 {
            writeln!(
                out,
                "… and {} more",
                preview.count - preview.sample.len() as u64
            )?;
        }
        if !preview.missing.is_empty() {
            writeln!(out, "not found: {}", preview.missing.join(", "))?;
        }
    }
    Err(Refused(if preview.count == 0 {
        "nothing was purged: no dead letter matches".to_owned()
    } else {
        "nothing was purged: add --confirm to purge them (needs an admin token)".to_owned()
    })
    .into())
}

/// What a purge would delete: a count, the first few, and ids that do not exist.
#[derive(Debug, Default)]
struct PurgePreview {
    count: u64,
    sample: Vec<Value>,
    missing: Vec<String>,
}

async fn purge_preview(client: &Cli, selection: &Selection) -> anyhow::Result<PurgePreview> {
    let mut preview = PurgePreview::default();
    match selection {
        Selection::Ids(ids) => {
            for id in ids {
                match client.get(&["v1", "dead-letters", id], &[]).await {
                    Ok(reply) => {
                        preview.count += 1;
                        if preview.sample.len() < PURGE_SHOWN_MAX {
                            preview.sample.push(reply.json()?);
                        }
                    }
                    Err(e) if is_not_found(&e) => preview.missing.push(id.clone()),
                    Err(e) => return Err(e),
                }
            }
        }
        Selection::Filter(filter) => {
            let mut cursor: Option<String> = None;
            loop {
                let mut query = filter.pairs();
                query.push(("limit", PURGE_COUNT_PAGE));
                if let Some(c) = &cursor {
                    query.push(("cursor", c));
                }
                let page: Value = client.get(&["v1", "dead-letters"], &query).await?.json()?;
                let items = page.get("items").and_then(Value::as_array);
                for item in items.into_iter().flatten() {
                    preview.count += 1;
                    if preview.sample.len() < PURGE_SHOWN_MAX {
                        preview.sample.push(item.clone());
                    }
                }
                let next = page
                    .get("next_cursor")
                    .and_then(Value::as_str)
                    .map(str::to_owned);
                // A cursor that does not move would loop for ever.
                if next.is_none() || next == cursor {
                    break;
                }
                cursor = next;
            }
        }
    }
    Ok(preview)
}

fn is_not_found(err: &anyhow::Error) -> bool {
    err.downcast_ref::<ServerError>()
        .is_some_and(|e| e.code.as_deref() == Some("NOT_FOUND"))
}

#[cfg(test)]
mod tests;
