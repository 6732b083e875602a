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
//! Between GPU engines the state goes GPU memory to GPU memory (`Receiver::on_gpu`,
//! `Sender::on_gpu`): the receiver reserves the pieces the state will occupy in its engine's
//! pools (a slot, K/V blocks, room for the logits and a header: `TransferPools`), all of them
//! registered with NIXL, and the sender writes its snapshot's own pieces into them, each into its
//! counterpart, the logits and a header last in the same request. No image is built on either
//! side: the receiver reads the header back, checks it (magic, version, model fingerprint,
//! position, the slot's layout and dtype, the block size and count, the header's checksum) and
//! hands the pieces on as a snapshot its engine restores. The payload is not checksummed on this
//! path: CUDA IPC and RDMA are copies the hardware checks end to end (ECC, link CRCs), unlike a
//! byte stream through the host's TCP stack, where the host path keeps its checksum.
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

use super::checksum::checksum;
use super::format::{image_bytes, write_state};
use super::{Fingerprint, TransferTimes};
use crate::backend::cuda::qwen35::state_slots::{SlotLayout, StateDtype};
use crate::backend::cuda::qwen35::transfer::{Incoming, Pieces, TransferPools};
use crate::backend::cuda::qwen35::GpuSnapshot;
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

/// A range of GPU memory owned elsewhere (a pool's allocation), as NIXL registers it.
#[derive(Debug)]
struct DeviceRange {
    addr: u64,
    len: usize,
    device: usize,
}

impl MemoryRegion for DeviceRange {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for DeviceRange {
    fn mem_type(&self) -> MemType {
        MemType::Vram
    }
    fn device_id(&self) -> u64 {
        self.device as u64
    }
}

/// One end's GPU transfer memory and its registrations (by allocation address). Field order:
/// the registrations go before the pools that own the memory.
struct GpuSide {
    registered: HashMap<u64, RegistrationHandle>,
    pools: TransferPools,
}

impl GpuSide {
    /// Register the allocations of the pools not registered yet (they grow as states come).
    fn register_new(&mut self, endpoint: &Endpoint) -> Result<()> {
        let device = self.pools.ordinal();
        for (addr, len) in self.pools.regions() {
            if self.registered.contains_key(&addr) {
                continue;
            }
            let handle = endpoint.agent.register_memory(&DeviceRange { addr, len, device }, None).map_err(nixl_err("registering GPU memory (UCX needs a CUDA transport: cuda_copy, cuda_ipc)"))?;
            self.registered.insert(addr, handle);
        }
        Ok(())
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
    /// user's environment sets `UCX_TLS`; None leaves UCX its own choice (CUDA IPC between
    /// processes on one GPU). UCX reads `UCX_TLS` from the environment when the backend is
    /// created, so it is set for that moment only: another endpoint of this process (and a
    /// process it starts) sees the user's setting again.
    pub fn new(name: &str, transports: Option<&str>) -> Result<Endpoint> {
        static USERS: OnceLock<Option<std::ffi::OsString>> = OnceLock::new();
        load_library()?;
        let users = USERS.get_or_init(|| std::env::var_os("UCX_TLS"));
        // UCX has no other way to be told; set before the backend exists.
        let set = |v: Option<&std::ffi::OsStr>| match v {
            Some(v) => std::env::set_var("UCX_TLS", v),
            None => std::env::remove_var("UCX_TLS"),
        };
        set(users.as_deref().or(transports.map(std::ffi::OsStr::new)));
        let made = (|| {
            let agent = Agent::new(name).map_err(nixl_err("creating an agent"))?;
            let (_mems, params) = agent.get_plugin_params("UCX").map_err(nixl_err("the UCX plugin is missing from the NIXL installation"))?;
            let backend = agent.create_backend("UCX", &params).map_err(nixl_err("creating the UCX backend (see UCX's message above)"))?;
            Ok(Endpoint { agent, backend })
        })();
        set(users.as_deref());
        made
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
    pub memory: SlotMemory,
}

/// The memory of a reserved slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum SlotMemory {
    /// Host memory for the state's image (format.rs).
    Host { addr: u64, len: u64 },
    /// GPU memory: the pieces a state of the prompt's length occupies (`Pieces`).
    Gpu { device: u64, slot: u64, slot_bytes: u64, tail: u64, tail_bytes: u64, blocks: Vec<u64>, block_bytes: u64 },
}

impl SlotMemory {
    fn of(p: &Pieces) -> SlotMemory {
        SlotMemory::Gpu { device: p.device as u64, slot: p.slot, slot_bytes: p.slot_bytes as u64, tail: p.tail, tail_bytes: p.tail_bytes as u64, blocks: p.blocks.clone(), block_bytes: p.block_bytes as u64 }
    }
}

impl StateTicket {
    /// The slot's host memory (address, bytes), where it is host memory.
    pub fn host(&self) -> Option<(u64, u64)> {
        match self.memory {
            SlotMemory::Host { addr, len } => Some((addr, len)),
            SlotMemory::Gpu { .. } => None,
        }
    }
}

/// The header a GPU transfer writes past the logits: what the receiver checks before the
/// pieces become a state. Little-endian: magic, version, the recurrent dtype's code, the model
/// fingerprint, position, slot bytes, K/V blocks, block bytes, vocabulary, then a checksum of
/// all of it.
const GPU_MAGIC: [u8; 8] = *b"TNDMGPUS";
const GPU_VERSION: u32 = 1;
const GPU_HEADER: usize = 8 + 4 + 4 + 16 + 5 * 8 + 8;

/// What a GPU transfer's header says, and what the receiver expects of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GpuHeader {
    dtype: u32,
    fingerprint: Fingerprint,
    position: u64,
    slot_bytes: u64,
    blocks: u64,
    block_bytes: u64,
    vocab: u64,
}

fn dtype_code(d: StateDtype) -> u32 {
    match d {
        StateDtype::F32 => 1,
        StateDtype::Bf16 => 2,
    }
}

impl GpuHeader {
    fn of(fingerprint: Fingerprint, position: usize, layout: &SlotLayout, block_bytes: usize, vocab: usize) -> GpuHeader {
        GpuHeader { dtype: dtype_code(layout.dtype), fingerprint, position: position as u64, slot_bytes: layout.bytes() as u64, blocks: position.div_ceil(crate::backend::cuda::qwen35::kv_cache::KV_BLOCK) as u64, block_bytes: block_bytes as u64, vocab: vocab as u64 }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut h = Vec::with_capacity(GPU_HEADER);
        h.extend_from_slice(&GPU_MAGIC);
        h.extend_from_slice(&GPU_VERSION.to_le_bytes());
        h.extend_from_slice(&self.dtype.to_le_bytes());
        h.extend_from_slice(&self.fingerprint.to_le_bytes());
        for v in [self.position, self.slot_bytes, self.blocks, self.block_bytes, self.vocab] {
            h.extend_from_slice(&v.to_le_bytes());
        }
        let sum = checksum(&h);
        h.extend_from_slice(&sum.to_le_bytes());
        h
    }

    /// Check `bytes` (as the receiver read them) against `expected`: every difference is an
    /// error naming it.
    fn check(bytes: &[u8], expected: &GpuHeader) -> Result<()> {
        if bytes.len() < GPU_HEADER || bytes[..8] != GPU_MAGIC {
            bail!("not a tandem GPU state (no header: the write did not reach the slot)");
        }
        let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
        if u32_at(8) != GPU_VERSION {
            bail!("GPU state header version {}, this tandem reads {GPU_VERSION}", u32_at(8));
        }
        if checksum(&bytes[..GPU_HEADER - 8]) != u64_at(GPU_HEADER - 8) {
            bail!("the GPU state header's checksum does not match: damaged on the way");
        }
        let got = GpuHeader {
            dtype: u32_at(12),
            fingerprint: u128::from_le_bytes(bytes[16..32].try_into().expect("16 bytes")),
            position: u64_at(32),
            slot_bytes: u64_at(40),
            blocks: u64_at(48),
            block_bytes: u64_at(56),
            vocab: u64_at(64),
        };
        if got.fingerprint != expected.fingerprint {
            bail!("a state of another model (fingerprint {:032x}, this model {:032x})", got.fingerprint, expected.fingerprint);
        }
        if got.position != expected.position {
            bail!("holds {} tokens, the request {}", got.position, expected.position);
        }
        if got.dtype != expected.dtype || got.slot_bytes != expected.slot_bytes {
            bail!("its recurrent states are of another dtype or layout ({} slot bytes, dtype code {}; here {} bytes, code {}): give both engines the same --state-dtype", got.slot_bytes, got.dtype, expected.slot_bytes, expected.dtype);
        }
        if got.blocks != expected.blocks || got.block_bytes != expected.block_bytes || got.vocab != expected.vocab {
            bail!("its K/V blocks or logits differ ({} blocks of {} bytes, {} logits; here {} of {}, {})", got.blocks, got.block_bytes, got.vocab, expected.blocks, expected.block_bytes, expected.vocab);
        }
        Ok(())
    }
}

/// A host slot whose state arrived, out of its receiver (`Receiver::take_arrived`).
pub struct Arrived {
    slot: u64,
    /// The agent that wrote it.
    from: String,
    region: Region,
}

impl Arrived {
    /// The state in the slot, checked as every bridge checks one (magic, version, model
    /// fingerprint, layer table, checksums) and its position compared with `position`, before it
    /// is built (into `reuse`'s buffers where given). Returns it with the times to check the
    /// header and to rebuild.
    pub fn state(&self, fingerprint: Fingerprint, cfg: &Qwen35Config, position: usize, reuse: Option<State>) -> Result<(State, Duration, Duration)> {
        let (slot, from) = (self.slot, &self.from);
        let mut bytes = self.region.memory.bytes();
        let (state, read, rebuild) = super::socket::receive(&mut bytes, fingerprint, cfg, reuse).with_context(|| format!("the state {from} wrote in slot {slot}, refused"))?;
        if state.position != position {
            bail!("the state {from} wrote in slot {slot} holds {} tokens, the request {position}: refused", state.position);
        }
        Ok((state, read, rebuild))
    }
}

/// A reserved slot's memory.
enum Reserved {
    Host(Region),
    Gpu(Incoming),
}

/// The decode side: slots reserved for states that are on their way.
pub struct Receiver {
    endpoint: Endpoint,
    reserved: HashMap<u64, Reserved>,
    /// Slots whose notification came: the state is in the slot, complete.
    arrived: HashMap<u64, String>,
    /// Registered host memory of slots taken, to be reused.
    free: Vec<Region>,
    /// Memory of released slots, with when each was released: reused after `QUARANTINE`.
    quarantined: Vec<(Instant, Reserved)>,
    /// GPU memory, where states arrive in it (`on_gpu`).
    gpu: Option<GpuSide>,
    next_slot: u64,
}

impl Receiver {
    pub fn new(name: &str, transports: Option<&str>) -> Result<Receiver> {
        Ok(Receiver { endpoint: Endpoint::new(name, transports)?, reserved: HashMap::new(), arrived: HashMap::new(), free: Vec::new(), quarantined: Vec::new(), gpu: None, next_slot: 1 })
    }

    /// Receive states into GPU memory, `pools` (a GPU decode engine's), instead of host memory.
    pub fn on_gpu(mut self, pools: TransferPools) -> Receiver {
        self.gpu = Some(GpuSide { registered: HashMap::new(), pools });
        self
    }

    /// Whether states arrive in GPU memory (`take_gpu`) rather than host memory (`take`).
    pub fn is_on_gpu(&self) -> bool {
        self.gpu.is_some()
    }

    /// Reserve a slot for the state of a request whose prompt has `prompt` tokens.
    pub fn reserve_for_prompt(&mut self, cfg: &Qwen35Config, prompt: usize) -> Result<StateTicket> {
        if self.gpu.is_none() {
            return self.reserve(super::format::prefilled_image_bytes(cfg, prompt));
        }
        self.end_quarantine();
        let gpu = self.gpu.as_mut().expect("checked above");
        let incoming = gpu.pools.reserve(prompt)?;
        gpu.register_new(&self.endpoint)?;
        let memory = SlotMemory::of(&incoming.pieces());
        self.hold(Reserved::Gpu(incoming), memory)
    }

    /// Reserve a slot of at least `bytes` bytes of host memory.
    pub fn reserve(&mut self, bytes: usize) -> Result<StateTicket> {
        self.end_quarantine();
        let region = match self.free.iter().position(|r| r.memory.len >= bytes) {
            Some(i) => self.free.swap_remove(i),
            None => self.endpoint.register(bytes)?,
        };
        let memory = SlotMemory::Host { addr: region.memory.ptr as u64, len: region.memory.len as u64 };
        self.hold(Reserved::Host(region), memory)
    }

    /// Memory released more than `QUARANTINE` ago goes back to use.
    fn end_quarantine(&mut self) {
        let now = Instant::now();
        let (out, kept): (Vec<_>, Vec<_>) = self.quarantined.drain(..).partition(|(at, _)| now.duration_since(*at) >= QUARANTINE);
        self.quarantined = kept;
        for (_, r) in out {
            if let Reserved::Host(region) = r {
                self.free.push(region);
            }
        }
    }

    fn hold(&mut self, reserved: Reserved, memory: SlotMemory) -> Result<StateTicket> {
        let slot = self.next_slot;
        self.next_slot += 1;
        let ticket = StateTicket { agent: self.endpoint.name(), metadata: self.endpoint.agent.get_local_md().map_err(nixl_err("reading this agent's metadata"))?, slot, memory };
        self.reserved.insert(slot, reserved);
        Ok(ticket)
    }

    /// Give up on a slot whose state will not come (or whose request went): its memory goes to
    /// quarantine (see `QUARANTINE`). Returns whether the slot was reserved.
    pub fn release(&mut self, slot: u64) -> bool {
        self.arrived.remove(&slot);
        match self.reserved.remove(&slot) {
            Some(reserved) => {
                self.quarantined.push((Instant::now(), reserved));
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
        let arrived = self.take_arrived(slot)?;
        let result = arrived.state(fingerprint, cfg, position, reuse);
        self.recycle(arrived);
        result
    }

    /// Take host slot `slot`, whose state arrived, out of the receiver: its state is then checked
    /// and copied out (`Arrived::state`) without holding the receiver, and its memory comes back
    /// with `recycle`. The slot is no longer reserved.
    pub fn take_arrived(&mut self, slot: u64) -> Result<Arrived> {
        let (from, Reserved::Host(region)) = self.take_out(slot, false)? else { unreachable!("take_out gives the kind asked for") };
        Ok(Arrived { slot, from, region })
    }

    /// Slot `slot`, whose state arrived, out of the reserved ones, with the agent that wrote it:
    /// GPU memory where `gpu`, else host memory; a slot of the other kind stays reserved (an
    /// error names the call that takes it).
    fn take_out(&mut self, slot: u64, gpu: bool) -> Result<(String, Reserved)> {
        if !self.arrived.contains_key(&slot) {
            bail!("no state has arrived in slot {slot}");
        }
        match self.reserved.get(&slot) {
            None => bail!("state slot {slot} is not reserved here"),
            Some(Reserved::Gpu(_)) if !gpu => bail!("state slot {slot} is GPU memory: take_gpu"),
            Some(Reserved::Host(_)) if gpu => bail!("state slot {slot} is host memory: take"),
            Some(_) => {}
        }
        Ok((self.arrived.remove(&slot).expect("checked above"), self.reserved.remove(&slot).expect("checked above")))
    }

    /// The memory of a slot taken with `take_arrived`, back for later reservations (the
    /// notification came after the last byte: nothing writes it any more).
    pub fn recycle(&mut self, arrived: Arrived) {
        self.free.push(arrived.region);
    }

    /// Take the state that arrived in GPU slot `slot`: its header checked (model
    /// `fingerprint`, `position` the prompt length it was reserved for, the slot's layout, the
    /// blocks, the header's checksum), then its pieces as a snapshot the engine restores. The
    /// slot is freed whatever the outcome.
    pub fn take_gpu(&mut self, slot: u64, fingerprint: Fingerprint, position: usize) -> Result<GpuSnapshot> {
        let (from, Reserved::Gpu(incoming)) = self.take_out(slot, true)? else { unreachable!("take_out gives the kind asked for") };
        let pools = &self.gpu.as_ref().context("a GPU slot without GPU transfer memory")?.pools;
        let expected = GpuHeader::of(fingerprint, position, pools.layout(), pools.block_bytes(), pools.vocab());
        let checked = incoming.header().and_then(|h| GpuHeader::check(&h, &expected));
        checked.with_context(|| format!("the state {from} wrote in GPU slot {slot}, refused"))?;
        incoming.into_snapshot(position)
    }
}

/// The prefill side: writes states into the slots receivers reserved.
pub struct Sender {
    endpoint: Endpoint,
    staging: Option<Region>,
    /// GPU memory, where states are sent from it (`on_gpu`).
    gpu: Option<GpuSide>,
    /// The metadata loaded for each receiving agent, to reload it when it changes (a receiver
    /// registers more memory).
    peers: HashMap<String, Vec<u8>>,
}

impl Sender {
    pub fn new(name: &str, transports: Option<&str>) -> Result<Sender> {
        Ok(Sender { endpoint: Endpoint::new(name, transports)?, staging: None, gpu: None, peers: HashMap::new() })
    }

    /// Send GPU states from `pools` (the prefill engine's, whose snapshots are sent as they
    /// are) to receivers on GPUs (`send_gpu`).
    pub fn on_gpu(mut self, pools: TransferPools) -> Sender {
        self.gpu = Some(GpuSide { registered: HashMap::new(), pools });
        self
    }

    /// Write `state` into the slot of `ticket` and notify its receiver; returns once the write
    /// has completed (the receiver may use the slot), or an error after `timeout`. Times:
    /// serialize = the image written into registered memory (with its checksum), read = the
    /// transfer until NIXL reports it complete.
    pub fn send(&mut self, ticket: &StateTicket, state: &State, fingerprint: Fingerprint, timeout: Duration) -> Result<TransferTimes> {
        let Some((addr, len)) = ticket.host() else {
            bail!("{} reserved GPU memory for slot {}; this state is in host memory (a CPU engine's): give the prefill and decode workers engines of one kind", ticket.agent, ticket.slot);
        };
        let size = image_bytes(state);
        if size as u64 > len {
            bail!("the state ({size} bytes, {} tokens) does not fit the {len}-byte slot {} that {} reserved", state.position, ticket.slot, ticket.agent);
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
        let mut local = XferDescList::new(MemType::Dram).map_err(nixl_err("a descriptor list"))?;
        local.add_desc(staged, size, 0);
        let mut remote = XferDescList::new(MemType::Dram).map_err(nixl_err("a descriptor list"))?;
        remote.add_desc(addr as usize, size, 0);
        let read = self.write(ticket, &local, &remote, size, timeout)?;
        Ok(TransferTimes { serialize, read, rebuild: Duration::ZERO })
    }

    /// Write the GPU snapshot `snap` into the GPU slot of `ticket`, each piece into its
    /// counterpart (slot, K/V blocks, then logits and header), and notify; returns once the
    /// write has completed, or an error after `timeout`. Times: serialize = the logits and
    /// header staged, read = the transfer.
    pub fn send_gpu(&mut self, ticket: &StateTicket, snap: &GpuSnapshot, fingerprint: Fingerprint, timeout: Duration) -> Result<TransferTimes> {
        let SlotMemory::Gpu { device, slot, slot_bytes, tail, tail_bytes, ref blocks, block_bytes } = ticket.memory else {
            bail!("{} reserved host memory for slot {}; this state is on a GPU: give the prefill and decode workers engines of one kind", ticket.agent, ticket.slot);
        };
        // The forward that made the state may still run on the GPU: its time is the prefill's,
        // not the transfer's.
        snap.wait_ready()?;
        let t = Instant::now();
        let gpu = self.gpu.as_mut().context("this sender has no GPU transfer memory (Sender::on_gpu)")?;
        let pools = &gpu.pools;
        let header = GpuHeader::of(fingerprint, snap.position, pools.layout(), pools.block_bytes(), pools.vocab()).bytes();
        let (_staged, pieces) = pools.stage(snap, &header)?;
        gpu.register_new(&self.endpoint)?;
        if pieces.blocks.len() > blocks.len() || pieces.slot_bytes as u64 != slot_bytes || pieces.block_bytes as u64 != block_bytes || pieces.tail_bytes as u64 > tail_bytes {
            bail!(
                "the state ({} tokens: {} K/V blocks of {} bytes, a {}-byte slot) does not fit slot {} that {} reserved ({} blocks of {block_bytes} bytes, a {slot_bytes}-byte slot): the workers run different models or state dtypes",
                snap.position,
                pieces.blocks.len(),
                pieces.block_bytes,
                pieces.slot_bytes,
                ticket.slot,
                ticket.agent,
                blocks.len()
            );
        }
        let serialize = t.elapsed();
        let (mut local, mut remote) = (XferDescList::new(MemType::Vram).map_err(nixl_err("a descriptor list"))?, XferDescList::new(MemType::Vram).map_err(nixl_err("a descriptor list"))?);
        let here = pieces.device as u64;
        // One request, so that its one notification comes after every piece (NIXL does not
        // order the pieces among themselves): the receiver reads the header only then.
        local.add_desc(pieces.slot as usize, pieces.slot_bytes, here);
        remote.add_desc(slot as usize, pieces.slot_bytes, device);
        for (&from, &to) in pieces.blocks.iter().zip(blocks) {
            local.add_desc(from as usize, pieces.block_bytes, here);
            remote.add_desc(to as usize, pieces.block_bytes, device);
        }
        local.add_desc(pieces.tail as usize, pieces.tail_bytes, here);
        remote.add_desc(tail as usize, pieces.tail_bytes, device);
        let bytes = pieces.slot_bytes + pieces.blocks.len() * pieces.block_bytes + pieces.tail_bytes;
        let read = self.write(ticket, &local, &remote, bytes, timeout)?;
        Ok(TransferTimes { serialize, read, rebuild: Duration::ZERO })
    }

    /// Post the write of `local` into `remote` (the ticket's agent's memory) with the
    /// notification naming the slot, and wait until NIXL reports it complete (at most
    /// `timeout`). Returns how long it took.
    fn write(&mut self, ticket: &StateTicket, local: &XferDescList, remote: &XferDescList, bytes: usize, timeout: Duration) -> Result<Duration> {
        let t = Instant::now();
        self.connect(ticket)?;
        let agent = &self.endpoint.agent;
        let mut args = OptArgs::new().map_err(nixl_err("transfer arguments"))?;
        args.add_backend(&self.endpoint.backend).map_err(nixl_err("transfer arguments"))?;
        args.set_has_notification(true).map_err(nixl_err("transfer arguments"))?;
        args.set_notification_message(format!("{NOTE_PREFIX}{}", ticket.slot).as_bytes()).map_err(nixl_err("transfer arguments"))?;
        let request = agent
            .create_xfer_req(XferOp::Write, local, remote, &ticket.agent, Some(&args))
            .map_err(|e| anyhow!("NIXL: a write to slot {} of {} ({bytes} bytes): {e:?} (the slot is not registered there: released, or the ticket is stale)", ticket.slot, ticket.agent))?;
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
        Ok(t.elapsed())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A GPU transfer's header: read back as written it passes; each field that differs from
    /// what the receiver expects is refused, naming it; a changed byte fails the checksum; a slot
    /// the write never reached (zeros) is no state at all.
    #[test]
    fn gpu_headers_are_checked_field_by_field() {
        let want = GpuHeader { dtype: 1, fingerprint: 0xfeed, position: 40, slot_bytes: 1 << 20, blocks: 3, block_bytes: 4096, vocab: 1024 };
        GpuHeader::check(&want.bytes(), &want).unwrap();
        let refused = |got: GpuHeader| format!("{:#}", GpuHeader::check(&got.bytes(), &want).unwrap_err());
        assert!(refused(GpuHeader { fingerprint: 1, ..want }).contains("another model"));
        assert!(refused(GpuHeader { position: 41, ..want }).contains("holds 41 tokens, the request 40"));
        assert!(refused(GpuHeader { dtype: 2, ..want }).contains("--state-dtype"));
        assert!(refused(GpuHeader { slot_bytes: 1, ..want }).contains("--state-dtype"));
        assert!(refused(GpuHeader { blocks: 4, ..want }).contains("K/V blocks"));
        assert!(refused(GpuHeader { vocab: 7, ..want }).contains("logits"));
        let mut damaged = want.bytes();
        damaged[33] ^= 1;
        assert!(format!("{:#}", GpuHeader::check(&damaged, &want).unwrap_err()).contains("checksum"));
        let mut future = want.bytes();
        future[8] = 9;
        assert!(format!("{:#}", GpuHeader::check(&future, &want).unwrap_err()).contains("version 9"));
        assert!(format!("{:#}", GpuHeader::check(&[0; 4096], &want).unwrap_err()).contains("did not reach"));
    }

    /// Tickets cross processes as JSON, host or GPU memory alike.
    #[test]
    fn tickets_round_trip_through_json() {
        for memory in [SlotMemory::Host { addr: 4096, len: 1 << 20 }, SlotMemory::Gpu { device: 0, slot: 1 << 40, slot_bytes: 99, tail: 77, tail_bytes: 5, blocks: vec![1, 2, 3], block_bytes: 16 }] {
            let t = StateTicket { agent: "a".into(), metadata: vec![0, 255, 7], slot: 3, memory };
            let back: StateTicket = serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
            assert_eq!(back, t);
        }
    }
}
