//! lazaret's typed HTTP client and worker runtime.
//!
//! Two layers:
//!
//! - [`Client`]: one async method per endpoint of the HTTP contract
//!   (enqueue, batch enqueue, jobs, leases, ack/fail/heartbeat and their
//!   batched forms, dead letters, redrive, purge, stats, breakers,
//!   pause/resume, audit). An error reply becomes [`ClientError::Api`] with
//!   the contract's [`ErrorCode`], so `LEASE_LOST` or `SHED` is a `match`,
//!   not string parsing.
//! - [`Worker`]: register a handler per job type with a typed payload; the
//!   runtime leases in batches (never more than it can start before the
//!   leases would expire), heartbeats running handlers, catches panics,
//!   batches acks, and shuts down without charging attempts to the jobs it
//!   hands back.
//!
//! A handler's failure is data: it returns a [`Failure`] whose [`Class`]
//! (transient, permanent, deferred with a `retry_after`) and kind it
//! chooses, or lets `?` convert common errors: I/O errors and timeouts are
//! transient, HTTP 5xx transient, 429/503 with `Retry-After` deferred,
//! other 4xx permanent ([`Failure::from_status`], [`Failure::from_reqwest`]).
//! A payload that does not deserialise is a permanent `parse` failure and
//! the handler never runs; a panic is a transient `panic` failure with its
//! message and backtrace, and the worker keeps serving.
//!
//! What this crate deliberately does not do: decide anything about a job's
//! fate. Retry or dead-letter, backoff, budgets and breakers are the
//! server's policy (`lazaret-core`); the runtime reports what happened and
//! moves bytes and time. It does not retry an ack that met `LEASE_LOST`
//! (the job is someone else's by then).
//!
//! TLS: an `https://` base URL is spoken with rustls (on ring), trusting
//! the system's roots and any CA given to
//! [`ClientBuilder::ca_cert_file`] or [`ClientBuilder::ca_cert_pem`] (a
//! private CA, or a proxy's self-signed certificate). The lazaret server
//! itself speaks plain HTTP: put it behind a TLS-terminating proxy.
//!
//! # A complete worker
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use lazaret_client::{Client, Failure, Job, NewJob, Worker};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Debug, Serialize, Deserialize)]
//! struct SendEmail {
//!     to: String,
//!     subject: String,
//! }
//!
//! async fn send_email(job: Job<SendEmail>) -> Result<(), Failure> {
//!     if !job.payload.to.contains('@') {
//!         // Retrying will not fix this address: dead-letter it at once.
//!         return Err(Failure::permanent("validation", "no @ in the address"));
//!     }
//!     let http = reqwest::Client::new();
//!     let reply = http
//!         .post("http://127.0.0.1:8025/send")
//!         // The same key on every delivery makes a redelivery harmless.
//!         .header("Idempotency-Key", job.idempotency_key().unwrap_or("none"))
//!         .json(&serde_json::json!({ "to": job.payload.to, "subject": job.payload.subject }))
//!         .timeout(Duration::from_secs(10))
//!         .send()
//!         .await?; // a timeout or a refused connection: transient
//!     match Failure::from_response(&reply) {
//!         None => Ok(()),
//!         Some(failure) => Err(failure), // 5xx transient, 429 deferred, 4xx permanent
//!     }
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let client = Client::builder("http://127.0.0.1:7433")
//!         .token(std::env::var("LAZARET_TOKEN").unwrap_or_default())
//!         .build()?;
//!
//!     let job = NewJob::new("send_email", "acme", &SendEmail {
//!         to: "ada@example.com".into(),
//!         subject: "hello".into(),
//!     })?
//!     .lane("interactive")
//!     .idempotency_key("welcome-ada");
//!     client.enqueue(&job).await?;
//!
//!     let report = Worker::builder(client)
//!         .lane("interactive", 16) // 16 handlers at once in this lane
//!         .lane("batch", 2)        // and 2 in this one, never starved by it
//!         .lease(Duration::from_secs(30))
//!         .shutdown_grace(Duration::from_secs(20))
//!         .handle("send_email", send_email)
//!         .handle("ping", |job: Job<serde_json::Value>| async move {
//!             println!("ping {} attempt {}", job.id(), job.attempt());
//!             Ok(())
//!         })
//!         .on_report(|r| println!("{} {} -> {:?}", r.job_type, r.id, r.result))
//!         .build()?
//!         .run() // until SIGTERM or ctrl-c, then a graceful shutdown
//!         .await?;
//!     println!("{report:?}");
//!     Ok(())
//! }
//! ```

pub mod client;
pub mod error;
pub mod failure;
pub mod model;
mod wire;
pub mod worker;

pub use client::{BodyStream, Client, ClientBuilder};
pub use error::{ClientError, ErrorCode, ItemError};
pub use failure::{Class, Failure};
pub use lazaret_core::{
    AttemptOutcome, DeadLetterReason, ErrorKind, JobId, JobState, JobType, Lane, TenantId, WorkerId,
};
pub use model::{
    AckItem, Admission, Attempt, AuditEntry, AuditPage, AuditRequest, Breaker, BreakerStatus,
    CancelReply, DeadLetter, DeadLetterFilter, DeadLetterId, DeadLetterPage, DeadLetterQuery,
    Enqueued, FailItem, Heartbeat, JobInfo, JobPage, JobsQuery, LeaseRequest, LeaseToken,
    LeasedJob, NewJob, Outcome, OutcomeAndLease, PauseTarget, ReasonCount, Redrive, Redriven,
    Selection, Stage,
};
pub use worker::{Job, JobReport, JobResult, RunReport, Worker, WorkerBuilder, WorkerError};
