//! A small key-value store served by tokio, where the server's CPU takes
//! no part in the data path: the server registers a durable, file-backed
//! table and tells each client where it is; clients GET with an RDMA Read,
//! PUT durably with a Write then a Commit, and count with FetchAdd.
//!
//! Table layout: `SLOTS` slots of `SLOT` bytes (8-byte length, then the
//! value), one per key (keys are slot numbers here; a real store would
//! hash, and lock or version a slot with CmpSwap); then one 8-byte
//! counter per slot.
//!
//!     cargo run --release --example async_kv

use std::error::Error;
use std::net::SocketAddr;

use stag::verbs::r#async::{AsyncCompletionQueue, AsyncListener, AsyncQueuePair};
use stag::verbs::{self, Access, ConnectOptions, Context, MemoryRegion, Remote};

type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;

const SLOTS: usize = 256;
const SLOT: usize = 256;
const COUNTERS: usize = SLOTS * SLOT;
const TABLE: usize = COUNTERS + SLOTS * 8;
const CLIENTS: usize = 4;
/// The counter every client bumps once per key.
const HITS: usize = 0;

const RIGHTS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC)
    .union(Access::FLUSH_PERSISTENT);

/// A client's view of the store: its QP, a scratch region, the table.
struct KvClient {
    qp: AsyncQueuePair,
    scratch: MemoryRegion,
    table: Remote,
}

impl KvClient {
    fn at(&self, offset: usize) -> Remote {
        Remote {
            rkey: self.table.rkey,
            addr: self.table.addr + offset as u64,
        }
    }

    /// PUT: Write the slot, then Commit it: durable when this returns.
    async fn put(&self, key: usize, value: &[u8]) -> Res<()> {
        if value.len() > SLOT - 8 {
            return Err("value too large".into());
        }
        let slot = (key % SLOTS) * SLOT;
        self.scratch
            .write_at(0, &(value.len() as u64).to_le_bytes())?;
        self.scratch.write_at(8, value)?;
        let len = 8 + value.len();
        self.qp
            .write(&[self.scratch.slice(0, len)?], self.at(slot))
            .await?;
        self.qp.commit(self.at(slot), len as u32).await?;
        Ok(())
    }

    /// GET: one Read of the slot.
    async fn get(&self, key: usize) -> Res<Vec<u8>> {
        let slot = (key % SLOTS) * SLOT;
        self.qp
            .read(&[self.scratch.slice(SLOT, SLOT)?], self.at(slot))
            .await?;
        let len = (self.scratch.load_u64(SLOT)? as usize).min(SLOT - 8);
        Ok(self.scratch.to_vec(SLOT + 8, len)?)
    }

    /// INCR: FetchAdd on the key's counter; the value before.
    async fn incr(&self, key: usize, by: u64) -> Res<u64> {
        let at = self.at(COUNTERS + (key % SLOTS) * 8);
        let result = self.scratch.slice(2 * SLOT, 8)?;
        self.qp.fetch_add(&result, at, by).await?;
        Ok(self.scratch.load_u64(2 * SLOT)?)
    }
}

/// The server: accept clients, send each the table's place. Nothing else.
async fn serve(
    ctx: Context,
    pd: verbs::ProtectionDomain,
    listener: AsyncListener,
    table: MemoryRegion,
) -> Res<()> {
    let cq = AsyncCompletionQueue::new(ctx.create_cq(64)?)?;
    let hello = pd.alloc_mr(16, Access::LOCAL_WRITE)?;
    let remote = table.remote(0);
    hello.write_at(0, &remote.addr.to_le_bytes())?;
    hello.write_at(8, &(remote.rkey as u64).to_le_bytes())?;
    let mut goodbyes = Vec::new();
    for _ in 0..CLIENTS {
        let (qp, _) = listener
            .accept(&pd, &cq, &ConnectOptions::default())
            .await?;
        // The client's goodbye, posted before it can know the table.
        goodbyes.push(qp.recv(&[]));
        qp.send(&[hello.slice(0, 16)?]).await?;
    }
    // Stay up until every client said goodbye (an Immediate Data): a
    // RoCE peer's going is not seen by an idle QP.
    for bye in goodbyes {
        bye.await?;
    }
    Ok(())
}

async fn client(device: String, addr: SocketAddr, id: usize) -> Res<(usize, u64)> {
    let ctx = Context::open(&device)?;
    let pd = ctx.alloc_pd()?;
    let cq = AsyncCompletionQueue::new(ctx.create_cq(64)?)?;
    let scratch = pd.alloc_mr(4 * SLOT, Access::LOCAL_WRITE)?;
    let hello = pd.alloc_mr(16, Access::LOCAL_WRITE)?;
    let hello_slice = hello.slice(0, 16)?;
    let pre = move |qp: &verbs::QueuePair| qp.post_recv(0, &[hello_slice]);
    let (qp, _) =
        verbs::r#async::connect_with(&pd, &cq, addr, &ConnectOptions::default(), pre).await?;
    // The server's first message lands in the receive posted before the
    // connection existed: wait for it on the raw CQ.
    let first = loop {
        let mut out = Vec::new();
        std::future::poll_fn(|cx| cq.poll_drain(cx, &mut out, 1)).await?;
        if let Some(c) = out.pop() {
            break c;
        }
    };
    if !first.is_ok() {
        return Err("no table from the server".into());
    }
    let table = Remote {
        addr: hello.load_u64(0)?,
        rkey: hello.load_u64(8)? as u32,
    };
    let kv = KvClient { qp, scratch, table };
    let mut checked = 0;
    for i in 0..20 {
        let key = 1 + id * 20 + i;
        let value = format!("value {i} of client {id}");
        kv.put(key, value.as_bytes()).await?;
        let back = kv.get(key).await?;
        if back != value.as_bytes() {
            return Err(format!("{key}: read back {:?}", String::from_utf8_lossy(&back)).into());
        }
        checked += 1;
        kv.incr(HITS, 1).await?;
    }
    let hits = kv.incr(HITS, 0).await?;
    kv.qp.imm(0).await?;
    Ok((checked, hits))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Res<()> {
    let device = verbs::default_device();
    let addr: SocketAddr = match std::env::var("STAG_ADDR") {
        Ok(a) => format!("{a}:0").parse()?,
        Err(_) => "127.0.0.1:0".parse()?,
    };
    let ctx = Context::open(&device)?;
    let pd = ctx.alloc_pd()?;
    let path = std::env::temp_dir().join(format!("stag-async-kv-{}", std::process::id()));
    let table = pd.alloc_file_mr(&path, TABLE, RIGHTS)?;
    let listener = AsyncListener::bind(&ctx, addr)?;
    let addr = listener.local_addr()?;
    println!(
        "kv server on {device} at {addr}; table in {}",
        path.display()
    );
    let server = tokio::spawn(serve(ctx, pd, listener, table.clone()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|id| tokio::spawn(client(device.clone(), addr, id)))
        .collect();
    let mut keys = 0;
    for c in clients {
        let (checked, hits) = c.await??;
        keys += checked;
        println!("client done: {checked} keys put durably and read back, hits then {hits}");
    }
    server.await??;
    // The server's table, as the clients left it, without the server's
    // CPU having touched a byte of it.
    let hits = table.load_u64(COUNTERS + HITS * 8)?;
    let on_disk = std::fs::read(&path)?;
    let first = &on_disk[SLOT + 8..SLOT + 8 + 19];
    println!(
        "hits counter {hits}; key 1 on disk: {:?}",
        String::from_utf8_lossy(first)
    );
    drop(table);
    let _ = std::fs::remove_file(&path);
    if keys != CLIENTS * 20 || hits != keys as u64 || first != b"value 0 of client 0" as &[u8] {
        return Err("the store does not hold what the clients wrote".into());
    }
    println!("all done");
    Ok(())
}
