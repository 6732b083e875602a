//! The transfer section's NIXL rows: states written by this process through NIXL (UCX over
//! TCP) into slots that a separate `tandem state-receive --nixl` process reserved, as a prefill
//! worker writes into a decode worker's; on a GPU, a GPU engine's states written GPU memory to
//! GPU memory into pieces such a process reserved on the same GPU (`--gpu N`). The two talk over
//! the child's stdin and stdout, a line each way: `reserve N` is answered with a ticket (JSON),
//! `take SLOT N` with the receiver's times once the state is checked (and, in host memory,
//! rebuilt).

use std::time::Duration;

#[cfg(not(feature = "nixl"))]
use {anyhow::Result, tandem_core::bridge::Fingerprint, tandem_core::state::State};

/// Times of one state through NIXL.
#[derive(Clone, Copy, Debug)]
pub struct NixlTimes {
    /// The image written into the sender's registered memory (with its checksum).
    pub serialize: Duration,
    /// The one-sided write, until NIXL reported it complete.
    pub wire: Duration,
    /// The receiver's wait for the notification and its header check.
    pub notify: Duration,
    /// The receiver's checksum of the payloads and their copy into a state.
    pub rebuild: Duration,
}

impl NixlTimes {
    /// As the transfer table's three parts: serialize, read (the write, the notification and
    /// the header check), rebuild.
    pub fn parts(&self) -> (Duration, Duration, Duration) {
        (self.serialize, self.wire + self.notify, self.rebuild)
    }

    pub fn total(&self) -> Duration {
        self.serialize + self.wire + self.notify + self.rebuild
    }
}

#[cfg(feature = "nixl")]
pub use with_nixl::{gpu_rows, state_receive, NixlPeer};

#[cfg(not(feature = "nixl"))]
pub struct NixlPeer;

#[cfg(not(feature = "nixl"))]
impl NixlPeer {
    pub fn start(_spec: &str, _fingerprint: Fingerprint) -> Result<NixlPeer> {
        Err(tandem_core::bridge::nixl_not_built())
    }

    pub fn send(&mut self, _state: &State, _fingerprint: Fingerprint) -> Result<NixlTimes> {
        Err(tandem_core::bridge::nixl_not_built())
    }
}

#[cfg(not(feature = "nixl"))]
pub fn state_receive(_cfg: &tandem_core::model::config::Qwen35Config, _fingerprint: Fingerprint, _gpu: Option<usize>) -> Result<std::process::ExitCode> {
    Err(tandem_core::bridge::nixl_not_built())
}

#[cfg(not(feature = "nixl"))]
pub fn gpu_rows(_spec: &str, _net: &tandem_core::model::Qwen35, _from: usize, _to: usize, _lengths: &[usize], _reps: usize) -> Result<Vec<GpuRow>> {
    Err(tandem_core::bridge::nixl_not_built())
}

/// One length's GPU rows: the state's bytes on the GPU, and per kind of transfer its times.
pub struct GpuRow {
    pub tokens: usize,
    pub bytes: usize,
    /// (what, times), the first row the floor.
    pub times: Vec<(&'static str, Vec<Duration>)>,
}

#[cfg(feature = "nixl")]
mod with_nixl {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
    use std::time::{Duration, Instant};

    use anyhow::{bail, Context, Result};
    use tandem_core::backend::cuda::qwen35::state_slots::StateDtype;
    use tandem_core::backend::cuda::qwen35::transfer::TransferPools;
    use tandem_core::backend::cuda::qwen35::{GpuQwen35, Precision};
    use tandem_core::backend::cuda::Gpu;
    use tandem_core::bridge::nixl::{Receiver, Sender, StateTicket, tcp};
    use tandem_core::bridge::Fingerprint;
    use tandem_core::model::Logits;
    use tandem_core::state::State;

    use super::{GpuRow, NixlTimes};
    use crate::ms;

    /// How long a write or a receiver's wait may take before the bench gives up.
    const TIMEOUT: Duration = Duration::from_secs(30);

    /// The sending side and its receiving process.
    pub struct NixlPeer {
        sender: Sender,
        child: Child,
        to_child: ChildStdin,
        from_child: BufReader<ChildStdout>,
    }

    impl NixlPeer {
        /// Start `tandem state-receive --nixl` for the model `spec`; both agents use UCX over
        /// TCP only.
        pub fn start(spec: &str, fingerprint: Fingerprint) -> Result<NixlPeer> {
            let sender = Sender::new(&format!("tandem-bench-{}", std::process::id()), Some(tcp()))?;
            Self::with(sender, spec, fingerprint, None)
        }

        /// The receiving process for `sender`, its slots in GPU `gpu`'s memory where given (UCX
        /// then picks its own transports: CUDA IPC on one GPU), else in host memory over TCP.
        fn with(sender: Sender, spec: &str, fingerprint: Fingerprint, gpu: Option<usize>) -> Result<NixlPeer> {
            let mut cmd = Command::new(std::env::current_exe()?);
            cmd.args(["state-receive", "--nixl", "--model", spec, "--fingerprint", &format!("{fingerprint:032x}")]);
            match gpu {
                Some(g) => cmd.args(["--gpu", &g.to_string()]),
                None => cmd.env("UCX_TLS", std::env::var("UCX_TLS").unwrap_or_else(|_| tcp().into())),
            };
            let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().context("starting the receiving process (tandem state-receive --nixl)")?;
            let to_child = child.stdin.take().expect("piped");
            let from_child = BufReader::new(child.stdout.take().expect("piped"));
            Ok(NixlPeer { sender, child, to_child, from_child })
        }

        fn ask(&mut self, line: &str) -> Result<String> {
            writeln!(self.to_child, "{line}")?;
            self.to_child.flush()?;
            let mut answer = String::new();
            if self.from_child.read_line(&mut answer)? == 0 {
                bail!("the receiving process (tandem state-receive --nixl) ended; its errors are above");
            }
            Ok(answer)
        }

        /// One state through NIXL into a slot the receiving process reserves for it.
        pub fn send(&mut self, state: &State, fingerprint: Fingerprint) -> Result<NixlTimes> {
            let n = state.position;
            let ticket: StateTicket = serde_json::from_str(&self.ask(&format!("reserve {n}"))?).context("the receiving process's ticket")?;
            let times = self.sender.send(&ticket, state, fingerprint, TIMEOUT)?;
            let answer = self.ask(&format!("take {} {n}", ticket.slot))?;
            let f: Vec<f64> = answer.split_whitespace().filter_map(|x| x.parse().ok()).collect();
            if f.len() != 3 {
                bail!("the receiving process answered {answer:?}");
            }
            Ok(NixlTimes { serialize: times.serialize, wire: times.read, notify: Duration::from_secs_f64(f[0] / 1e3), rebuild: Duration::from_secs_f64(f[1] / 1e3) })
        }
    }

    /// The GPU rows at each of `lengths`: a state prefilled by a GPU engine on `from`, its
    /// pieces copied in this process to GPU `to` (the floor: a copy within one GPU, or a peer
    /// copy), and written by NIXL GPU memory to GPU memory into pieces a `tandem state-receive
    /// --nixl --gpu TO` process reserved (the time until that process has checked the header),
    /// with the write alone.
    pub fn gpu_rows(spec: &str, net: &tandem_core::model::Qwen35, from: usize, to: usize, lengths: &[usize], reps: usize) -> Result<Vec<GpuRow>> {
        let fp = net.fingerprint();
        let mut gpu = GpuQwen35::upload(Gpu::open(from)?, net, Precision::TensorCores)?;
        gpu.keep_snapshots_on_device()?;
        // The engine whose copy of the state is the floor: this one, or one on the other GPU.
        let there = if to == from { None } else { Some(GpuQwen35::upload(Gpu::open(to)?, net, Precision::TensorCores)?) };
        let sender = Sender::new(&format!("tandem-bench-gpu-{}", std::process::id()), None)?.on_gpu(TransferPools::new(&gpu.pools(), net.config.vocab_size)?);
        let mut peer = NixlPeer::with(sender, spec, fp, Some(to))?;
        let mut rows = Vec::new();
        let floor: &'static str = if to == from { "copy of its pieces on the GPU (one process)" } else { "peer copy of its pieces to the other GPU (one process)" };
        for &n in lengths {
            let prompt: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 17) % net.config.vocab_size.min(1 << 16) as u32).collect();
            let mut state = gpu.new_state()?;
            gpu.forward(&prompt, &mut state, Logits::Last)?;
            let snap = gpu.snapshot_state(&state)?.context("this engine keeps snapshots on the GPU")?;
            let mut times: Vec<(&'static str, Vec<Duration>)> = vec![(floor, vec![]), ("NIXL, GPU memory to GPU memory (another process)", vec![]), ("of which NIXL's write alone (until complete)", vec![])];
            for _ in 0..reps {
                let t = Instant::now();
                let copy = there.as_ref().unwrap_or(&gpu).copy_state(&state)?;
                times[0].1.push(t.elapsed());
                drop(copy);
                let t = Instant::now();
                let ticket: StateTicket = serde_json::from_str(&peer.ask(&format!("reserve {n}"))?).context("the receiving process's ticket")?;
                let sent = peer.sender.send_gpu(&ticket, &snap, fp, TIMEOUT)?;
                peer.ask(&format!("take {} {n}", ticket.slot))?;
                times[1].1.push(t.elapsed());
                times[2].1.push(sent.read);
            }
            rows.push(GpuRow { tokens: n, bytes: state.bytes(), times });
        }
        Ok(rows)
    }

    impl Drop for NixlPeer {
        fn drop(&mut self) {
            let _ = writeln!(self.to_child, "quit");
            let _ = self.to_child.flush();
            let _ = self.child.wait();
        }
    }

    /// `tandem state-receive --nixl`: reserve slots and take the states written into them, on
    /// the commands of stdin (see the module's comment); answers `wait+read_ms rebuild_ms
    /// position` for each state taken.
    pub fn state_receive(cfg: &tandem_core::model::config::Qwen35Config, fingerprint: Fingerprint, gpu: Option<usize>) -> Result<std::process::ExitCode> {
        let name = format!("tandem-state-receive-{}", std::process::id());
        let mut receiver = match gpu {
            // The sender's engine keeps f32 recurrent states (the default state dtype).
            Some(g) => Receiver::new(&name, None)?.on_gpu(TransferPools::standalone(g, cfg, StateDtype::F32)?),
            None => Receiver::new(&name, Some(tcp()))?,
        };
        let stdin = std::io::stdin().lock();
        let mut stdout = std::io::stdout().lock();
        let mut spare = None;
        for line in stdin.lines() {
            let line = line?;
            let words: Vec<&str> = line.split_whitespace().collect();
            let num = |i: usize| -> Result<usize> { words.get(i).and_then(|w| w.parse().ok()).with_context(|| format!("state-receive: bad command {line:?}")) };
            match words.first() {
                Some(&"reserve") => {
                    let ticket = receiver.reserve_for_prompt(cfg, num(1)?)?;
                    writeln!(stdout, "{}", serde_json::to_string(&ticket)?)?;
                }
                Some(&"take") => {
                    let (slot, n) = (num(1)? as u64, num(2)?);
                    let t = Instant::now();
                    receiver.wait(slot, TIMEOUT)?;
                    let waited = t.elapsed();
                    if receiver.is_on_gpu() {
                        let t = Instant::now();
                        let snapshot = receiver.take_gpu(slot, fingerprint, n)?;
                        writeln!(stdout, "{:.4} 0 {}", ms(waited + t.elapsed()), snapshot.position)?;
                        stdout.flush()?;
                        continue;
                    }
                    let (state, read, rebuild) = receiver.take(slot, fingerprint, cfg, n, spare.take())?;
                    writeln!(stdout, "{:.4} {:.4} {}", ms(waited + read), ms(rebuild), state.position)?;
                    spare = Some(state);
                }
                Some(&"quit") | None => break,
                Some(other) => bail!("state-receive: unknown command {other:?}"),
            }
            stdout.flush()?;
        }
        Ok(std::process::ExitCode::SUCCESS)
    }
}
