//! Terminate causes: the layer / error type / error code triple of an RDMAP
//! Terminate message (RFC 5040 §4.8), and the mapping from [`Error`].

use super::Error;

/// The layer that detected the error (Terminate Control, bits 0..3).
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
    pub fn terminate_cause(&self) -> TerminateCause {
        use ErrorType::*;
        let (etype, ecode) = match *self {
            // RFC 5044 §8 / RFC 6581 §5 (LLP, error type MPA).
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
            // RFC 5040 §4.8 (RDMAP), RFC 7306 §8.
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
            Error::AtomicMisaligned => (RdmapRemoteOperation, 0x0a),
            Error::InvalidAtomicOpcode(_) => (RdmapRemoteOperation, 0x0b),
            Error::IrdExceeded => (RdmapRemoteOperation, 0x07),
        };
        TerminateCause { etype, ecode }
    }
}
