//! One safe verbs API over libibverbs devices and stag's userspace iWARP
//! provider.

/// Low-level libibverbs/librdmacm backend (not the stable API).
#[doc(hidden)]
pub mod ibv;
