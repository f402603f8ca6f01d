//! `expand_placeholders` and `mrope_positions` against transformers: the expanded ids built with
//! the processor's rules (its own `replace_video_with_audio_token` for audio in video) and the
//! positions and delta from `get_rope_index`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{golden, u32s};
use omni_mm::{MmItem, MmPromptConfig, expand_placeholders, mrope_positions};

fn items(v: &serde_json::Value) -> Vec<MmItem> {
    let grid = |g: &serde_json::Value| -> [u32; 3] { u32s(g).try_into().unwrap() };
    v.as_array()
        .unwrap()
        .iter()
        .map(|it| {
            if let Some(x) = it.get("image") {
                MmItem::Image {
                    grid_thw: grid(&x["grid_thw"]),
                }
            } else if let Some(x) = it.get("audio") {
                MmItem::Audio {
                    num_frames: x["num_frames"].as_u64().unwrap() as usize,
                }
            } else if let Some(x) = it.get("video") {
                MmItem::Video {
                    grid_thw: grid(&x["grid_thw"]),
                    second_per_grid: x["second_per_grid"].as_f64().unwrap() as f32,
                }
            } else {
                let x = &it["video_with_audio"];
                MmItem::VideoWithAudio {
                    grid_thw: grid(&x["grid_thw"]),
                    second_per_grid: x["second_per_grid"].as_f64().unwrap() as f32,
                    audio_frames: x["audio_frames"].as_u64().unwrap() as usize,
                }
            }
        })
        .collect()
}

fn i64s(v: &serde_json::Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

#[test]
fn thinker_config_ids_are_read() {
    let g = golden();
    let cfg = MmPromptConfig::from_thinker_config(
        &serde_json::json!({ "thinker_config": g["ids"].clone() }),
    )
    .unwrap();
    assert_eq!(cfg, MmPromptConfig::QWEN3_OMNI);
}

#[test]
fn expansion_and_positions_match_transformers() {
    let g = golden();
    let cfg = MmPromptConfig::QWEN3_OMNI;
    let cases = g["mrope"].as_array().unwrap();
    assert!(cases.len() >= 6);
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let items = items(&c["items"]);
        let ids = u32s(&c["ids"]);
        let expanded = expand_placeholders(&u32s(&c["unexpanded_ids"]), &items, &cfg).unwrap();
        assert_eq!(expanded.ids, ids, "{name}: expanded ids");
        for (r, it) in expanded.ranges.iter().zip(&items) {
            assert_eq!(r.length, it.num_tokens(2), "{name}");
            let pads = &expanded.ids[r.offset..r.offset + r.length];
            assert!(pads.iter().all(|&t| {
                [cfg.image_token_id, cfg.audio_token_id, cfg.video_token_id].contains(&t)
            }));
        }
        let (rows, delta) = mrope_positions(&ids, &items, &cfg).unwrap();
        assert_eq!(rows.t, i64s(&c["t"]), "{name}: t");
        assert_eq!(rows.h, i64s(&c["h"]), "{name}: h");
        assert_eq!(rows.w, i64s(&c["w"]), "{name}: w");
        assert_eq!(delta, c["delta"].as_i64().unwrap(), "{name}: delta");
    }
}

#[test]
fn mismatched_items_are_errors() {
    let cfg = MmPromptConfig::QWEN3_OMNI;
    let ids = [
        1,
        cfg.vision_start_token_id,
        cfg.image_token_id,
        cfg.vision_end_token_id,
    ];
    assert!(expand_placeholders(&ids, &[], &cfg).is_err());
    assert!(expand_placeholders(&ids, &[MmItem::Audio { num_frames: 100 }], &cfg).is_err());
    let img = MmItem::Image {
        grid_thw: [1, 4, 4],
    };
    assert!(expand_placeholders(&ids, &[img.clone(), img.clone()], &cfg).is_err());
    // Positions need the expanded prompt: one pad where four are expected is an error.
    assert!(mrope_positions(&ids, &[img], &cfg).is_err());
}
