//! stag's own wire formats above the verbs, in the style of the
//! provider's `wire` module: a zero-copy `Packet` view with checked
//! accessors, and a `Repr` that is parsed from it and emitted into one.
//!
//! - [`hello`]: the header stag puts in front of a connection's private
//!   data (what the sender's device runs natively, the agent channel).
//! - [`agent`]: the 64-byte messages of the agent channel.
//!
//! Integers are little-endian. Operation codes are [`OpKind::code`]s and
//! agent opcodes, both written out, never positions in a list.
//!
//! [`OpKind::code`]: crate::OpKind::code

pub mod agent;
pub mod hello;

/// Why bytes are not a message of ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// Shorter than the fields need.
    #[error("truncated: {got} bytes, {need} needed")]
    Truncated {
        /// Bytes present.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// Not stag's magic.
    #[error("no stag magic")]
    Magic,
    /// A version this build does not speak.
    #[error("unknown version {0}")]
    Version(u8),
    /// An unknown message kind.
    #[error("unknown message kind {0}")]
    Kind(u8),
    /// An unknown operation code.
    #[error("unknown operation code {0}")]
    Op(u8),
}

/// The four bytes every stag header and message starts with.
pub const MAGIC: [u8; 4] = *b"STAG";

pub(crate) fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

pub(crate) fn le32(b: &[u8], at: usize) -> u32 {
    let mut w = [0; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

pub(crate) fn le64(b: &[u8], at: usize) -> u64 {
    let mut w = [0; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn check_len(got: usize, need: usize) -> Result<(), WireError> {
    if got < need {
        Err(WireError::Truncated { got, need })
    } else {
        Ok(())
    }
}
