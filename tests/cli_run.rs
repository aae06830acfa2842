//! `stag run -- CMD`: the signals a process sends to `stag run` reach CMD,
//! and `stag run` exits with CMD's status.

use std::os::unix::process::CommandExt as _;
use std::process::Command;
use std::time::{Duration, Instant};

/// Whether `pid` has a child process yet.
fn has_child(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .is_ok_and(|c| !c.trim().is_empty())
}

/// Send `sig` to `stag run -- sleep 60` once it runs sleep; the exit
/// status `stag run` reports (None: killed by a signal itself). sleep
/// neither handles nor unblocks signals: it ends by the signal only if
/// the signal is forwarded and not blocked in it.
fn status_after(sig: i32) -> Option<i32> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stag"));
    cmd.args(["run", "--", "sleep", "60"])
        // No plugin is needed to run sleep: an empty LD_PRELOAD.
        .env("STAG_PLUGIN", "");
    // A shell without job control starts a background command with
    // SIGINT and SIGQUIT ignored, and an ignored disposition survives
    // exec: sleep would then ignore the forwarded SIGINT (`bash .ci/run &`
    // failed here). The test is of the forwarding, so the signals start
    // at their defaults whatever this process inherited.
    // SAFETY: between fork and exec the closure calls only signal(2),
    // which is async-signal-safe, and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
                libc::signal(sig, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    let mut run = cmd.spawn().expect("spawn stag run");
    // Not a timing check: bounds for a hang, which is the failure.
    let start = Instant::now();
    while !has_child(run.id()) {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "stag run started no child"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: kill(2) to our own child process.
    assert_eq!(unsafe { libc::kill(run.id() as libc::pid_t, sig) }, 0);
    let start = Instant::now();
    loop {
        if let Some(status) = run.try_wait().expect("wait") {
            return status.code();
        }
        if start.elapsed() > Duration::from_secs(20) {
            let _ = run.kill();
            let _ = run.wait();
            panic!("signal {sig}: the child did not end (not forwarded, or blocked in it?)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn run_forwards_term_int_hup_to_the_child() {
    // 128 + the signal that ended the child.
    assert_eq!(
        status_after(libc::SIGTERM),
        Some(128 + libc::SIGTERM),
        "SIGTERM"
    );
    assert_eq!(
        status_after(libc::SIGINT),
        Some(128 + libc::SIGINT),
        "SIGINT"
    );
    assert_eq!(
        status_after(libc::SIGHUP),
        Some(128 + libc::SIGHUP),
        "SIGHUP"
    );
}
