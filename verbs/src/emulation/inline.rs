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

use std::cell::Cell;
use std::sync::Mutex;

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

thread_local! {
    /// The buffer of this thread's last inline post, for its next one:
    /// an inline post allocates nothing once a thread has made one. With
    /// a `Box` per post, its `malloc` and `free` made an 8-octet inline
    /// Write's post ~260 instructions dearer than posting the slice
    /// (callgrind, `stag lat write`), where the provider's inline framing
    /// is ~220 cheaper than its gather (#20).
    static SPARE: Cell<Option<Box<Inline>>> = const { Cell::new(None) };
}

/// An inline payload on its way to the backend, in a buffer of its own
/// (boxed: a [`super::Queued`] moves several times, and 264 octets moved
/// with it were memory copies). The buffer goes back to the thread's
/// spare when the post is done with it.
pub(super) struct Gathered(Option<Box<Inline>>);

impl Gathered {
    /// Gather `wr`'s payload: Sends and Writes only, at most
    /// [`MAX_INLINE`] bytes.
    pub(super) fn gather(wr: &WorkRequest<'_>) -> Result<Gathered> {
        if !wr.op.sends_payload() {
            return Err(Error::InvalidRequest("only Sends and Writes go inline"));
        }
        let len: usize = wr.local.iter().map(|s| s.len() as usize).sum();
        if len > MAX_INLINE {
            return Err(Error::InvalidRequest(
                "inline payload over MAX_INLINE bytes",
            ));
        }
        // Only `buf[..len]` is read, and all of it is written below: a
        // reused buffer needs no clearing.
        let mut inline = SPARE
            .try_with(Cell::take)
            .ok()
            .flatten()
            .unwrap_or_else(|| {
                Box::new(Inline {
                    buf: [0; MAX_INLINE],
                    len: 0,
                })
            });
        inline.len = len;
        let mut at = 0;
        for s in wr.local {
            let n = s.len() as usize;
            s.mr().read_at(s.offset(), &mut inline.buf[at..at + n])?;
            at += n;
        }
        Ok(Gathered(Some(inline)))
    }
}

impl std::ops::Deref for Gathered {
    type Target = Inline;

    fn deref(&self) -> &Inline {
        self.0.as_deref().expect("a gathered payload until dropped")
    }
}

impl Drop for Gathered {
    fn drop(&mut self) {
        if let Some(inline) = self.0.take() {
            // After the thread's locals are gone (a post from a TLS
            // destructor) it is simply freed.
            let _ = SPARE.try_with(|spare| spare.set(Some(inline)));
        }
    }
}

impl Inline {
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

    /// An inline post reuses its thread's last buffer (no allocation per
    /// post), never one still in use, and gathers the new WR's bytes
    /// whatever the reused buffer held: only the new payload is posted.
    #[test]
    fn a_thread_reuses_its_inline_buffer_once_it_is_free() {
        let ctx = Context::open_with(crate::device::USERSPACE_DEVICE, &ContextOptions::default())
            .unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
        mr.write_at(0, b"a longer first payload").unwrap();
        mr.write_at(64, b"short").unwrap();
        let (first, second) = (mr.slice(0, 22).unwrap(), mr.slice(64, 5).unwrap());
        let send = SendOp::Send {
            solicited: false,
            invalidate: None,
        };
        let address = |g: &super::Gathered| g.bytes().as_ptr() as usize;
        let a = super::Gathered::gather(&WorkRequest::new(1, send, &[first])).unwrap();
        let b = super::Gathered::gather(&WorkRequest::new(2, send, std::slice::from_ref(&second)))
            .unwrap();
        assert_ne!(address(&a), address(&b), "a buffer in use is not shared");
        assert_eq!(a.bytes(), b"a longer first payload");
        assert_eq!(b.bytes(), b"short");
        let at = address(&a);
        drop(a);
        // Were it freed, the allocator would hand its memory to the next
        // allocation of its size: this one.
        let _hog = Box::new(std::mem::MaybeUninit::<super::Inline>::uninit());
        let c = super::Gathered::gather(&WorkRequest::new(3, send, &[second])).unwrap();
        assert_eq!(address(&c), at, "the freed buffer is taken again");
        assert_eq!(c.bytes(), b"short", "only the new payload");
    }

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
