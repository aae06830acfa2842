//! Connection setup with one shape for every device: [`connect`] on the
//! active side, [`Listener::bind`] + [`Listener::accept`] on the passive
//! side. On libibverbs devices this is librdmacm (iWARP needs it; RoCE
//! uses it too); on the userspace provider it is its own TCP listener with
//! the MPA exchange.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use crate::agent::{new_token, AgentSetup, Hello};
use crate::caps::gap_needs_agent;

use crate::cq::{CompletionQueue, CqBackend};
use crate::device::{ContextBackend, PdBackend, ProtectionDomain};
use crate::error::{Error, Result};
use crate::ibv;
use crate::qp::{QpBackend, QpCaps, QueuePair};

/// How long address and route resolution may take.
const RESOLVE_MS: i32 = 5000;

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
            stag_header: true,
        }
    }
}

impl ConnectOptions {
    fn mpa(&self) -> provider::setup::MpaParams {
        provider::setup::MpaParams {
            ird: self.responder_resources as u16,
            ord: self.initiator_depth as u16,
            crc: self.crc,
            p2p: self.peer_to_peer,
            private_data: self.private_data.clone(),
            ..provider::setup::MpaParams::default()
        }
    }

    /// The QP's creation parameters; `send_ops` picks the extended
    /// `ibv_wr_*` post path (`None`: `ibv_post_send`).
    fn ibv_caps(&self, send_ops: Option<ibv::SendOps>) -> ibv::QpCaps {
        ibv::QpCaps {
            max_send_wr: self.caps.max_send_wr,
            max_recv_wr: self.caps.max_recv_wr,
            max_send_sge: self.caps.max_sge,
            max_recv_sge: self.caps.max_sge,
            send_ops,
            ..ibv::QpCaps::default()
        }
    }

    fn conn_param(&self) -> ibv::ConnParam {
        ibv::ConnParam {
            private_data: self.private_data.clone(),
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            ..ibv::ConnParam::default()
        }
    }
}

fn user_qp_caps(c: &QpCaps, rdmap_extensions: bool) -> provider::qp::QpCaps {
    provider::qp::QpCaps {
        rdmap_extensions,
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_sge,
        max_recv_sge: c.max_sge,
        ..provider::qp::QpCaps::default()
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
    if pd.context().same(cq.context()) {
        Ok(())
    } else {
        Err(Error::Mismatch)
    }
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
        let (qp, reply) = connect_raw(pd, cq, addr, opts, pre_post)?;
        qp.inner.set_connection(ctx.connection_caps(None), None);
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
    let mut main_opts = opts.clone();
    main_opts.private_data = hello.encode(&opts.private_data);
    let (qp, reply) = connect_raw(pd, cq, addr, &main_opts, pre_post)?;
    let (peer, app) = Hello::decode(&reply);
    let app = app.to_vec();
    let peer_native = peer.map(|p| p.native);
    qp.inner
        .set_connection(ctx.connection_caps(peer_native), peer_native);
    if let Some(peer) = peer {
        let gap = gap_needs_agent(native, peer.native);
        if wants_agent || gap || peer.wants_agent {
            let setup = AgentSetup::new(pd)?;
            let agent_opts = agent_options(&setup, token);
            let (aqp, areply) =
                connect_raw(pd, &setup.cq, addr, &agent_opts, |q| setup.pre_post(q))?;
            let mailbox = match Hello::decode(&areply).0 {
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
            let agent = setup.start(pd, aqp, mailbox);
            let _ = qp.inner.agent.set(agent);
        }
    }
    Ok((qp, app))
}

/// The options of an agent channel connection.
fn agent_options(setup: &AgentSetup, token: u64) -> ConnectOptions {
    ConnectOptions {
        caps: QpCaps {
            max_send_wr: 512,
            max_recv_wr: 256,
            max_sge: 1,
        },
        private_data: setup.hello(token).encode(&[]),
        // The agent has receives of its own, never the application's SRQ.
        srq: None,
        ..ConnectOptions::default()
    }
}

/// One connection, no stag header.
fn connect_raw(
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    addr: SocketAddr,
    opts: &ConnectOptions,
    pre_post: impl FnOnce(&QueuePair) -> Result<()>,
) -> Result<(QueuePair, Vec<u8>)> {
    check_same_device(pd, cq, opts)?;
    match (pd.backend(), &cq.inner.backend) {
        (PdBackend::User(upd), CqBackend::User(ucq)) => {
            let qp = user_qp(pd, upd, cq, ucq, opts)?;
            pre_post(&qp)?;
            let QpBackend::User(uqp) = qp.inner_backend() else {
                unreachable!("built as a userspace QP")
            };
            let private = uqp.connect(addr, &opts.mpa()).map_err(|e| match e {
                provider::device::DeviceError::Rejected(pd) => Error::Rejected(pd),
                other => other.into(),
            })?;
            Ok((qp, private))
        }
        (PdBackend::Ibv(ipd), CqBackend::Ibv(icq)) => {
            let channel = ibv::EventChannel::new()?;
            let id = ibv::CmId::new(&channel)?;
            id.resolve_addr(None, addr, RESOLVE_MS)?;
            channel.expect(ibv::CmEventType::AddrResolved)?;
            id.resolve_route(RESOLVE_MS)?;
            channel.expect(ibv::CmEventType::RouteResolved)?;
            let qp = ibv_qp(pd, ipd, cq, icq, id, opts)?;
            pre_post(&qp)?;
            let id = qp.cm_id().expect("built as an ibv QP");
            id.connect(&opts.conn_param())?;
            let ev = channel.get_event()?;
            match ev.kind {
                ibv::CmEventType::Established => Ok((qp, ev.private_data)),
                ibv::CmEventType::Rejected => Err(Error::Rejected(ev.private_data)),
                other => Err(Error::Connect(format!(
                    "rdma_cm event {other:?} instead of ESTABLISHED"
                ))),
            }
        }
        _ => Err(Error::Mismatch),
    }
}

/// A userspace-provider QP for a connection.
fn user_qp(
    pd: &ProtectionDomain,
    upd: &provider::device::ProtectionDomain,
    cq: &CompletionQueue,
    ucq: &Arc<provider::cq::CompletionQueue>,
    opts: &ConnectOptions,
) -> Result<QueuePair> {
    let srq = match opts.srq.as_ref().map(|s| &s.inner.backend) {
        None => None,
        Some(crate::srq::SrqBackend::User(s)) => Some(s.clone()),
        Some(crate::srq::SrqBackend::Ibv { .. }) => return Err(Error::Mismatch),
    };
    let uqp = upd.create_qp(
        user_qp_caps(&opts.caps, pd.context().rdmap_extensions()),
        ucq,
        ucq,
        srq.as_ref(),
    );
    let qp_num = uqp.qp_num();
    QueuePair::from_backend(
        pd.context(),
        pd,
        cq,
        cq,
        opts.srq.clone(),
        QpBackend::User(uqp),
        qp_num,
    )
}

/// A libibverbs QP on an rdma_cm id.
fn ibv_qp(
    pd: &ProtectionDomain,
    ipd: &Arc<ibv::ProtectionDomain>,
    cq: &CompletionQueue,
    icq: &Arc<ibv::CompletionQueue>,
    id: ibv::CmId,
    opts: &ConnectOptions,
) -> Result<QueuePair> {
    let srq = match opts.srq.as_ref().map(|s| &s.inner.backend) {
        None => None,
        Some(crate::srq::SrqBackend::Ibv { srq, .. }) => Some(srq),
        Some(crate::srq::SrqBackend::User(_)) => return Err(Error::Mismatch),
    };
    let iqp = id.create_qp_with_srq(ipd, icq, icq, &opts.ibv_caps(pd.context().wr_ops()), srq)?;
    let qp_num = iqp.qp_num();
    QueuePair::from_backend(
        pd.context(),
        pd,
        cq,
        cq,
        opts.srq.clone(),
        QpBackend::Ibv { qp: iqp, id },
        qp_num,
    )
}

/// A passive endpoint.
#[derive(Debug)]
pub struct Listener {
    shared: Arc<ListenerShared>,
}

#[derive(Debug)]
struct ListenerShared {
    backend: ListenerBackend,
    /// Requests that arrived while someone waited for another kind (an
    /// agent channel, or the next application connection).
    stash: Mutex<VecDeque<Raw>>,
    /// Serialises waiting on the backend.
    accepting: Mutex<()>,
}

#[derive(Debug)]
enum ListenerBackend {
    User(provider::device::Listener),
    Ibv {
        channel: Arc<ibv::EventChannel>,
        id: ibv::CmId,
    },
}

/// A request as it arrived, its stag header split off.
#[derive(Debug)]
struct Raw {
    backend: IncomingBackend,
    hello: Option<Hello>,
    app: Vec<u8>,
}

/// A connection request, for the application to accept or reject.
#[derive(Debug)]
pub struct Incoming {
    raw: Raw,
    listener: Arc<ListenerShared>,
}

#[derive(Debug)]
enum IncomingBackend {
    User(provider::device::ConnRequest),
    Ibv { id: ibv::CmId },
}

impl ListenerShared {
    /// Wait for the next request on the backend.
    fn next_raw(&self) -> Result<Raw> {
        let _one = self.accepting.lock().unwrap_or_else(|p| p.into_inner());
        let (backend, data) = match &self.backend {
            ListenerBackend::User(l) => {
                let req = l.accept()?;
                let data = req.request().private_data.clone();
                (IncomingBackend::User(req), data)
            }
            ListenerBackend::Ibv { channel, .. } => {
                let ev = channel.expect(ibv::CmEventType::ConnectRequest)?;
                let id = ev
                    .new_id
                    .ok_or_else(|| Error::Connect("connect request without an id".into()))?;
                (IncomingBackend::Ibv { id }, ev.private_data)
            }
        };
        let (hello, app) = Hello::decode(&data);
        Ok(Raw {
            backend,
            hello,
            app: app.to_vec(),
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
    pub fn bind(ctx: &crate::device::Context, addr: SocketAddr) -> Result<Listener> {
        let backend = match ctx.backend() {
            ContextBackend::User(_) => {
                ListenerBackend::User(provider::device::Listener::bind(addr)?)
            }
            ContextBackend::Ibv(_) => {
                let channel = ibv::EventChannel::new()?;
                let id = ibv::CmId::new(&channel)?;
                id.bind_addr(addr)?;
                id.listen(16)?;
                ListenerBackend::Ibv { channel, id }
            }
        };
        Ok(Listener {
            shared: Arc::new(ListenerShared {
                backend,
                stash: Mutex::new(VecDeque::new()),
                accepting: Mutex::new(()),
            }),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        match &self.shared.backend {
            ListenerBackend::User(l) => Ok(l.local_addr()?),
            ListenerBackend::Ibv { id, .. } => id
                .local_addr()
                .ok_or_else(|| Error::Connect("listener has no local address".into())),
        }
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
        let mut reply_opts = opts.clone();
        if let Some(peer) = peer {
            // Only a stag initiator gets a header back: another peer would
            // take it for application data.
            reply_opts.private_data = Hello {
                wants_agent,
                is_agent: false,
                token: peer.token,
                mailbox: None,
                native: ctx.native_ops(),
            }
            .encode(&opts.private_data);
        }
        let qp = accept_raw(raw.backend, pd, cq, &reply_opts, pre_post)?;
        qp.inner.set_connection(caps, peer_native);
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
                let agent_opts = agent_options(&setup, token);
                let aqp = accept_raw(agent_raw.backend, pd, &setup.cq, &agent_opts, |q| {
                    setup.pre_post(q)
                })?;
                let agent = setup.start(pd, aqp, mailbox);
                let _ = qp.inner.agent.set(agent);
            }
        }
        Ok(qp)
    }

    /// Reject with private data.
    pub fn reject(self, private_data: &[u8]) -> Result<()> {
        match self.raw.backend {
            IncomingBackend::User(req) => Ok(req.reject(private_data)?),
            IncomingBackend::Ibv { id, .. } => Ok(id.reject(private_data)?),
        }
    }
}

/// Accept one request onto a new QP, no stag header.
fn accept_raw(
    backend: IncomingBackend,
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    opts: &ConnectOptions,
    pre_post: impl FnOnce(&QueuePair) -> Result<()>,
) -> Result<QueuePair> {
    check_same_device(pd, cq, opts)?;
    match (backend, pd.backend(), &cq.inner.backend) {
        (IncomingBackend::User(req), PdBackend::User(upd), CqBackend::User(ucq)) => {
            let qp = user_qp(pd, upd, cq, ucq, opts)?;
            pre_post(&qp)?;
            let QpBackend::User(uqp) = qp.inner_backend() else {
                unreachable!("built as a userspace QP")
            };
            req.accept(uqp, &opts.mpa())?;
            Ok(qp)
        }
        (IncomingBackend::Ibv { id }, PdBackend::Ibv(ipd), CqBackend::Ibv(icq)) => {
            // Its own channel, so that its ESTABLISHED is not mixed up with
            // other requests arriving on the listener's.
            let channel = ibv::EventChannel::new()?;
            let id = id.migrate(&channel)?;
            let qp = ibv_qp(pd, ipd, cq, icq, id, opts)?;
            pre_post(&qp)?;
            let id = qp.cm_id().expect("built as an ibv QP");
            id.accept(&opts.conn_param())?;
            channel.expect(ibv::CmEventType::Established)?;
            Ok(qp)
        }
        _ => Err(Error::Mismatch),
    }
}
