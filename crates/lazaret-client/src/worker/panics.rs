//! Catching a handler's panic as a [`Failure`] of kind `panic`, with its
//! message, location and a backtrace, so one bad job never takes the worker
//! down.
//!
//! `catch_unwind` gives the panic's payload but not its backtrace: that only
//! exists while the panic hook runs, on the panicking thread. So a hook
//! (installed once, chained to the previous one) captures a backtrace when
//! the thread is polling a handler — a thread-local flag set around each
//! poll says so — and leaves every other panic to the previous hook. The
//! unwind is caught within that same poll, on that same thread, where the
//! capture is then taken back.

use std::backtrace::Backtrace;
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Once;
use std::task::{Context, Poll};

use futures_util::FutureExt;

use crate::failure::Failure;

thread_local! {
    static IN_HANDLER: Cell<bool> = const { Cell::new(false) };
    static CAPTURED: RefCell<Option<Captured>> = const { RefCell::new(None) };
}

struct Captured {
    location: Option<String>,
    backtrace: String,
}

fn install_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if IN_HANDLER.with(Cell::get) {
                let captured = Captured {
                    location: info.location().map(|l| l.to_string()),
                    backtrace: Backtrace::force_capture().to_string(),
                };
                CAPTURED.with(|c| *c.borrow_mut() = Some(captured));
            } else {
                previous(info);
            }
        }));
    });
}

/// Marks the thread as "in a handler" for the duration of each poll.
struct Marked<F>(Pin<Box<F>>);

struct Reset(bool);

impl Drop for Reset {
    fn drop(&mut self) {
        IN_HANDLER.with(|f| f.set(self.0));
    }
}

impl<F: Future> Future for Marked<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let _reset = Reset(IN_HANDLER.with(|f| f.replace(true)));
        self.0.as_mut().poll(cx)
    }
}

/// The panic payload's text, when it is text.
fn message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with a non-text payload".to_owned()
    }
}

/// Runs a handler's future; a panic anywhere in it becomes
/// [`Failure::panic`] with its message, location and backtrace.
pub(crate) async fn run_caught<F>(fut: F) -> Result<(), Failure>
where
    F: Future<Output = Result<(), Failure>>,
{
    install_hook();
    match AssertUnwindSafe(Marked(Box::pin(fut))).catch_unwind().await {
        Ok(result) => result,
        Err(payload) => {
            let text = message(payload.as_ref());
            let captured = CAPTURED.with(|c| c.borrow_mut().take());
            let (location, backtrace) = match captured {
                Some(c) => (c.location, c.backtrace),
                None => (None, "no backtrace was captured".to_owned()),
            };
            let message = match location {
                Some(at) => format!("handler panicked at {at}: {text}"),
                None => format!("handler panicked: {text}"),
            };
            Err(Failure::panic(message, backtrace))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_becomes_a_failure_with_message_location_and_backtrace() {
        let r = run_caught(async {
            tokio::task::yield_now().await;
            panic!("boom {}", 42);
        })
        .await;
        let f = r.unwrap_err();
        assert_eq!(f.kind.as_str(), "panic");
        assert!(f.message.contains("boom 42"), "{}", f.message);
        assert!(f.message.contains("panics.rs"), "{}", f.message);
        assert!(!f.traceback.unwrap().is_empty());
        // The flag does not leak out of the handler.
        assert!(!IN_HANDLER.with(Cell::get));
    }

    #[tokio::test]
    async fn results_pass_through() {
        assert_eq!(run_caught(async { Ok(()) }).await, Ok(()));
        let f = Failure::permanent("x", "y");
        assert_eq!(run_caught(async { Err(f.clone()) }).await, Err(f));
    }
}
