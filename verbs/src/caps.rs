//! The capability matrix: for every operation on a device, whether it runs
//! natively, through stag's emulation layer (and how, at what cost), or not
//! at all (and why).

use std::fmt;

use serde::Serialize;

use crate::ibv::{AtomicCap, DeviceAttr};

/// An operation the API offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum OpKind {
    /// Send (and Send with Solicited Event).
    Send,
    /// Send with Invalidate.
    SendInvalidate,
    /// RDMA Write.
    Write,
    /// RDMA Read.
    Read,
    /// RDMA Write followed by 8-byte Immediate Data (RFC 7306 §6).
    WriteImm,
    /// 8-byte Immediate Data, with or without Solicited Event (RFC 7306).
    Imm,
    /// 64-bit FetchAdd.
    FetchAdd,
    /// FetchAdd with an Add Mask (RFC 7306 §5.1.1).
    MaskedFetchAdd,
    /// 64-bit CmpSwap.
    CmpSwap,
    /// CmpSwap with Compare and Swap Masks (RFC 7306 §5.1.2).
    MaskedCmpSwap,
    /// Swap (draft-ietf-storm-rdmap-ext-03).
    Swap,
    /// RDMA Commit (draft-talpey-rdma-commit).
    Commit,
}

impl OpKind {
    /// Every operation, in display order.
    pub const ALL: [OpKind; 12] = [
        OpKind::Send,
        OpKind::SendInvalidate,
        OpKind::Write,
        OpKind::Read,
        OpKind::WriteImm,
        OpKind::Imm,
        OpKind::FetchAdd,
        OpKind::MaskedFetchAdd,
        OpKind::CmpSwap,
        OpKind::MaskedCmpSwap,
        OpKind::Swap,
        OpKind::Commit,
    ];

    /// The name used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Send => "send",
            OpKind::SendInvalidate => "send-inv",
            OpKind::Write => "write",
            OpKind::Read => "read",
            OpKind::WriteImm => "write-imm",
            OpKind::Imm => "imm",
            OpKind::FetchAdd => "fetch-add",
            OpKind::MaskedFetchAdd => "masked-fetch-add",
            OpKind::CmpSwap => "cmp-swap",
            OpKind::MaskedCmpSwap => "masked-cmp-swap",
            OpKind::Swap => "swap",
            OpKind::Commit => "commit",
        }
    }

    /// Parse a command-line name.
    pub fn from_name(name: &str) -> Option<OpKind> {
        OpKind::ALL.into_iter().find(|k| k.name() == name)
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which emulation runs an operation the device lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Emulation {
    /// RDMA Read of the target, then CmpSwap retries until the value sticks
    /// (needs native CmpSwap; works against any peer).
    CasLoop,
    /// The responder's stag library executes it on its memory: atomics
    /// with its CPU's atomics, Commit as read-after-write for placement then
    /// msync. Needs a stag peer (an agent channel set up at connect).
    Agent,
    /// 8-byte Immediate Data: an RDMA Write of the value into the peer's
    /// mailbox, then a zero-length Send that consumes the receive; the
    /// peer's library reports it as Immediate Data. Needs a stag peer.
    ImmMailbox,
}

impl Emulation {
    /// Whether the peer must run stag (an agent channel).
    pub fn needs_peer(self) -> bool {
        !matches!(self, Emulation::CasLoop)
    }

    /// How it runs `op`, in words, and the network round trips it costs
    /// at best (0: one-way messages only).
    fn describe(self, op: OpKind) -> (&'static str, u32) {
        match (self, op) {
            (Emulation::CasLoop, _) => (CAS_LOOP, 2),
            (Emulation::Agent, OpKind::Commit) => (
                "a zero-length RDMA Read places earlier Writes, then the responder's stag agent msyncs",
                2,
            ),
            (Emulation::Agent, _) => ("the responder's stag agent executes it on its CPU", 1),
            (Emulation::ImmMailbox, _) => ("RDMA Write into the peer's mailbox + zero-length Send", 0),
        }
    }

    fn support_for(self, op: OpKind) -> Support {
        let (how, round_trips) = self.describe(op);
        Support::Emulated {
            method: self,
            how: how.to_owned(),
            round_trips,
        }
    }
}

/// How an operation runs on a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "support", rename_all = "kebab-case")]
pub enum Support {
    /// The device does it.
    Native,
    /// stag does it with other operations.
    Emulated {
        /// Which emulation.
        method: Emulation,
        /// How, in words.
        how: String,
        /// Network round trips it costs, best case.
        round_trips: u32,
    },
    /// Neither.
    Unsupported {
        /// Why.
        why: String,
    },
}

impl Support {
    /// Whether the operation can be posted at all.
    pub fn is_available(&self) -> bool {
        !matches!(self, Support::Unsupported { .. })
    }
}

impl fmt::Display for Support {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Support::Native => f.write_str("native"),
            Support::Emulated {
                how, round_trips, ..
            } => {
                if *round_trips == 0 {
                    write!(f, "emulated ({how}; no extra round trip)")
                } else {
                    write!(f, "emulated ({how}; ≥{round_trips} RTT)")
                }
            }
            Support::Unsupported { why } => write!(f, "unsupported ({why})"),
        }
    }
}

/// How work requests reach a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PostPath {
    /// The userspace provider's own send queue.
    Userspace,
    /// libibverbs' extended API: `ibv_wr_start`, `ibv_wr_<op>`,
    /// `ibv_wr_complete` on a QP created by `ibv_create_qp_ex` with
    /// `send_ops_flags` (rxe, mlx5, efa, …).
    Extended,
    /// `ibv_post_send`: the provider has no `send_ops_flags` QPs (siw,
    /// irdma, cxgb4, erdma), or the application asked for this path.
    Legacy,
}

impl fmt::Display for PostPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PostPath::Userspace => "userspace provider send queue",
            PostPath::Extended => "ibv_wr_* (ibv_create_qp_ex send_ops_flags)",
            PostPath::Legacy => "ibv_post_send",
        })
    }
}

/// The matrix for one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Capabilities {
    /// Device name.
    pub device: String,
    /// Transport, e.g. "iWARP (userspace)", "iWARP", "RoCE".
    pub transport: String,
    /// How this device's QPs post work requests.
    pub post_path: PostPath,
    /// One entry per operation, in [`OpKind::ALL`] order.
    pub ops: Vec<(OpKind, Support)>,
}

/// How a CmpSwap retry loop emulates an atomic: read the target, then
/// CmpSwap the computed value until it sticks.
pub(crate) const CAS_LOOP: &str = "RDMA Read, then CmpSwap retries until the value sticks";

impl Capabilities {
    /// The support for `op`.
    pub fn get(&self, op: OpKind) -> &Support {
        self.ops
            .iter()
            .find(|(k, _)| *k == op)
            .map(|(_, s)| s)
            .expect("every OpKind has an entry")
    }

    /// The userspace provider: everything is native.
    pub fn userspace(device: &str) -> Capabilities {
        Capabilities {
            device: device.to_owned(),
            transport: "iWARP (stag userspace provider over TCP)".to_owned(),
            post_path: PostPath::Userspace,
            ops: OpKind::ALL.iter().map(|&k| (k, Support::Native)).collect(),
        }
    }

    /// A libibverbs device, from what it reports.
    pub fn ibverbs(device: &str, attr: &DeviceAttr) -> Capabilities {
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
                OpKind::MaskedFetchAdd | OpKind::MaskedCmpSwap | OpKind::Swap if atomics => {
                    Emulation::CasLoop.support_for(k)
                }
                // No atomics at all (siw): the peer's agent runs them, all
                // of them, so that they stay atomic with respect to each
                // other.
                OpKind::FetchAdd
                | OpKind::CmpSwap
                | OpKind::MaskedFetchAdd
                | OpKind::MaskedCmpSwap
                | OpKind::Swap => Emulation::Agent.support_for(k),
                // IBV_WR_FLUSH needs rdma-core ≥ 45 (Debian 12 has 44) and
                // the ibv_wr_* API: until both are there the agent does
                // Commit everywhere. Say when the device itself could.
                OpKind::Commit => {
                    let mut s = Emulation::Agent.support_for(k);
                    if attr.flush_global || attr.flush_persistent {
                        if let Support::Emulated { how, .. } = &mut s {
                            how.push_str(&format!(
                                "; the device advertises FLUSH ({}{}) but {}",
                                if attr.flush_global { "global" } else { "" },
                                match (attr.flush_global, attr.flush_persistent) {
                                    (true, true) => "+persistent",
                                    (false, true) => "persistent",
                                    _ => "",
                                },
                                if crate::ibv::HAS_WR_FLUSH {
                                    "native FLUSH is not wired to Commit yet"
                                } else {
                                    "the installed rdma-core has no ibv_wr_flush"
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
            post_path: if attr.wr_api {
                PostPath::Extended
            } else {
                PostPath::Legacy
            },
            ops,
        }
    }

    /// Replace native support for `ops` by an emulation (to test or
    /// measure the emulation layer on a device that does not need it):
    /// masked atomics and Swap by the CmpSwap loop, plain atomics and
    /// Commit by the agent, Immediate Data by the mailbox.
    pub fn force_emulation(&mut self, ops: &[OpKind]) {
        for (k, s) in self.ops.iter_mut() {
            if !ops.contains(k) || *s != Support::Native {
                continue;
            }
            let method = match k {
                OpKind::MaskedFetchAdd | OpKind::MaskedCmpSwap | OpKind::Swap => Emulation::CasLoop,
                OpKind::FetchAdd | OpKind::CmpSwap | OpKind::Commit => Emulation::Agent,
                OpKind::Imm | OpKind::WriteImm => Emulation::ImmMailbox,
                _ => continue,
            };
            *s = method.support_for(*k);
        }
    }

    /// Whether any operation needs a stag peer (so connections set up an
    /// agent channel).
    pub fn needs_agent(&self) -> bool {
        self.ops
            .iter()
            .any(|(_, s)| matches!(s, Support::Emulated { method, .. } if method.needs_peer()))
    }
}

impl fmt::Display for Capabilities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} — {}", self.device, self.transport)?;
        writeln!(f, "  posts with        {}", self.post_path)?;
        for (k, s) in &self.ops {
            writeln!(f, "  {:<17} {}", k.name(), s)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for k in OpKind::ALL {
            assert_eq!(OpKind::from_name(k.name()), Some(k));
        }
        assert_eq!(OpKind::from_name("nope"), None);
    }

    #[test]
    fn forced_emulation_only_touches_emulatable_ops() {
        let mut c = Capabilities::userspace("stag0");
        assert!(!c.needs_agent());
        c.force_emulation(&[OpKind::Swap, OpKind::Write, OpKind::Commit]);
        assert!(matches!(
            c.get(OpKind::Swap),
            Support::Emulated {
                method: Emulation::CasLoop,
                ..
            }
        ));
        assert!(matches!(
            c.get(OpKind::Commit),
            Support::Emulated {
                method: Emulation::Agent,
                ..
            }
        ));
        assert_eq!(c.get(OpKind::Write), &Support::Native);
        assert_eq!(c.get(OpKind::MaskedFetchAdd), &Support::Native);
        assert!(c.needs_agent());
    }
}
