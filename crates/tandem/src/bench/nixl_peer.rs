//! The transfer section's NIXL row: states written by this process through NIXL (UCX over
//! TCP) into slots that a separate `tandem state-receive --nixl` process reserved, as a prefill
//! worker writes into a decode worker's. The two talk over the child's stdin and stdout, a line
//! each way: `reserve N` is answered with a ticket (JSON), `take SLOT N` with the receiver's
//! times once the state is checked and rebuilt.

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
pub use with_nixl::{state_receive, NixlPeer};

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
pub fn state_receive(_cfg: &tandem_core::model::config::Qwen35Config, _fingerprint: Fingerprint) -> Result<std::process::ExitCode> {
    Err(tandem_core::bridge::nixl_not_built())
}

#[cfg(feature = "nixl")]
mod with_nixl {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
    use std::time::{Duration, Instant};

    use anyhow::{bail, Context, Result};
    use tandem_core::bridge::nixl::{Receiver, Sender, StateTicket, tcp};
    use tandem_core::bridge::Fingerprint;
    use tandem_core::state::State;

    use super::NixlTimes;
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
            let mut child = Command::new(std::env::current_exe()?)
                .args(["state-receive", "--nixl", "--model", spec, "--fingerprint", &format!("{fingerprint:032x}")])
                .env("UCX_TLS", std::env::var("UCX_TLS").unwrap_or_else(|_| tcp().into()))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .context("starting the receiving process (tandem state-receive --nixl)")?;
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
    pub fn state_receive(cfg: &tandem_core::model::config::Qwen35Config, fingerprint: Fingerprint) -> Result<std::process::ExitCode> {
        let mut receiver = Receiver::new(&format!("tandem-state-receive-{}", std::process::id()), Some(tcp()))?;
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
