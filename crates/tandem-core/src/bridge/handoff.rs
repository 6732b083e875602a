//! The hand-over from a prefill engine to a decode engine, one pair whatever the transfer:
//! `Sender::send` on the prefill engine's thread, `Receiver::receive` on the decode engine's.
//! Each prefilled state travels with an item of the caller's (the pipeline's request) and
//! arrives on the decode engine's device, with the three parts of its transfer timed
//! (`TransferTimes`: the sender's serialize, the receiver's read and rebuild).
//!
//! The handoff position is exact: a state covers the prompt `[0, N)` and carries the logits of
//! token N-1; nothing here applies or drops a token.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::mpsc::{self, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::file::{self, StateFile};
use super::{device, socket, Fingerprint, Transfer, TransferTimes};
use crate::backend::cuda::qwen35::device_pool::PoolFull;
use crate::backend::cuda::qwen35::GpuQwen35;
use crate::model::config::Qwen35Config;
use crate::state::{DeviceState, State};

/// What crosses the channel beside the caller's item.
enum Parcel {
    /// The state itself, wherever the prefill engine keeps it.
    State(DeviceState),
    /// A state file the sender wrote, read in place by the receiver.
    File(Arc<StateFile>),
    /// Arriving on the socket right now.
    OnSocket,
}

/// The prefill engine's end.
pub struct Sender<T> {
    transfer: Transfer,
    fingerprint: Fingerprint,
    cfg: Qwen35Config,
    channel: mpsc::Sender<(T, Parcel, Duration)>,
    /// The file transfer's state files: one is free to write when no state holds it.
    files: Vec<Arc<StateFile>>,
    /// The socket transfer's stream, and where the time of each send is reported.
    socket: Option<(UnixStream, mpsc::Sender<Duration>)>,
}

/// The decode engine's end.
pub struct Receiver<T> {
    fingerprint: Fingerprint,
    cfg: Qwen35Config,
    channel: mpsc::Receiver<(T, Parcel, Duration)>,
    socket: Option<(UnixStream, mpsc::Receiver<Duration>)>,
    /// States of finished requests, whose buffers the next received states are rebuilt into.
    spare: Vec<State>,
}

/// Why `Sender::send` sent nothing.
pub enum SendError<T> {
    /// This state could not be sent (the item comes back, to be answered); the bridge still
    /// works.
    Failed(T, anyhow::Error),
    /// The receiver is gone, or the socket broke mid-state: nothing more can be sent (an item
    /// already announced is answered by the receiver, whose read fails).
    Closed,
}

/// A connected pair for `transfer` between engines of the model with `fingerprint` and `cfg`.
pub fn channel<T>(transfer: &Transfer, fingerprint: Fingerprint, cfg: &Qwen35Config) -> Result<(Sender<T>, Receiver<T>)> {
    let (tx, rx) = mpsc::channel();
    let (send_end, receive_end) = match transfer {
        Transfer::Socket => {
            let (a, b) = UnixStream::pair().context("creating the bridge socket pair")?;
            let (sent_tx, sent_rx) = mpsc::channel();
            (Some((a, sent_tx)), Some((b, sent_rx)))
        }
        _ => (None, None),
    };
    let sender = Sender { transfer: transfer.clone(), fingerprint, cfg: cfg.clone(), channel: tx, files: Vec::new(), socket: send_end };
    let receiver = Receiver { fingerprint, cfg: cfg.clone(), channel: rx, socket: receive_end, spare: Vec::new() };
    Ok((sender, receiver))
}

impl<T> Sender<T> {
    /// With the file transfer, a fresh state for a prompt of `prompt` tokens whose recurrent
    /// states already live in a free state file (`file::state_in_file`), for a CPU prefill
    /// engine to work in: handing it over then copies only K/V and the logits. None for the
    /// other transfers.
    pub fn fresh_state(&mut self, prompt: usize) -> Result<Option<State>> {
        let Transfer::File(dir) = &self.transfer else { return Ok(None) };
        let i = free_state_file(&mut self.files, dir)?;
        Ok(Some(file::state_in_file(&mut self.files[i], &self.cfg, prompt, self.fingerprint)?))
    }

    /// Hand `state` over with `item`.
    pub fn send(&mut self, item: T, state: DeviceState) -> Result<(), SendError<T>> {
        let parcel = match &self.transfer {
            Transfer::Move => Parcel::State(match state {
                DeviceState::Gpu(mut s) => {
                    // Unmarked, a copy waits for everything queued on its engine's stream.
                    let _ = s.mark_handed_off();
                    DeviceState::Gpu(s)
                }
                host => host,
            }),
            Transfer::File(dir) => {
                let t = Instant::now();
                match write_state_file(&mut self.files, dir, state, self.fingerprint) {
                    Ok(file) => return self.channel.send((item, Parcel::File(file), t.elapsed())).map_err(|_| SendError::Closed),
                    Err(e) => return Err(SendError::Failed(item, e)),
                }
            }
            Transfer::Socket => {
                // Announce first: the receiver must be reading while this side writes.
                if self.channel.send((item, Parcel::OnSocket, Duration::ZERO)).is_err() {
                    return Err(SendError::Closed);
                }
                let (stream, sent) = self.socket.as_mut().expect("a socket transfer has a socket");
                let t = Instant::now();
                if state.into_host().and_then(|state| socket::send(stream, &state, self.fingerprint)).is_err() {
                    return Err(SendError::Closed);
                }
                let _ = sent.send(t.elapsed());
                return Ok(());
            }
        };
        self.channel.send((item, parcel, Duration::ZERO)).map_err(|_| SendError::Closed)
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        // States still holding a file keep its pages until they are dropped.
        for f in &self.files {
            let _ = std::fs::remove_file(f.path());
        }
    }
}

impl<T> Receiver<T> {
    /// The next handed-over state, on the device of an engine that computes on `gpu` (None:
    /// the host; a state for which that GPU's K/V cache has no room now stays where it was),
    /// with its item; with `wait`, blocks until one comes. An error in the result
    /// is this state's (the item is to be answered); `Err` means none is waiting
    /// (`TryRecvError::Empty`) or none will come (`Disconnected`).
    #[allow(clippy::type_complexity)]
    pub fn receive(&mut self, wait: bool, gpu: Option<&GpuQwen35>) -> Result<(T, Result<(DeviceState, TransferTimes)>), TryRecvError> {
        let (item, parcel, serialize) = if wait { self.channel.recv().map_err(|_| TryRecvError::Disconnected)? } else { self.channel.try_recv()? };
        let mut times = TransferTimes { serialize, ..Default::default() };
        let received = match parcel {
            Parcel::State(state) => Ok((state, false)),
            Parcel::File(file) => file::read_file(&file, self.fingerprint, &self.cfg, self.spare.pop(), true).map(|(state, read, rebuild)| {
                times.read = read;
                times.rebuild = rebuild;
                (DeviceState::Host(state), true)
            }),
            Parcel::OnSocket => {
                let (stream, sent) = self.socket.as_mut().expect("a socket transfer has a socket");
                socket::receive(stream, self.fingerprint, &self.cfg, self.spare.pop()).map(|(state, read, rebuild)| {
                    times.serialize = sent.recv().unwrap_or_default();
                    times.read = read;
                    times.rebuild = rebuild;
                    (DeviceState::Host(state), true)
                })
            }
        };
        // Onto the engine's device: between devices the copy is the whole transfer (it counts
        // as the read); a state read from a file or the socket is rebuilt on a GPU engine's
        // GPU (part of the rebuild). Where that GPU's K/V cache has no room now, the state
        // stays where it is, whole: the decode engine brings it in once blocks are free.
        let received = received.and_then(|(mut state, rebuilt)| {
            let t = Instant::now();
            match device::move_in_place(gpu, &mut state) {
                Ok(()) => {}
                Err(e) if PoolFull::is(&e) => {}
                Err(e) => return Err(e),
            }
            if rebuilt { times.rebuild += t.elapsed() } else { times.read = t.elapsed() }
            // A state on the engine's GPU has arrived; one left on another GPU for want of room
            // stays marked (nothing writes it there) until it is copied in.
            if let (DeviceState::Gpu(s), Some(g)) = (&mut state, gpu) {
                if s.ordinal() == g.gpu.ordinal {
                    s.arrived();
                }
            }
            Ok(state)
        });
        Ok((item, received.map(|state| (state, times))))
    }

    /// Keep the buffers of a finished request's state (up to two, in host memory and no file)
    /// for the next states received.
    pub fn recycle(&mut self, state: DeviceState) {
        match state {
            DeviceState::Host(state) if self.spare.len() < 2 && !state.in_file() => self.spare.push(state),
            _ => {}
        }
    }
}

/// Write `state` into a free file of `files` (one that no state holds), or into a new one in
/// `dir`; the file goes to the decode engine, whose state keeps it until the request ends. A
/// state prefilled in a file of its own (`Sender::fresh_state`) is completed in place; a GPU
/// engine's state is copied to the host first (part of the write).
fn write_state_file(files: &mut Vec<Arc<StateFile>>, dir: &Path, state: DeviceState, fingerprint: Fingerprint) -> Result<Arc<StateFile>> {
    let state = match state {
        DeviceState::Host(state) => state,
        gpu => gpu.into_host()?,
    };
    if let Some(held) = state.file() {
        let file = Arc::clone(held);
        // SAFETY: the file was free when `fresh_state` took it; since then only `state` has
        // used it, and it is dropped before the handoff.
        let written = unsafe { file.write_shared(&state, fingerprint) };
        drop(state);
        return written.map(|()| file);
    }
    let i = free_state_file(files, dir)?;
    Arc::get_mut(&mut files[i]).expect("a free file").write(&state, fingerprint)?;
    Ok(Arc::clone(&files[i]))
}

/// The index of a file of `files` that no state holds, made in `dir` if there is none.
fn free_state_file(files: &mut Vec<Arc<StateFile>>, dir: &Path) -> Result<usize> {
    if let Some(i) = files.iter_mut().position(|f| Arc::get_mut(f).is_some()) {
        return Ok(i);
    }
    let path = dir.join(format!("tandem-{}-{}.state", std::process::id(), files.len()));
    files.push(Arc::new(StateFile::create(&path)?));
    Ok(files.len() - 1)
}
