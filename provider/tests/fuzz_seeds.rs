//! The `conn_rx` fuzz target's harness run in CI: every seed (valid peer
//! streams for each opcode) gives the expected outcome, and a few thousand
//! deterministic mutations of them keep every invariant. With
//! `STAG_WRITE_SEEDS=1` the seeds are also written to `fuzz/seeds/conn_rx/`.

use std::ptr::NonNull;

use provider::mem::MrTable;
use provider::region::Region;
use provider::testing::{self, Outcome};

/// The table and region `testing::run` expects: the middle registered as
/// `testing::STAG`.
struct Target {
    mem: MrTable,
    region: Region,
}

impl Target {
    fn new() -> Target {
        let t = Target {
            mem: MrTable::new(),
            region: Region::anonymous(testing::REGION_LEN).unwrap(),
        };
        t.register();
        t
    }

    fn register(&self) {
        let base = self.region.as_ptr().as_ptr().wrapping_add(testing::CANARY);
        let base = NonNull::new(base).unwrap();
        for _ in 0..100_000 {
            // SAFETY: `base..base+MIDDLE` lies inside `self.region`, which
            // lives as long as `self.mem` (same struct, table dropped first).
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
            .unwrap();
            if stag == testing::STAG {
                return;
            }
            self.mem.deregister(stag).unwrap();
        }
        panic!("never drew the STag key");
    }

    fn run(&self, data: &[u8]) -> Outcome {
        if !self.mem.is_valid(testing::STAG) {
            self.register();
        }
        testing::run(&self.mem, &self.region, data)
    }
}

#[test]
fn seeds_give_the_expected_outcomes() {
    let t = Target::new();
    let seeds = testing::seeds();
    assert!(seeds.len() >= 10);
    for (name, data) in &seeds {
        let o = t.run(data);
        if *name == "rfc5040_refuses_requests" {
            // The Read Request is served; the Atomic Request after it
            // draws Terminate (RDMAP, remote operation, Unexpected OpCode).
            let c = o.sent.expect("our Terminate");
            assert_eq!(
                (c.etype, c.ecode),
                (provider::wire::ErrorType::RdmapRemoteOperation, 0x06)
            );
            assert!(o.frames >= 2, "{name}: {o:?}");
            continue;
        }
        assert_eq!(o.sent, None, "{name}: {o:?}");
        match *name {
            "terminate" => {
                let c = o.received.expect("peer Terminate");
                assert_eq!((c.etype, c.ecode), (testing::SEED_TERMINATE, 0x03));
            }
            n if n.starts_with("all") => {
                assert_eq!(o.received, None, "{name}");
                let mut s = o.succeeded.clone();
                s.sort_unstable();
                assert_eq!(s, [1, 2, 3, 10, 11, 12, 13], "{name}: {o:?}");
            }
            "send" | "send_invalidate" | "immediate" => {
                assert!(o.succeeded.contains(&1), "{name}: {o:?}")
            }
            "commit_response" => {
                assert!(o.succeeded.starts_with(&[10, 11, 12]), "{name}: {o:?}")
            }
            "requests" => assert!(o.frames >= 6, "{name}: responses went out: {o:?}"),
            _ => {}
        }
    }
    if std::env::var_os("STAG_WRITE_SEEDS").is_some() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/conn_rx");
        std::fs::create_dir_all(&dir).unwrap();
        for (name, data) in &seeds {
            std::fs::write(dir.join(name), data).unwrap();
        }
    }
}

/// A small deterministic fuzzer over the seeds: flips, truncations,
/// splices, re-chunking and flag changes. Any broken invariant panics
/// inside `testing::run`.
#[test]
fn mutated_seeds_keep_every_invariant() {
    let t = Target::new();
    let seeds = testing::seeds();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut terminated = 0;
    for i in 0..3000 {
        let (_, seed) = &seeds[i % seeds.len()];
        let mut d = seed.clone();
        for _ in 0..=(rnd() % 4) {
            let len = d.len().max(1);
            match rnd() % 6 {
                0 => {
                    let at = (rnd() as usize) % len;
                    if at < d.len() {
                        d[at] ^= 1 << (rnd() % 8);
                    }
                }
                1 => d.truncate((rnd() as usize) % len),
                2 => {
                    let at = (rnd() as usize) % len;
                    if at < d.len() {
                        d[at] = rnd() as u8;
                    }
                }
                3 => {
                    let (_, other) = &seeds[(rnd() as usize) % seeds.len()];
                    let from = 2 + (rnd() as usize) % (other.len() - 2);
                    d.extend_from_slice(&other[from..]);
                }
                4 => {
                    if d.len() > 1 {
                        d[1] = rnd() as u8;
                    }
                }
                _ => {
                    if !d.is_empty() {
                        d[0] ^= 1 << (rnd() % 6);
                    }
                }
            }
        }
        if t.run(&d).sent.is_some() {
            terminated += 1;
        }
    }
    assert!(
        terminated > 100,
        "mutations reach the error paths ({terminated})"
    );
}
