//! Qwen2-VL / Qwen3-Omni image and video preprocessing (transformers' PIL-backed
//! `Qwen2VLImageProcessor`): `smart_resize`, PIL bicubic resize, rescale and normalise, the
//! temporal tiling and the patch permutation to rows of `3 * temporal * patch * patch` values.
//!
//! `pixel_values` are bit-identical to the PIL processor's (tests/vision_golden.rs compares the
//! blake3 of the f32 bytes). transformers' fast (torchvision) image processor, which vLLM gets when
//! torchvision is installed, differs from it by at most one u8 level (2/255 after normalising) on
//! 0.04% (1280x720) to 0.3% (20x20) of the values; its torchvision video processor differs from
//! this per-frame PIL path by at most two levels on 0.12% of the values (3 frames of 1280x720).

use serde_json::Value;

use crate::error::ProcessError;
use crate::image::RgbImage;
use crate::resize::resize_bicubic;

/// Per-frame pixel bounds the Qwen3-Omni processor gives its video processor
/// (`size = {shortest_edge: 128 * 32 * 32, longest_edge: 768 * 32 * 32}`).
pub const QWEN3_OMNI_VIDEO_MIN_PIXELS: u64 = 128 * 32 * 32;
/// See [`QWEN3_OMNI_VIDEO_MIN_PIXELS`].
pub const QWEN3_OMNI_VIDEO_MAX_PIXELS: u64 = 768 * 32 * 32;

/// The image processor's settings (`preprocessor_config.json`), Qwen3-Omni's by default.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageProcessorConfig {
    /// Spatial patch side (16).
    pub patch_size: u32,
    /// Frames per temporal patch (2).
    pub temporal_patch_size: u32,
    /// Side of the patch merger's window (2).
    pub merge_size: u32,
    /// Fewest pixels after resizing (`size.shortest_edge`, 3136).
    pub min_pixels: u64,
    /// Most pixels after resizing (`size.longest_edge`, 12845056).
    pub max_pixels: u64,
    /// Per-channel mean subtracted after rescaling.
    pub image_mean: [f32; 3],
    /// Per-channel std divided by after subtracting the mean.
    pub image_std: [f32; 3],
    /// Factor from 0..=255 to 0..=1 (1/255, applied in f64 as transformers does).
    pub rescale_factor: f64,
}

impl Default for ImageProcessorConfig {
    fn default() -> Self {
        Self {
            patch_size: 16,
            temporal_patch_size: 2,
            merge_size: 2,
            min_pixels: 3136,
            max_pixels: 12_845_056,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            rescale_factor: 1.0 / 255.0,
        }
    }
}

fn get_u64(v: &Value, key: &str) -> Result<Option<u64>, ProcessError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .map(Some)
            .ok_or_else(|| ProcessError::Config(format!("`{key}` must be a non-negative integer"))),
    }
}

fn get_triple(v: &Value, key: &str) -> Result<Option<[f32; 3]>, ProcessError> {
    let Some(x) = v.get(key) else {
        return Ok(None);
    };
    let bad = || ProcessError::Config(format!("`{key}` must be a number or a list of 3 numbers"));
    if let Some(f) = x.as_f64() {
        return Ok(Some([f as f32; 3]));
    }
    let list = x.as_array().ok_or_else(bad)?;
    if list.len() != 3 {
        return Err(bad());
    }
    let mut out = [0f32; 3];
    for (o, e) in out.iter_mut().zip(list) {
        // numpy builds the mean/std arrays in the image's dtype, float32.
        *o = e.as_f64().ok_or_else(bad)? as f32;
    }
    Ok(Some(out))
}

impl ImageProcessorConfig {
    /// Reads the image processor keys of a `preprocessor_config.json` value. Keys that are absent
    /// keep Qwen3-Omni's values (not transformers' class defaults, which are Qwen2-VL's).
    /// `size.{shortest_edge,longest_edge}` win over the legacy `min_pixels` / `max_pixels`.
    pub fn from_preprocessor_config(v: &Value) -> Result<Self, ProcessError> {
        let mut cfg = Self::default();
        let small = |key: &str, x: u64| {
            u32::try_from(x)
                .ok()
                .filter(|&x| x > 0)
                .ok_or_else(|| ProcessError::Config(format!("`{key}` = {x} is out of range")))
        };
        if let Some(x) = get_u64(v, "patch_size")? {
            cfg.patch_size = small("patch_size", x)?;
        }
        if let Some(x) = get_u64(v, "temporal_patch_size")? {
            cfg.temporal_patch_size = small("temporal_patch_size", x)?;
        }
        if let Some(x) = get_u64(v, "merge_size")? {
            cfg.merge_size = small("merge_size", x)?;
        }
        if let Some(x) = get_u64(v, "min_pixels")? {
            cfg.min_pixels = x;
        }
        if let Some(x) = get_u64(v, "max_pixels")? {
            cfg.max_pixels = x;
        }
        if let Some(size) = v.get("size") {
            if let Some(x) = get_u64(size, "shortest_edge")? {
                cfg.min_pixels = x;
            }
            if let Some(x) = get_u64(size, "longest_edge")? {
                cfg.max_pixels = x;
            }
        }
        if let Some(m) = get_triple(v, "image_mean")? {
            cfg.image_mean = m;
        }
        if let Some(s) = get_triple(v, "image_std")? {
            cfg.image_std = s;
        }
        if let Some(r) = v.get("rescale_factor").and_then(Value::as_f64) {
            cfg.rescale_factor = r;
        }
        Ok(cfg)
    }

    /// The same settings with the Qwen3-Omni processor's per-frame video bounds.
    pub fn for_video(&self) -> Self {
        Self {
            min_pixels: QWEN3_OMNI_VIDEO_MIN_PIXELS,
            max_pixels: QWEN3_OMNI_VIDEO_MAX_PIXELS,
            ..self.clone()
        }
    }

    /// Values per pixel row: `3 * temporal_patch_size * patch_size^2` (1536).
    pub fn row_len(&self) -> usize {
        3 * (self.temporal_patch_size * self.patch_size * self.patch_size) as usize
    }

    /// `patch_size * merge_size` (32): resized sides are multiples of it.
    pub fn factor(&self) -> u32 {
        self.patch_size * self.merge_size
    }
}

/// transformers' `smart_resize`: the `(height, width)` an image is resized to. Python's `round`
/// rounds half to even (720 / 32 = 22.5 gives 22, so 704; `f64::round` would give 736).
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32), ProcessError> {
    let (h, w, f) = (f64::from(height), f64::from(width), f64::from(factor));
    if height == 0 || width == 0 || h.max(w) / h.min(w) > 200.0 {
        return Err(ProcessError::AspectRatio { height, width });
    }
    let mut h_bar = (h / f).round_ties_even() * f;
    let mut w_bar = (w / f).round_ties_even() * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = ((h * w) / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as u32, w_bar as u32))
}

/// An image's or video's pixel patches, as the vision encoder takes them.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageFeatures {
    /// `[t * h * w, row_len]` row-major; rows come 2x2-merge-window-major, each row is
    /// `(channel, frame, patch_y, patch_x)`.
    pub pixel_values: Vec<f32>,
    /// `(t, h, w)` in patches: `t` temporal patches, `h x w` spatial patches.
    pub grid_thw: [u32; 3],
}

impl ImageFeatures {
    /// Number of patch rows (`t * h * w`).
    pub fn num_patches(&self) -> usize {
        self.grid_thw.iter().map(|&x| x as usize).product()
    }
}

/// LLM tokens of an image or video: `t * h * w / merge^2`.
pub fn image_tokens(grid_thw: [u32; 3], merge_size: u32) -> usize {
    let [t, h, w] = grid_thw.map(|x| x as usize);
    t * h * w / (merge_size as usize * merge_size as usize)
}

/// Resized, rescaled, normalised planes `[3][h][w]` of one frame.
fn normalised_planes(
    img: &RgbImage,
    cfg: &ImageProcessorConfig,
) -> Result<(Vec<f32>, u32, u32), ProcessError> {
    let (h, w) = smart_resize(
        img.height,
        img.width,
        cfg.factor(),
        cfg.min_pixels,
        cfg.max_pixels,
    )?;
    let resized = resize_bicubic(img, w, h);
    let n = h as usize * w as usize;
    let mut planes = vec![0f32; 3 * n];
    for (i, px) in resized.data.chunks_exact(3).enumerate() {
        for c in 0..3 {
            // transformers: (u8 as f64 * factor) as f32, then (x - mean) / std in f32.
            let x = (f64::from(px[c]) * cfg.rescale_factor) as f32;
            planes[c * n + i] = (x - cfg.image_mean[c]) / cfg.image_std[c];
        }
    }
    Ok((planes, h, w))
}

/// Writes the patch rows of frames `frames` (each `[3][h][w]`, `temporal_patch_size` of them) for
/// one temporal patch.
fn patchify_into(
    out: &mut Vec<f32>,
    frames: &[&[f32]],
    h: usize,
    w: usize,
    cfg: &ImageProcessorConfig,
) {
    let (p, m) = (cfg.patch_size as usize, cfg.merge_size as usize);
    let (gh, gw) = (h / p, w / p);
    let n = h * w;
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for mh in 0..m {
                for mw in 0..m {
                    let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                    for c in 0..3 {
                        for frame in frames {
                            for py in 0..p {
                                let start = c * n + (y0 + py) * w + x0;
                                out.extend_from_slice(&frame[start..start + p]);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// One image: resized by [`smart_resize`], tiled to `temporal_patch_size` frames, patchified.
/// Equal to transformers' PIL-backed `Qwen2VLImageProcessor` `pixel_values` / `image_grid_thw`.
pub fn process_image(
    img: &RgbImage,
    cfg: &ImageProcessorConfig,
) -> Result<ImageFeatures, ProcessError> {
    let (planes, h, w) = normalised_planes(img, cfg)?;
    let (hp, wp) = (h / cfg.patch_size, w / cfg.patch_size);
    let frames: Vec<&[f32]> = vec![&planes; cfg.temporal_patch_size as usize];
    let mut pixel_values = Vec::with_capacity(hp as usize * wp as usize * cfg.row_len());
    patchify_into(&mut pixel_values, &frames, h as usize, w as usize, cfg);
    Ok(ImageFeatures {
        pixel_values,
        grid_thw: [1, hp, wp],
    })
}

/// A video's sampled frames (all the same size): each frame resized and normalised like an image
/// (pass [`ImageProcessorConfig::for_video`] for Qwen3-Omni's video bounds), the frame count padded
/// to a multiple of `temporal_patch_size` by repeating the last frame, then patchified with the
/// temporal patch outermost.
pub fn process_video(
    frames: &[RgbImage],
    cfg: &ImageProcessorConfig,
) -> Result<ImageFeatures, ProcessError> {
    let first = frames
        .first()
        .ok_or_else(|| ProcessError::InvalidVideo("a video needs at least one frame".into()))?;
    if let Some(bad) = frames
        .iter()
        .find(|f| (f.width, f.height) != (first.width, first.height))
    {
        return Err(ProcessError::InvalidVideo(format!(
            "frames differ in size: {}x{} and {}x{}",
            first.width, first.height, bad.width, bad.height
        )));
    }
    let mut planes = Vec::with_capacity(frames.len());
    let (mut h, mut w) = (0, 0);
    for f in frames {
        let (p, fh, fw) = normalised_planes(f, cfg)?;
        (h, w) = (fh, fw);
        planes.push(p);
    }
    let tp = cfg.temporal_patch_size as usize;
    let padded = planes.len().div_ceil(tp) * tp;
    let refs: Vec<&[f32]> = (0..padded)
        .map(|i| planes[i.min(planes.len() - 1)].as_slice())
        .collect();
    let (hp, wp) = (h / cfg.patch_size, w / cfg.patch_size);
    let gt = padded / tp;
    let mut pixel_values = Vec::with_capacity(gt * hp as usize * wp as usize * cfg.row_len());
    for chunk in refs.chunks_exact(tp) {
        patchify_into(&mut pixel_values, chunk, h as usize, w as usize, cfg);
    }
    Ok(ImageFeatures {
        pixel_values,
        grid_thw: [gt as u32, hp, wp],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_rounds_half_to_even() {
        // 720 / 32 = 22.5: Python's round gives 22 (704); f64::round would give 23 (736).
        assert_eq!(
            smart_resize(720, 1280, 32, 3136, 12_845_056),
            Ok((704, 1280))
        );
        assert_eq!((720f64 / 32.0).round() * 32.0, 736.0);
        // 20x20 is below min_pixels: the upscale branch.
        assert_eq!(smart_resize(20, 20, 32, 3136, 12_845_056), Ok((64, 64)));
        assert!(smart_resize(1, 300, 32, 3136, 12_845_056).is_err());
    }

    #[test]
    fn smart_resize_downscale_stays_within_max_pixels() {
        let (h, w) = smart_resize(3456, 3840, 32, 3136, 12_845_056).unwrap_or((0, 0));
        assert!(u64::from(h) * u64::from(w) <= 12_845_056);
        assert_eq!((h % 32, w % 32), (0, 0));
    }

    #[test]
    fn tokens_count_merged_patches() {
        assert_eq!(image_tokens([1, 44, 80], 2), 880);
    }
}
