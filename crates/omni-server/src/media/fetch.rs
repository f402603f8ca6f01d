//! A media part's bytes: from a `data:` URL, OpenAI's `input_audio`, an `http(s)://` URL under
//! the guard, or a `file://` URL under `--allowed-local-media-path`.
//!
//! The http(s) guard, applied to the URL and to every redirect hop before it is requested:
//! the scheme stays http(s); the hostname is one of `--allowed-media-domains` exactly (an
//! empty list refuses every http(s) URL: a deliberate difference from vLLM, which then fetches
//! from anywhere); the host is resolved once and, with `--media-egress-block-private`, every
//! address it resolves to must pass [`super::guard::is_blocked`]; the connection goes to the
//! checked address (reqwest's `resolve` override, no proxy), so a second DNS answer cannot
//! move it. Redirects are followed by hand, at most [`MAX_REDIRECTS`], or refused with
//! `--media-url-allow-redirects false`. The download is capped on `Content-Length` and counted
//! while it streams; the whole fetch (every hop and the body) has the modality's timeout.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use axum::http::StatusCode;
use omni_config::MediaConfig;
use reqwest::Url;
use reqwest::redirect::Policy;

use super::data_url::{self, DataUrlError};
use super::guard::is_blocked;
use super::parts::MediaSource;
use super::{Modality, ModalityName};
use crate::error::ApiError;

/// Most redirects one fetch follows.
pub(crate) const MAX_REDIRECTS: usize = 10;
const MIB: u64 = 1024 * 1024;

/// A media item's bytes and the media type its source declared (a data URL's, a response's
/// `Content-Type`, `audio/<format>` of `input_audio`), when one did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fetched {
    /// The file.
    pub bytes: Vec<u8>,
    /// Lowercase, without parameters.
    pub media_type: Option<String>,
}

/// Why a media part's bytes were not obtained.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FetchError {
    /// A malformed data URL or base64 payload.
    #[error(transparent)]
    DataUrl(#[from] DataUrlError),
    /// The declared media type does not match the part's modality.
    #[error("the media type `{got}` is not {want} (expected {want}/*)")]
    MediaType {
        /// What the source declared.
        got: String,
        /// `image` or `audio`.
        want: &'static str,
    },
    /// Not a URL, or not one of the schemes taken.
    #[error("The URL must be either a HTTP, data or file URL.")]
    Scheme,
    /// A URL that does not parse, or has no host.
    #[error("Failed to fetch media from URL: Invalid URL format")]
    InvalidUrl,
    /// http(s) media with no `--allowed-media-domains`.
    #[error(
        "http(s) media URLs are not accepted: the server has no --allowed-media-domains \
         (send the media as a data: URL)"
    )]
    NoDomainList,
    /// A host (of the URL or of a redirect) that is not in the list.
    #[error(
        "The URL must be from one of the allowed domains: {allowed:?}. Input URL domain: {host}"
    )]
    DomainNotAllowed {
        /// The host.
        host: String,
        /// `--allowed-media-domains`.
        allowed: Vec<String>,
    },
    /// The host resolves to an address the egress guard refuses.
    #[error(
        "Media URL host resolves to a blocked address: {ip}. Private, loopback, link-local and \
         multicast destinations are not allowed (--media-egress-block-private, env \
         VLLM_MEDIA_EGRESS_BLOCK_PRIVATE)."
    )]
    BlockedAddress {
        /// The refused address.
        ip: std::net::IpAddr,
    },
    /// DNS gave nothing usable.
    #[error("Cannot resolve media URL host {host:?}: {reason}")]
    Resolve {
        /// The host.
        host: String,
        /// Why.
        reason: String,
    },
    /// A redirect while redirects are off.
    #[error("the media URL redirects, and redirects are off (VLLM_MEDIA_URL_ALLOW_REDIRECTS=0)")]
    RedirectRefused,
    /// A redirect to another scheme than http(s).
    #[error("a media URL's redirect must stay on http(s), not `{0}:`")]
    RedirectScheme(String),
    /// More than [`MAX_REDIRECTS`] hops.
    #[error("the media URL redirected more than {MAX_REDIRECTS} times")]
    TooManyRedirects,
    /// An https URL in a build without TLS.
    #[error("https media URLs need omni-server built with its `https` feature (TLS)")]
    NoTls,
    /// The origin answered 4xx (other than 408/429): vLLM's 422.
    #[error("Failed to fetch media from URL: HTTP {0} error")]
    ClientStatus(u16),
    /// The origin answered another non-success status.
    #[error("Failed to fetch media from URL: the origin answered HTTP {0}")]
    OriginStatus(u16),
    /// Larger than the cap.
    #[error("Remote media download exceeds VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB={limit_mb}")]
    TooLarge {
        /// `--max-media-download-size-mb`.
        limit_mb: u64,
    },
    /// Local or remote media above the modality's own file cap.
    #[error("the {what} is {size} bytes, above the limit of {limit} bytes")]
    FileTooLarge {
        /// What was capped.
        what: &'static str,
        /// Its size.
        size: u64,
        /// The cap.
        limit: u64,
    },
    /// The whole fetch took longer than the modality's timeout.
    #[error("Failed to fetch media from URL: timed out after {0:?}")]
    Timeout(Duration),
    /// Connecting or reading failed.
    #[error("Failed to fetch media from URL: {0}")]
    Http(String),
    /// `file://` without `--allowed-local-media-path`.
    #[error("Cannot load local files without `--allowed-local-media-path`.")]
    NoLocalPath,
    /// A `file://` path that is not a readable file inside the allowed directory.
    #[error("The file path {path} must be a file under `--allowed-local-media-path {root}`.")]
    OutsideLocalPath {
        /// The path as given.
        path: String,
        /// The allowed directory.
        root: String,
    },
}

impl FetchError {
    /// The HTTP status the client gets: 422 where vLLM answers 422 (the origin's 4xx, a
    /// download over the cap, an unparsable URL), else 400.
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            Self::ClientStatus(_) | Self::TooLarge { .. } | Self::InvalidUrl => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            _ => StatusCode::BAD_REQUEST,
        }
    }

    /// As the client's error, naming `path`.
    pub(crate) fn into_api(self, path: &str) -> ApiError {
        let mut e = ApiError::bad_param(path, self.to_string());
        e.status = self.status();
        e
    }
}

/// The bytes of `source`, a part of `modality`, under `cfg`.
pub(crate) async fn fetch(
    source: &MediaSource,
    modality: Modality,
    cfg: &MediaConfig,
) -> Result<Fetched, FetchError> {
    let cap = byte_cap(cfg);
    let fetched = match source {
        MediaSource::InputAudio { format, data } => {
            let url = format!("data:audio/{format};base64,{data}");
            from_data_url(&url, cap)?
        }
        MediaSource::Url(url) => {
            let scheme = url.split_once(':').map(|(s, _)| s.to_ascii_lowercase());
            match scheme.as_deref() {
                Some("data") => from_data_url(url, cap)?,
                Some("http") | Some("https") => {
                    let timeout = cfg.fetch_timeout(modality.name());
                    let mut f = tokio::time::timeout(timeout, from_http(url, cfg, cap))
                        .await
                        .map_err(|_| FetchError::Timeout(timeout))??;
                    // An origin's `Content-Type` is only a hint (stores serve media as
                    // `binary/octet-stream`); the decoder judges the bytes.
                    let prefix = format!("{}/", modality.name());
                    f.media_type = f.media_type.filter(|t| t.starts_with(&prefix));
                    f
                }
                Some("file") => from_file(url, cfg, cap).await?,
                _ => return Err(FetchError::Scheme),
            }
        }
    };
    check_media_type(fetched.media_type.as_deref(), modality)?;
    Ok(fetched)
}

/// The largest download taken (`--max-media-download-size-mb`; 0: none). An audio clip's own
/// cap (`--max-audio-clip-filesize-mb`) is omni-mm's, checked before decoding.
fn byte_cap(cfg: &MediaConfig) -> Option<u64> {
    (cfg.max_media_download_size_mb > 0).then(|| cfg.max_media_download_size_mb.saturating_mul(MIB))
}

/// A declared type must be of the part's modality; none, or `application/octet-stream`, leaves
/// the format to the decoder.
fn check_media_type(media_type: Option<&str>, modality: Modality) -> Result<(), FetchError> {
    let Some(t) = media_type.filter(|t| !t.is_empty() && *t != "application/octet-stream") else {
        return Ok(());
    };
    let want = modality.name();
    if t.split('/').next() == Some(want) {
        Ok(())
    } else {
        Err(FetchError::MediaType {
            got: t.to_string(),
            want,
        })
    }
}

fn from_data_url(url: &str, cap: Option<u64>) -> Result<Fetched, FetchError> {
    let cap = cap.map(|c| usize::try_from(c).unwrap_or(usize::MAX));
    let d = data_url::parse(url, cap)?;
    Ok(Fetched {
        bytes: d.bytes,
        media_type: Some(d.media_type),
    })
}

/// The host as `--allowed-media-domains` names it: a domain lowercase, an IP without brackets.
fn host_name(url: &Url) -> Result<String, FetchError> {
    match (url.domain(), url.host_str()) {
        (Some(d), _) => Ok(d.to_ascii_lowercase()),
        (None, Some(ip)) => Ok(ip.trim_start_matches('[').trim_end_matches(']').to_string()),
        (None, None) => Err(FetchError::InvalidUrl),
    }
}

/// Resolves `host` once; with the guard on, every address must pass. The address to connect
/// to.
async fn resolve(host: &str, port: u16, guard: bool) -> Result<SocketAddr, FetchError> {
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| FetchError::Resolve {
            host: host.to_string(),
            reason: e.to_string(),
        })?
        .collect();
    if guard && let Some(bad) = addrs.iter().find(|a| is_blocked(a.ip())) {
        tracing::warn!(host, ip = %bad.ip(), "blocked a media URL fetch to a private address");
        return Err(FetchError::BlockedAddress { ip: bad.ip() });
    }
    addrs.first().copied().ok_or_else(|| FetchError::Resolve {
        host: host.to_string(),
        reason: "no addresses".into(),
    })
}

/// Checks one hop: the scheme, the domain list and the resolved address; returns a client
/// pinned to that address.
async fn checked_client(url: &Url, cfg: &MediaConfig) -> Result<reqwest::Client, FetchError> {
    match url.scheme() {
        "http" => {}
        "https" if cfg!(feature = "https") => {}
        "https" => return Err(FetchError::NoTls),
        _ => return Err(FetchError::Scheme),
    }
    if cfg.allowed_media_domains.is_empty() {
        return Err(FetchError::NoDomainList);
    }
    let host = host_name(url)?;
    if !cfg
        .allowed_media_domains
        .iter()
        .any(|d| d.eq_ignore_ascii_case(&host))
    {
        return Err(FetchError::DomainNotAllowed {
            host,
            allowed: cfg.allowed_media_domains.clone(),
        });
    }
    let port = url.port_or_known_default().ok_or(FetchError::InvalidUrl)?;
    let addr = resolve(&host, port, cfg.media_egress_block_private).await?;
    let mut builder = reqwest::Client::builder()
        .redirect(Policy::none())
        .no_proxy();
    if let Some(d) = url.domain() {
        builder = builder.resolve(d, addr);
    }
    builder.build().map_err(|e| FetchError::Http(e.to_string()))
}

async fn from_http(url: &str, cfg: &MediaConfig, cap: Option<u64>) -> Result<Fetched, FetchError> {
    let mut url = Url::parse(url).map_err(|_| FetchError::InvalidUrl)?;
    for _hop in 0..=MAX_REDIRECTS {
        let client = checked_client(&url, cfg).await?;
        let mut resp = client
            .get(url.clone())
            .send()
            .await
            .map_err(|e| FetchError::Http(e.to_string()))?;
        let status = resp.status();
        if status.is_redirection() {
            if !cfg.media_url_allow_redirects {
                return Err(FetchError::RedirectRefused);
            }
            let location = resp
                .headers()
                .get(reqwest::header::LOCATION)
                .and_then(|v| v.to_str().ok())
                .ok_or(FetchError::OriginStatus(status.as_u16()))?;
            url = url.join(location).map_err(|_| FetchError::InvalidUrl)?;
            if !matches!(url.scheme(), "http" | "https") {
                return Err(FetchError::RedirectScheme(url.scheme().to_string()));
            }
            continue;
        }
        if !status.is_success() {
            let code = status.as_u16();
            return Err(match code {
                408 | 429 => FetchError::OriginStatus(code),
                400..=499 => FetchError::ClientStatus(code),
                _ => FetchError::OriginStatus(code),
            });
        }
        let too_large = || FetchError::TooLarge {
            limit_mb: cfg.max_media_download_size_mb,
        };
        if let (Some(limit), Some(len)) = (cap, resp.content_length())
            && len > limit
        {
            return Err(too_large());
        }
        let media_type = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(|v| v.trim().to_ascii_lowercase());
        let mut bytes = Vec::new();
        while let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| FetchError::Http(e.to_string()))?
        {
            if cap.is_some_and(|limit| (bytes.len() + chunk.len()) as u64 > limit) {
                return Err(too_large());
            }
            bytes.extend_from_slice(&chunk);
        }
        return Ok(Fetched { bytes, media_type });
    }
    Err(FetchError::TooManyRedirects)
}

async fn from_file(url: &str, cfg: &MediaConfig, cap: Option<u64>) -> Result<Fetched, FetchError> {
    let root = cfg
        .allowed_local_media_path
        .as_deref()
        .ok_or(FetchError::NoLocalPath)?;
    let url = Url::parse(url).map_err(|_| FetchError::InvalidUrl)?;
    let outside = |path: &Path| FetchError::OutsideLocalPath {
        path: path.display().to_string(),
        root: root.display().to_string(),
    };
    let path = url.to_file_path().map_err(|()| FetchError::InvalidUrl)?;
    // One answer for "outside", "missing" and "not a file": no probing of the file system.
    let (Ok(root_real), Ok(real)) = (
        tokio::fs::canonicalize(root).await,
        tokio::fs::canonicalize(&path).await,
    ) else {
        return Err(outside(&path));
    };
    if !real.starts_with(&root_real) || real == root_real {
        return Err(outside(&path));
    }
    let meta = tokio::fs::metadata(&real)
        .await
        .map_err(|_| outside(&path))?;
    if !meta.is_file() {
        return Err(outside(&path));
    }
    if let Some(limit) = cap
        && meta.len() > limit
    {
        return Err(FetchError::FileTooLarge {
            what: "local media file",
            size: meta.len(),
            limit,
        });
    }
    let bytes = tokio::fs::read(&real).await.map_err(|_| outside(&path))?;
    Ok(Fetched {
        bytes,
        media_type: None,
    })
}
