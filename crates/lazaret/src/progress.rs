//! Progress on a terminal for the CLI's long operations (`indicatif`): a
//! spinner while a redrive, a purge or a migration runs on the server, a
//! bar over a bench's scenarios, and a bar while a redrive's report is
//! followed (`--follow`). Drawn on stderr, and only when stderr is a
//! terminal and the command is not under `--json`: piped, nothing at all
//! is written (the draw target is hidden, so no `\r` or escape byte
//! reaches a log or a script). Dropping one clears what it drew.

use std::borrow::Cow;
use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often a spinner turns.
const TICK: Duration = Duration::from_millis(120);

/// A spinner or a bar on stderr, or nothing.
#[derive(Debug)]
pub struct Progress(ProgressBar);

/// Whether progress is drawn: stderr is a terminal and `quiet` (`--json`) is off.
pub fn drawn(quiet: bool) -> bool {
    !quiet && std::io::stderr().is_terminal()
}

fn target(quiet: bool) -> ProgressDrawTarget {
    if drawn(quiet) {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    }
}

fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar())
}

impl Progress {
    /// A spinner saying `message`, with the time it has run.
    pub fn spinner(quiet: bool, message: impl Into<Cow<'static, str>>) -> Self {
        let bar = ProgressBar::with_draw_target(None, target(quiet));
        bar.set_style(style("{spinner} {msg} ({elapsed})"));
        bar.set_message(message);
        if drawn(quiet) {
            bar.enable_steady_tick(TICK);
        }
        Progress(bar)
    }

    /// A bar of `len` steps, saying `message`.
    pub fn bar(quiet: bool, len: u64, message: impl Into<Cow<'static, str>>) -> Self {
        let bar = ProgressBar::with_draw_target(Some(len), target(quiet));
        bar.set_style(style("[{bar:30}] {pos}/{len} {msg} ({elapsed})").progress_chars("=> "));
        bar.set_message(message);
        Progress(bar)
    }

    /// Moves the bar to `pos` of `len`, saying `message`.
    pub fn set(&self, pos: u64, len: u64, message: impl Into<Cow<'static, str>>) {
        self.0.set_length(len);
        self.0.set_position(pos.min(len));
        self.0.set_message(message);
    }
}

impl Progress {
    /// Runs `f` (which prints) with the bar cleared, then draws it again.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.0.suspend(f)
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quiet_progress_is_never_drawn() {
        assert!(!drawn(true));
        let p = Progress::bar(true, 3, "x");
        p.set(2, 3, "y");
        assert!(p.0.is_hidden());
    }
}
