//! The adapter registry: which module opens a source's broker, each behind
//! its cargo feature. Adding a broker is a `BrokerKind` (with its word and
//! URL schemes, in `spec.rs`), its module, and an arm here.

use crate::broker::{Broker, BrokerError};
use crate::spec::SourceSpec;

/// Opens the adapter for a source's broker.
pub async fn connect(spec: &SourceSpec) -> Result<Box<dyn Broker>, BrokerError> {
    match spec.broker {
        crate::spec::BrokerKind::RabbitMq => {
            #[cfg(feature = "rabbitmq")]
            return crate::rabbitmq::connect(spec).await;
            #[cfg(not(feature = "rabbitmq"))]
            return Err(BrokerError::NotBuilt("rabbitmq"));
        }
        crate::spec::BrokerKind::Nats => {
            #[cfg(feature = "nats")]
            return crate::nats::connect(spec).await;
            #[cfg(not(feature = "nats"))]
            return Err(BrokerError::NotBuilt("nats"));
        }
        crate::spec::BrokerKind::Redis => {
            #[cfg(feature = "redis")]
            return crate::redis::connect(spec).await;
            #[cfg(not(feature = "redis"))]
            return Err(BrokerError::NotBuilt("redis"));
        }
        crate::spec::BrokerKind::Kafka => {
            #[cfg(feature = "kafka")]
            return crate::kafka::connect(spec).await;
            #[cfg(not(feature = "kafka"))]
            return Err(BrokerError::NotBuilt("kafka"));
        }
        crate::spec::BrokerKind::Sqs => {
            #[cfg(feature = "sqs")]
            return crate::sqs::connect(spec).await;
            #[cfg(not(feature = "sqs"))]
            return Err(BrokerError::NotBuilt("sqs"));
        }
    }
}
