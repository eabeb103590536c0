//! Where weights come from: the [`WeightSource`] trait, and its sources —
//! safetensors files ([`SafetensorsSource`]), `--load-format dummy` (random values
//! made on the device, [`DummySource`]) and a cast of another source ([`CastSource`]).
//!
//! Checkpoint files are read with positioned reads (`pread`), never mapped: a
//! tensor-parallel rank reads exactly its byte ranges — one range for a block of
//! whole rows, one segment per row for a block of columns, adjacent segments
//! coalesced — into a short-lived buffer that MLX copies once. Nothing of the
//! file stays resident in the process (a mapping would keep every touched page
//! in its RSS), so a rank's memory is its shard plus one block in flight.
//!
//! With a `model.safetensors.index.json`, a file is opened (its header read) the
//! first time a tensor in it is asked for, so a rank never opens files that hold
//! only tensors it does not need. Without an index every file's header is read
//! up front (to know where tensors are); headers are small.
//!
//! Every request names the expected shape, so a checkpoint that disagrees
//! with `config.json` is an error naming the tensor and file, never a panic.
use std::cell::{Cell, OnceCell};
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::kernels;
use crate::mlx::{self, Array, Dtype, MlxError};
use crate::model_dir::ModelDir;

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
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
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

/// Dtype, shape and absolute byte offset of one tensor in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Offset of the tensor's first byte from the start of the file.
    pub start: u64,
}

/// The header of one safetensors file: its tensors (no data is read).
pub fn read_header(path: &Path) -> Result<HashMap<String, TensorEntry>, LoadError> {
    let file = File::open(path).map_err(|source| LoadError::Io {
        path: path.into(),
        source,
    })?;
    read_header_of(&file, path)
}

fn read_header_of(file: &File, path: &Path) -> Result<HashMap<String, TensorEntry>, LoadError> {
    let corrupt = |msg: String| LoadError::Corrupt {
        path: path.into(),
        msg,
    };
    let len = file
        .metadata()
        .map_err(|source| LoadError::Io {
            path: path.into(),
            source,
        })?
        .len();
    let mut n = [0u8; 8];
    read_at(file, path, &mut n, 0).map_err(|_| corrupt("shorter than 8 bytes".into()))?;
    let n = u64::from_le_bytes(n);
    if n > 100_000_000 || 8 + n > len {
        return Err(corrupt(format!(
            "header length {n} does not fit in the file ({len} bytes)"
        )));
    }
    let mut header = vec![0u8; n as usize];
    read_at(file, path, &mut header, 8)?;
    let text = std::str::from_utf8(&header).map_err(|e| corrupt(format!("header: {e}")))?;
    let meta: safetensors::tensor::Metadata =
        serde_json::from_str(text).map_err(|e| corrupt(format!("header: {e}")))?;
    let base = 8 + n;
    let mut out = HashMap::new();
    for (name, info) in meta.tensors() {
        let dtype_name = format!("{:?}", info.dtype);
        let dtype = Dtype::from_name(&dtype_name).ok_or_else(|| LoadError::Dtype {
            name: name.clone(),
            path: path.into(),
            dtype: dtype_name,
        })?;
        let (s, e) = info.data_offsets;
        let numel: usize = info.shape.iter().product();
        if e < s || (e - s) != numel * dtype.size() {
            return Err(corrupt(format!(
                "tensor `{name}`: data_offsets {s}..{e} do not match shape {:?} of {}",
                info.shape,
                dtype.name()
            )));
        }
        if base + e as u64 > len {
            return Err(corrupt(format!(
                "tensor `{name}` ends past the end of the file (truncated?)"
            )));
        }
        out.insert(
            name.clone(),
            TensorEntry {
                dtype,
                shape: info.shape.clone(),
                start: base + s as u64,
            },
        );
    }
    Ok(out)
}

/// Read exactly `buf.len()` bytes at `offset`.
fn read_at(file: &File, path: &Path, buf: &mut [u8], offset: u64) -> Result<(), LoadError> {
    #[cfg(unix)]
    let r = std::os::unix::fs::FileExt::read_exact_at(file, buf, offset);
    #[cfg(windows)]
    let r = {
        use std::os::windows::fs::FileExt;
        let (mut done, mut res) = (0usize, Ok(()));
        while done < buf.len() {
            match file.seek_read(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    res = Err(std::io::ErrorKind::UnexpectedEof.into());
                    break;
                }
                Ok(k) => done += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    res = Err(e);
                    break;
                }
            }
        }
        res
    };
    r.map_err(|source| LoadError::Io {
        path: path.into(),
        source,
    })
}

/// The byte ranges (absolute offset, length) of the block `rows × cols` of a row-major
/// 2-D tensor starting at `start` with rows of `row_bytes` bytes and elements of `elt`
/// bytes; adjacent segments are merged, so a block of whole rows is one range.
pub fn block_ranges(
    start: u64,
    row_bytes: usize,
    elt: usize,
    rows: Range<usize>,
    cols: Range<usize>,
) -> Vec<(u64, usize)> {
    let seg = cols.len() * elt;
    let mut out: Vec<(u64, usize)> = Vec::new();
    if seg == 0 {
        return out;
    }
    for r in rows {
        let a = start + (r * row_bytes + cols.start * elt) as u64;
        match out.last_mut() {
            Some((s, l)) if *s + *l as u64 == a => *l += seg,
            _ => out.push((a, seg)),
        }
    }
    out
}

struct OpenFile {
    file: File,
    tensors: HashMap<String, TensorEntry>,
}

/// Tensors of one checkpoint (one or several safetensors files), opened lazily when
/// an index says where each tensor is.
pub struct SafetensorsSource {
    paths: Vec<PathBuf>,
    /// Tensor → file (index's `weight_map`); `None`: every file was opened up front.
    map: Option<HashMap<String, usize>>,
    files: Vec<OnceCell<OpenFile>>,
    bytes_read: Cell<u64>,
    /// One staging buffer for every read: a fresh one per tensor costs a page fault per
    /// page (large allocations are mapped and unmapped each time).
    scratch: std::cell::RefCell<Vec<u8>>,
}

/// The staging buffer is kept between reads up to this size (larger ones, e.g. an
/// embedding table, are freed at once rather than held for the rest of the load).
const SCRATCH_KEEP_BYTES: usize = 256 << 20;

/// Weights smaller than this are copied into device memory on CUDA once read
/// (`MLXCEL_DEVICE_CONSTS`); larger ones have pages of their own.
const DEVICE_COPY_BYTES: usize = 1 << 20;

/// A constant that decode kernels read in every layer (a small weight, RoPE's table), made
/// from host data: in device memory on CUDA rather than unified memory, where it may share
/// pages the host writes (`MLXCEL_DEVICE_CONSTS`, [`mlx::device_inputs::device_copy`]).
pub(crate) fn device_const(a: Array) -> mlx::Result<Array> {
    match kernels::knobs::get().device_consts {
        true => mlx::device_inputs::device_copy(&a),
        false => Ok(a),
    }
}

impl SafetensorsSource {
    /// An array of shape `dims` from the bytes `fill` appends to the (emptied) staging
    /// buffer; `fill` returns their dtype.
    fn read_staged(
        &self,
        dims: &[i32],
        fill: impl FnOnce(&mut Vec<u8>) -> Result<Dtype, LoadError>,
    ) -> Result<Array, LoadError> {
        let mut buf = self.scratch.borrow_mut();
        buf.clear();
        let dtype = fill(&mut buf)?;
        let a = Array::from_bytes(&buf, dims, dtype)?;
        if buf.capacity() > SCRATCH_KEEP_BYTES {
            *buf = Vec::new();
        }
        // (a norm, a bias)
        Ok(match a.nbytes() < DEVICE_COPY_BYTES {
            true => device_const(a)?,
            false => a,
        })
    }

    /// Append the bytes of block `[rows, cols]` of `name` (full shape `shape`) to `buf`;
    /// returns the tensor's dtype. Checks shape and dtype against `kind`.
    fn append_block(
        &self,
        name: &str,
        shape: &[usize],
        rows: Range<usize>,
        cols: Range<usize>,
        kind: TensorKind,
        buf: &mut Vec<u8>,
    ) -> Result<Dtype, LoadError> {
        self.append_stacked(name, shape, None, rows, cols, kind, buf)
    }

    /// [`Self::append_block`] of a 1-, 2- or 3-D tensor; for a 3-D (stacked experts)
    /// tensor the block `rows × cols` of the last two axes of each expert in `experts`
    /// (all when `None`), expert after expert.
    #[allow(clippy::too_many_arguments)]
    fn append_stacked(
        &self,
        name: &str,
        shape: &[usize],
        experts: Option<Range<usize>>,
        rows: Range<usize>,
        cols: Range<usize>,
        kind: TensorKind,
        buf: &mut Vec<u8>,
    ) -> Result<Dtype, LoadError> {
        let (fi, e) = self.find(name)?.ok_or_else(|| LoadError::Missing {
            name: name.into(),
            files: self.file_list(),
        })?;
        let path = &self.paths[fi];
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
        let row_bytes = if shape.len() >= 2 {
            shape[shape.len() - 1] * elt
        } else {
            elt
        };
        let (lead, stride) = match shape.len() {
            3 => (experts.unwrap_or(0..shape[0]), shape[1] * shape[2] * elt),
            _ => (0..1, 0),
        };
        let ranges: Vec<(u64, usize)> = lead
            .flat_map(|x| {
                let start = e.start + (x * stride) as u64;
                block_ranges(start, row_bytes, elt, rows.clone(), cols.clone())
            })
            .collect();
        let total: usize = ranges.iter().map(|r| r.1).sum();
        let mut at = buf.len();
        buf.resize(at + total, 0);
        let file = &self.file(fi)?.file;
        for (off, len) in ranges {
            read_at(file, path, &mut buf[at..at + len], off)?;
            at += len;
        }
        self.bytes_read.set(self.bytes_read.get() + total as u64);
        Ok(e.dtype)
    }

    /// Open the given files and read all their headers (no tensor data).
    pub fn open(paths: &[PathBuf]) -> Result<SafetensorsSource, LoadError> {
        let src = SafetensorsSource {
            paths: paths.to_vec(),
            map: None,
            files: paths.iter().map(|_| OnceCell::new()).collect(),
            bytes_read: Cell::new(0),
            scratch: Default::default(),
        };
        for i in 0..paths.len() {
            src.file(i)?;
        }
        Ok(src)
    }

    /// The files of an index's `weight_map` (`files` are the distinct files it names, as in
    /// [`ModelDir::weights`]); each is opened the first time one of its tensors is loaded.
    pub fn open_indexed(index: &Path, files: &[PathBuf]) -> Result<SafetensorsSource, LoadError> {
        let by_name: HashMap<String, usize> = files
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.file_name().map(|n| (n.to_string_lossy().into_owned(), i)))
            .collect();
        let mut map = HashMap::new();
        for (tensor, file) in index_map(index)? {
            let i = *by_name.get(&file).ok_or_else(|| LoadError::IndexFile {
                path: index.into(),
                file: file.clone(),
            })?;
            map.insert(tensor, i);
        }
        Ok(SafetensorsSource {
            paths: files.to_vec(),
            map: Some(map),
            files: files.iter().map(|_| OnceCell::new()).collect(),
            bytes_read: Cell::new(0),
            scratch: Default::default(),
        })
    }

    fn file(&self, i: usize) -> Result<&OpenFile, LoadError> {
        if let Some(f) = self.files[i].get() {
            return Ok(f);
        }
        let path = &self.paths[i];
        let file = File::open(path).map_err(|source| LoadError::Io {
            path: path.clone(),
            source,
        })?;
        let tensors = read_header_of(&file, path)?;
        tracing::debug!("opened {} ({} tensors)", path.display(), tensors.len());
        let _ = self.files[i].set(OpenFile { file, tensors });
        Ok(self.files[i].get().expect("just set"))
    }

    /// Where `name` is: its file index and entry.
    fn find(&self, name: &str) -> Result<Option<(usize, &TensorEntry)>, LoadError> {
        match &self.map {
            Some(map) => match map.get(name) {
                None => Ok(None),
                Some(&i) => Ok(self.file(i)?.tensors.get(name).map(|e| (i, e))),
            },
            None => Ok((0..self.files.len()).find_map(|i| {
                self.files[i]
                    .get()
                    .and_then(|f| f.tensors.get(name))
                    .map(|e| (i, e))
            })),
        }
    }

    fn file_list(&self) -> String {
        self.paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Files whose header has been read so far.
    pub fn files_opened(&self) -> usize {
        self.files.iter().filter(|f| f.get().is_some()).count()
    }
}

/// Tensor name → file name, from an index's `weight_map`.
pub fn index_map(index: &Path) -> Result<HashMap<String, String>, LoadError> {
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
    Ok(map
        .iter()
        .filter_map(|(k, f)| f.as_str().map(|f| (k.clone(), f.to_string())))
        .collect())
}

/// Every tensor's dtype and shape in a model folder's checkpoint (headers only; a GGUF's
/// tensors as they will be handed to MLX).
pub fn catalog(dir: &ModelDir) -> Result<HashMap<String, TensorEntry>, LoadError> {
    if dir.is_gguf() {
        return Ok(super::gguf::catalog(&crate::gguf::GgufModel::open(
            &dir.weights[0],
        )?));
    }
    let mut all = HashMap::new();
    for p in &dir.weights {
        all.extend(read_header(p)?);
    }
    Ok(all)
}

/// Rows of a tensor: its name, full shape and row range (all rows when `None`).
pub type RowBlock = (String, Vec<usize>, Option<Range<usize>>);

/// What a source knows of one tensor before reading it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The stored shape (for packed quantized weights: the packed `uint32` shape).
    pub shape: Vec<usize>,
    /// The stored element type.
    pub dtype: Dtype,
}

/// A source of named tensors: the loader asks for tensors by their Hugging Face /
/// mlx-community names (`model.layers.0.self_attn.q_proj.weight`) with the shape the
/// config implies, and for blocks of them (a tensor-parallel rank's rows or columns).
///
/// A source must provide:
/// - [`info`](WeightSource::info): whether a tensor exists, and its stored shape and
///   dtype (the memory plan and the quantized/dense choice read it);
/// - [`load_block`](WeightSource::load_block): the block `[rows, cols]` of a 1-D or 2-D
///   tensor as an MLX array, reading no more than those bytes where it reads files,
///   with an error naming the tensor when it is missing or its shape is not the one asked;
/// - [`bytes_read`](WeightSource::bytes_read): bytes copied out of files so far.
///
/// [`load`](WeightSource::load), [`contains`](WeightSource::contains) and
/// [`load_concat`](WeightSource::load_concat) have default implementations over those;
/// a file-backed source overrides `load_concat` to read stacked blocks into one buffer.
/// Implementations: [`SafetensorsSource`], [`DummySource`], [`CastSource`].
pub trait WeightSource {
    /// The stored shape and dtype of `name`; `None` when the source has no such tensor
    /// (a source that makes tensors on demand answers `None`, and `contains` is true).
    fn info(&self, name: &str) -> Result<Option<TensorInfo>, LoadError>;

    /// The block `[rows, cols]` of `name` (full shape `shape`, 1-D or 2-D; all rows or
    /// columns when `None`), which must have that shape and be of kind `kind`.
    fn load_block(
        &self,
        name: &str,
        shape: &[usize],
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
        kind: TensorKind,
    ) -> Result<Array, LoadError>;

    /// Bytes read from checkpoint files so far (0 for made-up weights).
    fn bytes_read(&self) -> u64;

    /// The block `experts × rows × cols` of the stacked expert tensor `name` (full shape
    /// `shape`, `[E, R, C]`; all rows or columns when `None`), reading only those bytes where
    /// the source reads files. By default the rows and columns of each expert, stacked.
    fn load_stacked(
        &self,
        name: &str,
        shape: &[usize],
        experts: Range<usize>,
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
        kind: TensorKind,
    ) -> Result<Array, LoadError> {
        let _ = (shape, experts, rows, cols, kind);
        Err(LoadError::Mlx(MlxError::Invalid(format!(
            "{name}: stacked expert tensors are not supported by this weight source"
        ))))
    }

    /// Whether the checkpoint has this tensor.
    fn contains(&self, name: &str) -> bool {
        self.info(name).is_ok_and(|i| i.is_some())
    }

    /// Load `name`, which must have `shape`. Float tensors keep their stored dtype.
    fn load(&self, name: &str, shape: &[usize], kind: TensorKind) -> Result<Array, LoadError> {
        self.load_block(name, shape, None, None, kind)
    }

    /// Row blocks of several tensors stacked along the first axis, as one array: rows
    /// `rows` (all when `None`) of each `(name, shape)`. By default one array per part,
    /// concatenated.
    fn load_concat(&self, parts: &[RowBlock], kind: TensorKind) -> Result<Array, LoadError> {
        concat_blocks(self, parts, kind)
    }
}

/// Each part loaded on its own, then concatenated (what [`WeightSource::load_concat`] does
/// by default).
fn concat_blocks<S: WeightSource + ?Sized>(
    src: &S,
    parts: &[RowBlock],
    kind: TensorKind,
) -> Result<Array, LoadError> {
    let arrays = parts
        .iter()
        .map(|(name, shape, rows)| src.load_block(name, shape, rows.clone(), None, kind))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(mlx::concatenate(&arrays.iter().collect::<Vec<_>>(), 0)?)
}

/// The rows and columns of a block request, filled in, and the block's shape.
fn block_bounds(
    shape: &[usize],
    rows: Option<Range<usize>>,
    cols: Option<Range<usize>>,
) -> (Range<usize>, Range<usize>, Vec<i32>) {
    let rows = rows.unwrap_or(0..shape.first().copied().unwrap_or(1));
    let cols = match shape.len() {
        2 => cols.unwrap_or(0..shape[1]),
        _ => 0..1,
    };
    let dims = if shape.len() == 2 {
        vec![rows.len() as i32, cols.len() as i32]
    } else {
        vec![rows.len() as i32]
    };
    (rows, cols, dims)
}

/// A stacked block's rows, columns and shape.
type StackedBounds = (Range<usize>, Range<usize>, Vec<i32>);

/// The experts, rows and columns of a stacked block request (`[E, R, C]`), filled in,
/// and the block's shape.
fn stacked_bounds(
    shape: &[usize],
    experts: Range<usize>,
    rows: Option<Range<usize>>,
    cols: Option<Range<usize>>,
) -> Result<StackedBounds, LoadError> {
    if shape.len() != 3 || experts.end > shape[0] {
        return Err(LoadError::Mlx(MlxError::Invalid(format!(
            "stacked block: shape {shape:?} is not [experts, rows, cols] holding experts {experts:?}"
        ))));
    }
    let rows = rows.unwrap_or(0..shape[1]);
    let cols = cols.unwrap_or(0..shape[2]);
    let dims = [experts.len(), rows.len(), cols.len()].map(|d| d as i32);
    Ok((rows, cols, dims.to_vec()))
}

impl SafetensorsSource {
    /// A model folder's checkpoint: with an index, files are opened on first use.
    pub fn from_dir(dir: &ModelDir) -> Result<SafetensorsSource, LoadError> {
        match &dir.index {
            Some(index) => SafetensorsSource::open_indexed(index, &dir.weights),
            None => SafetensorsSource::open(&dir.weights),
        }
    }
}

impl WeightSource for SafetensorsSource {
    fn info(&self, name: &str) -> Result<Option<TensorInfo>, LoadError> {
        Ok(self.find(name)?.map(|(_, e)| TensorInfo {
            shape: e.shape.clone(),
            dtype: e.dtype,
        }))
    }

    /// From the index alone where there is one (no file is opened).
    fn contains(&self, name: &str) -> bool {
        match &self.map {
            Some(map) => map.contains_key(name),
            None => self
                .files
                .iter()
                .any(|f| f.get().is_some_and(|f| f.tensors.contains_key(name))),
        }
    }

    /// A row range is one contiguous byte range; a column range is one segment per row.
    fn load_block(
        &self,
        name: &str,
        shape: &[usize],
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
        kind: TensorKind,
    ) -> Result<Array, LoadError> {
        let (rows, cols, dims) = block_bounds(shape, rows, cols);
        self.read_staged(&dims, |buf| {
            self.append_block(name, shape, rows, cols, kind, buf)
        })
    }

    fn bytes_read(&self) -> u64 {
        self.bytes_read.get()
    }

    /// One segment per row of each expert's block (whole rows of consecutive experts merge).
    fn load_stacked(
        &self,
        name: &str,
        shape: &[usize],
        experts: Range<usize>,
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
        kind: TensorKind,
    ) -> Result<Array, LoadError> {
        let (rows, cols, dims) = stacked_bounds(shape, experts.clone(), rows, cols)?;
        self.read_staged(&dims, |buf| {
            self.append_stacked(name, shape, Some(experts), rows, cols, kind, buf)
        })
    }

    /// Where the parts agree in dtype and in their other dimensions, they are read straight
    /// into one buffer: one copy and no concatenation afterwards (which would allocate and
    /// copy them again).
    fn load_concat(&self, parts: &[RowBlock], kind: TensorKind) -> Result<Array, LoadError> {
        if let Some(first) = parts.first().filter(|p| !p.1.is_empty()) {
            let tail = &first.1[1..];
            let dtype_of = |name: &str| Ok::<_, LoadError>(self.find(name)?.map(|(_, e)| e.dtype));
            let first_dtype = dtype_of(&first.0)?;
            let mut alike = first_dtype.is_some();
            for (name, shape, _) in parts {
                alike &= !shape.is_empty() && &shape[1..] == tail && dtype_of(name)? == first_dtype;
            }
            if let (true, Some(dtype)) = (alike, first_dtype) {
                let n_rows: usize = parts
                    .iter()
                    .map(|(_, shape, rows)| rows.as_ref().map_or(shape[0], |r| r.len()))
                    .sum();
                let dims: Vec<i32> = std::iter::once(n_rows)
                    .chain(tail.iter().copied())
                    .map(|d| d as i32)
                    .collect();
                return self.read_staged(&dims, |buf| {
                    for (name, shape, rows) in parts {
                        let rows = rows.clone().unwrap_or(0..shape[0]);
                        let cols = if shape.len() == 2 { 0..shape[1] } else { 0..1 };
                        self.append_block(name, shape, rows, cols, kind, buf)?;
                    }
                    Ok(dtype)
                });
            }
        }
        // parts that differ: one array each, concatenated
        concat_blocks(self, parts, kind)
    }
}

/// Random weights of the right shapes from config.json alone, made on the device. Every
/// block is drawn from its own key, made of `seed`, the tensor's name and the block's rows
/// and columns: a tensor every rank holds whole (embeddings, `lm_head`) is the same on
/// every rank, as TP needs (each rank samples from its own replicated logits).
#[derive(Debug, Clone, Copy)]
pub struct DummySource {
    pub dtype: Dtype,
    pub seed: u64,
}

impl DummySource {
    pub fn new(dtype: Dtype, seed: u64) -> DummySource {
        DummySource { dtype, seed }
    }
}

impl WeightSource for DummySource {
    /// Nothing is stored: every name is made on demand.
    fn info(&self, _name: &str) -> Result<Option<TensorInfo>, LoadError> {
        Ok(None)
    }

    fn contains(&self, _name: &str) -> bool {
        true
    }

    fn load_block(
        &self,
        name: &str,
        shape: &[usize],
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
        kind: TensorKind,
    ) -> Result<Array, LoadError> {
        let (rows, cols, dims) = block_bounds(shape, rows, cols);
        self.make(name, shape, &dims, &rows, &cols, kind)
    }

    fn load_stacked(
        &self,
        name: &str,
        shape: &[usize],
        experts: Range<usize>,
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
        kind: TensorKind,
    ) -> Result<Array, LoadError> {
        let (rows, cols, dims) = stacked_bounds(shape, experts.clone(), rows, cols)?;
        // the experts' bounds are part of the key, like the rows' and columns'
        let keyed = format!("{name}#{}..{}", experts.start, experts.end);
        self.make(&keyed, shape, &dims, &rows, &cols, kind)
    }

    fn bytes_read(&self) -> u64 {
        0
    }
}

impl DummySource {
    /// Values of a block of shape `dims` of `name` (full shape `shape`).
    fn make(
        &self,
        name: &str,
        shape: &[usize],
        dims: &[i32],
        rows: &Range<usize>,
        cols: &Range<usize>,
        kind: TensorKind,
    ) -> Result<Array, LoadError> {
        let sub = mlx::random::key(block_seed(self.seed, name, rows, cols))?;
        let fan_in = *shape.last().unwrap_or(&1) as f32;
        let dtype = self.dtype;
        let dims = dims.to_vec();
        Ok(match kind {
            TensorKind::Norm => Array::full(&dims, 1.0, dtype)?,
            TensorKind::Float => mlx::random::normal(&dims, dtype, 0.0, fan_in.powf(-0.5), &sub)?,
            TensorKind::Packed => mlx::random::uniform(&dims, Dtype::F32, &sub)?
                .mul_scalar(4_294_967_040.0)?
                .astype(Dtype::U32)?,
            TensorKind::Scales => Array::full(&dims, 0.02, dtype)?,
            TensorKind::QuantBiases => Array::full(&dims, -0.15, dtype)?,
        })
    }
}

/// Another source with every float tensor cast to `dtype` (packed weights as they are),
/// e.g. an f32 reference of a bf16 model.
pub struct CastSource {
    pub inner: Box<dyn WeightSource>,
    pub dtype: Dtype,
}

impl CastSource {
    pub fn new(inner: Box<dyn WeightSource>, dtype: Dtype) -> CastSource {
        CastSource { inner, dtype }
    }
}

impl CastSource {
    fn cast(&self, a: Array, kind: TensorKind) -> Result<Array, LoadError> {
        match kind {
            TensorKind::Packed => Ok(a),
            _ => Ok(a.astype(self.dtype)?),
        }
    }
}

impl WeightSource for CastSource {
    fn info(&self, name: &str) -> Result<Option<TensorInfo>, LoadError> {
        self.inner.info(name)
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn load_block(
        &self,
        name: &str,
        shape: &[usize],
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
        kind: TensorKind,
    ) -> Result<Array, LoadError> {
        let a = self.inner.load_block(name, shape, rows, cols, kind)?;
        self.cast(a, kind)
    }

    fn load_stacked(
        &self,
        name: &str,
        shape: &[usize],
        experts: Range<usize>,
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
        kind: TensorKind,
    ) -> Result<Array, LoadError> {
        let a = self
            .inner
            .load_stacked(name, shape, experts, rows, cols, kind)?;
        self.cast(a, kind)
    }

    fn bytes_read(&self) -> u64 {
        self.inner.bytes_read()
    }
}

/// The key of a dummy block: FNV-1a over the name and the block's bounds, mixed with `seed`.
fn block_seed(seed: u64, name: &str, rows: &Range<usize>, cols: &Range<usize>) -> u64 {
    let bounds = [rows.start, rows.end, cols.start, cols.end].map(|b| b as u64);
    let bytes = name
        .bytes()
        .chain(bounds.iter().flat_map(|b| b.to_le_bytes()));
    let h = bytes.fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    #[test]
    fn block_ranges_are_exact_and_coalesced() {
        // [4, 8] f32 at offset 100: columns 2..6 of rows 1..3 → one segment per row
        assert_eq!(
            block_ranges(100, 32, 4, 1..3, 2..6),
            vec![(100 + 32 + 8, 16), (100 + 64 + 8, 16)]
        );
        // whole rows merge into one range
        assert_eq!(block_ranges(100, 32, 4, 1..4, 0..8), vec![(132, 96)]);
        // one row, one range
        assert_eq!(block_ranges(0, 32, 4, 2..3, 4..8), vec![(80, 16)]);
        assert!(block_ranges(0, 32, 4, 0..4, 3..3).is_empty());
    }

    fn write(path: &Path, tensors: &[(&str, Vec<usize>, Vec<f32>)]) {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .zip(&bytes)
            .map(|((n, s, _), b)| {
                (
                    n.to_string(),
                    TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    /// An empty folder of this test under the temp dir, removed when the guard drops.
    fn fresh_dir(tag: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("mlxcel-{tag}-test-"))
            .tempdir()
            .unwrap()
    }

    #[test]
    fn indexed_files_open_lazily_and_blocks_read_only_their_bytes() {
        let tmp = fresh_dir("weights");
        let dir = tmp.path();
        let w: Vec<f32> = (0..6 * 8).map(|i| i as f32).collect();
        write(&dir.join("a.safetensors"), &[("w", vec![6, 8], w.clone())]);
        write(
            &dir.join("b.safetensors"),
            &[("unused", vec![4], vec![1.0; 4])],
        );
        let index = dir.join("model.safetensors.index.json");
        std::fs::write(
            &index,
            r#"{"weight_map": {"w": "a.safetensors", "unused": "b.safetensors"}}"#,
        )
        .unwrap();
        let files = vec![dir.join("a.safetensors"), dir.join("b.safetensors")];
        let src = SafetensorsSource::open_indexed(&index, &files).unwrap();
        assert_eq!(src.files_opened(), 0);
        assert!(src.contains("unused") && !src.contains("nope"));
        // columns 2..5 of rows 1..4
        let a = src
            .load_block("w", &[6, 8], Some(1..4), Some(2..5), TensorKind::Float)
            .unwrap();
        let got: Vec<f32> = a.to_vec().unwrap();
        let want: Vec<f32> = (1..4)
            .flat_map(|r| (2..5).map(move |c| (r * 8 + c) as f32))
            .collect();
        assert_eq!(got, want);
        assert_eq!(src.bytes_read(), 3 * 3 * 4);
        assert_eq!(src.files_opened(), 1, "b.safetensors holds nothing needed");
        let info = src.info("w").unwrap().unwrap();
        assert_eq!((info.shape, info.dtype), (vec![6, 8], Dtype::F32));
        assert!(src.info("nope").unwrap().is_none());
        let e = src.load("missing", &[1], TensorKind::Float).unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");
        let e = src.load("w", &[6, 9], TensorKind::Float).unwrap_err();
        assert!(e.to_string().contains("a.safetensors"), "{e}");
    }

    #[test]
    fn dummy_blocks_depend_on_name_and_bounds_not_on_the_source() {
        // two sources stand for two ranks: a tensor both hold whole must be equal
        let (a, b) = (
            DummySource::new(Dtype::F32, 0),
            DummySource::new(Dtype::F32, 0),
        );
        let load = |s: &DummySource, name: &str, rows: Range<usize>| -> Vec<f32> {
            s.load_block(name, &[8, 4], Some(rows), None, TensorKind::Float)
                .unwrap()
                .to_vec()
                .unwrap()
        };
        let whole = load(&a, "lm_head.weight", 0..8);
        load(&a, "model.embed_tokens.weight", 0..8); // draws in between change nothing
        assert_eq!(whole, load(&b, "lm_head.weight", 0..8));
        assert_ne!(whole, load(&a, "model.embed_tokens.weight", 0..8));
        // two ranks' blocks of a split tensor differ
        assert_ne!(load(&a, "w", 0..4), load(&b, "w", 4..8));
        let other_seed = DummySource::new(Dtype::F32, 1);
        assert_ne!(whole, load(&other_seed, "lm_head.weight", 0..8));
    }

    #[test]
    fn cast_source_converts_float_tensors_only() {
        let src = DummySource::new(Dtype::BF16, 3);
        let plain = src.load("w", &[4, 8], TensorKind::Float).unwrap();
        let packed = src.load("q", &[4, 2], TensorKind::Packed).unwrap();
        let cast = CastSource::new(Box::new(DummySource::new(Dtype::BF16, 3)), Dtype::F32);
        let w = cast.load("w", &[4, 8], TensorKind::Float).unwrap();
        assert_eq!((plain.dtype(), w.dtype()), (Dtype::BF16, Dtype::F32));
        let exact: Vec<f32> = plain.astype(Dtype::F32).unwrap().to_vec().unwrap();
        assert_eq!(
            w.to_vec::<f32>().unwrap(),
            exact,
            "the same values, widened"
        );
        let q = cast.load("q", &[4, 2], TensorKind::Packed).unwrap();
        assert_eq!(q.dtype(), Dtype::U32);
        assert_eq!(q.to_vec::<u32>().unwrap(), packed.to_vec::<u32>().unwrap());
        assert!(cast.contains("anything") && cast.bytes_read() == 0);
    }

    #[test]
    fn load_concat_stacks_row_blocks_as_read() {
        let tmp = fresh_dir("concat");
        let dir = tmp.path();
        let a: Vec<f32> = (0..4 * 3).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..2 * 3).map(|i| 100.0 + i as f32).collect();
        let path = dir.join("m.safetensors");
        write(&path, &[("a", vec![4, 3], a), ("b", vec![2, 3], b)]);
        let src = SafetensorsSource::open(std::slice::from_ref(&path)).unwrap();
        let parts = vec![
            ("a".to_string(), vec![4, 3], Some(1..3)),
            ("b".to_string(), vec![2, 3], None),
        ];
        let got = src.load_concat(&parts, TensorKind::Float).unwrap();
        assert_eq!(got.shape(), vec![4, 3]);
        let want: Vec<f32> = [3., 4., 5., 6., 7., 8., 100., 101., 102., 103., 104., 105.].into();
        assert_eq!(got.to_vec::<f32>().unwrap(), want);
        assert_eq!(src.bytes_read(), 4 * 3 * 4, "only the blocks' bytes");
        // dummy weights take the concatenating path: same shape
        let d = DummySource::new(Dtype::F32, 0);
        assert_eq!(
            d.load_concat(&parts, TensorKind::Float).unwrap().shape(),
            vec![4, 3]
        );
        let missing = vec![("nope".to_string(), vec![1, 3], None)];
        let e = src.load_concat(&missing, TensorKind::Float).unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
    }
}
