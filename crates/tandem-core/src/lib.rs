//! tandem-core: Qwen3.5 inference on CPU.
//!
//! The data flow, module by module: `load` (checkpoint or synthetic model: `checkpoint`,
//! `config`, `model`) → `tokenizer` + `chat` (text to ids; `session` for conversations that
//! keep their state between turns) → `scheduler` (the pipeline: requests to the prefill
//! `engine`, its `state::State` across `state::bridge` to the decode engine, batched decode
//! steps) → `sampling` → events back to the caller. `model::Qwen35::forward` over the
//! `kernels` is the compute under every engine; `generate` is the plain one-engine loop that
//! the pipeline is tested against, and `verify` compares the model with reference outputs.

pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod cuda;
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
pub mod session;
pub mod state;
pub mod tensor;
pub mod tokenizer;
pub mod verify;
