//! Text to speech for the omni pipeline: the hibari voice (PyPI `hibari-tts` 0.2.1, Apache-2.0,
//! distilled from Kokoro-82M's `af_heart`) as a library, with no Python at run time.
//!
//! What it owns, in the order text goes through it:
//!
//! - [`split`]: sentences (and a streaming splitter for text that arrives in pieces);
//! - [`g2p`]: English text to phonemes (normalisation, spaCy-style tokenizer, perceptron tagger,
//!   misaki's lexicon rules, an ONNX net for out-of-vocabulary words), then phoneme ids;
//! - the acoustic model (`hibari.onnx`, int8, opset 17) through ONNX Runtime ([`onnx`]);
//! - [`dsp`]: the spectral parameters to 24 kHz float audio (pulse train, noise, iSTFT), with
//!   numpy-compatible noise ([`rng`]) so a seed reproduces the reference package's samples.
//!
//! It sits beside the model crates: nothing in it is GPU code, and the pipeline's speech stage
//! will drive it with the text stage's detokenized output.
//!
//! ```no_run
//! let voice = omni_tts::Voice::load("/root/.cache/omni-engine/voices/hibari-0.2.1")?;
//! let ids = voice.phonemize("Hello there.")?;          // [[0, 50, 83, 54, 156, 31, 16, ...]]
//! let audio = voice.synthesize("Hello there.", 1.0)?;  // 24 kHz mono f32
//! let mut stream = voice.stream(1.0, None);
//! for piece in ["Hi the", "re. How are", " you?"] {
//!     for chunk in stream.push(piece)? { /* play `chunk` */ let _ = chunk; }
//! }
//! for chunk in stream.finish()? { let _ = chunk; }
//! # Ok::<(), omni_tts::Error>(())
//! ```
//!
//! # The runtime: ONNX Runtime through `ort` with `load-dynamic`
//!
//! The acoustic model and the OOV net run on ONNX Runtime 1.31.1, the shared library of PyPI's
//! `onnxruntime` wheel, opened at run time by the `ort` crate (`load-dynamic`, no build-time
//! download; `scripts/fetch-voice.sh` fetches it next to the voice). That is the runtime the
//! reference package itself uses, so the model's outputs are the reference's bit for bit on one
//! thread, which is what lets the audio match to 1e-4. A pure-Rust runtime (`tract-onnx`) was
//! the alternative; it was not measured: matching would need its int8 `MatMulInteger` /
//! `DynamicQuantizeLinear` kernels to round exactly like ONNX Runtime's, and the duration
//! expansion ops to be supported, and the reference numbers below leave little to gain.
//! The measurements live in `tests/` (see `scripts/test.sh` for how the voice is fetched).

pub mod dsp;
mod error;
pub mod g2p;
pub mod onnx;
pub mod rng;
pub mod split;
mod voice;

pub use dsp::{SAMPLE_RATE, Spectra};
pub use error::Error;
pub use rng::NumpyRng;
pub use split::{SentenceSplitter, SentenceStream};
pub use voice::{MODEL_FILE, SpeechStream, Voice};
