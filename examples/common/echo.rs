//! A small gRPC echo service, written by hand so that building it needs
//! no `protoc`: prost-derived messages and tonic's codegen-free client
//! and server APIs (what tonic-build would generate from this .proto):
//!
//! ```proto
//! syntax = "proto3";
//! package stag.echo;
//! message EchoRequest { string message = 1; uint32 repeat = 2; }
//! message EchoReply { string message = 1; uint32 index = 2; uint32 qp_num = 3; }
//! service Echo {
//!   rpc Unary(EchoRequest) returns (EchoReply);
//!   rpc Repeat(EchoRequest) returns (stream EchoReply);
//!   rpc Chat(stream EchoRequest) returns (stream EchoReply);
//! }
//! ```
//!
//! Shared by `examples/grpc_echo.rs` and `tests/grpc.rs`.

#![allow(dead_code)]

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::pin::Pin;
use std::task::{Context, Poll};

use stag::verbs::r#async::grpc::RdmaConnectInfo;
use tokio_stream::{Stream, StreamExt};
use tonic::body::Body;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::codegen::{http, tokio_stream, Service};
use tonic::server::{NamedService, ServerStreamingService, StreamingService, UnaryService};
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;

#[derive(Clone, PartialEq, prost::Message)]
pub struct EchoRequest {
    #[prost(string, tag = "1")]
    pub message: String,
    /// How many replies `Repeat` sends.
    #[prost(uint32, tag = "2")]
    pub repeat: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct EchoReply {
    #[prost(string, tag = "1")]
    pub message: String,
    /// The reply's place in its stream (0 for `Unary`).
    #[prost(uint32, tag = "2")]
    pub index: u32,
    /// The QP of the server's end (0 when the call came over TCP).
    #[prost(uint32, tag = "3")]
    pub qp_num: u32,
}

const UNARY: &str = "/stag.echo.Echo/Unary";
const REPEAT: &str = "/stag.echo.Echo/Repeat";
const CHAT: &str = "/stag.echo.Echo/Chat";

/// The server's QP for a request that came over an `RdmaStream`.
fn qp_num<T>(req: &Request<T>) -> u32 {
    req.extensions()
        .get::<RdmaConnectInfo>()
        .map_or(0, |i| i.qp_num)
}

/// The client.
#[derive(Debug, Clone)]
pub struct EchoClient {
    grpc: tonic::client::Grpc<tonic::transport::Channel>,
}

impl EchoClient {
    pub fn new(channel: tonic::transport::Channel) -> EchoClient {
        EchoClient {
            grpc: tonic::client::Grpc::new(channel),
        }
    }

    async fn ready(&mut self) -> Result<(), Status> {
        self.grpc
            .ready()
            .await
            .map_err(|e| Status::unavailable(format!("the channel is not ready: {e}")))
    }

    pub async fn unary(&mut self, req: EchoRequest) -> Result<EchoReply, Status> {
        self.ready().await?;
        let path = PathAndQuery::from_static(UNARY);
        let resp = self
            .grpc
            .unary(Request::new(req), path, ProstCodec::default())
            .await?;
        Ok(resp.into_inner())
    }

    pub async fn repeat(&mut self, req: EchoRequest) -> Result<Streaming<EchoReply>, Status> {
        self.ready().await?;
        let path = PathAndQuery::from_static(REPEAT);
        let resp = self
            .grpc
            .server_streaming(Request::new(req), path, ProstCodec::default())
            .await?;
        Ok(resp.into_inner())
    }

    pub async fn chat(
        &mut self,
        reqs: impl Stream<Item = EchoRequest> + Send + 'static,
    ) -> Result<Streaming<EchoReply>, Status> {
        self.ready().await?;
        let path = PathAndQuery::from_static(CHAT);
        let resp = self
            .grpc
            .streaming(Request::new(reqs), path, ProstCodec::default())
            .await?;
        Ok(resp.into_inner())
    }
}

/// The server: echoes each message back, with the QP it came on.
#[derive(Debug, Clone, Default)]
pub struct EchoServer;

impl NamedService for EchoServer {
    const NAME: &'static str = "stag.echo.Echo";
}

struct Unary;

impl UnaryService<EchoRequest> for Unary {
    type Response = EchoReply;
    type Future = Ready<Result<Response<EchoReply>, Status>>;

    fn call(&mut self, req: Request<EchoRequest>) -> Self::Future {
        let qp_num = qp_num(&req);
        let message = req.into_inner().message;
        ready(Ok(Response::new(EchoReply {
            message,
            index: 0,
            qp_num,
        })))
    }
}

struct Repeat;

type ReplyStream = Pin<Box<dyn Stream<Item = Result<EchoReply, Status>> + Send>>;

impl ServerStreamingService<EchoRequest> for Repeat {
    type Response = EchoReply;
    type ResponseStream = ReplyStream;
    type Future = Ready<Result<Response<ReplyStream>, Status>>;

    fn call(&mut self, req: Request<EchoRequest>) -> Self::Future {
        let qp_num = qp_num(&req);
        let EchoRequest { message, repeat } = req.into_inner();
        let replies = (0..repeat).map(move |index| {
            Ok(EchoReply {
                message: message.clone(),
                index,
                qp_num,
            })
        });
        ready(Ok(Response::new(
            Box::pin(tokio_stream::iter(replies)) as ReplyStream
        )))
    }
}

struct Chat;

impl StreamingService<EchoRequest> for Chat {
    type Response = EchoReply;
    type ResponseStream = ReplyStream;
    type Future = Ready<Result<Response<ReplyStream>, Status>>;

    fn call(&mut self, req: Request<Streaming<EchoRequest>>) -> Self::Future {
        let qp_num = qp_num(&req);
        let mut index = 0;
        let replies = req.into_inner().map(move |r| {
            let reply = EchoReply {
                message: r?.message,
                index,
                qp_num,
            };
            index += 1;
            Ok(reply)
        });
        ready(Ok(Response::new(Box::pin(replies) as ReplyStream)))
    }
}

impl Service<http::Request<Body>> for EchoServer {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let mut grpc = tonic::server::Grpc::new(ProstCodec::<EchoReply, EchoRequest>::default());
        match req.uri().path() {
            UNARY => Box::pin(async move { Ok(grpc.unary(Unary, req).await) }),
            REPEAT => Box::pin(async move { Ok(grpc.server_streaming(Repeat, req).await) }),
            CHAT => Box::pin(async move { Ok(grpc.streaming(Chat, req).await) }),
            _ => Box::pin(ready(Ok(
                Status::unimplemented("no such method").into_http()
            ))),
        }
    }
}
