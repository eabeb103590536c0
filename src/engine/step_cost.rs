//! How long an engine step takes for the tokens in it, learned from the steps that ran,
//! and how many prefill tokens fit beside a step's decodes so that a decoding stream
//! waits at most a given ratio of a decode step for its next token.
//!
//! Chunked prefill under a fixed token budget lets every step that carries prefill
//! chunks take as long as the whole budget takes: with 2048 tokens a step runs ~5× an
//! 8B model's decode step on a GPU, and much longer on a CPU, where every token costs
//! the same. Sarathi-Serve sizes the budget from a latency target by profiling; here the
//! scheduler learns the cost of its own steps while it serves. Steps are put in buckets by
//! their token count (powers of two); a bucket's point is the median of its last few
//! steps (a step that compiled a kernel or met a host hiccup does not move it), the points
//! are made non-decreasing in time, and the time of any count is read off the polyline
//! through them, extended past either end along its nearest segment.
use std::collections::VecDeque;

/// Buckets: a step of `n` tokens falls in bucket `floor(log2 n)`.
const BUCKETS: usize = 24;
/// Steps kept per bucket; the median of their times is the bucket's point.
const KEEP: usize = 8;
/// Prefill tokens a step with decodes may always carry (so prompts keep moving even
/// where the learned cost allows less).
pub const MIN_PREFILL: usize = 16;

/// Step times by token count ([`StepCost::observe`]), and the prefill budget they allow
/// ([`StepCost::prefill_cap`]).
#[derive(Debug, Clone)]
pub struct StepCost {
    buckets: Vec<VecDeque<(usize, f64)>>,
}

impl Default for StepCost {
    fn default() -> Self {
        StepCost {
            buckets: vec![VecDeque::new(); BUCKETS],
        }
    }
}

impl StepCost {
    /// A step of `tokens` tokens (decodes + prefill) took `secs`.
    pub fn observe(&mut self, tokens: usize, secs: f64) {
        if tokens == 0 || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        let b = &mut self.buckets[(tokens.ilog2() as usize).min(BUCKETS - 1)];
        if b.len() == KEEP {
            b.pop_front();
        }
        b.push_back((tokens, secs));
    }

    /// Token-count buckets (powers of two) that have steps.
    pub fn buckets_seen(&self) -> usize {
        self.buckets.iter().filter(|b| !b.is_empty()).count()
    }

    /// One point per bucket that has steps (the step of median time), by token count,
    /// times made non-decreasing.
    fn points(&self) -> Vec<(f64, f64)> {
        let mut pts: Vec<(f64, f64)> = self
            .buckets
            .iter()
            .filter(|b| !b.is_empty())
            .map(|b| {
                let mut v: Vec<(usize, f64)> = b.iter().copied().collect();
                v.sort_by(|x, y| x.1.total_cmp(&y.1));
                // (the lower median: of two steps, the quicker)
                let (n, t) = v[(v.len() - 1) / 2];
                (n as f64, t)
            })
            .collect();
        for i in 1..pts.len() {
            pts[i].1 = pts[i].1.max(pts[i - 1].1);
        }
        pts
    }

    /// Seconds a step of `tokens` tokens takes (`None` before any step was seen). With
    /// one point the time is taken proportional to the tokens; past the ends, along the
    /// nearest segment where it rises (proportional to that end where it does not), and
    /// never below proportional to the first point.
    pub fn seconds(&self, tokens: usize) -> Option<f64> {
        Self::on(&self.points(), tokens as f64)
    }

    fn on(pts: &[(f64, f64)], n: f64) -> Option<f64> {
        let &(n0, t0) = pts.first()?;
        let proportional = |(pn, pt): (f64, f64)| pt * n / pn;
        if pts.len() == 1 {
            return Some(proportional((n0, t0)));
        }
        let along = |a: (f64, f64), b: (f64, f64), end: (f64, f64)| {
            let slope = (b.1 - a.1) / (b.0 - a.0);
            if slope > 0.0 {
                end.1 + slope * (n - end.0)
            } else {
                proportional(end)
            }
        };
        let t = if n <= n0 {
            along(pts[0], pts[1], pts[0]).max(proportional(pts[0]))
        } else if let Some(i) = pts.iter().position(|p| p.0 >= n) {
            let (a, b) = (pts[i - 1], pts[i]);
            a.1 + (b.1 - a.1) * (n - a.0) / (b.0 - a.0)
        } else {
            let k = pts.len();
            along(pts[k - 2], pts[k - 1], pts[k - 1])
        };
        Some(t)
    }

    /// Prefill tokens a step with `decodes` decoding sequences may carry so that it
    /// takes at most `ratio` × a step of the decodes alone: at most `most` (what the
    /// token budget leaves), at least [`MIN_PREFILL`]. `most` when nothing decodes, the
    /// ratio is not positive or no step was seen yet.
    pub fn prefill_cap(&self, decodes: usize, ratio: f64, most: usize) -> usize {
        let pts = self.points();
        if decodes == 0 || ratio.is_nan() || ratio <= 0.0 || pts.is_empty() {
            return most;
        }
        let at = |n: usize| Self::on(&pts, n as f64).expect("points");
        // (a relative slack for the rounding of equal times)
        let limit = ratio * at(decodes) * (1.0 + 1e-9);
        // the most prefill tokens p in [0, most] with at(decodes + p) ≤ limit (`at` does
        // not decrease with n)
        let (mut lo, mut hi) = (0usize, most);
        if at(decodes + most) <= limit {
            return most;
        }
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            if at(decodes + mid) <= limit {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo.max(MIN_PREFILL).min(most)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GPU-like cost: a fixed part (reading the weights) and a part per token.
    fn linear(a: f64, b: f64, ns: &[usize]) -> StepCost {
        let mut c = StepCost::default();
        for &n in ns {
            c.observe(n, a + b * n as f64);
        }
        c
    }

    #[test]
    fn on_a_linear_cost_the_cap_is_where_the_step_reaches_the_ratio() {
        let (a, b) = (4.4e-3, 22.3e-6);
        let c = linear(a, b, &[1, 8, 16, 64, 512, 2048]);
        for n in [1usize, 5, 16, 40, 300, 2048, 4000] {
            let t = c.seconds(n).unwrap();
            assert!((t - (a + b * n as f64)).abs() < 1e-9, "{n}: {t}");
        }
        for d in [1usize, 16, 64] {
            let p = c.prefill_cap(d, 3.0, 8192);
            let step = |n: usize| a + b * n as f64;
            assert!(step(d + p) <= 3.0 * step(d) + 1e-12, "{d}: {p}");
            assert!(step(d + p + 1) > 3.0 * step(d), "{d}: {p} is not the most");
        }
        // 16 decodes at 4.76 ms: 14.27 ms allows 442 tokens in all
        assert_eq!(c.prefill_cap(16, 3.0, 8192), 426);
        // the budget bounds it; nothing decoding or no ratio: the budget
        assert_eq!(c.prefill_cap(16, 3.0, 300), 300);
        assert_eq!(c.prefill_cap(0, 3.0, 2048), 2048);
        assert_eq!(c.prefill_cap(16, 0.0, 2048), 2048);
        assert_eq!(StepCost::default().prefill_cap(16, 3.0, 2048), 2048);
    }

    #[test]
    fn a_cost_per_token_only_leaves_the_ratio_less_one_times_the_decodes() {
        // a CPU: every token costs the same
        let c = linear(0.0, 1e-3, &[1, 2, 40, 700]);
        assert_eq!(c.prefill_cap(64, 3.0, 2048), 128);
        // never less than MIN_PREFILL
        assert_eq!(c.prefill_cap(2, 3.0, 2048), MIN_PREFILL);
        assert_eq!(c.prefill_cap(2, 3.0, 10), 10);
    }

    #[test]
    fn one_step_seen_is_taken_as_proportional() {
        let mut c = StepCost::default();
        c.observe(2048, 0.05);
        assert!((c.seconds(1024).unwrap() - 0.025).abs() < 1e-12);
        assert_eq!(c.prefill_cap(16, 3.0, 2048), 32);
        // a second, smaller step gives the line through both: the fixed part shows
        c.observe(48, 5.4e-3);
        let t16 = c.seconds(16).unwrap();
        assert!(t16 > 4.5e-3 && t16 < 5.0e-3, "{t16}");
        assert!(c.prefill_cap(16, 3.0, 2048) > 350);
    }

    #[test]
    fn a_slow_step_does_not_move_its_bucket() {
        let mut c = linear(4e-3, 20e-6, &[16, 16, 16, 512, 512, 512]);
        let before = c.prefill_cap(16, 3.0, 2048);
        // one step that compiled a kernel
        c.observe(16, 2.0);
        c.observe(520, 5.0);
        assert_eq!(c.prefill_cap(16, 3.0, 2048), before);
        // a bucket keeps its last KEEP steps: slower steps that persist are learned
        for _ in 0..KEEP {
            c.observe(512, 0.1);
        }
        assert!(c.prefill_cap(16, 3.0, 2048) < before);
    }

    #[test]
    fn times_never_fall_with_more_tokens() {
        let mut c = StepCost::default();
        c.observe(16, 6e-3);
        c.observe(64, 5e-3); // noise: less than the smaller step
        c.observe(1024, 30e-3);
        let mut last = 0.0;
        for n in (1..3000).step_by(7) {
            let t = c.seconds(n).unwrap();
            assert!(t >= last, "{n}: {t} < {last}");
            last = t;
        }
        // a flat end extends proportionally, so the cap stays finite
        let mut flat = StepCost::default();
        flat.observe(8, 5e-3);
        flat.observe(16, 5e-3);
        assert_eq!(flat.prefill_cap(16, 3.0, 4096), 32);
    }
}
