//! rdma_cm for the userspace device: librdmacm's API, mapped onto MPA
//! connections of stag0 (its addresses are TCP addresses).
//!
//! librdmacm only talks to the kernel's `rdma_ucm`; here every cm id lives
//! in this process. On iWARP the port space is TCP's, so a cm id's
//! address:port *is* the TCP address:port: `rdma_listen` listens on it,
//! `rdma_connect` opens a TCP connection to the peer's and runs the MPA
//! exchange (RFC 5044 / RFC 6581) onto the id's QP, with the connection
//! parameters' private data in the MPA Request/Reply and
//! `responder_resources`/`initiator_depth` as IRD/ORD.
//!
//! The pieces:
//! - `channel`: event channels (a pipe per channel, one byte per queued
//!   event, so `channel->fd` polls and honours the application's
//!   `O_NONBLOCK`) and the events waiting in them;
//! - `event`: `struct rdma_cm_event`s handed to the application, owned
//!   (with their private data) until `rdma_ack_cm_event`;
//! - `id`: cm ids, their registry and state machine;
//! - `addr`: socket addresses, binding and `rdma_getaddrinfo`;
//! - `listen`: accept threads per listening id, turning TCP+MPA Requests
//!   into CONNECT_REQUEST events (the child id is made when the
//!   application takes the event);
//! - `conn`: connect (the MPA exchange on a thread of its own), accept,
//!   reject, disconnect, and the watcher that turns a stream that went
//!   down (`rdma_disconnect`, the peer's close, the peer gone, the QP
//!   destroyed) into DISCONNECTED;
//! - `ops`: create/destroy, bind, address and route resolution, options,
//!   migration;
//! - `qp`: `rdma_create_qp` & co., SRQs, endpoints (`rdma_create_ep`,
//!   `rdma_get_request`);
//! - `verbs`: stag0's `ibv_context`, opened once through libibverbs, and
//!   the QP/CQ/SRQ helpers librdmacm offers;
//! - `exports`: the C entry points, exported with librdmacm's symbol
//!   versions (`librdmacm.map`).
//!
//! Threads never write into C-visible structures: background threads
//! (listeners, connectors, the watcher) only queue events; `rdma_cm_id`
//! fields and QP states are written on the application's threads, inside
//! its calls (`rdma_get_cm_event` included). The cm holds its QPs weakly,
//! so `ibv_destroy_qp` closes a connection, which the peer sees as
//! DISCONNECTED.
//!
//! Not provided: AF_IB addresses, UD port spaces (UDP/IPoIB) and
//! multicast, which need UD QPs (ENOSYS/EPROTONOSUPPORT); the rsocket API
//! (ENOSYS). A QP the application made itself (`ibv_create_qp`) is
//! connected by its `conn_param->qp_num`, and the application moves it
//! through INIT/RTR/RTS, as with the kernel's cm.

mod addr;
mod channel;
mod conn;
mod event;
mod exports;
mod id;
mod listen;
mod listener;
mod neigh;
mod ops;
mod qp;
mod verbs;

pub(crate) use crate::errno::Errno;
pub(crate) use crate::handle::is_stag_context;
pub(crate) use crate::qp::{QpHandle, StagQp, WeakQpHandle};

pub(crate) type CmResult<T> = Result<T, Errno>;

pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
