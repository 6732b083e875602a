//! The real Qwen3.5 vocabulary: every test vector of fixtures/qwen35-tokenizer, and the chat
//! template rendered and tokenized with it.

mod common;

use tandem_core::chat::{ChatTemplate, Message};
use tandem_core::tokenizer::{StreamDecoder, Tokenizer};

fn tokenizer() -> Tokenizer {
    Tokenizer::from_file(&common::fixtures().join("../../assets/qwen3.5/tokenizer.json")).unwrap()
}

#[test]
fn all_vectors_encode_exactly() {
    let tok = tokenizer();
    let text = std::fs::read_to_string(common::fixtures().join("qwen35-tokenizer/vectors.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(tok.vocab_size() as u64, v["vocab_size_with_specials"].as_u64().unwrap());
    let vectors = v["vectors"].as_array().unwrap();
    assert_eq!(vectors.len(), 50);
    let mut failures = Vec::new();
    for case in vectors {
        let s = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        let got = tok.encode(s).unwrap();
        if got != want {
            failures.push(format!("{s:?}: got {got:?}, want {want:?}"));
        }
    }
    assert!(failures.is_empty(), "{} vectors differ:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn token_bytes_put_together_give_the_text_back() {
    let tok = tokenizer();
    let text = std::fs::read_to_string(common::fixtures().join("qwen35-tokenizer/vectors.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut texts: Vec<String> = v["vectors"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap().to_string()).collect();
    // Control characters, a space run, split characters and special tokens.
    texts.push("tab\there\u{0}\u{7f} \u{ad}  x 😀👍🏽 数学 <|im_start|>user\n<tool_call>\n".into());
    for t in &texts {
        let ids = tok.encode(t).unwrap();
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id).expect("in the vocabulary")).collect();
        // The decoder's text: the tokenizer normalises to NFC first.
        assert_eq!(String::from_utf8(bytes).unwrap(), tok.decode(&ids).unwrap(), "{t:?}");
    }
    assert_eq!(tok.token_bytes(tok.token_id("<|im_end|>").unwrap()).unwrap(), b"<|im_end|>");
    assert_eq!(tok.token_bytes(198).unwrap(), b"\n", "id 198 is a newline");
    assert!(tok.token_bytes(10_000_000).is_none());
}

#[test]
fn streaming_decode_reassembles_split_characters() {
    let tok = tokenizer();
    // Emoji and CJK split into several byte-level tokens.
    let text = "emoji 😀👍🏽 and 数学 text";
    let ids = tok.encode(text).unwrap();
    let mut dec = StreamDecoder::new();
    let mut out = String::new();
    for &id in &ids {
        let piece = dec.push(&tok, id).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "a partial character leaked: {piece:?}");
        out.push_str(&piece);
    }
    out.push_str(&dec.finish(&tok).unwrap());
    assert_eq!(out, text);
}

#[test]
fn multi_turn_chat_renders_and_tokenizes_with_special_tokens() {
    let tok = tokenizer();
    let messages = vec![
        Message::new("system", "You are a helpful assistant."),
        Message::new("user", "What is the capital of France?"),
        Message::new("assistant", "<think>\nEasy.\n</think>\n\nParis."),
        Message::new("user", "And of Italy?"),
    ];
    let text = ChatTemplate::qwen35().render(&messages, true, false).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n\
         <|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    let ids = tok.encode(&text).unwrap();
    let (im_start, im_end, think, end_think) = (248045, 248046, 248068, 248069);
    assert_eq!(ids[0], im_start);
    assert_eq!(ids.iter().filter(|&&i| i == im_start).count(), 5);
    assert_eq!(ids.iter().filter(|&&i| i == im_end).count(), 4);
    // The prompt ends "<think>", "\n\n", "</think>", "\n\n" (an empty thinking block).
    let n = ids.len();
    assert_eq!((ids[n - 4], ids[n - 2]), (think, end_think));
    assert_eq!(tok.decode(&ids[n - 3..n - 2]).unwrap(), "\n\n");
    assert_eq!(tok.decode(&ids).unwrap(), text, "decode inverts encode");
}
