//! The stream octets a QP reads on while a message waits for a Receive
//! (`receive::Held`): a queue of fixed-size chunks the driver reads into
//! directly ([`Connection::held_room`](super::Connection::held_room)).
//!
//! One contiguous buffer cost the receiver of a sender that runs ahead
//! (qperf `rc_bw`, whose server is held nearly all the time) two extra
//! passes over every octet: the copy from the driver's read buffer into the
//! held buffer, and the compaction that moved what was left of it to the
//! front (`perf`: 15 % and 7 % of the receiving process's samples). Here
//! the socket is read straight into the last chunk, and a chunk that has
//! been deframed is recycled whole: nothing is copied but the FPDU that
//! straddles two chunks (into the deframer's buffer, as one that straddles
//! two reads always was).

use std::collections::VecDeque;

/// Octets per chunk: a few reads' worth, so that the FPDU a chunk's end
/// cuts in two (copied once more, into the deframer) is a small share.
pub(super) const CHUNK_LEN: usize = 1 << 20;

/// One chunk: `bytes[..filled]` came from the stream.
#[derive(Debug)]
struct Chunk {
    bytes: Box<[u8]>,
    filled: usize,
}

/// The held octets, in stream order: the front chunk's `bytes[start..filled]`,
/// then the other chunks' filled parts.
#[derive(Debug, Default)]
pub(super) struct HeldInput {
    chunks: VecDeque<Chunk>,
    /// Octets of the front chunk already taken.
    start: usize,
    /// Octets held.
    len: usize,
    /// Chunks taken whole, for the next reads (no allocation, no zeroing
    /// per chunk while the hold goes on); freed with the hold.
    spare: Vec<Box<[u8]>>,
}

impl HeldInput {
    /// An empty one that reads into `spare` chunks first (those a hold
    /// before it left, [`into_spare`](Self::into_spare)).
    pub(super) fn with_spare(spare: Vec<Box<[u8]>>) -> Self {
        HeldInput {
            spare,
            ..HeldInput::default()
        }
    }

    /// The hold is over: its chunks, at most `keep` of them, for the next
    /// one. A receiver that a sender outruns is held again and again
    /// (qperf `rc_bw`'s server, every time it has re-posted its Receives):
    /// fresh chunks each time cost a page fault per page and the unmap
    /// (`perf`: 15 % of the receiver's samples with none kept).
    pub(super) fn into_spare(self, keep: usize) -> Vec<Box<[u8]>> {
        let mut spare = self.spare;
        spare.extend(self.chunks.into_iter().map(|c| c.bytes));
        spare.truncate(keep);
        spare
    }

    /// Octets held.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Room for up to `want` octets at the end (at least one when `want`
    /// is): a read goes there, then [`filled`](Self::filled) says how much
    /// of it came.
    pub(super) fn room(&mut self, want: usize) -> &mut [u8] {
        let need_chunk = self.chunks.back().is_none_or(|c| c.filled == c.bytes.len());
        if need_chunk {
            let bytes = self
                .spare
                .pop()
                .unwrap_or_else(|| vec![0; CHUNK_LEN].into_boxed_slice());
            self.chunks.push_back(Chunk { bytes, filled: 0 });
        }
        let Some(last) = self.chunks.back_mut() else {
            unreachable!("a chunk was just pushed");
        };
        let end = last.bytes.len().min(last.filled + want);
        &mut last.bytes[last.filled..end]
    }

    /// `n` octets of the last [`room`](Self::room) were filled.
    pub(super) fn filled(&mut self, n: usize) {
        if let Some(last) = self.chunks.back_mut() {
            let n = n.min(last.bytes.len() - last.filled);
            last.filled += n;
            self.len += n;
        }
    }

    /// Append a copy of `bytes`.
    pub(super) fn push(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let room = self.room(bytes.len());
            let n = room.len();
            room.copy_from_slice(&bytes[..n]);
            self.filled(n);
            bytes = &bytes[n..];
        }
    }

    /// The held octets of the front chunk (empty when nothing is held).
    pub(super) fn front(&self) -> &[u8] {
        self.chunks
            .front()
            .map_or(&[][..], |c| &c.bytes[self.start..c.filled])
    }

    /// The first `n` octets of [`front`](Self::front) were taken; a chunk
    /// taken whole is kept for reuse.
    pub(super) fn consume(&mut self, n: usize) {
        let Some(front) = self.chunks.front() else {
            return;
        };
        let n = n.min(front.filled - self.start);
        self.start += n;
        self.len -= n;
        // The last chunk stays while it has room: reads go on into it.
        if self.start == front.filled
            && (front.filled == front.bytes.len() || self.chunks.len() > 1)
        {
            if let Some(done) = self.chunks.pop_front() {
                self.spare.push(done.bytes);
            }
            self.start = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(h: &mut HeldInput) -> Vec<u8> {
        let mut out = Vec::new();
        loop {
            let f = h.front().to_vec();
            if f.is_empty() {
                return out;
            }
            h.consume(f.len());
            out.extend_from_slice(&f);
        }
    }

    #[test]
    fn octets_come_out_in_order_across_chunks() {
        let mut h = HeldInput::default();
        let data: Vec<u8> = (0..(CHUNK_LEN * 2 + 123))
            .map(|i| (i % 251) as u8)
            .collect();
        h.push(&data[..1000]);
        // A read straight into the room, as the driver does.
        let room = h.room(CHUNK_LEN);
        let n = room.len();
        assert_eq!(n, CHUNK_LEN - 1000, "the room ends at the chunk's end");
        room.copy_from_slice(&data[1000..1000 + n]);
        h.filled(n);
        h.push(&data[1000 + n..]);
        assert_eq!(h.len(), data.len());
        assert_eq!(drain(&mut h), data);
        assert_eq!(h.len(), 0);
    }

    #[test]
    fn partly_taken_front_keeps_its_rest_and_chunks_are_reused() {
        let mut h = HeldInput::default();
        h.push(&vec![7u8; CHUNK_LEN + 10]);
        h.consume(CHUNK_LEN - 5);
        assert_eq!(h.front(), &[7u8; 5][..]);
        assert_eq!(h.len(), 15);
        h.consume(5);
        // The full first chunk went to the spares; the second is the front.
        assert_eq!(h.spare.len(), 1);
        assert_eq!(h.front().len(), 10);
        h.consume(10);
        // The last chunk has room left: reads go on into it.
        assert_eq!(h.chunks.len(), 1);
        assert!(h.front().is_empty());
        assert_eq!(h.room(4).len(), 4);
        h.filled(3);
        assert_eq!(h.len(), 3);
        // Filling it up and past takes the spare rather than a new chunk.
        h.push(&vec![1u8; CHUNK_LEN]);
        assert!(h.spare.is_empty());
        assert_eq!(h.len(), CHUNK_LEN + 3);
    }
}
