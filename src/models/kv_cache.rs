//! Paged KV cache: per layer one pool `[1, 2·kv_heads, blocks·block_size, head_dim]`
//! holding key heads and then value heads, its position axis cut into fixed-size blocks.
//! A sequence's positions live in the blocks of its block table (position p at block
//! `table[p / block_size]`, row `p % block_size`), so sequences take memory as they grow
//! and may share blocks (a cached prompt prefix). The driver (the scheduler) owns the
//! tables and sends them with each step; without a table (`mlxcel generate`, `bench`) a
//! slot owns the fixed blocks `j·slots + slot`, which keeps one slot's positions in one
//! run of rows. The model writes new keys/values at the rows of their positions (one
//! update, or one scatter) and reads a sequence's prefix back as a view of the pool when
//! its rows are one run, by a gather (`take`) otherwise; the decode kernel
//! (`kernels::attn`) reads through the table itself.
//!
//! A write must reuse the pool's buffer: MLX updates an array in place only while nothing
//! else references its buffer, and otherwise copies it whole (a layer's pool: gigabytes
//! on a GPU whose memory the pool fills). Two rules keep it so. Every read goes through
//! an unowned view ([`Array::unowned_slice`]), which does not keep the buffer referenced
//! while the read is queued on the device (an ordinary view does, until the device has
//! run it, so the next step's write would copy whenever the device lags behind the
//! host); the cache owns the buffer meanwhile, and waits for the device before it lets
//! go of it. And a step writes each layer's pool once, before any read of it
//! ([`KvCache::write_step`] takes all of a step's sequences): a second write after a
//! read of the same step would copy. [`KvCache::check_in_place`] counts the writes
//! that copied anyway.
use crate::kernels;
use crate::mlx::{self, Array, Dtype};

/// Tokens per block unless configured: the decode kernel's tile is 32 positions, so a
/// tile never straddles two blocks (see `kernels/attn.cu`).
pub const DEFAULT_BLOCK_SIZE: usize = 32;

/// Size of the block pool of each layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvConfig {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Allocate the whole pool at the first step (a pool sized by a memory budget);
    /// otherwise it grows with the highest block used.
    pub preallocate: bool,
}

impl KvConfig {
    /// Room for `slots` sequences of `ctx` tokens each, grown as used.
    pub fn for_slots(slots: usize, ctx: usize, block_size: usize) -> KvConfig {
        let block_size = block_size.max(1);
        KvConfig {
            block_size,
            num_blocks: slots.max(1) * ctx.div_ceil(block_size),
            preallocate: false,
        }
    }
}

/// Where a batched decode step writes and reads (see [`KvCache::batch_index`]).
pub struct BatchIndex {
    rows: usize,
    /// each batch row's position (its new token's), int32 `[B]`
    positions: Array,
    /// pool row of each batch row's new token, int32 `[B]`, and on the host
    write_rows: Array,
    write: Vec<i32>,
    /// block tables, int32 `[B, max blocks]` (for the decode kernel)
    table: Option<Array>,
    /// for MLX's attention: every row's pool rows, int32 `[B·L]`, its mask `[B, 1, 1, L]`, L
    gather: Option<(Array, Array, usize)>,
}

impl BatchIndex {
    /// The rows' block tables, int32 `[B, max blocks]` (made when the kernel attends).
    pub fn table(&self) -> Option<&Array> {
        self.table.as_ref()
    }

    /// Each batch row's position, int32 `[B]` (the RoPE angle and the attention's length).
    pub fn positions(&self) -> &Array {
        &self.positions
    }

    /// Each batch row's pool row, int32 `[B]`: where the step's keys and values go (also
    /// for a q/k/v kernel that writes the pool).
    pub fn kv_dst(&self) -> &Array {
        &self.write_rows
    }
}

/// Where one sequence's step writes and reads (see [`KvCache::seq_rows`]).
pub enum SeqRows {
    /// Positions `0..pos+T` are pool rows `start..start+pos+T`: read as a view.
    Run { start: usize, pos: usize, t: usize },
    /// Scattered: the new positions' rows `[T]` (also on the host, `rows`) and every
    /// position's rows `[pos+T]`.
    Gather {
        write: Array,
        rows: Vec<i32>,
        read: Array,
    },
}

impl SeqRows {
    pub fn is_run(&self) -> bool {
        matches!(self, SeqRows::Run { .. })
    }

    /// The pool rows of the step's new positions.
    fn write_rows(&self) -> Vec<i32> {
        match self {
            SeqRows::Run { start, pos, t } => {
                ((start + pos) as i32..(start + pos + t) as i32).collect()
            }
            SeqRows::Gather { rows, .. } => rows.clone(),
        }
    }
}

/// A step's new keys and values (`[B, kv_heads, T, head_dim]` each), or both as one
/// array (`[B, 2·kv_heads, T, head_dim]`, key heads first) as the pool stores them, or
/// already in the pool (`Written`: the q/k/v kernel wrote them at the rows of
/// [`KvCache::seq_kv_dst`] / [`BatchIndex::kv_dst`]).
pub enum NewKv {
    Split(Array, Array),
    Merged(Array),
    Written,
}

impl NewKv {
    fn merged(&self) -> mlx::Result<Array> {
        match self {
            NewKv::Merged(kv) => Ok(kv.clone()),
            NewKv::Split(k, v) => mlx::concatenate(&[k, v], 1),
            NewKv::Written => Err(mlx::MlxError::Invalid(
                "KV cache: keys and values already written into the pool".into(),
            )),
        }
    }
}

/// The rows a step writes into every layer's pool, int32 `[R]` (see [`KvCache::write_step`]):
/// a batched decode's rows first, then each prefill chunk's, in order.
pub struct StepWrites {
    rows: Array,
    /// the batched decode's rows at the front of `rows`
    decode_rows: i32,
}

pub struct KvCache {
    /// one pool per layer, keys and values
    kv: Vec<Array>,
    lens: Vec<usize>,
    /// per slot its block table; `None`: the slot's fixed blocks
    tables: Vec<Option<Vec<u32>>>,
    slots: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    num_blocks: usize,
    /// blocks the pools hold now
    cap_blocks: usize,
    /// blocks added at a time when the pools grow
    grow_blocks: usize,
    /// the whole pool is made at the first step (sized by a memory budget)
    preallocate: bool,
    max_len: usize,
    dtype: Dtype,
    /// the decode attention kernel's scratch and the query heads it was made for
    attn_scratch: Option<(usize, kernels::attn::Scratch)>,
    /// per layer the unowned views of its pool made since its last write (see
    /// [`KvCache::settle`])
    reads: std::cell::RefCell<Vec<Vec<Array>>>,
    /// per layer the last whole-pool view made (see [`KvCache::pool_view`])
    whole: std::cell::RefCell<Vec<Option<Array>>>,
    /// per layer the pool's buffer as last seen (0: not seen since it was made)
    buffers: Vec<u64>,
    /// writes that copied a layer's pool instead of updating it in place
    copies: u64,
}

/// What [`KvCache::save`] keeps.
pub struct CacheState {
    kv: Vec<Array>,
    lens: Vec<usize>,
    tables: Vec<Option<Vec<u32>>>,
    cap_blocks: usize,
    reads: Vec<Vec<Array>>,
    buffers: Vec<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("sequence needs {needed} positions but the context is {max} (--ctx-size)")]
    ContextFull { needed: usize, max: usize },
    #[error("slot {slot} out of range: the cache has {slots} slot(s)")]
    BadSlot { slot: usize, slots: usize },
    #[error("slot {slot}: position {pos} has no block (its table has {blocks}; the pool has {pool} blocks)")]
    NoBlock {
        slot: usize,
        pos: usize,
        blocks: usize,
        pool: usize,
    },
    #[error("slot {slot} holds {held} positions, fewer than the {len} to share")]
    ShortPrefix {
        slot: usize,
        held: usize,
        len: usize,
    },
    #[error("a fork's block {block} is not slot {slot}'s (full blocks are shared)")]
    NotShared { slot: usize, block: usize },
    #[error(transparent)]
    Mlx(#[from] mlx::MlxError),
}

/// Writes of every cache in this process that copied a layer's pool (see
/// [`KvCache::check_in_place`]).
static POOL_COPIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Writes into a KV pool of this process, so far, that copied the pool instead of updating
/// it in place (0 expected).
pub fn pool_copies_total() -> u64 {
    POOL_COPIES.load(std::sync::atomic::Ordering::Relaxed)
}

thread_local! {
    /// Views of a pool this thread's writes evaluated first ([`KvCache::settle`]).
    static SETTLED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Views of a pool that this thread's writes into it evaluated first, so far (none where
/// every step is evaluated before the next one's writes and no view is left unused).
pub fn views_settled() -> u64 {
    SETTLED.with(|n| n.get())
}

fn i32_array(v: &[i32], shape: &[i32]) -> mlx::Result<Array> {
    let mut a = step_i32(&[(v, shape)])?;
    Ok(a.pop().expect("one part"))
}

/// Int32 inputs of a step's kernels: in device memory on CUDA
/// ([`mlx::device_inputs`]; `MLXCEL_DEVICE_INPUTS=0`: host arrays, as MLX makes them).
pub fn step_i32(parts: &[(&[i32], &[i32])]) -> mlx::Result<Vec<Array>> {
    if kernels::knobs::get().device_inputs {
        mlx::device_inputs::device_i32_parts(parts)
    } else {
        parts.iter().map(|(v, s)| Array::from_slice(v, s)).collect()
    }
}

impl KvCache {
    /// An empty cache of `slots` sequences of at most `max_len` tokens over the pool of
    /// `kv`; memory is allocated on first use.
    pub fn new(
        layers: usize,
        slots: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: Dtype,
        max_len: usize,
        kv: KvConfig,
    ) -> Self {
        let bs = kv.block_size.max(1);
        let grow_blocks = if kv.preallocate {
            kv.num_blocks
        } else {
            256usize.div_ceil(bs)
        };
        KvCache {
            kv: Vec::with_capacity(layers),
            lens: vec![0; slots],
            tables: vec![None; slots],
            slots,
            kv_heads,
            head_dim,
            block_size: bs,
            num_blocks: kv.num_blocks,
            cap_blocks: 0,
            grow_blocks: grow_blocks.max(1),
            preallocate: kv.preallocate,
            max_len,
            dtype,
            attn_scratch: None,
            reads: std::cell::RefCell::new(vec![Vec::new(); layers]),
            whole: std::cell::RefCell::new(vec![None; layers]),
            buffers: Vec::new(),
            copies: 0,
        }
    }

    pub fn num_layers(&self) -> usize {
        self.kv.capacity().max(self.kv.len())
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn max_capacity(&self) -> usize {
        self.max_len
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Whether the whole pool is made at the first step (a pool sized by a memory budget),
    /// and has been.
    pub fn preallocated(&self) -> bool {
        self.preallocate && self.cap_blocks == self.num_blocks && !self.kv.is_empty()
    }

    /// Tokens held for `slot`.
    pub fn len(&self, slot: usize) -> usize {
        self.lens[slot]
    }

    /// Forget a slot's contents and table (the memory is reused).
    pub fn reset(&mut self, slot: usize) {
        self.lens[slot] = 0;
        self.tables[slot] = None;
    }

    /// The pools and the slots' state as they are now (array handles: no copy), for
    /// [`KvCache::restore`]: a graph built between the two (and never evaluated) leaves
    /// nothing behind that later steps build on or evaluate.
    pub fn save(&self) -> CacheState {
        CacheState {
            kv: self.kv.clone(),
            lens: self.lens.clone(),
            tables: self.tables.clone(),
            cap_blocks: self.cap_blocks,
            reads: self.reads.borrow().clone(),
            buffers: self.buffers.clone(),
        }
    }

    /// Back to the state [`KvCache::save`] took.
    pub fn restore(&mut self, s: CacheState) {
        self.kv = s.kv;
        self.lens = s.lens;
        self.tables = s.tables;
        self.cap_blocks = s.cap_blocks;
        *self.reads.borrow_mut() = s.reads;
        self.buffers = s.buffers;
        // a kept pool view made since the save may be one a dropped graph never evaluated:
        // it would hold its pool (the next write would copy it) and no settle would see it
        self.whole.borrow_mut().iter_mut().for_each(|w| *w = None);
    }

    /// Start `slot` over with its first `pos` positions already in the blocks of `table`
    /// (a cached prefix, or none).
    pub fn restart(&mut self, slot: usize, pos: usize, table: Option<&[u32]>) {
        self.lens[slot] = pos;
        self.tables[slot] = table.map(<[u32]>::to_vec);
    }

    /// Set `slot`'s block table (the driver's, covering at least the step's positions).
    pub fn set_table(&mut self, slot: usize, table: &[u32]) {
        match &mut self.tables[slot] {
            Some(t) if t.as_slice() == table => {}
            t => *t = Some(table.to_vec()),
        }
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

    /// Block `j` of `slot`.
    fn block(&self, slot: usize, j: usize) -> Result<usize, KvError> {
        let b = match &self.tables[slot] {
            Some(t) => t.get(j).map(|&b| b as usize),
            None => Some(j * self.slots + slot),
        };
        match b {
            Some(b) if b < self.num_blocks => Ok(b),
            _ => Err(KvError::NoBlock {
                slot,
                pos: j * self.block_size,
                blocks: self.tables[slot].as_ref().map_or(0, Vec::len),
                pool: self.num_blocks,
            }),
        }
    }

    /// Pool rows of positions `from..to` of `slot`.
    fn rows(&self, slot: usize, from: usize, to: usize) -> Result<Vec<i32>, KvError> {
        let bs = self.block_size;
        let mut out = Vec::with_capacity(to.saturating_sub(from));
        let mut p = from;
        while p < to {
            let j = p / bs;
            let b = self.block(slot, j)?;
            let end = ((j + 1) * bs).min(to);
            out.extend((p..end).map(|q| (b * bs + q % bs) as i32));
            p = end;
        }
        Ok(out)
    }

    /// Make sure each `(slot, end)` has blocks for positions `0..end` within the context,
    /// and the pools hold those blocks.
    pub fn prepare(&mut self, layers: usize, needs: &[(usize, usize)]) -> Result<(), KvError> {
        let mut top = 0;
        for &(slot, end) in needs {
            self.check_slot(slot)?;
            if end > self.max_len {
                return Err(KvError::ContextFull {
                    needed: end,
                    max: self.max_len,
                });
            }
            for j in 0..end.div_ceil(self.block_size) {
                top = top.max(self.block(slot, j)? + 1);
            }
        }
        self.grow(layers, top)?;
        Ok(())
    }

    /// Grow the pools to hold blocks `0..top` (in steps, at most the whole pool).
    fn grow(&mut self, layers: usize, top: usize) -> mlx::Result<()> {
        if top <= self.cap_blocks && self.kv.len() == layers {
            return Ok(());
        }
        let new_cap = top
            .div_ceil(self.grow_blocks)
            .saturating_mul(self.grow_blocks)
            .min(self.num_blocks)
            .max(top);
        let shape = |blocks: usize| {
            [
                1,
                2 * self.kv_heads as i32,
                (blocks * self.block_size) as i32,
                self.head_dim as i32,
            ]
        };
        if self.kv.len() != layers {
            // reads of the pools it replaces may still be queued (they do not own them)
            if !self.kv.is_empty() {
                mlx::synchronize()?;
            }
            self.kv = (0..layers)
                .map(|_| Array::zeros(&shape(new_cap), self.dtype))
                .collect::<mlx::Result<_>>()?;
        } else {
            // (the concatenation holds the old pool until the device has run it, so the
            // reads queued before it still find it)
            for layer in 0..layers {
                self.settle(layer)?;
                let pad = Array::zeros(&shape(new_cap - self.cap_blocks), self.dtype)?;
                let pool = &mut self.kv[layer];
                *pool = mlx::concatenate(&[pool, &pad], 2)?;
            }
        }
        self.buffers = vec![0; layers];
        self.cap_blocks = new_cap;
        Ok(())
    }

    /// After a step was evaluated (or queued): count the layers whose pool was copied by
    /// its write rather than updated in place (see the module's notes), and return how
    /// many. A pool made or grown since the last check is not counted.
    pub fn check_in_place(&mut self) -> usize {
        let mut copied = 0;
        for (seen, pool) in self.buffers.iter_mut().zip(&self.kv) {
            let id = pool.buffer_id();
            if id == 0 {
                continue;
            }
            if *seen != 0 && *seen != id {
                copied += 1;
            }
            *seen = id;
        }
        self.copies += copied as u64;
        POOL_COPIES.fetch_add(copied as u64, std::sync::atomic::Ordering::Relaxed);
        if copied > 0 {
            // the copied pool's old buffer goes with its last owner, and reads of it may
            // still be queued (unowned): let them run first
            let _ = mlx::synchronize();
        }
        copied
    }

    /// Unowned views `[start, stop)` of `layer`'s pool, made by one op and remembered until
    /// the pool's next write (see [`KvCache::settle`]).
    fn unowned_views(&self, layer: usize, ranges: &[(&[i32], &[i32])]) -> mlx::Result<Vec<Array>> {
        let v = self.kv[layer].unowned_slices(ranges)?;
        if let Some(r) = self.reads.borrow_mut().get_mut(layer) {
            r.extend(v.iter().cloned());
        }
        Ok(v)
    }

    /// One unowned view of `layer`'s pool (see [`KvCache::unowned_views`]).
    fn unowned(&self, layer: usize, start: &[i32], stop: &[i32]) -> mlx::Result<Array> {
        Ok(self
            .unowned_views(layer, &[(start, stop)])?
            .pop()
            .expect("one view"))
    }

    /// Before a write into `layer`'s pool: evaluate the views of it made since its last
    /// write that are not yet (a view not yet evaluated holds the pool, so the write would
    /// copy it; once evaluated it does not). The steps write each pool once, after
    /// evaluating the step before, so this finds nothing to do there.
    fn settle(&self, layer: usize) -> mlx::Result<()> {
        let pending: Vec<Array> = match self.reads.borrow_mut().get_mut(layer) {
            Some(r) => r.drain(..).filter(|v| v.buffer_id() == 0).collect(),
            None => return Ok(()),
        };
        if !pending.is_empty() {
            SETTLED.with(|n| n.set(n.get() + pending.len() as u64));
            mlx::async_eval(&pending.iter().collect::<Vec<_>>())?;
        }
        Ok(())
    }

    /// Forget `view`, a view of `layer`'s pool made for a kernel that did not take it (a
    /// q/k/v kernel that returned its keys and values instead of writing them): nothing
    /// reads it, and kept it would be evaluated before the pool's next write, on its own
    /// ([`KvCache::settle`]; on CUDA that commits the graph being encoded and waits in the
    /// driver: 90% of the host's samples of a batched 4-bit decode step on an H100, every
    /// layer). Views already evaluated, and any other, are left as they are.
    pub fn forget_unused_view(&self, layer: usize, view: &Array) {
        if view.is_scheduled() || !kernels::knobs::get().forget_view {
            return;
        }
        if let Some(r) = self.reads.borrow_mut().get_mut(layer) {
            r.retain(|v| !v.same_as(view));
        }
        if let Some(w) = self.whole.borrow_mut().get_mut(layer) {
            if w.as_ref().is_some_and(|w| w.same_as(view)) {
                *w = None;
            }
        }
    }

    /// After a kernel wrote `layer`'s pool in place (no MLX write): forget the views of it
    /// already evaluated, as a write does (those not yet evaluated are kept for the next
    /// MLX write, which must not copy the pool).
    fn written_by_kernel(&self, layer: usize) {
        if let Some(r) = self.reads.borrow_mut().get_mut(layer) {
            r.retain(|v| v.buffer_id() == 0);
        }
    }

    /// The pool row where a q/k/v kernel writes one sequence's one new position `rows` (a
    /// run of rows, `t` = 1; [`BatchIndex::kv_dst`] for one sequence); `None` for other
    /// steps.
    pub fn seq_kv_dst(&self, rows: &SeqRows) -> Option<i32> {
        match rows {
            SeqRows::Run { start, pos, t: 1 } => Some((start + pos) as i32),
            _ => None,
        }
    }

    /// Writes so far that copied a layer's pool (see [`KvCache::check_in_place`]).
    pub fn pool_copies(&self) -> u64 {
        self.copies
    }

    /// The whole pool of `layer` as an unowned view (for the q/k/v kernel that writes it,
    /// the decode kernel and gathers). Once such a view has been evaluated it is kept and
    /// handed out again while the pool is still that buffer (updated in place), so a step
    /// gets it as an input that is already there, not as one more op of its graph (one op
    /// per layer less for MLX to build and run); a pool copied or grown gets a new one.
    pub fn pool_view(&self, layer: usize) -> mlx::Result<Array> {
        let pool = &self.kv[layer];
        let id = pool.buffer_id();
        let shape = pool.shape();
        let mut whole = self.whole.borrow_mut();
        if whole.len() <= layer {
            whole.resize(layer + 1, None);
        }
        let keep = kernels::knobs::get().pool_view;
        if let (Some(v), true) = (&whole[layer], keep) {
            // (an evaluated view of this pool shares its buffer, so their identities match)
            if id != 0 && v.buffer_id() == id && v.shape() == shape {
                return Ok(v.clone());
            }
        }
        let v = self.unowned(layer, &vec![0; shape.len()], &shape)?;
        whole[layer] = (keep && id != 0).then(|| v.clone());
        Ok(v)
    }

    /// Where one step of `t` positions from `pos` of `slot` writes and reads, built once
    /// and shared by every layer (call [`KvCache::prepare`] first).
    pub fn seq_rows(&self, slot: usize, pos: usize, t: usize) -> Result<SeqRows, KvError> {
        let end = pos + t;
        let first = self.block(slot, 0)?;
        let mut run = true;
        for j in 1..end.div_ceil(self.block_size) {
            if self.block(slot, j)? != first + j {
                run = false;
                break;
            }
        }
        if run {
            return Ok(SeqRows::Run {
                start: first * self.block_size,
                pos,
                t,
            });
        }
        let read = self.rows(slot, 0, end)?;
        Ok(SeqRows::Gather {
            write: i32_array(&read[pos..], &[t as i32])?,
            rows: read[pos..].to_vec(),
            read: i32_array(&read, &[end as i32])?,
        })
    }

    /// Write `new` (one sequence, `T` positions) at `rows` of `layer`.
    pub fn write(&mut self, layer: usize, rows: &SeqRows, new: &NewKv) -> mlx::Result<()> {
        if let NewKv::Written = new {
            self.written_by_kernel(layer);
            return Ok(());
        }
        self.settle(layer)?;
        let (h, d) = (self.kv_heads as i32, self.head_dim as i32);
        let ones = [1, 1, 1, 1];
        let pool = &mut self.kv[layer];
        match rows {
            SeqRows::Run { start, pos, t } => {
                let p0 = (start + pos) as i32;
                let p1 = p0 + *t as i32;
                match new {
                    NewKv::Merged(kv) => {
                        *pool = pool.slice_update(
                            &kv.astype(self.dtype)?,
                            &[0, 0, p0, 0],
                            &[1, 2 * h, p1, d],
                            &ones,
                        )?;
                    }
                    NewKv::Written => {}
                    NewKv::Split(k, v) => {
                        *pool = pool.slice_update(
                            &k.astype(self.dtype)?,
                            &[0, 0, p0, 0],
                            &[1, h, p1, d],
                            &ones,
                        )?;
                        *pool = pool.slice_update(
                            &v.astype(self.dtype)?,
                            &[0, h, p0, 0],
                            &[1, 2 * h, p1, d],
                            &ones,
                        )?;
                    }
                }
            }
            SeqRows::Gather { write, .. } => {
                // [1, 2H, T, D] → updates [T, 1, 2H, 1, D] at rows `write` of axis 2
                let t = write.size() as i32;
                let kv = new
                    .merged()?
                    .astype(self.dtype)?
                    .transpose(&[2, 0, 1, 3])?
                    .reshape(&[t, 1, 2 * h, 1, d])?;
                *pool = pool.scatter(&[write], &kv, &[2])?;
            }
        }
        Ok(())
    }

    /// Write `new` (one sequence) at `rows` of `layer`; return its keys and values for
    /// positions `0..pos+T` (`[1, kv_heads, pos+T, head_dim]` each): views of the pool
    /// for a run of rows, gathered otherwise.
    pub fn write_and_read(
        &mut self,
        layer: usize,
        rows: &SeqRows,
        new: &NewKv,
    ) -> mlx::Result<(Array, Array)> {
        self.write(layer, rows, new)?;
        self.read(layer, rows)
    }

    /// The keys and values of positions `0..pos+T` of one sequence (`[1, kv_heads, pos+T,
    /// head_dim]` each) from `layer`'s pool as written so far: unowned views of the pool for
    /// a run of rows, gathered otherwise. Evaluate them before the pool's next write.
    pub fn read(&self, layer: usize, rows: &SeqRows) -> mlx::Result<(Array, Array)> {
        let (h, d) = (self.kv_heads as i32, self.head_dim as i32);
        match rows {
            SeqRows::Run { start, pos, t } => {
                let (r0, r1) = (*start as i32, (start + pos + t) as i32);
                let (k, v) = ([0, 0, r0, 0], [1, h, r1, d]);
                let (vs, ve) = ([0, h, r0, 0], [1, 2 * h, r1, d]);
                match kernels::knobs::get().pool_view {
                    // keys and values: two views, one op
                    true => {
                        let mut kv = self.unowned_views(layer, &[(&k, &v), (&vs, &ve)])?;
                        let values = kv.pop().expect("two views");
                        Ok((kv.pop().expect("two views"), values))
                    }
                    false => Ok((self.unowned(layer, &k, &v)?, self.unowned(layer, &vs, &ve)?)),
                }
            }
            SeqRows::Gather { read, .. } => {
                let kv = self.pool_view(layer)?.take(read, 2)?;
                let l = read.size() as i32;
                let ones = [1, 1, 1, 1];
                Ok((
                    kv.slice(&[0, 0, 0, 0], &[1, h, l, d], &ones)?,
                    kv.slice(&[0, h, 0, 0], &[1, 2 * h, l, d], &ones)?,
                ))
            }
        }
    }

    /// The rows a step of a batched decode (`decode`) and of prefill chunks (`chunks`, in
    /// order) writes, for [`KvCache::write_step`]; built once per step.
    pub fn step_writes(
        &self,
        decode: Option<&BatchIndex>,
        chunks: &[SeqRows],
    ) -> mlx::Result<StepWrites> {
        let decode_rows = decode.map_or(0, |d| d.rows as i32);
        if let (Some(d), true) = (decode, chunks.is_empty()) {
            return Ok(StepWrites {
                rows: d.write_rows.clone(),
                decode_rows,
            });
        }
        let mut rows: Vec<i32> = decode.map_or_else(Vec::new, |d| d.write.clone());
        for c in chunks {
            rows.extend(c.write_rows());
        }
        Ok(StepWrites {
            rows: i32_array(&rows, &[rows.len() as i32])?,
            decode_rows,
        })
    }

    /// Write a whole step's new keys and values into `layer`'s pool with one scatter: the
    /// batched decode's (`[B, 2·kv_heads or kv_heads, 1, head_dim]`) and each prefill
    /// chunk's (`[1, .., T, head_dim]`), at the rows of `writes` (made from the same
    /// decode index and chunks). One write per layer per step, before its reads, is what
    /// lets MLX update the pool in place (see the module's notes).
    pub fn write_step(
        &mut self,
        layer: usize,
        writes: &StepWrites,
        decode: Option<&NewKv>,
        chunks: &[NewKv],
    ) -> mlx::Result<()> {
        let (h2, d) = (2 * self.kv_heads as i32, self.head_dim as i32);
        let mut parts = Vec::with_capacity(2);
        // the decode rows' keys and values already in the pool (written by the q/k/v kernel):
        // the scatter takes the chunks' rows only, behind them in `writes`
        let mut rows = writes.rows.clone();
        match decode {
            Some(NewKv::Written) => {
                self.written_by_kernel(layer);
                if chunks.is_empty() {
                    return Ok(());
                }
                rows = rows.slice_axis(0, writes.decode_rows, rows.dim(0))?;
            }
            Some(new) => {
                let kv = new.merged()?;
                parts.push(kv.reshape(&[kv.dim(0), 1, h2, 1, d])?);
            }
            None => {}
        }
        if !chunks.is_empty() {
            // the chunks' positions end to end, [1, 2H, N, D] → [N, 1, 2H, 1, D]
            let merged: Vec<Array> = chunks
                .iter()
                .map(NewKv::merged)
                .collect::<mlx::Result<_>>()?;
            let kv = match merged.len() {
                1 => merged[0].clone(),
                _ => mlx::concatenate(&merged.iter().collect::<Vec<_>>(), 2)?,
            };
            let n = kv.dim(2);
            parts.push(kv.transpose(&[2, 0, 1, 3])?.reshape(&[n, 1, h2, 1, d])?);
        }
        let upd = match parts.len() {
            0 => return Ok(()),
            1 => parts.pop().expect("one part"),
            _ => mlx::concatenate(&parts.iter().collect::<Vec<_>>(), 0)?,
        };
        if upd.dim(0) != rows.dim(0) {
            return Err(mlx::MlxError::Invalid(format!(
                "write_step: {} new positions for {} rows",
                upd.dim(0),
                rows.dim(0)
            )));
        }
        self.settle(layer)?;
        let pool = &mut self.kv[layer];
        *pool = pool.scatter(&[&rows], &upd.astype(self.dtype)?, &[2])?;
        Ok(())
    }

    /// The pool of `layer`, `[1, 2·kv_heads, blocks·block_size, head_dim]` (key heads first),
    /// the array that owns it: a read of it queued on the device makes the layer's next
    /// write copy the pool, so steps read [`KvCache::pool_view`] instead.
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

    /// Index arrays for a batched decode step over `slots` at `positions` (one new token
    /// each), built once per step and shared by every layer: the rows the new tokens go
    /// to, and either the block tables (`kernel`: the decode kernel reads through them)
    /// or every row's pool rows and a mask hiding positions past its own length (MLX's
    /// attention over a gather). Call [`KvCache::prepare`] first.
    pub fn batch_index(
        &self,
        slots: &[usize],
        positions: &[usize],
        kernel: bool,
    ) -> Result<BatchIndex, KvError> {
        let b = slots.len();
        let bs = self.block_size;
        let mut write = Vec::with_capacity(b);
        for (&s, &p) in slots.iter().zip(positions) {
            write.push((self.block(s, p / bs)? * bs + p % bs) as i32);
        }
        let (mut table, mut gather) = (None, None);
        if kernel {
            let width = positions.iter().map(|&p| p / bs + 1).max().unwrap_or(1);
            let mut t = vec![0i32; b * width];
            for (r, (&s, &p)) in slots.iter().zip(positions).enumerate() {
                for j in 0..=p / bs {
                    t[r * width + j] = self.block(s, j)? as i32;
                }
            }
            table = Some((t, width));
        } else {
            let l = positions.iter().max().map_or(0, |&p| p + 1);
            let mut rows = Vec::with_capacity(b * l);
            for (&s, &p) in slots.iter().zip(positions) {
                let r = self.rows(s, 0, p + 1)?;
                let pad = r[0];
                rows.extend_from_slice(&r);
                // positions past the row's own are masked; any row of the pool will do
                rows.extend(std::iter::repeat_n(pad, l - r.len()));
            }
            let lens: Vec<i32> = positions.iter().map(|&p| p as i32 + 1).collect();
            let lens = i32_array(&lens, &[b as i32, 1, 1, 1])?;
            let mask = Array::arange(0.0, l as f64, 1.0, Dtype::I32)?
                .reshape(&[1, 1, 1, l as i32])?
                .lt(&lens)?;
            gather = Some((i32_array(&rows, &[(b * l) as i32])?, mask, l));
        }
        // positions, write rows and (kernel) tables: one array for the device
        let pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let bi = b as i32;
        let mut parts: Vec<(&[i32], Vec<i32>)> = vec![(&pos, vec![bi]), (&write, vec![bi])];
        if let Some((t, width)) = &table {
            parts.push((t, vec![bi, *width as i32]));
        }
        let parts: Vec<(&[i32], &[i32])> = parts.iter().map(|(v, s)| (*v, s.as_slice())).collect();
        let mut arrays = step_i32(&parts)?.into_iter();
        let mut next = || arrays.next().expect("one array per part");
        Ok(BatchIndex {
            rows: b,
            positions: next(),
            write_rows: next(),
            table: table.map(|_| next()),
            write,
            gather,
        })
    }

    /// Batched decode: write one token per sequence (`[B, kv_heads, 1, head_dim]` keys and
    /// values) at its row, with one scatter.
    pub fn write_batch(&mut self, layer: usize, idx: &BatchIndex, new: &NewKv) -> mlx::Result<()> {
        if let NewKv::Written = new {
            self.written_by_kernel(layer);
            return Ok(());
        }
        let (h, d) = (self.kv_heads as i32, self.head_dim as i32);
        let kv = new
            .merged()?
            .astype(self.dtype)?
            .reshape(&[idx.rows as i32, 1, 2 * h, 1, d])?;
        self.settle(layer)?;
        self.kv[layer] = self.kv[layer].scatter(&[&idx.write_rows], &kv, &[2])?;
        Ok(())
    }

    /// Keys and values of every batch row, `[B, kv_heads, L, head_dim]`, gathered, with the
    /// mask `[B, 1, 1, L]` of each row's positions (an index made without `kernel`).
    pub fn read_batch(&self, layer: usize, idx: &BatchIndex) -> mlx::Result<(Array, Array, Array)> {
        let Some((rows, mask, l)) = &idx.gather else {
            return Err(mlx::MlxError::Invalid(
                "read_batch: the index was made for the kernel".into(),
            ));
        };
        let (h, d, b, l) = (
            self.kv_heads as i32,
            self.head_dim as i32,
            idx.rows as i32,
            *l as i32,
        );
        // [1, 2H, B·L, D] → [B, 2H, L, D]
        let kv = self
            .pool_view(layer)?
            .take(rows, 2)?
            .reshape(&[2 * h, b, l, d])?
            .transpose(&[1, 0, 2, 3])?;
        let ones = [1, 1, 1, 1];
        Ok((
            kv.slice(&[0, 0, 0, 0], &[b, h, l, d], &ones)?,
            kv.slice(&[0, h, 0, 0], &[b, 2 * h, l, d], &ones)?,
            mask.clone(),
        ))
    }

    /// Start slot `dst` with the first `len` positions of slot `src` through `table`
    /// (`dst`'s block table, covering `0..len`), so sequences with one prompt share its
    /// prefill: the choices of an `n` > 1 request prefill the prompt once. The leading
    /// full blocks of `table` are `src`'s own (shared read-only; the driver counts their
    /// references); a partly filled last block is `dst`'s own, and its rows are copied
    /// here from `src`'s (one update per layer pool, after the copied rows are made
    /// contiguous and evaluated). Call it once the step that wrote `src`'s rows is
    /// evaluated: an update of a pool that a step still to be evaluated reads copies it.
    pub fn fork(
        &mut self,
        src: usize,
        dst: usize,
        len: usize,
        table: &[u32],
    ) -> Result<(), KvError> {
        self.check_slot(src)?;
        self.check_slot(dst)?;
        if len > self.lens[src] {
            return Err(KvError::ShortPrefix {
                slot: src,
                held: self.lens[src],
                len,
            });
        }
        let bs = self.block_size;
        let full = len / bs;
        for j in 0..full {
            if table.get(j).map(|&b| b as usize) != Some(self.block(src, j)?) {
                return Err(KvError::NotShared {
                    slot: src,
                    block: j,
                });
            }
        }
        self.restart(dst, 0, Some(table));
        let tail = len % bs;
        if tail > 0 {
            let layers = self.kv.len();
            self.prepare(layers, &[(dst, len)])?;
            let (from, to) = (self.block(src, full)?, self.block(dst, full)?);
            if from != to {
                let (h2, d) = (2 * self.kv_heads as i32, self.head_dim as i32);
                let (f, t, r) = ((from * bs) as i32, (to * bs) as i32, tail as i32);
                let ones = [1, 1, 1, 1];
                let rows: Vec<Array> = self
                    .kv
                    .iter()
                    .map(|pool| {
                        pool.unowned_slice(&[0, 0, f, 0], &[1, h2, f + r, d])?
                            .contiguous()
                    })
                    .collect::<mlx::Result<_>>()?;
                mlx::eval(&rows.iter().collect::<Vec<_>>())?;
                for (layer, rows) in rows.iter().enumerate() {
                    self.settle(layer)?;
                    let pool = &mut self.kv[layer];
                    *pool = pool.slice_update(rows, &[0, 0, t, 0], &[1, h2, t + r, d], &ones)?;
                }
            }
        }
        self.lens[dst] = len;
        Ok(())
    }

    /// Bytes the pools hold once grown to the whole pool (`num_blocks` blocks).
    pub fn full_bytes(&self) -> u64 {
        (self.num_layers() * 2 * self.kv_heads * self.num_blocks * self.block_size * self.head_dim)
            as u64
            * self.dtype.size() as u64
    }

    /// Bytes held by the pools.
    pub fn nbytes(&self) -> usize {
        self.kv.iter().map(|a| a.nbytes()).sum()
    }
}

impl Drop for KvCache {
    /// Reads of the pools queued on the device do not own them (see the module's notes):
    /// wait for the device before the pools go.
    fn drop(&mut self) {
        if !self.kv.is_empty() {
            let _ = mlx::synchronize();
        }
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

    /// Write `t` more positions of `slot` into layer 0 (keys and values counting up from
    /// `from`), advance the slot and evaluate the pool.
    fn append(c: &mut KvCache, slot: usize, t: usize, from: f32) {
        let (h, d) = (c.kv_heads as i32, c.head_dim as i32);
        let pos = c.len(slot);
        c.prepare(1, &[(slot, pos + t)]).unwrap();
        let rows = c.seq_rows(slot, pos, t).unwrap();
        c.write(
            0,
            &rows,
            &NewKv::Merged(values(&[1, 2 * h, t as i32, d], from)),
        )
        .unwrap();
        c.advance(slot, t);
        c.pool(0).eval().unwrap();
    }

    /// A cache of `layers` layers and `slots` slots (32 positions each) over `blocks`
    /// blocks of 4 tokens, of 2 float32 kv heads of 4.
    fn small_cache(layers: usize, slots: usize, blocks: usize, preallocate: bool) -> KvCache {
        let kv = KvConfig {
            block_size: 4,
            num_blocks: blocks,
            preallocate,
        };
        KvCache::new(layers, slots, 2, 4, Dtype::F32, 32, kv)
    }

    /// A sequence written through a table of scattered blocks reads back what a run of
    /// blocks holds, merged and split writes alike; a sequence sharing its first block
    /// (a cached prefix) reads it with its own; a batched step's gather and mask give
    /// each row its own positions, and the kernel's tables its blocks.
    #[test]
    fn scattered_blocks_read_back_like_a_run() {
        let (layers, h, d, bs) = (2usize, 2i32, 4i32, 4usize);
        let kv = KvConfig {
            block_size: bs,
            num_blocks: 8,
            preallocate: false,
        };
        let mut run = KvCache::new(layers, 2, h as usize, d as usize, Dtype::F32, 32, kv);
        let mut scat = KvCache::new(layers, 2, h as usize, d as usize, Dtype::F32, 32, kv);
        run.restart(0, 0, Some(&[2, 3]));
        scat.restart(1, 0, Some(&[5, 0]));
        // a 6-token prompt: split into layer 1, merged into layer 0
        let k = values(&[1, h, 6, d], 0.0);
        let v = values(&[1, h, 6, d], 100.0);
        let merged = mlx::concatenate(&[&k, &v], 1).unwrap();
        let mut got = vec![];
        for (c, slot) in [(&mut run, 0), (&mut scat, 1)] {
            c.prepare(layers, &[(slot, 6)]).unwrap();
            let rows = c.seq_rows(slot, 0, 6).unwrap();
            assert_eq!(rows.is_run(), slot == 0);
            let (k1, v1) = c
                .write_and_read(1, &rows, &NewKv::Split(k.clone(), v.clone()))
                .unwrap();
            let (k0, v0) = c
                .write_and_read(0, &rows, &NewKv::Merged(merged.clone()))
                .unwrap();
            got.push([read(&k1), read(&v1), read(&k0), read(&v0)]);
            c.advance(slot, 6);
        }
        assert_eq!(got[0], got[1]);
        assert_eq!(got[0][0], read(&k));
        assert_eq!(got[0][3], read(&v));
        // the pools grow in steps of 256 positions, at most the pool's 8 blocks
        assert_eq!(scat.nbytes(), layers * 8 * bs * 2 * (h * d) as usize * 4);
        // slot 0 shares slot 1's first block (a cached prefix) and writes positions 4..6
        // into its own block 4; then a batched decode step of both at position 6
        scat.restart(0, 4, Some(&[5, 4]));
        scat.prepare(layers, &[(0, 6)]).unwrap();
        let rows = scat.seq_rows(0, 4, 2).unwrap();
        let tail = |a: &Array| a.slice_axis(2, 4, 6).unwrap();
        scat.write(1, &rows, &NewKv::Split(tail(&k), tail(&v)))
            .unwrap();
        scat.advance(0, 2);
        let k1 = values(&[2, h, 1, d], 1000.0);
        let v1 = values(&[2, h, 1, d], 2000.0);
        scat.prepare(layers, &[(0, 7), (1, 7)]).unwrap();
        let idx = scat.batch_index(&[1, 0], &[6, 6], false).unwrap();
        scat.write_batch(1, &idx, &NewKv::Split(k1.clone(), v1.clone()))
            .unwrap();
        let (kk, vv, mask) = scat.read_batch(1, &idx).unwrap();
        assert_eq!(kk.shape(), vec![2, h, 7, d]);
        let (kk, vv) = (read(&kk), read(&vv));
        let (row, head) = ((h * 7 * d) as usize, (7 * d) as usize);
        // both rows: the prompt's 6 positions, then their own new one
        for r in 0..2 {
            for hh in 0..h as usize {
                let at = r * row + hh * head;
                assert_eq!(
                    kk[at..at + 6 * d as usize],
                    read(&k)[hh * 6 * d as usize..(hh + 1) * 6 * d as usize]
                );
                assert_eq!(
                    kk[at + 6 * d as usize],
                    1000.0 + ((r * h as usize + hh) * d as usize) as f32
                );
                assert_eq!(
                    vv[at + 6 * d as usize],
                    2000.0 + ((r * h as usize + hh) * d as usize) as f32
                );
            }
        }
        assert_eq!(
            mask.astype(Dtype::I32).unwrap().to_vec::<i32>().unwrap(),
            vec![1; 14]
        );
        let t = scat.batch_index(&[1, 0], &[6, 1], true).unwrap();
        assert_eq!(
            t.table().unwrap().to_vec::<i32>().unwrap(),
            vec![5, 0, 5, 0]
        );
        // a position past the table has no block; past the context, no room
        assert!(matches!(
            scat.prepare(layers, &[(1, 9)]),
            Err(KvError::NoBlock { .. })
        ));
        assert!(matches!(
            scat.prepare(layers, &[(1, 33)]),
            Err(KvError::ContextFull { .. })
        ));
    }

    /// A fork shares the source's full blocks and gets a copy of the rows of its partly
    /// filled last block: it reads the source's positions back, and what either writes
    /// next does not show in the other; a table whose full blocks are not the source's,
    /// or a prefix longer than the source, is refused.
    #[test]
    fn a_fork_shares_full_blocks_and_copies_the_last_partial_one() {
        let (layers, h, d) = (2usize, 2i32, 4i32);
        let mut c = small_cache(layers, 2, 8, false);
        c.restart(0, 0, Some(&[2, 3]));
        c.prepare(layers, &[(0, 6)]).unwrap();
        let rows = c.seq_rows(0, 0, 6).unwrap();
        for layer in 0..layers {
            let kv = values(&[1, 2 * h, 6, d], 1000.0 * layer as f32);
            c.write(layer, &rows, &NewKv::Merged(kv)).unwrap();
        }
        c.advance(0, 6);
        assert!(matches!(
            c.fork(0, 1, 6, &[4, 5]),
            Err(KvError::NotShared { block: 0, .. })
        ));
        assert!(matches!(
            c.fork(0, 1, 7, &[2, 5]),
            Err(KvError::ShortPrefix { held: 6, .. })
        ));
        c.fork(0, 1, 6, &[2, 5]).unwrap();
        assert_eq!(c.len(1), 6);
        // both write their own position 6 (in their own last block), then read 0..7
        let new = |from: f32| NewKv::Merged(values(&[1, 2 * h, 1, d], from));
        let mut got = vec![];
        for (slot, from) in [(0, -100.0), (1, -200.0)] {
            c.prepare(layers, &[(slot, 7)]).unwrap();
            let rows = c.seq_rows(slot, 6, 1).unwrap();
            let mut per_layer = vec![];
            for layer in 0..layers {
                let (k, v) = c.write_and_read(layer, &rows, &new(from)).unwrap();
                per_layer.push((read(&k), read(&v)));
            }
            got.push(per_layer);
        }
        let (pos, head) = (d as usize, (7 * d) as usize);
        for (layer, (src, fork)) in got[0].iter().zip(&got[1]).enumerate() {
            for hh in 0..h as usize {
                let six = hh * head..hh * head + 6 * pos;
                assert_eq!(
                    src.0[six.clone()],
                    fork.0[six.clone()],
                    "layer {layer} keys"
                );
                assert_eq!(src.1[six.clone()], fork.1[six], "layer {layer} values");
                let at = hh * head + 6 * pos;
                assert_eq!(src.0[at], -100.0 + (hh * pos) as f32);
                assert_eq!(fork.0[at], -200.0 + (hh * pos) as f32);
            }
            assert_eq!(fork.0[0], 1000.0 * layer as f32);
        }
    }

    /// A step's writes of several sequences go into each pool in place, and what each
    /// sequence reads back is its own; a write while something else holds the pool (here a
    /// clone) copies it, and the check counts it.
    #[test]
    fn step_writes_update_the_pools_in_place_and_copies_are_counted() {
        let (layers, h, d) = (2usize, 2i32, 4i32);
        let mut c = small_cache(layers, 3, 8, true);
        c.restart(0, 0, Some(&[0, 1]));
        c.restart(1, 0, Some(&[5]));
        c.restart(2, 0, Some(&[3, 6]));
        // slot 0 holds 5 positions; then one step: slot 0 decodes, slots 1 and 2 prefill
        c.prepare(layers, &[(0, 5)]).unwrap();
        let r0 = c.seq_rows(0, 0, 5).unwrap();
        for layer in 0..layers {
            c.write(layer, &r0, &NewKv::Merged(values(&[1, 2 * h, 5, d], 0.0)))
                .unwrap();
        }
        c.advance(0, 5);
        mlx::eval(&(0..layers).map(|l| c.pool(l)).collect::<Vec<_>>()).unwrap();
        assert_eq!(c.check_in_place(), 0, "made, not copied");
        c.prepare(layers, &[(0, 6), (1, 3), (2, 6)]).unwrap();
        let idx = c.batch_index(&[0], &[5], false).unwrap();
        let chunks = [c.seq_rows(1, 0, 3).unwrap(), c.seq_rows(2, 0, 6).unwrap()];
        let writes = c.step_writes(Some(&idx), &chunks).unwrap();
        let mut got = vec![];
        for layer in 0..layers {
            let dec = NewKv::Merged(values(&[1, 2 * h, 1, d], 500.0));
            let news = [
                NewKv::Merged(values(&[1, 2 * h, 3, d], 1000.0)),
                NewKv::Split(values(&[1, h, 6, d], 2000.0), values(&[1, h, 6, d], 3000.0)),
            ];
            c.write_step(layer, &writes, Some(&dec), &news).unwrap();
            let (k0, v0, _) = c.read_batch(layer, &idx).unwrap();
            let (k1, _) = c.read(layer, &chunks[0]).unwrap();
            let (k2, v2) = c.read(layer, &chunks[1]).unwrap();
            got.push([read(&k0), read(&v0), read(&k1), read(&k2), read(&v2)]);
        }
        for [k0, v0, k1, k2, v2] in &got {
            // slot 0: its 5 positions, then the decode's (head 0 at position 5: 500..)
            assert_eq!(k0[5 * d as usize], 500.0);
            assert_eq!(k0[0], 0.0);
            assert_eq!(v0[5 * d as usize], 500.0 + (h * d) as f32);
            assert_eq!(k1, &read(&values(&[1, h, 3, d], 1000.0)));
            assert_eq!(k2, &read(&values(&[1, h, 6, d], 2000.0)));
            assert_eq!(v2, &read(&values(&[1, h, 6, d], 3000.0)));
        }
        c.advance(0, 1);
        c.advance(1, 3);
        c.advance(2, 6);
        assert_eq!(c.check_in_place(), 0, "one write per pool: in place");
        // a write while a clone of the pool is held copies it
        let held = c.pool(0).clone();
        c.prepare(layers, &[(1, 4)]).unwrap();
        let r1 = c.seq_rows(1, 3, 1).unwrap();
        c.write(0, &r1, &NewKv::Merged(values(&[1, 2 * h, 1, d], 0.0)))
            .unwrap();
        c.pool(0).eval().unwrap();
        assert_eq!(c.check_in_place(), 1);
        assert_eq!(c.pool_copies(), 1);
        drop(held);
    }

    /// A whole-pool view made for a kernel that did not take it, once forgotten, is not
    /// evaluated on its own before the pool's next write (kept, it was: one evaluation a
    /// layer a step), and the write still updates the pool in place.
    #[test]
    fn a_view_no_kernel_took_is_forgotten_not_evaluated_before_the_write() {
        let (layers, h, d) = (1usize, 2i32, 4i32);
        let mut c = small_cache(layers, 1, 8, true);
        c.restart(0, 0, Some(&[0, 1]));
        let step = |c: &mut KvCache, p: usize, x: f32| {
            c.prepare(layers, &[(0, p + 1)]).unwrap();
            let r = c.seq_rows(0, p, 1).unwrap();
            c.write(0, &r, &NewKv::Merged(values(&[1, 2 * h, 1, d], x)))
                .unwrap();
            c.advance(0, 1);
            mlx::eval(&[c.pool(0)]).unwrap();
        };
        step(&mut c, 0, 1.0);
        // kept (not forgotten): the next write evaluates it first
        let unused = c.pool_view(0).unwrap();
        drop(unused);
        let before = views_settled();
        step(&mut c, 1, 2.0);
        assert_eq!(views_settled(), before + 1);
        // forgotten: nothing to evaluate
        let unused = c.pool_view(0).unwrap();
        c.forget_unused_view(0, &unused);
        drop(unused);
        step(&mut c, 2, 3.0);
        assert_eq!(
            views_settled(),
            before + 1,
            "the forgotten view was evaluated"
        );
        assert_eq!(c.check_in_place(), 0, "a write copied the pool");
        let (k, _) = c.read(0, &c.seq_rows(0, 0, 3).unwrap()).unwrap();
        let k = read(&k);
        assert_eq!((k[0], k[d as usize], k[2 * d as usize]), (1.0, 2.0, 3.0));
    }

    /// Where a q/k/v kernel wrote a step's decode keys and values itself
    /// ([`NewKv::Written`]), the step's one write scatters only the prefill chunks' rows
    /// (behind the decode rows in the step's rows) and leaves the decode rows as written.
    #[test]
    fn a_step_written_by_the_kernel_scatters_only_its_chunks() {
        let (layers, h, d) = (1usize, 2i32, 4i32);
        let mut c = small_cache(layers, 2, 8, true);
        c.restart(0, 0, Some(&[0, 1]));
        c.restart(1, 0, Some(&[5]));
        c.prepare(layers, &[(0, 5)]).unwrap();
        let r0 = c.seq_rows(0, 0, 5).unwrap();
        c.write(0, &r0, &NewKv::Merged(values(&[1, 2 * h, 5, d], 0.0)))
            .unwrap();
        c.advance(0, 5);
        c.prepare(layers, &[(0, 6), (1, 3)]).unwrap();
        // slot 0's new position: the row a kernel writes (here written by the cache first,
        // standing in for the kernel)
        let one = c.seq_rows(0, 5, 1).unwrap();
        assert_eq!(c.seq_kv_dst(&one), Some(5));
        c.write(0, &one, &NewKv::Merged(values(&[1, 2 * h, 1, d], 500.0)))
            .unwrap();
        let idx = c.batch_index(&[0], &[5], false).unwrap();
        let chunks = [c.seq_rows(1, 0, 3).unwrap()];
        let writes = c.step_writes(Some(&idx), &chunks).unwrap();
        let news = [NewKv::Merged(values(&[1, 2 * h, 3, d], 1000.0))];
        c.write_step(0, &writes, Some(&NewKv::Written), &news)
            .unwrap();
        let (k0, v0, _) = c.read_batch(0, &idx).unwrap();
        let (k1, v1) = c.read(0, &chunks[0]).unwrap();
        let (k0, v0) = (read(&k0), read(&v0));
        assert_eq!(k0[5 * d as usize], 500.0);
        assert_eq!(v0[5 * d as usize], 500.0 + (h * d) as f32);
        assert_eq!(
            k0[4 * d as usize],
            (4 * d) as f32,
            "the positions before stay"
        );
        let new = values(&[1, 2 * h, 3, d], 1000.0);
        let ones = [1, 1, 1, 1];
        let k1v = new.slice(&[0, 0, 0, 0], &[1, h, 3, d], &ones).unwrap();
        let v1v = new.slice(&[0, h, 0, 0], &[1, 2 * h, 3, d], &ones).unwrap();
        assert_eq!(read(&k1), read(&k1v));
        assert_eq!(read(&v1), read(&v1v));
        // only decode rows and nothing else: nothing to write
        let writes = c.step_writes(Some(&idx), &[]).unwrap();
        c.write_step(0, &writes, Some(&NewKv::Written), &[])
            .unwrap();
    }

    /// A write made between `save` and `restore` (and never evaluated) leaves nothing: the
    /// pools read back what they held before it, the slot its length, and the next write
    /// builds on the saved pools, not on the dropped one.
    #[test]
    fn a_restored_cache_forgets_a_graph_built_after_its_save() {
        let (layers, h, d) = (1usize, 2i32, 4i32);
        let mut c = small_cache(layers, 2, 8, true);
        c.restart(0, 0, Some(&[0, 1]));
        c.prepare(layers, &[(0, 3)]).unwrap();
        let r = c.seq_rows(0, 0, 3).unwrap();
        c.write(0, &r, &NewKv::Merged(values(&[1, 2 * h, 3, d], 0.0)))
            .unwrap();
        c.advance(0, 3);
        let before = read(&c.read(0, &r).unwrap().0);
        let views = c.reads.borrow()[0].len();
        let saved = c.save();
        c.reset(0);
        c.restart(0, 0, Some(&[0, 1]));
        c.prepare(layers, &[(0, 3)]).unwrap();
        c.write(0, &r, &NewKv::Merged(values(&[1, 2 * h, 3, d], 900.0)))
            .unwrap();
        c.advance(0, 3);
        assert_eq!(c.len(0), 3);
        let dropped = c.read(0, &r).unwrap().0;
        c.restore(saved);
        // the views a later write settles are the ones made before the save
        assert_eq!(c.reads.borrow()[0].len(), views);
        assert_eq!(c.len(0), 3);
        assert_eq!(read(&c.read(0, &r).unwrap().0), before);
        assert_eq!(
            read(&dropped)[0],
            900.0,
            "the dropped graph itself still computes"
        );
    }

    /// The whole-pool view is an op of the step that first makes it; once evaluated it is
    /// handed out again as an input (no op) while the pool is updated in place, and reads
    /// through it see the pool's writes; a pool that was copied or grew gets a new view.
    #[test]
    fn an_evaluated_pool_view_serves_until_the_pool_moves() {
        let (h, d) = (2i32, 4i32);
        let kv = KvConfig {
            block_size: 4,
            num_blocks: 128,
            preallocate: false,
        };
        let mut c = KvCache::new(1, 2, h as usize, d as usize, Dtype::F32, 512, kv);
        c.restart(0, 0, Some(&[0, 1]));
        append(&mut c, 0, 5, 0.0);
        let ops = |a: &Array| mlx::graph::count_ops(&[a], &[]).total();
        // (with MLXCEL_POOL_VIEW=0 every view is an op of its own)
        let kept = usize::from(!kernels::knobs::get().pool_view);
        let first = c.pool_view(0).unwrap();
        assert_eq!(ops(&first), 1, "made by the step that first asks");
        first.eval().unwrap();
        let again = c.pool_view(0).unwrap();
        assert_eq!(ops(&again), kept, "then an input");
        if kept == 0 {
            assert_eq!(again.buffer_id(), c.pool(0).buffer_id());
        }
        // a write in place: the same view, which reads what was written
        append(&mut c, 0, 1, 500.0);
        assert_eq!(c.check_in_place(), 0);
        let after = c.pool_view(0).unwrap();
        assert_eq!(ops(&after), kept);
        let row =
            |v: &Array, p: i32| read(&v.slice(&[0, 0, p, 0], &[1, 1, p + 1, d], &[1; 4]).unwrap());
        assert_eq!(row(&after, 5), vec![500.0, 501.0, 502.0, 503.0]);
        // a write that copies the pool (a clone held): a new view of the new buffer
        let held = c.pool(0).clone();
        append(&mut c, 0, 1, 700.0);
        assert_eq!(c.check_in_place(), 1);
        let copied = c.pool_view(0).unwrap();
        assert_eq!(ops(&copied), 1);
        assert_eq!(row(&copied, 6), vec![700.0, 701.0, 702.0, 703.0]);
        assert_eq!(row(&copied, 5), vec![500.0, 501.0, 502.0, 503.0]);
        drop(held);
        // a pool that grows (a block past its rows): a new view of the grown pool
        let rows = c.pool(0).shape()[2];
        c.restart(1, 0, Some(&[rows as u32 / 4]));
        c.prepare(1, &[(1, 1)]).unwrap();
        c.pool(0).eval().unwrap();
        assert!(c.pool(0).shape()[2] > rows);
        let grown = c.pool_view(0).unwrap();
        assert_eq!(ops(&grown), 1);
        assert_eq!(grown.shape(), c.pool(0).shape());
        assert_eq!(row(&grown, 5), vec![500.0, 501.0, 502.0, 503.0]);
    }

    /// A pool view made after a save, in a graph that is dropped unevaluated, is not kept
    /// past the restore: the next write still updates the pool in place.
    #[test]
    fn a_restore_forgets_a_pool_view_made_after_the_save() {
        let mut c = small_cache(1, 2, 8, true);
        c.restart(0, 0, Some(&[0, 1]));
        append(&mut c, 0, 3, 0.0);
        assert_eq!(c.check_in_place(), 0);
        let saved = c.save();
        drop(c.pool_view(0).unwrap());
        c.restore(saved);
        append(&mut c, 0, 1, 9.0);
        assert_eq!(c.check_in_place(), 0, "the write copied the pool");
    }

    /// Without a table a slot owns the blocks j·slots + slot: one slot's positions are
    /// one run.
    #[test]
    fn fixed_blocks_interleave_slots() {
        let kv = KvConfig::for_slots(3, 64, 16);
        assert_eq!(kv.num_blocks, 12);
        let mut c = KvCache::new(1, 3, 1, 2, Dtype::F32, 64, kv);
        c.prepare(1, &[(2, 40)]).unwrap();
        let idx = c.batch_index(&[2], &[39], true).unwrap();
        assert_eq!(idx.table().unwrap().to_vec::<i32>().unwrap(), vec![2, 5, 8]);
        assert!(!c.seq_rows(2, 0, 40).unwrap().is_run());
        let one = KvCache::new(1, 1, 1, 2, Dtype::F32, 64, KvConfig::for_slots(1, 64, 16));
        assert!(one.seq_rows(0, 0, 64).unwrap().is_run());
    }
}
