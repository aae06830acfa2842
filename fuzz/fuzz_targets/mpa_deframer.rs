//! The MPA deframer on arbitrary octets: the first octet picks CRC, markers,
//! the length limit and the chunk size; the rest is the TCP stream. It must
//! never panic, never yield more than the limit, and stay failed after an
//! error. The same stream fed whole must give the same ULPDUs and outcome.
#![no_main]

use libfuzzer_sys::fuzz_target;
use provider::wire::stream::{Deframer, DeframerConfig};
use provider::wire::Error;

fn run(config: DeframerConfig, stream: &[u8], chunk: usize) -> (Vec<Vec<u8>>, Option<Error>) {
    let mut deframer = Deframer::new(config);
    let mut ulpdus = Vec::new();
    for mut piece in stream.chunks(chunk) {
        loop {
            match deframer.poll(&mut piece) {
                Ok(Some(ulpdu)) => {
                    assert!(ulpdu.len() <= usize::from(config.max_ulpdu_len));
                    ulpdus.push(ulpdu.to_vec());
                }
                Ok(None) => break,
                Err(err) => {
                    assert_eq!(deframer.poll(&mut &b"more"[..]), Err(err));
                    return (ulpdus, Some(err));
                }
            }
        }
    }
    (ulpdus, None)
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, stream)) = data.split_first() else {
        return;
    };
    let config = DeframerConfig {
        crc: first & 1 != 0,
        markers: first & 2 != 0,
        max_ulpdu_len: if first & 4 != 0 { u16::MAX } else { 1024 },
    };
    let chunk = usize::from(first >> 3) + 1;
    let split = run(config, stream, chunk);
    let whole = run(config, stream, stream.len().max(1));
    assert_eq!(split, whole);
});
