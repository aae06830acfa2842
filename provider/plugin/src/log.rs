//! Logging for a library loaded into someone else's program: `tracing` to
//! stderr, filtered by `STAG_LOG` (default: errors only; a peer's
//! Terminate or a dead connection is the application's to report, through
//! its completions), installed once and only if the program has no
//! subscriber of its own.
//!
//! Each kind of message (each logging call site) is rate-limited: the
//! first [`BURST`] pass, then one per [`PERIOD`], which is preceded by a
//! line counting those suppressed since the last one. A peer that makes
//! every WR fail cannot flood the program's stderr.

use std::collections::HashMap;
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

use tracing::callsite::Identifier;
use tracing::{Metadata, Subscriber};
use tracing_subscriber::filter::FilterExt;
use tracing_subscriber::layer::{Context, Filter, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Messages of one kind that pass before the limit applies.
const BURST: u32 = 10;
/// After the burst, at most one message of a kind per this.
const PERIOD: Duration = Duration::from_secs(1);

pub(crate) fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter =
            EnvFilter::try_from_env("STAG_LOG").unwrap_or_else(|_| EnvFilter::new("error"));
        let limited = RateLimited(Limiter::new(BURST, PERIOD));
        let fmt = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_target(false)
            .with_filter(filter.and(limited));
        let _ = tracing_subscriber::registry().with(fmt).try_init();
    });
}

/// What the limiter says about one message.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// Print it.
    Pass,
    /// Print it, after a note that this many of its kind were dropped.
    PassAfter(u64),
    /// Drop it.
    Drop,
}

/// One kind's history.
#[derive(Debug)]
struct Kind {
    /// Messages passed in all (the burst counts these).
    passed: u32,
    /// When the last one passed.
    last: Instant,
    /// Dropped since the last one passed.
    suppressed: u64,
}

/// Per-kind rate limiting: `burst` messages, then one per `period`.
#[derive(Debug)]
struct Limiter<K> {
    burst: u32,
    period: Duration,
    kinds: Mutex<HashMap<K, Kind>>,
}

impl<K: std::hash::Hash + Eq> Limiter<K> {
    fn new(burst: u32, period: Duration) -> Self {
        Limiter {
            burst,
            period,
            kinds: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a message of `kind` arriving at `now` is printed.
    fn check(&self, kind: K, now: Instant) -> Verdict {
        let mut kinds = self.kinds.lock().unwrap_or_else(|p| p.into_inner());
        let k = kinds.entry(kind).or_insert(Kind {
            passed: 0,
            last: now,
            suppressed: 0,
        });
        if k.passed < self.burst || now.saturating_duration_since(k.last) >= self.period {
            k.passed = k.passed.saturating_add(1);
            k.last = now;
            let dropped = std::mem::take(&mut k.suppressed);
            return if dropped > 0 {
                Verdict::PassAfter(dropped)
            } else {
                Verdict::Pass
            };
        }
        k.suppressed += 1;
        Verdict::Drop
    }
}

/// The limiter as a per-layer filter: asked once per event that the
/// level filter let through (it comes second in `and`).
struct RateLimited(Limiter<Identifier>);

impl<S: Subscriber> Filter<S> for RateLimited {
    fn enabled(&self, meta: &Metadata<'_>, _cx: &Context<'_, S>) -> bool {
        if !meta.is_event() {
            return true;
        }
        match self.0.check(meta.callsite(), Instant::now()) {
            Verdict::Pass => true,
            Verdict::PassAfter(n) => {
                eprintln!("stag0: {n} more messages like the next one were suppressed");
                true
            }
            Verdict::Drop => false,
        }
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> tracing::subscriber::Interest {
        // Events are asked about each time; spans are not limited.
        if meta.is_event() {
            tracing::subscriber::Interest::sometimes()
        } else {
            tracing::subscriber::Interest::always()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_one_per_period_with_the_dropped_count() {
        let l = Limiter::new(3, Duration::from_secs(1));
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        for i in 0..3 {
            assert_eq!(l.check("a", ms(i)), Verdict::Pass, "burst message {i}");
        }
        for i in 3..100 {
            assert_eq!(l.check("a", ms(i)), Verdict::Drop, "message {i}");
        }
        // Another kind has its own burst.
        assert_eq!(l.check("b", ms(100)), Verdict::Pass);
        // A period after the last one passed: the next passes, with the
        // 97 dropped counted; then the limit holds again.
        assert_eq!(l.check("a", ms(999)), Verdict::Drop);
        assert_eq!(l.check("a", ms(1002)), Verdict::PassAfter(98));
        assert_eq!(l.check("a", ms(1003)), Verdict::Drop);
        assert_eq!(l.check("a", ms(2001)), Verdict::Drop);
        assert_eq!(l.check("a", ms(2002)), Verdict::PassAfter(2));
        // Quiet for a while: one passes with nothing to report.
        assert_eq!(l.check("a", ms(5000)), Verdict::Pass);
    }

    #[test]
    fn a_steady_flood_prints_about_one_per_period() {
        let l = Limiter::new(10, Duration::from_secs(1));
        let t0 = Instant::now();
        // 10 000 messages over 10 s: the burst, then one a second.
        let printed = (0..10_000u64)
            .filter(|i| l.check((), t0 + Duration::from_millis(*i)) != Verdict::Drop)
            .count();
        assert_eq!(printed, 10 + 9);
    }
}
