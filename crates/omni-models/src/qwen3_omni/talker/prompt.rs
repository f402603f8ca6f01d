//! The Talker's input, built from what the Thinker exported (transformers'
//! `_get_talker_user_parts` / `_get_talker_assistant_parts`; omni.md §2.2).
//!
//! The Thinker prompt splits at every `<|im_start|>`; the role is the token after it.
//! - system segments and earlier assistant turns are dropped;
//! - every user segment (its `<|im_start|>` up to the next one) is kept position by position:
//!   `hidden_projection(layer accept_hidden_layer)` at audio/image/video placeholders,
//!   `text_projection(layer 0)` elsewhere;
//! - the last `<|im_start|>assistant` segment gives 9 positions, each a text-side vector plus a
//!   codec embedding: `A[0..3]` (`<|im_start|>`, `assistant`, `\n`) with no codec; four
//!   `tts_pad` with `codec_nothink`, `codec_think_bos`, `codec_think_eos`, the speaker; `tts_bos`
//!   with `codec_pad`; the first generated token `A[3]` with `codec_bos`;
//! - the trailing text `A[4..]` then `tts_eos` is consumed one vector per decode step, and
//!   `tts_pad` after it.
//!
//! `A` is `text_projection` of the Thinker's layer-0 states from the assistant's
//! `<|im_start|>` on, over the prompt and the generated tokens that were fed back (the last
//! generated token never is).

use std::collections::HashMap;

use crate::error::ModelError;
use crate::qwen3_omni::config::OmniConfig;
use crate::qwen3_omni::talker::{ResizeMlp, Talker};
use crate::qwen3_omni::thinker::TtsEmbeddings;
use crate::weights::WeightSource;

/// What crossed from the Thinker for one request.
#[derive(Debug, Clone, Copy)]
pub struct ThinkerExports<'a> {
    /// The Thinker's tokens: prompt, then generated.
    pub ids: &'a [u32],
    /// How many of `ids` are the prompt.
    pub prompt_len: usize,
    /// Layer-0 input embeddings, `[rows, thinker_hidden]`, for the first `rows` of `ids`
    /// (every position the Thinker computed).
    pub embed: &'a [f32],
    /// The residual stream after `accept_hidden_layer` layers, same rows.
    pub hidden: &'a [f32],
    /// The TTS tokens' Thinker embeddings.
    pub tts: &'a TtsEmbeddings,
}

/// The Talker's input for one request, `[_, talker_hidden]` row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct TalkerPrompt {
    /// The prefill: user segments, then the 9 assistant positions.
    pub prefill: Vec<f32>,
    /// One text vector per decode step (`A[4..]`, then `tts_eos`).
    pub trailing_text: Vec<f32>,
    /// `text_projection(tts_pad)`: the text vector once the trailing text is used up.
    pub tts_pad: Vec<f32>,
    /// Width of every row.
    pub hidden: usize,
}

impl TalkerPrompt {
    /// Rows of the prefill.
    pub fn prefill_len(&self) -> usize {
        self.prefill.len() / self.hidden
    }

    /// The text vector of decode step `step` (0 = the step after the prefill).
    pub fn text_for_step(&self, step: usize) -> &[f32] {
        let h = self.hidden;
        self.trailing_text
            .get(step * h..(step + 1) * h)
            .unwrap_or(&self.tts_pad)
    }
}

impl Talker {
    /// Builds the Talker's prefill and trailing text for `speaker` (a codec id; see
    /// [`crate::qwen3_omni::config::TalkerConfig::speaker`]).
    pub fn build_prompt(
        &self,
        ex: &ThinkerExports<'_>,
        speaker: u32,
    ) -> Result<TalkerPrompt, ModelError> {
        self.prompt_builder().build(ex, speaker)
    }
}

/// Which of the Talker's two input projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Projection {
    /// `text_projection`: layer-0 Thinker states (text positions, fed-back tokens, TTS tokens).
    Text,
    /// `hidden_projection`: accept-layer Thinker states at multimodal positions.
    Hidden,
}

/// Runs a projection of `[rows, thinker_hidden]` (the builder's own on the host, or a
/// device copy of it).
pub type Project<'a> = dyn FnMut(Projection, &[f32]) -> Result<Vec<f32>, ModelError> + 'a;

/// Reads `codec_embedding` rows of codec ids, `[ids, hidden]`.
pub type CodecRows<'a> = dyn Fn(&[u32]) -> Result<Vec<f32>, ModelError> + 'a;

/// What building a Talker prompt takes: the two projections and the `codec_embedding` rows of
/// the codec ids the bootstrap uses (its fixed tokens and every speaker). A CUDA Talker builds
/// its prompts with one of these on the host.
#[derive(Debug, Clone)]
pub struct PromptBuilder {
    config: OmniConfig,
    text_projection: ResizeMlp,
    hidden_projection: ResizeMlp,
    codec: HashMap<u32, Vec<f32>>,
    hidden: usize,
}

impl PromptBuilder {
    /// Loads the projections (`talker.text_projection`, `talker.hidden_projection`) and reads
    /// the codec rows it needs through `codec_rows` (ids -> `[ids, hidden]`: the CPU Talker's
    /// table, or a device's).
    pub fn load(
        config: &OmniConfig,
        ws: &dyn WeightSource,
        codec_rows: &CodecRows<'_>,
    ) -> Result<Self, ModelError> {
        let t = &config.talker_config;
        let (th, mid, h) = (
            t.thinker_hidden_size,
            t.text_config.intermediate_size,
            t.text_config.hidden_size,
        );
        let text_projection = ResizeMlp::load(ws, "talker.text_projection", th, mid, h)?;
        let hidden_projection = ResizeMlp::load(ws, "talker.hidden_projection", th, mid, h)?;
        let mut ids = vec![
            t.codec_nothink_id,
            t.codec_think_bos_id,
            t.codec_think_eos_id,
            t.codec_pad_id,
            t.codec_bos_id,
        ];
        ids.extend(t.speaker_id.values().copied());
        ids.sort_unstable();
        ids.dedup();
        let rows = codec_rows(&ids)?;
        if rows.len() != ids.len() * h {
            return Err(ModelError::Batch(format!(
                "{} codec embedding values for {} ids of width {h}",
                rows.len(),
                ids.len()
            )));
        }
        let codec = ids
            .iter()
            .zip(rows.chunks_exact(h))
            .map(|(&id, r)| (id, r.to_vec()))
            .collect();
        Ok(Self {
            config: config.clone(),
            text_projection,
            hidden_projection,
            codec,
            hidden: h,
        })
    }

    /// `text_projection` of `[rows, thinker_hidden]`.
    pub fn project_text(&self, x: &[f32]) -> Result<Vec<f32>, ModelError> {
        self.text_projection.forward(x)
    }

    /// `hidden_projection` of `[rows, thinker_hidden]`.
    pub fn project_hidden(&self, x: &[f32]) -> Result<Vec<f32>, ModelError> {
        self.hidden_projection.forward(x)
    }

    /// The projection `which` itself (its weights, for a device copy).
    pub fn projection(&self, which: Projection) -> &ResizeMlp {
        match which {
            Projection::Text => &self.text_projection,
            Projection::Hidden => &self.hidden_projection,
        }
    }

    /// The `codec_embedding` rows of `ids` (each one the builder holds).
    fn embed_codec(&self, ids: &[u32]) -> Result<Vec<f32>, ModelError> {
        let mut out = Vec::with_capacity(ids.len() * self.hidden);
        for id in ids {
            let row = self.codec.get(id).ok_or_else(|| {
                ModelError::Batch(format!("codec id {id} is not a speaker or bootstrap token"))
            })?;
            out.extend_from_slice(row);
        }
        Ok(out)
    }

    /// Builds the Talker's prefill and trailing text for `speaker` (a codec id), projecting on
    /// the host.
    pub fn build(&self, ex: &ThinkerExports<'_>, speaker: u32) -> Result<TalkerPrompt, ModelError> {
        self.build_with(ex, speaker, &mut |which, x| {
            self.projection(which).forward(x)
        })
    }

    /// [`PromptBuilder::build`] with the projections run by `project`.
    pub fn build_with(
        &self,
        ex: &ThinkerExports<'_>,
        speaker: u32,
        project: &mut Project<'_>,
    ) -> Result<TalkerPrompt, ModelError> {
        let c = &self.config;
        let (ids, t) = (&c.ids, &c.talker_config);
        let th = t.thinker_hidden_size;
        let h = self.hidden;
        let rows = ex.embed.len() / th.max(1);
        if ex.embed.len() != rows * th || ex.hidden.len() != ex.embed.len() {
            return Err(ModelError::Batch(format!(
                "Thinker exports of {} and {} values are not matching rows of width {th}",
                ex.embed.len(),
                ex.hidden.len()
            )));
        }
        if ex.prompt_len > ex.ids.len() || rows > ex.ids.len() || rows < ex.prompt_len {
            return Err(ModelError::Batch(format!(
                "{rows} exported rows for a prompt of {} and {} tokens in all",
                ex.prompt_len,
                ex.ids.len()
            )));
        }
        let prompt = &ex.ids[..ex.prompt_len];
        // Role of each prompt position: the token after the latest <|im_start|>.
        let mut role = None;
        let mut user_rows = Vec::new();
        for (i, &tok) in prompt.iter().enumerate() {
            if tok == ids.im_start_token_id {
                role = prompt.get(i + 1).copied();
            }
            if role == Some(ids.user_token_id) {
                user_rows.push(i);
            }
        }
        let assistant_start = (0..prompt.len().saturating_sub(1))
            .rev()
            .find(|&i| {
                prompt[i] == ids.im_start_token_id && prompt[i + 1] == ids.assistant_token_id
            })
            .ok_or_else(|| {
                ModelError::Batch(
                    "the Thinker prompt has no `<|im_start|>assistant` turn for the Talker".into(),
                )
            })?;
        let mm = [t.audio_token_id, t.image_token_id, t.video_token_id];
        let row = |x: &[f32], r: usize| x[r * th..(r + 1) * th].to_vec();
        let mut prefill = Vec::with_capacity((user_rows.len() + 9) * h);
        // Consecutive runs of one kind go through one projection call.
        let mut i = 0;
        while i < user_rows.len() {
            let is_mm = |r: usize| mm.contains(&ex.ids[r]);
            let kind = is_mm(user_rows[i]);
            let mut j = i;
            let mut block = Vec::new();
            while j < user_rows.len() && is_mm(user_rows[j]) == kind {
                let src = if kind { ex.hidden } else { ex.embed };
                block.extend(row(src, user_rows[j]));
                j += 1;
            }
            let which = if kind {
                Projection::Hidden
            } else {
                Projection::Text
            };
            let projected = project(which, &block)?;
            prefill.extend(projected);
            i = j;
        }
        let a_rows: Vec<f32> = ex.embed[assistant_start * th..].to_vec();
        let a = project(Projection::Text, &a_rows)?;
        let a_len = a.len() / h;
        let a_row = |k: usize| -> Vec<f32> {
            if k < a_len {
                a[k * h..(k + 1) * h].to_vec()
            } else {
                vec![0.0; h]
            }
        };
        let tts_rows = [ex.tts.bos.as_slice(), &ex.tts.eos, &ex.tts.pad].concat();
        let tts = project(Projection::Text, &tts_rows)?;
        let (tts_bos, tts_eos, tts_pad) = (&tts[..h], &tts[h..2 * h], &tts[2 * h..]);
        let codec = self.embed_codec(&[
            t.codec_nothink_id,
            t.codec_think_bos_id,
            t.codec_think_eos_id,
            speaker,
            t.codec_pad_id,
            t.codec_bos_id,
        ])?;
        for k in 0..3 {
            prefill.extend(a_row(k));
        }
        let text_side: [&[f32]; 6] = [tts_pad, tts_pad, tts_pad, tts_pad, tts_bos, &a_row(3)];
        for (k, text) in text_side.iter().enumerate() {
            prefill.extend(
                text.iter()
                    .zip(&codec[k * h..(k + 1) * h])
                    .map(|(x, y)| x + y),
            );
        }
        let mut trailing_text = Vec::new();
        if a_len > 4 {
            trailing_text.extend_from_slice(&a[4 * h..]);
        }
        trailing_text.extend_from_slice(tts_eos);
        Ok(TalkerPrompt {
            prefill,
            trailing_text,
            tts_pad: tts_pad.to_vec(),
            hidden: h,
        })
    }
}
