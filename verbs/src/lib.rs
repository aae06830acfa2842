//! One safe verbs API over libibverbs devices and stag's userspace iWARP
//! provider.
