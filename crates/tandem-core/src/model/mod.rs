//! Model definitions (one file per model family) and loading a model from a path or a
//! `synthetic:` name.

pub mod qwen35;
pub mod synthetic;

pub use qwen35::{Logits, Qwen35};
