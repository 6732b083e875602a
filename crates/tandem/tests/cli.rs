//! The `tandem` command as a user runs it.

use std::path::PathBuf;
use std::process::{Command, Output};

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem")).args(args).output().expect("run tandem")
}

fn tiny() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny").to_string_lossy().into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn verify_passes_on_the_golden_fixture() {
    let reference = format!("{}/reference.safetensors", tiny());
    let o = tandem(&["verify", "--model", &tiny(), "--reference", &reference]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("95 of 95 checks within tolerance") && out.trim_end().ends_with("PASS"), "{out}");
}

#[test]
fn generate_from_token_ids_prints_ids_and_a_summary() {
    // The tiny checkpoint has no tokenizer: ids in, ids out. Greedy ids of fixture prompt p1.
    let o = tandem(&["generate", "--model", &tiny(), "--token-ids", "776,245,774,185,362,826,848", "--max-tokens", "5"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "294,115,733,707,844");
    let err = stderr(&o);
    for field in ["prompt 7 tokens", "TTFT", "prefill", "tok/s", "decode"] {
        assert!(err.contains(field), "summary lacks {field}: {err}");
    }
}

#[test]
fn synthetic_model_generates_text_from_a_chat_prompt() {
    let o = tandem(&["generate", "--model", "synthetic:qwen3.5-0.8b", "--prompt", "hello", "--chat", "--max-tokens", "3", "--temperature", "0.8", "--seed", "3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!o.stdout.is_empty());
    // <|im_start|> user \n hello <|im_end|> \n <|im_start|> assistant \n, then thinking is off
    // by default: <think> \n\n </think> \n\n. 13 tokens.
    assert!(stderr(&o).contains("prompt 13 tokens"), "{}", stderr(&o));
    let ids = tandem(&["generate", "--model", "synthetic:qwen3.5-0.8b", "--prompt", "hello", "--max-tokens", "4", "--ids-out"]);
    let again = tandem(&["generate", "--model", "synthetic:qwen3.5-0.8b", "--prompt", "hello", "--max-tokens", "4", "--ids-out"]);
    assert!(ids.status.success());
    assert_eq!(ids.stdout, again.stdout, "synthetic weights and greedy decoding are deterministic");
    assert_eq!(String::from_utf8_lossy(&ids.stdout).trim().split(',').count(), 4);
}

#[test]
fn bad_input_fails_cleanly_with_a_named_cause() {
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["generate".into(), "--model".into(), "/no/such/dir".into(), "--token-ids".into(), "1".into()], "/no/such/dir"),
        (vec!["generate".into(), "--model".into(), "synthetic:qwen3.5-70b".into(), "--token-ids".into(), "1".into()], "qwen3.5-70b"),
        (vec!["generate".into(), "--model".into(), tiny(), "--token-ids".into(), "1,99999".into()], "token id 99999"),
        (vec!["generate".into(), "--model".into(), tiny(), "--token-ids".into(), "1,x".into()], "\"x\" is not a token id"),
        (vec!["generate".into(), "--model".into(), tiny(), "--prompt".into(), "hi".into()], "no tokenizer.json"),
        (vec!["generate".into(), "--model".into(), tiny(), "--token-ids".into(), "1".into(), "--top-p".into(), "2".into()], "top_p 2"),
        (vec!["generate".into(), "--model".into(), tiny(), "--token-ids".into(), "1".into(), "--max-tokens".into(), "-3".into()], "--max-tokens"),
        (vec!["generate".into(), "--model".into(), tiny(), "--bogus".into()], "unknown option --bogus"),
        (vec!["verify".into(), "--model".into(), tiny(), "--reference".into(), "/no/ref.safetensors".into()], "/no/ref.safetensors"),
        (vec!["frobnicate".into()], "unknown command"),
    ];
    for (args, needle) in cases {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = tandem(&a);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: expected {needle:?} in {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}
