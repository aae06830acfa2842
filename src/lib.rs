//! stag: a Rust RDMA toolkit.
//!
//! The verbs API lives in the `verbs` crate and is re-exported here so that
//! applications depend on `stag` alone.

pub use verbs;
pub use verbs::*;

// The messages of the `stag` CLI's benchmarks (documented inside: outer
// docs here would make rustdoc resolve the module's links from this file).
pub mod bench_wire;
