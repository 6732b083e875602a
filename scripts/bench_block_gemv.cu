// Times the decode GEMV of block weights for one token alone, as the engine launches it
// (kernels/blocks.cu block_input, then gemv_<format>_t1_plain, with programmatic dependent
// launch), at the 9B's shapes in Q4_K and its LM head in Q6_K, for 8, 4 and 2 rows per block,
// rotating through copies of each matrix so that the weights come from memory. Prints µs per
// GEMV (median of 5 runs of 200, min - max), GB/s of weights and its fraction of the copy
// bandwidth measured in the same run, and the largest difference between the rows-per-block
// outputs. scripts/bench-block-gemv.sh builds it with nvcc.
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "common.cuh"
#include "norm.cu"
#include "blocks.cu"
#include "gemv.cu"
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

__global__ void fill_bytes(unsigned char* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995; h ^= h >> 15;
        p[i] = (unsigned char)h;
    }
}
// Every f16 scale of the matrix small and positive: Q4_K's d and dmin (a block's first 4 bytes,
// 144-byte blocks), or Q6_K's d (after a row's block bodies).
__global__ void fix_scales(unsigned char* p, size_t rows, size_t row_bytes, int k, int q6k) {
    size_t blocks = (size_t)(k / 256);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < rows * blocks; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / blocks, b = i % blocks;
        unsigned short* h = q6k ? (unsigned short*)(p + r * row_bytes + blocks * 208) + b : (unsigned short*)(p + r * row_bytes + b * 144);
        h[0] = 0x1c00 + (i & 0xff);
        if (!q6k) h[1] = 0x1800 + ((i >> 3) & 0xff);
    }
}
__global__ void fill_floats(float* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995; h ^= h >> 15;
        p[i] = ((h & 0xffff) / 65536.0f - 0.5f) * 2.0f;
    }
}

static cudaStream_t stream;
template <typename... K, typename... A>
static void launch(void (*kernel)(K...), int grid, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid); cfg.blockDim = dim3(256); cfg.stream = stream;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at; cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

typedef void (*Gemv)(const unsigned char*, float*, int, const unsigned char*, float*, int, const unsigned char*, float*, int, const unsigned char*, float*, int,
                     const float*, const float*, const float*, int, int, int, int, float, int);

int main() {
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    double copy;
    {
        size_t bytes = 1ull << 30;
        void *a, *b;
        CK(cudaMalloc(&a, bytes)); CK(cudaMalloc(&b, bytes));
        cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
        std::vector<float> ts;
        for (int i = 0; i < 7; i++) {
            cudaEventRecord(e0, stream); CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream)); cudaEventRecord(e1, stream);
            CK(cudaEventSynchronize(e1)); float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms);
        }
        std::sort(ts.begin(), ts.end());
        copy = 2.0 * bytes / (ts[3] * 1e-3) / 1e9;
        printf("copy bandwidth: %.0f GB/s (read + written, median of 7)\n", copy);
        cudaFree(a); cudaFree(b);
    }
    struct Shape { const char* what; int format, n, k; bool norm; };
    Shape shapes[] = {{"DeltaNet in, Q4_K", BLOCK_Q4_K, 12352, 4096, true}, {"DeltaNet out, Q4_K", BLOCK_Q4_K, 4096, 4096, false}, {"MLP gate + up, Q4_K", BLOCK_Q4_K, 24576, 4096, true},
                      {"MLP down, Q4_K", BLOCK_Q4_K, 4096, 12288, false}, {"LM head, Q6_K", BLOCK_Q6_K, 248320, 4096, true}};
    for (const Shape& sh : shapes) {
        int n = sh.n, k = sh.k;
        bool q6k = sh.format == BLOCK_Q6_K;
        size_t row = q6k ? ((size_t)(k / 256) * 210 + 15) / 16 * 16 : (size_t)(k / 256) * 144, mat = row * n;
        int copies = (int)std::max<size_t>(3, (800ull << 20) / mat + 1);
        unsigned char* w;
        CK(cudaMalloc(&w, mat * copies));
        fill_bytes<<<1024, 256>>>(w, mat * copies, 7);
        fix_scales<<<1024, 256>>>(w, (size_t)n * copies, row, k, q6k);
        float *x, *scale, *out;
        unsigned *q, *sums;
        CK(cudaMalloc(&x, k * 4)); CK(cudaMalloc(&scale, k * 4)); CK(cudaMalloc(&out, (size_t)n * 4));
        CK(cudaMalloc(&q, k * 2)); CK(cudaMalloc(&sums, (k / 8 + 1) * 4));
        fill_floats<<<64, 256>>>(x, k, 3); fill_floats<<<64, 256>>>(scale, k, 5);
        CK(cudaDeviceSynchronize());
        const float* sp = sh.norm ? scale : nullptr;
        const float eps = 1e-6f;
        Gemv kernel = q6k ? gemv_q6_k_t1_plain : gemv_q4_k_t1_plain;
        const int NV = 3, rbs[NV] = {8, 4, 2};
        auto run = [&](int i, int rb) {
            launch(block_input, BLOCK_INPUT_PARTS, (const float*)x, sp, k, eps, 0, sh.format, q, sums);
            launch(kernel, (n + rb - 1) / rb, (const unsigned char*)(w + (size_t)(i % copies) * mat), out, n, (const unsigned char*)nullptr, (float*)nullptr, 0, (const unsigned char*)nullptr,
                   (float*)nullptr, 0, (const unsigned char*)nullptr, (float*)nullptr, 0, (const float*)q, (const float*)sums, (const float*)nullptr, k, 1, rb, 0, eps, 0);
        };
        printf("\n%s, %d x %d: %.1f MB\n", sh.what, n, k, mat / 1e6);
        std::vector<std::vector<float>> times(NV), outs(NV, std::vector<float>(n));
        cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
        const int iters = 200;
        for (int rep = 0; rep < 5; rep++)
            for (int v = 0; v < NV; v++) {
                for (int i = 0; i < 10; i++) run(i, rbs[v]);
                cudaEventRecord(e0, stream);
                for (int i = 0; i < iters; i++) run(i, rbs[v]);
                cudaEventRecord(e1, stream);
                CK(cudaEventSynchronize(e1));
                float ms; cudaEventElapsedTime(&ms, e0, e1);
                times[v].push_back(ms * 1e3f / iters);
            }
        for (int v = 0; v < NV; v++) {
            run(0, rbs[v]);
            CK(cudaStreamSynchronize(stream));
            CK(cudaMemcpy(outs[v].data(), out, (size_t)n * 4, cudaMemcpyDeviceToHost));
            double diff = 0, top = 0;
            for (int i = 0; i < n; i++) { diff = std::max(diff, (double)fabsf(outs[v][i] - outs[0][i])); top = std::max(top, (double)fabsf(outs[0][i])); }
            std::vector<float> t = times[v];
            std::sort(t.begin(), t.end());
            double gbs = mat / (t[2] * 1e-6) / 1e9;
            printf("  %d rows per block: %7.2f us (%.2f - %.2f)  %5.0f GB/s  %3.0f%% of copy  (largest difference from 8 rows per block %.2g, of outputs up to %.3g)\n", rbs[v], t[2], t[0], t[4], gbs,
                   100 * gbs / copy, diff, top);
        }
        cudaFree(w); cudaFree(x); cudaFree(scale); cudaFree(out); cudaFree(q); cudaFree(sums);
    }
    return 0;
}
