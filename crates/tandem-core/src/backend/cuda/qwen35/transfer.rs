//! A GPU snapshot as it moves between processes, GPU memory to GPU memory (NIXL, with CUDA
//! IPC under it on one host). The receiver reserves the pieces a state of the prompt's length
//! will occupy: a slot of a pool of its own, with room past it for the last logits and a
//! header, and K/V blocks of its decode engine's pool. The sender's snapshot is already such
//! pieces (its slot, its blocks, its logits); the transfer writes each into its counterpart, and
//! the receiver's pieces become a snapshot its engine restores like any other (the blocks
//! shared, the slot copied on the GPU). Nothing passes through host memory but the header.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cudarc::driver::{CudaContext, CudaStream};

use super::kv_cache::{KvBlocks, KvPool, KV_BLOCK};
use super::state::{CopyOut, SnapshotLogits};
use super::state_slots::{SlotLayout, SlotPool, StateDtype, StateSlot};
use super::{GpuPools, GpuSnapshot};
use crate::model::config::Qwen35Config;
use crate::state::{new_snapshot_id, Lineage};

/// Bytes past the logits for the transfer's header.
pub const HEADER_ROOM: usize = 4096;

/// Where a state's pieces are in GPU memory, as a transfer moves them: the slot's bytes, the
/// logits then the header (`tail`), and the K/V blocks in position order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pieces {
    pub device: usize,
    pub slot: u64,
    pub slot_bytes: usize,
    /// The last logits (f32, the vocabulary's), then `HEADER_ROOM` bytes for the header.
    pub tail: u64,
    pub tail_bytes: usize,
    pub blocks: Vec<u64>,
    pub block_bytes: usize,
}

/// The memory states move through on one GPU: the decode engine's K/V pool, a slot pool of its
/// own (with room for logits and header past each slot), and, on a sender, the engine's
/// snapshot pool (its snapshots' slots are sent as they are). Every pool allocates memory other
/// processes can map.
pub struct TransferPools {
    kv: Arc<KvPool>,
    slots: Arc<SlotPool>,
    snapshots: Option<Arc<SlotPool>>,
    copy_out: Arc<CopyOut>,
    stream: Arc<CudaStream>,
    vocab: usize,
}

impl TransferPools {
    /// The transfer memory of an engine with `pools`, for a model of `vocab` tokens. Its pools
    /// allocate exportable memory from here on (`DevicePool::set_exportable`): make this before
    /// the engine's first state, or the slabs allocated until then cannot be moved.
    pub fn new(pools: &GpuPools, vocab: usize) -> Result<TransferPools> {
        Self::build(pools.kv.context(), pools.kv.clone(), *pools.slots.layout(), pools.snapshots.clone(), vocab)
    }

    /// Transfer memory of its own on GPU `ordinal` (no engine): what a benchmark's receiving
    /// process reserves states in.
    pub fn standalone(ordinal: usize, config: &Qwen35Config, dtype: StateDtype) -> Result<TransferPools> {
        let ctx = CudaContext::new(ordinal).map_err(|e| anyhow::anyhow!("cuda:{ordinal}: {e:?}"))?;
        let kv = Arc::new(KvPool::new(&ctx, config)?);
        Self::build(&ctx, kv, SlotLayout::new(config, dtype), None, config.vocab_size)
    }

    fn build(ctx: &Arc<CudaContext>, kv: Arc<KvPool>, layout: SlotLayout, snapshots: Option<Arc<SlotPool>>, vocab: usize) -> Result<TransferPools> {
        let slots = Arc::new(SlotPool::for_snapshots(ctx, layout, 4 * vocab + HEADER_ROOM)?);
        // Every pool a transfer reads or writes, mappable by the other process (CUDA IPC).
        for pool in [Some(&slots), snapshots.as_ref()].into_iter().flatten() {
            pool.set_exportable();
        }
        kv.set_exportable();
        let copy_out = Arc::new(CopyOut::new(ctx)?);
        let stream = copy_out.stream.clone();
        Ok(TransferPools { kv, slots, snapshots, copy_out, stream, vocab })
    }

    pub fn ordinal(&self) -> usize {
        self.kv.ordinal()
    }

    pub fn layout(&self) -> &SlotLayout {
        self.slots.layout()
    }

    pub fn block_bytes(&self) -> usize {
        self.kv.block_bytes()
    }

    /// Logits per state (the model's vocabulary).
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Every allocation a transfer may read or write: (address, bytes) of each (what NIXL
    /// registers; the pools grow, so this grows too).
    pub fn regions(&self) -> Vec<(u64, usize)> {
        let mut r = self.kv.slabs();
        r.extend(self.slots.slabs());
        if let Some(s) = &self.snapshots {
            r.extend(s.slabs());
        }
        r
    }

    /// The pieces a state of `prompt` tokens will occupy here (a `PoolFull` error where the
    /// pools have no room).
    pub fn reserve(&self, prompt: usize) -> Result<Incoming> {
        let mut kv = KvBlocks::new(self.kv.clone());
        kv.grow(prompt)?;
        let slot = StateSlot::take(&self.slots)?;
        Ok(Incoming { slot, kv, copy_out: self.copy_out.clone(), stream: self.stream.clone(), vocab: self.vocab })
    }

    /// Lay out what a transfer of `snap` sends besides its slot and blocks: its logits then
    /// `header`, in the tail of a slot of this pool (which the caller keeps until the
    /// transfer completes). Returns that slot and the pieces to send, once the snapshot's own
    /// copies and these are done.
    pub fn stage(&self, snap: &GpuSnapshot, header: &[u8]) -> Result<(StateSlot, Pieces)> {
        if header.len() > HEADER_ROOM {
            bail!("a transfer header of {} bytes (room for {HEADER_ROOM})", header.len());
        }
        let ordinal = self.ordinal();
        let err = |e| anyhow::anyhow!("cuda:{ordinal}: staging a state's logits and header: {e:?}");
        if snap.slot.layout() != self.layout() || snap.ordinal() != ordinal {
            bail!("cuda:{ordinal}: a snapshot of cuda:{} with {} recurrent states cannot be sent from this engine's transfer memory ({})", snap.ordinal(), snap.slot.layout().dtype, self.layout().dtype);
        }
        let blocks = snap.position.div_ceil(KV_BLOCK);
        if snap.kv.table().len() < blocks {
            bail!("a snapshot of {} tokens holds {} K/V blocks", snap.position, snap.kv.table().len());
        }
        snap.ready.synchronize().map_err(err)?;
        let staged = StateSlot::take(&self.slots)?;
        let tail = staged.tail().context("a transfer pool's slots have room past them")?;
        self.stream.context().bind_to_thread().map_err(err)?;
        let stream = self.stream.cu_stream();
        // SAFETY: the tail holds the vocabulary's logits and HEADER_ROOM bytes; the sources
        // hold what is copied; the stream is synchronized before the slot is handed out.
        unsafe {
            match &snap.logits {
                SnapshotLogits::Host(l) if l.len() == self.vocab => cudarc::driver::result::memcpy_htod_async(tail, &l[..], stream).map_err(err)?,
                SnapshotLogits::InSlot(n) if *n == self.vocab => {
                    let from = snap.slot.tail().context("a snapshot's logits past a slot without room for them")?;
                    cudarc::driver::result::memcpy_dtod_async(tail, from, 4 * n, stream).map_err(err)?
                }
                _ => bail!("the snapshot has no last logits of the vocabulary's {} tokens to send", self.vocab),
            }
            cudarc::driver::result::memcpy_htod_async(tail + 4 * self.vocab as u64, header, stream).map_err(err)?;
        }
        self.stream.synchronize().map_err(err)?;
        let pieces = Pieces {
            device: ordinal,
            slot: snap.slot.addr(),
            slot_bytes: snap.slot.layout().bytes(),
            tail,
            tail_bytes: 4 * self.vocab + header.len(),
            blocks: snap.kv.table()[..blocks].to_vec(),
            block_bytes: snap.kv.pool().block_bytes(),
        };
        Ok((staged, pieces))
    }
}

/// The pieces reserved for a state on its way.
pub struct Incoming {
    slot: StateSlot,
    kv: KvBlocks,
    copy_out: Arc<CopyOut>,
    stream: Arc<CudaStream>,
    vocab: usize,
}

impl Incoming {
    /// Where the state is to be written (the tail: room for the logits and `HEADER_ROOM`).
    pub fn pieces(&self) -> Pieces {
        Pieces {
            device: self.stream.context().ordinal(),
            slot: self.slot.addr(),
            slot_bytes: self.slot.layout().bytes(),
            tail: self.slot.tail().expect("a transfer pool's slots have room past them"),
            tail_bytes: 4 * self.vocab + HEADER_ROOM,
            blocks: self.kv.table().to_vec(),
            block_bytes: self.kv.pool().block_bytes(),
        }
    }

    /// The header's bytes as the sender wrote them (past the logits).
    pub fn header(&self) -> Result<Vec<u8>> {
        let ctx = self.stream.context();
        let err = |e| anyhow::anyhow!("cuda:{}: reading a transfer's header: {e:?}", ctx.ordinal());
        ctx.bind_to_thread().map_err(err)?;
        let mut out = vec![0u8; HEADER_ROOM];
        let at = self.slot.tail().expect("a transfer pool's slots have room past them") + 4 * self.vocab as u64;
        // SAFETY: the tail holds HEADER_ROOM bytes past the logits.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut out[..], at) }.map_err(err)?;
        Ok(out)
    }

    /// The pieces, written, as a snapshot of `position` tokens (its logits where the sender
    /// put them, past the slot). The caller has checked the header.
    pub fn into_snapshot(self, position: usize) -> Result<GpuSnapshot> {
        if self.kv.capacity() < position {
            bail!("a state of {position} tokens in K/V blocks reserved for {}", self.kv.capacity());
        }
        let ordinal = self.stream.context().ordinal();
        let ready = self.stream.record_event(None).map_err(|e| anyhow::anyhow!("cuda:{ordinal}: marking a received state: {e:?}"))?;
        Ok(GpuSnapshot { position, id: new_snapshot_id(), lineage: Lineage::default(), slot: self.slot, kv: self.kv, logits: SnapshotLogits::InSlot(self.vocab), stream: self.stream, ready, copy_out: self.copy_out })
    }
}
