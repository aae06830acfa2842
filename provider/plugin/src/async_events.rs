//! A context's asynchronous events (`ibv_get_async_event`), and what
//! destroying an object does to its events.
//!
//! libibverbs reads `struct ib_uverbs_async_event_desc` from
//! `context->async_fd` as the kernel writes it, then calls the provider's
//! `async_event` op. stag0's `async_fd` is one end of a socket pair; the
//! other end is [`AsyncEvents::post`]'s.
//!
//! The kernel's rule for an object with events (`ibv_destroy_qp`, and
//! libibverbs' `ibv_cmd_destroy_qp`): the events not yet read are
//! dropped, and destroy waits until the application has acked
//! (`ibv_ack_async_event`, which counts on the object itself) every event
//! it read, so an ack never touches a freed object. [`AsyncEvents::retire`]
//! does the same: it stops the object's posts, takes its unread events
//! out of the socket (the others go back in order), and returns how many
//! the application read, for the destroy verb to wait on.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::ffi::*;

/// A context's event queue.
pub(crate) struct AsyncEvents {
    /// Our end of the socket pair: events are written here.
    tx: OwnedFd,
    /// A duplicate of `async_fd`, the application's end: `retire` reads
    /// the queue back through it (`async_fd` itself is closed by
    /// libibverbs with the context, maybe before the last object goes).
    rx: OwnedFd,
    /// Posting and retiring, one at a time; per element, the events in the
    /// socket (`queued`) and those the application read (`reported`).
    counts: Mutex<HashMap<u64, Counts>>,
}

#[derive(Default, Clone, Copy)]
struct Counts {
    queued: u32,
    reported: u32,
}

/// One object's way to post events: its element (the `ibv_qp`, `ibv_cq`
/// or `ibv_srq` pointer, the kernel's user handle) and whether it was
/// retired.
pub(crate) struct AsyncSource {
    events: Arc<AsyncEvents>,
    element: u64,
    retired: AtomicBool,
}

const DESC_LEN: usize = std::mem::size_of::<ib_uverbs_async_event_desc>();

/// Whether events of `event_type` name an object (QP, CQ, SRQ, WQ) rather
/// than a port or the device.
pub(crate) fn names_object(event_type: u32) -> bool {
    !matches!(
        event_type,
        IBV_EVENT_DEVICE_FATAL
            | IBV_EVENT_PORT_ACTIVE
            | IBV_EVENT_PORT_ERR
            | IBV_EVENT_LID_CHANGE
            | IBV_EVENT_PKEY_CHANGE
            | IBV_EVENT_SM_CHANGE
            | IBV_EVENT_CLIENT_REREGISTER
            | IBV_EVENT_GID_CHANGE
    )
}

impl AsyncEvents {
    /// The queue over `tx`, whose peer is `rx` (a duplicate of `async_fd`).
    pub(crate) fn new(tx: OwnedFd, rx: OwnedFd) -> AsyncEvents {
        AsyncEvents {
            tx,
            rx,
            counts: Mutex::new(HashMap::new()),
        }
    }

    fn counts(&self) -> MutexGuard<'_, HashMap<u64, Counts>> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A device-wide event (`IBV_EVENT_DEVICE_FATAL`), element the port.
    pub(crate) fn post_device(&self, port: u64, event_type: u32) {
        let _held = self.counts();
        self.send(port, event_type);
    }

    /// Write one descriptor; whether it went in whole. Never blocks and
    /// never raises SIGPIPE (the application may have closed its end): an
    /// event that does not fit is dropped and logged.
    fn send(&self, element: u64, event_type: u32) -> bool {
        let desc = ib_uverbs_async_event_desc {
            element,
            event_type,
            reserved: 0,
        };
        let flags = libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT;
        // SAFETY: sends the bytes of a local plain-data struct on our socket.
        let n = unsafe {
            libc::send(
                self.tx.as_raw_fd(),
                ptr::addr_of!(desc).cast(),
                DESC_LEN,
                flags,
            )
        };
        if n != DESC_LEN as isize {
            tracing::debug!(
                event_type,
                "stag0: async event dropped (queue full or context closed)"
            );
            return false;
        }
        true
    }

    /// libibverbs read an event (its `async_event` op): count it reported.
    pub(crate) fn note_read(&self, element: u64, event_type: u32) {
        if !names_object(event_type) {
            return;
        }
        let mut counts = self.counts();
        if let Some(c) = counts.get_mut(&element) {
            c.queued = c.queued.saturating_sub(1);
            c.reported += 1;
        }
    }

    /// Everything in the socket now, in order.
    fn take_queued(&self) -> Vec<ib_uverbs_async_event_desc> {
        let mut out = Vec::new();
        loop {
            let mut desc = ib_uverbs_async_event_desc::default();
            // SAFETY: reads at most DESC_LEN bytes into a local plain-data
            // struct from our duplicate of the application's end.
            let n = unsafe {
                libc::recv(
                    self.rx.as_raw_fd(),
                    ptr::addr_of_mut!(desc).cast(),
                    DESC_LEN,
                    libc::MSG_DONTWAIT,
                )
            };
            if n != DESC_LEN as isize {
                // Empty (EAGAIN). Descriptors go in and out whole (16
                // octets on a local stream socket), so nothing is split.
                return out;
            }
            out.push(desc);
        }
    }
}

impl AsyncSource {
    /// A source for the object at `element`.
    pub(crate) fn new(events: Arc<AsyncEvents>, element: u64) -> Arc<AsyncSource> {
        events.counts().insert(element, Counts::default());
        Arc::new(AsyncSource {
            events,
            element,
            retired: AtomicBool::new(false),
        })
    }

    /// Queue an event on this object, unless it was retired.
    pub(crate) fn post(&self, event_type: u32) {
        let mut counts = self.events.counts();
        if self.retired.load(Ordering::Acquire) {
            return;
        }
        if self.events.send(self.element, event_type) {
            counts.entry(self.element).or_default().queued += 1;
        }
    }

    /// The object is being destroyed: no more events; its unread ones are
    /// dropped. Returns how many the application read, which the destroy
    /// verb waits to see acked.
    pub(crate) fn retire(&self) -> u32 {
        let ev = &*self.events;
        let mut counts = ev.counts();
        self.retired.store(true, Ordering::Release);
        // Posting is held off (we hold the lock): take the queue out, put
        // back what is not ours, in order.
        let mut dropped = 0;
        for desc in ev.take_queued() {
            if desc.element == self.element && names_object(desc.event_type) {
                dropped += 1;
            } else {
                ev.send(desc.element, desc.event_type);
            }
        }
        if let Some(c) = counts.get_mut(&self.element) {
            c.queued = c.queued.saturating_sub(dropped);
        }
        // An application thread may be between libibverbs' read() and its
        // async_event op for one of ours: that event counts as reported.
        // It takes no lock of ours in between, so this ends at once.
        while counts.get(&self.element).is_some_and(|c| c.queued > 0) {
            drop(counts);
            std::thread::yield_now();
            counts = ev.counts();
        }
        counts.remove(&self.element).map_or(0, |c| c.reported)
    }
}

impl Drop for AsyncSource {
    fn drop(&mut self) {
        if !self.retired.load(Ordering::Acquire) {
            self.events.counts().remove(&self.element);
        }
    }
}

/// Wait until `*completed` (an object's `events_completed`, which
/// `ibv_ack_async_event` counts under the object's `mutex` and signals on
/// its `cond`) reaches `reported`.
///
/// # Safety
/// The three pointers are the live members of one libibverbs object.
pub(crate) unsafe fn wait_acked(
    mutex: *mut libc::pthread_mutex_t,
    cond: *mut libc::pthread_cond_t,
    completed: *const u32,
    reported: u32,
) {
    // SAFETY: as the caller promises; this is ibv_cmd_destroy_qp's loop.
    unsafe {
        libc::pthread_mutex_lock(mutex);
        while ptr::read_volatile(completed) != reported {
            libc::pthread_cond_wait(cond, mutex);
        }
        libc::pthread_mutex_unlock(mutex);
    }
}
