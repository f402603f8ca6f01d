//! The one start-up sequence of every executor: `LoadModel` on every rank (each reports the KV
//! bytes of one block and the memory it has left), [`plan_num_blocks`] over the largest block and
//! the smallest budget, then `InitCache` with that many blocks on every rank.

use omni_protocol::{WorkerCommand, WorkerResponse};

use super::{EngineDeadError, ExecutorStartError, StartupSpec, kv_budget_bytes, plan_num_blocks};

/// What start-up decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CacheLayout {
    /// KV blocks allocated on every rank.
    pub num_blocks: u32,
    /// Bytes of one block on the largest rank.
    pub kv_bytes_per_block: u64,
}

/// Runs `LoadModel` -> [`plan_num_blocks`] -> `InitCache` over `collective_rpc`, which sends one
/// command to every rank and returns each rank's answer, by rank (vLLM's `collective_rpc`).
pub(crate) fn load_model_and_init_cache(
    spec: &StartupSpec,
    mut collective_rpc: impl FnMut(&WorkerCommand) -> Result<Vec<WorkerResponse>, EngineDeadError>,
) -> Result<CacheLayout, ExecutorStartError> {
    let mut kv_bytes_per_block = 0u64;
    let mut available = Vec::new();
    for (rank, answer) in collective_rpc(&WorkerCommand::LoadModel(spec.load.clone()))?
        .into_iter()
        .enumerate()
    {
        match answer {
            WorkerResponse::ModelLoaded {
                kv_bytes_per_block: b,
                available_memory_bytes,
            } => {
                kv_bytes_per_block = kv_bytes_per_block.max(b);
                available.push(available_memory_bytes);
            }
            other => return Err(unexpected(rank, "LoadModel", other).into()),
        }
    }
    let num_blocks = plan_num_blocks(
        kv_bytes_per_block,
        kv_budget_bytes(spec, &available),
        spec.num_blocks_override,
    )?;
    let init = WorkerCommand::InitCache {
        num_blocks,
        block_size: spec.load.block_size,
    };
    for (rank, answer) in collective_rpc(&init)?.into_iter().enumerate() {
        match answer {
            WorkerResponse::Ready { .. } => {}
            other => return Err(unexpected(rank, "InitCache", other).into()),
        }
    }
    Ok(CacheLayout {
        num_blocks,
        kv_bytes_per_block,
    })
}

/// The error for an answer that is not the one `what` expects from `rank`: the worker's own
/// message when it answered [`WorkerResponse::Error`].
pub(crate) fn unexpected(rank: usize, what: &str, resp: WorkerResponse) -> EngineDeadError {
    match resp {
        WorkerResponse::Error { rank, message } => EngineDeadError::Worker {
            rank,
            cause: message,
        },
        other => EngineDeadError::Worker {
            rank: rank as u32,
            cause: format!("unexpected answer to {what}: {other:?}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(budget: u64) -> StartupSpec {
        StartupSpec {
            load: omni_protocol::LoadModelSpec::default(),
            kv_cache_memory_bytes: Some(budget),
            num_blocks_override: None,
        }
    }

    #[test]
    fn blocks_follow_the_largest_rank_and_every_rank_gets_init_cache() {
        let mut sent = Vec::new();
        let layout = load_model_and_init_cache(&spec(10_000), |cmd| {
            sent.push(cmd.clone());
            Ok(match cmd {
                WorkerCommand::LoadModel(_) => [100u64, 300]
                    .map(|b| WorkerResponse::ModelLoaded {
                        kv_bytes_per_block: b,
                        available_memory_bytes: 1 << 30,
                    })
                    .to_vec(),
                _ => (0..2).map(|rank| WorkerResponse::Ready { rank }).collect(),
            })
        })
        .unwrap();
        assert_eq!(
            layout,
            CacheLayout {
                num_blocks: 33,
                kv_bytes_per_block: 300
            }
        );
        assert!(matches!(
            sent[1],
            WorkerCommand::InitCache { num_blocks: 33, .. }
        ));
    }

    #[test]
    fn a_rank_that_fails_to_load_is_named_with_its_message() {
        let err = load_model_and_init_cache(&spec(10_000), |_| {
            Ok(vec![
                WorkerResponse::ModelLoaded {
                    kv_bytes_per_block: 100,
                    available_memory_bytes: 1 << 30,
                },
                WorkerResponse::Error {
                    rank: 1,
                    message: "no such file".into(),
                },
            ])
        })
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "engine dead: worker 1 failed: no such file",
            "{err}"
        );
    }
}
