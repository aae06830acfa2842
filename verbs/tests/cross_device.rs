//! stag on two different devices of one fabric: the userspace provider
//! (`stag0`, RDMAP extensions on the wire) and a kernel iWARP device
//! without them (`$STAG_PEER_DEVICE`, siw0 in the VM suite, listening on
//! `$STAG_ADDR`). Each end's header tells the other what its device
//! executes; what siw lacks is emulated, in both directions. Needs the
//! kernel device, so ignored here; `scripts/vm/vm-suite.sh` runs it with
//! `--ignored` on siw0.

mod common;

use std::time::Duration;

use common::*;
use verbs::{ContextOptions, Emulation, OpKind, PeerAtomics, Support, WcStatus};

fn peer_device() -> String {
    std::env::var("STAG_PEER_DEVICE").expect("STAG_PEER_DEVICE names a kernel iWARP device")
}

fn agent(s: &Support) -> bool {
    s.emulation() == Some(Emulation::Agent)
}

#[test]
#[ignore = "needs a kernel iWARP device (the VM suite runs it on siw0)"]
fn userspace_initiator_to_kernel_siw() {
    let default = ContextOptions::default();
    let peer = peer_device();
    let (c, s) = pair_across(
        ("stag0", &default),
        (&peer, &default),
        2,
        &verbs::ConnectOptions::default(),
    );
    // stag0 does atomics and Commit itself, but siw cannot execute them.
    assert_eq!(c.ctx.capabilities().get(OpKind::FetchAdd), &Support::Native);
    for k in [OpKind::FetchAdd, OpKind::Swap, OpKind::Commit] {
        assert!(agent(c.qp.capabilities().get(k)), "{k}");
    }
    assert_eq!(
        c.qp.probe_atomics(s.mr.remote(0), Duration::from_secs(5))
            .unwrap(),
        PeerAtomics::Agent
    );
    run_extensions(&c, &s);
    run_extensions(&s, &c);
}

#[test]
#[ignore = "needs a kernel iWARP device (the VM suite runs it on siw0)"]
fn kernel_siw_initiator_to_userspace() {
    let default = ContextOptions::default();
    let peer = peer_device();
    let (c, s) = pair_across(
        (&peer, &default),
        ("stag0", &default),
        2,
        &verbs::ConnectOptions::default(),
    );
    assert!(agent(s.qp.capabilities().get(OpKind::CmpSwap)));
    run_extensions(&c, &s);
    run_extensions(&s, &c);
}

/// Without stag's header siw is just an RFC 5040 RNIC: RFC 7306 §1.1's
/// FetchAdd of 0 draws its Terminate and the connection ends.
#[test]
#[ignore = "needs a kernel iWARP device (the VM suite runs it on siw0)"]
fn probing_kernel_siw_without_stag() {
    let default = ContextOptions::default();
    let peer = peer_device();
    let opts = verbs::ConnectOptions {
        stag_header: false,
        ..verbs::ConnectOptions::default()
    };
    let (c, s) = pair_across(("stag0", &default), (&peer, &default), 0, &opts);
    assert_eq!(c.qp.peer_native(), None);
    let got =
        c.qp.probe_atomics(s.mr.remote(0), Duration::from_secs(10))
            .unwrap();
    assert!(
        matches!(got, PeerAtomics::Refused { status, .. } if status != WcStatus::Success),
        "{got:?}"
    );
}
