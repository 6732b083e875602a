// The CUDA kernels run on CPU threads (shim.h) against plain double-precision references:
// each check prints one line and the program exits non-zero if any is out of bounds.
// Built and run by tests/cuda_on_cpu.rs from the kernel files joined as for NVRTC (kernels_emu.cu); C++17.
#include "kernels_emu.cu"
#include <cstdio>
#include <random>
#include <string>
#include <tuple>

static std::mt19937 rng(7);
static std::vector<float> random(size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
}
static int failures = 0;
// Fails where the largest difference exceeds `bound` times the largest reference value.
static void compare(const std::string& what, const std::vector<float>& got, const std::vector<double>& want, double bound) {
    double err = 0, big = 0;
    for (size_t i = 0; i < got.size(); i++) {
        err = std::max(err, std::fabs(got[i] - want[i]));
        big = std::max(big, std::fabs(want[i]));
    }
    bool ok = err <= bound * big && big > 0;
    failures += !ok;
    printf("%s %-60s max |err| %.2e of max |ref| %.2e (bound %.0e relative)\n", ok ? "ok  " : "FAIL", what.c_str(), err, big, bound);
}
static double sigmoid(double x) { return 1 / (1 + std::exp(-x)); }
static double softplus(double x) { return x > 20 ? x : std::log1p(std::exp(x)); }

// Causal GQA attention of rows pos0.. (q [t, hq, d]) over caches [pos0 + t, hkv, d], gated.
static std::vector<double> attention_ref(const std::vector<float>& q, const std::vector<float>& kc, const std::vector<float>& vc, const std::vector<float>& gate, int t, int hq, int hkv, int d, int pos0) {
    std::vector<double> out((size_t)t * hq * d);
    for (int tok = 0; tok < t; tok++)
        for (int h = 0; h < hq; h++) {
            int kvh = h / (hq / hkv), visible = pos0 + tok + 1;
            std::vector<double> s(visible);
            double mx = -1e300, sum = 0;
            for (int p = 0; p < visible; p++) {
                double a = 0;
                for (int c = 0; c < d; c++) a += (double)q[((size_t)tok * hq + h) * d + c] * kc[((size_t)p * hkv + kvh) * d + c];
                s[p] = a / std::sqrt((double)d);
                mx = std::max(mx, s[p]);
            }
            for (auto& x : s) sum += (x = std::exp(x - mx));
            for (int c = 0; c < d; c++) {
                double o = 0;
                for (int p = 0; p < visible; p++) o += s[p] * vc[((size_t)p * hkv + kvh) * d + c];
                size_t at = ((size_t)tok * hq + h) * d + c;
                out[at] = o / sum * sigmoid(gate[at]);
            }
        }
    return out;
}

static bool all_zero(const std::vector<unsigned>& v) { return std::all_of(v.begin(), v.end(), [](unsigned x) { return x == 0; }); }
static void check_counters(const std::string& what, const std::vector<unsigned>& done) {
    failures += !all_zero(done);
    printf("%s %s: hand-over counters back at zero\n", all_zero(done) ? "ok  " : "FAIL", what.c_str());
}

// Rows pos0.. of a prefill or decode (up to 8: the decode kernel, split over the positions in
// chunks as the engine sizes them for a cache of `capacity` rows; else the tiled kernel).
static void check_attention(int t, int pos0, int d, int hq, int hkv, int capacity = 0) {
    auto q = random((size_t)t * hq * d, -4, 4), kc = random((size_t)(pos0 + t) * hkv * d, -1, 1), vc = random((size_t)(pos0 + t) * hkv * d, -1, 1), gate = random((size_t)t * hq * d, -2, 2);
    auto want = attention_ref(q, kc, vc, gate, t, hq, hkv, d, pos0);
    std::vector<float> got(want.size());
    u32 pos = pos0;
    std::string name;
    if (t <= 8) {
        int chunk = std::max(64, (capacity + 63) / 64), splits = (capacity + chunk - 1) / chunk;
        std::vector<float> part((size_t)t * hq * splits * (d + 2));
        std::vector<unsigned> done(t * hq, 0);
        launch(t, hq, splits, 128, [&] { attention(q.data(), kc.data(), vc.data(), gate.data(), got.data(), part.data(), done.data(), hq, hkv, d, chunk, splits, &pos); });
        name = "attention (decode, " + std::to_string(splits) + " chunks of " + std::to_string(chunk) + ")";
        check_counters(name + " after " + std::to_string(pos0), done);
    } else {
        launch((t + 63) / 64, hq, 1, 256, [&] { attention_tiled(q.data(), kc.data(), vc.data(), gate.data(), got.data(), t, hq, hkv, d, &pos); });
        name = "attention_tiled";
    }
    compare(name + ", " + std::to_string(t) + " rows after " + std::to_string(pos0) + ", head dim " + std::to_string(d), got, want, 1e-5);
}

// The tensor-core attention against the f32 tiles (bf16 operands: within 1%), its caches
// rounded to bf16 by to_bf16 as the engine does.
template <int D>
static void check_attention_mma(int t, int pos0, int hq, int hkv, void (*kernel)(const float*, const bf16_t*, const bf16_t*, const float*, float*, int, int, int, const u32*)) {
    auto q = random((size_t)t * hq * D, -4, 4), kc = random((size_t)(pos0 + t) * hkv * D, -1, 1), vc = random((size_t)(pos0 + t) * hkv * D, -1, 1), gate = random((size_t)t * hq * D, -2, 2);
    std::vector<float> f32(q.size()), got(q.size());
    u32 pos = pos0;
    int n = (int)kc.size();
    std::vector<bf16_t> kb(n), vb(n);
    launch((n + 1023) / 1024, 1, 1, 256, [&] { to_bf16(kc.data(), kb.data(), n); });
    launch((n + 1023) / 1024, 1, 1, 256, [&] { to_bf16(vc.data(), vb.data(), n); });
    launch((t + 63) / 64, hq, 1, 256, [&] { attention_tiled(q.data(), kc.data(), vc.data(), gate.data(), f32.data(), t, hq, hkv, D, &pos); });
    launch((t + 63) / 64, hq, 1, 256, [&] { kernel(q.data(), kb.data(), vb.data(), gate.data(), got.data(), t, hq, hkv, &pos); });
    compare("attention_mma_" + std::to_string(D) + " against attention_tiled, " + std::to_string(t) + " rows after " + std::to_string(pos0), got, std::vector<double>(f32.begin(), f32.end()), 1e-2);
}

// The gated delta rule of one value head, token after token: S <- alpha S; u = beta (v - S^T k);
// S += k u^T; o = S^T q (q, k as given). S is [dk][dv].
static void delta_rule(std::vector<double>& S, const double* q, const double* k, const double* v, double alpha, double beta, int dk, int dv, double* o) {
    for (auto& s : S) s *= alpha;
    for (int j = 0; j < dv; j++) {
        double m = 0;
        for (int i = 0; i < dk; i++) m += S[(size_t)i * dv + j] * k[i];
        double u = beta * (v[j] - m);
        for (int i = 0; i < dk; i++) S[(size_t)i * dv + j] += k[i] * u;
        o[j] = 0;
        for (int i = 0; i < dk; i++) o[j] += S[(size_t)i * dv + j] * q[i];
    }
}

// deltanet_step: conv + SiLU, l2 norms (q times 1/sqrt(dk)), the delta rule, the gated RMSNorm;
// two launches (3 tokens, then 1), so that the conv window and state carry over and the
// hand-over counters must be back at zero for the second.
template <int DK>
static void check_deltanet_step(int hk, int hv, int dv, void (*kernel)(float*, float*, const float*, const float*, const float*, const float*, const float*, const float*, const float*, const float*, float*, float*, unsigned*, int, int, int, int, int, int, float)) {
    const int dk = DK, kk = 4, kd = hk * dk, cd = 2 * kd + hv * dv, vd = hv * dv;
    const float eps = 1e-6f;
    auto conv0 = random((size_t)kk * cd, -1, 1), state0 = random((size_t)hv * dk * dv, -0.5, 0.5), taps = random((size_t)kk * cd, -0.7, 0.7);
    auto neg_a = random(hv, -2, -0.2), dt = random(hv, -1, 1), norm_w = random(dv, 0.5, 1.5);
    std::vector<float> conv = conv0, state = state0, partial((size_t)hv * (dv / 32) * 8);
    std::vector<unsigned> done(hk, 0);
    std::vector<double> S(state0.begin(), state0.end()), win(conv0.begin(), conv0.end()), want;
    std::vector<float> got;
    for (int t : {3, 1}) {
        auto qkv = random((size_t)t * cd, -2, 2), z = random((size_t)t * vd, -2, 2), b = random((size_t)t * hv, -2, 2), a = random((size_t)t * hv, -2, 2);
        std::vector<float> core((size_t)t * vd);
        launch(hv * dv / 32, 1, 1, 512, [&] {
            kernel(conv.data(), state.data(), qkv.data(), z.data(), b.data(), a.data(), taps.data(), neg_a.data(), dt.data(), norm_w.data(), core.data(), partial.data(), done.data(), t, hk, hv, dv, cd, kk, eps);
        });
        got.insert(got.end(), core.begin(), core.end());
        for (int tok = 0; tok < t; tok++) {
            std::vector<double> y(cd);
            for (int ch = 0; ch < cd; ch++) {
                for (int j = 0; j + 1 < kk; j++) win[(size_t)j * cd + ch] = win[(size_t)(j + 1) * cd + ch];
                win[(size_t)(kk - 1) * cd + ch] = qkv[(size_t)tok * cd + ch];
                double acc = 0;
                for (int j = 0; j < kk; j++) acc += (double)taps[(size_t)j * cd + ch] * win[(size_t)j * cd + ch];
                y[ch] = acc * sigmoid(acc);
            }
            for (int h = 0; h < hv; h++) {
                int kh = h / (hv / hk);
                std::vector<double> q(y.begin() + kh * dk, y.begin() + (kh + 1) * dk), k(y.begin() + kd + kh * dk, y.begin() + kd + (kh + 1) * dk), o(dv);
                double qs = 0, ks = 0;
                for (int i = 0; i < dk; i++) { qs += q[i] * q[i]; ks += k[i] * k[i]; }
                for (int i = 0; i < dk; i++) { q[i] /= std::sqrt(qs + 1e-6) * std::sqrt((double)dk); k[i] /= std::sqrt(ks + 1e-6); }
                std::vector<double> Sh(S.begin() + (size_t)h * dk * dv, S.begin() + (size_t)(h + 1) * dk * dv);
                double alpha = std::exp(neg_a[h] * softplus(a[tok * hv + h] + dt[h])), beta = sigmoid(b[tok * hv + h]);
                delta_rule(Sh, q.data(), k.data(), &y[2 * kd + h * dv], alpha, beta, dk, dv, o.data());
                std::copy(Sh.begin(), Sh.end(), S.begin() + (size_t)h * dk * dv);
                double ss = 0;
                for (double x : o) ss += x * x;
                double inv = 1 / std::sqrt(ss / dv + eps);
                for (int j = 0; j < dv; j++) {
                    double zz = z[(size_t)tok * vd + h * dv + j];
                    want.push_back(norm_w[j] * o[j] * inv * zz * sigmoid(zz));
                }
            }
        }
    }
    std::string name = "deltanet_step_" + std::to_string(DK) + ", " + std::to_string(hv / hk) + " value heads per key head, dv " + std::to_string(dv);
    compare(name + ": outputs", got, want, 1e-4);
    compare(name + ": state", state, S, 1e-4);
    compare(name + ": conv window", conv, win, 1e-6);
    check_counters(name, done);
}

// The chunked rule of a prefill (deltanet_chunk_prep, then the state walk: the f32
// deltanet_chunk_state_1, and the tensor-core one against it) against the delta rule token
// after token, from a non-zero state.
static void check_chunked(int t, int hk, int hv, int dk, int dv) {
    int chunks = (t + 63) / 64, kd = hk * dk, cd = 2 * kd + hv * dv, vd = hv * dv;
    auto mixed = random((size_t)t * cd, -1, 1), b = random(t * hv, -2, 2), a = random(t * hv, -2, 2), neg_a = random(hv, -2, -0.2), dt = random(hv, -1, 1);
    auto state0 = random((size_t)hv * dk * dv, -0.5, 0.5);
    std::vector<float> gcum(t * hv), U((size_t)t * hv * dv), W((size_t)t * hv * dk), P((size_t)chunks * hv * 64 * 64), core((size_t)t * vd), state = state0;
    // q and k heads l2-normalised (q also times 1/sqrt(dk)), as conv_silu_rows leaves them.
    for (int tok = 0; tok < t; tok++)
        for (int head = 0; head < 2 * hk; head++) {
            float* v = &mixed[(size_t)tok * cd + head * dk];
            double ss = 0;
            for (int i = 0; i < dk; i++) ss += (double)v[i] * v[i];
            double inv = 1 / std::sqrt(ss + 1e-6) * (head < hk ? 1 / std::sqrt((double)dk) : 1);
            for (int i = 0; i < dk; i++) v[i] = (float)(v[i] * inv);
        }
    launch(chunks, hv, 1, 256, [&] { deltanet_chunk_prep(mixed.data(), b.data(), a.data(), neg_a.data(), dt.data(), gcum.data(), U.data(), W.data(), P.data(), t, hk, hv, dk, dv, cd); });
    launch(hv, dv / 16, 1, 256, [&] { deltanet_chunk_state_1(state.data(), mixed.data(), gcum.data(), U.data(), W.data(), P.data(), core.data(), t, hk, hv, dk, dv, cd); });
    std::vector<double> S(state0.begin(), state0.end()), want((size_t)t * vd);
    for (int tok = 0; tok < t; tok++)
        for (int h = 0; h < hv; h++) {
            int kh = h / (hv / hk);
            std::vector<double> q(dk), k(dk), v(dv), Sh(S.begin() + (size_t)h * dk * dv, S.begin() + (size_t)(h + 1) * dk * dv);
            for (int i = 0; i < dk; i++) { q[i] = mixed[(size_t)tok * cd + kh * dk + i]; k[i] = mixed[(size_t)tok * cd + kd + kh * dk + i]; }
            for (int j = 0; j < dv; j++) v[j] = mixed[(size_t)tok * cd + 2 * kd + h * dv + j];
            double alpha = std::exp(neg_a[h] * softplus(a[tok * hv + h] + dt[h])), beta = sigmoid(b[tok * hv + h]);
            delta_rule(Sh, q.data(), k.data(), v.data(), alpha, beta, dk, dv, &want[(size_t)tok * vd + h * dv]);
            std::copy(Sh.begin(), Sh.end(), S.begin() + (size_t)h * dk * dv);
        }
    std::string name = "chunked delta rule, " + std::to_string(t) + " tokens, dk " + std::to_string(dk) + ", dv " + std::to_string(dv);
    compare(name + ": outputs", core, want, 1e-4);
    compare(name + ": state", state, S, 1e-4);
    // The tensor-core walk from the same matrices and start (bf16 operands: within 2%).
    std::vector<float> core_mma(core.size()), state_mma = state0;
    launch(hv, dv / 16, 1, 128, [&] {
        auto walk = dk == 32 ? deltanet_chunk_state_mma_32 : dk == 64 ? deltanet_chunk_state_mma_64 : deltanet_chunk_state_mma_128;
        walk(state_mma.data(), mixed.data(), gcum.data(), U.data(), W.data(), P.data(), core_mma.data(), t, hk, hv, dk, dv, cd);
    });
    compare(name + ", tensor cores: outputs", core_mma, std::vector<double>(core.begin(), core.end()), 2e-2);
    compare(name + ", tensor cores: state", state_mma, std::vector<double>(state.begin(), state.end()), 2e-2);
}

// bf16 weights [n, k] from random values; `wf` gets the values they hold.
static std::vector<bf16_t> bf16_matrix(size_t n, std::vector<float>& wf) {
    wf = random(n, -1, 1);
    std::vector<bf16_t> w(n);
    for (size_t i = 0; i < n; i++) { w[i] = f32_to_bf16(wf[i]); wf[i] = bf16_to_f32(w[i]); }
    return w;
}

// The decode GEMVs: up to four matrices of one input per launch, `rb` rows per block, the
// input RMS-normalised on the fly (1/rms found in the block or given by rms_inv) or plain,
// written or added to the output.
static void check_gemv(int t, bool norm, bool given_inv, int rb, bool accumulate, std::vector<int> rows) {
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
    std::vector<std::vector<double>> want(4);
    for (int j = 0; j < 4; j++) {
        want[j].assign(out[j].begin(), out[j].end());
        for (int m = 0; m < t; m++) {
            double ss = 0;
            for (int c = 0; c < k; c++) ss += (double)x[m * k + c] * x[m * k + c];
            double inv = norm ? 1 / std::sqrt(ss / k + eps) : 1;
            for (int r = 0; r < rows[j]; r++) {
                double acc = 0;
                for (int c = 0; c < k; c++) acc += (double)wf[j][(size_t)r * k + c] * x[m * k + c] * (norm ? scale[c] : 1.0f);
                double& o = want[j][(size_t)m * rows[j] + r];
                o = (accumulate ? o : 0) + acc * inv;
            }
        }
    }
    std::vector<float> inv(t);
    if (given_inv) launch(t, 1, 1, 256, [&] { rms_inv(x.data(), inv.data(), k, eps); });
    auto kernel = t == 1 ? (norm ? gemv_t1_norm : gemv_t1_plain) : (norm ? gemv_t8_norm : gemv_t8_plain);
    launch(units, 1, 1, 256, [&] {
        kernel(w[0].data(), out[0].data(), rows[0], w[1].data(), out[1].data(), rows[1], w[2].data(), out[2].data(), rows[2], w[3].data(), out[3].data(), rows[3], x.data(),
               scale.data(), given_inv ? inv.data() : nullptr, k, t, rb, accumulate, eps);
    });
    std::string name = std::string("gemv_t") + (t == 1 ? "1" : "8") + (norm ? "_norm" : "_plain") + ", " + std::to_string(t) + (t == 1 ? " token, " : " tokens, ") + std::to_string(rb) + " rows per block" +
                       (norm ? (given_inv ? ", 1/rms given" : ", 1/rms in the block") : "") + (accumulate ? ", adding" : "");
    for (int j = 0; j < 4; j++)
        if (rows[j] > 0) compare(name + ": matrix " + std::to_string(j) + " (" + std::to_string(rows[j]) + " rows)", out[j], want[j], 1e-5);
}

// The MLP's gate and up projections with the SwiGLU in the GEMV (gemv_t*_glu): o0 =
// silu(rms_norm(x) gate^T) * (rms_norm(x) up^T), the 1/rms found in the block.
static void check_gemv_glu(int t, int rb, int n) {
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
                double xn = (double)x[m * k + c] * scale[c] * inv;
                g += gf[(size_t)r * k + c] * xn;
                u += uf[(size_t)r * k + c] * xn;
            }
            want[(size_t)m * n + r] = g * sigmoid(g) * u;
        }
    }
    auto kernel = t == 1 ? gemv_t1_glu : gemv_t8_glu;
    launch((2 * n + rb - 1) / rb, 1, 1, 256, [&] {
        kernel(gw.data(), out.data(), n, uw.data(), up_out.data(), n, nullptr, nullptr, 0, nullptr, nullptr, 0, x.data(), scale.data(), nullptr, k, t, rb, 0, eps);
    });
    compare("gemv_t" + std::string(t == 1 ? "1" : "8") + "_glu, " + std::to_string(t) + (t == 1 ? " token, " : " tokens, ") + std::to_string(rb) + " rows per block, " + std::to_string(n) + " rows: silu(gate) * up", out, want, 1e-5);
}

// The streaming GEMV of one token over rows of 1024 (gemv_stream_*): `blocks` blocks, so that
// each warp takes several rows in turn; matrices in turn, plain or normalised, written or
// added, or gate and up with the SwiGLU.
static void check_gemv_stream(bool norm, bool glu, bool accumulate, std::vector<int> rows, int blocks) {
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
        for (int c = 0; c < k; c++) acc += (double)wf[j][(size_t)r * k + c] * x[c] * (norm ? scale[c] : 1.0f);
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
               nullptr, k, accumulate, eps);
    });
    std::string name = std::string("gemv_stream_") + (glu ? "glu" : norm ? "norm" : "plain") + ", " + std::to_string(blocks) + " blocks" + (accumulate ? ", adding" : "");
    for (int j = 0; j < (glu ? 1 : 4); j++)
        if (rows[j] > 0) compare(name + ": matrix " + std::to_string(j) + " (" + std::to_string(rows[j]) + " rows)", out[j], want[j], 1e-5);
}

// The f32 GEMM of an exact prefill, adding into its output.
static void check_gemm() {
    const int n = 70, k = 64, t = 37;
    std::vector<float> wf;
    auto w = bf16_matrix((size_t)n * k, wf);
    auto x = random((size_t)t * k, -2, 2), out = random((size_t)t * n, -1, 1);
    std::vector<double> want(out.begin(), out.end());
    for (int m = 0; m < t; m++)
        for (int r = 0; r < n; r++)
            for (int c = 0; c < k; c++) want[(size_t)m * n + r] += (double)wf[(size_t)r * k + c] * x[(size_t)m * k + c];
    launch((n + 63) / 64, (t + 63) / 64, 1, 256, [&] { gemm_bf16_f32(w.data(), x.data(), out.data(), n, k, t, 1); });
    compare("gemm_bf16_f32, 37 x 64 by 70 x 64, adding", out, want, 1e-5);
}

// The elementwise and per-row kernels of a prefill: RMSNorm (f32 and the bf16 operand), SwiGLU,
// the causal conv + SiLU over rows with its state carried in, and the gated RMSNorm.
static void check_rows() {
    const float eps = 1e-6f;
    // Rows of 200 and of 4096 with 256 threads (at most 16 values each, kept in registers), and
    // rows of 202 (not a multiple of 4) and of 600 with 32 threads (read twice); in f32 and into
    // bf16 (the tensor-core operand).
    for (auto [rows, d, threads] : {std::tuple{3, 200, 256}, {2, 4096, 256}, {2, 202, 32}, {2, 600, 32}}) {
        auto x = random(rows * d, -2, 2), scale = random(d, 0.5, 1.5);
        std::vector<float> out(rows * d), from_bf16(rows * d);
        std::vector<bf16_t> ob(rows * d);
        std::vector<double> want(rows * d);
        for (int i = 0; i < rows; i++) {
            double ss = 0;
            for (int c = 0; c < d; c++) ss += (double)x[i * d + c] * x[i * d + c];
            for (int c = 0; c < d; c++) want[i * d + c] = x[i * d + c] / std::sqrt(ss / d + eps) * scale[c];
        }
        launch(rows, 1, 1, threads, [&] { rms_norm(x.data(), scale.data(), out.data(), nullptr, d, eps); });
        launch(rows, 1, 1, threads, [&] { rms_norm(x.data(), scale.data(), nullptr, ob.data(), d, eps); });
        for (int i = 0; i < rows * d; i++) from_bf16[i] = bf16_to_f32(ob[i]);
        std::string name = std::to_string(rows) + " rows of " + std::to_string(d) + ", " + std::to_string(threads) + " threads";
        compare("rms_norm, " + name, out, want, 1e-6);
        compare("rms_norm into bf16 (the tensor-core operand), " + name, from_bf16, want, 4e-3);
    }
    {
        // Not a multiple of 4: the last thread's scalar tail.
        const int n = 1002;
        auto gate = random(n, -4, 4), up = random(n, -2, 2);
        std::vector<double> want(n);
        for (int i = 0; i < n; i++) want[i] = gate[i] * sigmoid(gate[i]) * up[i];
        std::vector<bf16_t> ob(n);
        std::vector<float> from_bf16(n), x = random(n, -3, 3), xb(n);
        launch((n + 1023) / 1024, 1, 1, 256, [&] { swiglu(gate.data(), up.data(), ob.data(), n); });
        for (int i = 0; i < n; i++) from_bf16[i] = bf16_to_f32(ob[i]);
        launch((n + 1023) / 1024, 1, 1, 256, [&] { swiglu(gate.data(), up.data(), nullptr, n); });
        compare("swiglu, 1002 values", gate, want, 1e-6);
        compare("swiglu into bf16 (the tensor-core operand)", from_bf16, want, 4e-3);
        // From bf16 gate and up (a tensor-core prefill's GEMM outputs) to bf16.
        std::vector<bf16_t> gb(n), ub(n);
        std::vector<double> want_b(n);
        for (int i = 0; i < n; i++) {
            gb[i] = f32_to_bf16(gate[i]);
            ub[i] = f32_to_bf16(up[i]);
            double g = bf16_to_f32(gb[i]);
            want_b[i] = g * sigmoid(g) * bf16_to_f32(ub[i]);
        }
        launch((n + 1023) / 1024, 1, 1, 256, [&] { swiglu_bf16(gb.data(), ub.data(), ob.data(), n); });
        for (int i = 0; i < n; i++) from_bf16[i] = bf16_to_f32(ob[i]);
        compare("swiglu_bf16, 1002 values", from_bf16, want_b, 4e-3);
        launch((n + 1023) / 1024, 1, 1, 256, [&] { to_bf16(x.data(), ob.data(), n); });
        for (int i = 0; i < n; i++) xb[i] = bf16_to_f32(ob[i]);
        compare("to_bf16, 1002 values", xb, std::vector<double>(x.begin(), x.end()), 4e-3);
    }
    // The conv with the l2 norm of the q and k heads: runs of tokens (the last partial),
    // channels past the last of a block's lanes, both builds (kernels of 4 and of 6 taps).
    for (auto [t, cd, hk, dk, kk] : {std::tuple{37, 300, 2, 16, 4}, {20, 1288, 2, 128, 6}}) {
        const int qk = 2 * hk * dk;
        const double q_scale = 1 / std::sqrt((double)dk);
        auto conv = random((size_t)kk * cd, -1, 1), qkv = random((size_t)t * cd, -2, 2), taps = random((size_t)kk * cd, -0.7, 0.7);
        std::vector<float> out((size_t)t * cd);
        std::vector<double> want(out.size()), tail((size_t)kk * cd);
        // The raw input at position i (negative: the state's columns, oldest first).
        auto input = [&](int i, int c) -> double { return i < 0 ? conv[(size_t)(kk + i) * cd + c] : qkv[(size_t)i * cd + c]; };
        for (int i = 0; i < t; i++) {
            for (int c = 0; c < cd; c++) {
                double acc = 0;
                for (int j = 0; j < kk; j++) acc += taps[(size_t)j * cd + c] * input(i - kk + 1 + j, c);
                want[(size_t)i * cd + c] = acc * sigmoid(acc);
            }
            for (int head = 0; head < qk / dk; head++) {
                double* v = &want[(size_t)i * cd + head * dk], ss = 0;
                for (int c = 0; c < dk; c++) ss += v[c] * v[c];
                double inv = 1 / std::sqrt(ss + 1e-6) * (head < hk ? q_scale : 1);
                for (int c = 0; c < dk; c++) v[c] *= inv;
            }
        }
        for (int j = 0; j < kk; j++)
            for (int c = 0; c < cd; c++) tail[(size_t)j * cd + c] = input(t - kk + j, c);
        launch((t + CONV_RUN - 1) / CONV_RUN, (cd + 1023) / 1024, 1, 256, [&] { (kk <= 4 ? conv_silu_rows_4 : conv_silu_rows_8)(conv.data(), qkv.data(), taps.data(), out.data(), t, cd, kk, qk, dk, (float)q_scale); });
        launch((cd + 255) / 256, 1, 1, 256, [&] { conv_state_tail(conv.data(), qkv.data(), t, cd, kk); });
        std::string name = std::to_string(t) + " rows of " + std::to_string(cd) + " after a state, heads of " + std::to_string(dk) + ", " + std::to_string(kk) + " taps";
        compare("conv_silu_rows_" + std::string(kk <= 4 ? "4" : "8") + " with the q/k l2 norm, " + name, out, want, 1e-6);
        compare("conv_state_tail: the last raw inputs, " + name, conv, tail, 0);
    }
    {
        const int rows = 11, dv = 32;
        auto core = random(rows * dv, -2, 2), z = random(rows * dv, -2, 2), w = random(dv, 0.5, 1.5);
        std::vector<double> want(rows * dv);
        for (int i = 0; i < rows; i++) {
            double ss = 0;
            for (int c = 0; c < dv; c++) ss += (double)core[i * dv + c] * core[i * dv + c];
            for (int c = 0; c < dv; c++) want[i * dv + c] = w[c] * core[i * dv + c] / std::sqrt(ss / dv + eps) * z[i * dv + c] * sigmoid(z[i * dv + c]);
        }
        std::vector<bf16_t> ob(rows * dv);
        std::vector<float> from_bf16(rows * dv);
        launch((rows + 7) / 8, 1, 1, 256, [&] { gated_rms_norm(core.data(), z.data(), w.data(), ob.data(), rows, dv, eps); });
        for (int i = 0; i < rows * dv; i++) from_bf16[i] = bf16_to_f32(ob[i]);
        launch((rows + 7) / 8, 1, 1, 256, [&] { gated_rms_norm(core.data(), z.data(), w.data(), nullptr, rows, dv, eps); });
        compare("gated_rms_norm, 11 heads of 32", core, want, 1e-6);
        compare("gated_rms_norm into bf16 (the tensor-core operand)", from_bf16, want, 4e-3);
    }
}

// argmax_rows against the plain loop (sampling::argmax_ref): ties go to the first, NaN never
// wins, a row of NaN gives 0; every row's counter back at zero after each of two launches.
static void check_argmax(int rows, int n, int spans) {
    auto x = random((size_t)rows * n, -8, 8);
    float nan = std::nanf("");
    x[5] = nan;                                         // row 0: a NaN among values
    x[n / 2] = x[n - 3] = 9.5f;                         // row 0: a tie, the first must win
    for (int i = 0; i < n; i++) x[(size_t)n + i] = i % 3 ? -INFINITY : nan;  // row 1: -inf and NaN
    for (int i = 0; i < n; i++) x[2 * (size_t)n + i] = nan;                  // row 2: NaN only
    x[(size_t)(rows - 1) * n + n - 1] = 100.0f;         // the last row's last value
    std::vector<float> pv((size_t)rows * spans);
    std::vector<u32> pi((size_t)rows * spans), got(rows);
    std::vector<unsigned> done(rows, 0);
    bool ok = true;
    for (int launchn = 0; launchn < 2; launchn++) {
        launch(spans, rows, 1, 256, [&] { argmax_rows(x.data(), n, pv.data(), pi.data(), done.data(), got.data()); });
        for (int r = 0; r < rows; r++) {
            int best = -1;
            for (int i = 0; i < n; i++) {
                float v = x[(size_t)r * n + i];
                if (!std::isnan(v) && (best < 0 || v > x[(size_t)r * n + best])) best = i;
            }
            ok &= got[r] == (u32)std::max(best, 0);
        }
        ok &= all_zero(done);
    }
    failures += !ok;
    printf("%s argmax_rows, %d rows of %d in %d spans: the plain loop's picks, counters at zero\n", ok ? "ok  " : "FAIL", rows, n, spans);
}

int main() {
    check_attention(1, 12, 32, 4, 2, 16);
    check_attention(3, 300, 256, 8, 2, 512);
    check_attention(1, 4999, 256, 8, 2, 8192);
    check_attention(150, 100, 32, 4, 2);
    check_attention(70, 0, 256, 8, 2);
    check_attention_mma<32>(150, 100, 4, 2, attention_mma_32);
    check_attention_mma<256>(70, 0, 8, 2, attention_mma_256);
    check_attention_mma<128>(100, 40, 4, 1, attention_mma_128);
    check_deltanet_step<32>(2, 4, 32, deltanet_step_32);
    check_deltanet_step<128>(2, 4, 128, deltanet_step_128);
    check_chunked(150, 2, 4, 32, 32);
    check_chunked(70, 1, 2, 128, 128);
    check_gemv(1, true, false, 2, false, {40, 24, 3, 5});
    check_gemv(5, true, true, 8, false, {17, 9});
    check_gemv(5, false, false, 1, true, {11});
    check_gemv(1, false, false, 4, true, {30});
    check_gemv_glu(1, 8, 21);
    check_gemv_stream(true, false, false, {40, 24, 3, 5}, 2);
    check_gemv_stream(false, false, true, {61}, 3);
    check_gemv_stream(true, true, false, {37, 37}, 2);
    check_gemv_glu(3, 2, 9);
    check_gemm();
    check_rows();
    check_argmax(4, 10007, 64);
    check_argmax(3, 300, 7);
    return failures != 0;
}
