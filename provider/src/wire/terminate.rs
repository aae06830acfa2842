//! The RDMAP Terminate message (RFC 5040 §4.8) and the Terminate cause each
//! [`Error`] draws: layer / error type / error code.
//!
//! A Terminate is an untagged, single-segment message on QN 2 (RFC 5040
//! §5.1; siw `siw_send_terminate`: MSN 1, MO 0, L set). After the 18-byte
//! untagged DDP header comes the Terminate header:
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! | Layer | EType |  Error Code   |M|D|R|        Reserved         |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |  DDP Segment Length (if D)    | Terminated DDP Header (if D)  ~
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+                               ~
//! ~  ... 14 bytes tagged / 18 untagged, then the Terminated RDMA   ~
//! ~  Header (if R): the 28-byte Read Request header                ~
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! siw lays this out as `struct iwarp_terminate` (24 bytes with the MPA
//! length). Its header defines the RFC masks (`TERM_MASK_LAYER 0xf0000000`,
//! ..., `TERM_FLAG_M 0x8000`, `D 0x4000`, `R 0x2000`) but fills the word
//! through little-endian C bitfields, so on x86 it sends Layer in the low
//! nibble, EType in the high one and M/D/R as 0x01/0x02/0x04 of the third
//! octet (seen on the wire against kernel 6.12 siw; [`TerminateRepr::parse`]
//! accepts that layout too; we send RFC 5040's). It appends the offending frame's header
//! *including its MPA length slot*, which it overwrites with the DDP
//! segment length: that slot is the 2-byte DDP Segment Length field, so the
//! copied DDP header starts 6 bytes into the Terminate header. siw's copy
//! rules (`siw_send_terminate`):
//! - LLP errors and RDMAP local catastrophic errors: nothing copied;
//! - DDP errors: M + D and the DDP header (none for invalid DDP version);
//! - RDMAP remote protection errors: M + D + R and the frame's header, the
//!   48-byte Read Request header for a Read Request, else the 20-byte
//!   untagged header (R set without an RDMA header following);
//! - RDMAP remote operation errors: M + D and the DDP header (none for
//!   invalid RDMAP version or unexpected opcode).
//!
//! The segment length siw reports is the frame's payload length (its MPA
//! length minus the opcode's header length).

use super::ddp::{Control, TAGGED_HEADER_LEN, UNTAGGED_HEADER_LEN};
use super::{Error, Field, Layer, Result};

/// The error type within a layer (Terminate Control, bits 4..7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorType {
    /// RDMAP 0x0: local catastrophic error.
    RdmapCatastrophic,
    /// RDMAP 0x1: remote protection error.
    RdmapRemoteProtection,
    /// RDMAP 0x2: remote operation error.
    RdmapRemoteOperation,
    /// DDP 0x0: local catastrophic error.
    DdpCatastrophic,
    /// DDP 0x1: tagged buffer error.
    DdpTagged,
    /// DDP 0x2: untagged buffer error.
    DdpUntagged,
    /// DDP 0x3: reserved for the LLP.
    DdpReservedLlp,
    /// LLP 0x0: MPA error.
    Mpa,
}

impl ErrorType {
    /// The layer this error type belongs to.
    pub fn layer(self) -> Layer {
        match self {
            Self::RdmapCatastrophic | Self::RdmapRemoteProtection | Self::RdmapRemoteOperation => {
                Layer::Rdmap
            }
            Self::DdpCatastrophic | Self::DdpTagged | Self::DdpUntagged | Self::DdpReservedLlp => {
                Layer::Ddp
            }
            Self::Mpa => Layer::Llp,
        }
    }

    /// The 4-bit value on the wire.
    pub fn value(self) -> u8 {
        match self {
            Self::RdmapCatastrophic | Self::DdpCatastrophic | Self::Mpa => 0x0,
            Self::RdmapRemoteProtection | Self::DdpTagged => 0x1,
            Self::RdmapRemoteOperation | Self::DdpUntagged => 0x2,
            Self::DdpReservedLlp => 0x3,
        }
    }

    /// Decode a layer / error type pair from the wire; `None` for pairs RFC
    /// 5040 §4.8, RFC 5041 §7 and RFC 5044 §8 do not define.
    pub fn from_wire(layer: Layer, etype: u8) -> Option<ErrorType> {
        Some(match (layer, etype) {
            (Layer::Rdmap, 0x0) => Self::RdmapCatastrophic,
            (Layer::Rdmap, 0x1) => Self::RdmapRemoteProtection,
            (Layer::Rdmap, 0x2) => Self::RdmapRemoteOperation,
            (Layer::Ddp, 0x0) => Self::DdpCatastrophic,
            (Layer::Ddp, 0x1) => Self::DdpTagged,
            (Layer::Ddp, 0x2) => Self::DdpUntagged,
            (Layer::Ddp, 0x3) => Self::DdpReservedLlp,
            (Layer::Llp, 0x0) => Self::Mpa,
            _ => return None,
        })
    }
}

/// What a Terminate message says went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TerminateCause {
    /// Layer and error type (the layer is implied by the type).
    pub etype: ErrorType,
    /// Error code within the type.
    pub ecode: u8,
}

impl TerminateCause {
    /// The layer that detected the error.
    pub fn layer(&self) -> Layer {
        self.etype.layer()
    }
}

impl Error {
    /// The Terminate layer, error type and error code that reports this error.
    ///
    /// Codes checked against the IANA "RDDP" registries (RFC 6580), RFC 5040
    /// §4.8, RFC 5041 §7, RFC 5044 §8, RFC 6581 §8, RFC 7306 §8 and siw's
    /// `enum rdmap_ecode`/`ddp_ecode`/`llp_ecode` (iwarp.h).
    pub fn terminate_cause(&self) -> TerminateCause {
        use ErrorType::*;
        let (etype, ecode) = match *self {
            // RFC 5044 §8 / RFC 6581 §8 (LLP, error type MPA).
            Error::LlpClosed => (Mpa, 0x01),
            Error::Crc { .. } => (Mpa, 0x02),
            Error::MarkerMismatch => (Mpa, 0x03),
            Error::MpaKey
            | Error::MpaRevision(_)
            | Error::MpaMalformed(_)
            | Error::MpaPrivateDataTooLong(_) => (Mpa, 0x04),
            Error::Truncated {
                layer: Layer::Llp, ..
            }
            | Error::FpduTooLong(_) => (Mpa, 0x04),
            Error::MpaLocalCatastrophic => (Mpa, 0x05),
            Error::InsufficientIrd => (Mpa, 0x06),
            Error::NoMatchingRtr => (Mpa, 0x07),
            // RFC 5041 §7 (DDP).
            Error::DdpInvalidStag(_) => (DdpTagged, 0x00),
            Error::DdpBaseBounds => (DdpTagged, 0x01),
            Error::DdpStagNotAssociated(_) => (DdpTagged, 0x02),
            Error::DdpToWrap => (DdpTagged, 0x03),
            Error::DdpVersion { tagged: true, .. } => (DdpTagged, 0x04),
            Error::InvalidQn(_) => (DdpUntagged, 0x01),
            Error::NoBuffer(_) => (DdpUntagged, 0x02),
            Error::MsnRange(_) => (DdpUntagged, 0x03),
            Error::InvalidMo(_) => (DdpUntagged, 0x04),
            Error::MessageTooLong => (DdpUntagged, 0x05),
            Error::DdpVersion { tagged: false, .. } => (DdpUntagged, 0x06),
            Error::Truncated {
                layer: Layer::Ddp, ..
            } => (DdpCatastrophic, 0x00),
            // RFC 5040 §4.8 (RDMAP). Remote protection codes 0x00-0x04,
            // 0x09, 0xFF; remote operation codes 0x05-0x09, 0xFF.
            Error::InvalidStag(_) => (RdmapRemoteProtection, 0x00),
            Error::BaseBounds => (RdmapRemoteProtection, 0x01),
            Error::AccessRights => (RdmapRemoteProtection, 0x02),
            Error::StagNotAssociated(_) => (RdmapRemoteProtection, 0x03),
            Error::ToWrap => (RdmapRemoteProtection, 0x04),
            Error::CannotInvalidate(_) => (RdmapRemoteProtection, 0x09),
            Error::RdmapVersion(_) => (RdmapRemoteOperation, 0x05),
            Error::UnexpectedOpcode(_) => (RdmapRemoteOperation, 0x06),
            Error::Catastrophic => (RdmapRemoteOperation, 0x07),
            Error::RdmapMalformed(_)
            | Error::Truncated {
                layer: Layer::Rdmap,
                ..
            } => (RdmapRemoteOperation, 0xff),
            // RFC 7306 §8.2: a misaligned atomic target is a remote
            // operation error, "Catastrophic error, localized to RDMAP
            // Stream" (RFC 5040 code 0x07); RFC 7306 defines no new codes.
            Error::AtomicMisaligned => (RdmapRemoteOperation, 0x07),
            // RFC 7306 §1: an unsupported atomic operation is reported as a
            // Remote Operation Error / Unexpected OpCode.
            Error::InvalidAtomicOpcode(_) => (RdmapRemoteOperation, 0x06),
            // More Read/Atomic Requests than IRD: siw `siw_init_rresp`
            // reports remote operation / catastrophic localized (0x07).
            Error::IrdExceeded => (RdmapRemoteOperation, 0x07),
        };
        TerminateCause { etype, ecode }
    }
}

/// Bytes of the fixed Terminate header (the Terminate Control word).
pub const TERMINATE_CONTROL_LEN: usize = 4;
/// Bytes of the DDP Segment Length field before a copied DDP header.
pub const SEGMENT_LENGTH_LEN: usize = 2;
/// Bytes of a copied RDMA header: the Read Request header (RFC 5040 §4.4).
pub const READ_REQUEST_HEADER_LEN: usize = 28;

mod field {
    use super::Field;
    pub const LAYER_ETYPE: usize = 0;
    pub const ECODE: usize = 1;
    pub const HDRCT: usize = 2;
    pub const RESERVED: Field = 2..4;
    pub const SEGMENT_LENGTH: Field = 4..6;
    pub const DDP_HEADER: usize = 6;
}

const FLAG_M: u8 = 0x80;
const FLAG_D: u8 = 0x40;
const FLAG_R: u8 = 0x20;

fn truncated(need: usize, have: usize) -> Error {
    Error::Truncated {
        layer: Layer::Rdmap,
        need,
        have,
    }
}

/// A read/write view of a Terminate header: the bytes after the Terminate
/// message's untagged DDP header, up to the end of the ULPDU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Terminate<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Terminate<T> {
    /// Wrap a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> Terminate<T> {
        Terminate { buffer }
    }

    /// Wrap a buffer and check every length the header claims.
    pub fn new_checked(buffer: T) -> Result<Terminate<T>> {
        let view = Self::new_unchecked(buffer);
        view.check_len()?;
        Ok(view)
    }

    /// Ensure no getter panics: the control word is there, and when D is set
    /// so are the segment length and the whole copied DDP header; when R is
    /// set, either nothing or at least a Read Request header follows.
    pub fn check_len(&self) -> Result<()> {
        let len = self.buffer.as_ref().len();
        if len < TERMINATE_CONTROL_LEN {
            return Err(truncated(TERMINATE_CONTROL_LEN, len));
        }
        if self.d() {
            // The copied header's control word tells its size.
            let Some(ddp_end) = self.rdmap_header_offset() else {
                return Err(truncated(field::DDP_HEADER + 2, len));
            };
            if len < ddp_end {
                return Err(truncated(ddp_end, len));
            }
            if self.r() && len > ddp_end && len < ddp_end + READ_REQUEST_HEADER_LEN {
                return Err(truncated(ddp_end + READ_REQUEST_HEADER_LEN, len));
            }
        }
        Ok(())
    }

    /// Give back the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Layer nibble.
    pub fn layer(&self) -> u8 {
        self.buffer.as_ref()[field::LAYER_ETYPE] >> 4
    }

    /// Error type nibble.
    pub fn etype(&self) -> u8 {
        self.buffer.as_ref()[field::LAYER_ETYPE] & 0x0f
    }

    /// Error code.
    pub fn ecode(&self) -> u8 {
        self.buffer.as_ref()[field::ECODE]
    }

    /// M: the DDP Segment Length field is valid.
    pub fn m(&self) -> bool {
        self.buffer.as_ref()[field::HDRCT] & FLAG_M != 0
    }

    /// D: the terminated segment's DDP header is included.
    pub fn d(&self) -> bool {
        self.buffer.as_ref()[field::HDRCT] & FLAG_D != 0
    }

    /// R: the terminated message's RDMA header is included.
    pub fn r(&self) -> bool {
        self.buffer.as_ref()[field::HDRCT] & FLAG_R != 0
    }

    /// The 13 reserved bits after M/D/R.
    pub fn reserved(&self) -> u16 {
        super::be_u16(&self.buffer.as_ref()[field::RESERVED]) & 0x1fff
    }

    /// DDP Segment Length (present when D is set; meaningful when M is).
    pub fn segment_length(&self) -> Option<u16> {
        self.buffer
            .as_ref()
            .get(field::SEGMENT_LENGTH)
            .map(super::be_u16)
    }

    /// The copied DDP header's control word, if the bytes are there.
    pub fn terminated_control(&self) -> Option<Control> {
        match self
            .buffer
            .as_ref()
            .get(field::DDP_HEADER..field::DDP_HEADER + 2)?
        {
            [a, b] => Some(Control::from_bytes([*a, *b])),
            _ => None,
        }
    }

    fn rdmap_header_offset(&self) -> Option<usize> {
        Some(field::DDP_HEADER + self.terminated_control()?.ddp_header_len())
    }

    /// The copied DDP header, 14 or 18 bytes as its T flag says (meaningful
    /// when D is set).
    pub fn terminated_ddp_header(&self) -> Option<&[u8]> {
        let end = self.rdmap_header_offset()?;
        self.buffer.as_ref().get(field::DDP_HEADER..end)
    }

    /// The copied Read Request header, if present (meaningful when D and R
    /// are set; siw sets R without one for Sends).
    pub fn terminated_rdmap_header(&self) -> Option<&[u8]> {
        let start = self.rdmap_header_offset()?;
        self.buffer
            .as_ref()
            .get(start..start + READ_REQUEST_HEADER_LEN)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Terminate<T> {
    /// Set layer, error type and code.
    pub fn set_cause(&mut self, layer: u8, etype: u8, ecode: u8) {
        let b = self.buffer.as_mut();
        b[field::LAYER_ETYPE] = (layer << 4) | (etype & 0x0f);
        b[field::ECODE] = ecode;
    }

    /// Set M, D, R; the reserved bits become zero.
    pub fn set_flags(&mut self, m: bool, d: bool, r: bool) {
        let b = self.buffer.as_mut();
        let mut hdrct = 0;
        if m {
            hdrct |= FLAG_M;
        }
        if d {
            hdrct |= FLAG_D;
        }
        if r {
            hdrct |= FLAG_R;
        }
        b[field::HDRCT] = hdrct;
        b[field::HDRCT + 1] = 0;
    }

    /// Set the DDP Segment Length field.
    pub fn set_segment_length(&mut self, length: u16) {
        self.buffer.as_mut()[field::SEGMENT_LENGTH].copy_from_slice(&length.to_be_bytes());
    }

    /// Copy a DDP header in after the segment length.
    pub fn set_terminated_ddp_header(&mut self, header: &[u8]) {
        self.buffer.as_mut()[field::DDP_HEADER..field::DDP_HEADER + header.len()]
            .copy_from_slice(header);
    }

    /// Copy a Read Request header in after the DDP header.
    ///
    /// # Panics
    /// If the copied DDP header is not in place yet (a caller bug).
    pub fn set_terminated_rdmap_header(&mut self, header: &[u8; READ_REQUEST_HEADER_LEN]) {
        let start = self
            .rdmap_header_offset()
            .expect("copied DDP header set first");
        self.buffer.as_mut()[start..start + READ_REQUEST_HEADER_LEN].copy_from_slice(header);
    }
}

/// A copied DDP header, kept as the bytes the peer sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TerminatedDdpHeader {
    /// A tagged header (T set), 14 bytes.
    Tagged([u8; TAGGED_HEADER_LEN]),
    /// An untagged header, 18 bytes.
    Untagged([u8; UNTAGGED_HEADER_LEN]),
}

impl TerminatedDdpHeader {
    /// Copy the DDP header off the front of a segment; `None` if it is
    /// shorter than the header its T flag announces.
    pub fn copy_from(segment: &[u8]) -> Option<TerminatedDdpHeader> {
        let first = *segment.first()?;
        if first & 0x80 != 0 {
            Some(Self::Tagged(
                segment.get(..TAGGED_HEADER_LEN)?.try_into().ok()?,
            ))
        } else {
            Some(Self::Untagged(
                segment.get(..UNTAGGED_HEADER_LEN)?.try_into().ok()?,
            ))
        }
    }

    /// The copied bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Tagged(b) => b,
            Self::Untagged(b) => b,
        }
    }

    /// The copied control word.
    pub fn control(&self) -> Control {
        let b = self.as_bytes();
        Control::from_bytes([b[0], b[1]])
    }
}

/// The R bit and what follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TerminatedRdmapHeader {
    /// R clear.
    NotIncluded,
    /// R set but no RDMA header follows (siw does this for remote protection
    /// errors on Sends, whose RDMA header is empty).
    FlagOnly,
    /// R set and the terminated Read Request's 28-byte header follows.
    ReadRequest([u8; READ_REQUEST_HEADER_LEN]),
}

/// The part of a Terminate describing the segment that caused it (D set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TerminatedSegment {
    /// DDP Segment Length when M is set (siw: the payload length).
    pub length: Option<u16>,
    /// The copied DDP header.
    pub ddp_header: TerminatedDdpHeader,
    /// The R bit and the copied RDMA header.
    pub rdmap_header: TerminatedRdmapHeader,
}

impl TerminatedSegment {
    /// Bytes after the Terminate Control word.
    pub fn buffer_len(&self) -> usize {
        let rdmap = match self.rdmap_header {
            TerminatedRdmapHeader::ReadRequest(_) => READ_REQUEST_HEADER_LEN,
            _ => 0,
        };
        SEGMENT_LENGTH_LEN + self.ddp_header.as_bytes().len() + rdmap
    }
}

/// The typed meaning of a Terminate message (its DDP MSN and header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TerminateRepr {
    /// MSN on QN 2 (siw always sends 1: a stream carries one Terminate).
    pub msn: u32,
    /// Layer, error type and error code.
    pub cause: TerminateCause,
    /// The terminated segment's headers, when D is set.
    pub terminated: Option<TerminatedSegment>,
}

impl TerminateRepr {
    /// Parse a Terminate header (the bytes after the DDP header, to the end
    /// of the ULPDU). Undefined layer / error type pairs, M or R without D,
    /// and bytes beyond what the flags announce are rejected; the reserved
    /// bits are ignored (RFC 5040 §4.8: "ignored on receive").
    ///
    /// Kernel siw on little-endian hosts fills the control word through C
    /// bitfields (`struct iwarp_terminate` in `iwarp.h`), which puts Layer in
    /// the *low* nibble of the first octet and EType in the high one, and M,
    /// D, R in bits 0x01, 0x02, 0x04 of the third octet instead of 0x80,
    /// 0x40, 0x20 (found against a live siw: a Read with a bad STag draws
    /// `10 00 07 00` for RDMAP / remote protection / invalid STag with
    /// M+D+R). A Terminate that does not parse as RFC 5040 lays it out, and
    /// whose RFC flag bits are clear, is parsed again in siw's layout.
    /// Terminates without flags whose nibbles read as a defined RFC cause
    /// either way stay ambiguous and are taken as RFC 5040 says.
    pub fn parse(msn: u32, header: &[u8]) -> Result<TerminateRepr> {
        match Self::parse_rfc(msn, header) {
            Ok(repr) => Ok(repr),
            Err(e) => {
                let Some(&[le, ecode, flags, _]) = header.get(..TERMINATE_CONTROL_LEN) else {
                    return Err(e);
                };
                if flags & (FLAG_M | FLAG_D | FLAG_R) != 0 {
                    return Err(e);
                }
                let mut fixed = header.to_vec();
                fixed[0] = le.rotate_left(4);
                fixed[1] = ecode;
                fixed[2] = (flags & 0x01) << 7 | (flags & 0x02) << 5 | (flags & 0x04) << 3;
                fixed[3] = 0;
                if fixed == header {
                    return Err(e);
                }
                Self::parse_rfc(msn, &fixed).map_err(|_| e)
            }
        }
    }

    fn parse_rfc(msn: u32, header: &[u8]) -> Result<TerminateRepr> {
        let view = Terminate::new_checked(header)?;
        let etype = Layer::from_u8(view.layer())
            .and_then(|layer| ErrorType::from_wire(layer, view.etype()))
            .ok_or(Error::RdmapMalformed(
                "undefined Terminate layer/error type",
            ))?;
        let cause = TerminateCause {
            etype,
            ecode: view.ecode(),
        };
        let (terminated, end) = if view.d() {
            let ddp_header = view
                .terminated_ddp_header()
                .and_then(TerminatedDdpHeader::copy_from)
                .ok_or(truncated(
                    field::DDP_HEADER + TAGGED_HEADER_LEN,
                    header.len(),
                ))?;
            let rdmap_header = match (view.r(), view.terminated_rdmap_header()) {
                (false, _) => TerminatedRdmapHeader::NotIncluded,
                (true, None) => TerminatedRdmapHeader::FlagOnly,
                (true, Some(bytes)) => TerminatedRdmapHeader::ReadRequest(
                    bytes
                        .try_into()
                        .map_err(|_| Error::RdmapMalformed("Terminate RDMA header"))?,
                ),
            };
            let segment = TerminatedSegment {
                length: view.segment_length().filter(|_| view.m()),
                ddp_header,
                rdmap_header,
            };
            let end = TERMINATE_CONTROL_LEN + segment.buffer_len();
            (Some(segment), end)
        } else {
            if view.m() || view.r() {
                return Err(Error::RdmapMalformed("Terminate M or R bit without D"));
            }
            (None, TERMINATE_CONTROL_LEN)
        };
        if header.len() != end {
            return Err(Error::RdmapMalformed("bytes after the Terminate header"));
        }
        Ok(TerminateRepr {
            msn,
            cause,
            terminated,
        })
    }

    /// Bytes of the Terminate header this repr emits (after the DDP header).
    pub fn buffer_len(&self) -> usize {
        TERMINATE_CONTROL_LEN + self.terminated.as_ref().map_or(0, |t| t.buffer_len())
    }

    /// Write the Terminate header into the first [`TerminateRepr::buffer_len`]
    /// bytes of `buf`.
    ///
    /// # Panics
    /// If `buf` is shorter than [`TerminateRepr::buffer_len`] (a caller bug).
    pub fn emit(&self, buf: &mut [u8]) {
        assert!(buf.len() >= self.buffer_len(), "Terminate buffer too short");
        let mut view = Terminate::new_unchecked(&mut buf[..self.buffer_len()]);
        view.set_cause(
            self.cause.layer() as u8,
            self.cause.etype.value(),
            self.cause.ecode,
        );
        match &self.terminated {
            None => view.set_flags(false, false, false),
            Some(t) => {
                let r = t.rdmap_header != TerminatedRdmapHeader::NotIncluded;
                view.set_flags(t.length.is_some(), true, r);
                view.set_segment_length(t.length.unwrap_or(0));
                view.set_terminated_ddp_header(t.ddp_header.as_bytes());
                if let TerminatedRdmapHeader::ReadRequest(h) = &t.rdmap_header {
                    view.set_terminated_rdmap_header(h);
                }
            }
        }
    }

    /// Build the Terminate that reports `error`, copying headers from the
    /// offending ULPDU the way siw does (see the module docs), so a siw peer
    /// sees what a siw peer would send. `offending` is the ULPDU that caused
    /// the error, or `None` for errors not tied to an incoming segment (RFC
    /// 7306 §8.1 rule 1: no headers then). The MSN is 1, as from siw.
    pub fn for_error(error: &Error, offending: Option<&[u8]>) -> TerminateRepr {
        let cause = error.terminate_cause();
        let copy = match cause.etype {
            ErrorType::Mpa | ErrorType::RdmapCatastrophic => false,
            ErrorType::DdpTagged => cause.ecode != 0x04,
            ErrorType::DdpUntagged => cause.ecode != 0x06,
            ErrorType::RdmapRemoteOperation => !matches!(cause.ecode, 0x05 | 0x06),
            _ => true,
        };
        let terminated = offending.filter(|_| copy).and_then(|ulpdu| {
            let ddp_header = TerminatedDdpHeader::copy_from(ulpdu)?;
            let control = ddp_header.control();
            let is_read_request = !control.tagged() && control.opcode() == 0x1;
            let rdmap_header = if cause.etype != ErrorType::RdmapRemoteProtection {
                TerminatedRdmapHeader::NotIncluded
            } else if is_read_request {
                let start = UNTAGGED_HEADER_LEN;
                match ulpdu.get(start..start + READ_REQUEST_HEADER_LEN) {
                    Some(h) => TerminatedRdmapHeader::ReadRequest(h.try_into().ok()?),
                    None => TerminatedRdmapHeader::FlagOnly,
                }
            } else {
                TerminatedRdmapHeader::FlagOnly
            };
            let header_len = if is_read_request {
                UNTAGGED_HEADER_LEN + READ_REQUEST_HEADER_LEN
            } else {
                ddp_header.as_bytes().len()
            };
            let payload_len = ulpdu.len().saturating_sub(header_len);
            Some(TerminatedSegment {
                length: Some(u16::try_from(payload_len).unwrap_or(u16::MAX)),
                ddp_header,
                rdmap_header,
            })
        });
        TerminateRepr {
            msn: 1,
            cause,
            terminated,
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;

    // The Terminate header siw sends for a DDP untagged-buffer error
    // "invalid MSN range" (0x1/0x2/0x03) on a 4-byte Send with MSN 5
    // (siw_qp.c `siw_send_terminate`, DDP layer: M + D, the 20-byte
    // `iwarp_ctrl_untagged` copied with its MPA length slot rewritten to the
    // payload length): control 0x12 0x03 0xC0 0x00, segment length 4, then
    // the Send's untagged header 0x4143, rsvd 0, QN 0, MSN 5, MO 0.
    static PACKET_BYTES: [u8; 24] = [
        0x12, 0x03, 0xc0, 0x00, 0x00, 0x04, 0x41, 0x43, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x05, 0x00, 0x00, 0x00, 0x00,
    ];

    const SEND_HEADER: [u8; 18] = [
        0x41, 0x43, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x05, 0x00,
        0x00, 0x00, 0x00,
    ];

    // A Read Request (siw `struct iwarp_rdma_rreq` minus the MPA length):
    // control 0x4141, rsvd, QN 1, MSN 1, MO 0, sink STag 0x11, sink TO
    // 0x2000, size 0x100, source STag 0x22, source TO 0x3000.
    const READ_REQUEST: [u8; 46] = [
        0x41, 0x41, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, // DDP
        0, 0, 0, 0x11, 0, 0, 0, 0, 0, 0, 0x20, 0, // sink STag, TO
        0, 0, 1, 0, // size
        0, 0, 0, 0x22, 0, 0, 0, 0, 0, 0, 0x30, 0, // source STag, TO
    ];

    fn packet_repr() -> TerminateRepr {
        TerminateRepr {
            msn: 1,
            cause: TerminateCause {
                etype: ErrorType::DdpUntagged,
                ecode: 0x03,
            },
            terminated: Some(TerminatedSegment {
                length: Some(4),
                ddp_header: TerminatedDdpHeader::Untagged(SEND_HEADER),
                rdmap_header: TerminatedRdmapHeader::NotIncluded,
            }),
        }
    }

    #[test]
    fn test_deconstruct() {
        let view = Terminate::new_checked(&PACKET_BYTES[..]).unwrap();
        assert_eq!((view.layer(), view.etype(), view.ecode()), (1, 2, 3));
        assert!(view.m() && view.d() && !view.r());
        assert_eq!(view.reserved(), 0);
        assert_eq!(view.segment_length(), Some(4));
        assert_eq!(view.terminated_control(), Some(Control(0x4143)));
        assert_eq!(view.terminated_ddp_header(), Some(&SEND_HEADER[..]));
        assert_eq!(view.terminated_rdmap_header(), None);
    }

    #[test]
    fn test_construct() {
        let mut bytes = [0xa5; 24];
        let mut view = Terminate::new_unchecked(&mut bytes[..]);
        view.set_cause(1, 2, 3);
        view.set_flags(true, true, false);
        view.set_segment_length(4);
        view.set_terminated_ddp_header(&SEND_HEADER);
        assert_eq!(bytes, PACKET_BYTES);
    }

    #[test]
    fn test_parse() {
        assert_eq!(TerminateRepr::parse(1, &PACKET_BYTES), Ok(packet_repr()));
    }

    #[test]
    fn test_emit() {
        let repr = packet_repr();
        assert_eq!(repr.buffer_len(), PACKET_BYTES.len());
        let mut bytes = [0xa5; 24];
        repr.emit(&mut bytes);
        assert_eq!(bytes, PACKET_BYTES);
    }

    #[test]
    fn test_truncated() {
        for len in 0..PACKET_BYTES.len() {
            let err = TerminateRepr::parse(1, &PACKET_BYTES[..len]).unwrap_err();
            assert!(
                matches!(err, Error::Truncated { layer: Layer::Rdmap, have, .. } if have == len),
                "{len}: {err:?}"
            );
            assert_eq!(err.terminate_cause().ecode, 0xff);
        }
    }

    /// siw's Terminate for an RDMA Read Request with an invalid source STag
    /// (captured from kernel 6.12 siw by `scripts/vm/interop.sh`, case
    /// terminate-from-siw): after the untagged DDP header, the control word
    /// `10 00 07 00` in siw's little-endian bitfield layout (Layer 0 in the
    /// low nibble, EType 1 in the high one, M+D+R as 0x01|0x02|0x04), the
    /// segment length 0 and the offending 46-byte Read Request header.
    static SIW_READ_BAD_STAG: [u8; 52] = [
        0x10, 0x00, 0x07, 0x00, // control, siw layout
        0x00, 0x00, // DDP segment length
        0x41, 0x41, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, // ctrl, rsvd, QN 1
        0x00, 0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, // MSN (sic) 0x10, MO 0
        0x00, 0x00, 0x01, 0x76, 0x00, 0x00, 0x7f, 0x1f, 0x70, 0xda, 0x80, 0x00, // sink
        0x00, 0x00, 0x00, 0x10, // size
        0xb2, 0x4b, 0x81, 0x00, 0x00, 0x00, 0x7f, 0x1f, 0x70, 0x9d, 0xd0, 0x00, // source
    ];

    #[test]
    fn test_siw_bitfield_layout() {
        let repr = TerminateRepr::parse(1, &SIW_READ_BAD_STAG).unwrap();
        assert_eq!(repr.cause.etype, ErrorType::RdmapRemoteProtection);
        assert_eq!(repr.cause.ecode, 0x00);
        let t = repr.terminated.expect("D: the DDP header is there");
        assert_eq!(t.length, Some(0));
        assert!(matches!(
            t.rdmap_header,
            TerminatedRdmapHeader::ReadRequest(_)
        ));
        // The RFC 5040 layout of the same cause parses as before.
        let mut rfc = SIW_READ_BAD_STAG;
        rfc[0] = 0x01;
        rfc[2] = 0xe0;
        assert_eq!(TerminateRepr::parse(1, &rfc), Ok(repr));
        // siw's flag-less LLP Terminate (CRC error: layer 2 in the low
        // nibble, `02 02 00 00`) reads as RDMAP remote operation / code 2 in
        // RFC terms, a defined cause: that one stays ambiguous.
        let amb = TerminateRepr::parse(1, &[0x02, 0x02, 0x00, 0x00]).unwrap();
        assert_eq!(amb.cause.etype, ErrorType::RdmapRemoteOperation);
        // siw's DDP invalid-version Terminate has no RFC meaning (layer 2,
        // type 1) and reads as DDP / untagged buffer error in siw's layout.
        let ddp = TerminateRepr::parse(1, &[0x21, 0x06, 0x00, 0x00]).unwrap();
        assert_eq!(ddp.cause.etype, ErrorType::DdpUntagged);
    }

    #[test]
    fn test_no_copy() {
        // An LLP CRC error as RFC 5040 lays it out: layer 2, type 0, code
        // 0x02, no flags (siw itself sends `02 02 00 00`, see
        // test_siw_bitfield_layout).
        let bytes = [0x20, 0x02, 0x00, 0x00];
        let repr = TerminateRepr::parse(1, &bytes).unwrap();
        assert_eq!(repr.cause.etype, ErrorType::Mpa);
        assert_eq!(repr.cause.ecode, 0x02);
        assert_eq!(repr.terminated, None);
        assert_eq!(
            TerminateRepr::for_error(
                &Error::Crc {
                    received: 1,
                    computed: 2
                },
                Some(&READ_REQUEST)
            ),
            repr
        );
        // Reserved bits are ignored.
        assert_eq!(TerminateRepr::parse(1, &[0x20, 0x02, 0x1f, 0xff]), Ok(repr));
    }

    #[test]
    fn test_read_request_copy() {
        // Remote protection error on a Read Request: M + D + R and the whole
        // 48-byte siw `iwarp_rdma_rreq` (segment length 0 + 46 bytes).
        let err = Error::InvalidStag(0x11);
        let repr = TerminateRepr::for_error(&err, Some(&READ_REQUEST));
        let mut bytes = [0xa5; 4 + 2 + 46];
        assert_eq!(repr.buffer_len(), bytes.len());
        repr.emit(&mut bytes);
        assert_eq!(&bytes[..6], &[0x01, 0x00, 0xe0, 0x00, 0x00, 0x00]);
        assert_eq!(&bytes[6..], &READ_REQUEST[..]);
        assert_eq!(TerminateRepr::parse(1, &bytes), Ok(repr));
        // Every truncation fails except right after the DDP header, which
        // reads as R set with no RDMA header (what siw sends for Sends).
        for len in 0..bytes.len() {
            let parsed = TerminateRepr::parse(1, &bytes[..len]);
            if len == 24 {
                let t = parsed.unwrap().terminated.unwrap();
                assert_eq!(t.rdmap_header, TerminatedRdmapHeader::FlagOnly);
            } else {
                assert!(matches!(parsed, Err(Error::Truncated { .. })), "{len}");
            }
        }
        // Trailing bytes are rejected.
        let mut long = [0u8; 4 + 2 + 46 + 1];
        long[..bytes.len()].copy_from_slice(&bytes);
        assert_eq!(
            TerminateRepr::parse(1, &long),
            Err(Error::RdmapMalformed("bytes after the Terminate header"))
        );
    }

    #[test]
    fn test_for_error_rules() {
        let mut send = [0u8; 22];
        send[..18].copy_from_slice(&SEND_HEADER);
        // DDP error: M + D, the untagged header, payload length 4.
        assert_eq!(
            TerminateRepr::for_error(&Error::MsnRange(5), Some(&send)),
            packet_repr()
        );
        // Remote protection on a Send: R set, no RDMA header (siw).
        let t = TerminateRepr::for_error(&Error::AccessRights, Some(&send))
            .terminated
            .unwrap();
        assert_eq!(t.rdmap_header, TerminatedRdmapHeader::FlagOnly);
        // Remote operation on a Read Request: M + D only.
        let t = TerminateRepr::for_error(&Error::IrdExceeded, Some(&READ_REQUEST))
            .terminated
            .unwrap();
        assert_eq!(t.rdmap_header, TerminatedRdmapHeader::NotIncluded);
        assert_eq!(t.length, Some(0));
        // Version and opcode errors: the layout is unknown, nothing copied.
        for err in [
            Error::RdmapVersion(2),
            Error::UnexpectedOpcode(0xe),
            Error::DdpVersion {
                tagged: true,
                version: 0,
            },
            Error::DdpVersion {
                tagged: false,
                version: 0,
            },
        ] {
            assert_eq!(
                TerminateRepr::for_error(&err, Some(&send)).terminated,
                None,
                "{err:?}"
            );
        }
        // Errors not tied to a segment (RFC 7306 §8.1 rule 1).
        assert_eq!(
            TerminateRepr::for_error(&Error::MsnRange(5), None).terminated,
            None
        );
        // A tagged segment copies 14 bytes.
        let write = [0xc1, 0x40, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 9, 9];
        let t = TerminateRepr::for_error(&Error::DdpBaseBounds, Some(&write))
            .terminated
            .unwrap();
        assert_eq!(
            t.ddp_header,
            TerminatedDdpHeader::Tagged(write[..14].try_into().unwrap())
        );
        assert_eq!(t.length, Some(2));
    }

    #[test]
    fn test_rejects() {
        // Undefined layer 3 and RDMAP error type 3, in either nibble order
        // (0x21, undefined as RFC 5040 lays it out, is siw's DDP untagged
        // buffer error: see test_siw_bitfield_layout).
        for first in [0x30, 0x03, 0x33, 0x24] {
            let err = TerminateRepr::parse(1, &[first, 0, 0, 0]).unwrap_err();
            assert_eq!(
                err,
                Error::RdmapMalformed("undefined Terminate layer/error type")
            );
            assert_eq!(
                err.terminate_cause(),
                TerminateCause {
                    etype: ErrorType::RdmapRemoteOperation,
                    ecode: 0xff
                }
            );
        }
        // M or R without D.
        for hdrct in [0x80, 0x20] {
            assert_eq!(
                TerminateRepr::parse(1, &[0x12, 0x03, hdrct, 0]),
                Err(Error::RdmapMalformed("Terminate M or R bit without D"))
            );
        }
        // Trailing bytes with no D.
        assert!(TerminateRepr::parse(1, &[0x12, 0x03, 0, 0, 0]).is_err());
        // D without M: the segment length is not reported.
        let mut bytes = PACKET_BYTES;
        bytes[2] = 0x40;
        let t = TerminateRepr::parse(1, &bytes).unwrap().terminated.unwrap();
        assert_eq!(t.length, None);
    }

    #[test]
    fn test_wire_values() {
        for (etype, layer, value) in [
            (ErrorType::RdmapCatastrophic, Layer::Rdmap, 0),
            (ErrorType::RdmapRemoteProtection, Layer::Rdmap, 1),
            (ErrorType::RdmapRemoteOperation, Layer::Rdmap, 2),
            (ErrorType::DdpCatastrophic, Layer::Ddp, 0),
            (ErrorType::DdpTagged, Layer::Ddp, 1),
            (ErrorType::DdpUntagged, Layer::Ddp, 2),
            (ErrorType::DdpReservedLlp, Layer::Ddp, 3),
            (ErrorType::Mpa, Layer::Llp, 0),
        ] {
            assert_eq!(etype.layer(), layer);
            assert_eq!(etype.value(), value);
            assert_eq!(ErrorType::from_wire(layer, value), Some(etype));
            assert_eq!(Layer::from_u8(layer as u8), Some(layer));
        }
        assert_eq!(Layer::from_u8(3), None);
        assert_eq!(ErrorType::from_wire(Layer::Llp, 1), None);
    }

    /// Every variant's Terminate cause, checked against the IANA RDDP
    /// registries (RFC 6580) / RFC 5040 §4.8, RFC 5041 §7, RFC 5044 §8,
    /// RFC 6581 §8 and RFC 7306 §8.2.
    #[test]
    fn test_terminate_cause_table() {
        use ErrorType::*;
        let table: &[(Error, ErrorType, u8)] = &[
            (Error::LlpClosed, Mpa, 0x01),
            (
                Error::Crc {
                    received: 0,
                    computed: 1,
                },
                Mpa,
                0x02,
            ),
            (Error::MarkerMismatch, Mpa, 0x03),
            (Error::MpaKey, Mpa, 0x04),
            (Error::MpaRevision(3), Mpa, 0x04),
            (Error::MpaMalformed("x"), Mpa, 0x04),
            (Error::MpaPrivateDataTooLong(600), Mpa, 0x04),
            (
                Error::Truncated {
                    layer: Layer::Llp,
                    need: 1,
                    have: 0,
                },
                Mpa,
                0x04,
            ),
            (Error::FpduTooLong(70000), Mpa, 0x04),
            (Error::MpaLocalCatastrophic, Mpa, 0x05),
            (Error::InsufficientIrd, Mpa, 0x06),
            (Error::NoMatchingRtr, Mpa, 0x07),
            (Error::DdpInvalidStag(1), DdpTagged, 0x00),
            (Error::DdpBaseBounds, DdpTagged, 0x01),
            (Error::DdpStagNotAssociated(1), DdpTagged, 0x02),
            (Error::DdpToWrap, DdpTagged, 0x03),
            (
                Error::DdpVersion {
                    tagged: true,
                    version: 2,
                },
                DdpTagged,
                0x04,
            ),
            (Error::InvalidQn(7), DdpUntagged, 0x01),
            (Error::NoBuffer(1), DdpUntagged, 0x02),
            (Error::MsnRange(1), DdpUntagged, 0x03),
            (Error::InvalidMo(1), DdpUntagged, 0x04),
            (Error::MessageTooLong, DdpUntagged, 0x05),
            (
                Error::DdpVersion {
                    tagged: false,
                    version: 2,
                },
                DdpUntagged,
                0x06,
            ),
            (
                Error::Truncated {
                    layer: Layer::Ddp,
                    need: 1,
                    have: 0,
                },
                DdpCatastrophic,
                0x00,
            ),
            (Error::InvalidStag(1), RdmapRemoteProtection, 0x00),
            (Error::BaseBounds, RdmapRemoteProtection, 0x01),
            (Error::AccessRights, RdmapRemoteProtection, 0x02),
            (Error::StagNotAssociated(1), RdmapRemoteProtection, 0x03),
            (Error::ToWrap, RdmapRemoteProtection, 0x04),
            (Error::CannotInvalidate(1), RdmapRemoteProtection, 0x09),
            (Error::RdmapVersion(0), RdmapRemoteOperation, 0x05),
            (Error::UnexpectedOpcode(0xe), RdmapRemoteOperation, 0x06),
            (Error::Catastrophic, RdmapRemoteOperation, 0x07),
            (Error::RdmapMalformed("x"), RdmapRemoteOperation, 0xff),
            (
                Error::Truncated {
                    layer: Layer::Rdmap,
                    need: 1,
                    have: 0,
                },
                RdmapRemoteOperation,
                0xff,
            ),
            (Error::AtomicMisaligned, RdmapRemoteOperation, 0x07),
            (Error::InvalidAtomicOpcode(3), RdmapRemoteOperation, 0x06),
            (Error::IrdExceeded, RdmapRemoteOperation, 0x07),
        ];
        for (err, etype, ecode) in table {
            assert_eq!(
                err.terminate_cause(),
                TerminateCause {
                    etype: *etype,
                    ecode: *ecode
                },
                "{err:?}"
            );
        }
    }
}
