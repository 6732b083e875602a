//! The `tandem` command as a user runs it.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

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

/// `verify --precision fast`: the table of what each precision costs, then the checks of fast
/// against its own arithmetic, which pass; a GPU is told that fast is the CPU's.
#[test]
fn verify_fast_reports_its_error_and_passes_against_its_arithmetic() {
    let reference = format!("{}/reference.safetensors", tiny());
    let o = tandem(&["verify", "--model", &tiny(), "--reference", &reference, "--precision", "fast"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    for row in ["| exact | the reference |", "| fast | the reference |", "| fast | exact |", "| fast's arithmetic, plain kernels | exact |"] {
        assert!(out.contains(row), "no row {row:?}: {out}");
    }
    assert!(out.contains("95 of 95 checks within tolerance") && out.trim_end().ends_with("PASS"), "{out}");
    let o = tandem(&["verify", "--model", &tiny(), "--reference", &reference, "--precision", "fp8"]);
    assert!(!o.status.success() && stderr(&o).contains("\"fp8\": exact") && stderr(&o).contains("or fast"), "{}", stderr(&o));
}

/// A GGUF file of the fixture, as llama.cpp's converter writes Qwen3.5: `verify` passes on it
/// and `generate` prints the checkpoint's ids, in one engine and across the hybrid bridge.
#[test]
fn a_gguf_file_verifies_and_generates_as_its_checkpoint() {
    let gguf = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf/qwen35-tiny-bf16.gguf").to_string_lossy().into_owned();
    let reference = format!("{}/reference.safetensors", tiny());
    let o = tandem(&["verify", "--model", &gguf, "--reference", &reference]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && out.contains("95 of 95 checks within tolerance"), "{out}\n{}", stderr(&o));
    let ids = |model: &str, extra: &[&str]| {
        let mut args = vec!["generate", "--model", model, "--token-ids", "3,141,59,26,535", "--max-tokens", "12", "--ids-out"];
        args.extend(extra);
        let o = tandem(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or_default().to_string()
    };
    let want = ids(&tiny(), &[]);
    assert_eq!(want.split(',').count(), 12, "{want}");
    assert_eq!(ids(&gguf, &[]), want);
    assert_eq!(ids(&gguf, &["--prefill", "cpu:cores=0", "--decode", "cpu:cores=0"]), want);
}

#[test]
fn generate_from_token_ids_prints_ids_and_a_summary() {
    // The tiny checkpoint has no tokenizer: ids in, ids out. Greedy ids of fixture prompt p1.
    let o = tandem(&["generate", "--model", &tiny(), "--token-ids", "776,245,774,185,362,826,848", "--max-tokens", "5"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "294,115,733,707,844");
    let err = stderr(&o);
    for field in ["TTFT ms", "prefill ms", "decode/s", "aggregate: 1 requests, 7 prompt tokens, 5 generated"] {
        assert!(err.contains(field), "summary lacks {field}: {err}");
    }
}

#[test]
fn several_prompts_through_a_hybrid_pipeline_give_the_single_engine_tokens() {
    let dir = std::env::temp_dir().join(format!("tandem-cli-prompts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Token ids in a prompts file need a tokenizer; use the synthetic model's real one.
    let file = dir.join("prompts.txt");
    std::fs::write(&file, "The tandem bicycle\n\nA second prompt, longer than the first one\n").unwrap();
    let single = tandem(&["generate", "--model", "synthetic:qwen3.5-0.8b", "--prompts-file", file.to_str().unwrap(), "--max-tokens", "3", "--ids-out"]);
    assert!(single.status.success(), "{}", stderr(&single));
    let hybrid = tandem(&[
        "generate", "--model", "synthetic:qwen3.5-0.8b", "--prompts-file", file.to_str().unwrap(), "--max-tokens", "3", "--ids-out",
        "--prefill", "cpu:threads=1,dispatch=batched:4", "--decode", "cpu:threads=1", "--transfer", &format!("file:{}", dir.display()),
    ]);
    assert!(hybrid.status.success(), "{}", stderr(&hybrid));
    let out = String::from_utf8_lossy(&single.stdout).to_string();
    assert!(out.contains("### request 1") && out.contains("### request 2"), "{out}");
    // Requests may finish in either order; compare them request by request.
    let parts = |s: &str| {
        let mut v: Vec<String> = s.split("### request ").filter(|p| !p.trim().is_empty()).map(|p| p.trim().to_string()).collect();
        v.sort();
        v
    };
    assert_eq!(parts(&out), parts(&String::from_utf8_lossy(&hybrid.stdout)));
    let err = stderr(&hybrid);
    assert!(err.contains("hybrid") && err.contains("bridge s+r+rb ms") && err.contains("aggregate: 2 requests"), "{err}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1, "state files are removed");
}

#[test]
fn chat_from_a_pipe_answers_each_line_with_its_ttft() {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["chat", "--model", "synthetic:qwen3.5-0.8b", "--max-tokens", "2", "--threads", "2"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"Hello\nAnd again\n").unwrap();
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(err.matches("[TTFT").count(), 2, "{err}");
    // The second turn reused what was prefilled before it was sent (its scaffolding).
    assert!(err.lines().filter(|l| l.contains("[TTFT")).nth(1).is_some_and(|l| !l.contains("| 0 of")), "{err}");
}

#[test]
fn synthetic_model_generates_text_from_a_chat_prompt() {
    let o = tandem(&["generate", "--model", "synthetic:qwen3.5-0.8b", "--prompt", "hello", "--chat", "--max-tokens", "3", "--temperature", "0.8", "--seed", "3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!o.stdout.is_empty());
    // <|im_start|> user \n hello <|im_end|> \n <|im_start|> assistant \n, then thinking is off
    // by default: <think> \n\n </think> \n\n. 13 tokens.
    assert!(stderr(&o).contains("aggregate: 1 requests, 13 prompt tokens"), "{}", stderr(&o));
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
        (vec!["generate".into(), "--model".into(), tiny(), "--prompt".into(), "hi".into()], "has no tokenizer.json"),
        (vec!["generate".into(), "--model".into(), format!("{}/../gguf/qwen35-tiny-bf16.gguf", tiny()), "--prompt".into(), "hi".into()], "has no tokenizer (tokenizer.ggml.* metadata)"),
        (vec!["generate".into(), "--model".into(), tiny(), "--token-ids".into(), "1".into(), "--top-p".into(), "2".into()], "top_p 2"),
        (vec!["generate".into(), "--model".into(), tiny(), "--token-ids".into(), "1".into(), "--max-tokens".into(), "-3".into()], "--max-tokens"),
        (vec!["generate".into(), "--model".into(), tiny(), "--bogus".into()], "unknown option --bogus"),
        (vec!["generate".into(), "--model".into(), tiny(), "--token-ids".into(), "1".into(), "--prefill".into(), "gpu:0".into()], "unknown backend"),
        (vec!["generate".into(), "--model".into(), tiny(), "--token-ids".into(), "1".into(), "--mode".into(), "both".into()], "unknown mode"),
        (vec!["generate".into(), "--model".into(), tiny(), "--token-ids".into(), "1".into(), "--transfer".into(), "pigeon".into(), "--decode".into(), "cpu".into()], "unknown transfer"),
        (vec!["generate".into(), "--model".into(), tiny(), "--token-ids".into(), "1".into(), "--decode".into(), "cpu:cores=99".into()], "core 99"),
        (vec!["generate".into(), "--model".into(), tiny(), "--prompts-file".into(), "/no/prompts.txt".into()], "/no/prompts.txt"),
        (vec!["verify".into(), "--model".into(), tiny(), "--reference".into(), "/no/ref.safetensors".into()], "/no/ref.safetensors"),
        (vec!["frobnicate".into()], "unknown command"),
        (vec!["serve".into(), "--role".into(), "scheduler".into()], "--role \"scheduler\""),
        (vec!["serve".into(), "--role".into(), "decode".into(), "--model".into(), "synthetic:tiny".into(), "--port".into(), "0".into()], "give --router"),
        (vec!["serve".into(), "--role".into(), "prefill".into(), "--model".into(), "synthetic:tiny".into(), "--port".into(), "0".into(), "--router".into(), "10.0.0.1:80".into()], "expected http://HOST:PORT"),
        (vec!["serve".into(), "--role".into(), "router".into(), "--prefill-placement".into(), "sometimes".into()], "--prefill-placement \"sometimes\""),
        (vec!["bench".into(), "--sections".into(), "modes,tables".into()], "unknown section \"tables\""),
        (vec!["bench".into(), "--quant".into(), "fp4".into()], "--quant \"fp4\""),
        (vec!["bench".into(), "--sections".into(), "dispatch".into(), "--out".into(), std::env::temp_dir().join("tandem-cli-bad-bench").to_string_lossy().into_owned(), "--prefill".into(), "cpu:cores=99".into(), "--model".into(), tiny(), "--quick".into()], "core 99"),
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

/// The study's tables as `tandem bench` writes them: the Markdown report on stdout and in the
/// output folder, every raw run in runs.json (counted per section), the plots as SVG files.
/// The tiny fixture keeps it to seconds; the multi-turn table needs a tokenizer, so it runs in
/// CI's `bench --quick` on the synthetic model instead.
#[test]
fn bench_writes_the_study_tables_their_raw_runs_and_plots() {
    let dir = std::env::temp_dir().join(format!("tandem-cli-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let o = tandem(&[
        "bench", "--quick", "--model", &tiny(), "--sections", "energy,modes,dispatch,crossover,concurrency,placement", "--prefill", "cpu:threads=1,dispatch=batched:4",
        "--decode", "cpu:threads=1", "--quant", "int8", "--out", dir.to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    // Sections in the report's order whatever order they were asked in.
    let at = |h: &str| out.find(h).unwrap_or_else(|| panic!("no {h:?} in {out}"));
    assert!(at("## Two CPU engines at once") < at("## Decode by cores") && at("## Decode by cores") < at("## Modes"));
    assert!(at("## Modes") < at("## Batched against sequential dispatch") && at("## Concurrency") < at("## Crossover") && at("## Crossover") < at("## Energy"));
    // Placement: each engine alone and beside the other, and decode by cores with its verdict.
    for row in ["| decode | tok/s, one sequence |", "| decode | GB/s (", "| prefill | tok/s, 74-token prompt |", "| 1 | "] {
        assert!(out.contains(row), "no {row:?} in {out}");
    }
    assert!(out.contains("The fewest cores whose decode reads at 90%") || out.contains("No number of cores measured decodes at 90%"), "{out}");
    assert_eq!(std::fs::read_to_string(dir.join("report.md")).unwrap(), out);
    // The two-engine sections run the --quant format.
    assert!(out.contains("| two-engine sections | prefill engine cpu:threads=1,dispatch=batched:4, decode engine cpu:threads=1,dispatch=dynamic, int8 weights |"), "{out}");
    // The dispatch table: 74 one-token dispatches, then three of 32 (22 rows padded), then one.
    for row in ["| sequential | 74 | 74 (0) |", "| batched:32 | 3 | 96 (22) |", "| dynamic | 1 | 74 (0) |"] {
        assert!(out.contains(row), "no {row:?} in {out}");
    }
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("runs.json")).unwrap()).unwrap();
    assert_eq!(doc["complete"], true);
    assert_eq!(doc["prefill_engine"], "cpu:threads=1,dispatch=batched:4");
    let runs = doc["runs"].as_array().unwrap();
    let count = |section: &str| runs.iter().filter(|r| r["section"] == section).count();
    // --quick: one repetition; modes: 3 modes x 2 prompts; dispatch: 3; crossover: 2 engines x
    // 3 lengths; concurrency: 4 decode-step runs and 4 pipeline runs.
    assert_eq!((count("modes"), count("dispatch"), count("crossover"), count("concurrency")), (6, 3, 6, 8), "{doc}");
    // Placement: one repetition of the two engines, then one decode per count of cores.
    let placement: Vec<&serde_json::Value> = runs.iter().filter(|r| r["section"] == "placement").collect();
    assert!(placement.len() >= 2 && placement[0]["decode_beside_tok_s"].as_f64().unwrap() > 0.0 && placement[0]["prefill_beside_tok_s"].as_f64().unwrap() > 0.0, "{doc}");
    assert!(placement[1..].iter().all(|r| r["decode_tok_s"].as_f64().unwrap() > 0.0), "{doc}");
    for r in runs.iter().filter(|r| r["section"] == "modes") {
        assert!(r["ttft_ms"].as_f64().unwrap() > 0.0 && r["generated"] == 8, "{r}");
    }
    for plot in ["modes.svg", "crossover.svg", "concurrency.svg"] {
        let svg = std::fs::read_to_string(dir.join(plot)).unwrap_or_else(|e| panic!("{plot}: {e}"));
        assert!(svg.starts_with("<svg") && svg.matches("<circle").count() >= 6, "{plot}: {svg}");
    }
    // Energy: figures where a counter can be read, else the reason for each counter.
    let energy = &out[at("## Energy")..];
    assert!(energy.contains("joules per token") || (energy.contains("No power counter") && energy.contains("RAPL")), "{energy}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The golden fixture on the GPU, through the CLI as a user runs it; where no NVIDIA driver is
/// installed, the CLI's refusal of the GPU instead: an error that names the missing driver,
/// never a panic.
#[test]
fn verify_on_a_gpu_passes_or_says_why_there_is_none() {
    let reference = format!("{}/reference.safetensors", tiny());
    let o = tandem(&["verify", "--model", &tiny(), "--reference", &reference, "--device", "cuda:0"]);
    let (out, err) = (String::from_utf8_lossy(&o.stdout), stderr(&o));
    if let Some(why) = tandem_core::backend::cuda::driver_missing() {
        eprintln!("no NVIDIA driver ({why}): checked the refusal, not the GPU");
        assert!(!o.status.success() && err.contains("libcuda.so") && !err.contains("panicked"), "{err}");
        return;
    }
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("95 of 95 checks within tolerance") && out.trim_end().ends_with("PASS"), "{out}");
}

#[test]
fn a_bad_device_name_is_refused_by_name() {
    let reference = format!("{}/reference.safetensors", tiny());
    let o = tandem(&["verify", "--model", &tiny(), "--reference", &reference, "--device", "gpu7"]);
    assert!(!o.status.success() && stderr(&o).contains("--device \"gpu7\""), "{}", stderr(&o));
}

/// A GPU placement through the pipeline, as a user runs it: prefill on the GPU, decode on the
/// CPU, the reference's greedy ids (fixture prompt p1); without an NVIDIA driver, the CLI's
/// refusal instead: an error naming the engine and the driver.
#[test]
fn a_gpu_placement_generates_or_says_why_there_is_none() {
    let o = tandem(&[
        "generate", "--model", &tiny(), "--token-ids", "776,245,774,185,362,826,848", "--max-tokens", "5",
        "--prefill", "cuda:0,precision=exact", "--decode", "cpu:threads=1",
    ]);
    let err = stderr(&o);
    if let Some(why) = tandem_core::backend::cuda::driver_missing() {
        eprintln!("no NVIDIA driver ({why}): checked the refusal, not the GPU");
        assert!(!o.status.success() && err.contains("prefill engine") && err.contains("libcuda.so") && !err.contains("panicked"), "{err}");
        return;
    }
    assert!(o.status.success(), "{err}");
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "294,115,733,707,844");
}

/// A decode worker asked for NIXL where its libraries cannot be loaded (or, built without
/// NIXL, a build without it) fails at once with what is missing and how to install it; a
/// prefill worker is told its option is not its own.
#[test]
fn a_worker_without_nixl_says_what_is_missing() {
    let o = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["serve", "--role", "decode", "--state-transfer", "nixl", "--model", "synthetic:tiny", "--port", "0", "--router", "http://127.0.0.1:9"])
        .env("TANDEM_NIXL_LIB", "/no/such/libnixl_capi.so")
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("--state-transfer") && err.contains("scripts/nixl.sh"), "{err}");
    if cfg!(feature = "nixl") {
        assert!(err.contains("/no/such/libnixl_capi.so"), "{err}");
    }
    for (args, want) in [(vec!["--role", "prefill", "--state-transfer", "stream"], "a decode worker's option"), (vec!["--role", "decode", "--state-transfer", "carrier-pigeon"], "nixl, stream or file[:DIR]"), (vec!["--role", "decode", "--state-transfer", "file:/no/such/dir"], "not a directory")] {
        let o = Command::new(env!("CARGO_BIN_EXE_tandem")).args(["serve", "--model", "synthetic:tiny", "--port", "0", "--router", "http://127.0.0.1:9"]).args(&args).output().unwrap();
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// The serving bench end to end: a real `tandem serve` child, streamed requests at two
/// concurrencies and a Poisson rate, every request answered, every slot back after each point.
#[test]
fn the_serving_bench_drives_a_real_server_and_gets_every_slot_back() {
    let o = tandem(&[
        "bench", "--sections", "serve", "--model", "synthetic:tiny", "--threads", "1", "--max-concurrent", "3",
        "--concurrency", "1,3", "--rates", "20", "--requests", "6", "--input-len", "12", "--output-len", "5",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("| concurrency ") || l.starts_with("| 20 req/s")).collect();
    assert_eq!(rows.len(), 3, "{out}");
    for row in rows {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        // load, requests, failed, ..., slots free after, K/V blocks and state slots (a GPU
        // engine's), swaps, the engines' busy shares.
        assert_eq!((cells[2], cells[3]), ("6", "0"), "{row}");
        assert_eq!(&cells[cells.len() - 6..cells.len() - 2], ["3/3", "- / -", "- / -", "0"], "{row}");
        let busy: Vec<f64> = cells[cells.len() - 2].split(" / ").map(|c| c.trim_end_matches('%').parse().unwrap_or(0.0)).collect();
        assert!(busy.len() == 2 && busy.iter().all(|&b| b > 0.0), "both engines worked: {row}");
        let tok_s: f64 = cells[5].parse().unwrap_or(0.0);
        assert!(tok_s > 0.0, "{row}");
        // The limit with the prefills' arithmetic is at most the decode-only one (equal as
        // printed, whole tokens a second, where a tiny model's prompts cost next to nothing).
        // It is not compared with what was served: the limit is from the memory bandwidth, and
        // the tiny model's weights stay in the CPU's caches (a machine with a large L3 served
        // 658 tok/s against a limit of 573).
        let (decode_limit, limit): (f64, f64) = (cells[12].parse().unwrap_or(0.0), cells[13].parse().unwrap_or(0.0));
        assert!(limit > 0.0 && limit <= decode_limit, "{row}");
    }
    let bad = tandem(&["bench", "--sections", "serve", "--concurrency", "0"]);
    assert!(!bad.status.success() && stderr(&bad).contains("--concurrency"), "{}", stderr(&bad));
}

/// The prefix-cache bench: every workload with the cache on and off, the cache covering
/// prompt tokens only when on and never more than the ideal, every request answered.
#[test]
fn the_prefix_cache_bench_measures_each_workload_on_and_off() {
    let o = tandem(&["bench", "--sections", "prefix-cache", "--quick", "--model", "synthetic:tiny", "--threads", "1"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    for workload in ["questions", "agent", "few-shot", "no reuse"] {
        for cache in ["on", "off"] {
            let row = out.lines().find(|l| l.starts_with(&format!("| {workload} | {cache} | 1 |"))).unwrap_or_else(|| panic!("no {workload} row, cache {cache}:\n{out}"));
            let cells: Vec<&str> = row.split('|').map(str::trim).collect();
            // (the empty cell before the first |), workload, cache, rep, requests, prompt
            // tokens, ideal, cached, of ideal, ...
            let n = |i: usize| cells[i].parse::<usize>().unwrap_or_else(|_| panic!("{row}"));
            let (requests, prompt, ideal, cached) = (n(4), n(5), n(6), n(7));
            assert!(requests > 0 && ideal <= prompt, "{row}");
            // One request at a time, no cache covers more than what finished requests applied.
            if workload != "agent" {
                assert!(cached <= ideal, "{row}");
            }
            match (workload, cache) {
                (_, "off") | ("no reuse", _) => assert_eq!(cached, 0, "nothing cached: {row}"),
                // The quick sizes share at least 150 tokens a prompt after the first.
                _ => assert!(cached * 10 >= ideal * 8, "most of the ideal is cached: {row}"),
            }
        }
    }
    assert!(out.contains("| questions alone | off | 1 |"), "{out}");
}

/// A model written by `tandem convert` (synthetic:tiny in Q8_0 blocks, its rows being too short
/// for Q4_K's, with the real Qwen3.5 tokenizer and chat template in the file's metadata) runs
/// from the GGUF file as from where it came: the same greedy ids from a text prompt through the
/// chat template (the tokenizer and template read from the file), and `tandem serve` on the file
/// answers a chat completion over HTTP with those ids.
#[test]
fn a_converted_gguf_file_chats_and_serves_as_its_source() {
    use std::io::{Read, Write};
    let dir = std::env::temp_dir().join(format!("tandem-convert-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let gguf = dir.join("tiny-q8_0.gguf").to_string_lossy().into_owned();
    let o = tandem(&["convert", "--model", "synthetic:tiny", "--quant", "q8_0", "--out", &gguf, "--threads", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("q8_0"), "{}", stderr(&o));
    let chat = |model: &str, quant: &[&str]| {
        let mut args = vec!["generate", "--model", model, "--prompt", "Hello there", "--chat", "--max-tokens", "6", "--ids-out", "--threads", "2"];
        args.extend(quant);
        let o = tandem(&args);
        assert!(o.status.success(), "{model}: {}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    let want = chat("synthetic:tiny", &["--quant", "q8_0"]);
    assert_eq!(want.split(',').count(), 6, "{want}");
    assert_eq!(chat(&gguf, &[]), want, "the GGUF file's model, tokenizer and template give other ids");
    // The server on the file.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let mut server = Command::new(env!("CARGO_BIN_EXE_tandem")).args(["serve", "--model", &gguf, "--port", &port, "--threads", "2"]).stderr(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap();
    let request = |method: &str, path: &str, body: &str| -> Option<String> {
        let mut s = std::net::TcpStream::connect(format!("127.0.0.1:{port}")).ok()?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(60))).ok()?;
        write!(s, "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some(out)
    };
    let started = std::time::Instant::now();
    while request("GET", "/health", "").is_none_or(|r| !r.starts_with("HTTP/1.1 200")) {
        assert!(started.elapsed().as_secs() < 120, "the server on {gguf} did not come up");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let reply = request("POST", "/v1/chat/completions", r#"{"messages":[{"role":"user","content":"Hello there"}],"max_tokens":6,"temperature":0,"return_token_ids":true}"#).unwrap();
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let body: serde_json::Value = serde_json::from_str(reply.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    let ids: Vec<String> = body["choices"][0]["token_ids"].as_array().unwrap_or_else(|| panic!("no token_ids in {body}")).iter().map(|v| v.to_string()).collect();
    assert_eq!(ids.join(","), want, "the server's reply: {body}");
}
