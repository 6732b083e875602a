//! A request's state where its engine keeps it: in host memory (CPU engines, and the file and
//! socket bridges, which move host states) or in a GPU's memory. `bridge::device` moves it
//! from one to the other.

use anyhow::Result;

use super::State;
use crate::backend::cuda::qwen35::kv_cache::KV_BLOCK;
use crate::backend::cuda::qwen35::{GpuQwen35, GpuState};

pub enum DeviceState {
    Host(State),
    Gpu(Box<GpuState>),
}

impl DeviceState {
    pub fn position(&self) -> usize {
        match self {
            DeviceState::Host(s) => s.position,
            DeviceState::Gpu(s) => s.position,
        }
    }

    /// Logits of the last applied token, on the host (copied there first if a GPU decode step
    /// left them on the GPU).
    pub fn last_logits(&mut self) -> Result<&[f32]> {
        match self {
            DeviceState::Host(s) => Ok(&s.last_logits),
            DeviceState::Gpu(s) => s.last_logits(),
        }
    }

    /// Whether there are logits to sample from (a fresh state has none).
    pub fn has_logits(&self) -> bool {
        match self {
            DeviceState::Host(s) => !s.last_logits.is_empty(),
            DeviceState::Gpu(s) => s.has_logits(),
        }
    }

    /// K/V blocks (of `KV_BLOCK` positions) the state must take to hold `end` positions on a
    /// GPU: what it lacks there, or all of them for a state in host memory.
    pub fn kv_blocks_short(&self, end: usize) -> usize {
        match self {
            DeviceState::Host(_) => end.div_ceil(KV_BLOCK),
            DeviceState::Gpu(s) => s.kv_blocks_short(end),
        }
    }

    /// Whether some of the state lives in a state file (see `State::in_file`).
    pub fn in_file(&self) -> bool {
        matches!(self, DeviceState::Host(s) if s.in_file())
    }

    /// A copy of the state in this process's memory (from the GPU where it lives there); the
    /// state itself goes on as it was.
    pub fn snapshot(&self) -> Result<State> {
        match self {
            DeviceState::Host(s) => Ok(s.clone()),
            DeviceState::Gpu(s) => s.download(),
        }
    }

    /// The state in this process's memory, whole (copied from the GPU or out of its file).
    pub fn into_host(self) -> Result<State> {
        match self {
            DeviceState::Host(s) => Ok(s.into_owned()),
            DeviceState::Gpu(s) => s.download(),
        }
    }

    /// Whether the state lives on `gpu`'s device.
    pub fn is_on(&self, gpu: &GpuQwen35) -> bool {
        matches!(self, DeviceState::Gpu(s) if s.ordinal() == gpu.gpu.ordinal)
    }

    /// Where the state lives, for messages: `host`, `cuda:N`.
    pub fn location(&self) -> String {
        match self {
            DeviceState::Host(_) => "host".into(),
            DeviceState::Gpu(s) => format!("cuda:{}", s.ordinal()),
        }
    }
}
