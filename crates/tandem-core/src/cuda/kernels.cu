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

// x[i, :] = embedding row ids[i]. Grid: tokens.
extern "C" __global__ void embed(const bf16_t* table, const u32* ids, float* x, int h) {
    const bf16_t* row = table + (size_t)ids[blockIdx.x] * h;
    for (int c = threadIdx.x; c < h; c += blockDim.x) x[(size_t)blockIdx.x * h + c] = bf16_to_f32(row[c]);
}

// out = x / rms(x) * scale, per row of width d. Grid: rows.
extern "C" __global__ void rms_norm(const float* x, const float* scale, float* out, int d, float eps) {
    const float* xr = x + (size_t)blockIdx.x * d;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) ss += xr[c] * xr[c];
    float inv = 1.0f / sqrtf(block_sum(ss) / d + eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x) out[(size_t)blockIdx.x * d + c] = xr[c] * inv * scale[c];
}

// x += y.
extern "C" __global__ void add_inplace(float* x, const float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// gate = silu(gate) * up.
extern "C" __global__ void swiglu(float* gate, const float* up, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gate[i] = siluf_(gate[i]) * up[i];
}

// Round f32 to bf16, nearest even (the operand of a tensor-core GEMM).
extern "C" __global__ void to_bf16(const float* x, bf16_t* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        u32 b = __float_as_uint(x[i]);
        b += 0x7fffu + ((b >> 16) & 1u);
        y[i] = (bf16_t)(b >> 16);
    }
}

// The dot products of bf16 row `row` (k values) with the t <= 8 input rows of x, one warp, 8
// bf16 per lane per load (k a multiple of 8); every lane gets the sums.
#define GEMV_MAX_T 8
__device__ __forceinline__ void warp_dots(const uint4* row, const float* x, int k, int t, float* acc) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < GEMV_MAX_T; m++) acc[m] = 0.0f;
// Not unrolled: unrolling by 4 measured slower on an H100 (9B decode 85 vs 121 tok/s).
#pragma unroll 1
    for (int c = lane; c < k / 8; c += 32) {
        uint4 p = row[c];
        float wv[8];
        wv[0] = __uint_as_float(p.x << 16); wv[1] = __uint_as_float(p.x & 0xffff0000u);
        wv[2] = __uint_as_float(p.y << 16); wv[3] = __uint_as_float(p.y & 0xffff0000u);
        wv[4] = __uint_as_float(p.z << 16); wv[5] = __uint_as_float(p.z & 0xffff0000u);
        wv[6] = __uint_as_float(p.w << 16); wv[7] = __uint_as_float(p.w & 0xffff0000u);
#pragma unroll
        for (int m = 0; m < GEMV_MAX_T; m++) {
            if (m < t) {
                const float4* xp = (const float4*)(x + (size_t)m * k + c * 8);
                float4 a = xp[0], b = xp[1];
                acc[m] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w + wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
            }
        }
    }
#pragma unroll
    for (int m = 0; m < GEMV_MAX_T; m++)
        if (m < t) acc[m] = warp_sum(acc[m]);
}

// Lane 0 writes (or adds, with `accumulate`) row r's sums into out[t, n]. Unrolled with a bound
// test, so that acc stays in registers.
__device__ __forceinline__ void store_sums(float* out, int n, int r, int t, const float* acc, int accumulate) {
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int m = 0; m < GEMV_MAX_T; m++)
            if (m < t) out[(size_t)m * n + r] = (accumulate ? out[(size_t)m * n + r] : 0.0f) + acc[m];
}

// out[m, r] (+)= x[m, :] . W[r, :] for t <= 8 tokens, one warp per row; `accumulate` adds to
// out (a residual connection). Grid: ceil(n / 8).
extern "C" __global__ void gemv_bf16(const bf16_t* w, const float* x, float* out, int n, int k, int t, int accumulate) {
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= n) return;
    float acc[GEMV_MAX_T];
    warp_dots((const uint4*)(w + (size_t)r * k), x, k, t, acc);
    store_sums(out, n, r, t, acc, accumulate);
}

// Up to four products of the same input in one launch (a layer's input projections): matrix j
// has n_j rows (0: unused) and writes out_j[t, n_j]; its rows take the next ceil(n_j / 8) blocks.
extern "C" __global__ void gemv_bf16_multi(const bf16_t* w0, float* o0, int n0, const bf16_t* w1, float* o1, int n1, const bf16_t* w2, float* o2, int n2,
                                           const bf16_t* w3, float* o3, int n3, const float* x, int k, int t) {
    // Which matrix this block's rows belong to (selects, not an indexed array: registers).
    int warps = blockDim.x >> 5;
    int b0 = (n0 + warps - 1) / warps, b1 = (n1 + warps - 1) / warps, b2 = (n2 + warps - 1) / warps;
    int block = blockIdx.x;
    const bf16_t* w = w0;
    float* out = o0;
    int n = n0;
    if (block >= b0) { block -= b0; w = w1; out = o1; n = n1;
        if (block >= b1) { block -= b1; w = w2; out = o2; n = n2;
            if (block >= b2) { block -= b2; w = w3; out = o3; n = n3; } } }
    int r = block * warps + (threadIdx.x >> 5);
    if (r >= n) return;
    float acc[GEMV_MAX_T];
    warp_dots((const uint4*)(w + (size_t)r * k), x, k, t, acc);
    store_sums(out, n, r, t, acc, 0);
}

// out[m, r] = x[m, :] . W[r, :] for any t, in f32 (the exact path of a prefill): 64 x 64 output
// tiles, 16 x 16 threads of 4 x 4 outputs each, k in steps of 16.
extern "C" __global__ void gemm_bf16_f32(const bf16_t* w, const float* x, float* out, int n, int k, int t) {
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
            if (r < n) out[(size_t)m * n + r] = acc[i][j];
        }
    }
}

// Causal depthwise conv + SiLU (qwen35.rs causal_conv_silu): one thread per channel runs over
// the t tokens with its K-column window, then leaves the last K raw columns in `conv`
// ([K, cd], oldest first).
extern "C" __global__ void conv_silu(float* conv, const float* qkv, const float* taps, float* out, int t, int cd, int kk) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cd) return;
    float win[8];
    for (int j = 0; j < kk; j++) win[j] = conv[(size_t)j * cd + c];
    for (int i = 0; i < t; i++) {
        for (int j = 0; j + 1 < kk; j++) win[j] = win[j + 1];
        win[kk - 1] = qkv[(size_t)i * cd + c];
        float acc = 0.0f;
        for (int j = 0; j < kk; j++) acc = fmaf(taps[(size_t)j * cd + c], win[j], acc);
        out[(size_t)i * cd + c] = siluf_(acc);
    }
    for (int j = 0; j < kk; j++) conv[(size_t)j * cd + c] = win[j];
}

// l2-normalise each q and k head of the conv output in place, q also scaled by q_scale.
// Grid: (tokens, 2 * key heads); block: dk threads (rounded to a warp multiple).
extern "C" __global__ void l2norm_qk(float* mixed, int cd, int hk, int dk, float q_scale) {
    int head = blockIdx.y;
    float* v = mixed + (size_t)blockIdx.x * cd + (size_t)head * dk;
    float x = threadIdx.x < dk ? v[threadIdx.x] : 0.0f;
    float inv = 1.0f / sqrtf(block_sum(x * x) + 1e-6f);
    if (threadIdx.x < dk) v[threadIdx.x] = x * inv * (head < hk ? q_scale : 1.0f);
}

// The gated delta rule over t tokens (deltanet.rs recurrent_step, token after token). One block
// per value head, one thread per value column j, which holds column j of the head's state in
// registers for the whole call.
template <int DK>
__device__ void deltanet_body(float* state, const float* mixed, const float* bproj, const float* aproj, const float* neg_a, const float* dt_bias, float* core, int t, int hk, int hv, int dv, int cd) {
    __shared__ float qs[DK], ks[DK];
    int head = blockIdx.x, j = threadIdx.x;
    int kh = head / (hv / hk), kd = hk * DK, vd = hv * dv;
    float* sh = state + (size_t)head * DK * dv;
    float s[DK];
#pragma unroll
    for (int i = 0; i < DK; i++) s[i] = sh[(size_t)i * dv + j];
    for (int tok = 0; tok < t; tok++) {
        const float* row = mixed + (size_t)tok * cd;
        __syncthreads();
        for (int i = j; i < DK; i += blockDim.x) {
            qs[i] = row[kh * DK + i];
            ks[i] = row[kd + kh * DK + i];
        }
        __syncthreads();
        float beta = sigmoidf_(bproj[tok * hv + head]);
        float alpha = expf(neg_a[head] * softplusf_(aproj[tok * hv + head] + dt_bias[head]));
        float m = 0.0f;
#pragma unroll
        for (int i = 0; i < DK; i++) { s[i] *= alpha; m += s[i] * ks[i]; }
        float u = beta * (row[2 * kd + head * dv + j] - m);
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < DK; i++) { s[i] += ks[i] * u; o += s[i] * qs[i]; }
        core[(size_t)tok * vd + head * dv + j] = o;
    }
#pragma unroll
    for (int i = 0; i < DK; i++) sh[(size_t)i * dv + j] = s[i];
}
extern "C" __global__ void deltanet_32(float* s, const float* mixed, const float* b, const float* a, const float* na, const float* dt, float* core, int t, int hk, int hv, int dv, int cd) { deltanet_body<32>(s, mixed, b, a, na, dt, core, t, hk, hv, dv, cd); }
extern "C" __global__ void deltanet_64(float* s, const float* mixed, const float* b, const float* a, const float* na, const float* dt, float* core, int t, int hk, int hv, int dv, int cd) { deltanet_body<64>(s, mixed, b, a, na, dt, core, t, hk, hv, dv, cd); }
extern "C" __global__ void deltanet_128(float* s, const float* mixed, const float* b, const float* a, const float* na, const float* dt, float* core, int t, int hk, int hv, int dv, int cd) { deltanet_body<128>(s, mixed, b, a, na, dt, core, t, hk, hv, dv, cd); }

// core = w * (core / rms(core)) * silu(z), per head row of width dv. Grid: tokens * value heads.
extern "C" __global__ void gated_rms_norm(float* core, const float* z, const float* w, int dv, float eps) {
    float* x = core + (size_t)blockIdx.x * dv;
    const float* g = z + (size_t)blockIdx.x * dv;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < dv; c += blockDim.x) ss += x[c] * x[c];
    float inv = 1.0f / sqrtf(block_sum(ss) / dv + eps);
    for (int c = threadIdx.x; c < dv; c += blockDim.x) x[c] = w[c] * (x[c] * inv) * siluf_(g[c]);
}

// Per token: split the interleaved query/gate heads, RMSNorm q and k heads with their
// zero-centred weights, rotate the first 2 * half channels (NeoX pairs c, c + half) at
// position pos[0] + token. Grid: (tokens, hq + hkv); block: a warp multiple >= d.
extern "C" __global__ void qk_norm_rope(const float* qg, float* q, float* gate, float* k, const float* q_norm, const float* k_norm,
                                        const float* inv_freq, int hq, int hkv, int d, int half, const u32* pos, float eps) {
    int pos0 = (int)pos[0];
    __shared__ float v[1024];
    int tok = blockIdx.x, head = blockIdx.y, c = threadIdx.x;
    bool is_q = head < hq;
    const float* src = is_q ? qg + ((size_t)tok * hq + head) * 2 * d : k + ((size_t)tok * hkv + (head - hq)) * d;
    float* dst = is_q ? q + ((size_t)tok * hq + head) * d : k + ((size_t)tok * hkv + (head - hq)) * d;
    const float* w = is_q ? q_norm : k_norm;
    float x = c < d ? src[c] : 0.0f;
    if (is_q && c < d) gate[((size_t)tok * hq + head) * d + c] = src[d + c];
    float inv = 1.0f / sqrtf(block_sum(x * x) / d + eps);
    if (c < d) v[c] = x * inv * w[c];
    __syncthreads();
    if (c < d) {
        float y = v[c];
        if (c < 2 * half) {
            int i = c < half ? c : c - half;
            float angle = (float)(pos0 + tok) * inv_freq[i];
            float cs = (float)cos((double)angle), sn = (float)sin((double)angle);
            y = c < half ? v[c] * cs - v[c + half] * sn : v[c] * cs + v[c - half] * sn;
        }
        dst[c] = y;
    }
}

// Causal GQA attention for one (token, query head): scores over the visible positions in
// shared memory, softmax, weighted sum of values; then the output gate sigmoid(gate).
// Grid: (tokens, hq); block 128; dynamic shared memory: pos[0] + t floats or more.
extern "C" __global__ void attention(const float* q, const float* kc, const float* vc, const float* gate, float* out, int hq, int hkv, int d, const u32* pos) {
    extern __shared__ float scores[];
    int pos0 = (int)pos[0];
    int tok = blockIdx.x, h = blockIdx.y;
    int kvh = h / (hq / hkv);
    int visible = pos0 + tok + 1;
    const float* qh = q + ((size_t)tok * hq + h) * d;
    float scale = 1.0f / sqrtf((float)d);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int p = warp; p < visible; p += warps) {
        const float* kp = kc + ((size_t)p * hkv + kvh) * d;
        float s = 0.0f;
        for (int c = lane; c < d; c += 32) s += qh[c] * kp[c];
        s = warp_sum(s);
        if (lane == 0) scores[p] = s * scale;
    }
    __syncthreads();
    float mx = NEG_INF;
    for (int p = threadIdx.x; p < visible; p += blockDim.x) mx = fmaxf(mx, scores[p]);
    mx = block_max(mx);
    float sum = 0.0f;
    for (int p = threadIdx.x; p < visible; p += blockDim.x) {
        float e = expf(scores[p] - mx);
        scores[p] = e;
        sum += e;
    }
    float inv = 1.0f / block_sum(sum);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float o = 0.0f;
        for (int p = 0; p < visible; p++) o = fmaf(scores[p] * inv, vc[((size_t)p * hkv + kvh) * d + c], o);
        size_t at = ((size_t)tok * hq + h) * d + c;
        out[at] = o * sigmoidf_(gate[at]);
    }
}

// Append t rows of keys and values (n = t * row values each) to the caches at row pos[0].
extern "C" __global__ void kv_append(const float* k, const float* v, float* kc, float* vc, const u32* pos, int row, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    size_t at = (size_t)pos[0] * row + i;
    kc[at] = k[i];
    vc[at] = v[i];
}
