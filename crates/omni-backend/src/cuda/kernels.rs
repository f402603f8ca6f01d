//! NVRTC kernels: CUDA C++ source compiled at run time to a real-architecture CUBIN (e.g.
//! `sm_90`), cached per process by source hash + architecture.
//!
//! The sources are header-free: NVRTC 13 ships no built-in `cuda_bf16.h`, so bf16 is moved as
//! `unsigned short` and converted with the bit tricks below (round to nearest even), with all
//! arithmetic in f32.

use std::collections::HashMap;
use std::ffi::CString;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{result as nr, sys as ns};

use super::CudaError;

/// bf16 <-> f32 helpers shared by every kernel source.
const BF16_HELPERS: &str = r#"
__device__ __forceinline__ float bf2f(unsigned short x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ unsigned short f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u); // quiet NaN
    u += 0x7FFFu + ((u >> 16) & 1u);   // round to nearest even
    return (unsigned short)(u >> 16);
}
"#;

/// RMSNorm over bf16 rows with f32 accumulation: one block per row, block size a multiple of 32
/// (at most 1024). `y = x / sqrt(mean(x^2) + eps) * w` (Hugging Face `LlamaRMSNorm`).
const RMSNORM_BODY: &str = r#"
extern "C" __global__ void rmsnorm_bf16(const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
                                        unsigned short* __restrict__ y, int hidden, float eps) {
    const unsigned short* xr = x + (size_t)blockIdx.x * hidden;
    unsigned short* yr = y + (size_t)blockIdx.x * hidden;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) { float v = bf2f(xr[i]); ss += v * v; }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    __shared__ float sh[32];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    if (lane == 0) sh[wid] = ss;
    __syncthreads();
    if (wid == 0) {
        ss = (lane < (int)(blockDim.x >> 5)) ? sh[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) sh[0] = ss;
    }
    __syncthreads();
    float inv = rsqrtf(sh[0] / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) yr[i] = f2bf(bf2f(w[i]) * (bf2f(xr[i]) * inv));
}
"#;

/// The RMSNorm kernel's entry point.
pub(crate) const RMSNORM_FN: &str = "rmsnorm_bf16";

/// Full source of the RMSNorm module.
pub(crate) fn rmsnorm_source() -> String {
    format!("{BF16_HELPERS}{RMSNORM_BODY}")
}

type CubinCache = Mutex<HashMap<(u64, String), Arc<Vec<u8>>>>;

fn cache() -> &'static CubinCache {
    static CACHE: OnceLock<CubinCache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

fn source_hash(src: &str) -> u64 {
    let mut h = DefaultHasher::new();
    src.hash(&mut h);
    h.finish()
}

/// Compiles `src` to a CUBIN for `arch` (e.g. `"sm_90"`), or returns the cached one.
pub(crate) fn cubin(src: &str, arch: &str) -> Result<Arc<Vec<u8>>, CudaError> {
    let key = (source_hash(src), arch.to_string());
    if let Some(c) = cache().lock().map_err(|_| CudaError::Poisoned)?.get(&key) {
        return Ok(c.clone());
    }
    // Compile outside the lock: two threads may both compile once, which is harmless.
    let bin = Arc::new(compile_cubin(src, arch)?);
    cache()
        .lock()
        .map_err(|_| CudaError::Poisoned)?
        .insert(key, bin.clone());
    Ok(bin)
}

/// Number of CUBINs in the process-wide cache (for tests).
#[cfg(test)]
pub(crate) fn cached_count() -> usize {
    cache().lock().map(|c| c.len()).unwrap_or(0)
}

fn compile_cubin(src: &str, arch: &str) -> Result<Vec<u8>, CudaError> {
    // SAFETY: querying whether a shared library can be dlopen'ed has no preconditions.
    if !unsafe { ns::is_culib_present() } {
        return Err(CudaError::MissingLibrary("libnvrtc"));
    }
    let csrc = CString::new(src).map_err(|_| CudaError::Nvrtc {
        stage: "source contains a NUL byte",
        log: String::new(),
    })?;
    let prog = nr::create_program(&csrc, None).map_err(|e| CudaError::Nvrtc {
        stage: "nvrtcCreateProgram",
        log: format!("{e:?}"),
    })?;
    let opts = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
    ];
    // SAFETY: `prog` is a live program from nvrtcCreateProgram; destroyed exactly once below.
    let res = unsafe { nr::compile_program(prog, &opts) };
    let out = match res {
        Err(e) => {
            // SAFETY: `prog` is still live; the log is read before it is destroyed.
            let log = unsafe { nr::get_program_log(prog) }.unwrap_or_default();
            let log: String = log
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8 as char)
                .collect();
            Err(CudaError::Nvrtc {
                stage: "nvrtcCompileProgram",
                log: format!("{e:?}: {log}"),
            })
        }
        Ok(()) => read_cubin(prog),
    };
    // SAFETY: `prog` is live and not used after this call.
    let _ = unsafe { nr::destroy_program(prog) };
    out
}

fn read_cubin(prog: ns::nvrtcProgram) -> Result<Vec<u8>, CudaError> {
    let mut size = 0usize;
    // SAFETY: `prog` is a successfully compiled program; `size` is a valid out-pointer.
    unsafe { ns::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .map_err(|e| CudaError::Nvrtc {
            stage: "nvrtcGetCUBINSize",
            log: format!("{e:?}"),
        })?;
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` holds exactly the `size` bytes NVRTC reported for this program's CUBIN.
    unsafe { ns::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| CudaError::Nvrtc {
            stage: "nvrtcGetCUBIN",
            log: format!("{e:?}"),
        })?;
    Ok(buf)
}
