//! The CUDA backend: one GPU, its stream, cuBLAS, and tandem's kernels (kernels/, split by
//! family and joined for NVRTC, which compiles them at run time for the GPU found, and kept on
//! disk by compile.rs). The CUDA libraries are loaded when a GPU is first asked
//! for, not linked: tandem builds and runs on machines without CUDA, and there asking for a GPU
//! is an error that says what is missing.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr};

pub mod compile;
pub mod kernels;
pub mod launch;
pub mod qwen35;

use launch::{DevPtr, Kernel, Params};

/// One GPU with a stream that every launch and copy of tandem goes through (so they run in
/// order), a cuBLAS handle on that stream, and the compiled kernels.
pub struct Gpu {
    pub ordinal: usize,
    pub name: String,
    /// The architecture the kernels are compiled for, such as `sm_90`.
    pub arch: String,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    kernels: HashMap<&'static str, CudaFunction>,
    /// Where the compiled kernels came from: the kernel cache or NVRTC just now.
    pub kernel_origin: compile::Origin,
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Blocks of 256 threads of a kernel that run at once on the whole GPU, by kernel, as the
    /// driver reports them.
    resident: std::sync::Mutex<HashMap<&'static str, u32>>,
    /// Whether kernels launch with programmatic dependent launch (compute capability 9.0 and
    /// later, unless TANDEM_CUDA_PDL=0): a kernel starts while the one before it finishes and
    /// loads its weights meanwhile (kernels/common.cuh, pdl_enter).
    pub pdl: bool,
    /// Whether the launches of the forward call being queued use `pdl` (see `pdl_for`).
    pdl_now: std::sync::atomic::AtomicBool,
    /// Whether the GPU has bf16 mma instructions (compute capability 8.0 and later): the
    /// tensor-core prefill's attention kernel needs them.
    pub bf16_mma: bool,
    /// While profiling: each launch's kernel with events recorded before and after it.
    profile: std::sync::Mutex<Option<Vec<ProfiledLaunch>>>,
}

/// A launch being profiled: its kernel's name and the events recorded before and after it.
type ProfiledLaunch = (Cow<'static, str>, CudaEvent, CudaEvent);

/// Page-locked host memory of one GPU's context: copies between it and the GPU run
/// asynchronously on the stream and can be captured into a CUDA graph.
pub struct Pinned<T> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is plain host memory owned by this value; the GPU touches it only through
// copies that the owner synchronizes before it reads or writes the buffer again.
unsafe impl<T: Send> Send for Pinned<T> {}

impl<T: cudarc::driver::DeviceRepr + Copy> Pinned<T> {
    pub fn new(gpu: &Gpu, len: usize) -> Result<Pinned<T>> {
        Self::in_context(gpu.stream.context(), len)
    }

    fn in_context(ctx: &Arc<CudaContext>, len: usize) -> Result<Pinned<T>> {
        let (ctx, ordinal) = (ctx.clone(), ctx.ordinal());
        ctx.bind_to_thread().map_err(|e| anyhow::anyhow!("cuda:{ordinal}: {e:?}"))?;
        // SAFETY: a fresh allocation of len values, freed in Drop; zeroed before use.
        let ptr = unsafe { cudarc::driver::result::malloc_host(len.max(1) * std::mem::size_of::<T>(), 0) }.map_err(|e| anyhow::anyhow!("cuda:{ordinal}: allocating {len} values of page-locked memory: {e:?}"))? as *mut T;
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(Pinned { ptr, len, ctx })
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: len initialised values (zeroed at birth); see the Send note on GPU access.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in as_slice, with &mut self the only access from the host.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T> Drop for Pinned<T> {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_host in `new`, freed once.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}

/// Two page-locked buffers through which states come from the GPU to host memory: a copy into
/// pageable memory runs at a fraction of the bus's speed (the driver stages it through a buffer
/// of its own, one piece at a time), and with two buffers the CPU's copy of one piece overlaps
/// the GPU's copy of the next. Allocated at the first download (an engine whose states stay on
/// the GPU never needs them).
#[derive(Default)]
pub struct Staging {
    buffers: Option<[Pinned<f32>; 2]>,
}

/// Values per staging buffer (8 MB each).
const STAGING_VALUES: usize = 2 << 20;

/// Threads that lay out the blocks of one staging buffer (`Staging::upload_blocks`).
const FILL_THREADS: usize = 4;

impl Staging {
    /// The first `n` values at device address `src`, copied to a new host vector.
    pub fn download(&mut self, stream: &CudaStream, src: u64, n: usize) -> Result<Vec<f32>> {
        let err = |e| anyhow::anyhow!("copying a state from the GPU: {e:?}");
        let buffers = self.buffers(stream)?;
        let mut out = Vec::with_capacity(n);
        // The piece in flight: its buffer, length and the event after its copy.
        let mut in_flight: Option<(usize, usize, CudaEvent)> = None;
        let (mut at, mut which) = (0, 0);
        loop {
            let next = if at < n {
                let len = STAGING_VALUES.min(n - at);
                // SAFETY: src holds n values; the buffer is not read until the event has passed
                // and not written again until its piece has been copied out (below).
                unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut buffers[which].as_mut_slice()[..len], src + 4 * at as u64, stream.cu_stream()) }.map_err(err)?;
                let done = stream.record_event(None).map_err(err)?;
                at += len;
                which ^= 1;
                Some((which ^ 1, len, done))
            } else {
                None
            };
            if let Some((b, len, done)) = in_flight.take() {
                done.synchronize().map_err(err)?;
                out.extend_from_slice(&buffers[b].as_slice()[..len]);
            }
            match next {
                Some(piece) => in_flight = Some(piece),
                None => return Ok(out),
            }
        }
    }

    /// The two buffers (allocated at the first use) with `stream`'s context bound to this
    /// thread.
    fn buffers(&mut self, stream: &CudaStream) -> Result<&mut [Pinned<f32>; 2]> {
        stream.context().bind_to_thread().map_err(|e| anyhow::anyhow!("cuda:{}: {e:?}", stream.context().ordinal()))?;
        Ok(match &mut self.buffers {
            Some(b) => b,
            none => none.insert([Pinned::in_context(stream.context(), STAGING_VALUES)?, Pinned::in_context(stream.context(), STAGING_VALUES)?]),
        })
    }

    /// `buffers`, and how many blocks of `block_values` values one of them holds.
    fn buffers_for_blocks(&mut self, stream: &CudaStream, block_values: usize) -> Result<(&mut [Pinned<f32>; 2], usize)> {
        anyhow::ensure!(block_values > 0 && block_values <= STAGING_VALUES, "a K/V block of {block_values} values does not fit a staging buffer of {STAGING_VALUES}");
        Ok((self.buffers(stream)?, STAGING_VALUES / block_values))
    }

    /// Copy GPU blocks of `block_values` values each at the device addresses `blocks` to the
    /// host through the two buffers, handing each to `take(i, values)` in order; the CPU takes
    /// one buffer's blocks while the other's copies run.
    pub fn download_blocks(&mut self, stream: &CudaStream, block_values: usize, blocks: &[u64], mut take: impl FnMut(usize, &[f32])) -> Result<()> {
        let err = |e| anyhow::anyhow!("copying a state from the GPU: {e:?}");
        if blocks.is_empty() {
            return Ok(());
        }
        let (buffers, per_buffer) = self.buffers_for_blocks(stream, block_values)?;
        let groups: Vec<&[u64]> = blocks.chunks(per_buffer).collect();
        // The group in flight: its index and the event after its copies.
        let mut in_flight: Option<(usize, CudaEvent)> = None;
        for next in 0..=groups.len() {
            let queued = match groups.get(next) {
                Some(group) => {
                    let buffer = buffers[next % 2].as_mut_slice();
                    for (j, &src) in group.iter().enumerate() {
                        // SAFETY: `src` holds a block; the buffer is read only after the event
                        // recorded after these copies has passed, and written again only after
                        // it has been read (below).
                        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut buffer[j * block_values..(j + 1) * block_values], src, stream.cu_stream()) }.map_err(err)?;
                    }
                    Some((next, stream.record_event(None).map_err(err)?))
                }
                None => None,
            };
            if let Some((g, done)) = in_flight.take() {
                done.synchronize().map_err(err)?;
                let buffer = buffers[g % 2].as_slice();
                for j in 0..groups[g].len() {
                    take(g * per_buffer + j, &buffer[j * block_values..(j + 1) * block_values]);
                }
            }
            in_flight = queued;
        }
        Ok(())
    }

    /// Fill GPU blocks of `block_values` values each at the device addresses `blocks`, through
    /// the two buffers: `fill(i, out)` writes block i's values into `out`, on a few threads at
    /// once (laying rows out is the slow part: a restore laid out on one thread ran at about
    /// 3 GB/s on an H200's host, no faster than the 9B prefills the same tokens); the CPU fills
    /// one buffer's blocks while the other's copies run. Returns once the copies are done.
    pub fn upload_blocks(&mut self, stream: &CudaStream, block_values: usize, blocks: &[u64], fill: impl Fn(usize, &mut [f32]) + Sync) -> Result<()> {
        let err = |e| anyhow::anyhow!("copying a state to the GPU: {e:?}");
        if blocks.is_empty() {
            return Ok(());
        }
        let (buffers, per_buffer) = self.buffers_for_blocks(stream, block_values)?;
        // The event after each buffer's last copies: it is not written again before it passes.
        let mut copied: [Option<CudaEvent>; 2] = [None, None];
        for (piece, group) in blocks.chunks(per_buffer).enumerate() {
            let which = piece % 2;
            if let Some(done) = copied[which].take() {
                done.synchronize().map_err(err)?;
            }
            let buffer = &mut buffers[which].as_mut_slice()[..group.len() * block_values];
            let per_thread = group.len().div_ceil(FILL_THREADS);
            std::thread::scope(|scope| {
                for (t, part) in buffer.chunks_mut(per_thread * block_values).enumerate() {
                    let fill = &fill;
                    scope.spawn(move || {
                        for (j, out) in part.chunks_mut(block_values).enumerate() {
                            fill(piece * per_buffer + t * per_thread + j, out);
                        }
                    });
                }
            });
            for (j, &dst) in group.iter().enumerate() {
                // SAFETY: `dst` holds a block; the buffer is not written again until the event
                // recorded after these copies has passed.
                unsafe { cudarc::driver::result::memcpy_htod_async(dst, &buffer[j * block_values..(j + 1) * block_values], stream.cu_stream()) }.map_err(err)?;
            }
            copied[which] = Some(stream.record_event(None).map_err(err)?);
        }
        for done in copied.into_iter().flatten() {
            done.synchronize().map_err(err)?;
        }
        Ok(())
    }
}

/// Where and how `Gpu::gemm_bf16` writes its product.
#[derive(Clone, Copy, Debug)]
pub enum GemmOut {
    /// In f32.
    F32(DevPtr<f32>),
    /// Added to the f32 output (a residual connection).
    F32Add(DevPtr<f32>),
    /// Rounded to bf16.
    Bf16(DevPtr<u16>),
}

/// Restores the programmatic-launch setting `Gpu::pdl_for` changed.
pub struct PdlGuard<'g> {
    gpu: &'g Gpu,
    before: bool,
}

impl Drop for PdlGuard<'_> {
    fn drop(&mut self) {
        self.gpu.pdl_now.store(self.before, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Whether the CUDA driver library can be loaded on this machine, and if not, why not.
pub fn driver_missing() -> Option<String> {
    // SAFETY: only tries to dlopen the library under its usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Some("the NVIDIA driver library (libcuda.so) was not found: no NVIDIA GPU driver is installed on this machine".into());
    }
    None
}

/// How many CUDA GPUs this machine has; an error says why none can be used.
pub fn gpu_count() -> Result<usize> {
    if let Some(why) = driver_missing() {
        bail!("{why}");
    }
    CudaContext::device_count().map(|n| n as usize).map_err(|e| anyhow::anyhow!("cannot count GPUs: {e:?}"))
}

/// Let work of context `here` read and write memory of context `there` directly (over NVLink
/// or PCIe), where the two GPUs can: without it, a peer copy passes through host memory (a
/// 72 MB state took 4.6 ms between two NVLink-joined H200s). Once per pair and process; returns
/// whether access is on.
pub fn enable_peer_access(here: &Arc<CudaContext>, there: &Arc<CudaContext>) -> bool {
    use std::sync::{Mutex, OnceLock};
    static DONE: OnceLock<Mutex<HashMap<(usize, usize), bool>>> = OnceLock::new();
    let pair = (here.ordinal(), there.ordinal());
    if pair.0 == pair.1 {
        return true;
    }
    let mut done = DONE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    *done.entry(pair).or_insert_with(|| {
        let mut can = 0;
        // SAFETY: plain driver queries and a context setting, with the context bound.
        unsafe {
            if cudarc::driver::sys::cuDeviceCanAccessPeer(&mut can, here.cu_device(), there.cu_device()) != cudarc::driver::sys::CUresult::CUDA_SUCCESS || can == 0 {
                return false;
            }
            if here.bind_to_thread().is_err() {
                return false;
            }
            matches!(cudarc::driver::sys::cuCtxEnablePeerAccess(there.cu_ctx(), 0), cudarc::driver::sys::CUresult::CUDA_SUCCESS | cudarc::driver::sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
        }
    })
}

/// The names of this machine's CUDA GPUs, by ordinal (without compiling any kernels).
pub fn gpu_names() -> Result<Vec<String>> {
    (0..gpu_count()?)
        .map(|i| CudaContext::new(i).and_then(|c| c.name()).map_err(|e| anyhow::anyhow!("cuda:{i}: {e:?}")))
        .collect()
}

impl Gpu {
    /// Open GPU `ordinal`: checks that the driver, NVRTC and cuBLAS libraries load, that the GPU
    /// exists, and compiles the kernels for it.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        Gpu::open_with_priority(ordinal, false)
    }

    /// `open`, with the stream at the GPU's highest priority where `high`: where two engines
    /// share a GPU, the blocks of the decode engine's kernels are then scheduled before the
    /// prefill engine's waiting blocks (a decode step no longer waits for a whole prefill).
    pub fn open_with_priority(ordinal: usize, high: bool) -> Result<Gpu> {
        if let Some(why) = driver_missing() {
            bail!("cuda:{ordinal}: {why}");
        }
        // SAFETY: as above, dlopen attempts only.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            bail!("cuda:{ordinal}: the NVRTC library (libnvrtc.so) was not found; it compiles tandem's kernels at run time (install the CUDA toolkit or add its lib directory to LD_LIBRARY_PATH)");
        }
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            bail!("cuda:{ordinal}: the cuBLAS library (libcublas.so) was not found (install the CUDA toolkit or add its lib directory to LD_LIBRARY_PATH)");
        }
        let count = CudaContext::device_count().map_err(|e| {
            let stub = format!("{e:?}").contains("STUB_LIBRARY");
            anyhow::anyhow!(
                "cuda:{ordinal}: cannot count GPUs ({e:?}){}",
                if stub { ": the libcuda.so loaded is the CUDA toolkit's link-time stub, not the driver; take the toolkit's lib/stubs directory out of LD_LIBRARY_PATH" } else { "" }
            )
        })?;
        if ordinal >= count as usize {
            bail!("cuda:{ordinal}: this machine has {count} CUDA GPU(s) (cuda:0..cuda:{})", count.max(1) - 1);
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| anyhow::anyhow!("cuda:{ordinal}: cannot create a context ({e:?})"))?;
        // One stream does everything in order, so the per-buffer event tracking is not needed.
        // SAFETY: no buffer of this context is used from another stream.
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let (major, minor) = ctx.compute_capability().map_err(|e| anyhow::anyhow!("cuda:{ordinal}: {e:?}"))?;
        let arch = format!("sm_{major}{minor}");
        let (cubin, kernel_origin) = compile::kernels_for(&kernels::source(), &arch, compile::cache_dir().as_deref()).map_err(|e| anyhow::anyhow!("cuda:{ordinal}: {e:#}"))?;
        if let compile::Origin::Compiled { seconds, cached_to } = &kernel_origin {
            let kept = cached_to.as_ref().map_or("not cached".to_string(), |f| format!("cached in {}", f.display()));
            eprintln!("cuda:{ordinal}: kernels compiled for {arch} in {seconds:.1} s ({kept})");
        }
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)).map_err(|e| anyhow::anyhow!("cuda:{ordinal}: loading the kernels ({kernel_origin:?}): {e:?}"))?;
        let sms = ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(|e| anyhow::anyhow!("cuda:{ordinal}: {e:?}"))? as u32;
        let mut kernels = HashMap::new();
        for &(name, _) in kernels::ALL {
            let f = module.load_function(name).map_err(|e| anyhow::anyhow!("cuda:{ordinal}: kernel {name}: {e:?}"))?;
            kernels.insert(name, f);
        }
        // Buffers come from the device's default memory pool (stream-ordered allocation). Keep
        // what is freed in the pool instead of handing it back to the driver at every
        // synchronisation: a prefill allocates its workspace afresh, and remapping it each time
        // cost milliseconds.
        if ctx.has_async_alloc() {
            use cudarc::driver::sys;
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            let mut keep = u64::MAX;
            // SAFETY: the context's own device; the attribute takes a u64.
            unsafe {
                sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
                    .result()
                    .and_then(|()| sys::cuMemPoolSetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut keep as *mut u64 as *mut std::ffi::c_void).result())
            }
            .map_err(|e| anyhow::anyhow!("cuda:{ordinal}: configuring the memory pool: {e:?}"))?;
        }
        // A stream of its own (not the legacy default stream): a decode step is captured into a
        // CUDA graph on it, and two engines on one GPU run side by side on their own streams.
        let stream = if high {
            let (_least, greatest) = cudarc::driver::result::stream::get_priority_range().map_err(|e| anyhow::anyhow!("cuda:{ordinal}: stream priorities: {e:?}"))?;
            ctx.new_stream_with_priority(greatest)
        } else {
            ctx.new_stream()
        }
        .map_err(|e| anyhow::anyhow!("cuda:{ordinal}: creating a stream: {e:?}"))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| anyhow::anyhow!("cuda:{ordinal}: cuBLAS: {e:?}"))?;
        let pdl = major >= 9 && std::env::var("TANDEM_CUDA_PDL").map_or(true, |v| v != "0");
        Ok(Gpu { ordinal, name, arch, stream, blas, kernels, kernel_origin, sms, resident: Default::default(), pdl, pdl_now: true.into(), bf16_mma: major >= 8, profile: std::sync::Mutex::new(None) })
    }

    /// Programmatic launch on (`decode`) or off for the launches queued until the guard drops.
    /// A 9B prefill of 2048 tokens on an H200 ran at 23,548 tok/s with it and 26,236 without
    /// (bench, the same binary), most likely because a prefill's kernels run several waves of
    /// blocks and the next kernel's blocks, started early, hold SM resources the last waves
    /// need; a decode step, one wave per kernel, is faster with it.
    pub fn pdl_for(&self, decode: bool) -> PdlGuard<'_> {
        use std::sync::atomic::Ordering::Relaxed;
        PdlGuard { gpu: self, before: self.pdl_now.swap(decode, Relaxed) }
    }

    /// How many blocks of 256 threads of `kernel` (without dynamic shared memory) the GPU runs
    /// at once.
    pub fn resident_blocks<P: Params>(&self, kernel: Kernel<P>) -> Result<u32> {
        let name = kernel.name;
        let f = self.kernels.get(name).with_context(|| format!("no kernel {name}"))?;
        let mut known = self.resident.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&n) = known.get(name) {
            return Ok(n);
        }
        let per_sm = f.occupancy_max_active_blocks_per_multiprocessor(256, 0, None).map_err(|e| anyhow::anyhow!("cuda:{}: kernel {name}: {e:?}", self.ordinal))?;
        let n = per_sm.max(1) * self.sms;
        known.insert(name, n);
        Ok(n)
    }

    /// Queue `work` on the stream; while profiling, between two events recorded under `name`.
    /// Run `work`, which queues one launch, between two events while profiling (`name` is
    /// asked for only then).
    fn timed(&self, name: impl FnOnce() -> Cow<'static, str>, work: impl FnOnce() -> Result<()>) -> Result<()> {
        let mut profile = self.profile.lock().unwrap_or_else(|e| e.into_inner());
        let event = || self.stream.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| anyhow::anyhow!("cuda:{}: {e:?}", self.ordinal));
        let before = if profile.is_some() { Some(event()?) } else { None };
        work()?;
        if let (Some(list), Some(before)) = (profile.as_mut(), before) {
            list.push((name(), before, event()?));
        }
        Ok(())
    }

    /// Time every kernel launched from now until `finish_profile` (with an event before and
    /// after each: not for CUDA graph captures, and a little slower than without).
    pub fn start_profile(&self) {
        *self.profile.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
    }

    /// Stop profiling: each kernel's name, total milliseconds and number of launches, the most
    /// time first.
    pub fn finish_profile(&self) -> Result<Vec<(Cow<'static, str>, f64, usize)>> {
        let list = self.profile.lock().unwrap_or_else(|e| e.into_inner()).take().unwrap_or_default();
        self.synchronize()?;
        let mut by_name: HashMap<Cow<'static, str>, (f64, usize)> = HashMap::new();
        for (name, a, b) in list {
            let ms = a.elapsed_ms(&b).map_err(|e| anyhow::anyhow!("cuda:{}: {e:?}", self.ordinal))? as f64;
            let e = by_name.entry(name).or_default();
            e.0 += ms;
            e.1 += 1;
        }
        let mut out: Vec<_> = by_name.into_iter().map(|(n, (ms, c))| (n, ms, c)).collect();
        out.sort_by(|a, b| b.1.total_cmp(&a.1));
        Ok(out)
    }

    pub fn upload<T: cudarc::driver::DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(host).map_err(|e| anyhow::anyhow!("cuda:{}: copying {} bytes to the GPU: {e:?}", self.ordinal, std::mem::size_of_val(host)))
    }

    pub fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros(n.max(1)).map_err(|e| anyhow::anyhow!("cuda:{}: allocating {} bytes: {e:?}", self.ordinal, n * std::mem::size_of::<T>()))
    }

    /// An uninitialised buffer of `n` values, for outputs that a kernel writes whole (saves the
    /// memset launch of `zeros`).
    pub fn scratch<T: cudarc::driver::DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: callers hand the buffer to a kernel or copy that writes all `n` values before
        // anything reads them.
        unsafe { self.stream.alloc(n.max(1)) }.map_err(|e| anyhow::anyhow!("cuda:{}: allocating {} bytes: {e:?}", self.ordinal, n * std::mem::size_of::<T>()))
    }

    pub fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(&self, dev: &CudaSlice<T>, n: usize) -> Result<Vec<T>> {
        let mut host = vec![T::default(); n];
        self.stream.memcpy_dtoh(&dev.slice(..n), &mut host[..]).map_err(|e| anyhow::anyhow!("cuda:{}: copying from the GPU: {e:?}", self.ordinal))?;
        Ok(host)
    }

    /// Queue a copy of `src` to `dst` (capturable into a graph).
    pub fn copy_to_device<T: cudarc::driver::DeviceRepr + Copy>(&self, src: &Pinned<T>, dst: DevPtr<T>) -> Result<()> {
        // SAFETY: dst holds src.len values (the callers' workspace buffers).
        unsafe { cudarc::driver::result::memcpy_htod_async(dst.addr(), src.as_slice(), self.stream.cu_stream()) }.map_err(|e| anyhow::anyhow!("cuda:{}: copying to the GPU: {e:?}", self.ordinal))
    }

    /// Queue a copy of the first `n` values of `src` to `dst` (capturable).
    pub fn copy_part_to_device<T: cudarc::driver::DeviceRepr + Copy>(&self, src: &Pinned<T>, n: usize, dst: DevPtr<T>) -> Result<()> {
        // SAFETY: dst holds n values (the callers' workspace buffers); src holds at least n.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst.addr(), &src.as_slice()[..n], self.stream.cu_stream()) }.map_err(|e| anyhow::anyhow!("cuda:{}: copying to the GPU: {e:?}", self.ordinal))
    }

    /// Queue a copy of `dst.len` values at `src` into `dst` (capturable).
    pub fn copy_to_host<T: cudarc::driver::DeviceRepr + Copy>(&self, src: DevPtr<T>, dst: &mut Pinned<T>) -> Result<()> {
        // SAFETY: src holds dst.len values; dst is not read before the stream is synchronized.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst.as_mut_slice(), src.addr(), self.stream.cu_stream()) }.map_err(|e| anyhow::anyhow!("cuda:{}: copying from the GPU: {e:?}", self.ordinal))
    }

    /// Queue a copy of `n` values from `src` to `dst`, both on this GPU.
    pub fn copy_on_device<T: cudarc::driver::DeviceRepr>(&self, src: DevPtr<T>, dst: DevPtr<T>, n: usize) -> Result<()> {
        // SAFETY: the callers' buffers hold n values at src and at dst, and do not overlap.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst.addr(), src.addr(), n * std::mem::size_of::<T>(), self.stream.cu_stream()) }.map_err(|e| anyhow::anyhow!("cuda:{}: copying on the GPU: {e:?}", self.ordinal))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| anyhow::anyhow!("cuda:{}: {e:?}", self.ordinal))
    }

    /// `out[t, n] (+)= x[t, k] · W[n, k]ᵀ` in bf16 on tensor cores with f32 sums (cuBLAS; x
    /// and W bf16, out as `out` says): column-major `C[n, t] = W[k, n]ᵀ · X[k, t]`, which is
    /// row-major `out[t, n]`.
    pub fn gemm_bf16(&self, xb: DevPtr<u16>, t: usize, w: DevPtr<u16>, n: usize, k: usize, out: GemmOut) -> Result<()> {
        let (alpha, beta) = (1.0f32, if matches!(out, GemmOut::F32Add(_)) { 1.0f32 } else { 0.0 });
        let (out, out_type) = match out {
            GemmOut::F32(p) | GemmOut::F32Add(p) => (p.addr(), cudaDataType::CUDA_R_32F),
            GemmOut::Bf16(p) => (p.addr(), cudaDataType::CUDA_R_16BF),
        };
        // SAFETY: the three buffers hold t·k bf16, n·k bf16 and t·n values of out_type.
        // Profiled by shape: the step's GEMMs differ tenfold in how well cuBLAS fills the GPU.
        self.timed(|| format!("cuBLAS GEMM (bf16), {t} rows, {k} -> {n}").into(), || unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                t as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w.addr() as *const _,
                cudaDataType::CUDA_R_16BF,
                k as i32,
                xb.addr() as *const _,
                cudaDataType::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const _,
                out as *mut _,
                out_type,
                n as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| anyhow::anyhow!("cuda:{}: cuBLAS GEMM {t}x{k} by {n}x{k}: {e:?}", self.ordinal)))
    }

    /// This GPU's PCI address as NVML writes it ("00000000:65:00.0").
    pub fn pci_bus_id(&self) -> Result<String> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        let ctx = self.stream.context();
        let get = |a| ctx.attribute(a).map_err(|e| anyhow::anyhow!("cuda:{}: {e:?}", self.ordinal));
        Ok(format!("{:08X}:{:02X}:{:02X}.0", get(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?, get(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?, get(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?))
    }

    /// The device address of `s`, typed by its values (offsets are `DevPtr::offset`).
    pub fn ptr<T>(&self, s: &CudaSlice<T>) -> DevPtr<T> {
        let (p, _sync) = s.device_ptr(&self.stream);
        DevPtr::new(p)
    }
}
