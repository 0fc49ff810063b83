//! Raw sockets against the real server, and what its process holds: the
//! tools of the connection, shutdown and hostile-client tests.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::harness::{EVENTUALLY, RawReply, parse_reply};

/// `127.0.0.1:PORT` of a base URL.
pub fn addr(base: &str) -> &str {
    base.strip_prefix("http://").expect("an http:// base URL")
}

/// A connected socket.
pub async fn connect(base: &str) -> TcpStream {
    TcpStream::connect(addr(base)).await.expect("connected")
}

/// How a socket ended when read until the server answered or closed.
#[derive(Debug)]
pub enum Ended {
    /// A whole reply arrived.
    Reply(RawReply),
    /// The server closed (or reset) the connection without a whole reply.
    Closed,
    /// Nothing happened within the wait.
    StillOpen,
}

/// Reads `stream` until a whole reply, a close, or `wait` passes.
pub async fn read_reply(stream: &mut TcpStream, wait: Duration) -> Ended {
    let mut buf = Vec::new();
    let mut tmp = vec![0u8; 16 * 1024];
    let read = async {
        loop {
            if let Some(reply) = parse_reply(&buf) {
                return Ended::Reply(reply);
            }
            match stream.read(&mut tmp).await {
                Ok(0) | Err(_) => return Ended::Closed,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        }
    };
    tokio::time::timeout(wait, read)
        .await
        .unwrap_or(Ended::StillOpen)
}

/// Sends `bytes` on a new socket, shuts its write side when `half_close`,
/// and reads until a reply or a close (at most [`EVENTUALLY`]).
pub async fn exchange(base: &str, bytes: &[u8], half_close: bool) -> Ended {
    let mut s = connect(base).await;
    s.write_all(bytes).await.expect("request written");
    if half_close {
        s.shutdown().await.expect("write side shut");
    }
    read_reply(&mut s, EVENTUALLY).await
}

/// A whole request: `method path`, the headers (each `Name: value`) and a
/// body, with its `Content-Length`.
pub fn request(base: &str, method: &str, path: &str, headers: &[&str], body: &str) -> Vec<u8> {
    let mut text = format!(
        "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        addr(base),
        body.len()
    );
    for h in headers {
        text.push_str(h);
        text.push_str("\r\n");
    }
    text.push_str("\r\n");
    text.push_str(body);
    text.into_bytes()
}

/// The process's resident memory in KiB (`VmRSS` of `/proc/PID/status`).
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmRSS line")
}

/// The process's open descriptors (entries of `/proc/PID/fd`).
pub fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("/proc/PID/fd")
        .count()
}

/// Waits until `f()` holds, polling (at most [`EVENTUALLY`]); whether it did.
pub async fn until(mut f: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + EVENTUALLY;
    while std::time::Instant::now() < deadline {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    f()
}
