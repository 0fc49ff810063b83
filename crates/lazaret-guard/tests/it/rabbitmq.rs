//! rabbitmq tests (being written).
