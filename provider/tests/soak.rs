//! Soak: 64 QPs over 8 device pairs (one driving thread per pair) running
//! Sends with checksummed payloads, Writes read back, and FetchAdd
//! counters, for `STAG_SOAK_SECS` seconds (default 5). Every op must
//! complete successfully with the right data: zero lost, zero corrupted.
//! `scripts/dev/soak.sh SECONDS` runs it long; RSS before and after is printed.

mod common;

use std::time::{Duration, Instant};

use common::*;
use provider::device::Device;
use provider::setup::MpaParams;
use provider::wr::{RecvWr, SendOp, WcOpcode, WcStatus};

const DEVICE_PAIRS: usize = 8;
const QPS_PER_PAIR: usize = 8;
const MSG: usize = 256;
const BLOCK: usize = 4096;
// Offsets inside each side's 1 MiB region.
const SEND_SRC: usize = 0;
const RECV_DST: usize = 4096;
const WRITE_SRC: usize = 64 * 1024;
const WRITE_DST: usize = 128 * 1024;
const READ_DST: usize = 192 * 1024;
const COUNTER: usize = 256 * 1024;
const FA_DST: usize = 256 * 1024 + 64;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn fill(seq: u64, qp: usize, n: usize) -> Vec<u8> {
    let mut x = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (qp as u64 + 1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A Send payload: sequence number, body, and an FNV-1a checksum of both.
fn message(seq: u64, qp: usize) -> Vec<u8> {
    let mut m = seq.to_le_bytes().to_vec();
    m.extend(fill(seq, qp, MSG - 16));
    let sum = fnv(&m);
    m.extend(sum.to_le_bytes());
    m
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[derive(Default, Debug, Clone, Copy)]
struct Counts {
    sends: u64,
    writes: u64,
    reads: u64,
    fetch_adds: u64,
}

fn run_pair(p: usize, until: Instant) -> Counts {
    let da = Device::open(&format!("soak-a{p}")).unwrap();
    let db = Device::open(&format!("soak-b{p}")).unwrap();
    let qps: Vec<(Side, Side)> = (0..QPS_PER_PAIR)
        .map(|_| {
            let a = Side::on(&da, None);
            let b = Side::on(&db, None);
            connect_with(&a, &b, MpaParams::default(), MpaParams::default());
            (a, b)
        })
        .collect();
    let mut counts = Counts::default();
    let mut seq = 0u64;
    while Instant::now() < until {
        for (q, (a, b)) in qps.iter().enumerate() {
            b.qp.post_recv(RecvWr {
                wr_id: seq,
                sg_list: vec![b.mr.sge(RECV_DST, MSG as u32)],
            })
            .unwrap();
            a.mr.region().write_at(SEND_SRC, &message(seq, q)).unwrap();
            a.mr.region()
                .write_at(WRITE_SRC, &fill(seq, q, BLOCK))
                .unwrap();
            a.post(
                seq * 4,
                SendOp::Send {
                    solicited: false,
                    invalidate: None,
                },
                vec![a.mr.sge(SEND_SRC, MSG as u32)],
            );
            a.post(
                seq * 4 + 1,
                SendOp::Write {
                    remote: b.mr.remote(WRITE_DST),
                },
                vec![a.mr.sge(WRITE_SRC, BLOCK as u32)],
            );
            a.post(
                seq * 4 + 2,
                SendOp::Read {
                    remote: b.mr.remote(WRITE_DST),
                },
                vec![a.mr.sge(READ_DST, BLOCK as u32)],
            );
            a.post(
                seq * 4 + 3,
                SendOp::FetchAdd {
                    remote: b.mr.remote(COUNTER),
                    add: 1,
                    mask: 0,
                },
                vec![a.mr.sge(FA_DST, 8)],
            );
        }
        for (q, (a, b)) in qps.iter().enumerate() {
            let c = a.wait(4);
            let want = [
                WcOpcode::Send,
                WcOpcode::RdmaWrite,
                WcOpcode::RdmaRead,
                WcOpcode::FetchAdd,
            ];
            for (i, w) in c.iter().enumerate() {
                assert_eq!(
                    (w.wr_id, w.status, w.opcode),
                    (seq * 4 + i as u64, WcStatus::Success, want[i]),
                    "pair {p} qp {q}: lost or failed op"
                );
            }
            let r = b.wait(1);
            assert_eq!(
                (r[0].wr_id, r[0].status, r[0].byte_len),
                (seq, WcStatus::Success, MSG as u32),
                "pair {p} qp {q}: receive"
            );
            let got = b.mr.region().to_vec(RECV_DST, MSG).unwrap();
            assert_eq!(
                fnv(&got[..MSG - 8]).to_le_bytes(),
                got[MSG - 8..],
                "pair {p} qp {q}: corrupted Send"
            );
            assert_eq!(got, message(seq, q), "pair {p} qp {q}: wrong Send");
            assert_eq!(
                a.mr.region().to_vec(READ_DST, BLOCK).unwrap(),
                fill(seq, q, BLOCK),
                "pair {p} qp {q}: Write read back differs"
            );
            assert_eq!(
                a.mr.region().load_u64(FA_DST).unwrap(),
                seq,
                "pair {p} qp {q}: FetchAdd original"
            );
            counts.sends += 1;
            counts.writes += 1;
            counts.reads += 1;
            counts.fetch_adds += 1;
        }
        seq += 1;
    }
    for (q, (_, b)) in qps.iter().enumerate() {
        assert_eq!(
            b.mr.region().load_u64(COUNTER).unwrap(),
            seq,
            "pair {p} qp {q}: counter"
        );
    }
    counts
}

#[test]
fn soak_mixed_ops_over_many_qps() {
    let secs: u64 = std::env::var("STAG_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let rss_before = rss_kib();
    let start = Instant::now();
    let until = start + Duration::from_secs(secs);
    let per_pair: Vec<Counts> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..DEVICE_PAIRS)
            .map(|p| s.spawn(move || run_pair(p, until)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let elapsed = start.elapsed().as_secs_f64();
    let rss_after = rss_kib();
    let total = per_pair.iter().fold(Counts::default(), |t, c| Counts {
        sends: t.sends + c.sends,
        writes: t.writes + c.writes,
        reads: t.reads + c.reads,
        fetch_adds: t.fetch_adds + c.fetch_adds,
    });
    let ops = total.sends + total.writes + total.reads + total.fetch_adds;
    println!(
        "soak: {} QPs over {DEVICE_PAIRS} device pairs, {elapsed:.1}s: {ops} ops \
         ({:.0}/s; {total:?}), 0 lost, 0 corrupted; RSS {rss_before} KiB before, \
         {rss_after} KiB after",
        DEVICE_PAIRS * QPS_PER_PAIR,
        ops as f64 / elapsed
    );
    assert!(
        per_pair.iter().all(|c| c.sends > 0),
        "every pair made progress"
    );
}
