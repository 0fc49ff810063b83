//! [`Client`]: one typed async method per endpoint of the HTTP contract.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use lazaret_core::JobId;
use reqwest::header::{AUTHORIZATION, HeaderValue, RETRY_AFTER};
use reqwest::{Method, StatusCode, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{ClientError, ItemError, head};
use crate::failure::{Failure, parse_retry_after};
use crate::model::*;
use crate::wire;

/// How long a call may take unless it long-polls.
const TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);

/// Configures a [`Client`].
#[derive(Debug)]
pub struct ClientBuilder {
    base_url: String,
    token: Option<String>,
    timeout: Duration,
    connect_timeout: Duration,
    ca_certs: Vec<CaCert>,
    user_agent: Option<String>,
}

/// A CA certificate to trust beside the system's roots.
#[derive(Debug)]
enum CaCert {
    Pem(Vec<u8>),
    File(PathBuf),
}

impl ClientBuilder {
    /// The bearer token (an empty one counts as none).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// How long a call may take (a lease's `wait` is added to it).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long connecting may take.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Also trusts the CA certificates in this PEM text (a private CA, or a
    /// server's self-signed certificate), beside the system's roots.
    pub fn ca_cert_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca_certs.push(CaCert::Pem(pem.into()));
        self
    }

    /// Also trusts the CA certificates in this PEM file, read by
    /// [`build`](Self::build) (whose error then names the file).
    pub fn ca_cert_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_certs.push(CaCert::File(path.into()));
        self
    }

    /// The `User-Agent` sent (`lazaret-client/VERSION` by default).
    pub fn user_agent(mut self, user_agent: impl Into<String>) -> Self {
        self.user_agent = Some(user_agent.into());
        self
    }

    /// The client.
    pub fn build(self) -> Result<Client, ClientError> {
        let mut base = Url::parse(self.base_url.trim()).map_err(|e| {
            ClientError::Config(format!(
                "{:?} is not a URL ({e}); write it like http://127.0.0.1:7433",
                self.base_url
            ))
        })?;
        if base.cannot_be_a_base() || !matches!(base.scheme(), "http" | "https") {
            return Err(ClientError::Config(format!(
                "{base} is not an http:// base URL"
            )));
        }
        // A path prefix is kept: `http://h/lazaret` + `v1/jobs`.
        if !base.path().ends_with('/') {
            let path = format!("{}/", base.path());
            base.set_path(&path);
        }
        let authorization = match self.token.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(t) => {
                let mut v = HeaderValue::from_str(&format!("Bearer {t}")).map_err(|_| {
                    ClientError::Config("the token holds characters a header cannot carry".into())
                })?;
                v.set_sensitive(true);
                Some(v)
            }
        };
        let mut http =
            reqwest::Client::builder()
                // rustls on ring, the system's roots, plus the CAs given.
                .use_rustls_tls()
                .connect_timeout(self.connect_timeout)
                .tcp_nodelay(true)
                .pool_max_idle_per_host(64)
                .user_agent(self.user_agent.unwrap_or_else(|| {
                    concat!("lazaret-client/", env!("CARGO_PKG_VERSION")).into()
                }));
        for ca in &self.ca_certs {
            for cert in ca.certificates()? {
                http = http.add_root_certificate(cert);
            }
        }
        let http = http.build().map_err(|e| {
            ClientError::Config(format!(
                "cannot set up the HTTP client: {}",
                crate::error::root_cause(&e)
            ))
        })?;
        Ok(Client {
            http,
            base,
            authorization,
            timeout: self.timeout,
        })
    }
}

impl CaCert {
    fn certificates(&self) -> Result<Vec<reqwest::Certificate>, ClientError> {
        let (pem, from) = match self {
            CaCert::Pem(pem) => (pem.clone(), "the CA certificate given".to_owned()),
            CaCert::File(path) => (
                std::fs::read(path).map_err(|e| {
                    ClientError::Config(format!(
                        "cannot read the CA certificate file {}: {e}",
                        path.display()
                    ))
                })?,
                format!("the CA certificate file {}", path.display()),
            ),
        };
        let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
            ClientError::Config(format!(
                "{from} is not PEM: {}",
                crate::error::root_cause(&e)
            ))
        })?;
        if certs.is_empty() {
            return Err(ClientError::Config(format!(
                "{from} holds no certificate (expected PEM text with -----BEGIN CERTIFICATE-----)"
            )));
        }
        Ok(certs)
    }
}

/// A typed client for one lazaret server. Cheap to clone (the connection
/// pool is shared).
///
/// Every method maps one endpoint of the contract; an error reply becomes
/// [`ClientError::Api`] with the contract's code.
#[derive(Clone, Debug)]
pub struct Client {
    http: reqwest::Client,
    base: Url,
    authorization: Option<HeaderValue>,
    timeout: Duration,
}

impl Client {
    /// A client for `base_url` (like `http://127.0.0.1:7433`) with no token.
    pub fn new(base_url: impl Into<String>) -> Result<Self, ClientError> {
        Self::builder(base_url).build()
    }

    /// A builder for `base_url`.
    pub fn builder(base_url: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            base_url: base_url.into(),
            token: None,
            timeout: TIMEOUT_DEFAULT,
            connect_timeout: Duration::from_secs(10),
            ca_certs: Vec::new(),
            user_agent: None,
        }
    }

    /// The base URL.
    pub fn base_url(&self) -> &Url {
        &self.base
    }

    fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        url
    }

    /// Sends a request and returns the 2xx body; an error reply becomes a typed error.
    async fn send(
        &self,
        method: Method,
        url: Url,
        body: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<(StatusCode, bytes::Bytes), ClientError> {
        let resp = self.respond(method, url, body, timeout).await?;
        let status = resp.status();
        let bytes = resp.bytes().await?;
        Ok((status, bytes))
    }

    /// Sends a request and returns the response once its status is 2xx
    /// (its body still to read); an error reply becomes a typed error.
    async fn respond(
        &self,
        method: Method,
        url: Url,
        body: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<reqwest::Response, ClientError> {
        let mut req = self.http.request(method, url).timeout(timeout);
        if let Some(auth) = &self.authorization {
            req = req.header(AUTHORIZATION, auth.clone());
        }
        if let Some(body) = body {
            req = req
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body);
        }
        let resp = req.send().await?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let retry_after = resp
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()));
        let bytes = resp.bytes().await?;
        Err(ClientError::from_reply(status, retry_after, &bytes))
    }

    fn url_with_query(&self, segments: &[&str], query: &[(&str, &str)]) -> Url {
        let mut url = self.url(segments);
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(query);
        }
        url
    }

    // ------------------------------------------------------------ raw

    /// `GET` of an API path given as segments (each percent-encoded, so an
    /// id never climbs out of its place) with a query: the 2xx body as the
    /// server sent it. For tools that show the reply untouched (the CLI's
    /// `--json`); programs want the typed methods.
    pub async fn get_raw(
        &self,
        segments: &[&str],
        query: &[(&str, &str)],
    ) -> Result<bytes::Bytes, ClientError> {
        let url = self.url_with_query(segments, query);
        Ok(self.send(Method::GET, url, None, self.timeout).await?.1)
    }

    /// `POST` of a JSON body: the 2xx body as the server sent it.
    pub async fn post_raw(
        &self,
        segments: &[&str],
        body: &impl Serialize,
    ) -> Result<bytes::Bytes, ClientError> {
        let body = serde_json::to_vec(body).map_err(ClientError::Encode)?;
        let url = self.url(segments);
        Ok(self
            .send(Method::POST, url, Some(body), self.timeout)
            .await?
            .1)
    }

    /// `DELETE`: the 2xx body as the server sent it.
    pub async fn delete_raw(&self, segments: &[&str]) -> Result<bytes::Bytes, ClientError> {
        let url = self.url(segments);
        Ok(self.send(Method::DELETE, url, None, self.timeout).await?.1)
    }

    /// `GET` whose 2xx body is read chunk by chunk ([`BodyStream::chunk`]),
    /// so a 50 MB payload is never held whole.
    pub async fn get_stream(&self, segments: &[&str]) -> Result<BodyStream, ClientError> {
        let resp = self
            .respond(Method::GET, self.url(segments), None, self.timeout)
            .await?;
        Ok(BodyStream { resp })
    }

    async fn call<R: DeserializeOwned>(
        &self,
        method: Method,
        url: Url,
        body: Option<&impl Serialize>,
        timeout: Duration,
    ) -> Result<R, ClientError> {
        let body = body
            .map(serde_json::to_vec)
            .transpose()
            .map_err(ClientError::Encode)?;
        let (status, bytes) = self.send(method, url, body, timeout).await?;
        serde_json::from_slice(&bytes).map_err(|source| ClientError::Decode {
            status,
            source,
            body: head(&bytes),
        })
    }

    async fn get<R: DeserializeOwned>(&self, url: Url) -> Result<R, ClientError> {
        self.call(Method::GET, url, None::<&()>, self.timeout).await
    }

    async fn post<R: DeserializeOwned>(
        &self,
        segments: &[&str],
        body: &impl Serialize,
    ) -> Result<R, ClientError> {
        self.call(Method::POST, self.url(segments), Some(body), self.timeout)
            .await
    }

    // ------------------------------------------------------------ health

    /// `GET /healthz`: `Ok` once the server accepts work.
    pub async fn health(&self) -> Result<(), ClientError> {
        self.send(Method::GET, self.url(&["healthz"]), None, self.timeout)
            .await
            .map(drop)
    }

    // ------------------------------------------------------------ producers

    /// `POST /v1/jobs`.
    pub async fn enqueue(&self, job: &NewJob) -> Result<Enqueued, ClientError> {
        self.post(&["v1", "jobs"], job).await
    }

    /// `POST /v1/jobs/batch`: one result per job, in order; one bad job is
    /// one error in the list, not a failed batch.
    pub async fn enqueue_batch(
        &self,
        jobs: &[NewJob],
    ) -> Result<Vec<Result<Enqueued, ItemError>>, ClientError> {
        #[derive(Serialize)]
        struct Batch<'a> {
            jobs: &'a [NewJob],
        }
        let r: Results<Enqueued> = self.post(&["v1", "jobs", "batch"], &Batch { jobs }).await?;
        Ok(items(r))
    }

    /// `GET /v1/jobs/{id}`.
    pub async fn job(&self, id: JobId) -> Result<JobInfo, ClientError> {
        self.get(self.url(&["v1", "jobs", &id.to_string()])).await
    }

    /// `GET /v1/jobs`: one page, newest first (a producer's token sees
    /// only its own jobs).
    pub async fn jobs(&self, q: &JobsQuery) -> Result<JobPage, ClientError> {
        let mut url = self.url(&["v1", "jobs"]);
        {
            let mut pairs = url.query_pairs_mut();
            let mut add = |k: &str, v: Option<&str>| {
                if let Some(v) = v {
                    pairs.append_pair(k, v);
                }
            };
            add("state", q.state.map(|s| s.as_str()));
            add("type", q.job_type.as_deref());
            add("tenant", q.tenant.as_deref());
            add("lane", q.lane.as_deref());
            add("limit", q.limit.map(|l| l.to_string()).as_deref());
            add("cursor", q.cursor.as_deref());
        }
        if url.query() == Some("") {
            url.set_query(None);
        }
        self.get(url).await
    }

    /// `POST /v1/jobs/{id}/cancel`: a queued or scheduled job is cancelled
    /// now; a leased one at its outcome unless acked. `BAD_STATE` for a
    /// finished job.
    pub async fn cancel(&self, id: JobId) -> Result<CancelReply, ClientError> {
        self.post(
            &["v1", "jobs", &id.to_string(), "cancel"],
            &serde_json::json!({}),
        )
        .await
    }

    // ------------------------------------------------------------ workers

    /// `POST /v1/leases`. Long-polls up to `req.wait` when nothing is ready.
    pub async fn lease(&self, req: &LeaseRequest) -> Result<Vec<LeasedJob>, ClientError> {
        let body = lease_body(req);
        let r: Leased = self
            .call(
                Method::POST,
                self.url(&["v1", "leases"]),
                Some(&body),
                self.timeout + req.wait,
            )
            .await?;
        Ok(r.jobs)
    }

    /// `POST /v1/jobs/{id}/ack` with `next`: acks, then leases as
    /// [`lease`](Self::lease) would, in one round trip. The ack stands
    /// even when the lease part is refused (then `next_error` says why);
    /// an ack that is itself refused (`LEASE_LOST`) is an `Err` and
    /// leases nothing.
    pub async fn ack_next(
        &self,
        id: JobId,
        token: &LeaseToken,
        next: &LeaseRequest,
    ) -> Result<OutcomeAndLease, ClientError> {
        self.outcome_next(id, "ack", token, None, next).await
    }

    /// `POST /v1/jobs/{id}/fail` with `next`: as [`ack_next`](Self::ack_next).
    pub async fn fail_next(
        &self,
        id: JobId,
        token: &LeaseToken,
        failure: &Failure,
        next: &LeaseRequest,
    ) -> Result<OutcomeAndLease, ClientError> {
        self.outcome_next(id, "fail", token, Some(failure), next)
            .await
    }

    async fn outcome_next(
        &self,
        id: JobId,
        verb: &str,
        token: &LeaseToken,
        error: Option<&Failure>,
        next: &LeaseRequest,
    ) -> Result<OutcomeAndLease, ClientError> {
        let body = OutcomeNextBody {
            lease_token: token,
            error,
            next: lease_body(next),
        };
        let body = serde_json::to_vec(&body).map_err(ClientError::Encode)?;
        let (status, bytes) = self
            .send(
                Method::POST,
                self.url(&["v1", "jobs", &id.to_string(), verb]),
                Some(body),
                self.timeout + next.wait,
            )
            .await?;
        let decode = |source| ClientError::Decode {
            status,
            source,
            body: head(&bytes),
        };
        // Read twice: the outcome's fields, then the lease's (flattening
        // would lose the payloads' raw bytes).
        let outcome: Outcome = serde_json::from_slice(&bytes).map_err(decode)?;
        let part: NextPart = serde_json::from_slice(&bytes).map_err(decode)?;
        Ok(OutcomeAndLease {
            outcome,
            jobs: part.jobs,
            next_error: part.next_error.map(ItemError::from),
        })
    }

    /// `POST /v1/jobs/{id}/ack`. `LEASE_LOST` means the job is someone
    /// else's now: drop it, do not retry.
    pub async fn ack(&self, id: JobId, token: &LeaseToken) -> Result<Outcome, ClientError> {
        self.post(
            &["v1", "jobs", &id.to_string(), "ack"],
            &TokenBody { lease_token: token },
        )
        .await
    }

    /// `POST /v1/jobs/{id}/fail`.
    pub async fn fail(
        &self,
        id: JobId,
        token: &LeaseToken,
        failure: &Failure,
    ) -> Result<Outcome, ClientError> {
        self.post(
            &["v1", "jobs", &id.to_string(), "fail"],
            &FailBody {
                lease_token: token,
                error: failure,
            },
        )
        .await
    }

    /// `POST /v1/jobs/{id}/heartbeat`: extends the lease to `extend` from
    /// now; returns the new expiry (server clock).
    pub async fn heartbeat(
        &self,
        id: JobId,
        token: &LeaseToken,
        extend: Duration,
    ) -> Result<SystemTime, ClientError> {
        Ok(self
            .heartbeat_reply(id, token, extend)
            .await?
            .lease_expires_at)
    }

    /// [`Client::heartbeat`], with the whole reply: also whether a cancel
    /// of the job was requested.
    pub async fn heartbeat_reply(
        &self,
        id: JobId,
        token: &LeaseToken,
        extend: Duration,
    ) -> Result<Heartbeat, ClientError> {
        self.post(
            &["v1", "jobs", &id.to_string(), "heartbeat"],
            &HeartbeatBody {
                lease_token: token,
                extend_ms: wire::ms(extend),
            },
        )
        .await
    }

    /// `POST /v1/acks`: one result per item, in order.
    pub async fn acks(
        &self,
        items_: &[AckItem],
    ) -> Result<Vec<Result<Outcome, ItemError>>, ClientError> {
        let r: Results<Outcome> = self.post(&["v1", "acks"], &Items { items: items_ }).await?;
        Ok(items(r))
    }

    /// `POST /v1/fails`: one result per item, in order.
    pub async fn fails(
        &self,
        items_: &[FailItem],
    ) -> Result<Vec<Result<Outcome, ItemError>>, ClientError> {
        let r: Results<Outcome> = self
            .post(&["v1", "fails"], &Items { items: items_ })
            .await?;
        Ok(items(r))
    }

    // ------------------------------------------------------------ dead letters

    /// `GET /v1/dead-letters`: one page.
    pub async fn dead_letters(&self, q: &DeadLetterQuery) -> Result<DeadLetterPage, ClientError> {
        let mut url = self.url(&["v1", "dead-letters"]);
        {
            let mut pairs = url.query_pairs_mut();
            let mut add = |k: &str, v: Option<&str>| {
                if let Some(v) = v {
                    pairs.append_pair(k, v);
                }
            };
            add("type", q.filter.job_type.as_deref());
            add("tenant", q.filter.tenant.as_deref());
            add("lane", q.filter.lane.as_deref());
            add("reason", q.filter.reason.map(|r| r.as_str()));
            add("limit", q.limit.map(|l| l.to_string()).as_deref());
            add("cursor", q.cursor.as_deref());
        }
        if url.query() == Some("") {
            url.set_query(None);
        }
        self.get(url).await
    }

    /// `GET /v1/dead-letters/{id}`.
    pub async fn dead_letter(&self, id: DeadLetterId) -> Result<DeadLetter, ClientError> {
        self.get(self.url(&["v1", "dead-letters", &id.to_string()]))
            .await
    }

    /// `GET /v1/dead-letters/{id}/payload`: the original payload bytes.
    pub async fn dead_letter_payload(&self, id: DeadLetterId) -> Result<Vec<u8>, ClientError> {
        let url = self.url(&["v1", "dead-letters", &id.to_string(), "payload"]);
        let (_, body) = self.send(Method::GET, url, None, self.timeout).await?;
        Ok(body.to_vec())
    }

    /// `GET /v1/dead-letters/reasons`.
    pub async fn dead_letter_reasons(&self) -> Result<Vec<ReasonCount>, ClientError> {
        let r: Reasons = self
            .get(self.url(&["v1", "dead-letters", "reasons"]))
            .await?;
        Ok(r.reasons)
    }

    /// `POST /v1/dead-letters/redrive`.
    pub async fn redrive(&self, req: &Redrive) -> Result<Redriven, ClientError> {
        let mut body = SelectionBody::new(&req.selection);
        body.dry_run = Some(req.dry_run);
        body.rate_per_sec = req.rate_per_sec;
        self.post(&["v1", "dead-letters", "redrive"], &body).await
    }

    /// `POST /v1/dead-letters/purge` (admin): deletes for good; returns how many.
    pub async fn purge(&self, selection: &Selection) -> Result<u64, ClientError> {
        let mut body = SelectionBody::new(selection);
        body.confirm = Some(true);
        let r: Purged = self.post(&["v1", "dead-letters", "purge"], &body).await?;
        Ok(r.purged)
    }

    // ------------------------------------------------------------ observing

    /// `GET /v1/stats`: a JSON summary (its shape is the server's, beyond
    /// the contract's promise that it summarises the metrics).
    pub async fn stats(&self) -> Result<serde_json::Value, ClientError> {
        self.get(self.url(&["v1", "stats"])).await
    }

    /// `GET /v1/breakers` (closed ones may be left out).
    pub async fn breakers(&self) -> Result<Vec<Breaker>, ClientError> {
        let r: Breakers = self.get(self.url(&["v1", "breakers"])).await?;
        Ok(r.breakers)
    }

    /// `POST /v1/pause` (operator).
    pub async fn pause(&self, target: &PauseTarget) -> Result<(), ClientError> {
        self.pause_resume("pause", target).await
    }

    /// `POST /v1/resume` (operator).
    pub async fn resume(&self, target: &PauseTarget) -> Result<(), ClientError> {
        self.pause_resume("resume", target).await
    }

    async fn pause_resume(&self, verb: &str, target: &PauseTarget) -> Result<(), ClientError> {
        let body = match target {
            PauseTarget::Type(t) => PauseBody {
                job_type: Some(t),
                lane: None,
            },
            PauseTarget::Lane(l) => PauseBody {
                job_type: None,
                lane: Some(l),
            },
        };
        let _: serde_json::Value = self.post(&["v1", verb], &body).await?;
        Ok(())
    }

    /// `GET /v1/audit` (operator, admin): the newest `limit` entries.
    pub async fn audit(&self, limit: Option<u32>) -> Result<Vec<AuditEntry>, ClientError> {
        let page = self
            .audit_page(&AuditRequest {
                limit,
                ..AuditRequest::default()
            })
            .await?;
        Ok(page.items)
    }

    /// `GET /v1/audit` (operator, admin): one page, newest first; follow
    /// `next_cursor` for older entries.
    pub async fn audit_page(&self, req: &AuditRequest) -> Result<AuditPage, ClientError> {
        let mut url = self.url(&["v1", "audit"]);
        {
            let mut q = url.query_pairs_mut();
            if let Some(l) = req.limit {
                q.append_pair("limit", &l.to_string());
            }
            for (key, value) in [
                ("cursor", &req.cursor),
                ("action", &req.action),
                ("actor", &req.actor),
            ] {
                if let Some(v) = value {
                    q.append_pair(key, v);
                }
            }
        }
        self.get(url).await
    }
}

fn lease_body(req: &LeaseRequest) -> LeaseBody<'_> {
    LeaseBody {
        worker_id: &req.worker_id,
        lanes: req.lanes.as_deref(),
        types: req.types.as_deref(),
        max_jobs: req.max_jobs,
        lease_ms: wire::ms(req.lease),
        wait_ms: wire::ms(req.wait),
    }
}

/// A 2xx body being received; see [`Client::get_stream`].
#[derive(Debug)]
pub struct BodyStream {
    resp: reqwest::Response,
}

impl BodyStream {
    /// The next chunk, `None` at the end. An error here means the body was
    /// cut off: what came before is not the whole of it.
    pub async fn chunk(&mut self) -> Result<Option<bytes::Bytes>, ClientError> {
        Ok(self.resp.chunk().await?)
    }

    /// The announced length, if the server sent one.
    pub fn content_length(&self) -> Option<u64> {
        self.resp.content_length()
    }
}

fn items<T>(r: Results<T>) -> Vec<Result<T, ItemError>> {
    r.results
        .into_iter()
        .map(|i| match i {
            ItemResult::Ok(v) => Ok(v),
            ItemResult::Err(e) => Err(ItemError::from(e.error)),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_keep_a_path_prefix_and_encode_ids() {
        let c = Client::new("http://127.0.0.1:7433/lazaret").unwrap();
        assert_eq!(
            c.url(&["v1", "jobs", "1/../x"]).as_str(),
            "http://127.0.0.1:7433/lazaret/v1/jobs/1%2F..%2Fx"
        );
        let c = Client::new("http://127.0.0.1:7433").unwrap();
        assert_eq!(
            c.url(&["v1", "acks"]).as_str(),
            "http://127.0.0.1:7433/v1/acks"
        );
        assert!(Client::new("not a url").is_err());
        assert!(Client::new("ftp://x").is_err());
        assert!(Client::new("https://lazaret.internal:7433").is_ok());
    }

    #[test]
    fn a_ca_certificate_is_checked_when_the_client_is_built() {
        let ca = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let pem = ca.cert.pem();
        assert!(
            Client::builder("https://localhost:1")
                .ca_cert_pem(pem.clone())
                .build()
                .is_ok()
        );

        let config_error = |b: ClientBuilder| match b.build() {
            Err(ClientError::Config(msg)) => msg,
            other => panic!("not a config error: {other:?}"),
        };
        let msg = config_error(Client::builder("https://localhost:1").ca_cert_pem("hello"));
        assert!(msg.contains("BEGIN CERTIFICATE"), "{msg}");
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("ca.pem");
        let msg = config_error(Client::builder("https://localhost:1").ca_cert_file(&missing));
        assert!(msg.contains("ca.pem"), "{msg}");
        std::fs::write(&missing, pem).unwrap();
        assert!(
            Client::builder("https://localhost:1")
                .ca_cert_file(&missing)
                .build()
                .is_ok()
        );
    }
}
