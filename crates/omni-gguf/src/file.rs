//! The GGUF container: header, metadata, tensor infos and the aligned data section.
//!
//! ```text
//! u32 magic "GGUF" | u32 version (2 or 3) | u64 tensor_count | u64 kv_count
//! kv_count x  { string key | u32 value_type | value }
//! tensor_count x { string name | u32 n_dims | u64 dims[n_dims] (innermost first) | u32 ggml_type | u64 offset }
//! padding to `general.alignment` (default 32)
//! data section: each tensor at data_start + offset
//! ```
//! Strings are `u64 length | bytes`; arrays are `u32 element_type | u64 count | elements`.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

use crate::Error;
use crate::dequant::{GgmlType, dequantize};
use crate::value::{Value, ValueType};

/// The magic number, "GGUF" read as a little-endian u32.
pub const GGUF_MAGIC: u32 = 0x4655_4747;
/// Alignment of the data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// Arrays and strings longer than this are rejected as corrupt, before allocating.
const MAX_LEN: u64 = 1 << 32;

/// One tensor's entry in the header.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// llama.cpp name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions as stored: innermost (fastest-varying) first, the reverse of row-major shape.
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Byte offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> usize {
        self.dims.iter().map(|&d| d as usize).product()
    }

    /// Row-major shape, outermost first (`[out, in]` for a linear weight).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// Where the file's bytes live.
enum Storage {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Self::Mapped(m) => m,
            Self::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file. Tensor data stays in the memory map until asked for.
pub struct GgufFile {
    storage: Storage,
    path: Option<PathBuf>,
    version: u32,
    metadata: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    alignment: usize,
    data_start: usize,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_start", &self.data_start)
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, Error> {
        let path = path.as_ref();
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process. A checkpoint is treated as
        // immutable while it is served (the same assumption every mmap-based loader makes); if
        // another process truncated it meanwhile, reads could fault, which no safe API prevents.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let mut parsed = Self::parse(Storage::Mapped(map))?;
        parsed.path = Some(path.to_path_buf());
        Ok(parsed)
    }

    /// Parses a GGUF image held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, Error> {
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<Self, Error> {
        let bytes = storage.bytes();
        let mut r = Reader { bytes, pos: 0 };
        let magic = r.u32()?;
        if magic != GGUF_MAGIC {
            return Err(Error::BadMagic { magic });
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            // A big-endian file reads its small version number byte-swapped.
            return Err(Error::UnsupportedVersion { version });
        }
        let n_tensors = r.u64()?;
        let n_kv = r.u64()?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.value_type()?;
            let value = r.value(ty)?;
            metadata.insert(key, value);
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a as usize,
                _ => {
                    return Err(Error::Malformed {
                        reason: format!("general.alignment = {v}"),
                    });
                }
            },
        };
        let mut tensors = Vec::new();
        let mut index = HashMap::new();
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims > 8 {
                return Err(Error::Malformed {
                    reason: format!("tensor `{name}` has {n_dims} dimensions"),
                });
            }
            let dims = (0..n_dims)
                .map(|_| r.u64())
                .collect::<Result<Vec<_>, _>>()?;
            let ggml_type = GgmlType::from_tag(r.u32()?);
            let offset = r.u64()?;
            if index.insert(name.clone(), tensors.len()).is_some() {
                return Err(Error::Malformed {
                    reason: format!("tensor `{name}` appears twice"),
                });
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let data_start = r.pos.div_ceil(alignment) * alignment;
        for t in &tensors {
            let n = t
                .dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| Error::Malformed {
                    reason: format!("tensor `{}` is too large", t.name),
                })?;
            // Types this crate cannot size are only bounds-checked at their start.
            let size = t.ggml_type.byte_size(n).unwrap_or(0);
            let end = usize::try_from(t.offset)
                .ok()
                .and_then(|o| o.checked_add(data_start))
                .and_then(|o| o.checked_add(size));
            if end.is_none_or(|end| end > bytes.len()) {
                return Err(Error::Malformed {
                    reason: format!("tensor `{}` runs past the end of the file", t.name),
                });
            }
        }
        Ok(Self {
            storage,
            path: None,
            version,
            metadata,
            tensors,
            index,
            alignment,
            data_start,
        })
    }

    /// The path it was opened from, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data-section alignment in bytes.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Every metadata key and value, sorted by key.
    pub fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required string value.
    pub fn get_str(&self, key: &str) -> Result<&str, Error> {
        self.required(key)?.as_str().ok_or(Error::MetadataType {
            key: key.into(),
            expected: "a string",
        })
    }

    /// A required non-negative integer value.
    pub fn get_u64(&self, key: &str) -> Result<u64, Error> {
        self.required(key)?.as_u64().ok_or(Error::MetadataType {
            key: key.into(),
            expected: "a non-negative integer",
        })
    }

    /// A required numeric value as f64.
    pub fn get_f64(&self, key: &str) -> Result<f64, Error> {
        self.required(key)?.as_f64().ok_or(Error::MetadataType {
            key: key.into(),
            expected: "a number",
        })
    }

    /// A required array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, Error> {
        let expected = "an array of strings";
        self.required(key)?
            .as_array()
            .ok_or(Error::MetadataType {
                key: key.into(),
                expected,
            })?
            .iter()
            .map(|v| {
                v.as_str().ok_or(Error::MetadataType {
                    key: key.into(),
                    expected,
                })
            })
            .collect()
    }

    fn required(&self, key: &str) -> Result<&Value, Error> {
        self.metadata
            .get(key)
            .ok_or_else(|| Error::MissingMetadata { key: key.into() })
    }

    /// `general.architecture`, e.g. `llama`.
    pub fn architecture(&self) -> Result<&str, Error> {
        self.get_str("general.architecture")
    }

    /// Every tensor's header entry, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// One tensor's header entry by llama.cpp name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of one tensor.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8], Error> {
        let t = self
            .tensor(name)
            .ok_or_else(|| Error::TensorNotFound { name: name.into() })?;
        let size =
            t.ggml_type
                .byte_size(t.n_elements())
                .ok_or_else(|| Error::UnsupportedTensorType {
                    name: name.into(),
                    ggml_type: t.ggml_type.name(),
                })?;
        // Bounds were checked when the header was parsed.
        let start = self.data_start + t.offset as usize;
        Ok(&self.storage.bytes()[start..start + size])
    }

    /// One tensor dequantized to f32, in stored (GGUF) order, which is row-major over
    /// [`TensorInfo::shape`].
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, Error> {
        let t = self
            .tensor(name)
            .ok_or_else(|| Error::TensorNotFound { name: name.into() })?;
        let bytes = self.tensor_bytes(name)?;
        dequantize(t.ggml_type, bytes, t.n_elements()).map_err(|source| Error::Dequantize {
            name: name.into(),
            source,
        })
    }
}

/// A bounds-checked little-endian cursor.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(Error::Truncated {
                offset: self.pos,
                needed: n,
            });
        };
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Error> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32, Error> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, Error> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn len(&mut self) -> Result<usize, Error> {
        let at = self.pos;
        let n = self.u64()?;
        if n > MAX_LEN {
            return Err(Error::Malformed {
                reason: format!("length {n} at byte {at}"),
            });
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String, Error> {
        let n = self.len()?;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }

    fn value_type(&mut self) -> Result<ValueType, Error> {
        let tag = self.u32()?;
        ValueType::from_tag(tag).ok_or(Error::UnknownValueType { tag })
    }

    fn value(&mut self, ty: ValueType) -> Result<Value, Error> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>()?[0]),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array()?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array()?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array()?)),
            ValueType::U32 => Value::U32(self.u32()?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array()?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array()?)),
            ValueType::Bool => Value::Bool(self.array::<1>()?[0] != 0),
            ValueType::String => Value::String(self.string()?),
            ValueType::U64 => Value::U64(self.u64()?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array()?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array()?)),
            ValueType::Array => {
                let elem = self.value_type()?;
                let n = self.len()?;
                // Every element takes at least one byte: a count past the end is corrupt.
                if n > self.bytes.len() - self.pos {
                    return Err(Error::Truncated {
                        offset: self.pos,
                        needed: n,
                    });
                }
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::writer::GgufWriter;

    fn sample() -> Vec<u8> {
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", Value::String("llama".into()));
        w.metadata("u8", Value::U8(200));
        w.metadata("i8", Value::I8(-3));
        w.metadata("u16", Value::U16(60000));
        w.metadata("i16", Value::I16(-30000));
        w.metadata("u32", Value::U32(4_000_000_000));
        w.metadata("i32", Value::I32(-2_000_000_000));
        w.metadata("f32", Value::F32(0.5));
        w.metadata("bool", Value::Bool(true));
        w.metadata("u64", Value::U64(1 << 40));
        w.metadata("i64", Value::I64(-(1 << 40)));
        w.metadata("f64", Value::F64(-0.25));
        w.metadata(
            "strings",
            Value::Array(
                ValueType::String,
                vec![Value::String("a b".into()), Value::String("ü".into())],
            ),
        );
        w.metadata(
            "nested",
            Value::Array(
                ValueType::Array,
                vec![Value::Array(
                    ValueType::I32,
                    vec![Value::I32(1), Value::I32(-1)],
                )],
            ),
        );
        w.tensor_f32("a", &[3, 2], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        w.tensor_f32("b", &[5], &[9.0; 5]);
        w.to_bytes()
    }

    #[test]
    fn every_metadata_type_reads_back() {
        let f = GgufFile::from_bytes(sample()).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.architecture().unwrap(), "llama");
        assert_eq!(f.get("u8"), Some(&Value::U8(200)));
        assert_eq!(f.get("i8"), Some(&Value::I8(-3)));
        assert_eq!(f.get("u16"), Some(&Value::U16(60000)));
        assert_eq!(f.get("i16"), Some(&Value::I16(-30000)));
        assert_eq!(f.get_u64("u32").unwrap(), 4_000_000_000);
        assert_eq!(f.get("i32"), Some(&Value::I32(-2_000_000_000)));
        assert_eq!(f.get_f64("f32").unwrap(), 0.5);
        assert_eq!(f.get("bool"), Some(&Value::Bool(true)));
        assert_eq!(f.get_u64("u64").unwrap(), 1 << 40);
        assert_eq!(f.get("i64"), Some(&Value::I64(-(1 << 40))));
        assert_eq!(f.get_f64("f64").unwrap(), -0.25);
        assert_eq!(f.get_str_array("strings").unwrap(), ["a b", "ü"]);
        let nested = f.get("nested").unwrap().as_array().unwrap();
        assert_eq!(
            nested[0].as_array().unwrap(),
            [Value::I32(1), Value::I32(-1)]
        );
    }

    #[test]
    fn tensors_are_aligned_and_read_in_row_major_order() {
        let f = GgufFile::from_bytes(sample()).unwrap();
        let a = f.tensor("a").unwrap();
        assert_eq!(a.dims, [3, 2]);
        assert_eq!(a.shape(), [2, 3]);
        assert_eq!(f.dequantize("a").unwrap(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let b = f.tensor("b").unwrap();
        assert_eq!(b.offset % 32, 0);
        assert_eq!(f.dequantize("b").unwrap(), [9.0; 5]);
        assert!(matches!(
            f.dequantize("c"),
            Err(Error::TensorNotFound { .. })
        ));
    }

    #[test]
    fn custom_alignment_is_honoured() {
        let mut w = GgufWriter::new();
        w.metadata("general.alignment", Value::U32(64));
        w.tensor_f32("x", &[3], &[1.0, 2.0, 3.0]);
        w.tensor_f32("y", &[1], &[4.0]);
        let f = GgufFile::from_bytes(w.to_bytes()).unwrap();
        assert_eq!(f.alignment(), 64);
        assert_eq!(f.tensor("y").unwrap().offset, 64);
        assert_eq!(f.dequantize("y").unwrap(), [4.0]);
    }

    #[test]
    fn version_2_files_parse() {
        let mut bytes = sample();
        bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
        assert_eq!(GgufFile::from_bytes(bytes).unwrap().version(), 2);
    }

    #[test]
    fn corrupt_headers_are_errors_not_panics() {
        let good = sample();
        assert!(matches!(
            GgufFile::from_bytes(b"GGML....".to_vec()),
            Err(Error::BadMagic { .. })
        ));
        let mut v1 = good.clone();
        v1[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(matches!(
            GgufFile::from_bytes(v1),
            Err(Error::UnsupportedVersion { version: 1 })
        ));
        // Every truncation point fails cleanly.
        for cut in (0..good.len() - 1).step_by(7) {
            assert!(
                GgufFile::from_bytes(good[..cut].to_vec()).is_err(),
                "cut at {cut}"
            );
        }
    }
}
