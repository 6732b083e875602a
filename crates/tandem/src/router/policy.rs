//! The router's two decisions for a request: which decode worker runs it, and whether its
//! prompt is prefilled there (local) or on a prefill worker whose state is then written into
//! the decode worker's slot (remote).
//!
//! Decode worker: the one whose prefix cache holds the most of the prompt (what it holds need
//! not be prefilled anywhere), the least loaded among equals. Prefill: remote where it is
//! expected to cost less, from rates measured while serving: the decode worker's prefill rate
//! (it reports its own) against a prefill worker's (each remote prefill reports its time) plus
//! the state's transfer (per prompt token, as measured); a local prefill also stalls the
//! sequences the decode worker runs, so a remote one may take up to (1 + that worker's load)
//! times as long and still be chosen. Below `min_remote_tokens` uncached tokens, or with no
//! prefill worker, it is local; until a few remote prefills are measured, a busy decode worker
//! tries one (one at a time: the router keeps the others local until it has come back), and
//! after a run of local ones, one goes remote again to measure anew, so that a slow measurement
//! cannot keep every prefill local for good.

use std::time::Duration;

/// What the router knows of a decode worker for one request.
#[derive(Clone, Debug, Default)]
pub struct DecodeCandidate {
    /// Prompt tokens its prefix cache holds.
    pub cached: usize,
    /// Sequences running, requests waiting there, and the router's requests in flight on it.
    pub active: usize,
    pub queued: usize,
    pub in_flight: usize,
    pub max_concurrent: usize,
    /// Its prefill engine's prompt tokens per second so far (None before its first prefill).
    pub prefill_rate: Option<f64>,
}

impl DecodeCandidate {
    fn load(&self) -> f64 {
        (self.active.max(self.in_flight) + self.queued) as f64 / self.max_concurrent.max(1) as f64
    }
}

/// The decode worker to run a request: the most cached tokens, then the least load.
pub fn pick_decode(candidates: &[DecodeCandidate]) -> Option<usize> {
    (0..candidates.len()).max_by(|&a, &b| {
        let (x, y) = (&candidates[a], &candidates[b]);
        x.cached.cmp(&y.cached).then(y.load().total_cmp(&x.load())).then(b.cmp(&a))
    })
}

/// How the router places prefills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// By the rule of this module.
    Conditional,
    /// Always on the decode worker.
    Local,
    /// On a prefill worker whenever one is live.
    Remote,
}

impl Placement {
    pub fn parse(s: &str) -> anyhow::Result<Placement> {
        Ok(match s {
            "conditional" => Placement::Conditional,
            "local" => Placement::Local,
            "remote" => Placement::Remote,
            _ => anyhow::bail!("--prefill-placement {s:?}: conditional, local or remote"),
        })
    }
}

/// Why a prefill went where it did (a label in the router's metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Asked,
    NoPrefillWorker,
    Short,
    DecodeIdle,
    Exploring,
    /// Nothing measured yet and a measuring remote prefill under way: local meanwhile.
    AwaitingMeasurement,
    LocalCheaper,
    RemoteCheaper,
    /// Local would be cheaper by the estimates, but they are old: one goes remote to measure.
    Remeasuring,
}

impl Reason {
    pub fn name(self) -> &'static str {
        match self {
            Reason::Asked => "placement_option",
            Reason::NoPrefillWorker => "no_prefill_worker",
            Reason::Short => "short_prompt",
            Reason::DecodeIdle => "decode_idle",
            Reason::Exploring => "no_remote_measurement_yet",
            Reason::AwaitingMeasurement => "awaiting_remote_measurement",
            Reason::LocalCheaper => "local_cheaper",
            Reason::RemoteCheaper => "remote_cheaper",
            Reason::Remeasuring => "remeasuring",
        }
    }
}

/// What remote prefills have cost lately: per prompt token prefilled, and per prompt token of
/// the state moved (its transfer, checks and the HTTP around it), each the median of the last
/// few remote prefills, so that one slow one (the first write to a decode worker maps its
/// memory; the first prefill of a process makes its buffers) does not decide the next ones.
#[derive(Clone, Debug, Default)]
pub struct RemoteCosts {
    /// The last samples, oldest first: (seconds per prefilled token, seconds per prompt token
    /// of everything else).
    samples: std::collections::VecDeque<(Option<f64>, f64)>,
    /// Prefills the rule has kept local since the last sample.
    kept_local: usize,
}

impl RemoteCosts {
    /// Samples kept; the estimates are their medians.
    const KEPT: usize = 5;
    /// Remote prefills measured before the rule decides by the estimates.
    pub const FIRST: usize = 3;
    /// Prefills kept local by the rule after which one goes remote again to measure anew (the
    /// prefill workers' load and the transfer change while serving).
    pub const REMEASURE_AFTER: usize = 16;

    /// Take in one remote prefill: `prefilled` tokens computed in `prefill`, the whole call
    /// (with the transfer) in `total`, for a prompt of `prompt` tokens.
    pub fn observe(&mut self, prefilled: usize, prompt: usize, prefill: Duration, total: Duration) {
        if prompt == 0 {
            return;
        }
        let per_token = (prefilled > 0).then(|| prefill.as_secs_f64() / prefilled as f64);
        if self.samples.len() == Self::KEPT {
            self.samples.pop_front();
        }
        self.samples.push_back((per_token, total.saturating_sub(prefill).as_secs_f64() / prompt as f64));
        self.kept_local = 0;
    }

    /// Count a prefill the rule kept local.
    pub fn kept_local(&mut self) {
        self.kept_local += 1;
    }

    /// Seconds per prefilled token on a prefill worker (None before the first sample).
    pub fn prefill(&self) -> Option<f64> {
        median(self.samples.iter().filter_map(|s| s.0).collect())
    }

    /// Seconds per prompt token of everything else a remote prefill costs.
    pub fn overhead(&self) -> Option<f64> {
        median(self.samples.iter().map(|s| s.1).collect())
    }
}

/// The middle value (of an even count, the lower of the two middle ones).
fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len().saturating_sub(1) / 2).copied()
}

/// Whether to prefill remotely (true) a prompt of `prompt` tokens of which `uncached` are left
/// to prefill, on the decode worker `decode`, with the router's requests in flight on the least
/// busy prefill worker (each waits for those ahead; None: no prefill worker is live) and what
/// remote prefills have cost so far.
pub fn remote(placement: Placement, min_remote_tokens: usize, prompt: usize, uncached: usize, decode: &DecodeCandidate, prefill_in_flight: Option<usize>, costs: &RemoteCosts) -> (bool, Reason) {
    let Some(prefill_in_flight) = prefill_in_flight else { return (false, Reason::NoPrefillWorker) };
    match placement {
        Placement::Local => return (false, Reason::Asked),
        Placement::Remote => return (true, Reason::Asked),
        Placement::Conditional => {}
    }
    if uncached < min_remote_tokens {
        return (false, Reason::Short);
    }
    let busy = decode.active.max(decode.in_flight) + decode.queued;
    let measured = costs.samples.len() >= RemoteCosts::FIRST;
    let (true, Some(per_token), Some(overhead), Some(local_rate)) = (measured, costs.prefill(), costs.overhead(), decode.prefill_rate) else {
        // Too little measured yet: an idle decode worker loses nothing by prefilling; a busy
        // one tries a prefill worker, which measures it.
        return if busy == 0 { (false, Reason::DecodeIdle) } else { (true, Reason::Exploring) };
    };
    // Expected seconds to the first token: locally the prefill after those queued ahead (as
    // long as this one each), remotely after the prefill worker's own requests in flight.
    let local = uncached as f64 / local_rate * (1 + decode.queued) as f64;
    let remote = uncached as f64 * per_token * (1 + prefill_in_flight) as f64 + prompt as f64 * overhead;
    // A local prefill stalls the decode worker's running sequences meanwhile.
    let stall = 1.0 + decode.active.max(decode.in_flight) as f64 / decode.max_concurrent.max(1) as f64;
    if remote < local * stall {
        (true, Reason::RemoteCheaper)
    } else if costs.kept_local >= RemoteCosts::REMEASURE_AFTER && prefill_in_flight == 0 {
        (true, Reason::Remeasuring)
    } else {
        (false, Reason::LocalCheaper)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(cached: usize, active: usize, queued: usize) -> DecodeCandidate {
        DecodeCandidate { cached, active, queued, in_flight: 0, max_concurrent: 8, prefill_rate: Some(1000.0) }
    }

    #[test]
    fn the_decode_worker_holding_the_most_of_the_prompt_wins_then_the_least_loaded() {
        assert_eq!(pick_decode(&[worker(0, 0, 0), worker(100, 7, 3), worker(40, 0, 0)]), Some(1));
        assert_eq!(pick_decode(&[worker(0, 5, 0), worker(0, 1, 0), worker(0, 3, 0)]), Some(1));
        // Equal in both: the first.
        assert_eq!(pick_decode(&[worker(0, 1, 0), worker(0, 1, 0)]), Some(0));
        assert_eq!(pick_decode(&[]), None);
    }

    #[test]
    fn prefills_go_where_they_are_expected_to_cost_less() {
        let (busy, idle) = (worker(0, 4, 0), worker(0, 0, 0));
        let c = Placement::Conditional;
        let free = Some(0);
        let none = RemoteCosts::default();
        assert_eq!(remote(c, 256, 1000, 1000, &busy, None, &none), (false, Reason::NoPrefillWorker));
        assert_eq!(remote(c, 256, 100, 100, &busy, free, &none), (false, Reason::Short));
        // Nothing measured: idle stays local, busy explores.
        assert_eq!(remote(c, 256, 1000, 1000, &idle, free, &none), (false, Reason::DecodeIdle));
        assert_eq!(remote(c, 256, 1000, 1000, &busy, free, &none), (true, Reason::Exploring));
        // The decode worker prefills 1000 tok/s: 1 s for 1000 tokens.
        let measured = |prefill_ms: u64, total_ms: u64| {
            let mut costs = RemoteCosts::default();
            for _ in 0..RemoteCosts::FIRST {
                costs.observe(1000, 1000, Duration::from_millis(prefill_ms), Duration::from_millis(total_ms));
            }
            costs
        };
        let costs = measured(500, 600);
        assert_eq!(remote(c, 256, 1000, 1000, &busy, free, &costs), (true, Reason::RemoteCheaper), "0.6 s remote against 1 s local");
        // Until a few remote prefills are measured, a busy decode worker keeps trying one.
        let mut first = RemoteCosts::default();
        first.observe(1000, 1000, Duration::from_millis(500), Duration::from_millis(600));
        assert_eq!(remote(c, 256, 1000, 1000, &busy, free, &first), (true, Reason::Exploring));
        let slow = measured(500, 2500);
        assert_eq!(remote(c, 256, 1000, 1000, &busy, free, &slow), (false, Reason::LocalCheaper), "2.5 s remote against 1 s local, 1.5 s with the stall");
        // Half a batch running: 1.5 s remote is worth sparing it the stall only when full.
        let mid = measured(500, 1600);
        assert!(!remote(c, 256, 1000, 1000, &busy, free, &mid).0, "1.6 s against 1 s x 1.5");
        assert!(remote(c, 256, 1000, 1000, &worker(0, 8, 0), free, &mid).0, "1.6 s against 1 s x 2");
        // The options override the rule, but not the lack of a prefill worker.
        let full = Some(8);
        assert_eq!(remote(Placement::Remote, 256, 3, 3, &idle, full, &slow), (true, Reason::Asked));
        assert_eq!(remote(Placement::Local, 256, 1000, 1000, &busy, free, &costs), (false, Reason::Asked));
        assert_eq!(remote(Placement::Remote, 256, 1000, 1000, &busy, None, &costs), (false, Reason::NoPrefillWorker));
    }

    #[test]
    fn remote_costs_are_medians_per_token_of_the_last_samples() {
        let mut c = RemoteCosts::default();
        assert_eq!((c.prefill(), c.overhead()), (None, None));
        c.observe(100, 200, Duration::from_millis(100), Duration::from_millis(300));
        assert_eq!((c.prefill(), c.overhead()), (Some(0.001), Some(0.001)));
        // A slow first one (10 s more for the transfer) no longer counts once two more came.
        let mut c = RemoteCosts::default();
        c.observe(100, 200, Duration::from_millis(100), Duration::from_millis(10_100));
        c.observe(100, 200, Duration::from_millis(100), Duration::from_millis(300));
        c.observe(100, 200, Duration::from_millis(200), Duration::from_millis(400));
        assert!((c.prefill().unwrap() - 0.001).abs() < 1e-12 && (c.overhead().unwrap() - 0.001).abs() < 1e-12, "{c:?}");
        // Only the last five count: five cheap transfers replace it altogether.
        for _ in 0..5 {
            c.observe(100, 200, Duration::from_millis(100), Duration::from_millis(120));
        }
        assert!((c.overhead().unwrap() - 0.0001).abs() < 1e-12, "{c:?}");
    }

    #[test]
    fn after_a_run_of_local_prefills_one_goes_remote_to_measure_anew() {
        let mut c = RemoteCosts::default();
        for _ in 0..RemoteCosts::FIRST {
            c.observe(1000, 1000, Duration::from_millis(500), Duration::from_millis(2500));
        }
        let busy = worker(0, 4, 0);
        for _ in 0..RemoteCosts::REMEASURE_AFTER {
            assert_eq!(remote(Placement::Conditional, 256, 1000, 1000, &busy, Some(0), &c), (false, Reason::LocalCheaper));
            c.kept_local();
        }
        // Not while the prefill worker is busy; then once, and the sample starts a new run.
        assert_eq!(remote(Placement::Conditional, 256, 1000, 1000, &busy, Some(1), &c), (false, Reason::LocalCheaper));
        assert_eq!(remote(Placement::Conditional, 256, 1000, 1000, &busy, Some(0), &c), (true, Reason::Remeasuring));
        c.observe(1000, 1000, Duration::from_millis(500), Duration::from_millis(2500));
        assert_eq!(remote(Placement::Conditional, 256, 1000, 1000, &busy, Some(0), &c), (false, Reason::LocalCheaper));
    }
}
