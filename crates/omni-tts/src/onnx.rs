//! ONNX Runtime through the `ort` crate, loading `libonnxruntime.so` at run time (`load-dynamic`).
//!
//! The library comes from PyPI's `onnxruntime` wheel (`scripts/fetch-voice.sh`): `ort`'s default
//! build downloads a binary at build time, which a machine that reaches only the package
//! registries cannot do. The process loads one library, the first one asked for.
//!
//! Sessions run on one intra-op and one inter-op thread, like the reference package (the model is
//! small; one core runs it far faster than real time, and a serving process has other work).
//!
//! The voice is an int8 (dynamically quantized) graph, and ONNX Runtime's x86 kernels for it are
//! exact only on CPUs with VNNI; elsewhere every session sets [`X64_QUANT_PRECISION`], so the
//! audio does not depend on the machine (see the constant and [`Int8Products`]).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use ort::session::Session;
use ort::session::builder::GraphOptimizationLevel;
use ort::value::Tensor;

use crate::Error;

/// ONNX Runtime's session entry (`kOrtSessionOptionsAvx2PrecisionMode`) for exact int8 matrix
/// products on x86, set to `"1"` where the CPU's own kernels are not exact ([`Int8Products`]).
///
/// The quantized graph multiplies uint8 activations by int8 weights. Without VNNI, ONNX Runtime's
/// u8 x s8 kernels add neighbouring products with `PMADDUBSW`, which saturates at 16 bits
/// (255 x 127 x 2 > 32767); with VNNI the sums are exact. So the same text gave different audio
/// on an AVX2-only CPU (0.22 away from the reference at "Hello there.", durations included) than on
/// a VNNI one. The entry makes the runtime rewrite the int8 weights to uint8 and use its u8 x u8
/// kernels, exact on every x86 CPU, so the audio no longer depends on the machine. The u8 x u8
/// kernels are slower: on an AVX-512 VNNI CPU the acoustic model took 1.6x as long with the entry
/// (0.54 against 0.34 s for 19 sentences, outputs bit for bit the same), hence [`Int8Products`].
pub const X64_QUANT_PRECISION: (&str, &str) = ("session.x64quantprecision", "1");

/// How a session gets exact int8 products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Products {
    /// ONNX Runtime's own kernels where they are exact ([`cpu_int8_is_exact`]), else the
    /// rewrite of [`X64_QUANT_PRECISION`].
    Auto,
    /// The rewrite of [`X64_QUANT_PRECISION`] on any CPU (a check that both paths agree).
    Rewritten,
}

/// Whether ONNX Runtime's u8 x s8 kernels sum exactly on this CPU: VNNI's `VPDPBUSD` (AVX-512
/// VNNI, or AVX-VNNI) adds the products in 32 bits, and off x86 the kernels are exact as well.
pub fn cpu_int8_is_exact() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512vnni")
            || std::arch::is_x86_feature_detected!("avxvnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        true
    }
}

static ENVIRONMENT: OnceLock<Result<ort::environment::Environment, String>> = OnceLock::new();

fn environment(lib: &Path) -> Result<&'static ort::environment::Environment, Error> {
    let env = ENVIRONMENT.get_or_init(|| {
        ort::init_from(lib)
            .map_err(|e| e.to_string())?
            .with_name("omni-tts")
            .build()
            .map_err(|e| e.to_string())
    });
    env.as_ref().map_err(|reason| Error::RuntimeLoad {
        path: lib.to_path_buf(),
        reason: reason.clone(),
    })
}

/// One loaded model; runs are serialised (a session run needs exclusive access in `ort`).
#[derive(Debug)]
pub struct OnnxModel {
    name: String,
    session: Mutex<Session>,
}

/// A model output as a flat f32 or i64 buffer with its shape.
#[derive(Debug, Clone)]
pub struct Output<T> {
    pub shape: Vec<i64>,
    pub data: Vec<T>,
}

impl OnnxModel {
    /// Loads `model` with [`Int8Products::Auto`].
    pub fn load(runtime: &Path, model: &Path) -> Result<Self, Error> {
        Self::load_with(runtime, model, Int8Products::Auto)
    }

    pub fn load_with(runtime: &Path, model: &Path, int8: Int8Products) -> Result<Self, Error> {
        let rewrite = int8 == Int8Products::Rewritten || !cpu_int8_is_exact();
        let name = model.file_name().map_or_else(
            || model.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let env = environment(runtime)?;
        let build = || -> Result<Session, String> {
            let b = Session::builder(env).map_err(|e| e.to_string())?;
            let b = b.with_intra_threads(1).map_err(|e| e.to_string())?;
            let b = b.with_inter_threads(1).map_err(|e| e.to_string())?;
            let b = b
                .with_optimization_level(GraphOptimizationLevel::All)
                .map_err(|e| e.to_string())?;
            if !rewrite {
                let mut b = b;
                return b.commit_from_file(model).map_err(|e| e.to_string());
            }
            let (key, value) = X64_QUANT_PRECISION;
            let mut b = b.with_config_entry(key, value).map_err(|e| e.to_string())?;
            // The precision entry needs each integer-product weight used once (onnx_shared.rs).
            let bytes = std::fs::read(model).map_err(|e| format!("{}: {e}", model.display()))?;
            match crate::onnx_shared::unshare_integer_weights(&bytes) {
                Ok(Some(unshared)) => b.commit_from_memory(&unshared),
                Ok(None) | Err(_) => b.commit_from_memory(&bytes),
            }
            .map_err(|e| e.to_string())
        };
        let session = build().map_err(|e| Error::onnx(&name, e))?;
        Ok(Self {
            name,
            session: Mutex::new(session),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Session>, Error> {
        self.session
            .lock()
            .map_err(|_| Error::onnx(&self.name, "a previous run panicked"))
    }

    /// Runs a model with one `[1, n]` int64 input (the OOV net) and returns its int64 output.
    pub fn run_ids(&self, input: &str, ids: &[i64]) -> Result<Output<i64>, Error> {
        let t = Tensor::from_array(([1usize, ids.len()], ids.to_vec()))
            .map_err(|e| Error::onnx(&self.name, e))?;
        let mut session = self.lock()?;
        let outputs = session
            .run(ort::inputs![input => t])
            .map_err(|e| Error::onnx(&self.name, e))?;
        let (shape, data) = outputs[0]
            .try_extract_tensor::<i64>()
            .map_err(|e| Error::onnx(&self.name, e))?;
        Ok(Output {
            shape: shape.iter().copied().collect(),
            data: data.to_vec(),
        })
    }

    /// Runs the acoustic model: `ids [1, L]` int64 and `speed [1]` f32 in, every output as f32.
    pub fn run_acoustic(
        &self,
        ids: &[i64],
        speed: f32,
    ) -> Result<Vec<(String, Output<f32>)>, Error> {
        let ids = Tensor::from_array(([1usize, ids.len()], ids.to_vec()))
            .map_err(|e| Error::onnx(&self.name, e))?;
        let speed =
            Tensor::from_array(([1usize], vec![speed])).map_err(|e| Error::onnx(&self.name, e))?;
        let mut session = self.lock()?;
        let outputs = session
            .run(ort::inputs!["ids" => ids, "speed" => speed])
            .map_err(|e| Error::onnx(&self.name, e))?;
        let mut out = Vec::new();
        for (name, value) in outputs.iter() {
            let (shape, data) = value
                .try_extract_tensor::<f32>()
                .map_err(|e| Error::onnx(&self.name, e))?;
            out.push((
                name.to_string(),
                Output {
                    shape: shape.iter().copied().collect(),
                    data: data.to_vec(),
                },
            ));
        }
        Ok(out)
    }
}

/// Where the runtime library is looked for when none is given: next to the voice folder
/// (`scripts/fetch-voice.sh` puts it there), then inside it.
pub fn default_library(voice_dir: &Path) -> PathBuf {
    let name = "libonnxruntime.so";
    let beside = voice_dir.parent().map(|p| p.join(name));
    match beside {
        Some(p) if p.exists() => p,
        _ => voice_dir.join(name),
    }
}
