//! Prometheus metrics (text format 0.0.4) with vLLM-like names under `mlxcel:`.
//!
//! Everything is atomics: the engine thread records (through
//! [`Observer`](crate::engine::scheduler::Observer), implemented in the server
//! module), the HTTP side records request statuses and renders `/metrics`.
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::engine::generate::FinishReason;
use crate::engine::scheduler::{HostPart, Outcome};
use crate::engine::step::MemoryStats;
use crate::parallel::protocol::RankReport;

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];
/// Tokens of a step (decodes and prefill chunks), and sequences prefilled in one.
const STEP_TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
    16384.0, 32768.0,
];
const STEP_SEQ_BUCKETS: &[f64] = &[0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// A histogram with fixed upper bounds (plus +Inf).
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket, not cumulative; the last is +Inf.
    counts: Vec<AtomicU64>,
    sum_bits: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_bits: AtomicU64::new(0f64.to_bits()),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| v <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let _ = self
            .sum_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some((f64::from_bits(b) + v).to_bits())
            });
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (i, c) in self.counts.iter().enumerate() {
            cum += c.load(Ordering::Relaxed);
            let le = match self.bounds.get(i) {
                Some(b) => format!("{b}"),
                None => "+Inf".into(),
            };
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cum}");
        }
        let sum = f64::from_bits(self.sum_bits.load(Ordering::Relaxed));
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {cum}");
    }
}

/// Picks one counter out of [`MemoryStats`].
type MemoryField = fn(&MemoryStats) -> u64;

/// One TP rank, for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankMetrics {
    pub pid: u32,
    pub weight_bytes: u64,
    pub memory: MemoryStats,
}

/// All server metrics.
pub struct Metrics {
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens run through the model (a prompt shared by `n` choices counts once).
    pub prefill_tokens: AtomicU64,
    /// Decode steps queued before the previous step's tokens were read.
    pub pipelined_steps: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub success_stop: AtomicU64,
    pub success_length: AtomicU64,
    pub aborted: AtomicU64,
    pub failed: AtomicU64,
    pub engine_errors: AtomicU64,
    pub memory_active: AtomicU64,
    pub memory_peak: AtomicU64,
    pub memory_cache: AtomicU64,
    /// KV cache writes of the process that runs the model that copied a layer's pool.
    pub kv_pool_copies: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub queue_time: Histogram,
    pub e2e: Histogram,
    /// Per engine step: its tokens (decodes and prefill chunks), and the sequences it
    /// prefilled.
    pub step_tokens: Histogram,
    pub step_prefill_seqs: Histogram,
    /// The scheduler's token budget per step.
    pub max_num_batched_tokens: AtomicU64,
    /// Restarts of the TP rank group.
    pub tp_restarts: AtomicU64,
    /// KV cache blocks held by sequences, and in the pool.
    pub kv_blocks_used: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    /// Prompt tokens looked up in the prefix cache, and found there.
    pub prefix_cache_queries: AtomicU64,
    pub prefix_cache_hits: AtomicU64,
    pub preemptions: AtomicU64,
    /// Host time of pipelined decode steps per [`HostPart`] (in its order), nanoseconds.
    pub host_nanos: [AtomicU64; 4],
    /// `Some` when the model runs on TP ranks (empty while they are restarting).
    tp_ranks: Mutex<Option<Vec<RankMetrics>>>,
    /// (path, status) → count.
    http: Mutex<BTreeMap<(&'static str, u16), u64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics {
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            prefill_tokens: AtomicU64::new(0),
            pipelined_steps: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            success_stop: AtomicU64::new(0),
            success_length: AtomicU64::new(0),
            aborted: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            engine_errors: AtomicU64::new(0),
            kv_blocks_used: AtomicU64::new(0),
            kv_blocks_total: AtomicU64::new(0),
            prefix_cache_queries: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            host_nanos: Default::default(),
            memory_active: AtomicU64::new(0),
            memory_peak: AtomicU64::new(0),
            memory_cache: AtomicU64::new(0),
            kv_pool_copies: AtomicU64::new(0),
            ttft: Histogram::new(LATENCY_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            queue_time: Histogram::new(LATENCY_BUCKETS),
            e2e: Histogram::new(LATENCY_BUCKETS),
            step_tokens: Histogram::new(STEP_TOKEN_BUCKETS),
            step_prefill_seqs: Histogram::new(STEP_SEQ_BUCKETS),
            max_num_batched_tokens: AtomicU64::new(0),
            tp_restarts: AtomicU64::new(0),
            tp_ranks: Mutex::new(None),
            http: Mutex::new(BTreeMap::new()),
        }
    }

    /// A new TP group is up: its ranks as they reported after loading.
    pub fn set_tp_ranks(&self, reports: &[RankReport]) {
        let ranks = reports
            .iter()
            .map(|r| RankMetrics {
                pid: r.pid,
                weight_bytes: r.weight_bytes,
                memory: MemoryStats {
                    active: r.active_memory,
                    peak: r.peak_memory,
                    cache: 0,
                },
            })
            .collect();
        if let Ok(mut t) = self.tp_ranks.lock() {
            *t = Some(ranks);
        }
    }

    /// The ranks' memory after a step, by rank.
    pub fn set_tp_memory(&self, memory: &[MemoryStats]) {
        if let Ok(mut t) = self.tp_ranks.lock() {
            if let Some(ranks) = t.as_mut() {
                for (r, m) in ranks.iter_mut().zip(memory) {
                    r.memory = *m;
                }
            }
        }
    }

    /// The TP group is gone (it is being restarted).
    pub fn clear_tp_ranks(&self) {
        if let Ok(mut t) = self.tp_ranks.lock() {
            if let Some(ranks) = t.as_mut() {
                ranks.clear();
            }
        }
    }

    /// An HTTP response on a known route (`path` is the route, not the raw URI).
    pub fn http_response(&self, path: &'static str, status: u16) {
        if let Ok(mut m) = self.http.lock() {
            *m.entry((path, status)).or_insert(0) += 1;
        }
    }

    /// `seconds` of a pipelined decode step's host time went to `part`.
    pub fn host_time(&self, part: HostPart, seconds: f64) {
        let i = HostPart::ALL.iter().position(|&p| p == part).unwrap_or(0);
        self.host_nanos[i].fetch_add((seconds * 1e9) as u64, Ordering::Relaxed);
    }

    /// A request left the engine.
    pub fn finished(&self, outcome: Outcome, e2e_seconds: f64) {
        match outcome {
            Outcome::Finished(FinishReason::Stop) => &self.success_stop,
            Outcome::Finished(FinishReason::Length) => &self.success_length,
            Outcome::Aborted => &self.aborted,
            Outcome::Failed => &self.failed,
        }
        .fetch_add(1, Ordering::Relaxed);
        if matches!(outcome, Outcome::Finished(_)) {
            self.e2e.observe(e2e_seconds);
        }
    }

    /// The `/metrics` page.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let g = |out: &mut String, name: &str, kind: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        };
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        g(
            &mut out,
            "mlxcel:num_requests_running",
            "gauge",
            "Requests in the running batch.",
            ld(&self.running),
        );
        g(
            &mut out,
            "mlxcel:num_requests_waiting",
            "gauge",
            "Requests waiting for a slot.",
            ld(&self.waiting),
        );
        let (used, total) = (ld(&self.kv_blocks_used), ld(&self.kv_blocks_total));
        let _ = writeln!(
            out,
            "# HELP vllm:kv_cache_usage_perc Fraction of the KV cache's blocks held by sequences (1 = all).\n# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc {}",
            if total > 0 { used as f64 / total as f64 } else { 0.0 }
        );
        g(
            &mut out,
            "mlxcel:kv_blocks_used",
            "gauge",
            "KV cache blocks held by sequences.",
            used,
        );
        g(
            &mut out,
            "mlxcel:kv_blocks_free",
            "gauge",
            "KV cache blocks no sequence holds (free, or cached prefix blocks that may be evicted).",
            total - used.min(total),
        );
        g(
            &mut out,
            "vllm:prefix_cache_queries",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            ld(&self.prefix_cache_queries),
        );
        g(
            &mut out,
            "vllm:prefix_cache_hits",
            "counter",
            "Prompt tokens found in the prefix cache (not prefilled).",
            ld(&self.prefix_cache_hits),
        );
        g(
            &mut out,
            "vllm:num_preemptions",
            "counter",
            "Running sequences preempted because the KV cache had no free block.",
            ld(&self.preemptions),
        );
        g(
            &mut out,
            "mlxcel:prompt_tokens_total",
            "counter",
            "Prompt tokens prefilled.",
            ld(&self.prompt_tokens),
        );
        g(
            &mut out,
            "mlxcel:prefill_tokens_total",
            "counter",
            "Prompt tokens run through the model (the choices of an n > 1 request share one prefill).",
            ld(&self.prefill_tokens),
        );
        g(
            &mut out,
            "mlxcel:pipelined_decode_steps_total",
            "counter",
            "Decode steps queued on the device before the previous step's tokens were read (constrained ones too: their masks are computed while the step runs).",
            ld(&self.pipelined_steps),
        );
        let _ = writeln!(
            out,
            "# HELP mlxcel:decode_host_seconds_total Engine-thread time of pipelined decode steps, by part: masks (constrained sequences' token masks; deferred, the wait for the thread computing them), queue (building steps and handing them to the device), wait (for a step's tokens), deliver (grammar advance, stop checks, events).\n# TYPE mlxcel:decode_host_seconds_total counter"
        );
        for (part, v) in HostPart::ALL.iter().zip(&self.host_nanos) {
            let _ = writeln!(
                out,
                "mlxcel:decode_host_seconds_total{{part=\"{}\"}} {}",
                part.name(),
                ld(v) as f64 / 1e9
            );
        }
        g(
            &mut out,
            "mlxcel:generation_tokens_total",
            "counter",
            "Tokens generated.",
            ld(&self.generation_tokens),
        );
        let _ = writeln!(
            out,
            "# HELP mlxcel:request_success_total Requests that finished, by reason (abort: the client went away).\n# TYPE mlxcel:request_success_total counter"
        );
        for (reason, v) in [
            ("stop", &self.success_stop),
            ("length", &self.success_length),
            ("abort", &self.aborted),
        ] {
            let _ = writeln!(
                out,
                "mlxcel:request_success_total{{finished_reason=\"{reason}\"}} {}",
                ld(v)
            );
        }
        g(
            &mut out,
            "mlxcel:request_failure_total",
            "counter",
            "Requests that the engine failed (step errors, shutdown, bad prompts).",
            ld(&self.failed),
        );
        g(
            &mut out,
            "mlxcel:engine_step_errors_total",
            "counter",
            "Engine steps that failed.",
            ld(&self.engine_errors),
        );
        self.ttft.render(
            &mut out,
            "mlxcel:time_to_first_token_seconds",
            "Time from receiving a request to its first token.",
        );
        self.itl.render(
            &mut out,
            "mlxcel:inter_token_latency_seconds",
            "Time between two tokens of one request.",
        );
        self.queue_time.render(
            &mut out,
            "mlxcel:request_queue_time_seconds",
            "Time a request waited for a slot.",
        );
        self.e2e.render(
            &mut out,
            "mlxcel:e2e_request_latency_seconds",
            "Time from receiving a request to its last token.",
        );
        self.step_tokens.render(
            &mut out,
            "mlxcel:step_tokens",
            "Tokens of an engine step: one per decoding sequence plus its prefill chunks (at most --max-num-batched-tokens).",
        );
        self.step_prefill_seqs.render(
            &mut out,
            "mlxcel:step_prefill_sequences",
            "Sequences with a prefill chunk in an engine step.",
        );
        g(
            &mut out,
            "mlxcel:max_num_batched_tokens",
            "gauge",
            "The scheduler's token budget per step.",
            ld(&self.max_num_batched_tokens),
        );
        let tp = self.tp_ranks.lock().ok().and_then(|t| t.clone());
        let memory: [(&str, &str, MemoryField); 3] = [
            (
                "mlxcel:device_memory_active_bytes",
                "MLX active memory of the process that runs the model (per TP rank with --tp-size).",
                |m| m.active,
            ),
            (
                "mlxcel:device_memory_peak_bytes",
                "MLX peak memory of the process that runs the model since it started (per TP rank with --tp-size).",
                |m| m.peak,
            ),
            (
                "mlxcel:device_memory_cache_bytes",
                "MLX allocator cache of the process that runs the model (per TP rank with --tp-size).",
                |m| m.cache,
            ),
        ];
        match &tp {
            None => {
                let local = MemoryStats {
                    active: ld(&self.memory_active),
                    peak: ld(&self.memory_peak),
                    cache: ld(&self.memory_cache),
                };
                for (name, help, f) in memory {
                    g(&mut out, name, "gauge", help, f(&local));
                }
                g(
                    &mut out,
                    "mlxcel:kv_pool_copies_total",
                    "counter",
                    "KV cache writes that copied a layer's whole pool instead of updating it in place (0 expected).",
                    ld(&self.kv_pool_copies),
                );
            }
            Some(ranks) => {
                let family =
                    |out: &mut String, name: &str, help: &str, f: &dyn Fn(&RankMetrics) -> u64| {
                        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
                        for (rank, r) in ranks.iter().enumerate() {
                            let _ = writeln!(out, "{name}{{tp_rank=\"{rank}\"}} {}", f(r));
                        }
                    };
                for (name, help, f) in memory {
                    family(&mut out, name, help, &|r| f(&r.memory));
                }
                family(
                    &mut out,
                    "mlxcel:tp_rank_weight_bytes",
                    "Bytes of weights each TP rank holds.",
                    &|r| r.weight_bytes,
                );
                family(
                    &mut out,
                    "mlxcel:tp_rank_pid",
                    "Process id of each TP rank (no series while the group restarts).",
                    &|r| r.pid as u64,
                );
                g(
                    &mut out,
                    "mlxcel:tp_restarts_total",
                    "counter",
                    "Restarts of the TP rank group after a rank failed.",
                    ld(&self.tp_restarts),
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP mlxcel:http_requests_total HTTP responses by route and status.\n# TYPE mlxcel:http_requests_total counter"
        );
        if let Ok(m) = self.http.lock() {
            for ((path, status), v) in m.iter() {
                let _ = writeln!(
                    out,
                    "mlxcel:http_requests_total{{path=\"{path}\",status=\"{status}\"}} {v}"
                );
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let m = Metrics::new();
        m.ttft.observe(0.003);
        m.ttft.observe(0.003);
        m.ttft.observe(1e6);
        m.http_response("/v1/completions", 200);
        let text = m.render();
        assert!(text.contains("mlxcel:time_to_first_token_seconds_bucket{le=\"0.001\"} 0\n"));
        assert!(text.contains("mlxcel:time_to_first_token_seconds_bucket{le=\"0.005\"} 2\n"));
        assert!(text.contains("mlxcel:time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(text.contains("mlxcel:time_to_first_token_seconds_count 3\n"));
        assert!(text
            .contains("mlxcel:http_requests_total{path=\"/v1/completions\",status=\"200\"} 1\n"));
        assert!(text.contains("\nmlxcel:device_memory_active_bytes 0\n"));
        assert!(text.contains("\nmlxcel:kv_pool_copies_total 0\n"));
        assert!(!text.contains("tp_rank"));
    }

    #[test]
    fn host_time_adds_up_by_part() {
        let m = Metrics::new();
        m.host_time(HostPart::Masks, 0.25);
        m.host_time(HostPart::Masks, 0.5);
        m.host_time(HostPart::Wait, 2.0);
        let text = m.render();
        assert!(text.contains("mlxcel:decode_host_seconds_total{part=\"masks\"} 0.75\n"));
        assert!(text.contains("mlxcel:decode_host_seconds_total{part=\"queue\"} 0\n"));
        assert!(text.contains("mlxcel:decode_host_seconds_total{part=\"wait\"} 2\n"));
        assert!(text.contains("mlxcel:decode_host_seconds_total{part=\"deliver\"} 0\n"));
    }

    #[test]
    fn tp_ranks_are_labelled() {
        let m = Metrics::new();
        let reports: Vec<RankReport> = (0..2)
            .map(|rank| RankReport {
                rank,
                pid: 100 + rank as u32,
                active_memory: 7,
                weight_bytes: 5,
                ..Default::default()
            })
            .collect();
        m.set_tp_ranks(&reports);
        m.set_tp_memory(&[
            MemoryStats {
                active: 11,
                peak: 12,
                cache: 13,
            },
            MemoryStats::default(),
        ]);
        m.tp_restarts.fetch_add(1, Ordering::Relaxed);
        let text = m.render();
        for line in [
            "mlxcel:device_memory_active_bytes{tp_rank=\"0\"} 11\n",
            "mlxcel:device_memory_cache_bytes{tp_rank=\"0\"} 13\n",
            "mlxcel:device_memory_peak_bytes{tp_rank=\"1\"} 0\n",
            "mlxcel:tp_rank_pid{tp_rank=\"1\"} 101\n",
            "mlxcel:tp_rank_weight_bytes{tp_rank=\"0\"} 5\n",
            "mlxcel:tp_restarts_total 1\n",
        ] {
            assert!(text.contains(line), "{line} in:\n{text}");
        }
        assert!(!text.contains("\nmlxcel:device_memory_active_bytes "));
        m.clear_tp_ranks();
        let text = m.render();
        assert!(!text.contains("tp_rank_pid{"));
        assert!(text.contains("mlxcel:tp_restarts_total 1\n"));
    }
}
