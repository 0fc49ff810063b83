//! The rabbitmq adapter (being written).

use crate::broker::{Broker, BrokerError};
use crate::spec::SourceSpec;

/// Opens the adapter.
pub async fn connect(spec: &SourceSpec) -> Result<Box<dyn Broker>, BrokerError> {
    Err(BrokerError::Config(format!("source {}: the rabbitmq adapter is not written yet", spec.name)))
}
