// Row-wise passes over activations: the embedding lookup, RMSNorm, SwiGLU, 1/rms, rounding
// to bf16.

// x[i, :] = embedding row ids[i]. Grid: tokens.
extern "C" __global__ void embed(const bf16_t* table, const u32* ids, float* x, int h) {
    pdl_enter();
    const bf16_t* row = table + (size_t)ids[blockIdx.x] * h;
    for (int c = threadIdx.x; c < h; c += blockDim.x) x[(size_t)blockIdx.x * h + c] = bf16_to_f32(row[c]);
}

// out = x / rms(x) * scale, per row of width d; in bf16 into out_bf16 where that is not null
// (the input of a tensor-core GEMM), else in f32 into out. A row of up to 16 values a thread
// (d a multiple of 4) is read once, in 16-byte pieces, and kept in registers; a longer one is
// read twice. With 256 threads and d a multiple of 4 (up to 4096) the 1/rms is the GEMVs'
// (common.cuh thread_squares). Grid: rows.
extern "C" __global__ void rms_norm(const float* x, const float* scale, float* out, bf16_t* out_bf16, int d, float eps) {
    pdl_enter();
    const float* xr = x + (size_t)blockIdx.x * d;
    size_t row = (size_t)blockIdx.x * d;
    if (d % 4 == 0 && d <= 16 * (int)blockDim.x) {
        constexpr int V = 4;
        float4 v[V];
#pragma unroll
        for (int j = 0; j < V; j++) {
            int c4 = threadIdx.x + j * blockDim.x;
            v[j] = c4 < d / 4 ? ((const float4*)xr)[c4] : make_float4(0, 0, 0, 0);
        }
        float inv;
        if (blockDim.x == 256) {
            // thread_squares' order (the zeros past the row add nothing).
            __shared__ float squares[8];
            float ss = 0.0f;
#pragma unroll
            for (int j = 0; j < V; j++) ss = __fadd_rn(ss, squares_of4(v[j]));
            ss = warp_sum(ss);
            if ((threadIdx.x & 31) == 0) squares[threadIdx.x >> 5] = ss;
            __syncthreads();
            inv = inv_rms_of(squares, d, eps);
        } else {
            float ss = 0.0f;
#pragma unroll
            for (int j = 0; j < V; j++) ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
            inv = 1.0f / sqrtf(block_sum(ss) / d + eps);
        }
#pragma unroll
        for (int j = 0; j < V; j++) {
            int c4 = threadIdx.x + j * blockDim.x;
            if (c4 >= d / 4) continue;
            float4 s = ((const float4*)scale)[c4];
            float4 y = make_float4(v[j].x * inv * s.x, v[j].y * inv * s.y, v[j].z * inv * s.z, v[j].w * inv * s.w);
            if (out_bf16) *(uint2*)&out_bf16[row + 4 * c4] = make_uint2(pack_bf16x2(y.x, y.y), pack_bf16x2(y.z, y.w));
            else *(float4*)&out[row + 4 * c4] = y;
        }
        return;
    }
    float ss = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) ss += xr[c] * xr[c];
    float inv = 1.0f / sqrtf(block_sum(ss) / d + eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float y = xr[c] * inv * scale[c];
        if (out_bf16) out_bf16[row + c] = f32_to_bf16(y); else out[row + c] = y;
    }
}

// gate = silu(gate) * up; in bf16 into out_bf16 instead where that is not null. Four values a
// thread (16-byte loads; the last thread takes what is left). Grid: ceil(n / 1024); block 256.
extern "C" __global__ void swiglu(float* gate, const float* up, bf16_t* out_bf16, int n) {
    pdl_enter();
    int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 4 > n) {
        for (; i < n; i++) {
            float y = siluf_(gate[i]) * up[i];
            if (out_bf16) out_bf16[i] = f32_to_bf16(y); else gate[i] = y;
        }
        return;
    }
    float4 g = *(const float4*)&gate[i], u = *(const float4*)&up[i];
    float4 y = make_float4(siluf_(g.x) * u.x, siluf_(g.y) * u.y, siluf_(g.z) * u.z, siluf_(g.w) * u.w);
    if (out_bf16) *(uint2*)&out_bf16[i] = make_uint2(pack_bf16x2(y.x, y.y), pack_bf16x2(y.z, y.w));
    else *(float4*)&gate[i] = y;
}

// out = silu(gate) * up from bf16 gate and up (the tensor-core GEMM's outputs), in bf16 (the
// down projection's operand): n values, rows of f; row r of gate and of up at r * in_row (one
// product of the stacked gate and up matrices writes rows of both: in_row = 2 f, up = gate + f).
// Four values a thread, as swiglu (f a multiple of 4). Grid: ceil(n / 1024); block 256.
extern "C" __global__ void swiglu_bf16(const bf16_t* gate, const bf16_t* up, bf16_t* out, int n, int f, int in_row) {
    pdl_enter();
    int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 4 > n) {
        for (; i < n; i++) {
            size_t at = (size_t)(i / f) * in_row + i % f;
            out[i] = f32_to_bf16(siluf_(bf16_to_f32(gate[at])) * bf16_to_f32(up[at]));
        }
        return;
    }
    size_t at = (size_t)(i / f) * in_row + i % f;
    uint2 g = *(const uint2*)&gate[at], u = *(const uint2*)&up[at];
    float y[4];
    u32 gw[2] = {g.x, g.y}, uw[2] = {u.x, u.y};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float gv = __uint_as_float(j & 1 ? gw[j / 2] & 0xffff0000u : gw[j / 2] << 16), uv = __uint_as_float(j & 1 ? uw[j / 2] & 0xffff0000u : uw[j / 2] << 16);
        y[j] = siluf_(gv) * uv;
    }
    *(uint2*)&out[i] = make_uint2(pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3]));
}

// inv[row] = 1 / rms(x[row, :]) (for the GEMV's IN_NORM). Grid: rows.
extern "C" __global__ void rms_inv(const float* x, float* inv, int d, float eps) {
    pdl_enter();
    const float* xr = x + (size_t)blockIdx.x * d;
    if (d % 4 == 0 && blockDim.x == 256) {
        // The GEMVs' and rms_norm's order (common.cuh thread_squares).
        __shared__ float squares[8];
        float ss = warp_sum(thread_squares(xr, d));
        if ((threadIdx.x & 31) == 0) squares[threadIdx.x >> 5] = ss;
        __syncthreads();
        if (threadIdx.x == 0) inv[blockIdx.x] = inv_rms_of(squares, d, eps);
        return;
    }
    float ss = 0.0f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) ss += xr[c] * xr[c];
    ss = block_sum(ss);
    if (threadIdx.x == 0) inv[blockIdx.x] = 1.0f / sqrtf(ss / d + eps);
}

// y = x rounded to bf16, four values a thread (the last takes what is left). Grid: ceil(n / 1024).
extern "C" __global__ void to_bf16(const float* x, bf16_t* y, int n) {
    pdl_enter();
    int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 4 > n) {
        for (; i < n; i++) y[i] = f32_to_bf16(x[i]);
        return;
    }
    float4 v = *(const float4*)&x[i];
    *(uint2*)&y[i] = make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
}
