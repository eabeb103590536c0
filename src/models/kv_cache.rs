//! Slot-based KV cache: per layer one pool `[slots, 2·kv_heads, capacity, head_dim]`
//! holding a slot's key heads and then its value heads, grown in steps, with a length
//! per slot. A sequence owns a slot while it runs; the model writes its new keys/values
//! at the slot's current length (one update when they come as one `[.., 2·kv_heads, ..]`
//! array, as the fused q/k/v kernel writes them) and reads the prefix back as views.
use crate::kernels;
use crate::mlx::{self, Array, Dtype};

/// Where a batched decode step writes and reads (see [`KvCache::batch_index`]).
pub struct BatchIndex {
    rows: usize,
    slot_idx: Array,
    pos_idx: Array,
    /// Maximal runs of batch rows with consecutive slots.
    pub runs: Vec<Run>,
}

impl BatchIndex {
    /// The rows' slots, int32 `[B]`.
    pub fn slot_array(&self) -> &Array {
        &self.slot_idx
    }
}

/// Batch rows `rows` hold consecutive slots from `first_slot`; `mask` (`[n, 1, 1, max_len]`)
/// hides each row's positions past its own length.
pub struct Run {
    pub rows: std::ops::Range<usize>,
    first_slot: usize,
    max_len: usize,
    pub mask: Array,
}

/// A step's new keys and values (`[B, kv_heads, T, head_dim]` each), or both as one
/// array (`[B, 2·kv_heads, T, head_dim]`, key heads first) as the pool stores them.
pub enum NewKv {
    Split(Array, Array),
    Merged(Array),
}

pub struct KvCache {
    /// one pool per layer, keys and values
    kv: Vec<Array>,
    lens: Vec<usize>,
    slots: usize,
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    max_capacity: usize,
    step: usize,
    dtype: Dtype,
    /// the decode attention kernel's scratch and the query heads it was made for
    attn_scratch: Option<(usize, kernels::attn::Scratch)>,
}

#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("sequence needs {needed} positions but the context is {max} (--ctx-size)")]
    ContextFull { needed: usize, max: usize },
    #[error("slot {slot} out of range: the cache has {slots} slot(s)")]
    BadSlot { slot: usize, slots: usize },
    #[error("slot {slot} holds {held} positions, fewer than the {len} to copy")]
    ShortPrefix {
        slot: usize,
        held: usize,
        len: usize,
    },
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
            kv: Vec::with_capacity(layers),
            lens: vec![0; slots],
            slots,
            kv_heads,
            head_dim,
            capacity: 0,
            max_capacity,
            step: 256,
            dtype,
            attn_scratch: None,
        }
    }

    pub fn num_layers(&self) -> usize {
        self.kv.capacity().max(self.kv.len())
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
        if needed <= self.capacity && self.kv.len() == layers {
            return Ok(());
        }
        let new_cap = needed
            .div_ceil(self.step)
            .saturating_mul(self.step)
            .min(self.max_capacity)
            .max(needed);
        let shape = [
            self.slots as i32,
            2 * self.kv_heads as i32,
            new_cap as i32,
            self.head_dim as i32,
        ];
        if self.kv.len() != layers {
            self.kv = (0..layers)
                .map(|_| Array::zeros(&shape, self.dtype))
                .collect::<mlx::Result<_>>()?;
        } else {
            let extra = [
                shape[0],
                shape[1],
                (new_cap - self.capacity) as i32,
                shape[3],
            ];
            for pool in self.kv.iter_mut() {
                let pad = Array::zeros(&extra, self.dtype)?;
                *pool = mlx::concatenate(&[pool, &pad], 2)?;
            }
        }
        self.capacity = new_cap;
        Ok(())
    }

    /// Write `new` (one sequence, `T` positions) for `slot` at position `pos` of `layer`;
    /// return the slot's keys and values for positions `0..pos+T` (`[1, kv_heads,
    /// pos+T, head_dim]` each, views of the pool).
    pub fn write_and_read(
        &mut self,
        layer: usize,
        slot: usize,
        pos: usize,
        new: &NewKv,
    ) -> mlx::Result<(Array, Array)> {
        let p1 = self.write(layer, slot, pos, new)? as i32;
        let (s, h, d) = (slot as i32, self.kv_heads as i32, self.head_dim as i32);
        let ones = [1, 1, 1, 1];
        let pool = &self.kv[layer];
        Ok((
            pool.slice(&[s, 0, 0, 0], &[s + 1, h, p1, d], &ones)?,
            pool.slice(&[s, h, 0, 0], &[s + 1, 2 * h, p1, d], &ones)?,
        ))
    }

    /// The pool of `layer`, `[slots, 2·kv_heads, capacity, head_dim]` (key heads first).
    pub fn pool(&self, layer: usize) -> &Array {
        &self.kv[layer]
    }

    /// The decode attention kernel's scratch for `q_heads` query heads, made on first use.
    /// One scratch serves every layer and step: the kernels that use it must run one after
    /// another, as a step's layers do (each reads the previous one's output) and as
    /// separately evaluated steps do on one stream. Two batched forwards built into one
    /// graph without a dependency between them must not share it.
    pub fn attn_scratch(&mut self, q_heads: usize) -> mlx::Result<&kernels::attn::Scratch> {
        if self
            .attn_scratch
            .as_ref()
            .is_none_or(|(q, _)| *q != q_heads)
        {
            let s = kernels::attn::Scratch::new(self.slots, q_heads, self.kv_heads, self.head_dim)?;
            self.attn_scratch = Some((q_heads, s));
        }
        Ok(&self.attn_scratch.as_ref().expect("set above").1)
    }

    /// Write `new` (one sequence, `T` positions) for `slot` at position `pos` of `layer`
    /// (one update of the pool); returns `pos + T`.
    pub fn write(
        &mut self,
        layer: usize,
        slot: usize,
        pos: usize,
        new: &NewKv,
    ) -> mlx::Result<usize> {
        let s = slot as i32;
        let (h, d) = (self.kv_heads as i32, self.head_dim as i32);
        let ones = [1, 1, 1, 1];
        let t = match new {
            NewKv::Split(k, _) | NewKv::Merged(k) => k.dim(2),
        };
        let (p0, p1) = (pos as i32, pos as i32 + t);
        let pool = &mut self.kv[layer];
        match new {
            NewKv::Merged(kv) => {
                *pool = pool.slice_update(
                    &kv.astype(self.dtype)?,
                    &[s, 0, p0, 0],
                    &[s + 1, 2 * h, p1, d],
                    &ones,
                )?;
            }
            NewKv::Split(k, v) => {
                *pool = pool.slice_update(
                    &k.astype(self.dtype)?,
                    &[s, 0, p0, 0],
                    &[s + 1, h, p1, d],
                    &ones,
                )?;
                *pool = pool.slice_update(
                    &v.astype(self.dtype)?,
                    &[s, h, p0, 0],
                    &[s + 1, 2 * h, p1, d],
                    &ones,
                )?;
            }
        }
        Ok(p1 as usize)
    }

    /// Index arrays and attention masks for a batched decode step over `slots` at
    /// `positions`, built once per step and shared by every layer. Rows whose slots are
    /// consecutive form a run; each run reads the pool as one view (no copy of the cache).
    /// `with_runs = false` skips the runs and their masks (a step that attends with
    /// `kernels::attn` needs neither).
    pub fn batch_index(
        &self,
        slots: &[usize],
        positions: &[usize],
        with_runs: bool,
    ) -> mlx::Result<BatchIndex> {
        let to_arr = |v: &[usize]| {
            let v: Vec<i32> = v.iter().map(|&x| x as i32).collect();
            Array::from_slice(&v, &[v.len() as i32])
        };
        let mut runs = Vec::new();
        let mut start = 0;
        // no rows to walk when the runs are not wanted
        let ends = if with_runs { slots.len() } else { 0 };
        for i in 1..=ends {
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

    /// Batched decode: write one token per sequence (`[B, kv_heads, 1, head_dim]` keys and
    /// values) at its position in its slot, with one scatter.
    pub fn write_batch(&mut self, layer: usize, idx: &BatchIndex, new: &NewKv) -> mlx::Result<()> {
        let (h, d) = (self.kv_heads as i32, self.head_dim as i32);
        let kv = match new {
            NewKv::Merged(kv) => kv.clone(),
            NewKv::Split(k, v) => mlx::concatenate(&[k, v], 1)?,
        };
        let kv = kv
            .astype(self.dtype)?
            .reshape(&[idx.rows as i32, 1, 2 * h, 1, d])?;
        let at = [&idx.slot_idx, &idx.pos_idx];
        self.kv[layer] = self.kv[layer].scatter(&at, &kv, &[0, 2])?;
        Ok(())
    }

    /// Keys and values of one run's slots, `[rows, kv_heads, max_len, head_dim]`: views of the pool.
    pub fn read_run(&self, layer: usize, run: &Run) -> mlx::Result<(Array, Array)> {
        let (h, d) = (self.kv_heads as i32, self.head_dim as i32);
        let s0 = run.first_slot as i32;
        let s1 = s0 + run.rows.len() as i32;
        let len = run.max_len as i32;
        let ones = [1, 1, 1, 1];
        let pool = &self.kv[layer];
        Ok((
            pool.slice(&[s0, 0, 0, 0], &[s1, h, len, d], &ones)?,
            pool.slice(&[s0, h, 0, 0], &[s1, 2 * h, len, d], &ones)?,
        ))
    }

    /// Make slot `dst` hold the first `len` positions of slot `src` (its length becomes
    /// `len`), so sequences with one prompt share its prefill: the choices of an `n` > 1
    /// request prefill the prompt once and each continues from a copy. Here it copies
    /// (one update per layer pool, after the copied rows are made contiguous and
    /// evaluated, so the update is done in place); a paged cache implements it as block
    /// sharing: `dst`'s block table points at `src`'s full blocks (reference counted),
    /// and only a partly filled last block is copied (or shared copy-on-write).
    pub fn copy_prefix(&mut self, src: usize, dst: usize, len: usize) -> Result<(), KvError> {
        self.check_slot(src)?;
        self.check_slot(dst)?;
        if len > self.lens[src] {
            return Err(KvError::ShortPrefix {
                slot: src,
                held: self.lens[src],
                len,
            });
        }
        if src != dst && len > 0 {
            let (h2, d) = (2 * self.kv_heads as i32, self.head_dim as i32);
            let (s, t, l) = (src as i32, dst as i32, len as i32);
            let ones = [1, 1, 1, 1];
            let rows: Vec<Array> = self
                .kv
                .iter()
                .map(|pool| {
                    pool.slice(&[s, 0, 0, 0], &[s + 1, h2, l, d], &ones)?
                        .contiguous()
                })
                .collect::<mlx::Result<_>>()?;
            mlx::eval(&rows.iter().collect::<Vec<_>>())?;
            for (pool, r) in self.kv.iter_mut().zip(&rows) {
                *pool = pool.slice_update(r, &[t, 0, 0, 0], &[t + 1, h2, l, d], &ones)?;
            }
        }
        self.lens[dst] = len;
        Ok(())
    }

    /// Bytes held by the pools.
    pub fn nbytes(&self) -> usize {
        self.kv.iter().map(|a| a.nbytes()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(shape: &[i32], from: f32) -> Array {
        let n: i32 = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| from + i as f32).collect();
        Array::from_slice(&v, shape).unwrap()
    }

    fn read(a: &Array) -> Vec<f32> {
        a.to_vec::<f32>().unwrap()
    }

    /// `copy_prefix` gives the destination slot the source's first positions and
    /// length, leaves the other slots alone, and refuses more than the source holds.
    #[test]
    fn copy_prefix_copies_the_first_positions() {
        let (h, d) = (2i32, 4i32);
        let mut c = KvCache::new(2, 3, h as usize, d as usize, Dtype::F32, 64);
        c.reserve(2, 8).unwrap();
        for layer in 0..2 {
            let kv = values(&[1, 2 * h, 5, d], 10.0 * layer as f32);
            c.write(layer, 0, 0, &NewKv::Merged(kv)).unwrap();
        }
        c.advance(0, 5);
        c.copy_prefix(0, 2, 4).unwrap();
        assert_eq!(c.len(2), 4);
        let idx = c.batch_index(&[0, 1, 2], &[3, 3, 3], true).unwrap();
        for layer in 0..2 {
            let (k, v) = c.read_run(layer, &idx.runs[0]).unwrap();
            let (k, v) = (read(&k), read(&v));
            let row = (h * 4 * d) as usize;
            assert_eq!(k[..row], k[2 * row..], "layer {layer} keys");
            assert_eq!(v[..row], v[2 * row..], "layer {layer} values");
            assert!(k[row..2 * row].iter().all(|&x| x == 0.0));
            assert_eq!(k[0], 10.0 * layer as f32);
        }
        assert!(matches!(
            c.copy_prefix(0, 1, 6),
            Err(KvError::ShortPrefix { held: 5, .. })
        ));
        assert!(c.copy_prefix(0, 3, 1).is_err());
    }

    /// A step that attends with the kernel gets the rows' slots and no runs (no masks).
    #[test]
    fn batch_index_without_runs_has_the_slots_only() {
        let cache = KvCache::new(1, 4, 2, 4, Dtype::F32, 64);
        let idx = cache.batch_index(&[3, 0, 1], &[5, 2, 7], false).unwrap();
        assert!(idx.runs.is_empty());
        assert_eq!(idx.slot_array().to_vec::<i32>().unwrap(), vec![3, 0, 1]);
        let with = cache.batch_index(&[3, 0, 1], &[5, 2, 7], true).unwrap();
        let rows: Vec<_> = with.runs.iter().map(|r| r.rows.clone()).collect();
        assert_eq!(rows, vec![0..1, 1..3]);
    }

    /// Keys and values written as one `[.., 2·kv_heads, ..]` array (as the fused q/k/v
    /// kernel writes them) and written separately read back the same, for one sequence
    /// and for a batched decode step; the other slot is untouched.
    #[test]
    fn merged_and_split_writes_agree() {
        let (layers, slots, h, d) = (2usize, 3usize, 2i32, 4i32);
        let mut split = KvCache::new(layers, slots, h as usize, d as usize, Dtype::F32, 64);
        let mut merged = KvCache::new(layers, slots, h as usize, d as usize, Dtype::F32, 64);
        for c in [&mut split, &mut merged] {
            c.reserve(layers, 8).unwrap();
        }
        // a 3-token prompt in slot 1 of layer 1
        let k = values(&[1, h, 3, d], 0.0);
        let v = values(&[1, h, 3, d], 100.0);
        let kv = mlx::concatenate(&[&k, &v], 1).unwrap();
        let (ks, vs) = split
            .write_and_read(1, 1, 0, &NewKv::Split(k.clone(), v.clone()))
            .unwrap();
        let (km, vm) = merged.write_and_read(1, 1, 0, &NewKv::Merged(kv)).unwrap();
        assert_eq!(read(&ks), read(&k));
        assert_eq!(read(&vs), read(&v));
        assert_eq!(read(&km), read(&k));
        assert_eq!(read(&vm), read(&v));
        for c in [&mut split, &mut merged] {
            c.advance(1, 3);
        }
        // a batched decode step: slot 1 at position 3, slot 2 at position 0
        let k1 = values(&[2, h, 1, d], 1000.0);
        let v1 = values(&[2, h, 1, d], 2000.0);
        let kv1 = mlx::concatenate(&[&k1, &v1], 1).unwrap();
        let idx = split.batch_index(&[1, 2], &[3, 0], true).unwrap();
        split
            .write_batch(1, &idx, &NewKv::Split(k1.clone(), v1.clone()))
            .unwrap();
        merged.write_batch(1, &idx, &NewKv::Merged(kv1)).unwrap();
        let (ks, vs) = split.read_run(1, &idx.runs[0]).unwrap();
        let (km, vm) = merged.read_run(1, &idx.runs[0]).unwrap();
        assert_eq!(ks.shape(), vec![2, h, 4, d]);
        assert_eq!(read(&ks), read(&km));
        assert_eq!(read(&vs), read(&vm));
        // slot 1: the prompt's keys then the new one; slot 2: the new one at position 0
        let kk = read(&ks);
        let (row, head) = ((h * 4 * d) as usize, (4 * d) as usize);
        assert_eq!(kk[..3 * d as usize], read(&k)[..3 * d as usize]);
        assert_eq!(kk[3 * d as usize], 1000.0);
        assert_eq!(kk[row], 1000.0 + (h * d) as f32);
        assert_eq!(read(&vs)[row + head], 2000.0 + ((h + 1) * d) as f32);
        // slot 0 was never written
        let idx0 = merged.batch_index(&[0], &[0], true).unwrap();
        let (k0, v0) = merged.read_run(1, &idx0.runs[0]).unwrap();
        assert!(read(&k0).iter().chain(read(&v0).iter()).all(|&x| x == 0.0));
        assert_eq!(merged.nbytes(), split.nbytes());
        // capacity grows in steps of 256 positions, capped at the 64 of the context
        assert_eq!(
            split.nbytes(),
            layers * slots * 2 * h as usize * 64 * d as usize * 4
        );
    }
}
