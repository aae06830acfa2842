//! The memory registration table: STag → region, protection domain, access
//! rights and bounds, and the only code in the provider that touches
//! registered memory.
//!
//! STags follow the usual verbs layout: the upper 24 bits index the table,
//! the low 8 bits are a key drawn at random on every registration, so a stale
//! or guessed STag is rejected even when its index is reused. The same value
//! serves as lkey and rkey.
//!
//! Every access is checked (valid entry, key, PD, access right, bounds) while
//! the table's read lock is held; deregistration takes the write lock, so a
//! region's memory is never touched after [`MrTable::deregister`] returns.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use crate::wire::fpdu::Crc32c;
use crate::wire::Error;

/// Access rights of a memory region, with libibverbs' `IBV_ACCESS_*` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// `IBV_ACCESS_LOCAL_WRITE`: the device may write it for local WRs (Recv, Read sink, atomic result).
    pub const LOCAL_WRITE: Access = Access(1);
    /// `IBV_ACCESS_REMOTE_WRITE`: target of RDMA Write.
    pub const REMOTE_WRITE: Access = Access(1 << 1);
    /// `IBV_ACCESS_REMOTE_READ`: source of RDMA Read.
    pub const REMOTE_READ: Access = Access(1 << 2);
    /// `IBV_ACCESS_REMOTE_ATOMIC`: target of FetchAdd, CmpSwap and Swap.
    pub const REMOTE_ATOMIC: Access = Access(1 << 3);
    /// `IBV_ACCESS_FLUSH_GLOBAL`: target of a Commit for global visibility.
    pub const FLUSH_GLOBAL: Access = Access(1 << 8);
    /// `IBV_ACCESS_FLUSH_PERSISTENT`: target of a Commit for durability.
    pub const FLUSH_PERSISTENT: Access = Access(1 << 9);
    /// Remote peers may invalidate this STag with Send with Invalidate.
    pub const REMOTE_INVALIDATE: Access = Access(1 << 16);

    /// No rights at all.
    pub const fn empty() -> Access {
        Access(0)
    }
    /// The raw bits.
    pub const fn bits(self) -> u32 {
        self.0
    }
    /// Build from raw bits, keeping only the ones defined here.
    pub const fn from_bits_truncate(bits: u32) -> Access {
        Access(bits & (1 | 1 << 1 | 1 << 2 | 1 << 3 | 1 << 8 | 1 << 9 | 1 << 16))
    }
    /// Both sets of rights (usable in constants).
    pub const fn union(self, other: Access) -> Access {
        Access(self.0 | other.0)
    }
    /// Whether every right in `other` is present.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl core::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

/// A protection domain handle. Regions and queue pairs of different PDs never
/// see each other.
pub type PdId = u32;

/// A registered range of memory.
#[derive(Debug)]
struct Entry {
    key: u8,
    pd: PdId,
    base: NonNull<u8>,
    /// The address peers and SGEs use for the first byte (a virtual address
    /// as in libibverbs; the TO of a tagged message is such an address).
    iova: u64,
    len: u64,
    access: Access,
    /// File-backed: a Commit msyncs the range.
    durable: bool,
    /// Being deregistered ([`MrTable::revoke`]): every check fails, only
    /// [`MrTable::snapshot`] still reads it.
    revoked: bool,
}

// SAFETY: an Entry is only a description of memory the registrant promised
// (in `MrTable::register`'s contract) stays valid until deregistration; it
// owns nothing thread-bound, and every dereference happens under the table's
// lock in this module.
unsafe impl Send for Entry {}
// SAFETY: see `Send`; shared access only reads the description.
unsafe impl Sync for Entry {}

/// Why a Commit failed: it returns a status to the requester and does not
/// terminate the stream (draft-talpey-rdma-commit §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CommitError {
    /// The STag, PD, rights or bounds check failed.
    #[error("commit target invalid: {0}")]
    Invalid(Error),
    /// msync reported an error (errno).
    #[error("msync failed: errno {0}")]
    Sync(i32),
}

impl CommitError {
    /// The non-zero status carried in the Commit Response.
    pub fn status(&self) -> u32 {
        match self {
            CommitError::Invalid(Error::InvalidStag(_)) => 1,
            CommitError::Invalid(Error::BaseBounds) => 2,
            CommitError::Invalid(Error::AccessRights) => 3,
            CommitError::Invalid(Error::StagNotAssociated(_)) => 4,
            CommitError::Invalid(_) => 5,
            CommitError::Sync(_) => 6,
        }
    }
}

/// The operation of an RFC 7306 atomic (and draft-03 Swap), with its masks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    /// Masked FetchAdd: `mask` bits mark where carries stop.
    FetchAdd { add: u64, mask: u64 },
    /// Masked CmpSwap.
    CmpSwap {
        compare: u64,
        compare_mask: u64,
        swap: u64,
        swap_mask: u64,
    },
    /// Swap (draft-ietf-storm-rdmap-ext-03 §5.1.2; it has no mask).
    Swap { swap: u64 },
}

/// Where a memory access comes from: the checks differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// Our own WRs (SGEs), addressed by lkey.
    Local,
    /// A peer's tagged message, addressed by rkey (errors are RDMAP errors).
    Remote,
    /// A peer's DDP tagged placement (errors are DDP tagged-buffer errors).
    RemoteDdp,
}

/// The registration table of one device.
#[derive(Debug, Default)]
pub struct MrTable {
    inner: RwLock<Slots>,
}

#[derive(Debug, Default)]
struct Slots {
    /// Index 0 is never used so that STag 0 is never valid.
    entries: Vec<Option<Entry>>,
    free: Vec<u32>,
}

/// The largest index the 24-bit STag index field allows.
const MAX_INDEX: usize = (1 << 24) - 1;

impl MrTable {
    /// An empty table.
    pub fn new() -> MrTable {
        MrTable::default()
    }

    /// Register `len` bytes at `base`, visible to peers and SGEs at `iova`.
    /// Returns the STag (used as both lkey and rkey).
    ///
    /// # Safety
    /// `base..base+len` must stay valid for reads and writes (and, for
    /// `durable`, be a shared file mapping) until [`MrTable::deregister`]
    /// returns for this STag; nothing else may assume exclusive access to it
    /// meanwhile (the device writes it concurrently, like an RNIC does).
    pub unsafe fn register(
        &self,
        pd: PdId,
        base: NonNull<u8>,
        iova: u64,
        len: u64,
        access: Access,
        durable: bool,
    ) -> Result<u32, RegisterError> {
        if iova.checked_add(len).is_none() {
            return Err(RegisterError::Bounds);
        }
        let mut slots = self.inner.write().unwrap_or_else(|p| p.into_inner());
        if slots.entries.is_empty() {
            slots.entries.push(None);
        }
        let index = match slots.free.pop() {
            Some(i) => i as usize,
            None => {
                if slots.entries.len() > MAX_INDEX {
                    return Err(RegisterError::TableFull);
                }
                slots.entries.push(None);
                slots.entries.len() - 1
            }
        };
        let key = random_key();
        slots.entries[index] = Some(Entry {
            key,
            pd,
            base,
            iova,
            len,
            access,
            durable,
            revoked: false,
        });
        Ok(((index as u32) << 8) | key as u32)
    }

    /// Remove a registration. Waits for any access in progress; afterwards
    /// the memory is never touched again through this STag. (Output
    /// already framed from it is not rescued: the device's deregistration,
    /// [`ProtectionDomain::dereg_mr`](crate::device::ProtectionDomain::dereg_mr),
    /// does that between [`revoke`](Self::revoke) and
    /// [`remove_revoked`](Self::remove_revoked).)
    pub fn deregister(&self, stag: u32) -> Result<(), Error> {
        self.revoke(stag)?;
        self.remove_revoked(stag);
        Ok(())
    }

    /// First step of a deregistration: from now on every check of `stag`
    /// fails as if it were gone (new WRs, framing, placement, peers), but
    /// the entry stays so that output already framed from it can be
    /// copied out with [`snapshot`](Self::snapshot). Waits for any access
    /// in progress.
    pub fn revoke(&self, stag: u32) -> Result<(), Error> {
        let mut slots = self.inner.write().unwrap_or_else(|p| p.into_inner());
        match slots.entries.get_mut((stag >> 8) as usize) {
            Some(Some(e)) if e.key == stag as u8 && !e.revoked => {
                e.revoked = true;
                Ok(())
            }
            _ => Err(Error::InvalidStag(stag)),
        }
    }

    /// Last step of a deregistration: drop the revoked entry. Waits for
    /// any access in progress; afterwards the memory is never touched.
    pub fn remove_revoked(&self, stag: u32) {
        let mut slots = self.inner.write().unwrap_or_else(|p| p.into_inner());
        let index = (stag >> 8) as usize;
        if let Some(Some(e)) = slots.entries.get(index) {
            if e.key == stag as u8 && e.revoked {
                slots.entries[index] = None;
                slots.free.push(index as u32);
            }
        }
    }

    /// Append `[addr, addr+len)` of `stag` to `out`, whether or not the
    /// STag is revoked (the copy a deregistration makes of payloads that
    /// are framed but not yet written). Only bounds are checked: the
    /// octets were checked when they were framed. Returns false (and
    /// appends nothing) if the entry or the range is not there.
    pub fn snapshot(&self, stag: u32, addr: u64, len: u64, out: &mut Vec<u8>) -> bool {
        let slots = self.inner.read().unwrap_or_else(|p| p.into_inner());
        let Some(Some(e)) = slots.entries.get((stag >> 8) as usize) else {
            return false;
        };
        let inside = matches!(addr.checked_add(len), Some(end) if end <= e.iova + e.len);
        if e.key != stag as u8 || addr < e.iova || !inside {
            return false;
        }
        let offset = (addr - e.iova) as usize;
        // SAFETY: `offset + len <= e.len` (checked above), inside memory the
        // registrant keeps valid until the entry is removed, which waits for
        // the read lock held here; the slice lives only for the copy.
        let src = unsafe { std::slice::from_raw_parts(e.base.as_ptr().add(offset), len as usize) };
        out.extend_from_slice(src);
        true
    }

    /// Invalidate an STag on behalf of a peer's Send with Invalidate.
    pub fn remote_invalidate(&self, stag: u32, pd: PdId) -> Result<(), Error> {
        let mut slots = self.inner.write().unwrap_or_else(|p| p.into_inner());
        let index = (stag >> 8) as usize;
        match slots.entries.get(index) {
            Some(Some(e)) if e.key == stag as u8 && !e.revoked => {
                if e.pd != pd {
                    return Err(Error::StagNotAssociated(stag));
                }
                if !e.access.contains(Access::REMOTE_INVALIDATE) {
                    return Err(Error::CannotInvalidate(stag));
                }
                slots.entries[index] = None;
                slots.free.push(index as u32);
                Ok(())
            }
            _ => Err(Error::InvalidStag(stag)),
        }
    }

    /// Whether `stag` is currently registered.
    pub fn is_valid(&self, stag: u32) -> bool {
        let slots = self.inner.read().unwrap_or_else(|p| p.into_inner());
        matches!(slots.entries.get((stag >> 8) as usize), Some(Some(e)) if e.key == stag as u8 && !e.revoked)
    }

    /// Run `f` on the checked bytes `[addr, addr+len)` of `stag`.
    fn with_range<R>(
        &self,
        origin: Origin,
        (stag, pd, addr, len): (u32, PdId, u64, u64),
        need: Access,
        f: impl FnOnce(&Entry, NonNull<u8>) -> R,
    ) -> Result<R, Error> {
        let slots = self.inner.read().unwrap_or_else(|p| p.into_inner());
        // The entry and pointer are used only while the read lock is held.
        let (entry, ptr) = checked_range(&slots, origin, (stag, pd, addr, len), need)?;
        Ok(f(entry, ptr))
    }

    /// Copy `data` into `[addr, addr+len)` of a region, after the checks
    /// `origin` calls for. Empty copies touch nothing and check nothing
    /// (a zero-length tagged message, e.g. an RFC 6581 RTR Write, carries
    /// an STag nobody validates).
    fn copy_in(
        &self,
        origin: Origin,
        key: u32,
        pd: PdId,
        addr: u64,
        need: Access,
        data: &[u8],
    ) -> Result<(), Error> {
        if data.is_empty() {
            return Ok(());
        }
        self.with_range(
            origin,
            (key, pd, addr, data.len() as u64),
            need,
            |_, dst| {
                // SAFETY: `dst` points at `data.len()` checked bytes of a
                // registered region; `data` is our own buffer and cannot
                // overlap memory the peer addresses.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst.as_ptr(), data.len()) }
            },
        )
    }

    /// Copy `out.len()` bytes at `addr` of a region out, after the checks
    /// `origin` calls for.
    fn copy_out(
        &self,
        origin: Origin,
        key: u32,
        pd: PdId,
        addr: u64,
        need: Access,
        out: &mut [u8],
    ) -> Result<(), Error> {
        if out.is_empty() {
            return Ok(());
        }
        self.with_range(origin, (key, pd, addr, out.len() as u64), need, |_, src| {
            // SAFETY: `src` points at `out.len()` checked bytes of a
            // registered region; `out` is our own buffer.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), out.as_mut_ptr(), out.len()) }
        })
    }

    /// Run `f` with a [`ReadScope`]: shared views of registered memory,
    /// checked like [`read_local`](Self::read_local) and
    /// [`read_remote`](Self::read_remote), that cannot outlive the call.
    /// The table's read lock is held throughout, so no region seen through
    /// the scope is deregistered meanwhile; `f` must not call back into
    /// this table (a waiting deregistration would block it).
    pub fn read_scope<R>(&self, f: impl FnOnce(&ReadScope<'_>) -> R) -> R {
        let slots = self.inner.read().unwrap_or_else(|p| p.into_inner());
        f(&ReadScope { slots: &slots })
    }

    /// Check that a peer's tagged DDP segment of `len` octets may be placed
    /// at `to` ([`place_tagged`](Self::place_tagged)'s checks and errors,
    /// touching nothing).
    pub fn check_tagged(&self, stag: u32, pd: PdId, to: u64, len: u64) -> Result<(), Error> {
        if len == 0 {
            return Ok(());
        }
        self.with_range(
            Origin::RemoteDdp,
            (stag, pd, to, len),
            Access::REMOTE_WRITE,
            |_, _| (),
        )
    }

    /// Copy `data` to the front of `target`, each piece after the checks
    /// its kind calls for ([`place_tagged`](Self::place_tagged) or
    /// [`write_local`](Self::write_local)). Octets beyond the target are an
    /// error and are not placed.
    pub fn place_copy(&self, target: &PlaceTarget, mut data: &[u8]) -> Result<(), Error> {
        for seg in target.segs() {
            if data.is_empty() {
                break;
            }
            let n = (seg.len as usize).min(data.len());
            let (origin, need) = seg.kind.check();
            self.copy_in(origin, seg.key, target.pd, seg.addr, need, &data[..n])?;
            data = &data[n..];
        }
        if data.is_empty() {
            Ok(())
        } else {
            Err(Error::DdpBaseBounds)
        }
    }

    /// Read from `fd` straight into `target` (then into `tail`), with one
    /// `readv`, and extend `crc` over the octets that landed in the target.
    /// Every piece is checked (STag, PD, rights, bounds) and the table's
    /// read lock is held across the syscall, so no region of the target can
    /// be deregistered while the kernel writes into it. The outer error is
    /// a failed check (nothing was read); the inner one the syscall's.
    pub fn recv_placed(
        &self,
        fd: BorrowedFd<'_>,
        target: &PlaceTarget,
        tail: &mut [u8],
        crc: Option<&mut Crc32c>,
    ) -> Result<io::Result<usize>, Error> {
        let slots = self.inner.read().unwrap_or_else(|p| p.into_inner());
        let empty = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        let mut iov = [empty; MAX_PLACE_SEGS + 1];
        let mut count = 0;
        for seg in target.segs() {
            let (origin, need) = seg.kind.check();
            let key = (seg.key, target.pd, seg.addr, u64::from(seg.len));
            let ptr = checked_range(&slots, origin, key, need)?.1;
            iov[count] = libc::iovec {
                iov_base: ptr.as_ptr().cast(),
                iov_len: seg.len as usize,
            };
            count += 1;
        }
        iov[count] = libc::iovec {
            iov_base: tail.as_mut_ptr().cast(),
            iov_len: tail.len(),
        };
        count += 1;
        // SAFETY: every iovec but the last covers checked octets of a
        // registered region, valid by `register`'s contract until
        // deregistration, which waits for the read lock held here until
        // after the syscall; the last is our own `tail`. The kernel writes
        // through raw pointers: no Rust reference to region memory exists
        // meanwhile, so concurrent application access is the same DMA race
        // an RNIC has (verbs leaves it undefined), not aliasing UB.
        let rc = unsafe { libc::readv(fd.as_raw_fd(), iov.as_ptr(), count as libc::c_int) };
        if rc < 0 {
            return Ok(Err(io::Error::last_os_error()));
        }
        let got = rc as usize;
        if let Some(crc) = crc {
            let mut left = got;
            for v in &iov[..count - 1] {
                if left == 0 {
                    break;
                }
                let n = v.iov_len.min(left);
                // SAFETY: the first `n` octets of this iovec were just
                // written by readv into checked region memory, still
                // registered (read lock held); the slice lives only for
                // the CRC update below.
                let placed = unsafe { std::slice::from_raw_parts(v.iov_base.cast::<u8>(), n) };
                crc.update(placed);
                left -= n;
            }
        }
        Ok(Ok(got))
    }

    /// Place a peer's tagged DDP segment (RDMA Write, Read Response sink).
    pub fn place_tagged(&self, stag: u32, pd: PdId, to: u64, data: &[u8]) -> Result<(), Error> {
        self.copy_in(Origin::RemoteDdp, stag, pd, to, Access::REMOTE_WRITE, data)
    }

    /// Copy `out.len()` bytes of a peer-readable region into `out` (the
    /// source of an RDMA Read Response).
    pub fn read_remote(&self, stag: u32, pd: PdId, to: u64, out: &mut [u8]) -> Result<(), Error> {
        self.copy_out(Origin::Remote, stag, pd, to, Access::REMOTE_READ, out)
    }

    /// Check that a peer may read `[to, to+len)` (done once per Read
    /// Request, before any response goes out).
    pub fn check_remote(
        &self,
        stag: u32,
        pd: PdId,
        to: u64,
        len: u64,
        need: Access,
    ) -> Result<(), Error> {
        if len == 0 {
            return Ok(());
        }
        self.with_range(Origin::Remote, (stag, pd, to, len), need, |_, _| ())
    }

    /// Copy bytes out of a local SGE (gather for Send/Write/Read Response).
    pub fn read_local(&self, lkey: u32, pd: PdId, addr: u64, out: &mut [u8]) -> Result<(), Error> {
        self.copy_out(Origin::Local, lkey, pd, addr, Access::empty(), out)
    }

    /// Write bytes into a local SGE (scatter for Recv, Read Response, atomic result).
    pub fn write_local(&self, lkey: u32, pd: PdId, addr: u64, data: &[u8]) -> Result<(), Error> {
        self.copy_in(Origin::Local, lkey, pd, addr, Access::LOCAL_WRITE, data)
    }

    /// Check a local SGE without touching it.
    pub fn check_local(
        &self,
        lkey: u32,
        pd: PdId,
        addr: u64,
        len: u64,
        write: bool,
    ) -> Result<(), Error> {
        let need = if write {
            Access::LOCAL_WRITE
        } else {
            Access::empty()
        };
        if len == 0 {
            return Ok(());
        }
        self.with_range(Origin::Local, (lkey, pd, addr, len), need, |_, _| ())
    }

    /// Execute an RFC 7306 atomic on the 8 bytes at `to`, atomically with
    /// respect to every other atomic of this device (on any QP), and return
    /// the original value. The operand is big-endian on the wire; the target
    /// is a host-order `u64` in memory, as on every RNIC.
    pub fn atomic(&self, stag: u32, pd: PdId, to: u64, op: AtomicOp) -> Result<u64, Error> {
        if !to.is_multiple_of(8) {
            // Checked before the STag so that the peer learns the RFC 7306
            // §8.2 cause even for an otherwise valid target.
            return Err(Error::AtomicMisaligned);
        }
        self.with_range(
            Origin::Remote,
            (stag, pd, to, 8),
            Access::REMOTE_ATOMIC,
            |entry, ptr| {
                // The region's base may itself be unaligned; the RFC's alignment
                // is about the address, so check the real pointer too.
                if !(ptr.as_ptr() as usize).is_multiple_of(8) {
                    return Err(Error::AtomicMisaligned);
                }
                let _ = entry;
                // SAFETY: `ptr` is 8-byte aligned, points at 8 checked bytes of a
                // registered region that stays valid while the read lock is held,
                // and every concurrent device access to it goes through atomics.
                let cell = unsafe { AtomicU64::from_ptr(ptr.as_ptr().cast::<u64>()) };
                let mut current = cell.load(Ordering::Acquire);
                loop {
                    let new = apply(op, current);
                    if new == current {
                        // Nothing changes (e.g. a failed compare): no write.
                        return Ok(current);
                    }
                    match cell.compare_exchange_weak(
                        current,
                        new,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    ) {
                        Ok(_) => return Ok(current),
                        Err(seen) => current = seen,
                    }
                }
            },
        )?
    }

    /// Make `[to, to+len)` of a durable region durable (msync), the
    /// responder side of RDMA Commit.
    pub fn commit(&self, stag: u32, pd: PdId, to: u64, len: u64) -> Result<(), CommitError> {
        self.with_range(
            Origin::Remote,
            (stag, pd, to, len.max(1)),
            Access::empty(),
            |entry, ptr| {
                let persistent = Access::FLUSH_PERSISTENT;
                let global = Access::FLUSH_GLOBAL;
                if !(entry.access.contains(persistent) || entry.access.contains(global)) {
                    return Err(CommitError::Invalid(Error::AccessRights));
                }
                if !entry.durable || len == 0 {
                    // Memory that is not file-backed is globally visible once
                    // placed; placement precedes this in stream order.
                    std::sync::atomic::fence(Ordering::SeqCst);
                    return Ok(());
                }
                msync_range(ptr.as_ptr(), len as usize).map_err(CommitError::Sync)
            },
        )
        .map_err(CommitError::Invalid)?
    }
}

/// The most pieces a [`PlaceTarget`] has (a Read Response scattered
/// across more SGEs takes the copying path).
pub const MAX_PLACE_SEGS: usize = 8;

/// How a piece of a [`PlaceTarget`] is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlaceKind {
    /// A peer's RDMA Write: the rkey needs remote write, errors are DDP
    /// tagged-buffer errors.
    RemoteWrite,
    /// One of our SGEs (a Read Response's sink): the lkey needs local write.
    LocalWrite,
}

impl PlaceKind {
    fn check(self) -> (Origin, Access) {
        match self {
            PlaceKind::RemoteWrite => (Origin::RemoteDdp, Access::REMOTE_WRITE),
            PlaceKind::LocalWrite => (Origin::Local, Access::LOCAL_WRITE),
        }
    }
}

/// One contiguous piece of a [`PlaceTarget`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaceSeg {
    /// The STag (rkey or lkey).
    pub key: u32,
    /// Address (TO or SGE address) of the first octet.
    pub addr: u64,
    /// Octets.
    pub len: u32,
    /// The checks it takes.
    pub kind: PlaceKind,
}

/// Where the payload of one tagged DDP segment goes, in order: decided by
/// the protocol core, checked again (and written) by [`MrTable`] at the
/// moment of placement. Fixed-size: building one allocates nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaceTarget {
    /// The protection domain every piece must belong to.
    pub pd: PdId,
    segs: [PlaceSeg; MAX_PLACE_SEGS],
    count: usize,
}

impl PlaceTarget {
    /// An empty target in `pd`.
    pub const fn new(pd: PdId) -> PlaceTarget {
        const NONE: PlaceSeg = PlaceSeg {
            key: 0,
            addr: 0,
            len: 0,
            kind: PlaceKind::RemoteWrite,
        };
        PlaceTarget {
            pd,
            segs: [NONE; MAX_PLACE_SEGS],
            count: 0,
        }
    }

    /// Append a piece; `false` (and nothing appended) when full. Empty
    /// pieces are dropped.
    pub fn push(&mut self, seg: PlaceSeg) -> bool {
        if seg.len == 0 {
            return true;
        }
        let Some(slot) = self.segs.get_mut(self.count) else {
            return false;
        };
        *slot = seg;
        self.count += 1;
        true
    }

    /// The pieces.
    pub fn segs(&self) -> &[PlaceSeg] {
        &self.segs[..self.count]
    }

    /// Total octets.
    pub fn len(&self) -> u64 {
        self.segs().iter().map(|s| u64::from(s.len)).sum()
    }

    /// No octets at all.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The target less its first `skip` octets, cut to at most `max`.
    pub fn window(&self, mut skip: u64, mut max: u64) -> PlaceTarget {
        let mut out = PlaceTarget::new(self.pd);
        for seg in self.segs() {
            let len = u64::from(seg.len);
            if skip >= len {
                skip -= len;
                continue;
            }
            if max == 0 {
                break;
            }
            let n = (len - skip).min(max);
            out.push(PlaceSeg {
                addr: seg.addr.wrapping_add(skip),
                len: n as u32,
                ..*seg
            });
            max -= n;
            skip = 0;
        }
        out
    }
}

/// Registered memory to read in place, for the duration of
/// [`MrTable::read_scope`]: the transmit path hands these slices straight
/// to `writev` instead of copying them out first.
pub struct ReadScope<'t> {
    slots: &'t Slots,
}

impl ReadScope<'_> {
    /// `len` bytes at `addr` of a local SGE's region (a Send or Write
    /// payload), after [`MrTable::read_local`]'s checks.
    pub fn local(&self, lkey: u32, pd: PdId, addr: u64, len: u32) -> Result<&[u8], Error> {
        self.slice(Origin::Local, (lkey, pd, addr, len), Access::empty())
    }

    /// `len` bytes at `to` of a peer-readable region (a Read Response's
    /// source), after [`MrTable::read_remote`]'s checks.
    pub fn remote(&self, stag: u32, pd: PdId, to: u64, len: u32) -> Result<&[u8], Error> {
        self.slice(Origin::Remote, (stag, pd, to, len), Access::REMOTE_READ)
    }

    fn slice(
        &self,
        origin: Origin,
        (key, pd, addr, len): (u32, PdId, u64, u32),
        need: Access,
    ) -> Result<&[u8], Error> {
        if len == 0 {
            return Ok(&[]);
        }
        let ptr = checked_range(self.slots, origin, (key, pd, addr, len as u64), need)?.1;
        // SAFETY: `ptr` points at `len` checked bytes of a registered
        // region, valid by `register`'s contract until deregistration,
        // which waits for the read lock the enclosing `read_scope` holds
        // for at least the slice's lifetime (it borrows `self`). The bytes
        // may change under the slice only if the application rewrites a
        // buffer of an outstanding WR or a peer writes a region another
        // peer is reading — the same race an RNIC's DMA has, which verbs
        // leaves undefined; we only read them (CRC, writev).
        Ok(unsafe { std::slice::from_raw_parts(ptr.as_ptr(), len as usize) })
    }
}

/// Check `[addr, addr+len)` of `key` for `origin` with right `need`; the
/// entry and a pointer to the first byte.
fn checked_range(
    slots: &Slots,
    origin: Origin,
    (stag, pd, addr, len): (u32, PdId, u64, u64),
    need: Access,
) -> Result<(&Entry, NonNull<u8>), Error> {
    let entry = match slots.entries.get((stag >> 8) as usize) {
        Some(Some(e)) if e.key == stag as u8 && !e.revoked => e,
        _ => {
            return Err(match origin {
                Origin::RemoteDdp => Error::DdpInvalidStag(stag),
                _ => Error::InvalidStag(stag),
            })
        }
    };
    if entry.pd != pd {
        return Err(match origin {
            Origin::RemoteDdp => Error::DdpStagNotAssociated(stag),
            _ => Error::StagNotAssociated(stag),
        });
    }
    if !entry.access.contains(need) {
        return Err(Error::AccessRights);
    }
    let end = addr.checked_add(len).ok_or(match origin {
        Origin::RemoteDdp => Error::DdpToWrap,
        _ => Error::ToWrap,
    })?;
    if addr < entry.iova || end > entry.iova + entry.len {
        return Err(match origin {
            Origin::RemoteDdp => Error::DdpBaseBounds,
            _ => Error::BaseBounds,
        });
    }
    let offset = (addr - entry.iova) as usize;
    // SAFETY: offset + len <= entry.len, checked above, so the pointer
    // stays inside the registered range (valid by `register`'s contract).
    let ptr = unsafe { NonNull::new_unchecked(entry.base.as_ptr().add(offset)) };
    Ok((entry, ptr))
}

/// The value an atomic leaves behind (RFC 7306 arithmetic from
/// [`crate::wire::atomic`]).
fn apply(op: AtomicOp, original: u64) -> u64 {
    use crate::wire::atomic;
    match op {
        AtomicOp::FetchAdd { add, mask } => atomic::fetch_add(original, add, mask),
        AtomicOp::CmpSwap {
            compare,
            compare_mask,
            swap,
            swap_mask,
        } => atomic::cmp_swap(original, compare, compare_mask, swap, swap_mask),
        AtomicOp::Swap { swap } => atomic::swap(original, swap),
    }
}

/// msync the pages covering `[ptr, ptr+len)`.
fn msync_range(ptr: *mut u8, len: usize) -> Result<(), i32> {
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    let start = ptr as usize & !(page - 1);
    let end = ptr as usize + len;
    // SAFETY: the range covers pages of a registered file mapping (checked
    // by the caller); msync only flushes, it reads no Rust-visible memory.
    let rc = unsafe { libc::msync(start as *mut libc::c_void, end - start, libc::MS_SYNC) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO))
    }
}

/// Registration failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// `iova + len` overflows.
    #[error("region bounds overflow")]
    Bounds,
    /// All 2^24 STag indices are in use.
    #[error("registration table full")]
    TableFull,
}

/// A random 8-bit STag key, so a reused index does not revive old STags.
fn random_key() -> u8 {
    let mut b = [0u8; 1];
    if getrandom::getrandom(&mut b).is_err() {
        // Fall back on a counter-like value from the clock; keys are a
        // defence in depth, the PD and bounds checks still hold.
        b[0] = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos() as u8)
            .unwrap_or(0x5a);
    }
    b[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(buf: &mut [u8]) -> (NonNull<u8>, u64) {
        let p = NonNull::new(buf.as_mut_ptr()).unwrap();
        (p, p.as_ptr() as u64)
    }

    #[test]
    fn place_checks_stag_pd_access_bounds() {
        let mut buf = vec![0u8; 64];
        let (p, va) = region(&mut buf);
        let t = MrTable::new();
        // SAFETY: buf outlives the registration (deregistered below).
        let stag = unsafe { t.register(7, p, va, 32, Access::REMOTE_WRITE, false) }.unwrap();
        assert_eq!(t.place_tagged(stag, 7, va + 4, b"abcd"), Ok(()));
        assert_eq!(
            t.place_tagged(stag ^ 1, 7, va, b"x"),
            Err(Error::DdpInvalidStag(stag ^ 1))
        );
        assert_eq!(
            t.place_tagged(stag, 8, va, b"x"),
            Err(Error::DdpStagNotAssociated(stag))
        );
        assert_eq!(
            t.place_tagged(stag, 7, va + 30, b"abc"),
            Err(Error::DdpBaseBounds)
        );
        assert_eq!(
            t.place_tagged(stag, 7, va - 1, b"a"),
            Err(Error::DdpBaseBounds)
        );
        assert_eq!(
            t.place_tagged(stag, 7, u64::MAX, b"ab"),
            Err(Error::DdpToWrap)
        );
        let mut out = [0u8; 4];
        assert_eq!(
            t.read_remote(stag, 7, va + 4, &mut out),
            Err(Error::AccessRights)
        );
        t.deregister(stag).unwrap();
        assert_eq!(
            t.place_tagged(stag, 7, va, b"x"),
            Err(Error::DdpInvalidStag(stag))
        );
        assert_eq!(&buf[4..8], b"abcd");
        assert!(
            buf[32..].iter().all(|&b| b == 0),
            "nothing outside the region"
        );
    }

    #[test]
    fn stale_stag_after_reuse_is_rejected() {
        let mut buf = vec![0u8; 8];
        let (p, va) = region(&mut buf);
        let t = MrTable::new();
        let mut seen = Vec::new();
        for _ in 0..16 {
            // SAFETY: buf outlives every registration.
            let s = unsafe { t.register(1, p, va, 8, Access::REMOTE_WRITE, false) }.unwrap();
            seen.push(s);
            t.deregister(s).unwrap();
        }
        // Same index every time, and no key twice in a row is the point of
        // the key; at least the table rejects all of them now.
        assert!(seen.iter().all(|s| s >> 8 == seen[0] >> 8));
        assert!(seen.iter().all(|&s| !t.is_valid(s)));
    }

    #[test]
    fn atomics_are_checked_and_exact() {
        let mut buf = vec![0u64; 4];
        let p = NonNull::new(buf.as_mut_ptr().cast::<u8>()).unwrap();
        let va = p.as_ptr() as u64;
        let t = MrTable::new();
        // SAFETY: buf outlives the registration.
        let stag = unsafe { t.register(1, p, va, 32, Access::REMOTE_ATOMIC, false) }.unwrap();
        let add = AtomicOp::FetchAdd { add: 5, mask: 0 };
        assert_eq!(t.atomic(stag, 1, va + 8, add), Ok(0));
        assert_eq!(t.atomic(stag, 1, va + 8, add), Ok(5));
        assert_eq!(t.atomic(stag, 1, va + 4, add), Err(Error::AtomicMisaligned));
        assert_eq!(t.atomic(stag, 1, va + 32, add), Err(Error::BaseBounds));
        let cas = AtomicOp::CmpSwap {
            compare: 10,
            compare_mask: u64::MAX,
            swap: 99,
            swap_mask: u64::MAX,
        };
        assert_eq!(t.atomic(stag, 1, va + 8, cas), Ok(10));
        assert_eq!(
            t.atomic(stag, 1, va + 8, cas),
            Ok(99),
            "compare fails, no swap"
        );
        t.deregister(stag).unwrap();
        assert_eq!(buf[1], 99);
    }

    #[test]
    fn concurrent_fetch_add_is_atomic() {
        let mut buf = vec![0u64; 1];
        let p = NonNull::new(buf.as_mut_ptr().cast::<u8>()).unwrap();
        let va = p.as_ptr() as u64;
        let t = std::sync::Arc::new(MrTable::new());
        // SAFETY: buf outlives the registration (threads are joined first).
        let stag = unsafe { t.register(1, p, va, 8, Access::REMOTE_ATOMIC, false) }.unwrap();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let t = t.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        t.atomic(stag, 1, va, AtomicOp::FetchAdd { add: 1, mask: 0 })
                            .unwrap();
                    }
                })
            })
            .collect();
        for th in threads {
            th.join().unwrap();
        }
        t.deregister(stag).unwrap();
        assert_eq!(buf[0], 40_000);
    }

    #[test]
    fn commit_needs_flush_rights() {
        let mut buf = vec![0u8; 16];
        let (p, va) = region(&mut buf);
        let t = MrTable::new();
        // SAFETY: buf outlives the registrations.
        let plain = unsafe { t.register(1, p, va, 16, Access::REMOTE_WRITE, false) }.unwrap();
        let flush = unsafe { t.register(1, p, va, 16, Access::FLUSH_PERSISTENT, false) }.unwrap();
        assert_eq!(
            t.commit(plain, 1, va, 8),
            Err(CommitError::Invalid(Error::AccessRights))
        );
        assert_eq!(t.commit(flush, 1, va, 8), Ok(()));
        assert_eq!(
            t.commit(flush, 1, va, 17),
            Err(CommitError::Invalid(Error::BaseBounds))
        );
        assert_ne!(CommitError::Invalid(Error::BaseBounds).status(), 0);
    }
}
