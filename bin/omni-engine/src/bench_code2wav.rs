//! `omni-engine bench code2wav`: Qwen3-Omni's Code2Wav on one GPU
//! (`omni_models::cuda_code2wav`): milliseconds per batch of streaming windows (end to end:
//! codes up, graph replay, waveform down, trim; and the replay alone), the eager time, the
//! TFLOP/s of the convolutions and GEMMs against this device's bf16 GEMM rate, and optionally
//! where the GPU time goes per op.

use std::path::PathBuf;

use clap::Args;

/// What `bench code2wav` measures.
#[derive(Debug, Args)]
pub struct Code2WavArgs {
    /// A directory with the Qwen3-Omni `config.json` (e.g. bench/models/qwen3-omni-30b-a3b).
    #[arg(long)]
    model: PathBuf,
    /// `dummy`: random weights of the config's shapes (fan-in scaled); `safetensors`: the
    /// directory's checkpoint.
    #[arg(long, default_value = "dummy")]
    load_format: String,
    /// Shapes `BATCHxFRAMES` (windows per batch x frames per window, context included).
    #[arg(long, value_delimiter = ',', default_values_t = ["16x50".to_string(), "1x4".to_string(), "1x50".to_string()])]
    shapes: Vec<String>,
    /// Frames of each window that are left context (vLLM-Omni's 25), trimmed from the output.
    #[arg(long, default_value_t = 25)]
    left_context: usize,
    /// Timed decodes per shape.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Per-op GPU time of one eager decode of each shape.
    #[arg(long)]
    profile: bool,
    /// Write every number as JSON to this path.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[cfg(not(feature = "cuda"))]
pub fn run(_a: Code2WavArgs) -> anyhow::Result<()> {
    anyhow::bail!("this omni-engine was built without the CUDA backend (feature `cuda`)")
}

#[cfg(feature = "cuda")]
pub fn run(a: Code2WavArgs) -> anyhow::Result<()> {
    imp::run(a)
}

#[cfg(feature = "cuda")]
mod imp {
    use std::sync::Arc;
    use std::time::Instant;

    use anyhow::Context;

    use omni_backend::cuda::CudaContext;
    use omni_models::cuda_code2wav::CudaCode2Wav;
    use omni_models::dummy::DummyWeights;
    use omni_models::hf_dir::SafetensorsDir;
    use omni_models::qwen3_omni::code2wav::{Code2Wav, FanInScaled};
    use serde_json::json;

    use super::*;

    fn parse_shape(s: &str) -> anyhow::Result<(usize, usize)> {
        let (b, t) = s
            .split_once('x')
            .with_context(|| format!("shape `{s}` is not BATCHxFRAMES"))?;
        Ok((b.trim().parse()?, t.trim().parse()?))
    }

    fn median(v: &mut [f64]) -> f64 {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    }

    /// The device's bf16 GEMM rate (cuBLAS, 8192^3, median of 10), in TFLOP/s.
    fn gemm_rate(cx: &CudaContext) -> anyhow::Result<f64> {
        let n = 8192;
        let mut a = cx.zeros_bf16(n * n)?;
        let mut w = cx.zeros_bf16(n * n)?;
        cx.fill_uniform_bf16(&mut a, 1, -1.0, 1.0)?;
        cx.fill_uniform_bf16(&mut w, 2, -1.0, 1.0)?;
        let mut o = cx.zeros_bf16(n * n)?;
        cx.matmul_nt_bf16(&a, &w, &mut o, n, n, n)?;
        cx.synchronize()?;
        let mut times = Vec::new();
        for _ in 0..10 {
            let t0 = Instant::now();
            cx.matmul_nt_bf16(&a, &w, &mut o, n, n, n)?;
            cx.synchronize()?;
            times.push(t0.elapsed().as_secs_f64());
        }
        Ok(2.0 * (n as f64).powi(3) / median(&mut times) / 1e12)
    }

    pub(super) fn run(a: Code2WavArgs) -> anyhow::Result<()> {
        let config = omni_models::registry::read_config(&a.model)?;
        let shapes: Vec<(usize, usize)> = a
            .shapes
            .iter()
            .map(|s| parse_shape(s))
            .collect::<anyhow::Result<_>>()?;
        let cap = shapes.iter().map(|&(b, t)| b * t).max().unwrap_or(1);
        let cx = Arc::new(CudaContext::new(0)?);
        println!("device: {:?}", cx.info());
        let t0 = Instant::now();
        let mut m = match a.load_format.as_str() {
            "dummy" => {
                let ws = FanInScaled(DummyWeights::new(Code2Wav::weight_shapes(&config)?, 7));
                CudaCode2Wav::load(cx.clone(), &config, &ws, cap)?
            }
            "safetensors" => {
                let ws = SafetensorsDir::open(&a.model)?;
                CudaCode2Wav::load(cx.clone(), &config, &ws, cap)?
            }
            f => anyhow::bail!("unknown --load-format {f} (dummy, safetensors)"),
        };
        println!(
            "loaded in {:.1} s; buffers for {cap} batch-frames: {:.2} GiB",
            t0.elapsed().as_secs_f64(),
            m.buffer_bytes() as f64 / (1u64 << 30) as f64
        );
        let rate = gemm_rate(&cx)?;
        println!("bf16 GEMM rate (cuBLAS 8192^3): {rate:.0} TFLOP/s");
        let c = m.config().clone();
        let nq = c.num_quantizers;
        let mut rows = Vec::new();
        let mut profiles = Vec::new();
        for &(batch, frames) in &shapes {
            // A window no longer than the context is a stream's first (nothing emitted before).
            let left = if frames > a.left_context {
                a.left_context
            } else {
                0
            };
            let mut seed = 0x2545_f491_4f6c_dd1du64 ^ (batch * 1000 + frames) as u64;
            let codes: Vec<Vec<u32>> = (0..batch)
                .map(|_| {
                    (0..nq * frames)
                        .map(|_| {
                            seed = seed
                                .wrapping_mul(6364136223846793005)
                                .wrapping_add(1442695040888963407);
                            ((seed >> 33) % c.codebook_size as u64) as u32
                        })
                        .collect()
                })
                .collect();
            let windows: Vec<(&[u32], usize, usize)> =
                codes.iter().map(|v| (v.as_slice(), frames, left)).collect();
            // Graphs: the first call captures (batch, bucket).
            m.set_graphs(true);
            let tc = Instant::now();
            let out = m.decode_windows(&windows)?;
            let capture_s = tc.elapsed().as_secs_f64();
            let samples: usize = out.iter().map(Vec::len).sum();
            anyhow::ensure!(
                out.iter().flatten().all(|v| v.is_finite()),
                "non-finite samples"
            );
            let mut e2e = Vec::new();
            for _ in 0..a.iters {
                let t = Instant::now();
                m.decode_windows(&windows)?;
                e2e.push(t.elapsed().as_secs_f64() * 1e3);
            }
            let bucket = omni_models::cuda_code2wav::FRAME_BUCKETS
                .iter()
                .copied()
                .find(|&b| b >= frames)
                .unwrap_or(frames);
            let mut replay = Vec::new();
            for _ in 0..a.iters {
                let t = Instant::now();
                anyhow::ensure!(m.replay(batch, bucket)?, "no graph for {batch}x{bucket}");
                m.synchronize()?;
                replay.push(t.elapsed().as_secs_f64() * 1e3);
            }
            m.set_graphs(false);
            m.decode_windows(&windows)?;
            let mut eager = Vec::new();
            for _ in 0..a.iters.min(5) {
                let t = Instant::now();
                m.decode_windows(&windows)?;
                eager.push(t.elapsed().as_secs_f64() * 1e3);
            }
            m.set_graphs(true);
            let (e2e, replay, eager) = (median(&mut e2e), median(&mut replay), median(&mut eager));
            let flops = m.flops(batch, bucket);
            let tflops = flops / (replay * 1e-3) / 1e12;
            let audio_s = samples as f64 / 24_000.0;
            println!(
                "bench code2wav {batch}x{frames} (bucket {bucket}, left {left}): e2e {e2e:.2} ms, replay {replay:.2} ms, eager {eager:.2} ms, {:.1} GFLOP -> {tflops:.1} TFLOP/s ({:.1}% of GEMM), {audio_s:.2} s audio out, RTF {:.4}, capture {capture_s:.2} s",
                flops / 1e9,
                100.0 * tflops / rate,
                e2e * 1e-3 / audio_s.max(1e-9),
            );
            rows.push(json!({
                "batch": batch, "frames": frames, "bucket": bucket, "left_context": left,
                "e2e_ms": e2e, "replay_ms": replay, "eager_ms": eager, "gflop": flops / 1e9,
                "tflops": tflops, "gemm_tflops": rate, "audio_s": audio_s,
                "samples_out": samples, "capture_s": capture_s,
            }));
            if a.profile {
                let ops = m.profile(batch, bucket)?;
                let total: f64 = ops.iter().map(|o| o.ms).sum();
                println!("profile {batch}x{bucket} (eager, GPU time {total:.2} ms):");
                for o in &ops {
                    let tf = if o.flops > 0.0 {
                        format!("{:7.1} TFLOP/s", o.flops / (o.ms * 1e-3) / 1e12)
                    } else {
                        String::new()
                    };
                    println!(
                        "|  {:<52} | {:8.3} ms | {:5.1}% | {tf}",
                        o.label,
                        o.ms,
                        100.0 * o.ms / total
                    );
                }
                profiles.push(json!({
                    "batch": batch, "frames": bucket, "total_ms": total,
                    "ops": ops.iter().map(|o| json!({"op": o.label, "ms": o.ms, "gflop": o.flops / 1e9})).collect::<Vec<_>>(),
                }));
            }
        }
        println!();
        println!(
            "| shape (B x T) | bucket | e2e ms | replay ms | eager ms | GFLOP | TFLOP/s | % GEMM |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for r in &rows {
            println!(
                "| {} x {} | {} | {:.2} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} |",
                r["batch"],
                r["frames"],
                r["bucket"],
                r["e2e_ms"].as_f64().unwrap_or(0.0),
                r["replay_ms"].as_f64().unwrap_or(0.0),
                r["eager_ms"].as_f64().unwrap_or(0.0),
                r["gflop"].as_f64().unwrap_or(0.0),
                r["tflops"].as_f64().unwrap_or(0.0),
                100.0 * r["tflops"].as_f64().unwrap_or(0.0) / rate,
            );
        }
        if let Some(p) = &a.json {
            let v = json!({"device": cx.info().name, "gemm_tflops": rate, "rows": rows, "profiles": profiles});
            std::fs::write(p, serde_json::to_string_pretty(&v)?)
                .with_context(|| format!("writing {}", p.display()))?;
        }
        Ok(())
    }
}
