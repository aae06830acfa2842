//! The sans-IO core under faults: two `Connection`s from a real MPA
//! exchange, byte queues between them, and queue edits (split, drop,
//! duplicate, reorder, bit flips, cuts) or a raw malicious peer. Every test
//! is deterministic: no sockets, threads or clocks.

mod common;

use common::pair::*;
use common::ALL;
use provider::mem::Access;
use provider::qp::{CqSide, QpCaps, QpState};
use provider::setup::MpaParams;
use provider::wire::rdmap::{RdmapRepr, SendKind};
use provider::wire::ErrorType;
use provider::wr::{SendOp, Sge, WcOpcode, WcStatus};

fn send() -> SendOp {
    SendOp::Send {
        solicited: false,
        invalidate: None,
    }
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Every operation once, from `a` to `b`, checked end to end.
fn every_op(cfg: Config, rx_chunk: usize) {
    let mut p = Pair::with(cfg);
    p.a.rx_chunk = rx_chunk;
    p.b.rx_chunk = rx_chunk;
    let ba = p.a.reg(64 * 1024, ALL);
    let bb = p.b.reg(64 * 1024, ALL);
    let inv = p.b.reg(64, ALL);
    let data = pattern(3000, 1);
    p.a.write(&ba, 0, b"hello");
    p.a.write(&ba, 100, &data);
    p.a.write(&ba, 4000, &pattern(5000, 2));
    p.a.write(&ba, 9000, b"imm-data");
    p.b.write(&bb, 40000, &pattern(6000, 3));
    p.b.store_u64(&bb, 50000, 40);
    p.b.store_u64(&bb, 50008, 7);
    p.b.store_u64(&bb, 50016, 3);

    p.b.recv(1, vec![bb.sge(0, 64)]);
    p.b.recv(2, vec![bb.sge(1000, 1000), bb.sge(2000, 3000)]);
    p.b.recv(3, vec![bb.sge(8000, 64)]);
    p.b.recv(4, vec![]);
    p.b.recv(5, vec![]);

    p.a.post(10, send(), vec![ba.sge(0, 5)]);
    p.a.post(
        11,
        SendOp::Send {
            solicited: true,
            invalidate: None,
        },
        vec![ba.sge(100, 3000)],
    );
    p.a.post(
        12,
        SendOp::Send {
            solicited: false,
            invalidate: Some(inv.stag),
        },
        vec![ba.sge(0, 4)],
    );
    p.a.post(
        13,
        SendOp::Write {
            remote: bb.remote(20000),
        },
        vec![ba.sge(4000, 5000)],
    );
    p.a.post(
        14,
        SendOp::WriteImm {
            remote: bb.remote(30000),
            imm: 0x1122_3344_5566_7788,
        },
        vec![ba.sge(9000, 8)],
    );
    p.a.post(
        15,
        SendOp::Imm {
            imm: u64::MAX - 1,
            solicited: true,
        },
        vec![],
    );
    p.a.post(
        16,
        SendOp::Read {
            remote: bb.remote(40000),
        },
        vec![ba.sge(20000, 2000), ba.sge(22000, 4000)],
    );
    p.a.post(
        17,
        SendOp::FetchAdd {
            remote: bb.remote(50000),
            add: 2,
            mask: 0,
        },
        vec![ba.sge(30000, 8)],
    );
    p.a.post(
        18,
        SendOp::CmpSwap {
            remote: bb.remote(50008),
            compare: 7,
            compare_mask: u64::MAX,
            swap: 9,
            swap_mask: u64::MAX,
        },
        vec![ba.sge(30008, 8)],
    );
    p.a.post(
        19,
        SendOp::Swap {
            remote: bb.remote(50016),
            swap: 5,
        },
        vec![ba.sge(30016, 8)],
    );
    p.a.post(
        20,
        SendOp::Commit {
            remote: bb.remote(0),
            len: 64,
        },
        vec![],
    );
    p.drive();

    assert!(
        p.a.sent_terminate().is_none() && p.b.sent_terminate().is_none(),
        "a: {:?} b: {:?} rtr {:?}",
        p.a.events,
        p.b.events,
        p.a.conn.negotiated().rtr
    );
    assert_eq!(p.a.state(), QpState::Rts);
    assert_eq!(p.b.state(), QpState::Rts);
    let s = p.a.cq(CqSide::Send);
    let ids: Vec<u64> = s.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, (10..=20).collect::<Vec<_>>(), "{s:?}");
    assert!(s.iter().all(|c| c.status == WcStatus::Success), "{s:?}");
    let ops: Vec<WcOpcode> = s.iter().map(|c| c.opcode).collect();
    use WcOpcode::*;
    assert_eq!(
        ops,
        [Send, Send, Send, RdmaWrite, RdmaWrite, Imm, RdmaRead, FetchAdd, CmpSwap, Swap, Commit]
    );
    let r = p.b.cq(CqSide::Recv);
    let got: Vec<_> = r
        .iter()
        .map(|c| (c.wr_id, c.status, c.opcode, c.byte_len, c.solicited))
        .collect();
    assert_eq!(
        got,
        [
            (1, WcStatus::Success, Recv, 5, false),
            (2, WcStatus::Success, Recv, 3000, true),
            (3, WcStatus::Success, Recv, 4, false),
            (4, WcStatus::Success, RecvImm, 0, false),
            (5, WcStatus::Success, RecvImm, 0, true),
        ]
    );
    assert_eq!(r[2].invalidated_rkey, Some(inv.stag));
    assert!(!p.b.mem.is_valid(inv.stag));
    assert_eq!(r[3].imm, Some(0x1122_3344_5566_7788));
    assert_eq!(r[4].imm, Some(u64::MAX - 1));
    assert_eq!(p.b.read(&bb, 0, 5), b"hello");
    let mut scattered = p.b.read(&bb, 1000, 1000);
    scattered.extend(p.b.read(&bb, 2000, 2000));
    assert_eq!(scattered, data);
    assert_eq!(p.b.read(&bb, 20000, 5000), pattern(5000, 2));
    assert_eq!(p.b.read(&bb, 30000, 8), b"imm-data");
    let mut read = p.a.read(&ba, 20000, 2000);
    read.extend(p.a.read(&ba, 22000, 4000));
    assert_eq!(read, pattern(6000, 3));
    assert_eq!(
        (
            p.a.load_u64(&ba, 30000),
            p.a.load_u64(&ba, 30008),
            p.a.load_u64(&ba, 30016)
        ),
        (40, 7, 3)
    );
    assert_eq!(
        (
            p.b.load_u64(&bb, 50000),
            p.b.load_u64(&bb, 50008),
            p.b.load_u64(&bb, 50016)
        ),
        (42, 9, 5)
    );
    assert!(p.a.sent_terminate().is_none() && p.b.sent_terminate().is_none());
}

#[test]
fn every_op_default() {
    every_op(Config::default(), usize::MAX);
}

#[test]
fn every_op_byte_by_byte_with_small_segments() {
    let caps = QpCaps {
        max_segment: 100,
        ..QpCaps::default()
    };
    every_op(
        Config {
            caps_a: caps,
            caps_b: caps,
            ..Config::default()
        },
        1,
    );
}

#[test]
fn every_op_crc_off_odd_chunks() {
    let nocrc = MpaParams {
        crc: false,
        ..MpaParams::default()
    };
    every_op(
        Config {
            a: nocrc.clone(),
            b: nocrc,
            ..Config::default()
        },
        7,
    );
}

#[test]
fn every_op_with_markers_both_ways() {
    let m = MpaParams {
        markers: true,
        ..MpaParams::default()
    };
    every_op(
        Config {
            a: m.clone(),
            b: m,
            caps_a: QpCaps {
                max_segment: 1000,
                ..QpCaps::default()
            },
            ..Config::default()
        },
        13,
    );
}

#[test]
fn every_op_mpa_revision_1_and_srq() {
    every_op(
        Config {
            a: MpaParams {
                revision: 1,
                ..MpaParams::default()
            },
            srq_b: true,
            ..Config::default()
        },
        usize::MAX,
    );
}

#[test]
fn every_op_peer_to_peer_rtr_models() {
    use provider::setup::RtrModes;
    for modes in [
        RtrModes {
            write: true,
            ..RtrModes::default()
        },
        RtrModes {
            read: true,
            ..RtrModes::default()
        },
        RtrModes {
            send: true,
            ..RtrModes::default()
        },
    ] {
        let p2p = MpaParams {
            p2p: Some(modes),
            ..MpaParams::default()
        };
        every_op(
            Config {
                a: p2p.clone(),
                b: p2p,
                ..Config::default()
            },
            5,
        );
    }
}

/// A pair where `a` sends one 64-byte Send to a posted receive, with a Read
/// and a receive outstanding on `a` and a second receive on `b`, all
/// transmitted but not delivered. Returns the queue position of the Send.
fn one_send(cfg: Config) -> Pair {
    one_send_bufs(cfg).0
}

fn one_send_bufs(cfg: Config) -> (Pair, common::pair::Buf) {
    let mut p = Pair::with(cfg);
    let ba = p.a.reg(4096, ALL);
    let bb = p.b.reg(4096, ALL);
    p.a.write(&ba, 0, &pattern(64, 9));
    p.b.recv(1, vec![bb.sge(0, 64)]);
    p.b.recv(2, vec![bb.sge(64, 64)]);
    p.a.recv(3, vec![ba.sge(1024, 64)]);
    p.a.post(10, send(), vec![ba.sge(0, 64)]);
    p.a.post(
        11,
        SendOp::Read {
            remote: bb.remote(512),
        },
        vec![ba.sge(2048, 16)],
    );
    p.transmit();
    assert_eq!(p.queue(Dir::AtoB).len(), 2, "a Send and a Read Request");
    (p, bb)
}

fn flushed_everything(p: &Pair) {
    let a_send = exactly_once(&p.a, CqSide::Send, &[10, 11]);
    assert_eq!(a_send[0].status, WcStatus::Success, "handed to the LLP");
    assert_ne!(
        a_send[1].status,
        WcStatus::Success,
        "the Read never came back"
    );
    let a_recv = exactly_once(&p.a, CqSide::Recv, &[3]);
    assert_eq!(a_recv[0].status, WcStatus::WrFlushErr);
    let b_recv = exactly_once(&p.b, CqSide::Recv, &[1, 2]);
    assert!(
        b_recv.iter().all(|c| c.status == WcStatus::WrFlushErr),
        "{b_recv:?}"
    );
}

#[test]
fn crc_error_anywhere_but_the_length_terminates_with_mpa_crc() {
    let n = one_send(Config::default()).queue(Dir::AtoB)[0].len();
    for byte in 2..n {
        for bit in [0u8, 3, 7] {
            let mut p = one_send(Config::default());
            p.flip_bit(Dir::AtoB, 0, byte, bit);
            p.drive();
            assert_terminate(&p, false, ErrorType::Mpa, 0x02);
            flushed_everything(&p);
            let term = p.b.sent_frames().pop().unwrap().0;
            assert!(matches!(term, RdmapRepr::Terminate(_)), "{term:?}");
        }
    }
}

#[test]
fn flipped_length_field_never_panics_and_ends_cleanly() {
    for crc in [true, false] {
        for bit in 0..16u8 {
            let cfg = Config {
                a: MpaParams {
                    crc,
                    ..MpaParams::default()
                },
                b: MpaParams {
                    crc,
                    ..MpaParams::default()
                },
                ..Config::default()
            };
            let mut p = one_send(cfg);
            p.flip_bit(Dir::AtoB, 0, (bit / 8) as usize, bit % 8);
            p.drive();
            // Either the receiver caught it, or it waits for bytes that
            // never come; then the stream dies and everything flushes.
            if let Some(c) = p.b.sent_terminate() {
                assert!(
                    c.etype != ErrorType::Mpa || crc || c.ecode == 0x04,
                    "without CRC only framing errors are MPA's: {c:?}"
                );
            }
            p.break_link();
            assert_eq!((p.a.state(), p.b.state()), (QpState::Error, QpState::Error));
            exactly_once(&p.a, CqSide::Send, &[10, 11]);
            exactly_once(&p.a, CqSide::Recv, &[3]);
            let b = exactly_once(&p.b, CqSide::Recv, &[1, 2]);
            assert!(b[1].status == WcStatus::WrFlushErr, "{b:?}");
        }
    }
}

fn nocrc() -> Config {
    let m = MpaParams {
        crc: false,
        ..MpaParams::default()
    };
    Config {
        a: m.clone(),
        b: m,
        ..Config::default()
    }
}

#[test]
fn without_crc_a_payload_flip_lands_in_the_data() {
    let (mut p, bb) = one_send_bufs(nocrc());
    // Untagged header is 18 bytes after the 2-byte length: byte 20 on is payload.
    p.flip_bit(Dir::AtoB, 0, 20 + 17, 2);
    p.drive();
    assert_eq!((p.a.state(), p.b.state()), (QpState::Rts, QpState::Rts));
    let r = p.b.cq(CqSide::Recv);
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].byte_len),
        (1, WcStatus::Success, 64)
    );
    let mut want = pattern(64, 9);
    want[17] ^= 1 << 2;
    assert_eq!(p.b.read(&bb, 0, 64), want);
}

/// Without CRC, header flips are caught by header validation, each with
/// its own Terminate.
#[test]
fn without_crc_header_flips_are_caught_by_validation() {
    // (FPDU byte, bit, expected error type, code)
    let cases = [
        // DDP control, DV (0x01 of the first control byte).
        (2usize, 0u8, ErrorType::DdpUntagged, 0x06u8),
        // RDMAP control, RV (0x40 of the second control byte).
        (3, 6, ErrorType::RdmapRemoteOperation, 0x05),
        // Queue number (low byte) 0 -> 1: a Send on the Read Request queue.
        (11, 0, ErrorType::DdpUntagged, 0x01),
        // MSN 1 -> 3.
        (15, 1, ErrorType::DdpUntagged, 0x03),
        // MSN high byte.
        (12, 7, ErrorType::DdpUntagged, 0x03),
        // Message offset 0 -> 0x0100_0000: far past the 64-byte buffer.
        (16, 0, ErrorType::DdpUntagged, 0x05),
    ];
    for (byte, bit, etype, ecode) in cases {
        let mut p = one_send(nocrc());
        p.flip_bit(Dir::AtoB, 0, byte, bit);
        p.drive();
        assert_terminate(&p, false, etype, ecode);
        flushed_everything(&p);
    }
}

#[test]
fn duplicated_fpdu_is_an_msn_range_error() {
    let mut p = one_send(Config::default());
    p.dup_fpdu(Dir::AtoB, 0);
    p.drive();
    assert_terminate(&p, false, ErrorType::DdpUntagged, 0x03);
    // The first copy was received.
    let r = exactly_once(&p.b, CqSide::Recv, &[1, 2]);
    assert_eq!((r[0].wr_id, r[0].status), (1, WcStatus::Success));
    assert_eq!(r[1].status, WcStatus::WrFlushErr);
}

fn two_sends() -> Pair {
    let mut p = Pair::new();
    let ba = p.a.reg(4096, ALL);
    let bb = p.b.reg(4096, ALL);
    p.b.recv(1, vec![bb.sge(0, 64)]);
    p.b.recv(2, vec![bb.sge(64, 64)]);
    p.a.post(10, send(), vec![ba.sge(0, 8)]);
    p.a.post(11, send(), vec![ba.sge(8, 8)]);
    p.transmit();
    assert_eq!(p.queue(Dir::AtoB).len(), 2);
    p
}

#[test]
fn reordered_fpdus_are_an_msn_range_error() {
    let mut p = two_sends();
    p.swap_fpdus(Dir::AtoB, 0, 1);
    p.drive();
    assert_terminate(&p, false, ErrorType::DdpUntagged, 0x03);
    let r = exactly_once(&p.b, CqSide::Recv, &[1, 2]);
    assert!(r.iter().all(|c| c.status == WcStatus::WrFlushErr));
}

#[test]
fn dropped_fpdu_is_an_msn_range_error() {
    let mut p = two_sends();
    p.drop_fpdu(Dir::AtoB, 0);
    p.drive();
    assert_terminate(&p, false, ErrorType::DdpUntagged, 0x03);
}

#[test]
fn split_at_every_boundary_is_transparent() {
    let total: usize = two_sends().queue(Dir::AtoB).iter().map(Vec::len).sum();
    for at in 1..total {
        let mut p = two_sends();
        p.rechunk(Dir::AtoB, &[at, total]);
        p.drive();
        let r = exactly_once(&p.b, CqSide::Recv, &[1, 2]);
        assert!(
            r.iter().all(|c| c.status == WcStatus::Success),
            "split at {at}"
        );
        assert_eq!(p.b.state(), QpState::Rts);
    }
}

#[test]
fn oversized_send_is_message_too_long() {
    let mut p = Pair::new();
    let ba = p.a.reg(4096, ALL);
    let bb = p.b.reg(4096, ALL);
    p.b.recv(1, vec![bb.sge(0, 16)]);
    p.a.post(10, send(), vec![ba.sge(0, 100)]);
    p.drive();
    assert_terminate(&p, false, ErrorType::DdpUntagged, 0x05);
    let r = exactly_once(&p.b, CqSide::Recv, &[1]);
    assert_eq!(r[0].status, WcStatus::WrFlushErr);
}

/// A Send or Immediate Data that finds no Receive waits for one (iWARP
/// has no RNR retries; the driver stops reading meanwhile), then lands in
/// the next Receive posted: no Terminate, nothing lost.
#[test]
fn send_without_receive_waits_for_one() {
    let mut p = Pair::new();
    let ba = p.a.reg(4096, ALL);
    let bb = p.b.reg(4096, ALL);
    p.a.write(&ba, 0, b"0123456789");
    p.a.post(10, send(), vec![ba.sge(0, 10)]);
    p.a.post(
        11,
        SendOp::Imm {
            imm: 7,
            solicited: false,
        },
        vec![],
    );
    p.drive();
    assert!(p.b.sent_terminate().is_none(), "events {:?}", p.b.events);
    assert!(p.b.conn.rx_held());
    assert_eq!(p.b.state(), QpState::Rts);
    p.b.recv(1, vec![bb.sge(0, 16)]);
    p.b.recv(2, vec![bb.sge(16, 16)]);
    p.drive();
    let r = exactly_once(&p.b, CqSide::Recv, &[1, 2]);
    assert!(r.iter().all(|wc| wc.status == WcStatus::Success), "{r:?}");
    assert_eq!(r[0].byte_len, 10);
    assert_eq!(r[1].imm, Some(7));
    assert_eq!(p.b.read(&bb, 0, 10), b"0123456789");
    assert!(!p.b.conn.rx_held());
    assert_eq!(p.a.state(), QpState::Rts);
}

/// On an SRQ the QP cannot wait (posts go to the SRQ, not to it): a Send
/// or Immediate Data with no Receive draws the no-buffer Terminate.
#[test]
fn send_without_receive_on_an_srq_is_no_buffer() {
    for imm in [false, true] {
        let mut p = Pair::with(Config {
            srq_b: true,
            ..Config::default()
        });
        let ba = p.a.reg(4096, ALL);
        if imm {
            p.a.post(
                10,
                SendOp::Imm {
                    imm: 1,
                    solicited: false,
                },
                vec![],
            );
        } else {
            p.a.post(10, send(), vec![ba.sge(0, 10)]);
        }
        p.drive();
        assert_terminate(&p, false, ErrorType::DdpUntagged, 0x02);
    }
}

/// A peer that ignores the negotiated ORD: raw Read and atomic Requests
/// beyond our IRD draw the IRD Terminate.
#[test]
fn ird_overflow_from_a_peer_ignoring_ord() {
    for atomic_last in [false, true] {
        let mut p = Pair::with(Config {
            b: MpaParams {
                ird: 2,
                ..MpaParams::default()
            },
            ..Config::default()
        });
        assert_eq!(p.a.conn.negotiated().ord, 2);
        assert_eq!(p.b.conn.negotiated().ird, 2);
        let bb = p.b.reg(4096, ALL);
        let mut raw = Raw::new(true);
        let mut bytes = Vec::new();
        for i in 0..3u64 {
            let msn = raw.next_msn(1);
            let repr = if atomic_last && i == 2 {
                RdmapRepr::AtomicRequest {
                    msn,
                    opcode: provider::wire::atomic::AtomicOpcode::FetchAdd,
                    req_id: 7,
                    stag: bb.stag,
                    to: bb.addr,
                    add_swap: 1,
                    add_swap_mask: 0,
                    compare: 0,
                    compare_mask: u64::MAX,
                }
            } else {
                RdmapRepr::ReadRequest {
                    msn,
                    sink_stag: 0x100,
                    sink_to: 0,
                    size: 16,
                    src_stag: bb.stag,
                    src_to: bb.addr + 16 * i,
                }
            };
            bytes.extend(raw.frame(&repr, &[]));
        }
        p.inject(Dir::AtoB, bytes);
        p.deliver(Dir::AtoB);
        let c = p.b.sent_terminate().expect("IRD Terminate");
        assert_eq!((c.etype, c.ecode), (ErrorType::RdmapRemoteOperation, 0x07));
        assert_eq!(p.b.state(), QpState::Error);
        // Memory untouched by the refused atomic.
        assert_eq!(p.b.load_u64(&bb, 0), 0);
    }
}

#[test]
fn a_requester_keeping_ord_never_exceeds_ird() {
    let mut p = Pair::with(Config {
        b: MpaParams {
            ird: 2,
            ..MpaParams::default()
        },
        ..Config::default()
    });
    let ba = p.a.reg(4096, ALL);
    let bb = p.b.reg(4096, ALL);
    p.b.write(&bb, 0, &pattern(64, 4));
    for i in 0..32u64 {
        let op = if i % 2 == 0 {
            SendOp::Read {
                remote: bb.remote(i as usize),
            }
        } else {
            SendOp::FetchAdd {
                remote: bb.remote(1024),
                add: 1,
                mask: 0,
            }
        };
        let sge = if i % 2 == 0 {
            ba.sge(i as usize, 1)
        } else {
            ba.sge(2048 + 8 * i as usize, 8)
        };
        p.a.post(i, op, vec![sge]);
    }
    p.drive();
    let s = exactly_once(&p.a, CqSide::Send, &(0..32).collect::<Vec<_>>());
    assert!(s.iter().all(|c| c.status == WcStatus::Success), "{s:?}");
    assert_eq!(p.b.load_u64(&bb, 1024), 16);
}

/// What a protection case posts on `a` against `b`'s buffers.
struct Bufs {
    b: common::pair::Buf,
    ro: common::pair::Buf,
    wo: common::pair::Buf,
    other_pd: common::pair::Buf,
    noinv: common::pair::Buf,
    a: common::pair::Buf,
}

type Case = (&'static str, fn(&Bufs) -> (SendOp, Vec<Sge>), ErrorType, u8);

fn write_to(r: provider::wr::Remote, bufs: &Bufs) -> (SendOp, Vec<Sge>) {
    (SendOp::Write { remote: r }, vec![bufs.a.sge(0, 4)])
}

fn read_from(r: provider::wr::Remote, bufs: &Bufs) -> (SendOp, Vec<Sge>) {
    (SendOp::Read { remote: r }, vec![bufs.a.sge(0, 4)])
}

fn fetch_add(r: provider::wr::Remote, bufs: &Bufs) -> (SendOp, Vec<Sge>) {
    (
        SendOp::FetchAdd {
            remote: r,
            add: 1,
            mask: 0,
        },
        vec![bufs.a.sge(8, 8)],
    )
}

fn bad(r: provider::wr::Remote) -> provider::wr::Remote {
    provider::wr::Remote {
        addr: r.addr,
        rkey: r.rkey ^ 0x5a,
    }
}

fn wrap(r: provider::wr::Remote) -> provider::wr::Remote {
    provider::wr::Remote {
        addr: u64::MAX - 1,
        rkey: r.rkey,
    }
}

const CASES: &[Case] = &[
    (
        "write bad stag",
        |x| write_to(bad(x.b.remote(0)), x),
        ErrorType::DdpTagged,
        0x00,
    ),
    (
        "write bounds",
        |x| write_to(x.b.remote(4094), x),
        ErrorType::DdpTagged,
        0x01,
    ),
    (
        "write other pd",
        |x| write_to(x.other_pd.remote(0), x),
        ErrorType::DdpTagged,
        0x02,
    ),
    (
        "write to wrap",
        |x| write_to(wrap(x.b.remote(0)), x),
        ErrorType::DdpTagged,
        0x03,
    ),
    (
        "write no rights",
        |x| write_to(x.ro.remote(0), x),
        ErrorType::RdmapRemoteProtection,
        0x02,
    ),
    (
        "read bad stag",
        |x| read_from(bad(x.b.remote(0)), x),
        ErrorType::RdmapRemoteProtection,
        0x00,
    ),
    (
        "read bounds",
        |x| read_from(x.b.remote(4094), x),
        ErrorType::RdmapRemoteProtection,
        0x01,
    ),
    (
        "read no rights",
        |x| read_from(x.wo.remote(0), x),
        ErrorType::RdmapRemoteProtection,
        0x02,
    ),
    (
        "read other pd",
        |x| read_from(x.other_pd.remote(0), x),
        ErrorType::RdmapRemoteProtection,
        0x03,
    ),
    (
        "read to wrap",
        |x| read_from(wrap(x.b.remote(0)), x),
        ErrorType::RdmapRemoteProtection,
        0x04,
    ),
    (
        "atomic misaligned",
        |x| fetch_add(x.b.remote(4), x),
        ErrorType::RdmapRemoteOperation,
        0x07,
    ),
    (
        "atomic bad stag",
        |x| fetch_add(bad(x.b.remote(0)), x),
        ErrorType::RdmapRemoteProtection,
        0x00,
    ),
    (
        "atomic bounds",
        |x| fetch_add(x.b.remote(4096), x),
        ErrorType::RdmapRemoteProtection,
        0x01,
    ),
    (
        "atomic no rights",
        |x| fetch_add(x.ro.remote(0), x),
        ErrorType::RdmapRemoteProtection,
        0x02,
    ),
    (
        "atomic other pd",
        |x| fetch_add(x.other_pd.remote(0), x),
        ErrorType::RdmapRemoteProtection,
        0x03,
    ),
    (
        "send invalidating a bad stag",
        |x| {
            (
                SendOp::Send {
                    solicited: false,
                    invalidate: Some(x.b.stag ^ 0x5a),
                },
                vec![x.a.sge(0, 4)],
            )
        },
        ErrorType::RdmapRemoteProtection,
        0x00,
    ),
    (
        "send invalidating a protected stag",
        |x| {
            (
                SendOp::Send {
                    solicited: true,
                    invalidate: Some(x.noinv.stag),
                },
                vec![x.a.sge(0, 4)],
            )
        },
        ErrorType::RdmapRemoteProtection,
        0x09,
    ),
];

#[test]
fn protection_matrix() {
    for (name, op, etype, ecode) in CASES {
        let mut p = Pair::new();
        let bufs = Bufs {
            a: p.a.reg(4096, ALL),
            b: p.b.reg(4096, ALL),
            ro: p.b.reg(4096, Access::REMOTE_READ),
            wo: p.b.reg(4096, Access::REMOTE_WRITE),
            other_pd: p.b.reg_in(PD + 1, 4096, ALL),
            noinv: p.b.reg(64, Access::REMOTE_WRITE),
        };
        p.b.store_u64(&bufs.b, 0, 0x77);
        p.b.store_u64(&bufs.ro, 0, 0x77);
        p.b.store_u64(&bufs.other_pd, 0, 0x77);
        p.b.recv(1, vec![bufs.b.sge(1024, 64)]);
        p.b.recv(2, vec![bufs.b.sge(2048, 64)]);
        p.a.recv(3, vec![bufs.a.sge(1024, 64)]);
        let (op, sgl) = op(&bufs);
        p.a.post(10, op, sgl);
        p.drive();
        assert_terminate(&p, false, *etype, *ecode);
        let s = exactly_once(&p.a, CqSide::Send, &[10]);
        if op.needs_response() {
            let want = if *etype == ErrorType::RdmapRemoteOperation {
                WcStatus::RemOpErr
            } else {
                WcStatus::RemAccessErr
            };
            assert_eq!(s[0].status, want, "{name}");
            assert_eq!(s[0].vendor_err & 0xff, *ecode as u32, "{name}");
        }
        let ra = exactly_once(&p.a, CqSide::Recv, &[3]);
        assert_eq!(ra[0].status, WcStatus::WrFlushErr, "{name}");
        let rb = exactly_once(&p.b, CqSide::Recv, &[1, 2]);
        assert!(
            rb.iter().all(|c| c.status == WcStatus::WrFlushErr),
            "{name}: {rb:?}"
        );
        // Nothing changed in b's memory.
        for buf in [&bufs.b, &bufs.ro, &bufs.other_pd] {
            assert_eq!(p.b.load_u64(buf, 0), 0x77, "{name}");
        }
        assert!(p.b.mem.is_valid(bufs.noinv.stag), "{name}");
    }
}

#[test]
fn failed_commit_returns_a_status_and_keeps_the_stream() {
    let mut p = Pair::new();
    let ba = p.a.reg(4096, ALL);
    let bb = p.b.reg(4096, Access::REMOTE_WRITE);
    let ok = p.b.reg(4096, ALL);
    p.a.post(
        1,
        SendOp::Commit {
            remote: bb.remote(0),
            len: 64,
        },
        vec![],
    );
    p.a.post(
        2,
        SendOp::Commit {
            remote: ok.remote(4000),
            len: 200,
        },
        vec![],
    );
    p.a.post(
        3,
        SendOp::Commit {
            remote: ok.remote(0),
            len: 4096,
        },
        vec![],
    );
    p.a.post(
        4,
        SendOp::Write {
            remote: ok.remote(0),
        },
        vec![ba.sge(0, 8)],
    );
    p.drive();
    let s = exactly_once(&p.a, CqSide::Send, &[1, 2, 3, 4]);
    assert_eq!((s[0].status, s[0].vendor_err), (WcStatus::RemOpErr, 3));
    assert_eq!((s[1].status, s[1].vendor_err), (WcStatus::RemOpErr, 2));
    assert_eq!(
        (s[2].status, s[3].status),
        (WcStatus::Success, WcStatus::Success)
    );
    assert_eq!((p.a.state(), p.b.state()), (QpState::Rts, QpState::Rts));
}

#[test]
fn local_protection_error_fails_only_that_wr_and_terminates() {
    let mut p = Pair::new();
    let ba = p.a.reg(64, ALL);
    p.a.post(1, send(), vec![ba.sge(60, 8)]);
    p.drive();
    let s = exactly_once(&p.a, CqSide::Send, &[1]);
    assert_eq!(s[0].status, WcStatus::LocProtErr);
    assert_terminate(&p, true, ErrorType::RdmapRemoteOperation, 0x07);
}

// ---- malicious peers on the response paths (bugs found here) ----

/// A Read Request whose sink TO wraps while the responder segments its
/// response used to overflow `sink_to + sent` (a panic in debug builds).
#[test]
fn read_request_with_wrapping_sink_to_is_answered_without_panic() {
    let mut p = Pair::with(Config {
        caps_b: QpCaps {
            max_segment: 64,
            ..QpCaps::default()
        },
        ..Config::default()
    });
    let bb = p.b.reg(4096, ALL);
    p.b.write(&bb, 0, &pattern(200, 5));
    let mut raw = Raw::new(true);
    let msn = raw.next_msn(1);
    let req = raw.frame(
        &RdmapRepr::ReadRequest {
            msn,
            sink_stag: 0x1234,
            sink_to: u64::MAX - 10,
            size: 200,
            src_stag: bb.stag,
            src_to: bb.addr,
        },
        &[],
    );
    p.inject(Dir::AtoB, req);
    p.deliver(Dir::AtoB);
    p.b.transmit();
    let frames = p.b.sent_frames();
    let tos: Vec<u64> = frames
        .iter()
        .map(|(r, _)| match r {
            RdmapRepr::ReadResponse { to, .. } => *to,
            other => panic!("{other:?}"),
        })
        .collect();
    let base = u64::MAX - 10;
    assert_eq!(
        tos,
        [0, 64, 128, 192].map(|o: u64| base.wrapping_add(o)),
        "responses keep the wire TO (the requester judges it)"
    );
    let data: Vec<u8> = frames.iter().flat_map(|(_, d)| d.clone()).collect();
    assert_eq!(data, pattern(200, 5));
}

/// A Read Response whose TO is so far past the sink that `offset + length`
/// overflows used to panic in debug builds; it is a tagged TO wrap.
#[test]
fn read_response_overflowing_the_offset_is_a_to_wrap() {
    let mut p = Pair::new();
    let ba = p.a.reg_at(PD, 0x10, 64, ALL);
    p.a.post(
        1,
        SendOp::Read {
            remote: provider::wr::Remote {
                addr: 0x1000,
                rkey: 0x200,
            },
        },
        vec![ba.sge(0, 32)],
    );
    p.transmit();
    p.queue(Dir::AtoB).clear();
    let mut raw = Raw::new(true);
    let resp = raw.frame(
        &RdmapRepr::ReadResponse {
            last: true,
            stag: ba.stag,
            to: u64::MAX - 3,
        },
        &[0xee; 32],
    );
    p.inject(Dir::BtoA, resp);
    p.deliver(Dir::BtoA);
    let c = p.a.sent_terminate().expect("Terminate");
    assert_eq!((c.etype, c.ecode), (ErrorType::DdpTagged, 0x03));
    let s = exactly_once(&p.a, CqSide::Send, &[1]);
    assert_eq!(s[0].status, WcStatus::WrFlushErr);
    assert_eq!(p.a.read(&ba, 0, 64), vec![0u8; 64]);
}

/// A Send with Invalidate naming a bad STag used to take the receive WR
/// out of the queue and lose it: it never completed.
#[test]
fn failed_send_with_invalidate_still_completes_the_receive() {
    let mut p = Pair::new();
    let ba = p.a.reg(64, ALL);
    let bb = p.b.reg(64, ALL);
    p.b.recv(1, vec![bb.sge(0, 64)]);
    p.a.post(
        10,
        SendOp::Send {
            solicited: false,
            invalidate: Some(0xdead_beef),
        },
        vec![ba.sge(0, 8)],
    );
    p.drive();
    assert_terminate(&p, false, ErrorType::RdmapRemoteProtection, 0x00);
    let r = exactly_once(&p.b, CqSide::Recv, &[1]);
    assert_eq!(r[0].status, WcStatus::WrFlushErr);
}

/// A segment size of zero used to make no progress at all (and fill
/// memory with empty segments); it is clamped to one byte.
#[test]
fn zero_segment_size_still_makes_progress() {
    let mut p = Pair::with(Config {
        caps_a: QpCaps {
            max_segment: 0,
            ..QpCaps::default()
        },
        ..Config::default()
    });
    let ba = p.a.reg(64, ALL);
    let bb = p.b.reg(64, ALL);
    p.a.write(&ba, 0, b"0123456789");
    p.b.recv(1, vec![bb.sge(0, 64)]);
    p.a.post(10, send(), vec![ba.sge(0, 10)]);
    p.drive();
    assert_eq!(p.a.sent_frames().len(), 10);
    let r = exactly_once(&p.b, CqSide::Recv, &[1]);
    assert_eq!((r[0].status, r[0].byte_len), (WcStatus::Success, 10));
    assert_eq!(p.b.read(&bb, 0, 10), b"0123456789");
}

#[test]
fn a_message_over_4_gib_is_refused_at_post() {
    let mut p = Pair::new();
    let ba = p.a.reg(64, ALL);
    let sge = Sge {
        length: u32::MAX,
        ..ba.sge(0, 1)
    };
    let err = p.a.post_send(10, send(), vec![ba.sge(0, 8), sge]);
    assert!(
        matches!(err, Err(provider::qp::PostError::Invalid(_))),
        "{err:?}"
    );
    assert!(p.a.completions.is_empty());
}

#[test]
fn raw_send_segments_out_of_order_within_a_message_are_placed() {
    // DDP places untagged segments by MO; they may arrive in any order
    // within one message as long as the last one completes it.
    let mut p = Pair::new();
    let bb = p.b.reg(64, ALL);
    p.b.recv(1, vec![bb.sge(0, 64)]);
    let mut raw = Raw::new(true);
    let seg = |raw: &mut Raw, last, mo: u32, data: &[u8]| {
        raw.frame(
            &RdmapRepr::Send {
                kind: SendKind::Send,
                last,
                msn: 1,
                mo,
                invalidate_stag: 0,
            },
            data,
        )
    };
    let s2 = seg(&mut raw, false, 4, b"5678");
    let s1 = seg(&mut raw, false, 0, b"1234");
    let s3 = seg(&mut raw, true, 8, b"9");
    for s in [s2, s1, s3] {
        p.inject(Dir::AtoB, s);
    }
    p.deliver(Dir::AtoB);
    let r = exactly_once(&p.b, CqSide::Recv, &[1]);
    assert_eq!((r[0].status, r[0].byte_len), (WcStatus::Success, 9));
    assert_eq!(p.b.read(&bb, 0, 9), b"123456789");
}

// ---- the stream cut at every byte ----

const WORKLOAD_SEND: &[u64] = &[10, 11, 12, 13, 14, 15, 16];

fn workload(cut_at: Option<usize>) -> Pair {
    let mut p = Pair::with(Config {
        caps_a: QpCaps {
            max_segment: 48,
            ..QpCaps::default()
        },
        caps_b: QpCaps {
            max_segment: 48,
            ..QpCaps::default()
        },
        ..Config::default()
    });
    p.cut_at = cut_at;
    let ba = p.a.reg(4096, ALL);
    let bb = p.b.reg(4096, ALL);
    p.a.write(&ba, 0, &pattern(100, 1));
    p.b.write(&bb, 1024, &pattern(100, 2));
    p.b.recv(1, vec![bb.sge(0, 128)]);
    p.b.recv(2, vec![]);
    p.b.recv(3, vec![bb.sge(256, 64)]);
    p.a.recv(4, vec![ba.sge(2048, 64)]);
    p.a.post(10, send(), vec![ba.sge(0, 100)]);
    p.a.post(
        11,
        SendOp::Write {
            remote: bb.remote(512),
        },
        vec![ba.sge(0, 60)],
    );
    p.a.post(
        12,
        SendOp::Read {
            remote: bb.remote(1024),
        },
        vec![ba.sge(1024, 100)],
    );
    p.a.post(
        13,
        SendOp::FetchAdd {
            remote: bb.remote(2048),
            add: 5,
            mask: 0,
        },
        vec![ba.sge(3000, 8)],
    );
    p.a.post(
        14,
        SendOp::Imm {
            imm: 9,
            solicited: false,
        },
        vec![],
    );
    p.a.post(
        15,
        SendOp::Commit {
            remote: bb.remote(0),
            len: 100,
        },
        vec![],
    );
    p.a.post(16, send(), vec![ba.sge(0, 10)]);
    p.b.post(20, send(), vec![bb.sge(1024, 20)]);
    p.drive();
    p
}

#[test]
fn stream_cut_at_every_byte_completes_every_wr_exactly_once() {
    let clean = workload(None);
    assert!(clean
        .a
        .cq(CqSide::Send)
        .iter()
        .all(|c| c.status == WcStatus::Success));
    let total = clean.crossed;
    assert!(total > 500, "a workload of many FPDUs ({total} bytes)");
    for cut in 0..=total {
        let p = workload(Some(cut));
        assert!(!p.link_up, "cut at {cut}");
        assert_eq!((p.a.state(), p.b.state()), (QpState::Error, QpState::Error));
        assert!(p.a.sent_terminate().is_none() && p.b.sent_terminate().is_none());
        for c in exactly_once(&p.a, CqSide::Send, WORKLOAD_SEND)
            .iter()
            .chain(&exactly_once(&p.a, CqSide::Recv, &[4]))
            .chain(&exactly_once(&p.b, CqSide::Send, &[20]))
            .chain(&exactly_once(&p.b, CqSide::Recv, &[1, 2, 3]))
        {
            assert!(success_or_flush(c), "cut at {cut}: {c:?}");
        }
        // Whatever succeeded is right.
        let rb = p.b.cq(CqSide::Recv);
        if rb[0].status == WcStatus::Success {
            assert_eq!(rb[0].byte_len, 100);
        }
        let sa = p.a.cq(CqSide::Send);
        let read = sa.iter().find(|c| c.wr_id == 12).unwrap();
        if read.status == WcStatus::Success {
            assert_eq!(read.byte_len, 100);
        }
        let fa = sa.iter().find(|c| c.wr_id == 13).unwrap();
        if fa.status == WcStatus::Success {
            assert_eq!(fa.byte_len, 8);
        }
    }
}

/// An RFC 5040-only responder (what kernel siw is) answers every RDMAP
/// extension with Terminate (RDMAP, remote operation, Unexpected OpCode
/// 0x06) before looking at its STag, leaving memory alone — the answer
/// RFC 7306 §1.1's FetchAdd-of-0 probe reads — and its own QP refuses to
/// post one.
#[test]
fn rfc5040_only_responder_refuses_extensions() {
    let ops = |r: provider::wr::Remote| {
        vec![
            SendOp::FetchAdd {
                remote: r,
                add: 0,
                mask: 0,
            },
            SendOp::Swap { remote: r, swap: 9 },
            SendOp::Imm {
                imm: 5,
                solicited: false,
            },
            SendOp::Commit { remote: r, len: 8 },
        ]
    };
    for i in 0..4 {
        let mut p = Pair::with(Config {
            caps_b: QpCaps {
                rdmap_extensions: false,
                ..QpCaps::default()
            },
            ..Config::default()
        });
        let ba = p.a.reg(64, ALL);
        let bb = p.b.reg(64, ALL);
        p.b.store_u64(&bb, 0, 41);
        p.b.recv(50, vec![bb.sge(8, 8)]);
        let op = ops(bb.remote(0)).remove(i);
        let sges = match op {
            SendOp::Imm { .. } | SendOp::Commit { .. } => vec![],
            _ => vec![ba.sge(0, 8)],
        };
        p.a.post(1, op, sges.clone());
        p.drive();
        assert_terminate(&p, false, ErrorType::RdmapRemoteOperation, 0x06);
        assert_eq!(p.b.load_u64(&bb, 0), 41, "op {i}: memory untouched");
        let c = exactly_once(&p.a, CqSide::Send, &[1]);
        // Immediate Data is one-way and completes once sent; the others
        // wait for a response that never comes.
        if i != 2 {
            assert_ne!(c[0].status, WcStatus::Success, "op {i}");
        }
        // The refusing side cannot post one either.
        let mut q = Pair::with(Config {
            caps_a: QpCaps {
                rdmap_extensions: false,
                ..QpCaps::default()
            },
            ..Config::default()
        });
        let qa = q.a.reg(64, ALL);
        let qb = q.b.reg(64, ALL);
        let op = ops(qb.remote(0)).remove(i);
        let sges = match op {
            SendOp::Imm { .. } | SendOp::Commit { .. } => vec![],
            _ => vec![qa.sge(0, 8)],
        };
        assert!(matches!(
            q.a.post_send(1, op, sges),
            Err(provider::qp::PostError::Invalid(_))
        ));
        assert_eq!(q.a.state(), QpState::Rts);
    }
}
