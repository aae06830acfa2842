//! Support for the receive-path fuzz target (`fuzz/fuzz_targets/conn_rx.rs`)
//! and its seed corpus. Not a stable API.
//!
//! The caller owns the memory: it registers the middle of a [`Region`] of
//! [`REGION_LEN`] bytes at [`IOVA`] (leaving [`CANARY`] bytes unregistered
//! on each side) until the table hands out [`STAG`], so that seeds can name
//! it. [`run`] then drives one [`Connection`] with an input and panics on
//! any broken invariant.

use crate::mem::{Access, MrTable, PdId};
use crate::qp::{Connection, CqSide, Env, Event, QpCaps, QpState};
use crate::region::Region;
use crate::setup::{Answer, Initiator, MpaParams, Request, RtrModes};
use crate::wire::atomic::AtomicOpcode;
use crate::wire::rdmap::{RdmapRepr, SendKind};
use crate::wire::stream::{Deframer, DeframerConfig, Framer, FramerConfig};
use crate::wire::terminate::TerminateRepr;
use crate::wire::{ErrorType, TerminateCause};
use crate::wr::{RecvWr, Remote, SendOp, SendWr, Sge};

/// Unregistered guard bytes on each side of the registered middle.
pub const CANARY: usize = 64;
/// The registered middle.
pub const MIDDLE: usize = 1024;
/// The whole region: canary, middle, canary.
pub const REGION_LEN: usize = CANARY + MIDDLE + CANARY;
/// The guard byte value.
pub const CANARY_BYTE: u8 = 0xc5;
/// The iova the middle is registered at.
pub const IOVA: u64 = 0x4000;
/// The STag the caller must obtain (index 1, key 0xa5).
pub const STAG: u32 = 0x0000_01a5;
/// The protection domain.
pub const PD: PdId = 1;
/// The rights of the middle.
pub const ACCESS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC)
    .union(Access::FLUSH_PERSISTENT)
    .union(Access::REMOTE_INVALIDATE);

/// The peer's STag our posted Read, atomic and Commit name.
pub const PEER_STAG: u32 = 0x77;
/// Where they point at the peer.
pub const PEER_TO: u64 = 0x9000;

/// Input flags (first byte).
pub mod flags {
    /// Both sides ask for CRC.
    pub const CRC: u8 = 1;
    /// We ask the peer for markers (it inserts them in what we receive).
    pub const MARKERS: u8 = 1 << 1;
    /// We are the MPA responder (else the initiator).
    pub const RESPONDER: u8 = 1 << 2;
    /// Peer-to-peer model in bits 3-4: 1 Write, 2 Read, 3 Send RTR.
    pub const P2P_SHIFT: u8 = 3;
    /// Our IRD is 1 instead of 4.
    pub const SMALL_IRD: u8 = 1 << 5;
    /// Our QP runs RFC 5040 only (no Atomics, Immediate Data or Commit):
    /// posting those fails, and a peer's draw a Terminate.
    pub const RFC5040_ONLY: u8 = 1 << 6;
}

fn sge(off: usize, len: u32) -> Sge {
    Sge {
        addr: IOVA + off as u64,
        length: len,
        lkey: STAG,
    }
}

/// The parameters both sides use for `f`.
fn params(f: u8) -> (MpaParams, MpaParams) {
    let p2p = match (f >> flags::P2P_SHIFT) & 3 {
        0 => None,
        1 => Some(RtrModes {
            write: true,
            ..RtrModes::default()
        }),
        2 => Some(RtrModes {
            read: true,
            ..RtrModes::default()
        }),
        _ => Some(RtrModes {
            send: true,
            ..RtrModes::default()
        }),
    };
    let ours = MpaParams {
        crc: f & flags::CRC != 0,
        markers: f & flags::MARKERS != 0,
        ird: if f & flags::SMALL_IRD != 0 { 1 } else { 4 },
        ord: 4,
        p2p,
        ..MpaParams::default()
    };
    let peer = MpaParams {
        crc: f & flags::CRC != 0,
        markers: false,
        ird: 4,
        ord: 4,
        p2p,
        ..MpaParams::default()
    };
    (ours, peer)
}

/// Our connection after a real MPA exchange for flags `f`.
fn connect(f: u8) -> Connection {
    let (ours, peer) = params(f);
    let (local, remote) = if f & flags::RESPONDER != 0 {
        (peer, ours)
    } else {
        (ours, peer)
    };
    // `local` initiates; we are whichever side `ours` ended up on.
    let (mut init, request) = Initiator::new(local).expect("request");
    let mut input = &request[..];
    let req = Request::reader()
        .read(&mut input)
        .expect("valid request")
        .map(|r| Request::from_repr(&r))
        .expect("whole request");
    let (resp_neg, reply) = req.accept(&remote).expect("accepted");
    let mut input = &reply[..];
    let Some(Answer::Accepted(init_neg)) = init.handle_bytes(&mut input).expect("reply") else {
        panic!("rejected");
    };
    let neg = if f & flags::RESPONDER != 0 {
        resp_neg
    } else {
        init_neg
    };
    Connection::new(
        7,
        PD,
        QpCaps {
            max_segment: 512,
            rdmap_extensions: f & flags::RFC5040_ONLY == 0,
            ..QpCaps::default()
        },
        neg,
        false,
    )
}

/// The WR ids [`run`] posts (sends, then receives).
pub const SEND_IDS: [u64; 4] = [10, 11, 12, 13];
/// Receive WR ids.
pub const RECV_IDS: [u64; 3] = [1, 2, 3];

/// What one run saw.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Completions with status Success, by wr_id, in order.
    pub succeeded: Vec<u64>,
    /// The Terminate we sent, if any.
    pub sent: Option<TerminateCause>,
    /// The Terminate the peer sent, if any.
    pub received: Option<TerminateCause>,
    /// Frames we transmitted.
    pub frames: usize,
}

/// Feed `data` (`[flags, chunk, stream...]`) to a fresh connection over
/// `mem` (which must hold [`STAG`] over the middle of `region`) and check
/// the invariants: no panic, canaries intact, every error we detect goes
/// out as a Terminate naming it, everything we transmit parses, every WR
/// completes exactly once after the stream closes.
pub fn run(mem: &MrTable, region: &Region, data: &[u8]) -> Outcome {
    let (f, chunk, stream) = match data {
        [f, c, rest @ ..] => (*f, *c as usize, rest),
        _ => return Outcome::default(),
    };
    // Reset the memory: canaries, then zeroes.
    region.write_at(0, &[CANARY_BYTE; CANARY]).expect("canary");
    region.write_at(CANARY, &[0u8; MIDDLE]).expect("middle");
    region
        .write_at(CANARY + MIDDLE, &[CANARY_BYTE; CANARY])
        .expect("canary");
    assert!(
        mem.is_valid(STAG),
        "caller must register the middle as STAG"
    );

    let mut conn = connect(f);
    let env = Env { mem, srq: None };
    for (id, wr) in RECV_IDS
        .iter()
        .zip([vec![sge(256, 256)], vec![sge(512, 16)], vec![]])
    {
        conn.post_recv(RecvWr {
            wr_id: *id,
            sg_list: wr,
        })
        .expect("recv");
    }
    let remote = Remote {
        addr: PEER_TO,
        rkey: PEER_STAG,
    };
    let ops = [
        (SendOp::Read { remote }, vec![sge(0, 64)]),
        (
            SendOp::FetchAdd {
                remote: Remote {
                    addr: PEER_TO + 8,
                    ..remote
                },
                add: 1,
                mask: 0,
            },
            vec![sge(128, 8)],
        ),
        (SendOp::Commit { remote, len: 64 }, vec![]),
        (
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            vec![sge(600, 16)],
        ),
    ];
    let rfc5040_only = f & flags::RFC5040_ONLY != 0;
    let mut posted = Vec::new();
    for (id, (op, sg_list)) in SEND_IDS.iter().zip(ops) {
        let extension = matches!(op, SendOp::FetchAdd { .. } | SendOp::Commit { .. });
        let r = conn.post_send(
            SendWr {
                wr_id: *id,
                op,
                sg_list,
                signaled: true,
                fence: false,
            },
            &env,
        );
        if rfc5040_only && extension {
            assert!(matches!(r, Err(crate::qp::PostError::Invalid(_))), "{r:?}");
        } else {
            r.expect("post");
            posted.push(*id);
        }
    }

    let mut out = Vec::new();
    let mut completions = Vec::new();
    let mut events = Vec::new();
    let mut pump = |conn: &mut Connection, out: &mut Vec<u8>| {
        for _ in 0..64 {
            if !conn.poll_transmit(&env, out, 1 << 16) {
                match conn.poll_durability() {
                    Some(job) => conn.handle_commit_done(job.req_id, job.run(env.mem)),
                    None => break,
                }
            }
        }
        while let Some(c) = conn.poll_completion() {
            completions.push(c);
        }
        while let Some(e) = conn.poll_event() {
            events.push(e);
        }
    };
    pump(&mut conn, &mut out);
    let size = if chunk == 0 {
        stream.len().max(1)
    } else {
        chunk
    };
    for piece in stream.chunks(size) {
        conn.handle_bytes(piece, &env);
        pump(&mut conn, &mut out);
    }
    let before_close = conn.state();
    conn.handle_closed();
    pump(&mut conn, &mut out);

    // Canaries intact.
    let mut guard = [0u8; CANARY];
    region.read_at(0, &mut guard).expect("canary");
    assert!(guard.iter().all(|&b| b == CANARY_BYTE), "front canary hit");
    region.read_at(CANARY + MIDDLE, &mut guard).expect("canary");
    assert!(guard.iter().all(|&b| b == CANARY_BYTE), "back canary hit");

    // Everything we sent parses; a Terminate we sent is the last frame.
    let neg = conn.negotiated().clone();
    let mut deframer = Deframer::new(DeframerConfig {
        crc: neg.crc,
        markers: neg.markers_tx,
        max_ulpdu_len: u16::MAX,
    });
    let mut input = &out[..];
    let mut frames = Vec::new();
    while let Some(u) = deframer.poll(&mut input).expect("our own stream deframes") {
        let (repr, _) = RdmapRepr::parse(&u).expect("our own frames parse");
        frames.push(repr);
    }
    assert!(input.is_empty() && deframer.is_idle(), "a partial frame");
    let sent = events.iter().find_map(|e| match e {
        Event::TerminateSent(c) => Some(*c),
        _ => None,
    });
    let received = events.iter().find_map(|e| match e {
        Event::TerminateReceived(c) => Some(*c),
        _ => None,
    });
    if let Some(cause) = sent {
        assert_eq!(before_close, QpState::Error);
        match frames.last() {
            Some(RdmapRepr::Terminate(t)) => assert_eq!(t.cause, cause),
            other => panic!("error {cause:?} without a Terminate (last frame {other:?})"),
        }
    }
    let terminates = frames
        .iter()
        .filter(|r| matches!(r, RdmapRepr::Terminate(_)))
        .count();
    assert_eq!(
        terminates,
        usize::from(sent.is_some()),
        "one Terminate at most"
    );
    if before_close == QpState::Error {
        assert!(
            sent.is_some() || received.is_some(),
            "Error state without a Terminate either way"
        );
    }

    // Every WR completed exactly once, on the right CQ.
    for (side, ids) in [(CqSide::Send, &posted[..]), (CqSide::Recv, &RECV_IDS[..])] {
        let mut got: Vec<u64> = completions
            .iter()
            .filter(|(s, _)| *s == side)
            .map(|(_, c)| c.wr_id)
            .collect();
        got.sort_unstable();
        assert_eq!(got, ids, "{side:?} completions {completions:?}");
    }
    Outcome {
        succeeded: completions
            .iter()
            .filter(|(_, c)| c.status == crate::wr::WcStatus::Success)
            .map(|(_, c)| c.wr_id)
            .collect(),
        sent,
        received,
        frames: frames.len(),
    }
}

/// Valid peer streams for each opcode, as fuzz inputs (`name`, bytes).
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    struct Peer {
        framer: Framer,
        out: Vec<u8>,
    }
    impl Peer {
        fn new(f: u8) -> Peer {
            Peer {
                framer: Framer::new(FramerConfig {
                    crc: f & flags::CRC != 0,
                    markers: f & flags::MARKERS != 0,
                }),
                out: Vec::new(),
            }
        }
        fn put(&mut self, repr: RdmapRepr, payload: &[u8]) -> &mut Peer {
            let mut header = vec![0u8; repr.header_len()];
            repr.emit(&mut header);
            self.framer
                .frame(&[&header, payload], &mut self.out)
                .expect("frame");
            self
        }
    }
    let send = |msn, mo, last| RdmapRepr::Send {
        kind: SendKind::Send,
        last,
        msn,
        mo,
        invalidate_stag: 0,
    };
    let read_resp = |p: &mut Peer| {
        p.put(
            RdmapRepr::ReadResponse {
                last: false,
                stag: STAG,
                to: IOVA,
            },
            &[0x11; 40],
        )
        .put(
            RdmapRepr::ReadResponse {
                last: true,
                stag: STAG,
                to: IOVA + 40,
            },
            &[0x22; 24],
        );
    };
    let atomic_resp = |p: &mut Peer| {
        p.put(
            RdmapRepr::AtomicResponse {
                msn: 1,
                req_id: 1,
                original: 42,
            },
            &[],
        );
    };
    let commit_resp = |p: &mut Peer| {
        p.put(
            RdmapRepr::CommitResponse {
                msn: 2,
                req_id: 2,
                status: 0,
            },
            &[],
        );
    };
    let requests = |p: &mut Peer| {
        p.put(
            RdmapRepr::ReadRequest {
                msn: 1,
                sink_stag: 0x55,
                sink_to: 0,
                size: 32,
                src_stag: STAG,
                src_to: IOVA,
            },
            &[],
        )
        .put(
            RdmapRepr::AtomicRequest {
                msn: 2,
                opcode: AtomicOpcode::FetchAdd,
                req_id: 9,
                stag: STAG,
                to: IOVA + 256,
                add_swap: 3,
                add_swap_mask: 0,
                compare: 0,
                compare_mask: u64::MAX,
            },
            &[],
        );
    };
    let all = |f: u8| {
        let mut p = Peer::new(f);
        // A responder sends its WRs once the RTR is in: deliver the RTR
        // alone first (chunks of its size), so the responses that follow
        // answer requests that went out.
        let mut chunk = 0u8;
        if (f >> flags::P2P_SHIFT) & 3 == 1 && f & flags::RESPONDER != 0 {
            p.put(
                RdmapRepr::Write {
                    last: true,
                    stag: 1,
                    to: 0,
                },
                &[],
            );
            chunk = p.out.len() as u8;
        }
        p.put(send(1, 0, false), &[b'a'; 100])
            .put(send(1, 100, true), b"tail")
            .put(
                RdmapRepr::Send {
                    kind: SendKind::SendSe,
                    last: true,
                    msn: 2,
                    mo: 0,
                    invalidate_stag: 0,
                },
                &[7; 16],
            )
            .put(
                RdmapRepr::Write {
                    last: true,
                    stag: STAG,
                    to: IOVA + 700,
                },
                &[0x33; 64],
            );
        read_resp(&mut p);
        atomic_resp(&mut p);
        commit_resp(&mut p);
        requests(&mut p);
        p.put(
            RdmapRepr::CommitRequest {
                msn: 3,
                req_id: 10,
                stag: STAG,
                len: 64,
                to: IOVA,
                invalidate_stag: 0,
            },
            &[],
        )
        .put(RdmapRepr::ImmediateData { se: true, msn: 3 }, &[1; 8]);
        let mut v = vec![f, chunk];
        v.extend(p.out);
        v
    };
    let one = |f: u8, build: &dyn Fn(&mut Peer)| {
        let mut p = Peer::new(f);
        build(&mut p);
        let mut v = vec![f, 0];
        v.extend(p.out);
        v
    };
    let crc = flags::CRC;
    let mut out = vec![
        (
            "send",
            one(crc, &|p| {
                p.put(send(1, 0, true), b"hello");
            }),
        ),
        (
            "send_invalidate",
            one(crc, &|p| {
                p.put(
                    RdmapRepr::Send {
                        kind: SendKind::SendSeInvalidate,
                        last: true,
                        msn: 1,
                        mo: 0,
                        invalidate_stag: STAG,
                    },
                    b"bye",
                );
            }),
        ),
        (
            "write",
            one(crc, &|p| {
                p.put(
                    RdmapRepr::Write {
                        last: true,
                        stag: STAG,
                        to: IOVA + 8,
                    },
                    &[9; 100],
                );
            }),
        ),
        ("read_response", one(crc, &|p| read_resp(p))),
        (
            "atomic_response",
            one(crc, &|p| {
                read_resp(p);
                atomic_resp(p);
            }),
        ),
        (
            "commit_response",
            one(crc, &|p| {
                read_resp(p);
                atomic_resp(p);
                commit_resp(p);
            }),
        ),
        ("requests", one(crc, &|p| requests(p))),
        (
            "immediate",
            one(crc, &|p| {
                p.put(RdmapRepr::ImmediateData { se: false, msn: 1 }, &[5; 8]);
            }),
        ),
        (
            "rfc5040_refuses_requests",
            one(crc | flags::RFC5040_ONLY, &|p| requests(p)),
        ),
        (
            "terminate",
            one(crc, &|p| {
                let mut t = TerminateRepr::for_error(&crate::wire::Error::MsnRange(3), None);
                t.msn = 1;
                p.put(RdmapRepr::Terminate(t), &[]);
            }),
        ),
        ("all_crc", all(crc)),
        ("all_nocrc", all(0)),
        ("all_markers", all(crc | flags::MARKERS)),
        (
            "all_p2p_write_responder",
            all(crc | flags::RESPONDER | 1 << flags::P2P_SHIFT),
        ),
    ];
    let mut chunked = all(crc);
    chunked[1] = 7;
    out.push(("all_chunked", chunked));
    out
}

/// The error type a seed named `terminate` carries (for tests).
pub const SEED_TERMINATE: ErrorType = ErrorType::DdpUntagged;
