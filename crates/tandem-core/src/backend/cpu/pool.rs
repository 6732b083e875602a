//! A persistent worker pool sized to an engine's cores. Every kernel call fans out to the same
//! threads (no per-op spawn: at decode sizes a thread spawn or a rayon hand-off costs as much
//! as the work). The calling thread is worker 0. Idle workers spin briefly (ops arrive every
//! few microseconds during a forward pass), then park.
//!
//! Jobs run with subnormal floats flushed to zero (x86 FTZ/DAZ). The DeltaNet decays
//! `exp(G_i − G_j)` reach e^-100 and below, and arithmetic on subnormals is microcoded on x86,
//! tens of times slower; a value under 1.2e-38 cannot change an f32 result we keep.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

/// How long an idle worker spins before parking.
const SPIN: Duration = Duration::from_micros(200);

type Job = *const (dyn Fn(usize) + Sync);

/// A value alone on its cache lines (two: Intel cores fetch lines in pairs), so that writes to
/// its neighbours do not take it away from the cores that read it.
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// A call's fork is one write that every worker reads (`generation`), and its join one write
/// per worker that only the caller reads (`done`). Each on lines of its own: with the fork's
/// counter beside a join counter that all workers decremented, every decrement took the line
/// from the workers still spinning on it, one after another. An empty call on 16 Xeon cores
/// took 2.9-3.2 µs that way and takes 0.9-1.0 µs so (`examples/fork_join.rs`; a decode step
/// of the 0.8B makes 145 calls); on 2 threads it costs 0.46-0.61 µs instead of
/// 0.15-0.25 there, a fraction of a thousandth of a step.
struct Shared {
    job: UnsafeCell<Option<Job>>,
    generation: Padded<AtomicU64>,
    /// The last generation each worker finished (index 0, the caller's, unused).
    done: Vec<Padded<AtomicU64>>,
    shutdown: AtomicBool,
    panicked: AtomicBool,
    sleeping: Vec<AtomicBool>,
}

// SAFETY: `job` is written only by `run` while no worker reads it (all are idle: each has
// finished the previous generation), and read by workers only between the generation bump and
// their `done` store.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<(JoinHandle<()>, Thread)>,
    cores: Vec<usize>,
}

/// Cores the machine has online (not only those the calling thread may run on: a pinned thread
/// narrows what `available_parallelism` reports, and threads it starts inherit that).
fn online_cores() -> usize {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sysconf has no preconditions.
        let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        if n > 0 {
            return n as usize;
        }
    }
    thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

impl Pool {
    /// `threads` workers, not pinned.
    pub fn new(threads: usize) -> Pool {
        Self::spawn(threads.max(1), Vec::new())
    }

    /// One worker per listed core, each pinned to it (the caller's thread is pinned to the
    /// first). Linux only; elsewhere the threads run unpinned.
    pub fn pinned(cores: &[usize]) -> Result<Pool> {
        if cores.is_empty() {
            bail!("a pool needs at least one core");
        }
        let available = online_cores();
        if let Some(&c) = cores.iter().find(|&&c| c >= available) {
            bail!("core {c} does not exist: this machine has cores 0..{available}");
        }
        pin_current_thread(cores[0])?;
        Ok(Self::spawn(cores.len(), cores.to_vec()))
    }

    fn spawn(threads: usize, cores: Vec<usize>) -> Pool {
        let shared = Arc::new(Shared {
            job: UnsafeCell::new(None),
            generation: Padded(AtomicU64::new(0)),
            done: (0..threads).map(|_| Padded(AtomicU64::new(0))).collect(),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            sleeping: (0..threads).map(|_| AtomicBool::new(false)).collect(),
        });
        let workers = (1..threads)
            .map(|id| {
                let s = shared.clone();
                let core = cores.get(id).copied();
                let handle = thread::Builder::new()
                    .name(format!("tandem-worker-{id}"))
                    .spawn(move || {
                        if let Some(c) = core {
                            let _ = pin_current_thread(c);
                        }
                        worker_loop(&s, id)
                    })
                    .expect("spawning a worker thread");
                let t = handle.thread().clone();
                (handle, t)
            })
            .collect();
        Pool { shared, workers, cores }
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// The cores the pool is pinned to (empty when unpinned).
    pub fn cores(&self) -> &[usize] {
        &self.cores
    }

    /// Run `f(worker)` on every worker (0..threads) and wait for all of them.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        let _ftz = FlushSubnormals::enable();
        if self.workers.is_empty() {
            f(0);
            return;
        }
        let s = &*self.shared;
        // SAFETY: all workers are idle (the previous run waited for each one's `done`), so
        // nobody reads `job` now; the lifetime is erased but `run` does not return before
        // every worker is done with `f`.
        unsafe {
            let job: Job = std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static (dyn Fn(usize) + Sync)>(f);
            *s.job.get() = Some(job);
        }
        // Only this thread writes the generation (workers read it), so a load and a store.
        let generation = s.generation.load(Ordering::Relaxed) + 1;
        s.generation.store(generation, Ordering::Release);
        for (i, (_, t)) in self.workers.iter().enumerate() {
            if s.sleeping[i + 1].load(Ordering::Acquire) {
                t.unpark();
            }
        }
        let caller = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(0)));
        for done in &s.done[1..] {
            while done.load(Ordering::Acquire) != generation {
                std::hint::spin_loop();
            }
        }
        if let Err(p) = caller {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a worker thread panicked");
        }
    }

    /// Split `0..n` into one contiguous range per worker, boundaries on multiples of `align`,
    /// and run `f(range)` on each.
    pub fn for_ranges(&self, n: usize, align: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        let parts = self.threads();
        let units = n.div_ceil(align);
        self.run(&|w| {
            let (a, b) = (units * w / parts * align, (units * (w + 1) / parts * align).min(n));
            if a < b {
                f(a..b);
            }
        });
    }
}

/// Units of work that a pool's workers take in turn (each worker loops on `take` until it is
/// empty): a worker that finishes early takes more, so nobody waits on a slow neighbour at the
/// end of a call, whatever else shares the machine.
pub struct WorkQueue {
    next: AtomicUsize,
    len: usize,
}

impl WorkQueue {
    pub fn new(len: usize) -> WorkQueue {
        WorkQueue { next: AtomicUsize::new(0), len }
    }

    /// The next unit, or None when all were taken.
    #[inline]
    pub fn take(&self) -> Option<usize> {
        let u = self.next.fetch_add(1, Ordering::Relaxed);
        (u < self.len).then_some(u)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.generation.fetch_add(1, Ordering::Release);
        for (h, t) in self.workers.drain(..) {
            t.unpark();
            let _ = h.join();
        }
    }
}

/// While alive, the calling thread flushes subnormal inputs and results to zero; the previous
/// mode is restored on drop (the caller's thread is the user's).
struct FlushSubnormals {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

impl FlushSubnormals {
    fn enable() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            // FTZ (bit 15) and DAZ (bit 6) of MXCSR.
            #[allow(deprecated)]
            // SAFETY: reading and writing MXCSR only changes floating-point modes.
            unsafe {
                let saved = std::arch::x86_64::_mm_getcsr();
                std::arch::x86_64::_mm_setcsr(saved | 0x8040);
                FlushSubnormals { saved }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        FlushSubnormals {}
    }
}

impl Drop for FlushSubnormals {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        #[allow(deprecated)]
        // SAFETY: restores the mode read in `enable`.
        unsafe {
            std::arch::x86_64::_mm_setcsr(self.saved)
        }
    }
}

fn worker_loop(s: &Shared, id: usize) {
    // Workers only ever run engine jobs: flush subnormals for their whole life.
    let _ftz = FlushSubnormals::enable();
    // Generation 0 is the pool's initial one; a `run` may have bumped it before this thread
    // got here, and that job must still be picked up.
    let mut seen = 0;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            spins += 1;
            if spins % 1024 == 0 && start.elapsed() > SPIN {
                s.sleeping[id].store(true, Ordering::Release);
                // Re-check after announcing sleep: a run that started in between unparks us
                // (the unpark token is kept if it comes before park).
                if s.generation.load(Ordering::Acquire) == seen {
                    thread::park_timeout(Duration::from_millis(50));
                }
                s.sleeping[id].store(false, Ordering::Release);
            } else {
                std::hint::spin_loop();
            }
        }
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: see `Shared`; the job stays valid until this worker stores its `done`.
        let job = unsafe { (*s.job.get()).expect("job set before the generation bump") };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { (*job)(id) }));
        if r.is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.done[id].store(seen, Ordering::Release);
    }
}

/// The cores the calling thread may run on (its affinity mask: a container's or `taskset`'s
/// limits), in order; every online core where the mask cannot be read.
pub fn allowed_cores() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: cpu_set_t is plain data; sched_getaffinity(0, ...) reads the calling thread's.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
                let cores: Vec<usize> = (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect();
                if !cores.is_empty() {
                    return cores;
                }
            }
        }
    }
    (0..online_cores()).collect()
}

/// Pin the calling thread to one core.
#[cfg(target_os = "linux")]
pub fn pin_current_thread(core: usize) -> Result<()> {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity(0, ...) acts on the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            bail!("cannot pin a thread to core {core}: {}", std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
pub fn pin_current_thread(_core: usize) -> Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_worker_runs_once_per_call_and_ranges_cover_everything() {
        let pool = Pool::new(3);
        let counts: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..1000 {
            pool.run(&|w| {
                counts[w].fetch_add(1, Ordering::Relaxed);
            });
        }
        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1000));
        let hits: Vec<AtomicUsize> = (0..1000).map(|_| AtomicUsize::new(0)).collect();
        pool.for_ranges(1000, 16, &|r| {
            assert!(r.start % 16 == 0);
            for i in r {
                hits[i].fetch_add(1, Ordering::Relaxed);
            }
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }

    /// The join waits for the slowest worker, call after call, and a worker's panic reaches the
    /// caller without breaking the pool.
    #[test]
    fn a_call_returns_after_every_worker_and_a_panic_reaches_the_caller() {
        let pool = Pool::new(4);
        for call in 0..50u64 {
            let finished: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
            pool.run(&|w| {
                // A different worker is the slow one on each call.
                if w as u64 == call % 4 {
                    std::thread::sleep(Duration::from_micros(300));
                }
                finished[w].store(1, Ordering::Relaxed);
            });
            assert!(finished.iter().all(|f| f.load(Ordering::Relaxed) == 1), "call {call} returned before a worker finished");
        }
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|w| {
                if w == 3 {
                    panic!("worker 3 fails");
                }
            })
        }));
        assert!(caught.is_err(), "a worker's panic was lost");
        let n = AtomicUsize::new(0);
        pool.run(&|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 4, "the pool does not work after a panic");
    }

    #[test]
    fn a_work_queue_hands_out_every_unit_once() {
        let pool = Pool::new(3);
        let hits: Vec<AtomicUsize> = (0..500).map(|_| AtomicUsize::new(0)).collect();
        let queue = WorkQueue::new(hits.len());
        pool.run(&|_| {
            while let Some(u) = queue.take() {
                hits[u].fetch_add(1, Ordering::Relaxed);
            }
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        assert_eq!(queue.take(), None);
    }

    #[test]
    fn parked_workers_wake_up() {
        let pool = Pool::new(2);
        std::thread::sleep(Duration::from_millis(20));
        let n = AtomicUsize::new(0);
        pool.run(&|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_nonexistent_core_is_an_error() {
        let e = Pool::pinned(&[0, 4096]).err().unwrap().to_string();
        assert!(e.contains("core 4096"), "{e}");
    }
}
