//! A radix tree over token ids whose nodes hold snapshots of a model state. A Qwen3.5 state
//! cannot be cut back to an earlier position (the DeltaNet layers' recurrent state has folded
//! every token in), so a prompt can reuse only a snapshot taken at a point it passes: the tree
//! finds, for a prompt, how far it matches what earlier requests applied and the deepest
//! snapshot at or before that point; the prefill continues from there.
//!
//! Each node is the end of an edge labelled with a run of tokens; its depth is the number of
//! tokens from the root. A snapshot belongs to the node at its depth (an edge is split where a
//! snapshot falls inside it). Snapshots are evicted least recently used first, down to a byte
//! budget; a pinned node (a state in use, a live session) is never evicted, and nodes left
//! with neither a snapshot nor children are removed.
//!
//! The tree is generic over the snapshot (`S`): what a snapshot holds and where it lives (host
//! memory, a device, a file) is its owner's business; the tree keeps its size.

use std::collections::HashMap;

/// A node's index; stable while the node lives (a split gives the new upper part a new id).
pub type NodeId = usize;

const ROOT: NodeId = 0;

struct Node<S> {
    parent: NodeId,
    /// The tokens of the edge from the parent to this node.
    label: Vec<u32>,
    depth: usize,
    children: HashMap<u32, NodeId>,
    snapshot: Option<(S, usize)>,
    pins: u32,
    last_used: u64,
}

pub struct PrefixTree<S> {
    nodes: Vec<Option<Node<S>>>,
    free: Vec<NodeId>,
    clock: u64,
    bytes: usize,
    snapshots: usize,
}

/// What a prompt finds in the tree.
#[derive(Debug, Clone, PartialEq)]
pub struct Match<S> {
    /// How many of the prompt's tokens some earlier request applied (the ideal reuse).
    pub matched: usize,
    /// The deepest snapshot at or before `matched`: its node, its depth (the tokens it
    /// covers) and a copy of it.
    pub snapshot: Option<(NodeId, usize, S)>,
}

impl<S: Clone> Default for PrefixTree<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S: Clone> PrefixTree<S> {
    pub fn new() -> PrefixTree<S> {
        let root = Node { parent: ROOT, label: Vec::new(), depth: 0, children: HashMap::new(), snapshot: None, pins: 0, last_used: 0 };
        PrefixTree { nodes: vec![Some(root)], free: Vec::new(), clock: 0, bytes: 0, snapshots: 0 }
    }

    /// Bytes of the snapshots held (as their owners sized them).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn snapshots(&self) -> usize {
        self.snapshots
    }

    fn node(&self, id: NodeId) -> &Node<S> {
        self.nodes[id].as_ref().expect("a live node id")
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node<S> {
        self.nodes[id].as_mut().expect("a live node id")
    }

    /// How far `tokens` runs along the tree: the last node passed whole, and the tokens
    /// matched (past that node, `matched - depth` tokens into the edge of `partial`).
    fn walk(&self, tokens: &[u32]) -> (NodeId, usize, Option<NodeId>) {
        let mut at = ROOT;
        let mut matched = 0;
        loop {
            let Some(&child) = tokens.get(matched).and_then(|t| self.node(at).children.get(t)) else {
                return (at, matched, None);
            };
            let label = &self.node(child).label;
            let common = label.iter().zip(&tokens[matched..]).take_while(|(a, b)| a == b).count();
            if common < label.len() {
                return (at, matched + common, Some(child));
            }
            at = child;
            matched += common;
        }
    }

    /// The prompt's match, the snapshot it finds marked as used.
    pub fn lookup(&mut self, tokens: &[u32]) -> Match<S> {
        let (end, matched, _) = self.walk(tokens);
        let mut at = end;
        let found = loop {
            if self.node(at).snapshot.is_some() || at == ROOT {
                break self.node(at).snapshot.as_ref().map(|_| at);
            }
            at = self.node(at).parent;
        };
        self.clock += 1;
        let clock = self.clock;
        let snapshot = found.map(|id| {
            let node = self.node_mut(id);
            node.last_used = clock;
            (id, node.depth, node.snapshot.as_ref().expect("found with a snapshot").0.clone())
        });
        Match { matched, snapshot }
    }

    /// The node of exactly `tokens`, where it holds a snapshot (not marked as used).
    pub fn find(&self, tokens: &[u32]) -> Option<NodeId> {
        match self.walk(tokens) {
            (at, matched, None) if matched == tokens.len() && self.node(at).snapshot.is_some() && at != ROOT => Some(at),
            _ => None,
        }
    }

    /// The deepest snapshot above depth `tokens.len()` on the path of `tokens` that `pick`
    /// takes something from (not marked as used).
    pub fn deepest_above<'a, T>(&'a self, tokens: &[u32], pick: impl Fn(&'a S) -> Option<T>) -> Option<T> {
        let (mut at, _, _) = self.walk(tokens);
        loop {
            let node = self.node(at);
            if let Some(found) = node.snapshot.as_ref().filter(|_| node.depth < tokens.len()).and_then(|(s, _)| pick(s)) {
                return Some(found);
            }
            if at == ROOT {
                return None;
            }
            at = node.parent;
        }
    }

    /// The node at depth `tokens.len()` on the path of `tokens`, made if missing (splitting an
    /// edge that passes that depth).
    fn node_at(&mut self, tokens: &[u32]) -> NodeId {
        let (at, matched, partial) = self.walk(tokens);
        match partial {
            // The tokens end inside an edge, or leave it: split the edge where they part.
            Some(child) => {
                let upper = self.split(child, matched - self.node(at).depth);
                if matched == tokens.len() {
                    upper
                } else {
                    self.add_leaf(upper, &tokens[matched..])
                }
            }
            None if matched == tokens.len() => at,
            None => self.add_leaf(at, &tokens[matched..]),
        }
    }

    /// Split the edge into `child` after `keep` of its tokens; returns the new node there.
    fn split(&mut self, child: NodeId, keep: usize) -> NodeId {
        let (parent, label) = {
            let c = self.node(child);
            (c.parent, c.label.clone())
        };
        let depth = self.node(parent).depth + keep;
        let upper = self.alloc(Node { parent, label: label[..keep].to_vec(), depth, children: HashMap::from([(label[keep], child)]), snapshot: None, pins: 0, last_used: 0 });
        self.node_mut(parent).children.insert(label[0], upper);
        let c = self.node_mut(child);
        c.parent = upper;
        c.label.drain(..keep);
        upper
    }

    fn add_leaf(&mut self, parent: NodeId, label: &[u32]) -> NodeId {
        let depth = self.node(parent).depth + label.len();
        let leaf = self.alloc(Node { parent, label: label.to_vec(), depth, children: HashMap::new(), snapshot: None, pins: 0, last_used: 0 });
        self.node_mut(parent).children.insert(label[0], leaf);
        leaf
    }

    fn alloc(&mut self, node: Node<S>) -> NodeId {
        match self.free.pop() {
            Some(id) => {
                self.nodes[id] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        }
    }

    /// Keep `snapshot` (of `bytes` bytes), the state after exactly `tokens`, in place of the one
    /// there (given back). Returns its node, None for an empty `tokens` (a fresh state costs
    /// nothing to make; nothing is kept).
    pub fn insert(&mut self, tokens: &[u32], snapshot: S, bytes: usize) -> Option<(NodeId, Option<S>)> {
        if tokens.is_empty() {
            return None;
        }
        let id = self.node_at(tokens);
        self.clock += 1;
        let clock = self.clock;
        let node = self.node_mut(id);
        let old = node.snapshot.replace((snapshot, bytes));
        node.last_used = clock;
        match &old {
            Some((_, b)) => self.bytes -= b,
            None => self.snapshots += 1,
        }
        self.bytes += bytes;
        Some((id, old.map(|(s, _)| s)))
    }

    /// The tokens from the root to `id`.
    pub fn key_of(&self, mut id: NodeId) -> Vec<u32> {
        let mut parts = Vec::new();
        while id != ROOT {
            let n = self.node(id);
            parts.push(&n.label[..]);
            id = n.parent;
        }
        parts.iter().rev().flat_map(|l| l.iter().copied()).collect()
    }

    /// The snapshot at `id`, if it has one.
    pub fn get(&self, id: NodeId) -> Option<&S> {
        self.nodes.get(id)?.as_ref()?.snapshot.as_ref().map(|(s, _)| s)
    }

    /// The node whose snapshot was used longest ago among those `pick` takes (given the
    /// snapshot and whether the node is pinned).
    pub fn oldest(&self, pick: impl Fn(&S, bool) -> bool) -> Option<NodeId> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(id, n)| {
                let n = n.as_ref()?;
                let (s, _) = n.snapshot.as_ref()?;
                pick(s, n.pins > 0).then_some((n.last_used, id))
            })
            .min()
            .map(|(_, id)| id)
    }

    /// Take the snapshot out of `id` (pinned or not); the nodes left holding nothing go.
    pub fn remove(&mut self, id: NodeId) -> Option<S> {
        let (s, b) = self.nodes.get_mut(id)?.as_mut()?.snapshot.take()?;
        self.bytes -= b;
        self.snapshots -= 1;
        self.prune(id);
        Some(s)
    }

    /// Put `snapshot` (of `bytes`) in place of the one at `id` (given back), keeping when it was
    /// last used: the same state kept elsewhere.
    pub fn replace(&mut self, id: NodeId, snapshot: S, bytes: usize) -> Option<S> {
        let node = self.nodes.get_mut(id)?.as_mut()?;
        let (old, b) = node.snapshot.replace((snapshot, bytes))?;
        self.bytes = self.bytes - b + bytes;
        Some(old)
    }

    /// A node that must not be evicted while its user holds it (pins count).
    pub fn pin(&mut self, id: NodeId) {
        self.node_mut(id).pins += 1;
    }

    pub fn is_pinned(&self, id: NodeId) -> bool {
        self.node(id).pins > 0
    }

    pub fn unpin(&mut self, id: NodeId) {
        let node = self.node_mut(id);
        assert!(node.pins > 0, "unpin of node {id}, which is not pinned");
        node.pins -= 1;
    }

    /// Where a prefill of `tokens` from the snapshot at depth `from` should stop to take
    /// snapshots: where the prompt leaves the tree (a branch point: the tokens before it are
    /// shared with an earlier request, and a third may share them too), every `every` tokens
    /// (0: never), and the prompt's end. Ascending, each past `from`.
    pub fn stops(&self, tokens: &[u32], from: usize, every: usize) -> Vec<usize> {
        let (_, matched, _) = self.walk(tokens);
        let mut stops: Vec<usize> = Vec::new();
        if matched > from && matched < tokens.len() {
            stops.push(matched);
        }
        if let Some(first) = from.checked_div(every) {
            stops.extend((first + 1..).map(|i| i * every).take_while(|&p| p < tokens.len()));
        }
        if tokens.len() > from {
            stops.push(tokens.len());
        }
        stops.sort_unstable();
        stops.dedup();
        stops
    }

    /// Evict snapshots, least recently used first, until their bytes are at most `budget`;
    /// pinned nodes keep theirs. Returns how many were evicted.
    pub fn evict_to(&mut self, budget: usize) -> usize {
        let mut evicted = 0;
        while self.bytes > budget {
            let Some(id) = self.oldest(|_, pinned| !pinned) else { break };
            self.remove(id);
            evicted += 1;
        }
        evicted
    }

    /// Remove `id` and its ancestors while they hold nothing: no snapshot, no children, no pin.
    fn prune(&mut self, mut id: NodeId) {
        while id != ROOT {
            let n = self.node(id);
            if n.snapshot.is_some() || !n.children.is_empty() || n.pins > 0 {
                return;
            }
            let (parent, first) = (n.parent, n.label[0]);
            self.node_mut(parent).children.remove(&first);
            self.nodes[id] = None;
            self.free.push(id);
            id = parent;
        }
    }

    /// Nodes alive (the root included): for tests and metrics.
    pub fn nodes(&self) -> usize {
        self.nodes.len() - self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random prompts that share prefixes: each starts as a copy of part of an earlier one
    /// and goes on with tokens of its own, from a small vocabulary (so that paths also meet
    /// by chance).
    fn prompts(seed: &mut u64, n: usize) -> Vec<Vec<u32>> {
        let mut next = || {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (*seed >> 33) as usize
        };
        let mut out: Vec<Vec<u32>> = Vec::new();
        for _ in 0..n {
            let mut p = if out.is_empty() || next() % 5 == 0 {
                Vec::new()
            } else {
                let base = &out[next() % out.len()];
                base[..next() % (base.len() + 1)].to_vec()
            };
            let extra = 1 + next() % 40;
            p.extend((0..extra).map(|_| (next() % 6) as u32));
            out.push(p);
        }
        out
    }

    /// The value a snapshot of `tokens` holds in the tests: the tokens themselves, so that a
    /// snapshot found for the wrong prefix shows.
    #[test]
    fn lookups_find_the_deepest_snapshot_on_the_path_as_a_plain_search_does() {
        let mut seed = 42;
        for round in 0..20 {
            let ps = prompts(&mut seed, 60);
            let mut tree: PrefixTree<Vec<u32>> = PrefixTree::new();
            let mut kept: Vec<Vec<u32>> = Vec::new();
            for (i, p) in ps.iter().enumerate() {
                // Snapshots at the end and at a point part way, as a prefill would take them.
                for cut in [p.len(), (p.len() * (i % 3 + 1)) / 4] {
                    if cut > 0 {
                        tree.insert(&p[..cut], p[..cut].to_vec(), cut);
                        kept.push(p[..cut].to_vec());
                    }
                }
            }
            kept.sort();
            kept.dedup();
            assert_eq!(tree.snapshots(), kept.len(), "round {round}");
            assert_eq!(tree.bytes(), kept.iter().map(|k| k.len()).sum::<usize>());
            for q in prompts(&mut seed, 80).iter().chain(&ps) {
                let m = tree.lookup(q);
                let ideal = ps.iter().map(|p| p.iter().zip(q).take_while(|(a, b)| a == b).count()).max().unwrap();
                let deepest = kept.iter().filter(|k| k.len() <= m.matched && q.starts_with(k)).map(|k| k.len()).max();
                assert_eq!(m.matched, ideal, "round {round}: {q:?}");
                assert_eq!(m.snapshot.as_ref().map(|s| s.1), deepest, "round {round}: {q:?}");
                if let Some((_, depth, value)) = m.snapshot {
                    assert_eq!(value, q[..depth], "the snapshot found is of another prefix");
                }
            }
        }
    }

    #[test]
    fn eviction_goes_least_recently_used_first_spares_pins_and_prunes() {
        let mut tree: PrefixTree<u32> = PrefixTree::new();
        let (a, _) = tree.insert(&[1, 2, 3], 3, 10).unwrap();
        tree.insert(&[1, 2, 4], 4, 10).unwrap();
        tree.insert(&[1, 2], 2, 10).unwrap();
        tree.insert(&[7], 7, 10).unwrap();
        assert_eq!(tree.lookup(&[1, 2, 4, 9]).snapshot.map(|s| s.2), Some(4));
        tree.pin(a);
        // Least recently used: [1, 2, 3] (pinned: kept), then [1, 2], then [7].
        assert_eq!(tree.evict_to(20), 2);
        assert_eq!((tree.bytes(), tree.snapshots()), (20, 2));
        assert_eq!(tree.lookup(&[1, 2, 9]).snapshot, None, "[1, 2] was evicted");
        assert_eq!(tree.lookup(&[7, 7]).snapshot, None);
        assert_eq!(tree.lookup(&[1, 2, 3]).snapshot.map(|s| s.2), Some(3));
        // The [7] branch is gone; the node of [1, 2] stays while its children hold snapshots.
        assert_eq!(tree.lookup(&[7]).matched, 0);
        tree.unpin(a);
        assert_eq!(tree.evict_to(0), 2);
        assert_eq!((tree.bytes(), tree.snapshots(), tree.nodes()), (0, 0, 1), "everything pruned back to the root");
    }

    #[test]
    fn a_prefill_stops_where_the_prompt_leaves_the_tree_every_n_tokens_and_at_its_end() {
        let mut tree: PrefixTree<u32> = PrefixTree::new();
        let shared: Vec<u32> = (0..10).collect();
        let mut first = shared.clone();
        first.extend([50, 51, 52]);
        tree.insert(&first, 0, 1);
        let mut second = shared.clone();
        second.extend([60, 61, 62, 63, 64]);
        // From scratch: the branch point 10, every 4 tokens, the end.
        assert_eq!(tree.stops(&second, 0, 4), vec![4, 8, 10, 12, 15]);
        // From a snapshot at 10 (none at the branch needed), no periodic stops.
        assert_eq!(tree.stops(&second, 10, 0), vec![15]);
        // A prompt the tree holds whole: only its end.
        assert_eq!(tree.stops(&first[..7], 0, 0), vec![7]);
        // The snapshot taken at the branch point is found by a third prompt.
        tree.insert(&second[..10], 10, 1);
        let mut third = shared.clone();
        third.push(70);
        assert_eq!(tree.lookup(&third).snapshot.map(|s| s.1), Some(10));
    }
}
