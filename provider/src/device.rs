//! The userspace RNIC's verbs objects: device, protection domains,
//! registrations, and the QPs made on them.
//!
//! Each connected QP is a sans-IO [`Connection`](crate::qp::Connection)
//! under a TCP driver (`driver.rs`, which also holds what a QP does
//! before it is connected); a [`QueuePair`] is a handle onto it, as
//! quinn's `Connection` is over quinn-proto. The device's progress engine
//! ([`crate::engine`]) drives the QPs no application thread is driving,
//! in the device's [`Progress`] mode.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::assist::Assist;
use crate::cq::CompletionQueue;
use crate::driver::QpShared;
use crate::engine::{Engine, Progress};
pub use crate::error::DeviceError;
pub use crate::establish::{ConnRequest, SETUP_TIMEOUT};
pub use crate::listener::Listener;
use crate::mem::{Access, MrTable, PdId};
use crate::qp::QpCaps;
pub use crate::queue_pair::{AsSendWr, PostGuard, QueuePair};
use crate::region::Region;
use crate::registry::QpRegistry;
use crate::srq::Srq;
use crate::wr::{Remote, Sge, WcOpcode, WcStatus, WorkCompletion};

/// A userspace iWARP device.
#[derive(Debug, Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

#[derive(Debug)]
pub(crate) struct DeviceInner {
    name: String,
    mem: Arc<MrTable>,
    next_pd: AtomicU32,
    next_qpn: AtomicU32,
    engine: Arc<Engine>,
    /// Every QP made on the device: for deregistration to find the output
    /// that still reads a region, and for the policies of
    /// [`Device::poll_cq`].
    qps: QpRegistry,
}

impl Device {
    /// Open a userspace device named `name` (e.g. `"stag0"`), in the
    /// progress mode `$STAG_PROGRESS` names (else the default).
    pub fn open(name: &str) -> Result<Device, DeviceError> {
        Self::open_with(name, Progress::from_env())
    }

    /// Open a userspace device whose engine runs in `progress` mode.
    pub fn open_with(name: &str, progress: Progress) -> Result<Device, DeviceError> {
        Ok(Device {
            inner: Arc::new(DeviceInner {
                name: name.to_owned(),
                mem: Arc::new(MrTable::new()),
                next_pd: AtomicU32::new(1),
                next_qpn: AtomicU32::new(1),
                engine: Arc::new(Engine::start(name, progress)?),
                qps: QpRegistry::default(),
            }),
        })
    }

    /// The progress mode of the device's engine.
    pub fn progress(&self) -> Progress {
        self.inner.engine.progress()
    }

    /// How many times the engine found input for a QP that an application
    /// thread was driving (it polled a CQ with no notification armed) and
    /// left it to that thread. An application that sleeps on completion
    /// notifications never causes one: its arrivals are the engine's, or
    /// the sleeping thread's own.
    pub fn engine_parks(&self) -> u64 {
        self.inner.engine.parks()
    }

    /// How many times a busy engine found an application thread driving
    /// a QP, with no arrival to race it for, and left the QP to it.
    pub fn engine_idle_parks(&self) -> u64 {
        self.inner.engine.idle_parks()
    }

    /// How many times a doorbell held back the short last segment of a
    /// post's output, to go out in front of the next post's.
    pub fn tails_held(&self) -> u64 {
        self.inner.engine.tails_held()
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// `ibv_alloc_pd`.
    pub fn alloc_pd(&self) -> ProtectionDomain {
        ProtectionDomain {
            device: self.clone(),
            id: self.inner.next_pd.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// The registration table.
    pub fn mem(&self) -> &MrTable {
        &self.inner.mem
    }

    /// `ibv_poll_cq` on `cq`, a CQ of this device's QPs, with the device's
    /// progress policies for a polling thread (`registry`): a poll
    /// that finds the CQ empty (and not armed) right after one that found
    /// it empty (a thread spins on it) sweeps the QPs whose CQs nobody
    /// polls, and one that reaps a successful RDMA Write and leaves
    /// the CQ empty assists that QP (`assist`). An armed CQ gets
    /// neither: its program is about to sleep on the notification, so its
    /// QPs stay with the engine. The rdma-core plugin's `poll_cq` and
    /// verbs' userspace backend poll through here.
    pub fn poll_cq(&self, cq: &CompletionQueue, out: &mut [WorkCompletion]) -> usize {
        let (max, take) = crate::cq::fill(out);
        self.poll_cq_each(cq, max, take)
    }

    /// [`poll_cq`](Self::poll_cq), handing up to `max` completions to
    /// `take` in order (under the CQ's lock: it should only store them),
    /// so that a front end fills its own buffer (`struct ibv_wc`, a Vec)
    /// without a blank-filled array in between.
    #[inline]
    pub fn poll_cq_each(
        &self,
        cq: &CompletionQueue,
        max: usize,
        mut take: impl FnMut(WorkCompletion),
    ) -> usize {
        cq.mark().bump();
        if max == 0 {
            return 0;
        }
        let armed = cq.is_armed();
        // What the assist needs of the last completion reaped.
        let mut last = None;
        let mut take = |wc: WorkCompletion| {
            last = Some((wc.opcode, wc.status, wc.qp_num));
            take(wc);
        };
        let mut n = cq.poll_each(max, &mut take);
        // Only a thread that spins on an empty CQ sweeps. A program that
        // polls many CQs in turn, each until it is empty (`stag bw --qps
        // 1024`), ends every visit with one empty poll; with a sweep
        // there, each visit drove every QP not visited for the idle time,
        // which is all of them when a round of visits takes longer (0.16
        // against 0.9 Mpps).
        if n == 0 && cq.mark().empty_again() && !armed && self.inner.qps.sweep(cq) > 0 {
            // What the sweep delivered may have landed here.
            n = cq.try_poll_each(max, &mut take);
        }
        if n > 0 {
            cq.mark().found();
        }
        if let Some((WcOpcode::RdmaWrite, WcStatus::Success, qpn)) = last {
            if !armed && cq.is_empty() {
                // The program may now wait for the peer's answer in
                // memory, without entering the provider.
                self.inner.qps.after_write(qpn);
            }
        }
        n
    }
}

/// A protection domain.
#[derive(Debug, Clone)]
pub struct ProtectionDomain {
    device: Device,
    id: PdId,
}

impl ProtectionDomain {
    /// The PD's id.
    pub fn id(&self) -> PdId {
        self.id
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// `ibv_reg_mr` over raw memory. Returns the STag (lkey = rkey).
    ///
    /// # Safety
    /// See [`MrTable::register`]: the memory stays valid until
    /// [`ProtectionDomain::dereg_mr`] returns, and the device may write it
    /// at any time meanwhile.
    pub unsafe fn reg_mr(
        &self,
        base: NonNull<u8>,
        len: usize,
        access: Access,
        durable: bool,
    ) -> Result<u32, DeviceError> {
        // SAFETY: forwarded contract.
        let stag = unsafe {
            self.device.inner.mem.register(
                self.id,
                base,
                base.as_ptr() as u64,
                len as u64,
                access,
                durable,
            )
        }?;
        Ok(stag)
    }

    /// `ibv_reg_mr` of memory the registration owns (sideway's
    /// `reg_managed_mr`): `region`'s bytes are visible to SGEs and peers at
    /// `iova..iova + len` (pass `region.addr(0)` for the usual
    /// virtual-address registration), and dropping the [`MemoryRegion`]
    /// deregisters them before the memory is unmapped.
    pub fn register(
        &self,
        region: Region,
        iova: u64,
        access: Access,
    ) -> Result<MemoryRegion, DeviceError> {
        // SAFETY: the MemoryRegion built below owns `region` and
        // deregisters the STag (Drop or `into_region`) before it drops or
        // hands back the memory; every safe access to a Region is a raw
        // copy or an atomic, so the device writing it meanwhile is sound.
        let stag = unsafe {
            self.device.inner.mem.register(
                self.id,
                region.as_ptr(),
                iova,
                region.len() as u64,
                access,
                region.is_durable(),
            )
        }?;
        Ok(MemoryRegion {
            pd: self.clone(),
            stag,
            iova,
            region: Some(region),
        })
    }

    /// `ibv_dereg_mr`. Once it returns the region is never read or
    /// written again. Output already framed from it (a Send's segments,
    /// a Read Response, waiting for the socket) is copied first, so that
    /// it leaves exactly as its CRC says; a posted WR whose octets are not
    /// framed yet completes with `IBV_WC_LOC_PROT_ERR` and its QP goes to
    /// Error, as on an RNIC.
    pub fn dereg_mr(&self, stag: u32) -> Result<(), DeviceError> {
        let inner = &self.device.inner;
        // New checks of the STag fail from here on, so no QP frames more
        // output from it while the queued output is copied.
        inner.mem.revoke(stag)?;
        for qp in inner.qps.live_in(self.id) {
            let env = qp.env();
            let mut io = qp.lock();
            if let Some(conn) = io.conn.as_mut() {
                conn.detach_region(&env, stag);
            }
        }
        inner.mem.remove_revoked(stag);
        Ok(())
    }

    /// `ibv_create_qp` for an RC QP.
    pub fn create_qp(
        &self,
        caps: QpCaps,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        srq: Option<&Arc<Srq>>,
    ) -> QueuePair {
        let qpn = self.device.inner.next_qpn.fetch_add(1, Ordering::Relaxed);
        let shared = QpShared::new(
            qpn,
            self.id,
            caps,
            self.device.inner.mem.clone(),
            &self.device.inner.engine,
            send_cq,
            recv_cq,
            srq,
        );
        let assist = Arc::new(Assist::new(
            shared.send_cq.mark().clone(),
            shared.recv_cq.mark().clone(),
        ));
        self.device.inner.qps.register(&shared, assist.clone());
        QueuePair::new(shared, self.device.inner.engine.clone(), assist)
    }
}

/// A registration that owns its memory, from
/// [`ProtectionDomain::register`]: deregistered when dropped, and only
/// then is the memory unmapped.
#[derive(Debug)]
pub struct MemoryRegion {
    pd: ProtectionDomain,
    stag: u32,
    iova: u64,
    /// `None` once handed back by [`into_region`](Self::into_region).
    region: Option<Region>,
}

impl MemoryRegion {
    /// The STag, used as both lkey and rkey.
    pub fn stag(&self) -> u32 {
        self.stag
    }

    /// The address of byte 0 for SGEs and peers.
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// The registered memory.
    pub fn region(&self) -> &Region {
        self.region
            .as_ref()
            .expect("a registration has its region until into_region")
    }

    /// A local SGE over `len` bytes at `offset`.
    pub fn sge(&self, offset: usize, len: u32) -> Sge {
        Sge {
            addr: self.iova + offset as u64,
            length: len,
            lkey: self.stag,
        }
    }

    /// What a peer needs to reach `offset` (address and rkey).
    pub fn remote(&self, offset: usize) -> Remote {
        Remote {
            addr: self.iova + offset as u64,
            rkey: self.stag,
        }
    }

    /// Deregister and give the memory back. If deregistration fails the
    /// STag stays in the table, so the memory stays mapped for good (it
    /// is leaked, never freed under the device) and the error returned.
    pub fn into_region(mut self) -> Result<Region, DeviceError> {
        let region = self.region.take().expect("taken once");
        match self.pd.dereg_mr(self.stag) {
            Ok(()) => Ok(region),
            Err(e) => {
                std::mem::forget(region);
                Err(e)
            }
        }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if let Some(region) = self.region.take() {
            if self.pd.dereg_mr(self.stag).is_err() {
                // Still in the table: the memory must stay mapped.
                std::mem::forget(region);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::qp::QpCaps;

    /// A poll that reaps its CQ, then one empty poll (a program that polls
    /// many CQs in turn, each until empty) does not sweep the other QPs; a
    /// second empty poll in a row (a thread spinning on the CQ) does.
    #[test]
    fn only_a_thread_spinning_on_an_empty_cq_sweeps() {
        let dev = Device::open("spin-sweep-test").unwrap();
        let pd = dev.alloc_pd();
        let (mine, theirs) = (
            CompletionQueue::new(4).unwrap(),
            CompletionQueue::new(4).unwrap(),
        );
        let qp = pd.create_qp(QpCaps::default(), &theirs, &theirs, None);
        let qps = &dev.inner.qps;
        let mut out = [WorkCompletion::BLANK; 4];
        for round in 0..3 {
            mine.push(WorkCompletion {
                wr_id: round,
                ..WorkCompletion::BLANK
            });
            assert_eq!(dev.poll_cq(&mine, &mut out), 1);
            assert_eq!(dev.poll_cq(&mine, &mut out), 0, "empty after the reap");
            assert!(!qps.swept_yet(qp.qp_num()), "round {round}: one empty poll");
        }
        assert_eq!(dev.poll_cq(&mine, &mut out), 0);
        assert!(qps.swept_yet(qp.qp_num()), "two empty polls in a row");
    }
}
