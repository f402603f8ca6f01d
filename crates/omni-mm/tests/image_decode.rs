//! Image decoding against PIL (what vLLM decodes with): lossless formats bit-exact, lossy ones
//! within a measured bound; alpha composited over white like vLLM's `rgba_to_rgb`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{bytes, golden};
use omni_mm::{MediaLimits, decode_image, image_dimensions};

fn diff(a: &[u8], b: &[u8]) -> (u8, f64, f64) {
    assert_eq!(a.len(), b.len());
    let max = a
        .iter()
        .zip(b)
        .map(|(x, y)| x.abs_diff(*y))
        .max()
        .unwrap_or(0);
    let frac = a.iter().zip(b).filter(|(x, y)| x != y).count() as f64 / a.len() as f64;
    let mean = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(x.abs_diff(*y)))
        .sum::<f64>()
        / a.len() as f64;
    (max, frac, mean)
}

#[test]
fn rgba_is_composited_over_white_like_vllm() {
    let img = decode_image(&bytes("img_rgba.png"), &MediaLimits::default()).unwrap();
    assert_eq!((img.width, img.height), (64, 48));
    assert_eq!(img.data, bytes("img_rgba.rgb.u8"));
}

#[test]
fn lossless_webp_is_exact() {
    let img = decode_image(&bytes("img_lossless.webp"), &MediaLimits::default()).unwrap();
    let h = blake3::hash(&img.data).to_hex().to_string();
    assert_eq!(h, golden()["lossless_webp_rgb_blake3"].as_str().unwrap());
}

/// zune-jpeg and libjpeg-turbo (PIL) differ in IDCT rounding and chroma upsampling; on this 4:2:0
/// quality-90 file: at most 7 levels, mean well under one level. A known difference from vLLM.
/// Lossy WebP (image-webp vs libwebp) is bit-exact.
#[test]
fn jpeg_and_lossy_webp_are_close_to_pil() {
    for (file, max_levels, max_mean) in [("img_q90.jpg", 8u8, 0.6), ("img_lossy.webp", 0, 0.0)] {
        let b = bytes(file);
        assert_eq!(image_dimensions(&b).unwrap(), (160, 120));
        let img = decode_image(&b, &MediaLimits::default()).unwrap();
        let (max, frac, mean) = diff(&img.data, &bytes(&format!("{file}.rgb.u8")));
        eprintln!(
            "{file}: vs PIL max {max} u8 levels, mean {mean:.3}, {:.2}% of values differ",
            frac * 100.0
        );
        assert!(
            max <= max_levels && mean <= max_mean,
            "{file}: max {max}, mean {mean}"
        );
    }
}
