//! Qwen3-Omni's M-RoPE positions for an expanded prompt (transformers' `get_rope_index`).
//!
//! Text advances all three rows by one per token. Each item starts at `st = (max of the previous
//! chunk) + 1`: its start marker(s) get 1-D positions, audio pads get `st + j` in all rows, image
//! and video pads get `(st + t_k, st + y, st + x)` over the merged grid (t-major), with
//! `t_k = k * second_per_grid * position_id_per_seconds` for video and 0 for an image; the end
//! marker(s) continue from the last chunk's max. A video with audio interleaves its video and audio
//! pads by time (ties: video first), as the processor ordered them. Non-integer video times are
//! truncated to integers (transformers keeps them as floats; every Qwen3-Omni default, fps 1 or 2,
//! gives integers). The decode delta is `max(positions) + 1 - len(ids)`.

use crate::error::ProcessError;
use crate::mel::audio_output_tokens;
use crate::prompt::{MmItem, MmPromptConfig, interleave_video_audio};

/// The three position rows (temporal, height, width), one entry per prompt token.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MropeRows {
    /// Temporal row.
    pub t: Vec<i64>,
    /// Height row.
    pub h: Vec<i64>,
    /// Width row.
    pub w: Vec<i64>,
}

impl MropeRows {
    fn push(&mut self, t: i64, h: i64, w: i64) {
        self.t.push(t);
        self.h.push(h);
        self.w.push(w);
    }

    /// `n` 1-D positions from `start`; returns the chunk's max.
    fn push_text(&mut self, start: i64, n: usize) -> i64 {
        for i in 0..n as i64 {
            self.push(start + i, start + i, start + i);
        }
        start + n as i64 - 1
    }

    /// Number of positions.
    pub fn len(&self) -> usize {
        self.t.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.t.is_empty()
    }
}

/// Vision positions of one grid as `(t_time, h, w)` offsets from the chunk start, t-major.
fn vision_offsets(grid_thw: [u32; 3], t_step: f32, merge: u32) -> Vec<(f32, i64, i64)> {
    let (gh, gw) = (
        i64::from(grid_thw[1] / merge),
        i64::from(grid_thw[2] / merge),
    );
    let mut v = Vec::with_capacity(grid_thw[0] as usize * (gh * gw) as usize);
    for k in 0..grid_thw[0] {
        let t = k as f32 * t_step;
        for y in 0..gh {
            for x in 0..gw {
                v.push((t, y, x));
            }
        }
    }
    v
}

fn mismatch(msg: String) -> ProcessError {
    ProcessError::Placeholders(msg)
}

/// Checks `ids[at..at + n]` are all `pad` (or, with `order`, the interleaved video/audio pads).
fn expect_pads(
    ids: &[u32],
    at: usize,
    n: usize,
    pad: impl Fn(usize) -> u32,
) -> Result<(), ProcessError> {
    let ok = ids.len() >= at + n && (0..n).all(|i| ids[at + i] == pad(i));
    if ok {
        Ok(())
    } else {
        Err(mismatch(format!("expected {n} pad tokens at {at}")))
    }
}

/// The M-RoPE positions of an expanded prompt (see the module doc) and its decode delta.
/// `items` are in prompt order, as for [`crate::expand_placeholders`].
pub fn mrope_positions(
    ids: &[u32],
    items: &[MmItem],
    cfg: &MmPromptConfig,
) -> Result<(MropeRows, i64), ProcessError> {
    let merge = cfg.spatial_merge_size;
    let mut rows = MropeRows::default();
    let mut st = 0usize; // next token index
    let mut last_max = -1i64; // max of the last chunk pushed
    for (n, item) in items.iter().enumerate() {
        let marker = match item {
            MmItem::Audio { .. } => cfg.audio_start_token_id,
            _ => cfg.vision_start_token_id,
        };
        let at = ids[st..]
            .iter()
            .position(|&id| id == marker)
            .map(|p| p + st)
            .ok_or_else(|| mismatch(format!("no start marker for item {n}")))?;
        let mut pos = last_max + 1;
        if at > st {
            last_max = rows.push_text(pos, at - st);
            pos = last_max + 1;
        }
        let (bos, eos) = if matches!(item, MmItem::VideoWithAudio { .. }) {
            (2, 2)
        } else {
            (1, 1)
        };
        if bos == 2 && ids.get(at + 1) != Some(&cfg.audio_start_token_id) {
            return Err(mismatch(format!(
                "item {n}: a video with audio starts with vision_start, audio_start"
            )));
        }
        last_max = rows.push_text(pos, bos);
        pos = last_max + 1;
        let body = at + bos;
        let len = match *item {
            MmItem::Audio { num_frames } => {
                let k = audio_output_tokens(num_frames);
                expect_pads(ids, body, k, |_| cfg.audio_token_id)?;
                last_max = rows.push_text(pos, k);
                k
            }
            MmItem::Image { grid_thw } | MmItem::Video { grid_thw, .. } => {
                let (pad, step) = match *item {
                    MmItem::Video {
                        second_per_grid, ..
                    } => (
                        cfg.video_token_id,
                        second_per_grid * cfg.position_id_per_seconds,
                    ),
                    _ => (cfg.image_token_id, cfg.position_id_per_seconds),
                };
                let offs = vision_offsets(grid_thw, step, merge);
                expect_pads(ids, body, offs.len(), |_| pad)?;
                let mut max = i64::MIN;
                for &(t, y, x) in &offs {
                    let t = pos + t as i64;
                    rows.push(t, pos + y, pos + x);
                    max = max.max(t).max(pos + y).max(pos + x);
                }
                if !offs.is_empty() {
                    last_max = max;
                }
                offs.len()
            }
            MmItem::VideoWithAudio {
                grid_thw,
                second_per_grid,
                audio_frames,
            } => {
                let k = audio_output_tokens(audio_frames);
                let step = second_per_grid * cfg.position_id_per_seconds;
                let order = interleave_video_audio(grid_thw, second_per_grid, k, cfg);
                expect_pads(ids, body, order.len(), |i| {
                    if order[i] {
                        cfg.video_token_id
                    } else {
                        cfg.audio_token_id
                    }
                })?;
                let offs = vision_offsets(grid_thw, step, merge);
                let (mut v, mut a) = (0usize, 0i64);
                // transformers takes the max of the last run appended (video or audio).
                let mut run_max = i64::MIN;
                let mut prev: Option<bool> = None;
                for &is_video in &order {
                    if prev != Some(is_video) {
                        run_max = i64::MIN;
                        prev = Some(is_video);
                    }
                    if is_video {
                        let (t, y, x) = offs[v];
                        let t = pos + t as i64;
                        rows.push(t, pos + y, pos + x);
                        run_max = run_max.max(t).max(pos + y).max(pos + x);
                        v += 1;
                    } else {
                        rows.push(pos + a, pos + a, pos + a);
                        run_max = run_max.max(pos + a);
                        a += 1;
                    }
                }
                if !order.is_empty() {
                    last_max = run_max;
                }
                order.len()
            }
        };
        let end = body + len;
        let eos_ok = if eos == 2 {
            ids.get(end) == Some(&cfg.audio_end_token_id)
                && ids.get(end + 1) == Some(&cfg.vision_end_token_id)
        } else {
            ids.get(end).is_some()
        };
        if !eos_ok {
            return Err(mismatch(format!("item {n}: no end marker at {end}")));
        }
        last_max = rows.push_text(last_max + 1, eos);
        st = end + eos;
    }
    if st < ids.len() {
        rows.push_text(last_max + 1, ids.len() - st);
    }
    let max = rows
        .t
        .iter()
        .chain(&rows.h)
        .chain(&rows.w)
        .copied()
        .max()
        .unwrap_or(-1);
    Ok((rows, max + 1 - ids.len() as i64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_only_is_sequential_with_zero_delta() {
        let (rows, delta) =
            mrope_positions(&[1, 2, 3], &[], &MmPromptConfig::QWEN3_OMNI).unwrap_or_default();
        assert_eq!(rows.t, vec![0, 1, 2]);
        assert_eq!(rows.w, rows.t);
        assert_eq!(delta, 0);
    }

    #[test]
    fn image_1280x720_after_bos_at_p() {
        // The design note's worked check: BOS at p, t = p+1, h in p+1..=p+22, w in p+1..=p+40.
        let c = MmPromptConfig::QWEN3_OMNI;
        let grid = [1, 44, 80];
        let mut ids = vec![7u32; 5];
        ids.push(c.vision_start_token_id);
        ids.extend(std::iter::repeat_n(c.image_token_id, 880));
        ids.push(c.vision_end_token_id);
        let (rows, delta) =
            mrope_positions(&ids, &[MmItem::Image { grid_thw: grid }], &c).unwrap_or_default();
        let p = 5;
        assert_eq!(rows.t[p + 1], p as i64 + 1);
        assert_eq!(rows.h[p + 880], p as i64 + 22);
        assert_eq!(rows.w[p + 880], p as i64 + 40);
        assert_eq!(rows.t[p + 881], p as i64 + 41);
        assert_eq!(delta, (p as i64 + 42) - ids.len() as i64);
    }
}
