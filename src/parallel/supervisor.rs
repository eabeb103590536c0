//! Restart policy for a supervised TP rank group (the server's engine thread
//! restarts a failed group): at most `max_restarts` restarts within a sliding
//! `window`; past that the supervisor gives up with a reason.
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The sliding window `--max-restarts` counts in.
pub const RESTART_WINDOW: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    /// Restarts allowed within `window` (0: never restart).
    pub max_restarts: usize,
    pub window: Duration,
}

impl RestartPolicy {
    pub fn new(max_restarts: usize) -> RestartPolicy {
        RestartPolicy {
            max_restarts,
            window: RESTART_WINDOW,
        }
    }
}

/// Why the supervisor stopped restarting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GiveUp(pub String);

/// Counts restarts in a sliding window.
#[derive(Debug, Clone)]
pub struct RestartBudget {
    policy: RestartPolicy,
    /// When the restarts within the window happened, oldest first.
    recent: VecDeque<Instant>,
    total: u64,
}

impl RestartBudget {
    pub fn new(policy: RestartPolicy) -> RestartBudget {
        RestartBudget {
            policy,
            recent: VecDeque::new(),
            total: 0,
        }
    }

    pub fn policy(&self) -> RestartPolicy {
        self.policy
    }

    /// Restarts granted so far.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Restarts granted within the window ending at `now`.
    pub fn in_window(&mut self, now: Instant) -> usize {
        while let Some(&t) = self.recent.front() {
            if now.saturating_duration_since(t) >= self.policy.window {
                self.recent.pop_front();
            } else {
                break;
            }
        }
        self.recent.len()
    }

    /// Asks for one more restart at `now`: `Ok(n)` is its number within the
    /// window (1-based); `Err` when the budget is spent.
    pub fn try_restart(&mut self, now: Instant) -> Result<usize, GiveUp> {
        let used = self.in_window(now);
        let p = self.policy;
        if p.max_restarts == 0 {
            return Err(GiveUp("not restarting (--max-restarts 0)".into()));
        }
        if used >= p.max_restarts {
            return Err(GiveUp(format!(
                "giving up: {used} restart(s) within the last {} already (--max-restarts {})",
                window_text(p.window),
                p.max_restarts
            )));
        }
        self.recent.push_back(now);
        self.total += 1;
        Ok(used + 1)
    }
}

/// `10 minutes`, `90 s`.
pub fn window_text(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 && s.is_multiple_of(60) {
        let m = s / 60;
        format!("{m} minute{}", if m == 1 { "" } else { "s" })
    } else {
        format!("{s} s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_restarts_in_a_sliding_window() {
        let mut b = RestartBudget::new(RestartPolicy {
            max_restarts: 3,
            window: Duration::from_secs(600),
        });
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(b.try_restart(at(0)), Ok(1));
        assert_eq!(b.try_restart(at(100)), Ok(2));
        assert_eq!(b.try_restart(at(200)), Ok(3));
        let e = b.try_restart(at(300)).unwrap_err();
        assert!(
            e.0.contains("3 restart(s)") && e.0.contains("10 minutes"),
            "{e}"
        );
        // a refusal does not count; the first restart leaves the window at 600 s
        assert_eq!(b.in_window(at(599)), 3);
        assert_eq!(b.try_restart(at(600)), Ok(3));
        assert!(b.try_restart(at(650)).is_err());
        assert_eq!(b.try_restart(at(700)), Ok(3));
        assert_eq!(b.total(), 5);
        // long after, the window is empty again
        assert_eq!(b.in_window(at(5000)), 0);
        assert_eq!(b.try_restart(at(5000)), Ok(1));
    }

    #[test]
    fn zero_never_restarts() {
        let mut b = RestartBudget::new(RestartPolicy::new(0));
        let e = b.try_restart(Instant::now()).unwrap_err();
        assert!(e.0.contains("--max-restarts 0"), "{e}");
        assert_eq!(b.total(), 0);
        assert_eq!(window_text(Duration::from_secs(90)), "90 s");
        assert_eq!(window_text(Duration::from_secs(60)), "1 minute");
    }
}
