//! `STGB`: what the two sides of `stag lat`/`stag bw` tell each other in
//! the connection's private data (the client's plan, each side's target).
//!
//! ```text
//!  0      4   5    6    7    8       12      16     18   19  20        28     32    34
//! +------+---+----+----+----+-------+-------+------+----+---+---------+------+-----+----+
//! | STGB | 2 |test| op |all | size  | iters |txdep |c2m | 0 | addr    | rkey | qps | 0  |
//! +------+---+----+----+----+-------+-------+------+----+---+---------+------+-----+----+
//! ```
//!
//! test: 0 latency, 1 bandwidth; op: [`OpKind::code`]; all: 1 for every
//! size (`-a`); c2m: bit 0, Commit targets memory. 36 bytes fit
//! librdmacm's 56-byte limit for an RC connect's private data.

use verbs::{OpKind, Remote};

use super::{be16, be32, be64, check, WireError};

/// The magic.
pub const MAGIC: &[u8; 4] = b"STGB";
/// 2: the QP count.
pub const VERSION: u8 = 2;
/// Bytes of the message.
pub const LEN: usize = 36;
const WHAT: &str = "benchmark hello";

mod field {
    pub const TEST: usize = 5;
    pub const OP: usize = 6;
    pub const ALL: usize = 7;
    pub const SIZE: usize = 8;
    pub const ITERS: usize = 12;
    pub const TX_DEPTH: usize = 16;
    pub const FLAGS: usize = 18;
    pub const ADDR: usize = 20;
    pub const RKEY: usize = 28;
    pub const QPS: usize = 32;
}

/// The test kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Test {
    /// Latency.
    Lat,
    /// Bandwidth.
    Bw,
}

/// A view of a hello, its length, magic and version checked.
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
        self.b()[field::TEST]
    }
    /// The operation's code.
    pub fn op(&self) -> u8 {
        self.b()[field::OP]
    }
    /// Every size (`-a`).
    pub fn all(&self) -> bool {
        self.b()[field::ALL] != 0
    }
    /// The message size.
    pub fn size(&self) -> u32 {
        be32(self.b(), field::SIZE)
    }
    /// Iterations per size.
    pub fn iters(&self) -> u32 {
        be32(self.b(), field::ITERS)
    }
    /// Outstanding operations (bandwidth).
    pub fn tx_depth(&self) -> u16 {
        be16(self.b(), field::TX_DEPTH)
    }
    /// Commit targets memory.
    pub fn commit_to_memory(&self) -> bool {
        self.b()[field::FLAGS] & 1 != 0
    }
    /// The sender's target buffer.
    pub fn target(&self) -> Remote {
        Remote {
            addr: be64(self.b(), field::ADDR),
            rkey: be32(self.b(), field::RKEY),
        }
    }
    /// Queue pairs the client opens.
    pub fn qps(&self) -> u16 {
        be16(self.b(), field::QPS)
    }
}

/// A hello, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    pub test: Test,
    pub op: OpKind,
    pub all: bool,
    pub size: u32,
    pub iters: u32,
    pub tx_depth: u16,
    /// Commit: the server's target is memory, not a file.
    pub commit_to_memory: bool,
    /// The sender's target buffer.
    pub target: Remote,
    /// Queue pairs the client opens (each connection carries the count).
    pub qps: u16,
}

impl Repr {
    /// Parse a checked view.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr, WireError> {
        let field = |why: String| WireError::Field { what: WHAT, why };
        let test = match p.test() {
            0 => Test::Lat,
            1 => Test::Bw,
            t => return Err(field(format!("test {t}"))),
        };
        let op = OpKind::from_code(p.op()).ok_or_else(|| field(format!("operation {}", p.op())))?;
        Ok(Repr {
            test,
            op,
            all: p.all(),
            size: p.size(),
            iters: p.iters(),
            tx_depth: p.tx_depth(),
            commit_to_memory: p.commit_to_memory(),
            target: p.target(),
            qps: p.qps(),
        })
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
        b[field::TEST] = match self.test {
            Test::Lat => 0,
            Test::Bw => 1,
        };
        b[field::OP] = self.op.code();
        b[field::ALL] = u8::from(self.all);
        b[field::SIZE..field::SIZE + 4].copy_from_slice(&self.size.to_be_bytes());
        b[field::ITERS..field::ITERS + 4].copy_from_slice(&self.iters.to_be_bytes());
        b[field::TX_DEPTH..field::TX_DEPTH + 2].copy_from_slice(&self.tx_depth.to_be_bytes());
        b[field::FLAGS] = u8::from(self.commit_to_memory);
        b[field::ADDR..field::ADDR + 8].copy_from_slice(&self.target.addr.to_be_bytes());
        b[field::RKEY..field::RKEY + 4].copy_from_slice(&self.target.rkey.to_be_bytes());
        b[field::QPS..field::QPS + 2].copy_from_slice(&self.qps.to_be_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_as_drawn() {
        let r = Repr {
            test: Test::Bw,
            op: OpKind::Write,
            all: false,
            size: 0x0102_0304,
            iters: 5000,
            tx_depth: 128,
            commit_to_memory: true,
            target: Remote {
                addr: 0x1122_3344_5566_7788,
                rkey: 0xaabb_ccdd,
            },
            qps: 64,
        };
        let b = r.encode();
        let mut want = vec![b'S', b'T', b'G', b'B', 2, 1, OpKind::Write.code(), 0];
        want.extend_from_slice(&[1, 2, 3, 4, 0, 0, 0x13, 0x88, 0, 128, 1, 0]);
        want.extend_from_slice(&[0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88]);
        want.extend_from_slice(&[0xaa, 0xbb, 0xcc, 0xdd, 0, 64, 0, 0]);
        assert_eq!(&b[..], &want[..]);
        assert_eq!(Repr::decode(&b).unwrap(), r);
    }

    #[test]
    fn strangers_are_errors() {
        let r = Repr {
            test: Test::Lat,
            op: OpKind::Send,
            all: true,
            size: 0,
            iters: 1,
            tx_depth: 1,
            commit_to_memory: false,
            target: Remote { addr: 0, rkey: 0 },
            qps: 1,
        };
        let good = r.encode();
        assert!(matches!(
            Repr::decode(&good[..LEN - 1]),
            Err(WireError::Truncated { .. })
        ));
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(Repr::decode(&b), Err(WireError::Magic { .. })));
        let mut b = good;
        b[4] = 1;
        assert!(matches!(Repr::decode(&b), Err(WireError::Version { .. })));
        let mut b = good;
        b[field::TEST] = 2;
        assert!(matches!(Repr::decode(&b), Err(WireError::Field { .. })));
        let mut b = good;
        b[field::OP] = 200;
        assert!(matches!(Repr::decode(&b), Err(WireError::Field { .. })));
    }
}
