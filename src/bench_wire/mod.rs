//! The messages of the `stag` CLI's benchmarks (`stag lat|bw|floor|scale`),
//! as views and parsed forms in the manner of smoltcp (a `Packet` over
//! bytes, a `Repr` that parses and emits it).
//!
//! | magic  | module        | carried in                                    |
//! |--------|---------------|-----------------------------------------------|
//! | `STGB` | [`hello`]     | `stag lat`/`bw`: the connection's private data |
//! | `STGC` | [`ctrl`]      | `stag lat`/`bw`: control Sends on the test QP  |
//! | `STGF` | [`floor`]     | `stag floor`: the first bytes of every stream  |
//! | `STGS` | [`scale`]     | `stag scale`: the connection's private data    |
//!
//! Every field is big-endian. Bytes from a peer are untrusted: a parse
//! checks length, magic, version and every field's range, and fails with a
//! [`WireError`] (the `bench_wire` fuzz target holds them to it).

pub mod ctrl;
pub mod floor;
pub mod hello;
pub mod scale;

/// Why bytes are not a message of ours.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than the message has.
    #[error("{what}: {got} bytes, want {want}")]
    Truncated {
        what: &'static str,
        got: usize,
        want: usize,
    },
    /// Another program's bytes.
    #[error("{what}: not a stag peer (magic {magic:02x?})")]
    Magic { what: &'static str, magic: [u8; 4] },
    /// Ours, but another version.
    #[error("{what}: version {got}, ours is {ours}")]
    Version {
        what: &'static str,
        got: u8,
        ours: u8,
    },
    /// A field out of its range.
    #[error("{what}: {why}")]
    Field { what: &'static str, why: String },
}

/// Check the common prefix (length, magic, version) of a message.
fn check(
    b: &[u8],
    what: &'static str,
    len: usize,
    magic: &[u8; 4],
    version: u8,
) -> Result<(), WireError> {
    if b.len() < len {
        return Err(WireError::Truncated {
            what,
            got: b.len(),
            want: len,
        });
    }
    if &b[..4] != magic {
        return Err(WireError::Magic {
            what,
            magic: [b[0], b[1], b[2], b[3]],
        });
    }
    if b[4] != version {
        return Err(WireError::Version {
            what,
            got: b[4],
            ours: version,
        });
    }
    Ok(())
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(v)
}
