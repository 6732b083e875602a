//! The model: its config (mirroring config.json), the checkpoint's tensors (safetensors,
//! memory-mapped; GGUF files, `gguf`), weights in their stored dtype, int8 or GGML's block
//! formats (`blocks`, `quant`), the Qwen3.5 decoder's weights and description, synthetic
//! models of the published shapes, and loading any of them by name.

pub mod blocks;
pub mod checkpoint;
pub mod config;
pub mod gguf;
pub mod load;
pub mod quant;
mod qwen35;
pub mod synthetic;
pub mod tensor;

pub use qwen35::Qwen35;
pub(crate) use qwen35::{GatedAttention, GatedDeltaNet, Mixer, Mlp};

/// Which positions of a forward pass need logits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Logits {
    /// Only the last token (prefill before generation, decode).
    Last,
    /// Every token (verification against the reference).
    All,
    /// None: the layers only, for a piece of a prompt that more pieces follow before anything
    /// samples (the LM head is the largest single read of a pass: a 410-token prompt in
    /// 128-token pieces computed it four times). A CPU pass empties the state's `last_logits`,
    /// so that nothing samples stale ones; a GPU pass computes the last token's as for `Last`.
    Skip,
}
