//! A lean HTTP/1.1 client for the bench: one keep-alive hyper connection
//! per producer or consumer, plain `http://` only.
//!
//! The bench shares the machine's cores with the server it measures, so
//! every microsecond of client CPU per request is taken from the server.
//! A general client (connection pool, URL parsing, redirects, proxies,
//! middleware) costs far more per request than this needs: each task owns
//! one connection, sends one request at a time and reads the whole answer.
//! TLS is deliberately not supported.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// No request (connecting, sending, reading the answer) may take longer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// Where a base URL points: what to connect to, what to send as `Host`,
/// and the path every request path is appended to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl {
    /// `host:port` for the TCP connection (port 80 when the URL names none).
    pub connect_to: String,
    /// The authority as written in the URL, for the `Host` header.
    pub host: String,
    /// The URL's path without its trailing slash (`""` for none).
    pub path_prefix: String,
}

/// Parses `http://HOST[:PORT][/PATH]` (no user, query or fragment).
pub fn parse_base_url(url: &str) -> anyhow::Result<BaseUrl> {
    let Some((scheme, rest)) = url.split_once("://") else {
        bail!("{url:?} is not an http:// URL (write it as http://HOST:PORT)");
    };
    if scheme.eq_ignore_ascii_case("https") {
        bail!(
            "{url:?}: the bench speaks plain HTTP only, not https; \
             point it at the server's http:// address (or a local TLS-terminating proxy)"
        );
    }
    if !scheme.eq_ignore_ascii_case("http") {
        bail!("{url:?}: scheme {scheme:?} is not http");
    }
    if rest.contains(['?', '#']) {
        bail!("{url:?}: a server URL takes no query or fragment");
    }
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    if authority.contains('@') {
        bail!("{url:?}: user info in the URL is not supported; use --token");
    }
    // The port follows the last ':' outside an IPv6 literal's brackets.
    let (host, port) = match authority.strip_prefix('[') {
        Some(v6) => {
            let Some((addr, after)) = v6.split_once(']') else {
                bail!("{url:?}: unclosed '[' in the host");
            };
            let port = match after {
                "" => None,
                p => Some(
                    p.strip_prefix(':')
                        .with_context(|| format!("{url:?}: junk after the IPv6 address"))?,
                ),
            };
            (addr, port)
        }
        None => match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        },
    };
    if host.is_empty() {
        bail!("{url:?} names no host");
    }
    let port = match port {
        None => 80,
        Some(p) => match p.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => bail!("{url:?}: {p:?} is not a port (1-65535)"),
        },
    };
    let connect_to = if authority.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    Ok(BaseUrl {
        connect_to,
        host: authority.to_owned(),
        path_prefix: path.trim_end_matches('/').to_owned(),
    })
}

/// Appends `segment` to `out` as one path segment, percent-encoding all but
/// RFC 3986's unreserved characters (ids are digits, so this rarely acts).
pub fn push_segment(out: &mut String, segment: &str) {
    for b in segment.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            const HEX: &[u8; 16] = b"0123456789ABCDEF";
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        }
    }
}

/// What every connection to one server shares. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    base: BaseUrl,
    host: HeaderValue,
    authorization: Option<HeaderValue>,
}

impl Client {
    /// A client for the server at `base_url`, sending `token` as a bearer token.
    pub fn new(base_url: &str, token: Option<&str>) -> anyhow::Result<Self> {
        let base = parse_base_url(base_url)?;
        let host = HeaderValue::from_str(&base.host)
            .with_context(|| format!("{base_url:?}: the host is not a valid Host header"))?;
        let authorization = token
            .map(|t| {
                let mut v = HeaderValue::from_str(&format!("Bearer {t}"))
                    .context("the token is not valid in an Authorization header")?;
                v.set_sensitive(true);
                anyhow::Ok(v)
            })
            .transpose()?;
        Ok(Client {
            inner: Arc::new(Inner {
                base,
                host,
                authorization,
            }),
        })
    }

    /// A connection of its own, opened at its first request.
    pub fn connection(&self) -> Connection {
        Connection {
            client: self.clone(),
            sender: None,
        }
    }
}

/// An answer: its status and whole body.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub body: Bytes,
}

/// One keep-alive connection, used for one request at a time. After an
/// error it is dropped, and the next request opens a new one.
#[derive(Debug)]
pub struct Connection {
    client: Client,
    sender: Option<SendRequest<Full<Bytes>>>,
}

impl Connection {
    /// POSTs a JSON body and returns the body of a 2xx answer; any other
    /// status is an error naming the endpoint, status and the server's text.
    pub async fn post(&mut self, path: &str, body: impl Into<Bytes>) -> anyhow::Result<Bytes> {
        let reply = self
            .send(Method::POST, path, body.into())
            .await
            .with_context(|| format!("POST {path}"))?;
        if !reply.status.is_success() {
            bail!(
                "POST {path}: {}: {}",
                reply.status,
                String::from_utf8_lossy(&reply.body)
            );
        }
        Ok(reply.body)
    }

    /// Sends one request and reads the whole answer, whatever its status.
    pub async fn send(&mut self, method: Method, path: &str, body: Bytes) -> anyhow::Result<Reply> {
        let request = self.request(method, path, body)?;
        match tokio::time::timeout(REQUEST_TIMEOUT, self.exchange(request)).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => {
                self.sender = None;
                Err(e)
            }
            Err(_) => {
                // Dropping the exchange cancelled it, which closes the connection.
                self.sender = None;
                bail!("no answer within {REQUEST_TIMEOUT:?}")
            }
        }
    }

    fn request(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
    ) -> anyhow::Result<Request<Full<Bytes>>> {
        let c = &self.client.inner;
        let uri = if c.base.path_prefix.is_empty() {
            Uri::try_from(path)
        } else {
            Uri::try_from(format!("{}{path}", c.base.path_prefix))
        }
        .with_context(|| format!("{path:?} is not a request path"))?;
        let mut req = Request::new(Full::new(body));
        *req.method_mut() = method;
        *req.uri_mut() = uri;
        let headers = req.headers_mut();
        headers.insert(header::HOST, c.host.clone());
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(auth) = &c.authorization {
            headers.insert(header::AUTHORIZATION, auth.clone());
        }
        Ok(req)
    }

    async fn exchange(&mut self, request: Request<Full<Bytes>>) -> anyhow::Result<Reply> {
        let sender = self.ready().await?;
        let response = match sender.try_send_request(request).await {
            Ok(r) => r,
            Err(mut e) => match e.take_message() {
                // Never written: the server closed the idle connection under
                // us. Sending it again on a fresh connection cannot repeat it.
                Some(request) => {
                    self.sender = None;
                    self.ready()
                        .await?
                        .send_request(request)
                        .await
                        .context("sending the request")?
                }
                None => return Err(e.into_error()).context("sending the request"),
            },
        };
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .context("reading the answer")?
            .to_bytes();
        Ok(Reply { status, body })
    }

    /// The sender, once it can take a request; connects first if needed.
    async fn ready(&mut self) -> anyhow::Result<&mut SendRequest<Full<Bytes>>> {
        let sender = match self.sender.take() {
            Some(s) if !s.is_closed() => s,
            _ => self.client.connect().await?,
        };
        let sender = self.sender.insert(sender);
        sender.ready().await.context("the connection closed")?;
        Ok(sender)
    }
}

impl Client {
    async fn connect(&self) -> anyhow::Result<SendRequest<Full<Bytes>>> {
        let to = &self.inner.base.connect_to;
        let stream = TcpStream::connect(to)
            .await
            .with_context(|| format!("connecting to {to}"))?;
        // Requests are small and written whole; do not let Nagle hold them.
        stream.set_nodelay(true).context("setting TCP_NODELAY")?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .with_context(|| format!("HTTP handshake with {to}"))?;
        // The connection task ends when the sender is dropped or the peer closes.
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base(connect_to: &str, host: &str, path_prefix: &str) -> BaseUrl {
        BaseUrl {
            connect_to: connect_to.into(),
            host: host.into(),
            path_prefix: path_prefix.into(),
        }
    }

    #[test]
    fn parses_http_urls_into_host_port_and_prefix() {
        for (url, want) in [
            (
                "http://127.0.0.1:7433",
                base("127.0.0.1:7433", "127.0.0.1:7433", ""),
            ),
            (
                "http://127.0.0.1:7433/",
                base("127.0.0.1:7433", "127.0.0.1:7433", ""),
            ),
            ("HTTP://localhost", base("localhost:80", "localhost", "")),
            (
                "http://queue.internal:8080/lazaret/",
                base("queue.internal:8080", "queue.internal:8080", "/lazaret"),
            ),
            ("http://[::1]:7433/", base("[::1]:7433", "[::1]:7433", "")),
            ("http://[::1]", base("[::1]:80", "[::1]", "")),
        ] {
            assert_eq!(parse_base_url(url).unwrap(), want, "{url}");
        }
    }

    #[test]
    fn refuses_what_it_cannot_speak() {
        let https = parse_base_url("https://127.0.0.1:7433").unwrap_err();
        assert!(
            format!("{https:#}").contains("plain HTTP only"),
            "{https:#}"
        );
        for url in [
            "127.0.0.1:7433",
            "ftp://127.0.0.1:7433",
            "http://",
            "http://:7433",
            "http://127.0.0.1:0",
            "http://127.0.0.1:port",
            "http://127.0.0.1:70000",
            "http://127.0.0.1:",
            "http://user:pw@127.0.0.1:7433",
            "http://127.0.0.1:7433/?x=1",
            "http://127.0.0.1:7433/#top",
            "http://[::1",
            "http://[::1]7433",
        ] {
            assert!(parse_base_url(url).is_err(), "{url} should be refused");
        }
    }

    #[test]
    fn path_segments_are_percent_encoded() {
        let enc = |s: &str| {
            let mut out = String::from("/v1/jobs/");
            push_segment(&mut out, s);
            out
        };
        assert_eq!(enc("42"), "/v1/jobs/42");
        assert_eq!(enc("j_4.2-x~"), "/v1/jobs/j_4.2-x~");
        assert_eq!(enc("a b/c?"), "/v1/jobs/a%20b%2Fc%3F");
        assert_eq!(enc("é"), "/v1/jobs/%C3%A9");
    }

    /// A server that answers each request with the next canned reply and
    /// closes the connection after it, and reports the requests it read.
    async fn canned_server(
        replies: Vec<&'static str>,
    ) -> (String, tokio::task::JoinHandle<Vec<String>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let mut seen = Vec::new();
            for reply in replies {
                let (mut stream, _) = listener.accept().await.unwrap();
                let mut buf = Vec::new();
                let mut chunk = [0; 4096];
                // Headers, then as many body bytes as content-length says.
                let request = loop {
                    let n = stream.read(&mut chunk).await.unwrap();
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).into_owned();
                    if let Some((head, body)) = text.split_once("\r\n\r\n") {
                        let len = head
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length: ")
                                    .map(str::to_owned)
                            })
                            .map_or(0, |v| v.parse().unwrap());
                        if body.len() >= len {
                            break text;
                        }
                    }
                };
                seen.push(request);
                stream.write_all(reply.as_bytes()).await.unwrap();
            }
            seen
        });
        (url, task)
    }

    #[tokio::test]
    async fn reconnects_after_a_close_and_reports_the_servers_error() {
        let ok = "HTTP/1.1 200 OK\r\ncontent-length: 10\r\nconnection: close\r\n\r\n{\"id\":\"1\"}";
        let conflict = "HTTP/1.1 409 Conflict\r\ncontent-length: 22\r\nconnection: close\r\n\r\n{\"error\":{\"code\":\"X\"}}";
        let (url, server) = canned_server(vec![ok, ok, conflict]).await;
        let client = Client::new(&format!("{url}/base/"), Some("tok")).unwrap();
        let mut conn = client.connection();
        for _ in 0..2 {
            let body = conn.post("/v1/jobs", r#"{"a":1}"#).await.unwrap();
            assert_eq!(&body[..], br#"{"id":"1"}"#);
        }
        let e = conn.post("/v1/acks", "{}").await.unwrap_err();
        assert_eq!(
            format!("{e:#}"),
            r#"POST /v1/acks: 409 Conflict: {"error":{"code":"X"}}"#
        );
        let seen = server.await.unwrap();
        assert_eq!(seen.len(), 3);
        let first = seen[0].to_ascii_lowercase();
        assert!(
            first.starts_with("post /base/v1/jobs http/1.1\r\n"),
            "{first}"
        );
        for header in [
            "authorization: bearer tok",
            "content-type: application/json",
            "content-length: 7",
        ] {
            assert!(first.contains(header), "{header} missing in {first}");
        }
        assert!(first.contains(&format!("host: {}", url.trim_start_matches("http://"))));
        assert!(first.ends_with(r#"{"a":1}"#), "{first}");
    }

    #[tokio::test]
    async fn a_refused_connection_is_an_error_naming_the_address() {
        // Bind then drop a listener: nothing listens on its port now.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let mut conn = Client::new(&format!("http://{addr}"), None)
            .unwrap()
            .connection();
        let e = conn.post("/v1/jobs", "{}").await.unwrap_err();
        assert!(
            format!("{e:#}").starts_with(&format!("POST /v1/jobs: connecting to {addr}")),
            "{e:#}"
        );
    }

    #[test]
    fn a_token_becomes_a_sensitive_bearer_header() {
        let c = Client::new("http://127.0.0.1:7433", Some("s3cret")).unwrap();
        let auth = c.inner.authorization.as_ref().unwrap();
        assert_eq!(auth, "Bearer s3cret");
        assert!(auth.is_sensitive());
        assert!(Client::new("http://127.0.0.1:7433", Some("bad\ntoken")).is_err());
        assert!(
            Client::new("http://127.0.0.1:7433", None)
                .unwrap()
                .inner
                .authorization
                .is_none()
        );
    }
}
