//! Tokenizers, chat templates and streaming detokenization.
//!
//! A [`Tokenizer`] comes from a Hugging Face checkpoint directory (`tokenizer.json`,
//! `tokenizer_config.json`) or from a GGUF file's `tokenizer.*` metadata (byte-level BPE
//! vocabularies; the `tokenizer.json` is generated and handed to the `tokenizers` crate). It
//! carries the special tokens and the chat template ([`ChatTemplate`], minijinja set up like
//! `transformers`). [`IncrementalDetokenizer`] turns generated ids into text deltas for
//! streaming, and [`StopStrings`] finds stop strings and how much text is safe to stream.
//!
//! Used by the API server (prompt rendering, streaming) and the engine (EOS ids); it links no
//! model or GPU code.
//!
//! ```no_run
//! use omni_tokenizer::Tokenizer;
//! # fn main() -> Result<(), omni_tokenizer::Error> {
//! let tok = Tokenizer::from_gguf_path("SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let messages = serde_json::json!([{"role": "user", "content": "What is the capital of France?"}]);
//! let prompt_ids = tok.encode_chat(&messages, true)?;
//! let mut detok = tok.incremental_detokenizer(&prompt_ids, true);
//! for id in [4649u32, 47] {
//!     print!("{}", detok.push(&tok, id)?);
//! }
//! # Ok(()) }
//! ```

pub mod chat;
pub mod detokenize;
pub mod gguf;
pub mod stop;
pub mod tokenizer;

use std::path::PathBuf;

pub use chat::ChatTemplate;
pub use detokenize::IncrementalDetokenizer;
pub use gguf::tokenizer_json_from_gguf;
pub use stop::{StopMatch, StopStrings};
pub use tokenizer::Tokenizer;

/// Errors loading or using a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A JSON file is malformed.
    #[error("parsing {path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: serde_json::Error,
    },
    /// The `tokenizers` crate rejected the tokenizer or an input.
    #[error("tokenizer: {reason}")]
    Tokenizer {
        /// Its message.
        reason: String,
    },
    /// The GGUF file could not be read.
    #[error(transparent)]
    Gguf(#[from] omni_gguf::Error),
    /// The GGUF's tokenizer kind is not supported.
    #[error("GGUF tokenizer not supported: {reason}")]
    UnsupportedGguf {
        /// What is unsupported.
        reason: String,
    },
    /// The chat template failed to compile or render (`raise_exception` lands here).
    #[error("chat template: {reason}")]
    Template {
        /// minijinja's message.
        reason: String,
    },
    /// The checkpoint has no chat template.
    #[error("the model has no chat template")]
    NoChatTemplate,
}
