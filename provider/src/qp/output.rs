//! Framed output waiting for the socket, without copying payloads: the
//! octets the core produces (MPA length, DDP/RDMAP headers, pad and CRC)
//! sit in one buffer, and payloads stay in registered memory until the
//! driver's `writev` reads them from there.

use std::collections::VecDeque;
use std::io::IoSlice;

use tracing::debug;

use crate::mem::{MrTable, PdId, ReadScope};
use crate::wire::Error;

/// At most this many iovecs go to one `writev` (well below `IOV_MAX`).
pub(super) const MAX_IOV: usize = 64;

/// Iovecs enough for the usual small write (see [`TxQueue::write_with`]).
const FEW_IOV: usize = 4;

/// Zeros standing in for payload bytes whose region went away (see
/// [`Piece::Zeros`]); a segment is never longer than this.
static ZEROS: [u8; 1 << 16] = [0; 1 << 16];

/// One run of output octets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Piece {
    /// `bytes[start..end]`.
    Bytes { start: usize, end: usize },
    /// A payload in a local SGE's region (Send, Write).
    Local { lkey: u32, addr: u64, len: u32 },
    /// A payload in a peer-readable region (Read Response).
    Remote { stag: u32, to: u64, len: u32 },
    /// A payload in the QP's inline slots (an inline Send or Write): the
    /// framer copies it (`Connection::frame_pieces`), so it never reaches
    /// the queue.
    Inline { start: u32, len: u32 },
    /// Payload bytes that could not be read at write time: zeros keep the
    /// framing intact, and the CRC, computed over what was there at
    /// framing time, makes the peer terminate. A deregistration never
    /// leads here ([`TxQueue::detach`] copies the octets first); only a
    /// peer's Send with Invalidate of a region our own output still reads
    /// does.
    Zeros { len: u32 },
}

impl Piece {
    pub(super) fn len(&self) -> usize {
        match *self {
            Piece::Bytes { start, end } => end - start,
            Piece::Local { len, .. }
            | Piece::Remote { len, .. }
            | Piece::Inline { len, .. }
            | Piece::Zeros { len } => len as usize,
        }
    }

    /// The octets of a payload piece inside `scope`; an error if its
    /// region is gone.
    pub(super) fn try_payload<'s>(
        &self,
        scope: &'s ReadScope<'_>,
        pd: PdId,
    ) -> Result<&'s [u8], Error> {
        match *self {
            Piece::Local { lkey, addr, len } => scope.local(lkey, pd, addr, len),
            Piece::Remote { stag, to, len } => scope.remote(stag, pd, to, len),
            Piece::Zeros { len } => Ok(&ZEROS[..(len as usize).min(ZEROS.len())]),
            Piece::Bytes { .. } | Piece::Inline { .. } => Ok(&[]),
        }
    }

    /// [`try_payload`](Self::try_payload), zeros if the region is gone.
    pub(super) fn payload<'s>(&self, scope: &'s ReadScope<'_>, pd: PdId) -> &'s [u8] {
        self.try_payload(scope, pd).unwrap_or_else(|e| {
            debug!(error = %e, "payload region gone before transmit");
            &ZEROS[..self.len().min(ZEROS.len())]
        })
    }

    /// The region a payload piece reads: `(stag, address)`.
    fn region(&self) -> Option<(u32, u64)> {
        match *self {
            Piece::Local { lkey, addr, .. } => Some((lkey, addr)),
            Piece::Remote { stag, to, .. } => Some((stag, to)),
            Piece::Bytes { .. } | Piece::Inline { .. } | Piece::Zeros { .. } => None,
        }
    }
}

/// The queue of framed output.
#[derive(Debug, Default)]
pub(super) struct TxQueue {
    /// Octets the core produced.
    pub(super) bytes: Vec<u8>,
    pieces: VecDeque<Piece>,
    /// Octets of the front piece already written.
    front_done: usize,
    /// Octets queued and not yet written.
    queued: usize,
    /// Octets ever queued, and ever written (or dropped by `clear`): a
    /// send WR completes once `written_total` passes its last octet, so
    /// its buffer is not reused while `writev` may still read it.
    queued_total: u64,
    written_total: u64,
    /// Queued pieces read from registered memory at write time.
    gathered: usize,
}

impl TxQueue {
    pub(super) fn with_capacity(n: usize) -> TxQueue {
        TxQueue {
            bytes: Vec::with_capacity(n),
            ..TxQueue::default()
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.queued == 0
    }

    /// Octets queued and not yet written.
    pub(super) fn len(&self) -> usize {
        self.queued
    }

    pub(super) fn clear(&mut self) {
        self.bytes.clear();
        self.pieces.clear();
        self.front_done = 0;
        self.queued = 0;
        self.written_total = self.queued_total;
        self.gathered = 0;
    }

    /// Octets ever queued (the mark a WR's completion waits for).
    pub(super) fn queued_total(&self) -> u64 {
        self.queued_total
    }

    /// Octets ever written.
    pub(super) fn written_total(&self) -> u64 {
        self.written_total
    }

    /// Whether a queued payload is still to be read from registered
    /// memory (then nothing may change that memory first: its CRC was
    /// computed over what is there now).
    pub(super) fn has_gathered(&self) -> bool {
        self.gathered > 0
    }

    /// The octets appended to `bytes` since `start` are output.
    pub(super) fn push_bytes(&mut self, start: usize) {
        let end = self.bytes.len();
        if end == start {
            return;
        }
        self.queued += end - start;
        self.queued_total += (end - start) as u64;
        // Contiguous with the previous run (a trailer and the next
        // header): one iovec.
        if let Some(Piece::Bytes { end: last, .. }) = self.pieces.back_mut() {
            if *last == start {
                *last = end;
                return;
            }
        }
        self.pieces.push_back(Piece::Bytes { start, end });
    }

    /// A payload piece.
    pub(super) fn push_payload(&mut self, piece: Piece) {
        let n = piece.len();
        if n == 0 {
            return;
        }
        self.queued += n;
        self.queued_total += n as u64;
        if matches!(piece, Piece::Local { .. } | Piece::Remote { .. }) {
            self.gathered += 1;
        }
        self.pieces.push_back(piece);
    }

    /// Hand up to [`MAX_IOV`] pieces to `write` as iovecs (payloads read in
    /// place under `mem`'s read scope); consume what it accepted.
    pub(super) fn write_with(
        &mut self,
        mem: &MrTable,
        pd: PdId,
        write: impl FnOnce(&[IoSlice<'_>]) -> std::io::Result<usize>,
    ) -> std::io::Result<usize> {
        // A few pieces (a message's header, payload and trailer; a
        // ping-pong's one FPDU) in a few iovecs: zeroing all of MAX_IOV's
        // kilobyte for them was 180 instructions of every small write.
        let n = if self.pieces.len() <= FEW_IOV {
            self.gather::<FEW_IOV>(mem, pd, write)
        } else {
            self.gather::<MAX_IOV>(mem, pd, write)
        }?;
        self.consume(n);
        Ok(n)
    }

    /// [`write_with`](Self::write_with)'s call of `write` with up to `N`
    /// iovecs.
    fn gather<const N: usize>(
        &self,
        mem: &MrTable,
        pd: PdId,
        write: impl FnOnce(&[IoSlice<'_>]) -> std::io::Result<usize>,
    ) -> std::io::Result<usize> {
        mem.read_scope(|scope| {
            let mut iov = [IoSlice::new(&[]); N];
            let mut count = 0;
            for (i, piece) in self.pieces.iter().take(N).enumerate() {
                let all = match *piece {
                    Piece::Bytes { start, end } => &self.bytes[start..end],
                    _ => piece.payload(scope, pd),
                };
                let skip = if i == 0 { self.front_done } else { 0 };
                iov[count] = IoSlice::new(all.get(skip..).unwrap_or_default());
                count += 1;
            }
            write(&iov[..count])
        })
    }

    /// The region `stag` is being deregistered: copy the octets queued
    /// pieces still read from it into `bytes`, so that what is framed goes
    /// out exactly as its CRC says and the region is never read again.
    /// Returns how many pieces were copied.
    pub(super) fn detach(&mut self, mem: &MrTable, stag: u32) -> usize {
        let mut copied = 0;
        for piece in self.pieces.iter_mut() {
            let Some((key, addr)) = piece.region() else {
                continue;
            };
            if key != stag {
                continue;
            }
            let start = self.bytes.len();
            let len = piece.len();
            *piece = if mem.snapshot(stag, addr, len as u64, &mut self.bytes) {
                Piece::Bytes {
                    start,
                    end: start + len,
                }
            } else {
                // Framed from a region that is no longer there: cannot
                // happen, since removal waits for this copy.
                Piece::Zeros { len: len as u32 }
            };
            self.gathered -= 1;
            copied += 1;
        }
        copied
    }

    /// Copy everything queued to `out` and consume it (for callers that
    /// want one buffer, such as tests).
    pub(super) fn drain_into(&mut self, mem: &MrTable, pd: PdId, out: &mut Vec<u8>) {
        mem.read_scope(|scope| {
            for (i, piece) in self.pieces.iter().enumerate() {
                let all = match *piece {
                    Piece::Bytes { start, end } => &self.bytes[start..end],
                    _ => piece.payload(scope, pd),
                };
                let skip = if i == 0 { self.front_done } else { 0 };
                out.extend_from_slice(all.get(skip..).unwrap_or_default());
            }
        });
        self.clear();
    }

    /// `n` octets from the front were written.
    fn consume(&mut self, mut n: usize) {
        self.written_total += n.min(self.queued) as u64;
        self.queued -= n.min(self.queued);
        while n > 0 {
            let Some(front) = self.pieces.front() else {
                break;
            };
            let left = front.len() - self.front_done;
            if n < left {
                self.front_done += n;
                return;
            }
            n -= left;
            self.front_done = 0;
            if let Some(Piece::Local { .. } | Piece::Remote { .. }) = self.pieces.pop_front() {
                self.gathered -= 1;
            }
        }
        if self.pieces.is_empty() {
            self.bytes.clear();
            self.queued = 0;
            self.gathered = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A queue of `runs` runs of bytes (1, 2, 3, ...) with a run of `zeros`
    /// zeros after each but the last: `2 * runs - 1` pieces. Returns the
    /// queue and the octets it holds.
    fn queue(runs: u8, zeros: u32) -> (TxQueue, Vec<u8>) {
        let mut q = TxQueue::with_capacity(64);
        let mut all = Vec::new();
        for run in 1..=runs {
            let start = q.bytes.len();
            q.bytes.extend_from_slice(&[run; 3]);
            q.push_bytes(start);
            all.extend_from_slice(&[run; 3]);
            if run < runs {
                q.push_payload(Piece::Zeros { len: zeros });
                all.extend(std::iter::repeat_n(0, zeros as usize));
            }
        }
        (q, all)
    }

    /// Write all of `q`, `at_most` octets per call; the octets as written.
    fn write_out(q: &mut TxQueue, at_most: usize) -> Vec<u8> {
        let mem = MrTable::new();
        let mut out = Vec::new();
        while !q.is_empty() {
            let n = q
                .write_with(&mem, 0, |iov| {
                    let mut took = 0;
                    for s in iov {
                        let n = s.len().min(at_most - took);
                        out.extend_from_slice(&s[..n]);
                        took += n;
                    }
                    Ok(took)
                })
                .unwrap();
            assert!(n > 0, "a write took nothing");
        }
        out
    }

    /// The few-iovec path (up to `FEW_IOV` pieces) and the long one
    /// (more, up to `MAX_IOV` a call) write the same octets in order,
    /// whole or a few at a time (a short write resumes mid-piece).
    #[test]
    fn writes_leave_every_octet_in_order_on_both_sides_of_few_iov() {
        for runs in [1u8, 2, 3, 4, 40] {
            for at_most in [1, 2, 5, 1000] {
                let (mut q, all) = queue(runs, 2);
                assert_eq!(q.pieces.len(), 2 * runs as usize - 1);
                assert_eq!(q.len(), all.len());
                assert_eq!(
                    write_out(&mut q, at_most),
                    all,
                    "{runs} runs, {at_most} a write"
                );
                assert_eq!(q.written_total(), all.len() as u64);
                assert!(q.pieces.is_empty() && q.bytes.is_empty());
            }
        }
    }

    /// Each call hands `write` at most as many iovecs as the queue has
    /// pieces, and never more than `MAX_IOV`.
    #[test]
    fn a_write_gets_one_iovec_per_piece_up_to_max_iov() {
        let mem = MrTable::new();
        for runs in [2u8, 3, 50] {
            let (mut q, _) = queue(runs, 1);
            let pieces = q.pieces.len();
            let mut seen = 0;
            q.write_with(&mem, 0, |iov| {
                seen = iov.len();
                Ok(0)
            })
            .unwrap();
            assert_eq!(seen, pieces.min(MAX_IOV), "{runs} runs");
        }
    }
}
