//! An NCCL communicator for tensor parallelism: one rank per GPU (one per process or per thread),
//! all-reduce of bf16 activations in place on the rank's [`CudaContext`] stream.
//!
//! Rank 0 makes the 128-byte unique id with [`NcclComm::unique_id`] and sends the bytes to the
//! other ranks by any channel (a file, a pipe); every rank then calls [`NcclComm::new`] with the
//! same id and world size, concurrently (initialisation blocks until all ranks have joined).
//!
//! Environment (not set here: a library does not mutate the process environment): on the lent
//! H200 machines the caller must run with `NCCL_NVLS_ENABLE=0` (NVLink multicast must stay off
//! there; `scripts/gpu-check.sh` sets it).
//!
//! cudarc loads NCCL with `dlopen` and *panics* when it is missing, so every entry point checks
//! first and returns [`NcclError::MissingLibrary`]. cudarc tries `libnccl.so` but not NCCL's
//! soname `libnccl.so.2`: where only the latter exists (e.g. the pip `nvidia-nccl` wheel), put a
//! directory holding a `libnccl.so -> .../libnccl.so.2` symlink on `LD_LIBRARY_PATH`.

use std::ffi::{CStr, c_char, c_void};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaStream, DevicePtrMut, DriverError};
use cudarc::nccl::{result as nr, sys as ns};

use super::{CudaContext, bf16};

/// Errors from the NCCL communicator.
#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    /// `libnccl.so` is not loadable.
    #[error(
        "NCCL is not loadable: libnccl.so could not be loaded (searched {searched:?}); NCCL's soname is libnccl.so.2, which is not searched: put a directory holding a symlink `libnccl.so -> /path/to/libnccl.so.2` (e.g. the nvidia-nccl pip wheel's nvidia/nccl/lib) on LD_LIBRARY_PATH"
    )]
    MissingLibrary {
        /// The library names cudarc tries.
        searched: Vec<String>,
    },
    /// An NCCL call failed.
    #[error("{call} failed: {code} ({message}){last}")]
    Nccl {
        /// The NCCL function.
        call: &'static str,
        /// The `ncclResult_t` code, e.g. `ncclInvalidUsage`.
        code: String,
        /// `ncclGetErrorString` of the code.
        message: String,
        /// `ncclGetLastError`'s detail (prefixed with `: `), or empty.
        last: String,
    },
    /// A CUDA driver call (binding the device's context to the thread) failed.
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    /// An argument is out of range (rank, world size, buffer length).
    #[error("invalid NCCL argument: {0}")]
    InvalidArgument(String),
}

/// Whether `libnccl.so` can be loaded (checked once per process).
pub fn nccl_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the NCCL library by name; no other preconditions.
    *PRESENT.get_or_init(|| unsafe { ns::is_culib_present() })
}

fn ensure_nccl() -> Result<(), NcclError> {
    if nccl_present() {
        return Ok(());
    }
    let mut searched: Vec<String> = Vec::new();
    for name in cudarc::get_lib_name_candidates("nccl") {
        if !searched.contains(&name) {
            searched.push(name);
        }
    }
    Err(NcclError::MissingLibrary { searched })
}

/// Text of a C string returned by NCCL (static storage), or empty for null.
fn c_text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: NCCL returns pointers to NUL-terminated strings it owns (static or per-thread
    // storage) that stay valid at least until the next NCCL call on this thread; the text is
    // copied out immediately.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Builds [`NcclError::Nccl`] for a failed call (NCCL is loaded: every caller checked first).
fn nccl_err(call: &'static str, e: nr::NcclError) -> NcclError {
    // SAFETY: ncclGetErrorString accepts any result code and returns a static string.
    let message = c_text(unsafe { ns::ncclGetErrorString(e.0) });
    // ncclGetLastError exists from NCCL 2.13 on (version code 21300); its argument is unused.
    let last = match nr::get_nccl_version() {
        // SAFETY: the symbol exists in this version; a null communicator is allowed.
        Ok(v) if v >= 21300 => c_text(unsafe { ns::ncclGetLastError(std::ptr::null_mut()) }),
        _ => String::new(),
    };
    NcclError::Nccl {
        call,
        code: format!("{:?}", e.0),
        message,
        last: if last.is_empty() {
            last
        } else {
            format!(": {last}")
        },
    }
}

/// One rank of an NCCL communicator, bound to one [`CudaContext`]'s device and stream.
///
/// `Send` but not `Sync`: a communicator may move between threads but must not be used by two
/// at once (NCCL communicators are not thread-safe). Dropping it finalizes and destroys it
/// cleanly, which waits for its outstanding operations, so all ranks should drop together;
/// use [`NcclComm::abort`] when a peer may be gone.
pub struct NcclComm {
    comm: ns::ncclComm_t,
    ctx: Arc<cudarc::driver::CudaContext>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
}

// SAFETY: the communicator handle is only an opaque pointer to NCCL's state, which NCCL lets any
// thread use as long as calls on it do not overlap; `NcclComm` is not `Sync` and every method
// takes `&self`/`&mut self` of one owner, so calls cannot overlap. The cudarc handles it holds
// are `Send`.
unsafe impl Send for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.ctx.ordinal())
            .finish_non_exhaustive()
    }
}

impl NcclComm {
    /// A fresh unique id for a new communicator (called once, by rank 0), as the 128 bytes the
    /// other ranks pass to [`NcclComm::new`].
    pub fn unique_id() -> Result<[u8; 128], NcclError> {
        ensure_nccl()?;
        let id = nr::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// Joins the communicator `id` as `rank` of `world`, on `cx`'s device and stream. Blocks
    /// until all `world` ranks have called it with the same id.
    pub fn new(
        cx: &CudaContext,
        rank: usize,
        world: usize,
        id: &[u8; 128],
    ) -> Result<Self, NcclError> {
        ensure_nccl()?;
        if world == 0 || rank >= world || i32::try_from(world).is_err() {
            return Err(NcclError::InvalidArgument(format!(
                "rank {rank} of world size {world}"
            )));
        }
        // NCCL uses the thread's current device: make it cx's.
        cx.raw().bind_to_thread()?;
        let uid = ns::ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut comm: ns::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; world fits in i32 and rank < world (checked);
        // the thread's current context is cx's, whose device the communicator will use.
        unsafe { nr::comm_init_rank(&mut comm, world as i32, uid, rank as i32) }
            .map_err(|e| nccl_err("ncclCommInitRank", e))?;
        Ok(Self {
            comm,
            ctx: cx.raw().clone(),
            stream: cx.stream().clone(),
            rank,
            world,
        })
    }

    /// This rank's index in `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// Sums the first `len` bf16 values of `buf` over all ranks, in place. Asynchronous: queued on
    /// the context's stream without synchronizing, so it can be captured in a CUDA graph. Every
    /// rank must call it with the same `len`, in the same order relative to other collectives.
    pub fn all_reduce_sum_bf16_in_place(
        &self,
        buf: &mut impl DevicePtrMut<bf16>,
        len: usize,
    ) -> Result<(), NcclError> {
        self.all_reduce_sum_in_place(buf, len, ns::ncclDataType_t::ncclBfloat16)
    }

    /// [`NcclComm::all_reduce_sum_bf16_in_place`] for f32 values.
    pub fn all_reduce_sum_f32_in_place(
        &self,
        buf: &mut impl DevicePtrMut<f32>,
        len: usize,
    ) -> Result<(), NcclError> {
        self.all_reduce_sum_in_place(buf, len, ns::ncclDataType_t::ncclFloat32)
    }

    fn all_reduce_sum_in_place<T>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        len: usize,
        dtype: ns::ncclDataType_t,
    ) -> Result<(), NcclError> {
        if len > buf.len() {
            return Err(NcclError::InvalidArgument(format!(
                "all-reduce of {len} elements on a buffer of {}",
                buf.len()
            )));
        }
        if len == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        let (ptr, _guard) = buf.device_ptr_mut(&self.stream);
        // SAFETY: `ptr` addresses at least `len` elements of `T`, whose NCCL type the callers
        // pass as `dtype`, on this communicator's device (checked above), valid while the guard
        // lives, past the enqueue; in-place (send == receive buffer) is allowed by NCCL; the
        // communicator is live and the stream belongs to the same context.
        unsafe {
            nr::all_reduce(
                ptr as *const c_void,
                ptr as *mut c_void,
                len,
                dtype,
                ns::ncclRedOp_t::ncclSum,
                self.comm,
                self.stream.cu_stream() as ns::cudaStream_t,
            )
        }
        .map_err(|e| nccl_err("ncclAllReduce", e))?;
        Ok(())
    }

    /// Tears the communicator down without waiting for peers (`ncclCommAbort`): for error paths
    /// where another rank may have died and a clean finalize could block forever.
    pub fn abort(mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the communicator is live; it is nulled right after so Drop skips it.
        let _ = unsafe { nr::comm_abort(self.comm) };
        self.comm = std::ptr::null_mut();
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.comm.is_null() {
            return;
        }
        // Drop cannot report errors: on failure the handle is aborted instead (never leaked
        // half-finalized), and nothing else can be done.
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the communicator is live and used by no one else (`&mut self`); finalize
        // flushes its outstanding operations, then destroy frees it; abort is the fallback.
        unsafe {
            match nr::comm_finalize(self.comm) {
                Ok(_) => {
                    let _ = nr::comm_destroy(self.comm);
                }
                Err(_) => {
                    let _ = nr::comm_abort(self.comm);
                }
            }
        }
        self.comm = std::ptr::null_mut();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::super::driver_status;
    use super::*;

    /// Skips (with a message) unless NCCL and `need` devices are present.
    fn devices_or_skip(test: &str, need: usize) -> bool {
        let info = match driver_status() {
            Ok(i) => i,
            Err(e) => {
                println!("SKIP {test}: {e}");
                return false;
            }
        };
        if info.device_count < need {
            println!(
                "SKIP {test}: needs {need} GPUs, this machine has {}",
                info.device_count
            );
            return false;
        }
        if let Err(e) = ensure_nccl() {
            println!("SKIP {test}: {e}");
            return false;
        }
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            println!("{test}: warning: NCCL_NVLS_ENABLE is unset (use 0 on the lent machines)");
        }
        true
    }

    /// Small integers: exact in bf16, and so are their sums over a few ranks.
    fn value(i: usize, rank: usize) -> f32 {
        ((i * 7 + rank * 3) % 13) as f32 - 6.0 + rank as f32
    }

    #[test]
    fn missing_nccl_is_an_error_not_a_panic() {
        if nccl_present() {
            println!("nccl present: nothing to check");
            return;
        }
        let e = NcclComm::unique_id().unwrap_err();
        let msg = e.to_string();
        println!("nccl missing: {msg}");
        assert!(matches!(e, NcclError::MissingLibrary { .. }));
        assert!(
            msg.contains("libnccl.so") && msg.contains("LD_LIBRARY_PATH"),
            "{msg}"
        );
    }

    #[test]
    fn nccl_world_of_one_is_the_identity() {
        if !devices_or_skip("nccl_world_of_one_is_the_identity", 1) {
            return;
        }
        let cx = CudaContext::new(0).unwrap();
        let id = NcclComm::unique_id().unwrap();
        assert!(matches!(
            NcclComm::new(&cx, 1, 1, &id),
            Err(NcclError::InvalidArgument(_))
        ));
        let comm = NcclComm::new(&cx, 0, 1, &id).unwrap();
        assert_eq!((comm.rank(), comm.world_size()), (0, 1));
        let host: Vec<f32> = (0..4096).map(|i| value(i, 0)).collect();
        let mut buf = cx.upload_f32_as_bf16(&host).unwrap();
        comm.all_reduce_sum_bf16_in_place(&mut buf, host.len())
            .unwrap();
        assert!(matches!(
            comm.all_reduce_sum_bf16_in_place(&mut buf, host.len() + 1),
            Err(NcclError::InvalidArgument(_))
        ));
        assert_eq!(cx.download_f32(&buf).unwrap(), host);
        println!("nccl world 1: {comm:?} ok");
    }

    #[test]
    fn nccl_all_reduce_over_two_gpus_sums_and_timing() {
        if !devices_or_skip("nccl_all_reduce_over_two_gpus_sums_and_timing", 2) {
            return;
        }
        let world = 2;
        let (tx, rx) = std::sync::mpsc::channel::<[u8; 128]>();
        let mut rx = Some(rx);
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let tx = tx.clone();
                let rx = if rank == 0 { None } else { rx.take() };
                std::thread::spawn(move || {
                    let cx = CudaContext::new(rank).unwrap();
                    let id = if rank == 0 {
                        let id = NcclComm::unique_id().unwrap();
                        for _ in 1..world {
                            tx.send(id).unwrap();
                        }
                        id
                    } else {
                        rx.expect("receiver").recv().unwrap()
                    };
                    let t = std::time::Instant::now();
                    let comm = NcclComm::new(&cx, rank, world, &id).unwrap();
                    if rank == 0 {
                        println!("nccl init: {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
                    }
                    for len in [1024usize, 16 << 20] {
                        let host: Vec<f32> = (0..len).map(|i| value(i, rank)).collect();
                        let mut buf = cx.upload_f32_as_bf16(&host).unwrap();
                        comm.all_reduce_sum_bf16_in_place(&mut buf, len).unwrap();
                        let got = cx.download_f32(&buf).unwrap();
                        for (i, g) in got.iter().enumerate() {
                            let want: f32 = (0..world).map(|r| value(i, r)).sum();
                            assert_eq!(*g, want, "rank {rank} len {len} element {i}");
                        }
                    }
                    drop(comm);
                })
            })
            .collect();
        drop(tx);
        for h in handles {
            h.join().expect("rank thread panicked");
        }
        let rows = crate::cuda::measure_all_reduce(world, &[16 << 10, 256 << 20], 50).unwrap();
        for r in rows {
            println!(
                "nccl all-reduce bf16 {} KiB x{world}: {:.1} us, algbw {:.1} GB/s, busbw {:.1} GB/s",
                r.bytes >> 10,
                r.seconds * 1e6,
                r.algbw / 1e9,
                r.busbw / 1e9
            );
        }
    }
}
