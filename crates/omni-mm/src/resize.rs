//! PIL's bicubic resize (`Image.resize(size, Image.BICUBIC)`) on RGB8, bit for bit.
//!
//! The facts reproduced (Pillow's `libImaging/Resample.c`): a separable filter, horizontal pass
//! first into an 8-bit intermediate, then vertical; the cubic kernel with `a = -0.5` and support 2,
//! scaled by the downscale factor (antialiasing); per output sample the window is
//! `[trunc(center - support + 0.5), trunc(center + support + 0.5))` clipped to the image, the
//! weights are normalised to sum 1 in f64, then turned into 22-bit fixed point (rounded half away
//! from zero); sums start at `1 << 21` and are shifted right by 22 and clamped to 0..=255. A pass
//! whose size does not change is skipped, as PIL does.

use crate::image::RgbImage;

/// Fixed-point precision of PIL's 8-bit resampling (`32 - 8 - 2`).
const PRECISION_BITS: u32 = 22;

fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// One pass's filter taps: for each output sample, the first input index and its weights.
struct Coeffs {
    /// Taps per output sample (the stride of `weights`).
    ksize: usize,
    /// `(first input index, number of taps)` per output sample.
    bounds: Vec<(usize, usize)>,
    /// Fixed-point weights, `ksize` per output sample.
    weights: Vec<i32>,
}

fn coeffs(in_size: usize, out_size: usize) -> Coeffs {
    const SUPPORT: f64 = 2.0;
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = SUPPORT * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut weights = vec![0i32; out_size * ksize];
    let mut k = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // C's (int) cast truncates toward zero, as `as i64` does.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let n = xmax.saturating_sub(xmin);
        let mut ww = 0.0;
        for (x, kx) in k.iter_mut().enumerate().take(n) {
            let w = bicubic(((x + xmin) as f64 - center + 0.5) * ss);
            *kx = w;
            ww += w;
        }
        let row = &mut weights[xx * ksize..(xx + 1) * ksize];
        for (x, out) in row.iter_mut().enumerate().take(n) {
            let w = if ww != 0.0 { k[x] / ww } else { k[x] };
            let f = w * f64::from(1u32 << PRECISION_BITS);
            *out = if w < 0.0 {
                (-0.5 + f) as i32
            } else {
                (0.5 + f) as i32
            };
        }
        bounds.push((xmin, n));
    }
    Coeffs {
        ksize,
        bounds,
        weights,
    }
}

fn clip8(v: i64) -> u8 {
    (v >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Horizontal pass over rows `y0..y1` of `src` (`w_in` wide) into a `w_out`-wide image.
fn horizontal(src: &[u8], w_in: usize, rows: std::ops::Range<usize>, c: &Coeffs) -> Vec<u8> {
    let w_out = c.bounds.len();
    let mut out = Vec::with_capacity(rows.len() * w_out * 3);
    let init = 1i64 << (PRECISION_BITS - 1);
    for y in rows {
        let line = &src[y * w_in * 3..(y + 1) * w_in * 3];
        for (xx, &(xmin, n)) in c.bounds.iter().enumerate() {
            let k = &c.weights[xx * c.ksize..xx * c.ksize + n];
            let (mut s0, mut s1, mut s2) = (init, init, init);
            for (x, &w) in k.iter().enumerate() {
                let p = (xmin + x) * 3;
                let w = i64::from(w);
                s0 += i64::from(line[p]) * w;
                s1 += i64::from(line[p + 1]) * w;
                s2 += i64::from(line[p + 2]) * w;
            }
            out.extend_from_slice(&[clip8(s0), clip8(s1), clip8(s2)]);
        }
    }
    out
}

/// Vertical pass: `src` is `width` wide; output row `yy` reads rows `bounds[yy].0 - row_offset ..`.
fn vertical(src: &[u8], width: usize, row_offset: usize, c: &Coeffs) -> Vec<u8> {
    let h_out = c.bounds.len();
    let stride = width * 3;
    let mut out = vec![0u8; h_out * stride];
    let init = 1i64 << (PRECISION_BITS - 1);
    let mut acc = vec![0i64; stride];
    for (yy, &(ymin, n)) in c.bounds.iter().enumerate() {
        let k = &c.weights[yy * c.ksize..yy * c.ksize + n];
        acc.fill(init);
        for (y, &w) in k.iter().enumerate() {
            let row = ymin - row_offset + y;
            let line = &src[row * stride..(row + 1) * stride];
            let w = i64::from(w);
            for (a, &p) in acc.iter_mut().zip(line) {
                *a += i64::from(p) * w;
            }
        }
        for (o, &a) in out[yy * stride..(yy + 1) * stride].iter_mut().zip(&acc) {
            *o = clip8(a);
        }
    }
    out
}

/// Resizes `src` to `width x height` exactly as PIL's `Image.resize((width, height), BICUBIC)`.
///
/// Both sizes must be non-zero.
pub fn resize_bicubic(src: &RgbImage, width: u32, height: u32) -> RgbImage {
    let (w_in, h_in) = (src.width as usize, src.height as usize);
    let (w_out, h_out) = (width as usize, height as usize);
    if w_in == w_out && h_in == h_out {
        return src.clone();
    }
    let cv = coeffs(h_in, h_out);
    let data = if w_in != w_out {
        let ch = coeffs(w_in, w_out);
        // Only the rows the vertical pass reads, as PIL does (the values do not depend on it).
        let first = cv.bounds.first().map_or(0, |b| b.0);
        let last = cv.bounds.last().map_or(0, |b| b.0 + b.1);
        let tmp = horizontal(&src.data, w_in, first..last, &ch);
        if h_in != h_out {
            vertical(&tmp, w_out, first, &cv)
        } else {
            tmp
        }
    } else {
        vertical(&src.data, w_in, 0, &cv)
    };
    RgbImage {
        width,
        height,
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_is_interpolating() {
        assert_eq!(bicubic(0.0), 1.0);
        assert_eq!(bicubic(1.0), 0.0);
        assert_eq!(bicubic(-2.0), 0.0);
    }

    #[test]
    fn constant_image_stays_constant() {
        let src = RgbImage {
            width: 7,
            height: 5,
            data: vec![200; 7 * 5 * 3],
        };
        for (w, h) in [(3, 2), (20, 11), (7, 9), (2, 5)] {
            let out = resize_bicubic(&src, w, h);
            assert!(out.data.iter().all(|&v| v == 200), "{w}x{h}");
        }
    }
}
