//! Constrained decoding on the real Qwen3.5 vocabulary: whatever the logits say (random rows
//! here, as a model with random weights gives), the sampled reply follows the grammar and ends
//! once it is complete.

mod common;

use serde_json::{json, Value};
use tandem_core::grammar::Grammars;
use tandem_core::rng::Rng;
use tandem_core::sampling::{Sampler, SamplingParams};
use tandem_core::tokenizer::Tokenizer;

fn tokenizer() -> Tokenizer {
    Tokenizer::from_file(&common::fixtures().join("../../assets/qwen3.5/tokenizer.json")).unwrap()
}

/// Sample from random logits under `params` until an end token (or `limit` tokens): the reply's
/// text and whether it ended.
fn sample_reply(tok: &Tokenizer, params: SamplingParams, ends: &[u32], seed: u64, limit: usize) -> (String, bool) {
    let n = tok.vocab_size();
    let mut rows = Rng::new(seed);
    let mut s = Sampler::new(params, n);
    let mut ids = Vec::new();
    for _ in 0..limit {
        // Padded as the model's rows are.
        let logits: Vec<f32> = (0..n + 243).map(|_| rows.next_signed_f32() * 4.0).collect();
        let t = s.sample(&logits).unwrap();
        if ends.contains(&t) {
            return (tok.decode(&ids).unwrap(), true);
        }
        ids.push(t);
    }
    (tok.decode(&ids).unwrap(), false)
}

fn ends(tok: &Tokenizer) -> Vec<u32> {
    vec![tok.token_id("<|im_end|>").unwrap(), tok.token_id("<|endoftext|>").unwrap()]
}

#[test]
fn random_logits_under_a_json_schema_give_json_that_matches_it() {
    let tok = tokenizer();
    let ends = ends(&tok);
    let g = Grammars::new(&tok, &ends).unwrap();
    let schema = json!({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"}},
        "required": ["name", "age", "tags", "ok"], "additionalProperties": false});
    let constraint = g.json_schema(&schema).unwrap();
    for (seed, temperature) in [(1, 0.0), (2, 1.0), (3, 1.0), (4, 0.7)] {
        let params = SamplingParams { temperature, seed, constraint: Some(constraint.clone()), ..Default::default() };
        let (text, ended) = sample_reply(&tok, params, &ends, seed, 400);
        assert!(ended, "seed {seed}: no end after {text:?}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {text:?} is not JSON: {e}"));
        let o = v.as_object().unwrap();
        assert_eq!(o.len(), 4, "{text}");
        assert!(o["name"].as_str().is_some_and(|s| s.chars().count() <= 12), "{text}");
        assert!(o["age"].as_u64().is_some_and(|a| a <= 150), "{text}");
        assert!(o["tags"].as_array().is_some_and(|t| t.len() <= 3 && t.iter().all(|x| x == "a" || x == "b")), "{text}");
        assert!(o["ok"].is_boolean(), "{text}");
    }
    // Unconstrained, the same rows give no JSON at all.
    let (text, _) = sample_reply(&tok, SamplingParams { temperature: 1.0, seed: 2, ..Default::default() }, &ends, 2, 40);
    assert!(serde_json::from_str::<Value>(&text).is_err(), "{text:?}");
}

#[test]
fn any_json_object_and_lark_grammars_hold_too() {
    let tok = tokenizer();
    let ends = ends(&tok);
    let g = Grammars::new(&tok, &ends).unwrap();
    // json_object: any object; random logits would nest and grow for ever, so cap the keys.
    let object = g.json_schema(&json!({"type": "object", "maxProperties": 2, "additionalProperties": {"type": "integer"}})).unwrap();
    let (text, ended) = sample_reply(&tok, SamplingParams { temperature: 1.0, seed: 9, constraint: Some(object), ..Default::default() }, &ends, 9, 300);
    assert!(ended && serde_json::from_str::<Value>(&text).is_ok_and(|v| v.is_object()), "{text:?}");
    // A Lark grammar, special tokens included: a tool call's frame around JSON arguments.
    let lark = g.lark("start: <tool_call> \"\\n\" \"x=\" %json{\"type\": \"integer\", \"minimum\": 0, \"maximum\": 9} \"\\n\" </tool_call>").unwrap();
    let (text, ended) = sample_reply(&tok, SamplingParams { temperature: 1.0, seed: 5, constraint: Some(lark), ..Default::default() }, &ends, 5, 50);
    assert!(ended, "{text:?}");
    assert!(text.starts_with("<tool_call>\nx=") && text.ends_with("\n</tool_call>") && text.len() == "<tool_call>\nx=5\n</tool_call>".len(), "{text:?}");
    // A grammar the engine cannot compile is an error that says why.
    let e = g.json_schema(&json!({"type": "nonsense"})).err().expect("refused");
    assert!(!e.to_string().is_empty());
}

#[test]
fn tool_call_grammars_give_calls_of_the_offered_functions() {
    let tok = tokenizer();
    let ends = ends(&tok);
    let g = Grammars::new(&tok, &ends).unwrap();
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}, "note": {"type": "string", "maxLength": 6}},
            "required": ["city", "days"]}}},
        {"type": "function", "function": {"name": "now"}}]);
    let call = regex_like_call();
    for (only, seed) in [(None, 1), (None, 2), (Some("get_weather"), 3), (Some("now"), 4)] {
        let c = g.tool_calls(&tools, only).unwrap();
        let (text, ended) = sample_reply(&tok, SamplingParams { temperature: 1.0, seed, constraint: Some(c), ..Default::default() }, &ends, seed, 300);
        assert!(ended, "{only:?}: {text:?}");
        let calls: Vec<&str> = text.split("\n<tool_call>").collect();
        assert!(only.is_none() || calls.len() == 1, "{only:?}: one call of {only:?}: {text:?}");
        for c in calls {
            assert!(call(c, only), "{only:?}: {c:?} in {text:?}");
        }
    }
    assert!(g.tool_calls(&tools, Some("nope")).err().is_some_and(|e| format!("{e:#}").contains("no function named \"nope\"")));
}

/// Whether `c` is one call in Qwen3.5's form of get_weather (city one of the enum, days 1..=7,
/// an optional note of up to 6 characters) or of now (no parameters), of `only` where given.
fn regex_like_call() -> impl Fn(&str, Option<&str>) -> bool {
    |c: &str, only: Option<&str>| {
        let c = c.strip_prefix("<tool_call>").unwrap_or(c);
        let Some(body) = c.strip_prefix("\n<function=").and_then(|b| b.strip_suffix("</function>\n</tool_call>")) else { return false };
        let Some((name, params)) = body.split_once(">\n") else { return false };
        if only.is_some_and(|o| o != name) {
            return false;
        }
        match name {
            "now" => params.is_empty(),
            "get_weather" => {
                let mut rest = params;
                let mut take = |p: &str| -> Option<String> {
                    let r = rest.strip_prefix(&format!("<parameter={p}>\n"))?;
                    let (v, after) = r.split_once("\n</parameter>\n")?;
                    rest = after;
                    Some(v.to_string())
                };
                let (city, days) = (take("city"), take("days"));
                let note = take("note");
                city.is_some_and(|c| c == "Paris" || c == "Rome") && days.and_then(|d| d.parse::<u32>().ok()).is_some_and(|d| (1..=7).contains(&d)) && note.is_none_or(|n| n.chars().count() <= 6) && rest.is_empty()
            }
            _ => false,
        }
    }
}

#[test]
fn samplers_side_by_side_pick_what_they_pick_one_after_another() {
    use tandem_core::sampling::sample_side_by_side;
    let tok = tokenizer();
    let ends = ends(&tok);
    let g = Grammars::new(&tok, &ends).unwrap();
    let schema = g.json_schema(&json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}}, "required": ["a", "b"]})).unwrap();
    let n = tok.vocab_size();
    let params = |k: u64| SamplingParams { temperature: if k % 2 == 0 { 0.0 } else { 0.8 }, seed: k, constraint: (k % 3 != 0).then(|| schema.clone()), ..Default::default() };
    let mut rng = Rng::new(4);
    let rows: Vec<Vec<f32>> = (0..4).map(|_| (0..n).map(|_| rng.next_signed_f32() * 4.0).collect()).collect();
    for threads in [2, 3, 8] {
        let mut alone: Vec<Sampler> = (0..7).map(|k| Sampler::new(params(k), n)).collect();
        let mut together: Vec<Sampler> = (0..7).map(|k| Sampler::new(params(k), n)).collect();
        for step in 0..20 {
            let want: Vec<u32> = alone.iter_mut().enumerate().map(|(i, s)| s.sample(&rows[(step + i) % 4]).unwrap()).collect();
            let mut pairs: Vec<(&[f32], &mut Sampler)> = together.iter_mut().enumerate().map(|(i, s)| (&rows[(step + i) % 4][..], s)).collect();
            let got: Vec<u32> = sample_side_by_side(&mut pairs, threads).into_iter().map(Result::unwrap).collect();
            assert_eq!(got, want, "{threads} threads, step {step}");
        }
    }
}

/// A grammar's masks computed ahead (`prepare`, as a GPU engine's decode loop does while the
/// step runs) and the GPU's way of picking (`gpu_masked_pick`: the row masked by the mask it
/// hands out, greedy or drawn with its uniform, the token handed back through `took`; or the
/// host's fallback with the same uniform) pick what `sample` picks alone.
#[test]
fn masks_computed_ahead_and_masked_picks_are_the_samplers_own() {
    use tandem_core::grammar;
    use tandem_core::sampling::{argmax, prepare_side_by_side};
    let tok = tokenizer();
    let ends = ends(&tok);
    let g = Grammars::new(&tok, &ends).unwrap();
    let schema = g.json_schema(&json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}}, "required": ["a", "b"]})).unwrap();
    let n = tok.vocab_size();
    let params = |k: u64| SamplingParams { temperature: [0.0, 0.8, 1.3][k as usize % 3], top_k: if k == 4 { 40 } else { 0 }, seed: k, constraint: Some(schema.clone()), ..Default::default() };
    let mut rng = Rng::new(11);
    let rows: Vec<Vec<f32>> = (0..5).map(|_| (0..n + 243).map(|_| rng.next_signed_f32() * 4.0).collect()).collect();
    let samplers = || (0..6).map(|k| Sampler::new(params(k), n)).collect::<Vec<_>>();
    let (mut alone, mut ahead, mut masked) = (samplers(), samplers(), samplers());
    for step in 0..40 {
        let row = |i: usize| &rows[(step + i) % rows.len()][..];
        let want: Vec<u32> = alone.iter_mut().enumerate().map(|(i, s)| s.sample(row(i)).unwrap()).collect();
        prepare_side_by_side(&mut ahead.iter_mut().collect::<Vec<_>>(), 3);
        assert!(ahead.iter().all(|s| !s.unprepared()));
        let got: Vec<u32> = ahead.iter_mut().enumerate().map(|(i, s)| s.sample(row(i)).unwrap()).collect();
        assert_eq!(got, want, "masks computed ahead, step {step}");
        let got: Vec<u32> = masked
            .iter_mut()
            .enumerate()
            .map(|(i, s)| {
                let pick = s.gpu_masked_pick().expect("a grammar alone changes the logits").unwrap();
                let (mask, draw) = (pick.mask.to_vec(), pick.draw);
                match draw {
                    // The host's fallback for a draw the GPU could not make.
                    Some(d) => s.sample_drawn(row(i), d.u).unwrap(),
                    // What mask_rows and argmax_rows compute.
                    None => {
                        let mut r = row(i)[..n].to_vec();
                        grammar::apply(&mask, &mut r);
                        let id = argmax(&r);
                        s.took(id);
                        id
                    }
                }
            })
            .collect();
        assert_eq!(got, want, "masked picks, step {step}");
    }
    // A sampler that reads the logits otherwise (logprobs) takes no masked pick on a GPU.
    let mut s = Sampler::new(SamplingParams { logprobs: Some(2), constraint: Some(schema.clone()), ..Default::default() }, n);
    assert!(s.gpu_masked_pick().is_none());
}
