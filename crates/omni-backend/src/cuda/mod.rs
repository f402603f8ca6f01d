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

mod kernels;
#[cfg(test)]
mod tests;

use std::sync::{Arc, OnceLock};

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys as blas_sys};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
pub use half::bf16;

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
    /// A dimension does not fit the 32-bit integers cuBLAS / kernels take.
    #[error("{what} = {value} does not fit in i32")]
    TooLarge {
        /// Which dimension.
        what: &'static str,
        /// Its value.
        value: usize,
    },
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
    })
}

fn to_i32(what: &'static str, value: usize) -> CudaResult<i32> {
    i32::try_from(value).map_err(|_| CudaError::TooLarge { what, value })
}

/// One device: its cudarc context, a stream, a cuBLAS handle, and lazily loaded kernels.
///
/// All work is queued on [`CudaContext::stream`]; call [`CudaContext::synchronize`] before reading
/// results on the host other than through the copy helpers (which synchronize).
pub struct CudaContext {
    info: DeviceInfo,
    ctx: Arc<cudarc::driver::CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    rmsnorm: OnceLock<CudaFunction>,
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
        let stream = ctx.default_stream();
        let blas = CudaBlas::new(stream.clone())?;
        Ok(Self {
            info,
            ctx,
            stream,
            blas,
            rmsnorm: OnceLock::new(),
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

    /// Rounds `host` to bf16 and uploads it.
    pub fn upload_f32_as_bf16(&self, host: &[f32]) -> CudaResult<CudaSlice<bf16>> {
        let v: Vec<bf16> = host.iter().map(|&x| bf16::from_f32(x)).collect();
        self.upload_bf16(&v)
    }

    /// A zeroed bf16 buffer of `len` elements.
    pub fn zeros_bf16(&self, len: usize) -> CudaResult<CudaSlice<bf16>> {
        Ok(self.stream.alloc_zeros(len)?)
    }

    /// Downloads a bf16 buffer, widened to f32 (synchronizes the stream).
    pub fn download_f32(&self, dev: &CudaSlice<bf16>) -> CudaResult<Vec<f32>> {
        let v = self.stream.clone_dtoh(dev)?;
        Ok(v.iter().map(|x| x.to_f32()).collect())
    }

    /// The linear layer without bias on the GPU: `out[m, n] = a[m, k] @ w[n, k]^T`, all row-major
    /// bf16, f32 accumulation (cuBLAS `gemm_ex`, `CUBLAS_COMPUTE_32F`).
    ///
    /// cuBLAS is column-major, so it sees row-major `out [m, n]` as `out^T` (n x m, ld n),
    /// `w [n, k]` as a k x n matrix (ld k) and `a [m, k]` as a k x m matrix (ld k). The call is
    /// the "TN" GEMM `out^T = op_T(w) * op_N(a)` with cuBLAS (m, n, k) = (n, m, k).
    pub fn matmul_nt_bf16(
        &self,
        a: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
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
        let (mi, ki, ni) = (to_i32("m", m)?, to_i32("k", k)?, to_i32("n", n)?);
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

    fn rmsnorm_fn(&self) -> CudaResult<&CudaFunction> {
        if let Some(f) = self.rmsnorm.get() {
            return Ok(f);
        }
        let cubin = kernels::cubin(&kernels::rmsnorm_source(), &self.info.sm_arch())?;
        let module = self
            .ctx
            .load_module(Ptx::from_binary(cubin.as_ref().clone()))?;
        let f = module.load_function(kernels::RMSNORM_FN)?;
        Ok(self.rmsnorm.get_or_init(|| f))
    }

    /// RMSNorm over rows of width `dim` (bf16 in and out, f32 accumulation), the GPU twin of
    /// [`crate::ops::rms_norm`]. The kernel is compiled by NVRTC for this device's `sm_XY` on
    /// first use and cached.
    pub fn rms_norm_bf16(
        &self,
        x: &CudaSlice<bf16>,
        weight: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
        dim: usize,
        eps: f32,
    ) -> CudaResult<()> {
        crate::check_len("cuda rms_norm weight", weight.len(), dim)?;
        crate::check_len("cuda rms_norm out", out.len(), x.len())?;
        if dim == 0 || !x.len().is_multiple_of(dim) {
            return Err(crate::Error::Shape {
                what: "cuda rms_norm input (multiple of dim)",
                expected: dim,
                got: x.len(),
            }
            .into());
        }
        let rows = x.len() / dim;
        if rows == 0 {
            return Ok(());
        }
        let rows_u32 = u32::try_from(rows).map_err(|_| CudaError::TooLarge {
            what: "rows",
            value: rows,
        })?;
        let hidden = to_i32("dim", dim)?;
        let threads = dim.div_ceil(32).clamp(1, 32) * 32;
        let cfg = LaunchConfig {
            grid_dim: (rows_u32, 1, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.rmsnorm_fn()?;
        let mut launch = self.stream.launch_builder(f);
        launch.arg(x).arg(weight).arg(out).arg(&hidden).arg(&eps);
        // SAFETY: the argument list matches `rmsnorm_bf16(const u16*, const u16*, u16*, int,
        // float)`; x/out hold rows * dim elements and weight dim (checked above); the block size
        // is a multiple of 32 and at most 1024, as the kernel's warp reduction requires.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}
