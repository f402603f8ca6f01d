//! Chat messages into typed content: each message's text and media parts in order, every media
//! part with the JSON path of its field (`messages[0].content[1].image_url`) for errors. No
//! fetching and no decoding happen here.

use serde_json::Value;

use super::Modality;
use crate::error::ApiError;
use crate::openai::{ChatMessage, ContentPart, MessageContent};

/// Where a media part's bytes come from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum MediaSource {
    /// A `data:`, `http(s)://` or `file://` URL.
    Url(String),
    /// OpenAI's `input_audio`: base64 of a file of this format (`wav`, `mp3`, `flac`).
    InputAudio {
        /// The container, lowercase.
        format: String,
        /// Base64 of the file.
        data: String,
    },
}

/// One media part of a message.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MediaPart {
    /// Image, audio or video.
    pub modality: Modality,
    /// Its bytes' source.
    pub source: MediaSource,
    /// vLLM's `uuid` of the item, when the client gave one.
    pub uuid: Option<String>,
    /// The part's JSON path (`messages[0].content[1]`).
    pub part_path: String,
    /// The JSON path of the field holding the media (`messages[0].content[1].image_url`).
    pub path: String,
}

/// One piece of a message's content, in order.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Segment {
    /// A text part.
    Text(String),
    /// A media part: its index among the request's media parts (in message order).
    Media(usize),
}

/// A message's `content`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Content {
    /// `null` (an assistant message with tool calls).
    Null,
    /// A plain string.
    Text(String),
    /// A list of parts.
    Parts(Vec<Segment>),
}

/// A message as the chat template will see it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ParsedMessage {
    /// `system`, `user`, ...
    pub role: String,
    /// The optional participant name.
    pub name: Option<String>,
    /// The content.
    pub content: Content,
}

/// The messages of a chat request and their media parts, in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct ParsedChat {
    /// The messages.
    pub messages: Vec<ParsedMessage>,
    /// Every media part, in message and part order ([`Segment::Media`] indexes this).
    pub media: Vec<MediaPart>,
}

/// Text part types (vLLM's text-like parts that carry `text`).
const TEXT_TYPES: [&str; 3] = ["text", "input_text", "output_text"];
/// Embedding parts: vLLM takes `torch.save` tensors here behind `--enable-mm-embeds`; this
/// server never deserialises client tensors.
const EMBED_TYPES: [&str; 4] = [
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
];

/// Parses every message's content. Errors name the part (`messages[i].content[j]`) or its field.
pub(crate) fn parse_messages(messages: Vec<ChatMessage>) -> Result<ParsedChat, ApiError> {
    let mut out = ParsedChat::default();
    for (i, m) in messages.into_iter().enumerate() {
        let content = match m.content {
            None => Content::Null,
            Some(MessageContent::Text(t)) => Content::Text(t),
            Some(MessageContent::Parts(parts)) => {
                let mut segments = Vec::with_capacity(parts.len());
                for (j, p) in parts.into_iter().enumerate() {
                    match parse_part(i, j, p)? {
                        Parsed::Text(t) => segments.push(Segment::Text(t)),
                        Parsed::Media(mp) => {
                            segments.push(Segment::Media(out.media.len()));
                            out.media.push(mp);
                        }
                    }
                }
                Content::Parts(segments)
            }
        };
        out.messages.push(ParsedMessage {
            role: m.role,
            name: m.name,
            content,
        });
    }
    Ok(out)
}

enum Parsed {
    Text(String),
    Media(MediaPart),
}

fn parse_part(i: usize, j: usize, p: ContentPart) -> Result<Parsed, ApiError> {
    let part_path = format!("messages[{i}].content[{j}]");
    let kind = p.kind.as_str();
    if TEXT_TYPES.contains(&kind) {
        return match p.text {
            Some(t) => Ok(Parsed::Text(t)),
            // The message, as before content parts took media.
            None => Err(ApiError::bad_param(
                format!("messages[{i}].content"),
                "a text content part needs a `text` string",
            )),
        };
    }
    if EMBED_TYPES.contains(&kind) {
        return Err(ApiError::bad_param(
            part_path,
            format!(
                "content part type `{kind}` is not accepted: this server does not load \
                 client-supplied tensors; send the media itself"
            ),
        ));
    }
    let uuid = match p.uuid {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(_) => {
            return Err(ApiError::bad_param(
                format!("{part_path}.uuid"),
                "`uuid` must be a string",
            ));
        }
    };
    let (modality, field, value) = match kind {
        "image_url" => (Modality::Image, "image_url", p.image_url),
        "audio_url" => (Modality::Audio, "audio_url", p.audio_url),
        "video_url" => (Modality::Video, "video_url", p.video_url),
        "input_audio" => (Modality::Audio, "input_audio", p.input_audio),
        other => {
            return Err(ApiError::bad_param(
                format!("messages[{i}].content"),
                format!("content part type `{other}` is not supported"),
            ));
        }
    };
    let path = format!("{part_path}.{field}");
    let value = match value {
        None | Some(Value::Null) if uuid.is_some() => {
            // vLLM reuses a cached item for a uuid without media.
            return Err(ApiError::bad_param(
                path,
                format!(
                    "`{field}` is missing: this server keeps no media cache, so a `uuid` \
                     cannot stand for the media"
                ),
            ));
        }
        None | Some(Value::Null) => {
            return Err(ApiError::bad_param(
                path,
                format!("a `{kind}` content part needs a `{field}` object"),
            ));
        }
        Some(v) => v,
    };
    let source = if kind == "input_audio" {
        input_audio(&path, value)?
    } else {
        MediaSource::Url(url_of(&path, kind, &value)?)
    };
    Ok(Parsed::Media(MediaPart {
        modality,
        source,
        uuid,
        part_path,
        path,
    }))
}

/// `{"url": "...", "detail": "auto"}`: the URL; a `detail` other than `auto` is ignored with a
/// warning, as vLLM does.
fn url_of(path: &str, kind: &str, value: &Value) -> Result<String, ApiError> {
    let url = value
        .get("url")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_param(path, format!("`{kind}` needs a `url` string")))?;
    if let Some(detail) = value.get("detail").and_then(Value::as_str)
        && detail != "auto"
    {
        tracing::warn!(
            param = path,
            detail,
            "`detail` other than \"auto\" is not supported; ignored"
        );
    }
    Ok(url.to_string())
}

/// Formats `input_audio` may name (OpenAI's two, and FLAC).
const INPUT_AUDIO_FORMATS: [&str; 3] = ["wav", "mp3", "flac"];

fn input_audio(path: &str, value: Value) -> Result<MediaSource, ApiError> {
    let Value::Object(mut obj) = value else {
        return Err(ApiError::bad_param(
            path,
            "`input_audio` must be an object with `data` and `format`",
        ));
    };
    let data = match obj.remove("data") {
        Some(Value::String(d)) => d,
        _ => {
            return Err(ApiError::bad_param(
                format!("{path}.data"),
                "`input_audio.data` must be a base64 string",
            ));
        }
    };
    let format = obj
        .get("format")
        .and_then(Value::as_str)
        .map(str::to_ascii_lowercase)
        .unwrap_or_default();
    if !INPUT_AUDIO_FORMATS.contains(&format.as_str()) {
        return Err(ApiError::bad_param(
            format!("{path}.format"),
            format!(
                "`input_audio.format` must be one of {}, got {:?}",
                INPUT_AUDIO_FORMATS.join(", "),
                format
            ),
        ));
    }
    Ok(MediaSource::InputAudio { format, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<ParsedChat, ApiError> {
        let messages: Vec<ChatMessage> = serde_json::from_value(v).unwrap();
        parse_messages(messages)
    }

    #[test]
    fn parts_keep_their_order_and_paths() {
        let chat = parse(serde_json::json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "what is"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA==", "detail": "high"}},
                {"type": "input_audio", "input_audio": {"data": "AA==", "format": "WAV"}, "uuid": "a1"},
            ]},
        ]))
        .unwrap();
        assert_eq!(chat.media.len(), 2);
        assert_eq!(chat.media[0].path, "messages[1].content[1].image_url");
        assert_eq!(chat.media[1].modality, Modality::Audio);
        assert_eq!(chat.media[1].uuid.as_deref(), Some("a1"));
        assert_eq!(
            chat.media[1].source,
            MediaSource::InputAudio {
                format: "wav".into(),
                data: "AA==".into()
            }
        );
        assert_eq!(
            chat.messages[1].content,
            Content::Parts(vec![
                Segment::Text("what is".into()),
                Segment::Media(0),
                Segment::Media(1)
            ])
        );
    }

    #[test]
    fn malformed_parts_name_their_field() {
        let cases = [
            (
                serde_json::json!({"type": "image_url"}),
                "messages[0].content[0].image_url",
            ),
            (
                serde_json::json!({"type": "image_url", "image_url": {"uri": "x"}}),
                "messages[0].content[0].image_url",
            ),
            (
                serde_json::json!({"type": "input_audio", "input_audio": {"data": "AA==", "format": "ogg"}}),
                "messages[0].content[0].input_audio.format",
            ),
            (
                serde_json::json!({"type": "image_embeds", "image_embeds": "AA=="}),
                "messages[0].content[0]",
            ),
            (
                serde_json::json!({"type": "image_url", "uuid": "x"}),
                "messages[0].content[0].image_url",
            ),
            (serde_json::json!({"type": "smell"}), "messages[0].content"),
        ];
        for (part, want) in cases {
            let e = parse(serde_json::json!([{"role": "user", "content": [part]}])).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(want), "{part}: {e}");
        }
    }
}
