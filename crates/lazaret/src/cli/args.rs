//! The client subcommands as clap sees them, and the request bodies they send.
//!
//! Body building lives next to the arguments so a test can check "these
//! flags send this JSON" without a server.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::builder::NonEmptyStringValueParser;
use lazaret_server::auth::Role;
use serde::Serialize;
use serde_json::value::RawValue;

/// The default server: the address `lazaret serve` listens on.
pub const SERVER_DEFAULT: &str = "http://127.0.0.1:7433";

/// Options every command takes, before or after the subcommand
/// (`global`): where the server is, the token, how to print answers.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct GlobalOpts {
    /// Base URL of the lazaret server, http:// or https://; for client
    /// commands LAZARET_SERVER, else http://127.0.0.1:7433. (`bench`
    /// starts a server of its own unless given --server.)
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        value_name = "URL"
    )]
    pub server: Option<String>,
    /// Bearer token sent as `Authorization: Bearer`. Prefer the
    /// environment variable: a flag shows in `ps` and shell history.
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "LAZARET_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub token: Option<String>,
    /// Also trust the CA certificate(s) in this PEM file for an https://
    /// server (a private CA, or a self-signed certificate).
    #[arg(
        long,
        global = true,
        help_heading = "Global options",
        env = "LAZARET_CA_CERT",
        value_name = "FILE"
    )]
    pub ca_cert: Option<PathBuf>,
    /// Print the server's JSON reply as is (for scripts).
    #[arg(long, global = true, help_heading = "Global options")]
    pub json: bool,
}

impl GlobalOpts {
    /// The server a client command talks to: --server, LAZARET_SERVER, or
    /// the default.
    pub fn server_url(&self) -> String {
        self.server
            .clone()
            .or_else(|| {
                std::env::var("LAZARET_SERVER")
                    .ok()
                    .filter(|s| !s.trim().is_empty())
            })
            .unwrap_or_else(|| SERVER_DEFAULT.to_owned())
    }
}

/// Client subcommands: talk to a running server over its HTTP API.
#[derive(Debug, clap::Subcommand)]
pub enum ClientCommand {
    /// Enqueue one job (POST /v1/jobs); the payload is sent byte for byte.
    Enqueue(EnqueueArgs),
    /// List, show and cancel jobs.
    Jobs {
        #[command(subcommand)]
        command: JobsCommand,
    },
    /// Inspect, redrive and purge dead letters.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// Stop leasing a job type or a lane (POST /v1/pause; operator).
    Pause(PauseArgs),
    /// Lease a paused type or lane again (POST /v1/resume; operator).
    Resume(PauseArgs),
    /// Show the circuit breakers that are open or half-open (GET /v1/breakers).
    Breakers,
    /// Read the audit log, newest first, a page at a time (GET /v1/audit).
    Audit(AuditArgs),
    /// Print the server's stats (GET /v1/stats).
    Stats,
    /// Manage API tokens (admin): list, create, revoke (/v1/tokens).
    Tokens {
        #[command(subcommand)]
        command: TokensCommand,
    },
}

/// `lazaret pause|resume (--type T | --lane L)`
#[derive(Debug, Clone, PartialEq, Eq, clap::Args, Serialize)]
#[group(required = true, multiple = false)]
pub struct PauseArgs {
    /// A job type: none of its jobs is leased while it is paused.
    #[arg(long = "type", value_name = "TYPE", value_parser = NonEmptyStringValueParser::new())]
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub job_type: Option<String>,
    /// A lane: none of its jobs is leased while it is paused.
    #[arg(long, value_name = "LANE", value_parser = NonEmptyStringValueParser::new())]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lane: Option<String>,
}

impl PauseArgs {
    /// `type send_email` or `lane batch`, for messages.
    pub fn target(&self) -> String {
        match (&self.job_type, &self.lane) {
            (Some(t), _) => format!("type {t}"),
            (None, Some(l)) => format!("lane {l}"),
            (None, None) => "nothing".to_owned(),
        }
    }
}

/// The actions the audit log records (`GET /v1/audit?action=`).
pub const AUDIT_ACTIONS: [&str; 10] = [
    "redrive",
    "purge",
    "archive",
    "restore",
    "pause",
    "resume",
    "token_create",
    "token_revoke",
    "denied",
    "cancel",
];

/// `lazaret audit`
#[derive(Debug, Clone, clap::Args)]
pub struct AuditArgs {
    /// Only this action.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(AUDIT_ACTIONS))]
    pub action: Option<String>,
    /// Only this actor (a token's name).
    #[arg(long, value_name = "NAME", value_parser = NonEmptyStringValueParser::new())]
    pub actor: Option<String>,
    /// At most this many entries in the page (1 to 1000; the server's default is 100).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub limit: Option<u32>,
    /// Continue after a previous page (its "next cursor").
    #[arg(long, value_name = "C")]
    pub cursor: Option<String>,
}

impl AuditArgs {
    /// The query of `GET /v1/audit`, in a fixed order.
    pub fn query(&self) -> Vec<(&'static str, String)> {
        [
            ("action", self.action.clone()),
            ("actor", self.actor.clone()),
            ("limit", self.limit.map(|l| l.to_string())),
            ("cursor", self.cursor.clone()),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k, v)))
        .collect()
    }
}

/// The job states, as the API writes them (`GET /v1/jobs?state=`).
pub const JOB_STATES: [&str; 6] = [
    "queued",
    "scheduled",
    "leased",
    "succeeded",
    "dead_lettered",
    "cancelled",
];

/// `lazaret jobs ls`
#[derive(Debug, Clone, clap::Args)]
pub struct JobsLsArgs {
    /// Only jobs in this state.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(JOB_STATES))]
    pub state: Option<String>,
    /// Only this job type.
    #[arg(long = "type", value_name = "TYPE", value_parser = NonEmptyStringValueParser::new())]
    pub job_type: Option<String>,
    /// Only this tenant.
    #[arg(long, value_parser = NonEmptyStringValueParser::new())]
    pub tenant: Option<String>,
    /// Only this lane.
    #[arg(long, value_parser = NonEmptyStringValueParser::new())]
    pub lane: Option<String>,
    /// At most this many jobs in the page.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub limit: Option<u32>,
    /// Continue after a previous page (its "next cursor").
    #[arg(long, value_name = "C")]
    pub cursor: Option<String>,
}

impl JobsLsArgs {
    /// The query of `GET /v1/jobs`, in the contract's order.
    pub fn query(&self) -> Vec<(&'static str, String)> {
        [
            ("state", self.state.clone()),
            ("type", self.job_type.clone()),
            ("tenant", self.tenant.clone()),
            ("lane", self.lane.clone()),
            ("limit", self.limit.map(|l| l.to_string())),
            ("cursor", self.cursor.clone()),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k, v)))
        .collect()
    }
}

/// `lazaret tokens …`
#[derive(Debug, clap::Subcommand)]
pub enum TokensCommand {
    /// List tokens, from the config and created through the API, never
    /// their secrets (GET /v1/tokens).
    #[command(visible_alias = "list")]
    Ls,
    /// Create a token and print its secret, shown this once (POST /v1/tokens).
    Create(TokenCreateArgs),
    /// Revoke a token created through the API (DELETE /v1/tokens/{name}).
    Revoke(TokenRevokeArgs),
}

/// `tokens create NAME --role ROLE`
#[derive(Debug, clap::Args, Serialize)]
pub struct TokenCreateArgs {
    /// Its name: the actor in the audit log.
    pub name: String,
    /// What it may do.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(Role::ALL.map(Role::as_str)))]
    pub role: String,
}

/// `tokens revoke NAME`
#[derive(Debug, clap::Args)]
pub struct TokenRevokeArgs {
    pub name: String,
}

/// `lazaret jobs …`
#[derive(Debug, clap::Subcommand)]
pub enum JobsCommand {
    /// List jobs, newest first, a page at a time (GET /v1/jobs; operator).
    #[command(visible_alias = "list")]
    Ls(JobsLsArgs),
    /// Show one job and its history (GET /v1/jobs/{id}).
    Show(ShowArgs),
    /// Cancel a job: a queued or scheduled one at once, a leased one at its
    /// outcome (POST /v1/jobs/{id}/cancel).
    Cancel(ShowArgs),
}

/// `lazaret dlq …`
#[derive(Debug, clap::Subcommand)]
pub enum DlqCommand {
    /// List dead letters, a page at a time (GET /v1/dead-letters).
    #[command(visible_alias = "list")]
    Ls(DlqLsArgs),
    /// Show one dead letter: error, history, payload preview.
    Show(ShowArgs),
    /// Write a dead letter's original payload to stdout or a file, streamed.
    Payload(DlqPayloadArgs),
    /// Count dead letters by reason and type.
    Reasons,
    /// Put dead letters back in their queue with a fresh attempt budget
    /// (a broker message: republished to its broker).
    Redrive(DlqRedriveArgs),
    /// Delete dead letters for good (admin); needs --confirm.
    Purge(DlqPurgeArgs),
    /// Failure groups: dead letters whose errors differ only by data,
    /// newest first (GET /v1/dead-letters/groups).
    Groups(DlqGroupsArgs),
    /// Archive dead letters: kept, hidden from lists, groups and alerts,
    /// restorable (POST /v1/dead-letters/archive).
    Archive(DlqArchiveArgs),
    /// Restore archived dead letters (POST /v1/dead-letters/restore).
    Restore(DlqArchiveArgs),
    /// What a redrive did so far: sent, succeeded, running, failed again
    /// and the groups they fell into (GET /v1/redrives/{id}); the id is in
    /// the redrive's answer.
    Report(DlqReportArgs),
    /// Redrive one dead letter with a corrected payload; the original stays
    /// in the job's history and the edit is audited with its reason
    /// (POST /v1/dead-letters/{id}/redrive).
    Correct(DlqCorrectArgs),
}

/// `lazaret enqueue`
#[derive(Debug, clap::Args)]
pub struct EnqueueArgs {
    /// Job type, e.g. send_email.
    #[arg(value_name = "TYPE")]
    pub job_type: String,
    /// Tenant the job belongs to (the unit of fairness).
    #[arg(long)]
    pub tenant: String,
    /// Lane to queue in (the server's default lane when absent).
    #[arg(long)]
    pub lane: Option<String>,
    /// Idempotency key: a second enqueue with the same key is a DUPLICATE.
    #[arg(long, value_name = "KEY")]
    pub key: Option<String>,
    /// Payload schema version (the latest when absent).
    #[arg(long, value_name = "N")]
    pub schema_version: Option<u32>,
    /// Hold the job this many milliseconds before it may run.
    #[arg(long, value_name = "N")]
    pub delay_ms: Option<u64>,
    /// Payload as JSON text; without it and --payload-file, read from stdin.
    #[arg(long, value_name = "JSON", conflicts_with = "payload_file")]
    pub payload: Option<String>,
    /// Read the payload from this file.
    #[arg(long, value_name = "PATH")]
    pub payload_file: Option<PathBuf>,
}

/// `… show ID`
#[derive(Debug, clap::Args)]
pub struct ShowArgs {
    pub id: String,
}

/// Filters on dead letters; every given one must match.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args, Serialize)]
pub struct DlqFilter {
    /// Only this job type.
    #[arg(long = "type", value_name = "TYPE", value_parser = NonEmptyStringValueParser::new())]
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub job_type: Option<String>,
    /// Only this tenant.
    #[arg(long, value_parser = NonEmptyStringValueParser::new())]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Only this lane.
    #[arg(long, value_parser = NonEmptyStringValueParser::new())]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lane: Option<String>,
    /// Only this dead-letter reason (exhausted, crash_loop, schema_invalid, …).
    #[arg(long, value_parser = NonEmptyStringValueParser::new())]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Only messages of this broker source (a `[[sources]]` name).
    #[arg(long, value_name = "NAME", value_parser = NonEmptyStringValueParser::new())]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Only this stage: admission, processing or broker.
    #[arg(long, value_parser = ["admission", "processing", "broker"])]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage: Option<String>,
    /// Only this failure group (an id from `dlq groups`).
    #[arg(long, value_name = "ID", value_parser = NonEmptyStringValueParser::new())]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
}

impl DlqFilter {
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }

    /// `(name, value)` pairs of the given filters, in a fixed order.
    pub fn pairs(&self) -> Vec<(&'static str, &str)> {
        [
            ("type", &self.job_type),
            ("tenant", &self.tenant),
            ("lane", &self.lane),
            ("reason", &self.reason),
            ("source", &self.source),
            ("stage", &self.stage),
            ("group", &self.group),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.as_deref().map(|v| (k, v)))
        .collect()
    }
}

/// `lazaret dlq ls`
#[derive(Debug, clap::Args)]
pub struct DlqLsArgs {
    #[command(flatten)]
    pub filter: DlqFilter,
    /// Only the dead letter of this job (what `jobs show` calls its id).
    #[arg(long, value_name = "ID", value_parser = NonEmptyStringValueParser::new())]
    pub job_id: Option<String>,
    /// At most this many items in the page.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub limit: Option<u32>,
    /// Continue after a previous page (its "next cursor").
    #[arg(long, value_name = "C")]
    pub cursor: Option<String>,
}

/// `lazaret dlq payload`
#[derive(Debug, clap::Args)]
pub struct DlqPayloadArgs {
    pub id: String,
    /// Write to this file instead of stdout.
    #[arg(long, short, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

/// Which dead letters a redrive or purge acts on: ids, or filters.
#[derive(Debug, clap::Args)]
pub struct DlqSelectArgs {
    /// A dead-letter id; repeat for several. Cannot be mixed with filters.
    #[arg(
        long = "id",
        value_name = "ID",
        value_parser = NonEmptyStringValueParser::new(),
        conflicts_with_all = ["job_type", "tenant", "lane", "reason", "source", "stage", "group"]
    )]
    pub ids: Vec<String>,
    #[command(flatten)]
    pub filter: DlqFilter,
}

/// `lazaret dlq redrive`
#[derive(Debug, clap::Args)]
pub struct DlqRedriveArgs {
    #[command(flatten)]
    pub select: DlqSelectArgs,
    /// Redrive nothing: list what would be redriven.
    #[arg(long)]
    pub dry_run: bool,
    /// Redrive at most N dead letters (jobs or broker messages) per second.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub rate: Option<u32>,
    /// Send the jobs to this type instead (a repair handler); its admission
    /// (schema, byte cap) is applied to each payload again.
    #[arg(long, value_name = "TYPE", value_parser = NonEmptyStringValueParser::new())]
    pub to_type: Option<String>,
    /// Queue the jobs in this lane instead.
    #[arg(long, value_name = "LANE", value_parser = NonEmptyStringValueParser::new())]
    pub to_lane: Option<String>,
    /// Then follow the redrive's report until none of what it sent is
    /// running, a bar of the finished on a terminal (`dlq report --follow`).
    #[arg(long, conflicts_with = "dry_run")]
    pub follow: bool,
}

/// `lazaret dlq report`
#[derive(Debug, clap::Args)]
pub struct DlqReportArgs {
    /// The redrive's id (in the redrive's answer).
    pub id: String,
    /// Poll the report until none of what the redrive sent is running,
    /// a bar of the finished on a terminal; then print it.
    #[arg(long)]
    pub follow: bool,
}

/// `lazaret dlq groups`
#[derive(Debug, clap::Args)]
pub struct DlqGroupsArgs {
    /// Only this job type.
    #[arg(long = "type", value_name = "TYPE", value_parser = NonEmptyStringValueParser::new())]
    pub job_type: Option<String>,
    /// Only this dead-letter reason.
    #[arg(long, value_parser = NonEmptyStringValueParser::new())]
    pub reason: Option<String>,
    /// Only dead letters of this broker source.
    #[arg(long, value_name = "NAME", value_parser = NonEmptyStringValueParser::new())]
    pub source: Option<String>,
    /// Only dead letters of this tenant.
    #[arg(long, value_parser = NonEmptyStringValueParser::new())]
    pub tenant: Option<String>,
    /// Only dead letters from this time on (RFC 3339).
    #[arg(long, value_name = "TIME", value_parser = NonEmptyStringValueParser::new())]
    pub since: Option<String>,
    /// The archived dead letters' groups instead of the active ones'.
    #[arg(long)]
    pub archived: bool,
    /// At most this many groups in the page.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub limit: Option<u32>,
    /// Continue after a previous page (its "next cursor").
    #[arg(long, value_name = "C")]
    pub cursor: Option<String>,
}

/// `lazaret dlq archive` and `lazaret dlq restore`
#[derive(Debug, clap::Args)]
pub struct DlqArchiveArgs {
    #[command(flatten)]
    pub select: DlqSelectArgs,
    /// Change nothing: list what would change.
    #[arg(long)]
    pub dry_run: bool,
    /// Change at most N dead letters per second.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub rate: Option<u32>,
}

/// `lazaret dlq correct ID (--payload JSON | --payload-file PATH) --reason TEXT`
#[derive(Debug, clap::Args)]
pub struct DlqCorrectArgs {
    /// The dead letter.
    pub id: String,
    /// The corrected payload as JSON text; without it and --payload-file,
    /// read from stdin.
    #[arg(long, value_name = "JSON", conflicts_with = "payload_file")]
    pub payload: Option<String>,
    /// Read the corrected payload from this file (e.g. one written by
    /// `dlq payload ID -o FILE` and edited).
    #[arg(long, value_name = "PATH")]
    pub payload_file: Option<PathBuf>,
    /// Why it was corrected, for the audit log (a ticket, a sentence).
    #[arg(long, value_name = "TEXT", value_parser = NonEmptyStringValueParser::new())]
    pub reason: String,
    /// The schema version the corrected payload is written for (default:
    /// the dead letter's).
    #[arg(long, value_name = "N")]
    pub schema_version: Option<u32>,
}

/// Body of `POST /v1/dead-letters/{id}/redrive`.
#[derive(Debug, Serialize)]
pub struct CorrectBody<'a> {
    pub payload: &'a RawValue,
    pub reason: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schema_version: Option<u32>,
}

/// `lazaret dlq purge`
#[derive(Debug, clap::Args)]
pub struct DlqPurgeArgs {
    #[command(flatten)]
    pub select: DlqSelectArgs,
    /// Really delete; without it only show what would be purged.
    #[arg(long)]
    pub confirm: bool,
}

/// The dead letters a redrive or purge names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Selection {
    Ids(Vec<String>),
    Filter(DlqFilter),
}

impl DlqSelectArgs {
    /// Refuses an empty selection: "everything" must never be the default
    /// of a command that moves or deletes dead letters.
    pub fn selection(&self, verb: &str) -> anyhow::Result<Selection> {
        if !self.ids.is_empty() {
            return Ok(Selection::Ids(self.ids.clone()));
        }
        if self.filter.is_empty() {
            bail!(
                "say which dead letters to {verb}: --id ID (repeatable) or at least one of \
                 --type, --tenant, --lane, --reason, --source, --stage"
            );
        }
        Ok(Selection::Filter(self.filter.clone()))
    }
}

impl std::fmt::Display for Selection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Ids(ids) => write!(f, "ids {}", ids.join(", ")),
            Self::Filter(filter) => {
                let pairs: Vec<String> = filter
                    .pairs()
                    .into_iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                write!(f, "{}", pairs.join(" "))
            }
        }
    }
}

/// Body of `POST /v1/dead-letters/redrive`.
#[derive(Debug, Serialize)]
pub struct RedriveBody<'a> {
    #[serde(flatten)]
    pub selection: &'a Selection,
    pub dry_run: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_per_sec: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to: Option<RedirectTo<'a>>,
}

/// A redrive's `"to"`: another type and/or lane.
#[derive(Debug, Serialize)]
pub struct RedirectTo<'a> {
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub job_type: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lane: Option<&'a str>,
}

/// Body of `POST /v1/dead-letters/purge`.
#[derive(Debug, Serialize)]
pub struct PurgeBody<'a> {
    #[serde(flatten)]
    pub selection: &'a Selection,
    pub confirm: bool,
}

/// Body of `POST /v1/jobs`. The payload is a `RawValue` so its text goes out
/// exactly as the user wrote it: the server keeps and hashes those bytes.
#[derive(Debug, Serialize)]
pub struct EnqueueBody<'a> {
    #[serde(rename = "type")]
    pub job_type: &'a str,
    pub tenant: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lane: Option<&'a str>,
    pub payload: &'a RawValue,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schema_version: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<u64>,
}

impl EnqueueArgs {
    /// Checks the payload text is one JSON value (surrounding whitespace is
    /// dropped, the value's own bytes are kept).
    pub fn parse_payload(text: String, from: &str) -> anyhow::Result<Box<RawValue>> {
        serde_json::from_str::<Box<RawValue>>(&text)
            .with_context(|| format!("the payload from {from} is not one valid JSON value"))
    }

    pub fn body<'a>(&'a self, payload: &'a RawValue) -> EnqueueBody<'a> {
        EnqueueBody {
            job_type: &self.job_type,
            tenant: &self.tenant,
            lane: self.lane.as_deref(),
            payload,
            idempotency_key: self.key.as_deref(),
            schema_version: self.schema_version,
            delay_ms: self.delay_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};
    use serde_json::json;

    /// Stands in for the binary's top-level parser, which flattens
    /// ClientCommand beside the global options.
    #[derive(Debug, Parser)]
    #[command(name = "lazaret")]
    struct TestCli {
        #[command(flatten)]
        global: GlobalOpts,
        #[command(subcommand)]
        command: ClientCommand,
    }

    fn parse_all(args: &[&str]) -> Result<(GlobalOpts, ClientCommand), clap::Error> {
        TestCli::try_parse_from(std::iter::once("lazaret").chain(args.iter().copied()))
            .map(|c| (c.global, c.command))
    }

    fn parse(args: &[&str]) -> Result<ClientCommand, clap::Error> {
        parse_all(args).map(|(_, c)| c)
    }

    fn global(args: &[&str]) -> GlobalOpts {
        parse_all(args)
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
            .0
    }

    fn ok(args: &[&str]) -> ClientCommand {
        parse(args).unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    #[test]
    fn the_command_definition_is_consistent() {
        TestCli::command().debug_assert();
    }

    #[test]
    fn enqueue_takes_all_its_options() {
        let ClientCommand::Enqueue(a) = ok(&[
            "enqueue",
            "send_email",
            "--tenant",
            "acme",
            "--lane",
            "interactive",
            "--key",
            "order-42",
            "--schema-version",
            "2",
            "--delay-ms",
            "1500",
            "--payload",
            r#"{"to":"a@b"}"#,
            "--server",
            "http://10.0.0.1:9000",
            "--json",
        ]) else {
            panic!("not enqueue")
        };
        assert_eq!(a.job_type, "send_email");
        assert_eq!(a.tenant, "acme");
        assert_eq!(a.lane.as_deref(), Some("interactive"));
        assert_eq!(a.key.as_deref(), Some("order-42"));
        assert_eq!(a.schema_version, Some(2));
        assert_eq!(a.delay_ms, Some(1500));
        assert_eq!(a.payload.as_deref(), Some(r#"{"to":"a@b"}"#));
    }

    #[test]
    fn server_token_ca_cert_and_json_go_anywhere_on_the_line() {
        let lines: [&[&str]; 4] = [
            &[
                "--server",
                "https://q:1",
                "--token",
                "t",
                "--ca-cert",
                "ca.pem",
                "--json",
                "dlq",
                "ls",
            ],
            &[
                "dlq",
                "--server",
                "https://q:1",
                "--json",
                "ls",
                "--token",
                "t",
                "--ca-cert",
                "ca.pem",
            ],
            &[
                "dlq",
                "ls",
                "--json",
                "--ca-cert",
                "ca.pem",
                "--token",
                "t",
                "--server",
                "https://q:1",
            ],
            &[
                "--json",
                "dlq",
                "--token",
                "t",
                "ls",
                "--server",
                "https://q:1",
                "--ca-cert",
                "ca.pem",
            ],
        ];
        for line in lines {
            let g = global(line);
            assert_eq!(g.server.as_deref(), Some("https://q:1"), "{line:?}");
            assert_eq!(g.token.as_deref(), Some("t"), "{line:?}");
            assert_eq!(
                g.ca_cert.as_deref(),
                Some(std::path::Path::new("ca.pem")),
                "{line:?}"
            );
            assert!(g.json, "{line:?}");
        }
    }

    #[test]
    fn enqueue_needs_a_tenant_and_one_payload_source() {
        assert!(parse(&["enqueue", "t"]).is_err());
        let both = parse(&[
            "enqueue",
            "t",
            "--tenant",
            "a",
            "--payload",
            "{}",
            "--payload-file",
            "p.json",
        ]);
        assert_eq!(
            both.unwrap_err().kind(),
            clap::error::ErrorKind::ArgumentConflict
        );
        let ClientCommand::Enqueue(a) = ok(&["enqueue", "t", "--tenant", "a"]) else {
            panic!()
        };
        assert!(
            a.payload.is_none() && a.payload_file.is_none(),
            "stdin then"
        );
    }

    #[test]
    fn the_server_defaults_to_loopback() {
        // Only checkable when the environment does not set it.
        if std::env::var_os("LAZARET_SERVER").is_none() {
            assert_eq!(global(&["stats"]).server_url(), "http://127.0.0.1:7433");
        }
        assert!(!global(&["stats"]).json);
    }

    #[test]
    fn jobs_show_and_dlq_read_commands_parse() {
        assert!(matches!(
            ok(&["jobs", "show", "j1"]),
            ClientCommand::Jobs { command: JobsCommand::Show(ShowArgs { ref id, .. }) } if id == "j1"
        ));
        assert!(matches!(
            ok(&["dlq", "show", "d1", "--json"]),
            ClientCommand::Dlq { command: DlqCommand::Show(ShowArgs { ref id }) }
                if id == "d1"
        ));
        assert!(matches!(
            ok(&["dlq", "payload", "d1", "--output", "out.bin"]),
            ClientCommand::Dlq { command: DlqCommand::Payload(DlqPayloadArgs { ref output, .. }) }
                if output.as_deref() == Some(std::path::Path::new("out.bin"))
        ));
        assert!(matches!(
            ok(&["dlq", "reasons"]),
            ClientCommand::Dlq {
                command: DlqCommand::Reasons
            }
        ));
        assert!(matches!(ok(&["stats"]), ClientCommand::Stats));
        assert!(matches!(ok(&["breakers"]), ClientCommand::Breakers));
        assert!(matches!(
            ok(&["jobs", "cancel", "j7"]),
            ClientCommand::Jobs { command: JobsCommand::Cancel(ShowArgs { ref id }) } if id == "j7"
        ));
    }

    #[test]
    fn pause_and_resume_take_exactly_one_of_type_or_lane() {
        let ClientCommand::Pause(p) = ok(&["pause", "--type", "send_email"]) else {
            panic!("not pause")
        };
        assert_eq!(
            serde_json::to_value(&p).unwrap(),
            json!({"type": "send_email"})
        );
        let ClientCommand::Resume(r) = ok(&["resume", "--lane", "batch"]) else {
            panic!("not resume")
        };
        assert_eq!(serde_json::to_value(&r).unwrap(), json!({"lane": "batch"}));
        assert_eq!(r.target(), "lane batch");
        assert_eq!(
            parse(&["pause"]).unwrap_err().kind(),
            clap::error::ErrorKind::MissingRequiredArgument
        );
        assert_eq!(
            parse(&["pause", "--type", "t", "--lane", "l"])
                .unwrap_err()
                .kind(),
            clap::error::ErrorKind::ArgumentConflict
        );
        assert!(parse(&["resume", "--type", ""]).is_err());
    }

    #[test]
    fn jobs_ls_sends_its_filters_in_the_contracts_order() {
        let ClientCommand::Jobs {
            command: JobsCommand::Ls(a),
        } = ok(&[
            "jobs",
            "ls",
            "--cursor",
            "c9",
            "--limit",
            "5",
            "--lane",
            "batch",
            "--tenant",
            "acme",
            "--type",
            "t",
            "--state",
            "cancelled",
        ])
        else {
            panic!("not jobs ls")
        };
        let query = a.query();
        let q: Vec<(&str, &str)> = query.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(
            q,
            [
                ("state", "cancelled"),
                ("type", "t"),
                ("tenant", "acme"),
                ("lane", "batch"),
                ("limit", "5"),
                ("cursor", "c9")
            ]
        );
        let err = parse(&["jobs", "ls", "--state", "running"]).unwrap_err();
        assert!(err.to_string().contains("dead_lettered"), "{err}");
        assert!(parse(&["jobs", "ls", "--limit", "0"]).is_err());
    }

    #[test]
    fn audit_takes_filters_and_a_cursor() {
        let ClientCommand::Audit(a) = ok(&[
            "audit",
            "--action",
            "purge",
            "--actor",
            "ops-alice",
            "--limit",
            "10",
            "--cursor",
            "41",
        ]) else {
            panic!("not audit")
        };
        let query = a.query();
        let q: Vec<(&str, &str)> = query.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(
            q,
            [
                ("action", "purge"),
                ("actor", "ops-alice"),
                ("limit", "10"),
                ("cursor", "41")
            ]
        );
        let err = parse(&["audit", "--action", "delete"]).unwrap_err();
        assert!(err.to_string().contains("token_revoke"), "{err}");
        assert!(parse(&["audit", "--limit", "1001"]).is_err());
    }

    #[test]
    fn dlq_ls_takes_filters_and_paging() {
        let ClientCommand::Dlq {
            command: DlqCommand::Ls(a),
        } = ok(&[
            "dlq",
            "ls",
            "--type",
            "send_email",
            "--tenant",
            "acme",
            "--lane",
            "batch",
            "--reason",
            "exhausted",
            "--limit",
            "20",
            "--cursor",
            "abc",
        ])
        else {
            panic!()
        };
        assert_eq!(
            a.filter.pairs(),
            [
                ("type", "send_email"),
                ("tenant", "acme"),
                ("lane", "batch"),
                ("reason", "exhausted")
            ]
        );
        assert_eq!(a.limit, Some(20));
        assert_eq!(a.cursor.as_deref(), Some("abc"));
        assert!(matches!(
            ok(&["dlq", "list"]),
            ClientCommand::Dlq {
                command: DlqCommand::Ls(_)
            }
        ));
        assert!(parse(&["dlq", "ls", "--limit", "0"]).is_err());
    }

    fn redrive(args: &[&str]) -> DlqRedriveArgs {
        let mut all = vec!["dlq", "redrive"];
        all.extend_from_slice(args);
        match ok(&all) {
            ClientCommand::Dlq {
                command: DlqCommand::Redrive(a),
            } => a,
            other => panic!("{other:?}"),
        }
    }

    fn purge(args: &[&str]) -> DlqPurgeArgs {
        let mut all = vec!["dlq", "purge"];
        all.extend_from_slice(args);
        match ok(&all) {
            ClientCommand::Dlq {
                command: DlqCommand::Purge(a),
            } => a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn redrive_by_ids_sends_the_ids() {
        let a = redrive(&["--id", "d1", "--id", "d2", "--rate", "5"]);
        let sel = a.select.selection("redrive").unwrap();
        let body = RedriveBody {
            selection: &sel,
            dry_run: a.dry_run,
            rate_per_sec: a.rate,
            to: None,
        };
        assert_eq!(
            serde_json::to_value(&body).unwrap(),
            json!({"ids": ["d1", "d2"], "dry_run": false, "rate_per_sec": 5})
        );
    }

    #[test]
    fn redrive_by_filter_sends_only_the_given_filters() {
        let a = redrive(&["--type", "send_email", "--reason", "exhausted", "--dry-run"]);
        let sel = a.select.selection("redrive").unwrap();
        let body = RedriveBody {
            selection: &sel,
            dry_run: a.dry_run,
            rate_per_sec: a.rate,
            to: None,
        };
        assert_eq!(
            serde_json::to_value(&body).unwrap(),
            json!({"filter": {"type": "send_email", "reason": "exhausted"}, "dry_run": true})
        );
        assert_eq!(sel.to_string(), "type=send_email reason=exhausted");
    }

    #[test]
    fn source_and_stage_filter_ls_and_redrive() {
        let ClientCommand::Dlq {
            command: DlqCommand::Ls(a),
        } = ok(&["dlq", "ls", "--source", "orders", "--stage", "broker"])
        else {
            panic!()
        };
        assert_eq!(
            a.filter.pairs(),
            [("source", "orders"), ("stage", "broker")]
        );
        let a = redrive(&["--source", "orders"]);
        let sel = a.select.selection("redrive").unwrap();
        let body = RedriveBody {
            selection: &sel,
            dry_run: a.dry_run,
            rate_per_sec: a.rate,
            to: None,
        };
        assert_eq!(
            serde_json::to_value(&body).unwrap(),
            json!({"filter": {"source": "orders"}, "dry_run": false})
        );
        assert_eq!(sel.to_string(), "source=orders");
        assert!(parse(&["dlq", "ls", "--stage", "parked"]).is_err());
        assert!(parse(&["dlq", "ls", "--source", ""]).is_err());
        let mixed = parse(&["dlq", "redrive", "--id", "d1", "--source", "orders"]);
        assert_eq!(
            mixed.unwrap_err().kind(),
            clap::error::ErrorKind::ArgumentConflict
        );
    }

    #[test]
    fn redrive_refuses_an_empty_selection() {
        let err = redrive(&["--dry-run"])
            .select
            .selection("redrive")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--id") && err.contains("--reason") && err.contains("--source"),
            "{err}"
        );
        assert!(err.contains("redrive"), "{err}");
    }

    #[test]
    fn ids_and_filters_do_not_mix_and_filters_may_not_be_empty() {
        let mixed = parse(&["dlq", "redrive", "--id", "d1", "--type", "t"]);
        assert_eq!(
            mixed.unwrap_err().kind(),
            clap::error::ErrorKind::ArgumentConflict
        );
        // An empty filter would otherwise widen the match to everything.
        assert!(parse(&["dlq", "redrive", "--type", ""]).is_err());
        assert!(parse(&["dlq", "purge", "--id", "", "--confirm"]).is_err());
        assert!(parse(&["dlq", "redrive", "--type", "t", "--rate", "0"]).is_err());
    }

    #[test]
    fn purge_sends_confirm_and_refuses_an_empty_selection() {
        let a = purge(&["--tenant", "acme", "--confirm"]);
        let sel = a.select.selection("purge").unwrap();
        let body = PurgeBody {
            selection: &sel,
            confirm: a.confirm,
        };
        assert_eq!(
            serde_json::to_value(&body).unwrap(),
            json!({"filter": {"tenant": "acme"}, "confirm": true})
        );
        assert!(!purge(&["--id", "d9"]).confirm);
        assert!(purge(&["--confirm"]).select.selection("purge").is_err());
    }

    #[test]
    fn enqueue_sends_the_payload_bytes_as_written() {
        let ClientCommand::Enqueue(a) = ok(&[
            "enqueue",
            "send_email",
            "--tenant",
            "acme",
            "--key",
            "order-42",
        ]) else {
            panic!()
        };
        // Key order, spacing and number spelling survive; outer whitespace does not.
        let text = " {\"z\": 1.50, \"a\":[1,2]}\n".to_owned();
        let payload = EnqueueArgs::parse_payload(text, "stdin").unwrap();
        let body = serde_json::to_string(&a.body(&payload)).unwrap();
        assert_eq!(
            body,
            r#"{"type":"send_email","tenant":"acme","payload":{"z": 1.50, "a":[1,2]},"idempotency_key":"order-42"}"#
        );
    }

    #[test]
    fn enqueue_sends_every_optional_field_when_given() {
        let ClientCommand::Enqueue(a) = ok(&[
            "enqueue",
            "t",
            "--tenant",
            "a",
            "--lane",
            "batch",
            "--schema-version",
            "3",
            "--delay-ms",
            "0",
        ]) else {
            panic!()
        };
        let payload = EnqueueArgs::parse_payload("null".into(), "--payload").unwrap();
        assert_eq!(
            serde_json::to_value(a.body(&payload)).unwrap(),
            json!({"type": "t", "tenant": "a", "lane": "batch", "payload": null,
                   "schema_version": 3, "delay_ms": 0})
        );
    }

    #[test]
    fn an_invalid_payload_is_refused_before_sending() {
        let err = EnqueueArgs::parse_payload("{\"a\":".into(), "--payload").unwrap_err();
        assert!(format!("{err:#}").contains("--payload"), "{err:#}");
        assert!(EnqueueArgs::parse_payload("1 2".into(), "stdin").is_err());
        assert!(EnqueueArgs::parse_payload("".into(), "stdin").is_err());
    }
}
