//! The audio of an omni stream chunk: standard base64 of a complete file per chunk (vLLM-Omni's
//! streaming), measured in PCM sample frames as vLLM-Omni's client does with Python's `wave`:
//! a WAV chunk's frames come from its own RIFF header (`fmt ` and `data`), a raw `pcm` chunk
//! is s16le mono at the server's 24 kHz.

/// Sample rate of a raw `pcm` chunk (vLLM-Omni's and ours for Qwen3-Omni).
pub const PCM_SAMPLE_RATE: u32 = 24_000;

/// An audio chunk that could not be measured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AudioChunkError {
    /// `delta.content` is not standard base64.
    #[error("audio chunk is not base64: byte {0:#04x}")]
    Base64(u8),
    /// Not a RIFF/WAVE file, or one without `fmt ` or `data`.
    #[error("audio chunk is not a WAV file: {0}")]
    Wav(&'static str),
    /// A format whose frames this client cannot count.
    #[error("audio format {0:?} is not measurable (use wav or pcm)")]
    Format(String),
}

/// How the server encodes each audio chunk (`audio.format` of the request body).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkFormat {
    /// A complete WAV file per chunk (the default).
    Wav,
    /// Raw s16le mono at [`PCM_SAMPLE_RATE`].
    Pcm,
}

impl ChunkFormat {
    /// The format a request body asks for (`audio.format`, default `wav`; `pcm16` is `pcm`).
    pub fn of_body(body: &serde_json::Value) -> Result<Self, AudioChunkError> {
        match body["audio"]["format"].as_str().unwrap_or("wav") {
            "wav" => Ok(Self::Wav),
            "pcm" | "pcm16" => Ok(Self::Pcm),
            other => Err(AudioChunkError::Format(other.to_string())),
        }
    }
}

/// PCM sample frames of one decoded chunk, and its sample rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkAudio {
    /// Sample frames (samples per channel).
    pub frames: u64,
    /// Frames per second.
    pub sample_rate: u32,
}

impl ChunkAudio {
    /// Seconds of audio.
    pub fn seconds(&self) -> f64 {
        if self.sample_rate == 0 {
            return 0.0;
        }
        self.frames as f64 / f64::from(self.sample_rate)
    }
}

/// Measures one chunk's `delta.content`.
pub fn measure_chunk(content: &str, format: ChunkFormat) -> Result<ChunkAudio, AudioChunkError> {
    let bytes = base64_decode(content)?;
    match format {
        ChunkFormat::Wav => wav_frames(&bytes),
        ChunkFormat::Pcm => Ok(ChunkAudio {
            frames: bytes.len() as u64 / 2,
            sample_rate: PCM_SAMPLE_RATE,
        }),
    }
}

/// Bytes to standard base64 (RFC 4648, padded).
pub fn base64_encode(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for k in 0..4 {
            if k <= c.len() {
                s.push(A[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

/// Standard base64 (RFC 4648, padding optional) to bytes.
pub fn base64_decode(s: &str) -> Result<Vec<u8>, AudioChunkError> {
    let val = |c: u8| -> Result<u32, AudioChunkError> {
        Ok(match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return Err(AudioChunkError::Base64(c)),
        })
    };
    let bytes: Vec<u8> = s.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for group in bytes.chunks(4) {
        if group.len() == 1 {
            return Err(AudioChunkError::Base64(group[0]));
        }
        let mut n = 0u32;
        for (i, &c) in group.iter().enumerate() {
            n |= val(c)? << (18 - 6 * i);
        }
        out.extend_from_slice(&n.to_be_bytes()[1..group.len()]);
    }
    Ok(out)
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes([*b.get(at)?, *b.get(at + 1)?]))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Sample frames and rate of a WAV file: `data` bytes / (channels x bytes per sample). A `data`
/// length past the end of the file (a streaming header) counts the bytes that are there.
pub fn wav_frames(file: &[u8]) -> Result<ChunkAudio, AudioChunkError> {
    if file.get(..4) != Some(b"RIFF") || file.get(8..12) != Some(b"WAVE") {
        return Err(AudioChunkError::Wav("no RIFF/WAVE header"));
    }
    let mut at = 12;
    let mut fmt: Option<(u16, u32, u16)> = None;
    while at + 8 <= file.len() {
        let id = &file[at..at + 4];
        let len = u32_at(file, at + 4).ok_or(AudioChunkError::Wav("truncated chunk"))? as usize;
        let body_start = at + 8;
        let body_end = body_start.saturating_add(len).min(file.len());
        if id == b"fmt " {
            let body = &file[body_start..body_end];
            let channels = u16_at(body, 2).ok_or(AudioChunkError::Wav("short fmt"))?;
            let rate = u32_at(body, 4).ok_or(AudioChunkError::Wav("short fmt"))?;
            let bits = u16_at(body, 14).ok_or(AudioChunkError::Wav("short fmt"))?;
            fmt = Some((channels, rate, bits));
        } else if id == b"data" {
            let (channels, rate, bits) = fmt.ok_or(AudioChunkError::Wav("data before fmt"))?;
            let frame_bytes = u64::from(channels) * u64::from(bits).div_ceil(8);
            if frame_bytes == 0 {
                return Err(AudioChunkError::Wav("zero channels or bits"));
            }
            return Ok(ChunkAudio {
                frames: (body_end - body_start) as u64 / frame_bytes,
                sample_rate: rate,
            });
        }
        at = body_start.saturating_add(len).saturating_add(len & 1);
    }
    Err(AudioChunkError::Wav("no data chunk"))
}

/// Base64 of a 16-bit mono WAV file of `n` silent samples at `rate` (with an odd-length
/// `LIST` chunk before `data`), for the tests of this crate.
#[cfg(test)]
pub(crate) fn test_wav_base64(n: usize, rate: u32) -> String {
    base64_encode(&tests::wav(n, rate))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A 16-bit mono WAV of `n` samples at `rate`, with an extra `LIST` chunk before `data`.
    pub(super) fn wav(n: usize, rate: u32) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(b"RIFF");
        f.extend_from_slice(&(4 + 24 + 12 + 8 + 2 * n as u32).to_le_bytes());
        f.extend_from_slice(b"WAVEfmt ");
        f.extend_from_slice(&16u32.to_le_bytes());
        f.extend_from_slice(&1u16.to_le_bytes()); // PCM
        f.extend_from_slice(&1u16.to_le_bytes()); // mono
        f.extend_from_slice(&rate.to_le_bytes());
        f.extend_from_slice(&(rate * 2).to_le_bytes());
        f.extend_from_slice(&2u16.to_le_bytes());
        f.extend_from_slice(&16u16.to_le_bytes());
        f.extend_from_slice(b"LIST");
        f.extend_from_slice(&3u32.to_le_bytes());
        f.extend_from_slice(b"abc\0"); // odd length, padded
        f.extend_from_slice(b"data");
        f.extend_from_slice(&(2 * n as u32).to_le_bytes());
        f.extend(std::iter::repeat_n(0u8, 2 * n));
        f
    }

    #[test]
    fn base64_decodes_rfc_4648_vectors() {
        for (want, enc) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64_decode(enc).unwrap(), want.as_bytes());
        }
        assert_eq!(base64_decode("//79").unwrap(), [0xff, 0xfe, 0xfd]);
        assert_eq!(base64_decode("Zm9v!"), Err(AudioChunkError::Base64(b'!')));
    }

    #[test]
    fn wav_chunks_count_sample_frames_from_their_own_header() {
        let a = measure_chunk(&base64_encode(&wav(20_565, 24_000)), ChunkFormat::Wav).unwrap();
        assert_eq!(a.frames, 20_565);
        assert_eq!(a.sample_rate, 24_000);
        assert!((a.seconds() - 20_565.0 / 24_000.0).abs() < 1e-12);
        // A streaming header whose data length runs past the end counts what is there.
        let mut open = wav(10, 16_000);
        let data = open.len() - 20 - 4;
        open[data..data + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(wav_frames(&open).unwrap().frames, 10);
        assert!(wav_frames(b"RIFF0000WAVE").is_err());
        assert!(wav_frames(b"not a wav file").is_err());
        let pcm = measure_chunk(&base64_encode(&[0u8; 96]), ChunkFormat::Pcm).unwrap();
        assert_eq!((pcm.frames, pcm.sample_rate), (48, PCM_SAMPLE_RATE));
    }

    #[test]
    fn the_body_picks_the_chunk_format() {
        let f = |v| ChunkFormat::of_body(&v);
        assert_eq!(f(serde_json::json!({})), Ok(ChunkFormat::Wav));
        assert_eq!(
            f(serde_json::json!({"audio": {"format": "pcm16"}})),
            Ok(ChunkFormat::Pcm)
        );
        assert!(f(serde_json::json!({"audio": {"format": "mp3"}})).is_err());
    }
}
