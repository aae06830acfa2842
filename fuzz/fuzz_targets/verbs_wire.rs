//! stag's own headers above the verbs: any bytes parse to a header or an
//! error without panicking, and what parses re-emits to the same header.
#![no_main]

use libfuzzer_sys::fuzz_target;
use verbs::wire::{agent, hello};

fuzz_target!(|data: &[u8]| {
    let (parsed, rest) = hello::Repr::split(data);
    match parsed {
        Some(h) => {
            assert_eq!(data.len(), h.header_len() + rest.len());
            let again = h.encode(rest);
            assert_eq!(hello::Repr::split(&again), (Some(h), rest));
        }
        None => assert_eq!(rest, data),
    }
    if let Ok(p) = agent::Packet::new_checked(data) {
        if let Ok(m) = agent::Repr::parse(&p) {
            let bytes = m.to_bytes();
            assert_eq!(agent::Repr::parse(&agent::Packet::new_unchecked(&bytes[..])), Ok(m));
        }
    }
});
