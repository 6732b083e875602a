//! `tandem verify`: compare the engine with a reference file in the golden fixtures' format
//! (see tests/fixtures/README.md and scripts/make_reference.py): prefill logits at every position,
//! the state of every layer, and a greedy continuation fed back through the state.
//!
//! Two conventions of how the reference was produced are read from the file's metadata, with
//! defaults that describe the golden fixture (both measured, see
//! docs/results/2026-11-23-cpu-exactness-study-serving.md):
//! * `linear_state_at`: `"prompt"` or `"prompt+greedy"` (default). The fixture's conv and
//!   recurrent tensors hold the state after the prompt *and* the greedy tokens: HF updates
//!   those cache tensors in place during the continuation. Its K/V are post-prompt.
//! * `rope_inv_freq`: `"f32"` or `"bf16"` (default). The fixture's model was built in bf16 and
//!   cast to f32, which rounded the RoPE frequency buffer to bf16.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{bail, Context, Result};
use safetensors::{Dtype, SafeTensors};

use crate::model::config::Qwen35Config;
use crate::backend::cpu::CpuPrecision;
use crate::model::{Logits, Qwen35};
use crate::backend::cpu::pool::Pool;
use crate::sampling::argmax;
use crate::state::{LayerState, State};

/// Logits: `LOGIT_REL_TOL` of the largest reference logit of the item, and never less than
/// `LOGIT_TOL` (so the tolerance scales with the logits as the states' does, and a model whose
/// logits are five times larger is held to the same relative error). States: relative to the
/// tensor's largest value.
///
/// Why 5e-4: the reference is itself a float32 computation. At a few positions of the golden
/// fixture a DeltaNet head output nearly cancels, and there rounding is amplified: the
/// reference implementation's own float32 logits of its 300-token prompt differ from the same
/// model computed in float64 by up to 2.07e-3 (4.4e-4 of the largest logit, 4.75; at
/// position 72; `scripts/make_reference.py --dtype float64`). A tighter tolerance would fail
/// the reference itself. A wrong formula moves these logits by far more (the fixture's
/// weights are drawn at a scale where it does).
pub const LOGIT_TOL: f32 = 1e-3;
pub const LOGIT_REL_TOL: f32 = 5e-4;
pub const STATE_REL_TOL: f32 = 1e-3;

/// What a comparison allows: logits within `logit_rel` of the reference's largest logit (and
/// never less than `logit_abs`), states within `state_rel` of the tensor's largest value, and
/// with `near_ties` a greedy pick that differs where the reference's best two logits are
/// closer than the logit tolerance.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub logit_abs: f32,
    pub logit_rel: f32,
    pub state_rel: f32,
    pub near_ties: bool,
}

/// The exact engines against the reference implementation (see `LOGIT_REL_TOL`).
pub const EXACT: Tolerance = Tolerance { logit_abs: LOGIT_TOL, logit_rel: LOGIT_REL_TOL, state_rel: STATE_REL_TOL, near_ties: false };

/// `precision=fast` against its own arithmetic done by the exact kernels (`FastReference`):
/// the two differ only in the order of f32 sums, but a sum that differs in its last bit can
/// round to the neighbouring bf16 (or int8 step) where it next enters a product, and that
/// difference (2^-8 of the value, not 2^-24) travels on. 2e-2 of the largest logit is the
/// bound the GPU's tensor-core decode is held to against itself in another summation order
/// (tests/cuda.rs, measured there at up to 7e-3 on the same fixture). States: the same 2e-2
/// of the tensor's largest value. Each item may also differ by `ROUNDING_SHARE` of what the
/// rounding itself moved it (see there).
pub const SUMMATION_ORDER: Tolerance = Tolerance { logit_abs: LOGIT_TOL, logit_rel: 2e-2, state_rel: 2e-2, near_ties: true };

/// How far `precision=fast` may be from its arithmetic by the exact kernels, as a share of how
/// far that arithmetic is from the reference on the same item. Where a model magnifies small
/// differences (the golden fixture's random weights do: its float32 and float64 logits differ
/// 7,000 times more than one float32 rounding), a difference in the last bit of a sum grows
/// too, but stays far below what rounding the inputs to bf16 grows to, which is 2^15 times
/// larger to begin with: measured on the fixture's 300-token prompt, fast is 0.12-0.20 from
/// its arithmetic where that is 4.57 from the reference (1/23-1/39). Where a sum's last bit
/// tips one activation to the neighbouring bf16, the item moves by a share of the rounding's
/// own effect that depends on which activation tipped: two builds whose other kernels differ
/// only in their exp (libm's, then a polynomial) put the fixture's 64-token prompt at 14% and
/// then 30% of it, the other prompts at 3-15%. A kernel that rounds or quantizes wrongly (a
/// truncation for a rounding, a scale of the wrong block, a lost pair of products) errs by as
/// much as the rounding itself, and fails.
pub const ROUNDING_SHARE: f32 = 0.5;

/// The absolute tolerance of logits whose reference is `want`: `LOGIT_REL_TOL` of its largest
/// magnitude, at least `LOGIT_TOL` (the golden fixture's logits, up to 4.75, get 2.4e-3).
pub fn logit_tolerance(want: &[f32]) -> f32 {
    EXACT.logits(want)
}

impl Tolerance {
    /// The absolute tolerance of logits whose reference is `want`.
    pub fn logits(&self, want: &[f32]) -> f32 {
        self.logit_abs.max(self.logit_rel * largest_magnitude(want))
    }
}

fn largest_magnitude(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

#[derive(Debug, Clone)]
pub struct Check {
    /// e.g. "p3 prefill logits", "p3 layer 4 recurrent".
    pub item: String,
    /// Largest absolute error (for states: relative to the reference's largest magnitude).
    pub error: f32,
    pub tolerance: f32,
    pub relative: bool,
    pub detail: String,
    /// Logits: at how many of how many positions the largest logit is the reference's.
    pub top1: Option<(usize, usize)>,
}

impl Check {
    pub fn passed(&self) -> bool {
        self.error <= self.tolerance
    }
}

struct RefTensor {
    shape: Vec<usize>,
    f32s: Vec<f32>,
    i64s: Vec<i64>,
}

/// A reference file's tensors and the conventions it was produced with; or the same made by
/// running one of our engines (`Reference::made_by`).
struct Reference {
    tensors: BTreeMap<String, RefTensor>,
    /// The conv and recurrent states are those after the prompt and the greedy tokens (else
    /// after the prompt).
    linear_after_greedy: bool,
    /// The RoPE frequencies were rounded to bf16.
    rope_bf16: bool,
    /// Where the tensors came from, for error messages.
    source: String,
}

impl Reference {
    fn read(path: &Path) -> Result<Reference> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| anyhow::anyhow!("{}: not a valid safetensors file ({e})", path.display()))?;
        let meta = meta.metadata().clone().unwrap_or_default();
        let st = SafeTensors::deserialize(&bytes).map_err(|e| anyhow::anyhow!("{}: not a valid safetensors file ({e})", path.display()))?;
        let mut tensors = BTreeMap::new();
        for (name, view) in st.tensors() {
            let data = view.data();
            let (f32s, i64s) = match view.dtype() {
                Dtype::F32 => (data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(), vec![]),
                Dtype::I64 => (vec![], data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()),
                other => bail!("{}: tensor {name} has dtype {other:?}; reference files hold f32 and i64", path.display()),
            };
            tensors.insert(name, RefTensor { shape: view.shape().to_vec(), f32s, i64s });
        }
        let linear_after_greedy = convention(&meta, "linear_state_at", "prompt+greedy", &["prompt", "prompt+greedy"], path)? == "prompt+greedy";
        let rope_bf16 = convention(&meta, "rope_inv_freq", "bf16", &["f32", "bf16"], path)? == "bf16";
        let r = Reference { tensors, linear_after_greedy, rope_bf16, source: path.display().to_string() };
        if r.prompts().is_empty() {
            bail!("{}: no prompts (tensors named <prompt>.input_ids)", r.source);
        }
        Ok(r)
    }

    fn get(&self, name: &str) -> Result<&RefTensor> {
        self.tensors.get(name).with_context(|| format!("{}: tensor {name} is missing", self.source))
    }

    fn prompts(&self) -> Vec<String> {
        self.tensors.keys().filter_map(|k| k.strip_suffix(".input_ids")).map(String::from).collect()
    }

    fn input_ids(&self, p: &str) -> Result<Vec<u32>> {
        self.get(&format!("{p}.input_ids"))?
            .i64s
            .iter()
            .map(|&i| u32::try_from(i).with_context(|| format!("{}: {p}.input_ids holds {i}, not a token id", self.source)))
            .collect()
    }

    /// What `forward` computes on this reference's prompts, recorded as this reference records
    /// its own: the prompt's logits at every position, a greedy continuation of the same
    /// length (each pick fed back) with the logits after each token, the K/V after the prompt
    /// and the linear layers' state after the continuation.
    fn made_by(&self, config: &Qwen35Config, forward: &Step, name: &str) -> Result<Reference> {
        let mut tensors = BTreeMap::new();
        let f32s = |shape: Vec<usize>, f32s: Vec<f32>| RefTensor { shape, f32s, i64s: vec![] };
        let i64s = |i64s: Vec<i64>| RefTensor { shape: vec![i64s.len()], f32s: vec![], i64s };
        for p in self.prompts() {
            let ids = self.input_ids(&p)?;
            let greedy = self.get(&format!("{p}.greedy_ids"))?.i64s.len();
            let mut state = State::new(config);
            let logits = forward(&ids, &mut state, Logits::All)?;
            tensors.insert(format!("{p}.prefill_logits"), f32s(vec![ids.len(), config.vocab_size], logits));
            let after_prompt = state.clone();
            let (mut picks, mut steps) = (vec![argmax(&state.last_logits) as i64], Vec::new());
            for i in 0..greedy {
                let step = forward(&[picks[i] as u32], &mut state, Logits::Last)?;
                if i + 1 < greedy {
                    picks.push(argmax(&step) as i64);
                }
                steps.extend_from_slice(&step);
            }
            tensors.insert(format!("{p}.greedy_logits"), f32s(vec![greedy, config.vocab_size], steps));
            tensors.insert(format!("{p}.greedy_ids"), i64s(picks));
            for (_, tensor, values) in state_tensors(config, &p, ids.len(), &after_prompt, &state)? {
                tensors.insert(tensor, f32s(vec![values.len()], values));
            }
            tensors.insert(format!("{p}.input_ids"), i64s(ids.iter().map(|&i| i as i64).collect()));
        }
        Ok(Reference { tensors, linear_after_greedy: true, rope_bf16: self.rope_bf16, source: name.to_string() })
    }
}

fn convention<'a>(meta: &'a HashMap<String, String>, key: &str, default: &'a str, allowed: &[&str], path: &Path) -> Result<&'a str> {
    let v = meta.get(key).map(String::as_str).unwrap_or(default);
    if !allowed.contains(&v) {
        bail!("{}: metadata {key} = {v:?}, expected one of {allowed:?}", path.display());
    }
    Ok(v)
}

/// Run every prompt of the reference file and return one check per compared item.
/// `net` is borrowed mutably only to set the RoPE frequency convention; it is restored.
pub fn verify(pool: &Pool, net: &mut Qwen35, reference: &Path) -> Result<Vec<Check>> {
    verify_with(net, reference, &|net: &Qwen35, tokens: &[u32], state: &mut State, which: Logits| net.forward(pool, tokens, state, which))
}

/// `verify` on a GPU: the same checks, every forward run by `gpu` on a state uploaded to it
/// and downloaded after (so the states compared are the GPU's).
pub fn verify_cuda(gpu: &mut crate::backend::cuda::qwen35::GpuQwen35, net: &mut Qwen35, reference: &Path) -> Result<Vec<Check>> {
    let gpu = std::cell::RefCell::new(gpu);
    verify_with(net, reference, &|net: &Qwen35, tokens: &[u32], state: &mut State, which: Logits| {
        let mut g = gpu.borrow_mut();
        g.set_rope_frequencies(net)?;
        g.forward_host(tokens, state, which)
    })
}

/// A forward pass of some engine over `net`'s weights (with `net`'s RoPE convention).
type ForwardFn<'a> = dyn Fn(&Qwen35, &[u32], &mut State, Logits) -> Result<Vec<f32>> + 'a;

fn verify_with(net: &mut Qwen35, reference: &Path, forward: &ForwardFn) -> Result<Vec<Check>> {
    let r = Reference::read(reference)?;
    net.set_rope_frequencies_bf16(r.rope_bf16);
    let result = run_checks(&net.config, &|tokens: &[u32], state: &mut State, which: Logits| forward(net, tokens, state, which), &r, EXACT);
    net.set_rope_frequencies_bf16(false);
    result
}

/// `verify --precision fast` on the CPU.
pub struct FastVerification {
    /// The pass/fail checks: `precision=fast` against its own arithmetic by the exact kernels
    /// (`CpuPrecision::FastReference`; with bf16 weights the tensor-core emulation of
    /// `--precision tensor-cores`), within `SUMMATION_ORDER` or `ROUNDING_SHARE` of what the
    /// rounding moved the item.
    pub checks: Vec<Check>,
    /// What each precision gets against the reference file and against exact, each item with
    /// the exact tolerance: `(precision, against, checks)`. Reported, not a pass criterion.
    pub costs: Vec<(&'static str, &'static str, Vec<Check>)>,
}

/// The fast precision against the reference file, against exact, and against its own
/// arithmetic. `net`'s precision and RoPE convention are restored.
pub fn verify_fast(pool: &Pool, net: &mut Qwen35, reference: &Path) -> Result<FastVerification> {
    verify_as_fast(pool, net, reference, CpuPrecision::Fast)
}

/// `verify_fast` with `candidate` in the place of `precision=fast` (the tests' way to show that
/// the checks fail a precision that does not compute fast's arithmetic).
fn verify_as_fast(pool: &Pool, net: &mut Qwen35, reference: &Path, candidate: CpuPrecision) -> Result<FastVerification> {
    let r = Reference::read(reference)?;
    let was = net.cpu_precision();
    net.set_rope_frequencies_bf16(r.rope_bf16);
    let mut run = || -> Result<FastVerification> {
        let mut costs = Vec::new();
        let config = net.config.clone();

        // Each precision's forward borrows `net` until its block ends.
        net.set_cpu_precision(CpuPrecision::Exact);
        let exact = {
            let exact = cpu_forward(pool, net);
            costs.push(("exact", "the reference", run_checks(&config, &exact, &r, EXACT)?));
            r.made_by(&config, &exact, "the exact precision")?
        };

        net.set_cpu_precision(CpuPrecision::FastReference);
        let (rounding, arithmetic) = {
            let arithmetic = cpu_forward(pool, net);
            costs.push(("fast's arithmetic, plain kernels", "the reference", run_checks(&config, &arithmetic, &r, EXACT)?));
            (run_checks(&config, &arithmetic, &exact, EXACT)?, r.made_by(&config, &arithmetic, "precision=fast's arithmetic by plain kernels")?)
        };

        net.set_cpu_precision(candidate);
        let fast = cpu_forward(pool, net);
        costs.push(("fast", "the reference", run_checks(&config, &fast, &r, EXACT)?));
        costs.push(("fast's arithmetic, plain kernels", "exact", rounding.clone()));
        costs.push(("fast", "exact", run_checks(&config, &fast, &exact, EXACT)?));
        let mut checks = run_checks(&config, &fast, &arithmetic, SUMMATION_ORDER)?;
        // What rounding the inputs moved each item (the same items in the same order).
        for (c, rounded) in checks.iter_mut().zip(&rounding) {
            debug_assert_eq!(c.item, rounded.item);
            if c.tolerance > 0.0 && ROUNDING_SHARE * rounded.error > c.tolerance {
                c.tolerance = ROUNDING_SHARE * rounded.error;
                c.detail += &format!(", or {ROUNDING_SHARE} x the rounding's own {:.2e}", rounded.error);
            }
        }
        Ok(FastVerification { checks, costs })
    };
    let result = run();
    net.set_cpu_precision(was);
    net.set_rope_frequencies_bf16(false);
    result
}

/// `net`'s CPU forward pass as a `Step`.
fn cpu_forward<'a>(pool: &'a Pool, net: &'a Qwen35) -> impl Fn(&[u32], &mut State, Logits) -> Result<Vec<f32>> + 'a {
    move |tokens: &[u32], state: &mut State, which: Logits| net.forward(pool, tokens, state, which)
}

type Step<'a> = dyn Fn(&[u32], &mut State, Logits) -> Result<Vec<f32>> + 'a;

fn run_checks(config: &Qwen35Config, forward: &Step, r: &Reference, tol: Tolerance) -> Result<Vec<Check>> {
    let vocab = config.vocab_size;
    let mut checks = Vec::new();
    for p in &r.prompts() {
        let ids = r.input_ids(p)?;
        let l = ids.len();
        if l == 0 {
            bail!("{}: {p}.input_ids is empty", r.source);
        }

        // 1. One forward over the whole prompt, logits at every position.
        let mut state = State::new(config);
        let logits = forward(&ids, &mut state, Logits::All)?;
        let want = r.get(&format!("{p}.prefill_logits"))?;
        if want.shape != [l, vocab] {
            bail!("{}: {p}.prefill_logits has shape {:?}, expected [{l}, {vocab}]", r.source, want.shape);
        }
        checks.push(logit_check(format!("{p} prefill logits ({l} tokens)"), &logits, &want.f32s, vocab, tol));
        let after_prompt = state.clone();

        // 2. Greedy continuation through the state: ids[0] from the prefill's last logits, then
        //    logits[i] after feeding ids[i]. The reference's ids are fed, so that one early
        //    mismatch does not hide the later logits.
        let want_ids = &r.get(&format!("{p}.greedy_ids"))?.i64s;
        let want_logits = &r.get(&format!("{p}.greedy_logits"))?.f32s;
        if want_logits.len() != want_ids.len() * vocab {
            bail!("{}: {p}.greedy_logits holds {} values, expected {} steps of {vocab}", r.source, want_logits.len(), want_ids.len());
        }
        let mut got_ids = vec![argmax(&state.last_logits) as i64];
        let mut got_logits = Vec::with_capacity(want_logits.len());
        for i in 0..want_ids.len() {
            let step = forward(&[want_ids[i] as u32], &mut state, Logits::Last)?;
            got_logits.extend_from_slice(&step);
            if i + 1 < want_ids.len() {
                got_ids.push(argmax(&step) as i64);
            }
        }
        // The logits each pick was made from: the prompt's last, then each step's.
        let pick_rows = || std::iter::once(&want.f32s[(l - 1) * vocab..]).chain(want_logits.chunks(vocab));
        let near_tie = tol.logits(want_logits).max(tol.logits(&want.f32s));
        let differ = got_ids
            .iter()
            .zip(want_ids.iter())
            .zip(pick_rows())
            .filter(|((g, w), row)| g != w && !(tol.near_ties && row.get(**w as usize).zip(row.get(**g as usize)).is_some_and(|(w, g)| w - g <= near_tie)))
            .count();
        let same = got_ids.iter().zip(want_ids.iter()).filter(|(a, b)| a == b).count();
        checks.push(Check {
            item: format!("{p} greedy ids"),
            error: differ as f32,
            tolerance: 0.0,
            relative: false,
            detail: if tol.near_ties { format!("{same}/{} identical, {differ} differ where the best two are apart by more than {near_tie:.1e}", want_ids.len()) } else { format!("{same}/{} identical", want_ids.len()) },
            top1: Some((same, want_ids.len())),
        });
        checks.push(logit_check(format!("{p} greedy decode logits ({} steps)", want_ids.len()), &got_logits, want_logits, vocab, tol));

        // 3. States, layer by layer: K/V after the prompt; conv and recurrent where the
        //    reference recorded them.
        let linear_state = if r.linear_after_greedy { &state } else { &after_prompt };
        for (item, tensor, got) in state_tensors(config, p, l, &after_prompt, linear_state)? {
            checks.push(rel_check(item, &got, &r.get(&tensor)?.f32s, tol));
        }
    }
    Ok(checks)
}

/// A state tensor as reference files lay it out: its check's name, its tensor's name, values.
type StateTensor = (String, String, Vec<f32>);

/// The states of prompt `p` as the reference files lay them out: K/V from `after_prompt`,
/// conv and recurrent from `linear_state`.
fn state_tensors(c: &Qwen35Config, p: &str, l: usize, after_prompt: &State, linear_state: &State) -> Result<Vec<StateTensor>> {
    let mut out = Vec::new();
    let mut push = |item: String, tensor: String, t: Vec<f32>| out.push((item, tensor, t));
    for (i, (kv_layer, lin_layer)) in after_prompt.layers.iter().zip(&linear_state.layers).enumerate() {
        match (kv_layer, lin_layer) {
            (_, LayerState::Linear { conv, recurrent }) => {
                // Ours is [K, conv_dim] time-major; the reference is [conv_dim, K].
                let (k, cd) = (c.linear_conv_kernel_dim, c.linear_conv_dim());
                let mut t = vec![0f32; conv.len()];
                for j in 0..k {
                    for ch in 0..cd {
                        t[ch * k + j] = conv[j * cd + ch];
                    }
                }
                push(format!("{p} layer {i} conv window"), format!("{p}.state.{i}.conv"), t);
                push(format!("{p} layer {i} recurrent state"), format!("{p}.state.{i}.recurrent"), recurrent.to_vec());
            }
            (LayerState::Full { k, v }, _) => {
                // Ours is [L, Hkv, D]; the reference is [Hkv, L, D].
                let (hkv, d) = (c.num_key_value_heads, c.head_dim);
                let to_ref = |x: &[f32]| {
                    let mut t = vec![0f32; x.len()];
                    for pos in 0..l {
                        for h in 0..hkv {
                            t[(h * l + pos) * d..(h * l + pos + 1) * d].copy_from_slice(&x[(pos * hkv + h) * d..(pos * hkv + h + 1) * d]);
                        }
                    }
                    t
                };
                push(format!("{p} layer {i} keys"), format!("{p}.state.{i}.k"), to_ref(k));
                push(format!("{p} layer {i} values"), format!("{p}.state.{i}.v"), to_ref(v));
            }
            _ => bail!("layer {i}: state kinds disagree"),
        }
    }
    Ok(out)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) })
}

/// Largest absolute logit error, the position (row of `vocab` logits) where it is, and at how
/// many positions the largest logit is the reference's.
fn logit_check(item: String, got: &[f32], want: &[f32], vocab: usize, tol: Tolerance) -> Check {
    let tolerance = tol.logits(want);
    if got.len() != want.len() {
        return Check { item, error: f32::INFINITY, tolerance, relative: false, detail: format!("{} logits vs {} in the reference", got.len(), want.len()), top1: None };
    }
    let (mut worst, mut worst_row, mut agree) = (0f32, 0, 0);
    for (row, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let abs = max_abs_diff(g, w);
        if abs > worst || abs.is_nan() {
            (worst, worst_row) = (if abs.is_nan() { f32::INFINITY } else { abs }, row);
        }
        agree += (argmax(g) == argmax(w)) as usize;
    }
    let rows = want.len() / vocab;
    let scale = largest_magnitude(want);
    let detail = format!(
        "max |err| {worst:.2e} at position {worst_row}, top-1 {agree}/{rows}; tolerance max({:.0e}, {:.0e} x max |ref| {scale:.2})",
        tol.logit_abs, tol.logit_rel
    );
    Check { item, error: worst, tolerance, relative: false, detail, top1: Some((agree, rows)) }
}

fn rel_check(item: String, got: &[f32], want: &[f32], tol: Tolerance) -> Check {
    let scale = largest_magnitude(want).max(f32::MIN_POSITIVE);
    let abs = max_abs_diff(got, want);
    let error = abs / scale;
    Check { item, error, tolerance: tol.state_rel, relative: true, detail: format!("max |err| {abs:.2e} = {error:.2e} of max |ref| {scale:.2e}"), top1: None }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny")
    }

    /// `verify --precision fast` on the golden fixture, on every instruction-set level: bf16
    /// weights within the summation-order tolerance of their arithmetic by plain kernels (where
    /// the CPU has no `vdpbf16ps`, exactly: the same kernels then), int8 weights exactly; and
    /// the table of costs against the reference shows what rounding costs.
    #[test]
    fn the_fast_precision_passes_verify_on_every_isa() {
        let pool = Pool::new(2);
        let reference = tiny_dir().join("reference.safetensors");
        let dir = tiny_dir();
        for int8 in [false, true] {
            let mut m = if int8 { crate::model::load::LoadedModel::load_int8(dir.to_str().unwrap(), &pool) } else { crate::model::load::LoadedModel::load(dir.to_str().unwrap()) }.unwrap();
            crate::backend::cpu::kernels::for_each_isa(|isa| {
                let v = verify_fast(&pool, &mut m.net, &reference).unwrap();
                let failed: Vec<_> = v.checks.iter().filter(|c| !c.passed()).collect();
                assert!(failed.is_empty(), "{isa:?} int8 {int8}: {failed:?}");
                let largest = v.checks.iter().map(|c| c.error).fold(0f32, f32::max);
                let dot = isa >= crate::backend::cpu::kernels::Isa::Avx512Dot;
                if int8 || !dot {
                    assert_eq!(largest, 0.0, "{isa:?} int8 {int8}: fast is not its arithmetic's bits");
                }
                assert_eq!(m.net.cpu_precision(), CpuPrecision::Exact, "the precision was not restored");
                // What rounding costs is reported: the rounded arithmetic is off exact (int8
                // weights round nothing without the dot-product instructions).
                let (name, against, rounding) = &v.costs[3];
                assert_eq!((*name, *against), ("fast's arithmetic, plain kernels", "exact"));
                assert_eq!(rounding.iter().any(|c| !c.passed()), !int8 || dot, "{isa:?} int8 {int8}: what rounding the inputs changed");
            });
        }
    }

    /// The checks fail a precision that skips fast's rounding: exact, put in fast's place.
    #[test]
    fn verify_fast_fails_a_precision_that_does_not_round() {
        let pool = Pool::new(2);
        let _same_kernels = crate::backend::cpu::kernels::hold_isa();
        let mut m = crate::model::load::LoadedModel::load(tiny_dir().to_str().unwrap()).unwrap();
        let v = verify_as_fast(&pool, &mut m.net, &tiny_dir().join("reference.safetensors"), CpuPrecision::Exact).unwrap();
        let failed: Vec<_> = v.checks.iter().filter(|c| !c.passed()).map(|c| c.item.as_str()).collect();
        assert!(failed.iter().any(|i| i.contains("prefill logits")) && failed.iter().any(|i| i.contains("recurrent")), "{failed:?}");
        // The tensor-core emulation is fast's arithmetic for bf16 weights: it passes, exactly.
        let v = verify_as_fast(&pool, &mut m.net, &tiny_dir().join("reference.safetensors"), CpuPrecision::Bf16Inputs).unwrap();
        assert!(v.checks.iter().all(|c| c.error == 0.0), "{:?}", v.checks.iter().find(|c| c.error != 0.0));
    }

    /// The same relative logit error passes whatever the logits' scale; small logits keep the
    /// absolute 1e-3.
    #[test]
    fn the_logit_tolerance_scales_with_the_logits() {
        let vocab = 64;
        let want: Vec<f32> = (0..2 * vocab).map(|i| 1.5 * ((i * 37 % 101) as f32 / 50.0 - 1.0)).collect();
        let scale = largest_magnitude(&want);
        assert!(scale > 1.45 && scale <= 1.5);
        assert_eq!(logit_tolerance(&want), LOGIT_TOL);
        let off_by = |want: &[f32], err: f32| {
            let mut got = want.to_vec();
            got[vocab + 3] += err;
            logit_check("logits".into(), &got, want, vocab, EXACT)
        };
        assert!(off_by(&want, 0.9e-3).passed());
        assert!(!off_by(&want, 1.1e-3).passed());
        // Five times larger logits, five times the error: the same relative error passes.
        let large: Vec<f32> = want.iter().map(|v| 5.0 * v).collect();
        let check = off_by(&large, 3.6e-3);
        assert!(check.passed(), "{check:?}");
        assert!((check.tolerance - LOGIT_REL_TOL * 5.0 * scale).abs() < 1e-6, "{check:?}");
        assert!(check.detail.contains("tolerance max(1e-3, 5e-4 x max |ref|"), "{}", check.detail);
        assert!(!off_by(&large, 4e-3).passed());
    }
}
