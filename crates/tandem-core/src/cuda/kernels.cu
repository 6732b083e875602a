// tandem's CUDA kernels for Qwen3.5, compiled at run time with NVRTC (cuda/mod.rs). Each is
// the GPU form of a CPU kernel in src/kernels or src/model/qwen35.rs, which is its reference:
// the same formula in the same f32 arithmetic (sums may run in another order). Activations are
// f32; weights are bf16, stored as unsigned short and widened by a shift.
//
// Positions are read from GPU memory (`pos`: the position of a sequence's first token in this
// call), not passed as arguments, so that a captured decode step (a CUDA graph) replays at
// whatever position its state has reached.

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

// x[i, :] = embedding row ids[i]. Grid: tokens.
extern "C" __global__ void embed(const bf16_t* table, const u32* ids, float* x, int h) {
    pdl_enter();
    const bf16_t* row = table + (size_t)ids[blockIdx.x] * h;
    for (int c = threadIdx.x; c < h; c += blockDim.x) x[(size_t)blockIdx.x * h + c] = bf16_to_f32(row[c]);
}

// Round f32 to bf16, nearest even (the operand of a tensor-core GEMM).
__device__ __forceinline__ bf16_t f32_to_bf16(float x) {
    u32 b = __float_as_uint(x);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (bf16_t)(b >> 16);
}

// Two f32 rounded to bf16 and packed, the first in the low half: an mma operand register, or
// two neighbours of a bf16 array.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) { return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16); }

// out = x / rms(x) * scale, per row of width d; in bf16 into out_bf16 where that is not null
// (the input of a tensor-core GEMM), else in f32 into out. A row of up to 16 values a thread
// (d a multiple of 4) is read once, in 16-byte pieces, and kept in registers; a longer one is
// read twice. Grid: rows.
extern "C" __global__ void rms_norm(const float* x, const float* scale, float* out, bf16_t* out_bf16, int d, float eps) {
    pdl_enter();
    const float* xr = x + (size_t)blockIdx.x * d;
    size_t row = (size_t)blockIdx.x * d;
    if (d % 4 == 0 && d <= 16 * (int)blockDim.x) {
        constexpr int V = 4;
        float4 v[V];
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < V; j++) {
            int c4 = threadIdx.x + j * blockDim.x;
            v[j] = c4 < d / 4 ? ((const float4*)xr)[c4] : make_float4(0, 0, 0, 0);
            ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
        }
        float inv = 1.0f / sqrtf(block_sum(ss) / d + eps);
#pragma unroll
        for (int j = 0; j < V; j++) {
            int c4 = threadIdx.x + j * blockDim.x;
            if (c4 >= d / 4) continue;
            float4 s = ((const float4*)scale)[c4];
            float4 y = make_float4(v[j].x * inv * s.x, v[j].y * inv * s.y, v[j].z * inv * s.z, v[j].w * inv * s.w);
            if (out_bf16) *(uint2*)&out_bf16[row + 4 * c4] = make_uint2(pack_bf16x2(y.x, y.y), pack_bf16x2(y.z, y.w));
            else *(float4*)&out[row + 4 * c4] = y;
        }
        return;
    }
    float ss = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) ss += xr[c] * xr[c];
    float inv = 1.0f / sqrtf(block_sum(ss) / d + eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float y = xr[c] * inv * scale[c];
        if (out_bf16) out_bf16[row + c] = f32_to_bf16(y); else out[row + c] = y;
    }
}

// gate = silu(gate) * up; in bf16 into out_bf16 instead where that is not null. Four values a
// thread (16-byte loads; the last thread takes what is left). Grid: ceil(n / 1024); block 256.
extern "C" __global__ void swiglu(float* gate, const float* up, bf16_t* out_bf16, int n) {
    pdl_enter();
    int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 4 > n) {
        for (; i < n; i++) {
            float y = siluf_(gate[i]) * up[i];
            if (out_bf16) out_bf16[i] = f32_to_bf16(y); else gate[i] = y;
        }
        return;
    }
    float4 g = *(const float4*)&gate[i], u = *(const float4*)&up[i];
    float4 y = make_float4(siluf_(g.x) * u.x, siluf_(g.y) * u.y, siluf_(g.z) * u.z, siluf_(g.w) * u.w);
    if (out_bf16) *(uint2*)&out_bf16[i] = make_uint2(pack_bf16x2(y.x, y.y), pack_bf16x2(y.z, y.w));
    else *(float4*)&gate[i] = y;
}

// out = silu(gate) * up from bf16 gate and up (a tensor-core prefill's GEMM outputs), in bf16
// (the down projection's operand). Four values a thread, as swiglu. Grid: ceil(n / 1024);
// block 256.
extern "C" __global__ void swiglu_bf16(const bf16_t* gate, const bf16_t* up, bf16_t* out, int n) {
    pdl_enter();
    int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 4 > n) {
        for (; i < n; i++) out[i] = f32_to_bf16(siluf_(bf16_to_f32(gate[i])) * bf16_to_f32(up[i]));
        return;
    }
    uint2 g = *(const uint2*)&gate[i], u = *(const uint2*)&up[i];
    float y[4];
    u32 gw[2] = {g.x, g.y}, uw[2] = {u.x, u.y};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float gv = __uint_as_float(j & 1 ? gw[j / 2] & 0xffff0000u : gw[j / 2] << 16), uv = __uint_as_float(j & 1 ? uw[j / 2] & 0xffff0000u : uw[j / 2] << 16);
        y[j] = siluf_(gv) * uv;
    }
    *(uint2*)&out[i] = make_uint2(pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3]));
}

// inv[row] = 1 / rms(x[row, :]) (for the GEMV's IN_NORM). Grid: rows.
extern "C" __global__ void rms_inv(const float* x, float* inv, int d, float eps) {
    pdl_enter();
    const float* xr = x + (size_t)blockIdx.x * d;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) ss += xr[c] * xr[c];
    ss = block_sum(ss);
    if (threadIdx.x == 0) inv[blockIdx.x] = 1.0f / sqrtf(ss / d + eps);
}

// y = x rounded to bf16, four values a thread (the last takes what is left). Grid: ceil(n / 1024).
extern "C" __global__ void to_bf16(const float* x, bf16_t* y, int n) {
    pdl_enter();
    int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 4 > n) {
        for (; i < n; i++) y[i] = f32_to_bf16(x[i]);
        return;
    }
    float4 v = *(const float4*)&x[i];
    *(uint2*)&y[i] = make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
}

// The decode GEMV: out_j[m, r] (+)= in(x)[m, :] . W_j[r, :] for t <= T tokens (T = 1 or 8) and
// up to four matrices of the same input in one launch (a layer's input projections). What the
// weights are multiplied with (MODE):
//   IN_PLAIN  x itself;
//   IN_NORM   rms_norm(x) * scale (x2 = scale), the block's input RMSNorm (model/qwen35.rs)
//             computed on the fly: x * scale in the products, times the 1 / rms of each row,
//             from `rms_inv` (the rms_inv kernel) or, where that is null, found by each block
//             itself (from L2, while its weight loads are in flight: a launch fewer, but every
//             block reads the whole rows; cuda/qwen35.rs gemv chooses by the row length).
// (The SwiGLU computed the same way inside the down projection measured slower on an H100
// than the swiglu kernel before a plain GEMV: it reads gate and up again for every row.)
// Each block of 256 threads (8 warps) takes one unit of `rb` rows (1, 2, 4 or 8), 8 / rb warps
// per row, so that a matrix of few rows still has enough loads in flight; the warps' partial
// sums are added in a fixed order (the same bits on every run). Lanes read 8 bf16 at a time.
// Matrix j's rows are the next ceil(n_j / rb) units (blocks); `accumulate` adds into out (a
// residual). With GLU, matrices 0 and 1 are the MLP's gate and up projections (as many rows)
// and the output is o0 = silu(gate) * up: a unit's rows alternate gate row, up row (rb even),
// so that its block holds both halves of the rows it writes (a swiglu launch of its own
// measured 1.4 us per layer in a decode graph on an H200).
#define IN_PLAIN 0
#define IN_NORM 1

template <int T, int MODE>
__device__ __forceinline__ void gemv_chunk(uint4 p, const float* x, const float* x2, int k, int t, int c, float* acc) {
    float wv[8];
    wv[0] = __uint_as_float(p.x << 16); wv[1] = __uint_as_float(p.x & 0xffff0000u);
    wv[2] = __uint_as_float(p.y << 16); wv[3] = __uint_as_float(p.y & 0xffff0000u);
    wv[4] = __uint_as_float(p.z << 16); wv[5] = __uint_as_float(p.z & 0xffff0000u);
    wv[6] = __uint_as_float(p.w << 16); wv[7] = __uint_as_float(p.w & 0xffff0000u);
    float4 s0, s1;
    if (MODE == IN_NORM) {
        const float4* sp = (const float4*)(x2 + c * 8);
        s0 = sp[0]; s1 = sp[1];
    }
#pragma unroll
    for (int m = 0; m < T; m++) {
        if (m < t) {
            const float4* xp = (const float4*)(x + (size_t)m * k + c * 8);
            float4 a = xp[0], b = xp[1];
            if (MODE == IN_NORM) {
                a.x *= s0.x; a.y *= s0.y; a.z *= s0.z; a.w *= s0.w;
                b.x *= s1.x; b.y *= s1.y; b.z *= s1.z; b.w *= s1.w;
            }
            acc[m] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w + wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
        }
    }
}

template <int T, int MODE, bool GLU>
__device__ void gemv_body(const bf16_t* w0, float* o0, int n0, const bf16_t* w1, float* o1, int n1, const bf16_t* w2, float* o2, int n2,
                          const bf16_t* w3, float* o3, int n3, const float* x, const float* x2, const float* rms_inv, int k, int t, int rb, int accumulate,
                          float eps) {
    __shared__ float parts[8][T], squares[8][T];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int b0 = (n0 + rb - 1) / rb, b1 = (n1 + rb - 1) / rb, b2 = (n2 + rb - 1) / rb;
    int wpr = 8 / rb;
    // Which matrix this block's unit of rows belongs to (selects, not an indexed array:
    // registers).
    int block = blockIdx.x;
    const bf16_t* w = w0;
    float* out = o0;
    int n = n0;
    if (!GLU && block >= b0) { block -= b0; w = w1; out = o1; n = n1;
        if (block >= b1) { block -= b1; w = w2; out = o2; n = n2;
            if (block >= b2) { block -= b2; w = w3; out = o3; n = n3; } } }
    int r = block * rb + warp / wpr, part = warp % wpr;
    if (GLU) {
        // The unit's rows alternate gate row, up row: its row i is row i / 2 of matrix i % 2.
        if (r & 1) w = w1;
        r >>= 1;
    }
    const uint4* row = (const uint4*)(w + (size_t)(r < n ? r : 0) * k);
    int kc = k / 8, step = wpr * 32;
    int c = part * 32 + lane;
    // The first PRE x 8 weights of each lane are loaded before waiting for the input (a row
    // of 1024 with one warp: all of them): the weight reads overlap the kernel before, and
    // are in flight together.
    constexpr int PRE = 4;
    uint4 pre[PRE];
#pragma unroll
    for (int j = 0; j < PRE; j++) pre[j] = r < n && c + j * step < kc ? row[c + j * step] : make_uint4(0, 0, 0, 0);
    pdl_enter();
    if (MODE == IN_NORM && !rms_inv) {
        // Each row's sum of squares over the whole block (a few loads per thread), one
        // partial per warp; combined once the block has synchronised, below.
#pragma unroll
        for (int m = 0; m < T; m++) {
            float ss = 0.0f;
            if (m < t) {
                const float4* xr = (const float4*)(x + (size_t)m * k);
                for (int q = threadIdx.x; q < k / 4; q += 256) {
                    float4 v = xr[q];
                    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                }
            }
            ss = warp_sum(ss);
            if (lane == 0) squares[warp][m] = ss;
        }
    }
    float acc[T];
#pragma unroll
    for (int m = 0; m < T; m++) acc[m] = 0.0f;
    if (r < n) {
#pragma unroll
        for (int j = 0; j < PRE; j++)
            if (c + j * step < kc) gemv_chunk<T, MODE>(pre[j], x, x2, k, t, c + j * step, acc);
        // Past those, one load in flight per lane: four measured slower on an H100, with and
        // without programmatic launch (9B decode 133-135 against 133-141 tok/s, interleaved;
        // 98 against 113 before it).
#pragma unroll 1
        for (c += PRE * step; c < kc; c += step) gemv_chunk<T, MODE>(row[c], x, x2, k, t, c, acc);
    }
#pragma unroll
    for (int m = 0; m < T; m++) acc[m] = warp_sum(acc[m]);
    float inv[T];
    if (MODE == IN_NORM && rms_inv) {
#pragma unroll
        for (int m = 0; m < T; m++) inv[m] = m < t ? rms_inv[m] : 0.0f;
    } else if (MODE == IN_NORM) {
        __syncthreads();
#pragma unroll
        for (int m = 0; m < T; m++) {
            float ss = 0.0f;
            for (int q = 0; q < 8; q++) ss += squares[q][m];
            inv[m] = 1.0f / sqrtf(ss / k + eps);
        }
    }
    if (wpr == 1 && !GLU) {
        // One warp per row: it writes its sums itself.
        if (r < n && lane == 0)
#pragma unroll
            for (int m = 0; m < T; m++)
                if (m < t) {
                    size_t at = (size_t)m * n + r;
                    out[at] = (accumulate ? out[at] : 0.0f) + (MODE == IN_NORM ? acc[m] * inv[m] : acc[m]);
                }
        return;
    }
    if (lane == 0)
#pragma unroll
        for (int m = 0; m < T; m++) parts[warp][m] = acc[m];
    __syncthreads();
    if (GLU) {
        // Thread p * T + m: row p of this unit's rb / 2, token m.
        int p = threadIdx.x / T, m = threadIdx.x % T, row = (block * rb) / 2 + p;
        if (p < rb / 2 && m < t && row < n) {
            float g = 0.0f, u = 0.0f;
            for (int q = 0; q < wpr; q++) {
                g += parts[2 * p * wpr + q][m];
                u += parts[(2 * p + 1) * wpr + q][m];
            }
            if (MODE == IN_NORM) { g *= inv[m]; u *= inv[m]; }
            o0[(size_t)m * n + row] = siluf_(g) * u;
        }
        return;
    }
    if (r < n && part == 0 && lane == 0) {
#pragma unroll
        for (int m = 0; m < T; m++) {
            if (m < t) {
                float s = 0.0f;
                for (int q = 0; q < wpr; q++) s += parts[warp + q][m];
                if (MODE == IN_NORM) s *= inv[m];
                size_t at = (size_t)m * n + r;
                out[at] = (accumulate ? out[at] : 0.0f) + s;
            }
        }
    }
}

#define GEMV_KERNEL(NAME, T, MODE, GLU)                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) NAME(const bf16_t* w0, float* o0, int n0, const bf16_t* w1, float* o1, int n1, \
                                                           const bf16_t* w2, float* o2, int n2, const bf16_t* w3, float* o3, int n3,   \
                                                           const float* x, const float* x2, const float* rms_inv, int k, int t, int rb, int accumulate, float eps) { \
        gemv_body<T, MODE, GLU>(w0, o0, n0, w1, o1, n1, w2, o2, n2, w3, o3, n3, x, x2, rms_inv, k, t, rb, accumulate, eps);          \
    }
GEMV_KERNEL(gemv_t1_plain, 1, IN_PLAIN, false)
GEMV_KERNEL(gemv_t1_norm, 1, IN_NORM, false)
GEMV_KERNEL(gemv_t1_glu, 1, IN_NORM, true)
GEMV_KERNEL(gemv_t8_plain, 8, IN_PLAIN, false)
GEMV_KERNEL(gemv_t8_norm, 8, IN_NORM, false)
GEMV_KERNEL(gemv_t8_glu, 8, IN_NORM, true)

// The decode GEMV of one token over rows of 1024 (the 0.8B model's input projections and its
// LM head) as a stream: warp g of the W in the grid (a grid the GPU runs at once) takes rows
// g, g + W, ... and loads its next row while it multiplies this one, so that loads stay in
// flight until the matrix ends (gemv_t1_* above, a block per few rows that come and go in
// rounds, read matrices of 10 to 17 MB at 1.7 to 1.9 TB/s on an H200, this one at 1.9 to 2.5,
// and the LM head at 3.0 TB/s against 4.3). The same matrices (up to four, their rows in
// turn), input modes and `accumulate` as gemv_body; with GLU a warp takes row r of gate
// (matrix 0) and of up (matrix 1) and writes o0 = silu(gate) * up.
// Grid: at most what runs at once; block 256. k == 32 * 8 * STREAM_PIECES.
#define STREAM_PIECES 4
template <int MODE, bool GLU>
__device__ void gemv_stream_body(const bf16_t* w0, float* o0, int n0, const bf16_t* w1, float* o1, int n1, const bf16_t* w2, float* o2, int n2, const bf16_t* w3,
                                 float* o3, int n3, const float* x, const float* x2, const float* rms_inv, int k, int accumulate, float eps) {
    constexpr int PER = STREAM_PIECES;
    __shared__ float squares[8];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int stride = gridDim.x * 8, total = GLU ? n0 : n0 + n1 + n2 + n3;
    // Row i of the matrices in turn: its weights and output, and (returned) its row there.
    auto locate = [&](int i, const bf16_t*& w, float*& out) {
        w = w0; out = o0;
        if (GLU) return i;
        if (i >= n0) { i -= n0; w = w1; out = o1;
            if (i >= n1) { i -= n1; w = w2; out = o2;
                if (i >= n2) { i -= n2; w = w3; out = o3; } } }
        return i;
    };
    auto load = [&](uint4* dst, const bf16_t* w, int r) {
        const uint4* row = (const uint4*)(w + (size_t)r * k);
#pragma unroll
        for (int j = 0; j < PER; j++) dst[j] = row[lane + 32 * j];
    };
    // This row's weights (gate's, with GLU) and up's, loaded before the wait.
    uint4 cw[PER], cu[PER];
    int i = blockIdx.x * 8 + warp;
    const bf16_t* w;
    float* out;
    int r = 0;
    if (i < total) {
        r = locate(i, w, out);
        load(cw, w, r);
        if (GLU) load(cu, w1, r);
    }
    pdl_enter();
    float inv = 1.0f;
    if (MODE == IN_NORM && rms_inv) {
        inv = rms_inv[0];
    } else if (MODE == IN_NORM) {
        float ss = 0.0f;
        for (int q = threadIdx.x; q < k / 4; q += 256) {
            float4 v = ((const float4*)x)[q];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        ss = warp_sum(ss);
        if (lane == 0) squares[warp] = ss;
        __syncthreads();
        ss = 0.0f;
        for (int q = 0; q < 8; q++) ss += squares[q];
        inv = 1.0f / sqrtf(ss / k + eps);
    }
    // This lane's inputs (times the norm's scale), kept for every row.
    float xv[PER][8];
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const float4* xp = (const float4*)(x + (lane + 32 * j) * 8);
        float4 a = xp[0], b = xp[1];
        if (MODE == IN_NORM) {
            const float4* sp = (const float4*)(x2 + (lane + 32 * j) * 8);
            float4 sa = sp[0], sb = sp[1];
            a = make_float4(a.x * sa.x, a.y * sa.y, a.z * sa.z, a.w * sa.w);
            b = make_float4(b.x * sb.x, b.y * sb.y, b.z * sb.z, b.w * sb.w);
        }
        xv[j][0] = a.x; xv[j][1] = a.y; xv[j][2] = a.z; xv[j][3] = a.w;
        xv[j][4] = b.x; xv[j][5] = b.y; xv[j][6] = b.z; xv[j][7] = b.w;
    }
    auto dot = [&](const uint4* p) {
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < PER; j++) {
            u32 h[4] = {p[j].x, p[j].y, p[j].z, p[j].w};
#pragma unroll
            for (int e = 0; e < 4; e++) acc += __uint_as_float(h[e] << 16) * xv[j][2 * e] + __uint_as_float(h[e] & 0xffff0000u) * xv[j][2 * e + 1];
        }
        return warp_sum(acc);
    };
    for (; i < total; i += stride) {
        // The next row's loads go out before this row is multiplied.
        uint4 nw[PER], nu[PER];
        const bf16_t* next_w;
        float* next_out;
        int next_r = 0;
        if (i + stride < total) {
            next_r = locate(i + stride, next_w, next_out);
            load(nw, next_w, next_r);
            if (GLU) load(nu, w1, next_r);
        }
        float g = dot(cw) * inv;
        if (GLU) {
            float u = dot(cu) * inv;
            if (lane == 0) o0[r] = siluf_(g) * u;
        } else if (lane == 0) {
            out[r] = (accumulate ? out[r] : 0.0f) + g;
        }
        if (i + stride < total) {
            w = next_w; out = next_out; r = next_r;
#pragma unroll
            for (int j = 0; j < PER; j++) { cw[j] = nw[j]; if (GLU) cu[j] = nu[j]; }
        }
    }
}
// (At most 80 registers a thread, three blocks per SM, where that spills little: not with GLU.)
#define GEMV_STREAM_KERNEL(NAME, MODE, GLU, BLOCKS_PER_SM)                                                                                      \
    extern "C" __global__ void __launch_bounds__(256, BLOCKS_PER_SM) NAME(const bf16_t* w0, float* o0, int n0, const bf16_t* w1, float* o1, int n1,        \
                                                              const bf16_t* w2, float* o2, int n2, const bf16_t* w3, float* o3, int n3,          \
                                                              const float* x, const float* x2, const float* rms_inv, int k, int accumulate, float eps) { \
        gemv_stream_body<MODE, GLU>(w0, o0, n0, w1, o1, n1, w2, o2, n2, w3, o3, n3, x, x2, rms_inv, k, accumulate, eps);                        \
    }
GEMV_STREAM_KERNEL(gemv_stream_plain, IN_PLAIN, false, 3)
GEMV_STREAM_KERNEL(gemv_stream_norm, IN_NORM, false, 3)
GEMV_STREAM_KERNEL(gemv_stream_glu, IN_NORM, true, 2)

// out[m, r] (+)= x[m, :] . W[r, :] for any t, in f32 (the exact path of a prefill): 64 x 64
// output tiles, 16 x 16 threads of 4 x 4 outputs each, k in steps of 16; `accumulate` adds to
// out (a residual connection).
extern "C" __global__ void gemm_bf16_f32(const bf16_t* w, const float* x, float* out, int n, int k, int t, int accumulate) {
    pdl_enter();
    __shared__ float ws[16][65];
    __shared__ float xs[16][65];
    int r0 = blockIdx.x * 64, m0 = blockIdx.y * 64;
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4] = {{0}};
    for (int k0 = 0; k0 < k; k0 += 16) {
        for (int i = threadIdx.x; i < 64 * 16; i += 256) {
            int rr = i / 16, kk = i % 16;
            int gr = r0 + rr, gk = k0 + kk;
            ws[kk][rr] = (gr < n && gk < k) ? bf16_to_f32(w[(size_t)gr * k + gk]) : 0.0f;
            int gm = m0 + rr;
            xs[kk][rr] = (gm < t && gk < k) ? x[(size_t)gm * k + gk] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < 16; kk++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) { a[i] = ws[kk][tx * 4 + i]; b[i] = xs[kk][ty * 4 + i]; }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
    for (int j = 0; j < 4; j++) {
        int m = m0 + ty * 4 + j;
        if (m >= t) continue;
        for (int i = 0; i < 4; i++) {
            int r = r0 + tx * 4 + i;
            if (r < n) out[(size_t)m * n + r] = (accumulate ? out[(size_t)m * n + r] : 0.0f) + acc[i][j];
        }
    }
}

// Causal depthwise conv + SiLU of a prefill (qwen35.rs causal_conv_silu), and the l2 norm of
// each q and k head of its output (q also times q_scale; the first qk_channels channels are the
// q heads, then the k heads, of dk channels each). The window of token i is the raw inputs
// i - kk + 1 ..= i, those before the call read from the conv state `conv` ([kk, cd], oldest
// first). A thread takes 4 neighbouring channels of CONV_RUN tokens and slides the window over
// them, so that each input is read once per run (one thread per token and channel read every
// input kk times: 2.5 ms of a 9B prefill of 2048 tokens on an H200, and the norm in a kernel of
// its own another 0.5 ms); the dk / 4 lanes of a head add up its squares with shuffles. Two
// builds, for kk <= 4 (Qwen3.5's) and kk <= 8: the window's registers are sized by the build.
// Grid: (ceil(t / CONV_RUN), ceil(cd / 1024)); block 256. cd a multiple of 4; dk a power of
// two from 4 to 128.
#define CONV_RUN 8
__device__ __forceinline__ float conv_input(const float* conv, const float* qkv, int p, int c, int cd, int kk) {
    return p >= 0 ? qkv[(size_t)p * cd + c] : conv[(size_t)(kk + p) * cd + c];
}
template <int KMAX>
__device__ void conv_silu_rows_body(const float* conv, const float* qkv, const float* taps, float* out, int t, int cd, int kk, int qk_channels, int dk, float q_scale) {
    int c = 4 * (blockIdx.y * blockDim.x + threadIdx.x), i0 = blockIdx.x * CONV_RUN, n = min(CONV_RUN, t - i0);
    bool has = c < cd;
    int cc = has ? c : 0;  // lanes past the last channel still take part in the shuffles
    auto input = [&](int p) { return p >= 0 ? *(const float4*)&qkv[(size_t)p * cd + cc] : *(const float4*)&conv[(size_t)(kk + p) * cd + cc]; };
    float4 tap[KMAX], win[KMAX], raw[CONV_RUN];
#pragma unroll
    for (int q = 0; q < KMAX; q++)
        if (q < kk) {
            tap[q] = *(const float4*)&taps[(size_t)q * cd + cc];
            win[q] = input(i0 - kk + q);
        }
#pragma unroll
    for (int r = 0; r < CONV_RUN; r++) raw[r] = r < n ? input(i0 + r) : make_float4(0, 0, 0, 0);
    bool normed = c < qk_channels;
    float scale = c < qk_channels / 2 ? q_scale : 1.0f;
#pragma unroll
    for (int r = 0; r < CONV_RUN; r++) {
        if (r >= n) break;  // the same for the whole block
        float4 acc = make_float4(0, 0, 0, 0);
#pragma unroll
        for (int q = 0; q < KMAX; q++) {
            if (q + 1 < kk) win[q] = win[q + 1];
            else if (q + 1 == kk) win[q] = raw[r];
            if (q < kk) {
                acc.x = fmaf(tap[q].x, win[q].x, acc.x);
                acc.y = fmaf(tap[q].y, win[q].y, acc.y);
                acc.z = fmaf(tap[q].z, win[q].z, acc.z);
                acc.w = fmaf(tap[q].w, win[q].w, acc.w);
            }
        }
        float4 y = make_float4(siluf_(acc.x), siluf_(acc.y), siluf_(acc.z), siluf_(acc.w));
        float ss = y.x * y.x + y.y * y.y + y.z * y.z + y.w * y.w;
        for (int o = 1; o < dk / 4; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (normed) {
            float inv = 1.0f / sqrtf(ss + 1e-6f) * scale;
            y = make_float4(y.x * inv, y.y * inv, y.z * inv, y.w * inv);
        }
        if (has) *(float4*)&out[(size_t)(i0 + r) * cd + c] = y;
    }
}
#define CONV_SILU_ROWS(NAME, KMAX)                                                                                                                        \
    extern "C" __global__ void NAME(const float* conv, const float* qkv, const float* taps, float* out, int t, int cd, int kk, int qk_channels, int dk, \
                                    float q_scale) {                                                                                                      \
        pdl_enter();                                                                                                                                      \
        conv_silu_rows_body<KMAX>(conv, qkv, taps, out, t, cd, kk, qk_channels, dk, q_scale);                                                            \
    }
CONV_SILU_ROWS(conv_silu_rows_4, 4)
CONV_SILU_ROWS(conv_silu_rows_8, 8)

// After conv_silu_rows: the conv state becomes the last kk raw inputs (one thread per channel
// reads its old columns before it writes any).
extern "C" __global__ void conv_state_tail(float* conv, const float* qkv, int t, int cd, int kk) {
    pdl_enter();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cd) return;
    float win[8];
    for (int j = 0; j < kk; j++) win[j] = conv_input(conv, qkv, t - kk + j, c, cd, kk);
    for (int j = 0; j < kk; j++) conv[(size_t)j * cd + c] = win[j];
}

// A DeltaNet layer's mixer for a few tokens (decode), in one launch: causal conv + SiLU, l2 norm
// of q and k (q scaled by 1/sqrt(dk)), the gated delta rule token after token
// (deltanet.rs recurrent_step) and the gated RMSNorm (model/qwen35.rs), from the projections
// (qkv, z, b, a) to the core output.
// Block (vh, cb) of the grid (hv * dv / 32) owns the 32 state columns cb * 32.. of value head
// vh: warp w holds rows w * R.. (R = DK / 16) of them and lane l column l, so that every state
// load is one 128-byte line and a decode step spreads over hv * dv / 32 SMs (one block per key
// head left most SMs idle: 16.7 us per layer on an H100). Every block of a key head recomputes
// its conv, norms and gates (a few hundred values); each conv channel of v has one owner block.
// The gated RMSNorm needs the whole head, and the key head's q/k conv window must not be
// rewritten while one of its blocks may still read it, so each block writes its raw outputs and
// their sum of squares per token, and the last block of the key head to finish (a counter in
// `done`, which it resets) normalises them all and writes the q/k window.
// Block: 512 threads; t <= 8; partial_ss: hv * (dv / 32) * 8 floats; done: hk zeroed counters.
template <int DK>
__device__ void deltanet_step_body(float* conv, float* state, const float* qkv, const float* z, const float* bproj, const float* aproj, const float* taps,
                                   const float* neg_a, const float* dt_bias, const float* norm_w, float* core, float* partial_ss, unsigned* done, int t, int hk,
                                   int hv, int dv, int cd, int kk, float eps) {
    constexpr int WARPS = 16, R = DK / WARPS, CB = 32, KMAX = 8, TMAX = 8;
    __shared__ float sq[DK], sk[DK], sv[CB], stats[2], red[WARPS][CB];
    int blocks_per_head = dv / CB, vh = blockIdx.x / blocks_per_head, cb = blockIdx.x % blocks_per_head;
    int ratio = hv / hk, kh = vh / ratio, kd = hk * DK, vd = hv * dv;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, j = cb * CB + lane;
    // The conv channel this thread owns (if any): q, then k of the key head, then this block's v.
    bool has_ch = tid < 2 * DK + CB;
    int ch = tid < DK ? kh * DK + tid : tid < 2 * DK ? kd + kh * DK + (tid - DK) : 2 * kd + vh * dv + cb * CB + (tid - 2 * DK);
    float win[KMAX];
    if (has_ch) {
#pragma unroll
        for (int q = 0; q < KMAX; q++)
            if (q < kk) win[q] = conv[(size_t)q * cd + ch];
    }
    float* sh = state + (size_t)vh * DK * dv;
    float s[R];
#pragma unroll
    for (int i = 0; i < R; i++) s[i] = sh[(size_t)(warp * R + i) * dv + j];
    // The state and conv window were loaded before the wait: their last writer is this kernel
    // in an earlier forward call, and every call starts with a copy of its token ids that
    // waits for all earlier work.
    pdl_enter();
    for (int tok = 0; tok < t; tok++) {
        if (has_ch) {
            float acc = 0.0f;
#pragma unroll
            for (int q = 0; q < KMAX; q++) {
                if (q + 1 < kk) win[q] = win[q + 1];
                else if (q + 1 == kk) win[q] = qkv[(size_t)tok * cd + ch];
                if (q < kk) acc = fmaf(taps[(size_t)q * cd + ch], win[q], acc);
            }
            float y = siluf_(acc);
            if (tid < DK) sq[tid] = y; else if (tid < 2 * DK) sk[tid - DK] = y; else sv[tid - 2 * DK] = y;
        }
        __syncthreads();
        // Warp 0: 1 / |q| (times 1/sqrt(dk)); warp 1: 1 / |k|.
        if (tid < 64) {
            const float* v = tid < 32 ? sq : sk;
            float ss = 0.0f;
            for (int i = lane; i < DK; i += 32) ss += v[i] * v[i];
            ss = warp_sum(ss);
            if (lane == 0) stats[warp] = 1.0f / sqrtf(ss + 1e-6f) * (warp == 0 ? rsqrtf((float)DK) : 1.0f);
        }
        __syncthreads();
        float qn = stats[0], kn = stats[1];
        float beta = sigmoidf_(bproj[tok * hv + vh]);
        float alpha = expf(neg_a[vh] * softplusf_(aproj[tok * hv + vh] + dt_bias[vh]));
        float m = 0.0f;
#pragma unroll
        for (int i = 0; i < R; i++) { s[i] *= alpha; m += s[i] * (sk[warp * R + i] * kn); }
        red[warp][lane] = m;
        __syncthreads();
        m = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) m += red[w][lane];
        float u = beta * (sv[lane] - m);
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < R; i++) { s[i] += (sk[warp * R + i] * kn) * u; o += s[i] * (sq[warp * R + i] * qn); }
        __syncthreads();  // every warp has read red
        red[warp][lane] = o;
        __syncthreads();
        if (warp == 0) {
            o = 0.0f;
#pragma unroll
            for (int w = 0; w < WARPS; w++) o += red[w][lane];
            core[(size_t)tok * vd + vh * dv + j] = o;
            float ss = warp_sum(o * o);
            if (lane == 0) partial_ss[(size_t)blockIdx.x * TMAX + tok] = ss;
        }
        __syncthreads();  // sq, sk, sv and red are rewritten by the next token
    }
#pragma unroll
    for (int i = 0; i < R; i++) sh[(size_t)(warp * R + i) * dv + j] = s[i];
    if (tid >= 2 * DK && has_ch) {
#pragma unroll
        for (int q = 0; q < KMAX; q++)
            if (q < kk) conv[(size_t)q * cd + ch] = win[q];
    }
    // Hand over to the last block of the key head.
    if (!last_block_of(&done[kh], ratio * blocks_per_head)) return;
    if (tid < 2 * DK) {
#pragma unroll
        for (int q = 0; q < KMAX; q++)
            if (q < kk) conv[(size_t)q * cd + ch] = win[q];
    }
    for (int e = tid; e < t * ratio * dv; e += blockDim.x) {
        int tok = e / (ratio * dv), h = kh * ratio + (e % (ratio * dv)) / dv, c = e % dv;
        float total = 0.0f;
        for (int b = 0; b < blocks_per_head; b++) total += __ldcg(&partial_ss[(size_t)(h * blocks_per_head + b) * TMAX + tok]);
        size_t at = (size_t)tok * vd + h * dv + c;
        float inv = 1.0f / sqrtf(total / dv + eps);
        core[at] = norm_w[c] * (__ldcg(&core[at]) * inv) * siluf_(z[at]);
    }
    if (tid == 0) done[kh] = 0;
}
#define DELTANET_STEP(NAME, DK)                                                                                                              \
    extern "C" __global__ void __launch_bounds__(512) NAME(float* conv, float* state, const float* qkv, const float* z, const float* b, const float* a, const float* taps, \
                                    const float* na, const float* dt, const float* nw, float* core, float* pss, unsigned* done, int t, int hk, int hv, int dv, int cd, int kk, float eps) { \
        deltanet_step_body<DK>(conv, state, qkv, z, b, a, taps, na, dt, nw, core, pss, done, t, hk, hv, dv, cd, kk, eps);                    \
    }
DELTANET_STEP(deltanet_step_32, 32)
DELTANET_STEP(deltanet_step_64, 64)
DELTANET_STEP(deltanet_step_128, 128)

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

// Causal GQA attention of a tensor-core prefill (flash attention 2 on bf16 mma, f32 sums; the
// f32 attention_tiled is its reference): q rounded to bf16, k and v given in bf16 (the caches
// rounded by to_bf16, same layout [position, hkv, D]), and the softmax weights P rounded before
// they multiply V; scores, the online softmax and the outputs in f32. Block (64 queries, query
// head), 8 warps: warp w takes query rows 16 (w % 4).. and output dims (w / 4) D / 2.. (the two
// warps of a row group compute the same scores, so S costs twice and each holds half of O in
// registers). Keys go KT at a time through shared memory, two tiles in flight (cp.async: the
// next tile loads while this one is multiplied), and every mma operand of K and V comes from
// one ldmatrix per two 16 x 8 pieces. (The first version converted f32 tiles in registers and
// stored them one value at a time, V transposed: 7.3 ms of a 9B prefill of 2048 tokens on an
// H200, about 38 TFLOP/s; this one 4.6 ms.)
// Grid: (ceil(t / 64), hq); block: 256. D: the head dim, a multiple of 32; KT a multiple of 16.
template <int D, int KT>
__device__ void attention_mma_body(const float* q, const bf16_t* kb, const bf16_t* vb, const float* gate, float* out, int t, int hq, int hkv, const u32* pos) {
    constexpr int KSTEPS = D / 16, HALF = D / 2, NT = HALF / 8, PIECES = D / 8, PER = (KT * PIECES + 255) / 256;
    __shared__ __align__(16) bf16_t ks[2][KT][D + 8];
    __shared__ __align__(16) bf16_t vs[2][KT][D + 8];
    int pos0 = (int)pos[0];
    int q0 = blockIdx.x * 64, h = blockIdx.y, kvh = h / (hq / hkv);
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int row0 = q0 + (warp & 3) * 16, dim0 = (warp >> 2) * HALF;
    int r = lane >> 2, cp = (lane & 3) * 2;
    int kend = pos0 + min(q0 + 64, t);  // keys 0..kend - 1 are visible to some row of this block
    int last_key = pos0 + row0 + 15;     // the last one visible to some row of this warp
    // Scores in log2 units, for exp2f.
    float scale = 1.4426950408889634f / sqrtf((float)D);
    // A tile's keys and values, 16 bytes a copy, into stage `st`.
    auto load_tile = [&](int k0, int st) {
#pragma unroll
        for (int j = 0; j < PER; j++) {
            int e = tid + j * 256, key = e / PIECES, c = (e % PIECES) * 8;
            if (e < KT * PIECES) {
                bool in = k0 + key < kend;
                size_t at = in ? ((size_t)(k0 + key) * hkv + kvh) * D + c : 0;
                copy16_async(&ks[st][key][c], kb + at, in);
                copy16_async(&vs[st][key][c], vb + at, in);
            }
        }
        copy_async_commit();
    };
    load_tile(0, 0);
    u32 qa[KSTEPS][4];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int row = row0 + r + (i & 1) * 8, col = kk * 16 + cp + (i >> 1) * 8;
            const float* src = q + ((size_t)row * hq + h) * D + col;
            qa[kk][i] = row < t ? pack_bf16x2(src[0], src[1]) : 0u;
        }
    float o[NT][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < NT; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    int tiles = (kend + KT - 1) / KT;
    for (int it = 0; it < tiles; it++) {
        int k0 = it * KT, st = it & 1;
        if (it + 1 < tiles) {
            load_tile(k0 + KT, st ^ 1);
            copy_async_wait<1>();
        } else {
            copy_async_wait<0>();
        }
        __syncthreads();  // tile `it` is in for every thread
        if (k0 <= last_key) {
            // S = Q K^T for this warp's 16 rows and the tile's KT keys: KT / 8 pieces of 16 x 8.
            float s[KT / 8][4];
#pragma unroll
            for (int j = 0; j < KT / 8; j++) {
                s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < KSTEPS; kk += 2) {
                    u32 b[4];
                    ldmatrix_x4<false>(b, &ks[st][j * 8 + (lane & 7)][kk * 16 + (lane >> 3) * 8]);
                    mma_bf16_16816(s[j], qa[kk], b[0], b[1]);
                    mma_bf16_16816(s[j], qa[kk + 1], b[2], b[3]);
                }
            }
            // Online softmax of the two rows this lane holds (r and r + 8; four lanes per row).
#pragma unroll
            for (int i = 0; i < 2; i++) {
                int qpos = pos0 + row0 + r + 8 * i;
                float mx = NEG_INF;
#pragma unroll
                for (int j = 0; j < KT / 8; j++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        int key = k0 + j * 8 + cp + e;
                        float v = key <= qpos ? s[j][2 * i + e] * scale : NEG_INF;
                        s[j][2 * i + e] = v;
                        mx = fmaxf(mx, v);
                    }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                // Key 0 is visible to every row, so after the first tile m is finite.
                float m_new = fmaxf(m[i], mx), alpha = exp2f(m[i] - m_new), sum = 0.0f;
#pragma unroll
                for (int j = 0; j < KT / 8; j++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float p = exp2f(s[j][2 * i + e] - m_new);
                        s[j][2 * i + e] = p;
                        sum += p;
                    }
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                l[i] = l[i] * alpha + sum;
                m[i] = m_new;
#pragma unroll
                for (int j = 0; j < NT; j++) { o[j][2 * i] *= alpha; o[j][2 * i + 1] *= alpha; }
            }
            // O += P V: P's accumulator layout is the A operand's (keys 16 kk.. as two 8-key
            // pieces); V's B operands for two 8-dim pieces from one transposing ldmatrix.
#pragma unroll
            for (int kk = 0; kk < KT / 16; kk++) {
                u32 pa[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]), pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
                for (int j = 0; j < NT; j += 2) {
                    u32 b[4];
                    ldmatrix_x4<true>(b, &vs[st][kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8][dim0 + j * 8 + (lane >> 4) * 8]);
                    mma_bf16_16816(o[j], pa, b[0], b[1]);
                    mma_bf16_16816(o[j + 1], pa, b[2], b[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with stage st before it is loaded again
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int row = row0 + r + 8 * i;
        if (row >= t) continue;
        float inv = 1.0f / l[i];
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                size_t at = ((size_t)row * hq + h) * D + dim0 + j * 8 + cp + e;
                out[at] = o[j][2 * i + e] * inv * sigmoidf_(gate[at]);
            }
    }
}
// KT: 16 keys a tile at head dim 256, else 32, so that two tiles of K and V fit in the 48 KB
// of static shared memory.
#define ATTENTION_MMA(NAME, D)                                                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) NAME(const float* q, const bf16_t* kb, const bf16_t* vb, const float* gate, float* out, int t, int hq, \
                                                           int hkv, const u32* pos) {                                                             \
        pdl_enter();                                                                                                                              \
        attention_mma_body<D, (D >= 256 ? 16 : 32)>(q, kb, vb, gate, out, t, hq, hkv, pos);                                                      \
    }
ATTENTION_MMA(attention_mma_32, 32)
ATTENTION_MMA(attention_mma_64, 64)
ATTENTION_MMA(attention_mma_128, 128)
ATTENTION_MMA(attention_mma_256, 256)

// The chunked gated delta rule of a prefill (deltanet.rs chunked_body), in two kernels.
// Part 1, every (chunk of 64 tokens, value head) at once, as it needs no state: the cumulative
// log-decay G, the matrices A = (beta k . k^T) * decay (strictly lower) and P = (q . k^T) * decay
// (lower with the diagonal), and by forward substitution (I + A) U = beta v and
// (I + A) W = beta k exp(G). Writes gcum [t, hv], U [t, hv, dv], W [t, hv, dk] and
// P [chunks, hv, 64, 64]. `mixed` holds the conv output with q and k already l2-normalised.
// Block: 256 threads (at least dk + dv); grid: (chunks, hv).
#define CHUNK 64
extern "C" __global__ void __launch_bounds__(256) deltanet_chunk_prep(const float* mixed, const float* bproj, const float* aproj, const float* neg_a, const float* dt_bias,
                                                                      float* gcum, float* U, float* W, float* P, int t, int hk, int hv, int dk, int dv, int cd) {
    pdl_enter();
    __shared__ float qs[CHUNK][33], ks[CHUNK][33], as[CHUNK][CHUNK + 1], gc[CHUNK], bt[CHUNK];
    int chunk = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    int c0 = chunk * CHUNK, n = min(CHUNK, t - c0);
    int kh = h / (hv / hk), kd = hk * dk;
    if (tid < CHUNK) {
        float g = 0.0f, b = 0.0f;
        if (tid < n) {
            g = neg_a[h] * softplusf_(aproj[(size_t)(c0 + tid) * hv + h] + dt_bias[h]);
            b = sigmoidf_(bproj[(size_t)(c0 + tid) * hv + h]);
        }
        gc[tid] = g;
        bt[tid] = b;
    }
    __syncthreads();
    if (tid == 0)
        for (int i = 1; i < n; i++) gc[i] += gc[i - 1];
    __syncthreads();
    if (tid < n) gcum[(size_t)(c0 + tid) * hv + h] = gc[tid];
    // k . k^T and q . k^T, 4 x 4 entries per thread, over dk in steps of 32; the next 32
    // channels' loads in flight while these are multiplied (with the column loads below in
    // flight together too, this kernel went from 6.3 to 5.0 ms of a 9B prefill on an H200).
    int ty = tid / 16, tx = tid % 16;
    float accA[4][4] = {{0}}, accP[4][4] = {{0}};
    constexpr int PER = CHUNK * 32 / 256;
    float rq[PER], rk[PER];
    auto load_qk = [&](int d0) {
#pragma unroll
        for (int j = 0; j < PER; j++) {
            int e = tid + j * 256, i = e / 32, dd = e % 32;
            const float* row = mixed + (size_t)(c0 + i) * cd;
            rq[j] = i < n ? row[kh * dk + d0 + dd] : 0.0f;
            rk[j] = i < n ? row[kd + kh * dk + d0 + dd] : 0.0f;
        }
    };
    load_qk(0);
    for (int d0 = 0; d0 < dk; d0 += 32) {
#pragma unroll
        for (int j = 0; j < PER; j++) {
            int e = tid + j * 256;
            qs[e / 32][e % 32] = rq[j];
            ks[e / 32][e % 32] = rk[j];
        }
        __syncthreads();
        if (d0 + 32 < dk) load_qk(d0 + 32);
#pragma unroll 8
        for (int dd = 0; dd < 32; dd++) {
            float qa[4], ka[4], kb[4];
#pragma unroll
            for (int r = 0; r < 4; r++) { qa[r] = qs[ty * 4 + r][dd]; ka[r] = ks[ty * 4 + r][dd]; kb[r] = ks[tx * 4 + r][dd]; }
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int c = 0; c < 4; c++) { accA[r][c] += ka[r] * kb[c]; accP[r][c] += qa[r] * kb[c]; }
        }
        __syncthreads();
    }
    float* Pc = P + ((size_t)chunk * hv + h) * CHUNK * CHUNK;
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            int i = ty * 4 + r, jj = tx * 4 + c;
            float decay = jj <= i ? expf(gc[i] - gc[jj]) : 0.0f;
            as[i][jj] = jj < i ? bt[i] * accA[r][c] * decay : 0.0f;
            Pc[i * CHUNK + jj] = accP[r][c] * decay;
        }
    __syncthreads();
    // Forward substitution, one column of U (threads < dv) or W (the next dk) per thread, the
    // column in registers (the loops are unrolled).
    if (tid < dv + dk) {
        bool is_u = tid < dv;
        int d = is_u ? tid : tid - dv;
        const float* src = mixed + (is_u ? 2 * kd + h * dv + d : kd + kh * dk + d);
        // The column's 64 loads first, all in flight together, then the substitution in place.
        float col[CHUNK];
#pragma unroll
        for (int i = 0; i < CHUNK; i++) col[i] = i < n ? src[(size_t)(c0 + i) * cd] : 0.0f;
#pragma unroll
        for (int i = 0; i < CHUNK; i++) {
            float acc = is_u ? bt[i] * col[i] : bt[i] * col[i] * expf(gc[i]);
#pragma unroll
            for (int jj = 0; jj < i; jj++) acc -= as[i][jj] * col[jj];
            col[i] = acc;
        }
        float* dst = is_u ? U + (size_t)h * dv + d : W + (size_t)h * dk + d;
        size_t stride = (size_t)hv * (is_u ? dv : dk);
        for (int i = 0; i < n; i++) dst[(size_t)(c0 + i) * stride] = col[i];
    }
}

// Part 2, the state's way through the chunks (in order), one block per (value head, DS value
// columns): V' = U - W S, O = (q exp(G)) S + P V', S <- exp(G_last) S + (k exp(G_last - G))^T V'.
// The DS columns of S live in shared memory; thread (group, col) takes rows RPG * group .. of
// the chunk's products. Block: 256 threads; grid: (hv, dv / DS).
template <int DS>
__device__ void deltanet_chunk_state_body(float* state, const float* mixed, const float* gcum, const float* U, const float* W, const float* P, float* core, int t, int hk, int hv,
                                          int dk, int dv, int cd) {
    constexpr int G = 256 / DS, RPG = CHUNK / G;
    __shared__ float S[128][DS], vp[CHUNK][DS + 1], gc[CHUNK];
    // xs and ys (32 key channels of W, q or k for every row), or P.
    __shared__ float tiles[2 * CHUNK * 33];
    float(*xs)[33] = (float(*)[33])tiles;
    float(*ys)[33] = (float(*)[33])(tiles + CHUNK * 33);
    float(*ps)[CHUNK] = (float(*)[CHUNK])tiles;
    int h = blockIdx.x, col0 = blockIdx.y * DS, tid = threadIdx.x, col = tid % DS, grp = tid / DS;
    int kh = h / (hv / hk), kd = hk * dk, vd = hv * dv;
    float* sh = state + (size_t)h * dk * dv;
    for (int e = tid; e < dk * DS; e += blockDim.x) S[e / DS][e % DS] = sh[(size_t)(e / DS) * dv + col0 + e % DS];
    int chunks = (t + CHUNK - 1) / CHUNK;
    for (int chunk = 0; chunk < chunks; chunk++) {
        int c0 = chunk * CHUNK, n = min(CHUNK, t - c0);
        __syncthreads();
        if (tid < CHUNK) gc[tid] = tid < n ? gcum[(size_t)(c0 + tid) * hv + h] : 0.0f;
        __syncthreads();
        // This chunk's U and P, loaded now and used after W S: their loads run meanwhile.
        const float* Pc = P + ((size_t)chunk * hv + h) * CHUNK * CHUNK;
        float ur[RPG], pr[CHUNK * CHUNK / 256];
#pragma unroll
        for (int r = 0; r < RPG; r++) {
            int i = grp * RPG + r;
            ur[r] = i < n ? U[((size_t)(c0 + i) * hv + h) * dv + col0 + col] : 0.0f;
        }
#pragma unroll
        for (int q = 0; q < CHUNK * CHUNK / 256; q++) pr[q] = Pc[tid + q * 256];
        // W S and (q exp(G)) S, the next 32 key channels loaded while these are multiplied.
        constexpr int PER = CHUNK * 32 / 256;
        float rx[PER], ry[PER];
        auto load_wq = [&](int d0) {
#pragma unroll
            for (int q = 0; q < PER; q++) {
                int e = tid + q * 256, i = e / 32, dd = e % 32;
                bool in = i < n;
                rx[q] = in ? W[((size_t)(c0 + i) * hv + h) * dk + d0 + dd] : 0.0f;
                ry[q] = in ? mixed[(size_t)(c0 + i) * cd + kh * dk + d0 + dd] * expf(gc[i]) : 0.0f;
            }
        };
        float accv[RPG], acco[RPG];
#pragma unroll
        for (int r = 0; r < RPG; r++) accv[r] = acco[r] = 0.0f;
        load_wq(0);
        for (int d0 = 0; d0 < dk; d0 += 32) {
#pragma unroll
            for (int q = 0; q < PER; q++) {
                int e = tid + q * 256;
                xs[e / 32][e % 32] = rx[q];
                ys[e / 32][e % 32] = ry[q];
            }
            __syncthreads();
            if (d0 + 32 < dk) load_wq(d0 + 32);
#pragma unroll 8
            for (int dd = 0; dd < 32; dd++) {
                float sv = S[d0 + dd][col];
#pragma unroll
                for (int r = 0; r < RPG; r++) { accv[r] += xs[grp * RPG + r][dd] * sv; acco[r] += ys[grp * RPG + r][dd] * sv; }
            }
            __syncthreads();
        }
#pragma unroll
        for (int r = 0; r < RPG; r++) {
            int i = grp * RPG + r;
            vp[i][col] = i < n ? ur[r] - accv[r] : 0.0f;
        }
#pragma unroll
        for (int q = 0; q < CHUNK * CHUNK / 256; q++) {
            int e = tid + q * 256;
            ps[e / CHUNK][e % CHUNK] = pr[q];
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < RPG; r++) {
            int i = grp * RPG + r;
            if (i < n) {
                float o = acco[r];
                for (int jj = 0; jj <= i; jj++) o += ps[i][jj] * vp[jj][col];
                core[(size_t)(c0 + i) * vd + h * dv + col0 + col] = o;
            }
        }
        // S <- exp(G_last) S + (k exp(G_last - G))^T V', 32 key channels at a time, the next
        // ones loaded while these are added.
        float gl = gc[n - 1], el = expf(gl);
        auto load_k = [&](int d0) {
#pragma unroll
            for (int q = 0; q < PER; q++) {
                int e = tid + q * 256, i = e / 32, dd = e % 32;
                rx[q] = i < n ? mixed[(size_t)(c0 + i) * cd + kd + kh * dk + d0 + dd] * expf(gl - gc[i]) : 0.0f;
            }
        };
        load_k(0);
        for (int d0 = 0; d0 < dk; d0 += 32) {
            __syncthreads();
#pragma unroll
            for (int q = 0; q < PER; q++) {
                int e = tid + q * 256;
                xs[e / 32][e % 32] = rx[q];
            }
            __syncthreads();
            if (d0 + 32 < dk) load_k(d0 + 32);
            for (int dd = grp; dd < 32; dd += G) {
                float acc = S[d0 + dd][col] * el;
                for (int i = 0; i < n; i++) acc += xs[i][dd] * vp[i][col];
                S[d0 + dd][col] = acc;
            }
        }
    }
    __syncthreads();
    for (int e = tid; e < dk * DS; e += blockDim.x) sh[(size_t)(e / DS) * dv + col0 + e % DS] = S[e / DS][e % DS];
}
// Two builds of the walk: with at most 128 registers a thread, so that two blocks share an SM
// (a grid of more blocks than SMs runs in one round), and with all it needs (about 210, one
// block per SM), which spills nothing: a grid that fits on the SMs takes that one.
extern "C" __global__ void __launch_bounds__(256, 2) deltanet_chunk_state(float* state, const float* mixed, const float* gcum, const float* U, const float* W, const float* P,
                                                                       float* core, int t, int hk, int hv, int dk, int dv, int cd) {
    pdl_enter();
    deltanet_chunk_state_body<16>(state, mixed, gcum, U, W, P, core, t, hk, hv, dk, dv, cd);
}
extern "C" __global__ void __launch_bounds__(256, 1) deltanet_chunk_state_1(float* state, const float* mixed, const float* gcum, const float* U, const float* W, const float* P,
                                                                         float* core, int t, int hk, int hv, int dk, int dv, int cd) {
    pdl_enter();
    deltanet_chunk_state_body<16>(state, mixed, gcum, U, W, P, core, t, hk, hv, dk, dv, cd);
}

// f(element, row, column) for each element of the state that lane (r, cp) of `warp` holds in
// the tensor-core walk: sacc[a][nt][e] is the accumulator element e of the 16 x 8 piece at
// rows 16 (warp + 4 a).., columns 8 nt.. (row + 8 (e / 2), column + e % 2).
template <int MT_PER_WARP, int MT, typename F>
__device__ __forceinline__ void for_each_state(float (&sacc)[MT_PER_WARP][2][4], int warp, int r, int cp, F f) {
#pragma unroll
    for (int a = 0; a < MT_PER_WARP; a++)
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int mt = warp + 4 * a;
                if (mt < MT) f(sacc[a][nt][e], mt * 16 + r + (e >> 1) * 8, nt * 8 + cp + (e & 1));
            }
}

// Part 2 on tensor cores (tensor-cores precision, sm_80 and later; deltanet_chunk_state is its
// f32 reference): per chunk the same three products, V' = U - W S, O = (q exp(G)) S + P V' and
// S <- exp(G_last) S + (k exp(G_last - G))^T V', with bf16 operands and f32 sums. The state's
// master copy stays f32, in the registers of the last product's accumulators; a bf16 copy of
// it (transposed: Sb[column][key channel]) is the B operand of the next chunk's first two.
// Block (value head, 16 value columns), 4 warps: for V' and O warp w takes chunk rows 16 w..,
// for the state key channels 16 (w + 4 j)... Shared memory, bf16: W and q exp(G) as rows
// (phase 1), then P in their place (phase 2), then k exp(G_last - G) transposed (phase 3);
// V' transposed (Vb[column][row]) for phases 2 and 3. `dk` must equal DK.
// Grid: (hv, dv / 16); block 128.
template <int DK>
__device__ void deltanet_chunk_state_mma_body(float* state, const float* mixed, const float* gcum, const float* U, const float* W, const float* P, float* core, int t,
                                              int hk, int hv, int dv, int cd) {
    constexpr int DS = 16, PAD = 8, KSTEPS = DK / 16, MT = DK / 16, MT_PER_WARP = (MT + 3) / 4;
    constexpr int ROWS = CHUNK * (DK + PAD), TRANSPOSED = DK * (CHUNK + PAD), REGION = 2 * ROWS > TRANSPOSED ? 2 * ROWS : TRANSPOSED;
    __shared__ __align__(16) bf16_t region[REGION];
    __shared__ __align__(16) bf16_t Sb[DS][DK + PAD];
    __shared__ __align__(16) bf16_t Vb[DS][CHUNK + PAD];
    __shared__ float gc[CHUNK];
    bf16_t(*Wb)[DK + PAD] = (bf16_t(*)[DK + PAD])region;
    bf16_t(*Qb)[DK + PAD] = (bf16_t(*)[DK + PAD])(region + ROWS);
    bf16_t(*Pb)[CHUNK + PAD] = (bf16_t(*)[CHUNK + PAD])region;
    bf16_t(*Kt)[CHUNK + PAD] = (bf16_t(*)[CHUNK + PAD])region;
    int h = blockIdx.x, col0 = blockIdx.y * DS, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int r = lane >> 2, cp = (lane & 3) * 2;
    int kh = h / (hv / hk), kd = hk * DK, vd = hv * dv;
    float* sh = state + (size_t)h * DK * dv;
    // The state's elements this lane holds (for_each_state), the master copy.
    float sacc[MT_PER_WARP][2][4] = {};
    for_each_state<MT_PER_WARP, MT>(sacc, warp, r, cp, [&](float& v, int row, int col) { v = sh[(size_t)row * dv + col0 + col]; });
    auto store_sb = [&]() { for_each_state<MT_PER_WARP, MT>(sacc, warp, r, cp, [&](float& v, int row, int col) { Sb[col][row] = f32_to_bf16(v); }); };
    // The A operand's registers for rows row0.. and columns k0.. of a bf16 matrix in shared memory.
    auto a_frag = [&](u32* a, const bf16_t* base, int stride, int row0, int k0) {
        a[0] = *(const u32*)&base[(row0 + r) * stride + k0 + cp];
        a[1] = *(const u32*)&base[(row0 + r + 8) * stride + k0 + cp];
        a[2] = *(const u32*)&base[(row0 + r) * stride + k0 + 8 + cp];
        a[3] = *(const u32*)&base[(row0 + r + 8) * stride + k0 + 8 + cp];
    };
    store_sb();
    // Loads in batches of 8 float4 a thread (32 KB a block in flight), converted to bf16 once
    // they are all in: loads issued one at a time, each waited for, made this walk slower than
    // the f32 one. ROW4 is a row's float4s; PER4 a thread's over the chunk's rows.
    constexpr int ROW4 = DK / 4, PER4 = CHUNK * ROW4 / 128, BATCH = PER4 < 8 ? PER4 : 8;
    static_assert(PER4 % BATCH == 0, "whole batches");
    int chunks = (t + CHUNK - 1) / CHUNK;
    // A batch of W and q rows of a chunk, raw (q is scaled once this chunk's G is in).
    float4 wv[BATCH], qv[BATCH];
    auto load_wq = [&](int chunk, int b0) {
        int c0 = chunk * CHUNK, n = min(CHUNK, t - c0);
#pragma unroll
        for (int j = 0; j < BATCH; j++) {
            int e = tid + (b0 + j) * 128, i = e / ROW4, d4 = e % ROW4;
            bool in = i < n;
            wv[j] = in ? ((const float4*)(W + ((size_t)(c0 + i) * hv + h) * DK))[d4] : make_float4(0, 0, 0, 0);
            qv[j] = in ? ((const float4*)(mixed + (size_t)(c0 + i) * cd + kh * DK))[d4] : make_float4(0, 0, 0, 0);
        }
    };
    load_wq(0, 0);
    for (int chunk = 0; chunk < chunks; chunk++) {
        int c0 = chunk * CHUNK, n = min(CHUNK, t - c0);
        __syncthreads();  // Sb is written and the last chunk's phase 3 is done with the region
        if (tid < CHUNK) gc[tid] = tid < n ? gcum[(size_t)(c0 + tid) * hv + h] : 0.0f;
        // This chunk's U and P, used after phase 1: their loads run meanwhile.
        float ur[2][4];
        float4 pr[CHUNK * CHUNK / 4 / 128];
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int i = warp * 16 + r + (e >> 1) * 8, c = nt * 8 + cp + (e & 1);
                ur[nt][e] = i < n ? U[((size_t)(c0 + i) * hv + h) * dv + col0 + c] : 0.0f;
            }
        const float4* Pc = (const float4*)(P + ((size_t)chunk * hv + h) * CHUNK * CHUNK);
#pragma unroll
        for (int q = 0; q < CHUNK * CHUNK / 4 / 128; q++) pr[q] = Pc[tid + q * 128];
        __syncthreads();
        for (int b0 = 0; b0 < PER4; b0 += BATCH) {
            if (b0 > 0) load_wq(chunk, b0);  // the first batch came in during the chunk before
#pragma unroll
            for (int j = 0; j < BATCH; j++) {
                int e = tid + (b0 + j) * 128, i = e / ROW4, d = (e % ROW4) * 4;
                float eg = expf(gc[i]);
                *(uint2*)&Wb[i][d] = make_uint2(pack_bf16x2(wv[j].x, wv[j].y), pack_bf16x2(wv[j].z, wv[j].w));
                *(uint2*)&Qb[i][d] = make_uint2(pack_bf16x2(qv[j].x * eg, qv[j].y * eg), pack_bf16x2(qv[j].z * eg, qv[j].w * eg));
            }
        }
        __syncthreads();
        // Phase 1: W S and (q exp(G)) S for this warp's 16 rows.
        float vacc[2][4], oacc[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) vacc[nt][e] = oacc[nt][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++) {
            u32 aw[4], aq[4];
            a_frag(aw, &Wb[0][0], DK + PAD, warp * 16, kk * 16);
            a_frag(aq, &Qb[0][0], DK + PAD, warp * 16, kk * 16);
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                u32 b0 = *(const u32*)&Sb[nt * 8 + r][kk * 16 + cp], b1 = *(const u32*)&Sb[nt * 8 + r][kk * 16 + 8 + cp];
                mma_bf16_16816(vacc[nt], aw, b0, b1);
                mma_bf16_16816(oacc[nt], aq, b0, b1);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int i = warp * 16 + r + (e >> 1) * 8, c = nt * 8 + cp + (e & 1);
                Vb[c][i] = f32_to_bf16(i < n ? ur[nt][e] - vacc[nt][e] : 0.0f);
            }
        __syncthreads();  // Vb is whole; W and q are done with
        // Phase 2: O += P V'.
#pragma unroll
        for (int q = 0; q < CHUNK * CHUNK / 4 / 128; q++) {
            int e = (tid + q * 128) * 4;
            *(uint2*)&Pb[e / CHUNK][e % CHUNK] = make_uint2(pack_bf16x2(pr[q].x, pr[q].y), pack_bf16x2(pr[q].z, pr[q].w));
        }
        // Phase 3's first batch of k rows, in flight during phase 2 (in P's registers; the
        // walk of a 9B prefill of 2048 tokens on an H200: 8.6 -> 8.5 ms, of the 0.8B's 5.3 ->
        // 5.1 ms).
        float4 kv[BATCH];
        auto load_k = [&](int b0) {
#pragma unroll
            for (int j = 0; j < BATCH; j++) {
                int e = tid + (b0 + j) * 128, i = e / ROW4, d4 = e % ROW4;
                kv[j] = i < n ? ((const float4*)(mixed + (size_t)(c0 + i) * cd + kd + kh * DK))[d4] : make_float4(0, 0, 0, 0);
            }
        };
        load_k(0);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < CHUNK / 16; kk++) {
            u32 ap[4];
            a_frag(ap, &Pb[0][0], CHUNK + PAD, warp * 16, kk * 16);
#pragma unroll
            for (int nt = 0; nt < 2; nt++) mma_bf16_16816(oacc[nt], ap, *(const u32*)&Vb[nt * 8 + r][kk * 16 + cp], *(const u32*)&Vb[nt * 8 + r][kk * 16 + 8 + cp]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int i = warp * 16 + r + (e >> 1) * 8, c = nt * 8 + cp + (e & 1);
                if (i < n) core[(size_t)(c0 + i) * vd + h * dv + col0 + c] = oacc[nt][e];
            }
        __syncthreads();  // P is done with
        // Phase 3: S <- exp(G_last) S + (k exp(G_last - G))^T V'.
        float gl = gc[n - 1], el = expf(gl);
        for (int b0 = 0; b0 < PER4; b0 += BATCH) {
            if (b0 > 0) load_k(b0);
#pragma unroll
            for (int j = 0; j < BATCH; j++) {
                int e = tid + (b0 + j) * 128, i = e / ROW4, d = (e % ROW4) * 4;
                float ek = expf(gl - gc[i]);
                Kt[d][i] = f32_to_bf16(kv[j].x * ek);
                Kt[d + 1][i] = f32_to_bf16(kv[j].y * ek);
                Kt[d + 2][i] = f32_to_bf16(kv[j].z * ek);
                Kt[d + 3][i] = f32_to_bf16(kv[j].w * ek);
            }
        }
        __syncthreads();
        // The next chunk's first W and q loads, in flight while this one's state is updated.
        if (chunk + 1 < chunks) load_wq(chunk + 1, 0);
#pragma unroll
        for (int a = 0; a < MT_PER_WARP; a++) {
            int mt = warp + 4 * a;
            if (mt >= MT) continue;
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) sacc[a][nt][e] *= el;
#pragma unroll
            for (int kk = 0; kk < CHUNK / 16; kk++) {
                u32 ak[4];
                a_frag(ak, &Kt[0][0], CHUNK + PAD, mt * 16, kk * 16);
#pragma unroll
                for (int nt = 0; nt < 2; nt++) mma_bf16_16816(sacc[a][nt], ak, *(const u32*)&Vb[nt * 8 + r][kk * 16 + cp], *(const u32*)&Vb[nt * 8 + r][kk * 16 + 8 + cp]);
            }
        }
        // Sb was last read in phase 1 (several barriers ago): the next chunk's copy goes in now.
        store_sb();
    }
    for_each_state<MT_PER_WARP, MT>(sacc, warp, r, cp, [&](float& v, int row, int col) { sh[(size_t)row * dv + col0 + col] = v; });
}
#define DELTANET_CHUNK_STATE_MMA(NAME, DK)                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) NAME(float* state, const float* mixed, const float* gcum, const float* U, const float* W, const float* P, \
                                                           float* core, int t, int hk, int hv, int dk, int dv, int cd) {                   \
        pdl_enter();                                                                                                                        \
        deltanet_chunk_state_mma_body<DK>(state, mixed, gcum, U, W, P, core, t, hk, hv, dv, cd);                                           \
    }
DELTANET_CHUNK_STATE_MMA(deltanet_chunk_state_mma_32, 32)
DELTANET_CHUNK_STATE_MMA(deltanet_chunk_state_mma_64, 64)
DELTANET_CHUNK_STATE_MMA(deltanet_chunk_state_mma_128, 128)

// core = w * (core / rms(core)) * silu(z), per head row of width dv; in bf16 into out_bf16
// instead where that is not null (the out projection's tensor-core GEMM operand). A warp per
// row (a block per row: 2.0 ms of that 9B prefill, this 0.8 ms). Grid: ceil(rows / 8); block 256.
extern "C" __global__ void gated_rms_norm(float* core, const float* z, const float* w, bf16_t* out_bf16, int rows, int dv, float eps) {
    pdl_enter();
    int row = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    float* x = core + (size_t)row * dv;
    const float* g = z + (size_t)row * dv;
    float ss = 0.0f;
    for (int c = lane; c < dv; c += 32) ss += x[c] * x[c];
    float inv = 1.0f / sqrtf(warp_sum(ss) / dv + eps);
    for (int c = lane; c < dv; c += 32) {
        float y = w[c] * (x[c] * inv) * siluf_(g[c]);
        if (out_bf16) out_bf16[(size_t)row * dv + c] = f32_to_bf16(y); else x[c] = y;
    }
}

// Per token: split the interleaved query/gate heads, RMSNorm q and k heads with their
// zero-centred weights, rotate the first 2 * half channels (NeoX pairs c, c + half) at
// position pos[0] + token; keys and values go straight into the caches kc, vc at that row.
// Grid: (tokens, hq + hkv); block: a warp multiple >= d.
extern "C" __global__ void qk_norm_rope(const float* qg, float* q, float* gate, const float* k, const float* v, float* kc, float* vc, const float* q_norm,
                                        const float* k_norm, const float* inv_freq, int hq, int hkv, int d, int half, const u32* pos, float eps) {
    pdl_enter();
    int pos0 = (int)pos[0];
    __shared__ float sv[1024];
    int tok = blockIdx.x, head = blockIdx.y, c = threadIdx.x;
    bool is_q = head < hq;
    int kh = head - hq;
    size_t kv_at = (size_t)tok * hkv + kh, cache_at = (size_t)(pos0 + tok) * hkv + kh;
    const float* src = is_q ? qg + ((size_t)tok * hq + head) * 2 * d : k + kv_at * d;
    float* dst = is_q ? q + ((size_t)tok * hq + head) * d : kc + cache_at * d;
    const float* w = is_q ? q_norm : k_norm;
    float x = c < d ? src[c] : 0.0f;
    if (is_q && c < d) gate[((size_t)tok * hq + head) * d + c] = src[d + c];
    if (!is_q && c < d) vc[cache_at * d + c] = v[kv_at * d + c];
    float inv = 1.0f / sqrtf(block_sum(x * x) / d + eps);
    if (c < d) sv[c] = x * inv * w[c];
    __syncthreads();
    if (c < d) {
        float y = sv[c];
        if (c < 2 * half) {
            int i = c < half ? c : c - half;
            float angle = (float)(pos0 + tok) * inv_freq[i];
            float cs = (float)cos((double)angle), sn = (float)sin((double)angle);
            y = c < half ? sv[c] * cs - sv[c + half] * sn : sv[c] * cs + sv[c - half] * sn;
        }
        dst[c] = y;
    }
}

// Causal GQA attention of a few tokens (decode), split over the positions (flash decoding):
// block (token, query head, s) takes positions s * chunk .. of the visible ones: scores in shared
// memory, their max and exp-sum, the exp-weighted sum of the value rows. One block per head
// read the whole cache alone (8 blocks on the 0.8B model, 14 us per layer at 77 positions,
// and slower the longer the context). Where the positions span more than one chunk, each
// block writes (max, sum, weighted values) to `part`, and the last block of the (token, head)
// to finish (a counter in `done`, which it resets) rescales and adds them; then the output
// gate sigmoid(gate). Blocks past the visible positions do nothing.
// Grid: (tokens, hq, splits); block 128; chunk <= ATTN_CHUNK; part: tokens * hq * splits *
// (d + 2) floats; done: tokens * hq zeroed counters.
#define ATTN_CHUNK 1024
extern "C" __global__ void __launch_bounds__(128) attention(const float* q, const float* kc, const float* vc, const float* gate, float* out, float* part, unsigned* done,
                                                            int hq, int hkv, int d, int chunk, int splits, const u32* pos) {
    pdl_enter();
    __shared__ float scores[ATTN_CHUNK];
    int tok = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
    int visible = (int)pos[0] + tok + 1, active = (visible + chunk - 1) / chunk;
    if (s >= active) return;
    int p0 = s * chunk, n = min(visible - p0, chunk);
    int kvh = h / (hq / hkv);
    const float* qh = q + ((size_t)tok * hq + h) * d;
    float scale = 1.0f / sqrtf((float)d);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int p = warp; p < n; p += warps) {
        const float* kp = kc + ((size_t)(p0 + p) * hkv + kvh) * d;
        float sc = 0.0f;
        for (int c = lane; c < d; c += 32) sc += qh[c] * kp[c];
        sc = warp_sum(sc);
        if (lane == 0) scores[p] = sc * scale;
    }
    __syncthreads();
    float mx = NEG_INF;
    for (int p = threadIdx.x; p < n; p += blockDim.x) mx = fmaxf(mx, scores[p]);
    mx = block_max(mx);
    float sum = 0.0f;
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
        float e = expf(scores[p] - mx);
        scores[p] = e;
        sum += e;
    }
    sum = block_sum(sum);
    size_t head = (size_t)tok * hq + h;
    float* mine = part + (head * splits + s) * (d + 2);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        // Four sums, so that four value rows are read at a time.
        float o4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const float* vp = vc + ((size_t)p0 * hkv + kvh) * d + c;
        int p = 0;
        for (; p + 4 <= n; p += 4)
#pragma unroll
            for (int u = 0; u < 4; u++) o4[u] = fmaf(scores[p + u], vp[(size_t)(p + u) * hkv * d], o4[u]);
        for (; p < n; p++) o4[0] = fmaf(scores[p], vp[(size_t)p * hkv * d], o4[0]);
        float o = (o4[0] + o4[1]) + (o4[2] + o4[3]);
        if (active == 1) out[head * d + c] = o / sum * sigmoidf_(gate[head * d + c]);
        else mine[2 + c] = o;
    }
    if (active == 1) return;
    if (threadIdx.x == 0) {
        mine[0] = mx;
        mine[1] = sum;
    }
    if (!last_block_of(&done[head], active)) return;
    const float* all = part + head * splits * (d + 2);
    float m = NEG_INF, l = 0.0f;
    for (int j = 0; j < active; j++) m = fmaxf(m, __ldcg(&all[(size_t)j * (d + 2)]));
    for (int j = 0; j < active; j++) l += __ldcg(&all[(size_t)j * (d + 2) + 1]) * expf(__ldcg(&all[(size_t)j * (d + 2)]) - m);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float o = 0.0f;
        for (int j = 0; j < active; j++) o += __ldcg(&all[(size_t)j * (d + 2) + 2 + c]) * expf(__ldcg(&all[(size_t)j * (d + 2)]) - m);
        out[head * d + c] = o / l * sigmoidf_(gate[head * d + c]);
    }
    if (threadIdx.x == 0) done[head] = 0;
}

// The greedy pick of each row of logits: the index of its largest value, the first of equal
// ones, NaN never chosen (sampling::argmax, its reference); 0 where no value qualifies. Block
// (span, row) finds the best of its span and writes it to part; the last block of the row to
// finish (a counter in `done`, which it resets) combines the spans in order and writes out[row].
// Copying one index to the host instead of a row of logits (a megabyte for Qwen3.5's vocabulary)
// and the host's pass over it took 0.15 ms of a 1.2 ms 0.8B decode step on an H200.
// Grid: (spans, rows), spans <= 256; block 256; part_v, part_i: rows * spans; done: rows zeroed.
// A candidate (v, i) beats (bv, bi): larger, or equal and earlier (NaN compares false).
__device__ __forceinline__ bool pick_beats(float v, u32 i, float bv, u32 bi) { return v > bv || (v == bv && i < bi); }
__device__ __forceinline__ void pick_warp(float& v, u32& i) {
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        u32 oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (pick_beats(ov, oi, v, i)) { v = ov; i = oi; }
    }
}
// The best over the block of each thread's (v, i); thread 0 gets it.
__device__ void pick_block(float& v, u32& i) {
    __shared__ float pv[8];
    __shared__ u32 pi[8];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    pick_warp(v, i);
    if (lane == 0) { pv[warp] = v; pi[warp] = i; }
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? pv[lane] : NEG_INF;
        i = lane < (int)(blockDim.x >> 5) ? pi[lane] : 0xffffffffu;
        pick_warp(v, i);
    }
}
extern "C" __global__ void __launch_bounds__(256) argmax_rows(const float* logits, int n, float* part_v, u32* part_i, u32* done, u32* out) {
    pdl_enter();
    int row = blockIdx.y, spans = gridDim.x;
    int span = (n + spans - 1) / spans, p0 = blockIdx.x * span, p1 = min(n, p0 + span);
    const float* x = logits + (size_t)row * n;
    float bv = NEG_INF;
    u32 bi = 0xffffffffu;
    // Each thread's positions rise, so a later equal value never beats an earlier one.
    for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x) {
        float v = x[p];
        if (pick_beats(v, p, bv, bi)) { bv = v; bi = p; }
    }
    pick_block(bv, bi);
    size_t at = (size_t)row * spans + blockIdx.x;
    if (threadIdx.x == 0) { part_v[at] = bv; part_i[at] = bi; }
    if (!last_block_of(&done[row], spans)) return;
    bv = NEG_INF;
    bi = 0xffffffffu;
    if (threadIdx.x < spans) { bv = __ldcg(&part_v[(size_t)row * spans + threadIdx.x]); bi = __ldcg(&part_i[(size_t)row * spans + threadIdx.x]); }
    pick_block(bv, bi);
    if (threadIdx.x == 0) {
        out[row] = bi == 0xffffffffu ? 0u : bi;
        done[row] = 0;
    }
}

// Causal GQA attention of a prefill, tiled (flash attention, in f32): one block per (64 queries,
// query head) walks the visible keys 64 at a time with an online softmax, so each key and value
// row is read once per 64 queries and no buffer grows with the context. S = Q K^T: thread
// (ty, tx) holds rows 4ty.. and keys 4tx..; O: rows 4ty.., columns tx + 16c. The 16 threads of
// a row group are one half-warp (row max and sum by shuffles). d <= 256, a multiple of 16.
// Grid: (ceil(t / 64), hq); block: 256.
#define AQ 64
#define AK 64
extern "C" __global__ void __launch_bounds__(256) attention_tiled(const float* q, const float* kc, const float* vc, const float* gate, float* out, int t, int hq,
                                                                  int hkv, int d, const u32* pos) {
    pdl_enter();
    // qs/ks (staged 32 channels at a time for S) share their memory with vs (16 keys of V).
    __shared__ float tiles[2 * AQ * 33];
    __shared__ float ps[AQ][AK + 1];
    float(*qs)[33] = (float(*)[33])tiles;
    float(*ks)[33] = (float(*)[33])(tiles + AQ * 33);
    float* vs = tiles;
    int pos0 = (int)pos[0];
    int q0 = blockIdx.x * AQ, h = blockIdx.y, kvh = h / (hq / hkv);
    int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
    int rows = min(AQ, t - q0);
    int kend = pos0 + q0 + rows;  // keys 0..kend - 1 are visible to some row of this block
    float scale = 1.0f / sqrtf((float)d);
    float m[4], l[4], o[4][16];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        m[r] = NEG_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < 16; c++) o[r][c] = 0.0f;
    }
    for (int k0 = 0; k0 < kend; k0 += AK) {
        float sc[4][4] = {{0}};
        for (int d0 = 0; d0 < d; d0 += 32) {
            __syncthreads();
            for (int e = tid; e < AQ * 32; e += 256) {
                int i = e / 32, dd = e % 32;
                bool dok = d0 + dd < d;
                qs[i][dd] = (i < rows && dok) ? q[((size_t)(q0 + i) * hq + h) * d + d0 + dd] : 0.0f;
                ks[i][dd] = (k0 + i < kend && dok) ? kc[((size_t)(k0 + i) * hkv + kvh) * d + d0 + dd] : 0.0f;
            }
            __syncthreads();
#pragma unroll 8
            for (int dd = 0; dd < 32; dd++) {
                float a[4], b[4];
#pragma unroll
                for (int r = 0; r < 4; r++) { a[r] = qs[ty * 4 + r][dd]; b[r] = ks[tx * 4 + r][dd]; }
#pragma unroll
                for (int r = 0; r < 4; r++)
#pragma unroll
                    for (int c = 0; c < 4; c++) sc[r][c] += a[r] * b[c];
            }
        }
        // Online softmax: mask, new row max, rescale what was summed so far.
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int qp = pos0 + q0 + ty * 4 + r;
            float mx = NEG_INF;
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int kp = k0 + tx * 4 + c;
                sc[r][c] = kp <= qp ? sc[r][c] * scale : NEG_INF;
                mx = fmaxf(mx, sc[r][c]);
            }
            for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            float mn = fmaxf(m[r], mx);
            // A row past the prompt's end sees nothing (mn = -inf): keep it at zero.
            float corr = mn == NEG_INF ? 1.0f : expf(m[r] - mn);
            float sum = 0.0f;
#pragma unroll
            for (int c = 0; c < 4; c++) {
                float p = mn == NEG_INF ? 0.0f : expf(sc[r][c] - mn);
                ps[ty * 4 + r][tx * 4 + c] = p;
                sum += p;
            }
            for (int off = 8; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
            m[r] = mn;
            l[r] = l[r] * corr + sum;
#pragma unroll
            for (int c = 0; c < 16; c++) o[r][c] *= corr;
        }
        // O += P V, 16 keys of V at a time.
        for (int j0 = 0; j0 < AK; j0 += 16) {
            __syncthreads();
            for (int e = tid; e < 16 * d; e += 256) {
                int jj = e / d, dd = e % d;
                vs[jj * d + dd] = k0 + j0 + jj < kend ? vc[((size_t)(k0 + j0 + jj) * hkv + kvh) * d + dd] : 0.0f;
            }
            __syncthreads();
#pragma unroll 4
            for (int jj = 0; jj < 16; jj++) {
                float p[4];
#pragma unroll
                for (int r = 0; r < 4; r++) p[r] = ps[ty * 4 + r][j0 + jj];
#pragma unroll
                for (int c = 0; c < 16; c++) {
                    if (tx + 16 * c < d) {
                        float v = vs[jj * d + tx + 16 * c];
#pragma unroll
                        for (int r = 0; r < 4; r++) o[r][c] += p[r] * v;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int i = ty * 4 + r;
        if (i >= rows) continue;
        float inv = 1.0f / l[r];
#pragma unroll
        for (int c = 0; c < 16; c++) {
            int col = tx + 16 * c;
            if (col < d) {
                size_t at = ((size_t)(q0 + i) * hq + h) * d + col;
                out[at] = o[r][c] * inv * sigmoidf_(gate[at]);
            }
        }
    }
}
