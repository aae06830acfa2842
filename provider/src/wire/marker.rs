//! MPA markers (RFC 5044 §4.3, §5): the marker view and where markers fall
//! in the stream. The codecs that put them there and take them out are
//! [`super::stream`].
//!
//! A marker is 4 octets: 16 reserved bits (zero on send, ignored on receipt
//! except by the CRC) and `FPDUPTR`, the number of octets from the first
//! octet of the `ULPDU_Length` field of the FPDU the marker lies in to the
//! first octet of the marker (its two low bits are sent as zero and treated
//! as zero on receipt).
//!
//! Placement, as RFC 5044 and Wireshark's `packet-iwarp-mpa.c` agree:
//! - stream offsets count from the first octet after the MPA Request/Reply,
//!   i.e. the first octet of the first FPDU, and include the markers;
//! - a marker sits at every offset that is a multiple of 512, starting with
//!   offset 0: the first marker immediately precedes the first FPDU;
//! - a marker that falls exactly between two FPDUs belongs to the next one:
//!   it precedes that FPDU's length field and its `FPDUPTR` is 0; it is
//!   sent only together with that FPDU;
//! - `ULPDU_Length` and the pad ignore markers;
//! - the CRC covers every octet of the FPDU before the CRC field, markers
//!   included (also a leading one and one just before the CRC).
//!
//! Because FPDUs and markers are multiples of 4 octets and markers sit at
//! multiples of 512, a marker never splits the length field, the pad or the
//! CRC: it lands before the length field, between two ULPDU octets (at ULPDU
//! offsets ≡ 2 mod 4), or between the pad and the CRC.
//!
//! Kernel siw negotiates markers off (it rejects M); they are here for
//! RFC 5044 peers that want them.

use super::fpdu::{fpdu_len, MAX_ULPDU_LEN};
use super::{be_u16, Error, Field, Layer, Result};

/// Distance between markers in the TCP stream.
pub const MARKER_INTERVAL: usize = 512;
/// Size of a marker.
pub const MARKER_LEN: usize = 4;

pub(super) const INTERVAL: u64 = MARKER_INTERVAL as u64;

mod field {
    use super::Field;
    pub const RESERVED: Field = 0..2;
    pub const FPDUPTR: Field = 2..4;
}

/// A read/write view of a 4-octet MPA marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Marker<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Marker<T> {
    /// Wraps a buffer without checking anything.
    pub const fn new_unchecked(buffer: T) -> Marker<T> {
        Marker { buffer }
    }

    /// Wraps a buffer after [`Marker::check_len`].
    pub fn new_checked(buffer: T) -> Result<Marker<T>> {
        let marker = Self::new_unchecked(buffer);
        marker.check_len()?;
        Ok(marker)
    }

    /// Checks that the buffer holds a whole marker.
    pub fn check_len(&self) -> Result<()> {
        let have = self.buffer.as_ref().len();
        if have < MARKER_LEN {
            return Err(Error::Truncated {
                layer: Layer::Llp,
                need: MARKER_LEN,
                have,
            });
        }
        Ok(())
    }

    /// Unwraps the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The reserved half (zero from a correct sender).
    pub fn reserved(&self) -> u16 {
        be_u16(&self.buffer.as_ref()[field::RESERVED])
    }

    /// `FPDUPTR` as sent, low bits included.
    pub fn fpduptr(&self) -> u16 {
        be_u16(&self.buffer.as_ref()[field::FPDUPTR])
    }

    /// `FPDUPTR` with its two low bits treated as zero, as receivers must.
    pub fn fpdu_distance(&self) -> u16 {
        self.fpduptr() & !3
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Marker<T> {
    /// Sets the reserved half.
    pub fn set_reserved(&mut self, value: u16) {
        self.buffer.as_mut()[field::RESERVED].copy_from_slice(&value.to_be_bytes());
    }

    /// Sets `FPDUPTR`.
    pub fn set_fpduptr(&mut self, value: u16) {
        self.buffer.as_mut()[field::FPDUPTR].copy_from_slice(&value.to_be_bytes());
    }
}

/// The octets of a marker pointing `fpduptr` octets back.
pub(super) const fn marker_bytes(fpduptr: u16) -> [u8; 4] {
    let p = fpduptr.to_be_bytes();
    [0, 0, p[0], p[1]]
}

/// True at stream offsets where a marker goes (multiples of 512).
#[inline]
pub(super) fn is_marker_pos(pos: u64) -> bool {
    pos & (INTERVAL - 1) == 0
}

/// Octets from `pos` to the next marker position (a full interval when
/// `pos` is itself a marker position).
#[inline]
pub(super) fn to_next_marker(pos: u64) -> u64 {
    INTERVAL - pos % INTERVAL
}

/// Wire size of an FPDU carrying `ulpdu_len` octets that starts at stream
/// offset `pos`, markers included; fails when the ULPDU is too long for the
/// length field or a marker's `FPDUPTR` would not fit in 16 bits.
pub(super) fn wire_len(pos: u64, ulpdu_len: usize, markers: bool) -> Result<usize> {
    if ulpdu_len > MAX_ULPDU_LEN {
        return Err(Error::FpduTooLong(ulpdu_len));
    }
    let logical = fpdu_len(ulpdu_len) as u64;
    if !markers {
        return Ok(logical as usize);
    }
    let mut p = pos;
    let mut wire = 0u64;
    if is_marker_pos(p) {
        wire += MARKER_LEN as u64;
        p += MARKER_LEN as u64;
    }
    let start = p;
    let mut remaining = logical;
    loop {
        let room = to_next_marker(p);
        if remaining <= room {
            // A marker right after the CRC belongs to the next FPDU.
            wire += remaining;
            break;
        }
        wire += room;
        p += room;
        remaining -= room;
        if p - start > u64::from(u16::MAX) {
            return Err(Error::FpduTooLong(ulpdu_len));
        }
        wire += MARKER_LEN as u64;
        p += MARKER_LEN as u64;
    }
    Ok(wire as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A marker 508 octets after the length field of an FPDU that had a
    /// leading marker (stream offset 512).
    static PACKET_BYTES: [u8; 4] = [0x00, 0x00, 0x01, 0xfc];

    #[test]
    fn test_deconstruct() {
        let marker = Marker::new_checked(&PACKET_BYTES[..]).unwrap();
        assert_eq!(marker.reserved(), 0);
        assert_eq!(marker.fpduptr(), 508);
        assert_eq!(marker.fpdu_distance(), 508);
        let odd = Marker::new_unchecked([0xff, 0xff, 0x01, 0xff]);
        assert_eq!(odd.reserved(), 0xffff);
        assert_eq!(odd.fpdu_distance(), 0x1fc);
    }

    #[test]
    fn test_construct() {
        let mut bytes = [0xa5u8; 4];
        let mut marker = Marker::new_unchecked(&mut bytes[..]);
        marker.set_reserved(0);
        marker.set_fpduptr(508);
        assert_eq!(bytes, PACKET_BYTES);
        assert_eq!(marker_bytes(508), PACKET_BYTES);
    }

    #[test]
    fn test_truncated() {
        for len in 0..4 {
            assert!(matches!(
                Marker::new_checked(&PACKET_BYTES[..len]),
                Err(Error::Truncated { layer: Layer::Llp, need: 4, have }) if have == len
            ));
        }
    }
}
