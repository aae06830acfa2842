//! Byte vectors captured against a live kernel siw (Linux 6.12, in the VM of
//! `scripts/vm/vm.sh -- scripts/vm/interop.sh` with `STAG_INTEROP_PCAP`): each
//! one pins a place where our provider and siw once disagreed, or where the
//! capture confirmed that they agree.

use provider::mem::{MrTable, PdId};
use provider::qp::{Connection, Env, Event, QpCaps};
use provider::setup::{Negotiated, Rtr};
use provider::wire::ErrorType;

const PD: PdId = 1;

fn conn(initiator: bool, crc: bool, rtr: Option<Rtr>) -> Connection {
    Connection::new(
        1,
        PD,
        QpCaps::default(),
        Negotiated {
            initiator,
            revision: 2,
            crc,
            markers_tx: false,
            markers_rx: false,
            ird: 8,
            ord: 8,
            rtr,
            peer_private_data: Vec::new(),
        },
        false,
    )
}

fn transmit(c: &mut Connection, mem: &MrTable) -> Vec<u8> {
    let env = Env { mem, srq: None };
    let mut out = Vec::new();
    loop {
        if c.poll_transmit(&env, &mut out, 1 << 20) {
            continue;
        }
        match c.poll_durability() {
            Some(job) => c.handle_commit_done(job.req_id, job.run(mem)),
            None => break,
        }
    }
    out
}

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Our zero-length Write RTR, as captured (case stag-client-p2p-write, CRC
/// on): siw accepted it. STag 1, TO 0, exactly what siw_qp_mpa_rts sends.
#[test]
fn write_rtr_matches_capture() {
    let mem = MrTable::new();
    let mut c = conn(true, true, Some(Rtr::ZeroLengthWrite));
    assert_eq!(
        transmit(&mut c, &mem),
        hex("000e c140 00000001 0000000000000000 ebd34c5f")
    );
}

/// Our zero-length Read RTR. The first interop run sent sink STag 1; siw's
/// own Read RTR (siw_qp_mpa_rts: one zero-length SGE with lkey 0 as the
/// sink, rkey 1 as the source) carries sink STag 0, source STag 1.
#[test]
fn read_rtr_matches_siw() {
    let mem = MrTable::new();
    let mut c = conn(true, false, Some(Rtr::ZeroLengthRead));
    assert_eq!(
        transmit(&mut c, &mem),
        hex("002e 4141 00000000 00000001 00000001 00000000
             00000000 0000000000000000 00000000
             00000001 0000000000000000 00000000")
    );
}

/// siw's answer to a Read RTR (case stag-client-p2p-read, CRC off): a
/// zero-length last Read Response echoing the sink STag. It completes the
/// RTR without a completion or an error.
#[test]
fn siw_read_rtr_response_is_accepted() {
    let mem = MrTable::new();
    let env = Env {
        mem: &mem,
        srq: None,
    };
    let mut c = conn(true, false, Some(Rtr::ZeroLengthRead));
    transmit(&mut c, &mem);
    for stag in ["00000001", "00000000"] {
        let mut c2 = conn(true, false, Some(Rtr::ZeroLengthRead));
        transmit(&mut c2, &mem);
        c2.handle_bytes(
            &hex(&format!("000e c142 {stag} 0000000000000000 00000000")),
            &env,
        );
        let events: Vec<_> = std::iter::from_fn(|| c2.poll_event()).collect();
        assert!(
            events
                .iter()
                .all(|e| !matches!(e, Event::TerminateSent(_) | Event::TerminateReceived(_))),
            "{events:?}"
        );
        assert!(c2.poll_completion().is_none());
    }
}

/// siw's Terminate for a Read Request with an invalid source STag (case
/// terminate-from-siw, CRC on), whole FPDU. Its control word `10 00 07 00`
/// is siw's little-endian bitfield layout of RDMAP / remote protection /
/// invalid STag with M+D+R. Before the fix we could not parse it, answered
/// with a Terminate of our own and never reported the peer's cause. (The
/// copied Read Request says MSN 0x10 where ours said 1: siw copies its
/// receive context's header, not the bytes it received.)
#[test]
fn siw_terminate_is_decoded() {
    let mem = MrTable::new();
    let env = Env {
        mem: &mem,
        srq: None,
    };
    let mut c = conn(true, true, None);
    transmit(&mut c, &mem);
    c.handle_bytes(
        &hex("0046 4147 00000000 00000002 00000001 00000000 10000700 0000
              4141 00000000 00000001 00000010 00000000
              00000176 00007f1f70da8000 00000010 b24b8100 00007f1f709dd000
              53028c66"),
        &env,
    );
    let events: Vec<_> = std::iter::from_fn(|| c.poll_event()).collect();
    let cause = events
        .iter()
        .find_map(|e| match e {
            Event::TerminateReceived(c) => Some(*c),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no TerminateReceived: {events:?}"));
    assert_eq!(
        (cause.etype, cause.ecode),
        (ErrorType::RdmapRemoteProtection, 0x00)
    );
    assert!(
        !events.iter().any(|e| matches!(e, Event::TerminateSent(_))),
        "{events:?}"
    );
}
