//! Criterion benches of the provider's per-frame and per-WR costs:
//! RDMAP parse/emit per frame type, CRC32c per KiB, Framer/Deframer per
//! FPDU, and post + poll per WR on a connected loopback pair.
//!
//! ```text
//! cargo bench -p stag-provider --bench wire
//! ```

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use provider::cq::CompletionQueue;
use provider::device::{Device, Listener, MemoryRegion, QueuePair};
use provider::mem::Access;
use provider::qp::QpCaps;
use provider::region::Region;
use provider::setup::MpaParams;
use provider::wire::atomic::AtomicOpcode;
use provider::wire::fpdu::Crc32c;
use provider::wire::rdmap::{RdmapRepr, SendKind};
use provider::wire::stream::{Deframer, DeframerConfig, Framer, FramerConfig};
use provider::wire::terminate::TerminateRepr;
use provider::wire::Error;
use provider::wr::{RecvWr, Remote, SendOp, SendWr, Sge, WorkCompletion};

fn frames() -> Vec<(&'static str, RdmapRepr)> {
    vec![
        (
            "write",
            RdmapRepr::Write {
                last: true,
                stag: 0x1234_5678,
                to: 0x7f00_0000_1000,
            },
        ),
        (
            "send",
            RdmapRepr::Send {
                kind: SendKind::Send,
                last: true,
                msn: 7,
                mo: 0,
                invalidate_stag: 0,
            },
        ),
        (
            "read_request",
            RdmapRepr::ReadRequest {
                msn: 3,
                sink_stag: 0x100,
                sink_to: 0x2000,
                size: 4096,
                src_stag: 0x200,
                src_to: 0x3000,
            },
        ),
        (
            "read_response",
            RdmapRepr::ReadResponse {
                last: true,
                stag: 0x100,
                to: 0x2000,
            },
        ),
        (
            "atomic_request",
            RdmapRepr::AtomicRequest {
                msn: 9,
                opcode: AtomicOpcode::FetchAdd,
                req_id: 42,
                stag: 0x300,
                to: 0x4000,
                add_swap: 1,
                add_swap_mask: 0,
                compare: 0,
                compare_mask: 0,
            },
        ),
        (
            "atomic_response",
            RdmapRepr::AtomicResponse {
                msn: 9,
                req_id: 42,
                original: 0xdead_beef,
            },
        ),
        (
            "terminate",
            RdmapRepr::Terminate({
                let mut t = TerminateRepr::for_error(&Error::DdpBaseBounds, None);
                t.msn = 1;
                t
            }),
        ),
    ]
}

fn rdmap(c: &mut Criterion) {
    let mut g = c.benchmark_group("rdmap");
    for (name, repr) in frames() {
        // Tagged and Send frames carry 8 payload bytes; the others none.
        let payload = match repr {
            RdmapRepr::Write { .. } | RdmapRepr::Send { .. } | RdmapRepr::ReadResponse { .. } => 8,
            _ => 0,
        };
        let mut buf = vec![0u8; repr.header_len() + payload];
        repr.emit(&mut buf[..repr.header_len()]);
        g.bench_function(BenchmarkId::new("emit", name), |b| {
            let mut out = [0u8; 128];
            b.iter(|| {
                let r = black_box(&repr);
                r.emit(&mut out[..r.header_len()]);
                black_box(&out);
            })
        });
        g.bench_function(BenchmarkId::new("parse", name), |b| {
            b.iter(|| black_box(RdmapRepr::parse(black_box(&buf)).unwrap()))
        });
    }
    g.finish();
}

fn crc(c: &mut Criterion) {
    let mut g = c.benchmark_group("crc32c");
    for len in [28usize, 256, 1024, 4096, 65536, 1 << 20] {
        let data = vec![0xa5u8; len];
        g.throughput(Throughput::Bytes(data.len() as u64));
        // The `crc32` instruction chain alone, and the length-dispatched
        // update the data path uses.
        g.bench_function(BenchmarkId::new("sse42", len), |b| {
            b.iter(|| black_box(crc32c::crc32c(black_box(&data))))
        });
        g.bench_function(BenchmarkId::new("update", len), |b| {
            b.iter(|| {
                let mut crc = Crc32c::new();
                crc.update(black_box(&data));
                black_box(crc.value())
            })
        });
    }
    g.finish();
}

fn fpdu(c: &mut Criterion) {
    let mut g = c.benchmark_group("fpdu");
    let header = {
        let r = RdmapRepr::Write {
            last: true,
            stag: 0x100,
            to: 0x1000,
        };
        let mut h = vec![0u8; r.header_len()];
        r.emit(&mut h);
        h
    };
    for (crc_on, markers) in [(true, false), (false, false), (true, true)] {
        for payload_len in [8usize, 16 * 1024, 65535 - 64] {
            if markers && payload_len > 16 * 1024 {
                // Markers push a full-size FPDU past the 16-bit limit.
                continue;
            }
            let tag = format!(
                "{}{}/{payload_len}B",
                if crc_on { "crc" } else { "nocrc" },
                if markers { "+markers" } else { "" }
            );
            let payload = vec![0x5au8; payload_len];
            let cfg = FramerConfig {
                crc: crc_on,
                markers,
            };
            // One stream of 64 identical FPDUs: markers land at different
            // offsets in each, as in a real stream.
            let mut framer = Framer::new(cfg);
            let mut stream = Vec::new();
            for _ in 0..64 {
                framer.frame(&[&header, &payload], &mut stream).unwrap();
            }
            g.throughput(Throughput::Bytes((stream.len() / 64) as u64));
            g.bench_function(BenchmarkId::new("frame", &tag), |b| {
                let mut framer = Framer::new(cfg);
                let mut out = Vec::with_capacity(payload_len + 1024);
                b.iter(|| {
                    out.clear();
                    framer
                        .frame(&[&header, black_box(&payload)], &mut out)
                        .unwrap();
                    black_box(&out);
                })
            });
            let dcfg = DeframerConfig {
                crc: crc_on,
                markers,
                max_ulpdu_len: u16::MAX,
            };
            g.bench_function(BenchmarkId::new("deframe", &tag), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    let mut left = iters;
                    while left > 0 {
                        let n = left.min(64);
                        let mut d = Deframer::new(dcfg);
                        let mut input: &[u8] = &stream;
                        let t = Instant::now();
                        for _ in 0..n {
                            let u = d.poll(&mut input).unwrap().unwrap();
                            black_box(u.len());
                        }
                        total += t.elapsed();
                        left -= n;
                    }
                    total
                })
            });
        }
    }
    g.finish();
}

// ---- post + poll on a connected pair ----

const ALL: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);

struct Side {
    _dev: Device,
    cq: Arc<CompletionQueue>,
    qp: QueuePair,
    mr: MemoryRegion,
}

fn side() -> Side {
    let dev = Device::open("bench").unwrap();
    let pd = dev.alloc_pd();
    let cq = CompletionQueue::new(8192).unwrap();
    let qp = pd.create_qp(QpCaps::default(), &cq, &cq, None);
    let region = Region::anonymous(1 << 20).unwrap();
    let iova = region.addr(0);
    let mr = pd.register(region, iova, ALL).unwrap();
    Side {
        _dev: dev,
        cq,
        qp,
        mr,
    }
}

fn pair() -> (Side, Side) {
    let (a, b) = (side(), side());
    let l = Listener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            l.accept()
                .unwrap()
                .accept(&b.qp, &MpaParams::default())
                .unwrap()
        });
        a.qp.connect(addr, &MpaParams::default()).unwrap();
        h.join().unwrap();
    });
    (a, b)
}

/// Post `batch` signaled WRs, then poll until all completed; time per WR.
fn post_poll(c: &mut Criterion) {
    let mut g = c.benchmark_group("post_poll");
    let (a, b) = pair();
    let sge = Sge {
        addr: a.mr.region().addr(0),
        length: 8,
        lkey: a.mr.stag(),
    };
    let remote = Remote {
        addr: b.mr.region().addr(0),
        rkey: b.mr.stag(),
    };
    let ops: Vec<(&str, SendOp)> = vec![
        ("write_8B", SendOp::Write { remote }),
        (
            "send_8B",
            SendOp::Send {
                solicited: false,
                invalidate: None,
            },
        ),
        ("read_8B", SendOp::Read { remote }),
    ];
    let batch = 16u64;
    let mut recv_posted = 0u64;
    for (name, op) in ops {
        g.throughput(Throughput::Elements(batch));
        g.bench_function(name, |bch| {
            let mut wcs = [WorkCompletion::BLANK; 16];
            bch.iter(|| {
                if matches!(op, SendOp::Send { .. }) {
                    // Keep the peer's receive queue stocked; its completions
                    // pile up on its CQ and are drained below.
                    while recv_posted < batch {
                        b.qp.post_recv(RecvWr {
                            wr_id: 0,
                            sg_list: vec![Sge {
                                addr: b.mr.region().addr(4096),
                                length: 8,
                                lkey: b.mr.stag(),
                            }],
                        })
                        .unwrap();
                        recv_posted += 1;
                    }
                }
                for i in 0..batch {
                    a.qp.post_send(SendWr {
                        wr_id: i,
                        op,
                        sg_list: vec![sge],
                        signaled: true,
                        fence: false,
                    })
                    .unwrap();
                }
                let mut done = 0;
                while done < batch as usize {
                    done += a.cq.poll(&mut wcs);
                    // The responder side: its application polls too.
                    let got = b.cq.poll(&mut wcs[..]);
                    recv_posted -= got as u64;
                }
            })
        });
    }
    // Drain what the peer still holds.
    let mut wcs = [WorkCompletion::BLANK; 16];
    while b.cq.poll(&mut wcs) > 0 {}
    g.finish();
}

criterion_group!(benches, rdmap, crc, fpdu, post_poll);
criterion_main!(benches);
