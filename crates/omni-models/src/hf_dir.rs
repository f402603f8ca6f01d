//! A Hugging Face checkpoint directory of safetensors files as a [`WeightSource`]: a single
//! `model.safetensors`, or shards listed in `model.safetensors.index.json`. F32, BF16 and F16
//! tensors are upcast to f32 on load.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo};

use crate::weights::{HostTensor, WeightError, WeightSource};

#[derive(Debug)]
struct MappedFile {
    path: PathBuf,
    mmap: Mmap,
    data_start: usize,
}

/// Memory-mapped safetensors files of one checkpoint directory.
#[derive(Debug)]
pub struct SafetensorsDir {
    files: Vec<MappedFile>,
    tensors: HashMap<String, (usize, TensorInfo)>,
}

fn io_err(path: &Path, source: std::io::Error) -> WeightError {
    WeightError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl SafetensorsDir {
    /// Opens `dir`: the shards of `model.safetensors.index.json` if present, else
    /// `model.safetensors`, else every `*.safetensors` file in it.
    pub fn open(dir: &Path) -> Result<Self, WeightError> {
        let index = dir.join("model.safetensors.index.json");
        let names: BTreeSet<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| io_err(&index, e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| WeightError::Invalid {
                    name: index.display().to_string(),
                    reason: e.to_string(),
                })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| WeightError::Invalid {
                    name: index.display().to_string(),
                    reason: "no `weight_map` object".into(),
                })?;
            map.values()
                .filter_map(|f| f.as_str())
                .map(|f| dir.join(f))
                .collect()
        } else if dir.join("model.safetensors").exists() {
            BTreeSet::from([dir.join("model.safetensors")])
        } else {
            std::fs::read_dir(dir)
                .map_err(|e| io_err(dir, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect()
        };
        if names.is_empty() {
            return Err(io_err(
                dir,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no .safetensors files"),
            ));
        }
        let mut files = Vec::new();
        let mut tensors = HashMap::new();
        for path in names {
            let file = File::open(&path).map_err(|e| io_err(&path, e))?;
            // SAFETY: the checkpoint is opened read-only and is not expected to change while the
            // model loads; a concurrent writer could change the bytes we read, never memory
            // safety of anything but the values.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| io_err(&path, e))?;
            let (header_len, meta): (usize, Metadata) =
                SafeTensors::read_metadata(&mmap).map_err(|e| WeightError::Invalid {
                    name: path.display().to_string(),
                    reason: e.to_string(),
                })?;
            let fi = files.len();
            for (name, info) in meta.tensors() {
                tensors.insert(name, (fi, info.clone()));
            }
            files.push(MappedFile {
                path,
                mmap,
                data_start: 8 + header_len,
            });
        }
        tracing::debug!(dir = %dir.display(), files = files.len(), tensors = tensors.len(), "opened safetensors checkpoint");
        Ok(Self { files, tensors })
    }
}

fn upcast(name: &str, dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>, WeightError> {
    let out = match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        other => {
            return Err(WeightError::Invalid {
                name: name.into(),
                reason: format!("dtype {other:?} is not supported (F32, BF16, F16 are)"),
            });
        }
    };
    Ok(out)
}

impl WeightSource for SafetensorsDir {
    fn tensor_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.tensors.keys().cloned().collect();
        v.sort();
        v
    }

    fn shape(&self, name: &str) -> Result<Vec<usize>, WeightError> {
        self.tensors
            .get(name)
            .map(|(_, i)| i.shape.clone())
            .ok_or_else(|| WeightError::Missing { name: name.into() })
    }

    fn load(&self, name: &str) -> Result<HostTensor, WeightError> {
        let (fi, info) = self
            .tensors
            .get(name)
            .ok_or_else(|| WeightError::Missing { name: name.into() })?;
        let file = &self.files[*fi];
        let (a, b) = info.data_offsets;
        let bytes = file
            .mmap
            .get(file.data_start + a..file.data_start + b)
            .ok_or_else(|| WeightError::Invalid {
                name: name.into(),
                reason: format!("data offsets out of {}", file.path.display()),
            })?;
        let data = upcast(name, info.dtype, bytes)?;
        let n: usize = info.shape.iter().product();
        if data.len() != n {
            return Err(WeightError::Invalid {
                name: name.into(),
                reason: format!("{} values for shape {:?}", data.len(), info.shape),
            });
        }
        Ok(HostTensor {
            shape: info.shape.clone(),
            data,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn bf16_and_f16_upcast_exactly() {
        let bf = half::bf16::from_f32(1.5).to_bits().to_le_bytes();
        let f = half::f16::from_f32(-2.25).to_bits().to_le_bytes();
        assert_eq!(upcast("x", Dtype::BF16, &bf).unwrap(), vec![1.5]);
        assert_eq!(upcast("x", Dtype::F16, &f).unwrap(), vec![-2.25]);
        assert!(upcast("x", Dtype::I64, &[0; 8]).is_err());
    }

    #[test]
    fn missing_directory_is_an_io_error() {
        let r = SafetensorsDir::open(Path::new("/nonexistent/omni-models-test"));
        assert!(matches!(r, Err(WeightError::Io { .. })));
    }
}
