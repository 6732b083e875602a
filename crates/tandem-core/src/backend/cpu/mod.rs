//! The CPU backend: the forward pass (`forward`), its kernels (AVX-512 / AVX2 / portable, each
//! beside its plain reference) and the persistent worker pool they run on.

pub mod forward;
pub mod kernels;
pub mod pool;
pub mod profile;

/// How a CPU pass multiplies (`cpu,precision=...`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpuPrecision {
    /// f32 products of the activations and the widened weights: the reference arithmetic,
    /// which `tandem verify` holds to the published model.
    #[default]
    Exact,
    /// A GPU's tensor-core arithmetic emulated: the input of every product rounded to bf16, the
    /// exact kernels then (`verify --precision tensor-cores` on the CPU).
    Bf16Inputs,
    /// The CPU's matrix instructions: a bf16 weight's products take bf16-rounded inputs, summed
    /// in f32 by AMX tiles where the CPU has them, else two at a time by `vdpbf16ps` where it
    /// has AVX512-BF16 (the tensor-core arithmetic, in other summation orders); a prompt's
    /// products with int8 weights take its inputs quantized to int8 in blocks of 64, each
    /// block's products summed exactly in i32 by AMX tiles or by `vpdpbusd` (AVX512-VNNI), the
    /// same bits either way (W8A8); a decode step's products with Q4_K, Q5_K and Q6_K blocks
    /// take its inputs quantized to int8 in blocks of 256 on AVX2 and AVX-512 (W4A8 / W6A8,
    /// blocks_a8.rs); other products as `Exact`.
    Fast,
    /// `Fast`'s arithmetic by plain kernels, what `verify --precision fast` holds it to: a bf16
    /// weight's products by the exact kernels on bf16-rounded inputs (`Fast` up to the order of
    /// f32 sums; with bf16 weights this is `Bf16Inputs`), a prompt's W8A8 products by the
    /// kernel's scalar reference (`Fast`'s bits), the W4A8 decode products by theirs.
    FastReference,
}
