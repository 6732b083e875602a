//! Causal softmax attention with grouped KV heads (docs/qwen35.md §2.5 steps 5-6), over a KV
//! cache laid out `[position, kv_head, head_dim]` so that appending a token is one copy.

use super::matmul::dot;

/// Keys per block: one KV head's K and V rows of a block (128 x 256 f32 x 2 = 256 KB for
/// Qwen3.5) stay in L2 while every query of a query block reads them.
const KEY_BLOCK: usize = 128;
/// Queries that share each pass over the keys: the cache is read once per query block instead
/// of once per query (with one query at a time, 28 new tokens after a 7,000-token history read
/// 19 GB of K/V for the 0.8B model; in blocks of 32, 0.6 GB).
const QUERY_BLOCK: usize = 32;

super::multiversion! {
    /// One query head `h` of causal attention. `q`: `[t, hq, d]` for the `t` new tokens at
    /// positions `pos0..pos0 + t`; `k`, `v`: the whole cache `[pos0 + t, hkv, d]` (new tokens
    /// already appended); writes `out[ti * hq * d + h * d ..][..d]` through `out`.
    /// Query head `h` reads KV head `h / (hq / hkv)`; the scale is `1/√d`.
    ///
    /// Tiled with an online softmax (the running maximum and sum of each query, rescaled as
    /// each key block arrives). Key blocks are aligned to absolute positions and each query's
    /// sums run over them in order, so a query's output does not depend on which other queries
    /// share its call: any split of a prompt into dispatches, and decode, give the same bits.
    pub fn attention_head(q: &[f32], t: usize, pos0: usize, k: &[f32], v: &[f32], hq: usize, hkv: usize, d: usize, h: usize, scores: &mut Vec<f32>, out: &mut [f32]) => attention_head_body
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attention_head_body(q: &[f32], t: usize, pos0: usize, k: &[f32], v: &[f32], hq: usize, hkv: usize, d: usize, h: usize, scores: &mut Vec<f32>, out: &mut [f32]) {
    let kvh = h / (hq / hkv);
    let scale = 1.0 / (d as f32).sqrt();
    let row = |p: usize| (p * hkv + kvh) * d..(p * hkv + kvh + 1) * d;
    scores.resize(KEY_BLOCK, 0.0);
    for qb in (0..t).step_by(QUERY_BLOCK) {
        let qe = (qb + QUERY_BLOCK).min(t);
        let mut max = [f32::NEG_INFINITY; QUERY_BLOCK];
        let mut sum = [0f32; QUERY_BLOCK];
        for ti in qb..qe {
            out[ti * hq * d + h * d..][..d].iter_mut().for_each(|x| *x = 0.0);
        }
        // The block's last query sees keys up to its own position.
        for kb in (0..pos0 + qe).step_by(KEY_BLOCK) {
            for ti in qb..qe {
                let visible = pos0 + ti + 1;
                if kb >= visible {
                    continue;
                }
                let ke = (kb + KEY_BLOCK).min(visible);
                let qh = &q[(ti * hq + h) * d..(ti * hq + h + 1) * d];
                let s = &mut scores[..ke - kb];
                let mut block_max = f32::NEG_INFINITY;
                for (p, sc) in (kb..ke).zip(s.iter_mut()) {
                    *sc = dot(qh, &k[row(p)]) * scale;
                    block_max = block_max.max(*sc);
                }
                let i = ti - qb;
                let new_max = max[i].max(block_max);
                // exp(-inf) = 0 for the first block: nothing accumulated yet.
                let rescale = (max[i] - new_max).exp();
                let o = &mut out[ti * hq * d + h * d..][..d];
                o.iter_mut().for_each(|x| *x *= rescale);
                sum[i] *= rescale;
                for (p, &sc) in (kb..ke).zip(s.iter()) {
                    let w = (sc - new_max).exp();
                    sum[i] += w;
                    for (ov, &vv) in o.iter_mut().zip(&v[row(p)]) {
                        *ov = w.mul_add(vv, *ov);
                    }
                }
                max[i] = new_max;
            }
        }
        for ti in qb..qe {
            let inv = 1.0 / sum[ti - qb];
            out[ti * hq * d + h * d..][..d].iter_mut().for_each(|x| *x *= inv);
        }
    }
}

/// The plain form the tiled kernel is tested against: for each query, every visible score,
/// their softmax, the weighted sum of values.
#[allow(clippy::too_many_arguments)]
pub fn attention_head_reference(q: &[f32], t: usize, pos0: usize, k: &[f32], v: &[f32], hq: usize, hkv: usize, d: usize, h: usize, out: &mut [f32]) {
    let kvh = h / (hq / hkv);
    let scale = 1.0 / (d as f32).sqrt();
    for ti in 0..t {
        let visible = pos0 + ti + 1;
        let qh = &q[(ti * hq + h) * d..(ti * hq + h + 1) * d];
        let scores: Vec<f64> = (0..visible).map(|p| qh.iter().zip(&k[(p * hkv + kvh) * d..][..d]).map(|(a, b)| (a * b) as f64).sum::<f64>() * scale as f64).collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        for j in 0..d {
            let o: f64 = weights.iter().enumerate().map(|(p, w)| w * v[(p * hkv + kvh) * d + j] as f64).sum();
            out[ti * hq * d + h * d + j] = (o / total) as f32;
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

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut r = crate::rng::Rng::new(seed);
        (0..n).map(|_| (r.next_f64() * 2.0 - 1.0) as f32 * 2.0).collect()
    }

    /// Queries past several key blocks, in a call that spans query blocks.
    #[test]
    fn tiled_attention_matches_the_plain_form() {
        let (hq, hkv, d, pos0, t) = (4, 2, 64, 300, 70);
        let (q, k, v) = (random(t * hq * d, 1), random((pos0 + t) * hkv * d, 2), random((pos0 + t) * hkv * d, 3));
        let (mut got, mut want) = (vec![0f32; t * hq * d], vec![0f32; t * hq * d]);
        causal_attention(&q, t, pos0, &k, &v, hq, hkv, d, &mut got);
        for h in 0..hq {
            attention_head_reference(&q, t, pos0, &k, &v, hq, hkv, d, h, &mut want);
        }
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 2e-6, "largest difference {worst}");
    }

    /// A prompt prefilled whole, in two dispatches, or token by token (decode) gives each
    /// query the same bits.
    #[test]
    fn a_query_gets_the_same_bits_however_the_prompt_is_split() {
        let (hq, hkv, d, n) = (2, 1, 32, 200);
        let (q, k, v) = (random(n * hq * d, 4), random(n * hkv * d, 5), random(n * hkv * d, 6));
        let mut whole = vec![0f32; n * hq * d];
        causal_attention(&q, n, 0, &k[..n * hkv * d], &v[..n * hkv * d], hq, hkv, d, &mut whole);
        for split in [1, 37, 130] {
            let mut parts = vec![0f32; n * hq * d];
            let mut pos = 0;
            while pos < n {
                let t = split.min(n - pos);
                let end = (pos + t) * hkv * d;
                causal_attention(&q[pos * hq * d..(pos + t) * hq * d], t, pos, &k[..end], &v[..end], hq, hkv, d, &mut parts[pos * hq * d..(pos + t) * hq * d]);
                pos += t;
            }
            assert!(parts == whole, "dispatches of {split} tokens differ from the whole prompt");
        }
    }
}
