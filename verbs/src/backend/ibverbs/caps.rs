//! The capability matrix of a libibverbs device, from what it reports.

use crate::caps::{
    native_flush_commit, Capabilities, Emulation, Limits, OpKind, PostPath, Support,
};
use crate::ibv::{AtomicCap, DeviceAttr, WrApi};

/// A libibverbs device, from what it reports (`attr`) and what its provider
/// library took of the `ibv_wr_*` API (`wr`).
pub(crate) fn capabilities(device: &str, attr: &DeviceAttr, wr: &WrApi) -> Capabilities {
    let atomics = attr.atomic_cap != AtomicCap::None;
    let mut ops = Vec::new();
    for k in OpKind::ALL {
        let s = match k {
            OpKind::Send | OpKind::Write | OpKind::Read => Support::Native,
            // iWARP (siw) invalidates any STag of the receiving QP's PD.
            OpKind::SendInvalidate if attr.is_iwarp() => Support::Native,
            // IB/RoCE invalidate only memory windows and fast-register
            // MRs (rxe: "Type (1) is wrong" for a user MR), and stag
            // registers user MRs and hands out their rkeys.
            OpKind::SendInvalidate => Support::Unsupported {
                why: "IB/RoCE Send with Invalidate only invalidates memory windows and \
                      fast-register MRs, and stag's regions are user MRs"
                    .into(),
            },
            // Verbs immediate data is 4 bytes and iWARP has none: the
            // RFC 7306 8-byte form always goes through the mailbox.
            OpKind::WriteImm | OpKind::Imm => Emulation::ImmMailbox.support_for(k),
            OpKind::FetchAdd | OpKind::CmpSwap if atomics => Support::Native,
            // IBV_WR_ATOMIC_WRITE: the device advertises it (rxe from
            // Linux 6.2) and its provider takes the send_ops flag.
            OpKind::AtomicWrite if atomics && attr.atomic_write && wr.atomic_write => {
                Support::Native
            }
            OpKind::MaskedFetchAdd | OpKind::MaskedCmpSwap | OpKind::Swap | OpKind::AtomicWrite
                if atomics =>
            {
                Emulation::CasLoop.support_for(k)
            }
            // No atomics at all (siw): the peer's agent runs them, all
            // of them, so that they stay atomic with respect to each
            // other.
            OpKind::FetchAdd
            | OpKind::CmpSwap
            | OpKind::MaskedFetchAdd
            | OpKind::MaskedCmpSwap
            | OpKind::Swap
            | OpKind::AtomicWrite => Emulation::Agent.support_for(k),
            // Commit by one ibv_wr_flush: the device advertises FLUSH
            // (rxe from Linux 6.2) and its provider library takes
            // IBV_QP_EX_WITH_FLUSH (rdma-core >= 45).
            OpKind::Commit if wr.commit_by_flush(attr) => native_flush_commit(),
            OpKind::Commit => {
                let mut s = Emulation::Agent.support_for(k);
                if attr.flush_global || attr.flush_persistent {
                    if let Support::Emulated { how, .. } = &mut s {
                        how.push_str(&format!(
                            "; the device advertises FLUSH ({}), but {}",
                            match (attr.flush_global, attr.flush_persistent) {
                                (true, true) => "global+persistent",
                                (true, false) => "global",
                                _ => "persistent",
                            },
                            if !crate::ibv::HAS_WR_FLUSH {
                                "stag was built against an rdma-core without ibv_wr_flush \
                                 (>= 45 has it)"
                            } else if !wr.flush {
                                "its provider library refuses IBV_QP_EX_WITH_FLUSH"
                            } else {
                                "not FLUSH global, and a persistent FLUSH reaches pmem \
                                 pages only"
                            }
                        ));
                    }
                }
                s
            }
        };
        ops.push((k, s));
    }
    Capabilities {
        device: device.to_owned(),
        transport: format!("{:?}", attr.transport),
        post_path: if wr.available() {
            PostPath::Extended
        } else {
            PostPath::Legacy
        },
        ops,
        limits: Limits {
            max_qp: attr.max_qp,
            max_qp_wr: attr.max_qp_wr,
            max_sge: attr.max_sge,
            max_cqe: attr.max_cqe,
            max_mr: attr.max_mr,
            max_qp_rd_atom: attr.max_qp_rd_atom,
            max_qp_init_rd_atom: attr.max_qp_init_rd_atom,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// rxe as each (kernel, rdma-core) pair shows it: the kernel decides
    /// the FLUSH and ATOMIC_WRITE bits (Linux >= 6.2), the library whether
    /// `IBV_QP_EX_WITH_FLUSH` is taken (rdma-core >= 45; Atomic Write's
    /// flag is in 44 already).
    fn rxe(kernel_6_12: bool, rdma_core_55: bool) -> (DeviceAttr, WrApi) {
        use crate::ibv::{NodeType, SendOps, Transport};
        let attr = DeviceAttr {
            name: "rxe0".into(),
            fw_ver: String::new(),
            node_guid: 0,
            vendor_id: 0xffffff,
            vendor_part_id: 0,
            max_qp: 1,
            max_qp_wr: 1,
            max_sge: 1,
            max_sge_rd: 1,
            max_cq: 1,
            max_cqe: 1,
            max_mr: 1,
            max_mr_size: 1,
            max_pd: 1,
            max_qp_rd_atom: 1,
            max_qp_init_rd_atom: 1,
            atomic_cap: AtomicCap::Hca,
            phys_port_cnt: 1,
            device_cap_flags: 0,
            device_cap_flags_ex: 0,
            extended: true,
            flush_global: kernel_6_12,
            flush_persistent: kernel_6_12,
            atomic_write: kernel_6_12,
            node_type: NodeType::Ca,
            transport: Transport::Ib,
        };
        let wr = WrApi {
            ops: SendOps::BASIC_ATOMICS,
            atomic_write: true,
            flush: rdma_core_55,
        };
        (attr, wr)
    }

    fn rxe_caps(kernel_6_12: bool, rdma_core_55: bool) -> Capabilities {
        let (attr, wr) = rxe(kernel_6_12, rdma_core_55);
        capabilities("rxe0", &attr, &wr)
    }

    #[test]
    fn rxe_commit_per_kernel_and_rdma_core() {
        // 6.12 + 55: a device FLUSH, except into file-backed regions.
        let c = rxe_caps(true, true);
        let commit = c.get(OpKind::Commit);
        assert!(commit.is_native(), "{commit}");
        assert_eq!(commit.any_emulation(), Some(Emulation::Agent));
        assert_eq!(commit.emulation(), None);
        let text = commit.to_string();
        assert!(
            text.starts_with("native (ibv_wr_flush, IBV_FLUSH_GLOBAL"),
            "{text}"
        );
        assert!(text.contains("file-backed regions"), "{text}");
        assert!(text.ends_with("msyncs; ≥2 RTT)"), "{text}");
        assert!(c.native_ops().contains(OpKind::Commit));
        assert_eq!(c.get(OpKind::AtomicWrite), &Support::Native);
        // The file-backed case needs the peer's agent.
        assert!(c.needs_agent());
        // 6.12 + 44: the kernel has FLUSH, the library cannot post it.
        let c = rxe_caps(true, false);
        let text = c.get(OpKind::Commit).to_string();
        assert!(
            text.starts_with("emulated (a zero-length RDMA Read"),
            "{text}"
        );
        assert!(
            text.contains("advertises FLUSH (global+persistent), but"),
            "{text}"
        );
        assert!(
            text.contains("without ibv_wr_flush") || text.contains("refuses IBV_QP_EX_WITH_FLUSH"),
            "{text}"
        );
        assert_eq!(c.get(OpKind::AtomicWrite), &Support::Native);
        // 6.1, either library: no FLUSH, no ATOMIC_WRITE in the kernel.
        for lib55 in [false, true] {
            let c = rxe_caps(false, lib55);
            assert_eq!(
                c.get(OpKind::Commit).to_string(),
                "emulated (a zero-length RDMA Read places earlier Writes, then the \
                 responder's stag agent msyncs; ≥2 RTT)"
            );
            assert_eq!(
                c.get(OpKind::AtomicWrite).emulation(),
                Some(Emulation::CasLoop)
            );
        }
    }

    #[test]
    fn a_flush_commit_resolves_against_the_peer() {
        let dev = rxe_caps(true, true);
        let native = dev.native_ops();
        // Both ends FLUSH: it stays a device FLUSH except for files.
        let both = dev.for_connection(&[], Some(native));
        assert!(matches!(
            both.get(OpKind::Commit),
            Support::NativeExcept { .. }
        ));
        // A peer that cannot be FLUSHed into (6.12 + 44): the agent.
        let old = rxe_caps(true, false).native_ops();
        let conn = dev.for_connection(&[], Some(old));
        assert_eq!(conn.get(OpKind::Commit).emulation(), Some(Emulation::Agent));
        // A peer without stag has no stag files: the FLUSH is all there is.
        let plain = dev.for_connection(&[], None);
        assert_eq!(plain.get(OpKind::Commit), &Support::Native);
        // --emulate commit, and ibv_post_send: the agent.
        let forced = dev.for_connection(&[OpKind::Commit], Some(native));
        assert_eq!(
            forced.get(OpKind::Commit).emulation(),
            Some(Emulation::Agent)
        );
        let mut legacy = dev.clone();
        legacy.on_legacy_post();
        assert_eq!(
            legacy.get(OpKind::Commit).emulation(),
            Some(Emulation::Agent)
        );
        assert!(!legacy.native_ops().contains(OpKind::Commit));
    }
}
