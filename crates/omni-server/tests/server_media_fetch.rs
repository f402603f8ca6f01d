//! Media fetched from URLs: http(s) only from allowed hosts and public addresses (every origin
//! is a 127.0.0.1 listener of the test that counts its connections, so "never fetched" is
//! checked, not assumed), redirects checked hop by hop, timeouts, caps; `file://` only inside
//! the allowed directory.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod media_common;

use std::sync::Arc;

use common::{FakeEngine, call};
use media_common::{
    CHAT, Origin, app, chat, http_response, image_part, mm_config, mm_tokenizer, no_requests, png,
    refused,
};
use serde_json::{Value, json};

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
    // https in a build without TLS: a clear 400, nothing contacted.
    if cfg!(not(feature = "https")) {
        let tls = format!("https://127.0.0.1:{}/cat.png", origin.port());
        refused(
            &app,
            &chat(vec![image_part(&tls)]),
            400,
            p,
            "`https` feature",
        )
        .await;
    }
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
        "/tofile" => http_response("302 Found", &[("Location", "file:///etc/passwd")], b""),
        "/stream" => {
            // No Content-Length: 1.5 MiB until the connection closes.
            let mut r = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n".to_vec();
            r.resize(r.len() + (3 << 19), b'x');
            r
        }
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
    // No Content-Length: counted while streaming.
    let stream = chat(vec![image_part(&at("/stream"))]);
    refused(&app, &stream, 422, p, "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB=1").await;
    // A redirect off http(s).
    let to_file = chat(vec![image_part(&at("/tofile"))]);
    refused(&app, &to_file, 400, p, "must stay on http(s)").await;
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
