//! Media in chat content parts: hostile and malformed media get an OpenAI-shaped 4xx naming the
//! part, the server keeps serving, nothing reaches the engine, and nothing is fetched that
//! should not be (every origin is a 127.0.0.1 listener of the test that counts its
//! connections); a PNG and a WAV reach the engine with their placeholders expanded.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod media_common;

use std::sync::Arc;

use common::{FakeEngine, call};
use media_common::{
    Origin, b64, http_response, mm_config, mm_tokenizer, png, png_header, wav, wav_claiming,
};
use omni_server::ServerConfig;
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";

fn app(engine: Arc<FakeEngine>, config: ServerConfig) -> axum::Router {
    omni_server::router(config, engine, mm_tokenizer(true))
}

fn chat(parts: Vec<Value>) -> String {
    json!({"messages": [{"role": "user", "content": parts}], "max_tokens": 2}).to_string()
}

fn image_part(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

fn audio_part(format: &str, bytes: &[u8]) -> Value {
    json!({"type": "input_audio", "input_audio": {"data": b64(bytes), "format": format}})
}

/// Posts `body`, expects `status` with OpenAI's error shape naming `param` and a message
/// holding `needle`, then checks that the server still answers.
async fn refused(app: &axum::Router, body: &str, status: u16, param: &str, needle: &str) {
    let (got, v, text) = call(app, "POST", CHAT, Some(body), &[]).await;
    let ctx = &body[..body.len().min(160)];
    assert_eq!(got, status, "{ctx}: {text}");
    let e = &v["error"];
    assert_eq!(e["param"], param, "{ctx}: {v}");
    assert_eq!(e["type"], "invalid_request_error", "{ctx}: {v}");
    let message = e["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(needle),
        "{ctx}: {message:?} lacks {needle:?}"
    );
    let (ok, _, _) = call(app, "GET", "/health", None, &[]).await;
    assert_eq!(ok, 200, "still serving after {ctx}");
}

fn no_requests(engine: &FakeEngine) {
    assert!(
        engine.requests.lock().unwrap().is_empty(),
        "nothing reaches the engine"
    );
}

#[tokio::test]
async fn hostile_inline_media_gets_a_400_naming_the_part() {
    let engine = Arc::new(FakeEngine::default());
    let app = app(engine.clone(), mm_config());
    let p = "messages[0].content[0].image_url";
    // A 100k x 100k PNG header: refused from the header, nothing allocated.
    let bomb = format!(
        "data:image/png;base64,{}",
        b64(&png_header(100_000, 100_000))
    );
    refused(&app, &chat(vec![image_part(&bomb)]), 400, p, "pixels").await;
    // Truncated base64.
    let good = b64(&png(64, 64));
    let cut = format!("data:image/png;base64,{}", &good[..good.len() - 3]);
    refused(&app, &chat(vec![image_part(&cut)]), 400, p, "base64").await;
    // The wrong media type for the part.
    let text = format!("data:text/plain;base64,{good}");
    refused(&app, &chat(vec![image_part(&text)]), 400, p, "text/plain").await;
    let audio_png =
        json!({"type": "audio_url", "audio_url": {"url": format!("data:image/png;base64,{good}")}});
    let pa = "messages[0].content[0].audio_url";
    refused(&app, &chat(vec![audio_png]), 400, pa, "image/png").await;
    // Not base64 at all, and an unknown scheme.
    let plain = "data:image/png,rawbytes";
    refused(&app, &chat(vec![image_part(plain)]), 400, p, "Only base64").await;
    refused(
        &app,
        &chat(vec![image_part("ftp://x/y.png")]),
        400,
        p,
        "HTTP, data or file",
    )
    .await;
    // Bytes that are no image.
    let junk = format!(
        "data:image/png;base64,{}",
        b64(b"definitely not a png file")
    );
    refused(&app, &chat(vec![image_part(&junk)]), 400, p, "image").await;
    // A WAV header claiming two hours (vLLM's cap: 600 s), with a few samples behind it.
    let pi = "messages[0].content[0].input_audio";
    let long = wav_claiming(16_000, 2 * 3600);
    refused(
        &app,
        &chat(vec![audio_part("wav", &long)]),
        400,
        pi,
        "longer than",
    )
    .await;
    // A "file named mp3" that is not one.
    let fake = b"ID3 this is a text file pretending to be an mp3".repeat(20);
    refused(
        &app,
        &chat(vec![audio_part("mp3", &fake)]),
        400,
        pi,
        "audio",
    )
    .await;
    // A WAV declared as mp3.
    let clip = wav(16_000, &[0; 16_000]);
    refused(&app, &chat(vec![audio_part("mp3", &clip)]), 400, pi, "mp3").await;
    // The second part is the bad one: the path says so.
    let two = chat(vec![
        json!({"type": "text", "text": "hi"}),
        image_part(&cut),
    ]);
    refused(
        &app,
        &two,
        400,
        "messages[0].content[1].image_url",
        "base64",
    )
    .await;
    // Images whose tokens alone overflow a 200-token context: 4 images of 64 (256 x 256).
    let small_ctx = ServerConfig {
        max_model_len: 200,
        ..mm_config()
    };
    let app_small = omni_server::router(small_ctx, engine.clone(), mm_tokenizer(true));
    let big = format!("data:image/png;base64,{}", b64(&png(256, 256)));
    let many = chat((0..4).map(|_| image_part(&big)).collect());
    refused(
        &app_small,
        &many,
        400,
        "messages",
        "at least 256 tokens (at messages[0].content[3]",
    )
    .await;
    no_requests(&engine);
}

#[tokio::test]
async fn unsupported_parts_and_text_only_models_are_refused_by_name() {
    let engine = Arc::new(FakeEngine::default());
    let app = app(engine.clone(), mm_config());
    let part = "messages[0].content[0]";
    let video = json!({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}});
    refused(
        &app,
        &chat(vec![video]),
        400,
        part,
        "video input is not supported",
    )
    .await;
    let embeds = json!({"type": "image_embeds", "image_embeds": "AAAA"});
    refused(
        &app,
        &chat(vec![embeds]),
        400,
        part,
        "client-supplied tensors",
    )
    .await;
    let no_url = json!({"type": "image_url", "image_url": {}});
    refused(
        &app,
        &chat(vec![no_url]),
        400,
        "messages[0].content[0].image_url",
        "url",
    )
    .await;
    let ogg = json!({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}});
    let fmt = "messages[0].content[0].input_audio.format";
    refused(&app, &chat(vec![ogg]), 400, fmt, "wav, mp3, flac").await;
    no_requests(&engine);

    let text_only = ServerConfig {
        multimodal: None,
        ..mm_config()
    };
    let app = omni_server::router(text_only, engine.clone(), mm_tokenizer(true));
    let png_url = format!("data:image/png;base64,{}", b64(&png(64, 64)));
    refused(
        &app,
        &chat(vec![image_part(&png_url)]),
        400,
        part,
        "image input",
    )
    .await;
    let clip = wav(16_000, &[0; 16_000]);
    refused(
        &app,
        &chat(vec![audio_part("wav", &clip)]),
        400,
        part,
        "audio input",
    )
    .await;
    no_requests(&engine);
}

#[tokio::test]
async fn http_media_needs_an_allowed_domain_and_a_public_address() {
    let origin =
        Origin::start(|_| http_response("200 OK", &[("Content-Type", "image/png")], &png(64, 64)))
            .await;
    let url = format!("http://127.0.0.1:{}/cat.png", origin.port());
    let engine = Arc::new(FakeEngine::default());
    let p = "messages[0].content[0].image_url";
    // No --allowed-media-domains: http(s) is refused outright.
    let app = app(engine.clone(), mm_config());
    refused(
        &app,
        &chat(vec![image_part(&url)]),
        400,
        p,
        "allowed-media-domains",
    )
    .await;
    // Allowed by name, but 127.0.0.1 is loopback: the egress guard refuses it.
    let mut cfg = mm_config();
    cfg.media.allowed_media_domains = vec!["127.0.0.1".into()];
    let app = omni_server::router(cfg.clone(), engine.clone(), mm_tokenizer(true));
    refused(
        &app,
        &chat(vec![image_part(&url)]),
        400,
        p,
        "blocked address",
    )
    .await;
    // Another host than the allowed one.
    let other = format!("http://localhost:{}/cat.png", origin.port());
    refused(
        &app,
        &chat(vec![image_part(&other)]),
        400,
        p,
        "allowed domains",
    )
    .await;
    // 1000 images: refused on the count, before any fetch.
    cfg.media.media_egress_block_private = false;
    let app = omni_server::router(cfg, engine.clone(), mm_tokenizer(true));
    let many: Vec<Value> = (0..1000).map(|_| image_part(&url)).collect();
    let part = "messages[0].content[999]";
    refused(
        &app,
        &chat(many),
        400,
        part,
        "At most 999 image(s) may be provided in one prompt.",
    )
    .await;
    assert_eq!(origin.hits(), 0, "nothing was fetched");
    no_requests(&engine);
}

#[tokio::test]
async fn a_redirect_to_a_host_not_allowed_is_never_followed() {
    let elsewhere = Origin::start(|_| http_response("200 OK", &[], &png(64, 64))).await;
    let target = format!("http://localhost:{}/cat.png", elsewhere.port());
    let allowed = Origin::start(move |path| match path {
        "/loop" => http_response("302 Found", &[("Location", "/loop")], b""),
        "/missing" => http_response("404 Not Found", &[], b"no"),
        "/stall" => Vec::new(),
        "/huge" => {
            b"HTTP/1.1 200 OK\r\nContent-Length: 2097152\r\nConnection: close\r\n\r\nxx".to_vec()
        }
        _ => http_response("302 Found", &[("Location", target.as_str())], b""),
    })
    .await;
    let mut cfg = mm_config();
    cfg.media.allowed_media_domains = vec!["127.0.0.1".into()];
    cfg.media.media_egress_block_private = false;
    cfg.media.max_media_download_size_mb = 1;
    let engine = Arc::new(FakeEngine::default());
    let app = omni_server::router(cfg.clone(), engine.clone(), mm_tokenizer(true));
    let p = "messages[0].content[0].image_url";
    let at = |path: &str| format!("http://127.0.0.1:{}{path}", allowed.port());
    refused(
        &app,
        &chat(vec![image_part(&at("/r"))]),
        400,
        p,
        "Input URL domain: localhost",
    )
    .await;
    assert_eq!(allowed.hits(), 1);
    assert_eq!(
        elsewhere.hits(),
        0,
        "the redirect target was never contacted"
    );
    // A redirect loop stops after 10 redirects (11 requests).
    refused(
        &app,
        &chat(vec![image_part(&at("/loop"))]),
        400,
        p,
        "more than 10",
    )
    .await;
    assert_eq!(allowed.hits(), 1 + 11);
    // The origin's 4xx and a Content-Length over the cap are vLLM's 422.
    refused(
        &app,
        &chat(vec![image_part(&at("/missing"))]),
        422,
        p,
        "HTTP 404",
    )
    .await;
    refused(
        &app,
        &chat(vec![image_part(&at("/huge"))]),
        422,
        p,
        "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB=1",
    )
    .await;
    // An origin that never answers: the fetch ends at the image timeout.
    let mut slow = cfg.clone();
    slow.media.image_fetch_timeout = 1;
    let app_slow = omni_server::router(slow, engine.clone(), mm_tokenizer(true));
    let t0 = std::time::Instant::now();
    refused(
        &app_slow,
        &chat(vec![image_part(&at("/stall"))]),
        400,
        p,
        "timed out",
    )
    .await;
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(4),
        "{:?}",
        t0.elapsed()
    );
    // Redirects off: the first one is refused.
    cfg.media.media_url_allow_redirects = false;
    let app = omni_server::router(cfg, engine.clone(), mm_tokenizer(true));
    refused(
        &app,
        &chat(vec![image_part(&at("/loop"))]),
        400,
        p,
        "redirects are off",
    )
    .await;
    assert_eq!(elsewhere.hits(), 0);
    no_requests(&engine);
}

#[tokio::test]
async fn file_urls_are_read_only_inside_the_allowed_path() {
    let base = std::env::temp_dir().join(format!("omni-media-test-{}", std::process::id()));
    let (root, outside) = (base.join("allowed"), base.join("outside"));
    std::fs::create_dir_all(&root).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(root.join("cat.png"), png(64, 64)).unwrap();
    std::fs::write(
        root.join("song.mp3"),
        b"not an mp3 at all, just text".repeat(10),
    )
    .unwrap();
    std::fs::write(outside.join("secret.png"), png(64, 64)).unwrap();
    std::os::unix::fs::symlink(outside.join("secret.png"), root.join("link.png")).unwrap();
    let url = |p: &std::path::Path| format!("file://{}", p.display());
    let engine = Arc::new(FakeEngine::default());
    let p = "messages[0].content[0].image_url";
    // No --allowed-local-media-path: every file URL is refused.
    let app = app(engine.clone(), mm_config());
    let inside = url(&root.join("cat.png"));
    refused(
        &app,
        &chat(vec![image_part(&inside)]),
        400,
        p,
        "allowed-local-media-path",
    )
    .await;
    let mut cfg = mm_config();
    cfg.media.allowed_local_media_path = Some(root.clone());
    let app = omni_server::router(cfg, engine.clone(), mm_tokenizer(true));
    for bad in [
        url(&outside.join("secret.png")),
        format!("file://{}/../outside/secret.png", root.display()),
        url(&root.join("link.png")),
        url(&root.join("absent.png")),
        url(&root),
    ] {
        refused(
            &app,
            &chat(vec![image_part(&bad)]),
            400,
            p,
            "must be a file under",
        )
        .await;
    }
    let song = json!({"type": "audio_url", "audio_url": {"url": url(&root.join("song.mp3"))}});
    refused(
        &app,
        &chat(vec![song]),
        400,
        "messages[0].content[0].audio_url",
        "audio",
    )
    .await;
    no_requests(&engine);
    let (status, v, _) = call(
        &app,
        "POST",
        CHAT,
        Some(&chat(vec![image_part(&inside)])),
        &[],
    )
    .await;
    assert_eq!(status, 200, "{v}");
    std::fs::remove_dir_all(&base).unwrap();
}

/// The pad runs of `ids`: (token, start, length).
fn runs(ids: &[u32], pads: &[u32]) -> Vec<(u32, u32, u32)> {
    let mut out: Vec<(u32, u32, u32)> = Vec::new();
    for (k, &t) in ids.iter().enumerate() {
        if !pads.contains(&t) {
            continue;
        }
        match out.last_mut() {
            Some((tok, start, len)) if *tok == t && *start + *len == k as u32 => *len += 1,
            _ => out.push((t, k as u32, 1)),
        }
    }
    out
}

#[tokio::test]
async fn a_png_and_a_wav_reach_the_engine_with_expanded_placeholders() {
    let image = format!("data:image/png;base64,{}", b64(&png(64, 64)));
    let other = format!("data:image/png;base64,{}", b64(&png(96, 64)));
    let clip = wav(
        16_000,
        &(0..16_000)
            .map(|i| ((i % 80) * 300) as i16)
            .collect::<Vec<_>>(),
    );
    for parts_template in [true, false] {
        let engine = Arc::new(FakeEngine::default());
        let app = omni_server::router(mm_config(), engine.clone(), mm_tokenizer(parts_template));
        let body = chat(vec![
            json!({"type": "text", "text": "Describe"}),
            json!({"type": "image_url", "image_url": {"url": image, "detail": "high"}}),
            audio_part("wav", &clip),
            image_part(&other),
            image_part(&image),
        ]);
        let (status, v, _) = call(&app, "POST", CHAT, Some(&body), &[]).await;
        assert_eq!(status, 200, "{v}");
        let reqs = engine.requests.lock().unwrap();
        let req = &reqs[0];
        // 64x64: a 4x4 patch grid, 4 tokens; 96x64: 6x4, 6; 1 s of audio: 100 frames, 13.
        let got = runs(
            &req.prompt_token_ids,
            &[media_common::IMAGE_PAD, media_common::AUDIO_PAD],
        );
        let lens: Vec<u32> = got.iter().map(|r| r.2).collect();
        assert_eq!(
            lens,
            [4, 13, 6, 4],
            "in part order (parts template: {parts_template})"
        );
        let ph = &req.mm_placeholders;
        assert_eq!(ph.len(), 4);
        for (r, p) in got.iter().zip(ph) {
            assert_eq!((r.1, r.2), (p.offset, p.length));
        }
        assert_eq!(
            ph[0].mm_hash, ph[3].mm_hash,
            "the same image, the same hash"
        );
        assert_ne!(ph[0].mm_hash, ph[2].mm_hash);
        assert_ne!(ph[0].mm_hash, ph[1].mm_hash);
    }
}

#[tokio::test]
async fn http_media_from_an_allowed_origin_is_fetched_once() {
    let origin =
        Origin::start(|_| http_response("200 OK", &[("Content-Type", "image/png")], &png(64, 64)))
            .await;
    let mut cfg = mm_config();
    cfg.media.allowed_media_domains = vec!["127.0.0.1".into()];
    cfg.media.media_egress_block_private = false;
    let engine = Arc::new(FakeEngine::default());
    let app = omni_server::router(cfg, engine.clone(), mm_tokenizer(true));
    let url = format!("http://127.0.0.1:{}/cat.png", origin.port());
    let (status, v, _) = call(&app, "POST", CHAT, Some(&chat(vec![image_part(&url)])), &[]).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(origin.hits(), 1);
    // /tokenize counts the placeholder as the image's 4 tokens, as the chat completion does.
    let tok = json!({"messages": [{"role": "user", "content": [image_part(&url)]}]}).to_string();
    let (status, v, _) = call(&app, "POST", "/tokenize", Some(&tok), &[]).await;
    assert_eq!(status, 200, "{v}");
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
    assert_eq!(
        ids.iter()
            .filter(|&&t| t == media_common::IMAGE_PAD)
            .count(),
        4
    );
    let reqs = engine.requests.lock().unwrap();
    assert_eq!(reqs[0].prompt_token_ids, ids, "the same prompt");
}
