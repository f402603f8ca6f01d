//! The code predictor (`talker.code_predictor.*`): a dense Qwen3 decoder that writes residual
//! codebooks 1..`num_code_groups - 1` of one frame, one group after another.
//!
//! For a frame whose layer-0 code `c0` the Talker chose from its final-norm state `h`:
//! the sequence `[h, codec_embedding(c0)]` is run (positions 0, 1) and `lm_head[0]` of the last
//! position gives `c1`; then `codec_embedding[g-1](c_g)` is appended (position `g + 1`) and
//! `lm_head[g]` gives `c_{g+1}`, up to the last group. Each frame starts a fresh sequence (a
//! scratch KV cache per call; transformers runs it as a fresh `generate`, vLLM-Omni re-prefills:
//! all three are the same computation). Requests of a batch run together, one sequence each.

use crate::batch::{ForwardBatch, SeqChunk};
use crate::decoder::{DecoderModel, TpContext, load_shaped};
use crate::error::ModelError;
use crate::interface::{Capture, ModelInputs, PositionInputs, StageModel, TokenInputs};
use crate::qwen3_omni::config::TalkerConfig;
use crate::weights::{SubmodelWeights, WeightSource};

/// Tokens per block of the scratch KV cache.
const BLOCK: usize = 16;

/// One batch of frames from [`CodePredictor::predict`].
#[derive(Debug, Clone, PartialEq)]
pub struct PredictedFrames {
    /// `[rows, num_code_groups]`: `c0` then the predicted groups.
    pub codes: Vec<u32>,
    /// `[rows, hidden]`: the sum of the frame's codec embeddings (the next Talker input, before
    /// its text vector is added).
    pub codec_sum: Vec<f32>,
}

/// The code predictor, replicated on every rank.
#[derive(Debug)]
pub struct CodePredictor {
    decoder: DecoderModel,
    /// `num_code_groups - 1` tables `[vocab, hidden]`.
    embeddings: Vec<Vec<f32>>,
    /// `num_code_groups - 1` heads `[vocab, hidden]`.
    heads: Vec<Vec<f32>>,
    vocab: usize,
    hidden: usize,
}

impl CodePredictor {
    /// Loads it from a whole Qwen3-Omni checkpoint's weights.
    pub fn load(t: &TalkerConfig, ws: &dyn WeightSource) -> Result<Self, ModelError> {
        let c = &t.code_predictor_config;
        let spec = c.spec(false)?;
        let decoder = DecoderModel::load(
            spec,
            &SubmodelWeights::new(ws, "talker.code_predictor.", &[]),
            TpContext::single(),
        )?;
        let (v, h) = (c.vocab_size, c.hidden_size);
        let groups = t.num_code_groups - 1;
        let table = |n: String| load_shaped(ws, &n, &[v, h]).map(|t| t.data);
        Ok(Self {
            decoder,
            embeddings: (0..groups)
                .map(|g| {
                    table(format!(
                        "talker.code_predictor.model.codec_embedding.{g}.weight"
                    ))
                })
                .collect::<Result<_, _>>()?,
            heads: (0..groups)
                .map(|g| table(format!("talker.code_predictor.lm_head.{g}.weight")))
                .collect::<Result<_, _>>()?,
            vocab: v,
            hidden: h,
        })
    }

    /// Every tensor it reads, with its checkpoint name and shape.
    pub fn weight_shapes(t: &TalkerConfig) -> Result<Vec<(String, Vec<usize>)>, ModelError> {
        let c = &t.code_predictor_config;
        let mut v: Vec<(String, Vec<usize>)> = c
            .spec(false)?
            .weight_shapes()
            .into_iter()
            .map(|(n, s)| (format!("talker.code_predictor.{n}"), s))
            .collect();
        for g in 0..t.num_code_groups - 1 {
            let shape = vec![c.vocab_size, c.hidden_size];
            v.push((
                format!("talker.code_predictor.model.codec_embedding.{g}.weight"),
                shape.clone(),
            ));
            v.push((format!("talker.code_predictor.lm_head.{g}.weight"), shape));
        }
        Ok(v)
    }

    /// Residual groups per frame.
    pub fn num_groups(&self) -> usize {
        self.heads.len()
    }

    /// Codes per group (the heads' width).
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Completes one frame per row. `hidden` is `[rows, hidden]`, the Talker's final-norm state
    /// at the position that chose `c0`; `c0_embed` is `codec_embedding(c0)` `[rows, hidden]`.
    /// `choose(row, group, logits)` picks group `group`'s code (1-based) from its logits (greedy
    /// or [`super::sampling::top_k_top_p`]).
    pub fn predict(
        &self,
        hidden: &[f32],
        c0: &[u32],
        c0_embed: &[f32],
        choose: &mut dyn FnMut(usize, usize, &mut [f32]) -> u32,
    ) -> Result<PredictedFrames, ModelError> {
        let (rows, h, v) = (c0.len(), self.hidden, self.vocab);
        if hidden.len() != rows * h || c0_embed.len() != rows * h {
            return Err(ModelError::Batch(format!(
                "code predictor: {rows} rows, {} hidden and {} embedding values (width {h})",
                hidden.len(),
                c0_embed.len()
            )));
        }
        let groups = self.num_groups();
        let seq_len = groups + 1;
        let blocks = seq_len.div_ceil(BLOCK);
        let spec = StageModel::kv_cache_spec(&self.decoder)
            .ok_or_else(|| ModelError::Batch("code predictor without KV cache".into()))?;
        let mut kv = spec.allocate(rows * blocks, BLOCK);
        let tables: Vec<Vec<u32>> = (0..rows)
            .map(|r| ((r * blocks) as u32..((r + 1) * blocks) as u32).collect())
            .collect();
        let mut codes = vec![0u32; rows * (groups + 1)];
        let mut sum = c0_embed.to_vec();
        for (r, &c) in c0.iter().enumerate() {
            codes[r * (groups + 1)] = c;
        }
        let mut input: Vec<f32> = Vec::with_capacity(rows * 2 * h);
        for r in 0..rows {
            input.extend_from_slice(&hidden[r * h..(r + 1) * h]);
            input.extend_from_slice(&c0_embed[r * h..(r + 1) * h]);
        }
        let mut logits = vec![0.0; rows * v];
        for g in 1..=groups {
            let (width, start) = if g == 1 { (2, 0) } else { (1, g) };
            let dummy = vec![0u32; width];
            let chunks: Vec<SeqChunk<'_>> = tables
                .iter()
                .map(|bt| SeqChunk {
                    tokens: &dummy,
                    start_pos: start,
                    block_table: bt,
                })
                .collect();
            let batch = ForwardBatch::from_chunks(&chunks, BLOCK)?;
            let out = StageModel::forward(
                &self.decoder,
                &ModelInputs {
                    batch: &batch,
                    tokens: TokenInputs::Embeds(&input),
                    positions: PositionInputs::Batch,
                    mm_features: &[],
                    capture: &[Capture::FinalNorm],
                },
                &mut kv,
            )?;
            let last = out
                .hidden_states
                .into_iter()
                .find(|(c, _)| *c == Capture::FinalNorm)
                .map(|(_, t)| t.data)
                .ok_or_else(|| ModelError::Batch("code predictor: no final state".into()))?;
            input.clear();
            omni_backend::linalg::matmul_nt(&last, &self.heads[g - 1], &mut logits, rows, h, v)?;
            for (r, row) in logits.chunks_exact_mut(v).enumerate() {
                let code = choose(r, g, row);
                if code as usize >= v {
                    return Err(ModelError::Batch(format!(
                        "code predictor: chose code {code} of {v}"
                    )));
                }
                codes[r * (groups + 1) + g] = code;
                let e = &self.embeddings[g - 1][code as usize * h..(code as usize + 1) * h];
                sum[r * h..(r + 1) * h]
                    .iter_mut()
                    .zip(e)
                    .for_each(|(s, x)| *s += x);
                input.extend_from_slice(e);
            }
        }
        Ok(PredictedFrames {
            codes,
            codec_sum: sum,
        })
    }
}
