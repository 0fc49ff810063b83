//! Broker faults a battery injects into the machine's own services, and a
//! [`Restorer`] that always puts them back as it found them.
//!
//! Each [`Service`] is the one the machine runs (the start commands of
//! `.ci/run`): RabbitMQ on :5672, Redis on :6379, NATS JetStream on
//! :4222, tansu (Kafka API) on :9092, moto (SQS) on :4566. The faults:
//!
//! - [`Restorer::restart`]: RabbitMQ `rabbitmqctl stop_app` then
//!   `start_app` (the node keeps running, its quorum queues and persistent
//!   messages survive); Redis, NATS, tansu and moto stopped with SIGTERM
//!   and started again with the command they were running under (Redis,
//!   NATS: the machine's command; tansu, moto: the command line read from
//!   `/proc` before the stop). What survives a restart is the broker's
//!   business: NATS keeps its file storage (`-sd /var/lib/nats-server`);
//!   Redis runs with `--save "" --appendonly no` and tansu and moto keep
//!   everything in memory, so a restart loses their streams, topics and
//!   queues with every message in them.
//! - [`Restorer::pause`] / [`Restorer::resume`]: SIGSTOP and SIGCONT of
//!   the broker's process (found with `pgrep -f`).
//! - [`kill_rabbitmq_connections`], [`kill_redis_clients`]: the broker
//!   closes its clients' connections (`rabbitmqctl close_connection`,
//!   `CLIENT KILL`).
//!
//! A [`Restorer`] remembers which services answered when it was made; its
//! `Drop` (which runs when a test panics too) sends SIGCONT to every
//! process it paused, starts every service it stopped that does not
//! answer, and waits until each answers again. A panic hook installed by
//! the first restorer also sends the SIGCONTs, so a paused broker is
//! resumed even before a panicking test unwinds. A battery that touches
//! shared services must not run concurrently with other tests of the same
//! brokers: run it alone (`--test-threads=1`, its own test binary).

use std::collections::BTreeSet;
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

/// How long a service may take to answer again after a restart or a
/// restore before the restorer gives up (and says so).
pub const RESTORE_WITHIN: Duration = Duration::from_secs(90);

/// A broker the machine runs, by its port on 127.0.0.1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Service {
    /// RabbitMQ on :5672 (`rabbitmq-server -detached`).
    RabbitMq,
    /// Redis on :6379, keeping nothing on disk.
    Redis,
    /// NATS with JetStream on :4222, file storage in /var/lib/nats-server.
    Nats,
    /// tansu, a Kafka-API broker on :9092, memory storage.
    Tansu,
    /// moto's SQS on :4566, in memory.
    Moto,
}

impl Service {
    /// Its TCP port on 127.0.0.1.
    pub fn port(self) -> u16 {
        match self {
            Service::RabbitMq => 5672,
            Service::Redis => 6379,
            Service::Nats => 4222,
            Service::Tansu => 9092,
            Service::Moto => 4566,
        }
    }

    /// The `pgrep -f` pattern of its process (the one to stop or pause).
    pub fn pattern(self) -> &'static str {
        match self {
            // The Erlang VM of the node (not epmd, not the disk monitor).
            Service::RabbitMq => "beam.smp.*rabbit",
            Service::Redis => "redis-server.*:6379",
            Service::Nats => "^/usr/sbin/nats-server .*-p 4222",
            Service::Tansu => "tansu broker",
            Service::Moto => "moto_server.*4566",
        }
    }

    /// Whether its port accepts a TCP connection now.
    pub fn answers(self) -> bool {
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port()));
        TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
    }

    /// The pids `pgrep -f` finds for it.
    pub fn pids(self) -> Vec<u32> {
        Command::new("pgrep")
            .args(["-f", self.pattern()])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .filter_map(|l| l.trim().parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The pids some restorer paused and has not resumed: the panic hook and
/// every `Drop` send them SIGCONT.
static PAUSED: Mutex<BTreeSet<u32>> = Mutex::new(BTreeSet::new());
static HOOK: Once = Once::new();

fn signal(pid: u32, sig: &str) -> bool {
    Command::new("kill")
        .args([sig, &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn resume_all_paused() {
    let pids: Vec<u32> = PAUSED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .copied()
        .collect();
    for pid in pids {
        signal(pid, "-CONT");
    }
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let what = format!("{cmd:?}");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{what}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what}: {}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The command line of `pid` (from `/proc`), to start it again with.
fn cmdline(pid: u32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    (!args.is_empty()).then_some(args)
}

/// Whether `svc` answers now; for RabbitMQ, whether its app runs
/// (`rabbitmq-diagnostics check_running`).
fn up(svc: Service) -> bool {
    svc.answers()
        && (svc != Service::RabbitMq
            || run(Command::new("rabbitmq-diagnostics").args(["-q", "check_running"])).is_ok())
}

/// Waits until `svc` answers (for RabbitMQ: its app runs), at most
/// [`RESTORE_WITHIN`].
pub fn wait_answers(svc: Service) -> Result<(), String> {
    let deadline = Instant::now() + RESTORE_WITHIN;
    loop {
        if up(svc) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "{svc:?} does not answer on 127.0.0.1:{} within {RESTORE_WITHIN:?}",
                svc.port()
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Faults on the machine's services, undone when dropped: see the module
/// documentation.
#[derive(Debug)]
pub struct Restorer {
    /// The services that answered when it was made, and how to start each
    /// again (the command line read before a stop, for tansu and moto).
    found: Vec<(Service, Option<Vec<String>>)>,
    /// The pids this restorer paused.
    paused: BTreeSet<u32>,
}

impl Restorer {
    /// Notes which of `services` answer now: those are the ones it puts
    /// back. Installs (once per process) the panic hook that resumes
    /// paused processes.
    pub fn new(services: &[Service]) -> Restorer {
        HOOK.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                resume_all_paused();
                previous(info);
            }));
        });
        let found = services
            .iter()
            .filter(|s| s.answers())
            .map(|&s| {
                let line = match s {
                    Service::Tansu | Service::Moto => {
                        s.pids().first().and_then(|&pid| cmdline(pid))
                    }
                    _ => None,
                };
                (s, line)
            })
            .collect();
        Restorer {
            found,
            paused: BTreeSet::new(),
        }
    }

    /// Whether `svc` answered when this restorer was made.
    pub fn found(&self, svc: Service) -> bool {
        self.found.iter().any(|(s, _)| *s == svc)
    }

    /// SIGSTOP of `svc`'s processes (see [`Service::pattern`]).
    pub fn pause(&mut self, svc: Service) -> Result<(), String> {
        let pids = svc.pids();
        if pids.is_empty() {
            return Err(format!(
                "no process of {svc:?} to pause (pgrep -f {:?})",
                svc.pattern()
            ));
        }
        for pid in pids {
            PAUSED
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(pid);
            self.paused.insert(pid);
            if !signal(pid, "-STOP") {
                return Err(format!("kill -STOP {pid} ({svc:?}) failed"));
            }
        }
        Ok(())
    }

    /// SIGCONT of every process this restorer paused.
    pub fn resume(&mut self) {
        let mut all = PAUSED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for pid in std::mem::take(&mut self.paused) {
            signal(pid, "-CONT");
            all.remove(&pid);
        }
    }

    /// Restarts `svc` and waits until it answers again (see the module
    /// documentation for what each restart keeps).
    pub fn restart(&mut self, svc: Service) -> Result<(), String> {
        self.resume();
        if svc == Service::RabbitMq {
            run(Command::new("rabbitmqctl").args(["-q", "stop_app"]))?;
            run(Command::new("rabbitmqctl").args(["-q", "start_app"]))?;
            return wait_answers(svc);
        }
        let pids = svc.pids();
        if pids.is_empty() {
            return Err(format!("no process of {svc:?} to restart"));
        }
        for &pid in &pids {
            signal(pid, "-TERM");
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while pids
            .iter()
            .any(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
        {
            if Instant::now() >= deadline {
                for &pid in &pids {
                    signal(pid, "-KILL");
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.start(svc)?;
        wait_answers(svc)
    }

    /// Starts `svc` with the machine's command (see `.ci/run`).
    fn start(&self, svc: Service) -> Result<(), String> {
        match svc {
            Service::RabbitMq => {
                if svc.pids().is_empty() {
                    run(Command::new("rabbitmq-server").arg("-detached"))
                } else {
                    run(Command::new("rabbitmqctl").args(["-q", "start_app"]))
                }
            }
            Service::Redis => run(Command::new("redis-server").args([
                "--daemonize",
                "yes",
                "--bind",
                "127.0.0.1 -::1",
                "--port",
                "6379",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                "/var/lib/redis",
                "--logfile",
                "/var/log/redis/ci.log",
            ])),
            Service::Nats => run(Command::new("start-stop-daemon").args([
                "--start",
                "--oknodo",
                "--background",
                "--exec",
                "/usr/sbin/nats-server",
                "--",
                "-a",
                "127.0.0.1",
                "-p",
                "4222",
                "-js",
                "-sd",
                "/var/lib/nats-server",
                "-l",
                "/var/log/nats-server.log",
            ])),
            Service::Tansu | Service::Moto => {
                let line = self
                    .found
                    .iter()
                    .find(|(s, _)| *s == svc)
                    .and_then(|(_, l)| l.clone())
                    .ok_or_else(|| {
                        format!("{svc:?}'s command line was not read before it stopped")
                    })?;
                let log = match svc {
                    Service::Tansu => "/var/log/tansu.log",
                    _ => "/tmp/lazaret-ci-moto.log",
                };
                let out = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)
                    .map_err(|e| format!("{log}: {e}"))?;
                let err = out.try_clone().map_err(|e| format!("{log}: {e}"))?;
                // setsid: its own session, so it outlives the test.
                Command::new("setsid")
                    .args(&line)
                    .stdin(Stdio::null())
                    .stdout(out)
                    .stderr(err)
                    .spawn()
                    .map(drop)
                    .map_err(|e| format!("start {line:?}: {e}"))
            }
        }
    }

    /// Resumes what it paused and starts what it found running but no
    /// longer answers; waits until each answers. Errors say which did not.
    pub fn restore(&mut self) -> Result<(), String> {
        self.resume();
        let mut errors = Vec::new();
        for (svc, _) in &self.found {
            let svc = *svc;
            if up(svc) {
                continue;
            }
            if let Err(e) = self.start(svc).and_then(|()| wait_answers(svc)) {
                errors.push(e);
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }
}

impl Drop for Restorer {
    fn drop(&mut self) {
        if let Err(e) = self.restore() {
            // Not a panic in a drop that runs during one: said loudly.
            // Otherwise the test fails: a service left down is not a pass.
            eprintln!("RESTORE FAILED: {e}");
            if !std::thread::panicking() {
                panic!("a service the test touched could not be given back: {e}");
            }
        }
    }
}

/// Closes, from the broker's side, every RabbitMQ connection whose
/// client-given name (`connection_name`) starts with `prefix`
/// (`rabbitmqctl close_connection`, what `close_all_connections` does to
/// all); how many it closed. Reads the name from `client_properties`, which
/// every RabbitMQ version lists.
pub fn kill_rabbitmq_connections(prefix: &str) -> Result<usize, String> {
    let out = Command::new("rabbitmqctl")
        .args([
            "list_connections",
            "-q",
            "--no-table-headers",
            "pid",
            "client_properties",
        ])
        .output()
        .map_err(|e| format!("rabbitmqctl list_connections: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "rabbitmqctl list_connections: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let needle = format!("{{\"connection_name\",\"{prefix}");
    let mut closed = 0;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some((pid, props)) = line.split_once('\t') else {
            continue;
        };
        if props.contains(&needle)
            && run(Command::new("rabbitmqctl").args([
                "-q",
                "close_connection",
                pid.trim(),
                "closed by the lazaret fault battery",
            ]))
            .is_ok()
        {
            closed += 1;
        }
    }
    Ok(closed)
}

/// `CLIENT KILL TYPE normal SKIPME yes` on the Redis at :6379: every
/// normal client connection but the one that asks is closed; how many.
pub fn kill_redis_clients() -> Result<usize, String> {
    let out = Command::new("redis-cli")
        .args([
            "-p", "6379", "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes",
        ])
        .output()
        .map_err(|e| format!("redis-cli CLIENT KILL: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .trim_start_matches("(integer) ")
        .parse()
        .map_err(|_| format!("redis-cli CLIENT KILL answered {text:?}"))
}

/// Destroys every TCP socket of the server listening on 127.0.0.1:`port`
/// (`ss -K`, the kernel closes them as if the server had): for brokers
/// without a command that closes a client's connection (NATS, tansu).
/// How many sockets there were.
pub fn kill_sockets(port: u16) -> Result<usize, String> {
    let filter = format!("( sport = :{port} )");
    let listed = Command::new("ss")
        .args(["-Htn", &filter])
        .output()
        .map_err(|e| format!("ss: {e}"))?;
    let n = String::from_utf8_lossy(&listed.stdout).lines().count();
    let out = Command::new("ss")
        .args(["-HtnK", &filter])
        .output()
        .map_err(|e| format!("ss -K: {e}"))?;
    if out.status.success() {
        Ok(n)
    } else {
        Err(format!(
            "ss -K {filter}: {} (it needs CAP_NET_ADMIN and a kernel with INET_DIAG_DESTROY)",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}
