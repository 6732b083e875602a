//! The checkpoint layouts of published and fine-tuned Qwen3.5 exports load to the same model:
//! sharded safetensors with an index, the text-only `Qwen3_5ForCausalLM` config with `model.`
//! weight names, f32 tensors.

mod common;

use std::collections::HashMap;

use tandem_core::model::load::LoadedModel;
use tandem_core::model::Logits;
use tandem_core::state::State;

fn logits_of(dir: &std::path::Path) -> Vec<f32> {
    let m = LoadedModel::load(dir.to_str().unwrap()).unwrap();
    let mut st = State::new(&m.net.config);
    m.net.forward(&tandem_core::backend::cpu::pool::Pool::new(2), &[5, 77, 901, 3, 64], &mut st, Logits::All).unwrap()
}

#[test]
fn sharded_text_only_and_f32_layouts_give_the_same_logits() {
    let want = logits_of(&common::tiny_dir());
    let bytes = std::fs::read(common::tiny_dir().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    // Decoder tensors only, renamed from model.language_model.* to model.*, and with the
    // f32 upcast of every norm weight (a dtype mix the loader must accept).
    let mut renamed: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let Some(rest) = name.strip_prefix("model.language_model.") else {
            if name == "lm_head.weight" {
                renamed.push((name.clone(), view.dtype(), view.shape().to_vec(), view.data().to_vec()));
            }
            continue;
        };
        let (dtype, data) = if rest.ends_with("norm.weight") && view.dtype() == safetensors::Dtype::BF16 {
            let f: Vec<u8> = view
                .data()
                .chunks_exact(2)
                .flat_map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16).to_le_bytes())
                .collect();
            (safetensors::Dtype::F32, f)
        } else {
            (view.dtype(), view.data().to_vec())
        };
        renamed.push((format!("model.{rest}"), dtype, view.shape().to_vec(), data));
    }
    renamed.sort_by(|a, b| a.0.cmp(&b.0));
    let dir = common::scratch("sharded");
    let half = renamed.len() / 2;
    let mut weight_map = serde_json::Map::new();
    for (i, part) in [&renamed[..half], &renamed[half..]].iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let views: Vec<(String, safetensors::tensor::TensorView)> = part
            .iter()
            .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None::<HashMap<String, String>>, &dir.join(&file)).unwrap();
        for (n, ..) in part.iter() {
            weight_map.insert(n.clone(), serde_json::Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    // Text-only config: the text_config fields at the top level.
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(common::tiny_dir().join("config.json")).unwrap()).unwrap();
    let mut text = cfg["text_config"].clone();
    text["architectures"] = serde_json::json!(["Qwen3_5ForCausalLM"]);
    std::fs::write(dir.join("config.json"), text.to_string()).unwrap();

    let got = logits_of(&dir);
    assert_eq!(got, want, "same weights, same maths: bit-identical logits");

    // A shard named by the index but missing is reported by name.
    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let e = format!("{:#}", LoadedModel::load(dir.to_str().unwrap()).err().expect("must fail"));
    assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
}
