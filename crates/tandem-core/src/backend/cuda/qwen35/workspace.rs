//! The buffers of one forward call, reused by every layer.

use super::*;

/// The tensor-core state walk's bf16 operands, written by the chunk prep (workspace.rs
/// walk_operands).
#[derive(Clone, Copy)]
pub(super) struct WalkOperands {
    pub w: DevPtr<u16>,
    pub q: DevPtr<u16>,
    pub k: DevPtr<u16>,
    pub p: DevPtr<u16>,
}

/// The buffers of one forward call over `rows` token rows (of one or several sequences); each
/// layer reuses them.
pub(super) struct Workspace {
    /// The position of each sequence's first row, then the token id of each row.
    pub(super) io: CudaSlice<u32>,
    pub(super) sequences: usize,
    /// Products of at most this many rows take the GEMV (`takes_gemv`), more the GEMM.
    gemv_max: usize,
    pub(super) x: CudaSlice<f32>,
    /// 1 / rms of each row of a long GEMV input (gemv).
    pub(super) rms_inv: CudaSlice<f32>,
    /// A block-format GEMV's inputs as 16-bit integers (two a word), or with `Precision::Fast`
    /// a k-quant's as int8, in the order its lanes read them, then the sums its format needs
    /// and the scales (kernels/blocks.cu block_input, block_input8).
    pub(super) block_q: CudaSlice<u32>,
    pub(super) block_sums: CudaSlice<u32>,
    /// The normalised rows of an exact prefill's GEMM input.
    pub(super) xn: CudaSlice<f32>,
    // DeltaNet
    /// A batched step's input projections, a row of qkv, z, b and a per sequence (the stacked
    /// `DeltaNet::in_proj`'s product); other forwards write the four below.
    pub(super) in_proj: CudaSlice<f32>,
    pub(super) qkv: CudaSlice<f32>,
    pub(super) conv_out: CudaSlice<f32>,
    pub(super) z: CudaSlice<f32>,
    pub(super) core: CudaSlice<f32>,
    pub(super) beta: CudaSlice<f32>,
    pub(super) alpha: CudaSlice<f32>,
    /// The chunked delta rule's cumulative decay, U, W and P (prefill rows only).
    pub(super) gcum: CudaSlice<f32>,
    pub(super) chunk_u: CudaSlice<f32>,
    pub(super) chunk_w: CudaSlice<f32>,
    /// The tensor-core walk's operands, bf16 [rows, hv, dk] each, one after another: W,
    /// q exp(G) and k exp(G_last - G) (written by the chunk prep; `walk_operands`).
    chunk_bf16: CudaSlice<u16>,
    pub(super) chunk_p: CudaSlice<f32>,
    // attention
    pub(super) qg: CudaSlice<f32>,
    pub(super) k: CudaSlice<f32>,
    pub(super) v: CudaSlice<f32>,
    pub(super) q: CudaSlice<f32>,
    pub(super) gate: CudaSlice<f32>,
    pub(super) attn: CudaSlice<f32>,
    // MLP
    pub(super) ffn_gate: CudaSlice<f32>,
    pub(super) ffn_up: CudaSlice<f32>,
    /// A bf16 copy of a GEMM's input (tensor-core prefill only).
    pub(super) xb: CudaSlice<u16>,
    /// The decode DeltaNet step's hand-over between the blocks of a key head: each block's
    /// sum of squares per token, and a count of finished blocks per key head (zero between
    /// launches: the last block resets it).
    pub(super) step_ss: CudaSlice<f32>,
    pub(super) step_done: CudaSlice<u32>,
    /// The decode attention's hand-over between the chunks of a (row, head): each chunk's
    /// (max, exp-sum, weighted values), and a count of finished chunks (reset by the last).
    pub(super) attn_part: CudaSlice<f32>,
    pub(super) attn_done: CudaSlice<u32>,
    /// The final-normed rows that get logits, and their logits (shared with the states of a
    /// batched step, which read their rows from it only if asked: `LastLogits::InBatch`).
    pub(super) normed: CudaSlice<f32>,
    pub(super) logits: Arc<CudaSlice<f32>>,
    /// The last row of each sequence of a packed prefill, gathered for the LM head
    /// (`LogitRows::LastOfEach`).
    pub(super) last_rows: CudaSlice<f32>,
    /// A batched decode step's tables of per-sequence state addresses, two per DeltaNet layer
    /// (conv window and recurrent state), `sequences` each (`write_tables`).
    pub(super) tables: CudaSlice<u64>,
    /// The sequences' K/V block tables, `kv_width` entries each (`write_blocks`): room for
    /// `MAX_CONTEXT` positions per sequence.
    pub(super) blocks: CudaSlice<u64>,
    pub(super) kv_width: usize,
    /// A batched decode step: every sequence brings one row and the mixers run once for all
    /// of them (`tables` written).
    pub(super) batched: bool,
    /// A packed prefill: every sequence brings more than `GEMV_MAX_T` rows and the DeltaNet
    /// prefill kernels run once for all of them (`tables` and `seqs` written; `write_packed`).
    pub(super) packed: bool,
    /// Each sequence's first row, row count, first chunk of `chunk_p` and first row of the
    /// attention's gathered bf16 keys and values (a packed prefill; `PACKED_SEQ_FIELDS` each).
    pub(super) seqs: CudaSlice<u32>,
    /// The rows those gathered keys and values take: every position each sequence sees.
    pub(super) kv_rows: usize,
    /// The greedy pick of each logits row (argmax_rows): each span's best value and index, a
    /// count of finished spans per row (reset by the last), and the picks.
    pub(super) pick_v: CudaSlice<f32>,
    pub(super) pick_i: CudaSlice<u32>,
    pub(super) pick_done: CudaSlice<u32>,
    pub(super) pick: CudaSlice<u32>,
}

impl Workspace {
    /// The workspace of a forward call: products of up to `GEMV_MAX_T` rows take the GEMV.
    pub(super) fn new(net: &GpuQwen35, rows: usize, sequences: usize, logit_rows: usize) -> Result<Workspace> {
        Workspace::with(net, rows, sequences, logit_rows, GEMV_MAX_T, false)
    }

    /// The workspace of a batched decode step of `n` sequences (one row each): its products
    /// take the tensor-core GEMM from `decode_gemm_from` sequences (`GpuQwen35::decode_gemm_from`).
    /// A model with block-format weights takes the GEMV at every size (in launches of
    /// GEMV_MAX_T tokens): its GEMMs multiply the weights dequantized and, on tensor cores,
    /// rounded to bf16, which the GEMV does not (measured on the tiny fixture in Q4_K and Q8_0:
    /// logits 3% of the largest apart), so each sequence keeps the products it has alone.
    pub(super) fn batched(net: &GpuQwen35, n: usize) -> Result<Workspace> {
        let gemv_max = match net.precision {
            _ if net.has_block_weights() => usize::MAX,
            Precision::TensorCores | Precision::Fast => (net.decode_gemm_from - 1).clamp(1, GEMV_MAX_T),
            Precision::Exact => GEMV_MAX_T,
        };
        Workspace::with(net, n, n, n, gemv_max, true)
    }

    /// Whether a product of `t` rows takes the GEMV (else the GEMM).
    pub(super) fn takes_gemv(&self, t: usize) -> bool {
        t <= self.gemv_max
    }

    /// A batched step's workspace (`batched`) has the stacked input projections' product in
    /// `in_proj` and none of a prefill's DeltaNet buffers (it never prefills).
    fn with(net: &GpuQwen35, rows: usize, sequences: usize, logit_rows: usize, gemv_max: usize, batched: bool) -> Result<Workspace> {
        let c = &net.config;
        let g = &net.gpu;
        let (h, cd, vd, hv, f) = (c.hidden_size, c.linear_conv_dim(), c.linear_value_dim(), c.linear_num_value_heads, c.intermediate_size);
        let (qd, kvd) = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
        let widest = h.max(vd).max(qd).max(f);
        let xb = if rows > gemv_max && net.precision.tensor_cores() { rows * widest } else { 1 };
        let xn = if rows > gemv_max && net.precision == Precision::Exact { rows * h } else { 1 };
        let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
        let chunked = if rows > GEMV_MAX_T && !batched { rows } else { 0 };
        let (stacked, split) = if batched { (rows, 0) } else { (0, rows) };
        // Rows of the decode attention: a few of one sequence, or one of each of a batch.
        let decode_rows = rows.min(GEMV_MAX_T).max(sequences);
        Ok(Workspace {
            io: g.scratch(sequences + rows)?,
            sequences,
            gemv_max,
            x: g.scratch(rows * h)?,
            rms_inv: g.scratch(rows.min(GEMV_MAX_T))?,
            block_q: g.scratch(if net.block_weights { rows.min(GEMV_MAX_T) * widest / 2 } else { 0 })?,
            block_sums: g.scratch(if net.block_weights { rows.min(GEMV_MAX_T) * (widest / 8 + widest / 256 + 1) } else { 0 })?,
            xn: g.scratch(xn)?,
            in_proj: g.scratch(stacked * DeltaNet::in_proj_starts(c)[4])?,
            qkv: g.scratch(split * cd)?,
            conv_out: g.scratch(split * cd)?,
            z: g.scratch(split * vd)?,
            core: g.scratch(rows * vd)?,
            beta: g.scratch(split * hv)?,
            alpha: g.scratch(split * hv)?,
            gcum: g.scratch(chunked * hv)?,
            chunk_u: g.scratch(chunked * hv * dv)?,
            chunk_w: g.scratch(chunked * hv * dk)?,
            chunk_bf16: g.scratch(if net.prefills_on_tensor_cores() { 3 * chunked * hv * dk } else { 0 })?,
            // (Each sequence of a packed prefill starts a chunk of its own.)
            chunk_p: g.scratch(if chunked > 0 { chunked.div_ceil(DELTANET_CHUNK) + sequences - 1 } else { 0 } * hv * DELTANET_CHUNK * DELTANET_CHUNK)?,
            qg: g.scratch(rows * 2 * qd)?,
            k: g.scratch(rows * kvd)?,
            v: g.scratch(rows * kvd)?,
            q: g.scratch(rows * qd)?,
            gate: g.scratch(rows * qd)?,
            attn: g.scratch(rows * qd)?,
            ffn_gate: g.scratch(rows * f)?,
            ffn_up: g.scratch(rows * f)?,
            xb: g.scratch(xb)?,
            step_ss: g.scratch(hv * c.linear_value_head_dim / 32 * GEMV_MAX_T * sequences)?,
            step_done: g.zeros(c.linear_num_key_heads * sequences)?,
            attn_part: g.scratch(decode_rows * c.num_attention_heads * ATTN_SPLITS * (c.head_dim + 2))?,
            attn_done: g.zeros(decode_rows * c.num_attention_heads)?,
            normed: g.scratch(logit_rows * h)?,
            logits: Arc::new(g.scratch(logit_rows * c.vocab_size)?),
            last_rows: g.scratch(if rows > sequences { sequences * h } else { 1 })?,
            tables: g.scratch(if sequences > 1 { 2 * c.layer_types.len() * sequences } else { 1 })?,
            blocks: g.scratch(sequences * MAX_CONTEXT / KV_BLOCK)?,
            kv_width: 0,
            batched,
            packed: false,
            seqs: g.scratch(if sequences > 1 { PACKED_SEQ_FIELDS * sequences } else { 1 })?,
            kv_rows: 0,
            pick_v: g.scratch(logit_rows * ARGMAX_SPANS)?,
            pick_i: g.scratch(logit_rows * ARGMAX_SPANS)?,
            pick_done: g.zeros(logit_rows)?,
            pick: g.scratch(logit_rows)?,
        })
    }

    /// The device address of sequence `i`'s position.
    pub(super) fn position_of(&self, g: &Gpu, i: usize) -> DevPtr<u32> {
        g.ptr(&self.io).offset(i)
    }

    /// Write the sequences' positions and the rows' token ids (before the kernels run).
    pub(super) fn write_io(&mut self, g: &Gpu, positions: &[usize], tokens: &[u32]) -> Result<()> {
        let io: Vec<u32> = positions.iter().map(|&p| p as u32).chain(tokens.iter().copied()).collect();
        g.stream.memcpy_htod(&io[..], &mut self.io.slice_mut(..io.len())).map_err(|e| anyhow::anyhow!("cuda:{}: copying token ids: {e:?}", g.ordinal))
    }

    /// Write the block tables of `states` (see `fill_blocks`), `width` entries each (at least
    /// the most blocks a state holds), before a call launched kernel by kernel.
    pub(super) fn write_blocks(&mut self, g: &Gpu, states: &[&mut GpuState], width: usize) -> Result<()> {
        let mut table = vec![0u64; width * states.len()];
        fill_blocks(states, None, width, &mut table);
        g.stream.memcpy_htod(&table[..], &mut self.blocks.slice_mut(..table.len())).map_err(|e| anyhow::anyhow!("cuda:{}: copying block tables: {e:?}", g.ordinal))?;
        self.kv_width = width;
        Ok(())
    }

    /// The chunk prep's bf16 outputs for the tensor-core state walk (W, q exp(G),
    /// k exp(G_last - G) from row `first`, and P over `chunk_p`, which the walk then reads in
    /// bf16); null where the walk is in f32 (the prep then writes none, and P in f32).
    pub(super) fn walk_operands(&self, net: &GpuQwen35, first: usize) -> WalkOperands {
        if !net.prefills_on_tensor_cores() {
            return WalkOperands { w: DevPtr::NULL, q: DevPtr::NULL, k: DevPtr::NULL, p: DevPtr::NULL };
        }
        let c = &net.config;
        let each = self.chunk_bf16.len() / 3;
        let base = net.gpu.ptr(&self.chunk_bf16).offset(first * c.linear_num_value_heads * c.linear_key_head_dim);
        WalkOperands { w: base, q: base.offset(each), k: base.offset(2 * each), p: net.gpu.ptr(&self.chunk_p).reinterpret() }
    }

    /// Sequence `i`'s block table.
    pub(super) fn blocks_of(&self, g: &Gpu, i: usize) -> DevPtr<DevPtr<f32>> {
        g.ptr(&self.blocks).offset(i * self.kv_width).reinterpret()
    }

    /// Write the tables of `states` (see `fill_tables`), for a batched decode step (launched
    /// kernel by kernel) or a packed prefill.
    pub(super) fn write_tables(&mut self, g: &Gpu, states: &[&mut GpuState]) -> Result<()> {
        let mut table = vec![0u64; 2 * states.first().map_or(0, |s| s.layers.len()) * states.len()];
        fill_tables(states, None, &mut table);
        g.stream.memcpy_htod(&table[..], &mut self.tables.slice_mut(..table.len())).map_err(|e| anyhow::anyhow!("cuda:{}: copying a batch's state tables: {e:?}", g.ordinal))
    }

    /// Make this the workspace of a packed prefill of `states`, whose rows are `rows` (more
    /// than `GEMV_MAX_T` each): their tables, and where each one's rows and chunks are.
    pub(super) fn write_packed(&mut self, g: &Gpu, states: &[&mut GpuState], rows: &[Rows]) -> Result<()> {
        debug_assert!(rows.iter().all(|r| r.count > GEMV_MAX_T));
        self.write_tables(g, states)?;
        let width = states.iter().map(|s| s.kv.table().len()).max().unwrap_or(0);
        self.write_blocks(g, states, width)?;
        let mut seqs = Vec::with_capacity(PACKED_SEQ_FIELDS * rows.len());
        let (mut chunk, mut kv_first) = (0, 0);
        for (s, r) in states.iter().zip(rows) {
            seqs.extend([r.first as u32, r.count as u32, chunk as u32, kv_first as u32]);
            chunk += r.count.div_ceil(DELTANET_CHUNK);
            kv_first += s.position + r.count;
        }
        self.kv_rows = kv_first;
        g.stream.memcpy_htod(&seqs[..], &mut self.seqs.slice_mut(..seqs.len())).map_err(|e| anyhow::anyhow!("cuda:{}: copying a packed prefill's sequences: {e:?}", g.ordinal))?;
        self.packed = true;
        Ok(())
    }

    /// Layer `li`'s two tables of a batched step of `n` sequences.
    pub(super) fn layer_tables(&self, g: &Gpu, li: usize, n: usize) -> (DevPtr<DevPtr<f32>>, DevPtr<DevPtr<StateValues>>) {
        let base = g.ptr(&self.tables);
        (base.offset(2 * li * n).reinterpret(), base.offset((2 * li + 1) * n).reinterpret())
    }
}

/// The tables of a batched decode step of `table.len() / (2 · layers)` rows: layer l's conv
/// windows (or K caches) at `2 l · n`, its recurrent states (or V caches) at `(2 l + 1) · n`;
/// row i is `states[i]`'s, and the rows past them `pad`'s (a graph's padding rows).
pub(super) fn fill_tables(states: &[&mut GpuState], pad: Option<&GpuState>, table: &mut [u64]) {
    let layers = states.first().map_or(0, |s| s.layers.len());
    let n = table.len() / (2 * layers).max(1);
    for i in 0..n {
        let s: &GpuState = match states.get(i) {
            Some(s) => s,
            None => pad.expect("a state or the padding state for every row"),
        };
        for (li, l) in s.layers.iter().enumerate() {
            let (a, b) = match l {
                GpuLayerState::Linear { conv, recurrent } => (conv.addr(), recurrent.addr()),
                GpuLayerState::Full => (0, 0),
            };
            table[2 * li * n + i] = a;
            table[(2 * li + 1) * n + i] = b;
        }
    }
}

/// The K/V block tables of `table.len() / width` rows, `width` entries each: row i's blocks
/// are `states[i]`'s, the rows past them `pad`'s, and the entries past a state's blocks zero.
pub(super) fn fill_blocks(states: &[&mut GpuState], pad: Option<&GpuState>, width: usize, table: &mut [u64]) {
    for (i, row) in table.chunks_mut(width.max(1)).enumerate() {
        let s: &GpuState = match states.get(i) {
            Some(s) => s,
            None => pad.expect("a state or the padding state for every row"),
        };
        let blocks = s.kv.table();
        debug_assert!(blocks.len() <= row.len(), "a block table wider than its row");
        let n = blocks.len().min(row.len());
        row[..n].copy_from_slice(&blocks[..n]);
        row[n..].fill(0);
    }
}
