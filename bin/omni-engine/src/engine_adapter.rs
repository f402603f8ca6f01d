//! [`CoreEngineClient`]: omni-core's [`EngineCoreClient`] (the engine core on a thread here or
//! in its own process) seen through omni-server's [`omni_server::EngineClient`] trait.
//!
//! The engine core hands each request a [`RequestStream`] of `Result<_, RequestError>`; the server
//! wants an unbounded receiver of `Result<_, omni_server::EngineError>`. One small tokio task per
//! request forwards and maps the items. When the server drops its receiver (client gone, stop
//! string matched) the task drops the stream, and dropping an unfinished stream aborts the
//! request in the engine, which frees its KV blocks.

use std::sync::Arc;

use omni_core::{EngineCoreClient, EngineDeadError, RequestError, RequestStream};
use omni_protocol::{EngineCoreRequest, RequestId, SchedulerStats};
use omni_server::{CacheInfo, EngineError, OutputReceiver};
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};

/// The real engine (omni-core's [`EngineCoreClient`]) behind the server's trait.
#[derive(Debug, Clone)]
pub struct CoreEngineClient {
    client: Arc<dyn EngineCoreClient>,
    cache: CacheInfo,
}

impl CoreEngineClient {
    /// Wraps `client`; `cache` is reported by `vllm:cache_config_info`.
    pub fn new(client: Arc<dyn EngineCoreClient>, cache: CacheInfo) -> Self {
        Self { client, cache }
    }
}

/// The table from the engine core's failures to the server's (and so to HTTP statuses):
/// admission refusals are 400; a dead worker, a dead engine core or a shutdown 503 (naming the
/// rank or the engine core).
fn server_error(e: RequestError) -> EngineError {
    match e {
        RequestError::Rejected(r) => EngineError::InvalidRequest {
            reason: r.to_string(),
        },
        RequestError::Engine(e) => EngineError::Dead {
            cause: dead_cause(&e),
        },
        RequestError::Shutdown => EngineError::Dead {
            cause: "the engine is shutting down".into(),
        },
    }
}

fn dead_cause(e: &EngineDeadError) -> String {
    match e {
        EngineDeadError::Worker { rank, cause } => format!("worker {rank} failed: {cause}"),
        EngineDeadError::EngineCore { cause } => format!("engine core failed: {cause}"),
        EngineDeadError::Stage {
            stage_id,
            kind,
            replica,
            cause,
        } => format!("stage {stage_id} ({kind}) replica {replica} failed: {cause}"),
    }
}

/// Copies `stream` into `tx` until the request finishes or the receiver is dropped.
async fn forward(
    mut stream: RequestStream,
    tx: UnboundedSender<Result<omni_protocol::EngineCoreOutput, EngineError>>,
) {
    loop {
        let item = tokio::select! {
            item = stream.next() => item,
            () = tx.closed() => None,
        };
        let Some(item) = item else { break };
        let last = !matches!(&item, Ok(out) if !out.finished());
        if tx.send(item.map_err(server_error)).is_err() || last {
            break;
        }
    }
    // Dropping an unfinished `stream` here aborts its request.
}

impl omni_server::EngineClient for CoreEngineClient {
    fn add_request(&self, request: EngineCoreRequest) -> Result<OutputReceiver, EngineError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|e| EngineError::Internal {
            reason: format!("add_request outside the server's runtime: {e}"),
        })?;
        let stream = self.client.add_request(request).map_err(server_error)?;
        let (tx, rx) = unbounded_channel();
        runtime.spawn(forward(stream, tx));
        Ok(rx)
    }

    fn abort(&self, request_ids: &[RequestId]) {
        self.client.abort(request_ids.to_vec());
    }

    fn stats(&self) -> SchedulerStats {
        self.client.stats()
    }

    fn is_healthy(&self) -> Result<(), String> {
        self.client.health().map_err(|e| dead_cause(&e))
    }

    fn cache_info(&self) -> CacheInfo {
        self.cache
    }

    fn pipeline_stats(&self) -> Option<omni_protocol::PipelineStats> {
        self.client.pipeline_stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_worker_maps_to_a_dead_engine_naming_the_rank() {
        let e = server_error(RequestError::Engine(EngineDeadError::Worker {
            rank: 1,
            cause: "killed by signal 9".into(),
        }));
        assert_eq!(
            e,
            EngineError::Dead {
                cause: "worker 1 failed: killed by signal 9".into()
            }
        );
        assert!(matches!(
            server_error(RequestError::Shutdown),
            EngineError::Dead { .. }
        ));
    }

    #[test]
    fn dead_engine_core_maps_to_a_dead_engine_naming_it() {
        let e = server_error(RequestError::Engine(EngineDeadError::EngineCore {
            cause: "engine-core process 7 (omni-engine-core) killed by signal 9".into(),
        }));
        assert_eq!(
            e,
            EngineError::Dead {
                cause: "engine core failed: engine-core process 7 (omni-engine-core) killed by \
                        signal 9"
                    .into()
            }
        );
    }
}
