//! `tandem`: generate text with Qwen3.5, verify the engine against reference outputs.

mod args;
mod bench;

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use args::Args;
use tandem_core::chat::Message;
use tandem_core::generate::generate;
use tandem_core::load::LoadedModel;
use tandem_core::pool::Pool;
use tandem_core::sampling::{Sampler, SamplingParams};
use tandem_core::tokenizer::StreamDecoder;

const USAGE: &str = "\
tandem: Qwen3.5 inference, prefill and decode on their own engines

USAGE:
  tandem generate --model PATH|synthetic:NAME (--prompt TEXT [--chat] | --token-ids 1,2,3) [options]
  tandem verify   --model DIR --reference FILE
  tandem bench    [--model M] [--quant bf16,int8] [--quick] ...   (tandem bench --help)

MODELS:
  a Hugging Face Qwen3.5 checkpoint directory (config.json + safetensors), or
  synthetic:qwen3.5-0.8b | synthetic:qwen3.5-2b | synthetic:qwen3.5-9b (real shapes, random weights)

ENGINE OPTIONS (generate, verify):
  --threads N            worker threads (default: all cores)
  --cores 0,1            pin one worker to each listed core instead
  --quant int8           weight-only int8 (per-row scales), quantized at load; default: as stored
  --isa avx512|avx2|portable
                         cap the kernels' instruction set (default: the best this CPU has)

GENERATE OPTIONS:
  --prompt TEXT          prompt text (tokenized with the model's tokenizer.json)
  --chat                 wrap --prompt as a user message in the model's chat template
  --system TEXT          system message (with --chat)
  --enable-thinking      open a <think> block in the generation prompt (with --chat)
  --token-ids 1,2,3      prompt as token ids instead of text
  --ids-out              print generated token ids (comma-separated) instead of text
  --max-tokens N         tokens to generate (default 128)
  --temperature T        0 = greedy (default 0)
  --top-k K              keep the K most likely tokens (default 0 = all)
  --top-p P              nucleus sampling mass (default 1.0)
  --seed S               sampling seed (default 0)

VERIFY:
  compares prefill logits, post-prompt states and a greedy continuation with a reference file
  (scripts/make_reference.py writes one for any checkpoint); exits 1 past the tolerances
  (logits 1e-3 absolute, states 1e-3 relative, greedy ids identical).
";

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let result = match argv.first().map(String::as_str) {
        Some("generate") => cmd_generate(&argv[1..]),
        Some("verify") => cmd_verify(&argv[1..]),
        Some("bench") => bench::run(&argv[1..]),
        Some("-h" | "--help" | "help") | None => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some("-V" | "--version") => {
            println!("tandem {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Some(other) => Err(anyhow::anyhow!("unknown command {other:?}\n\n{USAGE}")),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn wants_help(argv: &[String]) -> bool {
    argv.iter().any(|a| a == "--help" || a == "-h")
}

fn cmd_generate(argv: &[String]) -> Result<ExitCode> {
    if wants_help(argv) {
        print!("{USAGE}");
        return Ok(ExitCode::SUCCESS);
    }
    let args = Args::parse(
        argv,
        &["model", "prompt", "system", "token-ids", "max-tokens", "temperature", "top-k", "top-p", "seed", "threads", "cores", "quant", "isa"],
        &["chat", "ids-out", "enable-thinking"],
    )?;
    let params = SamplingParams {
        temperature: args.get("temperature", 0.0)?,
        top_k: args.get("top-k", 0)?,
        top_p: args.get("top-p", 1.0)?,
        seed: args.get("seed", 0)?,
    };
    params.validate()?;
    let max_tokens: usize = args.get("max-tokens", 128)?;
    let spec = args.required("model")?;

    let pool = make_pool(&args)?;
    let load_start = Instant::now();
    let model = load_model(spec, &args, &pool)?;
    let load_time = load_start.elapsed();

    let prompt: Vec<u32> = match (args.str("prompt"), args.str("token-ids")) {
        (Some(_), Some(_)) => bail!("give either --prompt or --token-ids, not both"),
        (None, None) => bail!("give a prompt: --prompt TEXT or --token-ids 1,2,3"),
        (None, Some(ids)) => parse_ids(ids)?,
        (Some(text), None) => {
            let tok = model.tokenizer.as_ref().with_context(|| format!("{spec} has no tokenizer.json: give --token-ids instead of --prompt"))?;
            let text = if args.flag("chat") {
                let mut messages = Vec::new();
                if let Some(sys) = args.str("system") {
                    messages.push(Message::new("system", sys));
                }
                messages.push(Message::new("user", text));
                model.chat_template.render(&messages, true, args.flag("enable-thinking"))?
            } else {
                text.to_string()
            };
            tok.encode(&text)?
        }
    };
    if let Some(&bad) = prompt.iter().find(|&&id| id as usize >= model.net.config.vocab_size) {
        bail!("token id {bad} is outside the model's vocabulary (ids 0..{})", model.net.config.vocab_size);
    }

    let ids_out = args.flag("ids-out") || model.tokenizer.is_none();
    let mut sampler = Sampler::new(params, model.sampleable_vocab());
    let mut stdout = std::io::stdout().lock();
    let mut decoder = StreamDecoder::new();
    let mut first = true;
    let (_, stats) = generate(&pool, &model.net, &prompt, max_tokens, &mut sampler, &model.stop_ids, |id| {
        if ids_out {
            write!(stdout, "{}{id}", if first { "" } else { "," })?;
        } else {
            let tok = model.tokenizer.as_ref().expect("text output needs a tokenizer");
            write!(stdout, "{}", decoder.push(tok, id)?)?;
        }
        first = false;
        stdout.flush()?;
        Ok(())
    })?;
    if let (false, Some(tok)) = (ids_out, model.tokenizer.as_ref()) {
        write!(stdout, "{}", decoder.finish(tok)?)?;
    }
    writeln!(stdout)?;
    let peak = tandem_core::state::peak_rss_bytes().map(|b| format!(" | peak RSS {:.2} GB", b as f64 / 1e9)).unwrap_or_default();
    eprintln!(
        "[{}] load {:.2} s | prompt {} tokens | TTFT {:.1} ms | prefill {:.1} tok/s | decode {:.2} tok/s ({} tokens, {}){peak}",
        model.name,
        load_time.as_secs_f64(),
        stats.prompt_tokens,
        stats.ttft.as_secs_f64() * 1e3,
        stats.prefill_tok_s(),
        stats.decode_tok_s(),
        stats.generated_tokens,
        if stats.stopped { "stop token" } else { "length" },
    );
    Ok(ExitCode::SUCCESS)
}

/// The engine's worker pool from `--threads N` or `--cores 0,1,...` (default: all cores).
pub(crate) fn make_pool(args: &Args) -> Result<Pool> {
    use tandem_core::kernels::{set_max_isa, Isa};
    match args.str("isa") {
        None | Some("avx512") => set_max_isa(Isa::Avx512),
        Some("avx2") => set_max_isa(Isa::Avx2),
        Some("portable") => set_max_isa(Isa::Portable),
        Some(other) => bail!("--isa {other:?}: choose avx512, avx2 or portable"),
    }
    match (args.str("threads"), args.str("cores")) {
        (Some(_), Some(_)) => bail!("give either --threads or --cores, not both"),
        (_, Some(list)) => {
            let cores = list
                .split(',')
                .map(|c| c.trim().parse::<usize>().map_err(|_| anyhow::anyhow!("--cores: {c:?} is not a core number")))
                .collect::<Result<Vec<_>>>()?;
            Pool::pinned(&cores)
        }
        (Some(_), None) => {
            let n: usize = args.get("threads", 1)?;
            if n == 0 {
                bail!("--threads must be at least 1");
            }
            Ok(Pool::new(n))
        }
        (None, None) => Ok(Pool::new(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))),
    }
}

/// Load a model and apply `--quant`.
fn load_model(spec: &str, args: &Args, pool: &Pool) -> Result<LoadedModel> {
    match args.str("quant") {
        None | Some("none") => LoadedModel::load(spec),
        Some("int8") => LoadedModel::load_int8(spec, pool),
        Some(other) => bail!("--quant {other:?}: supported are int8 and none"),
    }
}

fn parse_ids(s: &str) -> Result<Vec<u32>> {
    s.split(',')
        .map(|p| p.trim())
        .filter(|p| !p.is_empty())
        .map(|p| p.parse::<u32>().map_err(|_| anyhow::anyhow!("--token-ids: {p:?} is not a token id")))
        .collect()
}

fn cmd_verify(argv: &[String]) -> Result<ExitCode> {
    if wants_help(argv) {
        print!("{USAGE}");
        return Ok(ExitCode::SUCCESS);
    }
    let args = Args::parse(argv, &["model", "reference", "threads", "cores", "quant", "isa"], &[])?;
    let pool = make_pool(&args)?;
    let mut model = load_model(args.required("model")?, &args, &pool)?;
    let reference = Path::new(args.required("reference")?);
    let checks = tandem_core::verify::verify(&pool, &mut model.net, reference)?;
    let width = checks.iter().map(|c| c.item.len()).max().unwrap_or(0);
    for c in &checks {
        println!(
            "{} {:width$}  {}  (tolerance {:.0e}{})",
            if c.passed() { "ok  " } else { "FAIL" },
            c.item,
            c.detail,
            c.tolerance,
            if c.relative { " relative" } else { "" }
        );
    }
    let failed = checks.iter().filter(|c| !c.passed()).count();
    let worst = |rel: bool| checks.iter().filter(|c| c.relative == rel && !c.item.ends_with("ids")).map(|c| c.error).fold(0f32, f32::max);
    println!(
        "\n{} of {} checks within tolerance; largest logit error {:.2e}, largest relative state error {:.2e}",
        checks.len() - failed,
        checks.len(),
        worst(false),
        worst(true)
    );
    if failed > 0 {
        println!("FAIL: {failed} checks out of tolerance");
        return Ok(ExitCode::FAILURE);
    }
    println!("PASS");
    Ok(ExitCode::SUCCESS)
}
