// The reference of kernels/attention.cu and its checks (decode, tiled and tensor-core attention): run on CPU threads by
// tests/cuda_on_cpu.rs; tests/cuda_emu/checks.cpp (random, compare, ...) includes it.

// Causal GQA attention of rows pos0.. (q [t, hq, d]) over caches [pos0 + t, hkv, d], gated.
static std::vector<double> attention_ref(const std::vector<float>& q, const std::vector<float>& kc, const std::vector<float>& vc, const std::vector<float>& gate, int t, int hq, int hkv, int d, int pos0) {
    std::vector<double> out((size_t)t * hq * d);
    for (int tok = 0; tok < t; tok++)
        for (int h = 0; h < hq; h++) {
            int kvh = h / (hq / hkv), visible = pos0 + tok + 1;
            std::vector<double> s(visible);
            double mx = -1e300, sum = 0;
            for (int p = 0; p < visible; p++) {
                double a = 0;
                for (int c = 0; c < d; c++) a += (double)q[((size_t)tok * hq + h) * d + c] * kc[((size_t)p * hkv + kvh) * d + c];
                s[p] = a / std::sqrt((double)d);
                mx = std::max(mx, s[p]);
            }
            for (auto& x : s) sum += (x = std::exp(x - mx));
            for (int c = 0; c < d; c++) {
                double o = 0;
                for (int p = 0; p < visible; p++) o += s[p] * vc[((size_t)p * hkv + kvh) * d + c];
                size_t at = ((size_t)tok * hq + h) * d + c;
                out[at] = o / sum * sigmoid(gate[at]);
            }
        }
    return out;
}

// A paged cache holding contiguous keys and values kc, vc ([n, row] each) as one layer's rows:
// the layer second of two (so that its offset counts), its blocks in a shuffled order with a
// spare block between, and the table of their addresses (null past the last).
struct Paged {
    std::vector<std::vector<float>> blocks;
    std::vector<float*> table;
    int koff;
    Paged(const std::vector<float>& kc, const std::vector<float>& vc, int row, int width = 0) {
        int n = (int)(kc.size() / row), used = (n + KV_BLOCK - 1) / KV_BLOCK;
        koff = 2 * KV_BLOCK * row;
        blocks.assign(2 * used, random(4 * KV_BLOCK * row, -9, 9));  // filled with values no row holds
        table.assign(std::max(width, used), nullptr);
        std::vector<int> order(used);
        for (int b = 0; b < used; b++) order[b] = 2 * b + 1;
        std::shuffle(order.begin(), order.end(), rng);
        for (int b = 0; b < used; b++) table[b] = blocks[order[b]].data();
        for (int p = 0; p < n; p++)
            for (int c = 0; c < row; c++) {
                table[p / KV_BLOCK][koff + (p % KV_BLOCK) * row + c] = kc[(size_t)p * row + c];
                table[p / KV_BLOCK][koff + (KV_BLOCK + p % KV_BLOCK) * row + c] = vc[(size_t)p * row + c];
            }
    }
    // A copy with blocks of its own, laid out as this one's.
    Paged(const Paged& o) : blocks(o.blocks), table(o.table.size(), nullptr), koff(o.koff) {
        for (size_t b = 0; b < table.size(); b++)
            for (size_t i = 0; i < blocks.size(); i++)
                if (o.table[b] == o.blocks[i].data()) table[b] = blocks[i].data();
    }
    // Position p's key (v = false) or value row, as the kernels address it.
    const float* row_of(int p, int row, bool v) const { return table[p / KV_BLOCK] + koff + ((v ? KV_BLOCK : 0) + p % KV_BLOCK) * row; }
};

// Rows pos0.. of a prefill or decode (up to 8: the decode kernel, split over the positions in
// chunks as the engine sizes them for a cache of `capacity` rows; else the tiled kernel).
static void check_attention(int t, int pos0, int d, int hq, int hkv, int capacity = 0) {
    auto q = random((size_t)t * hq * d, -4, 4), kc = random((size_t)(pos0 + t) * hkv * d, -1, 1), vc = random((size_t)(pos0 + t) * hkv * d, -1, 1), gate = random((size_t)t * hq * d, -2, 2);
    auto want = attention_ref(q, kc, vc, gate, t, hq, hkv, d, pos0);
    Paged cache(kc, vc, hkv * d);
    std::vector<float> got(want.size());
    u32 pos = pos0;
    std::string name;
    if (t <= 8) {
        int chunk = std::max(64, (capacity + 63) / 64), splits = (capacity + chunk - 1) / chunk;
        std::vector<float> part((size_t)t * hq * splits * (d + 2));
        std::vector<unsigned> done(t * hq, 0);
        launch(t, hkv, splits, 128, [&] { attention(q.data(), cache.table.data(), cache.koff, gate.data(), got.data(), part.data(), done.data(), hq, hkv, d, chunk, splits, &pos); });
        name = "attention (decode, " + std::to_string(splits) + " chunks of " + std::to_string(chunk) + ")";
        check_counters(name + " after " + std::to_string(pos0), done);
    } else {
        launch((t + 63) / 64, hq, 1, 256, [&] { attention_tiled(q.data(), cache.table.data(), cache.koff, gate.data(), got.data(), t, hq, hkv, d, &pos); });
        name = "attention_tiled";
    }
    compare(name + ", " + std::to_string(t) + " rows after " + std::to_string(pos0) + ", head dim " + std::to_string(d), got, want, 1e-5);
}

// The tensor-core attention against the f32 tiles (bf16 operands: within 1%), its operands
// gathered from the paged cache by kv_to_bf16 as the engine does (and checked to be the rows
// rounded).
template <int D>
static void check_attention_mma(int t, int pos0, int hq, int hkv, void (*kernel)(const float*, const bf16_t*, const bf16_t*, const float*, float*, int, int, int, const u32*)) {
    auto q = random((size_t)t * hq * D, -4, 4), kc = random((size_t)(pos0 + t) * hkv * D, -1, 1), vc = random((size_t)(pos0 + t) * hkv * D, -1, 1), gate = random((size_t)t * hq * D, -2, 2);
    std::vector<float> f32(q.size()), got(q.size());
    u32 pos = pos0;
    int n = (int)kc.size(), row = hkv * D;
    Paged cache(kc, vc, row);
    std::vector<bf16_t> kb(n), vb(n);
    launch((n + 1023) / 1024, 1, 1, 256, [&] { kv_to_bf16(cache.table.data(), cache.koff, kb.data(), vb.data(), pos0 + t, row); });
    bool rounded = true;
    for (int i = 0; i < n; i++) rounded &= kb[i] == f32_to_bf16(kc[i]) && vb[i] == f32_to_bf16(vc[i]);
    failures += !rounded;
    printf("%s kv_to_bf16, %d rows: each row of the paged cache, rounded\n", rounded ? "ok  " : "FAIL", pos0 + t);
    launch((t + 63) / 64, hq, 1, 256, [&] { attention_tiled(q.data(), cache.table.data(), cache.koff, gate.data(), f32.data(), t, hq, hkv, D, &pos); });
    launch((t + 63) / 64, hq, 1, 256, [&] { kernel(q.data(), kb.data(), vb.data(), gate.data(), got.data(), t, hq, hkv, &pos); });
    compare("attention_mma_" + std::to_string(D) + " against attention_tiled, " + std::to_string(t) + " rows after " + std::to_string(pos0), got, std::vector<double>(f32.begin(), f32.end()), 1e-2);
}

// The batched decode step's kernels against the one-sequence ones, sequence by sequence: three
// sequences at different positions, each with its own paged cache (the batch's tables side by
// side, `width` apart); qk_norm_rope_batch writes what qk_norm_rope writes for each alone, and
// attention_batch (split as the longest needs) what attention computes for each alone with the
// same split: bit for bit.
static void check_attention_batch() {
    const int n = 3, hq = 4, hkv = 2, d = 64, half = 16, capacity = 512;
    const float eps = 1e-6f;
    const int pos[n] = {12, 300, 70};
    int most = 301, chunk = std::max(64, (most + 63) / 64), splits = (most + chunk - 1) / chunk;
    auto qg = random((size_t)n * hq * 2 * d, -2, 2), k = random((size_t)n * hkv * d, -2, 2), v = random((size_t)n * hkv * d, -2, 2);
    auto q_norm = random(d, 0.5, 1.5), k_norm = random(d, 0.5, 1.5), inv_freq = random(half, 0.001, 1);
    const int row = hkv * d, width = capacity / KV_BLOCK;
    std::vector<Paged> batch, alone;
    std::vector<float*> tables;
    for (int b = 0; b < n; b++) {
        auto kc = random((size_t)capacity * row, -1, 1), vc = random((size_t)capacity * row, -1, 1);
        batch.emplace_back(kc, vc, row, width);
    }
    for (auto& c : batch) alone.emplace_back(c);
    for (auto& c : batch) tables.insert(tables.end(), c.table.begin(), c.table.end());
    std::vector<u32> posv(pos, pos + n);
    std::vector<float> q((size_t)n * hq * d), gate(q.size()), out(q.size()), part((size_t)n * hq * splits * (d + 2));
    std::vector<unsigned> done(n * hq, 0);
    int koff = batch[0].koff;
    launch(n, hq + hkv, 1, d, [&] { qk_norm_rope_batch(qg.data(), q.data(), gate.data(), k.data(), v.data(), tables.data(), width, koff, q_norm.data(), k_norm.data(), inv_freq.data(), hq, hkv, d, half, posv.data(), eps); });
    launch(n, hkv, splits, 128, [&] { attention_batch(q.data(), tables.data(), width, koff, gate.data(), out.data(), part.data(), done.data(), hq, hkv, d, chunk, splits, posv.data()); });
    bool same = all_zero(done);
    for (int b = 0; b < n; b++) {
        size_t at = (size_t)b * hq * d;
        std::vector<float> q1(hq * d), g1(hq * d), o1(hq * d), p1((size_t)hq * splits * (d + 2));
        std::vector<unsigned> d1(hq, 0);
        u32 p = pos[b];
        float* const* table = alone[b].table.data();
        launch(1, hq + hkv, 1, d, [&] { qk_norm_rope(qg.data() + (size_t)b * hq * 2 * d, q1.data(), g1.data(), k.data() + (size_t)b * hkv * d, v.data() + (size_t)b * hkv * d, table, koff, q_norm.data(), k_norm.data(), inv_freq.data(), hq, hkv, d, half, &p, eps); });
        launch(1, hkv, splits, 128, [&] { attention(q1.data(), table, koff, g1.data(), o1.data(), p1.data(), d1.data(), hq, hkv, d, chunk, splits, &p); });
        same &= std::equal(q1.begin(), q1.end(), q.begin() + at) && std::equal(g1.begin(), g1.end(), gate.begin() + at) && std::equal(o1.begin(), o1.end(), out.begin() + at);
        // Every block the same: the new row where both wrote it, the rest untouched.
        for (size_t i = 0; i < batch[b].blocks.size(); i++) same &= batch[b].blocks[i] == alone[b].blocks[i];
        // And the new value went to the position's row of its block.
        same &= std::equal(v.begin() + (size_t)b * row, v.begin() + (size_t)(b + 1) * row, batch[b].row_of(pos[b], row, true));
    }
    failures += !same;
    printf("%s qk_norm_rope_batch + attention_batch, 3 sequences at 12, 300, 70: each sequence's bits as alone\n", same ? "ok  " : "FAIL");
}

// A packed prefill's attention kernels against the one-sequence ones, sequence by sequence:
// three sequences of 70, 9 and 30 rows after 0, 40 and 100 positions, each with its own paged
// cache (the tables side by side, `width` apart), their rows packed one after another;
// qk_norm_rope_packed, kv_to_bf16_packed and attention_mma_packed_D write what qk_norm_rope,
// kv_to_bf16 and attention_mma_D write for each alone: bit for bit.
template <int D>
static void check_attention_packed(int hq, int hkv, void (*alone_mma)(const float*, const bf16_t*, const bf16_t*, const float*, float*, int, int, int, const u32*),
                                   void (*packed_mma)(const float*, const bf16_t*, const bf16_t*, const float*, float*, int, int, const u32*, const u32*)) {
    const int n = 3, half = D / 4, row = hkv * D, capacity = 256, width = capacity / KV_BLOCK;
    const float eps = 1e-6f;
    const int seen[n] = {0, 40, 100}, count[n] = {70, 9, 30};
    int rows = 0, kv_rows = 0, longest = 0, most = 0;
    std::vector<u32> seqs, posv(seen, seen + n);
    for (int b = 0; b < n; b++) {
        seqs.insert(seqs.end(), {(u32)rows, (u32)count[b], 0u, (u32)kv_rows});
        rows += count[b];
        kv_rows += seen[b] + count[b];
        longest = std::max(longest, count[b]);
        most = std::max(most, seen[b] + count[b]);
    }
    auto qg = random((size_t)rows * hq * 2 * D, -2, 2), k = random((size_t)rows * row, -2, 2), v = random((size_t)rows * row, -2, 2);
    auto q_norm = random(D, 0.5, 1.5), k_norm = random(D, 0.5, 1.5), inv_freq = random(half, 0.001, 1);
    std::vector<Paged> packed, alone;
    std::vector<float*> tables;
    for (int b = 0; b < n; b++) packed.emplace_back(random((size_t)capacity * row, -1, 1), random((size_t)capacity * row, -1, 1), row, width);
    for (auto& c : packed) alone.emplace_back(c);
    for (auto& c : packed) tables.insert(tables.end(), c.table.begin(), c.table.end());
    int koff = packed[0].koff;
    std::vector<float> q((size_t)rows * hq * D), gate(q.size()), out(q.size());
    std::vector<bf16_t> kb((size_t)kv_rows * row), vb(kb.size());
    launch(longest, hq + hkv, n, D, [&] { qk_norm_rope_packed(qg.data(), q.data(), gate.data(), k.data(), v.data(), tables.data(), width, koff, q_norm.data(), k_norm.data(), inv_freq.data(), hq, hkv, D, half, posv.data(), seqs.data(), eps); });
    launch((most * row + 1023) / 1024, 1, n, 256, [&] { kv_to_bf16_packed(tables.data(), width, koff, kb.data(), vb.data(), row, posv.data(), seqs.data()); });
    launch((longest + 63) / 64, hq, n, 256, [&] { packed_mma(q.data(), kb.data(), vb.data(), gate.data(), out.data(), hq, hkv, posv.data(), seqs.data()); });
    bool same = true;
    for (int b = 0; b < n; b++) {
        int first = seqs[4 * b], t = count[b], kv = seen[b] + t;
        std::vector<float> q1((size_t)t * hq * D), g1(q1.size()), o1(q1.size());
        std::vector<bf16_t> kb1((size_t)kv * row), vb1(kb1.size());
        u32 p = seen[b];
        float* const* table = alone[b].table.data();
        launch(t, hq + hkv, 1, D, [&] { qk_norm_rope(qg.data() + (size_t)first * hq * 2 * D, q1.data(), g1.data(), k.data() + (size_t)first * row, v.data() + (size_t)first * row, table, koff, q_norm.data(), k_norm.data(), inv_freq.data(), hq, hkv, D, half, &p, eps); });
        launch((kv * row + 1023) / 1024, 1, 1, 256, [&] { kv_to_bf16(table, koff, kb1.data(), vb1.data(), kv, row); });
        launch((t + 63) / 64, hq, 1, 256, [&] { alone_mma(q1.data(), kb1.data(), vb1.data(), g1.data(), o1.data(), t, hq, hkv, &p); });
        size_t at = (size_t)first * hq * D, kat = (size_t)seqs[4 * b + 3] * row;
        same &= std::equal(q1.begin(), q1.end(), q.begin() + at) && std::equal(g1.begin(), g1.end(), gate.begin() + at) && std::equal(o1.begin(), o1.end(), out.begin() + at);
        same &= std::equal(kb1.begin(), kb1.end(), kb.begin() + kat) && std::equal(vb1.begin(), vb1.end(), vb.begin() + kat);
        for (size_t i = 0; i < packed[b].blocks.size(); i++) same &= packed[b].blocks[i] == alone[b].blocks[i];
    }
    failures += !same;
    printf("%s qk_norm_rope_packed + kv_to_bf16_packed + attention_mma_packed_%d, 3 sequences of 70, 9, 30 rows after 0, 40, 100: each sequence's bits as alone\n", same ? "ok  " : "FAIL", D);
}

static void check_attention_kernels() {
    check_attention(1, 12, 32, 4, 2, 16);
    check_attention(3, 300, 256, 8, 2, 512);
    check_attention(1, 4999, 256, 8, 2, 8192);
    // Groups of 8 query heads and of 1 (a key/value head each).
    check_attention(2, 200, 128, 8, 1, 512);
    check_attention(1, 40, 64, 2, 2, 64);
    check_attention(150, 100, 32, 4, 2);
    check_attention(70, 0, 256, 8, 2);
    check_attention_mma<32>(150, 100, 4, 2, attention_mma_32);
    check_attention_mma<256>(70, 0, 8, 2, attention_mma_256);
    check_attention_mma<128>(100, 40, 4, 1, attention_mma_128);
    check_attention_batch();
    check_attention_packed<32>(4, 2, attention_mma_32, attention_mma_packed_32);
    check_attention_packed<256>(2, 1, attention_mma_256, attention_mma_packed_256);
}
