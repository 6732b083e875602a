//! The gated delta rule of one value head (qwen35-spec.md §2.4.1-2.4.2), in f32.
//!
//! State `S` is `[Dk, Dv]` row-major (row = key channel). Inputs per token: `q`, `k` (already
//! l2-normalised, q scaled by 1/√Dk), `v`, the write strength `beta` and the log-decay `g ≤ 0`.
//! `recurrent_step` is the per-token definition (decode); `chunked` is the WY/UT-transform form
//! used for multi-token prefill; the test below holds them to each other.

use super::matmul::dot;

/// Chunk length of the chunked algorithm (the reference's, so rounding follows the same grouping).
pub const CHUNK: usize = 64;

/// One decode step: decay, delta-rule write, read.
pub fn recurrent_step(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], beta: f32, g: f32, out: &mut [f32]) {
    let (dk, dv) = (k.len(), v.len());
    debug_assert_eq!(s.len(), dk * dv);
    let alpha = g.exp();
    // Pass 1: S ← α S, and kv_mem = Sᵀ k on the decayed state.
    let mut kv_mem = [0f32; 512];
    let kv_mem = &mut kv_mem[..dv];
    for i in 0..dk {
        let row = &mut s[i * dv..(i + 1) * dv];
        let ki = k[i];
        for (sv, m) in row.iter_mut().zip(kv_mem.iter_mut()) {
            *sv *= alpha;
            *m += *sv * ki;
        }
    }
    // u = β (v − Sᵀk)
    for (m, &vv) in kv_mem.iter_mut().zip(v) {
        *m = beta * (vv - *m);
    }
    // Pass 2: S ← S + k ⊗ u, and out = Sᵀ q on the updated state.
    out.iter_mut().for_each(|o| *o = 0.0);
    for i in 0..dk {
        let row = &mut s[i * dv..(i + 1) * dv];
        let (ki, qi) = (k[i], q[i]);
        for ((sv, &u), o) in row.iter_mut().zip(kv_mem.iter()).zip(out.iter_mut()) {
            *sv += ki * u;
            *o += *sv * qi;
        }
    }
}

/// Scratch buffers of `chunked`, reused across heads and calls.
#[derive(Default)]
pub struct ChunkScratch {
    g_cum: Vec<f32>,
    a: Vec<f32>,
    u: Vec<f32>,
    w: Vec<f32>,
    kb: Vec<f32>,
}

/// Process `L = beta.len()` tokens of one head. `q`, `k`: `[L, Dk]`; `v`, `out`: `[L, Dv]`.
pub fn chunked(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], beta: &[f32], g: &[f32], out: &mut [f32], scratch: &mut ChunkScratch) {
    let l = beta.len();
    let dk = k.len() / l.max(1);
    let dv = v.len() / l.max(1);
    debug_assert_eq!(s.len(), dk * dv);
    let sc = scratch;
    sc.g_cum.resize(CHUNK, 0.0);
    sc.a.resize(CHUNK * CHUNK, 0.0);
    sc.u.resize(CHUNK * dv, 0.0);
    sc.w.resize(CHUNK * dk, 0.0);
    sc.kb.resize(CHUNK * dk, 0.0);

    let mut c0 = 0;
    while c0 < l {
        // The reference pads the last chunk with zeros (β = 0, g = 0, k = 0): those rows change
        // neither the state nor the real rows, so working on the real rows alone is identical.
        let n = (l - c0).min(CHUNK);
        let (qc, kc, vc) = (&q[c0 * dk..(c0 + n) * dk], &k[c0 * dk..(c0 + n) * dk], &v[c0 * dv..(c0 + n) * dv]);
        let (bc, gc) = (&beta[c0..c0 + n], &g[c0..c0 + n]);
        let oc = &mut out[c0 * dv..(c0 + n) * dv];

        let gcum = &mut sc.g_cum[..n];
        let mut acc = 0f32;
        for (gi, &x) in gcum.iter_mut().zip(gc) {
            acc += x;
            *gi = acc;
        }
        for i in 0..n {
            for d in 0..dk {
                sc.kb[i * dk + d] = bc[i] * kc[i * dk + d];
            }
        }
        // A_ij = (kβ_i · k_j) exp(G_i − G_j) for j < i.
        for i in 0..n {
            for j in 0..i {
                sc.a[i * CHUNK + j] = dot(&sc.kb[i * dk..(i + 1) * dk], &kc[j * dk..(j + 1) * dk]) * (gcum[i] - gcum[j]).exp();
            }
        }
        // (I + A) U = β v  and  (I + A) W = kβ exp(G), by forward substitution.
        for i in 0..n {
            let eg = gcum[i].exp();
            for d in 0..dv {
                sc.u[i * dv + d] = bc[i] * vc[i * dv + d];
            }
            for d in 0..dk {
                sc.w[i * dk + d] = sc.kb[i * dk + d] * eg;
            }
            for j in 0..i {
                let aij = sc.a[i * CHUNK + j];
                let (u_done, u_rest) = sc.u.split_at_mut(i * dv);
                axpy(-aij, &u_done[j * dv..(j + 1) * dv], &mut u_rest[..dv]);
                let (w_done, w_rest) = sc.w.split_at_mut(i * dk);
                axpy(-aij, &w_done[j * dk..(j + 1) * dk], &mut w_rest[..dk]);
            }
        }
        // V' = U − W S  (stored back into U).
        for i in 0..n {
            for d in 0..dk {
                let wid = sc.w[i * dk + d];
                axpy(-wid, &s[d * dv..(d + 1) * dv], &mut sc.u[i * dv..(i + 1) * dv]);
            }
        }
        // O_i = exp(G_i) q_i S + Σ_{j≤i} (q_i · k_j) exp(G_i − G_j) V'_j
        for i in 0..n {
            let o = &mut oc[i * dv..(i + 1) * dv];
            o.iter_mut().for_each(|x| *x = 0.0);
            let eg = gcum[i].exp();
            for d in 0..dk {
                axpy(qc[i * dk + d] * eg, &s[d * dv..(d + 1) * dv], o);
            }
            for j in 0..=i {
                let p = dot(&qc[i * dk..(i + 1) * dk], &kc[j * dk..(j + 1) * dk]) * (gcum[i] - gcum[j]).exp();
                axpy(p, &sc.u[j * dv..(j + 1) * dv], o);
            }
        }
        // S ← exp(G_last) S + Σ_i (k_i exp(G_last − G_i)) ⊗ V'_i
        let g_last = gcum[n - 1];
        let e_last = g_last.exp();
        s.iter_mut().for_each(|x| *x *= e_last);
        for i in 0..n {
            let e = (g_last - gcum[i]).exp();
            for d in 0..dk {
                axpy(kc[i * dk + d] * e, &sc.u[i * dv..(i + 1) * dv], &mut s[d * dv..(d + 1) * dv]);
            }
        }
        c0 += n;
    }
}

#[inline(always)]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yv, &xv) in y.iter_mut().zip(x) {
        *yv = a.mul_add(xv, *yv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand_vec(seed: &mut u64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn normalize_rows(x: &mut [f32], d: usize, scale: f32) {
        for r in x.chunks_exact_mut(d) {
            crate::kernels::norm::l2_normalize(r);
            r.iter_mut().for_each(|v| *v *= scale);
        }
    }

    /// Chunked and recurrent forms agree, across chunk boundaries and from a non-zero state.
    #[test]
    fn chunked_equals_recurrent() {
        let mut seed = 42;
        let (dk, dv) = (32, 16);
        for &l in &[1usize, 5, 64, 65, 150] {
            let mut q = rand_vec(&mut seed, l * dk);
            let mut k = rand_vec(&mut seed, l * dk);
            normalize_rows(&mut q, dk, 1.0 / (dk as f32).sqrt());
            normalize_rows(&mut k, dk, 1.0);
            let v = rand_vec(&mut seed, l * dv);
            let beta: Vec<f32> = rand_vec(&mut seed, l).iter().map(|x| 0.5 + 0.5 * x).collect();
            let g: Vec<f32> = rand_vec(&mut seed, l).iter().map(|x| -0.3 * (1.0 + x)).collect();
            let s0 = rand_vec(&mut seed, dk * dv);

            let mut s_rec = s0.clone();
            let mut o_rec = vec![0f32; l * dv];
            for t in 0..l {
                recurrent_step(
                    &mut s_rec,
                    &q[t * dk..(t + 1) * dk],
                    &k[t * dk..(t + 1) * dk],
                    &v[t * dv..(t + 1) * dv],
                    beta[t],
                    g[t],
                    &mut o_rec[t * dv..(t + 1) * dv],
                );
            }
            let mut s_chk = s0.clone();
            let mut o_chk = vec![0f32; l * dv];
            chunked(&mut s_chk, &q, &k, &v, &beta, &g, &mut o_chk, &mut ChunkScratch::default());
            let err_o = o_rec.iter().zip(&o_chk).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let err_s = s_rec.iter().zip(&s_chk).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err_o < 1e-4 && err_s < 1e-4, "L={l}: out err {err_o}, state err {err_s}");
        }
    }
}
