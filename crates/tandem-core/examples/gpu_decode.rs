//! One sequence's decode and a prompt's prefill on a GPU, for each weight format: the GPU's
//! copy bandwidth (a 1 GiB device-to-device copy), then per model and `--quant` format the
//! prefill of 512 tokens (tensor cores), the decode step replayed from its CUDA graph (the
//! GPU's time alone, and with the host picking each token), the weights it reads and their rate
//! against the bandwidth, each decode GEMV alone by kind, and a step's largest kernels. Every
//! line is printed as soon as it is measured (a long run cut short keeps what it had). Medians
//! of 5 (min - max). A format with `-fast` (`q4_k-fast`) runs GPU precision=fast (int8 inputs to
//! the k-quant decode GEMVs), the others tensor-cores; consecutive formats of the same weights
//! (`q4_k,q4_k-fast,q4_k`) share one load and upload.
//! `cargo run --release --example gpu_decode -p tandem-core MODEL[,MODEL] [bf16,q4_k,q4_k-fast,...]`
use std::time::Instant;

use tandem_core::backend::cpu::pool::Pool;
use tandem_core::backend::cuda::qwen35::{GpuQwen35, Precision};
use tandem_core::backend::cuda::Gpu;
use tandem_core::model::load::LoadedModel;
use tandem_core::model::quant::Quant;
use tandem_core::model::Logits;
use tandem_core::sampling::argmax;

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() -> anyhow::Result<()> {
    let models = std::env::args().nth(1).unwrap_or("synthetic:qwen3.5-0.8b".into());
    let formats = std::env::args().nth(2).unwrap_or("bf16,q4_k".into());
    let mut gpu = Some(Gpu::open(0)?);
    let g = gpu.as_ref().expect("opened");
    let bytes = 1usize << 30;
    let (src, mut dst) = (g.zeros::<u8>(bytes)?, g.zeros::<u8>(bytes)?);
    let mut copies = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        g.stream.memcpy_dtod(&src, &mut dst).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        g.synchronize()?;
        copies.push(2.0 * bytes as f64 / t.elapsed().as_secs_f64());
    }
    drop((src, dst));
    let (bandwidth, _, _) = stats(copies);
    println!("{}: device copy bandwidth {:.0} GB/s (1 GiB, read + write, median of 5)", g.name, bandwidth / 1e9);
    println!("| model | weights | MB read per step | prefill 512 tok/s | decode tok/s (GPU alone) | decode tok/s (host picks) | GB/s | of bandwidth |");
    println!("|---|---|---|---|---|---|---|---|");
    let pool = Pool::new(std::thread::available_parallelism().map_or(1, |n| n.get()));
    // The weights on the GPU now: (model, format without -fast) and the engine.
    let mut uploaded: Option<((String, String), GpuQwen35)> = None;
    for model in models.split(',') {
        for format in formats.split(',') {
            let (weights, precision) = match format.strip_suffix("-fast") {
                Some(w) => (w, Precision::Fast),
                None => (format, Precision::TensorCores),
            };
            let key = (model.to_string(), weights.to_string());
            let mut gp = match uploaded.take() {
                Some((k, gp)) if k == key => gp,
                other => {
                    if let Some((_, gp)) = other {
                        gpu = Some(gp.into_gpu());
                    }
                    let t = Instant::now();
                    let loaded = match weights {
                        "bf16" => LoadedModel::load(model)?,
                        q => LoadedModel::load_quantized(model, Quant::parse(q)?, &pool)?,
                    };
                    eprintln!("{model} {weights}: loaded in {:.1} s ({})", t.elapsed().as_secs_f64(), loaded.net.matrix_formats());
                    GpuQwen35::upload(gpu.take().expect("one GPU"), &loaded.net, precision)?
                }
            };
            gp.precision = precision;
            let vocab = gp.config.vocab_size.min(248044) as u32;
            let tokens: Vec<u32> = (0..512u32).map(|i| (i * 7919 + 13) % vocab).collect();
            let mut prefill = Vec::new();
            for _ in 0..6 {
                let mut st = gp.new_state()?;
                let t = Instant::now();
                gp.forward(&tokens, &mut st, Logits::Last)?;
                prefill.push(512.0 / t.elapsed().as_secs_f64());
            }
            let (p, _, _) = stats(prefill[1..].to_vec());
            let (mut alone, mut picked) = (Vec::new(), Vec::new());
            for rep in 0..6 {
                let mut st = gp.new_state()?;
                gp.forward(&tokens[..13], &mut st, Logits::Last)?;
                let step = gp.time_step_replays(&mut st, 64)?;
                if rep > 0 {
                    alone.push(step);
                }
                let mut s = gp.new_state()?;
                gp.forward(&tokens[..13], &mut s, Logits::Last)?;
                let mut next = s.last_argmax().unwrap_or_else(|| argmax(s.last_logits().expect("logits")));
                let t = Instant::now();
                for _ in 0..64 {
                    gp.apply(&[next], &mut s)?;
                    next = match s.last_argmax() {
                        Some(a) => a,
                        None => argmax(s.last_logits()?),
                    };
                }
                if rep > 0 {
                    picked.push(t.elapsed().as_secs_f64() / 64.0);
                }
            }
            let (step, lo, hi) = stats(alone);
            let (host_step, _, _) = stats(picked);
            let read = gp.weight_bytes() as f64;
            println!(
                "| {model} | {format} | {:.0} | {p:.0} | {:.1} ({:.1} - {:.1}) | {:.1} | {:.0} | {:.0}% |",
                read / 1e6,
                1.0 / step,
                1.0 / hi,
                1.0 / lo,
                1.0 / host_step,
                read / step / 1e9,
                100.0 * read / step / bandwidth
            );
            for t in gp.time_decode_gemvs(40, 5)? {
                let rate = t.bytes as f64 / (t.micros * 1e-6);
                eprintln!("  {model} {format}: {} {}x{} {:.1} MB {:.2} us {:.0} GB/s {:.0}%", t.what, t.rows, t.cols, t.bytes as f64 / 1e6, t.micros, rate / 1e9, 100.0 * rate / bandwidth);
            }
            // A decode step's kernels, each timed with events (launched one by one, so each
            // also pays its launch): the largest ten, µs per step.
            gp.graphs = false;
            let mut st = gp.new_state()?;
            gp.forward(&tokens[..13], &mut st, Logits::Last)?;
            gp.gpu.start_profile();
            for i in 0..8 {
                gp.forward(&tokens[20 + i..21 + i], &mut st, Logits::Last)?;
            }
            let mut profile = gp.gpu.finish_profile()?;
            profile.sort_by(|a, b| b.1.total_cmp(&a.1));
            for (name, ms, count) in profile.iter().take(10) {
                eprintln!("  {model} {format} kernel {name}: {:.1} us per step ({} launches)", 1e3 * ms / 8.0, count / 8);
            }
            gp.graphs = true;
            uploaded = Some((key, gp));
        }
    }
    Ok(())
}
