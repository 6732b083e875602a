//! A timeline of the engines' work (`--trace FILE`): every prefill call, every sampling of a
//! decode batch and every decode step, with its start, its duration and how many prompts,
//! tokens or sequences it carried, on one track per engine (its thread's name); and a prefix
//! cache's work that bears on theirs (snapshots taken and restored on the engines, lookups and
//! keeps on a server's threads, snapshots copied off the GPU). The file is in the Chrome
//! trace-event format (a JSON array of complete events, timestamps in microseconds from the
//! pipeline's start), which Perfetto (ui.perfetto.dev) and chrome://tracing open, and which
//! `scripts/trace_summary.py` sums up. Spans are measured on the host: a GPU engine's call
//! counts from its first launch to the moment the host has what it waits for.
//!
//! The engines hand each event to a writer thread, so that a step never waits for the disk;
//! the writer flushes whenever it has caught up, so a server stopped with a signal leaves every
//! event but the last few milliseconds' (the closing bracket then missing, which the format
//! allows).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::mpsc::{channel, Sender};
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{Context, Result};

/// What a span carried (the event's `args`).
#[derive(Clone, Copy, Debug)]
pub enum Work {
    /// Prompts (or chunks of prompts) applied in one prefill call, and their tokens.
    Prefill { prompts: usize, tokens: usize },
    /// The next token of every running sequence drawn from its logits.
    Sample { sequences: usize },
    /// One batched decode step; `positions`: the sequences' cached positions in all (what its
    /// attention reads).
    Decode { sequences: usize, positions: usize },
    /// A copy of a request's state for a prefix cache, at `tokens` tokens.
    Snapshot { tokens: usize },
    /// A request's state made from a prefix cache's snapshot of `tokens` tokens, kept in `tier`.
    Restore { tokens: usize, tier: &'static str },
    /// A prefix cache's work on a server's thread: `snapshots` kept (its lock held, with the
    /// eviction that made room for them), or a lookup (0; a snapshot of the disk tier read
    /// back with the lock let go).
    Cache { snapshots: usize },
    /// A snapshot of `tokens` tokens copied from the GPU to host memory for a prefix cache.
    Demote { tokens: usize },
    /// A state of `tokens` tokens the decode engine took in from the prefill engine: read from
    /// a file or socket, or copied onto its device (from another GPU, or from the host).
    Receive { tokens: usize },
}

impl Work {
    fn is_empty(&self) -> bool {
        matches!(*self, Work::Prefill { prompts: 0, .. } | Work::Sample { sequences: 0 } | Work::Decode { sequences: 0, .. })
    }

    fn name(&self) -> &'static str {
        match self {
            Work::Prefill { .. } => "prefill",
            Work::Sample { .. } => "sample",
            Work::Decode { .. } => "decode step",
            Work::Snapshot { .. } => "snapshot",
            Work::Restore { .. } => "restore",
            Work::Cache { snapshots: 0 } => "cache lookup",
            Work::Cache { .. } => "cache keep",
            Work::Demote { .. } => "demote",
            Work::Receive { .. } => "receive",
        }
    }

    fn args(&self) -> String {
        match *self {
            Work::Prefill { prompts, tokens } => format!("{{\"prompts\":{prompts},\"tokens\":{tokens}}}"),
            Work::Sample { sequences } => format!("{{\"sequences\":{sequences}}}"),
            Work::Decode { sequences, positions } => format!("{{\"sequences\":{sequences},\"positions\":{positions}}}"),
            Work::Snapshot { tokens } | Work::Demote { tokens } | Work::Receive { tokens } => format!("{{\"tokens\":{tokens}}}"),
            Work::Restore { tokens, tier } => format!("{{\"tokens\":{tokens},\"tier\":\"{tier}\"}}"),
            Work::Cache { snapshots } => format!("{{\"snapshots\":{snapshots}}}"),
        }
    }
}

/// The open trace file of a running pipeline.
pub struct Trace {
    origin: Instant,
    /// None once the trace is closing.
    events: Option<Sender<String>>,
    writer: Option<JoinHandle<()>>,
}

impl Trace {
    /// Create `path` (replacing a file there) and start its writer thread, which ends once the
    /// trace is dropped and closes the array.
    pub fn create(path: &Path) -> Result<Trace> {
        let file = File::create(path).with_context(|| format!("--trace: creating {}", path.display()))?;
        let (tx, rx) = channel::<String>();
        let shown = path.display().to_string();
        let writer = std::thread::Builder::new()
            .name("trace writer".into())
            .spawn(move || {
                let mut out = BufWriter::new(file);
                let write = |out: &mut BufWriter<File>, s: &str| match out.write_all(s.as_bytes()) {
                    Ok(()) => true,
                    Err(e) => {
                        eprintln!("--trace: writing {shown}: {e}; the trace stops here");
                        false
                    }
                };
                let mut sep = "[\n";
                // Each event as it comes, and whatever else waits; flushed once caught up.
                while let Ok(event) = rx.recv() {
                    for event in std::iter::once(event).chain(rx.try_iter()) {
                        if !write(&mut out, sep) || !write(&mut out, &event) {
                            return;
                        }
                        sep = ",\n";
                    }
                    let _ = out.flush();
                }
                if sep == "[\n" && !write(&mut out, sep) {
                    return;
                }
                let _ = write(&mut out, "\n]\n");
                let _ = out.flush();
            })
            .context("starting the trace writer")?;
        Ok(Trace { origin: Instant::now(), events: Some(tx), writer: Some(writer) })
    }

    /// Record `work` from `started` to now, on the track of the calling thread (named after
    /// its engine); work of nothing (no prompts, no sequences) is not recorded.
    pub fn span(&self, started: Instant, work: Work) {
        if work.is_empty() {
            return;
        }
        let thread = std::thread::current();
        let thread = thread.name().unwrap_or("engine");
        let ts = started.saturating_duration_since(self.origin).as_secs_f64() * 1e6;
        let dur = started.elapsed().as_secs_f64() * 1e6;
        let event = format!(
            "{{\"name\":\"{}\",\"ph\":\"X\",\"pid\":1,\"tid\":\"{thread}\",\"ts\":{ts:.1},\"dur\":{dur:.1},\"args\":{}}}",
            work.name(),
            work.args()
        );
        // A writer that stopped (a full disk) has said so; the engines go on without it.
        if let Some(tx) = &self.events {
            let _ = tx.send(event);
        }
    }
}

impl Drop for Trace {
    /// Close the array and wait for the file to be complete.
    fn drop(&mut self) {
        self.events.take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}
