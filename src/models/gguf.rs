//! The GGUF weight source: tensors of a GGUF model (`crate::gguf`) under the HF names the
//! model code asks for, converted to MLX's layout as they are read.
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

use crate::gguf::{
    self, file, quant, split_name, GgufError, GgufModel, MetaValue, Part, TensorInfo,
};
use crate::mlx::{Array, Dtype};

use super::weights::{
    block_ranges, LoadError, TensorEntry, TensorInfo as TensorInfo2, TensorKind, WeightSource,
};

/// Every tensor under its HF names, as the loader will hand it to MLX (packed
/// uint32 + scales + biases for affine types, floats otherwise), for the memory plan.
pub fn catalog(model: &GgufModel) -> HashMap<String, TensorEntry> {
    let float = gguf::float_dtype();
    let mut out = HashMap::new();
    for (gname, (_, t)) in &model.tensors {
        let Some(hf) = gguf::hf_name(gname) else {
            continue;
        };
        let shape = t.shape();
        match (quant::affine_bits(t.ty), shape.as_slice()) {
            (Some(bits), &[rows, cols]) => {
                let prefix = hf.trim_end_matches(".weight");
                let entry = |dtype, width| TensorEntry {
                    dtype,
                    shape: vec![rows, width],
                    start: t.start,
                };
                out.insert(hf.clone(), entry(Dtype::U32, cols * bits as usize / 32));
                for s in ["scales", "biases"] {
                    out.insert(format!("{prefix}.{s}"), entry(float, cols / quant::GROUP));
                }
            }
            _ => {
                out.insert(
                    hf,
                    TensorEntry {
                        dtype: float,
                        shape,
                        start: t.start,
                    },
                );
            }
        }
    }
    out
}

/// Converted scales and biases kept from a `.weight` read until they are asked for.
type Pending = HashMap<(String, usize, usize, usize, usize), (Option<Vec<f32>>, Option<Vec<f32>>)>;

/// Tensors of a GGUF model, converted on read (see the module docs).
pub struct GgufSource {
    model: GgufModel,
    /// Dtype of every float tensor, scale and bias handed to MLX.
    float: Dtype,
    /// `(q heads, kv heads)` when the q/k rows are in llama.cpp's permuted order.
    permuted: Option<(usize, usize)>,
    bytes_read: Cell<u64>,
    pending: RefCell<Pending>,
}

impl GgufSource {
    pub fn open(first: &Path) -> Result<GgufSource, GgufError> {
        Self::from_model(GgufModel::open(first)?)
    }

    /// [`open`](Self::open), with floats, scales and biases in `float` (not
    /// [`gguf::float_dtype`]'s choice).
    pub fn open_as(first: &Path, float: Dtype) -> Result<GgufSource, GgufError> {
        let mut s = Self::open(first)?;
        s.float = float;
        Ok(s)
    }

    pub fn from_model(model: GgufModel) -> Result<GgufSource, GgufError> {
        model.check_types()?;
        let arch = model.architecture()?.to_string();
        let permuted = if arch == "llama" {
            let heads = model.need_u64("llama.attention.head_count")? as usize;
            let kv = model
                .get("llama.attention.head_count_kv")
                .and_then(MetaValue::as_u64)
                .map_or(heads, |x| x as usize);
            Some((heads, kv))
        } else {
            None
        };
        Ok(GgufSource {
            model,
            float: gguf::float_dtype(),
            permuted,
            bytes_read: Cell::new(0),
            pending: RefCell::new(HashMap::new()),
        })
    }

    pub fn model(&self) -> &GgufModel {
        &self.model
    }

    /// Bytes read from the GGUF files so far.
    pub fn total_bytes_read(&self) -> u64 {
        self.bytes_read.get()
    }

    fn tensor(&self, gname: &str) -> Option<(usize, &TensorInfo)> {
        self.model.tensors.get(gname).map(|(i, t)| (*i, t))
    }

    /// Shape and dtype of the HF-named tensor as it is handed to MLX (`None`: not
    /// offered; `.scales`/`.biases` only for tensors that convert to MLX's affine layout).
    fn info_of(&self, name: &str) -> Option<TensorInfo2> {
        let (g, part) = split_name(name)?;
        let (_, t) = self.tensor(&g)?;
        let shape = t.shape();
        match (quant::affine_bits(t.ty), part, shape.as_slice()) {
            (Some(bits), Part::Weight, &[rows, cols]) => Some(TensorInfo2 {
                shape: vec![rows, cols * bits as usize / 32],
                dtype: Dtype::U32,
            }),
            (Some(_), Part::Scales | Part::Biases, &[rows, cols]) => Some(TensorInfo2 {
                shape: vec![rows, cols / quant::GROUP],
                dtype: self.float,
            }),
            (_, Part::Scales | Part::Biases, _) => None,
            _ => Some(TensorInfo2 {
                shape,
                dtype: self.float,
            }),
        }
    }

    fn err(&self, name: &str, msg: String) -> LoadError {
        LoadError::Gguf(GgufError::Corrupt {
            path: self.model.path().to_path_buf(),
            msg: format!("tensor `{name}`: {msg}"),
        })
    }

    /// Rows of q/k heads of `hd` rows each: HF row `r` of a head is GGUF row
    /// `2·(r mod hd/2) + r div (hd/2)`.
    fn head_dim_of(&self, gname: &str, rows_total: usize) -> Option<usize> {
        let (heads, kv) = self.permuted?;
        let n = if gname.ends_with(".attn_q.weight") || gname.ends_with(".attn_q.bias") {
            heads
        } else if gname.ends_with(".attn_k.weight") || gname.ends_with(".attn_k.bias") {
            kv
        } else {
            return None;
        };
        Some(rows_total / n)
    }

    /// Read rows `rows` of the GGUF tensor, blocks covering values `vals`; returns the
    /// bytes and the value offset of the first block read.
    fn read_rows(
        &self,
        name: &str,
        part: usize,
        t: &TensorInfo,
        rows: Range<usize>,
        vals: Range<usize>,
    ) -> Result<(Vec<u8>, usize), LoadError> {
        let (bv, bb) = t.ty.block().expect("checked at open");
        let cols = t.dims[0] as usize;
        let (b0, b1) = (vals.start / bv, vals.end.div_ceil(bv));
        if vals.end > cols || rows.end > t.dims.get(1).copied().unwrap_or(1) as usize {
            return Err(self.err(name, format!("block {rows:?} x {vals:?} is out of range")));
        }
        let ranges = block_ranges(t.start, cols / bv * bb, bb, rows, b0..b1);
        let total: usize = ranges.iter().map(|r| r.1).sum();
        let mut buf = vec![0u8; total];
        let f = &self.model.parts[part];
        let mut at = 0;
        for (off, len) in ranges {
            file::read_at(&f.file, &f.path, &mut buf[at..at + len], off)
                .map_err(|e| self.err(name, e.to_string()))?;
            at += len;
        }
        self.bytes_read.set(self.bytes_read.get() + total as u64);
        Ok((buf, b0 * bv))
    }

    fn affine(
        &self,
        gname: &str,
        pi: usize,
        t: &TensorInfo,
        rows: Range<usize>,
        vals: Range<usize>,
        hd: Option<usize>,
    ) -> Result<quant::Affine, LoadError> {
        if !vals.start.is_multiple_of(quant::GROUP) || !vals.end.is_multiple_of(quant::GROUP) {
            return Err(self.err(
                gname,
                format!("columns {vals:?} do not cut at 32-value groups"),
            ));
        }
        let (buf, first) = self.read_rows(gname, pi, t, rows.clone(), vals.clone())?;
        let mut a =
            quant::rows_affine(t.ty, &buf, rows.len(), vals.start - first..vals.end - first);
        if let Some(hd) = hd {
            let words = a.packed.len() / rows.len().max(1);
            let groups = a.scales.len() / rows.len().max(1);
            unpermute(&mut a.packed, words, hd);
            unpermute(&mut a.scales, groups, hd);
            unpermute(&mut a.biases, groups, hd);
        }
        Ok(a)
    }
}

impl WeightSource for GgufSource {
    fn info(&self, name: &str) -> Result<Option<TensorInfo2>, LoadError> {
        Ok(self.info_of(name))
    }

    /// The block `[rows, cols]` of the HF-named tensor `name` of full shape `shape`
    /// (columns of packed weights in uint32 words, of scales and biases in groups).
    fn load_block(
        &self,
        name: &str,
        shape: &[usize],
        rows: Option<Range<usize>>,
        cols: Option<Range<usize>>,
        kind: TensorKind,
    ) -> Result<Array, LoadError> {
        let missing = || LoadError::Missing {
            name: name.into(),
            files: self.model.path().display().to_string(),
        };
        let (gname, part) = split_name(name).ok_or_else(missing)?;
        let (pi, t) = self.tensor(&gname).ok_or_else(missing)?;
        let gshape = t.shape();
        let (n_rows, n_cols) = match gshape.as_slice() {
            [r, c] => (*r, *c),
            [c] => (1, *c),
            _ => return Err(self.err(&gname, format!("shape {gshape:?} is not 1-D or 2-D"))),
        };
        let bits = quant::affine_bits(t.ty);
        let shape_err = |expected: Vec<usize>| LoadError::Shape {
            name: name.into(),
            path: self.model.path().to_path_buf(),
            expected: shape.to_vec(),
            actual: expected,
        };
        let one_d = shape.len() == 1;
        // a 1-D tensor (norm, bias) is one row; its block comes as `rows`
        let (rows, cols) = if one_d {
            (0..1, rows.unwrap_or(0..shape[0]))
        } else {
            (rows.unwrap_or(0..shape[0]), cols.unwrap_or(0..shape[1]))
        };
        // the unit of `cols`: values, packed words or groups
        let unit = match (part, kind, bits) {
            (Part::Weight, TensorKind::Packed, Some(b)) => 32 / b as usize,
            (Part::Weight, TensorKind::Packed, None) => {
                return Err(LoadError::Dtype {
                    name: name.into(),
                    path: self.model.path().to_path_buf(),
                    dtype: format!("{} (not an MLX affine type)", t.ty.name()),
                })
            }
            (Part::Scales | Part::Biases, _, Some(_)) => quant::GROUP,
            (Part::Scales | Part::Biases, _, None) => return Err(missing()),
            _ => 1,
        };
        let full = if one_d {
            vec![n_cols / unit]
        } else {
            vec![n_rows, n_cols / unit]
        };
        if full != shape || n_cols % unit != 0 {
            return Err(shape_err(if one_d { vec![n_cols] } else { gshape.clone() }));
        }
        let vals = cols.start * unit..cols.end * unit;
        let hd = self.head_dim_of(&gname, n_rows);
        if let Some(hd) = hd {
            if rows.start % hd != 0 || rows.end % hd != 0 {
                return Err(self.err(
                    name,
                    format!("rows {rows:?} do not cut at whole heads of {hd} (q/k rows are permuted per head)"),
                ));
            }
        }
        let dims: Vec<i32> = if one_d {
            vec![cols.len() as i32]
        } else {
            vec![rows.len() as i32, cols.len() as i32]
        };
        let key = (gname.clone(), rows.start, rows.end, vals.start, vals.end);
        if matches!(part, Part::Scales | Part::Biases) {
            let mut pending = self.pending.borrow_mut();
            let hit = pending.get_mut(&key).and_then(|(s, b)| match part {
                Part::Scales => s.take(),
                _ => b.take(),
            });
            if pending
                .get(&key)
                .is_some_and(|(s, b)| s.is_none() && b.is_none())
            {
                pending.remove(&key);
            }
            drop(pending);
            let v = match hit {
                Some(v) => v,
                None => {
                    // asked before (or without) the weight: convert again
                    let a = self.affine(&gname, pi, t, rows.clone(), vals.clone(), hd)?;
                    if part == Part::Scales {
                        a.scales
                    } else {
                        a.biases
                    }
                }
            };
            return Ok(Array::from_slice(&v, &dims)?.astype(self.float)?);
        }
        if unit > 1 {
            let a = self.affine(&gname, pi, t, rows, vals, hd)?;
            self.pending
                .borrow_mut()
                .insert(key, (Some(a.scales), Some(a.biases)));
            return Ok(Array::from_slice(&a.packed, &dims)?);
        }
        let (buf, first) = self.read_rows(&gname, pi, t, rows.clone(), vals.clone())?;
        let mut v = quant::rows_float(t.ty, &buf, rows.len(), vals.start - first..vals.end - first);
        if let Some(hd) = hd {
            unpermute(&mut v, vals.len(), hd);
        }
        let a = Array::from_slice(&v, &dims)?;
        Ok(match kind {
            TensorKind::Packed => unreachable!("handled above"),
            _ => a.astype(self.float)?,
        })
    }

    fn bytes_read(&self) -> u64 {
        self.total_bytes_read()
    }
}

/// Put rows of `row_len` elements back from llama.cpp's per-head interleaved order
/// (GGUF row `2i + h` of a head is HF row `h·hd/2 + i`) into HF order.
fn unpermute<T: Copy>(v: &mut [T], row_len: usize, hd: usize) {
    if row_len == 0 || hd < 2 {
        return;
    }
    let n_rows = v.len() / row_len;
    let src = v.to_vec();
    let half = hd / 2;
    for r in 0..n_rows {
        let (head, within) = (r / hd, r % hd);
        let g = head * hd + 2 * (within % half) + within / half;
        v[r * row_len..(r + 1) * row_len].copy_from_slice(&src[g * row_len..(g + 1) * row_len]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(n_head, 2, hd/2, ...).swapaxes(1, 2).reshape(...)
        let (heads, hd) = (2, 4);
        let hf: Vec<u32> = (0..(heads * hd) as u32).collect();
        let mut permuted = vec![0; hf.len()];
        for h in 0..heads {
            for i in 0..hd / 2 {
                for half in 0..2 {
                    permuted[h * hd + 2 * i + half] = hf[h * hd + half * hd / 2 + i];
                }
            }
        }
        assert_eq!(permuted, vec![0, 2, 1, 3, 4, 6, 5, 7]);
        unpermute(&mut permuted, 1, hd);
        assert_eq!(permuted, hf);
    }

    /// A small llama GGUF: `attn_q` Q8_0 `[8, 64]` (2 heads of 4 rows, in llama.cpp's
    /// permuted order), `ffn_down` Q4_1 `[4, 64]`, `output_norm` F16 `[64]`.
    fn write_model(path: &Path) -> (Vec<Vec<i32>>, Vec<Vec<u8>>) {
        use crate::gguf::file::write;
        let f16 = |x: f32| -> [u8; 2] {
            // exact for the small dyadic values used here
            let b = x.to_bits();
            let e = ((b >> 23) & 0xff) as i32 - 127 + 15;
            let v = ((b >> 16) & 0x8000) as u16 | ((e as u16) << 10) | ((b >> 13) & 0x3ff) as u16;
            if x == 0.0 {
                [0, 0]
            } else {
                v.to_le_bytes()
            }
        };
        // q8 values of GGUF row g, column c
        let q8: Vec<Vec<i32>> = (0..8)
            .map(|g| (0..64).map(|c| (g * 37 + c * 3) % 201 - 100).collect())
            .collect();
        let mut q_bytes = Vec::new();
        for row in &q8 {
            for blk in row.chunks(32) {
                q_bytes.extend(f16(1.0));
                q_bytes.extend(blk.iter().map(|&v| v as i8 as u8));
            }
        }
        // q4_1 nibbles of row r, column c; d = 0.5, m = -1
        let q4: Vec<Vec<u8>> = (0..4)
            .map(|r| (0..64).map(|c| ((r * 5 + c) % 16) as u8).collect())
            .collect();
        let mut d_bytes = Vec::new();
        for row in &q4 {
            for blk in row.chunks(32) {
                d_bytes.extend(f16(0.5));
                d_bytes.extend(f16(-1.0));
                d_bytes.extend((0..16).map(|j| blk[j] | (blk[j + 16] << 4)));
            }
        }
        let norm: Vec<u8> = (0..64).flat_map(|i| f16(i as f32 / 4.0)).collect();
        let s = |x: &str| MetaValue::Str(x.into());
        write(
            path,
            &[
                ("general.architecture", s("llama")),
                ("llama.attention.head_count", MetaValue::U64(2)),
                ("llama.attention.head_count_kv", MetaValue::U64(1)),
            ],
            &[
                ("blk.0.attn_q.weight", vec![8, 64], 8, q_bytes),
                ("blk.0.ffn_down.weight", vec![4, 64], 3, d_bytes),
                ("output_norm.weight", vec![64], 1, norm),
            ],
        )
        .unwrap();
        (q8, q4)
    }

    #[test]
    fn blocks_read_their_bytes_and_convert_exactly() {
        let tmp = tempfile::Builder::new()
            .prefix("mlxcel-gguf-src-")
            .tempdir()
            .unwrap();
        let dir = tmp.path();
        let path = dir.join("m.gguf");
        let (q8, q4) = write_model(&path);
        let src = GgufSource::open_as(&path, Dtype::F32).unwrap();
        let q = "model.layers.0.self_attn.q_proj";
        assert!(src.contains(&format!("{q}.scales")));
        assert!(!src.contains("model.norm.scales") && src.contains("model.norm.weight"));
        assert_eq!(
            src.info(&format!("{q}.weight")).unwrap().unwrap().shape,
            vec![8, 16],
            "8-bit: 4 values per uint32"
        );
        // head 1 (rows 4..8), columns 32..64 (words 8..16, group 1)
        let dq = |prefix: &str, rows: Range<usize>, words: Range<usize>, bits: i32| {
            let groups = words.start * 32 / bits as usize / 32..words.end * 32 / bits as usize / 32;
            let w = src
                .load_block(
                    &format!("{prefix}.weight"),
                    &[rows.end.max(4), 64 * bits as usize / 32],
                    Some(rows.clone()),
                    Some(words),
                    TensorKind::Packed,
                )
                .unwrap();
            let sc = src
                .load_block(
                    &format!("{prefix}.scales"),
                    &[rows.end.max(4), 2],
                    Some(rows.clone()),
                    Some(groups.clone()),
                    TensorKind::Scales,
                )
                .unwrap();
            let b = src
                .load_block(
                    &format!("{prefix}.biases"),
                    &[rows.end.max(4), 2],
                    Some(rows),
                    Some(groups),
                    TensorKind::QuantBiases,
                )
                .unwrap();
            crate::mlx::fast::dequantize(&w, &sc, &b, 32, bits)
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
        };
        let before = src.bytes_read();
        let got = dq(q, 4..8, 8..16, 8);
        assert_eq!(
            src.bytes_read() - before,
            4 * 34,
            "4 rows of one Q8_0 block"
        );
        // HF row r of head 1 is GGUF row 4 + 2·(r mod 2) + r div 2 (hd = 4)
        let want: Vec<f32> = (0..4)
            .flat_map(|r| {
                let g = 4 + 2 * (r % 2) + r / 2;
                q8[g][32..64].iter().map(|&v| v as f32).collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(got, want);
        // a row-parallel block of the Q4_1 down projection: columns 32..64 (words 4..8)
        let before = src.bytes_read();
        let got = dq("model.layers.0.mlp.down_proj", 0..4, 4..8, 4);
        assert_eq!(src.bytes_read() - before, 4 * 20, "one Q4_1 block per row");
        let want: Vec<f32> = (0..4)
            .flat_map(|r| {
                q4[r][32..64]
                    .iter()
                    .map(|&v| 0.5 * v as f32 - 1.0)
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(got, want);
        // F16 → float32, a 1-D block
        let n = src
            .load_block(
                "model.norm.weight",
                &[64],
                Some(32..40),
                None,
                TensorKind::Norm,
            )
            .unwrap();
        assert_eq!(
            n.to_vec::<f32>().unwrap(),
            (32..40).map(|i| i as f32 / 4.0).collect::<Vec<_>>()
        );
        // rows that cut a head are refused (the permutation is per head)
        let e = src
            .load_block(
                &format!("{q}.weight"),
                &[8, 16],
                Some(2..6),
                None,
                TensorKind::Packed,
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("whole heads"), "{e}");
        let e = src
            .load_block(
                &format!("{q}.weight"),
                &[8, 17],
                None,
                None,
                TensorKind::Packed,
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("attn_q") || e.contains("q_proj"), "{e}");
    }
}
