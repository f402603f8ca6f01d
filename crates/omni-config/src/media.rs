//! [`MediaConfig`]: how the API server takes multimodal inputs (images and audio in chat
//! content parts): where media may be fetched from, how long and how much, and how many items
//! one prompt may hold. vLLM reads most of these from environment variables only; here each
//! variable sets a flag (see [`crate::ENV_FLAGS`]), so the file, the environment and the command
//! line layer as for every other setting.
//!
//! Like [`crate::FrontendConfig`], only the API process reads it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde::{Deserialize, Serialize};

/// vLLM's per-modality default of `--limit-mm-per-prompt`.
pub const DEFAULT_MM_LIMIT: u32 = 999;

/// Settings of multimodal inputs (`serve` only).
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[command(next_help_heading = "Multimodal inputs")]
#[serde(deny_unknown_fields)]
pub struct MediaConfig {
    /// Hostnames that http(s) media URLs may name, matched exactly on the URL and on every
    /// redirect hop. Empty (the default): http(s) media URLs are refused, and only `data:` URLs
    /// (and `file://` under --allowed-local-media-path) are taken. vLLM fetches from any host
    /// when the list is empty; this server does not.
    #[arg(long, num_args = 1.., value_name = "HOST")]
    pub allowed_media_domains: Vec<String>,
    /// A directory that `file://` media URLs may read from (the resolved path must lie inside
    /// it). Absent: `file://` URLs are refused.
    #[arg(long, value_name = "DIR")]
    pub allowed_local_media_path: Option<PathBuf>,
    /// Most items of each modality in one prompt, as JSON: `{"image": 2, "audio": 1}` (vLLM's
    /// `{"video": {"count": 1, ...}}` form is read for its count). A modality not named gets
    /// 999; 0 refuses the modality.
    #[arg(long, value_name = "JSON", value_parser = parse_mm_limits)]
    pub limit_mm_per_prompt: Option<MmLimits>,
    /// Seconds to fetch one image URL (env VLLM_IMAGE_FETCH_TIMEOUT).
    #[arg(long, value_name = "SECONDS", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub image_fetch_timeout: u64,
    /// Seconds to fetch one audio URL (env VLLM_AUDIO_FETCH_TIMEOUT).
    #[arg(long, value_name = "SECONDS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub audio_fetch_timeout: u64,
    /// Seconds to fetch one video URL (env VLLM_VIDEO_FETCH_TIMEOUT).
    #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub video_fetch_timeout: u64,
    /// Follow redirects of media URLs, each hop checked as the URL itself, at most 10 (env
    /// VLLM_MEDIA_URL_ALLOW_REDIRECTS). Off: a redirect is refused.
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        default_value_t = true,
        default_missing_value = "true",
        action = clap::ArgAction::Set,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub media_url_allow_redirects: bool,
    /// Largest media download in MiB, checked on Content-Length and counted while the body
    /// streams (env VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB; 0: no limit, not advised).
    #[arg(long, value_name = "MIB", default_value_t = 256)]
    pub max_media_download_size_mb: u64,
    /// Refuse media URLs whose host resolves to a loopback, private, link-local, reserved,
    /// multicast, CGNAT, 6to4 or NAT64 address (IPv4-mapped IPv6 judged as IPv4); the
    /// connection goes to the address that was checked (env VLLM_MEDIA_EGRESS_BLOCK_PRIVATE).
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        default_value_t = true,
        default_missing_value = "true",
        action = clap::ArgAction::Set,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub media_egress_block_private: bool,
    /// Largest image, in pixels, read from its header before any decoding (env
    /// VLLM_MAX_IMAGE_PIXELS; vLLM's default, twice PIL's bomb threshold).
    #[arg(long, value_name = "PIXELS", default_value_t = 178_956_970, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_image_pixels: u64,
    /// Largest audio file in MiB (env VLLM_MAX_AUDIO_CLIP_FILESIZE_MB).
    #[arg(long, value_name = "MIB", default_value_t = 25, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_audio_clip_filesize_mb: u64,
    /// Longest audio clip in seconds, enforced while decoding (env
    /// VLLM_MAX_AUDIO_DECODE_DURATION_S).
    #[arg(long, value_name = "SECONDS", default_value_t = 600.0)]
    pub max_audio_decode_duration_s: f64,
    /// GiB of preprocessed media the API process keeps by a hash of the fetched bytes, so a
    /// repeated image or clip is not decoded and preprocessed again (vLLM's multimodal processor
    /// cache, LRU; `vllm:mm_cache_queries` / `vllm:mm_cache_hits` count it; 0: off).
    #[arg(long, value_name = "GIB", default_value_t = 4.0)]
    pub mm_processor_cache_gb: f64,
}

impl Default for MediaConfig {
    /// The defaults, as clap's attributes write them.
    fn default() -> Self {
        crate::engine::clap_defaults()
    }
}

impl MediaConfig {
    /// The fetch timeout of a modality (`image`, `audio`, `video`; another name gets the image
    /// one).
    pub fn fetch_timeout(&self, modality: &str) -> Duration {
        Duration::from_secs(match modality {
            "audio" => self.audio_fetch_timeout,
            "video" => self.video_fetch_timeout,
            _ => self.image_fetch_timeout,
        })
    }

    /// The most items of `modality` one prompt may hold.
    pub fn limit(&self, modality: &str) -> u32 {
        self.limit_mm_per_prompt
            .as_ref()
            .and_then(|l| l.0.get(modality).copied())
            .unwrap_or(DEFAULT_MM_LIMIT)
    }
}

/// `--limit-mm-per-prompt`: modality name to the most items of it in one prompt.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmLimits(pub BTreeMap<String, u32>);

/// Parses `--limit-mm-per-prompt`: a JSON object of counts, or of objects with a `count`.
pub fn parse_mm_limits(s: &str) -> Result<MmLimits, String> {
    let v: serde_json::Value =
        serde_json::from_str(s).map_err(|e| format!("expected a JSON object: {e}"))?;
    let obj = v
        .as_object()
        .ok_or("expected a JSON object such as {\"image\": 2}")?;
    let mut out = BTreeMap::new();
    for (k, v) in obj {
        if !["image", "audio", "video"].contains(&k.as_str()) {
            return Err(format!("`{k}`: the modalities are image, audio and video"));
        }
        let n = v
            .as_u64()
            .or_else(|| v.get("count").and_then(|c| c.as_u64()))
            .ok_or_else(|| format!("`{k}`: expected a count (a non-negative integer)"))?;
        let n = u32::try_from(n).map_err(|_| format!("`{k}`: {n} is too large"))?;
        out.insert(k.clone(), n);
    }
    Ok(MmLimits(out))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use clap::FromArgMatches;

    use super::*;

    #[test]
    fn vllms_env_vars_set_the_flags_under_the_command_line() {
        let cmd = MediaConfig::augment_args(clap::Command::new("serve"));
        let env = [
            ("VLLM_MEDIA_EGRESS_BLOCK_PRIVATE", "0"),
            ("VLLM_IMAGE_FETCH_TIMEOUT", "7"),
            ("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "false"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let argv: Vec<String> = ["serve", "--image-fetch-timeout", "9"]
            .map(String::from)
            .to_vec();
        let argv = crate::layered_argv(argv, &cmd, env).unwrap();
        let m = crate::override_self(cmd)
            .try_get_matches_from(argv)
            .unwrap();
        let c = MediaConfig::from_arg_matches(&m).unwrap();
        assert!(!c.media_egress_block_private && !c.media_url_allow_redirects);
        assert_eq!(c.image_fetch_timeout, 9, "the command line wins");
        let bad = [("VLLM_MAX_IMAGE_PIXELS".to_string(), "lots".to_string())];
        let cmd = MediaConfig::augment_args(clap::Command::new("serve"));
        let e = crate::layered_argv(vec!["serve".into()], &cmd, bad).unwrap_err();
        assert!(e.to_string().contains("VLLM_MAX_IMAGE_PIXELS"), "{e}");
    }

    #[test]
    fn defaults_are_vllms_and_limits_parse_both_forms() {
        let d = MediaConfig::default();
        assert_eq!(d.fetch_timeout("image"), Duration::from_secs(5));
        assert_eq!(d.fetch_timeout("audio"), Duration::from_secs(10));
        assert_eq!(d.fetch_timeout("video"), Duration::from_secs(30));
        assert!(d.media_url_allow_redirects && d.media_egress_block_private);
        assert_eq!(d.max_media_download_size_mb, 256);
        assert_eq!(d.limit("image"), DEFAULT_MM_LIMIT);
        let l =
            parse_mm_limits(r#"{"image": 2, "video": {"count": 0, "num_frames": 32}}"#).unwrap();
        assert_eq!(l.0["image"], 2);
        assert_eq!(l.0["video"], 0);
        assert!(parse_mm_limits("[1]").is_err());
        assert!(parse_mm_limits(r#"{"image": -1}"#).is_err());
        assert!(parse_mm_limits(r#"{"imag": 1}"#).is_err());
    }
}
