//! RMSNorm variants of Qwen3.5 (qwen35-spec.md §2.2) and the small activations.

/// `y = x · rsqrt(mean(x²) + eps) · scale`, per row of width `scale.len()`.
/// For the zero-centred Qwen3_5RMSNorm the caller passes `scale = 1 + w`.
pub fn rms_norm(x: &[f32], scale: &[f32], eps: f32, out: &mut [f32]) {
    let d = scale.len();
    for (xr, yr) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let inv = inv_rms(xr, eps);
        for ((y, &v), &s) in yr.iter_mut().zip(xr).zip(scale) {
            *y = v * inv * s;
        }
    }
}

/// In-place RMSNorm of every row of width `scale.len()`.
pub fn rms_norm_inplace(x: &mut [f32], scale: &[f32], eps: f32) {
    let d = scale.len();
    for xr in x.chunks_exact_mut(d) {
        let inv = inv_rms(xr, eps);
        for (v, &s) in xr.iter_mut().zip(scale) {
            *v = *v * inv * s;
        }
    }
}

/// Qwen3_5RMSNormGated: `y = w · (x · rsqrt(mean(x²) + eps)) · silu(z)` per row of width
/// `w.len()` (one DeltaNet value head). Normalise first, then gate; `w` is a plain weight.
pub fn gated_rms_norm_inplace(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let d = w.len();
    for (xr, zr) in x.chunks_exact_mut(d).zip(z.chunks_exact(d)) {
        let inv = inv_rms(xr, eps);
        for ((v, &g), &s) in xr.iter_mut().zip(zr).zip(w) {
            *v = s * (*v * inv) * silu(g);
        }
    }
}

#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// `x · rsqrt(Σx² + 1e-6)`: the l2norm inside the gated delta rule (eps hard-coded in HF).
pub fn l2_normalize(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
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
    fn softplus_matches_torch_threshold() {
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
    }
}
