//! A distributed counter: several clients FetchAdd one 64-bit word in the
//! server's memory; the server's CPU never touches it. Every client sees a
//! distinct ticket and the final value is exact.
//!
//!     cargo run --release --example counter

mod common;

use common::*;
use stag::verbs::{CompletionKind, SendOp, WorkRequest};

const CLIENTS: usize = 4;
const TICKETS: u64 = 1000;

fn main() -> Res<()> {
    let server = End::open(4096)?;
    let clients: Vec<End> = (0..CLIENTS).map(|_| End::open(4096)).collect::<Res<_>>()?;
    let (_sqps, qps) = connect_clients(&server, &clients, |_| Ok(()))?;
    let counter = server.mr.remote(0);
    let mut tickets: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = clients
            .iter()
            .zip(&qps)
            .map(|(c, qp)| {
                s.spawn(move || -> Res<Vec<u64>> {
                    let mut mine = Vec::new();
                    for i in 0..TICKETS {
                        let op = SendOp::FetchAdd {
                            remote: counter,
                            add: 1,
                            mask: 0,
                        };
                        qp.post_send(WorkRequest::new(i, op, &[c.mr.slice(0, 8)?]))?;
                        match wait(&c.cq)?.kind {
                            CompletionKind::FetchAdd { original } => mine.push(original),
                            other => return Err(format!("unexpected {other:?}").into()),
                        }
                    }
                    Ok(mine)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().map_err(|_| "client panicked")?)
            .collect::<Res<Vec<_>>>()
            .map(|v| v.concat())
    })?;
    tickets.sort_unstable();
    let expected: Vec<u64> = (0..CLIENTS as u64 * TICKETS).collect();
    let total = server.mr.load_u64(0)?;
    println!(
        "{CLIENTS} clients × {TICKETS} FetchAdds on {}: counter = {total}, tickets unique and gap-free: {}",
        server.ctx.name(),
        tickets == expected
    );
    if total != CLIENTS as u64 * TICKETS || tickets != expected {
        return Err("counter lost or duplicated an update".into());
    }
    Ok(())
}
