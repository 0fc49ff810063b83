//! Fail points: named places in the guard where the kill -9 battery
//! (issue 29, `crates/lazaret/tests/it/kill9.rs`) makes the process die on
//! purpose, at the moments a crash is most dangerous: after a dead
//! letter's commit before the broker ack, after a redrive's republish
//! before the store forgets the dead letter, after a held retry's handler
//! answered before the store records its outcome, after a Kafka offset
//! commit before the next poll.
//!
//! Compiled only with the `failpoints` cargo feature: without it
//! [`fail_point!`] expands to nothing, so the shipped binary (`cargo build
//! --release -p lazaret`, default features) holds no fail point. With it,
//! `LAZARET_FAILPOINTS="NAME=N;NAME2=M"` arms them: the `N`th time the
//! process passes `NAME` (counted from 1; `NAME` alone means 1) it sends
//! itself `SIGKILL`, which is `kill -9` at exactly that point: no
//! destructor, no flush. Unarmed, a point costs a look at an empty
//! list.

/// Marks a fail point (see the module doc); nothing without the
/// `failpoints` feature. `fail_point!("name" if cond)` passes it only when
/// `cond` holds (not evaluated without the feature: keep it pure).
#[cfg(feature = "failpoints")]
macro_rules! fail_point {
    ($name:literal) => {
        $crate::failpoint::hit($name)
    };
    ($name:literal if $cond:expr) => {
        if $cond {
            $crate::failpoint::hit($name)
        }
    };
}

/// Marks a fail point (see the module doc); nothing without the
/// `failpoints` feature.
#[cfg(not(feature = "failpoints"))]
macro_rules! fail_point {
    ($name:literal) => {};
    ($name:literal if $cond:expr) => {};
}

pub(crate) use fail_point;

/// The environment variable that arms fail points.
pub const FAILPOINTS_VAR: &str = "LAZARET_FAILPOINTS";

/// The fail points the guard has, by name.
pub const POINTS: [&str; 4] = [
    "guard::after_dead_letter_commit",
    "guard::redrive_after_publish",
    "guard::held_retry_before_outcome",
    "guard::kafka_after_commit",
];

/// Whether this build has fail points (the `failpoints` feature).
pub const COMPILED: bool = cfg!(feature = "failpoints");

/// Reads `LAZARET_FAILPOINTS` once and says on stderr what it armed, so a
/// battery can tell a build with fail points from one without; a build
/// without them says it ignores the variable. Call it at start-up.
pub fn announce() {
    let Some(spec) = std::env::var_os(FAILPOINTS_VAR) else {
        return;
    };
    if COMPILED {
        #[cfg(feature = "failpoints")]
        {
            let armed = armed::get();
            let list: Vec<String> = armed.iter().map(|(n, at, _)| format!("{n}={at}")).collect();
            eprintln!("lazaret failpoints armed: {}", list.join(";"));
        }
    } else {
        eprintln!(
            "{FAILPOINTS_VAR}={spec:?} is ignored: this build has no fail points (build with the `failpoints` feature)"
        );
    }
}

#[cfg(feature = "failpoints")]
pub(crate) use armed::hit;

#[cfg(feature = "failpoints")]
mod armed {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::{FAILPOINTS_VAR, POINTS};

    /// Each armed point: its name, the hit that kills, the hits so far.
    pub(super) type Armed = Vec<(&'static str, u64, AtomicU64)>;

    /// The points `LAZARET_FAILPOINTS` arms; a name the guard does not
    /// have stops the process at start-up (a typo would arm nothing).
    pub(super) fn get() -> &'static Armed {
        static ARMED: OnceLock<Armed> = OnceLock::new();
        ARMED.get_or_init(|| {
            let spec = std::env::var(FAILPOINTS_VAR).unwrap_or_default();
            let mut armed = Armed::new();
            for item in spec.split(';').map(str::trim).filter(|s| !s.is_empty()) {
                let (name, at) = item.split_once('=').unwrap_or((item, "1"));
                let Some(&name) = POINTS.iter().find(|p| **p == name.trim()) else {
                    eprintln!(
                        "{FAILPOINTS_VAR}: unknown fail point {name:?}; the points are {POINTS:?}"
                    );
                    std::process::exit(2);
                };
                let Ok(at) = at.trim().parse::<u64>() else {
                    eprintln!(
                        "{FAILPOINTS_VAR}: {item:?} should be NAME=N, N the hit that kills (from 1)"
                    );
                    std::process::exit(2);
                };
                armed.push((name, at.max(1), AtomicU64::new(0)));
            }
            armed
        })
    }

    /// The process passes fail point `name`: dies by `SIGKILL` on the
    /// armed hit.
    pub(crate) fn hit(name: &'static str) {
        for (n, at, hits) in get() {
            if *n == name && hits.fetch_add(1, Ordering::Relaxed) + 1 == *at {
                eprintln!(
                    "lazaret fail point {name} reached (hit {at}): killing the process (kill -9)"
                );
                // `kill -9` itself (the workspace forbids the unsafe call
                // to libc's `kill`): this task blocks until the signal
                // lands, so it never goes past the point; other tasks may
                // run on for the milliseconds `kill` takes to start, as if
                // the signal came that much later for them.
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &std::process::id().to_string()])
                    .status();
                // `kill` missing or refused: die here all the same.
                std::process::abort();
            }
        }
    }
}
