//! Token sampling: turns a batch of logits into one token per sequence.
//!
//! Owns: the per-request [`SamplingParams`] (and their validation), the
//! per-sequence sampling state [`SequenceSampler`] (PRNG key, token history for
//! penalties) and [`sample_batch`], which does all the math on MLX arrays and
//! reads back the chosen tokens (and log-probabilities) in one transfer.
//!
//! Order of transforms, as in HF / vLLM:
//! penalties → temperature → top-k → top-p → min-p → categorical sample.
//!
//! * Repetition penalty (HF): for every token of prompt + output,
//!   `logit > 0 ? logit / p : logit * p`.
//! * Presence / frequency penalty (OpenAI, vLLM): on generated tokens only,
//!   `logit -= presence * (count > 0) + frequency * count`, after the
//!   repetition penalty.
//! * Temperature 0 (or `top_k == 1`) is greedy: `argmax`, ties to the lowest index.
//! * top-p keeps the smallest prefix of the sorted distribution whose mass
//!   reaches `top_p` (a token is kept while the mass before it is below
//!   `top_p - 1e-6`; the slack absorbs f32 rounding at exact boundaries).
//!   Tokens tied with the last kept one are kept too (likewise for top-k).
//! * min-p keeps tokens with `p >= min_p * p_max` (computed in log space).
//!
//! Log-probabilities ([`Sampled::logprob`], [`Sampled::top_logprobs`]) are
//! `log_softmax` of the logits **after penalties but before temperature and
//! truncation**: they describe the model's (penalised) distribution, not the
//! tempered/truncated one the token was drawn from, so they stay comparable
//! across sampling settings and are finite for every token.
//!
//! Drawing: the Gumbel-max trick, `argmax(logits / T + g)` with `g = -log(-log(u))`,
//! for all sampling rows of a batch at once. The uniform `u` of row r, token j is a
//! counter-based hash (two rounds of `lowbias32`) of `j` and two 32-bit keys derived
//! on the host from the sequence's seed and its draw count — about twenty
//! element-wise ops per step whatever the batch size.
//!
//! Reproducibility: each sequence has its own seed (`seed`, or a random one from
//! the OS) and counts its draws, so the same seed and logits give the same tokens
//! whatever else shares the batch.
use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::mlx::{self, where_, Array, Dtype, MlxError, Result};

/// Most `top_logprobs` a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Slack on the top-p boundary (see the module docs).
const TOP_P_EPS: f32 = 1e-6;

/// How one sequence is sampled. `Default` is greedy with no penalties.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 = greedy.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 = off.
    pub top_k: u32,
    /// Nucleus sampling mass in (0, 1]; 1 = off.
    pub top_p: f32,
    /// Drop tokens with `p < min_p * p_max`; in [0, 1], 0 = off.
    pub min_p: f32,
    /// HF repetition penalty over prompt + output tokens; > 0, 1 = off.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty over generated tokens, in [-2, 2].
    pub presence_penalty: f32,
    /// OpenAI frequency penalty over generated tokens, in [-2, 2].
    pub frequency_penalty: f32,
    /// PRNG seed; `None` takes a random one from the OS.
    pub seed: Option<u64>,
    /// Return the log-probability of the chosen token.
    pub logprobs: bool,
    /// Also return this many most likely tokens with their log-probabilities (≤ 20; needs `logprobs`).
    pub top_logprobs: u32,
    /// OpenAI `logit_bias`: `(token, bias)` added to the token's logit, bias in [-100, 100]
    /// (after the penalties, before temperature).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logprobs: false,
            top_logprobs: 0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Checks every field; the message names the first bad one.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(format!("temperature must be >= 0 (got {t})"));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return Err(format!("top_p must be in (0, 1] (got {p})"));
        }
        let m = self.min_p;
        if !(0.0..=1.0).contains(&m) {
            return Err(format!("min_p must be in [0, 1] (got {m})"));
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(format!("repetition_penalty must be > 0 (got {r})"));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be in [-2, 2] (got {v})"));
            }
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(format!(
                "top_logprobs must be <= {MAX_TOP_LOGPROBS} (got {})",
                self.top_logprobs
            ));
        }
        if self.top_logprobs > 0 && !self.logprobs {
            return Err("top_logprobs requires logprobs = true".into());
        }
        if let Some(&(t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(format!(
                "logit_bias values must be in [-100, 100] (got {b} for token {t})"
            ));
        }
        Ok(())
    }

    /// Whether the token is `argmax` (temperature 0 or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// Whether any penalty (repetition, presence, frequency) is on: the sampler then
    /// needs every generated token on the host before the next step.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

/// The sampling state of one sequence.
pub struct SequenceSampler {
    params: SamplingParams,
    /// Seed of this sequence's random stream.
    seed: u64,
    /// Draws made so far (the counter of the stream).
    draws: u64,
    /// Token → number of times it was generated. With a repetition penalty,
    /// prompt tokens are also present (count 0 unless generated).
    counts: HashMap<u32, u32>,
    generated: usize,
}

impl SequenceSampler {
    /// State for a sequence with `prompt_tokens`; fails (naming the field) on invalid params.
    pub fn new(params: SamplingParams, prompt_tokens: &[u32]) -> Result<SequenceSampler> {
        params
            .validate()
            .map_err(|e| MlxError::Invalid(format!("invalid sampling params: {e}")))?;
        let seed = params.seed.unwrap_or_else(rand::random::<u64>);
        let mut counts = HashMap::new();
        if params.repetition_penalty != 1.0 {
            for &t in prompt_tokens {
                counts.entry(t).or_insert(0);
            }
        }
        Ok(SequenceSampler {
            params,
            seed,
            draws: 0,
            counts,
            generated: 0,
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Tokens observed so far (generated, not prompt).
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Records the token chosen for this sequence (call after each step).
    pub fn observe(&mut self, token: u32) {
        if self.params.has_penalties() {
            *self.counts.entry(token).or_insert(0) += 1;
        }
        self.generated += 1;
    }

    /// `(token, divisor for positive / multiplier for negative logits, amount subtracted)`
    /// for every token this sequence penalises, below `vocab`.
    /// `logit_bias` is folded in as a negative amount subtracted.
    fn penalty_entries(&self, vocab: u32) -> Vec<(u32, f32, f32)> {
        let p = &self.params;
        let mut out: Vec<(u32, f32, f32)> = if p.has_penalties() {
            let rep = p.repetition_penalty;
            self.counts
                .iter()
                .filter(|&(&t, &c)| t < vocab && (rep != 1.0 || c > 0))
                .map(|(&t, &c)| (t, rep, penalty_sub(p, c)))
                .collect()
        } else {
            Vec::new()
        };
        if !p.logit_bias.is_empty() {
            let at: HashMap<u32, usize> = out.iter().enumerate().map(|(i, e)| (e.0, i)).collect();
            for &(t, b) in p.logit_bias.iter().filter(|(t, _)| *t < vocab) {
                match at.get(&t) {
                    Some(&i) => out[i].2 -= b,
                    None => out.push((t, 1.0, -b)),
                }
            }
        }
        out
    }
}

/// `presence * (count > 0) + frequency * count`, as subtracted from a logit.
fn penalty_sub(p: &SamplingParams, count: u32) -> f32 {
    let present = if count > 0 { 1.0 } else { 0.0 };
    p.presence_penalty * present + p.frequency_penalty * count as f32
}

/// One sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// log-probability of `token` (when `logprobs` was asked for).
    pub logprob: Option<f32>,
    /// The `top_logprobs` most likely tokens, most likely first (ties: lower id first).
    pub top_logprobs: Vec<(u32, f32)>,
}

fn neg_inf() -> Result<Array> {
    Array::scalar(f32::NEG_INFINITY, Dtype::F32)
}

fn u32_index(rows: &[usize]) -> Result<Array> {
    let v: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    Array::from_slice(&v, &[v.len() as i32])
}

/// Penalised logits (f32 `[B, V]`): repetition, then frequency and presence penalties.
pub(crate) fn apply_penalties(x: &Array, seqs: &[&SequenceSampler]) -> Result<Array> {
    let vocab = x.dim(-1) as u32;
    let b = seqs.len();
    let entries: Vec<Vec<(u32, f32, f32)>> =
        seqs.iter().map(|s| s.penalty_entries(vocab)).collect();
    let n = entries.iter().map(Vec::len).max().unwrap_or(0);
    if n == 0 {
        return Ok(x.clone());
    }
    let mut idx = Vec::with_capacity(b * n);
    let mut rep = Vec::with_capacity(b * n);
    let mut sub = Vec::with_capacity(b * n);
    for row in &entries {
        // Pad with copies of the row's first entry (a duplicate scatter of the
        // same value), or with an identity entry at token 0 for empty rows.
        let pad = row.first().copied().unwrap_or((0, 1.0, 0.0));
        for &(t, r, s) in row.iter().chain(std::iter::repeat_n(&pad, n - row.len())) {
            idx.push(t);
            rep.push(r);
            sub.push(s);
        }
    }
    let shape = [b as i32, n as i32];
    let idx = Array::from_slice(&idx, &shape)?;
    let rep = Array::from_slice(&rep, &shape)?;
    let sub = Array::from_slice(&sub, &shape)?;
    let g = x.take_along_axis(&idx, -1)?;
    let zero = Array::scalar(0.0, Dtype::F32)?;
    let g = where_(&g.gt(&zero)?, &g.div(&rep)?, &g.mul(&rep)?)?.sub(&sub)?;
    x.put_along_axis(&idx, &g, -1)
}

/// Applies temperature, top-k, top-p and min-p to `y` (f32 `[S, V]`), one row per
/// sampler in `params`; dropped tokens become `-inf`.
fn truncate(y: &Array, params: &[&SamplingParams]) -> Result<Array> {
    let s = params.len() as i32;
    let vocab = y.dim(-1);
    let col = |v: Vec<f32>| Array::from_slice(&v, &[s, 1]);
    let temps: Vec<f32> = params.iter().map(|p| p.temperature).collect();
    let mut y = y.div(&col(temps)?)?;
    let ninf = neg_inf()?;

    // top-k as a limit on the sorted position; `vocab` = off.
    let k_lim: Vec<i32> = params
        .iter()
        .map(|p| match p.top_k as i64 {
            0 => vocab,
            k => k.min(vocab as i64) as i32,
        })
        .collect();
    let k_on: Vec<bool> = k_lim.iter().map(|&k| k < vocab).collect();
    let p_on: Vec<bool> = params.iter().map(|p| p.top_p < 1.0).collect();
    if k_on.iter().chain(&p_on).any(|&b| b) {
        let k_max = *k_lim
            .iter()
            .zip(&k_on)
            .filter(|(_, &on)| on)
            .map(|(k, _)| k)
            .max()
            .unwrap_or(&vocab);
        // top-p without top-k needs the whole row sorted; else the k_max largest suffice.
        let full = k_on.iter().zip(&p_on).any(|(&k, &p)| p && !k) || k_max >= vocab;
        let w = if full { vocab } else { k_max };
        let cand = if full { y.clone() } else { y.topk(w, -1)? };
        let sorted = cand.neg()?.sort(-1)?.neg()?; // descending, [S, W]
        let pos = Array::arange(0.0, w as f64, 1.0, Dtype::I32)?.reshape(&[1, w])?;
        let in_k = pos.lt(&Array::from_slice(&k_lim, &[s, 1])?)?;
        let masked = where_(&in_k, &sorted, &ninf)?;
        let p_lim: Vec<f32> = params
            .iter()
            .map(|p| {
                if p.top_p < 1.0 {
                    p.top_p - TOP_P_EPS
                } else {
                    2.0
                }
            })
            .collect();
        let probs = masked.softmax(-1, true)?;
        let before = probs.cumsum(-1, false, false)?;
        let keep = before.lt(&col(p_lim)?)?.logical_and(&in_k)?;
        let count = keep.astype(Dtype::I32)?.sum(&[-1], true)?;
        let last = count
            .sub(&Array::scalar_i32(1)?)?
            .maximum(&Array::scalar_i32(0)?)?;
        let thr = masked.take_along_axis(&last, -1)?;
        let on: Vec<bool> = k_on.iter().zip(&p_on).map(|(&k, &p)| k || p).collect();
        let thr = where_(&Array::from_slice(&on, &[s, 1])?, &thr, &ninf)?;
        y = where_(&y.lt(&thr)?, &ninf, &y)?;
    }

    if params.iter().any(|p| p.min_p > 0.0) {
        let ln_min: Vec<f32> = params
            .iter()
            .map(|p| {
                if p.min_p > 0.0 {
                    p.min_p.ln()
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let thr = y.max(&[-1], true)?.add(&col(ln_min)?)?;
        y = where_(&y.lt(&thr)?, &ninf, &y)?;
    }
    Ok(y)
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The two 32-bit hash keys of draw number `draw` of the stream `seed`.
fn draw_keys(seed: u64, draw: u64) -> (u32, u32) {
    let h = splitmix64(seed ^ splitmix64(draw));
    (h as u32, (h >> 32) as u32)
}

/// Gumbel noise `[rows, vocab]`: row r uses the keys `keys[r]`; token j's uniform is
/// `lowbias32(lowbias32(j + k1) ^ k2)` mapped to (0, 1).
fn gumbel_noise(keys: &[(u32, u32)], vocab: i32) -> Result<Array> {
    let r = keys.len() as i32;
    let c = |v: u32| Array::from_slice(&[v], &[1]);
    let lowbias32 = |x: Array| -> Result<Array> {
        let x = x.bitwise_xor(&x.shr(&c(16)?)?)?.mul(&c(0x7feb_352d)?)?;
        let x = x.bitwise_xor(&x.shr(&c(15)?)?)?.mul(&c(0x846c_a68b)?)?;
        x.bitwise_xor(&x.shr(&c(16)?)?)
    };
    let k1: Vec<u32> = keys.iter().map(|k| k.0).collect();
    let k2: Vec<u32> = keys.iter().map(|k| k.1).collect();
    let j = Array::arange(0.0, vocab as f64, 1.0, Dtype::U32)?.reshape(&[1, vocab])?;
    let x = lowbias32(j.add(&Array::from_slice(&k1, &[r, 1])?)?)?;
    let x = lowbias32(x.bitwise_xor(&Array::from_slice(&k2, &[r, 1])?)?)?;
    let u = open_unit(&x)?;
    u.log()?.neg()?.log()?.neg()
}

/// uint32 bits → float32 in (0, 1), never 0 or 1: the top 23 bits n as (n + 0.5) / 2^23,
/// exact for every n < 2^23. (With 24 bits, n + 0.5 rounded up to 2^24 for the largest n:
/// u was 1, the Gumbel noise +∞, and that token won even where its logit was −∞, e.g. a
/// token a grammar's mask had taken out.)
fn open_unit(x: &Array) -> Result<Array> {
    x.shr(&Array::from_slice(&[9u32], &[1])?)?
        .astype(Dtype::F32)?
        .add_scalar(0.5)?
        .mul_scalar(1.0 / 8_388_608.0)
}

/// Samples one token per row of `logits` (`[B, V]`, any float dtype), row `i`
/// following `seqs[i]`. Does not call [`SequenceSampler::observe`]; the caller
/// does once it accepts the token.
///
/// All math stays on the device; results come back in one evaluation (for an
/// all-greedy batch without logprobs or penalties: one `argmax` and one read).
pub fn sample_batch(logits: &Array, seqs: &mut [&mut SequenceSampler]) -> Result<Vec<Sampled>> {
    sample_batch_lazy(logits, seqs)?.read()
}

/// The tokens (and logprobs) of [`sample_batch_lazy`], still on the device.
pub struct LazySample {
    /// `[tokens u32 [B]]`, then with logprob rows: chosen logprobs, and with
    /// `top_logprobs`: top values and top ids.
    outs: Vec<Array>,
    lrows: Vec<usize>,
    n_top: i32,
    /// `top_logprobs` asked for by each row.
    wants: Vec<usize>,
}

impl LazySample {
    /// The sampled token ids, `u32 [B]`, unevaluated: the next step can take them as input.
    pub fn tokens(&self) -> &Array {
        &self.outs[0]
    }

    /// Every array to evaluate (for `async_eval`).
    pub fn arrays(&self) -> Vec<&Array> {
        self.outs.iter().collect()
    }

    /// Evaluate (if not yet) and read the results back.
    pub fn read(self) -> Result<Vec<Sampled>> {
        let LazySample {
            outs,
            lrows,
            n_top,
            wants,
        } = self;
        let to_eval: Vec<&Array> = outs.iter().collect();
        mlx::eval(&to_eval)?;
        let tokens = outs[0].to_vec::<u32>()?;
        let mut result: Vec<Sampled> = tokens
            .into_iter()
            .map(|token| Sampled {
                token,
                logprob: None,
                top_logprobs: Vec::new(),
            })
            .collect();
        if !lrows.is_empty() {
            let chosen = outs[1].to_vec::<f32>()?;
            let (top_val, top_idx) = if n_top > 0 {
                (outs[2].to_vec::<f32>()?, outs[3].to_vec::<u32>()?)
            } else {
                (Vec::new(), Vec::new())
            };
            let n = n_top as usize;
            for (r, &i) in lrows.iter().enumerate() {
                result[i].logprob = Some(chosen[r]);
                let want = wants[i];
                if want > 0 {
                    let mut top: Vec<(u32, f32)> = top_idx[r * n..(r + 1) * n]
                        .iter()
                        .copied()
                        .zip(top_val[r * n..(r + 1) * n].iter().copied())
                        .collect();
                    top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                    top.truncate(want);
                    result[i].top_logprobs = top;
                }
            }
        }
        Ok(result)
    }
}

/// [`sample_batch`] without reading back: builds the sampling graph (advancing the
/// random streams of sampling rows) and returns its outputs unevaluated.
pub fn sample_batch_lazy(logits: &Array, seqs: &mut [&mut SequenceSampler]) -> Result<LazySample> {
    let shape = logits.shape();
    if shape.len() != 2 {
        return Err(MlxError::Invalid(format!(
            "sample_batch: logits must be [batch, vocab], got shape {shape:?}"
        )));
    }
    let (b, vocab) = (shape[0] as usize, shape[1]);
    if b != seqs.len() {
        return Err(MlxError::Invalid(format!(
            "sample_batch: {b} rows of logits for {} sequences",
            seqs.len()
        )));
    }
    let wants: Vec<usize> = seqs
        .iter()
        .map(|s| s.params.top_logprobs as usize)
        .collect();
    if b == 0 {
        return Ok(LazySample {
            outs: vec![Array::from_slice::<u32>(&[], &[0])?],
            lrows: Vec::new(),
            n_top: 0,
            wants,
        });
    }
    if !logits.dtype().is_float() {
        return Err(MlxError::Invalid(format!(
            "sample_batch: logits must be floating point, got {}",
            logits.dtype().name()
        )));
    }

    let plain = |s: &SequenceSampler| {
        let p = &s.params;
        p.is_greedy() && !p.logprobs && !p.has_penalties() && p.logit_bias.is_empty()
    };
    if seqs.iter().all(|s| plain(s)) {
        return Ok(LazySample {
            outs: vec![logits.argmax(-1, false)?.astype(Dtype::U32)?],
            lrows: Vec::new(),
            n_top: 0,
            wants,
        });
    }

    let x = logits.astype(Dtype::F32)?;
    let refs: Vec<&SequenceSampler> = seqs.iter().map(|s| &**s).collect();
    let x = apply_penalties(&x, &refs)?;
    let mut tokens = x.argmax(-1, false)?;

    // Sampling rows: truncate, then one Gumbel-max draw for all of them together.
    let srows: Vec<usize> = (0..b).filter(|&i| !seqs[i].params.is_greedy()).collect();
    if !srows.is_empty() {
        let sidx = u32_index(&srows)?;
        let params: Vec<&SamplingParams> = srows.iter().map(|&i| &seqs[i].params).collect();
        let y = truncate(&x.take(&sidx, 0)?, &params)?;
        let keys: Vec<(u32, u32)> = srows
            .iter()
            .map(|&i| draw_keys(seqs[i].seed, seqs[i].draws))
            .collect();
        let g = gumbel_noise(&keys, vocab)?;
        let sampled = y.add(&g)?.argmax(-1, false)?.astype(Dtype::U32)?;
        tokens = tokens.put_along_axis(&sidx, &sampled, 0)?;
        for &i in &srows {
            seqs[i].draws += 1;
        }
    }

    // Logprobs rows: log_softmax of the penalised logits.
    let lrows: Vec<usize> = (0..b).filter(|&i| seqs[i].params.logprobs).collect();
    let n_top = seqs
        .iter()
        .map(|s| s.params.top_logprobs as i32)
        .max()
        .unwrap_or(0)
        .min(vocab);
    let mut outs = vec![tokens.clone()];
    if !lrows.is_empty() {
        let lidx = u32_index(&lrows)?;
        let xl = x.take(&lidx, 0)?;
        let lp = xl.sub(&xl.logsumexp(&[-1], true)?)?;
        let chosen_tok = tokens.take(&lidx, 0)?.reshape(&[lrows.len() as i32, 1])?;
        outs.push(lp.take_along_axis(&chosen_tok, -1)?);
        if n_top > 0 {
            let top_idx = lp
                .neg()?
                .argpartition(n_top - 1, -1)?
                .slice_axis(-1, 0, n_top)?;
            outs.push(lp.take_along_axis(&top_idx, -1)?);
            outs.push(top_idx.astype(Dtype::U32)?);
        }
    }
    Ok(LazySample {
        outs,
        lrows,
        n_top,
        wants,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    fn rand_logits(n: usize, scale: f32) -> Vec<f32> {
        let mut rng = rand::rng();
        (0..n).map(|_| rng.random_range(-scale..scale)).collect()
    }

    fn argmax_ref(row: &[f32]) -> u32 {
        (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best }) as u32
    }

    fn log_softmax_ref(row: &[f32]) -> Vec<f32> {
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let lse = m + row.iter().map(|v| ((v - m) as f64).exp()).sum::<f64>().ln() as f32;
        row.iter().map(|v| v - lse).collect()
    }

    fn sampler(params: SamplingParams) -> SequenceSampler {
        SequenceSampler::new(params, &[]).unwrap()
    }

    fn sample(logits: &Array, seqs: &mut [SequenceSampler]) -> Vec<Sampled> {
        let mut refs: Vec<&mut SequenceSampler> = seqs.iter_mut().collect();
        sample_batch(logits, &mut refs).unwrap()
    }

    /// Token histogram over `n` draws from `row` (batches of samplers with seeds `seed0..`).
    fn histogram(row: &[f32], params: &SamplingParams, n: usize, seed0: u64) -> Vec<usize> {
        let v = row.len();
        let mut hist = vec![0; v];
        let batch = 250;
        let data: Vec<f32> = row.iter().cycle().take(batch * v).cloned().collect();
        let logits = Array::from_slice(&data, &[batch as i32, v as i32]).unwrap();
        for chunk in 0..n.div_ceil(batch) {
            let mut seqs: Vec<SequenceSampler> = (0..batch)
                .map(|j| {
                    sampler(SamplingParams {
                        seed: Some(seed0 + (chunk * batch + j) as u64),
                        ..params.clone()
                    })
                })
                .collect();
            for s in sample(&logits, &mut seqs) {
                hist[s.token as usize] += 1;
            }
        }
        hist
    }

    #[test]
    fn greedy_equals_argmax() {
        let (b, v) = (5, 1000);
        let data = rand_logits(b * v, 4.0);
        let logits = Array::from_slice(&data, &[b as i32, v as i32]).unwrap();
        let want: Vec<u32> = data.chunks(v).map(argmax_ref).collect();
        let mut seqs: Vec<_> = (0..b).map(|_| sampler(SamplingParams::default())).collect();
        let got: Vec<u32> = sample(&logits, &mut seqs).iter().map(|s| s.token).collect();
        assert_eq!(got, want);
        // bf16 logits, and the non-fast path (logprobs) give the same tokens
        let bf = logits.astype(Dtype::BF16).unwrap();
        let bf_ref: Vec<f32> = bf.astype(Dtype::F32).unwrap().to_vec().unwrap();
        let want_bf: Vec<u32> = bf_ref.chunks(v).map(argmax_ref).collect();
        let mut seqs: Vec<_> = (0..b)
            .map(|_| {
                sampler(SamplingParams {
                    logprobs: true,
                    ..Default::default()
                })
            })
            .collect();
        let got: Vec<u32> = sample(&bf, &mut seqs).iter().map(|s| s.token).collect();
        assert_eq!(got, want_bf);
        // ties go to the lowest index, on both paths
        let tie = Array::from_slice(&[0.0f32, 3.0, 1.0, 3.0, 3.0], &[1, 5]).unwrap();
        for lp in [false, true] {
            let mut s = [sampler(SamplingParams {
                logprobs: lp,
                ..Default::default()
            })];
            assert_eq!(sample(&tie, &mut s)[0].token, 1);
        }
    }

    #[test]
    fn top_k_1_is_greedy_at_any_temperature() {
        let (b, v) = (4, 300);
        let data = rand_logits(b * v, 2.0);
        let logits = Array::from_slice(&data, &[b as i32, v as i32]).unwrap();
        let want: Vec<u32> = data.chunks(v).map(argmax_ref).collect();
        for t in [0.3f32, 1.0, 5.0, 100.0] {
            let mut seqs: Vec<_> = (0..b)
                .map(|_| {
                    sampler(SamplingParams {
                        temperature: t,
                        top_k: 1,
                        ..Default::default()
                    })
                })
                .collect();
            let got: Vec<u32> = sample(&logits, &mut seqs).iter().map(|s| s.token).collect();
            assert_eq!(got, want, "temperature {t}");
        }
    }

    #[test]
    fn top_k_only_hits_k_largest() {
        let (v, k) = (64, 5);
        let row = rand_logits(v, 1.0);
        let mut order: Vec<usize> = (0..v).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        let allowed = &order[..k];
        let params = SamplingParams {
            temperature: 2.0,
            top_k: k as u32,
            ..Default::default()
        };
        let hist = histogram(&row, &params, 2000, 1000);
        for (t, &c) in hist.iter().enumerate() {
            assert!(
                c == 0 || allowed.contains(&t),
                "token {t} outside top-{k} drawn {c} times"
            );
        }
        assert_eq!(hist.iter().sum::<usize>(), 2000);
        assert!(hist.iter().filter(|&&c| c > 0).count() >= 3, "{hist:?}");
        // mixed top-k per row with full-sort top-p rows in the same batch
        let logits =
            Array::from_slice(&[row.clone(), row.clone()].concat(), &[2, v as i32]).unwrap();
        for seed in 0..50 {
            let mut seqs = [
                sampler(SamplingParams {
                    temperature: 2.0,
                    top_k: 2,
                    seed: Some(seed),
                    ..Default::default()
                }),
                sampler(SamplingParams {
                    temperature: 2.0,
                    top_p: 0.999,
                    seed: Some(seed),
                    ..Default::default()
                }),
            ];
            let got = sample(&logits, &mut seqs);
            assert!(order[..2].contains(&(got[0].token as usize)));
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        let row: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.8,
            ..Default::default()
        };
        let hist = histogram(&row, &params, 2000, 0);
        assert_eq!(hist[2] + hist[3], 0, "{hist:?}");
        let f0 = hist[0] as f32 / 2000.0;
        assert!((f0 - 0.625).abs() < 0.05, "freq of 0: {f0} ({hist:?})");
        // top_p together with top_k (small-sort path)
        let params = SamplingParams { top_k: 3, ..params };
        let hist = histogram(&row, &params, 1000, 7);
        assert_eq!(hist[2] + hist[3], 0, "{hist:?}");
        assert!(hist[0] > 0 && hist[1] > 0);
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let row: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        // threshold 0.25 * 0.5 = 0.125: keeps {0, 1, 2} with 0.5/0.95, 0.3/0.95, 0.15/0.95
        let params = SamplingParams {
            temperature: 1.0,
            min_p: 0.25,
            ..Default::default()
        };
        let hist = histogram(&row, &params, 2000, 99);
        assert_eq!(hist[3], 0, "{hist:?}");
        for (t, want) in [(0, 0.5 / 0.95), (1, 0.3 / 0.95), (2, 0.15 / 0.95)] {
            let f = hist[t] as f32 / 2000.0;
            assert!(
                (f - want).abs() < 0.05,
                "token {t}: {f} vs {want} ({hist:?})"
            );
        }
        // threshold 0.35 * 0.5 = 0.175 drops token 2 too
        let params = SamplingParams {
            min_p: 0.35,
            ..params
        };
        let hist = histogram(&row, &params, 1000, 5);
        assert_eq!(hist[2] + hist[3], 0, "{hist:?}");
    }

    /// Rows of one batch draw independently and follow softmax(logits): 4000 sequences with
    /// distinct seeds, one draw each from p = [0.1, 0.2, 0.3, 0.4].
    #[test]
    fn batched_draws_follow_the_distribution() {
        let n = 4000usize;
        let p = [0.1f32, 0.2, 0.3, 0.4];
        let row: Vec<f32> = p.iter().map(|x| x.ln()).collect();
        let logits: Vec<f32> = (0..n).flat_map(|_| row.clone()).collect();
        let l = Array::from_slice(&logits, &[n as i32, 4]).unwrap();
        let mut seqs: Vec<SequenceSampler> = (0..n)
            .map(|i| {
                sampler(SamplingParams {
                    temperature: 1.0,
                    seed: Some(i as u64),
                    ..Default::default()
                })
            })
            .collect();
        let mut refs: Vec<&mut SequenceSampler> = seqs.iter_mut().collect();
        let out = sample_batch(&l, &mut refs).unwrap();
        let mut counts = [0usize; 4];
        for s in &out {
            counts[s.token as usize] += 1;
        }
        for (k, &c) in counts.iter().enumerate() {
            let f = c as f32 / n as f32;
            assert!(
                (f - p[k]).abs() < 0.03,
                "token {k}: frequency {f}, expected {}",
                p[k]
            );
        }
    }

    #[test]
    fn seed_reproducible_and_batch_independent() {
        let (steps, v) = (50, 100);
        let rows: Vec<Vec<f32>> = (0..steps).map(|_| rand_logits(v, 1.0)).collect();
        let params = |seed| SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..Default::default()
        };
        let run_alone = |seed| -> Vec<u32> {
            let mut s = [sampler(params(seed))];
            rows.iter()
                .map(|r| {
                    let l = Array::from_slice(r, &[1, v as i32]).unwrap();
                    let t = sample(&l, &mut s)[0].token;
                    s[0].observe(t);
                    t
                })
                .collect()
        };
        let a = run_alone(42);
        assert_eq!(a, run_alone(42));
        assert_ne!(a, run_alone(43));
        // same seed as row 1 of a batch next to other sequences
        let mut seqs = [
            sampler(SamplingParams {
                temperature: 0.7,
                seed: Some(1),
                ..Default::default()
            }),
            sampler(params(42)),
            sampler(SamplingParams::default()),
        ];
        let b: Vec<u32> = rows
            .iter()
            .map(|r| {
                let data = [rand_logits(v, 1.0), r.clone(), rand_logits(v, 1.0)].concat();
                let l = Array::from_slice(&data, &[3, v as i32]).unwrap();
                let got = sample(&l, &mut seqs);
                for (s, g) in seqs.iter_mut().zip(&got) {
                    s.observe(g.token);
                }
                got[1].token
            })
            .collect();
        assert_eq!(a, b);
    }

    #[test]
    fn penalties_match_reference() {
        let v = 40usize;
        let prompt = [3u32, 5, 5, 7, 39, 1000];
        let generated = [5u32, 9, 9, 9, 11, 2000];
        let p1 = SamplingParams {
            repetition_penalty: 1.3,
            presence_penalty: 0.5,
            frequency_penalty: 0.2,
            ..Default::default()
        };
        let p2 = SamplingParams {
            presence_penalty: -0.7,
            frequency_penalty: 1.1,
            ..Default::default()
        };
        let p3 = SamplingParams {
            repetition_penalty: 0.8,
            ..Default::default()
        };
        // logit_bias (ids past the vocabulary are ignored)
        let p4 = SamplingParams {
            logit_bias: vec![(9, 2.5), (20, -100.0), (1000, 5.0)],
            ..Default::default()
        };
        let ps = [p1, p2, p3, p4, SamplingParams::default()];
        let mut seqs: Vec<_> = ps
            .iter()
            .map(|p| SequenceSampler::new(p.clone(), &prompt).unwrap())
            .collect();
        for s in &mut seqs {
            for &t in &generated {
                s.observe(t);
            }
        }
        let data = rand_logits(ps.len() * v, 3.0);
        let x = Array::from_slice(&data, &[ps.len() as i32, v as i32]).unwrap();
        let refs: Vec<&SequenceSampler> = seqs.iter().collect();
        let got = apply_penalties(&x, &refs).unwrap().to_vec::<f32>().unwrap();
        let mut want = data.clone();
        for (r, p) in ps.iter().enumerate() {
            for t in 0..v as u32 {
                let l = &mut want[r * v + t as usize];
                let count = generated.iter().filter(|&&g| g == t).count() as u32;
                if prompt.contains(&t) || count > 0 {
                    let rp = p.repetition_penalty;
                    *l = if *l > 0.0 { *l / rp } else { *l * rp };
                }
                *l -= p.presence_penalty * (count > 0) as u32 as f32
                    + p.frequency_penalty * count as f32;
                for &(bt, b) in &p.logit_bias {
                    if bt == t {
                        *l += b;
                    }
                }
            }
        }
        assert_eq!(got, want);
        assert_ne!(got, data);
        // and greedy sampling picks the argmax of the penalised logits
        let tokens: Vec<u32> = sample(&x, &mut seqs).iter().map(|s| s.token).collect();
        let want_tok: Vec<u32> = want.chunks(v).map(argmax_ref).collect();
        assert_eq!(tokens, want_tok);
    }

    #[test]
    fn logprobs_equal_log_softmax() {
        let (b, v) = (3, 200);
        let data = rand_logits(b * v, 3.0);
        let logits = Array::from_slice(&data, &[b as i32, v as i32]).unwrap();
        let prompt = [4u32, 8, 15];
        let ps = [
            SamplingParams {
                logprobs: true,
                top_logprobs: 5,
                ..Default::default()
            },
            SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                seed: Some(3),
                logprobs: true,
                top_logprobs: 20,
                repetition_penalty: 1.5,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.0,
                logprobs: true,
                ..Default::default()
            },
        ];
        let mut seqs: Vec<_> = ps
            .iter()
            .map(|p| SequenceSampler::new(p.clone(), &prompt).unwrap())
            .collect();
        let got = sample(&logits, &mut seqs);
        for (r, (g, p)) in got.iter().zip(&ps).enumerate() {
            let mut row = data[r * v..(r + 1) * v].to_vec();
            if p.repetition_penalty != 1.0 {
                for &t in &prompt {
                    let l = &mut row[t as usize];
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
            let lp = log_softmax_ref(&row);
            let chosen = g.logprob.expect("logprob requested");
            assert!((chosen - lp[g.token as usize]).abs() < 1e-4, "row {r}");
            let mut order: Vec<usize> = (0..v).collect();
            order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]));
            assert_eq!(g.top_logprobs.len(), p.top_logprobs as usize);
            for (j, &(t, l)) in g.top_logprobs.iter().enumerate() {
                assert_eq!(t as usize, order[j], "row {r} rank {j}");
                assert!((l - lp[order[j]]).abs() < 1e-4);
            }
        }
        assert_eq!(got[0].token, argmax_ref(&data[..v]));
    }

    #[test]
    fn validate_names_the_bad_field() {
        assert!(SamplingParams::default().validate().is_ok());
        let d = SamplingParams::default;
        let cases = [
            (
                SamplingParams {
                    temperature: -0.1,
                    ..d()
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..d()
                },
                "temperature",
            ),
            (SamplingParams { top_p: 0.0, ..d() }, "top_p"),
            (SamplingParams { top_p: 1.5, ..d() }, "top_p"),
            (SamplingParams { min_p: -0.1, ..d() }, "min_p"),
            (SamplingParams { min_p: 1.1, ..d() }, "min_p"),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..d()
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..d()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: -3.0,
                    ..d()
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    logprobs: true,
                    top_logprobs: 21,
                    ..d()
                },
                "top_logprobs",
            ),
            (
                SamplingParams {
                    top_logprobs: 2,
                    ..d()
                },
                "top_logprobs",
            ),
        ];
        for (p, field) in cases {
            let e = p.validate().expect_err(field);
            assert!(e.contains(field), "{e:?} should name {field}");
            let e = SequenceSampler::new(p, &[]).err().expect("new rejects");
            assert!(e.to_string().contains(field));
        }
        let p: SamplingParams = serde_json::from_str(r#"{"temperature":0.7,"seed":5}"#).unwrap();
        assert_eq!(
            p,
            SamplingParams {
                temperature: 0.7,
                seed: Some(5),
                ..d()
            }
        );
    }

    #[test]
    fn bad_shapes_are_errors() {
        let mut s = sampler(SamplingParams::default());
        let l = Array::from_slice(&[0.0f32; 8], &[2, 4]).unwrap();
        assert!(sample_batch(&l, &mut [&mut s]).is_err());
        let l = Array::from_slice(&[0.0f32; 8], &[8]).unwrap();
        assert!(sample_batch(&l, &mut [&mut s]).is_err());
    }

    #[test]
    fn uniforms_stay_inside_the_open_interval_at_the_extremes() {
        let bits = [
            0u32,
            1,
            255,
            256,
            511,
            512,
            0x7fff_ffff,
            0xffff_feff,
            0xffff_ff00,
            u32::MAX,
        ];
        let x = Array::from_slice(&bits, &[bits.len() as i32]).unwrap();
        let u = open_unit(&x).unwrap().to_vec::<f32>().unwrap();
        for (b, u) in bits.iter().zip(&u) {
            assert!(*u > 0.0 && *u < 1.0, "bits {b:#x} gave {u}");
        }
        // and the Gumbel noise of the largest is finite
        let g = open_unit(&x)
            .unwrap()
            .log()
            .unwrap()
            .neg()
            .unwrap()
            .log()
            .unwrap()
            .neg()
            .unwrap();
        assert!(g.to_vec::<f32>().unwrap().iter().all(|v| v.is_finite()));
    }

    /// Rows where most tokens are −∞ (a grammar's mask): a temperature draw over 32 rows
    /// of a 49,152-token vocabulary, 20 times, only ever picks finite tokens. Noise of +∞
    /// (a uniform of exactly 1) picked a −∞ token in the first batch.
    #[test]
    fn masked_rows_only_sample_their_allowed_tokens() {
        let (b, v) = (32usize, 49152usize);
        for trial in 0..20usize {
            let mut data = vec![f32::NEG_INFINITY; b * v];
            let mut allowed = vec![vec![]; b];
            for (r, row) in allowed.iter_mut().enumerate() {
                for j in 0..1 + (r * 7 + trial) % 30 {
                    let t = (r * 1543 + j * 977 + trial * 31) % v;
                    data[r * v + t] = j as f32 * 0.1 - 3.0;
                    row.push(t as u32);
                }
            }
            let logits = Array::from_slice(&data, &[b as i32, v as i32]).unwrap();
            let mut seqs: Vec<SequenceSampler> = (0..b)
                .map(|i| {
                    sampler(SamplingParams {
                        temperature: 0.7,
                        seed: Some((i + trial * 100) as u64),
                        ..Default::default()
                    })
                })
                .collect();
            for (r, s) in sample(&logits, &mut seqs).iter().enumerate() {
                assert!(
                    allowed[r].contains(&s.token),
                    "trial {trial} row {r}: token {} is not one of {:?}",
                    s.token,
                    allowed[r]
                );
            }
        }
    }
}
