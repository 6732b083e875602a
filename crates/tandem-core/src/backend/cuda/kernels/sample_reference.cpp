// The reference of kernels/sample.cu and its checks (the greedy pick, the draw with its cuts): run on CPU threads by
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

// The plain form of a draw (sampling.rs Sampler::sample_drawn): the candidates sorted by score
// (high first, then id), cut to top_k and to the fewest whose weight reaches ceil(top_p * total),
// back in id order, and the first whose running weight passes u * total; 0xffffffff without a
// candidate.
static u32 plain_draw(const float* x, int n, float inv_t, unsigned long long top_k, float top_p, double u) {
    float m = -INFINITY;
    for (int i = 0; i < n; i++) m = std::fmax(m, x[i]);
    struct C { int id; float s; unsigned long long w; };
    std::vector<C> c;
    for (int i = 0; i < n; i++) {
        float s = (x[i] - m) * inv_t;
        if (s > -30.0f) c.push_back({i, s, (unsigned long long)std::llround((double)std::exp(s) * 1099511627776.0)});
    }
    if (c.empty()) return 0xffffffffu;
    std::sort(c.begin(), c.end(), [](const C& a, const C& b) { return a.s > b.s || (a.s == b.s && a.id < b.id); });
    if (top_k > 0 && top_k < c.size()) c.resize(top_k);
    if (top_p < 1.0f) {
        unsigned long long total = 0, run = 0;
        for (auto& e : c) total += e.w;
        unsigned long long target = std::min(std::max((unsigned long long)std::ceil((double)top_p * (double)total), 1ull), total);
        size_t keep = 0;
        while (keep < c.size() && run < target) run += c[keep++].w;
        c.resize(keep);
    }
    std::sort(c.begin(), c.end(), [](const C& a, const C& b) { return a.id < b.id; });
    unsigned long long total = 0, run = 0;
    for (auto& e : c) total += e.w;
    unsigned long long r = std::min((unsigned long long)(u * (double)total), total - 1);
    for (auto& e : c) {
        run += e.w;
        if (r < run) return e.id;
    }
    return 0xffffffffu;
}

// sample_rows against the plain form, one launch over rows of different lengths, temperatures
// and cuts, each at several draws across [0, 1): rows with NaN, with ties at the top-k boundary
// (equal logits around the k-th), with more kept than candidates, top_k 1, a tiny top_p, a top_k
// past the few gathered in shared memory, the step's argmax given or not (and one past the
// allowed ids), and a row without a finite logit (the sentinel).
static void check_sample_rows(int n, int threads) {
    struct Row { float temperature; unsigned long long top_k; float top_p; };
    std::vector<Row> kinds = {{1.0f, 0, 1.0f}, {0.7f, 20, 1.0f}, {0.7f, 0, 0.8f}, {0.6f, 20, 0.95f}, {1.3f, 1, 1.0f}, {1.0f, 0, 1e-6f},
                              {0.8f, 1000000, 0.5f}, {0.3f, 64, 0.9f}, {1.0f, 7, 1.0f}, {0.9f, 2000, 0.7f}, {1.1f, 1500, 1.0f}};
    int rows_n = (int)kinds.size() + 1;
    std::vector<std::vector<float>> rows;
    for (int r = 0; r < rows_n; r++) {
        auto x = random(n, -6, 6);
        x[(size_t)(r * 37) % n] = std::nanf("");
        // Ties: a run of equal values high enough to straddle small top-k boundaries.
        for (int i = 0; i < 12; i++) x[(size_t)(i * 101 + r) % n] = 7.25f;
        rows.push_back(x);
    }
    // A largest value past the allowed ids: a step's argmax there does not give the maximum.
    rows[1][n - 1] = 50.0f;
    rows.back().assign(n, -INFINITY);
    rows.back()[1] = std::nanf("");
    std::vector<const float*> ptrs;
    for (auto& x : rows) ptrs.push_back(x.data());
    bool ok = true;
    std::vector<u32> got(rows_n);
    for (double u : {0.0, 1e-9, 0.5, 0.731, 0.99999999999}) {
        std::vector<double> params;
        for (int r = 0; r < rows_n; r++) {
            Row k = kinds[r % kinds.size()];
            int len = n - 3 * r;  // rows of different allowed lengths
            // Every other row with the whole row's argmax (the first largest), as a step finds it.
            int argmax = -1;
            for (int i = 0; i < n && r % 2; i++)
                if (!std::isnan(rows[r][i]) && (argmax < 0 || rows[r][i] > rows[r][argmax])) argmax = i;
            params.insert(params.end(), {(double)len, (double)(1.0f / k.temperature), (double)k.top_k, (double)k.top_p, u, (double)argmax});
        }
        std::fill(got.begin(), got.end(), 12345u);
        launch(rows_n, 1, 1, threads, [&] { sample_rows((float* const*)ptrs.data(), params.data(), got.data()); });
        for (int r = 0; r < rows_n; r++) {
            const double* p = &params[6 * r];
            u32 want = plain_draw(rows[r].data(), (int)p[0], (float)p[1], (unsigned long long)p[2], (float)p[3], u);
            if (got[r] != want) printf("     row %d, u %g: %u, the plain draw %u\n", r, u, got[r], want);
            ok &= got[r] == want;
        }
    }
    failures += !ok;
    printf("%s sample_rows, %d rows of about %d logits with top-k and top-p cuts, %d threads: the plain draw's picks, the sentinel without a finite logit\n", ok ? "ok  " : "FAIL", rows_n, n, threads);
}

// mask_rows against the plain mask (grammar::apply): rows of different masks (all allowed, a
// few ids, whole words and single bits, none), ids past the mask's words never reached; then the
// greedy pick of each masked row by argmax_rows is the plain loop's over the allowed ids, -inf
// elsewhere.
static void check_mask_rows(int rows_n, int n, int spans) {
    int words = (n + 31) / 32;
    auto x = random((size_t)rows_n * n, -8, 8);
    x[3] = std::nanf("");
    std::vector<u32> bits((size_t)rows_n * words);
    unsigned seed = 12345;
    auto next = [&] { seed = seed * 1664525u + 1013904223u; return seed; };
    for (int r = 0; r < rows_n; r++) {
        u32* b = &bits[(size_t)r * words];
        for (int w = 0; w < words; w++) {
            switch (r % 4) {
                case 0: b[w] = 0xffffffffu; break;                     // every id
                case 1: b[w] = (w % 7 == 0) ? next() : 0u; break;      // a few words, random bits
                case 2: b[w] = (w == words / 2) ? 1u << (r % 32) : 0u; break;  // one id
                default: b[w] = (w % 3 == 1) ? 0xffffffffu : 0u; break;  // whole words
            }
        }
    }
    std::vector<const float*> ptrs;
    for (int r = 0; r < rows_n; r++) ptrs.push_back(&x[(size_t)r * n]);
    std::vector<float> out((size_t)rows_n * n, 1.0f);
    launch(spans, rows_n, 1, 256, [&] { mask_rows((float* const*)ptrs.data(), bits.data(), words, n, out.data()); });
    bool ok = true;
    for (int r = 0; r < rows_n; r++)
        for (int i = 0; i < n; i++) {
            bool allowed = (bits[(size_t)r * words + i / 32] >> (i % 32)) & 1u;
            float want = allowed ? x[(size_t)r * n + i] : -INFINITY, got = out[(size_t)r * n + i];
            ok &= (std::isnan(want) && std::isnan(got)) || got == want;
        }
    std::vector<float> pv((size_t)rows_n * spans);
    std::vector<u32> pi((size_t)rows_n * spans), got(rows_n);
    std::vector<unsigned> done(rows_n, 0);
    launch(spans, rows_n, 1, 256, [&] { argmax_rows(out.data(), n, pv.data(), pi.data(), done.data(), got.data()); });
    for (int r = 0; r < rows_n; r++) {
        int best = -1;
        for (int i = 0; i < n; i++) {
            bool allowed = (bits[(size_t)r * words + i / 32] >> (i % 32)) & 1u;
            float v = allowed ? x[(size_t)r * n + i] : -INFINITY;
            if (!std::isnan(v) && (best < 0 || v > (((bits[(size_t)r * words + best / 32] >> (best % 32)) & 1u) ? x[(size_t)r * n + best] : -INFINITY))) best = i;
        }
        ok &= got[r] == (u32)std::max(best, 0);
    }
    failures += !ok;
    printf("%s mask_rows, %d rows of %d in %d spans: the plain mask, and argmax_rows' picks of the masked rows the plain loop's\n", ok ? "ok  " : "FAIL", rows_n, n, spans);
}

static void check_sample_kernels() {
    check_sample_rows(10007, 256);
    check_sample_rows(300, 96);
    check_argmax(4, 10007, 64);
    check_argmax(3, 300, 7);
    check_mask_rows(8, 10007, 64);
    check_mask_rows(5, 300, 3);
}
