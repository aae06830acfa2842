//! tonic over `RdmaStream` on stag0 (feature `grpc`): real unary,
//! server-streaming and bidirectional calls through `RdmaConnector` and
//! `RdmaIncoming`, several clients at once, each on its own QP, and a
//! client whose server went away gets an error, not a hang.

#[path = "../examples/common/echo.rs"]
mod echo;

use std::time::Duration;

use echo::{EchoClient, EchoRequest, EchoServer};
use stag::verbs::r#async::grpc::{RdmaConnector, RdmaIncoming};
use stag::verbs::r#async::{AsyncListener, StreamOptions};
use stag::verbs::{Context, ProtectionDomain};
use tonic::codegen::tokio_stream::{self, StreamExt};
use tonic::transport::{Endpoint, Server};

/// Nothing here may take longer: a hang fails the test instead.
const LIMIT: Duration = Duration::from_secs(30);

fn device() -> String {
    std::env::var("STAG_DEVICE").unwrap_or_else(|_| "stag0".into())
}

/// A server on a fresh listener; its address, and the task serving it.
fn serve(ctx: &Context) -> (String, tokio::task::JoinHandle<()>) {
    let pd = ctx.alloc_pd().unwrap();
    let listener = AsyncListener::bind(ctx, "127.0.0.1:0".parse().unwrap()).unwrap();
    let uri = format!("http://{}", listener.local_addr().unwrap());
    let incoming = RdmaIncoming::new(listener, pd, StreamOptions::default());
    let task = tokio::spawn(async move {
        Server::builder()
            .serve_with_incoming(EchoServer, incoming)
            .await
            .unwrap();
    });
    (uri, task)
}

async fn client(pd: &ProtectionDomain, uri: &str) -> EchoClient {
    let channel = Endpoint::from_shared(uri.to_owned())
        .unwrap()
        .connect_with_connector(RdmaConnector::new(pd.clone(), StreamOptions::default()))
        .await
        .expect("connects over RDMA");
    EchoClient::new(channel)
}

fn request(message: &str, repeat: u32) -> EchoRequest {
    EchoRequest {
        message: message.into(),
        repeat,
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn unary_and_streaming_calls_over_rdma_streams() {
    runtime().block_on(async {
        let ctx = Context::open(&device()).unwrap();
        let (uri, _server) = serve(&ctx);
        let pd = ctx.alloc_pd().unwrap();
        tokio::time::timeout(LIMIT, async {
            let mut c = client(&pd, &uri).await;
            // Unary: a message larger than one stream slot (64 KiB) too.
            for len in [0, 5, 200_000] {
                let msg = "x".repeat(len);
                let reply = c.unary(request(&msg, 0)).await.unwrap();
                assert_eq!(reply.message, msg);
                assert_ne!(reply.qp_num, 0, "the server saw no RdmaConnectInfo");
            }
            // Server streaming.
            let mut replies = c.repeat(request("r", 100)).await.unwrap();
            let mut n = 0;
            while let Some(r) = replies.message().await.unwrap() {
                assert_eq!((r.index, r.message.as_str()), (n, "r"));
                n += 1;
            }
            assert_eq!(n, 100);
            // Bidirectional.
            let words: Vec<String> = (0..50).map(|i| format!("w{i}")).collect();
            let reqs = tokio_stream::iter(words.clone().into_iter().map(|w| request(&w, 0)));
            let echoed: Vec<String> = c
                .chat(reqs)
                .await
                .unwrap()
                .map(|r| r.unwrap().message)
                .collect()
                .await;
            assert_eq!(echoed, words);
        })
        .await
        .expect("the calls finish in time");
    });
}

#[test]
fn clients_on_separate_connections_are_served_at_once() {
    runtime().block_on(async {
        let ctx = Context::open(&device()).unwrap();
        let (uri, _server) = serve(&ctx);
        let pd = ctx.alloc_pd().unwrap();
        tokio::time::timeout(LIMIT, async {
            let mut clients = Vec::new();
            for _ in 0..4 {
                clients.push(client(&pd, &uri).await);
            }
            let calls = clients.iter_mut().enumerate().map(|(i, c)| async move {
                let mut qps = Vec::new();
                for j in 0..20 {
                    let msg = format!("{i}/{j}");
                    let r = c.unary(request(&msg, 0)).await.unwrap();
                    assert_eq!(r.message, msg);
                    qps.push(r.qp_num);
                }
                qps.dedup();
                assert_eq!(qps.len(), 1, "one client's calls share one connection");
                qps[0]
            });
            let mut qps = futures_join_all(calls).await;
            qps.sort_unstable();
            qps.dedup();
            assert_eq!(qps.len(), 4, "each client has its own server QP");
        })
        .await
        .expect("the calls finish in time");
    });
}

#[test]
fn a_call_to_a_server_that_went_away_fails() {
    // The server on a runtime of its own, on another thread: dropping
    // that runtime drops every connection task it spawned (aborting the
    // serve task alone would leave them running, as over TCP).
    let ctx = Context::open(&device()).unwrap();
    let (uri_tx, uri_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server_ctx = ctx.clone();
    let server = std::thread::spawn(move || {
        runtime().block_on(async move {
            let (uri, _task) = serve(&server_ctx);
            uri_tx.send(uri).unwrap();
            let _ = stop_rx.await;
        });
    });
    let uri = uri_rx.recv().unwrap();
    runtime().block_on(async {
        let pd = ctx.alloc_pd().unwrap();
        tokio::time::timeout(LIMIT, async {
            let mut c = client(&pd, &uri).await;
            c.unary(request("before", 0)).await.unwrap();
            stop_tx.send(()).unwrap();
            tokio::task::spawn_blocking(move || server.join().unwrap())
                .await
                .unwrap();
            let after = c.unary(request("after", 0)).await;
            assert!(after.is_err(), "a call with no server gave {after:?}");
        })
        .await
        .expect("the failed call returns in time");
    });
}

/// Run futures concurrently on this task, in order of the results.
async fn futures_join_all<F: std::future::Future>(fs: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut set = Vec::new();
    for f in fs {
        set.push(Box::pin(f));
    }
    let mut out: Vec<Option<F::Output>> = set.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in set.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *o = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(Option::unwrap).collect()
}
