//! A decode step captured as a CUDA graph and replayed per token.

use super::*;

impl GpuQwen35 {
    /// A decode step through the state's captured graph (captured now if it has none, or if
    /// its K/V caches moved since). The logits stay in the step's buffer; their argmax comes
    /// back.
    pub(super) fn replay_step(&self, token: u32, state: &mut GpuState) -> Result<()> {
        let g = &self.gpu;
        if state.step.as_ref().is_none_or(|s| s.capacity != state.capacity || !std::sync::Arc::ptr_eq(&s.stream, &g.stream)) {
            // The old step's buffer may hold the last logits: they come to the host first, so
            // that a failed capture leaves the state whole.
            state.last_logits()?;
            state.step = None;
            let ws = Workspace::new(self, 1, 1, 1)?;
            let (io_host, mut argmax_host) = (Pinned::<u32>::new(g, 2)?, Pinned::<u32>::new(g, 1)?);
            // The attention's split over the positions is sized for the whole cache, so that
            // the one captured launch serves every position.
            let visible = state.capacity.min(MAX_CONTEXT);
            g.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(|e| anyhow::anyhow!("cuda:{}: starting a graph capture: {e:?}", g.ordinal))?;
            // The position and token id come in from pinned memory and the argmax goes out to
            // it inside the graph: one launch and one wait per token.
            let enqueued = g
                .copy_to_device(&io_host, g.ptr(&ws.io))
                .and_then(|()| self.enqueue(&ws, &mut [&mut *state], &[Rows { first: 0, count: 1 }], 0, Some(visible)))
                .and_then(|()| self.enqueue_argmax(&ws, 1))
                .and_then(|()| g.copy_to_host(g.ptr(&ws.pick), &mut argmax_host));
            // End the capture whatever happened, so that the stream is usable again.
            let captured = g.stream.end_capture(CUgraphInstantiate_flags(0));
            enqueued?;
            let graph = captured.map_err(|e| anyhow::anyhow!("cuda:{}: capturing the decode step: {e:?}", g.ordinal))?.context("the captured decode step is empty")?;
            state.step = Some(StepGraph { graph: Graph(graph), stream: g.stream.clone(), ws, capacity: state.capacity, io_host, argmax_host });
        }
        let step = state.step.as_mut().expect("captured above");
        // The previous replay has finished (its argmax was read), so the host side is free.
        step.io_host.as_mut_slice().copy_from_slice(&[state.position as u32, token]);
        step.graph.0.launch().map_err(|e| anyhow::anyhow!("cuda:{}: replaying the decode step: {e:?}", g.ordinal))?;
        g.synchronize()?;
        state.position += 1;
        state.last = LastLogits::InStep { argmax: step.argmax_host.as_slice()[0] };
        Ok(())
    }

    /// Seconds per decode step on the GPU alone: `steps` replays of `state`'s step graph back to
    /// back, one wait at the end (what `apply` adds per token on top is the host's part: the
    /// wait for the step, the copy of its argmax). The state is advanced `steps` times at the
    /// same position; a bench state only.
    pub fn time_step_replays(&self, state: &mut GpuState, steps: usize) -> Result<f64> {
        let g = &self.gpu;
        let token = crate::sampling::argmax(state.last_logits()?);
        self.replay_step(token, state)?;
        let step = state.step.as_ref().context("no step graph was captured")?;
        let start = std::time::Instant::now();
        for _ in 0..steps {
            step.graph.0.launch().map_err(|e| anyhow::anyhow!("cuda:{}: replaying the decode step: {e:?}", g.ordinal))?;
        }
        g.synchronize()?;
        Ok(start.elapsed().as_secs_f64() / steps as f64)
    }
}
