//! The listener never waits on one peer: silent clients, garbage and half
//! handshakes, many at once, cost nobody else anything, and a good client
//! behind them is handed to `accept` at once.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use provider::device::{DeviceError, Listener};
use provider::setup::{Initiator, MpaParams};

/// A valid MPA Request with `private_data`.
fn request(private_data: &[u8]) -> Vec<u8> {
    let params = MpaParams {
        private_data: private_data.to_vec(),
        ..MpaParams::default()
    };
    Initiator::new(params).unwrap().1
}

#[test]
fn bad_clients_do_not_hold_up_a_good_one() {
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let valid = request(b"good");
    let mut bad = Vec::new();
    for i in 0..20 {
        // Silent: connects and says nothing.
        bad.push(TcpStream::connect(addr).unwrap());
        // Garbage: not an MPA key.
        let mut g = TcpStream::connect(addr).unwrap();
        g.write_all(&[0x5a ^ i as u8; 40]).unwrap();
        bad.push(g);
        // Half a handshake: the first bytes of a valid Request, then
        // nothing.
        let mut h = TcpStream::connect(addr).unwrap();
        h.write_all(&valid[..10 + i % 8]).unwrap();
        bad.push(h);
    }
    // A client that connects and leaves at once.
    drop(TcpStream::connect(addr).unwrap());

    let start = Instant::now();
    let mut good = TcpStream::connect(addr).unwrap();
    good.write_all(&valid).unwrap();
    let req = listener.accept().unwrap();
    let took = start.elapsed();
    assert_eq!(req.request().private_data, b"good");
    assert_eq!(req.peer_addr(), good.local_addr().unwrap());
    // Far below the 10 s a silent client may take: the old listener read
    // each Request in turn and would wait out every silent one first.
    assert!(took < Duration::from_secs(1), "{took:?}");

    // The garbage clients were closed by the listener (their read ends),
    // while the silent ones still wait for their deadline.
    for (i, s) in bad.iter_mut().enumerate().filter(|(i, _)| i % 3 == 1) {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = [0u8; 16];
        let n = s.read(&mut b).unwrap_or(0);
        assert_eq!(n, 0, "garbage client {i} got {n} bytes instead of a close");
    }
    // Nothing else was handed over.
    assert!(listener
        .accept_timeout(Duration::from_millis(100))
        .unwrap()
        .is_none());
}

/// A handshake that misses its deadline is dropped (its socket closed);
/// one that arrives in pieces is put together.
#[test]
fn handshakes_have_deadlines_and_may_arrive_in_pieces() {
    let listener = Listener::bind_with("127.0.0.1:0", Duration::from_millis(300)).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut silent = TcpStream::connect(addr).unwrap();
    let valid = request(&[7u8; 300]);
    let mut slow = TcpStream::connect(addr).unwrap();
    for piece in valid.chunks(7) {
        slow.write_all(piece).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    let req = listener.accept().unwrap();
    assert_eq!(req.request().private_data, vec![7u8; 300]);
    silent
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut b = [0u8; 1];
    assert_eq!(
        silent.read(&mut b).unwrap_or(0),
        0,
        "closed at its deadline"
    );
}

/// Requests accepted through the listener run as connections: a full
/// setup with the new listener, then Sends both ways.
#[test]
fn accepted_requests_become_connections() {
    let (a, b) = pair();
    b.recv(1, 0, 64);
    a.mr.region().write_at(0, b"through the listener").unwrap();
    a.post(
        2,
        provider::wr::SendOp::Send {
            solicited: false,
            invalidate: None,
        },
        vec![a.mr.sge(0, 20)],
    );
    assert_eq!(a.wait(1)[0].wr_id, 2);
    assert_eq!(b.wait(1)[0].byte_len, 20);
    assert_eq!(
        b.mr.region().to_vec(0, 20).unwrap(),
        b"through the listener"
    );
}

/// Shutting the listener down ends a blocked accept with an error and
/// closes the port.
#[test]
fn shutdown_ends_accept_and_closes_the_port() {
    let listener = std::sync::Arc::new(Listener::bind("127.0.0.1:0").unwrap());
    let addr = listener.local_addr().unwrap();
    let waiter = {
        let l = listener.clone();
        std::thread::spawn(move || l.accept())
    };
    std::thread::sleep(Duration::from_millis(50));
    listener.shutdown();
    let r = waiter.join().unwrap();
    assert!(matches!(r, Err(DeviceError::ListenerClosed)), "{r:?}");
    assert!(TcpStream::connect(addr).is_err(), "port still open");
}
