//! The post path allocates nothing in steady state when SGEs are posted by
//! reference (`QueuePair::post_send` of a `SendWrRef`): counted with a global allocator
//! that counts the posting thread's allocations during the post calls.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use provider::wr::{InlineWr, SendOp, SendWrRef};

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
