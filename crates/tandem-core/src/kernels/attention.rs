//! Causal softmax attention with grouped KV heads (qwen35-spec.md §2.5 steps 5-6), over a KV
//! cache laid out `[position, kv_head, head_dim]` so that appending a token is one copy.

use super::matmul::dot;

super::multiversion! {
    /// One query head `h` of causal attention. `q`: `[t, hq, d]` for the `t` new tokens at
    /// positions `pos0..pos0 + t`; `k`, `v`: the whole cache `[pos0 + t, hkv, d]` (new tokens
    /// already appended); writes `out[ti * hq * d + h * d ..][..d]` through `out`.
    /// Query head `h` reads KV head `h / (hq / hkv)`; the scale is `1/√d`.
    pub fn attention_head(q: &[f32], t: usize, pos0: usize, k: &[f32], v: &[f32], hq: usize, hkv: usize, d: usize, h: usize, scores: &mut Vec<f32>, out: &mut [f32]) => attention_head_body
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attention_head_body(q: &[f32], t: usize, pos0: usize, k: &[f32], v: &[f32], hq: usize, hkv: usize, d: usize, h: usize, scores: &mut Vec<f32>, out: &mut [f32]) {
    let kvh = h / (hq / hkv);
    let scale = 1.0 / (d as f32).sqrt();
    scores.resize(pos0 + t, 0.0);
    for ti in 0..t {
        let visible = pos0 + ti + 1;
        let qh = &q[(ti * hq + h) * d..(ti * hq + h + 1) * d];
        let mut max = f32::NEG_INFINITY;
        for (p, s) in scores[..visible].iter_mut().enumerate() {
            *s = dot(qh, &k[(p * hkv + kvh) * d..(p * hkv + kvh + 1) * d]) * scale;
            max = max.max(*s);
        }
        let mut sum = 0f32;
        for s in scores[..visible].iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        let o = &mut out[ti * hq * d + h * d..ti * hq * d + (h + 1) * d];
        o.iter_mut().for_each(|x| *x = 0.0);
        for (p, &s) in scores[..visible].iter().enumerate() {
            let w = s * inv;
            for (ov, &vv) in o.iter_mut().zip(&v[(p * hkv + kvh) * d..(p * hkv + kvh + 1) * d]) {
                *ov = w.mul_add(vv, *ov);
            }
        }
    }
}

/// All heads, one after the other (tests and callers without a pool).
#[allow(clippy::too_many_arguments)]
pub fn causal_attention(q: &[f32], t: usize, pos0: usize, k: &[f32], v: &[f32], hq: usize, hkv: usize, d: usize, out: &mut [f32]) {
    let mut scores = Vec::new();
    for h in 0..hq {
        attention_head(q, t, pos0, k, v, hq, hkv, d, h, &mut scores, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_position_returns_its_value_and_gqa_groups_heads() {
        // One cached position: softmax over one score is 1, so the output is that value row.
        let (hq, hkv, d) = (4, 2, 3);
        let q: Vec<f32> = (0..hq * d).map(|i| i as f32).collect();
        let k = vec![0.5f32; hkv * d];
        let v: Vec<f32> = vec![1.0, 2.0, 3.0, -1.0, -2.0, -3.0];
        let mut out = vec![0f32; hq * d];
        causal_attention(&q, 1, 0, &k, &v, hq, hkv, d, &mut out);
        assert_eq!(&out[..6], &[1.0, 2.0, 3.0, 1.0, 2.0, 3.0], "heads 0,1 read kv head 0");
        assert_eq!(&out[6..], &[-1.0, -2.0, -3.0, -1.0, -2.0, -3.0], "heads 2,3 read kv head 1");
    }

    #[test]
    fn later_tokens_are_masked() {
        // Two new tokens; the first must not see the second's value.
        let (hq, hkv, d) = (1, 1, 2);
        let q = vec![1.0f32, 0.0, 1.0, 0.0];
        let k = vec![1.0f32, 0.0, 1.0, 0.0];
        let v = vec![10.0f32, 0.0, 20.0, 0.0];
        let mut out = vec![0f32; 4];
        causal_attention(&q, 2, 0, &k, &v, hq, hkv, d, &mut out);
        assert_eq!(out[0], 10.0);
        assert!((out[2] - 15.0).abs() < 1e-5, "equal scores average the two values");
    }
}
