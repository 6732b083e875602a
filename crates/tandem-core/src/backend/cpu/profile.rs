//! Where a CPU forward pass spends its time, phase by phase, while switched on (`enable`): the
//! wall-clock time of each phase summed over passes, read and cleared by `take`. For `tandem
//! bench`'s table of a prefill's phases; off, a phase costs one relaxed load.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The phases of a forward pass that are timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The layers' matrix products (projections and MLP).
    Products,
    /// The LM head's product.
    LmHead,
    /// DeltaNet: the causal conv, q/k normalisation and the gated RMSNorm.
    DeltaNetConvNorms,
    /// DeltaNet: the delta rule over the tokens, per value head.
    DeltaNetRecurrence,
    /// Attention: q/k norms, RoPE, the cache append.
    AttentionPrep,
    /// Attention: softmax(q kᵀ) v per head, and the output gate.
    Attention,
    /// The MLP's SwiGLU.
    SwiGlu,
    /// Embedding, the layer norms and the residual adds.
    NormsResidual,
}

pub const PHASES: [Phase; 8] =
    [Phase::Products, Phase::LmHead, Phase::DeltaNetConvNorms, Phase::DeltaNetRecurrence, Phase::AttentionPrep, Phase::Attention, Phase::SwiGlu, Phase::NormsResidual];

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Products => "layer products",
            Phase::LmHead => "LM head",
            Phase::DeltaNetConvNorms => "DeltaNet conv and norms",
            Phase::DeltaNetRecurrence => "DeltaNet recurrence",
            Phase::AttentionPrep => "attention q/k norms, RoPE, cache",
            Phase::Attention => "attention",
            Phase::SwiGlu => "SwiGLU",
            Phase::NormsResidual => "embedding, norms, residual",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; PHASES.len()] = [const { AtomicU64::new(0) }; PHASES.len()];

/// Switch the timing on or off (process-wide).
pub fn enable(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Each phase's summed time since the last `take`, and clear them.
pub fn take() -> Vec<(Phase, Duration)> {
    PHASES.iter().map(|&p| (p, Duration::from_nanos(NANOS[p as usize].swap(0, Ordering::Relaxed)))).collect()
}

/// Times `phase` from now until dropped, if timing is on.
pub struct Timer(Option<(Phase, Instant)>);

pub fn time(phase: Phase) -> Timer {
    Timer(ON.load(Ordering::Relaxed).then(|| (phase, Instant::now())))
}

impl Timer {
    /// Run `f` under this timer.
    pub fn run<R>(self, f: impl FnOnce() -> R) -> R {
        let r = f();
        drop(self);
        r
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        if let Some((phase, t)) = self.0 {
            NANOS[phase as usize].fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }
}
