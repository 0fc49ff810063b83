//! Connections: the accept loop under the router, with the limits a hostile
//! client meets (docs/reliability.md, "Connections").
//!
//! - **A cap on open connections**, derived from the file-descriptor limit
//!   (raised to the hard limit at start, [`raise_fd_limit`]). At the cap,
//!   the connection idle the longest is closed to make room (as nginx
//!   reuses its keep-alive connections); when every connection is running
//!   a request (long-polls), the new one is answered `503 UNAVAILABLE`
//!   with `Retry-After` in the contract's envelope and closed: the
//!   listener never stops accepting for want of descriptors.
//! - **A header timeout** from a request's first byte to the end of its
//!   headers (slowloris), and **an idle timeout** for a connection with no
//!   request running and no bytes moving (a long-poll is a request running,
//!   so it is never idle). Both live in [`Watched`], a wrapper of the socket
//!   that hyper reads through. The body timeout is tower-http's
//!   `RequestBodyTimeoutLayer` on the router (`api::router`).
//! - **Half-closed requests are answered**: a client that sends its request
//!   and shuts down its write side still reads the answer (hyper's
//!   `half_close`), so a request that was applied is never left unanswered.
//! - **A bounded shutdown**: once the stop future ends, the listener closes,
//!   every connection is told to finish (an idle one or one still sending
//!   its headers closes at once; a body still arriving fails at once,
//!   `StopBody`; long-polls answer at once through `App::begin_stop`),
//!   and whatever is still running after `shutdown_grace_ms` is dropped.
//!
//! A connection with no request running when the shutdown begins (idle, or
//! still sending its headers) is dropped at once: its request, if any, was
//! neither applied nor answered.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};
use tower::ServiceExt;

use crate::config::HttpConfig;
use crate::error::ApiError;
use crate::metrics as m;

/// Descriptors kept out of the connection cap (the store's files, broker
/// connections, the listener, logs, the sockets being refused): a quarter
/// of the limit, at least 32 and at most 512.
pub fn fd_reserve(limit: u64) -> u64 {
    (limit / 4).clamp(32, 512)
}
/// Connections over the cap waiting for room or being refused at once, at
/// most; past that one is answered 503 without waiting, and closed.
const REFUSING_MAX: usize = 32;
/// How long a connection over the cap waits for the idle connection closed
/// for it to free its place.
const EVICTION_WAIT: Duration = Duration::from_millis(250);
/// The cap when the descriptor limit is unlimited or unknown.
const CONNECTIONS_MAX_UNLIMITED: usize = 65_536;

/// What [`raise_fd_limit`] found and did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FdLimit {
    /// The soft limit found at start (`None`: unlimited).
    pub before: Option<u64>,
    /// The soft limit now (`None`: unlimited).
    pub now: Option<u64>,
    /// The hard limit (`None`: unlimited).
    pub hard: Option<u64>,
}

/// Raises the soft limit on open files to the hard limit: the connection
/// cap is derived from it, and the default soft limit (often 1024) is far
/// below what thousands of long-polling workers need.
pub fn raise_fd_limit() -> FdLimit {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let found = getrlimit(Resource::Nofile);
    let mut limit = FdLimit {
        before: found.current,
        now: found.current,
        hard: found.maximum,
    };
    if found.current != found.maximum {
        let mut want = found;
        want.current = found.maximum;
        match setrlimit(Resource::Nofile, want) {
            Ok(()) => limit.now = found.maximum,
            Err(e) => tracing::warn!(
                error = %e, soft = ?found.current, hard = ?found.maximum,
                "could not raise the open-file limit to its hard limit; the connection cap follows the soft one"
            ),
        }
    }
    limit
}

/// The connection cap: `configured` if set and within what the descriptor
/// limit allows, else the limit less [`fd_reserve`].
pub fn connections_max(configured: Option<usize>, fd_limit: Option<u64>) -> usize {
    let derived = fd_limit.map_or(CONNECTIONS_MAX_UNLIMITED, |n| {
        (n.saturating_sub(fd_reserve(n)).max(16)).min(usize::MAX as u64) as usize
    });
    match configured {
        Some(c) if c > derived => {
            tracing::warn!(
                configured = c,
                allowed = derived,
                "[http] connections_max is above what the open-file limit allows; using the lower number. \
                 Raise the hard limit (ulimit -Hn, LimitNOFILE=) to allow more"
            );
            derived
        }
        Some(c) => c,
        None => derived,
    }
}

/// What the socket wrapper, the service and the accept loop share about
/// one connection.
#[derive(Debug, Default)]
struct ConnState {
    /// Requests whose handler is running.
    in_flight: AtomicUsize,
    /// Requests whose headers were read, in all.
    requests: AtomicU64,
    /// When a byte last moved either way ([`ms_now`]).
    last_io_ms: AtomicU64,
    /// Chosen to make room (see [`Registry::evict_idlest`]).
    evicting: AtomicBool,
    /// Woken when chosen.
    evict: Notify,
}

/// Milliseconds since the first call: a cheap clock for [`ConnState`].
fn ms_now() -> u64 {
    static EPOCH: OnceLock<std::time::Instant> = OnceLock::new();
    EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

/// The open connections, so that one may be closed to make room.
#[derive(Debug, Default)]
struct Registry {
    next: AtomicU64,
    conns: Mutex<HashMap<u64, Arc<ConnState>>>,
}

impl Registry {
    fn add(&self, state: &Arc<ConnState>) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(id, Arc::clone(state));
        id
    }

    fn remove(&self, id: u64) {
        self.lock().remove(&id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<ConnState>>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// At the cap, as nginx does with its keep-alive connections: closes the
    /// connection idle the longest (no request running; a long-poll is a
    /// request running, so it is never chosen). Whether there was one.
    fn evict_idlest(&self) -> bool {
        let conns = self.lock();
        let victim = conns
            .values()
            .filter(|c| {
                c.in_flight.load(Ordering::Acquire) == 0 && !c.evicting.load(Ordering::Acquire)
            })
            .min_by_key(|c| c.last_io_ms.load(Ordering::Relaxed));
        match victim {
            Some(v) => {
                v.evicting.store(true, Ordering::Release);
                v.evict.notify_one();
                true
            }
            None => false,
        }
    }
}

/// Counts a request as running while it lives.
struct Running(Arc<ConnState>);

impl Running {
    fn enter(state: &Arc<ConnState>) -> Self {
        state.in_flight.fetch_add(1, Ordering::AcqRel);
        state.requests.fetch_add(1, Ordering::AcqRel);
        Running(Arc::clone(state))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A socket with the header and idle timeouts: a read that would wait past
/// either fails with `TimedOut`, and hyper closes the connection.
#[derive(Debug)]
pub struct Watched<T> {
    io: T,
    state: Arc<ConnState>,
    header_timeout: Duration,
    idle_timeout: Duration,
    /// When a byte last moved either way.
    last_io: Instant,
    /// The first byte of a request whose headers are not all in yet, and
    /// the request count then (a new count: they are in).
    header_since: Option<(Instant, u64)>,
    sleep: Pin<Box<Sleep>>,
}

impl<T> Watched<T> {
    fn new(io: T, state: Arc<ConnState>, http: &HttpConfig) -> Self {
        let now = Instant::now();
        Watched {
            io,
            state,
            header_timeout: http.header_read_timeout,
            idle_timeout: http.idle_timeout,
            last_io: now,
            header_since: None,
            sleep: Box::pin(tokio::time::sleep_until(now)),
        }
    }

    /// The read is pending: fail it if a timeout passed, else wake the
    /// task when the next one would.
    fn poll_deadline(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.state.in_flight.load(Ordering::Acquire) > 0 {
            // A request is running (a long-poll, a body being read): the
            // body timeout and the handler bound it, not these.
            return Poll::Pending;
        }
        let requests = self.state.requests.load(Ordering::Acquire);
        if self.header_since.is_some_and(|(_, n)| n != requests) {
            self.header_since = None;
        }
        let (deadline, what) = match self.header_since {
            Some((since, _)) => (since + self.header_timeout, "headers"),
            None => (self.last_io + self.idle_timeout, "idle"),
        };
        self.sleep.as_mut().reset(deadline);
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                m::connection_timed_out(what);
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    match what {
                        "headers" => "the request headers took longer than header_read_timeout_ms",
                        _ => "the connection was idle longer than idle_timeout_ms",
                    },
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    let now = Instant::now();
                    this.last_io = now;
                    this.state.last_io_ms.store(ms_now(), Ordering::Relaxed);
                    if this.header_since.is_none()
                        && this.state.in_flight.load(Ordering::Acquire) == 0
                    {
                        let n = this.state.requests.load(Ordering::Acquire);
                        this.header_since = Some((now, n));
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => this.poll_deadline(cx),
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            this.last_io = Instant::now();
            this.state.last_io_ms.store(ms_now(), Ordering::Relaxed);
        }
        r
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// A request body that fails once the shutdown begins while it still waits
/// for bytes: a half-sent body is dropped then (its handler answers 400 and
/// applies nothing), while a request whose body is in keeps its grace.
struct StopBody {
    inner: Incoming,
    closing: Pin<Box<dyn Future<Output = ()> + Send + Sync>>,
}

impl StopBody {
    fn new(inner: Incoming, mut close: watch::Receiver<bool>) -> Self {
        StopBody {
            inner,
            closing: Box::pin(async move {
                let _ = close.wait_for(|c| *c).await;
            }),
        }
    }
}

impl hyper::body::Body for StopBody {
    type Data = bytes::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame.map(|f| f.map_err(Into::into))),
            Poll::Pending => match this.closing.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(
                    "the server is shutting down; the request body was not finished: send it again"
                        .into(),
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Serves `router` on `listener` until `stop` ends, then shuts down within
/// `http.shutdown_grace_ms` (see the module doc).
pub async fn run(
    listener: TcpListener,
    router: Router,
    http: HttpConfig,
    cap: usize,
    stop: impl Future<Output = ()>,
) {
    let (close_tx, close_rx) = watch::channel(false);
    let shared = Arc::new(Shared {
        router,
        http,
        close: close_rx,
        permits: Arc::new(Semaphore::new(cap)),
        cap,
        registry: Registry::default(),
    });
    let waiting = Arc::new(Semaphore::new(REFUSING_MAX));
    let mut conns = JoinSet::new();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // Out of descriptors (the cap keeps this rare) or a
                        // connection reset before it was accepted: pause
                        // briefly rather than spin, and go on.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                if let Ok(permit) = Arc::clone(&shared.permits).try_acquire_owned() {
                    conns.spawn(connection(stream, Arc::clone(&shared), permit));
                    continue;
                }
                // At the cap: close the connection idle the longest and
                // take its place; with none idle (every connection is
                // running a request), or too many waiting, 503.
                match Arc::clone(&waiting).try_acquire_owned() {
                    Ok(slot) => {
                        let shared = Arc::clone(&shared);
                        conns.spawn(async move {
                            let permit = if shared.registry.evict_idlest() {
                                tokio::time::timeout(
                                    EVICTION_WAIT,
                                    Arc::clone(&shared.permits).acquire_owned(),
                                )
                                .await
                                .ok()
                                .and_then(Result::ok)
                            } else {
                                None
                            };
                            match permit {
                                Some(permit) => {
                                    drop(slot);
                                    connection(stream, shared, permit).await;
                                }
                                None => {
                                    m::connection_refused();
                                    refuse(stream, shared.cap).await;
                                    drop(slot);
                                }
                            }
                        });
                    }
                    // Too many waiting at once: the answer fits an empty
                    // send buffer, so write it without waiting, and close.
                    Err(_) => {
                        m::connection_refused();
                        let _ = stream.try_write(refusal(cap).as_bytes());
                    }
                }
            }
        }
    }
    drop(listener);
    let _ = close_tx.send(true);
    let grace = http.shutdown_grace;
    let drained =
        tokio::time::timeout(grace, async { while conns.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!(
            connections = conns.len(),
            grace_ms = crate::config::millis(http.shutdown_grace),
            "requests still running after the shutdown grace are dropped"
        );
        conns.shutdown().await;
    }
}

/// What every connection task shares.
struct Shared {
    router: Router,
    http: HttpConfig,
    close: watch::Receiver<bool>,
    permits: Arc<Semaphore>,
    cap: usize,
    registry: Registry,
}

/// Serves one connection (a TCP socket; an in-memory pipe in the tests,
/// which run it under paused time) until it ends, times out, is chosen to
/// make room, or the shutdown closes it.
async fn connection<T>(stream: T, shared: Arc<Shared>, permit: OwnedSemaphorePermit)
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    m::connections(shared.cap - shared.permits.available_permits());
    let http = shared.http;
    let router = shared.router.clone();
    let mut close = shared.close.clone();
    let state = Arc::new(ConnState::default());
    state.last_io_ms.store(ms_now(), Ordering::Relaxed);
    let id = shared.registry.add(&state);
    let io = TokioIo::new(Watched::new(stream, Arc::clone(&state), &http));
    let state_at_close = Arc::clone(&state);
    let closing = close.clone();
    let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let running = Running::enter(&state);
        let router = router.clone();
        let closing = closing.clone();
        async move {
            let req = req.map(|b| Body::new(StopBody::new(b, closing)));
            let resp = router.oneshot(req).await;
            drop(running);
            resp
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .half_close(true)
        .keep_alive(true)
        .serve_connection(io, svc);
    tokio::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "connection ended");
            }
        }
        () = async { let _ = close.wait_for(|c| *c).await; } => {
            // No request running (idle, or headers still coming): dropped
            // now, unanswered and not applied. A request running gets the
            // grace, and the connection closes after its answer.
            if state_at_close.in_flight.load(Ordering::Acquire) > 0 {
                conn.as_mut().graceful_shutdown();
                let _ = conn.await;
            }
        }
        () = state_at_close.evict.notified() => {
            // Chosen to make room while idle; should a request have begun
            // meanwhile, it is answered first.
            m::connection_evicted();
            if state_at_close.in_flight.load(Ordering::Acquire) > 0 {
                conn.as_mut().graceful_shutdown();
                let _ = conn.await;
            }
        }
    }
    shared.registry.remove(id);
    drop(permit);
    m::connections(shared.cap - shared.permits.available_permits());
}

/// The whole 503 answer to a connection over the cap.
fn refusal(cap: usize) -> String {
    let body = ApiError::unavailable(format!(
        "the server has {cap} connections open, its cap ([http] connections_max, or the open-file limit); \
         retry after the Retry-After seconds, and reuse connections (keep-alive) rather than opening many"
    ))
    .body()
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         retry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Answers a connection over the cap: 503 in the envelope, then closes
/// (reading what the client sent meanwhile, for at most 250 ms, so the
/// close does not reset the answer away).
async fn refuse(mut stream: TcpStream, cap: usize) {
    let reply = refusal(cap);
    let _ = tokio::time::timeout(Duration::from_millis(250), async {
        stream.write_all(reply.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut seen = 0usize;
        loop {
            let n = stream.read(&mut sink).await?;
            seen += n;
            if n == 0 || seen > 64 * 1024 {
                return Ok::<(), io::Error>(());
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_follows_the_descriptor_limit_and_never_exceeds_it() {
        assert_eq!(connections_max(None, Some(20_000)), 20_000 - 512);
        assert_eq!(connections_max(Some(100), Some(20_000)), 100);
        assert_eq!(connections_max(Some(50_000), Some(20_000)), 20_000 - 512);
        assert_eq!(connections_max(None, Some(1024)), 768);
        assert_eq!(connections_max(None, Some(256)), 192);
        assert_eq!(connections_max(None, Some(40)), 16);
        assert_eq!(connections_max(None, None), CONNECTIONS_MAX_UNLIMITED);
    }

    /// The timeouts of [`Watched`] and the shutdown of [`connection`],
    /// under paused time: the runtime's clock jumps to the next timer
    /// whenever every task waits, so the defaults (10 s for headers, 75 s
    /// idle) are met exactly and cost no wall time. An in-memory pipe stands
    /// for the socket.
    mod paused {
        use axum::routing::get;
        use tokio::io::DuplexStream;

        use super::*;

        /// A handler that runs for ten minutes, like a long-poll that waits.
        const SLOW: Duration = Duration::from_secs(600);

        fn shared(http: HttpConfig) -> (Arc<Shared>, watch::Sender<bool>) {
            let router = Router::new()
                .route("/quick", get(|| async { "quick" }))
                .route(
                    "/slow",
                    get(|| async {
                        tokio::time::sleep(SLOW).await;
                        "slow"
                    }),
                );
            let (close_tx, close) = watch::channel(false);
            let shared = Arc::new(Shared {
                router,
                http,
                close,
                permits: Arc::new(Semaphore::new(8)),
                cap: 8,
                registry: Registry::default(),
            });
            (shared, close_tx)
        }

        /// A client end whose server end is served by [`connection`].
        fn open(shared: &Arc<Shared>) -> (DuplexStream, tokio::task::JoinHandle<()>) {
            let (client, server) = tokio::io::duplex(64 * 1024);
            let permit = Arc::clone(&shared.permits)
                .try_acquire_owned()
                .expect("a permit");
            let task = tokio::spawn(connection(server, Arc::clone(shared), permit));
            (client, task)
        }

        /// Reads until the server closes: everything it sent, and when it
        /// closed.
        async fn until_closed(client: &mut DuplexStream) -> (String, Instant) {
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.expect("read");
            (String::from_utf8_lossy(&got).into_owned(), Instant::now())
        }

        /// Reads one whole answer to a `GET` (headers and a body of
        /// `Content-Length` bytes), leaving the connection open.
        async fn one_answer(client: &mut DuplexStream) -> (String, Instant) {
            let mut got = Vec::new();
            let mut buf = [0u8; 1024];
            loop {
                let n = client.read(&mut buf).await.expect("read");
                assert!(n > 0, "closed before the answer: {got:?}");
                got.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&got).into_owned();
                if let Some(end) = text.find("\r\n\r\n") {
                    let len: usize = text[..end]
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length: ")
                                .map(|v| v.trim().parse().expect("a length"))
                        })
                        .expect("content-length");
                    if got.len() >= end + 4 + len {
                        return (text, Instant::now());
                    }
                }
            }
        }

        /// `took` is `want`, to the timer's millisecond.
        fn about(took: Duration, want: Duration) {
            assert!(
                took >= want && took <= want + Duration::from_millis(1),
                "took {took:?}, want {want:?}"
            );
        }

        #[tokio::test(start_paused = true)]
        async fn headers_that_never_end_are_cut_at_the_header_timeout() {
            let http = HttpConfig::default();
            let (shared, _close) = shared(http);
            let (mut client, _task) = open(&shared);
            let begun = Instant::now();
            client
                .write_all(b"GET /quick HTTP/1.1\r\nHost: a\r\nX-A: ")
                .await
                .expect("written");
            let (answer, closed) = until_closed(&mut client).await;
            assert_eq!(answer, "", "nothing is answered to a request never read");
            about(closed - begun, http.header_read_timeout);
        }

        #[tokio::test(start_paused = true)]
        async fn header_bytes_trickling_in_do_not_extend_the_header_timeout() {
            let http = HttpConfig::default();
            let (shared, _close) = shared(http);
            let (mut client, _task) = open(&shared);
            let begun = Instant::now();
            client
                .write_all(b"GET /quick HTTP/1.1\r\n")
                .await
                .expect("written");
            // A header byte every second, each one well inside the idle
            // timeout: slowloris. Cut at 10 s all the same.
            let mut cut = false;
            for _ in 0..60 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                if client.write_all(b"x").await.is_err() {
                    cut = true;
                    break;
                }
            }
            assert!(
                cut,
                "a header byte a second kept the connection for a minute"
            );
            let closed = Instant::now();
            // The write that failed is the first after the close.
            let took = closed - begun;
            assert!(
                took >= http.header_read_timeout
                    && took <= http.header_read_timeout + Duration::from_secs(1),
                "cut after {took:?}"
            );
        }

        #[tokio::test(start_paused = true)]
        async fn a_connection_that_sends_nothing_is_closed_at_the_idle_timeout() {
            let http = HttpConfig::default();
            let (shared, _close) = shared(http);
            let begun = Instant::now();
            let (mut client, _task) = open(&shared);
            let (answer, closed) = until_closed(&mut client).await;
            assert_eq!(answer, "");
            about(closed - begun, http.idle_timeout);
        }

        #[tokio::test(start_paused = true)]
        async fn a_kept_alive_connection_is_closed_an_idle_timeout_after_its_answer() {
            let http = HttpConfig::default();
            let (shared, _close) = shared(http);
            let (mut client, _task) = open(&shared);
            // Some time passes before the request: it does not count.
            tokio::time::sleep(Duration::from_secs(30)).await;
            client
                .write_all(b"GET /quick HTTP/1.1\r\nHost: a\r\n\r\n")
                .await
                .expect("written");
            let (answer, answered) = one_answer(&mut client).await;
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            assert!(answer.ends_with("quick"), "{answer}");
            let (rest, closed) = until_closed(&mut client).await;
            assert_eq!(rest, "");
            about(closed - answered, http.idle_timeout);
        }

        #[tokio::test(start_paused = true)]
        async fn a_request_running_outlives_every_timeout_and_is_answered() {
            let http = HttpConfig::default();
            assert!(SLOW > http.idle_timeout * 4 && SLOW > http.header_read_timeout * 4);
            let (shared, _close) = shared(http);
            let (mut client, _task) = open(&shared);
            let begun = Instant::now();
            client
                .write_all(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
                .await
                .expect("written");
            let (answer, answered) = one_answer(&mut client).await;
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            assert!(answer.ends_with("slow"), "{answer}");
            about(answered - begun, SLOW);
        }

        #[tokio::test(start_paused = true)]
        async fn the_shutdown_drops_an_idle_connection_at_once_and_answers_a_running_one() {
            let http = HttpConfig::default();
            let (shared, close) = shared(http);
            let (mut idle, _idle_task) = open(&shared);
            let (mut busy, busy_task) = open(&shared);
            busy.write_all(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
                .await
                .expect("written");
            tokio::time::sleep(Duration::from_secs(1)).await;
            let began = Instant::now();
            close.send(true).expect("the connections listen");
            let (answer, closed) = until_closed(&mut idle).await;
            assert_eq!(answer, "");
            assert_eq!(closed, began, "the idle connection is dropped at once");
            let (answer, answered) = until_closed(&mut busy).await;
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            assert!(answer.ends_with("slow"), "{answer}");
            about(answered - began, SLOW - Duration::from_secs(1));
            busy_task
                .await
                .expect("the connection task ends after its answer");
        }
    }
}
