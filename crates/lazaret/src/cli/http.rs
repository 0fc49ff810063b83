//! A small HTTP client for the lazaret API: URLs, the bearer token, and
//! turning every failure into a message an operator can act on.

use std::fmt;

use anyhow::{Context, anyhow, bail};
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderValue, RETRY_AFTER};
use reqwest::{Response, StatusCode, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// An error reply of the API: `{"error": {"code", "reason", "message", ...}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: String,
    pub reason: Option<String>,
    pub message: String,
    /// Extra fields such as `details` of a schema violation.
    pub details: Option<serde_json::Value>,
    /// `Retry-After` of a `SHED` reply, as the server sent it.
    pub retry_after: Option<String>,
}

impl ApiError {
    /// Reads an error body; `None` when it is not the API's error shape
    /// (a proxy's HTML page, say).
    pub fn parse(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> Option<Self> {
        let v: serde_json::Value = serde_json::from_slice(body).ok()?;
        let e = v.get("error")?.as_object()?;
        let code = e.get("code")?.as_str()?.to_owned();
        let text = |k: &str| e.get(k).and_then(|v| v.as_str()).map(str::to_owned);
        Some(Self {
            status,
            code,
            reason: text("reason"),
            message: text("message").unwrap_or_default(),
            details: e.get("details").filter(|d| !d.is_null()).cloned(),
            retry_after: headers
                .get(RETRY_AFTER)
                .and_then(|h| h.to_str().ok())
                .map(str::to_owned),
        })
    }
}

/// `CODE (reason): message`, then what else the server said, one item a line.
impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let clean = super::table::clean_line;
        write!(f, "{}", clean(&self.code))?;
        if let Some(reason) = &self.reason {
            write!(f, " ({})", clean(reason))?;
        }
        write!(f, ": {}", clean(&self.message))?;
        if let Some(after) = &self.retry_after {
            write!(f, "\n  retry after: {} s", clean(after))?;
        }
        if let Some(details) = &self.details {
            let text = details.to_string();
            write!(f, "\n  details: {}", super::table::cut(&clean(&text), 2000))?;
        }
        Ok(())
    }
}

impl std::error::Error for ApiError {}

/// A reply with a 2xx status and its whole body, kept as bytes so `--json`
/// prints it untouched.
#[derive(Debug)]
pub struct Reply {
    body: Vec<u8>,
}

impl Reply {
    pub fn json<T: DeserializeOwned>(&self) -> anyhow::Result<T> {
        serde_json::from_slice(&self.body).context("the server's reply is not the JSON expected")
    }

    pub fn raw(&self) -> &[u8] {
        &self.body
    }
}

/// A non-2xx reply: the API error if the body is one, and the body itself
/// (which `--json` prints as is).
#[derive(Debug)]
pub struct ServerError {
    pub api: Option<ApiError>,
    /// What to say when the body is not an API error.
    pub other: String,
    pub body: Vec<u8>,
    pub hint: Option<&'static str>,
}

impl fmt::Display for ServerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.api {
            Some(api) => write!(f, "{api}")?,
            None => write!(f, "{}", self.other)?,
        }
        if let Some(hint) = self.hint {
            write!(f, "\n  hint: {hint}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ServerError {}

/// Talks to one server with one optional token.
#[derive(Debug)]
pub struct Client {
    http: reqwest::Client,
    base: Url,
    /// `Bearer …`, marked sensitive so it never shows in debug output.
    authorization: Option<HeaderValue>,
}

impl Client {
    /// `server` is the base URL (a path prefix is kept); an empty token counts as none.
    pub fn new(server: &str, token: Option<String>) -> anyhow::Result<Self> {
        let base = parse_server(server)?;
        let http = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(10))
            .user_agent(concat!("lazaret-cli/", env!("CARGO_PKG_VERSION")))
            .build()
            .context("cannot set up the HTTP client")?;
        let authorization = match token.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(token) => {
                let mut value =
                    HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
                        anyhow!("LAZARET_TOKEN holds characters an HTTP header cannot carry")
                    })?;
                value.set_sensitive(true);
                Some(value)
            }
        };
        Ok(Self {
            http,
            base,
            authorization,
        })
    }

    /// The URL of an API path given as segments; each is percent-encoded,
    /// so an id can never climb out of its path.
    pub fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        url.path_segments_mut()
            .expect("http URLs have a path")
            .pop_if_empty()
            .extend(segments);
        url
    }

    pub async fn get(&self, segments: &[&str], query: &[(&str, &str)]) -> anyhow::Result<Reply> {
        let mut url = self.url(segments);
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(query);
        }
        let resp = self.send(self.http.get(url.clone()), &url).await?;
        self.read(resp, &url).await
    }

    pub async fn post<B: Serialize + ?Sized>(
        &self,
        segments: &[&str],
        body: &B,
    ) -> anyhow::Result<Reply> {
        let url = self.url(segments);
        let resp = self
            .send(self.http.post(url.clone()).json(body), &url)
            .await?;
        self.read(resp, &url).await
    }

    pub async fn delete(&self, segments: &[&str]) -> anyhow::Result<Reply> {
        let url = self.url(segments);
        let resp = self.send(self.http.delete(url.clone()), &url).await?;
        self.read(resp, &url).await
    }

    /// A GET whose 2xx body the caller streams (`Response::chunk`).
    pub async fn get_stream(&self, segments: &[&str]) -> anyhow::Result<Response> {
        let url = self.url(segments);
        let resp = self.send(self.http.get(url.clone()), &url).await?;
        if resp.status().is_success() {
            Ok(resp)
        } else {
            Err(self.error_of(resp, &url).await)
        }
    }

    async fn send(&self, req: reqwest::RequestBuilder, url: &Url) -> anyhow::Result<Response> {
        let req = match &self.authorization {
            Some(value) => req.header(AUTHORIZATION, value.clone()),
            None => req,
        };
        req.send().await.map_err(|e| self.transport_error(&e, url))
    }

    async fn read(&self, resp: Response, url: &Url) -> anyhow::Result<Reply> {
        if !resp.status().is_success() {
            return Err(self.error_of(resp, url).await);
        }
        let body = resp
            .bytes()
            .await
            .map_err(|e| self.transport_error(&e, url))?;
        Ok(Reply {
            body: body.to_vec(),
        })
    }

    /// Turns a non-2xx reply into an error, keeping the body for `--json`.
    async fn error_of(&self, resp: Response, url: &Url) -> anyhow::Error {
        let status = resp.status();
        let headers = resp.headers().clone();
        let body = match resp.bytes().await {
            Ok(b) => b.to_vec(),
            Err(e) => return self.transport_error(&e, url),
        };
        let api = ApiError::parse(status, &headers, &body);
        let hint = api.as_ref().and_then(|api| {
            (api.code == "UNAUTHORIZED" && self.authorization.is_none())
                .then_some("no token was sent: set LAZARET_TOKEN")
        });
        let other = {
            let text = String::from_utf8_lossy(&body);
            let text = super::table::clean_line(text.trim());
            let text = super::table::cut(&text, 300);
            format!("HTTP {status} from {url} (not a lazaret error reply): {text}")
        };
        anyhow::Error::new(ServerError {
            api,
            other,
            body,
            hint,
        })
    }

    fn transport_error(&self, e: &reqwest::Error, url: &Url) -> anyhow::Error {
        let cause = root_cause(e);
        if e.is_connect() {
            anyhow!(
                "cannot connect to the lazaret server at {}: {cause}\n  \
                 is it running? start one with `lazaret serve`, or point --server \
                 (or LAZARET_SERVER) at a running one",
                self.base
            )
        } else if e.is_timeout() {
            anyhow!("{url}: timed out: {cause}")
        } else {
            anyhow!("{url}: {cause}")
        }
    }
}

/// The innermost cause, e.g. "Connection refused (os error 111)", which
/// says more than reqwest's "error sending request for url (…)".
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}

/// Validates the `--server` URL up front, with a message that says what is wrong.
pub fn parse_server(server: &str) -> anyhow::Result<Url> {
    let url = Url::parse(server)
        .with_context(|| format!("--server {server:?} is not a URL like http://127.0.0.1:7433"))?;
    match url.scheme() {
        "http" => {}
        "https" => bail!(
            "--server {server}: https is not supported by this build (no TLS); \
             use http:// on loopback or a TLS-terminating proxy"
        ),
        other => bail!("--server {server}: unsupported scheme {other:?}; use http://"),
    }
    if url.query().is_some() || url.fragment().is_some() {
        bail!("--server {server}: give the base URL only, without ? or #");
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(status: u16, body: &str, headers: HeaderMap) -> Option<ApiError> {
        ApiError::parse(
            StatusCode::from_u16(status).unwrap(),
            &headers,
            body.as_bytes(),
        )
    }

    #[test]
    fn an_error_body_prints_as_code_reason_message() {
        let e = api(
            422,
            r#"{"error":{"code":"POISON","reason":"invalid_json","message":"expected value at line 1"}}"#,
            HeaderMap::new(),
        )
        .unwrap();
        assert_eq!(
            e.to_string(),
            "POISON (invalid_json): expected value at line 1"
        );
    }

    #[test]
    fn a_null_reason_is_left_out() {
        let e = api(
            404,
            r#"{"error":{"code":"NOT_FOUND","reason":null,"message":"no dead letter d1"}}"#,
            HeaderMap::new(),
        )
        .unwrap();
        assert_eq!(e.to_string(), "NOT_FOUND: no dead letter d1");
        assert_eq!(e.status, StatusCode::NOT_FOUND);
    }

    #[test]
    fn shed_shows_retry_after_and_schema_errors_their_details() {
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_static("10"));
        let e = api(
            503,
            r#"{"error":{"code":"SHED","reason":"breaker_open","message":"send_email is parked"}}"#,
            headers,
        )
        .unwrap();
        assert_eq!(
            e.to_string(),
            "SHED (breaker_open): send_email is parked\n  retry after: 10 s"
        );

        let e = api(
            422,
            r#"{"error":{"code":"POISON","reason":"schema_invalid","message":"bad","details":[{"path":"/to"}]}}"#,
            HeaderMap::new(),
        )
        .unwrap();
        assert_eq!(
            e.to_string(),
            "POISON (schema_invalid): bad\n  details: [{\"path\":\"/to\"}]"
        );
    }

    #[test]
    fn a_hostile_message_cannot_drive_the_terminal() {
        let e = api(
            400,
            r#"{"error":{"code":"BAD_REQUEST","reason":null,"message":"x\u001b[2Jy\nz"}}"#,
            HeaderMap::new(),
        )
        .unwrap();
        assert_eq!(e.to_string(), "BAD_REQUEST: x\u{FFFD}[2Jy z");
    }

    #[test]
    fn other_bodies_are_not_api_errors() {
        assert!(api(502, "<html>bad gateway</html>", HeaderMap::new()).is_none());
        assert!(api(500, r#"{"error":"oops"}"#, HeaderMap::new()).is_none());
        assert!(api(500, r#"{"message":"oops"}"#, HeaderMap::new()).is_none());
    }

    #[test]
    fn urls_escape_ids_and_keep_a_path_prefix() {
        let c = Client::new("http://127.0.0.1:7433", None).unwrap();
        assert_eq!(
            c.url(&["v1", "jobs", "j-1"]).as_str(),
            "http://127.0.0.1:7433/v1/jobs/j-1"
        );
        assert_eq!(
            c.url(&["v1", "dead-letters", "../../v1/stats", "payload"])
                .as_str(),
            "http://127.0.0.1:7433/v1/dead-letters/..%2F..%2Fv1%2Fstats/payload"
        );
        let c = Client::new("http://proxy:80/lazaret/", Some(String::new())).unwrap();
        assert_eq!(
            c.url(&["v1", "stats"]).as_str(),
            "http://proxy/lazaret/v1/stats"
        );
        assert!(
            c.authorization.is_none(),
            "an empty LAZARET_TOKEN sends no header"
        );
        let c = Client::new("http://h", Some(" s3cret\n".into())).unwrap();
        let auth = c.authorization.unwrap();
        assert_eq!(auth.to_str().unwrap(), "Bearer s3cret");
        assert!(auth.is_sensitive());
        assert!(Client::new("http://h", Some("a\nb".into())).is_err());
    }

    #[test]
    fn the_server_url_is_checked_up_front() {
        assert!(parse_server("http://127.0.0.1:7433").is_ok());
        let https = parse_server("https://q.example").unwrap_err().to_string();
        assert!(https.contains("TLS"), "{https}");
        assert!(parse_server("127.0.0.1:7433").is_err());
        assert!(parse_server("http://h/?x=1").is_err());
    }
}
