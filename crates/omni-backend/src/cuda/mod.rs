//! The CUDA backend (feature `cuda`, issue 5): device discovery, a context wrapper with bf16
//! GEMM through cuBLAS and NVRTC-compiled kernels.
//!
//! cudarc is built with `dynamic-loading`: nothing links against CUDA, and the libraries
//! (`libcuda`, `libnvrtc`, `libcublas`) are `dlopen`ed on first use. cudarc *panics* when a
//! library is missing, so every entry point here checks presence first and returns
//! [`CudaUnavailable`] / [`CudaError::MissingLibrary`] instead.
//!
//! Layouts follow the CPU backend: row-major, weights in Hugging Face `[out, in]` layout, so
//! [`CudaContext::matmul_nt_bf16`] is the GPU twin of [`crate::linalg::matmul_nt`].
//!
//! The kernels are CUDA C++ files under the crate's `kernels/` folder, embedded with
//! `include_str!` and compiled at run time by NVRTC for the device's architecture (`kernels.rs`).
//! Each op family is a module here: `layers` (the fused per-layer kernels), `attention`, `moe`,
//! `sampling`, `talker` (Qwen3-Omni's Talker and code predictor), `encoder` (Qwen3-Omni's vision
//! and audio towers), `gemv` (the small-batch GEMV and the decoder's fused small-batch path);
//! `launch` holds the checks every launcher makes.

/// `[*mut c_void; N]` pointing at each of the given local variables: a raw kernel launch's
/// parameter array (the variables must outlive the launch call).
macro_rules! kernel_args {
    ($($a:ident),+ $(,)?) => {
        [$((&raw mut $a).cast::<std::ffi::c_void>()),+]
    };
}

mod attention;
pub mod audio;
mod collective;
pub mod encoder;
mod gemv;
mod kernels;
mod launch;
mod layers;
#[cfg(test)]
mod layers_emu;
#[cfg(test)]
mod layers_tests;
#[cfg(test)]
mod mma_emu;
mod moe;
mod nccl;
mod prefetch;
mod probe;
mod qkv_rope;
mod sampling;
mod talker;
#[cfg(test)]
pub(crate) mod tests;
mod wgmma;

/// Whether a kernel choice made the default after measurement is on: yes unless its environment
/// variable is `0` (the switches stay so that a regression can be bisected without a rebuild).
pub(crate) fn switch_on(var: &str) -> bool {
    !matches!(std::env::var(var), Ok(v) if v.trim() == "0")
}

/// Whether a kernel choice that is off by default was asked for: its environment variable is `1`.
pub(crate) fn switch_opt_in(var: &str) -> bool {
    matches!(std::env::var(var), Ok(v) if v.trim() == "1")
}

pub use attention::*;
pub use collective::NcclAllReduce;
pub use gemv::*;
pub use layers::*;
pub use moe::*;
pub use nccl::*;
pub use prefetch::L2Prefetch;
pub use probe::*;
pub use qkv_rope::*;
pub use sampling::*;
pub use talker::*;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub use cudarc;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys as blas_sys};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaViewMut, DevicePtr, DevicePtrMut, DriverError,
    PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
pub use half::bf16;
use launch::{elementwise_cfg, narrow, shape_err};

/// What [`driver_status`] reports about a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Number of devices the driver sees.
    pub device_count: usize,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Compute capability `(major, minor)`, e.g. `(9, 0)`.
    pub compute_capability: (i32, i32),
    /// Total device memory in bytes.
    pub total_mem: usize,
    /// Driver API version (e.g. 13000 for CUDA 13.0).
    pub driver_version: i32,
    /// Streaming multiprocessors (132 on an H100 or H200).
    pub sm_count: usize,
}

impl DeviceInfo {
    /// The real architecture NVRTC compiles CUBINs for, e.g. `sm_90`.
    pub fn sm_arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }
}

/// Why no CUDA device can be used on this machine.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum CudaUnavailable {
    /// `libcuda.so` is not loadable: no NVIDIA driver on this machine.
    #[error(
        "no CUDA driver: libcuda.so could not be loaded (searched {searched:?}); this machine has no NVIDIA driver or it is not on the loader path"
    )]
    NoDriver {
        /// The library names cudarc tries.
        searched: Vec<String>,
    },
    /// The driver loaded but initialising it or querying the device failed.
    #[error("CUDA driver loaded but device {ordinal} is unusable: {reason}")]
    Device {
        /// Device ordinal asked for.
        ordinal: usize,
        /// The driver's error.
        reason: String,
    },
}

/// Errors from the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable driver / device.
    #[error(transparent)]
    Unavailable(#[from] CudaUnavailable),
    /// A CUDA library other than the driver is not loadable.
    #[error("CUDA library {0} could not be loaded")]
    MissingLibrary(&'static str),
    /// A driver API call failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Cublas(#[from] cudarc::cublas::result::CublasError),
    /// NVRTC failed (with the compile log where there is one).
    #[error("NVRTC {stage}: {log}")]
    Nvrtc {
        /// Which step failed.
        stage: &'static str,
        /// Compiler log or error code.
        log: String,
    },
    /// Shapes or lengths do not match.
    #[error(transparent)]
    Shape(#[from] crate::Error),
    /// A dimension does not fit the integer type cuBLAS or a kernel takes.
    #[error("{what} = {value} does not fit in i32")]
    TooLarge {
        /// Which dimension.
        what: &'static str,
        /// Its value.
        value: usize,
    },
    /// A device pointer is not 16-byte aligned (the kernels move 16-byte vectors; views must
    /// start at a multiple of 16 bytes).
    #[error("{what}: device pointer {ptr:#x} is not 16-byte aligned")]
    Misaligned {
        /// Which operand.
        what: &'static str,
        /// The pointer.
        ptr: u64,
    },
    /// A collective (NCCL) failed.
    #[error("NCCL: {0}")]
    Collective(String),
    /// A cache mutex was poisoned by a panicking thread.
    #[error("CUDA backend cache poisoned")]
    Poisoned,
}

/// Result alias for the CUDA backend.
pub type CudaResult<T> = std::result::Result<T, CudaError>;

fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library by name; no other preconditions.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

fn no_driver() -> CudaUnavailable {
    let mut searched: Vec<String> = Vec::new();
    for name in ["cuda", "nvcuda"]
        .iter()
        .flat_map(|l| cudarc::get_lib_name_candidates(l))
    {
        if !searched.contains(&name) {
            searched.push(name);
        }
    }
    CudaUnavailable::NoDriver { searched }
}

/// Checks for a CUDA driver and describes device 0. Never panics: returns
/// [`CudaUnavailable::NoDriver`] on machines without `libcuda.so`.
pub fn driver_status() -> Result<DeviceInfo, CudaUnavailable> {
    device_info(0)
}

/// Like [`driver_status`] for device `ordinal`.
pub fn device_info(ordinal: usize) -> Result<DeviceInfo, CudaUnavailable> {
    if !driver_present() {
        return Err(no_driver());
    }
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| dev_err(ordinal, e))?;
    info_of(&ctx, ordinal)
}

fn dev_err(ordinal: usize, e: DriverError) -> CudaUnavailable {
    CudaUnavailable::Device {
        ordinal,
        reason: format!("{e}"),
    }
}

fn info_of(
    ctx: &Arc<cudarc::driver::CudaContext>,
    ordinal: usize,
) -> Result<DeviceInfo, CudaUnavailable> {
    let e = |e| dev_err(ordinal, e);
    let mut driver_version = 0i32;
    // SAFETY: the driver is loaded and initialised (a context exists); the out-pointer is valid.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) }
        .result()
        .map_err(e)?;
    Ok(DeviceInfo {
        ordinal,
        device_count: cudarc::driver::CudaContext::device_count().map_err(e)? as usize,
        name: ctx.name().map_err(e)?,
        compute_capability: ctx.compute_capability().map_err(e)?,
        total_mem: ctx.total_mem().map_err(e)?,
        driver_version,
        sm_count: ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(e)?
            .max(1) as usize,
    })
}

/// Sums an f32 buffer over the tensor-parallel group, in place and asynchronously on the
/// context's stream (NCCL in the engine); must be capturable in a CUDA graph.
pub trait DeviceAllReduce: Send + Sync + std::fmt::Debug {
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// `buf = sum over ranks of buf`.
    fn all_reduce_sum_f32(&self, buf: &mut CudaViewMut<'_, f32>) -> CudaResult<()>;
}

/// Elements of the page-locked staging buffer for uploads (64 MiB of bf16).
pub const STAGING_ELEMS: usize = 32 << 20;

/// Bytes of the cuBLAS workspace each context sets (NVIDIA recommends 32 MiB on Hopper).
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// One device: its cudarc context, a stream, a cuBLAS handle, and lazily loaded kernels.
///
/// All work is queued on [`CudaContext::stream`]; call [`CudaContext::synchronize`] before reading
/// results on the host other than through the copy helpers (which synchronize).
pub struct CudaContext {
    info: DeviceInfo,
    ctx: Arc<cudarc::driver::CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// cuBLAS's workspace, ours so that GEMMs captured in a CUDA graph never allocate.
    _blas_workspace: CudaSlice<u8>,
    /// Page-locked staging buffer for weight uploads (allocated on first use).
    staging: Mutex<Option<PinnedHostSlice<bf16>>>,
    /// Loaded kernels by entry-point name (each name belongs to exactly one source).
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
}

impl std::fmt::Debug for CudaContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaContext")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl CudaContext {
    /// Opens device `ordinal`: checks the driver and cuBLAS are present first (never panics).
    pub fn new(ordinal: usize) -> CudaResult<Self> {
        if !driver_present() {
            return Err(no_driver().into());
        }
        // SAFETY: only tries to dlopen cuBLAS by name.
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(CudaError::MissingLibrary("libcublas"));
        }
        let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| dev_err(ordinal, e))?;
        let info = info_of(&ctx, ordinal)?;
        // One stream per worker and explicit ordering: cudarc's per-buffer event tracking would
        // make CUDA graph capture fail (a captured launch waiting on an event recorded before
        // the capture), so it is off for every buffer this context allocates.
        // SAFETY: all work of this context is queued on the one stream below, so no buffer is
        // used by two streams and stream order alone orders every use and free.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let mut workspace = stream.alloc_zeros::<u8>(CUBLAS_WORKSPACE_BYTES)?;
        {
            let (ptr, _g) = workspace.device_ptr_mut(&stream);
            // SAFETY: the handle is live; the workspace is a device allocation of
            // CUBLAS_WORKSPACE_BYTES that this context keeps alive as long as the handle.
            unsafe {
                blas_sys::cublasSetWorkspace_v2(
                    *blas.handle(),
                    ptr as *mut std::ffi::c_void,
                    CUBLAS_WORKSPACE_BYTES,
                )
            }
            .result()?;
        }
        Ok(Self {
            info,
            ctx,
            stream,
            blas,
            _blas_workspace: workspace,
            functions: Mutex::new(HashMap::new()),
            staging: Mutex::new(None),
        })
    }

    /// The device this context runs on.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The cudarc context (for work this wrapper does not cover yet).
    pub fn raw(&self) -> &Arc<cudarc::driver::CudaContext> {
        &self.ctx
    }

    /// The stream all work is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> CudaResult<()> {
        Ok(self.stream.synchronize()?)
    }

    /// Uploads bf16 values.
    pub fn upload_bf16(&self, host: &[bf16]) -> CudaResult<CudaSlice<bf16>> {
        Ok(self.stream.clone_htod(host)?)
    }

    /// Uploads bf16 values through a page-locked staging buffer (pageable copies run at a tenth
    /// of the PCIe rate on the lent machines), in chunks of [`STAGING_ELEMS`]; synchronizes.
    pub fn upload_bf16_pinned(&self, host: &[bf16]) -> CudaResult<CudaSlice<bf16>> {
        // SAFETY: every element is written by the copies below before the buffer is returned.
        let mut dst = unsafe { self.stream.alloc::<bf16>(host.len()) }?;
        if host.is_empty() {
            return Ok(dst);
        }
        let mut staging = self.staging.lock().map_err(|_| CudaError::Poisoned)?;
        if staging.is_none() {
            // SAFETY: flags 0 = plain page-locked memory (not write-combined); the buffer is
            // only read by the DMA engine and written by this thread under the mutex.
            *staging = Some(unsafe { self.ctx.alloc_pinned_with_flags::<bf16>(STAGING_ELEMS, 0) }?);
        }
        let Some(pinned) = staging.as_mut() else {
            return Err(CudaError::Poisoned);
        };
        let (base, _g) = dst.device_ptr_mut(&self.stream);
        for (i, chunk) in host.chunks(STAGING_ELEMS).enumerate() {
            let buf = pinned.as_mut_slice()?;
            buf[..chunk.len()].copy_from_slice(chunk);
            let off = (i * STAGING_ELEMS * std::mem::size_of::<bf16>()) as u64;
            // SAFETY: the destination range `off .. off + chunk bytes` lies inside `dst` (chunks
            // tile `host`, which has dst's length); the source is page-locked and not touched
            // again until the stream is synchronized below.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    base + off,
                    &buf[..chunk.len()],
                    self.stream.cu_stream(),
                )
            }?;
            self.stream.synchronize()?;
        }
        drop(_g);
        Ok(dst)
    }

    /// A zeroed bf16 buffer of `len` elements.
    pub fn zeros_bf16(&self, len: usize) -> CudaResult<CudaSlice<bf16>> {
        Ok(self.stream.alloc_zeros(len)?)
    }

    /// The linear layer without bias on the GPU: `out[m, n] = a[m, k] @ w[n, k]^T`, all row-major
    /// bf16, f32 accumulation (cuBLAS `gemm_ex`, `CUBLAS_COMPUTE_32F`).
    ///
    /// cuBLAS is column-major, so it sees row-major `out [m, n]` as `out^T` (n x m, ld n),
    /// `w [n, k]` as a k x n matrix (ld k) and `a [m, k]` as a k x m matrix (ld k). The call is
    /// the "TN" GEMM `out^T = op_T(w) * op_N(a)` with cuBLAS (m, n, k) = (n, m, k).
    pub fn matmul_nt_bf16(
        &self,
        a: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        m: usize,
        k: usize,
        n: usize,
    ) -> CudaResult<()> {
        crate::check_len("cuda matmul lhs", a.len(), m * k)?;
        crate::check_len("cuda matmul weight", w.len(), n * k)?;
        crate::check_len("cuda matmul out", out.len(), m * n)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (mi, ki, ni) = (
            narrow::<i32>("m", m)?,
            narrow::<i32>("k", k)?,
            narrow::<i32>("n", n)?,
        );
        let cfg = GemmConfig {
            transa: blas_sys::cublasOperation_t::CUBLAS_OP_T,
            transb: blas_sys::cublasOperation_t::CUBLAS_OP_N,
            m: ni,
            n: mi,
            k: ki,
            alpha: bf16::ONE,
            lda: ki.max(1),
            ldb: ki.max(1),
            beta: bf16::ZERO,
            ldc: ni,
        };
        // SAFETY: the three buffers are device allocations of this context whose lengths were
        // checked above against the (m, k, n) shape and leading dimensions passed to cuBLAS.
        unsafe { self.blas.gemm(cfg, w, a, out) }?;
        Ok(())
    }

    /// The kernel `name` from the module built from `source()`: compiled (through the CUBIN
    /// cache) and loaded on first use, then kept for this context. Every entry-point name must
    /// belong to exactly one source.
    pub(crate) fn function(
        &self,
        source: fn() -> String,
        name: &'static str,
    ) -> CudaResult<CudaFunction> {
        self.function_for(source, name, &self.info.sm_arch())
    }

    /// [`CudaContext::function`] from a module compiled for `arch` (an architecture-specific
    /// target such as `sm_90a`, which the caller has checked the device runs).
    pub(crate) fn function_for(
        &self,
        source: fn() -> String,
        name: &'static str,
        arch: &str,
    ) -> CudaResult<CudaFunction> {
        if let Some(f) = self
            .functions
            .lock()
            .map_err(|_| CudaError::Poisoned)?
            .get(name)
        {
            return Ok(f.clone());
        }
        let cubin = kernels::cubin(&source(), arch)?;
        let module = self
            .ctx
            .load_module(Ptx::from_binary(cubin.as_ref().clone()))?;
        let f = module.load_function(name)?;
        gemv::apply_carveout(&f);
        self.functions
            .lock()
            .map_err(|_| CudaError::Poisoned)?
            .insert(name, f.clone());
        Ok(f)
    }

    /// SiLU-and-mul: `gate_up` (`[tokens, 2 * inter]`, gate half first) into `out`
    /// (`[tokens, inter]`), f32 math: the GPU twin of [`crate::ops::silu_and_mul`].
    pub fn silu_and_mul_bf16(
        &self,
        gate_up: &impl DevicePtr<bf16>,
        out: &mut impl DevicePtrMut<bf16>,
        inter: usize,
    ) -> CudaResult<()> {
        if inter == 0 || !gate_up.len().is_multiple_of(2 * inter) {
            return Err(shape_err(
                "cuda silu_and_mul input (multiple of 2 * inter)",
                2 * inter,
                gate_up.len(),
            ));
        }
        let n = gate_up.len() / 2;
        crate::check_len("cuda silu_and_mul out", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let (gu, _g1) = gate_up.device_ptr(&self.stream);
        let (o, _g2) = out.device_ptr_mut(&self.stream);
        // SAFETY: gate_up holds 2 * n and out n elements (checked above), both on this stream.
        unsafe { self.silu_and_mul_ptrs(gu, o, n, inter) }
    }

    /// [`CudaContext::silu_and_mul_bf16`] on raw device pointers: `n` outputs (rows of
    /// `inter`) from `2 * n` inputs (the cuBLAS MoE path's workspace parts).
    ///
    /// # Safety
    /// `gate_up` must hold `2 * n` and `out` `n` bf16 elements of this context's device
    /// memory, with `n` a multiple of `inter`, ordered on this stream against other accesses.
    pub(crate) unsafe fn silu_and_mul_ptrs(
        &self,
        gate_up: u64,
        out: u64,
        n: usize,
        inter: usize,
    ) -> CudaResult<()> {
        let (inter_i, n_i) = (narrow::<i64>("inter", inter)?, narrow::<i64>("n", n)?);
        let f = self.function(kernels::silu_mul_source, kernels::SILU_MUL_FN)?;
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(&gate_up).arg(&out).arg(&inter_i).arg(&n_i);
        // SAFETY: the arguments match `silu_mul_bf16(const u16*, u16*, long long, long long)`;
        // gate_up holds 2 * n and out n elements (the caller's contract); the kernel's
        // grid-stride loop stays below n for any grid.
        unsafe { launch.launch(elementwise_cfg(n)) }?;
        Ok(())
    }
}
