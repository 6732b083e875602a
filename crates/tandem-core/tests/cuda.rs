//! The CUDA engine's kernels against the CPU engine (their reference) on the golden fixture's
//! longest prompt, 300 tokens: five chunks of the chunked delta rule and five query tiles of
//! the prefill attention. Whole, and split into dispatches of 1, 7, 64, 100 and 128 tokens (the
//! one-launch DeltaNet step and the untiled attention for the short ones, the chunked rule from
//! a state that is not empty, attention tiles that start past position 0); then greedy decode
//! steps through the CUDA graph. Ignored by default (they need an NVIDIA GPU): on a GPU
//! machine, `cargo test --release -- --include-ignored`.

mod common;

use tandem_core::backend::cuda::qwen35::{GpuQwen35, GpuState, Precision};
use tandem_core::backend::cuda::Gpu;
use tandem_core::model::load::LoadedModel;
use tandem_core::model::Logits;
use tandem_core::backend::cpu::pool::Pool;
use tandem_core::sampling::argmax;
use tandem_core::state::{LayerState, State};
use tandem_core::verify::{LOGIT_TOL, STATE_REL_TOL};

fn prompt(name: &str) -> Vec<u32> {
    let bytes = std::fs::read(common::tiny_dir().join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensor(&format!("{name}.input_ids")).unwrap().data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32).collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// A fresh state on `gpu` with `tokens` applied.
fn prefilled(gpu: &GpuQwen35, tokens: &[u32]) -> GpuState {
    let mut s = gpu.new_state().unwrap();
    gpu.forward(tokens, &mut s, Logits::Last).unwrap();
    s
}

/// The largest difference of any state array, relative to the largest value of that array.
fn state_error(got: &State, want: &State) -> f32 {
    assert_eq!(got.position, want.position);
    let rel = |a: &[f32], b: &[f32]| max_abs_diff(a, b) / b.iter().map(|x| x.abs()).fold(1e-6, f32::max);
    got.layers
        .iter()
        .zip(&want.layers)
        .map(|pair| match pair {
            (LayerState::Linear { conv: c1, recurrent: r1 }, LayerState::Linear { conv: c2, recurrent: r2 }) => rel(c1, c2).max(rel(r1, r2)),
            (LayerState::Full { k: k1, v: v1 }, LayerState::Full { k: k2, v: v2 }) => rel(k1, k2).max(rel(v1, v2)),
            _ => panic!("layer kinds differ"),
        })
        .fold(0.0, f32::max)
}

const NEEDS_A_GPU: &str = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine";

/// Held by each test while it uses the GPU: the tests share one CUDA context, where what one
/// does (loading its module, freeing page-locked memory) synchronizes the whole GPU and so
/// breaks a graph capture that another is making at that moment.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// GPU 0, for `what`, and the turn to use it; a test run without one fails saying so.
fn gpu_for(what: &str) -> (Gpu, std::sync::MutexGuard<'static, ()>) {
    let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    (gpu0(what), turn)
}

fn gpu0(what: &str) -> Gpu {
    match tandem_core::backend::cuda::gpu_count() {
        Ok(n) if n > 0 => Gpu::open(0).unwrap(),
        Ok(_) => panic!("{what}: the driver reports no GPU ({NEEDS_A_GPU})"),
        Err(why) => panic!("{what}: {why:#} ({NEEDS_A_GPU})"),
    }
}

/// GPU 0 with bf16 mma instructions (compute capability 8.0 and later), for `what`.
fn mma_gpu_for(what: &str) -> (Gpu, std::sync::MutexGuard<'static, ()>) {
    let (g, turn) = gpu_for(what);
    assert!(g.bf16_mma, "{what}: {} has no bf16 mma (compute capability below 8.0)", g.name);
    (g, turn)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn gpu_prefill_and_decode_match_the_cpu_engine() {
    let (gpu0, _turn) = gpu_for("the CUDA kernels against the CPU engine");
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let tokens = prompt("p4");
    assert_eq!(tokens.len(), 300);
    let pool = Pool::new(1);
    let mut cpu = State::new(&m.net.config);
    let want = m.net.forward(&pool, &tokens, &mut cpu, Logits::All).unwrap();
    let gpu = GpuQwen35::upload(gpu0, &m.net, Precision::Exact).unwrap();
    for splits in [vec![300], vec![1, 7, 64, 100, 128]] {
        let mut on_gpu = gpu.new_state().unwrap();
        let mut got = Vec::new();
        let mut at = 0;
        for n in &splits {
            got.extend(gpu.forward(&tokens[at..at + n], &mut on_gpu, Logits::All).unwrap());
            at += n;
        }
        // Both engines are held to the reference implementation within LOGIT_TOL (`tandem
        // verify`; f32 sums in different orders), so to each other within twice that.
        let err = max_abs_diff(&got, &want);
        eprintln!("dispatches {splits:?}: logits differ from the CPU engine's by up to {err:.2e}");
        assert!(err <= 2.0 * LOGIT_TOL, "dispatches {splits:?}: logits differ by up to {err:.2e}");
        let err = state_error(&gpu.download_state(&on_gpu).unwrap(), &cpu);
        assert!(err <= STATE_REL_TOL, "dispatches {splits:?}: states differ by up to {err:.2e} (relative)");
        // Greedy decode from both, the GPU's steps replayed from its graph.
        let mut cpu_dec = cpu.clone();
        for step in 0..8 {
            let id = argmax(&cpu_dec.last_logits);
            assert_eq!(argmax(on_gpu.last_logits().unwrap()), id, "dispatches {splits:?}: decode step {step} picks another token");
            let g = gpu.forward(&[id], &mut on_gpu, Logits::Last).unwrap();
            let c = m.net.forward(&pool, &[id], &mut cpu_dec, Logits::Last).unwrap();
            let err = max_abs_diff(&g, &c);
            assert!(err <= 2.0 * LOGIT_TOL, "dispatches {splits:?}: decode step {step}: logits differ by up to {err:.2e}");
            // The replayed step's own greedy pick (argmax_rows) is the host's argmax of its logits.
            assert_eq!(on_gpu.last_argmax(), Some(argmax(&g)), "dispatches {splits:?}: decode step {step}: the GPU's argmax");
        }
        let err = state_error(&gpu.download_state(&on_gpu).unwrap(), &cpu_dec);
        assert!(err <= STATE_REL_TOL, "dispatches {splits:?}: states after decode differ by up to {err:.2e} (relative)");
    }
}

/// The batched decode step (every sequence's mixer in one launch per layer, greedy picks on the
/// GPU, logits left there until asked for) against each sequence decoded alone: sequences at
/// different positions, 3 of them (the projections by the multi-row GEMV) and 11 (by the
/// GEMM), six greedy steps, the last sequence leaving after the third; replayed from the
/// graphs of their bucket (4 and 2 rows, 12 rows, padding rows included) and launched kernel
/// by kernel; the DeltaNet mixer with a block per value head (the default from
/// `step_heads_from` sequences) and per 32 columns at every size. Exact products (the batch on the GEMV up to 8 rows, else the exact GEMM): the same
/// picks, logits within twice the verify tolerance. Tensor-core precision with the GEMM from 2
/// sequences (the one sequence's GEMV multiplies the same bf16-rounded inputs, but sums them in
/// another order, and a value that differs in its last f32 bit may round to the other bf16
/// downstream): logits within `TC_LOGIT_REL_TOL` of the largest, the same picks except where
/// the solo run's best two are closer than that. Both precisions: the same sequences decoded two
/// or three at a time get what they get in the batch, within the same bounds.
/// GGML block formats on the GPU (`--quant`: Q8_0 for the fixture's rows of 128, each k-quant
/// for its down projections' rows of 256; the GEMVs and embedding read the blocks, a prefill's
/// GEMMs their dequantized weights) against the CPU engine with the same weights: exact
/// products, a prefill whole and in dispatches (f32 products of the dequantized weights on
/// both), then greedy steps through the CUDA graph against the CPU's decode step (both
/// multiplying the blocks' integers by the inputs rounded to 16-bit integers): a whole prefill
/// within twice the verify tolerance, pieces of at most 8 tokens (the GEMV) and decode steps
/// within the bounds of that rounding measured on this fixture; and an embedding table of
/// blocks.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn block_format_weights_on_the_gpu_match_the_cpu_engine() {
    const GEMV_INPUT_LOGIT_TOL: f32 = 2e-2;
    const GEMV_INPUT_STATE_TOL: f32 = 1e-2;
    use tandem_core::model::quant::Quant;
    let (gpu0, _turn) = gpu_for("block-format weights on the GPU");
    let mut gpu0 = Some(gpu0);
    let tokens = prompt("p4");
    let pool = Pool::new(2);
    for name in ["q8_0", "q4_k", "q5_k", "q6_k"] {
        let mut m = LoadedModel::load_quantized(common::tiny_dir().to_str().unwrap(), Quant::parse(name).unwrap(), &pool).unwrap();
        if name == "q4_k" {
            // The embedding table in blocks too (as a GGUF file may hold it).
            m.net.quantize_embedding(Quant::parse("q8_0").unwrap(), &pool);
        }
        let mut cpu = State::new(&m.net.config);
        let want = m.net.forward(&pool, &tokens, &mut cpu, Logits::All).unwrap();
        let gpu = GpuQwen35::upload(gpu0.take().unwrap(), &m.net, Precision::Exact).unwrap();
        for splits in [vec![300], vec![1, 7, 64, 100, 128]] {
            let mut on_gpu = gpu.new_state().unwrap();
            let mut got = Vec::new();
            let mut at = 0;
            for n in &splits {
                got.extend(gpu.forward(&tokens[at..at + n], &mut on_gpu, Logits::All).unwrap());
                at += n;
            }
            // Pieces of at most 8 tokens take the GEMV, which multiplies the inputs rounded to
            // 16-bit integers (as the CPU's decode step does; its prompt kernels here multiply
            // f32 inputs): this fixture's random weights magnify that rounding (relative 1.5e-5
            // of a row's largest input) to 9.5e-3 of the logits for q8_0 on an H200.
            let short_pieces = splits.iter().any(|&n| n <= 8);
            let (logit_tol, state_tol) = if short_pieces { (GEMV_INPUT_LOGIT_TOL, GEMV_INPUT_STATE_TOL) } else { (2.0 * LOGIT_TOL, STATE_REL_TOL) };
            let err = max_abs_diff(&got, &want);
            let state_err = state_error(&gpu.download_state(&on_gpu).unwrap(), &cpu);
            eprintln!("{name} ({}), dispatches {splits:?}: logits differ from the CPU engine's by up to {err:.2e}, states by {state_err:.2e} (relative)", m.net.matrix_formats());
            assert!(err <= logit_tol, "{name}, dispatches {splits:?}: logits differ by up to {err:.2e}");
            assert!(state_err <= state_tol, "{name}, dispatches {splits:?}: states differ by up to {state_err:.2e} (relative)");
            let mut cpu_dec = cpu.clone();
            for step in 0..8 {
                let id = argmax(&cpu_dec.last_logits);
                assert_eq!(argmax(on_gpu.last_logits().unwrap()), id, "{name}, dispatches {splits:?}: decode step {step} picks another token");
                let g = gpu.forward(&[id], &mut on_gpu, Logits::Last).unwrap();
                m.net.decode_batch(&pool, &[id], &mut [&mut cpu_dec]).unwrap();
                let err = max_abs_diff(&g, &cpu_dec.last_logits);
                // (Both round the inputs to integers, but from norms computed in another order:
                // an integer here and there lands one apart. 2.2e-3 for q4_k on an H200.)
                assert!(err <= GEMV_INPUT_LOGIT_TOL, "{name}, dispatches {splits:?}: decode step {step}: logits differ by up to {err:.2e}");
            }
        }
        gpu0 = Some(gpu.into_gpu());
    }
}

/// GPU precision=fast (k-quant decode GEMVs against int8 inputs, kernels/blocks.cu
/// BlockChunk8) against the CPU engine's precision=fast (blocks_a8.rs, the same int8 inputs):
/// both decode greedily from the same state (a prompt prefilled on the CPU, its state uploaded),
/// the same picks and logits within the bound of one input landing one int8 step apart (norms
/// and sums in another order), and nearer the CPU's fast than the GPU's own 16-bit inputs.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn fast_k_quant_decode_on_the_gpu_matches_the_cpu_engines_fast() {
    // Of the logits' span (largest less smallest). On an H200 the fixture's q4_k came within
    // 4.9e-3 (step 0) to 1.3e-2 (step 7) of it, the int8 rounding itself moving the logits by
    // 1.2e-2 to 7.7e-2: its random weights magnify an input that lands one int8 step apart.
    const FAST_LOGIT_TOL: f32 = 2.5e-2;
    use tandem_core::backend::cpu::CpuPrecision;
    use tandem_core::model::quant::Quant;
    let (gpu0, _turn) = gpu_for("fast k-quant decode on the GPU");
    let mut gpu0 = Some(gpu0);
    let tokens = prompt("p4");
    let pool = Pool::new(std::thread::available_parallelism().map_or(2, |n| n.get()));
    // The fixture's rows of 128 are Q8_0 in every format but its MLP down projection (rows of
    // 256); the synthetic 0.8B (rows of 1024 and 3584) is all k-quant: its SwiGLU GEMVs and its
    // Q6_K LM head.
    let tiny = common::tiny_dir().to_str().unwrap().to_string();
    for (model, name) in [(tiny.as_str(), "q4_k"), (tiny.as_str(), "q5_k"), (tiny.as_str(), "q6_k"), ("synthetic:qwen3.5-0.8b", "q4_k")] {
        let mut m = LoadedModel::load_quantized(model, Quant::parse(name).unwrap(), &pool).unwrap();
        let mut cpu = State::new(&m.net.config);
        m.net.forward(&pool, &tokens[..40], &mut cpu, Logits::Last).unwrap();
        m.net.set_cpu_precision(CpuPrecision::Fast);
        let mut gpu = GpuQwen35::upload(gpu0.take().unwrap(), &m.net, Precision::Fast).unwrap();
        for graphs in [true, false] {
            gpu.graphs = graphs;
            let (mut fast, mut plain) = (gpu.upload_state(&cpu).unwrap(), gpu.upload_state(&cpu).unwrap());
            let mut cpu_dec = cpu.clone();
            for step in 0..8 {
                let id = argmax(&cpu_dec.last_logits);
                gpu.precision = Precision::Fast;
                let g = gpu.forward(&[id], &mut fast, Logits::Last).unwrap();
                gpu.precision = Precision::TensorCores;
                let p = gpu.forward(&[id], &mut plain, Logits::Last).unwrap();
                m.net.decode_batch(&pool, &[id], &mut [&mut cpu_dec]).unwrap();
                let err = max_abs_diff(&g, &cpu_dec.last_logits);
                let (lo, hi) = cpu_dec.last_logits.iter().fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
                let (tol, rounding) = (FAST_LOGIT_TOL * (hi - lo), max_abs_diff(&g, &p));
                eprintln!("{model} {name}, graphs {graphs}, step {step}: GPU fast against the CPU's fast {err:.2e}, against the GPU's 16-bit inputs {rounding:.2e} (logits span {:.2})", hi - lo);
                assert!(err <= tol, "{model} {name}, graphs {graphs}, step {step}: GPU fast and CPU fast logits differ by up to {err:.2e} (bound {tol:.2e})");
                // Nearer the CPU's int8 products than its own 16-bit ones: the same arithmetic.
                assert!(err < rounding, "{model} {name}, graphs {graphs}, step {step}: GPU fast is {err:.2e} from the CPU's fast, {rounding:.2e} from the GPU's 16-bit inputs");
                let (pick, best) = (argmax(&g), argmax(&cpu_dec.last_logits));
                let tie = cpu_dec.last_logits[best as usize] - cpu_dec.last_logits[pick as usize] <= tol;
                assert!(pick == best || tie, "{model} {name}, graphs {graphs}, step {step}: the GPU picks {pick}, the CPU {best}");
            }
        }
        gpu0 = Some(gpu.into_gpu());
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn batched_decode_matches_each_sequence_alone() {
    /// Measured on an H100 with the tiny fixture model (random weights, which magnify a
    /// difference): the printed sequences within 6e-7 (absolute), the largest differences seen
    /// 2e-3 and 7e-3 of the largest logit (an input rounded to the other bf16 somewhere in the
    /// step); 1.1e-2 when the GEMV multiplied f32 inputs and the GEMM their bf16 roundings.
    const TC_LOGIT_REL_TOL: f32 = 2e-2;
    let (gpu0, _turn) = gpu_for("the batched decode step");
    let tokens = prompt("p4");
    let mut gpu0 = Some(gpu0);
    // As stored (bf16), and in block formats (q4_k: Q8_0 and Q4_K; the tensor-core GEMM takes
    // the weights dequantized and rounded to bf16, the GEMV exact: within the same bound).
    for weights in ["bf16", "q4_k"] {
    let m = match weights {
        "bf16" => LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap(),
        q => LoadedModel::load_quantized(common::tiny_dir().to_str().unwrap(), tandem_core::model::quant::Quant::parse(q).unwrap(), &Pool::new(2)).unwrap(),
    };
    let mut gpu = GpuQwen35::upload(gpu0.take().unwrap(), &m.net, Precision::Exact).unwrap();
    let default_heads_from = gpu.step_heads_from();
    // (Fast: the k-quants' GEMVs against int8 inputs; bf16 weights as TensorCores.)
    let precisions = if weights == "q4_k" { vec![(Precision::Exact, gpu.decode_gemm_from()), (Precision::TensorCores, 2), (Precision::Fast, 2)] } else { vec![(Precision::Exact, gpu.decode_gemm_from()), (Precision::TensorCores, 2)] };
    for (precision, gemm_from) in precisions {
        gpu.precision = precision;
        gpu.set_decode_gemm_from(gemm_from);
        // Replayed and launched kernel by kernel; and the DeltaNet mixer with a block per 32
        // columns at every batch size (else per value head from `step_heads_from` sequences).
        for (graphs, heads_from) in [(true, default_heads_from), (false, default_heads_from), (true, usize::MAX)] {
            gpu.set_step_heads_from(heads_from);
            for lengths in [vec![5usize, 130, 40], vec![1, 2, 7, 9, 33, 64, 65, 100, 200, 299, 300]] {
                let mut alone: Vec<_> = lengths.iter().map(|&l| prefilled(&gpu, &tokens[..l])).collect();
                let mut batch: Vec<_> = lengths.iter().map(|&l| prefilled(&gpu, &tokens[..l])).collect();
                let mut small: Vec<_> = lengths.iter().map(|&l| prefilled(&gpu, &tokens[..l])).collect();
                gpu.graphs = graphs;
                for step in 0..6 {
                    let running = if step < 3 { lengths.len() } else { lengths.len() - 1 };
                    let picks: Vec<u32> = alone[..running].iter_mut().map(|s| argmax(s.last_logits().unwrap())).collect();
                    for (i, s) in alone[..running].iter_mut().enumerate() {
                        gpu.apply(&[picks[i]], s).unwrap();
                    }
                    let mut refs: Vec<_> = batch[..running].iter_mut().collect();
                    gpu.decode_batch(&picks, &mut refs).unwrap();
                    // (Read before the smaller batches' steps, which may reuse the buffer; the
                    // GPU's picks first, as reading the logits brings them to the host.)
                    let gpu_picks: Vec<Option<u32>> = batch[..running].iter().map(|s| s.last_argmax()).collect();
                    let batched: Vec<Vec<f32>> = batch[..running].iter_mut().map(|s| s.last_logits().unwrap().to_vec()).collect();
                    // Two at a time, the last three together where two would leave one alone
                    // (each group's logits read before the next group's step reuses the buffer).
                    let mut in_small = Vec::new();
                    let mut from = 0;
                    while from < running {
                        let to = if running - from == 3 { running } else { from + 2 };
                        let mut refs: Vec<_> = small[from..to].iter_mut().collect();
                        gpu.decode_batch(&picks[from..to], &mut refs).unwrap();
                        in_small.extend(small[from..to].iter_mut().map(|s| s.last_logits().unwrap().to_vec()));
                        from = to;
                    }
                    for i in 0..running {
                        let what = format!("{weights}, {precision:?} from {gemm_from}, graphs {graphs}, mixer per head from {heads_from} sequences, {running} sequences, step {step}: sequence {i} (prompt of {})", lengths[i]);
                        let want = alone[i].last_logits().unwrap().to_vec();
                        let tol = match precision {
                            Precision::Exact => 2.0 * LOGIT_TOL,
                            Precision::TensorCores | Precision::Fast => TC_LOGIT_REL_TOL * want.iter().fold(0.0f32, |m, v| m.max(v.abs())),
                        };
                        let pick = gpu_picks[i].unwrap_or_else(|| panic!("{what}: no pick from the GPU"));
                        let best = argmax(&want);
                        let tie = precision.tensor_cores() && want[best as usize] - want[pick as usize] <= tol;
                        assert!(pick == best || tie, "{what} picks {pick}, alone {best} (logits {} and {})", want[pick as usize], want[best as usize]);
                        assert_eq!(batch[i].position, alone[i].position);
                        let got = &batched[i];
                        let err = max_abs_diff(got, &want);
                        if step == 0 && i == 0 {
                            eprintln!("{what}: logits differ from the solo run's by {err:.2e}");
                        }
                        assert!(err <= tol, "{what}: logits differ from its solo run by {err:.2e} (bound {tol:.2e})");
                        let err = max_abs_diff(&in_small[i], got);
                        assert!(err <= tol, "{what}: logits in a batch of {running} and of 2 or 3 differ by {err:.2e} (bound {tol:.2e})");
                    }
                }
                gpu.graphs = true;
            }
        }
    }
    gpu0 = Some(gpu.into_gpu());
    }
}

/// The batched mixer with a block per value head on Qwen3.5's own head shape (dk = dv = 128,
/// the synthetic 0.8B: random weights, the real shapes), whose state crosses shared memory in
/// several bulk copies: four sequences at different positions, four greedy steps, f32 and bf16
/// states, exact products (the batch on the multi-row GEMV). Against the same batch with the
/// mixer per 32 columns (the same projections): states and logits bit for bit. Against each
/// sequence decoded alone: the same picks, logits within twice the verify tolerance, f32
/// states within the state tolerance (a bf16 state's values may round to the neighbouring bf16
/// where the batch's projections differ from the solo run's in their last bits, and carry that
/// into the next steps). (The tiny fixture's heads of 32 take one copy of 4 KB.)
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn batched_mixer_on_full_size_heads_matches_each_sequence_alone() {
    use tandem_core::backend::cuda::qwen35::state_slots::StateDtype;
    let (g, _turn) = gpu_for("the batched mixer on heads of 128");
    let m = LoadedModel::load("synthetic:qwen3.5-0.8b").unwrap();
    assert_eq!(m.net.config.linear_key_head_dim, 128);
    let mut gpu = GpuQwen35::upload(g, &m.net, Precision::Exact).unwrap();
    let tokens: Vec<u32> = (0..90u32).map(|i| (i * 7919 + 13) % 50_000).collect();
    let lengths = [3usize, 17, 64, 90];
    for dtype in [StateDtype::F32, StateDtype::Bf16] {
        gpu.set_state_dtype(dtype).unwrap();
        let mut alone: Vec<_> = lengths.iter().map(|&l| prefilled(&gpu, &tokens[..l])).collect();
        let mut heads: Vec<_> = lengths.iter().map(|&l| prefilled(&gpu, &tokens[..l])).collect();
        let mut columns: Vec<_> = lengths.iter().map(|&l| prefilled(&gpu, &tokens[..l])).collect();
        for step in 0..4 {
            let picks: Vec<u32> = alone.iter_mut().map(|s| argmax(s.last_logits().unwrap())).collect();
            for (i, s) in alone.iter_mut().enumerate() {
                gpu.apply(&[picks[i]], s).unwrap();
            }
            let mut batch = |states: &mut Vec<GpuState>, heads_from: usize| -> Vec<Vec<f32>> {
                gpu.set_step_heads_from(heads_from);
                let mut refs: Vec<_> = states.iter_mut().collect();
                gpu.decode_batch(&picks, &mut refs).unwrap();
                states.iter_mut().map(|s| s.last_logits().unwrap().to_vec()).collect()
            };
            let by_heads = batch(&mut heads, 2);
            let by_columns = batch(&mut columns, usize::MAX);
            for i in 0..lengths.len() {
                let what = format!("{dtype:?} states, step {step}, sequence {i} (prompt of {})", lengths[i]);
                let state = heads[i].download().unwrap();
                assert!(by_heads[i] == by_columns[i], "{what}: the mixer per value head and per 32 columns give other logits");
                assert!(state == columns[i].download().unwrap(), "{what}: the mixer per value head and per 32 columns leave other states");
                let want = alone[i].last_logits().unwrap().to_vec();
                assert_eq!(argmax(&by_heads[i]), argmax(&want), "{what}: the batch picks another token");
                let err = max_abs_diff(&by_heads[i], &want);
                assert!(err <= 2.0 * LOGIT_TOL, "{what}: logits differ from the solo run's by {err:.2e}");
                if dtype == StateDtype::F32 {
                    let err = state_error(&state, &alone[i].download().unwrap());
                    assert!(err <= STATE_REL_TOL, "{what}: states differ from the solo run's by {err:.2e} (relative)");
                }
            }
        }
    }
}

/// Prompts prefilled together in one forward (their rows packed, each sequence's mixer on its
/// own rows) against each prompt prefilled alone: fresh states and states that already hold a
/// prompt, lengths from 1 token (up to 8 are applied alone, as their GEMV is) to 300 (five
/// delta-rule chunks), exact products and tensor cores; the same greedy picks and positions, logits within twice
/// the verify tolerance (exact) and states within the state tolerance; then a batched decode
/// step from the packed states picks what the solo states pick.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn packed_prefill_matches_each_prompt_alone() {
    let (gpu0, _turn) = gpu_for("the packed prefill");
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let tokens = prompt("p4");
    let mut gpu = GpuQwen35::upload(gpu0, &m.net, Precision::Exact).unwrap();
    for precision in [Precision::Exact, Precision::TensorCores] {
        gpu.precision = precision;
        // (tokens already in the state, tokens of the prompt)
        let cases: &[&[(usize, usize)]] = &[&[(0, 300), (0, 5)], &[(0, 1), (0, 9), (0, 64), (0, 65), (40, 130), (0, 300), (7, 2), (100, 33)]];
        for &case in cases {
            let start = |done: usize| {
                let mut s = gpu.new_state().unwrap();
                if done > 0 {
                    gpu.forward(&tokens[..done], &mut s, Logits::Last).unwrap();
                }
                s
            };
            let mut alone: Vec<_> = case.iter().map(|&(done, _)| start(done)).collect();
            let mut packed: Vec<_> = case.iter().map(|&(done, _)| start(done)).collect();
            let prompts: Vec<&[u32]> = case.iter().map(|&(done, n)| &tokens[done..done + n]).collect();
            for (s, p) in alone.iter_mut().zip(&prompts) {
                gpu.forward(p, s, Logits::Last).unwrap();
            }
            let mut refs: Vec<_> = packed.iter_mut().collect();
            gpu.prefill_batch(&prompts, &mut refs).unwrap();
            for (i, (b, a)) in packed.iter_mut().zip(alone.iter_mut()).enumerate() {
                let what = format!("{precision:?}, case {case:?}: sequence {i}");
                let want = a.last_logits().unwrap().to_vec();
                assert_eq!(b.position, a.position, "{what}");
                // (A prompt applied alone leaves its logits on the host, with no GPU argmax.)
                let gpu_pick = b.last_argmax();
                let got = b.last_logits().unwrap();
                assert_eq!(argmax(got), argmax(&want), "{what} picks another token");
                assert!(gpu_pick.is_none() || gpu_pick == Some(argmax(got)), "{what}: the GPU's greedy pick is not the argmax of its logits");
                let err = max_abs_diff(got, &want);
                eprintln!("{what}: logits differ from the solo prefill by {err:.2e}");
                if precision == Precision::Exact {
                    assert!(err <= 2.0 * LOGIT_TOL, "{what}: logits differ from the solo prefill by {err:.2e}");
                    let err = state_error(&gpu.download_state(b).unwrap(), &gpu.download_state(a).unwrap());
                    assert!(err <= STATE_REL_TOL, "{what}: states differ by {err:.2e} (relative)");
                }
            }
            let picks: Vec<u32> = alone.iter_mut().map(|s| argmax(s.last_logits().unwrap())).collect();
            for (s, &p) in alone.iter_mut().zip(&picks) {
                gpu.apply(&[p], s).unwrap();
            }
            let mut refs: Vec<_> = packed.iter_mut().collect();
            gpu.decode_batch(&picks, &mut refs).unwrap();
            for (i, (b, a)) in packed.iter_mut().zip(alone.iter_mut()).enumerate() {
                assert_eq!(argmax(b.last_logits().unwrap()), argmax(a.last_logits().unwrap()), "{precision:?}, case {case:?}: sequence {i}: the decode step after the packed prefill picks another token");
            }
        }
    }
    // A prompt the engine cannot take is refused before any state changes.
    gpu.precision = Precision::Exact;
    let mut a = gpu.new_state().unwrap();
    let mut b = gpu.new_state().unwrap();
    let bad = [u32::MAX];
    let e = format!("{:#}", gpu.prefill_batch(&[&tokens[..10], &bad], &mut [&mut a, &mut b]).unwrap_err());
    assert!(e.contains("outside the model's vocabulary"), "{e}");
    assert_eq!((a.position, b.position), (0, 0));
}

/// A batched step's logits stay on the GPU in its bucket's buffer; a state whose row a later
/// step of that bucket overwrote says so rather than hand out another sequence's logits.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn logits_overwritten_by_a_later_batched_step_are_refused() {
    let (gpu0, _turn) = gpu_for("the batched decode step's logits");
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let tokens = prompt("p4");
    let gpu = GpuQwen35::upload(gpu0, &m.net, Precision::Exact).unwrap();
    let mut states: Vec<_> = (0..4).map(|i| prefilled(&gpu, &tokens[..5 + i])).collect();
    let (first, second) = states.split_at_mut(2);
    gpu.decode_batch(&[1, 2], &mut first.iter_mut().collect::<Vec<_>>()).unwrap();
    gpu.decode_batch(&[3, 4], &mut second.iter_mut().collect::<Vec<_>>()).unwrap();
    let e = format!("{:#}", first[0].last_logits().unwrap_err());
    assert!(e.contains("overwritten by a later batched decode step"), "{e}");
    // The greedy pick came back with the step and stays; the second batch's rows are current.
    assert!(first[0].last_argmax().is_some());
    assert_eq!(second[1].last_logits().unwrap().len(), m.net.config.vocab_size);
}

/// Three states whose last logits a GPU step left on the GPU: prefilled with p4's first 5, 6 and
/// 7 tokens, the first two then stepped as one batch, the third alone.
fn states_with_logits_on_the_gpu(gpu: &GpuQwen35) -> Vec<GpuState> {
    let tokens = prompt("p4");
    let mut states: Vec<_> = (0..3).map(|i| prefilled(gpu, &tokens[..5 + i])).collect();
    gpu.decode_batch(&[1, 2], &mut states[..2].iter_mut().collect::<Vec<_>>()).unwrap();
    gpu.forward(&[3], &mut states[2], Logits::Last).unwrap();
    states
}

/// Draws on the GPU (kernels/sample.cu sample_rows, every row of a batch in one launch) pick
/// what the host's sampler picks from the same row with the same uniform, at temperatures with
/// and without top-k and top-p cuts, after a batched step and after one sequence's step; once
/// the row is on the host the GPU declines.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn draws_on_the_gpu_are_the_hosts() {
    use tandem_core::sampling::{GpuDraw, Sampler, SamplingParams};
    let (gpu0, _turn) = gpu_for("draws with cuts");
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let gpu = GpuQwen35::upload(gpu0, &m.net, Precision::TensorCores).unwrap();
    let mut states = states_with_logits_on_the_gpu(&gpu);
    let allowed = m.net.config.vocab_size - 7;
    let draws: Vec<f64> = (0..40).map(|i| (i as f64 * 0.618_034).fract()).chain([0.0, 0.999_999_9]).collect();
    let cuts = [(1.0f32, 0, 1.0f32), (0.7, 0, 1.0), (3.0, 0, 1.0), (0.7, 20, 0.8), (0.6, 20, 1.0), (1.0, 0, 0.9), (1.0, 1, 1.0), (2.0, 500, 0.95)];
    for (temperature, top_k, top_p) in cuts {
        let params = SamplingParams { temperature, top_k, top_p, ..Default::default() };
        let rows: Vec<(&GpuState, GpuDraw)> = states
            .iter()
            .flat_map(|s| draws.iter().map(move |&u| (s, GpuDraw { allowed, inv_t: 1.0 / temperature, top_k, top_p, u })))
            .collect();
        let picks = gpu.sample_rows(&rows).unwrap();
        for (i, s) in states.iter().enumerate() {
            let row = s.host_logits().unwrap();
            let mut host = Sampler::new(params.clone(), allowed);
            let mine = &picks[i * draws.len()..(i + 1) * draws.len()];
            for (&u, pick) in draws.iter().zip(mine) {
                assert_eq!(*pick, Some(host.sample_drawn(&row, u).unwrap()), "state {i}, {params:?}, u {u}");
            }
            if top_k != 1 {
                assert!(mine.iter().collect::<std::collections::HashSet<_>>().len() > 1, "draws with {params:?} vary");
            }
        }
    }
    for s in states.iter_mut() {
        s.last_logits().unwrap();
        let draw = GpuDraw { allowed, inv_t: 1.0, top_k: 0, top_p: 1.0, u: 0.5 };
        assert_eq!(gpu.sample_rows(&[(s, draw)]).unwrap(), vec![None], "the row is on the host now");
    }
}

/// Picks on the GPU from rows masked by a grammar's mask (kernels/sample.cu mask_rows, then
/// argmax_rows or sample_rows) are what the host picks from the same rows masked the same way
/// (grammar::apply): greedy and drawn, with masks of every kind (all allowed, a few words, one
/// id, the step's own argmax masked out), after a batched step and one sequence's; a row on the
/// host is declined.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn masked_picks_on_the_gpu_are_the_hosts() {
    use tandem_core::grammar;
    use tandem_core::sampling::{argmax, GpuDraw, MaskedPick, Sampler, SamplingParams};
    let (gpu0, _turn) = gpu_for("picks masked by a grammar");
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let gpu = GpuQwen35::upload(gpu0, &m.net, Precision::TensorCores).unwrap();
    let mut states = states_with_logits_on_the_gpu(&gpu);
    let allowed = m.net.config.vocab_size - 7;
    let words = allowed.div_ceil(32);
    let mut seed = 99u32;
    let mut next = || {
        seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        seed
    };
    let masks: Vec<Vec<u32>> = vec![
        vec![u32::MAX; words],
        (0..words).map(|w| if w % 5 == 0 { next() } else { 0 }).collect(),
        (0..words).map(|w| if w == words / 3 { 1 << 7 } else { 0 }).collect(),
        (0..words).map(|w| if w % 2 == 1 { u32::MAX } else { 0 }).collect(),
        // Shorter than the row: the ids past it are masked.
        vec![u32::MAX; words / 2],
    ];
    let kinds: Vec<Option<(f32, usize, f32)>> = vec![None, Some((1.0, 0, 1.0)), Some((0.7, 20, 0.9)), Some((2.0, 0, 0.5))];
    let mut rows = Vec::new();
    for s in &states {
        for (mi, mask) in masks.iter().enumerate() {
            for (ki, kind) in kinds.iter().enumerate() {
                let u = ((mi * 7 + ki * 3) as f64 * 0.618_034).fract();
                let draw = kind.map(|(t, top_k, top_p)| GpuDraw { allowed, inv_t: 1.0 / t, top_k, top_p, u });
                rows.push((s, MaskedPick { allowed, mask: &mask[..], draw }));
            }
        }
    }
    let picks = gpu.sample_masked(&rows).unwrap();
    for ((s, p), pick) in rows.iter().zip(&picks) {
        let mut row = s.host_logits().unwrap()[..allowed].to_vec();
        grammar::apply(p.mask, &mut row);
        let want = match p.draw {
            None => argmax(&row),
            Some(d) => {
                let params = SamplingParams { temperature: 1.0 / d.inv_t, top_k: d.top_k, top_p: d.top_p, ..Default::default() };
                Sampler::new(params, allowed).sample_drawn(&row, d.u).unwrap()
            }
        };
        assert_eq!(*pick, Some(want), "{:?}", p.draw);
        assert!(p.mask.get(want as usize / 32).is_some_and(|w| (w >> (want % 32)) & 1 == 1), "an allowed id");
    }
    states[0].last_logits().unwrap();
    let pick = MaskedPick { allowed, mask: &masks[0], draw: None };
    assert_eq!(gpu.sample_masked(&[(&states[0], pick)]).unwrap(), vec![None], "the row is on the host now");
}

/// A decode step far into the context: the decode attention splits its 5,000 visible
/// positions into chunks scored by separate blocks and merged by the last one (a prompt of
/// pseudo-random ids; the CPU engine is the reference).
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn decode_at_5000_positions_matches_the_cpu_engine() {
    let (gpu0, _turn) = gpu_for("long-context decode on the GPU");
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let mut rng = tandem_core::rng::Rng::new(5);
    let tokens: Vec<u32> = (0..5000).map(|_| (rng.next_f64() * m.net.config.vocab_size as f64) as u32).collect();
    let pool = Pool::new(1);
    let mut cpu = State::new(&m.net.config);
    m.net.forward(&pool, &tokens, &mut cpu, Logits::Last).unwrap();
    let gpu = GpuQwen35::upload(gpu0, &m.net, Precision::Exact).unwrap();
    let mut on_gpu = prefilled(&gpu, &tokens);
    for step in 0..4 {
        let id = argmax(&cpu.last_logits);
        assert_eq!(argmax(on_gpu.last_logits().unwrap()), id, "decode step {step} picks another token");
        let g = gpu.forward(&[id], &mut on_gpu, Logits::Last).unwrap();
        let c = m.net.forward(&pool, &[id], &mut cpu, Logits::Last).unwrap();
        let err = max_abs_diff(&g, &c);
        assert!(err <= LOGIT_TOL, "decode step {step} at position {}: logits differ by up to {err:.2e}", 5000 + step);
    }
}

/// The tensor-core prefill attention (bf16 mma, kernels/attention.cu attention_mma_*) against the f32
/// tiled kernel, its reference, on random queries, keys, values and gates: head dims 32 and
/// 256, 150 queries after 100 cached positions (a last block of 22 rows; key tiles that start
/// before the queries and cross the diagonal). bf16 operands: within 1% of the largest output.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn mma_attention_matches_the_f32_tiles() {
    let (g, _turn) = mma_gpu_for("the tensor-core attention kernel");
    use tandem_core::backend::cuda::kernels as k;
    use tandem_core::backend::cuda::launch::Grid;
    let mut rng = tandem_core::rng::Rng::new(11);
    for (d, hq, hkv) in [(32usize, 4usize, 2usize), (256, 8, 2)] {
        let (pos0, t) = (100usize, 150usize);
        let mut random = |len: usize, scale: f32| -> Vec<f32> { (0..len).map(|_| (rng.next_f64() * 2.0 - 1.0) as f32 * scale).collect() };
        let (q, kc, vc, gate) = (random(t * hq * d, 4.0), random((pos0 + t) * hkv * d, 1.0), random((pos0 + t) * hkv * d, 1.0), random(t * hq * d, 2.0));
        // A paged cache of one layer (koff 0): block i holds positions 16 i.. (keys, then
        // values), placed in reverse order in memory.
        let (row, bs) = (hkv * d, tandem_core::backend::cuda::qwen35::kv_cache::KV_BLOCK);
        let blocks = (pos0 + t).div_ceil(bs);
        let mut image = vec![0f32; blocks * 2 * bs * row];
        for p in 0..pos0 + t {
            let at = (blocks - 1 - p / bs) * 2 * bs * row + (p % bs) * row;
            image[at..at + row].copy_from_slice(&kc[p * row..(p + 1) * row]);
            image[at + bs * row..at + (bs + 1) * row].copy_from_slice(&vc[p * row..(p + 1) * row]);
        }
        let cache = g.upload(&image).unwrap();
        let table: Vec<u64> = (0..blocks).map(|i| g.ptr(&cache).offset((blocks - 1 - i) * 2 * bs * row).addr()).collect();
        let table = g.upload(&table).unwrap();
        let table = g.ptr(&table).reinterpret::<tandem_core::backend::cuda::launch::DevPtr<f32>>();
        let (q, gate) = (g.upload(&q).unwrap(), g.upload(&gate).unwrap());
        let pos = g.upload(&[pos0 as u32]).unwrap();
        let (want, got) = (g.zeros::<f32>(t * hq * d).unwrap(), g.zeros::<f32>(t * hq * d).unwrap());
        let grid = Grid::new((t.div_ceil(64), hq, 1), 256);
        let (t_, hq_, hkv_) = (t as i32, hq as i32, hkv as i32);
        g.launch(k::ATTENTION_TILED, grid, (g.ptr(&q), table, 0, g.ptr(&gate), g.ptr(&want), t_, hq_, hkv_, d as i32, g.ptr(&pos))).unwrap();
        // The mma kernel takes the cache's rows gathered and rounded to bf16 (kv_to_bf16, as
        // the engine does).
        let n = (pos0 + t) * row;
        let (kb, vb) = (g.zeros::<u16>(n).unwrap(), g.zeros::<u16>(n).unwrap());
        g.launch(k::KV_TO_BF16, Grid::x(n.div_ceil(1024), 256), (table, 0, g.ptr(&kb), g.ptr(&vb), (pos0 + t) as i32, row as i32)).unwrap();
        let kernel = match d {
            32 => k::ATTENTION_MMA_32,
            _ => k::ATTENTION_MMA_256,
        };
        g.launch(kernel, grid, (g.ptr(&q), g.ptr(&kb), g.ptr(&vb), g.ptr(&gate), g.ptr(&got), t_, hq_, hkv_, g.ptr(&pos))).unwrap();
        let (want, got) = (g.download(&want, t * hq * d).unwrap(), g.download(&got, t * hq * d).unwrap());
        let largest = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = max_abs_diff(&got, &want);
        eprintln!("head dim {d}: mma against f32 tiles: max |err| {err:.2e} of max |out| {largest:.2e}");
        assert!(largest > 0.05, "head dim {d}: the reference output is degenerate");
        assert!(err <= 1e-2 * largest, "head dim {d}: the mma attention differs by {err:.2e} (largest output {largest:.2e})");
    }
}

/// The tensor-core state walk (kernels/deltanet.cu deltanet_chunk_state_mma_*) against the f32 walk,
/// its reference, from the same chunk matrices (deltanet_chunk_prep of random projections with
/// q and k l2-normalised; the walk's from the prep's tensor-core build) and the same non-zero
/// start state: 150 tokens (three chunks, the last partial), key and value heads of 32 and of
/// 128 channels. bf16 operands: outputs and final state within 2% of their largest values.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn mma_state_walk_matches_the_f32_walk() {
    let (g, _turn) = mma_gpu_for("the tensor-core state walk");
    use tandem_core::backend::cuda::kernels as k;
    use tandem_core::backend::cuda::launch::Grid;
    let mut rng = tandem_core::rng::Rng::new(13);
    for (hk, hv, dk, dv) in [(2usize, 4usize, 32usize, 32usize), (2, 4, 128, 128)] {
        let (t, chunks) = (150usize, 3usize);
        let cd = 2 * hk * dk + hv * dv;
        let mut random = |len: usize, lo: f32, hi: f32| -> Vec<f32> { (0..len).map(|_| lo + (hi - lo) * rng.next_f64() as f32).collect() };
        // q and k heads l2-normalised (q also times 1/sqrt(dk)), as the conv leaves them.
        let mut mixed = random(t * cd, -1.0, 1.0);
        for (index, head) in mixed.chunks_mut(cd).flat_map(|row| row[..2 * hk * dk].chunks_mut(dk)).enumerate() {
            let scale = if index % (2 * hk) < hk { 1.0 / (dk as f32).sqrt() } else { 1.0 };
            let inv = 1.0 / (head.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt() * scale;
            head.iter_mut().for_each(|v| *v *= inv);
        }
        let mixed = g.upload(&mixed).unwrap();
        let (beta, alpha) = (g.upload(&random(t * hv, -2.0, 2.0)).unwrap(), g.upload(&random(t * hv, -2.0, 2.0)).unwrap());
        let (neg_a, dt_bias) = (g.upload(&vec![-1.0f32; hv]).unwrap(), g.upload(&vec![0.0f32; hv]).unwrap());
        let start = random(hv * dk * dv, -0.5, 0.5);
        let (gcum, u, w, p) = (g.zeros::<f32>(t * hv).unwrap(), g.zeros::<f32>(t * hv * dv).unwrap(), g.zeros::<f32>(t * hv * dk).unwrap(), g.zeros::<f32>(chunks * hv * 64 * 64).unwrap());
        let (t_, hk_, hv_, dk_, dv_, cd_) = (t as i32, hk as i32, hv as i32, dk as i32, dv as i32, cd as i32);
        // The prep with the tensor-core walk's bf16 operands (W, q exp(G), k exp(G_last - G), P;
        // its products on tensor cores, into its own U).
        let ops = g.zeros::<u16>(3 * t * hv * dk + chunks * hv * 64 * 64).unwrap();
        let u_mma = g.zeros::<f32>(t * hv * dv).unwrap();
        let (wb, qb, kb, pb) = (g.ptr(&ops), g.ptr(&ops).offset(t * hv * dk), g.ptr(&ops).offset(2 * t * hv * dk), g.ptr(&ops).offset(3 * t * hv * dk));
        let prep = (g.ptr(&mixed), g.ptr(&beta), g.ptr(&alpha), g.ptr(&neg_a), g.ptr(&dt_bias), g.ptr(&gcum), g.ptr(&u_mma), g.ptr(&w), g.ptr(&p), wb, qb, kb, pb, t_, hk_, hv_, dk_, dv_, cd_);
        g.launch(k::DELTANET_CHUNK_PREP, Grid::new((chunks, hv, 1), 256), prep).unwrap();
        // And without them, all in f32, for the f32 walk.
        let null = tandem_core::backend::cuda::launch::DevPtr::NULL;
        let prep = (g.ptr(&mixed), g.ptr(&beta), g.ptr(&alpha), g.ptr(&neg_a), g.ptr(&dt_bias), g.ptr(&gcum), g.ptr(&u), g.ptr(&w), g.ptr(&p), null, null, null, null, t_, hk_, hv_, dk_, dv_, cd_);
        g.launch(k::DELTANET_CHUNK_PREP, Grid::new((chunks, hv, 1), 256), prep).unwrap();
        let mma = match dk {
            32 => k::DELTANET_CHUNK_STATE_MMA_32,
            _ => k::DELTANET_CHUNK_STATE_MMA_128,
        };
        use tandem_core::backend::cuda::launch::{DevPtr, StateValues};
        let walked = |launch: &dyn Fn(DevPtr<StateValues>, DevPtr<f32>)| {
            let (state, core) = (g.upload(&start).unwrap(), g.zeros::<f32>(t * hv * dv).unwrap());
            launch(g.ptr(&state).reinterpret(), g.ptr(&core));
            (g.download(&core, t * hv * dv).unwrap(), g.download(&state, hv * dk * dv).unwrap())
        };
        let grid = |threads| Grid::new((hv, dv / 16, 1), threads);
        let want = walked(&|state, core| g.launch(k::DELTANET_CHUNK_STATE_1, grid(256), (state, g.ptr(&mixed), g.ptr(&gcum), g.ptr(&u), g.ptr(&w), g.ptr(&p), core, t_, hk_, hv_, dk_, dv_, cd_)).unwrap());
        let got = walked(&|state, core| g.launch(mma, grid(128).with_shared(k::chunk_state_mma_shared(dk)), (state, g.ptr(&gcum), g.ptr(&u_mma), wb, qb, kb, pb, core, t_, hv_, dk_, dv_)).unwrap());
        let (want, got) = (&want, &got);
        for (what, a, b) in [("outputs", &got.0, &want.0), ("final state", &got.1, &want.1)] {
            let largest = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = max_abs_diff(a, b);
            eprintln!("dk {dk}, dv {dv}: {what}: max |err| {err:.2e} of max |value| {largest:.2e}");
            assert!(largest > 0.01, "dk {dk}: the reference {what} are degenerate");
            assert!(err <= 2e-2 * largest, "dk {dk}, dv {dv}: the tensor-core walk's {what} differ by {err:.2e} (largest {largest:.2e})");
        }
    }
}

/// The kernels are compiled once and then loaded from the kernel cache (the same CUBIN); a
/// cache file damaged on disk is not loaded but compiled again and replaced.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn kernels_come_from_the_cache_after_the_first_compile() {
    use tandem_core::backend::cuda::compile::{kernels_for, Origin};
    let (g, _turn) = gpu_for("the kernel cache");
    let arch = g.arch.clone();
    let dir = std::env::temp_dir().join(format!("tandem-kernel-cache-test-{}", std::process::id()));
    let source = tandem_core::backend::cuda::kernels::source();
    let (first, origin) = kernels_for(&source, &arch, Some(&dir)).unwrap();
    let Origin::Compiled { cached_to: Some(file), seconds } = origin else { panic!("first time: {origin:?}") };
    let (again, origin) = kernels_for(&source, &arch, Some(&dir)).unwrap();
    assert_eq!(origin, Origin::Cached(file.clone()));
    assert!(again == first, "the cached CUBIN differs from the compiled one");
    // Another source is another file.
    let (_, origin) = kernels_for(&format!("{source}\n// another version\n"), &arch, Some(&dir)).unwrap();
    assert!(matches!(origin, Origin::Compiled { .. }), "a changed source was loaded from the cache: {origin:?}");
    // A damaged file: compiled again, and the file made good.
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&file, &bytes).unwrap();
    let (fixed, origin) = kernels_for(&source, &arch, Some(&dir)).unwrap();
    assert!(matches!(origin, Origin::Compiled { .. }), "a damaged file was loaded: {origin:?}");
    assert!(fixed == first);
    let (_, origin) = kernels_for(&source, &arch, Some(&dir)).unwrap();
    assert_eq!(origin, Origin::Cached(file));
    eprintln!("{arch}: compiled in {seconds:.2} s, {} KB", first.len() / 1024);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The paged K/V cache at its limit: a state takes blocks of 16 positions as it grows and gives
/// them back when dropped; a call that needs more than the pool may hold is refused with
/// `PoolFull` before anything is applied (the state stays where it was), and once blocks
/// are free again the same call succeeds; blocks that served another sequence (handed out
/// again in another order) give the same logits as a fresh engine's.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn kv_cache_refuses_past_its_limit_and_reuses_freed_blocks() {
    use tandem_core::backend::cuda::qwen35::{device_pool::PoolFull, kv_cache::KV_BLOCK};
    let (g, _turn) = gpu_for("the paged K/V cache");
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let tokens = prompt("p4");
    let gpu = GpuQwen35::upload(g, &m.net, Precision::Exact).unwrap();
    let fresh = {
        let mut s = gpu.new_state().unwrap();
        gpu.forward(&tokens[..40], &mut s, Logits::Last).unwrap()
    };
    let pool = gpu.kv_pool().clone();
    pool.set_limit(Some(3));
    assert_eq!(3 * KV_BLOCK, 48);
    let mut a = gpu.new_state().unwrap();
    let mut first = gpu.new_state().unwrap();
    gpu.forward(&tokens[..20], &mut first, Logits::Last).unwrap();
    assert_eq!(pool.level().used, 2);
    drop(first);
    assert_eq!(pool.level().used, 0, "a dropped state gives its blocks back");
    // Blocks that held another sequence's rows, taken in another order.
    let logits = gpu.forward(&tokens[..40], &mut a, Logits::Last).unwrap();
    assert_eq!(logits, fresh, "reused blocks give other logits than a fresh engine's");
    assert_eq!(pool.level().used, 3);
    let mut b = gpu.new_state().unwrap();
    let refused = gpu.forward(&tokens[..10], &mut b, Logits::Last).unwrap_err();
    assert!(refused.downcast_ref::<PoolFull>().is_some(), "not a PoolFull: {refused:#}");
    assert_eq!(b.position, 0, "a refused call applied something");
    for &t in &tokens[40..48] {
        gpu.forward(&[t], &mut a, Logits::Last).unwrap();
    }
    let refused = gpu.forward(&[tokens[48]], &mut a, Logits::Last).unwrap_err();
    assert!(refused.downcast_ref::<PoolFull>().is_some(), "not a PoolFull: {refused:#}");
    assert_eq!(a.position, 48);
    drop(a);
    gpu.forward(&tokens[..10], &mut b, Logits::Last).unwrap();
    assert_eq!(pool.level().used, 1);
    assert_eq!(pool.available(), Some(2));
}

/// Snapshots kept on the GPU: a snapshot taken where a state's position ends inside a block
/// shares the full blocks and copies that one, so the state going on (writing the rest of that
/// block and more) leaves the snapshot as it was; a state restored from it copies the slot and
/// that block again and shares the rest, and goes on exactly as the original did (the same
/// bits); every block comes back to the pool once the last holder is dropped, in any order.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn device_snapshots_share_full_blocks_and_restore_exactly() {
    use tandem_core::backend::cuda::qwen35::kv_cache::KV_BLOCK;
    let (g, _turn) = gpu_for("snapshots on the GPU");
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let tokens: Vec<u32> = (0..5 * KV_BLOCK as u32).map(|i| (i * 37 + 11) % m.net.config.vocab_size as u32).collect();
    let mut gpu = GpuQwen35::upload(g, &m.net, Precision::Exact).unwrap();
    gpu.keep_snapshots_on_device().unwrap();
    let pool = gpu.kv_pool().clone();
    let at = 2 * KV_BLOCK + 5;
    let mut state = gpu.new_state().unwrap();
    gpu.forward(&tokens[..at], &mut state, Logits::Last).unwrap();
    let then = state.download().unwrap();
    let snap = gpu.snapshot_state(&state).unwrap().expect("this engine keeps snapshots on the GPU");
    assert_eq!(snap.blocks().len(), 3);
    assert_eq!(pool.level().used, 4, "two blocks shared, the third copied");
    // The original goes on: the rest of its third block, and more.
    let rest = &tokens[at..at + 20];
    let went_on = gpu.forward(rest, &mut state, Logits::Last).unwrap();
    assert!(snap.download().unwrap() == then, "the state going on changed its snapshot");
    let mut restored = gpu.restore_state(&snap, true).unwrap();
    assert_eq!(pool.level().used, 4 + 1 + 1, "the original's new block, and the restored state's copy of the third");
    assert!(restored.download().unwrap() == then, "a restored state is not the snapshot");
    let again = gpu.forward(rest, &mut restored, Logits::Last).unwrap();
    assert_eq!(again, went_on, "a restored state went on differently from the original");
    assert!(restored.download().unwrap() == state.download().unwrap());
    // A snapshot at a block's end copies nothing.
    let whole = gpu.forward(&tokens[at + 20..at + 20 + (KV_BLOCK - (at + 20) % KV_BLOCK)], &mut state, Logits::Last).unwrap();
    assert!(!whole.is_empty());
    assert_eq!(state.position % KV_BLOCK, 0);
    let used = pool.level().used;
    let aligned = gpu.snapshot_state(&state).unwrap().unwrap();
    assert_eq!(pool.level().used, used, "a snapshot at a block's end shares every block");
    drop(state);
    drop(snap);
    assert!(aligned.download().is_ok());
    drop(restored);
    drop(aligned);
    assert_eq!(pool.level().used, 0, "every block back once its last holder is gone");
    // After a packed prefill the logits stay on the GPU: a snapshot copies them past its slot,
    // and gives them back (to the host, or to a restored state that asks for them) exactly.
    let (mut a, mut b) = (gpu.new_state().unwrap(), gpu.new_state().unwrap());
    gpu.prefill_batch(&[&tokens[..30], &tokens[7..40]], &mut [&mut a, &mut b]).unwrap();
    let want = b.host_logits().unwrap();
    let snap = gpu.snapshot_state(&b).unwrap().unwrap();
    assert_eq!(&snap.host_logits().unwrap()[..], &want[..]);
    assert!(snap.download().unwrap().last_logits == want);
    let with = gpu.restore_state(&snap, true).unwrap();
    assert_eq!(with.host_logits().unwrap(), want);
    let without = gpu.restore_state(&snap, false).unwrap();
    assert!(!without.has_logits(), "a state restored without its logits has none to sample from");
    drop((a, b, snap, with, without));
    // Down to host memory: a snapshot of a state that went on from another (restored from it)
    // comes over sharing that one's host K/V (only the rows past it cross the bus), reads back
    // whole, and a state placed from its spans is the snapshot, bit for bit, and goes on as
    // the original.
    let mut first = gpu.new_state().unwrap();
    gpu.forward(&tokens[..at], &mut first, Logits::Last).unwrap();
    let early = gpu.snapshot_state(&first).unwrap().unwrap();
    let host_early = early.to_host_snapshot(None).unwrap();
    let mut going = gpu.restore_state(&early, false).unwrap();
    gpu.forward(&tokens[at..at + 30], &mut going, Logits::Last).unwrap();
    let late = gpu.snapshot_state(&going).unwrap().unwrap();
    let host_late = late.to_host_snapshot(Some(&host_early)).unwrap();
    assert_eq!(host_late.spans().count(), 2, "the later snapshot shares the earlier one's K/V");
    assert_eq!(host_late.spans().last(), host_early.spans().next(), "shares the very span");
    assert!(host_late.to_state() == late.download().unwrap(), "a shared host snapshot reads back whole");
    // One of a state computed apart (not restored from it) is compared row by row instead.
    let mut apart = gpu.new_state().unwrap();
    gpu.forward(&tokens[..at + 30], &mut apart, Logits::Last).unwrap();
    let apart = gpu.snapshot_state(&apart).unwrap().unwrap();
    assert!(apart.to_host_snapshot(Some(&host_early)).unwrap().to_state() == apart.download().unwrap());
    let mut placed = gpu.place_snapshot(&host_late).unwrap();
    assert!(placed.download().unwrap() == late.download().unwrap(), "a state placed from host spans is not the snapshot");
    let more = &tokens[at + 30..at + 40];
    assert_eq!(gpu.forward(more, &mut placed, Logits::Last).unwrap(), gpu.forward(more, &mut going, Logits::Last).unwrap());
}

/// State slots: one per state, taken when it is made and given back when it is dropped; past
/// the pool's limit a new state is refused with `PoolFull` until one is freed, and a reused
/// slot starts as zero as a fresh one (the same logits). Recurrent states in bf16: each
/// forward call rounds them once (what the state holds is bf16 values), they stay within 1% of
/// the f32 engine's and give its greedy token on the fixture's prompt; a batched step of bf16
/// states gives each sequence's logits alone; an f32 state is refused by the bf16 engine with a
/// message naming both, and the bridge's move converts it (through the host) instead.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --include-ignored on a GPU machine"]
fn state_slots_are_pooled_and_bf16_states_round_once() {
    use tandem_core::backend::cuda::qwen35::device_pool::PoolFull;
    use tandem_core::backend::cuda::qwen35::state_slots::StateDtype;
    use tandem_core::model::tensor::{bf16_to_f32, f32_to_bf16};
    let (g, _turn) = gpu_for("the state slots");
    let m = LoadedModel::load(common::tiny_dir().to_str().unwrap()).unwrap();
    let tokens = prompt("p4");
    let mut gpu = GpuQwen35::upload(g, &m.net, Precision::Exact).unwrap();
    let fresh = prefilled(&gpu, &tokens[..40]);
    let fresh_logits = fresh.host_logits().unwrap();
    let slots = gpu.slot_pool().clone();
    assert_eq!(slots.level().used, 1);
    slots.set_limit(Some(2));
    let used = gpu.new_state().unwrap();
    let refused = gpu.new_state().err().expect("a third state past a limit of two");
    assert!(refused.downcast_ref::<PoolFull>().is_some(), "not a PoolFull: {refused:#}");
    drop(used);
    let again = prefilled(&gpu, &tokens[..40]);
    assert_eq!(again.host_logits().unwrap(), fresh_logits, "a reused slot gave other logits than a fresh one");
    drop(again);
    slots.set_limit(None);

    let f32_state = fresh.download().unwrap();
    gpu.set_state_dtype(StateDtype::Bf16).unwrap();
    let moved = gpu.forward(&tokens[40..41], &mut gpu_state_copy(&gpu, &fresh), Logits::Last);
    assert!(moved.is_ok(), "a moved state must run: {:?}", moved.err());
    let mut f32_here = fresh;
    let refused = gpu.forward(&tokens[40..41], &mut f32_here, Logits::Last).unwrap_err();
    assert!(format!("{refused:#}").contains("f32") && format!("{refused:#}").contains("bf16"), "{refused:#}");

    let bf16 = prefilled(&gpu, &tokens[..40]);
    let bf16_logits = bf16.host_logits().unwrap();
    let bf16_state = bf16.download().unwrap();
    for l in &bf16_state.layers {
        if let LayerState::Linear { recurrent, .. } = l {
            assert!(recurrent.iter().all(|&x| bf16_to_f32(f32_to_bf16(x)) == x), "a bf16 state holds a value that is not a bf16");
        }
    }
    let err = state_error(&bf16_state, &f32_state);
    let logit_diff = max_abs_diff(&bf16_logits, &fresh_logits);
    eprintln!("bf16 states after 40 tokens: state relative error {err:.2e}, max logit diff {logit_diff:.2e}");
    assert!(err < 1e-2, "bf16 state off by {err} relative");
    assert_eq!(argmax(&bf16_logits), argmax(&fresh_logits), "bf16 states change the greedy token");
    // A host state placed in a bf16 slot comes back rounded, nothing else changed.
    let placed = gpu.upload_state(&f32_state).unwrap().download().unwrap();
    for (a, b) in placed.layers.iter().zip(&f32_state.layers) {
        match (a, b) {
            (LayerState::Linear { conv: c1, recurrent: r1 }, LayerState::Linear { conv: c2, recurrent: r2 }) => {
                assert_eq!(c1, c2);
                assert!(r1.iter().zip(r2.iter()).all(|(x, y)| *x == bf16_to_f32(f32_to_bf16(*y))));
            }
            (LayerState::Full { k: k1, v: v1 }, LayerState::Full { k: k2, v: v2 }) => assert!(k1 == k2 && v1 == v2),
            _ => panic!("layer kinds differ"),
        }
    }
    // Three bf16 states stepped together and alone.
    let mut together: Vec<GpuState> = (0..3).map(|i| prefilled(&gpu, &tokens[i..20 + i])).collect();
    let mut alone: Vec<GpuState> = (0..3).map(|i| prefilled(&gpu, &tokens[i..20 + i])).collect();
    let ids = [tokens[30], tokens[31], tokens[32]];
    for step in 0..3 {
        let mut refs: Vec<_> = together.iter_mut().collect();
        gpu.decode_batch(&ids, &mut refs).unwrap();
        for (s, &id) in alone.iter_mut().zip(&ids) {
            gpu.forward(&[id], s, Logits::Last).unwrap();
        }
        for (t, a) in together.iter_mut().zip(alone.iter_mut()) {
            let diff = max_abs_diff(&t.host_logits().unwrap(), &a.host_logits().unwrap());
            eprintln!("bf16 states, step {step}: batched against alone: max logit diff {diff:.2e}");
            assert!(diff <= 2.0 * LOGIT_TOL, "a batched bf16 step differs from the sequence alone by {diff}");
        }
    }
}

/// `state` brought to `gpu` as the bridge's move does (a copy where the engine cannot run it
/// in place: another GPU, or recurrent states of another dtype).
fn gpu_state_copy(gpu: &GpuQwen35, state: &GpuState) -> GpuState {
    assert!(!gpu.runs_in_place(state));
    gpu.copy_state(state).unwrap()
}
