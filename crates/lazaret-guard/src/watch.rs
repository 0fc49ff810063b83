//! Watch mode: the queue is a dead-letter queue the broker (or a framework
//! on it, such as Celery) already fills. Each message is taken in as a
//! dead letter with `stage: "broker"` and the broker's reason, then
//! acknowledged: the quarantine write first, the acknowledgement after it.
//! A quarantine the store refuses (a full disk) is tried again after a
//! growing delay, the message held meanwhile, and no other message is
//! taken until the store takes writes again (as in guard mode).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use lazaret_core::{DeadLetterReason, Failure, Timestamp, bounded_name};
use lazaret_store::{SourceDeadLetter, SourceRef, Stage, Store, StoreError};
use tokio::sync::watch;

use crate::broker::{Broker, Reconnecting};
use crate::celery;
use crate::guard::{Faults, GuardError, now};
use crate::host::{Host, StoreWrites, store_retry_delay};
use crate::message::{Delivery, TakenIn};
use crate::redrive::redrive_id;
use crate::spec::{SourceSpec, TenantFrom};

/// One watch source, ready to run.
pub struct Watch<H: Host> {
    spec: SourceSpec,
    host: Arc<H>,
    broker: Arc<dyn Broker>,
    faults: Faults,
    /// Whether the store takes writes, when the host keeps none.
    own_writes: StoreWrites,
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
            own_writes: StoreWrites::default(),
        }
    }

    /// Injects faults (tests).
    pub fn with_faults(mut self, faults: Faults) -> Watch<H> {
        self.faults = faults;
        self
    }

    fn writes(&self) -> &StoreWrites {
        self.host.store_writes().unwrap_or(&self.own_writes)
    }

    /// Runs until `shutdown` turns true.
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) -> Result<(), GuardError> {
        let mut messages = Reconnecting::new(self.broker.as_ref(), &self.spec.name);
        let every = (self.spec.delivery_timeout / 4)
            .clamp(Duration::from_millis(500), Duration::from_secs(10));
        loop {
            // While the store refuses writes (this source's or another's),
            // take nothing: the broker keeps its dead letters.
            while self.writes().refusal().is_some() {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    _ = shutdown.changed() => {}
                }
                if *shutdown.borrow() {
                    return Ok(());
                }
            }
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
            let mut tries = 0;
            let written = loop {
                let refused = self
                    .faults
                    .refuse_write
                    .as_ref()
                    .and_then(|refuse| refuse(&dl_delivery(&dl)));
                let r = match refused {
                    Some(e) => Err(e),
                    None => self.host.store().quarantine_message(dl.clone()).await,
                };
                match r {
                    Ok(q) => {
                        self.writes().wrote();
                        break Ok(q);
                    }
                    Err(StoreError::Closed) => break Err(StoreError::Closed),
                    Err(e) => {
                        // Held, never handed back at once: the broker would
                        // hand it straight back.
                        self.writes().refused(&self.spec.name, &e);
                        tokio::select! {
                            _ = tokio::time::sleep(store_retry_delay(tries).min(every)) => {}
                            _ = shutdown.changed() => {}
                        }
                        if *shutdown.borrow() {
                            break Err(e);
                        }
                        if let Err(e) = incoming.ack.progress().await {
                            tracing::debug!(source = %self.spec.name, "in-progress ack failed: {e}");
                        }
                        tries += 1;
                    }
                }
            };
            match written {
                Ok(q) => {
                    if q.created {
                        self.host.observe_taken_in(&self.spec.name, &dl, now());
                    }
                }
                Err(e) => {
                    tracing::warn!(source = %self.spec.name, "cannot quarantine a broker dead letter: {e}; handing it back");
                    self.host.given_back(&self.spec.name);
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
            // Hostile names fall back (the full value stays in the headers).
            TenantFrom::Header(h) => msg
                .header(h)
                .as_deref()
                .and_then(bounded_name)
                .unwrap_or("default")
                .to_owned(),
        };
        let queue = taken
            .original_queue
            .or_else(|| self.spec.redrive_to.clone())
            .unwrap_or_else(|| msg.queue.clone());
        // A Celery task's dead letter names the task beside the broker's reason.
        let error = match (taken.error, celery.as_ref()) {
            (Some(mut e), Some(t)) => {
                e.message = format!(
                    "Celery task {} ({}): {}",
                    shown(&t.name),
                    shown(&t.id),
                    e.message
                );
                Some(e)
            }
            (Some(e), None) => Some(e),
            (None, Some(t)) => Some(Failure::new(
                "celery_task",
                format!(
                    "the broker dead-lettered Celery task {} ({})",
                    shown(&t.name),
                    shown(&t.id)
                ),
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
                    .and_then(|t| bounded_name(&t.name))
                    .map_or_else(|| self.spec.job_type.to_string(), str::to_owned),
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
            may_be_held: true,
        }
    }
}

/// A name from the message as an error quotes it: escaped, at most
/// `NAME_BYTES_MAX` bytes of it.
fn shown(name: &str) -> String {
    lazaret_core::bound::quote_line(name, lazaret_core::NAME_BYTES_MAX)
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
