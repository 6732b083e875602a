//! Partial NeoX rotary embedding (docs/qwen35.md §2.5 step 3): only the first `rotary_dim`
//! channels of each head rotate, in pairs (d, d + rotary_dim/2).

/// Inverse frequencies `θ^(-2i/rotary_dim)` in f32, as HF computes them.
pub fn inv_freq(theta: f64, rotary_dim: usize) -> Vec<f32> {
    (0..rotary_dim / 2).map(|i| (1.0 / theta.powf(2.0 * i as f64 / rotary_dim as f64)) as f32).collect()
}

/// The same frequencies rounded to bf16: what a reference gets whose model was built in bf16
/// and then cast to f32 (the buffer is rounded with the weights). Only `verify` uses this, when
/// the reference file says so.
pub fn inv_freq_bf16(theta: f64, rotary_dim: usize) -> Vec<f32> {
    inv_freq(theta, rotary_dim).into_iter().map(|f| half::bf16::from_f32(f).to_f32()).collect()
}

/// cos and sin tables of one position, each of length `rotary_dim / 2`. The angle is the f32
/// product `pos · inv_freq`, exactly as the reference computes it, so long positions round alike.
pub fn cos_sin(pos: usize, inv_freq: &[f32], cos: &mut [f32], sin: &mut [f32]) {
    for ((f, c), s) in inv_freq.iter().zip(cos.iter_mut()).zip(sin.iter_mut()) {
        let angle = (pos as f32) * f;
        *c = (angle as f64).cos() as f32;
        *s = (angle as f64).sin() as f32;
    }
}

/// Rotate the first `2 * cos.len()` channels of one head vector in place.
pub fn apply_rope(head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for d in 0..half {
        let (a, b) = (head[d], head[d + half]);
        head[d] = a * cos[d] - b * sin[d];
        head[d + half] = b * cos[d] + a * sin[d];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity_and_rotation_preserves_norm() {
        let f = inv_freq(1e7, 8);
        let (mut c, mut s) = ([0f32; 4], [0f32; 4]);
        let orig: Vec<f32> = (0..16).map(|i| i as f32 - 7.5).collect();
        let mut h = orig.clone();
        cos_sin(0, &f, &mut c, &mut s);
        apply_rope(&mut h, &c, &s);
        assert_eq!(h, orig);
        cos_sin(1234, &f, &mut c, &mut s);
        apply_rope(&mut h, &c, &s);
        let n0: f32 = orig[..8].iter().map(|v| v * v).sum();
        let n1: f32 = h[..8].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-3);
        assert_eq!(h[8..], orig[8..], "channels past rotary_dim pass through");
        assert_ne!(h[..8], orig[..8]);
    }
}
