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
        let n = mem.read_scope(|scope| {
            let mut iov = [IoSlice::new(&[]); MAX_IOV];
            let mut count = 0;
            for (i, piece) in self.pieces.iter().take(MAX_IOV).enumerate() {
                let all = match *piece {
                    Piece::Bytes { start, end } => &self.bytes[start..end],
                    _ => piece.payload(scope, pd),
                };
                let skip = if i == 0 { self.front_done } else { 0 };
                iov[count] = IoSlice::new(all.get(skip..).unwrap_or_default());
                count += 1;
            }
            write(&iov[..count])
        })?;
        self.consume(n);
        Ok(n)
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
