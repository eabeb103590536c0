//! The GGUF container (version 2 and 3): header, metadata key/values and tensor infos,
//! parsed without reading any tensor data. Layout as in ggml's `docs/gguf.md`: magic
//! `GGUF`, version, tensor count, metadata count, the key/values, the tensor infos
//! (name, dims innermost first, type, offset from the data section), then the data
//! section at the next multiple of `general.alignment` (default 32).
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use super::GgufError;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U64(v) => Some(v),
            MetaValue::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F64(v) => Some(v),
            MetaValue::U64(v) => Some(v as f64),
            MetaValue::I64(v) => Some(v as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// ggml tensor types this loader knows by name (the ones it converts, and the rest so a
/// refusal can name them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    BF16,
    Other(u32),
}

impl GgmlType {
    pub fn from_id(id: u32) -> GgmlType {
        use GgmlType::*;
        match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            30 => BF16,
            other => Other(other),
        }
    }

    /// Values per block and bytes per block (`None`: a type without a known layout).
    pub fn block(self) -> Option<(usize, usize)> {
        use GgmlType::*;
        Some(match self {
            F32 => (1, 4),
            F16 | BF16 => (1, 2),
            Q4_0 => (32, 18),
            Q4_1 => (32, 20),
            Q5_0 => (32, 22),
            Q5_1 => (32, 24),
            Q8_0 => (32, 34),
            Q8_1 => (32, 36),
            Q2K => (256, 84),
            Q3K => (256, 110),
            Q4K => (256, 144),
            Q5K => (256, 176),
            Q6K => (256, 210),
            Q8K => (256, 292),
            Other(_) => return None,
        })
    }

    pub fn name(self) -> String {
        match self {
            GgmlType::Other(id) => format!("ggml type {id}"),
            t => format!("{t:?}").replace('K', "_K"),
        }
    }
}

/// One tensor of a GGUF file: dims as GGUF stores them (innermost first: `[cols, rows]`).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute offset of its first byte in the file.
    pub start: u64,
}

impl TensorInfo {
    /// Row-major shape (outermost first), as safetensors and MLX write it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Elements (saturating: a crafted header cannot wrap it round to a small number).
    pub fn numel(&self) -> u64 {
        self.dims.iter().fold(1u64, |n, &d| n.saturating_mul(d))
    }

    /// Bytes in the file (`None` for an unknown type or a size past `u64`).
    pub fn nbytes(&self) -> Option<u64> {
        let (vals, bytes) = self.ty.block()?;
        (self.numel() / vals as u64).checked_mul(bytes as u64)
    }
}

/// A parsed GGUF file (one part of a split model), open for positioned reads.
pub struct GgufFile {
    pub path: PathBuf,
    pub file: File,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: BTreeMap<String, TensorInfo>,
}

/// Longest string or array accepted in a header (guards against a corrupt length).
const MAX_LEN: u64 = 1 << 28;

struct Reader<R: Read> {
    r: R,
    pos: u64,
    path: PathBuf,
}

impl<R: Read> Reader<R> {
    fn bad(&self, msg: impl Into<String>) -> GgufError {
        GgufError::Corrupt {
            path: self.path.clone(),
            msg: format!("{} (at byte {})", msg.into(), self.pos),
        }
    }
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut b = [0u8; N];
        self.r
            .read_exact(&mut b)
            .map_err(|_| self.bad("ends inside the header"))?;
        self.pos += N as u64;
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    fn len(&mut self, what: &str) -> Result<usize, GgufError> {
        let n = self.u64()?;
        if n > MAX_LEN {
            return Err(self.bad(format!("{what} length {n} is implausible")));
        }
        Ok(n as usize)
    }
    fn string(&mut self) -> Result<String, GgufError> {
        let n = self.len("string")?;
        let mut b = vec![0u8; n];
        self.r
            .read_exact(&mut b)
            .map_err(|_| self.bad("ends inside a string"))?;
        self.pos += n as u64;
        // token strings may hold invalid UTF-8 (byte pieces); keep them lossily
        Ok(String::from_utf8(b).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into()))
    }
    fn value(&mut self, ty: u32) -> Result<MetaValue, GgufError> {
        Ok(match ty {
            0 => MetaValue::U64(self.bytes::<1>()?[0] as u64),
            1 => MetaValue::I64(self.bytes::<1>()?[0] as i8 as i64),
            2 => MetaValue::U64(u16::from_le_bytes(self.bytes()?) as u64),
            3 => MetaValue::I64(i16::from_le_bytes(self.bytes()?) as i64),
            4 => MetaValue::U64(self.u32()? as u64),
            5 => MetaValue::I64(i32::from_le_bytes(self.bytes()?) as i64),
            6 => MetaValue::F64(f32::from_le_bytes(self.bytes()?) as f64),
            7 => MetaValue::Bool(self.bytes::<1>()?[0] != 0),
            8 => MetaValue::Str(self.string()?),
            9 => {
                let et = self.u32()?;
                let n = self.len("array")?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(et)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(i64::from_le_bytes(self.bytes()?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.bytes()?)),
            other => return Err(self.bad(format!("unknown metadata value type {other}"))),
        })
    }
}

impl GgufFile {
    /// Parse the header of `path` (no tensor data is read).
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut r = Reader {
            r: BufReader::with_capacity(1 << 20, &file),
            pos: 0,
            path: path.to_path_buf(),
        };
        if &r.bytes::<4>()? != b"GGUF" {
            return Err(r.bad("no GGUF magic: not a GGUF file"));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(r.bad(format!(
                "GGUF version {version} is not supported (2 and 3 are)"
            )));
        }
        let n_tensors = r.u64()?;
        let n_kv = r.u64()?;
        if n_tensors > 1 << 20 || n_kv > 1 << 20 {
            return Err(r.bad(format!("{n_tensors} tensors / {n_kv} keys is implausible")));
        }
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let k = r.string()?;
            let ty = r.u32()?;
            let v = r.value(ty)?;
            metadata.insert(k, v);
        }
        let mut infos = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = r.string()?;
            let nd = r.u32()?;
            if nd == 0 || nd > 4 {
                return Err(r.bad(format!("tensor `{name}` has {nd} dimensions")));
            }
            let mut dims = Vec::with_capacity(nd as usize);
            for _ in 0..nd {
                dims.push(r.u64()?);
            }
            let ty = GgmlType::from_id(r.u32()?);
            let offset = r.u64()?;
            infos.push((name, dims, ty, offset));
        }
        let align = metadata
            .get("general.alignment")
            .and_then(MetaValue::as_u64)
            .unwrap_or(32)
            .max(1);
        let data = r.pos.div_ceil(align) * align;
        let mut tensors = BTreeMap::new();
        for (name, dims, ty, offset) in infos {
            let t = TensorInfo {
                dims,
                ty,
                start: data.saturating_add(offset),
            };
            if t.ty.block().is_some() && t.nbytes().is_none() {
                return Err(GgufError::Corrupt {
                    path: path.to_path_buf(),
                    msg: format!("tensor `{name}` has an impossible size {:?}", t.dims),
                });
            }
            if let Some(n) = t.nbytes() {
                if t.start.saturating_add(n) > len {
                    return Err(GgufError::Corrupt {
                        path: path.to_path_buf(),
                        msg: format!("tensor `{name}` ends past the end of the file (truncated?)"),
                    });
                }
                let (vals, _) = ty.block().expect("known");
                if !t.dims[0].is_multiple_of(vals as u64) {
                    return Err(GgufError::Corrupt {
                        path: path.to_path_buf(),
                        msg: format!(
                            "tensor `{name}`: {} values per row are not whole {} blocks",
                            t.dims[0],
                            ty.name()
                        ),
                    });
                }
            }
            tensors.insert(name, t);
        }
        drop(r);
        Ok(GgufFile {
            path: path.to_path_buf(),
            file,
            metadata,
            tensors,
        })
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }
}

/// Read exactly `buf.len()` bytes at `offset`.
pub fn read_at(file: &File, path: &Path, buf: &mut [u8], offset: u64) -> Result<(), GgufError> {
    #[cfg(unix)]
    let r = std::os::unix::fs::FileExt::read_exact_at(file, buf, offset);
    #[cfg(not(unix))]
    let r = {
        use std::io::{Seek, SeekFrom};
        let mut f = file;
        f.seek(SeekFrom::Start(offset))
            .and_then(|_| f.read_exact(buf))
    };
    r.map_err(|source| GgufError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Writes a GGUF v3 file: for tests (and the writer of test models), tensors given with
/// their row-major shape and raw block bytes.
pub fn write(
    path: &Path,
    metadata: &[(&str, MetaValue)],
    tensors: &[(&str, Vec<usize>, u32, Vec<u8>)],
) -> std::io::Result<()> {
    fn s(out: &mut Vec<u8>, x: &str) {
        out.extend((x.len() as u64).to_le_bytes());
        out.extend(x.as_bytes());
    }
    fn val(out: &mut Vec<u8>, v: &MetaValue, with_type: bool) {
        let (ty, body): (u32, Vec<u8>) = match v {
            MetaValue::U64(x) => (4, (*x as u32).to_le_bytes().to_vec()),
            MetaValue::I64(x) => (5, (*x as i32).to_le_bytes().to_vec()),
            MetaValue::F64(x) => (6, (*x as f32).to_le_bytes().to_vec()),
            MetaValue::Bool(b) => (7, vec![*b as u8]),
            MetaValue::Str(x) => {
                let mut b = Vec::new();
                s(&mut b, x);
                (8, b)
            }
            MetaValue::Array(a) => {
                let mut b = Vec::new();
                let et = match a.first() {
                    Some(MetaValue::U64(_)) => 4u32,
                    Some(MetaValue::I64(_)) => 5,
                    Some(MetaValue::F64(_)) => 6,
                    Some(MetaValue::Bool(_)) => 7,
                    _ => 8,
                };
                b.extend(et.to_le_bytes());
                b.extend((a.len() as u64).to_le_bytes());
                for e in a {
                    val(&mut b, e, false);
                }
                (9, b)
            }
        };
        if with_type {
            out.extend(ty.to_le_bytes());
        }
        out.extend(body);
    }
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        s(&mut out, k);
        val(&mut out, v, true);
    }
    let mut offset = 0u64;
    let mut offsets = Vec::new();
    for (name, shape, ty, bytes) in tensors {
        s(&mut out, name);
        out.extend((shape.len() as u32).to_le_bytes());
        for d in shape.iter().rev() {
            out.extend((*d as u64).to_le_bytes());
        }
        out.extend(ty.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offsets.push(offset);
        offset = (offset + bytes.len() as u64).div_ceil(32) * 32;
    }
    let data = (out.len() as u64).div_ceil(32) * 32;
    out.resize(data as usize, 0);
    for ((_, _, _, bytes), off) in tensors.iter().zip(offsets) {
        out.resize((data + off) as usize, 0);
        out.extend(bytes);
    }
    std::fs::write(path, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header whose tensor sizes overflow u64 (or point past the file) is refused, not
    /// wrapped round to a small size that passes the bounds check.
    #[test]
    fn impossible_tensor_sizes_are_refused() {
        let tmp = tempfile::Builder::new()
            .prefix("mlxcel-gguf-size-")
            .tempdir()
            .unwrap();
        let dir = tmp.path();
        for (i, dims) in [[1u64 << 40, 1 << 40], [1 << 62, 8], [1 << 20, 1 << 20]]
            .iter()
            .enumerate()
        {
            let mut b = Vec::new();
            b.extend_from_slice(b"GGUF");
            b.extend_from_slice(&3u32.to_le_bytes());
            b.extend_from_slice(&1u64.to_le_bytes()); // tensors
            b.extend_from_slice(&0u64.to_le_bytes()); // metadata entries
            b.extend_from_slice(&1u64.to_le_bytes());
            b.push(b'w');
            b.extend_from_slice(&2u32.to_le_bytes());
            for d in dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&0u32.to_le_bytes()); // F32
            b.extend_from_slice(&0u64.to_le_bytes()); // offset
            b.resize(b.len().next_multiple_of(32) + 64, 0);
            let p = dir.join(format!("t{i}.gguf"));
            std::fs::write(&p, &b).unwrap();
            let e = GgufFile::open(&p)
                .err()
                .expect("accepted an impossible tensor size");
            let msg = e.to_string();
            assert!(
                msg.contains("impossible size") || msg.contains("past the end"),
                "{dims:?}: {msg}"
            );
        }
    }
}
