//! The router's two decisions for a request: which decode worker runs it, and whether its
//! prompt is prefilled there (local) or on a prefill worker whose state is then written into
//! the decode worker's slot (remote).
//!
//! Decode worker: the one whose prefix cache holds the most of the prompt (what it holds need
//! not be prefilled anywhere), the least loaded among equals. Prefill: remote only where it can
//! pay: enough tokens left to prefill (`min_remote_tokens`: below it the transfer costs about
//! what the prefill does), the decode worker busy (a prefill there delays the tokens of the
//! sequences it runs; an idle one loses nothing), and a prefill worker no busier than the
//! decode worker.

/// What the router knows of a decode worker for one request.
#[derive(Clone, Debug)]
pub struct DecodeCandidate {
    /// Prompt tokens its prefix cache holds.
    pub cached: usize,
    /// Sequences running, requests waiting there, and the router's requests in flight on it.
    pub active: usize,
    pub queued: usize,
    pub in_flight: usize,
    pub max_concurrent: usize,
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
    PrefillBusier,
    DecodeBusy,
}

impl Reason {
    pub fn name(self) -> &'static str {
        match self {
            Reason::Asked => "placement_option",
            Reason::NoPrefillWorker => "no_prefill_worker",
            Reason::Short => "short_prompt",
            Reason::DecodeIdle => "decode_idle",
            Reason::PrefillBusier => "prefill_busier",
            Reason::DecodeBusy => "decode_busy",
        }
    }
}

/// Whether to prefill remotely (true) a prompt of which `uncached` tokens are left to
/// prefill, on the decode worker `decode`, with the least busy prefill worker's requests in
/// flight and most concurrent (None: no prefill worker is live).
pub fn remote(placement: Placement, min_remote_tokens: usize, uncached: usize, decode: &DecodeCandidate, prefill: Option<(usize, usize)>) -> (bool, Reason) {
    let Some((prefill_in_flight, prefill_max)) = prefill else { return (false, Reason::NoPrefillWorker) };
    match placement {
        Placement::Local => return (false, Reason::Asked),
        Placement::Remote => return (true, Reason::Asked),
        Placement::Conditional => {}
    }
    if uncached < min_remote_tokens {
        return (false, Reason::Short);
    }
    if decode.active.max(decode.in_flight) == 0 && decode.queued == 0 {
        return (false, Reason::DecodeIdle);
    }
    let prefill_load = prefill_in_flight as f64 / prefill_max.max(1) as f64;
    if prefill_load > decode.load() {
        return (false, Reason::PrefillBusier);
    }
    (true, Reason::DecodeBusy)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(cached: usize, active: usize, queued: usize) -> DecodeCandidate {
        DecodeCandidate { cached, active, queued, in_flight: 0, max_concurrent: 8 }
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
    fn prefills_go_remote_only_where_they_can_pay() {
        let busy = worker(0, 4, 0);
        let idle = worker(0, 0, 0);
        let c = Placement::Conditional;
        assert_eq!(remote(c, 256, 1000, &busy, None), (false, Reason::NoPrefillWorker));
        assert_eq!(remote(c, 256, 100, &busy, Some((0, 8))), (false, Reason::Short));
        assert_eq!(remote(c, 256, 1000, &idle, Some((0, 8))), (false, Reason::DecodeIdle));
        assert_eq!(remote(c, 256, 1000, &busy, Some((8, 8))), (false, Reason::PrefillBusier));
        assert_eq!(remote(c, 256, 1000, &busy, Some((1, 8))), (true, Reason::DecodeBusy));
        // The options override the rule, but not the lack of a prefill worker.
        assert_eq!(remote(Placement::Remote, 256, 3, &idle, Some((8, 8))), (true, Reason::Asked));
        assert_eq!(remote(Placement::Local, 256, 1000, &busy, Some((0, 8))), (false, Reason::Asked));
        assert_eq!(remote(Placement::Remote, 256, 1000, &busy, None), (false, Reason::NoPrefillWorker));
    }
}
