//! Connection setup with one shape for every device: [`connect`] on the
//! active side, [`Listener::bind`] + [`Listener::accept`] on the passive
//! side. On libibverbs devices this is librdmacm (iWARP needs it; RoCE
//! uses it too); on the userspace provider it is its own TCP listener with
//! the MPA exchange.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::{Connecting, CqOps, IncomingOps, ListenerOps, QpRequest};
use crate::caps::gap_needs_agent;
use crate::cq::CompletionQueue;
use crate::device::Context;
use crate::emulation::agent::AgentSetup;
use crate::emulation::QpCore;
use crate::error::{Error, Result};
use crate::pd::ProtectionDomain;
use crate::qp::{QpCaps, QueuePair};
use crate::wire::hello::Repr as Hello;

/// What a connection asks for.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Queue sizes.
    pub caps: QpCaps,
    /// Private data for the peer.
    pub private_data: Vec<u8>,
    /// Inbound Read/atomic/Commit requests we accept at once (IRD).
    pub responder_resources: u8,
    /// Outbound such requests we keep outstanding (ORD).
    pub initiator_depth: u8,
    /// Userspace provider only: ask for CRC32c on every FPDU.
    pub crc: bool,
    /// Userspace provider only: peer-to-peer setup with these RTR models.
    pub peer_to_peer: Option<provider::setup::RtrModes>,
    /// Take receives from this shared receive queue (same PD as the QP).
    pub srq: Option<crate::srq::SharedReceiveQueue>,
    /// Receive completions go here instead of the send CQ (same device).
    pub recv_cq: Option<CompletionQueue>,
    /// Put stag's header in front of the private data (default). Without
    /// it the connection is a plain RDMA one, for peers that would take
    /// the header for their own data: the peer's device is unknown, only
    /// what this device does natively can run, and RFC 7306 §1.1's probe
    /// ([`QueuePair::probe_atomics`]) tells whether the peer has atomics.
    pub stag_header: bool,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            caps: QpCaps::default(),
            private_data: Vec::new(),
            responder_resources: 16,
            initiator_depth: 16,
            crc: true,
            peer_to_peer: None,
            srq: None,
            recv_cq: None,
            stag_header: true,
        }
    }
}

impl ConnectOptions {
    /// What the backend creates and connects an application's QP with: on
    /// `send_cq`, and `recv_cq` when one is given.
    fn qp_request<'a>(
        &'a self,
        send_cq: &'a CompletionQueue,
        private_data: Vec<u8>,
    ) -> QpRequest<'a> {
        let recv_cq = self.recv_cq.as_ref().unwrap_or(send_cq);
        self.request_on(&send_cq.inner.ops, &recv_cq.inner.ops, private_data)
    }

    /// What the backend creates and connects a QP with, on these CQs.
    fn request_on<'a>(
        &'a self,
        send_cq: &'a Arc<dyn CqOps>,
        recv_cq: &'a Arc<dyn CqOps>,
        private_data: Vec<u8>,
    ) -> QpRequest<'a> {
        QpRequest {
            send_cq,
            recv_cq,
            srq: self.srq.as_ref().map(|s| &s.core.ops),
            max_send_wr: self.caps.max_send_wr,
            max_recv_wr: self.caps.max_recv_wr,
            max_sge: self.caps.max_sge,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            crc: self.crc,
            peer_to_peer: self.peer_to_peer,
            private_data,
        }
    }
}

fn check_same_device(
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    opts: &ConnectOptions,
) -> Result<()> {
    if let Some(srq) = &opts.srq {
        if srq.pd_key() != pd.key() {
            return Err(Error::Mismatch);
        }
    }
    let same = |c: &Context| pd.context().same(c);
    if same(cq.context()) && opts.recv_cq.as_ref().is_none_or(|r| same(r.context())) {
        Ok(())
    } else {
        Err(Error::Mismatch)
    }
}

/// A fresh connection token.
fn new_token() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    t ^ (std::process::id() as u64) << 32 ^ COUNTER.fetch_add(1, Ordering::Relaxed).rotate_left(17)
}

/// The QP of a connection being made: its emulation core over the
/// backend's QP, handed to `pre_post` before the connection completes.
fn build_qp(
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    opts: &ConnectOptions,
    connecting: Box<dyn Connecting>,
    pre_post: impl FnOnce(&QueuePair) -> Result<()>,
) -> Result<(QueuePair, Vec<u8>)> {
    let core = QpCore::new(
        pd,
        connecting.qp().clone(),
        cq,
        opts.recv_cq.as_ref().unwrap_or(cq),
        opts.srq.as_ref().map(|s| s.core.clone()),
        opts.caps.max_send_wr,
    )?;
    let qp = QueuePair { core };
    pre_post(&qp)?;
    let (_, private) = connecting.finish()?;
    Ok((qp, private))
}

/// Connect to a listener at `addr`; returns the QP and the peer's private
/// data.
pub fn connect(
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    addr: SocketAddr,
    opts: &ConnectOptions,
) -> Result<(QueuePair, Vec<u8>)> {
    connect_with(pd, cq, addr, opts, |_| Ok(()))
}

/// Connect, running `pre_post` on the QP before the connection exists (to
/// post the receives the peer's first messages need: it may send as soon
/// as it accepts).
///
/// When this device or the peer's needs the emulation agent, a second
/// connection to the same listener carries it (see the `agent` module).
pub fn connect_with(
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    addr: SocketAddr,
    opts: &ConnectOptions,
    pre_post: impl FnOnce(&QueuePair) -> Result<()>,
) -> Result<(QueuePair, Vec<u8>)> {
    let ctx = pd.context();
    if !opts.stag_header {
        let (qp, reply) = connect_raw(pd, cq, addr, opts, opts.private_data.clone(), pre_post)?;
        qp.core.set_connection(ctx.connection_caps(None), None);
        return Ok((qp, reply));
    }
    let wants_agent = ctx.capabilities().needs_agent();
    let native = ctx.native_ops();
    let token = new_token();
    let hello = Hello {
        wants_agent,
        is_agent: false,
        token,
        mailbox: None,
        native,
    };
    let (qp, reply) = connect_raw(
        pd,
        cq,
        addr,
        opts,
        hello.encode(&opts.private_data),
        pre_post,
    )?;
    let (peer, app) = Hello::split(&reply);
    let app = app.to_vec();
    let peer_native = peer.map(|p| p.native);
    qp.core
        .set_connection(ctx.connection_caps(peer_native), peer_native);
    if let Some(peer) = peer {
        let gap = gap_needs_agent(native, peer.native);
        if wants_agent || gap || peer.wants_agent {
            let setup = AgentSetup::new(pd)?;
            let agent_opts = agent_options();
            let connecting = pd.ops().connector(
                agent_opts.request_on(&setup.cq, &setup.cq, setup.hello(token).encode(&[])),
                addr,
            )?;
            setup.pre_post(connecting.qp())?;
            let (aqp, areply) = connecting.finish()?;
            let mailbox = match Hello::split(&areply).0 {
                Some(Hello {
                    is_agent: true,
                    mailbox: Some(m),
                    ..
                }) => m,
                _ => {
                    return Err(Error::Connect(
                        "the peer's agent channel sent no mailbox".into(),
                    ))
                }
            };
            qp.core.set_agent(setup.start(pd, aqp, mailbox));
        }
    }
    Ok((qp, app))
}

/// The options of an agent channel connection.
fn agent_options() -> ConnectOptions {
    ConnectOptions {
        caps: QpCaps {
            max_send_wr: 512,
            max_recv_wr: 256,
            max_sge: 1,
        },
        // The agent has receives of its own, never the application's SRQ.
        srq: None,
        recv_cq: None,
        ..ConnectOptions::default()
    }
}

/// One connection with `private_data` as it goes on the wire.
fn connect_raw(
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    addr: SocketAddr,
    opts: &ConnectOptions,
    private_data: Vec<u8>,
    pre_post: impl FnOnce(&QueuePair) -> Result<()>,
) -> Result<(QueuePair, Vec<u8>)> {
    check_same_device(pd, cq, opts)?;
    let connecting = pd
        .ops()
        .connector(opts.qp_request(cq, private_data), addr)?;
    build_qp(pd, cq, opts, connecting, pre_post)
}

/// A passive endpoint.
#[derive(Debug)]
pub struct Listener {
    shared: Arc<ListenerShared>,
}

#[derive(Debug)]
struct ListenerShared {
    ops: Box<dyn ListenerOps>,
    /// Requests that arrived while someone waited for another kind (an
    /// agent channel, or the next application connection).
    stash: Mutex<VecDeque<Raw>>,
    /// Serialises waiting on the backend.
    accepting: Mutex<()>,
}

/// A request as it arrived, its stag header split off.
#[derive(Debug)]
struct Raw {
    incoming: Box<dyn IncomingOps>,
    hello: Option<Hello>,
    app: Vec<u8>,
}

/// A connection request, for the application to accept or reject.
#[derive(Debug)]
pub struct Incoming {
    raw: Raw,
    listener: Arc<ListenerShared>,
}

impl ListenerShared {
    /// Wait for the next request on the backend.
    fn next_raw(&self) -> Result<Raw> {
        let _one = self.accepting.lock().unwrap_or_else(|p| p.into_inner());
        let incoming = self.ops.next()?;
        let (hello, app) = Hello::split(incoming.private_data());
        let app = app.to_vec();
        Ok(Raw {
            incoming,
            hello,
            app,
        })
    }

    /// The next request that `want` accepts, stashing the others.
    fn next_matching(&self, want: impl Fn(&Raw) -> bool) -> Result<Raw> {
        {
            let mut stash = self.stash.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(i) = stash.iter().position(&want) {
                return Ok(stash.remove(i).expect("position is in range"));
            }
        }
        loop {
            let raw = self.next_raw()?;
            if want(&raw) {
                return Ok(raw);
            }
            self.stash
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push_back(raw);
        }
    }
}

fn is_agent(raw: &Raw) -> bool {
    matches!(raw.hello, Some(Hello { is_agent: true, .. }))
}

impl Listener {
    /// Listen on `addr` for the device of `ctx` (port 0 picks one on the
    /// userspace provider).
    pub fn bind(ctx: &Context, addr: SocketAddr) -> Result<Listener> {
        Ok(Listener {
            shared: Arc::new(ListenerShared {
                ops: ctx.ops().listen(addr)?,
                stash: Mutex::new(VecDeque::new()),
                accepting: Mutex::new(()),
            }),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.shared.ops.local_addr()
    }

    /// Wait for the next connection request of the application (agent
    /// channels are handled inside [`Incoming::accept`]).
    pub fn get_request(&self) -> Result<Incoming> {
        let raw = self.shared.next_matching(|r| !is_agent(r))?;
        Ok(Incoming {
            raw,
            listener: self.shared.clone(),
        })
    }

    /// Accept the next request with `opts`: the QP and the initiator's
    /// private data.
    pub fn accept(
        &self,
        pd: &ProtectionDomain,
        cq: &CompletionQueue,
        opts: &ConnectOptions,
    ) -> Result<(QueuePair, Vec<u8>)> {
        let incoming = self.get_request()?;
        let private = incoming.private_data().to_vec();
        Ok((incoming.accept(pd, cq, opts)?, private))
    }
}

impl Incoming {
    /// The initiator's private data.
    pub fn private_data(&self) -> &[u8] {
        &self.raw.app
    }

    /// Accept onto a new QP.
    pub fn accept(
        self,
        pd: &ProtectionDomain,
        cq: &CompletionQueue,
        opts: &ConnectOptions,
    ) -> Result<QueuePair> {
        self.accept_with(pd, cq, opts, |_| Ok(()))
    }

    /// Accept, running `pre_post` on the QP before the peer learns of the
    /// acceptance (to post the receives its first messages need). Sets up
    /// the agent channel when either side needs it.
    pub fn accept_with(
        self,
        pd: &ProtectionDomain,
        cq: &CompletionQueue,
        opts: &ConnectOptions,
        pre_post: impl FnOnce(&QueuePair) -> Result<()>,
    ) -> Result<QueuePair> {
        let ctx = pd.context();
        let Incoming { raw, listener } = self;
        let peer = raw.hello;
        let peer_native = peer.map(|p| p.native);
        let caps = ctx.connection_caps(peer_native);
        let wants_agent = caps.needs_agent();
        let reply = match peer {
            // Only a stag initiator gets a header back: another peer would
            // take it for application data.
            Some(peer) => Hello {
                wants_agent,
                is_agent: false,
                token: peer.token,
                mailbox: None,
                native: ctx.native_ops(),
            }
            .encode(&opts.private_data),
            None => opts.private_data.clone(),
        };
        let qp = accept_raw(raw.incoming, pd, cq, opts, reply, pre_post)?;
        qp.core.set_connection(caps, peer_native);
        if let Some(peer) = peer {
            // The initiator opens the channel when either end's matrix
            // needs it; the same test on the same two headers.
            let gap = gap_needs_agent(peer.native, ctx.native_ops());
            if wants_agent || gap || peer.wants_agent {
                let token = peer.token;
                let agent_raw = listener
                    .next_matching(|r| matches!(r.hello, Some(Hello { is_agent: true, token: t, .. }) if t == token))?;
                let mailbox = agent_raw.hello.and_then(|h| h.mailbox).ok_or_else(|| {
                    Error::Connect("agent channel request without a mailbox".into())
                })?;
                let setup = AgentSetup::new(pd)?;
                let agent_opts = agent_options();
                let connecting = agent_raw.incoming.acceptor(
                    pd.ops().as_ref(),
                    agent_opts.request_on(&setup.cq, &setup.cq, setup.hello(token).encode(&[])),
                )?;
                setup.pre_post(connecting.qp())?;
                let (aqp, _) = connecting.finish()?;
                qp.core.set_agent(setup.start(pd, aqp, mailbox));
            }
        }
        Ok(qp)
    }

    /// Reject with private data.
    pub fn reject(self, private_data: &[u8]) -> Result<()> {
        self.raw.incoming.reject(private_data)
    }
}

/// Accept one request onto a new QP, replying `private_data`.
fn accept_raw(
    incoming: Box<dyn IncomingOps>,
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    opts: &ConnectOptions,
    private_data: Vec<u8>,
    pre_post: impl FnOnce(&QueuePair) -> Result<()>,
) -> Result<QueuePair> {
    check_same_device(pd, cq, opts)?;
    let connecting = incoming.acceptor(pd.ops().as_ref(), opts.qp_request(cq, private_data))?;
    Ok(build_qp(pd, cq, opts, connecting, pre_post)?.0)
}
