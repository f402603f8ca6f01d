//! The scheduler's part of the engine configuration.

/// Limits of one scheduling step and the shape of the KV cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Token budget of one step, summed over every scheduled request.
    pub max_num_batched_tokens: usize,
    /// Most requests in the running set.
    pub max_num_seqs: usize,
    /// Longest sequence (prompt + output).
    pub max_model_len: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks on each worker (from memory profiling).
    pub num_blocks: usize,
    /// Reuse the KV of full blocks whose chained token hash matches.
    pub enable_prefix_caching: bool,
    /// Split prefills that exceed the step's remaining budget across steps.
    pub enable_chunked_prefill: bool,
    /// Schedule the next step while the current one runs (vLLM's `async_scheduling`): a
    /// request that will sample this step is scheduled again for its next position before
    /// the sampled token is known, and each worker feeds the token it sampled itself. Hides
    /// the scheduler, the output path and the queue hand-off behind the device. Takes effect
    /// only where the executor supports it ([`crate::executor::Executor::supports_async_scheduling`]).
    pub async_scheduling: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            max_model_len: 2048,
            block_size: 16,
            num_blocks: 1024,
            enable_prefix_caching: true,
            enable_chunked_prefill: true,
            async_scheduling: false,
        }
    }
}

/// A [`SchedulerConfig`] under which some request could never be scheduled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerConfigError {
    /// A size that must be positive is zero.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// The KV cache cannot hold one sequence of `max_model_len` tokens.
    #[error(
        "max_model_len {max_model_len} exceeds the KV cache capacity of {capacity} tokens \
         ({num_blocks} blocks x {block_size}); lower max_model_len or give the cache more memory"
    )]
    KvCacheTooSmall {
        /// Configured `max_model_len`.
        max_model_len: usize,
        /// `num_blocks * block_size`.
        capacity: usize,
        /// Configured blocks.
        num_blocks: usize,
        /// Configured block size.
        block_size: usize,
    },
    /// Without chunked prefill, a full-length prompt must fit in one step's budget.
    #[error(
        "max_num_batched_tokens {max_num_batched_tokens} is smaller than max_model_len \
         {max_model_len}; enable chunked prefill or raise the budget"
    )]
    BudgetBelowModelLen {
        /// Configured budget.
        max_num_batched_tokens: usize,
        /// Configured `max_model_len`.
        max_model_len: usize,
    },
}

impl SchedulerConfig {
    /// Checks that every admissible request can eventually run.
    pub fn validate(&self) -> Result<(), SchedulerConfigError> {
        for (name, value) in [
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_num_seqs", self.max_num_seqs),
            ("max_model_len", self.max_model_len),
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
        ] {
            if value == 0 {
                return Err(SchedulerConfigError::Zero(name));
            }
        }
        let capacity = self.num_blocks * self.block_size;
        if capacity < self.max_model_len {
            return Err(SchedulerConfigError::KvCacheTooSmall {
                max_model_len: self.max_model_len,
                capacity,
                num_blocks: self.num_blocks,
                block_size: self.block_size,
            });
        }
        if !self.enable_chunked_prefill && self.max_num_batched_tokens < self.max_model_len {
            return Err(SchedulerConfigError::BudgetBelowModelLen {
                max_num_batched_tokens: self.max_num_batched_tokens,
                max_model_len: self.max_model_len,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid() {
        assert_eq!(SchedulerConfig::default().validate(), Ok(()));
    }

    #[test]
    fn config_rejects_cache_smaller_than_one_sequence() {
        let cfg = SchedulerConfig {
            num_blocks: 4,
            block_size: 16,
            max_model_len: 100,
            ..Default::default()
        };
        assert!(matches!(
            cfg.validate(),
            Err(SchedulerConfigError::KvCacheTooSmall { capacity: 64, .. })
        ));
    }

    #[test]
    fn config_without_chunking_needs_budget_for_a_full_prompt() {
        let cfg = SchedulerConfig {
            enable_chunked_prefill: false,
            max_num_batched_tokens: 512,
            max_model_len: 2048,
            ..Default::default()
        };
        assert!(matches!(
            cfg.validate(),
            Err(SchedulerConfigError::BudgetBelowModelLen { .. })
        ));
    }
}
