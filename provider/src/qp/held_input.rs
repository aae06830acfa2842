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
use std::sync::{Mutex, PoisonError};

/// Octets per chunk: a few reads' worth, so that the FPDU a chunk's end
/// cuts in two (copied once more, into the deframer) is a small share.
pub(super) const CHUNK_LEN: usize = 1 << 20;

/// The most octets of chunks the process keeps that no hold is using: as
/// many as one hold may fill (`receive::HELD_INPUT_MAX`, 16 MiB) and the
/// chunk being read into. A receiver that a sender outruns is held again
/// and again (qperf `rc_bw`'s server, each time it has re-posted its
/// Receives), and fresh chunks each time cost a page fault per page and
/// the unmap (`perf`: 15 % of the receiver's samples with none kept, 5 %
/// with 8). Kept per QP instead, they would stay with every QP that ever
/// held, 17 MiB each, where an idle QP may cost 64 KiB.
pub(super) const SPARE_MAX: usize = (16 << 20) + CHUNK_LEN;

/// Chunks no hold is using, for the next hold of any QP of the process.
static SPARE_CHUNKS: ChunkPool = ChunkPool::new(SPARE_MAX / CHUNK_LEN);

/// A bounded stack of spare chunks. Its lock is taken once per chunk
/// (a MiB of input), never per read.
#[derive(Debug)]
pub(super) struct ChunkPool {
    spare: Mutex<Vec<Box<[u8]>>>,
    max: usize,
}

impl ChunkPool {
    pub(super) const fn new(max: usize) -> Self {
        ChunkPool {
            spare: Mutex::new(Vec::new()),
            max,
        }
    }

    /// A spare chunk, or a new one (zeroed pages the kernel maps in as
    /// they are first written).
    fn take(&self) -> Box<[u8]> {
        // A poisoned lock only means another thread panicked while it
        // held it: the stack itself is always whole.
        let spare = self
            .spare
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        spare.unwrap_or_else(|| vec![0; CHUNK_LEN].into_boxed_slice())
    }

    /// Keep `chunks` for later, up to the bound; the rest are freed.
    fn give(&self, chunks: impl IntoIterator<Item = Box<[u8]>>) {
        let mut spare = self.spare.lock().unwrap_or_else(PoisonError::into_inner);
        for chunk in chunks {
            if spare.len() == self.max {
                break;
            }
            spare.push(chunk);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.spare
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// One chunk: `bytes[..filled]` came from the stream.
#[derive(Debug)]
struct Chunk {
    bytes: Box<[u8]>,
    filled: usize,
}

/// The held octets, in stream order: the front chunk's `bytes[start..filled]`,
/// then the other chunks' filled parts. Its chunks come from, and go back
/// to, a [`ChunkPool`] (the process's, [`SPARE_CHUNKS`]).
#[derive(Debug)]
pub(super) struct HeldInput {
    chunks: VecDeque<Chunk>,
    /// Octets of the front chunk already taken.
    start: usize,
    /// Octets held.
    len: usize,
    pool: &'static ChunkPool,
}

impl Default for HeldInput {
    fn default() -> Self {
        HeldInput::from_pool(&SPARE_CHUNKS)
    }
}

impl Drop for HeldInput {
    /// The hold is over (or moved on without these chunks): they go back to
    /// the pool.
    fn drop(&mut self) {
        self.pool.give(self.chunks.drain(..).map(|c| c.bytes));
    }
}

impl HeldInput {
    /// An empty one whose chunks come from `pool`.
    pub(super) fn from_pool(pool: &'static ChunkPool) -> Self {
        HeldInput {
            chunks: VecDeque::new(),
            start: 0,
            len: 0,
            pool,
        }
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
            let bytes = self.pool.take();
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
    /// taken whole goes back to the pool for the next reads.
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
                self.pool.give([done.bytes]);
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

    /// A pool of its own, so that other tests' holds do not move its count.
    fn own_pool(max: usize) -> &'static ChunkPool {
        Box::leak(Box::new(ChunkPool::new(max)))
    }

    #[test]
    fn partly_taken_front_keeps_its_rest_and_chunks_are_reused() {
        let pool = own_pool(4);
        let mut h = HeldInput::from_pool(pool);
        h.push(&vec![7u8; CHUNK_LEN + 10]);
        h.consume(CHUNK_LEN - 5);
        assert_eq!(h.front(), &[7u8; 5][..]);
        assert_eq!(h.len(), 15);
        h.consume(5);
        // The full first chunk went back to the pool; the second is the front.
        assert_eq!(pool.len(), 1);
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
        assert_eq!(pool.len(), 0);
        assert_eq!(h.len(), CHUNK_LEN + 3);
        // The hold ends: both chunks go back.
        drop(h);
        assert_eq!(pool.len(), 2);
    }

    #[test]
    fn the_pool_keeps_no_more_than_its_bound() {
        let pool = own_pool(2);
        let mut h = HeldInput::from_pool(pool);
        h.push(&vec![3u8; 3 * CHUNK_LEN + 1]);
        assert_eq!(h.chunks.len(), 4);
        drop(h);
        assert_eq!(pool.len(), 2, "two kept, two freed");
        let mut again = HeldInput::from_pool(pool);
        again.push(&[1]);
        assert_eq!(pool.len(), 1, "the next hold starts on a kept chunk");
    }
}
