//! The CLI's side of `lazaret_client::Client`: building it from the global
//! options, and turning its errors into messages an operator can act on
//! and into the exit status (see `ExitCode`).

use std::fmt;
use std::time::Duration;

use anyhow::bail;
use lazaret_client::{Client, ClientError};

use super::args::GlobalOpts;
use super::table::{clean_line, cut};

/// How long one command's request may take. Generous: a redrive with
/// `--rate` is answered only once it is done, and a 50 MB payload may
/// cross a slow link.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

/// How long connecting may take before the server counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The exit status of a client command (docs/api.md#cli).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitCode {
    /// Done as asked.
    Ok = 0,
    /// The server answered with an error, the answer broke off, or the
    /// command did not do all it was asked (ids that match nothing, dead
    /// letters a broker did not take back).
    Failed = 1,
    /// The command line was wrong, or the command was refused before
    /// anything was sent that changes state (clap's usage errors exit 2 too).
    Usage = 2,
    /// The server could not be reached: connection refused, no such host,
    /// TLS handshake failed. Nothing was sent.
    Unreachable = 3,
}

/// The command was refused on the client side; nothing was sent that changes state.
#[derive(Debug)]
pub struct Refused(pub String);

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// The server could not be reached.
#[derive(Debug)]
pub struct Unreachable(pub String);

impl fmt::Display for Unreachable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unreachable {}

/// A non-2xx reply: shown as `CODE (reason): message` when the body is an
/// API error; the body is kept for `--json`, which prints it as is.
#[derive(Debug)]
pub struct ServerError {
    /// The contract's code, when the body is an API error.
    pub code: Option<String>,
    text: String,
    pub body: Vec<u8>,
    hint: Option<&'static str>,
}

impl fmt::Display for ServerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)?;
        if let Some(hint) = self.hint {
            write!(f, "\n  hint: {hint}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ServerError {}

/// Which exit status an error of a client command means.
pub fn exit_code(err: &anyhow::Error) -> ExitCode {
    if err.downcast_ref::<Refused>().is_some() {
        ExitCode::Usage
    } else if err.downcast_ref::<Unreachable>().is_some() {
        ExitCode::Unreachable
    } else {
        ExitCode::Failed
    }
}

/// Checks `--server` up front, with a message that says what is wrong.
pub fn check_server(server: &str) -> anyhow::Result<()> {
    let Some((scheme, rest)) = server.split_once("://") else {
        bail!("--server {server:?} is not a URL like http://127.0.0.1:7433");
    };
    if !matches!(scheme, "http" | "https") {
        bail!("--server {server}: unsupported scheme {scheme:?}; use http:// or https://");
    }
    if rest.is_empty() || rest.starts_with('/') {
        bail!("--server {server}: no host; write it like http://127.0.0.1:7433");
    }
    if rest.contains(['?', '#']) {
        bail!("--server {server}: give the base URL only, without ? or #");
    }
    Ok(())
}

/// The one client of the workspace, set up from the global options.
pub fn client(global: &GlobalOpts) -> Result<Cli, Refused> {
    let server = global.server_url();
    check_server(&server).map_err(|e| Refused(e.to_string()))?;
    let mut builder = Client::builder(&server)
        .timeout(REQUEST_TIMEOUT)
        .connect_timeout(CONNECT_TIMEOUT)
        .user_agent(concat!("lazaret-cli/", env!("CARGO_PKG_VERSION")));
    let token = global.token.as_deref().map(str::trim).unwrap_or_default();
    if !token.is_empty() {
        builder = builder.token(token);
    }
    if let Some(ca) = &global.ca_cert {
        builder = builder.ca_cert_file(ca);
    }
    let client = builder.build().map_err(|e| match e {
        ClientError::Config(msg) => Refused(msg),
        other => Refused(other.to_string()),
    })?;
    Ok(Cli {
        client,
        server,
        token_sent: !token.is_empty(),
    })
}

/// The client and what error messages need to know about it.
#[derive(Debug)]
pub struct Cli {
    pub client: Client,
    server: String,
    token_sent: bool,
}

/// A 2xx reply's body, kept as bytes so `--json` prints it untouched.
#[derive(Debug)]
pub struct Reply {
    body: bytes::Bytes,
}

impl Reply {
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> anyhow::Result<T> {
        use anyhow::Context as _;
        serde_json::from_slice(&self.body).context("the server's reply is not the JSON expected")
    }

    pub fn raw(&self) -> &[u8] {
        &self.body
    }
}

impl Cli {
    pub async fn get(&self, segments: &[&str], query: &[(&str, &str)]) -> anyhow::Result<Reply> {
        match self.client.get_raw(segments, query).await {
            Ok(body) => Ok(Reply { body }),
            Err(e) => Err(self.explain(e)),
        }
    }

    pub async fn post(
        &self,
        segments: &[&str],
        body: &impl serde::Serialize,
    ) -> anyhow::Result<Reply> {
        match self.client.post_raw(segments, body).await {
            Ok(body) => Ok(Reply { body }),
            Err(e) => Err(self.explain(e)),
        }
    }

    pub async fn delete(&self, segments: &[&str]) -> anyhow::Result<Reply> {
        match self.client.delete_raw(segments).await {
            Ok(body) => Ok(Reply { body }),
            Err(e) => Err(self.explain(e)),
        }
    }

    pub async fn stream(&self, segments: &[&str]) -> anyhow::Result<lazaret_client::BodyStream> {
        self.client
            .get_stream(segments)
            .await
            .map_err(|e| self.explain(e))
    }

    /// Turns a client error into the CLI's: what happened, and what to do.
    pub fn explain(&self, err: ClientError) -> anyhow::Error {
        match err {
            ClientError::Api {
                status: _,
                code,
                reason,
                message,
                details,
                retry_after,
                body,
            } => {
                let mut text = clean_line(code.as_str()).into_owned();
                if let Some(reason) = &reason {
                    text.push_str(&format!(" ({})", clean_line(reason)));
                }
                text.push_str(&format!(": {}", clean_line(&message)));
                if let Some(after) = retry_after {
                    text.push_str(&format!(
                        "\n  retry after: {} s",
                        after.as_secs_f64().ceil()
                    ));
                }
                if let Some(details) = &details {
                    let d = details.to_string();
                    text.push_str(&format!("\n  details: {}", cut(&clean_line(&d), 2000)));
                }
                let hint = match code.as_str() {
                    "UNAUTHORIZED" if !self.token_sent => {
                        Some("no token was sent: set LAZARET_TOKEN (or pass --token)")
                    }
                    "FORBIDDEN" => Some(
                        "this token's role may not do this: operators read, redrive and pause; \
                         only admins purge and manage tokens",
                    ),
                    _ => None,
                };
                anyhow::Error::new(ServerError {
                    code: Some(code.as_str().to_owned()),
                    text,
                    body: body.into_vec(),
                    hint,
                })
            }
            ClientError::Unexpected { status, body } => {
                let text = clean_line(body.trim()).into_owned();
                anyhow::Error::new(ServerError {
                    code: None,
                    text: format!(
                        "HTTP {status} from {} (not a lazaret error reply): {}",
                        self.server,
                        cut(&text, 300)
                    ),
                    body: body.into_bytes(),
                    hint: None,
                })
            }
            e if e.is_connect() => {
                let cause = e.cause().unwrap_or_default();
                let what = if is_certificate(&cause) {
                    "the server's TLS certificate is not trusted: pass --ca-cert FILE (or set \
                     LAZARET_CA_CERT) with the certificate of the CA that signed it"
                } else if self.server.starts_with("https://") && is_handshake(&cause) {
                    "the TLS handshake failed: does the server (or its proxy) speak https on \
                     this port? `lazaret serve` itself speaks http://"
                } else {
                    "is it running? start one with `lazaret serve`, or point --server (or \
                     LAZARET_SERVER) at a running one"
                };
                anyhow::Error::new(Unreachable(format!(
                    "cannot connect to the lazaret server at {}: {}\n  {what}",
                    self.server,
                    clean_line(&cause)
                )))
            }
            ClientError::Http(e) if e.is_timeout() => anyhow::anyhow!(
                "{}: no answer within {} s; the request may still have been applied",
                self.server,
                REQUEST_TIMEOUT.as_secs()
            ),
            e @ ClientError::Http(_) => {
                let cause = e.cause().unwrap_or_default();
                anyhow::anyhow!("{}: {}", self.server, clean_line(&cause))
            }
            other => anyhow::Error::new(other),
        }
    }
}

fn is_certificate(cause: &str) -> bool {
    let c = cause.to_ascii_lowercase();
    c.contains("certificate") || c.contains("unknownissuer")
}

fn is_handshake(cause: &str) -> bool {
    let c = cause.to_ascii_lowercase();
    c.contains("tls") || c.contains("handshake") || c.contains("corrupt message")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_url_is_checked_up_front() {
        assert!(check_server("http://127.0.0.1:7433").is_ok());
        assert!(check_server("https://q.example/lazaret").is_ok());
        let bare = check_server("127.0.0.1:7433").unwrap_err().to_string();
        assert!(bare.contains("http://127.0.0.1:7433"), "{bare}");
        assert!(check_server("ftp://h").is_err());
        assert!(check_server("http://").is_err());
        assert!(check_server("http://h/?x=1").is_err());
    }

    #[test]
    fn an_unreadable_ca_certificate_is_a_usage_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.pem");
        let opts = |ca: &std::path::Path| GlobalOpts {
            server: Some("https://127.0.0.1:1".into()),
            ca_cert: Some(ca.to_owned()),
            ..GlobalOpts::default()
        };
        let err = client(&opts(&missing)).unwrap_err().to_string();
        assert!(err.contains("nope.pem"), "{err}");
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not a certificate").unwrap();
        let err = client(&opts(&junk)).unwrap_err().to_string();
        assert!(
            err.contains("junk.pem") && err.contains("BEGIN CERTIFICATE"),
            "{err}"
        );
    }

    #[test]
    fn errors_map_to_the_documented_exit_codes() {
        assert_eq!(exit_code(&Refused("x".into()).into()), ExitCode::Usage);
        assert_eq!(
            exit_code(&Unreachable("x".into()).into()),
            ExitCode::Unreachable
        );
        assert_eq!(exit_code(&anyhow::anyhow!("x")), ExitCode::Failed);
        let codes = [
            ExitCode::Ok,
            ExitCode::Failed,
            ExitCode::Usage,
            ExitCode::Unreachable,
        ];
        assert_eq!(codes.map(|c| c as i32), [0, 1, 2, 3]);
    }
}
