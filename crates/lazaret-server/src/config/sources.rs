//! `[[sources]]`: the broker queues `lazaret serve` guards or watches.

use std::time::Duration;

use lazaret_core::Lane;
use lazaret_guard::{BrokerKind, DeliverFormat, Mode, SourceSpec, TenantFrom};
use serde::Deserialize;

use super::{ConfigError, Ctx, Ms, RawConfig, root};

/// `[[sources]]`: exactly the contract's keys, plus `lane`.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a source table with name, broker, url, queue and (for a guard) deliver"
)]
pub(super) struct RawSource {
    name: Option<String>,
    broker: Option<String>,
    url: Option<String>,
    queue: Option<String>,
    group: Option<String>,
    mode: Option<String>,
    deliver: Option<String>,
    deliver_format: Option<String>,
    #[serde(rename = "type")]
    job_type: Option<String>,
    tenant: Option<String>,
    tenant_header: Option<String>,
    lane: Option<String>,
    concurrency: Option<u32>,
    settling: Option<u32>,
    delivery_timeout_ms: Option<Ms>,
    redrive_to: Option<String>,
    redrive_allow: Option<Vec<String>>,
    receives_in_flight: Option<u32>,
}

impl Ctx<'_> {
    /// Every `[[sources]]` entry as a [`SourceSpec`], with the contract's
    /// defaults filled in.
    pub(super) fn sources(&self, raw: &RawConfig) -> Result<Vec<SourceSpec>, ConfigError> {
        let mut out: Vec<SourceSpec> = Vec::with_capacity(raw.sources.len());
        for (i, s) in raw.sources.iter().enumerate() {
            let path = root("sources").index(i);
            // A present key that is blank is as wrong as a missing one, but
            // is reported on its own line.
            let text = |key: &str, v: &Option<String>| -> Result<Option<String>, ConfigError> {
                match v {
                    Some(t) if t.trim().is_empty() => Err(self.invalid(
                        &path.key(key),
                        format!("{key} is empty; give a value or remove the key"),
                    )),
                    Some(t) => Ok(Some(t.clone())),
                    None => Ok(None),
                }
            };
            let required = |key: &str, v: &Option<String>, hint: &str| {
                text(key, v)?.ok_or_else(|| {
                    self.invalid(
                        &path.key(key),
                        format!("every source needs {key}: add {key} = {hint}"),
                    )
                })
            };

            let name = required(
                "name",
                &s.name,
                "\"orders\" (unique; dead letters and metrics carry it)",
            )?;
            let name_ok = name.len() <= 64
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
            if !name_ok {
                return Err(self.invalid(
                    &path.key("name"),
                    format!(
                        "source name {name:?} may hold only ASCII letters, digits, `_`, `-` and `.`, at most 64 of them: it travels in HTTP headers (Lazaret-Source) and metric labels; rename it"
                    ),
                ));
            }
            if let Some(j) = out.iter().position(|o| o.name == name) {
                return Err(self.invalid(
                    &path.key("name"),
                    format!(
                        "source name `{name}` is already used by sources[{j}]{}; dead letters are filed and redriven by source name, so rename one",
                        self.on_line(&root("sources").index(j).key("name"))
                    ),
                ));
            }

            let word = required("broker", &s.broker, &BrokerKind::words())?;
            let broker = match BrokerKind::parse(&word) {
                Some(b) => b,
                None => {
                    return Err(self.invalid(
                        &path.key("broker"),
                        format!("unknown broker \"{word}\": use {}", BrokerKind::words()),
                    ));
                }
            };

            let url = required("url", &s.url, &BrokerKind::url_forms())?;
            if let Some(other) = BrokerKind::from_url(&url).filter(|b| *b != broker) {
                return Err(self.invalid(
                    &path.key("url"),
                    format!(
                        "this is a {} URL but broker = \"{}\": fix the url or the broker",
                        other.as_str(),
                        broker.as_str()
                    ),
                ));
            }
            let queue = required(
                "queue",
                &s.queue,
                "\"orders\" (the RabbitMQ queue, JetStream stream or Redis stream)",
            )?;

            let mode = match s.mode.as_deref() {
                None | Some("guard") => Mode::Guard,
                Some("watch") => Mode::Watch,
                Some(other) => {
                    return Err(self.invalid(
                        &path.key("mode"),
                        format!(
                            "unknown mode \"{other}\": use \"guard\" (deliver each message to `deliver`) or \"watch\" (take in a dead-letter queue)"
                        ),
                    ));
                }
            };
            let deliver = text("deliver", &s.deliver)?;
            match (mode, &deliver) {
                (Mode::Guard, None) => {
                    return Err(self.invalid(
                        &path.key("deliver"),
                        "a guard source needs deliver = \"http://…\", the URL each message is POSTed to (or mode = \"watch\" for a dead-letter queue)",
                    ));
                }
                (Mode::Guard, Some(d))
                    if !(d.starts_with("http://") || d.starts_with("https://")) =>
                {
                    return Err(self.invalid(
                        &path.key("deliver"),
                        format!("deliver {d:?} is not an http:// or https:// URL; give the URL of the team's handler"),
                    ));
                }
                (Mode::Watch, Some(_)) => {
                    return Err(self.invalid(
                        &path.key("deliver"),
                        "a watch source delivers nothing (it takes a dead-letter queue in): remove deliver, or set mode = \"guard\"",
                    ));
                }
                _ => {}
            }

            let job_type = text("type", &s.job_type)?.unwrap_or_else(|| name.clone());
            if s.job_type.is_some() {
                self.not_blank(&path.key("type"), &job_type, "job type")?;
            }
            let deliver_format = match s.deliver_format.as_deref() {
                None => DeliverFormat::Raw,
                Some(word) => DeliverFormat::parse(word).ok_or_else(|| {
                    self.invalid(
                        &path.key("deliver_format"),
                        format!(
                            "unknown deliver_format {word:?}: use \"raw\" (the body byte for byte, the default) or \"envelope\" (one JSON object with the body and every header)"
                        ),
                    )
                })?,
            };
            if mode == Mode::Watch && s.deliver_format.is_some() {
                return Err(self.invalid(
                    &path.key("deliver_format"),
                    "a watch source delivers nothing: remove deliver_format, or set mode = \"guard\"",
                ));
            }
            let mut spec = match mode {
                Mode::Guard => SourceSpec::guard(&name, broker, &url, &queue, job_type),
                Mode::Watch => SourceSpec::watch(&name, broker, &url, &queue, job_type),
            };
            spec.deliver = deliver;
            spec.deliver_format = deliver_format;
            if let Some(g) = text("group", &s.group)? {
                spec.group = g;
            }
            spec.tenant = match (
                text("tenant", &s.tenant)?,
                text("tenant_header", &s.tenant_header)?,
            ) {
                (Some(_), Some(_)) => {
                    return Err(self.invalid(
                        &path.key("tenant_header"),
                        "set either tenant (one tenant for every message) or tenant_header (read from each message), not both",
                    ));
                }
                (Some(t), None) => {
                    self.not_blank(&path.key("tenant"), &t, "tenant")?;
                    TenantFrom::Fixed(t)
                }
                (None, Some(h)) => TenantFrom::Header(h),
                (None, None) => TenantFrom::Fixed("default".into()),
            };
            if let Some(l) = text("lane", &s.lane)? {
                self.not_blank(&path.key("lane"), &l, "lane")?;
                spec.lane = Lane::new(l.as_str());
            }
            if let Some(n) = s.concurrency {
                if n == 0 {
                    return Err(self.invalid(
                        &path.key("concurrency"),
                        "concurrency must be at least 1 (got 0), or nothing is ever delivered; to hold a source, pause its type or lane",
                    ));
                }
                spec.concurrency = n;
            }
            spec.settling = s.settling;
            if let Some(n) = s.receives_in_flight {
                if n == 0 {
                    return Err(self.invalid(
                        &path.key("receives_in_flight"),
                        "receives_in_flight must be at least 1 (got 0), or nothing is ever received; the default is 2",
                    ));
                }
                spec.receives_in_flight = n;
            }
            if let Some(Ms(v)) = s.delivery_timeout_ms {
                if v == 0 {
                    return Err(self.invalid(
                        &path.key("delivery_timeout_ms"),
                        "delivery_timeout_ms must be at least 1 (got 0), or every delivery times out",
                    ));
                }
                spec.delivery_timeout = Duration::from_millis(v);
            }
            spec.redrive_to = text("redrive_to", &s.redrive_to)?;
            if let Some(allow) = &s.redrive_allow {
                if mode == Mode::Guard {
                    return Err(self.invalid(
                        &path.key("redrive_allow"),
                        "redrive_allow is for watch sources (a guard redrives to its own queue, or redrive_to): remove it",
                    ));
                }
                if let Some(bad) = allow.iter().find(|q| q.trim().is_empty()) {
                    return Err(self.invalid(
                        &path.key("redrive_allow"),
                        format!("redrive_allow lists an empty queue name ({bad:?}): remove it"),
                    ));
                }
                spec.redrive_allow.clone_from(allow);
            }
            // A guard and a watch on one queue: the watch would take half
            // the healthy traffic in as dead letters.
            if let Some(j) = out.iter().position(|o| {
                o.mode != spec.mode
                    && o.broker == spec.broker
                    && o.queue == spec.queue
                    && same_server(&o.url, &spec.url)
            }) {
                let (guard, watch) = match spec.mode {
                    Mode::Guard => (&spec.name, &out[j].name),
                    Mode::Watch => (&out[j].name, &spec.name),
                };
                return Err(self.invalid(
                    &path.key("queue"),
                    format!(
                        "sources `{guard}` (guard) and `{watch}` (watch) both read queue {:?} on the same broker{}: the watch would take the guard's healthy messages in as dead letters; point the watch source at the dead-letter queue",
                        spec.queue,
                        self.on_line(&root("sources").index(j).key("queue"))
                    ),
                ));
            }
            out.push(spec);
        }
        // A watch source may redrive to the queues of the config's own
        // sources on its broker (besides `redrive_to` and its list).
        let queues: Vec<(BrokerKind, String)> =
            out.iter().map(|s| (s.broker, s.queue.clone())).collect();
        for spec in out.iter_mut().filter(|s| s.mode == Mode::Watch) {
            for (broker, queue) in &queues {
                if *broker == spec.broker
                    && *queue != spec.queue
                    && !spec.redrive_allow.contains(queue)
                {
                    spec.redrive_allow.push(queue.clone());
                }
            }
        }
        Ok(out)
    }
}

/// Whether two source URLs name the same broker: equal once the user
/// info (credentials) is left out and the scheme and host lower-cased.
fn same_server(a: &str, b: &str) -> bool {
    fn norm(url: &str) -> String {
        let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
        let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        format!(
            "{}://{}{}",
            scheme.to_ascii_lowercase(),
            host.to_ascii_lowercase(),
            path.trim_end_matches('/')
        )
    }
    norm(a) == norm(b)
}
