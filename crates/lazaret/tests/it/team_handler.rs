//! What the end-to-end source tests share, whatever the broker: the
//! broker's address from the environment (skipped visibly without it, a
//! failure under `CI=true`), and the team's handler that `lazaret serve`
//! delivers to.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{Value, json};

use crate::harness::{EVENTUALLY, Server};

/// A healthy order.
pub const ORDER_1: &str = r#"{"order": 1, "amount": 4200}"#;
/// The order the handler refuses while it is `broken`.
pub const ORDER_2: &str = r#"{"order": 2}"#;

/// The value of `var`, or `None` after saying the test is skipped (a
/// failure under `CI=true`, where `.ci/run` must start the service and set
/// it). `how` says what to set it to.
pub fn service(var: &str, how: &str, test: &str) -> Option<String> {
    lazaret_testkit::service(var, how, test)
}

/// One delivery as the handler saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    /// Its HTTP headers.
    pub headers: HeaderMap,
    /// Its body.
    pub body: Vec<u8>,
}

impl Seen {
    /// A header that must be there.
    pub fn header(&self, name: &str) -> String {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_else(|| panic!("no {name} header: {:?}", self.headers))
            .to_owned()
    }

    /// `Lazaret-Message-Id`, percent-decoded.
    pub fn message_id(&self) -> String {
        percent_decode(&self.header("lazaret-message-id"))
    }
}

/// The team's handler: records every delivery; while `broken`, refuses
/// [`ORDER_2`] as a permanent failure (400) with the contract's error body.
#[derive(Clone, Default)]
pub struct Handler {
    seen: Arc<Mutex<Vec<Seen>>>,
    /// Whether [`ORDER_2`] is refused.
    pub broken: Arc<AtomicBool>,
}

impl Handler {
    /// A handler that refuses [`ORDER_2`] until told otherwise.
    pub fn broken() -> Handler {
        let h = Handler::default();
        h.broken.store(true, Ordering::SeqCst);
        h
    }

    /// Accepts everything from now on.
    pub fn mend(&self) {
        self.broken.store(false, Ordering::SeqCst);
    }

    /// Serves on a free loopback port; returns the URL to deliver to.
    pub async fn start(&self) -> String {
        async fn handle(State(h): State<Handler>, headers: HeaderMap, body: Bytes) -> Response {
            let refuse = h.broken.load(Ordering::SeqCst) && body.as_ref() == ORDER_2.as_bytes();
            h.seen.lock().expect("not poisoned").push(Seen {
                headers,
                body: body.to_vec(),
            });
            if refuse {
                let error =
                    json!({"error": {"kind": "validation", "message": "order 2 has no amount"}});
                return (StatusCode::BAD_REQUEST, Json(error)).into_response();
            }
            StatusCode::NO_CONTENT.into_response()
        }
        let app = Router::new()
            .route("/orders", post(handle))
            .with_state(self.clone());
        format!("{}/orders", crate::harness::serve_app(app).await)
    }

    /// The deliveries of `message_id` so far.
    pub fn of(&self, message_id: &str) -> Vec<Seen> {
        self.matching(|s| s.message_id() == message_id)
    }

    fn matching(&self, keep: impl Fn(&Seen) -> bool) -> Vec<Seen> {
        self.seen
            .lock()
            .expect("not poisoned")
            .iter()
            .filter(|s| keep(s))
            .cloned()
            .collect()
    }

    /// Waits until the handler saw `message_id` `n` times.
    pub async fn deliveries(&self, message_id: &str, n: usize, server: &Server) -> Vec<Seen> {
        self.wait(message_id, n, server, |s| s.message_id() == message_id)
            .await
    }

    /// Waits until the handler saw `body` `n` times.
    pub async fn deliveries_of_body(&self, body: &str, n: usize, server: &Server) -> Vec<Seen> {
        self.wait(body, n, server, |s| s.body == body.as_bytes())
            .await
    }

    async fn wait(
        &self,
        what: &str,
        n: usize,
        server: &Server,
        keep: impl Fn(&Seen) -> bool,
    ) -> Vec<Seen> {
        let deadline = Instant::now() + EVENTUALLY;
        loop {
            let seen = self.matching(&keep);
            if seen.len() >= n {
                return seen;
            }
            assert!(
                Instant::now() < deadline,
                "{what} delivered {} time(s), not {n}, within {EVENTUALLY:?}\n--- lazaret ---\n{}",
                seen.len(),
                server.output()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The dead letters `query` selects, once there are `n` (within
/// `EVENTUALLY`).
pub async fn dead_letters(server: &Server, query: &str, n: usize) -> Vec<Value> {
    let api = server.api();
    let deadline = Instant::now() + EVENTUALLY;
    loop {
        let items = api.dead_letters(query).await;
        if items.len() >= n {
            return items;
        }
        assert!(
            Instant::now() < deadline,
            "{n} dead letter(s) for {query} within {EVENTUALLY:?}\n{}",
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `%XX` decoded (the message id and idempotency key headers).
pub fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).expect("UTF-8 after decoding")
}
