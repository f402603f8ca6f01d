//! CPU speed of a SmolLM2-135M-shaped model with dummy weights (f32), or of a GGUF file's
//! weights (Q4_1 / Q8_0 kept in blocks): one prefill, then batch-1 and batch-8 decode steps
//! through the paged KV cache. No engine around it: the model's own time.
//!
//! `cargo run --release -p omni-models --example cpu_bench [prompt_len] [model.gguf]`

use std::time::Instant;

use omni_models::registry::{build_model, dummy_weights};
use omni_models::{ForwardBatch, ModelError, SeqChunk, TpContext};

fn main() -> Result<(), ModelError> {
    let prompt_len: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(128);
    let config = serde_json::json!({"architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
        "rope_theta": 100000, "tie_word_embeddings": true, "hidden_act": "silu"});
    let t0 = Instant::now();
    let model = match std::env::args().nth(2) {
        Some(path) => {
            let ws = omni_models::gguf::GgufWeights::open(&path)?;
            build_model(&ws.hf_config()?, &ws, TpContext::single())?
        }
        None => build_model(&config, &dummy_weights(&config, 0)?, TpContext::single())?,
    };
    println!("load: {:.2?}", t0.elapsed());
    let block_size = 16;
    let seqs = 8;
    let decode_steps = 32;
    let per_seq_blocks = (prompt_len + decode_steps).div_ceil(block_size);
    let mut kv = model
        .kv_cache_spec()
        .allocate(seqs * per_seq_blocks, block_size);
    let tables: Vec<Vec<u32>> = (0..seqs)
        .map(|s| ((s * per_seq_blocks) as u32..((s + 1) * per_seq_blocks) as u32).collect())
        .collect();
    let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| (i * 37) % 49152).collect();

    // Prefill every sequence (one batch each), timing the first.
    for (s, table) in tables.iter().enumerate() {
        let t = Instant::now();
        let batch = ForwardBatch::from_chunks(
            &[SeqChunk {
                tokens: &prompt,
                start_pos: 0,
                block_table: table,
            }],
            block_size,
        )?;
        model.forward(&batch, &mut kv)?;
        if s == 0 {
            let dt = t.elapsed();
            println!(
                "prefill {prompt_len} tokens: {dt:.2?} ({:.0} tok/s)",
                prompt_len as f64 / dt.as_secs_f64()
            );
        }
    }
    for batch_size in [1, seqs] {
        let token = [7u32];
        let t = Instant::now();
        for step in 0..decode_steps / 2 {
            let pos = prompt_len + step + if batch_size == 1 { 0 } else { decode_steps / 2 };
            let chunks: Vec<SeqChunk<'_>> = tables[..batch_size]
                .iter()
                .map(|table| SeqChunk {
                    tokens: &token,
                    start_pos: pos,
                    block_table: table,
                })
                .collect();
            model.forward(&ForwardBatch::from_chunks(&chunks, block_size)?, &mut kv)?;
        }
        let dt = t.elapsed() / (decode_steps as u32 / 2);
        println!(
            "decode batch {batch_size}: {dt:.2?}/step ({:.1} tok/s)",
            batch_size as f64 / dt.as_secs_f64()
        );
    }
    Ok(())
}
