//! What every example needs: a server and a client connected on the
//! default device, in one process.

#![allow(dead_code)]

use std::error::Error;
use std::net::SocketAddr;
use std::time::Duration;

use stag::verbs::{
    self, Access, Completion, CompletionQueue, ConnectOptions, Context, Listener, MemoryRegion,
    ProtectionDomain, QueuePair,
};

pub type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;

pub const RIGHTS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC)
    .union(Access::FLUSH_PERSISTENT);

pub struct End {
    pub ctx: Context,
    pub pd: ProtectionDomain,
    pub cq: CompletionQueue,
    pub mr: MemoryRegion,
}

impl End {
    pub fn open(len: usize) -> Res<End> {
        let ctx = Context::open_default()?;
        let pd = ctx.alloc_pd()?;
        let cq = ctx.create_cq(1024)?;
        let mr = pd.alloc_mr(len, RIGHTS)?;
        Ok(End { ctx, pd, cq, mr })
    }
}

pub fn listen_addr() -> Res<SocketAddr> {
    Ok(match std::env::var("STAG_ADDR") {
        Ok(a) => format!("{a}:0").parse()?,
        Err(_) => "127.0.0.1:0".parse()?,
    })
}

/// Accept `n` clients on `server`, each connecting from its own `End`;
/// `pre_post` runs on every server QP before its client learns of it.
pub fn connect_clients(
    server: &End,
    clients: &[End],
    pre_post: impl Fn(&QueuePair) -> verbs::Result<()> + Sync,
) -> Res<(Vec<QueuePair>, Vec<QueuePair>)> {
    let listener = Listener::bind(&server.ctx, listen_addr()?)?;
    let addr = listener.local_addr()?;
    let opts = ConnectOptions::default();
    let mut sqps = Vec::new();
    let mut cqps = Vec::new();
    for c in clients {
        let (s, q) = std::thread::scope(|scope| -> Res<_> {
            let h = scope.spawn(|| {
                listener
                    .get_request()
                    .and_then(|r| r.accept_with(&server.pd, &server.cq, &opts, &pre_post))
            });
            let client = verbs::connect(&c.pd, &c.cq, addr, &opts);
            let server = h.join().map_err(|_| "server thread panicked")?;
            // A failed accept shows at the client only as a timeout: say
            // what the server saw.
            match (server, client) {
                (Ok(s), Ok((q, _))) => Ok((s, q)),
                (Err(se), Ok(_)) => Err(format!("accept: {se}").into()),
                (Ok(_), Err(ce)) => Err(format!("connect: {ce}").into()),
                (Err(se), Err(ce)) => Err(format!("accept: {se}; connect: {ce}").into()),
            }
        })?;
        sqps.push(s);
        cqps.push(q);
    }
    Ok((sqps, cqps))
}

pub fn wait(cq: &CompletionQueue) -> Res<Completion> {
    let c = cq
        .poll_one(Duration::from_secs(10))?
        .ok_or("no completion within 10 s")?;
    if !c.is_ok() {
        return Err(format!("work request {} failed: {}", c.wr_id, c.status.as_str()).into());
    }
    Ok(c)
}
