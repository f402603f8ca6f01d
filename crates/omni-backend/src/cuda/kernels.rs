//! NVRTC kernels: CUDA C++ source compiled at run time to a real-architecture CUBIN (e.g.
//! `sm_90`), cached per process by source hash + architecture.
//!
//! The sources are the files under the crate's `kernels/` folder, embedded with [`kernel_file!`].
//! A module's source is the concatenation of its files (headers first), built by the Rust module
//! that launches it; there are no `#include`s, so NVRTC needs no include path. Some modules get
//! generated text as well: `#define`s of the launch constants (sampling) and the `extern "C"`
//! entry points instantiating a template per head dimension or tile shape (attention, MoE).
//!
//! The sources are header-free: NVRTC 13 ships no built-in `cuda_bf16.h`, so bf16 is moved as
//! `unsigned short` and converted with the bit tricks of `bf16.cuh` (round to nearest even), with
//! all arithmetic in f32.

use std::collections::HashMap;
use std::ffi::CString;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{result as nr, sys as ns};

use super::CudaError;

/// The text of `kernels/<path>` (relative to the crate root), embedded at compile time.
macro_rules! kernel_file {
    ($path:literal) => {
        include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/", $path))
    };
}
pub(crate) use kernel_file;

/// bf16 <-> f32 helpers shared by every kernel source.
pub(crate) const BF16_HELPERS: &str = kernel_file!("bf16.cuh");

/// The RoPE angle helper shared by the q/k norm + RoPE kernel and the decode attention (after
/// [`BF16_HELPERS`]).
pub(crate) const ROPE_HELPERS: &str = kernel_file!("rope.cuh");

/// The grid-wide barrier of the one-launch kernels (after [`BF16_HELPERS`]).
pub(crate) const GRID_SYNC: &str = kernel_file!("grid_sync.cuh");

/// The element-wise kernels (SiLU-and-mul).
const ELEMENTWISE: &str = kernel_file!("elementwise.cu");

/// The SiLU-and-mul kernel's entry point.
pub(crate) const SILU_MUL_FN: &str = "silu_mul_bf16";

/// Full source of the element-wise module.
pub(crate) fn silu_mul_source() -> String {
    format!("{BF16_HELPERS}{ELEMENTWISE}")
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

fn compile_cubin(src: &str, arch: &str) -> Result<Vec<u8>, CudaError> {
    compile_with(src, arch, &[]).map(|(cubin, _)| cubin)
}

/// Compiles `src` for `arch` with `extra` NVRTC options: the CUBIN and the program log.
fn compile_with(src: &str, arch: &str, extra: &[&str]) -> Result<(Vec<u8>, String), CudaError> {
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
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
    ];
    opts.extend(extra.iter().map(|o| o.to_string()));
    // SAFETY: `prog` is a live program from nvrtcCreateProgram; destroyed exactly once below.
    let res = unsafe { nr::compile_program(prog, &opts) };
    // SAFETY: `prog` is still live; the log is read before it is destroyed.
    let log = unsafe { nr::get_program_log(prog) }.unwrap_or_default();
    let log: String = log
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8 as char)
        .collect();
    let out = match res {
        Err(e) => Err(CudaError::Nvrtc {
            stage: "nvrtcCompileProgram",
            log: format!("{e:?}: {log}"),
        }),
        Ok(()) => read_cubin(prog).map(|c| (c, log)),
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::cuda::{attention, gemv, layers, moe, sampling, talker};

    /// Whether NVRTC can be loaded (it needs no driver or GPU: `scripts/fetch-nvrtc.sh` provides
    /// it on CPU machines, so kernel sources are compile-checked everywhere the test command
    /// runs).
    fn nvrtc_present() -> bool {
        // SAFETY: querying whether a shared library can be dlopen'ed has no preconditions.
        unsafe { ns::is_culib_present() }
    }

    /// Test helper: compiles `src` for `sm_90` (the lent H200s) and panics with NVRTC's log on
    /// failure or when ptxas serializes warpgroup MMAs; returns `false` (skipped, printed) when
    /// NVRTC is not loadable.
    fn check_compiles(what: &str, src: &str) -> bool {
        if !nvrtc_present() {
            println!(
                "SKIP compile check of {what}: libnvrtc.so not loadable (scripts/fetch-nvrtc.sh)"
            );
            return false;
        }
        let arch = module_arch(what);
        match compile_with(src, arch, &[]) {
            Err(e) => panic!("{what} does not compile for {arch}: {e}"),
            // ptxas reports (C7520) when it serializes wgmma instructions, e.g. behind a branch
            // it cannot prove warp-uniform: a silent slowdown, so a failure here.
            Ok((_, log)) => assert!(
                !log.contains("C7520"),
                "{what}: ptxas serializes wgmma for {arch}: {log}"
            ),
        }
        true
    }

    /// The architecture a module of [`every_module`] is checked for: `sm_90`, or `sm_90a` for
    /// the Hopper-only MoE and attention modules.
    fn module_arch(what: &str) -> &'static str {
        if what == "moe wgmma" || what == "moe ws" || what == "attention wgmma" {
            moe::source::WGMMA_ARCH
        } else {
            "sm_90"
        }
    }

    /// Every module this crate compiles, by name: the head-dimension instances of attention and
    /// its reduce, the fused layers, MoE, sampling and the element-wise kernels.
    fn every_module() -> Vec<(String, String)> {
        let mut v = vec![
            ("elementwise".to_string(), silu_mul_source()),
            ("audio".to_string(), crate::cuda::audio::audio_source()),
            (
                "encoder".to_string(),
                crate::cuda::encoder::encoder_source(),
            ),
            ("layers".to_string(), layers::layers_source()),
            (
                "attention reduce".to_string(),
                attention::source::reduce_source(),
            ),
            ("moe".to_string(), moe::source::moe_source()),
            ("moe wgmma".to_string(), moe::source::moe_wgmma_source()),
            ("moe ws".to_string(), moe::source::moe_ws_source()),
            (
                "attention wgmma".to_string(),
                attention::source::attn_wgmma_source(),
            ),
            ("moe small".to_string(), moe::small::moe_small_source()),
            ("moe block1".to_string(), moe::block1::moe_block1_source()),
            (
                "attention block1".to_string(),
                attention::block1::attn_block1_source(),
            ),
            ("sampling".to_string(), sampling::sampling_source()),
            ("talker".to_string(), talker::talker_source()),
            ("gemv".to_string(), gemv::gemv_source()),
        ];
        // The first forms kept behind switches: the one-launch MoE block's count barrier, and
        // the shared-memory top-k in the modules that route.
        type Kept = (&'static str, &'static str, fn() -> String);
        let kept: [Kept; 4] = [
            (
                "moe block1 count barrier",
                moe::block1::COUNT_BARRIER_DEFINE,
                moe::block1::moe_block1_source,
            ),
            (
                "moe block1 top-k smem",
                moe::source::TOPK_SMEM_DEFINE,
                moe::block1::moe_block1_source,
            ),
            (
                "moe top-k smem",
                moe::source::TOPK_SMEM_DEFINE,
                moe::source::moe_source,
            ),
            (
                "moe small top-k smem",
                moe::source::TOPK_SMEM_DEFINE,
                moe::small::moe_small_source,
            ),
        ];
        for (name, define, source) in kept {
            v.push((name.to_string(), format!("{define}{}", source())));
        }
        for hd in attention::SUPPORTED_HEAD_DIMS {
            v.push((
                format!("attention hd{hd}"),
                attention::source::attn_source(hd),
            ));
        }
        v
    }

    #[test]
    fn every_kernel_module_compiles_for_sm90() {
        for (what, src) in every_module() {
            if !check_compiles(&what, &src) {
                return;
            }
        }
    }

    /// Runs without NVRTC: a `.cu` / `.cuh` file that no module includes would never be
    /// compile-checked (nor used).
    #[test]
    fn every_kernel_file_is_part_of_a_compiled_module() {
        let modules = every_module();
        // A test binary built here and run elsewhere (the GPU machine runs it from a copy of the
        // repository) falls back to the path relative to the working directory.
        let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let root = if built.is_dir() {
            built
        } else {
            std::path::PathBuf::from("crates/omni-backend/kernels")
        };
        let mut dirs = vec![root.clone()];
        let mut files = 0;
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                    continue;
                }
                let rel = path.strip_prefix(&root).unwrap().display().to_string();
                assert!(
                    rel.ends_with(".cu") || rel.ends_with(".cuh"),
                    "kernels/{rel}: only .cu and .cuh files belong here"
                );
                let text = std::fs::read_to_string(&path).unwrap();
                let users: Vec<&str> = modules
                    .iter()
                    .filter(|(_, src)| src.contains(&text))
                    .map(|(name, _)| name.as_str())
                    .collect();
                println!("kernels/{rel}: in {users:?}");
                assert!(!users.is_empty(), "kernels/{rel} is in no compiled module");
                files += 1;
            }
        }
        assert!(files >= 21, "found only {files} kernel files");
    }

    /// Not a check: ptxas's registers, spills and shared memory per kernel of every module
    /// (`cargo test -p omni-backend --features cuda --lib -- --ignored ptxas_report
    /// --nocapture`, NVRTC on the library path), to reason about occupancy without a GPU.
    #[test]
    #[ignore]
    fn ptxas_report() {
        if !nvrtc_present() {
            println!("SKIP ptxas_report: libnvrtc.so not loadable");
            return;
        }
        let only = std::env::var("PTXAS_MODULE").ok();
        for (what, src) in every_module() {
            if only.as_ref().is_some_and(|o| !what.contains(o.as_str())) {
                continue;
            }
            let (_, log) = compile_with(&src, module_arch(&what), &["--ptxas-options=-v"]).unwrap();
            println!("== {what}");
            log.lines()
                .filter(|l| {
                    l.contains("Compiling entry")
                        || l.contains("Used")
                        || l.contains("spill")
                        || l.contains("arning")
                })
                .for_each(|l| println!("{}", l.trim()));
        }
    }

    #[test]
    fn a_module_is_compiled_once_per_process() {
        if !nvrtc_present() {
            println!("SKIP a_module_is_compiled_once_per_process: libnvrtc.so not loadable");
            return;
        }
        // A source of its own, so no concurrent test inserts the same key.
        let src = format!(
            "{}// a_module_is_compiled_once_per_process\n",
            silu_mul_source()
        );
        let first = cubin(&src, "sm_90").unwrap();
        let again = cubin(&src, "sm_90").unwrap();
        assert!(Arc::ptr_eq(&first, &again), "the CUBIN cache missed");
        assert!(!first.is_empty());
    }
}
