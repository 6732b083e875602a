//! An engine is a backend, its resources and a prefill dispatch contract, e.g.
//! `cpu:cores=0,dispatch=batched:32`: the CPU kernels on a pool pinned to core 0, prefilling
//! in fixed 32-token dispatches as a static-shape accelerator would (the study's Neural
//! Engine). A prefill engine and a decode engine make a placement; both may be the same.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::model::{Logits, Qwen35};
use crate::pool::Pool;
use crate::state::State;

/// How an engine applies a prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dispatch {
    /// One token per dispatch (the study's first engine).
    Sequential,
    /// Fixed dispatches of N rows; the last one right-padded and masked.
    Batched(usize),
    /// One static shape per bucket (ascending): each dispatch takes the smallest bucket that
    /// holds the rest of the prompt, or the largest one, padded and masked.
    Buckets(Vec<usize>),
    /// Whatever the prompt needs, in one call.
    Dynamic,
}

impl Dispatch {
    pub fn parse(s: &str) -> Result<Dispatch> {
        let positive = |v: &str| -> Result<usize> {
            match v.trim().parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                _ => bail!("dispatch {s:?}: {v:?} is not a positive number of tokens"),
            }
        };
        Ok(match s.split_once(':') {
            None if s == "sequential" => Dispatch::Sequential,
            None if s == "dynamic" => Dispatch::Dynamic,
            Some(("batched", n)) => Dispatch::Batched(positive(n)?),
            Some(("buckets", list)) => {
                let mut b = list.split(',').map(positive).collect::<Result<Vec<_>>>()?;
                b.sort_unstable();
                b.dedup();
                Dispatch::Buckets(b)
            }
            _ => bail!("unknown dispatch {s:?}: choose sequential, batched:N, buckets:64,256,512 or dynamic"),
        })
    }

    /// The dispatches of an `n`-token prompt: (real tokens, rows) each.
    pub fn plan(&self, n: usize) -> Vec<(usize, usize)> {
        match self {
            Dispatch::Sequential => vec![(1, 1); n],
            Dispatch::Dynamic => vec![(n, n)],
            Dispatch::Batched(size) => (0..n).step_by(*size).map(|i| ((n - i).min(*size), *size)).collect(),
            Dispatch::Buckets(buckets) => {
                let mut plan = Vec::new();
                let mut left = n;
                while left > 0 {
                    let b = buckets.iter().copied().find(|&b| b >= left).unwrap_or(*buckets.last().expect("buckets are never empty"));
                    plan.push((left.min(b), b));
                    left -= left.min(b);
                }
                plan
            }
        }
    }
}

impl std::fmt::Display for Dispatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dispatch::Sequential => write!(f, "sequential"),
            Dispatch::Dynamic => write!(f, "dynamic"),
            Dispatch::Batched(n) => write!(f, "batched:{n}"),
            Dispatch::Buckets(b) => write!(f, "buckets:{}", b.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(",")),
        }
    }
}

/// Where an engine runs and how it dispatches: `cpu[:cores=0-3|threads=N][,dispatch=MODE]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Pin one worker to each of these cores (the engine's thread takes the first).
    pub cores: Option<Vec<usize>>,
    /// Or this many unpinned workers (default: every core).
    pub threads: Option<usize>,
    pub dispatch: Dispatch,
}

impl Placement {
    /// Parse a placement. Values may contain commas (`cores=0,1`, `buckets:64,256`): a part
    /// without `=` continues the previous value.
    pub fn parse(spec: &str) -> Result<Placement> {
        let (backend, opts) = spec.split_once(':').unwrap_or((spec, ""));
        match backend {
            "cpu" => {}
            "cuda" => bail!("placement {spec:?}: this build has no CUDA backend yet; use cpu"),
            other => bail!("placement {spec:?}: unknown backend {other:?} (choose cpu)"),
        }
        let mut pairs: Vec<(String, String)> = Vec::new();
        for part in opts.split(',').filter(|p| !p.is_empty()) {
            match part.split_once('=') {
                Some((k, v)) => pairs.push((k.trim().to_string(), v.trim().to_string())),
                None => match pairs.last_mut() {
                    Some((_, v)) => {
                        v.push(',');
                        v.push_str(part.trim());
                    }
                    None => bail!("placement {spec:?}: {part:?} is not key=value"),
                },
            }
        }
        let mut p = Placement { cores: None, threads: None, dispatch: Dispatch::Dynamic };
        for (k, v) in pairs {
            match k.as_str() {
                "cores" => p.cores = Some(parse_cores(&v).with_context(|| format!("placement {spec:?}"))?),
                "threads" => match v.parse::<usize>() {
                    Ok(n) if n > 0 => p.threads = Some(n),
                    _ => bail!("placement {spec:?}: threads={v:?} is not a positive number"),
                },
                "dispatch" => p.dispatch = Dispatch::parse(&v).with_context(|| format!("placement {spec:?}"))?,
                other => bail!("placement {spec:?}: unknown key {other:?} (keys: cores, threads, dispatch)"),
            }
        }
        if p.cores.is_some() && p.threads.is_some() {
            bail!("placement {spec:?}: give cores or threads, not both");
        }
        Ok(p)
    }

    /// The worker pool this placement asks for, pinning the calling thread when it names cores.
    pub fn pool(&self) -> Result<Pool> {
        match (&self.cores, self.threads) {
            (Some(cores), _) => Pool::pinned(cores),
            (None, Some(n)) => Ok(Pool::new(n)),
            (None, None) => Ok(Pool::new(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))),
        }
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cpu:")?;
        match (&self.cores, self.threads) {
            (Some(c), _) => write!(f, "cores={},", c.iter().map(|c| c.to_string()).collect::<Vec<_>>().join("+"))?,
            (None, Some(n)) => write!(f, "threads={n},")?,
            (None, None) => {}
        }
        write!(f, "dispatch={}", self.dispatch)
    }
}

/// `0`, `0,1`, `0-3`, `0+2` (also mixed: `0-1,4`).
fn parse_cores(s: &str) -> Result<Vec<usize>> {
    let num = |x: &str| x.trim().parse::<usize>().map_err(|_| anyhow::anyhow!("cores: {x:?} is not a core number"));
    let mut cores = Vec::new();
    for part in s.split([',', '+']) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    bail!("cores: range {part:?} runs backwards");
                }
                cores.extend(a..=b);
            }
            None => cores.push(num(part)?),
        }
    }
    if cores.is_empty() {
        bail!("cores: no core given");
    }
    Ok(cores)
}

/// What one prefill did.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrefillStats {
    pub tokens: usize,
    pub dispatches: usize,
    /// Rows computed beyond the real tokens (the padding of static-shape dispatches).
    pub padded_rows: usize,
    pub time: Duration,
}

/// A CPU engine: the model's kernels on a worker pool, with a dispatch mode. It must be made
/// on the thread that will run it (a pinned pool pins that thread).
pub struct Engine<'m> {
    pub placement: Placement,
    pub net: &'m Qwen35,
    pool: Pool,
}

impl<'m> Engine<'m> {
    pub fn new(placement: &Placement, net: &'m Qwen35) -> Result<Engine<'m>> {
        Ok(Engine { placement: placement.clone(), net, pool: placement.pool()? })
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Apply `tokens` to `state` in this engine's dispatches; `state.last_logits` ends up
    /// holding the logits of the last token.
    pub fn prefill(&self, tokens: &[u32], state: &mut State) -> Result<PrefillStats> {
        let start = Instant::now();
        let plan = self.placement.dispatch.plan(tokens.len());
        let mut at = 0;
        let mut padded_rows = 0;
        for &(real, rows) in &plan {
            let part = &tokens[at..at + real];
            match self.placement.dispatch {
                Dispatch::Sequential | Dispatch::Dynamic => {
                    self.net.forward(&self.pool, part, state, Logits::Last)?;
                }
                Dispatch::Batched(_) | Dispatch::Buckets(_) => {
                    let mut shaped = part.to_vec();
                    // Pad id 0: any id works, pads are masked out.
                    shaped.resize(rows, 0);
                    self.net.forward_padded(&self.pool, &shaped, real, state)?;
                }
            }
            padded_rows += rows - real;
            at += real;
        }
        Ok(PrefillStats { tokens: tokens.len(), dispatches: plan.len(), padded_rows, time: start.elapsed() })
    }

    /// One decode step: `tokens[i]` applied to `states[i]`, all in one pass over the weights.
    pub fn decode(&self, tokens: &[u32], states: &mut [&mut State]) -> Result<()> {
        if let [state] = states {
            self.net.forward(&self.pool, tokens, state, Logits::Last)?;
            return Ok(());
        }
        self.net.decode_batch(&self.pool, tokens, states)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_parse_with_commas_inside_values() {
        let p = Placement::parse("cpu:cores=0,dispatch=batched:32").unwrap();
        assert_eq!(p.cores, Some(vec![0]));
        assert_eq!(p.dispatch, Dispatch::Batched(32));
        let p = Placement::parse("cpu:cores=0,1,dispatch=buckets:256,64,512").unwrap();
        assert_eq!(p.cores, Some(vec![0, 1]));
        assert_eq!(p.dispatch, Dispatch::Buckets(vec![64, 256, 512]));
        assert_eq!(Placement::parse("cpu:cores=0-2").unwrap().cores, Some(vec![0, 1, 2]));
        assert_eq!(Placement::parse("cpu").unwrap(), Placement { cores: None, threads: None, dispatch: Dispatch::Dynamic });
        assert_eq!(Placement::parse("cpu:threads=2,dispatch=sequential").unwrap().to_string(), "cpu:threads=2,dispatch=sequential");
        for (bad, says) in [
            ("gpu", "unknown backend"),
            ("cpu:cores=x", "not a core number"),
            ("cpu:dispatch=batched:0", "positive"),
            ("cpu:dispatch=chunky", "unknown dispatch"),
            ("cpu:speed=fast", "unknown key"),
            ("cpu:cores=1,threads=2", "not both"),
            ("cpu:0", "not key=value"),
        ] {
            let e = format!("{:#}", Placement::parse(bad).unwrap_err());
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn dispatch_plans_cover_the_prompt_with_the_right_shapes() {
        assert_eq!(Dispatch::Batched(32).plan(74), vec![(32, 32), (32, 32), (10, 32)]);
        assert_eq!(Dispatch::Buckets(vec![64, 256, 512]).plan(74), vec![(74, 256)]);
        assert_eq!(Dispatch::Buckets(vec![64, 256]).plan(600), vec![(256, 256), (256, 256), (88, 256)]);
        assert_eq!(Dispatch::Buckets(vec![64, 256]).plan(40), vec![(40, 64)]);
        assert_eq!(Dispatch::Sequential.plan(3), vec![(1, 1); 3]);
        assert_eq!(Dispatch::Dynamic.plan(74), vec![(74, 74)]);
        for d in [Dispatch::Batched(7), Dispatch::Buckets(vec![3, 10]), Dispatch::Sequential, Dispatch::Dynamic] {
            for n in 1..50 {
                let plan = d.plan(n);
                assert_eq!(plan.iter().map(|p| p.0).sum::<usize>(), n, "{d} n={n}");
                assert!(plan.iter().all(|&(real, rows)| real >= 1 && real <= rows));
            }
        }
    }
}
