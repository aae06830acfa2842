//! The capability matrix: for every operation on a device, whether it runs
//! natively, through stag's emulation layer (and how, at what cost), or not
//! at all (and why).

use std::fmt;

use serde::Serialize;

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
    /// 64-bit Atomic Write (IBTA `IBV_WR_ATOMIC_WRITE`; the commit draft's
    /// "log update" after a Commit).
    AtomicWrite,
}

impl OpKind {
    /// Every operation, in display order.
    pub const ALL: [OpKind; 13] = [
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
        OpKind::AtomicWrite,
    ];

    /// The operation's code on the wire (stag's connection header sets bit
    /// `code` of its native set; the benchmark names its operation by it).
    /// Written out, not derived from [`OpKind::ALL`]'s display order: a
    /// code never changes once given.
    pub const fn code(self) -> u8 {
        match self {
            OpKind::Send => 0,
            OpKind::SendInvalidate => 1,
            OpKind::Write => 2,
            OpKind::Read => 3,
            OpKind::WriteImm => 4,
            OpKind::Imm => 5,
            OpKind::FetchAdd => 6,
            OpKind::MaskedFetchAdd => 7,
            OpKind::CmpSwap => 8,
            OpKind::MaskedCmpSwap => 9,
            OpKind::Swap => 10,
            OpKind::Commit => 11,
            OpKind::AtomicWrite => 12,
        }
    }

    /// The operation with wire code `code`.
    pub fn from_code(code: u8) -> Option<OpKind> {
        OpKind::ALL.into_iter().find(|k| k.code() == code)
    }

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
            OpKind::AtomicWrite => "atomic-write",
        }
    }

    /// FetchAdd, CmpSwap (plain or masked), Swap or Atomic Write.
    pub fn is_atomic(self) -> bool {
        ATOMICS.contains(&self)
    }

    /// Parse a command-line name.
    pub fn from_name(name: &str) -> Option<OpKind> {
        OpKind::ALL.into_iter().find(|k| k.name() == name)
    }
}

impl From<&provider::wr::SendOp> for OpKind {
    /// Which row of the capability matrix an operation falls in (a plain
    /// FetchAdd has a zero Add Mask; a plain CmpSwap all-ones masks).
    fn from(op: &provider::wr::SendOp) -> OpKind {
        use provider::wr::SendOp;
        match *op {
            SendOp::Send {
                invalidate: None, ..
            } => OpKind::Send,
            SendOp::Send {
                invalidate: Some(_),
                ..
            } => OpKind::SendInvalidate,
            SendOp::Write { .. } => OpKind::Write,
            SendOp::WriteImm { .. } => OpKind::WriteImm,
            SendOp::Read { .. } => OpKind::Read,
            SendOp::Imm { .. } => OpKind::Imm,
            SendOp::FetchAdd { mask: 0, .. } => OpKind::FetchAdd,
            SendOp::FetchAdd { .. } => OpKind::MaskedFetchAdd,
            SendOp::CmpSwap {
                compare_mask: u64::MAX,
                swap_mask: u64::MAX,
                ..
            } => OpKind::CmpSwap,
            SendOp::CmpSwap { .. } => OpKind::MaskedCmpSwap,
            SendOp::Swap { .. } => OpKind::Swap,
            SendOp::Commit { .. } => OpKind::Commit,
            SendOp::AtomicWrite { .. } => OpKind::AtomicWrite,
        }
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

    pub(crate) fn support_for(self, op: OpKind) -> Support {
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
    /// The device does it for some targets, stag's emulation for the
    /// rest: Commit through a device FLUSH, which places data in memory
    /// and makes it visible but cannot write a file-backed region to its
    /// file.
    NativeExcept {
        /// What the device does, in words.
        how: String,
        /// Which targets it cannot serve, and why.
        except: String,
        /// Which emulation serves those.
        method: Emulation,
        /// How, in words.
        emulated: String,
        /// Network round trips the emulated case costs, best case.
        round_trips: u32,
    },
    /// Neither.
    Unsupported {
        /// Why.
        why: String,
    },
}

impl Support {
    /// Which emulation runs it, if one does for every target.
    pub fn emulation(&self) -> Option<Emulation> {
        match self {
            Support::Emulated { method, .. } => Some(*method),
            _ => None,
        }
    }

    /// Whether the device executes it (for every target, or for those
    /// [`Support::NativeExcept`] does not except): what a stag peer is
    /// told the device executes.
    pub fn is_native(&self) -> bool {
        matches!(self, Support::Native | Support::NativeExcept { .. })
    }

    /// Which emulation serves some or all of its targets.
    pub fn any_emulation(&self) -> Option<Emulation> {
        match self {
            Support::Emulated { method, .. } | Support::NativeExcept { method, .. } => {
                Some(*method)
            }
            _ => None,
        }
    }

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
            Support::NativeExcept {
                how,
                except,
                emulated,
                round_trips,
                ..
            } => write!(
                f,
                "native ({how}); {except}: emulated ({emulated}; ≥{round_trips} RTT)"
            ),
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
    /// What QPs and CQs may ask for.
    pub limits: Limits,
}

/// A device's limits, as `ibv_query_device` reports them: what a QP's and
/// a CQ's sizes may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Limits {
    /// `max_qp`.
    pub max_qp: u32,
    /// `max_qp_wr`: WRs per send or receive queue.
    pub max_qp_wr: u32,
    /// `max_sge`: SGEs per WR.
    pub max_sge: u32,
    /// `max_cqe`: entries per CQ.
    pub max_cqe: u32,
    /// `max_mr`.
    pub max_mr: u32,
    /// `max_qp_rd_atom`: inbound Reads and atomics in flight (IRD).
    pub max_qp_rd_atom: u32,
    /// `max_qp_init_rd_atom`: outbound ones (ORD).
    pub max_qp_init_rd_atom: u32,
}

impl Limits {
    /// The userspace provider's: its one table,
    /// [`provider::identity::LIMITS`], which the rdma-core plugin's
    /// `query_device` reports too.
    pub fn userspace() -> Limits {
        let l = provider::identity::LIMITS;
        Limits {
            max_qp: l.max_qp,
            max_qp_wr: l.max_qp_wr,
            max_sge: l.max_sge,
            max_cqe: l.max_cqe,
            max_mr: l.max_mr,
            max_qp_rd_atom: l.max_rd_atom,
            max_qp_init_rd_atom: l.max_rd_atom,
        }
    }
}

/// Commit through `ibv_wr_flush`, and what that does not reach. stag's
/// durable regions are page-cache file mappings that reach their file by
/// msync; rxe registers FLUSH_PERSISTENT rights on pmem pages only, and a
/// global FLUSH makes data visible, not durable. So a device FLUSH is the
/// whole Commit for memory regions, and file-backed regions, which get no
/// FLUSH rights at the responder (a FLUSH to one fails instead of
/// pretending), keep the read-after-write + msync of the agent.
pub(crate) fn native_flush_commit() -> Support {
    let (emulated, round_trips) = Emulation::Agent.describe(OpKind::Commit);
    Support::NativeExcept {
        how: "ibv_wr_flush, IBV_FLUSH_GLOBAL: placed and globally visible at the responder; \
              1 RTT, no agent"
            .into(),
        except: "file-backed regions (rxe FLUSHes to persistence only into pmem, and a \
                 global FLUSH leaves the page cache unwritten; the first Commit to a region \
                 asks the responder's agent which kind it is)"
            .into(),
        method: Emulation::Agent,
        emulated: emulated.into(),
        round_trips,
    }
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
            limits: Limits::userspace(),
        }
    }

    /// The userspace provider running RFC 5040 only (as kernel siw does):
    /// what siw emulates, it emulates the same way.
    pub fn userspace_rfc5040(device: &str) -> Capabilities {
        let ops = OpKind::ALL
            .iter()
            .map(|&k| {
                let s = match k {
                    OpKind::WriteImm | OpKind::Imm => Emulation::ImmMailbox.support_for(k),
                    _ if k.is_atomic() => Emulation::Agent.support_for(k),
                    OpKind::Commit => Emulation::Agent.support_for(k),
                    _ => Support::Native,
                };
                (k, s)
            })
            .collect();
        Capabilities {
            device: device.to_owned(),
            transport: "iWARP (stag userspace provider over TCP, RFC 5040 only)".to_owned(),
            post_path: PostPath::Userspace,
            ops,
            limits: Limits::userspace(),
        }
    }

    /// Replace native support for `ops` by an emulation (to test or
    /// measure the emulation layer on a device that does not need it):
    /// masked atomics and Swap by the CmpSwap loop, plain atomics and
    /// Commit by the agent, Immediate Data by the mailbox.
    pub fn force_emulation(&mut self, ops: &[OpKind]) {
        for (k, s) in self.ops.iter_mut() {
            if !ops.contains(k) || !s.is_native() {
                continue;
            }
            let method = match k {
                OpKind::MaskedFetchAdd
                | OpKind::MaskedCmpSwap
                | OpKind::Swap
                | OpKind::AtomicWrite => Emulation::CasLoop,
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
            .any(|(_, s)| s.any_emulation().is_some_and(Emulation::needs_peer))
    }
}

/// A set of operations, e.g. those a device executes natively. Carried in
/// stag's connection header as a 16-bit mask (bit [`OpKind::code`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct OpSet(u16);

impl OpSet {
    /// No operation.
    pub const EMPTY: OpSet = OpSet(0);
    /// What every RNIC does (RFC 5040): Send, Send with Invalidate, Write,
    /// Read. Assumed of a stag peer whose header carries no native set.
    pub const RDMAP: OpSet = OpSet(0b1111);

    fn bit(op: OpKind) -> u16 {
        1 << op.code()
    }

    /// The set with `op` added.
    pub fn with(self, op: OpKind) -> OpSet {
        OpSet(self.0 | Self::bit(op))
    }

    /// Whether `op` is in the set.
    pub fn contains(self, op: OpKind) -> bool {
        self.0 & Self::bit(op) != 0
    }

    /// The wire form.
    pub fn bits(self) -> u16 {
        self.0
    }

    /// From the wire form (bits of operations this version does not know
    /// are dropped).
    pub fn from_bits(bits: u16) -> OpSet {
        OpSet(bits & OpKind::ALL.iter().fold(0, |m, &k| m | Self::bit(k)))
    }

    /// The operations in the set, in [`OpKind::ALL`] order.
    pub fn iter(self) -> impl Iterator<Item = OpKind> {
        OpKind::ALL.into_iter().filter(move |&k| self.contains(k))
    }
}

impl FromIterator<OpKind> for OpSet {
    fn from_iter<I: IntoIterator<Item = OpKind>>(iter: I) -> OpSet {
        iter.into_iter().fold(OpSet::EMPTY, OpSet::with)
    }
}

/// The atomics, which stay on one path per connection (an agent's atomic
/// is not atomic with respect to the device's on the same word).
const ATOMICS: [OpKind; 6] = [
    OpKind::FetchAdd,
    OpKind::CmpSwap,
    OpKind::MaskedFetchAdd,
    OpKind::MaskedCmpSwap,
    OpKind::Swap,
    OpKind::AtomicWrite,
];

/// What runs `op` on a connection whose responder lacks it natively (the
/// initiator's device has it): atomics by the CmpSwap loop when the
/// responder has CmpSwap, else by its agent; Immediate Data through the
/// mailbox; Commit by the agent; Send with Invalidate nothing.
fn fallback(op: OpKind, peer_native: OpSet) -> Option<Emulation> {
    match op {
        _ if op.is_atomic() => Some(if peer_native.contains(OpKind::CmpSwap) {
            Emulation::CasLoop
        } else {
            Emulation::Agent
        }),
        OpKind::Imm | OpKind::WriteImm => Some(Emulation::ImmMailbox),
        OpKind::Commit => Some(Emulation::Agent),
        _ => None,
    }
}

/// Whether an initiator whose device does `native` needs the agent channel
/// on a connection to a responder that does `peer_native`, because of
/// what the responder lacks. Both ends compute it from the two headers, so
/// they agree on opening the channel.
pub(crate) fn gap_needs_agent(native: OpSet, peer_native: OpSet) -> bool {
    native.iter().any(|k| {
        !peer_native.contains(k) && fallback(k, peer_native).is_some_and(Emulation::needs_peer)
    })
}

impl Capabilities {
    /// Posting with `ibv_post_send`: Atomic Write, which stag posts with
    /// `ibv_wr_atomic_write` only, falls back to the CmpSwap loop, and
    /// Commit, posted with `ibv_wr_flush` only, to the agent.
    pub(crate) fn on_legacy_post(&mut self) {
        self.post_path = PostPath::Legacy;
        for (k, s) in self.ops.iter_mut() {
            if *k == OpKind::AtomicWrite && *s == Support::Native {
                *s = Emulation::CasLoop.support_for(*k);
            }
            // ... and Commit, posted with ibv_wr_flush only.
            if *k == OpKind::Commit && s.is_native() {
                *s = Emulation::Agent.support_for(*k);
            }
        }
    }

    /// The operations the device does natively.
    pub fn native_ops(&self) -> OpSet {
        self.ops
            .iter()
            .filter(|(_, s)| s.is_native())
            .map(|&(k, _)| k)
            .collect()
    }

    /// The matrix on one connection, from the device's own matrix (no
    /// forced emulation), the operations forced through emulation, and the
    /// responder's native set from a stag peer's header: what the
    /// responder's device cannot execute is emulated instead. `None` is a
    /// peer that runs no stag: native operations stay native (the peer may
    /// still refuse them: probe atomics with
    /// [`crate::QueuePair::probe_atomics`], as RFC 7306 §1.1 suggests), and
    /// what needs the peer's agent becomes unsupported.
    pub fn for_connection(&self, forced: &[OpKind], peer_native: Option<OpSet>) -> Capabilities {
        let mut out = match peer_native {
            Some(p) => self.with_peer(p),
            None => self.clone(),
        };
        out.force_emulation(forced);
        if peer_native.is_none() {
            out.without_agent();
        }
        out
    }

    /// What needs the peer's agent becomes unsupported.
    fn without_agent(&mut self) {
        for (_, s) in self.ops.iter_mut() {
            // A peer without stag has no file-backed stag regions to
            // except: the device FLUSH is all a Commit can be there.
            if let Support::NativeExcept { .. } = s {
                *s = Support::Native;
            }
            if let Support::Emulated { method, how, .. } = s {
                if method.needs_peer() {
                    *s = Support::Unsupported {
                        why: format!(
                            "emulated here ({how}), which needs a stag peer, and this peer \
                             sent no stag header"
                        ),
                    };
                }
            }
        }
    }

    /// Resolve against a responder that executes `peer_native`.
    fn with_peer(&self, peer_native: OpSet) -> Capabilities {
        let mut out = self.clone();
        let cas_native =
            self.get(OpKind::CmpSwap) == &Support::Native && peer_native.contains(OpKind::CmpSwap);
        for (k, s) in out.ops.iter_mut() {
            let peer_has = peer_native.contains(*k);
            let was_native = s.is_native();
            let new = if k.is_atomic() {
                match s {
                    Support::Native if peer_has && cas_native => continue,
                    Support::Emulated {
                        method: Emulation::CasLoop,
                        ..
                    } if cas_native => continue,
                    Support::Unsupported { .. } => continue,
                    _ if cas_native => Emulation::CasLoop,
                    // All atomics go to the agent together.
                    _ => Emulation::Agent,
                }
            } else {
                match s {
                    Support::Native | Support::NativeExcept { .. } if !peer_has => {
                        match fallback(*k, peer_native) {
                            Some(e) => e,
                            None => {
                                *s = Support::Unsupported {
                                    why: format!(
                                    "the peer's device cannot execute {k} and it has no emulation"
                                ),
                                };
                                continue;
                            }
                        }
                    }
                    _ => continue,
                }
            };
            let mut emu = new.support_for(*k);
            if let Support::Emulated { how, .. } = &mut emu {
                if was_native {
                    how.push_str("; the peer's device lacks it");
                }
            }
            *s = emu;
        }
        out
    }
}

impl fmt::Display for Capabilities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} — {}", self.device, self.transport)?;
        writeln!(f, "  posts with        {}", self.post_path)?;
        let l = &self.limits;
        writeln!(
            f,
            "  limits            {} WRs/queue, {} SGEs/WR, {} CQEs/CQ, IRD {} ORD {}",
            l.max_qp_wr, l.max_sge, l.max_cqe, l.max_qp_rd_atom, l.max_qp_init_rd_atom
        )?;
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
    fn wire_codes_are_fixed_and_unique() {
        // The codes are a wire format: this list changes only by growing.
        let codes: Vec<(OpKind, u8)> = OpKind::ALL.iter().map(|&k| (k, k.code())).collect();
        assert_eq!(
            codes,
            [
                (OpKind::Send, 0),
                (OpKind::SendInvalidate, 1),
                (OpKind::Write, 2),
                (OpKind::Read, 3),
                (OpKind::WriteImm, 4),
                (OpKind::Imm, 5),
                (OpKind::FetchAdd, 6),
                (OpKind::MaskedFetchAdd, 7),
                (OpKind::CmpSwap, 8),
                (OpKind::MaskedCmpSwap, 9),
                (OpKind::Swap, 10),
                (OpKind::Commit, 11),
                (OpKind::AtomicWrite, 12),
            ]
        );
        for k in OpKind::ALL {
            assert_eq!(OpKind::from_code(k.code()), Some(k));
        }
        assert_eq!(OpKind::from_code(13), None);
    }

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

    #[test]
    fn op_set_round_trips_and_drops_unknown_bits() {
        let set: OpSet = [OpKind::Send, OpKind::Swap, OpKind::Commit]
            .into_iter()
            .collect();
        assert_eq!(OpSet::from_bits(set.bits()), set);
        assert_eq!(OpSet::from_bits(set.bits() | 0x8000), set);
        assert_eq!(
            set.iter().collect::<Vec<_>>(),
            [OpKind::Send, OpKind::Swap, OpKind::Commit]
        );
        assert_eq!(
            OpSet::RDMAP.iter().collect::<Vec<_>>(),
            [
                OpKind::Send,
                OpKind::SendInvalidate,
                OpKind::Write,
                OpKind::Read
            ]
        );
    }

    #[test]
    fn a_peer_lacking_extensions_moves_them_to_emulation() {
        let full = Capabilities::userspace("stag0");
        let legacy = Capabilities::userspace_rfc5040("stag0");
        let conn = full.for_connection(&[], Some(legacy.native_ops()));
        for k in ATOMICS.into_iter().chain([OpKind::Commit]) {
            assert_eq!(conn.get(k).emulation(), Some(Emulation::Agent), "{k}");
        }
        for k in [OpKind::Imm, OpKind::WriteImm] {
            assert_eq!(conn.get(k).emulation(), Some(Emulation::ImmMailbox), "{k}");
        }
        assert_eq!(conn.get(OpKind::Read), &Support::Native);
        assert!(conn.needs_agent());
        assert!(gap_needs_agent(full.native_ops(), legacy.native_ops()));
        // Full to full: nothing changes; forced emulation still applies.
        let same = full.for_connection(&[OpKind::Swap], Some(full.native_ops()));
        assert_eq!(same.get(OpKind::Swap).emulation(), Some(Emulation::CasLoop));
        assert_eq!(same.get(OpKind::FetchAdd), &Support::Native);
        assert!(!gap_needs_agent(full.native_ops(), full.native_ops()));
    }

    #[test]
    fn a_peer_with_cmp_swap_only_gets_cas_loops() {
        let full = Capabilities::userspace("stag0");
        let peer: OpSet = OpSet::RDMAP.with(OpKind::FetchAdd).with(OpKind::CmpSwap);
        let conn = full.for_connection(&[], Some(peer));
        assert_eq!(conn.get(OpKind::FetchAdd), &Support::Native);
        assert_eq!(conn.get(OpKind::CmpSwap), &Support::Native);
        for k in [OpKind::MaskedFetchAdd, OpKind::MaskedCmpSwap, OpKind::Swap] {
            assert_eq!(conn.get(k).emulation(), Some(Emulation::CasLoop), "{k}");
        }
        // Send with Invalidate has no emulation.
        let conn = full.for_connection(&[], Some(OpSet::EMPTY.with(OpKind::Send)));
        assert!(!conn.get(OpKind::SendInvalidate).is_available());
    }

    #[test]
    fn a_peer_without_stag_cannot_host_an_agent() {
        let legacy = Capabilities::userspace_rfc5040("stag0");
        let conn = legacy.for_connection(&[], None);
        for k in ATOMICS.into_iter().chain([OpKind::Commit, OpKind::Imm]) {
            assert!(
                matches!(conn.get(k), Support::Unsupported { why } if why.contains("no stag header")),
                "{k}"
            );
        }
        assert!(!conn.needs_agent());
        let full = Capabilities::userspace("stag0");
        assert_eq!(full.for_connection(&[], None), full);
    }

    #[test]
    fn userspace_limits_are_the_providers_table() {
        let l = provider::identity::LIMITS;
        for caps in [
            Capabilities::userspace("stag0"),
            Capabilities::userspace_rfc5040("stag0"),
        ] {
            let c = caps.limits;
            assert_eq!(
                (c.max_qp, c.max_qp_wr, c.max_sge, c.max_cqe, c.max_mr),
                (l.max_qp, l.max_qp_wr, l.max_sge, l.max_cqe, l.max_mr)
            );
            assert_eq!(
                (c.max_qp_rd_atom, c.max_qp_init_rd_atom),
                (l.max_rd_atom, l.max_rd_atom)
            );
        }
    }
}
