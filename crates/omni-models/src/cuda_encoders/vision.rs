//! The vision tower on the device: the twin of
//! [`crate::qwen3_omni::vision_encoder::VisionEncoder`] (see its module doc for the forward).

use std::sync::Arc;

use omni_backend::cuda::cudarc::driver::CudaSlice;
use omni_backend::cuda::encoder::{EncoderAct, Rows};
use omni_backend::cuda::{CudaContext, bf16};

use super::block::{BlockDims, BlockNames, DBlock, Work, act_of};
use super::{Source, Up, upload, zeros_f32};
use crate::ModelError;
use crate::qwen3_omni::encoder_block::Activation;
use crate::qwen3_omni::vision_encoder::{
    LN_EPS, VisionEncoderConfig, axis_taps, block_major, geometry, rotary_inv_freq,
};
use crate::weights::WeightSource;

/// The vision tower's outputs for the items of one call, rows in item order (bf16).
#[derive(Debug)]
pub struct CudaVisionOutput {
    /// `[patches / 4, out_hidden_size]`.
    pub merged: CudaSlice<bf16>,
    /// One `[patches / 4, out_hidden_size]` per deepstack index.
    pub deepstack: Vec<CudaSlice<bf16>>,
}

/// A patch merger: LayerNorm (per patch, or over the 4 shuffled patches), `Linear(4h, 4h)`,
/// exact GELU, `Linear(4h, out)`.
struct DMerger {
    norm: (CudaSlice<f32>, CudaSlice<f32>),
    postshuffle: bool,
    fc1_w: CudaSlice<bf16>,
    fc1_b: CudaSlice<f32>,
    fc2_w: CudaSlice<bf16>,
    fc2_b: CudaSlice<f32>,
}

impl DMerger {
    fn load(
        u: &Up<'_>,
        p: &str,
        c: &VisionEncoderConfig,
        postshuffle: bool,
    ) -> Result<Self, ModelError> {
        let wide = c.hidden_size * c.merge_unit();
        let out = c.out_hidden_size;
        let norm_dim = if postshuffle { wide } else { c.hidden_size };
        Ok(Self {
            norm: u.norm(&format!("{p}.ln_q"), norm_dim)?,
            postshuffle,
            fc1_w: u.mat(&[format!("{p}.mlp.0.weight")], &[wide, wide], |v| v)?,
            fc1_b: u.vec(&[format!("{p}.mlp.0.bias")], wide)?,
            fc2_w: u.mat(&[format!("{p}.mlp.2.weight")], &[out, wide], |v| v)?,
            fc2_b: u.vec(&[format!("{p}.mlp.2.bias")], out)?,
        })
    }

    /// `[merged, out]` bf16 from the residual rows `x` (`[4 merged, hidden]`), through `w`.
    fn forward(
        &self,
        cx: &CudaContext,
        x: &CudaSlice<f32>,
        merged: usize,
        c: &VisionEncoderConfig,
        w: &mut Work,
    ) -> Result<CudaSlice<bf16>, ModelError> {
        let (hid, unit, out) = (c.hidden_size, c.merge_unit(), c.out_hidden_size);
        let wide = hid * unit;
        let norm_rows = if self.postshuffle {
            Rows {
                rows: merged,
                cols: wide,
            }
        } else {
            Rows {
                rows: merged * unit,
                cols: hid,
            }
        };
        cx.enc_layer_norm(x, (&self.norm.0, &self.norm.1), &mut w.h, norm_rows, LN_EPS)?;
        cx.matmul_nt_bf16_f32(&w.h, &self.fc1_w, &mut w.y, merged, wide, wide)?;
        let rows = Rows {
            rows: merged,
            cols: wide,
        };
        cx.enc_bias_act(&w.y, &self.fc1_b, &mut w.a, rows, EncoderAct::Gelu)?;
        cx.matmul_nt_bf16_f32(&w.a, &self.fc2_w, &mut w.y, merged, wide, out)?;
        let mut o = cx.zeros_bf16(merged * out)?;
        let rows = Rows {
            rows: merged,
            cols: out,
        };
        cx.enc_bias_act(&w.y, &self.fc2_b, &mut o, rows, EncoderAct::Identity)?;
        Ok(o)
    }
}

/// The vision tower on one device. See the module doc.
pub struct CudaVisionEncoder {
    cx: Arc<CudaContext>,
    cfg: VisionEncoderConfig,
    dims: BlockDims,
    side: usize,
    /// `[hidden, patch_values]`.
    patch_w: CudaSlice<bf16>,
    patch_b: CudaSlice<f32>,
    /// `[side * side, hidden]`.
    pos_table: CudaSlice<f32>,
    /// `[head_dim / 4]`.
    inv_freq: CudaSlice<f32>,
    blocks: Vec<DBlock>,
    merger: DMerger,
    deepstack: Vec<DMerger>,
}

impl std::fmt::Debug for CudaVisionEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaVisionEncoder")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl CudaVisionEncoder {
    /// Reads the tower from `ws` under the names inside `thinker.visual.` (as the host tower).
    pub fn load(
        cx: Arc<CudaContext>,
        cfg: VisionEncoderConfig,
        ws: &dyn WeightSource,
    ) -> Result<Self, ModelError> {
        Self::build(cx, cfg, Source::Host(ws))
    }

    /// Random weights of the config's shapes made from `seed` (see the module doc).
    pub fn load_dummy(
        cx: Arc<CudaContext>,
        cfg: VisionEncoderConfig,
        seed: u64,
    ) -> Result<Self, ModelError> {
        Self::build(cx, cfg, Source::Dummy(seed))
    }

    fn build(
        cx: Arc<CudaContext>,
        cfg: VisionEncoderConfig,
        src: Source<'_>,
    ) -> Result<Self, ModelError> {
        let (side, head_dim) = geometry(&cfg)?;
        let dims = BlockDims {
            dim: cfg.hidden_size,
            heads: cfg.num_heads,
            inter: cfg.intermediate_size,
            act: act_of(Activation::from_name(&cfg.hidden_act)?),
            eps: LN_EPS,
        };
        let u = Up { cx: &cx, src };
        let h = cfg.hidden_size;
        let blocks = (0..cfg.depth)
            .map(|i| {
                let p = format!("blocks.{i}");
                let names = BlockNames {
                    norm1: format!("{p}.norm1"),
                    qkv: vec![format!("{p}.attn.qkv")],
                    proj: format!("{p}.attn.proj"),
                    norm2: format!("{p}.norm2"),
                    fc1: format!("{p}.mlp.linear_fc1"),
                    fc2: format!("{p}.mlp.linear_fc2"),
                };
                DBlock::load(&u, &names, dims)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let patch_shape = [
            h,
            cfg.in_channels,
            cfg.temporal_patch_size,
            cfg.patch_size,
            cfg.patch_size,
        ];
        let (_, inv_freq) = rotary_inv_freq(&cfg, head_dim);
        Ok(Self {
            patch_w: u.mat(&["patch_embed.proj.weight".into()], &patch_shape, |v| v)?,
            patch_b: u.vec(&["patch_embed.proj.bias".into()], h)?,
            pos_table: u.table("pos_embed.weight", &[cfg.num_position_embeddings, h])?,
            inv_freq: u.f32(&inv_freq)?,
            merger: DMerger::load(&u, "merger", &cfg, false)?,
            deepstack: (0..cfg.deepstack_visual_indexes.len())
                .map(|j| DMerger::load(&u, &format!("merger_list.{j}"), &cfg, true))
                .collect::<Result<Vec<_>, _>>()?,
            blocks,
            side,
            dims,
            cfg,
            cx,
        })
    }

    /// The config it was built from.
    pub fn config(&self) -> &VisionEncoderConfig {
        &self.cfg
    }

    /// Encodes several items in one call: `pixel_values` is `[sum t*h*w, patch_values]` bf16
    /// (the items' patches one after another, as on the wire) and `grids` their `(t, h, w)`
    /// patch grids. The outputs are on the device, queued on the context's stream.
    pub fn encode(
        &self,
        pixel_values: &[bf16],
        grids: &[[usize; 3]],
    ) -> Result<CudaVisionOutput, ModelError> {
        let cx = &*self.cx;
        let (hid, m) = (self.cfg.hidden_size, self.cfg.spatial_merge_size);
        let patches: usize = grids.iter().map(|g| g[0] * g[1] * g[2]).sum();
        let pv = self.cfg.patch_values();
        if pixel_values.len() != patches * pv
            || grids
                .iter()
                .any(|g| g[0] == 0 || !g[1].is_multiple_of(m) || !g[2].is_multiple_of(m))
        {
            return Err(ModelError::Batch(format!(
                "vision input: {} values for grids {grids:?} of {pv} values a patch (merge {m})",
                pixel_values.len(),
            )));
        }
        let (mut idx, mut wts, mut rc) = (
            Vec::with_capacity(4 * patches),
            Vec::with_capacity(4 * patches),
            Vec::with_capacity(2 * patches),
        );
        let mut cu = vec![0];
        for &[t, gh, gw] in grids {
            for _ in 0..t {
                for (r, c) in block_major(gh, gw, m) {
                    let (hs, ws) = (axis_taps(r, gh, self.side), axis_taps(c, gw, self.side));
                    for (ti, hw) in hs {
                        for &(tj, ww) in &ws {
                            idx.push((ti * self.side + tj) as i32);
                            wts.push(hw * ww);
                        }
                    }
                    rc.extend([r as i32, c as i32]);
                }
                cu.push(cu.last().copied().unwrap_or(0) + gh * gw);
            }
        }
        let merged = patches / self.cfg.merge_unit();
        let out_h = self.cfg.out_hidden_size;
        let mut w = Work::new(cx, &cu, self.dims, merged * out_h.max(hid * 4))?;
        let pix = cx.upload_bf16(pixel_values)?;
        let taps = (upload(cx, &idx)?, upload(cx, &wts)?);
        let rc = upload(cx, &rc)?;
        cx.matmul_nt_bf16_f32(&pix, &self.patch_w, &mut w.y, patches, pv, hid)?;
        let mut x = zeros_f32(cx, patches * hid)?;
        let rows = Rows {
            rows: patches,
            cols: hid,
        };
        cx.enc_vision_pos(
            &w.y,
            &self.patch_b,
            &self.pos_table,
            (&taps.0, &taps.1),
            &mut x,
            rows,
        )?;
        let head_dim = hid / self.cfg.num_heads;
        let mut cos_sin = zeros_f32(cx, patches * head_dim)?;
        cx.enc_rope_table(&rc, &self.inv_freq, &mut cos_sin, patches)?;
        let mut deepstack = Vec::with_capacity(self.deepstack.len());
        for (i, b) in self.blocks.iter().enumerate() {
            b.forward(cx, &mut x, &cu, Some(&cos_sin), self.dims, &mut w)?;
            if let Some(j) = self
                .cfg
                .deepstack_visual_indexes
                .iter()
                .position(|&d| d == i)
            {
                deepstack.push(self.deepstack[j].forward(cx, &x, merged, &self.cfg, &mut w)?);
            }
        }
        Ok(CudaVisionOutput {
            merged: self.merger.forward(cx, &x, merged, &self.cfg, &mut w)?,
            deepstack,
        })
    }
}
