//! Wire interop between the userspace provider and kernel soft-iWARP (siw):
//! VM-only, every case `#[ignore]`d, so `cargo test` outside the VM skips
//! them all.
//!
//! Runs inside the test VM (`scripts/vm/vm.sh -- scripts/vm/interop.sh`), where
//! `siw0` sits on `$STAG_SIW_ADDR` (10.12.0.1). Each case connects our
//! provider and a plain rdma_cm endpoint on siw0 (through `verbs::ibv`, so
//! no stag header and no agent connection) in one process, then runs Send,
//! RDMA Write and RDMA Read in both directions at several sizes, checks the
//! data on both sides, and checks that no Terminate was sent or received.
//! interop.sh runs each case as its own process:
//!
//! ```text
//! siw_interop --ignored --exact --nocapture --test-threads=1 stag_client_crc
//! ```
//!
//! Cases (test names; the output spells them with `-`): `stag_client_crc`,
//! `stag_client_nocrc` (we initiate, siw0 listens), `siw_client_crc`,
//! `siw_client_nocrc` (siw0 initiates, we listen; siw's own module default
//! is CRC off, our Reply's C bit turns it on), `stag_client_p2p_write`,
//! `stag_client_p2p_read` (we initiate in peer-to-peer mode and send the
//! RTR frame siw chose; siw cannot initiate in that mode: its
//! `peer_to_peer` is a compile-time constant, off), `terminate_from_siw`
//! (we Read with a bad STag: siw's Terminate must decode as RDMAP / remote
//! protection / invalid STag) and `terminate_to_siw` (siw Writes with a
//! bad STag: we send DDP / tagged buffer / invalid STag). Each prints one
//! line per check and `interop: N passed, M failed`, and fails if any
//! check did.
//!
//! `scripts/vm/fpdu-dump.py CAPTURE.pcap` decodes the captures that
//! `STAG_INTEROP_PCAP` makes interop.sh write.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use provider::cq::CompletionQueue as StagCq;
use provider::device::{Device, Listener, MemoryRegion as StagMr, QueuePair as StagQp};
use provider::mem::Access;
use provider::qp::{Event, QpCaps as StagCaps};
use provider::region::Region;
use provider::setup::{MpaParams, RtrModes};
use provider::wire::ErrorType;
use provider::wr::{RecvWr, Remote, SendOp, SendWr, Sge as StagSge, WcStatus, WorkCompletion};
use verbs::ibv::{
    self, AccessFlags, CmEventType, CmId, CompletionQueue, ConnParam, EventChannel, MemoryRegion,
    QpInitAttr, QueuePair, SendFlags, Sge,
};

/// Bytes per buffer on each side: receive slots, Write/Read target, source
/// and Read sink.
const BUF: usize = 6 * SLOT;
/// Transfer sizes: odd (pad bytes), one page less 3, several FPDUs.
const SIZES: [usize; 3] = [1, 4093, 200_000];
/// Where receives land (one slot per size, 256 KiB each).
const RECV_BASE: usize = 0;
const SLOT: usize = 256 << 10;
/// Where sends/writes come from and Reads read.
const SRC: usize = 4 * SLOT;
const TIMEOUT: Duration = Duration::from_secs(20);

type Res<T> = Result<T, String>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Who {
    StagClient,
    SiwClient,
}

/// What a case does once connected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    /// Every data check; no Terminate may appear.
    Data,
    /// We Read with a bad STag: siw must answer with a Terminate (RDMAP,
    /// remote protection, invalid STag) that we decode as such.
    SiwTerminates,
    /// siw Writes with a bad STag: we send a Terminate (DDP, tagged buffer
    /// error, invalid STag); siw's Write fails.
    StagTerminates,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    plan: Plan,
    name: &'static str,
    who: Who,
    crc: bool,
    p2p: Option<RtrModes>,
}

const WRITE_RTR: RtrModes = RtrModes {
    send: false,
    write: true,
    read: false,
};
const READ_RTR: RtrModes = RtrModes {
    send: false,
    write: false,
    read: true,
};

const CASES: [Case; 8] = [
    Case {
        plan: Plan::Data,
        name: "stag-client-crc",
        who: Who::StagClient,
        crc: true,
        p2p: None,
    },
    Case {
        plan: Plan::Data,
        name: "stag-client-nocrc",
        who: Who::StagClient,
        crc: false,
        p2p: None,
    },
    Case {
        plan: Plan::Data,
        name: "siw-client-crc",
        who: Who::SiwClient,
        crc: true,
        p2p: None,
    },
    Case {
        plan: Plan::Data,
        name: "siw-client-nocrc",
        who: Who::SiwClient,
        crc: false,
        p2p: None,
    },
    Case {
        plan: Plan::Data,
        name: "stag-client-p2p-write",
        who: Who::StagClient,
        crc: true,
        p2p: Some(WRITE_RTR),
    },
    Case {
        plan: Plan::Data,
        name: "stag-client-p2p-read",
        who: Who::StagClient,
        crc: false,
        p2p: Some(READ_RTR),
    },
    Case {
        plan: Plan::SiwTerminates,
        name: "terminate-from-siw",
        who: Who::StagClient,
        crc: true,
        p2p: None,
    },
    Case {
        plan: Plan::StagTerminates,
        name: "terminate-to-siw",
        who: Who::StagClient,
        crc: true,
        p2p: None,
    },
];

/// Deterministic test data, different per size and direction.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(31).wrapping_add(seed as u32 * 7) as u8 ^ seed)
        .collect()
}

// ---------------------------------------------------------------------------
// The siw side: raw rdma_cm + libibverbs on siw0.

struct SiwSide {
    id: CmId,
    cq: Arc<CompletionQueue>,
    qp: QueuePair,
    mr: MemoryRegion,
    buf: Region,
}

impl SiwSide {
    fn new(id: CmId) -> Res<SiwSide> {
        let ctx = id.context().map_err(|e| format!("cm id context: {e}"))?;
        let pd = ctx.alloc_pd().map_err(|e| format!("alloc_pd: {e}"))?;
        let cq = ctx
            .create_cq(256, None, 0)
            .map_err(|e| format!("create_cq: {e}"))?;
        let caps = QpInitAttr {
            max_send_wr: 64,
            max_recv_wr: 64,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
            sq_sig_all: false,
            send_ops: None,
        };
        let qp = id
            .create_qp(&pd, &cq, &cq, &caps)
            .map_err(|e| format!("rdma_create_qp: {e}"))?;
        let buf = Region::anonymous(BUF).map_err(|e| format!("region: {e}"))?;
        let access =
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        // SAFETY: `buf` is a private anonymous mapping owned by this struct;
        // `mr` is declared before `buf`, so it is deregistered before the
        // mapping goes away. The process only touches the mapping through
        // Region's copying accessors.
        let mr = unsafe { pd.reg_mr(buf.as_ptr().as_ptr(), BUF, access) }
            .map_err(|e| format!("ibv_reg_mr: {e}"))?;
        Ok(SiwSide {
            id,
            cq,
            qp,
            mr,
            buf,
        })
    }

    fn sge(&self, off: usize, len: usize) -> Sge {
        Sge::from_mr(&self.mr, off, len as u32).expect("sge in range")
    }

    /// Our address and rkey for the peer: addr (8, LE) + rkey (4, LE).
    fn token(&self) -> Vec<u8> {
        let mut v = self.mr.addr().to_le_bytes().to_vec();
        v.extend_from_slice(&self.mr.rkey().to_le_bytes());
        v
    }

    fn post_recvs(&self) -> Res<()> {
        for (i, _) in SIZES.iter().enumerate() {
            let sges = [self.sge(RECV_BASE + i * SLOT, SLOT)];
            // SAFETY: the SGE lies in `mr`, which outlives every completion
            // this program waits for (the QP is destroyed first).
            unsafe {
                self.qp.post_recv(&[ibv::RecvWr {
                    wr_id: 100 + i as u64,
                    sges: &sges,
                }])
            }
            .map_err(|(e, _)| format!("ibv_post_recv: {e}"))?;
        }
        Ok(())
    }

    fn post(&self, wr_id: u64, op: ibv::SendOp, off: usize, len: usize) -> Res<()> {
        let sges = [self.sge(off, len)];
        let wr = ibv::SendWr {
            wr_id,
            op,
            sges: &sges,
            flags: SendFlags::SIGNALED,
        };
        // SAFETY: as in post_recvs: the SGE lies in `mr`.
        unsafe { self.qp.post_send(&[wr]) }.map_err(|(e, _)| format!("ibv_post_send: {e}"))
    }

    fn wait(&self, wr_id: u64) -> Res<ibv::WorkCompletion> {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            match self.cq.poll_one().map_err(|e| format!("poll_cq: {e}"))? {
                Some(wc) if !wc.is_ok() => {
                    return Err(format!(
                        "siw completion {} failed: {} (vendor_err {:#x})",
                        wc.wr_id,
                        wc.status.as_str(),
                        wc.vendor_err
                    ))
                }
                Some(wc) if wc.wr_id == wr_id => return Ok(wc),
                Some(wc) => return Err(format!("siw: expected wr {wr_id}, got {wc:?}")),
                None if Instant::now() > deadline => {
                    return Err(format!("siw: no completion for wr {wr_id}"))
                }
                None => std::thread::sleep(Duration::from_micros(200)),
            }
        }
    }
}

fn siw_conn_param(private_data: Vec<u8>) -> ConnParam {
    ConnParam {
        private_data,
        responder_resources: 8,
        initiator_depth: 8,
        retry_count: 7,
        rnr_retry_count: 7,
    }
}

// ---------------------------------------------------------------------------
// Our side: the userspace provider.

struct StagSide {
    _dev: Device,
    cq: Arc<StagCq>,
    qp: StagQp,
    mr: StagMr,
    /// Every connection event so far (take_events drains the QP's).
    events: std::sync::Mutex<Vec<Event>>,
}

impl StagSide {
    fn new() -> Res<StagSide> {
        let dev = Device::open("interop").map_err(|e| e.to_string())?;
        let pd = dev.alloc_pd();
        let cq = StagCq::new(256).map_err(|e| e.to_string())?;
        let qp = pd.create_qp(StagCaps::default(), &cq, &cq, None);
        let buf = Region::anonymous(BUF).map_err(|e| e.to_string())?;
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let iova = buf.addr(0);
        let mr = pd
            .register(buf, iova, access)
            .map_err(|e| format!("reg_mr: {e}"))?;
        Ok(StagSide {
            _dev: dev,
            cq,
            qp,
            mr,
            events: Default::default(),
        })
    }

    fn sge(&self, off: usize, len: usize) -> StagSge {
        self.mr.sge(off, len as u32)
    }

    fn events(&self) -> Vec<Event> {
        let mut ev = self.events.lock().unwrap();
        ev.extend(self.qp.take_events());
        ev.clone()
    }

    fn token(&self) -> Vec<u8> {
        let mut v = self.mr.iova().to_le_bytes().to_vec();
        v.extend_from_slice(&self.mr.stag().to_le_bytes());
        v
    }

    fn post_recvs(&self) -> Res<()> {
        for (i, _) in SIZES.iter().enumerate() {
            self.qp
                .post_recv(RecvWr {
                    wr_id: 100 + i as u64,
                    sg_list: vec![self.sge(RECV_BASE + i * SLOT, SLOT)],
                })
                .map_err(|e| format!("post_recv: {e}"))?;
        }
        Ok(())
    }

    fn post(&self, wr_id: u64, op: SendOp, off: usize, len: usize) -> Res<()> {
        self.qp
            .post_send(SendWr {
                wr_id,
                op,
                sg_list: vec![self.sge(off, len)],
                signaled: true,
                fence: false,
            })
            .map_err(|e| format!("post_send: {e}"))
    }

    fn wait(&self, wr_id: u64) -> Res<WorkCompletion> {
        let deadline = Instant::now() + TIMEOUT;
        let mut wc = [WorkCompletion::BLANK; 1];
        loop {
            if self.cq.poll(&mut wc) == 1 {
                let wc = wc[0];
                if wc.status != WcStatus::Success {
                    return Err(format!(
                        "stag completion {} failed: {:?}; events {:?}",
                        wc.wr_id,
                        wc.status,
                        self.events()
                    ));
                }
                if wc.wr_id != wr_id {
                    return Err(format!("stag: expected wr {wr_id}, got {wc:?}"));
                }
                return Ok(wc);
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "stag: no completion for wr {wr_id}; events {:?}",
                    self.events()
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

fn parse_token(pd: &[u8]) -> Res<(u64, u32)> {
    if pd.len() < 12 {
        return Err(format!("peer private data too short: {pd:02x?}"));
    }
    Ok((
        u64::from_le_bytes(pd[..8].try_into().unwrap()),
        u32::from_le_bytes(pd[8..12].try_into().unwrap()),
    ))
}

// ---------------------------------------------------------------------------
// Connection setup.

struct Pair {
    siw: SiwSide,
    stag: StagSide,
    /// siw's buffer as our provider addresses it.
    siw_remote: Remote,
    /// Our buffer as siw addresses it.
    stag_remote: (u64, u32),
    // Keeps the listening id alive for the connection's lifetime.
    _listen: Option<CmId>,
    _ch: Arc<EventChannel>,
}

fn siw_ip() -> Res<IpAddr> {
    std::env::var("STAG_SIW_ADDR")
        .unwrap_or_else(|_| "10.12.0.1".into())
        .parse()
        .map_err(|e| format!("STAG_SIW_ADDR: {e}"))
}

fn mpa_params(case: &Case, private_data: Vec<u8>) -> MpaParams {
    MpaParams {
        revision: 2,
        crc: case.crc,
        markers: false,
        ird: 8,
        ord: 8,
        p2p: case.p2p,
        private_data,
    }
}

/// We initiate, siw0 listens.
fn connect_stag_client(case: &Case) -> Res<Pair> {
    let ip = siw_ip()?;
    let ch = EventChannel::new().map_err(|e| format!("event channel: {e}"))?;
    let listen = CmId::new(&ch).map_err(|e| format!("rdma_create_id: {e}"))?;
    listen
        .bind_addr(SocketAddr::new(ip, 0))
        .map_err(|e| format!("rdma_bind_addr {ip}: {e}"))?;
    listen.listen(4).map_err(|e| format!("rdma_listen: {e}"))?;
    let port = listen.local_addr().ok_or("listener has no address")?.port();
    let stag = StagSide::new()?;
    stag.post_recvs()?;
    let params = mpa_params(case, stag.token());
    let (siw, reply) = std::thread::scope(|s| {
        let stag = &stag;
        let h = s.spawn(move || {
            stag.qp
                .connect(SocketAddr::new(ip, port), &params)
                .map_err(|e| format!("stag connect: {e}"))
        });
        let siw = (|| {
            let mut req = ch
                .expect(CmEventType::ConnectRequest)
                .map_err(|e| format!("CONNECT_REQUEST: {e}"))?;
            let peer_pd = req.private_data.clone();
            let siw = SiwSide::new(req.new_id.take().ok_or("no new id")?)?;
            siw.post_recvs()?;
            siw.id
                .accept(&siw_conn_param(siw.token()))
                .map_err(|e| format!("rdma_accept: {e}"))?;
            Ok::<_, String>((siw, peer_pd))
        })();
        let reply = h
            .join()
            .unwrap_or_else(|_| Err("stag connect panicked".into()));
        (siw, reply)
    });
    let (siw, peer_pd) = siw?;
    let reply = reply?;
    ch.expect(CmEventType::Established)
        .map_err(|e| format!("siw ESTABLISHED: {e}"))?;
    let (addr, rkey) = parse_token(&reply)?;
    let stag_remote = parse_token(&peer_pd)?;
    Ok(Pair {
        siw,
        stag,
        siw_remote: Remote { addr, rkey },
        stag_remote,
        _listen: Some(listen),
        _ch: ch,
    })
}

/// siw0 initiates, we listen on siw0's address.
fn connect_siw_client(case: &Case) -> Res<Pair> {
    let ip = siw_ip()?;
    let listener =
        Listener::bind(SocketAddr::new(ip, 0)).map_err(|e| format!("stag listen: {e}"))?;
    let port = listener
        .local_addr()
        .map_err(|e| format!("local_addr: {e}"))?
        .port();
    let stag = StagSide::new()?;
    stag.post_recvs()?;
    let params = mpa_params(case, stag.token());
    let ch = EventChannel::new().map_err(|e| format!("event channel: {e}"))?;
    let cid = CmId::new(&ch).map_err(|e| format!("rdma_create_id: {e}"))?;
    cid.resolve_addr(None, SocketAddr::new(ip, port), 2000)
        .map_err(|e| format!("rdma_resolve_addr: {e}"))?;
    ch.expect(CmEventType::AddrResolved)
        .map_err(|e| format!("ADDR_RESOLVED: {e}"))?;
    cid.resolve_route(2000)
        .map_err(|e| format!("rdma_resolve_route: {e}"))?;
    ch.expect(CmEventType::RouteResolved)
        .map_err(|e| format!("ROUTE_RESOLVED: {e}"))?;
    let siw = SiwSide::new(cid)?;
    siw.post_recvs()?;
    let (peer_pd, est) = std::thread::scope(|s| {
        let stag = &stag;
        let h = s.spawn(move || {
            let req = listener
                .accept()
                .map_err(|e| format!("stag accept: {e}"))?;
            let r = req.request().clone();
            println!(
                "  siw's MPA Request: revision {}, crc {}, markers {}, ird/ord {:?}, {} bytes private data",
                r.revision,
                r.crc,
                r.markers,
                r.ird_ord,
                r.private_data.len()
            );
            req.accept(&stag.qp, &params)
                .map_err(|e| format!("stag accept: {e}"))?;
            Ok::<_, String>(r.private_data)
        });
        let est = siw
            .id
            .connect(&siw_conn_param(siw.token()))
            .map_err(|e| format!("rdma_connect: {e}"))
            .and_then(|()| {
                ch.expect(CmEventType::Established)
                    .map_err(|e| format!("siw ESTABLISHED: {e}"))
            });
        let pd = h
            .join()
            .unwrap_or_else(|_| Err("stag accept panicked".into()));
        (pd, est)
    });
    let peer_pd = peer_pd?;
    let est = est?;
    let (addr, rkey) = parse_token(&peer_pd)?;
    let stag_remote = parse_token(&est.private_data)?;
    Ok(Pair {
        siw,
        stag,
        siw_remote: Remote { addr, rkey },
        stag_remote,
        _listen: None,
        _ch: ch,
    })
}

// ---------------------------------------------------------------------------
// The checks.

struct Tally {
    passed: usize,
    failed: usize,
}

impl Tally {
    fn record(&mut self, case: &str, what: &str, r: Res<()>) -> bool {
        match r {
            Ok(()) => {
                self.passed += 1;
                println!("ok   {case:<22} {what}");
                true
            }
            Err(e) => {
                self.failed += 1;
                println!("FAIL {case:<22} {what}: {e}");
                false
            }
        }
    }
}

fn check_eq(what: &str, got: Vec<u8>, want: &[u8]) -> Res<()> {
    if got == want {
        return Ok(());
    }
    let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
    Err(format!(
        "{what}: data differs at byte {at} of {} (got {:02x?}, want {:02x?})",
        want.len(),
        &got[at..(at + 8).min(got.len())],
        &want[at..(at + 8).min(want.len())]
    ))
}

fn send_to_siw(p: &Pair, i: usize, len: usize) -> Res<()> {
    let data = pattern(len, 1 + i as u8);
    p.stag
        .mr
        .region()
        .write_at(SRC, &data)
        .map_err(|e| e.to_string())?;
    p.stag.post(
        1,
        SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        SRC,
        len,
    )?;
    p.stag.wait(1)?;
    let wc = p.siw.wait(100 + i as u64)?;
    if wc.byte_len as usize != len {
        return Err(format!("siw received {} bytes, want {len}", wc.byte_len));
    }
    check_eq(
        "siw receive buffer",
        p.siw.buf.to_vec(RECV_BASE + i * SLOT, len).unwrap(),
        &data,
    )
}

fn send_to_stag(p: &Pair, i: usize, len: usize) -> Res<()> {
    let data = pattern(len, 11 + i as u8);
    p.siw.buf.write_at(SRC, &data).map_err(|e| e.to_string())?;
    p.siw.post(2, ibv::SendOp::Send, SRC, len)?;
    p.siw.wait(2)?;
    let wc = p.stag.wait(100 + i as u64)?;
    if wc.byte_len as usize != len {
        return Err(format!("stag received {} bytes, want {len}", wc.byte_len));
    }
    check_eq(
        "stag receive buffer",
        p.stag
            .mr
            .region()
            .to_vec(RECV_BASE + i * SLOT, len)
            .unwrap(),
        &data,
    )
}

/// Where Writes land and Reads read in the peer's buffer.
const DST: usize = 3 * SLOT;

fn write_to_siw(p: &Pair, i: usize, len: usize) -> Res<()> {
    let data = pattern(len, 21 + i as u8);
    p.stag
        .mr
        .region()
        .write_at(SRC, &data)
        .map_err(|e| e.to_string())?;
    let remote = Remote {
        addr: p.siw_remote.addr + DST as u64,
        rkey: p.siw_remote.rkey,
    };
    p.stag.post(3, SendOp::Write { remote }, SRC, len)?;
    p.stag.wait(3)?;
    // A Read behind the Write returns only after the Write was placed.
    p.stag.post(4, SendOp::Read { remote }, SRC + SLOT, len)?;
    p.stag.wait(4)?;
    check_eq(
        "siw memory after Write",
        p.siw.buf.to_vec(DST, len).unwrap(),
        &data,
    )?;
    check_eq(
        "stag Read back",
        p.stag.mr.region().to_vec(SRC + SLOT, len).unwrap(),
        &data,
    )
}

fn read_from_siw(p: &Pair, i: usize, len: usize) -> Res<()> {
    let data = pattern(len, 31 + i as u8);
    p.siw.buf.write_at(DST, &data).map_err(|e| e.to_string())?;
    let remote = Remote {
        addr: p.siw_remote.addr + DST as u64,
        rkey: p.siw_remote.rkey,
    };
    p.stag.post(5, SendOp::Read { remote }, SRC, len)?;
    p.stag.wait(5)?;
    check_eq(
        "stag Read result",
        p.stag.mr.region().to_vec(SRC, len).unwrap(),
        &data,
    )
}

fn write_to_stag(p: &Pair, i: usize, len: usize) -> Res<()> {
    let data = pattern(len, 41 + i as u8);
    p.siw.buf.write_at(SRC, &data).map_err(|e| e.to_string())?;
    let (addr, rkey) = p.stag_remote;
    let op = ibv::SendOp::RdmaWrite {
        rkey,
        remote_addr: addr + DST as u64,
    };
    p.siw.post(6, op, SRC, len)?;
    p.siw.wait(6)?;
    let op = ibv::SendOp::RdmaRead {
        rkey,
        remote_addr: addr + DST as u64,
    };
    p.siw.post(7, op, SRC + SLOT, len)?;
    p.siw.wait(7)?;
    check_eq(
        "stag memory after Write",
        p.stag.mr.region().to_vec(DST, len).unwrap(),
        &data,
    )?;
    check_eq(
        "siw Read back",
        p.siw.buf.to_vec(SRC + SLOT, len).unwrap(),
        &data,
    )
}

fn read_from_stag(p: &Pair, i: usize, len: usize) -> Res<()> {
    let data = pattern(len, 51 + i as u8);
    p.stag
        .mr
        .region()
        .write_at(DST, &data)
        .map_err(|e| e.to_string())?;
    let (addr, rkey) = p.stag_remote;
    let op = ibv::SendOp::RdmaRead {
        rkey,
        remote_addr: addr + DST as u64,
    };
    p.siw.post(8, op, SRC, len)?;
    p.siw.wait(8)?;
    check_eq(
        "siw Read result",
        p.siw.buf.to_vec(SRC, len).unwrap(),
        &data,
    )
}

type Check = fn(&Pair, usize, usize) -> Res<()>;

const CHECKS: [(&str, Check); 6] = [
    ("send stag->siw", send_to_siw),
    ("send siw->stag", send_to_stag),
    ("write stag->siw", write_to_siw),
    ("read stag<-siw", read_from_siw),
    ("write siw->stag", write_to_stag),
    ("read siw<-stag", read_from_stag),
];

fn run_case(case: &Case, t: &mut Tally) {
    println!("== {}", case.name);
    let pair = match case.who {
        Who::StagClient => connect_stag_client(case),
        Who::SiwClient => connect_siw_client(case),
    };
    let pair = match pair {
        Ok(p) => p,
        Err(e) => {
            t.record(case.name, "connect", Err(e));
            return;
        }
    };
    let neg = pair.stag.qp.negotiated();
    let r = match &neg {
        Some(n) if n.crc != case.crc => {
            Err(format!("negotiated crc {} (want {})", n.crc, case.crc))
        }
        Some(n) if n.rtr.is_some() != case.p2p.is_some() => {
            Err(format!("negotiated rtr {:?} (want {:?})", n.rtr, case.p2p))
        }
        Some(_) => Ok(()),
        None => Err("not connected".into()),
    };
    let n = neg.as_ref();
    let what = format!(
        "connect (revision {:?}, crc {:?}, ird {:?}, ord {:?}, rtr {:?})",
        n.map(|n| n.revision),
        n.map(|n| n.crc),
        n.map(|n| n.ird),
        n.map(|n| n.ord),
        n.and_then(|n| n.rtr)
    );
    if !t.record(case.name, &what, r) {
        return;
    }
    match case.plan {
        Plan::Data => {}
        Plan::SiwTerminates => {
            let remote = Remote {
                addr: pair.siw_remote.addr + DST as u64,
                rkey: pair.siw_remote.rkey ^ 0x5a00,
            };
            let r = pair
                .stag
                .post(9, SendOp::Read { remote }, SRC, 16)
                .and_then(|()| match pair.stag.wait(9) {
                    Ok(wc) => Err(format!("bad-STag Read succeeded: {wc:?}")),
                    Err(_) => Ok(()),
                })
                .and_then(|()| expect_terminate(&pair, false));
            t.record(case.name, "Read with a bad STag draws siw's Terminate", r);
            return;
        }
        Plan::StagTerminates => {
            let (addr, rkey) = pair.stag_remote;
            let op = ibv::SendOp::RdmaWrite {
                rkey: rkey ^ 0x5a00,
                remote_addr: addr + DST as u64,
            };
            // siw completes a Write once it is sent; our Terminate follows.
            let r = pair
                .siw
                .post(9, op, SRC, 16)
                .and_then(|()| expect_terminate(&pair, true));
            if r.is_ok() {
                // The Terminate moved siw's QP to Error: a later WR fails.
                let r2 = pair
                    .siw
                    .wait(9)
                    .and_then(|_| pair.siw.post(10, ibv::SendOp::Send, SRC, 1));
                let after = r2.and_then(|()| pair.siw.wait(10).map(|_| ()));
                println!("  siw after our Terminate: {after:?}");
            }
            t.record(case.name, "Write with a bad STag draws our Terminate", r);
            return;
        }
    }
    'outer: for (name, check) in CHECKS {
        for (i, &len) in SIZES.iter().enumerate() {
            if !t.record(case.name, &format!("{name} {len} B"), check(&pair, i, len)) {
                break 'outer;
            }
        }
    }
    // Give a late Terminate a moment to arrive.
    std::thread::sleep(Duration::from_millis(100));
    let events = pair.stag.events();
    let bad: Vec<_> = events
        .iter()
        .filter(|e| matches!(e, Event::TerminateSent(_) | Event::TerminateReceived(_)))
        .collect();
    t.record(
        case.name,
        "no Terminate",
        if bad.is_empty() {
            Ok(())
        } else {
            Err(format!("{bad:?}"))
        },
    );
    let _ = pair.siw.id.disconnect();
}

/// Wait for the Terminate event and check its cause.
fn expect_terminate(p: &Pair, sent: bool) -> Res<()> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let ev = p.stag.events();
        let found = ev.iter().find_map(|e| match e {
            Event::TerminateSent(c) if sent => Some(*c),
            Event::TerminateReceived(c) if !sent => Some(*c),
            _ => None,
        });
        if let Some(c) = found {
            println!("  stag events: {ev:?}");
            let want = if sent {
                (ErrorType::DdpTagged, 0x00)
            } else {
                (ErrorType::RdmapRemoteProtection, 0x00)
            };
            return if (c.etype, c.ecode) == want {
                Ok(())
            } else {
                Err(format!(
                    "Terminate cause {c:?}, want {want:?}; events {ev:?}"
                ))
            };
        }
        if Instant::now() > deadline {
            return Err(format!("no Terminate; events {ev:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Run the case named `name` (as in [`CASES`]) and fail if a check did.
fn run_named(name: &str) {
    let case = CASES
        .iter()
        .find(|c| c.name == name)
        .expect("a case of CASES");
    let mut t = Tally {
        passed: 0,
        failed: 0,
    };
    run_case(case, &mut t);
    println!("interop: {} passed, {} failed", t.passed, t.failed);
    assert!(
        t.failed == 0 && t.passed > 0,
        "{name}: {} checks failed, {} passed",
        t.failed,
        t.passed
    );
}

macro_rules! siw_cases {
    ($($test:ident => $name:literal,)*) => {
        $(
            #[test]
            #[ignore = "needs kernel siw0: runs in the VM (scripts/vm/interop.sh)"]
            fn $test() {
                run_named($name);
            }
        )*
        /// The cases that have a test.
        const TESTED: &[&str] = &[$($name),*];
    };
}

siw_cases! {
    stag_client_crc => "stag-client-crc",
    stag_client_nocrc => "stag-client-nocrc",
    siw_client_crc => "siw-client-crc",
    siw_client_nocrc => "siw-client-nocrc",
    stag_client_p2p_write => "stag-client-p2p-write",
    stag_client_p2p_read => "stag-client-p2p-read",
    terminate_from_siw => "terminate-from-siw",
    terminate_to_siw => "terminate-to-siw",
}

/// Runs everywhere: a case added to [`CASES`] without a test would never
/// run in the VM.
#[test]
fn every_case_has_a_test() {
    let cases: Vec<&str> = CASES.iter().map(|c| c.name).collect();
    assert_eq!(cases, TESTED);
}
