//! Redrive back to the broker: a dead letter of a source is republished to
//! `redrive_to` (or where it came from) with its headers minus the
//! broker's own, `x-lazaret-message-id` set to its message id and
//! `x-lazaret-attempt: 0`. The caller removes the dead letter only after
//! the broker confirmed the publish.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use lazaret_store::DeadLetter;

use crate::broker::{Broker, BrokerError};
use crate::message::{Republish, republish_headers};
use crate::spec::SourceSpec;

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
    /// original, or an operator's correction) and waits for the broker's
    /// confirmation; returns the message id it was sent with.
    pub async fn redrive(&self, dl: &DeadLetter, payload: Vec<u8>) -> Result<String, RedriveError> {
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
        let msg = republish(spec, src, payload);
        let id = msg.message_id.clone();
        broker.publish(msg).await?;
        Ok(id)
    }
}

/// The message a redrive sends.
pub fn republish(spec: &SourceSpec, src: &lazaret_store::SourceRef, payload: Vec<u8>) -> Republish {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    Republish {
        queue: spec.redrive_to.clone().unwrap_or_else(|| src.queue.clone()),
        body: payload,
        content_type: src.content_type.clone(),
        headers: republish_headers(&src.headers, &src.message_id),
        message_id: src.message_id.clone(),
        dedup_id: format!("{}:redrive:{nanos}", src.message_id),
        position: src.position.clone(),
    }
}
