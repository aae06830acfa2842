//! Owned memory for registration: anonymous page-aligned mappings, or
//! file-backed shared mappings whose bytes a Commit makes durable.
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

/// An owned mapping.
#[derive(Debug)]
pub struct Region {
    map: MmapMut,
    file: Option<File>,
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
        Ok(Region { map, file: None })
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
            map,
            file: Some(file),
        })
    }

    /// Whether it is file-backed.
    pub fn is_durable(&self) -> bool {
        self.file.is_some()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether it is empty (never: mappings have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The first byte, for registration.
    pub fn as_ptr(&self) -> NonNull<u8> {
        // A mapping's pointer is never null.
        NonNull::new(self.map.as_ptr() as *mut u8).unwrap_or(NonNull::dangling())
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
        if !offset.is_multiple_of(8) {
            return Err(RegionError::Misaligned(offset));
        }
        // SAFETY: in bounds, 8-byte aligned (mappings are page-aligned), and
        // the device accesses such words only atomically.
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
        Ok(self.map.flush_range(offset, len))
    }

    /// msync the whole region (durable regions) to its file.
    pub fn sync(&self) -> std::io::Result<()> {
        self.map.flush()
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
