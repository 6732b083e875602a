//! A state between devices: a GPU engine copies a host state to its GPU, or a state of another
//! GPU across (a peer copy); a CPU engine copies a GPU state to the host. The copies
//! themselves are the CUDA backend's (`GpuQwen35::upload_state`, `copy_state`,
//! `GpuState::download`).

use anyhow::Result;

use crate::backend::cuda::qwen35::GpuQwen35;
use crate::state::DeviceState;

/// Bring `state` to the device of an engine that computes on `gpu` (None: the host). A state
/// already there is returned as is.
pub fn move_to(gpu: Option<&GpuQwen35>, state: DeviceState) -> Result<DeviceState> {
    Ok(match (gpu, state) {
        (None, DeviceState::Gpu(s)) => DeviceState::Host(s.download()?),
        (Some(g), DeviceState::Host(s)) => DeviceState::Gpu(Box::new(g.upload_state(&s)?)),
        (Some(g), DeviceState::Gpu(s)) if s.ordinal() != g.gpu.ordinal => DeviceState::Gpu(Box::new(g.copy_state(&s)?)),
        (_, here) => here,
    })
}

/// `move_to`, in place: a state already there stays as it is, and so does one whose copy
/// fails (a GPU out of K/V blocks: the caller may try again later).
pub fn move_in_place(gpu: Option<&GpuQwen35>, state: &mut DeviceState) -> Result<()> {
    let moved = match (gpu, &*state) {
        (None, DeviceState::Gpu(s)) => DeviceState::Host(s.download()?),
        (Some(g), DeviceState::Host(s)) => DeviceState::Gpu(Box::new(g.upload_state(s)?)),
        (Some(g), DeviceState::Gpu(s)) if s.ordinal() != g.gpu.ordinal || !g.runs_in_place(s) => DeviceState::Gpu(Box::new(g.copy_state(s)?)),
        _ => return Ok(()),
    };
    *state = moved;
    Ok(())
}
