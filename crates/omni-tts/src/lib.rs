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
//! `onnxruntime` wheel, opened at run time by the `ort` crate (2.0.0-rc.15, `load-dynamic`, API
//! level 22: any ONNX Runtime from 1.22 on). `ort`'s default build downloads a binary at build
//! time, which a machine that reaches only the package registries cannot do;
//! `scripts/fetch-voice.sh` puts the wheel's library next to the voice instead. It is the runtime
//! the reference package itself uses, and on one thread its outputs are the reference's bit for
//! bit, which is what lets the audio match. The int8 products are exact on every x86 CPU: ONNX
//! Runtime's own kernels where the CPU has VNNI, its u8 x u8 rewrite elsewhere
//! (`onnx::Int8Products`; without it a CPU lacking VNNI saturates them and the audio depends on
//! the machine), and the reference (`scripts/make-tts-golden.sh`) is made exact the same way.
//!
//! The pure-Rust alternative, `tract-onnx` 0.23.9, does not run this graph: typing it fails on the
//! duration expansion (the frame count is data-dependent: node `/Reshape_42` expects
//! `[?, 128, F]` and gets `[1, 128, 2*range]`), and with concrete input shapes its analysis fails
//! at `/emb/Gather`. Even where it ran, its int8 kernels (`DynamicQuantizeLinear`,
//! `MatMulInteger`, 77 of each here) would have to round exactly as ONNX Runtime's do to keep the
//! reference's outputs.
//!
//! # Measured against the reference package (`tests/`, `examples/voice_bench.rs`)
//!
//! | what | result |
//! |---|---|
//! | phoneme ids, 20 golden sentences + 72 G2P cases | all identical to hibari 0.2.1's |
//! | acoustic model outputs vs onnxruntime in Python | max abs diff 0 (bit-identical) |
//! | audio from text, 20 sentences, seed 0 | max abs diff 1.3e-7 (contract: 1e-4) |
//! | speed, one thread, 72.5 s of audio | 55x real time (G2P 2,200x, model 116x, DSP 108x) |
//! | the package, same machine, same minute | 64x real time (G2P 2,500x, model 115x, DSP 152x) |
//!
//! Speeds are from the shared 2-core development machine under a load of about 5, so read them
//! as ratios; the DSP's gap is numpy's SIMD `exp` / `sincos` against libm's scalar ones.

pub mod builtin;
pub mod dsp;
mod error;
pub mod g2p;
pub mod onnx;
mod onnx_shared;
pub mod rng;
pub mod split;
mod voice;

pub use dsp::{SAMPLE_RATE, Spectra};
pub use error::Error;
pub use rng::NumpyRng;
pub use split::{SentenceSplitter, SentenceStream};
pub use voice::{MODEL_FILE, SpeechStream, Voice};
