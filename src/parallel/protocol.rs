//! Messages between the driver and its rank processes over the control channel.
use serde::{Deserialize, Serialize};

use crate::engine::step::{SampledToken, SeqMask, StepPlan, StepResult};

/// Driver → rank.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ToRank {
    /// Execute this step (every rank gets the same plan).
    Step(StepPlan),
    /// Queue a pipelined decode step (`Executor::queue_decode`) without replying:
    /// rows `(seq_id, slot, pos)`, and their input tokens, or `None` for the
    /// tokens this rank sampled in its previous queued step (every rank samples
    /// the same tokens: replicated logits, shared seeds).
    QueueDecode {
        rows: Vec<(u64, usize, usize)>,
        tokens: Option<Vec<u32>>,
        /// Block tables `(slot, table)` to set first (the driver's, grown since).
        #[serde(default)]
        tables: Vec<(usize, Vec<u32>)>,
    },
    /// Queue the forward pass of a pipelined decode step whose sampling waits for
    /// `SampleQueued` (`Executor::queue_forward`; no reply), same rows and tokens as
    /// `QueueDecode`.
    QueueForward {
        rows: Vec<(u64, usize, usize)>,
        tokens: Option<Vec<u32>>,
        /// Block tables `(slot, table)` to set first, as in `QueueDecode`.
        #[serde(default)]
        tables: Vec<(usize, Vec<u32>)>,
    },
    /// Sample the newest `QueueForward` step with these token masks
    /// (`Executor::sample_queued`; no reply): every rank applies them, so every rank
    /// draws the same tokens.
    SampleQueued { masks: Vec<SeqMask> },
    /// Read the oldest queued decode step's tokens and reply with them.
    TakeSampled,
    /// Drop queued decode steps (no reply).
    DiscardQueued,
    /// Exit cleanly.
    Shutdown,
}

/// Rank → driver.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum FromRank {
    /// Weights loaded; the rank waits for steps.
    Ready(RankReport),
    /// A step's result (only rank 0's carries sampled tokens).
    Step(StepResult),
    /// The tokens of a queued decode step (every rank's: the driver checks they agree).
    Sampled(Vec<SampledToken>),
    /// The rank failed and is exiting.
    Error(String),
}

/// What a rank reports after loading.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RankReport {
    pub rank: usize,
    pub pid: u32,
    /// `cpu`, or the GPU's name.
    pub device: String,
    pub weight_bytes: u64,
    /// MLX active memory after loading (weights and anything else alive).
    pub active_memory: u64,
    pub peak_memory: u64,
    /// Bytes copied out of checkpoint files.
    pub bytes_read: u64,
    pub load_seconds: f64,
    /// `bytes_read / load_seconds` in GB/s (0 for dummy weights).
    pub load_gbps: f64,
    /// The process's peak resident set size at the end of loading (`VmHWM` of
    /// `/proc/self/status`; `None` where the OS does not say).
    pub peak_rss_bytes: Option<u64>,
}

impl RankReport {
    /// `rank 0 (pid 123, cpu): weights 1.234 GB, active 1.300 GB, read 1.234 GB in 0.52 s (2.37 GB/s), peak RSS 1.5 GB`
    pub fn summary(&self) -> String {
        let gb = |b: u64| b as f64 / 1e9;
        format!(
            "rank {} (pid {}, {}): weights {:.3} GB, active {:.3} GB, read {:.3} GB in {:.2} s ({:.2} GB/s), peak RSS {}",
            self.rank,
            self.pid,
            self.device,
            gb(self.weight_bytes),
            gb(self.active_memory),
            gb(self.bytes_read),
            self.load_seconds,
            self.load_gbps,
            self.peak_rss_bytes
                .map(|b| format!("{:.3} GB", gb(b)))
                .unwrap_or_else(|| "n/a".into())
        )
    }
}

/// What every rank must agree on with the driver: same model, same split.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// FNV-1a of config.json's bytes.
    pub config_hash: String,
    pub tp_size: usize,
    /// Weight files and their sizes in bytes (empty for dummy weights).
    pub weight_files: Vec<(String, u64)>,
}

impl Identity {
    pub fn of(
        config_bytes: &[u8],
        tp_size: usize,
        weight_files: &[std::path::PathBuf],
    ) -> Identity {
        let mut h: u64 = 0xcbf29ce484222325;
        for b in config_bytes {
            h ^= *b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
        let weight_files = weight_files
            .iter()
            .map(|p| {
                let name = p
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                (name, std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
            })
            .collect();
        Identity {
            config_hash: format!("{h:016x}"),
            tp_size,
            weight_files,
        }
    }
}
