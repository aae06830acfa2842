//! Wire codecs for the iWARP stack, in the smoltcp `wire` style.
//!
//! Each frame type has a `Packet<T: AsRef<[u8]>>`-like view: `new_unchecked`
//! only wraps, `check_len` verifies every length the header claims,
//! `new_checked` does both, and after that no getter panics. Each has a
//! `Repr` with `parse` (rejects what the protocol forbids), `emit` (writes
//! every field) and `buffer_len`.
//!
//! Every failure is an [`Error`], and every [`Error`] knows the Terminate
//! layer, error type and error code (RFC 5040 §4.8, RFC 5041 §7, RFC 5044 §8,
//! RFC 6581 §5, RFC 7306 §8) that a Terminate message reporting it carries.
//!
//! Offsets in the DDP and RDMAP views are relative to the start of the
//! ULPDU, i.e. the byte after MPA's 2-byte ULPDU_Length field. Header sizes
//! "including the length field" as kernel siw counts them are those plus 2.

pub mod atomic;
pub mod ddp;
pub mod fpdu;
pub mod marker;
pub mod mpa;
pub mod rdmap;
pub mod stream;
pub mod terminate;

pub use terminate::{ErrorType, TerminateCause};

/// The protocol layer an error belongs to, as the Terminate Control field
/// names it (bits 0..3). It lives here, beside [`Error`], because every
/// layer's codec reports errors by it; `terminate` only encodes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Layer {
    /// RDMAP (0x0).
    Rdmap = 0x0,
    /// DDP (0x1).
    Ddp = 0x1,
    /// The lower-layer protocol, MPA over TCP (0x2).
    Llp = 0x2,
}

impl Layer {
    /// Decode the 4-bit layer field; 0x3..0xF are not defined.
    pub fn from_u8(value: u8) -> Option<Layer> {
        match value {
            0x0 => Some(Layer::Rdmap),
            0x1 => Some(Layer::Ddp),
            0x2 => Some(Layer::Llp),
            _ => None,
        }
    }
}

/// A byte range inside a header.
pub(crate) type Field = core::ops::Range<usize>;
/// The bytes from an offset to the end of the buffer.
pub(crate) type Rest = core::ops::RangeFrom<usize>;

/// Read a big-endian `u16` from exactly two bytes.
#[inline]
pub(crate) fn be_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

/// Read a big-endian `u32` from exactly four bytes.
#[inline]
pub(crate) fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// Read a big-endian `u64` from exactly eight bytes.
#[inline]
pub(crate) fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// The result of a wire operation.
pub type Result<T> = core::result::Result<T, Error>;

/// Everything that can be wrong with bytes received from a peer, or with what
/// they ask us to do. Each variant maps to the Terminate it draws
/// ([`Error::terminate_cause`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- LLP (MPA, RFC 5044 / RFC 6581) ----
    /// Fewer bytes than the header or its length fields claim.
    #[error("truncated {layer:?} frame: need {need} bytes, have {have}")]
    Truncated {
        layer: Layer,
        need: usize,
        have: usize,
    },
    /// An MPA Request/Reply whose key is not "MPA ID Req Frame"/"MPA ID Rep Frame".
    #[error("bad MPA key")]
    MpaKey,
    /// An MPA revision we do not speak (only 1 and 2 exist).
    #[error("unsupported MPA revision {0}")]
    MpaRevision(u8),
    /// A malformed MPA Request/Reply (reserved bits, enhanced without rev 2, …).
    #[error("malformed MPA request/reply: {0}")]
    MpaMalformed(&'static str),
    /// Private data longer than the MPA maximum (512 octets, RFC 5044 §7.1).
    #[error("MPA private data too long: {0} bytes")]
    MpaPrivateDataTooLong(usize),
    /// The MPA CRC of an FPDU does not match.
    #[error("MPA CRC error: received {received:#010x}, computed {computed:#010x}")]
    Crc { received: u32, computed: u32 },
    /// A marker that does not point back to the start of the current FPDU.
    #[error("MPA marker does not point to the FPDU start")]
    MarkerMismatch,
    /// An FPDU longer than the receiver accepts.
    #[error("FPDU of {0} bytes exceeds the limit")]
    FpduTooLong(usize),
    /// RFC 6581: the responder cannot supply the IRD the initiator needs.
    #[error("insufficient IRD resources")]
    InsufficientIrd,
    /// RFC 6581: no RTR model both peers support.
    #[error("no matching RTR model")]
    NoMatchingRtr,
    /// The TCP connection closed, reset or was lost.
    #[error("TCP connection closed")]
    LlpClosed,
    /// RFC 6581 §9.3: a local error during enhanced connection setup that no
    /// more specific MPA error code describes (e.g. no RTR model configured).
    #[error("local catastrophic error during MPA connection setup")]
    MpaLocalCatastrophic,

    // ---- DDP (RFC 5041 §7) ----
    /// DDP version (DV) other than 1.
    #[error("invalid DDP version {version} ({}tagged)", if *.tagged { "" } else { "un" })]
    DdpVersion { tagged: bool, version: u8 },
    /// Tagged: the STag is not valid.
    #[error("invalid STag {0:#010x} (DDP)")]
    DdpInvalidStag(u32),
    /// Tagged: base or bounds violation.
    #[error("DDP tagged base or bounds violation")]
    DdpBaseBounds,
    /// Tagged: STag not associated with this DDP stream (PD mismatch).
    #[error("STag {0:#010x} not associated with the DDP stream")]
    DdpStagNotAssociated(u32),
    /// Tagged: TO wrap.
    #[error("DDP tagged offset wrap")]
    DdpToWrap,
    /// Untagged: invalid queue number.
    #[error("invalid DDP queue number {0}")]
    InvalidQn(u32),
    /// Untagged: MSN with no buffer available.
    #[error("no receive buffer for MSN {0}")]
    NoBuffer(u32),
    /// Untagged: MSN outside the valid range.
    #[error("MSN {0} out of range")]
    MsnRange(u32),
    /// Untagged: invalid message offset.
    #[error("invalid DDP message offset {0}")]
    InvalidMo(u32),
    /// Untagged: message too long for the available buffer.
    #[error("DDP message too long for the receive buffer")]
    MessageTooLong,

    // ---- RDMAP (RFC 5040 §4.8, RFC 7306 §8, commit draft) ----
    /// RDMAP version (RV) other than 1.
    #[error("invalid RDMAP version {0}")]
    RdmapVersion(u8),
    /// An opcode that is reserved or not expected here.
    #[error("unexpected RDMAP opcode {0:#x}")]
    UnexpectedOpcode(u8),
    /// RDMAP: invalid STag.
    #[error("invalid STag {0:#010x}")]
    InvalidStag(u32),
    /// RDMAP: base or bounds violation.
    #[error("base or bounds violation")]
    BaseBounds,
    /// RDMAP: access rights violation.
    #[error("access rights violation")]
    AccessRights,
    /// RDMAP: STag not associated with this RDMAP stream (PD mismatch).
    #[error("STag {0:#010x} not associated with the RDMAP stream")]
    StagNotAssociated(u32),
    /// RDMAP: TO wrap.
    #[error("tagged offset wrap")]
    ToWrap,
    /// RDMAP: the STag cannot be invalidated.
    #[error("STag {0:#010x} cannot be invalidated")]
    CannotInvalidate(u32),
    /// RFC 7306: an atomic operation whose target is not 64-bit aligned.
    #[error("atomic target not 8-byte aligned")]
    AtomicMisaligned,
    /// RFC 7306: reserved/unknown atomic opcode.
    #[error("invalid atomic opcode {0:#x}")]
    InvalidAtomicOpcode(u32),
    /// RFC 7306: more outstanding atomic/read requests than IRD allows.
    #[error("too many outstanding requests (IRD exceeded)")]
    IrdExceeded,
    /// An RDMAP header field the protocol forbids (length, reserved value).
    #[error("malformed RDMAP header: {0}")]
    RdmapMalformed(&'static str),
    /// Catastrophic error localized to this stream (local failure).
    #[error("catastrophic error localized to the RDMAP stream")]
    Catastrophic,
}
