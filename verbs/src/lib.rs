//! One safe verbs API over libibverbs devices and stag's userspace iWARP
//! provider.
//!
//! Open a [`Context`] by device name (or [`Context::open_default`]), make a
//! [`ProtectionDomain`], [`MemoryRegion`]s and a [`CompletionQueue`], then
//! [`connect`] or [`Listener::accept`] to get a [`QueuePair`]. Post
//! [`WorkRequest`]s naming [`Slice`]s of registered memory, and poll typed
//! [`Completion`]s. Every operation — including RFC 7306's masked atomics,
//! Swap, 8-byte Immediate Data and RDMA Commit — is offered on every device:
//! natively where the device has it, through the emulation layer where it
//! does not; [`Context::capabilities`] says which.

mod agent;
pub mod caps;
pub mod cm;
pub mod cq;
pub mod device;
pub mod error;
pub mod mr;
pub mod qp;
pub mod srq;

/// Low-level libibverbs/librdmacm backend (not the stable API).
#[doc(hidden)]
pub mod ibv;

pub use caps::{Capabilities, Emulation, OpKind, OpSet, PostPath, Support};
pub use cm::{connect, connect_with, ConnectOptions, Incoming, Listener};
pub use cq::{Completion, CompletionKind, CompletionQueue, WcStatus};
pub use device::{
    default_device, devices, Backend, Context, ContextOptions, DeviceInfo, ParseProgressError,
    Progress, ProtectionDomain, PROGRESS_ENV,
};
pub use error::{Error, Result};
pub use mr::{Access, MemoryRegion, Slice};
pub use provider::wr::{Remote, SendOp};
pub use qp::{
    op_kind, EmulationCounters, PeerAtomics, PostListError, QpCaps, QueuePair, WorkRequest,
};
pub use srq::SharedReceiveQueue;
