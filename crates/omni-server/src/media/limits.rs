//! What a prompt's media may be, checked on the parsed parts before anything is fetched: the
//! model must have the tower for each modality, video is not taken yet, and each modality's
//! count is at most its `--limit-mm-per-prompt` (vLLM's default 999; 0 refuses the modality),
//! with vLLM's message.

use omni_config::MediaConfig;

use super::parts::MediaPart;
use super::{Modality, ModalityName, MultimodalModel};
use crate::error::ApiError;

/// Refuses the first part the model cannot take, or the first part beyond its modality's
/// limit.
pub(crate) fn check(
    parts: &[MediaPart],
    model: Option<&MultimodalModel>,
    cfg: &MediaConfig,
) -> Result<(), ApiError> {
    for p in parts {
        if p.modality == Modality::Video {
            return Err(ApiError::bad_param(
                &p.part_path,
                "video input is not supported yet (send frames as images, or the audio track \
                 as audio)",
            ));
        }
        if !model.is_some_and(|m| m.supports(p.modality)) {
            let tower = match p.modality {
                Modality::Image => "vision",
                _ => "audio",
            };
            return Err(ApiError::bad_param(
                &p.part_path,
                format!(
                    "this model does not take {} input (it has no {tower} encoder)",
                    p.modality.name()
                ),
            ));
        }
    }
    for modality in [Modality::Image, Modality::Audio] {
        let limit = cfg.limit(modality.name());
        if let Some(over) = parts
            .iter()
            .filter(|p| p.modality == modality)
            .nth(limit as usize)
        {
            let mut message = format!(
                "At most {limit} {}(s) may be provided in one prompt.",
                modality.name()
            );
            if limit > 0 {
                message.push_str(" Set `--limit-mm-per-prompt` to increase this limit.");
            }
            return Err(ApiError::bad_param(&over.part_path, message));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::media::parts::MediaSource;

    fn part(modality: Modality, j: usize) -> MediaPart {
        MediaPart {
            modality,
            source: MediaSource::Url("data:,".into()),
            uuid: None,
            part_path: format!("messages[0].content[{j}]"),
            path: String::new(),
        }
    }

    #[test]
    fn counts_follow_limit_mm_per_prompt_and_zero_disables() {
        let model = MultimodalModel::test_model();
        let cfg = MediaConfig {
            limit_mm_per_prompt: Some(
                omni_config::parse_mm_limits(r#"{"image": 2, "audio": 0}"#).unwrap(),
            ),
            ..MediaConfig::default()
        };
        let images: Vec<_> = (0..3).map(|j| part(Modality::Image, j)).collect();
        assert!(check(&images[..2], Some(&model), &cfg).is_ok());
        let e = check(&images, Some(&model), &cfg).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[2]"));
        assert!(
            e.message
                .starts_with("At most 2 image(s) may be provided in one prompt.")
        );
        let e = check(&[part(Modality::Audio, 0)], Some(&model), &cfg).unwrap_err();
        assert_eq!(
            e.message,
            "At most 0 audio(s) may be provided in one prompt."
        );
    }

    #[test]
    fn a_text_only_model_and_video_are_refused_by_modality() {
        let cfg = MediaConfig::default();
        let e = check(&[part(Modality::Image, 1)], None, &cfg).unwrap_err();
        assert!(e.message.contains("image input"), "{e}");
        assert_eq!(e.param.as_deref(), Some("messages[0].content[1]"));
        let model = MultimodalModel::test_model();
        let e = check(&[part(Modality::Video, 0)], Some(&model), &cfg).unwrap_err();
        assert!(e.message.contains("video input is not supported"), "{e}");
    }
}
