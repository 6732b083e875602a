//! Intel's tile matrix unit (AMX): eight tile registers of up to 16 rows × 64 bytes, and one
//! instruction that multiplies a tile of 16 rows by a tile of 16 columns, 64 bytes deep (int8:
//! 64 products per output, summed exactly in i32; bf16: 32 products, summed into f32). On a
//! Sapphire or Emerald Rapids core that is eight times `vpdpbusd`'s and sixteen times
//! `vdpbf16ps`'s work per instruction.
//!
//! Rust has no stable AMX intrinsics, so the few instructions are inline assembly here, each
//! behind a macro naming its tile registers. Linux hands the tile state to a process only on
//! request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); `available` asks once, and reports the unit
//! only when the CPU has it and the kernel said yes, so no tile instruction runs otherwise.
//!
//! Tile registers used by the GEMMs (matmul/amx_gemm.rs), all configured 16 rows × 64 bytes:
//! `tmm0`-`tmm3` sums (two token halves × two column halves), `tmm4`-`tmm5` the inputs of 16
//! tokens each, `tmm6`-`tmm7` the weights of 16 columns each.

/// Whether this process may use AMX-INT8 and AMX-BF16 (asked of the CPU and the operating
/// system once).
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::__cpuid_count;
    // CPUID leaf 7: EDX bit 22 AMX-BF16, 24 AMX-TILE, 25 AMX-INT8.
    let edx = __cpuid_count(7, 0).edx;
    if edx & (1 << 22 | 1 << 24 | 1 << 25) != (1 << 22 | 1 << 24 | 1 << 25) {
        return false;
    }
    // The tile data (XSAVE component 18) must be granted to the process before its first use;
    // a kernel without AMX support refuses, and the unit stays unused.
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// The tile registers configured (every one 16 rows × 64 bytes) on this thread while it lives;
/// released (`tilerelease`, back to the init state the OS need not save) when dropped.
pub struct Tiles(());

impl Tiles {
    /// # Safety
    /// `available()` must be true.
    #[cfg(target_arch = "x86_64")]
    pub unsafe fn configure() -> Tiles {
        // The 64-byte configuration: palette 1; bytes 16.. each tile's bytes per row (u16);
        // bytes 48.. each tile's rows.
        let mut config = [0u8; 64];
        config[0] = 1;
        for tile in 0..8 {
            config[16 + 2 * tile..18 + 2 * tile].copy_from_slice(&64u16.to_le_bytes());
            config[48 + tile] = 16;
        }
        std::arch::asm!("ldtilecfg [{}]", in(reg) config.as_ptr(), options(nostack, readonly));
        Tiles(())
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: a `Tiles` exists only where `configure` ran, so the CPU has the unit.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem))
        }
    }
}

/// `tmm$t = 0`.
macro_rules! tile_zero {
    ($t:literal) => {
        std::arch::asm!(concat!("tilezero tmm", $t), options(nostack, nomem))
    };
}

/// `tmm$t` = 16 rows of 64 bytes from `$ptr`, rows `$stride` bytes apart.
macro_rules! tile_load {
    ($t:literal, $ptr:expr, $stride:expr) => {
        std::arch::asm!(concat!("tileloadd tmm", $t, ", [{p} + {s}*1]"), p = in(reg) $ptr, s = in(reg) ($stride) as usize, options(nostack, readonly))
    };
}

/// 16 rows of 64 bytes of `tmm$t` to `$ptr`, rows `$stride` bytes apart.
macro_rules! tile_store {
    ($t:literal, $ptr:expr, $stride:expr) => {
        std::arch::asm!(concat!("tilestored [{p} + {s}*1], tmm", $t), p = in(reg) $ptr, s = in(reg) ($stride) as usize, options(nostack))
    };
}

/// `tmm$c[m][n] += Σ_j tmm$a.i8[m][j] · tmm$b.i8[j / 4][4n + j % 4]` (signed bytes, i32 sums).
macro_rules! tile_dot_i8 {
    ($c:literal, $a:literal, $b:literal) => {
        std::arch::asm!(concat!("tdpbssd tmm", $c, ", tmm", $a, ", tmm", $b), options(nostack, nomem))
    };
}

/// `tmm$c[m][n] += Σ_j tmm$a.bf16[m][j] · tmm$b.bf16[j / 2][2n + j % 2]` (f32 sums).
macro_rules! tile_dot_bf16 {
    ($c:literal, $a:literal, $b:literal) => {
        std::arch::asm!(concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b), options(nostack, nomem))
    };
}

pub(crate) use {tile_dot_bf16, tile_dot_i8, tile_load, tile_store, tile_zero};

/// `iters` rounds of four independent tile products (`tdpbssd` if `int8`, else `tdpbf16ps`) on
/// this thread; returns the operations done (a multiply-add counted as two). The unit's peak,
/// for the benchmark's ceilings. None where the CPU has no AMX.
pub fn peak_ops(iters: u64, int8: bool) -> Option<f64> {
    if !available() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let zeros = [0u8; 1024];
        // SAFETY: `available()` checked the CPU and the permission.
        unsafe {
            let _tiles = Tiles::configure();
            tile_load!(4, zeros.as_ptr(), 64);
            tile_load!(6, zeros.as_ptr(), 64);
            for _ in 0..iters {
                if int8 {
                    tile_dot_i8!(0, 4, 6);
                    tile_dot_i8!(1, 4, 6);
                    tile_dot_i8!(2, 4, 6);
                    tile_dot_i8!(3, 4, 6);
                } else {
                    tile_dot_bf16!(0, 4, 6);
                    tile_dot_bf16!(1, 4, 6);
                    tile_dot_bf16!(2, 4, 6);
                    tile_dot_bf16!(3, 4, 6);
                }
            }
        }
        // A tile product: 16 × 16 outputs, each 64 (int8) or 32 (bf16) multiply-adds.
        Some(iters as f64 * 4.0 * 256.0 * if int8 { 64.0 } else { 32.0 } * 2.0)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}
