//! The per-request model state: everything a Qwen3.5 forward pass carries from one token to
//! the next. It is the unit that prefill hands to decode (and that the bridge moves): it covers
//! tokens `[0, position)` and holds the logits of token `position - 1`.

use std::sync::Arc;

use crate::model::config::{LayerType, Qwen35Config};

mod device;
mod snapshot;

use crate::bridge::file::StateFile;
pub use device::DeviceState;
pub use snapshot::{new_snapshot_id, HostSnapshot, KvSpan, Lineage, Snapshot, Tier};

#[derive(Clone, Debug, PartialEq)]
pub enum LayerState {
    /// Gated DeltaNet layer.
    Linear {
        /// The last `K` raw (pre-conv) qkv columns, time-major `[K, conv_dim]`, oldest first;
        /// zero before the first tokens (the conv's left padding).
        conv: StateArray,
        /// `[Hv, Dk, Dv]`, f32.
        recurrent: StateArray,
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
                    conv: vec![0.0; cfg.linear_conv_kernel_dim * cfg.linear_conv_dim()].into(),
                    recurrent: vec![0.0; cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim].into(),
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

    /// Bytes of its attention layers' K/V.
    pub fn kv_bytes(&self) -> usize {
        4 * self.layers.iter().map(|l| if let LayerState::Full { k, v } = l { k.len() + v.len() } else { 0 }).sum::<usize>()
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

/// A fixed-size f32 array of a state (a conv window, a recurrent state): in this process's
/// memory, or in place in a state file that the file bridge wrote, so that a state handed over
/// through a file is used where it lies instead of being copied out (see `bridge::read_file`).
pub enum StateArray {
    Owned(Vec<f32>),
    /// `len` values at `ptr`, inside the mapping of `file`, which this array keeps alive.
    InFile { file: Arc<StateFile>, ptr: *mut f32, len: usize },
}

// SAFETY: an InFile array is the only user of its region of the mapping (the bridge hands each
// region to one array, and a state file is rewritten only when no array holds it: see
// `StateFile::write`), so it can move between threads like the Vec it stands for.
unsafe impl Send for StateArray {}
unsafe impl Sync for StateArray {}

impl StateArray {
    pub fn in_file(&self) -> bool {
        matches!(self, StateArray::InFile { .. })
    }

    /// The buffer to reuse for another state (empty for an array in a file).
    pub fn into_vec(self) -> Vec<f32> {
        match self {
            StateArray::Owned(v) => v,
            StateArray::InFile { .. } => Vec::new(),
        }
    }
}

impl From<Vec<f32>> for StateArray {
    fn from(v: Vec<f32>) -> Self {
        StateArray::Owned(v)
    }
}

impl std::ops::Deref for StateArray {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            StateArray::Owned(v) => v,
            // SAFETY: `ptr` and `len` lie inside the mapping that `file` keeps alive, aligned
            // (payloads start on 64-byte boundaries), and no one else uses the region.
            StateArray::InFile { ptr, len, .. } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }
}

impl std::ops::DerefMut for StateArray {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            StateArray::Owned(v) => v,
            // SAFETY: as in `deref`; `&mut self` makes this the only access.
            StateArray::InFile { ptr, len, .. } => unsafe { std::slice::from_raw_parts_mut(*ptr, *len) },
        }
    }
}

/// A clone is always owned: a copy of the values, not a second user of the file.
impl Clone for StateArray {
    fn clone(&self) -> Self {
        StateArray::Owned(self.to_vec())
    }
}

impl PartialEq for StateArray {
    fn eq(&self, other: &Self) -> bool {
        self[..] == other[..]
    }
}

impl std::fmt::Debug for StateArray {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}({} values)", if self.in_file() { "InFile" } else { "Owned" }, self.len())
    }
}

impl State {
    /// Whether some of this state's arrays live in a state file.
    pub fn in_file(&self) -> bool {
        self.file().is_some()
    }

    /// The state file that some of this state's arrays live in, if any.
    pub fn file(&self) -> Option<&Arc<StateFile>> {
        self.layers.iter().find_map(|l| match l {
            LayerState::Linear { conv: StateArray::InFile { file, .. }, .. } | LayerState::Linear { recurrent: StateArray::InFile { file, .. }, .. } => Some(file),
            _ => None,
        })
    }

    /// This state with every array in this process's memory (copied out of its file, which is
    /// then free for reuse): for a state that outlives its request.
    pub fn into_owned(mut self) -> State {
        for l in &mut self.layers {
            if let LayerState::Linear { conv, recurrent } = l {
                for a in [conv, recurrent] {
                    if a.in_file() {
                        *a = StateArray::Owned(a.to_vec());
                    }
                }
            }
        }
        self
    }
}
