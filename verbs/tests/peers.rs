//! A connection's matrix depends on both devices: a stag peer's header
//! says what its device executes, and what it lacks is emulated; a peer
//! that runs no stag can be probed for atomics as RFC 7306 §1.1 says.
//! The peer without RDMAP extensions is the userspace provider running
//! RFC 5040 only, as kernel siw does (the VM suite does the same against
//! siw0 itself in `cross_device`).

mod common;

use std::time::Duration;

use common::*;
use verbs::{ContextOptions, Emulation, OpKind, PeerAtomics, SendOp, Support, WcStatus};

fn rfc5040() -> ContextOptions {
    ContextOptions {
        rfc5040_only: true,
        ..ContextOptions::default()
    }
}

/// A full provider talking to an RFC 5040 one: the header tells the
/// client what the server's device lacks, so the client emulates it
/// instead of sending what the server would Terminate.
#[test]
fn stag_peer_lacking_extensions_gets_them_emulated() {
    let (c, s) = pair_between("stag0", &ContextOptions::default(), &rfc5040(), 2);
    let dev = c.ctx.capabilities();
    let conn = c.qp.capabilities();
    for k in [
        OpKind::FetchAdd,
        OpKind::CmpSwap,
        OpKind::MaskedFetchAdd,
        OpKind::MaskedCmpSwap,
        OpKind::Swap,
        OpKind::Commit,
    ] {
        assert_eq!(dev.get(k), &Support::Native);
        assert_eq!(conn.get(k).emulation(), Some(Emulation::Agent), "{k}");
        assert!(conn
            .get(k)
            .to_string()
            .contains("the peer's device lacks it"));
    }
    for k in [OpKind::Imm, OpKind::WriteImm] {
        assert_eq!(conn.get(k).emulation(), Some(Emulation::ImmMailbox), "{k}");
    }
    for k in [
        OpKind::Send,
        OpKind::Write,
        OpKind::Read,
        OpKind::SendInvalidate,
    ] {
        assert_eq!(conn.get(k), &Support::Native, "{k}");
    }
    let peer = c.qp.peer_native().expect("a stag peer");
    assert!(peer.contains(OpKind::Read) && !peer.contains(OpKind::FetchAdd));
    assert_eq!(s.qp.peer_native(), Some(c.ctx.native_ops()));
    // Known from the header: nothing is sent.
    assert_eq!(
        c.qp.probe_atomics(s.mr.remote(0), Duration::from_secs(5))
            .unwrap(),
        PeerAtomics::Agent
    );
    run_extensions(&c, &s);
}

/// The other way round: the RFC 5040 side emulates with its own matrix,
/// the full side's agent answers.
#[test]
fn rfc5040_initiator_runs_extensions_through_the_peer() {
    let (c, s) = pair_between("stag0", &rfc5040(), &ContextOptions::default(), 2);
    assert_eq!(
        c.qp.capabilities().get(OpKind::FetchAdd).emulation(),
        Some(Emulation::Agent)
    );
    // The server's own matrix is untouched by a peer that lacks what the
    // server only receives... except where it sends: its atomics towards
    // an RFC 5040 peer go through the client's agent too.
    assert_eq!(
        s.qp.capabilities().get(OpKind::FetchAdd).emulation(),
        Some(Emulation::Agent)
    );
    run_extensions(&c, &s);
    run_extensions(&s, &c);
}

/// A peer without stag's header: RFC 7306 §1.1's FetchAdd of 0 finds out
/// whether it executes atomics; what needs its agent is refused clearly.
#[test]
fn probing_a_peer_that_runs_no_stag() {
    use provider::device::{Device, Listener};
    use provider::mem::Access as PAccess;
    use provider::region::Region;
    for extensions in [true, false] {
        let dev = Device::open("raw").unwrap();
        let pd = dev.alloc_pd();
        let cq = provider::cq::CompletionQueue::new(64).unwrap();
        let qp = pd.create_qp(
            provider::qp::QpCaps {
                rdmap_extensions: extensions,
                ..provider::qp::QpCaps::default()
            },
            &cq,
            &cq,
            None,
        );
        let region = Region::anonymous(4096).unwrap();
        region.store_u64(64, 77).unwrap();
        // SAFETY: `region` outlives the registration (dropped after the
        // QP and PD at the end of this iteration, deregistered below).
        let stag = unsafe {
            pd.reg_mr(
                region.as_ptr(),
                region.len(),
                PAccess::LOCAL_WRITE | PAccess::REMOTE_ATOMIC | PAccess::REMOTE_READ,
                false,
            )
        }
        .unwrap();
        let target = verbs::Remote {
            addr: region.addr(64),
            rkey: stag,
        };
        let listener = Listener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let req = listener.accept().unwrap();
            req.accept(&qp, &provider::setup::MpaParams::default())
                .unwrap();
            qp
        });
        let ctx = verbs::Context::open("stag0").unwrap();
        let vpd = ctx.alloc_pd().unwrap();
        let vcq = ctx.create_cq(64).unwrap();
        let (vqp, _) = verbs::connect(&vpd, &vcq, addr, &verbs::ConnectOptions::default()).unwrap();
        let qp = server.join().unwrap();
        assert_eq!(vqp.peer_native(), None);
        // Unknown peer: what the device does stays native, unverified.
        assert_eq!(vqp.capabilities(), ctx.capabilities());
        assert!(matches!(
            vqp.probe_atomics(
                verbs::Remote {
                    addr: target.addr + 4,
                    ..target
                },
                Duration::from_secs(1)
            ),
            Err(verbs::Error::InvalidRequest(_))
        ));

        let got = vqp.probe_atomics(target, Duration::from_secs(10)).unwrap();
        if extensions {
            assert_eq!(got, PeerAtomics::Native);
            assert_eq!(region.load_u64(64).unwrap(), 77, "a FetchAdd of 0");
            assert_eq!(vqp.outstanding(), 0);
        } else {
            assert!(
                matches!(got, PeerAtomics::Refused { status, .. } if status != WcStatus::Success),
                "{got:?}"
            );
            assert_eq!(region.load_u64(64).unwrap(), 77);
            // The refusal took the stream down: new work flushes.
            let mr = vpd.alloc_mr(64, verbs::Access::LOCAL_WRITE).unwrap();
            vqp.post_send(verbs::WorkRequest::new(
                10,
                SendOp::Read { remote: target },
                &[mr.slice(0, 8).unwrap()],
            ))
            .unwrap();
            let c = wait_one(&vcq);
            assert_eq!((c.wr_id, c.status), (10, WcStatus::WrFlushErr));
        }
        drop(vqp);
        qp.set_error();
        let _ = pd.dereg_mr(stag);
    }
}

/// A device without the extensions, connected to a peer that runs no
/// stag: nothing can run what it lacks, and posting one says so.
#[test]
fn without_extensions_or_a_stag_peer_the_error_says_why() {
    use provider::device::{Device, Listener};
    let dev = Device::open("raw").unwrap();
    let pd = dev.alloc_pd();
    let cq = provider::cq::CompletionQueue::new(64).unwrap();
    let qp = pd.create_qp(provider::qp::QpCaps::default(), &cq, &cq, None);
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let req = listener.accept().unwrap();
        req.accept(&qp, &provider::setup::MpaParams::default())
            .unwrap();
        qp
    });
    let ctx = verbs::Context::open_with("stag0", &rfc5040()).unwrap();
    let vpd = ctx.alloc_pd().unwrap();
    let vcq = ctx.create_cq(64).unwrap();
    let (vqp, _) = verbs::connect(&vpd, &vcq, addr, &verbs::ConnectOptions::default()).unwrap();
    let qp = server.join().unwrap();
    let caps = vqp.capabilities();
    for k in [OpKind::FetchAdd, OpKind::Swap, OpKind::Imm, OpKind::Commit] {
        assert!(
            matches!(caps.get(k), Support::Unsupported { why } if why.contains("no stag header")),
            "{k}: {}",
            caps.get(k)
        );
    }
    let mr = vpd.alloc_mr(64, verbs::Access::LOCAL_WRITE).unwrap();
    let remote = mr.remote(0);
    for (op, local) in [
        (
            SendOp::Imm {
                imm: 1,
                solicited: false,
            },
            vec![],
        ),
        (
            SendOp::FetchAdd {
                remote,
                add: 1,
                mask: 0,
            },
            vec![mr.slice(0, 8).unwrap()],
        ),
    ] {
        let err = vqp
            .post_send(verbs::WorkRequest::new(9, op, &local))
            .unwrap_err();
        assert!(
            matches!(&err, verbs::Error::Unsupported { why, .. } if why.contains("stag")),
            "{err}"
        );
    }
    assert!(matches!(
        vqp.probe_atomics(remote, Duration::from_secs(1)),
        Err(verbs::Error::Unsupported {
            op: OpKind::FetchAdd,
            ..
        })
    ));
    // Nothing was sent: the connection still works.
    assert_eq!(vqp.outstanding(), 0);
    qp.set_error();
}

/// `stag_header: false` makes a plain RDMA connection even between two
/// stag ends: the server sees no header, the client knows nothing of the
/// server's device, and the probe asks the wire — refused here, by a
/// server running RFC 5040 only.
#[test]
fn a_plain_connection_probes_the_wire() {
    let opts = verbs::ConnectOptions {
        stag_header: false,
        ..verbs::ConnectOptions::default()
    };
    let default = ContextOptions::default();
    let (c, s) = pair_across(("stag0", &default), ("stag0", &rfc5040()), 0, &opts);
    assert_eq!(c.qp.peer_native(), None);
    assert_eq!(s.qp.peer_native(), None);
    let got =
        c.qp.probe_atomics(s.mr.remote(0), Duration::from_secs(10))
            .unwrap();
    assert!(
        matches!(got, PeerAtomics::Refused { status, .. } if status != WcStatus::Success),
        "{got:?}"
    );
}
