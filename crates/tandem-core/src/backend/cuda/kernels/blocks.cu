// GGML's block formats on the GPU (model/blocks.rs: the formats; backend/cuda/blocks.rs: how a
// matrix is laid out here). A row is k / E blocks. Q4_K (144 bytes) and Q5_K (176) keep the
// file's layout, their blocks whole 16-byte units; the others, whose blocks are not (Q4_0 18,
// Q8_0 34, Q6_K 210), are split: each row holds its blocks without their f16 scale `d` (16, 32,
// 208 bytes: 16-byte units), then the row's k / E scales, then zeros to a multiple of 16 bytes,
// so that every load is aligned.
//
// A GEMV lane reads a row a unit at a time (`BlockChunk<F>`: 64 values for Q4_K and Q5_K, a pair
// of runs that share their scales' bytes; 32 for the others) and does not dequantize: it
// multiplies the unit's integers (before their run's scale) by the token's inputs rounded to
// 16-bit integers (`block_input`: q = v / s rounded, s = max |v| / 32767, as the CPU engine's
// block GEMV rounds them), two products an instruction (`__dp2a_lo`/`_hi`: two 16-bit inputs
// times two bytes, added to a 32-bit sum), so that each run's sum is exact; then scales it by
// the run's d · scale in f32 and adds its minimum times the sum of the run's inputs
// (`block_input` writes those sums, and lays the integers out in the order the lanes read
// them). That is about half an instruction a value, against four for dequantizing into f32 (an
// integer made a float, the scale's fused multiply-add, the product), which held an H200 to
// 10-15% of its bandwidth. The dequantize and embed kernels compute each value as the CPU's
// plain dequantizer does (a product, then a difference), bit for bit.

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
// The products of one word of weights' bytes with the two halves of a piece's 8 inputs.
__device__ __forceinline__ int dot4_lo(u32 w, uint4 x, int acc) { return dot4(w, x.x, x.y, acc); }
__device__ __forceinline__ int dot4_hi(u32 w, uint4 x, int acc) { return dot4(w, x.z, x.w, acc); }

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

// The scales and minimums of runs 2 u and 2 u + 1 (u = 0..4) of a k-quant, as scale_min_k4 finds
// them, two at a time: each 16 bits of S (scales) and M (minimums) hold the pair's two bytes.
__device__ __forceinline__ void scale_min_k4_pair(int u, u32 q0, u32 q1, u32 q2, float& sc0, float& m0, float& sc1, float& m1) {
    u32 h = 16 * (u & 1);
    u32 s = u < 2 ? (q0 >> h) & 0x3f3fu : ((q2 >> h) & 0x0f0fu) | ((q0 >> (h + 2)) & 0x3030u);
    u32 m = u < 2 ? (q1 >> h) & 0x3f3fu : ((q2 >> (h + 4)) & 0x0f0fu) | ((q1 >> (h + 2)) & 0x3030u);
    sc0 = (float)(s & 0xffu);
    sc1 = (float)(s >> 8);
    m0 = (float)(m & 0xffu);
    m1 = (float)(m >> 8);
}

// What a GEMV lane reads at a time: a unit of a row's values (U of them, in the block
// `unit / (E / U)`), loaded by `load` (before the kernel waits for its input) and multiplied by
// a few tokens' inputs by `dot`. A unit's inputs are P = U / 8 pieces of 8 (`piece_start`: the
// first value of each), and `dot` takes NS sums of them (each over P / NS consecutive pieces).
//
// The inputs, as block_input writes them for the GEMV of one format, are in the order the lanes
// read them: token m's piece p of unit u at q[m * (k / 8) + p * units + u] (8 16-bit integers,
// 16 bytes), its sum s at sums[m * (k / 8) + s * units + u], so that the lanes of a warp, which
// take consecutive units, read consecutive 16 bytes. (In the row's own order one lane's inputs
// were 64 bytes from the next lane's, each load touching four times the cache lines; reading
// them in the lanes' order took the 9B's Q4_K GEMVs on an H200, scripts/bench-block-gemv.sh,
// from 24.7 to 18.7 µs for the DeltaNet input projection and from 44.4 to 30.4 µs for gate and
// up; a lane's unit of two runs rather than one, their scales decoded once, then took them to
// 15.4 and 24.9 µs.)
template <int F> struct BlockChunk;

// Q4_K / Q5_K unit u (0..4 of a block): runs 2 u and 2 u + 1, which share their scales' bytes
// and 32 bytes of the quants (byte i: value i of the first run in its low nibble, of the second
// in its high one); Q5_K's fifth bits from all 32 bytes of qh (bits 2 u and 2 u + 1).
template <int F>
struct KQuantChunk {
    static constexpr int U = 64, NS = 2, PRE = 2;
    struct Raw {
        uint4 head, qa, qb, ha, hb;
    };
    __device__ static int piece_start(int u, int p) { return 64 * u + 8 * p; }
    __device__ static Raw load(const unsigned char* row, int k, int u) {
        const unsigned char* blk = row + (size_t)(u / 4) * BlockShape<F>::BODY;
        const unsigned char* qs = blk + (F == BLOCK_Q5_K ? 48 : 16) + 32 * (u % 4);
        Raw r;
        r.head = *(const uint4*)blk;
        r.qa = *(const uint4*)qs;
        r.qb = *(const uint4*)(qs + 16);
        if (F == BLOCK_Q5_K) {
            r.ha = *(const uint4*)(blk + 16);
            r.hb = *(const uint4*)(blk + 32);
        }
        return r;
    }
    // The unit's two runs' scales times d (dl, dh) and minimums times -dmin (ml, mh).
    __device__ static void scales(const Raw& r, int run, float& dl, float& ml, float& dh, float& mh) {
        float d = f16_bits_to_f32(r.head.x & 0xffffu), dmin = f16_bits_to_f32(r.head.x >> 16);
        float sc0, m0, sc1, m1;
        scale_min_k4_pair(run, r.head.y, r.head.z, r.head.w, sc0, m0, sc1, m1);
        dl = d * sc0; ml = -(dmin * m0); dh = d * sc1; mh = -(dmin * m1);
    }
    // The unit's integers, four bytes a word: word w of la holds values 4 w .. 4 w + 3 of the
    // first run, of lb values 16 + 4 w .. 16 + 4 w + 3 (the low nibbles of the unit's first and
    // second 16 bytes); ua and ub the same of the second run (the high nibbles); Q5_K's fifth
    // bits added.
    __device__ static void integers(const Raw& r, int run, u32* la, u32* lb, u32* ua, u32* ub) {
        u32 qa[4] = {r.qa.x, r.qa.y, r.qa.z, r.qa.w}, qb[4] = {r.qb.x, r.qb.y, r.qb.z, r.qb.w};
        u32 ha[4] = {r.ha.x, r.ha.y, r.ha.z, r.ha.w}, hb[4] = {r.hb.x, r.hb.y, r.hb.z, r.hb.w};
#pragma unroll
        for (int w = 0; w < 4; w++) {
            la[w] = qa[w] & 0x0f0f0f0fu;
            lb[w] = qb[w] & 0x0f0f0f0fu;
            ua[w] = (qa[w] >> 4) & 0x0f0f0f0fu;
            ub[w] = (qb[w] >> 4) & 0x0f0f0f0fu;
            if (F == BLOCK_Q5_K) {
                la[w] |= ((ha[w] >> (2 * run)) & 0x01010101u) << 4;
                lb[w] |= ((hb[w] >> (2 * run)) & 0x01010101u) << 4;
                ua[w] |= ((ha[w] >> (2 * run + 1)) & 0x01010101u) << 4;
                ub[w] |= ((hb[w] >> (2 * run + 1)) & 0x01010101u) << 4;
            }
        }
    }
    // acc[m] += the unit's values · token m's integer inputs q (block_input's, before their
    // scale: BlockRows applies it to the row's sum), from the inputs' sums. Each run's products are summed in integers, exactly
    // (Q4_K: 32 · 15 · 32767 < 2^24, so its conversion to f32 is exact too; Q5_K's values go
    // to 31, so its runs are summed in halves of 16).
    template <int T>
    __device__ static void dot(const Raw& r, int u, const uint4* q, const int* sums, int k, int t, float* acc) {
        int run = u % 4, units = k / U, stride = k / 8;
        float dl, ml, dh, mh;
        scales(r, run, dl, ml, dh, mh);
        u32 la[4], lb[4], ua[4], ub[4];
        integers(r, run, la, lb, ua, ub);
#pragma unroll
        for (int m = 0; m < T; m++) {
            if (m < t) {
                const uint4* x = q + (size_t)m * stride + u;
                uint4 p[8];
#pragma unroll
                for (int i = 0; i < 8; i++) p[i] = x[(size_t)i * units];
                int la0 = 0, lb0 = 0, ua0 = 0, ub0 = 0;
#pragma unroll
                for (int w = 0; w < 4; w++) {
                    la0 = w % 2 ? dot4_hi(la[w], p[w / 2], la0) : dot4_lo(la[w], p[w / 2], la0);
                    lb0 = w % 2 ? dot4_hi(lb[w], p[2 + w / 2], lb0) : dot4_lo(lb[w], p[2 + w / 2], lb0);
                    ua0 = w % 2 ? dot4_hi(ua[w], p[4 + w / 2], ua0) : dot4_lo(ua[w], p[4 + w / 2], ua0);
                    ub0 = w % 2 ? dot4_hi(ub[w], p[6 + w / 2], ub0) : dot4_lo(ub[w], p[6 + w / 2], ub0);
                }
                const int* s = sums + (size_t)m * stride + u;
                float lo = F == BLOCK_Q5_K ? (float)la0 + (float)lb0 : (float)(la0 + lb0);
                float hi = F == BLOCK_Q5_K ? (float)ua0 + (float)ub0 : (float)(ua0 + ub0);
                float part = fmaf(dl, lo, fmaf(dh, hi, fmaf(ml, (float)s[0], mh * (float)s[units])));
                acc[m] += part;
            }
        }
    }
};
template <> struct BlockChunk<BLOCK_Q4_K> : KQuantChunk<BLOCK_Q4_K> {};
template <> struct BlockChunk<BLOCK_Q5_K> : KQuantChunk<BLOCK_Q5_K> {};

// Q6_K unit c (0..8 of a block, 32 values): half c / 4 of the block, the 8 columns
// l0 = 8 (c % 4) .. + 8 of each of its four parts (piece p: values 128 half + 32 p + l0 ..;
// dequantize_block).
template <>
struct BlockChunk<BLOCK_Q6_K> {
    static constexpr int U = 32, NS = 4, PRE = 4;
    struct Raw {
        uint4 a, b, c;
        float d;
    };
    __device__ static int piece_start(int c, int p) { return 256 * (c / 8) + 128 * ((c % 8) / 4) + 32 * p + 8 * (c % 4); }
    __device__ static Raw load(const unsigned char* row, int k, int c) {
        int b = c / 8, j = c % 8, half = j / 4, l0 = 8 * (j % 4);
        const unsigned char* blk = row + (size_t)b * 208;
        uint2 qa = *(const uint2*)(blk + 64 * half + l0), qb = *(const uint2*)(blk + 64 * half + 32 + l0), qh = *(const uint2*)(blk + 128 + 32 * half + l0);
        Raw r;
        r.a = make_uint4(qa.x, qa.y, qb.x, qb.y);
        r.b = make_uint4(qh.x, qh.y, 0, 0);
        r.c = *(const uint4*)(blk + 192);
        r.d = block_d<BLOCK_Q6_K>(row, k, b);
        return r;
    }
    // Part p's 8 integers (0..63, the format's 32 not yet subtracted), two words of four bytes,
    // and its scale times d.
    __device__ static void integers(const Raw& r, int c, u32 (*wq)[2], float* ds) {
        int j = c % 8, half = j / 4, l0 = 8 * (j % 4);
        u32 sc[4] = {r.c.x, r.c.y, r.c.z, r.c.w};
        u32 qa[2] = {r.a.x, r.a.y}, qb[2] = {r.a.z, r.a.w}, qh[2] = {r.b.x, r.b.y};
#pragma unroll
        for (int p = 0; p < 4; p++) {
            int s = 8 * half + 2 * p + l0 / 16;
            ds[p] = r.d * (float)(signed char)((sc[s / 4] >> (8 * (s % 4))) & 0xffu);
#pragma unroll
            for (int w = 0; w < 2; w++) wq[p][w] = (((p % 2 == 0 ? qa[w] : qb[w]) >> (p < 2 ? 0 : 4)) & 0x0f0f0f0fu) | (((qh[w] >> (2 * p)) & 0x03030303u) << 4);
        }
    }
    template <int T>
    __device__ static void dot(const Raw& r, int c, const uint4* q, const int* sums, int k, int t, float* acc) {
        int units = k / U, stride = k / 8;
        u32 wq[4][2];
        float ds[4];
        integers(r, c, wq, ds);
#pragma unroll
        for (int m = 0; m < T; m++) {
            if (m < t) {
                float part = 0.0f;
#pragma unroll
                for (int p = 0; p < 4; p++) {
                    uint4 x = q[(size_t)m * stride + (size_t)p * units + c];
                    int i = dot4_hi(wq[p][1], x, dot4_lo(wq[p][0], x, 0)) - 32 * sums[(size_t)m * stride + (size_t)p * units + c];
                    part = fmaf(ds[p], (float)i, part);
                }
                acc[m] += part;
            }
        }
    }
};

// Q8_0 and Q4_0: a unit is a block (32 values; Q4_0's low nibbles the first 16, its high ones
// the next 16).
template <>
struct BlockChunk<BLOCK_Q8_0> {
    static constexpr int U = 32, NS = 0, PRE = 4;
    struct Raw {
        uint4 a, b;
        float d;
    };
    __device__ static int piece_start(int c, int p) { return 32 * c + 8 * p; }
    __device__ static Raw load(const unsigned char* row, int k, int c) {
        const uint4* q = (const uint4*)(row + (size_t)c * 32);
        Raw r;
        r.a = q[0];
        r.b = q[1];
        r.d = block_d<BLOCK_Q8_0>(row, k, c);
        return r;
    }
    template <int T>
    __device__ static void dot(const Raw& r, int c, const uint4* q, const int*, int k, int t, float* acc) {
        u32 w[8] = {r.a.x, r.a.y, r.a.z, r.a.w, r.b.x, r.b.y, r.b.z, r.b.w};
        int units = k / U, stride = k / 8;
#pragma unroll
        for (int m = 0; m < T; m++) {
            if (m < t) {
                int i = 0;
#pragma unroll
                for (int v = 0; v < 4; v++) {
                    uint4 xv = q[(size_t)m * stride + (size_t)v * units + c];
                    i = dot4_hi(w[2 * v + 1], xv, dot4_lo(w[2 * v], xv, i));
                }
                acc[m] = fmaf(r.d, (float)i, acc[m]);
            }
        }
    }
};
template <>
struct BlockChunk<BLOCK_Q4_0> {
    static constexpr int U = 32, NS = 1, PRE = 4;
    struct Raw {
        uint4 a;
        float d;
    };
    __device__ static int piece_start(int c, int p) { return 32 * c + 8 * p; }
    __device__ static Raw load(const unsigned char* row, int k, int c) {
        Raw r;
        r.a = *(const uint4*)(row + (size_t)c * 16);
        r.d = block_d<BLOCK_Q4_0>(row, k, c);
        return r;
    }
    template <int T>
    __device__ static void dot(const Raw& r, int c, const uint4* q, const int* sums, int k, int t, float* acc) {
        u32 qw[4] = {r.a.x, r.a.y, r.a.z, r.a.w}, lo[4], hi[4];
        int units = k / U, stride = k / 8;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            lo[w] = qw[w] & 0x0f0f0f0fu;
            hi[w] = (qw[w] >> 4) & 0x0f0f0f0fu;
        }
#pragma unroll
        for (int m = 0; m < T; m++) {
            if (m < t) {
                const uint4* x = q + (size_t)m * stride + c;
                uint4 a0 = x[0], a1 = x[units], b0 = x[2 * units], b1 = x[3 * units];
                int i = dot4_hi(lo[3], a1, dot4_lo(lo[2], a1, dot4_hi(lo[1], a0, dot4_lo(lo[0], a0, 0))));
                i = dot4_hi(hi[3], b1, dot4_lo(hi[2], b1, dot4_hi(hi[1], b0, dot4_lo(hi[0], b0, i))));
                acc[m] = fmaf(r.d, (float)(i - 8 * sums[(size_t)m * stride + c]), acc[m]);
            }
        }
    }
};

// The k-quants against int8 inputs (GPU precision=fast, as the CPU engine's precision=fast
// multiplies them: backend/cpu/kernels/matmul/blocks_a8.rs). The token's inputs are quantized
// per 256 values as int8_dot.rs quantize_block does it (s = max |v| / 127, q = v / s rounded to
// nearest, ties to even; a block holding a NaN or an infinity: s = NaN, q = 0; all zeros: s = 0):
// block_input8 writes them in the order the lanes read them, with the sums of the integers the
// format needs (a Q4_K / Q5_K run's 32, a Q6_K piece's 8) and each 256 values' s. A unit's
// products are four an instruction (__dp4a: four bytes of weights times four int8 inputs, added
// to a 32-bit sum), half the instructions and half the input bytes of the 16-bit inputs above;
// every run's sum is an exact integer (32 · 31 · 127 < 2^24), scaled in f32 by the run's
// d · scale and the block's s.
//
// Token m's inputs: piece p (PB = U / 4 bytes) of unit u at byte m · k + (p · units + u) · PB;
// its sum j at sums[m · (k / 8) + j · units + u]; the s of its 256 values b at
// scales[m · (k / 256) + b], scales = sums + t · (k / 8) as floats.
template <int F> struct BlockChunk8;

template <int F>
struct KQuantChunk8 {
    // R: rows a GEMV warp takes at once, sharing its lanes' inputs (bench-block-gemv.sh: one was
    // fastest for Q4_K, two for Q6_K, whose units read more inputs per byte of weights).
    static constexpr int U = 64, NS = 2, PB = 16, PRE = 2, R = 1;
    typedef typename KQuantChunk<F>::Raw Raw;
    // A unit's inputs for one token: its four pieces of 16 (pieces 0, 1 the first run, 2, 3 the
    // second), the two runs' sums and the block's s.
    struct In {
        uint4 p[4];
        int s0, s1;
        float s;
    };
    __device__ static int piece_start(int u, int p) { return 64 * u + 16 * p; }
    __device__ static Raw load(const unsigned char* row, int k, int u) { return KQuantChunk<F>::load(row, k, u); }
    __device__ static In inputs(const unsigned char* q, const int* sums, const float* scales, int u, int k, int m) {
        int units = k / U;
        const uint4* x = (const uint4*)(q + (size_t)m * k) + u;
        const int* s = sums + (size_t)m * (k / 8) + u;
        In in;
#pragma unroll
        for (int p = 0; p < 4; p++) in.p[p] = x[(size_t)p * units];
        in.s0 = s[0];
        in.s1 = s[units];
        in.s = scales[(size_t)m * (k / 256) + u / 4];
        return in;
    }
    // A unit's weights as the products take them (decoded once for all of a step's tokens).
    struct Dec {
        float dl, ml, dh, mh;
        u32 la[4], lb[4], ua[4], ub[4];
    };
    __device__ static Dec decode(const Raw& r, int u) {
        Dec w;
        KQuantChunk<F>::scales(r, u % 4, w.dl, w.ml, w.dh, w.mh);
        KQuantChunk<F>::integers(r, u % 4, w.la, w.lb, w.ua, w.ub);
        return w;
    }
    // The unit's values · one token's inputs.
    __device__ static float dot(const Dec& w, const In& in) {
        u32 x0[4] = {in.p[0].x, in.p[0].y, in.p[0].z, in.p[0].w}, x1[4] = {in.p[1].x, in.p[1].y, in.p[1].z, in.p[1].w};
        u32 x2[4] = {in.p[2].x, in.p[2].y, in.p[2].z, in.p[2].w}, x3[4] = {in.p[3].x, in.p[3].y, in.p[3].z, in.p[3].w};
        int lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo = __dp4a((int)w.la[i], (int)x0[i], __dp4a((int)w.lb[i], (int)x1[i], lo));
            hi = __dp4a((int)w.ua[i], (int)x2[i], __dp4a((int)w.ub[i], (int)x3[i], hi));
        }
        return in.s * fmaf(w.dl, (float)lo, fmaf(w.dh, (float)hi, fmaf(w.ml, (float)in.s0, w.mh * (float)in.s1)));
    }
};
template <> struct BlockChunk8<BLOCK_Q4_K> : KQuantChunk8<BLOCK_Q4_K> {};
template <> struct BlockChunk8<BLOCK_Q5_K> : KQuantChunk8<BLOCK_Q5_K> {};

template <>
struct BlockChunk8<BLOCK_Q6_K> {
    typedef BlockChunk<BLOCK_Q6_K> C16;
    static constexpr int U = 32, NS = 4, PB = 8, PRE = 4, R = 2;
    typedef C16::Raw Raw;
    // A unit's inputs for one token: its four pieces of 8 (one per part), their sums, the
    // block's s.
    struct In {
        uint2 p[4];
        int s[4];
        float s256;
    };
    __device__ static int piece_start(int c, int p) { return C16::piece_start(c, p); }
    __device__ static Raw load(const unsigned char* row, int k, int c) { return C16::load(row, k, c); }
    __device__ static In inputs(const unsigned char* q, const int* sums, const float* scales, int c, int k, int m) {
        int units = k / U;
        const uint2* x = (const uint2*)(q + (size_t)m * k) + c;
        const int* s = sums + (size_t)m * (k / 8) + c;
        In in;
#pragma unroll
        for (int p = 0; p < 4; p++) {
            in.p[p] = x[(size_t)p * units];
            in.s[p] = s[(size_t)p * units];
        }
        in.s256 = scales[(size_t)m * (k / 256) + c / 8];
        return in;
    }
    struct Dec {
        u32 wq[4][2];
        float ds[4];
    };
    __device__ static Dec decode(const Raw& r, int c) {
        Dec w;
        C16::integers(r, c, w.wq, w.ds);
        return w;
    }
    __device__ static float dot(const Dec& w, const In& in) {
        float part = 0.0f;
#pragma unroll
        for (int p = 0; p < 4; p++) {
            int i = __dp4a((int)w.wq[p][1], (int)in.p[p].y, __dp4a((int)w.wq[p][0], (int)in.p[p].x, 0)) - 32 * in.s[p];
            part = fmaf(w.ds[p], (float)i, part);
        }
        return in.s256 * part;
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

// The inputs of a block GEMV of format `format` (gemv.cu BlockRows): row m of x (t rows),
// normalised where `scale` is not null (rms_norm(x) * scale, the 1/rms found as rms_inv finds
// it) and rounded to bf16 with `round_in` (what the bf16 GEMV multiplies), as 16-bit integers
// q ≈ v / s, s = max |v| / 32767 (rounded to nearest, ties to even: the CPU engine's
// round_to_i16), in the order the format's GEMV lanes read them (BlockChunk), with the sums its
// units need; s (as a float's bits) into sums[t * (k / 8) + m]. k a multiple of the format's
// unit. BLOCK_INPUT_PARTS blocks per row (grid t * BLOCK_INPUT_PARTS), each finding the row's
// 1/rms and largest value and writing its share of the units: a decode step's GEMV waits on
// this, so it is spread over SMs (on an H200 a 9B decode step ran 4% faster than with one
// block per row holding its values in registers).
#define BLOCK_INPUT_PARTS 8
// The 1/rms of row xm (k values; 1 where scale is null: the inputs are not normalised), found
// by the whole block.
__device__ float block_input_inv_rms(const float* xm, const float* scale, int k, float eps) {
    __shared__ float squares[8];
    if (!scale) return 1.0f;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float ss = warp_sum(thread_squares(xm, k));
    if (lane == 0) squares[warp] = ss;
    __syncthreads();
    return inv_rms_of(squares, k, eps);
}
// Input value i as the products take it: normalised where scale is not null, rounded to bf16
// with round_in.
__device__ __forceinline__ float block_input_value(const float* xm, const float* scale, float inv, int round_in, int i) {
    float v = scale ? xm[i] * inv * scale[i] : xm[i];
    return round_in ? round_bf16(v) : v;
}
template <int F>
__device__ void block_input_body(const float* x, const float* scale, int k, float eps, int round_in, unsigned* q, unsigned* sums) {
    typedef BlockChunk<F> C;
    constexpr int P = C::U / 8;
    int m = blockIdx.x / BLOCK_INPUT_PARTS, part = blockIdx.x % BLOCK_INPUT_PARTS, t = gridDim.x / BLOCK_INPUT_PARTS;
    const float* xm = x + (size_t)m * k;
    float inv = block_input_inv_rms(xm, scale, k, eps);
    auto value = [&](int i) { return block_input_value(xm, scale, inv, round_in, i); };
    float most = 0.0f;
    for (int i = threadIdx.x; i < k; i += 256) most = fmaxf(most, fabsf(value(i)));
    most = block_reduce(most, 0.0f, Max());
    float s = most > 0.0f ? most / 32767.0f : 1.0f, r = 1.0f / s;
    // A thread per piece, the P pieces of a unit in consecutive lanes (256 a multiple of P),
    // each sum over G of them added across their lanes.
    constexpr int G = C::NS > 0 ? P / C::NS : 1;
    int units = k / C::U, stride = k / 8, per = (units + BLOCK_INPUT_PARTS - 1) / BLOCK_INPUT_PARTS;
    int first = part * per * P, end = min(units, (part + 1) * per) * P;
    uint4* qm = (uint4*)q + (size_t)m * stride;
    unsigned* sm = sums + (size_t)m * stride;
    for (int base = first; base < end; base += 256) {
        int g = base + threadIdx.x, u = g / P, p = g % P, sum = 0;
        bool live = g < end;
        if (live) {
            int at = C::piece_start(u, p);
            u32 packed[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int a = __float2int_rn(value(at + 2 * j) * r), b = __float2int_rn(value(at + 2 * j + 1) * r);
                sum += a + b;
                packed[j] = ((u32)a & 0xffffu) | ((u32)b << 16);
            }
            qm[(size_t)p * units + u] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        }
#pragma unroll
        for (int o = 1; o < G; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (C::NS > 0 && live && p % G == 0) sm[(size_t)(p / G) * units + u] = (u32)sum;
    }
    if (part == 0 && threadIdx.x == 0) sums[(size_t)t * stride + m] = __float_as_uint(s);
}
extern "C" __global__ void __launch_bounds__(256) block_input(const float* x, const float* scale, int k, float eps, int round_in, int format, unsigned* q, unsigned* sums) {
    pdl_enter();
    switch (format) {
    case BLOCK_Q4_0: block_input_body<BLOCK_Q4_0>(x, scale, k, eps, round_in, q, sums); break;
    case BLOCK_Q8_0: block_input_body<BLOCK_Q8_0>(x, scale, k, eps, round_in, q, sums); break;
    case BLOCK_Q4_K: block_input_body<BLOCK_Q4_K>(x, scale, k, eps, round_in, q, sums); break;
    case BLOCK_Q5_K: block_input_body<BLOCK_Q5_K>(x, scale, k, eps, round_in, q, sums); break;
    default: block_input_body<BLOCK_Q6_K>(x, scale, k, eps, round_in, q, sums); break;
    }
}

// The int8 inputs of a k-quant GEMV (BlockChunk8): row m of x normalised and rounded as
// block_input does it, quantized per 256 values (the CPU's quantize_block), in the lanes'
// order, with the sums and scales BlockChunk8 reads. A thread per piece, the pieces of 256
// values in consecutive lanes (16 or 32: their largest |v| found across them); each of the
// BLOCK_INPUT_PARTS blocks of a row takes its share of the 256s.
template <int F>
__device__ void block_input8_body(const float* x, const float* scale, int k, float eps, int round_in, unsigned char* q, unsigned* sums) {
    typedef BlockChunk8<F> C;
    constexpr int P = 4, PB = C::PB, G = 256 / PB, SG = P / C::NS;
    int m = blockIdx.x / BLOCK_INPUT_PARTS, part = blockIdx.x % BLOCK_INPUT_PARTS, t = gridDim.x / BLOCK_INPUT_PARTS;
    const float* xm = x + (size_t)m * k;
    float inv = block_input_inv_rms(xm, scale, k, eps);
    int nb = k / 256, units = k / C::U, stride = k / 8, per = (nb + BLOCK_INPUT_PARTS - 1) / BLOCK_INPUT_PARTS;
    int first = part * per * G, end = min(nb, (part + 1) * per) * G;
    unsigned char* qm = q + (size_t)m * k;
    unsigned* sm = sums + (size_t)m * stride;
    float* scales = (float*)sums + (size_t)t * stride + (size_t)m * nb;
    for (int base = first; base < end; base += 256) {
        int g = base + threadIdx.x, u = g / P, p = g % P;
        bool live = g < end;
        float v[PB], most = 0.0f;
        bool bad = false;
        if (live) {
            int at = C::piece_start(u, p);
#pragma unroll
            for (int j = 0; j < PB; j++) {
                v[j] = block_input_value(xm, scale, inv, round_in, at + j);
                most = fmaxf(most, fabsf(v[j]));
                bad |= v[j] != v[j];
            }
        }
        // The 256 values' largest |v| and whether one is NaN, across their G lanes.
#pragma unroll
        for (int o = 1; o < G; o <<= 1) {
            most = fmaxf(most, __shfl_xor_sync(0xffffffffu, most, o));
            bad |= __shfl_xor_sync(0xffffffffu, (int)bad, o) != 0;
        }
        bad |= most - most != 0.0f;  // an infinity
        float s = bad ? __int_as_float(0x7fc00000) : most / 127.0f;
        int sum = 0;
        if (live) {
            u32 packed[PB / 4];
#pragma unroll
            for (int w = 0; w < PB / 4; w++) {
                u32 word = 0;
#pragma unroll
                for (int b = 0; b < 4; b++) {
                    int i = bad || most == 0.0f ? 0 : max(-127, min(127, __float2int_rn(__fdiv_rn(v[4 * w + b], s))));
                    sum += i;
                    word |= ((u32)i & 0xffu) << (8 * b);
                }
                packed[w] = word;
            }
            unsigned char* dst = qm + ((size_t)p * units + u) * PB;
            if (PB == 16) *(uint4*)dst = make_uint4(packed[0], packed[1], packed[2], packed[3 % (PB / 4)]);
            else *(uint2*)dst = make_uint2(packed[0], packed[1 % (PB / 4)]);
        }
#pragma unroll
        for (int o = 1; o < SG; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (live && p % SG == 0) sm[(size_t)(p / SG) * units + u] = (u32)sum;
        if (live && g % G == 0) scales[g / G] = s;
    }
}
extern "C" __global__ void __launch_bounds__(256) block_input8(const float* x, const float* scale, int k, float eps, int round_in, int format, unsigned char* q, unsigned* sums) {
    pdl_enter();
    switch (format) {
    case BLOCK_Q4_K: block_input8_body<BLOCK_Q4_K>(x, scale, k, eps, round_in, q, sums); break;
    case BLOCK_Q5_K: block_input8_body<BLOCK_Q5_K>(x, scale, k, eps, round_in, q, sums); break;
    default: block_input8_body<BLOCK_Q6_K>(x, scale, k, eps, round_in, q, sums); break;
    }
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
