//! `/metrics` in the Prometheus text format (version 0.0.4), written by hand: a few counters,
//! gauges and two histograms need no client library.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tandem_core::backend::cuda::qwen35::device_pool::PoolLevel;
use tandem_core::prefix_cache::CacheStats;

/// Time to first token: from the request's arrival to its first token, queueing included.
const TTFT_BUCKETS: [f64; 15] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Time per output token after the first.
const TPOT_BUCKETS: [f64; 13] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5];

struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative), and one past the last bound.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, seconds: f64) {
        let i = self.bounds.iter().position(|&b| seconds <= b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += seconds;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", self.count, self.sum, self.count);
    }
}

/// Counters that only go up, by name.
#[derive(Default)]
pub struct Counters {
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens actually prefilled (the rest came from cached states).
    pub prefilled_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub typing_requests: AtomicU64,
    /// Sessions' reply ends prefilled in the background for their next turns.
    pub reply_prefills: AtomicU64,
}

/// What the served model and engines are, fixed at start-up: what a load generator needs to
/// work out the physical limit of a load (the operations a prompt takes, the bytes a decode step
/// reads) and to make prompts.
#[derive(Clone, Copy, Default)]
pub struct Served {
    /// Bytes of weights one decode step streams.
    pub decode_weight_bytes: usize,
    /// Bytes of one sequence's fixed-size (recurrent and conv) state.
    pub state_bytes: usize,
    pub kv_bytes_per_token: usize,
    /// Floating-point operations of the projections a prompt token takes in a prefill.
    pub prefill_flops_per_token: f64,
    /// Token ids a prompt may hold: 0..vocab.
    pub vocab: usize,
    /// Sequences that may run at once (--max-concurrent).
    pub sequence_slots: usize,
}

pub struct Metrics {
    pub counters: Counters,
    served: Served,
    ttft: Mutex<Histogram>,
    tpot: Mutex<Histogram>,
    /// Finished requests by (endpoint, outcome).
    outcomes: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
}

/// Readings taken when `/metrics` is asked for.
pub struct Gauges {
    /// The decode engine's K/V cache (a GPU engine's pool, a CPU engine's budget): blocks in
    /// use and its limit.
    pub kv: Option<PoolLevel>,
    /// Its state slots: slots in use and their limit.
    pub slots: Option<PoolLevel>,
    /// Sequences swapped out of it (to host memory, a CPU engine's to disk), and back, so far.
    pub swaps: (u64, u64),
    pub queued: usize,
    pub active: usize,
    pub cache: CacheGauges,
    pub prefill_busy: Duration,
    pub decode_busy: Duration,
}

/// The prefix cache's readings.
#[derive(Default)]
pub struct CacheGauges {
    /// Bytes and snapshots on the GPU, in host memory, on disk.
    pub bytes: [usize; 3],
    pub snapshots: [usize; 3],
    pub sessions: usize,
    pub stats: CacheStats,
}

fn gauge(out: &mut String, name: &str, help: &str, v: f64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
}

/// A decode engine's pool (its K/V blocks or state slots; a CPU engine's budget counts them): `{names[0]}_used`, `_allocated`
/// and `_limit` (where one is set) in pieces, and `names[1]`, the bytes of one.
fn pool_gauges(out: &mut String, level: &PoolLevel, names: [&str; 2], pieces: &str, piece: &str) {
    let [count, bytes] = names;
    gauge(out, &format!("{count}_used"), &format!("The {pieces} held by sequences (of the decode engine's pool or budget)."), level.used as f64);
    gauge(out, &format!("{count}_allocated"), &format!("The {pieces} allocated (held or free; a CPU engine allocates as it holds)."), level.allocated as f64);
    if let Some(limit) = level.limit {
        gauge(out, &format!("{count}_limit"), &format!("The most {pieces} the budget allows."), limit as f64);
    }
    gauge(out, bytes, &format!("Bytes of {piece}."), level.piece_bytes as f64);
}

pub fn add(counter: &AtomicU64, n: usize) {
    counter.fetch_add(n as u64, Ordering::Relaxed);
}

impl Metrics {
    pub fn new(served: Served) -> Metrics {
        Metrics { counters: Counters::default(), served, ttft: Mutex::new(Histogram::new(&TTFT_BUCKETS)), tpot: Mutex::new(Histogram::new(&TPOT_BUCKETS)), outcomes: Mutex::new(BTreeMap::new()) }
    }

    pub fn ttft(&self, d: Duration) {
        self.ttft.lock().expect("metrics lock").observe(d.as_secs_f64());
    }

    pub fn tpot(&self, d: Duration) {
        self.tpot.lock().expect("metrics lock").observe(d.as_secs_f64());
    }

    pub fn outcome(&self, endpoint: &'static str, outcome: &'static str) {
        *self.outcomes.lock().expect("metrics lock").entry((endpoint, outcome)).or_default() += 1;
    }

    pub fn render(&self, g: &Gauges) -> String {
        let mut out = String::new();
        let c = &self.counters;
        let counter = |out: &mut String, name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", v.load(Ordering::Relaxed));
        };
        gauge(&mut out, "tandem_queue_depth", "Requests waiting for a sequence slot (past --max-concurrent).", g.queued as f64);
        gauge(&mut out, "tandem_active_sequences", "Requests holding a sequence slot (prefilling or decoding).", g.active as f64);
        let m = &self.served;
        gauge(&mut out, "tandem_sequence_slots", "Sequences that may run at once (--max-concurrent).", m.sequence_slots as f64);
        gauge(&mut out, "tandem_model_decode_weight_bytes", "Bytes of weights one decode step streams.", m.decode_weight_bytes as f64);
        gauge(&mut out, "tandem_model_state_bytes", "Bytes of one sequence's recurrent and conv state.", m.state_bytes as f64);
        gauge(&mut out, "tandem_model_kv_bytes_per_token", "Bytes of keys and values one token adds.", m.kv_bytes_per_token as f64);
        gauge(&mut out, "tandem_model_prefill_flops_per_token", "Floating-point operations of the layers' projections per prompt token (2 per weight; attention, the delta rule and the LM head not counted).", m.prefill_flops_per_token);
        gauge(&mut out, "tandem_model_vocab_size", "Token ids a prompt may hold (0 to this, exclusive).", m.vocab as f64);
        counter(&mut out, "tandem_prompt_tokens_total", "Prompt tokens of requests served.", &c.prompt_tokens);
        counter(&mut out, "tandem_prefilled_tokens_total", "Prompt tokens prefilled (not covered by a cached state).", &c.prefilled_tokens);
        counter(&mut out, "tandem_generation_tokens_total", "Tokens generated.", &c.generation_tokens);
        counter(&mut out, "tandem_typing_requests_total", "Typing-ahead requests served.", &c.typing_requests);
        counter(&mut out, "tandem_prefix_cache_reply_prefills_total", "Sessions' reply ends prefilled in the background for their next turns.", &c.reply_prefills);
        if let Some(kv) = &g.kv {
            pool_gauges(&mut out, kv, ["tandem_kv_cache_blocks", "tandem_kv_cache_block_bytes"], "K/V cache blocks", "one K/V cache block");
        }
        if let Some(slots) = &g.slots {
            pool_gauges(&mut out, slots, ["tandem_state_slots", "tandem_state_slot_bytes"], "state slots", "one state slot");
        }
        let _ = writeln!(out, "# HELP tandem_kv_cache_swaps_total Sequences swapped out of the K/V cache to make room (a GPU engine's to host memory, a CPU engine's to disk), and back.\n# TYPE tandem_kv_cache_swaps_total counter");
        let _ = writeln!(out, "tandem_kv_cache_swaps_total{{direction=\"out\"}} {}\ntandem_kv_cache_swaps_total{{direction=\"in\"}} {}", g.swaps.0, g.swaps.1);
        let (pc, st) = (&g.cache, &g.cache.stats);
        for (name, help, v) in [
            ("lookups", "Requests that looked their prompt up in the prefix cache.", st.lookups),
            ("hits", "Requests that continued a cached state.", st.hits),
            ("hit_tokens", "Prompt tokens covered by the cached states continued (not prefilled).", st.hit_tokens),
            ("matched_tokens", "Prompt tokens matching what earlier requests applied (what a snapshot at every token would cover).", st.matched_tokens),
            ("inserted", "Snapshots kept.", st.inserted),
            ("evictions", "Snapshots evicted to keep the budget.", st.evicted),
            ("sessions_released", "Sessions whose pinned snapshots were let go to keep the budget.", st.sessions_released),
            ("demoted", "Snapshots the GPU's tier let go that moved to host memory or disk.", st.demoted),
            ("spilled", "Snapshots written to the disk tier as host memory (or the GPU's tier) let them go.", st.spilled),
            ("refused", "Snapshots on disk refused as they were read back (damaged, or another model's).", st.refused),
        ] {
            let name = format!("tandem_prefix_cache_{name}_total");
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
        let _ = writeln!(out, "# HELP tandem_prefix_cache_bytes Bytes of state snapshots in the prefix cache, by memory tier (K/V blocks that snapshots share counted once).\n# TYPE tandem_prefix_cache_bytes gauge");
        for (tier, v) in ["device", "host", "disk"].iter().zip(pc.bytes) {
            let _ = writeln!(out, "tandem_prefix_cache_bytes{{tier=\"{tier}\"}} {v}");
        }
        let _ = writeln!(out, "# HELP tandem_prefix_cache_snapshots State snapshots in the prefix cache, by memory tier.\n# TYPE tandem_prefix_cache_snapshots gauge");
        for (tier, v) in ["device", "host", "disk"].iter().zip(pc.snapshots) {
            let _ = writeln!(out, "tandem_prefix_cache_snapshots{{tier=\"{tier}\"}} {v}");
        }
        gauge(&mut out, "tandem_prefix_cache_pinned_sessions", "Sessions whose latest states are pinned in the prefix cache.", pc.sessions as f64);
        let _ = writeln!(out, "# HELP tandem_engine_busy_seconds_total Time the engines spent computing, by kind of work.\n# TYPE tandem_engine_busy_seconds_total counter");
        let _ = writeln!(out, "tandem_engine_busy_seconds_total{{work=\"prefill\"}} {}", g.prefill_busy.as_secs_f64());
        let _ = writeln!(out, "tandem_engine_busy_seconds_total{{work=\"decode\"}} {}", g.decode_busy.as_secs_f64());
        let _ = writeln!(out, "# HELP tandem_requests_total Requests answered, by endpoint and outcome.\n# TYPE tandem_requests_total counter");
        for ((endpoint, outcome), n) in self.outcomes.lock().expect("metrics lock").iter() {
            let _ = writeln!(out, "tandem_requests_total{{endpoint=\"{endpoint}\",outcome=\"{outcome}\"}} {n}");
        }
        self.ttft.lock().expect("metrics lock").write(&mut out, "tandem_time_to_first_token_seconds", "From a request's arrival to its first token.");
        self.tpot.lock().expect("metrics lock").write(&mut out, "tandem_time_per_output_token_seconds", "Time per generated token after the first.");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_with_sum_and_count() {
        let m = Metrics::new(Served { sequence_slots: 8, ..Served::default() });
        m.ttft(Duration::from_millis(3));
        m.ttft(Duration::from_millis(70));
        m.ttft(Duration::from_secs(100));
        m.outcome("chat", "stop");
        let cache = CacheGauges { bytes: [30, 10, 0], snapshots: [2, 1, 0], sessions: 0, stats: CacheStats { hits: 2, ..CacheStats::default() } };
        let g = Gauges { kv: None, slots: None, swaps: (0, 0), queued: 1, active: 2, cache, prefill_busy: Duration::from_millis(1500), decode_busy: Duration::ZERO };
        let text = m.render(&g);
        for line in [
            "tandem_time_to_first_token_seconds_bucket{le=\"0.0025\"} 0",
            "tandem_time_to_first_token_seconds_bucket{le=\"0.005\"} 1",
            "tandem_time_to_first_token_seconds_bucket{le=\"0.1\"} 2",
            "tandem_time_to_first_token_seconds_bucket{le=\"60\"} 2",
            "tandem_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3",
            "tandem_time_to_first_token_seconds_count 3",
            "tandem_queue_depth 1",
            "tandem_sequence_slots 8",
            "tandem_prefix_cache_hits_total 2",
            "tandem_prefix_cache_bytes{tier=\"host\"} 10",
            "tandem_prefix_cache_bytes{tier=\"device\"} 30",
            "tandem_prefix_cache_snapshots{tier=\"device\"} 2",
            "tandem_engine_busy_seconds_total{work=\"prefill\"} 1.5",
            "tandem_requests_total{endpoint=\"chat\",outcome=\"stop\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
    }
}
