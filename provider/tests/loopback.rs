//! The userspace provider end to end over loopback TCP: every operation,
//! both setup models, CRC and markers, and the error paths with the
//! Terminate each one draws.

mod common;

use std::sync::Arc;

use common::*;
use provider::mem::Access;
use provider::qp::{Event, QpState};
use provider::region::Region;
use provider::setup::{MpaParams, Rtr, RtrModes};
use provider::srq::Srq;
use provider::wire::{ErrorType, Layer};
use provider::wr::{SendOp, WcOpcode, WcStatus};

#[test]
fn send_recv_small_and_segmented() {
    let (a, b) = pair();
    b.recv(1, 0, 64);
    b.recv(2, 4096, 300_000);
    a.mr.region().write_at(0, b"hello").unwrap();
    let big: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    a.mr.region().write_at(8192, &big).unwrap();
    a.post(
        10,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        vec![a.mr.sge(0, 5)],
    );
    a.post(
        11,
        SendOp::Send {
            solicited: true,
            invalidate: None,
        },
        vec![a.mr.sge(8192, 300_000)],
    );
    let s = a.wait(2);
    assert_eq!(
        (s[0].wr_id, s[0].status, s[0].opcode),
        (10, WcStatus::Success, WcOpcode::Send)
    );
    assert_eq!((s[1].wr_id, s[1].status), (11, WcStatus::Success));
    let r = b.wait(2);
    assert_eq!(
        (r[0].wr_id, r[0].byte_len, r[0].opcode),
        (1, 5, WcOpcode::Recv)
    );
    assert!(!r[0].solicited);
    assert_eq!(
        (r[1].wr_id, r[1].byte_len, r[1].solicited),
        (2, 300_000, true)
    );
    assert_eq!(b.mr.region().to_vec(0, 5).unwrap(), b"hello");
    assert_eq!(b.mr.region().to_vec(4096, 300_000).unwrap(), big);
}

#[test]
fn send_gathers_and_scatters_over_several_sges() {
    let (a, b) = pair();
    b.qp.post_recv(provider::wr::RecvWr {
        wr_id: 5,
        sg_list: vec![b.mr.sge(100, 3), b.mr.sge(200, 10)],
    })
    .unwrap();
    a.mr.region().write_at(0, b"abc").unwrap();
    a.mr.region().write_at(50, b"defgh").unwrap();
    a.post(
        1,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        vec![a.mr.sge(0, 3), a.mr.sge(50, 5)],
    );
    a.wait(1);
    let r = b.wait(1);
    assert_eq!(r[0].byte_len, 8);
    assert_eq!(b.mr.region().to_vec(100, 3).unwrap(), b"abc");
    assert_eq!(b.mr.region().to_vec(200, 5).unwrap(), b"defgh");
}

#[test]
fn write_then_read_back() {
    let (a, b) = pair();
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
    a.mr.region().write_at(0, &data).unwrap();
    a.post(
        1,
        SendOp::Write {
            remote: b.mr.remote(1000),
        },
        vec![a.mr.sge(0, 200_000)],
    );
    a.post(
        2,
        SendOp::Read {
            remote: b.mr.remote(1000),
        },
        vec![a.mr.sge(400_000, 200_000)],
    );
    let c = a.wait(2);
    assert_eq!(
        (c[0].wr_id, c[0].opcode, c[0].status),
        (1, WcOpcode::RdmaWrite, WcStatus::Success)
    );
    assert_eq!(
        (c[1].wr_id, c[1].opcode, c[1].status),
        (2, WcOpcode::RdmaRead, WcStatus::Success)
    );
    assert_eq!(b.mr.region().to_vec(1000, 200_000).unwrap(), data);
    assert_eq!(a.mr.region().to_vec(400_000, 200_000).unwrap(), data);
}

#[test]
fn completions_keep_posting_order_across_reads() {
    let (a, b) = pair();
    b.mr.region().write_at(0, &[9u8; 64]).unwrap();
    for i in 0..20u64 {
        if i % 3 == 0 {
            a.post(
                i,
                SendOp::Read {
                    remote: b.mr.remote(0),
                },
                vec![a.mr.sge(64 * i as usize, 64)],
            );
        } else {
            a.post(
                i,
                SendOp::Write {
                    remote: b.mr.remote(4096),
                },
                vec![a.mr.sge(0, 8)],
            );
        }
    }
    let c = a.wait(20);
    let ids: Vec<u64> = c.iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, (0..20).collect::<Vec<_>>());
    assert!(c.iter().all(|w| w.status == WcStatus::Success));
}

#[test]
fn ord_limits_outstanding_reads() {
    let a = Side::new(None);
    let b = Side::new(None);
    let cp = MpaParams {
        ord: 2,
        ..MpaParams::default()
    };
    let sp = MpaParams {
        ird: 2,
        ..MpaParams::default()
    };
    connect_with(&a, &b, cp, sp);
    assert_eq!(a.qp.negotiated().unwrap().ord, 2);
    b.mr.region().write_at(0, b"0123456789abcdef").unwrap();
    for i in 0..16u64 {
        a.post(
            i,
            SendOp::Read {
                remote: b.mr.remote(i as usize),
            },
            vec![a.mr.sge(i as usize, 1)],
        );
    }
    // Had the requester exceeded ORD, the responder (IRD 2) would have
    // terminated the stream and these would be flushed.
    let c = a.wait(16);
    assert!(c.iter().all(|w| w.status == WcStatus::Success), "{c:?}");
    assert_eq!(a.mr.region().to_vec(0, 16).unwrap(), b"0123456789abcdef");
}

#[test]
fn write_with_immediate_and_immediate_data() {
    let (a, b) = pair();
    b.recv(1, 0, 0);
    b.recv(2, 0, 0);
    a.mr.region().write_at(0, b"payload!").unwrap();
    a.post(
        7,
        SendOp::WriteImm {
            remote: b.mr.remote(512),
            imm: 0x1122_3344_5566_7788,
        },
        vec![a.mr.sge(0, 8)],
    );
    a.post(
        8,
        SendOp::Imm {
            imm: u64::MAX - 1,
            solicited: true,
        },
        vec![],
    );
    let c = a.wait(2);
    assert_eq!((c[0].wr_id, c[0].opcode), (7, WcOpcode::RdmaWrite));
    assert_eq!((c[1].wr_id, c[1].opcode), (8, WcOpcode::Imm));
    let r = b.wait(2);
    assert_eq!(
        (r[0].wr_id, r[0].opcode, r[0].imm),
        (1, WcOpcode::RecvImm, Some(0x1122_3344_5566_7788))
    );
    assert_eq!((r[1].imm, r[1].solicited), (Some(u64::MAX - 1), true));
    // The Write was placed before its Immediate Data completed.
    assert_eq!(b.mr.region().to_vec(512, 8).unwrap(), b"payload!");
}

#[test]
fn atomics_plain_and_masked() {
    let (a, b) = pair();
    b.mr.region().store_u64(0, 100).unwrap();
    a.post(
        1,
        SendOp::FetchAdd {
            remote: b.mr.remote(0),
            add: 5,
            mask: 0,
        },
        vec![a.mr.sge(0, 8)],
    );
    a.wait(1);
    assert_eq!(a.mr.region().load_u64(0).unwrap(), 100);
    assert_eq!(b.mr.region().load_u64(0).unwrap(), 105);

    // Masked FetchAdd: two 32-bit lanes, the carry out of the low lane stops.
    b.mr.region().store_u64(8, 0x0000_0001_ffff_ffff).unwrap();
    a.post(
        2,
        SendOp::FetchAdd {
            remote: b.mr.remote(8),
            add: 0x0000_0001_0000_0001,
            mask: 0x8000_0000_8000_0000,
        },
        vec![a.mr.sge(8, 8)],
    );
    a.wait(1);
    assert_eq!(b.mr.region().load_u64(8).unwrap(), 0x0000_0002_0000_0000);

    // CmpSwap, both outcomes.
    let cas = |compare| SendOp::CmpSwap {
        remote: b.mr.remote(0),
        compare,
        compare_mask: u64::MAX,
        swap: 7,
        swap_mask: u64::MAX,
    };
    a.post(3, cas(999), vec![a.mr.sge(16, 8)]);
    a.post(4, cas(105), vec![a.mr.sge(24, 8)]);
    let c = a.wait(2);
    assert_eq!(
        (c[0].opcode, c[1].opcode),
        (WcOpcode::CmpSwap, WcOpcode::CmpSwap)
    );
    assert_eq!(
        a.mr.region().load_u64(16).unwrap(),
        105,
        "failed compare returns the original"
    );
    assert_eq!(a.mr.region().load_u64(24).unwrap(), 105);
    assert_eq!(b.mr.region().load_u64(0).unwrap(), 7);

    // Masked CmpSwap: compare the low byte only, swap the high byte only.
    b.mr.region().store_u64(32, 0x1100_0000_0000_0022).unwrap();
    a.post(
        5,
        SendOp::CmpSwap {
            remote: b.mr.remote(32),
            compare: 0xffff_ffff_ffff_ff22,
            compare_mask: 0xff,
            swap: 0xab00_0000_0000_0000,
            swap_mask: 0xff00_0000_0000_0000,
        },
        vec![a.mr.sge(32, 8)],
    );
    // Swap (draft-03): unconditional, no mask.
    a.post(
        6,
        SendOp::Swap {
            remote: b.mr.remote(40),
            swap: 0xdead_beef,
        },
        vec![a.mr.sge(40, 8)],
    );
    let c = a.wait(2);
    assert_eq!(c[1].opcode, WcOpcode::Swap);
    assert_eq!(b.mr.region().load_u64(32).unwrap(), 0xab00_0000_0000_0022);
    assert_eq!(b.mr.region().load_u64(40).unwrap(), 0xdead_beef);
}

#[test]
fn commit_on_a_durable_region_reaches_the_file() {
    let a = Side::new(None);
    let b = Side::new(None);
    connect_with(&a, &b, MpaParams::default(), MpaParams::default());
    let dir = std::env::temp_dir().join(format!("stag-commit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("log.bin");
    let durable = common::register(&b.pd, Region::file_backed(&path, 1 << 16).unwrap(), ALL);
    a.mr.region().write_at(0, b"committed bytes").unwrap();
    a.post(
        1,
        SendOp::Write {
            remote: durable.remote(4096),
        },
        vec![a.mr.sge(0, 15)],
    );
    a.post(
        2,
        SendOp::Commit {
            remote: durable.remote(4096),
            len: 15,
        },
        vec![],
    );
    let c = a.wait(2);
    assert_eq!(
        (c[1].opcode, c[1].status, c[1].vendor_err),
        (WcOpcode::Commit, WcStatus::Success, 0)
    );
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(&on_disk[4096..4111], b"committed bytes");

    // A commit to a region without flush rights fails with a status and
    // leaves the stream up.
    let plain = common::new_mr(&b.pd, 4096, Access::REMOTE_WRITE);
    a.post(
        3,
        SendOp::Commit {
            remote: plain.remote(0),
            len: 8,
        },
        vec![],
    );
    let c = a.wait(1);
    assert_eq!(c[0].status, WcStatus::RemOpErr);
    assert_ne!(c[0].vendor_err, 0);
    a.post(
        4,
        SendOp::Write {
            remote: durable.remote(0),
        },
        vec![a.mr.sge(0, 4)],
    );
    assert_eq!(a.wait(1)[0].status, WcStatus::Success);
    assert_eq!(a.qp.state(), QpState::Rts);
    drop(durable);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn srq_serves_several_qps() {
    let dev = provider::device::Device::open("srq").unwrap();
    // An SRQ belongs to one PD, and so do the QPs that draw from it.
    let pd = dev.alloc_pd();
    let srq = Arc::new(Srq::new(64, 4));
    let servers: Vec<Side> = (0..3).map(|_| Side::in_pd(&pd, Some(&srq))).collect();
    let clients: Vec<Side> = (0..3).map(|_| Side::new(None)).collect();
    for (c, s) in clients.iter().zip(&servers) {
        connect_with(c, s, MpaParams::default(), MpaParams::default());
    }
    // One pool of buffers in the first server's region.
    for i in 0..6u64 {
        srq.post_recv(provider::wr::RecvWr {
            wr_id: 100 + i,
            sg_list: vec![servers[0].mr.sge(64 * i as usize, 64)],
        })
        .unwrap();
    }
    for (i, c) in clients.iter().enumerate() {
        c.mr.region().write_at(0, &[i as u8; 16]).unwrap();
        c.post(
            i as u64,
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            vec![c.mr.sge(0, 16)],
        );
        c.post(
            i as u64,
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            vec![c.mr.sge(0, 16)],
        );
        c.wait(2);
    }
    let mut ids = Vec::new();
    for s in &servers {
        let r = s.wait(2);
        assert!(r
            .iter()
            .all(|w| w.status == WcStatus::Success && w.byte_len == 16));
        assert!(r.iter().all(|w| w.qp_num == s.qp.qp_num()));
        ids.extend(r.iter().map(|w| w.wr_id));
    }
    ids.sort();
    assert_eq!(ids, (100..106).collect::<Vec<_>>());
    assert!(srq.is_empty());
}

fn p2p(rtr_client: RtrModes, rtr_server: RtrModes, expect: Rtr) {
    let a = Side::new(None);
    let b = Side::new(None);
    let cp = MpaParams {
        p2p: Some(rtr_client),
        ..MpaParams::default()
    };
    let sp = MpaParams {
        p2p: Some(rtr_server),
        ..MpaParams::default()
    };
    b.recv(1, 0, 16);
    connect_with(&a, &b, cp, sp);
    assert_eq!(a.qp.negotiated().unwrap().rtr, Some(expect));
    assert_eq!(b.qp.negotiated().unwrap().rtr, Some(expect));
    // The responder may only send once the RTR arrived.
    b.wait_event(|e| *e == Event::Established);
    b.mr.region().write_at(0, b"from responder").unwrap();
    b.post(
        1,
        SendOp::Write {
            remote: a.mr.remote(0),
        },
        vec![b.mr.sge(0, 14)],
    );
    b.wait(1);
    a.post(
        2,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        vec![a.mr.sge(100, 4)],
    );
    a.wait(1);
    let r = b.wait(1);
    assert_eq!(
        (r[0].wr_id, r[0].byte_len),
        (1, 4),
        "the RTR consumed no receive"
    );
    a.post(
        3,
        SendOp::Read {
            remote: b.mr.remote(0),
        },
        vec![a.mr.sge(64, 14)],
    );
    assert_eq!(a.wait(1)[0].status, WcStatus::Success);
    assert_eq!(a.mr.region().to_vec(0, 14).unwrap(), b"from responder");
}

#[test]
fn peer_to_peer_with_write_rtr() {
    p2p(RtrModes::ALL, RtrModes::ALL, Rtr::ZeroLengthWrite);
}

#[test]
fn peer_to_peer_with_read_rtr() {
    let read = RtrModes {
        read: true,
        ..RtrModes::default()
    };
    p2p(RtrModes::ALL, read, Rtr::ZeroLengthRead);
}

#[test]
fn peer_to_peer_with_send_rtr() {
    let send = RtrModes {
        send: true,
        ..RtrModes::default()
    };
    p2p(send, RtrModes::ALL, Rtr::ZeroLengthSend);
}

fn transfer_with(cp: MpaParams, sp: MpaParams) -> (Side, Side) {
    let a = Side::new(None);
    let b = Side::new(None);
    connect_with(&a, &b, cp, sp);
    let data: Vec<u8> = (0..70_001u32).map(|i| (i % 241) as u8).collect();
    a.mr.region().write_at(0, &data).unwrap();
    b.recv(1, 0, 70_001);
    a.post(
        1,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        vec![a.mr.sge(0, 70_001)],
    );
    a.post(
        2,
        SendOp::Write {
            remote: b.mr.remote(100_000),
        },
        vec![a.mr.sge(0, 70_001)],
    );
    a.post(
        3,
        SendOp::Read {
            remote: b.mr.remote(100_000),
        },
        vec![a.mr.sge(200_000, 70_001)],
    );
    let c = a.wait(3);
    assert!(c.iter().all(|w| w.status == WcStatus::Success), "{c:?}");
    assert_eq!(b.wait(1)[0].byte_len, 70_001);
    assert_eq!(b.mr.region().to_vec(0, 70_001).unwrap(), data);
    assert_eq!(a.mr.region().to_vec(200_000, 70_001).unwrap(), data);
    (a, b)
}

#[test]
fn crc_off_on_both_sides() {
    let off = MpaParams {
        crc: false,
        ..MpaParams::default()
    };
    let (a, _b) = transfer_with(off.clone(), off);
    assert!(!a.qp.negotiated().unwrap().crc);
}

#[test]
fn crc_on_when_either_side_asks() {
    let off = MpaParams {
        crc: false,
        ..MpaParams::default()
    };
    let (a, b) = transfer_with(off, MpaParams::default());
    assert!(a.qp.negotiated().unwrap().crc && b.qp.negotiated().unwrap().crc);
}

#[test]
fn markers_in_both_directions() {
    let m = MpaParams {
        markers: true,
        ..MpaParams::default()
    };
    let (a, b) = transfer_with(m.clone(), m);
    let (na, nb) = (a.qp.negotiated().unwrap(), b.qp.negotiated().unwrap());
    assert!(na.markers_tx && na.markers_rx && nb.markers_tx && nb.markers_rx);
}

#[test]
fn markers_one_way_only() {
    let m = MpaParams {
        markers: true,
        ..MpaParams::default()
    };
    let (a, b) = transfer_with(m, MpaParams::default());
    let (na, nb) = (a.qp.negotiated().unwrap(), b.qp.negotiated().unwrap());
    assert_eq!((na.markers_rx, nb.markers_tx), (true, true));
    assert_eq!((na.markers_tx, nb.markers_rx), (false, false));
}

#[test]
fn mpa_revision_1_peer() {
    let v1 = MpaParams {
        revision: 1,
        ..MpaParams::default()
    };
    let (a, b) = transfer_with(v1, MpaParams::default());
    assert_eq!(a.qp.negotiated().unwrap().revision, 1);
    assert_eq!(b.qp.negotiated().unwrap().revision, 1);
}

#[test]
fn private_data_both_ways_and_reject() {
    let a = Side::new(None);
    let b = Side::new(None);
    let listener = provider::device::Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            let req = listener.accept().unwrap();
            assert_eq!(req.request().private_data, b"who are you");
            req.reject(b"go away").unwrap();
            let req = listener.accept().unwrap();
            let sp = MpaParams {
                private_data: b"welcome".to_vec(),
                ..MpaParams::default()
            };
            req.accept(&b.qp, &sp).unwrap();
        });
        let cp = MpaParams {
            private_data: b"who are you".to_vec(),
            ..MpaParams::default()
        };
        match a.qp.connect(addr, &cp) {
            Err(provider::device::DeviceError::Rejected(pd)) => assert_eq!(pd, b"go away"),
            other => panic!("expected a reject, got {other:?}"),
        }
        assert_eq!(a.qp.connect(addr, &cp).unwrap(), b"welcome");
        h.join().unwrap();
    });
    assert_eq!(b.qp.negotiated().unwrap().peer_private_data, b"who are you");
}

#[test]
fn send_with_invalidate_kills_the_stag() {
    let (a, b) = pair();
    let target = common::new_mr(&b.pd, 4096, ALL);
    b.recv(1, 0, 16);
    a.post(
        1,
        SendOp::Send {
            solicited: false,
            invalidate: Some(target.stag()),
        },
        vec![a.mr.sge(0, 4)],
    );
    a.wait(1);
    let r = b.wait(1);
    assert_eq!(r[0].invalidated_rkey, Some(target.stag()));
    assert!(!b.dev.mem().is_valid(target.stag()));
}

// ---- error paths ----

/// Assert the cause on both sides: the detecting side sent it, the other
/// received it, both QPs are in Error.
fn assert_terminated(detector: &Side, other: &Side, etype: ErrorType, ecode: u8) {
    let sent = detector.wait_event(|e| matches!(e, Event::TerminateSent(_)));
    let got = other.wait_event(|e| matches!(e, Event::TerminateReceived(_)));
    for e in [sent, got] {
        let (Event::TerminateSent(c) | Event::TerminateReceived(c)) = e else {
            unreachable!()
        };
        assert_eq!((c.etype, c.ecode), (etype, ecode), "{c:?}");
    }
    assert_eq!(detector.qp.state(), QpState::Error);
    assert_eq!(other.qp.state(), QpState::Error);
}

#[test]
fn write_to_bad_stag_is_terminated_and_flushes() {
    let (a, b) = pair();
    b.recv(1, 0, 8);
    b.recv(2, 0, 8);
    let bad = provider::wr::Remote {
        addr: b.mr.region().addr(0),
        rkey: b.mr.stag() ^ 0xff,
    };
    a.post(1, SendOp::Write { remote: bad }, vec![a.mr.sge(0, 8)]);
    assert_terminated(&b, &a, ErrorType::DdpTagged, 0x00);
    // Both posted receives flush, exactly once each.
    let r = b.wait(2);
    assert!(r.iter().all(|w| w.status == WcStatus::WrFlushErr));
    assert_eq!(b.cq.len(), 0);
    // Later WRs complete with a flush error too.
    a.wait(1);
    a.post(
        9,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        vec![],
    );
    let c = a.wait(1);
    assert_eq!((c[0].wr_id, c[0].status), (9, WcStatus::WrFlushErr));
}

#[test]
fn write_out_of_bounds_is_terminated() {
    let (a, b) = pair();
    let small = common::new_mr(&b.pd, 4096, ALL);
    a.post(
        1,
        SendOp::Write {
            remote: small.remote(4090),
        },
        vec![a.mr.sge(0, 16)],
    );
    assert_terminated(&b, &a, ErrorType::DdpTagged, 0x01);
}

#[test]
fn write_without_rights_is_terminated() {
    let (a, b) = pair();
    let ro = common::new_mr(&b.pd, 4096, Access::REMOTE_READ);
    a.post(
        1,
        SendOp::Write {
            remote: ro.remote(0),
        },
        vec![a.mr.sge(0, 16)],
    );
    let sent = b.wait_event(|e| matches!(e, Event::TerminateSent(_)));
    let Event::TerminateSent(c) = sent else {
        unreachable!()
    };
    assert_eq!(c.layer(), Layer::Rdmap, "{c:?}");
    assert_eq!((c.etype, c.ecode), (ErrorType::RdmapRemoteProtection, 0x02));
}

#[test]
fn write_to_another_pd_is_terminated() {
    let (a, b) = pair();
    let other_pd = b.dev.alloc_pd();
    let foreign = common::new_mr(&other_pd, 4096, ALL);
    a.post(
        1,
        SendOp::Write {
            remote: foreign.remote(0),
        },
        vec![a.mr.sge(0, 16)],
    );
    assert_terminated(&b, &a, ErrorType::DdpTagged, 0x02);
}

#[test]
fn read_of_bad_stag_fails_the_read() {
    let (a, b) = pair();
    // An index no test allocates: 0x100 (index 1, key 0) was b's own MR
    // whenever its random key came out 0, one run in 256, and the Read then
    // succeeded.
    let bad = provider::wr::Remote {
        addr: b.mr.region().addr(0),
        rkey: 0x7fff_ff00,
    };
    a.post(1, SendOp::Read { remote: bad }, vec![a.mr.sge(0, 8)]);
    a.post(
        2,
        SendOp::Read {
            remote: b.mr.remote(0),
        },
        vec![a.mr.sge(0, 8)],
    );
    let c = a.wait(2);
    assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::RemAccessErr));
    assert_eq!((c[1].wr_id, c[1].status), (2, WcStatus::WrFlushErr));
    assert_terminated(&b, &a, ErrorType::RdmapRemoteProtection, 0x00);
}

#[test]
fn send_without_receive_is_terminated() {
    let (a, b) = pair();
    a.post(
        1,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        vec![a.mr.sge(0, 8)],
    );
    assert_terminated(&b, &a, ErrorType::DdpUntagged, 0x02);
}

#[test]
fn send_too_long_for_the_buffer_is_terminated() {
    let (a, b) = pair();
    b.recv(1, 0, 4);
    a.post(
        1,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        vec![a.mr.sge(0, 8)],
    );
    assert_terminated(&b, &a, ErrorType::DdpUntagged, 0x05);
    let r = b.wait(1);
    assert_eq!(r[0].status, WcStatus::WrFlushErr);
}

#[test]
fn misaligned_atomic_is_terminated_and_memory_untouched() {
    let (a, b) = pair();
    b.mr.region().write_at(0, &[0u8; 16]).unwrap();
    a.post(
        1,
        SendOp::FetchAdd {
            remote: b.mr.remote(4),
            add: 1,
            mask: 0,
        },
        vec![a.mr.sge(0, 8)],
    );
    let c = a.wait(1);
    assert_eq!(c[0].status, WcStatus::RemOpErr);
    let sent = b.wait_event(|e| matches!(e, Event::TerminateSent(_)));
    let Event::TerminateSent(cause) = sent else {
        unreachable!()
    };
    assert_eq!(
        cause,
        provider::wire::Error::AtomicMisaligned.terminate_cause()
    );
    assert_eq!(b.mr.region().to_vec(0, 16).unwrap(), [0u8; 16]);
}

#[test]
fn atomic_without_rights_is_refused() {
    let (a, b) = pair();
    let ro = common::new_mr(&b.pd, 4096, Access::REMOTE_READ | Access::REMOTE_WRITE);
    a.post(
        1,
        SendOp::CmpSwap {
            remote: ro.remote(0),
            compare: 0,
            compare_mask: u64::MAX,
            swap: 1,
            swap_mask: u64::MAX,
        },
        vec![a.mr.sge(0, 8)],
    );
    assert_eq!(a.wait(1)[0].status, WcStatus::RemAccessErr);
    assert_eq!(ro.region().load_u64(0).unwrap(), 0);
}

#[test]
fn peer_disconnect_flushes_outstanding_work() {
    let (a, b) = pair();
    a.recv(1, 0, 8);
    a.recv(2, 0, 8);
    // A Read that will never be answered: the peer goes away first.
    drop(b);
    a.post(
        3,
        SendOp::Read {
            remote: a.mr.remote(0),
        },
        vec![a.mr.sge(64, 8)],
    );
    let mut c = a.wait(3);
    c.sort_by_key(|w| w.wr_id);
    assert!(c.iter().all(|w| w.status == WcStatus::WrFlushErr), "{c:?}");
    assert_eq!(c.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [1, 2, 3]);
    a.wait_event(|e| *e == Event::Closed);
    assert_eq!(a.qp.state(), QpState::Error);
}

#[test]
fn local_protection_error_fails_the_wr() {
    let (a, _b) = pair();
    let mut sge = a.mr.sge(0, 8);
    sge.lkey ^= 0x55;
    a.post(
        1,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        vec![sge],
    );
    let c = a.wait(1);
    assert_eq!(c[0].status, WcStatus::LocProtErr);
    assert_eq!(a.qp.state(), QpState::Error);
}

/// `QueuePair::post_list` queues and rings under one lock: a WR refused
/// halfway down the list reports its index, and the WRs before it still
/// leave, with nobody posting or polling the sender again.
#[test]
fn a_post_list_refused_halfway_sends_what_went_before() {
    use provider::wr::{ListWr, SendWrRef};
    let (a, b) = pair();
    b.recv(1, 0, 64);
    a.mr.region().write_at(0, b"before the refusal").unwrap();
    let send = [a.mr.sge(0, 18)];
    // An atomic's result takes one 8-octet SGE: this one is refused.
    let short = [a.mr.sge(4096, 4)];
    let wr = |wr_id, op, sg_list| {
        ListWr::Send(SendWrRef {
            wr_id,
            op,
            sg_list,
            signaled: true,
            fence: false,
        })
    };
    let list = [
        wr(
            10,
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            &send[..],
        ),
        wr(11, SendOp::fetch_add(b.mr.remote(64), 1), &short[..]),
        wr(
            12,
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            &send[..],
        ),
    ];
    let (_, index) = a.qp.post_list(list).expect_err("the atomic is refused");
    assert_eq!(index, 1);
    // Only the receiver polls.
    let r = b.wait(1);
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].byte_len),
        (1, WcStatus::Success, 18)
    );
    assert_eq!(b.mr.region().to_vec(0, 18).unwrap(), b"before the refusal");
    let s = a.wait(1);
    assert_eq!((s[0].wr_id, s[0].status), (10, WcStatus::Success));
    assert_eq!(a.cq.poll(&mut [provider::wr::WorkCompletion::BLANK; 4]), 0);
}
