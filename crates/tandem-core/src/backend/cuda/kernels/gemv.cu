// The decode GEMVs: products of a few tokens with the weights, read once per step.

// The decode GEMV: out_j[m, r] (+)= in(x)[m, :] . W_j[r, :] for t <= T tokens (T = 1, 2, 4, 8) and
// up to four matrices of the same input in one launch (a layer's input projections). What the
// weights are multiplied with (MODE):
//   IN_PLAIN  x itself;
//   IN_NORM   rms_norm(x) * scale (x2 = scale), the block's input RMSNorm (backend/cpu/forward.rs)
//             computed on the fly: x * scale in the products, times the 1 / rms of each row,
//             from `rms_inv` (the rms_inv kernel) or, where that is null, found by each block
//             itself (from L2, while its weight loads are in flight: a launch fewer, but every
//             block reads the whole rows; backend/cuda/qwen35.rs gemv chooses by the row length).
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
// With `round_in` (tensor-core precision) the GEMV multiplies what a tensor-core GEMM of the same
// rows would: each input value rounded to bf16 (with IN_NORM, rms_norm(x) * scale rounded, so
// the 1/rms is found before the products), and with GLU gate and up rounded to bf16 before the
// SwiGLU (as the GEMM writes them). A sequence then gets the same products whether its step
// takes the GEMV or, in a larger batch, the GEMM; only the order of the sums differs.
#define IN_PLAIN 0
#define IN_NORM 1

// Four input values as the products take them: x, or x * scale (IN_NORM; the 1/rms applied to
// the sums), or with `round_in` (x * 1/rms) * scale as rms_norm computes it (IN_NORM) or x,
// rounded to bf16.
template <int MODE>
__device__ __forceinline__ float4 gemv_input(float4 v, float4 s, float inv, int round_in) {
    if (MODE == IN_NORM && round_in) v = make_float4(v.x * inv * s.x, v.y * inv * s.y, v.z * inv * s.z, v.w * inv * s.w);
    else if (MODE == IN_NORM) v = make_float4(v.x * s.x, v.y * s.y, v.z * s.z, v.w * s.w);
    if (round_in) v = make_float4(round_bf16(v.x), round_bf16(v.y), round_bf16(v.z), round_bf16(v.w));
    return v;
}

template <int T, int MODE>
__device__ __forceinline__ void gemv_chunk(uint4 p, const float* x, const float* x2, const float* inv, int round_in, int k, int t, int c, float* acc) {
    float wv[8];
    wv[0] = __uint_as_float(p.x << 16); wv[1] = __uint_as_float(p.x & 0xffff0000u);
    wv[2] = __uint_as_float(p.y << 16); wv[3] = __uint_as_float(p.y & 0xffff0000u);
    wv[4] = __uint_as_float(p.z << 16); wv[5] = __uint_as_float(p.z & 0xffff0000u);
    wv[6] = __uint_as_float(p.w << 16); wv[7] = __uint_as_float(p.w & 0xffff0000u);
    float4 s0 = make_float4(1, 1, 1, 1), s1 = s0;
    if (MODE == IN_NORM) {
        const float4* sp = (const float4*)(x2 + c * 8);
        s0 = sp[0]; s1 = sp[1];
    }
#pragma unroll
    for (int m = 0; m < T; m++) {
        if (m < t) {
            const float4* xp = (const float4*)(x + (size_t)m * k + c * 8);
            float r = MODE == IN_NORM && round_in ? inv[m] : 1.0f;
            float4 a = gemv_input<MODE>(xp[0], s0, r, round_in), b = gemv_input<MODE>(xp[1], s1, r, round_in);
            acc[m] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w + wv[4] * b.x + wv[5] * b.y + wv[6] * b.z + wv[7] * b.w;
        }
    }
}

// The weights a GEMV reads, chunk by chunk (a lane's share of a row at a time): bf16 rows,
// 8 values a chunk (one 16-byte load), or rows of GGML blocks (blocks.cu), 32 values a chunk.
// `PRE`: chunks a lane loads before the kernel waits for its input.
struct Bf16Rows {
    typedef bf16_t Elem;
    typedef uint4 Raw;
    static constexpr int VALUES = 8, PRE = 4;
    __device__ static const Elem* row(const Elem* w, int r, int k) { return w + (size_t)r * k; }
    __device__ static Raw load(const Elem* row, int k, int c) { return ((const uint4*)row)[c]; }
    template <int T, int MODE>
    __device__ static void dot(const Raw& p, const Elem*, int c, const float* x, const float* x2, const float* inv, int round_in, int k, int t, float* acc) {
        gemv_chunk<T, MODE>(p, x, x2, inv, round_in, k, t, c, acc);
    }
    template <int T>
    __device__ static void finish(const float*, int, int, float*) {}
};

// Rows of blocks of format F: each unit's integers (BlockChunk<F>, a unit of 32 or 64 values a
// lane) times the inputs as block_input (blocks.cu) rounds them to integers: `x` holds those,
// `x2` the sums the format needs and the scales; the input modes are block_input's (IN_PLAIN
// here). A lane has PRE units in flight before its first products (Q4_K: 2, a row of 4096 with
// a warp per row; more measured slower on an H200).
template <int F>
struct BlockRows {
    typedef unsigned char Elem;
    typedef typename BlockChunk<F>::Raw Raw;
    static constexpr int VALUES = BlockChunk<F>::U, PRE = BlockChunk<F>::PRE;
    __device__ static const Elem* row(const Elem* w, int r, int k) { return w + (size_t)r * block_row_bytes<F>(k); }
    __device__ static Raw load(const Elem* row, int k, int c) { return BlockChunk<F>::load(row, k, c); }
    template <int T, int MODE>
    __device__ static void dot(const Raw& p, const Elem*, int c, const float* x, const float* x2, const float*, int, int k, int t, float* acc) {
        BlockChunk<F>::template dot<T>(p, c, (const uint4*)x, (const int*)x2, k, t, acc);
    }
    // A lane's sums times the inputs' scales (after the sums of blocks' scales times integers).
    template <int T>
    __device__ static void finish(const float* x2, int k, int t, float* acc) {
        const float* scales = x2 + (size_t)t * (k / 8);
#pragma unroll
        for (int m = 0; m < T; m++)
            if (m < t) acc[m] *= scales[m];
    }
};

template <class W, int T, int MODE, bool GLU>
__device__ void gemv_body(const typename W::Elem* w0, float* o0, int n0, const typename W::Elem* w1, float* o1, int n1, const typename W::Elem* w2, float* o2, int n2,
                          const typename W::Elem* w3, float* o3, int n3, const float* x, const float* x2, const float* rms_inv, int k, int t, int rb, int accumulate,
                          float eps, int round_in) {
    __shared__ float parts[8][T], squares[T][8];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int b0 = (n0 + rb - 1) / rb, b1 = (n1 + rb - 1) / rb, b2 = (n2 + rb - 1) / rb;
    int wpr = 8 / rb;
    // Which matrix this block's unit of rows belongs to (selects, not an indexed array:
    // registers).
    int block = blockIdx.x;
    const typename W::Elem* w = w0;
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
    const typename W::Elem* row = W::row(w, r < n ? r : 0, k);
    int kc = k / W::VALUES, step = wpr * 32;
    int c = part * 32 + lane;
    // The first PRE chunks of each lane are loaded before waiting for the input (a bf16 row
    // of 1024 with one warp: all of them): the weight reads overlap the kernel before, and
    // are in flight together.
    constexpr int PRE = W::PRE;
    typename W::Raw pre[PRE];
#pragma unroll
    for (int j = 0; j < PRE; j++)
        if (r < n && c + j * step < kc) pre[j] = W::load(row, k, c + j * step);
    pdl_enter();
    if (MODE == IN_NORM && !rms_inv) {
        // Each row's sum of squares over the whole block (a few loads per thread), one
        // partial per warp; combined once the block has synchronised, below.
#pragma unroll
        for (int m = 0; m < T; m++) {
            float ss = m < t ? thread_squares(x + (size_t)m * k, k) : 0.0f;
            ss = warp_sum(ss);
            if (lane == 0) squares[m][warp] = ss;
        }
    }
    // Each row's 1/rms: given, or from the block's sums of squares (before the products where
    // the inputs are rounded, else after them, while the last loads are in flight).
    float inv[T];
    auto find_inv = [&]() {
        if (rms_inv) {
#pragma unroll
            for (int m = 0; m < T; m++) inv[m] = m < t ? rms_inv[m] : 0.0f;
            return;
        }
        __syncthreads();
#pragma unroll
        for (int m = 0; m < T; m++) inv[m] = inv_rms_of(squares[m], k, eps);
    };
    if (MODE == IN_NORM && round_in) find_inv();
    float acc[T];
#pragma unroll
    for (int m = 0; m < T; m++) acc[m] = 0.0f;
    if (r < n) {
#pragma unroll
        for (int j = 0; j < PRE; j++)
            if (c + j * step < kc) W::template dot<T, MODE>(pre[j], row, c + j * step, x, x2, inv, round_in, k, t, acc);
        // Past those, one load in flight per lane: four measured slower on an H100, with and
        // without programmatic launch (9B decode 133-135 against 133-141 tok/s, interleaved;
        // 98 against 113 before it).
#pragma unroll 1
        for (c += PRE * step; c < kc; c += step) W::template dot<T, MODE>(W::load(row, k, c), row, c, x, x2, inv, round_in, k, t, acc);
        W::template finish<T>(x2, k, t, acc);
    }
#pragma unroll
    for (int m = 0; m < T; m++) acc[m] = warp_sum(acc[m]);
    // The sums still to be scaled by 1/rms (the inputs were not rounded).
    bool scale = MODE == IN_NORM && !round_in;
    if (scale) find_inv();
    if (wpr == 1 && !GLU) {
        // One warp per row: it writes its sums itself.
        if (r < n && lane == 0)
#pragma unroll
            for (int m = 0; m < T; m++)
                if (m < t) {
                    size_t at = (size_t)m * n + r;
                    out[at] = (accumulate ? out[at] : 0.0f) + (scale ? acc[m] * inv[m] : acc[m]);
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
            if (scale) { g *= inv[m]; u *= inv[m]; }
            if (round_in) { g = round_bf16(g); u = round_bf16(u); }
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
                if (scale) s *= inv[m];
                size_t at = (size_t)m * n + r;
                out[at] = (accumulate ? out[at] : 0.0f) + s;
            }
        }
    }
}

#define GEMV_KERNEL(NAME, T, MODE, GLU)                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) NAME(const bf16_t* w0, float* o0, int n0, const bf16_t* w1, float* o1, int n1, \
                                                           const bf16_t* w2, float* o2, int n2, const bf16_t* w3, float* o3, int n3,   \
                                                           const float* x, const float* x2, const float* rms_inv, int k, int t, int rb, int accumulate, float eps, \
                                                           int round_in) {                                                                  \
        gemv_body<Bf16Rows, T, MODE, GLU>(w0, o0, n0, w1, o1, n1, w2, o2, n2, w3, o3, n3, x, x2, rms_inv, k, t, rb, accumulate, eps, round_in);  \
    }
GEMV_KERNEL(gemv_t1_plain, 1, IN_PLAIN, false)
GEMV_KERNEL(gemv_t1_norm, 1, IN_NORM, false)
GEMV_KERNEL(gemv_t1_glu, 1, IN_NORM, true)
// Steps of 2 and of 3-4 tokens have kernels of their own: with T = 8 they would carry eight
// accumulators per lane and reduce all eight across the warp, for rows of 1024 (4 chunks per
// lane) about as much work as the products.
GEMV_KERNEL(gemv_t2_plain, 2, IN_PLAIN, false)
GEMV_KERNEL(gemv_t2_norm, 2, IN_NORM, false)
GEMV_KERNEL(gemv_t2_glu, 2, IN_NORM, true)
GEMV_KERNEL(gemv_t4_plain, 4, IN_PLAIN, false)
GEMV_KERNEL(gemv_t4_norm, 4, IN_NORM, false)
GEMV_KERNEL(gemv_t4_glu, 4, IN_NORM, true)
GEMV_KERNEL(gemv_t8_plain, 8, IN_PLAIN, false)
GEMV_KERNEL(gemv_t8_norm, 8, IN_NORM, false)
GEMV_KERNEL(gemv_t8_glu, 8, IN_NORM, true)

// The same GEMVs of block-format weights (blocks.cu), one kernel per format, tokens (1, 2, 4 or
// 8) and output: gemv_<format>_t<T>_<plain|glu>, their inputs from block_input (which
// normalises them where the bf16 GEMV's IN_NORM would).
// (The parameters of every block GEMV kernel, 16-bit or int8 inputs: backend/cuda/kernels/mod.rs
// GemvBlocksParams.)
#define GEMV_BLOCKS_PARAMS                                                                                                     \
    const unsigned char *w0, float *o0, int n0, const unsigned char *w1, float *o1, int n1, const unsigned char *w2, float *o2, \
        int n2, const unsigned char *w3, float *o3, int n3, const float *x, const float *x2, const float *rms_inv, int k, int t,  \
        int rb, int accumulate, float eps, int round_in
#define GEMV_BLOCKS_KERNEL(NAME, F, T, GLU)                                        \
    extern "C" __global__ void __launch_bounds__(256) NAME(GEMV_BLOCKS_PARAMS) { \
        gemv_body<BlockRows<F>, T, IN_PLAIN, GLU>(w0, o0, n0, w1, o1, n1, w2, o2, n2, w3, o3, n3, x, x2, rms_inv, k, t, rb, accumulate, eps, round_in); \
    }
// KERNEL(NAME_t<T>_<plain|glu>, F, T, GLU) for T = 1, 2, 4, 8.
#define GEMV_BLOCKS_T(KERNEL, NAME, F, T) KERNEL(NAME##_t##T##_plain, F, T, false) KERNEL(NAME##_t##T##_glu, F, T, true)
#define GEMV_BLOCKS(KERNEL, NAME, F) GEMV_BLOCKS_T(KERNEL, NAME, F, 1) GEMV_BLOCKS_T(KERNEL, NAME, F, 2) GEMV_BLOCKS_T(KERNEL, NAME, F, 4) GEMV_BLOCKS_T(KERNEL, NAME, F, 8)
GEMV_BLOCKS(GEMV_BLOCKS_KERNEL, gemv_q4_0, BLOCK_Q4_0)
GEMV_BLOCKS(GEMV_BLOCKS_KERNEL, gemv_q8_0, BLOCK_Q8_0)
GEMV_BLOCKS(GEMV_BLOCKS_KERNEL, gemv_q4_k, BLOCK_Q4_K)
GEMV_BLOCKS(GEMV_BLOCKS_KERNEL, gemv_q5_k, BLOCK_Q5_K)
GEMV_BLOCKS(GEMV_BLOCKS_KERNEL, gemv_q6_k, BLOCK_Q6_K)

// The k-quant GEMVs against int8 inputs (block_input8's; precision=fast): the matrices,
// tokens, SwiGLU and `accumulate` of gemv_body, but each warp takes BlockChunk8<F>::R rows
// whole, loading each unit's inputs once for all of them, and a block 8 R rows of one matrix
// (with GLU, 8 R rows of gate and up in turn: 4 R outputs). Its lanes take a unit at a time
// (a lane per 64 or 32 values), the first PRE loaded before the kernel waits for its input.
// (The same products through gemv_body, its warps per row chosen at run time, ran 9-10% slower
// on an H200 than a row a warp for three of the 9B's Q4_K shapes, 3% faster for MLP down, and
// 37% slower than two rows a warp for the Q6_K LM head: scripts/bench-block-gemv.sh.) `rms_inv`, `rb` and `eps` are
// gemv_body's and unused: block_input8 normalised the inputs.
template <int F, int T, bool GLU>
__device__ void gemv_a8_body(const unsigned char* w0, float* o0, int n0, const unsigned char* w1, float* o1, int n1, const unsigned char* w2, float* o2, int n2,
                             const unsigned char* w3, float* o3, int n3, const float* x, const float* x2, int k, int t, int accumulate, int round_in) {
    typedef BlockChunk8<F> C;
    constexpr int R = C::R, PRE = C::PRE, ROWS = 8 * R;
    __shared__ float vals[GLU ? ROWS : 1][T];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, block = blockIdx.x;
    // This block's matrix (selects, not an indexed array: registers) and its rows: with GLU the
    // list of gate and up rows in turn.
    const unsigned char* w = w0;
    float* out = o0;
    int n = GLU ? 2 * n0 : n0;
    if (!GLU) {
        int b0 = (n0 + ROWS - 1) / ROWS, b1 = (n1 + ROWS - 1) / ROWS, b2 = (n2 + ROWS - 1) / ROWS;
        if (block >= b0) { block -= b0; w = w1; out = o1; n = n1;
            if (block >= b1) { block -= b1; w = w2; out = o2; n = n2;
                if (block >= b2) { block -= b2; w = w3; out = o3; n = n3; } } }
    }
    int first = block * ROWS + warp * R, kc = k / C::U;
    size_t row_bytes = block_row_bytes<F>(k);
    const unsigned char* rows[R];
#pragma unroll
    for (int i = 0; i < R; i++) {
        int li = min(first + i, n - 1);
        rows[i] = GLU ? ((li & 1) ? w1 : w0) + (size_t)(li >> 1) * row_bytes : w + (size_t)li * row_bytes;
    }
    typename C::Raw pre[PRE][R];
#pragma unroll
    for (int j = 0; j < PRE; j++)
        if (lane + 32 * j < kc)
#pragma unroll
            for (int i = 0; i < R; i++) pre[j][i] = C::load(rows[i], k, lane + 32 * j);
    pdl_enter();
    const unsigned char* q = (const unsigned char*)x;
    const int* sums = (const int*)x2;
    const float* scales = x2 + (size_t)t * (k / 8);
    float acc[R][T];
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int m = 0; m < T; m++) acc[i][m] = 0.0f;
    // Unit c of the warp's rows: each row's weights decoded once, each token's inputs loaded
    // once. Token 0's (t >= 1) are loaded before the decoding, so that their loads overlap it
    // (loaded after it, behind the `m < t` test, the 9B's Q4_K GEMVs ran 5-11% slower on an
    // H200: bench-block-gemv.sh's "1 row a warp" against the engine's).
    auto unit = [&](const typename C::Raw* raw, int c) {
        typename C::In in = C::inputs(q, sums, scales, c, k, 0);
        typename C::Dec d[R];
#pragma unroll
        for (int i = 0; i < R; i++) d[i] = C::decode(raw[i], c);
#pragma unroll
        for (int m = 0; m < T; m++) {
            if (m < t) {
                if (m > 0) in = C::inputs(q, sums, scales, c, k, m);
#pragma unroll
                for (int i = 0; i < R; i++) acc[i][m] += C::dot(d[i], in);
            }
        }
    };
#pragma unroll
    for (int j = 0; j < PRE; j++)
        if (lane + 32 * j < kc) unit(pre[j], lane + 32 * j);
    // Past those, one unit in flight per lane.
#pragma unroll 1
    for (int c = lane + 32 * PRE; c < kc; c += 32) {
        typename C::Raw raw[R];
#pragma unroll
        for (int i = 0; i < R; i++) raw[i] = C::load(rows[i], k, c);
        unit(raw, c);
    }
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int m = 0; m < T; m++) acc[i][m] = warp_sum(acc[i][m]);
    if (!GLU) {
        if (lane == 0)
#pragma unroll
            for (int i = 0; i < R; i++)
                if (first + i < n)
#pragma unroll
                    for (int m = 0; m < T; m++)
                        if (m < t) {
                            size_t at = (size_t)m * n + first + i;
                            out[at] = (accumulate ? out[at] : 0.0f) + acc[i][m];
                        }
        return;
    }
    if (lane == 0)
#pragma unroll
        for (int i = 0; i < R; i++)
#pragma unroll
            for (int m = 0; m < T; m++) vals[warp * R + i][m] = acc[i][m];
    __syncthreads();
    // Thread p * T + m: output row p of this block's 4 R, token m.
    int p = threadIdx.x / T, m = threadIdx.x % T, row = block * (ROWS / 2) + p;
    if (p < ROWS / 2 && m < t && row < n0) {
        float g = vals[2 * p][m], u = vals[2 * p + 1][m];
        if (round_in) { g = round_bf16(g); u = round_bf16(u); }
        o0[(size_t)m * n0 + row] = siluf_(g) * u;
    }
}
#define GEMV_BLOCKS8_KERNEL(NAME, F, T, GLU)                                       \
    extern "C" __global__ void __launch_bounds__(256) NAME(GEMV_BLOCKS_PARAMS) { \
        gemv_a8_body<F, T, GLU>(w0, o0, n0, w1, o1, n1, w2, o2, n2, w3, o3, n3, x, x2, k, t, accumulate, round_in); \
    }
GEMV_BLOCKS(GEMV_BLOCKS8_KERNEL, gemv_q4_k_a8, BLOCK_Q4_K)
GEMV_BLOCKS(GEMV_BLOCKS8_KERNEL, gemv_q5_k_a8, BLOCK_Q5_K)
GEMV_BLOCKS(GEMV_BLOCKS8_KERNEL, gemv_q6_k_a8, BLOCK_Q6_K)

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
                                 float* o3, int n3, const float* x, const float* x2, const float* rms_inv, int k, int accumulate, float eps, int round_in) {
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
        float ss = warp_sum(thread_squares(x, k));
        if (lane == 0) squares[warp] = ss;
        __syncthreads();
        inv = inv_rms_of(squares, k, eps);
    }
    // This lane's inputs (times the norm's scale), kept for every row.
    float xv[PER][8];
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const float4* xp = (const float4*)(x + (lane + 32 * j) * 8);
        float4 sa = make_float4(1, 1, 1, 1), sb = sa;
        if (MODE == IN_NORM) {
            const float4* sp = (const float4*)(x2 + (lane + 32 * j) * 8);
            sa = sp[0]; sb = sp[1];
        }
        float4 a = gemv_input<MODE>(xp[0], sa, inv, round_in), b = gemv_input<MODE>(xp[1], sb, inv, round_in);
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
        // (The rounded inputs were scaled by 1/rms already.)
        float after = round_in ? 1.0f : inv;
        float g = dot(cw) * after;
        if (GLU) {
            float u = dot(cu) * after;
            if (round_in) { g = round_bf16(g); u = round_bf16(u); }
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
                                                              const float* x, const float* x2, const float* rms_inv, int k, int accumulate, float eps,   \
                                                              int round_in) {                                                                    \
        gemv_stream_body<MODE, GLU>(w0, o0, n0, w1, o1, n1, w2, o2, n2, w3, o3, n3, x, x2, rms_inv, k, accumulate, eps, round_in);              \
    }
GEMV_STREAM_KERNEL(gemv_stream_plain, IN_PLAIN, false, 3)
GEMV_STREAM_KERNEL(gemv_stream_norm, IN_NORM, false, 3)
GEMV_STREAM_KERNEL(gemv_stream_glu, IN_NORM, true, 2)
