//! Media in chat content parts, inline (data URLs, `input_audio`): hostile and malformed media
//! get an OpenAI-shaped 4xx naming the part, the server keeps serving and nothing reaches the
//! engine; a PNG and a WAV reach the engine with their placeholders expanded.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod media_common;

use std::sync::Arc;

use common::{FakeEngine, call};
use media_common::{
    CHAT, app, audio_part, b64, chat, image_part, mm_config, mm_tokenizer, no_requests, png,
    png_header, refused, wav, wav_claiming,
};
use omni_server::ServerConfig;
use serde_json::json;

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
        let ph = &req.mm_features;
        assert_eq!(ph.len(), 4);
        for (r, p) in got.iter().zip(ph) {
            assert_eq!((r.1, r.2), (p.offset, p.length));
            // The tensor rides the request: its buffer has the bytes its shape makes.
            let b = req.mm_buffers.get(p.tensor.buffer_index as usize).unwrap();
            assert_eq!(b.len() as u64, p.tensor.num_bytes());
        }
        assert!(matches!(
            ph[0].kind,
            omni_protocol::MmKind::Image {
                grid_thw: [1, 4, 4]
            }
        ));
        assert!(matches!(
            ph[1].kind,
            omni_protocol::MmKind::Audio { num_frames: 100 }
        ));
        assert_eq!(
            ph[0].mm_hash, ph[3].mm_hash,
            "the same image, the same hash"
        );
        assert_ne!(ph[0].mm_hash, ph[2].mm_hash);
        assert_ne!(ph[0].mm_hash, ph[1].mm_hash);
    }
}

/// The value of counter `name` (`vllm:..._total`) in a `/metrics` text.
fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name) && !l.starts_with('#'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in {text}"))
}

#[tokio::test]
async fn a_repeated_image_comes_from_the_processor_cache_and_gives_the_same_item() {
    let image = format!("data:image/png;base64,{}", b64(&png(64, 64)));
    let other = format!("data:image/png;base64,{}", b64(&png(96, 64)));
    for gib in [4.0, 0.0] {
        let engine = Arc::new(FakeEngine::default());
        let mut config = mm_config();
        config.media.mm_processor_cache_gb = gib;
        let app = omni_server::router(config, engine.clone(), mm_tokenizer(true));
        // The same image twice in one request, then again in a second request.
        let first = chat(vec![
            image_part(&image),
            image_part(&other),
            image_part(&image),
        ]);
        let second = chat(vec![image_part(&image)]);
        for body in [&first, &second] {
            let (status, v, _) = call(&app, "POST", CHAT, Some(body), &[]).await;
            assert_eq!(status, 200, "{v}");
        }
        let (_, _, text) = call(&app, "GET", "/metrics", None, &[]).await;
        let queries = counter(&text, "vllm:mm_cache_queries_total");
        let hits = counter(&text, "vllm:mm_cache_hits_total");
        let reqs = engine.requests.lock().unwrap();
        let (a, b) = (&reqs[0], &reqs[1]);
        // Cached or not, the items are the same: hash, kind and tensor bytes.
        let bytes = |r: &omni_protocol::EngineCoreRequest, i: usize| {
            let f = &r.mm_features[i];
            r.mm_buffers
                .get(f.tensor.buffer_index as usize)
                .unwrap()
                .clone()
        };
        assert_eq!(a.mm_features[0].mm_hash, a.mm_features[2].mm_hash);
        assert_eq!(a.mm_features[0].mm_hash, b.mm_features[0].mm_hash);
        assert_ne!(a.mm_features[0].mm_hash, a.mm_features[1].mm_hash);
        assert_eq!(bytes(a, 0), bytes(b, 0));
        assert_eq!(bytes(a, 0), bytes(a, 2));
        if gib > 0.0 {
            // Four items looked up; the second request's image is a hit, and the first
            // request's repeat is one unless both copies were preprocessed at once.
            assert_eq!(queries, 4.0, "{text}");
            assert!((1.0..=2.0).contains(&hits), "hits {hits}");
        } else {
            assert_eq!((queries, hits), (0.0, 0.0), "no cache, no lookups");
        }
    }
}
