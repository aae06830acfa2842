//! Direct placement: the payload of a large tagged segment (RDMA Write,
//! RDMA Read Response) goes from the socket straight into registered
//! memory instead of through the read buffer and the deframer.
//!
//! The core only decides *where* the octets go: once the header of such a
//! segment is in, [`Connection::handle_bytes`] checks it exactly as
//! [`receive`](super::receive) would (STag, PD, rights, bounds, the Read
//! it answers) and keeps a [`PlaceTarget`]; the driver asks for it with
//! [`Connection::placement`], reads into it through
//! [`MrTable::recv_placed`](crate::mem::MrTable::recv_placed) (which checks
//! every piece again under the table's lock) and reports with
//! [`Connection::handle_placed`]. Octets of the payload that arrive through
//! `handle_bytes` anyway are copied to the same target.
//!
//! Placing before the CRC is checked is what RFC 5041 allows an RNIC
//! (placement is not delivery: a tagged buffer's contents are undefined
//! until the message completes). What it must not do is deliver: a segment
//! whose CRC then fails ends the stream with the MPA CRC Terminate and
//! completes nothing — the Read it answered is flushed — and no octet ever
//! lands outside the checked range.
//!
//! Anything the direct path does not handle (markers, untagged messages,
//! small segments, a header that does not check out, the RTR phases) takes
//! the ordinary path, which reports errors in its own order (CRC first).

use tracing::trace;

use super::{Connection, Phase};
use crate::mem::{PlaceKind, PlaceSeg, PlaceTarget};
use crate::wire::ddp::TAGGED_HEADER_LEN;
use crate::wire::fpdu::{pad_len, Crc32c, CRC_LEN, LENGTH_LEN};
use crate::wire::rdmap::RdmapRepr;
use crate::wire::stream::Deframer;
use crate::wire::Error;
use crate::wr::{sge_spans, SendOp, WcStatus};

use super::Env;

/// Payload octets still to come, past those already received, below which
/// a segment takes the ordinary path: a `readv` of its own per segment
/// costs more than copying that much out of a large shared read. Measured
/// on loopback (`stag bw write -s N`, direct always vs never, medians of
/// 3): 2–4 KiB segments lose 15–20 % direct, 16 KiB ~10 %, 24–48 KiB even
/// within noise, 64 KiB gain 5–10 %, and 1 MiB messages (64 KiB FPDUs)
/// gain most.
pub(super) const DIRECT_MIN: usize = 16 * 1024;

/// The length field and tagged header of an FPDU: what a driver reads
/// ahead to see whether the next segment can be placed directly.
pub const HEADER_PEEK: usize = LENGTH_LEN + TAGGED_HEADER_LEN;

/// What a directly placed segment is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Write,
    ReadResponse { last: bool },
}

/// A tagged segment whose payload is being placed directly.
#[derive(Debug)]
pub(super) struct Placing {
    kind: Kind,
    target: PlaceTarget,
    /// Payload octets accounted for so far (placed, or discarded after
    /// `failed`).
    done: u64,
    /// A piece failed its check at placement time (the region was
    /// deregistered meanwhile): the rest is discarded, and once the CRC
    /// has passed the stream terminates with this error.
    failed: Option<Error>,
}

/// What the driver is asked to read: the payload into `target`, then
/// `trailer` octets (pad and CRC) into its own buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaceRequest {
    /// The rest of the payload's destination.
    pub target: PlaceTarget,
    /// The FPDU's running CRC, to extend over the octets placed (`None`
    /// without CRC); handed back in [`Connection::handle_placed`].
    pub crc: Option<Crc32c>,
    /// Pad and CRC octets that follow the payload.
    pub trailer: usize,
}

impl Connection {
    /// Where the driver should read the next octets of the stream to, if
    /// a directly placed payload is in progress.
    pub fn placement(&self) -> Option<PlaceRequest> {
        let placing = self.placing.as_ref()?;
        if self.phase.is_error() || placing.failed.is_some() {
            return None;
        }
        let deframer = self.deframer.as_ref()?;
        let remaining = deframer.external_remaining() as u64;
        if remaining == 0 {
            return None;
        }
        // The CRC field is there with or without CRC (then unchecked).
        let ulpdu_len = placing.target.len() as usize + TAGGED_HEADER_LEN;
        Some(PlaceRequest {
            target: placing.target.window(placing.done, remaining),
            crc: deframer.external_crc(),
            trailer: pad_len(ulpdu_len) + CRC_LEN,
        })
    }

    /// How many octets the driver should read next, when it is not placing:
    /// while tagged segments are being placed directly, the rest of the
    /// FPDU under way and the next header, so that the next large segment
    /// is seen before its payload is in a read buffer; `None` (read all
    /// there is) otherwise.
    pub fn read_hint(&self) -> Option<usize> {
        // While a payload is being placed the driver asks `placement`
        // first; here it only waits for the trailer (pad, CRC).
        if !self.streaming || self.phase.is_error() {
            return None;
        }
        Some(self.deframer.as_ref()?.fpdu_remaining()? + HEADER_PEEK)
    }

    /// `n` payload octets of the [`placement`](Self::placement) were read
    /// into its target, `crc` its CRC extended over them.
    pub fn handle_placed(&mut self, n: usize, crc: Option<Crc32c>) {
        let (Some(placing), Some(deframer)) = (self.placing.as_mut(), self.deframer.as_mut())
        else {
            return;
        };
        let n = n.min(deframer.external_remaining());
        deframer.placed_external(n, crc);
        placing.done += n as u64;
    }

    /// The target of the [`placement`](Self::placement) failed its check
    /// at the moment of placement (deregistered meanwhile): the rest of the
    /// payload is discarded as it comes through
    /// [`handle_bytes`](Self::handle_bytes), and the segment is refused
    /// with `err` once its CRC has been checked.
    pub fn handle_place_failed(&mut self, err: Error) {
        if let Some(placing) = self.placing.as_mut() {
            placing.failed.get_or_insert(placing.kind.error(err));
        }
    }

    /// At an FPDU boundary: if `input` starts a tagged segment worth
    /// placing directly whose header checks out, take its header and start
    /// placing. `true` when it did.
    pub(super) fn try_begin_direct(
        &mut self,
        deframer: &mut Deframer,
        input: &mut &[u8],
        env: &Env,
    ) -> bool {
        if self.phase != Phase::Running || !deframer.is_idle() || deframer.config().markers {
            return false;
        }
        let Some(header) = input.get(LENGTH_LEN..LENGTH_LEN + TAGGED_HEADER_LEN) else {
            return false;
        };
        let ulpdu_len = usize::from(u16::from_be_bytes([input[0], input[1]]));
        let Some(payload_len) = ulpdu_len.checked_sub(TAGGED_HEADER_LEN) else {
            return false;
        };
        if payload_len < DIRECT_MIN || header[0] & 0x80 == 0 {
            return false;
        }
        // Large tagged segments are arriving: from now on the driver reads
        // header by header, so that the next one starts here with nothing
        // of its payload in a read buffer.
        self.streaming = true;
        // Octets of the payload beyond what `input` already holds.
        let have = input.len() - LENGTH_LEN - TAGGED_HEADER_LEN;
        if payload_len.saturating_sub(have) < DIRECT_MIN {
            return false;
        }
        let Ok((repr, _)) = RdmapRepr::parse(header) else {
            return false;
        };
        let Some((kind, target)) = self.direct_target(repr, payload_len as u64, env) else {
            return false;
        };
        if deframer.begin_external(input, TAGGED_HEADER_LEN).is_none() {
            return false;
        }
        trace!(
            qp = self.qp_num,
            ?kind,
            len = payload_len,
            "direct placement"
        );
        self.placing = Some(Placing {
            kind,
            target,
            done: 0,
            failed: None,
        });
        true
    }

    /// The checked destination of a tagged segment's payload, or `None` if
    /// it does not check out (the ordinary path then reports why, after
    /// the CRC) or is not for this path.
    fn direct_target(
        &mut self,
        repr: RdmapRepr,
        len: u64,
        env: &Env,
    ) -> Option<(Kind, PlaceTarget)> {
        let mut target = PlaceTarget::new(self.pd);
        match repr {
            RdmapRepr::Write { stag, to, .. } => {
                env.mem.check_tagged(stag, self.pd, to, len).ok()?;
                target.push(PlaceSeg {
                    key: stag,
                    addr: to,
                    len: u32::try_from(len).ok()?,
                    kind: PlaceKind::RemoteWrite,
                });
                Some((Kind::Write, target))
            }
            RdmapRepr::ReadResponse { last, stag, to } => {
                let pd = self.pd;
                let head = self.response_head()?;
                let SendOp::Read { .. } = head.op else {
                    return None;
                };
                let first = head.sg_list.first()?;
                if stag != first.lkey {
                    return None;
                }
                let off = to.checked_sub(first.addr)?;
                if off.checked_add(len)? > u64::from(head.byte_len) {
                    return None;
                }
                // The spans `scatter` would copy to, recorded instead.
                let mut left = len;
                for (sge, off, n) in sge_spans(&head.sg_list, off, len) {
                    let addr = sge.addr.checked_add(off)?;
                    env.mem.check_local(sge.lkey, pd, addr, n, true).ok()?;
                    let seg = PlaceSeg {
                        key: sge.lkey,
                        addr,
                        len: n as u32,
                        kind: PlaceKind::LocalWrite,
                    };
                    if !target.push(seg) {
                        return None;
                    }
                    left -= n;
                }
                (left == 0).then_some((Kind::ReadResponse { last }, target))
            }
            _ => None,
        }
    }

    /// Payload octets of the segment being placed that came through
    /// `handle_bytes`: copied to the target (or discarded after a failure).
    pub(super) fn place_from_input(
        &mut self,
        deframer: &mut Deframer,
        input: &mut &[u8],
        env: &Env,
    ) {
        let Some(placing) = self.placing.as_mut() else {
            return;
        };
        let n = deframer.external_remaining().min(input.len());
        let (bytes, rest) = input.split_at(n);
        if placing.failed.is_none() {
            let target = placing.target.window(placing.done, n as u64);
            if let Err(e) = env.mem.place_copy(&target, bytes) {
                placing.failed = Some(placing.kind.error(e));
            }
        }
        placing.done += n as u64;
        deframer.take_external(bytes);
        *input = rest;
    }

    /// The directly placed segment is complete and its CRC passed
    /// (`header` is its DDP header): refuse it if a piece failed, else
    /// finish it as `receive` would.
    pub(super) fn finish_direct(&mut self, placing: Placing, header: &[u8]) {
        if let Some(e) = placing.failed {
            self.terminate(e, header);
            return;
        }
        if let Kind::ReadResponse { last: true } = placing.kind {
            if let Some(head) = self.response_head() {
                head.status = Some(WcStatus::Success);
            }
            self.ord_used = self.ord_used.saturating_sub(1);
        }
    }
}

impl Kind {
    /// How a placement failure of this kind is reported: a Write's with
    /// the DDP tagged error the table gives, a Read Response's as a base
    /// or bounds violation (as the copying path does).
    fn error(self, e: Error) -> Error {
        match self {
            Kind::Write => e,
            Kind::ReadResponse { .. } => Error::DdpBaseBounds,
        }
    }
}
