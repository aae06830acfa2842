//! The C types the plugin speaks, generated at build time from the
//! installed `<infiniband/verbs.h>` and `<rdma/rdma_cma.h>` and from
//! `src/abi.h` (libibverbs' private provider ABI 34).
#![allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    missing_docs,
    clippy::all,
    clippy::undocumented_unsafe_blocks,
    unsafe_op_in_unsafe_fn
)]

include!(concat!(env!("OUT_DIR"), "/abi.rs"));
