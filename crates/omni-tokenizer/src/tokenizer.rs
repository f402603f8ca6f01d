//! [`Tokenizer`]: a `tokenizers` tokenizer plus the special tokens and chat template that
//! come with a checkpoint, loaded from an HF directory or a GGUF file.

use std::path::Path;

use omni_gguf::GgufFile;
use serde::Serialize;
use serde_json::Value as Json;

use crate::Error;
use crate::chat::ChatTemplate;
use crate::detokenize::IncrementalDetokenizer;
use crate::gguf::tokenizer_json_from_gguf;

/// A checkpoint's tokenizer, special tokens and chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    eos_token_ids: Vec<u32>,
    chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

fn read(path: &Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn read_json(path: &Path) -> Result<Option<Json>, Error> {
    if !path.is_file() {
        return Ok(None);
    }
    let bytes = read(path)?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|source| Error::Json {
            path: path.to_path_buf(),
            source,
        })
}

/// A special token in `tokenizer_config.json`: a string or an `AddedToken` map.
fn token_content(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(m) => m.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `eos_token_id` in a config: an integer or a list of them.
fn token_ids(v: Option<&Json>) -> Vec<u32> {
    match v {
        Some(Json::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .into_iter()
            .collect(),
        Some(Json::Array(a)) => a
            .iter()
            .filter_map(|n| n.as_u64())
            .filter_map(|n| u32::try_from(n).ok())
            .collect(),
        _ => Vec::new(),
    }
}

/// `chat_template` in `tokenizer_config.json`: a string, or a list of `{name, template}`
/// from which `default` (else the first) is taken.
fn template_source(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Array(list) => {
            let named = |name: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some(name))
            };
            let chosen = named("default").or_else(|| list.first())?;
            chosen.get("template")?.as_str().map(str::to_owned)
        }
        _ => None,
    }
}

impl Tokenizer {
    /// Loads an HF checkpoint directory: `tokenizer.json` (required), and when present
    /// `tokenizer_config.json` (special tokens, `chat_template`), `chat_template.jinja`,
    /// `generation_config.json` and `config.json` (`eos_token_id`).
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self, Error> {
        let dir = dir.as_ref();
        let json = read(&dir.join("tokenizer.json"))?;
        let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Json::Null);
        let mut template = template_source(config.get("chat_template"));
        let jinja = dir.join("chat_template.jinja");
        if template.is_none() && jinja.is_file() {
            template = Some(String::from_utf8_lossy(&read(&jinja)?).into_owned());
        }
        let mut tok = Self::from_tokenizer_json(&json)?;
        tok.bos_token = token_content(config.get("bos_token"));
        tok.eos_token = token_content(config.get("eos_token"));
        tok.pad_token = token_content(config.get("pad_token"));
        let mut eos_ids: Vec<u32> = tok
            .eos_token
            .as_deref()
            .and_then(|t| tok.token_to_id(t))
            .into_iter()
            .collect();
        for file in ["generation_config.json", "config.json"] {
            if let Some(cfg) = read_json(&dir.join(file))? {
                eos_ids.extend(token_ids(cfg.get("eos_token_id")));
            }
        }
        eos_ids.dedup();
        let mut seen = std::collections::HashSet::new();
        eos_ids.retain(|id| seen.insert(*id));
        tok.eos_token_ids = eos_ids;
        if let Some(src) = template {
            tok.set_chat_template(src)?;
        }
        Ok(tok)
    }

    /// Builds the tokenizer described by a GGUF file's `tokenizer.*` metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, Error> {
        let json = tokenizer_json_from_gguf(file)?;
        let bytes = serde_json::to_vec(&json).map_err(|e| Error::Tokenizer {
            reason: e.to_string(),
        })?;
        let mut tok = Self::from_tokenizer_json(&bytes)?;
        let token_of = |key: &str| {
            let id = file.get(key)?.as_u64()?;
            tok.inner.id_to_token(u32::try_from(id).ok()?)
        };
        tok.bos_token = token_of("tokenizer.ggml.bos_token_id");
        tok.eos_token = token_of("tokenizer.ggml.eos_token_id");
        tok.pad_token = token_of("tokenizer.ggml.padding_token_id");
        tok.eos_token_ids = tok
            .eos_token
            .as_deref()
            .and_then(|t| tok.token_to_id(t))
            .into_iter()
            .collect();
        if let Some(eot) = token_of("tokenizer.ggml.eot_token_id").and_then(|t| tok.token_to_id(&t))
            && !tok.eos_token_ids.contains(&eot)
        {
            tok.eos_token_ids.push(eot);
        }
        if let Some(src) = file.get("tokenizer.chat_template").and_then(|v| v.as_str()) {
            tok.set_chat_template(src.to_owned())?;
        }
        Ok(tok)
    }

    /// Opens a GGUF file and builds its tokenizer.
    pub fn from_gguf_path(path: impl AsRef<Path>) -> Result<Self, Error> {
        Self::from_gguf(&GgufFile::open(path)?)
    }

    /// A bare tokenizer from `tokenizer.json` bytes (no special tokens or template known).
    pub fn from_tokenizer_json(json: &[u8]) -> Result<Self, Error> {
        let inner = tokenizers::Tokenizer::from_bytes(json).map_err(|e| Error::Tokenizer {
            reason: e.to_string(),
        })?;
        Ok(Self {
            inner,
            bos_token: None,
            eos_token: None,
            pad_token: None,
            eos_token_ids: Vec::new(),
            chat_template: None,
        })
    }

    /// Replaces the chat template.
    pub fn set_chat_template(&mut self, source: String) -> Result<(), Error> {
        let bos = self.bos_token.clone().unwrap_or_default();
        let eos = self.eos_token.clone().unwrap_or_default();
        self.chat_template = Some(ChatTemplate::new(source, bos, eos)?);
        Ok(())
    }

    /// Encodes `text`. With `add_special_tokens` the post-processor adds BOS etc. where the
    /// tokenizer asks for it; a rendered chat template already holds its special tokens, so
    /// encode it with `false`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, Error> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Tokenizer {
                reason: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes `ids` to text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, Error> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Tokenizer {
                reason: e.to_string(),
            })
    }

    /// Renders the chat template and returns the prompt text.
    pub fn apply_chat_template<M: Serialize + ?Sized>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
    ) -> Result<String, Error> {
        self.chat_template
            .as_ref()
            .ok_or(Error::NoChatTemplate)?
            .render(messages, add_generation_prompt)
    }

    /// Renders the chat template and encodes the prompt (without adding special tokens again).
    pub fn encode_chat<M: Serialize + ?Sized>(
        &self,
        messages: &M,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, Error> {
        self.encode(
            &self.apply_chat_template(messages, add_generation_prompt)?,
            false,
        )
    }

    /// A streaming detokenizer for a sequence with this prompt.
    pub fn incremental_detokenizer(
        &self,
        prompt_ids: &[u32],
        skip_special_tokens: bool,
    ) -> IncrementalDetokenizer {
        IncrementalDetokenizer::new(prompt_ids, skip_special_tokens)
    }

    /// The chat template, if the checkpoint has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// The id of a token string (added tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Vocabulary size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The BOS token string.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The BOS token id.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token.as_deref().and_then(|t| self.token_to_id(t))
    }

    /// The EOS token string.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The pad token string.
    pub fn pad_token(&self) -> Option<&str> {
        self.pad_token.as_deref()
    }

    /// Every id that ends generation (EOS, plus `generation_config.json`'s list or GGUF's EOT).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Whether `id` is a special added token (skipped by `decode(.., true)`).
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|t| t.special)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
