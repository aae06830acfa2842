//! Completion queues and completion channels.
//!
//! A completion channel is a pipe: `ibv_get_cq_event` (libibverbs) reads an
//! 8-byte `ib_uverbs_comp_event_desc` holding the `ibv_cq` pointer from
//! `channel->fd`, as the kernel would write it. The thread that delivers
//! the completion firing an armed CQ (the device's engine, or whichever
//! application thread drove the QP) writes that record itself, so the
//! application thread asleep on the channel is the only thread woken.
//! libibverbs' own `ibv_create_comp_channel` would ask the kernel through
//! the command fd, so the plugin interposes it ([`crate::interpose`]).

use std::collections::HashMap;
use std::ffi::c_int;
use std::ptr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};

use provider::cq::{CompletionQueue, NotifySink};
use provider::wr::{WcOpcode, WorkCompletion};
use smallvec::SmallVec;

use crate::comp_channel::Channel;
use crate::errno::{self, guard};
use crate::ffi::*;
use crate::handle::{self, from_raw, Object};
use provider::identity::LIMITS;

/// `ibv_cq` first, then the RNIC's CQ.
#[repr(C)]
pub(crate) struct StagCq {
    cq: ibv_cq,
    pub(crate) inner: Arc<CompletionQueue>,
    /// Where its notifications go (created with a channel).
    channel: Option<Arc<ChannelWriter>>,
    /// The QPs completing into this CQ.
    pub(crate) users: Arc<crate::users::Users>,
    /// Where its IBV_EVENT_CQ_ERR goes.
    events: Option<Arc<crate::async_events::AsyncSource>>,
    /// Completion events the application has read (`ibv_get_cq_event`):
    /// `destroy_cq` waits until as many are acked, as the kernel's
    /// `comp_events_reported` makes rdma-core's `ibv_cmd_destroy_cq` do.
    comp_reported: AtomicU32,
}

// SAFETY: repr(C), starts with its ibv_cq; create_cq makes every ibv_cq
// of a stag context.
unsafe impl Object for StagCq {
    type C = ibv_cq;
}

/// One completion event of `cq` read by the application (libibverbs'
/// `ibv_get_cq_event` calls the `cq_event` op; ours counts here itself).
///
/// # Safety
/// `cq` must be NULL or a live `ibv_cq`.
pub(crate) unsafe fn count_event(cq: *mut ibv_cq) {
    // SAFETY: forwarded.
    if let Some(sc) = unsafe { from_raw::<StagCq>(cq) } {
        sc.comp_reported.fetch_add(1, Ordering::AcqRel);
    }
}

thread_local! {
    /// The channel this thread sleeps on in [`get_cq_event`] (0: none),
    /// and the records of that channel's notifications this thread fired
    /// itself meanwhile: they go to it directly, not through the pipe it
    /// would then have to poll and read.
    static WAITING: std::cell::RefCell<(usize, Vec<u64>)> =
        const { std::cell::RefCell::new((0, Vec::new())) };
}

/// Where a CQ's notifications go: its completion channel, while the CQ
/// still exists. The provider CQ may outlive its `ibv_cq` for a moment (a
/// QP being torn down holds it), and a record naming a freed `ibv_cq`
/// must never reach the application.
struct ChannelWriter {
    chan: Arc<Channel>,
    /// The channel's address.
    channel: usize,
    /// The `ibv_cq` address, the record's content.
    token: u64,
    /// Written (false) by `destroy_cq`; read for the whole of a delivery,
    /// so no record is delivered once `destroy_cq` returns.
    open: RwLock<bool>,
}

impl ChannelWriter {
    /// One event record: to this thread itself if it is inside
    /// `ibv_get_cq_event` on the channel, else to the channel
    /// ([`Channel::deliver`]).
    fn notify(&self) {
        let open = self.open.read().unwrap_or_else(|p| p.into_inner());
        if !*open {
            return;
        }
        let direct = WAITING.with(|w| match w.try_borrow_mut() {
            Ok(mut w) if w.0 == self.channel => {
                w.1.push(self.token);
                true
            }
            _ => false,
        });
        if !direct {
            self.chan.deliver(self.token);
        }
    }
}

/// The CQs of each completion channel: channel address → (`ibv_cq`
/// address, its RNIC CQ).
type ChannelCqs = HashMap<usize, Vec<(usize, Weak<CompletionQueue>)>>;

fn channel_cqs() -> &'static Mutex<ChannelCqs> {
    static CQS: OnceLock<Mutex<ChannelCqs>> = OnceLock::new();
    CQS.get_or_init(Default::default)
}

/// `ibv_get_cq_event` on one of our channels (`None`: not ours).
///
/// A record kept in memory ([`Channel::deliver`]: nobody could have been
/// watching the fd when it came, typically this thread's own Send
/// completion) is the answer at once, with no system call. Otherwise the
/// thread sleeps on the channel's pipe and on the sockets of the QPs
/// that feed its armed CQs ([`CompletionQueue::wait_notified`]): the
/// peer's message wakes this thread, which places it, delivers the
/// completion and gets its own record in memory, instead of waking the
/// engine to do so and then this thread through the pipe.
///
/// # Safety
/// `ch` must be NULL or a live channel; `out_cq` and `out_ctx` writable.
pub(crate) unsafe fn get_cq_event(
    ch: *mut ibv_comp_channel,
    out_cq: *mut *mut ibv_cq,
    out_ctx: *mut *mut std::ffi::c_void,
) -> Option<c_int> {
    if ch.is_null() {
        return None;
    }
    let chan = handle::comp_channels()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&(ch as usize))
        .cloned()?;
    Some(guard("ibv_get_cq_event", -1, || {
        let token = match chan.begin_sleep() {
            Ok(token) => token,
            Err(sleeper) => {
                let waited = wait_for_record(ch, &chan);
                drop(sleeper);
                match waited {
                    Ok((token, others)) => {
                        // Several CQs on the channel fired: the others go
                        // where any thread, or poll(2), can find them.
                        for other in others {
                            chan.deliver(other);
                        }
                        token
                    }
                    Err(e) => {
                        errno::set(e);
                        return -1;
                    }
                }
            }
        };
        let cq = token as usize as *mut ibv_cq;
        // SAFETY: the record names one of our live CQs (destroy_cq stops
        // records before it frees one); the out pointers are the caller's.
        unsafe {
            *out_cq = cq;
            *out_ctx = (*cq).cq_context;
            count_event(cq);
        }
        0
    }))
}

/// The sleeping part of [`get_cq_event`], the thread counted as the
/// channel's sleeper: the record this thread fired itself while driving
/// the QPs (with any others it fired, for the caller to deliver once it
/// no longer counts as a sleeper), or else one read from the pipe; an
/// errno on failure.
fn wait_for_record(ch: *mut ibv_comp_channel, chan: &Channel) -> Result<(u64, Vec<u64>), i32> {
    let cqs: SmallVec<[Arc<CompletionQueue>; 2]> = channel_cqs()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&(ch as usize))
        .map(|v| v.iter().filter_map(|(_, w)| w.upgrade()).collect())
        .unwrap_or_default();
    let fd = chan.fd();
    // SAFETY: the channel's read end stays open while the channel exists
    // (the caller's contract).
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    // A channel fd the program made non-blocking (libfabric's verbs
    // provider does, then reads events until EAGAIN) is looked at once:
    // the QPs are driven without sleeping, and an empty channel answers
    // EAGAIN from the read below, as the kernel's would. The flag is the
    // one the interposed fcntl/ioctl saw set: no F_GETFL per wait.
    let nonblocking = chan.nonblocking();
    let timeout = nonblocking.then_some(std::time::Duration::ZERO);
    WAITING.with(|w| w.borrow_mut().0 = ch as usize);
    let waited = crate::comp_channel::inside(|| loop {
        let waited = CompletionQueue::wait_notified(borrowed, &cqs, timeout, &|| {
            WAITING.with(|w| !w.borrow().1.is_empty())
        });
        // libibverbs' read(2) of the channel is restarted after a
        // handler with SA_RESTART, as the kernel restarts it; poll(2)
        // never is.
        match waited {
            Err(nix::errno::Errno::EINTR) if restarts_after_signal() => continue,
            other => break other,
        }
    });
    // The first record this thread fired is the answer; any others (several
    // CQs on the channel) are the caller's to deliver. The buffer stays
    // the thread's, so a wait per message allocates nothing.
    let (first, others) = WAITING.with(|w| {
        let mut w = w.borrow_mut();
        w.0 = 0;
        let others = if w.1.len() > 1 {
            w.1.split_off(1)
        } else {
            Vec::new()
        };
        (w.1.pop(), others)
    });
    let Some(first) = first else {
        if let Err(e) = waited {
            return Err(e as i32);
        }
        let mut desc = [0u8; 8];
        // SAFETY: reads 8 bytes into a local buffer. Blocks only if
        // another thread took the record first, as libibverbs' own read
        // would; on a non-blocking channel, fails with EAGAIN.
        let n = unsafe { libc::read(fd, desc.as_mut_ptr().cast(), desc.len()) };
        if n != desc.len() as isize {
            return Err(if n >= 0 {
                libc::EIO
            } else {
                nix::errno::Errno::last_raw()
            });
        }
        return Ok((u64::from_ne_bytes(desc), Vec::new()));
    };
    Ok((first, others))
}

/// Whether a read(2) interrupted by a signal's handler would be restarted:
/// every handler installed has SA_RESTART. (Which signal interrupted the
/// wait is not known here; with one handler lacking SA_RESTART the wait
/// ends with EINTR, as it would if that one had run.)
fn restarts_after_signal() -> bool {
    (1..=libc::SIGRTMAX()).all(|sig| {
        // SAFETY: sigaction is plain data, filled by the query below.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: a query (no new action) into a valid sigaction.
        if unsafe { libc::sigaction(sig, ptr::null(), &mut old) } != 0 {
            return true;
        }
        old.sa_sigaction == libc::SIG_DFL
            || old.sa_sigaction == libc::SIG_IGN
            || old.sa_flags & libc::SA_RESTART != 0
    })
}

pub(crate) unsafe extern "C" fn create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    channel: *mut ibv_comp_channel,
    _comp_vector: c_int,
) -> *mut ibv_cq {
    guard("create_cq", ptr::null_mut(), || {
        if !handle::is_stag_context(ctx) || !(1..=(LIMITS.max_cqe as i32)).contains(&cqe) {
            errno::set(libc::EINVAL);
            return ptr::null_mut();
        }
        let chan = if channel.is_null() {
            None
        } else {
            let chans = handle::comp_channels()
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            match chans.get(&(channel as usize)) {
                Some(chan) => Some(chan.clone()),
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
            channel: None,
            users: Arc::default(),
            events: None,
            comp_reported: AtomicU32::new(0),
        }));
        // SAFETY: ctx is live (checked ours above).
        if let Some(st) = unsafe { handle::context(ctx) } {
            // The kernel's user handle for a CQ is the ibv_cq pointer.
            let source = crate::async_events::AsyncSource::new(st.async_events.clone(), raw as u64);
            let s = source.clone();
            inner.set_overrun_hook(move || s.post(IBV_EVENT_CQ_ERR));
            // SAFETY: the fresh allocation, not handed out yet.
            unsafe { (*raw).events = Some(source) };
        }
        if let Some(chan) = chan {
            let writer = Arc::new(ChannelWriter {
                chan,
                channel: channel as usize,
                token: raw as u64,
                open: RwLock::new(true),
            });
            let sink = writer.clone();
            inner.set_notify_sink(NotifySink::new(move || sink.notify()));
            // SAFETY: just allocated, not handed out yet.
            unsafe { (*raw).channel = Some(writer) };
            channel_cqs()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(channel as usize)
                .or_default()
                .push((raw as usize, Arc::downgrade(&inner)));
        }
        raw.cast()
    })
}

pub(crate) unsafe extern "C" fn destroy_cq(cq: *mut ibv_cq) -> c_int {
    guard("destroy_cq", libc::EIO, || {
        // SAFETY: libibverbs passes a cq of this context.
        let Some(sc) = (unsafe { from_raw::<StagCq>(cq) }) else {
            return libc::EINVAL;
        };
        let raw = cq.cast::<StagCq>();
        if sc.users.in_use() {
            return libc::EBUSY;
        }
        // As for a QP: its unread events dropped, the read ones acked.
        if let Some(events) = &sc.events {
            let reported = events.retire();
            // SAFETY: the live cq's own members.
            unsafe {
                crate::async_events::wait_acked(
                    ptr::addr_of_mut!((*cq).mutex).cast(),
                    ptr::addr_of_mut!((*cq).cond).cast(),
                    ptr::addr_of!((*cq).async_events_completed),
                    reported,
                )
            };
        }
        if let Some(channel) = &sc.channel {
            *channel.open.write().unwrap_or_else(|p| p.into_inner()) = false;
            // Records kept in memory for it go too (the kernel drops a
            // destroyed CQ's queued events likewise).
            channel.chan.forget(channel.token);
            // Every completion event read is acked first: the application
            // may still be using the CQ it named (rdma-core's
            // ibv_cmd_destroy_cq waits so, on comp_events_completed).
            let reported = sc.comp_reported.load(Ordering::Acquire);
            // SAFETY: the live cq's own members (libibverbs initialised
            // them; ibv_ack_cq_events counts under them).
            unsafe {
                crate::async_events::wait_acked(
                    ptr::addr_of_mut!((*cq).mutex).cast(),
                    ptr::addr_of_mut!((*cq).cond).cast(),
                    ptr::addr_of!((*cq).comp_events_completed),
                    reported,
                )
            };
            let mut cqs = channel_cqs().lock().unwrap_or_else(|p| p.into_inner());
            let chan = sc.cq.channel as usize;
            if let Some(v) = cqs.get_mut(&chan) {
                v.retain(|(c, _)| *c != raw as usize);
                if v.is_empty() {
                    cqs.remove(&chan);
                }
            }
        }
        // SAFETY: ours, freed once; no record names it any more.
        drop(unsafe { Box::from_raw(raw) });
        0
    })
}

pub(crate) unsafe extern "C" fn resize_cq(cq: *mut ibv_cq, cqe: c_int) -> c_int {
    guard("resize_cq", libc::EIO, || {
        // SAFETY: libibverbs passes a cq of this context.
        if unsafe { from_raw::<StagCq>(cq) }.is_none()
            || !(1..=(LIMITS.max_cqe as i32)).contains(&cqe)
        {
            return libc::EINVAL;
        }
        tracing::warn!("stag0: ibv_resize_cq is not supported");
        libc::EOPNOTSUPP
    })
}

pub(crate) unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    guard("req_notify_cq", libc::EIO, || {
        // SAFETY: libibverbs passes a cq of this context.
        let Some(sc) = (unsafe { from_raw::<StagCq>(cq) }) else {
            return libc::EINVAL;
        };
        sc.inner.req_notify(solicited_only != 0);
        0
    })
}

/// How many completions one call converts through its stack buffer.
const POLL_BATCH: usize = 32;

pub(crate) unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, num: c_int, wc: *mut ibv_wc) -> c_int {
    guard("poll_cq", -1, || {
        // SAFETY: libibverbs passes a cq of this context.
        let Some(StagCq { inner, .. }) = (unsafe { from_raw::<StagCq>(cq) }) else {
            errno::set(libc::EINVAL);
            return -1;
        };
        // SAFETY: ours (checked above), so its context is a live one of ours.
        let Some(st) = (unsafe { handle::context((*cq).context) }) else {
            errno::set(libc::EINVAL);
            return -1;
        };
        if num <= 0 {
            // Still a poll, for the sweep's count.
            st.device.poll_cq_each(inner, 0, |_| {});
            return 0;
        }
        if wc.is_null() {
            errno::set(libc::EINVAL);
            return -1;
        }
        let want = (num as usize).min(POLL_BATCH);
        // The device's policies (sweep, assist) for a polling thread; each
        // completion written straight into the caller's array.
        let mut i = 0;
        let n = st.device.poll_cq_each(inner, want, |c| {
            if i < want {
                // SAFETY: the caller gave room for `num` ≥ want > i entries.
                unsafe { ptr::write(wc.add(i), to_ibv_wc(&c)) };
                i += 1;
            }
        });
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
