//! A sans-IO pair in quinn-proto's `Pair` style: two [`Connection`]s built
//! from a real MPA exchange (`setup.rs`), each with its own [`MrTable`], and
//! a queue of FPDUs per direction between them. No sockets, no threads, no
//! clock: [`Pair::step`] moves bytes once, [`Pair::drive`] runs to idle.
//!
//! Faults are edits of the queues between `transmit` and `deliver`: split
//! the bytes at any boundary, drop, duplicate or reorder whole FPDUs, flip a
//! bit, cut the stream after any byte. [`Raw`] is a malicious peer that
//! emits arbitrary frames through the wire codecs.

use std::collections::VecDeque;

use provider::mem::{Access, MrTable, PdId};
use provider::qp::{Connection, CqSide, Env, Event, PostError, QpCaps, QpState};
use provider::region::Region;
use provider::setup::{Answer, Initiator, MpaParams, Request};
use provider::srq::Srq;
use provider::wire::fpdu::{fpdu_len, CRC_LEN, LENGTH_LEN};
use provider::wire::rdmap::RdmapRepr;
use provider::wire::stream::{Deframer, DeframerConfig, Framer, FramerConfig};
use provider::wire::{ErrorType, TerminateCause};
use provider::wr::{RecvWr, Remote, SendOp, SendWr, Sge, WcStatus, WorkCompletion};

/// The protection domain of every connection the harness builds.
pub const PD: PdId = 1;

/// A registered buffer of one host.
#[derive(Debug, Clone, Copy)]
pub struct Buf {
    pub stag: u32,
    /// The iova of byte 0 (what SGEs and TOs use).
    pub addr: u64,
    pub len: usize,
    idx: usize,
}

impl Buf {
    pub fn sge(&self, off: usize, len: u32) -> Sge {
        Sge {
            addr: self.addr + off as u64,
            length: len,
            lkey: self.stag,
        }
    }

    pub fn remote(&self, off: usize) -> Remote {
        Remote {
            addr: self.addr + off as u64,
            rkey: self.stag,
        }
    }
}

/// One end: a connection, its registrations and what came out of it.
pub struct Host {
    pub conn: Connection,
    /// Declared before `regions`: the table goes first on drop, so no
    /// registration outlives its memory.
    pub mem: MrTable,
    regions: Vec<Region>,
    next_iova: u64,
    pub srq: Option<Srq>,
    /// Completions drained from the connection, in order.
    pub completions: Vec<(CqSide, WorkCompletion)>,
    pub events: Vec<Event>,
    /// FPDUs this host sent that the other end has not received yet (one
    /// element per FPDU unless markers are on: then one per transmit).
    pub outbound: VecDeque<Vec<u8>>,
    /// Hand received bytes to the connection in pieces of at most this.
    pub rx_chunk: usize,
    /// Every byte this host ever transmitted (for decoding in tests).
    pub sent_log: Vec<u8>,
    markers_tx: bool,
    crc: bool,
}

impl Host {
    fn new(conn: Connection, srq: Option<Srq>) -> Host {
        let neg = conn.negotiated().clone();
        Host {
            conn,
            mem: MrTable::new(),
            regions: Vec::new(),
            // Deterministic, distinct iovas for every registration.
            next_iova: 0x10_0000,
            srq,
            completions: Vec::new(),
            events: Vec::new(),
            outbound: VecDeque::new(),
            rx_chunk: usize::MAX,
            sent_log: Vec::new(),
            markers_tx: neg.markers_tx,
            crc: neg.crc,
        }
    }

    /// Register `len` zeroed bytes in `pd` with `access`.
    pub fn reg_in(&mut self, pd: PdId, len: usize, access: Access) -> Buf {
        let iova = self.next_iova;
        self.next_iova += (len as u64).next_multiple_of(0x1_0000) + 0x1_0000;
        self.reg_at(pd, iova, len, access)
    }

    /// Register `len` zeroed bytes visible at `iova`.
    pub fn reg_at(&mut self, pd: PdId, iova: u64, len: usize, access: Access) -> Buf {
        let region = Region::anonymous(len).unwrap();
        // SAFETY: the region is kept in `self.regions` until the Host drops,
        // and `self.mem` (declared first) drops before it, so the memory
        // outlives the registration.
        let stag = unsafe {
            self.mem
                .register(pd, region.as_ptr(), iova, len as u64, access, false)
        }
        .unwrap();
        self.regions.push(region);
        Buf {
            stag,
            addr: iova,
            len,
            idx: self.regions.len() - 1,
        }
    }

    /// Register in the connection's PD.
    pub fn reg(&mut self, len: usize, access: Access) -> Buf {
        self.reg_in(PD, len, access)
    }

    pub fn write(&self, buf: &Buf, off: usize, data: &[u8]) {
        self.regions[buf.idx].write_at(off, data).unwrap();
    }

    pub fn read(&self, buf: &Buf, off: usize, len: usize) -> Vec<u8> {
        self.regions[buf.idx].to_vec(off, len).unwrap()
    }

    pub fn load_u64(&self, buf: &Buf, off: usize) -> u64 {
        self.regions[buf.idx].load_u64(off).unwrap()
    }

    pub fn store_u64(&self, buf: &Buf, off: usize, v: u64) {
        self.regions[buf.idx].store_u64(off, v).unwrap()
    }

    pub fn post_send(
        &mut self,
        wr_id: u64,
        op: SendOp,
        sg_list: Vec<Sge>,
    ) -> Result<(), PostError> {
        let env = Env {
            mem: &self.mem,
            srq: self.srq.as_ref(),
        };
        let r = self.conn.post_send(
            SendWr {
                wr_id,
                op,
                sg_list,
                signaled: true,
                fence: false,
            },
            &env,
        );
        self.drain();
        r
    }

    pub fn post(&mut self, wr_id: u64, op: SendOp, sg_list: Vec<Sge>) {
        self.post_send(wr_id, op, sg_list).unwrap()
    }

    pub fn recv(&mut self, wr_id: u64, sg_list: Vec<Sge>) {
        let wr = RecvWr { wr_id, sg_list };
        match &self.srq {
            Some(srq) => srq.post_recv(wr).unwrap(),
            None => {
                self.conn.post_recv(wr).unwrap();
                // As the device does: a message that waited for a
                // Receive takes this one.
                let env = Env {
                    mem: &self.mem,
                    srq: None,
                };
                self.conn.resume_held(&env);
            }
        }
        self.drain();
    }

    /// Feed bytes as received from the stream (in `rx_chunk` pieces).
    pub fn handle(&mut self, bytes: &[u8]) {
        for piece in bytes.chunks(self.rx_chunk.max(1)) {
            let env = Env {
                mem: &self.mem,
                srq: self.srq.as_ref(),
            };
            self.conn.handle_bytes(piece, &env);
        }
        self.drain();
    }

    /// Everything the connection has to send, split into FPDUs.
    pub fn transmit(&mut self) -> bool {
        let mut out = Vec::new();
        for _ in 0..10_000 {
            let env = Env {
                mem: &self.mem,
                srq: self.srq.as_ref(),
            };
            if !self.conn.poll_transmit(&env, &mut out, 1 << 20) {
                // Perform a Commit the responses wait for, as a driver does.
                match self.conn.poll_durability() {
                    Some(job) => self.conn.handle_commit_done(job.req_id, job.run(&self.mem)),
                    None => break,
                }
            }
            assert!(out.len() < 64 << 20, "runaway transmit");
        }
        self.drain();
        if out.is_empty() {
            return false;
        }
        self.sent_log.extend_from_slice(&out);
        if self.markers_tx {
            self.outbound.push_back(out);
        } else {
            self.outbound.extend(split_fpdus(&out));
        }
        true
    }

    /// Move completions and events out of the connection.
    pub fn drain(&mut self) {
        while let Some(c) = self.conn.poll_completion() {
            self.completions.push(c);
        }
        while let Some(e) = self.conn.poll_event() {
            self.events.push(e);
        }
    }

    pub fn state(&self) -> QpState {
        self.conn.state()
    }

    /// Completions of one CQ side.
    pub fn cq(&self, side: CqSide) -> Vec<WorkCompletion> {
        self.completions
            .iter()
            .filter(|(s, _)| *s == side)
            .map(|(_, c)| *c)
            .collect()
    }

    pub fn sent_terminate(&self) -> Option<TerminateCause> {
        self.events.iter().find_map(|e| match e {
            Event::TerminateSent(c) => Some(*c),
            _ => None,
        })
    }

    pub fn got_terminate(&self) -> Option<TerminateCause> {
        self.events.iter().find_map(|e| match e {
            Event::TerminateReceived(c) => Some(*c),
            _ => None,
        })
    }

    /// Every ULPDU this host sent, decoded (markers and CRC as negotiated).
    pub fn sent_frames(&self) -> Vec<(RdmapRepr, Vec<u8>)> {
        let mut d = Deframer::new(DeframerConfig {
            crc: self.crc,
            markers: self.markers_tx,
            max_ulpdu_len: u16::MAX,
        });
        let mut input = &self.sent_log[..];
        let mut out = Vec::new();
        while let Some(u) = d.poll(&mut input).unwrap() {
            let (repr, payload) = RdmapRepr::parse(&u).unwrap();
            out.push((repr, payload.to_vec()));
        }
        out
    }
}

/// Split a marker-free FPDU stream at FPDU boundaries (a trailing partial
/// FPDU stays one element).
pub fn split_fpdus(mut bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while bytes.len() >= LENGTH_LEN {
        let ulpdu = u16::from_be_bytes([bytes[0], bytes[1]]) as usize;
        let n = fpdu_len(ulpdu).min(bytes.len());
        out.push(bytes[..n].to_vec());
        bytes = &bytes[n..];
    }
    if !bytes.is_empty() {
        out.push(bytes.to_vec());
    }
    out
}

/// A direction on the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    AtoB,
    BtoA,
}

/// Parameters of a harness connection.
#[derive(Clone)]
pub struct Config {
    pub a: MpaParams,
    pub b: MpaParams,
    pub caps_a: QpCaps,
    pub caps_b: QpCaps,
    /// `b` draws its receives from an SRQ.
    pub srq_b: bool,
    /// MPA Request/Reply are fed in pieces of this size.
    pub mpa_chunk: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            a: MpaParams::default(),
            b: MpaParams::default(),
            caps_a: QpCaps::default(),
            caps_b: QpCaps::default(),
            srq_b: false,
            mpa_chunk: 1,
        }
    }
}

/// Two connected hosts; `a` sent the MPA Request.
pub struct Pair {
    pub a: Host,
    pub b: Host,
    pub link_up: bool,
    /// Cut the link once this many bytes (both directions together) have
    /// crossed: the receiver gets exactly the bytes before the cut.
    pub cut_at: Option<usize>,
    pub crossed: usize,
}

impl Pair {
    pub fn new() -> Pair {
        Pair::with(Config::default())
    }

    /// Run the MPA exchange through `setup.rs` and build both connections.
    pub fn with(cfg: Config) -> Pair {
        let (mut init, request) = Initiator::new(cfg.a.clone()).unwrap();
        let mut reader = Request::reader();
        let mut req = None;
        for piece in request.chunks(cfg.mpa_chunk.max(1)) {
            let mut input = piece;
            assert!(req.is_none(), "bytes after the MPA Request");
            req = reader
                .read(&mut input)
                .unwrap()
                .map(|r| Request::from_repr(&r));
            assert!(input.is_empty());
        }
        let req = req.expect("whole MPA Request");
        let (neg_b, reply) = req.accept(&cfg.b).unwrap();
        let mut answer = None;
        for piece in reply.chunks(cfg.mpa_chunk.max(1)) {
            let mut input = piece;
            assert!(answer.is_none(), "bytes after the MPA Reply");
            answer = init.handle_bytes(&mut input).unwrap();
            assert!(input.is_empty());
        }
        let Some(Answer::Accepted(neg_a)) = answer else {
            panic!("not accepted: {answer:?}");
        };
        let a = Connection::new(1, PD, cfg.caps_a, neg_a, false);
        let b = Connection::new(2, PD, cfg.caps_b, neg_b, cfg.srq_b);
        let srq = cfg.srq_b.then(|| Srq::new(1024, 8));
        let mut p = Pair {
            a: Host::new(a, None),
            b: Host::new(b, srq),
            link_up: true,
            cut_at: None,
            crossed: 0,
        };
        p.a.drain();
        p.b.drain();
        p
    }

    pub fn host(&mut self, d: Dir) -> (&mut Host, &mut Host) {
        match d {
            Dir::AtoB => (&mut self.a, &mut self.b),
            Dir::BtoA => (&mut self.b, &mut self.a),
        }
    }

    /// The FPDUs in flight in direction `d`.
    pub fn queue(&mut self, d: Dir) -> &mut VecDeque<Vec<u8>> {
        &mut self.host(d).0.outbound
    }

    /// Both hosts transmit into their queues (nothing is delivered).
    pub fn transmit(&mut self) -> bool {
        if !self.link_up {
            return false;
        }
        let a = self.a.transmit();
        let b = self.b.transmit();
        a | b
    }

    /// Deliver everything queued in direction `d` (up to a pending cut).
    pub fn deliver(&mut self, d: Dir) -> bool {
        let mut moved = false;
        while self.link_up {
            let Some(mut fpdu) = self.queue(d).pop_front() else {
                break;
            };
            moved = true;
            let mut cut = false;
            if let Some(limit) = self.cut_at {
                let room = limit.saturating_sub(self.crossed);
                if fpdu.len() >= room {
                    fpdu.truncate(room);
                    cut = true;
                }
            }
            self.crossed += fpdu.len();
            self.host(d).1.handle(&fpdu);
            if cut {
                self.break_link();
            }
        }
        moved
    }

    /// The stream breaks (TCP reset or close seen by both ends).
    pub fn break_link(&mut self) {
        if !self.link_up {
            return;
        }
        self.link_up = false;
        self.a.outbound.clear();
        self.b.outbound.clear();
        self.a.conn.handle_closed();
        self.b.conn.handle_closed();
        self.a.drain();
        self.b.drain();
    }

    /// One round: both transmit, both queues delivered, closes honoured.
    pub fn step(&mut self) -> bool {
        let mut progress = self.transmit();
        progress |= self.deliver(Dir::AtoB);
        progress |= self.deliver(Dir::BtoA);
        if self.link_up {
            let a_close = self.a.conn.wants_close() && self.a.outbound.is_empty();
            let b_close = self.b.conn.wants_close() && self.b.outbound.is_empty();
            if a_close || b_close {
                self.break_link();
                progress = true;
            }
        }
        progress
    }

    /// Step until nothing moves.
    pub fn drive(&mut self) {
        for _ in 0..100_000 {
            if !self.step() {
                return;
            }
        }
        panic!("the pair did not settle");
    }

    // ---- queue edits ----

    /// Put raw bytes (e.g. from [`Raw`]) on the link in direction `d`.
    pub fn inject(&mut self, d: Dir, bytes: Vec<u8>) {
        self.queue(d).push_back(bytes);
    }

    /// Flip bit `bit` of byte `byte` of the `i`th queued FPDU.
    pub fn flip_bit(&mut self, d: Dir, i: usize, byte: usize, bit: u8) {
        self.queue(d)[i][byte] ^= 1 << bit;
    }

    pub fn drop_fpdu(&mut self, d: Dir, i: usize) -> Vec<u8> {
        self.queue(d).remove(i).unwrap()
    }

    pub fn dup_fpdu(&mut self, d: Dir, i: usize) {
        let f = self.queue(d)[i].clone();
        self.queue(d).insert(i + 1, f);
    }

    pub fn swap_fpdus(&mut self, d: Dir, i: usize, j: usize) {
        self.queue(d).swap(i, j);
    }

    /// Re-split everything queued in `d` into pieces of the given sizes
    /// (cycled), ignoring FPDU boundaries.
    pub fn rechunk(&mut self, d: Dir, sizes: &[usize]) {
        let q = self.queue(d);
        let all: Vec<u8> = q.drain(..).flatten().collect();
        let mut rest = &all[..];
        let mut k = 0;
        while !rest.is_empty() {
            let n = sizes[k % sizes.len()].clamp(1, rest.len());
            q.push_back(rest[..n].to_vec());
            rest = &rest[n..];
            k += 1;
        }
    }
}

impl Default for Pair {
    fn default() -> Self {
        Pair::new()
    }
}

/// A malicious (or merely scripted) peer: frames any RDMAP header and
/// payload it is told to, with its own MSNs, through the wire codecs.
pub struct Raw {
    framer: Framer,
    pub msn: [u32; 4],
}

impl Raw {
    /// A raw sender for a stream with the given CRC setting, no markers.
    pub fn new(crc: bool) -> Raw {
        Raw {
            framer: Framer::new(FramerConfig {
                crc,
                markers: false,
            }),
            msn: [1; 4],
        }
    }

    /// The next MSN on untagged queue `qn`.
    pub fn next_msn(&mut self, qn: usize) -> u32 {
        let m = self.msn[qn];
        self.msn[qn] = m.wrapping_add(1);
        m
    }

    /// One FPDU carrying `repr` and `payload`.
    pub fn frame(&mut self, repr: &RdmapRepr, payload: &[u8]) -> Vec<u8> {
        let mut header = vec![0u8; repr.header_len()];
        repr.emit(&mut header);
        let mut out = Vec::new();
        self.framer.frame(&[&header, payload], &mut out).unwrap();
        out
    }
}

/// The length of a marker-free FPDU's framing around its ULPDU.
pub const FRAMING: usize = LENGTH_LEN + CRC_LEN;

/// Assert the Terminate `detector` sent and `other` received.
pub fn assert_terminate(p: &Pair, detector_is_a: bool, etype: ErrorType, ecode: u8) {
    let (det, oth) = if detector_is_a {
        (&p.a, &p.b)
    } else {
        (&p.b, &p.a)
    };
    let sent = det
        .sent_terminate()
        .unwrap_or_else(|| panic!("no Terminate sent; events {:?}", det.events));
    assert_eq!((sent.etype, sent.ecode), (etype, ecode), "sent {sent:?}");
    if p.cut_at.is_none() {
        let got = oth
            .got_terminate()
            .unwrap_or_else(|| panic!("no Terminate received; events {:?}", oth.events));
        assert_eq!(got, sent);
    }
    assert_eq!(det.state(), QpState::Error);
    assert_eq!(oth.state(), QpState::Error);
}

/// Assert every WR id in `posted` completed exactly once on `side`, and
/// return the completions keyed by id.
pub fn exactly_once(h: &Host, side: CqSide, posted: &[u64]) -> Vec<WorkCompletion> {
    let cq = h.cq(side);
    let mut ids: Vec<u64> = cq.iter().map(|c| c.wr_id).collect();
    ids.sort_unstable();
    let mut want = posted.to_vec();
    want.sort_unstable();
    assert_eq!(ids, want, "completions {cq:?}");
    cq
}

/// The statuses a flushed or finished WR may have.
pub fn success_or_flush(c: &WorkCompletion) -> bool {
    matches!(c.status, WcStatus::Success | WcStatus::WrFlushErr)
}
