// The reference of kernels/blocks.cu (GGML's block formats on the GPU) and its checks: run on
// CPU threads by tests/cuda_on_cpu.rs; tests/cuda_emu/checks.cpp includes it. The formats'
// definitions are written here anew from model/blocks (the plain dequantizer, in the file's
// layout, each value as a product then a difference in f32), and the GPU layout from
// backend/cuda/blocks.rs (split formats: the blocks without their f16 scale, then the scales,
// then zeros to 16 bytes).

struct FormatInfo {
    int id, e, bytes, body;
    bool split;
    const char* name;
};
static const FormatInfo FORMATS[5] = {
    {BLOCK_Q4_0, 32, 18, 16, true, "Q4_0"},
    {BLOCK_Q8_0, 32, 34, 32, true, "Q8_0"},
    {BLOCK_Q4_K, 256, 144, 144, false, "Q4_K"},
    {BLOCK_Q5_K, 256, 176, 176, false, "Q5_K"},
    {BLOCK_Q6_K, 256, 210, 208, true, "Q6_K"},
};

static float ref_f16(const unsigned char* p) {
    unsigned h = p[0] | (p[1] << 8), sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24) : std::ldexp((float)(m | 1024), (int)e - 25);
    return sign ? -v : v;
}

// Scale and minimum j of a k-quant's 12 bytes.
static void ref_scale_min(int j, const unsigned char* q, int& sc, int& m) {
    if (j < 4) { sc = q[j] & 63; m = q[j + 4] & 63; }
    else { sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4); m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

// One block in the file's layout into y (the plain dequantizer: model/blocks dequantize_block).
static void ref_dequantize_block(int f, const unsigned char* b, float* y) {
    if (f == BLOCK_Q4_0) {
        float d = ref_f16(b);
        for (int j = 0; j < 16; j++) { y[j] = (float)((b[2 + j] & 0xf) - 8) * d; y[j + 16] = (float)((b[2 + j] >> 4) - 8) * d; }
    } else if (f == BLOCK_Q8_0) {
        float d = ref_f16(b);
        for (int j = 0; j < 32; j++) y[j] = (float)(signed char)b[2 + j] * d;
    } else if (f == BLOCK_Q4_K || f == BLOCK_Q5_K) {
        float d = ref_f16(b), dmin = ref_f16(b + 2);
        const unsigned char* qh = b + 16;
        const unsigned char* qs = f == BLOCK_Q5_K ? b + 48 : b + 16;
        for (int run = 0; run < 4; run++) {
            int sc0, m0, sc1, m1;
            ref_scale_min(2 * run, b + 4, sc0, m0);
            ref_scale_min(2 * run + 1, b + 4, sc1, m1);
            float d0 = d * (float)sc0, min0 = dmin * (float)m0, d1 = d * (float)sc1, min1 = dmin * (float)m1;
            for (int l = 0; l < 32; l++) {
                int lo = qs[32 * run + l] & 0xf, hi = qs[32 * run + l] >> 4;
                if (f == BLOCK_Q5_K) { lo |= ((qh[l] >> (2 * run)) & 1) << 4; hi |= ((qh[l] >> (2 * run + 1)) & 1) << 4; }
                y[64 * run + l] = d0 * (float)lo - min0;
                y[64 * run + 32 + l] = d1 * (float)hi - min1;
            }
        }
    } else {
        const unsigned char *ql = b, *qh = b + 128, *sc = b + 192;
        float d = ref_f16(b + 208);
        for (int half = 0; half < 2; half++)
            for (int l = 0; l < 32; l++) {
                int is = l / 16, a = ql[64 * half + l], c = ql[64 * half + l + 32], h = qh[32 * half + l];
                int q[4] = {((a & 0xf) | ((h & 3) << 4)) - 32, ((c & 0xf) | (((h >> 2) & 3) << 4)) - 32, ((a >> 4) | (((h >> 4) & 3) << 4)) - 32, ((c >> 4) | ((h >> 6) << 4)) - 32};
                for (int p = 0; p < 4; p++) y[128 * half + 32 * p + l] = (d * (float)(signed char)sc[8 * half + is + 2 * p]) * (float)q[p];
            }
    }
}

// Random blocks of rows of k values in the file's layout (finite f16 scales), and their values.
static std::vector<unsigned char> random_blocks(const FormatInfo& f, int rows, int k, std::vector<float>& values) {
    std::uniform_int_distribution<int> byte(0, 255), exp(8, 13), mant(0, 1023), sign(0, 1);
    size_t blocks = (size_t)rows * (k / f.e);
    std::vector<unsigned char> raw(blocks * f.bytes);
    for (auto& b : raw) b = (unsigned char)byte(rng);
    int scale_at[2] = {f.id == BLOCK_Q6_K ? 208 : 0, 2};
    int scales = f.id == BLOCK_Q4_K || f.id == BLOCK_Q5_K ? 2 : 1;
    for (size_t b = 0; b < blocks; b++)
        for (int s = 0; s < scales; s++) {
            unsigned h = (sign(rng) << 15) | (exp(rng) << 10) | mant(rng);
            raw[b * f.bytes + scale_at[s]] = h & 0xff;
            raw[b * f.bytes + scale_at[s] + 1] = h >> 8;
        }
    values.assign((size_t)rows * k, 0.0f);
    for (size_t b = 0; b < blocks; b++) ref_dequantize_block(f.id, &raw[b * f.bytes], &values[b * f.e]);
    return raw;
}

// The GPU layout of those rows (backend/cuda/blocks.rs).
static size_t gpu_row_bytes(const FormatInfo& f, int k) {
    size_t blocks = k / f.e, bytes = blocks * f.body + (f.split ? 2 * blocks : 0);
    return (bytes + 15) / 16 * 16;
}
static std::vector<unsigned char> gpu_layout(const FormatInfo& f, int rows, int k, const std::vector<unsigned char>& raw) {
    size_t per = k / f.e, row = gpu_row_bytes(f, k);
    std::vector<unsigned char> out(rows * row, 0);
    for (int r = 0; r < rows; r++)
        for (size_t b = 0; b < per; b++) {
            const unsigned char* src = &raw[(r * per + b) * f.bytes];
            unsigned char* dst = &out[r * row];
            if (!f.split) { std::copy(src, src + f.bytes, dst + b * f.bytes); continue; }
            int d_at = f.id == BLOCK_Q6_K ? 208 : 0, body_at = f.id == BLOCK_Q6_K ? 0 : 2;
            std::copy(src + body_at, src + body_at + f.body, dst + b * f.body);
            dst[per * f.body + 2 * b] = src[d_at];
            dst[per * f.body + 2 * b + 1] = src[d_at + 1];
        }
    return out;
}

// dequantize_rows (f32 and bf16) and embed_blocks: each value the plain dequantizer's, bit for bit.
static void check_dequantize(const FormatInfo& f) {
    const int n = 5, k = 512;
    std::vector<float> values;
    auto raw = random_blocks(f, n, k, values);
    auto w = gpu_layout(f, n, k, raw);
    std::vector<float> out((size_t)n * k, -7.0f);
    std::vector<bf16_t> out_bf16((size_t)n * k);
    auto kernels = f.id == BLOCK_Q4_0 ? std::make_tuple(dequantize_rows_q4_0, embed_blocks_q4_0)
                 : f.id == BLOCK_Q8_0 ? std::make_tuple(dequantize_rows_q8_0, embed_blocks_q8_0)
                 : f.id == BLOCK_Q4_K ? std::make_tuple(dequantize_rows_q4_k, embed_blocks_q4_k)
                 : f.id == BLOCK_Q5_K ? std::make_tuple(dequantize_rows_q5_k, embed_blocks_q5_k)
                                      : std::make_tuple(dequantize_rows_q6_k, embed_blocks_q6_k);
    launch(n, 1, 1, 256, [&] { std::get<0>(kernels)(w.data(), out.data(), nullptr, n, k); });
    launch(n, 1, 1, 256, [&] { std::get<0>(kernels)(w.data(), nullptr, out_bf16.data(), n, k); });
    std::vector<u32> ids = {3, 0, 4, 4};
    std::vector<float> x(ids.size() * k);
    launch(ids.size(), 1, 1, 256, [&] { std::get<1>(kernels)(w.data(), ids.data(), x.data(), k); });
    bool same = true, rounded = true, embedded = true;
    for (size_t i = 0; i < values.size(); i++) {
        same = same && out[i] == values[i];
        rounded = rounded && out_bf16[i] == f32_to_bf16(values[i]);
    }
    for (size_t i = 0; i < ids.size(); i++)
        for (int c = 0; c < k; c++) embedded = embedded && x[i * k + c] == values[(size_t)ids[i] * k + c];
    failures += !same + !rounded + !embedded;
    printf("%s dequantize_rows %s: the plain dequantizer's values\n", same ? "ok  " : "FAIL", f.name);
    printf("%s dequantize_rows %s into bf16: those values rounded\n", rounded ? "ok  " : "FAIL", f.name);
    printf("%s embed_blocks %s: the table's rows\n", embedded ? "ok  " : "FAIL", f.name);
}

static void check_blocks_kernels() {
    for (const auto& f : FORMATS) check_dequantize(f);
}
