//! The RDMAP receive path on arbitrary octets: a `Connection` after a real
//! MPA exchange (the first input octet picks CRC, markers, role, RTR model
//! and IRD; the second the chunk size), with a Read, an atomic, a Commit, a
//! Send and three receives posted, fed the rest as its TCP stream.
//! `provider::testing::run` checks the invariants: no panic, the canaries
//! around the registered middle of the region intact, every error we find
//! sent as a Terminate naming it, all we transmit parseable, and every WR
//! completed exactly once once the stream closes.
#![no_main]

use std::ptr::NonNull;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use provider::mem::MrTable;
use provider::region::Region;
use provider::testing;

struct Target {
    mem: MrTable,
    region: Region,
}

impl Target {
    fn register(&self) {
        let base = self.region.as_ptr().as_ptr().wrapping_add(testing::CANARY);
        let base = NonNull::new(base).expect("mapping");
        loop {
            // SAFETY: `base..base+MIDDLE` lies inside `self.region`, which
            // lives in the same static as `self.mem` and is never unmapped.
            let stag = unsafe {
                self.mem.register(
                    testing::PD,
                    base,
                    testing::IOVA,
                    testing::MIDDLE as u64,
                    testing::ACCESS,
                    false,
                )
            }
            .expect("register");
            // Seeds name a fixed STag: draw keys until it comes up.
            if stag == testing::STAG {
                return;
            }
            self.mem.deregister(stag).expect("deregister");
        }
    }
}

static TARGET: OnceLock<Target> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let t = TARGET.get_or_init(|| {
        let t = Target {
            mem: MrTable::new(),
            region: Region::anonymous(testing::REGION_LEN).expect("region"),
        };
        t.register();
        t
    });
    // A Send with Invalidate may have invalidated it last time.
    if !t.mem.is_valid(testing::STAG) {
        t.register();
    }
    testing::run(&t.mem, &t.region, data);
});
