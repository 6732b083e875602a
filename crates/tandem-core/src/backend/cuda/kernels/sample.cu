// Sampling on the GPU: the greedy pick of each row of logits, and a draw with a temperature, top-k and top-p.

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

// A grammar's mask on rows of logits (sampling.rs Sampler::gpu_masked_pick; grammar::apply the
// host's form): out[r * n + i] = rows[r][i] where bit i of row r's mask (`words` u32 a row, bit i
// of word i / 32) allows id i, else -inf, for ids 0..n. A copy, so that a state's own row stays
// the model's logits; argmax_rows and sample_rows then pick from it. Grid: (spans, rows); block
// 256.
extern "C" __global__ void __launch_bounds__(256) mask_rows(float* const* rows, const u32* allowed, int words, int n, float* out) {
    pdl_enter();
    const float* x = rows[blockIdx.y];
    const u32* bits = allowed + (size_t)blockIdx.y * words;
    float* o = out + (size_t)blockIdx.y * n;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) o[i] = (bits[i >> 5] >> (i & 31)) & 1u ? x[i] : NEG_INF;
}

// Sampling at a temperature with top-k and top-p cuts, one row of logits per block (sampling.rs
// Sampler::sample_drawn, the host's form; sample_reference.cpp its plain check). Over the first n
// ids, the scores s = (logit - max) * inv_t above -30 are the candidates; each weighs
// round(exp(s) * 2^40) as an integer, so that sums are exact in any order. The candidates are
// ordered by score, high first, then by id (the order the cuts take): top_k keeps the first
// top_k, top_p then the fewest first ones whose weight reaches ceil(top_p * total); r = u * total
// of what is kept (u uniform in [0, 1), drawn by the host's generator) picks the first kept id,
// in id order, whose running weight passes r. A kept set is the candidates at or before a
// boundary (key K, id cut) in that order: key > K, or key == K and id <= cut, where the key is
// the score's bits mapped so that integer order is score order. The boundary is found by radix
// selection (below) and the first crossing of a running count or weight; a small top-k gathers
// its few into shared memory. No sort; without cuts three passes over the row (two where the
// step's argmax gives the largest), with a top-k of at most 1024 eight, with both cuts at most
// fourteen. Only the index comes back: out[row] = the id, or 0xffffffff where no logit
// qualifies (all NaN or -inf: the host decides). expf may differ from the host's exp in the
// last bit, so a draw or a cut that lands exactly on a boundary may differ.
// Grid: rows; block: a multiple of 32 threads, at most 1024 (the more, the more of the row in
// flight). rows[r]: the row's logits; params[6 r ..]: n, inv_t, top_k (0: none), top_p (1:
// none), u, and the row's argmax where its step found it (else -1): the first of its largest
// values, which is the largest of the first n where it lies below n.
typedef unsigned long long u64;
__device__ __forceinline__ u32 score_key(float s) {
    u32 b = __float_as_uint(s);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_score(u32 key) { return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key); }
// 0 for an id that is not a candidate (every candidate's key is above 0).
__device__ __forceinline__ u32 candidate_key(float logit, float m, float inv_t) {
    float s = (logit - m) * inv_t;
    return s > -30.0f ? score_key(s) : 0u;
}
__device__ __forceinline__ u64 key_weight(u32 key) { return (u64)llround((double)expf(key_score(key)) * 1099511627776.0); }
__device__ __forceinline__ bool kept(u32 key, u32 id, u32 k, u32 cut) { return key != 0u && (key > k || (key == k && id <= cut)); }
// The weight the first ones in score order must reach for top_p: ceil(top_p * total), at least 1
// and at most total (sampling.rs nucleus).
__device__ __forceinline__ u64 nucleus_target(float top_p, u64 total) {
    u64 target = (u64)ceil((double)top_p * (double)total);
    return target < 1 ? 1 : (target > total ? total : target);
}
// Where uniform u falls in `total` of weight: the running weight the draw's id first passes.
__device__ __forceinline__ u64 draw_point(double u, u64 total) {
    u64 r = (u64)(u * (double)total);
    return r > total - 1 ? total - 1 : r;
}
__device__ __forceinline__ u64 shfl_xor_u64(u64 v, int o) {
    u32 lo = __shfl_xor_sync(0xffffffffu, (u32)v, o), hi = __shfl_xor_sync(0xffffffffu, (u32)(v >> 32), o);
    return ((u64)hi << 32) | lo;
}
// The sums over the block of every thread's a and b; every thread gets them.
__device__ void block_sum_u64x2(u64& a, u64& b) {
    __shared__ u64 part[32][2];
    for (int o = 16; o > 0; o >>= 1) {
        a += shfl_xor_u64(a, o);
        b += shfl_xor_u64(b, o);
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) { part[threadIdx.x >> 5][0] = a; part[threadIdx.x >> 5][1] = b; }
    __syncthreads();
    a = b = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) { a += part[w][0]; b += part[w][1]; }
    __syncthreads();
}
// The id at which the running sum of w(id), in id order over 0..n, first passes r (0xffffffff
// where it never does), narrowed in three levels whose reads are all coalesced: each warp sums a
// range of whole 1,024-id tiles; the warp whose range holds the crossing sums its 32 pieces (each
// whole chunks of 32 ids, a chunk summed across the lanes); then the piece that holds it is
// read a chunk at a time into shared memory and walked there by one thread.
template <typename W>
__device__ u32 first_crossing(int n, u64 r, W w) {
    __shared__ u64 sums[32];
    __shared__ u64 chunk[32];
    __shared__ u64 base_s;
    __shared__ int pick_s;
    __shared__ u32 found;
    const int warps = blockDim.x >> 5, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int range = (n + warps * 1024 - 1) / (warps * 1024) * 1024, piece = range / 32;
    int w0 = min(n, warp * range), w1 = min(n, w0 + range);
    u64 mine = 0;
#pragma unroll 4
    for (int i = w0 + lane; i < w1; i += 32) mine += w(i);
    for (int o = 16; o > 0; o >>= 1) mine += shfl_xor_u64(mine, o);
    __syncthreads();
    if (lane == 0) sums[warp] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 run = 0;
        pick_s = -1;
        found = 0xffffffffu;
        for (int v = 0; v < warps; v++) {
            if (r < run + sums[v]) { pick_s = v; break; }
            run += sums[v];
        }
        base_s = run;
    }
    __syncthreads();
    int pick = pick_s;
    if (pick < 0) return 0xffffffffu;
    int p0 = pick * range;
    __syncthreads();
    if (warp == pick) {
        for (int q = 0; q < 32; q++) {
            u64 s = 0;
            for (int c = p0 + q * piece; c < min(n, p0 + (q + 1) * piece); c += 32) s += c + lane < n ? w(c + lane) : 0ull;
            for (int o = 16; o > 0; o >>= 1) s += shfl_xor_u64(s, o);
            if (lane == 0) sums[q] = s;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 run = base_s;
        pick_s = 31;
        for (int q = 0; q < 32; q++) {
            if (r < run + sums[q]) { pick_s = q; break; }
            run += sums[q];
        }
        base_s = run;
    }
    __syncthreads();
    int q0 = p0 + pick_s * piece, q1 = min(n, q0 + piece);
    for (int c = q0; c < q1; c += 32) {
        if (warp == 0) chunk[lane] = c + lane < q1 ? w(c + lane) : 0ull;
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 run = base_s;
            for (int l = 0; l < 32 && found == 0xffffffffu; l++) {
                run += chunk[l];
                if (r < run) found = (u32)(c + l);
            }
            base_s = run;
        }
        __syncthreads();
        if (found != 0xffffffffu) break;
    }
    return found;
}
// Radix selection over the ids with w(id, &key) > 0 (a weight or a count), keys high first: the
// key at which the running sum of w first reaches `target` (>= 1), and how much of the target is
// left for the ids of that key (*left, >= 1). A first round bins the scores linearly over
// [lo, 0] (lo: the lowest candidate's score), 4096 bands: monotone in the score, and spread over
// many bands however narrow the scores are (the key's top bits put a narrow spread in a few bins,
// whose shared-memory counters then serialise: 2.4 ms of a 64-row draw on an H100). Three rounds
// of 12, 10 and 10 bits of the key then select among the ids of the chosen band. Each round
// counts into bins (`hist`, up to 4096), sums the bins 16 at a time from the top (`group`, 256),
// and one thread walks those sums and then 16 bins. (The caller holds the bins: one 32 KB array,
// where each instantiation would declare its own.)
template <typename W>
__device__ u32 radix_select(int n, u64 target, float lo, u64* left, u64* hist, u64* group, W w) {
    __shared__ u32 prefix_s;
    __shared__ u64 left_s;
    const float scale = lo < 0.0f ? 4096.0f / -lo : 0.0f;
    auto band_of = [&](u32 key) { return min(max((int)((key_score(key) - lo) * scale), 0), 4095); };
    if (threadIdx.x == 0) { prefix_s = 0; left_s = target; }
    u32 mask = 0;
    int shift = 32, band = -1;
    for (int round = 0; round < 4; round++) {
        int bits = round < 2 ? 12 : 10, bins = 1 << bits, groups = bins / 16;
        if (round > 0) shift -= bits;
        for (int b = threadIdx.x; b < bins; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        u32 prefix = prefix_s;
#pragma unroll 4
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            u32 key;
            u64 v = w(i, &key);
            if (!v) continue;
            if (round == 0) atomicAdd(&hist[band_of(key)], v);
            else if ((key & mask) == prefix && band_of(key) == band) atomicAdd(&hist[(key >> shift) & (u32)(bins - 1)], v);
        }
        __syncthreads();
        // Group g holds bins bins - 16 (g + 1) .. bins - 16 g - 1 (group 0 the highest).
        for (int g = threadIdx.x; g < groups; g += blockDim.x) {
            u64 s = 0;
            for (int b = bins - 16 * (g + 1); b < bins - 16 * g; b++) s += hist[b];
            group[g] = s;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 need = left_s, run = 0;
            int g = 0;
            for (; g < groups - 1 && run + group[g] < need; g++) run += group[g];
            int b = bins - 16 * g - 1;
            for (; b > bins - 16 * (g + 1) && run + hist[b] < need; b--) run += hist[b];
            // Round 0 chose a band (kept in prefix_s until round 1 reads it).
            prefix_s = round == 0 ? (u32)b : prefix | ((u32)b << shift);
            left_s = need - run;
        }
        __syncthreads();
        if (round == 0) {
            band = (int)prefix_s;
            __syncthreads();
            if (threadIdx.x == 0) prefix_s = 0;
        } else {
            mask |= (u32)(bins - 1) << shift;
        }
    }
    *left = left_s;
    return prefix_s;
}
// The draw once top-k has cut the candidates to `top_k` <= SMALL_TOP_K ids (key > k, or key == k
// and id <= cut): they are gathered into shared memory (`scratch`, the radix bins' 32 KB) and
// ranked there, in score order for top-p and in id order for the draw, by one thread.
#define SMALL_TOP_K 1024
template <typename K>
__device__ u32 draw_among_few(int n, u32 k, u32 cut, float top_p, double u, u64* scratch, K key_of) {
    __shared__ u32 gathered;
    __shared__ u32 picked;
    u64* weight = scratch;
    u32 *ids = (u32*)(scratch + SMALL_TOP_K), *keys = ids + SMALL_TOP_K, *by_id = keys + SMALL_TOP_K, *by_score = by_id + SMALL_TOP_K;
    if (threadIdx.x == 0) gathered = 0;
    __syncthreads();
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        u32 key = key_of(i);
        if (kept(key, i, k, cut)) {
            u32 j = atomicAdd(&gathered, 1u);
            if (j < SMALL_TOP_K) {
                ids[j] = i;
                keys[j] = key;
            }
        }
    }
    __syncthreads();
    int c = min((int)gathered, SMALL_TOP_K);
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        int in_ids = 0, in_scores = 0;
        for (int l = 0; l < c; l++) {
            in_ids += ids[l] < ids[j];
            in_scores += keys[l] > keys[j] || (keys[l] == keys[j] && ids[l] < ids[j]);
        }
        by_id[in_ids] = j;
        by_score[in_scores] = j;
        weight[j] = key_weight(keys[j]);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        // Kept: the first `keep` in score order; a key above `low`, or equal to it with an id up
        // to `last` (the boundary as the full-row passes write it).
        int keep = c;
        if (top_p < 1.0f) {
            u64 total = 0, run = 0;
            for (int q = 0; q < c; q++) total += weight[q];
            u64 target = nucleus_target(top_p, total);
            for (keep = 0; keep < c && run < target;) run += weight[by_score[keep++]];
        }
        u32 low = keys[by_score[keep - 1]], last = ids[by_score[keep - 1]];
        u64 total = 0, run = 0;
        for (int q = 0; q < c; q++) total += kept(keys[q], ids[q], low, last) ? weight[q] : 0ull;
        u64 r = draw_point(u, total);
        picked = 0xffffffffu;
        for (int q = 0; q < c; q++) {
            int j = by_id[q];
            if (!kept(keys[j], ids[j], low, last)) continue;
            run += weight[j];
            if (r < run) { picked = ids[j]; break; }
        }
    }
    __syncthreads();
    return picked;
}
extern "C" __global__ void __launch_bounds__(1024) sample_rows(float* const* rows, const double* params, u32* out) {
    pdl_enter();
    const float* x = rows[blockIdx.x];
    const double* p = params + 6 * (size_t)blockIdx.x;
    int n = (int)p[0];
    float inv_t = (float)p[1], top_p = (float)p[3];
    u64 top_k = (u64)p[2];
    double u = p[4];
    int argmax = (int)p[5];
    __shared__ u64 hist[4096], group[256];
    float m = NEG_INF;
    if (argmax >= 0 && argmax < n) {
        m = x[argmax];
    } else {
#pragma unroll 4
        for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, x[i]);
        m = block_max(m);
    }
    auto key_of = [&](int i) { return candidate_key(x[i], m, inv_t); };
    // The kept set: every candidate, until a cut moves the boundary.
    u32 k = 0, cut = 0xffffffffu;
    auto weight_kept = [&](int i) {
        u32 key = key_of(i);
        return kept(key, i, k, cut) ? key_weight(key) : 0ull;
    };
    u64 count = 0, total = 0;
    float lo = 0.0f;
#pragma unroll 4
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        u32 key = key_of(i);
        count += key != 0u;
        total += key != 0u ? key_weight(key) : 0ull;
        lo = key != 0u ? fminf(lo, key_score(key)) : lo;
    }
    block_sum_u64x2(count, total);
    lo = -block_max(-lo);
    if (count == 0) {
        if (threadIdx.x == 0) out[blockIdx.x] = 0xffffffffu;
        return;
    }
    // Sums the weight kept now, where a cut has moved the boundary.
    auto total_kept = [&]() {
        u64 t = 0, unused = 0;
#pragma unroll 4
        for (int i = threadIdx.x; i < n; i += blockDim.x) t += weight_kept(i);
        block_sum_u64x2(t, unused);
        return t;
    };
    if (top_k > 0 && top_k < count) {
        u64 ties;
        k = radix_select(n, top_k, lo, &ties, hist, group, [&](int i, u32* key) { *key = key_of(i); return (u64)(*key != 0u); });
        cut = first_crossing(n, ties - 1, [&](int i) { return (u64)(key_of(i) == k); });
        if (top_k <= SMALL_TOP_K) {
            u32 id = draw_among_few(n, k, cut, top_p, u, hist, key_of);
            if (threadIdx.x == 0) out[blockIdx.x] = id;
            return;
        }
        total = total_kept();
    }
    if (top_p < 1.0f) {
        u64 target = nucleus_target(top_p, total);
        u64 left;
        u32 kp = radix_select(n, target, lo, &left, hist, group, [&](int i, u32* key) {
            *key = key_of(i);
            return kept(*key, i, k, cut) ? key_weight(*key) : 0ull;
        });
        cut = first_crossing(n, left - 1, [&](int i) {
            u32 key = key_of(i);
            return key == kp && kept(key, i, k, cut) ? key_weight(key) : 0ull;
        });
        k = kp;
        total = total_kept();
    }
    u32 id = first_crossing(n, draw_point(u, total), weight_kept);
    if (threadIdx.x == 0) out[blockIdx.x] = id;
}
