//! Causal softmax attention with grouped KV heads (docs/qwen35.md §2.5 steps 5-6), over a KV
//! cache laid out `[position, kv_head, head_dim]` so that appending a token is one copy.

use super::matmul::dot;
use super::norm::exp_fast;

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
    scores.resize(QUERY_BLOCK * KEY_BLOCK, 0.0);
    for qb in (0..t).step_by(QUERY_BLOCK) {
        let qe = (qb + QUERY_BLOCK).min(t);
        let mut max = [f32::NEG_INFINITY; QUERY_BLOCK];
        let mut sum = [0f32; QUERY_BLOCK];
        let mut rescale = [0f32; QUERY_BLOCK];
        let mut keys = [0usize; QUERY_BLOCK];
        for ti in qb..qe {
            out[ti * hq * d + h * d..][..d].iter_mut().for_each(|x| *x = 0.0);
        }
        // The block's last query sees keys up to its own position.
        for kb in (0..pos0 + qe).step_by(KEY_BLOCK) {
            // Each query's weights of the block's keys it sees (0 keys: none yet), and its
            // running maximum and sum.
            for ti in qb..qe {
                let i = ti - qb;
                keys[i] = (pos0 + ti + 1).min(kb + KEY_BLOCK).saturating_sub(kb);
                if keys[i] == 0 {
                    continue;
                }
                let qh = &q[(ti * hq + h) * d..(ti * hq + h + 1) * d];
                let s = &mut scores[i * KEY_BLOCK..i * KEY_BLOCK + keys[i]];
                let mut done = 0;
                #[cfg(target_arch = "x86_64")]
                if d.is_multiple_of(16) && crate::backend::cpu::kernels::isa() >= crate::backend::cpu::kernels::Isa::Avx512 {
                    // Four keys at a time: four independent chains of FMAs where one `dot`
                    // waits on its own (16 dependent FMAs for a row of 256).
                    while done + 4 <= s.len() {
                        let p = kb + done;
                        // SAFETY: feature checked; every row holds d values, a multiple of 16.
                        let four = unsafe { dot4_avx512(qh, [&k[row(p)], &k[row(p + 1)], &k[row(p + 2)], &k[row(p + 3)]]) };
                        for (sc, v) in s[done..done + 4].iter_mut().zip(four) {
                            *sc = v * scale;
                        }
                        done += 4;
                    }
                }
                for (p, sc) in (kb + done..).zip(s[done..].iter_mut()) {
                    *sc = dot(qh, &k[row(p)]) * scale;
                }
                let block_max = s.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let new_max = max[i].max(block_max);
                // exp(-inf) = 0 for the first block: nothing accumulated yet.
                rescale[i] = (max[i] - new_max).exp();
                sum[i] *= rescale[i];
                // The weights in a loop the compiler vectorises, then summed in key order.
                s.iter_mut().for_each(|sc| *sc = exp_fast(*sc - new_max));
                for &w in s.iter() {
                    sum[i] += w;
                }
                max[i] = new_max;
            }
            let (n, vs) = (qe - qb, hkv * d);
            let v_block = &v[row(kb).start..];
            let o = &mut out[qb * hq * d + h * d..];
            #[cfg(target_arch = "x86_64")]
            if d.is_multiple_of(64) && crate::backend::cpu::kernels::isa() >= crate::backend::cpu::kernels::Isa::Avx512 {
                // SAFETY: feature checked; query i's output row and the `keys[i]` value rows
                // lie inside `o` and `v_block` (rows `hq · d` and `hkv · d` apart).
                unsafe { weighted_values_avx512(scores, &keys[..n], &rescale, v_block, vs, o, hq * d, d) };
                continue;
            }
            weighted_values(scores, &keys[..n], &rescale, v_block, vs, o, hq * d, d);
        }
        for ti in qb..qe {
            let inv = 1.0 / sum[ti - qb];
            out[ti * hq * d + h * d..][..d].iter_mut().for_each(|x| *x *= inv);
        }
    }
}

/// `dot(a, b_i)` for four rows `b_i`, each with `dot`'s operations in `dot`'s order (sixteen
/// lanes of FMAs along the row, then the lanes added pairwise, 8 apart, 4, 2, 1), so the same
/// bits, the four chains interleaved.
///
/// # Safety
/// AVX-512F; `a.len()` a multiple of 16, no longer than each `b_i`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot4_avx512(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 4];
    for c in (0..a.len()).step_by(16) {
        let av = _mm512_loadu_ps(a.as_ptr().add(c));
        for (acc, b) in acc.iter_mut().zip(&b) {
            *acc = _mm512_fmadd_ps(av, _mm512_loadu_ps(b.as_ptr().add(c)), *acc);
        }
    }
    acc.map(|v| {
        let v8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))));
        let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
        let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
        // `dot` adds the sum of a tail past the last 16 (none here) last.
        _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps::<1>(v2, v2))) + 0.0
    })
}

/// For each query `i` of a query block: `o_i ← o_i · rescale_i + Σ_p w_ip · v_p` over its
/// `keys[i]` keys of the key block in order, one FMA per key (`w`: `[QUERY_BLOCK][KEY_BLOCK]`;
/// query i's output `o[i · o_stride..][..d]`, key p's value row `v[p · v_stride..][..d]`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn weighted_values(w: &[f32], keys: &[usize], rescale: &[f32], v: &[f32], v_stride: usize, o: &mut [f32], o_stride: usize, d: usize) {
    for (i, &n) in keys.iter().enumerate().filter(|&(_, &n)| n > 0) {
        let oi = &mut o[i * o_stride..i * o_stride + d];
        oi.iter_mut().for_each(|x| *x *= rescale[i]);
        for (p, &wp) in w[i * KEY_BLOCK..i * KEY_BLOCK + n].iter().enumerate() {
            for (ov, &vv) in oi.iter_mut().zip(&v[p * v_stride..p * v_stride + d]) {
                *ov = wp.mul_add(vv, *ov);
            }
        }
    }
}

/// `weighted_values` for four queries at a time, 64 channels of their outputs in registers
/// while the keys they all see go by (each value row read once for the four, and no output
/// loaded and stored per key): the same operations on each value in the same order, so the
/// same bits. The queries of a block see nondecreasing numbers of keys, so a group's first
/// sees the fewest; each then takes its further keys alone.
///
/// # Safety
/// AVX-512F; `d` a multiple of 64; the rows `weighted_values` reads and writes inside `v`
/// and `o`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn weighted_values_avx512(w: &[f32], keys: &[usize], rescale: &[f32], v: &[f32], v_stride: usize, o: &mut [f32], o_stride: usize, d: usize) {
    use std::arch::x86_64::*;
    const R: usize = 4;
    let first = keys.iter().position(|&n| n > 0).unwrap_or(keys.len());
    let whole = first + (keys.len() - first) / R * R;
    let (vp, op, wp) = (v.as_ptr(), o.as_mut_ptr(), w.as_ptr());
    for i0 in (first..whole).step_by(R) {
        for c in (0..d).step_by(64) {
            let at = |r: usize, j: usize| op.add((i0 + r) * o_stride + c + 16 * j);
            let mut acc: [[__m512; 4]; R] = std::array::from_fn(|r| std::array::from_fn(|j| _mm512_mul_ps(_mm512_loadu_ps(at(r, j)), _mm512_set1_ps(rescale[i0 + r]))));
            for p in 0..keys[i0] {
                let vv: [__m512; 4] = std::array::from_fn(|j| _mm512_loadu_ps(vp.add(p * v_stride + c + 16 * j)));
                for (r, a) in acc.iter_mut().enumerate() {
                    let wr = _mm512_set1_ps(*wp.add((i0 + r) * KEY_BLOCK + p));
                    for j in 0..4 {
                        a[j] = _mm512_fmadd_ps(wr, vv[j], a[j]);
                    }
                }
            }
            for (r, a) in acc.iter_mut().enumerate() {
                for p in keys[i0]..keys[i0 + r] {
                    let wr = _mm512_set1_ps(*wp.add((i0 + r) * KEY_BLOCK + p));
                    for (j, aj) in a.iter_mut().enumerate() {
                        *aj = _mm512_fmadd_ps(wr, _mm512_loadu_ps(vp.add(p * v_stride + c + 16 * j)), *aj);
                    }
                }
                for (j, &aj) in a.iter().enumerate() {
                    _mm512_storeu_ps(at(r, j), aj);
                }
            }
        }
    }
    // The last few queries of the block, one at a time.
    let rest = &keys[whole..];
    if !rest.is_empty() {
        weighted_values(&w[whole * KEY_BLOCK..], rest, &rescale[whole..], v, v_stride, &mut o[whole * o_stride..], o_stride, d);
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

    /// Every instruction set's build gives the portable build's bits (the AVX-512 one scores
    /// four keys and weighs four queries' values at a time), over several key blocks, with a
    /// partial group of queries at the end of a query block.
    #[test]
    fn every_isa_gives_the_portable_bits() {
        let (hq, hkv, d, pos0, t) = (4, 2, 128, 150, 45);
        let (q, k, v) = (random(t * hq * d, 7), random((pos0 + t) * hkv * d, 8), random((pos0 + t) * hkv * d, 9));
        let mut want = None;
        crate::backend::cpu::kernels::for_each_isa(|isa| {
            let mut got = vec![0f32; t * hq * d];
            causal_attention(&q, t, pos0, &k, &v, hq, hkv, d, &mut got);
            let bits: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
            match &want {
                None => want = Some(bits),
                Some(w) => assert!(&bits == w, "{isa:?} differs from the portable build"),
            }
        });
    }

    /// A prompt prefilled whole, in two dispatches, or token by token (decode) gives each
    /// query the same bits.
    #[test]
    fn a_query_gets_the_same_bits_however_the_prompt_is_split() {
        let (hq, hkv, d, n) = (2, 1, 64, 200);
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
