//! EngineCore, Scheduler, KV cache manager: the engine's brain, with no device code.
//!
//! Layer L2: depends on `omni-protocol` and `omni-ipc`; no model or GPU code lives here. The
//! [`Executor`] trait is the seam to whatever runs the model: [`UniprocExecutor`] drives an
//! in-process [`omni_protocol::WorkerBase`], [`MultiprocExecutor`] spawns one worker process per rank
//! and talks to them over `omni-ipc`. [`EngineCoreClient`] is the seam to whatever runs the
//! engine core: [`InprocClient`] runs its busy loop on a thread of this process, [`MpClient`] in
//! a process of its own ([`EngineCoreProc`], `omni-engine-core`) over a pair of `MessageQueue`s.
//! Servers and offline inference hold an `Arc<dyn EngineCoreClient>` and do not care which.
//!
//! - [`BlockPool`]: KV blocks with reference counts, an LRU free queue and the prefix-cache map.
//! - [`KvCacheManager`]: per-request block tables, prefix caching by chained block hash.
//! - [`Scheduler`]: continuous batching with chunked prefill and preemption by recompute.
//! - [`EncoderCacheManager`]: which multimodal items the workers encode in a step and keep
//!   in their encoder caches (budget in embeddings, one encode per content hash).
//! - [`EngineCore`]: `add_request`, `abort`, `step`.
//! - [`connector`]: what flows between omni stages ([`connector::CodecChunker`]: Talker frames
//!   into Code2Wav windows).
//! - `engine_loop`: the busy loop, and [`InprocClient`]; `engine_core_proc` / `mp_client`: the
//!   two ends of the engine-core process; `engine_core_client`: the trait, [`RequestStream`] and
//!   the frontend that routes outputs to requests.
//!
//! ```
//! use omni_core::{EngineCore, EngineDeadError, Executor, SchedulerConfig};
//! use omni_protocol::{EngineCoreRequest, ModelRunnerOutput, SamplingParams, SchedulerOutput};
//!
//! /// Always samples token 7.
//! struct Sevens;
//! impl Executor for Sevens {
//!     fn execute_model(
//!         &mut self,
//!         so: &SchedulerOutput,
//!         _buffers: &[&[u8]],
//!     ) -> Result<ModelRunnerOutput, EngineDeadError> {
//!         let req_ids: Vec<String> = so.num_scheduled_tokens.keys().cloned().collect();
//!         let sampled_token_ids = vec![vec![7]; req_ids.len()];
//!         Ok(ModelRunnerOutput { req_ids, sampled_token_ids, ..Default::default() })
//!     }
//! }
//!
//! let mut core = EngineCore::new(SchedulerConfig::default(), Sevens).unwrap();
//! core.add_request(EngineCoreRequest::new("r0", vec![1, 2, 3], SamplingParams::greedy(3), None))
//!     .unwrap();
//! let mut tokens = Vec::new();
//! while core.has_unfinished_requests() {
//!     for out in core.step().unwrap() {
//!         tokens.extend(out.new_token_ids);
//!     }
//! }
//! assert_eq!(tokens, vec![7, 7, 7]);
//! ```

#![cfg_attr(test, allow(clippy::unwrap_used))]

mod block_pool;
mod config;
pub mod connector;
mod encoder_cache_manager;
mod engine_core;
mod engine_core_client;
mod engine_core_proc;
mod engine_loop;
mod executor;
mod kv_cache_manager;
mod mp_client;
mod omni_pipeline;
mod request;
mod scheduler;
mod stage_client;

pub use block_pool::{
    BlockAllocError, BlockHash, BlockPool, hash_block_tokens, hash_block_tokens_with_keys,
};
pub use config::{SchedulerConfig, SchedulerConfigError};
pub use encoder_cache_manager::{EncoderCacheManager, EncoderPlan};
pub use engine_core::EngineCore;
pub use engine_core_client::{EngineCoreClient, RequestError, RequestOutput, RequestStream};
pub use engine_core_proc::{ENGINE_CORE_PROCESS_NAME, EngineCoreProc, EngineCoreProcError};
pub use engine_loop::{HEALTH_CHECK_INTERVAL, InprocClient};
pub use executor::{
    DEFAULT_KV_CACHE_MEMORY_BYTES, EngineDeadError, Executor, ExecutorStartError, HeadlessConfig,
    HeadlessError, MultiprocConfig, MultiprocExecutor, NodeConfig, StartupSpec, UniprocExecutor,
    plan_num_blocks, run_headless,
};
pub use kv_cache_manager::{ComputedBlocks, KvCacheManager};
pub use mp_client::{EngineCoreStartError, MpClient, MpClientConfig};
pub use omni_pipeline::{OmniPipeline, OmniPipelineConfig};
pub use request::{Request, RequestStatus};
pub use scheduler::{AddRequestError, Scheduler};
pub use stage_client::{StageClient, StageDeathHandler, StageOutputHandler};
