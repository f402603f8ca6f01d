//! The omni pipeline end to end on the tiny Qwen3-Omni fixture (issue 13): Thinker, Talker and
//! Code2Wav as stage processes of this binary (`omni-engine stage`), joined by omni-ipc queues
//! through `OmniPipeline`.
//!
//! Every stage greedy with fixed lengths (8 Thinker tokens, 11 Talker frames, ignore_eos):
//! the text equals transformers' greedy tokens, and the audio equals Code2Wav applied to
//! transformers' greedy Talker frames (`talker.frames.*` of the fixture): as one window
//! without async chunks, as the 4 / 25+25 windows with the streaming trim with them. Any
//! differing code would change the waveform. Four requests (2 prompts x 2 voices) run at once,
//! so every stage batches across requests.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

#[path = "server_common.rs"]
mod common;
#[path = "omni_common.rs"]
mod omni_common;
use omni_common::*;

use omni_core::{EngineCoreClient, MpClientConfig, OmniPipeline, OmniPipelineConfig};
use omni_protocol::{
    EngineCoreRequest, EngineDeadError, FinishReason, LoadFormat, Modality, OmniParams,
    SamplingParams, StageKind, StageSpec,
};

fn spec(kind: StageKind, replica: u32, async_chunk: bool) -> StageSpec {
    let stage_id = match kind {
        StageKind::Thinker => 0,
        StageKind::Talker => 1,
        StageKind::Code2Wav => 2,
        StageKind::Tts => 1,
    };
    StageSpec {
        stage_id,
        replica,
        kind,
        model: fixture().display().to_string(),
        tokenizer: String::new(),
        device: omni_protocol::Device::Cpu,
        device_ordinal: 0,
        gpu_memory_utilization: 0.9,
        enforce_eager: true,
        load_format: LoadFormat::Safetensors,
        seed: 0,
        max_num_seqs: 8,
        max_num_batched_tokens: 1024,
        max_model_len: 256,
        block_size: 16,
        num_blocks: 128,
        enable_prefix_caching: true,
        async_chunk,
        windowing: WINDOWS,
        default_sampling: SamplingParams::greedy(FRAMES),
        cuda_profile_steps: 0,
        profile_interval_s: 0.0,
    }
}

fn start(async_chunk: bool, talkers: u32) -> OmniPipeline {
    start_with(vec![
        vec![spec(StageKind::Thinker, 0, async_chunk)],
        (0..talkers)
            .map(|r| spec(StageKind::Talker, r, async_chunk))
            .collect(),
        vec![spec(StageKind::Code2Wav, 0, async_chunk)],
    ])
}

fn start_with(stages: Vec<Vec<StageSpec>>) -> OmniPipeline {
    // The pipeline's own warnings (a request's failure and why) in the test's output.
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let mut client = MpClientConfig::new(engine_bin());
    client.args = vec!["stage".into()];
    client.ready_timeout = Duration::from_secs(120);
    OmniPipeline::start(&OmniPipelineConfig { client, stages }).expect("the pipeline starts")
}

fn request(id: &str, prompt: Vec<u32>, speaker: &str) -> EngineCoreRequest {
    let thinker = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(THINKER_TOKENS),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let talker = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(FRAMES),
        ignore_eos: true,
        repetition_penalty: 1.05,
        ..SamplingParams::default()
    };
    let mut r = EngineCoreRequest::new(id, prompt, thinker, None);
    r.omni = Some(OmniParams {
        modalities: vec![Modality::Text, Modality::Audio],
        speaker: speaker.into(),
        stage_sampling: vec![talker],
    });
    r
}

#[derive(Debug, Default)]
struct Collected {
    tokens: Vec<u32>,
    text_finish: Option<FinishReason>,
    audio: Vec<f32>,
    packets: usize,
    finish: Option<FinishReason>,
}

fn collect(mut s: omni_core::RequestStream) -> Result<Collected, omni_core::RequestError> {
    let mut c = Collected::default();
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        let Some(item) = s.blocking_next() else { break };
        let o = item?;
        c.tokens.extend(&o.new_token_ids);
        if o.text_finish_reason.is_some() {
            c.text_finish = o.text_finish_reason;
        }
        if let Some(a) = &o.audio {
            assert_eq!(a.sample_rate, 24_000);
            c.audio.extend(&a.samples);
            c.packets += 1;
        }
        if o.finished() {
            c.finish = o.finish_reason;
            break;
        }
    }
    Ok(c)
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "audio lengths");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Runs the fixture's 4 requests at once and checks text and audio against the references.
fn check_all(p: &OmniPipeline, async_chunk: bool) {
    let r = reference();
    let c2w = load_code2wav();
    let mut running = Vec::new();
    for (i, prompt) in r["thinker.prompts"].as_array().unwrap().iter().enumerate() {
        for speaker in ["chelsie", "ethan"] {
            let id = format!("req-{i}-{speaker}");
            let s = p.add_request(request(&id, ids(prompt), speaker)).unwrap();
            running.push((i, speaker, s));
        }
    }
    for (i, speaker, s) in running {
        let got = collect(s).unwrap();
        let want_tokens = ids(&r[format!("thinker.greedy.{i}").as_str()]);
        assert_eq!(got.tokens, want_tokens, "prompt {i} {speaker}: text");
        assert_eq!(got.text_finish, Some(FinishReason::Length));
        assert_eq!(got.finish, Some(FinishReason::Stop), "prompt {i} {speaker}");
        let frames = reference_frames(&format!("talker.frames.{i}.{speaker}"));
        let want = expected_audio(&c2w, &frames, async_chunk);
        assert_eq!(want.len(), 1920 * FRAMES as usize - 555);
        let e = max_abs(&got.audio, &want);
        assert!(e <= 1e-4, "prompt {i} {speaker}: audio max abs err {e}");
        let packets = if async_chunk { 2 } else { 1 };
        assert_eq!(got.packets, packets, "prompt {i} {speaker}: audio packets");
    }
}

/// The segments the stage processes `pids` left in /dev/shm.
fn segments_of(pids: &[u32]) -> Vec<String> {
    pids.iter().flat_map(|&p| common::segments_of(p)).collect()
}

#[test]
fn async_chunks_give_transformers_text_and_the_streaming_windows_audio() {
    let p = start(true, 1);
    check_all(&p, true);
    let pids: Vec<u32> = p.stages().iter().flatten().map(|s| s.pid()).collect();
    p.shutdown();
    assert!(segments_of(&pids).is_empty(), "{:?}", segments_of(&pids));
}

#[test]
fn full_payloads_give_transformers_text_and_one_window_of_audio() {
    let p = start(false, 1);
    check_all(&p, false);
    p.shutdown();
}

#[test]
fn two_talker_replicas_give_the_same_audio_as_one() {
    let p = start(true, 2);
    check_all(&p, true);
    p.shutdown();
}

#[test]
fn a_killed_stage_fails_its_requests_naming_it_and_leaves_no_segments() {
    let p = start(true, 1);
    let r = reference();
    // Long enough to outlive the kill on a slow machine.
    let mut req = request("doomed", ids(&r["thinker.prompts"][0]), "ethan");
    req.sampling_params.max_tokens = Some(200);
    if let Some(o) = req.omni.as_mut() {
        o.stage_sampling[0].max_tokens = Some(200);
    }
    let mut s = p.add_request(req).unwrap();
    // Wait for the first text so the request lives in every stage.
    let first = s.blocking_next().unwrap().unwrap();
    assert!(!first.finished());
    let talker = p.stages()[1][0].pid();
    let pids: Vec<u32> = p.stages().iter().flatten().map(|s| s.pid()).collect();
    let killed = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(talker as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let err = loop {
        match s.blocking_next() {
            Some(Ok(o)) if !o.finished() => continue,
            Some(Err(e)) => break e,
            other => panic!("expected the stage's death, got {other:?}"),
        }
    };
    assert!(
        killed.elapsed() < Duration::from_secs(2),
        "{:?}",
        killed.elapsed()
    );
    match err {
        omni_core::RequestError::Engine(EngineDeadError::Stage {
            stage_id, replica, ..
        }) => assert_eq!((stage_id, replica), (1, 0)),
        e => panic!("expected a stage error, got {e}"),
    }
    assert!(p.health().is_err());
    // New requests fail at once.
    let again = p.add_request(request("late", ids(&r["thinker.prompts"][0]), "ethan"));
    assert!(again.is_err() || collect(again.unwrap()).is_err());
    p.shutdown();
    assert!(segments_of(&pids).is_empty(), "{:?}", segments_of(&pids));
}

/// Polls `cond` on the pipeline's per-stage stats for up to 10 s.
fn wait_stats(
    p: &OmniPipeline,
    cond: impl Fn(&[Vec<omni_protocol::SchedulerStats>]) -> bool,
) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if cond(&p.stage_stats()) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

#[test]
fn a_dropped_stream_frees_its_blocks_in_every_stage() {
    let p = start(true, 1);
    let r = reference();
    let mut req = request("gone", ids(&r["thinker.prompts"][1]), "chelsie");
    // Long enough to be alive in both KV-holding stages when the client leaves.
    req.sampling_params.max_tokens = Some(200);
    if let Some(o) = req.omni.as_mut() {
        o.stage_sampling[0].max_tokens = Some(200);
    }
    let mut s = p.add_request(req).unwrap();
    assert!(!s.blocking_next().unwrap().unwrap().finished());
    assert!(
        wait_stats(&p, |st| st[0][0].kv_cache_usage > 0.0
            && st[1][0].kv_cache_usage > 0.0),
        "the request never held blocks in both stages: {:?}",
        p.stage_stats()
    );
    drop(s);
    assert!(
        wait_stats(&p, |st| {
            st[0][0].kv_cache_usage == 0.0
                && st[1][0].kv_cache_usage == 0.0
                && st[0][0].num_running_reqs == 0
                && st[1][0].num_running_reqs == 0
        }),
        "blocks still held after the disconnect: {:?}",
        p.stage_stats()
    );
    p.shutdown();
}

fn on_gpu(mut s: StageSpec) -> StageSpec {
    s.device = omni_protocol::Device::Cuda;
    s.gpu_memory_utilization = 0.2;
    s.enforce_eager = false;
    s
}

/// The CUDA stages in the pipeline (skips without a GPU). The bf16 Thinker's greedy text
/// starts with transformers' first token (later ones may part at a routing near-tie of the
/// fixture's random routers), and four requests batched in the all-GPU pipeline give each
/// the text it got alone; with Code2Wav on the GPU (the rest on the CPU, so the frames are
/// transformers') the audio is within bf16 accuracy of the CPU's (SNR over 25 dB).
#[test]
fn gpu_thinker_and_code2wav_stages_serve_the_pipeline() {
    if omni_backend::cuda::driver_status().is_err() {
        eprintln!("no CUDA driver: skipped");
        return;
    }
    let r = reference();
    let p = start_with(vec![
        vec![on_gpu(spec(StageKind::Thinker, 0, true))],
        vec![spec(StageKind::Talker, 0, true)],
        vec![spec(StageKind::Code2Wav, 0, true)],
    ]);
    let mut alone = Vec::new();
    for i in 0..2 {
        let id = format!("gpu-thinker-{i}");
        let prompt = ids(&r["thinker.prompts"][i]);
        let got = collect(p.add_request(request(&id, prompt, "ethan")).unwrap()).unwrap();
        let want = ids(&r[format!("thinker.greedy.{i}").as_str()]);
        eprintln!(
            "prompt {i}: CUDA Thinker {:?}, transformers {want:?}",
            got.tokens
        );
        assert_eq!(got.tokens.len(), want.len());
        assert_eq!(
            got.tokens[0], want[0],
            "prompt {i}: the CUDA Thinker's first token"
        );
        assert_eq!(got.finish, Some(FinishReason::Stop));
        alone.push(got.tokens);
    }
    p.shutdown();
    let p = start_with(vec![
        vec![spec(StageKind::Thinker, 0, true)],
        vec![spec(StageKind::Talker, 0, true)],
        vec![on_gpu(spec(StageKind::Code2Wav, 0, true))],
    ]);
    let c2w = load_code2wav();
    for (i, speaker) in [(0, "ethan"), (1, "chelsie")] {
        let id = format!("gpu-c2w-{i}");
        let prompt = ids(&r["thinker.prompts"][i]);
        let got = collect(p.add_request(request(&id, prompt, speaker)).unwrap()).unwrap();
        let frames = reference_frames(&format!("talker.frames.{i}.{speaker}"));
        let want = expected_audio(&c2w, &frames, true);
        assert_eq!(got.audio.len(), want.len());
        let signal: f64 = want.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        let noise: f64 = got
            .audio
            .iter()
            .zip(&want)
            .map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2))
            .sum();
        let snr = 10.0 * (signal / noise.max(1e-30)).log10();
        eprintln!("prompt {i} {speaker}: CUDA Code2Wav SNR {snr:.1} dB");
        assert!(snr > 25.0, "prompt {i} {speaker}: SNR {snr:.1} dB");
    }
    p.shutdown();
    // Every stage on the GPU, four requests at once: each gets the text it got alone; the
    // frames follow the bf16 Talker (its greedy codes leave transformers' at the first
    // near-tie, see cuda_talker.rs), so the audio is checked for its length and soundness.
    let p = start_with(vec![
        vec![on_gpu(spec(StageKind::Thinker, 0, true))],
        vec![on_gpu(spec(StageKind::Talker, 0, true))],
        vec![on_gpu(spec(StageKind::Code2Wav, 0, true))],
    ]);
    let mut running = Vec::new();
    for i in 0..2 {
        for speaker in ["chelsie", "ethan"] {
            let id = format!("gpu-all-{i}-{speaker}");
            let prompt = ids(&r["thinker.prompts"][i]);
            running.push((i, p.add_request(request(&id, prompt, speaker)).unwrap()));
        }
    }
    for (i, s) in running {
        let got = collect(s).unwrap();
        assert_eq!(got.tokens, alone[i], "prompt {i}: batched text != alone");
        assert_eq!(got.finish, Some(FinishReason::Stop));
        assert_eq!(got.audio.len(), 1920 * FRAMES as usize - 555);
        assert!(got.audio.iter().all(|x| x.is_finite() && x.abs() <= 1.0));
        let rms = (got.audio.iter().map(|x| x * x).sum::<f32>() / got.audio.len() as f32).sqrt();
        eprintln!("prompt {i}: all-GPU audio rms {rms:.4}");
        assert!(rms > 1e-4, "silent audio");
    }
    p.shutdown();
}
