//! Direct placement, driven as the driver drives it: bytes through a real
//! socket (a Unix stream pair), payloads read straight into registered
//! memory with `MrTable::recv_placed`, everything else through
//! `handle_bytes`. Each test checks the octets in the region, the octets
//! around it, and the completions and Terminate that result.

use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;

use super::*;
use crate::mem::Access;
use crate::wire::fpdu::LENGTH_LEN;
use crate::wire::rdmap::RdmapRepr;
use crate::wire::stream::{Deframer, DeframerConfig};
use crate::wire::{Error, ErrorType, Layer};
use crate::wr::Remote;

const PD: PdId = 1;
/// Guard octets on either side of every registered range.
const GUARD: usize = 4096;
const GUARD_BYTE: u8 = 0xee;

fn pair(crc: bool) -> (Connection, Connection) {
    let neg = |initiator| Negotiated {
        initiator,
        revision: 2,
        crc,
        markers_tx: false,
        markers_rx: false,
        ird: 8,
        ord: 8,
        rtr: None,
        peer_private_data: Vec::new(),
    };
    let caps = QpCaps::default();
    (
        Connection::new(1, PD, caps, neg(true), false),
        Connection::new(2, PD, caps, neg(false), false),
    )
}

/// A registered range of `len` octets with guards around it, and an STag
/// over the whole buffer (guards included) to inspect it.
struct Guarded {
    stag: u32,
    va: u64,
    len: usize,
    whole: u32,
}

impl Guarded {
    fn new(mem: &MrTable, len: usize, access: Access, fill: impl Fn(usize) -> u8) -> Guarded {
        let mut v = vec![GUARD_BYTE; len + 2 * GUARD];
        for (i, b) in v[GUARD..GUARD + len].iter_mut().enumerate() {
            *b = fill(i);
        }
        let buf: &'static mut [u8] = Box::leak(v.into_boxed_slice());
        let base = NonNull::new(buf.as_mut_ptr()).expect("non-null");
        let whole_va = base.as_ptr() as u64;
        // SAFETY: the buffer is leaked, so it stays valid forever.
        let whole =
            unsafe { mem.register(PD, base, whole_va, buf.len() as u64, Access::empty(), false) }
                .expect("register");
        let inner = NonNull::new(base.as_ptr().wrapping_add(GUARD)).expect("non-null");
        let va = whole_va + GUARD as u64;
        // SAFETY: as above; the range is inside the leaked buffer.
        let stag = unsafe { mem.register(PD, inner, va, len as u64, access, false) }.expect("reg");
        Guarded {
            stag,
            va,
            len,
            whole,
        }
    }

    fn contents(&self, mem: &MrTable) -> Vec<u8> {
        let mut out = vec![0; self.len];
        mem.read_local(self.whole, PD, self.va, &mut out)
            .expect("read");
        out
    }

    /// Both guards still hold only their fill.
    fn guards_intact(&self, mem: &MrTable) -> bool {
        let mut g = vec![0; GUARD];
        let front = self.va - GUARD as u64;
        mem.read_local(self.whole, PD, front, &mut g).expect("read");
        let ok_front = g.iter().all(|&b| b == GUARD_BYTE);
        mem.read_local(self.whole, PD, self.va + self.len as u64, &mut g)
            .expect("read");
        ok_front && g.iter().all(|&b| b == GUARD_BYTE)
    }
}

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 9)) as u8
}

fn transmit(c: &mut Connection, mem: &MrTable) -> Vec<u8> {
    let env = Env { mem, srq: None };
    let mut out = Vec::new();
    while c.poll_transmit(&env, &mut out, 1 << 24) {}
    out
}

fn completions(c: &mut Connection) -> Vec<(u64, WcStatus)> {
    std::iter::from_fn(|| c.poll_completion())
        .map(|(_, wc)| (wc.wr_id, wc.status))
        .collect()
}

fn events(c: &mut Connection) -> Vec<Event> {
    std::iter::from_fn(|| c.poll_event()).collect()
}

/// The Terminate `c` sent, from its own output.
fn terminate_sent(c: &mut Connection, mem: &MrTable) -> Option<crate::wire::TerminateCause> {
    let out = transmit(c, mem);
    let mut d = Deframer::new(DeframerConfig {
        crc: c.negotiated().crc,
        markers: false,
        max_ulpdu_len: u16::MAX,
    });
    let mut input = &out[..];
    let mut cause = None;
    while let Some(u) = d.poll(&mut input).expect("deframes") {
        if let (RdmapRepr::Terminate(t), _) = RdmapRepr::parse(&u).expect("parses") {
            cause = Some(t.cause);
        }
    }
    cause
}

/// The receiving end of a socket, read as the driver reads it.
struct Rx {
    rd: UnixStream,
    wr: Option<UnixStream>,
    /// Octets the ordinary path reads at a time.
    chunk: usize,
    rbuf: Vec<u8>,
    /// `readv`s straight into a region.
    direct: usize,
    /// Octets that came through ordinary reads.
    copied: usize,
}

impl Rx {
    fn new(chunk: usize) -> Rx {
        let (rd, wr) = UnixStream::pair().expect("socketpair");
        rd.set_nonblocking(true).expect("nonblocking");
        wr.set_nonblocking(true).expect("nonblocking");
        Rx {
            rd,
            wr: Some(wr),
            chunk,
            rbuf: vec![0; 256 * 1024],
            direct: 0,
            copied: 0,
        }
    }

    /// Send `bytes` through the socket, `step` octets at a time, draining
    /// the far end into `conn` after each.
    fn deliver(&mut self, bytes: &[u8], step: usize, conn: &mut Connection, mem: &MrTable) {
        let mut rest = bytes;
        while !rest.is_empty() {
            let n = step.min(rest.len());
            let w = self.wr.as_mut().expect("open");
            match w.write(&rest[..n]) {
                Ok(k) => rest = &rest[k..],
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => panic!("write: {e}"),
            }
            self.pump(conn, mem);
        }
        self.pump(conn, mem);
    }

    /// What `driver::QpShared::drive_with` does with the socket.
    fn pump(&mut self, conn: &mut Connection, mem: &MrTable) {
        let env = Env { mem, srq: None };
        loop {
            if conn.state() == QpState::Error {
                return;
            }
            if let Some(req) = conn.placement() {
                let tail = req.trailer + LENGTH_LEN + 14;
                let mut crc = req.crc;
                match mem.recv_placed(
                    self.rd.as_fd(),
                    &req.target,
                    &mut self.rbuf[..tail],
                    crc.as_mut(),
                ) {
                    Err(e) => conn.handle_place_failed(e),
                    Ok(Ok(0)) => return conn.handle_closed(),
                    Ok(Ok(n)) => {
                        self.direct += 1;
                        let placed = n.min(req.target.len() as usize);
                        conn.handle_placed(placed, crc);
                        conn.handle_bytes(&self.rbuf[..n - placed], &env);
                    }
                    Ok(Err(e)) if e.kind() == ErrorKind::WouldBlock => return,
                    Ok(Err(e)) => panic!("readv: {e}"),
                }
                continue;
            }
            let want = conn.read_hint().unwrap_or(self.chunk).min(self.chunk);
            match self.rd.read(&mut self.rbuf[..want]) {
                Ok(0) => return conn.handle_closed(),
                Ok(n) => {
                    self.copied += n;
                    conn.handle_bytes(&self.rbuf[..n], &env);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => panic!("read: {e}"),
            }
        }
    }

    /// The peer goes away.
    fn hang_up(&mut self, conn: &mut Connection, mem: &MrTable) {
        self.wr = None;
        self.pump(conn, mem);
    }
}

/// `a` posts an RDMA Write of `len` octets of a patterned source to `dst`.
fn post_write(a: &mut Connection, mem: &MrTable, len: usize, rkey: u32, addr: u64) {
    let src = Guarded::new(mem, len, Access::empty(), pattern);
    let env = Env { mem, srq: None };
    let wr = SendWr {
        wr_id: 11,
        op: SendOp::Write {
            remote: Remote { addr, rkey },
        },
        sg_list: vec![Sge {
            addr: src.va,
            length: len as u32,
            lkey: src.stag,
        }],
        signaled: true,
        fence: false,
    };
    a.post_send(wr, &env).expect("post");
}

/// `a` posts an RDMA Read (wr_id 5) of `src` into `sink`.
fn post_read(a: &mut Connection, mem: &MrTable, src: &Guarded, sink: Vec<Sge>) {
    let wr = SendWr {
        wr_id: 5,
        op: SendOp::Read {
            remote: Remote {
                addr: src.va,
                rkey: src.stag,
            },
        },
        sg_list: sink,
        signaled: true,
        fence: false,
    };
    a.post_send(wr, &Env { mem, srq: None }).expect("post");
}

const BIG: usize = 150_000;

#[test]
fn a_large_write_lands_directly_and_exactly() {
    for (crc, chunk, step) in [
        (true, 4096, 1 << 20),
        (false, 100, 1 << 20),
        (true, 4096, 997),
    ] {
        let mem = MrTable::new();
        let (mut a, mut b) = pair(crc);
        let dst = Guarded::new(&mem, BIG, Access::REMOTE_WRITE, |_| 0);
        post_write(&mut a, &mem, BIG, dst.stag, dst.va);
        let wire = transmit(&mut a, &mem);
        let mut rx = Rx::new(chunk);
        rx.deliver(&wire, step, &mut b, &mem);
        assert!(rx.direct > 0, "the direct path was taken");
        if step < 1000 {
            assert!(rx.direct > 100, "a segment split over many reads");
        }
        assert_eq!(b.state(), QpState::Rts);
        assert!(b.placing.is_none() && b.deframer.as_ref().is_some_and(|d| d.is_idle()));
        let got = dst.contents(&mem);
        assert!(
            got.iter().enumerate().all(|(i, &x)| x == pattern(i)),
            "crc {crc} chunk {chunk} step {step}"
        );
        assert!(dst.guards_intact(&mem));
    }
}

#[test]
fn a_large_read_response_lands_directly_across_sges() {
    let mem = MrTable::new();
    let (mut a, mut b) = pair(true);
    let src = Guarded::new(&mem, BIG, Access::REMOTE_READ, pattern);
    // Two sink SGEs in one region with a gap between them.
    let sink = Guarded::new(&mem, BIG + 1000, Access::LOCAL_WRITE, |_| 0);
    let env = Env {
        mem: &mem,
        srq: None,
    };
    let first = 70_001u32;
    post_read(
        &mut a,
        &mem,
        &src,
        vec![
            Sge {
                addr: sink.va,
                length: first,
                lkey: sink.stag,
            },
            Sge {
                addr: sink.va + 1000 + first as u64,
                length: BIG as u32 - first,
                lkey: sink.stag,
            },
        ],
    );
    let request = transmit(&mut a, &mem);
    b.handle_bytes(&request, &env);
    let responses = transmit(&mut b, &mem);
    let mut rx = Rx::new(4096);
    rx.deliver(&responses, 1 << 20, &mut a, &mem);
    assert!(rx.direct > 0);
    assert_eq!(completions(&mut a), [(5, WcStatus::Success)]);
    let got = sink.contents(&mem);
    let f = first as usize;
    assert!(got[..f].iter().enumerate().all(|(i, &x)| x == pattern(i)));
    assert!(
        got[f..f + 1000].iter().all(|&x| x == 0),
        "the gap untouched"
    );
    assert!(got[f + 1000..]
        .iter()
        .enumerate()
        .all(|(i, &x)| x == pattern(f + i)));
    assert!(sink.guards_intact(&mem));
}

/// Feed `wire` twice, to fresh receivers: all at once (the ordinary,
/// zero-copy path: every FPDU is whole in the input) and through the
/// socket in small reads (where the direct path would start). Both must
/// draw the same Terminate and leave `dst` the same (the segments before
/// the refused one placed, nothing of it), guards intact.
fn same_refusal(
    make: impl Fn(&MrTable) -> (Connection, Connection, Guarded, Vec<u8>),
    expect: Error,
) -> Vec<u8> {
    let mut causes = Vec::new();
    let mut contents = Vec::new();
    for chunk in [usize::MAX, 4096] {
        let mem = MrTable::new();
        let (_, mut b, dst, wire) = make(&mem);
        if chunk == usize::MAX {
            b.handle_bytes(
                &wire,
                &Env {
                    mem: &mem,
                    srq: None,
                },
            );
        } else {
            let mut rx = Rx::new(chunk);
            rx.deliver(&wire, 1 << 20, &mut b, &mem);
        }
        assert_eq!(b.state(), QpState::Error);
        contents.push(dst.contents(&mem));
        assert!(dst.guards_intact(&mem));
        causes.push(terminate_sent(&mut b, &mem).expect("a Terminate"));
    }
    assert_eq!(causes[0], expect.terminate_cause());
    assert_eq!(causes[0], causes[1]);
    assert!(contents[0] == contents[1], "the same octets placed");
    contents.swap_remove(0)
}

#[test]
fn a_write_to_a_bad_stag_is_refused_as_before() {
    let placed = same_refusal(
        |mem| {
            let (mut a, b) = pair(true);
            let dst = Guarded::new(mem, BIG, Access::REMOTE_WRITE, |_| 0);
            post_write(&mut a, mem, BIG, dst.stag ^ 0x1, dst.va);
            let wire = transmit(&mut a, mem);
            (a, b, dst, wire)
        },
        Error::DdpInvalidStag(0),
    );
    assert!(placed.iter().all(|&x| x == 0));
}

#[test]
fn a_write_out_of_bounds_is_refused_as_before() {
    let placed = same_refusal(
        |mem| {
            let (mut a, b) = pair(true);
            let dst = Guarded::new(mem, BIG, Access::REMOTE_WRITE, |_| 0);
            // The first segments fit (and go direct), the last one ends
            // past the region.
            post_write(&mut a, mem, BIG, dst.stag, dst.va + 100);
            let wire = transmit(&mut a, mem);
            (a, b, dst, wire)
        },
        Error::DdpBaseBounds,
    );
    // Two whole segments landed, nothing of the third.
    let two = 2 * QpCaps::default().max_segment as usize;
    let (before, after) = placed[100..].split_at(two);
    assert!(before.iter().enumerate().all(|(i, &x)| x == pattern(i)));
    assert!(after.iter().all(|&x| x == 0), "not the refused one");
}

#[test]
fn a_write_without_the_right_is_refused_as_before() {
    let placed = same_refusal(
        |mem| {
            let (mut a, b) = pair(true);
            let dst = Guarded::new(mem, BIG, Access::REMOTE_READ, |_| 0);
            post_write(&mut a, mem, BIG, dst.stag, dst.va);
            let wire = transmit(&mut a, mem);
            (a, b, dst, wire)
        },
        Error::AccessRights,
    );
    assert!(placed.iter().all(|&x| x == 0));
}

#[test]
fn a_crc_error_after_placement_terminates_and_completes_nothing() {
    let mem = MrTable::new();
    let (mut a, mut b) = pair(true);
    let src = Guarded::new(&mem, BIG, Access::REMOTE_READ, pattern);
    let sink = Guarded::new(&mem, BIG, Access::LOCAL_WRITE, |_| 0);
    let env = Env {
        mem: &mem,
        srq: None,
    };
    post_read(
        &mut a,
        &mem,
        &src,
        vec![Sge {
            addr: sink.va,
            length: BIG as u32,
            lkey: sink.stag,
        }],
    );
    b.handle_bytes(&transmit(&mut a, &mem), &env);
    let mut responses = transmit(&mut b, &mem);
    // Corrupt one payload octet near the end of the last segment.
    let at = responses.len() - 100;
    responses[at] ^= 0x40;
    let mut rx = Rx::new(4096);
    rx.deliver(&responses, 1 << 20, &mut a, &mem);
    assert!(rx.direct > 0, "the corrupt segment was placed directly");
    assert_eq!(a.state(), QpState::Error);
    assert!(a.placing.is_none());
    let cause = terminate_sent(&mut a, &mem).expect("a Terminate");
    assert_eq!(
        (cause.layer(), cause.etype, cause.ecode),
        (Layer::Llp, ErrorType::Mpa, 0x02)
    );
    // The Read never succeeds: it is flushed.
    assert_eq!(completions(&mut a), [(5, WcStatus::WrFlushErr)]);
    assert!(sink.guards_intact(&mem), "nothing outside the sink");
}

#[test]
fn a_region_deregistered_mid_payload_is_refused_after_the_crc() {
    let mem = MrTable::new();
    let (mut a, mut b) = pair(true);
    let dst = Guarded::new(&mem, BIG, Access::REMOTE_WRITE, |_| 0);
    post_write(&mut a, &mem, BIG, dst.stag, dst.va);
    let wire = transmit(&mut a, &mem);
    let mut rx = Rx::new(4096);
    // The first 20 000 octets: the first segment's header and a part of
    // its payload, the direct path under way.
    rx.deliver(&wire[..20_000], 1 << 20, &mut b, &mem);
    assert!(b.placing.is_some() && rx.direct > 0);
    mem.deregister(dst.stag).expect("deregister");
    rx.deliver(&wire[20_000..], 1 << 20, &mut b, &mem);
    assert_eq!(b.state(), QpState::Error);
    let cause = terminate_sent(&mut b, &mem).expect("a Terminate");
    assert_eq!(cause, Error::DdpInvalidStag(0).terminate_cause());
    // Only what was placed before the deregistration landed.
    let got = dst.contents(&mem);
    let placed = got.iter().rposition(|&x| x != 0).map_or(0, |p| p + 1);
    assert!(placed < 20_000, "{placed}");
    assert!(dst.guards_intact(&mem));
}

#[test]
fn a_peer_gone_mid_payload_flushes_the_read() {
    let mem = MrTable::new();
    let (mut a, mut b) = pair(true);
    let src = Guarded::new(&mem, BIG, Access::REMOTE_READ, pattern);
    let sink = Guarded::new(&mem, BIG, Access::LOCAL_WRITE, |_| 0);
    let env = Env {
        mem: &mem,
        srq: None,
    };
    post_read(
        &mut a,
        &mem,
        &src,
        vec![Sge {
            addr: sink.va,
            length: BIG as u32,
            lkey: sink.stag,
        }],
    );
    b.handle_bytes(&transmit(&mut a, &mem), &env);
    let responses = transmit(&mut b, &mem);
    let mut rx = Rx::new(4096);
    let cut = responses.len() - 30_000;
    rx.deliver(&responses[..cut], 1 << 20, &mut a, &mem);
    assert!(a.placing.is_some() && rx.direct > 0, "mid-payload");
    rx.hang_up(&mut a, &mem);
    assert_eq!(a.state(), QpState::Error);
    assert!(a.placing.is_none());
    assert_eq!(completions(&mut a), [(5, WcStatus::WrFlushErr)]);
    assert!(events(&mut a).contains(&Event::Closed));
    assert!(sink.guards_intact(&mem));
}

#[test]
fn small_segments_and_markers_take_the_ordinary_path() {
    // A Write of less than DIRECT_MIN, and one with markers negotiated.
    for (len, markers) in [(place::DIRECT_MIN - 1, false), (BIG, true)] {
        let mem = MrTable::new();
        let (mut a, mut b) = pair(true);
        a.framer = Framer::new(FramerConfig { crc: true, markers });
        b.deframer = Some(Box::new(Deframer::new(DeframerConfig {
            crc: true,
            markers,
            max_ulpdu_len: u16::MAX,
        })));
        let dst = Guarded::new(&mem, len, Access::REMOTE_WRITE, |_| 0);
        post_write(&mut a, &mem, len, dst.stag, dst.va);
        let wire = transmit(&mut a, &mem);
        let mut rx = Rx::new(100);
        rx.deliver(&wire, 1 << 20, &mut b, &mem);
        assert_eq!(rx.direct, 0, "len {len} markers {markers}");
        assert_eq!(b.state(), QpState::Rts);
        let got = dst.contents(&mem);
        assert!(got.iter().enumerate().all(|(i, &x)| x == pattern(i)));
    }
}

#[test]
fn back_to_back_large_writes_stay_on_the_direct_path() {
    // Messages of 16 full segments and a short one, as `stag bw write`
    // sends them: only the first read and the short segments are copied.
    let mem = MrTable::new();
    let (mut a, mut b) = pair(true);
    let len = 1 << 20;
    let dst = Guarded::new(&mem, len, Access::REMOTE_WRITE, |_| 0);
    for _ in 0..4 {
        post_write(&mut a, &mem, len, dst.stag, dst.va);
    }
    let wire = transmit(&mut a, &mem);
    let mut rx = Rx::new(256 * 1024);
    rx.deliver(&wire, wire.len(), &mut b, &mem);
    assert_eq!(b.state(), QpState::Rts);
    let short = len % QpCaps::default().max_segment as usize;
    assert!(
        rx.copied < 256 * 1024 + 4 * (short + 100),
        "copied {} of {}",
        rx.copied,
        wire.len()
    );
    let got = dst.contents(&mem);
    assert!(got.iter().enumerate().all(|(i, &x)| x == pattern(i)));
}

/// `ibv_dereg_mr` of a Write's source while part of it is framed and not
/// yet written: the framed segments leave as framed (copied out at
/// deregistration, so later changes to the memory do not reach the wire
/// and the peer sees no CRC error), the rest of the WR fails with
/// `IBV_WC_LOC_PROT_ERR`, and a Terminate follows.
#[test]
fn a_source_deregistered_with_output_queued_sends_it_intact_then_fails_local() {
    let mem = MrTable::new();
    let (mut a, mut b) = pair(true);
    let env = Env {
        mem: &mem,
        srq: None,
    };
    let src = Guarded::new(&mem, BIG, Access::empty(), pattern);
    let dst = Guarded::new(&mem, BIG, Access::REMOTE_WRITE, |_| 0);
    let wr = SendWr {
        wr_id: 11,
        op: SendOp::Write {
            remote: Remote {
                addr: dst.va,
                rkey: dst.stag,
            },
        },
        sg_list: vec![Sge {
            addr: src.va,
            length: BIG as u32,
            lkey: src.stag,
        }],
        signaled: true,
        fence: false,
    };
    a.post_send(wr, &env).expect("post");
    // One segment framed (its payload still in the source region).
    assert!(a.prepare_transmit(&env, 1));
    let framed = a.tx.len();
    assert!(framed > 60_000 && framed < BIG, "{framed}");
    mem.revoke(src.stag).expect("revoke");
    assert_eq!(a.detach_region(&env, src.stag), 1);
    mem.remove_revoked(src.stag);
    // The application reuses the memory: none of this may go out.
    // SAFETY: the source buffer is leaked (Guarded), so valid forever;
    // nothing else refers to it now.
    unsafe { std::ptr::write_bytes(src.va as *mut u8, 0x5a, BIG) };
    let wire = transmit(&mut a, &mem);
    assert_eq!(completions(&mut a), [(11, WcStatus::LocProtErr)]);
    b.handle_bytes(&wire, &env);
    // The peer placed the first segment as it was, then took our
    // Terminate: no error of its own.
    let evs = events(&mut b);
    assert!(
        evs.iter().any(|e| matches!(e, Event::TerminateReceived(_))),
        "{evs:?}"
    );
    assert!(
        !evs.iter().any(|e| matches!(e, Event::TerminateSent(_))),
        "{evs:?}"
    );
    let got = dst.contents(&mem);
    let placed = got.iter().rposition(|&x| x != 0).map_or(0, |p| p + 1);
    assert!(placed > 60_000 && placed < BIG, "{placed}");
    assert!(got[..placed]
        .iter()
        .enumerate()
        .all(|(i, &x)| x == pattern(i)));
    assert!(dst.guards_intact(&mem));
}
