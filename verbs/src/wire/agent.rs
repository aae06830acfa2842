//! The agent channel's messages: fixed 64-byte Sends.
//!
//! ```text
//!  0      4    5    6     8        16          24     28       32                    64
//! +------+----+----+-----+--------+-----------+------+--------+---------------------+
//! | STAG |kind| op | 0 0 | req id | addr      | rkey | len    | 4 × u64 operands    |  request
//! | STAG |kind| 0  | 0 0 | req id | 0         | 0    | status | original, 0, 0, 0   |  response
//! +------+----+----+-----+--------+-----------+------+--------+---------------------+
//! ```
//!
//! kind: 1 request, 2 response. op: 1 FetchAdd (add, mask), 2 CmpSwap
//! (compare, compare mask, swap, swap mask), 3 Swap (swap), 4 Commit
//! (`len` bytes at addr). status: 0 done, else a [`Refusal`].

use provider::wr::Remote;

use super::{check_len, le32, le64, WireError, MAGIC};

/// Bytes of every agent message.
pub const LEN: usize = 64;

const KIND_REQUEST: u8 = 1;
const KIND_RESPONSE: u8 = 2;

mod field {
    pub const KIND: usize = 4;
    pub const OP: usize = 5;
    pub const REQ_ID: usize = 8;
    pub const ADDR: usize = 16;
    pub const RKEY: usize = 24;
    pub const LEN_OR_STATUS: usize = 28;
    pub const OPERANDS: usize = 32;
}

/// What the agent is asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentOp {
    /// Masked FetchAdd (a zero mask is a plain one).
    FetchAdd {
        /// Addend.
        add: u64,
        /// RFC 7306 Add Mask.
        mask: u64,
    },
    /// Masked CmpSwap.
    CmpSwap {
        /// Compare value.
        compare: u64,
        /// Compare Mask.
        compare_mask: u64,
        /// Swap value.
        swap: u64,
        /// Swap Mask.
        swap_mask: u64,
    },
    /// Swap.
    Swap {
        /// The new value.
        swap: u64,
    },
    /// msync `len` bytes.
    Commit {
        /// Bytes.
        len: u32,
    },
}

impl AgentOp {
    fn code(self) -> u8 {
        match self {
            AgentOp::FetchAdd { .. } => 1,
            AgentOp::CmpSwap { .. } => 2,
            AgentOp::Swap { .. } => 3,
            AgentOp::Commit { .. } => 4,
        }
    }
}

/// Why an agent refused a request (non-zero status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Refusal {
    /// No region with that rkey in the agent's PD.
    UnknownKey = 1,
    /// Outside the region.
    Bounds = 2,
    /// The region does not grant the right.
    Access = 3,
    /// An atomic not 8-byte aligned.
    Misaligned = 4,
    /// msync failed.
    Sync = 5,
    /// The request made no sense.
    Malformed = 6,
}

/// A view of one agent message.
#[derive(Debug, Clone, Copy)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// The view, unchecked.
    pub fn new_unchecked(buffer: T) -> Packet<T> {
        Packet { buffer }
    }

    /// The view, after checking its length.
    pub fn new_checked(buffer: T) -> Result<Packet<T>, WireError> {
        check_len(buffer.as_ref().len(), LEN)?;
        Ok(Packet { buffer })
    }

    fn b(&self) -> &[u8] {
        self.buffer.as_ref()
    }
    /// Message kind.
    pub fn kind(&self) -> u8 {
        self.b()[field::KIND]
    }
    /// Request opcode.
    pub fn op(&self) -> u8 {
        self.b()[field::OP]
    }
    /// The requester's id.
    pub fn req_id(&self) -> u64 {
        le64(self.b(), field::REQ_ID)
    }
    /// The target.
    pub fn remote(&self) -> Remote {
        Remote {
            addr: le64(self.b(), field::ADDR),
            rkey: le32(self.b(), field::RKEY),
        }
    }
    /// A request's length, a response's status.
    pub fn len_or_status(&self) -> u32 {
        le32(self.b(), field::LEN_OR_STATUS)
    }
    /// Operand `i` (0..4).
    pub fn operand(&self, i: usize) -> u64 {
        le64(self.b(), field::OPERANDS + 8 * i)
    }
}

/// An agent message, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repr {
    /// Run `op` on `remote`.
    Request {
        /// Echoed in the response.
        req_id: u64,
        /// The target.
        remote: Remote,
        /// What to do.
        op: AgentOp,
    },
    /// The answer to request `req_id`.
    Response {
        /// The request's id.
        req_id: u64,
        /// 0, or a [`Refusal`].
        status: u32,
        /// The target's value before an atomic; a Commit's answer.
        original: u64,
    },
}

impl Repr {
    /// Parse a message.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Repr, WireError> {
        check_len(p.b().len(), LEN)?;
        if p.b()[..4] != MAGIC {
            return Err(WireError::Magic);
        }
        match p.kind() {
            KIND_REQUEST => {
                let (a, b, c, d) = (p.operand(0), p.operand(1), p.operand(2), p.operand(3));
                let op = match p.op() {
                    1 => AgentOp::FetchAdd { add: a, mask: b },
                    2 => AgentOp::CmpSwap {
                        compare: a,
                        compare_mask: b,
                        swap: c,
                        swap_mask: d,
                    },
                    3 => AgentOp::Swap { swap: a },
                    4 => AgentOp::Commit {
                        len: p.len_or_status(),
                    },
                    other => return Err(WireError::Op(other)),
                };
                Ok(Repr::Request {
                    req_id: p.req_id(),
                    remote: p.remote(),
                    op,
                })
            }
            KIND_RESPONSE => Ok(Repr::Response {
                req_id: p.req_id(),
                status: p.len_or_status(),
                original: p.operand(0),
            }),
            other => Err(WireError::Kind(other)),
        }
    }

    /// The message's bytes.
    pub fn to_bytes(&self) -> [u8; LEN] {
        let mut m = [0u8; LEN];
        m[..4].copy_from_slice(&MAGIC);
        let put64 = |m: &mut [u8; LEN], at: usize, v: u64| {
            m[at..at + 8].copy_from_slice(&v.to_le_bytes());
        };
        match *self {
            Repr::Request { req_id, remote, op } => {
                m[field::KIND] = KIND_REQUEST;
                m[field::OP] = op.code();
                let (len, operands) = match op {
                    AgentOp::FetchAdd { add, mask } => (8, [add, mask, 0, 0]),
                    AgentOp::CmpSwap {
                        compare,
                        compare_mask,
                        swap,
                        swap_mask,
                    } => (8, [compare, compare_mask, swap, swap_mask]),
                    AgentOp::Swap { swap } => (8, [swap, 0, 0, 0]),
                    AgentOp::Commit { len } => (len, [0; 4]),
                };
                put64(&mut m, field::REQ_ID, req_id);
                put64(&mut m, field::ADDR, remote.addr);
                m[field::RKEY..field::RKEY + 4].copy_from_slice(&remote.rkey.to_le_bytes());
                m[field::LEN_OR_STATUS..field::LEN_OR_STATUS + 4]
                    .copy_from_slice(&len.to_le_bytes());
                for (i, v) in operands.into_iter().enumerate() {
                    put64(&mut m, field::OPERANDS + 8 * i, v);
                }
            }
            Repr::Response {
                req_id,
                status,
                original,
            } => {
                m[field::KIND] = KIND_RESPONSE;
                put64(&mut m, field::REQ_ID, req_id);
                m[field::LEN_OR_STATUS..field::LEN_OR_STATUS + 4]
                    .copy_from_slice(&status.to_le_bytes());
                put64(&mut m, field::OPERANDS, original);
            }
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn cmp_swap_request_vector() {
        let bytes = hex(
            "53544147 01 02 0000 0300000000000000 0010000000000000 05000000 08000000
             0100000000000000 0200000000000000 0300000000000000 0400000000000000",
        );
        let r = Repr::Request {
            req_id: 3,
            remote: Remote {
                addr: 0x1000,
                rkey: 5,
            },
            op: AgentOp::CmpSwap {
                compare: 1,
                compare_mask: 2,
                swap: 3,
                swap_mask: 4,
            },
        };
        assert_eq!(r.to_bytes().to_vec(), bytes);
        assert_eq!(
            Repr::parse(&Packet::new_checked(&bytes[..]).unwrap()),
            Ok(r)
        );
    }

    #[test]
    fn commit_request_and_response_vectors() {
        let commit = hex(
            "53544147 01 04 0000 0700000000000000 0020000000000000 09000000 00100000
             0000000000000000 0000000000000000 0000000000000000 0000000000000000",
        );
        let r = Repr::Request {
            req_id: 7,
            remote: Remote {
                addr: 0x2000,
                rkey: 9,
            },
            op: AgentOp::Commit { len: 4096 },
        };
        assert_eq!(r.to_bytes().to_vec(), commit);
        let resp = hex(
            "53544147 02 00 0000 0700000000000000 0000000000000000 00000000 05000000
             2a00000000000000 0000000000000000 0000000000000000 0000000000000000",
        );
        let a = Repr::Response {
            req_id: 7,
            status: Refusal::Sync as u32,
            original: 42,
        };
        assert_eq!(a.to_bytes().to_vec(), resp);
        assert_eq!(Repr::parse(&Packet::new_checked(&resp[..]).unwrap()), Ok(a));
    }

    #[test]
    fn every_request_round_trips() {
        let remote = Remote { addr: 8, rkey: 1 };
        for op in [
            AgentOp::FetchAdd { add: 5, mask: 0x10 },
            AgentOp::Swap { swap: u64::MAX },
            AgentOp::Commit { len: 0 },
        ] {
            let r = Repr::Request {
                req_id: u64::MAX,
                remote,
                op,
            };
            assert_eq!(Repr::parse(&Packet::new_unchecked(r.to_bytes())), Ok(r));
        }
    }

    #[test]
    fn malformed_messages_are_errors() {
        let good = Repr::Response {
            req_id: 1,
            status: 0,
            original: 0,
        }
        .to_bytes();
        assert_eq!(
            Packet::new_checked(&good[..63]).err(),
            Some(WireError::Truncated { got: 63, need: 64 })
        );
        let mut m = good;
        m[0] = b'X';
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(m)),
            Err(WireError::Magic)
        );
        let mut m = good;
        m[4] = 9;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(m)),
            Err(WireError::Kind(9))
        );
        let mut m = good;
        m[4] = 1;
        m[5] = 0;
        assert_eq!(
            Repr::parse(&Packet::new_unchecked(m)),
            Err(WireError::Op(0))
        );
    }
}
