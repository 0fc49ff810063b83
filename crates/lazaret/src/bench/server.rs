//! Spawning a throwaway `lazaret serve` for a bench run, and reading its RSS.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use bytes::Bytes;
use hyper::{Method, StatusCode};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::http;

/// What the server prints as its first stdout line.
const LISTENING_PREFIX: &str = "lazaret listening on ";

/// How long the server may take to print its address and to become healthy.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Parses `lazaret listening on http://127.0.0.1:PORT` into the base URL
/// (no trailing slash). Text after the URL (a note in parentheses, say) is
/// ignored.
pub fn parse_listening_line(line: &str) -> anyhow::Result<String> {
    let rest = line
        .trim()
        .strip_prefix(LISTENING_PREFIX)
        .with_context(|| format!("not a listening line: {line:?}"))?;
    let url = rest.split_whitespace().next().unwrap_or("");
    let url = url
        .trim_end_matches([',', ';', ')', '.'])
        .trim_end_matches('/');
    let Some(authority) = url.strip_prefix("http://") else {
        bail!("listening line has no http:// URL: {line:?}");
    };
    let Some((host, port)) = authority.rsplit_once(':') else {
        bail!("listening URL has no port: {line:?}");
    };
    if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
        bail!("listening URL has no usable host and port: {line:?}");
    }
    Ok(url.to_owned())
}

/// A value in kB from `/proc/<pid>/status` text (`VmRSS:\t  1234 kB`).
pub fn parse_status_kb(status: &str, key: &str) -> Option<u64> {
    status.lines().find_map(|l| {
        let value = l.strip_prefix(key)?.strip_prefix(':')?;
        value.split_whitespace().next()?.parse().ok()
    })
}

/// RSS (`VmRSS`) and peak RSS (`VmHWM`) of a process in kB, if it can be read.
pub fn rss_kb(pid: u32) -> (Option<u64>, Option<u64>) {
    match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(s) => (parse_status_kb(&s, "VmRSS"), parse_status_kb(&s, "VmHWM")),
        Err(_) => (None, None),
    }
}

/// This binary, to run as the server. When the file was replaced since we
/// started (a rebuild in a shared target directory), `/proc/self/exe` still
/// runs the binary we are.
fn server_binary() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("finding the lazaret binary")?;
    let proc_exe = Path::new("/proc/self/exe");
    if !exe.exists() && proc_exe.exists() {
        return Ok(proc_exe.to_owned());
    }
    Ok(exe)
}

/// User plus system CPU time in clock ticks from `/proc/<pid>/stat` text.
pub fn parse_stat_ticks(stat: &str) -> Option<u64> {
    // The command name may hold spaces and parentheses; fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12th and 13th after the name.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// CPU time a process has used so far, in seconds (Linux reports it in
/// USER_HZ ticks, which are 1/100 s).
/// The machine's load average over 1, 5 and 15 minutes (`/proc/loadavg`).
pub fn loadavg() -> Option<[f64; 3]> {
    parse_loadavg(&std::fs::read_to_string("/proc/loadavg").ok()?)
}

fn parse_loadavg(text: &str) -> Option<[f64; 3]> {
    let mut it = text.split_whitespace().map(str::parse::<f64>);
    Some([it.next()?.ok()?, it.next()?.ok()?, it.next()?.ok()?])
}

pub fn cpu_s(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(parse_stat_ticks(&stat)? as f64 / 100.0)
}

/// A directory removed (with its contents) when dropped.
#[derive(Debug)]
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> anyhow::Result<Self> {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path =
            std::env::temp_dir().join(format!("lazaret-bench-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(TempDir(path))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A `lazaret serve` child on a random loopback port with its data in a
/// temporary directory. Killed (and the directory removed) on drop.
#[derive(Debug)]
pub struct ServerProcess {
    child: Child,
    pid: u32,
    url: String,
    log: PathBuf,
    // Last, so it is removed after the child is killed.
    _dir: TempDir,
}

impl ServerProcess {
    /// Starts `current_exe serve --listen 127.0.0.1:0 --data DIR [--config FILE]`
    /// (`--store URL` instead of `--data` when given) and waits until
    /// `GET /healthz` answers 200.
    pub async fn spawn(config: Option<&Path>, store: Option<&str>) -> anyhow::Result<Self> {
        Self::spawn_binary(&server_binary()?, config, store).await
    }

    /// [`spawn`](Self::spawn) with the `lazaret` binary at `exe` (the
    /// promise bench is not that binary).
    pub async fn spawn_binary(
        exe: &Path,
        config: Option<&Path>,
        store: Option<&str>,
    ) -> anyhow::Result<Self> {
        let dir = TempDir::new()?;
        let data = dir.0.join("data");
        std::fs::create_dir_all(&data).with_context(|| format!("creating {}", data.display()))?;
        let log = dir.0.join("server.log");
        let log_file =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;

        let mut cmd = Command::new(exe);
        cmd.arg("serve").arg("--listen").arg("127.0.0.1:0");
        match store {
            Some(url) => cmd.arg("--store").arg(url),
            None => cmd.arg("--data").arg(&data),
        };
        if let Some(config) = config {
            cmd.arg("--config").arg(config);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {} serve", exe.display()))?;
        let pid = child.id().context("server exited at once")?;
        let stdout = child.stdout.take().context("server stdout")?;

        let mut lines = BufReader::new(stdout).lines();
        let found = tokio::time::timeout(START_TIMEOUT, async {
            let mut seen = Vec::new();
            while let Some(line) = lines.next_line().await? {
                if let Ok(url) = parse_listening_line(&line) {
                    return Ok(url);
                }
                seen.push(line);
            }
            bail!("server closed stdout before printing its address; stdout was {seen:?}")
        })
        .await;
        let mut server = ServerProcess {
            child,
            pid,
            url: String::new(),
            log,
            _dir: dir,
        };
        server.url = match found {
            Ok(Ok(url)) => url,
            Ok(Err(e)) => return Err(server.fail(e).await),
            Err(_) => {
                let e = anyhow::anyhow!("server printed no listening line in {START_TIMEOUT:?}");
                return Err(server.fail(e).await);
            }
        };
        // Keep draining stdout so the server never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

        if let Err(e) = server.wait_healthy().await {
            return Err(server.fail(e).await);
        }
        Ok(server)
    }

    async fn wait_healthy(&mut self) -> anyhow::Result<()> {
        let url = format!("{}/healthz", self.url);
        let mut conn = http::Client::new(&self.url, None)?.connection();
        let deadline = Instant::now() + START_TIMEOUT;
        let mut last = String::from("no answer yet");
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("server exited ({status}) before /healthz answered 200 ({last})");
            }
            let health = conn.send(Method::GET, "/healthz", Bytes::new());
            match tokio::time::timeout(Duration::from_secs(5), health).await {
                Ok(Ok(r)) if r.status == StatusCode::OK => return Ok(()),
                Ok(Ok(r)) => last = format!("last answer {}", r.status),
                Ok(Err(e)) => last = format!("last error {e:#}"),
                Err(_) => last = "last try timed out".into(),
            }
            if Instant::now() > deadline {
                bail!("GET {url} did not answer 200 within {START_TIMEOUT:?} ({last})");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills the child and adds its log to `e`.
    async fn fail(mut self, e: anyhow::Error) -> anyhow::Error {
        let _ = self.child.kill().await;
        anyhow::anyhow!("{e:#}\n{}", self.log_excerpt())
    }

    /// The server's stderr, shortened to its first and last lines.
    pub fn log_excerpt(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let shown = if lines.len() <= 30 {
            lines.join("\n")
        } else {
            let (head, tail) = (&lines[..10], &lines[lines.len() - 15..]);
            format!("{}\n[...]\n{}", head.join("\n"), tail.join("\n"))
        };
        format!("--- server log ({}):\n{shown}", self.log.display())
    }

    /// The server's base URL (`http://127.0.0.1:PORT`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the server is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Kills the server and waits for it; the data directory goes with `self`.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// A schema of its own for one bench run on PostgreSQL.
pub struct BenchSchema {
    opts: lazaret_store::PgOptions,
    url: String,
}

impl BenchSchema {
    pub async fn new(url: &str) -> anyhow::Result<Self> {
        let mut opts = lazaret_store::PgOptions::from_url(url)?;
        opts.schema = format!(
            "lz_bench_{}_{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis())
        );
        let sep = if opts.url.contains('?') { '&' } else { '?' };
        let url = format!("{}{sep}schema={}", opts.url, opts.schema);
        Ok(BenchSchema { opts, url })
    }

    pub fn store_url(&self) -> String {
        self.url.clone()
    }

    pub async fn drop_schema(self) {
        if let Err(e) = lazaret_store::postgres::drop_schema(&self.opts).await {
            eprintln!("  could not drop schema {}: {e}", self.opts.schema);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_load_average() {
        assert_eq!(
            parse_loadavg("1.52 0.98 0.40 3/412 12345\n"),
            Some([1.52, 0.98, 0.40])
        );
        assert_eq!(parse_loadavg("1.5 x"), None);
    }

    #[test]
    fn parses_the_listening_line() {
        let url = parse_listening_line("lazaret listening on http://127.0.0.1:40123").unwrap();
        assert_eq!(url, "http://127.0.0.1:40123");
        // Line endings, a trailing slash and a note after the URL are fine.
        for line in [
            "lazaret listening on http://127.0.0.1:40123\r\n",
            "lazaret listening on http://127.0.0.1:40123/",
            "lazaret listening on http://127.0.0.1:40123 (loopback only: no tokens configured)",
            "lazaret listening on http://127.0.0.1:40123, loopback only",
        ] {
            assert_eq!(
                parse_listening_line(line).unwrap(),
                "http://127.0.0.1:40123",
                "{line:?}"
            );
        }
        assert_eq!(
            parse_listening_line("lazaret listening on http://[::1]:7433").unwrap(),
            "http://[::1]:7433"
        );
    }

    #[test]
    fn rejects_other_lines() {
        for line in [
            "",
            "starting lazaret",
            "listening on http://127.0.0.1:40123",
            "lazaret listening on ",
            "lazaret listening on 127.0.0.1:40123",
            "lazaret listening on https://127.0.0.1:40123",
            "lazaret listening on http://127.0.0.1",
            "lazaret listening on http://127.0.0.1:0",
            "lazaret listening on http://127.0.0.1:port",
            "lazaret listening on http://:40123",
        ] {
            assert!(
                parse_listening_line(line).is_err(),
                "{line:?} should be refused"
            );
        }
    }

    #[test]
    fn reads_kb_from_proc_status() {
        let status = "Name:\tlazaret\nVmHWM:\t   51234 kB\nVmRSS:\t   40960 kB\nThreads:\t9\n";
        assert_eq!(parse_status_kb(status, "VmRSS"), Some(40960));
        assert_eq!(parse_status_kb(status, "VmHWM"), Some(51234));
        assert_eq!(parse_status_kb(status, "VmSwap"), None);
        // Our own process has an RSS.
        assert!(rss_kb(std::process::id()).0.unwrap_or(0) > 0);
    }

    #[test]
    fn reads_cpu_ticks_from_proc_stat() {
        let stat =
            "4242 (lazaret (x) y) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 75 0 0 20 0 9 0 1 2 3";
        assert_eq!(parse_stat_ticks(stat), Some(325));
        assert_eq!(parse_stat_ticks("4242 (short) S 1"), None);
        assert!(cpu_s(std::process::id()).is_some());
    }
}
