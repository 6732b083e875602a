use super::*;
use crate::model::tensor::HeapStorage;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf").join(name)
}

fn parse_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
    GgufFile::parse(Path::new("test.gguf"), Arc::new(HeapStorage(bytes)))
}

/// A GGUF file built field by field, to make valid files and damage them on purpose.
struct Writer {
    kv: Vec<u8>,
    kv_count: u64,
    infos: Vec<u8>,
    data: Vec<u8>,
    tensor_count: u64,
    alignment: usize,
}

impl Writer {
    fn new() -> Writer {
        Writer { kv: Vec::new(), kv_count: 0, infos: Vec::new(), data: Vec::new(), tensor_count: 0, alignment: 32 }
    }

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    /// A metadata entry of type `kind` whose value is already encoded.
    fn kv_raw(&mut self, key: &str, kind: u32, value: &[u8]) -> &mut Self {
        Self::string(&mut self.kv, key);
        self.kv.extend(kind.to_le_bytes());
        self.kv.extend(value);
        self.kv_count += 1;
        self
    }

    fn kv_str(&mut self, key: &str, s: &str) -> &mut Self {
        let mut v = Vec::new();
        Self::string(&mut v, s);
        self.kv_raw(key, 8, &v)
    }

    fn kv_array(&mut self, key: &str, item: u32, items: &[Vec<u8>]) -> &mut Self {
        let mut v = item.to_le_bytes().to_vec();
        v.extend((items.len() as u64).to_le_bytes());
        items.iter().for_each(|i| v.extend(i));
        self.kv_raw(key, 9, &v)
    }

    fn kv_strs(&mut self, key: &str, items: &[String]) -> &mut Self {
        let items: Vec<Vec<u8>> = items.iter().map(|s| {
            let mut v = Vec::new();
            Self::string(&mut v, s);
            v
        }).collect();
        self.kv_array(key, 8, &items)
    }

    /// A tensor at the next aligned offset of the data section.
    fn tensor(&mut self, name: &str, dims: &[u64], t: GgmlType, bytes: &[u8]) -> &mut Self {
        let offset = self.data.len().next_multiple_of(self.alignment);
        self.data.resize(offset, 0);
        self.data.extend(bytes);
        self.tensor_raw(name, dims, t.id(), offset as u64)
    }

    fn tensor_raw(&mut self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> &mut Self {
        Self::string(&mut self.infos, name);
        self.infos.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| self.infos.extend(d.to_le_bytes()));
        self.infos.extend(type_id.to_le_bytes());
        self.infos.extend(offset.to_le_bytes());
        self.tensor_count += 1;
        self
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(b"GGUF");
        out.extend(3u32.to_le_bytes());
        out.extend(self.tensor_count.to_le_bytes());
        out.extend(self.kv_count.to_le_bytes());
        out.extend(&self.kv);
        out.extend(&self.infos);
        out.resize(out.len().next_multiple_of(self.alignment), 0);
        out.extend(&self.data);
        out
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A small valid file: two string entries, an f32 matrix and a Q8_0 matrix.
fn small_file() -> Vec<u8> {
    let mut w = Writer::new();
    w.kv_str("general.architecture", "qwen35").kv_raw("qwen35.block_count", 4, &8u32.to_le_bytes());
    let m: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
    w.tensor("a", &[3, 2], GgmlType::F32, &f32_bytes(&m));
    let mut q8 = vec![0u8; 34 * 2];
    for (b, block) in q8.chunks_exact_mut(34).enumerate() {
        block[..2].copy_from_slice(&half::f16::from_f32(0.5 + b as f32).to_le_bytes());
        for j in 0..32 {
            block[2 + j] = (j as i8 - 16) as u8;
        }
    }
    w.tensor("b", &[32, 2], GgmlType::Q8_0, &q8);
    w.bytes()
}

#[test]
fn a_small_file_reads_back() {
    let g = parse_bytes(small_file()).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.str("general.architecture").unwrap(), "qwen35");
    assert_eq!(g.usize("qwen35.block_count").unwrap(), 8);
    assert_eq!(g.tensors().len(), 2);
    let a = g.tensor_info("a").unwrap();
    assert_eq!(a.rows_cols().unwrap(), (2, 3));
    assert_eq!(g.tensor_f32("a").unwrap(), vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
    let b = g.tensor_f32("b").unwrap();
    assert_eq!(b.len(), 64);
    assert_eq!((b[0], b[31], b[32], b[63]), (-8.0, 7.5, -24.0, 22.5));
    // Typed getters name the key and what it is.
    let e = g.str("qwen35.block_count").unwrap_err().to_string();
    assert!(e.contains("qwen35.block_count") && e.contains("uint32"), "{e}");
    let e = g.u64("qwen35.missing").unwrap_err().to_string();
    assert!(e.contains("test.gguf") && e.contains("qwen35.missing"), "{e}");
}

/// Every value type, as the `gguf` package wrote them (scripts/gguf_fixtures.py).
#[test]
fn metadata_of_every_type_reads_as_the_gguf_package_wrote_it() {
    let g = GgufFile::open(&fixture("blocks.gguf")).unwrap();
    let want = [
        ("test.u8", Value::U8(200)),
        ("test.i8", Value::I8(-100)),
        ("test.u16", Value::U16(60000)),
        ("test.i16", Value::I16(-30000)),
        ("test.u32", Value::U32(4_000_000_000)),
        ("test.i32", Value::I32(-2_000_000_000)),
        ("test.u64", Value::U64((1u64 << 63) + 5)),
        ("test.i64", Value::I64(-(1i64 << 62))),
        ("test.f32", Value::F32(0.25)),
        ("test.f64", Value::F64(-1.5e300)),
        ("test.bool", Value::Bool(true)),
        ("test.str", Value::Str("Grüße, GGUF".into())),
        ("test.strs", Value::Array(vec![Value::Str("a".into()), Value::Str("".into()), Value::Str("ccc".into())])),
    ];
    for (key, value) in want {
        assert_eq!(g.get(key), Some(&value), "{key}");
    }
    let ints: Vec<i64> = g.array("test.ints").unwrap().iter().map(|v| v.as_f64().unwrap() as i64).collect();
    assert_eq!(ints, vec![1, -2, 3]);
    assert_eq!(g.str("general.architecture").unwrap(), "tandem-test");
}

/// Each block type's plain dequantizer gives what the `gguf` package's gives on random blocks
/// (both compute a scale times an integer, minus a minimum, in f32; they may round the scale
/// products in another order, so agreement is to a few units in the last place).
#[test]
fn block_dequantizers_agree_with_the_gguf_package() {
    let g = GgufFile::open(&fixture("blocks.gguf")).unwrap();
    let types = [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K];
    for t in types {
        let info = g.tensor_info(t.name()).unwrap_or_else(|| panic!("no tensor {}", t.name()));
        assert_eq!(info.ggml_type, t);
        assert_eq!(info.rows_cols().unwrap(), (2, 512));
        let got = g.tensor_f32(t.name()).unwrap();
        let want = g.tensor_f32(&format!("{}.expected", t.name())).unwrap();
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "{}: all zeros", t.name());
        let mut exact = 0;
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() <= 4.0 * f32::EPSILON * scale, "{} value {i}: {a} against {b}", t.name());
            exact += (a == b) as usize;
        }
        // Most values must be the same bits: a layout error moves whole runs of values.
        assert!(exact * 10 >= got.len() * 9, "{}: only {exact} of {} values equal", t.name(), got.len());
    }
}

fn error_of(bytes: Vec<u8>) -> String {
    match parse_bytes(bytes) {
        Ok(_) => panic!("the damaged file was accepted"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn damaged_headers_are_errors_that_name_the_field() {
    let good = small_file();
    // Magic, version, endianness.
    let mut b = good.clone();
    b[0] = b'X';
    assert!(error_of(b).contains("not a GGUF file"));
    let mut b = good.clone();
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(error_of(b).contains("version 1"));
    let mut b = good.clone();
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(error_of(b).contains("big-endian"));
    // Counts larger than the file can hold: an error, not an allocation.
    let mut b = good.clone();
    b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = error_of(b);
    assert!(e.contains("metadata count") && e.contains("damaged"), "{e}");
    let mut b = good.clone();
    b[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(error_of(b).contains("tensor count"));
    // A string longer than the file.
    let mut b = good.clone();
    b[24..32].copy_from_slice(&(1u64 << 50).to_le_bytes());
    assert!(error_of(b).contains("metadata entry 0's key"));

    let check = |w: &Writer, want: &[&str]| {
        let e = error_of(w.bytes());
        for s in want {
            assert!(e.contains(s), "{e:?} lacks {s:?}");
        }
    };
    let mut w = Writer::new();
    w.kv_raw("k", 13, &[]);
    check(&w, &["\"k\"", "unknown value type 13"]);
    let mut w = Writer::new();
    w.kv_raw("k", 7, &[2]);
    check(&w, &["bool of value 2"]);
    let mut w = Writer::new();
    w.kv_str("k", "x").kv_str("k", "y");
    check(&w, &["\"k\"", "twice"]);
    let mut w = Writer::new();
    w.kv_raw("k", 8, &[3, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xfe, 0xfd]);
    check(&w, &["\"k\"", "UTF-8"]);
    // Arrays: an unknown item type, a count past the file, nesting.
    let mut w = Writer::new();
    w.kv_raw("k", 9, &[77, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]);
    check(&w, &["unknown type 77"]);
    let mut w = Writer::new();
    let mut v = vec![4, 0, 0, 0];
    v.extend(u64::MAX.to_le_bytes());
    w.kv_raw("k", 9, &v);
    check(&w, &["length of metadata \"k\""]);
    // More items than any model's metadata has, each one byte in the file.
    let mut w = Writer::new();
    let mut v = vec![0, 0, 0, 0];
    v.extend(((1u64 << 24) + 1).to_le_bytes());
    v.resize(v.len() + (1 << 24) + 1, 7);
    w.kv_raw("k", 9, &v);
    check(&w, &["\"k\"", "16777217 items"]);
    let mut deep = Vec::new();
    for _ in 0..5 {
        deep.extend([9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]);
    }
    let mut w = Writer::new();
    w.kv_raw("k", 9, &deep);
    check(&w, &["nests arrays"]);
    let mut w = Writer::new();
    w.kv_raw("general.alignment", 4, &24u32.to_le_bytes());
    check(&w, &["general.alignment", "power of two"]);

    // Tensor table entries.
    let one = f32_bytes(&[1.0; 32]);
    let mut w = Writer::new();
    w.tensor("t", &[32, 1, 1, 1, 1], GgmlType::F32, &one);
    check(&w, &["\"t\"", "5 dimensions"]);
    let mut w = Writer::new();
    w.tensor("t", &[32, 0], GgmlType::F32, &one);
    check(&w, &["\"t\"", "size 0"]);
    let mut w = Writer::new();
    w.tensor_raw("t", &[32], 10, 0);
    check(&w, &["\"t\"", "Q2_K", "not supported"]);
    let mut w = Writer::new();
    w.tensor_raw("t", &[32], 99, 0);
    check(&w, &["\"t\"", "type 99"]);
    let mut w = Writer::new();
    w.tensor("t", &[33], GgmlType::Q8_0, &[0; 34]);
    check(&w, &["\"t\"", "multiple of Q8_0's block of 32"]);
    let mut w = Writer::new();
    w.tensor("t", &[1 << 20, 1 << 20], GgmlType::F32, &one);
    check(&w, &["\"t\"", "runs past the end"]);
    let mut w = Writer::new();
    w.tensor("t", &[u64::MAX / 2, 4], GgmlType::F32, &one);
    check(&w, &["\"t\"", "overflows"]);
    let mut w = Writer::new();
    w.tensor("t", &[32], GgmlType::F32, &one).tensor_raw("u", &[32], 0, 8);
    check(&w, &["\"u\"", "alignment"]);
    let mut w = Writer::new();
    w.tensor("t", &[32], GgmlType::F32, &one).tensor_raw("u", &[32], 0, u64::MAX - 31);
    check(&w, &["\"u\"", "runs past the end"]);
    let mut w = Writer::new();
    w.tensor("t", &[32], GgmlType::F32, &one).tensor("t", &[32], GgmlType::F32, &one);
    check(&w, &["\"t\"", "twice"]);
}

/// A file cut anywhere is an error (each cut loses part of a field or of the last tensor).
#[test]
fn a_file_cut_anywhere_is_an_error() {
    let good = small_file();
    for len in 0..good.len() {
        let e = match parse_bytes(good[..len].to_vec()) {
            Ok(_) => panic!("a file cut to {len} of {} bytes was accepted", good.len()),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("test.gguf"), "cut at {len}: {e}");
    }
}

/// Random damage never panics: each damaged file is refused, or read with every tensor inside
/// the file.
#[test]
fn random_damage_is_refused_or_read_within_bounds() {
    let good = small_file();
    let fixture = std::fs::read(fixture("blocks.gguf")).unwrap();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let (mut refused, mut read) = (0, 0);
    for round in 0..3000 {
        let mut b = if round % 3 == 0 { fixture.clone() } else { good.clone() };
        // Damage the header and table mostly (that is where the structure is).
        let span = if round % 3 == 0 { 2048.min(b.len()) } else { b.len() };
        for _ in 0..1 + next() % 4 {
            let at = (next() as usize) % span;
            b[at] = match next() % 4 {
                0 => 0xff,
                1 => 0,
                _ => next() as u8,
            };
        }
        if next() % 8 == 0 {
            b.truncate((next() as usize) % b.len());
        }
        match parse_bytes(b) {
            Err(_) => refused += 1,
            Ok(g) => {
                read += 1;
                for t in g.tensors() {
                    assert!(t.start + t.bytes <= g.storage().bytes().len());
                    let _ = g.tensor_f32(&t.name).unwrap();
                }
            }
        }
    }
    assert!(refused > 0 && read > 0, "refused {refused}, read {read}");
}

/// The Qwen3.5 tokenizer stored as llama.cpp's converter stores it (tokens by id, their types,
/// merges as "a b", the pre-tokenizer's name) encodes and decodes as the tokenizer.json it came
/// from.
#[test]
fn a_tokenizer_stored_in_gguf_metadata_is_the_one_it_came_from() {
    let asset = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/qwen3.5/tokenizer.json")).unwrap();
    let want = crate::tokenizer::Tokenizer::from_bytes(&asset).unwrap();
    let json: serde_json::Value = serde_json::from_slice(&asset).unwrap();
    let vocab = json["model"]["vocab"].as_object().unwrap();
    let added = json["added_tokens"].as_array().unwrap();
    let n = vocab.len() + added.len();
    let (mut tokens, mut types) = (vec![String::new(); n], vec![0i32; n]);
    for (t, id) in vocab {
        let id = id.as_u64().unwrap() as usize;
        (tokens[id], types[id]) = (t.clone(), 1);
    }
    for a in added {
        let id = a["id"].as_u64().unwrap() as usize;
        (tokens[id], types[id]) = (a["content"].as_str().unwrap().to_string(), if a["special"].as_bool().unwrap() { 3 } else { 4 });
    }
    let merges: Vec<String> = json["model"]["merges"].as_array().unwrap().iter().map(|m| format!("{} {}", m[0].as_str().unwrap(), m[1].as_str().unwrap())).collect();
    let file = |pre: &str| {
        let mut w = Writer::new();
        w.kv_str("tokenizer.ggml.model", "gpt2").kv_str("tokenizer.ggml.pre", pre).kv_strs("tokenizer.ggml.tokens", &tokens).kv_strs("tokenizer.ggml.merges", &merges);
        let types: Vec<Vec<u8>> = types.iter().map(|t| t.to_le_bytes().to_vec()).collect();
        w.kv_array("tokenizer.ggml.token_type", 5, &types);
        parse_bytes(w.bytes()).unwrap()
    };
    let got = tokenizer::tokenizer(&file("qwen35")).unwrap().expect("a tokenizer");
    assert_eq!(got.vocab_size(), want.vocab_size());
    for text in ["Hello, world!", "<|im_start|>user\nWie geht's? 12345 ...\n\n  indented\tcode()<|im_end|>", "数字 ١٢٣ and émojis 🎉🎉", "  leading spaces and a <think>\n</think> block", ""] {
        let ids = want.encode(text).unwrap();
        assert_eq!(got.encode(text).unwrap(), ids, "{text:?}");
        assert_eq!(got.decode(&ids).unwrap(), want.decode(&ids).unwrap(), "{text:?}");
    }
    for id in [0u32, 248044, 248045, 248046] {
        assert_eq!(got.is_special(id), want.is_special(id), "id {id}");
    }
    let e = tokenizer::tokenizer(&file("llama-bpe")).err().expect("an unknown pre-tokenizer was accepted").to_string();
    assert!(e.contains("llama-bpe") && e.contains("tokenizer.ggml.pre"), "{e}");
}

mod qwen35_files {
    use crate::backend::cpu::pool::Pool;
    use crate::model::load::LoadedModel;
    use crate::model::{Logits, Mixer};
    use crate::state::State;

    fn load(name: &str) -> LoadedModel {
        let path = super::fixture(name);
        LoadedModel::load(path.to_str().unwrap()).unwrap_or_else(|e| panic!("{name}: {e:#}"))
    }

    fn checkpoint() -> LoadedModel {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
        LoadedModel::load(dir.to_str().unwrap()).unwrap()
    }

    /// Logits of every position of a prompt, and 12 greedy ids after it.
    fn run(m: &LoadedModel) -> (Vec<f32>, Vec<u32>) {
        let pool = Pool::new(2);
        let prompt = [3u32, 141, 59, 26, 535, 897, 12, 1000, 7, 64, 300, 2];
        let mut st = State::new(&m.net.config);
        let logits = m.net.forward(&pool, &prompt, &mut st, Logits::All).unwrap();
        let mut ids = Vec::new();
        for _ in 0..12 {
            let l = &st.last_logits;
            let next = (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a))).unwrap() as u32;
            ids.push(next);
            m.net.decode_batch(&pool, &[next], &mut [&mut st]).unwrap();
        }
        (logits, ids)
    }

    /// The golden fixture written as llama.cpp's converter writes Qwen3.5 (its value heads
    /// tiled, norms as 1 + w, A as -exp(A_log)) loads into the same model: the same config, the
    /// same matrices bit for bit, the same norms, the decay within a few units in the last place
    /// (the file's was computed by numpy's f32 exp, the checkpoint's by Rust's; the converter
    /// uses PyTorch's), so the same greedy ids and logits within that rounding's effect.
    #[test]
    fn a_bf16_gguf_file_is_the_checkpoint_it_was_converted_from() {
        let (a, b) = (checkpoint(), load("qwen35-tiny-bf16.gguf"));
        assert_eq!(a.net.config, b.net.config);
        assert_eq!(b.stop_ids, vec![7]);
        assert!(b.chat_template.render(&[crate::chat::Message::new("user", "hi")], false, false).unwrap().contains("<|im_start|>user\nhi"));
        let bytes = |m: &crate::model::tensor::Matrix| {
            let mut v = vec![0f32; m.cols];
            (0..m.rows).flat_map(|r| {
                m.row_to_f32(r, &mut v);
                v.clone()
            }).collect::<Vec<f32>>()
        };
        assert!(bytes(&a.net.lm_head) == bytes(&b.net.lm_head));
        assert_eq!(a.net.final_norm, b.net.final_norm);
        for (i, (la, lb)) in a.net.layers.iter().zip(&b.net.layers).enumerate() {
            assert_eq!(la.input_norm, lb.input_norm, "layer {i}");
            assert_eq!(la.post_attention_norm, lb.post_attention_norm, "layer {i}");
            assert!(bytes(&la.mlp.down_proj) == bytes(&lb.mlp.down_proj), "layer {i}");
            match (&la.mixer, &lb.mixer) {
                (Mixer::DeltaNet(x), Mixer::DeltaNet(y)) => {
                    for (name, p, q) in [("in_proj_qkv", &x.in_proj_qkv, &y.in_proj_qkv), ("in_proj_z", &x.in_proj_z, &y.in_proj_z), ("in_proj_b", &x.in_proj_b, &y.in_proj_b), ("in_proj_a", &x.in_proj_a, &y.in_proj_a), ("out_proj", &x.out_proj, &y.out_proj)] {
                        assert!(bytes(p) == bytes(q), "layer {i} {name}");
                    }
                    assert_eq!(x.conv_taps, y.conv_taps, "layer {i}");
                    assert_eq!(x.dt_bias, y.dt_bias, "layer {i}");
                    assert_eq!(x.norm, y.norm, "layer {i}");
                    for (p, q) in x.neg_a.iter().zip(&y.neg_a) {
                        assert!((p.to_bits() as i64 - q.to_bits() as i64).abs() <= 4, "layer {i} decay {p} against {q}");
                    }
                }
                (Mixer::Attention(x), Mixer::Attention(y)) => {
                    assert!(bytes(&x.q_proj) == bytes(&y.q_proj) && bytes(&x.o_proj) == bytes(&y.o_proj), "layer {i}");
                    assert_eq!((&x.q_norm, &x.k_norm), (&y.q_norm, &y.k_norm), "layer {i}");
                }
                _ => panic!("layer {i} has another kind"),
            }
        }
        let ((la, ia), (lb, ib)) = (run(&a), run(&b));
        assert_eq!(ia, ib);
        let scale = la.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = la.iter().zip(&lb).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(worst <= 1e-5 * scale, "largest logit difference {worst} (logits up to {scale})");
    }

    /// Q8_0 matrices (dequantized by the plain reference; each weight within half a step of
    /// its block's 1/127) move the logits about as far as tandem's own int8 does (measured on
    /// this prompt: 0.558 and 0.543 of logits up to 3.9; the tiny model's random weights
    /// amplify any rounding), so within 1.25x of int8's.
    #[test]
    fn a_q8_0_gguf_file_is_no_further_from_its_checkpoint_than_int8() {
        let (a, b) = (checkpoint(), load("qwen35-tiny-q8_0.gguf"));
        assert_eq!(a.net.config, b.net.config);
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
        let int8 = LoadedModel::load_int8(dir.to_str().unwrap(), &Pool::new(1)).unwrap();
        let (la, _) = run(&a);
        let worst = |m: &LoadedModel| run(m).0.iter().zip(&la).fold(0f32, |w, (x, y)| w.max((x - y).abs()));
        let (q8_0, int8) = (worst(&b), worst(&int8));
        let scale = la.iter().fold(0f32, |m, v| m.max(v.abs()));
        eprintln!("largest logit difference from the checkpoint: Q8_0 {q8_0}, int8 {int8} (logits up to {scale})");
        assert!(q8_0 > 0.0, "quantized logits equal the checkpoint's: the file was not read quantized");
        assert!(q8_0 <= 1.25 * int8, "Q8_0 {q8_0} against int8 {int8}");
    }

    /// A file that is not Qwen3.5, or lacks or misnames a tensor, is refused with its name.
    #[test]
    fn a_wrong_gguf_model_is_an_error_naming_what_is_wrong() {
        let good = std::fs::read(super::fixture("qwen35-tiny-bf16.gguf")).unwrap();
        let dir = std::env::temp_dir().join(format!("tandem-gguf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let with = |from: &str, to: &str| {
            assert_eq!(from.len(), to.len());
            let mut b = good.clone();
            let at = b.windows(from.len()).position(|w| w == from.as_bytes()).unwrap_or_else(|| panic!("{from} not in the file"));
            b[at..at + to.len()].copy_from_slice(to.as_bytes());
            let path = dir.join(format!("{to}.gguf"));
            std::fs::write(&path, b).unwrap();
            match LoadedModel::load(path.to_str().unwrap()) {
                Ok(_) => panic!("{from} -> {to} was accepted"),
                Err(e) => format!("{e:#}"),
            }
        };
        let e = with("qwen35", "llama7");
        assert!(e.contains("general.architecture") && e.contains("llama7"), "{e}");
        let e = with("blk.0.ssm_out.weight", "blk.0.ssm_oux.weight");
        assert!(e.contains("blk.0.ssm_oux.weight"), "{e}");
        let e = with("output_norm.weight", "outpux_norm.weight");
        assert!(e.contains("norm.weight") && e.contains("missing"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
