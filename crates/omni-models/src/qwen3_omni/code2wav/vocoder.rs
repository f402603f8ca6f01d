//! Code2Wav's convolution stack, on time-major `[len, channels]` sequences: the ConvNeXt
//! upsampling stages (transformers' `upsample`), then the decoder (`decoder`): a kernel-7 conv to
//! `decoder_dim`, blocks of SnakeBeta + causal transposed conv + three dilated residual units,
//! SnakeBeta, a kernel-7 conv to one channel, and the clamp to `[-1, 1]`.

use omni_backend::activation::{SnakeBeta, gelu_inplace, layer_norm_inplace};
use omni_backend::conv::{Conv1dSpec, ConvTranspose1dSpec, causal_conv_transpose1d, causal_conv1d};
use omni_backend::linalg::matmul_nt;
use omni_backend::ops::{add_bias_inplace, add_inplace};

use super::config::{
    CONV_KERNEL, CONVNEXT_EXPANSION, CONVNEXT_LN_EPS, Code2WavConfig, RESIDUAL_DILATIONS,
};
use super::load_vec;
use crate::error::ModelError;
use crate::weights::WeightSource;

/// `Qwen3OmniMoeCausalConvNet`: weights `[out, in / groups, k]` and bias.
#[derive(Debug, Clone)]
struct CausalConv {
    spec: Conv1dSpec,
    w: Vec<f32>,
    b: Vec<f32>,
}

impl CausalConv {
    fn load(ws: &dyn WeightSource, name: &str, spec: Conv1dSpec) -> Result<Self, ModelError> {
        let cin_g = spec.in_channels / spec.groups;
        Ok(Self {
            w: load_vec(
                ws,
                &format!("{name}.weight"),
                &[spec.out_channels, cin_g, spec.kernel_size],
            )?,
            b: load_vec(ws, &format!("{name}.bias"), &[spec.out_channels])?,
            spec,
        })
    }

    fn forward(&self, x: &[f32], len: usize) -> Result<(Vec<f32>, usize), ModelError> {
        Ok(causal_conv1d(x, len, &self.w, Some(&self.b), &self.spec)?)
    }
}

/// `Qwen3OmniMoeCausalTransConvNet`: weights `[in, out, k]` and bias, trimmed `k - s` per side.
#[derive(Debug, Clone)]
struct CausalTransConv {
    spec: ConvTranspose1dSpec,
    w: Vec<f32>,
    b: Vec<f32>,
}

impl CausalTransConv {
    fn load(
        ws: &dyn WeightSource,
        name: &str,
        spec: ConvTranspose1dSpec,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            w: load_vec(
                ws,
                &format!("{name}.weight"),
                &[spec.in_channels, spec.out_channels, spec.kernel_size],
            )?,
            b: load_vec(ws, &format!("{name}.bias"), &[spec.out_channels])?,
            spec,
        })
    }

    fn forward(&self, x: &[f32], len: usize) -> Result<(Vec<f32>, usize), ModelError> {
        Ok(causal_conv_transpose1d(
            x,
            len,
            &self.w,
            Some(&self.b),
            &self.spec,
        )?)
    }
}

fn snake(ws: &dyn WeightSource, name: &str, channels: usize) -> Result<SnakeBeta, ModelError> {
    let alpha = load_vec(ws, &format!("{name}.alpha"), &[channels])?;
    let beta = load_vec(ws, &format!("{name}.beta"), &[channels])?;
    Ok(SnakeBeta::from_log_params(&alpha, &beta)?)
}

/// One upsampling stage: a transposed conv (kernel = stride = factor), then a ConvNeXt block
/// (depthwise causal conv, LayerNorm, Linear, GELU, Linear, `gamma`, residual).
#[derive(Debug, Clone)]
struct Upsample {
    up: CausalTransConv,
    dwconv: CausalConv,
    norm_w: Vec<f32>,
    norm_b: Vec<f32>,
    pw1_w: Vec<f32>,
    pw1_b: Vec<f32>,
    pw2_w: Vec<f32>,
    pw2_b: Vec<f32>,
    gamma: Vec<f32>,
}

impl Upsample {
    fn load(ws: &dyn WeightSource, p: &str, h: usize, factor: usize) -> Result<Self, ModelError> {
        let wide = CONVNEXT_EXPANSION * h;
        let spec = ConvTranspose1dSpec {
            in_channels: h,
            out_channels: h,
            kernel_size: factor,
            stride: factor,
        };
        Ok(Self {
            up: CausalTransConv::load(ws, &format!("{p}.0.conv"), spec)?,
            dwconv: CausalConv::load(
                ws,
                &format!("{p}.1.dwconv.conv"),
                Conv1dSpec::new(h, h, CONV_KERNEL).with_groups(h),
            )?,
            norm_w: load_vec(ws, &format!("{p}.1.norm.weight"), &[h])?,
            norm_b: load_vec(ws, &format!("{p}.1.norm.bias"), &[h])?,
            pw1_w: load_vec(ws, &format!("{p}.1.pwconv1.weight"), &[wide, h])?,
            pw1_b: load_vec(ws, &format!("{p}.1.pwconv1.bias"), &[wide])?,
            pw2_w: load_vec(ws, &format!("{p}.1.pwconv2.weight"), &[h, wide])?,
            pw2_b: load_vec(ws, &format!("{p}.1.pwconv2.bias"), &[h])?,
            gamma: load_vec(ws, &format!("{p}.1.gamma"), &[h])?,
        })
    }

    fn forward(&self, x: &[f32], len: usize) -> Result<(Vec<f32>, usize), ModelError> {
        let h = self.gamma.len();
        let wide = self.pw1_b.len();
        let (mut x, len) = self.up.forward(x, len)?;
        let (mut y, _) = self.dwconv.forward(&x, len)?;
        layer_norm_inplace(&mut y, &self.norm_w, &self.norm_b, h, CONVNEXT_LN_EPS)?;
        let mut z = vec![0.0; len * wide];
        matmul_nt(&y, &self.pw1_w, &mut z, len, h, wide)?;
        add_bias_inplace(&mut z, &self.pw1_b)?;
        gelu_inplace(&mut z);
        matmul_nt(&z, &self.pw2_w, &mut y, len, wide, h)?;
        add_bias_inplace(&mut y, &self.pw2_b)?;
        for (xr, yr) in x.chunks_exact_mut(h).zip(y.chunks_exact(h)) {
            for ((a, b), g) in xr.iter_mut().zip(yr).zip(&self.gamma) {
                *a += g * b;
            }
        }
        Ok((x, len))
    }
}

/// `x + Conv1x1(Snake(CausalConv_k7_dilated(Snake(x))))`.
#[derive(Debug, Clone)]
struct ResidualUnit {
    act1: SnakeBeta,
    conv1: CausalConv,
    act2: SnakeBeta,
    conv2: CausalConv,
}

impl ResidualUnit {
    fn forward(&self, x: &mut [f32], len: usize) -> Result<(), ModelError> {
        let mut y = x.to_vec();
        self.act1.apply_inplace(&mut y)?;
        let (mut y, _) = self.conv1.forward(&y, len)?;
        self.act2.apply_inplace(&mut y)?;
        let (y, _) = self.conv2.forward(&y, len)?;
        add_inplace(x, &y)?;
        Ok(())
    }
}

/// SnakeBeta, causal transposed conv (kernel `2r`, stride `r`, halving the channels), then the
/// residual units.
#[derive(Debug, Clone)]
struct DecoderBlock {
    act: SnakeBeta,
    up: CausalTransConv,
    units: Vec<ResidualUnit>,
}

/// The convolution stack after the pre-transformer.
#[derive(Debug, Clone)]
pub(super) struct Vocoder {
    upsample: Vec<Upsample>,
    conv_in: CausalConv,
    blocks: Vec<DecoderBlock>,
    act_out: SnakeBeta,
    conv_out: CausalConv,
}

impl Vocoder {
    pub(super) fn load(c: &Code2WavConfig, ws: &dyn WeightSource) -> Result<Self, ModelError> {
        let h = c.hidden_size;
        let upsample = c
            .upsampling_ratios
            .iter()
            .enumerate()
            .map(|(n, &f)| Upsample::load(ws, &format!("code2wav.upsample.{n}"), h, f))
            .collect::<Result<Vec<_>, _>>()?;
        let conv_in = CausalConv::load(
            ws,
            "code2wav.decoder.0.conv",
            Conv1dSpec::new(h, c.decoder_dim, CONV_KERNEL),
        )?;
        let mut blocks = Vec::new();
        for (b, &r) in c.upsample_rates.iter().enumerate() {
            let (cin, cout) = c.block_channels(b);
            let p = format!("code2wav.decoder.{}.block", b + 1);
            let spec = ConvTranspose1dSpec {
                in_channels: cin,
                out_channels: cout,
                kernel_size: 2 * r,
                stride: r,
            };
            let units = RESIDUAL_DILATIONS
                .iter()
                .enumerate()
                .map(|(u, &d)| {
                    let q = format!("{p}.{}", u + 2);
                    Ok(ResidualUnit {
                        act1: snake(ws, &format!("{q}.act1"), cout)?,
                        conv1: CausalConv::load(
                            ws,
                            &format!("{q}.conv1.conv"),
                            Conv1dSpec::new(cout, cout, CONV_KERNEL).with_dilation(d),
                        )?,
                        act2: snake(ws, &format!("{q}.act2"), cout)?,
                        conv2: CausalConv::load(
                            ws,
                            &format!("{q}.conv2.conv"),
                            Conv1dSpec::new(cout, cout, 1),
                        )?,
                    })
                })
                .collect::<Result<Vec<_>, ModelError>>()?;
            blocks.push(DecoderBlock {
                act: snake(ws, &format!("{p}.0"), cin)?,
                up: CausalTransConv::load(ws, &format!("{p}.1.conv"), spec)?,
                units,
            });
        }
        let last = c.upsample_rates.len();
        let out_dim = c.decoder_dim >> last;
        Ok(Self {
            upsample,
            conv_in,
            blocks,
            act_out: snake(ws, &format!("code2wav.decoder.{}", last + 1), out_dim)?,
            conv_out: CausalConv::load(
                ws,
                &format!("code2wav.decoder.{}.conv", last + 2),
                Conv1dSpec::new(out_dim, 1, CONV_KERNEL),
            )?,
        })
    }

    /// One sequence's pre-transformer output `[frames, hidden]` to its waveform, clamped.
    pub(super) fn forward(&self, x: &[f32], frames: usize) -> Result<Vec<f32>, ModelError> {
        let mut len = frames;
        let mut x = x.to_vec();
        for stage in &self.upsample {
            (x, len) = stage.forward(&x, len)?;
        }
        (x, len) = self.conv_in.forward(&x, len)?;
        for block in &self.blocks {
            block.act.apply_inplace(&mut x)?;
            (x, len) = block.up.forward(&x, len)?;
            for unit in &block.units {
                unit.forward(&mut x, len)?;
            }
        }
        self.act_out.apply_inplace(&mut x)?;
        let (mut wav, _) = self.conv_out.forward(&x, len)?;
        wav.iter_mut().for_each(|v| *v = v.clamp(-1.0, 1.0));
        Ok(wav)
    }
}
