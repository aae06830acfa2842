//! gRPC over RDMA: a tonic echo service served over `RdmaStream`s on the
//! default device (`$STAG_DEVICE`, else the first RDMA device, else
//! stag's userspace provider), called with unary, server-streaming and
//! bidirectional-streaming RPCs; then unary latency over RDMA against the
//! same service over TCP, in alternating rounds (medians). Both ends run
//! in this process. On a libibverbs device set `STAG_ADDR` to its IP.
//!
//!     cargo run --release --features grpc --example grpc_echo [-- ROUNDS CALLS]
//!
//! One side per process, for `scripts/bench/bench-async.sh` (the client prints
//! one JSON line: the median of CALLS unary calls, timed one by one):
//!
//!     grpc_echo server rdma|tcp PORT        (serves until killed)
//!     grpc_echo client rdma|tcp HOST:PORT CALLS

#[path = "common/echo.rs"]
mod echo;

use std::error::Error;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use echo::{EchoClient, EchoRequest, EchoServer};
use stag::verbs::r#async::grpc::{RdmaConnector, RdmaIncoming};
use stag::verbs::r#async::{AsyncListener, StreamOptions};
use stag::verbs::{self, Context};
use tonic::codegen::tokio_stream::{self, StreamExt};
use tonic::transport::{Endpoint, Server};

type Res<T> = Result<T, Box<dyn Error>>;

/// The streams' shape; `GRPC_SPIN_US` sets their CQs' spin
/// (`StreamOptions::spin`), unset the default; `GRPC_SENDS` set: data as
/// Sends (`StreamOptions::write_imm` false).
fn stream_options() -> Res<StreamOptions> {
    let mut o = StreamOptions::default();
    if let Ok(v) = std::env::var("GRPC_SPIN_US") {
        o.spin = Duration::from_micros(v.parse()?);
    }
    if std::env::var_os("GRPC_SENDS").is_some() {
        o.write_imm = false;
    }
    Ok(o)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Res<()> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    match argv.first().map(String::as_str) {
        Some("server") => return serve_alone(&argv).await,
        Some("client") => return call_alone(&argv).await,
        _ => {}
    }
    let mut args = argv.into_iter();
    let rounds: usize = args.next().map_or(Ok(3), |a| a.parse())?;
    let calls: usize = args.next().map_or(Ok(200), |a| a.parse())?;
    let device = verbs::default_device();
    let ip = std::env::var("STAG_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
    println!("device {device}");

    // The server: tonic over the listener's RdmaStreams.
    let ctx = Context::open(&device)?;
    let pd = ctx.alloc_pd()?;
    let opts = stream_options()?;
    let listener = AsyncListener::bind(&ctx, format!("{ip}:0").parse()?)?;
    let addr = listener.local_addr()?;
    let incoming = RdmaIncoming::new(listener, pd.clone(), opts);
    // One service, no router: it answers every path itself.
    tokio::spawn(Server::builder().serve_with_incoming(EchoServer, incoming));

    // The client: tonic's channel, connected by RdmaConnector to the
    // host:port of its URI.
    let channel = Endpoint::from_shared(format!("http://{addr}"))?
        .connect_with_connector(RdmaConnector::new(pd.clone(), opts))
        .await?;
    let mut client = EchoClient::new(channel);

    let reply = client.unary(request("hello over RDMA", 0)).await?;
    println!("unary    {:?} (server QP {})", reply.message, reply.qp_num);
    if reply.message != "hello over RDMA" || reply.qp_num == 0 {
        return Err("the unary reply is wrong".into());
    }

    let mut replies = client.repeat(request("again", 5)).await?;
    let mut n = 0;
    while let Some(r) = replies.message().await? {
        if r.index != n || r.message != "again" {
            return Err(format!("reply {n} of the stream is {r:?}").into());
        }
        n += 1;
    }
    println!("repeat   {n} replies streamed back");

    const WORDS: [&str; 3] = ["one", "two", "three"];
    let reqs = tokio_stream::iter(WORDS.iter().map(|w| request(w, 0)));
    let echoed: Vec<String> = client
        .chat(reqs)
        .await?
        .map(|r| r.map(|r| r.message))
        .collect::<Result<_, _>>()
        .await?;
    println!("chat     {echoed:?}");
    if echoed != WORDS {
        return Err("the chat echoed the wrong words".into());
    }

    // Unary latency: the same service over TCP, side by side.
    let tcp = tokio::net::TcpListener::bind(format!("{ip}:0")).await?;
    let tcp_addr: SocketAddr = tcp.local_addr()?;
    tokio::spawn(Server::builder().serve_with_incoming(
        EchoServer,
        tokio_stream::wrappers::TcpListenerStream::new(tcp),
    ));
    let mut tcp_client = EchoClient::new(
        Endpoint::from_shared(format!("http://{tcp_addr}"))?
            .connect()
            .await?,
    );
    let (mut rdma_us, mut tcp_us) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        rdma_us.push(unary_latency(&mut client, calls).await?);
        tcp_us.push(unary_latency(&mut tcp_client, calls).await?);
    }
    let (r, t) = (median(&mut rdma_us), median(&mut tcp_us));
    println!(
        "grpc_echo: ok; unary RPC median of {rounds} rounds x {calls} calls: \
         RDMA {r:.1} us, TCP {t:.1} us, ratio {:.2}",
        r / t
    );
    Ok(())
}

/// `server rdma|tcp PORT`: serve until killed.
async fn serve_alone(argv: &[String]) -> Res<()> {
    let usage = "usage: grpc_echo server rdma|tcp PORT";
    let port: u16 = argv.get(2).ok_or(usage)?.parse()?;
    let addr = SocketAddr::from(([0, 0, 0, 0], port));
    match argv.get(1).map(String::as_str) {
        Some("rdma") => {
            let ctx = Context::open(&verbs::default_device())?;
            let pd = ctx.alloc_pd()?;
            let listener = AsyncListener::bind(&ctx, addr)?;
            let incoming = RdmaIncoming::new(listener, pd, stream_options()?);
            Server::builder()
                .serve_with_incoming(EchoServer, incoming)
                .await?;
        }
        Some("tcp") => {
            let tcp = tokio::net::TcpListener::bind(addr).await?;
            Server::builder()
                .serve_with_incoming(
                    EchoServer,
                    tokio_stream::wrappers::TcpListenerStream::new(tcp),
                )
                .await?;
        }
        _ => return Err(usage.into()),
    }
    Ok(())
}

/// `client rdma|tcp HOST:PORT CALLS`: the median of CALLS unary calls
/// (after CALLS/10 to warm up), as one JSON line.
async fn call_alone(argv: &[String]) -> Res<()> {
    let usage = "usage: grpc_echo client rdma|tcp HOST:PORT CALLS";
    let transport = argv.get(1).ok_or(usage)?.as_str();
    let addr: SocketAddr = argv.get(2).ok_or(usage)?.parse()?;
    let calls: usize = argv.get(3).ok_or(usage)?.parse()?;
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))?;
    let channel = match transport {
        "rdma" => {
            let ctx = Context::open(&verbs::default_device())?;
            let pd = ctx.alloc_pd()?;
            endpoint
                .connect_with_connector(RdmaConnector::new(pd, stream_options()?))
                .await?
        }
        "tcp" => endpoint.connect().await?,
        _ => return Err(usage.into()),
    };
    let mut client = EchoClient::new(channel);
    let mut samples = Vec::with_capacity(calls);
    for i in 0..calls + calls / 10 {
        let t = Instant::now();
        client.unary(request("ping", 0)).await?;
        if i >= calls / 10 {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let med = median(&mut samples);
    // Sorted by `median`: the tail, to see a second mode.
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    println!(
        "{{\"test\":\"grpc-unary\",\"transport\":\"{transport}\",\"iterations\":{},\"t_typical_us\":{med:.3},\"p10_us\":{:.3},\"p90_us\":{:.3},\"p99_us\":{:.3}}}",
        samples.len(),
        at(0.10),
        at(0.90),
        at(0.99),
    );
    Ok(())
}

fn request(message: &str, repeat: u32) -> EchoRequest {
    EchoRequest {
        message: message.into(),
        repeat,
    }
}

/// Mean microseconds per unary call over `calls` calls, one at a time.
async fn unary_latency(client: &mut EchoClient, calls: usize) -> Res<f64> {
    let start = Instant::now();
    for _ in 0..calls {
        client.unary(request("ping", 0)).await?;
    }
    let per_call: Duration = start.elapsed() / calls.max(1) as u32;
    Ok(per_call.as_secs_f64() * 1e6)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
