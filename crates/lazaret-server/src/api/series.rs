//! `GET /v1/series`: the four signals seed 003 asks operators to watch —
//! DLQ depth, the dead-lettering (poison) rate, redrive outcomes and
//! failure-reason cardinality — per type and per source, and throughput
//! and the oldest ready job's age per lane, over the last hour or day
//! (issue 33, part 5). Read from the samples the store keeps
//! (`Store::signal_samples`), which every node of a cluster shares, so
//! every node answers the same; the dashboard's charts draw this answer.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use lazaret_core::Timestamp;
use lazaret_core::series::{By, Signal, Window, series};
use lazaret_core::time::duration_ms;
use lazaret_store::Store;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

use crate::app::now;
use crate::error::ApiError;
use crate::views;

use super::{ApiResult, Shared, ok};

/// The query of `GET /v1/series`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct SeriesParams {
    /// `1h` (a point per minute; the default) or `24h` (a point per five minutes).
    window: Option<String>,
    /// One signal: `dlq_depth`, `dead_lettered`, `redrive_sent`,
    /// `redrive_succeeded`, `redrive_failed_again`, `failure_reasons`,
    /// `throughput`, `oldest_age_ms`; every signal when absent.
    signal: Option<String>,
    /// `type`, `source` or `lane`; every axis when absent.
    by: Option<String>,
}

fn words<T: Copy>(all: &[T], word: impl Fn(T) -> &'static str) -> String {
    all.iter().map(|t| word(*t)).collect::<Vec<_>>().join(", ")
}

pub(super) async fn series_page<S: Store>(
    State(app): Shared<S>,
    query: Result<Query<SeriesParams>, QueryRejection>,
) -> ApiResult {
    let Query(q) = query.map_err(|e| {
        ApiError::bad_request(format!(
            "{}; the parameters are window, signal and by",
            e.body_text()
        ))
    })?;
    let window = match q.window.as_deref() {
        None | Some("") => Window::Hour,
        Some(w) => Window::parse(w)
            .ok_or_else(|| ApiError::bad_request(format!("unknown window {w:?}; use 1h or 24h")))?,
    };
    let signal = match q.signal.as_deref() {
        None | Some("") => None,
        Some(s) => Some(Signal::parse(s).ok_or_else(|| {
            ApiError::bad_request(format!(
                "unknown signal {s:?}; the signals are {}",
                words(&Signal::ALL, Signal::as_str)
            ))
        })?),
    };
    let by = match q.by.as_deref() {
        None | Some("") => None,
        Some(b) => Some(By::parse(b).ok_or_else(|| {
            ApiError::bad_request(format!(
                "unknown axis {b:?}; use {}",
                words(&By::ALL, By::as_str)
            ))
        })?),
    };
    if let (Some(s), Some(b)) = (signal, by) {
        if !s.axes().contains(&b) {
            return Err(ApiError::bad_request(format!(
                "{} is not broken down by {}; it is by {}",
                s.as_str(),
                b.as_str(),
                words(s.axes(), By::as_str)
            )));
        }
    }
    let now = now();
    let (from, to) = window.range(now);
    let got = app.store.signal_samples(from, to).await?;
    let lines: Vec<_> = series(&got.samples, &got.sampled, window, now)
        .into_iter()
        .filter(|l| signal.is_none_or(|s| l.signal == s) && by.is_none_or(|b| l.by == b))
        .map(|l| {
            json!({
                "signal": l.signal.as_str(),
                "by": l.by.as_str(),
                "name": (!l.name.is_empty()).then_some(l.name),
                "gauge": l.signal.is_gauge(),
                "values": l.points,
            })
        })
        .collect();
    let step = window.step_ms();
    let at: Vec<String> = (0..window.points() as i64)
        .map(|i| views::time(Timestamp::from_millis(from.as_millis() + i * step)))
        .collect();
    ok(json!({
        "window": window.as_str(),
        "step_ms": step,
        "from": views::time(from),
        "to": views::time(to),
        "sample_ms": duration_ms(app.config.retention.series_sample),
        "at": at,
        "series": lines,
    }))
}
