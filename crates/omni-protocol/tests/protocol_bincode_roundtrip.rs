//! Every message type survives a bincode 2 round trip, as the IPC layer encodes it.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;

use omni_protocol::{
    AddRequestError, CachedRequestData, DType, EngineCoreInput, EngineCoreOutput,
    EngineCoreOutputs, EngineCoreRequest, EngineDeadError, FinishReason, LoadFormat, LoadModelSpec,
    Logprob, MmKind, ModelRunnerOutput, MultiModalFeatureSpec, NewRequestData, SamplingParams,
    SchedulerOutput, SchedulerStats, StopReason, TensorRef, TokenLogprobs, WorkerCommand,
    WorkerResponse,
};
use serde::{Serialize, de::DeserializeOwned};

fn roundtrip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(value: &T) {
    let config = bincode::config::standard();
    let bytes = bincode::serde::encode_to_vec(value, config).unwrap();
    let (decoded, read): (T, usize) = bincode::serde::decode_from_slice(&bytes, config).unwrap();
    assert_eq!(read, bytes.len(), "decoder must consume the whole message");
    assert_eq!(&decoded, value);
}

fn full_sampling_params() -> SamplingParams {
    SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        top_k: Some(40),
        min_p: 0.05,
        seed: Some(1234),
        presence_penalty: 0.5,
        frequency_penalty: -0.25,
        repetition_penalty: 1.1,
        max_tokens: Some(128),
        min_tokens: 2,
        stop: vec!["\n\n".into(), "</s>".into()],
        stop_token_ids: vec![7, 9],
        ignore_eos: true,
        logprobs: Some(5),
    }
}

fn tensor(index: u32) -> TensorRef {
    TensorRef {
        name: "thinker.hidden_states.24".into(),
        request_id: Some("req-1".into()),
        dtype: DType::Bf16,
        shape: vec![17, 2048],
        buffer_index: index,
    }
}

fn feature(index: u32) -> MultiModalFeatureSpec {
    MultiModalFeatureSpec {
        mm_hash: 0xfeed_beef,
        offset: 1,
        length: 3,
        kind: MmKind::Image {
            grid_thw: [1, 2, 6],
        },
        tensor: TensorRef {
            name: "pixel_values".into(),
            request_id: None,
            dtype: DType::Bf16,
            shape: vec![12, 1536],
            buffer_index: index,
        },
    }
}

fn scheduler_output() -> SchedulerOutput {
    SchedulerOutput {
        scheduled_new_reqs: vec![NewRequestData {
            req_id: "req-1".into(),
            prompt_token_ids: vec![1, 2, 3, 4, 5],
            sampling_params: full_sampling_params(),
            eos_token_id: Some(2),
            block_ids: vec![0, 3],
            num_computed_tokens: 0,
            mm_features: vec![feature(1)],
        }],
        scheduled_cached_reqs: vec![CachedRequestData {
            req_id: "req-0".into(),
            resumed_from_preemption: true,
            new_token_ids: vec![42],
            new_block_ids: vec![5, 6, 7],
            num_computed_tokens: 33,
        }],
        num_scheduled_tokens: HashMap::from([("req-1".into(), 5), ("req-0".into(), 1)]),
        total_num_scheduled_tokens: 6,
        finished_req_ids: vec!["req-9".into()],
        preempted_req_ids: vec!["req-8".into()],
        scheduled_encoder_inputs: HashMap::from([("req-1".into(), vec![0])]),
        free_encoder_mm_hashes: vec![0xabc],
        tensors: vec![tensor(2)],
        ..Default::default()
    }
}

#[test]
fn sampling_params_roundtrip_with_every_field_set() {
    roundtrip(&full_sampling_params());
    roundtrip(&SamplingParams::default());
}

#[test]
fn engine_core_inputs_roundtrip() {
    let mut req =
        EngineCoreRequest::new("req-1", vec![10, 20, 30], full_sampling_params(), Some(2));
    req.mm_features.push(feature(0));
    req.mm_features.push(MultiModalFeatureSpec {
        kind: MmKind::Audio { num_frames: 537 },
        ..feature(1)
    });
    roundtrip(&req);
    roundtrip(&EngineCoreInput::Add(Box::new(req.clone())));
    // The buffers stay out of the header.
    req.mm_buffers.push(vec![0u8; 100_000].into());
    let config = bincode::config::standard();
    let bytes = bincode::serde::encode_to_vec(&req, config).unwrap();
    assert!(bytes.len() < 1000, "{} header bytes", bytes.len());
    let (back, _): (EngineCoreRequest, usize) =
        bincode::serde::decode_from_slice(&bytes, config).unwrap();
    assert_eq!(back.mm_features, req.mm_features);
    assert!(back.mm_buffers.is_empty());
    roundtrip(&EngineCoreInput::Abort(vec!["a".into(), "b".into()]));
    roundtrip(&EngineCoreInput::Shutdown);
}

#[test]
fn scheduler_output_roundtrips_inside_execute_model() {
    let out = scheduler_output();
    roundtrip(&out);
    roundtrip(&WorkerCommand::ExecuteModel(out));
    roundtrip(&WorkerCommand::ExecuteModel(SchedulerOutput::default()));
}

#[test]
fn borrowed_commands_encode_like_owned_ones() {
    let config = bincode::config::standard();
    let commands = [
        WorkerCommand::LoadModel(LoadModelSpec::default()),
        WorkerCommand::InitCache {
            num_blocks: 7,
            block_size: 16,
        },
        WorkerCommand::ExecuteModel(scheduler_output()),
        WorkerCommand::Health,
        WorkerCommand::Shutdown,
    ];
    for cmd in &commands {
        let owned = bincode::serde::encode_to_vec(cmd, config).unwrap();
        let borrowed = bincode::serde::encode_to_vec(cmd.as_ref(), config).unwrap();
        assert_eq!(borrowed, owned, "{cmd:?}");
    }
}

#[test]
fn model_runner_output_buffers_stay_out_of_the_header() {
    let config = bincode::config::standard();
    let with = ModelRunnerOutput {
        tensors: vec![tensor(0)],
        buffers: vec![vec![1; 1000]],
        ..Default::default()
    };
    let bytes = bincode::serde::encode_to_vec(&with, config).unwrap();
    assert!(bytes.len() < 100, "{} header bytes", bytes.len());
    let (back, _): (ModelRunnerOutput, usize) =
        bincode::serde::decode_from_slice(&bytes, config).unwrap();
    assert_eq!(back.tensors, with.tensors);
    assert!(back.buffers.is_empty());
}

#[test]
fn every_worker_command_roundtrips() {
    roundtrip(&WorkerCommand::LoadModel(LoadModelSpec {
        model: "/models/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
        load_format: LoadFormat::Gguf,
        dtype: Some(DType::F32),
        max_model_len: 8192,
        block_size: 16,
        gpu_memory_utilization: 0.9,
        tensor_parallel_size: 2,
        pipeline_parallel_size: 2,
        seed: 0,
        device: omni_protocol::Device::Cuda,
        max_num_batched_tokens: 8192,
        max_num_seqs: 256,
        enforce_eager: true,
        cuda_profile_steps: 16,
    }));
    roundtrip(&WorkerCommand::InitCache {
        num_blocks: 4096,
        block_size: 16,
    });
    roundtrip(&WorkerCommand::Health);
    roundtrip(&WorkerCommand::Shutdown);
}

#[test]
fn every_worker_response_roundtrips() {
    roundtrip(&WorkerResponse::Ready { rank: 3 });
    roundtrip(&WorkerResponse::ModelLoaded {
        kv_bytes_per_block: 1 << 20,
        available_memory_bytes: 80 << 30,
    });
    let lp = |token_id, logprob| Logprob { token_id, logprob };
    roundtrip(&WorkerResponse::ModelRunnerOutput(ModelRunnerOutput {
        req_ids: vec!["req-0".into(), "req-1".into()],
        sampled_token_ids: vec![vec![42], vec![]],
        logprobs: vec![
            vec![TokenLogprobs {
                sampled: lp(42, -0.1),
                rank: 1,
                top: vec![lp(42, -0.1), lp(7, -2.5)],
            }],
            vec![],
        ],
        tensors: vec![tensor(1)],
        buffers: Vec::new(),
    }));
    roundtrip(&WorkerResponse::Error {
        rank: 1,
        message: "CUDA out of memory".into(),
    });
}

#[test]
fn engine_core_outputs_roundtrip() {
    let outputs = EngineCoreOutputs {
        outputs: vec![
            EngineCoreOutput {
                request_id: "req-0".into(),
                new_token_ids: vec![5],
                new_logprobs: vec![],
                finish_reason: Some(FinishReason::Stop),
                stop_reason: Some(StopReason::TokenId(5)),
                num_cached_tokens: 16,
                queue_time: Some(0.125),
                text_finish_reason: None,
                audio: None,
            },
            EngineCoreOutput {
                request_id: "req-1".into(),
                new_token_ids: vec![],
                new_logprobs: vec![],
                finish_reason: Some(FinishReason::Abort),
                stop_reason: Some(StopReason::String("END".into())),
                num_cached_tokens: 0,
                queue_time: None,
                text_finish_reason: None,
                audio: None,
            },
        ],
        scheduler_stats: Some(SchedulerStats {
            num_running_reqs: 3,
            num_waiting_reqs: 1,
            kv_cache_usage: 0.25,
            num_preemptions: 2,
            prefix_cache_queries: 100,
            prefix_cache_hits: 48,
            engine_steps: 7,
            mq_broadcast_messages: 9,
            mq_overflow_messages: 1,
            mq_ring_bytes: 4096,
            mq_overflow_bytes: 11_501_568,
        }),
        timestamp: 1.7e9,
        tensors: vec![],
        rejected: vec![(
            "req-2".into(),
            AddRequestError::PromptTooLong {
                prompt_len: 9000,
                max_model_len: 8192,
            },
        )],
        engine_dead: Some(EngineDeadError::Worker {
            rank: 1,
            cause: "worker process killed by signal 9".into(),
        }),
    };
    roundtrip(&outputs);
}

#[test]
fn tensor_ref_reports_buffer_size() {
    let t = tensor(1);
    assert_eq!(t.num_elements(), 17 * 2048);
    assert_eq!(t.num_bytes(), 17 * 2048 * 2);
    assert_eq!(FinishReason::Length.to_string(), "length");
}

#[test]
fn engine_core_output_without_queue_time_still_deserializes() {
    // A peer (or a log line) from before `queue_time` existed.
    let old = r#"{"request_id":"req-0","new_token_ids":[5],"new_logprobs":[],
        "finish_reason":null,"stop_reason":null,"num_cached_tokens":0}"#;
    let out: EngineCoreOutput = serde_json::from_str(old).unwrap();
    assert_eq!(out.queue_time, None);
    assert_eq!(out.new_token_ids, vec![5]);
}
