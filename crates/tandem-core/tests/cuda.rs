//! The CUDA engine's kernels against the CPU engine (their reference) on the golden fixture's
//! longest prompt, 300 tokens: five chunks of the chunked delta rule and five query tiles of
//! the prefill attention. Whole, and split into dispatches of 1, 7, 64, 100 and 128 tokens (the
//! one-launch DeltaNet step and the untiled attention for the short ones, the chunked rule from
//! a state that is not empty, attention tiles that start past position 0); then greedy decode
//! steps through the CUDA graph. Runs where a GPU is present and says SKIPPED otherwise.

mod common;

use tandem_core::cuda::qwen35::{GpuQwen35, Precision};
use tandem_core::cuda::Gpu;
use tandem_core::load::LoadedModel;
use tandem_core::model::Logits;
use tandem_core::pool::Pool;
use tandem_core::sampling::argmax;
use tandem_core::state::{LayerState, State};
use tandem_core::verify::{LOGIT_TOL, STATE_REL_TOL};

fn prompt(name: &str) -> Vec<u32> {
    let bytes = std::fs::read(common::tiny_dir().join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensor(&format!("{name}.input_ids")).unwrap().data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The largest difference of any state array, relative to the largest value of that array.
fn state_error(got: &State, want: &State) -> f32 {
    assert_eq!(got.position, want.position);
    let rel = |a: &[f32], b: &[f32]| max_abs_diff(a, b) / b.iter().map(|x| x.abs()).fold(1e-6, f32::max);
    got.layers
        .iter()
        .zip(&want.layers)
        .map(|pair| match pair {
            (LayerState::Linear { conv: c1, recurrent: r1 }, LayerState::Linear { conv: c2, recurrent: r2 }) => rel(c1, c2).max(rel(r1, r2)),
            (LayerState::Full { k: k1, v: v1 }, LayerState::Full { k: k2, v: v2 }) => rel(k1, k2).max(rel(v1, v2)),
            _ => panic!("layer kinds differ"),
        })
        .fold(0.0, f32::max)
}

#[test]
fn gpu_prefill_and_decode_match_the_cpu_engine() {
    match tandem_core::cuda::gpu_count() {
        Ok(n) if n > 0 => {}
        Ok(_) => return eprintln!("SKIPPED: the CUDA kernels against the CPU engine: the driver reports no GPU"),
        Err(why) => return eprintln!("SKIPPED: the CUDA kernels against the CPU engine: {why:#}"),
    }
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let tokens = prompt("p4");
    assert_eq!(tokens.len(), 300);
    let pool = Pool::new(1);
    let mut cpu = State::new(&m.net.config);
    let want = m.net.forward(&pool, &tokens, &mut cpu, Logits::All).unwrap();
    let gpu = GpuQwen35::upload(Gpu::open(0).unwrap(), &m.net, Precision::Exact).unwrap();
    for splits in [vec![300], vec![1, 7, 64, 100, 128]] {
        let mut on_gpu = gpu.new_state().unwrap();
        let mut got = Vec::new();
        let mut at = 0;
        for n in &splits {
            got.extend(gpu.forward(&tokens[at..at + n], &mut on_gpu, Logits::All).unwrap());
            at += n;
        }
        let err = max_abs_diff(&got, &want);
        assert!(err <= LOGIT_TOL, "dispatches {splits:?}: logits differ by up to {err:.2e}");
        let err = state_error(&gpu.download_state(&on_gpu).unwrap(), &cpu);
        assert!(err <= STATE_REL_TOL, "dispatches {splits:?}: states differ by up to {err:.2e} (relative)");
        // Greedy decode from both, the GPU's steps replayed from its graph.
        let mut cpu_dec = cpu.clone();
        for step in 0..8 {
            let id = argmax(&cpu_dec.last_logits);
            assert_eq!(argmax(&on_gpu.last_logits), id, "dispatches {splits:?}: decode step {step} picks another token");
            let g = gpu.forward(&[id], &mut on_gpu, Logits::Last).unwrap();
            let c = m.net.forward(&pool, &[id], &mut cpu_dec, Logits::Last).unwrap();
            let err = max_abs_diff(&g, &c);
            assert!(err <= LOGIT_TOL, "dispatches {splits:?}: decode step {step}: logits differ by up to {err:.2e}");
        }
        let err = state_error(&gpu.download_state(&on_gpu).unwrap(), &cpu_dec);
        assert!(err <= STATE_REL_TOL, "dispatches {splits:?}: states after decode differ by up to {err:.2e} (relative)");
    }
}
