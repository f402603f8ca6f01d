//! The prompt of a chat request with media: what the chat template sees, and the expansion of
//! each placeholder's pad token to its item's token count.
//!
//! Two content formats, as vLLM's `--chat-template-content-format auto` tells them apart: a
//! template that loops over a message's content (Qwen's do: `{% for content in
//! message['content'] %}` writing `<|vision_start|><|image_pad|><|vision_end|>` for an image
//! part) gets the parts as a list (`{"type": "text", "text": ...}`, `{"type": "image"}`,
//! `{"type": "audio"}`); any other template gets a string with the placeholders first, one a
//! line, then the text parts joined by newlines (vLLM's default placement). A message without
//! media is a string either way, as before media existed.

use omni_mm::MmItem;
use omni_tokenizer::Tokenizer;
use serde_json::{Value, json};

use super::parts::{Content, ParsedChat, Segment};
use super::{MmInput, Modality, ModalityName, MultimodalModel};
use crate::error::ApiError;

/// How message content reaches the chat template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ContentFormat {
    /// One string per message.
    String,
    /// OpenAI's list of typed parts.
    OpenAi,
}

/// `OpenAi` when some `{% for ... in ... %}` of the template iterates over something named
/// `content` (vLLM inspects the template's syntax tree for the same loop).
pub(crate) fn content_format(template: Option<&str>) -> ContentFormat {
    let Some(src) = template else {
        return ContentFormat::String;
    };
    let loops_over_content = src.split("{%").skip(1).any(|block| {
        let stmt = block.split("%}").next().unwrap_or_default();
        let stmt = stmt.trim_start_matches(['-', '+']).trim();
        stmt.strip_prefix("for ")
            .and_then(|rest| rest.split_once(" in "))
            .is_some_and(|(_, iter)| iter.contains("content"))
    });
    if loops_over_content {
        ContentFormat::OpenAi
    } else {
        ContentFormat::String
    }
}

/// The placeholder text of `modality`: its start, pad and end tokens as the tokenizer spells
/// them (`<|vision_start|><|image_pad|><|vision_end|>`).
fn placeholder(
    model: &MultimodalModel,
    tokenizer: &Tokenizer,
    modality: Modality,
) -> Result<String, ApiError> {
    let ids = model.placeholder_ids(modality).ok_or_else(|| {
        ApiError::internal(format!("no placeholder for {} input", modality.name()))
    })?;
    ids.iter()
        .map(|&id| {
            tokenizer.id_to_token(id).ok_or_else(|| {
                ApiError::internal(format!(
                    "the tokenizer has no token {id}, the model's {} placeholder",
                    modality.name()
                ))
            })
        })
        .collect()
}

/// The messages as the chat template sees them: `{role, content, name?}`.
pub(crate) fn template_messages(
    chat: &ParsedChat,
    format: ContentFormat,
    model: Option<&MultimodalModel>,
    tokenizer: &Tokenizer,
) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::with_capacity(chat.messages.len());
    for m in &chat.messages {
        let content = match &m.content {
            Content::Null => Value::Null,
            Content::Text(text) => Value::String(text.clone()),
            Content::Parts(segments) => content_of(chat, segments, format, model, tokenizer)?,
        };
        let mut msg = json!({ "role": m.role, "content": content });
        if let Some(name) = &m.name {
            msg["name"] = Value::String(name.clone());
        }
        out.push(msg);
    }
    Ok(out)
}

fn content_of(
    chat: &ParsedChat,
    segments: &[Segment],
    format: ContentFormat,
    model: Option<&MultimodalModel>,
    tokenizer: &Tokenizer,
) -> Result<Value, ApiError> {
    let texts = || {
        segments.iter().filter_map(|s| match s {
            Segment::Text(t) => Some(t.as_str()),
            Segment::Media(_) => None,
        })
    };
    let media: Vec<Modality> = segments
        .iter()
        .filter_map(|s| match s {
            Segment::Media(i) => chat.media.get(*i).map(|p| p.modality),
            Segment::Text(_) => None,
        })
        .collect();
    if media.is_empty() {
        return Ok(Value::String(texts().collect::<Vec<_>>().join("\n")));
    }
    let model = model.ok_or_else(|| ApiError::internal("media parts for a text-only model"))?;
    if format == ContentFormat::OpenAi {
        let parts = segments
            .iter()
            .map(|s| match s {
                Segment::Text(t) => json!({"type": "text", "text": t}),
                Segment::Media(i) => {
                    let name = chat.media.get(*i).map_or("image", |p| p.modality.name());
                    json!({"type": name})
                }
            })
            .collect();
        return Ok(Value::Array(parts));
    }
    let mut lines = media
        .iter()
        .map(|&m| placeholder(model, tokenizer, m))
        .collect::<Result<Vec<_>, _>>()?;
    let text = texts().collect::<Vec<_>>().join("\n");
    if !text.is_empty() {
        lines.push(text);
    }
    Ok(Value::String(lines.join("\n")))
}

/// Expands each pad token of the prompt to its item's token count (omni-mm's
/// `expand_placeholders`; the items in prompt order) and records each item's offset. Any
/// mismatch between the pads and the items (a template that dropped a placeholder, a message
/// that typed one as text) is a 400 naming `messages`, so the engine never sees pads without
/// their item. A model without encoders has no pads.
pub(crate) fn expand(
    ids: Vec<u32>,
    inputs: &mut [MmInput],
    model: Option<&MultimodalModel>,
) -> Result<Vec<u32>, ApiError> {
    let Some(model) = model else {
        return Ok(ids);
    };
    let items: Vec<MmItem> = inputs
        .iter()
        .map(|i| match (i.grid_thw, i.num_frames) {
            (Some(grid_thw), _) => MmItem::Image { grid_thw },
            (None, frames) => MmItem::Audio {
                num_frames: frames.unwrap_or(0) as usize,
            },
        })
        .collect();
    let expanded = omni_mm::expand_placeholders(&ids, &items, &model.prompt)
        .map_err(|e| ApiError::bad_param("messages", e.to_string()))?;
    for (item, range) in inputs.iter_mut().zip(&expanded.ranges) {
        if range.length != item.num_tokens as usize {
            return Err(ApiError::internal(format!(
                "a {} item of {} tokens got {} pads",
                item.modality.name(),
                item.num_tokens,
                range.length
            )));
        }
        item.offset = u32::try_from(range.offset)
            .map_err(|_| ApiError::bad_param("messages", "the prompt is too long"))?;
    }
    Ok(expanded.ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_that_loop_over_content_get_parts() {
        let qwen = "{% for message in messages %}{% if message['content'] is string %}\
                    {{ message['content'] }}{% else %}{%- for content in message['content'] -%}\
                    {% endfor %}{% endif %}{% endfor %}";
        assert_eq!(content_format(Some(qwen)), ContentFormat::OpenAi);
        let plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}";
        assert_eq!(content_format(Some(plain)), ContentFormat::String);
        assert_eq!(content_format(None), ContentFormat::String);
    }

    fn item(modality: Modality, num_tokens: u32) -> MmInput {
        MmInput {
            modality,
            data: Default::default(),
            shape: [0, 0],
            // 4 x 2 patches merge 2 x 2 into 2 tokens; 100 mel frames are 13 tokens.
            grid_thw: (modality == Modality::Image).then_some([1, 4, 2]),
            num_frames: (modality == Modality::Audio).then_some(100),
            num_tokens,
            content_hash: omni_mm::ContentHash([0; 32]),
            offset: 0,
            uuid: None,
        }
    }

    #[test]
    fn pads_expand_in_order_and_offsets_point_at_them() {
        let model = MultimodalModel::test_model();
        let mut items = vec![item(Modality::Image, 2), item(Modality::Audio, 13)];
        let ids = vec![1, 11, 10, 12, 2, 21, 20, 22];
        let out = expand(ids, &mut items, Some(&model)).unwrap();
        let mut want = vec![1, 11, 10, 10, 12, 2, 21];
        want.extend([20; 13]);
        want.push(22);
        assert_eq!(out, want);
        assert_eq!((items[0].offset, items[1].offset), (2, 7));
        let e = expand(vec![1, 10, 10], &mut items[..1], Some(&model)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(expand(vec![1, 10], &mut [], Some(&model)).is_err());
        assert_eq!(expand(vec![1, 10], &mut [], None).unwrap(), [1, 10]);
    }
}
