//! RDMAP messages (RFC 5040 §4, RFC 7306 §4–§6, draft-talpey-rdma-commit
//! §4) on top of DDP segments.
//!
//! [`RdmapRepr::parse`] takes a whole ULPDU (one DDP segment) and returns the
//! typed header plus the payload; [`RdmapRepr::emit`] writes the complete
//! DDP + RDMAP header and leaves the payload to the caller. Header lengths,
//! relative to the ULPDU (siw's sizes minus its 2-byte MPA length):
//!
//! | opcode | message             | T | QN | header | payload         |
//! |--------|---------------------|---|----|--------|-----------------|
//! | 0x0    | RDMA Write          | 1 | –  | 14     | data            |
//! | 0x1    | RDMA Read Request   | 0 | 1  | 46     | none            |
//! | 0x2    | RDMA Read Response  | 1 | –  | 14     | data            |
//! | 0x3–6  | Send (SE, Inv)      | 0 | 0  | 18     | data            |
//! | 0x7    | Terminate           | 0 | 2  | 22 + copies | none       |
//! | 0x8–9  | Immediate Data (SE) | 0 | 0  | 18     | exactly 8 bytes |
//! | 0xA    | Atomic Request      | 0 | 1  | 70     | none            |
//! | 0xB    | Atomic Response     | 0 | 3  | 30     | none            |
//! | 0xC    | Commit Request      | 0 | 1  | 38     | none            |
//! | 0xD    | Commit Response     | 0 | 3  | 26     | none            |
//!
//! Validation order follows siw `siw_get_hdr`: DDP version, RDMAP version,
//! opcode; then the buffer model, length, queue number, single-segment rules
//! and payload length.

use super::atomic::AtomicOpcode;
use super::ddp::UNTAGGED_HEADER_LEN;
use super::ddp::{qn, Control, DdpHeader, DdpRepr, RDMAP_VERSION, TAGGED_HEADER_LEN};
use super::terminate::{TerminateRepr, READ_REQUEST_HEADER_LEN, TERMINATE_CONTROL_LEN};
use super::{be_u32, be_u64, Error, Field, Layer, Result};

/// ULPDU bytes of a Read Request header (siw `struct iwarp_rdma_rreq`, 48).
pub const READ_REQUEST_LEN: usize = UNTAGGED_HEADER_LEN + READ_REQUEST_HEADER_LEN;
/// ULPDU bytes of a Terminate header without copied headers (siw
/// `struct iwarp_terminate`, 24).
pub const TERMINATE_LEN: usize = UNTAGGED_HEADER_LEN + TERMINATE_CONTROL_LEN;
/// ULPDU bytes of an Atomic Request header (RFC 7306 §5.2.1: 52-byte RDMAP
/// header after the untagged DDP header).
pub const ATOMIC_REQUEST_LEN: usize = UNTAGGED_HEADER_LEN + 52;
/// ULPDU bytes of an Atomic Response header (RFC 7306 §5.2.2 Figure 6 and
/// Appendix A.2: request id and 64-bit original value; §4's "32 bytes" is
/// not what the figures show).
pub const ATOMIC_RESPONSE_LEN: usize = UNTAGGED_HEADER_LEN + 12;
/// ULPDU bytes of a Commit Request header (draft-talpey-rdma-commit §4.1:
/// request id, sink STag, length, sink TO).
pub const COMMIT_REQUEST_LEN: usize = UNTAGGED_HEADER_LEN + 20;
/// ULPDU bytes of a Commit Response header (request id, status).
pub const COMMIT_RESPONSE_LEN: usize = UNTAGGED_HEADER_LEN + 8;
/// Payload bytes of an Immediate Data message (RFC 7306 §6.3).
pub const IMMEDIATE_DATA_LEN: usize = 8;

/// RDMAP opcodes (RFC 5040 §4.3, RFC 7306 §4.1, draft-talpey-rdma-commit
/// §4). 0xE and 0xF are unassigned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// RDMA Write (0x0).
    Write = 0x0,
    /// RDMA Read Request (0x1).
    ReadRequest = 0x1,
    /// RDMA Read Response (0x2).
    ReadResponse = 0x2,
    /// Send (0x3).
    Send = 0x3,
    /// Send with Invalidate (0x4).
    SendInvalidate = 0x4,
    /// Send with Solicited Event (0x5).
    SendSe = 0x5,
    /// Send with Solicited Event and Invalidate (0x6).
    SendSeInvalidate = 0x6,
    /// Terminate (0x7).
    Terminate = 0x7,
    /// Immediate Data (0x8, RFC 7306).
    ImmediateData = 0x8,
    /// Immediate Data with Solicited Event (0x9, RFC 7306).
    ImmediateDataSe = 0x9,
    /// Atomic Request (0xA, RFC 7306).
    AtomicRequest = 0xa,
    /// Atomic Response (0xB, RFC 7306).
    AtomicResponse = 0xb,
    /// RDMA Commit Request (0xC, draft-talpey-rdma-commit).
    CommitRequest = 0xc,
    /// RDMA Commit Response (0xD, draft-talpey-rdma-commit).
    CommitResponse = 0xd,
}

impl Opcode {
    /// Decode the 4-bit opcode; 0xE/0xF draw "Unexpected OpCode".
    pub fn from_u8(value: u8) -> Result<Opcode> {
        use Opcode::*;
        Ok(match value {
            0x0 => Write,
            0x1 => ReadRequest,
            0x2 => ReadResponse,
            0x3 => Send,
            0x4 => SendInvalidate,
            0x5 => SendSe,
            0x6 => SendSeInvalidate,
            0x7 => Terminate,
            0x8 => ImmediateData,
            0x9 => ImmediateDataSe,
            0xa => AtomicRequest,
            0xb => AtomicResponse,
            0xc => CommitRequest,
            0xd => CommitResponse,
            other => return Err(Error::UnexpectedOpcode(other)),
        })
    }

    /// Whether the message uses the tagged buffer model (T set).
    pub fn is_tagged(self) -> bool {
        matches!(self, Opcode::Write | Opcode::ReadResponse)
    }

    /// The untagged queue the message goes to; `None` for tagged messages.
    pub fn queue_number(self) -> Option<u32> {
        use Opcode::*;
        match self {
            Write | ReadResponse => None,
            Send | SendInvalidate | SendSe | SendSeInvalidate | ImmediateData | ImmediateDataSe => {
                Some(qn::SEND)
            }
            ReadRequest | AtomicRequest | CommitRequest => Some(qn::READ_REQUEST),
            Terminate => Some(qn::TERMINATE),
            AtomicResponse | CommitResponse => Some(qn::ATOMIC_RESPONSE),
        }
    }

    /// Whether the message must be a single DDP segment (L set, MO 0):
    /// everything but Write, Read Response and Send.
    pub fn single_segment(self) -> bool {
        use Opcode::*;
        !matches!(
            self,
            Write | ReadResponse | Send | SendInvalidate | SendSe | SendSeInvalidate
        )
    }

    /// DDP + RDMAP header bytes at the start of the ULPDU (a Terminate's
    /// copied headers, which follow, not included).
    pub fn header_len(self) -> usize {
        use Opcode::*;
        match self {
            Write | ReadResponse => TAGGED_HEADER_LEN,
            Send | SendInvalidate | SendSe | SendSeInvalidate | ImmediateData | ImmediateDataSe => {
                UNTAGGED_HEADER_LEN
            }
            ReadRequest => READ_REQUEST_LEN,
            Terminate => TERMINATE_LEN,
            AtomicRequest => ATOMIC_REQUEST_LEN,
            AtomicResponse => ATOMIC_RESPONSE_LEN,
            CommitRequest => COMMIT_REQUEST_LEN,
            CommitResponse => COMMIT_RESPONSE_LEN,
        }
    }
}

/// The header length announced by a ULPDU's first two bytes, for a
/// streaming receiver that has read only those: checks DV, RV, the opcode
/// and that T matches it. For a Terminate this is the fixed 22 bytes; its
/// copied headers run to the end of the ULPDU.
pub fn header_len(first_two_bytes: [u8; 2]) -> Result<usize> {
    Ok(checked_opcode(Control::from_bytes(first_two_bytes))?.header_len())
}

fn checked_opcode(control: Control) -> Result<Opcode> {
    control.check_ddp_version()?;
    if control.rdmap_version() != RDMAP_VERSION {
        return Err(Error::RdmapVersion(control.rdmap_version()));
    }
    let opcode = Opcode::from_u8(control.opcode())?;
    if opcode.is_tagged() != control.tagged() {
        // RDMAP defines each opcode for one buffer model only.
        return Err(Error::UnexpectedOpcode(opcode as u8));
    }
    Ok(opcode)
}

/// Which of the four Send opcodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SendKind {
    /// Send (0x3).
    Send,
    /// Send with Invalidate (0x4).
    SendInvalidate,
    /// Send with Solicited Event (0x5).
    SendSe,
    /// Send with Solicited Event and Invalidate (0x6).
    SendSeInvalidate,
}

impl SendKind {
    /// The Send opcode of a message with (or without) the Solicited Event
    /// flag and an STag to invalidate.
    pub fn of(solicited: bool, invalidates: bool) -> SendKind {
        match (solicited, invalidates) {
            (false, false) => SendKind::Send,
            (false, true) => SendKind::SendInvalidate,
            (true, false) => SendKind::SendSe,
            (true, true) => SendKind::SendSeInvalidate,
        }
    }

    /// The opcode on the wire.
    pub fn opcode(self) -> Opcode {
        match self {
            SendKind::Send => Opcode::Send,
            SendKind::SendInvalidate => Opcode::SendInvalidate,
            SendKind::SendSe => Opcode::SendSe,
            SendKind::SendSeInvalidate => Opcode::SendSeInvalidate,
        }
    }

    /// Whether the receiver must invalidate the Invalidate STag.
    pub fn invalidates(self) -> bool {
        matches!(self, SendKind::SendInvalidate | SendKind::SendSeInvalidate)
    }

    /// Whether the Send asks for a solicited event.
    pub fn solicited(self) -> bool {
        matches!(self, SendKind::SendSe | SendKind::SendSeInvalidate)
    }
}

mod field {
    use super::Field;
    // Read Request (RFC 5040 §4.4; siw `struct iwarp_rdma_rreq`).
    pub const RR_SINK_STAG: Field = 18..22;
    pub const RR_SINK_TO: Field = 22..30;
    pub const RR_SIZE: Field = 30..34;
    pub const RR_SRC_STAG: Field = 34..38;
    pub const RR_SRC_TO: Field = 38..46;
    // Atomic Request (RFC 7306 §5.2.1 Figure 4, Appendix A.1).
    pub const AR_AOPCODE: Field = 18..22;
    pub const AR_REQ_ID: Field = 22..26;
    pub const AR_STAG: Field = 26..30;
    pub const AR_TO: Field = 30..38;
    pub const AR_ADD_SWAP: Field = 38..46;
    pub const AR_ADD_SWAP_MASK: Field = 46..54;
    pub const AR_COMPARE: Field = 54..62;
    pub const AR_COMPARE_MASK: Field = 62..70;
    // Atomic Response (RFC 7306 §5.2.2 Figure 6, Appendix A.2).
    pub const ARSP_REQ_ID: Field = 18..22;
    pub const ARSP_ORIGINAL: Field = 22..30;
    // Commit Request (draft-talpey-rdma-commit §4.1 Figure 2).
    pub const CR_REQ_ID: Field = 18..22;
    pub const CR_STAG: Field = 22..26;
    pub const CR_LEN: Field = 26..30;
    pub const CR_TO: Field = 30..38;
    // Commit Response (draft-talpey-rdma-commit §4.2 Figure 3).
    pub const CRSP_REQ_ID: Field = 18..22;
    pub const CRSP_STATUS: Field = 22..26;
    // Terminate header (RFC 5040 §4.8).
    pub const TERMINATE: usize = 18;
}

/// The typed meaning of one DDP segment carrying an RDMAP message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RdmapRepr {
    /// A segment of an RDMA Write.
    Write {
        /// L: last segment.
        last: bool,
        /// Data-sink STag.
        stag: u32,
        /// Tagged offset of this segment's payload.
        to: u64,
    },
    /// An RDMA Read Request (one segment).
    ReadRequest {
        /// MSN on QN 1.
        msn: u32,
        /// Where the Read Response goes: STag...
        sink_stag: u32,
        /// ...and tagged offset at the requester.
        sink_to: u64,
        /// Bytes to read.
        size: u32,
        /// What to read: STag...
        src_stag: u32,
        /// ...and tagged offset at the responder.
        src_to: u64,
    },
    /// A segment of an RDMA Read Response.
    ReadResponse {
        /// L: last segment.
        last: bool,
        /// Data-sink STag (the Read Request's sink STag).
        stag: u32,
        /// Tagged offset of this segment's payload.
        to: u64,
    },
    /// A segment of a Send.
    Send {
        /// Which Send opcode.
        kind: SendKind,
        /// L: last segment.
        last: bool,
        /// MSN on QN 0.
        msn: u32,
        /// Message offset.
        mo: u32,
        /// The STag to invalidate; zero unless `kind.invalidates()` (the
        /// field is reserved for the other kinds: sent as zero, ignored).
        invalidate_stag: u32,
    },
    /// A Terminate (one segment).
    Terminate(TerminateRepr),
    /// Immediate Data (RFC 7306 §6); the 8 data bytes are the payload.
    ImmediateData {
        /// With Solicited Event (opcode 0x9).
        se: bool,
        /// MSN on QN 0.
        msn: u32,
    },
    /// An Atomic Request (RFC 7306 §5.2.1, one segment).
    AtomicRequest {
        /// MSN on QN 1.
        msn: u32,
        /// FetchAdd, Swap (draft-03) or CmpSwap.
        opcode: AtomicOpcode,
        /// Request Identifier, echoed in the response.
        req_id: u32,
        /// Remote STag.
        stag: u32,
        /// Remote tagged offset.
        to: u64,
        /// Add Data or Swap Data.
        add_swap: u64,
        /// Add Mask or Swap Mask (all ones for Swap).
        add_swap_mask: u64,
        /// Compare Data (zero unless CmpSwap).
        compare: u64,
        /// Compare Mask (all ones unless CmpSwap).
        compare_mask: u64,
    },
    /// An Atomic Response (RFC 7306 §5.2.2, one segment).
    AtomicResponse {
        /// MSN on QN 3.
        msn: u32,
        /// Original Request Identifier.
        req_id: u32,
        /// Original Remote Data Value.
        original: u64,
    },
    /// An RDMA Commit Request (draft-talpey-rdma-commit §4.1, one segment).
    CommitRequest {
        /// MSN on QN 1.
        msn: u32,
        /// Request Identifier, echoed in the response.
        req_id: u32,
        /// Data-sink STag of the region to make durable.
        stag: u32,
        /// Data-sink length.
        len: u32,
        /// Data-sink tagged offset.
        to: u64,
        /// Invalidate STag: optional for a Commit Request (the draft's
        /// Table 1 "opt"); zero when none.
        invalidate_stag: u32,
    },
    /// An RDMA Commit Response (draft-talpey-rdma-commit §4.2, one segment).
    CommitResponse {
        /// MSN on QN 3.
        msn: u32,
        /// Original Request Identifier.
        req_id: u32,
        /// Zero on success; a failed commit does not terminate.
        status: u32,
    },
}

fn truncated(layer: Layer, need: usize, have: usize) -> Error {
    Error::Truncated { layer, need, have }
}

impl RdmapRepr {
    /// Parse one ULPDU (a whole DDP segment), returning the header and the
    /// payload after it. Rejects everything RFC 5040/5041/7306 and the
    /// commit draft forbid, each with the [`Error`] whose Terminate cause
    /// reports it.
    pub fn parse(ulpdu: &[u8]) -> Result<(RdmapRepr, &[u8])> {
        let control = match ulpdu {
            [a, b, ..] => Control::from_bytes([*a, *b]),
            _ => return Err(truncated(Layer::Ddp, 2, ulpdu.len())),
        };
        let opcode = checked_opcode(control)?;
        let (ddp, _) = DdpRepr::parse(ulpdu)?;
        let header_len = opcode.header_len();
        let Some(payload) = ulpdu.get(header_len..) else {
            return Err(truncated(Layer::Rdmap, header_len, ulpdu.len()));
        };
        let last = ddp.last;
        let (rsvd_ulp, msn, mo) = match ddp.header {
            DdpHeader::Tagged { stag, to } => {
                let repr = match opcode {
                    Opcode::Write => RdmapRepr::Write { last, stag, to },
                    _ => RdmapRepr::ReadResponse { last, stag, to },
                };
                return Ok((repr, payload));
            }
            DdpHeader::Untagged {
                rsvd_ulp,
                qn,
                msn,
                mo,
            } => {
                if Some(qn) != opcode.queue_number() {
                    return Err(Error::InvalidQn(qn));
                }
                (rsvd_ulp, msn, mo)
            }
        };
        if opcode.single_segment() {
            if !last {
                return Err(Error::RdmapMalformed(
                    "message must be a single DDP segment",
                ));
            }
            if mo != 0 {
                return Err(Error::InvalidMo(mo));
            }
        }
        let u32_at = |f: Field| be_u32(&ulpdu[f]);
        let u64_at = |f: Field| be_u64(&ulpdu[f]);
        let repr = match opcode {
            // T matched the opcode in `checked_opcode`, so these came back above.
            Opcode::Write | Opcode::ReadResponse => {
                return Err(Error::UnexpectedOpcode(opcode as u8))
            }
            Opcode::Send | Opcode::SendInvalidate | Opcode::SendSe | Opcode::SendSeInvalidate => {
                let kind = match opcode {
                    Opcode::Send => SendKind::Send,
                    Opcode::SendInvalidate => SendKind::SendInvalidate,
                    Opcode::SendSe => SendKind::SendSe,
                    _ => SendKind::SendSeInvalidate,
                };
                let repr = RdmapRepr::Send {
                    kind,
                    last,
                    msn,
                    mo,
                    invalidate_stag: if kind.invalidates() { rsvd_ulp } else { 0 },
                };
                return Ok((repr, payload));
            }
            Opcode::ImmediateData | Opcode::ImmediateDataSe => {
                if payload.len() != IMMEDIATE_DATA_LEN {
                    return Err(Error::RdmapMalformed(
                        "Immediate Data must carry exactly 8 bytes",
                    ));
                }
                let se = opcode == Opcode::ImmediateDataSe;
                return Ok((RdmapRepr::ImmediateData { se, msn }, payload));
            }
            Opcode::Terminate => {
                let repr = TerminateRepr::parse(msn, &ulpdu[field::TERMINATE..])?;
                return Ok((RdmapRepr::Terminate(repr), &[]));
            }
            Opcode::ReadRequest => RdmapRepr::ReadRequest {
                msn,
                sink_stag: u32_at(field::RR_SINK_STAG),
                sink_to: u64_at(field::RR_SINK_TO),
                size: u32_at(field::RR_SIZE),
                src_stag: u32_at(field::RR_SRC_STAG),
                src_to: u64_at(field::RR_SRC_TO),
            },
            Opcode::AtomicRequest => RdmapRepr::AtomicRequest {
                msn,
                // The upper 28 bits are reserved: ignored on receive.
                opcode: AtomicOpcode::from_u8((u32_at(field::AR_AOPCODE) & 0xf) as u8)?,
                req_id: u32_at(field::AR_REQ_ID),
                stag: u32_at(field::AR_STAG),
                to: u64_at(field::AR_TO),
                add_swap: u64_at(field::AR_ADD_SWAP),
                add_swap_mask: u64_at(field::AR_ADD_SWAP_MASK),
                compare: u64_at(field::AR_COMPARE),
                compare_mask: u64_at(field::AR_COMPARE_MASK),
            },
            Opcode::AtomicResponse => RdmapRepr::AtomicResponse {
                msn,
                req_id: u32_at(field::ARSP_REQ_ID),
                original: u64_at(field::ARSP_ORIGINAL),
            },
            Opcode::CommitRequest => RdmapRepr::CommitRequest {
                msn,
                req_id: u32_at(field::CR_REQ_ID),
                stag: u32_at(field::CR_STAG),
                len: u32_at(field::CR_LEN),
                to: u64_at(field::CR_TO),
                invalidate_stag: rsvd_ulp,
            },
            Opcode::CommitResponse => RdmapRepr::CommitResponse {
                msn,
                req_id: u32_at(field::CRSP_REQ_ID),
                status: u32_at(field::CRSP_STATUS),
            },
        };
        if !payload.is_empty() {
            return Err(Error::RdmapMalformed("payload after a header-only message"));
        }
        Ok((repr, payload))
    }

    /// The opcode this repr is sent with.
    pub fn opcode(&self) -> Opcode {
        match self {
            RdmapRepr::Write { .. } => Opcode::Write,
            RdmapRepr::ReadRequest { .. } => Opcode::ReadRequest,
            RdmapRepr::ReadResponse { .. } => Opcode::ReadResponse,
            RdmapRepr::Send { kind, .. } => kind.opcode(),
            RdmapRepr::Terminate(_) => Opcode::Terminate,
            RdmapRepr::ImmediateData { se: false, .. } => Opcode::ImmediateData,
            RdmapRepr::ImmediateData { se: true, .. } => Opcode::ImmediateDataSe,
            RdmapRepr::AtomicRequest { .. } => Opcode::AtomicRequest,
            RdmapRepr::AtomicResponse { .. } => Opcode::AtomicResponse,
            RdmapRepr::CommitRequest { .. } => Opcode::CommitRequest,
            RdmapRepr::CommitResponse { .. } => Opcode::CommitResponse,
        }
    }

    /// The L flag this repr is sent with.
    pub fn last(&self) -> bool {
        match *self {
            RdmapRepr::Write { last, .. }
            | RdmapRepr::ReadResponse { last, .. }
            | RdmapRepr::Send { last, .. } => last,
            _ => true,
        }
    }

    /// Bytes [`RdmapRepr::emit`] writes: the whole DDP + RDMAP header,
    /// including a Terminate's copied headers.
    pub fn header_len(&self) -> usize {
        match self {
            RdmapRepr::Terminate(t) => UNTAGGED_HEADER_LEN + t.buffer_len(),
            other => other.opcode().header_len(),
        }
    }

    /// The DDP header this repr's segment carries.
    pub fn ddp_repr(&self) -> DdpRepr {
        let untagged = |rsvd_ulp, msn, mo| DdpHeader::Untagged {
            rsvd_ulp,
            qn: self.opcode().queue_number().unwrap_or(0),
            msn,
            mo,
        };
        let header = match *self {
            RdmapRepr::Write { stag, to, .. } | RdmapRepr::ReadResponse { stag, to, .. } => {
                DdpHeader::Tagged { stag, to }
            }
            RdmapRepr::Send {
                kind,
                msn,
                mo,
                invalidate_stag,
                ..
            } => untagged(
                if kind.invalidates() {
                    invalidate_stag
                } else {
                    0
                },
                msn,
                mo,
            ),
            RdmapRepr::CommitRequest {
                msn,
                invalidate_stag,
                ..
            } => untagged(invalidate_stag, msn, 0),
            RdmapRepr::Terminate(TerminateRepr { msn, .. })
            | RdmapRepr::ReadRequest { msn, .. }
            | RdmapRepr::ImmediateData { msn, .. }
            | RdmapRepr::AtomicRequest { msn, .. }
            | RdmapRepr::AtomicResponse { msn, .. }
            | RdmapRepr::CommitResponse { msn, .. } => untagged(0, msn, 0),
        };
        DdpRepr {
            last: self.last(),
            ulp_control: RDMAP_VERSION << 6 | self.opcode() as u8,
            header,
        }
    }

    /// Write the complete DDP + RDMAP header into the first
    /// [`RdmapRepr::header_len`] bytes of `header_buf`; the caller appends
    /// the payload. Reserved fields are written as zero.
    ///
    /// # Panics
    /// If `header_buf` is shorter than [`RdmapRepr::header_len`].
    pub fn emit(&self, header_buf: &mut [u8]) {
        assert!(
            header_buf.len() >= self.header_len(),
            "RDMAP header buffer too short"
        );
        self.ddp_repr().emit(header_buf);
        let mut put32 = |f: Field, v: u32| header_buf[f].copy_from_slice(&v.to_be_bytes());
        match *self {
            RdmapRepr::ReadRequest {
                sink_stag,
                size,
                src_stag,
                ..
            } => {
                put32(field::RR_SINK_STAG, sink_stag);
                put32(field::RR_SIZE, size);
                put32(field::RR_SRC_STAG, src_stag);
            }
            RdmapRepr::AtomicRequest {
                opcode,
                req_id,
                stag,
                ..
            } => {
                put32(field::AR_AOPCODE, u32::from(opcode as u8));
                put32(field::AR_REQ_ID, req_id);
                put32(field::AR_STAG, stag);
            }
            RdmapRepr::AtomicResponse { req_id, .. } => put32(field::ARSP_REQ_ID, req_id),
            RdmapRepr::CommitRequest {
                req_id, stag, len, ..
            } => {
                put32(field::CR_REQ_ID, req_id);
                put32(field::CR_STAG, stag);
                put32(field::CR_LEN, len);
            }
            RdmapRepr::CommitResponse { req_id, status, .. } => {
                put32(field::CRSP_REQ_ID, req_id);
                put32(field::CRSP_STATUS, status);
            }
            _ => {}
        }
        let mut put64 = |f: Field, v: u64| header_buf[f].copy_from_slice(&v.to_be_bytes());
        match *self {
            RdmapRepr::ReadRequest {
                sink_to, src_to, ..
            } => {
                put64(field::RR_SINK_TO, sink_to);
                put64(field::RR_SRC_TO, src_to);
            }
            RdmapRepr::AtomicRequest {
                to,
                add_swap,
                add_swap_mask,
                compare,
                compare_mask,
                ..
            } => {
                put64(field::AR_TO, to);
                put64(field::AR_ADD_SWAP, add_swap);
                put64(field::AR_ADD_SWAP_MASK, add_swap_mask);
                put64(field::AR_COMPARE, compare);
                put64(field::AR_COMPARE_MASK, compare_mask);
            }
            RdmapRepr::AtomicResponse { original, .. } => put64(field::ARSP_ORIGINAL, original),
            RdmapRepr::CommitRequest { to, .. } => put64(field::CR_TO, to),
            RdmapRepr::Terminate(ref t) => t.emit(&mut header_buf[field::TERMINATE..]),
            _ => {}
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::wire::ddp::Untagged;
    use crate::wire::terminate::{
        TerminateCause, TerminatedDdpHeader, TerminatedRdmapHeader, TerminatedSegment,
    };
    use crate::wire::ErrorType;
    use proptest::prelude::*;

    // An RDMA Read Request as siw lays it out (`struct iwarp_rdma_rreq`,
    // iwarp.h, minus the 2-byte MPA length; control from `iwarp_pktinfo`
    // in siw_qp.c: L | DV 1 | RV 1 | opcode 1 = 0x4141): rsvd, QN 1, MSN 1,
    // MO 0, sink STag 0x11, sink TO 0x2000, size 0x100, source STag 0x22,
    // source TO 0x3000.
    static PACKET_BYTES: [u8; 46] = [
        0x41, 0x41, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, // DDP
        0, 0, 0, 0x11, 0, 0, 0, 0, 0, 0, 0x20, 0, // sink STag, TO
        0, 0, 1, 0, // size
        0, 0, 0, 0x22, 0, 0, 0, 0, 0, 0, 0x30, 0, // source STag, TO
    ];

    fn packet_repr() -> RdmapRepr {
        RdmapRepr::ReadRequest {
            msn: 1,
            sink_stag: 0x11,
            sink_to: 0x2000,
            size: 0x100,
            src_stag: 0x22,
            src_to: 0x3000,
        }
    }

    /// An untagged DDP header followed by big-endian fields.
    fn untagged(control: u16, rsvd: u32, qn: u32, msn: u32, mo: u32, rest: &[&[u8]]) -> Vec<u8> {
        let mut v = control.to_be_bytes().to_vec();
        for w in [rsvd, qn, msn, mo] {
            v.extend_from_slice(&w.to_be_bytes());
        }
        for r in rest {
            v.extend_from_slice(r);
        }
        v
    }

    fn round_trip(bytes: &[u8], repr: RdmapRepr, payload: &[u8]) {
        let (parsed, rest) = RdmapRepr::parse(bytes).unwrap();
        assert_eq!(parsed, repr);
        assert_eq!(rest, payload);
        let mut out = vec![0xa5; repr.header_len() + payload.len()];
        repr.emit(&mut out);
        out[repr.header_len()..].copy_from_slice(payload);
        assert_eq!(out, bytes);
    }

    #[test]
    fn test_deconstruct() {
        assert_eq!(header_len([PACKET_BYTES[0], PACKET_BYTES[1]]), Ok(46));
        let ddp = Untagged::new_checked(&PACKET_BYTES[..]).unwrap();
        assert_eq!(ddp.control().opcode(), Opcode::ReadRequest as u8);
        assert_eq!((ddp.qn(), ddp.msn(), ddp.mo()), (qn::READ_REQUEST, 1, 0));
        assert_eq!(be_u32(&PACKET_BYTES[field::RR_SIZE]), 0x100);
        assert_eq!(be_u64(&PACKET_BYTES[field::RR_SRC_TO]), 0x3000);
    }

    #[test]
    fn test_construct() {
        let mut bytes = [0xa5; 46];
        packet_repr().emit(&mut bytes);
        assert_eq!(bytes, PACKET_BYTES);
    }

    #[test]
    fn test_parse() {
        let (repr, payload) = RdmapRepr::parse(&PACKET_BYTES).unwrap();
        assert_eq!(repr, packet_repr());
        assert!(payload.is_empty());
    }

    #[test]
    fn test_emit() {
        let repr = packet_repr();
        assert_eq!(repr.header_len(), READ_REQUEST_LEN);
        let mut bytes = [0xa5; READ_REQUEST_LEN];
        repr.emit(&mut bytes);
        assert_eq!(bytes, PACKET_BYTES);
    }

    #[test]
    fn test_truncated() {
        for len in 0..PACKET_BYTES.len() {
            let err = RdmapRepr::parse(&PACKET_BYTES[..len]).unwrap_err();
            let layer = if len < UNTAGGED_HEADER_LEN {
                Layer::Ddp
            } else {
                Layer::Rdmap
            };
            assert_eq!(
                err,
                Error::Truncated {
                    layer,
                    need: if len < 2 {
                        2
                    } else if len < 18 {
                        18
                    } else {
                        46
                    },
                    have: len
                }
            );
        }
        assert_eq!(
            Error::Truncated {
                layer: Layer::Rdmap,
                need: 46,
                have: 20
            }
            .terminate_cause(),
            TerminateCause {
                etype: ErrorType::RdmapRemoteOperation,
                ecode: 0xff
            }
        );
    }

    #[test]
    fn test_write_rtr() {
        // siw's peer-to-peer RTR: a zero-length Write, STag 1, TO 0
        // (siw_qp.c `siw_qp_mpa_rts`), control 0xC140.
        let bytes = [0xc1, 0x40, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0];
        round_trip(
            &bytes,
            RdmapRepr::Write {
                last: true,
                stag: 1,
                to: 0,
            },
            &[],
        );
        // A middle Read Response segment with payload (T set, L clear).
        let bytes = [0x81, 0x42, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0x10, 0, 1, 2, 3];
        round_trip(
            &bytes,
            RdmapRepr::ReadResponse {
                last: false,
                stag: 9,
                to: 0x1000,
            },
            &[1, 2, 3],
        );
    }

    #[test]
    fn test_sends() {
        // siw `struct iwarp_send`: last Send 0x4143, MSN 1 ("hi").
        let bytes = untagged(0x4143, 0, 0, 1, 0, &[b"hi"]);
        let repr = RdmapRepr::Send {
            kind: SendKind::Send,
            last: true,
            msn: 1,
            mo: 0,
            invalidate_stag: 0,
        };
        round_trip(&bytes, repr, b"hi");
        // siw `struct iwarp_send_inv`: Send with SE and Invalidate, middle
        // segment, Invalidate STag in the RsvdULP word.
        let bytes = untagged(0x0146, 0xdead_beef, 0, 2, 0x10, &[b"x"]);
        let repr = RdmapRepr::Send {
            kind: SendKind::SendSeInvalidate,
            last: false,
            msn: 2,
            mo: 0x10,
            invalidate_stag: 0xdead_beef,
        };
        round_trip(&bytes, repr, b"x");
        // Plain Send: the reserved word is ignored on receive.
        let bytes = untagged(0x4145, 0x1234, 0, 1, 0, &[]);
        let (repr, _) = RdmapRepr::parse(&bytes).unwrap();
        assert!(matches!(
            repr,
            RdmapRepr::Send {
                kind: SendKind::SendSe,
                invalidate_stag: 0,
                ..
            }
        ));
        assert!(SendKind::SendSe.solicited() && !SendKind::SendSe.invalidates());
    }

    #[test]
    fn test_terminate() {
        // A whole siw Terminate ULPDU (siw_send_terminate: QN 2, MSN 1,
        // MO 0, control 0x4147, then the Terminate header for an invalid
        // MSN on a 4-byte Send with MSN 5); 42 = siw's mpa_len.
        let send = untagged(0x4143, 0, 0, 5, 0, &[]);
        let bytes = untagged(
            0x4147,
            0,
            2,
            1,
            0,
            &[&[0x12, 0x03, 0xc0, 0x00, 0x00, 0x04], &send],
        );
        assert_eq!(bytes.len(), 42);
        let repr = RdmapRepr::Terminate(TerminateRepr {
            msn: 1,
            cause: TerminateCause {
                etype: ErrorType::DdpUntagged,
                ecode: 0x03,
            },
            terminated: Some(TerminatedSegment {
                length: Some(4),
                ddp_header: TerminatedDdpHeader::Untagged(send.try_into().unwrap()),
                rdmap_header: TerminatedRdmapHeader::NotIncluded,
            }),
        });
        round_trip(&bytes, repr, &[]);
        assert_eq!(header_len([0x41, 0x47]), Ok(TERMINATE_LEN));
        // A Terminate header error surfaces from the RDMAP parse.
        let bytes = untagged(0x4147, 0, 2, 1, 0, &[&[0x30, 0, 0, 0]]);
        assert!(matches!(
            RdmapRepr::parse(&bytes),
            Err(Error::RdmapMalformed(_))
        ));
    }

    #[test]
    fn test_immediate_data() {
        // RFC 7306 Appendix A.3: untagged header on QN 0, then 8 bytes.
        let data = 0x0102_0304_0506_0708u64.to_be_bytes();
        let bytes = untagged(0x4149, 0, 0, 3, 0, &[&data]);
        round_trip(&bytes, RdmapRepr::ImmediateData { se: true, msn: 3 }, &data);
        for len in [0, 7, 9] {
            let bytes = untagged(0x4148, 0, 0, 3, 0, &[&vec![0; len]]);
            let err = RdmapRepr::parse(&bytes).unwrap_err();
            assert_eq!(
                err,
                Error::RdmapMalformed("Immediate Data must carry exactly 8 bytes")
            );
            assert_eq!(err.terminate_cause().ecode, 0xff);
        }
    }

    fn atomic_request_bytes(aopcode: u32) -> Vec<u8> {
        // RFC 7306 Appendix A.1 / Figure 4.
        untagged(
            0x414a,
            0,
            1,
            1,
            0,
            &[
                &aopcode.to_be_bytes(),
                &7u32.to_be_bytes(),
                &0x100u32.to_be_bytes(),
                &8u64.to_be_bytes(),
                &1u64.to_be_bytes(),
                &0u64.to_be_bytes(),
                &0u64.to_be_bytes(),
                &u64::MAX.to_be_bytes(),
            ],
        )
    }

    #[test]
    fn test_atomics() {
        let bytes = atomic_request_bytes(0);
        assert_eq!(bytes.len(), ATOMIC_REQUEST_LEN);
        let repr = RdmapRepr::AtomicRequest {
            msn: 1,
            opcode: AtomicOpcode::FetchAdd,
            req_id: 7,
            stag: 0x100,
            to: 8,
            add_swap: 1,
            add_swap_mask: 0,
            compare: 0,
            compare_mask: u64::MAX,
        };
        round_trip(&bytes, repr, &[]);
        // The 28 reserved bits above AOpCode are ignored.
        let (repr, _) = RdmapRepr::parse(&atomic_request_bytes(0xffff_fff2)).unwrap();
        assert!(matches!(
            repr,
            RdmapRepr::AtomicRequest {
                opcode: AtomicOpcode::CmpSwap,
                ..
            }
        ));
        // draft-ietf-storm-rdmap-ext-03 Swap (0x1) is accepted.
        let (repr, _) = RdmapRepr::parse(&atomic_request_bytes(1)).unwrap();
        assert!(matches!(
            repr,
            RdmapRepr::AtomicRequest {
                opcode: AtomicOpcode::Swap,
                ..
            }
        ));
        // Reserved AOpCode.
        let err = RdmapRepr::parse(&atomic_request_bytes(3)).unwrap_err();
        assert_eq!(err, Error::InvalidAtomicOpcode(3));
        assert_eq!(
            err.terminate_cause(),
            TerminateCause {
                etype: ErrorType::RdmapRemoteOperation,
                ecode: 0x06
            }
        );
        // RFC 7306 Appendix A.2: Atomic Response on QN 3.
        let bytes = untagged(
            0x414b,
            0,
            3,
            1,
            0,
            &[&7u32.to_be_bytes(), &42u64.to_be_bytes()],
        );
        assert_eq!(bytes.len(), ATOMIC_RESPONSE_LEN);
        round_trip(
            &bytes,
            RdmapRepr::AtomicResponse {
                msn: 1,
                req_id: 7,
                original: 42,
            },
            &[],
        );
    }

    #[test]
    fn test_commit() {
        // draft-talpey-rdma-commit §4.1 Figure 2 (with the MO every untagged
        // DDP header has; the appendix figure leaves it out).
        let bytes = untagged(
            0x414c,
            0x55,
            1,
            2,
            0,
            &[
                &9u32.to_be_bytes(),
                &0x100u32.to_be_bytes(),
                &0x1000u32.to_be_bytes(),
                &0x2000u64.to_be_bytes(),
            ],
        );
        assert_eq!(bytes.len(), COMMIT_REQUEST_LEN);
        let repr = RdmapRepr::CommitRequest {
            msn: 2,
            req_id: 9,
            stag: 0x100,
            len: 0x1000,
            to: 0x2000,
            invalidate_stag: 0x55,
        };
        round_trip(&bytes, repr, &[]);
        // §4.2 Figure 3: Commit Response on QN 3.
        let bytes = untagged(
            0x414d,
            0,
            3,
            1,
            0,
            &[&9u32.to_be_bytes(), &5u32.to_be_bytes()],
        );
        assert_eq!(bytes.len(), COMMIT_RESPONSE_LEN);
        round_trip(
            &bytes,
            RdmapRepr::CommitResponse {
                msn: 1,
                req_id: 9,
                status: 5,
            },
            &[],
        );
    }

    #[test]
    fn test_header_len_table() {
        let expect = [
            (0xc140, 14),
            (0x4141, 46),
            (0xc142, 14),
            (0x4143, 18),
            (0x4144, 18),
            (0x4145, 18),
            (0x4146, 18),
            (0x4147, 22),
            (0x4148, 18),
            (0x4149, 18),
            (0x414a, 70),
            (0x414b, 30),
            (0x414c, 38),
            (0x414d, 26),
        ];
        for (word, len) in expect {
            assert_eq!(header_len(Control(word).to_bytes()), Ok(len), "{word:#x}");
            // siw counts its header sizes with the 2-byte MPA length.
            let op = Opcode::from_u8((word & 0xf) as u8).unwrap();
            assert_eq!(op.header_len(), len);
            assert_eq!(op.is_tagged(), word & 0x8000 != 0);
        }
        assert_eq!(Opcode::Write.header_len() + 2, 16);
        assert_eq!(Opcode::Send.header_len() + 2, 20);
        assert_eq!(Opcode::ReadRequest.header_len() + 2, 48);
        assert_eq!(Opcode::Terminate.header_len() + 2, 24);
        assert_eq!(Opcode::AtomicRequest.queue_number(), Some(1));
        assert_eq!(Opcode::AtomicResponse.queue_number(), Some(3));
        assert_eq!(Opcode::CommitRequest.queue_number(), Some(1));
        assert_eq!(Opcode::CommitResponse.queue_number(), Some(3));
        assert_eq!(Opcode::ImmediateData.queue_number(), Some(0));
        assert_eq!(Opcode::Terminate.queue_number(), Some(2));
        assert_eq!(Opcode::Write.queue_number(), None);
    }

    #[test]
    fn test_rejects() {
        let remote_op = |ecode| TerminateCause {
            etype: ErrorType::RdmapRemoteOperation,
            ecode,
        };
        // siw_get_hdr order: DDP version first (untagged 0x1/0x2/0x06).
        let err = header_len([0x42, 0x83]).unwrap_err();
        assert_eq!(
            err,
            Error::DdpVersion {
                tagged: false,
                version: 2
            }
        );
        // RDMAP version (RV 2): 0x0/0x2/0x05.
        let err = header_len([0x41, 0x83]).unwrap_err();
        assert_eq!(err, Error::RdmapVersion(2));
        assert_eq!(err.terminate_cause(), remote_op(0x05));
        // Unassigned opcodes 0xE/0xF: 0x0/0x2/0x06 (siw rejects >= 0x8 the same way).
        for word in [0x414e, 0x414f] {
            let err = header_len(Control(word).to_bytes()).unwrap_err();
            assert_eq!(err, Error::UnexpectedOpcode((word & 0xf) as u8));
            assert_eq!(err.terminate_cause(), remote_op(0x06));
        }
        // T flag not matching the opcode.
        assert_eq!(header_len([0xc1, 0x43]), Err(Error::UnexpectedOpcode(3)));
        assert_eq!(header_len([0x41, 0x40]), Err(Error::UnexpectedOpcode(0)));
        // Wrong queue: 0x1/0x2/0x01.
        let bytes = untagged(0x4143, 0, 1, 1, 0, &[]);
        let err = RdmapRepr::parse(&bytes).unwrap_err();
        assert_eq!(err, Error::InvalidQn(1));
        assert_eq!(
            err.terminate_cause(),
            TerminateCause {
                etype: ErrorType::DdpUntagged,
                ecode: 0x01
            }
        );
        let bytes = untagged(0x414b, 0, 1, 1, 0, &[&[0; 12]]);
        assert_eq!(RdmapRepr::parse(&bytes), Err(Error::InvalidQn(1)));
        // Single-segment messages: L must be set, MO must be 0.
        let mut bytes = PACKET_BYTES;
        bytes[0] = 0x01;
        let err = RdmapRepr::parse(&bytes).unwrap_err();
        assert_eq!(
            err,
            Error::RdmapMalformed("message must be a single DDP segment")
        );
        assert_eq!(err.terminate_cause(), remote_op(0xff));
        let mut bytes = PACKET_BYTES;
        bytes[17] = 4;
        let err = RdmapRepr::parse(&bytes).unwrap_err();
        assert_eq!(err, Error::InvalidMo(4));
        // No payload after a Read Request.
        let mut bytes = PACKET_BYTES.to_vec();
        bytes.push(0);
        assert_eq!(
            RdmapRepr::parse(&bytes),
            Err(Error::RdmapMalformed("payload after a header-only message"))
        );
        // A short ULPDU.
        assert_eq!(
            RdmapRepr::parse(&[0x41]),
            Err(Error::Truncated {
                layer: Layer::Ddp,
                need: 2,
                have: 1
            })
        );
        // Bad DDP version through parse, tagged.
        let err = RdmapRepr::parse(&[0xc0, 0x40, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]).unwrap_err();
        assert_eq!(
            err,
            Error::DdpVersion {
                tagged: true,
                version: 0
            }
        );
    }

    fn arb_terminate() -> impl Strategy<Value = TerminateRepr> {
        let etype = prop::sample::select(vec![
            ErrorType::RdmapCatastrophic,
            ErrorType::RdmapRemoteProtection,
            ErrorType::RdmapRemoteOperation,
            ErrorType::DdpCatastrophic,
            ErrorType::DdpTagged,
            ErrorType::DdpUntagged,
            ErrorType::DdpReservedLlp,
            ErrorType::Mpa,
        ]);
        let ddp_header = prop_oneof![
            any::<[u8; 14]>().prop_map(|mut b| {
                b[0] |= 0x80;
                TerminatedDdpHeader::Tagged(b)
            }),
            any::<[u8; 18]>().prop_map(|mut b| {
                b[0] &= 0x7f;
                TerminatedDdpHeader::Untagged(b)
            }),
        ];
        let rdmap_header = prop_oneof![
            Just(TerminatedRdmapHeader::NotIncluded),
            Just(TerminatedRdmapHeader::FlagOnly),
            any::<[u8; 28]>().prop_map(TerminatedRdmapHeader::ReadRequest),
        ];
        let segment = (any::<Option<u16>>(), ddp_header, rdmap_header).prop_map(
            |(length, ddp_header, rdmap_header)| TerminatedSegment {
                length,
                ddp_header,
                rdmap_header,
            },
        );
        (
            any::<u32>(),
            etype,
            any::<u8>(),
            proptest::option::of(segment),
        )
            .prop_map(|(msn, etype, ecode, terminated)| TerminateRepr {
                msn,
                cause: TerminateCause { etype, ecode },
                terminated,
            })
    }

    fn arb_repr() -> impl Strategy<Value = RdmapRepr> {
        let kind = prop::sample::select(vec![
            SendKind::Send,
            SendKind::SendInvalidate,
            SendKind::SendSe,
            SendKind::SendSeInvalidate,
        ]);
        let aop = prop::sample::select(vec![
            AtomicOpcode::FetchAdd,
            AtomicOpcode::Swap,
            AtomicOpcode::CmpSwap,
        ]);
        prop_oneof![
            (any::<bool>(), any::<u32>(), any::<u64>())
                .prop_map(|(last, stag, to)| RdmapRepr::Write { last, stag, to }),
            (any::<bool>(), any::<u32>(), any::<u64>())
                .prop_map(|(last, stag, to)| RdmapRepr::ReadResponse { last, stag, to }),
            (
                any::<u32>(),
                any::<u32>(),
                any::<u64>(),
                any::<u32>(),
                any::<u32>(),
                any::<u64>()
            )
                .prop_map(|(msn, sink_stag, sink_to, size, src_stag, src_to)| {
                    RdmapRepr::ReadRequest {
                        msn,
                        sink_stag,
                        sink_to,
                        size,
                        src_stag,
                        src_to,
                    }
                }),
            (
                kind,
                any::<bool>(),
                any::<u32>(),
                any::<u32>(),
                any::<u32>()
            )
                .prop_map(|(kind, last, msn, mo, stag)| RdmapRepr::Send {
                    kind,
                    last,
                    msn,
                    mo,
                    invalidate_stag: if kind.invalidates() { stag } else { 0 },
                }),
            arb_terminate().prop_map(RdmapRepr::Terminate),
            (any::<bool>(), any::<u32>())
                .prop_map(|(se, msn)| RdmapRepr::ImmediateData { se, msn }),
            (aop, any::<[u32; 3]>(), any::<[u64; 5]>()).prop_map(|(opcode, w, d)| {
                RdmapRepr::AtomicRequest {
                    msn: w[0],
                    opcode,
                    req_id: w[1],
                    stag: w[2],
                    to: d[0],
                    add_swap: d[1],
                    add_swap_mask: d[2],
                    compare: d[3],
                    compare_mask: d[4],
                }
            }),
            (any::<u32>(), any::<u32>(), any::<u64>()).prop_map(|(msn, req_id, original)| {
                RdmapRepr::AtomicResponse {
                    msn,
                    req_id,
                    original,
                }
            }),
            (any::<[u32; 5]>(), any::<u64>()).prop_map(|(w, to)| RdmapRepr::CommitRequest {
                msn: w[0],
                req_id: w[1],
                stag: w[2],
                len: w[3],
                to,
                invalidate_stag: w[4],
            }),
            (any::<u32>(), any::<u32>(), any::<u32>()).prop_map(|(msn, req_id, status)| {
                RdmapRepr::CommitResponse {
                    msn,
                    req_id,
                    status,
                }
            }),
        ]
    }

    proptest! {
        #[test]
        fn prop_emit_parse_round_trip(repr in arb_repr(), data in proptest::collection::vec(any::<u8>(), 0..16)) {
            let payload: &[u8] = match repr {
                RdmapRepr::Write { .. } | RdmapRepr::ReadResponse { .. } | RdmapRepr::Send { .. } => &data,
                RdmapRepr::ImmediateData { .. } => &[7; 8],
                _ => &[],
            };
            let mut buf = vec![0xa5; repr.header_len() + payload.len()];
            repr.emit(&mut buf);
            buf[repr.header_len()..].copy_from_slice(payload);
            prop_assert_eq!(header_len([buf[0], buf[1]]), Ok(repr.opcode().header_len()));
            let (parsed, rest) = RdmapRepr::parse(&buf).unwrap();
            prop_assert_eq!(parsed, repr);
            prop_assert_eq!(rest, payload);
            // Every truncation of a header fails.
            for len in 0..repr.header_len() {
                if let Ok((short, _)) = RdmapRepr::parse(&buf[..len]) {
                    // Only a Terminate cut right after its copied DDP
                    // header still parses (R set, no RDMA header).
                    prop_assert!(matches!(short, RdmapRepr::Terminate(_)));
                }
            }
        }

        #[test]
        fn prop_parse_arbitrary(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
            if let Ok((repr, payload)) = RdmapRepr::parse(&bytes) {
                let mut buf = vec![0; repr.header_len() + payload.len()];
                repr.emit(&mut buf);
                buf[repr.header_len()..].copy_from_slice(payload);
                let (again, payload2) = RdmapRepr::parse(&buf).unwrap();
                prop_assert_eq!(again, repr);
                prop_assert_eq!(payload2, payload);
            }
        }
    }
}
