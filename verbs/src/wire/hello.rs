//! The stag connection header, in front of the application's private data.
//!
//! ```text
//!  0      4   5     6        8        16              24      28
//! +------+---+-----+--------+--------+---------------+-------+---------
//! | STAG | 1 |flags| native | token  | mailbox addr  | rkey  | app ...
//! +------+---+-----+--------+--------+---------------+-------+---------
//!                    u16 LE   u64 LE   (agent channel only)
//! ```
//!
//! flags: 1 the sender wants an agent channel, 2 this connection is the
//! agent channel of connection `token`, 4 the native set is present (else
//! the sender does RFC 5040's operations only). `native` is an
//! [`OpSet`]: bit [`OpKind::code`] per operation its device executes as a
//! responder.
//!
//! [`OpKind::code`]: crate::OpKind::code

use provider::wr::Remote;

use super::{check_len, le16, le32, le64, WireError, MAGIC};
use crate::caps::OpSet;

/// The only version.
pub const VERSION: u8 = 1;
/// Bytes of a main connection's header.
pub const HEADER_LEN: usize = 16;
/// Bytes of an agent channel's header (with the mailbox).
pub const AGENT_HEADER_LEN: usize = 28;

const FLAG_WANTS_AGENT: u8 = 1;
const FLAG_IS_AGENT: u8 = 2;
const FLAG_NATIVE: u8 = 4;

mod field {
    use std::ops::Range;
    pub const MAGIC: Range<usize> = 0..4;
    pub const VERSION: usize = 4;
    pub const FLAGS: usize = 5;
    pub const NATIVE: usize = 6;
    pub const TOKEN: usize = 8;
    pub const MAILBOX_ADDR: usize = 16;
    pub const MAILBOX_RKEY: usize = 24;
}

/// A view of private data that starts with stag's header.
#[derive(Debug, Clone, Copy)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// The view, unchecked.
    pub fn new_unchecked(buffer: T) -> Packet<T> {
        Packet { buffer }
    }

    /// The view, after checking that the header's fields are all there.
    pub fn new_checked(buffer: T) -> Result<Packet<T>, WireError> {
        let p = Packet::new_unchecked(buffer);
        p.check_len()?;
        Ok(p)
    }

    /// Whether every field the flags announce is present.
    pub fn check_len(&self) -> Result<(), WireError> {
        let b = self.buffer.as_ref();
        check_len(b.len(), HEADER_LEN)?;
        check_len(b.len(), self.header_len())
    }

    fn header_len(&self) -> usize {
        if self.flags() & FLAG_IS_AGENT != 0 {
            AGENT_HEADER_LEN
        } else {
            HEADER_LEN
        }
    }

    /// The magic bytes.
    pub fn magic(&self) -> &[u8] {
        &self.buffer.as_ref()[field::MAGIC]
    }
    /// The version.
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VERSION]
    }
    /// The flags byte.
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }
    /// The native-set field.
    pub fn native(&self) -> u16 {
        le16(self.buffer.as_ref(), field::NATIVE)
    }
    /// The connection token.
    pub fn token(&self) -> u64 {
        le64(self.buffer.as_ref(), field::TOKEN)
    }
    /// The mailbox (agent channel headers).
    pub fn mailbox(&self) -> Remote {
        let b = self.buffer.as_ref();
        Remote {
            addr: le64(b, field::MAILBOX_ADDR),
            rkey: le32(b, field::MAILBOX_RKEY),
        }
    }
    /// The application's private data after the header.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }
}

/// The header, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    /// This side needs an agent channel.
    pub wants_agent: bool,
    /// This connection is the agent channel of connection `token`.
    pub is_agent: bool,
    /// Names the main connection (chosen by the initiator).
    pub token: u64,
    /// Agent channel only: where the peer writes our Immediate Data.
    pub mailbox: Option<Remote>,
    /// What the sender's device executes natively ([`OpSet::RDMAP`] when
    /// a header carries no set).
    pub native: OpSet,
}

impl Repr {
    /// Parse a checked view.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr, WireError> {
        p.check_len()?;
        if p.magic() != MAGIC {
            return Err(WireError::Magic);
        }
        if p.version() != VERSION {
            return Err(WireError::Version(p.version()));
        }
        let flags = p.flags();
        let is_agent = flags & FLAG_IS_AGENT != 0;
        Ok(Repr {
            wants_agent: flags & FLAG_WANTS_AGENT != 0,
            is_agent,
            token: p.token(),
            mailbox: is_agent.then(|| p.mailbox()),
            native: if flags & FLAG_NATIVE != 0 {
                OpSet::from_bits(p.native())
            } else {
                OpSet::RDMAP
            },
        })
    }

    /// Bytes of the header.
    pub fn header_len(&self) -> usize {
        if self.is_agent {
            AGENT_HEADER_LEN
        } else {
            HEADER_LEN
        }
    }

    /// Write the header into the first [`Repr::header_len`] bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        let b = p.bytes_mut();
        b[field::MAGIC].copy_from_slice(&MAGIC);
        b[field::VERSION] = VERSION;
        let mut flags = FLAG_NATIVE;
        if self.wants_agent {
            flags |= FLAG_WANTS_AGENT;
        }
        if self.is_agent {
            flags |= FLAG_IS_AGENT;
        }
        b[field::FLAGS] = flags;
        b[field::NATIVE..field::NATIVE + 2].copy_from_slice(&self.native.bits().to_le_bytes());
        b[field::TOKEN..field::TOKEN + 8].copy_from_slice(&self.token.to_le_bytes());
        if self.is_agent {
            let m = self.mailbox.unwrap_or(Remote { addr: 0, rkey: 0 });
            b[field::MAILBOX_ADDR..field::MAILBOX_ADDR + 8].copy_from_slice(&m.addr.to_le_bytes());
            b[field::MAILBOX_RKEY..field::MAILBOX_RKEY + 4].copy_from_slice(&m.rkey.to_le_bytes());
        }
    }

    /// The header followed by `app`.
    pub fn encode(&self, app: &[u8]) -> Vec<u8> {
        let mut v = vec![0; self.header_len() + app.len()];
        self.emit(&mut Packet::new_unchecked(&mut v[..]));
        v[self.header_len()..].copy_from_slice(app);
        v
    }

    /// Split private data into stag's header, if the peer runs stag, and
    /// the application's bytes (all of it when there is no header).
    pub fn split(data: &[u8]) -> (Option<Repr>, &[u8]) {
        match Packet::new_checked(data).and_then(|p| Repr::parse(&p).map(|r| (r, p))) {
            Ok((r, _)) => (Some(r), &data[r.header_len()..]),
            Err(_) => (None, data),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OpKind;

    /// A main connection's header, byte by byte.
    const MAIN: [u8; 19] = [
        b'S', b'T', b'A', b'G', 1,    // magic, version
        0x05, // flags: wants agent | native present
        0x01, 0x08, // native: Send (code 0) and Commit (code 11)
        8, 7, 6, 5, 4, 3, 2, 1, // token
        b'a', b'p', b'p',
    ];

    #[test]
    fn main_header_vector() {
        let r = Repr {
            wants_agent: true,
            is_agent: false,
            token: 0x0102_0304_0506_0708,
            mailbox: None,
            native: OpSet::EMPTY.with(OpKind::Send).with(OpKind::Commit),
        };
        assert_eq!(r.encode(b"app"), MAIN);
        assert_eq!(Repr::split(&MAIN), (Some(r), &b"app"[..]));
    }

    #[test]
    fn agent_header_vector() {
        let bytes: [u8; 28] = [
            b'S', b'T', b'A', b'G', 1, 0x07, 0x0f, 0x00, 9, 0, 0, 0, 0, 0, 0, 0, // token 9
            0x00, 0x00, 0xad, 0xde, 0, 0, 0, 0, // mailbox addr 0xdead_0000
            77, 0, 0, 0, // rkey
        ];
        let r = Repr {
            wants_agent: true,
            is_agent: true,
            token: 9,
            mailbox: Some(Remote {
                addr: 0xdead_0000,
                rkey: 77,
            }),
            native: OpSet::RDMAP,
        };
        assert_eq!(r.encode(b""), bytes);
        assert_eq!(Repr::split(&bytes), (Some(r), &b""[..]));
        // An agent header cut short is not a header.
        assert_eq!(
            Packet::new_checked(&bytes[..20]).err(),
            Some(WireError::Truncated { got: 20, need: 28 })
        );
    }

    #[test]
    fn foreign_private_data_is_left_alone() {
        assert_eq!(
            Repr::split(b"plain private data"),
            (None, &b"plain private data"[..])
        );
        assert_eq!(Repr::split(b"STA"), (None, &b"STA"[..]));
        let mut v2 = MAIN;
        v2[4] = 2;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(&v2[..])),
            Err(WireError::Version(2))
        );
        assert_eq!(Repr::split(&v2).0, None);
    }

    #[test]
    fn a_header_without_a_native_set_means_rdmap_only() {
        let mut old = MAIN;
        old[5] &= !FLAG_NATIVE;
        old[6..8].fill(0);
        assert_eq!(Repr::split(&old).0.map(|h| h.native), Some(OpSet::RDMAP));
    }
}
