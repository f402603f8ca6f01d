//! The stages of an omni pipeline (Qwen3-Omni: Thinker -> Talker -> Code2Wav; a text LLM ->
//! TTS for the built-in voice), each run in a
//! process of its own (`omni-engine stage`, named `omni-stage-<id>[-<replica>]`) by
//! [`run_stage_process`], started and routed by omni-core's `OmniPipeline`.
//!
//! A stage is omni-core's `Scheduler` (Thinker, Talker) or a window batcher (Code2Wav) over its
//! network, which runs in the stage's process on its device; see [`thinker`], [`talker`],
//! [`code2wav`]. Layer L3: it links omni-core (scheduling, the process handshake), omni-models
//! and omni-worker's host sampler.

#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod code2wav;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
mod cuda_mlp;
pub mod nets;
mod process;
pub mod profile;
mod stage;
pub mod talker;
mod tensors;
pub mod text_net;
pub mod thinker;
pub mod tts;

pub use process::{BuiltStage, build_stage, run_stage_process};
pub use stage::{Stage, StepResult};

/// Why a stage failed.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// Its configuration cannot work.
    #[error("stage config: {0}")]
    Config(String),
    /// Loading or running its network failed.
    #[error("stage model: {0}")]
    Model(String),
    /// An input it cannot use.
    #[error("stage input: {0}")]
    Input(String),
    /// The process's handshake or queues failed.
    #[error(transparent)]
    Proc(#[from] omni_core::EngineCoreProcError),
    /// Its queues failed.
    #[error(transparent)]
    Ipc(#[from] omni_ipc::IpcError),
}

impl From<omni_models::ModelError> for StageError {
    fn from(e: omni_models::ModelError) -> Self {
        StageError::Model(e.to_string())
    }
}
