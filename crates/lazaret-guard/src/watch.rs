//! Watch mode: the queue is a dead-letter queue the broker (or a framework
//! on it, such as Celery) already fills. Each message is taken in as a
//! dead letter with `stage: "broker"` and the broker's reason, then
//! acknowledged: the quarantine write first, the acknowledgement after it.

use std::fmt;
use std::sync::Arc;

use lazaret_core::{DeadLetterReason, Failure, Timestamp};
use lazaret_store::{SourceDeadLetter, SourceRef, Stage, Store};
use serde_json::{Map, Value};
use tokio::sync::watch;

use crate::broker::{Broker, Reconnecting};
use crate::celery;
use crate::guard::{Faults, GuardError, now};
use crate::host::Host;
use crate::message::Delivery;
use crate::redrive::redrive_id;
use crate::spec::{SourceSpec, TenantFrom};

/// What a broker's dead-letter message says of itself; the adapter reads
/// it (`Broker::interpret`), the watch runtime files it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TakenIn {
    /// The broker's reason (`None`: the message carries no death
    /// information, `unknown_origin`).
    pub reason: Option<DeadLetterReason>,
    /// The error text the broker or framework carried.
    pub error: Option<Failure>,
    /// The queue the broker dead-lettered it from.
    pub original_queue: Option<String>,
    /// Its coordinates there.
    pub original_position: Option<Value>,
    /// How often the broker delivered or dead-lettered it.
    pub attempts: u32,
    /// When the broker first dead-lettered it.
    pub first_at: Option<Timestamp>,
    /// The message itself, when the dead-letter message only points at it
    /// (a JetStream advisory): body, headers, content type, id.
    pub original: Option<Delivery>,
}

/// One watch source, ready to run.
pub struct Watch<H: Host> {
    spec: SourceSpec,
    host: Arc<H>,
    broker: Arc<dyn Broker>,
    faults: Faults,
}

impl<H: Host> fmt::Debug for Watch<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watch")
            .field("source", &self.spec.name)
            .finish_non_exhaustive()
    }
}

impl<H: Host> Watch<H> {
    /// A watch of `spec`'s queue on `broker`.
    pub fn new(spec: SourceSpec, host: Arc<H>, broker: Arc<dyn Broker>) -> Watch<H> {
        Watch {
            spec,
            host,
            broker,
            faults: Faults::default(),
        }
    }

    /// Injects faults (tests).
    pub fn with_faults(mut self, faults: Faults) -> Watch<H> {
        self.faults = faults;
        self
    }

    /// Runs until `shutdown` turns true.
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) -> Result<(), GuardError> {
        let mut messages = Reconnecting::new(self.broker.as_ref(), &self.spec.name);
        loop {
            let Some(incoming) = messages.next(&mut shutdown).await else {
                return Ok(());
            };
            let mut delivery = incoming.delivery;
            delivery.resolve_id();
            let taken = match self.broker.interpret(&delivery).await {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(source = %self.spec.name, "cannot read a dead-letter message: {e}; handing it back");
                    let _ = incoming.ack.release().await;
                    continue;
                }
            };
            let dl = self.dead_letter(delivery, taken, now());
            match self.host.store().quarantine_message(dl.clone()).await {
                Ok(q) => {
                    if q.created {
                        self.host.observe_taken_in(&self.spec.name, &dl, now());
                    }
                }
                Err(e) => {
                    tracing::warn!(source = %self.spec.name, "cannot quarantine a broker dead letter: {e}; handing it back");
                    let _ = incoming.ack.release().await;
                    continue;
                }
            }
            if let Some(crash) = &self.faults.crash_after_write {
                if crash(&dl_delivery(&dl)) {
                    return Err(GuardError::Crashed);
                }
            }
            if let Err(e) = incoming.ack.ack().await {
                tracing::warn!(source = %self.spec.name, "acknowledgement failed: {e}; the redelivery will be recognised");
            }
        }
    }

    /// Files a broker's dead letter.
    pub fn dead_letter(
        &self,
        delivery: Delivery,
        taken: TakenIn,
        at: Timestamp,
    ) -> SourceDeadLetter {
        let msg = taken.original.unwrap_or(delivery);
        let celery = celery::Task::recognise(&msg.headers);
        let tenant = match &self.spec.tenant {
            TenantFrom::Fixed(t) => t.clone(),
            TenantFrom::Header(h) => msg.header(h).unwrap_or_else(|| "default".into()),
        };
        let queue = taken
            .original_queue
            .or_else(|| self.spec.redrive_to.clone())
            .unwrap_or_else(|| msg.queue.clone());
        // A Celery task's dead letter names the task beside the broker's reason.
        let error = match (taken.error, celery.as_ref()) {
            (Some(mut e), Some(t)) => {
                e.message = format!("Celery task {} ({}): {}", t.name, t.id, e.message);
                Some(e)
            }
            (Some(e), None) => Some(e),
            (None, Some(t)) => Some(Failure::new(
                "celery_task",
                format!("the broker dead-lettered Celery task {} ({})", t.name, t.id),
            )),
            (None, None) => None,
        };
        SourceDeadLetter {
            source: SourceRef {
                name: self.spec.name.clone(),
                broker: self.broker.kind().to_owned(),
                queue,
                message_id: msg.message_id.clone(),
                headers: msg.headers.clone(),
                position: taken.original_position.unwrap_or(msg.position.clone()),
                content_type: msg.content_type.clone(),
                redrive_id: redrive_id(&msg),
            },
            job_type: Some(
                celery
                    .as_ref()
                    .map_or_else(|| self.spec.job_type.to_string(), |t| t.name.clone()),
            ),
            tenant: Some(tenant),
            lane: Some(self.spec.lane.to_string()),
            // Never an invented `rejected`: nothing says the broker did it.
            reason: taken.reason.unwrap_or(DeadLetterReason::UnknownOrigin),
            stage: Stage::Broker,
            attempts: taken.attempts,
            error,
            envelope: None,
            idempotency_key: Some(celery.as_ref().map_or_else(
                || format!("{}:{}", self.spec.name, msg.message_id),
                |t| t.id.clone(),
            )),
            created_at: taken.first_at.unwrap_or(at),
            now: at,
            payload: msg.body,
            may_be_parked: true,
        }
    }
}

/// The delivery a dead letter came from, for fault hooks.
fn dl_delivery(dl: &SourceDeadLetter) -> Delivery {
    Delivery {
        message_id: dl.source.message_id.clone(),
        body: dl.payload.clone(),
        content_type: dl.source.content_type.clone(),
        headers: dl.source.headers.clone(),
        broker_prior: 0,
        redelivered: false,
        queue: dl.source.queue.clone(),
        position: dl.source.position.clone(),
    }
}

/// An empty header map (for adapters that build a [`TakenIn`]).
pub fn no_headers() -> Map<String, Value> {
    Map::new()
}
