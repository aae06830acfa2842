//! Statistics over benchmark samples, computed the way perftest reports
//! them: min, max, typical (median), average, population standard
//! deviation and nearest-rank percentiles for latency; peak and average
//! bandwidth and message rate for bandwidth.

use serde::Serialize;

/// One latency result row (all times in microseconds, already divided by
/// the latency factor: 2 for ping-pong operations, 1 for round trips).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LatStats {
    /// Message size in bytes.
    pub bytes: u64,
    /// Measured iterations (warm-up excluded).
    pub iterations: u64,
    /// Smallest sample.
    pub t_min_us: f64,
    /// Largest sample.
    pub t_max_us: f64,
    /// Median (perftest's "typical").
    pub t_typical_us: f64,
    /// Mean.
    pub t_avg_us: f64,
    /// Population standard deviation.
    pub t_stdev_us: f64,
    /// 99th percentile (nearest rank).
    pub p99_us: f64,
    /// 99.9th percentile (nearest rank).
    pub p999_us: f64,
}

/// Nearest-rank percentile of sorted samples: the smallest sample such
/// that at least `p` of all samples are ≤ it. `p` in `0.0..=1.0`.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    assert!(!sorted.is_empty(), "percentile of no samples");
    let n = sorted.len();
    let rank = (p * n as f64).ceil() as usize;
    sorted[rank.clamp(1, n) - 1]
}

/// Median of sorted samples (mean of the middle two for an even count).
pub fn median(sorted: &[f64]) -> f64 {
    assert!(!sorted.is_empty(), "median of no samples");
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// Mean and population standard deviation.
pub fn mean_stdev(samples: &[f64]) -> (f64, f64) {
    assert!(!samples.is_empty(), "mean of no samples");
    let n = samples.len() as f64;
    let mean = samples.iter().sum::<f64>() / n;
    let var = samples.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// Samples in nanoseconds to microseconds divided by `factor`.
pub fn to_usec(samples_ns: &[u64], factor: f64) -> Vec<f64> {
    samples_ns
        .iter()
        .map(|&ns| ns as f64 / 1000.0 / factor)
        .collect()
}

impl LatStats {
    /// Statistics of `samples` (microseconds, any order).
    pub fn from_samples(bytes: u64, samples: &[f64]) -> LatStats {
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let (avg, stdev) = mean_stdev(&sorted);
        LatStats {
            bytes,
            iterations: sorted.len() as u64,
            t_min_us: sorted[0],
            t_max_us: sorted[sorted.len() - 1],
            t_typical_us: median(&sorted),
            t_avg_us: avg,
            t_stdev_us: stdev,
            p99_us: percentile(&sorted, 0.99),
            p999_us: percentile(&sorted, 0.999),
        }
    }
}

/// One bandwidth result row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BwStats {
    /// Message size in bytes.
    pub bytes: u64,
    /// Messages completed.
    pub iterations: u64,
    /// Peak bandwidth, MiB/s (perftest's MB/sec).
    pub bw_peak_mb_s: f64,
    /// Average bandwidth, MiB/s.
    pub bw_avg_mb_s: f64,
    /// Peak bandwidth, Gb/s (10^9 bits).
    pub bw_peak_gbit_s: f64,
    /// Average bandwidth, Gb/s.
    pub bw_avg_gbit_s: f64,
    /// Average message rate, millions of messages per second.
    pub msg_rate_mpps: f64,
}

/// The best per-message time (ns) over any `k` consecutive messages,
/// each window measured from the first one's post to the last one's
/// completion: `(completed[i + k - 1] - posted[i]) / k`. No byte of
/// message `i` can leave before it is posted, so all `k` messages really
/// moved inside that interval and the rate is one the transfer achieved.
/// (Measuring completion to completion instead credits a window with data
/// sent before it began: completions that a provider reports in a burst
/// made a 1 MiB Write's "peak" 200 times its average. perftest's
/// `opt_delta`, one message's post to its completion, is no better when a
/// post itself moves most of the message.) `posted` must be taken before
/// each post call. `None` when the run has fewer than `k` messages.
pub fn best_per_message_ns(posted: &[u64], completed: &[u64], k: usize) -> Option<f64> {
    let k = k.max(1);
    let n = posted.len().min(completed.len());
    if n < k {
        return None;
    }
    // Completions arrive in order on an RC QP; a running maximum keeps the
    // bound honest even if two were stamped out of order.
    let done: Vec<u64> = completed[..n]
        .iter()
        .scan(0u64, |m, &c| {
            *m = (*m).max(c);
            Some(*m)
        })
        .collect();
    (0..=n - k)
        .map(|i| done[i + k - 1].saturating_sub(posted[i]) as f64 / k as f64)
        .filter(|&t| t > 0.0)
        .min_by(f64::total_cmp)
}

/// How many consecutive messages the peak is taken over: at least the
/// send window (so completions polled in one batch do not look infinitely
/// fast) and a tenth of the run.
pub fn peak_span(iterations: usize, window: usize) -> usize {
    window.max(iterations / 10).max(1)
}

impl BwStats {
    /// Statistics from per-message post and completion times (ns since a
    /// common origin, in message order); `window` is how many messages
    /// were kept outstanding.
    pub fn from_times(bytes: u64, posted: &[u64], completed: &[u64], window: usize) -> BwStats {
        let n = posted.len().min(completed.len());
        let total_ns = if n == 0 {
            0
        } else {
            completed[..n]
                .iter()
                .max()
                .copied()
                .unwrap_or(0)
                .saturating_sub(posted[0])
        };
        let secs = (total_ns as f64 / 1e9).max(f64::MIN_POSITIVE);
        let total_bytes = bytes as f64 * n as f64;
        let avg_bps = total_bytes / secs;
        let peak_bps =
            match best_per_message_ns(&posted[..n], &completed[..n], peak_span(n, window)) {
                Some(ns) => (bytes as f64 / (ns / 1e9)).max(avg_bps),
                None => avg_bps,
            };
        BwStats {
            bytes,
            iterations: n as u64,
            bw_peak_mb_s: peak_bps / MIB,
            bw_avg_mb_s: avg_bps / MIB,
            bw_peak_gbit_s: peak_bps * 8.0 / 1e9,
            bw_avg_gbit_s: avg_bps * 8.0 / 1e9,
            msg_rate_mpps: n as f64 / secs / 1e6,
        }
    }
}

impl BwStats {
    /// Statistics of `messages` of `bytes` each moved in `total_ns`, when
    /// only the whole run is timed (a TCP stream has no per-message
    /// completion): peak = average.
    pub fn from_total(bytes: u64, messages: u64, total_ns: u64) -> BwStats {
        let secs = (total_ns as f64 / 1e9).max(f64::MIN_POSITIVE);
        let bps = bytes as f64 * messages as f64 / secs;
        BwStats {
            bytes,
            iterations: messages,
            bw_peak_mb_s: bps / MIB,
            bw_avg_mb_s: bps / MIB,
            bw_peak_gbit_s: bps * 8.0 / 1e9,
            bw_avg_gbit_s: bps * 8.0 / 1e9,
            msg_rate_mpps: messages as f64 / secs / 1e6,
        }
    }
}

/// perftest's MB: 2^20 bytes.
const MIB: f64 = 1024.0 * 1024.0;

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9 * a.abs().max(b.abs()).max(1.0)
    }

    #[test]
    fn percentiles_nearest_rank() {
        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.99), 990.0);
        assert_eq!(percentile(&v, 0.999), 999.0);
        assert_eq!(percentile(&v, 1.0), 1000.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
        let small = [1.0, 2.0, 3.0, 4.0, 5.0];
        // ceil(0.99 * 5) = 5: the largest.
        assert_eq!(percentile(&small, 0.99), 5.0);
        assert_eq!(percentile(&small, 0.5), 3.0);
        assert_eq!(percentile(&[7.0], 0.999), 7.0);
    }

    #[test]
    fn median_odd_and_even() {
        assert_eq!(median(&[1.0, 2.0, 9.0]), 2.0);
        assert_eq!(median(&[1.0, 2.0, 4.0, 9.0]), 3.0);
        assert_eq!(median(&[5.0]), 5.0);
    }

    #[test]
    fn stdev_known_vector() {
        // The classic example: population stdev of this set is exactly 2.
        let (m, s) = mean_stdev(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert!(close(m, 5.0));
        assert!(close(s, 2.0));
        let (m, s) = mean_stdev(&[3.0; 10]);
        assert!(close(m, 3.0));
        assert_eq!(s, 0.0);
    }

    #[test]
    fn lat_stats_order_and_factor() {
        let ns = [4000u64, 2000, 10_000, 6000, 8000];
        let us = to_usec(&ns, 2.0);
        assert_eq!(us, vec![2.0, 1.0, 5.0, 3.0, 4.0]);
        let s = LatStats::from_samples(64, &us);
        assert_eq!(s.bytes, 64);
        assert_eq!(s.iterations, 5);
        assert_eq!(s.t_min_us, 1.0);
        assert_eq!(s.t_max_us, 5.0);
        assert_eq!(s.t_typical_us, 3.0);
        assert!(close(s.t_avg_us, 3.0));
        assert!(close(s.t_stdev_us, 2f64.sqrt()));
        assert_eq!(s.p99_us, 5.0);
        assert_eq!(s.p999_us, 5.0);
        assert!(s.t_min_us <= s.t_typical_us && s.t_typical_us <= s.t_max_us);
    }

    #[test]
    fn bw_from_evenly_spaced_completions() {
        // 1000 messages of 1 MiB, one posted and one completed every 1 ms:
        // 1000 MiB/s average and peak, message rate 0.001 Mpps.
        let posted: Vec<u64> = (0..1000).map(|i| i * 1_000_000).collect();
        let completed: Vec<u64> = (1..=1000).map(|i| i * 1_000_000).collect();
        let s = BwStats::from_times(1 << 20, &posted, &completed, 16);
        assert_eq!(s.iterations, 1000);
        assert!(close(s.bw_avg_mb_s, 1000.0), "{s:?}");
        assert!(close(s.bw_peak_mb_s, 1000.0), "{s:?}");
        assert!(close(s.msg_rate_mpps, 0.001), "{s:?}");
        assert!(close(s.bw_avg_gbit_s, 1000.0 * 1048576.0 * 8.0 / 1e9));
    }

    #[test]
    fn bw_from_a_total() {
        // 1000 messages of 1 MiB in one second.
        let s = BwStats::from_total(1 << 20, 1000, 1_000_000_000);
        assert!(close(s.bw_avg_mb_s, 1000.0), "{s:?}");
        assert_eq!(s.bw_peak_mb_s, s.bw_avg_mb_s);
        assert!(close(s.msg_rate_mpps, 0.001), "{s:?}");
    }

    #[test]
    fn bw_peak_sees_a_fast_stretch() {
        // Pipelined: each message posted 100 ns before it completes; they
        // complete 100 ns apart, except 20 at 10 ns apart in the middle.
        let mut completed = Vec::new();
        let mut t = 1_000;
        for i in 0..100 {
            t += if (40..60).contains(&i) { 10 } else { 100 };
            completed.push(t);
        }
        let posted: Vec<u64> = completed.iter().map(|c| c - 100).collect();
        // Inside the stretch: (9 gaps × 10 ns + 100 ns) / 10 messages.
        assert_eq!(best_per_message_ns(&posted, &completed, 10), Some(19.0));
        assert_eq!(best_per_message_ns(&posted, &completed, 101), None);
        assert_eq!(peak_span(100, 4), 10);
        assert_eq!(peak_span(100, 16), 16);
        let s = BwStats::from_times(1000, &posted, &completed, 4);
        assert!(s.bw_peak_mb_s > s.bw_avg_mb_s);
        // Too short a run for a peak: peak = average.
        let s = BwStats::from_times(1000, &[0, 0], &[100, 200], 128);
        assert_eq!(s.bw_peak_mb_s, s.bw_avg_mb_s);
    }

    #[test]
    fn bw_peak_is_not_fooled_by_a_burst_of_completions() {
        // 200 messages of 1 MiB posted 1 ms apart (the link moves 1 MiB
        // per ms), but the provider reports the completions in one burst,
        // 10 ns apart from 200 ms on. Completion-to-completion windows see
        // 10 ns per MiB; the peak must stay the 1000 MiB/s that moved.
        let posted: Vec<u64> = (0..200).map(|i| i * 1_000_000).collect();
        let completed: Vec<u64> = (0..200).map(|i| 200_000_000 + i * 10).collect();
        let s = BwStats::from_times(1 << 20, &posted, &completed, 128);
        assert!((s.bw_avg_mb_s - 1000.0).abs() < 0.1, "{s:?}");
        assert!(s.bw_peak_mb_s <= 1000.0 * 1.0001, "{s:?}");
    }
}
