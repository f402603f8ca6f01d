//! Engine core <-> worker messages: typed commands down, typed responses up.

use serde::{Deserialize, Serialize};

use crate::{DType, RequestId, SchedulerOutput, TensorRef, TokenId};

/// Where the weights come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LoadFormat {
    /// Pick from the files found at `model`.
    Auto,
    /// HF safetensors files.
    Safetensors,
    /// A GGUF file.
    Gguf,
    /// Random weights of the right shapes (benchmarks, tests).
    Dummy,
}

/// Which backend a worker runs the model on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Device {
    /// The CPU backend (f32).
    #[default]
    Cpu,
    /// One CUDA GPU per rank (bf16), device ordinal = rank.
    Cuda,
}

/// Everything a worker needs to load its shard of the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadModelSpec {
    /// A local path (directory or file).
    pub model: String,
    /// Weight format.
    pub load_format: LoadFormat,
    /// Compute dtype; `None` takes the checkpoint's.
    pub dtype: Option<DType>,
    /// Longest sequence (prompt + output) the engine will schedule.
    pub max_model_len: u32,
    /// Tokens per KV block, so the worker can report `kv_bytes_per_block`.
    pub block_size: u32,
    /// Fraction of device memory the worker may use in total.
    pub gpu_memory_utilization: f32,
    /// Tensor-parallel world size (the worker's rank is its process identity).
    pub tensor_parallel_size: u32,
    /// Pipeline stages (each rank loads its stage's layers).
    pub pipeline_parallel_size: u32,
    /// Seed of the worker's global sampling stream and of dummy weights.
    pub seed: u64,
    /// The backend.
    pub device: Device,
    /// Tokens in one step at most (sizes the GPU's activation buffers).
    pub max_num_batched_tokens: u32,
    /// Sequences in one step at most (sizes the GPU's per-sequence buffers and decode graphs).
    pub max_num_seqs: u32,
    /// No CUDA graphs: every step runs eagerly.
    pub enforce_eager: bool,
    /// Log per-kernel GPU times averaged over this many eager steps (0: off; graphs are off
    /// while profiling). The engine's `--cuda-profile-steps` / `OMNI_CUDA_PROFILE`.
    pub cuda_profile_steps: u32,
}

impl Default for LoadModelSpec {
    fn default() -> Self {
        Self {
            model: String::new(),
            load_format: LoadFormat::Auto,
            dtype: None,
            max_model_len: 2048,
            block_size: 16,
            gpu_memory_utilization: 0.9,
            tensor_parallel_size: 1,
            pipeline_parallel_size: 1,
            seed: 0,
            device: Device::Cpu,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            enforce_eager: false,
            cuda_profile_steps: 0,
        }
    }
}

/// A command broadcast from the engine core to every worker.
///
/// Not boxed: a worker decodes one per step and matches it at once, and the executor sends
/// [`WorkerCommandRef`] (a reference) instead of building one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[allow(clippy::large_enum_variant)]
pub enum WorkerCommand {
    /// Load weights; answered with [`WorkerResponse::ModelLoaded`].
    LoadModel(LoadModelSpec),
    /// Allocate the KV cache; answered with [`WorkerResponse::Ready`].
    InitCache {
        /// Number of KV blocks (the same on every rank).
        num_blocks: u32,
        /// Tokens per block.
        block_size: u32,
    },
    /// Run one step; the output rank answers with [`WorkerResponse::ModelRunnerOutput`].
    ExecuteModel(SchedulerOutput),
    /// Liveness probe; answered with [`WorkerResponse::Ready`].
    Health,
    /// Exit cleanly; no answer.
    Shutdown,
}

/// A [`WorkerCommand`] by reference, for sending: it encodes to the same bytes (serde encodes
/// `&T` as `T`, and the variants are the same, in the same order), so the executor broadcasts a
/// step's [`SchedulerOutput`] without moving or cloning it into a command.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename = "WorkerCommand")]
pub enum WorkerCommandRef<'a> {
    /// [`WorkerCommand::LoadModel`].
    LoadModel(&'a LoadModelSpec),
    /// [`WorkerCommand::InitCache`].
    InitCache {
        /// Number of KV blocks.
        num_blocks: u32,
        /// Tokens per block.
        block_size: u32,
    },
    /// [`WorkerCommand::ExecuteModel`].
    ExecuteModel(&'a SchedulerOutput),
    /// [`WorkerCommand::Health`].
    Health,
    /// [`WorkerCommand::Shutdown`].
    Shutdown,
}

impl WorkerCommand {
    /// This command by reference (see [`WorkerCommandRef`]).
    pub fn as_ref(&self) -> WorkerCommandRef<'_> {
        match self {
            WorkerCommand::LoadModel(spec) => WorkerCommandRef::LoadModel(spec),
            WorkerCommand::InitCache {
                num_blocks,
                block_size,
            } => WorkerCommandRef::InitCache {
                num_blocks: *num_blocks,
                block_size: *block_size,
            },
            WorkerCommand::ExecuteModel(so) => WorkerCommandRef::ExecuteModel(so),
            WorkerCommand::Health => WorkerCommandRef::Health,
            WorkerCommand::Shutdown => WorkerCommandRef::Shutdown,
        }
    }
}

/// One token and its log-probability.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Logprob {
    /// The token.
    pub token_id: TokenId,
    /// Its natural-log probability.
    pub logprob: f32,
}

/// Log-probabilities for one sampled position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// The sampled token and its log-probability.
    pub sampled: Logprob,
    /// 1-based rank of the sampled token among the whole vocabulary (1 = most likely).
    pub rank: u32,
    /// The most likely tokens, most likely first (as many as `SamplingParams::logprobs`).
    pub top: Vec<Logprob>,
}

/// What one step produced (vLLM's `ModelRunnerOutput`). `sampled_token_ids[i]` and `logprobs[i]`
/// belong to `req_ids[i]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelRunnerOutput {
    /// Every request of the batch.
    pub req_ids: Vec<RequestId>,
    /// Tokens sampled per request: one, or none for a partial prefill chunk.
    pub sampled_token_ids: Vec<Vec<TokenId>>,
    /// One entry per sampled token when the request asked for logprobs, else empty.
    pub logprobs: Vec<Vec<TokenLogprobs>>,
    /// Hidden states and other per-request tensors (omni stages); their bytes are
    /// [`Self::buffers`].
    pub tensors: Vec<TensorRef>,
    /// The bytes behind [`Self::tensors`] (`buffer_index` indexes this). Not part of the serde
    /// header: they travel as the response message's out-of-band buffers and the executor puts
    /// them back here.
    #[serde(skip)]
    pub buffers: Vec<Vec<u8>>,
}

/// A worker's answer to a [`WorkerCommand`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum WorkerResponse {
    /// Started (handshake), cache allocated, or healthy.
    Ready {
        /// The answering worker.
        rank: u32,
    },
    /// Weights are loaded and memory was profiled.
    ModelLoaded {
        /// KV cache bytes one block takes on this rank (all layers, K and V).
        kv_bytes_per_block: u64,
        /// Device bytes left for the KV cache on this rank.
        available_memory_bytes: u64,
    },
    /// The result of [`WorkerCommand::ExecuteModel`].
    ModelRunnerOutput(ModelRunnerOutput),
    /// A command failed; the engine core treats the worker as dead.
    Error {
        /// The failing worker.
        rank: u32,
        /// What went wrong.
        message: String,
    },
}

/// One rank's command handler, as an executor drives it (vLLM's `WorkerBase`): in this process
/// (`omni_core::UniprocExecutor`) or behind the queues of a worker process
/// (`omni_worker::process`). `omni_worker::Worker` is the implementation that runs models.
pub trait WorkerBase: Send {
    /// Answers one command; `None` for [`WorkerCommand::Shutdown`] (which has no answer).
    fn handle(&mut self, cmd: &WorkerCommand) -> Option<WorkerResponse>;

    /// Runs one step. `buffers` are the out-of-band buffers of the batch's message, which the
    /// [`TensorRef`]s of `scheduler_output` index (borrowed in place from the ring slot in a
    /// worker process; see [`SchedulerOutput::tensor_views`]). The output rank answers with a
    /// [`ModelRunnerOutput`] whose [`ModelRunnerOutput::buffers`] go back the same way.
    fn execute_model(
        &mut self,
        scheduler_output: &SchedulerOutput,
        buffers: &[&[u8]],
    ) -> WorkerResponse;
}
