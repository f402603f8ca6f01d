//! Multimodal inputs of chat requests: content parts in, decoded and preprocessed items out.
//!
//! The path of one request, all before tokenization:
//! 1. [`parts`]: the messages become text and media segments, in order, each media part with
//!    its JSON path (`messages[0].content[1].image_url`) for errors;
//! 2. [`limits`]: every part is checked against the model's towers (a text-only model refuses
//!    image and audio parts, naming the modality; video is not taken yet) and each modality's
//!    count against `--limit-mm-per-prompt`, before anything is fetched;
//! 3. [`fetch`]: the bytes, from a base64 `data:` URL, `input_audio`, an allowed http(s) host
//!    under the egress guard, or `file://` under `--allowed-local-media-path`;
//! 4. [`cache`]: an item whose fetched bytes were preprocessed before is taken from the
//!    processor cache (`--mm-processor-cache-gb`), else
//!    [`preprocess`]: on a blocking thread, omni-mm decodes (image header checked against
//!    `--max-image-pixels` before decoding, audio duration capped while decoding) and
//!    preprocesses (Qwen2-VL pixel patches, Whisper log-mel) into an [`MmInput`];
//! 5. [`prompt`]: the chat template gets the placeholders (it writes them itself when it walks
//!    content parts, else they are put before the message's text, as vLLM does), and each
//!    placeholder's pad token is expanded to the item's token count.
//!
//! Every refusal is an OpenAI-shaped 400 (422 where vLLM answers 422) naming the part.

mod cache;
pub(crate) mod data_url;
mod fetch;
mod guard;
mod limits;
pub(crate) mod parts;
mod preprocess;
pub(crate) mod prompt;

use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};

use crate::AppState;
use crate::error::ApiError;
use crate::openai::ChatMessage;
use parts::ParsedChat;

pub(crate) use cache::ProcessorCache;
pub use preprocess::MultimodalModel;

/// Media parts fetched and preprocessed at once for one request.
const MEDIA_CONCURRENCY: usize = 4;

pub use omni_mm::Modality;

/// vLLM's name of a modality (`image`, `audio`, `video`), as in `--limit-mm-per-prompt`.
pub(crate) trait ModalityName {
    /// The name.
    fn name(self) -> &'static str;
}

impl ModalityName for Modality {
    fn name(self) -> &'static str {
        match self {
            Modality::Image => "image",
            Modality::Audio => "audio",
            Modality::Video => "video",
        }
    }
}

/// One multimodal item of a prompt, decoded and preprocessed: what the model's encoder takes
/// for it, and where its placeholder tokens sit in the prompt.
///
/// The request path carries these on [`crate::prepare::PreparedPrompt::mm_inputs`], in prompt
/// order, and sends them as the engine request's `mm_features` (placeholder range, content
/// hash, kind) with the tensors as its out-of-band buffers: the hash keeps the prefix cache from
/// sharing blocks between different media behind equal pad tokens, the bytes reach the
/// Thinker's vision and audio encoders in every worker.
#[derive(Clone, PartialEq)]
pub struct MmInput {
    /// Image or audio.
    pub modality: Modality,
    /// The processed tensor as bf16, little-endian, row-major: an image's pixel patches
    /// `[grid_t * grid_h * grid_w, 3 * temporal_patch * patch^2]`, or an audio clip's log-mel
    /// `[num_mel_bins, num_frames]`. Shared (reference-counted) with the engine requests.
    pub data: bytes::Bytes,
    /// The tensor's shape (see `data`).
    pub shape: [usize; 2],
    /// An image's patch grid `(t, h, w)`.
    pub grid_thw: Option<[u32; 3]>,
    /// An audio clip's mel frames.
    pub num_frames: Option<u32>,
    /// Placeholder (pad) tokens the item takes in the prompt.
    pub num_tokens: u32,
    /// omni-mm's BLAKE3 of the modality, the shape and the bf16 tensor: equal for equal inputs
    /// to the encoder, whatever file or URL they came from.
    pub content_hash: omni_mm::ContentHash,
    /// Index of the item's first pad token in the prompt (set when the prompt is built).
    pub offset: u32,
    /// The client's `uuid` of the item, when it gave one.
    pub uuid: Option<String>,
}

impl std::fmt::Debug for MmInput {
    /// Everything but the tensor's bytes (their count instead).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmInput")
            .field("modality", &self.modality)
            .field("data_bytes", &self.data.len())
            .field("shape", &self.shape)
            .field("grid_thw", &self.grid_thw)
            .field("num_frames", &self.num_frames)
            .field("num_tokens", &self.num_tokens)
            .field("mm_hash", &self.mm_hash())
            .field("offset", &self.offset)
            .field("uuid", &self.uuid)
            .finish()
    }
}

impl MmInput {
    /// The content hash folded to the engine protocol's `mm_hash` (its first 8 bytes).
    pub fn mm_hash(&self) -> u64 {
        self.content_hash.as_u64()
    }
}

/// A chat request's messages, parsed, and its media items, preprocessed, in order
/// (`chat.media[i]` became `inputs[i]`).
#[derive(Debug, Clone, Default)]
pub(crate) struct ChatMedia {
    /// The messages and their parts.
    pub chat: ParsedChat,
    /// One item per media part.
    pub inputs: Vec<MmInput>,
}

/// Parses `messages`, checks the media parts against the model and the limits, then fetches
/// and preprocesses every media part (a few at a time, in order). A request without media
/// parts returns at once.
pub(crate) async fn load(
    state: &Arc<AppState>,
    messages: Vec<ChatMessage>,
) -> Result<ChatMedia, ApiError> {
    let chat = parts::parse_messages(messages)?;
    if chat.media.is_empty() {
        return Ok(ChatMedia {
            chat,
            inputs: Vec::new(),
        });
    }
    let model = state.config.multimodal.clone();
    limits::check(&chat.media, model.as_deref(), &state.config.media)?;
    let Some(model) = model else {
        return Err(ApiError::internal(
            "media parts passed the checks of a text-only model",
        ));
    };
    let mut items = futures::stream::iter(chat.media.iter().cloned())
        .map(|part| {
            let state = state.clone();
            let model = model.clone();
            async move {
                let media = &state.config.media;
                let fetched = fetch::fetch(&part.source, part.modality, media)
                    .await
                    .map_err(|e| e.into_api(&part.path))?;
                let key = state.mm_cache.as_ref().map(|_| {
                    omni_mm::source_hash(
                        part.modality,
                        fetched.media_type.as_deref(),
                        &fetched.bytes,
                    )
                });
                if let (Some(cache), Some(key)) = (&state.mm_cache, &key) {
                    let hit = cache.get(key);
                    state.metrics.mm_cache_query(hit.is_some());
                    if let Some(mut item) = hit {
                        item.uuid = part.uuid.clone();
                        return Ok::<MmInput, ApiError>(item);
                    }
                }
                let limits = preprocess::decode_limits(media);
                let path = part.path.clone();
                let item = tokio::task::spawn_blocking(move || {
                    preprocess::process(&model, &part, fetched, &limits)
                        .map_err(|e| ApiError::bad_param(&part.path, e))
                })
                .await
                .map_err(|e| ApiError::internal(format!("media task for {path} failed: {e}")))??;
                if let (Some(cache), Some(key)) = (&state.mm_cache, key) {
                    cache.insert(key, &item);
                }
                Ok(item)
            }
        })
        .buffered(MEDIA_CONCURRENCY);
    // The items' tokens alone must fit the context: stop at the first item past it, so a
    // prompt of many large images never holds more than a context's worth of tensors.
    let mut inputs: Vec<MmInput> = Vec::with_capacity(chat.media.len());
    let mut tokens = 0u64;
    while let Some(item) = items.try_next().await? {
        tokens += u64::from(item.num_tokens);
        if tokens >= u64::from(state.config.max_model_len) {
            return Err(ApiError::bad_param(
                "messages",
                format!(
                    "This model's maximum context length is {} tokens; the media of this \
                     prompt take at least {tokens} tokens (at {}).",
                    state.config.max_model_len,
                    chat.media[inputs.len()].path
                ),
            ));
        }
        inputs.push(item);
    }
    drop(items);
    Ok(ChatMedia { chat, inputs })
}
