//! A durable append-only log in a file-backed region of the server: the
//! client writes each record after the current tail, Commits it (the bytes
//! reach the file before the Commit completes), then advances the tail
//! word with an atomic and Commits that too. A reader that finds tail = N
//! in the file knows the first N bytes of records are durable.
//!
//!     cargo run --release --example durable_log

mod common;

use common::*;
use stag::verbs::{CompletionKind, SendOp, WorkRequest};

/// The tail word lives at offset 0; records start at 64.
const HEADER: u64 = 64;

fn main() -> Res<()> {
    let path = std::env::temp_dir().join(format!("stag-log-{}.bin", std::process::id()));
    let server = End::open(4096)?;
    let log = server.pd.alloc_file_mr(&path, 1 << 20, RIGHTS)?;
    let client = End::open(1 << 16)?;
    let (_sqps, qps) = connect_clients(&server, std::slice::from_ref(&client), |_| Ok(()))?;
    let qp = &qps[0];
    let c = &client;

    let records = ["first entry", "second, longer entry", "third"];
    let mut tail = 0u64;
    for (i, rec) in records.iter().enumerate() {
        let id = i as u64 * 10;
        // Length-prefixed record, written where the tail says.
        let mut bytes = (rec.len() as u32).to_le_bytes().to_vec();
        bytes.extend_from_slice(rec.as_bytes());
        c.mr.write_at(0, &bytes)?;
        let at = log.remote((HEADER + tail) as usize);
        qp.post_send(WorkRequest::new(
            id,
            SendOp::Write { remote: at },
            &[c.mr.slice(0, bytes.len())?],
        ))?;
        qp.post_send(WorkRequest::new(
            id + 1,
            SendOp::Commit {
                remote: at,
                len: bytes.len() as u32,
            },
            &[],
        ))?;
        wait(&c.cq)?;
        wait(&c.cq)?;
        // Publish: advance the tail atomically, then make the tail durable.
        let op = SendOp::FetchAdd {
            remote: log.remote(0),
            add: bytes.len() as u64,
            mask: 0,
        };
        qp.post_send(WorkRequest::new(id + 2, op, &[c.mr.slice(1024, 8)?]))?;
        let CompletionKind::FetchAdd { original } = wait(&c.cq)?.kind else {
            return Err("expected a FetchAdd completion".into());
        };
        tail = original + bytes.len() as u64;
        qp.post_send(WorkRequest::new(
            id + 3,
            SendOp::Commit {
                remote: log.remote(0),
                len: 8,
            },
            &[],
        ))?;
        wait(&c.cq)?;
        println!("appended {rec:?} at {original}, tail now {tail}");
    }

    // Read the file as a recovering process would.
    let file = std::fs::read(&path)?;
    let durable_tail = u64::from_le_bytes(file[..8].try_into()?);
    let mut at = HEADER as usize;
    let mut recovered = Vec::new();
    while at < (HEADER + durable_tail) as usize {
        let len = u32::from_le_bytes(file[at..at + 4].try_into()?) as usize;
        recovered.push(String::from_utf8_lossy(&file[at + 4..at + 4 + len]).into_owned());
        at += 4 + len;
    }
    println!("recovered from {}: {recovered:?}", path.display());
    drop(log);
    let _ = std::fs::remove_file(&path);
    if recovered != records {
        return Err("the log lost a committed record".into());
    }
    Ok(())
}
