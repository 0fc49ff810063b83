//! The `lazaret` client commands against the real server: global options
//! anywhere on the line, pause/resume, breakers, the audit log, redrive dry
//! runs, exit codes, and TLS through a local TLS endpoint.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;

use crate::harness::{QUICK, Server, id_text, job, lease_req};

const ADMIN: &str = "adm-7f3c9a";
const OPERATOR: &str = "ops-5b21e0";

/// What one run of the binary did.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    /// Asserts exit 0 and returns stdout.
    fn ok(&self) -> &str {
        assert_eq!(self.code, 0, "{self:?}");
        &self.stdout
    }
}

/// Runs `lazaret ARGS` with only the environment given (no LAZARET_* of
/// the machine's), exactly as written: no `--server` is added.
async fn lazaret(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_lazaret"));
    cmd.args(args)
        .env_remove("LAZARET_TOKEN")
        .env_remove("LAZARET_SERVER")
        .env_remove("LAZARET_CA_CERT")
        .env_remove("COLUMNS")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("`lazaret {}` hung", args.join(" ")))
        .expect("the lazaret binary runs");
    Run {
        code: out.status.code().expect("an exit code, not a signal"),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

async fn start() -> Server {
    let config = format!(
        r#"
[[tokens]]
name = "root"
role = "admin"
token = "{ADMIN}"
[[tokens]]
name = "ops-alice"
role = "operator"
token = "{OPERATOR}"
{QUICK}
[types.fragile]
attempts_max = 5

[types.fragile.breaker]
failures_min = 2
failure_ratio = 0.5
window_ms = 60000
cooldown_ms = 60000
probes = 1
"#
    );
    Server::start(&config).await
}

/// Enqueues a `fragile` job and fails it permanently: one dead letter.
async fn dead_letter(server: &Server, n: u32) -> String {
    let api = server.api_as(ADMIN);
    let id = api
        .enqueue_ok(&job("fragile", "acme", json!({ "n": n })))
        .await;
    let mut req = lease_req("w", 1, 30_000);
    req["types"] = json!(["fragile"]);
    let leased = api.lease_one(&req).await;
    assert_eq!(leased["id"], id);
    api.fail(
        &leased["id"],
        &leased["lease_token"],
        json!({"class": "permanent", "kind": "http_503", "message": "upstream says no"}),
    )
    .await
    .expect(200);
    api.dead_letter_of(&id).await["id"]
        .as_str()
        .expect("a dead-letter id")
        .to_owned()
}

#[tokio::test]
async fn global_options_go_before_between_or_after_the_subcommand() {
    let server = start().await;
    let base = server.base();
    let reasons = json!({"reasons": []});
    for line in [
        &[
            "--server", base, "--token", OPERATOR, "--json", "dlq", "reasons",
        ][..],
        &[
            "dlq", "--json", "--server", base, "reasons", "--token", OPERATOR,
        ],
        &[
            "dlq", "reasons", "--token", OPERATOR, "--json", "--server", base,
        ],
    ] {
        let run = lazaret(line, &[]).await;
        let v: Value = serde_json::from_str(run.ok()).unwrap();
        assert_eq!(v, reasons, "{line:?}");
    }
    // The token from the environment, the server from LAZARET_SERVER.
    let run = lazaret(
        &["dlq", "reasons", "--json"],
        &[("LAZARET_TOKEN", OPERATOR), ("LAZARET_SERVER", base)],
    )
    .await;
    assert_eq!(serde_json::from_str::<Value>(run.ok()).unwrap(), reasons);
}

#[tokio::test]
async fn exit_codes_say_what_kind_of_failure_it_was() {
    let server = start().await;
    let base = server.base();

    // 1: the server answered with an error; --json prints its body as is.
    let run = lazaret(&["stats", "--server", base, "--json"], &[]).await;
    assert_eq!(run.code, 1, "{run:?}");
    let body: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(body["error"]["code"], "UNAUTHORIZED", "{run:?}");
    assert!(run.stderr.contains("hint: no token was sent"), "{run:?}");
    let run = lazaret(
        &[
            "dlq",
            "purge",
            "--id",
            "1",
            "--confirm",
            "--server",
            base,
            "--token",
            OPERATOR,
        ],
        &[],
    )
    .await;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run.stderr.contains("FORBIDDEN"), "{run:?}");

    // 2: usage, or refused before anything was sent.
    let run = lazaret(&["pause", "--server", base, "--token", OPERATOR], &[]).await;
    assert_eq!(run.code, 2, "{run:?}");
    let run = lazaret(
        &["dlq", "redrive", "--server", base, "--token", OPERATOR],
        &[],
    )
    .await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(
        run.stderr.contains("say which dead letters to redrive"),
        "{run:?}"
    );
    let run = lazaret(&["stats", "--server", "localhost:7433"], &[]).await;
    assert_eq!(run.code, 2, "{run:?}");

    // 3: nothing listens there.
    let gone = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let run = lazaret(&["breakers", "--server", &gone], &[]).await;
    assert_eq!(run.code, 3, "{run:?}");
    assert!(
        run.stderr
            .contains("cannot connect to the lazaret server at"),
        "{run:?}"
    );
}

#[tokio::test]
async fn pause_resume_breakers_and_the_audit_log() {
    let server = start().await;
    let base = server.base();
    let op = |args: &[&str]| {
        let mut line: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        line.extend([
            "--server".into(),
            base.to_owned(),
            "--token".into(),
            OPERATOR.into(),
        ]);
        line
    };
    let run = |line: Vec<String>| async move {
        let args: Vec<&str> = line.iter().map(String::as_str).collect();
        lazaret(&args, &[]).await
    };

    let api = server.api_as(ADMIN);
    api.enqueue_ok(&job("report", "acme", json!({}))).await;
    let paused = run(op(&["pause", "--type", "report"])).await;
    assert!(paused.ok().starts_with("paused type report:"), "{paused:?}");
    // A paused type is not leased (and sheds new jobs).
    let mut req = lease_req("w", 1, 30_000);
    req["wait_ms"] = json!(300);
    assert!(api.lease(&req).await.is_empty(), "report is paused");
    assert_eq!(
        run(op(&["resume", "--type", "report"])).await.ok(),
        "resumed type report\n"
    );
    assert_eq!(api.lease_eventually(&req).await.len(), 1);

    assert_eq!(
        run(op(&["breakers"])).await.ok(),
        "every breaker is closed: all types are leased\n"
    );
    // Two transient http_503 failures open fragile's breaker.
    for n in 0..2 {
        api.enqueue_ok(&job("fragile", "acme", json!({ "n": n })))
            .await;
    }
    let mut fragile = lease_req("w", 1, 30_000);
    fragile["types"] = json!(["fragile"]);
    for _ in 0..2 {
        let leased = api.lease_one(&fragile).await;
        api.fail(
            &leased["id"],
            &leased["lease_token"],
            json!({"class": "transient", "kind": "http_503", "message": "down"}),
        )
        .await
        .expect(200);
    }
    let breakers = run(op(&["breakers"])).await;
    let lines: Vec<&str> = breakers.ok().lines().collect();
    assert_eq!(lines.len(), 2, "{breakers:?}");
    assert!(
        lines[0].starts_with("TYPE     KIND      STATE  UNTIL"),
        "{breakers:?}"
    );
    assert!(
        lines[1].starts_with("fragile  http_503  open   20"),
        "{breakers:?}"
    );

    // Newest first; one entry a page, then the cursor goes on.
    run(op(&["pause", "--lane", "batch"])).await.ok();
    let first = run(op(&[
        "audit", "--action", "pause", "--limit", "1", "--json",
    ]))
    .await;
    let page: Value = serde_json::from_str(first.ok()).unwrap();
    assert_eq!(page["items"].as_array().map(Vec::len), Some(1), "{page}");
    assert_eq!(page["items"][0]["actor"], "ops-alice");
    assert_eq!(page["items"][0]["request"], json!({"lane": "batch"}));
    let cursor = page["next_cursor"]
        .as_str()
        .expect("an older page")
        .to_owned();
    let older = run(op(&[
        "audit", "--action", "pause", "--cursor", &cursor, "--json",
    ]))
    .await;
    let page: Value = serde_json::from_str(older.ok()).unwrap();
    assert_eq!(
        page["items"][0]["request"],
        json!({"type": "report"}),
        "{page}"
    );
    let all = run(op(&["audit"])).await;
    let table: Vec<&str> = all.ok().lines().collect();
    assert!(table[0].starts_with("ID  AT"), "{all:?}");
    assert!(
        table[1].contains("ops-alice  pause") && table[1].contains(r#"{"lane":"batch"}"#),
        "{all:?}"
    );
    assert!(table[2].contains("ops-alice  resume"), "{all:?}");
    assert!(table[3].contains("ops-alice  pause"), "{all:?}");
}

#[tokio::test]
async fn a_redrive_dry_run_lists_the_rows_and_unknown_ids_fail_by_name() {
    let server = start().await;
    let base = server.base();
    let d1 = dead_letter(&server, 1).await;
    let line = |extra: &[&str]| {
        let mut l = vec![
            "dlq", "redrive", "--id", &d1, "--server", base, "--token", OPERATOR,
        ];
        l.extend_from_slice(extra);
        l.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let run = |l: Vec<String>| async move {
        let args: Vec<&str> = l.iter().map(String::as_str).collect();
        lazaret(&args, &[]).await
    };

    let dry = run(line(&["--dry-run"])).await;
    let out = dry.ok();
    assert!(out.contains("dry run: nothing was redriven"), "{out}");
    assert!(
        out.contains(&format!("\n{d1} ")) && out.contains("would be redriven"),
        "{out}"
    );
    assert_eq!(
        server.api_as(ADMIN).dead_letters("").await.len(),
        1,
        "still there"
    );

    let typo = run(line(&["--id", "999999", "--dry-run"])).await;
    assert_eq!(typo.code, 1, "{typo:?}");
    assert!(
        typo.stderr
            .contains("1 id(s) match no dead letter that can be redriven: 999999"),
        "{typo:?}"
    );

    let done = run(line(&[])).await;
    assert!(done.ok().contains("redriven:  1"), "{done:?}");
    assert!(server.api_as(ADMIN).dead_letters("").await.is_empty());
}

#[tokio::test]
async fn a_purge_names_the_ids_that_match_nothing_and_fails() {
    let server = start().await;
    let base = server.base();
    let d1 = dead_letter(&server, 1).await;
    let purge = |ids: &[&str], json: bool| {
        let mut l = vec![
            "dlq",
            "purge",
            "--confirm",
            "--server",
            base,
            "--token",
            ADMIN,
        ];
        if json {
            l.push("--json");
        }
        for id in ids {
            l.extend(["--id", id]);
        }
        let l: Vec<String> = l.into_iter().map(str::to_owned).collect();
        async move {
            let args: Vec<&str> = l.iter().map(String::as_str).collect();
            lazaret(&args, &[]).await
        }
    };

    let typo = purge(&["999999"], false).await;
    assert_eq!(typo.code, 1, "{typo:?}");
    assert!(
        typo.stderr.contains("1 id(s) match no dead letter: 999999"),
        "{typo:?}"
    );
    assert!(typo.stdout.contains("purged:  0"), "{typo:?}");
    assert_eq!(
        server.api_as(ADMIN).dead_letters("").await.len(),
        1,
        "the other dead letter is untouched"
    );

    // One real, one not: the real one goes, the other is named, exit 1.
    let mixed = purge(&[&d1, "424242"], true).await;
    assert_eq!(mixed.code, 1, "{mixed:?}");
    let reply: Value = serde_json::from_str(&mixed.stdout).expect("--json prints the reply");
    assert_eq!(reply, json!({"purged": 1, "not_found": ["424242"]}));
    assert!(
        mixed.stderr.contains("424242") && mixed.stderr.contains("the others were purged"),
        "{mixed:?}"
    );
    assert!(server.api_as(ADMIN).dead_letters("").await.is_empty());

    // Gone now: purging it again names it too.
    let again = purge(&[&d1], false).await;
    assert_eq!(again.code, 1, "{again:?}");
    assert!(
        again
            .stderr
            .contains(&format!("1 id(s) match no dead letter: {d1}")),
        "{again:?}"
    );
}

#[tokio::test]
async fn dlq_correct_redrives_one_dead_letter_with_a_corrected_payload() {
    let server = start().await;
    let base = server.base();
    let d1 = dead_letter(&server, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let fixed = dir.path().join("fixed.json");
    std::fs::write(&fixed, "{\"n\": 1, \"sku\": \"A-1\"}\n").unwrap();
    let fixed = fixed.to_str().unwrap();

    let run = lazaret(
        &[
            "dlq",
            "correct",
            &d1,
            "--payload-file",
            fixed,
            "--reason",
            "TICKET-311: the sku was dropped",
        ],
        &[("LAZARET_SERVER", base), ("LAZARET_TOKEN", OPERATOR)],
    )
    .await;
    let out = run.ok();
    assert!(
        out.starts_with(&format!("redriven:         {d1}\njob_id:")),
        "{out}"
    );
    assert!(out.contains("previous_sha256:"), "{out}");
    let api = server.api_as(ADMIN);
    assert!(api.dead_letters("").await.is_empty(), "moved, not copied");
    let job_id = out
        .lines()
        .find_map(|l| l.strip_prefix("job_id:"))
        .map(str::trim)
        .expect("a job id")
        .to_owned();
    let job = api.job(&json!(job_id)).await;
    assert_eq!(job["payload"], json!({"n": 1, "sku": "A-1"}), "{job}");
    let audit = lazaret(
        &[
            "audit", "--action", "redrive", "--json", "--server", base, "--token", OPERATOR,
        ],
        &[],
    )
    .await;
    let audit: Value = serde_json::from_str(audit.ok()).unwrap();
    let request = &audit["items"][0]["request"];
    assert_eq!(request["payload_edited"], true, "{audit}");
    assert_eq!(
        request["reason"], "TICKET-311: the sku was dropped",
        "{audit}"
    );

    // No reason, or a payload that is not JSON: refused before sending.
    let run = lazaret(
        &["dlq", "correct", &d1, "--payload", "{}", "--server", base],
        &[],
    )
    .await;
    assert_eq!(run.code, 2, "{run:?}");
    let run = lazaret(
        &[
            "dlq",
            "correct",
            &d1,
            "--payload",
            "{",
            "--reason",
            "x",
            "--server",
            base,
        ],
        &[],
    )
    .await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("not one valid JSON value"), "{run:?}");
}

#[tokio::test]
async fn jobs_ls_pages_and_filters_and_jobs_cancel_cancels() {
    let server = start().await;
    let base = server.base();
    let api = server.api_as(ADMIN);
    let first = api
        .enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    let second = api
        .enqueue_ok(&job("report", "globex", json!({"n": 2})))
        .await;
    let third = api
        .enqueue_ok(&job("resize", "acme", json!({"n": 3})))
        .await;
    let (first, second, third) = (id_text(&first), id_text(&second), id_text(&third));
    let op = |args: &[&str]| {
        let mut line: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        line.extend([
            "--server".into(),
            base.to_owned(),
            "--token".into(),
            OPERATOR.into(),
        ]);
        line
    };
    let run = |line: Vec<String>| async move {
        let args: Vec<&str> = line.iter().map(String::as_str).collect();
        lazaret(&args, &[]).await
    };

    // Newest first, a page of two, then the cursor for the rest.
    let page = run(op(&["jobs", "ls", "--limit", "2"])).await;
    let lines: Vec<&str> = page.ok().lines().collect();
    assert!(
        lines[0].starts_with("ID  TYPE    TENANT  LANE     STATE   ATTEMPT"),
        "{page:?}"
    );
    assert!(
        lines[1].starts_with(&format!("{third:<2}  resize  acme")),
        "{page:?}"
    );
    assert!(
        lines[2].starts_with(&format!("{second:<2}  report  globex")),
        "{page:?}"
    );
    let cursor = lines[3]
        .strip_prefix("next cursor: ")
        .and_then(|c| c.split_whitespace().next())
        .unwrap_or_else(|| panic!("a cursor line: {page:?}"));
    let rest = run(op(&[
        "jobs", "ls", "--limit", "2", "--cursor", cursor, "--json",
    ]))
    .await;
    let rest: Value = serde_json::from_str(rest.ok()).unwrap();
    assert_eq!(
        rest["items"][0]["id"].as_str(),
        Some(first.as_str()),
        "{rest}"
    );
    let acme = run(op(&[
        "jobs", "ls", "--tenant", "acme", "--type", "report", "--json",
    ]))
    .await;
    let acme: Value = serde_json::from_str(acme.ok()).unwrap();
    assert_eq!(acme["items"].as_array().map(Vec::len), Some(1), "{acme}");

    // A queued job is cancelled at once; a finished one cannot be.
    let cancelled = run(op(&["jobs", "cancel", &second])).await;
    assert_eq!(
        cancelled.ok(),
        format!("cancelled job {second}: it will not be leased again\n")
    );
    let listed = run(op(&["jobs", "ls", "--state", "cancelled"])).await;
    assert!(
        listed
            .ok()
            .contains(&format!("\n{second:<2}  report  globex")),
        "{listed:?}"
    );
    let again = run(op(&["jobs", "cancel", &second])).await;
    assert_eq!(again.code, 1, "{again:?}");
    assert!(again.stderr.contains("BAD_STATE"), "{again:?}");
    let missing = run(op(&["jobs", "cancel", "999999"])).await;
    assert_eq!(missing.code, 1, "{missing:?}");
    assert!(missing.stderr.contains("NOT_FOUND"), "{missing:?}");

    // A leased job: the cancel is requested and takes effect at its outcome.
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    let id = id_text(&leased["id"]);
    let requested = run(op(&["jobs", "cancel", &id])).await;
    assert!(
        requested
            .ok()
            .starts_with(&format!("job {id} is leased: cancel requested")),
        "{requested:?}"
    );
}

/// A TLS endpoint in front of a plain-HTTP server, as a terminating proxy
/// would be: its certificate is signed by a CA made for the test.
struct TlsFront {
    addr: SocketAddr,
    ca_pem: String,
}

async fn tls_front(backend: &str) -> TlsFront {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "lazaret test CA");
    let ca_key = KeyPair::generate().unwrap();
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .unwrap()
        .signed_by(&leaf_key, &ca, &ca_key)
        .unwrap();

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into()),
        )
        .unwrap();
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let backend = backend.trim_start_matches("http://").to_owned();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            let backend = backend.clone();
            tokio::spawn(async move {
                // A client that refuses the certificate ends the handshake.
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut plain = TcpStream::connect(&backend).await.expect("backend");
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    TlsFront {
        addr,
        ca_pem: ca.pem(),
    }
}

#[tokio::test]
async fn over_tls_the_cli_trusts_the_ca_it_is_given_and_only_that() {
    let server = start().await;
    let front = tls_front(server.base()).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &front.ca_pem).unwrap();
    let ca = ca.to_str().unwrap();
    let url = format!("https://127.0.0.1:{}", front.addr.port());
    let by_name = format!("https://localhost:{}", front.addr.port());

    let run = lazaret(
        &[
            "--server",
            &url,
            "--ca-cert",
            ca,
            "--token",
            OPERATOR,
            "dlq",
            "reasons",
        ],
        &[],
    )
    .await;
    assert_eq!(run.ok(), "no dead letters\n");
    let run = lazaret(
        &["breakers", "--json"],
        &[
            ("LAZARET_SERVER", &by_name),
            ("LAZARET_CA_CERT", ca),
            ("LAZARET_TOKEN", OPERATOR),
        ],
    )
    .await;
    assert_eq!(
        serde_json::from_str::<Value>(run.ok()).unwrap(),
        json!({"breakers": []})
    );

    // Without the CA the certificate is not trusted: exit 3, and what to do.
    let run = lazaret(&["--server", &url, "--token", OPERATOR, "stats"], &[]).await;
    assert_eq!(run.code, 3, "{run:?}");
    assert!(run.stderr.contains("certificate"), "{run:?}");
    assert!(
        run.stderr
            .contains("--ca-cert FILE (or set LAZARET_CA_CERT)"),
        "{run:?}"
    );

    // A CA file that is not one is a usage error naming the file.
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "hello").unwrap();
    let run = lazaret(
        &[
            "--server",
            &url,
            "--ca-cert",
            junk.to_str().unwrap(),
            "stats",
        ],
        &[],
    )
    .await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("junk.pem"), "{run:?}");
}
