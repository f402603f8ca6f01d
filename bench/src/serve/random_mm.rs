//! vLLM's `random-mm` dataset: random text prompts, each with synthetic images of sizes drawn
//! from `--random-mm-bucket-config` (`{(height, width, frames): probability, ...}`, vLLM's
//! syntax), sent as `image_url` data URLs of PNGs.
//!
//! Every image differs (its pixels come from `--seed`, the request's index and the item's), so
//! neither the encoder cache nor the prefix cache hits; its colours are random per 16x16 block,
//! so the PNG compresses to a few percent of its pixels and generating and sending it does not
//! dominate the run (a 1280x720 image is about 15 KB of PNG, 3520 patches in the server).
//! Not supported: videos (`frames > 1` with a probability above zero) and vLLM's
//! `--random-mm-num-mm-items-range-ratio` (every request has exactly the base item count).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::ServeBenchError;

/// vLLM's default `--random-mm-bucket-config`.
pub const DEFAULT_BUCKET_CONFIG: &str = "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}";

/// Pixels of one colour block, each side.
const BLOCK: u32 = 16;

/// One bucket: an image of `height` x `width` (one frame).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    /// Rows.
    pub height: u32,
    /// Columns.
    pub width: u32,
    /// Probability, normalised over the buckets.
    pub probability: f64,
}

/// Parses vLLM's bucket syntax, `{(720, 1280, 1): 1.0}`; drops zero-probability buckets and
/// normalises the rest.
pub fn parse_buckets(text: &str) -> Result<Vec<Bucket>, ServeBenchError> {
    let bad =
        |why: &str| ServeBenchError::Args(format!("--random-mm-bucket-config {text:?}: {why}"));
    let compact: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    let inner = compact
        .strip_prefix('{')
        .and_then(|s| s.strip_suffix('}'))
        .ok_or_else(|| bad("expected {(height, width, frames): probability, ...}"))?;
    let mut buckets = Vec::new();
    let mut rest = inner;
    while !rest.is_empty() {
        let body = rest
            .strip_prefix('(')
            .ok_or_else(|| bad("expected '(' before a bucket"))?;
        let (tuple, after) = body.split_once("):").ok_or_else(|| bad("expected '):'"))?;
        let dims: Vec<u32> = tuple
            .split(',')
            .map(|d| {
                d.parse::<u32>()
                    .map_err(|_| bad("sizes are positive integers"))
            })
            .collect::<Result<_, _>>()?;
        let [height, width, frames] = dims[..] else {
            return Err(bad("a bucket is (height, width, frames)"));
        };
        let (prob, next) = after.split_once(',').unwrap_or((after, ""));
        let probability: f64 = prob.parse().map_err(|_| bad("a probability is a number"))?;
        if !(probability >= 0.0 && probability.is_finite()) {
            return Err(bad("a probability is >= 0"));
        }
        rest = next;
        if probability == 0.0 {
            continue;
        }
        if frames != 1 {
            return Err(bad("videos (frames > 1) are not supported"));
        }
        if height == 0 || width == 0 {
            return Err(bad("sizes are positive integers"));
        }
        buckets.push(Bucket {
            height,
            width,
            probability,
        });
    }
    let total: f64 = buckets.iter().map(|b| b.probability).sum();
    if buckets.is_empty() || total <= 0.0 {
        return Err(bad("no bucket has a probability above zero"));
    }
    for b in &mut buckets {
        b.probability /= total;
    }
    Ok(buckets)
}

/// The `image_url` data URLs of request `index`: `items` images, their sizes drawn from
/// `buckets`, their pixels from `(seed, index, item)`.
pub fn request_images(
    buckets: &[Bucket],
    items: usize,
    seed: u64,
    index: usize,
) -> Result<Vec<String>, ServeBenchError> {
    let mut rng =
        StdRng::seed_from_u64(seed ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    (0..items)
        .map(|_| {
            let mut u: f64 = rng.random();
            let b = buckets
                .iter()
                .find(|b| {
                    u -= b.probability;
                    u < 0.0
                })
                .or(buckets.last())
                .ok_or_else(|| ServeBenchError::Args("no image bucket".into()))?;
            let png = block_png(b.width, b.height, &mut rng)?;
            Ok(format!(
                "data:image/png;base64,{}",
                super::wav::base64_encode(&png)
            ))
        })
        .collect()
}

/// An RGB PNG of `width` x `height` whose 16x16 blocks have random colours.
pub fn block_png(width: u32, height: u32, rng: &mut StdRng) -> Result<Vec<u8>, ServeBenchError> {
    let cols = width.div_ceil(BLOCK) as usize;
    let rows = height.div_ceil(BLOCK) as usize;
    let colours: Vec<[u8; 3]> = (0..cols * rows).map(|_| rng.random()).collect();
    let mut pixels = Vec::with_capacity(width as usize * height as usize * 3);
    for y in 0..height as usize {
        let row = &colours[(y / BLOCK as usize) * cols..][..cols];
        for x in 0..width as usize {
            pixels.extend_from_slice(&row[x / BLOCK as usize]);
        }
    }
    let mut out = Vec::new();
    let err = |e: png::EncodingError| ServeBenchError::Args(format!("encoding a PNG: {e}"));
    let mut enc = png::Encoder::new(&mut out, width, height);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.set_compression(png::Compression::Fast);
    let mut writer = enc.write_header().map_err(err)?;
    writer.write_image_data(&pixels).map_err(err)?;
    writer.finish().map_err(err)?;
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn bucket_config_parses_vllm_syntax_and_normalises() {
        let b =
            parse_buckets("{(720, 1280, 1): 3, (256, 256, 1): 1.0, (720, 1280, 16): 0.0}").unwrap();
        assert_eq!(b.len(), 2);
        assert_eq!((b[0].height, b[0].width), (720, 1280));
        assert!((b[0].probability - 0.75).abs() < 1e-12);
        assert_eq!(parse_buckets(DEFAULT_BUCKET_CONFIG).unwrap().len(), 2);
        for bad in [
            "(720, 1280, 1): 1.0",
            "{(720, 1280): 1.0}",
            "{(720, 1280, 4): 1.0}",
            "{(720, 1280, 1): -1}",
            "{(720, 1280, 1): 0}",
            "{(0, 1280, 1): 1}",
        ] {
            assert!(parse_buckets(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn images_differ_per_request_and_repeat_per_seed() {
        let b = parse_buckets("{(48, 40, 1): 1.0}").unwrap();
        let a = request_images(&b, 2, 0, 0).unwrap();
        assert_eq!(a.len(), 2);
        assert_ne!(a[0], a[1], "two items of one request differ");
        assert_ne!(a, request_images(&b, 2, 0, 1).unwrap());
        assert_eq!(a, request_images(&b, 2, 0, 0).unwrap());
        assert_ne!(a, request_images(&b, 2, 1, 0).unwrap());
        assert!(a[0].starts_with("data:image/png;base64,iVBORw0KGgo"));
    }

    #[test]
    fn a_720p_block_png_decodes_to_its_size_and_stays_small() {
        let mut rng = StdRng::seed_from_u64(7);
        let png = block_png(1280, 720, &mut rng).unwrap();
        let dec = png::Decoder::new(std::io::Cursor::new(&png));
        let reader = dec.read_info().unwrap();
        let info = reader.info();
        assert_eq!((info.width, info.height), (1280, 720));
        assert!(png.len() < 1280 * 720 * 3 / 20, "{} bytes", png.len());
    }
}
