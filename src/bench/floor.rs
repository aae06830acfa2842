//! `stag floor`: what plain TCP (and msync) achieve on this machine, the
//! floor `stag lat`/`stag bw` on the userspace provider are held against.
//!
//! `stag floor lat [HOST]` is a SIZE-byte ping-pong on one TCP connection
//! (one-way = round trip / 2, like `stag lat write|send`, plus the full
//! round trip Reads and atomics compare with); `stag floor bw [HOST]` a
//! one-way stream of SIZE-byte `send`s on `--streams` connections (one
//! thread each, up to the cores there are; see [`StreamSet`]), closed by a 1-byte ack so the last byte has arrived when
//! the clock stops; `stag floor msync` times one msync of a SIZE-byte
//! dirty range of a file-backed mapping (a Commit's responder-side cost).
//!
//! Server without HOST, client with it, as `stag lat|bw`: the client
//! chooses size, iterations and streams and sends them in a [`Header`] on
//! every connection; each side uses its own `--mode`. `--mode busy` spins
//! on a non-blocking socket (as a busy-polling RDMA application spins on
//! its CQ), `--mode blocking` sleeps in read/write. The JSON has the keys
//! of `stag lat|bw --json` so scripts read both alike.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::{debug, info};

use super::stats::{to_usec, BwStats, LatStats};
use super::{BenchError, Result, DEFAULT_PORT, STALL};

/// `stag floor`.
#[derive(Debug, Clone, clap::Args)]
pub struct FloorArgs {
    #[command(subcommand)]
    pub test: FloorTest,
}

/// The floor measurements.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum FloorTest {
    /// TCP ping-pong latency (one-way and round trip).
    Lat(NetArgs),
    /// TCP stream bandwidth and message rate over one or more connections.
    Bw(BwFloorArgs),
    /// One msync of a SIZE-byte dirty range of a file-backed mapping.
    Msync(MsyncArgs),
}

/// How a side waits for its socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Non-blocking socket, recv/send retried in a spin loop.
    Busy,
    /// Blocking read/write.
    Blocking,
}

/// Flags of `stag floor lat` (and, flattened, `stag floor bw`).
#[derive(Debug, Clone, clap::Args)]
pub struct NetArgs {
    /// Server to connect to (client mode). Without it, wait for a client.
    pub host: Option<String>,
    /// TCP port to listen on or connect to.
    #[arg(short = 'p', long, default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// Message size in bytes (lat: 8, bw: 1 MiB).
    #[arg(short = 's', long)]
    pub size: Option<u32>,
    /// Iterations (lat: 10000; bw: messages per stream, enough for about
    /// 4 GiB per stream, at most 1000000).
    #[arg(short = 'n', long)]
    pub iters: Option<u32>,
    /// Spin on a non-blocking socket or block in read/write.
    #[arg(long, value_enum, default_value_t = Mode::Busy)]
    pub mode: Mode,
    /// Print results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Address the server listens on (default 0.0.0.0).
    #[arg(long)]
    pub bind: Option<IpAddr>,
}

/// Flags of `stag floor bw`.
#[derive(Debug, Clone, clap::Args)]
pub struct BwFloorArgs {
    #[command(flatten)]
    pub net: NetArgs,
    /// Parallel TCP connections (client's choice).
    #[arg(long, default_value_t = 1)]
    pub streams: u16,
    /// Threads that drive them, on each side (each side's own choice):
    /// default one per stream up to 64 streams, beyond that one per core
    /// (a thread per stream then spins or wakes against all the others).
    #[arg(long)]
    pub threads: Option<u16>,
}

/// Flags of `stag floor msync`.
#[derive(Debug, Clone, clap::Args)]
pub struct MsyncArgs {
    /// Bytes dirtied (and synced) per iteration.
    #[arg(short = 's', long, default_value_t = 8)]
    pub size: u32,
    /// Iterations.
    #[arg(short = 'n', long, default_value_t = 1000)]
    pub iters: u32,
    /// Directory of the mapped file (default: the temporary directory,
    /// where `stag lat commit`'s server puts its target).
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
    /// Print results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Default ping-pong message size.
pub const LAT_SIZE: u32 = 8;
/// Default stream message size.
pub const BW_SIZE: u32 = 1 << 20;
/// Default ping-pong iterations.
pub const LAT_ITERS: u32 = 10_000;
/// Bytes a bandwidth stream moves by default (iterations follow from it).
const BW_BYTES: u64 = 4 << 30;
/// Largest receive per read: a receiver draining in large reads is what
/// makes a stream of small sends as fast as the sender can go.
const RX_CHUNK: usize = 1 << 20;

/// The client's parameters, on every connection (`STGF`,
/// [`stag::bench_wire::floor`]).
type Header = stag::bench_wire::floor::Repr;
use stag::bench_wire::floor::{Kind, LEN as HEADER_LEN};

/// Ping-pong warm-up (as `stag lat`).
fn warmup(iters: u32) -> u32 {
    iters.min(100)
}

/// Run `stag floor …`.
pub fn run_floor(args: FloorArgs) -> Result<()> {
    match args.test {
        FloorTest::Lat(a) => run_lat(&a),
        FloorTest::Bw(a) => run_bw(&a),
        FloorTest::Msync(a) => run_msync(&a),
    }
}

/// A connected socket that sends and receives whole buffers in `mode`.
struct Conn {
    s: TcpStream,
}

impl Conn {
    fn new(s: TcpStream, mode: Mode) -> Result<Conn> {
        s.set_nodelay(true)?;
        s.set_nonblocking(mode == Mode::Busy)?;
        Ok(Conn { s })
    }

    /// One read: Ok(0) when nothing is there yet (busy mode); EOF is an
    /// error.
    fn read_some(&mut self, buf: &mut [u8]) -> Result<usize> {
        match self.s.read(buf) {
            Ok(0) => Err(BenchError::Protocol(
                "the peer closed the connection".into(),
            )),
            Ok(n) => Ok(n),
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                Ok(0)
            }
            Err(e) => Err(e.into()),
        }
    }

    fn recv_exact(&mut self, buf: &mut [u8]) -> Result<()> {
        let mut got = 0;
        let mut idle = Idle::new();
        while got < buf.len() {
            let n = self.read_some(&mut buf[got..])?;
            got += n;
            idle.tick(n, "waiting for the peer's bytes")?;
        }
        Ok(())
    }

    fn send_all(&mut self, buf: &[u8]) -> Result<()> {
        let mut sent = 0;
        let mut idle = Idle::new();
        while sent < buf.len() {
            let n = match self.s.write(&buf[sent..]) {
                Ok(n) => n,
                Err(e)
                    if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted =>
                {
                    0
                }
                Err(e) => return Err(e.into()),
            };
            sent += n;
            idle.tick(n, "waiting for room in the socket")?;
        }
        Ok(())
    }

    /// Receive `total` bytes in chunks of up to [`RX_CHUNK`].
    fn drain(&mut self, total: u64) -> Result<()> {
        let mut buf = vec![0u8; RX_CHUNK.min(total as usize).max(1)];
        let mut left = total;
        let mut idle = Idle::new();
        while left > 0 {
            let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            let n = self.read_some(&mut buf[..want])?;
            left -= n as u64;
            idle.tick(n, "waiting for the stream")?;
        }
        Ok(())
    }
}

/// The streams one thread drives. By default a thread has one stream up
/// to 64 streams (the floor `stag bw --qps` has always been held to), and
/// beyond that there is one thread per core: a thousand threads would
/// spin (or wake) against each other on two cores, a floor no RDMA program
/// is held to (stag drives all its QPs from one thread). A thread with one
/// stream is the plain single-connection loop; with several, it goes round them,
/// one `send` of one message (or one `recv`) per stream per turn, on
/// non-blocking sockets: `--mode busy` spins, `--mode blocking` sleeps in
/// poll(2) when a turn moved nothing.
struct StreamSet {
    conns: Vec<Conn>,
    mode: Mode,
}

impl StreamSet {
    /// Deal `socks` out to `threads` sets (round robin).
    fn split(socks: Vec<TcpStream>, mode: Mode, threads: Option<u16>) -> Result<Vec<StreamSet>> {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let threads = threads.map_or(
            if socks.len() <= 64 {
                socks.len()
            } else {
                cores
            },
            usize::from,
        );
        let n = socks.len().min(threads).max(1);
        let many = socks.len() > n;
        let mut sets: Vec<StreamSet> = (0..n)
            .map(|_| StreamSet {
                conns: Vec::new(),
                mode,
            })
            .collect();
        for (i, s) in socks.into_iter().enumerate() {
            // A shared thread must never block on one of its streams.
            let c = Conn::new(s, if many { Mode::Busy } else { mode })?;
            sets[i % n].conns.push(c);
        }
        Ok(sets)
    }

    fn single(&mut self) -> Option<&mut Conn> {
        match self.conns.as_mut_slice() {
            [one] => Some(one),
            _ => None,
        }
    }

    /// After a turn that moved nothing: spin on, or sleep until a socket
    /// is ready for `events`.
    fn idle_turn(&self, waiting: impl Iterator<Item = bool>, events: libc::c_short) -> Result<()> {
        if self.mode == Mode::Busy {
            std::hint::spin_loop();
            return Ok(());
        }
        let mut fds: Vec<libc::pollfd> = self
            .conns
            .iter()
            .zip(waiting)
            .filter(|&(_, w)| w)
            .map(|(c, _)| libc::pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(&c.s),
                events,
                revents: 0,
            })
            .collect();
        // SAFETY: `fds` is a live array of fds.len() pollfds we own, and
        // every fd in it belongs to a socket of this set.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != ErrorKind::Interrupted {
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// `iters` copies of `msg` on every stream.
    fn send(&mut self, msg: &[u8], iters: u32) -> Result<()> {
        if let Some(c) = self.single() {
            for _ in 0..iters {
                c.send_all(msg)?;
            }
            return Ok(());
        }
        let mut left = vec![iters; self.conns.len()];
        let mut off = vec![0usize; self.conns.len()];
        let mut idle = Idle::new();
        loop {
            let mut moved = 0;
            for (i, c) in self.conns.iter_mut().enumerate() {
                if left[i] == 0 {
                    continue;
                }
                match c.s.write(&msg[off[i]..]) {
                    Ok(n) => {
                        moved += n;
                        off[i] += n;
                        if off[i] == msg.len() {
                            off[i] = 0;
                            left[i] -= 1;
                        }
                    }
                    Err(e)
                        if e.kind() == ErrorKind::WouldBlock
                            || e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                }
            }
            if left.iter().all(|&l| l == 0) {
                return Ok(());
            }
            if moved == 0 {
                self.idle_turn(left.iter().map(|&l| l > 0), libc::POLLOUT)?;
            }
            idle.tick(moved, "waiting for room in the sockets")?;
        }
    }

    /// `total` bytes from every stream.
    fn drain(&mut self, total: u64) -> Result<()> {
        if let Some(c) = self.single() {
            return c.drain(total);
        }
        let mut buf = vec![0u8; RX_CHUNK.min(total as usize).max(1)];
        let mut left = vec![total; self.conns.len()];
        let mut idle = Idle::new();
        loop {
            let mut moved = 0;
            for (i, c) in self.conns.iter_mut().enumerate() {
                if left[i] == 0 {
                    continue;
                }
                let want = buf
                    .len()
                    .min(usize::try_from(left[i]).unwrap_or(usize::MAX));
                let n = c.read_some(&mut buf[..want])?;
                moved += n;
                left[i] -= n as u64;
            }
            if left.iter().all(|&l| l == 0) {
                return Ok(());
            }
            if moved == 0 {
                self.idle_turn(left.iter().map(|&l| l > 0), libc::POLLIN)?;
            }
            idle.tick(moved, "waiting for the streams")?;
        }
    }

    /// The server's 1-byte ack on every stream.
    fn send_acks(&mut self) -> Result<()> {
        for c in &mut self.conns {
            c.send_all(&[1])?;
        }
        Ok(())
    }

    /// Every stream's ack.
    fn recv_acks(&mut self) -> Result<()> {
        for c in &mut self.conns {
            c.recv_exact(&mut [0u8; 1])?;
        }
        Ok(())
    }
}

/// Fails a spin or wait loop that makes no progress for [`STALL`] (the
/// clock is read once every 64 Ki idle turns, not on every one).
struct Idle {
    since: Option<Instant>,
    turns: u32,
}

impl Idle {
    fn new() -> Idle {
        Idle {
            since: None,
            turns: 0,
        }
    }

    fn tick(&mut self, progress: usize, what: &'static str) -> Result<()> {
        if progress > 0 {
            self.since = None;
            self.turns = 0;
            return Ok(());
        }
        self.turns = self.turns.wrapping_add(1);
        if self.turns.is_multiple_of(1 << 16) {
            let since = *self.since.get_or_insert_with(Instant::now);
            if since.elapsed() > STALL {
                return Err(BenchError::Stalled(STALL, what));
            }
        }
        std::hint::spin_loop();
        Ok(())
    }
}

fn listen(net: &NetArgs) -> Result<TcpListener> {
    let ip = net.bind.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    // std sets SO_REUSEADDR on Unix listeners: back-to-back runs on one
    // port do not wait for TIME_WAIT.
    let l = TcpListener::bind(SocketAddr::new(ip, net.port))?;
    eprintln!("# floor: waiting for a client on {}", l.local_addr()?);
    Ok(l)
}

/// Accept one connection and read its header (blocking, before the
/// measured mode is set).
fn accept(l: &TcpListener) -> Result<(TcpStream, Header)> {
    let (mut s, peer) = l.accept()?;
    let mut b = [0u8; HEADER_LEN];
    s.read_exact(&mut b)?;
    let h = Header::decode(&b).map_err(|e| BenchError::Protocol(e.to_string()))?;
    debug!(%peer, ?h, "floor client");
    Ok((s, h))
}

/// Connect, retrying a refused connection for a few seconds (the server
/// may still be starting), and send the header.
fn connect(host: &str, port: u16, h: Header) -> Result<TcpStream> {
    let addr = super::resolve(host, port)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut s = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) if e.kind() == ErrorKind::ConnectionRefused && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e.into()),
        }
    };
    s.write_all(&h.encode())?;
    Ok(s)
}

/// One latency result: one-way statistics (the `stag lat` keys) plus the
/// round trip's.
#[derive(Debug, Clone, Serialize)]
pub struct FloorLat {
    #[serde(flatten)]
    pub one_way: LatStats,
    pub rtt_min_us: f64,
    pub rtt_typical_us: f64,
    pub rtt_avg_us: f64,
    pub rtt_p99_us: f64,
    pub rtt_max_us: f64,
}

impl FloorLat {
    fn from_ns(bytes: u64, ns: &[u64]) -> FloorLat {
        let rtt = LatStats::from_samples(bytes, &to_usec(ns, 1.0));
        FloorLat {
            one_way: LatStats::from_samples(bytes, &to_usec(ns, 2.0)),
            rtt_min_us: rtt.t_min_us,
            rtt_typical_us: rtt.t_typical_us,
            rtt_avg_us: rtt.t_avg_us,
            rtt_p99_us: rtt.p99_us,
            rtt_max_us: rtt.t_max_us,
        }
    }
}

/// The JSON report (keys as `stag lat|bw --json`).
#[derive(Debug, Serialize)]
struct Report<'a, R: Serialize> {
    test: &'static str,
    op: &'static str,
    transport: &'static str,
    mode: Option<Mode>,
    streams: u16,
    /// 2: `t_*` is half the round trip (lat); 1: a single operation.
    #[serde(skip_serializing_if = "Option::is_none")]
    latency_factor: Option<u32>,
    results: &'a [R],
}

fn run_lat(net: &NetArgs) -> Result<()> {
    let Some(host) = &net.host else {
        let l = listen(net)?;
        let (s, h) = accept(&l)?;
        if h.test != Kind::Lat {
            return Err(BenchError::Protocol(
                "the client runs bw, this server lat".into(),
            ));
        }
        let mut c = Conn::new(s, net.mode)?;
        let mut buf = vec![0u8; h.size as usize];
        for _ in 0..warmup(h.iters) + h.iters {
            c.recv_exact(&mut buf)?;
            c.send_all(&buf)?;
        }
        eprintln!("# floor lat server done");
        return Ok(());
    };
    let size = net.size.unwrap_or(LAT_SIZE);
    let iters = net.iters.unwrap_or(LAT_ITERS);
    check_size_iters(size, iters)?;
    let h = Header {
        test: Kind::Lat,
        streams: 1,
        size,
        iters,
        index: 0,
    };
    let mut c = Conn::new(connect(host, net.port, h)?, net.mode)?;
    info!(size, iters, mode = ?net.mode, "floor ping-pong");
    let mut ping = vec![0u8; size as usize];
    let mut pong = vec![0u8; size as usize];
    let mut ns = Vec::with_capacity(iters as usize);
    for i in 0..warmup(iters) + iters {
        ping[0] = i as u8;
        let t0 = Instant::now();
        c.send_all(&ping)?;
        c.recv_exact(&mut pong)?;
        let dt = t0.elapsed();
        if i >= warmup(iters) {
            ns.push(dt.as_nanos() as u64);
        }
    }
    let r = FloorLat::from_ns(u64::from(size), &ns);
    let report = Report {
        test: "lat",
        op: "floor",
        transport: "tcp",
        mode: Some(net.mode),
        streams: 1,
        latency_factor: Some(2),
        results: std::slice::from_ref(&r),
    };
    print_report(net.json, &report, || {
        let o = &r.one_way;
        format!(
            " TCP ping-pong ({:?}), {} B x {}:\n one-way  typical {:.2} us, avg {:.2} us, min {:.2}, p99 {:.2}\n \
             round trip typical {:.2} us, avg {:.2} us, min {:.2}, p99 {:.2}\n",
            net.mode, o.bytes, o.iterations, o.t_typical_us, o.t_avg_us, o.t_min_us, o.p99_us,
            r.rtt_typical_us, r.rtt_avg_us, r.rtt_min_us, r.rtt_p99_us
        )
    })
}

fn check_size_iters(size: u32, iters: u32) -> Result<()> {
    if size == 0 || size > 1 << 30 {
        return Err(BenchError::Args(format!("size {size} is not in 1..=2^30")));
    }
    if iters == 0 {
        return Err(BenchError::Args("-n must be at least 1".into()));
    }
    Ok(())
}

fn print_report<R: Serialize>(
    json: bool,
    report: &Report<'_, R>,
    text: impl FnOnce() -> String,
) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, report)?;
        writeln!(out)?;
    } else {
        out.write_all(text().as_bytes())?;
    }
    Ok(())
}

/// When one stream started and finished (ns since the common origin).
#[derive(Debug, Clone, Copy)]
struct Span {
    start: u64,
    end: u64,
}

fn run_bw(a: &BwFloorArgs) -> Result<()> {
    super::raise_fd_limit();
    let net = &a.net;
    let Some(host) = &net.host else {
        return serve_bw(net, a.threads);
    };
    let size = net.size.unwrap_or(BW_SIZE);
    let iters = net
        .iters
        .unwrap_or_else(|| (BW_BYTES / u64::from(size)).clamp(1, 1_000_000) as u32);
    check_size_iters(size, iters)?;
    if a.streams == 0 {
        return Err(BenchError::Args("--streams must be at least 1".into()));
    }
    let socks = (0..a.streams)
        .map(|index| {
            let h = Header {
                test: Kind::Bw,
                streams: a.streams,
                size,
                iters,
                index,
            };
            connect(host, net.port, h)
        })
        .collect::<Result<Vec<_>>>()?;
    info!(size, iters, streams = a.streams, mode = ?net.mode, "floor stream");
    let sets = StreamSet::split(socks, net.mode, a.threads)?;
    // All streams start together; the run lasts from the first start to
    // the last ack.
    let start = Arc::new(Barrier::new(sets.len()));
    let origin = Instant::now();
    let handles: Vec<_> = sets
        .into_iter()
        .enumerate()
        .map(|(i, mut set)| {
            let start = Arc::clone(&start);
            std::thread::Builder::new()
                .name(format!("floor-stream-{i}"))
                .spawn(move || -> Result<Span> {
                    let msg = vec![0x5au8; size as usize];
                    start.wait();
                    let t0 = origin.elapsed().as_nanos() as u64;
                    set.send(&msg, iters)?;
                    set.recv_acks()?;
                    Ok(Span {
                        start: t0,
                        end: origin.elapsed().as_nanos() as u64,
                    })
                })
        })
        .collect::<std::io::Result<_>>()?;
    let spans = join_all(handles)?;
    let first = spans.iter().map(|s| s.start).min().unwrap_or(0);
    let last = spans.iter().map(|s| s.end).max().unwrap_or(0);
    let msgs = u64::from(iters) * u64::from(a.streams);
    let r = BwStats::from_total(u64::from(size), msgs, last.saturating_sub(first));
    let report = Report {
        test: "bw",
        op: "floor",
        transport: "tcp",
        mode: Some(net.mode),
        streams: a.streams,
        latency_factor: None,
        results: std::slice::from_ref(&r),
    };
    print_report(net.json, &report, || {
        format!(
            " TCP stream ({:?}), {} stream(s) of {} x {} B: {:.2} MB/s, {:.6} Mpps\n",
            net.mode, a.streams, iters, size, r.bw_avg_mb_s, r.msg_rate_mpps
        )
    })
}

fn join_all<T>(handles: Vec<std::thread::JoinHandle<Result<T>>>) -> Result<Vec<T>> {
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .map_err(|_| BenchError::Protocol("a stream thread panicked".into()))?
        })
        .collect()
}

/// The stream server: take every stream the client announces, drain each
/// in its own thread, ack its end.
fn serve_bw(net: &NetArgs, threads: Option<u16>) -> Result<()> {
    let l = listen(net)?;
    let (s, first) = accept(&l)?;
    if first.test != Kind::Bw {
        return Err(BenchError::Protocol(
            "the client runs lat, this server bw".into(),
        ));
    }
    let mut socks = vec![s];
    while socks.len() < usize::from(first.streams) {
        let (s, h) = accept(&l)?;
        if (h.test, h.streams, h.size, h.iters)
            != (first.test, first.streams, first.size, first.iters)
        {
            return Err(BenchError::Protocol(format!(
                "stream {} disagrees with stream 0: {h:?} vs {first:?}",
                h.index
            )));
        }
        socks.push(s);
    }
    let total = u64::from(first.size) * u64::from(first.iters);
    let handles: Vec<_> = StreamSet::split(socks, net.mode, threads)?
        .into_iter()
        .enumerate()
        .map(|(i, mut set)| {
            std::thread::Builder::new()
                .name(format!("floor-drain-{i}"))
                .spawn(move || -> Result<()> {
                    set.drain(total)?;
                    set.send_acks()
                })
        })
        .collect::<std::io::Result<_>>()?;
    join_all(handles)?;
    eprintln!("# floor bw server done");
    Ok(())
}

/// A shared, file-backed mapping, unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(file: &std::fs::File, len: usize) -> Result<Mapping> {
        file.set_len(len as u64)?;
        // SAFETY: a fresh shared mapping of a file we just sized; nothing
        // else maps it, and it is unmapped once, in drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(file),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }

    /// Dirty `[0, len)` with `value`.
    fn dirty(&mut self, len: usize, value: u8) {
        assert!(len <= self.len);
        // SAFETY: in bounds of our own mapping, which no one else touches.
        unsafe { std::ptr::write_bytes(self.ptr, value, len) };
    }

    /// msync the pages covering `[0, len)`, as the provider's Commit does
    /// (page-aligned, MS_SYNC).
    fn sync(&self, len: usize) -> Result<()> {
        let page = page_size();
        let end = len.next_multiple_of(page).min(self.len);
        // SAFETY: a page-aligned range inside our mapping.
        let rc = unsafe { libc::msync(self.ptr.cast(), end, libc::MS_SYNC) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in new with this length, unmapped only here.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).unwrap_or(4096).max(1)
}

fn run_msync(a: &MsyncArgs) -> Result<()> {
    check_size_iters(a.size, a.iters)?;
    let dir = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    let path = dir.join(format!("stag-floor-msync-{}.bin", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)?;
    // The file is only a target: gone whatever happens next.
    let _ = std::fs::remove_file(&path);
    let size = a.size as usize;
    let mut map = Mapping::new(&file, size.next_multiple_of(page_size()))?;
    let mut ns = Vec::with_capacity(a.iters as usize);
    for i in 0..warmup(a.iters) + a.iters {
        map.dirty(size, (i % 255) as u8 + 1);
        let t0 = Instant::now();
        map.sync(size)?;
        let dt = t0.elapsed();
        if i >= warmup(a.iters) {
            ns.push(dt.as_nanos() as u64);
        }
    }
    let r = LatStats::from_samples(u64::from(a.size), &to_usec(&ns, 1.0));
    let report = Report {
        test: "msync",
        op: "floor",
        transport: "file",
        mode: None,
        streams: 1,
        latency_factor: Some(1),
        results: std::slice::from_ref(&r),
    };
    print_report(a.json, &report, || {
        format!(
            " msync of {} dirty bytes in {}: typical {:.2} us, avg {:.2} us, p99 {:.2} us\n",
            r.bytes,
            dir.display(),
            r.t_typical_us,
            r.t_avg_us,
            r.p99_us
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 16 streams on 2 threads a side, in each mode: every stream
    /// carries every message and every ack arrives.
    #[test]
    fn shared_threads_carry_every_stream() {
        for mode in [Mode::Busy, Mode::Blocking] {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let (ours, theirs): (Vec<_>, Vec<_>) = (0..16)
                .map(|_| {
                    let c = TcpStream::connect(addr).unwrap();
                    (c, l.accept().unwrap().0)
                })
                .unzip();
            let (size, iters) = (8usize, 500u32);
            let senders = StreamSet::split(ours, mode, Some(2)).unwrap();
            let drains = StreamSet::split(theirs, mode, Some(2)).unwrap();
            assert_eq!((senders.len(), drains.len()), (2, 2));
            assert!(senders.iter().all(|s| s.conns.len() == 8));
            let total = (size as u64) * u64::from(iters);
            let d: Vec<_> = drains
                .into_iter()
                .map(|mut set| {
                    std::thread::spawn(move || {
                        set.drain(total)?;
                        set.send_acks()
                    })
                })
                .collect();
            let t: Vec<_> = senders
                .into_iter()
                .map(|mut set| {
                    std::thread::spawn(move || {
                        set.send(&vec![0x5a; size], iters)?;
                        set.recv_acks()
                    })
                })
                .collect();
            for h in d.into_iter().chain(t) {
                h.join().unwrap().unwrap();
            }
        }
    }

    #[test]
    fn rtt_is_twice_one_way() {
        let r = FloorLat::from_ns(8, &[10_000, 20_000, 30_000]);
        assert_eq!(r.one_way.t_typical_us, 10.0);
        assert_eq!(r.rtt_typical_us, 20.0);
        assert_eq!(r.rtt_min_us, 2.0 * r.one_way.t_min_us);
    }
}
