//! The paged K/V cache of an engine's full-attention layers. A sequence's keys and values live
//! in blocks of `KV_BLOCK` positions taken from the engine's pool as it grows and given back
//! the moment its state is dropped; its block table lists the blocks' addresses in position
//! order, and the attention kernels read and write through it (kernels/attention.cu: `kv_row`).
//! A block holds its positions' rows of every attention layer, keys then values per layer, so
//! that one table serves every layer and a block is one copy wherever it goes.
//!
//! The pool takes device memory in slabs of blocks as it needs them, up to a limit if one is
//! set (`set_limit`: what a serving engine sizes from its memory budget), and keeps what it
//! took: blocks given back go to the free list for the next sequence. Engines on one GPU may
//! share a pool (`GpuQwen35::share_kv_pool`): a prefill engine's state then decodes on the
//! other engine in the blocks it has, and one budget covers both. Its slabs are allocated on a
//! stream of its own and waited for, so that any engine's stream may use them at once.

use std::sync::{Arc, Mutex};

use anyhow::{bail, Result};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use crate::model::config::Qwen35Config;

/// Positions per block (kernels/attention.cu KV_BLOCK).
pub const KV_BLOCK: usize = 16;
/// Blocks per allocation when the pool grows.
const SLAB_BLOCKS: usize = 64;

/// An engine's pool of K/V blocks; shared with the states that hold blocks of it.
pub struct KvPool {
    /// Where slabs are allocated (synchronized after each).
    stream: Arc<CudaStream>,
    ordinal: usize,
    /// The model's shapes (where a block's rows are: `state.rs` lays host states out so).
    config: Qwen35Config,
    /// f32 values per block: every attention layer's keys and values of `KV_BLOCK` positions.
    block_values: usize,
    blocks: Mutex<Blocks>,
}

struct Blocks {
    slabs: Vec<CudaSlice<f32>>,
    /// Addresses of the blocks no state holds.
    free: Vec<u64>,
    /// Blocks allocated so far (held or free).
    allocated: usize,
    /// The most blocks the pool may allocate (None: as many as the GPU gives).
    limit: Option<usize>,
}

impl Blocks {
    fn level(&self, block_bytes: usize) -> KvLevel {
        KvLevel { used: self.allocated - self.free.len(), allocated: self.allocated, limit: self.limit, block_bytes }
    }
}

/// How full a pool is, in blocks of `KV_BLOCK` positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLevel {
    /// Blocks held by states.
    pub used: usize,
    /// Blocks allocated (held or free).
    pub allocated: usize,
    /// The most blocks the pool may hold (None: no limit set).
    pub limit: Option<usize>,
    pub block_bytes: usize,
}

/// The pool is out of blocks: its limit is reached (or the GPU is out of memory).
#[derive(Debug)]
pub struct KvCacheFull {
    pub wanted: usize,
    pub level: KvLevel,
    pub ordinal: usize,
}

/// What a `KvCacheFull` error says (a packed prefill's error reaches each prompt as text).
pub const KV_CACHE_FULL: &str = "the K/V cache is full";

impl std::fmt::Display for KvCacheFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let l = &self.level;
        write!(f, "cuda:{}: {KV_CACHE_FULL}: {} more blocks of {KV_BLOCK} positions wanted, {} of {} in use", self.ordinal, self.wanted, l.used, l.limit.unwrap_or(l.allocated))
    }
}

impl std::error::Error for KvCacheFull {}

impl KvCacheFull {
    /// Whether `e` is (or was, passed on as text) a `KvCacheFull`: the work may wait for room.
    pub fn is(e: &anyhow::Error) -> bool {
        e.downcast_ref::<KvCacheFull>().is_some() || e.chain().any(|c| c.to_string().contains(KV_CACHE_FULL))
    }
}

impl KvPool {
    /// An empty pool on the GPU of `ctx`, for a model of `config`'s shapes.
    pub fn new(ctx: &Arc<CudaContext>, config: &Qwen35Config) -> Result<KvPool> {
        let block_values = config.kv_bytes_per_token() / 4 * KV_BLOCK;
        let ordinal = ctx.ordinal();
        let stream = ctx.new_stream().map_err(|e| anyhow::anyhow!("cuda:{ordinal}: a stream for the K/V cache: {e:?}"))?;
        Ok(KvPool { stream, ordinal, config: config.clone(), block_values: block_values.max(1), blocks: Mutex::new(Blocks { slabs: Vec::new(), free: Vec::new(), allocated: 0, limit: None }) })
    }

    /// The GPU the pool's blocks are on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The GPU's free and total memory, in bytes, as the driver reports them now.
    pub fn memory(&self) -> Result<(usize, usize)> {
        let err = |e| anyhow::anyhow!("cuda:{}: reading the GPU's free memory: {e:?}", self.ordinal);
        self.stream.context().bind_to_thread().map_err(err)?;
        cudarc::driver::result::mem_get_info().map_err(err)
    }

    pub fn config(&self) -> &Qwen35Config {
        &self.config
    }

    /// Values (f32) per block.
    pub fn block_values(&self) -> usize {
        self.block_values
    }

    /// Bytes per block.
    pub fn block_bytes(&self) -> usize {
        4 * self.block_values
    }

    /// Let the pool hold at most `blocks` (more than it holds now, or it keeps what it has).
    pub fn set_limit(&self, blocks: Option<usize>) {
        self.lock().limit = blocks;
    }

    pub fn level(&self) -> KvLevel {
        self.lock().level(self.block_bytes())
    }

    /// Blocks states could still take under the limit (None: no limit set).
    pub fn available(&self) -> Option<usize> {
        let level = self.level();
        level.limit.map(|l| l.saturating_sub(level.used))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Blocks> {
        self.blocks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `n` blocks, all or none.
    fn take(&self, n: usize) -> Result<Vec<u64>> {
        let mut b = self.lock();
        let level = b.level(self.block_bytes());
        if level.limit.is_some_and(|l| level.used + n > l) {
            return Err(KvCacheFull { wanted: n, level, ordinal: self.ordinal }.into());
        }
        if b.free.len() < n {
            // A slab at a time, but never past the limit (checked above to leave room for n).
            let room = b.limit.map_or(usize::MAX, |l| l.saturating_sub(b.allocated));
            let want = (n - b.free.len()).max(SLAB_BLOCKS.min(room));
            // SAFETY: a block is written (by the kernels or a state copy) before it is read: the
            // attention reads only positions below the sequence's, which it wrote first.
            let slab = match unsafe { self.stream.alloc::<f32>(want * self.block_values) } {
                Ok(s) => s,
                Err(e) => bail!("cuda:{}: allocating {want} K/V blocks ({} MB): {e:?}", self.ordinal, (want * self.block_bytes()) >> 20),
            };
            self.stream.synchronize().map_err(|e| anyhow::anyhow!("cuda:{}: allocating K/V blocks: {e:?}", self.ordinal))?;
            let base = cudarc::driver::DevicePtr::device_ptr(&slab, &self.stream).0;
            let bytes = self.block_bytes() as u64;
            b.free.extend((0..want as u64).rev().map(|i| base + i * bytes));
            b.allocated += want;
            b.slabs.push(slab);
        }
        let at = b.free.len() - n;
        Ok(b.free.split_off(at))
    }

    fn give(&self, blocks: &mut Vec<u64>) {
        self.lock().free.append(blocks);
    }
}

/// A sequence's blocks of the pool, in position order (its block table); given back when
/// dropped.
pub struct KvBlocks {
    pool: Arc<KvPool>,
    table: Vec<u64>,
}

impl KvBlocks {
    pub fn new(pool: Arc<KvPool>) -> KvBlocks {
        KvBlocks { pool, table: Vec::new() }
    }

    /// The block addresses, in position order.
    pub fn table(&self) -> &[u64] {
        &self.table
    }

    /// Positions the blocks hold.
    pub fn capacity(&self) -> usize {
        self.table.len() * KV_BLOCK
    }

    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// Blocks these lack to hold `end` positions.
    pub fn short(&self, end: usize) -> usize {
        end.div_ceil(KV_BLOCK).saturating_sub(self.table.len())
    }

    /// Make room for `end` positions: the blocks that takes, all or none.
    pub fn grow(&mut self, end: usize) -> Result<()> {
        let want = self.short(end);
        if want > 0 {
            let more = self.pool.take(want)?;
            self.table.extend(more);
        }
        Ok(())
    }
}

impl Drop for KvBlocks {
    fn drop(&mut self) {
        self.pool.give(&mut self.table);
    }
}
