// The reference of kernels/norm.cu and its checks (RMSNorm, SwiGLU, the bf16 rounding): run on CPU threads by
// tests/cuda_on_cpu.rs; tests/cuda_emu/checks.cpp (random, compare, ...) includes it.

// RMSNorm (f32 and the bf16 operand), SwiGLU (from f32 and from bf16), to_bf16.
static void check_norms() {
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
        launch((n + 1023) / 1024, 1, 1, 256, [&] { swiglu_bf16(gb.data(), ub.data(), ob.data(), n, n, n); });
        for (int i = 0; i < n; i++) from_bf16[i] = bf16_to_f32(ob[i]);
        compare("swiglu_bf16, 1002 values", from_bf16, want_b, 4e-3);
        // The first 996 values as 3 rows of 332 whose gate and up share rows (the stacked
        // matrices' product: gate then up in each row of 664): the same bits.
        {
            const int rows = 3, f = 332, m = rows * f;
            std::vector<bf16_t> gu((size_t)2 * m), oc(m);
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < f; c++) {
                    gu[(size_t)r * 2 * f + c] = gb[r * f + c];
                    gu[(size_t)r * 2 * f + f + c] = ub[r * f + c];
                }
            launch((m + 1023) / 1024, 1, 1, 256, [&] { swiglu_bf16(gu.data(), gu.data() + f, oc.data(), m, f, 2 * f); });
            bool same = std::equal(oc.begin(), oc.end(), ob.begin());
            failures += !same;
            printf("%s swiglu_bf16, 3 rows of 332 from gate and up in one matrix: the bits of separate rows\n", same ? "ok  " : "FAIL");
        }
        launch((n + 1023) / 1024, 1, 1, 256, [&] { to_bf16(x.data(), ob.data(), n); });
        for (int i = 0; i < n; i++) xb[i] = bf16_to_f32(ob[i]);
        compare("to_bf16, 1002 values", xb, std::vector<double>(x.begin(), x.end()), 4e-3);
    }
}
