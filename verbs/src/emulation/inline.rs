//! Inline sends: the payload is gathered at post time, so the application
//! may rewrite its buffer at once.
//!
//! On stag0 the provider copies it into the QP's own inline slots
//! (`PostGuard::push_inline`, as siw's `siw_copy_inline_sgl`): the backend
//! gets the bytes ([`QpOps::copies_inline`]). A libibverbs device gets a
//! registered bounce slot of this QP instead, held by the WR's tracker
//! entry until its completion: its `max_inline_data` (if any) may be
//! smaller than [`MAX_INLINE`].
//!
//! [`QpOps::copies_inline`]: crate::backend::QpOps::copies_inline

use std::sync::Mutex;

use provider::wr::SendOp;

use super::QpCore;
use crate::error::{Error, Result};
use crate::mr::{Access, MemoryRegion, Slice};
use crate::wr::{WorkRequest, MAX_INLINE};

/// Inline payloads for a backend that does not copy them are copied here
/// at post time.
pub(super) struct Bounce {
    pub(super) mr: MemoryRegion,
    pub(super) free: Mutex<Vec<usize>>,
}

/// An inline WR's payload, gathered from its slices.
pub(super) struct Inline {
    buf: [u8; MAX_INLINE],
    len: usize,
}

impl Inline {
    /// Gather `wr`'s payload: Sends and Writes only, at most
    /// [`MAX_INLINE`] bytes.
    pub(super) fn gather(wr: &WorkRequest<'_>) -> Result<Inline> {
        if !matches!(
            wr.op,
            SendOp::Send { .. } | SendOp::Write { .. } | SendOp::WriteImm { .. }
        ) {
            return Err(Error::InvalidRequest("only Sends and Writes go inline"));
        }
        let len: usize = wr.local.iter().map(|s| s.len() as usize).sum();
        if len > MAX_INLINE {
            return Err(Error::InvalidRequest(
                "inline payload over MAX_INLINE bytes",
            ));
        }
        let mut inline = Inline {
            buf: [0; MAX_INLINE],
            len,
        };
        let mut at = 0;
        for s in wr.local {
            let n = s.len() as usize;
            s.mr().read_at(s.offset(), &mut inline.buf[at..at + n])?;
            at += n;
        }
        Ok(inline)
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl QpCore {
    /// Copy an inline payload into a bounce slot (a backend that does not
    /// copy inline data itself): the slice to post and the slot to free
    /// with the WR's entry.
    pub(super) fn bounce_copy(&self, data: &Inline) -> Result<(Slice, usize)> {
        let bounce = match self.bounce.get() {
            Some(b) => b,
            None => {
                let slots = self.max_send_wr.max(1) as usize;
                let mr = self.pd.alloc_mr(slots * MAX_INLINE, Access::LOCAL_WRITE)?;
                let _ = self.bounce.set(Bounce {
                    mr,
                    free: Mutex::new((0..slots).rev().collect()),
                });
                self.bounce.get().expect("just set")
            }
        };
        let slot = bounce
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .ok_or(Error::QueueFull)?;
        bounce.mr.write_at(slot * MAX_INLINE, data.bytes())?;
        Ok((bounce.mr.slice(slot * MAX_INLINE, data.len)?, slot))
    }

    pub(super) fn free_bounce(&self, slot: usize) {
        if let Some(b) = self.bounce.get() {
            b.free.lock().unwrap_or_else(|p| p.into_inner()).push(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::{
        Access, CompletionKind, ConnectOptions, Context, ContextOptions, Listener, SendOp,
        WcStatus, WorkRequest,
    };

    /// On stag0 an inline WR's payload goes into the provider's inline
    /// slots (`push_inline`): the QP never makes bounce slots, and each
    /// Send and Write, more than the send queue holds, carries the bytes
    /// of its post time.
    #[test]
    fn stag0_copies_inline_data_in_the_provider_without_bounce_slots() {
        let ctx = Context::open_with(crate::device::USERSPACE_DEVICE, &ContextOptions::default())
            .unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let (ccq, scq) = (ctx.create_cq(64).unwrap(), ctx.create_cq(64).unwrap());
        let all = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        let (cmr, smr) = (
            pd.alloc_mr(4096, all).unwrap(),
            pd.alloc_mr(1 << 16, all).unwrap(),
        );
        let listener = Listener::bind(&ctx, "127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let (server, client) = std::thread::scope(|s| {
            let h = s.spawn(|| {
                let req = listener.get_request().unwrap();
                req.accept_with(&pd, &scq, &ConnectOptions::default(), |_| Ok(()))
                    .unwrap()
            });
            let (qp, _) =
                crate::connect_with(&pd, &ccq, addr, &ConnectOptions::default(), |_| Ok(()))
                    .unwrap();
            (h.join().unwrap(), qp)
        });
        let wait = |cq: &crate::CompletionQueue| {
            cq.poll_one(Duration::from_secs(20))
                .unwrap()
                .expect("a completion within 20 s")
        };
        let depth = crate::QpCaps::default().max_send_wr as u64;
        let local = [cmr.slice(0, 200).unwrap()];
        for i in 0..depth + 8 {
            server.post_recv(i, &[smr.slice(0, 4096).unwrap()]).unwrap();
            cmr.write_at(0, &[i as u8; 200]).unwrap();
            let write = SendOp::write(smr.remote(8192));
            client
                .post_send(WorkRequest::new(2 * i, write, &local).inlined())
                .unwrap();
            client
                .post_send(WorkRequest::new(2 * i + 1, SendOp::send(), &local).inlined())
                .unwrap();
            // Rewritten at once: what left is what the WRs held at post.
            cmr.write_at(0, &[0xee; 200]).unwrap();
            for id in [2 * i, 2 * i + 1] {
                let c = wait(&ccq);
                assert_eq!((c.wr_id, c.status), (id, WcStatus::Success));
            }
            let got = wait(&scq);
            assert!(
                matches!(got.kind, CompletionKind::Recv { len: 200, .. }),
                "{got:?}"
            );
            assert_eq!(smr.to_vec(0, 200).unwrap(), [i as u8; 200], "Send {i}");
            assert_eq!(smr.to_vec(8192, 200).unwrap(), [i as u8; 200], "Write {i}");
        }
        assert!(client.core.bounce.get().is_none(), "bounce slots made");
    }
}
