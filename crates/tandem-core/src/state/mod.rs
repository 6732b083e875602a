//! The per-request model state: everything a Qwen3.5 forward pass carries from one token to
//! the next. It is the unit that prefill hands to decode (and that the bridge moves): it covers
//! tokens `[0, position)` and holds the logits of token `position - 1`.

use crate::config::{LayerType, Qwen35Config};

pub mod bridge;

#[derive(Clone, Debug, PartialEq)]
pub enum LayerState {
    /// Gated DeltaNet layer.
    Linear {
        /// The last `K` raw (pre-conv) qkv columns, time-major `[K, conv_dim]`, oldest first;
        /// zero before the first tokens (the conv's left padding).
        conv: Vec<f32>,
        /// `[Hv, Dk, Dv]`, f32.
        recurrent: Vec<f32>,
    },
    /// Full-attention layer: keys (after k_norm and RoPE) and values, `[position, Hkv, D]`.
    Full { k: Vec<f32>, v: Vec<f32> },
}

#[derive(Clone, Debug, PartialEq)]
pub struct State {
    /// Number of tokens applied.
    pub position: usize,
    pub layers: Vec<LayerState>,
    /// Logits of the last applied token (empty before the first token).
    pub last_logits: Vec<f32>,
}

impl State {
    /// The empty state of a fresh request.
    pub fn new(cfg: &Qwen35Config) -> State {
        let layers = cfg
            .layer_types
            .iter()
            .map(|t| match t {
                LayerType::LinearAttention => LayerState::Linear {
                    conv: vec![0.0; cfg.linear_conv_kernel_dim * cfg.linear_conv_dim()],
                    recurrent: vec![0.0; cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim],
                },
                LayerType::FullAttention => LayerState::Full { k: Vec::new(), v: Vec::new() },
            })
            .collect();
        State { position: 0, layers, last_logits: Vec::new() }
    }

    /// Whether this state fits the model `cfg`: its layer kinds and sizes, and K/V lengths that
    /// agree with its position. An error names the first thing that does not.
    pub fn check_shape(&self, cfg: &Qwen35Config) -> anyhow::Result<()> {
        if self.layers.len() != cfg.layer_types.len() {
            anyhow::bail!("state has {} layers but the model has {}", self.layers.len(), cfg.layer_types.len());
        }
        let (conv_len, rec_len) = (cfg.linear_conv_kernel_dim * cfg.linear_conv_dim(), cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim);
        let kv_len = self.position * cfg.num_key_value_heads * cfg.head_dim;
        for (i, (layer, kind)) in self.layers.iter().zip(&cfg.layer_types).enumerate() {
            match (layer, kind) {
                (LayerState::Linear { conv, recurrent }, LayerType::LinearAttention) => {
                    if conv.len() != conv_len || recurrent.len() != rec_len {
                        anyhow::bail!("state layer {i}: conv {} / recurrent {} values, the model needs {conv_len} / {rec_len}", conv.len(), recurrent.len());
                    }
                }
                (LayerState::Full { k, v }, LayerType::FullAttention) => {
                    if k.len() != kv_len || v.len() != kv_len {
                        anyhow::bail!("state layer {i}: K/V hold {} / {} values, {} tokens need {kv_len}", k.len(), v.len(), self.position);
                    }
                }
                _ => anyhow::bail!("state layer {i} is not of the model's kind ({kind:?})"),
            }
        }
        Ok(())
    }

    /// Bytes of state data (what a transfer has to move).
    pub fn bytes(&self) -> usize {
        let layer_bytes: usize = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Linear { conv, recurrent } => conv.len() + recurrent.len(),
                LayerState::Full { k, v } => k.len() + v.len(),
            })
            .sum();
        4 * (layer_bytes + self.last_logits.len())
    }
}

/// Peak resident memory of this process so far (VmHWM), in bytes; None where /proc is absent.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
