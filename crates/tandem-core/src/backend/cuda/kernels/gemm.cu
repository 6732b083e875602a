// The exact (f32) GEMM of a prefill; the tensor-core GEMMs are cuBLAS's.

// out[m, r] (+)= x[m, :] . W[r, :] for any t, in f32 (the exact path of a prefill): 64 x 64
// output tiles, 16 x 16 threads of 4 x 4 outputs each, k in steps of 16; `accumulate` adds to
// out (a residual connection).
// The weights as stored (bf16) or as dequantized from a block format (f32, gemm_f32_f32).
__device__ __forceinline__ float weight_f32(bf16_t w) { return bf16_to_f32(w); }
__device__ __forceinline__ float weight_f32(float w) { return w; }

template <typename W>
__device__ void gemm_f32_body(const W* w, const float* x, float* out, int n, int k, int t, int accumulate) {
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
            ws[kk][rr] = (gr < n && gk < k) ? weight_f32(w[(size_t)gr * k + gk]) : 0.0f;
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
extern "C" __global__ void gemm_bf16_f32(const bf16_t* w, const float* x, float* out, int n, int k, int t, int accumulate) { gemm_f32_body(w, x, out, n, k, t, accumulate); }
extern "C" __global__ void gemm_f32_f32(const float* w, const float* x, float* out, int n, int k, int t, int accumulate) { gemm_f32_body(w, x, out, n, k, t, accumulate); }
