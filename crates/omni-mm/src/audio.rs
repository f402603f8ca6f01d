//! Audio decoding: WAV (PCM), MP3 and FLAC to mono f32 at the clip's own rate.
//!
//! The encoded size is checked before probing; the duration is checked against the header's
//! declared length (when it has one) and again after every decoded packet, so a clip that lies
//! about its length, or has none, stops decoding as soon as it passes the limit (vLLM's
//! `VLLM_MAX_AUDIO_DECODE_DURATION_S`). Channels are averaged to mono (librosa's `to_mono`);
//! integer PCM is scaled by `1 / 2^(bits-1)` like libsndfile. MP3 encoder delay and padding are
//! trimmed when the stream declares them (gapless, as libsndfile's mpg123 does).

use std::io::Cursor;

use symphonia::core::codecs::audio::AudioDecoderOptions;
use symphonia::core::codecs::audio::well_known::{CODEC_ID_FLAC, CODEC_ID_MP3};
use symphonia::core::errors::Error as SymError;
use symphonia::core::formats::probe::Hint;
use symphonia::core::formats::{FormatOptions, TrackType};
use symphonia::core::io::MediaSourceStream;
use symphonia::core::meta::MetadataOptions;

use crate::error::{MediaError, MediaLimits};

/// A decoded mono clip.
#[derive(Debug, Clone, PartialEq)]
pub struct Audio {
    /// Samples per second of `samples`.
    pub sample_rate: u32,
    /// Mono samples in -1..1 (channels averaged).
    pub samples: Vec<f32>,
}

impl Audio {
    /// Length in seconds.
    pub fn duration_s(&self) -> f64 {
        self.samples.len() as f64 / f64::from(self.sample_rate.max(1))
    }
}

/// The container/codec a format hint names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expected {
    Wav,
    Mp3,
    Flac,
}

fn parse_hint(hint: &str) -> Option<Expected> {
    let h = hint.trim().to_ascii_lowercase();
    let h = h.strip_prefix("audio/").unwrap_or(&h);
    match h {
        "wav" | "wave" | "x-wav" | "vnd.wave" => Some(Expected::Wav),
        "mp3" | "mpeg" | "mpga" | "x-mp3" | "mpeg3" | "x-mpeg-3" => Some(Expected::Mp3),
        "flac" | "x-flac" => Some(Expected::Flac),
        _ => None,
    }
}

fn unknown(hint: Option<&str>, detail: impl Into<String>) -> MediaError {
    MediaError::UnknownAudioFormat {
        hint: hint.map_or_else(String::new, |h| format!(" (expected {h})")),
        detail: detail.into(),
    }
}

fn too_long(limits: &MediaLimits, detail: String) -> MediaError {
    MediaError::AudioTooLong {
        limit_s: limits.max_audio_duration_s,
        detail,
    }
}

/// Decodes a WAV, MP3 or FLAC clip to mono f32 at its own sample rate.
///
/// `format_hint` (`"wav"`, `"mp3"`, `"flac"`, or a MIME type such as `"audio/mpeg"`) must agree
/// with what the bytes are: a clip declared as MP3 that is not MP3 is refused, which is stricter
/// than vLLM (librosa sniffs the bytes and ignores the declared format).
pub fn decode_audio(
    bytes: &[u8],
    format_hint: Option<&str>,
    limits: &MediaLimits,
) -> Result<Audio, MediaError> {
    if bytes.len() > limits.max_audio_bytes {
        return Err(MediaError::AudioFileTooLarge {
            bytes: bytes.len(),
            limit: limits.max_audio_bytes,
        });
    }
    let expected = match format_hint {
        None => None,
        Some(h) => Some(parse_hint(h).ok_or_else(|| unknown(Some(h), "unsupported format name"))?),
    };
    let mut hint = Hint::new();
    match expected {
        Some(Expected::Wav) => hint.with_extension("wav"),
        Some(Expected::Mp3) => hint.with_extension("mp3"),
        Some(Expected::Flac) => hint.with_extension("flac"),
        None => &mut hint,
    };
    let mss = MediaSourceStream::new(Box::new(Cursor::new(bytes)), Default::default());
    let mut format = symphonia::default::get_probe()
        .probe(
            &hint,
            mss,
            FormatOptions::default(),
            MetadataOptions::default(),
        )
        .map_err(|e| unknown(format_hint, e.to_string()))?;
    let short_name = format.format_info().short_name;
    let track = format
        .default_track(TrackType::Audio)
        .ok_or_else(|| MediaError::InvalidAudio("no audio track".into()))?;
    let track_id = track.id;
    let params = track
        .codec_params
        .as_ref()
        .and_then(|p| p.audio())
        .ok_or_else(|| MediaError::InvalidAudio("the audio track has no codec parameters".into()))?
        .clone();
    let found = match params.codec {
        c if c == CODEC_ID_MP3 => Some(Expected::Mp3),
        c if c == CODEC_ID_FLAC => Some(Expected::Flac),
        _ if short_name.eq_ignore_ascii_case("wave") || short_name.eq_ignore_ascii_case("wav") => {
            Some(Expected::Wav)
        }
        _ => None,
    };
    if let Some(e) = expected
        && found != Some(e)
    {
        return Err(unknown(format_hint, format!("the data is `{short_name}`")));
    }
    if let (Some(frames), Some(rate)) = (track.num_frames, params.sample_rate)
        && rate > 0
        && frames as f64 / f64::from(rate) > limits.max_audio_duration_s
    {
        return Err(too_long(
            limits,
            format!(
                "the header declares {:.2} s",
                frames as f64 / f64::from(rate)
            ),
        ));
    }
    let mut decoder = symphonia::default::get_codecs()
        .make_audio_decoder(&params, &AudioDecoderOptions::default())
        .map_err(|e| MediaError::InvalidAudio(e.to_string()))?;
    let mut samples: Vec<f32> = Vec::new();
    let mut planes: Vec<Vec<f32>> = Vec::new();
    let mut rate = params.sample_rate.unwrap_or(0);
    loop {
        let packet = match format.next_packet() {
            Ok(Some(p)) => p,
            Ok(None) => break,
            // A truncated stream ends where its data ends (libsndfile reads what is there).
            Err(SymError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(MediaError::InvalidAudio(e.to_string())),
        };
        if packet.track_id != track_id {
            continue;
        }
        let buf = match decoder.decode(&packet) {
            Ok(b) => b,
            Err(SymError::DecodeError(e)) => {
                return Err(MediaError::InvalidAudio(format!("malformed stream: {e}")));
            }
            Err(SymError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(MediaError::InvalidAudio(e.to_string())),
        };
        rate = buf.spec().rate();
        buf.copy_to_vecs_planar::<f32>(&mut planes);
        let channels = planes.len().max(1);
        let frames = buf.frames();
        // librosa's to_mono: np.mean over channels in f32 (sum, then divide).
        samples.extend((0..frames).map(|i| {
            let sum: f32 = planes.iter().map(|p| p[i]).sum();
            sum / channels as f32
        }));
        if rate > 0 && samples.len() as f64 / f64::from(rate) > limits.max_audio_duration_s {
            return Err(too_long(
                limits,
                format!(
                    "decoding stopped after {:.2} s",
                    samples.len() as f64 / f64::from(rate)
                ),
            ));
        }
    }
    if samples.is_empty() || rate == 0 {
        return Err(MediaError::InvalidAudio("no audio samples decoded".into()));
    }
    Ok(Audio {
        sample_rate: rate,
        samples,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_accept_extensions_and_mime_types() {
        assert_eq!(parse_hint("MP3"), Some(Expected::Mp3));
        assert_eq!(parse_hint("audio/mpeg"), Some(Expected::Mp3));
        assert_eq!(parse_hint("audio/x-wav"), Some(Expected::Wav));
        assert_eq!(parse_hint("flac"), Some(Expected::Flac));
        assert_eq!(parse_hint("ogg"), None);
    }
}
