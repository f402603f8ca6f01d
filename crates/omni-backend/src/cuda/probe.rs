//! Device ceilings for roofline comparisons (`omni-engine bench latency`): the bandwidth of a
//! device-to-device copy and the rate of a square bf16 GEMM, each timed with CUDA events on the
//! context's stream. Each reports the best of its timed repetitions, after one untimed warm-up.

use cudarc::driver::CudaEvent;
use cudarc::driver::sys::CUevent_flags;

use super::{CudaContext, CudaResult, bf16};

/// Smallest copy [`measure_copy_bandwidth`] times (smaller requests are raised to it).
pub const MIN_PROBE_COPY_BYTES: usize = 1 << 20;

/// Smallest GEMM edge [`measure_gemm_tflops`] times (smaller requests are raised to it).
pub const MIN_PROBE_GEMM_N: usize = 64;

/// An event that records timing (cudarc's default disables it).
fn timing_event(cx: &CudaContext) -> CudaResult<CudaEvent> {
    Ok(cx
        .stream()
        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
}

/// Seconds between two recorded events (waits for the second).
fn elapsed_s(start: &CudaEvent, end: &CudaEvent) -> CudaResult<f64> {
    Ok(f64::from(start.elapsed_ms(end)?) / 1e3)
}

/// Bytes per second of a device-to-device copy (`memcpy_dtod`) of `bytes` bytes, counting
/// every byte both read and written (`2 × bytes` per copy), the way a roofline that streams
/// weights compares against it. Best of `reps` (at least 1) copies; `bytes` is raised to at
/// least [`MIN_PROBE_COPY_BYTES`]. Use a size far above the L2 cache (1 GiB on an H200).
pub fn measure_copy_bandwidth(cx: &CudaContext, bytes: usize, reps: usize) -> CudaResult<f64> {
    let bytes = bytes.max(MIN_PROBE_COPY_BYTES);
    let stream = cx.stream();
    let src = stream.alloc_zeros::<u8>(bytes)?;
    let mut dst = stream.alloc_zeros::<u8>(bytes)?;
    stream.memcpy_dtod(&src, &mut dst)?;
    let mut best = 0f64;
    for _ in 0..reps.max(1) {
        let start = timing_event(cx)?;
        stream.memcpy_dtod(&src, &mut dst)?;
        let end = timing_event(cx)?;
        let s = elapsed_s(&start, &end)?;
        if s > 0.0 {
            best = best.max(2.0 * bytes as f64 / s);
        }
    }
    cx.synchronize()?;
    Ok(best)
}

/// Dense bf16 tensor-core rate in TFLOP/s (1e12 FLOP/s) of [`CudaContext::matmul_nt_bf16`] on
/// `n × n × n` (`2 n³` FLOPs per call) with pseudo-random operands (zeros would draw less power
/// and clock higher). Best of `reps` (at least 1) calls; `n` is raised to at least
/// [`MIN_PROBE_GEMM_N`]. 8192 keeps an H200 busy for about 1.5 ms per call.
pub fn measure_gemm_tflops(cx: &CudaContext, n: usize, reps: usize) -> CudaResult<f64> {
    let n = n.max(MIN_PROBE_GEMM_N);
    let a = cx.upload_bf16(&pseudo_random_bf16(n * n, 1))?;
    let w = cx.upload_bf16(&pseudo_random_bf16(n * n, 2))?;
    let mut out = cx.zeros_bf16(n * n)?;
    cx.matmul_nt_bf16(&a, &w, &mut out, n, n, n)?;
    let flops = 2.0 * (n as f64).powi(3);
    let mut best = 0f64;
    for _ in 0..reps.max(1) {
        let start = timing_event(cx)?;
        cx.matmul_nt_bf16(&a, &w, &mut out, n, n, n)?;
        let end = timing_event(cx)?;
        let s = elapsed_s(&start, &end)?;
        if s > 0.0 {
            best = best.max(flops / s / 1e12);
        }
    }
    cx.synchronize()?;
    Ok(best)
}

/// `len` bf16 values in [-1, 1): a short pseudo-random period repeated (cheap to build for
/// hundreds of millions of elements; a GEMM's speed does not depend on the pattern).
fn pseudo_random_bf16(len: usize, seed: u64) -> Vec<bf16> {
    const PERIOD: usize = 65_521;
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let pattern: Vec<bf16> = (0..PERIOD.min(len))
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            bf16::from_f32(2.0 * u - 1.0)
        })
        .collect();
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        let take = pattern.len().min(len - v.len());
        v.extend_from_slice(&pattern[..take]);
    }
    v
}

/// One size of [`measure_all_reduce`], as nccl-tests reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AllReduceRow {
    /// Bytes reduced per rank (bf16 elements × 2).
    pub bytes: usize,
    /// Mean time of one all-reduce, seconds (rank 0's stream).
    pub seconds: f64,
    /// `bytes / seconds`.
    pub algbw: f64,
    /// `algbw × 2 (n − 1) / n`: what every link must carry, comparable across rank counts.
    pub busbw: f64,
}

/// Times an in-place bf16 sum all-reduce over GPUs `0..gpus` (one thread and one NCCL rank
/// each, as the engine's worker processes use them) for each size in `sizes` (bytes): 5
/// warm-up calls, then `iters` timed calls back to back; the time is rank 0's, between events
/// around the timed calls. Needs `NCCL_NVLS_ENABLE=0` on machines without NVLink multicast
/// (the caller's environment).
pub fn measure_all_reduce(
    gpus: usize,
    sizes: &[usize],
    iters: usize,
) -> Result<Vec<AllReduceRow>, super::NcclError> {
    use super::{NcclComm, NcclError};
    if gpus == 0 {
        return Err(NcclError::InvalidArgument("0 GPUs".into()));
    }
    let id = NcclComm::unique_id()?;
    let iters = iters.max(1);
    let sizes = sizes.to_vec();
    let run = move |rank: usize| -> Result<Vec<AllReduceRow>, NcclError> {
        let cx = CudaContext::new(rank)
            .map_err(|e| NcclError::InvalidArgument(format!("GPU {rank}: {e}")))?;
        let comm = NcclComm::new(&cx, rank, gpus, &id)?;
        let cuda = |e: super::CudaError| NcclError::InvalidArgument(format!("GPU {rank}: {e}"));
        let mut rows = Vec::new();
        for &bytes in &sizes {
            let len = (bytes / 2).max(1);
            let mut buf = cx.zeros_bf16(len).map_err(cuda)?;
            for _ in 0..5 {
                comm.all_reduce_sum_bf16_in_place(&mut buf, len)?;
            }
            let start = timing_event(&cx).map_err(cuda)?;
            for _ in 0..iters {
                comm.all_reduce_sum_bf16_in_place(&mut buf, len)?;
            }
            let end = timing_event(&cx).map_err(cuda)?;
            let seconds = elapsed_s(&start, &end).map_err(cuda)? / iters as f64;
            let algbw = (len * 2) as f64 / seconds;
            rows.push(AllReduceRow {
                bytes: len * 2,
                seconds,
                algbw,
                busbw: algbw * 2.0 * (gpus - 1) as f64 / gpus as f64,
            });
        }
        Ok(rows)
    };
    let handles: Vec<_> = (0..gpus)
        .map(|rank| {
            let run = run.clone();
            std::thread::spawn(move || run(rank))
        })
        .collect();
    let mut rank0 = None;
    let mut first_err = None;
    for (rank, h) in handles.into_iter().enumerate() {
        match h.join() {
            Ok(Ok(rows)) if rank == 0 => rank0 = Some(rows),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(_) => {
                first_err.get_or_insert(NcclError::InvalidArgument(format!(
                    "rank {rank}'s thread panicked"
                )));
            }
        }
    }
    match (first_err, rank0) {
        (Some(e), _) => Err(e),
        (None, Some(rows)) => Ok(rows),
        (None, None) => Err(NcclError::InvalidArgument("rank 0 returned nothing".into())),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn pseudo_random_operands_have_the_length_asked_and_vary() {
        let v = pseudo_random_bf16(200_000, 7);
        assert_eq!(v.len(), 200_000);
        assert!(v.iter().all(|x| x.to_f32().abs() <= 1.0));
        assert!(v[..100].windows(2).any(|p| p[0] != p[1]));
        assert!(pseudo_random_bf16(0, 1).is_empty());
    }

    #[test]
    fn probes_report_positive_rates() {
        let Some(cx) = crate::cuda::tests::ctx_or_skip("probes_report_positive_rates") else {
            return;
        };
        let bw = measure_copy_bandwidth(&cx, 64 << 20, 3).unwrap();
        let tf = measure_gemm_tflops(&cx, 1024, 3).unwrap();
        println!(
            "copy {:.0} GB/s (read+write), GEMM {tf:.1} TFLOP/s",
            bw / 1e9
        );
        assert!(bw > 1e9, "copy bandwidth {bw}");
        assert!(tf > 0.1, "GEMM rate {tf}");
    }
}
