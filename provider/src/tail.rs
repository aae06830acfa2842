//! Holding back the short last segment of a post's output.
//!
//! An application that posts one large WR at a time (qperf's `rc_bw` and
//! `rc_rdma_write_bw`, fio's rdma engine) has each WR written by its own
//! `sendmsg`. A 64 KiB WR is two FPDUs, 65,608 octets on the wire, one
//! more than fits the loopback MSS (65,483): TCP sends a full segment and
//! a 125-octet one, which costs the sender a second trip through its
//! stack (and through the peer's, which loopback runs on the sender's
//! core) for 0.2 % of the bytes. A doorbell therefore writes only whole
//! segments when that leaves a short tail, and the tail goes out in front
//! of the next post's octets, as one stream of full segments.
//!
//! Nothing waits on the tail for long: any other drive of the QP writes
//! it (a poll of an empty CQ, the engine, a read), so does a wait before
//! it sleeps, and the engine writes it within [`TAIL_LIMIT`] if no thread
//! comes back to the provider. The WR whose octets it holds completes
//! once they are written, as every send WR does, so its buffer is never
//! reused under the held octets. Only a QP whose posts stream holds
//! ([`Streak`]). Measured (two processes, 4 alternating rounds, medians,
//! hold off → on): qperf -cm1 -m 64K `rc_bw` 2.62 → 3.0 GB/s,
//! `rc_rdma_write_bw` 2.6 → 3.1 GB/s, fio rdma write at iodepth 16 2.26 →
//! 3.05 GB/s.

use std::io::IoSlice;
use std::time::Duration;

/// The longest tail held back: a few packets' worth, so that what waits
/// is small next to what went.
pub(crate) const TAIL_MAX: usize = 4096;

/// How long a held tail waits for the next post before the engine writes
/// it (a program that posts and then waits outside the provider: on the
/// peer's answer in memory without polling its CQ, or in its own
/// `poll(2)`). The scale of the engine's other rechecks.
pub(crate) const TAIL_LIMIT: Duration = Duration::from_millis(1);

/// How often a doorbell reads the stream's segment size again (a
/// `getsockopt`; TCP changes it as the peer's window grows).
pub(crate) const MSS_REFRESH: Duration = Duration::from_millis(10);

/// TCP's minimum MSS (RFC 9293 §3.7.1): output no longer than this is
/// never held.
pub(crate) const MIN_MSS: usize = 536;

/// At most this many iovecs are cut (the output queue's own bound).
pub(crate) const IOV_CAP: usize = 64;

/// Posts without a hold after a held tail went out alone, before a post
/// holds one again; doubled at each tail in a row that goes out alone, up
/// to [`PROBATION_MAX`]. One: a stream's tail goes out alone now and then
/// (qperf's `rc_bw` found its CQ empty for 1 % of its posts), and a
/// longer first probation cost it most of its holds (64 posts each:
/// 38 % of posts held nothing).
pub(crate) const PROBATION: u32 = 1;

/// The longest probation: a program that never streams (qperf's
/// `rc_rdma_write_poll_lat` posts, polls its CQ once and then waits in
/// memory, so each tail it holds waits for [`TAIL_LIMIT`]) pays that once
/// per this many posts.
pub(crate) const PROBATION_MAX: u32 = 8192;

/// Whether this QP's posts stream. Holding a tail pays only when the
/// next post comes before anything else writes it: in a ping-pong (or
/// at a stream's end) a wait or a poll writes it instead, a second
/// `sendmsg` and a delay for nothing, and an engine deadline armed per
/// post (a wake-up each on a sleeping engine: `stag lat send -s 65536
/// --blocking` went from 63 to 102 µs typical). So after a tail went out
/// alone, posts go out whole for a probation ([`PROBATION`], doubling
/// while tails keep going out alone) before one tries again; a tail
/// merged into the next post keeps the QP holding.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Streak {
    /// The last tail held went out in front of the next post.
    merging: bool,
    /// Posts still to go out whole.
    probation: u32,
    /// Tails in a row that went out alone.
    alone: u32,
}

impl Streak {
    /// A post wrote the held tail in front of its own octets.
    pub(crate) fn merged(&mut self) {
        self.merging = true;
        self.probation = 0;
        self.alone = 0;
    }

    /// Something else wrote the held tail (a wait, a poll, the engine).
    pub(crate) fn ended(&mut self) {
        self.merging = false;
        self.probation = PROBATION
            .checked_shl(self.alone)
            .map_or(PROBATION_MAX, |p| p.min(PROBATION_MAX));
        self.alone = self.alone.saturating_add(1);
    }

    /// Whether this post may hold a tail (a post that may not counts
    /// down the probation).
    pub(crate) fn may_hold(&mut self) -> bool {
        if self.merging || self.probation == 0 {
            return true;
        }
        self.probation -= 1;
        false
    }
}

/// How many of `queued` octets to hold back at the end, for segments of
/// `mss` octets: the remainder after the whole segments, when there is
/// at least one whole segment and the remainder is short. `mss == 0`
/// (unknown) never holds.
pub(crate) fn tail_to_hold(queued: usize, mss: usize) -> usize {
    if mss == 0 || queued <= mss {
        return 0;
    }
    let rem = queued % mss;
    if rem <= TAIL_MAX.min(mss / 4) {
        rem
    } else {
        0
    }
}

/// The first `keep` octets of `iov`, in `out` (an array of [`IOV_CAP`]):
/// how many iovecs that takes.
pub(crate) fn cut<'a>(iov: &'a [IoSlice<'_>], keep: usize, out: &mut [IoSlice<'a>]) -> usize {
    let mut left = keep;
    let mut n = 0;
    for s in iov.iter().take(out.len()) {
        if left == 0 {
            break;
        }
        let take = s.len().min(left);
        out[n] = IoSlice::new(&s[..take]);
        n += 1;
        left -= take;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOOPBACK_MSS: usize = 65_483;

    #[test]
    fn a_64k_write_holds_its_125_octet_tail_on_loopback() {
        // Two FPDUs of a 65,536-octet Write: 65,608 octets on the wire.
        assert_eq!(tail_to_hold(65_608, LOOPBACK_MSS), 125);
        // The tail of the last post in front of the next WR: 250 held.
        assert_eq!(tail_to_hold(125 + 65_608, LOOPBACK_MSS), 250);
    }

    #[test]
    fn nothing_is_held_without_a_whole_segment_or_with_a_long_tail() {
        assert_eq!(tail_to_hold(8, LOOPBACK_MSS), 0);
        assert_eq!(tail_to_hold(LOOPBACK_MSS, LOOPBACK_MSS), 0);
        assert_eq!(tail_to_hold(2 * LOOPBACK_MSS, LOOPBACK_MSS), 0);
        assert_eq!(tail_to_hold(LOOPBACK_MSS + TAIL_MAX + 1, LOOPBACK_MSS), 0);
        assert_eq!(
            tail_to_hold(LOOPBACK_MSS + TAIL_MAX, LOOPBACK_MSS),
            TAIL_MAX
        );
        // An Ethernet MSS: at most a quarter of a segment waits.
        assert_eq!(tail_to_hold(1448 + 362, 1448), 362);
        assert_eq!(tail_to_hold(1448 + 363, 1448), 0);
        assert_eq!(tail_to_hold(1_000_000, 0), 0);
    }

    /// `n` posts go out whole, and the next may hold.
    fn sits_out(streak: &mut Streak, n: u32) {
        for _ in 0..n {
            assert!(!streak.may_hold());
        }
        assert!(streak.may_hold());
    }

    #[test]
    fn a_tail_that_went_out_alone_stops_holding_for_the_probation() {
        let mut streak = Streak::default();
        // First large post: tries.
        assert!(streak.may_hold());
        streak.merged();
        assert!(streak.may_hold());
        // A wait wrote the tail: the probation, then twice as long, and
        // so on up to the cap.
        streak.ended();
        sits_out(&mut streak, PROBATION);
        streak.ended();
        sits_out(&mut streak, 2 * PROBATION);
        for _ in 0..40 {
            streak.ended();
        }
        sits_out(&mut streak, PROBATION_MAX);
        // A merge ends the probation and its doubling.
        streak.merged();
        assert!(streak.may_hold());
        streak.ended();
        sits_out(&mut streak, PROBATION);
    }

    #[test]
    fn cut_keeps_the_first_octets_across_iovecs() {
        let a = [1u8; 10];
        let b = [2u8; 20];
        let c = [3u8; 5];
        let iov = [IoSlice::new(&a), IoSlice::new(&b), IoSlice::new(&c)];
        let mut out = [IoSlice::new(&[]); IOV_CAP];
        let n = cut(&iov, 25, &mut out);
        assert_eq!(n, 2);
        assert_eq!(out[0].len(), 10);
        assert_eq!(&*out[1], &[2u8; 15][..]);
        assert_eq!(cut(&iov, 35, &mut out), 3);
        assert_eq!(cut(&iov, 0, &mut out), 0);
    }
}
