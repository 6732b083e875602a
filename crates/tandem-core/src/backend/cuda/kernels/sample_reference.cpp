// The reference of kernels/sample.cu and its checks (the greedy pick): run on CPU threads by
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

static void check_sample_kernels() {
    check_argmax(4, 10007, 64);
    check_argmax(3, 300, 7);
}
