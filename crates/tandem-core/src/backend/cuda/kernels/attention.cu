// The gated attention mixer: q/k norms and RoPE, and causal GQA attention of a prefill (tiled,
// on tensor cores or in f32) and of a decode step (split over the positions), over the paged
// K/V cache.

// The paged K/V cache: a sequence's keys and values live in blocks of KV_BLOCK positions, and
// its block table lists each block's address in position order. A block holds those positions'
// rows of every attention layer (row = hkv * d floats): layer l's keys at l * 2 * KV_BLOCK * row
// floats (the layer's `koff`), its values KV_BLOCK * row further; so one table serves every
// layer, and a block moves between engines in one copy. (qwen35/kv_cache.rs: KV_BLOCK.)
#define KV_BLOCK 16
// The key row of position p (its value row is KV_BLOCK * row further).
__device__ __forceinline__ float* kv_row(float* const* blocks, int koff, int p, int row) { return blocks[p / KV_BLOCK] + koff + (size_t)(p % KV_BLOCK) * row; }

// Per token: split the interleaved query/gate heads, RMSNorm q and k heads with their
// zero-centred weights, rotate the first 2 * half channels (NeoX pairs c, c + half) at
// position pos[0] + token; keys and values go straight into the cache (the blocks of table
// `blocks`, layer offset koff) at that position. Grid: (tokens, hq + hkv); block: a warp
// multiple >= d.
// Row `tok` of the call's rows, at position pos0 + tok.
__device__ void qk_norm_rope_body(const float* qg, float* q, float* gate, const float* k, const float* v, float* const* blocks, int koff, const float* q_norm,
                                  const float* k_norm, const float* inv_freq, int hq, int hkv, int d, int half, int pos0, int tok, float eps) {
    __shared__ float sv[1024];
    int head = blockIdx.y, c = threadIdx.x;
    bool is_q = head < hq;
    int kh = head - hq;
    size_t kv_at = (size_t)tok * hkv + kh;
    float* key = is_q ? nullptr : kv_row(blocks, koff, pos0 + tok, hkv * d) + (size_t)kh * d;
    const float* src = is_q ? qg + ((size_t)tok * hq + head) * 2 * d : k + kv_at * d;
    float* dst = is_q ? q + ((size_t)tok * hq + head) * d : key;
    const float* w = is_q ? q_norm : k_norm;
    float x = c < d ? src[c] : 0.0f;
    if (is_q && c < d) gate[((size_t)tok * hq + head) * d + c] = src[d + c];
    if (!is_q && c < d) key[(size_t)KV_BLOCK * hkv * d + c] = v[kv_at * d + c];
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

extern "C" __global__ void qk_norm_rope(const float* qg, float* q, float* gate, const float* k, const float* v, float* const* blocks, int koff, const float* q_norm,
                                        const float* k_norm, const float* inv_freq, int hq, int hkv, int d, int half, const u32* pos, float eps) {
    pdl_enter();
    qk_norm_rope_body(qg, q, gate, k, v, blocks, koff, q_norm, k_norm, inv_freq, hq, hkv, d, half, (int)pos[0], blockIdx.x, eps);
}

// A packed prefill's (common.cuh: PackedSeq): sequence z's rows, its block table at
// blocks + z * width, its position pos[z]; the same arithmetic as qk_norm_rope on that sequence
// alone. Grid: (the longest sequence's rows, hq + hkv, sequences); block as qk_norm_rope.
extern "C" __global__ void qk_norm_rope_packed(const float* qg, float* q, float* gate, const float* k, const float* v, float* const* blocks, int width, int koff,
                                               const float* q_norm, const float* k_norm, const float* inv_freq, int hq, int hkv, int d, int half, const u32* pos,
                                               const u32* seqs, float eps) {
    pdl_enter();
    PackedSeq s = packed_seq(seqs);
    if ((int)blockIdx.x >= s.count) return;
    size_t z = blockIdx.z, f = s.first;
    qk_norm_rope_body(qg + f * hq * 2 * d, q + f * hq * d, gate + f * hq * d, k + f * hkv * d, v + f * hkv * d, blocks + z * width, koff, q_norm, k_norm, inv_freq, hq,
                      hkv, d, half, (int)pos[z], blockIdx.x, eps);
}

// The batched decode step's: row b is sequence b's one token, its block table at
// blocks + b * width, its position pos[b]. The same arithmetic as qk_norm_rope on that sequence
// alone. Grid: (sequences, hq + hkv); block as qk_norm_rope.
extern "C" __global__ void qk_norm_rope_batch(const float* qg, float* q, float* gate, const float* k, const float* v, float* const* blocks, int width, int koff,
                                              const float* q_norm, const float* k_norm, const float* inv_freq, int hq, int hkv, int d, int half, const u32* pos,
                                              float eps) {
    pdl_enter();
    size_t b = blockIdx.x;
    qk_norm_rope_body(qg + b * hq * 2 * d, q + b * hq * d, gate + b * hq * d, k + b * hkv * d, v + b * hkv * d, blocks + b * width, koff, q_norm, k_norm, inv_freq, hq,
                      hkv, d, half, (int)pos[b], 0, eps);
}

// Causal GQA attention of a few tokens (decode), split over the positions (flash decoding):
// block (token, key/value head, s) takes positions s * chunk .. of the visible ones for the
// query heads that share that key/value head (GQA's group), so that each key and value row is
// read once for all of them. (A block per query head read every row once per head of its group,
// and scored a row with one warp's scalar loads: 4.0 ms of a 256-sequence step of the 0.8B at
// 512-614 positions on an H200, 43% of the step, at 16% of the DRAM's bandwidth.) A warp scores
// two rows at a time, each lane taking four channels at a time of the keys and of up to
// ATTN_PASS query heads of the group (held in registers; a larger group takes more passes);
// scores go to shared memory, one row of `chunk` a head; a warp per head finds their max and
// exp-sum; then each thread takes two channels of eight value rows at a time and adds them,
// weighted, into each head's output. (Teams of d / 4 threads, four channels each, taking eight
// rows in turn and adding their sums in shared memory, were no faster: 1.56 against 1.50 ms.)
// Where the positions span more than one chunk, each block writes (max, sum, weighted values)
// per head to `part`, and the last block of the (token, key/value head) to finish (a counter in
// `done` at its first query head, which it resets) rescales and adds them; then the output gate
// sigmoid(gate). Blocks past the visible positions do nothing.
// Grid: (tokens, hkv, splits); block 128; dynamic shared memory group * chunk floats;
// chunk <= ATTN_CHUNK; d a multiple of 4 up to 256; group = hq / hkv <= ATTN_GROUP_MAX;
// part: tokens * hq * splits * (d + 2) floats; done: tokens * hq zeroed counters.
#define ATTN_CHUNK 1024
#define ATTN_GROUP_MAX 8
// Query heads taken per pass over the rows (their q in registers: a larger group takes passes).
#define ATTN_PASS 4
// The scores of query heads j0 .. j0 + ATTN_PASS - 1 (those below `group`) against positions
// p0 .. p0 + n - 1, into scores[j * chunk + p]: a warp scores two rows at a time, each lane
// four channels at a time of each.
__device__ __forceinline__ void attention_scores(const float* qh, float* const* blocks, int koff, float* scores, int chunk, int kvh, int row, int d, int group,
                                                 int j0, int p0, int n, float scale) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // This lane's channels 4 lane + 128 i (i < 2) of the pass's query heads.
    float4 qr[ATTN_PASS][2];
#pragma unroll
    for (int j = 0; j < ATTN_PASS; j++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int c = 4 * lane + 128 * i;
            qr[j][i] = j0 + j < group && c < d ? *(const float4*)(qh + (size_t)(j0 + j) * d + c) : zero;
        }
    for (int p = 2 * warp; p < n; p += 2 * warps) {
        float4 kr[2][2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float* kp = p + r < n ? kv_row(blocks, koff, p0 + p + r, row) + (size_t)kvh * d : nullptr;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                int c = 4 * lane + 128 * i;
                kr[r][i] = kp && c < d ? *(const float4*)(kp + c) : zero;
            }
        }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (p + r >= n) break;
#pragma unroll
            for (int j = 0; j < ATTN_PASS; j++) {
                if (j0 + j >= group) break;
                float sc = 0.0f;
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    sc = fmaf(qr[j][i].x, kr[r][i].x, sc);
                    sc = fmaf(qr[j][i].y, kr[r][i].y, sc);
                    sc = fmaf(qr[j][i].z, kr[r][i].z, sc);
                    sc = fmaf(qr[j][i].w, kr[r][i].w, sc);
                }
                sc = warp_sum(sc);
                if (lane == 0) scores[(j0 + j) * chunk + p + r] = sc * scale;
            }
        }
    }
}

// Row `tok` of the call's rows, at position pos0 + tok.
__device__ void attention_body(const float* q, float* const* blocks, int koff, const float* gate, float* out, float* part, unsigned* done, int hq, int hkv,
                               int d, int chunk, int splits, int pos0, int tok) {
    DYNAMIC_SHARED(float, scores, ATTN_GROUP_MAX * ATTN_CHUNK);  // [group][chunk]
    __shared__ float head_max[ATTN_GROUP_MAX], head_sum[ATTN_GROUP_MAX];
    int kvh = blockIdx.y, s = blockIdx.z, group = hq / hkv, h0 = kvh * group;
    int visible = pos0 + tok + 1, active = (visible + chunk - 1) / chunk;
    if (s >= active) return;
    int p0 = s * chunk, n = min(visible - p0, chunk);
    int row = hkv * d;
    float scale = 1.0f / sqrtf((float)d);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const float* qh = q + ((size_t)tok * hq + h0) * d;
    for (int j0 = 0; j0 < group; j0 += ATTN_PASS) attention_scores(qh, blocks, koff, scores, chunk, kvh, row, d, group, j0, p0, n, scale);
    __syncthreads();
    for (int j = warp; j < group; j += warps) {
        float* sj = scores + j * chunk;
        float mx = NEG_INF;
        for (int p = lane; p < n; p += 32) mx = fmaxf(mx, sj[p]);
        mx = warp_reduce(mx, Max());
        float sum = 0.0f;
        for (int p = lane; p < n; p += 32) {
            float e = expf(sj[p] - mx);
            sj[p] = e;
            sum += e;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            head_max[j] = mx;
            head_sum[j] = sum;
        }
    }
    __syncthreads();
    // part's entry of query head h0 + j: [splits][d + 2] per head.
    auto mine = [&](int j) { return part + (((size_t)tok * hq + h0 + j) * splits + s) * (d + 2); };
    // The weighted value rows: thread t takes channels 2 t, 2 t + 1 (and 2 blockDim further).
    for (int j0 = 0; j0 < group; j0 += ATTN_PASS)
        for (int c = 2 * threadIdx.x; c < d; c += 2 * blockDim.x) {
            float o[ATTN_PASS][2];
#pragma unroll
            for (int j = 0; j < ATTN_PASS; j++) o[j][0] = o[j][1] = 0.0f;
            size_t vc = (size_t)KV_BLOCK * row + (size_t)kvh * d + c;
            // Eight value rows in flight at a time, then the rest one by one.
            int p = 0;
            for (; p + 8 <= n; p += 8) {
                float v[8][2];
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    const float* vp = kv_row(blocks, koff, p0 + p + u, row) + vc;
                    v[u][0] = vp[0];
                    v[u][1] = vp[1];
                }
#pragma unroll
                for (int j = 0; j < ATTN_PASS; j++) {
                    if (j0 + j >= group) break;
#pragma unroll
                    for (int u = 0; u < 8; u++) {
                        float w = scores[(j0 + j) * chunk + p + u];
                        o[j][0] = fmaf(w, v[u][0], o[j][0]);
                        o[j][1] = fmaf(w, v[u][1], o[j][1]);
                    }
                }
            }
            for (; p < n; p++) {
                const float* vp = kv_row(blocks, koff, p0 + p, row) + vc;
                float v0 = vp[0], v1 = vp[1];
#pragma unroll
                for (int j = 0; j < ATTN_PASS; j++) {
                    if (j0 + j >= group) break;
                    float w = scores[(j0 + j) * chunk + p];
                    o[j][0] = fmaf(w, v0, o[j][0]);
                    o[j][1] = fmaf(w, v1, o[j][1]);
                }
            }
#pragma unroll
            for (int j = 0; j < ATTN_PASS; j++) {
                if (j0 + j >= group) break;
                size_t at = ((size_t)tok * hq + h0 + j0 + j) * d + c;
                if (active == 1) {
                    out[at] = o[j][0] / head_sum[j0 + j] * sigmoidf_(gate[at]);
                    out[at + 1] = o[j][1] / head_sum[j0 + j] * sigmoidf_(gate[at + 1]);
                } else {
                    mine(j0 + j)[2 + c] = o[j][0];
                    mine(j0 + j)[3 + c] = o[j][1];
                }
            }
        }
    if (active == 1) return;
    if ((int)threadIdx.x < group) {
        mine(threadIdx.x)[0] = head_max[threadIdx.x];
        mine(threadIdx.x)[1] = head_sum[threadIdx.x];
    }
    unsigned* counter = &done[(size_t)tok * hq + h0];
    if (!last_block_of(counter, active)) return;
    for (int j = 0; j < group; j++) {
        size_t head = (size_t)tok * hq + h0 + j;
        const float* all = part + head * splits * (d + 2);
        float m = NEG_INF, l = 0.0f;
        for (int k = 0; k < active; k++) m = fmaxf(m, __ldcg(&all[(size_t)k * (d + 2)]));
        for (int k = 0; k < active; k++) l += __ldcg(&all[(size_t)k * (d + 2) + 1]) * expf(__ldcg(&all[(size_t)k * (d + 2)]) - m);
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            float o = 0.0f;
            for (int k = 0; k < active; k++) o += __ldcg(&all[(size_t)k * (d + 2) + 2 + c]) * expf(__ldcg(&all[(size_t)k * (d + 2)]) - m);
            out[head * d + c] = o / l * sigmoidf_(gate[head * d + c]);
        }
    }
    if (threadIdx.x == 0) *counter = 0;
}
extern "C" __global__ void __launch_bounds__(128) attention(const float* q, float* const* blocks, int koff, const float* gate, float* out, float* part, unsigned* done,
                                                            int hq, int hkv, int d, int chunk, int splits, const u32* pos) {
    pdl_enter();
    attention_body(q, blocks, koff, gate, out, part, done, hq, hkv, d, chunk, splits, (int)pos[0], blockIdx.x);
}

// The batched decode step's: row b is sequence b's one token over its cache (block table at
// blocks + b * width) at position pos[b]; the same arithmetic as attention on that sequence
// alone. Grid: (sequences, hkv, splits), splits sized for the sequence that sees the most
// positions; part and done as for that many rows. Eight blocks an SM (64 registers a thread, no
// spills; 72 without the bound): its step's attention 1.29 against 1.50 ms (see above).
extern "C" __global__ void __launch_bounds__(128, 8) attention_batch(const float* q, float* const* blocks, int width, int koff, const float* gate, float* out, float* part,
                                                                  unsigned* done, int hq, int hkv, int d, int chunk, int splits, const u32* pos) {
    pdl_enter();
    size_t b = blockIdx.x;
    attention_body(q + b * hq * d, blocks + b * width, koff, gate + b * hq * d, out + b * hq * d, part + b * hq * splits * (d + 2), done + b * hq, hq, hkv, d, chunk,
                   splits, (int)pos[b], 0);
}

// The keys and values of positions 0..n of one layer, gathered from the cache and rounded to
// bf16 ([position, hkv, d] each): the tensor-core prefill attention's operands. Four values a
// thread. Grid: ceil(n * row / 1024); block 256.
__device__ void kv_to_bf16_body(float* const* blocks, int koff, bf16_t* kb, bf16_t* vb, int n, int row) {
    size_t total = (size_t)n * row;
    for (size_t i = 4 * ((size_t)blockIdx.x * blockDim.x + threadIdx.x), end = i + 4; i < end && i < total; i++) {
        const float* key = kv_row(blocks, koff, (int)(i / row), row) + i % row;
        kb[i] = f32_to_bf16(key[0]);
        vb[i] = f32_to_bf16(key[(size_t)KV_BLOCK * row]);
    }
}
extern "C" __global__ void kv_to_bf16(float* const* blocks, int koff, bf16_t* kb, bf16_t* vb, int n, int row) {
    pdl_enter();
    kv_to_bf16_body(blocks, koff, kb, vb, n, row);
}
// A packed prefill's: sequence z's positions 0..pos[z] + its rows, from its block table (at
// blocks + z * width) into rows kv_first.. of kb and vb. Grid: (ceil(most * row / 1024), 1,
// sequences), most the positions of the sequence that sees the most; block 256.
extern "C" __global__ void kv_to_bf16_packed(float* const* blocks, int width, int koff, bf16_t* kb, bf16_t* vb, int row, const u32* pos, const u32* seqs) {
    pdl_enter();
    PackedSeq s = packed_seq(seqs);
    size_t at = (size_t)s.kv_first * row;
    kv_to_bf16_body(blocks + (size_t)blockIdx.z * width, koff, kb + at, vb + at, (int)pos[blockIdx.z] + s.count, row);
}

// Causal GQA attention of a tensor-core prefill (flash attention 2 on bf16 mma, f32 sums; the
// f32 attention_tiled is its reference): q rounded to bf16, k and v given in bf16 (gathered
// from the cache by kv_to_bf16, [position, hkv, D]), and the softmax weights P rounded before
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
// A packed prefill's: sequence z's rows over its gathered keys and values (kv_to_bf16_packed),
// at its position pos[z]; the same arithmetic as attention_mma_* on that sequence alone.
// Grid: (ceil(longest / 64), hq, sequences); block 256.
#define ATTENTION_MMA_PACKED(NAME, D)                                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) NAME(const float* q, const bf16_t* kb, const bf16_t* vb, const float* gate, float* out, int hq, int hkv, \
                                                           const u32* pos, const u32* seqs) {                                                       \
        pdl_enter();                                                                                                                                \
        PackedSeq s = packed_seq(seqs);                                                                                                             \
        if ((int)blockIdx.x * 64 >= s.count) return;                                                                                                \
        size_t rows = (size_t)s.first * hq * D, keys = (size_t)s.kv_first * hkv * D;                                                                 \
        attention_mma_body<D, (D >= 256 ? 16 : 32)>(q + rows, kb + keys, vb + keys, gate + rows, out + rows, s.count, hq, hkv, pos + blockIdx.z);  \
    }
ATTENTION_MMA_PACKED(attention_mma_packed_32, 32)
ATTENTION_MMA_PACKED(attention_mma_packed_64, 64)
ATTENTION_MMA_PACKED(attention_mma_packed_128, 128)
ATTENTION_MMA_PACKED(attention_mma_packed_256, 256)

// Causal GQA attention of a prefill, tiled (flash attention, in f32): one block per (64 queries,
// query head) walks the visible keys 64 at a time with an online softmax, so each key and value
// row is read once per 64 queries and no buffer grows with the context. S = Q K^T: thread
// (ty, tx) holds rows 4ty.. and keys 4tx..; O: rows 4ty.., columns tx + 16c. The 16 threads of
// a row group are one half-warp (row max and sum by shuffles). d <= 256, a multiple of 16.
// Grid: (ceil(t / 64), hq); block: 256.
#define AQ 64
#define AK 64
extern "C" __global__ void __launch_bounds__(256) attention_tiled(const float* q, float* const* blocks, int koff, const float* gate, float* out, int t, int hq,
                                                                  int hkv, int d, const u32* pos) {
    pdl_enter();
    // qs/ks (staged 32 channels at a time for S) share their memory with vs (16 keys of V).
    __shared__ float tiles[2 * AQ * 33];
    __shared__ float ps[AQ][AK + 1];
    float(*qs)[33] = (float(*)[33])tiles;
    float(*ks)[33] = (float(*)[33])(tiles + AQ * 33);
    float* vs = tiles;
    int pos0 = (int)pos[0];
    int q0 = blockIdx.x * AQ, h = blockIdx.y, kvh = h / (hq / hkv), row = hkv * d;
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
                ks[i][dd] = (k0 + i < kend && dok) ? kv_row(blocks, koff, k0 + i, row)[(size_t)kvh * d + d0 + dd] : 0.0f;
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
                vs[jj * d + dd] = k0 + j0 + jj < kend ? kv_row(blocks, koff, k0 + j0 + jj, row)[(size_t)KV_BLOCK * row + (size_t)kvh * d + dd] : 0.0f;
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
