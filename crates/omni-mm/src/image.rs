//! Image decoding: PNG, JPEG, WebP to RGB8, with the pixel limit checked on the header first.
//!
//! Conversion to RGB follows vLLM's `convert_image_mode(image, "RGB")`: grey is replicated, and an
//! image with alpha is composited over white (vLLM's `rgba_to_rgb` default background) with PIL's
//! `paste(mask=alpha)` rounding. EXIF orientation is not applied (neither PIL's `Image.open` nor
//! vLLM applies it).
//!
//! Decoders against PIL (tests/image_decode.rs): PNG and WebP (lossless and lossy) are bit-exact;
//! JPEG (zune-jpeg vs libjpeg-turbo) differs in IDCT rounding and chroma upsampling, by up to 7
//! u8 levels (mean 0.38) on a 4:2:0 quality-90 file. A JPEG without its end-of-image marker is
//! refused, as PIL refuses a truncated file.

use std::io::Cursor;

use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;

use crate::error::{MediaError, MediaLimits};

/// An 8-bit RGB image, rows top to bottom, `data.len() == width * height * 3`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Interleaved R, G, B bytes, row-major.
    pub data: Vec<u8>,
}

impl RgbImage {
    /// The pixel at column `x`, row `y`.
    pub fn pixel(&self, x: u32, y: u32) -> [u8; 3] {
        let i = (y as usize * self.width as usize + x as usize) * 3;
        [self.data[i], self.data[i + 1], self.data[i + 2]]
    }
}

/// The formats this crate decodes, told apart by their signatures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Png,
    Jpeg,
    WebP,
}

fn sniff(bytes: &[u8]) -> Result<Format, MediaError> {
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Ok(Format::Png)
    } else if bytes.starts_with(&[0xff, 0xd8, 0xff]) {
        Ok(Format::Jpeg)
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Ok(Format::WebP)
    } else {
        Err(MediaError::UnknownImageFormat)
    }
}

fn invalid(e: impl std::fmt::Display) -> MediaError {
    MediaError::InvalidImage(e.to_string())
}

fn jpeg_decoder(bytes: &[u8]) -> zune_jpeg::JpegDecoder<ZCursor<&[u8]>> {
    // Sizes are checked by `decode_image` against the pixel limit, not by the decoder's defaults.
    let options = DecoderOptions::default()
        .set_strict_mode(false)
        .set_max_width(usize::MAX)
        .set_max_height(usize::MAX);
    zune_jpeg::JpegDecoder::new_with_options(ZCursor::new(bytes), options)
}

/// The `(width, height)` an encoded image declares, read from its header only (no raster is decoded).
pub fn image_dimensions(bytes: &[u8]) -> Result<(u32, u32), MediaError> {
    match sniff(bytes)? {
        Format::Png => {
            let reader = png::Decoder::new(Cursor::new(bytes))
                .read_info()
                .map_err(invalid)?;
            let info = reader.info();
            Ok((info.width, info.height))
        }
        Format::Jpeg => {
            let mut d = jpeg_decoder(bytes);
            d.decode_headers().map_err(invalid)?;
            let (w, h) = d
                .dimensions()
                .ok_or_else(|| invalid("JPEG without a frame header"))?;
            // JPEG sizes are 16-bit.
            Ok((w as u32, h as u32))
        }
        Format::WebP => {
            let d = image_webp::WebPDecoder::new(Cursor::new(bytes)).map_err(invalid)?;
            Ok(d.dimensions())
        }
    }
}

/// Decodes a PNG, JPEG or WebP image to RGB8.
///
/// The header's `width * height` is checked against `limits.max_image_pixels` before anything is
/// decoded, and each decoder's own allocation limit is set from the checked size, so a header that
/// lies cannot make it allocate more. PNG: palette and low bit depths are expanded, 16-bit samples
/// keep their high byte (as PIL opens 16-bit RGB), APNG gives its first frame.
pub fn decode_image(bytes: &[u8], limits: &MediaLimits) -> Result<RgbImage, MediaError> {
    let format = sniff(bytes)?;
    let (width, height) = image_dimensions(bytes)?;
    let pixels = u64::from(width) * u64::from(height);
    if pixels > limits.max_image_pixels {
        return Err(MediaError::ImageTooLarge {
            width,
            height,
            pixels,
            limit: limits.max_image_pixels,
        });
    }
    if pixels == 0 {
        return Err(MediaError::EmptyImage { width, height });
    }
    // The largest raster a supported format decodes to is 4 bytes a pixel after expansion.
    let max_bytes =
        usize::try_from(pixels.saturating_mul(8).saturating_add(1 << 20)).unwrap_or(usize::MAX);
    let n = pixels as usize;
    let (channels, raw) = match format {
        Format::Png => {
            let mut d =
                png::Decoder::new_with_limits(Cursor::new(bytes), png::Limits { bytes: max_bytes });
            d.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
            let mut reader = d.read_info().map_err(invalid)?;
            let size = reader
                .output_buffer_size()
                .ok_or_else(|| invalid("PNG too large"))?;
            let mut buf = vec![0u8; size];
            let frame = reader.next_frame(&mut buf).map_err(invalid)?;
            buf.truncate(frame.buffer_size());
            (buf.len() / n, buf)
        }
        Format::Jpeg => {
            if !jpeg_has_end(bytes) {
                // zune-jpeg fills a truncated scan in; PIL refuses it ("image file is truncated").
                return Err(invalid("truncated JPEG: no end-of-image marker"));
            }
            let mut d = jpeg_decoder(bytes);
            d.decode_headers().map_err(invalid)?;
            let out = match d.input_colorspace() {
                Some(ColorSpace::Luma) => ColorSpace::Luma,
                _ => ColorSpace::RGB, // YCbCr, RGB, CMYK, YCCK
            };
            let mut d = zune_jpeg::JpegDecoder::new_with_options(
                ZCursor::new(bytes),
                d.options().jpeg_set_out_colorspace(out),
            );
            let buf = d.decode().map_err(invalid)?;
            (buf.len() / n, buf)
        }
        Format::WebP => {
            let mut d = image_webp::WebPDecoder::new(Cursor::new(bytes)).map_err(invalid)?;
            d.set_memory_limit(max_bytes);
            let channels = if d.has_alpha() { 4 } else { 3 };
            let mut buf = vec![0u8; n * channels];
            d.read_image(&mut buf).map_err(invalid)?;
            (channels, buf)
        }
    };
    if raw.len() != n * channels || !(1..=4).contains(&channels) {
        return Err(invalid(format!(
            "decoded {} bytes for {width}x{height}",
            raw.len()
        )));
    }
    Ok(RgbImage {
        width,
        height,
        data: to_rgb(&raw, channels),
    })
}

/// Whether a JPEG has an end-of-image marker (`FF D9`) after its first start-of-scan (`FF DA`).
fn jpeg_has_end(bytes: &[u8]) -> bool {
    let sos = bytes.windows(2).position(|w| w == [0xff, 0xda]);
    sos.is_some_and(|s| bytes[s..].windows(2).any(|w| w == [0xff, 0xd9]))
}

/// PIL's `DIV255`: `x / 255` rounded, for `x <= 255 * 255`.
fn div255(x: u32) -> u8 {
    let t = x + 128;
    (((t >> 8) + t) >> 8) as u8
}

/// Grey, grey + alpha, RGB or RGBA bytes to RGB; alpha is composited over white with PIL's
/// `paste(mask=alpha)` arithmetic (vLLM's `rgba_to_rgb`): `DIV255(255 * (255 - a) + c * a)`.
fn to_rgb(raw: &[u8], channels: usize) -> Vec<u8> {
    match channels {
        3 => return raw.to_vec(),
        1 => return raw.iter().flat_map(|&g| [g; 3]).collect(),
        _ => {}
    }
    let mut out = Vec::with_capacity(raw.len() / channels * 3);
    for px in raw.chunks_exact(channels) {
        let (rgb, a) = match channels {
            1 => ([px[0]; 3], 255),
            2 => ([px[0]; 3], px[1]),
            _ => ([px[0], px[1], px[2]], px[3]),
        };
        let a = u32::from(a);
        for c in rgb {
            out.push(div255(255 * (255 - a) + u32::from(c) * a));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn div255_matches_exact_rounding() {
        for x in 0..=(255u32 * 255) {
            let exact = (f64::from(x) / 255.0).round() as u32;
            assert!(
                (u32::from(div255(x)) as i64 - exact as i64).abs() <= 1,
                "x={x}"
            );
        }
        assert_eq!(div255(255 * 255), 255);
        assert_eq!(div255(0), 0);
    }
}
