//! The phase machine and the Commit hand-off, driven through the public
//! sans-IO API between two connections.

use std::ptr::NonNull;

use super::*;
use crate::mem::Access;
use crate::wire::rdmap::RdmapRepr;
use crate::wire::stream::{Deframer, DeframerConfig};
use crate::wr::Remote;

const PD: PdId = 1;

fn negotiated(initiator: bool, rtr: Option<Rtr>) -> Negotiated {
    Negotiated {
        initiator,
        revision: 2,
        crc: true,
        markers_tx: false,
        markers_rx: false,
        ird: 8,
        ord: 8,
        rtr,
        peer_private_data: Vec::new(),
    }
}

fn pair(rtr: Option<Rtr>) -> (Connection, Connection) {
    pair_with(QpCaps::default(), rtr)
}

/// [`pair`] with `caps` on both ends.
fn pair_with(caps: QpCaps, rtr: Option<Rtr>) -> (Connection, Connection) {
    (
        Connection::new(1, PD, caps, negotiated(true, rtr), false),
        Connection::new(2, PD, caps, negotiated(false, rtr), false),
    )
}

/// [`pair`] with one Read or atomic outstanding at a time (ORD and IRD 1).
fn pair_of_one_credit() -> (Connection, Connection) {
    let one = |initiator| Negotiated {
        ord: 1,
        ird: 1,
        ..negotiated(initiator, None)
    };
    let caps = QpCaps::default();
    (
        Connection::new(1, PD, caps, one(true), false),
        Connection::new(2, PD, caps, one(false), false),
    )
}

/// Everything `c` has to send now (no commit performed).
fn transmit(c: &mut Connection, mem: &MrTable) -> Vec<u8> {
    let env = Env { mem, srq: None };
    let mut out = Vec::new();
    while c.poll_transmit(&env, &mut out, 1 << 20) {}
    out
}

fn deliver(bytes: &[u8], to: &mut Connection, mem: &MrTable) {
    to.handle_bytes(bytes, &Env { mem, srq: None });
}

/// The RDMAP messages in `bytes`.
fn frames(bytes: &[u8]) -> Vec<RdmapRepr> {
    let mut d = Deframer::new(DeframerConfig {
        crc: true,
        markers: false,
        max_ulpdu_len: u16::MAX,
    });
    let mut input = bytes;
    let mut out = Vec::new();
    while let Some(u) = d.poll(&mut input).expect("deframes") {
        out.push(RdmapRepr::parse(&u).expect("parses").0);
    }
    out
}

fn events(c: &mut Connection) -> Vec<Event> {
    std::iter::from_fn(|| c.poll_event()).collect()
}

fn completions(c: &mut Connection) -> Vec<(CqSide, WorkCompletion)> {
    std::iter::from_fn(|| c.poll_completion()).collect()
}

/// A registered buffer (leaked for the test's lifetime, so the
/// registration can never outlive it).
fn region(mem: &MrTable, len: usize, access: Access) -> (u32, u64) {
    let buf: &'static mut [u8] = Box::leak(vec![0u8; len].into_boxed_slice());
    let base = NonNull::new(buf.as_mut_ptr()).expect("non-null");
    let va = base.as_ptr() as u64;
    // SAFETY: the buffer is leaked, so it stays valid forever.
    let stag = unsafe { mem.register(PD, base, va, len as u64, access, false) }.expect("register");
    (stag, va)
}

/// A signaled Send of `len` octets at `addr` in region `lkey`.
fn send_wr(wr_id: u64, lkey: u32, addr: u64, len: u32) -> SendWr {
    SendWr {
        wr_id,
        op: SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        sg_list: vec![Sge {
            addr,
            length: len,
            lkey,
        }],
        signaled: true,
        fence: false,
    }
}

/// A Receive of up to `len` octets into `addr` in region `lkey`.
fn recv_wr(wr_id: u64, lkey: u32, addr: u64, len: u32) -> RecvWr {
    RecvWr {
        wr_id,
        sg_list: vec![Sge {
            addr,
            length: len,
            lkey,
        }],
    }
}

#[test]
fn client_server_is_running_from_the_start() {
    let (a, b) = pair(None);
    for mut c in [a, b] {
        assert_eq!(c.phase, Phase::Running);
        assert_eq!(c.state(), QpState::Rts);
        assert_eq!(events(&mut c), [Event::Established]);
        assert!(!c.wants_close());
    }
}

#[test]
fn read_rtr_holds_an_ord_credit_until_its_response() {
    let mem = MrTable::new();
    let (mut a, mut b) = pair(Some(Rtr::ZeroLengthRead));
    assert_eq!(a.phase, Phase::SendRtr(Rtr::ZeroLengthRead));
    assert_eq!(a.state(), QpState::Rts);
    assert_eq!(b.phase, Phase::AwaitRtr(Rtr::ZeroLengthRead));
    assert_eq!(b.state(), QpState::Rtr);
    assert!(events(&mut b).is_empty());
    assert!(a.has_pending_tx() && !b.has_pending_tx());
    // The responder says nothing before the RTR.
    assert!(transmit(&mut b, &mem).is_empty());

    let rtr = transmit(&mut a, &mem);
    assert!(matches!(
        frames(&rtr)[..],
        [RdmapRepr::ReadRequest { size: 0, .. }]
    ));
    assert_eq!((a.phase, a.ord_used), (Phase::AwaitRtrResponse, 1));
    deliver(&rtr, &mut b, &mem);
    assert_eq!(b.phase, Phase::Running);
    assert_eq!(events(&mut b), [Event::Established]);

    let response = transmit(&mut b, &mem);
    assert!(matches!(
        frames(&response)[..],
        [RdmapRepr::ReadResponse { last: true, .. }]
    ));
    deliver(&response, &mut a, &mem);
    assert_eq!((a.phase, a.ord_used), (Phase::Running, 0));
    assert!(completions(&mut a).is_empty(), "the RTR is no WR");
}

#[test]
fn write_and_send_rtr_go_straight_to_running() {
    let mem = MrTable::new();
    for rtr in [Rtr::ZeroLengthWrite, Rtr::ZeroLengthSend] {
        let (mut a, mut b) = pair(Some(rtr));
        let bytes = transmit(&mut a, &mem);
        assert_eq!(a.phase, Phase::Running);
        deliver(&bytes, &mut b, &mem);
        assert_eq!(b.phase, Phase::Running, "{rtr:?}");
        assert!(completions(&mut b).is_empty(), "the RTR takes no receive");
    }
}

#[test]
fn wrong_rtr_terminates_then_closes() {
    let mem = MrTable::new();
    let (_, mut b) = pair(Some(Rtr::ZeroLengthWrite));
    let (mut a, _) = pair(Some(Rtr::ZeroLengthSend));
    deliver(&transmit(&mut a, &mem), &mut b, &mem);
    assert_eq!(b.phase, Phase::Closing);
    assert_eq!(b.state(), QpState::Error);
    assert!(!b.wants_close(), "the Terminate drains first");
    assert!(matches!(
        frames(&transmit(&mut b, &mem))[..],
        [RdmapRepr::Terminate(_)]
    ));
    assert!(b.wants_close());
    b.handle_closed();
    assert_eq!(b.phase, Phase::Closed);
    assert!(b.wants_close() && !b.has_pending_tx());
    let evs = events(&mut b);
    assert!(
        matches!(evs[..], [Event::TerminateSent(_), Event::Closed]),
        "{evs:?}"
    );
}

#[test]
fn set_error_closes_without_a_terminate() {
    let mem = MrTable::new();
    let (mut a, _) = pair(None);
    a.set_error();
    assert_eq!(a.phase, Phase::Closing);
    assert!(transmit(&mut a, &mem).is_empty());
    assert!(a.wants_close());
    // A post in Error completes with a flush error.
    a.post_recv(RecvWr {
        wr_id: 7,
        sg_list: Vec::new(),
    })
    .expect("accepted");
    let c = completions(&mut a);
    assert_eq!((c[0].1.wr_id, c[0].1.status), (7, WcStatus::WrFlushErr));
}

/// A posts a Commit of `commit_stag` then a Read of `read` (16 bytes).
fn commit_then_read(a: &mut Connection, mem: &MrTable, commit_stag: u32, read: (u32, u64)) {
    let env = Env { mem, srq: None };
    let (sink, sink_va) = region(mem, 16, Access::LOCAL_WRITE);
    a.post_send(
        SendWr {
            wr_id: 1,
            op: SendOp::Commit {
                remote: Remote {
                    addr: read.1,
                    rkey: commit_stag,
                },
                len: 8,
            },
            sg_list: Vec::new(),
            signaled: true,
            fence: false,
        },
        &env,
    )
    .expect("commit");
    a.post_send(
        SendWr {
            wr_id: 2,
            op: SendOp::Read {
                remote: Remote {
                    addr: read.1,
                    rkey: read.0,
                },
            },
            sg_list: vec![Sge {
                addr: sink_va,
                length: 16,
                lkey: sink,
            }],
            signaled: true,
            fence: false,
        },
        &env,
    )
    .expect("read");
}

#[test]
fn a_pending_commit_holds_back_a_later_read_response() {
    let mem = MrTable::new();
    let (mut a, mut b) = pair(None);
    let (src, va) = region(&mem, 16, Access::REMOTE_READ | Access::FLUSH_PERSISTENT);
    commit_then_read(&mut a, &mem, src, (src, va));
    deliver(&transmit(&mut a, &mem), &mut b, &mem);

    // Nothing goes out until the driver has performed the commit.
    assert!(b.has_pending_tx());
    assert!(transmit(&mut b, &mem).is_empty());
    let job = b.poll_durability().expect("a commit job");
    assert_eq!((job.stag, job.to, job.len, job.pd), (src, va, 8, PD));
    assert!(b.poll_durability().is_none(), "one job at a time");
    assert!(!b.has_pending_tx(), "waiting for the driver");
    assert!(transmit(&mut b, &mem).is_empty(), "the Read Response waits");
    // A stale or unknown completion changes nothing.
    b.handle_commit_done(job.req_id.wrapping_add(1), 0);
    assert!(transmit(&mut b, &mem).is_empty());

    b.handle_commit_done(job.req_id, job.run(&mem));
    let out = transmit(&mut b, &mem);
    let f = frames(&out);
    assert!(
        matches!(
            f[..],
            [
                RdmapRepr::CommitResponse { status: 0, .. },
                RdmapRepr::ReadResponse { last: true, .. }
            ]
        ),
        "{f:?}"
    );
    deliver(&out, &mut a, &mem);
    let c = completions(&mut a);
    assert_eq!(
        c.iter()
            .map(|(_, wc)| (wc.wr_id, wc.status))
            .collect::<Vec<_>>(),
        [(1, WcStatus::Success), (2, WcStatus::Success)]
    );
}

#[test]
fn a_failing_commit_answers_with_a_status() {
    let mem = MrTable::new();
    let (mut a, mut b) = pair(None);
    // Readable but not flushable: the commit fails, the Read still works.
    let (src, va) = region(&mem, 16, Access::REMOTE_READ);
    commit_then_read(&mut a, &mem, src, (src, va));
    deliver(&transmit(&mut a, &mem), &mut b, &mem);
    assert!(transmit(&mut b, &mem).is_empty());
    let job = b.poll_durability().expect("a commit job");
    let status = job.run(&mem);
    assert_ne!(status, 0);
    b.handle_commit_done(job.req_id, status);
    let out = transmit(&mut b, &mem);
    deliver(&out, &mut a, &mem);
    assert_eq!(b.phase, Phase::Running, "no Terminate");
    let c = completions(&mut a);
    assert_eq!(
        c.iter()
            .map(|(_, wc)| (wc.wr_id, wc.status, wc.vendor_err))
            .collect::<Vec<_>>(),
        [(1, WcStatus::RemOpErr, status), (2, WcStatus::Success, 0)]
    );
}

#[test]
fn teardown_drops_a_pending_commit() {
    let mem = MrTable::new();
    let (mut a, mut b) = pair(None);
    let (src, va) = region(&mem, 16, Access::REMOTE_READ | Access::FLUSH_GLOBAL);
    commit_then_read(&mut a, &mem, src, (src, va));
    deliver(&transmit(&mut a, &mem), &mut b, &mem);
    assert!(transmit(&mut b, &mem).is_empty());
    let job = b.poll_durability().expect("a commit job");
    b.handle_closed();
    b.handle_commit_done(job.req_id, 0);
    assert!(transmit(&mut b, &mem).is_empty());
    assert!(b.poll_durability().is_none());
}

#[test]
fn gathered_output_survives_partial_writes_byte_for_byte() {
    let mem = MrTable::new();
    let (src, va) = region(&mem, 200_000, Access::LOCAL_WRITE);
    let post = |c: &mut Connection| {
        let wr = SendWr {
            wr_id: 9,
            op: SendOp::Write {
                remote: Remote {
                    addr: 0x1000,
                    rkey: 0x42,
                },
            },
            // Two SGEs: segments straddle them.
            sg_list: vec![
                Sge {
                    addr: va,
                    length: 70_001,
                    lkey: src,
                },
                Sge {
                    addr: va + 100_000,
                    length: 60_003,
                    lkey: src,
                },
            ],
            signaled: true,
            fence: false,
        };
        c.post_send(
            wr,
            &Env {
                mem: &mem,
                srq: None,
            },
        )
        .expect("post");
    };
    let (mut copied, _) = pair(None);
    let (mut gathered, _) = pair(None);
    post(&mut copied);
    post(&mut gathered);
    let expected = transmit(&mut copied, &mem);
    let mut got = Vec::new();
    let mut odd = 1usize;
    // A socket that takes a few odd-sized bytes at a time.
    write_out(
        &mut gathered,
        &mem,
        || {
            odd = (odd * 7919) % 4093 + 1;
            odd
        },
        &mut got,
    );
    assert_eq!(got.len(), expected.len());
    assert!(got == expected, "same octets whichever way they leave");
    assert!(matches!(
        frames(&got)[..],
        [
            RdmapRepr::Write { last: false, .. },
            ..,
            RdmapRepr::Write { last: true, .. }
        ]
    ));
}

/// Drain `c`'s output through `write_transmit`, as a socket that takes
/// `chunk()` octets per call would, into `out`.
fn write_out(
    c: &mut Connection,
    mem: &MrTable,
    mut chunk: impl FnMut() -> usize,
    out: &mut Vec<u8>,
) {
    let env = Env { mem, srq: None };
    while c.has_queued_tx() || c.prepare_transmit(&env, 1 << 20) {
        let take_now = chunk();
        let n = c
            .write_transmit(&env, |iov| {
                let mut n = 0;
                for s in iov {
                    let take = s.len().min(take_now - n);
                    out.extend_from_slice(&s[..take]);
                    n += take;
                    if n == take_now {
                        break;
                    }
                }
                Ok(n)
            })
            .expect("write");
        assert!(n > 0);
    }
}

/// A Write's buffer is read by `writev`, after framing: its completion
/// (which lets the application reuse the buffer) waits until the socket
/// took the last octet.
#[test]
fn a_write_completes_only_after_its_octets_were_written() {
    let mem = MrTable::new();
    let (src, va) = region(&mem, 100_000, Access::LOCAL_WRITE);
    let (mut a, _) = pair(None);
    let env = Env {
        mem: &mem,
        srq: None,
    };
    a.post_send(
        SendWr {
            wr_id: 5,
            op: SendOp::Write {
                remote: Remote {
                    addr: 0x1000,
                    rkey: 0x42,
                },
            },
            sg_list: vec![Sge {
                addr: va,
                length: 100_000,
                lkey: src,
            }],
            signaled: true,
            fence: false,
        },
        &env,
    )
    .expect("post");
    assert!(a.prepare_transmit(&env, 1 << 20));
    assert!(completions(&mut a).is_empty(), "framed is not sent");
    let mut taken = 0;
    while a.has_queued_tx() {
        taken += a
            .write_transmit(&env, |iov| Ok(iov[0].len().min(1000)))
            .expect("write");
        if a.has_queued_tx() {
            assert!(completions(&mut a).is_empty(), "{taken} octets out");
        }
    }
    assert_eq!(
        completions(&mut a)
            .iter()
            .map(|(_, wc)| (wc.wr_id, wc.status))
            .collect::<Vec<_>>(),
        [(5, WcStatus::Success)]
    );
}

/// RC order at the responder: a Read Response gathered from memory at
/// write time goes out before a later atomic on the same words changes
/// them, so it carries the value from before the atomic, under a CRC that
/// matches.
#[test]
fn an_atomic_waits_for_a_gathered_read_response_over_its_target() {
    let mem = MrTable::new();
    let (mut a, mut b) = pair(None);
    let env = Env {
        mem: &mem,
        srq: None,
    };
    let len = 65_536u32;
    let (target, tva) = region(
        &mem,
        len as usize,
        Access::REMOTE_READ | Access::REMOTE_ATOMIC,
    );
    // SAFETY: the region is leaked and 8-byte aligned at its start.
    unsafe { (tva as *mut u64).write(7) };
    let (sink, sva) = region(&mem, len as usize + 8, Access::LOCAL_WRITE);
    let remote = Remote {
        addr: tva,
        rkey: target,
    };
    for (wr_id, op, sge) in [
        (1, SendOp::Read { remote }, (sva, len)),
        (2, SendOp::fetch_add(remote, 1), (sva + u64::from(len), 8)),
    ] {
        a.post_send(
            SendWr {
                wr_id,
                op,
                sg_list: vec![Sge {
                    addr: sge.0,
                    length: sge.1,
                    lkey: sink,
                }],
                signaled: true,
                fence: false,
            },
            &env,
        )
        .expect("post");
    }
    deliver(&transmit(&mut a, &mem), &mut b, &mem);
    assert!(b.prepare_transmit(&env, 1 << 20));
    // SAFETY: as above.
    assert_eq!(unsafe { (tva as *const u64).read() }, 7, "the atomic waits");
    let mut out = Vec::new();
    write_out(&mut b, &mem, || 3000, &mut out);
    // SAFETY: as above.
    assert_eq!(unsafe { (tva as *const u64).read() }, 8, "then runs");
    // The CRCs check (frames() deframes with CRC on).
    let f = frames(&out);
    assert!(
        matches!(
            f.last(),
            Some(RdmapRepr::AtomicResponse { original: 7, .. })
        ),
        "{f:?}"
    );
    deliver(&out, &mut a, &mem);
    let c = completions(&mut a);
    assert_eq!(
        c.iter()
            .map(|(_, wc)| (wc.wr_id, wc.status))
            .collect::<Vec<_>>(),
        [(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    // SAFETY: the sink is leaked; the Read placed 7 at its start.
    assert_eq!(
        unsafe { (sva as *const u64).read() },
        7,
        "read before the add"
    );
}

/// A Send that finds no Receive posted waits for one instead of drawing a
/// Terminate (iWARP's stand-in for InfiniBand's RNR retries): it and the
/// input behind it are delivered as Receives are posted, in order, and a
/// close that arrives meanwhile is reported at once but flushes only
/// after them.
#[test]
fn a_send_with_no_receive_waits_for_one() {
    let mem = MrTable::new();
    let (src, src_va) = region(&mem, 3, Access::LOCAL_WRITE);
    let (dst, dst_va) = region(&mem, 3, Access::LOCAL_WRITE);
    let (mut a, mut b) = pair(None);
    let env = Env {
        mem: &mem,
        srq: None,
    };
    let recv = |wr_id| recv_wr(wr_id, dst, dst_va, 3);
    b.post_recv(recv(10)).expect("post recv");
    for wr_id in 1..=3 {
        a.post_send(send_wr(wr_id, src, src_va, 3), &env)
            .expect("post send");
    }
    let bytes = transmit(&mut a, &mem);
    deliver(&bytes, &mut b, &mem);
    let ids = |c: &mut Connection| {
        completions(c)
            .iter()
            .map(|(_, wc)| (wc.wr_id, wc.status))
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(&mut b), [(10, WcStatus::Success)]);
    assert!(b.rx_held(), "the second Send waits");
    let evs = events(&mut b);
    assert!(
        !evs.iter().any(|e| matches!(e, Event::TerminateSent(_))),
        "no Terminate: {evs:?}"
    );
    assert_eq!(b.state(), QpState::Rts);
    assert!(transmit(&mut b, &mem).is_empty(), "nothing on the wire");
    // Input that arrives meanwhile is kept behind it.
    deliver(&[], &mut b, &mem);
    b.post_recv(recv(11)).expect("post recv");
    b.resume_held(&env);
    assert_eq!(ids(&mut b), [(11, WcStatus::Success)]);
    assert!(b.rx_held(), "the third Send waits");
    // The peer closes: reported now, the last Send still delivered.
    b.handle_closed();
    assert_eq!(events(&mut b), [Event::Closed]);
    assert_eq!(b.state(), QpState::Rts);
    b.post_recv(recv(12)).expect("post recv");
    b.resume_held(&env);
    assert_eq!(ids(&mut b), [(12, WcStatus::Success)]);
    assert!(!b.rx_held());
    assert_eq!(b.state(), QpState::Error, "closed after the last one");
    assert!(events(&mut b).is_empty(), "the close was reported once");
}

/// A message that waited for a Receive past the driver's bound draws the
/// Terminate it would have drawn on arrival (DDP untagged, no buffer),
/// and the input held behind it goes with the connection.
#[test]
fn a_held_send_that_expires_is_the_no_buffer_terminate() {
    let mem = MrTable::new();
    let (src, src_va) = region(&mem, 3, Access::LOCAL_WRITE);
    let (mut a, mut b) = pair(None);
    let env = Env {
        mem: &mem,
        srq: None,
    };
    for wr_id in 1..=2 {
        a.post_send(send_wr(wr_id, src, src_va, 3), &env)
            .expect("post send");
    }
    let bytes = transmit(&mut a, &mem);
    deliver(&bytes, &mut b, &mem);
    assert!(b.rx_held());
    assert_eq!(b.state(), QpState::Rts);
    b.expire_held();
    assert!(!b.rx_held());
    assert_eq!(b.state(), QpState::Error);
    let evs = events(&mut b);
    assert!(
        evs.iter().any(|e| matches!(e, Event::TerminateSent(_))),
        "a Terminate: {evs:?}"
    );
    let term = transmit(&mut b, &mem);
    assert!(!term.is_empty(), "the Terminate goes out");
    deliver(&term, &mut a, &mem);
    assert_eq!(a.state(), QpState::Error);
}

/// Inline WRs (siw's inline SQEs): the payload is copied at post time, so
/// the caller rewriting its buffer right after the post changes nothing on
/// the wire, and the slots wrap (a queue of 4, 5 rounds of 4) without one
/// WR's bytes overwriting another's still queued.
#[test]
fn inline_payloads_are_copied_at_post_and_their_slots_wrap() {
    let mem = MrTable::new();
    let env = Env {
        mem: &mem,
        srq: None,
    };
    let caps = QpCaps {
        max_send_wr: 4,
        ..QpCaps::default()
    };
    let (mut a, mut b) = pair_with(caps, None);
    let (dst, dst_va) = region(&mem, 4 * 64, Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let mut buf = [0u8; 40];
    for round in 0..5u8 {
        for i in 0..4u8 {
            let tag = round * 4 + i;
            buf.fill(tag);
            let len = 20 + i as usize * 5;
            a.post_inline(
                InlineWr {
                    wr_id: tag as u64,
                    op: SendOp::Write {
                        remote: Remote {
                            addr: dst_va + i as u64 * 64,
                            rkey: dst,
                        },
                    },
                    data: &[&buf[..8], &buf[8..len]],
                    signaled: true,
                    fence: false,
                },
                &env,
            )
            .expect("post");
            // The caller reuses its buffer at once.
            buf.fill(0xee);
        }
        let full = a.post_inline(
            InlineWr {
                wr_id: 99,
                op: SendOp::Send {
                    solicited: false,
                    invalidate: None,
                },
                data: &[&buf[..1]],
                signaled: true,
                fence: false,
            },
            &env,
        );
        assert!(matches!(full, Err(PostError::SendQueueFull(4))), "{full:?}");
        deliver(&transmit(&mut a, &mem), &mut b, &mem);
        // SAFETY: `region` leaked the buffer, and nothing writes it now.
        let placed = unsafe { std::slice::from_raw_parts(dst_va as *const u8, 4 * 64) };
        for i in 0..4usize {
            let len = 20 + i * 5;
            let tag = round * 4 + i as u8;
            assert!(
                placed[i * 64..i * 64 + len].iter().all(|&x| x == tag),
                "round {round}, WR {i}: {:?}",
                &placed[i * 64..i * 64 + len]
            );
        }
        let done: Vec<_> = completions(&mut a)
            .into_iter()
            .map(|(_, wc)| (wc.wr_id, wc.status, wc.byte_len))
            .collect();
        let want: Vec<_> = (0..4u8)
            .map(|i| ((round * 4 + i) as u64, WcStatus::Success, 20 + i as u32 * 5))
            .collect();
        assert_eq!(done, want);
    }
}

#[test]
fn inline_is_refused_past_max_inline_and_for_other_ops() {
    let mem = MrTable::new();
    let env = Env {
        mem: &mem,
        srq: None,
    };
    let (mut a, _) = pair(None);
    let big = [7u8; MAX_INLINE + 1];
    let remote = Remote {
        addr: 0x1000,
        rkey: 0x42,
    };
    for (op, data) in [
        (SendOp::Write { remote }, &big[..]),
        (SendOp::Read { remote }, &big[..8]),
    ] {
        let r = a.post_inline(
            InlineWr {
                wr_id: 1,
                op,
                data: &[data],
                signaled: true,
                fence: false,
            },
            &env,
        );
        assert!(matches!(r, Err(PostError::Invalid(_))), "{op:?}: {r:?}");
    }
    assert!(transmit(&mut a, &mem).is_empty());
    assert!(completions(&mut a).is_empty());
}

/// A held burst longer than several chunks of held input, read the
/// driver's way (straight into `held_room`, reads of odd sizes that cut
/// FPDUs and chunks anywhere) and taken one Receive at a time: every Send
/// arrives whole and in order.
#[test]
fn a_held_burst_across_chunks_arrives_whole_one_receive_at_a_time() {
    const LEN: usize = 64 << 10;
    const N: u64 = 40;
    let mem = MrTable::new();
    let (src, src_va) = region(&mem, N as usize * LEN, Access::LOCAL_WRITE);
    let (dst, dst_va) = region(&mem, LEN, Access::LOCAL_WRITE);
    let (mut a, mut b) = pair(None);
    let env = Env {
        mem: &mem,
        srq: None,
    };
    let src_buf = src_va as *mut u8;
    for i in 0..N {
        // SAFETY: the region is leaked and nothing else touches it.
        unsafe { std::ptr::write_bytes(src_buf.add(i as usize * LEN), i as u8 + 1, LEN) };
        a.post_send(send_wr(i, src, src_va + i * LEN as u64, LEN as u32), &env)
            .expect("post send");
    }
    let bytes = transmit(&mut a, &mem);
    assert!(bytes.len() > 2 * held_input::CHUNK_LEN, "spans chunks");
    let recv = |wr_id| recv_wr(wr_id, dst, dst_va, LEN as u32);
    // The first message finds no Receive: held, with what followed it in
    // the same read.
    let (first, mut rest) = bytes.split_at(200_000);
    b.handle_bytes(first, &env);
    assert!(b.rx_held());
    let mut read = 7919;
    while !rest.is_empty() {
        let room = b.held_room(read).expect("held");
        let n = room.len().min(rest.len());
        room[..n].copy_from_slice(&rest[..n]);
        b.held_filled(n);
        rest = &rest[n..];
        read = read * 3 % 300_007 + 1;
    }
    for i in 0..N {
        b.post_recv(recv(100 + i)).expect("post recv");
        b.resume_held(&env);
        let wcs = completions(&mut b);
        assert_eq!(wcs.len(), 1, "message {i}");
        assert_eq!(wcs[0].1.wr_id, 100 + i);
        assert_eq!(wcs[0].1.status, WcStatus::Success);
        assert_eq!(wcs[0].1.byte_len as usize, LEN);
        // SAFETY: the region is leaked; the connection wrote it above.
        let got = unsafe { std::slice::from_raw_parts(dst_va as *const u8, LEN) };
        assert!(got.iter().all(|&x| x == i as u8 + 1), "message {i} intact");
        assert_eq!(b.rx_held(), i + 1 < N, "held until the last");
    }
    assert_eq!(b.state(), QpState::Rts);
}

#[test]
fn a_read_stream_at_the_ord_limit_is_pipelined_until_its_last_request_leaves() {
    let mem = MrTable::new();
    let env = Env {
        mem: &mem,
        srq: None,
    };
    let (mut a, mut b) = pair_of_one_credit();
    let (source, sva) = region(&mem, 64, Access::REMOTE_READ);
    let (sink, dva) = region(&mem, 64, Access::LOCAL_WRITE);
    let read = |wr_id| SendWr {
        wr_id,
        op: SendOp::Read {
            remote: Remote {
                addr: sva,
                rkey: source,
            },
        },
        sg_list: vec![Sge {
            addr: dva,
            length: 64,
            lkey: sink,
        }],
        signaled: true,
        fence: false,
    };
    assert!(!a.pipelined(), "nothing posted");
    a.post_send(read(1), &env).expect("post");
    assert!(!a.pipelined(), "nothing waits behind the first Read");
    // The first Read was framed at its post (nothing was ahead of it) and
    // holds the one credit: the second waits behind it.
    a.post_send(read(2), &env).expect("post");
    assert!(a.pipelined());

    // One Read leaves (ORD 1); the second waits for its response.
    let first = transmit(&mut a, &mem);
    assert_eq!(frames(&first).len(), 1);
    assert!(a.pipelined());
    deliver(&first, &mut b, &mem);
    deliver(&transmit(&mut b, &mem), &mut a, &mem);
    assert_eq!(completions(&mut a).len(), 1);

    // The response freed the credit: the second Read leaves, and nothing
    // waits behind it.
    let second = transmit(&mut a, &mem);
    assert_eq!(frames(&second).len(), 1);
    assert!(!a.pipelined(), "the last request is on the wire");
    deliver(&second, &mut b, &mem);
    deliver(&transmit(&mut b, &mem), &mut a, &mem);
    assert_eq!(completions(&mut a).len(), 1);
    assert!(!a.pipelined());
}

#[test]
fn input_is_under_way_from_a_message_s_first_octet_to_its_last() {
    let mem = MrTable::new();
    let env = Env {
        mem: &mem,
        srq: None,
    };
    // Segments of 40 octets: a 100-octet Send is three FPDUs.
    let caps = QpCaps {
        max_segment: 40,
        ..QpCaps::default()
    };
    let (mut a, mut b) = pair_with(caps, None);
    let (src, sva) = region(&mem, 100, Access::LOCAL_WRITE);
    let (dst, dva) = region(&mem, 100, Access::LOCAL_WRITE);
    a.post_send(send_wr(1, src, sva, 100), &env).expect("post");
    let wire = transmit(&mut a, &mem);
    assert_eq!(frames(&wire).len(), 3);

    assert!(!b.input_under_way(), "nothing came");
    // Length field, header and 40 octets, padded to 4, then the CRC.
    let first_fpdu = (crate::wire::fpdu::LENGTH_LEN + crate::wire::ddp::UNTAGGED_HEADER_LEN + 40)
        .next_multiple_of(4)
        + crate::wire::fpdu::CRC_LEN;
    // Part of an FPDU: the rest is coming.
    deliver(&wire[..10], &mut b, &mem);
    assert!(b.input_under_way(), "part of an FPDU");
    // The Send's first segment without a Receive: the message is held,
    // and nothing moves until one is posted, so nothing is under way.
    deliver(&wire[10..first_fpdu], &mut b, &mem);
    assert!(!b.input_under_way(), "held for a Receive");
    b.post_recv(recv_wr(9, dst, dva, 100)).expect("post_recv");
    b.resume_held(&env);
    assert!(b.input_under_way(), "between the Send's segments");
    deliver(&wire[first_fpdu..], &mut b, &mem);
    assert!(!b.input_under_way(), "the Send is in");
    assert_eq!(completions(&mut b).len(), 1);
}

/// A WR with nothing ahead of it is framed at its post, as the send queue
/// would frame it next; what comes behind it queues, and so does a WR the
/// queue would hold (a fenced one behind a Read, a Read past the ORD).
/// What reaches the wire, and the order of the completions, are the
/// queue's.
#[test]
fn a_wr_with_nothing_ahead_is_framed_at_its_post_and_the_rest_queue() {
    let mem = MrTable::new();
    let env = Env {
        mem: &mem,
        srq: None,
    };
    let (mut a, mut b) = pair_of_one_credit();
    let (src, sva) = region(&mem, 64, Access::LOCAL_WRITE);
    let (dst, dva) = region(&mem, 64, Access::REMOTE_WRITE | Access::REMOTE_READ);
    let fill: Vec<u8> = (0..64).collect();
    mem.write_local(src, PD, sva, &fill).expect("fill");
    let op = |wr_id: u64, op: SendOp, fence: bool| SendWr {
        wr_id,
        op,
        sg_list: vec![Sge {
            addr: sva + wr_id * 8,
            length: 8,
            lkey: src,
        }],
        signaled: true,
        fence,
    };
    let write = |wr_id: u64| SendOp::Write {
        remote: Remote {
            addr: dva + wr_id * 8,
            rkey: dst,
        },
    };
    let read = |wr_id: u64| SendOp::Read {
        remote: Remote {
            addr: dva + wr_id * 8,
            rkey: dst,
        },
    };

    a.post_send(op(0, write(0), false), &env).expect("post");
    let framed = a.queued_tx();
    assert!(framed > 0, "framed at its post");
    a.post_send(op(1, write(1), false), &env).expect("post");
    assert_eq!(a.queued_tx(), framed, "the second queues behind the first");
    let out = transmit(&mut a, &mem);
    assert!(matches!(
        frames(&out)[..],
        [
            RdmapRepr::Write { to: t0, last: true, .. },
            RdmapRepr::Write { to: t1, last: true, .. },
        ] if t0 == dva && t1 == dva + 8
    ));
    deliver(&out, &mut b, &mem);

    // The Read takes the one ORD credit at its post. With nothing
    // framed, a second Read waits for the credit, and a Write behind it
    // waits in the queue.
    a.post_send(op(2, read(0), false), &env).expect("post");
    assert!(a.queued_tx() > 0, "the Read is framed at its post");
    let out = transmit(&mut a, &mem);
    assert!(matches!(frames(&out)[..], [RdmapRepr::ReadRequest { .. }]));
    deliver(&out, &mut b, &mem);
    a.post_send(op(3, read(1), false), &env).expect("post");
    assert_eq!(a.queued_tx(), 0, "past the ORD");
    a.post_send(op(4, write(4), false), &env).expect("post");
    assert_eq!(a.queued_tx(), 0, "behind a queued WR");
    deliver(&transmit(&mut b, &mem), &mut a, &mem);
    let out = transmit(&mut a, &mem);
    assert!(matches!(
        frames(&out)[..],
        [RdmapRepr::ReadRequest { .. }, RdmapRepr::Write { .. }]
    ));
    deliver(&out, &mut b, &mem);
    deliver(&transmit(&mut b, &mem), &mut a, &mem);

    // A fenced Write waits for the Read before it.
    a.post_send(op(5, read(4), false), &env).expect("post");
    let out = transmit(&mut a, &mem);
    assert!(matches!(frames(&out)[..], [RdmapRepr::ReadRequest { .. }]));
    deliver(&out, &mut b, &mem);
    a.post_send(op(6, write(6), true), &env).expect("post");
    assert_eq!(a.queued_tx(), 0, "fenced");
    deliver(&transmit(&mut b, &mem), &mut a, &mem);
    let out = transmit(&mut a, &mem);
    assert!(matches!(frames(&out)[..], [RdmapRepr::Write { .. }]));
    deliver(&out, &mut b, &mem);

    let done: Vec<_> = completions(&mut a)
        .iter()
        .map(|(_, wc)| (wc.wr_id, wc.status))
        .collect();
    assert_eq!(
        done,
        (0..7).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
    );
    // Writes 0, 1, 4 and 6 placed their 8 octets; Reads 2, 3 and 5
    // brought back those of Writes 0, 1 and 4.
    let mut placed = [0u8; 64];
    mem.read_local(dst, PD, dva, &mut placed).expect("read");
    assert_eq!(placed[..16], fill[..16]);
    assert_eq!(placed[32..40], fill[32..40]);
    assert_eq!(placed[48..56], fill[48..56]);
    let mut got = [0u8; 64];
    mem.read_local(src, PD, sva, &mut got).expect("read");
    assert_eq!(got[16..32], fill[..16]);
    assert_eq!(got[40..48], fill[32..40]);
    assert_eq!(a.state(), QpState::Rts);
    assert_eq!(b.state(), QpState::Rts);
}
