//! RC loopback over rdma_cm on a real device (rxe0 / siw0 in the test VM).
//!
//! Run: `STAG_IBV_DEVICE=rxe0 STAG_IBV_ADDR=10.0.2.15 cargo test -p stag-verbs
//! --test ibv_loopback -- --ignored --nocapture`
//!
//! Two RC QPs in one process, connected through librdmacm on
//! `STAG_IBV_ADDR`; the client does RDMA WRITE, READ, SEND, SEND_WITH_IMM,
//! WRITE_WITH_IMM, and (when the device has atomics) FETCH_AND_ADD and
//! CMP_AND_SWP on the legacy path, then the `ibv_wr_*` path (write, inline
//! send, atomic write and flush where the device and rdma-core have them).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use verbs::ibv::{
    self, probe_wr_api, AccessFlags, AtomicCap, CmEventType, CmId, CompletionQueue, ConnParam,
    EventChannel, FlushLevel, FlushType, MemoryRegion, QpInitAttr, QueuePair, RecvWr, SendFlags,
    SendOp, SendOps, SendWr, Sge, WcOpcode, WorkCompletion,
};

const BUF: usize = 4096;

/// A page-aligned zeroed buffer the NIC may access; read through raw
/// pointers only.
struct DmaBuf {
    ptr: *mut u8,
}

impl DmaBuf {
    fn new() -> Self {
        // SAFETY: non-zero size, valid alignment.
        let ptr = unsafe { alloc_zeroed(Layout::from_size_align(BUF, 4096).unwrap()) };
        assert!(!ptr.is_null());
        DmaBuf { ptr }
    }
    fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= BUF);
        // SAFETY: in bounds; no outstanding WR targets this range when the
        // test writes it.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
    }
    fn read(&self, off: usize, len: usize) -> Vec<u8> {
        assert!(off + len <= BUF);
        // SAFETY: in bounds; volatile because the NIC writes it.
        (0..len)
            .map(|i| unsafe { self.ptr.add(off + i).read_volatile() })
            .collect()
    }
    fn read_u64(&self, off: usize) -> u64 {
        u64::from_ne_bytes(self.read(off, 8).try_into().unwrap())
    }
    fn write_u64(&self, off: usize, v: u64) {
        self.write(off, &v.to_ne_bytes());
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in new() with this layout.
        unsafe { dealloc(self.ptr, Layout::from_size_align(BUF, 4096).unwrap()) };
    }
}

struct Side {
    id: CmId,
    cq: Arc<CompletionQueue>,
    qp: QueuePair,
    mr: MemoryRegion,
    buf: DmaBuf,
}

fn poll_n(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    let mut wcs = [WorkCompletion {
        wr_id: 0,
        status: ibv::WcStatus::Success,
        raw_status: 0,
        opcode: None,
        byte_len: 0,
        imm: None,
        qp_num: 0,
        vendor_err: 0,
        wc_flags: 0,
        invalidated_rkey: None,
    }; 8];
    while out.len() < n {
        let got = cq.poll(&mut wcs).expect("poll_cq");
        out.extend_from_slice(&wcs[..got]);
        assert!(
            Instant::now() < deadline,
            "timeout: {} of {n} completions: {out:?}",
            out.len()
        );
        if got == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    for wc in &out {
        assert!(
            wc.is_ok(),
            "completion failed: {wc:?} ({})",
            wc.status.as_str()
        );
    }
    out
}

fn setup(id: CmId, caps: &QpInitAttr, access: AccessFlags) -> Side {
    let ctx = id.context().expect("cm id has a device");
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let cq = ctx.create_cq(64, None, 0).expect("create_cq");
    let qp = id.create_qp(&pd, &cq, &cq, caps).expect("rdma_create_qp");
    let buf = DmaBuf::new();
    // SAFETY: buf lives in Side next to mr and is dropped after it (field
    // order: mr before buf).
    let mr = unsafe { pd.reg_mr(buf.ptr, BUF, access) }.expect("reg_mr");
    Side {
        id,
        cq,
        qp,
        mr,
        buf,
    }
}

fn sge(s: &Side, off: usize, len: u32) -> Sge {
    Sge::from_mr(&s.mr, off, len).unwrap()
}

fn post_one(s: &Side, wr_id: u64, op: SendOp, sges: &[Sge]) {
    let wr = SendWr {
        wr_id,
        op,
        sges,
        flags: SendFlags::SIGNALED,
    };
    // SAFETY: SGEs lie in s.mr, which outlives the completion we poll for.
    unsafe { s.qp.post_send(&[wr]) }
        .map_err(|(e, i)| format!("{e} at {i}"))
        .unwrap();
    let wc = poll_n(&s.cq, 1);
    assert_eq!(wc[0].wr_id, wr_id);
}

fn post_recvs(s: &Side, n: u64) {
    for i in 0..n {
        let sges = [sge(s, 2048 + (i as usize) * 64, 64)];
        // SAFETY: SGEs lie in s.mr (LOCAL_WRITE), alive for the test.
        unsafe {
            s.qp.post_recv(&[RecvWr {
                wr_id: 1000 + i,
                sges: &sges,
            }])
        }
        .map_err(|(e, _)| e)
        .unwrap();
    }
}

#[test]
#[ignore = "needs an RDMA device: set STAG_IBV_DEVICE and STAG_IBV_ADDR and run with --ignored (the VM does)"]
fn rc_loopback_over_rdma_cm() {
    // STAG_IBV_* name the device on purpose; the suite's STAG_DEVICE /
    // STAG_ADDR do as well when they name a libibverbs device.
    let var = |ibv: &str, generic: &str| {
        std::env::var(ibv).or_else(|_| {
            std::env::var(generic).and_then(|v| {
                if v == verbs::device::USERSPACE_DEVICE {
                    Err(std::env::VarError::NotPresent)
                } else {
                    Ok(v)
                }
            })
        })
    };
    let (Ok(dev), Ok(addr)) = (
        var("STAG_IBV_DEVICE", "STAG_DEVICE"),
        var("STAG_IBV_ADDR", "STAG_ADDR"),
    ) else {
        // Only run on purpose (it is #[ignore]d): without a device named
        // there is nothing to test, which must not look like a pass.
        panic!("ibv_loopback needs STAG_IBV_DEVICE and STAG_IBV_ADDR (the VM run sets them)");
    };
    let ip: IpAddr = addr.parse().expect("STAG_IBV_ADDR is an IP address");
    let names: Vec<String> = ibv::devices()
        .expect("devices")
        .into_iter()
        .map(|d| d.name)
        .collect();
    assert!(names.contains(&dev), "device {dev} not in {names:?}");

    // Server: listen on ip:0.
    let ch_s = EventChannel::new().expect("server event channel");
    let listen = CmId::new(&ch_s).expect("listen id");
    listen.bind_addr(SocketAddr::new(ip, 0)).expect("bind");
    listen.listen(4).expect("listen");
    let port = listen.local_addr().expect("bound").port();

    // Client: resolve.
    let ch_c = EventChannel::new().expect("client event channel");
    let cid = CmId::new(&ch_c).expect("client id");
    cid.resolve_addr(None, SocketAddr::new(ip, port), 2000)
        .expect("resolve_addr");
    ch_c.expect(CmEventType::AddrResolved)
        .expect("ADDR_RESOLVED");
    cid.resolve_route(2000).expect("resolve_route");
    ch_c.expect(CmEventType::RouteResolved)
        .expect("ROUTE_RESOLVED");

    let attr = cid.context().unwrap().query_device().expect("query_device");
    println!("device attr: {attr:#?}");
    assert_eq!(attr.name, dev, "rdma_cm bound {ip} to another device");
    let wr = probe_wr_api(&cid.context().unwrap());
    let atomics = attr.atomic_cap != AtomicCap::None;
    let send_ops = wr.available().then(|| {
        let mut ops = if atomics {
            SendOps::BASIC_ATOMICS
        } else {
            SendOps::BASIC
        };
        if wr.atomic_write && attr.atomic_write {
            ops = ops | SendOps::ATOMIC_WRITE;
        }
        if wr.flush && attr.flush_global {
            ops = ops | SendOps::FLUSH;
        }
        ops
    });
    let caps = QpInitAttr {
        max_send_wr: 32,
        max_recv_wr: 32,
        max_send_sge: 2,
        max_recv_sge: 1,
        max_inline_data: 64,
        sq_sig_all: false,
        send_ops,
    };
    let mut access =
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    if atomics {
        access |= AccessFlags::REMOTE_ATOMIC;
    }
    if attr.flush_global {
        access |= AccessFlags::FLUSH_GLOBAL;
    }
    let rd = attr
        .max_qp_rd_atom
        .min(attr.max_qp_init_rd_atom)
        .clamp(1, 16) as u8;

    let client = setup(cid, &caps, access);
    let mut pd_c = client.mr.addr().to_le_bytes().to_vec();
    pd_c.extend_from_slice(&client.mr.rkey().to_le_bytes());
    client
        .id
        .connect(&ConnParam {
            private_data: pd_c.clone(),
            responder_resources: rd,
            initiator_depth: rd,
            retry_count: 7,
            rnr_retry_count: 7,
        })
        .expect("rdma_connect");

    // Server: accept with its own addr/rkey as private data.
    let mut req = ch_s
        .expect(CmEventType::ConnectRequest)
        .expect("CONNECT_REQUEST");
    assert!(req.is_for(&listen));
    assert_eq!(
        req.private_data.get(..12),
        Some(&pd_c[..]),
        "client private data"
    );
    let server = setup(req.new_id.take().unwrap(), &caps, access);
    post_recvs(&server, 8);
    let mut pd_s = server.mr.addr().to_le_bytes().to_vec();
    pd_s.extend_from_slice(&server.mr.rkey().to_le_bytes());
    server
        .id
        .accept(&ConnParam {
            private_data: pd_s.clone(),
            responder_resources: rd,
            initiator_depth: rd,
            retry_count: 7,
            rnr_retry_count: 7,
        })
        .expect("rdma_accept");
    let est = ch_c
        .expect(CmEventType::Established)
        .expect("client ESTABLISHED");
    assert_eq!(
        est.private_data.get(..12),
        Some(&pd_s[..]),
        "server private data"
    );
    ch_s.expect(CmEventType::Established)
        .expect("server ESTABLISHED");

    let raddr = server.mr.addr();
    let rkey = server.mr.rkey();

    // RDMA WRITE.
    client.buf.write(0, b"stag rdma write!");
    post_one(
        &client,
        1,
        SendOp::RdmaWrite {
            rkey,
            remote_addr: raddr,
        },
        &[sge(&client, 0, 16)],
    );
    assert_eq!(server.buf.read(0, 16), b"stag rdma write!");

    // RDMA READ.
    server.buf.write(256, b"stag rdma read..");
    post_one(
        &client,
        2,
        SendOp::RdmaRead {
            rkey,
            remote_addr: raddr + 256,
        },
        &[sge(&client, 256, 16)],
    );
    assert_eq!(client.buf.read(256, 16), b"stag rdma read..");

    // SEND.
    client.buf.write(512, b"hello over send.");
    post_one(&client, 3, SendOp::Send, &[sge(&client, 512, 16)]);
    let wc = poll_n(&server.cq, 1);
    assert_eq!(
        (wc[0].opcode, wc[0].byte_len, wc[0].imm),
        (Some(WcOpcode::Recv), 16, None)
    );
    let slot = (wc[0].wr_id - 1000) as usize;
    assert_eq!(server.buf.read(2048 + slot * 64, 16), b"hello over send.");

    if attr.transport == ibv::Transport::Iwarp {
        // iWARP has no Immediate Data (siw's post_send answers -EINVAL):
        // the verb must fail, and fail without posting anything.
        client.buf.write(600, b"write+imm");
        for op in [
            SendOp::SendWithImm { imm: 0xdead_beef },
            SendOp::RdmaWriteWithImm {
                rkey,
                remote_addr: raddr + 600,
                imm: 0x0102_0304,
            },
        ] {
            let sges = [sge(&client, 600, 9)];
            let wr = SendWr {
                wr_id: 4,
                op,
                sges: &sges,
                flags: SendFlags::SIGNALED,
            };
            // SAFETY: SGEs lie in client.mr, alive for the test.
            let err = unsafe { client.qp.post_send(&[wr]) }
                .expect_err("iWARP has no Immediate Data")
                .0;
            assert!(err.errno == libc::EINVAL || err.is_unsupported(), "{err}");
        }
        println!("immediate data: refused by {dev} (iWARP), as expected");
        assert!(client.cq.poll_one().unwrap().is_none());
        assert_eq!(server.buf.read(600, 9), [0u8; 9]);
    } else {
        // SEND_WITH_IMM.
        post_one(
            &client,
            4,
            SendOp::SendWithImm { imm: 0xdead_beef },
            &[sge(&client, 512, 4)],
        );
        let wc = poll_n(&server.cq, 1);
        assert_eq!(
            (wc[0].opcode, wc[0].imm),
            (Some(WcOpcode::Recv), Some(0xdead_beef))
        );

        // RDMA_WRITE_WITH_IMM.
        client.buf.write(600, b"write+imm");
        post_one(
            &client,
            5,
            SendOp::RdmaWriteWithImm {
                rkey,
                remote_addr: raddr + 600,
                imm: 0x0102_0304,
            },
            &[sge(&client, 600, 9)],
        );
        let wc = poll_n(&server.cq, 1);
        assert_eq!(
            (wc[0].opcode, wc[0].imm),
            (Some(WcOpcode::RecvRdmaWithImm), Some(0x0102_0304))
        );
        assert_eq!(server.buf.read(600, 9), b"write+imm");
    }

    if atomics {
        server.buf.write_u64(1024, 5);
        post_one(
            &client,
            6,
            SendOp::FetchAdd {
                rkey,
                remote_addr: raddr + 1024,
                add: 3,
            },
            &[sge(&client, 1024, 8)],
        );
        assert_eq!(client.buf.read_u64(1024), 5);
        assert_eq!(server.buf.read_u64(1024), 8);
        post_one(
            &client,
            7,
            SendOp::CmpSwap {
                rkey,
                remote_addr: raddr + 1024,
                compare: 8,
                swap: 42,
            },
            &[sge(&client, 1032, 8)],
        );
        assert_eq!(client.buf.read_u64(1032), 8);
        assert_eq!(server.buf.read_u64(1024), 42);
    } else {
        println!("atomics: not supported by {dev} (atomic_cap NONE), skipped");
    }

    if client.qp.has_wr_api() {
        client.buf.write(1100, b"wr api write");
        let mut b = client.qp.start_wr().expect("ibv_wr_start");
        // SAFETY: SGE lies in client.mr, alive until the completion below.
        unsafe {
            b.push(
                20,
                SendFlags::SIGNALED,
                SendOp::RdmaWrite {
                    rkey,
                    remote_addr: raddr + 1100,
                },
                &[sge(&client, 1100, 12)],
            )
        }
        .expect("wr rdma_write");
        b.push_inline(21, SendFlags::SIGNALED, SendOp::Send, b"inline send")
            .expect("wr inline send");
        b.commit().expect("ibv_wr_complete");
        let wcs = poll_n(&client.cq, 2);
        assert_eq!(
            wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
            vec![20, 21]
        );
        let wc = poll_n(&server.cq, 1);
        let slot = (wc[0].wr_id - 1000) as usize;
        assert_eq!(server.buf.read(2048 + slot * 64, 11), b"inline send");
        assert_eq!(server.buf.read(1100, 12), b"wr api write");

        if client.qp.send_ops().contains(SendOps::ATOMIC_WRITE) {
            let mut b = client.qp.start_wr().unwrap();
            b.atomic_write(
                22,
                SendFlags::SIGNALED,
                rkey,
                raddr + 1200,
                0x1122_3344_5566_7788u64.to_ne_bytes(),
            )
            .expect("atomic_write");
            b.commit().expect("commit atomic write");
            poll_n(&client.cq, 1);
            assert_eq!(server.buf.read_u64(1200), 0x1122_3344_5566_7788);
        } else {
            println!(
                "atomic write: not available (rdma-core {} / device {})",
                ibv::HAS_WR_ATOMIC_WRITE,
                attr.atomic_write
            );
        }
        if client.qp.send_ops().contains(SendOps::FLUSH) {
            let mut b = client.qp.start_wr().unwrap();
            b.flush(
                23,
                SendFlags::SIGNALED,
                rkey,
                raddr,
                64,
                FlushType::Global,
                FlushLevel::Range,
            )
            .expect("flush");
            b.commit().expect("commit flush");
            let wc = poll_n(&client.cq, 1);
            assert_eq!(wc[0].opcode, Some(WcOpcode::Flush));
        } else {
            println!(
                "flush: not available (rdma-core {} / device {})",
                ibv::HAS_WR_FLUSH,
                attr.flush_global
            );
        }
        // A dropped batch is aborted, not posted.
        drop(client.qp.start_wr().unwrap());
    } else {
        println!("ibv_wr_* API: not supported by {dev}'s provider, skipped");
        assert_eq!(
            client.qp.start_wr().err().map(|e| e.is_unsupported()),
            Some(true)
        );
    }

    // Teardown.
    // The active side's DREQ reaches the server as DISCONNECTED; the
    // server's own rdma_disconnect answers it (DREP on IB/RoCE), which is
    // what completes the client's. Waiting for the client first would sit
    // out the DREQ timeout (~80 s on rxe).
    client.id.disconnect().expect("rdma_disconnect (client)");
    ch_s.expect(CmEventType::Disconnected)
        .expect("server DISCONNECTED");
    // iWARP may already have torn the connection down completely.
    if let Err(e) = server.id.disconnect() {
        println!("server rdma_disconnect after the peer's: {e}");
    }
    ch_c.expect(CmEventType::Disconnected)
        .expect("client DISCONNECTED");
    drop(client);
    drop(server);
    drop(listen);
}
