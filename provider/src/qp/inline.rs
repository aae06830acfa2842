//! Inline data (`IBV_SEND_INLINE`): a Send's or Write's payload handed over
//! as bytes and copied into the QP at post time, so that the caller may
//! reuse its buffer as soon as the post returns. Kernel siw does the same
//! (`siw_copy_inline_sgl` copies the payload into the send queue element);
//! here each send queue entry has a slot of [`MAX_INLINE`] octets.
//!
//! The slots form a ring of `max_send_wr` entries, taken in posting order by
//! inline WRs only. A slot is rewritten only `max_send_wr` inline posts
//! later, and by then the WR that filled it has left the send queue: were
//! it still queued, so would be every WR posted after it (the queue drains
//! from the front), which is `max_send_wr` WRs with the new one, and the
//! post would be refused as a full queue. Once a WR leaves the send queue
//! its payload is framed, so its slot is never read again.

use crate::identity::LIMITS;

/// The most inline octets one WR may carry (`max_inline_data`).
pub const MAX_INLINE: usize = LIMITS.max_inline as usize;

/// The inline slots of one QP: allocated at the first inline post (one
/// allocation per QP, none per post), `max_send_wr` × [`MAX_INLINE`].
#[derive(Debug, Default)]
pub(super) struct InlineSlots {
    buf: Vec<u8>,
    /// Inline WRs posted so far: the next slot is `next % slots`.
    next: usize,
}

impl InlineSlots {
    /// Copy `data` into the next slot of a ring of `slots`; returns where
    /// the bytes are (an offset into the slots, for [`get`](Self::get)) and
    /// how many there are. The caller checked the total against
    /// [`MAX_INLINE`] and that the send queue has room.
    pub(super) fn copy_in(&mut self, slots: usize, data: &[&[u8]]) -> (u32, u32) {
        if self.buf.len() != slots * MAX_INLINE {
            self.buf = vec![0; slots * MAX_INLINE];
        }
        let start = (self.next % slots) * MAX_INLINE;
        self.next = self.next.wrapping_add(1);
        let mut at = start;
        for d in data {
            self.buf[at..at + d.len()].copy_from_slice(d);
            at += d.len();
        }
        (start as u32, (at - start) as u32)
    }

    /// The `len` octets at `start` that [`copy_in`](Self::copy_in) placed.
    pub(super) fn get(&self, start: u32, len: u32) -> &[u8] {
        &self.buf[start as usize..start as usize + len as usize]
    }
}
