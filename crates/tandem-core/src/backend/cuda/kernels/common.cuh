// tandem's CUDA kernels for Qwen3.5, compiled at run time with NVRTC (kernels/mod.rs joins
// the files of this folder in the order of `SOURCES`: common.cuh, norm.cu,
// gemv.cu, gemm.cu, deltanet.cu, attention.cu, sample.cu; each may use what those before it
// define). Each kernel is the GPU form of a CPU kernel in backend/cpu (kernels/ or forward.rs),
// which is its reference: the same formula in the same f32 arithmetic (sums may run in another
// order). Activations are f32; weights are bf16, stored as unsigned short and widened by a
// shift. Each family's *_reference.cpp beside it holds its kernels to plain double-precision
// references on CPU threads (tests/cuda_on_cpu.rs), and kernels/mod.rs declares each kernel's
// parameters for the Rust launches.
//
// Positions are read from GPU memory (`pos`: the position of a sequence's first token in this
// call), not passed as arguments, so that a captured decode step (a CUDA graph) replays at
// whatever position its state has reached.
//
// common.cuh: the types, reductions, programmatic dependent launch, the blocks' hand-over, bf16
// rounding, and the tensor-core instructions (mma, ldmatrix, asynchronous copies).


typedef unsigned short bf16_t;
typedef unsigned int u32;
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_f32(bf16_t b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.0f + expf(-x)); }
// torch softplus, threshold 20.
__device__ __forceinline__ float softplusf_(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Programmatic dependent launch (sm_90 and later; cuda/mod.rs sets the launch attribute): a
// kernel may start while the one before it in the stream is still running. Each kernel first
// lets the next one launch (`griddepcontrol.launch_dependents`), then waits until the one
// before it has finished and its writes are visible (`griddepcontrol.wait`). Before the wait a
// kernel reads only what no kernel of the same forward call writes (weights, and in a decode
// step the recurrent state, whose writer ran in an earlier call), so its loads overlap the
// previous kernel; everything else comes after it. Every kernel waits, so that a kernel's end
// implies the end of all kernels before it. Without the attribute both are no-ops.
__device__ __forceinline__ void pdl_launch_next() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait_previous() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// The first thing a kernel does that reads nothing before the wait.
__device__ __forceinline__ void pdl_enter() {
    pdl_launch_next();
    pdl_wait_previous();
}

struct Sum {
    __device__ float operator()(float a, float b) const { return a + b; }
};
struct Max {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Reduce over the warp with `op`; every lane gets the result.
template <typename Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, Sum()); }

// Reduce over the block (blockDim.x a multiple of 32, at most 1024) with `op`, whose identity
// is `identity`; every thread gets the result.
template <typename Op>
__device__ float block_reduce(float v, float identity, Op op) {
    __shared__ float part[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x >> 5) ? part[lane] : identity;
        s = warp_reduce(s, op);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}
__device__ float block_sum(float v) { return block_reduce(v, 0.0f, Sum()); }
__device__ float block_max(float v) { return block_reduce(v, NEG_INF, Max()); }

// Whether this block is the last of the `count` blocks that share the counter `*done` to get
// here, where the blocks of a group hand their partial results to one of them (the pattern of
// the CUDA threadFenceReduction sample: results, fence, then the count). What every block wrote
// before the call is visible to the last one after it, which must reset `*done` to 0 for the
// next launch. Every thread of the block calls it.
__device__ bool last_block_of(unsigned* done, unsigned count) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1u) == count - 1;
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// A block's dynamic shared memory as an array of T (sized at launch; a kernel is allowed more
// than 48 KB of it only by an attribute, which `Gpu::launch` sets). One byte array underlies
// every kernel's (an extern array can have only one type). The CPU emulation gives a block
// `most` values of static storage instead.
#ifdef __CUDA_ARCH__
#define DYNAMIC_SHARED(T, name, most) extern __shared__ __align__(16) unsigned char dynamic_shared_bytes[]; T* name = reinterpret_cast<T*>(dynamic_shared_bytes)
#else
#define DYNAMIC_SHARED(T, name, most) alignas(16) static T name##_storage[most]; T* name = name##_storage
#endif

// Round f32 to bf16, nearest even (the operand of a tensor-core GEMM).
__device__ __forceinline__ bf16_t f32_to_bf16(float x) {
    u32 b = __float_as_uint(x);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (bf16_t)(b >> 16);
}

// The 1/rms of a row of k floats (k a multiple of 4) in one order for every kernel that
// normalises (rms_norm, rms_inv, the GEMVs), on blocks of 256 threads: thread i adds the
// squares of float4s i, i + 256, ... (`thread_squares`), each warp's sum goes to
// squares[warp], and `inv_rms_of` adds the eight in order. The GEMV with tensor-core precision
// rounds rms_norm(x) * scale to bf16 itself, so it must find the 1/rms that rms_norm finds for
// the GEMM, to the bit (else an input here and there rounds the other way). The products are
// rounded (`__fmul_rn`, `__fadd_rn`) so that the compiler contracts them the same way everywhere.
__device__ __forceinline__ float squares_of4(float4 v) {
    return __fadd_rn(__fadd_rn(__fmul_rn(v.x, v.x), __fmul_rn(v.y, v.y)), __fadd_rn(__fmul_rn(v.z, v.z), __fmul_rn(v.w, v.w)));
}
__device__ __forceinline__ float thread_squares(const float* x, int k) {
    float ss = 0.0f;
    for (int q = threadIdx.x; q < k / 4; q += 256) ss = __fadd_rn(ss, squares_of4(((const float4*)x)[q]));
    return ss;
}
__device__ __forceinline__ float inv_rms_of(const float* squares8, int k, float eps) {
    float ss = 0.0f;
    for (int q = 0; q < 8; q++) ss = __fadd_rn(ss, squares8[q]);
    return 1.0f / sqrtf(ss / k + eps);
}

// f32 rounded to the nearest bf16 and back (a tensor-core operand's value, in f32).
__device__ __forceinline__ float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// Two f32 rounded to bf16 and packed, the first in the low half: an mma operand register, or
// two neighbours of a bf16 array.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) { return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16); }

// d (16 x 8, f32) += a (16 x 16, bf16, row-major) . b (16 x 8, bf16, column-major): the
// tensor-core instruction of sm_80 and later. Lane l holds a at rows l / 4 (+8), columns
// 2 (l % 4) (+1, +8, +9); b at rows 2 (l % 4) (+1, +8, +9), column l / 4; d at row l / 4 (+8),
// columns 2 (l % 4) (+1).
__device__ __forceinline__ void mma_bf16_16816(float* d, const u32* a, u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// A 16-byte copy from global to shared memory that completes in the background (cp.async,
// sm_80 and later; elsewhere a plain copy); zeros instead where `valid` is false (src is then
// not read). copy_async_commit closes a group of them; copy_async_wait<N> waits until at most
// the N latest groups are still in flight (for this thread's copies: a barrier must follow
// before other threads read them).
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool valid) {
#if __CUDA_ARCH__ >= 800
    unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src), "r"(valid ? 16 : 0) : "memory");
#else
    *(uint4*)dst = valid ? *(const uint4*)src : make_uint4(0, 0, 0, 0);
#endif
}
__device__ __forceinline__ void copy_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void copy_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Four 8 x 8 bf16 matrices from shared memory (ldmatrix, sm_80 and later, like the mma that
// takes them): lane l gives the address of row l % 8 of matrix l / 8 (8 contiguous values).
// r[i] gets matrix i's row l / 4, columns 2 (l % 4) and +1, or with TRANS its column l / 4,
// rows 2 (l % 4) and +1: the layout of an mma operand register.
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(u32* r, const bf16_t* p) {
#if __CUDA_ARCH__ >= 800
    unsigned s = (unsigned)__cvta_generic_to_shared(p);
    if (TRANS) asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
    else asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
#else
    __trap();
#endif
}

// A block's copy of `bytes` (a multiple of 16, both ends 16-byte aligned) between global and
// shared memory by the copy engine (cp.async.bulk, sm_90 and later): one thread issues it and
// the block goes on; elsewhere the block's threads copy 16 bytes at a time. Every thread of the
// block calls each of these. bulk_load_start begins a load that completes on `bar` (a shared
// 8-byte mbarrier, which it sets up: one load per barrier), bulk_load_wait waits for it (and is
// a barrier). bulk_store_start writes shared memory back after the threads' last writes there
// (it is a barrier); bulk_store_wait returns once the copy engine has read it all, so that the
// block may reuse or release it (the global writes complete in the background).
__device__ __forceinline__ void bulk_load_start(void* dst, const void* src, u32 bytes, unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0) {
        unsigned b = (unsigned)__cvta_generic_to_shared(bar), d = (unsigned)__cvta_generic_to_shared(dst);
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
        // In pieces of 16 KB, all completing on the one barrier.
        for (u32 at = 0; at < bytes; at += 16384) {
            u32 n = bytes - at < 16384 ? bytes - at : 16384;
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(d + at), "l"((const char*)src + at), "r"(n), "r"(b)
                         : "memory");
        }
    }
#else
    for (u32 i = threadIdx.x; i < bytes / 16; i += blockDim.x) ((uint4*)dst)[i] = ((const uint4*)src)[i];
#endif
}
__device__ __forceinline__ void bulk_load_wait(unsigned long long* bar) {
    // (Also makes thread 0's set-up of the barrier seen before anyone waits on it.)
    __syncthreads();
#if __CUDA_ARCH__ >= 900
    unsigned b = (unsigned)__cvta_generic_to_shared(bar), done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(b) : "memory");
#endif
}
__device__ __forceinline__ void bulk_store_start(void* dst, const void* src, u32 bytes) {
#if __CUDA_ARCH__ >= 900
    // The threads' shared-memory writes made visible to the copy engine, then one thread copies.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned s = (unsigned)__cvta_generic_to_shared(src);
        for (u32 at = 0; at < bytes; at += 16384) {
            u32 n = bytes - at < 16384 ? bytes - at : 16384;
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"((char*)dst + at), "r"(s + at), "r"(n) : "memory");
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
#else
    __syncthreads();
    for (u32 i = threadIdx.x; i < bytes / 16; i += blockDim.x) ((uint4*)dst)[i] = ((const uint4*)src)[i];
#endif
}
__device__ __forceinline__ void bulk_store_wait() {
#if __CUDA_ARCH__ >= 900
    if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#endif
    __syncthreads();
}

// The kernels of several sequences packed into one forward, one sequence per blockIdx.z (the
// *_packed kernels of deltanet.cu and attention.cu): each does what its one-sequence kernel does
// on that sequence's rows, state and caches alone (the same arithmetic, bit for bit), so that a
// packed prefill launches each once per layer rather than once per sequence. `seqs` holds four
// values per sequence: its first row among the packed rows, its row count, its first chunk of
// the chunked rule's scratch P, and its first row of the attention's gathered bf16 keys and
// values (every position it sees, its cache and its new rows). The grid is sized for the
// longest sequence; the blocks past a shorter one's rows return at once.
#define PACKED_SEQ_FIELDS 4
struct PackedSeq {
    int first, count, chunk0, kv_first;
};
__device__ __forceinline__ PackedSeq packed_seq(const u32* seqs) {
    const u32* s = seqs + PACKED_SEQ_FIELDS * blockIdx.z;
    return {(int)s[0], (int)s[1], (int)s[2], (int)s[3]};
}
