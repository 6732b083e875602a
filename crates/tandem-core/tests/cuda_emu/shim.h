// tandem's CUDA kernels on CPU threads (tests/cuda_on_cpu.rs): one std::thread per CUDA thread,
// one block after another, so that __shared__ can be a function-local static. Barriers stand for
// __syncthreads and for a warp's shuffles; a thread that returns drops out of both. What this
// checks is a kernel's logic (indexing, barriers, the hand-over between blocks), not its speed
// and not the GPU's memory model. The tensor-core instruction is computed from the fragment
// layout of the PTX ISA (mma.m16n8k16, bf16 operands, f32 sums): mma_emulated; so is the
// shared-memory load of its operands (ldmatrix): ldmatrix_emulated.
#pragma once
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>
#include <algorithm>
using std::min; using std::max;
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
struct int2 { int x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
struct uint2 { unsigned x, y; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct dim3_ { unsigned x = 0, y = 0, z = 0; };
inline thread_local dim3_ threadIdx, blockIdx;
inline dim3_ blockDim, gridDim;
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n)
#define __shared__ static
#define __restrict__
// std::barrier, for compilers without C++20: a thread that drops out lowers the count.
class Barrier {
    std::mutex m;
    std::condition_variable cv;
    int count, waiting = 0;
    unsigned long generation = 0;
    void release() { waiting = 0; generation++; cv.notify_all(); }
  public:
    explicit Barrier(int n) : count(n) {}
    void arrive_and_wait() {
        std::unique_lock<std::mutex> lock(m);
        unsigned long g = generation;
        if (++waiting == count) release();
        else cv.wait(lock, [&] { return generation != g; });
    }
    void arrive_and_drop() {
        std::unique_lock<std::mutex> lock(m);
        if (--count > 0 && waiting == count) release();
    }
};
struct Block {
    std::unique_ptr<Barrier> all;
    std::vector<std::unique_ptr<Barrier>> warps;
    float xbuf[32][32];
    uint32_t abuf[32][32][4], bbuf[32][32][2];
    const uint16_t* rows[32][32];
};
inline Block* g_block;
inline void __syncthreads() { g_block->all->arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __trap() { abort(); }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
template <typename T> inline T __ldcg(const T* p) { return *(volatile const T*)p; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return reinterpret_cast<std::atomic<unsigned>*>(p)->fetch_add(v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return reinterpret_cast<std::atomic<unsigned long long>*>(p)->fetch_add(v); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline int __float2int_rn(float x) { return (int)std::nearbyint(x); }
// Two 16-bit integers of a times bytes 0, 1 (lo) or 2, 3 (hi) of b, all signed, plus c.
inline int __dp2a_lo(int a, int b, int c) { return c + (short)(a & 0xffff) * (signed char)(b & 0xff) + (short)(a >> 16) * (signed char)((b >> 8) & 0xff); }
inline int __dp2a_hi(int a, int b, int c) { return c + (short)(a & 0xffff) * (signed char)((b >> 16) & 0xff) + (short)(a >> 16) * (signed char)(b >> 24); }
// Four signed bytes of a times four of b, plus c.
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (signed char)((a >> (8 * i)) & 0xff) * (signed char)((b >> (8 * i)) & 0xff);
    return c;
}
inline float __fdiv_rn(float a, float b) { return a / b; }
inline void warp_sync() { g_block->warps[threadIdx.x >> 5]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int m) {
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    g_block->xbuf[w][l] = v;
    warp_sync();
    float r = g_block->xbuf[w][l ^ m];
    warp_sync();
    return r;
}
inline float __shfl_sync(unsigned, float v, int src) {
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    g_block->xbuf[w][l] = v;
    warp_sync();
    float r = g_block->xbuf[w][src & 31];
    warp_sync();
    return r;
}
inline unsigned __shfl_xor_sync(unsigned mask, unsigned v, int m) { return __float_as_uint(__shfl_xor_sync(mask, __uint_as_float(v), m)); }
inline int __shfl_xor_sync(unsigned mask, int v, int m) { return (int)__shfl_xor_sync(mask, (unsigned)v, m); }
// Whether any lane of the warp passes a true predicate (every lane calls it).
inline bool __any_sync(unsigned, bool p) {
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    g_block->xbuf[w][l] = p ? 1.0f : 0.0f;
    warp_sync();
    bool any = false;
    for (int i = 0; i < 32; i++) any = any || g_block->xbuf[w][i] != 0.0f;
    warp_sync();
    return any;
}
inline float bf16_value(uint32_t bits) { return __uint_as_float(bits << 16); }
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d += a . b, for the calling lane: lane l
// (group g = l / 4, t = l % 4) holds A[g (+8)][2t (+1) (+8)] in a[0..4] (a[1]: row + 8, a[2]:
// column + 8), B[2t (+1) (+8)][g] in b0, b1 and D[g (+8)][2t (+1)] in d[0..4], the lower column
// of a pair in the low half of a register.
inline void mma_emulated(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    for (int i = 0; i < 4; i++) g_block->abuf[w][l][i] = a[i];
    g_block->bbuf[w][l][0] = b0;
    g_block->bbuf[w][l][1] = b1;
    warp_sync();
    float A[16][16], B[16][8];
    for (int lane = 0; lane < 32; lane++) {
        int g = lane >> 2, t = lane & 3;
        for (int i = 0; i < 4; i++)
            for (int h = 0; h < 2; h++) A[g + (i & 1) * 8][t * 2 + h + (i >> 1) * 8] = bf16_value(h ? g_block->abuf[w][lane][i] >> 16 : g_block->abuf[w][lane][i] & 0xffff);
        for (int i = 0; i < 2; i++)
            for (int h = 0; h < 2; h++) B[t * 2 + h + i * 8][g] = bf16_value(h ? g_block->bbuf[w][lane][i] >> 16 : g_block->bbuf[w][lane][i] & 0xffff);
    }
    warp_sync();
    int g = l >> 2, t = l & 3;
    for (int e = 0; e < 4; e++) {
        float s = 0;
        for (int k = 0; k < 16; k++) s += A[g + (e >> 1) * 8][k] * B[k][t * 2 + (e & 1)];
        d[e] += s;
    }
}
// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16 for the calling lane: lane l gives the address
// of row l % 8 of matrix l / 8; r[i] gets matrix i's row l / 4, columns 2 (l % 4) and +1 (with
// TRANS: column l / 4, rows 2 (l % 4) and +1), the lower index in the low half.
template <bool TRANS, typename T>
inline void ldmatrix_emulated(uint32_t* r, const T* p) {
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    g_block->rows[w][l] = (const uint16_t*)p;
    warp_sync();
    for (int i = 0; i < 4; i++) {
        if (TRANS) {
            const uint16_t *a = g_block->rows[w][i * 8 + (l & 3) * 2], *b = g_block->rows[w][i * 8 + (l & 3) * 2 + 1];
            r[i] = (uint32_t)a[l >> 2] | ((uint32_t)b[l >> 2] << 16);
        } else {
            const uint16_t* row = g_block->rows[w][i * 8 + (l >> 2)];
            r[i] = (uint32_t)row[(l & 3) * 2] | ((uint32_t)row[(l & 3) * 2 + 1] << 16);
        }
    }
    warp_sync();
}
// Run `kernel` (a call of one kernel) for every block of the grid (x, y, z), `threads` each.
template <typename F>
void launch(unsigned gx, unsigned gy, unsigned gz, unsigned threads, F kernel) {
    blockDim = {threads, 1, 1};
    gridDim = {gx, gy, gz};
    for (unsigned z = 0; z < gz; z++)
        for (unsigned y = 0; y < gy; y++)
            for (unsigned x = 0; x < gx; x++) {
                Block b;
                b.all = std::make_unique<Barrier>(threads);
                for (unsigned w = 0; w < threads / 32; w++) b.warps.push_back(std::make_unique<Barrier>(32));
                g_block = &b;
                std::vector<std::thread> ts;
                for (unsigned t = 0; t < threads; t++)
                    ts.emplace_back([&, t, x, y, z] {
                        threadIdx = {t, 0, 0};
                        blockIdx = {x, y, z};
                        kernel();
                        b.warps[t >> 5]->arrive_and_drop();
                        b.all->arrive_and_drop();
                    });
                for (auto& th : ts) th.join();
            }
}
