//! Where weights come from: safetensors files (memory-mapped with `memmap2`,
//! headers parsed by the `safetensors` crate, each tensor copied once into an
//! MLX buffer) or `--load-format dummy` (random values made on the device).
//!
//! Every request names the expected shape, so a checkpoint that disagrees
//! with `config.json` is an error naming the tensor and file, never a panic.
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::mlx::{self, Array, Dtype, MlxError};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a valid safetensors file ({msg})")]
    Corrupt { path: PathBuf, msg: String },
    #[error("tensor `{name}` not found in {files}")]
    Missing { name: String, files: String },
    #[error("tensor `{name}` in {path}: shape {actual:?}, but config.json implies {expected:?}")]
    Shape {
        name: String,
        path: PathBuf,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("tensor `{name}` in {path}: dtype {dtype} is not supported")]
    Dtype {
        name: String,
        path: PathBuf,
        dtype: String,
    },
    #[error("{path}: weight_map lists `{file}`, which is missing")]
    IndexFile { path: PathBuf, file: String },
    #[error(transparent)]
    Mlx(#[from] MlxError),
}

/// What kind of tensor is asked for (dummy weights pick values by it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorKind {
    /// A float weight or bias.
    Float,
    /// A norm scale (dummy: ones).
    Norm,
    /// Packed quantized weights (uint32).
    Packed,
    /// Quantization scales.
    Scales,
    /// Quantization biases.
    QuantBiases,
}

struct TensorEntry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
}

/// Tensors of one checkpoint (one or several safetensors files).
pub struct SafetensorsSource {
    files: Vec<(PathBuf, Mmap)>,
    tensors: HashMap<String, TensorEntry>,
    bytes_read: std::cell::Cell<u64>,
}

impl SafetensorsSource {
    /// Open and index the given files (their headers only).
    pub fn open(paths: &[PathBuf]) -> Result<SafetensorsSource, LoadError> {
        let mut files = Vec::new();
        let mut tensors = HashMap::new();
        for (fi, path) in paths.iter().enumerate() {
            let file = File::open(path).map_err(|source| LoadError::Io {
                path: path.clone(),
                source,
            })?;
            // SAFETY: the file is opened read-only; mlxcel does not write checkpoint files while running.
            let map = unsafe { Mmap::map(&file) }.map_err(|source| LoadError::Io {
                path: path.clone(),
                source,
            })?;
            let (header_len, meta) =
                safetensors::SafeTensors::read_metadata(&map[..]).map_err(|e| {
                    LoadError::Corrupt {
                        path: path.clone(),
                        msg: e.to_string(),
                    }
                })?;
            let base = 8 + header_len;
            for (name, info) in meta.tensors() {
                let dtype_name = format!("{:?}", info.dtype);
                let dtype = Dtype::from_name(&dtype_name).ok_or_else(|| LoadError::Dtype {
                    name: name.clone(),
                    path: path.clone(),
                    dtype: dtype_name,
                })?;
                let (s, e) = info.data_offsets;
                if base + e > map.len() {
                    return Err(LoadError::Corrupt {
                        path: path.clone(),
                        msg: format!("tensor `{name}` ends past the end of the file (truncated?)"),
                    });
                }
                tensors.insert(
                    name.clone(),
                    TensorEntry {
                        file: fi,
                        dtype,
                        shape: info.shape.clone(),
                        start: base + s,
                    },
                );
            }
            files.push((path.clone(), map));
        }
        Ok(SafetensorsSource {
            files,
            tensors,
            bytes_read: std::cell::Cell::new(0),
        })
    }

    fn file_list(&self) -> String {
        self.files
            .iter()
            .map(|(p, _)| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Bytes copied out of checkpoint files so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.get()
    }
}

/// A source of named tensors.
pub enum WeightSource {
    Files(SafetensorsSource),
    /// Random weights of the right shapes, made on the device from a seed.
    Dummy {
        dtype: Dtype,
        key: std::cell::RefCell<Array>,
    },
}

impl WeightSource {
    pub fn files(paths: &[PathBuf]) -> Result<WeightSource, LoadError> {
        Ok(WeightSource::Files(SafetensorsSource::open(paths)?))
    }

    pub fn dummy(dtype: Dtype, seed: u64) -> Result<WeightSource, LoadError> {
        Ok(WeightSource::Dummy {
            dtype,
            key: std::cell::RefCell::new(mlx::random::key(seed)?),
        })
    }

    /// Whether the checkpoint has this tensor (dummy: whether it would make one).
    pub fn contains(&self, name: &str) -> bool {
        match self {
            WeightSource::Files(s) => s.tensors.contains_key(name),
            WeightSource::Dummy { .. } => true,
        }
    }

    /// Load `name`, which must have `shape`. Float tensors keep their stored dtype.
    pub fn load(&self, name: &str, shape: &[usize], kind: TensorKind) -> Result<Array, LoadError> {
        self.load_block(name, shape, None, None, kind)
    }

    /// Load the block `[rows, cols]` of `name` (full shape `shape`, 1-D or 2-D): only those
    /// bytes are read. A row range is one contiguous byte range; a column range is one
    /// segment per row.
    pub fn load_block(
        &self,
        name: &str,
        shape: &[usize],
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
        kind: TensorKind,
    ) -> Result<Array, LoadError> {
        let rows = rows.unwrap_or(0..shape.first().copied().unwrap_or(1));
        let cols = match shape.len() {
            2 => cols.unwrap_or(0..shape[1]),
            _ => 0..1,
        };
        let out_shape: Vec<usize> = if shape.len() == 2 {
            vec![rows.len(), cols.len()]
        } else {
            vec![rows.len()]
        };
        let dims: Vec<i32> = out_shape.iter().map(|&d| d as i32).collect();
        match self {
            WeightSource::Files(src) => {
                let e = src.tensors.get(name).ok_or_else(|| LoadError::Missing {
                    name: name.into(),
                    files: src.file_list(),
                })?;
                let (path, map) = &src.files[e.file];
                if e.shape != shape {
                    return Err(LoadError::Shape {
                        name: name.into(),
                        path: path.clone(),
                        expected: shape.to_vec(),
                        actual: e.shape.clone(),
                    });
                }
                let want_packed = kind == TensorKind::Packed;
                if want_packed != (e.dtype == Dtype::U32) || (!want_packed && !e.dtype.is_float()) {
                    return Err(LoadError::Dtype {
                        name: name.into(),
                        path: path.clone(),
                        dtype: e.dtype.name().into(),
                    });
                }
                let elt = e.dtype.size();
                let row_bytes = if shape.len() == 2 {
                    shape[1] * elt
                } else {
                    elt
                };
                let arr = if cols.len() * elt == row_bytes {
                    // whole rows: one contiguous range
                    let a = e.start + rows.start * row_bytes;
                    let b = e.start + rows.end * row_bytes;
                    src.bytes_read.set(src.bytes_read.get() + (b - a) as u64);
                    Array::from_bytes(&map[a..b], &dims, e.dtype)?
                } else {
                    let seg = cols.len() * elt;
                    let mut buf = Vec::with_capacity(rows.len() * seg);
                    for r in rows.clone() {
                        let a = e.start + r * row_bytes + cols.start * elt;
                        buf.extend_from_slice(&map[a..a + seg]);
                    }
                    src.bytes_read.set(src.bytes_read.get() + buf.len() as u64);
                    Array::from_bytes(&buf, &dims, e.dtype)?
                };
                Ok(arr)
            }
            WeightSource::Dummy { dtype, key } => {
                let mut k = key.borrow_mut();
                let mut keys = mlx::random::split(&k, 2)?;
                let sub = keys.pop().unwrap();
                *k = keys.pop().unwrap();
                let fan_in = *shape.last().unwrap_or(&1) as f32;
                let a = match kind {
                    TensorKind::Norm => Array::full(&dims, 1.0, *dtype)?,
                    TensorKind::Float => {
                        mlx::random::normal(&dims, *dtype, 0.0, fan_in.powf(-0.5), &sub)?
                    }
                    TensorKind::Packed => mlx::random::uniform(&dims, Dtype::F32, &sub)?
                        .mul_scalar(4_294_967_040.0)?
                        .astype(Dtype::U32)?,
                    TensorKind::Scales => Array::full(&dims, 0.02, *dtype)?,
                    TensorKind::QuantBiases => Array::full(&dims, -0.15, *dtype)?,
                };
                Ok(a)
            }
        }
    }

    /// Bytes read from checkpoint files (0 for dummy weights).
    pub fn bytes_read(&self) -> u64 {
        match self {
            WeightSource::Files(s) => s.bytes_read(),
            WeightSource::Dummy { .. } => 0,
        }
    }
}

/// The distinct files of a `model.safetensors.index.json`, checked to exist.
pub fn index_files(index: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let text = std::fs::read_to_string(index).map_err(|source| LoadError::Io {
        path: index.into(),
        source,
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| LoadError::Corrupt {
        path: index.into(),
        msg: e.to_string(),
    })?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| LoadError::Corrupt {
            path: index.into(),
            msg: "no `weight_map` object".into(),
        })?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<String> = map
        .values()
        .filter_map(|f| f.as_str().map(String::from))
        .collect();
    files.sort();
    files.dedup();
    files
        .into_iter()
        .map(|f| {
            let p = dir.join(&f);
            if p.is_file() {
                Ok(p)
            } else {
                Err(LoadError::IndexFile {
                    path: index.into(),
                    file: f,
                })
            }
        })
        .collect()
}
