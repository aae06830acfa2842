//! `stag run`'s child gets the signals meant for it: SIGTERM, SIGINT and
//! SIGHUP sent to `stag run` (by `timeout`, `kill`, a service manager) are
//! passed on to the child, so that the program ends as it would have run
//! alone, and `stag run` then reports its status.
//!
//! The three signals are blocked in `stag run` before the child is spawned
//! (and unblocked in the child before exec), and one thread
//! takes them with `sigwaitinfo`. Only signals a process sent are passed
//! on: the terminal's (^C, a hang-up) already reached the child, which is
//! in the same process group.

use std::ffi::c_int;
use std::io;
use std::process::{Child, Command, ExitStatus};
use std::sync::{Arc, Mutex};

/// The signals passed on to the child.
const FORWARDED: [c_int; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// The child's PID while it has not been reaped (None after: the PID may
/// be reused, and nothing is sent to it any more).
type Live = Arc<Mutex<Option<libc::pid_t>>>;

fn forwarded_set() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data, initialised by sigemptyset.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t; the signal numbers are valid.
    unsafe {
        libc::sigemptyset(&mut set);
        for s in FORWARDED {
            libc::sigaddset(&mut set, s);
        }
    }
    set
}

/// Spawn `cmd` and wait for it, passing [`FORWARDED`] signals on to it.
pub fn run_forwarding(cmd: &mut Command) -> io::Result<ExitStatus> {
    let set = forwarded_set();
    // SAFETY: a valid set; blocks the signals in this (the main) thread
    // and in the thread spawned below, which inherits the mask. They stay
    // blocked: one that arrives after the child was reaped stays pending
    // and goes with this process, which is about to exit with the child's
    // status.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    spawn_and_wait(cmd, &set)
}

fn spawn_and_wait(cmd: &mut Command, set: &libc::sigset_t) -> io::Result<ExitStatus> {
    use std::os::unix::process::CommandExt;
    let unblock = *set;
    // SAFETY: the closure runs in the forked child before exec and calls
    // only pthread_sigmask, which is async-signal-safe. The child must not
    // inherit our mask (std does not reset it): a program that does not
    // unblock signals itself would never see SIGTERM.
    unsafe {
        cmd.pre_exec(move || {
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &unblock, std::ptr::null_mut());
            Ok(())
        });
    }
    let mut child: Child = cmd.spawn()?;
    let live: Live = Arc::new(Mutex::new(Some(child.id() as libc::pid_t)));
    {
        let (live, set) = (live.clone(), *set);
        // No thread, no forwarding: the child still runs and is waited for.
        let _ = std::thread::Builder::new()
            .name("stag-run-signals".into())
            .spawn(move || forward(&set, &live));
    }
    // Wait without reaping, then mark the PID dead under the lock, then
    // reap: the forwarder never signals a PID that could be reused.
    let pid = child.id() as libc::pid_t;
    loop {
        // SAFETY: siginfo_t is plain data, filled by waitid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own child with a valid siginfo_t.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if rc == 0 {
            break;
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            break;
        }
    }
    *live.lock().unwrap_or_else(|p| p.into_inner()) = None;
    child.wait()
}

/// The forwarding thread: each signal of `set` a process sent goes to the
/// child while it lives.
fn forward(set: &libc::sigset_t, live: &Live) {
    loop {
        // SAFETY: siginfo_t is plain data, filled by sigwaitinfo.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: a valid set, blocked in every thread of this process.
        let sig = unsafe { libc::sigwaitinfo(set, &mut info) };
        if sig < 0 {
            if io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return;
        }
        // SI_USER, SI_QUEUE, SI_TKILL (<= 0): a process sent it. The
        // kernel's (a terminal's ^C or hang-up) went to the child's
        // process group already.
        if info.si_code > 0 {
            continue;
        }
        let live = live.lock().unwrap_or_else(|p| p.into_inner());
        match *live {
            // SAFETY: kill(2) to our unreaped child (its PID cannot have
            // been reused while `live` holds it).
            Some(pid) => unsafe {
                libc::kill(pid, sig);
            },
            None => return,
        }
    }
}
