//! Engine configuration: [`EngineConfig`] and its layering.
//!
//! Layer L1 (depends on omni-ipc only, for the queue's config type). An engine's every setting
//! is a field of one [`EngineConfig`] part (model, cache, parallel, scheduler, device, ipc),
//! and the API server's are [`FrontendConfig`]'s (kept out of the engine config, which every
//! stage and child process receives),
//! each a clap argument group and a serde struct, with its default written once (in the clap
//! attribute). Precedence is defaults < `--config FILE` (YAML; keys are the long flag names, as
//! in vLLM) < environment < command line: [`layered_argv`] turns the file and the environment
//! into flags placed before the command line, and clap parses everything once. The binary then
//! validates once ([`EngineConfig::validate`], every problem together), logs the result, and
//! hands the resolved parts to each child process in its handshake (children never re-read the
//! environment).
//!
//! Every environment variable the engine reads is in [`ENV_FLAGS`], beside the flag it sets.
//! `VLLM_MQ_MAX_CHUNK_BYTES_MB` keeps vLLM's name because users tune it by that name; our own
//! variables are `OMNI_<AREA>_<NAME>`.
//!
//! ```
//! let mut c = omni_config::EngineConfig::default();
//! assert_eq!(c.ipc.broadcast().max_chunk_bytes, 16 << 20);
//! c.cache.gpu_memory_utilization = 2.0;
//! assert!(c.validate().unwrap_err().to_string().contains("gpu-memory-utilization"));
//! ```

mod deploy;
mod engine;
mod frontend;
mod layers;
mod media;

pub use deploy::{
    CodecChunking, ConnectorConfig, DEFAULT_PROFILES, DeployConfig, DeployOverrides, DeploySource,
    OmniArgs, StageDeployConfig, TEXT_SPEECH_PROFILE,
};
pub use engine::{
    CacheConfig, DeviceConfig, DeviceKind, Dtype, EngineConfig, ExecutorKind, IpcConfig,
    LoadFormat, ModelConfig, ParallelConfig, SchedulerConfig, parse_bytes,
};
pub use frontend::FrontendConfig;
pub use layers::{ENV_FLAGS, layered_argv, layered_argv_with, override_self};
pub use media::{DEFAULT_MM_LIMIT, MediaConfig, MmLimits, parse_mm_limits};

/// Configuration errors; all problems are reported together.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Values that parse but do not make sense, or environment values that do not parse.
    #[error("invalid configuration: {}", .0.join("; "))]
    Invalid(Vec<String>),
    /// A `--config` file that cannot be read, is not YAML, or names unknown flags.
    #[error("config file {}: {message}", path.display())]
    ConfigFile {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong (every problem).
        message: String,
    },
}
