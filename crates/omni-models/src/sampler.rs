//! Sampling from logits: greedy, temperature, top-k, top-p, min-p, penalties, logprobs.
