//! Human-readable output of the server's replies.
//!
//! Every renderer reads a `serde_json::Value` rather than a typed struct: the
//! contract lets the server add fields and send `null`, and a CLI that
//! breaks on a new field would be worse than one that ignores it. `--json`
//! shows everything; these summaries show what an operator reads first.

use std::borrow::Cow;
use std::io::{self, Write};

use serde_json::Value;

use super::table::{Column, Table, clean_line, clean_text, cut};

/// How many job ids a redrive prints before "… and N more".
const JOB_IDS_SHOWN_MAX: usize = 20;
/// The widest an error message gets in a table before it is cut.
const ERROR_WIDTH_MAX: usize = 60;
/// The widest a payload gets in `jobs show`.
const PAYLOAD_WIDTH_MAX: usize = 200;

type Out<'a> = &'a mut dyn Write;

/// A field as text: strings bare, `null` or absent as `-`, the rest as JSON.
pub fn text(v: &Value, key: &str) -> String {
    scalar(v.get(key))
}

fn scalar(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "-".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// An RFC 3339 time to the second, for tables; anything else as it came.
pub fn short_time(v: &Value, key: &str) -> String {
    let s = text(v, key);
    match humantime::parse_rfc3339_weak(&s) {
        Ok(t) => humantime::format_rfc3339_seconds(t).to_string(),
        Err(_) => s,
    }
}

/// `kind: message` of an error object, `-` when there is none.
pub fn error_summary(e: Option<&Value>) -> String {
    let Some(e) = e.filter(|e| !e.is_null()) else {
        return "-".to_owned();
    };
    let kind = e.get("kind").and_then(Value::as_str);
    let message = e.get("message").and_then(Value::as_str);
    match (kind, message) {
        (Some(k), Some(m)) if !m.is_empty() => format!("{k}: {m}"),
        (Some(k), _) => k.to_owned(),
        (None, Some(m)) => m.to_owned(),
        (None, None) => e.to_string(),
    }
}

/// `label:  value` lines with the values lined up.
fn fields(out: Out, pairs: &[(&str, String)]) -> io::Result<()> {
    indented_fields(out, pairs, "")
}

/// [`fields`] under a heading. Labels may come from a broker message's
/// headers, so they are cleaned like values.
fn indented_fields(out: Out, pairs: &[(&str, String)], indent: &str) -> io::Result<()> {
    let labels: Vec<String> = pairs
        .iter()
        .map(|(k, _)| format!("{}:", clean_line(k)))
        .collect();
    let width = labels.iter().map(|l| l.chars().count()).max().unwrap_or(0);
    for (label, (_, value)) in labels.iter().zip(pairs) {
        let pad = width - label.chars().count();
        writeln!(out, "{indent}{label}{:pad$}  {}", "", clean_line(value))?;
    }
    Ok(())
}

fn write_lines(out: Out, lines: &[String], indent: &str) -> io::Result<()> {
    for line in lines {
        writeln!(out, "{indent}{line}")?;
    }
    Ok(())
}

pub fn items<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v.get(key)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

/// `POST /v1/jobs`.
pub fn enqueued(out: Out, v: &Value) -> io::Result<()> {
    fields(
        out,
        &[
            ("id", text(v, "id")),
            ("state", text(v, "state")),
            ("admission", text(v, "admission")),
        ],
    )?;
    match v.get("admission").and_then(Value::as_str) {
        Some("DUPLICATE") => writeln!(
            out,
            "this idempotency key was already admitted: the id above is the existing job"
        ),
        Some("FAIR_QUEUE") => writeln!(
            out,
            "the tenant is at its in-flight cap in this lane: the job waits its turn"
        ),
        _ => Ok(()),
    }
}

fn history_table(history: &[Value]) -> Table {
    let mut t = Table::new(vec![
        Column::new("ATTEMPT").right(),
        Column::new("STARTED_AT"),
        Column::new("ENDED_AT"),
        Column::new("WORKER"),
        Column::new("OUTCOME"),
        Column::new("ERROR").width_max(ERROR_WIDTH_MAX).flex(),
    ]);
    for h in history {
        t.push([
            text(h, "attempt"),
            short_time(h, "started_at"),
            short_time(h, "ended_at"),
            text(h, "worker_id"),
            text(h, "outcome"),
            error_summary(h.get("error")),
        ]);
    }
    t
}

fn history(out: Out, v: &Value, width: Option<usize>) -> io::Result<()> {
    let h = items(v, "history");
    if h.is_empty() {
        return writeln!(out, "\nhistory: none");
    }
    writeln!(out, "\nhistory:")?;
    write_lines(out, &history_table(h).lines(width.map(|w| w - 2)), "  ")
}

/// Optional fields are shown only when the server sends them.
fn push_if_present(pairs: &mut Vec<(&'static str, String)>, v: &Value, key: &'static str) {
    if v.get(key).is_some_and(|x| !x.is_null()) {
        pairs.push((key, text(v, key)));
    }
}

/// `GET /v1/jobs/{id}`.
pub fn job(out: Out, v: &Value, width: Option<usize>) -> io::Result<()> {
    let mut pairs = vec![
        ("id", text(v, "id")),
        ("type", text(v, "type")),
        ("tenant", text(v, "tenant")),
        ("lane", text(v, "lane")),
        ("state", text(v, "state")),
        ("attempt", text(v, "attempt")),
        ("idempotency_key", text(v, "idempotency_key")),
    ];
    push_if_present(&mut pairs, v, "schema_version");
    push_if_present(&mut pairs, v, "redrive_count");
    pairs.push(("created_at", text(v, "created_at")));
    pairs.push(("run_at", text(v, "run_at")));
    let payload = match v.get("payload") {
        None => "-".to_owned(),
        Some(p) => {
            let compact = p.to_string();
            match cut(&compact, PAYLOAD_WIDTH_MAX) {
                Cow::Owned(shown) => format!("{shown}  (cut; --json for the whole payload)"),
                Cow::Borrowed(_) => compact,
            }
        }
    };
    pairs.push(("payload", payload));
    fields(out, &pairs)?;
    history(out, v, width)
}

fn dead_letter_table(items: &[Value]) -> Table {
    // The SOURCE column only when a broker message is on the page: most
    // installations have no sources, and their tables stay as they were.
    let sources = items
        .iter()
        .any(|d| d.get("source").is_some_and(|s| !s.is_null()));
    let mut columns = vec![Column::new("ID"), Column::new("JOB_ID")];
    if sources {
        columns.push(Column::new("SOURCE"));
    }
    columns.extend([
        Column::new("TYPE"),
        Column::new("TENANT"),
        Column::new("LANE"),
        Column::new("REASON"),
        Column::new("STAGE"),
        Column::new("ATTEMPTS").right(),
        Column::new("DEAD_LETTERED_AT"),
        Column::new("ERROR").width_max(ERROR_WIDTH_MAX).flex(),
    ]);
    let mut t = Table::new(columns);
    for d in items {
        let mut row = vec![text(d, "id"), text(d, "job_id")];
        if sources {
            row.push(
                d.get("source")
                    .map_or_else(|| "-".to_owned(), |s| text(s, "name")),
            );
        }
        row.extend([
            text(d, "type"),
            text(d, "tenant"),
            text(d, "lane"),
            text(d, "reason"),
            text(d, "stage"),
            text(d, "attempts"),
            short_time(d, "dead_lettered_at"),
            error_summary(d.get("error")),
        ]);
        t.push(row);
    }
    t
}

/// The "next cursor" line under a page (`--cursor` continues from it).
fn next_cursor(out: Out, v: &Value, empty: bool) -> io::Result<()> {
    match v.get("next_cursor").and_then(Value::as_str) {
        Some(c) => writeln!(
            out,
            "next cursor: {}  (add --cursor to see the next page)",
            clean_line(c)
        ),
        None if empty => Ok(()),
        None => writeln!(out, "next cursor: none (last page)"),
    }
}

/// `GET /v1/jobs`: one row per job, newest first.
pub fn jobs(out: Out, v: &Value, width: Option<usize>) -> io::Result<()> {
    let page = items(v, "items");
    if page.is_empty() {
        writeln!(out, "no jobs match")?;
    } else {
        let mut t = Table::new(vec![
            Column::new("ID"),
            Column::new("TYPE"),
            Column::new("TENANT"),
            Column::new("LANE"),
            Column::new("STATE"),
            Column::new("ATTEMPT").right(),
            Column::new("CREATED_AT"),
            Column::new("RUN_AT"),
            Column::new("DEAD_LETTER"),
        ]);
        for j in page {
            t.push([
                text(j, "id"),
                text(j, "type"),
                text(j, "tenant"),
                text(j, "lane"),
                text(j, "state"),
                text(j, "attempt"),
                short_time(j, "created_at"),
                short_time(j, "run_at"),
                text(j, "dead_letter_id"),
            ]);
        }
        write_lines(out, &t.lines(width), "")?;
    }
    next_cursor(out, v, page.is_empty())
}

/// `POST /v1/jobs/{id}/cancel`.
pub fn cancelled(out: Out, v: &Value, id: &str) -> io::Result<()> {
    let id = clean_line(id);
    match v.get("state").and_then(Value::as_str) {
        Some("cancelled") => writeln!(out, "cancelled job {id}: it will not be leased again"),
        _ if v.get("cancel_requested") == Some(&Value::Bool(true)) => writeln!(
            out,
            "job {id} is leased: cancel requested; it ends cancelled at its outcome or when \
             its lease expires, unless its worker acks it first"
        ),
        _ => fields(
            out,
            &[("job", id.into_owned()), ("state", text(v, "state"))],
        ),
    }
}

/// `GET /v1/breakers`: the breakers that are not closed.
pub fn breakers(out: Out, v: &Value, width: Option<usize>) -> io::Result<()> {
    let rows: Vec<&Value> = items(v, "breakers")
        .iter()
        .filter(|b| b.get("state").and_then(Value::as_str) != Some("closed"))
        .collect();
    if rows.is_empty() {
        return writeln!(out, "every breaker is closed: all types are leased");
    }
    let mut t = Table::new(vec![
        Column::new("TYPE"),
        Column::new("KIND"),
        Column::new("STATE"),
        Column::new("UNTIL"),
    ]);
    for b in rows {
        t.push([
            text(b, "type"),
            text(b, "kind"),
            text(b, "state"),
            short_time(b, "until"),
        ]);
    }
    write_lines(out, &t.lines(width), "")
}

/// `GET /v1/audit`: one row per entry, newest first.
pub fn audit(out: Out, v: &Value, width: Option<usize>) -> io::Result<()> {
    let page = items(v, "items");
    if page.is_empty() {
        writeln!(out, "no audit entries match")?;
    } else {
        let mut t = Table::new(vec![
            Column::new("ID"),
            Column::new("AT"),
            Column::new("ACTOR"),
            Column::new("ACTION"),
            Column::new("COUNT").right(),
            Column::new("REQUEST").width_max(ERROR_WIDTH_MAX * 2).flex(),
        ]);
        for e in page {
            t.push([
                text(e, "id"),
                short_time(e, "at"),
                text(e, "actor"),
                text(e, "action"),
                text(e, "count"),
                compact(e.get("request")),
            ]);
        }
        write_lines(out, &t.lines(width), "")?;
    }
    next_cursor(out, v, page.is_empty())
}

/// `GET /v1/dead-letters`: the page and where the next one starts.
pub fn dead_letters(out: Out, v: &Value, width: Option<usize>) -> io::Result<()> {
    let page = items(v, "items");
    if page.is_empty() {
        writeln!(out, "no dead letters match")?;
    } else {
        write_lines(out, &dead_letter_table(page).lines(width), "")?;
    }
    next_cursor(out, v, page.is_empty())
}

/// A few dead letters, as `dlq purge` shows them before asking for --confirm.
pub fn dead_letters_sample(out: Out, page: &[Value], width: Option<usize>) -> io::Result<()> {
    write_lines(out, &dead_letter_table(page).lines(width), "")
}

/// `GET /v1/dead-letters/{id}`.
pub fn dead_letter(out: Out, v: &Value, width: Option<usize>) -> io::Result<()> {
    let mut pairs = vec![
        ("id", text(v, "id")),
        ("job_id", text(v, "job_id")),
        ("type", text(v, "type")),
        ("tenant", text(v, "tenant")),
        ("lane", text(v, "lane")),
        ("stage", text(v, "stage")),
        ("reason", text(v, "reason")),
        ("attempts", text(v, "attempts")),
        ("idempotency_key", text(v, "idempotency_key")),
    ];
    push_if_present(&mut pairs, v, "redrive_count");
    push_if_present(&mut pairs, v, "held");
    pairs.push(("created_at", text(v, "created_at")));
    pairs.push(("dead_lettered_at", text(v, "dead_lettered_at")));
    pairs.push(("payload_size", text(v, "payload_size")));
    pairs.push(("payload_sha256", text(v, "payload_sha256")));
    let error = v.get("error").filter(|e| !e.is_null());
    if let Some(e) = error {
        pairs.push(("error.class", text(e, "class")));
        pairs.push(("error.kind", text(e, "kind")));
        pairs.push(("error.message", text(e, "message")));
    } else {
        pairs.push(("error", "-".to_owned()));
    }
    fields(out, &pairs)?;

    if let Some(tb) = error
        .and_then(|e| e.get("traceback"))
        .and_then(Value::as_str)
    {
        if !tb.trim().is_empty() {
            writeln!(out, "\ntraceback:")?;
            for line in clean_text(tb.trim_end()).lines() {
                writeln!(out, "  {line}")?;
            }
        }
    }
    source(out, v)?;
    celery(out, v)?;
    history(out, v, width)?;
    lineage(out, v, width)?;
    payload_preview(out, v)
}

/// A dead letter's redrives, oldest first, and how each ended.
fn lineage(out: Out, v: &Value, width: Option<usize>) -> io::Result<()> {
    let rows = items(v, "lineage");
    if rows.is_empty() {
        return Ok(());
    }
    writeln!(out, "\nlineage:")?;
    let mut t = Table::new(vec![
        Column::new("REDRIVE"),
        Column::new("AT"),
        Column::new("BY"),
        Column::new("FROM_GROUP"),
        Column::new("EDITED"),
        Column::new("SENT_TO"),
        Column::new("ENDED").flex(),
    ]);
    for r in rows {
        let to = r.get("to").filter(|t| t.is_object()).map_or_else(
            || "-".to_owned(),
            |to| format!("{}/{}", text(to, "type"), text(to, "lane")),
        );
        let ended = match r.get("outcome") {
            Some(o) if o.get("current") == Some(&Value::Bool(true)) => {
                format!("now {} (group {})", text(o, "state"), text(o, "group"))
            }
            Some(o) => format!("failed again into group {}", text(o, "group")),
            None => "-".to_owned(),
        };
        let edited = if r.get("payload_edited") == Some(&Value::Bool(true)) {
            "yes"
        } else {
            "no"
        };
        t.push([
            text(r, "redrive_id"),
            text(r, "at"),
            text(r, "actor"),
            text(r, "from_group"),
            edited.to_owned(),
            to,
            ended,
        ]);
    }
    write_lines(out, &t.lines(width), "  ")
}

/// A JSON value on one line: strings bare, the rest as compact JSON.
fn compact(v: Option<&Value>) -> String {
    match v {
        Some(Value::Object(m)) if m.is_empty() => "{}".to_owned(),
        other => scalar(other),
    }
}

/// Where a broker dead letter came from: its source, broker coordinates
/// and the message's own headers.
fn source(out: Out, v: &Value) -> io::Result<()> {
    let Some(s) = v.get("source").filter(|s| s.is_object()) else {
        return Ok(());
    };
    writeln!(out, "\nsource:")?;
    let mut pairs = vec![
        ("name", text(s, "name")),
        ("broker", text(s, "broker")),
        ("queue", text(s, "queue")),
        ("message_id", text(s, "message_id")),
        ("position", compact(s.get("position"))),
    ];
    push_if_present(&mut pairs, s, "content_type");
    indented_fields(out, &pairs, "  ")?;
    match s.get("headers").and_then(Value::as_object) {
        Some(h) if !h.is_empty() => {
            writeln!(out, "  headers:")?;
            let rows: Vec<(&str, String)> = h
                .iter()
                .map(|(k, v)| (k.as_str(), compact(Some(v))))
                .collect();
            indented_fields(out, &rows, "    ")
        }
        _ => writeln!(out, "  headers:     none"),
    }
}

/// A Celery task's name, id, retries and arguments.
fn celery(out: Out, v: &Value) -> io::Result<()> {
    let Some(c) = v.get("celery").filter(|c| c.is_object()) else {
        return Ok(());
    };
    writeln!(out, "\ncelery task:")?;
    let mut pairs = vec![
        ("task", text(c, "task")),
        ("id", text(c, "id")),
        ("retries", text(c, "retries")),
    ];
    let args = c.get("arguments");
    match args.and_then(|a| a.get("args")) {
        Some(a) => {
            pairs.push(("args", compact(Some(a))));
            pairs.push(("kwargs", compact(args.and_then(|a| a.get("kwargs")))));
        }
        // A body that is not JSON: what Celery's own repr headers say.
        None => {
            pairs.push(("argsrepr", compact(args.and_then(|a| a.get("argsrepr")))));
            pairs.push((
                "kwargsrepr",
                compact(args.and_then(|a| a.get("kwargsrepr"))),
            ));
        }
    }
    indented_fields(out, &pairs, "  ")
}

fn payload_preview(out: Out, v: &Value) -> io::Result<()> {
    let preview = match v.get("payload_preview") {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::String(s)) => s.clone(),
        Some(other) => serde_json::to_string_pretty(other).unwrap_or_default(),
    };
    let size = v.get("payload_size").and_then(Value::as_u64);
    let id = text(v, "id");
    match size {
        Some(size) if size > preview.len() as u64 => writeln!(
            out,
            "\npayload preview (first {} of {size} bytes; `lazaret dlq payload {}` for all):",
            preview.len(),
            clean_line(&id)
        )?,
        _ => writeln!(out, "\npayload preview:")?,
    }
    for line in clean_text(&preview).lines() {
        writeln!(out, "  {line}")?;
    }
    Ok(())
}

/// `GET /v1/dead-letters/reasons`.
pub fn reasons(out: Out, v: &Value, width: Option<usize>) -> io::Result<()> {
    let rows = items(v, "reasons");
    if rows.is_empty() {
        return writeln!(out, "no dead letters");
    }
    let mut t = Table::new(vec![
        Column::new("REASON"),
        Column::new("TYPE"),
        Column::new("COUNT").right(),
        Column::new("FIRST_AT"),
        Column::new("LAST_AT"),
    ]);
    for r in rows {
        t.push([
            text(r, "reason"),
            text(r, "type"),
            text(r, "count"),
            short_time(r, "first_at"),
            short_time(r, "last_at"),
        ]);
    }
    write_lines(out, &t.lines(width), "")
}

/// `GET /v1/dead-letters/groups`: one row per group, newest first.
pub fn groups(out: Out, v: &Value, width: Option<usize>) -> io::Result<()> {
    let rows = items(v, "items");
    if rows.is_empty() {
        return writeln!(out, "no dead letters");
    }
    let mut t = Table::new(vec![
        Column::new("GROUP"),
        Column::new("COUNT").right(),
        Column::new("1H").right(),
        Column::new("HELD").right(),
        Column::new("TYPE"),
        Column::new("REASON"),
        Column::new("KIND"),
        Column::new("LAST_AT"),
        Column::new("ERROR"),
    ]);
    for r in rows {
        t.push([
            text(r, "id"),
            text(r, "count"),
            text(r, "rate_1h"),
            text(r, "held"),
            text(r, "type"),
            text(r, "reason"),
            text(r, "kind"),
            short_time(r, "last_at"),
            text(r, "fingerprint"),
        ]);
    }
    write_lines(out, &t.lines(width), "")?;
    if let Some(c) = v.get("next_cursor").and_then(Value::as_str) {
        writeln!(out, "next cursor: {}", clean_line(c))?;
    }
    Ok(())
}

/// `GET /v1/redrives/{id}`: what a redrive did so far.
pub fn redrive_report(out: Out, v: &Value) -> io::Result<()> {
    fields(
        out,
        &[
            ("redrive", text(v, "id")),
            ("at", short_time(v, "at")),
            ("actor", text(v, "actor")),
            ("sent", text(v, "sent")),
            ("jobs", text(v, "jobs")),
            ("messages", text(v, "messages")),
            ("succeeded", text(v, "succeeded")),
            ("running", text(v, "running")),
            ("failed again", text(v, "failed_again")),
            ("cancelled", text(v, "cancelled")),
            ("gone", text(v, "gone")),
        ],
    )?;
    for (key, label) in [
        ("from_groups", "from group"),
        ("failed_again_groups", "failed again into"),
    ] {
        for g in items(v, key) {
            writeln!(out, "{label} {}: {}", text(g, "group"), text(g, "count"))?;
        }
    }
    Ok(())
}

/// `POST /v1/dead-letters/archive` and `/restore`.
pub fn archived(out: Out, v: &Value, done: &str) -> io::Result<()> {
    fields(
        out,
        &[("matched", text(v, "matched")), (done, text(v, done))],
    )?;
    let missing = redrive_not_found(v);
    if !missing.is_empty() {
        writeln!(out, "not found: {}", clean_line(&missing.join(", ")))?;
    }
    Ok(())
}

/// `POST /v1/dead-letters/redrive`: the counts, then what happened to
/// each dead letter (a server that sends no `items` gets the job ids).
pub fn redriven(out: Out, v: &Value, dry_run: bool) -> io::Result<()> {
    fields(
        out,
        &[
            ("matched", text(v, "matched")),
            ("redriven", text(v, "redriven")),
        ],
    )?;
    if dry_run {
        writeln!(out, "dry run: nothing was redriven")?;
    }
    let per_item = items(v, "items");
    if v.get("items").is_some_and(Value::is_array) {
        if !per_item.is_empty() {
            redrive_items(out, per_item, dry_run)?;
        }
    } else if !dry_run {
        let ids = items(v, "job_ids");
        if !ids.is_empty() {
            writeln!(out, "job ids:")?;
            for id in ids.iter().take(JOB_IDS_SHOWN_MAX) {
                writeln!(out, "  {}", clean_line(&scalar(Some(id))))?;
            }
            if ids.len() > JOB_IDS_SHOWN_MAX {
                writeln!(
                    out,
                    "  … and {} more (--json for all)",
                    ids.len() - JOB_IDS_SHOWN_MAX
                )?;
            }
        }
    }
    let missing = redrive_not_found(v);
    if !missing.is_empty() {
        writeln!(
            out,
            "not found (or not redrivable): {}",
            clean_line(&missing.join(", "))
        )?;
    }
    if let Some(to) = v.get("to").filter(|t| t.is_object()) {
        writeln!(
            out,
            "sent to: type {}, lane {}",
            clean_line(&text(to, "type")),
            clean_line(&text(to, "lane"))
        )?;
    }
    if let Some(n) = v
        .get("held_skipped")
        .and_then(Value::as_u64)
        .filter(|n| *n > 0)
    {
        writeln!(
            out,
            "skipped {n} held dead letter(s): their jobs failed again after redrives_max redrives; \
             a person redrives one by naming it (--id)"
        )?;
    }
    let refused = items(v, "refused");
    if !refused.is_empty() {
        writeln!(out, "refused by the new type's admission:")?;
        for r in refused.iter().take(JOB_IDS_SHOWN_MAX) {
            writeln!(
                out,
                "  {}  {}",
                clean_line(&text(r, "dead_letter_id")),
                clean_line(&text(r, "message"))
            )?;
        }
    }
    match v.get("skipped_admission_records").and_then(Value::as_u64) {
        Some(n) if n > 0 => writeln!(
            out,
            "skipped {n} admission record(s): nothing valid was admitted, so there is nothing to run again"
        ),
        _ => Ok(()),
    }
}

/// One row per dead letter: which job or broker message, and its result.
fn redrive_items(out: Out, rows: &[Value], dry_run: bool) -> io::Result<()> {
    let mut t = Table::new(vec![
        Column::new("DEAD_LETTER"),
        Column::new("JOB_ID"),
        Column::new("SOURCE"),
        Column::new("MESSAGE_ID"),
        Column::new("RESULT").width_max(ERROR_WIDTH_MAX * 2).flex(),
    ]);
    for r in rows.iter().take(JOB_IDS_SHOWN_MAX) {
        let result = match (dry_run, r.get("error").and_then(Value::as_str)) {
            (true, _) => "would be redriven".to_owned(),
            (false, Some(e)) if r.get("redriven") == Some(&Value::Bool(true)) => {
                format!("redriven, but: {e}")
            }
            (false, Some(e)) => format!("not redriven: {e}"),
            (false, None) => "redriven".to_owned(),
        };
        t.push([
            text(r, "dead_letter_id"),
            text(r, "job_id"),
            text(r, "source"),
            text(r, "message_id"),
            result,
        ]);
    }
    write_lines(out, &t.lines(None), "")?;
    if rows.len() > JOB_IDS_SHOWN_MAX {
        writeln!(
            out,
            "… and {} more (--json for all)",
            rows.len() - JOB_IDS_SHOWN_MAX
        )?;
    }
    Ok(())
}

/// The requested ids a redrive or purge reply names as matching nothing
/// (redrive: nothing redrivable).
pub fn redrive_not_found(v: &Value) -> Vec<String> {
    items(v, "not_found")
        .iter()
        .map(|x| scalar(Some(x)))
        .collect()
}

/// How many dead letters of a redrive reply were not redriven, for the
/// exit status.
pub fn redrive_failures(v: &Value) -> usize {
    items(v, "items")
        .iter()
        .filter(|r| r.get("error").is_some_and(|e| !e.is_null()))
        .filter(|r| r.get("redriven") != Some(&Value::Bool(true)))
        .count()
}

/// `POST /v1/dead-letters/{id}/redrive`: what went back, and what it replaced.
pub fn corrected(out: Out, v: &Value) -> io::Result<()> {
    let mut pairs = vec![("redriven", text(v, "dead_letter_id"))];
    if v.get("source").is_some_and(|s| !s.is_null()) {
        pairs.push(("source", text(v, "source")));
        pairs.push(("message_id", text(v, "message_id")));
    } else {
        pairs.push(("job_id", text(v, "job_id")));
    }
    pairs.extend([
        ("payload_size", text(v, "payload_size")),
        ("payload_sha256", text(v, "payload_sha256")),
        ("previous_sha256", text(v, "previous_payload_sha256")),
    ]);
    fields(out, &pairs)?;
    if let Some(w) = v.get("warning").and_then(Value::as_str) {
        writeln!(out, "warning: {}", clean_line(w))?;
    }
    Ok(())
}

/// `POST /v1/dead-letters/purge`.
pub fn purged(out: Out, v: &Value) -> io::Result<()> {
    fields(out, &[("purged", text(v, "purged"))])?;
    let missing = redrive_not_found(v);
    if !missing.is_empty() {
        writeln!(out, "not found: {}", clean_line(&missing.join(", ")))?;
    }
    Ok(())
}

/// `GET /v1/tokens`: one row per token, never a secret.
pub fn tokens(out: Out, v: &Value, width: Option<usize>) -> io::Result<()> {
    let rows = items(v, "items");
    if rows.is_empty() {
        return writeln!(out, "no tokens");
    }
    let mut t = Table::new(vec![
        Column::new("NAME"),
        Column::new("ROLE"),
        Column::new("SOURCE"),
        Column::new("CREATED_AT"),
        Column::new("CREATED_BY"),
    ]);
    for r in rows {
        t.push([
            text(r, "name"),
            text(r, "role"),
            text(r, "source"),
            short_time(r, "created_at"),
            text(r, "created_by"),
        ]);
    }
    write_lines(out, &t.lines(width), "")
}

/// `POST /v1/tokens`: the secret, with the warning that it is shown once.
pub fn token_created(out: Out, v: &Value) -> io::Result<()> {
    fields(
        out,
        &[
            ("name", text(v, "name")),
            ("role", text(v, "role")),
            ("token", text(v, "token")),
        ],
    )?;
    writeln!(
        out,
        "the token is shown this once: store it now (the server keeps only its SHA-256)"
    )
}

/// `DELETE /v1/tokens/{name}`.
pub fn token_revoked(out: Out, v: &Value) -> io::Result<()> {
    fields(out, &[("revoked", text(v, "name"))])
}

/// `GET /v1/stats`: the contract leaves its shape open, so it is shown as
/// a tree: scalars as `key: value`, objects as indented sections, lists of
/// objects as tables.
pub fn stats(out: Out, v: &Value, width: Option<usize>) -> io::Result<()> {
    match v {
        Value::Object(_) => tree(out, v, 0, width),
        other => writeln!(out, "{}", clean_line(&scalar(Some(other)))),
    }
}

fn tree(out: Out, v: &Value, depth: usize, width: Option<usize>) -> io::Result<()> {
    let Value::Object(map) = v else {
        return Ok(());
    };
    let indent = "  ".repeat(depth);
    let is_section = |x: &Value| x.as_object().is_some_and(|m| !m.is_empty()) || is_table(x);
    let label_width = map
        .iter()
        .filter(|(_, x)| !is_section(x))
        .map(|(k, _)| k.chars().count() + 1)
        .max()
        .unwrap_or(0);
    for (key, value) in map {
        let key = clean_line(key);
        match value {
            Value::Object(m) if !m.is_empty() => {
                writeln!(out, "{indent}{key}:")?;
                tree(out, value, depth + 1, width)?;
            }
            Value::Array(rows) if is_table(value) => {
                writeln!(out, "{indent}{key}:")?;
                let lines =
                    object_table(rows).lines(width.map(|w| w.saturating_sub(indent.len() + 2)));
                write_lines(out, &lines, &format!("{indent}  "))?;
            }
            Value::Object(_) | Value::Array(_) => {
                let xs = value.as_array().map_or(&[][..], Vec::as_slice);
                let label = format!("{key}:");
                let joined = if xs.is_empty() {
                    "(none)".to_owned()
                } else {
                    xs.iter()
                        .map(|x| scalar(Some(x)))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                writeln!(
                    out,
                    "{indent}{label:<label_width$}  {}",
                    clean_line(&joined)
                )?;
            }
            scalar_value => {
                let label = format!("{key}:");
                writeln!(
                    out,
                    "{indent}{label:<label_width$}  {}",
                    clean_line(&scalar(Some(scalar_value)))
                )?;
            }
        }
    }
    Ok(())
}

fn is_table(v: &Value) -> bool {
    v.as_array()
        .is_some_and(|xs| !xs.is_empty() && xs.iter().all(Value::is_object))
}

/// A table over a list of objects: one column per key, in first-seen order.
fn object_table(rows: &[Value]) -> Table {
    let mut keys: Vec<&str> = Vec::new();
    for row in rows.iter().filter_map(Value::as_object) {
        for k in row.keys() {
            if !keys.contains(&k.as_str()) {
                keys.push(k);
            }
        }
    }
    let columns = keys
        .iter()
        .map(|k| {
            let header = k.to_uppercase();
            let numeric = rows.iter().all(|r| r.get(*k).is_none_or(Value::is_number));
            let col = Column::new(header).width_max(ERROR_WIDTH_MAX);
            if numeric { col.right() } else { col }
        })
        .collect();
    let mut t = Table::new(columns);
    for row in rows {
        t.push(keys.iter().map(|k| scalar(row.get(*k))));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(f: impl FnOnce(Out) -> io::Result<()>) -> String {
        let mut buf = Vec::new();
        f(&mut buf).unwrap();
        String::from_utf8(buf).unwrap()
    }

    #[test]
    fn enqueue_prints_id_state_and_admission() {
        let v = json!({"id": "j1", "state": "queued", "admission": "ADMITTED"});
        assert_eq!(
            render(|o| enqueued(o, &v)),
            "id:         j1\nstate:      queued\nadmission:  ADMITTED\n"
        );
        let v = json!({"id": "j0", "state": "succeeded", "admission": "DUPLICATE"});
        assert!(render(|o| enqueued(o, &v)).contains("already admitted"));
    }

    fn dead_letter_json() -> Value {
        json!({
            "id": "d1", "job_id": "j1", "type": "send_email", "tenant": "acme",
            "lane": "default", "reason": "exhausted", "stage": "processing", "attempts": 5,
            "error": {"class": "transient", "kind": "http_503",
                      "message": "upstream unavailable\nretry later",
                      "traceback": "at send()\n  at main()"},
            "history": [
                {"attempt": 1, "started_at": "2026-01-02T03:04:05.678Z",
                 "ended_at": "2026-01-02T03:04:06Z", "worker_id": "w-1",
                 "outcome": "failed", "error": {"kind": "http_503", "message": "down"}}
            ],
            "idempotency_key": null, "created_at": "2026-01-02T03:04:00Z",
            "dead_lettered_at": "2026-01-02T03:09:00.123456Z",
            "payload_size": 10000, "payload_sha256": "ab12",
            "payload_preview": "{\"to\": \"a@b\""
        })
    }

    #[test]
    fn a_dead_letter_page_is_a_table_with_its_cursor() {
        let v = json!({"items": [dead_letter_json()], "next_cursor": "c2"});
        assert_eq!(
            render(|o| dead_letters(o, &v, None)),
            "ID  JOB_ID  TYPE        TENANT  LANE     REASON     STAGE       ATTEMPTS  DEAD_LETTERED_AT      ERROR\n\
             d1  j1      send_email  acme    default  exhausted  processing         5  2026-01-02T03:09:00Z  http_503: upstream unavailable retry later\n\
             next cursor: c2  (add --cursor to see the next page)\n"
        );
        let last = json!({"items": [dead_letter_json()], "next_cursor": null});
        assert!(
            render(|o| dead_letters(o, &last, None)).ends_with("next cursor: none (last page)\n")
        );
        let empty = json!({"items": [], "next_cursor": null});
        assert_eq!(
            render(|o| dead_letters(o, &empty, None)),
            "no dead letters match\n"
        );
    }

    #[test]
    fn a_long_error_is_cut_to_the_terminal() {
        let mut d = dead_letter_json();
        d["error"]["message"] = json!("ä".repeat(500));
        let v = json!({"items": [d], "next_cursor": null});
        let out = render(|o| dead_letters(o, &v, None));
        let row = out.lines().nth(1).unwrap();
        assert!(row.ends_with('…'), "{row}");
        assert!(row.chars().count() < 200);
        let narrow = render(|o| dead_letters(o, &v, Some(120)));
        assert!(
            narrow.lines().nth(1).unwrap().chars().count() <= 120,
            "{narrow}"
        );
    }

    #[test]
    fn a_dead_letter_shows_error_traceback_history_and_preview() {
        let out = render(|o| dead_letter(o, &dead_letter_json(), None));
        assert!(
            out.starts_with("id:                d1\njob_id:            j1\n"),
            "{out}"
        );
        assert!(out.contains("\nidempotency_key:   -\n"), "{out}");
        assert!(out.contains("\nerror.kind:        http_503\n"), "{out}");
        assert!(
            out.contains("\nerror.message:     upstream unavailable retry later\n"),
            "{out}"
        );
        assert!(
            out.contains("\ntraceback:\n  at send()\n    at main()\n"),
            "{out}"
        );
        assert!(out.contains(
            "\nhistory:\n  ATTEMPT  STARTED_AT            ENDED_AT              WORKER  OUTCOME  ERROR\n        \
             1  2026-01-02T03:04:05Z  2026-01-02T03:04:06Z  w-1     failed   http_503: down\n"
        ), "{out}");
        assert!(out.ends_with(
            "\npayload preview (first 12 of 10000 bytes; `lazaret dlq payload d1` for all):\n  {\"to\": \"a@b\"\n"
        ), "{out}");
    }

    #[test]
    fn a_job_shows_its_summary_and_history() {
        let v = json!({
            "id": "j1", "type": "resize", "tenant": "acme", "lane": "batch",
            "state": "scheduled", "attempt": 2, "idempotency_key": "k",
            "payload": {"w": 10}, "created_at": "2026-01-02T03:04:00Z", "run_at": null,
            "history": []
        });
        assert_eq!(
            render(|o| job(o, &v, None)),
            "id:               j1\ntype:             resize\ntenant:           acme\n\
             lane:             batch\nstate:            scheduled\nattempt:          2\n\
             idempotency_key:  k\ncreated_at:       2026-01-02T03:04:00Z\nrun_at:           -\n\
             payload:          {\"w\":10}\n\nhistory: none\n"
        );
    }

    #[test]
    fn a_large_job_payload_is_cut() {
        let v = json!({"id": "j1", "payload": {"blob": "x".repeat(1000)}, "history": []});
        let out = render(|o| job(o, &v, None));
        let line = out.lines().find(|l| l.starts_with("payload:")).unwrap();
        assert!(
            line.ends_with("x…  (cut; --json for the whole payload)"),
            "{line}"
        );
    }

    #[test]
    fn reasons_are_a_table() {
        let v = json!({"reasons": [
            {"reason": "schema_invalid", "type": "send_email", "count": 12,
             "first_at": "2026-01-01T00:00:00Z", "last_at": "2026-01-02T00:00:00.5Z"},
            {"reason": "crash_loop", "type": null, "count": 3,
             "first_at": "2026-01-01T00:00:00Z", "last_at": "2026-01-01T00:00:00Z"}
        ]});
        assert_eq!(
            render(|o| reasons(o, &v, None)),
            "REASON          TYPE        COUNT  FIRST_AT              LAST_AT\n\
             schema_invalid  send_email     12  2026-01-01T00:00:00Z  2026-01-02T00:00:00Z\n\
             crash_loop      -               3  2026-01-01T00:00:00Z  2026-01-01T00:00:00Z\n"
        );
    }

    #[test]
    fn redrive_and_purge_print_their_counts() {
        let v = json!({"matched": 3, "redriven": 3, "job_ids": ["j1", "j2", "j3"]});
        assert_eq!(
            render(|o| redriven(o, &v, false)),
            "matched:   3\nredriven:  3\njob ids:\n  j1\n  j2\n  j3\n"
        );
        let v = json!({"matched": 3, "redriven": 0, "job_ids": []});
        assert_eq!(
            render(|o| redriven(o, &v, true)),
            "matched:   3\nredriven:  0\ndry run: nothing was redriven\n"
        );
        let many: Vec<String> = (0..25).map(|i| format!("j{i}")).collect();
        let v = json!({"matched": 25, "redriven": 25, "job_ids": many});
        assert!(render(|o| redriven(o, &v, false)).ends_with("  … and 5 more (--json for all)\n"));
        assert_eq!(render(|o| purged(o, &json!({"purged": 7}))), "purged:  7\n");
        assert_eq!(
            render(|o| purged(o, &json!({"purged": 1, "not_found": ["9", "12"]}))),
            "purged:  1\nnot found: 9, 12\n"
        );
    }

    fn broker_dead_letter_json() -> Value {
        let mut d = dead_letter_json();
        d["id"] = json!("d2");
        d["job_id"] = Value::Null;
        d["type"] = json!("tasks.charge");
        d["stage"] = json!("broker");
        d["reason"] = json!("delivery_limit");
        d["source"] = json!({
            "name": "orders", "broker": "rabbitmq", "queue": "orders",
            "message_id": "task-7", "position": {"delivery_tag": 3},
            "headers": {"task": "tasks.charge", "id": "task-7", "x-evil\u{1b}[2J": "a\nb"},
            "content_type": "application/json"
        });
        d["celery"] = json!({
            "task": "tasks.charge", "id": "task-7", "retries": 2,
            "arguments": {"args": ["order-1", 4200], "kwargs": {"currency": "EUR"}}
        });
        d
    }

    #[test]
    fn a_page_with_broker_messages_gets_a_source_column() {
        let v =
            json!({"items": [broker_dead_letter_json(), dead_letter_json()], "next_cursor": null});
        let out = render(|o| dead_letters(o, &v, None));
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].starts_with("ID  JOB_ID  SOURCE  TYPE"), "{out}");
        assert!(
            lines[1].starts_with("d2  -       orders  tasks.charge"),
            "{out}"
        );
        assert!(
            lines[2].starts_with("d1  j1      -       send_email"),
            "{out}"
        );
    }

    #[test]
    fn a_broker_dead_letter_shows_its_source_and_celery_task() {
        let out = render(|o| dead_letter(o, &broker_dead_letter_json(), None));
        assert!(
            out.contains(
                "\nsource:\n  name:          orders\n  broker:        rabbitmq\n  queue:         orders\n  \
                 message_id:    task-7\n  position:      {\"delivery_tag\":3}\n  content_type:  application/json\n"
            ),
            "{out}"
        );
        assert!(
            out.contains("\n  headers:\n    id:          task-7\n    task:        tasks.charge\n"),
            "{out}"
        );
        assert!(
            !out.contains('\u{1b}'),
            "no escape reaches the terminal: {out}"
        );
        assert!(
            out.contains(
                "\ncelery task:\n  task:     tasks.charge\n  id:       task-7\n  retries:  2\n  \
                 args:     [\"order-1\",4200]\n  kwargs:   {\"currency\":\"EUR\"}\n"
            ),
            "{out}"
        );
        let mut repr = broker_dead_letter_json();
        repr["celery"]["arguments"] = json!({"argsrepr": "('order-1', 4200)", "kwargsrepr": "{}"});
        let out = render(|o| dead_letter(o, &repr, None));
        assert!(out.contains("  argsrepr:    ('order-1', 4200)\n"), "{out}");
        // lazaret's own jobs show neither block.
        let own = render(|o| dead_letter(o, &dead_letter_json(), None));
        assert!(!own.contains("source:") && !own.contains("celery"), "{own}");
    }

    #[test]
    fn a_redrive_prints_each_dead_letters_result() {
        let v = json!({
            "matched": 3, "redriven": 2, "job_ids": ["j1"],
            "items": [
                {"dead_letter_id": "d1", "job_id": "j1", "source": null, "message_id": null, "redriven": true, "error": null},
                {"dead_letter_id": "d2", "job_id": null, "source": "orders", "message_id": "m-7", "redriven": true, "error": null},
                {"dead_letter_id": "d3", "job_id": null, "source": "orders", "message_id": "m-8", "redriven": false,
                 "error": "redis: the publish to orders was not confirmed"}
            ],
            "not_found": ["d9"], "dry_run": false, "skipped_admission_records": 1
        });
        assert_eq!(
            render(|o| redriven(o, &v, false)),
            "matched:   3\nredriven:  2\n\
             DEAD_LETTER  JOB_ID  SOURCE  MESSAGE_ID  RESULT\n\
             d1           j1      -       -           redriven\n\
             d2           -       orders  m-7         redriven\n\
             d3           -       orders  m-8         not redriven: redis: the publish to orders was not confirmed\n\
             not found (or not redrivable): d9\n\
             skipped 1 admission record(s): nothing valid was admitted, so there is nothing to run again\n"
        );
        assert_eq!(redrive_failures(&v), 1);
        let dry = json!({"matched": 1, "redriven": 0, "job_ids": [], "dry_run": true, "not_found": [],
            "items": [{"dead_letter_id": "d2", "job_id": null, "source": "orders", "message_id": "m-7"}]});
        assert_eq!(
            render(|o| redriven(o, &dry, true)),
            "matched:   1\nredriven:  0\ndry run: nothing was redriven\n\
             DEAD_LETTER  JOB_ID  SOURCE  MESSAGE_ID  RESULT\n\
             d2           -       orders  m-7         would be redriven\n"
        );
        assert_eq!(redrive_failures(&dry), 0);
    }

    #[test]
    fn stats_render_as_a_tree() {
        let v = json!({
            "breakers": [{"kind": "http_503", "state": "open", "type": "send_email"}],
            "dead_letters": {"by_reason": {"exhausted": 4}, "total": 4},
            "lanes": [],
            "queue_depth": 17
        });
        assert_eq!(
            render(|o| stats(o, &v, None)),
            "breakers:\n  KIND      STATE  TYPE\n  http_503  open   send_email\n\
             dead_letters:\n  by_reason:\n    exhausted:  4\n  total:  4\n\
             lanes:        (none)\nqueue_depth:  17\n"
        );
    }

    #[test]
    fn error_summaries() {
        assert_eq!(error_summary(None), "-");
        assert_eq!(error_summary(Some(&Value::Null)), "-");
        assert_eq!(
            error_summary(Some(&json!({"kind": "parse", "message": ""}))),
            "parse"
        );
        assert_eq!(
            error_summary(Some(&json!({"kind": null, "message": "boom"}))),
            "boom"
        );
    }

    #[test]
    fn jobs_are_a_table_with_their_dead_letter() {
        let v = json!({"items": [
            {"id": "41", "type": "send_email", "tenant": "acme", "lane": "interactive",
             "state": "scheduled", "attempt": 2, "created_at": "2026-12-01T21:00:00.123Z",
             "run_at": "2026-12-01T21:00:04.500Z", "dead_letter_id": null},
            {"id": "40", "type": "resize", "tenant": "globex", "lane": "batch",
             "state": "dead_lettered", "attempt": 5, "created_at": "2026-12-01T20:59:00Z",
             "run_at": null, "dead_letter_id": "7"}
        ], "next_cursor": null});
        expect_test::expect![[r#"
            ID  TYPE        TENANT  LANE         STATE          ATTEMPT  CREATED_AT            RUN_AT                DEAD_LETTER
            41  send_email  acme    interactive  scheduled            2  2026-12-01T21:00:00Z  2026-12-01T21:00:04Z  -
            40  resize      globex  batch        dead_lettered        5  2026-12-01T20:59:00Z  -                     7
            next cursor: none (last page)
        "#]]
        .assert_eq(&render(|o| jobs(o, &v, None)));
        let empty = json!({"items": [], "next_cursor": null});
        assert_eq!(render(|o| jobs(o, &empty, None)), "no jobs match\n");
    }

    #[test]
    fn the_audit_log_is_a_table_with_the_request_on_one_line() {
        let v = json!({"items": [
            {"id": "12", "at": "2026-12-01T21:05:00.250Z", "actor": "ops-alice",
             "action": "redrive", "request": {"filter": {"reason": "exhausted"}, "dry_run": false},
             "count": 3},
            {"id": "11", "at": "2026-12-01T21:04:00Z", "actor": "ci-bot", "action": "denied",
             "request": {"path": "/v1/dead-letters/purge"}, "count": 0}
        ], "next_cursor": "11"});
        expect_test::expect![[r#"
            ID  AT                    ACTOR      ACTION   COUNT  REQUEST
            12  2026-12-01T21:05:00Z  ops-alice  redrive      3  {"dry_run":false,"filter":{"reason":"exhausted"}}
            11  2026-12-01T21:04:00Z  ci-bot     denied       0  {"path":"/v1/dead-letters/purge"}
            next cursor: 11  (add --cursor to see the next page)
        "#]]
        .assert_eq(&render(|o| audit(o, &v, None)));
    }

    #[test]
    fn breakers_show_open_and_half_open_ones_only() {
        let v = json!({"breakers": [
            {"type": "send_email", "kind": "http_503", "state": "open", "until": "2026-12-01T21:00:10.900Z"},
            {"type": "send_email", "kind": "timeout", "state": "half_open", "until": null},
            {"type": "resize", "kind": "oom", "state": "closed", "until": null}
        ]});
        expect_test::expect![[r#"
            TYPE        KIND      STATE      UNTIL
            send_email  http_503  open       2026-12-01T21:00:10Z
            send_email  timeout   half_open  -
        "#]]
        .assert_eq(&render(|o| breakers(o, &v, None)));
        let none = json!({"breakers": []});
        assert_eq!(
            render(|o| breakers(o, &none, None)),
            "every breaker is closed: all types are leased\n"
        );
    }
}
