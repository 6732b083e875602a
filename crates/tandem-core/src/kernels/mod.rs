//! CPU kernels. Each one sits next to its plain reference (or a second formulation of the
//! same maths) and a test that holds the two together.

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
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has the features v512 was compiled for.
                    return unsafe { v512($($a),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: as above.
                    return unsafe { v256($($a),*) };
                }
            }
            $body($($a),*)
        }
    };
}
pub(crate) use multiversion;

pub mod attention;
pub mod deltanet;
pub mod matmul;
pub mod norm;
pub mod rope;
