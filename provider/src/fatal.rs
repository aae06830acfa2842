//! Device-fatal: the RNIC can no longer make progress, because its engine
//! thread died of a bug (a panic). The QPs the engine drove would stall
//! in silence; instead every listener hears of it, once, as the kernel's
//! `IBV_EVENT_DEVICE_FATAL` tells a program its device is gone. The state
//! is sticky: a listener added after the fact hears of it at once.
//!
//! `STAG_FAULT_INJECT=engine-panic` makes the engine thread panic as it
//! starts, so that tests can check this path from C
//! (`provider/plugin/tests/c/faults.c`, case `async_device_fatal`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tracing::error;

/// A device-fatal listener.
pub type FatalHook = dyn Fn() + Send + Sync;

static FATAL: AtomicBool = AtomicBool::new(false);
static HOOKS: Mutex<Vec<Weak<FatalHook>>> = Mutex::new(Vec::new());

/// Call `hook` once the device is fatally broken (at once if it is).
/// Held weakly: dropping the `Arc` unregisters it.
pub fn on_device_fatal(hook: &Arc<FatalHook>) {
    let mut hooks = HOOKS.lock().unwrap_or_else(|p| p.into_inner());
    hooks.retain(|h| h.strong_count() > 0);
    if FATAL.load(Ordering::Acquire) {
        drop(hooks);
        hook();
        return;
    }
    hooks.push(Arc::downgrade(hook));
}

/// Whether the device is fatally broken.
pub fn is_fatal() -> bool {
    FATAL.load(Ordering::Acquire)
}

fn raise() {
    let hooks = {
        let hooks = HOOKS.lock().unwrap_or_else(|p| p.into_inner());
        if FATAL.swap(true, Ordering::AcqRel) {
            return;
        }
        hooks.iter().filter_map(Weak::upgrade).collect::<Vec<_>>()
    };
    for hook in hooks {
        hook();
    }
}

/// Run an RNIC thread's body; if it panics, the device is fatally broken.
pub(crate) fn run_guarded(name: &str, body: impl FnOnce()) {
    let injected = std::env::var("STAG_FAULT_INJECT").is_ok_and(|v| v == "engine-panic");
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        if injected {
            panic!("STAG_FAULT_INJECT=engine-panic");
        }
        body()
    }));
    if run.is_err() {
        error!(
            thread = name,
            "stag0's engine thread died: the device is broken"
        );
        raise();
    }
}
