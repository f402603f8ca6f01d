//! Talker frames into Code2Wav windows, in async-chunk mode (vLLM-Omni's
//! `talker2code2wav_async_chunk`, omni.md 6.2).
//!
//! With `initial` = 4, `chunk` = 25, `left_context` = 25 (the default profile's connector):
//! the first window is frames 0..4 (the first audio packet, `1920 * 4 - 555` samples), the
//! second frames 0..29 (25 new, the first 4 as context), then every 25 new frames with the 25
//! before them as context; when the request finishes, whatever is pending goes out at once. Each
//! window is decoded whole and trimmed to its new frames' samples (Code2Wav's
//! `decode_window`), so the windows' audio joins without gaps and totals `1920 * T - 555`.

/// One Code2Wav window of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodecWindow {
    /// Codebook-major codes `[groups, num_frames]` (what Code2Wav reads).
    pub codes: Vec<u32>,
    /// Frames in the window (context + new).
    pub num_frames: usize,
    /// Leading frames that are context only (their audio went out with an earlier window).
    pub left_context: usize,
    /// Index of the window's first frame in the request.
    pub first_frame: usize,
    /// The request's last window.
    pub finished: bool,
}

impl CodecWindow {
    /// Frames whose audio this window adds.
    pub fn new_frames(&self) -> usize {
        self.num_frames - self.left_context
    }
}

/// One request's frames, cut into windows as they arrive.
#[derive(Debug, Clone)]
pub struct CodecChunker {
    groups: usize,
    initial: usize,
    chunk: usize,
    left_context: usize,
    /// Frame-major codes `[frames, groups]`.
    frames: Vec<u32>,
    /// Frames whose audio has gone out.
    emitted: usize,
    windows: usize,
    done: bool,
}

impl CodecChunker {
    /// A chunker for frames of `groups` codes (`initial`, `chunk` and `left_context` in frames;
    /// `initial` and `chunk` at least 1).
    pub fn new(groups: usize, initial: usize, chunk: usize, left_context: usize) -> Self {
        Self {
            groups,
            initial: initial.max(1),
            chunk: chunk.max(1),
            left_context,
            frames: Vec::new(),
            emitted: 0,
            windows: 0,
            done: false,
        }
    }

    /// Frames received so far.
    pub fn num_frames(&self) -> usize {
        self.frames.len() / self.groups.max(1)
    }

    /// Adds one frame (`groups` codes); returns the window it completes, if any.
    pub fn push(&mut self, frame: &[u32]) -> Option<CodecWindow> {
        if self.done || frame.len() != self.groups {
            return None;
        }
        self.frames.extend_from_slice(frame);
        let pending = self.num_frames() - self.emitted;
        let size = if self.windows == 0 {
            self.initial
        } else {
            self.chunk
        };
        (pending >= size).then(|| self.window(false))
    }

    /// The request ended: the pending frames' window, if any frame is pending (`None` when the
    /// last window already went out; the caller then sends the end of the request alone).
    pub fn finish(&mut self) -> Option<CodecWindow> {
        if self.done {
            return None;
        }
        self.done = true;
        (self.num_frames() > self.emitted).then(|| self.window(true))
    }

    fn window(&mut self, finished: bool) -> CodecWindow {
        let n = self.num_frames();
        // The second window keeps the whole first one as context, as vLLM-Omni's does.
        let left = if self.windows == 1 {
            self.emitted
        } else {
            self.emitted.min(self.left_context)
        };
        let first = self.emitted - left;
        let w = n - first;
        let g = self.groups;
        let mut codes = vec![0; g * w];
        for (t, frame) in self.frames[first * g..].chunks_exact(g).enumerate() {
            for (q, &c) in frame.iter().enumerate() {
                codes[q * w + t] = c;
            }
        }
        self.emitted = n;
        self.windows += 1;
        CodecWindow {
            codes,
            num_frames: w,
            left_context: left,
            first_frame: first,
            finished,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn run(frames: usize, groups: usize) -> Vec<CodecWindow> {
        let mut c = CodecChunker::new(groups, 4, 25, 25);
        let mut out = Vec::new();
        for t in 0..frames {
            let frame: Vec<u32> = (0..groups).map(|q| (t * 100 + q) as u32).collect();
            out.extend(c.push(&frame));
        }
        out.extend(c.finish());
        out
    }

    #[test]
    fn windows_follow_vllm_omnis_table() {
        let w = run(60, 2);
        let shape: Vec<(usize, usize, usize, bool)> = w
            .iter()
            .map(|w| (w.first_frame, w.num_frames, w.left_context, w.finished))
            .collect();
        // 0..4 | 0..29 (4 context) | 4..54 (25 context) | 29..60 (25 context, the last 6 new).
        assert_eq!(
            shape,
            [
                (0, 4, 0, false),
                (0, 29, 4, false),
                (4, 50, 25, false),
                (29, 31, 25, true)
            ]
        );
        assert_eq!(w.iter().map(CodecWindow::new_frames).sum::<usize>(), 60);
        // Codebook-major: codebook 1 of frame 4 in window 2 is at row 1, column 0.
        assert_eq!(w[2].codes[w[2].num_frames], 401);
        assert_eq!(w[2].codes[0], 400);
    }

    #[test]
    fn short_requests_and_empty_finishes() {
        let w = run(3, 1);
        assert_eq!(w.len(), 1);
        assert_eq!(
            (w[0].num_frames, w[0].left_context, w[0].finished),
            (3, 0, true)
        );
        assert!(run(0, 1).is_empty());
        // Exactly 29 frames: two windows, and the finish adds nothing.
        let w = run(29, 1);
        assert_eq!(w.len(), 2);
        assert!(!w[1].finished);
        let mut c = CodecChunker::new(2, 4, 25, 25);
        assert!(
            c.push(&[1]).is_none(),
            "a frame of the wrong width is refused"
        );
        assert_eq!(c.num_frames(), 0);
    }
}
