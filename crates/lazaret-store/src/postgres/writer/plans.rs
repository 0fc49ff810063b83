//! For the unit tests of the writer's statements' plans: a scratch schema
//! with jobs in it, and what a simple query of `PREPARE`, `EXECUTE`,
//! `pg_prepared_statements` and `EXPLAIN EXECUTE` answered.

use tokio_postgres::{Client, SimpleQueryMessage};

use super::super::{PgOptions, connect, drop_schema, migrate};

/// A migrated schema of its own (`lz_NAME_PID`) with `jobs_sql` run in it
/// (the jobs to plan over, inserted without statistics), or `None` with a
/// visible skip when `LAZARET_TEST_PG_URL` is unset.
pub(super) async fn scratch(name: &str, jobs_sql: &str) -> Option<(PgOptions, Client)> {
    let url = lazaret_testkit::service("LAZARET_TEST_PG_URL", "postgres://…", name)?;
    let schema = format!(
        "lz_{}_{}",
        name.replace(|c: char| !c.is_ascii_alphanumeric(), "_"),
        std::process::id()
    );
    let opts = PgOptions::from_url(&format!("{url}?schema={schema}")).expect("a URL");
    migrate(&opts).await.expect("migrated");
    let c = connect(&opts, None).await.expect("connected");
    c.batch_execute(jobs_sql).await.expect("jobs");
    Some((opts, c))
}

/// What a simple query answered, its schema dropped: every row, each as
/// its columns' text.
pub(super) async fn answered(
    opts: &PgOptions,
    c: &Client,
    script: &str,
) -> Vec<Vec<Option<String>>> {
    let replies = c.simple_query(script).await.expect("ran");
    drop_schema(opts).await.expect("dropped");
    replies
        .iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => {
                Some((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect())
            }
            _ => None,
        })
        .collect()
}

/// A prepared statement's (generic, custom) plans so far, from the row of
/// `SELECT generic_plans, custom_plans FROM pg_prepared_statements`.
pub(super) fn plan_counts(rows: &[Vec<Option<String>>]) -> (i64, i64) {
    let n = |v: &Option<String>| v.as_deref().and_then(|v| v.parse::<i64>().ok());
    rows.iter()
        .find_map(|r| match r.as_slice() {
            [g, c] => Some((n(g)?, n(c)?)),
            _ => None,
        })
        .expect("the statement's plan counts")
}

/// The plan `EXPLAIN` answered: the one-column rows, as lines.
pub(super) fn plan_text(rows: &[Vec<Option<String>>]) -> String {
    rows.iter()
        .filter_map(|r| match r.as_slice() {
            [Some(line)] => Some(line.as_str()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("\n")
}
