//! Slot-based KV cache: per layer one pool `[slots, kv_heads, capacity, head_dim]`
//! for keys and one for values, grown in steps, with a length per slot.
//! A sequence owns a slot while it runs; the model writes its new keys/values
//! at the slot's current length and reads the prefix back as a view.
use crate::mlx::{self, Array, Dtype};

/// Where a batched decode step writes and reads (see [`KvCache::batch_index`]).
pub struct BatchIndex {
    rows: usize,
    slot_idx: Array,
    pos_idx: Array,
    /// Maximal runs of batch rows with consecutive slots.
    pub runs: Vec<Run>,
}

/// Batch rows `rows` hold consecutive slots from `first_slot`; `mask` (`[n, 1, 1, max_len]`)
/// hides each row's positions past its own length.
pub struct Run {
    pub rows: std::ops::Range<usize>,
    first_slot: usize,
    max_len: usize,
    pub mask: Array,
}

pub struct KvCache {
    k: Vec<Array>,
    v: Vec<Array>,
    lens: Vec<usize>,
    slots: usize,
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    max_capacity: usize,
    step: usize,
    dtype: Dtype,
}

#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("sequence needs {needed} positions but the context is {max} (--ctx-size)")]
    ContextFull { needed: usize, max: usize },
    #[error("slot {slot} out of range: the cache has {slots} slot(s)")]
    BadSlot { slot: usize, slots: usize },
    #[error(transparent)]
    Mlx(#[from] mlx::MlxError),
}

impl KvCache {
    /// An empty cache; memory is allocated on first use, `step` positions at a time.
    pub fn new(
        layers: usize,
        slots: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: Dtype,
        max_capacity: usize,
    ) -> Self {
        KvCache {
            k: Vec::with_capacity(layers),
            v: Vec::with_capacity(layers),
            lens: vec![0; slots],
            slots,
            kv_heads,
            head_dim,
            capacity: 0,
            max_capacity,
            step: 256,
            dtype,
        }
    }

    pub fn num_layers(&self) -> usize {
        self.k.capacity().max(self.k.len())
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn max_capacity(&self) -> usize {
        self.max_capacity
    }

    /// Tokens held for `slot`.
    pub fn len(&self, slot: usize) -> usize {
        self.lens[slot]
    }

    /// Forget a slot's contents (the memory is reused).
    pub fn reset(&mut self, slot: usize) {
        self.lens[slot] = 0;
    }

    /// Record that `n` more tokens of `slot` were written (after all layers).
    pub fn advance(&mut self, slot: usize, n: usize) {
        self.lens[slot] += n;
    }

    pub fn check_slot(&self, slot: usize) -> Result<(), KvError> {
        if slot >= self.slots {
            return Err(KvError::BadSlot {
                slot,
                slots: self.slots,
            });
        }
        Ok(())
    }

    /// Make room for `needed` positions in every slot.
    pub fn reserve(&mut self, layers: usize, needed: usize) -> Result<(), KvError> {
        if needed > self.max_capacity {
            return Err(KvError::ContextFull {
                needed,
                max: self.max_capacity,
            });
        }
        if needed <= self.capacity && self.k.len() == layers {
            return Ok(());
        }
        let new_cap = needed
            .div_ceil(self.step)
            .saturating_mul(self.step)
            .min(self.max_capacity)
            .max(needed);
        let shape = [
            self.slots as i32,
            self.kv_heads as i32,
            new_cap as i32,
            self.head_dim as i32,
        ];
        if self.k.len() != layers {
            self.k = (0..layers)
                .map(|_| Array::zeros(&shape, self.dtype))
                .collect::<mlx::Result<_>>()?;
            self.v = (0..layers)
                .map(|_| Array::zeros(&shape, self.dtype))
                .collect::<mlx::Result<_>>()?;
        } else {
            let extra = [
                shape[0],
                shape[1],
                (new_cap - self.capacity) as i32,
                shape[3],
            ];
            for pool in self.k.iter_mut().chain(self.v.iter_mut()) {
                let pad = Array::zeros(&extra, self.dtype)?;
                *pool = mlx::concatenate(&[pool, &pad], 2)?;
            }
        }
        self.capacity = new_cap;
        Ok(())
    }

    /// Write `k`/`v` (`[1, kv_heads, T, head_dim]`) for `slot` at position `pos` of `layer`;
    /// return the slot's keys and values for positions `0..pos+T` (`[1, kv_heads, pos+T, head_dim]`).
    pub fn write_and_read(
        &mut self,
        layer: usize,
        slot: usize,
        pos: usize,
        k: &Array,
        v: &Array,
    ) -> mlx::Result<(Array, Array)> {
        let t = k.dim(2) as usize;
        let s = slot as i32;
        let (p0, p1) = (pos as i32, (pos + t) as i32);
        let (h, d) = (self.kv_heads as i32, self.head_dim as i32);
        let lo = [s, 0, p0, 0];
        let hi = [s + 1, h, p1, d];
        let ones = [1, 1, 1, 1];
        self.k[layer] = self.k[layer].slice_update(&k.astype(self.dtype)?, &lo, &hi, &ones)?;
        self.v[layer] = self.v[layer].slice_update(&v.astype(self.dtype)?, &lo, &hi, &ones)?;
        let rlo = [s, 0, 0, 0];
        Ok((
            self.k[layer].slice(&rlo, &hi, &ones)?,
            self.v[layer].slice(&rlo, &hi, &ones)?,
        ))
    }

    /// Index arrays and attention masks for a batched decode step over `slots` at
    /// `positions`, built once per step and shared by every layer. Rows whose slots are
    /// consecutive form a run; each run reads the pool as one view (no copy of the cache).
    pub fn batch_index(&self, slots: &[usize], positions: &[usize]) -> mlx::Result<BatchIndex> {
        let to_arr = |v: &[usize]| {
            let v: Vec<i32> = v.iter().map(|&x| x as i32).collect();
            Array::from_slice(&v, &[v.len() as i32])
        };
        let mut runs = Vec::new();
        let mut start = 0;
        for i in 1..=slots.len() {
            if i == slots.len() || slots[i] != slots[i - 1] + 1 {
                let max_len = positions[start..i].iter().max().map_or(0, |&p| p + 1);
                // row r attends to positions 0..=positions[r]
                let lens: Vec<i32> = positions[start..i].iter().map(|&p| p as i32 + 1).collect();
                let lens = Array::from_slice(&lens, &[lens.len() as i32, 1, 1, 1])?;
                let mask = Array::arange(0.0, max_len as f64, 1.0, Dtype::I32)?
                    .reshape(&[1, 1, 1, max_len as i32])?
                    .lt(&lens)?;
                runs.push(Run {
                    rows: start..i,
                    first_slot: slots[start],
                    max_len,
                    mask,
                });
                start = i;
            }
        }
        Ok(BatchIndex {
            rows: slots.len(),
            slot_idx: to_arr(slots)?,
            pos_idx: to_arr(positions)?,
            runs,
        })
    }

    /// Batched decode: write one token per sequence (`k`, `v`: `[B, kv_heads, 1, head_dim]`) at
    /// its position in its slot, with one scatter per pool.
    pub fn write_batch(
        &mut self,
        layer: usize,
        idx: &BatchIndex,
        k: &Array,
        v: &Array,
    ) -> mlx::Result<()> {
        let (h, d) = (self.kv_heads as i32, self.head_dim as i32);
        let upd_shape = [idx.rows as i32, 1, h, 1, d];
        let k = k.astype(self.dtype)?.reshape(&upd_shape)?;
        let v = v.astype(self.dtype)?.reshape(&upd_shape)?;
        let at = [&idx.slot_idx, &idx.pos_idx];
        self.k[layer] = self.k[layer].scatter(&at, &k, &[0, 2])?;
        self.v[layer] = self.v[layer].scatter(&at, &v, &[0, 2])?;
        Ok(())
    }

    /// Keys and values of one run's slots, `[rows, kv_heads, max_len, head_dim]`: a view of the pool.
    pub fn read_run(&self, layer: usize, run: &Run) -> mlx::Result<(Array, Array)> {
        let (h, d) = (self.kv_heads as i32, self.head_dim as i32);
        let s0 = run.first_slot as i32;
        let lo = [s0, 0, 0, 0];
        let hi = [s0 + run.rows.len() as i32, h, run.max_len as i32, d];
        let ones = [1, 1, 1, 1];
        Ok((
            self.k[layer].slice(&lo, &hi, &ones)?,
            self.v[layer].slice(&lo, &hi, &ones)?,
        ))
    }

    /// Bytes held by the pools.
    pub fn nbytes(&self) -> usize {
        self.k.iter().chain(self.v.iter()).map(|a| a.nbytes()).sum()
    }
}
