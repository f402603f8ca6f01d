//! Image decoding: PNG, JPEG, WebP to RGB8, with the pixel limit checked on the header first.
//!
//! Conversion to RGB follows vLLM's `convert_image_mode(image, "RGB")`: grey is replicated, and an
//! image with alpha is composited over white (vLLM's `rgba_to_rgb` default background) with PIL's
//! `paste(mask=alpha)` rounding. EXIF orientation is not applied (neither PIL's `Image.open` nor
//! vLLM applies it).

use std::io::Cursor;

use image::{DynamicImage, ImageFormat, ImageReader, Limits};

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

/// A reader over in-memory bytes.
type BytesReader<'a> = ImageReader<Cursor<&'a [u8]>>;

fn reader(bytes: &[u8]) -> Result<(BytesReader<'_>, ImageFormat), MediaError> {
    let format = image::guess_format(bytes).map_err(|_| MediaError::UnknownImageFormat)?;
    if !matches!(
        format,
        ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP
    ) {
        return Err(MediaError::UnknownImageFormat);
    }
    let mut reader = ImageReader::new(Cursor::new(bytes));
    reader.set_format(format);
    Ok((reader, format))
}

/// The `(width, height)` an encoded image declares, read from its header only (no raster is decoded).
pub fn image_dimensions(bytes: &[u8]) -> Result<(u32, u32), MediaError> {
    let (reader, _) = reader(bytes)?;
    reader
        .into_dimensions()
        .map_err(|e| MediaError::InvalidImage(e.to_string()))
}

/// Decodes a PNG, JPEG or WebP image to RGB8.
///
/// The header's `width * height` is checked against `limits.max_image_pixels` before anything is
/// decoded, and the decoder's own allocation limit is set from the checked size, so a header that
/// lies cannot make it allocate more.
pub fn decode_image(bytes: &[u8], limits: &MediaLimits) -> Result<RgbImage, MediaError> {
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
    let (mut reader, format) = reader(bytes)?;
    if format == ImageFormat::Jpeg && !jpeg_has_end(bytes) {
        // zune-jpeg fills a truncated scan in; PIL refuses it ("image file is truncated").
        return Err(MediaError::InvalidImage(
            "truncated JPEG: no end-of-image marker".into(),
        ));
    }
    let mut decode_limits = Limits::default();
    decode_limits.max_image_width = Some(width);
    decode_limits.max_image_height = Some(height);
    // The largest raster a supported format decodes to is RGBA with 16 bits per channel.
    decode_limits.max_alloc = Some(pixels.saturating_mul(8).saturating_add(1 << 20));
    reader.limits(decode_limits);
    let decoded = reader
        .decode()
        .map_err(|e| MediaError::InvalidImage(e.to_string()))?;
    Ok(to_rgb(decoded))
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

fn to_rgb(img: DynamicImage) -> RgbImage {
    let (width, height) = (img.width(), img.height());
    let data = if img.color().has_alpha() {
        // vLLM's rgba_to_rgb: Image.new("RGB", size, (255, 255, 255)).paste(img, mask=alpha),
        // per channel out = DIV255(255 * (255 - a) + c * a).
        let rgba = img.into_rgba8();
        let mut out = Vec::with_capacity(width as usize * height as usize * 3);
        for px in rgba.pixels() {
            let a = u32::from(px.0[3]);
            for &c in &px.0[..3] {
                out.push(div255(255 * (255 - a) + u32::from(c) * a));
            }
        }
        out
    } else {
        img.into_rgb8().into_raw()
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
