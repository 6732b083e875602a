// GGML's block formats on the GPU (model/blocks.rs: the formats; backend/cuda/blocks.rs: how a
// matrix is laid out here). A row is k / E blocks. Q4_K (144 bytes) and Q5_K (176) keep the
// file's layout, their blocks whole 16-byte units; the others, whose blocks are not (Q4_0 18,
// Q8_0 34, Q6_K 210), are split: each row holds its blocks without their f16 scale `d` (16, 32,
// 208 bytes: 16-byte units), then the row's k / E scales, then zeros to a multiple of 16 bytes,
// so that every load is aligned.
//
// A chunk is 32 of a row's values that one lane of a GEMV reads together: chunk c of a row is
// in block c / (E / 32). `BlockChunk<F>` loads one (`load`, before the kernel waits for its
// input) and multiplies it by a few tokens' inputs (`dot`). The decode GEMV does not dequantize:
// it multiplies a chunk's integers (before their run's scale) by the token's inputs rounded to
// 16-bit integers (`block_input`: q = v / s rounded, s = max |v| / 32767, as the CPU engine's
// block GEMV rounds them), two products an instruction (`__dp2a_lo`/`_hi`: two 16-bit inputs
// times two bytes, added to a 32-bit sum), so that each run's sum is exact; then scales it by
// the run's d · scale in f32 and adds its minimum times the sum of the run's inputs
// (`block_input` writes the sum of each 8). That is about half an instruction a value, against
// four for dequantizing into f32 (an integer made a float, the scale's fused multiply-add, the
// product), which held an H200 to 10-15% of its bandwidth. The dequantize and embed kernels
// compute each value as the CPU's plain dequantizer does (a product, then a difference), bit
// for bit.

#define BLOCK_Q4_0 0
#define BLOCK_Q8_0 1
#define BLOCK_Q4_K 2
#define BLOCK_Q5_K 3
#define BLOCK_Q6_K 4

__device__ __forceinline__ float f16_bits_to_f32(u32 h) {
#if __CUDA_ARCH__
    // One conversion instruction, exact (every f16 is an f32), subnormals included.
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
#endif
    u32 sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        // Zero or subnormal: m * 2^-24, exact.
        float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112) << 23) | (m << 13));
}

// Bytes of w (signed) times four 16-bit inputs (x01: inputs 0 and 1, x23: 2 and 3), plus acc.
__device__ __forceinline__ int dot4(u32 w, u32 x01, u32 x23, int acc) {
    return __dp2a_hi((int)x23, (int)w, __dp2a_lo((int)x01, (int)w, acc));
}

// Sums of 8 inputs `i` and `i + 1` (in units of 8 values).
__device__ __forceinline__ int sums2(const int* s, int i) { return s[i] + s[i + 1]; }

// Values per block and bytes of a block in the GPU layout (without `d` where split).
template <int F> struct BlockShape;
template <> struct BlockShape<BLOCK_Q4_0> { static constexpr int E = 32, BODY = 16; static constexpr bool SPLIT = true; };
template <> struct BlockShape<BLOCK_Q8_0> { static constexpr int E = 32, BODY = 32; static constexpr bool SPLIT = true; };
template <> struct BlockShape<BLOCK_Q4_K> { static constexpr int E = 256, BODY = 144; static constexpr bool SPLIT = false; };
template <> struct BlockShape<BLOCK_Q5_K> { static constexpr int E = 256, BODY = 176; static constexpr bool SPLIT = false; };
template <> struct BlockShape<BLOCK_Q6_K> { static constexpr int E = 256, BODY = 208; static constexpr bool SPLIT = true; };

// Bytes of a row of k values (backend/cuda/blocks.rs gpu_row_bytes).
template <int F>
__device__ __forceinline__ size_t block_row_bytes(int k) {
    typedef BlockShape<F> S;
    size_t blocks = k / S::E, bytes = blocks * S::BODY + (S::SPLIT ? 2 * blocks : 0);
    return (bytes + 15) / 16 * 16;
}

// The f16 scale of block b of a row (split layouts: after the bodies; else the block's first
// two bytes).
template <int F>
__device__ __forceinline__ float block_d(const unsigned char* row, int k, int b) {
    typedef BlockShape<F> S;
    if (S::SPLIT) return f16_bits_to_f32(((const unsigned short*)(row + (size_t)(k / S::E) * S::BODY))[b]);
    return f16_bits_to_f32(*(const unsigned short*)(row + (size_t)b * S::BODY));
}

// A k-quant's scale and minimum of run j (0..8) from its 12 bytes (q0..q2 as 32-bit words):
// model/blocks scale_min_k4.
__device__ __forceinline__ void scale_min_k4(int j, u32 q0, u32 q1, u32 q2, float& sc, float& m) {
    u32 s, mm;
    if (j < 4) {
        s = (q0 >> (8 * j)) & 63u;
        mm = (q1 >> (8 * j)) & 63u;
    } else {
        int i = j - 4;
        s = ((q2 >> (8 * i)) & 0xfu) | (((q0 >> (8 * i + 6)) & 3u) << 4);
        mm = ((q2 >> (8 * i + 4)) & 0xfu) | (((q1 >> (8 * i + 6)) & 3u) << 4);
    }
    sc = (float)s;
    m = (float)mm;
}

// One chunk's bytes, as loaded.
struct ChunkRaw {
    uint4 a, b, c;
    float d;
};

template <int F> struct BlockChunk;

// Q4_K / Q5_K chunk j (0..8) of a block: 16 bytes of the quants, the low nibbles values
// 64 (j / 2) + 16 (j % 2) + i of run 2 (j / 2), the high ones 32 further of run 2 (j / 2) + 1;
// Q5_K's fifth bits from 16 bytes of qh (bits 2 (j / 2) and + 1).
template <int F>
struct KQuantChunk {
    static constexpr int PER_BLOCK = 8;
    __device__ static ChunkRaw load(const unsigned char* row, int k, int c) {
        const unsigned char* blk = row + (size_t)(c / 8) * BlockShape<F>::BODY;
        int j = c % 8;
        ChunkRaw r;
        r.a = *(const uint4*)blk;
        r.b = *(const uint4*)(blk + (F == BLOCK_Q5_K ? 48 : 16) + 16 * j);
        r.c = F == BLOCK_Q5_K ? *(const uint4*)(blk + 16 + 16 * (j % 2)) : make_uint4(0, 0, 0, 0);
        r.d = 0.0f;
        return r;
    }
    // acc[m] += s_m · (the chunk's values · token m's inputs), from the integer inputs q
    // ([t, k]), their sums of 8 (sums, [t, k / 8]) and scales s (qs) of block_input.
    template <int T>
    __device__ static void dot(const ChunkRaw& r, int c, const short* q, const int* sums, const float* qs, int k, int t, float* acc) {
        int b = c / 8, j = c % 8, run = j / 2;
        float d = f16_bits_to_f32(r.a.x & 0xffffu), dmin = f16_bits_to_f32(r.a.x >> 16);
        float sc0, m0, sc1, m1;
        scale_min_k4(2 * run, r.a.y, r.a.z, r.a.w, sc0, m0);
        scale_min_k4(2 * run + 1, r.a.y, r.a.z, r.a.w, sc1, m1);
        float dl = d * sc0, ml = -(dmin * m0), dh = d * sc1, mh = -(dmin * m1);
        int base = 256 * b + 64 * run + 16 * (j % 2);
        u32 qw[4] = {r.b.x, r.b.y, r.b.z, r.b.w}, h[4] = {r.c.x, r.c.y, r.c.z, r.c.w}, lo[4], hi[4];
#pragma unroll
        for (int w = 0; w < 4; w++) {
            lo[w] = qw[w] & 0x0f0f0f0fu;
            hi[w] = (qw[w] >> 4) & 0x0f0f0f0fu;
            if (F == BLOCK_Q5_K) {
                lo[w] |= ((h[w] >> (2 * run)) & 0x01010101u) << 4;
                hi[w] |= ((h[w] >> (2 * run + 1)) & 0x01010101u) << 4;
            }
        }
        int groups = k / 8;
#pragma unroll
        for (int m = 0; m < T; m++) {
            if (m < t) {
                const uint4* xa = (const uint4*)(q + (size_t)m * k + base);
                uint4 a0 = xa[0], a1 = xa[1], b0 = xa[4], b1 = xa[5];
                int il = dot4(lo[3], a1.z, a1.w, dot4(lo[2], a1.x, a1.y, dot4(lo[1], a0.z, a0.w, dot4(lo[0], a0.x, a0.y, 0))));
                int ih = dot4(hi[3], b1.z, b1.w, dot4(hi[2], b1.x, b1.y, dot4(hi[1], b0.z, b0.w, dot4(hi[0], b0.x, b0.y, 0))));
                const int* s = sums + m * groups + base / 8;
                float part = fmaf(dl, (float)il, fmaf(dh, (float)ih, fmaf(ml, (float)sums2(s, 0), mh * (float)sums2(s, 4))));
                acc[m] = fmaf(qs[m], part, acc[m]);
            }
        }
    }
};
template <> struct BlockChunk<BLOCK_Q4_K> : KQuantChunk<BLOCK_Q4_K> {};
template <> struct BlockChunk<BLOCK_Q5_K> : KQuantChunk<BLOCK_Q5_K> {};

// Q6_K chunk j (0..8) of a block: half j / 4, the 8 columns l0 = 8 (j % 4) .. + 8 of each of
// its four parts (values 128 half + 32 part + l; dequantize_block).
template <>
struct BlockChunk<BLOCK_Q6_K> {
    static constexpr int PER_BLOCK = 8;
    __device__ static ChunkRaw load(const unsigned char* row, int k, int c) {
        int b = c / 8, j = c % 8, half = j / 4, l0 = 8 * (j % 4);
        const unsigned char* blk = row + (size_t)b * 208;
        uint2 qa = *(const uint2*)(blk + 64 * half + l0), qb = *(const uint2*)(blk + 64 * half + 32 + l0), qh = *(const uint2*)(blk + 128 + 32 * half + l0);
        ChunkRaw r;
        r.a = make_uint4(qa.x, qa.y, qb.x, qb.y);
        r.b = make_uint4(qh.x, qh.y, 0, 0);
        r.c = *(const uint4*)(blk + 192);
        r.d = block_d<BLOCK_Q6_K>(row, k, b);
        return r;
    }
    template <int T>
    __device__ static void dot(const ChunkRaw& r, int c, const short* q, const int* sums, const float* qs, int k, int t, float* acc) {
        int b = c / 8, j = c % 8, half = j / 4, l0 = 8 * (j % 4);
        u32 sc[4] = {r.c.x, r.c.y, r.c.z, r.c.w};
        u32 qa[2] = {r.a.x, r.a.y}, qb[2] = {r.a.z, r.a.w}, qh[2] = {r.b.x, r.b.y};
        // Part p's 8 integers (0..63, the format's 32 not yet subtracted) and its scale.
        u32 wq[4][2];
        float ds[4];
#pragma unroll
        for (int p = 0; p < 4; p++) {
            int s = 8 * half + 2 * p + l0 / 16;
            ds[p] = r.d * (float)(signed char)((sc[s / 4] >> (8 * (s % 4))) & 0xffu);
#pragma unroll
            for (int w = 0; w < 2; w++) wq[p][w] = (((p % 2 == 0 ? qa[w] : qb[w]) >> (p < 2 ? 0 : 4)) & 0x0f0f0f0fu) | (((qh[w] >> (2 * p)) & 0x03030303u) << 4);
        }
        int groups = k / 8;
#pragma unroll
        for (int m = 0; m < T; m++) {
            if (m < t) {
                float part = 0.0f;
#pragma unroll
                for (int p = 0; p < 4; p++) {
                    int at = 256 * b + 128 * half + 32 * p + l0;
                    uint4 x = *(const uint4*)(q + (size_t)m * k + at);
                    int i = dot4(wq[p][1], x.z, x.w, dot4(wq[p][0], x.x, x.y, 0)) - 32 * sums[m * groups + at / 8];
                    part = fmaf(ds[p], (float)i, part);
                }
                acc[m] = fmaf(qs[m], part, acc[m]);
            }
        }
    }
};

// Q8_0 and Q4_0: a chunk is a block.
template <>
struct BlockChunk<BLOCK_Q8_0> {
    static constexpr int PER_BLOCK = 1;
    __device__ static ChunkRaw load(const unsigned char* row, int k, int c) {
        const uint4* q = (const uint4*)(row + (size_t)c * 32);
        ChunkRaw r;
        r.a = q[0];
        r.b = q[1];
        r.c = make_uint4(0, 0, 0, 0);
        r.d = block_d<BLOCK_Q8_0>(row, k, c);
        return r;
    }
    template <int T>
    __device__ static void dot(const ChunkRaw& r, int c, const short* q, const int* sums, const float* qs, int k, int t, float* acc) {
        u32 w[8] = {r.a.x, r.a.y, r.a.z, r.a.w, r.b.x, r.b.y, r.b.z, r.b.w};
#pragma unroll
        for (int m = 0; m < T; m++) {
            if (m < t) {
                const uint4* x = (const uint4*)(q + (size_t)m * k + 32 * c);
                int i = 0;
#pragma unroll
                for (int v = 0; v < 4; v++) {
                    uint4 xv = x[v];
                    i = dot4(w[2 * v + 1], xv.z, xv.w, dot4(w[2 * v], xv.x, xv.y, i));
                }
                acc[m] = fmaf(qs[m], r.d * (float)i, acc[m]);
            }
        }
    }
};
template <>
struct BlockChunk<BLOCK_Q4_0> {
    static constexpr int PER_BLOCK = 1;
    __device__ static ChunkRaw load(const unsigned char* row, int k, int c) {
        ChunkRaw r;
        r.a = *(const uint4*)(row + (size_t)c * 16);
        r.b = r.c = make_uint4(0, 0, 0, 0);
        r.d = block_d<BLOCK_Q4_0>(row, k, c);
        return r;
    }
    template <int T>
    __device__ static void dot(const ChunkRaw& r, int c, const short* q, const int* sums, const float* qs, int k, int t, float* acc) {
        u32 qw[4] = {r.a.x, r.a.y, r.a.z, r.a.w}, lo[4], hi[4];
#pragma unroll
        for (int w = 0; w < 4; w++) {
            lo[w] = qw[w] & 0x0f0f0f0fu;
            hi[w] = (qw[w] >> 4) & 0x0f0f0f0fu;
        }
        int groups = k / 8;
#pragma unroll
        for (int m = 0; m < T; m++) {
            if (m < t) {
                const uint4* x = (const uint4*)(q + (size_t)m * k + 32 * c);
                uint4 a0 = x[0], a1 = x[1], b0 = x[2], b1 = x[3];
                int i = dot4(lo[3], a1.z, a1.w, dot4(lo[2], a1.x, a1.y, dot4(lo[1], a0.z, a0.w, dot4(lo[0], a0.x, a0.y, 0))));
                i = dot4(hi[3], b1.z, b1.w, dot4(hi[2], b1.x, b1.y, dot4(hi[1], b0.z, b0.w, dot4(hi[0], b0.x, b0.y, i))));
                const int* s = sums + m * groups + 4 * c;
                acc[m] = fmaf(qs[m], r.d * (float)(i - 8 * (sums2(s, 0) + sums2(s, 2))), acc[m]);
            }
        }
    }
};

// Value i of a row as the CPU's plain dequantizer computes it (model/blocks dequantize_block:
// a scale times an integer, then less the minimum, each rounded).
template <int F>
__device__ float block_value(const unsigned char* row, int k, int i) {
    typedef BlockShape<F> S;
    int b = i / S::E, v = i % S::E;
    const unsigned char* blk = row + (size_t)b * S::BODY;
    if (F == BLOCK_Q8_0) return __fmul_rn((float)(signed char)blk[v], block_d<F>(row, k, b));
    if (F == BLOCK_Q4_0) {
        int q = v < 16 ? blk[v] & 0xf : blk[v - 16] >> 4;
        return __fmul_rn((float)(q - 8), block_d<F>(row, k, b));
    }
    if (F == BLOCK_Q6_K) {
        int half = v / 128, part = (v % 128) / 32, l = v % 32;
        int ql = blk[64 * half + 32 * (part % 2) + l], qh = blk[128 + 32 * half + l];
        int q = ((part < 2 ? ql : ql >> 4) & 0xf) | (((qh >> (2 * part)) & 3) << 4);
        float s = __fmul_rn(block_d<F>(row, k, b), (float)(signed char)blk[192 + v / 16]);
        return __fmul_rn(s, (float)(q - 32));
    }
    const u32* w = (const u32*)(blk + 4);
    float d = f16_bits_to_f32(*(const unsigned short*)blk), dmin = f16_bits_to_f32(*(const unsigned short*)(blk + 2)), sc, m;
    int run = v / 32, l = v % 32;
    scale_min_k4(run, w[0], w[1], w[2], sc, m);
    const unsigned char* qs = blk + (F == BLOCK_Q5_K ? 48 : 16);
    int q = (qs[32 * (run / 2) + l] >> (4 * (run % 2))) & 0xf;
    if (F == BLOCK_Q5_K) q |= ((blk[16 + l] >> run) & 1) << 4;
    return __fsub_rn(__fmul_rn(__fmul_rn(d, sc), (float)q), __fmul_rn(dmin, m));
}

// A block-format matrix [n, k] dequantized into f32 (`out`) or rounded to bf16 (`out_bf16`,
// where not null): the weights of a GEMM. A block per row.
template <int F>
__device__ void dequantize_rows_body(const unsigned char* w, float* out, bf16_t* out_bf16, int n, int k) {
    pdl_enter();
    int r = blockIdx.x;
    if (r >= n) return;
    const unsigned char* row = w + (size_t)r * block_row_bytes<F>(k);
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        float y = block_value<F>(row, k, i);
        size_t at = (size_t)r * k + i;
        if (out_bf16) out_bf16[at] = f32_to_bf16(y);
        else out[at] = y;
    }
}

// Row ids[i] of a block-format embedding table [vocab, h] into x's row i (the embed kernel of
// norm.cu for bf16 tables).
template <int F>
__device__ void embed_blocks_body(const unsigned char* table, const u32* ids, float* x, int h) {
    pdl_enter();
    const unsigned char* row = table + (size_t)ids[blockIdx.x] * block_row_bytes<F>(h);
    for (int i = threadIdx.x; i < h; i += blockDim.x) x[(size_t)blockIdx.x * h + i] = block_value<F>(row, h, i);
}

// The inputs of a block GEMV (gemv.cu BlockRows): row m of x (t rows), normalised where
// `scale` is not null (rms_norm(x) * scale, the 1/rms found as rms_inv finds it) and rounded to
// bf16 with `round_in` (what the bf16 GEMV multiplies), as 16-bit integers q ≈ v / s,
// s = max |v| / 32767 (rounded to nearest, ties to even: the CPU engine's round_to_i16), into
// q[m * k ..]; the sum of each 8 of them into sums[m * (k / 8) ..] and s (as a float's bits)
// into sums[t * (k / 8) + m]. k a multiple of 8. BLOCK_INPUT_PARTS blocks per row (grid
// t * BLOCK_INPUT_PARTS), each finding the row's 1/rms and largest value and writing its part
// of the integers: a decode step's GEMV waits on this, so it is spread over SMs (on an H200 a
// 9B decode step ran 4% faster than with one block per row holding its values in registers).
#define BLOCK_INPUT_PARTS 8
extern "C" __global__ void __launch_bounds__(256) block_input(const float* x, const float* scale, int k, float eps, int round_in, unsigned* q, unsigned* sums) {
    pdl_enter();
    __shared__ float squares[8];
    int m = blockIdx.x / BLOCK_INPUT_PARTS, part = blockIdx.x % BLOCK_INPUT_PARTS, t = gridDim.x / BLOCK_INPUT_PARTS;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* xm = x + (size_t)m * k;
    float inv = 1.0f;
    if (scale) {
        float ss = warp_sum(thread_squares(xm, k));
        if (lane == 0) squares[warp] = ss;
        __syncthreads();
        inv = inv_rms_of(squares, k, eps);
    }
    auto value = [&](int i) {
        float v = scale ? xm[i] * inv * scale[i] : xm[i];
        return round_in ? round_bf16(v) : v;
    };
    float most = 0.0f;
    for (int i = threadIdx.x; i < k; i += 256) most = fmaxf(most, fabsf(value(i)));
    most = block_reduce(most, 0.0f, Max());
    float s = most > 0.0f ? most / 32767.0f : 1.0f, r = 1.0f / s;
    int groups = k / 8, per = (groups + BLOCK_INPUT_PARTS - 1) / BLOCK_INPUT_PARTS, end = min(groups, (part + 1) * per);
    for (int g = part * per + threadIdx.x; g < end; g += 256) {
        int sum = 0;
        u32 packed[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int a = __float2int_rn(value(8 * g + 2 * j) * r), b = __float2int_rn(value(8 * g + 2 * j + 1) * r);
            sum += a + b;
            packed[j] = ((u32)a & 0xffffu) | ((u32)b << 16);
        }
        ((uint4*)(q + (size_t)m * k / 2))[g] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        sums[(size_t)m * groups + g] = (u32)sum;
    }
    if (part == 0 && threadIdx.x == 0) sums[(size_t)t * groups + m] = __float_as_uint(s);
}

#define BLOCK_KERNELS(SUFFIX, F)                                                                                                \
    extern "C" __global__ void dequantize_rows_##SUFFIX(const unsigned char* w, float* out, bf16_t* out_bf16, int n, int k) {    \
        dequantize_rows_body<F>(w, out, out_bf16, n, k);                                                                       \
    }                                                                                                                          \
    extern "C" __global__ void embed_blocks_##SUFFIX(const unsigned char* table, const u32* ids, float* x, int h) {             \
        embed_blocks_body<F>(table, ids, x, h);                                                                                \
    }
BLOCK_KERNELS(q4_0, BLOCK_Q4_0)
BLOCK_KERNELS(q8_0, BLOCK_Q8_0)
BLOCK_KERNELS(q4_k, BLOCK_Q4_K)
BLOCK_KERNELS(q5_k, BLOCK_Q5_K)
BLOCK_KERNELS(q6_k, BLOCK_Q6_K)
