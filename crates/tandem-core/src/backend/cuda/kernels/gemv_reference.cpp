// The reference of kernels/gemv.cu and its checks (the decode GEMVs): run on CPU threads by
// tests/cuda_on_cpu.rs; tests/cuda_emu/checks.cpp (random, compare, ...) includes it.

// The T of the kernel that takes t tokens (gemv.rs chooses the same).
static const char* gemv_t(int t) { return t == 1 ? "1" : t == 2 ? "2" : t <= 4 ? "4" : "8"; }

// The decode GEMVs: up to four matrices of one input per launch, `rb` rows per block, the
// input RMS-normalised on the fly (1/rms found in the block or given by rms_inv) or plain,
// written or added to the output; with `round`, each input value (normalised and scaled, in f32
// as rms_norm computes it) rounded to bf16 first (the reference rounds the same f32 values,
// its 1/rms in double then f32: on these inputs no value rounds the other way).
static void check_gemv(int t, bool norm, bool given_inv, int rb, bool accumulate, std::vector<int> rows, bool round = false) {
    const int k = 256;
    const float eps = 1e-6f;
    auto x = random((size_t)t * k, -2, 2), scale = random(k, 0.5, 1.5);
    std::vector<std::vector<float>> wf(4), out(4);
    std::vector<std::vector<bf16_t>> w(4);
    rows.resize(4, 0);
    int units = 0;
    for (int j = 0; j < 4; j++) {
        w[j] = bf16_matrix((size_t)std::max(rows[j], 1) * k, wf[j]);
        out[j] = random((size_t)t * std::max(rows[j], 1), -1, 1);
        units += (rows[j] + rb - 1) / rb;
    }
    std::vector<float> inv(t);
    if (given_inv) launch(t, 1, 1, 256, [&] { rms_inv(x.data(), inv.data(), k, eps); });
    std::vector<std::vector<double>> want(4);
    for (int j = 0; j < 4; j++) {
        want[j].assign(out[j].begin(), out[j].end());
        for (int m = 0; m < t; m++) {
            double ss = 0;
            for (int c = 0; c < k; c++) ss += (double)x[m * k + c] * x[m * k + c];
            double inv_m = norm ? (given_inv ? inv[m] : 1 / std::sqrt(ss / k + eps)) : 1;
            // The input the products take: x (times the scale), or its rounded normalised value.
            auto in = [&](int c) -> double {
                float v = x[m * k + c];
                if (!round) return (double)v * (norm ? scale[c] : 1.0f);
                return round_bf16(norm ? v * (float)inv_m * scale[c] : v);
            };
            for (int r = 0; r < rows[j]; r++) {
                double acc = 0;
                for (int c = 0; c < k; c++) acc += (double)wf[j][(size_t)r * k + c] * in(c);
                double& o = want[j][(size_t)m * rows[j] + r];
                o = (accumulate ? o : 0) + (round ? acc : acc * inv_m);
            }
        }
    }
    auto kernel = t == 1 ? (norm ? gemv_t1_norm : gemv_t1_plain) : t == 2 ? (norm ? gemv_t2_norm : gemv_t2_plain) : t <= 4 ? (norm ? gemv_t4_norm : gemv_t4_plain) : (norm ? gemv_t8_norm : gemv_t8_plain);
    launch(units, 1, 1, 256, [&] {
        kernel(w[0].data(), out[0].data(), rows[0], w[1].data(), out[1].data(), rows[1], w[2].data(), out[2].data(), rows[2], w[3].data(), out[3].data(), rows[3], x.data(),
               scale.data(), given_inv ? inv.data() : nullptr, k, t, rb, accumulate, eps, round);
    });
    std::string name = std::string("gemv_t") + gemv_t(t) + (norm ? "_norm" : "_plain") + ", " + std::to_string(t) + (t == 1 ? " token, " : " tokens, ") + std::to_string(rb) + " rows per block" +
                       (norm ? (given_inv ? ", 1/rms given" : ", 1/rms in the block") : "") + (accumulate ? ", adding" : "") + (round ? ", inputs rounded to bf16" : "");
    for (int j = 0; j < 4; j++)
        if (rows[j] > 0) compare(name + ": matrix " + std::to_string(j) + " (" + std::to_string(rows[j]) + " rows)", out[j], want[j], 1e-5);
}

// The MLP's gate and up projections with the SwiGLU in the GEMV (gemv_t*_glu): o0 =
// silu(rms_norm(x) gate^T) * (rms_norm(x) up^T), the 1/rms found in the block; with `round`,
// the inputs and then gate and up rounded to bf16.
static void check_gemv_glu(int t, int rb, int n, bool round = false) {
    const int k = 256;
    const float eps = 1e-6f;
    auto x = random((size_t)t * k, -2, 2), scale = random(k, 0.5, 1.5);
    std::vector<float> gf, uf, out((size_t)t * n), up_out((size_t)t * n, 7.0f);
    auto gw = bf16_matrix((size_t)n * k, gf), uw = bf16_matrix((size_t)n * k, uf);
    std::vector<double> want((size_t)t * n);
    for (int m = 0; m < t; m++) {
        double ss = 0;
        for (int c = 0; c < k; c++) ss += (double)x[m * k + c] * x[m * k + c];
        double inv = 1 / std::sqrt(ss / k + eps);
        for (int r = 0; r < n; r++) {
            double g = 0, u = 0;
            for (int c = 0; c < k; c++) {
                double xn = round ? (double)round_bf16(x[m * k + c] * (float)inv * scale[c]) : (double)x[m * k + c] * scale[c] * inv;
                g += gf[(size_t)r * k + c] * xn;
                u += uf[(size_t)r * k + c] * xn;
            }
            if (round) { g = round_bf16((float)g); u = round_bf16((float)u); }
            want[(size_t)m * n + r] = g * sigmoid(g) * u;
        }
    }
    auto kernel = t == 1 ? gemv_t1_glu : t == 2 ? gemv_t2_glu : t <= 4 ? gemv_t4_glu : gemv_t8_glu;
    launch((2 * n + rb - 1) / rb, 1, 1, 256, [&] {
        kernel(gw.data(), out.data(), n, uw.data(), up_out.data(), n, nullptr, nullptr, 0, nullptr, nullptr, 0, x.data(), scale.data(), nullptr, k, t, rb, 0, eps, round);
    });
    compare("gemv_t" + std::string(gemv_t(t)) + "_glu, " + std::to_string(t) + (t == 1 ? " token, " : " tokens, ") + std::to_string(rb) + " rows per block, " + std::to_string(n) + " rows: silu(gate) * up" + (round ? ", rounded to bf16" : ""), out, want, 1e-5);
}

// The streaming GEMV of one token over rows of 1024 (gemv_stream_*): `blocks` blocks, so that
// each warp takes several rows in turn; matrices in turn, plain or normalised, written or
// added, or gate and up with the SwiGLU; with `round`, as check_gemv's and check_gemv_glu's.
static void check_gemv_stream(bool norm, bool glu, bool accumulate, std::vector<int> rows, int blocks, bool round = false) {
    const int k = 1024;
    const float eps = 1e-6f;
    auto x = random(k, -2, 2), scale = random(k, 0.5, 1.5);
    rows.resize(4, 0);
    std::vector<std::vector<float>> wf(4), out(4);
    std::vector<std::vector<bf16_t>> w(4);
    for (int j = 0; j < 4; j++) {
        w[j] = bf16_matrix((size_t)std::max(rows[j], 1) * k, wf[j]);
        out[j] = random(std::max(rows[j], 1), -1, 1);
    }
    double ss = 0;
    for (int c = 0; c < k; c++) ss += (double)x[c] * x[c];
    double inv = norm ? 1 / std::sqrt(ss / k + eps) : 1;
    auto product = [&](int j, int r) {
        double acc = 0;
        for (int c = 0; c < k; c++) {
            double in = round ? (double)round_bf16(norm ? x[c] * (float)inv * scale[c] : x[c]) : (double)x[c] * (norm ? scale[c] : 1.0f);
            acc += (double)wf[j][(size_t)r * k + c] * in;
        }
        if (round) return glu ? (double)round_bf16((float)acc) : acc;
        return acc * inv;
    };
    std::vector<std::vector<double>> want(4);
    for (int j = 0; j < 4; j++) {
        want[j].assign(out[j].begin(), out[j].end());
        for (int r = 0; r < rows[j]; r++) {
            if (glu && j == 0) { double g = product(0, r); want[0][r] = g * sigmoid(g) * product(1, r); }
            else if (!glu) want[j][r] = (accumulate ? want[j][r] : 0) + product(j, r);
        }
    }
    auto kernel = glu ? gemv_stream_glu : norm ? gemv_stream_norm : gemv_stream_plain;
    launch(blocks, 1, 1, 256, [&] {
        kernel(w[0].data(), out[0].data(), rows[0], w[1].data(), out[1].data(), rows[1], w[2].data(), out[2].data(), rows[2], w[3].data(), out[3].data(), rows[3], x.data(), scale.data(),
               nullptr, k, accumulate, eps, round);
    });
    std::string name = std::string("gemv_stream_") + (glu ? "glu" : norm ? "norm" : "plain") + ", " + std::to_string(blocks) + " blocks" + (accumulate ? ", adding" : "") + (round ? ", inputs rounded to bf16" : "");
    for (int j = 0; j < (glu ? 1 : 4); j++)
        if (rows[j] > 0) compare(name + ": matrix " + std::to_string(j) + " (" + std::to_string(rows[j]) + " rows)", out[j], want[j], 1e-5);
}

// The GEMV kernel of block format f (gemv_<f>_t<T>_<plain|glu>).
typedef void (*BlockGemv)(const unsigned char*, float*, int, const unsigned char*, float*, int, const unsigned char*, float*, int, const unsigned char*, float*, int,
                          const float*, const float*, const float*, int, int, int, int, float, int);
static BlockGemv block_gemv(int f, int t, bool glu) {
#define BLOCK_GEMV_OF(S) { gemv_##S##_t1_plain, gemv_##S##_t1_glu, gemv_##S##_t2_plain, gemv_##S##_t2_glu, gemv_##S##_t4_plain, gemv_##S##_t4_glu, gemv_##S##_t8_plain, gemv_##S##_t8_glu }
    static const BlockGemv all[5][8] = {BLOCK_GEMV_OF(q4_0), BLOCK_GEMV_OF(q8_0), BLOCK_GEMV_OF(q4_k), BLOCK_GEMV_OF(q5_k), BLOCK_GEMV_OF(q6_k)};
    int ti = t == 1 ? 0 : t == 2 ? 1 : t <= 4 ? 2 : 3;
    return all[f][2 * ti + glu];
}
// The k-quant GEMV of format f against int8 inputs (gemv_<f>_a8_t<T>_<plain|glu>).
static BlockGemv block_gemv8(int f, int t, bool glu) {
#define BLOCK_GEMV8_OF(S) { gemv_##S##_a8_t1_plain, gemv_##S##_a8_t1_glu, gemv_##S##_a8_t2_plain, gemv_##S##_a8_t2_glu, gemv_##S##_a8_t4_plain, gemv_##S##_a8_t4_glu, gemv_##S##_a8_t8_plain, gemv_##S##_a8_t8_glu }
    static const BlockGemv all[3][8] = {BLOCK_GEMV8_OF(q4_k), BLOCK_GEMV8_OF(q5_k), BLOCK_GEMV8_OF(q6_k)};
    int ti = t == 1 ? 0 : t == 2 ? 1 : t <= 4 ? 2 : 3;
    return all[f - BLOCK_Q4_K][2 * ti + glu];
}

// block_input8's output for k-quant F in the rows' own order (as block_input_natural): token
// m's int8 of value c at natural[m * k + c], and whether each unit's sums are its pieces'.
template <int F>
static std::vector<short> block_input8_natural(const std::vector<unsigned>& q, const std::vector<unsigned>& sums, int t, int k, bool& ok) {
    typedef BlockChunk8<F> C;
    const int units = k / C::U, stride = k / 8, per_sum = 4 / C::NS;
    const signed char* qi = (const signed char*)q.data();
    std::vector<short> natural((size_t)t * k);
    std::vector<int> seen((size_t)t * k, 0);
    for (int m = 0; m < t; m++)
        for (int u = 0; u < units; u++) {
            int total[4] = {0, 0, 0, 0};
            for (int p = 0; p < 4; p++) {
                int at = C::piece_start(u, p);
                for (int i = 0; i < C::PB; i++) {
                    short v = qi[(size_t)m * k + ((size_t)p * units + u) * C::PB + i];
                    natural[(size_t)m * k + at + i] = v;
                    seen[(size_t)m * k + at + i]++;
                    total[p / per_sum] += v;
                }
            }
            for (int j = 0; j < C::NS; j++) ok = ok && (int)sums[(size_t)m * stride + (size_t)j * units + u] == total[j];
        }
    for (int n : seen) ok = ok && n == 1;
    return natural;
}

// block_input's output for format F in the rows' own order: token m's integer of value c at
// natural[m * k + c] (each value written once, else `ok` is cleared), and whether each of a
// unit's sums is that of its pieces' integers (NS sums, each over U / 8 / NS pieces in turn).
template <int F>
static std::vector<short> block_input_natural(const std::vector<unsigned>& q, const std::vector<unsigned>& sums, int t, int k, bool& ok) {
    typedef BlockChunk<F> C;
    const int units = k / C::U, stride = k / 8;
    const short* qi = (const short*)q.data();
    std::vector<short> natural((size_t)t * k);
    std::vector<int> seen((size_t)t * k, 0);
    for (int m = 0; m < t; m++)
        for (int u = 0; u < units; u++) {
            int total[4] = {0, 0, 0, 0}, per_sum = C::NS > 0 ? C::U / 8 / C::NS : 1;
            for (int p = 0; p < C::U / 8; p++) {
                int at = C::piece_start(u, p);
                for (int i = 0; i < 8; i++) {
                    short v = qi[8 * ((size_t)m * stride + (size_t)p * units + u) + i];
                    natural[(size_t)m * k + at + i] = v;
                    seen[(size_t)m * k + at + i]++;
                    total[p / per_sum % 4] += v;
                }
            }
            for (int s = 0; s < C::NS; s++) ok = ok && (int)sums[(size_t)m * stride + (size_t)s * units + u] == total[s];
        }
    for (int n : seen) ok = ok && n == 1;
    return natural;
}

// With `a8` (k-quants only) the inputs are block_input8's int8 per 256 values and the GEMV
// gemv_<f>_a8_*; else block_input's 16-bit integers per row.
static void check_gemv_blocks(const FormatInfo& f, int t, bool norm, int rb, bool accumulate, std::vector<int> rows, bool round = false, bool glu = false, bool a8 = false) {
    const int k = 512;
    const float eps = 1e-6f;
    auto x = random((size_t)t * k, -2, 2), scale = random(k, 0.5, 1.5);
    if (a8) {
        // A 256 with one large value (the others round to few levels) and one of zeros.
        x[7] = 40.0f;
        for (int c = 256; c < 512 && t > 1; c++) x[k + c] = 0.0f;
    }
    rows.resize(4, 0);
    if (glu) rows = {rows[0], rows[0], 0, 0};
    std::vector<std::vector<float>> wf(4), out(4);
    std::vector<std::vector<unsigned char>> w(4);
    int units = glu ? (2 * rows[0] + rb - 1) / rb : 0;
    for (int j = 0; j < 4; j++) {
        auto raw = random_blocks(f, std::max(rows[j], 1), k, wf[j]);
        w[j] = gpu_layout(f, std::max(rows[j], 1), k, raw);
        out[j] = random((size_t)t * std::max(rows[j], 1), -1, 1);
        if (!glu) units += (rows[j] + rb - 1) / rb;
    }
    const int groups = k / 8, nb = k / 256, span = a8 ? 256 : k;
    std::vector<unsigned> q((size_t)t * k / 2), sums((size_t)t * groups + t * nb + t);
    bool ints = true;
    std::vector<short> natural;
    if (a8) {
        launch(t * BLOCK_INPUT_PARTS, 1, 1, 256, [&] { block_input8(x.data(), norm ? scale.data() : nullptr, k, eps, round, f.id, (unsigned char*)q.data(), sums.data()); });
        natural = f.id == BLOCK_Q4_K ? block_input8_natural<BLOCK_Q4_K>(q, sums, t, k, ints)
                : f.id == BLOCK_Q5_K ? block_input8_natural<BLOCK_Q5_K>(q, sums, t, k, ints)
                                     : block_input8_natural<BLOCK_Q6_K>(q, sums, t, k, ints);
    } else {
        launch(t * BLOCK_INPUT_PARTS, 1, 1, 256, [&] { block_input(x.data(), norm ? scale.data() : nullptr, k, eps, round, f.id, q.data(), sums.data()); });
        natural = f.id == BLOCK_Q4_0 ? block_input_natural<BLOCK_Q4_0>(q, sums, t, k, ints)
                : f.id == BLOCK_Q8_0 ? block_input_natural<BLOCK_Q8_0>(q, sums, t, k, ints)
                : f.id == BLOCK_Q4_K ? block_input_natural<BLOCK_Q4_K>(q, sums, t, k, ints)
                : f.id == BLOCK_Q5_K ? block_input_natural<BLOCK_Q5_K>(q, sums, t, k, ints)
                                     : block_input_natural<BLOCK_Q6_K>(q, sums, t, k, ints);
    }
    const short* qi = natural.data();
    // The inputs' scale of each span (a row, or with a8 each 256 values) of each token.
    const int spans = k / span, top = a8 ? 127 : 32767;
    std::vector<float> s((size_t)t * spans);
    for (int m = 0; m < t; m++) {
        double ss = 0;
        for (int c = 0; c < k; c++) ss += (double)x[m * k + c] * x[m * k + c];
        double inv = norm ? 1 / std::sqrt(ss / k + eps) : 1;
        std::vector<double> v(k);
        for (int c = 0; c < k; c++) {
            v[c] = x[m * k + c] * inv * (norm ? scale[c] : 1.0f);
            if (round) v[c] = round_bf16((float)v[c]);
        }
        for (int b = 0; b < spans; b++) {
            double most = 0;
            for (int c = b * span; c < (b + 1) * span; c++) most = std::max(most, std::fabs(v[c]));
            float& sb = s[(size_t)m * spans + b];
            memcpy(&sb, a8 ? &sums[(size_t)t * groups + (size_t)m * nb + b] : &sums[(size_t)t * groups + m], 4);
            if (most == 0) {
                ints = ints && sb == 0.0f;
                for (int c = b * span; c < (b + 1) * span; c++) ints = ints && qi[m * k + c] == 0;
                continue;
            }
            ints = ints && std::fabs(sb - most / top) <= 1e-5 * most / top;
            // (v / s is up to `top`, and the kernel's v and s are f32: a value near a half
            // rounds either way.)
            for (int c = b * span; c < (b + 1) * span; c++) ints = ints && std::abs(qi[m * k + c]) <= top && std::fabs(qi[m * k + c] - v[c] / sb) <= 0.5 + top * 4.0 / (1 << 24);
        }
    }
    std::string name = std::string("gemv ") + f.name + (a8 ? " a8" : "") + " t" + gemv_t(t) + (glu ? " glu" : norm ? " norm" : " plain") + ", " + std::to_string(t) + (t == 1 ? " token, " : " tokens, ") + std::to_string(rb) +
                       (a8 ? " rows per block (unused: 8 R rows a block)" : " rows per block") + (accumulate && !glu ? ", adding" : "") + (round ? ", inputs rounded to bf16" : "");
    failures += !ints;
    printf("%s %s for %s: integers v / s rounded, in the lanes' order, their units' sums exact\n", ints ? "ok  " : "FAIL", a8 ? "block_input8" : "block_input", name.c_str());
    std::vector<std::vector<double>> want(4);
    for (int j = 0; j < 4; j++) want[j].assign(out[j].begin(), out[j].end());
    for (int m = 0; m < t; m++) {
        auto product = [&](int j, int r) {
            double acc = 0;
            for (int b = 0; b < spans; b++) {
                double part = 0;
                for (int c = b * span; c < (b + 1) * span; c++) part += (double)wf[j][(size_t)r * k + c] * qi[m * k + c];
                acc += part * s[(size_t)m * spans + b];
            }
            return acc;
        };
        for (int j = 0; j < 4; j++)
            for (int r = 0; r < rows[j]; r++) {
                double& o = want[j][(size_t)m * rows[j] + r];
                if (glu && j == 0) {
                    double g = product(0, r), u = product(1, r);
                    if (round) { g = round_bf16((float)g); u = round_bf16((float)u); }
                    o = g * sigmoid(g) * u;
                } else if (!glu) {
                    o = (accumulate ? o : 0) + product(j, r);
                }
            }
    }
    auto kernel = a8 ? block_gemv8(f.id, t, glu) : block_gemv(f.id, t, glu);
    if (a8) {
        // A block per 8 R rows of one matrix (gate and up rows in turn with GLU); rb unused.
        int rows_per = 8 * (f.id == BLOCK_Q6_K ? BlockChunk8<BLOCK_Q6_K>::R : BlockChunk8<BLOCK_Q4_K>::R);
        units = glu ? (2 * rows[0] + rows_per - 1) / rows_per : 0;
        for (int j = 0; j < 4 && !glu; j++) units += (rows[j] + rows_per - 1) / rows_per;
    }
    launch(units, 1, 1, 256, [&] {
        kernel(w[0].data(), out[0].data(), rows[0], w[1].data(), out[1].data(), rows[1], w[2].data(), out[2].data(), rows[2], w[3].data(), out[3].data(), rows[3],
               (const float*)q.data(), (const float*)sums.data(), nullptr, k, t, rb, glu ? 0 : accumulate, eps, round);
    });
    // With rounding, gate and up are rounded to bf16 before the SwiGLU: a sum that lands on the
    // other side of a rounding boundary than the double reference's moves the output by a bf16
    // step (2^-8) of gate or up.
    double bound = glu && round ? 8e-3 : 1e-5;
    for (int j = 0; j < (glu ? 1 : 4); j++)
        if (rows[j] > 0) compare(name + ": matrix " + std::to_string(j) + " (" + std::to_string(rows[j]) + " rows)", out[j], want[j], bound);
}

static void check_gemv_kernels() {
    // Every format in one token's shapes (four matrices; gate and up), the rest of the
    // arguments on Q4_K and Q6_K (the formats with and without minimums).
    for (const auto& f : FORMATS) {
        check_gemv_blocks(f, 1, true, 2, false, {40, 24, 3, 5});
        check_gemv_blocks(f, 4, true, 2, false, {9}, true, true);
    }
    for (const auto& f : {FORMATS[2], FORMATS[4]}) {
        check_gemv_blocks(f, 5, true, 8, false, {17, 9});
        check_gemv_blocks(f, 3, false, 1, true, {11});
        check_gemv_blocks(f, 2, true, 4, false, {33, 8}, true);
        check_gemv_blocks(f, 8, false, 4, true, {13}, true);
        check_gemv_blocks(f, 1, true, 8, false, {21}, false, true);
    }
    // The k-quants against int8 inputs: every shape above for Q4_K and Q6_K, one token and
    // gate and up for Q5_K.
    for (const auto& f : {FORMATS[2], FORMATS[3], FORMATS[4]}) {
        check_gemv_blocks(f, 1, true, 2, false, {40, 24, 3, 5}, false, false, true);
        check_gemv_blocks(f, 4, true, 2, false, {9}, true, true, true);
    }
    for (const auto& f : {FORMATS[2], FORMATS[4]}) {
        check_gemv_blocks(f, 5, true, 8, false, {17, 9}, false, false, true);
        check_gemv_blocks(f, 3, false, 1, true, {11}, false, false, true);
        check_gemv_blocks(f, 8, false, 4, true, {13}, true, false, true);
        check_gemv_blocks(f, 1, true, 8, false, {21}, false, true, true);
    }
    check_gemv(1, true, false, 2, false, {40, 24, 3, 5});
    check_gemv(5, true, true, 8, false, {17, 9});
    check_gemv(5, false, false, 1, true, {11});
    check_gemv(1, false, false, 4, true, {30});
    check_gemv_glu(1, 8, 21);
    check_gemv_stream(true, false, false, {40, 24, 3, 5}, 2);
    check_gemv_stream(false, false, true, {61}, 3);
    check_gemv_stream(true, true, false, {37, 37}, 2);
    check_gemv_glu(3, 2, 9);
    check_gemv(2, true, false, 4, false, {33, 8});
    check_gemv(3, false, false, 2, true, {19, 5, 7});
    check_gemv(4, true, true, 8, false, {21});
    check_gemv_glu(2, 4, 13);
    check_gemv_glu(4, 8, 11);
    check_gemv_glu(8, 2, 6);
    // Inputs rounded to bf16 (tensor-core precision).
    check_gemv(1, false, false, 4, true, {30, 7}, true);
    check_gemv(3, false, false, 2, false, {19}, true);
    check_gemv(5, true, true, 8, false, {17, 9}, true);
    check_gemv(2, true, false, 4, false, {33, 8}, true);
    check_gemv_glu(1, 8, 21, true);
    check_gemv_glu(4, 8, 11, true);
    check_gemv_stream(false, false, true, {61}, 3, true);
    check_gemv_stream(true, false, false, {40, 24, 3, 5}, 2, true);
    check_gemv_stream(true, true, false, {37, 37}, 2, true);
}
