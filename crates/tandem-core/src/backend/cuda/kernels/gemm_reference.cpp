// The reference of kernels/gemm.cu and its checks (the exact prefill GEMM): run on CPU threads by
// tests/cuda_on_cpu.rs; tests/cuda_emu/checks.cpp (random, compare, ...) includes it.

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

// The same GEMM of f32 weights (a block format's, dequantized), writing its output.
static void check_gemm_f32() {
    const int n = 45, k = 96, t = 70;
    auto w = random((size_t)n * k, -1, 1), x = random((size_t)t * k, -2, 2), out = random((size_t)t * n, -1, 1);
    std::vector<double> want((size_t)t * n, 0.0);
    for (int m = 0; m < t; m++)
        for (int r = 0; r < n; r++)
            for (int c = 0; c < k; c++) want[(size_t)m * n + r] += (double)w[(size_t)r * k + c] * x[(size_t)m * k + c];
    launch((n + 63) / 64, (t + 63) / 64, 1, 256, [&] { gemm_f32_f32(w.data(), x.data(), out.data(), n, k, t, 0); });
    compare("gemm_f32_f32, 70 x 96 by 45 x 96", out, want, 1e-5);
}
