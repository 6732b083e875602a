//! A state between processes and hosts through NIXL, the transfer library of the large serving
//! engines (UCX underneath: TCP, shared memory, RDMA, GPU memory).
//!
//! The receiver (a decode worker) reserves a slot for a request before it is prefilled: memory
//! registered with its NIXL agent, big enough for the image of the prefilled state
//! (`format.rs`), described by a `StateTicket` (its agent's metadata, the slot's address and
//! length) that travels to the sender by whatever channel the two already share (the router).
//! The sender (a prefill worker) writes the image into its own registered staging memory and
//! then, one-sided, straight into the slot, with a notification that names the slot; NIXL
//! delivers the notification after the bytes. The receiver checks the image as every bridge
//! does (magic, version, model fingerprint, position, layer table, header and payload
//! checksums) before a state is built from it. A slot whose state never comes is released at
//! once by whoever gives up on it; its memory stays registered (UCX over TCP does not check a
//! write against the receiver's registrations: memory freed under a late writer is a crash) and
//! is not reused for `QUARANTINE`, longer than any sender waits for its write, so that a late
//! write of a sender thought dead lands where nobody reads.
//!
//! The NIXL libraries are loaded at run time (the `nixl-sys` crate's `stub-api`), from
//! `TANDEM_NIXL_LIB`, the library path, or `target/tools` where `scripts/nixl.sh` puts them;
//! `load_library` says what is missing before any NIXL call is made.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use nixl_sys::{Agent, Backend, MemType, MemoryRegion, NixlDescriptor, NotificationMap, OptArgs, RegistrationHandle, XferDescList, XferOp};
use serde::{Deserialize, Serialize};

use super::format::{image_bytes, write_state};
use super::{Fingerprint, TransferTimes};
use crate::model::config::Qwen35Config;
use crate::state::State;

/// The notification a sender attaches to a state's write: this prefix, then the slot number.
const NOTE_PREFIX: &str = "tandem-state ";
/// Registered memory comes in multiples of this, so that slots of nearby sizes reuse it.
const GRANULE: usize = 1 << 20;
/// UCX restricted to TCP for host memory (`UCX_TLS`). On a machine with an NVIDIA GPU cuda_copy
/// rides along: there NIXL refuses a UCX without a CUDA transport (it moves no host memory).
pub fn tcp() -> &'static str {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        "tcp,cuda_copy"
    } else {
        "tcp"
    }
}

/// How long the memory of a released slot is kept from other requests: longer than a sender
/// waits for a write (`Sender::send`'s timeout, which callers keep below this).
pub const QUARANTINE: Duration = Duration::from_secs(60);

/// Load `libnixl_capi.so` (once per process) so that the NIXL calls find it; an error says
/// where it was looked for and how to install it (see `candidates`; `target/tools` is where
/// `scripts/nixl.sh` installs the wheel's libraries).
pub fn load_library() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    match LOADED.get_or_init(find_and_load) {
        Ok(_) => Ok(()),
        Err(e) => Err(anyhow!("{e}")),
    }
}

/// Where to look for `libnixl_capi.so`: the file `TANDEM_NIXL_LIB` names, alone; else by name
/// on the library path, then in `tools/nixl-cu*` beside the executable's build directory.
fn candidates() -> Vec<PathBuf> {
    if let Some(p) = std::env::var_os("TANDEM_NIXL_LIB") {
        return vec![PathBuf::from(p)];
    }
    let mut candidates = vec![PathBuf::from("libnixl_capi.so")];
    if let Some(tools) = std::env::current_exe().ok().and_then(|exe| exe.ancestors().find(|d| d.join("tools").is_dir()).map(|d| d.join("tools"))) {
        let mut found: Vec<PathBuf> = std::fs::read_dir(&tools)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("nixl-cu")))
            .flat_map(|wheel| std::fs::read_dir(wheel).into_iter().flatten().flatten().map(|e| e.path().join("libnixl_capi.so")))
            .filter(|p| p.is_file())
            .collect();
        found.sort();
        candidates.extend(found);
    }
    candidates
}

fn find_and_load() -> std::result::Result<PathBuf, String> {
    let mut tried = Vec::new();
    for path in candidates() {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| format!("TANDEM_NIXL_LIB {}: not a path", path.display()))?;
        // SAFETY: dlopen with a valid C string; the handle is kept for the life of the process
        // (never closed), so the stubs' own dlopen("libnixl_capi.so") finds this library by its
        // soname, wherever it was loaded from.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if !handle.is_null() {
            return Ok(path);
        }
        // SAFETY: dlerror returns null or a C string valid until the next dl call.
        let why = unsafe { libc::dlerror() };
        let why = if why.is_null() { "unknown error".to_string() } else { unsafe { CStr::from_ptr(why) }.to_string_lossy().into_owned() };
        tried.push(format!("{} ({why})", path.display()));
    }
    Err(format!(
        "the NIXL libraries are not installed: libnixl_capi.so could not be loaded (tried {}). Run `eval \"$(scripts/nixl.sh)\"` in the tandem repository: it installs them from the PyPI wheel nixl-cu12 (or nixl-cu13) into target/tools and sets TANDEM_NIXL_LIB; or point TANDEM_NIXL_LIB at a libnixl_capi.so",
        tried.join("; ")
    ))
}

fn nixl_err(what: &str) -> impl FnOnce(nixl_sys::NixlError) -> anyhow::Error + '_ {
    move |e| anyhow!("NIXL: {what}: {e:?}")
}

/// Host memory to register with NIXL: page-aligned, zeroed, owned here.
#[derive(Debug)]
struct HostMemory {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain memory; who writes it when is the protocol's business (one owner at a time).
unsafe impl Send for HostMemory {}
unsafe impl Sync for HostMemory {}

impl HostMemory {
    fn new(len: usize) -> Result<HostMemory> {
        let layout = std::alloc::Layout::from_size_align(len.max(1), 4096).context("NIXL host memory: size overflows")?;
        // SAFETY: a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            bail!("NIXL host memory: could not allocate {len} bytes");
        }
        Ok(HostMemory { ptr, len })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: ptr holds len initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self is the only access from this process.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in new with this layout.
        unsafe { std::alloc::dealloc(self.ptr, std::alloc::Layout::from_size_align_unchecked(self.len.max(1), 4096)) }
    }
}

impl MemoryRegion for HostMemory {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for HostMemory {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

/// Host memory registered with an agent; deregistered before it is freed.
struct Region {
    // Field order: the registration goes first.
    _registration: RegistrationHandle,
    memory: HostMemory,
}

/// One NIXL agent with its UCX backend.
pub struct Endpoint {
    agent: Agent,
    backend: Backend,
}

impl Endpoint {
    /// An agent named `name` (unique among the agents that will talk to it) with a UCX backend.
    /// `transports` restricts UCX to these transports (`UCX_TLS`, e.g. "tcp"), unless the
    /// environment already sets `UCX_TLS`: UCX reads it from the environment when the backend
    /// is created.
    pub fn new(name: &str, transports: Option<&str>) -> Result<Endpoint> {
        load_library()?;
        if let Some(t) = transports {
            if std::env::var_os("UCX_TLS").is_none() {
                // UCX has no other way to be told; set before the backend exists.
                std::env::set_var("UCX_TLS", t);
            }
        }
        let agent = Agent::new(name).map_err(nixl_err("creating an agent"))?;
        let (_mems, params) = agent.get_plugin_params("UCX").map_err(nixl_err("the UCX plugin is missing from the NIXL installation"))?;
        let backend = agent.create_backend("UCX", &params).map_err(nixl_err("creating the UCX backend (see UCX's message above)"))?;
        Ok(Endpoint { agent, backend })
    }

    pub fn name(&self) -> String {
        self.agent.name()
    }

    fn register(&self, len: usize) -> Result<Region> {
        let memory = HostMemory::new(len.next_multiple_of(GRANULE))?;
        let registration = self.agent.register_memory(&memory, None).map_err(nixl_err("registering host memory"))?;
        Ok(Region { _registration: registration, memory })
    }
}

/// Where a receiver wants a state written: its agent (name and metadata, for the sender to
/// load), the slot's number (named in the notification) and its memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateTicket {
    pub agent: String,
    /// The receiving agent's NIXL metadata, as `get_local_md` gives it.
    #[serde(with = "hex_bytes")]
    pub metadata: Vec<u8>,
    pub slot: u64,
    pub addr: u64,
    pub len: u64,
}

/// The decode side: slots reserved for states that are on their way.
pub struct Receiver {
    endpoint: Endpoint,
    reserved: HashMap<u64, Region>,
    /// Slots whose notification came: the state is in the slot, complete.
    arrived: HashMap<u64, String>,
    /// Registered memory of slots taken, to be reused.
    free: Vec<Region>,
    /// Registered memory of released slots, with when each was released: reused after
    /// `QUARANTINE`.
    quarantined: Vec<(Instant, Region)>,
    next_slot: u64,
}

impl Receiver {
    pub fn new(name: &str, transports: Option<&str>) -> Result<Receiver> {
        Ok(Receiver { endpoint: Endpoint::new(name, transports)?, reserved: HashMap::new(), arrived: HashMap::new(), free: Vec::new(), quarantined: Vec::new(), next_slot: 1 })
    }

    /// Reserve a slot for the state of a request whose prompt has `prompt` tokens.
    pub fn reserve_for_prompt(&mut self, cfg: &Qwen35Config, prompt: usize) -> Result<StateTicket> {
        self.reserve(super::format::prefilled_image_bytes(cfg, prompt))
    }

    /// Reserve a slot of at least `bytes` bytes.
    pub fn reserve(&mut self, bytes: usize) -> Result<StateTicket> {
        let now = Instant::now();
        let (out, kept): (Vec<_>, Vec<_>) = self.quarantined.drain(..).partition(|(at, _)| now.duration_since(*at) >= QUARANTINE);
        self.quarantined = kept;
        self.free.extend(out.into_iter().map(|(_, r)| r));
        let region = match self.free.iter().position(|r| r.memory.len >= bytes) {
            Some(i) => self.free.swap_remove(i),
            None => self.endpoint.register(bytes)?,
        };
        let slot = self.next_slot;
        self.next_slot += 1;
        let ticket = StateTicket {
            agent: self.endpoint.name(),
            metadata: self.endpoint.agent.get_local_md().map_err(nixl_err("reading this agent's metadata"))?,
            slot,
            addr: region.memory.ptr as u64,
            len: region.memory.len as u64,
        };
        self.reserved.insert(slot, region);
        Ok(ticket)
    }

    /// Give up on a slot whose state will not come (or whose request went): its memory goes to
    /// quarantine (see `QUARANTINE`). Returns whether the slot was reserved.
    pub fn release(&mut self, slot: u64) -> bool {
        self.arrived.remove(&slot);
        match self.reserved.remove(&slot) {
            Some(region) => {
                self.quarantined.push((Instant::now(), region));
                true
            }
            None => false,
        }
    }

    /// The number of slots reserved and not yet taken or released.
    pub fn reserved(&self) -> usize {
        self.reserved.len()
    }

    /// Collect the notifications that have come; returns the slots whose state arrived since
    /// the last call. A notification for a slot not reserved (released meanwhile) is dropped.
    pub fn poll(&mut self) -> Result<Vec<u64>> {
        let mut notes = NotificationMap::new().map_err(nixl_err("a notification map"))?;
        self.endpoint.agent.get_notifications(&mut notes, None).map_err(nixl_err("reading notifications"))?;
        let mut came = Vec::new();
        for (agent, messages) in notes.take_notifs().map_err(nixl_err("reading notifications"))? {
            for m in messages {
                let Some(slot) = m.strip_prefix(NOTE_PREFIX).and_then(|s| s.parse::<u64>().ok()) else { continue };
                if self.reserved.contains_key(&slot) {
                    self.arrived.insert(slot, agent.clone());
                    came.push(slot);
                }
            }
        }
        Ok(came)
    }

    /// Whether the state of `slot` has arrived (an error where the slot is not reserved).
    pub fn has_arrived(&mut self, slot: u64) -> Result<bool> {
        if !self.arrived.contains_key(&slot) {
            if !self.reserved.contains_key(&slot) {
                bail!("state slot {slot} is not reserved here (released, or never reserved)");
            }
            self.poll()?;
        }
        Ok(self.arrived.contains_key(&slot))
    }

    /// Wait until the state of `slot` has arrived, at most `timeout`.
    pub fn wait(&mut self, slot: u64, timeout: Duration) -> Result<()> {
        let t = Instant::now();
        loop {
            if self.arrived.contains_key(&slot) {
                return Ok(());
            }
            if !self.reserved.contains_key(&slot) {
                bail!("state slot {slot} is not reserved here (released, or never reserved)");
            }
            self.poll()?;
            if self.arrived.contains_key(&slot) {
                return Ok(());
            }
            if t.elapsed() >= timeout {
                bail!("no state came for slot {slot} within {:.1} s", timeout.as_secs_f64());
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Take the state that arrived in `slot`: its image checked (model fingerprint, layout,
    /// checksums) and its position compared with `position`, the prompt length the slot was
    /// reserved for, before a state is built (into `reuse`'s buffers where given). The slot is
    /// freed whatever the outcome. Returns the state and the times to check the header and to
    /// rebuild.
    pub fn take(&mut self, slot: u64, fingerprint: Fingerprint, cfg: &Qwen35Config, position: usize, reuse: Option<State>) -> Result<(State, Duration, Duration)> {
        let from = self.arrived.remove(&slot).with_context(|| format!("no state has arrived in slot {slot}"))?;
        let region = self.reserved.remove(&slot).with_context(|| format!("state slot {slot} is not reserved here"))?;
        let mut bytes = region.memory.bytes();
        let result = super::socket::receive(&mut bytes, fingerprint, cfg, reuse).with_context(|| format!("the state {from} wrote in slot {slot}, refused"));
        // The notification came after the last byte: the memory is free to reuse.
        self.free.push(region);
        let (state, read, rebuild) = result?;
        if state.position != position {
            bail!("the state {from} wrote in slot {slot} holds {} tokens, the request {position}: refused", state.position);
        }
        Ok((state, read, rebuild))
    }
}

/// The prefill side: writes states into the slots receivers reserved.
pub struct Sender {
    endpoint: Endpoint,
    staging: Option<Region>,
    /// The metadata loaded for each receiving agent, to reload it when it changes (a receiver
    /// registers more memory).
    peers: HashMap<String, Vec<u8>>,
}

impl Sender {
    pub fn new(name: &str, transports: Option<&str>) -> Result<Sender> {
        Ok(Sender { endpoint: Endpoint::new(name, transports)?, staging: None, peers: HashMap::new() })
    }

    /// Write `state` into the slot of `ticket` and notify its receiver; returns once the write
    /// has completed (the receiver may use the slot), or an error after `timeout`. Times:
    /// serialize = the image written into registered memory (with its checksum), read = the
    /// transfer until NIXL reports it complete.
    pub fn send(&mut self, ticket: &StateTicket, state: &State, fingerprint: Fingerprint, timeout: Duration) -> Result<TransferTimes> {
        let size = image_bytes(state);
        if size as u64 > ticket.len {
            bail!("the state ({size} bytes, {} tokens) does not fit the {}-byte slot {} that {} reserved", state.position, ticket.len, ticket.slot, ticket.agent);
        }
        let t = Instant::now();
        if self.staging.as_ref().is_none_or(|r| r.memory.len < size) {
            self.staging = None;
            self.staging = Some(self.endpoint.register(size)?);
        }
        let staging = &mut self.staging.as_mut().expect("registered above").memory;
        let mut out = &mut staging.bytes_mut()[..size];
        write_state(&mut out, state, fingerprint)?;
        let staged = staging.ptr as usize;
        let serialize = t.elapsed();
        let t = Instant::now();
        self.connect(ticket)?;
        let agent = &self.endpoint.agent;
        let mut local = XferDescList::new(MemType::Dram).map_err(nixl_err("a descriptor list"))?;
        local.add_desc(staged, size, 0);
        let mut remote = XferDescList::new(MemType::Dram).map_err(nixl_err("a descriptor list"))?;
        remote.add_desc(ticket.addr as usize, size, 0);
        let mut args = OptArgs::new().map_err(nixl_err("transfer arguments"))?;
        args.add_backend(&self.endpoint.backend).map_err(nixl_err("transfer arguments"))?;
        args.set_has_notification(true).map_err(nixl_err("transfer arguments"))?;
        args.set_notification_message(format!("{NOTE_PREFIX}{}", ticket.slot).as_bytes()).map_err(nixl_err("transfer arguments"))?;
        let request = agent
            .create_xfer_req(XferOp::Write, &local, &remote, &ticket.agent, Some(&args))
            .map_err(|e| anyhow!("NIXL: a write to slot {} of {} ({} bytes at {:#x}): {e:?} (the slot is not registered there: released, or the ticket is stale)", ticket.slot, ticket.agent, size, ticket.addr))?;
        agent.post_xfer_req(&request, None).map_err(|e| anyhow!("NIXL: posting the write to {}: {e:?}", ticket.agent))?;
        loop {
            match agent.get_xfer_status(&request) {
                Ok(s) if s.is_success() => break,
                Ok(_) => {}
                Err(e) => bail!("NIXL: the write to slot {} of {} failed: {e:?}", ticket.slot, ticket.agent),
            }
            if t.elapsed() >= timeout {
                bail!("NIXL: the write to slot {} of {} did not complete within {:.1} s", ticket.slot, ticket.agent, timeout.as_secs_f64());
            }
            std::thread::yield_now();
        }
        Ok(TransferTimes { serialize, read: t.elapsed(), rebuild: Duration::ZERO })
    }

    /// Load the receiver's metadata, unless the same was loaded before.
    fn connect(&mut self, ticket: &StateTicket) -> Result<()> {
        if self.peers.get(&ticket.agent) == Some(&ticket.metadata) {
            return Ok(());
        }
        let name = self.endpoint.agent.load_remote_md(&ticket.metadata).map_err(|e| anyhow!("NIXL: loading the metadata of {}: {e:?}", ticket.agent))?;
        if name != ticket.agent {
            bail!("NIXL: the ticket names agent {} but its metadata is agent {name}'s", ticket.agent);
        }
        self.peers.insert(name, ticket.metadata.clone());
        Ok(())
    }
}

/// Bytes as a hex string in JSON.
mod hex_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&bytes.iter().map(|b| format!("{b:02x}")).collect::<String>())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        if s.len() % 2 != 0 {
            return Err(serde::de::Error::custom("hex bytes: odd length"));
        }
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|_| serde::de::Error::custom("hex bytes: not hex"))).collect()
    }
}
