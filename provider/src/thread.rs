//! Threads that stag starts inside other people's programs take none of
//! their signals.
//!
//! A signal sent to a process (`kill(getpid(), SIGUSR2)`, `SIGCHLD`,
//! `SIGALRM`) goes to any one of its threads that does not block it. A
//! program that handles such a signal through `signalfd` or `sigwait`
//! blocks it in the threads it knows of; a thread the plugin started
//! before that (or from a thread that had it unblocked) would still take
//! it, and the default action kills the process. tgtd's backing-store
//! workers `kill(getpid(), SIGUSR2)` after every I/O and tgtd died that
//! way under `stag run` (exit 140). A new thread inherits the signal mask
//! of the thread that spawns it, so [`SpawnMasked::spawn_masked`] blocks
//! every signal around the spawn and restores the caller's mask after:
//! the thread runs with everything blocked from its first instruction.
//! (Faults such as `SIGSEGV` in the thread itself are still delivered:
//! the kernel does not let a mask hold back a synchronous fault.)

use std::io;
use std::thread::{Builder, JoinHandle};

use nix::sys::signal::{pthread_sigmask, SigSet, SigmaskHow};

/// [`Builder::spawn`] for a thread that blocks every signal.
pub trait SpawnMasked {
    /// Spawns `f` on a thread whose signal mask blocks every signal.
    fn spawn_masked<F, T>(self, f: F) -> io::Result<JoinHandle<T>>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static;
}

impl SpawnMasked for Builder {
    fn spawn_masked<F, T>(self, f: F) -> io::Result<JoinHandle<T>>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let mut caller = SigSet::empty();
        pthread_sigmask(
            SigmaskHow::SIG_SETMASK,
            Some(&SigSet::all()),
            Some(&mut caller),
        )
        .map_err(io::Error::from)?;
        let spawned = self.spawn(f);
        // Restoring a mask read a moment ago cannot fail; if it did, the
        // caller would keep more signals blocked, never fewer.
        let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&caller), None);
        spawned
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::signal::Signal;

    fn current_mask() -> SigSet {
        let mut mask = SigSet::empty();
        pthread_sigmask(SigmaskHow::SIG_BLOCK, None, Some(&mut mask)).unwrap();
        mask
    }

    #[test]
    fn the_thread_blocks_every_signal_and_the_caller_keeps_its_mask() {
        // Run on a thread of our own so the test harness's mask is ours
        // to change.
        std::thread::spawn(|| {
            let mut usr1 = SigSet::empty();
            usr1.add(Signal::SIGUSR1);
            pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&usr1), None).unwrap();

            let inner = Builder::new()
                .spawn_masked(current_mask)
                .unwrap()
                .join()
                .unwrap();
            for sig in [
                Signal::SIGUSR1,
                Signal::SIGUSR2,
                Signal::SIGCHLD,
                Signal::SIGALRM,
                Signal::SIGTERM,
            ] {
                assert!(
                    inner.contains(sig),
                    "{sig:?} not blocked in the spawned thread"
                );
            }

            let after = current_mask();
            assert!(after.contains(Signal::SIGUSR1));
            assert!(!after.contains(Signal::SIGUSR2), "the caller's mask grew");
            assert!(!after.contains(Signal::SIGTERM), "the caller's mask grew");
        })
        .join()
        .unwrap();
    }
}
