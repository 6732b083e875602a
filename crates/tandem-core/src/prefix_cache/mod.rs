//! Reusing the state of a prompt's prefix across requests: a radix tree over token ids with
//! state snapshots at its nodes (`tree`).

pub mod tree;

pub use tree::{Match, NodeId, PrefixTree};
