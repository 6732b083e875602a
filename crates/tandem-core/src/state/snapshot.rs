//! A copy of a request's state taken part way into its prompt or at its end, for a prefix
//! cache: in host memory, or kept on the GPU of the engine that took it (its K/V blocks shared
//! with the state it came from). Nothing writes into a snapshot; a request that continues one
//! starts from a copy of it (`Engine::restore`).

use anyhow::Result;

use super::State;
use crate::backend::cuda::qwen35::GpuSnapshot;

pub enum Snapshot {
    Host(State),
    Gpu(GpuSnapshot),
}

/// Where a snapshot lives (the prefix cache's tiers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    Device,
    Host,
    Disk,
}

impl Tier {
    /// The name `/metrics` labels it with.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

impl Snapshot {
    /// Tokens the state has applied.
    pub fn position(&self) -> usize {
        match self {
            Snapshot::Host(s) => s.position,
            Snapshot::Gpu(s) => s.position,
        }
    }

    pub fn tier(&self) -> Tier {
        match self {
            Snapshot::Host(_) => Tier::Host,
            Snapshot::Gpu(_) => Tier::Device,
        }
    }

    /// Bytes it holds where it lives (a GPU snapshot's shared blocks counted whole).
    pub fn bytes(&self) -> usize {
        match self {
            Snapshot::Host(s) => s.bytes(),
            Snapshot::Gpu(s) => s.bytes(),
        }
    }

    /// A host copy of it (for an engine on another device, or to keep in host memory).
    pub fn to_host(&self) -> Result<State> {
        match self {
            Snapshot::Host(s) => Ok(s.clone()),
            Snapshot::Gpu(s) => s.download(),
        }
    }
}

impl From<State> for Snapshot {
    fn from(s: State) -> Snapshot {
        Snapshot::Host(s)
    }
}
