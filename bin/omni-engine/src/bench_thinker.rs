//! `omni-engine bench thinker`: the Qwen3-Omni Thinker's decode on one GPU with and without its
//! hidden-state export (the layer-0 input and the residual stream after `accept_hidden_layer`
//! layers copied out every step, as the Talker needs them), CUDA graphs both ways.

use std::path::PathBuf;

use clap::Args;

/// What `bench thinker` measures.
#[derive(Debug, Args)]
pub struct ThinkerArgs {
    /// A directory with the Qwen3-Omni `config.json` (dummy weights of its shapes are made on
    /// the device), e.g. bench/models/qwen3-omni-30b-a3b.
    #[arg(long)]
    model: PathBuf,
    /// Batch sizes.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 64])]
    batch_sizes: Vec<usize>,
    /// Tokens of context each sequence has before the timed steps.
    #[arg(long, default_value_t = 1024)]
    context: usize,
    /// Timed decode steps per batch size and mode.
    #[arg(long, default_value_t = 64)]
    steps: usize,
    /// Untimed steps before them.
    #[arg(long, default_value_t = 8)]
    warmup: usize,
}

#[cfg(not(feature = "cuda"))]
pub fn run(_a: ThinkerArgs) -> anyhow::Result<()> {
    anyhow::bail!("this omni-engine was built without the CUDA backend (feature `cuda`)")
}

#[cfg(feature = "cuda")]
pub fn run(a: ThinkerArgs) -> anyhow::Result<()> {
    imp::run(a)
}

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::Arc;
    use std::time::Instant;

    use anyhow::Context;
    use omni_backend::cuda::CudaContext;
    use omni_models::cuda_decoder::{CudaDecoderModel, DeviceWeightInit, StepLimits};
    use omni_models::dummy::DummyWeights;
    use omni_models::qwen3_omni::config::OmniConfig;
    use omni_models::registry::decoder_spec;
    use omni_models::{ForwardBatch, SeqChunk};

    use super::ThinkerArgs;

    const BLOCK: usize = 16;
    /// Tokens per prefill step while building the context.
    const PREFILL_CHUNK: usize = 8192;

    pub(super) fn run(a: ThinkerArgs) -> anyhow::Result<()> {
        let info = omni_backend::cuda::driver_status()?;
        let path = a.model.join("config.json");
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?,
        )?;
        let accept = OmniConfig::from_json(&config)?
            .talker_config
            .accept_hidden_layer;
        let spec = decoder_spec(&config)?;
        let vocab = spec.vocab_size as u64;
        let max_b = a.batch_sizes.iter().copied().max().unwrap_or(1);
        let max_len = a.context + a.warmup + a.steps + 1;
        let per_seq = max_len.div_ceil(BLOCK);
        let cx = Arc::new(CudaContext::new(0)?);
        let t0 = Instant::now();
        let mut m = CudaDecoderModel::load(
            cx.clone(),
            spec,
            &DummyWeights::new(Vec::new(), 0),
            DeviceWeightInit::Dummy { seed: 0 },
            0,
            1,
            None,
            StepLimits {
                max_tokens: PREFILL_CHUNK.max(max_b),
                max_seqs: max_b,
                max_model_len: max_len,
                block_size: BLOCK,
            },
            &|_, _| {},
        )?;
        m.init_cache(max_b * per_seq, BLOCK)?;
        eprintln!(
            "bench thinker: loaded in {:.1} s on {}",
            t0.elapsed().as_secs_f64(),
            info.name
        );
        let mut sizes: Vec<usize> = vec![1, 2, 4, 8];
        sizes.extend((16..=max_b).step_by(16));
        sizes.extend(a.batch_sizes.iter().copied());
        sizes.sort_unstable();
        sizes.dedup();
        let mut rows = Vec::new();
        for export in [false, true] {
            m.clear_decode_graphs();
            m.set_capture_after_layers(export.then_some(accept))?;
            m.capture_decode_graphs(&sizes)?;
            for &b in &a.batch_sizes {
                let tok_s = measure(&mut m, &cx, &a, b, per_seq, vocab, export)?;
                eprintln!("bench thinker: B={b} export={export}: {tok_s:.1} tok/s");
                rows.push((b, export, tok_s));
            }
        }
        println!(
            "Thinker decode on {} ({}; {} tokens of context; {} timed steps after {} warm-up; graphs)",
            info.name,
            a.model.display(),
            a.context,
            a.steps,
            a.warmup
        );
        println!("| batch | export | tok/s | with/without |");
        println!("|---:|---|---:|---:|");
        for &(b, export, tok_s) in &rows {
            let base = rows
                .iter()
                .find(|r| r.0 == b && !r.1)
                .map_or(f64::NAN, |r| r.2);
            let what = if export {
                format!("layer 0 + after {accept} layers")
            } else {
                "off".to_string()
            };
            println!("| {b} | {what} | {tok_s:.1} | {:.3} |", tok_s / base);
        }
        Ok(())
    }

    fn ids(n: usize, vocab: u64, z: &mut u64) -> Vec<u32> {
        (0..n)
            .map(|_| {
                *z = z
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((*z >> 33) % vocab) as u32
            })
            .collect()
    }

    /// Builds `b` sequences of `a.context` tokens, then times decode steps (each synchronized,
    /// with the exports copied to the host when `export`).
    fn measure(
        m: &mut CudaDecoderModel,
        cx: &CudaContext,
        a: &ThinkerArgs,
        b: usize,
        per_seq: usize,
        vocab: u64,
        export: bool,
    ) -> anyhow::Result<f64> {
        let tables: Vec<Vec<u32>> = (0..b)
            .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
            .collect();
        let mut z = 7u64;
        let per_step = (PREFILL_CHUNK / a.context.max(1)).max(1);
        for group in tables.chunks(per_step) {
            let prompts: Vec<Vec<u32>> = group
                .iter()
                .map(|_| ids(a.context, vocab, &mut z))
                .collect();
            let chunks: Vec<SeqChunk<'_>> = group
                .iter()
                .zip(&prompts)
                .map(|(t, p)| SeqChunk {
                    tokens: p,
                    start_pos: 0,
                    block_table: t,
                })
                .collect();
            m.forward(&ForwardBatch::from_chunks(&chunks, BLOCK)?)?;
        }
        let mut timed = 0.0;
        for step in 0..a.warmup + a.steps {
            let toks = ids(b, vocab, &mut z);
            let one: Vec<[u32; 1]> = toks.iter().map(|&t| [t]).collect();
            let chunks: Vec<SeqChunk<'_>> = tables
                .iter()
                .zip(&one)
                .map(|(t, tok)| SeqChunk {
                    tokens: tok,
                    start_pos: a.context + step,
                    block_table: t,
                })
                .collect();
            let batch = ForwardBatch::from_chunks(&chunks, BLOCK)?;
            let t = Instant::now();
            m.forward(&batch)?;
            if export {
                let (embed, after) = m.captured_to_host()?;
                anyhow::ensure!(after.is_some_and(|x| x.len() == embed.len()));
            } else {
                cx.stream().synchronize()?;
            }
            if step >= a.warmup {
                timed += t.elapsed().as_secs_f64();
            }
        }
        Ok((b * a.steps) as f64 / timed)
    }
}
