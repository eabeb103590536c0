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

    /// Take a block: the lowest free one, else the least recently used cached one.
    pub fn allocate(&mut self) -> Option<u32> {
        let b = match self.free.pop_first() {
            Some(b) => b,
            None => {
                let (_, b) = self.evictable.pop_first()?;
                if let Some(k) = self.key_of[b as usize].take() {
                    self.cached.remove(&k);
                }
                b
            }
        };
        self.refs[b as usize] = 1;
        Some(b)
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
        let b = m.allocate().unwrap();
        m.share(b);
        assert_eq!(m.used(), 1);
        m.release(b);
        assert_eq!(m.used(), 1, "still held by the other sequence");
        m.release(b);
        assert_eq!(m.used(), 0);
        assert_eq!(m.available(), 2);
    }

    #[test]
    fn shared_prefixes_are_reference_counted_and_evicted_least_recent_first() {
        let mut m = BlockManager::new(4, 2, true);
        let toks = [1, 2, 3, 4, 5];
        // a sequence computes two full blocks and registers them
        let mut a = vec![m.allocate().unwrap(), m.allocate().unwrap()];
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
        let fresh: Vec<u32> = (0..3).map(|_| m.allocate().unwrap()).collect();
        assert_eq!(fresh[..2], [2, 3]);
        assert_eq!(
            m.lookup(&toks),
            Vec::<u32>::new(),
            "the first block was evicted"
        );
        assert_eq!(m.available(), 1);
        assert!(m.allocate().is_some());
        assert!(m.allocate().is_none());
        // without caching nothing is found
        let mut off = BlockManager::new(2, 2, false);
        let x = off.allocate().unwrap();
        off.register(x, k0);
        assert!(off.lookup(&toks).is_empty());
    }
}
