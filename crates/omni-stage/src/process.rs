//! The stage process: the engine-core handshake with a [`StageSpec`], the stage's network, then
//! a loop of inputs and steps until `Shutdown` or the client's end.

use std::path::Path;
use std::time::{Duration, Instant};

use omni_core::EngineCoreProc;
use omni_ipc::IpcError;
use omni_models::qwen3_omni::code2wav::Code2Wav;
use omni_models::qwen3_omni::talker::Talker;
use omni_models::qwen3_omni::thinker::Thinker;
use omni_models::registry::{dummy_weights, read_config};
use omni_models::{TpContext, WeightSource};
use omni_protocol::{Device, LoadFormat, StageInput, StageKind, StageOutputs, StageSpec};

use crate::StageError;
use crate::code2wav::Code2WavStage;
use crate::nets::{CpuTalker, CpuThinker};
use crate::profile::StageProfile;
use crate::stage::Stage;
use crate::talker::TalkerStage;
use crate::text_net::TextNet;
use crate::thinker::ThinkerStage;
use crate::tts::TtsStage;

/// How long an idle stage waits for an input before it looks again.
const IDLE_WAIT: Duration = Duration::from_millis(100);
/// Inputs taken in one turn before a step runs (so a flood cannot starve the batch).
const MAX_INPUTS_PER_TURN: usize = 1024;

/// A loaded stage and what it reports at start-up.
#[derive(Debug)]
pub struct BuiltStage {
    /// The stage.
    pub stage: Box<dyn Stage>,
    /// KV blocks it holds (0 for Code2Wav).
    pub num_blocks: u32,
    /// Where its network runs.
    pub device: Device,
}

/// Whether a Thinker stage's model is a plain text LLM (a GGUF file, or a directory of another
/// architecture than Qwen3-Omni's), run as [`TextNet`].
fn is_text_llm(spec: &StageSpec) -> Result<bool, StageError> {
    let path = Path::new(&spec.model);
    if path.is_file() {
        return Ok(true);
    }
    Ok(omni_models::registry::engine_stage(&read_config(path)?).is_none())
}

/// Loads `spec`'s network on its device and wraps it in its stage.
pub fn build_stage(spec: &StageSpec) -> Result<BuiltStage, StageError> {
    match spec.kind {
        StageKind::Tts => {
            return Ok(BuiltStage {
                stage: Box::new(TtsStage::load(spec)?),
                num_blocks: 0,
                device: Device::Cpu,
            });
        }
        StageKind::Thinker if is_text_llm(spec)? => {
            let net = TextNet::load(spec)?;
            return Ok(BuiltStage {
                stage: Box::new(ThinkerStage::new(Box::new(net), spec)?),
                num_blocks: spec.num_blocks,
                device: Device::Cpu,
            });
        }
        _ => {}
    }
    let dir = Path::new(&spec.model);
    let config = read_config(dir)?;
    if spec.device == Device::Cuda {
        return build_cuda(spec, &config, dir);
    }
    let weights: Box<dyn WeightSource> = match spec.load_format {
        LoadFormat::Dummy => Box::new(dummy_weights(&config, spec.seed)?),
        LoadFormat::Auto | LoadFormat::Safetensors => Box::new(
            omni_models::hf_dir::SafetensorsDir::open(dir)
                .map_err(|e| StageError::Model(format!("opening {}: {e}", dir.display())))?,
        ),
        LoadFormat::Gguf => {
            return Err(StageError::Config(
                "omni stages load HF safetensors directories, not GGUF".into(),
            ));
        }
    };
    let ws = weights.as_ref();
    let stage: Box<dyn Stage> = match spec.kind {
        StageKind::Thinker => {
            let t = Thinker::load(&config, ws, TpContext::single())?;
            let net = CpuThinker::new(t, spec.num_blocks as usize, spec.block_size as usize)?;
            Box::new(ThinkerStage::new(Box::new(net), spec)?)
        }
        StageKind::Talker => {
            let t = Talker::load(&config, ws, TpContext::single())?;
            let net = CpuTalker::new(t, spec.num_blocks as usize, spec.block_size as usize)?;
            Box::new(TalkerStage::new(Box::new(net), spec)?)
        }
        StageKind::Code2Wav => Box::new(Code2WavStage::new(
            Box::new(Code2Wav::load(&config, ws)?),
            spec,
        )),
        StageKind::Tts => return Err(StageError::Config("a TTS stage has no network".into())),
    };
    let num_blocks = if spec.kind == StageKind::Code2Wav {
        0
    } else {
        spec.num_blocks
    };
    Ok(BuiltStage {
        stage,
        num_blocks,
        device: Device::Cpu,
    })
}

#[cfg(feature = "cuda")]
fn build_cuda(
    spec: &StageSpec,
    config: &serde_json::Value,
    dir: &Path,
) -> Result<BuiltStage, StageError> {
    use crate::cuda::{CudaCode2WavNet, CudaTalkerNet, CudaThinker};
    let (stage, num_blocks): (Box<dyn Stage>, u32) = match spec.kind {
        StageKind::Thinker => {
            let (net, blocks) = CudaThinker::load(config, dir, spec)?;
            let mut s = spec.clone();
            s.num_blocks = blocks;
            (Box::new(ThinkerStage::new(Box::new(net), &s)?), blocks)
        }
        StageKind::Talker => {
            let (net, blocks) = CudaTalkerNet::load(config, dir, spec)?;
            let mut s = spec.clone();
            s.num_blocks = blocks;
            (Box::new(TalkerStage::new(Box::new(net), &s)?), blocks)
        }
        StageKind::Code2Wav => (
            Box::new(Code2WavStage::new(
                Box::new(CudaCode2WavNet::load(config, dir, spec)?),
                spec,
            )),
            0,
        ),
        StageKind::Tts => return Err(StageError::Config("a TTS stage has no network".into())),
    };
    Ok(BuiltStage {
        stage,
        num_blocks,
        device: Device::Cuda,
    })
}

#[cfg(not(feature = "cuda"))]
fn build_cuda(
    _spec: &StageSpec,
    _config: &serde_json::Value,
    _dir: &Path,
) -> Result<BuiltStage, StageError> {
    Err(StageError::Config(
        "this omni-engine was built without the CUDA backend (feature `cuda`)".into(),
    ))
}

/// `omni-engine stage`: serves one stage replica until told to stop. A step's error ends the
/// process (the pipeline then fails the stage's requests, naming it).
pub fn run_stage_process() -> Result<(), StageError> {
    let (proc, spec) = EngineCoreProc::accept_named(StageSpec::process_name)?;
    let BuiltStage {
        mut stage,
        num_blocks,
        device,
    } = match build_stage(&spec) {
        Ok(s) => s,
        Err(e) => {
            proc.fail(&e.to_string())?;
            return Err(e);
        }
    };
    let (mut inputs, mut outputs) = proc.open_queues(num_blocks, &spec.model, device)?;
    tracing::info!(
        stage = spec.stage_id,
        replica = spec.replica,
        kind = spec.kind.as_str(),
        "stage serving"
    );
    let every = Duration::from_secs_f32(spec.profile_interval_s.max(0.0));
    let mut profile = StageProfile::new(spec.process_name(), every);
    loop {
        // Input time counts from the first input taken (not the idle wait before it).
        let mut first_input: Option<Instant> = None;
        let mut out = StageOutputs::default();
        let mut stop = false;
        let mut took = 0;
        for i in 0..MAX_INPUTS_PER_TURN {
            // A busy stage only polls (a published overflow message is still read whole:
            // omni-ipc gives its frames their own grace).
            let wait = if i == 0 && !stage.has_work() {
                IDLE_WAIT
            } else {
                Duration::ZERO
            };
            match inputs.dequeue(Some(wait)) {
                Ok(msg) => {
                    first_input.get_or_insert_with(Instant::now);
                    let input: StageInput = msg.header()?;
                    if matches!(input, StageInput::Shutdown) {
                        stop = true;
                        break;
                    }
                    let bufs: Vec<&[u8]> = msg.buffers().iter().map(|b| b.as_ref()).collect();
                    stage.input(input, &bufs, &mut out);
                    took += 1;
                }
                Err(IpcError::Timeout(_)) => break,
                Err(IpcError::Closed | IpcError::Cancelled) => {
                    stop = true;
                    break;
                }
                Err(e) => return Err(e.into()),
            }
        }
        // Inputs change what the stage holds (an abort frees blocks): report it even when no
        // step follows.
        if took > 0 {
            out.scheduler_stats = stage.stats();
        }
        if !out.is_empty() || out.scheduler_stats.is_some() {
            outputs.enqueue(&out, &[])?;
        }
        if let Some(t) = first_input {
            profile.add_inputs(t.elapsed());
        }
        if stop {
            return Ok(());
        }
        if stage.has_work() {
            let (out, bufs) = stage.step(profile.step_clock())?;
            profile.end_step();
            let sent = Instant::now();
            send_outputs(&mut outputs, out, &bufs)?;
            profile.add_sends(sent.elapsed());
        }
        profile.maybe_log();
    }
}

/// Sends one step's outputs: the Thinker's chunks packed into as few messages as stay within a
/// ring slot ([`omni_protocol::STAGE_PACK_BYTES`]; one per step unless prefills are large),
/// everything else in one message after them.
fn send_outputs(
    q: &mut omni_ipc::MessageQueue,
    mut out: StageOutputs,
    bufs: &[Vec<u8>],
) -> Result<(), StageError> {
    let chunks = std::mem::take(&mut out.thinker_chunks);
    let size = |i: usize| bufs.get(i).map_or(0, Vec::len);
    for (thinker_chunks, picked) in
        omni_protocol::pack_thinker_chunks(chunks, size, omni_protocol::STAGE_PACK_BYTES)
    {
        let views: Vec<&[u8]> = picked
            .iter()
            .filter_map(|&i| bufs.get(i).map(Vec::as_slice))
            .collect();
        let one = StageOutputs {
            thinker_chunks,
            ..StageOutputs::default()
        };
        q.enqueue(&one, &views)?;
    }
    if !out.is_empty() || out.scheduler_stats.is_some() {
        q.enqueue(&out, &[])?;
    }
    Ok(())
}
