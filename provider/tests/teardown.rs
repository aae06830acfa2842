//! Tearing everything down gives back every thread and file descriptor.
//! (A test binary of its own: other tests running beside it would change
//! the counts.)

mod common;

use std::time::{Duration, Instant};

use common::*;
use provider::wr::SendOp;

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn teardown_returns_every_thread_and_fd() {
    // Warm up whatever the runtime allocates once.
    drop(pair());
    let (fd0, th0) = (fds(), threads());
    for _ in 0..5 {
        let (a, b) = pair();
        b.recv(1, 0, 8);
        a.post(
            1,
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            vec![a.mr.sge(0, 8)],
        );
        a.wait(1);
        b.wait(1);
    }
    // Engine threads are joined on drop; give the kernel a moment to reap.
    let deadline = Instant::now() + Duration::from_secs(5);
    while (fds(), threads()) != (fd0, th0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        (fds(), threads()),
        (fd0, th0),
        "fds and threads before/after"
    );
}
