//! What crosses between the stages of an omni pipeline (Qwen3-Omni: Thinker -> Talker ->
//! Code2Wav), as message headers whose tensors travel as out-of-band buffers ([`TensorRef`]).
//!
//! Thinker -> Talker, in async-chunk mode (omni.md 2.5): chunk 0 once the Thinker has computed
//! the prompt and fed back its first generated token, with both exported states of those `P + 1`
//! positions and the three TTS-token embeddings; then one [`ThinkerChunk::Decode`] per fed-back
//! token (its layer-0 row only: the Talker reads the accept-layer state only at multimodal
//! positions, which are all in the prompt); then [`ThinkerChunk::End`]. With async chunking
//! off, one [`ThinkerChunk::Full`] after the Thinker finished.
//!
//! Talker -> Code2Wav: [`CodecChunk`]s, one Code2Wav window each (codebook-major codes with
//! their left context), cut as `omni_core::connector::CodecChunker` cuts them.

use serde::{Deserialize, Serialize};

use crate::tensor::{TensorBufferError, TensorRef, TensorView};
use crate::{
    AddRequestError, EngineCoreOutput, EngineCoreRequest, LoadFormat, RequestId, SamplingParams,
    SchedulerStats,
};

/// The Thinker's exports over a run of positions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThinkerStates {
    /// The Thinker's tokens so far: prompt, then generated.
    pub ids: Vec<u32>,
    /// How many of `ids` are the prompt.
    pub prompt_len: u32,
    /// Layer 0's input, `[rows, hidden]`.
    pub embed: TensorRef,
    /// The residual stream after `accept_hidden_layer` layers, `[rows, hidden]`.
    pub hidden: TensorRef,
    /// The embeddings of `tts_bos`, `tts_eos`, `tts_pad`, `[3, hidden]`.
    pub tts: TensorRef,
    /// The request's voice (`speaker` / `voice`), lower-cased.
    pub speaker: String,
}

/// One Thinker -> Talker payload of one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ThinkerChunk {
    /// Chunk 0 (async mode): the prompt and the first fed-back token, `P + 1` rows.
    Prefill(ThinkerStates),
    /// One fed-back token's layer-0 row, `[1, hidden]`.
    Decode {
        /// The token.
        token: u32,
        /// Its row.
        embed: TensorRef,
    },
    /// Every position at once, after the Thinker finished (async chunking off).
    Full(ThinkerStates),
    /// The Thinker finished; no more rows come (the trailing text ends with `tts_eos`).
    End,
}

/// A [`ThinkerChunk`] addressed to one request of the next stage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThinkerToTalker {
    /// The request (the same id in every stage).
    pub request_id: RequestId,
    /// 0, 1, 2, ... per request, so a receiver sees a lost or reordered chunk.
    pub chunk_id: u32,
    /// The payload.
    pub chunk: ThinkerChunk,
}

/// The checked views of a [`ThinkerStates`] (from a received message's buffers).
#[derive(Debug, Clone, Copy)]
pub struct ThinkerStatesView<'a> {
    /// Layer 0's input rows.
    pub embed: TensorView<'a>,
    /// The accept-layer rows.
    pub hidden: TensorView<'a>,
    /// The TTS embeddings.
    pub tts: TensorView<'a>,
}

/// A [`ThinkerStates`] whose tensors do not fit together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StagePayloadError {
    /// A tensor does not match its buffer.
    #[error(transparent)]
    Buffer(#[from] TensorBufferError),
    /// Shapes that disagree with each other or with the ids.
    #[error("Thinker states: {0}")]
    Shape(String),
}

impl ThinkerStates {
    /// Checks the tensors against `buffers` and each other: `embed` and `hidden` are
    /// `[rows, hidden]` with `prompt_len <= rows <= ids.len()`, `tts` is `[3, hidden]`.
    pub fn view<'a>(
        &'a self,
        buffers: &[&'a [u8]],
    ) -> Result<ThinkerStatesView<'a>, StagePayloadError> {
        let bad = |m: String| Err(StagePayloadError::Shape(m));
        let (embed, hidden, tts) = (
            self.embed.view(buffers)?,
            self.hidden.view(buffers)?,
            self.tts.view(buffers)?,
        );
        let e = &self.embed.shape;
        if e.len() != 2 || self.hidden.shape != *e || self.embed.dtype != self.hidden.dtype {
            return bad(format!(
                "embed {:?} {:?} and hidden {:?} {:?} must be equal [rows, hidden]",
                self.embed.dtype, e, self.hidden.dtype, self.hidden.shape
            ));
        }
        if self.tts.shape != [3, e[1]] {
            return bad(format!("tts {:?}, expected [3, {}]", self.tts.shape, e[1]));
        }
        let rows = e[0];
        if rows < u64::from(self.prompt_len) || rows > self.ids.len() as u64 {
            return bad(format!(
                "{rows} rows for a prompt of {} and {} ids",
                self.prompt_len,
                self.ids.len()
            ));
        }
        Ok(ThinkerStatesView { embed, hidden, tts })
    }
}

/// One Code2Wav window of one request (Talker -> Code2Wav).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodecChunk {
    /// The request.
    pub request_id: RequestId,
    /// 0, 1, 2, ... per request.
    pub chunk_id: u32,
    /// Codebook-major codes `[groups, num_frames]`.
    pub codes: Vec<u32>,
    /// Frames in the window.
    pub num_frames: u32,
    /// Leading frames that are context only.
    pub left_context: u32,
    /// The request's last window.
    pub finished: bool,
}

/// One text stage -> speech stage payload of one request: the token ids the text stage produced
/// since its previous one (the speech stage detokenizes them with the text model's tokenizer).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TextDelta {
    /// The request.
    pub request_id: RequestId,
    /// 0, 1, 2, ... per request, so a receiver sees a lost or reordered delta.
    pub chunk_id: u32,
    /// New generated token ids (may be empty on the last delta).
    pub token_ids: Vec<u32>,
    /// The text stage finished the request: no more text comes.
    pub finished: bool,
}

/// What a stage process runs (vLLM-Omni's `model_stage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StageKind {
    /// The Thinker (or any text LLM as a pipeline's first stage): text out; for Qwen3-Omni,
    /// hidden states to the Talker.
    Thinker,
    /// The Talker with its code predictor: codec frames out, in windows to Code2Wav.
    Talker,
    /// Code2Wav: waveforms out.
    Code2Wav,
    /// Text to speech: the text stage's tokens in (detokenized, cut into sentences), waveforms
    /// out (the built-in voice).
    Tts,
}

impl StageKind {
    /// Every kind, in pipeline order.
    pub const ALL: [StageKind; 4] = [
        StageKind::Thinker,
        StageKind::Talker,
        StageKind::Code2Wav,
        StageKind::Tts,
    ];

    /// Lower-case name (`thinker`, `talker`, `code2wav`, `tts`), as a profile's `model_stage`.
    pub fn as_str(self) -> &'static str {
        match self {
            StageKind::Thinker => "thinker",
            StageKind::Talker => "talker",
            StageKind::Code2Wav => "code2wav",
            StageKind::Tts => "tts",
        }
    }

    /// The kind named `name` (a profile's `model_stage`, case-insensitive).
    pub fn from_name(name: &str) -> Option<StageKind> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str().eq_ignore_ascii_case(name.trim()))
    }

    /// Whether the stage's outputs are the request's audio (its last output ends the request).
    pub fn makes_audio(self) -> bool {
        matches!(self, StageKind::Code2Wav | StageKind::Tts)
    }
}

/// Code2Wav windows: `initial` frames first, then `chunk` new frames with `left_context`
/// frames before them (omni.md 6.2). With async chunking off, one window of every frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodecWindowing {
    /// Frames of the first window.
    pub initial: u32,
    /// New frames of each later window.
    pub chunk: u32,
    /// Context frames of each later window.
    pub left_context: u32,
}

/// Everything a stage process needs (its handshake's config): it reads nothing else.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageSpec {
    /// Position in the pipeline.
    pub stage_id: u32,
    /// Which replica of the stage.
    pub replica: u32,
    /// What it runs.
    pub kind: StageKind,
    /// The model directory (`config.json`, safetensors), a GGUF file (a text stage), or the
    /// voice's folder (a TTS stage).
    pub model: String,
    /// The tokenizer a TTS stage detokenizes the text stage's tokens with (the text model's
    /// directory or GGUF file); empty for the other kinds.
    pub tokenizer: String,
    /// The backend its network runs on.
    pub device: crate::Device,
    /// Its GPU (CUDA).
    pub device_ordinal: u32,
    /// Its share of the GPU's memory (weights, buffers, KV cache), as vLLM's
    /// `gpu_memory_utilization`, counted over what this process allocates.
    pub gpu_memory_utilization: f32,
    /// No CUDA graphs.
    pub enforce_eager: bool,
    /// Real weights or random ones of the real shapes.
    pub load_format: LoadFormat,
    /// Seed of random weights and of sampling without a request seed.
    pub seed: u64,
    /// Most requests in one batch.
    pub max_num_seqs: u32,
    /// Most tokens (Thinker, Talker) or frames (Code2Wav) in one step.
    pub max_num_batched_tokens: u32,
    /// Longest sequence (prompt + output).
    pub max_model_len: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks (Thinker, Talker).
    pub num_blocks: u32,
    /// Reuse cached prompt blocks (`enable_prefix_caching`). Only a stage whose positions are
    /// real tokens and that exports no per-position states can honour it (a text LLM Thinker);
    /// the others ignore it.
    pub enable_prefix_caching: bool,
    /// Stream stage payloads as they are produced (`async_chunk`); else one full payload when
    /// the upstream stage finished.
    pub async_chunk: bool,
    /// How the Talker cuts frames into Code2Wav windows.
    pub windowing: CodecWindowing,
    /// Sampling of a request that brings none for this stage.
    pub default_sampling: SamplingParams,
    /// Per-kernel GPU times of this many eager steps, logged (`--cuda-profile-steps`; 0: off;
    /// graphs are off while profiling).
    pub cuda_profile_steps: u32,
    /// Seconds between the stage's `stage profile` log lines (0: off).
    pub profile_interval_s: f32,
}

impl StageSpec {
    /// The process name, `omni-stage-<id>` or `omni-stage-<id>-<replica>` (at most 15 bytes).
    pub fn process_name(&self) -> String {
        let name = if self.replica == 0 {
            format!("omni-stage-{}", self.stage_id)
        } else {
            format!("omni-stage-{}-{}", self.stage_id, self.replica)
        };
        name.chars().take(15).collect()
    }
}

/// A message to a stage process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum StageInput {
    /// A new request: the Thinker starts it; the Talker registers it (voice, sampling) and
    /// starts it once the Thinker's first chunk arrived.
    Add(Box<EngineCoreRequest>),
    /// Thinker states for Talker requests (a step's chunks packed together); tensors are this
    /// message's buffers.
    Thinker(Vec<ThinkerToTalker>),
    /// Code2Wav windows (a Talker step's, packed together).
    Codec(Vec<CodecChunk>),
    /// New text of requests, for a TTS stage (a text stage step's, packed together).
    Text(Vec<TextDelta>),
    /// Stop these requests and free what they hold.
    Abort(Vec<RequestId>),
    /// Finish the step in flight, then exit.
    Shutdown,
}

/// What one turn of a stage's loop produced.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageOutputs {
    /// Per-request outputs: the Thinker's tokens, the Talker's layer-0 codes (its last output
    /// per request has `finish_reason`), Code2Wav's audio.
    pub outputs: Vec<EngineCoreOutput>,
    /// Thinker -> Talker payloads; their tensors index this message's buffers.
    pub thinker_chunks: Vec<ThinkerToTalker>,
    /// Talker -> Code2Wav windows.
    pub codec_chunks: Vec<CodecChunk>,
    /// Requests refused at admission.
    pub rejected: Vec<(RequestId, AddRequestError)>,
    /// Requests that failed in this stage, with why.
    pub failed: Vec<(RequestId, String)>,
    /// The stage's scheduler state.
    pub scheduler_stats: Option<SchedulerStats>,
}

impl StageOutputs {
    /// Whether the message carries nothing but (possibly) stats.
    pub fn is_empty(&self) -> bool {
        self.outputs.is_empty()
            && self.thinker_chunks.is_empty()
            && self.codec_chunks.is_empty()
            && self.rejected.is_empty()
            && self.failed.is_empty()
    }
}

/// An omni pipeline's state for metrics: each stage replica's scheduler, and the bytes each
/// connector carried.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PipelineStats {
    /// `(stage_id, replica, stats)` of every replica.
    pub stages: Vec<(u32, u32, SchedulerStats)>,
    /// `(from_stage, to_stage, bytes so far)` of every connector.
    pub connector_bytes: Vec<(u32, u32, u64)>,
}

/// Buffer bytes one stage message should stay within when chunks are packed together: half
/// of the stage queues' 16 MiB ring slot, so a packed message takes the shared-memory path
/// (a single chunk larger than this still goes alone, over the overflow path if it must).
pub const STAGE_PACK_BYTES: usize = 8 << 20;

/// Renumbers the chunk's tensors to follow the `picked` ones, in order of appearance, and
/// appends the old buffer index of each to `picked`.
pub fn rebase_buffers(chunk: &mut ThinkerToTalker, picked: &mut Vec<usize>) {
    for t in tensors_mut(chunk) {
        picked.push(t.buffer_index as usize);
        t.buffer_index = (picked.len() - 1) as u32;
    }
}

/// The chunk's tensors, in order.
fn tensors_mut(chunk: &mut ThinkerToTalker) -> Vec<&mut TensorRef> {
    match &mut chunk.chunk {
        ThinkerChunk::Prefill(s) | ThinkerChunk::Full(s) => {
            vec![&mut s.embed, &mut s.hidden, &mut s.tts]
        }
        ThinkerChunk::Decode { embed, .. } => vec![embed],
        ThinkerChunk::End => Vec::new(),
    }
}

/// Thinker chunks packed into messages of at most `budget` buffer bytes each (a chunk over the
/// budget goes alone), in order: each pack's chunks index its own buffers `0..k`, and the
/// `Vec<usize>` lists the old index of each (`size(old)` is that buffer's length). One message
/// per step instead of one per request keeps a 64-request step from waiting on 64 ring slots.
pub fn pack_thinker_chunks(
    chunks: Vec<ThinkerToTalker>,
    size: impl Fn(usize) -> usize,
    budget: usize,
) -> Vec<(Vec<ThinkerToTalker>, Vec<usize>)> {
    let mut packs: Vec<(Vec<ThinkerToTalker>, Vec<usize>)> = Vec::new();
    let mut bytes = 0;
    for mut chunk in chunks {
        let mut own = Vec::new();
        rebase_buffers(&mut chunk, &mut own);
        let n: usize = own.iter().map(|&i| size(i)).sum();
        let start_new = match packs.last() {
            None => true,
            Some((c, _)) => !c.is_empty() && bytes + n > budget,
        };
        if start_new {
            packs.push((Vec::new(), Vec::new()));
            bytes = 0;
        }
        if let Some((c, picked)) = packs.last_mut() {
            let base = picked.len() as u32;
            tensors_mut(&mut chunk)
                .into_iter()
                .for_each(|t| t.buffer_index += base);
            picked.extend(own);
            c.push(chunk);
        }
        bytes += n;
    }
    packs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    /// Byte tensors: the checks here are about shapes, and u8 needs no buffer alignment.
    fn tensor(name: &str, shape: &[u64], buffer_index: u32) -> TensorRef {
        TensorRef {
            name: name.into(),
            request_id: None,
            dtype: DType::U8,
            shape: shape.to_vec(),
            buffer_index,
        }
    }

    fn states(rows: u64) -> ThinkerStates {
        ThinkerStates {
            ids: vec![1, 2, 3, 4, 5],
            prompt_len: 4,
            embed: tensor("thinker.embed", &[rows, 8], 0),
            hidden: tensor("thinker.hidden_states.24", &[rows, 8], 1),
            tts: tensor("thinker.tts", &[3, 8], 2),
            speaker: "ethan".into(),
        }
    }

    fn round_trip(m: &ThinkerToTalker) -> ThinkerToTalker {
        let cfg = bincode::config::standard();
        let bytes = bincode::serde::encode_to_vec(m, cfg).unwrap();
        bincode::serde::decode_from_slice(&bytes, cfg).unwrap().0
    }

    #[test]
    fn states_round_trip_and_check_their_buffers() {
        let msg = ThinkerToTalker {
            request_id: "r0".into(),
            chunk_id: 0,
            chunk: ThinkerChunk::Prefill(states(5)),
        };
        assert_eq!(round_trip(&msg), msg);
        let (a, b, c) = (vec![0u8; 40], vec![0u8; 40], vec![0u8; 24]);
        let bufs: Vec<&[u8]> = vec![&a, &b, &c];
        assert!(states(5).view(&bufs).is_ok());
        // 6 rows for 5 ids, a TTS tensor of another width, a buffer of another size: refused.
        let (a6, b6) = (vec![0u8; 48], vec![0u8; 48]);
        let six: Vec<&[u8]> = vec![&a6, &b6, &c];
        assert!(matches!(
            states(6).view(&six),
            Err(StagePayloadError::Shape(_))
        ));
        let mut wrong = states(5);
        wrong.tts.shape = vec![3, 4];
        assert!(wrong.view(&bufs).is_err());
        assert!(matches!(
            states(5).view(&six),
            Err(StagePayloadError::Buffer(_))
        ));
        let end = ThinkerToTalker {
            request_id: "r0".into(),
            chunk_id: 7,
            chunk: ThinkerChunk::End,
        };
        assert_eq!(round_trip(&end), end);
    }

    fn decode(id: &str, buffer_index: u32) -> ThinkerToTalker {
        ThinkerToTalker {
            request_id: id.into(),
            chunk_id: 1,
            chunk: ThinkerChunk::Decode {
                token: 7,
                embed: tensor("thinker.embed", &[1, 8], buffer_index),
            },
        }
    }

    fn indices(c: &ThinkerToTalker) -> Vec<u32> {
        match &c.chunk {
            ThinkerChunk::Prefill(s) | ThinkerChunk::Full(s) => {
                vec![
                    s.embed.buffer_index,
                    s.hidden.buffer_index,
                    s.tts.buffer_index,
                ]
            }
            ThinkerChunk::Decode { embed, .. } => vec![embed.buffer_index],
            ThinkerChunk::End => Vec::new(),
        }
    }

    #[test]
    fn packs_keep_order_and_index_their_own_buffers() {
        // Buffers of the step: a prefill's three (100 bytes each), then two decodes' (10).
        let mut prefill = ThinkerToTalker {
            request_id: "p".into(),
            chunk_id: 0,
            chunk: ThinkerChunk::Prefill(states(5)),
        };
        if let ThinkerChunk::Prefill(st) = &mut prefill.chunk {
            (
                st.embed.buffer_index,
                st.hidden.buffer_index,
                st.tts.buffer_index,
            ) = (2, 3, 4);
        }
        let end = ThinkerToTalker {
            request_id: "e".into(),
            chunk_id: 2,
            chunk: ThinkerChunk::End,
        };
        let chunks = vec![decode("a", 0), prefill, end, decode("b", 1)];
        let size = |i: usize| if i >= 2 { 100 } else { 10 };
        // Everything fits: one pack, indices 0.. in order of appearance.
        let one = pack_thinker_chunks(chunks.clone(), size, 1000);
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].1, [0, 2, 3, 4, 1]);
        let got: Vec<Vec<u32>> = one[0].0.iter().map(indices).collect();
        assert_eq!(got, [vec![0], vec![1, 2, 3], vec![], vec![4]]);
        // A budget under the prefill's 300 bytes: it goes alone, the rest packs around it.
        let split = pack_thinker_chunks(chunks, size, 50);
        let ids: Vec<Vec<&str>> = split
            .iter()
            .map(|(c, _)| c.iter().map(|m| m.request_id.as_str()).collect())
            .collect();
        assert_eq!(ids, [vec!["a"], vec!["p"], vec!["e", "b"]]);
        let picked: Vec<&[usize]> = split.iter().map(|(_, p)| p.as_slice()).collect();
        assert_eq!(picked, [&[0][..], &[2, 3, 4], &[1]]);
        let got: Vec<Vec<u32>> = split[1].0.iter().chain(&split[2].0).map(indices).collect();
        assert_eq!(got, [vec![0, 1, 2], vec![], vec![0]]);
    }
}
