//! `STGF`: the header `stag floor`'s client sends first on every stream.
//!
//! ```text
//!  0      4   5    6        8      12      16      18  20
//! +------+---+----+--------+------+-------+-------+---+
//! | STGF | 1 |test|streams | size | iters | index | 0 |
//! +------+---+----+--------+------+-------+-------+---+
//! ```
//!
//! test: 0 ping-pong, 1 stream. size is 1 to 2^30, iters and streams at
//! least 1, index below streams.

use super::{be16, be32, check, WireError};

/// The magic.
pub const MAGIC: &[u8; 4] = b"STGF";
/// The only version.
pub const VERSION: u8 = 1;
/// Bytes of the header.
pub const LEN: usize = 20;
const WHAT: &str = "floor header";

/// The floor test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Ping-pong latency.
    Lat,
    /// One-way stream.
    Bw,
}

/// A view of the header.
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
    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    /// The test byte.
    pub fn test(&self) -> u8 {
        self.b()[5]
    }
    /// Streams in the run.
    pub fn streams(&self) -> u16 {
        be16(self.b(), 6)
    }
    /// Message size.
    pub fn size(&self) -> u32 {
        be32(self.b(), 8)
    }
    /// Messages per stream (round trips for a ping-pong).
    pub fn iters(&self) -> u32 {
        be32(self.b(), 12)
    }
    /// Which stream this is.
    pub fn index(&self) -> u16 {
        be16(self.b(), 16)
    }
}

/// The header, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    pub test: Kind,
    pub streams: u16,
    pub size: u32,
    pub iters: u32,
    /// Which stream this connection is.
    pub index: u16,
}

impl Repr {
    /// Parse a checked view.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr, WireError> {
        let field = |why: String| WireError::Field { what: WHAT, why };
        let test = match p.test() {
            0 => Kind::Lat,
            1 => Kind::Bw,
            t => return Err(field(format!("test {t}"))),
        };
        let r = Repr {
            test,
            streams: p.streams(),
            size: p.size(),
            iters: p.iters(),
            index: p.index(),
        };
        if r.size == 0 || r.size > 1 << 30 || r.iters == 0 || r.streams == 0 || r.index >= r.streams
        {
            return Err(field(format!("{r:?}")));
        }
        Ok(r)
    }

    /// Parse received bytes.
    pub fn decode(b: &[u8]) -> Result<Repr, WireError> {
        Repr::parse(&Packet::new_checked(b)?)
    }

    /// The header's bytes.
    pub fn encode(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[..4].copy_from_slice(MAGIC);
        b[4] = VERSION;
        b[5] = match self.test {
            Kind::Lat => 0,
            Kind::Bw => 1,
        };
        b[6..8].copy_from_slice(&self.streams.to_be_bytes());
        b[8..12].copy_from_slice(&self.size.to_be_bytes());
        b[12..16].copy_from_slice(&self.iters.to_be_bytes());
        b[16..18].copy_from_slice(&self.index.to_be_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_as_drawn_and_garbage_is_refused() {
        let h = Repr {
            test: Kind::Bw,
            streams: 8,
            size: 1 << 20,
            iters: 4096,
            index: 7,
        };
        assert_eq!(
            h.encode(),
            [b'S', b'T', b'G', b'F', 1, 1, 0, 8, 0, 0x10, 0, 0, 0, 0, 0x10, 0, 0, 7, 0, 0]
        );
        assert_eq!(Repr::decode(&h.encode()).unwrap(), h);
        let mut b = h.encode();
        b[0] = b'X';
        assert!(matches!(Repr::decode(&b), Err(WireError::Magic { .. })));
        let mut b = h.encode();
        b[17] = 8;
        assert!(matches!(Repr::decode(&b), Err(WireError::Field { .. })));
        let mut b = h.encode();
        b[8..12].copy_from_slice(&0u32.to_be_bytes());
        assert!(matches!(Repr::decode(&b), Err(WireError::Field { .. })));
        assert!(Repr::decode(&h.encode()[..LEN - 1]).is_err());
    }
}
