//! Redrive back to the broker: a dead letter of a source is republished to
//! `redrive_to` (or where it came from) with its headers minus the
//! broker's own, `x-lazaret-message-id` set to its message id,
//! `x-lazaret-attempt: 0` and `x-lazaret-redrive-id` (one id per redrive
//! request), so the copy is never taken for the dead letter it came from,
//! and the dead letter's validated `traceparent` (lazaret's redrive span as
//! the parent when spans are exported) in place of the original's.
//! The caller removes the dead letter only after the broker confirmed the
//! publish.
//!
//! Where a watch source's dead letter goes back to comes from the message
//! (RabbitMQ's `x-death` names its queue), which whoever can publish to
//! the dead-letter queue controls; so a watch source redrives only to
//! `redrive_to`, the queues of the config's own sources on its broker, and
//! those listed in `redrive_allow` ([`SourceSpec::redrive_allow`]), never
//! to the queue it watches, and never to a name the broker cannot take.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use lazaret_store::{DeadLetter, SourceRef};

use crate::broker::{Broker, BrokerError};
use tracing::Instrument;

use crate::message::{Delivery, Republish, header_text, republish_headers, set_traceparent};
use crate::spec::{BrokerKind, Mode, SourceSpec};

/// The header a redriven copy carries: the redrive request's id. A
/// delivery that carries one is never matched against the dead letter it
/// was redriven from (it is part of a dead letter's key, see
/// `lazaret_store::MessageKey`).
pub const REDRIVE_ID_HEADER: &str = "x-lazaret-redrive-id";
/// The longest redrive id taken from a message; a longer one (not
/// lazaret's) is ignored.
pub const REDRIVE_ID_BYTES_MAX: usize = 64;
/// The longest queue name a redrive publishes to (AMQP's short string;
/// RabbitMQ closes the connection with `FRAME_ERROR` on a longer one).
pub const QUEUE_NAME_BYTES_MAX: usize = 255;
/// How much of a refused queue name an error quotes.
const QUOTED_NAME_BYTES_MAX: usize = 80;

/// The redrive id a delivery carries, if it is one lazaret could have
/// written (printable ASCII, at most [`REDRIVE_ID_BYTES_MAX`] bytes).
pub fn redrive_id(d: &Delivery) -> Option<String> {
    d.header(REDRIVE_ID_HEADER).filter(|id| {
        !id.is_empty()
            && id.len() <= REDRIVE_ID_BYTES_MAX
            && id.bytes().all(|b| b.is_ascii_graphic())
    })
}

/// A fresh redrive id: one per redrive request (every message that request
/// republishes carries it).
pub fn new_redrive_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{nanos:x}-{:x}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A name fit for an error message: at most `QUOTED_NAME_BYTES_MAX`
/// bytes of it, and its length when cut.
pub fn quoted(name: &str) -> String {
    if name.len() <= QUOTED_NAME_BYTES_MAX {
        return format!("{name:?}");
    }
    let mut end = QUOTED_NAME_BYTES_MAX;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}… ({} bytes)", &name[..end], name.len())
}

/// Why `name` cannot be a queue (stream, subject, topic) of `broker`, if
/// it cannot.
pub fn check_queue_name(broker: BrokerKind, name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("it is empty".into());
    }
    let max = match broker {
        // Kafka's own limit on topic names.
        BrokerKind::Kafka => 249,
        _ => QUEUE_NAME_BYTES_MAX,
    };
    if name.len() > max {
        return Err(format!(
            "it is {} bytes long; {} allows at most {max}",
            name.len(),
            broker.as_str()
        ));
    }
    if name.chars().any(char::is_control) {
        return Err("it holds control characters".into());
    }
    match broker {
        BrokerKind::Nats if name.contains(char::is_whitespace) => {
            Err("a NATS subject holds no whitespace".into())
        }
        BrokerKind::Kafka
            if !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')) =>
        {
            Err("a Kafka topic holds only letters, digits, '.', '_' and '-'".into())
        }
        _ => Ok(()),
    }
}

/// The sources a server runs, by name: where redrives of their dead
/// letters go.
#[derive(Default, Clone)]
pub struct SourceSet {
    sources: HashMap<String, (SourceSpec, Arc<dyn Broker>)>,
}

impl fmt::Debug for SourceSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.sources.keys()).finish()
    }
}

/// Why a dead letter could not be redriven to its broker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedriveError {
    /// The dead letter is lazaret's own job, not a broker message.
    #[error("dead letter {0} is not a broker message")]
    NotASource(u64),
    /// No running source has that name (it was removed from the config).
    #[error(
        "dead letter {id} came from source {name:?}, which this server does not run; add it back to [[sources]] to redrive it"
    )]
    UnknownSource {
        /// The dead letter.
        id: u64,
        /// The source it names.
        name: String,
    },
    /// The target is the queue the watch source reads: the copy would be
    /// taken in again as a dead letter, never handled.
    #[error(
        "source {name:?} watches queue {queue}, and this dead letter names no other queue to go back to: a redrive there would only be taken in again; set redrive_to = \"QUEUE\" on the source to name the queue its messages go back to"
    )]
    OwnQueue {
        /// The watch source.
        name: String,
        /// Its queue (quoted, cut).
        queue: String,
    },
    /// The target comes from the message and is not among the queues the
    /// watch source may redrive to.
    #[error(
        "this dead letter names queue {queue} to go back to, which source {name:?} may not redrive to (allowed: its redrive_to, the queues of the config's own sources, and its redrive_allow); add it to redrive_allow = [...] on the source if it is right"
    )]
    NotAllowed {
        /// The watch source.
        name: String,
        /// The target (quoted, cut).
        queue: String,
    },
    /// The target is not a name the broker takes.
    #[error(
        "cannot redrive to queue {queue}: {why}; set redrive_to = \"QUEUE\" on source {name:?}"
    )]
    BadQueue {
        /// The source.
        name: String,
        /// The target (quoted, cut).
        queue: String,
        /// What is wrong with it.
        why: String,
    },
    /// The broker did not take it.
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

impl SourceSet {
    /// Adds a running source.
    pub fn insert(&mut self, spec: SourceSpec, broker: Arc<dyn Broker>) {
        self.sources.insert(spec.name.clone(), (spec, broker));
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }

    /// The source of that name.
    pub fn get(&self, name: &str) -> Option<&(SourceSpec, Arc<dyn Broker>)> {
        self.sources.get(name)
    }

    /// Republishes a broker dead letter with `payload` as its body (the
    /// original, or an operator's correction) under a fresh redrive id and
    /// waits for the broker's confirmation; returns the message id it was
    /// sent with. See [`SourceSet::redrive_as`].
    pub async fn redrive(&self, dl: &DeadLetter, payload: Vec<u8>) -> Result<String, RedriveError> {
        self.redrive_as(dl, payload, &new_redrive_id()).await
    }

    /// Republishes a broker dead letter as part of the redrive request
    /// `redrive_id` (the copy carries it in [`REDRIVE_ID_HEADER`]), to
    /// [`SourceSet::target`], and waits for the broker's confirmation;
    /// returns the message id it was sent with.
    pub async fn redrive_as(
        &self,
        dl: &DeadLetter,
        payload: Vec<u8>,
        redrive_id: &str,
    ) -> Result<String, RedriveError> {
        let (spec, broker, src) = self.source_of(dl)?;
        let queue = target(spec, src)?;
        let span = tracing::debug_span!(
            "lazaret.redrive",
            "dead_letter.id" = dl.id.0,
            "job.type" = dl.job_type.as_deref(),
            "job.tenant" = dl.tenant.as_deref(),
            "job.lane" = dl.lane.as_deref(),
            source = %src.name,
            "message.id" = %src.message_id,
            "redrive.id" = redrive_id,
        );
        // A watch source's dead letter keeps the trace in its headers only.
        let traceparent = dl.traceparent.clone().or_else(|| {
            let header = src
                .headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(crate::trace::TRACEPARENT))
                .and_then(|(_, v)| header_text(v));
            crate::trace::from_header(header.as_deref(), &src.name)
        });
        crate::trace::follow(&span, traceparent.as_ref());
        let mut msg = republish_to(queue, src, payload, redrive_id);
        set_traceparent(
            &mut msg.headers,
            crate::trace::outgoing(&span, traceparent.as_ref()),
        );
        let id = msg.message_id.clone();
        broker.publish(msg).instrument(span).await?;
        crate::failpoint::fail_point!("guard::redrive_after_publish");
        Ok(id)
    }

    /// Where a redrive of `dl` would go, or why it may not: the watched
    /// queue itself, a queue outside the watch source's allowed targets, a
    /// name the broker does not take.
    pub fn target(&self, dl: &DeadLetter) -> Result<String, RedriveError> {
        let (spec, _, src) = self.source_of(dl)?;
        target(spec, src)
    }

    fn source_of<'a>(
        &'a self,
        dl: &'a DeadLetter,
    ) -> Result<(&'a SourceSpec, &'a Arc<dyn Broker>, &'a SourceRef), RedriveError> {
        let src = dl
            .source
            .as_ref()
            .ok_or(RedriveError::NotASource(dl.id.0))?;
        let (spec, broker) =
            self.sources
                .get(&src.name)
                .ok_or_else(|| RedriveError::UnknownSource {
                    id: dl.id.0,
                    name: src.name.clone(),
                })?;
        Ok((spec, broker, src))
    }
}

/// Where a dead letter of `spec` goes back to: `redrive_to`, else where it
/// came from; for a watch source, only a queue it may redrive to.
pub fn target(spec: &SourceSpec, src: &SourceRef) -> Result<String, RedriveError> {
    let queue = spec.redrive_to.clone().unwrap_or_else(|| src.queue.clone());
    if let Err(why) = check_queue_name(spec.broker, &queue) {
        return Err(RedriveError::BadQueue {
            name: spec.name.clone(),
            queue: quoted(&queue),
            why,
        });
    }
    if spec.mode == Mode::Watch {
        if queue == spec.queue {
            return Err(RedriveError::OwnQueue {
                name: spec.name.clone(),
                queue: quoted(&queue),
            });
        }
        if spec.redrive_to.as_deref() != Some(queue.as_str())
            && !spec.redrive_allow.contains(&queue)
        {
            return Err(RedriveError::NotAllowed {
                name: spec.name.clone(),
                queue: quoted(&queue),
            });
        }
    }
    Ok(queue)
}

/// The message a redrive sends, to where [`target`] says (unchecked here).
pub fn republish(spec: &SourceSpec, src: &SourceRef, payload: Vec<u8>) -> Republish {
    let queue = spec.redrive_to.clone().unwrap_or_else(|| src.queue.clone());
    republish_to(queue, src, payload, &new_redrive_id())
}

/// The message a redrive sends to `queue`: `x-lazaret-attempt: 0` and the
/// request's redrive id.
fn republish_to(queue: String, src: &SourceRef, payload: Vec<u8>, redrive_id: &str) -> Republish {
    let mut headers = republish_headers(&src.headers, &src.message_id);
    headers.insert(
        REDRIVE_ID_HEADER.into(),
        serde_json::Value::String(redrive_id.into()),
    );
    Republish {
        queue,
        body: payload,
        content_type: src.content_type.clone(),
        headers,
        message_id: src.message_id.clone(),
        // Unique per redrive request and message: a broker that drops a
        // repeated id (JetStream) never drops a second redrive.
        dedup_id: format!("{}:redrive:{redrive_id}", src.message_id),
        position: src.position.clone(),
    }
}
