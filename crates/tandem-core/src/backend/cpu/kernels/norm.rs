//! RMSNorm variants of Qwen3.5 (docs/qwen35.md §2.2) and the small activations.

use super::matmul::dot;

crate::backend::cpu::kernels::multiversion! {
    /// `y = x · rsqrt(mean(x²) + eps) · scale`, per row of width `scale.len()`.
    /// For the zero-centred Qwen3_5RMSNorm the caller passes `scale = 1 + w`.
    pub fn rms_norm(x: &[f32], scale: &[f32], eps: f32, out: &mut [f32]) => rms_norm_body
}

#[inline(always)]
fn rms_norm_body(x: &[f32], scale: &[f32], eps: f32, out: &mut [f32]) {
    let d = scale.len();
    for (xr, yr) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let inv = inv_rms(xr, eps);
        for ((y, &v), &s) in yr.iter_mut().zip(xr).zip(scale) {
            *y = v * inv * s;
        }
    }
}

crate::backend::cpu::kernels::multiversion! {
    /// In-place RMSNorm of every row of width `scale.len()`.
    pub fn rms_norm_inplace(x: &mut [f32], scale: &[f32], eps: f32) => rms_norm_inplace_body
}

#[inline(always)]
fn rms_norm_inplace_body(x: &mut [f32], scale: &[f32], eps: f32) {
    let d = scale.len();
    for xr in x.chunks_exact_mut(d) {
        let inv = inv_rms(xr, eps);
        for (v, &s) in xr.iter_mut().zip(scale) {
            *v = *v * inv * s;
        }
    }
}

crate::backend::cpu::kernels::multiversion! {
    /// Qwen3_5RMSNormGated: `y = w · (x · rsqrt(mean(x²) + eps)) · silu(z)` per row of width
    /// `w.len()` (one DeltaNet value head). Normalise first, then gate; `w` is a plain weight.
    pub fn gated_rms_norm_inplace(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) => gated_rms_norm_body
}

#[inline(always)]
fn gated_rms_norm_body(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let d = w.len();
    for (xr, zr) in x.chunks_exact_mut(d).zip(z.chunks_exact(d)) {
        let inv = inv_rms(xr, eps);
        for ((v, &g), &s) in xr.iter_mut().zip(zr).zip(w) {
            *v = s * (*v * inv) * silu(g);
        }
    }
}

/// `Σx²` in sixteen lanes (`dot`): one running sum was a chain of dependent adds, 1,024 of
/// them per row of the 0.8B, which made the prompt's norms a few per cent of its prefill.
#[inline(always)]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss = dot(x, x);
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

crate::backend::cpu::kernels::multiversion! {
    /// `x · rsqrt(Σx² + 1e-6)`: the l2norm inside the gated delta rule (eps hard-coded in HF).
    pub fn l2_normalize(x: &mut [f32]) => l2_normalize_body
}

#[inline(always)]
fn l2_normalize_body(x: &mut [f32]) {
    let ss = dot(x, x);
    let inv = 1.0 / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// e^x in straight-line f32 arithmetic that the compiler vectorises (a libm call per element
/// cost 4-5% of a prefill in `silu`): `2^n · p(r)` with `r = x − n ln 2`, |r| ≤ ln2/2, and a
/// degree-6 Taylor polynomial. Relative error below 4e-7 (about 3 ulp; tested against f64)
/// for x in [−87, 88]; outside it x is clamped (e^−87 = 1.6e-38 stands for anything smaller).
#[inline(always)]
pub fn exp_fast(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that n · LN2_HI is exact for |n| < 2^9.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding and subtracting 1.5 · 2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let mut p: f32 = 1.0 / 720.0;
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p.mul_add(r, c);
    }
    p * f32::from_bits((((n as i32) + 127) << 23) as u32)
}

crate::backend::cpu::kernels::multiversion! {
    /// `gate[i] = silu(gate[i]) · up[i]`: the SwiGLU activation, with `exp_fast`.
    pub fn swiglu_inplace(gate: &mut [f32], up: &[f32]) => swiglu_body
}

#[inline(always)]
fn swiglu_body(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// `x · sigmoid(x)`, with `exp_fast` (the conv's and the gated norm's SiLU took a tenth of a
/// prefill with a libm call per element).
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp_fast(-x))
}

/// `1 / (1 + e^-x)`, with `exp_fast`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_fast(-x))
}

/// torch.nn.functional.softplus with its default threshold of 20.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_of_a_constant_row_is_the_scale() {
        let mut out = [0f32; 4];
        rms_norm(&[3.0; 4], &[1.0, 2.0, 0.5, 0.0], 0.0, &mut out);
        assert_eq!(out, [1.0, 2.0, 0.5, 0.0]);
    }

    #[test]
    fn gated_norm_applies_silu_of_the_gate_after_normalising() {
        let mut x = [2.0f32, -2.0];
        gated_rms_norm_inplace(&mut x, &[0.0, 100.0], &[1.0, 3.0], 0.0);
        assert!((x[0] - 0.0).abs() < 1e-7);
        assert!((x[1] - (-3.0 * 100.0)).abs() < 1e-3);
    }

    #[test]
    fn exp_fast_is_within_4e7_of_exp() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = (x as f64).exp();
            worst = worst.max(((exp_fast(x) as f64 - want) / want).abs());
            x += 0.000_37;
        }
        assert!(worst < 4e-7, "largest relative error {worst:e}");
        assert_eq!(exp_fast(-1000.0), exp_fast(-87.0));
        assert!(exp_fast(f32::NAN).is_nan());
    }

    #[test]
    fn swiglu_matches_silu_times_up_in_f64() {
        crate::backend::cpu::kernels::for_each_isa(|isa| {
            let g0: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.037).collect();
            let up: Vec<f32> = (0..1000).map(|i| (i % 7) as f32 - 3.0).collect();
            let mut g = g0.clone();
            swiglu_inplace(&mut g, &up);
            for i in 0..g.len() {
                let x = g0[i] as f64;
                let want = (x / (1.0 + (-x).exp()) * up[i] as f64) as f32;
                assert!((g[i] - want).abs() <= 1e-6 * want.abs().max(1.0), "{isa:?} [{i}] {} vs {want}", g[i]);
            }
        });
    }

    /// The gated norm's build for each instruction set against its definition in f64.
    #[test]
    fn gated_norm_matches_its_definition_on_every_isa() {
        crate::backend::cpu::kernels::for_each_isa(|isa| {
            let d = 128;
            let x0: Vec<f32> = (0..3 * d).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.03).collect();
            let z: Vec<f32> = (0..3 * d).map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.2).collect();
            let w: Vec<f32> = (0..d).map(|i| 0.5 + (i % 5) as f32 * 0.1).collect();
            let mut x = x0.clone();
            gated_rms_norm_inplace(&mut x, &z, &w, 1e-6);
            for (r, (xr, zr)) in x0.chunks_exact(d).zip(z.chunks_exact(d)).enumerate() {
                let inv = 1.0 / (xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64 + 1e-6).sqrt();
                for i in 0..d {
                    let g = zr[i] as f64;
                    let want = w[i] as f64 * xr[i] as f64 * inv * g / (1.0 + (-g).exp());
                    let got = x[r * d + i] as f64;
                    assert!((got - want).abs() <= 2e-6 * want.abs().max(1.0), "{isa:?} row {r} [{i}]: {got} vs {want}");
                }
            }
        });
    }

    #[test]
    fn softplus_matches_torch_threshold() {
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
    }
}
