// The CUDA kernels run on CPU threads (shim.h) against plain double-precision references (the
// *_reference.cpp files beside the kernels): each check prints one line and the program exits
// non-zero if any is out of bounds.
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

static bool all_zero(const std::vector<unsigned>& v) { return std::all_of(v.begin(), v.end(), [](unsigned x) { return x == 0; }); }
static void check_counters(const std::string& what, const std::vector<unsigned>& done) {
    failures += !all_zero(done);
    printf("%s %s: hand-over counters back at zero\n", all_zero(done) ? "ok  " : "FAIL", what.c_str());
}

// bf16 weights [n, k] from random values; `wf` gets the values they hold.
static std::vector<bf16_t> bf16_matrix(size_t n, std::vector<float>& wf) {
    wf = random(n, -1, 1);
    std::vector<bf16_t> w(n);
    for (size_t i = 0; i < n; i++) { w[i] = f32_to_bf16(wf[i]); wf[i] = bf16_to_f32(w[i]); }
    return w;
}

// The references and checks of each kernel family, beside its kernels in src/backend/cuda/kernels/.
#include "norm_reference.cpp"
#include "blocks_reference.cpp"
#include "gemv_reference.cpp"
#include "gemm_reference.cpp"
#include "deltanet_reference.cpp"
#include "attention_reference.cpp"
#include "sample_reference.cpp"

int main() {
    check_attention_kernels();
    check_deltanet_kernels();
    check_blocks_kernels();
    check_gemv_kernels();
    check_gemm();
    check_gemm_f32();
    check_norms();
    check_sample_kernels();
    return failures != 0;
}
