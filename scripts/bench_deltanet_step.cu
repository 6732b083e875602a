// Times deltanet_step_batch_128 alone (scripts/bench-deltanet-step.sh builds it with nvcc, the
// kernel sources copied beside it) at the 0.8B's shapes (hk = hv = 16, dk = dv = 128, conv
// 4 taps) for B sequences, against a device-to-device copy of the states; prints registers,
// local memory (spills) and blocks per SM. Median of 20 launches after 5.
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "common.cuh"
#include "norm.cu"
#include "gemv.cu"
#include "gemm.cu"
#include "deltanet_v.cu"
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
__global__ void fill(float* p, size_t n, unsigned seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995; h ^= h >> 15;
        p[i] = ((h & 0xffff) / 65536.0f - 0.5f) * scale;
    }
}
int main(int argc, char** argv) {
    int B = argc > 1 ? atoi(argv[1]) : 256;
    const int hk = 16, hv = 16, dk = 128, dv = 128, kk = 4, cd = 2 * hk * dk + hv * dv, vd = hv * dv;
    size_t state_n = (size_t)hv * dk * dv;
    float *states, *convs, *qkv, *z, *b, *a, *taps, *na, *dt, *nw, *core, *pss; unsigned* done;
    CK(cudaMalloc(&states, B * state_n * 4)); CK(cudaMalloc(&convs, (size_t)B * kk * cd * 4));
    CK(cudaMalloc(&qkv, (size_t)B * cd * 4)); CK(cudaMalloc(&z, (size_t)B * vd * 4));
    CK(cudaMalloc(&b, B * hv * 4)); CK(cudaMalloc(&a, B * hv * 4)); CK(cudaMalloc(&taps, kk * cd * 4));
    CK(cudaMalloc(&na, hv * 4)); CK(cudaMalloc(&dt, hv * 4)); CK(cudaMalloc(&nw, dv * 4));
    CK(cudaMalloc(&core, (size_t)B * vd * 4)); CK(cudaMalloc(&pss, (size_t)B * (vd / 32) * 8 * 4));
    CK(cudaMalloc(&done, B * hk * 4)); CK(cudaMemset(done, 0, B * hk * 4));
    fill<<<1024, 256>>>(states, B * state_n, 1, 0.1f); fill<<<1024, 256>>>(convs, (size_t)B * kk * cd, 2, 1.f);
    fill<<<1024, 256>>>(qkv, (size_t)B * cd, 3, 1.f); fill<<<1024, 256>>>(z, (size_t)B * vd, 4, 1.f);
    fill<<<64, 256>>>(b, B * hv, 5, 1.f); fill<<<64, 256>>>(a, B * hv, 6, 1.f); fill<<<64, 256>>>(taps, kk * cd, 7, 1.f);
    fill<<<1, 32>>>(na, hv, 8, -1.f); fill<<<1, 32>>>(dt, hv, 9, 1.f); fill<<<1, 128>>>(nw, dv, 10, 1.f);
    std::vector<float*> hs(B), hc(B);
    for (int i = 0; i < B; i++) { hs[i] = states + i * state_n; hc[i] = convs + (size_t)i * kk * cd; }
    float **ds, **dc; CK(cudaMalloc(&ds, B * 8)); CK(cudaMalloc(&dc, B * 8));
    CK(cudaMemcpy(ds, hs.data(), B * 8, cudaMemcpyHostToDevice)); CK(cudaMemcpy(dc, hc.data(), B * 8, cudaMemcpyHostToDevice));
    cudaFuncAttributes at; CK(cudaFuncGetAttributes(&at, deltanet_step_batch_128));
    int per_sm = 0; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, deltanet_step_batch_128, 512, 0));
    dim3 grid(hv * dv / 32, B);
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    auto time = [&](auto f) { std::vector<float> t; for (int r = 0; r < 25; r++) { cudaEventRecord(e0); f(); cudaEventRecord(e1); cudaEventSynchronize(e1); float ms; cudaEventElapsedTime(&ms, e0, e1); if (r >= 5) t.push_back(ms); } std::sort(t.begin(), t.end()); return t[t.size() / 2]; };
    float ms = time([&] { deltanet_step_batch_128<<<grid, 512>>>(dc, ds, qkv, z, b, a, taps, na, dt, nw, core, pss, done, hk, hv, dv, cd, kk, 1e-6f); });
    CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
    float* dst; CK(cudaMalloc(&dst, B * state_n * 4));
    float cms = time([&] { cudaMemcpyAsync(dst, states, B * state_n * 4, cudaMemcpyDeviceToDevice); });
    double bytes = 2.0 * B * state_n * 4;
    printf("LB=%d B=%d regs=%d local=%zu blocks/SM=%d: step %.3f ms, %.0f GB/s (copy of the states %.3f ms, %.0f GB/s): %.0f%%\n", LB, B, at.numRegs, at.localSizeBytes, per_sm, ms, bytes / ms / 1e6, cms, bytes / cms / 1e6, 100.0 * cms / ms);
    return 0;
}
