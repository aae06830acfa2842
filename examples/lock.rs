//! A spin lock in the server's memory, taken with CmpSwap (0 → client id)
//! and released with CmpSwap (client id → 0). Inside the critical section
//! each client does a non-atomic read-modify-write (RDMA Read, then RDMA
//! Write) of a shared total: without mutual exclusion updates would be lost.
//!
//!     cargo run --release --example lock

mod common;

use common::*;
use stag::verbs::{CompletionKind, SendOp, WorkRequest};

const CLIENTS: usize = 3;
const ROUNDS: u64 = 100;

fn main() -> Res<()> {
    let server = End::open(4096)?;
    let clients: Vec<End> = (0..CLIENTS).map(|_| End::open(4096)).collect::<Res<_>>()?;
    let (_sqps, qps) = connect_clients(&server, &clients, |_| Ok(()))?;
    let (lock, total) = (server.mr.remote(0), server.mr.remote(8));
    let mut spins = 0u64;
    std::thread::scope(|s| -> Res<()> {
        let handles: Vec<_> = clients
            .iter()
            .zip(&qps)
            .enumerate()
            .map(|(id, (c, qp))| {
                s.spawn(move || -> Res<u64> {
                    let me = id as u64 + 1;
                    let mut spins = 0;
                    for round in 0..ROUNDS {
                        loop {
                            let op = SendOp::CmpSwap {
                                remote: lock,
                                compare: 0,
                                compare_mask: u64::MAX,
                                swap: me,
                                swap_mask: u64::MAX,
                            };
                            qp.post_send(WorkRequest::new(round, op, &[c.mr.slice(0, 8)?]))?;
                            if let CompletionKind::CmpSwap { swapped: true, .. } = wait(&c.cq)?.kind
                            {
                                break;
                            }
                            spins += 1;
                        }
                        // Critical section: read, increment, write back.
                        qp.post_send(WorkRequest::new(
                            round,
                            SendOp::Read { remote: total },
                            &[c.mr.slice(8, 8)?],
                        ))?;
                        wait(&c.cq)?;
                        let v = c.mr.load_u64(8)?;
                        c.mr.store_u64(16, v + 1)?;
                        qp.post_send(WorkRequest::new(
                            round,
                            SendOp::Write { remote: total },
                            &[c.mr.slice(16, 8)?],
                        ))?;
                        wait(&c.cq)?;
                        let release = SendOp::CmpSwap {
                            remote: lock,
                            compare: me,
                            compare_mask: u64::MAX,
                            swap: 0,
                            swap_mask: u64::MAX,
                        };
                        qp.post_send(WorkRequest::new(round, release, &[c.mr.slice(24, 8)?]))?;
                        match wait(&c.cq)?.kind {
                            CompletionKind::CmpSwap { swapped: true, .. } => {}
                            other => return Err(format!("lock stolen: {other:?}").into()),
                        }
                    }
                    Ok(spins)
                })
            })
            .collect();
        for h in handles {
            spins += h.join().map_err(|_| "client panicked")??;
        }
        Ok(())
    })?;
    let got = server.mr.load_u64(8)?;
    println!(
        "{CLIENTS} clients × {ROUNDS} critical sections: total = {got} (expected {}), {spins} failed acquisitions",
        CLIENTS as u64 * ROUNDS
    );
    if got != CLIENTS as u64 * ROUNDS {
        return Err("mutual exclusion violated".into());
    }
    Ok(())
}
