//! The worker process: [`Worker`] (one tensor-parallel rank's command handler), its
//! [`ModelRunner`] (per-request state, KV cache, batching, sampling), the host [`sampler`] it
//! falls back to (vLLM keeps it in `v1/sample/`), and [`ShmAllReduce`] (the tensor-parallel
//! all-reduce between worker processes over shared memory). Multimodal requests keep their
//! items and the encoder cache in the runner (`mm_inputs`): the scheduler says which items to
//! encode each step and which outputs to free.
//!
//! Layer L3: links the models (L2) and talks to the engine core only over `omni-ipc`: it reads
//! [`omni_protocol::WorkerCommand`]s from the engine's broadcast queue and writes
//! [`omni_protocol::WorkerResponse`]s to its own response queue ([`run_worker_process`]). The same
//! [`Worker`] also runs in-process behind `omni_core::UniprocExecutor`, through the
//! [`omni_protocol::WorkerBase`] trait; this crate does not link the engine core.
//!
//! ```no_run
//! use std::sync::Arc;
//! use omni_protocol::{LoadFormat, LoadModelSpec, WorkerCommand};
//! use omni_worker::Worker;
//!
//! let mut worker = Worker::in_process(0, Arc::new(omni_models::IdentityAllReduce));
//! let spec = LoadModelSpec { model: "path/to/SmolLM2-135M".into(), load_format: LoadFormat::Auto,
//!     ..LoadModelSpec::default() };
//! let loaded = worker.handle(&WorkerCommand::LoadModel(spec));
//! let ready = worker.handle(&WorkerCommand::InitCache { num_blocks: 256, block_size: 16 });
//! ```

#![cfg_attr(test, allow(clippy::unwrap_used))]

#[cfg(feature = "cuda")]
pub mod cuda_group;
#[cfg(feature = "cuda")]
pub mod cuda_model;
pub mod load_progress;
pub mod mm_inputs;
pub mod model_runner;
pub mod peers;
pub mod process;
pub mod sampler;
pub mod shm_all_reduce;
pub mod step_model;
pub mod step_timing;
pub mod worker;

pub use load_progress::LoadProgress;
pub use model_runner::{EncoderStats, ModelRunner};
pub use process::{WorkerProcessError, run_worker_process};
pub use shm_all_reduce::{ShmAllReduce, ShmAllReduceError};
pub use step_model::{CpuStepModel, DeviceSample, StepModel};
pub use worker::{Worker, load_model, load_model_with_progress};

/// Why a worker command failed (sent to the engine core as [`omni_protocol::WorkerResponse::Error`]).
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A command that needs the model came before `LoadModel`.
    #[error("no model loaded")]
    NotLoaded,
    /// The model could not be loaded as asked.
    #[error("load model: {0}")]
    Load(String),
    /// Building or running the model failed.
    #[error(transparent)]
    Model(#[from] omni_models::ModelError),
    /// Reading weights failed.
    #[error(transparent)]
    Weight(#[from] omni_models::weights::WeightError),
    /// Sampling failed.
    #[error(transparent)]
    Sampler(#[from] crate::sampler::SamplerError),
    /// The KV cache is missing or misconfigured.
    #[error("kv cache: {0}")]
    Cache(String),
    /// A scheduled request is unknown to this worker.
    #[error("unknown request {0:?}")]
    UnknownRequest(String),
    /// The scheduler output is inconsistent with this worker's state.
    #[error("batch: {0}")]
    Batch(String),
    /// The all-reduce segment could not be opened.
    #[error(transparent)]
    AllReduce(#[from] ShmAllReduceError),
    /// A pipeline or all-reduce link to a peer rank failed.
    #[error(transparent)]
    Peers(#[from] crate::peers::PeerLinkError),
    /// A tensor of the batch does not match the message's buffers.
    #[error(transparent)]
    Tensor(#[from] omni_protocol::TensorBufferError),
}

/// Set to `1`, CUDA ranks beyond a node's device count share its devices round-robin instead of
/// failing (pipeline stages tested on one GPU; NCCL still needs one device per rank of a
/// tensor-parallel group).
pub const SHARE_DEVICES_ENV: &str = "OMNI_CUDA_SHARE_DEVICES";

/// Whether [`SHARE_DEVICES_ENV`] is set to `1`.
pub fn share_devices() -> bool {
    std::env::var(SHARE_DEVICES_ENV).is_ok_and(|v| v == "1")
}
