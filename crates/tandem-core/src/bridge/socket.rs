//! A state over a byte stream (a Unix or TCP socket): the image of `format.rs`, written
//! straight from the state's memory and read straight into its arrays.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::format::{check_fixed, parse_header, write_state, FIXED};
use super::Fingerprint;
use crate::model::config::Qwen35Config;
use crate::state::State;

/// Send a state over a byte stream (a socket): the image, as `write_state` writes it.
pub fn send(stream: &mut impl Write, state: &State, fingerprint: Fingerprint) -> Result<()> {
    let mut w = std::io::BufWriter::with_capacity(16 << 10, stream);
    write_state(&mut w, state, fingerprint)?;
    w.flush()?;
    Ok(())
}

/// Receive one state from a byte stream, returning it with the time spent receiving the header
/// and checking it, and the time spent receiving the payloads, which go straight into the
/// state's arrays (so for a stream "rebuild" includes the wait for the bytes). `reuse` lends
/// the buffers of a state no longer needed.
pub fn receive(stream: &mut impl Read, fingerprint: Fingerprint, cfg: &Qwen35Config, reuse: Option<State>) -> Result<(State, Duration, Duration)> {
    let t = Instant::now();
    let mut bytes = vec![0u8; FIXED];
    stream.read_exact(&mut bytes).context("receiving a state header: the stream ended")?;
    let table_end = check_fixed(&bytes, fingerprint, cfg)?;
    bytes.resize(table_end, 0);
    stream.read_exact(&mut bytes[FIXED..]).context("receiving a state's layer table: the stream ended")?;
    let header = parse_header(&bytes, fingerprint, cfg)?;
    let read = t.elapsed();
    let t = Instant::now();
    let state = header.read_body(stream, reuse)?;
    Ok((state, read, t.elapsed()))
}

