// Times the decode GEMV of block weights for one token alone, as the engine launches it
// (kernels/blocks.cu block_input or block_input8, then the GEMV, with programmatic dependent
// launch), at the 9B's shapes in Q4_K and its LM head in Q6_K, rotating through copies of each
// matrix so that the weights come from memory: the 16-bit inputs (gemv_<format>_t1_plain), the
// int8 inputs of precision=fast (gemv_<format>_a8_t1_plain, BlockChunk8::R rows a warp), and
// the int8 inputs with R = 1, 2, 4 rows per warp sharing each lane's inputs (gemv_a8_rows
// below, the engine's loop without its matrices, tokens and SwiGLU) and Q4_K rows of 4096
// streamed by a grid the GPU runs at once (gemv_a8_stream); first each kernel's registers a
// thread. Prints µs per GEMV (median of 5 runs of 200, min - max), GB/s of weights and its
// fraction of the copy bandwidth measured in the same run, and the largest difference of each
// variant's outputs from the 16-bit inputs' (int8 inputs: their rounding) and from the
// engine's int8 GEMV (the R variants: the same sums in the same order, 0 expected).
// scripts/bench-block-gemv.sh builds it with nvcc.
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

// R rows per warp (8 warps a block): each lane loads its unit's inputs once for the R rows.
template <int F, int R>
__global__ void __launch_bounds__(256) gemv_a8_rows(const unsigned char* w, float* out, int n, const float* x, const float* x2, int k) {
    typedef BlockChunk8<F> C;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r0 = (blockIdx.x * 8 + warp) * R, kc = k / C::U;
    const unsigned char* q = (const unsigned char*)x;
    const int* sums = (const int*)x2;
    const float* scales = x2 + k / 8;
    const unsigned char* rows[R];
#pragma unroll
    for (int i = 0; i < R; i++) rows[i] = w + (size_t)min(r0 + i, n - 1) * block_row_bytes<F>(k);
    typename C::Raw pre[C::PRE][R];
#pragma unroll
    for (int j = 0; j < C::PRE; j++)
        if (lane + 32 * j < kc)
#pragma unroll
            for (int i = 0; i < R; i++) pre[j][i] = C::load(rows[i], k, lane + 32 * j);
    pdl_enter();
    float acc[R];
#pragma unroll
    for (int i = 0; i < R; i++) acc[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < C::PRE; j++) {
        int c = lane + 32 * j;
        if (c < kc) {
            typename C::In in = C::inputs(q, sums, scales, c, k, 0);
#pragma unroll
            for (int i = 0; i < R; i++) acc[i] += C::dot(C::decode(pre[j][i], c), in);
        }
    }
#pragma unroll 1
    for (int c = lane + 32 * C::PRE; c < kc; c += 32) {
        typename C::Raw raw[R];
#pragma unroll
        for (int i = 0; i < R; i++) raw[i] = C::load(rows[i], k, c);
        typename C::In in = C::inputs(q, sums, scales, c, k, 0);
#pragma unroll
        for (int i = 0; i < R; i++) acc[i] += C::dot(C::decode(raw[i], c), in);
    }
#pragma unroll
    for (int i = 0; i < R; i++) {
        float a = warp_sum(acc[i]);
        if (lane == 0 && r0 + i < n) out[r0 + i] = a;
    }
}

// Q4_K rows of 4096 streamed (a lane per two units): a grid the GPU runs at once (MINB blocks
// an SM), warp g of W taking rows g, g + W, ..., its lanes' inputs held in registers for every
// row and the next row's weights loaded while this one's are multiplied.
template <int MINB>
__global__ void __launch_bounds__(256, MINB) gemv_a8_stream(const unsigned char* w, float* out, int n, const float* x, const float* x2, int k) {
    typedef BlockChunk8<BLOCK_Q4_K> C;
    int lane = threadIdx.x & 31, warps = gridDim.x * 8, r = blockIdx.x * 8 + (threadIdx.x >> 5);
    size_t rb = block_row_bytes<BLOCK_Q4_K>(k);
    const unsigned char* q = (const unsigned char*)x;
    const int* sums = (const int*)x2;
    const float* scales = x2 + k / 8;
    C::Raw a0, a1;
    if (r < n) { a0 = C::load(w + (size_t)r * rb, k, lane); a1 = C::load(w + (size_t)r * rb, k, lane + 32); }
    pdl_enter();
    C::In i0 = C::inputs(q, sums, scales, lane, k, 0), i1 = C::inputs(q, sums, scales, lane + 32, k, 0);
#pragma unroll 1
    for (; r < n; r += warps) {
        C::Raw b0 = a0, b1 = a1;
        if (r + warps < n) { b0 = C::load(w + (size_t)(r + warps) * rb, k, lane); b1 = C::load(w + (size_t)(r + warps) * rb, k, lane + 32); }
        float acc = 0.0f;
        acc += C::dot(C::decode(a0, lane), i0);
        acc += C::dot(C::decode(a1, lane + 32), i1);
        acc = warp_sum(acc);
        if (lane == 0) out[r] = acc;
        a0 = b0; a1 = b1;
    }
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
    {
        // Registers a thread of each kernel (what bounds the blocks an SM holds).
        struct K { const char* name; const void* f; } ks[] = {{"gemv_q4_k_t1_plain", (const void*)gemv_q4_k_t1_plain}, {"gemv_q4_k_a8_t1_plain", (const void*)gemv_q4_k_a8_t1_plain},
            {"gemv_q6_k_a8_t1_plain", (const void*)gemv_q6_k_a8_t1_plain}, {"gemv_a8_rows<Q4_K, 1>", (const void*)gemv_a8_rows<BLOCK_Q4_K, 1>}, {"gemv_a8_rows<Q6_K, 2>", (const void*)gemv_a8_rows<BLOCK_Q6_K, 2>},
            {"gemv_a8_stream<2>", (const void*)gemv_a8_stream<2>}, {"gemv_a8_stream<3>", (const void*)gemv_a8_stream<3>}, {"block_input8", (const void*)block_input8}};
        for (const K& k : ks) {
            cudaFuncAttributes a;
            CK(cudaFuncGetAttributes(&a, k.f));
            printf("%-24s %3d registers, %zu bytes of local memory a thread\n", k.name, a.numRegs, a.localSizeBytes);
        }
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
        CK(cudaMalloc(&q, k * 2)); CK(cudaMalloc(&sums, (k / 8 + k / 256 + 1) * 4));
        fill_floats<<<64, 256>>>(x, k, 3); fill_floats<<<64, 256>>>(scale, k, 5);
        CK(cudaDeviceSynchronize());
        const float* sp = sh.norm ? scale : nullptr;
        const float eps = 1e-6f;
        Gemv i16 = q6k ? gemv_q6_k_t1_plain : gemv_q4_k_t1_plain, a8 = q6k ? gemv_q6_k_a8_t1_plain : gemv_q4_k_a8_t1_plain;
        typedef void (*Rows)(const unsigned char*, float*, int, const float*, const float*, int);
        Rows rows1 = q6k ? gemv_a8_rows<BLOCK_Q6_K, 1> : gemv_a8_rows<BLOCK_Q4_K, 1>, rows2 = q6k ? gemv_a8_rows<BLOCK_Q6_K, 2> : gemv_a8_rows<BLOCK_Q4_K, 2>,
             rows4 = q6k ? gemv_a8_rows<BLOCK_Q6_K, 4> : gemv_a8_rows<BLOCK_Q4_K, 4>;
        const int NV = 7;
        const char* names[NV] = {"16-bit inputs, 8 rows a block", "int8 inputs (engine)", "int8, 1 row a warp", "int8, 2 rows a warp", "int8, 4 rows a warp", "int8, streamed, 2 blocks an SM", "int8, streamed, 3 blocks an SM"};
        // The streamed variants: Q4_K rows of 4096 only, as many blocks as run at once.
        bool streams = !q6k && k == 4096;
        int sms = 0, per_sm2 = 0, per_sm3 = 0;
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm2, gemv_a8_stream<2>, 256, 0));
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm3, gemv_a8_stream<3>, 256, 0));
        const int per = 8 * (q6k ? BlockChunk8<BLOCK_Q6_K>::R : BlockChunk8<BLOCK_Q4_K>::R);  // rows a block of the engine's int8 GEMV
        auto run = [&](int i, int v) {
            const unsigned char* wi = w + (size_t)(i % copies) * mat;
            const unsigned char* none = nullptr;
            if (v == 0) {
                launch(block_input, BLOCK_INPUT_PARTS, (const float*)x, sp, k, eps, 0, sh.format, q, sums);
                launch(i16, (n + 7) / 8, wi, out, n, none, (float*)nullptr, 0, none, (float*)nullptr, 0, none, (float*)nullptr, 0, (const float*)q, (const float*)sums, (const float*)nullptr, k, 1, 8, 0, eps, 0);
                return;
            }
            launch(block_input8, BLOCK_INPUT_PARTS, (const float*)x, sp, k, eps, 0, sh.format, (unsigned char*)q, sums);
            if (v == 1) launch(a8, (n + per - 1) / per, wi, out, n, none, (float*)nullptr, 0, none, (float*)nullptr, 0, none, (float*)nullptr, 0, (const float*)q, (const float*)sums, (const float*)nullptr, k, 1, 8, 0, eps, 0);
            else if (v == 5) launch(gemv_a8_stream<2>, std::min(sms * per_sm2, (n + 7) / 8), wi, out, n, (const float*)q, (const float*)sums, k);
            else if (v == 6) launch(gemv_a8_stream<3>, std::min(sms * per_sm3, (n + 7) / 8), wi, out, n, (const float*)q, (const float*)sums, k);
            else {
                int r = v == 2 ? 1 : v == 3 ? 2 : 4;
                launch(v == 2 ? rows1 : v == 3 ? rows2 : rows4, (n + 8 * r - 1) / (8 * r), wi, out, n, (const float*)q, (const float*)sums, k);
            }
        };
        printf("\n%s, %d x %d: %.1f MB\n", sh.what, n, k, mat / 1e6);
        std::vector<std::vector<float>> times(NV), outs(NV, std::vector<float>(n));
        cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
        const int iters = 200;
        for (int rep = 0; rep < 5; rep++)
            for (int v = 0; v < NV; v++) {
                if (v >= 5 && !streams) continue;
                for (int i = 0; i < 10; i++) run(i, v);
                cudaEventRecord(e0, stream);
                for (int i = 0; i < iters; i++) run(i, v);
                cudaEventRecord(e1, stream);
                CK(cudaEventSynchronize(e1));
                float ms; cudaEventElapsedTime(&ms, e0, e1);
                times[v].push_back(ms * 1e3f / iters);
            }
        if (streams) printf("  (streamed: %d and %d blocks an SM resident)\n", per_sm2, per_sm3);
        for (int v = 0; v < NV; v++) {
            if (v >= 5 && !streams) continue;
            run(0, v);
            CK(cudaStreamSynchronize(stream));
            CK(cudaMemcpy(outs[v].data(), out, (size_t)n * 4, cudaMemcpyDeviceToHost));
        }
        for (int v = 0; v < NV; v++) {
            if (v >= 5 && !streams) continue;
            double diff = 0, diff8 = 0, top = 0;
            for (int i = 0; i < n; i++) {
                diff = std::max(diff, (double)fabsf(outs[v][i] - outs[0][i]));
                diff8 = std::max(diff8, (double)fabsf(outs[v][i] - outs[1][i]));
                top = std::max(top, (double)fabsf(outs[0][i]));
            }
            std::vector<float> t = times[v];
            std::sort(t.begin(), t.end());
            double gbs = mat / (t[2] * 1e-6) / 1e9;
            printf("  %-30s %7.2f us (%.2f - %.2f)  %5.0f GB/s  %3.0f%% of copy  (largest difference from 16-bit inputs %.2g, from the engine's int8 %.2g, of outputs up to %.3g)\n", names[v], t[2], t[0], t[4], gbs,
                   100 * gbs / copy, diff, diff8, top);
        }
        cudaFree(w); cudaFree(x); cudaFree(scale); cudaFree(out); cudaFree(q); cudaFree(sums);
    }
    return 0;
}
