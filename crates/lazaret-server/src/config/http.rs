//! `[http]`: connection timeouts, the connection cap, the shutdown grace
//! and the Host names answered without tokens.

use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, Ctx, Ms, ServerConfig, root};

/// `[http]`: connection timeouts, the connection cap and the shutdown grace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HttpConfig {
    /// From a request's first byte to the end of its headers
    /// (`header_read_timeout_ms`).
    pub header_read_timeout: Duration,
    /// Longest wait for the next piece of a request body
    /// (`body_read_timeout_ms`).
    pub body_read_timeout: Duration,
    /// A connection with no request running and no bytes moving for this
    /// long is closed (`idle_timeout_ms`).
    pub idle_timeout: Duration,
    /// Open connections at most; `None`: derived from the file-descriptor
    /// limit at start.
    pub connections_max: Option<usize>,
    /// After SIGTERM, how long requests under way may take
    /// (`shutdown_grace_ms`).
    pub shutdown_grace: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            header_read_timeout: Duration::from_millis(10_000),
            body_read_timeout: Duration::from_millis(30_000),
            idle_timeout: Duration::from_millis(75_000),
            connections_max: None,
            shutdown_grace: Duration::from_millis(10_000),
        }
    }
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table with header_read_timeout_ms, body_read_timeout_ms, idle_timeout_ms, connections_max, shutdown_grace_ms, allowed_hosts"
)]
pub(super) struct RawHttp {
    header_read_timeout_ms: Option<Ms>,
    body_read_timeout_ms: Option<Ms>,
    idle_timeout_ms: Option<Ms>,
    connections_max: Option<usize>,
    shutdown_grace_ms: Option<Ms>,
    allowed_hosts: Option<Vec<String>>,
}

/// An `[http] allowed_hosts` entry, checked and in lower case: a host name
/// or address as a browser sends it in `Host`, with or without a port.
fn allowed_host(entry: &str) -> Result<String, String> {
    let e = entry.trim();
    let example = "write it as it appears in the Host header, e.g. \"lazaret.example.com\" or \"lazaret.example.com:8443\"";
    if e.is_empty() {
        return Err(format!("an allowed_hosts entry is empty; {example}"));
    }
    if e.contains('*') {
        return Err(format!(
            "allowed_hosts entry {e:?} holds a wildcard, which would answer every name a rebinding \
             page could use; list each name ({example})"
        ));
    }
    if e.contains("://") || e.contains('/') {
        return Err(format!(
            "allowed_hosts entry {e:?} must be a host name without a scheme or path; {example}"
        ));
    }
    let (name, port) = match e.strip_prefix('[') {
        Some(rest) => match rest.split_once(']') {
            Some((v6, tail))
                if v6
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() || b":.".contains(&b)) =>
            {
                (
                    v6,
                    tail.strip_prefix(':')
                        .or(if tail.is_empty() { None } else { Some(tail) }),
                )
            }
            _ => {
                return Err(format!(
                    "allowed_hosts entry {e:?} is not a [IPv6] address; {example}"
                ));
            }
        },
        None => match e.rsplit_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (e, None),
        },
    };
    let name_ok = e.starts_with('[')
        || (!name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b)));
    let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok());
    if !name_ok || !port_ok {
        return Err(format!(
            "allowed_hosts entry {e:?} is not a host name or host:port; {example}"
        ));
    }
    Ok(e.to_ascii_lowercase())
}

impl Ctx<'_> {
    pub(super) fn http(&self, h: &RawHttp, cfg: &mut ServerConfig) -> Result<(), ConfigError> {
        let path = root("http");
        let positive = |key: &str, v: u64| {
            if v == 0 {
                Err(self.invalid(
                    &path.key(key),
                    format!("{key} must be at least 1 (got 0); leave it out for the default"),
                ))
            } else {
                Ok(Duration::from_millis(v))
            }
        };
        if let Some(Ms(v)) = h.header_read_timeout_ms {
            cfg.http.header_read_timeout = positive("header_read_timeout_ms", v)?;
        }
        if let Some(Ms(v)) = h.body_read_timeout_ms {
            cfg.http.body_read_timeout = positive("body_read_timeout_ms", v)?;
        }
        if let Some(Ms(v)) = h.idle_timeout_ms {
            cfg.http.idle_timeout = positive("idle_timeout_ms", v)?;
        }
        if let Some(v) = h.shutdown_grace_ms {
            cfg.http.shutdown_grace = v.duration();
        }
        if let Some(v) = h.connections_max {
            cfg.http.connections_max = (v > 0).then_some(v);
        }
        for entry in h.allowed_hosts.iter().flatten() {
            cfg.allowed_hosts.push(
                allowed_host(entry).map_err(|why| self.invalid(&path.key("allowed_hosts"), why))?,
            );
        }
        Ok(())
    }
}
