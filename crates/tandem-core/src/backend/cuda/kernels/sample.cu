// Sampling on the GPU: the greedy pick of each row of logits, and a draw at a temperature.

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

// Sampling at a temperature with no top-k or top-p cut (sampling.rs Sampler::sample, the
// host's form, and sample_reference.cpp): scores (logit - max) * inv_t; those above -30 weigh
// round(exp(score) * 2^40) as integers, so that the sums are exact whatever their order; r =
// u * total (u uniform in [0, 1), drawn by the host's generator) picks the first id whose
// running weight passes r. The row stays on the GPU; one index comes back. One block of 256
// threads per row, each owning a run of ids; out[0] = the id, or 0xffffffff where no logit
// qualifies (all NaN or -inf: the host decides). The weights may differ from the host's in
// their last bits (expf), so a draw that lands on a boundary may pick the neighbour.
__device__ __forceinline__ unsigned long long sample_weight(float logit, float max, float inv_t) {
    float s = (logit - max) * inv_t;
    return s > -30.0f ? (unsigned long long)llround((double)expf(s) * 1099511627776.0) : 0ull;
}
extern "C" __global__ void __launch_bounds__(256) sample_row(const float* logits, int n, float inv_t, double u, u32* out) {
    pdl_enter();
    __shared__ unsigned long long below[256];
    __shared__ unsigned long long total_s;
    int tid = threadIdx.x, per = (n + blockDim.x - 1) / blockDim.x, p0 = min(n, tid * per), p1 = min(n, p0 + per);
    float m = NEG_INF;
    for (int i = p0; i < p1; i++) m = fmaxf(m, logits[i]);
    m = block_max(m);
    unsigned long long mine = 0;
    for (int i = p0; i < p1; i++) mine += sample_weight(logits[i], m, inv_t);
    below[tid] = mine;
    __syncthreads();
    if (tid == 0) {
        unsigned long long run = 0;
        for (int t = 0; t < (int)blockDim.x; t++) {
            unsigned long long w = below[t];
            below[t] = run;
            run += w;
        }
        total_s = run;
    }
    __syncthreads();
    unsigned long long total = total_s;
    if (total == 0) {
        if (tid == 0) out[0] = 0xffffffffu;
        return;
    }
    unsigned long long r = (unsigned long long)(u * (double)total);
    if (r > total - 1) r = total - 1;
    unsigned long long run = below[tid];
    if (r < run || r >= run + mine) return;
    for (int i = p0; i < p1; i++) {
        run += sample_weight(logits[i], m, inv_t);
        if (r < run) {
            out[0] = (u32)i;
            return;
        }
    }
}
