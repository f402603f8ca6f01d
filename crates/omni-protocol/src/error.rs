//! The engine's failures that cross from an engine-core process to the API process: a request
//! refused at admission ([`AddRequestError`]) and a dead engine ([`EngineDeadError`]). Both ride
//! in [`crate::EngineCoreOutputs`]; in-process they are the same values, not copies of them.

use serde::{Deserialize, Serialize};

use crate::{RequestId, SamplingParamsError};

/// Why a request was refused at admission (the API maps these to HTTP 400).
#[derive(Debug, Clone, PartialEq, thiserror::Error, Serialize, Deserialize)]
pub enum AddRequestError {
    /// A live request already has this id.
    #[error("request id {0:?} is already in use")]
    DuplicateRequestId(RequestId),
    /// The prompt has no tokens.
    #[error("request {0:?} has an empty prompt")]
    EmptyPrompt(RequestId),
    /// The prompt does not fit the model's context.
    #[error("prompt of {prompt_len} tokens exceeds max_model_len {max_model_len}")]
    PromptTooLong {
        /// Prompt length.
        prompt_len: usize,
        /// Configured limit.
        max_model_len: usize,
    },
    /// A multimodal item does not match the prompt or its tensor bytes.
    #[error("request {request_id:?}: {reason}")]
    InvalidMultiModal {
        /// The request.
        request_id: RequestId,
        /// What is wrong.
        reason: String,
    },
    /// A sampling parameter is out of range.
    #[error(transparent)]
    InvalidSamplingParams(#[from] SamplingParamsError),
}

/// The engine cannot go on (vLLM's `EngineDeadError`): every live request fails with it, and so
/// does every later one. It names the process that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum EngineDeadError {
    /// A worker died, answered with an error, or stopped answering.
    #[error("engine dead: worker {rank} failed: {cause}")]
    Worker {
        /// The failing worker's rank.
        rank: u32,
        /// What happened (exit status, the worker's error message, a timeout).
        cause: String,
    },
    /// The engine-core process (`omni-engine-core`) died or stopped answering.
    #[error("engine dead: the engine core failed: {cause}")]
    EngineCore {
        /// What happened (its pid and exit status, a broken queue).
        cause: String,
    },
    /// A stage replica of an omni pipeline (`omni-stage-<id>[-<replica>]`) died or failed.
    #[error("engine dead: stage {stage_id} ({kind}) replica {replica} failed: {cause}")]
    Stage {
        /// The stage.
        stage_id: u32,
        /// Its network (`thinker`, `talker`, `code2wav`).
        kind: String,
        /// The replica.
        replica: u32,
        /// What happened (its pid and exit status, its error).
        cause: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_cross_the_wire_unchanged() {
        let cfg = bincode::config::standard();
        let errors = [
            AddRequestError::EmptyPrompt("a".into()),
            AddRequestError::InvalidSamplingParams(SamplingParamsError::Penalty {
                name: "frequency_penalty",
                value: 3.0,
            }),
        ];
        for e in errors {
            let bytes = bincode::serde::encode_to_vec(&e, cfg).unwrap();
            let (back, _): (AddRequestError, _) =
                bincode::serde::decode_from_slice(&bytes, cfg).unwrap();
            assert_eq!(back, e);
        }
        let dead = EngineDeadError::EngineCore {
            cause: "killed by signal 9".into(),
        };
        let bytes = bincode::serde::encode_to_vec(&dead, cfg).unwrap();
        let (back, _): (EngineDeadError, _) =
            bincode::serde::decode_from_slice(&bytes, cfg).unwrap();
        assert_eq!(back, dead);
        assert!(back.to_string().contains("engine core"), "{back}");
    }

    #[test]
    fn an_unknown_penalty_name_is_refused() {
        let json = r#"{"InvalidSamplingParams":{"Penalty":{"name":"x","value":1.0}}}"#;
        assert!(serde_json::from_str::<AddRequestError>(json).is_err());
    }
}
