//! `config.json`'s `code2wav_config`, and the table of every tensor Code2Wav reads.
//!
//! Every size comes from the file (a missing one is an error). Two switches that are not sizes
//! fall back to the architecture's only values when absent: `attention_bias` (false) and
//! `hidden_act` (silu). What the file does not describe is fixed by the architecture
//! (transformers' `Qwen3OmniMoeCode2Wav` modules): the ConvNeXt blocks (depthwise kernel 7,
//! LayerNorm eps 1e-6, 4x MLP), the decoder's kernel-7 convs and the residual dilations 1, 3, 9.

use serde::Deserialize;
use serde_json::Value;

use crate::error::ModelError;
use crate::hf_config::{require_silu, rope_settings};
use omni_backend::rope::RopeScaling;

/// Kernel of every non-transposed conv of the vocoder except the residual units' 1x1.
pub const CONV_KERNEL: usize = 7;
/// Dilations of the three residual units of each decoder block.
pub const RESIDUAL_DILATIONS: [usize; 3] = [1, 3, 9];
/// `nn.LayerNorm(dim, eps=1e-6)` in the ConvNeXt blocks.
pub const CONVNEXT_LN_EPS: f32 = 1e-6;
/// ConvNeXt MLP width over the hidden size.
pub const CONVNEXT_EXPANSION: usize = 4;

/// `rope_parameters` (transformers 5 form).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RopeParameters {
    /// RoPE base.
    pub rope_theta: f64,
    /// Only `default` is supported.
    #[serde(default)]
    pub rope_type: Option<String>,
}

/// The fields of `code2wav_config` the decoder reads.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Code2WavConfig {
    /// Codes per codebook (the embedding table holds `num_quantizers` such blocks).
    pub codebook_size: usize,
    /// Codebooks per frame.
    pub num_quantizers: usize,
    /// Pre-transformer width.
    pub hidden_size: usize,
    /// Pre-transformer MLP width.
    pub intermediate_size: usize,
    /// Pre-transformer layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads.
    pub num_key_value_heads: usize,
    /// Head size; when absent `hidden_size / num_attention_heads` (transformers' rule).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Keys per query, the query included (causal sliding window).
    pub sliding_window: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base (transformers 4 form).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE base (transformers 5 form).
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    /// Biases on q/k/v/o.
    #[serde(default)]
    pub attention_bias: bool,
    /// MLP activation (silu).
    #[serde(default = "crate::hf_config::default_act")]
    pub hidden_act: String,
    /// Channels after the decoder's first conv; halved by each decoder block.
    pub decoder_dim: usize,
    /// The decoder blocks' upsampling rates (transposed conv kernel `2r`, stride `r`).
    pub upsample_rates: Vec<usize>,
    /// The ConvNeXt upsampling stages' factors (transposed conv kernel = stride = factor).
    pub upsampling_ratios: Vec<usize>,
}

impl Code2WavConfig {
    /// Parses and checks `code2wav_config` of the whole `config.json`.
    pub fn from_model_config(config: &Value) -> Result<Self, ModelError> {
        let c2w = config
            .get("code2wav_config")
            .ok_or_else(|| ModelError::Config("no `code2wav_config`".into()))?;
        let c = Self::deserialize(c2w)?;
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), ModelError> {
        require_silu(&self.hidden_act)?;
        let bad = |m: String| Err(ModelError::Config(format!("code2wav_config: {m}")));
        let sizes = [
            ("codebook_size", self.codebook_size),
            ("num_quantizers", self.num_quantizers),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("sliding_window", self.sliding_window),
            ("decoder_dim", self.decoder_dim),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return bad(format!("{name} is 0"));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "{} heads over {} KV heads",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return bad("hidden_size not divisible by num_attention_heads".into());
        }
        let halvings = 1usize << self.upsample_rates.len();
        if !self.decoder_dim.is_multiple_of(halvings) {
            return bad(format!(
                "decoder_dim {} does not halve {} times",
                self.decoder_dim,
                self.upsample_rates.len()
            ));
        }
        if self
            .upsample_rates
            .iter()
            .chain(&self.upsampling_ratios)
            .any(|&r| r == 0)
        {
            return bad("an upsampling rate is 0".into());
        }
        self.rope_theta()?;
        Ok(())
    }

    /// Elements per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// The RoPE base, from `rope_parameters` or `rope_theta` (one of them is required).
    pub fn rope_theta(&self) -> Result<f32, ModelError> {
        if self.rope_theta.is_none() && self.rope_parameters.is_none() {
            return Err(ModelError::Config(
                "code2wav_config: neither `rope_parameters` nor `rope_theta`".into(),
            ));
        }
        let params = self.rope_parameters.as_ref().map(|p| {
            serde_json::json!({
                "rope_theta": p.rope_theta,
                "rope_type": p.rope_type.as_deref().unwrap_or("default"),
            })
        });
        let (theta, scaling) = rope_settings(self.rope_theta, None, params.as_ref(), 0.0)?;
        if scaling != RopeScaling::None {
            return Err(ModelError::Config(
                "code2wav_config: only default RoPE is supported".into(),
            ));
        }
        Ok(theta)
    }

    /// Output samples per frame: the product of every upsampling factor (1920 for the real
    /// checkpoint: 2 * 2 * 8 * 5 * 4 * 3).
    pub fn samples_per_frame(&self) -> usize {
        self.upsampling_ratios
            .iter()
            .chain(&self.upsample_rates)
            .product()
    }

    /// Checks a batch of Code2Wav requests `(codes [num_quantizers, T], T)`: each has
    /// `num_quantizers * T` codes, all inside the codebook.
    pub fn check_requests(&self, requests: &[(&[u32], usize)]) -> Result<(), ModelError> {
        let nq = self.num_quantizers;
        for (i, &(codes, t)) in requests.iter().enumerate() {
            if codes.len() != nq * t {
                return Err(ModelError::Batch(format!(
                    "request {i}: {} codes for {nq} quantizers x {t} frames",
                    codes.len()
                )));
            }
            if let Some(&bad) = codes.iter().find(|&&x| x as usize >= self.codebook_size) {
                return Err(ModelError::Batch(format!(
                    "request {i}: code {bad} outside the codebook of {}",
                    self.codebook_size
                )));
            }
        }
        Ok(())
    }

    /// Waveform samples a decode of `frames` frames yields (`1920 * T - 555` for the real
    /// checkpoint), following the lengths through the stack: each ConvNeXt stage multiplies by
    /// its factor, each decoder block maps `L` to `(L - 1) * r`. Zero for zero frames.
    pub fn num_samples(&self, frames: usize) -> usize {
        if frames == 0 {
            return 0;
        }
        let len = frames * self.upsampling_ratios.iter().product::<usize>();
        self.upsample_rates
            .iter()
            .fold(len, |l, &r| l.saturating_sub(1) * r)
    }

    /// Channels in and out of decoder block `i`.
    pub fn block_channels(&self, i: usize) -> (usize, usize) {
        (self.decoder_dim >> i, self.decoder_dim >> (i + 1))
    }

    /// Every tensor the network reads, with its shape (for `--load-format dummy` and checks).
    pub fn weight_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i, hd) = (self.hidden_size, self.intermediate_size, self.head_dim());
        let (q_out, kv_out) = (self.num_attention_heads * hd, self.num_key_value_heads * hd);
        let mut v: Vec<(String, Vec<usize>)> = Vec::new();
        let mut add = |name: String, shape: &[usize]| v.push((name, shape.to_vec()));
        add(
            "code2wav.code_embedding.weight".into(),
            &[self.num_quantizers * self.codebook_size, h],
        );
        for l in 0..self.num_hidden_layers {
            let p = format!("code2wav.pre_transformer.layers.{l}");
            add(format!("{p}.input_layernorm.weight"), &[h]);
            add(format!("{p}.post_attention_layernorm.weight"), &[h]);
            for (proj, rows) in [("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)] {
                add(format!("{p}.self_attn.{proj}.weight"), &[rows, h]);
                if self.attention_bias {
                    add(format!("{p}.self_attn.{proj}.bias"), &[rows]);
                }
            }
            add(format!("{p}.self_attn.o_proj.weight"), &[h, q_out]);
            if self.attention_bias {
                add(format!("{p}.self_attn.o_proj.bias"), &[h]);
            }
            add(format!("{p}.mlp.gate_proj.weight"), &[i, h]);
            add(format!("{p}.mlp.up_proj.weight"), &[i, h]);
            add(format!("{p}.mlp.down_proj.weight"), &[h, i]);
            add(format!("{p}.self_attn_layer_scale.scale"), &[h]);
            add(format!("{p}.mlp_layer_scale.scale"), &[h]);
        }
        add("code2wav.pre_transformer.norm.weight".into(), &[h]);
        let wide = CONVNEXT_EXPANSION * h;
        for (n, &f) in self.upsampling_ratios.iter().enumerate() {
            let p = format!("code2wav.upsample.{n}");
            add(format!("{p}.0.conv.weight"), &[h, h, f]);
            add(format!("{p}.0.conv.bias"), &[h]);
            add(format!("{p}.1.dwconv.conv.weight"), &[h, 1, CONV_KERNEL]);
            add(format!("{p}.1.dwconv.conv.bias"), &[h]);
            add(format!("{p}.1.norm.weight"), &[h]);
            add(format!("{p}.1.norm.bias"), &[h]);
            add(format!("{p}.1.pwconv1.weight"), &[wide, h]);
            add(format!("{p}.1.pwconv1.bias"), &[wide]);
            add(format!("{p}.1.pwconv2.weight"), &[h, wide]);
            add(format!("{p}.1.pwconv2.bias"), &[h]);
            add(format!("{p}.1.gamma"), &[h]);
        }
        let d = self.decoder_dim;
        add(
            "code2wav.decoder.0.conv.weight".into(),
            &[d, h, CONV_KERNEL],
        );
        add("code2wav.decoder.0.conv.bias".into(), &[d]);
        for (b, &r) in self.upsample_rates.iter().enumerate() {
            let (cin, cout) = self.block_channels(b);
            let p = format!("code2wav.decoder.{}.block", b + 1);
            add(format!("{p}.0.alpha"), &[cin]);
            add(format!("{p}.0.beta"), &[cin]);
            add(format!("{p}.1.conv.weight"), &[cin, cout, 2 * r]);
            add(format!("{p}.1.conv.bias"), &[cout]);
            for u in 0..RESIDUAL_DILATIONS.len() {
                let q = format!("{p}.{}", u + 2);
                for act in ["act1", "act2"] {
                    add(format!("{q}.{act}.alpha"), &[cout]);
                    add(format!("{q}.{act}.beta"), &[cout]);
                }
                add(format!("{q}.conv1.conv.weight"), &[cout, cout, CONV_KERNEL]);
                add(format!("{q}.conv1.conv.bias"), &[cout]);
                add(format!("{q}.conv2.conv.weight"), &[cout, cout, 1]);
                add(format!("{q}.conv2.conv.bias"), &[cout]);
            }
        }
        let last = self.upsample_rates.len();
        let out_dim = d >> last;
        add(format!("code2wav.decoder.{}.alpha", last + 1), &[out_dim]);
        add(format!("code2wav.decoder.{}.beta", last + 1), &[out_dim]);
        add(
            format!("code2wav.decoder.{}.conv.weight", last + 2),
            &[1, out_dim, CONV_KERNEL],
        );
        add(format!("code2wav.decoder.{}.conv.bias", last + 2), &[1]);
        v
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The real checkpoint's `code2wav_config` (transformers 5 form).
    pub(crate) fn real() -> Value {
        serde_json::json!({"code2wav_config": {
            "attention_bias": false, "codebook_size": 2048, "decoder_dim": 1536,
            "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
            "num_attention_heads": 16, "num_hidden_layers": 8, "num_key_value_heads": 16,
            "num_quantizers": 16, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_theta": 10000, "rope_type": "default"},
            "sliding_window": 72, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2]
        }})
    }

    #[test]
    fn real_sizes_give_1920_samples_per_frame_less_555() {
        let c = Code2WavConfig::from_model_config(&real()).unwrap();
        assert_eq!(c.samples_per_frame(), 1920);
        assert_eq!(c.head_dim(), 64);
        assert_eq!(c.rope_theta().unwrap(), 10000.0);
        for t in [1, 4, 25, 29, 50] {
            assert_eq!(c.num_samples(t), 1920 * t - 555);
        }
        assert_eq!(c.num_samples(0), 0);
    }

    #[test]
    fn real_weight_table_counts_216_million_parameters() {
        let c = Code2WavConfig::from_model_config(&real()).unwrap();
        let params: usize = c
            .weight_shapes()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum();
        assert_eq!(params, 216_016_577);
    }

    #[test]
    fn missing_sizes_and_rope_are_errors() {
        let mut v = real();
        v["code2wav_config"]
            .as_object_mut()
            .unwrap()
            .remove("decoder_dim");
        assert!(Code2WavConfig::from_model_config(&v).is_err());
        let mut v = real();
        v["code2wav_config"]
            .as_object_mut()
            .unwrap()
            .remove("rope_parameters");
        assert!(Code2WavConfig::from_model_config(&v).is_err());
        v["code2wav_config"]["rope_theta"] = serde_json::json!(10000.0);
        assert!(Code2WavConfig::from_model_config(&v).is_ok());
        assert!(Code2WavConfig::from_model_config(&serde_json::json!({})).is_err());
    }
}
