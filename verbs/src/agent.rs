//! The agent channel: what lets two stag peers emulate what their devices
//! lack (atomics on siw, Commit without a device FLUSH or into a
//! file-backed region, 8-byte Immediate Data).
//!
//! When either side of a connection needs it, the initiator opens a second
//! connection to the same listener, marked in its private data as the agent
//! channel of the first. Each side's library runs a thread on that channel
//! with its own receive buffers (never the application's): requests from
//! the peer are executed on local memory — atomics with the CPU's atomics,
//! Commit as msync of a file-backed region — and answered; answers to our
//! requests complete the application's work requests. Immediate Data goes
//! through a mailbox region the peer writes with RDMA Write.
//!
//! Private-data header (before the application's bytes):
//! `"STAG" | version 1 | flags (1 wants agent, 2 is agent channel, 4 native
//! set present) | native set u16 | token u64 | [agent channel only: mailbox
//! addr u64, mailbox rkey u32]`, integers little-endian. The native set
//! ([`OpSet`]) is what the sender's device executes as a responder; the
//! other end emulates what is missing from it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tracing::{debug, warn};

use provider::wr::{Remote, SendOp, WcStatus};

use crate::caps::OpSet;
use crate::cq::{Completion, CompletionKind, CompletionQueue};
use crate::device::{Context, ProtectionDomain};
use crate::error::{Error, Result};
use crate::mr::{Access, MemoryRegion};
use crate::qp::{QpInner, QueuePair, WorkRequest};

const MAGIC: &[u8; 4] = b"STAG";
const VERSION: u8 = 1;
const FLAG_WANTS_AGENT: u8 = 1;
const FLAG_IS_AGENT: u8 = 2;
const FLAG_NATIVE: u8 = 4;

/// The header stag puts in front of the application's private data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    /// This side needs an agent channel.
    pub wants_agent: bool,
    /// This connection is the agent channel of connection `token`.
    pub is_agent: bool,
    /// Names the main connection (chosen by the initiator).
    pub token: u64,
    /// Agent channel only: where the peer writes our Immediate Data.
    pub mailbox: Option<Remote>,
    /// What the sender's device executes natively ([`OpSet::RDMAP`] when
    /// a header carries no set).
    pub native: OpSet,
}

impl Hello {
    /// The header followed by `app`.
    pub fn encode(&self, app: &[u8]) -> Vec<u8> {
        let mut v = Vec::with_capacity(28 + app.len());
        v.extend_from_slice(MAGIC);
        v.push(VERSION);
        let mut flags = 0;
        if self.wants_agent {
            flags |= FLAG_WANTS_AGENT;
        }
        if self.is_agent {
            flags |= FLAG_IS_AGENT;
        }
        flags |= FLAG_NATIVE;
        v.push(flags);
        v.extend_from_slice(&self.native.bits().to_le_bytes());
        v.extend_from_slice(&self.token.to_le_bytes());
        if self.is_agent {
            let m = self.mailbox.unwrap_or(Remote { addr: 0, rkey: 0 });
            v.extend_from_slice(&m.addr.to_le_bytes());
            v.extend_from_slice(&m.rkey.to_le_bytes());
        }
        v.extend_from_slice(app);
        v
    }

    /// Split private data into stag's header (if the peer runs stag) and
    /// the application's bytes.
    pub fn decode(data: &[u8]) -> (Option<Hello>, &[u8]) {
        let Some(head) = data.get(..16) else {
            return (None, data);
        };
        if &head[..4] != MAGIC || head[4] != VERSION {
            return (None, data);
        }
        let flags = head[5];
        let native = if flags & FLAG_NATIVE != 0 {
            OpSet::from_bits(u16::from_le_bytes([head[6], head[7]]))
        } else {
            OpSet::RDMAP
        };
        let token = u64::from_le_bytes(head[8..16].try_into().unwrap_or([0; 8]));
        let is_agent = flags & FLAG_IS_AGENT != 0;
        let (mailbox, rest) = if is_agent {
            match data.get(16..28) {
                Some(m) => (
                    Some(Remote {
                        addr: u64::from_le_bytes(m[..8].try_into().unwrap_or([0; 8])),
                        rkey: u32::from_le_bytes(m[8..12].try_into().unwrap_or([0; 4])),
                    }),
                    &data[28..],
                ),
                None => return (None, data),
            }
        } else {
            (None, &data[16..])
        };
        (
            Some(Hello {
                wants_agent: flags & FLAG_WANTS_AGENT != 0,
                is_agent,
                token,
                mailbox,
                native,
            }),
            rest,
        )
    }
}

/// A fresh connection token.
pub(crate) fn new_token() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    t ^ (std::process::id() as u64) << 32 ^ COUNTER.fetch_add(1, Ordering::Relaxed).rotate_left(17)
}

/// Agent message size on the wire.
const MSG: usize = 64;
/// Receive buffers (and as many send buffers) per agent channel.
const SLOTS: usize = 128;
/// Immediate Data mailbox entries (seq u64, value u64).
const MAILBOX: usize = 256;
/// Marker bit of a mailbox entry: the Immediate Data was solicited.
const SOLICITED: u64 = 1 << 63;

const KIND_REQUEST: u8 = 1;
const KIND_RESPONSE: u8 = 2;

/// A Commit's answer (in the "original value" field) when the region is a
/// device FLUSH target: the requester's device FLUSH is its whole Commit
/// from now on. A durable region answers 0 after its msync, and so does
/// an agent that predates this answer: the requester keeps asking.
pub(crate) const FLUSH_TARGET: u64 = u64::from_le_bytes(*b"STAGFLSH");

/// What the agent is asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AgentOp {
    FetchAdd {
        add: u64,
        mask: u64,
    },
    CmpSwap {
        compare: u64,
        compare_mask: u64,
        swap: u64,
        swap_mask: u64,
    },
    Swap {
        swap: u64,
    },
    Commit {
        len: u32,
    },
}

/// Why the agent refused (carried in the response; non-zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
enum Refusal {
    UnknownKey = 1,
    Bounds = 2,
    Access = 3,
    Misaligned = 4,
    Sync = 5,
    Malformed = 6,
}

fn encode_request(req_id: u64, remote: Remote, op: AgentOp) -> [u8; MSG] {
    let mut m = [0u8; MSG];
    m[..4].copy_from_slice(MAGIC);
    m[4] = KIND_REQUEST;
    let (code, len, a, b, c, d) = match op {
        AgentOp::FetchAdd { add, mask } => (1, 8, add, mask, 0, 0),
        AgentOp::CmpSwap {
            compare,
            compare_mask,
            swap,
            swap_mask,
        } => (2, 8, compare, compare_mask, swap, swap_mask),
        AgentOp::Swap { swap } => (3, 8, swap, 0, 0, 0),
        AgentOp::Commit { len } => (4, len, 0, 0, 0, 0),
    };
    m[5] = code;
    m[8..16].copy_from_slice(&req_id.to_le_bytes());
    m[16..24].copy_from_slice(&remote.addr.to_le_bytes());
    m[24..28].copy_from_slice(&remote.rkey.to_le_bytes());
    m[28..32].copy_from_slice(&len.to_le_bytes());
    for (i, v) in [a, b, c, d].into_iter().enumerate() {
        m[32 + 8 * i..40 + 8 * i].copy_from_slice(&v.to_le_bytes());
    }
    m
}

fn le64(m: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(m[at..at + 8].try_into().unwrap_or([0; 8]))
}

fn le32(m: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(m[at..at + 4].try_into().unwrap_or([0; 4]))
}

/// An agent channel of one connection.
pub(crate) struct Agent {
    ctx: Context,
    pd_key: usize,
    qp: QueuePair,
    buffers: MemoryRegion,
    free_send: Mutex<Vec<usize>>,
    mailbox: MemoryRegion,
    peer_mailbox: Remote,
    next_req: AtomicU64,
    waiting: Mutex<HashMap<u64, (Weak<QpInner>, u64)>>,
    /// Zero-length Sends posted on the main QP so far; held across each
    /// such post so that the count follows wire order.
    pub zero_sends: Mutex<u64>,
    /// Zero-length receives completed on the main QP so far.
    zero_recvs: AtomicU64,
    /// Requests sent to the peer's agent, and the peer's requests run
    /// here: what shows whether an operation took the emulation path.
    requests_sent: AtomicU64,
    requests_served: AtomicU64,
    stop: AtomicBool,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("qp", &self.qp.qp_num())
            .finish_non_exhaustive()
    }
}

/// The local half of an agent channel before its connection exists.
pub(crate) struct AgentSetup {
    pub cq: CompletionQueue,
    pub buffers: MemoryRegion,
    pub mailbox: MemoryRegion,
}

impl AgentSetup {
    pub fn new(pd: &ProtectionDomain) -> Result<AgentSetup> {
        let ctx = pd.context();
        Ok(AgentSetup {
            cq: ctx.create_cq((4 * SLOTS) as u32)?,
            buffers: pd.alloc_mr(2 * SLOTS * MSG + MAILBOX * 16, Access::LOCAL_WRITE)?,
            mailbox: pd.alloc_mr(MAILBOX * 16, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?,
        })
    }

    /// Our header for the agent connection.
    pub fn hello(&self, token: u64) -> Hello {
        Hello {
            wants_agent: true,
            is_agent: true,
            token,
            mailbox: Some(self.mailbox.remote(0)),
            native: OpSet::RDMAP,
        }
    }

    /// Post the receive buffers (before the connection is up).
    pub fn pre_post(&self, qp: &QueuePair) -> Result<()> {
        for slot in 0..SLOTS {
            qp.post_recv(slot as u64, vec![self.buffers.slice(slot * MSG, MSG)?])?;
        }
        Ok(())
    }

    /// Start the channel's thread once connected.
    pub fn start(self, pd: &ProtectionDomain, qp: QueuePair, peer_mailbox: Remote) -> Arc<Agent> {
        let agent = Arc::new(Agent {
            ctx: pd.context().clone(),
            pd_key: pd.key(),
            qp,
            buffers: self.buffers,
            free_send: Mutex::new((0..SLOTS).rev().collect()),
            mailbox: self.mailbox,
            peer_mailbox,
            next_req: AtomicU64::new(1),
            waiting: Mutex::new(HashMap::new()),
            zero_sends: Mutex::new(0),
            zero_recvs: AtomicU64::new(0),
            requests_sent: AtomicU64::new(0),
            requests_served: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&agent);
        let cq = self.cq;
        let spawned = std::thread::Builder::new()
            .name("stag-agent".into())
            .spawn(move || run(weak, cq));
        if let Err(e) = spawned {
            warn!(error = %e, "agent thread could not start");
        }
        agent
    }
}

/// The channel's thread: wait for completions, handle them, until the
/// agent is dropped or its channel fails.
fn run(agent: Weak<Agent>, cq: CompletionQueue) {
    let mut out = Vec::new();
    loop {
        let Some(a) = agent.upgrade() else { return };
        if a.stop.load(Ordering::Acquire) {
            return;
        }
        out.clear();
        if let Err(e) = cq.wait(&mut out, 32, Duration::from_millis(20)) {
            warn!(error = %e, "agent channel failed");
            return;
        }
        for c in out.drain(..) {
            a.handle(c);
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.qp.set_error();
    }
}

impl Agent {
    fn send_slot(&self) -> Option<usize> {
        self.free_send
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
    }

    fn send(&self, msg: &[u8; MSG]) -> Result<()> {
        let slot = self.send_slot().ok_or(Error::InvalidRequest(
            "agent channel has no free send buffer",
        ))?;
        let at = (SLOTS + slot) * MSG;
        self.buffers.write_at(at, msg)?;
        let wr = WorkRequest::new(
            (SLOTS + slot) as u64,
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            vec![self.buffers.slice(at, MSG)?],
        );
        if let Err(e) = self.qp.post_send(wr) {
            self.free_send
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(slot);
            return Err(e);
        }
        Ok(())
    }

    /// Ask the peer's agent to run `op` on `remote`; the answer completes
    /// `token` on `qp`.
    pub fn request(
        &self,
        qp: &Arc<QpInner>,
        token: u64,
        remote: Remote,
        op: AgentOp,
    ) -> Result<()> {
        let req_id = self.next_req.fetch_add(1, Ordering::Relaxed);
        self.waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(req_id, (Arc::downgrade(qp), token));
        if let Err(e) = self.send(&encode_request(req_id, remote, op)) {
            self.waiting
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&req_id);
            return Err(e);
        }
        self.requests_sent.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// (requests sent to the peer's agent, peer requests run here).
    pub fn counts(&self) -> (u64, u64) {
        (
            self.requests_sent.load(Ordering::Relaxed),
            self.requests_served.load(Ordering::Relaxed),
        )
    }

    fn handle(&self, c: Completion) {
        if c.status != WcStatus::Success {
            if c.status != WcStatus::WrFlushErr {
                warn!(status = c.status.as_str(), "agent channel work failed");
            }
            self.fail_waiting(c.status);
            return;
        }
        match c.kind {
            CompletionKind::Send => {
                let slot = c.wr_id as usize - SLOTS;
                self.free_send
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(slot);
            }
            CompletionKind::Recv { len, .. } => {
                let slot = c.wr_id as usize;
                let mut m = [0u8; MSG];
                if len as usize == MSG && self.buffers.read_at(slot * MSG, &mut m).is_ok() {
                    self.dispatch(&m);
                } else {
                    warn!(len, "malformed agent message ignored");
                }
                if let Ok(s) = self.buffers.slice(slot * MSG, MSG) {
                    if let Err(e) = self.qp.post_recv(slot as u64, vec![s]) {
                        warn!(error = %e, "agent receive could not be re-posted");
                    }
                }
            }
            _ => {}
        }
    }

    fn fail_waiting(&self, status: WcStatus) {
        let waiting: Vec<_> = self
            .waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .collect();
        for (_, (qp, token)) in waiting {
            if let Some(qp) = qp.upgrade() {
                qp.finish_agent(token, status, 0, 0);
            }
        }
    }

    fn dispatch(&self, m: &[u8; MSG]) {
        if &m[..4] != MAGIC {
            warn!("agent message without magic ignored");
            return;
        }
        match m[4] {
            KIND_REQUEST => {
                self.requests_served.fetch_add(1, Ordering::Relaxed);
                let req_id = le64(m, 8);
                let (status, original) = match self.execute(m) {
                    Ok(v) => (0, v),
                    Err(r) => (r as u32, 0),
                };
                let mut resp = [0u8; MSG];
                resp[..4].copy_from_slice(MAGIC);
                resp[4] = KIND_RESPONSE;
                resp[8..16].copy_from_slice(&req_id.to_le_bytes());
                resp[28..32].copy_from_slice(&status.to_le_bytes());
                resp[32..40].copy_from_slice(&original.to_le_bytes());
                if let Err(e) = self.send(&resp) {
                    warn!(error = %e, "agent response could not be sent");
                }
            }
            KIND_RESPONSE => {
                let req_id = le64(m, 8);
                let status = le32(m, 28);
                let original = le64(m, 32);
                let entry = self
                    .waiting
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&req_id);
                match entry.and_then(|(qp, token)| Some((qp.upgrade()?, token))) {
                    Some((qp, token)) => {
                        let wc = if status == 0 {
                            WcStatus::Success
                        } else if status == Refusal::Sync as u32 {
                            WcStatus::RemOpErr
                        } else {
                            WcStatus::RemAccessErr
                        };
                        qp.finish_agent(token, wc, original, status);
                    }
                    None => debug!(req_id, "agent response for a request nobody waits for"),
                }
            }
            other => warn!(kind = other, "unknown agent message ignored"),
        }
    }

    /// Run a peer's request on our memory, with the checks an RNIC makes.
    fn execute(&self, m: &[u8; MSG]) -> std::result::Result<u64, Refusal> {
        let addr = le64(m, 16);
        let rkey = le32(m, 24);
        let len = le32(m, 28);
        let (a, b, c, d) = (le64(m, 32), le64(m, 40), le64(m, 48), le64(m, 56));
        let op = match m[5] {
            1 => AgentOp::FetchAdd { add: a, mask: b },
            2 => AgentOp::CmpSwap {
                compare: a,
                compare_mask: b,
                swap: c,
                swap_mask: d,
            },
            3 => AgentOp::Swap { swap: a },
            4 => AgentOp::Commit { len },
            _ => return Err(Refusal::Malformed),
        };
        let mr = self.ctx.mr_by_rkey(rkey).ok_or(Refusal::UnknownKey)?;
        if mr.pd_key() != self.pd_key {
            // Another protection domain's region is not ours to touch.
            return Err(Refusal::UnknownKey);
        }
        if let AgentOp::Commit { len } = op {
            let flush = Access::FLUSH_PERSISTENT;
            if !(mr.access().contains(flush) || mr.access().contains(Access::FLUSH_GLOBAL)) {
                return Err(Refusal::Access);
            }
            let off = mr.offset_of(addr, len as u64).ok_or(Refusal::Bounds)?;
            if mr.device_flush() {
                // Placed by the requester's ordering Read; the device
                // FLUSH can do this alone next time.
                return Ok(FLUSH_TARGET);
            }
            if mr.is_durable() && len > 0 {
                match mr.region().sync_range(off, len as usize) {
                    Ok(Ok(())) => {}
                    _ => return Err(Refusal::Sync),
                }
            }
            return Ok(0);
        }
        if !mr.access().contains(Access::REMOTE_ATOMIC) {
            return Err(Refusal::Access);
        }
        if !addr.is_multiple_of(8) {
            return Err(Refusal::Misaligned);
        }
        let off = mr.offset_of(addr, 8).ok_or(Refusal::Bounds)?;
        let f = move |cur: u64| match op {
            AgentOp::FetchAdd { add, mask } => provider::wire::atomic::fetch_add(cur, add, mask),
            AgentOp::CmpSwap {
                compare,
                compare_mask,
                swap,
                swap_mask,
            } => provider::wire::atomic::cmp_swap(cur, compare, compare_mask, swap, swap_mask),
            AgentOp::Swap { swap } => swap,
            AgentOp::Commit { .. } => cur,
        };
        mr.region()
            .fetch_update_u64(off, f)
            .map_err(|_| Refusal::Bounds)
    }

    /// Stage the mailbox entry of Immediate Data that travels with the
    /// `seq`-th zero-length Send of the main QP: returns the local slice
    /// holding it and where it goes at the peer.
    pub fn stage_imm(
        &self,
        seq: u64,
        imm: u64,
        solicited: bool,
    ) -> Result<(crate::mr::Slice, Remote)> {
        let slot = (seq as usize) % MAILBOX;
        let at = 2 * SLOTS * MSG + slot * 16;
        let mut entry = [0u8; 16];
        // The Solicited Event flag rides in the marker's top bit: a
        // libibverbs receive completion does not say whether the Send that
        // consumed it was solicited.
        let marker = (seq + 1) | if solicited { SOLICITED } else { 0 };
        entry[..8].copy_from_slice(&marker.to_le_bytes());
        entry[8..].copy_from_slice(&imm.to_le_bytes());
        self.buffers.write_at(at, &entry)?;
        let remote = Remote {
            addr: self.peer_mailbox.addr + (slot * 16) as u64,
            rkey: self.peer_mailbox.rkey,
        };
        Ok((self.buffers.slice(at, 16)?, remote))
    }

    /// A zero-length receive completed on the main QP: it is Immediate Data
    /// if the peer left an entry for it (its number among zero-length
    /// messages) in the mailbox; a plain empty Send otherwise. The entry
    /// was written before the Send, so it is there by now; a stale entry
    /// carries an older number. Receives are counted in completion order,
    /// which is arrival order on one QP.
    /// Returns the value and whether the sender asked for a Solicited
    /// Event.
    pub fn zero_length_recv(&self) -> Option<(u64, bool)> {
        let seq = self.zero_recvs.fetch_add(1, Ordering::AcqRel);
        let slot = (seq as usize) % MAILBOX;
        let mut entry = [0u8; 16];
        self.mailbox.read_at(slot * 16, &mut entry).ok()?;
        let marker = le64(&entry, 0);
        if marker & !SOLICITED != seq + 1 {
            return None;
        }
        Some((le64(&entry, 8), marker & SOLICITED != 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_leaves_foreign_data_alone() {
        let h = Hello {
            wants_agent: true,
            is_agent: false,
            token: 0x0102_0304_0506_0708,
            mailbox: None,
            native: OpSet::EMPTY
                .with(crate::OpKind::Send)
                .with(crate::OpKind::Commit),
        };
        let bytes = h.encode(b"app");
        assert_eq!(Hello::decode(&bytes), (Some(h), &b"app"[..]));
        let a = Hello {
            wants_agent: true,
            is_agent: true,
            token: 9,
            mailbox: Some(Remote {
                addr: 0xdead_0000,
                rkey: 77,
            }),
            native: OpSet::RDMAP,
        };
        let bytes = a.encode(b"");
        assert_eq!(bytes.len(), 28);
        assert_eq!(Hello::decode(&bytes), (Some(a), &b""[..]));
        assert_eq!(
            Hello::decode(b"plain private data"),
            (None, &b"plain private data"[..])
        );
        assert_eq!(Hello::decode(b"STA"), (None, &b"STA"[..]));
        // A header without the native-set flag: RDMAP operations only.
        let mut old = h.encode(b"");
        old[5] &= !FLAG_NATIVE;
        old[6..8].fill(0);
        assert_eq!(Hello::decode(&old).0.map(|h| h.native), Some(OpSet::RDMAP));
    }

    #[test]
    fn requests_encode_every_operand() {
        let r = Remote {
            addr: 0x1000,
            rkey: 5,
        };
        let m = encode_request(
            3,
            r,
            AgentOp::CmpSwap {
                compare: 1,
                compare_mask: 2,
                swap: 3,
                swap_mask: 4,
            },
        );
        assert_eq!((&m[..4], m[4], m[5]), (&MAGIC[..], KIND_REQUEST, 2));
        assert_eq!((le64(&m, 8), le64(&m, 16), le32(&m, 24)), (3, 0x1000, 5));
        assert_eq!(
            (le64(&m, 32), le64(&m, 40), le64(&m, 48), le64(&m, 56)),
            (1, 2, 3, 4)
        );
    }
}
