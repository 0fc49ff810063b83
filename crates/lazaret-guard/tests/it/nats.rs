//! nats tests (being written).
