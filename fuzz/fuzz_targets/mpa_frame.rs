//! MPA Request/Reply parsing on arbitrary octets: never panics, and whatever
//! parses emits to octets that parse to the same frame.
#![no_main]

use libfuzzer_sys::fuzz_target;
use provider::wire::mpa::{frame_len, Frame, FrameKind, FrameReader, FrameRepr};

fuzz_target!(|input: &[u8]| {
    // The first octet may supply a valid key so the fuzzer gets past it.
    let Some((&selector, rest)) = input.split_first() else {
        return;
    };
    let mut owned = Vec::new();
    let data = match selector % 3 {
        0 => rest,
        pick => {
            let kind = if pick == 1 {
                FrameKind::Request
            } else {
                FrameKind::Reply
            };
            owned.extend_from_slice(kind.key());
            owned.extend_from_slice(rest);
            &owned[..]
        }
    };
    let _ = frame_len(data);
    // The streaming reader agrees with the one-shot parse on a whole frame.
    let mut reader = FrameReader::new(FrameKind::Request);
    let mut input = data;
    let _ = reader.read(&mut input);

    let Ok(repr) = FrameRepr::parse(&Frame::new_unchecked(data)) else {
        return;
    };
    assert_eq!(frame_len(data), Ok(data.len()));
    let mut out = vec![0u8; repr.buffer_len()];
    repr.emit(&mut Frame::new_unchecked(&mut out[..]))
        .expect("a parsed frame emits");
    let again = FrameRepr::parse(&Frame::new_unchecked(&out[..])).expect("emitted frame parses");
    assert_eq!(again, repr);
});
