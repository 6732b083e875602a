//! A request's state on the GPU: made fresh, copied from the host, from another GPU (a peer
//! copy) or back to the host (`bridge::device` chooses), and its K/V caches grown as it
//! decodes.

use super::*;

impl GpuQwen35 {
    /// Host state to GPU state (the bridge's host-to-device copy).
    pub fn upload_state(&self, s: &State) -> Result<GpuState> {
        self.place_state(s)
    }

    /// The empty state of a fresh request, zeroed on the GPU from the config's shapes (copying
    /// a host state's zeros would cross the bus, 50 MB of recurrent state on the 9B model; and
    /// building that host state first took 2.4 ms of a 9B prefill on an H200). Its K/V caches
    /// get rows on the first forward call, which knows how many it needs.
    pub fn new_state(&self) -> Result<GpuState> {
        let c = &self.config;
        let layers = c
            .layer_types
            .iter()
            .map(|kind| {
                Ok(match kind {
                    LayerType::LinearAttention => GpuLayerState::Linear {
                        conv: self.gpu.zeros(c.linear_conv_kernel_dim * c.linear_conv_dim())?,
                        recurrent: self.gpu.zeros(c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim)?,
                    },
                    LayerType::FullAttention => GpuLayerState::Full { k: self.gpu.zeros(0)?, v: self.gpu.zeros(0)? },
                })
            })
            .collect::<Result<_>>()?;
        Ok(GpuState { position: 0, layers, capacity: 0, last: LastLogits::Host(Vec::new()), step: None, staging: self.staging.clone() })
    }

    /// `s` copied to the GPU.
    pub(super) fn place_state(&self, s: &State) -> Result<GpuState> {
        s.check_shape(&self.config)?;
        let g = &self.gpu;
        let row = self.config.num_key_value_heads * self.config.head_dim;
        let capacity = (s.position + KV_MIN_ROWS).next_power_of_two();
        // Straight from pageable memory: staging through the page-locked buffers measured slower
        // this way (H100: 12.9 against 8.1 ms for 72 MB), as the CPU's copy into them is the
        // slow part and the driver pipelines its own staging better.
        let copy = |host: &[f32], len: usize| -> Result<CudaSlice<f32>> {
            let mut dev = g.scratch::<f32>(len)?;
            if !host.is_empty() {
                g.stream.memcpy_htod(host, &mut dev.slice_mut(..host.len())).map_err(|e| anyhow::anyhow!("cuda:{}: copying a state to the GPU: {e:?}", g.ordinal))?;
            }
            Ok(dev)
        };
        let layers = s
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    LayerState::Linear { conv, recurrent } => GpuLayerState::Linear { conv: copy(conv, conv.len())?, recurrent: copy(recurrent, recurrent.len())? },
                    // The rows past the position are never read before they are written.
                    LayerState::Full { k, v } => GpuLayerState::Full { k: copy(k, capacity * row)?, v: copy(v, capacity * row)? },
                })
            })
            .collect::<Result<_>>()?;
        Ok(GpuState { position: s.position, layers, capacity, last: LastLogits::Host(s.last_logits.clone()), step: None, staging: self.staging.clone() })
    }

    /// A state of another GPU (or of another engine on this one) copied to this GPU: the
    /// bridge's device-to-device copy (a peer copy between two GPUs). Only the K/V rows in use
    /// are copied.
    pub fn copy_state(&self, s: &GpuState) -> Result<GpuState> {
        let g = &self.gpu;
        let err = |e| anyhow::anyhow!("cuda:{}: copying a state from cuda:{}: {e:?}", g.ordinal, s.ordinal());
        // The source's stream must be done writing before this stream reads.
        s.stream().synchronize().map_err(err)?;
        let row = self.config.num_key_value_heads * self.config.head_dim;
        let copy = |src: &CudaSlice<f32>, len: usize, used: usize| -> Result<CudaSlice<f32>> {
            let mut dst = g.zeros::<f32>(len)?;
            if used > 0 {
                g.stream.memcpy_dtod(&src.slice(..used), &mut dst.slice_mut(..used)).map_err(err)?;
            }
            Ok(dst)
        };
        let layers = s
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    GpuLayerState::Linear { conv, recurrent } => GpuLayerState::Linear { conv: copy(conv, conv.len(), conv.len())?, recurrent: copy(recurrent, recurrent.len(), recurrent.len())? },
                    GpuLayerState::Full { k, v } => GpuLayerState::Full { k: copy(k, k.len(), s.position * row)?, v: copy(v, v.len(), s.position * row)? },
                })
            })
            .collect::<Result<_>>()?;
        g.synchronize()?;
        Ok(GpuState { position: s.position, layers, capacity: s.capacity, last: LastLogits::Host(s.host_logits()?), step: None, staging: self.staging.clone() })
    }

    /// GPU state to host state (the bridge's device-to-host copy).
    pub fn download_state(&self, s: &GpuState) -> Result<State> {
        s.download()
    }

    /// Make room for `end` K/V rows (doubling), keeping the rows in use.
    pub(super) fn grow_kv(&self, state: &mut GpuState, end: usize) -> Result<()> {
        if end <= state.capacity {
            return Ok(());
        }
        let row = self.config.num_key_value_heads * self.config.head_dim;
        let used = state.position * row;
        // At least KV_MIN_ROWS: every growth moves the caches, and the state's captured decode
        // step with them, so that a short prompt would otherwise re-capture it every few steps.
        let cap = end.next_power_of_two().max(KV_MIN_ROWS);
        for l in &mut state.layers {
            if let GpuLayerState::Full { k, v } = l {
                for buf in [k, v] {
                    let mut bigger = self.gpu.zeros::<f32>(cap * row)?;
                    if used > 0 {
                        self.gpu.stream.memcpy_dtod(&buf.slice(..used), &mut bigger.slice_mut(..used)).map_err(|e| anyhow::anyhow!("cuda:{}: {e:?}", self.gpu.ordinal))?;
                    }
                    *buf = bigger;
                }
            }
        }
        state.capacity = cap;
        Ok(())
    }
}

impl GpuState {
    /// The GPU this state lives on.
    pub fn ordinal(&self) -> usize {
        self.stream().context().ordinal()
    }

    pub(super) fn stream(&self) -> &std::sync::Arc<cudarc::driver::CudaStream> {
        match &self.layers[0] {
            GpuLayerState::Linear { conv, .. } => conv.stream(),
            GpuLayerState::Full { k, .. } => k.stream(),
        }
    }

    /// This state copied to host memory (the bridge's device-to-host copy).
    pub fn download(&self) -> Result<State> {
        let stream = self.stream();
        let kv = self.layers.iter().find_map(|l| match l {
            GpuLayerState::Full { k, .. } => Some(k.len() / self.capacity * self.position),
            _ => None,
        });
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let mut down = |s: &CudaSlice<f32>, n: usize| -> Result<Vec<f32>> {
            let (src, _sync) = cudarc::driver::DevicePtr::device_ptr(s, stream);
            staging.download(stream, src, n)
        };
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match l {
                    GpuLayerState::Linear { conv, recurrent } => LayerState::Linear { conv: down(conv, conv.len())?.into(), recurrent: down(recurrent, recurrent.len())?.into() },
                    GpuLayerState::Full { k, v } => LayerState::Full { k: down(k, kv.unwrap_or(0))?, v: down(v, kv.unwrap_or(0))? },
                })
            })
            .collect::<Result<_>>()?;
        drop(staging);
        Ok(State { position: self.position, layers, last_logits: self.host_logits()? })
    }

    /// Bytes of state data on the GPU that a transfer moves (K/V up to the position).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                GpuLayerState::Linear { conv, recurrent } => 4 * (conv.len() + recurrent.len()),
                GpuLayerState::Full { k, .. } => 2 * 4 * k.len() / self.capacity * self.position,
            })
            .sum::<usize>()
            + 4 * match &self.last {
                LastLogits::Host(l) => l.len(),
                LastLogits::InStep { .. } => self.step.as_ref().map_or(0, |s| s.ws.logits.len()),
                LastLogits::InBatch { vocab, .. } => *vocab,
            }
    }

    /// The last token's logits, copied to the host first if a decode step left them on the GPU.
    pub fn last_logits(&mut self) -> Result<&[f32]> {
        if !matches!(self.last, LastLogits::Host(_)) {
            self.last = LastLogits::Host(self.host_logits()?);
        }
        match &self.last {
            LastLogits::Host(l) => Ok(l),
            _ => unreachable!("brought to the host above"),
        }
    }

    /// The argmax of the last logits (`sampling::argmax`), where the GPU found it: after a
    /// decode step replayed from its graph.
    pub fn last_argmax(&self) -> Option<u32> {
        match self.last {
            LastLogits::InStep { argmax } | LastLogits::InBatch { argmax, .. } => Some(argmax),
            LastLogits::Host(_) => None,
        }
    }

    /// Whether the state has logits to sample from (a fresh state has none).
    pub fn has_logits(&self) -> bool {
        !matches!(&self.last, LastLogits::Host(l) if l.is_empty())
    }

    /// A host copy of the last logits, wherever they are.
    pub(super) fn host_logits(&self) -> Result<Vec<f32>> {
        match &self.last {
            LastLogits::Host(l) => Ok(l.clone()),
            LastLogits::InStep { .. } => {
                let step = self.step.as_ref().context("the decode step whose buffer holds the logits is gone")?;
                let (src, _sync) = cudarc::driver::DevicePtr::device_ptr(&*step.ws.logits, &step.stream);
                self.staging.lock().unwrap_or_else(|e| e.into_inner()).download(&step.stream, src, step.ws.logits.len())
            }
            LastLogits::InBatch { logits, written, step, row, vocab, stream, .. } => {
                if written.load(Ordering::Acquire) != *step {
                    bail!("this state's logits were overwritten by a later batched decode step (read them before the next step)");
                }
                let v = *vocab;
                let (src, _sync) = cudarc::driver::DevicePtr::device_ptr(&**logits, stream);
                self.staging.lock().unwrap_or_else(|e| e.into_inner()).download(stream, src + (row * v * 4) as u64, v)
            }
        }
    }
}
