//! Synthetic Qwen3.5 models: the published shapes (docs/qwen35.md §1.2) with deterministic
//! random weights, so that benchmarks and tests run without downloading a checkpoint.
//! Weights are bf16 like the published checkpoints (A_log and the gated-norm weight in f32,
//! as published), scaled so that activations stay finite through every layer.

use std::sync::Arc;

use anyhow::{bail, Result};

use crate::model::checkpoint::TensorSet;
use crate::model::config::{LayerType, Qwen35Config};
use crate::rng::{hash_str, Rng};
use crate::model::tensor::{f32_to_bf16, zeroed_in_huge_pages, DType, HeapStorage, Storage, Tensor};

/// The names accepted after `synthetic:`.
/// `tiny` is no published shape: the real vocabulary and layer pattern at small widths, for
/// tests and smoke runs of the server.
pub const NAMES: [&str; 4] = ["qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-9b", "tiny"];

/// Seed of every synthetic model: fixed, so runs on different machines compare.
const SEED: u64 = 0x7A9D_E35;

/// How a tensor's values are drawn: uniform around `center` with standard deviation `std`.
struct Init {
    center: f32,
    std: f32,
    dtype: DType,
}

pub fn config(name: &str) -> Result<Qwen35Config> {
    match Qwen35Config::preset(name) {
        Some(c) => Ok(c),
        None => bail!("unknown synthetic model {name:?}; choose one of {}", NAMES.map(|n| format!("synthetic:{n}")).join(", ")),
    }
}

/// Generate every decoder tensor of the synthetic model `name`.
pub fn tensors(c: &Qwen35Config, name: &str) -> TensorSet {
    let h = c.hidden_size;
    let lin = |fan_in: usize| Init { center: 0.0, std: 1.0 / (fan_in as f32).sqrt(), dtype: DType::BF16 };
    let norm = || Init { center: 0.0, std: 0.05, dtype: DType::BF16 };
    let mut specs: Vec<(String, Vec<usize>, Init)> = vec![
        ("embed_tokens.weight".into(), vec![c.vocab_size, h], Init { center: 0.0, std: 0.02, dtype: DType::BF16 }),
        ("norm.weight".into(), vec![h], norm()),
    ];
    if !c.tie_word_embeddings {
        specs.push(("lm_head.weight".into(), vec![c.vocab_size, h], lin(h)));
    }
    for (i, lt) in c.layer_types.iter().enumerate() {
        let p = format!("layers.{i}.");
        specs.push((format!("{p}input_layernorm.weight"), vec![h], norm()));
        specs.push((format!("{p}post_attention_layernorm.weight"), vec![h], norm()));
        let f = c.intermediate_size;
        specs.push((format!("{p}mlp.gate_proj.weight"), vec![f, h], lin(h)));
        specs.push((format!("{p}mlp.up_proj.weight"), vec![f, h], lin(h)));
        specs.push((format!("{p}mlp.down_proj.weight"), vec![h, f], lin(f)));
        match lt {
            LayerType::LinearAttention => {
                let (hv, vd, cd, kk) = (c.linear_num_value_heads, c.linear_value_dim(), c.linear_conv_dim(), c.linear_conv_kernel_dim);
                let la = format!("{p}linear_attn.");
                specs.push((format!("{la}in_proj_qkv.weight"), vec![cd, h], lin(h)));
                specs.push((format!("{la}in_proj_z.weight"), vec![vd, h], lin(h)));
                specs.push((format!("{la}in_proj_b.weight"), vec![hv, h], lin(h)));
                specs.push((format!("{la}in_proj_a.weight"), vec![hv, h], lin(h)));
                specs.push((format!("{la}conv1d.weight"), vec![cd, 1, kk], lin(kk)));
                specs.push((format!("{la}dt_bias"), vec![hv], Init { center: 0.0, std: 0.5, dtype: DType::BF16 }));
                // A = exp(A_log) in about [1, 16], as HF initialises it.
                specs.push((format!("{la}A_log"), vec![hv], Init { center: 1.4, std: 0.8, dtype: DType::F32 }));
                specs.push((format!("{la}norm.weight"), vec![c.linear_value_head_dim], Init { center: 1.0, std: 0.05, dtype: DType::F32 }));
                specs.push((format!("{la}out_proj.weight"), vec![h, vd], lin(vd)));
            }
            LayerType::FullAttention => {
                let (hq, hkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
                let sa = format!("{p}self_attn.");
                specs.push((format!("{sa}q_proj.weight"), vec![2 * hq * d, h], lin(h)));
                specs.push((format!("{sa}k_proj.weight"), vec![hkv * d, h], lin(h)));
                specs.push((format!("{sa}v_proj.weight"), vec![hkv * d, h], lin(h)));
                specs.push((format!("{sa}o_proj.weight"), vec![h, hq * d], lin(hq * d)));
                specs.push((format!("{sa}q_norm.weight"), vec![d], norm()));
                specs.push((format!("{sa}k_norm.weight"), vec![d], norm()));
            }
        }
    }
    let lazy = specs
        .into_iter()
        .map(|(tname, shape, init)| {
            let (n, s) = (tname.clone(), shape.clone());
            let make: Box<dyn Fn() -> Tensor + Send + Sync> = Box::new(move || {
                let numel: usize = s.iter().product();
                let storage = generate(numel, &init, SEED ^ hash_str(&n));
                Tensor { name: n.clone(), dtype: init.dtype, shape: s.clone(), storage, offset: 0 }
            });
            (tname, shape, make)
        })
        .collect();
    TensorSet::lazy(lazy, format!("synthetic:{name}"))
}

/// Values in blocks of `BLOCK`, each block from its own stream, filled in parallel.
fn generate(numel: usize, init: &Init, seed: u64) -> Arc<dyn Storage> {
    const BLOCK: usize = 1 << 16;
    let half_width = init.std * 3f32.sqrt();
    let fill = |block: usize, out: &mut [f32]| {
        let mut rng = Rng::new(seed.wrapping_add(block as u64).wrapping_mul(0x2545_F491_4F6C_DD1D));
        for v in out.iter_mut() {
            *v = init.center + half_width * rng.next_signed_f32();
        }
    };
    match init.dtype {
        DType::F32 => {
            let mut v = zeroed_in_huge_pages::<f32>(numel);
            for (b, chunk) in v.chunks_mut(BLOCK).enumerate() {
                fill(b, chunk);
            }
            Arc::new(HeapStorage(v))
        }
        _ => {
            let mut v = zeroed_in_huge_pages::<u16>(numel);
            let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
            let per_thread = numel.div_ceil(threads).div_ceil(BLOCK) * BLOCK;
            std::thread::scope(|s| {
                for (ti, part) in v.chunks_mut(per_thread.max(BLOCK)).enumerate() {
                    s.spawn(move || {
                        let mut tmp = vec![0f32; BLOCK];
                        for (bi, chunk) in part.chunks_mut(BLOCK).enumerate() {
                            let block = ti * (per_thread.max(BLOCK) / BLOCK) + bi;
                            fill(block, &mut tmp[..chunk.len()]);
                            for (d, &x) in chunk.iter_mut().zip(&tmp) {
                                *d = f32_to_bf16(x);
                            }
                        }
                    });
                }
            });
            Arc::new(HeapStorage(v))
        }
    }
}
