//! `STGS`: `stag scale`'s plan, in front of every connection's private
//! data.
//!
//! ```text
//!  0      4   5   6     8          12       14
//! +------+---+---+-----+----------+--------+
//! | STGS | 1 | 0 | qps | idle ms  | index  |
//! +------+---+---+-----+----------+--------+
//! ```
//!
//! qps is at least 1 and index below it.

use super::{be16, be32, check, WireError};

/// The magic.
pub const MAGIC: &[u8; 4] = b"STGS";
/// The only version.
pub const VERSION: u8 = 1;
/// Bytes of the message.
pub const LEN: usize = 14;
const WHAT: &str = "scale hello";

/// A view of the message.
#[derive(Debug, Clone, Copy)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// The view, after checking length, magic and version.
    pub fn new_checked(buffer: T) -> Result<Packet<T>, WireError> {
        check(buffer.as_ref(), WHAT, LEN, MAGIC, VERSION)?;
        Ok(Packet { buffer })
    }
    /// QPs the client connects.
    pub fn qps(&self) -> u16 {
        be16(self.buffer.as_ref(), 6)
    }
    /// The idle period in milliseconds.
    pub fn idle_ms(&self) -> u32 {
        be32(self.buffer.as_ref(), 8)
    }
    /// This connection's index (0 for the first).
    pub fn index(&self) -> u16 {
        be16(self.buffer.as_ref(), 12)
    }
}

/// The message, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// QPs the client connects (at least 1).
    pub qps: u16,
    /// The idle period.
    pub idle_ms: u32,
    /// This connection's index.
    pub index: u16,
}

impl Repr {
    /// Parse a checked view.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr, WireError> {
        let r = Repr {
            qps: p.qps(),
            idle_ms: p.idle_ms(),
            index: p.index(),
        };
        if r.qps == 0 || r.index >= r.qps {
            return Err(WireError::Field {
                what: WHAT,
                why: format!("{r:?}"),
            });
        }
        Ok(r)
    }

    /// Parse private data.
    pub fn decode(b: &[u8]) -> Result<Repr, WireError> {
        Repr::parse(&Packet::new_checked(b)?)
    }

    /// The message's bytes.
    pub fn encode(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[..4].copy_from_slice(MAGIC);
        b[4] = VERSION;
        b[6..8].copy_from_slice(&self.qps.to_be_bytes());
        b[8..12].copy_from_slice(&self.idle_ms.to_be_bytes());
        b[12..14].copy_from_slice(&self.index.to_be_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_as_drawn() {
        let r = Repr {
            qps: 1024,
            idle_ms: 5000,
            index: 7,
        };
        assert_eq!(
            r.encode(),
            [b'S', b'T', b'G', b'S', 1, 0, 0x04, 0x00, 0, 0, 0x13, 0x88, 0, 7]
        );
        assert_eq!(Repr::decode(&r.encode()).unwrap(), r);
    }

    #[test]
    fn bad_messages_are_errors() {
        let good = Repr {
            qps: 2,
            idle_ms: 0,
            index: 1,
        }
        .encode();
        assert!(matches!(
            Repr::decode(&good[..LEN - 1]),
            Err(WireError::Truncated { .. })
        ));
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(Repr::decode(&b), Err(WireError::Magic { .. })));
        let mut b = good;
        b[4] = 2;
        assert!(matches!(Repr::decode(&b), Err(WireError::Version { .. })));
        let mut b = good;
        b[13] = 2;
        assert!(matches!(Repr::decode(&b), Err(WireError::Field { .. })));
    }
}
