//! `tandem`: generate text with Qwen3.5, chat, serve the OpenAI API, verify the engine against
//! reference outputs, and benchmark it.

mod args;
mod bench;
mod chat;
mod convert;
mod generate;
mod http_client;
mod quality;
mod router;
mod rss;
mod serve;

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Result};
use args::Args;
use tandem_core::model::load::LoadedModel;
use tandem_core::backend::cpu::pool::Pool;

const USAGE: &str = "\
tandem: Qwen3.5 inference, prefill and decode on their own engines

USAGE:
  tandem generate --model M (--prompt TEXT... | --prompts-file FILE | --token-ids 1,2,3) [options]
  tandem chat     --model M [--system TEXT] [options]
  tandem verify   --model DIR --reference FILE [--device cpu|cuda:N] [--precision exact|tensor-cores|fast]
  tandem bench    [--model M] [--quant bf16,int8,q4_k] [--quick] ...   (tandem bench --help)
  tandem serve    --model M [--port 8000] [engine options] ...    (tandem serve --help)
  tandem convert  --model M --out FILE.gguf [--quant q4_k]        (tandem convert --help)

MODELS:
  a Hugging Face Qwen3.5 checkpoint directory (config.json + safetensors), or
  a GGUF file as llama.cpp converts Qwen3.5 (architecture qwen35), or
  synthetic:qwen3.5-0.8b | synthetic:qwen3.5-2b | synthetic:qwen3.5-9b (real shapes, random weights)
  synthetic:tiny (the real vocabulary at small widths: tests and smoke runs)

ENGINES (generate, chat):
  --prefill PLACEMENT    the prefill engine, e.g. cpu:cores=0,dispatch=batched:32
  --decode PLACEMENT     the decode engine, e.g. cpu:cores=1
                         PLACEMENT = cpu[:cores=LIST|threads=N][,precision=exact|fast][,dispatch=MODE];
                         dispatch modes:
                         sequential | batched:N (fixed N-token dispatches, last one padded and
                         masked) | buckets:64,256,512 | dynamic (default); or
                         cuda[:N][,precision=exact|tensor-cores|fast][,state=f32|bf16][,graphs=on|off]
                         [,priority=high|normal][,dispatch=MODE] (README: Engines)
  --mode hybrid|prefill-engine|decode-engine
                         hybrid: prefill on one engine, the state crosses the bridge, decode on the
                         other (default when --prefill or --decode is given; cores 0 and 1 unless
                         placed); prefill-engine / decode-engine: that engine does both
  --transfer move|file[:DIR]|socket
                         how a hybrid state crosses (default move: no copy)
  --max-batch N          sequences decoded together in one step (default 8)
  --max-prefill-tokens N most prompt tokens prefilled in one forward: a CUDA engine packs the
                         prompts that wait into one, up to this many (default 8192); one
                         engine doing both (prefill-engine / decode-engine mode) applies this
                         many per step between decode steps, a longer prompt in chunks
                         (chunked prefill)
  --gpu-memory-utilization F | --kv-cache-memory SIZE
                         a GPU decode engine's paged K/V cache: what is left of this fraction of
                         the GPU's memory once the model is loaded, or this size (default: it
                         grows as the GPU allows; tandem serve: 0.9); a CPU decode engine's
                         memory budget: this size of K/V (default: no limit)
  --trace FILE           write a timeline of the engines' work (every prefill call, sampling and
                         decode step, with its size) in the Chrome trace format (Perfetto,
                         chrome://tracing; scripts/trace_summary.py sums it up)
  --threads N | --cores 0,1
                         without --prefill/--decode: one engine on N threads or these cores
                         (default: one engine on all cores)
  --quant int8|q8_0|q4_k|q5_k|q6_k
                         quantize the weights at load: int8 (per-row scales), or GGML's block
                         formats as GGUF files hold them (q4_k and q5_k: the LM head in Q6_K;
                         rows not a whole number of 256 in Q8_0); default: as stored
  --isa amx|avx512-dot|avx512|avx2|portable
                         cap the kernels' instruction set (default: the best this CPU has;
                         avx512-dot: with the BF16 and VNNI dot products; amx: and Intel's
                         AMX tiles for precision=fast prompts)

GENERATE OPTIONS:
  --prompt TEXT          a prompt (repeat for several; they run through the pipeline together)
  --prompts-file FILE    prompts, one per line
  --chat                 wrap each prompt as a user message in the model's chat template
  --system TEXT          system message (with --chat, and for chat)
  --enable-thinking      open a <think> block in the generation prompt (with --chat, and for chat)
  --token-ids 1,2,3      one prompt as token ids instead of text
  --ids-out              print generated token ids (comma-separated) instead of text
  --max-tokens N         tokens to generate (default 128; chat: 512)
  --temperature T        0 = greedy (default 0)
  --top-k K              keep the K most likely tokens (default 0 = all)
  --top-p P              nucleus sampling mass (default 1.0)
  --min-p P              leave out tokens less likely than P times the likeliest (default 0)
  --presence-penalty X   subtract X from the logits of tokens generated (default 0)
  --frequency-penalty X  subtract X per time generated (default 0)
  --repetition-penalty R divide positive logits of tokens seen (prompt and reply) by R, multiply
                         negative ones (default 1; in chat, the reply's tokens)
  --seed S               sampling seed (default 0)
  Per-request timings (queue, prefill, handoff and bridge, TTFT, decode tok/s) and the aggregate
  throughput go to stderr.

CHAT:
  an interactive conversation whose state is kept between turns: each turn prefills only its
  own tokens; the next turn's template is prefilled as soon as a reply ends, and in a terminal
  the message is prefilled while it is typed. From a pipe, each line is one message.

VERIFY:
  compares prefill logits, post-prompt states and a greedy continuation with a reference file
  (scripts/make_reference.py writes one for any checkpoint); exits 1 past the tolerances
  (logits: 2e-4 of the largest reference logit, at least 1e-3; states 1e-3 relative;
  greedy ids identical).
";

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let result = match argv.first().map(String::as_str) {
        Some("generate") if wants_help(&argv[1..]) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some("generate") => generate::run(&argv[1..]),
        Some("chat") if wants_help(&argv[1..]) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some("chat") => chat::run(&argv[1..]),
        Some("verify") => cmd_verify(&argv[1..]),
        Some("serve") if wants_help(&argv[1..]) => {
            print!("{}{}", serve::USAGE, router::USAGE);
            return ExitCode::SUCCESS;
        }
        Some("serve") => serve::run(&argv[1..]),
        Some("bench") => bench::run(&argv[1..]),
        Some("convert") => convert::run(&argv[1..]),
        // The receiving end of the cross-process bridge measurement (started by bench).
        Some("state-receive") => bench::pipeline::state_receive(&argv[1..]),
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

/// The engine's worker pool from `--threads N` or `--cores 0,1,...` (default: all cores).
pub(crate) fn make_pool(args: &Args) -> Result<Pool> {
    apply_isa(args)?;
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

/// `--isa`: cap the kernels' instruction set.
pub(crate) fn apply_isa(args: &Args) -> Result<()> {
    use tandem_core::backend::cpu::kernels::{set_max_isa, Isa};
    match args.str("isa") {
        None | Some("amx") => set_max_isa(Isa::Amx),
        Some("avx512-dot") => set_max_isa(Isa::Avx512Dot),
        Some("avx512") => set_max_isa(Isa::Avx512),
        Some("avx2") => set_max_isa(Isa::Avx2),
        Some("portable") => set_max_isa(Isa::Portable),
        Some(other) => bail!("--isa {other:?}: choose amx, avx512-dot, avx512, avx2 or portable"),
    }
    Ok(())
}

/// Load a model and apply `--quant` (and `--isa`); quantization runs on all cores.
pub(crate) fn load_model(spec: &str, args: &Args) -> Result<LoadedModel> {
    apply_isa(args)?;
    match args.str("quant") {
        None | Some("none") | Some("bf16") => LoadedModel::load(spec),
        Some(name) => {
            let quant = tandem_core::model::quant::Quant::parse(name)?;
            LoadedModel::load_quantized(spec, quant, &Pool::new(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)))
        }
    }
}

/// CPU engines read every weight in every decode step: where one of `engines` runs on the CPU,
/// a checkpoint's weights leave the file's pages for 2 MB pages of the process's own
/// (`Qwen35::copy_file_weights_into_huge_pages`; GPU engines only upload them). For the
/// long-running commands (serve, bench) only: the copy took 1.2-1.8 s of loading a 1.5 GB
/// checkpoint on 2 vCPUs (a lazy map takes 0.13 s) and raised the peak RSS by the largest
/// matrix, for decode 2-5% faster (docs/results/2026-11-29-cpu-decode-huge-pages.md), so
/// generate and chat start from the file's pages.
pub(crate) fn place_weights_for(model: &mut LoadedModel, engines: &[&tandem_core::engine::EngineSpec]) {
    if engines.iter().any(|e| e.device == tandem_core::engine::Device::Cpu) {
        model.net.copy_file_weights_into_huge_pages();
    }
}

/// `cuda` or `cuda:N` to the GPU ordinal N.
pub(crate) fn parse_cuda_device(s: &str) -> Result<usize> {
    match s.strip_prefix("cuda") {
        Some("") => Ok(0),
        Some(n) => n.strip_prefix(':').and_then(|n| n.parse().ok()).ok_or_else(|| anyhow::anyhow!("--device {s:?}: expected cpu, cuda or cuda:N")),
        None => bail!("--device {s:?}: expected cpu, cuda or cuda:N"),
    }
}

pub(crate) fn parse_ids(s: &str) -> Result<Vec<u32>> {
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
    let args = Args::parse(argv, &["model", "reference", "threads", "cores", "quant", "isa", "device", "precision"], &[])?;
    let pool = make_pool(&args)?;
    let mut model = load_model(args.required("model")?, &args)?;
    let reference = Path::new(args.required("reference")?);
    use tandem_core::backend::cuda::qwen35::{GpuQwen35, Precision};
    let (precision, fast) = match args.str("precision").unwrap_or("exact") {
        "exact" => (Precision::Exact, false),
        "tensor-cores" => (Precision::TensorCores, false),
        "fast" => (Precision::Fast, true),
        other => bail!("--precision {other:?}: exact (f32 products, the default), tensor-cores (products take bf16-rounded inputs) or fast (int8 inputs where the weights allow: the CPU engine's precision=fast, on a GPU tensor-cores with int8 inputs to the Q4_K/Q5_K/Q6_K decode products)"),
    };
    let checks = match args.str("device") {
        None | Some("cpu") if fast => {
            println!("device: cpu, precision fast (instruction set {:?})", tandem_core::backend::cpu::kernels::isa());
            let v = tandem_core::verify::verify_fast(&pool, &mut model.net, reference)?;
            println!("\nWhat each precision computes against the reference and against exact (reported; the pass/fail checks follow):\n");
            println!("| precision | against | largest prefill logit error | top-1 agreement (prefill) | greedy ids (the other's fed back) | largest decode logit error | largest relative state error |");
            println!("|---|---|---|---|---|---|---|");
            for (name, against, checks) in &v.costs {
                println!("{}", cost_row(name, against, checks));
            }
            println!("\nprecision=fast against its arithmetic by plain kernels (bf16 weights: the exact kernels on bf16-rounded inputs, the tensor-core emulation of --precision tensor-cores, the order of f32 sums apart; int8 weights: the W8A8 scalar reference, bit for bit; k-quant blocks: the W4A8 decode reference, bit for bit):\n");
            v.checks
        }
        None | Some("cpu") => {
            if precision == Precision::TensorCores {
                // The CPU engine computing as the GPU's tensor-core prefill does.
                println!("device: cpu, precision TensorCores (the inputs of every product rounded to bf16)");
                model.net.set_cpu_precision(tandem_core::backend::cpu::CpuPrecision::Bf16Inputs);
            }
            tandem_core::verify::verify(&pool, &mut model.net, reference)?
        }
        Some(device) => {
            let ordinal = parse_cuda_device(device)?;
            let gpu = tandem_core::backend::cuda::Gpu::open(ordinal)?;
            println!("device: cuda:{ordinal} ({}), precision {precision:?}", gpu.name);
            let mut g = GpuQwen35::upload(gpu, &model.net, precision)?;
            tandem_core::verify::verify_cuda(&mut g, &mut model.net, reference)?
        }
    };
    let width = checks.iter().map(|c| c.item.len()).max().unwrap_or(0);
    for c in &checks {
        println!(
            "{} {:width$}  {}  (tolerance {:.1e}{})",
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
    let quant = args.str("quant").filter(|q| !matches!(*q, "none" | "bf16"));
    if let (Some(name), true) = (quant, Path::new(args.required("model")?).is_dir()) {
        // What the quantization changes, beside the checks: the same prompts through the
        // stored weights.
        println!("\n{name} against the stored weights on the reference's prompts:\n");
        println!("| prompt | positions | top-1 agreement (prefill logits) | largest logit difference | greedy ids identical |");
        println!("|---|---|---|---|---|");
        for row in quality::quantized_vs_stored(&pool, args.required("model")?, tandem_core::model::quant::Quant::parse(name)?, reference)? {
            println!("{row}");
        }
    }
    if failed > 0 {
        println!("FAIL: {failed} checks out of tolerance");
        return Ok(ExitCode::FAILURE);
    }
    println!("PASS");
    Ok(ExitCode::SUCCESS)
}

/// One precision's checks against a reference, summed over its prompts as a table row.
fn cost_row(name: &str, against: &str, checks: &[tandem_core::verify::Check]) -> String {
    let of = |part: &'static str| checks.iter().filter(move |c| c.item.contains(part));
    let largest = |part: &'static str| of(part).map(|c| c.error).fold(0f32, f32::max);
    let count = |part: &'static str| of(part).filter_map(|c| c.top1).fold((0, 0), |(a, n), (b, m)| (a + b, n + m));
    let pct = |(a, n): (usize, usize)| format!("{a}/{n} ({:.1}%)", 100.0 * a as f64 / n.max(1) as f64);
    let states = checks.iter().filter(|c| c.relative).map(|c| c.error).fold(0f32, f32::max);
    format!(
        "| {name} | {against} | {:.2e} | {} | {} | {:.2e} | {states:.2e} |",
        largest("prefill logits"),
        pct(count("prefill logits")),
        pct(count("greedy ids")),
        largest("greedy decode logits")
    )
}

/// A duration in milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}
