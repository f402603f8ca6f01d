//! Qwen3-Omni's vision encoder (`thinker.visual.*`): pixel patches `[patches, C * T * P * P]`
//! (1536 values at the real sizes) of images and videos to Thinker-width embeddings, one per
//! 2x2 block of patches, plus the deepstack features.
//!
//! As transformers' `Qwen3OmniMoeVisionEncoder`:
//! 1. `patch_embed` (a Conv3d whose kernel is its stride: one linear map per patch, with bias).
//! 2. The learned `[side * side, hidden]` position table, resampled bilinearly with aligned
//!    corners to each item's `(h, w)` patch grid (the same for every frame), is added. Patches come
//!    2x2-merge-block-major (`(block row, block col, row in block, col in block)`), as the
//!    processor emits them.
//! 3. Blocks with 2-D rotary embeddings: `head_dim / 4` frequencies `theta^(-4i / head_dim)`, turned
//!    by the patch's row for the first quarter of each half and by its column for the second. Each
//!    frame of each item attends only within itself.
//! 4. After each block listed in `deepstack_visual_indexes`, a merger with the norm after the 2x2
//!    shuffle (`merger_list.{j}`) gives deepstack feature `j`; after the last block, `merger` (norm
//!    per patch, then shuffle) gives the main output. A merger is `LayerNorm`, `Linear(4h, 4h)`,
//!    exact GELU, `Linear(4h, out_hidden_size)`.

use omni_backend::activation::gelu_inplace;
use omni_backend::rope::{Rope, RopeScaling};
use serde::Deserialize;
use serde_json::Value;

use crate::decoder::{Linear, load_shaped};
use crate::error::ModelError;
use crate::qwen3_omni::encoder_block::{Activation, EncoderBlock, LayerNorm, Rotary, linear};
use crate::weights::{HostTensor, WeightSource};

/// The towers' LayerNorm epsilon.
pub(crate) const LN_EPS: f32 = 1e-6;

/// `thinker_config.vision_config` (every field the forward reads).
#[derive(Debug, Clone, Deserialize)]
pub struct VisionEncoderConfig {
    /// Blocks.
    pub depth: usize,
    /// Width.
    pub hidden_size: usize,
    /// MLP activation (`gelu_pytorch_tanh`).
    pub hidden_act: String,
    /// MLP width.
    pub intermediate_size: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Image channels (3).
    pub in_channels: usize,
    /// Patch side in pixels (16).
    pub patch_size: usize,
    /// Patches per merged token along each axis (2).
    pub spatial_merge_size: usize,
    /// Frames per patch (2).
    pub temporal_patch_size: usize,
    /// Output width (the Thinker's hidden size).
    pub out_hidden_size: usize,
    /// Rows of the learned position table (a square).
    pub num_position_embeddings: usize,
    /// Blocks whose output feeds a deepstack merger, in order.
    pub deepstack_visual_indexes: Vec<usize>,
    /// `rope_theta` of the rotary embedding (10000 when absent).
    #[serde(default)]
    pub rope_parameters: Option<Value>,
}

impl VisionEncoderConfig {
    /// Values per patch, `in_channels * temporal_patch_size * patch_size^2`.
    pub fn patch_values(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// Patches per merged token, `spatial_merge_size^2`.
    pub fn merge_unit(&self) -> usize {
        self.spatial_merge_size * self.spatial_merge_size
    }
}

/// A patch merger: `[patches, hidden]` to `[patches / 4, out]`.
#[derive(Debug)]
struct Merger {
    /// Per patch (`[hidden]`), or over the 4 shuffled patches (`[4 * hidden]`, deepstack).
    norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl Merger {
    fn load(
        ws: &dyn WeightSource,
        prefix: &str,
        cfg: &VisionEncoderConfig,
        postshuffle: bool,
    ) -> Result<Self, ModelError> {
        let wide = cfg.hidden_size * cfg.merge_unit();
        let norm_dim = if postshuffle { wide } else { cfg.hidden_size };
        Ok(Self {
            norm: LayerNorm::load(ws, &format!("{prefix}.ln_q"), norm_dim, LN_EPS)?,
            fc1: linear(ws, &format!("{prefix}.mlp.0"), wide, wide, true)?,
            fc2: linear(
                ws,
                &format!("{prefix}.mlp.2"),
                cfg.out_hidden_size,
                wide,
                true,
            )?,
        })
    }

    fn forward(&self, x: &[f32], merged: usize) -> Result<Vec<f32>, ModelError> {
        let mut h = x.to_vec();
        self.norm.apply(&mut h)?;
        let mut a = Vec::new();
        self.fc1.forward(&h, merged, &mut a)?;
        gelu_inplace(&mut a);
        self.fc2.forward(&a, merged, &mut h)?;
        Ok(h)
    }
}

/// The vision tower's outputs for the items of one call, rows in item order.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionOutput {
    /// `[patches / 4, out_hidden_size]`.
    pub merged: HostTensor,
    /// One `[patches / 4, out_hidden_size]` per deepstack index.
    pub deepstack: Vec<HostTensor>,
}

/// The loaded vision tower.
#[derive(Debug)]
pub struct VisionEncoder {
    cfg: VisionEncoderConfig,
    patch_embed: Linear,
    pos_embed: Vec<f32>,
    side: usize,
    blocks: Vec<EncoderBlock>,
    merger: Merger,
    deepstack: Vec<Merger>,
    rope: Rope,
    inv_freq: Vec<f32>,
}

impl VisionEncoder {
    /// Reads the tower from `ws` under the names inside `thinker.visual.`.
    pub fn load(cfg: VisionEncoderConfig, ws: &dyn WeightSource) -> Result<Self, ModelError> {
        let (side, head_dim) = geometry(&cfg)?;
        let (h, heads) = (cfg.hidden_size, cfg.num_heads);
        let act = Activation::from_name(&cfg.hidden_act)?;
        let pv = cfg.patch_values();
        let patch_w = load_shaped(
            ws,
            "patch_embed.proj.weight",
            &[
                h,
                cfg.in_channels,
                cfg.temporal_patch_size,
                cfg.patch_size,
                cfg.patch_size,
            ],
        )?
        .data;
        let patch_embed = Linear {
            w: patch_w,
            out: h,
            inp: pv,
            bias: Some(load_shaped(ws, "patch_embed.proj.bias", &[h])?.data),
        };
        let pos_embed =
            load_shaped(ws, "pos_embed.weight", &[cfg.num_position_embeddings, h])?.data;
        let blocks = (0..cfg.depth)
            .map(|i| {
                let p = format!("blocks.{i}");
                Ok(EncoderBlock {
                    norm1: LayerNorm::load(ws, &format!("{p}.norm1"), h, LN_EPS)?,
                    qkv: linear(ws, &format!("{p}.attn.qkv"), 3 * h, h, true)?,
                    proj: linear(ws, &format!("{p}.attn.proj"), h, h, true)?,
                    norm2: LayerNorm::load(ws, &format!("{p}.norm2"), h, LN_EPS)?,
                    fc1: linear(
                        ws,
                        &format!("{p}.mlp.linear_fc1"),
                        cfg.intermediate_size,
                        h,
                        true,
                    )?,
                    fc2: linear(
                        ws,
                        &format!("{p}.mlp.linear_fc2"),
                        h,
                        cfg.intermediate_size,
                        true,
                    )?,
                    act,
                    heads,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let merger = Merger::load(ws, "merger", &cfg, false)?;
        let deepstack = (0..cfg.deepstack_visual_indexes.len())
            .map(|j| Merger::load(ws, &format!("merger_list.{j}"), &cfg, true))
            .collect::<Result<Vec<_>, _>>()?;
        let (theta, inv_freq) = rotary_inv_freq(&cfg, head_dim);
        Ok(Self {
            rope: Rope::new(head_dim, theta, &RopeScaling::None)?,
            inv_freq,
            cfg,
            patch_embed,
            pos_embed,
            side,
            blocks,
            merger,
            deepstack,
        })
    }

    /// The config it was built from.
    pub fn config(&self) -> &VisionEncoderConfig {
        &self.cfg
    }

    /// Encodes several items in one call: `pixel_values` is `[sum t*h*w, patch_values]` (the
    /// items' patches one after another) and `grids` their `(t, h, w)` patch grids.
    pub fn encode(
        &self,
        pixel_values: &[f32],
        grids: &[[usize; 3]],
    ) -> Result<VisionOutput, ModelError> {
        let (hid, m) = (self.cfg.hidden_size, self.cfg.spatial_merge_size);
        let patches: usize = grids.iter().map(|g| g[0] * g[1] * g[2]).sum();
        if pixel_values.len() != patches * self.cfg.patch_values()
            || grids
                .iter()
                .any(|g| g[0] == 0 || !g[1].is_multiple_of(m) || !g[2].is_multiple_of(m))
        {
            return Err(ModelError::Batch(format!(
                "vision input: {} values for grids {grids:?} of {} values a patch (merge {m})",
                pixel_values.len(),
                self.cfg.patch_values()
            )));
        }
        let mut x = Vec::new();
        self.patch_embed.forward(pixel_values, patches, &mut x)?;
        let head_dim = hid / self.cfg.num_heads;
        let mut cos_sin = Vec::with_capacity(patches * head_dim);
        let mut cu = vec![0];
        let mut row = 0;
        let mut pos = vec![0.0f32; hid];
        for &[t, gh, gw] in grids {
            for _ in 0..t {
                for (r, c) in block_major(gh, gw, m) {
                    let (hs, ws) = (axis_taps(r, gh, self.side), axis_taps(c, gw, self.side));
                    pos.fill(0.0);
                    for (ti, hw) in hs {
                        for &(tj, ww) in &ws {
                            let src = &self.pos_embed[(ti * self.side + tj) * hid..][..hid];
                            let wt = hw * ww;
                            pos.iter_mut().zip(src).for_each(|(d, s)| *d += s * wt);
                        }
                    }
                    let dst = &mut x[row * hid..(row + 1) * hid];
                    dst.iter_mut().zip(&pos).for_each(|(d, p)| *d += p);
                    self.push_cos_sin(r, c, &mut cos_sin);
                    row += 1;
                }
                cu.push(row);
            }
        }
        let rotary = Rotary {
            rope: &self.rope,
            cos_sin: &cos_sin,
        };
        let merged = patches / self.cfg.merge_unit();
        let out_h = self.cfg.out_hidden_size;
        let mut deepstack = Vec::with_capacity(self.deepstack.len());
        for (i, b) in self.blocks.iter().enumerate() {
            b.forward(&mut x, &cu, Some(&rotary))?;
            if let Some(j) = self
                .cfg
                .deepstack_visual_indexes
                .iter()
                .position(|&d| d == i)
            {
                deepstack.push(HostTensor {
                    shape: vec![merged, out_h],
                    data: self.deepstack[j].forward(&x, merged)?,
                });
            }
        }
        Ok(VisionOutput {
            merged: HostTensor {
                shape: vec![merged, out_h],
                data: self.merger.forward(&x, merged)?,
            },
            deepstack,
        })
    }

    /// Appends the `[cos | sin]` row of the patch at (`r`, `c`).
    fn push_cos_sin(&self, r: usize, c: usize, cos_sin: &mut Vec<f32>) {
        let angles: Vec<f32> = self
            .inv_freq
            .iter()
            .map(|f| r as f32 * f)
            .chain(self.inv_freq.iter().map(|f| c as f32 * f))
            .collect();
        cos_sin.extend(angles.iter().map(|a| a.cos()));
        cos_sin.extend(angles.iter().map(|a| a.sin()));
    }
}

/// (row, col) of each patch of an `h x w` grid in merge-block-major order.
pub(crate) fn block_major(h: usize, w: usize, m: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..h / m).flat_map(move |br| {
        (0..w / m).flat_map(move |bc| {
            (0..m).flat_map(move |ir| (0..m).map(move |ic| (br * m + ir, bc * m + ic)))
        })
    })
}

/// The learned position table's side and the head size, after checking `cfg`.
pub(crate) fn geometry(cfg: &VisionEncoderConfig) -> Result<(usize, usize), ModelError> {
    let (h, heads) = (cfg.hidden_size, cfg.num_heads);
    let side = (cfg.num_position_embeddings as f64).sqrt().round() as usize;
    let head_dim = h.checked_div(heads).unwrap_or(0);
    if heads == 0
        || !h.is_multiple_of(heads)
        || !head_dim.is_multiple_of(4)
        || side * side != cfg.num_position_embeddings
        || cfg.spatial_merge_size == 0
        || cfg.deepstack_visual_indexes.iter().any(|&i| i >= cfg.depth)
    {
        return Err(ModelError::Config(format!(
            "vision_config: hidden {h}, {heads} heads, {} positions, merge {}, deepstack {:?} \
             of depth {}",
            cfg.num_position_embeddings,
            cfg.spatial_merge_size,
            cfg.deepstack_visual_indexes,
            cfg.depth
        )));
    }
    Ok((side, head_dim))
}

/// `rope_theta` and the `head_dim / 4` rotary frequencies of each spatial axis (transformers:
/// `1 / theta^(arange(0, head_dim / 2, 2) / (head_dim / 2))`, in f32).
pub(crate) fn rotary_inv_freq(cfg: &VisionEncoderConfig, head_dim: usize) -> (f32, Vec<f32>) {
    let theta = cfg
        .rope_parameters
        .as_ref()
        .and_then(|p| p.get("rope_theta"))
        .and_then(Value::as_f64)
        .unwrap_or(10000.0) as f32;
    let spatial = head_dim / 2;
    let inv_freq = (0..spatial)
        .step_by(2)
        .map(|i| 1.0 / theta.powf(i as f32 / spatial as f32))
        .collect();
    (theta, inv_freq)
}

/// The two bilinear taps (table index, weight) of patch index `i` on an axis of `size` patches
/// of a `side x side` table, with aligned corners and clamped at the border (transformers'
/// `_interpolation_axis_taps_weights`, in f32 as it computes them).
pub(crate) fn axis_taps(i: usize, size: usize, side: usize) -> [(usize, f32); 2] {
    let src = i as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
    let floor = src.floor();
    let base = floor as usize;
    [0usize, 1].map(|o| {
        let w = (1.0 - (src - floor - o as f32).abs()).max(0.0);
        ((base + o).min(side - 1), w)
    })
}
