//! Two endpoints of the userspace provider connected over TCP.

#![allow(dead_code)]

pub mod pair;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use provider::cq::CompletionQueue;
use provider::device::{Device, Listener, MemoryRegion, ProtectionDomain, QueuePair};
use provider::mem::Access;
use provider::qp::{Event, QpCaps};
use provider::region::Region;
use provider::setup::MpaParams;
use provider::srq::Srq;
use provider::wr::{RecvWr, SendOp, SendWr, Sge, WorkCompletion};

/// Every right, for tests that are not about rights.
pub const ALL: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC)
    .union(Access::FLUSH_PERSISTENT)
    .union(Access::REMOTE_INVALIDATE);

/// A registration that owns its memory and deregisters on drop.
pub type Mr = MemoryRegion;

/// Register `len` bytes of fresh anonymous memory.
pub fn new_mr(pd: &ProtectionDomain, len: usize, access: Access) -> Mr {
    register(pd, Region::anonymous(len).unwrap(), access)
}

/// Register `region` at its own addresses.
pub fn register(pd: &ProtectionDomain, region: Region, access: Access) -> Mr {
    let iova = region.addr(0);
    pd.register(region, iova, access).unwrap()
}

pub struct Side {
    pub dev: Device,
    pub pd: ProtectionDomain,
    pub cq: Arc<CompletionQueue>,
    pub qp: QueuePair,
    pub mr: Mr,
}

impl Side {
    pub fn new(srq: Option<&Arc<Srq>>) -> Side {
        let dev = Device::open("test").unwrap();
        Self::on(&dev, srq)
    }

    pub fn on(dev: &Device, srq: Option<&Arc<Srq>>) -> Side {
        Self::in_pd(&dev.alloc_pd(), srq)
    }

    pub fn in_pd(pd: &ProtectionDomain, srq: Option<&Arc<Srq>>) -> Side {
        let dev = pd.device().clone();
        let pd = pd.clone();
        let cq = CompletionQueue::new(4096).unwrap();
        let qp = pd.create_qp(QpCaps::default(), &cq, &cq, srq);
        let mr = new_mr(&pd, 1 << 20, ALL);
        Side {
            dev,
            pd,
            cq,
            qp,
            mr,
        }
    }

    pub fn post(&self, wr_id: u64, op: SendOp, sg_list: Vec<Sge>) {
        self.qp
            .post_send(SendWr {
                wr_id,
                op,
                sg_list,
                signaled: true,
                fence: false,
            })
            .unwrap();
    }

    pub fn recv(&self, wr_id: u64, offset: usize, len: u32) {
        self.qp
            .post_recv(RecvWr {
                wr_id,
                sg_list: vec![self.mr.sge(offset, len)],
            })
            .unwrap();
    }

    /// Poll until `n` completions arrived (busy, with a deadline).
    pub fn wait(&self, n: usize) -> Vec<WorkCompletion> {
        wait_cq(&self.cq, n)
    }

    /// Wait until an event matching `f` shows up.
    pub fn wait_event(&self, f: impl Fn(&Event) -> bool) -> Event {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(e) = self.qp.take_events().into_iter().find(|e| f(e)) {
                return e;
            }
            assert!(Instant::now() < deadline, "event did not arrive");
            self.qp.progress();
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

pub fn wait_cq(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    let mut buf = [WorkCompletion::BLANK; 16];
    while out.len() < n {
        let got = cq.poll(&mut buf[..(n - out.len()).min(16)]);
        out.extend_from_slice(&buf[..got]);
        if got == 0 {
            assert!(
                Instant::now() < deadline,
                "only {} of {n} completions arrived: {out:?}",
                out.len()
            );
            std::thread::yield_now();
        }
    }
    out
}

/// Connect `client` to `server` over loopback with the given parameters.
pub fn connect_with(client: &Side, server: &Side, cparams: MpaParams, sparams: MpaParams) {
    connect_at(
        client,
        server,
        "127.0.0.1:0".parse().unwrap(),
        cparams,
        sparams,
    )
}

pub fn connect_at(
    client: &Side,
    server: &Side,
    bind: SocketAddr,
    cparams: MpaParams,
    sparams: MpaParams,
) {
    let listener = Listener::bind(bind).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            let req = listener.accept().unwrap();
            req.accept(&server.qp, &sparams).unwrap();
        });
        client.qp.connect(addr, &cparams).unwrap();
        h.join().unwrap();
    });
}

/// A connected pair with default parameters (MPA rev 2, CRC on).
pub fn pair() -> (Side, Side) {
    let a = Side::new(None);
    let b = Side::new(None);
    connect_with(&a, &b, MpaParams::default(), MpaParams::default());
    (a, b)
}
