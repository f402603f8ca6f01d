//! What the Talker's codes are chosen under.
//!
//! - Layer 0 ([`suppress_control_codes`]): the top 1024 ids of the codec vocabulary
//!   (`[vocab - 1024, vocab)`, the control codes) are never chosen, except `codec_eos` (the
//!   stop); transformers' `talker_suppressed_tokens`. [`repetition_penalty`] is transformers'
//!   (and vLLM's) rule over the codes generated so far (HF default 1.05; applied when greedy too).
//! - Groups 1..15 ([`top_k_top_p`]): top-k 50, then top-p 0.8, temperature 1 (transformers'
//!   `code_predictor.generate(top_k=50, top_p=0.8)`); greedy when the Talker is greedy.

pub use omni_backend::ops::talker_uniform;

/// Sets the control codes' logits to `-inf`, all but `eos`.
pub fn suppress_control_codes(logits: &mut [f32], eos: u32) {
    let v = logits.len();
    for (i, l) in logits.iter_mut().enumerate().skip(v.saturating_sub(1024)) {
        if i != eos as usize {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// Divides positive logits and multiplies negative ones by `penalty`, once per distinct code
/// in `history`.
pub fn repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    let mut seen = vec![false; logits.len()];
    for &c in history {
        let Some(l) = logits.get_mut(c as usize) else {
            continue;
        };
        if std::mem::replace(&mut seen[c as usize], true) {
            continue;
        }
        *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
    }
}

/// The index of the largest logit (the lowest index among equals, as `torch.argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Samples from the `k` most likely codes, cut to the smallest set whose probability reaches
/// `p` (the most likely code always stays), with `u` uniform in `[0, 1)`.
pub fn top_k_top_p(logits: &[f32], k: usize, p: f32, u: f32) -> u32 {
    if logits.is_empty() {
        return 0;
    }
    draw_top_p(logits, &top_k_order(logits, k), p, u)
}

/// The `k` (at least 1) largest logits' indices, largest first.
fn top_k_order(logits: &[f32], k: usize) -> Vec<usize> {
    // Largest first, the lower index first among equals: a total order, so selecting the k
    // best in O(n) and sorting only them gives the order a full sort would (a full sort of
    // the 3072 codes made the layer-0 choice ~150 us a row, 10 ms of a 64-row Talker step).
    let by_rank = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let k = k.clamp(1, logits.len());
    let mut order: Vec<usize> = (0..logits.len()).collect();
    if k < order.len() {
        order.select_nth_unstable_by(k - 1, by_rank);
        order.truncate(k);
    }
    order.sort_by(by_rank);
    order
}

/// Draws from the head of `order` (largest first) whose probability reaches `p`.
fn draw_top_p(logits: &[f32], order: &[usize], p: f32, u: f32) -> u32 {
    let max = logits[order[0]];
    let w: Vec<f32> = order.iter().map(|&i| (logits[i] - max).exp()).collect();
    let total: f32 = w.iter().sum();
    let mut kept = 0;
    let mut mass = 0.0;
    for &x in &w {
        kept += 1;
        mass += x / total;
        if mass >= p {
            break;
        }
    }
    let kept_total: f32 = w[..kept].iter().sum();
    let mut target = u * kept_total;
    for (i, &x) in w[..kept].iter().enumerate() {
        if target < x {
            return order[i] as u32;
        }
        target -= x;
    }
    order[kept - 1] as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_codes_are_suppressed_except_eos() {
        let mut l = vec![1.0; 3072];
        suppress_control_codes(&mut l, 2150);
        assert_eq!(l[2047], 1.0);
        assert_eq!(l[2150], 1.0);
        assert!(l[2048].is_infinite() && l[3071].is_infinite());
    }

    #[test]
    fn repetition_penalty_shrinks_seen_codes_once() {
        let mut l = vec![2.0, -2.0, 2.0];
        repetition_penalty(&mut l, &[0, 1, 0], 2.0);
        assert_eq!(l, vec![1.0, -4.0, 2.0]);
    }

    /// The full sort [`top_k_top_p`] replaced.
    fn top_k_by_full_sort(logits: &[f32], k: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        order.truncate(k.max(1));
        order
    }

    #[test]
    fn selection_orders_the_head_as_the_full_sort() {
        // Coarse logits (many ties) with the control codes suppressed, several k.
        let mut state = 0x2545_f491_u64;
        for round in 0..40 {
            let mut l: Vec<f32> = (0..3072)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % 64) as f32 / 8.0
                })
                .collect();
            suppress_control_codes(&mut l, 2150);
            for k in [0, 1, 50, 3071, 3072, 5000] {
                assert_eq!(top_k_order(&l, k), top_k_by_full_sort(&l, k), "{round} {k}");
            }
        }
    }

    #[test]
    fn top_p_keeps_the_head_of_the_distribution() {
        // Probabilities ~ [0.64, 0.24, 0.09, 0.03]: p = 0.8 keeps the first two.
        let l = [3.0, 2.0, 1.0, 0.0];
        let picks: Vec<u32> = (0..100)
            .map(|i| top_k_top_p(&l, 50, 0.8, i as f32 / 100.0))
            .collect();
        assert!(picks.iter().all(|&c| c < 2));
        assert!(picks.contains(&1));
        assert_eq!(top_k_top_p(&l, 1, 1.0, 0.99), 0);
        assert_eq!(argmax(&[0.0, 5.0, 5.0]), 1);
    }
}
