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
pub(crate) const BF16_HELPERS: &str = r#"
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

/// RoPE in the Hugging Face `rotate_half` (GPT-NeoX) convention, in place on
/// `[tokens, heads, head_dim]`: one block per (token, head), pairs `(i, i + head_dim / 2)`.
/// `inv_freq = 1 / theta^(2i / head_dim)` and the angle `pos * inv_freq` are computed in f32, as
/// in [`crate::rope::Rope`].
const ROPE_BODY: &str = r#"
extern "C" __global__ void rope_neox_bf16(unsigned short* __restrict__ x, const unsigned int* __restrict__ pos,
                                          int heads, int head_dim, float theta) {
    const int half = head_dim >> 1;
    const unsigned int token = blockIdx.x / (unsigned int)heads;
    unsigned short* h = x + (size_t)blockIdx.x * head_dim;
    const float p = (float)pos[token];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float inv_freq = 1.0f / powf(theta, (float)(2 * i) / (float)head_dim);
        float s, c;
        sincosf(p * inv_freq, &s, &c);
        float a = bf2f(h[i]), b = bf2f(h[i + half]);
        h[i] = f2bf(a * c - b * s);
        h[i + half] = f2bf(b * c + a * s);
    }
}
"#;

/// SiLU-and-mul on fused rows `[gate | up]` of width `2 * inter` into `[tokens, inter]`.
const SILU_MUL_BODY: &str = r#"
extern "C" __global__ void silu_mul_bf16(const unsigned short* __restrict__ gu, unsigned short* __restrict__ out,
                                         long long inter, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long t = i / inter, j = i - t * inter;
        float g = bf2f(gu[t * 2 * inter + j]), u = bf2f(gu[t * 2 * inter + inter + j]);
        out[i] = f2bf(g / (1.0f + expf(-g)) * u);
    }
}
"#;

/// Residual add in place: `x += y` (f32 math, one bf16 rounding).
const ADD_BODY: &str = r#"
extern "C" __global__ void add_bf16(unsigned short* __restrict__ x, const unsigned short* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = f2bf(bf2f(x[i]) + bf2f(y[i]));
}
"#;

/// Greedy sampling: per row of `[rows, vocab]` f32 logits, the index of the largest logit that is
/// `> -inf` (NaN never wins), lowest index on ties, `-1` when there is none (as the CPU sampler's
/// `argmax`). One block per row; block size a multiple of 32, at most 1024.
const ARGMAX_BODY: &str = r#"
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    if (i < 0) return false;
    if (bi < 0) return true;
    return v > bv || (v == bv && i < bi);
}
extern "C" __global__ void argmax_f32_rows(const float* __restrict__ logits, int* __restrict__ out, int vocab) {
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float bv = 0.f; int bi = -1;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = row[i];
        if (v > __int_as_float(0xff800000) && (bi < 0 || v > bv)) { bv = v; bi = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    __shared__ float sv[32];
    __shared__ int si[32];
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    if (lane == 0) { sv[wid] = bv; si[wid] = bi; }
    __syncthreads();
    if (wid == 0) {
        bool live = lane < (int)(blockDim.x >> 5);
        bv = live ? sv[lane] : 0.f;
        bi = live ? si[lane] : -1;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) out[blockIdx.x] = bi;
    }
}
"#;

/// The RoPE kernel's entry point.
pub(crate) const ROPE_FN: &str = "rope_neox_bf16";
/// The SiLU-and-mul kernel's entry point.
pub(crate) const SILU_MUL_FN: &str = "silu_mul_bf16";
/// The residual-add kernel's entry point.
pub(crate) const ADD_FN: &str = "add_bf16";
/// The argmax kernel's entry point.
pub(crate) const ARGMAX_FN: &str = "argmax_f32_rows";

/// Full source of the RoPE module.
pub(crate) fn rope_source() -> String {
    format!("{BF16_HELPERS}{ROPE_BODY}")
}

/// Full source of the SiLU-and-mul module.
pub(crate) fn silu_mul_source() -> String {
    format!("{BF16_HELPERS}{SILU_MUL_BODY}")
}

/// Full source of the residual-add module.
pub(crate) fn add_source() -> String {
    format!("{BF16_HELPERS}{ADD_BODY}")
}

/// Full source of the argmax module (f32 only; no bf16 helpers needed).
pub(crate) fn argmax_source() -> String {
    ARGMAX_BODY.to_string()
}

#[cfg(test)]
/// Whether NVRTC can be loaded (it needs no driver or GPU: `scripts/fetch-nvrtc.sh` provides it
/// on CPU machines, so kernel sources are compile-checked everywhere the test command runs).
pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: querying whether a shared library can be dlopen'ed has no preconditions.
    unsafe { ns::is_culib_present() }
}

/// Test helper: compiles `src` for `sm_90` (the lent H200s) and panics with NVRTC's log on
/// failure; returns `false` (skipped, printed) when NVRTC is not loadable.
#[cfg(test)]
pub(crate) fn check_compiles(what: &str, src: &str) -> bool {
    if !nvrtc_present() {
        println!("SKIP compile check of {what}: libnvrtc.so not loadable (scripts/fetch-nvrtc.sh)");
        return false;
    }
    if let Err(e) = compile_cubin(src, "sm_90") {
        panic!("{what} does not compile for sm_90: {e}");
    }
    true
}

#[cfg(test)]
mod compile_tests {
    use super::*;

    #[test]
    fn elementwise_kernels_compile_for_sm90() {
        for (what, src) in [
            ("rmsnorm", rmsnorm_source()),
            ("rope", rope_source()),
            ("silu_mul", silu_mul_source()),
            ("add", add_source()),
            ("argmax", argmax_source()),
        ] {
            check_compiles(what, &src);
        }
    }
}
