//! MPA Request/Reply frames (RFC 5044 §7.1) with RFC 6581 enhanced
//! connection setup: the IRD/ORD word and its RTR flags. What two ends
//! make of those words (RFC 6581 §9) is [`crate::setup::negotiate`].
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |  Key: "MPA ID Req Frame" or "MPA ID Rep Frame" (16 octets)    |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |M|C|R|S|  Res  |     Rev       |          PD_Length            |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |A|B|        IRD                |C|D|        ORD                | (S=1 only)
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ~  Private Data (PD_Length octets in all, IRD/ORD word included)  ~
//! ```
//!
//! What kernel siw sends (`siw_cm.c`, `iwarp.h`): as initiator with its
//! default module parameters (`mpa_version` 2, no CRC, no peer-to-peer), the
//! flags word `0x1002` (S set, revision 2; octets `10 02`, `50 02` with CRC),
//! `PD_Length` = 4 + ULP private data, then `htons(ird)`, `htons(ord)`. In
//! peer-to-peer mode it adds A (0x8000) to the IRD half and C|D
//! (0x8000|0x4000) to the ORD half, and raises ORD 0 to 1. As responder it
//! answers with the request's revision and C bit, sets R and clears M when it
//! rejects (it rejects any request with M set), and picks one RTR model:
//! Write if offered, else Read, else Write. It treats `Res` bit 0x0800 as its
//! private "GSO allowed" hint; RFC 5044 says receivers ignore `Res`, so do we.

use super::{be_u16, Error, Field, Layer, Rest, Result};

/// Key of an MPA Request frame.
pub const KEY_REQUEST: &[u8; 16] = b"MPA ID Req Frame";
/// Key of an MPA Reply frame.
pub const KEY_REPLY: &[u8; 16] = b"MPA ID Rep Frame";
/// Size of the fixed part: key, flags/revision, `PD_Length`.
pub const HEADER_LEN: usize = 20;
/// Most private data a frame may carry, IRD/ORD word included (RFC 5044
/// §7.1, RFC 6581 §7).
pub const MAX_PRIVATE_DATA_LEN: usize = 512;
/// Most private data kernel siw accepts, IRD/ORD word included
/// (`MPA_MAX_PRIVDATA` = `RDMA_MAX_PRIVATE_DATA`, checked in
/// `siw_recv_mpa_rr`): keep frames for siw within this, not just 512.
pub const SIW_MAX_PRIVATE_DATA_LEN: usize = 256;
/// Size of the largest possible Request/Reply frame.
pub const MAX_FRAME_LEN: usize = HEADER_LEN + MAX_PRIVATE_DATA_LEN;
/// Size of the RFC 6581 IRD/ORD word at the start of enhanced private data.
pub const IRD_ORD_LEN: usize = 4;
/// IRD/ORD value meaning "no automatic negotiation, the ULP handles it"; it
/// is also the largest 14-bit value.
pub const IRD_ORD_NO_NEGOTIATION: u16 = 0x3fff;

mod field {
    use super::{Field, Rest};
    pub const KEY: Field = 0..16;
    pub const FLAGS: usize = 16;
    pub const REVISION: usize = 17;
    pub const PD_LENGTH: Field = 18..20;
    pub const PRIVATE_DATA: Rest = 20..;
    pub const IRD: Field = 20..22;
    pub const ORD: Field = 22..24;
}

mod flag {
    pub const MARKERS: u8 = 0x80;
    pub const CRC: u8 = 0x40;
    pub const REJECT: u8 = 0x20;
    pub const ENHANCED: u8 = 0x10;
    pub const RESERVED: u8 = 0x0f;
}

mod ird_ord {
    /// IRD half: A, peer-to-peer connection model.
    pub const PEER_TO_PEER: u16 = 0x8000;
    /// IRD half: B, zero-length Send (FULPDU) RTR.
    pub const ZERO_SEND_RTR: u16 = 0x4000;
    /// ORD half: C, zero-length RDMA Write RTR.
    pub const WRITE_RTR: u16 = 0x8000;
    /// ORD half: D, zero-length RDMA Read RTR.
    pub const READ_RTR: u16 = 0x4000;
    pub const VALUE: u16 = 0x3fff;
}

/// Which of the two frames: the initiator's Request or the responder's Reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FrameKind {
    /// "MPA ID Req Frame", sent by the initiator.
    Request,
    /// "MPA ID Rep Frame", sent by the responder.
    Reply,
}

impl FrameKind {
    /// The 16-octet key that starts frames of this kind.
    pub const fn key(self) -> &'static [u8; 16] {
        match self {
            FrameKind::Request => KEY_REQUEST,
            FrameKind::Reply => KEY_REPLY,
        }
    }

    /// The kind a key names, if any.
    pub fn from_key(key: &[u8]) -> Option<FrameKind> {
        if key == KEY_REQUEST {
            Some(FrameKind::Request)
        } else if key == KEY_REPLY {
            Some(FrameKind::Reply)
        } else {
            None
        }
    }
}

/// The RFC 6581 enhanced connection setup word: IRD/ORD and RTR flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct IrdOrd {
    /// Inbound RDMA Read queue depth (14 bits; 0x3FFF = no negotiation).
    pub ird: u16,
    /// Outbound RDMA Read queue depth (14 bits; 0x3FFF = no negotiation).
    pub ord: u16,
    /// A: peer-to-peer model, an explicit RTR message follows the Reply.
    pub peer_to_peer: bool,
    /// B: a zero-length Send may serve as RTR.
    pub zero_send_rtr: bool,
    /// C: a zero-length RDMA Write may serve as RTR.
    pub write_rtr: bool,
    /// D: a zero-length RDMA Read may serve as RTR.
    pub read_rtr: bool,
}

impl IrdOrd {
    /// Decodes the two 16-bit halves. B, C and D are ignored unless A is set
    /// (RFC 6581 §9.2: "if Control Flag A is set to 0 ... B, C, and D MUST be
    /// ignored").
    pub const fn from_words(ird_word: u16, ord_word: u16) -> IrdOrd {
        let p2p = ird_word & ird_ord::PEER_TO_PEER != 0;
        IrdOrd {
            ird: ird_word & ird_ord::VALUE,
            ord: ord_word & ird_ord::VALUE,
            peer_to_peer: p2p,
            zero_send_rtr: p2p && ird_word & ird_ord::ZERO_SEND_RTR != 0,
            write_rtr: p2p && ord_word & ird_ord::WRITE_RTR != 0,
            read_rtr: p2p && ord_word & ird_ord::READ_RTR != 0,
        }
    }

    /// Encodes the two 16-bit halves. IRD and ORD above 0x3FFF are clamped to
    /// 0x3FFF; B, C and D are sent only with A (RFC 6581 §9.2).
    pub fn to_words(&self) -> (u16, u16) {
        let mut ird = self.ird.min(ird_ord::VALUE);
        let mut ord = self.ord.min(ird_ord::VALUE);
        if self.peer_to_peer {
            ird |= ird_ord::PEER_TO_PEER;
            if self.zero_send_rtr {
                ird |= ird_ord::ZERO_SEND_RTR;
            }
            if self.write_rtr {
                ord |= ird_ord::WRITE_RTR;
            }
            if self.read_rtr {
                ord |= ird_ord::READ_RTR;
            }
        }
        (ird, ord)
    }

    /// The RTR models this word offers (none unless peer-to-peer).
    pub const fn rtr_modes(&self) -> RtrModes {
        RtrModes {
            send: self.peer_to_peer && self.zero_send_rtr,
            write: self.peer_to_peer && self.write_rtr,
            read: self.peer_to_peer && self.read_rtr,
        }
    }

    /// Offers exactly the models in `modes` (the B, C and D flags).
    pub fn set_rtr_modes(&mut self, modes: RtrModes) {
        self.zero_send_rtr = modes.send;
        self.write_rtr = modes.write;
        self.read_rtr = modes.read;
    }
}

/// Total size of the frame whose first [`HEADER_LEN`] octets are `header`,
/// for a streaming reader that must know how much more to wait for.
///
/// Fails early, before the private data arrives, on a bad key
/// ([`Error::MpaKey`]) or a `PD_Length` over 512
/// ([`Error::MpaPrivateDataTooLong`]).
pub fn frame_len(header: &[u8]) -> Result<usize> {
    let header = header.get(..HEADER_LEN).ok_or(Error::Truncated {
        layer: Layer::Llp,
        need: HEADER_LEN,
        have: header.len(),
    })?;
    FrameKind::from_key(&header[field::KEY]).ok_or(Error::MpaKey)?;
    let pd_len = usize::from(be_u16(&header[field::PD_LENGTH]));
    if pd_len > MAX_PRIVATE_DATA_LEN {
        return Err(Error::MpaPrivateDataTooLong(pd_len));
    }
    Ok(HEADER_LEN + pd_len)
}

/// A read/write view of an MPA Request or Reply frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Frame<T> {
    /// Wraps a buffer without checking anything.
    pub const fn new_unchecked(buffer: T) -> Frame<T> {
        Frame { buffer }
    }

    /// Wraps a buffer after [`Frame::check_len`].
    pub fn new_checked(buffer: T) -> Result<Frame<T>> {
        let frame = Self::new_unchecked(buffer);
        frame.check_len()?;
        Ok(frame)
    }

    /// Checks that the buffer holds the header and the `PD_Length` octets of
    /// private data it claims; after this no getter panics.
    pub fn check_len(&self) -> Result<()> {
        let have = self.buffer.as_ref().len();
        if have < HEADER_LEN {
            return Err(truncated(HEADER_LEN, have));
        }
        let need = self.total_len();
        if have < need {
            return Err(truncated(need, have));
        }
        Ok(())
    }

    /// Unwraps the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The 16-octet key.
    pub fn key(&self) -> &[u8] {
        &self.buffer.as_ref()[field::KEY]
    }

    /// Request or Reply, by the key; `None` for any other key.
    pub fn kind(&self) -> Option<FrameKind> {
        FrameKind::from_key(self.key())
    }

    fn flags(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }

    /// M: the sender wants markers in the FPDUs it receives.
    pub fn markers(&self) -> bool {
        self.flags() & flag::MARKERS != 0
    }

    /// C: the sender wants CRC32c on FPDUs.
    pub fn crc(&self) -> bool {
        self.flags() & flag::CRC != 0
    }

    /// R: the responder rejects the connection.
    pub fn reject(&self) -> bool {
        self.flags() & flag::REJECT != 0
    }

    /// S (RFC 6581): private data starts with the IRD/ORD word.
    pub fn enhanced(&self) -> bool {
        self.flags() & flag::ENHANCED != 0
    }

    /// The four reserved flag bits (siw uses 0x08 as a private GSO hint).
    pub fn reserved(&self) -> u8 {
        self.flags() & flag::RESERVED
    }

    /// Rev: the MPA revision.
    pub fn revision(&self) -> u8 {
        self.buffer.as_ref()[field::REVISION]
    }

    /// `PD_Length`: octets of private data, IRD/ORD word included.
    pub fn private_data_len(&self) -> u16 {
        be_u16(&self.buffer.as_ref()[field::PD_LENGTH])
    }

    /// Header plus private data.
    pub fn total_len(&self) -> usize {
        HEADER_LEN + usize::from(self.private_data_len())
    }

    /// All `PD_Length` octets of private data, IRD/ORD word included.
    pub fn private_data(&self) -> &[u8] {
        &self.buffer.as_ref()[field::PRIVATE_DATA][..usize::from(self.private_data_len())]
    }

    /// The IRD/ORD word, when S is set and the private data holds it.
    pub fn ird_ord(&self) -> Option<IrdOrd> {
        if !self.enhanced() || usize::from(self.private_data_len()) < IRD_ORD_LEN {
            return None;
        }
        let buf = self.buffer.as_ref();
        Some(IrdOrd::from_words(
            be_u16(buf.get(field::IRD)?),
            be_u16(buf.get(field::ORD)?),
        ))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Frame<T> {
    /// Writes the key of `kind`.
    pub fn set_kind(&mut self, kind: FrameKind) {
        self.buffer.as_mut()[field::KEY].copy_from_slice(kind.key());
    }

    fn set_flag(&mut self, mask: u8, value: bool) {
        let b = &mut self.buffer.as_mut()[field::FLAGS];
        *b = if value { *b | mask } else { *b & !mask };
    }

    /// Sets M.
    pub fn set_markers(&mut self, value: bool) {
        self.set_flag(flag::MARKERS, value)
    }

    /// Sets C.
    pub fn set_crc(&mut self, value: bool) {
        self.set_flag(flag::CRC, value)
    }

    /// Sets R.
    pub fn set_reject(&mut self, value: bool) {
        self.set_flag(flag::REJECT, value)
    }

    /// Sets S.
    pub fn set_enhanced(&mut self, value: bool) {
        self.set_flag(flag::ENHANCED, value)
    }

    /// Sets the four reserved flag bits (zero when sending, per RFC 5044).
    pub fn set_reserved(&mut self, value: u8) {
        let b = &mut self.buffer.as_mut()[field::FLAGS];
        *b = (*b & !flag::RESERVED) | (value & flag::RESERVED);
    }

    /// Sets Rev.
    pub fn set_revision(&mut self, value: u8) {
        self.buffer.as_mut()[field::REVISION] = value;
    }

    /// Sets `PD_Length`.
    pub fn set_private_data_len(&mut self, value: u16) {
        self.buffer.as_mut()[field::PD_LENGTH].copy_from_slice(&value.to_be_bytes());
    }

    /// The `PD_Length` octets of private data, for writing in place.
    pub fn private_data_mut(&mut self) -> &mut [u8] {
        let len = usize::from(self.private_data_len());
        &mut self.buffer.as_mut()[field::PRIVATE_DATA][..len]
    }

    /// Writes the IRD/ORD word at the start of the private data.
    pub fn set_ird_ord(&mut self, value: &IrdOrd) {
        let (ird, ord) = value.to_words();
        let buf = self.buffer.as_mut();
        buf[field::IRD].copy_from_slice(&ird.to_be_bytes());
        buf[field::ORD].copy_from_slice(&ord.to_be_bytes());
    }
}

/// The meaning of an MPA Request or Reply frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameRepr<'a> {
    /// Request or Reply.
    pub kind: FrameKind,
    /// M: markers wanted on FPDUs towards the sender.
    pub markers: bool,
    /// C: CRC wanted.
    pub crc: bool,
    /// R: connection rejected. Only meaningful in a Reply: RFC 5044 says it
    /// is zero in a Request and not checked there, so it is never parsed or
    /// emitted for a Request.
    pub reject: bool,
    /// MPA revision, 1 or 2.
    pub revision: u8,
    /// The RFC 6581 IRD/ORD word; `Some` exactly when S is set (revision 2).
    pub enhanced: Option<IrdOrd>,
    /// ULP private data, without the IRD/ORD word.
    pub private_data: &'a [u8],
}

impl<'a> FrameRepr<'a> {
    /// Parses a frame that fills `frame`'s buffer exactly (trailing octets
    /// are refused: nothing may follow a Request/Reply until the handshake is
    /// done). Reserved flag bits are ignored, as RFC 5044 requires.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(frame: &Frame<&'a T>) -> Result<FrameRepr<'a>> {
        let buf: &'a [u8] = frame.buffer.as_ref();
        frame_len(buf)?;
        frame.check_len()?;
        if buf.len() != frame.total_len() {
            return Err(Error::MpaMalformed("trailing bytes after the MPA frame"));
        }
        let kind = frame.kind().ok_or(Error::MpaKey)?;
        let revision = frame.revision();
        if !(1..=2).contains(&revision) {
            return Err(Error::MpaRevision(revision));
        }
        let all_private = buf.get(HEADER_LEN..).unwrap_or_default();
        let (enhanced, private_data) = if frame.enhanced() {
            if revision < 2 {
                return Err(Error::MpaMalformed("enhanced (S) flag with revision 1"));
            }
            let ird_ord = frame
                .ird_ord()
                .ok_or(Error::MpaMalformed("enhanced frame without IRD/ORD word"))?;
            (
                Some(ird_ord),
                all_private.get(IRD_ORD_LEN..).unwrap_or_default(),
            )
        } else {
            (None, all_private)
        };
        Ok(FrameRepr {
            kind,
            markers: frame.markers(),
            crc: frame.crc(),
            reject: kind == FrameKind::Reply && frame.reject(),
            revision,
            enhanced,
            private_data,
        })
    }

    /// `PD_Length` of the emitted frame: private data plus the IRD/ORD word
    /// when enhanced.
    pub fn private_data_len(&self) -> usize {
        self.private_data.len()
            + if self.enhanced.is_some() {
                IRD_ORD_LEN
            } else {
                0
            }
    }

    /// Size of the emitted frame.
    pub fn buffer_len(&self) -> usize {
        HEADER_LEN + self.private_data_len()
    }

    /// Writes every field of the frame into `frame`, whose buffer must hold
    /// at least [`FrameRepr::buffer_len`] octets; reserved bits are zeroed.
    ///
    /// Refuses what a peer would refuse: private data over 512 octets in all,
    /// a revision other than 1 or 2, or an IRD/ORD word with revision 1.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, frame: &mut Frame<T>) -> Result<()> {
        let pd_len = self.private_data_len();
        if pd_len > MAX_PRIVATE_DATA_LEN {
            return Err(Error::MpaPrivateDataTooLong(pd_len));
        }
        if !(1..=2).contains(&self.revision) {
            return Err(Error::MpaRevision(self.revision));
        }
        if self.enhanced.is_some() && self.revision < 2 {
            return Err(Error::MpaMalformed("enhanced (S) flag with revision 1"));
        }
        let have = frame.buffer.as_ref().len();
        if have < self.buffer_len() {
            return Err(truncated(self.buffer_len(), have));
        }
        frame.set_kind(self.kind);
        frame.buffer.as_mut()[field::FLAGS] = 0;
        frame.set_markers(self.markers);
        frame.set_crc(self.crc);
        frame.set_reject(self.kind == FrameKind::Reply && self.reject);
        frame.set_enhanced(self.enhanced.is_some());
        frame.set_revision(self.revision);
        // Cannot truncate: checked against MAX_PRIVATE_DATA_LEN above.
        frame.set_private_data_len(pd_len as u16);
        let ulp_start = match &self.enhanced {
            Some(ird_ord) => {
                frame.set_ird_ord(ird_ord);
                IRD_ORD_LEN
            }
            None => 0,
        };
        frame.private_data_mut()[ulp_start..].copy_from_slice(self.private_data);
        Ok(())
    }
}

/// Accumulates stream octets until one whole Request or Reply frame of the
/// expected kind is there; a fixed 532-octet buffer, no allocation.
///
/// Feed it whatever the socket gives; it consumes only the frame's octets and
/// leaves the rest in the caller's input (a peer that sends more before the
/// handshake is over is misbehaving; whether to fail is the caller's call).
#[derive(Debug, Clone)]
pub struct FrameReader {
    expect: FrameKind,
    buf: [u8; MAX_FRAME_LEN],
    have: usize,
    /// Total frame size once the header is in; 0 before.
    need: usize,
    failed: Option<Error>,
}

impl FrameReader {
    /// A reader waiting for a frame of kind `expect`.
    pub const fn new(expect: FrameKind) -> FrameReader {
        FrameReader {
            expect,
            buf: [0; MAX_FRAME_LEN],
            have: 0,
            need: 0,
            failed: None,
        }
    }

    /// Consumes octets from the front of `input` and returns the frame once
    /// complete (again on every later call, consuming nothing more). `None`
    /// means more octets are needed. After an error the reader stays failed.
    pub fn read<'s>(&'s mut self, input: &mut &[u8]) -> Result<Option<FrameRepr<'s>>> {
        if let Some(err) = self.failed {
            return Err(err);
        }
        match self.fill(input) {
            Ok(true) => {}
            Ok(false) => return Ok(None),
            Err(err) => {
                self.failed = Some(err);
                return Err(err);
            }
        }
        let frame_bytes = &self.buf[..self.have];
        match FrameRepr::parse(&Frame::new_unchecked(frame_bytes)) {
            Ok(repr) => Ok(Some(repr)),
            Err(err) => {
                self.failed = Some(err);
                Err(err)
            }
        }
    }

    /// Copies octets in; true once the whole frame is buffered.
    fn fill(&mut self, input: &mut &[u8]) -> Result<bool> {
        if self.need == 0 {
            let take = (HEADER_LEN - self.have).min(input.len());
            self.copy_in(input, take);
            if self.have < HEADER_LEN {
                return Ok(false);
            }
            self.need = frame_len(&self.buf[..HEADER_LEN])?;
            if FrameKind::from_key(&self.buf[field::KEY]) != Some(self.expect) {
                return Err(Error::MpaKey);
            }
        }
        let take = (self.need - self.have).min(input.len());
        self.copy_in(input, take);
        Ok(self.have == self.need)
    }

    fn copy_in(&mut self, input: &mut &[u8], take: usize) {
        let (head, rest) = input.split_at(take);
        self.buf[self.have..self.have + take].copy_from_slice(head);
        self.have += take;
        *input = rest;
    }
}

// ---- RFC 6581 §9: the RTR models the word carries ----

/// A set of RTR (ready-to-receive) models, the B/C/D flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RtrModes {
    /// B: zero-length Send.
    pub send: bool,
    /// C: zero-length RDMA Write.
    pub write: bool,
    /// D: zero-length RDMA Read.
    pub read: bool,
}

impl RtrModes {
    /// What kernel siw can send and accept: zero-length Write or Read.
    pub const SIW: RtrModes = RtrModes {
        send: false,
        write: true,
        read: true,
    };

    /// Every model: what the userspace provider can send and accept.
    pub const ALL: RtrModes = RtrModes {
        send: true,
        write: true,
        read: true,
    };

    /// The models in both sets.
    pub const fn intersection(self, other: RtrModes) -> RtrModes {
        RtrModes {
            send: self.send && other.send,
            write: self.write && other.write,
            read: self.read && other.read,
        }
    }

    /// True when no model is in the set.
    pub const fn is_empty(self) -> bool {
        !(self.send || self.write || self.read)
    }

    /// The one model to use from the set, preferring Write, then Read, then
    /// Send (siw's order: a Send RTR needs a pre-posted Receive).
    pub const fn preferred(self) -> Option<Rtr> {
        if self.write {
            Some(Rtr::ZeroLengthWrite)
        } else if self.read {
            Some(Rtr::ZeroLengthRead)
        } else if self.send {
            Some(Rtr::ZeroLengthSend)
        } else {
            None
        }
    }

    /// The set holding just `rtr`.
    pub const fn only(rtr: Rtr) -> RtrModes {
        RtrModes {
            send: matches!(rtr, Rtr::ZeroLengthSend),
            write: matches!(rtr, Rtr::ZeroLengthWrite),
            read: matches!(rtr, Rtr::ZeroLengthRead),
        }
    }
}

/// The message the initiator sends as RTR in the peer-to-peer model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rtr {
    /// A zero-length Send (B).
    ZeroLengthSend,
    /// A zero-length RDMA Write (C); siw sends STag 1, TO 0.
    ZeroLengthWrite,
    /// A zero-length RDMA Read (D); needs responder IRD ≥ 1.
    ZeroLengthRead,
}

fn truncated(need: usize, have: usize) -> Error {
    Error::Truncated {
        layer: Layer::Llp,
        need,
        have,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::ErrorType;

    /// The enhanced Request siw sends with default module parameters (rev 2,
    /// S, no CRC, no markers, client-server) for `rdma_connect` with
    /// IRD 16, ORD 16 (`cep->ird`/`cep->ord` from the verbs call) and 4
    /// octets of ULP private data: flags word 0x1002 (`siw_connect`),
    /// `PD_Length` 4 + 4 (`siw_send_mpareqrep`), `htons(ird)`, `htons(ord)`.
    static PACKET_BYTES: [u8; 28] = [
        b'M', b'P', b'A', b' ', b'I', b'D', b' ', b'R', b'e', b'q', b' ', b'F', b'r', b'a', b'm',
        b'e', // key
        0x10, 0x02, // M=0 C=0 R=0 S=1, Res 0, Rev 2
        0x00, 0x08, // PD_Length
        0x00, 0x10, // A=0 B=0 IRD 16
        0x00, 0x10, // C=0 D=0 ORD 16
        0xde, 0xad, 0xbe, 0xef, // ULP private data
    ];

    fn packet_repr() -> FrameRepr<'static> {
        FrameRepr {
            kind: FrameKind::Request,
            markers: false,
            crc: false,
            reject: false,
            revision: 2,
            enhanced: Some(IrdOrd {
                ird: 16,
                ord: 16,
                ..IrdOrd::default()
            }),
            private_data: &[0xde, 0xad, 0xbe, 0xef],
        }
    }

    #[test]
    fn test_deconstruct() {
        let frame = Frame::new_checked(&PACKET_BYTES[..]).unwrap();
        assert_eq!(frame.key(), KEY_REQUEST);
        assert_eq!(frame.kind(), Some(FrameKind::Request));
        assert!(!frame.markers());
        assert!(!frame.crc());
        assert!(!frame.reject());
        assert!(frame.enhanced());
        assert_eq!(frame.reserved(), 0);
        assert_eq!(frame.revision(), 2);
        assert_eq!(frame.private_data_len(), 8);
        assert_eq!(frame.total_len(), 28);
        assert_eq!(frame.private_data(), &PACKET_BYTES[20..]);
        assert_eq!(
            frame.ird_ord(),
            Some(IrdOrd {
                ird: 16,
                ord: 16,
                ..IrdOrd::default()
            })
        );
    }

    #[test]
    fn test_construct() {
        let mut bytes = [0xa5u8; 28];
        let mut frame = Frame::new_unchecked(&mut bytes[..]);
        frame.set_kind(FrameKind::Request);
        frame.set_markers(false);
        frame.set_crc(false);
        frame.set_reject(false);
        frame.set_enhanced(true);
        frame.set_reserved(0);
        frame.set_revision(2);
        frame.set_private_data_len(8);
        frame.set_ird_ord(&IrdOrd {
            ird: 16,
            ord: 16,
            ..IrdOrd::default()
        });
        frame.private_data_mut()[4..].copy_from_slice(&[0xde, 0xad, 0xbe, 0xef]);
        assert_eq!(bytes, PACKET_BYTES);
    }

    #[test]
    fn test_parse() {
        let frame = Frame::new_checked(&PACKET_BYTES[..]).unwrap();
        assert_eq!(FrameRepr::parse(&frame), Ok(packet_repr()));
    }

    #[test]
    fn test_emit() {
        let repr = packet_repr();
        assert_eq!(repr.buffer_len(), 28);
        let mut bytes = [0xa5u8; 28];
        repr.emit(&mut Frame::new_unchecked(&mut bytes[..]))
            .unwrap();
        assert_eq!(bytes, PACKET_BYTES);
    }

    #[test]
    fn test_truncated() {
        for len in 0..PACKET_BYTES.len() {
            let err = Frame::new_checked(&PACKET_BYTES[..len]).unwrap_err();
            assert!(matches!(err, Error::Truncated { layer: Layer::Llp, have, .. } if have == len));
            let err = FrameRepr::parse(&Frame::new_unchecked(&PACKET_BYTES[..len])).unwrap_err();
            assert!(matches!(err, Error::Truncated { .. }), "{len}: {err:?}");
        }
    }

    #[test]
    fn test_trailing_bytes() {
        let mut bytes = PACKET_BYTES.to_vec();
        bytes.extend_from_slice(&[0, 0x1c]);
        let frame = Frame::new_checked(&bytes[..]).unwrap();
        assert!(matches!(
            FrameRepr::parse(&frame),
            Err(Error::MpaMalformed(_))
        ));
    }

    fn emit(repr: &FrameRepr) -> Vec<u8> {
        let mut bytes = vec![0xa5u8; repr.buffer_len()];
        repr.emit(&mut Frame::new_unchecked(&mut bytes[..]))
            .unwrap();
        bytes
    }

    fn parse(bytes: &[u8]) -> Result<FrameRepr<'_>> {
        FrameRepr::parse(&Frame::new_unchecked(bytes))
    }

    /// siw in peer-to-peer mode with CRC: A on the IRD half, C|D on the ORD
    /// half (`rtr_type` default), ORD 0 raised to 1 (`siw_connect`).
    #[test]
    fn test_siw_p2p_crc_request() {
        let repr = FrameRepr {
            crc: true,
            enhanced: Some(IrdOrd {
                ird: 8,
                ord: 1,
                peer_to_peer: true,
                zero_send_rtr: false,
                write_rtr: true,
                read_rtr: true,
            }),
            private_data: &[],
            ..packet_repr()
        };
        let bytes = emit(&repr);
        assert_eq!(&bytes[..16], b"MPA ID Req Frame");
        assert_eq!(
            &bytes[16..],
            &[0x50, 0x02, 0x00, 0x04, 0x80, 0x08, 0xc0, 0x01]
        );
        assert_eq!(parse(&bytes), Ok(repr));
    }

    /// siw rejecting a request with M set (`siw_proc_mpareq`, `reject_conn`):
    /// Reply key, R set, M cleared, S and revision echoed; siw sends the
    /// IRD/ORD word it has so far with the reject.
    #[test]
    fn test_reply_reject() {
        let bytes: [u8; 24] = [
            b'M', b'P', b'A', b' ', b'I', b'D', b' ', b'R', b'e', b'p', b' ', b'F', b'r', b'a',
            b'm', b'e', 0x30, 0x02, 0x00, 0x04, 0x00, 0x10, 0x00, 0x10,
        ];
        let repr = parse(&bytes).unwrap();
        assert_eq!(repr.kind, FrameKind::Reply);
        assert!(repr.reject);
        assert!(!repr.markers);
        assert_eq!(
            repr.enhanced,
            Some(IrdOrd {
                ird: 16,
                ord: 16,
                ..IrdOrd::default()
            })
        );
        assert_eq!(repr.private_data, &[] as &[u8]);
        assert_eq!(emit(&repr), bytes);
    }

    /// Revision 1 frames carry no IRD/ORD word; all private data is ULP's.
    #[test]
    fn test_rev1() {
        let mut bytes = KEY_REPLY.to_vec();
        bytes.extend_from_slice(&[0x40, 0x01, 0x00, 0x03, 1, 2, 3]);
        let repr = parse(&bytes).unwrap();
        assert_eq!(
            repr,
            FrameRepr {
                kind: FrameKind::Reply,
                markers: false,
                crc: true,
                reject: false,
                revision: 1,
                enhanced: None,
                private_data: &[1, 2, 3],
            }
        );
        assert_eq!(emit(&repr), bytes);
        // S with revision 1 is malformed.
        bytes[16] |= 0x10;
        assert!(matches!(parse(&bytes), Err(Error::MpaMalformed(_))));
    }

    #[test]
    fn test_bad_key_and_revision() {
        let mut bytes = PACKET_BYTES;
        bytes[15] = b'E';
        assert_eq!(parse(&bytes), Err(Error::MpaKey));
        assert_eq!(frame_len(&bytes), Err(Error::MpaKey));
        for rev in [0u8, 3, 0xff] {
            let mut bytes = PACKET_BYTES;
            bytes[17] = rev;
            assert_eq!(parse(&bytes), Err(Error::MpaRevision(rev)));
        }
    }

    /// Res bits are not checked on receipt (siw's GSO hint 0x0800 included);
    /// R in a Request is ignored.
    #[test]
    fn test_reserved_bits_ignored() {
        let mut bytes = PACKET_BYTES;
        bytes[16] |= 0x0f | 0x20;
        assert_eq!(parse(&bytes), Ok(packet_repr()));
        assert_eq!(emit(&packet_repr()), PACKET_BYTES);
    }

    #[test]
    fn test_enhanced_without_word() {
        let mut bytes = KEY_REQUEST.to_vec();
        bytes.extend_from_slice(&[0x10, 0x02, 0x00, 0x03, 0, 0, 0]);
        assert!(matches!(parse(&bytes), Err(Error::MpaMalformed(_))));
    }

    #[test]
    fn test_private_data_limits() {
        let pd = [0x5au8; 512];
        // 512 octets of ULP data, rev 1: exactly the maximum.
        let repr = FrameRepr {
            revision: 1,
            enhanced: None,
            private_data: &pd,
            ..packet_repr()
        };
        let bytes = emit(&repr);
        assert_eq!(bytes.len(), MAX_FRAME_LEN);
        assert_eq!(frame_len(&bytes), Ok(MAX_FRAME_LEN));
        assert_eq!(parse(&bytes), Ok(repr));
        // Enhanced: the word counts, so 508 octets of ULP data at most.
        let repr = FrameRepr {
            private_data: &pd[..508],
            ..packet_repr()
        };
        assert_eq!(parse(&emit(&repr)), Ok(repr));
        let over = FrameRepr {
            private_data: &pd[..509],
            ..packet_repr()
        };
        let mut big = vec![0u8; 600];
        assert_eq!(
            over.emit(&mut Frame::new_unchecked(&mut big[..])),
            Err(Error::MpaPrivateDataTooLong(513))
        );
        // A peer claiming 513 octets is refused from the header alone.
        let mut header = PACKET_BYTES[..20].to_vec();
        header[18..20].copy_from_slice(&513u16.to_be_bytes());
        assert_eq!(frame_len(&header), Err(Error::MpaPrivateDataTooLong(513)));
        header.resize(20 + 513, 0);
        assert_eq!(parse(&header), Err(Error::MpaPrivateDataTooLong(513)));
    }

    #[test]
    fn test_frame_len() {
        assert_eq!(frame_len(&PACKET_BYTES[..20]), Ok(28));
        assert_eq!(frame_len(&PACKET_BYTES), Ok(28));
        assert_eq!(
            frame_len(&PACKET_BYTES[..19]),
            Err(Error::Truncated {
                layer: Layer::Llp,
                need: 20,
                have: 19
            })
        );
    }

    #[test]
    fn test_emit_errors() {
        let mut small = [0u8; 27];
        assert_eq!(
            packet_repr().emit(&mut Frame::new_unchecked(&mut small[..])),
            Err(Error::Truncated {
                layer: Layer::Llp,
                need: 28,
                have: 27
            })
        );
        let mut buf = [0u8; 28];
        let rev1 = FrameRepr {
            revision: 1,
            ..packet_repr()
        };
        assert!(matches!(
            rev1.emit(&mut Frame::new_unchecked(&mut buf[..])),
            Err(Error::MpaMalformed(_))
        ));
        let rev3 = FrameRepr {
            revision: 3,
            ..packet_repr()
        };
        assert_eq!(
            rev3.emit(&mut Frame::new_unchecked(&mut buf[..])),
            Err(Error::MpaRevision(3))
        );
    }

    #[test]
    fn test_ird_ord_words() {
        // B/C/D without A are ignored on receipt and not sent.
        let w = IrdOrd::from_words(0x4005, 0xc006);
        assert_eq!(
            w,
            IrdOrd {
                ird: 5,
                ord: 6,
                ..IrdOrd::default()
            }
        );
        assert_eq!(w.to_words(), (0x0005, 0x0006));
        let all = IrdOrd::from_words(0xffff, 0xffff);
        assert_eq!(
            all,
            IrdOrd {
                ird: 0x3fff,
                ord: 0x3fff,
                peer_to_peer: true,
                zero_send_rtr: true,
                write_rtr: true,
                read_rtr: true,
            }
        );
        assert_eq!(all.to_words(), (0xffff, 0xffff));
        // Over-range values clamp to 0x3FFF rather than wrap.
        let big = IrdOrd {
            ird: 0x4001,
            ord: 0xffff,
            ..IrdOrd::default()
        };
        assert_eq!(big.to_words(), (0x3fff, 0x3fff));
    }

    #[test]
    fn test_frame_reader() {
        let mut stream = PACKET_BYTES.to_vec();
        stream.extend_from_slice(&[1, 2, 3]);
        // Whole at once: leftover stays in the input.
        let mut reader = FrameReader::new(FrameKind::Request);
        let mut input = &stream[..];
        assert_eq!(reader.read(&mut input), Ok(Some(packet_repr())));
        assert_eq!(input, &[1, 2, 3]);
        assert_eq!(reader.read(&mut input), Ok(Some(packet_repr())));
        assert_eq!(input, &[1, 2, 3]);
        // Byte by byte.
        let mut reader = FrameReader::new(FrameKind::Request);
        for (i, b) in stream.iter().enumerate() {
            let mut input = std::slice::from_ref(b);
            let got = reader.read(&mut input).unwrap();
            if i < PACKET_BYTES.len() - 1 {
                assert_eq!(got, None);
                assert!(input.is_empty());
            } else {
                assert_eq!(got, Some(packet_repr()));
                break;
            }
        }
        // Wrong kind fails at the header and stays failed.
        let mut reader = FrameReader::new(FrameKind::Reply);
        let mut input = &stream[..];
        assert_eq!(reader.read(&mut input), Err(Error::MpaKey));
        assert_eq!(reader.read(&mut &stream[..]), Err(Error::MpaKey));
        // Oversized private data fails before it arrives.
        let mut header = PACKET_BYTES[..20].to_vec();
        header[18..20].copy_from_slice(&0xffffu16.to_be_bytes());
        let mut reader = FrameReader::new(FrameKind::Request);
        assert_eq!(
            reader.read(&mut &header[..]),
            Err(Error::MpaPrivateDataTooLong(0xffff))
        );
    }

    #[test]
    fn test_mpa_error_codes() {
        for (err, code) in [
            (Error::MpaKey, 0x04),
            (Error::MpaLocalCatastrophic, 0x05),
            (Error::InsufficientIrd, 0x06),
            (Error::NoMatchingRtr, 0x07),
        ] {
            let cause = err.terminate_cause();
            assert_eq!(cause.layer(), Layer::Llp);
            assert_eq!(cause.etype, ErrorType::Mpa);
            assert_eq!(cause.ecode, code, "{err:?}");
        }
    }

    mod prop {
        use super::*;
        use proptest::prelude::*;

        fn ird_ord() -> impl Strategy<Value = IrdOrd> {
            (
                0u16..=0x3fff,
                0u16..=0x3fff,
                any::<bool>(),
                any::<[bool; 3]>(),
            )
                .prop_map(|(ird, ord, p2p, [b, c, d])| IrdOrd {
                    ird,
                    ord,
                    peer_to_peer: p2p,
                    zero_send_rtr: p2p && b,
                    write_rtr: p2p && c,
                    read_rtr: p2p && d,
                })
        }

        proptest! {
            #[test]
            fn emit_parse_identity(
                reply in any::<bool>(),
                markers in any::<bool>(),
                crc in any::<bool>(),
                reject in any::<bool>(),
                enhanced in proptest::option::of(ird_ord()),
                rev1 in any::<bool>(),
                pd in proptest::collection::vec(any::<u8>(), 0..=508),
            ) {
                let kind = if reply { FrameKind::Reply } else { FrameKind::Request };
                let revision = if enhanced.is_none() && rev1 { 1 } else { 2 };
                let repr = FrameRepr {
                    kind, markers, crc,
                    reject: reply && reject,
                    revision, enhanced, private_data: &pd,
                };
                let bytes = emit(&repr);
                prop_assert_eq!(frame_len(&bytes), Ok(bytes.len()));
                prop_assert_eq!(parse(&bytes), Ok(repr));
            }

            #[test]
            fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
                let _ = parse(&bytes);
                let _ = frame_len(&bytes);
                let mut reader = FrameReader::new(FrameKind::Request);
                let _ = reader.read(&mut &bytes[..]);
            }
        }
    }
}
