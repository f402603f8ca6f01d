//! Audio in responses: a mono float waveform encoded as the file a chat request's
//! `audio.format` asks for (vLLM-Omni's formats `wav`, `pcm`, `flac`; `pcm16` is `pcm`).
//!
//! - `wav`: RIFF, PCM 16-bit little-endian, one channel (what libsndfile writes as `PCM_16`);
//! - `pcm`: the raw 16-bit little-endian samples, no header;
//! - `flac`: FLAC with 16-bit samples in verbatim subframes (lossless, uncompressed; every
//!   FLAC decoder reads it), 4096-sample blocks, the frame CRCs of the format.
//!
//! Samples are clamped to [-1, 1] and scaled by 32767, rounded to nearest. A streamed response
//! encodes each chunk as a complete file of its own, as vLLM-Omni does. libsndfile (Python's
//! `soundfile`) reads our FLAC and WAV of the same samples to identical 16-bit samples (checked
//! 2026-12-01 for 5, 4096 and 10,000 samples); a FLAC of no samples says "length unknown", as the
//! format writes a total of 0.

/// An output audio format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AudioFormat {
    /// RIFF WAVE, PCM 16-bit.
    Wav,
    /// Raw PCM 16-bit little-endian.
    Pcm,
    /// FLAC, 16-bit.
    Flac,
}

/// The formats `audio.format` accepts, as they are spelled in errors.
pub const SUPPORTED_AUDIO_FORMATS: &[&str] = &["wav", "pcm", "flac"];

impl AudioFormat {
    /// `audio.format` (case-insensitive; `pcm16` is `pcm`), or the message of the 400 (vLLM-Omni's
    /// wording for an unknown format; `mp3` and `opus`, which vLLM-Omni encodes, say they are not
    /// supported here).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "wav" => Ok(Self::Wav),
            "pcm" | "pcm16" => Ok(Self::Pcm),
            "flac" => Ok(Self::Flac),
            // vLLM-Omni's other formats (libsndfile encodes them there); no encoder here.
            "mp3" | "opus" => Err(format!(
                "Audio format '{s}' is not supported by this server. Supported formats: \
                 {SUPPORTED_AUDIO_FORMATS:?}"
            )),
            _ => Err(format!(
                "Invalid audio format '{s}'. Supported formats: {SUPPORTED_AUDIO_FORMATS:?}"
            )),
        }
    }

    /// The MIME type of an encoded file.
    pub fn mime(self) -> &'static str {
        match self {
            Self::Wav => "audio/wav",
            Self::Pcm => "audio/pcm",
            Self::Flac => "audio/flac",
        }
    }
}

/// `samples` (mono, nominally in [-1, 1]) at `sample_rate` Hz as a file of `format`.
pub fn encode(samples: &[f32], sample_rate: u32, format: AudioFormat) -> Vec<u8> {
    let pcm: Vec<i16> = samples.iter().map(|&x| to_i16(x)).collect();
    match format {
        AudioFormat::Pcm => pcm.iter().flat_map(|s| s.to_le_bytes()).collect(),
        AudioFormat::Wav => wav(&pcm, sample_rate),
        AudioFormat::Flac => flac(&pcm, sample_rate),
    }
}

fn to_i16(x: f32) -> i16 {
    // NaN becomes silence; the cast saturates, the clamp keeps the scale symmetric.
    let x = if x.is_nan() { 0.0 } else { x.clamp(-1.0, 1.0) };
    (x * 32767.0).round() as i16
}

fn wav(pcm: &[i16], rate: u32) -> Vec<u8> {
    let data = (pcm.len() * 2) as u32;
    let mut out = Vec::with_capacity(44 + data as usize);
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + data).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    out.extend_from_slice(&16u32.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes()); // PCM
    out.extend_from_slice(&1u16.to_le_bytes()); // mono
    out.extend_from_slice(&rate.to_le_bytes());
    out.extend_from_slice(&(rate * 2).to_le_bytes()); // bytes per second
    out.extend_from_slice(&2u16.to_le_bytes()); // block align
    out.extend_from_slice(&16u16.to_le_bytes()); // bits per sample
    out.extend_from_slice(b"data");
    out.extend_from_slice(&data.to_le_bytes());
    out.extend(pcm.iter().flat_map(|s| s.to_le_bytes()));
    out
}

/// Samples per FLAC frame (block size code 12 in the frame header).
const FLAC_BLOCK: usize = 4096;

/// MSB-first bit writer.
#[derive(Default)]
struct Bits {
    bytes: Vec<u8>,
    acc: u64,
    n: u32,
}

impl Bits {
    fn put(&mut self, value: u64, bits: u32) {
        for i in (0..bits).rev() {
            self.acc = (self.acc << 1) | ((value >> i) & 1);
            self.n += 1;
            if self.n == 8 {
                self.bytes.push(self.acc as u8);
                self.acc = 0;
                self.n = 0;
            }
        }
    }

    fn align(&mut self) {
        if self.n > 0 {
            self.put(0, 8 - self.n);
        }
    }
}

fn crc8(data: &[u8]) -> u8 {
    // x^8 + x^2 + x + 1, initial 0.
    let mut c = 0u8;
    for &b in data {
        c ^= b;
        for _ in 0..8 {
            c = if c & 0x80 != 0 {
                (c << 1) ^ 0x07
            } else {
                c << 1
            };
        }
    }
    c
}

fn crc16(data: &[u8]) -> u16 {
    // x^16 + x^15 + x^2 + 1, initial 0.
    let mut c = 0u16;
    for &b in data {
        c ^= u16::from(b) << 8;
        for _ in 0..8 {
            c = if c & 0x8000 != 0 {
                (c << 1) ^ 0x8005
            } else {
                c << 1
            };
        }
    }
    c
}

/// FLAC's UTF-8-like coding of a frame number.
fn utf8_number(v: u64, out: &mut Bits) {
    if v < 0x80 {
        out.put(v, 8);
        return;
    }
    let mut tail = Vec::new();
    let mut rest = v;
    let mut first_bits = 6u32;
    while rest >= (1 << first_bits) {
        tail.push(0x80 | (rest & 0x3f));
        rest >>= 6;
        first_bits -= 1;
    }
    let n = tail.len() as u32 + 1;
    let lead = (0xffu64 << (8 - n)) & 0xff;
    out.put(lead | rest, 8);
    for t in tail.iter().rev() {
        out.put(*t, 8);
    }
}

/// FLAC's sample-rate code (7 = 24 kHz, Qwen3-Omni's), or 0: "read it from STREAMINFO".
fn rate_code(rate: u32) -> u64 {
    match rate {
        8000 => 4,
        16000 => 5,
        22050 => 6,
        24000 => 7,
        32000 => 8,
        44100 => 9,
        48000 => 10,
        96000 => 11,
        _ => 0,
    }
}

fn flac(pcm: &[i16], rate: u32) -> Vec<u8> {
    let mut out = b"fLaC".to_vec();
    // Fixed-size blocks: STREAMINFO's sizes exclude the (shorter) last block, and are >= 16.
    let block = pcm.len().clamp(16, FLAC_BLOCK) as u64;
    let (min_block, max_block) = (block, block);
    let mut info = Bits::default();
    info.put(1, 1); // last metadata block
    info.put(0, 7); // STREAMINFO
    info.put(34, 24);
    info.put(min_block, 16);
    info.put(max_block, 16);
    info.put(0, 24); // min frame size unknown
    info.put(0, 24); // max frame size unknown
    info.put(u64::from(rate), 20);
    info.put(0, 3); // one channel
    info.put(15, 5); // 16 bits per sample
    info.put(pcm.len() as u64, 36);
    info.put(0, 64); // MD5 unknown (allowed by the format)
    info.put(0, 64);
    out.extend(info.bytes);
    for (number, block) in pcm.chunks(FLAC_BLOCK).enumerate() {
        let mut f = Bits::default();
        f.put(0b11_1111_1111_1110, 14); // sync
        f.put(0, 1);
        f.put(0, 1); // fixed block size
        let size_code = if block.len() == FLAC_BLOCK { 12 } else { 7 };
        f.put(size_code, 4);
        let rc = rate_code(rate);
        f.put(rc, 4);
        f.put(0, 4); // mono
        f.put(0b100, 3); // 16 bits
        f.put(0, 1);
        utf8_number(number as u64, &mut f);
        if size_code == 7 {
            f.put(block.len() as u64 - 1, 16);
        }
        let header_crc = crc8(&f.bytes);
        f.put(u64::from(header_crc), 8);
        f.put(0, 1); // subframe padding bit
        f.put(1, 6); // VERBATIM
        f.put(0, 1); // no wasted bits
        for &s in block {
            f.put(u64::from(s as u16), 16);
        }
        f.align();
        let footer = crc16(&f.bytes);
        out.extend(f.bytes);
        out.extend(footer.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_as_vllm_omni_spells_them() {
        assert_eq!(AudioFormat::parse("WAV"), Ok(AudioFormat::Wav));
        assert_eq!(AudioFormat::parse("pcm16"), Ok(AudioFormat::Pcm));
        let e = AudioFormat::parse("ogg").unwrap_err();
        assert!(
            e.contains("Invalid audio format 'ogg'") && e.contains("flac"),
            "{e}"
        );
        let e = AudioFormat::parse("mp3").unwrap_err();
        assert!(e.contains("'mp3' is not supported by this server"), "{e}");
    }

    #[test]
    fn wav_header_and_samples() {
        let w = encode(&[0.0, 1.0, -1.0, 2.0, 0.5], 24_000, AudioFormat::Wav);
        assert_eq!(&w[..4], b"RIFF");
        assert_eq!(u32::from_le_bytes(w[4..8].try_into().unwrap()), 36 + 10);
        assert_eq!(&w[8..16], b"WAVEfmt ");
        assert_eq!(u32::from_le_bytes(w[24..28].try_into().unwrap()), 24_000);
        assert_eq!(&w[36..40], b"data");
        let s: Vec<i16> = w[44..]
            .chunks_exact(2)
            .map(|b| i16::from_le_bytes([b[0], b[1]]))
            .collect();
        assert_eq!(s, [0, 32767, -32767, 32767, 16384]);
        assert_eq!(
            encode(&[0.5], 24_000, AudioFormat::Pcm),
            16384i16.to_le_bytes()
        );
    }

    #[test]
    fn crcs_match_the_formats_check_values() {
        // The standard check inputs: CRC-8/SMBUS and CRC-16/UMTS of "123456789".
        assert_eq!(crc8(b"123456789"), 0xf4);
        assert_eq!(crc16(b"123456789"), 0xfee8);
    }

    #[test]
    fn flac_frames_hold_every_sample_verbatim_with_valid_crcs() {
        let samples: Vec<f32> = (0..10_000)
            .map(|i| ((i as f32) * 0.01).sin() * 0.8)
            .collect();
        let f = encode(&samples, 24_000, AudioFormat::Flac);
        assert_eq!(&f[..4], b"fLaC");
        // STREAMINFO: 24 kHz, 1 channel, 16 bits, 10000 samples.
        let info = &f[8..42];
        let packed = u64::from_be_bytes(info[10..18].try_into().unwrap());
        assert_eq!(packed >> 44, 24_000);
        assert_eq!((packed >> 41) & 7, 0);
        assert_eq!((packed >> 36) & 31, 15);
        assert_eq!(packed & ((1 << 36) - 1), 10_000);
        // Frames: 4096 + 4096 + 1808 samples; each ends with the CRC-16 of what precedes it.
        let mut pos = 42;
        let mut decoded = Vec::new();
        for (n, len) in [4096usize, 4096, 1808].into_iter().enumerate() {
            assert_eq!(f[pos], 0xff);
            assert_eq!(f[pos + 1], 0xf8);
            let header = if len == 4096 { 5 } else { 7 };
            assert_eq!(f[pos + 4], n as u8, "frame number");
            assert_eq!(crc8(&f[pos..pos + header]), f[pos + header]);
            let sub = pos + header + 1;
            assert_eq!(f[sub], 0b0000_0010, "verbatim subframe");
            let end = sub + 1 + 2 * len;
            decoded.extend(
                f[sub + 1..end]
                    .chunks_exact(2)
                    .map(|b| i16::from_be_bytes([b[0], b[1]])),
            );
            let crc = u16::from_be_bytes([f[end], f[end + 1]]);
            assert_eq!(crc16(&f[pos..end]), crc);
            pos = end + 2;
        }
        assert_eq!(pos, f.len());
        let want: Vec<i16> = samples.iter().map(|&x| to_i16(x)).collect();
        assert_eq!(decoded, want);
        let mut b = Bits::default();
        utf8_number(0x123, &mut b);
        assert_eq!(b.bytes, [0xc4, 0xa3]);
    }
}
