//! Reusing the state of a prompt's prefix across requests: a radix tree over token ids with
//! state snapshots at its nodes (`tree`), and the cache a server shares across its requests
//! on top of it (`cache`), whose snapshots live on the GPU (`device_tier`), in host memory, or on disk (`disk_tier`).

pub mod cache;
pub mod device_tier;
pub mod disk_tier;
pub mod tree;

pub use cache::{CacheStats, Found, Pin, PrefixCache};
pub use device_tier::DeviceTier;
pub use disk_tier::DiskTier;
pub use tree::{Match, NodeId, PrefixTree};
