//! systemd's service notifications (`sd_notify(3)`), for a unit of
//! `Type=notify` (`deploy/lazaret.service`): one datagram of `KEY=value`
//! lines to the socket named by `$NOTIFY_SOCKET`.
//!
//! `serve` says `READY=1` once the listener is bound and the `[[sources]]`
//! are started, and `STOPPING=1` when a signal begins the shutdown. Without
//! `$NOTIFY_SOCKET` (not under systemd) nothing is sent. A few lines over
//! std's `UnixDatagram` rather than a crate: the protocol is one `sendto`.

use std::ffi::OsStr;
use std::io;
use std::os::unix::net::UnixDatagram;
use std::path::Path;

/// The variable systemd sets for a service that may notify.
pub const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";

/// Sends `state` (newline-separated `KEY=value` lines) to `$NOTIFY_SOCKET`.
/// `Ok(false)` when the variable is not set (not run by systemd, or by a
/// unit that does not listen).
pub fn notify(state: &str) -> io::Result<bool> {
    match std::env::var_os(NOTIFY_SOCKET).filter(|s| !s.is_empty()) {
        Some(socket) => notify_to(&socket, state).map(|()| true),
        None => Ok(false),
    }
}

/// Sends `state` to `socket`: a path, or `@name` for an abstract socket.
pub fn notify_to(socket: &OsStr, state: &str) -> io::Result<()> {
    let sender = UnixDatagram::unbound()?;
    match socket.as_encoded_bytes().strip_prefix(b"@") {
        Some(name) => send_abstract(&sender, name, state),
        None => sender
            .send_to(state.as_bytes(), Path::new(socket))
            .map(drop),
    }
}

#[cfg(target_os = "linux")]
fn send_abstract(sender: &UnixDatagram, name: &[u8], state: &str) -> io::Result<()> {
    use std::os::linux::net::SocketAddrExt as _;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
    sender.send_to_addr(state.as_bytes(), &addr)?;
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn send_abstract(_: &UnixDatagram, _: &[u8], _: &str) -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "an abstract NOTIFY_SOCKET (@name) exists on Linux only",
    ))
}

/// [`notify`], with a failure logged rather than returned: a lost
/// notification must not stop a server that is otherwise fine (systemd
/// then reports the start as timed out, which says what happened).
pub fn notify_or_warn(state: &str) {
    if let Err(e) = notify(state) {
        tracing::warn!(
            error = %e,
            socket = ?std::env::var_os(NOTIFY_SOCKET),
            state,
            "cannot notify systemd through NOTIFY_SOCKET; a Type=notify unit will time out starting"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_reaches_a_socket_path_as_one_datagram() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let listener = UnixDatagram::bind(&path).unwrap();
        notify_to(path.as_os_str(), "READY=1\nSTATUS=serving").unwrap();
        let mut buf = [0u8; 64];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=serving");
    }

    #[test]
    fn a_socket_nobody_listens_on_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = notify_to(dir.path().join("gone.sock").as_os_str(), "READY=1").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn an_abstract_socket_is_reached_by_its_name() {
        use std::os::linux::net::SocketAddrExt as _;
        let name = format!("lazaret-test-notify-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixDatagram::bind_addr(&addr).unwrap();
        notify_to(OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        let mut buf = [0u8; 16];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }
}
