//! Logging for a library loaded into someone else's program: `tracing` to
//! stderr, filtered by `STAG_LOG` (default: errors only; a peer's
//! Terminate or a dead connection is the application's to report, through
//! its completions), installed once and only if the program has no
//! subscriber of its own.

use std::sync::Once;

pub(crate) fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("STAG_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_target(false)
            .try_init();
    });
}
