//! The command line: a small parser (`--name value`, `--name=value` and boolean `--flag`s,
//! with errors that name the flag; enough for tandem's subcommands without a parser
//! dependency), and the engine and sampling options that generate, chat and serve share.

use std::collections::HashMap;
use std::path::PathBuf;
use std::str::FromStr;

use anyhow::{bail, Context, Result};
use tandem_core::bridge::Transfer;
use tandem_core::engine::{Dispatch, EngineSpec};
use tandem_core::pipeline::{KvBudget, Mode, PipelineConfig};
use tandem_core::sampling::{Penalties, SamplingParams};

pub struct Args {
    values: HashMap<String, Vec<String>>,
    flags: Vec<String>,
}

impl Args {
    /// Parse `argv` given the names of the options that take a value and of the boolean flags.
    pub fn parse(argv: &[String], with_value: &[&str], booleans: &[&str]) -> Result<Args> {
        Self::parse_with_lists(argv, with_value, &[], booleans)
    }

    /// Like `parse`, where the options named in `lists` may be given more than once.
    pub fn parse_with_lists(argv: &[String], with_value: &[&str], lists: &[&str], booleans: &[&str]) -> Result<Args> {
        let mut values = HashMap::new();
        let mut flags = Vec::new();
        let mut it = argv.iter();
        while let Some(a) = it.next() {
            let Some(name) = a.strip_prefix("--") else {
                bail!("unexpected argument {a:?} (options start with --; see --help)");
            };
            let (name, inline) = match name.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (name, None),
            };
            if with_value.contains(&name) || lists.contains(&name) {
                let v = match inline {
                    Some(v) => v,
                    None => it.next().with_context(|| format!("--{name} needs a value"))?.clone(),
                };
                let given: &mut Vec<String> = values.entry(name.to_string()).or_default();
                if !given.is_empty() && !lists.contains(&name) {
                    bail!("--{name} given twice");
                }
                given.push(v);
            } else if booleans.contains(&name) {
                if inline.is_some() {
                    bail!("--{name} takes no value");
                }
                flags.push(name.to_string());
            } else {
                bail!("unknown option --{name} (see --help)");
            }
        }
        Ok(Args { values, flags })
    }

    pub fn flag(&self, name: &str) -> bool {
        self.flags.iter().any(|f| f == name)
    }

    pub fn str(&self, name: &str) -> Option<&str> {
        self.values.get(name).and_then(|v| v.first()).map(String::as_str)
    }

    /// Every value of a list option, in order.
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.values.get(name).map(|v| v.iter().map(String::as_str).collect()).unwrap_or_default()
    }

    pub fn required(&self, name: &str) -> Result<&str> {
        self.str(name).with_context(|| format!("--{name} is required"))
    }

    /// A parsed value, or `default` when the option is absent.
    pub fn get<T: FromStr>(&self, name: &str, default: T) -> Result<T> {
        match self.str(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| anyhow::anyhow!("--{name} {v:?} is not a valid {}", std::any::type_name::<T>())),
        }
    }
}

/// Options of every command that runs the pipeline (generate, chat).
pub const ENGINE_OPTIONS: [&str; 13] = ["threads", "cores", "quant", "isa", "prefill", "decode", "mode", "transfer", "max-batch", "max-prefill-tokens", "gpu-memory-utilization", "kv-cache-memory", "trace"];

/// The pipeline asked for on the command line. Without `--prefill`/`--decode` one engine does
/// everything (on `--threads`/`--cores`, default all cores); with them, the default mode is
/// hybrid.
pub fn pipeline_config(args: &Args) -> Result<PipelineConfig> {
    let split = args.str("prefill").is_some() || args.str("decode").is_some();
    if split && (args.str("threads").is_some() || args.str("cores").is_some()) {
        bail!("give engine placements (--prefill/--decode) or --threads/--cores for a single engine, not both");
    }
    let mode = match args.str("mode") {
        Some(m) => Mode::parse(m)?,
        None if split => Mode::Hybrid,
        None => Mode::AllOnDecodeEngine,
    };
    let single = single_engine(args)?;
    let placement = |name: &str, hybrid_default: &str| -> Result<EngineSpec> {
        match args.str(name) {
            Some(p) => EngineSpec::parse(p).with_context(|| format!("--{name}")),
            None if mode == Mode::Hybrid => EngineSpec::parse(hybrid_default),
            None => Ok(single.clone()),
        }
    };
    let config = PipelineConfig {
        mode,
        prefill: placement("prefill", "cpu:cores=0")?,
        decode: placement("decode", "cpu:cores=1")?,
        transfer: Transfer::parse(args.str("transfer").unwrap_or("move"))?,
        max_batch: args.get("max-batch", 8)?,
        max_prefill_tokens: args.get("max-prefill-tokens", PipelineConfig::MAX_PREFILL_TOKENS)?,
        kv_cache: kv_budget(args, KvBudget::Unlimited)?,
        trace: args.str("trace").map(PathBuf::from),
        prefix_cache_device: 0,
        device_snapshots: false,
    };
    if config.max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    if config.max_prefill_tokens == 0 {
        bail!("--max-prefill-tokens must be at least 1");
    }
    if mode != Mode::Hybrid && args.str("transfer").is_some() {
        bail!("--transfer applies to the hybrid mode only (mode {})", mode.name());
    }
    Ok(config)
}

/// `512MiB`, `2GiB`, `1.5G`, `100000` (bytes), `0`.
pub fn parse_size(option: &str, s: &str) -> Result<usize> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.trim().parse().map_err(|_| anyhow::anyhow!("--{option} {s:?}: expected a size such as 512MiB or 4GiB"))?;
    let scale = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        _ => bail!("--{option} {s:?}: unknown unit {unit:?} (use B, KiB, MiB or GiB)"),
    };
    if !(n >= 0.0 && n.is_finite()) {
        bail!("--{option} {s:?} must be a size of 0 or more");
    }
    Ok((n * scale) as usize)
}

/// The K/V budget of `--gpu-memory-utilization F` or `--kv-cache-memory SIZE` (not both), else
/// `default`.
pub fn kv_budget(args: &Args, default: KvBudget) -> Result<KvBudget> {
    match (args.str("gpu-memory-utilization"), args.str("kv-cache-memory")) {
        (Some(_), Some(_)) => bail!("give --gpu-memory-utilization or --kv-cache-memory, not both"),
        (Some(f), None) => match f.trim().parse::<f64>() {
            Ok(f) if f > 0.0 && f <= 1.0 => Ok(KvBudget::GpuFraction(f)),
            _ => bail!("--gpu-memory-utilization {f:?}: give a fraction of the GPU's memory above 0 and at most 1, such as 0.9"),
        },
        (None, Some(b)) => Ok(KvBudget::Bytes(parse_size("kv-cache-memory", b)?)),
        (None, None) => Ok(default),
    }
}

/// The one engine of `--threads N` / `--cores LIST` (default: all cores).
fn single_engine(args: &Args) -> Result<EngineSpec> {
    let spec = match (args.str("threads"), args.str("cores")) {
        (Some(_), Some(_)) => bail!("give either --threads or --cores, not both"),
        (Some(n), None) => format!("cpu:threads={n}"),
        (None, Some(c)) => format!("cpu:cores={c}"),
        (None, None) => "cpu".into(),
    };
    let mut p = EngineSpec::parse(&spec)?;
    p.dispatch = Dispatch::Dynamic;
    Ok(p)
}

/// `--temperature`, `--top-k`, `--top-p`, `--min-p`, `--seed` and the penalties (the
/// repetition penalty's prompt tokens are set per request).
pub fn sampling(args: &Args) -> Result<SamplingParams> {
    let params = SamplingParams {
        temperature: args.get("temperature", 0.0)?,
        top_k: args.get("top-k", 0)?,
        top_p: args.get("top-p", 1.0)?,
        min_p: args.get("min-p", 0.0)?,
        seed: args.get("seed", 0)?,
        penalties: Penalties { presence: args.get("presence-penalty", 0.0)?, frequency: args.get("frequency-penalty", 0.0)?, repetition: args.get("repetition-penalty", 1.0)?, ..Default::default() },
        ..Default::default()
    };
    params.validate()?;
    Ok(params)
}

/// The options `sampling` reads.
pub const SAMPLING_OPTIONS: [&str; 8] = ["temperature", "top-k", "top-p", "min-p", "seed", "presence-penalty", "frequency-penalty", "repetition-penalty"];
