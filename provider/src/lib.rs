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
mod driver;
pub mod engine;
pub mod fatal;
mod linger;
pub mod listener;
pub mod mem;
mod nosignal;
pub mod qp;
pub mod region;
pub mod setup;
pub mod srq;
#[doc(hidden)]
pub mod testing;
pub mod thread;
pub mod wire;
pub mod wr;

/// How stag0 presents itself to rdma-core: the names, GUID and limits that
/// the device tree (`stag run`, `stag install`) and the rdma-core plugin
/// (`provider/plugin`) must agree on.
pub mod identity {
    /// The device's name (`ibv_get_device_name`).
    pub const DEVICE_NAME: &str = "stag0";
    /// Its uverbs name: `/dev/infiniband/<this>` and
    /// `class/infiniband_verbs/<this>` in the device tree. High, so that it
    /// never meets a kernel device's `uverbsN`.
    pub const UVERBS_NAME: &str = "uverbs64";
    /// `major:minor` of the character device discovery checks: `/dev/null`'s,
    /// so that a node made with `mknod c 1 3` (or the plugin's interposed
    /// `open`) matches.
    pub const UVERBS_DEV: (u32, u32) = (1, 3);
    /// The uverbs ABI version the tree announces (libibverbs accepts 3..=6).
    pub const UVERBS_ABI_VERSION: u32 = 6;
    /// Node GUID, as libibverbs prints it (host order).
    pub const NODE_GUID: u64 = 0x0273_7461_6700_0001;
    /// IEEE OUI-shaped vendor id (`ibv_device_attr::vendor_id`).
    pub const VENDOR_ID: u32 = 0x0053_5447;
    /// `ibv_device_attr::vendor_part_id`.
    pub const VENDOR_PART_ID: u32 = 0x7306;
    /// The GID of port 1: the interface id in bytes 8..16 (`ibv_devinfo`
    /// hides a GID whose bytes 8..16 are zero) and a zero subnet prefix in
    /// bytes 0..8. An iWARP device is in no InfiniBand subnet, and
    /// libfabric's verbs provider turns every GID whose prefix and
    /// interface id are both non-zero into `FI_SOCKADDR_IB` addresses that
    /// rdma_cm then refuses (kernel siw's GID, its MAC and zeros, gives it
    /// none either). iWARP carries no GID on the wire.
    pub const GID: [u8; 16] = [
        0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x73, 0x74, 0xff, 0xfe, 0x61, 0x67, 0x00,
    ];
}
