//! DDP segments (RFC 5041 §4), segmentation and untagged reassembly checks.
//!
//! A DDP segment is the ULPDU that MPA carries: it starts with the DDP
//! control byte, then one byte DDP reserves for its ULP (RDMAP puts its
//! control byte there), then the tagged or untagged buffer-model header and
//! the payload. Offsets here are relative to the start of the ULPDU, so the
//! header sizes are the ones kernel siw counts minus its 2-byte MPA length:
//! tagged 14 (siw `struct iwarp_ctrl_tagged`, 16), untagged 18
//! (`struct iwarp_ctrl_untagged`, 20).
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |T|L| Resrv | DV| RV|Rsv| Opcode|   tagged: STag ...            |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+  untagged: RsvdULP (Inv STag) |
//! ```

use super::{be_u32, be_u64, Error, Field, Layer, Rest, Result};

/// Bytes of a tagged DDP header (control, RsvdULP byte, STag, TO).
pub const TAGGED_HEADER_LEN: usize = 14;
/// Bytes of an untagged DDP header (control, RsvdULP 5 bytes, QN, MSN, MO).
pub const UNTAGGED_HEADER_LEN: usize = 18;
/// The only DDP version (DV) defined, RFC 5041 §4.
pub const DDP_VERSION: u8 = 1;
/// The only RDMAP version (RV) defined, RFC 5040 §4.
pub const RDMAP_VERSION: u8 = 1;

/// RDMAP's untagged queue numbers (RFC 5040 §5.1, RFC 7306 §10.2,
/// draft-talpey-rdma-commit §4).
pub mod qn {
    /// QN 0: Send variants and Immediate Data (RFC 7306 §6.3).
    pub const SEND: u32 = 0;
    /// QN 1: RDMA Read Requests, Atomic Requests (RFC 7306 §5.2) and Commit
    /// Requests (draft-talpey-rdma-commit §4.1) — the queue IRD/ORD governs.
    pub const READ_REQUEST: u32 = 1;
    /// QN 2: Terminate.
    pub const TERMINATE: u32 = 2;
    /// QN 3: Atomic Responses (RFC 7306 §5.2.2) and Commit Responses.
    pub const ATOMIC_RESPONSE: u32 = 3;
}

/// The first MSN on every untagged queue (RFC 5041 §5.3; siw initialises
/// `ddp_msn[]` to 1 as well).
pub const INITIAL_MSN: u32 = 1;

mod field {
    use super::{Field, Rest};
    pub const DDP_CTRL: usize = 0;
    pub const RDMAP_CTRL: usize = 1;
    pub const CONTROL: Field = 0..2;
    // Tagged buffer model.
    pub const STAG: Field = 2..6;
    pub const TO: Field = 6..14;
    pub const TAGGED_PAYLOAD: Rest = 14..;
    // Untagged buffer model.
    pub const RSVD_ULP: Field = 2..6;
    pub const QN: Field = 6..10;
    pub const MSN: Field = 10..14;
    pub const MO: Field = 14..18;
    pub const UNTAGGED_PAYLOAD: Rest = 18..;
}

/// The 16-bit DDP + RDMAP control word at the start of every ULPDU.
///
/// siw keeps both bytes as one big-endian `ddp_rdmap_ctrl` with T `0x8000`,
/// L `0x4000`, DV `0x0300`, RV `0x00C0` and the opcode in `0x000F`; an
/// untagged last Send is `0x4143`, a tagged last Write `0xC140`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Control(pub u16);

impl Control {
    /// T: the segment uses the tagged buffer model.
    pub const TAGGED: u16 = 0x8000;
    /// L: the last segment of its DDP message.
    pub const LAST: u16 = 0x4000;
    const DV_MASK: u16 = 0x0300;
    const RV_MASK: u16 = 0x00c0;
    const OPCODE_MASK: u16 = 0x000f;

    /// A control word with the given flags, DV = RV = 1, reserved bits zero.
    pub fn new(tagged: bool, last: bool, opcode: u8) -> Control {
        let mut word = u16::from(DDP_VERSION) << 8 | u16::from(RDMAP_VERSION) << 6;
        if tagged {
            word |= Self::TAGGED;
        }
        if last {
            word |= Self::LAST;
        }
        Control(word | (u16::from(opcode) & Self::OPCODE_MASK))
    }

    /// Read the control word from the first two ULPDU bytes.
    pub fn from_bytes(bytes: [u8; 2]) -> Control {
        Control(u16::from_be_bytes(bytes))
    }

    /// The two bytes on the wire.
    pub fn to_bytes(self) -> [u8; 2] {
        self.0.to_be_bytes()
    }

    /// T flag.
    pub fn tagged(self) -> bool {
        self.0 & Self::TAGGED != 0
    }

    /// L flag.
    pub fn last(self) -> bool {
        self.0 & Self::LAST != 0
    }

    /// DDP version (DV, 2 bits).
    pub fn ddp_version(self) -> u8 {
        ((self.0 & Self::DV_MASK) >> 8) as u8
    }

    /// RDMAP version (RV, 2 bits).
    pub fn rdmap_version(self) -> u8 {
        ((self.0 & Self::RV_MASK) >> 6) as u8
    }

    /// RDMAP opcode (4 bits), not yet validated.
    pub fn opcode(self) -> u8 {
        (self.0 & Self::OPCODE_MASK) as u8
    }

    /// The DDP header length this control word announces.
    pub fn ddp_header_len(self) -> usize {
        if self.tagged() {
            TAGGED_HEADER_LEN
        } else {
            UNTAGGED_HEADER_LEN
        }
    }

    /// Reject a DDP version other than 1 with the error RFC 5041 §7 assigns
    /// to the buffer model in use (tagged 0x04, untagged 0x06).
    pub fn check_ddp_version(self) -> Result<()> {
        if self.ddp_version() == DDP_VERSION {
            Ok(())
        } else {
            Err(Error::DdpVersion {
                tagged: self.tagged(),
                version: self.ddp_version(),
            })
        }
    }
}

fn truncated(need: usize, have: usize) -> Error {
    Error::Truncated {
        layer: Layer::Ddp,
        need,
        have,
    }
}

/// A read/write view of a tagged DDP segment (RFC 5041 §4.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tagged<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Tagged<T> {
    /// Wrap a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> Tagged<T> {
        Tagged { buffer }
    }

    /// Wrap a buffer and check it holds a whole tagged header.
    pub fn new_checked(buffer: T) -> Result<Tagged<T>> {
        let segment = Self::new_unchecked(buffer);
        segment.check_len()?;
        Ok(segment)
    }

    /// Ensure no getter panics: the buffer holds the 14 header bytes.
    pub fn check_len(&self) -> Result<()> {
        let len = self.buffer.as_ref().len();
        if len < TAGGED_HEADER_LEN {
            Err(truncated(TAGGED_HEADER_LEN, len))
        } else {
            Ok(())
        }
    }

    /// Give back the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// DDP + RDMAP control word.
    pub fn control(&self) -> Control {
        let b = self.buffer.as_ref();
        Control::from_bytes([b[field::DDP_CTRL], b[field::RDMAP_CTRL]])
    }

    /// Data-sink STag.
    pub fn stag(&self) -> u32 {
        be_u32(&self.buffer.as_ref()[field::STAG])
    }

    /// Tagged offset of the first payload byte.
    pub fn to(&self) -> u64 {
        be_u64(&self.buffer.as_ref()[field::TO])
    }

    /// The bytes after the tagged header.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[field::TAGGED_PAYLOAD]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Tagged<T> {
    /// Set the DDP + RDMAP control word.
    pub fn set_control(&mut self, control: Control) {
        self.buffer.as_mut()[field::CONTROL].copy_from_slice(&control.to_bytes());
    }

    /// Set the data-sink STag.
    pub fn set_stag(&mut self, stag: u32) {
        self.buffer.as_mut()[field::STAG].copy_from_slice(&stag.to_be_bytes());
    }

    /// Set the tagged offset.
    pub fn set_to(&mut self, to: u64) {
        self.buffer.as_mut()[field::TO].copy_from_slice(&to.to_be_bytes());
    }

    /// The bytes after the tagged header, writable.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[field::TAGGED_PAYLOAD]
    }
}

/// A read/write view of an untagged DDP segment (RFC 5041 §4.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Untagged<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Untagged<T> {
    /// Wrap a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> Untagged<T> {
        Untagged { buffer }
    }

    /// Wrap a buffer and check it holds a whole untagged header.
    pub fn new_checked(buffer: T) -> Result<Untagged<T>> {
        let segment = Self::new_unchecked(buffer);
        segment.check_len()?;
        Ok(segment)
    }

    /// Ensure no getter panics: the buffer holds the 18 header bytes.
    pub fn check_len(&self) -> Result<()> {
        let len = self.buffer.as_ref().len();
        if len < UNTAGGED_HEADER_LEN {
            Err(truncated(UNTAGGED_HEADER_LEN, len))
        } else {
            Ok(())
        }
    }

    /// Give back the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// DDP + RDMAP control word.
    pub fn control(&self) -> Control {
        let b = self.buffer.as_ref();
        Control::from_bytes([b[field::DDP_CTRL], b[field::RDMAP_CTRL]])
    }

    /// The 32 RsvdULP bits after the control word; RDMAP's Invalidate STag.
    pub fn rsvd_ulp(&self) -> u32 {
        be_u32(&self.buffer.as_ref()[field::RSVD_ULP])
    }

    /// Queue number.
    pub fn qn(&self) -> u32 {
        be_u32(&self.buffer.as_ref()[field::QN])
    }

    /// Message sequence number.
    pub fn msn(&self) -> u32 {
        be_u32(&self.buffer.as_ref()[field::MSN])
    }

    /// Message offset of the first payload byte.
    pub fn mo(&self) -> u32 {
        be_u32(&self.buffer.as_ref()[field::MO])
    }

    /// The bytes after the untagged header.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[field::UNTAGGED_PAYLOAD]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Untagged<T> {
    /// Set the DDP + RDMAP control word.
    pub fn set_control(&mut self, control: Control) {
        self.buffer.as_mut()[field::CONTROL].copy_from_slice(&control.to_bytes());
    }

    /// Set the RsvdULP word (RDMAP's Invalidate STag).
    pub fn set_rsvd_ulp(&mut self, value: u32) {
        self.buffer.as_mut()[field::RSVD_ULP].copy_from_slice(&value.to_be_bytes());
    }

    /// Set the queue number.
    pub fn set_qn(&mut self, qn: u32) {
        self.buffer.as_mut()[field::QN].copy_from_slice(&qn.to_be_bytes());
    }

    /// Set the message sequence number.
    pub fn set_msn(&mut self, msn: u32) {
        self.buffer.as_mut()[field::MSN].copy_from_slice(&msn.to_be_bytes());
    }

    /// Set the message offset.
    pub fn set_mo(&mut self, mo: u32) {
        self.buffer.as_mut()[field::MO].copy_from_slice(&mo.to_be_bytes());
    }

    /// The bytes after the untagged header, writable.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[field::UNTAGGED_PAYLOAD]
    }
}

/// The buffer-model part of a DDP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DdpHeader {
    /// Tagged buffer model: place at `to` in the buffer `stag` names.
    Tagged {
        /// Data-sink STag.
        stag: u32,
        /// Tagged offset of the first payload byte.
        to: u64,
    },
    /// Untagged buffer model: offset `mo` of message `msn` on queue `qn`.
    Untagged {
        /// RsvdULP bits (RDMAP: Invalidate STag).
        rsvd_ulp: u32,
        /// Queue number.
        qn: u32,
        /// Message sequence number.
        msn: u32,
        /// Message offset.
        mo: u32,
    },
}

/// The typed meaning of a DDP segment header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DdpRepr {
    /// L: last segment of the DDP message.
    pub last: bool,
    /// The byte DDP reserves for its ULP after its control byte: RDMAP's
    /// control byte (RV, Rsv, opcode).
    pub ulp_control: u8,
    /// Tagged or untagged header fields.
    pub header: DdpHeader,
}

impl DdpRepr {
    /// Parse a DDP segment: check DV and the header length, return the
    /// header and the bytes after it (which RDMAP may still interpret).
    pub fn parse(segment: &[u8]) -> Result<(DdpRepr, &[u8])> {
        let control = match segment {
            [a, b, ..] => Control::from_bytes([*a, *b]),
            _ => return Err(truncated(2, segment.len())),
        };
        control.check_ddp_version()?;
        let ulp_control = (control.0 & 0x00ff) as u8;
        if control.tagged() {
            let view = Tagged::new_checked(segment)?;
            let repr = DdpRepr {
                last: control.last(),
                ulp_control,
                header: DdpHeader::Tagged {
                    stag: view.stag(),
                    to: view.to(),
                },
            };
            Ok((repr, &segment[field::TAGGED_PAYLOAD]))
        } else {
            let view = Untagged::new_checked(segment)?;
            let repr = DdpRepr {
                last: control.last(),
                ulp_control,
                header: DdpHeader::Untagged {
                    rsvd_ulp: view.rsvd_ulp(),
                    qn: view.qn(),
                    msn: view.msn(),
                    mo: view.mo(),
                },
            };
            Ok((repr, &segment[field::UNTAGGED_PAYLOAD]))
        }
    }

    /// Header bytes this repr emits: 14 tagged, 18 untagged.
    pub fn header_len(&self) -> usize {
        match self.header {
            DdpHeader::Tagged { .. } => TAGGED_HEADER_LEN,
            DdpHeader::Untagged { .. } => UNTAGGED_HEADER_LEN,
        }
    }

    /// The control word this repr emits (DV = 1, reserved bits zero).
    pub fn control(&self) -> Control {
        let tagged = matches!(self.header, DdpHeader::Tagged { .. });
        let mut word = u16::from(DDP_VERSION) << 8 | u16::from(self.ulp_control);
        if tagged {
            word |= Control::TAGGED;
        }
        if self.last {
            word |= Control::LAST;
        }
        Control(word)
    }

    /// Write the header into the first [`DdpRepr::header_len`] bytes of
    /// `buf`.
    ///
    /// # Panics
    /// If `buf` is shorter than [`DdpRepr::header_len`] (a caller bug).
    pub fn emit(&self, buf: &mut [u8]) {
        assert!(
            buf.len() >= self.header_len(),
            "DDP header buffer too short"
        );
        let control = self.control();
        match self.header {
            DdpHeader::Tagged { stag, to } => {
                let mut view = Tagged::new_unchecked(buf);
                view.set_control(control);
                view.set_stag(stag);
                view.set_to(to);
            }
            DdpHeader::Untagged {
                rsvd_ulp,
                qn,
                msn,
                mo,
            } => {
                let mut view = Untagged::new_unchecked(buf);
                view.set_control(control);
                view.set_rsvd_ulp(rsvd_ulp);
                view.set_qn(qn);
                view.set_msn(msn);
                view.set_mo(mo);
            }
        }
    }
}

/// Where one DDP segment of a message starts and how long its payload is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SegmentSpan {
    /// Offset of the first payload byte within the message: the MO of an
    /// untagged segment; add the message's base TO for a tagged one.
    pub offset: u32,
    /// Payload bytes in this segment.
    pub len: u32,
    /// L: this is the message's last segment.
    pub last: bool,
}

/// Splits a message into DDP segments no larger than the MULPDU (the
/// core's send queue and Read Responses segment with it; a tagged
/// segment's TO is the message's base TO plus the span's offset, wrapping:
/// the receiver checks TO wrap, RFC 5041 §7).
///
/// Each segment carries `mulpdu - header_len` payload bytes except the last,
/// which carries the rest and has L set; an empty message is one empty last
/// segment (a zero-length Send or Write, e.g. siw's Write RTR).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segments {
    next_offset: u32,
    remaining: u32,
    max_payload: u32,
    done: bool,
}

impl Segments {
    /// Plan the segments of a `msg_len`-byte message whose segments each
    /// carry a `header_len`-byte DDP + RDMAP header, when the LLP accepts
    /// ULPDUs of at most `mulpdu` bytes (RFC 5041 §5.1: a DDP segment never
    /// exceeds the MULPDU).
    ///
    /// `None` if the MULPDU leaves no room for payload after the header.
    pub fn new(msg_len: u32, mulpdu: usize, header_len: usize) -> Option<Segments> {
        let room = mulpdu.checked_sub(header_len).filter(|&room| room > 0)?;
        Some(Segments {
            next_offset: 0,
            remaining: msg_len,
            max_payload: u32::try_from(room).unwrap_or(u32::MAX),
            done: false,
        })
    }
}

impl Iterator for Segments {
    type Item = SegmentSpan;

    fn next(&mut self) -> Option<SegmentSpan> {
        if self.done {
            return None;
        }
        let len = self.remaining.min(self.max_payload);
        let span = SegmentSpan {
            offset: self.next_offset,
            len,
            last: len == self.remaining,
        };
        self.remaining -= len;
        // Cannot overflow: offset + remaining never exceeds the message length.
        self.next_offset += len;
        self.done = span.last;
        Some(span)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        if self.done {
            return (0, Some(0));
        }
        let n = self.remaining.div_ceil(self.max_payload).max(1) as usize;
        (n, Some(n))
    }
}

impl ExactSizeIterator for Segments {}

/// What [`UntaggedReassembly::accept`] tells the caller to do with a
/// segment's payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Placement {
    /// Offset in the receive buffer where the payload goes (the MO).
    pub offset: u32,
    /// This segment completes the message: deliver it.
    pub complete: bool,
    /// Total message length so far (the delivered length when complete).
    pub message_len: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Partial {
    /// Highest byte end placed so far.
    message_len: u32,
    capacity: u32,
}

/// Validates the untagged segments of one queue as they arrive over TCP
/// (RFC 5041 §5.3, §7): MSNs consecutive from 1, no segment beyond the
/// receive buffer. Within one message segments are placed by their MO, in
/// whatever order they come (RFC 5041 §5.3: the MO, not arrival order,
/// places the payload); the segment with L set completes the message, whose
/// length is the highest byte end placed.
///
/// Errors are those of RFC 5041 §7: a segment for another MSN while one is
/// incomplete, or an unexpected MSN, is "MSN range not valid"; an MO whose
/// end overflows is "invalid MO"; no posted buffer is "no buffer
/// available"; running past the buffer is "message too long". (siw reports
/// a buffer that is too short as "no buffer available" instead,
/// `siw_send_check_ntoh`, and insists on in-order MOs.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UntaggedReassembly {
    expected_msn: u32,
    partial: Option<Partial>,
}

impl Default for UntaggedReassembly {
    fn default() -> Self {
        Self::new()
    }
}

impl UntaggedReassembly {
    /// A queue that expects MSN 1 next.
    pub const fn new() -> UntaggedReassembly {
        UntaggedReassembly {
            expected_msn: INITIAL_MSN,
            partial: None,
        }
    }

    /// The MSN the next message (or the one in progress) must carry.
    pub fn expected_msn(&self) -> u32 {
        self.expected_msn
    }

    /// Whether a message has started but not yet seen its last segment.
    pub fn in_progress(&self) -> bool {
        self.partial.is_some()
    }

    /// Check one segment (`msn`, `mo`, `len` payload bytes, L flag).
    ///
    /// On the first segment of a message `buffer` is called once to take
    /// the receive buffer the message will fill; it returns that buffer's
    /// length, or `None` if none is posted. On error the queue state is
    /// unchanged (a buffer taken by a failing first segment belongs to the
    /// failed message: the stream terminates anyway).
    pub fn accept(
        &mut self,
        msn: u32,
        mo: u32,
        len: u32,
        last: bool,
        buffer: impl FnOnce() -> Option<u32>,
    ) -> Result<Placement> {
        if msn != self.expected_msn {
            return Err(Error::MsnRange(msn));
        }
        let end = mo.checked_add(len).ok_or(Error::InvalidMo(mo))?;
        let partial = match self.partial {
            Some(partial) => partial,
            None => Partial {
                message_len: 0,
                capacity: buffer().ok_or(Error::NoBuffer(msn))?,
            },
        };
        if end > partial.capacity {
            return Err(Error::MessageTooLong);
        }
        let message_len = partial.message_len.max(end);
        if last {
            self.partial = None;
            self.expected_msn = self.expected_msn.wrapping_add(1);
        } else {
            self.partial = Some(Partial {
                message_len,
                capacity: partial.capacity,
            });
        }
        Ok(Placement {
            offset: mo,
            complete: last,
            message_len,
        })
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use proptest::prelude::*;

    // A tagged last RDMA Write, laid out as siw's `struct iwarp_rdma_write`
    // (drivers/infiniband/sw/siw/iwarp.h) minus the 2-byte MPA length:
    // control 0xC140 (T|L|DV 1|RV 1|opcode 0), STag, TO, then 4 payload bytes.
    static PACKET_BYTES: [u8; 18] = [
        0xc1, 0x40, 0x12, 0x34, 0x56, 0x78, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x20, 0x00, 0xaa,
        0xbb, 0xcc, 0xdd,
    ];

    // An untagged last Send, siw `struct iwarp_send` minus the MPA length:
    // control 0x4143, reserved 0, QN 0, MSN 1 (siw's first MSN), MO 0, then
    // 2 payload bytes.
    static UNTAGGED_BYTES: [u8; 20] = [
        0x41, 0x43, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00,
        0x00, 0x00, 0x00, 0x68, 0x69,
    ];

    fn packet_repr() -> DdpRepr {
        DdpRepr {
            last: true,
            ulp_control: 0x40,
            header: DdpHeader::Tagged {
                stag: 0x1234_5678,
                to: 0x0000_0001_0000_2000,
            },
        }
    }

    fn untagged_repr() -> DdpRepr {
        DdpRepr {
            last: true,
            ulp_control: 0x43,
            header: DdpHeader::Untagged {
                rsvd_ulp: 0,
                qn: qn::SEND,
                msn: 1,
                mo: 0,
            },
        }
    }

    #[test]
    fn test_control_words() {
        // siw iwarp.h / spec README: untagged last Send 0x4143, tagged last
        // Write 0xC140.
        assert_eq!(Control::new(false, true, 3), Control(0x4143));
        assert_eq!(Control::new(true, true, 0), Control(0xc140));
        let c = Control(0x4143);
        assert!(!c.tagged() && c.last());
        assert_eq!((c.ddp_version(), c.rdmap_version(), c.opcode()), (1, 1, 3));
        assert_eq!(c.ddp_header_len(), UNTAGGED_HEADER_LEN);
        assert_eq!(Control(0xc140).ddp_header_len(), TAGGED_HEADER_LEN);
    }

    #[test]
    fn test_deconstruct() {
        let packet = Tagged::new_checked(&PACKET_BYTES[..]).unwrap();
        assert_eq!(packet.control(), Control(0xc140));
        assert_eq!(packet.stag(), 0x1234_5678);
        assert_eq!(packet.to(), 0x0000_0001_0000_2000);
        assert_eq!(packet.payload(), &[0xaa, 0xbb, 0xcc, 0xdd]);

        let packet = Untagged::new_checked(&UNTAGGED_BYTES[..]).unwrap();
        assert_eq!(packet.control(), Control(0x4143));
        assert_eq!(packet.rsvd_ulp(), 0);
        assert_eq!(packet.qn(), 0);
        assert_eq!(packet.msn(), 1);
        assert_eq!(packet.mo(), 0);
        assert_eq!(packet.payload(), b"hi");
    }

    #[test]
    fn test_construct() {
        let mut bytes = [0xa5; 18];
        let mut packet = Tagged::new_unchecked(&mut bytes[..]);
        packet.set_control(Control(0xc140));
        packet.set_stag(0x1234_5678);
        packet.set_to(0x0000_0001_0000_2000);
        packet
            .payload_mut()
            .copy_from_slice(&[0xaa, 0xbb, 0xcc, 0xdd]);
        assert_eq!(&bytes, &PACKET_BYTES);

        let mut bytes = [0xa5; 20];
        let mut packet = Untagged::new_unchecked(&mut bytes[..]);
        packet.set_control(Control(0x4143));
        packet.set_rsvd_ulp(0);
        packet.set_qn(0);
        packet.set_msn(1);
        packet.set_mo(0);
        packet.payload_mut().copy_from_slice(b"hi");
        assert_eq!(&bytes, &UNTAGGED_BYTES);
    }

    #[test]
    fn test_parse() {
        let (repr, payload) = DdpRepr::parse(&PACKET_BYTES).unwrap();
        assert_eq!(repr, packet_repr());
        assert_eq!(payload, &[0xaa, 0xbb, 0xcc, 0xdd]);
        let (repr, payload) = DdpRepr::parse(&UNTAGGED_BYTES).unwrap();
        assert_eq!(repr, untagged_repr());
        assert_eq!(payload, b"hi");
    }

    #[test]
    fn test_emit() {
        let repr = packet_repr();
        let mut bytes = [0xa5; 18];
        repr.emit(&mut bytes);
        bytes[14..].copy_from_slice(&[0xaa, 0xbb, 0xcc, 0xdd]);
        assert_eq!(&bytes, &PACKET_BYTES);

        let repr = untagged_repr();
        let mut bytes = [0xa5; 20];
        repr.emit(&mut bytes);
        bytes[18..].copy_from_slice(b"hi");
        assert_eq!(&bytes, &UNTAGGED_BYTES);
    }

    #[test]
    fn test_truncated() {
        for len in 0..TAGGED_HEADER_LEN {
            let err = DdpRepr::parse(&PACKET_BYTES[..len]).unwrap_err();
            assert!(matches!(err, Error::Truncated { layer: Layer::Ddp, have, .. } if have == len));
            assert!(Tagged::new_checked(&PACKET_BYTES[..len]).is_err());
        }
        for len in 0..UNTAGGED_HEADER_LEN {
            let err = DdpRepr::parse(&UNTAGGED_BYTES[..len]).unwrap_err();
            assert!(matches!(err, Error::Truncated { layer: Layer::Ddp, have, .. } if have == len));
            assert!(Untagged::new_checked(&UNTAGGED_BYTES[..len]).is_err());
        }
        assert_eq!(
            Error::Truncated {
                layer: Layer::Ddp,
                need: 18,
                have: 3
            }
            .terminate_cause(),
            TerminateCause {
                etype: ErrorType::DdpCatastrophic,
                ecode: 0x00
            }
        );
    }

    use crate::wire::{ErrorType, TerminateCause};

    #[test]
    fn test_version_rejected() {
        // RFC 5041 §7: invalid DDP version is tagged 0x1/0x04, untagged 0x2/0x06.
        let mut bytes = PACKET_BYTES;
        bytes[0] = 0xc2; // DV 2
        let err = DdpRepr::parse(&bytes).unwrap_err();
        assert_eq!(
            err,
            Error::DdpVersion {
                tagged: true,
                version: 2
            }
        );
        assert_eq!(
            err.terminate_cause(),
            TerminateCause {
                etype: ErrorType::DdpTagged,
                ecode: 0x04
            }
        );
        let mut bytes = UNTAGGED_BYTES;
        bytes[0] = 0x40; // DV 0
        let err = DdpRepr::parse(&bytes).unwrap_err();
        assert_eq!(
            err,
            Error::DdpVersion {
                tagged: false,
                version: 0
            }
        );
        assert_eq!(
            err.terminate_cause(),
            TerminateCause {
                etype: ErrorType::DdpUntagged,
                ecode: 0x06
            }
        );
    }

    #[test]
    fn test_reserved_bits_ignored() {
        // RFC 5041 §4.1: Rsvd is set to zero by the sender, not checked.
        let mut bytes = PACKET_BYTES;
        bytes[0] |= 0x3c;
        let (repr, _) = DdpRepr::parse(&bytes).unwrap();
        assert_eq!(repr, packet_repr());
    }

    #[test]
    fn test_segments() {
        // 10 bytes, MULPDU 18 + 4: payload 4, 4, 2.
        let spans: Vec<_> = Segments::new(10, 22, UNTAGGED_HEADER_LEN)
            .unwrap()
            .collect();
        assert_eq!(
            spans,
            [
                SegmentSpan {
                    offset: 0,
                    len: 4,
                    last: false
                },
                SegmentSpan {
                    offset: 4,
                    len: 4,
                    last: false
                },
                SegmentSpan {
                    offset: 8,
                    len: 2,
                    last: true
                },
            ]
        );
        // Exact multiple: no empty trailing segment.
        let spans: Vec<_> = Segments::new(8, 22, UNTAGGED_HEADER_LEN).unwrap().collect();
        assert_eq!(spans.len(), 2);
        assert!(spans[1].last && spans[1].len == 4);
        // Empty message: one empty last segment.
        let spans: Vec<_> = Segments::new(0, 22, UNTAGGED_HEADER_LEN).unwrap().collect();
        assert_eq!(
            spans,
            [SegmentSpan {
                offset: 0,
                len: 0,
                last: true
            }]
        );
        // No room for payload.
        assert!(Segments::new(1, 18, UNTAGGED_HEADER_LEN).is_none());
        assert!(Segments::new(1, 3, UNTAGGED_HEADER_LEN).is_none());
        assert_eq!(
            Error::DdpToWrap.terminate_cause(),
            TerminateCause {
                etype: ErrorType::DdpTagged,
                ecode: 0x03
            }
        );
    }

    #[test]
    fn test_reassembly() {
        let mut q = UntaggedReassembly::new();
        assert_eq!(q.expected_msn(), 1);
        let p = q.accept(1, 0, 4, false, || Some(10)).unwrap();
        assert_eq!(
            p,
            Placement {
                offset: 0,
                complete: false,
                message_len: 4
            }
        );
        assert!(q.in_progress());
        // Continuation segments do not take another buffer.
        let p = q.accept(1, 4, 6, true, || panic!("second buffer")).unwrap();
        assert_eq!(
            p,
            Placement {
                offset: 4,
                complete: true,
                message_len: 10
            }
        );
        assert_eq!(q.expected_msn(), 2);
        assert!(!q.in_progress());
    }

    #[test]
    fn test_reassembly_errors() {
        let cause = |e: Error| e.terminate_cause();
        let untagged = |ecode| TerminateCause {
            etype: ErrorType::DdpUntagged,
            ecode,
        };

        let mut q = UntaggedReassembly::new();
        // Wrong MSN: RFC 5041 §7 0x2/0x03.
        let e = q.accept(2, 0, 1, true, || Some(8)).unwrap_err();
        assert_eq!(e, Error::MsnRange(2));
        assert_eq!(cause(e), untagged(0x03));
        // MO + len overflows: 0x2/0x04.
        let e = q.accept(1, u32::MAX, 1, true, || Some(8)).unwrap_err();
        assert_eq!(e, Error::InvalidMo(u32::MAX));
        assert_eq!(cause(e), untagged(0x04));
        // No buffer: 0x2/0x02.
        let e = q.accept(1, 0, 1, true, || None).unwrap_err();
        assert_eq!(e, Error::NoBuffer(1));
        assert_eq!(cause(e), untagged(0x02));
        // Too long for the buffer: 0x2/0x05.
        let e = q.accept(1, 0, 9, true, || Some(8)).unwrap_err();
        assert_eq!(e, Error::MessageTooLong);
        assert_eq!(cause(e), untagged(0x05));
        // Segments are placed by MO in any order; the message is as long
        // as the highest byte placed.
        q.accept(1, 4, 2, false, || Some(8)).unwrap();
        let p = q
            .accept(1, 0, 4, false, || panic!("second buffer"))
            .unwrap();
        assert_eq!((p.offset, p.message_len), (0, 6));
        // Interleaved next message before the last segment.
        assert_eq!(q.accept(2, 0, 1, true, || Some(8)), Err(Error::MsnRange(2)));
        // Past the buffer in a later segment.
        assert_eq!(q.accept(1, 6, 3, true, || None), Err(Error::MessageTooLong));
        let p = q.accept(1, 6, 2, true, || None).unwrap();
        assert_eq!((p.complete, p.message_len), (true, 8));
    }

    proptest! {
        #[test]
        fn prop_repr_round_trip(
            last: bool, ulp_control: u8, tagged: bool,
            a: u32, b: u32, c: u32, d: u32, to: u64,
            payload in proptest::collection::vec(any::<u8>(), 0..8),
        ) {
            let header = if tagged {
                DdpHeader::Tagged { stag: a, to }
            } else {
                DdpHeader::Untagged { rsvd_ulp: a, qn: b, msn: c, mo: d }
            };
            let repr = DdpRepr { last, ulp_control, header };
            let mut buf = vec![0xa5; repr.header_len() + payload.len()];
            repr.emit(&mut buf);
            buf[repr.header_len()..].copy_from_slice(&payload);
            let (parsed, rest) = DdpRepr::parse(&buf).unwrap();
            prop_assert_eq!(parsed, repr);
            prop_assert_eq!(rest, &payload[..]);
        }

        #[test]
        fn prop_segments_reassemble(msg_len in 0u32..5000, mulpdu in 0usize..300) {
            match Segments::new(msg_len, mulpdu, UNTAGGED_HEADER_LEN) {
                None => prop_assert!(mulpdu <= UNTAGGED_HEADER_LEN),
                Some(segments) => {
                    let expected = segments.len();
                    let mut q = UntaggedReassembly::new();
                    let mut total = 0u32;
                    let mut count = 0;
                    for span in segments {
                        prop_assert!(span.len as usize + UNTAGGED_HEADER_LEN <= mulpdu);
                        let p = q.accept(1, span.offset, span.len, span.last, || Some(msg_len)).unwrap();
                        total += span.len;
                        count += 1;
                        prop_assert_eq!(p.complete, span.last);
                    }
                    prop_assert_eq!(total, msg_len);
                    prop_assert_eq!(count, expected);
                    prop_assert_eq!(q.expected_msn(), 2);
                }
            }
        }

        #[test]
        fn prop_parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = DdpRepr::parse(&bytes);
        }
    }
}
