//! RDMA Write latency the way perftest's `ib_write_lat` measures it, on
//! the userspace RNIC directly (no libibverbs, no plugin): each side spins
//! on the last byte of its own buffer for the peer's Write, then posts its
//! own and polls its send CQ until that Write completes. With `--drive`
//! the spin also polls the CQ between looks at memory (which drives the
//! QP from the spinning thread), as `stag lat write` does.
//!
//! It tells the plugin's own cost (perftest through `stag run` against
//! this, same method) apart from the method's (memory-only spinning, where
//! the progress engine must place every Write, against `--drive`).
//!
//! ```text
//! write_lat_raw server PORT ITERS [--drive]
//! write_lat_raw client ADDR:PORT ITERS [--drive]
//! ```
//!
//! The client prints the median, mean and 99th percentile of half the
//! round trip in µs (perftest's t_typical for ib_write_lat).

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use provider::cq::CompletionQueue;
use provider::device::{Device, QueuePair};
use provider::listener::Listener;
use provider::mem::Access;
use provider::qp::QpCaps;
use provider::setup::MpaParams;
use provider::wr::{Remote, SendOp, SendWr, Sge, WcStatus, WorkCompletion};

type Error = Box<dyn std::error::Error>;

/// One side's buffers: 8 bytes it sends from, 8 the peer writes.
#[repr(C, align(64))]
struct Bufs {
    tx: [u8; 64],
    rx: [u8; 64],
}

/// The buffer address and STag, as private data.
fn advert(addr: u64, stag: u32) -> Vec<u8> {
    let mut v = addr.to_be_bytes().to_vec();
    v.extend_from_slice(&stag.to_be_bytes());
    v
}

fn parse_advert(pd: &[u8]) -> Result<Remote, Error> {
    if pd.len() < 12 {
        return Err(format!("peer's private data is {} bytes, not 12", pd.len()).into());
    }
    Ok(Remote {
        addr: u64::from_be_bytes(pd[..8].try_into()?),
        rkey: u32::from_be_bytes(pd[8..12].try_into()?),
    })
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 4 {
        return Err(
            "usage: write_lat_raw server PORT ITERS [--drive] | client ADDR:PORT ITERS [--drive]"
                .into(),
        );
    }
    let iters: u32 = args[3].parse()?;
    let drive = args.iter().any(|a| a == "--drive");
    let dev = Device::open("stag0")?;
    let pd = dev.alloc_pd();
    let cq = CompletionQueue::new(64)?;
    let qp = pd.create_qp(QpCaps::default(), &cq, &cq, None);
    let bufs: &'static mut Bufs = Box::leak(Box::new(Bufs {
        tx: [0; 64],
        rx: [0; 64],
    }));
    let base = NonNull::from(&mut *bufs).cast::<u8>();
    // SAFETY: leaked, so valid for the rest of the process.
    let stag = unsafe {
        pd.reg_mr(
            base,
            std::mem::size_of::<Bufs>(),
            Access::LOCAL_WRITE.union(Access::REMOTE_WRITE),
            false,
        )?
    };
    let tx_addr = bufs.tx.as_ptr() as u64;
    let rx_ptr = bufs.rx.as_ptr().wrapping_add(7);
    let tx_ptr = bufs.tx.as_mut_ptr().wrapping_add(7);
    let mine = advert(bufs.rx.as_ptr() as u64, stag);
    let peer = match args[1].as_str() {
        "server" => {
            let l = Listener::bind(("127.0.0.1", args[2].parse::<u16>()?))?;
            let req = l.accept()?;
            let peer = parse_advert(&req.request().private_data)?;
            req.accept(
                &qp,
                &MpaParams {
                    private_data: mine,
                    ..MpaParams::default()
                },
            )?;
            peer
        }
        "client" => {
            let pd = qp.connect(
                &args[2],
                &MpaParams {
                    private_data: mine,
                    ..MpaParams::default()
                },
            )?;
            parse_advert(&pd)?
        }
        other => return Err(format!("unknown role {other}").into()),
    };
    let client = args[1] == "client";
    let side = Side {
        qp: &qp,
        cq: &cq,
        peer,
        stag,
        tx_addr,
        rx_ptr,
        tx_ptr,
        drive,
    };
    let mut stamps = Vec::with_capacity(iters as usize + 1);
    let deadline = Instant::now() + Duration::from_secs(60);
    for i in 1..=iters {
        let seq = i as u8;
        if !client || i > 1 {
            side.wait_byte(if client { seq.wrapping_sub(1) } else { seq }, deadline)?;
        }
        stamps.push(Instant::now());
        side.post(seq)?;
        side.reap_own(deadline)?;
    }
    if client {
        side.wait_byte(iters as u8, deadline)?;
        stamps.push(Instant::now());
        let mut half: Vec<f64> = stamps
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64() * 1e6 / 2.0)
            .collect();
        half.sort_by(f64::total_cmp);
        let mean = half.iter().sum::<f64>() / half.len() as f64;
        println!(
            "{} {:.2} {:.2} {:.2}",
            if drive { "drive" } else { "memory" },
            half[half.len() / 2],
            mean,
            half[half.len() * 99 / 100]
        );
    } else {
        // Keep the buffer registered until the client's last Write is in.
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// What one iteration needs.
struct Side<'a> {
    qp: &'a QueuePair,
    cq: &'a Arc<CompletionQueue>,
    peer: Remote,
    stag: u32,
    tx_addr: u64,
    rx_ptr: *const u8,
    tx_ptr: *mut u8,
    drive: bool,
}

impl Side<'_> {
    /// Spin until the peer's Write has set our last byte to `seq`.
    fn wait_byte(&self, seq: u8, deadline: Instant) -> Result<(), Error> {
        let mut spins = 0u32;
        // SAFETY: the leaked buffer; the RNIC writes it concurrently, so
        // every look is a volatile read.
        while unsafe { self.rx_ptr.read_volatile() } != seq {
            if self.drive {
                let mut wc = [WorkCompletion::BLANK; 4];
                self.cq.poll(&mut wc);
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) && Instant::now() > deadline {
                return Err("stalled waiting for the peer's Write".into());
            }
            std::hint::spin_loop();
        }
        Ok(())
    }

    fn post(&self, seq: u8) -> Result<(), Error> {
        // SAFETY: the leaked buffer, read by the RNIC only during the post.
        unsafe { self.tx_ptr.write_volatile(seq) };
        self.qp.post_send(SendWr {
            wr_id: u64::from(seq),
            op: SendOp::Write { remote: self.peer },
            sg_list: vec![Sge {
                addr: self.tx_addr,
                length: 8,
                lkey: self.stag,
            }],
            signaled: true,
            fence: false,
        })?;
        Ok(())
    }

    /// Poll the send CQ until our Write's completion (perftest polls until
    /// one arrives).
    fn reap_own(&self, deadline: Instant) -> Result<(), Error> {
        let mut wc = [WorkCompletion::BLANK; 1];
        loop {
            if self.cq.poll(&mut wc) == 1 {
                if wc[0].status != WcStatus::Success {
                    return Err(format!("Write failed: {:?}", wc[0].status).into());
                }
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err("stalled waiting for our Write's completion".into());
            }
        }
    }
}
