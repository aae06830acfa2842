//! One safe verbs API over libibverbs devices and stag's userspace iWARP
//! provider.
//!
//! Open a [`Context`] by device name (or [`Context::open_default`]), make a
//! [`ProtectionDomain`], [`MemoryRegion`]s (allocated, or the
//! application's own memory registered in place) and
//! [`CompletionQueue`]s, then [`connect`] or [`Listener::accept`] to get a
//! [`QueuePair`]. Post [`WorkRequest`]s naming [`Slice`]s of registered
//! memory, alone or as lists, and poll typed [`Completion`]s. Every
//! operation — including RFC 7306's masked atomics, Swap, 8-byte Immediate
//! Data and RDMA Commit — is offered on every device: natively where the
//! device has it, through the emulation layer where it does not;
//! [`Context::capabilities`] says which, and a send queue's completions
//! come out in posting order whichever path each took.
//!
//! Layers, each using only those below it:
//!
//! | module | what it is |
//! |---|---|
//! | [`ibv`] | the libibverbs/librdmacm FFI wrapper (hidden; only `backend` uses it) |
//! | `backend` | one set of traits, implemented by the userspace provider and by libibverbs |
//! | `tracker` | the one table of posted work requests; what makes posting safe |
//! | [`mr`], `pd`, [`device`], [`cq`] | regions, protection domains, contexts, completion queues |
//! | [`wire`] | stag's own headers (connection hello, agent messages) |
//! | `emulation` | routing, the strategies, RC ordering |
//! | [`qp`], [`srq`], [`cm`] | queue pairs, shared receive queues, connections |
//! | `r#async` (feature `tokio`) | futures for every operation, async connect/accept, `RdmaStream` |
#![deny(unsafe_code)]

// The FFI wrapper and the two backends are the crate's `unsafe`: calling C,
// and posting memory the tracker holds (see `backend`).
#[cfg(feature = "tokio")]
pub mod r#async;
#[allow(unsafe_code)]
mod backend;
pub mod caps;
pub mod cm;
pub mod cq;
pub mod device;
mod emulation;
pub mod error;
pub mod mr;
mod pd;
pub mod qp;
pub mod srq;
mod tracker;
pub mod wire;
mod wr;

// The low-level libibverbs/librdmacm backend (not the stable API). Its
// docs are its own inner ones: outer docs here would make rustdoc resolve
// the module's links from this file.
#[doc(hidden)]
#[allow(unsafe_code)]
pub mod ibv;

pub use caps::{Capabilities, Emulation, Limits, OpKind, OpSet, PostPath, Support};
pub use cm::{connect, connect_with, ConnectOptions, Incoming, Listener};
pub use cq::{Completion, CompletionKind, CompletionQueue, WcStatus};
pub use device::{
    default_device, devices, Backend, Context, ContextOptions, DeviceInfo, ParseProgressError,
    Progress, PROGRESS_ENV,
};
pub use error::{Error, Result};
pub use mr::{Access, DeregisterError, MemoryRegion, Slice};
pub use pd::ProtectionDomain;
pub use provider::region::Owned;
pub use provider::wr::{Remote, SendOp};
pub use qp::{
    op_kind, EmulationCounters, PeerAtomics, PostListError, QpCaps, QueuePair, WorkRequest,
    MAX_INLINE,
};
pub use srq::SharedReceiveQueue;
