//! `tandem chat`: an interactive conversation on a session. In a terminal the keys are read as
//! they are typed, and the message is prefilled while it is being written (whenever the
//! prefill engine is free); after each reply the next turn's scaffolding is prefilled at once.
//! Each reply ends with its TTFT and how many of the turn's tokens were ready before Enter.
//! From a pipe, each line is one message (no typing ahead; the early prefill still runs).

use std::io::{BufRead, Read, Write};
use std::process::ExitCode;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::Duration;

use anyhow::{Context, Result};
use tandem_core::pipeline::{self, Pipeline, RequestParams};
use tandem_core::session::{Scaffold, Session};
use tandem_core::state::State;
use tandem_core::tokenizer::StreamDecoder;

use crate::args::Args;
use crate::args::{pipeline_config, sampling, SAMPLING_OPTIONS, ENGINE_OPTIONS};

pub fn run(argv: &[String]) -> Result<ExitCode> {
    let mut with_value = vec!["model", "system", "max-tokens"];
    with_value.extend(SAMPLING_OPTIONS);
    with_value.extend(ENGINE_OPTIONS);
    let args = Args::parse(argv, &with_value, &["enable-thinking", "quiet"])?;
    let config = pipeline_config(&args)?;
    let generation_params = sampling(&args)?;
    let spec = args.required("model")?;
    let model = crate::load_model(spec, &args)?;
    let tok = model.tokenizer.as_ref().with_context(|| format!("{spec} has no {}; chat needs one", model.tokenizer_source()))?;
    let scaffold = Scaffold::from_template(&model.chat_template, args.str("system"), args.flag("enable-thinking"))?;
    let generation = RequestParams {
        max_tokens: args.get("max-tokens", 512)?,
        sampling: generation_params,
        vocab: model.sampleable_vocab(),
        stop_ids: model.stop_ids.clone(),
    };
    let quiet = args.flag("quiet");
    pipeline::run(&model.net, &config, |pipeline| {
        let mut session = Session::new(scaffold, |s: &str| tok.encode(s), &model.net.config);
        let mut prefill = |st: State, ids: &[u32]| pipeline.prefill(st, ids).map(|(s, _)| s);
        let terminal = RawTerminal::enter();
        if !quiet {
            eprintln!(
                "[{}] {} | {} -> {} | Enter sends, Ctrl-D or /exit quits",
                model.name,
                config.mode.name(),
                config.prefill,
                config.decode
            );
        }
        let mut input = match &terminal {
            Some(_) => Input::Keys(spawn_key_reader()),
            None => Input::Lines(std::io::stdin().lock()),
        };
        loop {
            // Early prefill: the closing of the last reply and the next turn's opening.
            session.type_ahead("", &mut prefill)?;
            let Some(message) = read_message(&mut input, &mut session, &mut prefill)? else { break };
            if message.trim() == "/exit" {
                break;
            }
            if message.trim().is_empty() {
                continue;
            }
            turn(pipeline, &mut session, &message, &generation, tok, quiet)?;
        }
        drop(terminal);
        Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Send one message and stream the reply.
fn turn(pipeline: &Pipeline, session: &mut Session, message: &str, generation: &RequestParams, tok: &tandem_core::tokenizer::Tokenizer, quiet: bool) -> Result<()> {
    let sent = session.send(message)?;
    let (reused, at_send) = (sent.reused, sent.tokens.len());
    let mut out = std::io::stdout().lock();
    let mut decoder = StreamDecoder::new();
    let result = pipeline.generate(Some(sent.start), sent.tokens, generation, |id| {
        write!(out, "{}", decoder.push(tok, id)?)?;
        out.flush()?;
        Ok(())
    });
    let g = match result {
        Ok(g) => g,
        Err(e) => {
            session.abandon();
            return Err(e);
        }
    };
    writeln!(out, "{}", decoder.finish(tok)?)?;
    out.flush()?;
    let Some(state) = g.state else {
        session.abandon();
        anyhow::bail!("the turn ended without a state ({:?})", g.finish);
    };
    session.finish(state, &g.tokens, g.finish)?;
    if !quiet {
        // Dimmed on a terminal.
        // SAFETY: isatty has no preconditions.
        let (dim, plain) = if unsafe { libc::isatty(2) } == 1 { ("\x1b[2m", "\x1b[0m") } else { ("", "") };
        eprintln!(
            "{dim}[TTFT {:.1} ms | {} of the turn's {} tokens prefilled before send | {} tokens at {:.1} tok/s]{plain}",
            g.timings.ttft.as_secs_f64() * 1e3,
            reused,
            reused + at_send,
            g.timings.generated,
            g.timings.decode_tok_s()
        );
    }
    Ok(())
}

enum Input<'a> {
    Keys(Receiver<u8>),
    Lines(std::io::StdinLock<'a>),
}

/// Read one message. From the keyboard, the text typed so far goes to the session whenever no
/// key is waiting, so prefill keeps up with typing without delaying the echo of a burst.
fn read_message(input: &mut Input, session: &mut Session, prefill: &mut tandem_core::session::Prefill) -> Result<Option<String>> {
    let keys = match input {
        Input::Lines(lines) => {
            let mut line = String::new();
            return Ok(match lines.read_line(&mut line)? {
                0 => None,
                _ => Some(line.trim_end_matches(['\n', '\r']).to_string()),
            });
        }
        Input::Keys(keys) => keys,
    };
    let mut out = std::io::stdout();
    write!(out, "> ")?;
    out.flush()?;
    let mut bytes: Vec<u8> = Vec::new();
    let mut fed = String::new();
    loop {
        let key = match keys.recv_timeout(Duration::from_millis(30)) {
            Ok(k) => k,
            Err(RecvTimeoutError::Timeout) => {
                // A pause in typing: prefill what is there (once its characters are whole).
                if let Ok(text) = std::str::from_utf8(&bytes) {
                    if text != fed {
                        session.type_ahead(text, prefill)?;
                        fed = text.to_string();
                    }
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return Ok(None),
        };
        match key {
            b'\r' | b'\n' => {
                writeln!(out)?;
                out.flush()?;
                return Ok(Some(String::from_utf8_lossy(&bytes).into_owned()));
            }
            // Ctrl-C, or Ctrl-D on an empty line: quit.
            3 => return Ok(None),
            4 if bytes.is_empty() => return Ok(None),
            // Backspace: drop one character (all of its UTF-8 bytes).
            8 | 127 => {
                while let Some(b) = bytes.pop() {
                    if b & 0xC0 != 0x80 {
                        break;
                    }
                }
                write!(out, "\x08 \x08")?;
            }
            // Escape sequences (arrow keys) and other control keys are ignored.
            0x1b => {
                while let Ok(k) = keys.recv_timeout(Duration::from_millis(5)) {
                    if k.is_ascii_alphabetic() || k == b'~' {
                        break;
                    }
                }
            }
            k if k < 0x20 => {}
            k => {
                bytes.push(k);
                out.write_all(&[k])?;
            }
        }
        out.flush()?;
    }
}

fn spawn_key_reader() -> Receiver<u8> {
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin();
        let mut buf = [0u8; 64];
        while let Ok(n) = stdin.read(&mut buf) {
            if n == 0 || buf[..n].iter().any(|&b| tx.send(b).is_err()) {
                break;
            }
        }
    });
    rx
}

/// The terminal in non-canonical, no-echo mode (keys arrive as typed; Ctrl-C arrives as a key
/// so that the terminal is always restored; output processing stays on, so "\n" still starts
/// a new line), restored on drop. None when stdin is no terminal.
struct RawTerminal {
    saved: libc::termios,
}

impl RawTerminal {
    fn enter() -> Option<RawTerminal> {
        // SAFETY: isatty/tcgetattr/tcsetattr on fd 0 with a termios this function owns.
        unsafe {
            if libc::isatty(0) != 1 {
                return None;
            }
            let mut t: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(0, &mut t) != 0 {
                return None;
            }
            let saved = t;
            t.c_lflag &= !(libc::ICANON | libc::ECHO | libc::ISIG);
            t.c_cc[libc::VMIN] = 1;
            t.c_cc[libc::VTIME] = 0;
            if libc::tcsetattr(0, libc::TCSANOW, &t) != 0 {
                return None;
            }
            Some(RawTerminal { saved })
        }
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        // SAFETY: restores the attributes read in `enter`.
        unsafe {
            libc::tcsetattr(0, libc::TCSANOW, &self.saved);
        }
    }
}
