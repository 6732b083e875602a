//! Decode steps captured as CUDA graphs and replayed per token: one sequence's step (its own
//! graph, in its state), and the batched step of each batch-size bucket.

use super::*;

/// Captures of a batch bucket's step tried before its steps are launched kernel by kernel.
const CAPTURE_TRIES: u32 = 3;

impl GpuQwen35 {
    /// A decode step through the state's captured graph (captured now if it has none, or if
    /// its K/V blocks outgrew the graph's span). The logits stay in the step's buffer; their
    /// argmax comes back.
    pub(super) fn replay_step(&self, token: u32, state: &mut GpuState) -> Result<()> {
        let g = &self.gpu;
        self.check_slot(state)?;
        let capacity = state.kv.capacity();
        if state.step.as_ref().is_none_or(|s| s.span < capacity || !std::sync::Arc::ptr_eq(&s.stream, &g.stream)) {
            // The old step's buffer may hold the last logits: they come to the host first, so
            // that a failed capture leaves the state whole.
            state.last_logits()?;
            state.step = None;
            let mut ws = Workspace::new(self, 1, 1, 1)?;
            // The attention's split over the positions is sized for the whole span, so that the
            // one captured launch serves every position up to it.
            let span = capacity.next_power_of_two().clamp(KV_MIN_ROWS, MAX_CONTEXT);
            ws.kv_width = span / KV_BLOCK;
            let (io_host, mut argmax_host) = (Pinned::<u32>::new(g, 2)?, Pinned::<u32>::new(g, 1)?);
            let blocks_host = Pinned::<u64>::new(g, ws.kv_width)?;
            g.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(|e| anyhow::anyhow!("cuda:{}: starting a graph capture: {e:?}", g.ordinal))?;
            // The position and token id come in from pinned memory and the argmax goes out to
            // it inside the graph: one launch and one wait per token.
            let enqueued = g
                .copy_to_device(&io_host, g.ptr(&ws.io))
                .and_then(|()| g.copy_to_device(&blocks_host, g.ptr(&ws.blocks)))
                .and_then(|()| self.enqueue(&ws, &mut [&mut *state], &[Rows { first: 0, count: 1 }], LogitRows::From(0), Some(span)))
                .and_then(|()| self.enqueue_argmax(&ws, 1))
                .and_then(|()| g.copy_to_host(g.ptr(&ws.pick), &mut argmax_host));
            // End the capture whatever happened, so that the stream is usable again.
            let captured = g.stream.end_capture(CUgraphInstantiate_flags(0));
            match (enqueued, captured) {
                (Ok(()), Ok(Some(graph))) => state.step = Some(StepGraph { graph: Graph(graph), stream: g.stream.clone(), ws, span, io_host, blocks_host, argmax_host }),
                // A capture fails where another thread does what synchronizes the whole GPU
                // meanwhile (loading a module, freeing page-locked memory); nothing captured
                // ran, so this token goes kernel by kernel and the next one captures again.
                (enqueued, captured) => {
                    let why = enqueued.err().map(|e| format!("{e:#}")).or_else(|| captured.err().map(|e| format!("{e:?}"))).unwrap_or_else(|| "the graph is empty".into());
                    eprintln!("cuda:{}: a decode step could not be captured as a graph ({why}); this one is launched kernel by kernel", g.ordinal);
                    return self.forward_launches(&[token], state, Logits::Last).map(drop);
                }
            }
        }
        let step = state.step.as_mut().expect("captured above");
        // The previous replay has finished (its argmax was read), so the host side is free.
        step.io_host.as_mut_slice().copy_from_slice(&[state.position as u32, token]);
        let (blocks, host) = (state.kv.table(), step.blocks_host.as_mut_slice());
        host[..blocks.len()].copy_from_slice(blocks);
        host[blocks.len()..].fill(0);
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
        // (The step writes its K/V rows at the state's next position: a block must hold it.)
        self.reserve_kv(state, state.position + 1)?;
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

/// The batch size a step of `n` sequences runs at: 2, 4 or 8 (the GEMV's rows), then the
/// powers of two and the points three quarters of the way to them (12, 16, 24, 32, 48, 64,
/// 96, ...), so that past 8 at most a third of a step's rows are padding.
pub(super) fn batch_bucket(n: usize) -> usize {
    if n <= 8 {
        return n.next_power_of_two();
    }
    let p = n.next_power_of_two();
    if n <= p / 4 * 3 {
        p / 4 * 3
    } else {
        p
    }
}

/// The batched decode steps captured as CUDA graphs: per bucket (`batch_bucket`) its buffers
/// and one graph per span of visible positions (a power of two: the attention's split over
/// the positions is part of a captured launch), and the state the padding rows decode into.
#[derive(Default)]
pub(super) struct BatchSteps {
    buckets: std::collections::HashMap<usize, BatchBucket>,
    pad: Option<GpuState>,
}

/// One bucket's step: the workspace its graphs run in, the page-locked memory its inputs come
/// from (positions and token ids, the state tables, the K/V block tables: as many entries per
/// row as the graph's visible span has blocks) and its picks go to.
struct BatchBucket {
    ws: Workspace,
    io_host: Pinned<u32>,
    tables_host: Pinned<u64>,
    blocks_host: Pinned<u64>,
    picks_host: Pinned<u32>,
    graphs: std::collections::HashMap<usize, Graph>,
    /// Failed captures of this bucket so far: a capture fails where another thread
    /// synchronizes the whole GPU meanwhile (loading a module, freeing page-locked memory), so
    /// a failure is tried again, up to `CAPTURE_TRIES`, before the bucket's steps are launched
    /// kernel by kernel for good.
    capture_failures: u32,
    /// Steps run in `ws` so far: a state's logits row there is valid while this is unchanged.
    written: Arc<AtomicU64>,
}

impl GpuQwen35 {
    /// Make the state that batched steps' padding rows decode into, if there is none: a slot
    /// and a K/V block of the engine's pools. A serving engine makes it before it admits
    /// anything (`reserve_batch_padding`), so that a full pool never fails a step for it.
    fn make_padding_state(&self, steps: &mut BatchSteps) -> Result<()> {
        if steps.pad.is_none() {
            let mut p = self.new_state()?;
            self.reserve_kv(&mut p, 1)?;
            steps.pad = Some(p);
        }
        Ok(())
    }

    /// Take the padding rows' state now (see `make_padding_state`).
    pub fn reserve_batch_padding(&self) -> Result<()> {
        self.make_padding_state(&mut self.batch_steps.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// A decode step of several sequences (`decode_batch`, inputs checked, K/V blocks taken)
    /// through the graph of its bucket and visible span, captured now if there is none. Rows
    /// past the sequences decode token 0 at position 0 into the padding state.
    pub(super) fn replay_batch(&self, tokens: &[u32], states: &mut [&mut GpuState]) -> Result<()> {
        let g = &self.gpu;
        let n = tokens.len();
        // A replay runs the kernels of this engine's state dtype on whatever the tables hold:
        // each state's slot is checked here, as `enqueue` checks those it launches for.
        for s in states.iter() {
            self.check_slot(s)?;
        }
        let bucket = batch_bucket(n);
        let most = states.iter().map(|s| s.position + 1).max().unwrap_or(1);
        let visible = most.next_power_of_two().clamp(KV_MIN_ROWS, MAX_CONTEXT);
        let mut guard = self.batch_steps.lock().unwrap_or_else(|e| e.into_inner());
        self.make_padding_state(&mut guard)?;
        let BatchSteps { buckets, pad } = &mut *guard;
        let b = match buckets.entry(bucket) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let ws = Workspace::batched(self, bucket)?;
                let tables = 2 * self.config.layer_types.len() * bucket;
                e.insert(BatchBucket {
                    ws,
                    io_host: Pinned::new(g, 2 * bucket)?,
                    tables_host: Pinned::new(g, tables)?,
                    blocks_host: Pinned::new(g, bucket * MAX_CONTEXT / KV_BLOCK)?,
                    picks_host: Pinned::new(g, bucket)?,
                    graphs: Default::default(),
                    capture_failures: 0,
                    written: Arc::new(AtomicU64::new(0)),
                })
            }
        };
        // The host side of the step: positions, then token ids; the state tables.
        let io = b.io_host.as_mut_slice();
        io.fill(0);
        for (i, s) in states.iter().enumerate() {
            io[i] = s.position as u32;
            io[bucket + i] = tokens[i];
        }
        workspace::fill_tables(states, pad.as_ref(), b.tables_host.as_mut_slice());
        let width = visible / KV_BLOCK;
        workspace::fill_blocks(states, pad.as_ref(), width, &mut b.blocks_host.as_mut_slice()[..bucket * width]);
        if b.capture_failures < CAPTURE_TRIES && !b.graphs.contains_key(&visible) {
            g.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(|e| anyhow::anyhow!("cuda:{}: starting a graph capture: {e:?}", g.ordinal))?;
            let enqueued = self.enqueue_batch_step(b, visible);
            let captured = g.stream.end_capture(CUgraphInstantiate_flags(0));
            match (enqueued, captured) {
                (Ok(()), Ok(Some(graph))) => {
                    b.graphs.insert(visible, Graph(graph));
                }
                (enqueued, captured) => {
                    let why = enqueued.err().map(|e| format!("{e:#}")).or_else(|| captured.err().map(|e| format!("{e:?}"))).unwrap_or_else(|| "the graph is empty".into());
                    eprintln!("cuda:{}: the batched decode step of {bucket} rows could not be captured as a graph ({why}); this one is launched kernel by kernel", g.ordinal);
                    b.capture_failures += 1;
                }
            }
        }
        // States still holding the previous step's rows of this buffer lose them now.
        let step = b.written.fetch_add(1, Ordering::AcqRel) + 1;
        match b.graphs.get(&visible) {
            Some(graph) => graph.0.launch().map_err(|e| anyhow::anyhow!("cuda:{}: replaying a batched decode step: {e:?}", g.ordinal))?,
            None => self.enqueue_batch_step(b, visible)?,
        }
        g.synchronize()?;
        self.advance_batch(states, |_| 1, b.picks_host.as_slice(), &b.ws.logits, &b.written, step);
        Ok(())
    }

    /// Queue a bucket's step: its inputs in from page-locked memory, the forward pass of one
    /// row per sequence with the attention split for `visible` positions, the greedy picks out.
    fn enqueue_batch_step(&self, b: &mut BatchBucket, visible: usize) -> Result<()> {
        let g = &self.gpu;
        let rows = b.ws.sequences;
        g.copy_to_device(&b.io_host, g.ptr(&b.ws.io))?;
        g.copy_to_device(&b.tables_host, g.ptr(&b.ws.tables))?;
        b.ws.kv_width = visible / KV_BLOCK;
        g.copy_part_to_device(&b.blocks_host, rows * b.ws.kv_width, g.ptr(&b.ws.blocks))?;
        let each: Vec<Rows> = (0..rows).map(|i| Rows { first: i, count: 1 }).collect();
        self.enqueue(&b.ws, &mut [], &each, LogitRows::From(0), Some(visible))?;
        self.enqueue_argmax(&b.ws, rows)?;
        g.copy_to_host(g.ptr(&b.ws.pick), &mut b.picks_host)
    }
}

#[cfg(test)]
mod tests {
    use super::batch_bucket;

    #[test]
    fn batch_buckets_hold_the_batch_with_little_padding() {
        let got: Vec<usize> = [1, 2, 3, 5, 8, 9, 12, 13, 16, 17, 24, 25, 33, 48, 49, 64, 65, 129, 200, 256].iter().map(|&n| batch_bucket(n)).collect();
        assert_eq!(got, [1, 2, 4, 8, 8, 12, 12, 16, 16, 24, 24, 32, 48, 48, 64, 64, 96, 192, 256, 256]);
        for n in 9..=1024 {
            let b = batch_bucket(n);
            assert!(b >= n && (b - n) * 3 <= b, "{n} -> {b}");
        }
    }
}
