//! The GPU memory a prefix cache keeps snapshots in: the slots of their DeltaNet states (a pool
//! of their own) and the K/V blocks they hold in the engines' block pool, shared with the
//! states they came from and with the requests that continue them.
//!
//! Its budget is taken from what the K/V cache would get: the running requests' blocks are
//! held to the K/V cache's limit plus what of the budget the snapshots' slots leave (they may
//! use blocks the snapshots do not hold), so that the two together never pass the memory
//! planned at start-up, and the cache keeps its slots and blocks within the budget.

use std::sync::Arc;

use crate::backend::cuda::qwen35::kv_cache::KvPool;
use crate::backend::cuda::qwen35::GpuPools;

pub struct DeviceTier {
    kv: Arc<KvPool>,
    budget: usize,
    /// The K/V pool's limit without the tier (None: the pool has none).
    kv_base: Option<usize>,
}

impl DeviceTier {
    /// A tier of `budget` bytes on the GPU of `pools`, whose K/V pool holds `kv_base` blocks
    /// for the running requests (None: no limit).
    pub fn new(pools: &GpuPools, budget: usize, kv_base: Option<usize>) -> DeviceTier {
        let tier = DeviceTier { kv: pools.kv.clone(), budget, kv_base };
        tier.rebalance(0);
        tier
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    /// The GPU it is on.
    pub fn ordinal(&self) -> usize {
        self.kv.ordinal()
    }

    /// Set the K/V pool's limit for the snapshots holding `slot_bytes` in slots: the blocks of
    /// the rest of the budget come on top of the K/V cache's own.
    pub fn rebalance(&self, slot_bytes: usize) {
        if let Some(base) = self.kv_base {
            self.kv.set_limit(Some(base + self.budget.saturating_sub(slot_bytes) / self.kv.block_bytes()));
        }
    }
}
