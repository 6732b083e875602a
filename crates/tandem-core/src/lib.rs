//! tandem-core: Qwen3.5 inference on CPU.
//!
//! The data flow, module by module: `load` (checkpoint or synthetic model: `checkpoint`,
//! `config`, `model`) → `tokenizer` + `chat` (text to ids) → `model::Qwen35::forward` over the
//! `kernels`, carrying a `state::State` → `sampling` → `generate` (the loop and its timings).
//! `verify` compares all of it with reference outputs.

pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod engine;
pub mod generate;
pub mod kernels;
pub mod limits;
pub mod load;
pub mod model;
pub mod pool;
pub mod quality;
pub mod quant;
pub mod rng;
pub mod sampling;
pub mod scheduler;
pub mod state;
pub mod tensor;
pub mod tokenizer;
pub mod verify;
