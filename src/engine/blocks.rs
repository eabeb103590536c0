//! The driver's side of the paged KV cache: which blocks of the pool are free, which
//! sequence holds which (its block table), and the automatic prefix cache. A full block
//! is keyed by a hash of (the previous block's key, its token ids), so a key names a
//! whole prefix; blocks are shared read-only between sequences with reference counts,
//! and a cached block no sequence holds stays until the pool needs room (least recently
//! used first). The executor holds the blocks themselves; this only does the accounting,
//! and every step plan carries the tables it decides.
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

/// The key of a full block of `tokens` after the prefix whose last block's key is `prev`.
pub fn block_key(prev: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    prev.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// Block accounting and the prefix cache of one pool.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    refs: Vec<u32>,
    /// a block's key while the prefix cache holds it
    key_of: Vec<Option<u64>>,
    cached: HashMap<u64, u32>,
    /// blocks no sequence holds and the cache does not, lowest first
    free: BTreeSet<u32>,
    /// cached blocks no sequence holds, by when they were last released
    evictable: BTreeMap<u64, u32>,
    released_at: Vec<u64>,
    tick: u64,
    caching: bool,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize, caching: bool) -> BlockManager {
        BlockManager {
            block_size: block_size.max(1),
            refs: vec![0; num_blocks],
            key_of: vec![None; num_blocks],
            cached: HashMap::new(),
            free: (0..num_blocks as u32).collect(),
            evictable: BTreeMap::new(),
            released_at: vec![0; num_blocks],
            tick: 0,
            caching,
        }
    }

    /// Forget everything (a new executor has a new, empty pool).
    pub fn reset(&mut self) {
        *self = BlockManager::new(self.refs.len(), self.block_size, self.caching);
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    pub fn caching(&self) -> bool {
        self.caching
    }

    /// Blocks a sequence could take now (free, or cached and held by none).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks held by sequences.
    pub fn used(&self) -> usize {
        self.refs.len() - self.available()
    }

    /// Blocks for `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Take a block for a sequence whose table ends with block `last` (`None`: a new
    /// sequence): the block after `last` when it is free, so that a sequence's blocks stay
    /// one run of rows (a run is read as views at batch 1, scattered blocks through the
    /// table); else a free block with room to grow after it ([`BlockManager::roomiest`]);
    /// else the least recently used cached one.
    pub fn allocate(&mut self, last: Option<u32>) -> Option<u32> {
        let next = last.and_then(|b| b.checked_add(1));
        let b = match next.filter(|n| self.free.remove(n)) {
            Some(b) => b,
            None => match self.roomiest() {
                Some(b) => {
                    self.free.remove(&b);
                    b
                }
                None => {
                    let (_, b) = self.evictable.pop_first()?;
                    if let Some(k) = self.key_of[b as usize].take() {
                        self.cached.remove(&k);
                    }
                    b
                }
            },
        };
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// The free block to start a run at: in the longest run of free blocks (the lowest of
    /// equals), its first block when no sequence holds the block before it, else its
    /// middle, leaving the first half for the sequence before it to grow into.
    fn roomiest(&self) -> Option<u32> {
        let mut best: Option<(u32, u32)> = None;
        let mut run: Option<(u32, u32)> = None;
        for &b in &self.free {
            run = match run {
                Some((start, len)) if start + len == b => Some((start, len + 1)),
                _ => Some((b, 1)),
            };
            if let Some(r) = run {
                if best.is_none_or(|(_, l)| r.1 > l) {
                    best = Some(r);
                }
            }
        }
        let (start, len) = best?;
        let held_before = start > 0 && self.refs[start as usize - 1] > 0;
        Some(if held_before { start + len / 2 } else { start })
    }

    /// Another sequence takes `b`, which a sequence holds (shared read-only).
    pub fn share(&mut self, b: u32) {
        let i = b as usize;
        debug_assert!(self.refs[i] > 0, "block {b} shared while held by none");
        self.refs[i] += 1;
    }

    /// A sequence lets go of `b`.
    pub fn release(&mut self, b: u32) {
        let i = b as usize;
        debug_assert!(self.refs[i] > 0, "block {b} released twice");
        self.refs[i] = self.refs[i].saturating_sub(1);
        if self.refs[i] == 0 {
            if self.key_of[i].is_some() {
                self.tick += 1;
                self.released_at[i] = self.tick;
                self.evictable.insert(self.tick, b);
            } else {
                self.free.insert(b);
            }
        }
    }

    /// Let go of every block of `table`.
    pub fn release_all(&mut self, table: &mut Vec<u32>) {
        for b in table.drain(..) {
            self.release(b);
        }
    }

    /// The cached blocks holding the longest prefix of whole blocks of `tokens`, each
    /// taken (reference counted) by the caller.
    pub fn lookup(&mut self, tokens: &[u32]) -> Vec<u32> {
        let mut out = Vec::new();
        if !self.caching {
            return out;
        }
        let mut prev = None;
        for chunk in tokens.chunks_exact(self.block_size) {
            let k = block_key(prev, chunk);
            let Some(&b) = self.cached.get(&k) else {
                break;
            };
            let i = b as usize;
            if self.refs[i] == 0 {
                self.evictable.remove(&self.released_at[i]);
            }
            self.refs[i] += 1;
            out.push(b);
            prev = Some(k);
        }
        out
    }

    /// Offer block `b`, now full, to the prefix cache under `key`. A key already cached
    /// (the same prefix computed twice at once) keeps its first block.
    pub fn register(&mut self, b: u32, key: u64) {
        if !self.caching || self.key_of[b as usize].is_some() || self.cached.contains_key(&key) {
            return;
        }
        self.cached.insert(key, b);
        self.key_of[b as usize] = Some(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block shared with another sequence stays held until both let go of it.
    #[test]
    fn a_shared_block_is_free_once_both_holders_release_it() {
        let mut m = BlockManager::new(2, 4, false);
        let b = m.allocate(None).unwrap();
        m.share(b);
        assert_eq!(m.used(), 1);
        m.release(b);
        assert_eq!(m.used(), 1, "still held by the other sequence");
        m.release(b);
        assert_eq!(m.used(), 0);
        assert_eq!(m.available(), 2);
    }

    /// Sequences grow into the block after their last one; a new sequence starts where it
    /// has room: at the start of the pool's free blocks when nobody holds the block before
    /// them, else halfway into the longest free run; and after sequences have come and gone
    /// (their full blocks cached, their last ones free), one alone still gets a run.
    #[test]
    fn sequences_keep_their_blocks_in_runs() {
        let mut m = BlockManager::new(16, 4, true);
        let a0 = m.allocate(None).unwrap();
        assert_eq!(a0, 0);
        // a second sequence starts halfway into the free blocks 1..16
        let b0 = m.allocate(None).unwrap();
        assert_eq!(b0, 8);
        let a1 = m.allocate(Some(a0)).unwrap();
        let b1 = m.allocate(Some(b0)).unwrap();
        assert_eq!((a1, b1), (1, 9));
        // the block after is taken: a jump to where there is room
        let mut c = vec![m.allocate(Some(a1 - 1)).unwrap()];
        assert_eq!(c, [5], "free runs 2..8 and 10..16: the first, halfway");
        // sequence a ends with a full block cached and a partial one; b and c end too
        m.register(a0, 7);
        let mut a = vec![a0, a1];
        let mut b = vec![b0, b1];
        m.release_all(&mut a);
        m.release_all(&mut b);
        m.release_all(&mut c);
        // alone now: 1..16 free (block 0 cached, held by none), so a run from 1
        let mut d = vec![m.allocate(None).unwrap()];
        for _ in 0..5 {
            let last = d.last().copied();
            d.push(m.allocate(last).unwrap());
        }
        assert_eq!(d, [1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn shared_prefixes_are_reference_counted_and_evicted_least_recent_first() {
        let mut m = BlockManager::new(4, 2, true);
        let toks = [1, 2, 3, 4, 5];
        // a sequence computes two full blocks and registers them
        let first = m.allocate(None).unwrap();
        let mut a = vec![first, m.allocate(Some(first)).unwrap()];
        assert_eq!(a, [0, 1]);
        let k0 = block_key(None, &toks[..2]);
        let k1 = block_key(Some(k0), &toks[2..4]);
        m.register(a[0], k0);
        m.register(a[1], k1);
        // another finds both (the last partial block is never shared)
        let mut b = m.lookup(&toks);
        assert_eq!(b, a);
        let mut c = m.lookup(&[1, 2, 9, 9]);
        assert_eq!(c, vec![a[0]]);
        m.release_all(&mut c);
        m.release_all(&mut a);
        assert_eq!(m.available(), 2, "still held by the second sequence");
        m.release_all(&mut b);
        // both cached, held by none: available, evicted oldest first once free ones run out
        assert_eq!(m.available(), 4);
        assert_eq!(m.used(), 0);
        let fresh: Vec<u32> = (0..3).map(|_| m.allocate(None).unwrap()).collect();
        assert_eq!(fresh[..2], [2, 3]);
        assert_eq!(
            m.lookup(&toks),
            Vec::<u32>::new(),
            "the first block was evicted"
        );
        assert_eq!(m.available(), 1);
        assert!(m.allocate(None).is_some());
        assert!(m.allocate(None).is_none());
        // without caching nothing is found
        let mut off = BlockManager::new(2, 2, false);
        let x = off.allocate(None).unwrap();
        off.register(x, k0);
        assert!(off.lookup(&toks).is_empty());
    }
}
