//! A streaming consumer driven by Write with Immediate: the producer writes
//! each chunk into the consumer's ring and attaches 8 bytes of Immediate
//! Data (offset and length); the consumer learns of each chunk from its
//! receive completion, without polling the ring, and checks it.
//!
//!     cargo run --release --example stream

mod common;

use common::*;
use stag::verbs::{CompletionKind, SendOp, WorkRequest};

const RING: usize = 1 << 16;
const CHUNK: usize = 4096;
const CHUNKS: u64 = 200;
const CREDITS: u64 = 8;
/// Where the consumer reports progress in the producer's region.
const PROGRESS: usize = RING;

fn chunk_bytes(n: u64) -> Vec<u8> {
    (0..CHUNK).map(|i| (n as usize * 31 + i) as u8).collect()
}

fn main() -> Res<()> {
    // The ring, then one word past it for the consumer's progress.
    let consumer = End::open(RING + 4096)?;
    let producer = End::open(RING + 4096)?;
    // Each Immediate Data consumes a receive; keep CREDITS of them posted.
    let (sqps, pqps) = connect_clients(&consumer, std::slice::from_ref(&producer), |qp| {
        for i in 0..CREDITS {
            qp.post_recv(i, &[])?;
        }
        Ok(())
    })?;
    let (cqp, pqp) = (&sqps[0], &pqps[0]);
    std::thread::scope(|s| -> Res<()> {
        let producer_thread = s.spawn(|| -> Res<()> {
            for n in 0..CHUNKS {
                let slot = (n as usize * CHUNK) % RING;
                producer.mr.write_at(slot, &chunk_bytes(n))?;
                let imm = (slot as u64) << 32 | CHUNK as u64;
                let op = SendOp::WriteImm {
                    remote: consumer.mr.remote(slot),
                    imm,
                };
                pqp.post_send(WorkRequest::new(n, op, &[producer.mr.slice(slot, CHUNK)?]))?;
                wait(&producer.cq)?;
                // Flow control: never more chunks in flight than the ring
                // and the consumer's receives allow.
                if n + 1 >= CREDITS {
                    while consumer_seen(&producer)? + CREDITS <= n + 1 {
                        std::hint::spin_loop();
                    }
                }
            }
            Ok(())
        });
        let mut bytes = 0usize;
        for n in 0..CHUNKS {
            let c = wait(&consumer.cq)?;
            let CompletionKind::Recv { imm: Some(imm), .. } = c.kind else {
                return Err(format!("expected Immediate Data, got {c:?}").into());
            };
            let (slot, len) = ((imm >> 32) as usize, (imm & 0xffff_ffff) as usize);
            if consumer.mr.to_vec(slot, len)? != chunk_bytes(n) {
                return Err(format!("chunk {n} corrupt").into());
            }
            bytes += len;
            // Re-post the receive and tell the producer how far we got
            // (an RDMA Write of our progress into its region).
            cqp.post_recv(n + CREDITS, &[])?;
            consumer.mr.store_u64(PROGRESS, n + 1)?;
            let op = SendOp::Write {
                remote: producer.mr.remote(PROGRESS),
            };
            // Unsignaled: this CQ also carries the receive completions the
            // loop waits for.
            let progress = [consumer.mr.slice(PROGRESS, 8)?];
            cqp.post_send(WorkRequest::new(n, op, &progress).unsignaled())?;
        }
        producer_thread.join().map_err(|_| "producer panicked")??;
        println!(
            "consumed {CHUNKS} chunks, {bytes} bytes, all intact, driven by Write with Immediate"
        );
        Ok(())
    })
}

/// How many chunks the consumer reported done.
fn consumer_seen(producer: &End) -> Res<u64> {
    Ok(producer.mr.load_u64(PROGRESS)?)
}
