//! The compute under the engines: the Qwen3.5 forward pass on CPU cores (`cpu`) and on NVIDIA
//! GPUs (`cuda`). Each backend computes the same model (`crate::model::Qwen35`) from the same
//! state type; `crate::engine` puts one to work with its resources and dispatch mode.

pub mod cpu;
pub mod cuda;
