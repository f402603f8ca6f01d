//! The networks a stage drives, on whichever device its spec names: the CPU reference networks
//! here, the CUDA ones in `crate::cuda` (feature `cuda`).

use omni_models::qwen3_omni::code2wav::Code2Wav;
use omni_models::qwen3_omni::thinker::Thinker;
use omni_models::{
    ForwardBatch, LayerKvCache, ModelError, ModelInputs, PositionInputs, StageModel, TokenInputs,
};

/// What one Thinker step gives back, on the host.
#[derive(Debug, Default)]
pub struct ThinkerStep {
    /// Logits of the batch's output rows, `[rows, vocab]`.
    pub logits: Vec<f32>,
    /// With exports: layer 0's input and the accept-layer residual of every computed token,
    /// `[tokens, hidden]` each.
    pub exports: Option<(Vec<f32>, Vec<f32>)>,
}

/// The Thinker on some device, with its KV cache.
pub trait ThinkerNet: Send + std::fmt::Debug {
    /// Width of the exported rows.
    fn hidden_size(&self) -> usize;
    /// Logits row width.
    fn vocab_size(&self) -> usize;
    /// `tts_bos`, `tts_eos`, `tts_pad` embeddings, `[3, hidden]`.
    fn tts_rows(&self) -> &[f32];
    /// One step over token ids; `export` asks for the two Talker states of every token.
    fn forward(&mut self, batch: &ForwardBatch, export: bool) -> Result<ThinkerStep, ModelError>;
}

/// The CPU Thinker (f32) and its host KV cache.
#[derive(Debug)]
pub struct CpuThinker {
    thinker: Thinker,
    kv: Vec<LayerKvCache>,
    tts: Vec<f32>,
}

impl CpuThinker {
    /// Wraps a loaded Thinker with `num_blocks` KV blocks of `block_size`.
    pub fn new(thinker: Thinker, num_blocks: usize, block_size: usize) -> Result<Self, ModelError> {
        let kv = StageModel::kv_cache_spec(&thinker)
            .ok_or_else(|| ModelError::Config("the Thinker has no KV cache".into()))?
            .allocate(num_blocks, block_size);
        let t = thinker.tts_embeddings();
        let tts = [&t.bos, &t.eos, &t.pad]
            .iter()
            .flat_map(|r| r.iter().copied())
            .collect();
        Ok(Self { thinker, kv, tts })
    }
}

impl ThinkerNet for CpuThinker {
    fn hidden_size(&self) -> usize {
        self.thinker.config().thinker_config.text_config.hidden_size
    }

    fn vocab_size(&self) -> usize {
        self.thinker.config().thinker_config.text_config.vocab_size
    }

    fn tts_rows(&self) -> &[f32] {
        &self.tts
    }

    fn forward(&mut self, batch: &ForwardBatch, export: bool) -> Result<ThinkerStep, ModelError> {
        let capture = self.thinker.exports();
        let inputs = ModelInputs {
            batch,
            tokens: TokenInputs::Ids,
            positions: PositionInputs::Batch,
            mm_features: &[],
            capture: if export { &capture } else { &[] },
        };
        let out = StageModel::forward(&self.thinker, &inputs, &mut self.kv)?;
        let mut states = out.hidden_states;
        let mut take = |c| {
            states
                .iter()
                .position(|(k, _)| *k == c)
                .map(|i| states.swap_remove(i).1.data)
        };
        let exports = match (take(capture[0]), take(capture[1])) {
            (Some(e), Some(h)) if export => Some((e, h)),
            _ => None,
        };
        Ok(ThinkerStep {
            logits: out.logits.map(|t| t.data).unwrap_or_default(),
            exports,
        })
    }
}

/// Code2Wav on some device.
pub trait Code2WavNet: Send + std::fmt::Debug {
    /// Codebooks per frame.
    fn num_quantizers(&self) -> usize;
    /// Decodes windows `(codes [q, T], T, left_context)` together; each trimmed to its new audio.
    fn decode_windows(
        &mut self,
        windows: &[(&[u32], usize, usize)],
    ) -> Result<Vec<Vec<f32>>, ModelError>;
}

impl Code2WavNet for Code2Wav {
    fn num_quantizers(&self) -> usize {
        self.config().num_quantizers
    }

    fn decode_windows(
        &mut self,
        windows: &[(&[u32], usize, usize)],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        Code2Wav::decode_windows(self, windows)
    }
}
