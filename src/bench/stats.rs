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

/// How far apart (in messages) the peak search looks: perftest scans every
/// pair, which is quadratic; beyond this window the best per-message time
/// no longer changes in practice.
pub const PEAK_WINDOW: usize = 4096;

/// The best per-message time (ns) over any run of consecutive messages
/// `i..=j`: `(completed[j] - posted[i]) / (j - i + 1)`, perftest's
/// `opt_delta`, with `j - i` bounded by [`PEAK_WINDOW`].
pub fn best_per_message_ns(posted: &[u64], completed: &[u64]) -> Option<f64> {
    let n = posted.len().min(completed.len());
    let mut best: Option<f64> = None;
    for i in 0..n {
        for j in i..n.min(i + PEAK_WINDOW) {
            let span = completed[j].saturating_sub(posted[i]) as f64 / (j - i + 1) as f64;
            if span > 0.0 && best.is_none_or(|b| span < b) {
                best = Some(span);
            }
        }
    }
    best
}

impl BwStats {
    /// Statistics from per-message post and completion times (ns since a
    /// common origin, in message order).
    pub fn from_times(bytes: u64, posted: &[u64], completed: &[u64]) -> BwStats {
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
        let peak_bps = match best_per_message_ns(&posted[..n], &completed[..n]) {
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
        // 1000 MiB/s average, message rate 0.001 Mpps.
        let posted: Vec<u64> = (0..1000).map(|i| i * 1_000_000).collect();
        let completed: Vec<u64> = (1..=1000).map(|i| i * 1_000_000).collect();
        let s = BwStats::from_times(1 << 20, &posted, &completed);
        assert_eq!(s.iterations, 1000);
        assert!(close(s.bw_avg_mb_s, 1000.0), "{s:?}");
        assert!(close(s.bw_peak_mb_s, 1000.0), "{s:?}");
        assert!(close(s.msg_rate_mpps, 0.001), "{s:?}");
        assert!(close(s.bw_avg_gbit_s, 1000.0 * 1048576.0 * 8.0 / 1e9));
    }

    #[test]
    fn bw_peak_sees_a_fast_burst() {
        // Three messages posted together, completed 0.5 µs apart after a
        // slow first one: the best run is all three, 101 µs / 3.
        let posted = [0, 0, 0];
        let completed = [100_000, 100_500, 101_000];
        let best = best_per_message_ns(&posted, &completed).unwrap();
        assert!(close(best, 101_000.0 / 3.0), "{best}");
        let s = BwStats::from_times(1000, &posted, &completed);
        assert!(s.bw_peak_mb_s >= s.bw_avg_mb_s);
    }
}
