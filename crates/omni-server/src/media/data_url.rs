//! `data:` URLs (RFC 2397) with base64 payloads, the only encoding taken (as vLLM: "Only base64
//! data URLs are supported for now."), and a strict base64 decoder (standard alphabet, `=`
//! padding, length a multiple of 4: a truncated payload is refused, not guessed at).

/// A `data:` URL's media type (lowercase, parameters dropped; empty when none was given) and
/// its decoded bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DataUrl {
    /// `image/png`, `audio/wav`, ...
    pub media_type: String,
    /// The payload.
    pub bytes: Vec<u8>,
}

/// Why a `data:` URL or a base64 payload was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DataUrlError {
    /// No `,` between the header and the data.
    #[error("Invalid data URL: missing ',' separator.")]
    NoComma,
    /// Not `;base64`.
    #[error("Only base64 data URLs are supported for now.")]
    NotBase64,
    /// The payload is not valid base64.
    #[error("invalid base64: {0}")]
    Base64(Base64Error),
    /// The decoded payload would exceed the cap.
    #[error("the decoded payload would be {size} bytes, above the limit of {limit}")]
    TooLarge {
        /// Decoded size.
        size: usize,
        /// The cap.
        limit: usize,
    },
}

/// Why a base64 string does not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Base64Error {
    /// Length not a multiple of 4 (a truncated or unpadded payload).
    #[error("length {0} is not a multiple of 4 (truncated?)")]
    Length(usize),
    /// A byte outside the standard alphabet at this offset.
    #[error("byte {byte:#04x} at offset {offset} is not base64")]
    Byte {
        /// The offending byte.
        byte: u8,
        /// Its offset.
        offset: usize,
    },
    /// `=` before the end or more than two of them.
    #[error("misplaced padding")]
    Padding,
}

/// Parses `data:[<mediatype>][;<param>=<value>]*;base64,<data>`; `max_bytes` caps the decoded
/// size, checked before decoding.
pub(crate) fn parse(url: &str, max_bytes: Option<usize>) -> Result<DataUrl, DataUrlError> {
    let rest = url.get(5..).unwrap_or_default();
    let (spec, data) = rest.split_once(',').ok_or(DataUrlError::NoComma)?;
    let (media, encoding) = spec.rsplit_once(';').ok_or(DataUrlError::NotBase64)?;
    if encoding != "base64" {
        return Err(DataUrlError::NotBase64);
    }
    let media_type = media
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    if let Some(limit) = max_bytes {
        let size = data.len() / 4 * 3;
        if size > limit {
            return Err(DataUrlError::TooLarge { size, limit });
        }
    }
    let bytes = decode_base64(data).map_err(DataUrlError::Base64)?;
    Ok(DataUrl { media_type, bytes })
}

/// Decodes standard base64 with padding.
pub(crate) fn decode_base64(s: &str) -> Result<Vec<u8>, Base64Error> {
    let b = s.as_bytes();
    if !b.len().is_multiple_of(4) {
        return Err(Base64Error::Length(b.len()));
    }
    let pad = b.iter().rev().take_while(|&&c| c == b'=').count();
    if pad > 2 {
        return Err(Base64Error::Padding);
    }
    let body = &b[..b.len() - pad];
    let mut out = Vec::with_capacity(b.len() / 4 * 3);
    let mut acc = 0u32;
    let mut bits = 0u32;
    for (offset, &byte) in body.iter().enumerate() {
        let v = match byte {
            b'A'..=b'Z' => byte - b'A',
            b'a'..=b'z' => byte - b'a' + 26,
            b'0'..=b'9' => byte - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => return Err(Base64Error::Padding),
            _ => return Err(Base64Error::Byte { byte, offset }),
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_decodes_strictly() {
        assert_eq!(decode_base64("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(decode_base64("aGVsbG8h").unwrap(), b"hello!");
        assert_eq!(decode_base64("").unwrap(), b"");
        assert_eq!(decode_base64("aGVsbG"), Err(Base64Error::Length(6)));
        assert!(matches!(
            decode_base64("aGV$bG8="),
            Err(Base64Error::Byte { byte: b'$', .. })
        ));
        assert_eq!(decode_base64("aG=sbG8="), Err(Base64Error::Padding));
    }

    #[test]
    fn data_urls_parse_as_rfc_2397_base64_only() {
        let d = parse("data:image/PNG;name=x.png;base64,aGVsbG8=", None).unwrap();
        assert_eq!(d.media_type, "image/png");
        assert_eq!(d.bytes, b"hello");
        assert_eq!(
            parse("data:image/png,hello", None),
            Err(DataUrlError::NotBase64)
        );
        assert_eq!(
            parse("data:image/png;base64", None),
            Err(DataUrlError::NoComma)
        );
        assert!(matches!(
            parse("data:image/png;base64,aGVsbG8=", Some(3)),
            Err(DataUrlError::TooLarge { .. })
        ));
    }
}
