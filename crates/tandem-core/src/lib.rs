//! tandem-core: Qwen3.5 inference with prefill and decode on separate engines.
//!
//! The folders follow a request: `tokenizer` + `chat` (text to ids; `session` for
//! conversations that keep their state between turns) → `pipeline` (requests queue for the
//! prefill `engine`) → `state` (what a prefill leaves: conv windows, recurrent states, K/V,
//! the last logits) → `bridge` (the state moved to the decode engine: in process, through a
//! file, over a socket, between host and GPU) → the decode `engine` (batched steps) →
//! `sampling` (with a `grammar` where the reply must follow one) → events back to the caller. `model` is the Qwen3.5 checkpoint (config, weights,
//! loading); `backend` holds the compute under every engine: `backend::cpu` (the forward pass
//! on the CPU, its kernels, the worker pool) and `backend::cuda` (the same on NVIDIA GPUs).
//! `verify` compares a backend with the reference implementation's outputs.

pub mod backend;
pub mod bridge;
pub mod chat;
pub mod engine;
pub mod grammar;
pub mod model;
pub mod pipeline;
pub mod prefix_cache;
pub mod rng;
pub mod sampling;
pub mod session;
pub mod state;
pub mod tokenizer;
pub mod verify;
