//! stag0 as an rdma-core device.
//!
//! This library is two things in one shared object:
//!
//! - a **libibverbs provider plugin** (driver `stag`, ABI
//!   `IBVERBS_PRIVATE_34`, rdma-core v44..v56): libibverbs matches it to the
//!   `stag*` devices it finds under `$SYSFS_PATH` and calls it for every
//!   verb, which runs on the userspace iWARP RNIC of [`provider`];
//! - an **rdma_cm library** exporting librdmacm's API with its symbol
//!   versions (`RDMACM_1.0` .. `RDMACM_1.3`), which maps cm ids onto MPA
//!   connections of that RNIC. librdmacm itself only talks to the kernel.
//!
//! `stag run -- CMD` preloads it (so its rdma_cm and its few libibverbs
//! interposers come first) and points libibverbs at a device tree naming
//! stag0. The RFC 7306 and Commit operations verbs has no words for are in
//! `include/stagdv.h` ([`dv`]).
//!
//! Everything here is an `extern "C"` boundary: raw pointers from C are
//! checked for NULL and for being this plugin's objects before use, and no
//! panic crosses into C (each entry point catches and turns it into an
//! errno).

#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

mod ffi;

mod async_events;
mod c_list;
mod comp_channel;
mod cq;
mod driver;
mod errno;
mod handle;
mod interpose;
mod log;
mod mr;
mod ops;
mod qp;
mod query;
mod srq;
mod users;
mod wr;

pub mod cm;
pub mod dv;
