//! Decoding WAV / FLAC / MP3 and resampling to 16 kHz, against libsndfile (what librosa gives
//! vLLM), scipy's `resample_poly` and soxr_hq (librosa's default resampler, vLLM's default).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{blake3_f32, bytes, f32s, golden};
use omni_mm::{MediaError, MediaLimits, decode_audio, resample};

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn flac_stereo_decodes_to_the_librosa_mono_mix() {
    let g = golden();
    let a = decode_audio(
        &bytes("tone_44k1_stereo.flac"),
        Some("flac"),
        &MediaLimits::default(),
    )
    .unwrap();
    assert_eq!(a.sample_rate, 44_100);
    assert_eq!(
        a.samples.len() as u64,
        g["resample"]["decoded_frames"].as_u64().unwrap()
    );
    // Lossless: bit-exact with libsndfile's decode averaged by np.mean.
    assert_eq!(
        blake3_f32(&a.samples),
        g["resample"]["mono_blake3"].as_str().unwrap()
    );
}

#[test]
fn resample_44k1_to_16k_equals_scipy_resample_poly() {
    let a = decode_audio(
        &bytes("tone_44k1_stereo.flac"),
        None,
        &MediaLimits::default(),
    )
    .unwrap();
    let y = resample(&a.samples, 44_100, 16_000);
    let scipy = f32s("tone.resample_poly.f32");
    let soxr = f32s("tone.soxr_hq.f32");
    assert_eq!(y.len(), scipy.len());
    let d_scipy = max_abs(&y, &scipy);
    let n = y.len().min(soxr.len());
    let d_soxr = max_abs(&y[..n], &soxr[..n]);
    let d_soxr_interior = max_abs(&y[200..n - 200], &soxr[200..n - 200]);
    eprintln!(
        "resample vs scipy.signal.resample_poly: max abs {d_scipy:.2e}; vs soxr_hq (vLLM's default): \
         {d_soxr:.2e} ({d_soxr_interior:.2e} away from the edges)"
    );
    assert!(d_scipy <= 1e-6, "vs scipy {d_scipy}");
    // A different filter: about -55 dB of a full-scale signal, mostly at the clip edges.
    assert!(d_soxr <= 5e-3, "vs soxr {d_soxr}");
}

#[test]
fn mp3_decodes_like_libsndfile() {
    let g = golden();
    let a = decode_audio(
        &bytes("tone_44k1.mp3"),
        Some("mp3"),
        &MediaLimits::default(),
    )
    .unwrap();
    assert_eq!(
        u64::from(a.sample_rate),
        g["mp3"]["sample_rate"].as_u64().unwrap()
    );
    let want = f32s("tone_44k1.mp3.sndfile.f32");
    eprintln!(
        "mp3: symphonia {} frames, libsndfile/mpg123 {} frames",
        a.samples.len(),
        want.len()
    );
    // Find the alignment (encoder delay handling may differ) and compare there.
    let n = a.samples.len().min(want.len()) - 2000;
    let (best_shift, best) = (-1200i64..=1200)
        .map(|s| {
            let (x, y): (&[f32], &[f32]) = if s >= 0 {
                (&a.samples[s as usize..], &want[..])
            } else {
                (&a.samples[..], &want[(-s) as usize..])
            };
            (
                s,
                max_abs(
                    &x[..n.min(x.len()).min(y.len())],
                    &y[..n.min(x.len()).min(y.len())],
                ),
            )
        })
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap();
    eprintln!("mp3 vs libsndfile: best shift {best_shift} samples, max abs {best:.2e}");
    // Same length, same alignment (both trim the encoder delay from the LAME header).
    assert_eq!(a.samples.len(), want.len());
    assert_eq!(best_shift, 0);
    assert!(
        best < 1e-5,
        "mp3 decode differs by {best} at shift {best_shift}"
    );
}

#[test]
fn a_wav_declared_as_mp3_is_refused_with_a_clear_error() {
    let e = decode_audio(
        &bytes("clip_160037.wav"),
        Some("mp3"),
        &MediaLimits::default(),
    )
    .unwrap_err();
    assert!(matches!(e, MediaError::UnknownAudioFormat { .. }), "{e}");
    assert!(e.to_string().contains("expected mp3"), "{e}");
    let e = decode_audio(
        &bytes("img_20x20.png"),
        Some("mp3"),
        &MediaLimits::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("expected mp3"), "{e}");
    let e = decode_audio(&[0u8; 4096], None, &MediaLimits::default()).unwrap_err();
    assert!(matches!(e, MediaError::UnknownAudioFormat { .. }), "{e}");
}
