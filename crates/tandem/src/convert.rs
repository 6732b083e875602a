//! `tandem convert`: a model (a checkpoint, a GGUF file or a synthetic one) written as a GGUF
//! file, laid out as llama.cpp's converter lays Qwen3.5 out, its matrices as stored or in the
//! block format of `--quant` (q8_0, q4_k, q5_k, q6_k: the blocks the local runners read), with
//! its tokenizer, chat template and end-of-sequence id. tandem loads the file back into the
//! same weights, bit for bit.

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Result};

use crate::args::Args;
use tandem_core::model::gguf::write::{qwen35, Extras};

pub const USAGE: &str = "\
tandem convert --model M --out FILE.gguf [--quant q8_0|q4_k|q5_k|q6_k]

Writes the model as a GGUF file (architecture qwen35): the matrices as stored (bf16) or in the
block format of --quant (q4_k and q5_k: the LM head in Q6_K; rows that are not whole 256-value
blocks in Q8_0), the norms and the DeltaNet's decay and conv in f32, the tokenizer as
tokenizer.ggml.*, the chat template and the end-of-sequence id.
";

pub fn run(argv: &[String]) -> Result<ExitCode> {
    if argv.iter().any(|a| a == "--help" || a == "-h") {
        print!("{USAGE}");
        return Ok(ExitCode::SUCCESS);
    }
    let args = Args::parse(argv, &["model", "out", "quant", "threads", "isa"], &[])?;
    let out = Path::new(args.required("out")?);
    if args.str("quant") == Some("int8") {
        bail!("--quant int8 (row scales) is not a GGUF type; write q8_0 instead");
    }
    let t = Instant::now();
    let model = crate::load_model(args.required("model")?, &args)?;
    let json = model.tokenizer.as_ref().map(|t| t.to_json()).transpose()?;
    let extras = Extras {
        tokenizer_json: json.as_deref().map(str::as_bytes),
        chat_template: Some(&model.chat_template.source),
        eos_token_id: model.stop_ids.first().copied(),
    };
    qwen35(&model.net, &extras)?.write(out)?;
    let size = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    eprintln!("wrote {} ({:.2} GB, {}) in {:.1} s", out.display(), size as f64 / 1e9, model.net.matrix_formats(), t.elapsed().as_secs_f64());
    Ok(ExitCode::SUCCESS)
}
