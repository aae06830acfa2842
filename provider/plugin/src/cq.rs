//! Completion queues and completion channels.
//!
//! A completion channel is a pipe: `ibv_get_cq_event` (libibverbs) reads an
//! 8-byte `ib_uverbs_comp_event_desc` holding the `ibv_cq` pointer from
//! `channel->fd`, as the kernel would write it. One notifier thread per
//! process waits on the armed CQs' event fds and writes those records.
//! libibverbs' own `ibv_create_comp_channel` would ask the kernel through
//! the command fd, so the plugin interposes it ([`crate::interpose`]).

use std::collections::HashMap;
use std::ffi::c_int;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::ptr;
use std::sync::{Arc, Mutex, OnceLock};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use provider::cq::CompletionQueue;
use provider::wr::{WcOpcode, WcStatus, WorkCompletion};

use crate::context::limits;
use crate::errno::{self, guard};
use crate::ffi::*;
use crate::sweep::{self, PollMark};
use provider::thread::SpawnMasked;

/// `ibv_cq` first, then the RNIC's CQ.
#[repr(C)]
pub(crate) struct StagCq {
    cq: ibv_cq,
    pub(crate) inner: Arc<CompletionQueue>,
    /// Registered with the notifier (created with a channel).
    notified: bool,
    /// Counts the `poll_cq`s on this CQ ([`crate::sweep`]).
    pub(crate) mark: Arc<PollMark>,
}

/// The RNIC CQ behind one of our `ibv_cq`s.
///
/// # Safety
/// `cq` must be NULL or a live `ibv_cq`.
pub(crate) unsafe fn cq<'a>(cq: *const ibv_cq) -> Option<&'a Arc<CompletionQueue>> {
    // SAFETY: a live ibv_cq has a live context; ours are StagCqs.
    if cq.is_null() || !crate::context::is_stag_context(unsafe { (*cq).context }) {
        return None;
    }
    // SAFETY: ours (checked); StagCq starts with the ibv_cq.
    Some(unsafe { &(*cq.cast::<StagCq>()).inner })
}

/// The poll count of one of our `ibv_cq`s.
///
/// # Safety
/// As [`cq`].
pub(crate) unsafe fn mark(cq: *const ibv_cq) -> Option<Arc<PollMark>> {
    // SAFETY: forwarded; `cq` checked it is ours.
    unsafe { self::cq(cq) }.map(|_| unsafe { (*cq.cast::<StagCq>()).mark.clone() })
}

/// The completion channels this plugin made: channel address → the pipe's
/// write end.
pub(crate) fn channels() -> &'static Mutex<HashMap<usize, OwnedFd>> {
    static CHANNELS: OnceLock<Mutex<HashMap<usize, OwnedFd>>> = OnceLock::new();
    CHANNELS.get_or_init(Default::default)
}

/// The thread that turns armed CQs' events into channel records.
struct Notifier {
    epoll: Epoll,
    /// `ibv_cq` address → its CQ and a dup of its channel's write end.
    entries: Mutex<HashMap<u64, (Arc<CompletionQueue>, OwnedFd)>>,
}

fn notifier() -> Option<&'static Notifier> {
    static NOTIFIER: OnceLock<Option<&'static Notifier>> = OnceLock::new();
    *NOTIFIER.get_or_init(|| {
        let epoll = match Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC) {
            Ok(e) => e,
            Err(e) => {
                tracing::error!("stag0: completion notifier: epoll: {e}");
                return None;
            }
        };
        let n: &'static Notifier = Box::leak(Box::new(Notifier {
            epoll,
            entries: Mutex::new(HashMap::new()),
        }));
        let spawned = std::thread::Builder::new()
            .name("stag0-cq-events".into())
            .spawn_masked(move || n.run());
        if let Err(e) = spawned {
            tracing::error!("stag0: completion notifier thread: {e}");
            return None;
        }
        Some(n)
    })
}

impl Notifier {
    fn run(&self) {
        let mut events = [EpollEvent::empty(); 32];
        loop {
            let n = match self.epoll.wait(&mut events, EpollTimeout::NONE) {
                Ok(n) => n,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    tracing::error!("stag0: completion notifier: {e}");
                    return;
                }
            };
            let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
            for ev in &events[..n] {
                let token = ev.data();
                let Some((cq, chan)) = entries.get(&token) else {
                    continue;
                };
                cq.ack_events();
                let desc = token.to_ne_bytes();
                // SAFETY: writes 8 bytes from a local buffer to our pipe.
                let _ = unsafe { libc::write(chan.as_raw_fd(), desc.as_ptr().cast(), desc.len()) };
            }
        }
    }
}

pub(crate) unsafe extern "C" fn create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    channel: *mut ibv_comp_channel,
    _comp_vector: c_int,
) -> *mut ibv_cq {
    guard("create_cq", ptr::null_mut(), || {
        if !crate::context::is_stag_context(ctx) || !(1..=limits::MAX_CQE).contains(&cqe) {
            errno::set(libc::EINVAL);
            return ptr::null_mut();
        }
        let chan_fd = if channel.is_null() {
            None
        } else {
            let chans = channels().lock().unwrap_or_else(|p| p.into_inner());
            match chans.get(&(channel as usize)).map(|fd| fd.try_clone()) {
                Some(Ok(fd)) => Some(fd),
                Some(Err(e)) => {
                    errno::set(e.raw_os_error().unwrap_or(libc::EMFILE));
                    return ptr::null_mut();
                }
                None => {
                    tracing::warn!("stag0: ibv_create_cq: the channel is not a stag0 channel");
                    errno::set(libc::EINVAL);
                    return ptr::null_mut();
                }
            }
        };
        let inner = match CompletionQueue::new(cqe as usize) {
            Ok(q) => q,
            Err(e) => {
                errno::set(e.raw_os_error().unwrap_or(libc::ENOMEM));
                return ptr::null_mut();
            }
        };
        let raw = Box::into_raw(Box::new(StagCq {
            cq: ibv_cq {
                context: ctx,
                channel,
                cqe,
                ..Default::default()
            },
            inner: inner.clone(),
            notified: chan_fd.is_some(),
            mark: Arc::default(),
        }));
        if let Some(fd) = chan_fd {
            let Some(n) = notifier() else {
                // SAFETY: just allocated, not handed out.
                drop(unsafe { Box::from_raw(raw) });
                errno::set(libc::ENOMEM);
                return ptr::null_mut();
            };
            let token = raw as u64;
            let mut entries = n.entries.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = n
                .epoll
                .add(inner.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, token))
            {
                drop(entries);
                // SAFETY: just allocated, not handed out.
                drop(unsafe { Box::from_raw(raw) });
                errno::set(e as i32);
                return ptr::null_mut();
            }
            entries.insert(token, (inner, fd));
        }
        raw.cast()
    })
}

pub(crate) unsafe extern "C" fn destroy_cq(cq: *mut ibv_cq) -> c_int {
    guard("destroy_cq", libc::EIO, || {
        // SAFETY: libibverbs passes a cq of this context.
        if unsafe { self::cq(cq) }.is_none() {
            return libc::EINVAL;
        }
        let raw = cq.cast::<StagCq>();
        // SAFETY: ours (checked).
        let sc = unsafe { &*raw };
        if sc.notified {
            if let Some(n) = notifier() {
                let mut entries = n.entries.lock().unwrap_or_else(|p| p.into_inner());
                let _ = n.epoll.delete(sc.inner.as_fd());
                entries.remove(&(raw as u64));
            }
        }
        // SAFETY: ours, freed once; the notifier no longer knows it.
        drop(unsafe { Box::from_raw(raw) });
        0
    })
}

pub(crate) unsafe extern "C" fn resize_cq(cq: *mut ibv_cq, cqe: c_int) -> c_int {
    guard("resize_cq", libc::EIO, || {
        // SAFETY: libibverbs passes a cq of this context.
        if unsafe { self::cq(cq) }.is_none() || !(1..=limits::MAX_CQE).contains(&cqe) {
            return libc::EINVAL;
        }
        tracing::warn!("stag0: ibv_resize_cq is not supported");
        libc::EOPNOTSUPP
    })
}

pub(crate) unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    guard("req_notify_cq", libc::EIO, || {
        // SAFETY: libibverbs passes a cq of this context.
        let Some(inner) = (unsafe { self::cq(cq) }) else {
            return libc::EINVAL;
        };
        inner.req_notify(solicited_only != 0);
        0
    })
}

/// How many completions one call converts through its stack buffer.
const POLL_BATCH: usize = 32;

pub(crate) unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, num: c_int, wc: *mut ibv_wc) -> c_int {
    guard("poll_cq", -1, || {
        // SAFETY: libibverbs passes a cq of this context.
        let Some(inner) = (unsafe { self::cq(cq) }) else {
            errno::set(libc::EINVAL);
            return -1;
        };
        // SAFETY: ours (checked above).
        let mark = unsafe { &(*cq.cast::<StagCq>()).mark };
        mark.bump();
        if num <= 0 {
            return 0;
        }
        if wc.is_null() {
            errno::set(libc::EINVAL);
            return -1;
        }
        let mut buf = [WorkCompletion::BLANK; POLL_BATCH];
        let want = (num as usize).min(POLL_BATCH);
        let mut n = inner.poll(&mut buf[..want]);
        if n == 0 && sweep::registry().sweep(mark) > 0 {
            // What the sweep delivered may have landed here.
            n = inner.try_poll(&mut buf[..want]);
        }
        for (i, c) in buf[..n].iter().enumerate() {
            // SAFETY: the caller gave room for `num` ≥ n entries.
            unsafe { ptr::write(wc.add(i), to_ibv_wc(c)) };
        }
        if let Some(last) = buf[..n].last() {
            if last.opcode == WcOpcode::RdmaWrite
                && last.status == WcStatus::Success
                && inner.is_empty()
            {
                // The program may now wait for the peer's answer in
                // memory, without entering the provider.
                crate::assist::assists().after_write(last.qp_num);
            }
        }
        n as c_int
    })
}

/// libibverbs' `IBV_WC_FLUSH` / `IBV_WC_ATOMIC_WRITE` (rdma-core ≥ 45).
const WC_FLUSH: u32 = 8;
const WC_ATOMIC_WRITE: u32 = 9;

/// A provider completion as `struct ibv_wc`. 32-bit verbs immediate data
/// is the low half of the 8-byte iWARP Immediate Data, in network order.
pub(crate) fn to_ibv_wc(c: &WorkCompletion) -> ibv_wc {
    // Same discriminants (checked against the header in the tests).
    let status = c.status as u32;
    let opcode = match c.opcode {
        WcOpcode::Send | WcOpcode::Imm => IBV_WC_SEND,
        WcOpcode::RdmaWrite => IBV_WC_RDMA_WRITE,
        WcOpcode::RdmaRead => IBV_WC_RDMA_READ,
        WcOpcode::CmpSwap | WcOpcode::Swap => IBV_WC_COMP_SWAP,
        WcOpcode::FetchAdd => IBV_WC_FETCH_ADD,
        WcOpcode::Commit => WC_FLUSH,
        WcOpcode::AtomicWrite => WC_ATOMIC_WRITE,
        WcOpcode::Recv => IBV_WC_RECV,
        WcOpcode::RecvImm => IBV_WC_RECV_RDMA_WITH_IMM,
    };
    let mut wc = ibv_wc {
        wr_id: c.wr_id,
        status,
        opcode,
        vendor_err: c.vendor_err,
        byte_len: c.byte_len,
        qp_num: c.qp_num,
        ..Default::default()
    };
    if let Some(imm) = c.imm {
        wc.wc_flags |= IBV_WC_WITH_IMM;
        wc.__bindgen_anon_1.imm_data = (imm as u32).to_be();
    } else if let Some(rkey) = c.invalidated_rkey {
        wc.wc_flags |= IBV_WC_WITH_INV;
        wc.__bindgen_anon_1.invalidated_rkey = rkey;
    }
    wc
}

#[cfg(test)]
mod tests {
    use super::*;
    use provider::wr::WcStatus;

    /// Every provider status reaches C as the header's value (a fatal
    /// error as `IBV_WC_FATAL_ERR`, 19, not 14).
    #[test]
    fn statuses_reach_c_as_the_header_values() {
        let header = [
            IBV_WC_SUCCESS,
            IBV_WC_LOC_LEN_ERR,
            IBV_WC_LOC_QP_OP_ERR,
            IBV_WC_LOC_EEC_OP_ERR,
            IBV_WC_LOC_PROT_ERR,
            IBV_WC_WR_FLUSH_ERR,
            IBV_WC_MW_BIND_ERR,
            IBV_WC_BAD_RESP_ERR,
            IBV_WC_LOC_ACCESS_ERR,
            IBV_WC_REM_INV_REQ_ERR,
            IBV_WC_REM_ACCESS_ERR,
            IBV_WC_REM_OP_ERR,
            IBV_WC_RETRY_EXC_ERR,
            IBV_WC_RNR_RETRY_EXC_ERR,
            IBV_WC_LOC_RDD_VIOL_ERR,
            IBV_WC_REM_INV_RD_REQ_ERR,
            IBV_WC_REM_ABORT_ERR,
            IBV_WC_INV_EECN_ERR,
            IBV_WC_INV_EEC_STATE_ERR,
            IBV_WC_FATAL_ERR,
            IBV_WC_RESP_TIMEOUT_ERR,
            IBV_WC_GENERAL_ERR,
            IBV_WC_TM_ERR,
            IBV_WC_TM_RNDV_INCOMPLETE,
        ];
        assert_eq!(header.len(), WcStatus::ALL.len());
        for (status, want) in WcStatus::ALL.into_iter().zip(header) {
            let wc = to_ibv_wc(&WorkCompletion {
                status,
                ..WorkCompletion::BLANK
            });
            assert_eq!(wc.status, want, "{status:?}");
        }
    }
}
