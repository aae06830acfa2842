//! Parse arbitrary ULPDUs as DDP/RDMAP; whatever parses must emit and
//! re-parse to the same header and payload. Also exercises the streaming
//! `header_len` and Terminate construction from the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use provider::wire::rdmap::{header_len, RdmapRepr};
use provider::wire::terminate::TerminateRepr;

fuzz_target!(|data: &[u8]| {
    if let [a, b, ..] = data {
        let announced = header_len([*a, *b]);
        if let Ok((repr, payload)) = RdmapRepr::parse(data) {
            // The streaming length agrees with the full parse.
            assert_eq!(announced, Ok(repr.opcode().header_len()));
            let mut buf = vec![0u8; repr.header_len() + payload.len()];
            repr.emit(&mut buf);
            buf[repr.header_len()..].copy_from_slice(payload);
            let (again, payload2) = RdmapRepr::parse(&buf).expect("emitted bytes re-parse");
            assert_eq!(again, repr);
            assert_eq!(payload2, payload);
        }
    }
    let _ = RdmapRepr::parse(data).map_err(|err| {
        // Every rejection can be reported, copying headers from the bytes.
        let term = TerminateRepr::for_error(&err, Some(data));
        let mut buf = vec![0u8; term.buffer_len()];
        term.emit(&mut buf);
        assert_eq!(TerminateRepr::parse(term.msn, &buf), Ok(term));
    });
});
