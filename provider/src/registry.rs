//! The device's QPs, in one registry, and the progress policies that act on
//! several of them for a thread that polls a CQ ([`Device::poll_cq`]):
//!
//! - **sweep**: a poll that finds its CQ empty, right after one that found
//!   it empty too (a thread spins on it), also progresses, once, the
//!   device's QPs whose CQs no thread polled for [`IDLE_FOR`] (with
//!   `try_progress`, so a QP another thread is driving is left to it). A
//!   hardware RNIC answers RDMA Reads and atomics without the host; here
//!   some thread has to read the socket. A program that busy-polls one CQ
//!   while a QP on another CQ only answers (perftest's READ/ATOMIC latency
//!   server spins on the CQ of its rdma_cm side channel) would otherwise
//!   need three running threads on a two-process loopback test, the two
//!   spinning ones and the server's engine; on two cores the engine is the
//!   one that waits for a core, and every request pays for it. The
//!   spinning thread becomes the responder, and the engine parks those QPs
//!   (it sees an application thread driving them). A program that polls
//!   many CQs in turn (`stag bw --qps 1024`, one CQ per QP) polls each
//!   within that time and has none swept: were "not polled since the last
//!   sweep" the test, each empty poll would drive nearly every other QP
//!   (0.38× the message rate at 1024 QPs). Nor does it spin: it reaps
//!   each CQ until one poll finds it empty and moves on, and a round of
//!   1024 visits can take longer than the idle time; sweeping on that
//!   one empty poll drove every other QP again (0.16 Mpps against 0.9).
//! - **assist** ([`crate::assist`]): a poll that reaps an RDMA Write's
//!   completion keeps driving that QP for a short adaptive window, unless
//!   the program polls the QP's CQs while it waits.
//!
//! Both front ends poll through [`Device::poll_cq`]: a C program through
//! the plugin's `ibv_poll_cq`, a Rust one through verbs' userspace backend.
//!
//! Deregistration walks the same registry to find the output that still
//! reads a region.
//!
//! [`Device::poll_cq`]: crate::device::Device::poll_cq

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use crate::assist::{Assist, Outcome};
use crate::cq::{CompletionQueue, CqQp, PollMark};
use crate::driver::QpShared;
use crate::mem::PdId;
use crate::qpn_map::QpnMap;

/// How long a QP's CQs go unpolled before the sweep drives it.
pub(crate) const IDLE_FOR: Duration = Duration::from_millis(10);

/// The fewest registrations between two prunes.
const MIN_PRUNE_GAP: usize = 16;

/// One QP as the registry knows it.
#[derive(Debug)]
struct Entry {
    qp: Weak<QpShared>,
    assist: Arc<Assist>,
    /// Its CQs' poll counts (held here, so that a sweep reads them without
    /// taking a reference to the QP).
    send: Arc<PollMark>,
    recv: Arc<PollMark>,
    /// Its CQs' poll counts at the previous sweep.
    swept: AtomicU64,
    /// When a sweep last saw them change (ns since the registry's epoch).
    seen_at: AtomicU64,
}

/// The registry's tables.
#[derive(Debug, Default)]
struct Qps {
    /// Every QP, by number.
    by_qpn: QpnMap<Entry>,
    /// The numbers of each protection domain's QPs (dead ones until the
    /// next prune): a deregistration visits its domain's QPs alone, not
    /// every QP of the device (1024 deregistrations of 1024 QPs were a
    /// million visits, 3 % of a 1024-QP run).
    by_pd: HashMap<PdId, Vec<u32>>,
}

/// The QPs of one device, by number.
#[derive(Debug)]
pub(crate) struct QpRegistry {
    qps: RwLock<Qps>,
    /// Registrations left before the next prune of dead entries: pruning
    /// on every creation made setting up n QPs cost n² (a walk of all of
    /// them each time); pruning once the map may have doubled keeps it
    /// amortised O(1) per QP and the map within twice the live QPs.
    until_prune: AtomicUsize,
    /// Bumped (under the write lock) by every registration, from 1: a CQ
    /// whose sweep found every QP on itself skips its sweeps until it
    /// changes (`PollMark::all_mine_at`).
    generation: AtomicU64,
    /// The time base of `Entry::seen_at`.
    epoch: Instant,
    idle_for: Duration,
}

impl Default for QpRegistry {
    fn default() -> Self {
        QpRegistry::with_idle(IDLE_FOR)
    }
}

impl QpRegistry {
    /// A registry whose sweep drives QPs unpolled for `idle_for`.
    pub(crate) fn with_idle(idle_for: Duration) -> QpRegistry {
        QpRegistry {
            qps: RwLock::default(),
            until_prune: AtomicUsize::new(0),
            generation: AtomicU64::new(0),
            epoch: Instant::now(),
            idle_for,
        }
    }

    /// Make a new QP known; forgotten once it is gone.
    pub(crate) fn register(&self, qp: &Arc<QpShared>, assist: Arc<Assist>) {
        let mut qps = self.qps.write().unwrap_or_else(|p| p.into_inner());
        // Under the write lock: the countdown needs no stronger ordering.
        let left = self.until_prune.load(Ordering::Relaxed);
        if left == 0 {
            let Qps { by_qpn, by_pd } = &mut *qps;
            by_qpn.retain(|_, e| e.qp.strong_count() > 0);
            by_pd.retain(|_, qpns| {
                qpns.retain(|qpn| by_qpn.contains_key(qpn));
                !qpns.is_empty()
            });
            self.until_prune
                .store(by_qpn.len().max(MIN_PRUNE_GAP), Ordering::Relaxed);
        } else {
            self.until_prune.store(left - 1, Ordering::Relaxed);
        }
        self.generation.fetch_add(1, Ordering::Relaxed);
        qps.by_pd.entry(qp.pd).or_default().push(qp.qpn);
        qps.by_qpn.insert(
            qp.qpn,
            Entry {
                qp: Arc::downgrade(qp),
                assist,
                send: qp.send_cq.mark().clone(),
                recv: qp.recv_cq.mark().clone(),
                // Matches no real count at first: a new QP is swept only
                // after its CQs have been seen idle for `idle_for`.
                swept: AtomicU64::new(u64::MAX),
                seen_at: AtomicU64::new(0),
            },
        );
    }

    /// Whether a sweep has looked at QP `qpn` yet.
    #[cfg(test)]
    pub(crate) fn swept_yet(&self, qpn: u32) -> bool {
        let qps = self.qps.read().unwrap_or_else(|p| p.into_inner());
        qps.by_qpn
            .get(&qpn)
            .is_some_and(|e| e.swept.load(Ordering::Relaxed) != u64::MAX)
    }

    /// The QPs alive now.
    #[cfg(test)]
    pub(crate) fn live(&self) -> Vec<Arc<QpShared>> {
        let qps = self.qps.read().unwrap_or_else(|p| p.into_inner());
        qps.by_qpn.values().filter_map(|e| e.qp.upgrade()).collect()
    }

    /// The QPs of protection domain `pd` alive now.
    pub(crate) fn live_in(&self, pd: PdId) -> Vec<Arc<QpShared>> {
        let qps = self.qps.read().unwrap_or_else(|p| p.into_inner());
        let Some(qpns) = qps.by_pd.get(&pd) else {
            return Vec::new();
        };
        qpns.iter()
            .filter_map(|qpn| qps.by_qpn.get(qpn)?.qp.upgrade())
            // A number is reused only after 2³² creations; the domain
            // check keeps even that from mattering.
            .filter(|qp| qp.pd == pd)
            .collect()
    }

    /// The sweep: the thread polling `polling` found it empty; progress
    /// the QPs on other CQs that no thread polled for `idle_for`. Returns
    /// how many it progressed.
    pub(crate) fn sweep(&self, polling: &CompletionQueue) -> usize {
        let polling = polling.mark();
        // A program whose QPs are all on the CQ it spins on (one QP, one
        // CQ: every latency test) has nothing to sweep: no lock and no
        // walk per empty poll until a QP is created. The generation read
        // unlocked is at most as new as the table read below; a stale
        // match is one a creation after it breaks.
        let generation = self.generation.load(Ordering::Relaxed);
        if generation != 0 && polling.all_mine_at.load(Ordering::Relaxed) == generation {
            return 0;
        }
        let qps = self.qps.read().unwrap_or_else(|p| p.into_inner());
        let generation = self.generation.load(Ordering::Relaxed);
        let mut all_mine = true;
        let mut driven = 0;
        // Read the clock only for a QP off this CQ (a program with one CQ
        // pays no clock read per empty poll).
        let mut clock = None;
        let mut now = || *clock.get_or_insert_with(|| self.epoch.elapsed().as_nanos() as u64);
        let idle = self.idle_for.as_nanos() as u64;
        for e in qps.by_qpn.values() {
            if Arc::ptr_eq(&e.send, polling) || Arc::ptr_eq(&e.recv, polling) {
                // Polling this CQ already drove it.
                continue;
            }
            all_mine = false;
            let marks = e.send.get().wrapping_add(e.recv.get());
            if e.swept.load(Ordering::Relaxed) != marks {
                // Someone polls its CQs (or it is new): theirs to drive.
                e.swept.store(marks, Ordering::Relaxed);
                e.seen_at.store(now(), Ordering::Relaxed);
                continue;
            }
            if now().saturating_sub(e.seen_at.load(Ordering::Relaxed)) < idle {
                // Polled lately: its poller will be back.
                continue;
            }
            let Some(qp) = e.qp.upgrade() else {
                continue;
            };
            CqQp::try_progress(&*qp, true);
            driven += 1;
        }
        if all_mine {
            polling.all_mine_at.store(generation, Ordering::Relaxed);
        }
        driven
    }

    /// The assist: the polling thread just reaped a Write of QP `qpn` and
    /// left its CQ empty.
    pub(crate) fn after_write(&self, qpn: u32) -> Outcome {
        let found = {
            let qps = self.qps.read().unwrap_or_else(|p| p.into_inner());
            qps.by_qpn
                .get(&qpn)
                .and_then(|e| Some((e.qp.upgrade()?, e.assist.clone())))
        };
        let Some((qp, assist)) = found else {
            return Outcome::Skipped;
        };
        assist.after_write(
            || qp.try_progress_reading(),
            || CqQp::release_to_engine(&*qp),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::qp::QpCaps;

    /// A QP on CQs nobody polls is swept from another CQ's poller once its
    /// CQs have been seen idle; not while its own CQ is being polled, never
    /// from a poller of its own CQ, and not after it is gone (whose entry
    /// the next registration prunes). The assist finds QPs by number.
    #[test]
    fn sweeps_only_qps_nobody_polls() {
        let dev = Device::open("sweep-test").unwrap();
        let pd = dev.alloc_pd();
        let (mine, theirs) = (
            CompletionQueue::new(4).unwrap(),
            CompletionQueue::new(4).unwrap(),
        );
        let qp = pd.create_qp(QpCaps::default(), &theirs, &theirs, None);
        let reg = QpRegistry::with_idle(Duration::ZERO);
        reg.register(qp.shared(), Arc::default());
        assert_eq!(reg.sweep(&mine), 0, "new: its CQs not yet seen idle");
        assert_eq!(reg.sweep(&mine), 1, "idle since the last sweep");
        assert_eq!(reg.sweep(&mine), 1);
        theirs.mark().bump();
        assert_eq!(reg.sweep(&mine), 0, "its CQ was polled meanwhile");
        assert_eq!(reg.sweep(&mine), 1, "idle again");
        assert_eq!(reg.sweep(&theirs), 0, "its own poller never sweeps it");
        assert_eq!(reg.after_write(qp.qp_num() + 1000), Outcome::Skipped);
        let qpn = qp.qp_num();
        drop(qp);
        assert_eq!(reg.sweep(&mine), 0, "gone");
        assert_eq!(reg.after_write(qpn), Outcome::Skipped, "gone");
        let other = pd.create_qp(QpCaps::default(), &mine, &theirs, None);
        reg.register(other.shared(), Arc::default());
        assert_eq!(reg.live().len(), 1);
    }

    /// A CQ that every QP of the device is on has nothing to sweep: once a
    /// sweep found that, its next ones skip the walk, until a QP is
    /// registered (a QP on another CQ is then swept as before).
    #[test]
    fn a_cq_with_every_qp_skips_its_sweeps_until_a_qp_is_created() {
        let dev = Device::open("sweep-skip-test").unwrap();
        let pd = dev.alloc_pd();
        let (mine, theirs) = (
            CompletionQueue::new(4).unwrap(),
            CompletionQueue::new(4).unwrap(),
        );
        let reg = QpRegistry::with_idle(Duration::ZERO);
        let qp = pd.create_qp(QpCaps::default(), &mine, &mine, None);
        reg.register(qp.shared(), Arc::default());
        assert_eq!(mine.mark().all_mine_at.load(Ordering::Relaxed), 0);
        assert_eq!(reg.sweep(&mine), 0, "its own poller never sweeps it");
        let generation = reg.generation.load(Ordering::Relaxed);
        assert_eq!(mine.mark().all_mine_at.load(Ordering::Relaxed), generation);
        // Held for writing: a sweep that walked would wait for it forever.
        let table = reg.qps.write().unwrap();
        let skipped = std::thread::scope(|s| {
            let h = s.spawn(|| reg.sweep(&mine));
            let start = Instant::now();
            while !h.is_finished() && start.elapsed() < Duration::from_secs(5) {
                std::thread::yield_now();
            }
            let skipped = h.is_finished();
            // Released before the scope joins the sweep, finished or not.
            drop(table);
            skipped
        });
        assert!(
            skipped,
            "a sweep with nothing to sweep took the table's lock"
        );
        let other = pd.create_qp(QpCaps::default(), &theirs, &theirs, None);
        reg.register(other.shared(), Arc::default());
        assert_eq!(reg.sweep(&mine), 0, "new: its CQs not yet seen idle");
        assert_eq!(reg.sweep(&mine), 1, "a new QP on another CQ is swept");
        assert_ne!(
            mine.mark().all_mine_at.load(Ordering::Relaxed),
            reg.generation.load(Ordering::Relaxed)
        );
        assert_eq!(reg.sweep(&theirs), 0, "first seen by this sweep");
    }

    /// Dead entries are pruned now and then, not on every registration:
    /// the map stays within twice the live QPs (plus the minimum gap),
    /// and registering n QPs walks O(n) entries in all, not O(n²).
    #[test]
    fn dead_entries_are_pruned_in_amortised_constant_time() {
        let dev = Device::open("prune-test").unwrap();
        let pd = dev.alloc_pd();
        let cq = CompletionQueue::new(4).unwrap();
        let reg = QpRegistry::default();
        let mut kept = Vec::new();
        let mut prunes = 0;
        for i in 0..1000 {
            let qp = pd.create_qp(QpCaps::default(), &cq, &cq, None);
            if reg.until_prune.load(Ordering::Relaxed) == 0 {
                prunes += 1;
            }
            reg.register(qp.shared(), Arc::default());
            let len = reg.qps.read().unwrap().by_qpn.len();
            let live = kept.len() + 1;
            assert!(
                len <= 2 * live + MIN_PRUNE_GAP + 1,
                "registration {i}: {len} entries for {live} live QPs"
            );
            // Every third QP lives on; the rest die at once.
            if i % 3 == 0 {
                kept.push(qp);
            }
        }
        assert_eq!(reg.live().len(), kept.len());
        assert_eq!(reg.live_in(pd.id()).len(), kept.len());
        assert!(reg.live_in(pd.id() + 1).is_empty(), "another domain's");
        assert!(prunes <= 20, "{prunes} prunes for 1000 registrations");
        // All but one die: the map shrinks back at the next prune, which
        // comes within as many registrations as there were entries.
        kept.truncate(1);
        let before = reg.qps.read().unwrap().by_qpn.len();
        for _ in 0..=before {
            let qp = pd.create_qp(QpCaps::default(), &cq, &cq, None);
            reg.register(qp.shared(), Arc::default());
        }
        let len = reg.qps.read().unwrap().by_qpn.len();
        assert!(len < before, "{len} entries after a prune, {before} before");
        assert!(len <= MIN_PRUNE_GAP + 2, "{len} entries for 2 live QPs");
    }

    /// A QP whose CQ is polled now and then (one of many a program polls
    /// in turn) is not swept until it goes unpolled for `idle_for`.
    #[test]
    fn a_qp_polled_within_the_idle_time_is_not_swept() {
        let dev = Device::open("sweep-idle-test").unwrap();
        let pd = dev.alloc_pd();
        let (mine, theirs) = (
            CompletionQueue::new(4).unwrap(),
            CompletionQueue::new(4).unwrap(),
        );
        let qp = pd.create_qp(QpCaps::default(), &theirs, &theirs, None);
        let reg = QpRegistry::with_idle(Duration::from_secs(3600));
        reg.register(qp.shared(), Arc::default());
        for i in 0..100 {
            assert_eq!(reg.sweep(&mine), 0, "sweep {i}");
            if i % 10 == 0 {
                theirs.mark().bump();
            }
        }
        let reg = QpRegistry::with_idle(Duration::from_millis(20));
        reg.register(qp.shared(), Arc::default());
        assert_eq!(reg.sweep(&mine), 0, "new");
        assert_eq!(reg.sweep(&mine), 0, "seen idle for less than idle_for");
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(reg.sweep(&mine), 1, "unpolled for idle_for");
        theirs.mark().bump();
        assert_eq!(reg.sweep(&mine), 0, "polled again");
    }
}
