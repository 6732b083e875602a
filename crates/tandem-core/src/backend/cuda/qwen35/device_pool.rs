//! Pieces of GPU memory of one size, handed out to states and taken back: the K/V cache's
//! blocks (kv_cache.rs) and the state slots (state_slots.rs). The pool takes memory in slabs
//! of pieces as it needs them, up to a limit if one is set (what a serving engine sizes from its
//! memory budget), and keeps what it took: pieces given back go to the free list for the next
//! state. Its slabs are allocated on a stream of its own and waited for, so that any engine's
//! stream may use them at once. A pool whose pieces another process will read or write (a state
//! moved by NIXL, CUDA IPC underneath) takes its slabs from `cuMemAlloc` instead
//! (`set_exportable`): memory of the stream-ordered allocator's default pool cannot be mapped by
//! another process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::Result;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

/// A pool of pieces of `piece_bytes` on one GPU.
pub struct DevicePool {
    /// What the pieces are, for messages ("K/V blocks", "state slots").
    what: &'static str,
    /// Where slabs are allocated (synchronized after each).
    stream: Arc<CudaStream>,
    ordinal: usize,
    piece_bytes: usize,
    /// Pieces per slab.
    slab: usize,
    pieces: Mutex<Pieces>,
}

/// One allocation of pieces.
enum Slab {
    /// From the stream-ordered allocator (freed with the slice).
    Ordered(CudaSlice<u8>),
    /// From `cuMemAlloc`, which another process can map; freed on drop.
    Exportable { addr: u64, bytes: usize, ctx: Arc<CudaContext> },
}

impl Drop for Slab {
    fn drop(&mut self) {
        if let Slab::Exportable { addr, ctx, .. } = self {
            // SAFETY: allocated by cuMemAlloc in this context; the pool that held it is gone, so
            // no piece of it is in use.
            if ctx.bind_to_thread().is_ok() {
                let _ = unsafe { cudarc::driver::result::free_sync(*addr) };
            }
        }
    }
}

struct Pieces {
    slabs: Vec<Slab>,
    /// Whether new slabs come from `cuMemAlloc` (`set_exportable`).
    exportable: bool,
    /// Addresses of the pieces no state holds.
    free: Vec<u64>,
    /// Pieces allocated so far (held or free).
    allocated: usize,
    /// The most pieces the pool may allocate (None: as many as the GPU gives).
    limit: Option<usize>,
    /// Pieces with more than one holder, and how many more (K/V blocks that snapshots of a
    /// prefix share, kv_cache.rs): a piece goes back to the free list when its last holder
    /// gives it.
    shared: HashMap<u64, usize>,
}

/// How full a pool is, in pieces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolLevel {
    /// Pieces held by states.
    pub used: usize,
    /// Pieces allocated (held or free).
    pub allocated: usize,
    /// The most pieces the pool may hold (None: no limit set).
    pub limit: Option<usize>,
    pub piece_bytes: usize,
}

impl Pieces {
    fn level(&self, piece_bytes: usize) -> PoolLevel {
        PoolLevel { used: self.allocated - self.free.len(), allocated: self.allocated, limit: self.limit, piece_bytes }
    }
}

/// A pool is out of pieces: its limit is reached (or the GPU is out of memory). The work that
/// wanted them may wait for room: running states give theirs back as they finish. (A CPU
/// engine's memory budget, `pipeline::host_budget`, runs out with the same error.)
#[derive(Debug)]
pub struct PoolFull {
    pub what: &'static str,
    pub wanted: usize,
    pub level: PoolLevel,
    /// Whose pool: `cuda:N`, `cpu`.
    pub device: String,
}

/// What every `PoolFull` error says (a packed prefill's error reaches each prompt as text).
pub const POOL_FULL: &str = "no room in the pool of";

impl std::fmt::Display for PoolFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let l = &self.level;
        write!(f, "{}: {POOL_FULL} {}: {} more wanted, {} of {} in use", self.device, self.what, self.wanted, l.used, l.limit.unwrap_or(l.allocated))
    }
}

impl std::error::Error for PoolFull {}

impl PoolFull {
    /// Whether `e` is (or was, passed on as text) a `PoolFull`: the work may wait for room.
    pub fn is(e: &anyhow::Error) -> bool {
        e.downcast_ref::<PoolFull>().is_some() || e.chain().any(|c| c.to_string().contains(POOL_FULL))
    }
}

impl DevicePool {
    /// An empty pool of `what` on the GPU of `ctx`, pieces of `piece_bytes` (a multiple of 256,
    /// so that every piece is as aligned as an allocation), taken `slab` at a time.
    pub fn new(ctx: &Arc<CudaContext>, what: &'static str, piece_bytes: usize, slab: usize) -> Result<DevicePool> {
        let ordinal = ctx.ordinal();
        let stream = ctx.new_stream().map_err(|e| anyhow::anyhow!("cuda:{ordinal}: a stream for the pool of {what}: {e:?}"))?;
        let piece_bytes = piece_bytes.max(1).next_multiple_of(256);
        Ok(DevicePool { what, stream, ordinal, piece_bytes, slab: slab.max(1), pieces: Mutex::new(Pieces { slabs: Vec::new(), exportable: false, free: Vec::new(), allocated: 0, limit: None, shared: HashMap::new() }) })
    }

    /// The GPU the pieces are on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn piece_bytes(&self) -> usize {
        self.piece_bytes
    }

    /// The stream the pool allocates on (bound to its GPU).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Let the pool hold at most `pieces` (more than it holds now, or it keeps what it has).
    pub fn set_limit(&self, pieces: Option<usize>) {
        self.lock().limit = pieces;
    }

    pub fn level(&self) -> PoolLevel {
        self.lock().level(self.piece_bytes)
    }

    /// Pieces states could still take under the limit (None: no limit set).
    pub fn available(&self) -> Option<usize> {
        let level = self.level();
        level.limit.map(|l| l.saturating_sub(level.used))
    }

    /// Take the slabs allocated from now on from `cuMemAlloc`, so that another process can map
    /// them (CUDA IPC: NIXL's transfers between processes on one host). Set it before the pool
    /// allocates, or its first slabs stay unexportable.
    pub fn set_exportable(&self) {
        self.lock().exportable = true;
    }

    /// The pool's allocations: (address, bytes) of each, in the order they were made (what a
    /// transfer engine registers to move pieces of them).
    pub fn slabs(&self) -> Vec<(u64, usize)> {
        self.lock()
            .slabs
            .iter()
            .map(|s| match s {
                Slab::Ordered(slice) => (cudarc::driver::DevicePtr::device_ptr(slice, &self.stream).0, slice.len()),
                Slab::Exportable { addr, bytes, .. } => (*addr, *bytes),
            })
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pieces> {
        self.pieces.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `n` pieces, all or none. Their bytes are what the last holder left (or undefined).
    pub fn take(&self, n: usize) -> Result<Vec<u64>> {
        let mut p = self.lock();
        let level = p.level(self.piece_bytes);
        if level.limit.is_some_and(|l| level.used + n > l) {
            return Err(PoolFull { what: self.what, wanted: n, level, device: format!("cuda:{}", self.ordinal) }.into());
        }
        if p.free.len() < n {
            // A slab at a time, but never past the limit (checked above to leave room for n).
            let room = p.limit.map_or(usize::MAX, |l| l.saturating_sub(p.allocated));
            let want = (n - p.free.len()).max(self.slab.min(room));
            let bytes = want * self.piece_bytes;
            let failed = |e: &dyn std::fmt::Debug| anyhow::anyhow!("cuda:{}: allocating {want} {} ({} MB): {e:?}", self.ordinal, self.what, bytes >> 20);
            let (slab, base) = if p.exportable {
                let ctx = self.stream.context().clone();
                ctx.bind_to_thread().map_err(|e| failed(&e))?;
                // SAFETY: a plain allocation in the bound context; every user writes a piece
                // before it reads it (see `take`'s callers).
                let addr = unsafe { cudarc::driver::result::malloc_sync(bytes) }.map_err(|e| failed(&e))?;
                (Slab::Exportable { addr, bytes, ctx }, addr)
            } else {
                // SAFETY: every user writes a piece before it reads it (see `take`'s callers).
                let slice = unsafe { self.stream.alloc::<u8>(bytes) }.map_err(|e| failed(&e))?;
                self.stream.synchronize().map_err(|e| anyhow::anyhow!("cuda:{}: allocating {}: {e:?}", self.ordinal, self.what))?;
                let base = cudarc::driver::DevicePtr::device_ptr(&slice, &self.stream).0;
                (Slab::Ordered(slice), base)
            };
            let piece = self.piece_bytes as u64;
            p.free.extend((0..want as u64).rev().map(|i| base + i * piece));
            p.allocated += want;
            p.slabs.push(slab);
        }
        let at = p.free.len() - n;
        Ok(p.free.split_off(at))
    }

    /// One more holder for each of `pieces` (held already): each goes back to the free list
    /// once every holder has given it.
    pub fn share(&self, pieces: &[u64]) {
        let mut p = self.lock();
        for &piece in pieces {
            *p.shared.entry(piece).or_insert(0) += 1;
        }
    }

    /// Pieces back (emptying `pieces`): to the free list, but for those another holder still
    /// has.
    pub fn give(&self, pieces: &mut Vec<u64>) {
        let mut p = self.lock();
        if p.shared.is_empty() {
            p.free.append(pieces);
            return;
        }
        for piece in pieces.drain(..) {
            match p.shared.get_mut(&piece) {
                Some(1) => {
                    p.shared.remove(&piece);
                }
                Some(more) => *more -= 1,
                None => p.free.push(piece),
            }
        }
    }
}
