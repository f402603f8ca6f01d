//! `process_image` / `process_video` against transformers' PIL-backed `Qwen2VLImageProcessor`:
//! bit-exact `pixel_values` (blake3 of the f32 bytes) and `image_grid_thw`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{blake3_f32, bytes, floats, golden};
use omni_mm::{ImageProcessorConfig, MediaLimits, decode_image, process_image, process_video};

fn check_image(case: &str) {
    let g = golden();
    let c = &g["images"][case];
    let img = decode_image(&bytes(c["file"].as_str().unwrap()), &MediaLimits::default()).unwrap();
    let f = process_image(&img, &ImageProcessorConfig::default()).unwrap();
    let grid: Vec<u32> = common::u32s(&c["grid_thw"]);
    assert_eq!(f.grid_thw.to_vec(), grid, "{case}: grid_thw");
    let rows = f.num_patches();
    assert_eq!(
        vec![rows as u64, 1536],
        c["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect::<Vec<_>>()
    );
    let last = &f.pixel_values[(rows - 1) * 1536..];
    let want = floats(&c["row_last"]);
    let diff = last
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert_eq!(diff, 0.0, "{case}: last row differs by up to {diff}");
    assert_eq!(
        blake3_f32(&f.pixel_values),
        c["blake3"].as_str().unwrap(),
        "{case}: pixel_values differ"
    );
}

#[test]
fn image_1280x720_equals_transformers_exactly() {
    // smart_resize ties-even: 720 -> 704, so grid (1, 44, 80).
    check_image("img_1280x720");
}

#[test]
fn image_20x20_upscale_equals_transformers_exactly() {
    check_image("img_20x20");
}

#[test]
fn image_over_max_pixels_downscale_equals_transformers_exactly() {
    check_image("img_big");
}

/// How far transformers' fast (torchvision) image processor is from the slow one we match,
/// as measured by the fixture script: at most one u8 level on a small fraction of values.
#[test]
fn fast_processor_difference_is_recorded_and_small() {
    let g = golden();
    for case in ["img_1280x720", "img_20x20"] {
        let d = &g["images"][case]["fast_vs_slow"];
        if d.is_null() {
            continue; // torchvision was not importable when the fixtures were made
        }
        let levels = d["max_u8_levels"].as_f64().unwrap();
        let frac = d["frac_differing"].as_f64().unwrap();
        eprintln!(
            "{case}: fast vs slow max {levels:.3} u8 levels, {:.4}% of values differ",
            frac * 100.0
        );
        assert!(levels <= 1.01 && frac < 0.01, "{case}: {d}");
    }
}

#[test]
fn video_odd_frames_pad_by_repeating_the_last() {
    let g = golden();
    let c = &g["video"];
    let frames: Vec<_> = c["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| decode_image(&bytes(f.as_str().unwrap()), &MediaLimits::default()).unwrap())
        .collect();
    assert_eq!(frames.len(), 3);
    let cfg = ImageProcessorConfig::default().for_video();
    let f = process_video(&frames, &cfg).unwrap();
    // 1280x720 frames are over the video max_pixels (786432): downscaled to 640x1152.
    assert_eq!(f.grid_thw.to_vec(), common::u32s(&c["grid_thw"]));
    assert_eq!(blake3_f32(&f.pixel_values), c["blake3"].as_str().unwrap());
    // transformers' video processor resizes with torchvision: a few values differ by 1-2 u8 levels.
    if let Some(d) = c.get("hf_video_processor_vs_pil") {
        eprintln!("video: HF (torchvision) video processor vs the PIL path: {d}");
        assert!(d["max_abs"].as_f64().unwrap() <= 2.01 * 2.0 / 255.0);
    }
}
