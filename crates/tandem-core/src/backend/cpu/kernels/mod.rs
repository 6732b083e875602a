//! CPU kernels. Each one sits next to its plain reference (or a second formulation of the
//! same maths) and a test that holds the two together.

use std::sync::atomic::{AtomicU8, Ordering};

/// Instruction sets the kernels are built for, in increasing order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Portable = 0,
    Avx2 = 1,
    Avx512 = 2,
    /// AVX-512 with its dot-product instructions: bf16 pairs (AVX512-BF16 `vdpbf16ps`) and
    /// int8 quadruples (AVX512-VNNI `vpdpbusd`).
    Avx512Dot = 3,
    /// `Avx512Dot` and Intel's tile matrix unit (AMX-BF16 and AMX-INT8), which the operating
    /// system has let this process use (`amx::available`).
    Amx = 4,
}

static MAX_ISA: AtomicU8 = AtomicU8::new(Isa::Amx as u8);

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bw") && std::arch::is_x86_feature_detected!("avx512vl")
}

#[cfg(target_arch = "x86_64")]
fn has_avx512_dot() -> bool {
    has_avx512() && std::arch::is_x86_feature_detected!("avx512bf16") && std::arch::is_x86_feature_detected!("avx512vnni")
}

/// Cap the instruction set every kernel dispatches to (all levels compute the same results up
/// to summation order): lets tests run the AVX2 and portable builds on an AVX-512 machine,
/// and a benchmark compare them.
pub fn set_max_isa(isa: Isa) {
    MAX_ISA.store(isa as u8, Ordering::Relaxed);
}

/// The instruction set kernels use now: what the CPU has, within the cap.
#[inline]
pub fn isa() -> Isa {
    let cap = MAX_ISA.load(Ordering::Relaxed);
    #[cfg(target_arch = "x86_64")]
    {
        if cap >= Isa::Amx as u8 && has_avx512_dot() && amx::available() {
            return Isa::Amx;
        }
        if cap >= Isa::Avx512Dot as u8 && has_avx512_dot() {
            return Isa::Avx512Dot;
        }
        if cap >= Isa::Avx512 as u8 && has_avx512() {
            return Isa::Avx512;
        }
        if cap >= Isa::Avx2 as u8 && std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return Isa::Avx2;
        }
    }
    let _ = cap;
    Isa::Portable
}

/// The levels this CPU can run, lowest first.
pub fn available_isas() -> Vec<Isa> {
    let mut v = vec![Isa::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            v.push(Isa::Avx2);
        }
        if has_avx512() {
            v.push(Isa::Avx512);
        }
        if has_avx512_dot() {
            v.push(Isa::Avx512Dot);
            if amx::available() {
                v.push(Isa::Amx);
            }
        }
    }
    v
}

/// Held while a caller depends on the cap not moving: `for_each_isa` holds it, and so does a
/// test that compares two runs bit for bit (tests of one binary run on parallel threads).
pub fn hold_isa() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Run `f` at every instruction set this CPU has (lowest first), then lift the cap again. For
/// tests: every kernel build must give the reference's results.
pub fn for_each_isa(mut f: impl FnMut(Isa)) {
    let _held = hold_isa();
    for isa in available_isas() {
        set_max_isa(isa);
        f(isa);
    }
    set_max_isa(Isa::Amx);
}

/// Define `fn name(args) -> R` that runs `body(args)` compiled for AVX-512 or AVX2+FMA when the
/// CPU has them (picked at run time), else the portable build. `body` must be
/// `#[inline(always)]` so that each copy is vectorised for its own instruction set.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($a:ident : $t:ty),* $(,)?) $(-> $r:ty)? => $body:ident) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($a: $t),*) $(-> $r)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v512($($a: $t),*) $(-> $r)? { $body($($a),*) }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v256($($a: $t),*) $(-> $r)? { $body($($a),*) }
                match $crate::backend::cpu::kernels::isa() {
                    // SAFETY: isa() only reports features the CPU has.
                    $crate::backend::cpu::kernels::Isa::Avx512 | $crate::backend::cpu::kernels::Isa::Avx512Dot | $crate::backend::cpu::kernels::Isa::Amx => return unsafe { v512($($a),*) },
                    $crate::backend::cpu::kernels::Isa::Avx2 => return unsafe { v256($($a),*) },
                    $crate::backend::cpu::kernels::Isa::Portable => {}
                }
            }
            $body($($a),*)
        }
    };
}
pub(crate) use multiversion;

pub mod amx;
pub mod attention;
pub mod deltanet;
pub mod matmul;
pub mod norm;
pub mod rope;
