//! `RdmaStream`'s zero-copy slot path, both ends in this process on the
//! default device (`$STAG_DEVICE`, else the first RDMA device, else stag's
//! userspace provider; on a libibverbs device set `STAG_ADDR` to its IP
//! address): the client writes each message straight into a registered
//! send slot it borrows, the server reads each where it landed, in the
//! ring slot it borrows. Checks what arrived, and fails loudly if not.
//!
//!     cargo run --release --example async_stream_slots

use std::error::Error;
use std::io::Write;
use std::net::SocketAddr;

use stag::verbs::r#async::{AsyncListener, RdmaStream, StreamOptions};
use stag::verbs::{self, Context};
use tokio::io::AsyncWriteExt;

type Res<T> = Result<T, Box<dyn Error>>;

const MESSAGES: usize = 1000;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Res<()> {
    let device = verbs::default_device();
    let addr: SocketAddr = match std::env::var("STAG_ADDR") {
        Ok(a) => format!("{a}:0").parse()?,
        Err(_) => "127.0.0.1:0".parse()?,
    };
    let (sctx, cctx) = (Context::open(&device)?, Context::open(&device)?);
    let (spd, cpd) = (sctx.alloc_pd()?, cctx.alloc_pd()?);
    let listener = AsyncListener::bind(&sctx, addr)?;
    let addr = listener.local_addr()?;
    let opts = StreamOptions::default();
    let (server, client) = tokio::join!(
        RdmaStream::accept(&listener, &spd, opts),
        RdmaStream::connect(&cpd, addr, opts)
    );
    let (server, mut client) = (server?, client?);

    let writer = async {
        for i in 0..MESSAGES {
            // Borrow a send slot (waits while the peer's ring is full),
            // write the message into it in place, post it.
            let mut slot = client.send_slot().await?;
            let capacity = slot.capacity();
            let mut free = &mut slot[..];
            write!(free, "message {i} of {MESSAGES}")?;
            let len = capacity - free.len();
            slot.commit(len)?;
        }
        // Behind the data: the server's recv_slot then gives None.
        client.shutdown().await?;
        Ok::<_, Box<dyn Error>>(())
    };
    let reader = async {
        let mut got = 0;
        // Each message where it landed; the slot goes back as it drops.
        while let Some(slot) = server.recv_slot().await? {
            let want = format!("message {got} of {MESSAGES}");
            if slot[..] != *want.as_bytes() {
                return Err(format!("message {got}: {:?}", String::from_utf8_lossy(&slot)).into());
            }
            got += 1;
        }
        Ok::<_, Box<dyn Error>>(got)
    };
    let (wrote, got) = tokio::join!(writer, reader);
    wrote?;
    let got = got?;
    if got != MESSAGES {
        return Err(format!("{got} messages arrived, {MESSAGES} were sent").into());
    }
    println!("device {device}: {got} messages through the slot path, in order, no copy");
    Ok(())
}
