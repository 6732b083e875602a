//! The memory budget of a CPU decode engine (`--kv-cache-memory` with a CPU decode engine).
//! A CPU state's arrays live in host memory and its K/V grows as tokens are applied, so there
//! is no pool to hand pieces out of; the budget counts what the pipeline's sequences hold in
//! the units of a GPU engine's pools (one state slot a sequence, K/V blocks of `KV_BLOCK`
//! positions), as leases the sequences carry and give back when they are dropped. The loops
//! keep the work within it as they do a GPU's pools: a request waits for a slot and its
//! prompt's blocks, and where a running sequence finds no block for its next token the
//! sequence admitted last is swapped out (to a state file on disk, `swap_file.rs`).

use std::sync::{Arc, Mutex};

use anyhow::Result;

use crate::backend::cuda::qwen35::device_pool::{PoolFull, PoolLevel};
use crate::backend::cuda::qwen35::kv_cache::KV_BLOCK;
use crate::model::config::Qwen35Config;

/// The limits and what the leases hold, in slots and blocks.
pub struct HostBudget {
    block_bytes: usize,
    slot_bytes: usize,
    limits: Held,
    held: Mutex<Held>,
}

#[derive(Clone, Copy, Default)]
struct Held {
    slots: usize,
    blocks: usize,
}

/// One sequence's share of the budget: a slot and the blocks for its positions so far.
pub struct Lease {
    budget: Arc<HostBudget>,
    blocks: usize,
}

impl HostBudget {
    /// A budget of `kv_bytes` of K/V (whole blocks) and `slots` state slots for the model `cfg`.
    pub fn new(cfg: &Qwen35Config, kv_bytes: usize, slots: usize) -> HostBudget {
        let block_bytes = KV_BLOCK * cfg.kv_bytes_per_token();
        // A slot: the fixed-size state and the logits the state carries.
        let slot_bytes = cfg.recurrent_state_bytes() + 4 * cfg.vocab_size;
        HostBudget { block_bytes, slot_bytes, limits: Held { slots, blocks: kv_bytes / block_bytes }, held: Mutex::new(Held::default()) }
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    pub fn block_limit(&self) -> usize {
        self.limits.blocks
    }

    pub fn slot_limit(&self) -> usize {
        self.limits.slots
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How full the K/V budget is, in blocks (`allocated` is what the leases hold: host memory
    /// is taken as it is used).
    pub fn kv_level(&self) -> PoolLevel {
        let used = self.held().blocks;
        PoolLevel { used, allocated: used, limit: Some(self.limits.blocks), piece_bytes: self.block_bytes }
    }

    /// How many state slots the leases hold.
    pub fn slot_level(&self) -> PoolLevel {
        let used = self.held().slots;
        PoolLevel { used, allocated: used, limit: Some(self.limits.slots), piece_bytes: self.slot_bytes }
    }

    /// Blocks and slots still free: (blocks, slots).
    pub fn available(&self) -> (usize, usize) {
        let held = *self.held();
        (self.limits.blocks.saturating_sub(held.blocks), self.limits.slots.saturating_sub(held.slots))
    }

    /// A slot and the blocks that `end` positions take, all or none (a `PoolFull` error where
    /// the budget has no room: the caller may wait).
    pub fn lease(self: &Arc<Self>, end: usize) -> Result<Lease> {
        let blocks = end.div_ceil(KV_BLOCK);
        let mut held = self.held();
        if held.slots + 1 > self.limits.slots {
            return Err(self.full("state slots", 1, held.slots, self.limits.slots, self.slot_bytes).into());
        }
        if held.blocks + blocks > self.limits.blocks {
            return Err(self.full("K/V blocks", blocks, held.blocks, self.limits.blocks, self.block_bytes).into());
        }
        held.slots += 1;
        held.blocks += blocks;
        Ok(Lease { budget: Arc::clone(self), blocks })
    }

    fn full(&self, what: &'static str, wanted: usize, used: usize, limit: usize, piece_bytes: usize) -> PoolFull {
        PoolFull { what, wanted, level: PoolLevel { used, allocated: used, limit: Some(limit), piece_bytes }, device: "cpu".into() }
    }
}

impl Lease {
    /// Blocks the lease lacks to cover `end` positions.
    pub fn blocks_short(&self, end: usize) -> usize {
        end.div_ceil(KV_BLOCK).saturating_sub(self.blocks)
    }

    /// Cover `end` positions: take the blocks the lease lacks, all or none.
    pub fn grow(&mut self, end: usize) -> Result<()> {
        let more = self.blocks_short(end);
        if more == 0 {
            return Ok(());
        }
        let b = &self.budget;
        let mut held = b.held();
        if held.blocks + more > b.limits.blocks {
            return Err(b.full("K/V blocks", more, held.blocks, b.limits.blocks, b.block_bytes).into());
        }
        held.blocks += more;
        self.blocks += more;
        Ok(())
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lease {{ a slot and {} blocks }}", self.blocks)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut held = self.budget.held();
        held.slots -= 1;
        held.blocks -= self.blocks;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_take_slots_and_blocks_all_or_none_and_give_them_back() {
        let cfg = Qwen35Config::preset("tiny").unwrap();
        let block = KV_BLOCK * cfg.kv_bytes_per_token();
        let budget = Arc::new(HostBudget::new(&cfg, 5 * block + block / 2, 2));
        assert_eq!((budget.block_limit(), budget.slot_limit()), (5, 2));
        let mut a = budget.lease(KV_BLOCK + 1).unwrap();
        assert_eq!(budget.available(), (3, 1));
        // Growing within the blocks held takes nothing; past them, one more.
        a.grow(2 * KV_BLOCK).unwrap();
        assert_eq!(budget.available(), (3, 1));
        a.grow(2 * KV_BLOCK + 1).unwrap();
        assert_eq!((budget.available(), a.blocks_short(5 * KV_BLOCK)), ((2, 1), 2));
        // Too many blocks: nothing taken, and the error says it is a full pool.
        let e = a.grow(6 * KV_BLOCK).unwrap_err();
        assert!(PoolFull::is(&e), "{e:#}");
        assert!(format!("{e:#}").contains("cpu: no room in the pool of K/V blocks: 3 more wanted, 3 of 5 in use"), "{e:#}");
        assert_eq!(budget.available(), (2, 1));
        let b = budget.lease(KV_BLOCK).unwrap();
        // No slot left.
        let e = budget.lease(1).unwrap_err();
        assert!(format!("{e:#}").contains("state slots"), "{e:#}");
        assert_eq!((budget.kv_level().used, budget.slot_level().used), (4, 2));
        drop(a);
        drop(b);
        assert_eq!(budget.available(), (5, 2));
    }
}
