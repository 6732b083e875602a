//! Typed kernel launches. Each kernel of kernels/ is declared once (kernels/mod.rs) as a
//! `Kernel` with its parameter types; a launch passes a tuple of exactly those types, so an
//! argument of the wrong kind, element type or count does not compile, and the CPU emulation
//! test (tests/cuda_on_cpu.rs) holds every declaration to the kernel's C++ signature.

use std::marker::PhantomData;

use anyhow::{Context, Result};

use super::Gpu;

/// A device address of values of type `T` (`f32`, `u32`, or `u16` for bf16): what a kernel's
/// `T*` parameter takes.
#[derive(Debug)]
pub struct DevPtr<T> {
    addr: u64,
    values: PhantomData<fn() -> T>,
}

impl<T> Clone for DevPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DevPtr<T> {}

impl<T> DevPtr<T> {
    /// No buffer: for an optional output that a kernel skips when it is null.
    pub const NULL: DevPtr<T> = DevPtr { addr: 0, values: PhantomData };

    pub(crate) fn new(addr: u64) -> DevPtr<T> {
        DevPtr { addr, values: PhantomData }
    }

    pub fn addr(self) -> u64 {
        self.addr
    }

    /// The address `n` values further on.
    pub fn offset(self, n: usize) -> DevPtr<T> {
        DevPtr::new(self.addr + (n * std::mem::size_of::<T>()) as u64)
    }

    /// The same bytes as values of type `U` (a workspace buffer that one path fills with f32
    /// and another with bf16).
    pub fn reinterpret<U>(self) -> DevPtr<U> {
        DevPtr::new(self.addr)
    }
}

/// A value a kernel parameter takes, and how C++ spells the parameter's type (pointers without
/// their `const`).
pub trait Param: Copy {
    const C_TYPE: &'static str;
    /// The argument in a slot of 8 bytes: the driver reads as many bytes as the parameter has
    /// (8 for an address, 4 for an int or a float: the low bytes on a little-endian host).
    fn slot(self) -> u64;
}

impl Param for DevPtr<f32> {
    const C_TYPE: &'static str = "float*";
    fn slot(self) -> u64 {
        self.addr
    }
}

impl Param for DevPtr<u16> {
    const C_TYPE: &'static str = "bf16_t*";
    fn slot(self) -> u64 {
        self.addr
    }
}

/// Bytes: rows of GGML blocks (kernels/blocks.cu).
impl Param for DevPtr<u8> {
    const C_TYPE: &'static str = "unsigned char*";
    fn slot(self) -> u64 {
        self.addr
    }
}

impl Param for DevPtr<u32> {
    const C_TYPE: &'static str = "u32*";
    fn slot(self) -> u64 {
        self.addr
    }
}

impl Param for DevPtr<f64> {
    const C_TYPE: &'static str = "double*";
    fn slot(self) -> u64 {
        self.addr
    }
}

/// A table of device addresses (one per sequence of a batched step): a `float* const*`.
impl Param for DevPtr<DevPtr<f32>> {
    const C_TYPE: &'static str = "float**";
    fn slot(self) -> u64 {
        self.addr
    }
}

/// A recurrent state's values, f32 or bf16 (the kernel's build says which): a `void*`.
pub enum StateValues {}

impl Param for DevPtr<StateValues> {
    const C_TYPE: &'static str = "void*";
    fn slot(self) -> u64 {
        self.addr
    }
}

/// A table of recurrent states (one per sequence): a `void* const*`.
impl Param for DevPtr<DevPtr<StateValues>> {
    const C_TYPE: &'static str = "void**";
    fn slot(self) -> u64 {
        self.addr
    }
}

impl Param for i32 {
    const C_TYPE: &'static str = "int";
    fn slot(self) -> u64 {
        self as u32 as u64
    }
}

impl Param for f32 {
    const C_TYPE: &'static str = "float";
    fn slot(self) -> u64 {
        self.to_bits() as u64
    }
}

impl Param for f64 {
    const C_TYPE: &'static str = "double";
    fn slot(self) -> u64 {
        self.to_bits()
    }
}

/// A kernel's whole parameter list: a tuple of `Param`s.
pub trait Params {
    const C_TYPES: &'static [&'static str];
    fn slots(self) -> Vec<u64>;
}

macro_rules! tuple_params {
    ($($p:ident)+) => {
        impl<$($p: Param),+> Params for ($($p,)+) {
            const C_TYPES: &'static [&'static str] = &[$($p::C_TYPE),+];
            #[allow(non_snake_case)]
            fn slots(self) -> Vec<u64> {
                let ($($p,)+) = self;
                vec![$($p.slot()),+]
            }
        }
    };
}

macro_rules! tuples {
    ($first:ident $($rest:ident)*) => {
        tuple_params!($first $($rest)*);
        tuples!($($rest)*);
    };
    () => {};
}

tuples!(A B C D E F G H I J K L M N O P Q R S T U);

/// A kernel of kernels/ by name, with its parameter list `P`.
pub struct Kernel<P> {
    pub name: &'static str,
    params: PhantomData<fn(P)>,
}

impl<P> Clone for Kernel<P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<P> Copy for Kernel<P> {}

impl<P: Params> Kernel<P> {
    pub const fn new(name: &'static str) -> Kernel<P> {
        Kernel { name, params: PhantomData }
    }
}

/// A launch's shape: blocks in x, y, z, threads per block and bytes of dynamic shared memory
/// per block (kernels/common.cuh DYNAMIC_SHARED).
#[derive(Clone, Copy, Debug)]
pub struct Grid {
    pub blocks: (u32, u32, u32),
    pub threads: u32,
    pub shared: u32,
}

/// Dynamic shared memory a kernel may take without being allowed more.
const DEFAULT_SHARED_LIMIT: u32 = 48 << 10;

impl Grid {
    pub fn new(blocks: (usize, usize, usize), threads: usize) -> Grid {
        Grid { blocks: (blocks.0 as u32, blocks.1 as u32, blocks.2 as u32), threads: threads as u32, shared: 0 }
    }

    /// The same launch with `bytes` of dynamic shared memory a block.
    pub fn with_shared(self, bytes: usize) -> Grid {
        Grid { shared: bytes as u32, ..self }
    }

    /// `blocks` blocks in x.
    pub fn x(blocks: usize, threads: usize) -> Grid {
        Grid::new((blocks, 1, 1), threads)
    }
}

impl Gpu {
    /// Launch `kernel` on the stream with `args` (with programmatic dependent launch where the
    /// GPU has it: see `pdl`).
    pub fn launch<P: Params>(&self, kernel: Kernel<P>, grid: Grid, args: P) -> Result<()> {
        use cudarc::driver::sys;
        let name = kernel.name;
        let f = self.kernels.get(name).with_context(|| format!("no kernel {name}"))?;
        self.timed(|| name.into(), || {
            let mut slots = args.slots();
            let mut params: Vec<*mut std::ffi::c_void> = slots.iter_mut().map(|s| s as *mut u64 as *mut std::ffi::c_void).collect();
            // SAFETY: a plain-data union; the driver reads the member its id names.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            if grid.shared > DEFAULT_SHARED_LIMIT {
                // SAFETY: a function of this context's module; the attribute takes a byte count.
                unsafe { sys::cuFuncSetAttribute(f.cu_function(), sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, grid.shared as i32) }
                    .result()
                    .map_err(|e| anyhow::anyhow!("cuda:{}: allowing {name} {} bytes of shared memory: {e:?}", self.ordinal, grid.shared))?;
            }
            let config = sys::CUlaunchConfig {
                gridDimX: grid.blocks.0,
                gridDimY: grid.blocks.1,
                gridDimZ: grid.blocks.2,
                blockDimX: grid.threads,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: grid.shared,
                hStream: self.stream.cu_stream(),
                attrs: &mut attr,
                numAttrs: (self.pdl && self.pdl_now.load(std::sync::atomic::Ordering::Relaxed)) as u32,
            };
            self.stream.context().bind_to_thread().map_err(|e| anyhow::anyhow!("cuda:{}: {e:?}", self.ordinal))?;
            // SAFETY: `args` has the types of `kernel`'s declaration, which the CPU emulation
            // test holds to the kernel's C++ parameter list, so each slot is read as the
            // parameter it is; `slots` and `attr` outlive the call (the driver copies the
            // arguments). What the addresses hold is the caller's to size (see each launch).
            unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
                .result()
                .map_err(|e| anyhow::anyhow!("cuda:{}: launching {name}: {e:?}", self.ordinal))
        })
    }
}
