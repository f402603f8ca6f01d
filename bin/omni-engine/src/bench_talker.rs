//! `omni-engine bench talker`: Qwen3-Omni's Talker frames per second on one GPU
//! (`omni_models::cuda_talker`): one Talker decode step + 15 code-predictor steps per frame, all
//! requests of a batch in every network, with CUDA graphs and eagerly.

use std::path::PathBuf;

use clap::Args;

/// What `bench talker` measures.
#[derive(Debug, Args)]
pub struct TalkerArgs {
    /// A directory with the Qwen3-Omni `config.json` (e.g. bench/models/qwen3-omni-30b-a3b).
    #[arg(long)]
    model: PathBuf,
    /// `dummy`: random weights of the config's shapes made on the device; `safetensors`: the
    /// directory's checkpoint.
    #[arg(long, default_value = "dummy")]
    load_format: String,
    /// Batch sizes (requests, one frame each per step).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 16, 32, 64])]
    batch_sizes: Vec<usize>,
    /// Timed steps (frames per request) at each batch size.
    #[arg(long, default_value_t = 64)]
    frames: usize,
    /// Untimed steps before them.
    #[arg(long, default_value_t = 8)]
    warmup: usize,
    /// Prompt positions of each request (the Talker's context before the first frame).
    #[arg(long, default_value_t = 64)]
    prefill_len: usize,
    /// Only eager steps (no CUDA graphs).
    #[arg(long)]
    enforce_eager: bool,
    /// Per-kernel GPU time of eager steps, logged every this many steps of a kind (env
    /// `OMNI_CUDA_PROFILE`); implies eager.
    #[arg(long, env = "OMNI_CUDA_PROFILE")]
    cuda_profile_steps: Option<u64>,
    /// Eager steps (and the profile) with the small-batch GEMVs instead of cuBLAS; graphs are
    /// measured both ways anyway.
    #[arg(long)]
    small_batch_gemv: bool,
    /// Sample (transformers' defaults, seeded) instead of argmax.
    #[arg(long)]
    sample: bool,
    /// Write every number as JSON to this path.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[cfg(not(feature = "cuda"))]
pub fn run(_a: TalkerArgs) -> anyhow::Result<()> {
    anyhow::bail!("this omni-engine was built without the CUDA backend (feature `cuda`)")
}

#[cfg(feature = "cuda")]
pub fn run(a: TalkerArgs) -> anyhow::Result<()> {
    imp::run(a)
}

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::Arc;

    use anyhow::Context;
    use omni_backend::cuda::CudaContext;
    use omni_models::cuda_decoder::{DeviceWeightInit, StepLimits};
    use omni_models::cuda_talker::{CudaTalker, TalkerSampling};
    use omni_models::dummy::DummyWeights;
    use omni_models::hf_dir::SafetensorsDir;
    use omni_models::{ForwardBatch, SeqChunk};

    use super::*;

    const BLOCK: usize = 16;

    /// One measured row of the table.
    struct Row {
        batch: usize,
        mode: &'static str,
        frames_per_s: f64,
        ms_per_step: f64,
        cp_ms: f64,
        talker_ms: f64,
    }

    fn lcg(z: &mut u64) -> f32 {
        *z = z
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((*z >> 40) as f32 / 16_777_216.0 - 0.5) * 0.2
    }

    pub(super) fn run(a: TalkerArgs) -> anyhow::Result<()> {
        let info = omni_backend::cuda::driver_status()?;
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(a.model.join("config.json"))
                .with_context(|| format!("reading {}/config.json", a.model.display()))?,
        )?;
        let max_b = a.batch_sizes.iter().copied().max().unwrap_or(1);
        let max_len = a.prefill_len + a.warmup + a.frames + 2;
        let blocks_per_seq = max_len.div_ceil(BLOCK);
        let limits = StepLimits {
            max_tokens: (max_b * a.prefill_len).max(max_b),
            max_seqs: max_b,
            max_model_len: max_len,
            block_size: BLOCK,
        };
        let cx = Arc::new(CudaContext::new(0)?);
        let t0 = std::time::Instant::now();
        let mut m = match a.load_format.as_str() {
            "dummy" => CudaTalker::load(
                cx.clone(),
                &config,
                // No tensors: the dummy weights are made on the device.
                &DummyWeights::new(Vec::new(), 0),
                DeviceWeightInit::Dummy { seed: 0 },
                limits,
            )?,
            "safetensors" => CudaTalker::load(
                cx.clone(),
                &config,
                &SafetensorsDir::open(&a.model)?,
                DeviceWeightInit::Host,
                limits,
            )?,
            other => anyhow::bail!("--load-format {other}: dummy or safetensors"),
        };
        m.init_cache(max_b * blocks_per_seq, BLOCK)?;
        eprintln!(
            "bench talker: loaded in {:.1} s on {} (batch <= {max_b}, {} prompt positions)",
            t0.elapsed().as_secs_f64(),
            info.name,
            a.prefill_len
        );
        let profile = a.cuda_profile_steps.filter(|&n| n > 0);
        let mut modes: Vec<&'static str> = vec!["eager"];
        if !a.enforce_eager && profile.is_none() {
            modes.extend(["graphs", "graphs+gemv"]);
        }
        m.set_small_batch_gemv(a.small_batch_gemv);
        if let Some(n) = profile {
            m.enable_profiler(n);
        }
        let h = m.hidden_size();
        let mut rows = Vec::new();
        for mode in modes {
            if mode != "eager" {
                m.set_small_batch_gemv(mode == "graphs+gemv");
                let mut sizes = vec![1, 2, 4, 8];
                sizes.extend((16..=max_b).step_by(16));
                sizes.extend(a.batch_sizes.iter().copied());
                sizes.sort_unstable();
                sizes.dedup();
                let t = std::time::Instant::now();
                let got = m.capture_graphs(&sizes)?;
                eprintln!(
                    "bench talker: captured graphs for {got:?} in {:.1} s",
                    t.elapsed().as_secs_f64()
                );
            }
            for &b in &a.batch_sizes {
                rows.push(measure(&mut m, &a, b, h, mode, blocks_per_seq)?);
                let r = rows.last().map_or(0.0, |r: &Row| r.frames_per_s);
                eprintln!("bench talker: B={b} {mode}: {r:.0} frames/s");
            }
        }
        println!(
            "Talker frames/s on {} ({}; prompt {} positions; {} timed steps after {} warm-up; {})",
            info.name,
            a.model.display(),
            a.prefill_len,
            a.frames,
            a.warmup,
            if a.sample { "sampled" } else { "greedy" }
        );
        println!("| batch | mode | frames/s | ms/step | code predictor ms | Talker ms |");
        println!("|---:|---|---:|---:|---:|---:|");
        for r in &rows {
            println!(
                "| {} | {} | {:.0} | {:.3} | {:.3} | {:.3} |",
                r.batch, r.mode, r.frames_per_s, r.ms_per_step, r.cp_ms, r.talker_ms
            );
        }
        if let Some(path) = &a.json {
            let v: Vec<serde_json::Value> = rows
                .iter()
                .map(|r| {
                    serde_json::json!({
                        "batch": r.batch, "mode": r.mode, "frames_per_s": r.frames_per_s,
                        "ms_per_step": r.ms_per_step, "code_predictor_ms": r.cp_ms,
                        "talker_ms": r.talker_ms,
                    })
                })
                .collect();
            let doc = serde_json::json!({
                "device": info.name, "model": a.model.display().to_string(),
                "prefill_len": a.prefill_len, "frames": a.frames, "sample": a.sample, "rows": v,
            });
            std::fs::write(path, serde_json::to_string_pretty(&doc)?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }

    fn measure(
        m: &mut CudaTalker,
        a: &TalkerArgs,
        b: usize,
        h: usize,
        mode: &'static str,
        blocks_per_seq: usize,
    ) -> anyhow::Result<Row> {
        let sampling: Vec<TalkerSampling> = (0..b)
            .map(|r| {
                if a.sample {
                    TalkerSampling::hf_default(r as u64 + 1)
                } else {
                    TalkerSampling::greedy()
                }
            })
            .collect();
        m.start(&sampling)?;
        let tables: Vec<Vec<u32>> = (0..b)
            .map(|r| ((r * blocks_per_seq) as u32..((r + 1) * blocks_per_seq) as u32).collect())
            .collect();
        let mut z = b as u64;
        let prompt: Vec<f32> = (0..b * a.prefill_len * h).map(|_| lcg(&mut z)).collect();
        let text: Vec<f32> = (0..b * h).map(|_| lcg(&mut z)).collect();
        let dummy = vec![0u32; a.prefill_len];
        let chunks: Vec<SeqChunk<'_>> = tables
            .iter()
            .map(|t| SeqChunk {
                tokens: &dummy,
                start_pos: 0,
                block_table: t,
            })
            .collect();
        m.prefill(&ForwardBatch::from_chunks(&chunks, BLOCK)?, &prompt)?;
        let one = [0u32];
        let step_batch = |k: usize| -> anyhow::Result<ForwardBatch> {
            let chunks: Vec<SeqChunk<'_>> = tables
                .iter()
                .map(|t| SeqChunk {
                    tokens: &one,
                    start_pos: a.prefill_len + k,
                    block_table: t,
                })
                .collect();
            Ok(ForwardBatch::from_chunks(&chunks, BLOCK)?)
        };
        let batches: Vec<ForwardBatch> = (0..a.warmup + a.frames)
            .map(step_batch)
            .collect::<anyhow::Result<_>>()?;
        let (mut cp, mut talker) = (0.0f64, 0.0f64);
        for bt in &batches[..a.warmup] {
            m.step(bt, &text)?;
        }
        // One pass with events (where the time goes), one plain pass for the rate.
        for bt in &batches[a.warmup..] {
            if let (_, Some(t)) = m.step_timed(bt, &text, true)? {
                cp += f64::from(t.code_predictor_ms);
                talker += f64::from(t.talker_ms);
            }
        }
        // The timed pass re-runs the same positions (the same KV slots are rewritten).
        let t0 = std::time::Instant::now();
        for bt in &batches[a.warmup..] {
            m.step(bt, &text)?;
        }
        let secs = t0.elapsed().as_secs_f64();
        let n = a.frames.max(1) as f64;
        Ok(Row {
            batch: b,
            mode,
            frames_per_s: (b * a.frames) as f64 / secs,
            ms_per_step: secs * 1e3 / n,
            cp_ms: cp / n,
            talker_ms: talker / n,
        })
    }
}
