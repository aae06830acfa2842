//! The agent channel: what lets two stag peers emulate what their devices
//! lack (atomics on siw, Commit without a device FLUSH or into a
//! file-backed region, 8-byte Immediate Data).
//!
//! When either side of a connection needs it, the initiator opens a second
//! connection to the same listener, marked in its private data as the
//! agent channel of the first ([`crate::wire::hello`]). Each side runs a
//! thread on that channel, straight on the backend's QP and CQ (never the
//! application's API or receive buffers): requests from the peer are
//! executed on local memory — atomics with the CPU's atomics, Commit as
//! msync of a file-backed region — and answered; answers to our requests
//! finish the application's work requests. Immediate Data goes through a
//! mailbox region the peer writes with RDMA Write. Messages are
//! [`crate::wire::agent`]'s.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use smallvec::smallvec;
use tracing::{debug, warn};

use provider::wr::{Remote, SendOp, WcStatus};

use crate::backend::{CqOps, QpOps, RawCompletion};
use crate::caps::OpSet;
use crate::error::{Error, Result};
use crate::mr::{Access, MemoryRegion, Registry};
use crate::pd::ProtectionDomain;
use crate::tracker::{Table, Tracker};
use crate::wire::agent::{self as msg, AgentOp, Refusal};
use crate::wire::hello;
use provider::thread::SpawnMasked;

/// Receive buffers (and as many send buffers) per agent channel.
const SLOTS: usize = 128;
/// Immediate Data mailbox entries (seq u64, value u64).
const MAILBOX: usize = 256;
/// Marker bit of a mailbox entry: the Immediate Data was solicited.
const SOLICITED: u64 = 1 << 63;
/// Completions taken per round.
const BATCH: usize = 32;

/// A Commit's answer (in the "original value" field) when the region is a
/// device FLUSH target: the requester's device FLUSH is its whole Commit
/// from now on. A durable region answers 0 after its msync, and so does
/// an agent that predates this answer: the requester keeps asking.
pub(crate) const FLUSH_TARGET: u64 = u64::from_le_bytes(*b"STAGFLSH");

/// Who waits for an agent's answer: a QP's emulation core.
pub(crate) trait AgentClient: Send + Sync {
    /// The answer for `token` arrived (or the channel failed).
    fn finish_agent(&self, token: u64, status: WcStatus, original: u64, vendor_err: u32);
}

/// Who waits for an answer: the client and its token.
type Waiter = (Weak<dyn AgentClient>, u64);

/// The agent's own work requests.
#[derive(Debug, Clone, Copy)]
enum AgentWr {
    Recv(usize),
    Send(usize),
}

/// An agent channel of one connection.
pub(crate) struct Agent {
    qp: Arc<dyn QpOps>,
    tracker: Tracker<AgentWr>,
    buffers: MemoryRegion,
    free_send: Mutex<Vec<usize>>,
    mailbox: MemoryRegion,
    peer_mailbox: Remote,
    registry: Arc<Registry>,
    pd_key: usize,
    next_req: AtomicU64,
    waiting: Mutex<HashMap<u64, Waiter>>,
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
    pub cq: Arc<dyn CqOps>,
    buffers: MemoryRegion,
    mailbox: MemoryRegion,
    tracker: Tracker<AgentWr>,
}

impl AgentSetup {
    pub fn new(pd: &ProtectionDomain) -> Result<AgentSetup> {
        Ok(AgentSetup {
            cq: pd.context().ops().create_cq((4 * SLOTS) as u32)?,
            buffers: pd.alloc_mr(2 * SLOTS * msg::LEN + MAILBOX * 16, Access::LOCAL_WRITE)?,
            mailbox: pd.alloc_mr(MAILBOX * 16, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?,
            tracker: Tracker::new(Table::Qp),
        })
    }

    /// Our header for the agent connection.
    pub fn hello(&self, token: u64) -> hello::Repr {
        hello::Repr {
            wants_agent: true,
            is_agent: true,
            token,
            mailbox: Some(self.mailbox.remote(0)),
            native: OpSet::RDMAP,
        }
    }

    /// Post the receive buffers (before the connection is up).
    pub fn pre_post(&self, qp: &Arc<dyn QpOps>) -> Result<()> {
        for slot in 0..SLOTS {
            post_recv(qp, &self.tracker, &self.buffers, slot)?;
        }
        Ok(())
    }

    /// Start the channel's thread once connected.
    pub fn start(
        self,
        pd: &ProtectionDomain,
        qp: Arc<dyn QpOps>,
        peer_mailbox: Remote,
    ) -> Arc<Agent> {
        let agent = Arc::new(Agent {
            qp,
            tracker: self.tracker,
            buffers: self.buffers,
            free_send: Mutex::new((0..SLOTS).rev().collect()),
            mailbox: self.mailbox,
            peer_mailbox,
            registry: pd.context().registry().clone(),
            pd_key: pd.key(),
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
            .spawn_masked(move || run(weak, cq));
        if let Err(e) = spawned {
            warn!(error = %e, "agent thread could not start");
        }
        agent
    }
}

fn post_recv(
    qp: &Arc<dyn QpOps>,
    tracker: &Tracker<AgentWr>,
    buffers: &MemoryRegion,
    slot: usize,
) -> Result<()> {
    let ticket = tracker.insert(
        AgentWr::Recv(slot),
        smallvec![buffers.slice(slot * msg::LEN, msg::LEN)?],
    );
    qp.post_recv(&ticket.recv()).inspect_err(|_| {
        tracker.remove(ticket.token());
    })
}

/// The channel's thread: wait for completions, handle them, until the
/// agent is dropped or its channel fails.
fn run(agent: Weak<Agent>, cq: Arc<dyn CqOps>) {
    let mut raw = Vec::with_capacity(BATCH);
    loop {
        let Some(a) = agent.upgrade() else { return };
        if a.stop.load(Ordering::Acquire) {
            return;
        }
        raw.clear();
        let polled = cq.poll(&mut raw, BATCH).and_then(|()| {
            if raw.is_empty() && !cq.req_notify()? {
                cq.poll(&mut raw, BATCH)?;
                if raw.is_empty() {
                    drop(a);
                    cq.wait(Duration::from_millis(20))?;
                    return Ok(false);
                }
            }
            Ok(true)
        });
        match polled {
            Ok(false) => continue,
            Ok(true) => {}
            Err(e) => {
                warn!(error = %e, "agent channel failed");
                if let Some(a) = agent.upgrade() {
                    a.fail_waiting(WcStatus::GeneralErr);
                }
                return;
            }
        }
        let Some(a) = agent.upgrade() else { return };
        for rc in raw.drain(..) {
            a.handle(rc);
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
    fn send(&self, m: &[u8; msg::LEN]) -> Result<()> {
        let slot = self
            .free_send
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .ok_or(Error::QueueFull)?;
        let give_back = |e| {
            self.free_send
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(slot);
            e
        };
        let at = (SLOTS + slot) * msg::LEN;
        self.buffers.write_at(at, m).map_err(give_back)?;
        let slice = self.buffers.slice(at, msg::LEN).map_err(give_back)?;
        let ticket = self.tracker.insert(AgentWr::Send(slot), smallvec![slice]);
        self.qp
            .post_send(&[ticket.send(SendOp::send(), false)])
            .map_err(|(e, _)| {
                self.tracker.remove(ticket.token());
                give_back(e)
            })
    }

    /// Ask the peer's agent to run `op` on `remote`; the answer finishes
    /// `token` of `client`.
    pub fn request(
        &self,
        client: Weak<dyn AgentClient>,
        token: u64,
        remote: Remote,
        op: AgentOp,
    ) -> Result<()> {
        let req_id = self.next_req.fetch_add(1, Ordering::Relaxed);
        self.waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(req_id, (client, token));
        let m = msg::Repr::Request { req_id, remote, op }.to_bytes();
        if let Err(e) = self.send(&m) {
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

    fn handle(&self, rc: RawCompletion) {
        let Some((wr, _held)) = self.tracker.remove(rc.token) else {
            warn!(token = rc.token, "agent completion for an unknown WR");
            return;
        };
        if rc.status != WcStatus::Success {
            if rc.status != WcStatus::WrFlushErr {
                warn!(status = rc.status.as_str(), "agent channel work failed");
            }
            self.fail_waiting(rc.status);
            return;
        }
        match wr {
            AgentWr::Send(slot) => self
                .free_send
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(slot),
            AgentWr::Recv(slot) => {
                let mut m = [0u8; msg::LEN];
                if rc.byte_len as usize == msg::LEN
                    && self.buffers.read_at(slot * msg::LEN, &mut m).is_ok()
                {
                    self.dispatch(&m);
                } else {
                    warn!(len = rc.byte_len, "malformed agent message ignored");
                }
                if let Err(e) = post_recv(&self.qp, &self.tracker, &self.buffers, slot) {
                    warn!(error = %e, "agent receive could not be re-posted");
                }
            }
        }
    }

    fn fail_waiting(&self, status: WcStatus) {
        let waiting: Vec<_> = self
            .waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .collect();
        for (_, (client, token)) in waiting {
            if let Some(c) = client.upgrade() {
                c.finish_agent(token, status, 0, 0);
            }
        }
    }

    fn dispatch(&self, m: &[u8; msg::LEN]) {
        let repr = match msg::Repr::parse(&msg::Packet::new_unchecked(&m[..])) {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, "agent message ignored");
                // A request we cannot read still gets an answer if it has
                // an id: the requester's WR must not wait forever.
                if m[..4] == crate::wire::MAGIC && m[4] == 1 {
                    let req_id = crate::wire::le64(m, 8);
                    self.respond(req_id, Err(Refusal::Malformed));
                }
                return;
            }
        };
        match repr {
            msg::Repr::Request { req_id, remote, op } => {
                self.requests_served.fetch_add(1, Ordering::Relaxed);
                self.respond(req_id, self.execute(remote, op));
            }
            msg::Repr::Response {
                req_id,
                status,
                original,
            } => {
                let entry = self
                    .waiting
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&req_id);
                match entry.and_then(|(c, token)| Some((c.upgrade()?, token))) {
                    Some((client, token)) => {
                        let wc = if status == 0 {
                            WcStatus::Success
                        } else if status == Refusal::Sync as u32 {
                            WcStatus::RemOpErr
                        } else {
                            WcStatus::RemAccessErr
                        };
                        client.finish_agent(token, wc, original, status);
                    }
                    None => debug!(req_id, "agent response for a request nobody waits for"),
                }
            }
        }
    }

    fn respond(&self, req_id: u64, result: std::result::Result<u64, Refusal>) {
        let (status, original) = match result {
            Ok(v) => (0, v),
            Err(r) => (r as u32, 0),
        };
        let m = msg::Repr::Response {
            req_id,
            status,
            original,
        }
        .to_bytes();
        if let Err(e) = self.send(&m) {
            warn!(error = %e, "agent response could not be sent");
        }
    }

    /// Run a peer's request on our memory, with the checks an RNIC makes.
    fn execute(&self, remote: Remote, op: AgentOp) -> std::result::Result<u64, Refusal> {
        let Remote { addr, rkey } = remote;
        let mr = self.registry.get(rkey).ok_or(Refusal::UnknownKey)?;
        if mr.pd_key() != self.pd_key {
            // Another protection domain's region is not ours to touch.
            return Err(Refusal::UnknownKey);
        }
        if let AgentOp::Commit { len } = op {
            let flush = Access::FLUSH_PERSISTENT;
            if !(mr.access().contains(flush) || mr.access().contains(Access::FLUSH_GLOBAL)) {
                return Err(Refusal::Access);
            }
            let off = mr.offset_of(addr, u64::from(len)).ok_or(Refusal::Bounds)?;
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
        let at = 2 * SLOTS * msg::LEN + slot * 16;
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
        let marker = crate::wire::le64(&entry, 0);
        if marker & !SOLICITED != seq + 1 {
            return None;
        }
        Some((crate::wire::le64(&entry, 8), marker & SOLICITED != 0))
    }
}
