//! The post path allocates nothing in steady state when SGEs are posted by
//! reference (`QueuePair::post_send` of a `SendWrRef`, `post_recv_ref`),
//! and neither does a completion channel wait: counted with a global
//! allocator that counts the calling thread's allocations during the calls.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::os::fd::AsFd;
use std::sync::mpsc;
use std::time::Duration;

use common::Side;
use provider::cq::CompletionQueue;
use provider::device::Device;
use provider::engine::Progress;
use provider::setup::MpaParams;
use provider::wr::{InlineWr, SendOp, SendWrRef, WcStatus, WorkCompletion};

struct Counting;

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    /// This thread's counted allocations: per thread, so that tests
    /// running in parallel do not count each other's.
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: defers to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCS.with(|n| n.set(n.get() + 1));
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        if COUNTING.with(Cell::get) {
            ALLOCS.with(|n| n.set(n.get() + 1));
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations `f` makes on this thread.
fn allocations(f: impl FnOnce()) -> usize {
    let before = ALLOCS.with(Cell::get);
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    ALLOCS.with(Cell::get) - before
}

/// A Send with no solicited event or invalidation.
const SEND: SendOp = SendOp::Send {
    solicited: false,
    invalidate: None,
};

/// Allocations of `post` in steady state: 20 rounds of `post(base)`
/// (counted) then `exchange(base)` (not counted) warm queues, pools and
/// buffers up to their working size, and the next 20 rounds are counted.
/// `base` is the round's first WR id, 16 apart.
fn steady_state_allocations(mut post: impl FnMut(u64), mut exchange: impl FnMut(u64)) -> usize {
    let mut round = |r: u64| {
        let n = allocations(|| post(r * 16));
        exchange(r * 16);
        n
    };
    for r in 0..20 {
        round(r);
    }
    (20..40).map(round).sum()
}

#[test]
fn posting_by_reference_allocates_nothing_in_steady_state() {
    let (a, b) = common::pair();
    let sges = [a.mr.sge(0, 8), a.mr.sge(64, 8)];
    let op = SendOp::Write {
        remote: b.mr.remote(0),
    };
    let post = |wr_id| {
        let wr = SendWrRef {
            wr_id,
            op,
            sg_list: &sges,
            signaled: true,
            fence: false,
        };
        a.qp.post_send(wr).expect("post");
    };
    // Warm up: queues, pools and buffers reach their working size.
    for round in 0..20u64 {
        for i in 0..64 {
            post(round * 64 + i);
        }
        a.wait(64);
    }
    let mut counted = 0;
    for round in 0..20u64 {
        counted += allocations(|| {
            for i in 0..64 {
                post(10_000 + round * 64 + i);
            }
        });
        a.wait(64);
    }
    assert_eq!(counted, 0, "allocations on the post path");

    // The counter works: the owned path's caller allocates its list.
    let owned = allocations(|| {
        a.qp.post_send(provider::wr::SendWr {
            wr_id: 1,
            op,
            sg_list: sges.to_vec(),
            signaled: true,
            fence: false,
        })
        .expect("post");
    });
    assert!(owned >= 1);
    a.wait(1);
}

/// A receive posted by reference (`QueuePair::post_recv_ref`) reuses the
/// SGE list of a receive that completed: reposting what a Send took, as a
/// ping-pong does between a message and its answer, allocates nothing.
#[test]
fn reposting_receives_by_reference_allocates_nothing_in_steady_state() {
    let (a, b) = common::pair();
    let sges = [b.mr.sge(0, 32), b.mr.sge(64, 32)];
    // Each round: 16 receives posted, taken by 16 Sends, completed.
    let counted = steady_state_allocations(
        |base| {
            for i in 0..16 {
                b.qp.post_recv_ref(base + i, &sges).expect("post_recv");
            }
        },
        |base| {
            for i in 0..16 {
                a.post(base + i, SEND, vec![a.mr.sge(0, 8)]);
            }
            a.wait(16);
            let got = b.wait(16);
            assert!(got.iter().all(|wc| wc.status == WcStatus::Success));
        },
    );
    assert_eq!(counted, 0, "allocations reposting receives");

    // The counter works: the owned path's caller allocates its list.
    let owned = allocations(|| {
        b.qp.post_recv(provider::wr::RecvWr {
            wr_id: 1,
            sg_list: sges.to_vec(),
        })
        .expect("post_recv");
    });
    assert!(owned >= 1);
}

/// Receives posted to an SRQ by reference (`Srq::post_recv_ref`) reuse the
/// SGE lists of receives that completed on any of its QPs, which hand
/// them back at their next take: an SRQ reposted as its receives are
/// used allocates nothing.
#[test]
fn reposting_srq_receives_by_reference_allocates_nothing_in_steady_state() {
    let dev = provider::device::Device::open("srq-alloc").unwrap();
    let pd = dev.alloc_pd();
    let srq = std::sync::Arc::new(provider::srq::Srq::new(64, 2));
    let servers: Vec<Side> = (0..2).map(|_| Side::in_pd(&pd, Some(&srq))).collect();
    let clients: Vec<Side> = (0..2).map(|_| Side::new(None)).collect();
    for (c, s) in clients.iter().zip(&servers) {
        common::connect_with(c, s, MpaParams::default(), MpaParams::default());
    }
    let sges = [servers[0].mr.sge(0, 32), servers[0].mr.sge(64, 32)];
    // Each round: 16 receives posted, taken by 8 Sends from each client
    // (one per QP of the SRQ), completed.
    let counted = steady_state_allocations(
        |base| {
            for i in 0..16 {
                srq.post_recv_ref(base + i, &sges).expect("post_srq_recv");
            }
        },
        |base| {
            for i in 0..8 {
                for c in &clients {
                    c.post(base + i, SEND, vec![c.mr.sge(0, 8)]);
                }
            }
            let mut got = Vec::new();
            for (c, s) in clients.iter().zip(&servers) {
                c.wait(8);
                got.extend(s.wait(8));
            }
            assert!(got.iter().all(|wc| wc.status == WcStatus::Success));
            assert!(srq.is_empty());
        },
    );
    assert_eq!(counted, 0, "allocations reposting SRQ receives");

    // The counter works: the owned path's caller allocates its list.
    let owned = allocations(|| {
        srq.post_recv(provider::wr::RecvWr {
            wr_id: 1,
            sg_list: sges.to_vec(),
        })
        .expect("post_srq_recv");
    });
    assert!(owned >= 1);
}

/// Inline posts (`PostGuard::push_inline`) copy their payload into the QP's
/// inline slots, made at the first inline post: none after that.
#[test]
fn posting_inline_allocates_nothing_in_steady_state() {
    let (a, b) = common::pair();
    let op = SendOp::Write {
        remote: b.mr.remote(0),
    };
    let mut payload = [0u8; 100];
    let mut post = |wr_id: u64| {
        payload.fill(wr_id as u8);
        let mut guard = a.qp.start_post();
        guard
            .push_inline(InlineWr {
                wr_id,
                op,
                data: &[&payload[..60], &payload[60..]],
                signaled: true,
                fence: false,
            })
            .expect("post");
        guard.post();
    };
    for round in 0..20u64 {
        for i in 0..64 {
            post(round * 64 + i);
        }
        a.wait(64);
    }
    let mut counted = 0;
    for round in 0..20u64 {
        counted += allocations(|| {
            for i in 0..64 {
                post(10_000 + round * 64 + i);
            }
        });
        a.wait(64);
    }
    assert_eq!(counted, 0, "allocations on the inline post path");
}

/// Allocations a waiting thread makes in each of its steady-state waits:
/// `wait(i)` sleeps until the Send `100 + i`, which the peer posts once
/// the waiter is (most likely) asleep on the socket, has completed. 200
/// waits warm up, the next 200 are counted. `a` and `b` are connected,
/// in `mode`.
fn allocations_per_wait(mode: Progress, wait: impl Fn(&Side, u64)) -> usize {
    const ROUNDS: u64 = 200;
    let a = Side::on(&Device::open_with("client", mode).unwrap(), None);
    let b = Side::on(&Device::open_with("server", mode).unwrap(), None);
    common::connect_with(&a, &b, MpaParams::default(), MpaParams::default());
    for i in 0..2 * ROUNDS {
        b.recv(100 + i, 4096, 64);
    }
    let (go, sends) = mpsc::channel::<u64>();
    std::thread::scope(|s| {
        let a = &a;
        s.spawn(move || {
            for i in sends {
                std::thread::sleep(Duration::from_micros(200));
                let op = SendOp::Send {
                    solicited: false,
                    invalidate: None,
                };
                a.post(i, op, vec![a.mr.sge(0, 8)]);
                a.wait(1);
            }
        });
        let round = |i: u64| {
            go.send(i).unwrap();
            allocations(|| wait(&b, i))
        };
        for i in 0..ROUNDS {
            round(i);
        }
        let counted = (ROUNDS..2 * ROUNDS).map(round).sum();
        drop(go);
        counted
    })
}

/// Take the completion of the peer's Send `100 + i` from `b`'s CQ through
/// `CompletionQueue::wait`, and check it.
fn take_send(b: &Side, i: u64) {
    let mut wc = [WorkCompletion::BLANK];
    let got = b.cq.wait(&mut wc, Duration::from_secs(10));
    assert_eq!(
        (got, wc[0].wr_id, wc[0].status),
        (1, 100 + i, WcStatus::Success)
    );
}

/// A completion channel wait (`CompletionQueue::wait_notified`, under the
/// plugin's `ibv_get_cq_event`) that the peer's Send wakes allocates
/// nothing in steady state: its QPs, poll set and sleepers stay on the
/// stack. qperf's rc_lat makes one such wait per message.
#[test]
fn a_channel_wait_woken_by_a_send_allocates_nothing_in_steady_state() {
    let n = allocations_per_wait(Progress::default(), |b, i| {
        b.cq.req_notify(false);
        let woke = CompletionQueue::wait_notified(
            b.cq.as_fd(),
            std::slice::from_ref(&b.cq),
            Some(Duration::from_secs(10)),
            &|| false,
        )
        .expect("wait");
        assert!(woke, "Send {i}: no notification in 10 s");
        b.cq.ack_events();
        take_send(b, i);
    });
    assert_eq!(n, 0, "allocations in 200 channel waits");
}

/// The same for `CompletionQueue::wait` (verbs' `cq.wait`), whose thread
/// sleeps on the sockets itself on a blocking device and on the CQ's
/// wake-up fd otherwise.
#[test]
fn a_cq_wait_woken_by_a_send_allocates_nothing_in_steady_state() {
    for mode in [Progress::Blocking, Progress::default()] {
        let n = allocations_per_wait(mode, take_send);
        assert_eq!(n, 0, "{mode:?}: allocations in 200 CQ waits");
    }
}
