//! Drive the untagged reassembly checker with arbitrary segment sequences
//! (it must never panic and never place bytes outside the buffer), and check
//! that the segmenter's output for an arbitrary message always reassembles.
#![no_main]

use libfuzzer_sys::fuzz_target;
use provider::wire::ddp::{Segments, UntaggedReassembly, UNTAGGED_HEADER_LEN};

fn u32_at(data: &[u8], i: usize) -> u32 {
    let mut b = [0u8; 4];
    for (k, slot) in b.iter_mut().enumerate() {
        *slot = data.get(i + k).copied().unwrap_or(0);
    }
    u32::from_le_bytes(b)
}

fuzz_target!(|data: &[u8]| {
    // Part 1: segment then reassemble.
    let msg_len = u32_at(data, 0) % (1 << 20);
    let mulpdu = (u32_at(data, 4) % 70_000) as usize;
    match Segments::new(msg_len, mulpdu, UNTAGGED_HEADER_LEN) {
        None => assert!(mulpdu <= UNTAGGED_HEADER_LEN),
        Some(segments) => {
            let mut q = UntaggedReassembly::new();
            let mut total = 0u32;
            let mut done = false;
            for span in segments {
                assert!(!done);
                assert!(span.len as usize + UNTAGGED_HEADER_LEN <= mulpdu);
                let p = q
                    .accept(1, span.offset, span.len, span.last, || Some(msg_len))
                    .expect("own segmentation reassembles");
                total += span.len;
                done = p.complete;
            }
            assert!(done);
            assert_eq!(total, msg_len);
        }
    }

    // Part 2: arbitrary segments, 13 bytes each: msn, mo, len, flags.
    let mut q = UntaggedReassembly::new();
    let mut capacity = 0u32;
    for chunk in data.get(16..).unwrap_or(&[]).chunks_exact(13) {
        let msn = q
            .expected_msn()
            .wrapping_add(u32::from(chunk[0] % 3))
            .wrapping_sub(1);
        let mo = u32_at(chunk, 1) % 4096;
        let len = u32_at(chunk, 5) % 4096;
        let last = chunk[9] & 1 != 0;
        let buffer = if chunk[9] & 2 != 0 {
            None
        } else {
            Some(u32_at(chunk, 10) % 8192)
        };
        let was = q.clone();
        match q.accept(msn, mo, len, last, || {
            capacity = buffer.unwrap_or(0);
            buffer
        }) {
            Ok(p) => {
                assert_eq!(p.offset, mo);
                assert!(p.message_len <= capacity);
                assert_eq!(p.complete, last);
            }
            Err(_) => assert_eq!(q, was),
        }
    }
});
