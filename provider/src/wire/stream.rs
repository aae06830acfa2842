//! The sans-IO MPA stream codecs: [`Framer`] frames ULPDUs into the TCP
//! byte stream as FPDUs and [`Deframer`] gets them back out, with or without
//! markers ([`super::marker`] says where those fall) and CRC.

use super::fpdu::{
    crc_field_of, crc_to_wire, emit_fpdu, fpdu_len, pad_len, Crc32c, CRC_LEN, LENGTH_LEN,
};
use super::marker::{
    is_marker_pos, marker_bytes, to_next_marker, wire_len, Marker, INTERVAL, MARKER_LEN,
};
use super::{be_u16, Error, Layer, Result};

/// What the two ends agreed for FPDUs in one direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct FramerConfig {
    /// CRC32c in the CRC field (else zero there).
    pub crc: bool,
    /// Markers every 512 octets.
    pub markers: bool,
}

/// Transmit side: turns ULPDUs into the exact octets siw (or any RFC 5044
/// peer) expects in the TCP stream, tracking the stream offset for markers.
#[derive(Debug, Clone)]
pub struct Framer {
    config: FramerConfig,
    /// Stream offset of the next octet, from the first octet of the first
    /// FPDU.
    pos: u64,
}

impl Framer {
    /// A framer at the start of the FPDU stream (right after the MPA
    /// Request/Reply exchange).
    pub const fn new(config: FramerConfig) -> Framer {
        Framer { config, pos: 0 }
    }

    /// The configuration.
    pub const fn config(&self) -> FramerConfig {
        self.config
    }

    /// Octets framed so far, markers included.
    pub const fn stream_offset(&self) -> u64 {
        self.pos
    }

    /// Wire size of the next FPDU if it carries `ulpdu_len` octets.
    pub fn framed_len(&self, ulpdu_len: usize) -> Result<usize> {
        wire_len(self.pos, ulpdu_len, self.config.markers)
    }

    /// Frames one ULPDU, the concatenation of `ulpdu_parts`, into the front
    /// of `out` and returns the octets written ([`Framer::framed_len`]).
    ///
    /// Fails, writing nothing and leaving the stream offset alone, with
    /// [`Error::FpduTooLong`] for an oversized ULPDU or [`Error::Truncated`]
    /// when `out` is too small.
    pub fn frame_into(&mut self, ulpdu_parts: &[&[u8]], out: &mut [u8]) -> Result<usize> {
        let ulpdu_len: usize = ulpdu_parts.iter().map(|p| p.len()).sum();
        let total = self.framed_len(ulpdu_len)?;
        let have = out.len();
        let out = out.get_mut(..total).ok_or(Error::Truncated {
            layer: Layer::Llp,
            need: total,
            have,
        })?;
        if !self.config.markers {
            // No marker can fall inside: the parts go in as they are and
            // the CRC runs once over the whole FPDU, not once per part
            // (three or four calls for a small one).
            emit_fpdu(ulpdu_parts, self.config.crc, out)?;
            self.pos += total as u64;
            return Ok(total);
        }
        let mut w = MarkedWriter {
            out,
            at: 0,
            pos: self.pos,
            markers: self.config.markers,
            fpdu_start: None,
            crc: self.config.crc.then(Crc32c::new),
        };
        // Cannot truncate: framed_len checked it against MAX_ULPDU_LEN.
        w.put(&(ulpdu_len as u16).to_be_bytes());
        for part in ulpdu_parts {
            w.put(part);
        }
        w.put(&[0u8; 3][..pad_len(ulpdu_len)]);
        w.marker_if_due();
        let crc = w.crc.take().map_or(0, |c| c.value());
        w.put(&crc_to_wire(crc));
        debug_assert_eq!(w.at, total);
        self.pos = w.pos;
        Ok(total)
    }

    /// Frames one ULPDU, the concatenation of `ulpdu_parts`, appending its
    /// octets to `out`.
    pub fn frame(&mut self, ulpdu_parts: &[&[u8]], out: &mut Vec<u8>) -> Result<()> {
        let ulpdu_len: usize = ulpdu_parts.iter().map(|p| p.len()).sum();
        let total = self.framed_len(ulpdu_len)?;
        let start = out.len();
        out.resize(start + total, 0);
        let written = self.frame_into(ulpdu_parts, &mut out[start..]);
        if written.is_err() {
            out.truncate(start);
        }
        written.map(|_| ())
    }
}

impl Framer {
    /// Frames one ULPDU of a marker-free stream straight onto the end of
    /// `out`: the length field and `header`, then the payload `payload`
    /// appends to `out` itself (copied once, from wherever it is), then
    /// pad and CRC, computed in one pass over the whole FPDU.
    ///
    /// The octets are the ones [`Framer::frame`] produces for `[header,
    /// payload]`. If `payload` fails, `out` and the stream offset are left
    /// as they were and its error is the inner one; the outer error is
    /// [`Framer::frame`]'s (nothing written either), or
    /// [`Error::MpaLocalCatastrophic`] with markers negotiated, a caller's
    /// bug: use `frame` then.
    pub fn frame_appending<E>(
        &mut self,
        header: &[u8],
        out: &mut Vec<u8>,
        payload: impl FnOnce(&mut Vec<u8>) -> core::result::Result<(), E>,
    ) -> Result<core::result::Result<(), E>> {
        if self.config.markers {
            return Err(Error::MpaLocalCatastrophic);
        }
        let start = out.len();
        // The length field is known once the payload is in.
        out.extend_from_slice(&[0; LENGTH_LEN]);
        out.extend_from_slice(header);
        if let Err(e) = payload(out) {
            out.truncate(start);
            return Ok(Err(e));
        }
        let ulpdu_len = out.len() - start - LENGTH_LEN;
        let total = match self.framed_len(ulpdu_len) {
            Ok(total) => total,
            Err(e) => {
                out.truncate(start);
                return Err(e);
            }
        };
        // Cannot truncate: framed_len checked it against MAX_ULPDU_LEN.
        out[start..start + LENGTH_LEN].copy_from_slice(&(ulpdu_len as u16).to_be_bytes());
        out.extend_from_slice(&[0u8; 3][..pad_len(ulpdu_len)]);
        let crc_field = crc_field_of(self.config.crc, &out[start..]);
        out.extend_from_slice(&crc_field);
        debug_assert_eq!(out.len() - start, total);
        self.pos += total as u64;
        Ok(Ok(()))
    }
}

/// The end of an FPDU framed by [`Framer::frame_gather`]: pad and CRC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trailer {
    bytes: [u8; 3 + CRC_LEN],
    len: u8,
}

impl Trailer {
    /// The octets that follow the payload.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl Framer {
    /// Frames one ULPDU whose payload is not copied (marker-free streams
    /// only): appends the length field and `header` to `head`, lets
    /// `payload_crc` feed the `payload_len` payload octets to the CRC
    /// (they go on the wire from where they are, right after `head`), and
    /// returns the pad and CRC to send after them.
    ///
    /// The octets are the ones [`Framer::frame`] produces for
    /// `[header, payload]`. Fails like it, writing nothing; with markers
    /// negotiated (they would fall inside the payload) it refuses with
    /// [`Error::MpaLocalCatastrophic`], a caller's bug: use `frame` then.
    pub fn frame_gather(
        &mut self,
        header: &[u8],
        payload_len: usize,
        head: &mut Vec<u8>,
        payload_crc: impl FnOnce(&mut Crc32c),
    ) -> Result<Trailer> {
        if self.config.markers {
            return Err(Error::MpaLocalCatastrophic);
        }
        let ulpdu_len = header.len() + payload_len;
        let total = self.framed_len(ulpdu_len)?;
        let start = head.len();
        // Cannot truncate: framed_len checked it against MAX_ULPDU_LEN.
        head.extend_from_slice(&(ulpdu_len as u16).to_be_bytes());
        head.extend_from_slice(header);
        let pad = pad_len(ulpdu_len);
        let mut trailer = Trailer {
            bytes: [0; 3 + CRC_LEN],
            len: (pad + CRC_LEN) as u8,
        };
        if self.config.crc {
            let mut crc = Crc32c::new();
            crc.update(&head[start..]);
            payload_crc(&mut crc);
            crc.update(&[0u8; 3][..pad]);
            trailer.bytes[pad..pad + CRC_LEN].copy_from_slice(&crc.to_wire());
        }
        self.pos += total as u64;
        Ok(trailer)
    }
}

/// Writes the logical octets of one FPDU, inserting markers at stream
/// offsets that are multiples of 512 and feeding the CRC.
struct MarkedWriter<'o> {
    out: &'o mut [u8],
    at: usize,
    pos: u64,
    markers: bool,
    /// Stream offset of the length field, once written.
    fpdu_start: Option<u64>,
    /// Running CRC while the covered part is written; `None` for the CRC
    /// field itself or when CRC is off.
    crc: Option<Crc32c>,
}

impl MarkedWriter<'_> {
    fn raw(&mut self, bytes: &[u8]) {
        self.out[self.at..self.at + bytes.len()].copy_from_slice(bytes);
        if let Some(crc) = &mut self.crc {
            crc.update(bytes);
        }
        self.at += bytes.len();
        self.pos += bytes.len() as u64;
    }

    /// Inserts the marker due at the current offset, if any: FPDUPTR 0 before
    /// the length field, else the distance back to it.
    fn marker_if_due(&mut self) {
        if self.markers && is_marker_pos(self.pos) {
            let distance = self.fpdu_start.map_or(0, |start| self.pos - start);
            // wire_len refused FPDUs whose distances exceed 16 bits.
            self.raw(&marker_bytes(distance as u16));
        }
    }

    fn put(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            self.marker_if_due();
            if self.fpdu_start.is_none() {
                self.fpdu_start = Some(self.pos);
            }
            let room = if self.markers {
                to_next_marker(self.pos).min(data.len() as u64) as usize
            } else {
                data.len()
            };
            let (now, rest) = data.split_at(room);
            self.raw(now);
            data = rest;
        }
    }
}

/// What a receiver agreed to accept in one direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeframerConfig {
    /// Check the CRC (else the CRC field is ignored).
    pub crc: bool,
    /// Expect, check and strip markers.
    pub markers: bool,
    /// Largest ULPDU accepted; longer ones fail with [`Error::FpduTooLong`].
    /// Also bounds the deframer's buffer.
    pub max_ulpdu_len: u16,
}

/// A ULPDU yielded by [`Deframer::poll`]: the DDP segment octets, without
/// length field, pad, CRC or markers. Derefs to `[u8]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ulpdu<'s, 'i> {
    /// A sub-slice of the caller's input: the FPDU was contiguous there and
    /// had no markers inside, so nothing was copied.
    Borrowed(&'i [u8]),
    /// Reassembled in the deframer's buffer (the FPDU spanned input chunks
    /// or contained markers).
    Buffered(&'s [u8]),
}

impl Ulpdu<'_, '_> {
    /// The ULPDU octets.
    pub fn as_slice(&self) -> &[u8] {
        match *self {
            Ulpdu::Borrowed(b) => b,
            Ulpdu::Buffered(b) => b,
        }
    }

    /// True when the octets are the caller's own input, not a copy.
    pub fn is_zero_copy(&self) -> bool {
        matches!(self, Ulpdu::Borrowed(_))
    }
}

impl core::ops::Deref for Ulpdu<'_, '_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsRef<[u8]> for Ulpdu<'_, '_> {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

/// Receive side: fed the TCP byte stream in chunks split anywhere, checks
/// and strips markers, checks the CRC and the length limit, and yields whole
/// ULPDUs.
///
/// Sans-IO and bounded: it never panics on any input and never holds more
/// than `max_ulpdu_len` octets. After an error it stays failed and returns
/// that error again.
#[derive(Debug, Clone)]
pub struct Deframer {
    config: DeframerConfig,
    /// Stream offset of the next octet, from the first octet of the first
    /// FPDU, markers included.
    pos: u64,
    failed: Option<Error>,
    /// Some wire octet of the current FPDU (maybe a leading marker) has been
    /// consumed, so the fast path cannot take it.
    started: bool,
    /// Octets of the current FPDU consumed, markers excluded.
    got: usize,
    /// Stream offset of the current FPDU's length field.
    fpdu_start: u64,
    length: [u8; 2],
    /// The current FPDU's ULPDU_Length, once both octets are in.
    ulpdu_len: usize,
    crc: Crc32c,
    crc_field: [u8; 4],
    marker: [u8; 4],
    marker_got: usize,
    buf: Vec<u8>,
    /// `buf` holds a yielded ULPDU, to be dropped at the next poll.
    yielded: bool,
    /// ULPDU octets of the current FPDU that the caller places itself
    /// ([`Deframer::begin_external`]) and has not accounted for yet.
    external: usize,
}

impl Deframer {
    /// A deframer at the start of the FPDU stream (the first octet after the
    /// MPA Request/Reply exchange).
    pub fn new(config: DeframerConfig) -> Deframer {
        Deframer {
            config,
            pos: 0,
            failed: None,
            started: false,
            got: 0,
            fpdu_start: 0,
            length: [0; 2],
            ulpdu_len: 0,
            crc: Crc32c::new(),
            crc_field: [0; 4],
            marker: [0; 4],
            marker_got: 0,
            buf: Vec::new(),
            yielded: false,
            external: 0,
        }
    }

    /// The configuration.
    pub const fn config(&self) -> DeframerConfig {
        self.config
    }

    /// Octets consumed so far, markers included.
    pub const fn stream_offset(&self) -> u64 {
        self.pos
    }

    /// True between FPDUs: no part of an FPDU is pending (a clean place for
    /// the stream to end).
    pub const fn is_idle(&self) -> bool {
        !self.started && self.failed.is_none()
    }

    /// The error the deframer failed with, if it has.
    pub const fn error(&self) -> Option<Error> {
        self.failed
    }

    /// Consumes octets from the front of `input` up to the end of the next
    /// complete FPDU and yields its ULPDU; `Ok(None)` means `input` was used
    /// up without completing one. Call again with the rest of `input` until
    /// it returns `None`.
    ///
    /// The ULPDU is a slice of `input` when the whole FPDU lay in it with no
    /// markers inside, and otherwise a slice of the deframer's buffer.
    pub fn poll<'s, 'i>(&'s mut self, input: &mut &'i [u8]) -> Result<Option<Ulpdu<'s, 'i>>> {
        if let Some(err) = self.failed {
            return Err(err);
        }
        if self.yielded {
            self.buf.clear();
            self.yielded = false;
        }
        match self.advance(input) {
            Ok(Step::Pending) => Ok(None),
            Ok(Step::Borrowed(ulpdu)) => Ok(Some(Ulpdu::Borrowed(ulpdu))),
            Ok(Step::Buffered) => {
                self.yielded = true;
                Ok(Some(Ulpdu::Buffered(&self.buf)))
            }
            Err(err) => {
                self.failed = Some(err);
                Err(err)
            }
        }
    }

    /// Begins, at an FPDU boundary of a marker-free stream, an FPDU whose
    /// payload the caller places itself (direct placement into registered
    /// memory): consumes the length field and the first `head` ULPDU octets
    /// (the DDP/RDMAP header) from `input`, and returns how many ULPDU
    /// octets follow, which the caller must account for with
    /// [`take_external`](Self::take_external) or
    /// [`placed_external`](Self::placed_external) before polling again.
    /// Once they are in, [`poll`](Self::poll) takes pad and CRC, checks the
    /// CRC over the whole FPDU and yields the header alone.
    ///
    /// `None`, consuming nothing, when the stream is not at a boundary, has
    /// markers or failed, or `input` lacks the length field and header, or
    /// the FPDU is over the limit or shorter than `head` (the ordinary path
    /// reports those).
    pub fn begin_external(&mut self, input: &mut &[u8], head: usize) -> Option<usize> {
        if !self.is_idle() || self.config.markers || self.external > 0 {
            return None;
        }
        let len_field: [u8; 2] = input.get(..LENGTH_LEN)?.try_into().ok()?;
        let ulpdu_len = usize::from(u16::from_be_bytes(len_field));
        if ulpdu_len > usize::from(self.config.max_ulpdu_len) || ulpdu_len < head {
            return None;
        }
        let header = input.get(LENGTH_LEN..LENGTH_LEN + head)?;
        if self.yielded {
            self.buf.clear();
            self.yielded = false;
        }
        self.fpdu_start = self.pos;
        self.started = true;
        self.length = len_field;
        self.ulpdu_len = ulpdu_len;
        self.buf.extend_from_slice(header);
        if self.config.crc {
            self.crc.update(&len_field);
            self.crc.update(header);
        }
        let taken = LENGTH_LEN + head;
        *input = input.get(taken..).unwrap_or_default();
        self.got = taken;
        self.pos += taken as u64;
        self.external = ulpdu_len - head;
        Some(self.external)
    }

    /// Wire octets left of the FPDU under way (0 between FPDUs), if known:
    /// once its length field is in, on a stream without markers.
    pub fn fpdu_remaining(&self) -> Option<usize> {
        if self.config.markers || self.failed.is_some() {
            return None;
        }
        if !self.started {
            return Some(0);
        }
        (self.got >= LENGTH_LEN).then(|| self.total() - self.got)
    }

    /// ULPDU octets still to be placed by the caller.
    pub const fn external_remaining(&self) -> usize {
        self.external
    }

    /// The running CRC of the current FPDU, for the caller to extend over
    /// octets it places itself; `None` without CRC.
    pub const fn external_crc(&self) -> Option<Crc32c> {
        if self.config.crc {
            Some(self.crc)
        } else {
            None
        }
    }

    /// Accounts for payload octets the caller placed from its own buffer.
    /// At most [`external_remaining`](Self::external_remaining) of them.
    pub fn take_external(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(self.external);
        let bytes = &bytes[..n];
        self.update_crc(bytes);
        self.got += n;
        self.pos += n as u64;
        self.external -= n;
    }

    /// Accounts for `n` payload octets the caller read straight into their
    /// destination, with `crc` the value of
    /// [`external_crc`](Self::external_crc) extended over them.
    pub fn placed_external(&mut self, n: usize, crc: Option<Crc32c>) {
        let n = n.min(self.external);
        if let (true, Some(crc)) = (self.config.crc, crc) {
            self.crc = crc;
        }
        self.got += n;
        self.pos += n as u64;
        self.external -= n;
    }

    fn crc_start(&self) -> usize {
        LENGTH_LEN + self.ulpdu_len + pad_len(self.ulpdu_len)
    }

    fn total(&self) -> usize {
        self.crc_start() + CRC_LEN
    }

    fn update_crc(&mut self, bytes: &[u8]) {
        if self.config.crc {
            self.crc.update(bytes);
        }
    }

    fn reset_fpdu(&mut self) {
        self.started = false;
        self.got = 0;
        self.crc = Crc32c::new();
    }

    /// The whole FPDU is contiguous at the front of `input` with no marker
    /// inside: check it there and hand out a sub-slice.
    fn try_fast<'i>(&mut self, input: &mut &'i [u8]) -> Result<Option<&'i [u8]>> {
        let whole: &'i [u8] = input;
        let Some(len_field) = whole.get(..LENGTH_LEN) else {
            return Ok(None);
        };
        let ulpdu_len = usize::from(be_u16(len_field));
        if ulpdu_len > usize::from(self.config.max_ulpdu_len) {
            return Err(Error::FpduTooLong(ulpdu_len));
        }
        let total = fpdu_len(ulpdu_len);
        if self.config.markers && self.pos % INTERVAL + total as u64 > INTERVAL {
            return Ok(None);
        }
        let Some(fpdu) = whole.get(..total) else {
            return Ok(None);
        };
        let (covered, crc_field) = fpdu.split_at(total - CRC_LEN);
        if self.config.crc {
            let mut crc = Crc32c::new();
            crc.update(covered);
            check_crc(crc, crc_field)?;
        }
        *input = whole.get(total..).unwrap_or_default();
        self.pos += total as u64;
        Ok(covered.get(LENGTH_LEN..LENGTH_LEN + ulpdu_len))
    }

    fn advance<'i>(&mut self, input: &mut &'i [u8]) -> Result<Step<'i>> {
        loop {
            // The caller places the rest of the payload itself: nothing of
            // `input` belongs to us until it has accounted for it.
            if input.is_empty() || self.external > 0 {
                return Ok(Step::Pending);
            }
            if self.config.markers && (self.marker_got > 0 || is_marker_pos(self.pos)) {
                self.take_marker(input)?;
                continue;
            }
            if !self.started {
                if let Some(ulpdu) = self.try_fast(input)? {
                    return Ok(Step::Borrowed(ulpdu));
                }
            }
            if self.take_logical(input)? {
                return Ok(Step::Buffered);
            }
        }
    }

    /// Consumes (part of) the marker at the current offset and checks it
    /// once whole.
    fn take_marker(&mut self, input: &mut &[u8]) -> Result<()> {
        let take = (MARKER_LEN - self.marker_got).min(input.len());
        let (head, rest) = input.split_at(take);
        self.marker[self.marker_got..self.marker_got + take].copy_from_slice(head);
        self.marker_got += take;
        self.pos += take as u64;
        *input = rest;
        if self.marker_got < MARKER_LEN {
            return Ok(());
        }
        self.marker_got = 0;
        self.started = true;
        let marker_pos = self.pos - MARKER_LEN as u64;
        // Before the length field it points at the FPDU that follows (0);
        // else back to the length field.
        let expected = if self.got == 0 {
            0
        } else {
            marker_pos - self.fpdu_start
        };
        let received = Marker::new_unchecked(&self.marker).fpdu_distance();
        if u64::from(received) != expected {
            return Err(Error::MarkerMismatch);
        }
        // Markers up to the CRC field are covered by the CRC.
        if self.got < LENGTH_LEN || self.got <= self.crc_start() {
            let marker = self.marker;
            self.update_crc(&marker);
        }
        Ok(())
    }

    /// Consumes FPDU octets up to the next marker, the end of the current
    /// field or the end of `input`; true when the FPDU is complete and its
    /// ULPDU is in `buf`.
    fn take_logical(&mut self, input: &mut &[u8]) -> Result<bool> {
        let mut avail = input.len();
        if self.config.markers {
            avail = avail.min(to_next_marker(self.pos) as usize);
        }
        if self.got < LENGTH_LEN {
            if self.got == 0 {
                self.fpdu_start = self.pos;
                self.started = true;
            }
            let n = (LENGTH_LEN - self.got).min(avail);
            let bytes = self.consume(input, n);
            self.length[self.got - n..self.got].copy_from_slice(bytes);
            let bytes = self.length;
            self.update_crc(&bytes[self.got - n..self.got]);
            if self.got == LENGTH_LEN {
                self.ulpdu_len = usize::from(u16::from_be_bytes(self.length));
                if self.ulpdu_len > usize::from(self.config.max_ulpdu_len) {
                    return Err(Error::FpduTooLong(self.ulpdu_len));
                }
                self.buf.reserve_exact(self.ulpdu_len);
            }
            return Ok(false);
        }
        let ulpdu_end = LENGTH_LEN + self.ulpdu_len;
        let crc_start = self.crc_start();
        if self.got < crc_start {
            let field_end = if self.got < ulpdu_end {
                ulpdu_end
            } else {
                crc_start
            };
            let n = (field_end - self.got).min(avail);
            let in_ulpdu = self.got < ulpdu_end;
            let bytes = consume(input, n, &mut self.got, &mut self.pos);
            if in_ulpdu {
                self.buf.extend_from_slice(bytes);
            }
            if self.config.crc {
                self.crc.update(bytes);
            }
            return Ok(false);
        }
        let n = (self.total() - self.got).min(avail);
        let at = self.got - crc_start;
        let bytes = self.consume(input, n);
        self.crc_field[at..at + n].copy_from_slice(bytes);
        if self.got < self.total() {
            return Ok(false);
        }
        if self.config.crc {
            check_crc(self.crc, &self.crc_field)?;
        }
        self.reset_fpdu();
        Ok(true)
    }

    fn consume<'i>(&mut self, input: &mut &'i [u8], n: usize) -> &'i [u8] {
        consume(input, n, &mut self.got, &mut self.pos)
    }
}

/// Splits `n` octets off the front of `input`, counting them in `got` and
/// `pos`.
fn consume<'i>(input: &mut &'i [u8], n: usize, got: &mut usize, pos: &mut u64) -> &'i [u8] {
    let (head, rest) = input.split_at(n);
    *input = rest;
    *got += n;
    *pos += n as u64;
    head
}

fn check_crc(computed: Crc32c, field: &[u8]) -> Result<()> {
    let received = match field {
        [a, b, c, d] => super::fpdu::crc_from_wire([*a, *b, *c, *d]),
        _ => return Err(Error::MpaMalformed("short CRC field")),
    };
    let computed = computed.value();
    if received == computed {
        Ok(())
    } else {
        Err(Error::Crc { received, computed })
    }
}

enum Step<'i> {
    Pending,
    Borrowed(&'i [u8]),
    Buffered,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::fpdu::MAX_ULPDU_LEN;

    fn crc_markers() -> FramerConfig {
        FramerConfig {
            crc: true,
            markers: true,
        }
    }

    fn deframer(config: FramerConfig) -> Deframer {
        Deframer::new(DeframerConfig {
            crc: config.crc,
            markers: config.markers,
            max_ulpdu_len: u16::MAX,
        })
    }

    /// Feeds `stream` in chunks of the given sizes (cycled) and collects the
    /// ULPDUs.
    fn deframe_chunked(d: &mut Deframer, stream: &[u8], chunks: &[usize]) -> Result<Vec<Vec<u8>>> {
        let mut out = Vec::new();
        let mut rest = stream;
        let mut i = 0;
        while !rest.is_empty() {
            let n = chunks[i % chunks.len()].clamp(1, rest.len());
            i += 1;
            let (mut chunk, tail) = rest.split_at(n);
            rest = tail;
            while let Some(u) = d.poll(&mut chunk)? {
                out.push(u.to_vec());
            }
            assert!(chunk.is_empty());
        }
        Ok(out)
    }

    /// Three FPDUs with markers and CRC, checked against a separate Python
    /// model of RFC 5044 framing (bitwise CRC32c): a leading marker at 0, an
    /// interior marker at 512 with FPDUPTR 508, an FPDU ending exactly at
    /// 1024, and the next FPDU's leading marker at 1024.
    #[test]
    fn test_marker_vector() {
        let a: Vec<u8> = (0..600).map(|i| (i & 0xff) as u8).collect();
        let b: Vec<u8> = (0..400).map(|i| ((i * 7) & 0xff) as u8).collect();
        let mut framer = Framer::new(crc_markers());
        let mut stream = Vec::new();
        framer.frame(&[&a], &mut stream).unwrap();
        assert_eq!(stream.len(), 616);
        framer.frame(&[&b[..100], &b[100..]], &mut stream).unwrap();
        assert_eq!(stream.len(), 1024);
        framer.frame(&[b"abc"], &mut stream).unwrap();
        assert_eq!(stream.len(), 1040);
        assert_eq!(&stream[0..4], &[0, 0, 0, 0]);
        assert_eq!(&stream[4..6], &[0x02, 0x58]); // 600
        assert_eq!(&stream[512..516], &[0, 0, 0x01, 0xfc]);
        assert_eq!(&stream[612..616], &0x1a28_666au32.to_le_bytes());
        assert_eq!(&stream[1020..1024], &0x455d_c50au32.to_le_bytes());
        assert_eq!(
            &stream[1024..],
            &[0, 0, 0, 0, 0x00, 0x03, b'a', b'b', b'c', 0, 0, 0, 0x8e, 0x24, 0xdf, 0xb5]
        );
        let got = deframe_chunked(&mut deframer(crc_markers()), &stream, &[1040]).unwrap();
        assert_eq!(got, vec![a, b, b"abc".to_vec()]);
    }

    /// RFC 3385's CRC32c, bit by bit: a model independent of the
    /// accelerated kernels the framer uses.
    fn crc32c_bitwise(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0x82f6_3b78
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    /// Without markers, [`Framer::frame`] and [`Framer::frame_appending`]
    /// both emit length field, ULPDU, zero pad and the CRC (bitwise
    /// model, little-endian as siw sends it) over all of them, however the
    /// ULPDU is split into parts, and FPDU after FPDU.
    #[test]
    fn test_plain_framing_matches_model() {
        for crc in [false, true] {
            let config = FramerConfig {
                crc,
                markers: false,
            };
            let (mut framer, mut appending) = (Framer::new(config), Framer::new(config));
            let (mut a, mut b, mut expected) = (Vec::new(), Vec::new(), Vec::new());
            for len in [0usize, 1, 2, 3, 18, 19, 26, 100, 4097] {
                let ulpdu: Vec<u8> = (0..len).map(|i| (i * 31 + len) as u8).collect();
                let split = len.min(14);
                let start = expected.len();
                expected.extend_from_slice(&(len as u16).to_be_bytes());
                expected.extend_from_slice(&ulpdu);
                expected.resize(start + fpdu_len(len) - CRC_LEN, 0);
                let value = if crc {
                    crc32c_bitwise(&expected[start..])
                } else {
                    0
                };
                expected.extend_from_slice(&value.to_le_bytes());
                framer
                    .frame(&[&ulpdu[..split], &[], &ulpdu[split..]], &mut a)
                    .unwrap();
                appending
                    .frame_appending(&ulpdu[..split], &mut b, |out| {
                        out.extend_from_slice(&ulpdu[split..]);
                        Ok::<(), ()>(())
                    })
                    .unwrap()
                    .unwrap();
                assert_eq!(a, expected, "frame, len {len}, crc {crc}");
                assert_eq!(b, expected, "frame_appending, len {len}, crc {crc}");
                assert_eq!(framer.stream_offset(), expected.len() as u64);
                assert_eq!(appending.stream_offset(), expected.len() as u64);
            }
        }
    }

    /// A payload that cannot be appended, or a ULPDU over the limit,
    /// leaves the output and the stream offset as they were; markers are
    /// refused.
    #[test]
    fn test_frame_appending_failures_write_nothing() {
        let mut framer = Framer::new(FramerConfig {
            crc: true,
            markers: false,
        });
        let mut out = vec![7u8; 3];
        let failed = framer.frame_appending(b"head", &mut out, |out| {
            out.extend_from_slice(b"partial");
            Err("region gone")
        });
        assert_eq!(failed, Ok(Err("region gone")));
        let too_long = framer.frame_appending(b"head", &mut out, |out| {
            out.resize(out.len() + MAX_ULPDU_LEN, 1);
            Ok::<(), ()>(())
        });
        assert!(matches!(too_long, Err(Error::FpduTooLong(_))));
        assert_eq!((out, framer.stream_offset()), (vec![7u8; 3], 0));
        let mut markers = Framer::new(crc_markers());
        let refused = markers.frame_appending(b"head", &mut Vec::new(), |_| Ok::<(), ()>(()));
        assert_eq!(refused, Err(Error::MpaLocalCatastrophic));
    }

    /// For every stream offset in 0..1024 (4-aligned, as FPDU starts always
    /// are) and several ULPDU sizes: markers land exactly at multiples of
    /// 512, point back to the length field (0 when leading), and the
    /// deframer gets the ULPDUs back, whole or byte by byte.
    #[test]
    fn test_markers_at_every_offset() {
        let sizes = [
            0usize, 1, 2, 3, 18, 19, 502, 503, 506, 507, 508, 509, 510, 1100,
        ];
        for filler_len in (0..1024).step_by(4) {
            for &size in &sizes {
                let mut framer = Framer::new(crc_markers());
                let mut stream = Vec::new();
                // A first FPDU that brings the stream to `filler_len`, when
                // possible (an FPDU is at least 8 octets).
                let mut expected = Vec::new();
                if filler_len >= 12 {
                    let mut ulen = filler_len - 8;
                    while framer.framed_len(ulen).unwrap() > filler_len {
                        ulen -= 4;
                    }
                    let filler = vec![0xeeu8; ulen];
                    framer.frame(&[&filler], &mut stream).unwrap();
                    expected.push(filler);
                }
                let start = stream.len();
                let ulpdu: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
                framer.frame(&[&ulpdu], &mut stream).unwrap();
                expected.push(ulpdu);
                check_marker_positions(&stream);
                assert_eq!(
                    start as u64 + (stream.len() - start) as u64,
                    framer.stream_offset()
                );
                let whole = deframe_chunked(&mut deframer(crc_markers()), &stream, &[stream.len()])
                    .unwrap();
                assert_eq!(whole, expected, "offset {start} size {size}");
                let bytewise =
                    deframe_chunked(&mut deframer(crc_markers()), &stream, &[1]).unwrap();
                assert_eq!(bytewise, expected);
            }
        }
    }

    /// Walks a marked stream: each marker at a multiple of 512 must point
    /// back to its FPDU's length field.
    fn check_marker_positions(stream: &[u8]) {
        let mut pos = 0usize;
        while pos < stream.len() {
            // Start of an FPDU: maybe a leading marker.
            if is_marker_pos(pos as u64) {
                assert_eq!(
                    &stream[pos..pos + 4],
                    &[0, 0, 0, 0],
                    "leading marker at {pos}"
                );
                pos += 4;
            }
            let start = pos;
            let ulen = usize::from(be_u16(&stream[pos..pos + 2]));
            let mut logical = fpdu_len(ulen);
            while logical > 0 {
                if is_marker_pos(pos as u64) {
                    let ptr = usize::from(be_u16(&stream[pos + 2..pos + 4]));
                    assert_eq!(ptr, pos - start, "marker at {pos}");
                    pos += 4;
                }
                pos += 1;
                logical -= 1;
            }
        }
        assert_eq!(pos, stream.len());
    }

    /// A marker between the pad and the CRC is covered by the CRC; a marker
    /// in the ULPDU splits it at ULPDU offset ≡ 2 mod 4.
    #[test]
    fn test_marker_before_crc() {
        // Leading marker at 0, length at 4, CRC must start at 512: the
        // logical FPDU is 508 + 4 octets, so ULPDU 505 (+1 pad).
        let mut framer = Framer::new(crc_markers());
        let ulpdu = vec![0x11u8; 505];
        let mut stream = Vec::new();
        framer.frame(&[&ulpdu], &mut stream).unwrap();
        assert_eq!(stream.len(), 4 + 508 + 4 + 4);
        assert_eq!(&stream[512..516], &[0, 0, 0x01, 0xfc]);
        let mut crc = Crc32c::new();
        crc.update(&stream[..516]);
        assert_eq!(&stream[516..520], &crc.to_wire());
        let got = deframe_chunked(&mut deframer(crc_markers()), &stream, &[7]).unwrap();
        assert_eq!(got, vec![ulpdu]);
    }

    #[test]
    fn test_deframer_errors() {
        let mut framer = Framer::new(crc_markers());
        let mut stream = Vec::new();
        framer.frame(&[&[5u8; 700]], &mut stream).unwrap();
        // Corrupt the interior marker's FPDUPTR.
        let mut bad = stream.clone();
        bad[515] ^= 0x04;
        let mut d = deframer(crc_markers());
        assert_eq!(
            deframe_chunked(&mut d, &bad, &[3]),
            Err(Error::MarkerMismatch)
        );
        // It stays failed.
        assert_eq!(d.poll(&mut &stream[..]), Err(Error::MarkerMismatch));
        assert_eq!(d.error(), Some(Error::MarkerMismatch));
        // Low FPDUPTR bits and reserved bits are ignored by the marker check,
        // but the reserved bits are covered by the CRC.
        let mut low = stream.clone();
        low[515] |= 0x03;
        assert!(matches!(
            deframe_chunked(&mut deframer(crc_markers()), &low, &[700]),
            Err(Error::Crc { .. })
        ));
        let no_crc = FramerConfig {
            crc: false,
            markers: true,
        };
        let mut plain = Vec::new();
        Framer::new(no_crc)
            .frame(&[&[5u8; 700]], &mut plain)
            .unwrap();
        plain[515] |= 0x03;
        plain[512] = 0xff;
        assert_eq!(
            deframe_chunked(&mut deframer(no_crc), &plain, &[700]).unwrap(),
            vec![vec![5u8; 700]]
        );
        // A payload bit flip is a CRC error.
        let mut flip = stream.clone();
        flip[100] ^= 1;
        assert!(matches!(
            deframe_chunked(&mut deframer(crc_markers()), &flip, &[1]),
            Err(Error::Crc { .. })
        ));
        // Too long for the receiver.
        let mut small = Deframer::new(DeframerConfig {
            crc: true,
            markers: true,
            max_ulpdu_len: 699,
        });
        assert_eq!(
            deframe_chunked(&mut small, &stream, &[1]),
            Err(Error::FpduTooLong(700))
        );
        let mut small = Deframer::new(DeframerConfig {
            crc: false,
            markers: false,
            max_ulpdu_len: 10,
        });
        assert_eq!(
            small.poll(&mut &[0x00u8, 0x0b][..]),
            Err(Error::FpduTooLong(11))
        );
    }

    #[test]
    fn test_zero_copy() {
        let config = FramerConfig {
            crc: true,
            markers: false,
        };
        let mut framer = Framer::new(config);
        let mut stream = Vec::new();
        for n in [18usize, 100, 3] {
            framer.frame(&[&vec![n as u8; n]], &mut stream).unwrap();
        }
        let mut d = deframer(config);
        let mut input = &stream[..];
        for n in [18usize, 100, 3] {
            let u = d.poll(&mut input).unwrap().unwrap();
            assert!(u.is_zero_copy());
            assert_eq!(&*u, &vec![n as u8; n][..]);
        }
        assert_eq!(d.poll(&mut input), Ok(None));
        assert!(d.is_idle());
        // Split mid-FPDU: the straddling one is buffered, the others borrowed.
        let mut d = deframer(config);
        let (a, b) = stream.split_at(30);
        let mut input = a;
        let u = d.poll(&mut input).unwrap().unwrap();
        assert!(u.is_zero_copy());
        assert_eq!(d.poll(&mut input), Ok(None));
        assert!(!d.is_idle());
        let mut input = b;
        let u = d.poll(&mut input).unwrap().unwrap();
        assert!(!u.is_zero_copy());
        assert_eq!(u.len(), 100);
        let u = d.poll(&mut input).unwrap().unwrap();
        assert!(u.is_zero_copy());
        assert_eq!(u.len(), 3);
        // With markers, an FPDU clear of marker positions is borrowed too.
        let mut framer = Framer::new(crc_markers());
        let mut stream = Vec::new();
        framer.frame(&[&[1u8; 20]], &mut stream).unwrap(); // leading marker
        framer.frame(&[&[2u8; 20]], &mut stream).unwrap();
        let mut d = deframer(crc_markers());
        let mut input = &stream[..];
        assert!(!d.poll(&mut input).unwrap().unwrap().is_zero_copy());
        assert!(d.poll(&mut input).unwrap().unwrap().is_zero_copy());
    }

    #[test]
    fn test_framer_limits() {
        let mut framer = Framer::new(crc_markers());
        let mut out = [0u8; 16];
        assert_eq!(
            framer.frame_into(&[b"abcdefghi"], &mut out),
            Err(Error::Truncated {
                layer: Layer::Llp,
                need: 20,
                have: 16
            })
        );
        assert_eq!(framer.stream_offset(), 0);
        // With markers the last FPDUPTR must fit 16 bits.
        let big = vec![0u8; MAX_ULPDU_LEN];
        assert_eq!(
            framer.framed_len(big.len()),
            Err(Error::FpduTooLong(MAX_ULPDU_LEN))
        );
        let mut v = Vec::new();
        assert_eq!(
            framer.frame(&[&big], &mut v),
            Err(Error::FpduTooLong(MAX_ULPDU_LEN))
        );
        assert!(v.is_empty());
        // The largest that fits round-trips.
        let mut n = MAX_ULPDU_LEN;
        while framer.framed_len(n).is_err() {
            n -= 1;
        }
        assert!(n > 65_000);
        let data = vec![9u8; n];
        framer.frame(&[&data], &mut v).unwrap();
        let got = deframe_chunked(&mut deframer(crc_markers()), &v, &[4096]).unwrap();
        assert_eq!(got, vec![data]);
        // Without markers 65535 is fine, 65536 is not.
        let mut plain = Framer::new(FramerConfig::default());
        assert_eq!(plain.framed_len(MAX_ULPDU_LEN), Ok(fpdu_len(MAX_ULPDU_LEN)));
        assert_eq!(
            plain.frame(&[&big, b"x"], &mut v),
            Err(Error::FpduTooLong(MAX_ULPDU_LEN + 1))
        );
    }

    mod prop {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(128))]

            /// Framer → Deframer is the identity for any ULPDU sequence,
            /// CRC/marker setting and chunking.
            #[test]
            fn framer_deframer_identity(
                crc in any::<bool>(),
                markers in any::<bool>(),
                ulpdus in proptest::collection::vec(
                    proptest::collection::vec(any::<u8>(), 0..1500), 0..8),
                chunks in proptest::collection::vec(1usize..700, 1..8),
            ) {
                let config = FramerConfig { crc, markers };
                let mut framer = Framer::new(config);
                let mut stream = Vec::new();
                for u in &ulpdus {
                    let (a, b) = u.split_at(u.len() / 2);
                    framer.frame(&[a, b], &mut stream).unwrap();
                }
                prop_assert_eq!(framer.stream_offset(), stream.len() as u64);
                let mut d = deframer(config);
                let got = deframe_chunked(&mut d, &stream, &chunks).unwrap();
                prop_assert_eq!(got, ulpdus);
                prop_assert!(d.is_idle());
                prop_assert_eq!(d.stream_offset(), stream.len() as u64);
            }

            /// Arbitrary octets never panic the deframer and never grow its
            /// buffer past the limit.
            #[test]
            fn deframer_garbage(
                crc in any::<bool>(),
                markers in any::<bool>(),
                max in 0u16..2000,
                bytes in proptest::collection::vec(any::<u8>(), 0..3000),
                chunk in 1usize..64,
            ) {
                let mut d = Deframer::new(DeframerConfig { crc, markers, max_ulpdu_len: max });
                for mut c in bytes.chunks(chunk) {
                    loop {
                        match d.poll(&mut c) {
                            Ok(Some(u)) => prop_assert!(u.len() <= usize::from(max)),
                            Ok(None) => break,
                            Err(_) => break,
                        }
                    }
                    prop_assert!(d.buf.capacity() <= usize::from(max));
                }
            }
        }
    }
}
