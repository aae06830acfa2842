//! The `stag` benchmarks' messages (`STGB`, `STGC`, `STGF`, `STGS`): any
//! bytes parse to a message or an error without panicking, and what
//! parses re-emits to the same bytes' meaning.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stag::bench_wire::{ctrl, floor, hello, scale};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = hello::Repr::decode(data) {
        assert_eq!(hello::Repr::decode(&h.encode()), Ok(h));
    }
    if let Ok(Some(c)) = ctrl::Repr::decode(data) {
        assert_eq!(ctrl::Repr::decode(&c.encode()), Ok(Some(c)));
    }
    if let Ok(f) = floor::Repr::decode(data) {
        assert_eq!(floor::Repr::decode(&f.encode()), Ok(f));
    }
    if let Ok(s) = scale::Repr::decode(data) {
        assert_eq!(scale::Repr::decode(&s.encode()), Ok(s));
    }
});
