//! Code2Wav's weights on the device, read by the checkpoint names the CPU
//! [`crate::qwen3_omni::code2wav::Code2Wav`] reads: GEMM matrices in bf16 (convolutions
//! reordered for im2col / col2im), every per-channel vector in f32, SnakeBeta as
//! `(exp(alpha), 1 / (exp(beta) + 1e-9))`.

use omni_backend::cuda::audio::{conv_weight_gemm, snake_params, transconv_weight_gemm};
use omni_backend::cuda::cudarc::driver::CudaSlice;
use omni_backend::cuda::{CudaContext, bf16};

use crate::ModelError;
use crate::decoder::load_shaped;
use crate::qwen3_omni::code2wav::Code2WavConfig;
use crate::qwen3_omni::code2wav::config::{CONV_KERNEL, CONVNEXT_EXPANSION, RESIDUAL_DILATIONS};
use crate::weights::WeightSource;

#[derive(Debug)]
pub(super) struct DSnake {
    pub(super) alpha: CudaSlice<f32>,
    pub(super) inv_beta: CudaSlice<f32>,
}

#[derive(Debug)]
pub(super) struct DLayer {
    pub(super) input_norm: CudaSlice<f32>,
    pub(super) post_norm: CudaSlice<f32>,
    /// `[q; k; v]` stacked: `[(heads + 2 kv_heads) * head_dim, hidden]`.
    pub(super) qkv: CudaSlice<bf16>,
    pub(super) o: CudaSlice<bf16>,
    /// `[gate; up]` stacked: `[2 * intermediate, hidden]`.
    pub(super) gate_up: CudaSlice<bf16>,
    pub(super) down: CudaSlice<bf16>,
    pub(super) attn_scale: CudaSlice<f32>,
    pub(super) mlp_scale: CudaSlice<f32>,
}

/// A ConvNeXt upsampling stage.
#[derive(Debug)]
pub(super) struct DUpsample {
    pub(super) factor: usize,
    /// `[factor * hidden, hidden]` ([`transconv_weight_gemm`]).
    pub(super) up_w: CudaSlice<bf16>,
    pub(super) up_b: CudaSlice<f32>,
    /// `[hidden, 7]`.
    pub(super) dw_w: CudaSlice<f32>,
    pub(super) dw_b: CudaSlice<f32>,
    pub(super) ln_w: CudaSlice<f32>,
    pub(super) ln_b: CudaSlice<f32>,
    pub(super) pw1_w: CudaSlice<bf16>,
    pub(super) pw1_b: CudaSlice<f32>,
    pub(super) pw2_w: CudaSlice<bf16>,
    pub(super) pw2_b: CudaSlice<f32>,
    pub(super) gamma: CudaSlice<f32>,
}

#[derive(Debug)]
pub(super) struct DUnit {
    pub(super) dilation: usize,
    pub(super) act1: DSnake,
    /// `[C, 7 C]` ([`conv_weight_gemm`]).
    pub(super) conv1_w: CudaSlice<bf16>,
    pub(super) conv1_b: CudaSlice<f32>,
    pub(super) act2: DSnake,
    pub(super) conv2_w: CudaSlice<bf16>,
    pub(super) conv2_b: CudaSlice<f32>,
}

#[derive(Debug)]
pub(super) struct DBlock {
    pub(super) cin: usize,
    pub(super) cout: usize,
    pub(super) rate: usize,
    pub(super) act: DSnake,
    /// `[2 rate * cout, cin]` ([`transconv_weight_gemm`]).
    pub(super) up_w: CudaSlice<bf16>,
    pub(super) up_b: CudaSlice<f32>,
    pub(super) units: Vec<DUnit>,
}

#[derive(Debug)]
pub(super) struct DWeights {
    /// `[num_quantizers * codebook_size, hidden]`.
    pub(super) embedding: CudaSlice<bf16>,
    pub(super) layers: Vec<DLayer>,
    pub(super) norm: CudaSlice<f32>,
    pub(super) upsample: Vec<DUpsample>,
    /// `[decoder_dim, 7 hidden]`.
    pub(super) conv_in_w: CudaSlice<bf16>,
    pub(super) conv_in_b: CudaSlice<f32>,
    pub(super) blocks: Vec<DBlock>,
    pub(super) act_out: DSnake,
    /// `[7 * C]` tap-major, f32.
    pub(super) conv_out_w: CudaSlice<f32>,
    pub(super) conv_out_b: f32,
}

struct Up<'a> {
    cx: &'a CudaContext,
    ws: &'a dyn WeightSource,
}

impl Up<'_> {
    fn host(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        Ok(load_shaped(self.ws, name, shape)?.data)
    }

    fn bf16(&self, v: &[f32]) -> Result<CudaSlice<bf16>, ModelError> {
        let v: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
        Ok(self.cx.upload_bf16_pinned(&v)?)
    }

    fn f32(&self, v: &[f32]) -> Result<CudaSlice<f32>, ModelError> {
        Ok(self
            .cx
            .stream()
            .clone_htod(v)
            .map_err(omni_backend::cuda::CudaError::from)?)
    }

    fn vec(&self, name: &str, len: usize) -> Result<CudaSlice<f32>, ModelError> {
        self.f32(&self.host(name, &[len])?)
    }

    fn snake(&self, name: &str, c: usize) -> Result<DSnake, ModelError> {
        let (a, ib) = snake_params(
            &self.host(&format!("{name}.alpha"), &[c])?,
            &self.host(&format!("{name}.beta"), &[c])?,
        );
        Ok(DSnake {
            alpha: self.f32(&a)?,
            inv_beta: self.f32(&ib)?,
        })
    }

    /// A causal conv `[out, in, k]` as its im2col GEMM matrix, and its bias.
    fn conv(
        &self,
        name: &str,
        out: usize,
        inp: usize,
        k: usize,
    ) -> Result<(CudaSlice<bf16>, CudaSlice<f32>), ModelError> {
        let w = self.host(&format!("{name}.weight"), &[out, inp, k])?;
        Ok((
            self.bf16(&conv_weight_gemm(&w, out, inp, k))?,
            self.vec(&format!("{name}.bias"), out)?,
        ))
    }

    /// A transposed conv `[in, out, k]` as its col2im GEMM matrix, and its bias.
    fn transconv(
        &self,
        name: &str,
        inp: usize,
        out: usize,
        k: usize,
    ) -> Result<(CudaSlice<bf16>, CudaSlice<f32>), ModelError> {
        let w = self.host(&format!("{name}.weight"), &[inp, out, k])?;
        Ok((
            self.bf16(&transconv_weight_gemm(&w, inp, out, k))?,
            self.vec(&format!("{name}.bias"), out)?,
        ))
    }
}

impl DWeights {
    pub(super) fn load(
        cx: &CudaContext,
        c: &Code2WavConfig,
        ws: &dyn WeightSource,
    ) -> Result<Self, ModelError> {
        if c.attention_bias {
            return Err(ModelError::Config(
                "CUDA Code2Wav: attention biases are not supported (Qwen3-Omni has none)".into(),
            ));
        }
        let u = Up { cx, ws };
        let (h, i, hd) = (c.hidden_size, c.intermediate_size, c.head_dim());
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let rows = c.num_quantizers * c.codebook_size;
        let embedding = u.bf16(&u.host("code2wav.code_embedding.weight", &[rows, h])?)?;
        let mut layers = Vec::new();
        for l in 0..c.num_hidden_layers {
            let p = format!("code2wav.pre_transformer.layers.{l}");
            let a = format!("{p}.self_attn");
            let mut qkv = u.host(&format!("{a}.q_proj.weight"), &[nh * hd, h])?;
            qkv.extend(u.host(&format!("{a}.k_proj.weight"), &[nkv * hd, h])?);
            qkv.extend(u.host(&format!("{a}.v_proj.weight"), &[nkv * hd, h])?);
            let mut gate_up = u.host(&format!("{p}.mlp.gate_proj.weight"), &[i, h])?;
            gate_up.extend(u.host(&format!("{p}.mlp.up_proj.weight"), &[i, h])?);
            layers.push(DLayer {
                input_norm: u.vec(&format!("{p}.input_layernorm.weight"), h)?,
                post_norm: u.vec(&format!("{p}.post_attention_layernorm.weight"), h)?,
                qkv: u.bf16(&qkv)?,
                o: u.bf16(&u.host(&format!("{a}.o_proj.weight"), &[h, nh * hd])?)?,
                gate_up: u.bf16(&gate_up)?,
                down: u.bf16(&u.host(&format!("{p}.mlp.down_proj.weight"), &[h, i])?)?,
                attn_scale: u.vec(&format!("{p}.self_attn_layer_scale.scale"), h)?,
                mlp_scale: u.vec(&format!("{p}.mlp_layer_scale.scale"), h)?,
            });
        }
        let norm = u.vec("code2wav.pre_transformer.norm.weight", h)?;
        let wide = CONVNEXT_EXPANSION * h;
        let mut upsample = Vec::new();
        for (n, &f) in c.upsampling_ratios.iter().enumerate() {
            let p = format!("code2wav.upsample.{n}");
            let (up_w, up_b) = u.transconv(&format!("{p}.0.conv"), h, h, f)?;
            upsample.push(DUpsample {
                factor: f,
                up_w,
                up_b,
                dw_w: u
                    .f32(&u.host(&format!("{p}.1.dwconv.conv.weight"), &[h, 1, CONV_KERNEL])?)?,
                dw_b: u.vec(&format!("{p}.1.dwconv.conv.bias"), h)?,
                ln_w: u.vec(&format!("{p}.1.norm.weight"), h)?,
                ln_b: u.vec(&format!("{p}.1.norm.bias"), h)?,
                pw1_w: u.bf16(&u.host(&format!("{p}.1.pwconv1.weight"), &[wide, h])?)?,
                pw1_b: u.vec(&format!("{p}.1.pwconv1.bias"), wide)?,
                pw2_w: u.bf16(&u.host(&format!("{p}.1.pwconv2.weight"), &[h, wide])?)?,
                pw2_b: u.vec(&format!("{p}.1.pwconv2.bias"), h)?,
                gamma: u.vec(&format!("{p}.1.gamma"), h)?,
            });
        }
        let d = c.decoder_dim;
        let (conv_in_w, conv_in_b) = u.conv("code2wav.decoder.0.conv", d, h, CONV_KERNEL)?;
        let mut blocks = Vec::new();
        for (b, &r) in c.upsample_rates.iter().enumerate() {
            let (cin, cout) = c.block_channels(b);
            let p = format!("code2wav.decoder.{}.block", b + 1);
            let (up_w, up_b) = u.transconv(&format!("{p}.1.conv"), cin, cout, 2 * r)?;
            let mut units = Vec::new();
            for (n, &dil) in RESIDUAL_DILATIONS.iter().enumerate() {
                let q = format!("{p}.{}", n + 2);
                let (conv1_w, conv1_b) =
                    u.conv(&format!("{q}.conv1.conv"), cout, cout, CONV_KERNEL)?;
                let (conv2_w, conv2_b) = u.conv(&format!("{q}.conv2.conv"), cout, cout, 1)?;
                units.push(DUnit {
                    dilation: dil,
                    act1: u.snake(&format!("{q}.act1"), cout)?,
                    conv1_w,
                    conv1_b,
                    act2: u.snake(&format!("{q}.act2"), cout)?,
                    conv2_w,
                    conv2_b,
                });
            }
            blocks.push(DBlock {
                cin,
                cout,
                rate: r,
                act: u.snake(&format!("{p}.0"), cin)?,
                up_w,
                up_b,
                units,
            });
        }
        let last = c.upsample_rates.len();
        let out_dim = d >> last;
        let w = u.host(
            &format!("code2wav.decoder.{}.conv.weight", last + 2),
            &[1, out_dim, CONV_KERNEL],
        )?;
        let b = u.host(&format!("code2wav.decoder.{}.conv.bias", last + 2), &[1])?;
        Ok(Self {
            embedding,
            layers,
            norm,
            upsample,
            conv_in_w,
            conv_in_b,
            blocks,
            act_out: u.snake(&format!("code2wav.decoder.{}", last + 1), out_dim)?,
            conv_out_w: u.f32(&conv_weight_gemm(&w, 1, out_dim, CONV_KERNEL))?,
            conv_out_b: b[0],
        })
    }
}
