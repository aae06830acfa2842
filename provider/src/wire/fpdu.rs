//! MPA FPDU framing without markers (RFC 5044 §4.1, §4.4 for the CRC).
//!
//! An FPDU on the wire is
//!
//! ```text
//! +---------------+----------------------------+---------+--------------+
//! | ULPDU_Length  | ULPDU (DDP segment)        | PAD 0-3 | CRC32c       |
//! | 2 octets, BE  | ULPDU_Length octets        | zeros   | 4 octets     |
//! +---------------+----------------------------+---------+--------------+
//! ```
//!
//! `ULPDU_Length` counts only the ULPDU (not itself, the pad, markers or the
//! CRC); the pad makes the whole FPDU a multiple of four octets. The CRC field
//! is always present: it carries the CRC32c of length, ULPDU and pad when CRC
//! was negotiated, and zero otherwise (kernel siw, `siw_qp_tx.c`).
//!
//! **CRC byte order.** siw computes `crc32c(~0, …)` and stores the final,
//! inverted value with `put_unaligned_le32` (`siw_crc_final` in `siw.h`), i.e.
//! the standard CRC32c value (`crc32c("123456789") = 0xe3069283`) goes on the
//! wire least-significant octet first — the same octet order as iSCSI's
//! digests (RFC 3720 appendix B.4: 32 zero octets give `aa 36 91 8a`).
//!
//! This module handles FPDUs without markers; [`super::stream`] frames and
//! deframes a whole stream, with or without markers.

use super::{be_u16, Error, Field, Layer, Result};

/// Size of the `ULPDU_Length` field.
pub const LENGTH_LEN: usize = 2;
/// Size of the CRC field, present whether or not CRC was negotiated.
pub const CRC_LEN: usize = 4;
/// The largest ULPDU an FPDU can carry (the length field is 16 bits).
pub const MAX_ULPDU_LEN: usize = u16::MAX as usize;

mod field {
    use super::Field;
    pub const ULPDU_LENGTH: Field = 0..2;
    pub const ULPDU: usize = 2;
}

/// Number of pad octets after a ULPDU of `ulpdu_len` octets, so that
/// length field + ULPDU + pad is a multiple of four.
#[inline]
pub const fn pad_len(ulpdu_len: usize) -> usize {
    (LENGTH_LEN + ulpdu_len).wrapping_neg() & 3
}

/// Total size of a marker-free FPDU carrying `ulpdu_len` octets: length
/// field, ULPDU, pad and CRC.
#[inline]
pub const fn fpdu_len(ulpdu_len: usize) -> usize {
    LENGTH_LEN + ulpdu_len + pad_len(ulpdu_len) + CRC_LEN
}

/// A running MPA CRC32c (Castagnoli), for computing the CRC of an FPDU
/// piecewise as its parts go by on the data path.
///
/// The value is the standard CRC32c (`value()` of "123456789" is
/// `0xe3069283`); [`Crc32c::to_wire`] gives the octets siw puts on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Crc32c(u32);

impl Crc32c {
    /// The CRC of no data.
    pub const fn new() -> Self {
        Self(0)
    }

    /// Extends the CRC over `data` (hardware-accelerated where available).
    ///
    /// Two kernels, chosen by length. Below [`FOLD_FROM`] octets, SSE4.2's
    /// `crc32` instruction (the `crc32c` crate) wins: it starts at once. From
    /// there on, carry-less multiplication folds 64 to 256 octets a step
    /// (`crc-fast`: VPCLMULQDQ on AVX-512 parts, PCLMULQDQ elsewhere),
    /// about twice the `crc32` chain's speed from 4 KiB up on this project's
    /// machines (`cargo bench -p stag-provider --bench wire -- crc32c`). Both
    /// detect the CPU at run time and fall back to tables without the
    /// instructions, and both give the same value, so a CRC may be extended
    /// piecewise across the seam.
    #[inline]
    pub fn update(&mut self, data: &[u8]) {
        self.0 = if data.len() < FOLD_FROM {
            crc32c::crc32c_append(self.0, data)
        } else {
            crc32c_fold(self.0, data)
        };
    }

    /// The CRC of everything passed to [`Crc32c::update`] so far.
    pub const fn value(&self) -> u32 {
        self.0
    }

    /// The four octets of the CRC field carrying this value.
    pub const fn to_wire(&self) -> [u8; 4] {
        crc_to_wire(self.0)
    }
}

/// The length from which [`Crc32c::update`] folds with carry-less
/// multiplication instead of chaining `crc32` instructions (the crossover
/// measured here lies between 256 and 1024 octets).
pub const FOLD_FROM: usize = 512;

/// `crc32c_append` by folding: extends the standard CRC32c `crc` over `data`.
#[inline]
fn crc32c_fold(crc: u32, data: &[u8]) -> u32 {
    // The digest's state is the register before the final inversion.
    let mut digest =
        crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    digest.update(data);
    digest.finalize() as u32
}

/// The CRC field octets for a CRC value (least-significant octet first, as
/// siw's `siw_crc_final` stores it).
#[inline]
pub const fn crc_to_wire(crc: u32) -> [u8; 4] {
    crc.to_le_bytes()
}

/// The CRC value carried by the four octets of a CRC field.
#[inline]
pub const fn crc_from_wire(field: [u8; 4]) -> u32 {
    u32::from_le_bytes(field)
}

/// A read/write view of a marker-free FPDU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fpdu<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Fpdu<T> {
    /// Wraps a buffer without checking anything.
    pub const fn new_unchecked(buffer: T) -> Fpdu<T> {
        Fpdu { buffer }
    }

    /// Wraps a buffer after [`Fpdu::check_len`].
    pub fn new_checked(buffer: T) -> Result<Fpdu<T>> {
        let fpdu = Self::new_unchecked(buffer);
        fpdu.check_len()?;
        Ok(fpdu)
    }

    /// Checks that the buffer holds the whole FPDU its length field claims;
    /// after this no getter panics. Longer buffers are allowed (the rest is
    /// the next FPDU).
    pub fn check_len(&self) -> Result<()> {
        let have = self.buffer.as_ref().len();
        if have < LENGTH_LEN {
            return Err(truncated(LENGTH_LEN, have));
        }
        let need = self.total_len();
        if have < need {
            return Err(truncated(need, have));
        }
        Ok(())
    }

    /// Unwraps the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// `ULPDU_Length`: octets of ULPDU.
    #[inline]
    pub fn ulpdu_len(&self) -> u16 {
        be_u16(&self.buffer.as_ref()[field::ULPDU_LENGTH])
    }

    /// Octets of pad after the ULPDU.
    #[inline]
    pub fn pad_len(&self) -> usize {
        pad_len(usize::from(self.ulpdu_len()))
    }

    /// Size of the whole FPDU, CRC included.
    #[inline]
    pub fn total_len(&self) -> usize {
        fpdu_len(usize::from(self.ulpdu_len()))
    }

    fn crc_offset(&self) -> usize {
        self.total_len() - CRC_LEN
    }

    /// The ULPDU (the DDP segment).
    #[inline]
    pub fn ulpdu(&self) -> &[u8] {
        let end = field::ULPDU + usize::from(self.ulpdu_len());
        &self.buffer.as_ref()[field::ULPDU..end]
    }

    /// The pad octets (zero from a correct sender, not checked on receipt).
    pub fn pad(&self) -> &[u8] {
        let start = field::ULPDU + usize::from(self.ulpdu_len());
        &self.buffer.as_ref()[start..self.crc_offset()]
    }

    /// The CRC value the FPDU carries (zero when CRC was not negotiated).
    pub fn crc(&self) -> u32 {
        let at = self.crc_offset();
        let b = &self.buffer.as_ref()[at..at + CRC_LEN];
        crc_from_wire([b[0], b[1], b[2], b[3]])
    }

    /// The CRC32c of length field, ULPDU and pad, as it should be carried.
    pub fn compute_crc(&self) -> u32 {
        let mut crc = Crc32c::new();
        crc.update(&self.buffer.as_ref()[..self.crc_offset()]);
        crc.value()
    }

    /// Checks the carried CRC against the computed one ([`Error::Crc`]).
    pub fn check_crc(&self) -> Result<()> {
        let (received, computed) = (self.crc(), self.compute_crc());
        if received == computed {
            Ok(())
        } else {
            Err(Error::Crc { received, computed })
        }
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Fpdu<T> {
    /// Sets `ULPDU_Length`.
    #[inline]
    pub fn set_ulpdu_len(&mut self, len: u16) {
        self.buffer.as_mut()[field::ULPDU_LENGTH].copy_from_slice(&len.to_be_bytes());
    }

    /// The ULPDU, for writing in place.
    #[inline]
    pub fn ulpdu_mut(&mut self) -> &mut [u8] {
        let end = field::ULPDU + usize::from(self.ulpdu_len());
        &mut self.buffer.as_mut()[field::ULPDU..end]
    }

    /// Zeroes the pad octets.
    pub fn clear_pad(&mut self) {
        let start = field::ULPDU + usize::from(self.ulpdu_len());
        let end = self.crc_offset();
        self.buffer.as_mut()[start..end].fill(0);
    }

    /// Sets the CRC field to `crc`.
    pub fn set_crc(&mut self, crc: u32) {
        let at = self.crc_offset();
        self.buffer.as_mut()[at..at + CRC_LEN].copy_from_slice(&crc_to_wire(crc));
    }

    /// Sets the CRC field to the computed CRC when `crc_enabled`, else to zero
    /// (what siw sends when CRC was not negotiated).
    pub fn fill_crc(&mut self, crc_enabled: bool) {
        let crc = if crc_enabled { self.compute_crc() } else { 0 };
        self.set_crc(crc);
    }
}

/// The meaning of a marker-free FPDU: its ULPDU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FpduRepr<'a> {
    /// The DDP segment the FPDU carries.
    pub ulpdu: &'a [u8],
}

impl<'a> FpduRepr<'a> {
    /// Parses an FPDU that fills `fpdu`'s buffer exactly, checking the CRC
    /// when `crc_enabled` (when not, the CRC field is ignored).
    pub fn parse<T: AsRef<[u8]> + ?Sized>(fpdu: &Fpdu<&'a T>, crc_enabled: bool) -> Result<Self> {
        fpdu.check_len()?;
        let buf: &'a [u8] = fpdu.buffer.as_ref();
        if buf.len() != fpdu.total_len() {
            return Err(Error::MpaMalformed("trailing bytes after the FPDU"));
        }
        if crc_enabled {
            fpdu.check_crc()?;
        }
        let end = field::ULPDU + usize::from(fpdu.ulpdu_len());
        Ok(FpduRepr {
            ulpdu: buf.get(field::ULPDU..end).unwrap_or_default(),
        })
    }

    /// Size of the FPDU that carries this ULPDU.
    pub const fn buffer_len(&self) -> usize {
        fpdu_len(self.ulpdu.len())
    }

    /// Writes the whole FPDU (length, ULPDU, zero pad, CRC or zero) into
    /// `fpdu`, whose buffer must hold at least [`FpduRepr::buffer_len`] octets.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(
        &self,
        fpdu: &mut Fpdu<T>,
        crc_enabled: bool,
    ) -> Result<()> {
        emit_fpdu(&[self.ulpdu], crc_enabled, fpdu.buffer.as_mut()).map(|_| ())
    }
}

/// Writes one marker-free FPDU whose ULPDU is the concatenation of
/// `ulpdu_parts` (e.g. a DDP/RDMAP header and a payload, without copying them
/// together first) into the front of `out`. Returns the FPDU size.
///
/// The CRC field gets the CRC32c when `crc_enabled` and zero otherwise.
/// Fails with [`Error::FpduTooLong`] if the parts exceed 65535 octets and with
/// [`Error::Truncated`] if `out` is too small; `out` is untouched then.
pub fn emit_fpdu(ulpdu_parts: &[&[u8]], crc_enabled: bool, out: &mut [u8]) -> Result<usize> {
    let ulpdu_len: usize = ulpdu_parts.iter().map(|p| p.len()).sum();
    let len16 = u16::try_from(ulpdu_len).map_err(|_| Error::FpduTooLong(ulpdu_len))?;
    let total = fpdu_len(ulpdu_len);
    let have = out.len();
    let out = out.get_mut(..total).ok_or(truncated(total, have))?;
    let (body, crc_field) = out.split_at_mut(total - CRC_LEN);
    body[field::ULPDU_LENGTH].copy_from_slice(&len16.to_be_bytes());
    let mut at = field::ULPDU;
    for part in ulpdu_parts {
        body[at..at + part.len()].copy_from_slice(part);
        at += part.len();
    }
    body[at..].fill(0);
    crc_field.copy_from_slice(&crc_field_of(crc_enabled, body));
    Ok(total)
}

/// The CRC field of an FPDU whose length field, ULPDU and pad are
/// `covered`: their CRC32c as carried, or zeros when CRC is off.
pub(crate) fn crc_field_of(crc_enabled: bool, covered: &[u8]) -> [u8; CRC_LEN] {
    if !crc_enabled {
        return [0; CRC_LEN];
    }
    let mut crc = Crc32c::new();
    crc.update(covered);
    crc.to_wire()
}

fn truncated(need: usize, have: usize) -> Error {
    Error::Truncated {
        layer: Layer::Llp,
        need,
        have,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An untagged last Send as siw sends it (control 0x4143: L=1, DV=1,
    /// RV=1, opcode Send; QN 0, MSN 1, MO 0) carrying "hello": ULPDU of
    /// 18 + 5 octets, 3 pad octets, CRC on. CRC computed independently with a
    /// bitwise CRC32c (poly 0x82F63B78) and stored least-significant first.
    static PACKET_BYTES: [u8; 32] = [
        0x00, 0x17, // ULPDU_Length = 23
        0x41, 0x43, // DDP/RDMAP control
        0x00, 0x00, 0x00, 0x00, // reserved (invalidate STag)
        0x00, 0x00, 0x00, 0x00, // QN 0
        0x00, 0x00, 0x00, 0x01, // MSN 1
        0x00, 0x00, 0x00, 0x00, // MO 0
        0x68, 0x65, 0x6c, 0x6c, 0x6f, // "hello"
        0x00, 0x00, 0x00, // pad
        0xb9, 0x90, 0xb1, 0x0c, // CRC32c 0x0cb190b9, LE
    ];

    fn packet_repr() -> FpduRepr<'static> {
        FpduRepr {
            ulpdu: &PACKET_BYTES[2..25],
        }
    }

    #[test]
    fn test_deconstruct() {
        let fpdu = Fpdu::new_checked(&PACKET_BYTES[..]).unwrap();
        assert_eq!(fpdu.ulpdu_len(), 23);
        assert_eq!(fpdu.pad_len(), 3);
        assert_eq!(fpdu.total_len(), 32);
        assert_eq!(&fpdu.ulpdu()[..2], &[0x41, 0x43]);
        assert_eq!(&fpdu.ulpdu()[18..], b"hello");
        assert_eq!(fpdu.pad(), &[0, 0, 0]);
        assert_eq!(fpdu.crc(), 0x0cb1_90b9);
        assert_eq!(fpdu.compute_crc(), 0x0cb1_90b9);
        assert_eq!(fpdu.check_crc(), Ok(()));
    }

    #[test]
    fn test_construct() {
        let mut bytes = [0xa5u8; 32];
        let mut fpdu = Fpdu::new_unchecked(&mut bytes[..]);
        fpdu.set_ulpdu_len(23);
        fpdu.ulpdu_mut().copy_from_slice(&PACKET_BYTES[2..25]);
        fpdu.clear_pad();
        fpdu.fill_crc(true);
        assert_eq!(bytes, PACKET_BYTES);
    }

    #[test]
    fn test_parse() {
        let fpdu = Fpdu::new_checked(&PACKET_BYTES[..]).unwrap();
        assert_eq!(FpduRepr::parse(&fpdu, true), Ok(packet_repr()));
    }

    #[test]
    fn test_emit() {
        let repr = packet_repr();
        assert_eq!(repr.buffer_len(), 32);
        let mut bytes = [0xa5u8; 32];
        let mut fpdu = Fpdu::new_unchecked(&mut bytes[..]);
        repr.emit(&mut fpdu, true).unwrap();
        assert_eq!(bytes, PACKET_BYTES);
    }

    #[test]
    fn test_truncated() {
        for len in 0..PACKET_BYTES.len() {
            let err = Fpdu::new_checked(&PACKET_BYTES[..len]).unwrap_err();
            assert!(matches!(err, Error::Truncated { layer: Layer::Llp, have, .. } if have == len));
        }
    }

    #[test]
    fn test_trailing_bytes() {
        let mut bytes = PACKET_BYTES.to_vec();
        bytes.push(0);
        let fpdu = Fpdu::new_checked(&bytes[..]).unwrap();
        assert_eq!(fpdu.total_len(), 32);
        assert!(matches!(
            FpduRepr::parse(&fpdu, true),
            Err(Error::MpaMalformed(_))
        ));
    }

    #[test]
    fn test_crc_off_is_zero() {
        let mut bytes = [0xa5u8; 32];
        let n = emit_fpdu(&[&PACKET_BYTES[2..20], b"hello"], false, &mut bytes).unwrap();
        assert_eq!(n, 32);
        assert_eq!(&bytes[..28], &PACKET_BYTES[..28]);
        assert_eq!(&bytes[28..], &[0, 0, 0, 0]);
        // Without CRC the field is ignored on receipt.
        let fpdu = Fpdu::new_checked(&bytes[..]).unwrap();
        assert_eq!(FpduRepr::parse(&fpdu, false), Ok(packet_repr()));
        assert_eq!(
            FpduRepr::parse(&fpdu, true),
            Err(Error::Crc {
                received: 0,
                computed: 0x0cb1_90b9
            })
        );
    }

    #[test]
    fn test_emit_parts_equals_whole() {
        let mut a = [0u8; 32];
        let mut b = [0u8; 32];
        emit_fpdu(&[&PACKET_BYTES[2..20], b"hel", b"", b"lo"], true, &mut a).unwrap();
        emit_fpdu(&[&PACKET_BYTES[2..25]], true, &mut b).unwrap();
        assert_eq!(a, PACKET_BYTES);
        assert_eq!(b, PACKET_BYTES);
    }

    #[test]
    fn test_emit_errors() {
        let mut small = [0u8; 31];
        assert_eq!(
            emit_fpdu(&[&PACKET_BYTES[2..25]], true, &mut small),
            Err(Error::Truncated {
                layer: Layer::Llp,
                need: 32,
                have: 31
            })
        );
        let big = vec![0u8; MAX_ULPDU_LEN + 1];
        let mut out = vec![0u8; fpdu_len(big.len())];
        assert_eq!(
            emit_fpdu(&[&big], false, &mut out),
            Err(Error::FpduTooLong(MAX_ULPDU_LEN + 1))
        );
        let max = vec![7u8; MAX_ULPDU_LEN];
        assert_eq!(
            emit_fpdu(&[&max], true, &mut out),
            Ok(fpdu_len(MAX_ULPDU_LEN))
        );
    }

    #[test]
    fn test_pad_and_len() {
        for (ulpdu, pad) in [(0, 2), (1, 1), (2, 0), (3, 3), (18, 0), (23, 3), (65535, 3)] {
            assert_eq!(pad_len(ulpdu), pad, "ulpdu {ulpdu}");
            assert_eq!(fpdu_len(ulpdu) % 4, 0);
            assert_eq!(fpdu_len(ulpdu), 2 + ulpdu + pad + 4);
        }
    }

    /// The folding kernel and the `crc32` chain agree at every length
    /// around the seam, from any starting CRC, so a CRC extended piecewise
    /// is the same whichever kernel each piece took.
    #[test]
    fn test_crc32c_kernels_agree() {
        let data: Vec<u8> = (0..70_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for len in (0..2048).chain([4095, 4096, 4097, 65_535, 65_536, 70_000]) {
            for start in [0u32, 0xffff_ffff, 0x1234_5678] {
                let piece = &data[..len];
                assert_eq!(
                    crc32c_fold(start, piece),
                    crc32c::crc32c_append(start, piece),
                    "len {len}"
                );
            }
        }
        // Piecewise through update(): a short piece, a long one, a short one.
        let mut split = Crc32c::new();
        split.update(&data[..100]);
        split.update(&data[100..60_000]);
        split.update(&data[60_000..60_300]);
        let mut whole = Crc32c::new();
        whole.update(&data[..60_300]);
        assert_eq!(split, whole);
        assert_eq!(whole.value(), crc32c::crc32c(&data[..60_300]));
    }

    /// RFC 3720 appendix B.4 CRC32c vectors, shown there as wire octets: they
    /// fix the octet order siw uses (`put_unaligned_le32` of the final CRC).
    #[test]
    fn test_crc32c_known_answers() {
        let inc: Vec<u8> = (0u8..32).collect();
        let dec: Vec<u8> = (0u8..32).rev().collect();
        let cases: [(&[u8], u32, [u8; 4]); 5] = [
            (&[0u8; 32], 0x8a91_36aa, [0xaa, 0x36, 0x91, 0x8a]),
            (&[0xffu8; 32], 0x62a8_ab43, [0x43, 0xab, 0xa8, 0x62]),
            (&inc, 0x46dd_794e, [0x4e, 0x79, 0xdd, 0x46]),
            (&dec, 0x113f_db5c, [0x5c, 0xdb, 0x3f, 0x11]),
            (b"123456789", 0xe306_9283, [0x83, 0x92, 0x06, 0xe3]),
        ];
        for (data, value, wire) in cases {
            let mut crc = Crc32c::new();
            crc.update(data);
            assert_eq!(crc.value(), value);
            assert_eq!(crc.to_wire(), wire);
            assert_eq!(crc_from_wire(wire), value);
            // Piecewise equals whole.
            let mut split = Crc32c::new();
            let (a, b) = data.split_at(data.len() / 3);
            split.update(a);
            split.update(b);
            assert_eq!(split, crc);
        }
    }
}
