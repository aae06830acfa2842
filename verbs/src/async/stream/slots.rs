//! The stream's zero-copy path: [`SendSlot`] and [`RecvSlot`], guards
//! over the registered slots themselves, beside `AsyncRead`/`AsyncWrite`.
//!
//! The traits copy twice, because the caller's buffers are not
//! registered and may be reused once a call returns: into a send slot on
//! the writer, out of the ring on the reader (session 12's profile: 18 %
//! of the writer's samples, 12 % of the reader's). Here the caller writes
//! its bytes into a send slot it borrows ([`RdmaStream::send_slot`]) and
//! reads them from the ring slot they landed in ([`RdmaStream::recv_slot`]).
//!
//! **Sharing.** Both paths use the same ring, credits, slots and close:
//! a message committed from a slot is the next message of the stream,
//! after every byte written before it, and a read after a [`RecvSlot`]
//! goes on where the slot left off. The guards borrow the stream, so no
//! `poll_read`/`poll_write`/`poll_shutdown` (which take `&mut`) can run
//! while one lives: order is the order of the calls and commits.
//!
//! **Never reused while the device may touch it.** A [`SendSlot`] is a
//! send slot whose last message completed, with a data credit reserved
//! for it; it goes back to the stream when its message completes
//! (committed) or when it drops (not committed). A [`RecvSlot`] holds the
//! ring slot (or receive) its message landed in: its credit goes back to
//! the peer, which may then write that slot again, only once the guard
//! drops, and in the order the slots were handed out (the peer refills
//! the oldest slot first), so holding an older slot keeps the later ones'
//! credits back too.
//!
//! **Cancellation.** `send_slot()` and `recv_slot()` reserve nothing until
//! they resolve: dropping the future loses no slot, credit or byte.
//!
//! **Batching.** One post per message costs the writer more than the
//! copy it saves (session 13: `commit` per 64 KiB message ran at two
//! thirds of the rate of `commit_all` in fours): fill several slots,
//! awaiting the first and taking the rest with
//! [`RdmaStream::try_send_slot`], and post them with
//! [`RdmaStream::commit_all`].

use std::future::poll_fn;
use std::io;
use std::ops::{Deref, DerefMut};
use std::task::{Context as TaskContext, Poll};

use super::{
    io_err, plain_header, Close, RdmaStream, Side, StreamShared, StreamState, HEADER, KIND_DATA,
    TAG_SEND,
};
use crate::cq::WcStatus;
use crate::mr::MemoryRegion;
use crate::qp::WorkRequest;

/// A registered send slot of an [`RdmaStream`], borrowed to write a
/// message in place ([`RdmaStream::send_slot`]).
///
/// It derefs to the slot's payload, [`capacity`](Self::capacity) bytes
/// (`slot_size` - 16). [`commit(len)`](Self::commit) posts the first
/// `len` of them as the stream's next message. **Dropping it without a
/// commit sends nothing**: the slot and its credit go back to the stream
/// (a guard that does not know how much was written cannot post it).
pub struct SendSlot<'a> {
    stream: &'a RdmaStream,
    /// The send slot's index.
    slot: usize,
    /// Posted (or given back): nothing left for `Drop`.
    done: bool,
}

/// A filled ring slot of an [`RdmaStream`], borrowed to read a message in
/// place ([`RdmaStream::recv_slot`]).
///
/// It derefs to the message's bytes not yet read (all of it, unless an
/// `AsyncRead` call took its start). Dropping it frees the slot: its
/// credit goes back to the peer once every slot handed out before it was
/// dropped too.
pub struct RecvSlot<'a> {
    stream: &'a RdmaStream,
    /// Where the bytes are in the stream's region.
    at: usize,
    len: usize,
    /// Its place in `recv_held`.
    seq: u64,
}

impl RdmaStream {
    /// Borrow a registered send slot to write the next message in place:
    /// no copy of the payload. Waits (as `poll_write` does) while every
    /// send slot is in flight or the peer has no free ring slot.
    ///
    /// Fails once the connection failed, or after `shutdown`.
    /// Cancel-safe: the future holds nothing until it resolves.
    ///
    /// Each slot holds one of the window's credits until it is committed
    /// or dropped, and the peer returns credits only for messages it got:
    /// a task that holds slots while it awaits another can wait forever
    /// when the window is no larger than what it holds. To fill several
    /// before posting them together ([`commit_all`](Self::commit_all)),
    /// await the first and take the rest with
    /// [`try_send_slot`](Self::try_send_slot).
    ///
    /// ```no_run
    /// # async fn demo(stream: verbs::r#async::RdmaStream) -> std::io::Result<()> {
    /// let mut slot = stream.send_slot().await?;
    /// slot[..5].copy_from_slice(b"hello");
    /// slot.commit(5)?;
    /// # Ok(()) }
    /// ```
    pub async fn send_slot(&self) -> io::Result<SendSlot<'_>> {
        poll_fn(|cx| self.poll_send_slot(cx)).await
    }

    /// A send slot if one (and a credit) is free now, without waiting or
    /// driving the connection; `None` otherwise. Fails as `send_slot`.
    pub fn try_send_slot(&self) -> io::Result<Option<SendSlot<'_>>> {
        let st = &mut *self.shared.lock();
        Self::take_send_slot(st).map(|slot| {
            slot.map(|slot| SendSlot {
                stream: self,
                slot,
                done: false,
            })
        })
    }

    /// Reserve a send slot and a data credit, if free.
    fn take_send_slot(st: &mut StreamState) -> io::Result<Option<usize>> {
        if st.broken.is_some() {
            return Err(StreamShared::broken_error(st));
        }
        if st.close != Close::Open {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "send_slot after shutdown",
            ));
        }
        if st.data_credits == 0 {
            return Ok(None);
        }
        let slot = st.free_send.pop();
        if slot.is_some() {
            st.data_credits -= 1;
        }
        Ok(slot)
    }

    /// Borrow the next message in the ring slot it landed in: no copy of
    /// the payload. `None` at end of stream (the peer shut down and every
    /// byte before its close was read). Waits while nothing arrived.
    ///
    /// Fails once the connection failed (after the bytes that arrived
    /// before). Cancel-safe: the future holds nothing until it resolves.
    ///
    /// ```no_run
    /// # async fn demo(stream: verbs::r#async::RdmaStream) -> std::io::Result<()> {
    /// while let Some(slot) = stream.recv_slot().await? {
    ///     println!("{} bytes", slot.len());
    /// } // each slot goes back to the peer as it drops
    /// # Ok(()) }
    /// ```
    pub async fn recv_slot(&self) -> io::Result<Option<RecvSlot<'_>>> {
        poll_fn(|cx| self.poll_recv_slot(cx)).await
    }

    /// Post filled slots as the stream's next messages, in the order
    /// given, in one post list (one socket write on stag0, where a
    /// [`SendSlot::commit`] each costs one each): (slot, bytes to send).
    /// A length of 0 sends nothing for that slot. A length past a slot's
    /// capacity fails before anything is posted. Should the post fail
    /// part way, the slots posted stay posted and the rest go back; the
    /// error says so.
    ///
    /// ```no_run
    /// # async fn demo(stream: verbs::r#async::RdmaStream) -> std::io::Result<()> {
    /// // Wait for one slot, then take up to 3 more that are free now.
    /// let mut batch = vec![stream.send_slot().await?];
    /// while batch.len() < 4 {
    ///     match stream.try_send_slot()? {
    ///         Some(slot) => batch.push(slot),
    ///         None => break,
    ///     }
    /// }
    /// let filled = batch.into_iter().map(|mut slot| {
    ///     slot.fill(7);
    ///     let n = slot.capacity();
    ///     (slot, n)
    /// });
    /// stream.commit_all(filled)?;
    /// # Ok(()) }
    /// ```
    pub fn commit_all<'a>(
        &'a self,
        slots: impl IntoIterator<Item = (SendSlot<'a>, usize)>,
    ) -> io::Result<()> {
        let mut slots: Vec<(SendSlot<'a>, usize)> =
            slots.into_iter().filter(|(_, len)| *len > 0).collect();
        if slots.iter().any(|(slot, len)| *len > slot.capacity()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "commit: more bytes than a slot holds",
            ));
        }
        if slots
            .iter()
            .any(|(slot, _)| !std::ptr::eq(slot.stream, self))
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "commit: a slot of another stream",
            ));
        }
        if slots.is_empty() {
            return Ok(());
        }
        let sh = &*self.shared;
        let mut st = sh.lock();
        if st.broken.is_some() {
            return Err(StreamShared::broken_error(&st));
        }
        let posted = sh.post_slots(&mut st, &slots);
        for (slot, _) in &mut slots[..posted.as_ref().map_or_else(|e| e.0, |&n| n)] {
            slot.done = true;
        }
        // The slots not posted go back as they drop, which locks.
        drop(st);
        posted.map(drop).map_err(|(_, e)| io_err(e))
    }

    /// The most bytes one [`SendSlot`] (and one message) carries.
    pub fn slot_capacity(&self) -> usize {
        self.shared.opts.slot_size - HEADER
    }

    fn poll_send_slot(&self, cx: &mut TaskContext<'_>) -> Poll<io::Result<SendSlot<'_>>> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        loop {
            if let Some(slot) = Self::take_send_slot(&mut st)? {
                return Poll::Ready(Ok(SendSlot {
                    stream: self,
                    slot,
                    done: false,
                }));
            }
            if sh.poll_progress(&mut st, cx, Side::Slot)?.is_pending() {
                return Poll::Pending;
            }
        }
    }

    fn poll_recv_slot(&self, cx: &mut TaskContext<'_>) -> Poll<io::Result<Option<RecvSlot<'_>>>> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        loop {
            if let Some((recv, at, end)) = st.inbox.pop_front() {
                let seq = st.recv_held_first + st.recv_held.len() as u64;
                st.recv_held.push_back((recv, false));
                return Poll::Ready(Ok(Some(RecvSlot {
                    stream: self,
                    at,
                    len: end - at,
                    seq,
                })));
            }
            if st.peer_closed {
                return Poll::Ready(Ok(None));
            }
            if st.broken.is_some() {
                return Poll::Ready(Err(StreamShared::broken_error(&st)));
            }
            if sh.poll_progress(&mut st, cx, Side::Slot)?.is_pending() {
                return Poll::Pending;
            }
        }
    }
}

impl SendSlot<'_> {
    /// The most bytes this slot carries.
    pub fn capacity(&self) -> usize {
        self.stream.slot_capacity()
    }

    /// Post the slot's first `len` bytes as the stream's next message. The
    /// slot comes back to the stream when the message completed. `len` 0
    /// sends nothing (as a drop); more than [`capacity`](Self::capacity)
    /// fails with `InvalidInput` and gives the slot back.
    pub fn commit(self, len: usize) -> io::Result<()> {
        // A list of one: the same checks, header and post.
        let stream = self.stream;
        stream.commit_all([(self, len)])
    }

    fn payload(&self) -> (usize, usize) {
        let opts = &self.stream.shared.opts;
        (
            opts.send_offset(self.slot) + HEADER,
            opts.slot_size - HEADER,
        )
    }
}

impl StreamShared {
    /// Post `slots` (filled, lengths checked) as consecutive data
    /// messages in one post list: how many were posted, or how many were
    /// and why the rest were not.
    fn post_slots(
        &self,
        st: &mut StreamState,
        slots: &[(SendSlot<'_>, usize)],
    ) -> std::result::Result<usize, (usize, crate::Error)> {
        let mut slices = Vec::with_capacity(slots.len());
        for (k, (slot, len)) in slots.iter().enumerate() {
            let at = self.opts.send_offset(slot.slot);
            // The first message returns every owed credit, the rest none.
            let header = if k == 0 {
                self.header(st, KIND_DATA, *len)
            } else {
                plain_header(KIND_DATA, *len)
            };
            let slice = self
                .mr
                .write_at(at, &header)
                .and_then(|()| self.mr.slice(at, HEADER + len));
            slices.push(slice.map_err(|e| (0, e))?);
        }
        let wrs: Vec<WorkRequest<'_>> = slices
            .iter()
            .zip(slots)
            .enumerate()
            .map(|(k, (slice, (slot, _)))| {
                let op = self.data_op((st.ring_next + k) % self.opts.slots);
                WorkRequest::new(TAG_SEND | slot.slot as u64, op, std::slice::from_ref(slice))
            })
            .collect();
        let (posted, failed) = match self.qp.post_send_list(&wrs) {
            Ok(()) => (wrs.len(), None),
            Err(e) => (e.posted, Some(e.source)),
        };
        if posted > 0 {
            st.ring_next = (st.ring_next + posted) % self.opts.slots;
            st.data_owed = 0;
            st.control_owed = 0;
        }
        match failed {
            None => Ok(posted),
            Some(e) => Err((posted, e)),
        }
    }
}

impl Deref for SendSlot<'_> {
    type Target = [u8];

    #[allow(unsafe_code)]
    fn deref(&self) -> &[u8] {
        let (at, len) = self.payload();
        // SAFETY: see `deref_mut`; a shared view of the same bytes.
        unsafe { std::slice::from_raw_parts(region_ptr(&self.stream.shared.mr, at, len), len) }
    }
}

impl DerefMut for SendSlot<'_> {
    #[allow(unsafe_code)]
    fn deref_mut(&mut self) -> &mut [u8] {
        let (at, len) = self.payload();
        // SAFETY: the bytes lie inside the region (`region_ptr` checks),
        // which the borrowed stream keeps mapped. The send slot was taken
        // off `free_send`, so its last message completed and the device
        // no longer reads it, and no one else writes it: the stream writes
        // a send slot only while it holds it, the device and the peer
        // never (the peer's Writes go to the ring, whose place and size it
        // agreed at connect). The view borrows `self` mutably, so it is
        // the only one until `commit` takes the guard.
        unsafe { std::slice::from_raw_parts_mut(region_ptr(&self.stream.shared.mr, at, len), len) }
    }
}

impl Drop for SendSlot<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Not committed: the slot and its credit go back, and a task
        // waiting for either may take them.
        let sh = &*self.stream.shared;
        let mut st = sh.lock();
        st.free_send.push(self.slot);
        st.data_credits += 1;
        if let Some(w) = st.write_waker.take() {
            w.wake();
        }
        for w in st.slot_wakers.drain(..) {
            w.wake();
        }
    }
}

impl std::fmt::Debug for SendSlot<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendSlot")
            .field("slot", &self.slot)
            .field("capacity", &self.capacity())
            .finish()
    }
}

impl Deref for RecvSlot<'_> {
    type Target = [u8];

    #[allow(unsafe_code)]
    fn deref(&self) -> &[u8] {
        // SAFETY: the bytes lie inside the region (`region_ptr` checks),
        // which the borrowed stream keeps mapped. They are a message that
        // completed (the poll of its completion, under the stream's lock,
        // orders its bytes before this view), in a ring slot the peer
        // writes again only with its credit, or a receive the device
        // fills only once reposted: both go back only when this guard
        // drops. A peer that broke the protocol and wrote a slot without
        // credit would change bytes under the view, as it would under any
        // RDMA receive buffer; stag's own stream never does.
        unsafe {
            std::slice::from_raw_parts(
                region_ptr(&self.stream.shared.mr, self.at, self.len),
                self.len,
            )
        }
    }
}

impl Drop for RecvSlot<'_> {
    fn drop(&mut self) {
        let sh = &*self.stream.shared;
        let mut st = sh.lock();
        let index = self.seq.wrapping_sub(st.recv_held_first) as usize;
        if let Some(held) = st.recv_held.get_mut(index) {
            held.1 = true;
        }
        // Free slots in the order they were handed out: a credit says the
        // oldest ring slot is free.
        while let Some(&(recv, true)) = st.recv_held.front() {
            st.recv_held.pop_front();
            st.recv_held_first += 1;
            sh.release_read(&mut st, recv);
        }
        if sh.return_credits(&mut st, false).is_err() {
            st.broken.get_or_insert(WcStatus::LocQpOpErr);
        }
    }
}

impl std::fmt::Debug for RecvSlot<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvSlot").field("len", &self.len).finish()
    }
}

/// The address of `len` bytes at `at` in `mr`, writable. The slots lie
/// inside the region by construction (`StreamOptions::region_len`); the
/// index is still checked, so a layout bug could never point outside it.
fn region_ptr(mr: &MemoryRegion, at: usize, len: usize) -> *mut u8 {
    // The region's bytes are atomics (`UnsafeCell`s): writing through a
    // pointer taken from a shared view of them is allowed, and `AtomicU8`
    // has `u8`'s layout.
    mr.as_atomic_bytes()[at..at + len]
        .as_ptr()
        .cast_mut()
        .cast::<u8>()
}
