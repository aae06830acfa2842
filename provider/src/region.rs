//! Owned memory for registration: anonymous page-aligned mappings,
//! file-backed shared mappings whose bytes a Commit makes durable, or
//! memory the application already had (a `Box<[u8]>`/`Vec<u8>`, or a
//! `memmap2::MmapMut` such as a huge-page mapping), given back whole by
//! [`Region::into_owned`].
//!
//! A registered region is shared with the device, which writes it whenever
//! a peer's message lands, so safe code never gets a `&mut [u8]` to it:
//! bytes go in and out by copy ([`Region::write_at`], [`Region::read_at`])
//! and 64-bit words by atomic access ([`Region::load_u64`]).

use std::fs::{File, OpenOptions};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapMut, MmapOptions};

/// Owned memory for registration.
#[derive(Debug)]
pub struct Region {
    memory: Memory,
    file: Option<File>,
}

#[derive(Debug)]
enum Memory {
    Map(MmapMut),
    /// An application's heap buffer, held as a raw pointer from
    /// `Box::into_raw` so that no `Box` asserts unique access while the
    /// device writes it; rebuilt into the `Box` on the way out.
    Heap {
        ptr: NonNull<u8>,
        len: usize,
    },
}

// SAFETY: `Heap` owns its allocation exactly as the `Box` it came from
// did, and every access through a shared `Region` is a raw copy or an
// atomic, as for the mapping.
unsafe impl Send for Memory {}
// SAFETY: as above.
unsafe impl Sync for Memory {}

impl Drop for Memory {
    fn drop(&mut self) {
        if let Memory::Heap { ptr, len } = *self {
            // SAFETY: ptr/len came from `Box::<[u8]>::into_raw` in
            // `Region::from_boxed` and are dropped once, here.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr.as_ptr(), len)) });
        }
    }
}

/// Memory given back by [`Region::into_owned`], as it was registered.
#[derive(Debug)]
pub enum Owned {
    /// A mapping (anonymous, file-backed or the application's).
    Mmap(MmapMut),
    /// A heap buffer.
    Boxed(Box<[u8]>),
}

/// Out-of-range or misaligned access to a [`Region`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    /// `offset + len` beyond the region.
    #[error("access [{offset}, +{len}) outside a region of {size} bytes")]
    OutOfBounds {
        /// Requested offset.
        offset: usize,
        /// Requested length.
        len: usize,
        /// Region size.
        size: usize,
    },
    /// A 64-bit access not 8-byte aligned.
    #[error("offset {0} is not 8-byte aligned")]
    Misaligned(usize),
}

impl Region {
    /// `len` zeroed bytes, page-aligned.
    pub fn anonymous(len: usize) -> std::io::Result<Region> {
        let map = MmapOptions::new().len(len.max(1)).map_anon()?;
        Ok(Region {
            memory: Memory::Map(map),
            file: None,
        })
    }

    /// An application's mapping (e.g. huge pages), registered as it is.
    pub fn from_mmap(map: MmapMut) -> Region {
        Region {
            memory: Memory::Map(map),
            file: None,
        }
    }

    /// An application's heap buffer (`Vec<u8>` via `into_boxed_slice`).
    /// Its bytes are kept; an empty buffer is refused.
    pub fn from_boxed(buf: Box<[u8]>) -> Result<Region, Box<[u8]>> {
        if buf.is_empty() {
            return Err(buf);
        }
        let len = buf.len();
        let raw = Box::into_raw(buf).cast::<u8>();
        // A non-empty boxed slice's pointer is never null.
        let ptr = NonNull::new(raw).unwrap_or(NonNull::dangling());
        Ok(Region {
            memory: Memory::Heap { ptr, len },
            file: None,
        })
    }

    /// The memory back, as it was registered (bytes as the device left
    /// them).
    pub fn into_owned(self) -> Owned {
        let Region { memory, file } = self;
        drop(file);
        let memory = std::mem::ManuallyDrop::new(memory);
        match &*memory {
            // SAFETY: the map is moved out of a ManuallyDrop that is never
            // used again, so it is dropped once, by the caller.
            Memory::Map(map) => Owned::Mmap(unsafe { std::ptr::read(map) }),
            // SAFETY: ptr/len came from `Box::into_raw`; `memory` is never
            // dropped, so the allocation has this one owner again.
            Memory::Heap { ptr, len } => Owned::Boxed(unsafe {
                Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr.as_ptr(), *len))
            }),
        }
    }

    /// A shared mapping of `len` bytes of the file at `path` (created and
    /// extended as needed): what a Commit msyncs.
    pub fn file_backed(path: &Path, len: usize) -> std::io::Result<Region> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        if file.metadata()?.len() < len as u64 {
            file.set_len(len as u64)?;
        }
        // SAFETY: the mapping is shared with the file; other processes
        // changing the file is the documented purpose of a durable region,
        // and every access here goes through raw copies, never references.
        let map = unsafe { MmapOptions::new().len(len.max(1)).map_mut(&file)? };
        Ok(Region {
            memory: Memory::Map(map),
            file: Some(file),
        })
    }

    /// Whether it is file-backed.
    pub fn is_durable(&self) -> bool {
        self.file.is_some()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &self.memory {
            Memory::Map(m) => m.len(),
            Memory::Heap { len, .. } => *len,
        }
    }

    /// Whether it is empty (never: mappings have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first byte, for registration.
    pub fn as_ptr(&self) -> NonNull<u8> {
        match &self.memory {
            // A mapping's pointer is never null.
            Memory::Map(m) => NonNull::new(m.as_ptr() as *mut u8).unwrap_or(NonNull::dangling()),
            Memory::Heap { ptr, .. } => *ptr,
        }
    }

    /// The address SGEs and peers use for byte `offset`.
    pub fn addr(&self, offset: usize) -> u64 {
        self.as_ptr().as_ptr() as u64 + offset as u64
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), RegionError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(RegionError::OutOfBounds {
                offset,
                len,
                size: self.len(),
            }),
        }
    }

    /// Copy `data` into the region at `offset`.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<(), RegionError> {
        self.check(offset, data.len())?;
        // SAFETY: bounds checked; the mapping lives as long as self; raw
        // copies tolerate the device writing other bytes concurrently.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.as_ptr().as_ptr().add(offset),
                data.len(),
            );
        }
        Ok(())
    }

    /// Copy bytes at `offset` out into `out`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<(), RegionError> {
        self.check(offset, out.len())?;
        // SAFETY: as in `write_at`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.as_ptr().as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            );
        }
        Ok(())
    }

    /// A copy of `len` bytes at `offset`.
    pub fn to_vec(&self, offset: usize, len: usize) -> Result<Vec<u8>, RegionError> {
        let mut v = vec![0u8; len];
        self.read_at(offset, &mut v)?;
        Ok(v)
    }

    fn word(&self, offset: usize) -> Result<&AtomicU64, RegionError> {
        self.check(offset, 8)?;
        // The address, not the offset: a heap buffer need not start on an
        // 8-byte boundary.
        if !self.addr(offset).is_multiple_of(8) {
            return Err(RegionError::Misaligned(offset));
        }
        // SAFETY: in bounds, 8-byte aligned, and the device accesses such
        // words only atomically.
        Ok(unsafe { AtomicU64::from_ptr(self.as_ptr().as_ptr().add(offset).cast::<u64>()) })
    }

    /// Atomically read the host-order `u64` at `offset` (atomic targets,
    /// counters, polled flags).
    pub fn load_u64(&self, offset: usize) -> Result<u64, RegionError> {
        Ok(self.word(offset)?.load(Ordering::Acquire))
    }

    /// Atomically store a host-order `u64` at `offset`.
    pub fn store_u64(&self, offset: usize, value: u64) -> Result<(), RegionError> {
        self.word(offset)?.store(value, Ordering::Release);
        Ok(())
    }

    /// Atomically replace the `u64` at `offset` with `f(current)` (a CAS
    /// loop; atomic with respect to every other atomic access to the word)
    /// and return the value it replaced.
    pub fn fetch_update_u64(
        &self,
        offset: usize,
        f: impl Fn(u64) -> u64,
    ) -> Result<u64, RegionError> {
        let word = self.word(offset)?;
        let mut current = word.load(Ordering::Acquire);
        loop {
            let new = f(current);
            if new == current {
                return Ok(current);
            }
            match word.compare_exchange_weak(current, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(current),
                Err(seen) => current = seen,
            }
        }
    }

    /// msync the pages covering `[offset, offset+len)` to the file.
    pub fn sync_range(
        &self,
        offset: usize,
        len: usize,
    ) -> Result<std::io::Result<()>, RegionError> {
        self.check(offset, len)?;
        Ok(match &self.memory {
            Memory::Map(m) => m.flush_range(offset, len),
            Memory::Heap { .. } => Ok(()),
        })
    }

    /// msync the whole region (durable regions) to its file.
    pub fn sync(&self) -> std::io::Result<()> {
        match &self.memory {
            Memory::Map(m) => m.flush(),
            Memory::Heap { .. } => Ok(()),
        }
    }

    /// The bytes as atomics: a zero-copy view that stays sound while the
    /// device (or a peer's RDMA) writes them. Plain `&[u8]` would not be:
    /// the compiler may assume a shared slice does not change.
    pub fn as_atomic_bytes(&self) -> &[std::sync::atomic::AtomicU8] {
        // SAFETY: `len` bytes from `as_ptr` are owned by self for its
        // lifetime; AtomicU8 has the size and alignment of u8, and every
        // other access to them (copies, the device) tolerates concurrent
        // atomic byte access.
        unsafe {
            std::slice::from_raw_parts(
                self.as_ptr().as_ptr().cast::<std::sync::atomic::AtomicU8>(),
                self.len(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_bounds_checked() {
        let r = Region::anonymous(64).unwrap();
        r.write_at(60, b"abcd").unwrap();
        assert_eq!(r.to_vec(60, 4).unwrap(), b"abcd");
        assert_eq!(
            r.write_at(61, b"abcd"),
            Err(RegionError::OutOfBounds {
                offset: 61,
                len: 4,
                size: 64
            })
        );
        assert!(r.read_at(usize::MAX, &mut [0u8; 2]).is_err());
        r.store_u64(8, 42).unwrap();
        assert_eq!(r.load_u64(8), Ok(42));
        assert_eq!(r.load_u64(4), Err(RegionError::Misaligned(4)));
    }

    #[test]
    fn application_memory_is_used_in_place_and_given_back() {
        let mut v = vec![0u8; 100];
        v[3] = 7;
        let addr = v.as_ptr() as u64;
        let r = Region::from_boxed(v.into_boxed_slice()).unwrap();
        assert_eq!(r.addr(0), addr, "registered where it lives, not copied");
        assert_eq!(r.to_vec(3, 1).unwrap(), [7]);
        r.write_at(10, b"xy").unwrap();
        let atoms = r.as_atomic_bytes();
        assert_eq!(atoms[11].load(Ordering::Relaxed), b'y');
        // Word access follows the address's alignment, not the offset's.
        let aligned = (0..8).find(|o| (addr + o).is_multiple_of(8)).unwrap() as usize;
        r.store_u64(aligned, 5).unwrap();
        if aligned != 0 {
            assert_eq!(r.load_u64(0), Err(RegionError::Misaligned(0)));
        }
        match r.into_owned() {
            Owned::Boxed(b) => {
                assert_eq!(b.len(), 100);
                assert_eq!(&b[10..12], b"xy");
                assert_eq!(b.as_ptr() as u64, addr);
            }
            other => panic!("got {other:?}"),
        }
        assert!(Region::from_boxed(Box::new([])).is_err());
        let map = MmapOptions::new().len(4096).map_anon().unwrap();
        let r = Region::from_mmap(map);
        r.write_at(0, b"m").unwrap();
        match r.into_owned() {
            Owned::Mmap(m) => assert_eq!(m[0], b'm'),
            other => panic!("got {other:?}"),
        }
    }

    #[test]
    fn file_backed_reaches_the_file() {
        let dir = std::env::temp_dir().join(format!("stag-region-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r.bin");
        {
            let r = Region::file_backed(&path, 4096).unwrap();
            assert!(r.is_durable());
            r.write_at(100, b"durable").unwrap();
            r.sync().unwrap();
        }
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[100..107], b"durable");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
