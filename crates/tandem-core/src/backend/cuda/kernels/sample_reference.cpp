// The reference of kernels/sample.cu and its checks (the greedy pick, the draw at a temperature): run on CPU threads by
// tests/cuda_on_cpu.rs; tests/cuda_emu/checks.cpp (random, compare, ...) includes it.

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

// sample_row against the plain form (sampling.rs Sampler::sample without cuts: integer weights,
// the first id whose running weight passes u * total), for draws across [0, 1); a row with no
// finite logit gives the sentinel.
static void check_sample_row(int n, float temperature) {
    auto x = random(n, -6, 6);
    x[n / 3] = std::nanf("");
    float inv_t = 1.0f / temperature;
    float m = -INFINITY;
    for (float v : x) m = std::fmax(m, v);
    std::vector<unsigned long long> w(n);
    unsigned long long total = 0;
    for (int i = 0; i < n; i++) {
        float s = (x[i] - m) * inv_t;
        w[i] = s > -30.0f ? (unsigned long long)std::llround((double)std::exp(s) * 1099511627776.0) : 0ull;
        total += w[i];
    }
    bool ok = true;
    std::vector<u32> got(1);
    for (double u : {0.0, 1e-9, 0.25, 0.5, 0.731, 0.999999, 0.99999999999}) {
        got[0] = 12345;
        launch(1, 1, 1, 256, [&] { sample_row(x.data(), n, inv_t, u, got.data()); });
        unsigned long long r = std::min((unsigned long long)(u * (double)total), total - 1), run = 0;
        int want = -1;
        for (int i = 0; i < n && want < 0; i++) {
            run += w[i];
            if (r < run) want = i;
        }
        ok &= got[0] == (u32)want;
    }
    std::vector<float> none(n, -INFINITY);
    none[1] = std::nanf("");
    launch(1, 1, 1, 256, [&] { sample_row(none.data(), n, inv_t, 0.5, got.data()); });
    ok &= got[0] == 0xffffffffu;
    failures += !ok;
    printf("%s sample_row, %d logits at temperature %.1f: the plain draw's picks, the sentinel without a finite logit\n", ok ? "ok  " : "FAIL", n, temperature);
}

static void check_sample_kernels() {
    check_sample_row(10007, 1.0f);
    check_sample_row(300, 0.3f);
    check_argmax(4, 10007, 64);
    check_argmax(3, 300, 7);
}
