//! `[[alerts]]`: webhook targets and their rules.

use std::time::Duration;

use lazaret_core::{AlertEvent, AlertRule};
use serde::Deserialize;

use super::{ConfigError, Ctx, Ms, RawConfig, ServerConfig, root};

/// One `[[alerts]]` entry: where alerts go and which.
#[derive(Clone, Debug, PartialEq)]
pub struct AlertTarget {
    /// The webhook, `http://host:port/path`.
    pub url: String,
    /// Events, cooldown and thresholds.
    pub rule: AlertRule,
}

/// `[[alerts]]`: the contract's keys.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an alert table with url, events, cooldown_ms, poison_rate_per_min, surge_min, surge_share"
)]
pub(super) struct RawAlert {
    url: Option<String>,
    events: Option<Vec<String>>,
    cooldown_ms: Option<Ms>,
    poison_rate_per_min: Option<u64>,
    surge_min: Option<u64>,
    surge_share: Option<f64>,
}
impl Ctx<'_> {
    /// Every `[[alerts]]` entry, its thresholds defaulting to the top-level ones.
    pub(super) fn alerts(
        &self,
        raw: &RawConfig,
        cfg: &ServerConfig,
    ) -> Result<Vec<AlertTarget>, ConfigError> {
        let mut out = Vec::with_capacity(raw.alerts.len());
        for (i, a) in raw.alerts.iter().enumerate() {
            let path = root("alerts").index(i);
            let url = match a.url.as_deref().map(str::trim) {
                None | Some("") => {
                    return Err(self.invalid(
                        &path.key("url"),
                        "every [[alerts]] entry needs url: add url = \"http://127.0.0.1:9099/hook\" (POSTed one JSON body per alert)",
                    ));
                }
                Some(u) => u.to_owned(),
            };
            let host_ok = url
                .strip_prefix("http://")
                .is_some_and(|rest| !rest.is_empty() && !rest.starts_with('/'));
            if !host_ok {
                let hint = if url.starts_with("https://") {
                    "https targets are not supported yet; send to an http:// relay on this host"
                } else {
                    "write it as http://HOST:PORT/PATH"
                };
                return Err(self.invalid(
                    &path.key("url"),
                    format!("url {url:?} is not an http:// URL with a host: {hint}"),
                ));
            }
            let mut rule = AlertRule {
                surge_min: cfg.surge_min,
                surge_share: cfg.surge_share,
                ..AlertRule::default()
            };
            if let Some(events) = &a.events {
                rule.events.clear();
                for (j, e) in events.iter().enumerate() {
                    let event: AlertEvent =
                        e.parse()
                            .map_err(|err: lazaret_core::alerts::UnknownAlertEvent| {
                                self.invalid(&path.key("events").index(j), err.to_string())
                            })?;
                    rule.events.insert(event);
                }
            }
            if let Some(Ms(v)) = a.cooldown_ms {
                rule.cooldown = Duration::from_millis(v);
            }
            if let Some(v) = a.poison_rate_per_min {
                rule.poison_rate_per_min = v;
            }
            if let Some(v) = a.surge_min {
                rule.surge_min = v;
            }
            if let Some(v) = a.surge_share {
                rule.surge_share = v;
            }
            rule.validate().map_err(|e| {
                use lazaret_core::AlertRuleError as E;
                let key = match e {
                    E::NoEvents => "events",
                    E::Cooldown(_) => "cooldown_ms",
                    E::PoisonRate(_) => "poison_rate_per_min",
                    E::SurgeMin(_) => "surge_min",
                    _ => "surge_share",
                };
                self.invalid(&path.key(key), e.to_string())
            })?;
            out.push(AlertTarget { url, rule });
        }
        Ok(out)
    }
}
