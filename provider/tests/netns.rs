//! The provider across two network namespaces joined by a veth pair: a
//! responder in one, an initiator in the other (both are this test binary
//! re-executed under `ip netns exec`), doing Send, Write, Read and FetchAdd
//! over a real, non-loopback link.
//!
//! Needs root and iproute2. Without them the test FAILS, unless
//! `STAG_SKIP_NETNS=1` is set. The namespaces (and with them the veth
//! pair and the 10.77.x.y addresses) are deleted on every exit path.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use provider::device::Listener;
use provider::setup::MpaParams;
use provider::wr::{SendOp, WcOpcode, WcStatus};

const TEST_NAME: &str = "rdma_across_network_namespaces";
const ROLE: &str = "STAG_NETNS_ROLE";
const ADDR: &str = "STAG_NETNS_ADDR";
const PORT: u16 = 18515;
const LEN: usize = 64 * 1024;

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip`: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two namespaces and a veth pair, removed on drop (also on panic).
struct Netns {
    names: [String; 2],
}

impl Netns {
    fn create(tag: u32) -> Result<Netns, String> {
        let a = format!("stag-resp-{tag}");
        let b = format!("stag-init-{tag}");
        let ns = Netns {
            names: [a.clone(), b.clone()],
        };
        ip(&["netns", "add", &a])?;
        ip(&["netns", "add", &b])?;
        let (va, vb) = (
            format!("stva{}", tag % 100_000),
            format!("stvb{}", tag % 100_000),
        );
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        // Deleting the namespaces deletes the pair; until it is moved, the
        // root namespace holds it, so remove it explicitly if moving fails.
        let moved = ip(&["link", "set", &va, "netns", &a])
            .and_then(|_| ip(&["link", "set", &vb, "netns", &b]));
        if let Err(e) = moved {
            let _ = ip(&["link", "del", &va]);
            return Err(e);
        }
        let net = tag % 250 + 1;
        for (n, dev, host) in [(&a, &va, 1), (&b, &vb, 2)] {
            ip(&[
                "-n",
                n,
                "addr",
                "add",
                &format!("10.77.{net}.{host}/24"),
                "dev",
                dev,
            ])?;
            ip(&["-n", n, "link", "set", dev, "up"])?;
            ip(&["-n", n, "link", "set", "lo", "up"])?;
        }
        Ok(ns)
    }

    fn responder_addr(tag: u32) -> String {
        format!("10.77.{}.1:{PORT}", tag % 250 + 1)
    }

    fn spawn(&self, which: usize, role: &str, addr: &str) -> Child {
        let exe = std::env::current_exe().unwrap();
        Command::new("ip")
            .args(["netns", "exec", &self.names[which]])
            .arg(exe)
            .args(["--exact", TEST_NAME, "--nocapture", "--test-threads=1"])
            .env(ROLE, role)
            .env(ADDR, addr)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

/// Kills a child on drop unless it was reaped.
struct Reaped(Option<Child>);

impl Reaped {
    fn wait(&mut self, deadline: Instant) -> std::process::ExitStatus {
        let child = self.0.as_mut().unwrap();
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                self.0 = None;
                return st;
            }
            assert!(Instant::now() < deadline, "child did not finish in time");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn rdma_across_network_namespaces() {
    if let Ok(role) = std::env::var(ROLE) {
        let addr = std::env::var(ADDR).unwrap();
        match role.as_str() {
            "responder" => responder(&addr),
            "initiator" => initiator(&addr),
            other => panic!("unknown role {other}"),
        }
        return;
    }
    if std::env::var("STAG_SKIP_NETNS").as_deref() == Ok("1") {
        eprintln!("netns: SKIPPED because STAG_SKIP_NETNS=1 (not a pass)");
        return;
    }
    let tag = std::process::id();
    let ns = Netns::create(tag).unwrap_or_else(|e| {
        panic!(
            "netns test needs root and iproute2 (`ip netns add`): {e}. \
             Set STAG_SKIP_NETNS=1 to skip it explicitly."
        )
    });
    let addr = Netns::responder_addr(tag);
    let deadline = Instant::now() + Duration::from_secs(60);

    let mut resp = Reaped(Some(ns.spawn(0, "responder", &addr)));
    let stdout = resp.0.as_mut().unwrap().stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.contains("STAG_READY") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("responder never listened");
    let mut init = Reaped(Some(ns.spawn(1, "initiator", &addr)));
    let st = init.wait(deadline);
    assert!(st.success(), "initiator failed: {st}");
    let st = resp.wait(deadline);
    assert!(st.success(), "responder failed: {st}");
    drop(ns);
    for n in [format!("stag-resp-{tag}"), format!("stag-init-{tag}")] {
        assert!(
            ip(&["netns", "pids", &n]).is_err(),
            "namespace {n} left behind"
        );
    }
}

fn responder(addr: &str) {
    let side = Side::new(None);
    side.mr.region().write_at(LEN, &pattern(LEN, 2)).unwrap();
    side.mr.region().store_u64(3 * LEN, 100).unwrap();
    let listener = Listener::bind(addr).unwrap();
    println!("STAG_READY");
    let req = listener.accept().unwrap();
    let mut private = side.mr.stag().to_be_bytes().to_vec();
    private.extend(side.mr.region().addr(0).to_be_bytes());
    side.recv(1, 4 * LEN, 64);
    req.accept(
        &side.qp,
        &MpaParams {
            private_data: private,
            ..MpaParams::default()
        },
    )
    .unwrap();
    // The initiator's last message says it is done.
    let r = side.wait(1);
    assert_eq!((r[0].status, r[0].byte_len), (WcStatus::Success, 4));
    assert_eq!(side.mr.region().to_vec(4 * LEN, 4).unwrap(), b"done");
    assert_eq!(side.mr.region().to_vec(0, LEN).unwrap(), pattern(LEN, 1));
    assert_eq!(side.mr.region().load_u64(3 * LEN).unwrap(), 105);
    println!("responder ok");
}

fn initiator(addr: &str) {
    let side = Side::new(None);
    side.mr.region().write_at(0, &pattern(LEN, 1)).unwrap();
    side.mr.region().write_at(4 * LEN, b"done").unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let private = loop {
        match side.qp.connect(addr, &MpaParams::default()) {
            Ok(p) => break p,
            Err(e) => {
                assert!(Instant::now() < deadline, "cannot connect to {addr}: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    let rkey = u32::from_be_bytes(private[..4].try_into().unwrap());
    let base = u64::from_be_bytes(private[4..12].try_into().unwrap());
    let remote = |off: usize| provider::wr::Remote {
        addr: base + off as u64,
        rkey,
    };
    side.post(
        1,
        SendOp::Write { remote: remote(0) },
        vec![side.mr.sge(0, LEN as u32)],
    );
    side.post(
        2,
        SendOp::Read {
            remote: remote(LEN),
        },
        vec![side.mr.sge(LEN, LEN as u32)],
    );
    side.post(
        3,
        SendOp::FetchAdd {
            remote: remote(3 * LEN),
            add: 5,
            mask: 0,
        },
        vec![side.mr.sge(2 * LEN, 8)],
    );
    side.post(
        4,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        vec![side.mr.sge(4 * LEN, 4)],
    );
    let c = side.wait(4);
    let got: Vec<_> = c.iter().map(|w| (w.wr_id, w.status, w.opcode)).collect();
    assert_eq!(
        got,
        [
            (1, WcStatus::Success, WcOpcode::RdmaWrite),
            (2, WcStatus::Success, WcOpcode::RdmaRead),
            (3, WcStatus::Success, WcOpcode::FetchAdd),
            (4, WcStatus::Success, WcOpcode::Send),
        ]
    );
    assert_eq!(side.mr.region().to_vec(LEN, LEN).unwrap(), pattern(LEN, 2));
    assert_eq!(side.mr.region().load_u64(2 * LEN).unwrap(), 100);
    // Keep the stream up until the responder has checked everything: it
    // exits, closing the connection.
    side.wait_event(|e| matches!(e, provider::qp::Event::Closed));
    println!("initiator ok");
}
