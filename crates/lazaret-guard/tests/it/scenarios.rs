//! The shared scenarios (being written).
