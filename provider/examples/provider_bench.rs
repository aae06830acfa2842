//! Side-by-side loopback benchmark: raw TCP floors against the userspace
//! iWARP provider, in one run.
//!
//! ```text
//! cargo run --release -p stag-provider --example provider_bench -- [--runs N] [--iters N] [--json]
//! ```
//!
//! Raw TCP: busy-poll ping-pong (nonblocking spin on `recv`), blocking
//! ping-pong, and a 1 MiB-write stream. Provider: 8 B RDMA Write latency
//! (ib_write_lat style: each side writes into the other's buffer and spins
//! on its own memory, driving the QP meanwhile), 8 B Send/Recv latency,
//! FetchAdd and Read round trips, and 1 MiB RDMA Write throughput with many
//! Writes in flight — in busy-poll mode (the application spins on
//! `qp.progress()` / `cq.poll`) and blocking mode (`cq.wait`; a one-sided
//! target's application sleeps and the device's engine answers).
//!
//! Every figure is measured `--runs` times (default 3); the table shows the
//! median over runs of each run's median / p99, and the median of the
//! per-run ratios to the matching raw TCP floor (same run, same noise).
//! One-way latencies are half the round trip, as perftest reports them.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use provider::cq::CompletionQueue;
use provider::device::{Device, Listener, MemoryRegion, QueuePair};
use provider::mem::Access;
use provider::qp::QpCaps;
use provider::region::Region;
use provider::setup::MpaParams;
use provider::wr::{RecvWr, SendOp, SendWr, Sge, WcStatus, WorkCompletion};

const MSG: usize = 8;
const BIG: usize = 1 << 20;
const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------- options

#[derive(Debug, Clone)]
struct Opts {
    runs: usize,
    iters: usize,
    /// Bytes per throughput trial.
    stream_bytes: usize,
    json: bool,
    crc: bool,
    only: Option<String>,
}

fn parse_opts() -> Opts {
    let mut o = Opts {
        runs: 3,
        iters: 20_000,
        stream_bytes: 1 << 30,
        json: false,
        crc: true,
        only: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> usize {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} needs a number"))
        };
        match a.as_str() {
            "--runs" => o.runs = num("--runs").max(1),
            "--iters" => o.iters = num("--iters").max(100),
            "--stream-mib" => o.stream_bytes = num("--stream-mib").max(16) << 20,
            "--json" => o.json = true,
            "--no-crc" => o.crc = false,
            "--only" => o.only = args.next(),
            "--help" | "-h" => {
                eprintln!(
                    "provider_bench [--runs N] [--iters N] [--stream-mib N] [--no-crc] \
                     [--only SUBSTR] [--json]"
                );
                std::process::exit(0);
            }
            other => panic!("unknown option {other}"),
        }
    }
    o
}

// ---------------------------------------------------------------- stats

/// One measurement of one run.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Latency: median ns; throughput: GB/s.
    median: f64,
    /// Latency: p99 ns; throughput: worst trial GB/s.
    p99: f64,
}

fn lat_sample(mut ns: Vec<f64>) -> Sample {
    ns.sort_by(f64::total_cmp);
    let at = |q: f64| ns[((ns.len() as f64 - 1.0) * q).round() as usize];
    Sample {
        median: at(0.5),
        p99: at(0.99),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

// ---------------------------------------------------------------- raw TCP

fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    a.set_nodelay(true).unwrap();
    b.set_nodelay(true).unwrap();
    (a, b)
}

fn read_exact_spin(s: &mut TcpStream, buf: &mut [u8]) {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => panic!("peer closed"),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => panic!("read: {e}"),
        }
    }
}

fn write_all_spin(s: &mut TcpStream, mut buf: &[u8]) {
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => panic!("write: {e}"),
        }
    }
}

/// Raw TCP 8 B ping-pong; returns one-way (RTT/2) ns per iteration.
fn tcp_pingpong(iters: usize, busy: bool) -> Vec<f64> {
    let (mut a, mut b) = tcp_pair();
    a.set_nonblocking(busy).unwrap();
    b.set_nonblocking(busy).unwrap();
    let warm = iters / 10;
    let server = std::thread::spawn(move || {
        let mut buf = [0u8; MSG];
        for _ in 0..warm + iters {
            if busy {
                read_exact_spin(&mut b, &mut buf);
                write_all_spin(&mut b, &buf);
            } else {
                b.read_exact(&mut buf).unwrap();
                b.write_all(&buf).unwrap();
            }
        }
    });
    let mut out = Vec::with_capacity(iters);
    let mut buf = [0u8; MSG];
    for i in 0..warm + iters {
        buf[..8].copy_from_slice(&(i as u64).to_le_bytes());
        let t = Instant::now();
        if busy {
            write_all_spin(&mut a, &buf);
            read_exact_spin(&mut a, &mut buf);
        } else {
            a.write_all(&buf).unwrap();
            a.read_exact(&mut buf).unwrap();
        }
        let dt = t.elapsed().as_nanos() as f64;
        if i >= warm {
            out.push(dt / 2.0);
        }
    }
    server.join().unwrap();
    out
}

/// Raw TCP stream of 1 MiB writes; GB/s per trial.
fn tcp_stream(total: usize, trials: usize) -> Vec<f64> {
    let (mut a, mut b) = tcp_pair();
    let server = std::thread::spawn(move || {
        let mut buf = vec![0u8; BIG];
        let mut left = total * trials + BIG;
        while left > 0 {
            let n = b.read(&mut buf[..left.min(BIG)]).unwrap();
            assert!(n > 0);
            left -= n;
        }
        b.write_all(&[1]).unwrap();
    });
    let buf = vec![0x5au8; BIG];
    // Warm-up MiB.
    a.write_all(&buf).unwrap();
    let mut out = Vec::new();
    for _ in 0..trials {
        let t = Instant::now();
        for _ in 0..total / BIG {
            a.write_all(&buf).unwrap();
        }
        // The last bytes may still sit in socket buffers; at ≥ 1 GiB per
        // trial that error is a fraction of a percent.
        out.push(total as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    let mut ack = [0u8; 1];
    a.read_exact(&mut ack).unwrap();
    server.join().unwrap();
    out
}

// ---------------------------------------------------------------- provider

const ALL: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);

/// One endpoint; each has its own device (and so its own engine thread),
/// as two hosts would.
struct Side {
    _dev: Device,
    cq: Arc<CompletionQueue>,
    qp: QueuePair,
    mr: MemoryRegion,
}

impl Side {
    fn new(mr_len: usize) -> Side {
        let dev = Device::open("bench").unwrap();
        let pd = dev.alloc_pd();
        let cq = CompletionQueue::new(8192).unwrap();
        let qp = pd.create_qp(QpCaps::default(), &cq, &cq, None);
        let region = Region::anonymous(mr_len).unwrap();
        let iova = region.addr(0);
        let mr = pd.register(region, iova, ALL).unwrap();
        Side {
            _dev: dev,
            cq,
            qp,
            mr,
        }
    }

    fn post(&self, wr_id: u64, op: SendOp, sg_list: Vec<Sge>, signaled: bool) {
        self.qp
            .post_send(SendWr {
                wr_id,
                op,
                sg_list,
                signaled,
                fence: false,
            })
            .unwrap();
    }

    fn recv(&self, wr_id: u64) {
        self.qp
            .post_recv(RecvWr {
                wr_id,
                sg_list: vec![self.mr.sge(4096, MSG as u32)],
            })
            .unwrap();
    }

    /// Spin on `cq.poll` until one completion arrives.
    fn poll_one(&self, buf: &mut [WorkCompletion; 1]) -> WorkCompletion {
        let deadline = Instant::now() + WAIT;
        let mut spins = 0u32;
        loop {
            if self.cq.poll(buf) == 1 {
                check(&buf[0]);
                return buf[0];
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) {
                assert!(Instant::now() < deadline, "completion did not arrive");
            }
        }
    }

    /// Block in `cq.wait` until one completion arrives.
    fn wait_one(&self, buf: &mut [WorkCompletion; 1]) -> WorkCompletion {
        let deadline = Instant::now() + WAIT;
        loop {
            if self.cq.wait(buf, Duration::from_secs(1)) == 1 {
                check(&buf[0]);
                return buf[0];
            }
            assert!(Instant::now() < deadline, "completion did not arrive");
        }
    }

    fn get(&self, buf: &mut [WorkCompletion; 1], busy: bool) -> WorkCompletion {
        if busy {
            self.poll_one(buf)
        } else {
            self.wait_one(buf)
        }
    }

    /// Spin until the u64 at `offset` reads `want`, driving the QP.
    fn spin_mem(&self, offset: usize, want: u64) {
        let mut spins = 0u32;
        let deadline = Instant::now() + WAIT;
        while self.mr.region().load_u64(offset).unwrap() != want {
            self.qp.progress();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) {
                assert!(Instant::now() < deadline, "write did not land");
            }
        }
    }
}

fn check(wc: &WorkCompletion) {
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
}

fn provider_pair(mr_len: usize, crc: bool) -> (Side, Side) {
    let a = Side::new(mr_len);
    let b = Side::new(mr_len);
    let params = MpaParams {
        crc,
        ..MpaParams::default()
    };
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            let req = listener.accept().unwrap();
            req.accept(&b.qp, &params).unwrap();
        });
        a.qp.connect(addr, &params).unwrap();
        h.join().unwrap();
    });
    (a, b)
}

/// Runs `client` on this thread and `server` on another, both started
/// together; returns the client's result.
fn two_sides<R: Send>(
    a: &Side,
    b: &Side,
    client: impl FnOnce(&Side) -> R + Send,
    server: impl FnOnce(&Side) + Send,
) -> R {
    let go = Barrier::new(2);
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            go.wait();
            server(b);
        });
        go.wait();
        let r = client(a);
        h.join().unwrap();
        r
    })
}

/// 8 B RDMA Write ping-pong, ib_write_lat style: one-way ns.
fn write_lat(iters: usize, crc: bool) -> Vec<f64> {
    let (a, b) = provider_pair(1 << 16, crc);
    let warm = iters / 10;
    let n = (warm + iters) as u64;
    // Offset 0: what this side sends; offset 64: where the peer writes.
    let ping = |s: &Side, peer: &Side, i: u64| {
        s.mr.region().store_u64(0, i).unwrap();
        s.post(
            i,
            SendOp::Write {
                remote: peer.mr.remote(64),
            },
            vec![s.mr.sge(0, MSG as u32)],
            false,
        );
    };
    two_sides(
        &a,
        &b,
        |a| {
            let mut out = Vec::with_capacity(iters);
            for i in 1..=n {
                let t = Instant::now();
                ping(a, &b, i);
                a.spin_mem(64, i);
                let dt = t.elapsed().as_nanos() as f64;
                if i > warm as u64 {
                    out.push(dt / 2.0);
                }
            }
            out
        },
        |b| {
            for i in 1..=n {
                b.spin_mem(64, i);
                ping(b, &a, i);
            }
        },
    )
}

/// 8 B Send/Recv ping-pong (`busy`: spin on `cq.poll`; else `cq.wait`):
/// one-way ns.
fn send_lat(iters: usize, busy: bool, crc: bool) -> Vec<f64> {
    let (a, b) = provider_pair(1 << 16, crc);
    let warm = iters / 10;
    let n = (warm + iters) as u64;
    for s in [&a, &b] {
        for i in 0..64 {
            s.recv(i);
        }
    }
    let send = |s: &Side, i: u64| {
        s.post(
            i,
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
            vec![s.mr.sge(0, MSG as u32)],
            false,
        );
    };
    two_sides(
        &a,
        &b,
        |a| {
            let mut wc = [WorkCompletion::BLANK];
            let mut out = Vec::with_capacity(iters);
            for i in 1..=n {
                let t = Instant::now();
                send(a, i);
                let got = a.get(&mut wc, busy);
                let dt = t.elapsed().as_nanos() as f64;
                a.recv(got.wr_id);
                if i > warm as u64 {
                    out.push(dt / 2.0);
                }
            }
            out
        },
        |b| {
            let mut wc = [WorkCompletion::BLANK];
            for i in 1..=n {
                let got = b.get(&mut wc, busy);
                b.recv(got.wr_id);
                send(b, i);
            }
        },
    )
}

#[derive(Debug, Clone, Copy)]
enum RttOp {
    FetchAdd,
    Read,
}

/// FetchAdd or 8 B Read round trips. `busy`: the client spins on
/// `cq.poll` and the target's application spins on `qp.progress()`;
/// else the client blocks in `cq.wait` and the target's application
/// sleeps (its engine answers). RTT ns.
fn rtt(iters: usize, op: RttOp, busy: bool, crc: bool) -> Vec<f64> {
    let (a, b) = provider_pair(1 << 16, crc);
    let warm = iters / 10;
    let n = warm + iters;
    let stop = AtomicBool::new(false);
    two_sides(
        &a,
        &b,
        |a| {
            let mut wc = [WorkCompletion::BLANK];
            let mut out = Vec::with_capacity(iters);
            for i in 0..n {
                let op = match op {
                    RttOp::FetchAdd => SendOp::FetchAdd {
                        remote: b.mr.remote(128),
                        add: 1,
                        mask: 0,
                    },
                    RttOp::Read => SendOp::Read {
                        remote: b.mr.remote(128),
                    },
                };
                let t = Instant::now();
                a.post(i as u64, op, vec![a.mr.sge(256, MSG as u32)], true);
                a.get(&mut wc, busy);
                let dt = t.elapsed().as_nanos() as f64;
                if i >= warm {
                    out.push(dt);
                }
            }
            stop.store(true, Ordering::Release);
            out
        },
        |b| {
            while !stop.load(Ordering::Acquire) {
                if busy {
                    b.qp.progress();
                } else {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        },
    )
}

/// 1 MiB RDMA Writes, `depth` in flight; GB/s per trial. The target's
/// application spins on `qp.progress()` (`busy`) or sleeps (its engine
/// places); the initiator spins on `cq.poll` or blocks in `cq.wait`.
fn write_bw(total: usize, trials: usize, busy: bool, crc: bool) -> Vec<f64> {
    let depth = 16usize;
    let (a, b) = provider_pair(BIG, crc);
    let stop = AtomicBool::new(false);
    let write = |a: &Side, id: u64| {
        a.post(
            id,
            SendOp::Write {
                remote: b.mr.remote(0),
            },
            vec![a.mr.sge(0, BIG as u32)],
            true,
        );
    };
    // A Read after the Writes completes once they are all placed.
    let fence = |a: &Side, wc: &mut [WorkCompletion; 1]| {
        a.post(
            u64::MAX,
            SendOp::Read {
                remote: b.mr.remote(0),
            },
            vec![a.mr.sge(0, MSG as u32)],
            true,
        );
        while a.get(wc, busy).wr_id != u64::MAX {}
    };
    two_sides(
        &a,
        &b,
        |a| {
            let mut wc = [WorkCompletion::BLANK];
            // Warm-up.
            for i in 0..depth as u64 {
                write(a, i);
            }
            fence(a, &mut wc);
            let mut out = Vec::new();
            for _ in 0..trials {
                let count = (total / BIG) as u64;
                let t = Instant::now();
                let mut posted = 0u64;
                let mut done = 0u64;
                while done < count {
                    while posted < count && posted - done < depth as u64 {
                        write(a, posted);
                        posted += 1;
                    }
                    a.get(&mut wc, busy);
                    done += 1;
                }
                fence(a, &mut wc);
                out.push(total as f64 / t.elapsed().as_secs_f64() / 1e9);
            }
            stop.store(true, Ordering::Release);
            out
        },
        |b| {
            while !stop.load(Ordering::Acquire) {
                if busy {
                    b.qp.progress();
                } else {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        },
    )
}

// ---------------------------------------------------------------- table

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// Nanoseconds, lower is better.
    Latency,
    /// GB/s, higher is better.
    Throughput,
}

struct Row {
    name: &'static str,
    kind: Kind,
    /// The raw TCP row it is compared with (None for the floors).
    floor: Option<&'static str>,
    /// Target ratio (≤ for latency, ≥ for throughput).
    target: Option<f64>,
    runs: Vec<Sample>,
}

type Bench = Box<dyn Fn(&Opts) -> Sample>;

/// Name, kind, the raw TCP row it is compared with, target ratio, runner.
type BenchDef = (&'static str, Kind, Option<&'static str>, Option<f64>, Bench);

fn benches() -> Vec<BenchDef> {
    let trials = 3;
    vec![
        (
            "tcp_busy_8B_oneway",
            Kind::Latency,
            None,
            None,
            Box::new(|o: &Opts| lat_sample(tcp_pingpong(o.iters, true))),
        ),
        (
            "tcp_block_8B_oneway",
            Kind::Latency,
            None,
            None,
            Box::new(|o: &Opts| lat_sample(tcp_pingpong(o.iters / 2, false))),
        ),
        (
            "tcp_busy_8B_rtt",
            Kind::Latency,
            None,
            None,
            // Derived in `main` from the one-way run of the same round.
            Box::new(|_: &Opts| unreachable!()),
        ),
        (
            "tcp_block_8B_rtt",
            Kind::Latency,
            None,
            None,
            Box::new(|_: &Opts| unreachable!()),
        ),
        (
            "tcp_stream_1MiB_GBps",
            Kind::Throughput,
            None,
            None,
            Box::new(move |o: &Opts| tput_sample(tcp_stream(o.stream_bytes, trials))),
        ),
        (
            "write_8B_busy_oneway",
            Kind::Latency,
            Some("tcp_busy_8B_oneway"),
            Some(1.1),
            Box::new(|o: &Opts| lat_sample(write_lat(o.iters, o.crc))),
        ),
        (
            "send_8B_busy_oneway",
            Kind::Latency,
            Some("tcp_busy_8B_oneway"),
            Some(1.1),
            Box::new(|o: &Opts| lat_sample(send_lat(o.iters, true, o.crc))),
        ),
        (
            "fetchadd_busy_rtt",
            Kind::Latency,
            Some("tcp_busy_8B_rtt"),
            Some(1.1),
            Box::new(|o: &Opts| lat_sample(rtt(o.iters, RttOp::FetchAdd, true, o.crc))),
        ),
        (
            "read_8B_busy_rtt",
            Kind::Latency,
            Some("tcp_busy_8B_rtt"),
            Some(1.1),
            Box::new(|o: &Opts| lat_sample(rtt(o.iters, RttOp::Read, true, o.crc))),
        ),
        (
            "write_1MiB_busy_GBps",
            Kind::Throughput,
            Some("tcp_stream_1MiB_GBps"),
            Some(0.9),
            Box::new(move |o: &Opts| tput_sample(write_bw(o.stream_bytes, trials, true, o.crc))),
        ),
        (
            "send_8B_block_oneway",
            Kind::Latency,
            Some("tcp_block_8B_oneway"),
            Some(1.1),
            Box::new(|o: &Opts| lat_sample(send_lat(o.iters / 2, false, o.crc))),
        ),
        (
            "fetchadd_block_rtt",
            Kind::Latency,
            Some("tcp_block_8B_rtt"),
            Some(1.1),
            Box::new(|o: &Opts| lat_sample(rtt(o.iters / 2, RttOp::FetchAdd, false, o.crc))),
        ),
        (
            "read_8B_block_rtt",
            Kind::Latency,
            Some("tcp_block_8B_rtt"),
            Some(1.1),
            Box::new(|o: &Opts| lat_sample(rtt(o.iters / 2, RttOp::Read, false, o.crc))),
        ),
        (
            "write_1MiB_block_GBps",
            Kind::Throughput,
            Some("tcp_stream_1MiB_GBps"),
            Some(0.9),
            Box::new(move |o: &Opts| tput_sample(write_bw(o.stream_bytes, trials, false, o.crc))),
        ),
    ]
}

fn tput_sample(gbps: Vec<f64>) -> Sample {
    let worst = gbps.iter().copied().fold(f64::INFINITY, f64::min);
    Sample {
        median: median(gbps),
        p99: worst,
    }
}

fn ratio(row: &Row, floor: &Row, run: usize) -> f64 {
    let (p, f) = (row.runs[run].median, floor.runs[run].median);
    p / f
}

fn main() {
    let opts = parse_opts();
    let list = benches();
    let mut rows: Vec<Row> = list
        .iter()
        .map(|(name, kind, floor, target, _)| Row {
            name,
            kind: *kind,
            floor: *floor,
            target: *target,
            runs: Vec::new(),
        })
        .collect();
    let find = |n: &str, rows: &[Row]| rows.iter().position(|r| r.name == n);
    for run in 0..opts.runs {
        for (i, (name, _, _, _, f)) in list.iter().enumerate() {
            // Floors always run, so every ratio has its same-run partner.
            let needed = rows[i].floor.is_none()
                || opts.only.as_ref().is_none_or(|o| name.contains(o.as_str()));
            if !needed {
                continue;
            }
            let s = if let Some(base) = name
                .strip_suffix("_rtt")
                .filter(|_| name.starts_with("tcp_"))
            {
                // A round trip is twice the one-way figure of the same run.
                let one = &rows[find(&format!("{base}_oneway"), &rows).expect("listed")];
                let s = one.runs[run];
                Sample {
                    median: s.median * 2.0,
                    p99: s.p99 * 2.0,
                }
            } else {
                f(&opts)
            };
            if !opts.json {
                eprintln!(
                    "run {} {name:<24} {:>10.1} {:>10.1}",
                    run + 1,
                    s.median,
                    s.p99
                );
            }
            rows[i].runs.push(s);
        }
    }
    let mut table = Vec::new();
    for r in &rows {
        if r.runs.is_empty() {
            continue;
        }
        let med = median(r.runs.iter().map(|s| s.median).collect());
        let p99 = median(r.runs.iter().map(|s| s.p99).collect());
        let (ratio_med, floor_med) = match r.floor.and_then(|f| find(f, &rows)) {
            Some(fi) => {
                let f = &rows[fi];
                let n = r.runs.len().min(f.runs.len());
                let ratios: Vec<f64> = (0..n).map(|k| ratio(r, f, k)).collect();
                (
                    Some(median(ratios)),
                    Some(median(f.runs.iter().map(|s| s.median).collect())),
                )
            }
            None => (None, None),
        };
        let ok = match (ratio_med, r.target) {
            (Some(x), Some(t)) => Some(match r.kind {
                Kind::Latency => x <= t,
                Kind::Throughput => x >= t,
            }),
            _ => None,
        };
        table.push((r, med, p99, floor_med, ratio_med, ok));
    }
    if opts.json {
        let mut s = String::from("{\n  \"runs\": ");
        s += &format!(
            "{},\n  \"iters\": {},\n  \"crc\": {},\n  \"results\": [\n",
            opts.runs, opts.iters, opts.crc
        );
        for (k, (r, med, p99, floor, ratio, ok)) in table.iter().enumerate() {
            let unit = match r.kind {
                Kind::Latency => "ns",
                Kind::Throughput => "GB/s",
            };
            let opt = |v: Option<f64>| v.map_or("null".to_string(), |x| format!("{x:.4}"));
            s += &format!(
                "    {{\"name\": \"{}\", \"unit\": \"{unit}\", \"median\": {med:.3}, \"{}\": {p99:.3}, \
                 \"floor\": {}, \"floor_median\": {}, \"ratio\": {}, \"target\": {}, \"ok\": {}, \
                 \"per_run_median\": [{}]}}{}\n",
                r.name,
                if r.kind == Kind::Latency { "p99" } else { "worst" },
                r.floor.map_or("null".to_string(), |f| format!("\"{f}\"")),
                opt(*floor),
                opt(*ratio),
                opt(r.target),
                ok.map_or("null".to_string(), |b| b.to_string()),
                r.runs
                    .iter()
                    .map(|s| format!("{:.3}", s.median))
                    .collect::<Vec<_>>()
                    .join(", "),
                if k + 1 == table.len() { "" } else { "," }
            );
        }
        s += "  ]\n}";
        println!("{s}");
    } else {
        println!(
            "{:<24} {:>11} {:>11} {:>11} {:>7} {:>7}",
            "bench", "median", "p99/worst", "tcp floor", "ratio", "target"
        );
        for (r, med, p99, floor, ratio, ok) in &table {
            let (m, p, f) = match r.kind {
                Kind::Latency => (
                    format!("{:.2}us", med / 1e3),
                    format!("{:.2}us", p99 / 1e3),
                    floor.map_or(String::new(), |f| format!("{:.2}us", f / 1e3)),
                ),
                Kind::Throughput => (
                    format!("{med:.2}GB/s"),
                    format!("{p99:.2}GB/s"),
                    floor.map_or(String::new(), |f| format!("{f:.2}GB/s")),
                ),
            };
            let target = match (r.target, ok) {
                (Some(t), Some(true)) => format!(
                    "{}{t} ok",
                    if r.kind == Kind::Latency {
                        "≤"
                    } else {
                        "≥"
                    }
                ),
                (Some(t), _) => format!(
                    "{}{t} MISS",
                    if r.kind == Kind::Latency {
                        "≤"
                    } else {
                        "≥"
                    }
                ),
                _ => String::new(),
            };
            println!(
                "{:<24} {m:>11} {p:>11} {f:>11} {:>7} {target:>7}",
                r.name,
                ratio.map_or(String::new(), |x| format!("{x:.2}x")),
            );
        }
    }
}
