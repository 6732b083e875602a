// The reference of kernels/deltanet.cu and its checks (the conv, the decode step, the chunked rule, the gated norm): run on CPU threads by
// tests/cuda_on_cpu.rs; tests/cuda_emu/checks.cpp (random, compare, ...) includes it.

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
static void check_deltanet_step(int hk, int hv, int dv, void (*kernel)(float*, void*, const float*, const float*, const float*, const float*, const float*, const float*, const float*, const float*, float*, float*, unsigned*, int, int, int, int, int, int, float)) {
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

// The prep's bf16 operands of the tensor-core walk: q exp(G) and k exp(G_last - G) (G_last the
// last of the row's chunk), each the f32 value it stands for rounded (as the walk rounded them
// itself before), and W within bf16's reach of the f32 prep's (its products took bf16 q and k).
static void check_walk_operands(const std::vector<float>& mixed, const std::vector<float>& gcum, const std::vector<float>& W, const std::vector<bf16_t>& ops, int t, int hk,
                                int hv, int dk, int cd) {
    size_t each = (size_t)t * hv * dk;
    bool same = true;
    std::vector<float> w_op(each);
    for (int i = 0; i < t; i++)
        for (int h = 0; h < hv; h++) {
            int kh = h / (hv / hk), last = std::min((i / 64) * 64 + 63, t - 1);
            float g = gcum[(size_t)i * hv + h], gl = gcum[(size_t)last * hv + h];
            for (int d = 0; d < dk; d++) {
                size_t at = ((size_t)i * hv + h) * dk + d;
                float q = mixed[(size_t)i * cd + kh * dk + d], k = mixed[(size_t)i * cd + hk * dk + kh * dk + d];
                same &= ops[each + at] == f32_to_bf16(q * expf(g)) && ops[2 * each + at] == f32_to_bf16(k * expf(gl - g));
                w_op[at] = bf16_to_f32(ops[at]);
            }
        }
    failures += !same;
    printf("%s deltanet_chunk_prep's bf16 walk operands, %d rows, dk %d: q exp(G), k exp(G_last - G), each rounded\n", same ? "ok  " : "FAIL", t, dk);
    compare("deltanet_chunk_prep's bf16 W, " + std::to_string(t) + " rows, dk " + std::to_string(dk) + ", against the f32 prep's", w_op, std::vector<double>(W.begin(), W.end()), 1e-2);
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
    // The prep with the tensor-core walk's bf16 operands (W, q exp(G), k exp(G_last - G); its
    // products on tensor cores: its own U and P).
    std::vector<bf16_t> ops((size_t)3 * t * hv * dk);
    bf16_t *wb = ops.data(), *qb = wb + (size_t)t * hv * dk, *kb = qb + (size_t)t * hv * dk;
    std::vector<float> gcum_mma(gcum.size()), U_mma(U.size());
    std::vector<bf16_t> P16(P.size());
    launch(chunks, hv, 1, 256, [&] { deltanet_chunk_prep(mixed.data(), b.data(), a.data(), neg_a.data(), dt.data(), gcum_mma.data(), U_mma.data(), W.data(), P.data(), wb, qb, kb, P16.data(), t, hk, hv, dk, dv, cd); });
    // And without them, all in f32, for the f32 walk.
    launch(chunks, hv, 1, 256, [&] { deltanet_chunk_prep(mixed.data(), b.data(), a.data(), neg_a.data(), dt.data(), gcum.data(), U.data(), W.data(), P.data(), nullptr, nullptr, nullptr, nullptr, t, hk, hv, dk, dv, cd); });
    bool same_g = gcum_mma == gcum;
    failures += !same_g;
    printf("%s deltanet_chunk_prep's G, %d rows, dk %d: the same with and without the bf16 operands\n", same_g ? "ok  " : "FAIL", t, dk);
    check_walk_operands(mixed, gcum, W, ops, t, hk, hv, dk, cd);
    std::string prep = "deltanet_chunk_prep on tensor cores, " + std::to_string(t) + " rows, dk " + std::to_string(dk);
    compare(prep + ": U", U_mma, std::vector<double>(U.begin(), U.end()), 1e-2);
    std::vector<float> P_mma(P.size());
    for (size_t i = 0; i < P.size(); i++) P_mma[i] = bf16_to_f32(P16[i]);
    compare(prep + ": P (in bf16)", P_mma, std::vector<double>(P.begin(), P.end()), 1e-2);
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
        walk(state_mma.data(), gcum.data(), U_mma.data(), wb, qb, kb, P16.data(), core_mma.data(), t, hv, dk, dv);
    });
    compare(name + ", tensor cores: outputs", core_mma, std::vector<double>(core.begin(), core.end()), 2e-2);
    compare(name + ", tensor cores: state", state_mma, std::vector<double>(state.begin(), state.end()), 2e-2);
}

// The causal conv + SiLU over a prefill's rows with its state carried in (and the q/k l2
// norm), and the gated RMSNorm.
static void check_conv_and_gated_norm() {
    const float eps = 1e-6f;
    // The conv with the l2 norm of the q and k heads: runs of tokens (the last partial),
    // channels past the last of a block's lanes, both builds (kernels of 4, 3 and 6 taps: the
    // first build with its taps known and not).
    for (auto [t, cd, hk, dk, kk] : {std::tuple{37, 300, 2, 16, 4}, {29, 520, 1, 32, 3}, {20, 1288, 2, 128, 6}}) {
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

static float as_state_value(float x, float) { return x; }
static bf16_t as_state_value(float x, bf16_t) { return f32_to_bf16(x); }

// What a batched step's launch gets: n sequences' conv windows and states (tables), their
// inputs, the outputs and hand-over counters, the shapes.
struct BatchedStep {
    float* const* convs;
    void* const* states;
    const float *qkv, *z, *b, *a, *taps, *neg_a, *dt, *norm_w;
    float* core;
    unsigned* done;
    int n, hk, hv, dv, cd, in_row, kk;
    float eps;
};
using StepAlone = void (*)(float*, void*, const float*, const float*, const float*, const float*, const float*, const float*, const float*, const float*, float*, float*, unsigned*, int, int, int, int, int, int, float);

// A batched step's kernel (launched by `run`) against deltanet_step on each sequence alone (one
// token each, every sequence its own conv window and state, states of type S; its projections a
// row of qkv, z, b and a, as the batched step's one product writes them): outputs, windows and
// states bit for bit, hand-over counters back at zero.
template <int DK, typename S, typename Run>
static void check_batched_step(int hk, int hv, int dv, const char* name, StepAlone alone, Run run) {
    const int n = 3, kk = 4, cd = 2 * hk * DK + hv * dv, vd = hv * dv, blocks = hv * dv / 32;
    const float eps = 1e-6f;
    auto taps = random((size_t)kk * cd, -0.7, 0.7), neg_a = random(hv, -2, -0.2), dt = random(hv, -1, 1), norm_w = random(dv, 0.5, 1.5);
    const int in_row = cd + vd + 2 * hv;
    auto in = random((size_t)n * in_row, -2, 2);
    const float *qkv = in.data(), *z = qkv + cd, *b = z + vd, *a = b + hv;
    std::vector<std::vector<float>> conv(n), conv1(n);
    std::vector<std::vector<S>> state(n), state1(n);
    std::vector<float*> convs(n);
    std::vector<void*> states(n);
    for (int s = 0; s < n; s++) {
        conv[s] = conv1[s] = random((size_t)kk * cd, -1, 1);
        auto start = random((size_t)hv * DK * dv, -0.5, 0.5);
        state[s].resize(start.size());
        for (size_t i = 0; i < start.size(); i++) state[s][i] = as_state_value(start[i], S());
        state1[s] = state[s];
        convs[s] = conv[s].data();
        states[s] = state[s].data();
    }
    std::vector<float> core((size_t)n * vd);
    std::vector<unsigned> done(n * hk, 0);
    run(BatchedStep{convs.data(), states.data(), qkv, z, b, a, taps.data(), neg_a.data(), dt.data(), norm_w.data(), core.data(), done.data(), n, hk, hv, dv, cd, in_row, kk, eps});
    bool same = all_zero(done);
    for (int s = 0; s < n; s++) {
        std::vector<float> core1(vd), pss1((size_t)blocks * 8);
        std::vector<unsigned> done1(hk, 0);
        size_t at = (size_t)s * in_row;
        launch(blocks, 1, 1, 512, [&] { alone(conv1[s].data(), state1[s].data(), qkv + at, z + at, b + at, a + at, taps.data(), neg_a.data(), dt.data(), norm_w.data(), core1.data(), pss1.data(), done1.data(), 1, hk, hv, dv, cd, kk, eps); });
        same &= std::equal(core1.begin(), core1.end(), core.begin() + (size_t)s * vd) && conv1[s] == conv[s] && state1[s] == state[s];
    }
    failures += !same;
    printf("%s %s, 3 sequences, value heads a key head: %d; each sequence's bits as alone, counters at zero\n", same ? "ok  " : "FAIL", name, hv / hk);
}

// deltanet_step_batch_*: a block per 32 columns of a value head.
template <typename K>
static auto per_32_columns(K kernel) {
    return [=](const BatchedStep& s) {
        std::vector<float> pss((size_t)s.n * (s.hv * s.dv / 32) * 8);
        launch(s.hv * s.dv / 32, s.n, 1, 512, [&] { kernel(s.convs, s.states, s.qkv, s.z, s.b, s.a, s.taps, s.neg_a, s.dt, s.norm_w, s.core, pss.data(), s.done, s.hk, s.hv, s.dv, s.cd, s.in_row, s.kk, s.eps); });
    };
}

// deltanet_step_heads_*: a block per value head.
template <typename K>
static auto per_value_head(K kernel) {
    return [=](const BatchedStep& s) {
        launch(s.hv, s.n, 1, 2 * s.dv, [&] { kernel(s.convs, s.states, s.qkv, s.z, s.b, s.a, s.taps, s.neg_a, s.dt, s.norm_w, s.core, s.done, s.hk, s.hv, s.dv, s.cd, s.in_row, s.kk, s.eps); });
    };
}

// The prefill kernels of a packed prefill (conv_silu_rows_packed, conv_state_tail_packed,
// deltanet_chunk_prep_packed, the f32 and tensor-core walks *_packed) against the one-sequence
// kernels on each sequence alone: three sequences of 70, 9 and 130 rows (chunks that end
// mid-sequence, a sequence of one partial chunk), each with its own conv window and state;
// outputs, windows and states bit for bit.
template <int DK>
static void check_chunked_packed(int hk, int hv, int dv) {
    const int n = 3, kk = 4, cd = 2 * hk * DK + hv * dv, vd = hv * dv, qk = 2 * hk * DK;
    const int counts[n] = {70, 9, 130};
    const float q_scale = 1 / std::sqrt((float)DK);
    int t = 0, chunks = 0, longest = 0;
    std::vector<u32> seqs;
    for (int c : counts) {
        seqs.insert(seqs.end(), {(u32)t, (u32)c, (u32)chunks, 0u});
        t += c;
        chunks += (c + 63) / 64;
        longest = std::max(longest, c);
    }
    auto taps = random((size_t)kk * cd, -0.7, 0.7), neg_a = random(hv, -2, -0.2), dt = random(hv, -1, 1);
    auto qkv = random((size_t)t * cd, -2, 2), b = random((size_t)t * hv, -2, 2), a = random((size_t)t * hv, -2, 2);
    std::vector<std::vector<float>> conv(n), state(n), state_mma(n);
    std::vector<float*> convs(n);
    std::vector<void*> states(n), states_mma(n);
    for (int s = 0; s < n; s++) {
        conv[s] = random((size_t)kk * cd, -1, 1);
        state[s] = state_mma[s] = random((size_t)hv * DK * dv, -0.5, 0.5);
        convs[s] = conv[s].data();
        states[s] = state[s].data();
        states_mma[s] = state_mma[s].data();
    }
    // Alone first, from copies of the same windows and states.
    auto conv1 = conv, state1 = state, state1_mma = state_mma;
    std::vector<float> mixed1((size_t)t * cd), core1((size_t)t * vd), core1_mma((size_t)t * vd);
    auto walk_mma = DK == 32 ? deltanet_chunk_state_mma_32 : DK == 64 ? deltanet_chunk_state_mma_64 : deltanet_chunk_state_mma_128;
    for (int s = 0, first = 0; s < n; first += counts[s], s++) {
        int c = counts[s], ch = (c + 63) / 64;
        float* mx = mixed1.data() + (size_t)first * cd;
        std::vector<float> gcum((size_t)c * hv), U((size_t)c * hv * dv), W((size_t)c * hv * DK), P((size_t)ch * hv * 64 * 64), U_mma(U.size());
        std::vector<bf16_t> P16(P.size());
        std::vector<bf16_t> ops((size_t)3 * c * hv * DK);
        bf16_t *wb = ops.data(), *qb = wb + (size_t)c * hv * DK, *kb = qb + (size_t)c * hv * DK;
        launch((c + CONV_RUN - 1) / CONV_RUN, (cd + 1023) / 1024, 1, 256, [&] { conv_silu_rows_4(conv1[s].data(), qkv.data() + (size_t)first * cd, taps.data(), mx, c, cd, kk, qk, DK, q_scale); });
        launch((cd + 255) / 256, 1, 1, 256, [&] { conv_state_tail(conv1[s].data(), qkv.data() + (size_t)first * cd, c, cd, kk); });
        const float *bs = b.data() + (size_t)first * hv, *as = a.data() + (size_t)first * hv;
        launch(ch, hv, 1, 256, [&] { deltanet_chunk_prep(mx, bs, as, neg_a.data(), dt.data(), gcum.data(), U_mma.data(), W.data(), P.data(), wb, qb, kb, P16.data(), c, hk, hv, DK, dv, cd); });
        launch(ch, hv, 1, 256, [&] { deltanet_chunk_prep(mx, bs, as, neg_a.data(), dt.data(), gcum.data(), U.data(), W.data(), P.data(), nullptr, nullptr, nullptr, nullptr, c, hk, hv, DK, dv, cd); });
        launch(hv, dv / 16, 1, 256, [&] { deltanet_chunk_state(state1[s].data(), mx, gcum.data(), U.data(), W.data(), P.data(), core1.data() + (size_t)first * vd, c, hk, hv, DK, dv, cd); });
        launch(hv, dv / 16, 1, 128, [&] { walk_mma(state1_mma[s].data(), gcum.data(), U_mma.data(), wb, qb, kb, P16.data(), core1_mma.data() + (size_t)first * vd, c, hv, DK, dv); });
    }
    // Packed: each kernel once for the three.
    std::vector<float> mixed((size_t)t * cd), core((size_t)t * vd), core_mma((size_t)t * vd);
    std::vector<float> gcum((size_t)t * hv), U((size_t)t * hv * dv), W((size_t)t * hv * DK), P((size_t)chunks * hv * 64 * 64), U_mma(U.size());
    std::vector<bf16_t> P16(P.size());
    std::vector<bf16_t> ops((size_t)3 * t * hv * DK);
    bf16_t *wb = ops.data(), *qb = wb + (size_t)t * hv * DK, *kb = qb + (size_t)t * hv * DK;
    launch((longest + CONV_RUN - 1) / CONV_RUN, (cd + 1023) / 1024, n, 256, [&] { conv_silu_rows_packed_4(convs.data(), seqs.data(), qkv.data(), taps.data(), mixed.data(), cd, kk, qk, DK, q_scale); });
    launch((cd + 255) / 256, 1, n, 256, [&] { conv_state_tail_packed(convs.data(), seqs.data(), qkv.data(), cd, kk); });
    int most = (longest + 63) / 64;
    launch(most, hv, n, 256, [&] { deltanet_chunk_prep_packed(seqs.data(), mixed.data(), b.data(), a.data(), neg_a.data(), dt.data(), gcum.data(), U_mma.data(), W.data(), P.data(), wb, qb, kb, P16.data(), hk, hv, DK, dv, cd); });
    launch(most, hv, n, 256, [&] { deltanet_chunk_prep_packed(seqs.data(), mixed.data(), b.data(), a.data(), neg_a.data(), dt.data(), gcum.data(), U.data(), W.data(), P.data(), nullptr, nullptr, nullptr, nullptr, hk, hv, DK, dv, cd); });
    launch(hv, dv / 16, n, 256, [&] { deltanet_chunk_state_packed(states.data(), seqs.data(), mixed.data(), gcum.data(), U.data(), W.data(), P.data(), core.data(), hk, hv, DK, dv, cd); });
    auto packed_mma = DK == 32 ? deltanet_chunk_state_mma_packed_32 : DK == 64 ? deltanet_chunk_state_mma_packed_64 : deltanet_chunk_state_mma_packed_128;
    launch(hv, dv / 16, n, 128, [&] { packed_mma(states_mma.data(), seqs.data(), gcum.data(), U_mma.data(), wb, qb, kb, P16.data(), core_mma.data(), hv, DK, dv); });
    bool same = mixed == mixed1 && core == core1 && core_mma == core1_mma;
    for (int s = 0; s < n; s++) same &= conv[s] == conv1[s] && state[s] == state1[s] && state_mma[s] == state1_mma[s];
    failures += !same;
    printf("%s the packed prefill kernels, dk %d, 3 sequences of 70, 9 and 130 rows: each sequence's bits as alone\n", same ? "ok  " : "FAIL", DK);
}

// The builds for bf16 states (*_bf16_state) against the f32 builds: from a state of bf16
// values, the same outputs bit for bit, and the f32 build's new state rounded to bf16 (each
// build loads, computes in f32 and rounds once as it stores).
static void check_bf16_state_builds() {
    const int hk = 2, hv = 4, dk = 32, dv = 32, kk = 4, kd = hk * dk, cd = 2 * kd + hv * dv, vd = hv * dv, blocks = hv * dv / 32;
    const float eps = 1e-6f;
    auto to_bf16 = [](const std::vector<float>& v) { std::vector<bf16_t> out(v.size()); for (size_t i = 0; i < v.size(); i++) out[i] = f32_to_bf16(v[i]); return out; };
    auto widen = [](const std::vector<bf16_t>& v) { std::vector<float> out(v.size()); for (size_t i = 0; i < v.size(); i++) out[i] = bf16_to_f32(v[i]); return out; };
    auto report = [](const char* what, bool same) {
        failures += !same;
        printf("%s %s for bf16 states: the f32 build's outputs and its state rounded to bf16\n", same ? "ok  " : "FAIL", what);
    };
    auto start = to_bf16(random((size_t)hv * dk * dv, -0.5, 0.5));
    auto taps = random((size_t)kk * cd, -0.7, 0.7), neg_a = random(hv, -2, -0.2), dt = random(hv, -1, 1), norm_w = random(dv, 0.5, 1.5);
    {
        // The decode step (3 tokens) and the batched step (one sequence).
        const int t = 3;
        auto qkv = random((size_t)t * cd, -2, 2), z = random((size_t)t * vd, -2, 2), b = random((size_t)t * hv, -2, 2), a = random((size_t)t * hv, -2, 2);
        auto conv0 = random((size_t)kk * cd, -1, 1);
        std::vector<float> conv_f = conv0, conv_b = conv0, state_f = widen(start), core_f((size_t)t * vd), core_b((size_t)t * vd), pss((size_t)blocks * 8);
        std::vector<bf16_t> state_b = start;
        std::vector<unsigned> done(hk, 0);
        launch(blocks, 1, 1, 512, [&] { deltanet_step_32(conv_f.data(), state_f.data(), qkv.data(), z.data(), b.data(), a.data(), taps.data(), neg_a.data(), dt.data(), norm_w.data(), core_f.data(), pss.data(), done.data(), t, hk, hv, dv, cd, kk, eps); });
        launch(blocks, 1, 1, 512, [&] { deltanet_step_32_bf16_state(conv_b.data(), state_b.data(), qkv.data(), z.data(), b.data(), a.data(), taps.data(), neg_a.data(), dt.data(), norm_w.data(), core_b.data(), pss.data(), done.data(), t, hk, hv, dv, cd, kk, eps); });
        report("deltanet_step_32", core_f == core_b && conv_f == conv_b && to_bf16(state_f) == state_b);
        std::vector<float> conv1_f = conv0, conv1_b = conv0, state1_f = widen(start), core1_f(vd), core1_b(vd);
        std::vector<bf16_t> state1_b = start;
        float* convs_f[1] = {conv1_f.data()};
        float* convs_b[1] = {conv1_b.data()};
        void* states_f[1] = {state1_f.data()};
        void* states_b[1] = {state1_b.data()};
        launch(blocks, 1, 1, 512, [&] { deltanet_step_batch_32(convs_f, states_f, qkv.data(), z.data(), b.data(), a.data(), taps.data(), neg_a.data(), dt.data(), norm_w.data(), core1_f.data(), pss.data(), done.data(), hk, hv, dv, cd, cd, kk, eps); });
        launch(blocks, 1, 1, 512, [&] { deltanet_step_batch_32_bf16_state(convs_b, states_b, qkv.data(), z.data(), b.data(), a.data(), taps.data(), neg_a.data(), dt.data(), norm_w.data(), core1_b.data(), pss.data(), done.data(), hk, hv, dv, cd, cd, kk, eps); });
        report("deltanet_step_batch_32", core1_f == core1_b && conv1_f == conv1_b && to_bf16(state1_f) == state1_b);
    }
    {
        // The prefill's state walks (f32 and tensor cores, alone and packed) over 70 rows.
        const int t = 70, chunks = 2;
        auto mixed = random((size_t)t * cd, -0.3, 0.3), b = random(t * hv, -2, 2), a = random(t * hv, -2, 2);
        std::vector<float> gcum(t * hv), U((size_t)t * hv * dv), W((size_t)t * hv * dk), P((size_t)chunks * hv * 64 * 64);
        std::vector<bf16_t> ops((size_t)3 * t * hv * dk), P16(P.size());
        std::vector<float> U_mma(U.size());
        bf16_t *wb = ops.data(), *qb = wb + (size_t)t * hv * dk, *kb = qb + (size_t)t * hv * dk;
        launch(chunks, hv, 1, 256, [&] { deltanet_chunk_prep(mixed.data(), b.data(), a.data(), neg_a.data(), dt.data(), gcum.data(), U_mma.data(), W.data(), P.data(), wb, qb, kb, P16.data(), t, hk, hv, dk, dv, cd); });
        launch(chunks, hv, 1, 256, [&] { deltanet_chunk_prep(mixed.data(), b.data(), a.data(), neg_a.data(), dt.data(), gcum.data(), U.data(), W.data(), P.data(), nullptr, nullptr, nullptr, nullptr, t, hk, hv, dk, dv, cd); });
        using Walk = void (*)(void*, const float*, const float*, const float*, const float*, const float*, float*, int, int, int, int, int, int);
        auto walks = [&](const char* what, Walk f32_build, Walk bf16_build, int threads) {
            std::vector<float> state_f = widen(start), core_f((size_t)t * vd), core_b((size_t)t * vd);
            std::vector<bf16_t> state_b = start;
            launch(hv, dv / 16, 1, threads, [&] { f32_build(state_f.data(), mixed.data(), gcum.data(), U.data(), W.data(), P.data(), core_f.data(), t, hk, hv, dk, dv, cd); });
            launch(hv, dv / 16, 1, threads, [&] { bf16_build(state_b.data(), mixed.data(), gcum.data(), U.data(), W.data(), P.data(), core_b.data(), t, hk, hv, dk, dv, cd); });
            report(what, core_f == core_b && to_bf16(state_f) == state_b);
        };
        walks("deltanet_chunk_state", deltanet_chunk_state, deltanet_chunk_state_bf16_state, 256);
        walks("deltanet_chunk_state_1", deltanet_chunk_state_1, deltanet_chunk_state_1_bf16_state, 256);
        using MmaWalk = void (*)(void*, const float*, const float*, const bf16_t*, const bf16_t*, const bf16_t*, const bf16_t*, float*, int, int, int, int);
        auto mma_walks = [&](const char* what, MmaWalk f32_build, MmaWalk bf16_build) {
            std::vector<float> state_f = widen(start), core_f((size_t)t * vd), core_b((size_t)t * vd);
            std::vector<bf16_t> state_b = start;
            launch(hv, dv / 16, 1, 128, [&] { f32_build(state_f.data(), gcum.data(), U_mma.data(), wb, qb, kb, P16.data(), core_f.data(), t, hv, dk, dv); });
            launch(hv, dv / 16, 1, 128, [&] { bf16_build(state_b.data(), gcum.data(), U_mma.data(), wb, qb, kb, P16.data(), core_b.data(), t, hv, dk, dv); });
            report(what, core_f == core_b && to_bf16(state_f) == state_b);
        };
        mma_walks("deltanet_chunk_state_mma_32", deltanet_chunk_state_mma_32, deltanet_chunk_state_mma_32_bf16_state);
        using PackedWalk = void (*)(void* const*, const u32*, const float*, const float*, const float*, const float*, const float*, float*, int, int, int, int, int);
        std::vector<u32> seqs = {0, (u32)t, 0, 0};
        auto packed = [&](const char* what, PackedWalk f32_build, PackedWalk bf16_build, int threads) {
            std::vector<float> state_f = widen(start), core_f((size_t)t * vd), core_b((size_t)t * vd);
            std::vector<bf16_t> state_b = start;
            void* sf[1] = {state_f.data()};
            void* sb[1] = {state_b.data()};
            launch(hv, dv / 16, 1, threads, [&] { f32_build(sf, seqs.data(), mixed.data(), gcum.data(), U.data(), W.data(), P.data(), core_f.data(), hk, hv, dk, dv, cd); });
            launch(hv, dv / 16, 1, threads, [&] { bf16_build(sb, seqs.data(), mixed.data(), gcum.data(), U.data(), W.data(), P.data(), core_b.data(), hk, hv, dk, dv, cd); });
            report(what, core_f == core_b && to_bf16(state_f) == state_b);
        };
        packed("deltanet_chunk_state_packed", deltanet_chunk_state_packed, deltanet_chunk_state_packed_bf16_state, 256);
        using MmaPackedWalk = void (*)(void* const*, const u32*, const float*, const float*, const bf16_t*, const bf16_t*, const bf16_t*, const bf16_t*, float*, int, int, int);
        {
            MmaPackedWalk f32_build = deltanet_chunk_state_mma_packed_32, bf16_build = deltanet_chunk_state_mma_packed_32_bf16_state;
            std::vector<float> state_f = widen(start), core_f((size_t)t * vd), core_b((size_t)t * vd);
            std::vector<bf16_t> state_b = start;
            void* sf[1] = {state_f.data()};
            void* sb[1] = {state_b.data()};
            launch(hv, dv / 16, 1, 128, [&] { f32_build(sf, seqs.data(), gcum.data(), U_mma.data(), wb, qb, kb, P16.data(), core_f.data(), hv, dk, dv); });
            launch(hv, dv / 16, 1, 128, [&] { bf16_build(sb, seqs.data(), gcum.data(), U_mma.data(), wb, qb, kb, P16.data(), core_b.data(), hv, dk, dv); });
            report("deltanet_chunk_state_mma_packed_32", core_f == core_b && to_bf16(state_f) == state_b);
        }
    }
}

static void check_deltanet_kernels() {
    check_bf16_state_builds();
    check_chunked_packed<32>(2, 4, 32);
    check_chunked_packed<128>(1, 2, 128);
    check_deltanet_step<32>(2, 4, 32, deltanet_step_32);
    check_deltanet_step<128>(2, 4, 128, deltanet_step_128);
    check_batched_step<32, float>(2, 4, 32, "deltanet_step_batch_32", deltanet_step_32, per_32_columns(deltanet_step_batch_32));
    check_batched_step<128, float>(2, 4, 128, "deltanet_step_batch_128", deltanet_step_128, per_32_columns(deltanet_step_batch_128));
    check_batched_step<32, float>(2, 4, 32, "deltanet_step_heads_32", deltanet_step_32, per_value_head(deltanet_step_heads_32));
    check_batched_step<32, float>(4, 4, 32, "deltanet_step_heads_32", deltanet_step_32, per_value_head(deltanet_step_heads_32));
    check_batched_step<64, float>(2, 4, 64, "deltanet_step_heads_64", deltanet_step_64, per_value_head(deltanet_step_heads_64));
    check_batched_step<64, bf16_t>(2, 2, 64, "deltanet_step_heads_64_bf16_state", deltanet_step_64_bf16_state, per_value_head(deltanet_step_heads_64_bf16_state));
    check_batched_step<128, float>(2, 4, 128, "deltanet_step_heads_128", deltanet_step_128, per_value_head(deltanet_step_heads_128));
    check_batched_step<128, float>(2, 2, 128, "deltanet_step_heads_128", deltanet_step_128, per_value_head(deltanet_step_heads_128));
    check_batched_step<32, bf16_t>(2, 4, 32, "deltanet_step_heads_32_bf16_state", deltanet_step_32_bf16_state, per_value_head(deltanet_step_heads_32_bf16_state));
    check_batched_step<128, bf16_t>(2, 2, 128, "deltanet_step_heads_128_bf16_state", deltanet_step_128_bf16_state, per_value_head(deltanet_step_heads_128_bf16_state));
    check_chunked(150, 2, 4, 32, 32);
    check_chunked(70, 1, 2, 128, 128);
    check_conv_and_gated_norm();
}
