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

mod attention;
mod collective;
mod kernels;
mod layers;
mod moe;
mod nccl;
mod probe;
mod sampling;
#[cfg(test)]
pub(crate) mod tests;

pub use attention::*;
pub use collective::NcclAllReduce;
pub use layers::*;
pub use moe::*;
pub use nccl::*;
pub use probe::*;
pub use sampling::*;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub use cudarc;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys as blas_sys};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaViewMut, DevicePtr, DevicePtrMut, DriverError,
    LaunchConfig, PinnedHostSlice, PushKernelArg,
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
    })
}

fn to_i32(what: &'static str, value: usize) -> CudaResult<i32> {
    i32::try_from(value).map_err(|_| CudaError::TooLarge { what, value })
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

    /// The kernel `name` from the module built from `source()`: compiled (through the CUBIN
    /// cache) and loaded on first use, then kept for this context. Every entry-point name must
    /// belong to exactly one source.
    pub(crate) fn function(
        &self,
        source: fn() -> String,
        name: &'static str,
    ) -> CudaResult<CudaFunction> {
        if let Some(f) = self
            .functions
            .lock()
            .map_err(|_| CudaError::Poisoned)?
            .get(name)
        {
            return Ok(f.clone());
        }
        let cubin = kernels::cubin(&source(), &self.info.sm_arch())?;
        let module = self
            .ctx
            .load_module(Ptx::from_binary(cubin.as_ref().clone()))?;
        let f = module.load_function(name)?;
        self.functions
            .lock()
            .map_err(|_| CudaError::Poisoned)?
            .insert(name, f.clone());
        Ok(f)
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
        let f = self.function(kernels::rmsnorm_source, kernels::RMSNORM_FN)?;
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(x).arg(weight).arg(out).arg(&hidden).arg(&eps);
        // SAFETY: the argument list matches `rmsnorm_bf16(const u16*, const u16*, u16*, int,
        // float)`; x/out hold rows * dim elements and weight dim (checked above); the block size
        // is a multiple of 32 and at most 1024, as the kernel's warp reduction requires.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// RoPE in the Hugging Face `rotate_half` (GPT-NeoX) convention, in place on `x`
    /// (`[tokens, heads, head_dim]` bf16) with one position per token (`positions`, `[tokens]`
    /// on the device). Frequencies `1 / rope_theta^(2i / head_dim)` and angles are computed in
    /// f32 on the device: the GPU twin of [`crate::rope::Rope`] with
    /// [`crate::rope::RopeScaling::None`] (scaled variants are not covered yet).
    pub fn rope_neox_bf16(
        &self,
        x: &mut CudaSlice<bf16>,
        positions: &CudaSlice<u32>,
        heads: usize,
        head_dim: usize,
        rope_theta: f32,
    ) -> CudaResult<()> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(crate::Error::Shape {
                what: "cuda rope head_dim (even)",
                expected: head_dim + 1,
                got: head_dim,
            }
            .into());
        }
        let tokens = positions.len();
        crate::check_len("cuda rope input", x.len(), tokens * heads * head_dim)?;
        let blocks = tokens * heads;
        if blocks == 0 {
            return Ok(());
        }
        let blocks_u32 = u32::try_from(blocks).map_err(|_| CudaError::TooLarge {
            what: "tokens * heads",
            value: blocks,
        })?;
        let (heads_i, hd_i) = (to_i32("heads", heads)?, to_i32("head_dim", head_dim)?);
        let threads = (head_dim / 2).div_ceil(32).clamp(1, 8) * 32;
        let cfg = LaunchConfig {
            grid_dim: (blocks_u32, 1, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.function(kernels::rope_source, kernels::ROPE_FN)?;
        let mut launch = self.stream.launch_builder(&f);
        launch
            .arg(x)
            .arg(positions)
            .arg(&heads_i)
            .arg(&hd_i)
            .arg(&rope_theta);
        // SAFETY: the arguments match `rope_neox_bf16(u16*, const u32*, int, int, float)`; the
        // grid has one block per (token, head) and x holds tokens * heads * head_dim elements,
        // positions one per token (checked above); head_dim is even.
        unsafe { launch.launch(cfg) }?;
        Ok(())
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
            return Err(crate::Error::Shape {
                what: "cuda silu_and_mul input (multiple of 2 * inter)",
                expected: 2 * inter,
                got: gate_up.len(),
            }
            .into());
        }
        let n = gate_up.len() / 2;
        crate::check_len("cuda silu_and_mul out", out.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let (inter_i, n_i) = (to_i64("inter", inter)?, to_i64("n", n)?);
        let f = self.function(kernels::silu_mul_source, kernels::SILU_MUL_FN)?;
        let (gu, _g1) = gate_up.device_ptr(&self.stream);
        let (o, _g2) = out.device_ptr_mut(&self.stream);
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(&gu).arg(&o).arg(&inter_i).arg(&n_i);
        // SAFETY: the arguments match `silu_mul_bf16(const u16*, u16*, long long, long long)`;
        // gate_up holds 2 * n and out n elements (checked above); the kernel's grid-stride loop
        // stays below n for any grid.
        unsafe { launch.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// Gathers rows of `table` (`[vocab, hidden]`) for `ids` into `out` (`[ids.len(), hidden]`):
    /// the GPU twin of [`crate::ops::embedding`]. An id `>= vocab` is an error, reported before
    /// anything is launched.
    pub fn embedding_bf16(
        &self,
        table: &CudaSlice<bf16>,
        hidden: usize,
        ids: &[u32],
        out: &mut CudaSlice<bf16>,
    ) -> CudaResult<()> {
        if hidden == 0 || !table.len().is_multiple_of(hidden) {
            return Err(crate::Error::Shape {
                what: "cuda embedding table (multiple of hidden)",
                expected: hidden,
                got: table.len(),
            }
            .into());
        }
        let vocab = table.len() / hidden;
        let n = ids.len() * hidden;
        crate::check_len("cuda embedding out", out.len(), n)?;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(crate::Error::Shape {
                what: "cuda embedding token id (vocab size)",
                expected: vocab,
                got: id as usize,
            }
            .into());
        }
        if n == 0 {
            return Ok(());
        }
        let dids: Vec<i32> = ids
            .iter()
            .map(|&id| to_i32("token id", id as usize))
            .collect::<CudaResult<_>>()?;
        let dids = self.stream.clone_htod(&dids)?;
        self.embedding_ids_bf16(table, hidden, &dids, ids.len(), out)
    }

    /// Residual add in place, `x += y` (bf16, f32 math): the GPU twin of
    /// [`crate::ops::add_inplace`].
    pub fn add_residual_bf16(
        &self,
        x: &mut CudaSlice<bf16>,
        y: &CudaSlice<bf16>,
    ) -> CudaResult<()> {
        crate::check_len("cuda add operand", y.len(), x.len())?;
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let n_i = to_i64("n", n)?;
        let f = self.function(kernels::add_source, kernels::ADD_FN)?;
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(x).arg(y).arg(&n_i);
        // SAFETY: the arguments match `add_bf16(u16*, const u16*, long long)`; x and y both hold
        // n elements (checked above) and the grid-stride loop stays below n.
        unsafe { launch.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// Greedy sampling on the device: for each row of `logits` (`[rows, vocab]` f32), the index
    /// of the largest logit, lowest index on ties; `None` for a row with no logit above `-inf`
    /// (NaN never wins), as the CPU sampler. Synchronizes to read the `rows` results back.
    pub fn argmax_f32_rows(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
    ) -> CudaResult<Vec<Option<u32>>> {
        if vocab == 0 || !logits.len().is_multiple_of(vocab) {
            return Err(crate::Error::Shape {
                what: "cuda argmax logits (multiple of vocab)",
                expected: vocab,
                got: logits.len(),
            }
            .into());
        }
        let rows = logits.len() / vocab;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let rows_u32 = u32::try_from(rows).map_err(|_| CudaError::TooLarge {
            what: "rows",
            value: rows,
        })?;
        let vocab_i = to_i32("vocab", vocab)?;
        let mut out = self.stream.alloc_zeros::<i32>(rows)?;
        let threads = vocab.div_ceil(32).clamp(1, 32) * 32;
        let cfg = LaunchConfig {
            grid_dim: (rows_u32, 1, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = self.function(kernels::argmax_source, kernels::ARGMAX_FN)?;
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(logits).arg(&mut out).arg(&vocab_i);
        // SAFETY: the arguments match `argmax_f32_rows(const float*, int*, int)`; logits holds
        // rows * vocab elements and out rows (one block per row); the block size is a multiple
        // of 32 and at most 1024, as the kernel's warp reduction requires.
        unsafe { launch.launch(cfg) }?;
        let idx = self.stream.clone_dtoh(&out)?;
        Ok(idx.into_iter().map(|i| u32::try_from(i).ok()).collect())
    }
}

fn to_i64(what: &'static str, value: usize) -> CudaResult<i64> {
    i64::try_from(value).map_err(|_| CudaError::TooLarge { what, value })
}

/// Launch shape for the grid-stride element-wise kernels: 256 threads, enough blocks to cover
/// `n` up to a cap (the loop covers the rest).
fn elementwise_cfg(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}
