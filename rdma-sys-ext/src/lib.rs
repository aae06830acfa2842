//! FFI to what `rdma-sys` lacks.
