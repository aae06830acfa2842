//! The name libibverbs' driver (`driver.rs`) calls a context's
//! constructor by. The constructor lives with the ops table it installs
//! (`ops.rs`), as `siw_alloc_context` sits with `siw_context_ops`.

pub(crate) use crate::ops::alloc_context;
