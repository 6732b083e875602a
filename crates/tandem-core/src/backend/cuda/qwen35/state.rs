//! A request's state on the GPU: made fresh, copied from the host, from another GPU (a peer
//! copy) or back to the host (`bridge::device` chooses), and its K/V blocks taken as it
//! decodes. Its DeltaNet layers' arrays live in a slot of the engine's slot pool
//! (state_slots.rs), taken when the state is made.

use cudarc::driver::{CudaEvent, CudaStream};

use super::*;
use crate::state::new_snapshot_id;

impl GpuQwen35 {
    /// Host state to GPU state (the bridge's host-to-device copy).
    pub fn upload_state(&self, s: &State) -> Result<GpuState> {
        self.place_state(s)
    }

    /// The empty state of a fresh request: a slot zeroed on the GPU (copying a host state's
    /// zeros would cross the bus, 50 MB of recurrent state on the 9B model; and building that
    /// host state first took 2.4 ms of a 9B prefill on an H200). Its K/V blocks come on the
    /// first forward call, which knows how many it needs. A `PoolFull` error where the slot
    /// pool is at its limit.
    pub fn new_state(&self) -> Result<GpuState> {
        let slot = StateSlot::take(&self.slots)?;
        let g = &self.gpu;
        // SAFETY: the slot holds `bytes()` bytes; nothing else uses it while this state holds it.
        unsafe { cudarc::driver::result::memset_d8_async(slot.addr(), 0, slot.layout().bytes(), g.stream.cu_stream()) }.map_err(|e| anyhow::anyhow!("cuda:{}: zeroing a state slot: {e:?}", g.ordinal))?;
        Ok(self.state_in(slot, 0, KvBlocks::new(self.kv.clone()), LastLogits::Host(Arc::from(Vec::new())), Lineage::default()))
    }

    /// A state of `position` whose DeltaNet arrays are in `slot`, its K/V rows in `kv`.
    fn state_in(&self, slot: StateSlot, position: usize, kv: KvBlocks, last: LastLogits, lineage: Lineage) -> GpuState {
        let mut linear = 0;
        let layers = self
            .config
            .layer_types
            .iter()
            .map(|kind| match kind {
                LayerType::LinearAttention => {
                    linear += 1;
                    GpuLayerState::Linear { conv: DevPtr::new(slot.conv(linear - 1)), recurrent: DevPtr::new(slot.recurrent(linear - 1)) }
                }
                LayerType::FullAttention => GpuLayerState::Full,
            })
            .collect();
        GpuState { position, slot, layers, kv, stream: self.gpu.stream.clone(), last, step: None, staging: self.staging.clone(), lineage, handed_off: None }
    }

    /// `s` copied to the GPU (`place`).
    pub(super) fn place_state(&self, s: &State) -> Result<GpuState> {
        s.check_shape(&self.config)?;
        let row = self.config.num_key_value_heads * self.config.head_dim;
        let full: Vec<(&[f32], &[f32])> = s.layers.iter().filter_map(|l| if let LayerState::Full { k, v } = l { Some((&k[..], &v[..])) } else { None }).collect();
        self.place(s, |a, p| (&full[a].0[p * row..(p + 1) * row], &full[a].1[p * row..(p + 1) * row]), Lineage::default())
    }

    /// A host snapshot copied to the GPU (`place`), its K/V rows read from its spans where
    /// they are (no whole state gathered on the host first).
    pub fn place_snapshot(&self, h: &HostSnapshot) -> Result<GpuState> {
        let row = self.config.num_key_value_heads * self.config.head_dim;
        self.place(h.rest(), |a, p| h.kv_row(a, p, row), h.lineage.then(h.id, h.position()))
    }

    /// A host state copied to the GPU: the DeltaNet arrays of `s` (its K/V not read), and the
    /// K/V rows `rows(a, p)` gives for attention layer `a` at each position `p`, laid out in
    /// blocks straight into the page-locked staging buffers and copied from there into the
    /// state's blocks, a buffer filling while the other's copies run.
    fn place<'r>(&self, s: &State, rows: impl Fn(usize, usize) -> (&'r [f32], &'r [f32]) + Sync, lineage: Lineage) -> Result<GpuState> {
        let g = &self.gpu;
        let err = |e| anyhow::anyhow!("cuda:{}: copying a state to the GPU: {e:?}", g.ordinal);
        let mut kv = KvBlocks::new(self.kv.clone());
        kv.grow(s.position)?;
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        staging.upload_blocks(&g.stream, self.kv.block_values(), kv.table(), |b, out| fill_block(&self.config, b, s.position, &rows, out))?;
        drop(staging);
        // The DeltaNet layers' arrays in one copy, as the slot lays them out.
        let slot = StateSlot::take(&self.slots)?;
        let image = slot.layout().image(s.layers.iter().filter_map(|l| match l {
            LayerState::Linear { conv, recurrent } => Some((&conv[..], &recurrent[..])),
            LayerState::Full { .. } => None,
        }));
        // SAFETY: the slot holds the image's bytes; a copy from pageable memory returns once the
        // driver has taken the bytes, so `image` may go.
        unsafe { cudarc::driver::result::memcpy_htod_async(slot.addr(), &image[..], g.stream.cu_stream()) }.map_err(err)?;
        Ok(self.state_in(slot, s.position, kv, LastLogits::Host(Arc::from(s.last_logits.as_slice())), lineage))
    }

    /// A state of another GPU (or of another engine on this one) copied to this GPU: the
    /// bridge's device-to-device copy (a peer copy between two GPUs). Only the K/V blocks in use
    /// are copied, each in one piece.
    pub fn copy_state(&self, s: &GpuState) -> Result<GpuState> {
        let g = &self.gpu;
        let err = |e| anyhow::anyhow!("cuda:{}: copying a state from cuda:{}: {e:?}", g.ordinal, s.ordinal());
        if s.slot.layout() != self.slots.layout() {
            // Recurrent states of another dtype: converted through host memory.
            return self.place_state(&s.download()?);
        }
        // The source's writes must be done before this stream reads: those queued for it when
        // it was handed off, else everything queued on its stream.
        match &s.handed_off {
            Some(written) => written.synchronize().map_err(err)?,
            None => s.stream().synchronize().map_err(err)?,
        }
        let slot = StateSlot::take(&self.slots)?;
        let mut kv = KvBlocks::new(self.kv.clone());
        kv.grow(s.position)?;
        let bytes = self.kv.block_bytes();
        let (here, there) = (g.stream.context(), s.stream().context());
        if here != there {
            // Direct over NVLink or PCIe where the GPUs allow it (else through host memory).
            super::super::enable_peer_access(here, there);
            g.stream.context().bind_to_thread().map_err(err)?;
        }
        let pieces = kv.table().iter().zip(s.kv.table()).map(|(&to, &from)| (to, from, bytes));
        for (to, from, bytes) in pieces.chain([(slot.addr(), s.slot.addr(), slot.layout().bytes())]) {
            // SAFETY: blocks of the same size (one model's pools), slots of the same layout.
            // Between two GPUs a peer copy (a plain device copy of another context's address is
            // refused).
            unsafe {
                if here == there {
                    cudarc::driver::result::memcpy_dtod_async(to, from, bytes, g.stream.cu_stream())
                } else {
                    cudarc::driver::result::memcpy_peer_async(here.cu_ctx(), to, there.cu_ctx(), from, bytes, g.stream.cu_stream())
                }
            }
            .map_err(err)?;
        }
        g.synchronize()?;
        Ok(self.state_in(slot, s.position, kv, LastLogits::Host(s.shared_logits()?), s.lineage.clone()))
    }

    /// GPU state to host state (the bridge's device-to-host copy).
    pub fn download_state(&self, s: &GpuState) -> Result<State> {
        s.download()
    }

    /// Make room for `end` positions in the state's K/V blocks (all the blocks that takes, or
    /// none and an error: `PoolFull` where the pool is at its limit).
    pub fn reserve_kv(&self, state: &mut GpuState, end: usize) -> Result<()> {
        state.kv.grow(end)
    }
}

/// Block `b` of a state of `position` as the GPU holds it (kv_cache.rs; `kv_image` of that
/// block): the keys then values of each attention layer for `KV_BLOCK` positions, from
/// `rows(a, p)`, the rows past the position zero.
fn fill_block<'r>(c: &Qwen35Config, b: usize, position: usize, rows: &impl Fn(usize, usize) -> (&'r [f32], &'r [f32]), out: &mut [f32]) {
    let row = c.num_key_value_heads * c.head_dim;
    let skip = b * c.kv_bytes_per_token() / 4 * KV_BLOCK;
    out.fill(0.0);
    for p in b * KV_BLOCK..((b + 1) * KV_BLOCK).min(position) {
        for a in 0..c.num_full_attention_layers() {
            let at = key_row_at(c, a, p) - skip;
            let (k, v) = rows(a, p);
            out[at..at + row].copy_from_slice(k);
            out[at + KV_BLOCK * row..at + (KV_BLOCK + 1) * row].copy_from_slice(v);
        }
    }
}

/// The K/V rows of host state `s` laid out as its blocks hold them on the GPU (kv_cache.rs):
/// block after block, in each the attention layers' keys then values of `KV_BLOCK` positions
/// (the rows past the position zero). The plain layout `fill_block` is checked against.
#[cfg(test)]
fn kv_image(c: &Qwen35Config, s: &State) -> Vec<f32> {
    let row = c.num_key_value_heads * c.head_dim;
    let full: Vec<(&[f32], &[f32])> = s.layers.iter().filter_map(|l| if let LayerState::Full { k, v } = l { Some((&k[..], &v[..])) } else { None }).collect();
    let mut image = vec![0.0f32; s.position.div_ceil(KV_BLOCK) * c.kv_bytes_per_token() / 4 * KV_BLOCK];
    for p in 0..s.position {
        for (a, (k, v)) in full.iter().enumerate() {
            let at = key_row_at(c, a, p);
            image[at..at + row].copy_from_slice(&k[p * row..(p + 1) * row]);
            image[at + KV_BLOCK * row..at + (KV_BLOCK + 1) * row].copy_from_slice(&v[p * row..(p + 1) * row]);
        }
    }
    image
}

/// Where attention layer `a`'s key row of position `p` starts among the values of a state's
/// blocks laid end to end (its value row is `KV_BLOCK` rows further): kernels/attention.cu
/// `kv_row`, with the blocks in position order.
fn key_row_at(c: &Qwen35Config, a: usize, p: usize) -> usize {
    let row = c.num_key_value_heads * c.head_dim;
    (p / KV_BLOCK) * (c.kv_bytes_per_token() / 4 * KV_BLOCK) + a * 2 * KV_BLOCK * row + (p % KV_BLOCK) * row
}

/// The inverse of `kv_image`: rows `from..position` of each attention layer's keys and
/// values, from the values of the blocks from `first_block` on. The plain reading
/// `take_block_rows` is checked against.
#[cfg(test)]
fn kv_rows(c: &Qwen35Config, image: &[f32], first_block: usize, from: usize, position: usize) -> Vec<(Vec<f32>, Vec<f32>)> {
    let row = c.num_key_value_heads * c.head_dim;
    let skip = first_block * c.kv_bytes_per_token() / 4 * KV_BLOCK;
    (0..c.num_full_attention_layers())
        .map(|a| {
            let (mut k, mut v) = (Vec::with_capacity((position - from) * row), Vec::with_capacity((position - from) * row));
            for p in from..position {
                let at = key_row_at(c, a, p) - skip;
                k.extend_from_slice(&image[at..at + row]);
                v.extend_from_slice(&image[at + KV_BLOCK * row..at + (KV_BLOCK + 1) * row]);
            }
            (k, v)
        })
        .collect()
}

/// Rows `from..position` of block `b` (as the GPU holds it: `fill_block`) appended to each
/// attention layer's keys and values in `out` (blocks taken in order give `kv_rows`).
fn take_block_rows(c: &Qwen35Config, b: usize, from: usize, position: usize, block: &[f32], out: &mut [(Vec<f32>, Vec<f32>)]) {
    let row = c.num_key_value_heads * c.head_dim;
    let skip = b * c.kv_bytes_per_token() / 4 * KV_BLOCK;
    for p in (b * KV_BLOCK).max(from)..((b + 1) * KV_BLOCK).min(position) {
        for (a, (k, v)) in out.iter_mut().enumerate() {
            let at = key_row_at(c, a, p) - skip;
            k.extend_from_slice(&block[at..at + row]);
            v.extend_from_slice(&block[at + KV_BLOCK * row..at + (KV_BLOCK + 1) * row]);
        }
    }
}

/// A state of `position` whose DeltaNet arrays are in `slot` and K/V rows in `kv` (written on
/// `stream`), copied to host memory, with the K/V rows from position `from` on (the attention
/// layers hold rows `from..position`). Each block comes straight to the staging buffers, by
/// the GPU's copy engines: a gather into one buffer on the GPU first waited, from another
/// stream, for the SMs an engine's prefill held.
fn download(position: usize, from: usize, slot: &StateSlot, kv: &KvBlocks, stream: &Arc<CudaStream>, staging: &Mutex<Staging>, last_logits: Vec<f32>) -> Result<State> {
    let pool = kv.pool();
    let config = pool.config();
    let (first, used) = (from / KV_BLOCK, position.div_ceil(KV_BLOCK));
    let row = config.num_key_value_heads * config.head_dim;
    let mut rows: Vec<(Vec<f32>, Vec<f32>)> = (0..config.num_full_attention_layers()).map(|_| (Vec::with_capacity((position - from) * row), Vec::with_capacity((position - from) * row))).collect();
    let mut staging = staging.lock().unwrap_or_else(|e| e.into_inner());
    staging.download_blocks(stream, pool.block_values(), &kv.table()[first..used.max(first)], |i, block| take_block_rows(config, first + i, from, position, block, &mut rows))?;
    let mut kv = rows.into_iter();
    // The slot in one piece, as 4-byte words (a bf16 slot's recurrent values two a word).
    let layout = *slot.layout();
    let words = staging.download(stream, slot.addr(), layout.bytes() / 4)?;
    drop(staging);
    // The slot's bytes as the GPU wrote them (little-endian, as the host's: checked below).
    // SAFETY: f32 values viewed as their bytes (u8 has no alignment or validity to keep).
    let image = unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), 4 * words.len()) };
    const _: () = assert!(cfg!(target_endian = "little"), "a GPU state's bytes are read as the host's");
    let mut linear = layout.layers(image).into_iter();
    let layers = config
        .layer_types
        .iter()
        .map(|kind| {
            Ok(match kind {
                LayerType::LinearAttention => {
                    let (conv, recurrent) = linear.next().context("the state has more DeltaNet layers than its slot")?;
                    LayerState::Linear { conv: conv.into(), recurrent: recurrent.into() }
                }
                LayerType::FullAttention => {
                    let (k, v) = kv.next().context("the state has more attention layers than its K/V blocks")?;
                    LayerState::Full { k, v }
                }
            })
        })
        .collect::<Result<_>>()?;
    Ok(State { position, layers, last_logits })
}

/// A copy of a state kept on its GPU for a prefix cache (`GpuQwen35::snapshot_state`): its
/// slot's bytes in a slot of the snapshot pool, its full K/V blocks shared with the state it
/// was taken from, the block its position ends inside copied, its last logits on the host.
/// Restoring it (`restore_state`) makes a state the same way; nothing is written into a
/// snapshot after it is taken.
pub struct GpuSnapshot {
    pub position: usize,
    /// Its number (`new_snapshot_id`), and the snapshots the state it was taken of went on from.
    pub id: u64,
    pub lineage: Lineage,
    pub(super) slot: StateSlot,
    pub(super) kv: KvBlocks,
    pub(super) logits: SnapshotLogits,
    /// The stream of the engine that took it: its copies were queued there.
    pub(super) stream: Arc<CudaStream>,
    /// Passed on that stream once the copies are done.
    pub(super) ready: CudaEvent,
    /// How it leaves the GPU (`download`).
    pub(super) copy_out: Arc<CopyOut>,
}

/// Where a snapshot's last logits are: on the host (shared with the state, where it had them
/// there), or copied past its slot (from a batched call's buffer on the GPU: bringing them to
/// the host would stall the engine on every snapshot, and only a request that continues the
/// snapshot with nothing to prefill reads them).
pub(super) enum SnapshotLogits {
    Host(Arc<[f32]>),
    InSlot(usize),
}

/// The stream and staging buffers through which an engine's snapshots are copied to host
/// memory: their own, so that a prefix cache can move a snapshot off the GPU from its thread
/// while the engine works (and captures graphs, which a copy queued on its stream from
/// another thread would break) on its stream.
pub struct CopyOut {
    pub(super) stream: Arc<CudaStream>,
    pub(super) staging: Mutex<Staging>,
}

impl CopyOut {
    pub(super) fn new(ctx: &Arc<cudarc::driver::CudaContext>) -> Result<CopyOut> {
        let stream = ctx.new_stream().map_err(|e| anyhow::anyhow!("cuda:{}: a stream for snapshot copies: {e:?}", ctx.ordinal()))?;
        Ok(CopyOut { stream, staging: Mutex::new(Staging::default()) })
    }
}

impl GpuSnapshot {
    /// The GPU it lives on.
    pub fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// Wait until its copies (and the work queued before them: the forward that made the
    /// state) are done on the GPU.
    pub fn wait_ready(&self) -> Result<()> {
        self.ready.synchronize().map_err(|e| anyhow::anyhow!("cuda:{}: waiting for a snapshot: {e:?}", self.ordinal()))
    }

    /// Bytes of GPU memory it holds: its slot (with its logits) and its blocks (some of them
    /// shared).
    pub fn bytes(&self) -> usize {
        self.slot.bytes() + self.kv.table().len() * self.kv.pool().block_bytes()
    }

    /// Bytes of its slot (with its logits).
    pub fn slot_bytes(&self) -> usize {
        self.slot.bytes()
    }

    /// Its K/V blocks (addresses in the pool; shared blocks appear in several snapshots).
    pub fn blocks(&self) -> &[u64] {
        self.kv.table()
    }

    pub fn block_bytes(&self) -> usize {
        self.kv.pool().block_bytes()
    }

    /// The snapshot copied to host memory (a copy for another engine, or to keep in host
    /// memory when the device has no room), on a stream of its own: from any thread, while
    /// the engine that took it goes on.
    pub fn download(&self) -> Result<State> {
        self.download_from(0)
    }

    /// `download` with the K/V rows from position `from` on only (its attention layers hold
    /// rows `from..position`): the rows before are in host memory already.
    pub fn download_from(&self, from: usize) -> Result<State> {
        let logits = self.host_logits()?.to_vec();
        download(self.position, from.min(self.position), &self.slot, &self.kv, &self.copy_out.stream, &self.copy_out.staging, logits)
    }

    /// It in host memory, as a snapshot that shares the K/V spans of `earlier` (a host snapshot
    /// on its path) where its lineage says it went on from that one, so that only the rows
    /// past `earlier` cross the bus; else whole, sharing where the rows compare equal.
    pub fn to_host_snapshot(&self, earlier: Option<&HostSnapshot>) -> Result<HostSnapshot> {
        let host = match earlier {
            Some(e) if self.lineage.holds(e.id, e.position()) && e.position() <= self.position => HostSnapshot::sharing(self.download_from(e.position())?, e.kv().clone()),
            Some(e) => HostSnapshot::continuing(self.download()?, e),
            None => HostSnapshot::new(self.download()?),
        };
        Ok(host.numbered(self.id, self.lineage.clone()))
    }

    /// Its last logits on the host (copied there on the snapshot's own stream where they are
    /// on the GPU).
    pub fn host_logits(&self) -> Result<Arc<[f32]>> {
        let out = &self.copy_out;
        out.stream.wait(&self.ready).map_err(|e| anyhow::anyhow!("cuda:{}: waiting for a snapshot's copies: {e:?}", self.ordinal()))?;
        match self.logits {
            SnapshotLogits::Host(ref l) => Ok(l.clone()),
            SnapshotLogits::InSlot(n) => {
                let tail = self.slot.tail().context("a snapshot's logits past a slot without room for them")?;
                Ok(out.staging.lock().unwrap_or_else(|e| e.into_inner()).download(&out.stream, tail, n)?.into())
            }
        }
    }
}

impl GpuQwen35 {
    /// A snapshot of `s` kept on this GPU (`GpuSnapshot`), where this engine keeps snapshots
    /// (`keep_snapshots_on_device`; None where it does not). The copies are queued on this
    /// engine's stream, ahead of the state's next forward call.
    pub fn snapshot_state(&self, s: &GpuState) -> Result<Option<GpuSnapshot>> {
        let Some(pool) = &self.snapshot_slots else { return Ok(None) };
        let g = &self.gpu;
        if s.ordinal() != g.ordinal || !Arc::ptr_eq(s.kv.pool(), &self.kv) || s.slot.layout() != pool.layout() {
            return Ok(None);
        }
        let (slot, kv) = self.copy_in(pool, &s.slot, &s.kv, s.position, s.stream())?;
        let err = |e| anyhow::anyhow!("cuda:{}: copying a snapshot's logits: {e:?}", g.ordinal);
        let logits = match s.device_logits()? {
            None => SnapshotLogits::Host(s.shared_logits()?),
            Some((src, n, written_on)) => {
                if !Arc::ptr_eq(written_on, &g.stream) {
                    written_on.synchronize().map_err(err)?;
                }
                let tail = slot.tail().filter(|_| n <= self.config.vocab_size).context("the snapshot pool's slots have no room for these logits")?;
                // SAFETY: the tail holds the vocabulary's logits (`for_snapshots`); `src` holds n.
                unsafe { cudarc::driver::result::memcpy_dtod_async(tail, src, 4 * n, g.stream.cu_stream()) }.map_err(err)?;
                SnapshotLogits::InSlot(n)
            }
        };
        let ready = g.stream.record_event(None).map_err(|e| anyhow::anyhow!("cuda:{}: marking a snapshot's copies: {e:?}", g.ordinal))?;
        Ok(Some(GpuSnapshot { position: s.position, id: new_snapshot_id(), lineage: s.lineage.clone(), slot, kv, logits, stream: g.stream.clone(), ready, copy_out: self.copy_out.clone() }))
    }

    /// A state that goes on from `snap`: its slot copied into one of this engine's, its full
    /// K/V blocks shared, its last block copied. A snapshot of another GPU or pool comes
    /// through host memory. The last logits come along where `logits` (a request with nothing
    /// left to prefill samples from them; otherwise its prefill replaces them). A `PoolFull`
    /// error where this engine has no slot or block free.
    pub fn restore_state(&self, snap: &GpuSnapshot, logits: bool) -> Result<GpuState> {
        let g = &self.gpu;
        if snap.ordinal() != g.ordinal || !Arc::ptr_eq(snap.kv.pool(), &self.kv) || snap.slot.layout() != self.slots.layout() {
            return self.place_state(&snap.download()?);
        }
        let last = match &snap.logits {
            SnapshotLogits::Host(l) => l.clone(),
            SnapshotLogits::InSlot(_) if logits => snap.host_logits()?,
            SnapshotLogits::InSlot(_) => Arc::from(Vec::new()),
        };
        let (slot, kv) = self.copy_in(&self.slots, &snap.slot, &snap.kv, snap.position, &snap.stream)?;
        Ok(self.state_in(slot, snap.position, kv, LastLogits::Host(last), snap.lineage.then(snap.id, snap.position)))
    }

    /// The slot and K/V blocks of a state (or snapshot) of `position`, written on `written_on`,
    /// copied on this engine's stream: `slot`'s bytes into a slot of `pool`, the full blocks of
    /// `kv` shared and the last copied (`KvBlocks::share_prefix`).
    fn copy_in(&self, pool: &Arc<SlotPool>, slot: &StateSlot, kv: &KvBlocks, position: usize, written_on: &Arc<CudaStream>) -> Result<(StateSlot, KvBlocks)> {
        let g = &self.gpu;
        // The last writes were queued on that stream; the work of this engine is on this one.
        if !Arc::ptr_eq(written_on, &g.stream) {
            written_on.synchronize().map_err(|e| anyhow::anyhow!("cuda:{}: waiting for a state's stream: {e:?}", g.ordinal))?;
        }
        let copy = StateSlot::take(pool)?;
        let blocks = kv.share_prefix(position, &g.stream)?;
        // SAFETY: two slots of one layout (checked by the callers).
        unsafe { cudarc::driver::result::memcpy_dtod_async(copy.addr(), slot.addr(), copy.layout().bytes(), g.stream.cu_stream()) }
            .map_err(|e| anyhow::anyhow!("cuda:{}: copying a state slot: {e:?}", g.ordinal))?;
        Ok((copy, blocks))
    }
}

impl GpuState {
    /// The GPU this state lives on.
    pub fn ordinal(&self) -> usize {
        self.stream().context().ordinal()
    }

    pub(super) fn stream(&self) -> &std::sync::Arc<cudarc::driver::CudaStream> {
        &self.stream
    }

    /// Mark the work queued for this state so far, as it leaves the engine that made it (called
    /// on that engine's thread): a copy to another GPU then waits for that work only, not for
    /// the engine's next forward. `arrived` ends the mark.
    pub fn mark_handed_off(&mut self) -> Result<()> {
        self.handed_off = Some(self.stream.record_event(None).map_err(|e| anyhow::anyhow!("cuda:{}: marking a state handed off: {e:?}", self.ordinal()))?);
        Ok(())
    }

    /// End the mark of `mark_handed_off` (the state has arrived: an engine may write it again).
    pub fn arrived(&mut self) {
        self.handed_off = None;
    }

    /// This state copied to host memory (the bridge's device-to-host copy).
    pub fn download(&self) -> Result<State> {
        download(self.position, 0, &self.slot, &self.kv, &self.stream, &self.staging, self.host_logits()?)
    }

    /// K/V blocks this state must take to hold `end` positions.
    pub fn kv_blocks_short(&self, end: usize) -> usize {
        self.kv.short(end)
    }

    /// Bytes of state data on the GPU that a transfer moves (K/V up to the position).
    pub fn bytes(&self) -> usize {
        let pool = self.kv.pool();
        self.slot.layout().bytes()
            + pool.block_bytes() / KV_BLOCK * self.position
            + 4 * match &self.last {
                LastLogits::Host(l) => l.len(),
                LastLogits::InStep { .. } => self.step.as_ref().map_or(0, |s| s.ws.logits.len()),
                LastLogits::InBatch { vocab, .. } => *vocab,
            }
    }

    /// The last token's logits, copied to the host first if a decode step left them on the GPU.
    pub fn last_logits(&mut self) -> Result<&[f32]> {
        if !matches!(self.last, LastLogits::Host(_)) {
            self.last = LastLogits::Host(self.host_logits()?.into());
        }
        match &self.last {
            LastLogits::Host(l) => Ok(l),
            _ => unreachable!("brought to the host above"),
        }
    }

    /// The argmax of the last logits (`sampling::argmax`), where the GPU found it: after a
    /// decode step replayed from its graph.
    pub fn last_argmax(&self) -> Option<u32> {
        match self.last {
            LastLogits::InStep { argmax } | LastLogits::InBatch { argmax, .. } => Some(argmax),
            LastLogits::Host(_) => None,
        }
    }

    /// Whether the state has logits to sample from (a fresh state has none).
    pub fn has_logits(&self) -> bool {
        !matches!(&self.last, LastLogits::Host(l) if l.is_empty())
    }

    /// The last logits on the host, shared where they are there already (a snapshot holds
    /// them without a copy).
    fn shared_logits(&self) -> Result<Arc<[f32]>> {
        match &self.last {
            LastLogits::Host(l) => Ok(l.clone()),
            _ => Ok(self.host_logits()?.into()),
        }
    }

    /// Where the last logits are on the GPU (an address, their count and the stream that wrote
    /// them); None where they are on the host.
    fn device_logits(&self) -> Result<Option<(u64, usize, &Arc<CudaStream>)>> {
        match &self.last {
            LastLogits::Host(_) => Ok(None),
            LastLogits::InStep { .. } => {
                let step = self.step.as_ref().context("the decode step whose buffer holds the logits is gone")?;
                let (src, _sync) = cudarc::driver::DevicePtr::device_ptr(&*step.ws.logits, &step.stream);
                Ok(Some((src, step.ws.logits.len(), &step.stream)))
            }
            LastLogits::InBatch { logits, written, step, row, vocab, stream, .. } => {
                if written.load(Ordering::Acquire) != *step {
                    bail!("this state's logits were overwritten by a later batched decode step (read them before the next step)");
                }
                let (src, _sync) = cudarc::driver::DevicePtr::device_ptr(&**logits, stream);
                Ok(Some((src + (row * vocab * 4) as u64, *vocab, stream)))
            }
        }
    }

    /// A host copy of the last logits, wherever they are.
    pub fn host_logits(&self) -> Result<Vec<f32>> {
        if let LastLogits::Host(l) = &self.last {
            return Ok(l.to_vec());
        }
        let (src, n, stream) = self.device_logits()?.context("logits neither on the host nor on the GPU")?;
        self.staging.lock().unwrap_or_else(|e| e.into_inner()).download(stream, src, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host state laid out as K/V blocks and read back gives the same rows, for positions
    /// that fill blocks exactly, end inside one, and none; each attention layer's rows where
    /// the kernels look for them (kernels/attention.cu kv_row).
    #[test]
    fn kv_blocks_hold_a_host_states_rows() {
        let c = Qwen35Config::preset("qwen3.5-0.8b").unwrap();
        let row = c.num_key_value_heads * c.head_dim;
        let attention_layers = c.num_full_attention_layers();
        assert!(attention_layers >= 2, "the test wants two attention layers to tell their places apart");
        for position in [0, 1, KV_BLOCK, 2 * KV_BLOCK + 5] {
            let mut s = State::new(&c);
            let mut next = 0.0f32;
            for l in &mut s.layers {
                if let LayerState::Full { k, v } = l {
                    for buf in [k, v] {
                        *buf = (0..position * row).map(|_| { next += 1.0; next }).collect();
                    }
                }
            }
            s.position = position;
            let image = kv_image(&c, &s);
            let block_values = attention_layers * 2 * KV_BLOCK * row;
            assert_eq!(image.len(), position.div_ceil(KV_BLOCK) * block_values);
            let full: Vec<_> = s.layers.iter().filter_map(|l| if let LayerState::Full { k, v } = l { Some((k, v)) } else { None }).collect();
            for p in 0..position {
                for (a, (k, v)) in full.iter().enumerate() {
                    let key = (p / KV_BLOCK) * block_values + a * 2 * KV_BLOCK * row + (p % KV_BLOCK) * row;
                    assert_eq!(&image[key..key + row], &k[p * row..(p + 1) * row], "layer {a} key of position {p}");
                    assert_eq!(&image[key + KV_BLOCK * row..key + (KV_BLOCK + 1) * row], &v[p * row..(p + 1) * row], "layer {a} value of position {p}");
                }
            }
            let back = kv_rows(&c, &image, 0, 0, position);
            assert_eq!(back.len(), attention_layers);
            for ((k, v), (k0, v0)) in back.iter().zip(&full) {
                assert_eq!(k, *k0);
                assert_eq!(v, *v0);
            }
            // From a position inside the second block: the image of the blocks from there on.
            let from = position.min(KV_BLOCK + 3);
            let first = from / KV_BLOCK;
            let tail = kv_rows(&c, &image[(first * block_values).min(image.len())..], first, from, position);
            for ((k, v), (k0, v0)) in tail.iter().zip(&full) {
                assert_eq!(&k[..], &k0[from * row..]);
                assert_eq!(&v[..], &v0[from * row..]);
            }
            let mut taken = vec![(Vec::new(), Vec::new()); attention_layers];
            for b in first..position.div_ceil(KV_BLOCK) {
                take_block_rows(&c, b, from, position, &image[b * block_values..(b + 1) * block_values], &mut taken);
            }
            assert!(taken == tail, "rows taken block by block from {from} of {position}");
            // Each block filled on its own from the rows (of the state, and of a host snapshot
            // of it in two spans) is that block of the image.
            let rows = |a: usize, p: usize| (&full[a].0[p * row..(p + 1) * row], &full[a].1[p * row..(p + 1) * row]);
            let first_part = {
                let mut f = s.clone();
                f.position = position / 2;
                for l in &mut f.layers {
                    if let LayerState::Full { k, v } = l {
                        k.truncate(f.position * row);
                        v.truncate(f.position * row);
                    }
                }
                crate::state::HostSnapshot::new(f)
            };
            let spans = crate::state::HostSnapshot::continuing(s.clone(), &first_part);
            assert_eq!(spans.spans().count(), 2, "the rows of the first half in a span of their own");
            for b in 0..position.div_ceil(KV_BLOCK) {
                let mut out = vec![f32::NAN; block_values];
                fill_block(&c, b, position, &rows, &mut out);
                assert!(out == image[b * block_values..(b + 1) * block_values], "block {b} of {position} positions");
                out.fill(f32::NAN);
                fill_block(&c, b, position, &|a, p| spans.kv_row(a, p, row), &mut out);
                assert!(out == image[b * block_values..(b + 1) * block_values], "block {b} of {position} positions, from spans");
            }
        }
    }
}
