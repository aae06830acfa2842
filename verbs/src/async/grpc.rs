//! A tonic gRPC transport over [`RdmaStream`] (feature `grpc`): HTTP/2
//! runs over the stream's Sends as it would over a TCP socket.
//!
//! - Client: [`RdmaConnector`] is the `tower::Service<Uri>` that tonic's
//!   `Endpoint::connect_with_connector` takes; it connects an
//!   `RdmaStream` to the address in the URI's authority
//!   (`http://10.0.0.1:50051`) and hands it to hyper.
//! - Server: [`RdmaIncoming`] is the stream of accepted `RdmaStream`s that
//!   `Server::serve_with_incoming` takes; each stream is tonic-`Connected`,
//!   so a handler finds an [`RdmaConnectInfo`] in the request's
//!   extensions.
//!
//! ```no_run
//! # async fn demo(ctx: verbs::Context) -> Result<(), Box<dyn std::error::Error>> {
//! use verbs::r#async::grpc::{RdmaConnector, RdmaIncoming};
//! use verbs::r#async::{AsyncListener, StreamOptions};
//! let pd = ctx.alloc_pd()?;
//! // Server side: tonic::transport::Server::builder()
//! //     .add_service(svc).serve_with_incoming(incoming)
//! let listener = AsyncListener::bind(&ctx, "127.0.0.1:50051".parse()?)?;
//! let incoming = RdmaIncoming::new(listener, pd.clone(), StreamOptions::default());
//! // Client side:
//! let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:50051")
//!     .connect_with_connector(RdmaConnector::new(pd, StreamOptions::default()))
//!     .await?;
//! # let _ = (incoming, channel); Ok(()) }
//! ```

use std::future::Future;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};

use futures_core::Stream;
use http::Uri;
use hyper_util::rt::TokioIo;
use tonic::transport::server::Connected;

use super::{AsyncListener, RdmaStream, StreamOptions};
use crate::error::{Error, Result};
use crate::pd::ProtectionDomain;

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What a gRPC handler can learn of the connection its request came on
/// (`request.extensions().get::<RdmaConnectInfo>()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RdmaConnectInfo {
    /// The QP the stream runs on.
    pub qp_num: u32,
}

impl Connected for RdmaStream {
    type ConnectInfo = RdmaConnectInfo;

    fn connect_info(&self) -> RdmaConnectInfo {
        RdmaConnectInfo {
            qp_num: self.qp().qp_num(),
        }
    }
}

/// tonic's client connector: each call connects one [`RdmaStream`] to
/// the host and port of the URI it is given, wrapped for hyper.
#[derive(Debug, Clone)]
pub struct RdmaConnector {
    pd: ProtectionDomain,
    opts: StreamOptions,
}

impl RdmaConnector {
    /// Connect streams of shape `opts` (the server's must match) with
    /// resources of `pd`.
    pub fn new(pd: ProtectionDomain, opts: StreamOptions) -> RdmaConnector {
        RdmaConnector { pd, opts }
    }
}

/// The socket address a URI names (its port defaults to 80 for `http`,
/// 443 for `https`, as hyper's own connector does).
fn uri_addr(uri: &Uri) -> io::Result<SocketAddr> {
    let host = uri
        .host()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("no host in {uri}")))?;
    let port = uri
        .port_u16()
        .unwrap_or(if uri.scheme_str() == Some("https") {
            443
        } else {
            80
        });
    // An IPv6 literal comes bracketed.
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (host, port)
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("{host} has no address")))
}

impl tower_service::Service<Uri> for RdmaConnector {
    type Response = TokioIo<RdmaStream>;
    type Error = io::Error;
    type Future = BoxFuture<io::Result<TokioIo<RdmaStream>>>;

    fn poll_ready(&mut self, _: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (pd, opts) = (self.pd.clone(), self.opts);
        Box::pin(async move {
            let addr = uri_addr(&uri)?;
            let stream = RdmaStream::connect(&pd, addr, opts).await.map_err(to_io)?;
            Ok(TokioIo::new(stream))
        })
    }
}

fn to_io(e: Error) -> io::Error {
    match e {
        Error::Io(e) => e,
        e => io::Error::other(e),
    }
}

/// tonic's server incoming: the connections of a listener, each accepted
/// as an [`RdmaStream`]. A connection whose setup fails is an `Err` item,
/// which tonic's server logs and skips; the stream never ends by itself.
pub struct RdmaIncoming {
    listener: AsyncListener,
    pd: ProtectionDomain,
    opts: StreamOptions,
    accepting: Option<BoxFuture<Result<RdmaStream>>>,
}

impl std::fmt::Debug for RdmaIncoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaIncoming")
            .field("listener", &self.listener)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl RdmaIncoming {
    /// Accept the connections of `listener` as streams of shape `opts`,
    /// with resources of `pd`.
    pub fn new(listener: AsyncListener, pd: ProtectionDomain, opts: StreamOptions) -> RdmaIncoming {
        RdmaIncoming {
            listener,
            pd,
            opts,
            accepting: None,
        }
    }
}

impl Stream for RdmaIncoming {
    type Item = io::Result<RdmaStream>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let accepting = this.accepting.get_or_insert_with(|| {
            let (listener, pd, opts) = (this.listener.clone(), this.pd.clone(), this.opts);
            Box::pin(async move { RdmaStream::accept(&listener, &pd, opts).await })
        });
        let accepted = std::task::ready!(accepting.as_mut().poll(cx));
        this.accepting = None;
        Poll::Ready(Some(accepted.map_err(to_io)))
    }
}
