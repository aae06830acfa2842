//! Crash durability of RDMA Commit: a responder child process (this test
//! binary re-executed) owns a file-backed durable region; the initiator
//! (this process) Writes unique patterns and Commits each range, and the
//! responder is `kill -9`ed right after a Commit completes (odd trials) or
//! at a random moment while Writes and Commits are in flight (even trials).
//! The file, reopened, must hold every range whose Commit succeeded.
//!
//! `STAG_CRASH_TRIALS` sets the number of trials (default 4);
//! `scripts/dev/crash-durability.sh N` runs many.
//!
//! A `kill -9` loses the process, not the page cache, so this checks that a
//! Commit's success is only reported once its Write is placed in the file
//! mapping and the msync ran; it cannot simulate a power cut.

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use provider::device::Listener;
use provider::region::Region;
use provider::setup::MpaParams;
use provider::wr::{Remote, SendOp, WcStatus};

const ROLE: &str = "STAG_CRASH_ROLE";
const FILE: &str = "STAG_CRASH_FILE";
const FILE_LEN: usize = 1 << 20;
const CHUNK: usize = 4096;
const SLOTS: usize = FILE_LEN / CHUNK;

fn pattern(trial: u64, slot: usize) -> Vec<u8> {
    let mut x = trial.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (slot as u64 + 1);
    (0..CHUNK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn seed() -> u64 {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).unwrap();
    u64::from_le_bytes(b)
}

struct Killed(Option<Child>);

impl Drop for Killed {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn responder(path: &str) {
    let dev = provider::device::Device::open("crash").unwrap();
    let pd = dev.alloc_pd();
    let side = Side::in_pd(&pd, None);
    let durable = common::register(
        &pd,
        Region::file_backed(std::path::Path::new(path), FILE_LEN).unwrap(),
        ALL,
    );
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    println!(
        "STAG_PORT {port} {} {}",
        durable.stag(),
        durable.region().addr(0)
    );
    let req = listener.accept().unwrap();
    req.accept(&side.qp, &MpaParams::default()).unwrap();
    // Serve until killed (or, should the parent vanish, for a while).
    std::thread::sleep(Duration::from_secs(120));
}

struct Trial {
    committed: Vec<usize>,
    failed_after_kill: usize,
}

/// One trial: returns the slots whose Commit succeeded.
fn trial(trial_no: u64, rng: &mut u64, path: &PathBuf) -> Trial {
    let _ = std::fs::remove_file(path);
    let exe = std::env::current_exe().unwrap();
    let mut child = Killed(Some(
        Command::new(exe)
            .args(["--exact", "commit_survives_kill_9", "--nocapture"])
            .env(ROLE, "responder")
            .env(FILE, path)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let stdout = child.0.as_mut().unwrap().stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let line = loop {
        let l = lines.next().expect("responder exited early").unwrap();
        if l.starts_with("STAG_PORT ") {
            break l;
        }
    };
    let f: Vec<u64> = line[10..].split(' ').map(|s| s.parse().unwrap()).collect();
    let (port, rkey, base) = (f[0] as u16, f[1] as u32, f[2]);

    let side = Side::new(None);
    side.qp
        .connect(("127.0.0.1", port), &MpaParams::default())
        .unwrap();
    let mut next = || {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        *rng
    };
    let after_commit = trial_no % 2 == 1;
    // Kill after this many completed Commits (after_commit), or from
    // another thread after a random delay while work is in flight.
    let kill_after = 1 + (next() % 24) as usize;
    let kill_delay = Duration::from_micros(next() % 40_000);
    let kill_sent = Arc::new(AtomicBool::new(false));
    let killer = (!after_commit).then(|| {
        let pid = child.0.as_ref().unwrap().id().to_string();
        let kill_sent = kill_sent.clone();
        std::thread::spawn(move || {
            std::thread::sleep(kill_delay);
            // Flag first: no failure can be seen before the signal.
            kill_sent.store(true, Ordering::SeqCst);
            Command::new("kill").args(["-9", &pid]).status().unwrap();
        })
    });
    let mut committed = Vec::new();
    let mut killed = false;
    let mut failed_after_kill = 0;
    // Slots in a random order, two Write+Commit pairs in flight at a time.
    let mut slots: Vec<usize> = (0..SLOTS).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    for pair in slots.chunks(2) {
        for &slot in pair {
            side.mr
                .region()
                .write_at(slot * CHUNK, &pattern(trial_no, slot))
                .unwrap();
            let remote = Remote {
                addr: base + (slot * CHUNK) as u64,
                rkey,
            };
            side.post(
                (slot * 2) as u64,
                SendOp::Write { remote },
                vec![side.mr.sge(slot * CHUNK, CHUNK as u32)],
            );
            side.post(
                (slot * 2 + 1) as u64,
                SendOp::Commit {
                    remote,
                    len: CHUNK as u32,
                },
                vec![],
            );
        }
        let mut failed = false;
        for c in side.wait(pair.len() * 2) {
            let is_commit = c.wr_id % 2 == 1;
            if c.status == WcStatus::Success {
                // A Write completes once handed to TCP, so it may succeed
                // into a dead peer; a Commit needs the peer's answer.
                if is_commit {
                    assert!(!killed, "a Commit succeeded after the kill");
                    committed.push((c.wr_id / 2) as usize);
                }
            } else {
                let was_killed = killed || kill_sent.load(Ordering::SeqCst);
                assert!(was_killed, "{:?} before the kill", c.status);
                if is_commit {
                    failed_after_kill += 1;
                }
                failed = true;
            }
        }
        if failed {
            break;
        }
        if after_commit && committed.len() >= kill_after {
            // Right after a Commit completed: kill -9, and the next pair
            // must fail.
            let c = child.0.as_mut().unwrap();
            c.kill().unwrap();
            c.wait().unwrap();
            child.0 = None;
            killed = true;
        }
    }
    if let Some(k) = killer {
        k.join().unwrap();
    }
    drop(child);
    Trial {
        committed,
        failed_after_kill,
    }
}

#[test]
fn commit_survives_kill_9() {
    if std::env::var(ROLE).is_ok() {
        responder(&std::env::var(FILE).unwrap());
        return;
    }
    let trials: u64 = std::env::var("STAG_CRASH_TRIALS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let mut rng = seed() | 1;
    eprintln!("crash: {trials} trials, seed {rng:#x}");
    let dir = std::env::temp_dir().join(format!("stag-crash-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut total = 0;
    for t in 0..trials {
        let path = dir.join(format!("durable-{t}.bin"));
        let r = trial(t, &mut rng, &path);
        let file = std::fs::read(&path).unwrap();
        assert_eq!(file.len(), FILE_LEN);
        for &slot in &r.committed {
            assert!(
                file[slot * CHUNK..(slot + 1) * CHUNK] == pattern(t, slot)[..],
                "trial {t}: committed slot {slot} is not in the file"
            );
        }
        total += r.committed.len();
        eprintln!(
            "crash: trial {t} ({}): {} committed ranges intact, {} Commits failed after the kill",
            if t % 2 == 1 {
                "after a Commit"
            } else {
                "random"
            },
            r.committed.len(),
            r.failed_after_kill
        );
        std::fs::remove_file(&path).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(total > 0, "no Commit ever completed");
    println!("crash: {trials} trials, {total} committed ranges verified");
}
