//! What happens around a connection rather than inside it: a peer that
//! stops reading, and a peer process that dies.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use provider::device::DeviceError;
use provider::qp::{PostError, QpCaps, QpState};
use provider::setup::{MpaParams, Negotiated, Request};
use provider::wire::ddp::TAGGED_HEADER_LEN;
use provider::wire::stream::{Deframer, DeframerConfig};
use provider::wr::{SendOp, SendWr, WcStatus};

/// Accept one TCP connection and answer its MPA Request.
fn accept_mpa(listener: &TcpListener) -> std::net::TcpStream {
    accept_mpa_negotiated(listener).0
}

/// [`accept_mpa`], with what the exchange settled.
fn accept_mpa_negotiated(listener: &TcpListener) -> (std::net::TcpStream, Negotiated) {
    let (mut sock, _) = listener.accept().unwrap();
    let mut reader = Request::reader();
    let mut buf = [0u8; 1024];
    let request = loop {
        let n = sock.read(&mut buf).unwrap();
        let mut input = &buf[..n];
        if let Some(repr) = reader.read(&mut input).unwrap() {
            break Request::from_repr(&repr);
        }
    };
    let (negotiated, reply) = request.accept(&MpaParams::default()).unwrap();
    sock.write_all(&reply).unwrap();
    (sock, negotiated)
}

/// A peer that completes the MPA exchange and then never reads again.
fn stalled_peer() -> (
    std::net::SocketAddr,
    std::thread::JoinHandle<()>,
    std::sync::mpsc::Sender<()>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let h = std::thread::spawn(move || {
        let sock = accept_mpa(&listener);
        // Now stall: no reads until told to go away.
        let _ = stop_rx.recv();
        drop(sock);
    });
    (addr, h, stop_tx)
}

#[test]
fn a_stalled_peer_fills_buffers_without_hanging() {
    let (addr, peer, stop) = stalled_peer();
    let me = Side::new(None);
    me.qp.connect(addr, &MpaParams::default()).unwrap();
    let data = vec![0x5au8; 1 << 20];
    me.mr.region().write_at(0, &data).unwrap();
    // Post 1 MiB Writes until the send queue refuses: the socket buffers
    // fill, posting never blocks, and the queue is the bound.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut posted = 0u64;
    loop {
        let wr = SendWr {
            wr_id: posted,
            op: SendOp::Write {
                remote: provider::wr::Remote { addr: 0, rkey: 1 },
            },
            sg_list: vec![me.mr.sge(0, 1 << 20)],
            signaled: true,
            fence: false,
        };
        match me.qp.post_send(wr) {
            Ok(()) => posted += 1,
            Err(DeviceError::Post(PostError::SendQueueFull(n))) => {
                assert_eq!(n, QpCaps::default().max_send_wr);
                break;
            }
            Err(e) => panic!("unexpected {e}"),
        }
        assert!(Instant::now() < deadline, "posting hung");
    }
    // Far fewer than `posted` MiB can be in flight in socket buffers; the
    // rest waits in the queue. The connection is still up.
    assert!(
        posted >= QpCaps::default().max_send_wr as u64 / 2,
        "{posted}"
    );
    assert_eq!(me.qp.state(), QpState::Rts);
    // The peer goes away: everything completes, each WR exactly once.
    stop.send(()).unwrap();
    peer.join().unwrap();
    let done = me.wait(posted as usize);
    let mut ids: Vec<u64> = done.iter().map(|w| w.wr_id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len() as u64, posted, "each WR completes exactly once");
    assert!(done.iter().any(|w| w.status == WcStatus::WrFlushErr));
    assert_eq!(me.qp.state(), QpState::Error);
}

/// Small Writes, each framed at its post and written by it (the post's
/// short way, `QpShared::drive_posted`), against a peer that does not read
/// yet: the socket fills, the posts that meet it leave their octets to the
/// whole drive and queue behind them, and the send queue ends the posting.
/// Nobody posts or polls after that, yet once the peer reads, every FPDU
/// arrives whole and in posting order, and every WR completes in order.
#[test]
fn small_posts_that_fill_the_socket_leave_whole_and_in_order() {
    // Framed, an FPDU of this payload is below the shortest segment a
    // post holds back (`tail::MIN_MSS`): each post writes it at once.
    const LEN: usize = 400;
    // More than the socket buffers take (26 MB): the posts stop at the
    // first WR the send queue refuses, with the stream full.
    const MOST: usize = 1 << 16;
    const SLOTS: usize = 2048;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    // A small receive buffer, inherited by the accepted socket.
    nix::sys::socket::setsockopt(&listener, nix::sys::socket::sockopt::RcvBuf, &4096).unwrap();
    let addr = listener.local_addr().unwrap();
    let (go, go_rx) = std::sync::mpsc::channel::<usize>();
    let peer = std::thread::spawn(move || {
        let (mut sock, negotiated) = accept_mpa_negotiated(&listener);
        assert!(!negotiated.markers_rx);
        let n = go_rx.recv().unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut deframer = Deframer::new(DeframerConfig {
            crc: negotiated.crc,
            markers: false,
            max_ulpdu_len: u16::MAX,
        });
        let mut payloads: Vec<Vec<u8>> = Vec::with_capacity(n);
        let mut buf = vec![0u8; 64 << 10];
        while payloads.len() < n {
            let got = sock
                .read(&mut buf)
                .unwrap_or_else(|e| panic!("after {} FPDUs: {e}", payloads.len()));
            assert!(got > 0, "closed after {} FPDUs", payloads.len());
            let mut input = &buf[..got];
            while let Some(ulpdu) = deframer.poll(&mut input).unwrap() {
                payloads.push(ulpdu[TAGGED_HEADER_LEN..].to_vec());
            }
        }
        // The socket too: the stream stays up until the checks are done.
        (payloads, sock)
    });
    let me = Side::new(None);
    me.qp.connect(addr, &MpaParams::default()).unwrap();
    // Write i carries i in its first 4 octets and i as u8 after them,
    // from a slot of the MR that Write i + SLOTS reuses: with at most
    // max_send_wr outstanding, Write i completed (it is in the socket) by
    // then.
    let payload = |i: usize| {
        let mut p = vec![i as u8; LEN];
        p[..4].copy_from_slice(&(i as u32).to_be_bytes());
        p
    };
    let mut done = Vec::new();
    let mut posted = 0;
    while posted < MOST {
        let off = posted % SLOTS * LEN;
        me.mr.region().write_at(off, &payload(posted)).unwrap();
        let wr = SendWr {
            wr_id: posted as u64,
            op: SendOp::Write {
                remote: provider::wr::Remote {
                    addr: off as u64,
                    rkey: 1,
                },
            },
            sg_list: vec![me.mr.sge(off, LEN as u32)],
            signaled: true,
            fence: false,
        };
        match me.qp.post_send(wr) {
            Ok(()) => posted += 1,
            Err(DeviceError::Post(PostError::SendQueueFull(_))) => break,
            Err(e) => panic!("unexpected {e}"),
        }
        // What the posts' own drives completed (this drives nothing).
        me.cq.try_poll_each(usize::MAX, |wc| done.push(wc));
    }
    assert!(posted < MOST, "the socket took all {MOST} Writes");
    assert!(done.len() < posted);
    go.send(posted).unwrap();
    let (payloads, _stream) = peer.join().unwrap();
    for (i, p) in payloads.iter().enumerate() {
        assert!(*p == payload(i), "FPDU {i} is not Write {i}");
    }
    done.extend(me.wait(posted - done.len()));
    let ids: Vec<u64> = done.iter().map(|wc| wc.wr_id).collect();
    assert_eq!(
        ids,
        (0..posted as u64).collect::<Vec<_>>(),
        "in posting order"
    );
    assert!(done.iter().all(|wc| wc.status == WcStatus::Success));
    assert_eq!(me.qp.state(), QpState::Rts);
}

const CHILD_ENV: &str = "STAG_LIFECYCLE_CHILD";

/// In the child process of the test below: accept one connection and
/// serve until killed. Ignored, so it never counts as a test of its own.
#[test]
#[ignore = "the child half of a_killed_peer_process_flushes_outstanding_work"]
fn child_responder() {
    let port_file = std::env::var(CHILD_ENV)
        .expect("run only as the child of a_killed_peer_process_flushes_outstanding_work");
    let me = Side::new(None);
    let listener = provider::device::Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    me.mr.region().write_at(0, &[7u8; 4096]).unwrap();
    // Tell the parent where to connect and which memory to read.
    let info = format!("{} {} {}", addr, me.mr.region().addr(0), me.mr.stag());
    std::fs::write(&port_file, info).unwrap();
    let req = listener.accept().unwrap();
    req.accept(&me.qp, &MpaParams::default()).unwrap();
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[test]
fn a_killed_peer_process_flushes_outstanding_work() {
    let dir = std::env::temp_dir().join(format!("stag-lifecycle-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let info_file = dir.join("peer");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_responder",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &info_file)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let info = loop {
        if let Ok(s) = std::fs::read_to_string(&info_file) {
            if s.split(' ').count() == 3 {
                break s;
            }
        }
        assert!(Instant::now() < deadline, "child never came up");
        std::thread::sleep(Duration::from_millis(10));
    };
    let parts: Vec<&str> = info.split(' ').collect();
    let (addr, base, stag): (std::net::SocketAddr, u64, u32) = (
        parts[0].parse().unwrap(),
        parts[1].parse().unwrap(),
        parts[2].parse().unwrap(),
    );
    let me = Side::new(None);
    me.qp.connect(addr, &MpaParams::default()).unwrap();
    let remote = provider::wr::Remote {
        addr: base,
        rkey: stag,
    };
    // One Read proves the peer serves; then kill it with work outstanding.
    me.post(0, SendOp::Read { remote }, vec![me.mr.sge(0, 64)]);
    assert_eq!(me.wait(1)[0].status, WcStatus::Success);
    assert_eq!(me.mr.region().to_vec(0, 64).unwrap(), vec![7u8; 64]);
    me.recv(100, 0, 64);
    child.kill().unwrap();
    child.wait().unwrap();
    for i in 1..=8 {
        me.post(
            i,
            SendOp::Read { remote },
            vec![me.mr.sge(64 * i as usize, 64)],
        );
    }
    let done = me.wait(9);
    let mut ids: Vec<u64> = done.iter().map(|w| w.wr_id).collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        [1, 2, 3, 4, 5, 6, 7, 8, 100],
        "each outstanding WR exactly once"
    );
    assert!(
        done.iter().all(|w| w.status == WcStatus::WrFlushErr),
        "{done:?}"
    );
    assert_eq!(me.qp.state(), QpState::Error);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_qp_moved_to_error_before_connecting_flushes_what_is_posted() {
    let me = Side::new(None);
    let sge = me.mr.sge(0, 8);
    me.qp
        .post_recv(provider::wr::RecvWr {
            wr_id: 1,
            sg_list: vec![sge],
        })
        .unwrap();
    me.qp.set_error();
    me.qp
        .post_recv(provider::wr::RecvWr {
            wr_id: 2,
            sg_list: vec![sge],
        })
        .unwrap();
    me.qp
        .post_send(SendWr {
            wr_id: 3,
            op: SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            sg_list: vec![sge],
            signaled: true,
            fence: false,
        })
        .unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while got.len() < 3 && Instant::now() < deadline {
        let mut wc = [provider::wr::WorkCompletion::BLANK; 4];
        let n = me.cq.poll(&mut wc);
        got.extend(wc[..n].iter().map(|c| (c.wr_id, c.status)));
    }
    assert_eq!(
        got,
        [
            (1, WcStatus::WrFlushErr),
            (2, WcStatus::WrFlushErr),
            (3, WcStatus::WrFlushErr)
        ]
    );
    // And no connection may start on it.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let peer = std::thread::spawn(move || drop(accept_mpa(&listener)));
    assert!(matches!(
        me.qp.connect(addr, &MpaParams::default()),
        Err(DeviceError::InvalidState)
    ));
    peer.join().unwrap();
}

/// A peer that completes the MPA exchange; its socket.
fn mpa_peer(me: &Side) -> std::net::TcpStream {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let peer = std::thread::spawn(move || accept_mpa(&listener));
    me.qp.connect(addr, &MpaParams::default()).unwrap();
    let sock = peer.join().unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    sock.set_write_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    sock
}

/// A QP moved to Error reads on, discarding what comes (siw: a QP in
/// Error places nothing, and its socket is still read): a peer that is
/// still sending meets our FIN once it is done, not a reset for data
/// sent to a socket shut for reading, and its close reaches the QP.
#[test]
fn a_qp_in_error_drains_and_discards_what_the_peer_still_sends() {
    let me = Side::new(None);
    let mut sock = mpa_peer(&me);
    me.qp.set_error();
    // More than the socket buffers hold: it all goes only if the QP
    // reads it.
    let chunk = vec![0u8; 1 << 16];
    for i in 0..128 {
        sock.write_all(&chunk)
            .unwrap_or_else(|e| panic!("write {i} after the QP's error: {e}"));
    }
    sock.shutdown(std::net::Shutdown::Write).unwrap();
    let mut b = [0u8; 64];
    assert_eq!(sock.read(&mut b).unwrap(), 0, "the QP's FIN, nothing else");
    me.wait_event(|e| *e == provider::qp::Event::Closed);
    assert_eq!(me.qp.state(), QpState::Error);
}

/// A QP moved to Error (what `rdma_disconnect` does) with octets still
/// queued for a peer that reads no more, and not destroyed: its stream is
/// reset once the peer has taken nothing for `LINGER_LIMIT` (1 s), as
/// siw's close timeout does, instead of being held until the QP is
/// destroyed. The peer, reading at last, finds the reset.
#[test]
fn a_qp_in_error_resets_a_stream_its_peer_no_longer_reads() {
    let me = Side::new(None);
    let mut sock = mpa_peer(&me);
    let n = QpCaps::default().max_send_wr.min(16) as u64;
    for i in 0..n {
        me.post(
            i,
            SendOp::Write {
                remote: provider::wr::Remote { addr: 0, rkey: 1 },
            },
            vec![me.mr.sge(0, 1 << 20)],
        );
    }
    me.qp.set_error();
    let done = me.wait(n as usize);
    assert!(done.iter().any(|w| w.status == WcStatus::WrFlushErr));
    // The QP lives on; its stream ends within a few seconds.
    me.wait_event(|e| *e == provider::qp::Event::Closed);
    let mut buf = vec![0u8; 1 << 16];
    let err = loop {
        match sock.read(&mut buf) {
            Ok(0) => panic!("a clean close: the stream was drained, not reset"),
            Ok(_) => {}
            Err(e) => break e,
        }
    };
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    drop(me);
}
