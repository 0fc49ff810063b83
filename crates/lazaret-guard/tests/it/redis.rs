//! redis tests (being written).
