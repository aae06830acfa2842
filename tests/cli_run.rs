//! `stag run -- CMD`: the signals a process sends to `stag run` reach CMD,
//! and `stag run` exits with CMD's status.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Send `sig` to `stag run -- sh …` once the shell has its trap set; the
/// exit status `stag run` reports (None: killed by a signal itself).
fn status_after(sig: i32) -> Option<i32> {
    let script = "trap 'exit 71' TERM; trap 'exit 72' INT; trap 'exit 73' HUP; \
                  echo ready; while :; do sleep 0.05; done";
    let mut run = Command::new(env!("CARGO_BIN_EXE_stag"))
        .args(["run", "--", "sh", "-c", script])
        // No plugin is needed to run sh: an empty LD_PRELOAD.
        .env("STAG_PLUGIN", "")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn stag run");
    let mut line = String::new();
    BufReader::new(run.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read the child's first line");
    assert_eq!(line.trim(), "ready");
    // SAFETY: kill(2) to our own child process.
    assert_eq!(unsafe { libc::kill(run.id() as libc::pid_t, sig) }, 0);
    // Not a timing check: a child that never got the signal would keep
    // `stag run` waiting forever.
    let start = Instant::now();
    loop {
        if let Some(status) = run.try_wait().expect("wait") {
            return status.code();
        }
        if start.elapsed() > Duration::from_secs(20) {
            let _ = run.kill();
            let _ = run.wait();
            panic!("signal {sig}: the child did not end (not forwarded?)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn run_forwards_term_int_hup_to_the_child() {
    assert_eq!(status_after(libc::SIGTERM), Some(71), "SIGTERM");
    assert_eq!(status_after(libc::SIGINT), Some(72), "SIGINT");
    assert_eq!(status_after(libc::SIGHUP), Some(73), "SIGHUP");
}
