//! vLLM's media limits: the pixel cap on the header before any raster is allocated, the audio
//! size cap before decoding, the duration cap on the header and while decoding; malformed input.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use common::bytes;
use omni_mm::{MediaError, MediaLimits, decode_audio, decode_image, image_dimensions};

/// Counts the largest single allocation, to show a lying header allocates nothing big.
struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only records sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: same layout contract as our caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn crc32(data: &[u8]) -> u32 {
    let mut c = 0xffff_ffffu32;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xedb8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// A PNG whose IHDR claims `w x h` RGB8, followed by a tiny (wrong) IDAT and IEND.
fn lying_png(w: u32, h: u32) -> Vec<u8> {
    let mut out = vec![0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a];
    let mut chunk = |kind: &[u8; 4], data: &[u8]| {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let mut body = kind.to_vec();
        body.extend_from_slice(data);
        out.extend_from_slice(&body);
        out.extend_from_slice(&crc32(&body).to_be_bytes());
    };
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&w.to_be_bytes());
    ihdr.extend_from_slice(&h.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    chunk(b"IHDR", &ihdr);
    chunk(b"IDAT", &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01]);
    chunk(b"IEND", &[]);
    out
}

#[test]
fn png_claiming_100000x100000_is_refused_from_the_header_without_allocating() {
    let png = lying_png(100_000, 100_000);
    assert_eq!(image_dimensions(&png).unwrap(), (100_000, 100_000));
    LARGEST.store(0, Ordering::Relaxed);
    let e = decode_image(&png, &MediaLimits::default()).unwrap_err();
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(
        matches!(
            e,
            MediaError::ImageTooLarge {
                pixels: 10_000_000_000,
                limit: 178_956_970,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("VLLM_MAX_IMAGE_PIXELS"), "{e}");
    // Other tests run in parallel in this process: bound by far less than a 30 GB raster.
    assert!(largest < 64 << 20, "largest allocation {largest} bytes");
}

#[test]
fn pixel_limit_applies_at_the_boundary() {
    let png = bytes("img_20x20.png");
    let at = MediaLimits {
        max_image_pixels: 400,
        ..MediaLimits::default()
    };
    assert!(decode_image(&png, &at).is_ok());
    let below = MediaLimits {
        max_image_pixels: 399,
        ..MediaLimits::default()
    };
    assert!(matches!(
        decode_image(&png, &below),
        Err(MediaError::ImageTooLarge { .. })
    ));
}

#[test]
fn truncated_and_unknown_images_are_errors() {
    let png = bytes("img_1280x720.png");
    let e = decode_image(&png[..png.len() / 2], &MediaLimits::default()).unwrap_err();
    assert!(matches!(e, MediaError::InvalidImage(_)), "{e}");
    let jpg = bytes("img_q90.jpg");
    assert!(decode_image(&jpg[..jpg.len() / 3], &MediaLimits::default()).is_err());
    let e = decode_image(
        b"GIF89a\x01\x00\x01\x00\x00\x00\x00",
        &MediaLimits::default(),
    )
    .unwrap_err();
    assert!(matches!(e, MediaError::UnknownImageFormat), "{e}");
    assert!(matches!(
        decode_image(&[7u8; 64], &MediaLimits::default()),
        Err(MediaError::UnknownImageFormat)
    ));
    assert!(matches!(
        decode_image(&png[..8], &MediaLimits::default()),
        Err(MediaError::InvalidImage(_))
    ));
}

/// A 16 kHz mono PCM16 WAV whose header declares `declared_s` seconds but carries `actual` samples.
fn wav(declared_s: u32, actual: usize) -> Vec<u8> {
    let data_len = declared_s * 16_000 * 2;
    let mut v = Vec::new();
    v.extend_from_slice(b"RIFF");
    v.extend_from_slice(&(36 + data_len).to_le_bytes());
    v.extend_from_slice(b"WAVEfmt ");
    v.extend_from_slice(&16u32.to_le_bytes());
    v.extend_from_slice(&1u16.to_le_bytes()); // PCM
    v.extend_from_slice(&1u16.to_le_bytes()); // mono
    v.extend_from_slice(&16_000u32.to_le_bytes());
    v.extend_from_slice(&32_000u32.to_le_bytes());
    v.extend_from_slice(&2u16.to_le_bytes());
    v.extend_from_slice(&16u16.to_le_bytes());
    v.extend_from_slice(b"data");
    v.extend_from_slice(&data_len.to_le_bytes());
    for i in 0..actual {
        v.extend_from_slice(&(((i % 100) as i16 - 50) * 300).to_le_bytes());
    }
    v
}

#[test]
fn a_two_hour_wav_is_refused_by_the_duration_cap() {
    let clip = wav(2 * 3600, 16_000);
    let e = decode_audio(&clip, Some("wav"), &MediaLimits::default()).unwrap_err();
    assert!(matches!(e, MediaError::AudioTooLong { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("VLLM_MAX_AUDIO_DECODE_DURATION_S") && msg.contains("7200.00 s"),
        "{msg}"
    );
}

/// The FLAC fixture with STREAMINFO's total sample count set to 0 ("unknown", as a streaming
/// encoder writes it): nothing declares the length, so only the check while decoding can stop it.
fn flac_without_length(flac: &[u8]) -> Vec<u8> {
    assert_eq!(&flac[..4], b"fLaC");
    assert_eq!(flac[4] & 0x7f, 0, "first metadata block is STREAMINFO");
    let mut v = flac.to_vec();
    // STREAMINFO data starts at 8; bytes 18..26 hold rate (20 bits), channels (3), bits (5) and
    // the 36-bit total: its top 4 bits are the low nibble of byte 21.
    v[21] &= 0xf0;
    v[22..26].fill(0);
    v
}

#[test]
fn duration_cap_stops_decoding_early() {
    // The MP3 fixture is 1 s and its LAME header says so: a 0.25 s cap refuses it up front.
    let mp3 = bytes("tone_44k1.mp3");
    let limits = MediaLimits {
        max_audio_duration_s: 0.25,
        ..MediaLimits::default()
    };
    let e = decode_audio(&mp3, Some("mp3"), &limits).unwrap_err();
    assert!(e.to_string().contains("header declares 1.0"), "{e}");
    // A 2 s FLAC that declares no length, with a 1 s cap: decoding stops within a block (4096
    // samples) of the cap instead of decoding the whole clip.
    let flac = flac_without_length(&bytes("tone_44k1_stereo.flac"));
    assert_eq!(
        decode_audio(&flac, Some("flac"), &MediaLimits::default())
            .unwrap()
            .samples
            .len(),
        88_200
    );
    let limits = MediaLimits {
        max_audio_duration_s: 1.0,
        ..MediaLimits::default()
    };
    let e = decode_audio(&flac, Some("flac"), &limits).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, MediaError::AudioTooLong { .. }), "{msg}");
    assert!(msg.contains("decoding stopped after"), "{msg}");
    let stopped: f64 = msg
        .rsplit("after ")
        .next()
        .unwrap()
        .trim_end_matches(" s")
        .parse()
        .unwrap();
    assert!(
        (1.0..=1.0 + 4096.0 / 44_100.0 + 0.005).contains(&stopped),
        "{msg}"
    );
    // A WAV whose header is honest but longer than the cap is refused before decoding.
    let e = decode_audio(
        &wav(2, 32_000),
        None,
        &MediaLimits {
            max_audio_duration_s: 1.0,
            ..MediaLimits::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("header declares 2.00 s"), "{e}");
    assert!(decode_audio(&wav(2, 32_000), None, &MediaLimits::default()).is_ok());
}

#[test]
fn audio_size_cap_applies_before_decoding() {
    let clip = bytes("clip_160037.wav");
    let limits = MediaLimits {
        max_audio_bytes: 1000,
        ..MediaLimits::default()
    };
    let e = decode_audio(&clip, Some("wav"), &limits).unwrap_err();
    assert!(
        matches!(e, MediaError::AudioFileTooLarge { limit: 1000, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("VLLM_MAX_AUDIO_CLIP_FILESIZE_MB"));
    assert_eq!(MediaLimits::default().max_audio_bytes, 25 * 1024 * 1024);
}

#[test]
fn truncated_audio_is_an_error_or_what_is_there() {
    let clip = bytes("clip_160037.wav");
    // Cut inside the header: an error.
    assert!(decode_audio(&clip[..30], Some("wav"), &MediaLimits::default()).is_err());
    // Cut inside the data: the samples that are there (as libsndfile reads them).
    let a = decode_audio(&clip[..44 + 2 * 1000], Some("wav"), &MediaLimits::default()).unwrap();
    assert_eq!(a.samples.len(), 1000);
    let flac = bytes("tone_44k1_stereo.flac");
    let r = decode_audio(
        &flac[..flac.len() / 2],
        Some("flac"),
        &MediaLimits::default(),
    );
    assert!(r.map(|a| a.samples.len() < 88_200).unwrap_or(true));
}
