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

mod assist;
pub mod cq;
pub mod device;
mod driver;
pub mod engine;
pub mod error;
mod establish;
pub mod fatal;
mod linger;
pub mod listener;
pub mod mem;
mod nosignal;
pub mod qp;
pub mod qpn_map;
mod queue_pair;
pub mod region;
mod registry;
pub mod setup;
pub mod srq;
mod tail;
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

    /// The device's limits, as `ibv_query_device` reports them: the one
    /// table that the rdma-core plugin's `query_device` and its
    /// create_qp/create_cq/create_srq checks, and the `verbs` capability
    /// matrix of a userspace device, read.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Limits {
        /// `max_qp`.
        pub max_qp: u32,
        /// `max_qp_wr`: WRs per send or receive queue.
        pub max_qp_wr: u32,
        /// `max_sge` (also `max_sge_rd`, `max_srq_sge`): SGEs per WR.
        pub max_sge: u32,
        /// `max_cq`.
        pub max_cq: u32,
        /// `max_cqe`: entries per CQ.
        pub max_cqe: u32,
        /// `max_mr`.
        pub max_mr: u32,
        /// `max_pd`.
        pub max_pd: u32,
        /// `max_qp_rd_atom` = `max_qp_init_rd_atom`: IRD and ORD, the
        /// inbound and outbound Reads, atomics and Commits in flight.
        pub max_rd_atom: u32,
        /// `max_srq`.
        pub max_srq: u32,
        /// `max_srq_wr`.
        pub max_srq_wr: u32,
        /// `max_inline_data` a QP may ask for.
        pub max_inline: u32,
        /// `max_msg_sz`: an RDMAP message is at most 2^32 - 1 bytes.
        pub max_msg: u32,
    }

    /// stag0's limits.
    pub const LIMITS: Limits = Limits {
        max_qp: 16384,
        max_qp_wr: 4096,
        max_sge: 8,
        max_cq: 16384,
        max_cqe: 1 << 20,
        max_mr: 1 << 20,
        max_pd: 1 << 16,
        max_rd_atom: 128,
        max_srq: 4096,
        max_srq_wr: 4096,
        max_inline: 256,
        max_msg: u32::MAX,
    };
}
