//! stag's userspace iWARP RNIC.
//!
//! The protocol stack is MPA (RFC 5044, with RFC 6581 enhanced connection
//! setup) under DDP (RFC 5041) under RDMAP (RFC 5040, extended by RFC 7306 and
//! draft-talpey-rdma-commit), carried over TCP and wire-compatible with the
//! Linux kernel's soft-iWARP (`siw`).
//!
//! [`wire`] holds the byte-exact codecs: checked zero-copy views over frames
//! plus `Repr` types to parse and emit them.

#![forbid(unsafe_op_in_unsafe_fn)]

pub mod cq;
pub mod device;
pub mod mem;
pub mod qp;
pub mod region;
pub mod setup;
pub mod srq;
#[doc(hidden)]
pub mod testing;
pub mod wire;
pub mod wr;
