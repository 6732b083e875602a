//! Bad input gets a clear error naming the file, tensor or value; never a panic.

mod common;

use std::path::Path;

use tandem_core::model::load::LoadedModel;
use tandem_core::model::Logits;
use tandem_core::state::State;

fn copy_tiny(name: &str) -> std::path::PathBuf {
    let d = common::scratch(name);
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(common::tiny_dir().join(f), d.join(f)).unwrap();
    }
    d
}

fn load_err(dir: &Path) -> String {
    match LoadedModel::load(dir.to_str().unwrap()) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn missing_directory_and_files() {
    let e = match LoadedModel::load("/nonexistent/model") {
        Ok(_) => panic!("loaded"),
        Err(e) => format!("{e:#}"),
    };
    assert!(e.contains("/nonexistent/model") && e.contains("synthetic"), "{e}");

    let d = copy_tiny("no-weights");
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    let e = load_err(&d);
    assert!(e.contains("no model.safetensors"), "{e}");

    let d = copy_tiny("no-config");
    std::fs::remove_file(d.join("config.json")).unwrap();
    let e = load_err(&d);
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn truncated_safetensors_is_named() {
    let d = copy_tiny("truncated");
    let p = d.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(&d);
    assert!(e.contains("model.safetensors"), "{e}");
    assert!(e.contains("truncated") || e.contains("not a valid safetensors"), "{e}");
}

#[test]
fn wrong_model_type_and_wrong_shapes() {
    let d = copy_tiny("wrong-type");
    let cfg = std::fs::read_to_string(d.join("config.json")).unwrap();
    std::fs::write(d.join("config.json"), cfg.replace("\"model_type\": \"qwen3_5\"", "\"model_type\": \"llama\"").replace("qwen3_5_text", "llama")).unwrap();
    let e = load_err(&d);
    assert!(e.contains("llama") && e.contains("not Qwen3.5"), "{e}");

    let d = copy_tiny("wrong-shape");
    let cfg = std::fs::read_to_string(d.join("config.json")).unwrap();
    std::fs::write(d.join("config.json"), cfg.replace("\"intermediate_size\": 256", "\"intermediate_size\": 300")).unwrap();
    let e = load_err(&d);
    assert!(e.contains("mlp.gate_proj.weight") && e.contains("[256, 128]") && e.contains("[300, 128]"), "{e}");
}

#[test]
fn wrong_dtype_is_named() {
    // Rewrite one tensor as i32: the loader must name it.
    let d = copy_tiny("wrong-dtype");
    let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let name = "model.language_model.norm.weight";
    let mut tensors: Vec<(String, safetensors::tensor::TensorView)> = st.tensors().into_iter().filter(|(n, _)| n != name).collect();
    let ints = vec![0u8; 128 * 4];
    tensors.push((name.to_string(), safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![128], &ints).unwrap()));
    safetensors::serialize_to_file(tensors, None, &d.join("model.safetensors")).unwrap();
    let e = load_err(&d);
    assert!(e.contains(name) && e.contains("I32"), "{e}");
}

#[test]
fn unknown_token_and_context_overflow() {
    let d = copy_tiny("short-context");
    let cfg = std::fs::read_to_string(d.join("config.json")).unwrap();
    std::fs::write(d.join("config.json"), cfg.replace("\"max_position_embeddings\": 32768", "\"max_position_embeddings\": 8")).unwrap();
    let m = LoadedModel::load(d.to_str().unwrap()).unwrap();
    let mut st = State::new(&m.net.config);
    let e = m.net.forward(&tandem_core::backend::cpu::pool::Pool::new(2), &[1, 2, 5000], &mut st, Logits::Last).unwrap_err().to_string();
    assert!(e.contains("token id 5000") && e.contains("0..1024"), "{e}");
    assert_eq!(st.position, 0, "a rejected call leaves the state untouched");
    let e = m.net.forward(&tandem_core::backend::cpu::pool::Pool::new(2), &[1; 9], &mut st, Logits::Last).unwrap_err().to_string();
    assert!(e.contains("context of 8 tokens"), "{e}");
    assert_eq!(st.position, 0);
}

/// Rewrite the tiny checkpoint in `d` with `edit` applied to its tensors (by name).
fn rewrite_tensors(d: &Path, edit: impl Fn(&str, &[u8]) -> Option<Vec<u8>>) {
    let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st.tensors().into_iter().filter_map(|(n, t)| edit(&n, t.data()).map(|data| (n, t.dtype(), t.shape().to_vec(), data))).collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = kept.iter().map(|(n, dt, shape, data)| (n.clone(), safetensors::tensor::TensorView::new(*dt, shape.clone(), data).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &d.join("model.safetensors")).unwrap();
}

#[test]
fn a_missing_output_projection_is_named() {
    // The fixture's config does not tie the embeddings: without lm_head.weight it cannot run.
    let d = copy_tiny("no-lm-head");
    rewrite_tensors(&d, |n, data| (n != "lm_head.weight").then(|| data.to_vec()));
    let e = load_err(&d);
    assert!(e.contains("lm_head.weight") && e.contains("tie_word_embeddings"), "{e}");
}

#[test]
fn non_finite_weights_are_named() {
    // One NaN (bf16 0x7FC0) in a projection, then one infinity (0x7F80) in a norm.
    for (name, at, bits) in [("model.language_model.layers.1.mlp.up_proj.weight", 77, 0x7FC0u16), ("model.language_model.norm.weight", 5, 0x7F80)] {
        let d = copy_tiny("non-finite");
        rewrite_tensors(&d, |n, data| {
            let mut data = data.to_vec();
            if n == name {
                data[2 * at..2 * at + 2].copy_from_slice(&bits.to_le_bytes());
            }
            Some(data)
        });
        let e = load_err(&d);
        assert!(e.contains(name.trim_start_matches("model.language_model.")) && e.contains("not finite") && e.contains(&format!("element {at}")), "{e}");
    }
}
