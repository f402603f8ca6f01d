//! Every type that crosses a process boundary, versioned and checked at handshake.
//!
//! Layer L0 (above `omni-ipc`, whose queue handles the handshake carries): plain serde types
//! and no engine logic. The IPC layer (`omni-ipc`) encodes them with
//! bincode 2 (`bincode::serde::encode_to_vec(.., bincode::config::standard())`); large tensors
//! (multimodal features, hidden states) do not go through serde at all: they travel as out-of-band
//! byte buffers of the same IPC message, and the serde header only names them with [`TensorRef`]s.
//!
//! Who sends what:
//!
//! ```text
//! omni-api ──EngineCoreInput(EngineCoreRequest | Abort)──▶ omni-engine-core
//! omni-api ◀──────────EngineCoreOutputs───────────────── omni-engine-core
//! omni-engine-core ──WorkerCommand (1 -> N broadcast)──▶ omni-worker-<rank>
//! omni-engine-core ◀──WorkerResponse (one queue/rank)─── omni-worker-<rank>
//! ```
//!
//! The first two lines are a pair of `MessageQueue`s with one reader each when the engine core
//! runs in a process of its own; in-process the same two types go over a channel and a direct
//! call. Refusals ([`AddRequestError`]) and the engine's death ([`EngineDeadError`]) ride in
//! [`EngineCoreOutputs`].
//!
//! A worker process starts with a [`WorkerHandshake`] / [`WorkerHello`] JSON line pair on its
//! stdin and stdout ([`handshake`]), which names those queues; an engine-core process with an
//! [`EngineCoreHandshake`] (the resolved engine config inside) / [`EngineCoreStartup`] pair.
//! Both ends of every connection
//! exchange [`PROTOCOL_VERSION`] first and refuse a peer whose version differs
//! ([`check_protocol_version`]). [`WorkerBase`] is what an executor drives on the other side.
//!
//! ```
//! use omni_protocol::{EngineCoreRequest, SamplingParams, WorkerCommand, PROTOCOL_VERSION};
//!
//! omni_protocol::check_protocol_version(PROTOCOL_VERSION).unwrap();
//! let params = SamplingParams { temperature: 0.0, max_tokens: Some(8), ..Default::default() };
//! params.validate().unwrap();
//! let req = EngineCoreRequest::new("req-0", vec![1, 2, 3], params, Some(2));
//! assert_eq!(req.prompt_token_ids.len(), 3);
//! let cmd = WorkerCommand::InitCache { num_blocks: 1024, block_size: 16 };
//! assert!(matches!(cmd, WorkerCommand::InitCache { .. }));
//! ```

#![cfg_attr(test, allow(clippy::unwrap_used))]

mod error;
pub mod handshake;
mod mm;
mod omni;
mod output;
mod parallel;
mod request;
mod sampling;
mod scheduler_output;
mod stage;
mod tensor;
mod worker;

pub use error::{AddRequestError, EngineDeadError};
pub use handshake::{
    EngineCoreHandshake, EngineCoreReady, EngineCoreStartup, WorkerHandshake, WorkerHello,
};
pub use mm::{MmKind, MultiModalFeatureSpec, TensorBuffers};
pub use omni::{AudioOutput, Modality, OmniParams};
pub use output::{EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats, StopReason};
pub use parallel::{
    LeaderMessage, NodeAssignment, NodeEvent, NodeHellos, NodeJoin, ParallelLayout, PeerQueues,
    WorkerPeers,
};
pub use request::{EngineCoreInput, EngineCoreRequest};
pub use sampling::{SamplingParams, SamplingParamsError};
pub use scheduler_output::{CachedRequestData, NewRequestData, SchedulerOutput};
pub use stage::{
    CodecChunk, CodecWindowing, PipelineStats, STAGE_PACK_BYTES, StageInput, StageKind,
    StageOutputs, StagePayloadError, StageSpec, TextDelta, ThinkerChunk, ThinkerStates,
    ThinkerStatesView, ThinkerToTalker, pack_thinker_chunks, rebase_buffers,
};
pub use tensor::{DType, TensorBufferError, TensorRef, TensorView};
pub use worker::{
    Device, LoadFormat, LoadModelSpec, Logprob, ModelRunnerOutput, TokenLogprobs, WorkerBase,
    WorkerCommand, WorkerCommandRef, WorkerResponse,
};

/// Version of every message in this crate. Bump it on any change to a type's serde shape: bincode
/// is not self-describing, so peers of different versions would misread each other silently.
pub const PROTOCOL_VERSION: u32 = 14;

/// A request's id, unique among live requests (the API server makes it, e.g. `chatcmpl-<uuid>`).
pub type RequestId = String;

/// A token id of the model's vocabulary.
pub type TokenId = u32;

/// Index of a KV cache block in the workers' KV cache tensors (`0..num_blocks`).
pub type BlockId = u32;

/// The peer's [`PROTOCOL_VERSION`] differs from ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("protocol version mismatch: peer speaks {peer}, this build speaks {ours}")]
pub struct ProtocolVersionError {
    /// Version the peer announced.
    pub peer: u32,
    /// This build's [`PROTOCOL_VERSION`].
    pub ours: u32,
}

/// Checks a peer's announced protocol version at handshake.
pub fn check_protocol_version(peer: u32) -> Result<(), ProtocolVersionError> {
    if peer == PROTOCOL_VERSION {
        Ok(())
    } else {
        Err(ProtocolVersionError {
            peer,
            ours: PROTOCOL_VERSION,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshake_accepts_same_version_and_rejects_other() {
        assert!(check_protocol_version(PROTOCOL_VERSION).is_ok());
        let err = check_protocol_version(PROTOCOL_VERSION + 1).unwrap_err();
        assert_eq!(err.peer, PROTOCOL_VERSION + 1);
        assert!(err.to_string().contains("mismatch"));
    }
}
