//! The towers' input stems: the vision tower's position-table interpolation and rotary table,
//! and the im2col of the audio tower's 3x3 stride-2 convolutions.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use super::super::launch::{at_least, elementwise_cfg};
use super::{Rows, encoder_source, i32_of, i64_of};
use crate::cuda::{CudaContext, CudaResult};

/// The images of [`CudaContext::enc_im2col_s2`]: `images` of `width` (time) x `height`
/// (frequency) x `channels`, stored `[images, width, height, channels]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvImages {
    /// Images.
    pub images: usize,
    /// Width (the outer spatial axis: time).
    pub width: usize,
    /// Height (the inner spatial axis: frequency).
    pub height: usize,
    /// Channels (innermost).
    pub channels: usize,
}

impl ConvImages {
    /// The output `(width, height)` of a 3x3 stride-2 padding-1 convolution.
    pub fn out_size(&self) -> (usize, usize) {
        let o = |l: usize| if l == 0 { 0 } else { (l - 1) / 2 + 1 };
        (o(self.width), o(self.height))
    }

    /// Output pixels over all images (rows of the im2col matrix).
    pub fn out_pixels(&self) -> usize {
        let (w, h) = self.out_size();
        self.images * w * h
    }
}

impl CudaContext {
    /// The vision tower's input rows: `x[p, :] = y[p, :] + bias + sum_k tap_w[p, k] *
    /// table[tap_idx[p, k], :]` (`shape` = `[patches, hidden]`; 4 taps per patch; `table`
    /// `[positions, hidden]` f32; every index below `positions`, which the kernel does not
    /// check).
    pub fn enc_vision_pos(
        &self,
        y: &impl DevicePtr<f32>,
        bias: &CudaSlice<f32>,
        table: &CudaSlice<f32>,
        taps: (&CudaSlice<i32>, &CudaSlice<f32>),
        x: &mut impl DevicePtrMut<f32>,
        shape: Rows,
    ) -> CudaResult<()> {
        let n = shape.len();
        at_least("encoder vision_pos input", y.len(), n)?;
        at_least("encoder vision_pos bias", bias.len(), shape.cols)?;
        at_least(
            "encoder vision_pos tap indices",
            taps.0.len(),
            4 * shape.rows,
        )?;
        at_least(
            "encoder vision_pos tap weights",
            taps.1.len(),
            4 * shape.rows,
        )?;
        at_least("encoder vision_pos out", x.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(encoder_source, "enc_vision_pos")?;
        let (yp, _g1) = y.device_ptr(&self.stream);
        let (bp, _g2) = bias.device_ptr(&self.stream);
        let (tp, _g3) = table.device_ptr(&self.stream);
        let (ip, _g4) = taps.0.device_ptr(&self.stream);
        let (wp, _g5) = taps.1.device_ptr(&self.stream);
        let (xp, _g6) = x.device_ptr_mut(&self.stream);
        let (n_i, hidden) = (i64_of("n", n)?, i32_of("hidden", shape.cols)?);
        let mut l = self.stream.launch_builder(&f);
        l.arg(&yp)
            .arg(&bp)
            .arg(&tp)
            .arg(&ip)
            .arg(&wp)
            .arg(&xp)
            .arg(&n_i)
            .arg(&hidden);
        // SAFETY: matches `enc_vision_pos(const float*, const float*, const float*, const int*,
        // const float*, float*, long long, int)`; y and x hold n elements, bias hidden, the taps
        // 4 per row (checked); table rows are the caller's contract (indices below its rows).
        unsafe { l.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// The vision rotary table `out` (`[tokens, 4 * inv_freq.len()]` f32): per token `[cos |
    /// sin]` of the angles `row * inv_freq` then `col * inv_freq`, `rc` = `(row, col)` per token.
    pub fn enc_rope_table(
        &self,
        rc: &CudaSlice<i32>,
        inv_freq: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        tokens: usize,
    ) -> CudaResult<()> {
        let quarter = inv_freq.len();
        let n = tokens * 2 * quarter;
        at_least("encoder rope_table positions", rc.len(), 2 * tokens)?;
        at_least("encoder rope_table out", out.len(), 2 * n)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(encoder_source, "enc_rope_table")?;
        let (rp, _g1) = rc.device_ptr(&self.stream);
        let (fp, _g2) = inv_freq.device_ptr(&self.stream);
        let (op, _g3) = out.device_ptr_mut(&self.stream);
        let (n_i, q) = (i64_of("n", n)?, i32_of("quarter", quarter)?);
        let mut l = self.stream.launch_builder(&f);
        l.arg(&rp).arg(&fp).arg(&op).arg(&n_i).arg(&q);
        // SAFETY: matches `enc_rope_table(const int*, const float*, float*, long long, int)`;
        // element i < n = tokens * 2 quarter reads rc[2t..2t+2] and inv_freq below quarter and
        // writes two of the tokens * 4 quarter outputs (checked).
        unsafe { l.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// The im2col matrix `col` (`[out pixels, 9 * channels]`, column `(ky * 3 + kx) *
    /// channels + c`) of a 3x3 stride-2 padding-1 convolution over `x` (`[images, width,
    /// height, channels]`); output pixel `p = (b * out_w + ox) * out_h + oy`.
    pub fn enc_im2col_s2(
        &self,
        x: &impl DevicePtr<bf16>,
        col: &mut impl DevicePtrMut<bf16>,
        img: ConvImages,
    ) -> CudaResult<()> {
        let (ow, oh) = img.out_size();
        let total = img.out_pixels() * 9 * img.channels;
        at_least(
            "encoder im2col input",
            x.len(),
            img.images * img.width * img.height * img.channels,
        )?;
        at_least("encoder im2col out", col.len(), total)?;
        if total == 0 {
            return Ok(());
        }
        let f = self.function(encoder_source, "enc_im2col_s2")?;
        let (xp, _g1) = x.device_ptr(&self.stream);
        let (cp, _g2) = col.device_ptr_mut(&self.stream);
        let ints = [
            i32_of("width", img.width)?,
            i32_of("height", img.height)?,
            i32_of("channels", img.channels)?,
            i32_of("out width", ow)?,
            i32_of("out height", oh)?,
        ];
        let total_i = i64_of("im2col elements", total)?;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&xp).arg(&cp).arg(&total_i);
        for v in &ints {
            l.arg(v);
        }
        // SAFETY: matches `enc_im2col_s2(const u16*, u16*, long long, int, int, int, int,
        // int)`; element i < total writes col[i] and reads x only inside its image's bounds
        // (images * width * height * channels elements checked).
        unsafe { l.launch(elementwise_cfg(total)) }?;
        Ok(())
    }
}
