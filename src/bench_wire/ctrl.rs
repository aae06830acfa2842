//! `STGC`: the control Sends of `stag lat`/`stag bw`, on the test QP.
//!
//! ```text
//!  0      4       8       12      16
//! +------+-------+-------+-------+
//! | STGC | kind  |  arg  |   0   |
//! +------+-------+-------+-------+
//! ```

use super::{be32, WireError};

/// The magic.
pub const MAGIC: &[u8; 4] = b"STGC";
/// Bytes of the message.
pub const LEN: usize = 16;
const WHAT: &str = "control message";

/// What a control message says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Client: ready for size index `arg`.
    Ready = 1,
    /// Server: go ahead.
    Go = 2,
    /// Server: `arg` more receives are posted.
    Credit = 3,
    /// Client: finished.
    Done = 4,
}

impl Kind {
    fn from_u32(v: u32) -> Option<Kind> {
        Some(match v {
            1 => Kind::Ready,
            2 => Kind::Go,
            3 => Kind::Credit,
            4 => Kind::Done,
            _ => return None,
        })
    }
}

/// A view of a control message.
#[derive(Debug, Clone, Copy)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// The view, after checking length and magic (`Ok(None)`: not a
    /// control message, i.e. test data that happens to be in the buffer).
    pub fn new_checked(buffer: T) -> Result<Option<Packet<T>>, WireError> {
        let b = buffer.as_ref();
        if b.len() < LEN {
            return Err(WireError::Truncated {
                what: WHAT,
                got: b.len(),
                want: LEN,
            });
        }
        Ok((&b[..4] == MAGIC).then_some(Packet { buffer }))
    }
    /// The kind word.
    pub fn kind(&self) -> u32 {
        be32(self.buffer.as_ref(), 4)
    }
    /// The argument.
    pub fn arg(&self) -> u32 {
        be32(self.buffer.as_ref(), 8)
    }
}

/// A control message, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    pub kind: Kind,
    pub arg: u32,
}

impl Repr {
    /// Parse a checked view.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr, WireError> {
        let kind = Kind::from_u32(p.kind()).ok_or_else(|| WireError::Field {
            what: WHAT,
            why: format!("kind {}", p.kind()),
        })?;
        Ok(Repr { kind, arg: p.arg() })
    }

    /// Parse received bytes: `Ok(None)` when they are not a control
    /// message.
    pub fn decode(b: &[u8]) -> Result<Option<Repr>, WireError> {
        Packet::new_checked(b)?.map(|p| Repr::parse(&p)).transpose()
    }

    /// The message's bytes.
    pub fn encode(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[..4].copy_from_slice(MAGIC);
        b[4..8].copy_from_slice(&(self.kind as u32).to_be_bytes());
        b[8..12].copy_from_slice(&self.arg.to_be_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_as_drawn() {
        let r = Repr {
            kind: Kind::Credit,
            arg: 0x0102_0304,
        };
        assert_eq!(
            r.encode(),
            [b'S', b'T', b'G', b'C', 0, 0, 0, 3, 1, 2, 3, 4, 0, 0, 0, 0]
        );
        assert_eq!(Repr::decode(&r.encode()).unwrap(), Some(r));
    }

    #[test]
    fn data_is_not_control_and_bad_kinds_are_errors() {
        assert_eq!(Repr::decode(&[0u8; LEN]).unwrap(), None);
        assert!(Repr::decode(&[0u8; LEN - 1]).is_err());
        let mut b = Repr {
            kind: Kind::Go,
            arg: 0,
        }
        .encode();
        b[7] = 9;
        assert!(matches!(Repr::decode(&b), Err(WireError::Field { .. })));
    }
}
