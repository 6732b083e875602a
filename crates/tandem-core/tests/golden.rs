//! The engine against the reference implementation's golden outputs (fixtures/qwen35-tiny).

mod common;

use std::collections::HashMap;

use tandem_core::model::load::LoadedModel;
use tandem_core::model::Logits;
use tandem_core::state::State;
use tandem_core::verify::verify;

/// The whole model against the golden fixture, with the kernels of every instruction set this
/// CPU has (AVX-512, AVX2+FMA, portable).
#[test]
fn tiny_checkpoint_matches_the_reference_on_every_isa() {
    let mut m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    tandem_core::backend::cpu::kernels::for_each_isa(|isa| {
        let checks = verify(&tandem_core::backend::cpu::pool::Pool::new(2), &mut m.net, &common::tiny_dir().join("reference.safetensors")).unwrap();
        // 5 prompts x (prefill logits, greedy ids, greedy logits, 6 GDN layers x 2, 2 attention layers x 2)
        assert_eq!(checks.len(), 5 * (3 + 12 + 4));
        let failed: Vec<_> = checks.iter().filter(|c| !c.passed()).collect();
        assert!(failed.is_empty(), "{isa:?}: out of tolerance: {failed:#?}");
        for c in checks.iter().filter(|c| c.item.contains("greedy ids")) {
            assert_eq!(c.detail, "16/16 identical", "{isa:?}: {}", c.item);
        }
    });
}

/// A reference written by scripts/make_reference.py (transformers 5.17, f32, on the GPU
/// machine's CPU): states copied right after the prompt, exact f32 RoPE frequencies.
#[test]
fn tiny_checkpoint_matches_a_fresh_transformers_reference() {
    let mut m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let checks = verify(&tandem_core::backend::cpu::pool::Pool::new(2), &mut m.net, &common::tiny_dir().join("reference-transformers-5.17-f32.safetensors")).unwrap();
    assert_eq!(checks.len(), 95);
    let failed: Vec<_> = checks.iter().filter(|c| !c.passed()).collect();
    assert!(failed.is_empty(), "out of tolerance: {failed:#?}");
}

/// The check is able to fail: claiming the reference used exact f32 RoPE frequencies (it used
/// bf16-rounded ones) must push the long prompts' keys out of tolerance.
#[test]
fn verify_detects_a_wrong_rope_convention() {
    let src = common::tiny_dir().join("reference.safetensors");
    let bytes = std::fs::read(&src).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView)> = st.tensors();
    let meta = HashMap::from([("rope_inv_freq".to_string(), "f32".to_string())]);
    let out = common::scratch("rope").join("reference.safetensors");
    safetensors::serialize_to_file(views, Some(meta), &out).unwrap();

    let mut m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let checks = verify(&tandem_core::backend::cpu::pool::Pool::new(2), &mut m.net, &out).unwrap();
    let bad: Vec<_> = checks.iter().filter(|c| !c.passed()).map(|c| c.item.as_str()).collect();
    assert!(bad.iter().any(|i| i.starts_with("p4 layer 3 keys")), "{bad:?}");
    assert!(checks.iter().find(|c| c.item.starts_with("p0 prefill")).unwrap().passed(), "a 1-token prompt has no rotation");
}

/// Prefill in pieces (any split, across the 64-token chunk boundary) then decode gives the
/// logits and state of one pass over everything: the continuation rule of spec §3.
#[test]
fn split_prefill_equals_one_pass() {
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let tokens: Vec<u32> = (0..150).map(|i| (i * 37 + 11) % 1024).collect();
    let mut one = State::new(&m.net.config);
    let all = m.net.forward(&tandem_core::backend::cpu::pool::Pool::new(2), &tokens, &mut one, Logits::All).unwrap();
    let v = m.net.config.vocab_size;
    for splits in [&[1usize, 149][..], &[63, 2, 85], &[64, 64, 22], &[3, 1, 1, 1, 144]] {
        let mut st = State::new(&m.net.config);
        let mut pos = 0;
        for &n in splits {
            let logits = m.net.forward(&tandem_core::backend::cpu::pool::Pool::new(2), &tokens[pos..pos + n], &mut st, Logits::All).unwrap();
            let want = &all[pos * v..(pos + n) * v];
            let err = logits.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < 2e-4, "split {splits:?} at {pos}: logits differ by {err}");
            pos += n;
        }
        assert_eq!(st.position, one.position);
        for (a, b) in st.layers.iter().zip(&one.layers) {
            let (x, y) = match (a, b) {
                (tandem_core::state::LayerState::Linear { recurrent: x, .. }, tandem_core::state::LayerState::Linear { recurrent: y, .. }) => (&x[..], &y[..]),
                (tandem_core::state::LayerState::Full { k: x, .. }, tandem_core::state::LayerState::Full { k: y, .. }) => (&x[..], &y[..]),
                _ => panic!("layer kinds differ"),
            };
            let err = x.iter().zip(y).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < 1e-4, "split {splits:?}: state differs by {err}");
        }
    }
}
