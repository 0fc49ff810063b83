//! lazaret's durable store: the `Store` trait and its SQLite implementation.
