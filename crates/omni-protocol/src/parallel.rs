//! Where the ranks of one engine run, and how their peer queues are named (vLLM's
//! `ParallelConfig` ranks: `rank = pp_rank * tp_size + tp_rank`, nodes holding consecutive
//! ranks; node 0 runs the engine core).
//!
//! A rank reaches its peers over `omni-ipc` queues it writes itself, whose handles go out in its
//! [`crate::WorkerHello`] and come back to every rank in [`WorkerPeers`]:
//!
//! - `pp_send`: its activations to the same TP rank of the next pipeline stage (one reader);
//! - `tp_gather`: its partial sums to the other ranks of its tensor-parallel group, when that
//!   group spans nodes (on one node the group shares an all-reduce segment instead).
//!
//! A queue's readers on the writer's node attach through shared memory, the others over TCP;
//! [`ParallelLayout::reader_id`] numbers each class in rank order, the same on both sides.

use std::ops::Range;

use omni_ipc::{Handle, ReaderId};
use serde::{Deserialize, Serialize};

/// The ranks of an engine: their tensor- and pipeline-parallel coordinates and their nodes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParallelLayout {
    /// Ranks per pipeline stage.
    pub tensor_parallel_size: u32,
    /// Pipeline stages.
    pub pipeline_parallel_size: u32,
    /// The node of each rank (index = rank); node 0 runs the engine core.
    pub node_of_rank: Vec<u32>,
}

impl ParallelLayout {
    /// `tp * pp` ranks on one node.
    pub fn single_node(tp: u32, pp: u32) -> Self {
        Self::across_nodes(tp, pp, 1)
    }

    /// `tp * pp` ranks over `nnodes` nodes, consecutive ranks per node (vLLM's
    /// `local_world_size * node_rank + local_rank`); `tp * pp` must be a multiple of `nnodes`.
    pub fn across_nodes(tp: u32, pp: u32, nnodes: u32) -> Self {
        let world = (tp.max(1) * pp.max(1)) as usize;
        let per_node = world.div_ceil(nnodes.max(1) as usize);
        Self {
            tensor_parallel_size: tp.max(1),
            pipeline_parallel_size: pp.max(1),
            node_of_rank: (0..world).map(|r| (r / per_node) as u32).collect(),
        }
    }

    /// All ranks.
    pub fn world(&self) -> usize {
        self.node_of_rank.len()
    }

    fn tp(&self) -> usize {
        self.tensor_parallel_size.max(1) as usize
    }

    /// `rank`'s index in its tensor-parallel group.
    pub fn tp_rank(&self, rank: usize) -> usize {
        rank % self.tp()
    }

    /// `rank`'s pipeline stage.
    pub fn pp_rank(&self, rank: usize) -> usize {
        rank / self.tp()
    }

    /// The rank that answers with the step's output: TP rank 0 of the last stage.
    pub fn output_rank(&self) -> usize {
        (self.pipeline_parallel_size.max(1) as usize - 1) * self.tp()
    }

    /// The ranks of `rank`'s tensor-parallel group (its pipeline stage).
    pub fn tp_group(&self, rank: usize) -> Range<usize> {
        let start = self.pp_rank(rank) * self.tp();
        start..start + self.tp()
    }

    /// The same TP rank in the previous stage.
    pub fn prev_stage(&self, rank: usize) -> Option<usize> {
        rank.checked_sub(self.tp())
    }

    /// The same TP rank in the next stage.
    pub fn next_stage(&self, rank: usize) -> Option<usize> {
        Some(rank + self.tp()).filter(|&r| r < self.world())
    }

    /// `rank`'s node.
    pub fn node(&self, rank: usize) -> u32 {
        self.node_of_rank.get(rank).copied().unwrap_or(0)
    }

    /// Ranks on node `node`.
    pub fn ranks_on(&self, node: u32) -> Vec<usize> {
        (0..self.world())
            .filter(|&r| self.node(r) == node)
            .collect()
    }

    /// Nodes in the layout.
    pub fn nnodes(&self) -> u32 {
        self.node_of_rank.iter().max().map_or(1, |n| n + 1)
    }

    /// Whether `rank`'s tensor-parallel group is on one node (it shares an all-reduce segment)
    /// or spans nodes (its ranks exchange partial sums over `tp_gather` queues).
    pub fn tp_group_on_one_node(&self, rank: usize) -> bool {
        let node = self.node(rank);
        self.tp_group(rank).all(|r| self.node(r) == node)
    }

    /// The id of `reader` on a queue written on node `writer_node` for `readers` (in rank
    /// order): readers on that node are local readers, the others remote, each class numbered
    /// in rank order. `None` when `reader` is not among `readers`.
    pub fn reader_id(
        &self,
        writer_node: u32,
        readers: &[usize],
        reader: usize,
    ) -> Option<ReaderId> {
        let local = self.node(reader) == writer_node;
        let i = readers
            .iter()
            .filter(|&&r| (self.node(r) == writer_node) == local)
            .position(|&r| r == reader)?;
        Some(if local {
            ReaderId::Local(i)
        } else {
            ReaderId::Remote(i)
        })
    }

    /// `(local, remote)` reader counts of a queue written on `writer_node` for `readers`.
    pub fn reader_counts(&self, writer_node: u32, readers: &[usize]) -> (usize, usize) {
        let local = readers
            .iter()
            .filter(|&&r| self.node(r) == writer_node)
            .count();
        (local, readers.len() - local)
    }

    /// The other ranks of `rank`'s tensor-parallel group: the readers of its `tp_gather` queue.
    pub fn tp_peers(&self, rank: usize) -> Vec<usize> {
        self.tp_group(rank).filter(|&r| r != rank).collect()
    }
}

/// The queues one rank writes to its peers (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PeerQueues {
    /// Activations to the next pipeline stage.
    pub pp_send: Option<Handle>,
    /// Partial sums to the rest of a tensor-parallel group that spans nodes.
    pub tp_gather: Option<Handle>,
}

/// The second line a worker reads from its stdin, once every rank has said hello: every rank's
/// [`PeerQueues`], by rank.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerPeers {
    /// Index = rank.
    pub peers: Vec<PeerQueues>,
}

/// The first line a follower node (`serve --headless --node-rank N`) sends on the master
/// rendezvous connection: who it is and the layout it was started with (the leader refuses a
/// mismatch).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeJoin {
    /// The follower's [`crate::PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// Its `--node-rank`.
    pub node_rank: u32,
    /// Its `--nnodes`.
    pub nnodes: u32,
    /// Its `-tp`.
    pub tensor_parallel_size: u32,
    /// Its `-pp`.
    pub pipeline_parallel_size: u32,
    /// The launcher's pid (logs).
    pub pid: u32,
}

/// The leader's answer to a [`NodeJoin`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum NodeAssignment {
    /// Start these workers: one handshake per rank of the node (its `parent_pid` is the
    /// follower's to fill in), after creating the node's all-reduce segments (the handshakes
    /// name them) of `all_reduce_segment_bytes` each.
    Workers {
        /// The engine instance (segment names).
        instance: String,
        /// By rank.
        handshakes: Vec<crate::WorkerHandshake>,
        /// Size of each all-reduce segment.
        all_reduce_segment_bytes: usize,
    },
    /// The join was refused (a layout or version mismatch, a duplicate node rank).
    Refused {
        /// Why.
        message: String,
    },
}

/// A follower's hellos, once every worker of the node answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeHellos {
    /// By rank.
    pub hellos: Vec<crate::WorkerHello>,
}

/// What the leader sends a follower after the hellos.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum LeaderMessage {
    /// Every rank's peer queues, for the node's workers.
    Peers(WorkerPeers),
    /// The engine is shutting down: stop the workers and exit.
    Shutdown,
}

/// What a follower reports after start-up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum NodeEvent {
    /// A worker of the node died: the follower stops the others and exits non-zero.
    WorkerDied {
        /// Its rank.
        rank: u32,
        /// How it ended (exit status, signal).
        cause: String,
    },
    /// The follower failed for another reason.
    Failed {
        /// Why.
        message: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_follow_vllm_order_and_nodes_hold_consecutive_ranks() {
        let l = ParallelLayout::across_nodes(2, 2, 2);
        assert_eq!(l.node_of_rank, vec![0, 0, 1, 1]);
        assert_eq!((l.tp_rank(3), l.pp_rank(3)), (1, 1));
        assert_eq!(l.output_rank(), 2);
        assert_eq!(l.tp_group(1), 0..2);
        assert_eq!((l.prev_stage(2), l.next_stage(1)), (Some(0), Some(3)));
        assert_eq!((l.prev_stage(1), l.next_stage(3)), (None, None));
        assert!(l.tp_group_on_one_node(0) && l.tp_group_on_one_node(3));
        let tp_across = ParallelLayout::across_nodes(2, 1, 2);
        assert!(!tp_across.tp_group_on_one_node(0));
        assert_eq!(tp_across.nnodes(), 2);
    }

    #[test]
    fn reader_ids_number_local_and_remote_readers_apart() {
        let l = ParallelLayout::across_nodes(4, 1, 2); // ranks 0,1 on node 0; 2,3 on node 1
        let all = [0, 1, 2, 3];
        assert_eq!(l.reader_counts(0, &all), (2, 2));
        assert_eq!(l.reader_id(0, &all, 1), Some(ReaderId::Local(1)));
        assert_eq!(l.reader_id(0, &all, 2), Some(ReaderId::Remote(0)));
        assert_eq!(l.reader_id(0, &all, 3), Some(ReaderId::Remote(1)));
        // Rank 2 writes to 0, 1, 3: 3 is local to it, 0 and 1 remote.
        let peers = l.tp_peers(2);
        assert_eq!(peers, vec![0, 1, 3]);
        assert_eq!(l.reader_id(1, &peers, 3), Some(ReaderId::Local(0)));
        assert_eq!(l.reader_id(1, &peers, 1), Some(ReaderId::Remote(1)));
        assert_eq!(l.reader_id(1, &peers, 2), None);
    }
}
