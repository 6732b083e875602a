//! The paged K/V cache of an engine's full-attention layers. A sequence's keys and values live
//! in blocks of `KV_BLOCK` positions taken from the engine's pool as it grows and given back
//! the moment its state is dropped; its block table lists the blocks' addresses in position
//! order, and the attention kernels read and write through it (kernels/attention.cu: `kv_row`).
//! A block holds its positions' rows of every attention layer, keys then values per layer, so
//! that one table serves every layer and a block is one copy wherever it goes.
//!
//! The pool's blocks are pieces of a `DevicePool` (device_pool.rs: slabs, a free list, a limit
//! that a serving engine sizes from its memory budget). Engines on one GPU may share a pool
//! (`GpuQwen35::share_pools`): a prefill engine's state then decodes on the other engine in the
//! blocks it has, and one budget covers both.

use std::sync::Arc;

use anyhow::Result;
use cudarc::driver::CudaContext;

use super::device_pool::{DevicePool, PoolLevel};
use crate::model::config::Qwen35Config;

/// Positions per block (kernels/attention.cu KV_BLOCK).
pub const KV_BLOCK: usize = 16;
/// Blocks per allocation when the pool grows.
const SLAB_BLOCKS: usize = 64;

/// An engine's pool of K/V blocks; shared with the states that hold blocks of it.
pub struct KvPool {
    pieces: DevicePool,
    /// The model's shapes (where a block's rows are: `state.rs` lays host states out so).
    config: Qwen35Config,
    /// f32 values per block: every attention layer's keys and values of `KV_BLOCK` positions.
    block_values: usize,
}

impl KvPool {
    /// An empty pool on the GPU of `ctx`, for a model of `config`'s shapes.
    pub fn new(ctx: &Arc<CudaContext>, config: &Qwen35Config) -> Result<KvPool> {
        let block_values = (config.kv_bytes_per_token() / 4 * KV_BLOCK).max(1);
        // SAFETY of the pieces' contents: a block is written (by the kernels or a state copy)
        // before it is read: the attention reads only positions below the sequence's, which it
        // wrote first.
        let pieces = DevicePool::new(ctx, "K/V blocks", 4 * block_values, SLAB_BLOCKS)?;
        Ok(KvPool { pieces, config: config.clone(), block_values })
    }

    /// The GPU the pool's blocks are on.
    pub fn ordinal(&self) -> usize {
        self.pieces.ordinal()
    }

    /// The context of the pool's GPU.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.pieces.stream().context()
    }

    /// The GPU's free and total memory, in bytes, as the driver reports them now.
    pub fn memory(&self) -> Result<(usize, usize)> {
        let err = |e| anyhow::anyhow!("cuda:{}: reading the GPU's free memory: {e:?}", self.ordinal());
        self.pieces.stream().context().bind_to_thread().map_err(err)?;
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
        self.pieces.set_limit(blocks);
    }

    pub fn level(&self) -> PoolLevel {
        self.pieces.level()
    }

    /// Blocks states could still take under the limit (None: no limit set).
    pub fn available(&self) -> Option<usize> {
        self.pieces.available()
    }

    /// Allocate from now on memory another process can map (`DevicePool::set_exportable`).
    pub fn set_exportable(&self) {
        self.pieces.set_exportable();
    }

    /// The pool's allocations, (address, bytes) each.
    pub fn slabs(&self) -> Vec<(u64, usize)> {
        self.pieces.slabs()
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
            let more = self.pool.pieces.take(want)?;
            self.table.extend(more);
        }
        Ok(())
    }
}

impl KvBlocks {
    /// Blocks holding the first `position` positions of these, for another state or a snapshot
    /// of this one: the full blocks shared (no one writes them again: a state writes only at
    /// and past its position), the one the position ends inside copied on `stream`, as its
    /// holders will write its later rows. The copy is queued; it lands before any later work
    /// of `stream`.
    pub fn share_prefix(&self, position: usize, stream: &cudarc::driver::CudaStream) -> Result<KvBlocks> {
        let full = position / KV_BLOCK;
        assert!(position.div_ceil(KV_BLOCK) <= self.table.len(), "sharing {position} positions of blocks that hold {}", self.capacity());
        let mut table = Vec::with_capacity(position.div_ceil(KV_BLOCK));
        table.extend_from_slice(&self.table[..full]);
        if position % KV_BLOCK != 0 {
            let copy = self.pool.pieces.take(1)?[0];
            // SAFETY: two blocks of this pool, each `block_bytes` long.
            let copied = unsafe { cudarc::driver::result::memcpy_dtod_async(copy, self.table[full], self.pool.block_bytes(), stream.cu_stream()) };
            if let Err(e) = copied {
                self.pool.pieces.give(&mut vec![copy]);
                anyhow::bail!("cuda:{}: copying a K/V block: {e:?}", self.pool.ordinal());
            }
            table.push(copy);
        }
        self.pool.pieces.share(&self.table[..full]);
        Ok(KvBlocks { pool: self.pool.clone(), table })
    }
}

impl Drop for KvBlocks {
    fn drop(&mut self) {
        self.pool.pieces.give(&mut self.table);
    }
}
