//! The CPU backend: the forward pass (`forward`), its kernels (AVX-512 / AVX2 / portable, each
//! beside its plain reference) and the persistent worker pool they run on.

pub mod forward;
pub mod kernels;
pub mod pool;
