// The Gated DeltaNet mixer: the causal conv, the decode step, the chunked delta rule of a
// prefill (on CUDA cores and on tensor cores) and the gated RMSNorm of its output.

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
// two from 4 to 128. Built for three blocks an SM (at most 85 registers; it takes 95 unbounded,
// two blocks): 16 prompts of 512 tokens of the 0.8B on an H100, 262-282 -> 218-222 us a launch
// (ncu, two rounds).
#define CONV_RUN 8
__device__ __forceinline__ float conv_input(const float* conv, const float* qkv, int p, int c, int cd, int kk) {
    return p >= 0 ? qkv[(size_t)p * cd + c] : conv[(size_t)(kk + p) * cd + c];
}
// KK: the number of taps where the build knows it, else 0 and kk as passed. With it the
// window's shifts need no tests of kk: 16 prompts of 512 tokens of the 0.8B took 222-225 us a
// layer on an H200 without (35% of the DRAM peak, 56% of the SMs' issue rate), 148-150 with.
template <int KMAX, int KK>
__device__ void conv_silu_rows_run(const float* conv, const float* qkv, const float* taps, float* out, int t, int cd, int kk_arg, int qk_channels, int dk, float q_scale) {
    const int kk = KK ? KK : kk_arg;
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
        // (A warp of v channels only skips the sums of squares it has no use for.)
        if (__any_sync(0xffffffffu, normed))
            for (int o = 1; o < dk / 4; o <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (normed) {
            float inv = 1.0f / sqrtf(ss + 1e-6f) * scale;
            y = make_float4(y.x * inv, y.y * inv, y.z * inv, y.w * inv);
        }
        if (has) *(float4*)&out[(size_t)(i0 + r) * cd + c] = y;
    }
}
template <int KMAX>
__device__ void conv_silu_rows_body(const float* conv, const float* qkv, const float* taps, float* out, int t, int cd, int kk, int qk_channels, int dk, float q_scale) {
    if (kk == KMAX) conv_silu_rows_run<KMAX, KMAX>(conv, qkv, taps, out, t, cd, kk, qk_channels, dk, q_scale);
    else conv_silu_rows_run<KMAX, 0>(conv, qkv, taps, out, t, cd, kk, qk_channels, dk, q_scale);
}
#define CONV_SILU_ROWS(NAME, KMAX)                                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 3) NAME(const float* conv, const float* qkv, const float* taps, float* out, int t, int cd, int kk,    \
                                                              int qk_channels, int dk, float q_scale) {                                                   \
        pdl_enter();                                                                                                                                      \
        conv_silu_rows_body<KMAX>(conv, qkv, taps, out, t, cd, kk, qk_channels, dk, q_scale);                                                            \
    }
CONV_SILU_ROWS(conv_silu_rows_4, 4)
CONV_SILU_ROWS(conv_silu_rows_8, 8)

// After conv_silu_rows: the conv state becomes the last kk raw inputs (one thread per channel
// reads its old columns before it writes any).
__device__ void conv_state_tail_body(float* conv, const float* qkv, int t, int cd, int kk) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cd) return;
    float win[8];
    for (int j = 0; j < kk; j++) win[j] = conv_input(conv, qkv, t - kk + j, c, cd, kk);
    for (int j = 0; j < kk; j++) conv[(size_t)j * cd + c] = win[j];
}
extern "C" __global__ void conv_state_tail(float* conv, const float* qkv, int t, int cd, int kk) {
    pdl_enter();
    conv_state_tail_body(conv, qkv, t, cd, kk);
}

// The prefill kernels of a packed prefill (the *_packed kernels; common.cuh: PackedSeq): a
// prompt's DeltaNet launches alone fill few SMs (16 prompts of 512 tokens of the 0.8B spent 63%
// of their kernel time in them, one after another).
#define CONV_SILU_ROWS_PACKED(NAME, KMAX)                                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 3) NAME(float* const* convs, const u32* seqs, const float* qkv, const float* taps, float* out,  \
                                                              int cd, int kk, int qk_channels, int dk, float q_scale) {                            \
        pdl_enter();                                                                                                                               \
        PackedSeq q = packed_seq(seqs);                                                                                                            \
        if ((int)blockIdx.x * CONV_RUN >= q.count) return;                                                                                          \
        size_t at = (size_t)q.first * cd;                                                                                                          \
        conv_silu_rows_body<KMAX>(convs[blockIdx.z], qkv + at, taps, out + at, q.count, cd, kk, qk_channels, dk, q_scale);                           \
    }
CONV_SILU_ROWS_PACKED(conv_silu_rows_packed_4, 4)
CONV_SILU_ROWS_PACKED(conv_silu_rows_packed_8, 8)
// Grid: (ceil(cd / 256), 1, sequences); block 256.
extern "C" __global__ void conv_state_tail_packed(float* const* convs, const u32* seqs, const float* qkv, int cd, int kk) {
    pdl_enter();
    PackedSeq q = packed_seq(seqs);
    conv_state_tail_body(convs[blockIdx.z], qkv + (size_t)q.first * cd, q.count, cd, kk);
}

// A recurrent state's value: f32, or bf16 (an engine whose states are kept in bf16: half the
// bytes each step reads and writes), widened to f32 as it is loaded and rounded to the nearest
// bf16 as it is stored. The kernels that walk a state take it as void* and are built for each
// type (the *_bf16_state builds).
__device__ __forceinline__ float load_state(const float* p) { return *p; }
__device__ __forceinline__ float load_state(const bf16_t* p) { return bf16_to_f32(*p); }
__device__ __forceinline__ void store_state(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_state(bf16_t* p, float v) { *p = f32_to_bf16(v); }

// A DeltaNet layer's mixer for a few tokens (decode), in one launch: causal conv + SiLU, l2 norm
// of q and k (q scaled by 1/sqrt(dk)), the gated delta rule token after token
// (deltanet.rs recurrent_step) and the gated RMSNorm (backend/cpu/forward.rs), from the projections
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
// The roundings the batched kernels must repeat to the bit (deltanet_step_batch_*,
// deltanet_step_heads_*) are written out (__fmul_rn, fmaf, __fadd_rn): left to the compiler,
// a product and a sum may be fused in one kernel and not in another.
template <int DK, typename S>
__device__ void deltanet_step_body(float* conv, S* state, const float* qkv, const float* z, const float* bproj, const float* aproj, const float* taps,
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
    S* sh = state + (size_t)vh * DK * dv;
    float s[R];
#pragma unroll
    for (int i = 0; i < R; i++) s[i] = load_state(&sh[(size_t)(warp * R + i) * dv + j]);
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
            for (int i = lane; i < DK; i += 32) ss = fmaf(v[i], v[i], ss);
            ss = warp_sum(ss);
            if (lane == 0) stats[warp] = 1.0f / sqrtf(ss + 1e-6f) * (warp == 0 ? rsqrtf((float)DK) : 1.0f);
        }
        __syncthreads();
        float qn = stats[0], kn = stats[1];
        float beta = sigmoidf_(bproj[tok * hv + vh]);
        float alpha = expf(neg_a[vh] * softplusf_(aproj[tok * hv + vh] + dt_bias[vh]));
        float m = 0.0f;
#pragma unroll
        for (int i = 0; i < R; i++) {
            s[i] = __fmul_rn(s[i], alpha);
            m = fmaf(s[i], __fmul_rn(sk[warp * R + i], kn), m);
        }
        red[warp][lane] = m;
        __syncthreads();
        m = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) m += red[w][lane];
        float u = beta * (sv[lane] - m);
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < R; i++) {
            s[i] = fmaf(__fmul_rn(sk[warp * R + i], kn), u, s[i]);
            o = fmaf(s[i], __fmul_rn(sq[warp * R + i], qn), o);
        }
        __syncthreads();  // every warp has read red
        red[warp][lane] = o;
        __syncthreads();
        if (warp == 0) {
            o = 0.0f;
#pragma unroll
            for (int w = 0; w < WARPS; w++) o += red[w][lane];
            core[(size_t)tok * vd + vh * dv + j] = o;
            float ss = warp_sum(__fmul_rn(o, o));
            if (lane == 0) partial_ss[(size_t)blockIdx.x * TMAX + tok] = ss;
        }
        __syncthreads();  // sq, sk, sv and red are rewritten by the next token
    }
#pragma unroll
    for (int i = 0; i < R; i++) store_state(&sh[(size_t)(warp * R + i) * dv + j], s[i]);
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
        float inv = 1.0f / sqrtf(__fadd_rn(__fdiv_rn(total, (float)dv), eps));
        core[at] = norm_w[c] * (__ldcg(&core[at]) * inv) * siluf_(z[at]);
    }
    if (tid == 0) done[kh] = 0;
}
#define DELTANET_STEP(NAME, DK, S)                                                                                                           \
    extern "C" __global__ void __launch_bounds__(512) NAME(float* conv, void* state, const float* qkv, const float* z, const float* b, const float* a, const float* taps, \
                                    const float* na, const float* dt, const float* nw, float* core, float* pss, unsigned* done, int t, int hk, int hv, int dv, int cd, int kk, float eps) { \
        deltanet_step_body<DK, S>(conv, (S*)state, qkv, z, b, a, taps, na, dt, nw, core, pss, done, t, hk, hv, dv, cd, kk, eps);              \
    }
DELTANET_STEP(deltanet_step_32, 32, float)
DELTANET_STEP(deltanet_step_64, 64, float)
DELTANET_STEP(deltanet_step_128, 128, float)
DELTANET_STEP(deltanet_step_32_bf16_state, 32, bf16_t)
DELTANET_STEP(deltanet_step_64_bf16_state, 64, bf16_t)
DELTANET_STEP(deltanet_step_128_bf16_state, 128, bf16_t)

// The batched decode step's: one token of each sequence, block (x, b) doing for sequence b what
// block x of deltanet_step does for it alone (the same arithmetic), on its conv window
// convs[b] and state states[b]; each sequence has its own hand-over buffers. Grid:
// (hv * dv / 32, sequences); pss: sequences * hv * (dv / 32) * 8 floats; done: sequences * hk.
// Sequence b's projections are row b of one matrix of rows of `in_row` values (the batched
// step's input projections in one product): qkv, z, b and a point at their first row.
// A block's work is a chain of waits (its state tile's loads, the conv, five barriers, the
// stores): the SM hides one block's chain behind another's loads, so more blocks per SM move
// the states faster. At 64 registers two fit; capped at 40 (a few bytes spilled) three do: at
// the 0.8B's shapes, 256 sequences, 0.400 -> 0.327 ms a layer on an H100
// (scripts/bench-deltanet-step.sh).
#define DELTANET_STEP_BATCH(NAME, DK, S)                                                                                                     \
    extern "C" __global__ void __launch_bounds__(512, 3) NAME(float* const* convs, void* const* states, const float* qkv, const float* z, const float* b,     \
                                    const float* a, const float* taps, const float* na, const float* dt, const float* nw, float* core, float* pss,          \
                                    unsigned* done, int hk, int hv, int dv, int cd, int in_row, int kk, float eps) {                                       \
        size_t s = blockIdx.y, vd = (size_t)hv * dv, in = s * in_row;                                                                                     \
        deltanet_step_body<DK, S>(convs[s], (S*)states[s], qkv + in, z + in, b + in, a + in, taps, na, dt, nw, core + s * vd,                                   \
                               pss + s * (vd / 32) * 8, done + s * hk, 1, hk, hv, dv, cd, kk, eps);                                                        \
    }
DELTANET_STEP_BATCH(deltanet_step_batch_32, 32, float)
DELTANET_STEP_BATCH(deltanet_step_batch_64, 64, float)
DELTANET_STEP_BATCH(deltanet_step_batch_128, 128, float)
DELTANET_STEP_BATCH(deltanet_step_batch_32_bf16_state, 32, bf16_t)
DELTANET_STEP_BATCH(deltanet_step_batch_64_bf16_state, 64, bf16_t)
DELTANET_STEP_BATCH(deltanet_step_batch_128_bf16_state, 128, bf16_t)

// The batched decode step's mixer with a block per value head of a sequence: block (vh, b)
// does for sequence b's head vh what the dv / 32 blocks of deltanet_step do for it alone, in the
// same arithmetic (every sum in the same order), so a sequence still gets the bits it gets
// alone. The head's state (64 KB at dk = dv = 128 in f32, 32 KB in bf16) comes into shared
// memory by the copy engine (common.cuh bulk_load_start), which the block starts first and
// waits for after the conv; and goes back the same way. In between every thread walks K rows
// of 4 columns (at dk = 128, 16 rows), writing each row group's (R = dk / 16 rows,
// deltanet_step's warp's rows) sum of each column to shared memory, where the groups' sums are
// added in order per column; the block's other inputs are read while the state is on its way. Why: copied in and out by the threads (16-byte loads and stores) and
// walked by one thread per column, the copies and the walk were a chain of waits with no load
// in flight for most of it; held in registers instead (no copies), the block's 32 loads and
// stores a thread jammed the load/store queue (lg_throttle) and it was slower still. At 256
// sequences of the 0.8B on an H200 (ncu): f32 states 206-213 -> 174-175 us a layer (57 -> 68%
// of the DRAM peak), bf16 129-134 -> 121-122 us.
// A bf16 state is widened as it is read and rounded as it is written back, as deltanet_step
// rounds it as it stores it. The gated norm's sum of squares over the head is deltanet_step's
// 32-column warp sums, added in order.
// Built for square heads (dk = dv = D, known at compile time) and conv windows of up to 4 taps.
// Block: 2 D threads (thread c owns q/k conv channel c and, below D, v channel c); dynamic
// shared memory: D * D state values; grid (hv, sequences); done: sequences * hk zeroed counters
// (with several value heads a key head, the last of its blocks to finish writes the key head's
// q/k conv window, after all have read it). The projections as deltanet_step_batch's (in_row).
template <typename S>
struct StatePiece;
// 4 neighbouring values of a state's row, as stored: 16 bytes of f32 or 8 of bf16 (the same
// shape for both keeps a bf16 block's registers to half an f32 one's).
template <>
struct StatePiece<float> {
    u32 w[4];
    __device__ __forceinline__ float get(int e) const { return __uint_as_float(w[e]); }
    __device__ __forceinline__ void set(int e, float v) { w[e] = __float_as_uint(v); }
    __device__ __forceinline__ static StatePiece load(const float* p) {
        uint4 v = *(const uint4*)p;
        return {{v.x, v.y, v.z, v.w}};
    }
    __device__ __forceinline__ void store(float* p) const { *(uint4*)p = make_uint4(w[0], w[1], w[2], w[3]); }
};
template <>
struct StatePiece<bf16_t> {
    u32 w[2];
    __device__ __forceinline__ float get(int e) const { return bf16_to_f32((bf16_t)(w[e >> 1] >> (16 * (e & 1)))); }
    __device__ __forceinline__ void set(int e, float v) {
        u32 b = f32_to_bf16(v);
        w[e >> 1] = (e & 1) ? (w[e >> 1] & 0xffffu) | (b << 16) : (w[e >> 1] & 0xffff0000u) | b;
    }
    __device__ __forceinline__ static StatePiece load(const bf16_t* p) {
        uint2 v = *(const uint2*)p;
        return {{v.x, v.y}};
    }
    __device__ __forceinline__ void store(bf16_t* p) const { *(uint2*)p = make_uint2(w[0], w[1]); }
};
template <int D, typename S>
__device__ void deltanet_step_heads_body(float* conv, S* state, const float* qkv, const float* z, const float* bproj, const float* aproj, const float* taps,
                                         const float* neg_a, const float* dt_bias, const float* norm_w, float* core, unsigned* done, int hk, int hv, int dv,
                                         int cd, int kk, float eps) {
    using Piece = StatePiece<S>;
    // E values a piece, LPR lanes a row, RPI rows a warp's piece, K rows a thread (GROUPS row
    // groups of R): at dk = 128, 16 rows of 4 columns.
    constexpr int DK = D, R = DK / 16, KMAX = 4, THREADS = 2 * D, WARPS = THREADS / 32, E = 4, LPR = D / E, RPI = 32 / LPR,
                  K = D / (WARPS * RPI), GROUPS = K / R;
    static_assert(LPR <= 32 && K % R == 0, "a thread's rows are whole row groups");
    constexpr u32 BYTES = D * D * sizeof(S);
    DYNAMIC_SHARED(S, st, D * D);
    __shared__ __align__(16) float sq[DK], sk[DK], sv[D], so[D], su[D], red[16][D];
    __shared__ __align__(8) unsigned long long loaded;
    int vh = blockIdx.x, ratio = hv / hk, kh = vh / ratio, kd = hk * DK;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int c0 = (lane % LPR) * E, r0 = (warp * RPI + lane / LPR) * K;
    S* sh = state + (size_t)vh * DK * D;
    // (Started before the wait, as deltanet_step's loads are.)
    bulk_load_start(st, sh, BYTES, &loaded);
    // Conv channels: q/k channel `qk` (every thread), v channel `vc` (threads below D).
    int qk = tid < DK ? kh * DK + tid : kd + kh * DK + (tid - DK), vc = 2 * kd + vh * D + tid;
    bool has_v = tid < D;
    float wqk[KMAX], wv[KMAX];
#pragma unroll
    for (int q = 0; q < KMAX; q++) {
        if (q < kk) wqk[q] = conv[(size_t)q * cd + qk];
        if (q < kk && has_v) wv[q] = conv[(size_t)q * cd + vc];
    }
    pdl_enter();
    // Every other input read now, while the state is on its way (each read after the wait
    // would add a round trip to memory to the block's chain).
    float b_in = bproj[vh], a_in = aproj[vh], na = neg_a[vh], dt = dt_bias[vh];
    size_t at = (size_t)vh * D + tid;
    float z_in = has_v ? z[at] : 0.0f;
    auto conv_step = [&](float (&win)[KMAX], int ch) {
        float acc = 0.0f;
#pragma unroll
        for (int q = 0; q < KMAX; q++) {
            if (q + 1 < kk) win[q] = win[q + 1];
            else if (q + 1 == kk) win[q] = qkv[ch];
            if (q < kk) acc = fmaf(taps[(size_t)q * cd + ch], win[q], acc);
        }
        return siluf_(acc);
    };
    float y = conv_step(wqk, qk);
    if (tid < DK) sq[tid] = y; else sk[tid - DK] = y;
    if (has_v) {
        sv[tid] = conv_step(wv, vc);
#pragma unroll
        for (int q = 0; q < KMAX; q++)
            if (q < kk) conv[(size_t)q * cd + vc] = wv[q];
    }
    bulk_load_wait(&loaded);
    // 1 / |q| (times 1/sqrt(dk)) and 1 / |k|, as deltanet_step's warps 0 and 1 (every warp).
    float qn, kn;
    {
        float ss = 0.0f;
        for (int i = lane; i < DK; i += 32) ss = fmaf(sq[i], sq[i], ss);
        ss = warp_sum(ss);
        qn = 1.0f / sqrtf(ss + 1e-6f) * rsqrtf((float)DK);
        ss = 0.0f;
        for (int i = lane; i < DK; i += 32) ss = fmaf(sk[i], sk[i], ss);
        ss = warp_sum(ss);
        kn = 1.0f / sqrtf(ss + 1e-6f) * 1.0f;
    }
    float beta = sigmoidf_(b_in);
    float alpha = expf(na * softplusf_(a_in + dt));
    // Column c's 16 row groups' sums, added in order.
    auto column_sum = [&](int c) {
        float sum = 0.0f;
#pragma unroll
        for (int g = 0; g < 16; g++) sum += red[g][c];
        return sum;
    };
    // Each row group's share of each column's product of the decayed state with k.
#pragma unroll
    for (int gl = 0; gl < GROUPS; gl++) {
        int i0 = r0 + gl * R;
        Piece s[R];
#pragma unroll
        for (int r = 0; r < R; r++) s[r] = Piece::load(&st[(i0 + r) * D + c0]);
#pragma unroll
        for (int e = 0; e < E; e++) {
            float part = 0.0f;
#pragma unroll
            for (int r = 0; r < R; r++) part = fmaf(__fmul_rn(s[r].get(e), alpha), __fmul_rn(sk[i0 + r], kn), part);
            red[i0 / R][c0 + e] = part;
        }
    }
    __syncthreads();
    // Column `tid`: the groups' sums in order, then its update's scale u.
    if (has_v) su[tid] = beta * (sv[tid] - column_sum(tid));
    __syncthreads();
    // The update (the decay recomputed, not kept) and each row group's share of the product
    // with q.
#pragma unroll
    for (int gl = 0; gl < GROUPS; gl++) {
        int i0 = r0 + gl * R;
        Piece s[R];
#pragma unroll
        for (int r = 0; r < R; r++) s[r] = Piece::load(&st[(i0 + r) * D + c0]);
#pragma unroll
        for (int e = 0; e < E; e++) {
            float u = su[c0 + e], part = 0.0f;
#pragma unroll
            for (int r = 0; r < R; r++) {
                float x = fmaf(__fmul_rn(sk[i0 + r], kn), u, __fmul_rn(s[r].get(e), alpha));
                // Rounded where the state is bf16, as deltanet_step stores it; the output
                // takes the value before.
                s[r].set(e, x);
                part = fmaf(x, __fmul_rn(sq[i0 + r], qn), part);
            }
            red[i0 / R][c0 + e] = part;
        }
#pragma unroll
        for (int r = 0; r < R; r++) s[r].store(&st[(i0 + r) * D + c0]);
    }
    bulk_store_start(sh, st, BYTES);
    if (has_v) so[tid] = column_sum(tid);
    __syncthreads();
    // The gated RMSNorm over the head: deltanet_step's per-block sums of squares, in order.
    float total = 0.0f;
#pragma unroll
    for (int b = 0; b < D / 32; b++) {
        float x = so[b * 32 + lane];
        total += warp_sum(__fmul_rn(x, x));
    }
    if (has_v) {
        float inv = 1.0f / sqrtf(__fadd_rn(__fdiv_rn(total, (float)D), eps));
        core[at] = norm_w[tid] * (so[tid] * inv) * siluf_(z_in);
    }
    // The key head's q/k window: this block's with one value head a key head, else the last
    // block's of the key head to finish (every one has read the window by then).
    if (ratio == 1 || last_block_of(&done[kh], ratio)) {
#pragma unroll
        for (int q = 0; q < KMAX; q++)
            if (q < kk) conv[(size_t)q * cd + qk] = wqk[q];
        if (ratio > 1 && tid == 0) done[kh] = 0;
    }
    bulk_store_wait();
}
#define DELTANET_STEP_HEADS(NAME, DK, S, BLOCKS)                                                                                             \
    extern "C" __global__ void __launch_bounds__(256, BLOCKS) NAME(float* const* convs, void* const* states, const float* qkv, const float* z, const float* b,     \
                                    const float* a, const float* taps, const float* na, const float* dt, const float* nw, float* core, unsigned* done,     \
                                    int hk, int hv, int dv, int cd, int in_row, int kk, float eps) {                                                      \
        size_t s = blockIdx.y, vd = (size_t)hv * dv, in = s * in_row;                                                                                     \
        deltanet_step_heads_body<DK, S>(convs[s], (S*)states[s], qkv + in, z + in, b + in, a + in, taps, na, dt, nw, core + s * vd,                            \
                                     done + s * hk, hk, hv, dv, cd, kk, eps);                                                                             \
    }
DELTANET_STEP_HEADS(deltanet_step_heads_32, 32, float, 3)
DELTANET_STEP_HEADS(deltanet_step_heads_64, 64, float, 3)
DELTANET_STEP_HEADS(deltanet_step_heads_128, 128, float, 3)
DELTANET_STEP_HEADS(deltanet_step_heads_32_bf16_state, 32, bf16_t, 4)
DELTANET_STEP_HEADS(deltanet_step_heads_64_bf16_state, 64, bf16_t, 4)
DELTANET_STEP_HEADS(deltanet_step_heads_128_bf16_state, 128, bf16_t, 4)


// The chunked gated delta rule of a prefill (deltanet.rs chunked_body), in two kernels.
// Part 1, every (chunk of 64 tokens, value head) at once, as it needs no state: the cumulative
// log-decay G, the matrices A = (beta k . k^T) * decay (strictly lower) and P = (q . k^T) * decay
// (lower with the diagonal), and by forward substitution (I + A) U = beta v and
// (I + A) W = beta k exp(G). Writes gcum [t, hv], U [t, hv, dv], W [t, hv, dk] and
// P [chunks, hv, 64, 64]; where Wb, Qb, Kb and Pb are not null, the tensor-core walk's operands
// in bf16 instead of W and P: W, q exp(G) and k exp(G_last - G) ([t, hv, dk] each, G_last the
// chunk's last) and P (W and P are then not written in f32: only the f32 walk reads them).
// `mixed` holds the conv output with q and k already l2-normalised.
// For the tensor-core walk (Wb not null) k . k^T and q . k^T are taken on tensor cores too, from
// q and k rounded to bf16 (f32 sums): in f32 on CUDA cores they were most of this kernel's
// instructions. dk is then one of the walk's (a multiple of 16, at most 128).
// Block: 256 threads (at least dk + dv); grid: (chunks, hv).
#define CHUNK 64
__device__ void deltanet_chunk_prep_body(const float* mixed, const float* bproj, const float* aproj, const float* neg_a, const float* dt_bias, float* gcum, float* U,
                                         float* W, float* P, bf16_t* Wb, bf16_t* Qb, bf16_t* Kb, bf16_t* Pb, int t, int hk, int hv, int dk, int dv, int cd) {
    // `as` (A, for the substitution) first, then the products' operands: 32 key channels of q
    // and k in f32 (after `as`), or all of q and k in bf16 (over `as`: written after them).
    constexpr int RS = 128 + 8;  // a bf16 row's stride: 16-byte rows, the mma operand loads conflict-free
    __shared__ __align__(16) unsigned char scratch[2 * CHUNK * RS * sizeof(bf16_t)];
    __shared__ float gc[CHUNK], bt[CHUNK];
    float(*as)[CHUNK + 1] = (float(*)[CHUNK + 1])scratch;
    float(*qs)[33] = (float(*)[33])(scratch + sizeof(float) * CHUNK * (CHUNK + 1));
    float(*ks)[33] = qs + CHUNK;
    bf16_t(*q16)[RS] = (bf16_t(*)[RS])scratch;
    bf16_t(*k16)[RS] = q16 + CHUNK;
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
    // A = (beta k . k^T) * decay (strictly lower) and P = (q . k^T) * decay (lower with the
    // diagonal) from the products' entry (i, jj).
    auto put_a_p = [&](int i, int jj, float kk_, float qk) {
        float decay = jj <= i ? expf(gc[i] - gc[jj]) : 0.0f;
        as[i][jj] = jj < i ? bt[i] * kk_ * decay : 0.0f;
        size_t at = ((size_t)chunk * hv + h) * CHUNK * CHUNK + i * CHUNK + jj;
        if (Pb) Pb[at] = f32_to_bf16(qk * decay); else P[at] = qk * decay;
    };
    if (Qb) {
        // The tensor-core walk's q and k operands of this head, scaled and rounded here once
        // (its blocks of DS columns each did it for themselves): the same expressions; and q
        // and k as they are, rounded, for the products (zeros past the last row).
        float gl = gc[n - 1];
        for (int e = tid; e < CHUNK * dk / 4; e += blockDim.x) {
            int i = e / (dk / 4), d = (e % (dk / 4)) * 4;
            float4 q = make_float4(0.0f, 0.0f, 0.0f, 0.0f), k = q;
            if (i < n) {
                const float* row = mixed + (size_t)(c0 + i) * cd;
                q = *(const float4*)&row[kh * dk + d];
                k = *(const float4*)&row[kd + kh * dk + d];
                float eg = expf(gc[i]), ek = expf(gl - gc[i]);
                size_t at = ((size_t)(c0 + i) * hv + h) * dk + d;
                *(uint2*)&Qb[at] = make_uint2(pack_bf16x2(q.x * eg, q.y * eg), pack_bf16x2(q.z * eg, q.w * eg));
                *(uint2*)&Kb[at] = make_uint2(pack_bf16x2(k.x * ek, k.y * ek), pack_bf16x2(k.z * ek, k.w * ek));
            }
            *(uint2*)&q16[i][d] = make_uint2(pack_bf16x2(q.x, q.y), pack_bf16x2(q.z, q.w));
            *(uint2*)&k16[i][d] = make_uint2(pack_bf16x2(k.x, k.y), pack_bf16x2(k.z, k.w));
        }
        __syncthreads();
        // k . k^T and q . k^T: warp w takes rows 16 (w / 2).. and columns 32 (w % 2).. of both
        // (4 pieces of 16 x 8 each), k's rows being both the A operand (row-major) and the B
        // one (column-major: column jj of k^T is row jj of k).
        int warp = tid >> 5, lane = tid & 31, r = lane >> 2, cp = (lane & 3) * 2, row0 = (warp >> 1) * 16, col0 = (warp & 1) * 32;
        float kk_acc[4][4] = {}, qk_acc[4][4] = {};
        for (int k0 = 0; k0 < dk; k0 += 16) {
            u32 ak[4], aq[4];
            ak[0] = *(const u32*)&k16[row0 + r][k0 + cp];
            ak[1] = *(const u32*)&k16[row0 + r + 8][k0 + cp];
            ak[2] = *(const u32*)&k16[row0 + r][k0 + 8 + cp];
            ak[3] = *(const u32*)&k16[row0 + r + 8][k0 + 8 + cp];
            aq[0] = *(const u32*)&q16[row0 + r][k0 + cp];
            aq[1] = *(const u32*)&q16[row0 + r + 8][k0 + cp];
            aq[2] = *(const u32*)&q16[row0 + r][k0 + 8 + cp];
            aq[3] = *(const u32*)&q16[row0 + r + 8][k0 + 8 + cp];
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const bf16_t* b = &k16[col0 + nt * 8 + r][k0 + cp];
                u32 b0 = *(const u32*)b, b1 = *(const u32*)(b + 8);
                mma_bf16_16816(kk_acc[nt], ak, b0, b1);
                mma_bf16_16816(qk_acc[nt], aq, b0, b1);
            }
        }
        __syncthreads();  // `as` lies over q and k
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) put_a_p(row0 + r + (e >> 1) * 8, col0 + nt * 8 + cp + (e & 1), kk_acc[nt][e], qk_acc[nt][e]);
    } else {
        // k . k^T and q . k^T in f32, 4 x 4 entries per thread, over dk in steps of 32; the next
        // 32 channels' loads in flight while these are multiplied (with the column loads below in
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
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int c = 0; c < 4; c++) put_a_p(ty * 4 + r, tx * 4 + c, accA[r][c], accP[r][c]);
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
        size_t stride = (size_t)hv * (is_u ? dv : dk);
        if (!is_u && Wb) {
            for (int i = 0; i < n; i++) Wb[(size_t)(c0 + i) * stride + h * dk + d] = f32_to_bf16(col[i]);
        } else {
            float* dst = is_u ? U + (size_t)h * dv + d : W + (size_t)h * dk + d;
            for (int i = 0; i < n; i++) dst[(size_t)(c0 + i) * stride] = col[i];
        }
    }
}

// Built for two blocks an SM (at most 128 registers; unbounded it takes 180 and one block has an
// SM, 12% of its warps active): 16 prompts of 512 tokens of the 0.8B on an H100, 470-500 -> 404
// us a launch (ncu, two rounds).
extern "C" __global__ void __launch_bounds__(256, 2) deltanet_chunk_prep(const float* mixed, const float* bproj, const float* aproj, const float* neg_a, const float* dt_bias,
                                                                      float* gcum, float* U, float* W, float* P, bf16_t* Wb, bf16_t* Qb, bf16_t* Kb, bf16_t* Pb, int t, int hk,
                                                                      int hv, int dk, int dv, int cd) {
    pdl_enter();
    deltanet_chunk_prep_body(mixed, bproj, aproj, neg_a, dt_bias, gcum, U, W, P, Wb, Qb, Kb, Pb, t, hk, hv, dk, dv, cd);
}
// Grid: (most chunks of a sequence, hv, sequences).
extern "C" __global__ void __launch_bounds__(256, 2) deltanet_chunk_prep_packed(const u32* seqs, const float* mixed, const float* bproj, const float* aproj, const float* neg_a,
                                                                             const float* dt_bias, float* gcum, float* U, float* W, float* P, bf16_t* Wb, bf16_t* Qb,
                                                                             bf16_t* Kb, bf16_t* Pb, int hk, int hv, int dk, int dv, int cd) {
    pdl_enter();
    PackedSeq q = packed_seq(seqs);
    if ((int)blockIdx.x * CHUNK >= q.count) return;
    size_t r = q.first, rk = r * hv * dk, rp = (size_t)q.chunk0 * hv * CHUNK * CHUNK;
    deltanet_chunk_prep_body(mixed + r * cd, bproj + r * hv, aproj + r * hv, neg_a, dt_bias, gcum + r * hv, U + r * hv * dv, W + rk, P + rp, Wb ? Wb + rk : Wb,
                             Qb ? Qb + rk : Qb, Kb ? Kb + rk : Kb, Pb ? Pb + rp : Pb, q.count, hk, hv, dk, dv, cd);
}

// Part 2, the state's way through the chunks (in order), one block per (value head, DS value
// columns): V' = U - W S, O = (q exp(G)) S + P V', S <- exp(G_last) S + (k exp(G_last - G))^T V'.
// The DS columns of S live in shared memory; thread (group, col) takes rows RPG * group .. of
// the chunk's products (the state's tile St). Block: 256 threads; grid: (hv, dv / DS).
template <int DS, typename S>
__device__ void deltanet_chunk_state_body(S* state, const float* mixed, const float* gcum, const float* U, const float* W, const float* P, float* core, int t, int hk, int hv,
                                          int dk, int dv, int cd) {
    constexpr int G = 256 / DS, RPG = CHUNK / G;
    __shared__ float St[128][DS], vp[CHUNK][DS + 1], gc[CHUNK];
    // xs and ys (32 key channels of W, q or k for every row), or P.
    __shared__ float tiles[2 * CHUNK * 33];
    float(*xs)[33] = (float(*)[33])tiles;
    float(*ys)[33] = (float(*)[33])(tiles + CHUNK * 33);
    float(*ps)[CHUNK] = (float(*)[CHUNK])tiles;
    int h = blockIdx.x, col0 = blockIdx.y * DS, tid = threadIdx.x, col = tid % DS, grp = tid / DS;
    int kh = h / (hv / hk), kd = hk * dk, vd = hv * dv;
    S* sh = state + (size_t)h * dk * dv;
    for (int e = tid; e < dk * DS; e += blockDim.x) St[e / DS][e % DS] = load_state(&sh[(size_t)(e / DS) * dv + col0 + e % DS]);
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
                float sv = St[d0 + dd][col];
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
                float acc = St[d0 + dd][col] * el;
                for (int i = 0; i < n; i++) acc += xs[i][dd] * vp[i][col];
                St[d0 + dd][col] = acc;
            }
        }
    }
    __syncthreads();
    for (int e = tid; e < dk * DS; e += blockDim.x) store_state(&sh[(size_t)(e / DS) * dv + col0 + e % DS], St[e / DS][e % DS]);
}
// Two builds of the walk: with at most 128 registers a thread, so that two blocks share an SM
// (a grid of more blocks than SMs runs in one round), and with all it needs (about 210, one
// block per SM), which spills nothing: a grid that fits on the SMs takes that one.
#define DELTANET_CHUNK_STATE(NAME, BLOCKS_PER_SM, S)                                                                                         \
    extern "C" __global__ void __launch_bounds__(256, BLOCKS_PER_SM) NAME(void* state, const float* mixed, const float* gcum, const float* U,     \
                                                                         const float* W, const float* P, float* core, int t, int hk, int hv,  \
                                                                         int dk, int dv, int cd) {                                            \
        pdl_enter();                                                                                                                          \
        deltanet_chunk_state_body<16, S>((S*)state, mixed, gcum, U, W, P, core, t, hk, hv, dk, dv, cd);                                      \
    }
DELTANET_CHUNK_STATE(deltanet_chunk_state, 2, float)
DELTANET_CHUNK_STATE(deltanet_chunk_state_1, 1, float)
DELTANET_CHUNK_STATE(deltanet_chunk_state_bf16_state, 2, bf16_t)
DELTANET_CHUNK_STATE(deltanet_chunk_state_1_bf16_state, 1, bf16_t)

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
// S <- exp(G_last) S + (k exp(G_last - G))^T V', with bf16 operands and f32 sums. The operands
// W, q exp(G), k exp(G_last - G) and P come in bf16 from the prep (Wb, Qb, Kb, Pb), written once
// a head rather than rounded by each of its dv / 16 blocks. The state's master copy stays f32,
// in the registers of the last product's accumulators; a bf16 copy of it (transposed:
// Sb[column][key channel]) is the B operand of the next chunk's first two.
// Block (value head, 16 value columns), 4 warps: for V' and O warp w takes chunk rows 16 w..,
// for the state key channels 16 (w + 4 j)... The operands go from global to shared memory by
// asynchronous copies, each into a buffer of its own, issued a phase or two before they are
// needed: W and q of the next chunk once phase 1 is done with this one's, P of the next once
// phase 2 is, k of this chunk as it starts. They used to go through registers (255 a thread:
// two blocks an SM) into one region that the phases took in turn. k is kept as rows: phase 3's
// A operand is k^T, and ldmatrix transposes its 8 x 8 pieces as it loads them (the walk used to
// write k transposed, 2 bytes at a time, 16 lanes of a warp into one bank). V' transposed
// (Vb[column][row]) for phases 2 and 3. `dk` must equal DK. Dynamic shared memory:
// CHUNK_STATE_MMA_SHARED(DK) bytes. Grid: (hv, dv / 16); block 128.
// (layers.rs chunk_state_mma_shared computes the same.)
#define CHUNK_PAD 8
#define CHUNK_STATE_MMA_SHARED(DK) (2 * ((3 * CHUNK + 16) * ((DK) + CHUNK_PAD) + (CHUNK + 16) * (CHUNK + CHUNK_PAD)))
template <int DK, typename S>
__device__ void deltanet_chunk_state_mma_body(S* state, const float* gcum, const float* U, const bf16_t* Wg, const bf16_t* Qg, const bf16_t* Kg, const bf16_t* Pg, float* core,
                                              int t, int hv, int dv) {
    constexpr int DS = 16, KSTEPS = DK / 16, MT = DK / 16, MT_PER_WARP = (MT + 3) / 4;
    constexpr int RS = DK + CHUNK_PAD, PS = CHUNK + CHUNK_PAD;  // row strides: 16-byte rows, conflict-free operand loads
    DYNAMIC_SHARED(bf16_t, smem, CHUNK_STATE_MMA_SHARED(DK) / 2);
    bf16_t(*Wb)[RS] = (bf16_t(*)[RS])smem;
    bf16_t(*Qb)[RS] = Wb + CHUNK;
    bf16_t(*Kr)[RS] = Qb + CHUNK;
    bf16_t(*Sb)[RS] = Kr + CHUNK;
    bf16_t(*Pb)[PS] = (bf16_t(*)[PS])(Sb + DS);
    bf16_t(*Vb)[PS] = Pb + CHUNK;
    int h = blockIdx.x, col0 = blockIdx.y * DS, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int r = lane >> 2, cp = (lane & 3) * 2;
    int vd = hv * dv;
    S* sh = state + (size_t)h * DK * dv;
    int chunks = (t + CHUNK - 1) / CHUNK;
    if (chunks == 0) return;
    // A chunk's rows of a [t, hv, DK] operand into `dst`, 16 bytes a copy (zeros past the last
    // row), and a chunk's P (all 64 x 64 written by the prep).
    auto copy_rows = [&](bf16_t(*dst)[RS], const bf16_t* g, int chunk) {
        constexpr int ROW8 = DK / 8;
        int c0 = chunk * CHUNK, n = min(CHUNK, t - c0);
#pragma unroll
        for (int j = 0; j < CHUNK * ROW8 / 128; j++) {
            int e = tid + j * 128, i = e / ROW8, d = (e % ROW8) * 8;
            copy16_async(&dst[i][d], g + ((size_t)(c0 + min(i, n - 1)) * hv + h) * DK + d, i < n);
        }
    };
    auto copy_p = [&](int chunk) {
        const bf16_t* pc = Pg + ((size_t)chunk * hv + h) * CHUNK * CHUNK;
#pragma unroll
        for (int j = 0; j < CHUNK * CHUNK / 8 / 128; j++) {
            int e = tid + j * 128, i = e / (CHUNK / 8), c = (e % (CHUNK / 8)) * 8;
            copy16_async(&Pb[i][c], pc + i * CHUNK + c, true);
        }
    };
    // A chunk's last G and this lane's entries of its U, loaded a chunk ahead into registers.
    float glast, unext[2][4];
    auto load_g_u = [&](int chunk) {
        int c0 = chunk * CHUNK, n = min(CHUNK, t - c0);
        glast = gcum[(size_t)(c0 + n - 1) * hv + h];
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int i = warp * 16 + r + (e >> 1) * 8, c = nt * 8 + cp + (e & 1);
                unext[nt][e] = i < n ? U[((size_t)(c0 + i) * hv + h) * dv + col0 + c] : 0.0f;
            }
    };
    copy_rows(Wb, Wg, 0);
    copy_rows(Qb, Qg, 0);
    copy_async_commit();
    copy_p(0);
    copy_async_commit();
    load_g_u(0);
    // The state's elements this lane holds (for_each_state), the master copy.
    float sacc[MT_PER_WARP][2][4] = {};
    for_each_state<MT_PER_WARP, MT>(sacc, warp, r, cp, [&](float& v, int row, int col) { v = load_state(&sh[(size_t)row * dv + col0 + col]); });
    auto store_sb = [&]() { for_each_state<MT_PER_WARP, MT>(sacc, warp, r, cp, [&](float& v, int row, int col) { Sb[col][row] = f32_to_bf16(v); }); };
    // The A operand's registers for rows row0.. and columns k0.. of a bf16 matrix in shared memory.
    auto a_frag = [&](u32* a, const bf16_t* base, int stride, int row0, int k0) {
        a[0] = *(const u32*)&base[(row0 + r) * stride + k0 + cp];
        a[1] = *(const u32*)&base[(row0 + r + 8) * stride + k0 + cp];
        a[2] = *(const u32*)&base[(row0 + r) * stride + k0 + 8 + cp];
        a[3] = *(const u32*)&base[(row0 + r + 8) * stride + k0 + 8 + cp];
    };
    store_sb();
    // Each chunk commits three groups of copies, in this order: its k, the next chunk's W and q,
    // the next chunk's P; a phase waits for its own (copy_async_wait: at most N later groups
    // still in flight), then a barrier makes every thread's copies visible.
    for (int chunk = 0; chunk < chunks; chunk++) {
        int c0 = chunk * CHUNK, n = min(CHUNK, t - c0);
        float ur[2][4], el = expf(glast);
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) ur[nt][e] = unext[nt][e];
        copy_async_wait<1>();  // this chunk's W and q (its P may still be in flight)
        __syncthreads();       // and every thread is past the last chunk's phase 3
        copy_rows(Kr, Kg, chunk);
        copy_async_commit();
        // Phase 1: W S and (q exp(G)) S for this warp's 16 rows.
        float vacc[2][4], oacc[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) vacc[nt][e] = oacc[nt][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk++) {
            u32 aw[4], aq[4];
            a_frag(aw, &Wb[0][0], RS, warp * 16, kk * 16);
            a_frag(aq, &Qb[0][0], RS, warp * 16, kk * 16);
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
        if (chunk + 1 < chunks) {
            copy_rows(Wb, Wg, chunk + 1);
            copy_rows(Qb, Qg, chunk + 1);
        }
        copy_async_commit();
        copy_async_wait<2>();  // this chunk's P
        __syncthreads();
        // Phase 2: O += P V'.
#pragma unroll
        for (int kk = 0; kk < CHUNK / 16; kk++) {
            u32 ap[4];
            a_frag(ap, &Pb[0][0], PS, warp * 16, kk * 16);
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
        if (chunk + 1 < chunks) load_g_u(chunk + 1);
        copy_async_wait<1>();  // this chunk's k
        __syncthreads();       // P is done with
        if (chunk + 1 < chunks) copy_p(chunk + 1);
        copy_async_commit();
        // Phase 3: S <- exp(G_last) S + (k exp(G_last - G))^T V'.
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
                // k^T's rows mt 16.. (key channels), columns kk 16.. (chunk rows): lane l
                // points at chunk row kk 16 + 8 (m / 2) + l % 8, channels mt 16 + 8 (m % 2)..
                // of piece m = l / 8, which ldmatrix gives back transposed as a[m].
                u32 ak[4];
                int m = lane >> 3;
                ldmatrix_x4<true>(ak, &Kr[kk * 16 + (m >> 1) * 8 + (lane & 7)][mt * 16 + (m & 1) * 8]);
#pragma unroll
                for (int nt = 0; nt < 2; nt++) mma_bf16_16816(sacc[a][nt], ak, *(const u32*)&Vb[nt * 8 + r][kk * 16 + cp], *(const u32*)&Vb[nt * 8 + r][kk * 16 + 8 + cp]);
            }
        }
        // Sb was last read in phase 1 (two barriers ago): the next chunk's copy goes in now.
        store_sb();
    }
    copy_async_wait<0>();
    for_each_state<MT_PER_WARP, MT>(sacc, warp, r, cp, [&](float& v, int row, int col) { store_state(&sh[(size_t)row * dv + col0 + col], v); });
}
#define DELTANET_CHUNK_STATE_MMA(NAME, DK, S)                                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) NAME(void* state, const float* gcum, const float* U, const bf16_t* Wb, const bf16_t* Qb, const bf16_t* Kb, \
                                                           const bf16_t* Pb, float* core, int t, int hv, int dk, int dv) {                                  \
        pdl_enter();                                                                                                                                  \
        deltanet_chunk_state_mma_body<DK, S>((S*)state, gcum, U, Wb, Qb, Kb, Pb, core, t, hv, dv);                                                     \
    }
DELTANET_CHUNK_STATE_MMA(deltanet_chunk_state_mma_32, 32, float)
DELTANET_CHUNK_STATE_MMA(deltanet_chunk_state_mma_64, 64, float)
DELTANET_CHUNK_STATE_MMA(deltanet_chunk_state_mma_128, 128, float)
DELTANET_CHUNK_STATE_MMA(deltanet_chunk_state_mma_32_bf16_state, 32, bf16_t)
DELTANET_CHUNK_STATE_MMA(deltanet_chunk_state_mma_64_bf16_state, 64, bf16_t)
DELTANET_CHUNK_STATE_MMA(deltanet_chunk_state_mma_128_bf16_state, 128, bf16_t)

// The state walks of a packed prefill (grid: (hv, dv / 16, sequences)): sequence z's rows of
// the packed arrays and its own state.
#define PACKED_WALK_ARGS(q, S)                                                                                                           \
    (S*)states[blockIdx.z], mixed + (size_t)q.first * cd, gcum + (size_t)q.first * hv, U + (size_t)q.first * hv * dv, W + (size_t)q.first * hv * dk, \
        P + (size_t)q.chunk0 * hv * CHUNK * CHUNK, core + (size_t)q.first * hv * dv, q.count
#define DELTANET_CHUNK_STATE_MMA_PACKED(NAME, DK, S)                                                                                                   \
    extern "C" __global__ void __launch_bounds__(128) NAME(void* const* states, const u32* seqs, const float* gcum, const float* U, const bf16_t* Wb,       \
                                                           const bf16_t* Qb, const bf16_t* Kb, const bf16_t* Pb, float* core, int hv, int dk, int dv) {      \
        pdl_enter();                                                                                                                                   \
        PackedSeq q = packed_seq(seqs);                                                                                                                \
        size_t r = q.first, rk = r * hv * dk;                                                                                                          \
        deltanet_chunk_state_mma_body<DK, S>((S*)states[blockIdx.z], gcum + r * hv, U + r * hv * dv, Wb + rk, Qb + rk, Kb + rk,                        \
                                             Pb + (size_t)q.chunk0 * hv * CHUNK * CHUNK, core + r * hv * dv, q.count, hv, dv);                          \
    }
DELTANET_CHUNK_STATE_MMA_PACKED(deltanet_chunk_state_mma_packed_32, 32, float)
DELTANET_CHUNK_STATE_MMA_PACKED(deltanet_chunk_state_mma_packed_64, 64, float)
DELTANET_CHUNK_STATE_MMA_PACKED(deltanet_chunk_state_mma_packed_128, 128, float)
DELTANET_CHUNK_STATE_MMA_PACKED(deltanet_chunk_state_mma_packed_32_bf16_state, 32, bf16_t)
DELTANET_CHUNK_STATE_MMA_PACKED(deltanet_chunk_state_mma_packed_64_bf16_state, 64, bf16_t)
DELTANET_CHUNK_STATE_MMA_PACKED(deltanet_chunk_state_mma_packed_128_bf16_state, 128, bf16_t)
#define DELTANET_CHUNK_STATE_PACKED(NAME, S)                                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 2) NAME(void* const* states, const u32* seqs, const float* mixed, const float* gcum, const float* U, \
                                                              const float* W, const float* P, float* core, int hk, int hv, int dk, int dv, int cd) { \
        pdl_enter();                                                                                                                                   \
        PackedSeq q = packed_seq(seqs);                                                                                                                \
        deltanet_chunk_state_body<16, S>(PACKED_WALK_ARGS(q, S), hk, hv, dk, dv, cd);                                                                  \
    }
DELTANET_CHUNK_STATE_PACKED(deltanet_chunk_state_packed, float)
DELTANET_CHUNK_STATE_PACKED(deltanet_chunk_state_packed_bf16_state, bf16_t)

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
