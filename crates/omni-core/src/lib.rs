//! EngineCore, Scheduler, KV cache manager: the engine's brain, with no device code.
//!
//! Layer L2: depends on `omni-protocol` and `omni-ipc`; no model or GPU code lives here. The
//! [`Executor`] trait is the seam to whatever runs the model: [`UniprocExecutor`] drives an
//! in-process [`omni_protocol::WorkerBase`], [`MultiprocExecutor`] spawns one worker process per rank
//! and talks to them over `omni-ipc`. [`EngineLoop`] runs the busy loop on its own thread;
//! [`EngineClient`] is the handle servers and offline inference use.
//!
//! - [`BlockPool`]: KV blocks with reference counts, an LRU free queue and the prefix-cache map.
//! - [`KvCacheManager`]: per-request block tables, prefix caching by chained block hash.
//! - [`Scheduler`]: continuous batching with chunked prefill and preemption by recompute.
//! - [`EngineCore`]: `add_request`, `abort`, `step`.
//! - [`engine_loop`]: the busy-loop thread and its client handle.
//!
//! ```
//! use omni_core::{EngineCore, EngineError, Executor, SchedulerConfig};
//! use omni_protocol::{EngineCoreRequest, ModelRunnerOutput, SamplingParams, SchedulerOutput};
//!
//! /// Always samples token 7.
//! struct Sevens;
//! impl Executor for Sevens {
//!     fn execute_model(
//!         &mut self,
//!         so: &SchedulerOutput,
//!         _buffers: &[&[u8]],
//!     ) -> Result<ModelRunnerOutput, EngineError> {
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
mod engine_core;
pub mod engine_loop;
mod executor;
mod kv_cache_manager;
mod request;
mod scheduler;

pub use block_pool::{BlockAllocError, BlockHash, BlockPool, hash_block_tokens};
pub use config::{SchedulerConfig, SchedulerConfigError};
pub use engine_core::EngineCore;
pub use engine_loop::{EngineClient, EngineLoop, RequestError, RequestOutput, RequestStream};
pub use executor::{
    DEFAULT_KV_CACHE_MEMORY_BYTES, EngineError, Executor, ExecutorStartError, MultiprocConfig,
    MultiprocExecutor, StartupSpec, UniprocExecutor, plan_num_blocks,
};
pub use kv_cache_manager::{ComputedBlocks, KvCacheManager};
pub use request::{Request, RequestStatus};
pub use scheduler::{AddRequestError, Scheduler};
