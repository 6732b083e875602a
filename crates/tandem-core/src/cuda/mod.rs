//! The CUDA backend: one GPU, its stream, cuBLAS, and tandem's kernels (kernels.cu, compiled at
//! run time by NVRTC for the GPU found). The CUDA libraries are loaded when a GPU is first asked
//! for, not linked: tandem builds and runs on machines without CUDA, and there asking for a GPU
//! is an error that says what is missing.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};

pub mod qwen35;

const KERNELS: &str = include_str!("kernels.cu");
const KERNEL_NAMES: [&str; 15] = [
    "embed",
    "rms_norm",
    "add_inplace",
    "swiglu",
    "to_bf16",
    "gemv_bf16",
    "gemm_bf16_f32",
    "conv_silu",
    "l2norm_qk",
    "deltanet_32",
    "deltanet_64",
    "deltanet_128",
    "gated_rms_norm",
    "qk_norm_rope",
    "attention",
];

/// One GPU with a stream that every launch and copy of tandem goes through (so they run in
/// order), a cuBLAS handle on that stream, and the compiled kernels.
pub struct Gpu {
    pub ordinal: usize,
    pub name: String,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    kernels: HashMap<&'static str, CudaFunction>,
}

/// A kernel argument: a device address, an int or a float.
#[derive(Clone, Copy)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    F32(f32),
}

/// Whether the CUDA driver library can be loaded on this machine, and if not, why not.
pub fn driver_missing() -> Option<String> {
    // SAFETY: only tries to dlopen the library under its usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Some("the NVIDIA driver library (libcuda.so) was not found: no NVIDIA GPU driver is installed on this machine".into());
    }
    None
}

impl Gpu {
    /// Open GPU `ordinal`: checks that the driver, NVRTC and cuBLAS libraries load, that the GPU
    /// exists, and compiles the kernels for it.
    pub fn open(ordinal: usize) -> Result<Gpu> {
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
        let arch: &'static str = Box::leak(format!("sm_{major}{minor}").into_boxed_str());
        let opts = cudarc::nvrtc::CompileOptions { arch: Some(arch), options: vec!["-std=c++17".into()], ..Default::default() };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNELS, opts).map_err(|e| anyhow::anyhow!("cuda:{ordinal}: compiling tandem's kernels for {arch} failed: {e:?}"))?;
        let module = ctx.load_module(ptx).map_err(|e| anyhow::anyhow!("cuda:{ordinal}: loading the kernels: {e:?}"))?;
        let mut kernels = HashMap::new();
        for name in KERNEL_NAMES {
            let f = module.load_function(name).map_err(|e| anyhow::anyhow!("cuda:{ordinal}: kernel {name}: {e:?}"))?;
            kernels.insert(name, f);
        }
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(|e| anyhow::anyhow!("cuda:{ordinal}: cuBLAS: {e:?}"))?;
        Ok(Gpu { ordinal, name, stream, blas, kernels })
    }

    /// Launch kernel `name` on the stream.
    pub fn launch(&self, name: &str, grid: (u32, u32, u32), block: u32, shared: u32, args: &[Arg]) -> Result<()> {
        let f = self.kernels.get(name).with_context(|| format!("no kernel {name}"))?;
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Ptr(p) => b.arg(p),
                Arg::I32(i) => b.arg(i),
                Arg::F32(x) => b.arg(x),
            };
        }
        let cfg = LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: shared };
        // SAFETY: every kernel of kernels.cu is launched through the typed wrappers of
        // cuda/qwen35.rs, which pass its parameters in order with the sizes it was written for.
        unsafe { b.launch(cfg) }.map_err(|e| anyhow::anyhow!("cuda:{}: launching {name}: {e:?}", self.ordinal))?;
        Ok(())
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

    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| anyhow::anyhow!("cuda:{}: {e:?}", self.ordinal))
    }

    /// `out[t, n] = x[t, k] · W[n, k]ᵀ` in bf16 on tensor cores with f32 sums (cuBLAS; x and W
    /// bf16, out f32): column-major `C[n, t] = W[k, n]ᵀ · X[k, t]`, which is row-major `out[t, n]`.
    pub fn gemm_bf16(&self, xb: u64, t: usize, w: u64, n: usize, k: usize, out: u64) -> Result<()> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the three buffers hold t·k bf16, n·k bf16 and t·n f32 values.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                t as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                cudaDataType::CUDA_R_16BF,
                k as i32,
                xb as *const _,
                cudaDataType::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const _,
                out as *mut _,
                cudaDataType::CUDA_R_32F,
                n as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| anyhow::anyhow!("cuda:{}: cuBLAS GEMM {t}x{k} by {n}x{k}: {e:?}", self.ordinal))
    }

    /// The device address of `s` (kernels take raw addresses, so that offsets are plain adds).
    pub fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }
}
