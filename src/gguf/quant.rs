//! ggml blocks → MLX's affine quantization (`w = scale · q + bias`, groups of 32 along a
//! row, `32 / bits` values per uint32, lowest bits first), or → float values.
//!
//! Exact (every value is the same number after conversion, with float32 scales):
//! - Q4_0: `d · (q − 8)` → 4-bit, scale `d`, bias `−8d`;
//! - Q4_1: `d · q + m` → 4-bit, scale `d`, bias `m`;
//! - Q8_0: `d · q` with signed q → 8-bit with `q + 128`, scale `d`, bias `−128d`;
//! - Q4_K: each 32-value sub-block is `d·sc · q − dmin·m` → 4-bit, scale `d·sc`, bias
//!   `−dmin·m` (6-bit sc and m unpacked as ggml's `get_scale_min_k4`).
//!
//! Dequantized to floats (no MLX layout matches): Q5_0, Q5_1, Q6_K, and F16/BF16/F32.
use super::file::GgmlType;

/// Values of a quantization group (MLX group size and ggml's 32-value blocks).
pub const GROUP: usize = 32;

/// IEEE half → f32.
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // subnormal: normalise
            let shift = m.leading_zeros() - 21;
            let m = (m << shift) & 0x3ff;
            sign | ((113 - shift) << 23) | (m << 13)
        }
        (31, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

fn h(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Bits of the MLX affine layout a type converts to exactly (`None`: dequantized).
pub fn affine_bits(ty: GgmlType) -> Option<u32> {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4K => Some(4),
        GgmlType::Q8_0 => Some(8),
        _ => None,
    }
}

/// Whether values of `ty` can be read at all (exactly or dequantized).
pub fn readable(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | BF16 | Q4_0 | Q4_1 | Q8_0 | Q4K | Q5_0 | Q5_1 | Q6K
    )
}

/// One row's groups in MLX's affine layout, appended to the output vectors.
pub struct Affine {
    pub bits: u32,
    pub packed: Vec<u32>,
    pub scales: Vec<f32>,
    pub biases: Vec<f32>,
}

impl Affine {
    pub fn new(bits: u32) -> Affine {
        Affine {
            bits,
            packed: Vec::new(),
            scales: Vec::new(),
            biases: Vec::new(),
        }
    }

    fn push(&mut self, q: &[u8; GROUP], scale: f32, bias: f32) {
        let per = 32 / self.bits as usize;
        for w in q.chunks(per) {
            let mut word = 0u32;
            for (i, &v) in w.iter().enumerate() {
                word |= (v as u32) << (i as u32 * self.bits);
            }
            self.packed.push(word);
        }
        self.scales.push(scale);
        self.biases.push(bias);
    }
}

/// The groups of one ggml block of a 4/8-bit type: `(q, scale, bias)` for each 32 values.
fn block_groups(ty: GgmlType, b: &[u8], mut f: impl FnMut(&[u8; GROUP], f32, f32)) {
    let mut q = [0u8; GROUP];
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let (d, m, qs) = if ty == GgmlType::Q4_0 {
                let d = h(b, 0);
                (d, -8.0 * d, &b[2..18])
            } else {
                (h(b, 0), h(b, 2), &b[4..20])
            };
            for j in 0..16 {
                q[j] = qs[j] & 0xf;
                q[j + 16] = qs[j] >> 4;
            }
            f(&q, d, m);
        }
        GgmlType::Q8_0 => {
            let d = h(b, 0);
            for j in 0..32 {
                q[j] = (b[2 + j] as i8 as i16 + 128) as u8;
            }
            f(&q, d, -128.0 * d);
        }
        GgmlType::Q4K => {
            let (d, dmin) = (h(b, 0), h(b, 2));
            let sc = &b[4..16];
            let qs = &b[16..144];
            let scale_min = |j: usize| -> (u8, u8) {
                if j < 4 {
                    (sc[j] & 63, sc[j + 4] & 63)
                } else {
                    (
                        (sc[j + 4] & 0xf) | ((sc[j - 4] >> 6) << 4),
                        (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4),
                    )
                }
            };
            for chunk in 0..4 {
                let qc = &qs[chunk * 32..chunk * 32 + 32];
                for half in 0..2 {
                    let (s, m) = scale_min(chunk * 2 + half);
                    for l in 0..32 {
                        q[l] = if half == 0 { qc[l] & 0xf } else { qc[l] >> 4 };
                    }
                    f(&q, d * s as f32, -(dmin * m as f32));
                }
            }
        }
        other => unreachable!("block_groups({other:?})"),
    }
}

/// Appends the float values of one block of `ty` to `out`.
fn block_floats(ty: GgmlType, b: &[u8], out: &mut Vec<f32>) {
    match ty {
        GgmlType::F32 => out.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => out.push(h(b, 0)),
        GgmlType::BF16 => out.push(f32::from_bits(
            (u16::from_le_bytes([b[0], b[1]]) as u32) << 16,
        )),
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 | GgmlType::Q4K => {
            block_groups(ty, b, |q, s, m| {
                out.extend(q.iter().map(|&v| s * v as f32 + m));
            })
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (d, m, qh, qs) = if ty == GgmlType::Q5_0 {
                (h(b, 0), None, &b[2..6], &b[6..22])
            } else {
                (h(b, 0), Some(h(b, 2)), &b[4..8], &b[8..24])
            };
            let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
            let mut y = [0f32; 32];
            for j in 0..16 {
                let xh0 = ((qh >> j) << 4) & 0x10;
                let xh1 = (qh >> (j + 12)) & 0x10;
                let x0 = ((qs[j] & 0xf) as u32 | xh0) as f32;
                let x1 = ((qs[j] >> 4) as u32 | xh1) as f32;
                match m {
                    None => {
                        y[j] = (x0 - 16.0) * d;
                        y[j + 16] = (x1 - 16.0) * d;
                    }
                    Some(m) => {
                        y[j] = x0 * d + m;
                        y[j + 16] = x1 * d + m;
                    }
                }
            }
            out.extend(y);
        }
        GgmlType::Q6K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = h(b, 208);
            let mut y = [0f32; 256];
            for n in 0..2 {
                let (ql, qh, sc) = (&ql[n * 64..], &qh[n * 32..], &sc[n * 8..]);
                let y = &mut y[n * 128..];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    let s = |i: usize| d * sc[i] as i8 as f32;
                    y[l] = s(is) * q1 as f32;
                    y[l + 32] = s(is + 2) * q2 as f32;
                    y[l + 64] = s(is + 4) * q3 as f32;
                    y[l + 96] = s(is + 6) * q4 as f32;
                }
            }
            out.extend(y);
        }
        other => unreachable!("block_floats({other:?})"),
    }
}

/// Converts rows of `ty` read as whole blocks (`buf`: `n_rows` rows of `row_bytes` each, the
/// blocks covering values `first_value..` of each row) keeping values `keep` (relative to
/// `first_value`, 32-value aligned for the affine output) into MLX's affine layout.
pub fn rows_affine(
    ty: GgmlType,
    buf: &[u8],
    n_rows: usize,
    keep: std::ops::Range<usize>,
) -> Affine {
    let bits = affine_bits(ty).expect("an affine type");
    let (vals, bytes) = ty.block().expect("known layout");
    let row_bytes = buf.len() / n_rows.max(1);
    let (g0, g1) = (keep.start / GROUP, keep.end / GROUP);
    let mut out = Affine::new(bits);
    for r in 0..n_rows {
        let row = &buf[r * row_bytes..(r + 1) * row_bytes];
        let mut g = 0usize;
        for blk in row.chunks(bytes) {
            if g >= g1 {
                break;
            }
            if g + vals / GROUP <= g0 {
                g += vals / GROUP;
                continue;
            }
            block_groups(ty, blk, |q, s, m| {
                if (g0..g1).contains(&g) {
                    out.push(q, s, m);
                }
                g += 1;
            });
        }
    }
    out
}

/// As [`rows_affine`], to float values (`keep` need not be aligned).
pub fn rows_float(
    ty: GgmlType,
    buf: &[u8],
    n_rows: usize,
    keep: std::ops::Range<usize>,
) -> Vec<f32> {
    let (_, bytes) = ty.block().expect("known layout");
    let row_bytes = buf.len() / n_rows.max(1);
    let mut out = Vec::with_capacity(n_rows * keep.len());
    let mut row_vals = Vec::new();
    for r in 0..n_rows {
        row_vals.clear();
        for blk in buf[r * row_bytes..(r + 1) * row_bytes].chunks(bytes) {
            block_floats(ty, blk, &mut row_vals);
        }
        out.extend_from_slice(&row_vals[keep.clone()]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bits(x: f32) -> [u8; 2] {
        // exact for the values used below (small dyadic rationals)
        let b = x.to_bits();
        let sign = ((b >> 16) & 0x8000) as u16;
        let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
        let man = ((b >> 13) & 0x3ff) as u16;
        let v = if x == 0.0 {
            sign
        } else {
            sign | ((exp as u16) << 10) | man
        };
        v.to_le_bytes()
    }

    #[test]
    fn half_conversion() {
        for (bits, want) in [
            (0x3c00u16, 1.0f32),
            (0xc000, -2.0),
            (0x3555, 0.333_251_95),
            (0x0001, 5.960_464_5e-8),
            (0x7bff, 65504.0),
            (0x0000, 0.0),
        ] {
            assert_eq!(f16_to_f32(bits), want, "{bits:#x}");
        }
        assert!(f16_to_f32(0x7c00).is_infinite());
    }

    /// Unpack an affine row to floats the way MLX's dequantize does.
    fn unpack(a: &Affine) -> Vec<f32> {
        let per = 32 / a.bits as usize;
        let mask = (1u32 << a.bits) - 1;
        let mut out = Vec::new();
        for (g, (&s, &b)) in a.scales.iter().zip(&a.biases).enumerate() {
            for w in &a.packed[g * GROUP / per..(g + 1) * GROUP / per] {
                for i in 0..per {
                    out.push(s * ((w >> (i as u32 * a.bits)) & mask) as f32 + b);
                }
            }
        }
        out
    }

    /// ggml's `dequantize_row_q4_K`, transcribed on its own (not through `block_groups`).
    #[allow(clippy::needless_range_loop)]
    fn ggml_q4_k(x: &[u8]) -> Vec<f32> {
        let d = f16_to_f32(u16::from_le_bytes([x[0], x[1]]));
        let min = f16_to_f32(u16::from_le_bytes([x[2], x[3]]));
        let scales = &x[4..16];
        let get_scale_min_k4 = |j: usize| -> (u8, u8) {
            if j < 4 {
                (scales[j] & 63, scales[j + 4] & 63)
            } else {
                (
                    (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
                    (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
                )
            }
        };
        let mut y = Vec::new();
        let mut q = &x[16..];
        let mut is = 0;
        for _ in (0..256).step_by(64) {
            let (sc, m) = get_scale_min_k4(is);
            let (d1, m1) = (d * sc as f32, min * m as f32);
            let (sc, m) = get_scale_min_k4(is + 1);
            let (d2, m2) = (d * sc as f32, min * m as f32);
            for l in 0..32 {
                y.push(d1 * (q[l] & 0xF) as f32 - m1);
            }
            for l in 0..32 {
                y.push(d2 * (q[l] >> 4) as f32 - m2);
            }
            q = &q[32..];
            is += 2;
        }
        y
    }

    fn pseudo(n: usize, seed: u32) -> Vec<u8> {
        let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect()
    }

    #[test]
    fn q4_0_q4_1_q8_0_by_hand() {
        // Q4_0: d = 0.5, nibbles j & 15 in the low half, 15 - j in the high half
        let mut b = f16_bits(0.5).to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let want: Vec<f32> = (0..16)
            .map(|j| 0.5 * (j as f32 - 8.0))
            .chain((0..16).map(|j| 0.5 * ((15 - j) as f32 - 8.0)))
            .collect();
        assert_eq!(rows_float(GgmlType::Q4_0, &b, 1, 0..32), want);
        assert_eq!(unpack(&rows_affine(GgmlType::Q4_0, &b, 1, 0..32)), want);
        // Q4_1: d = 0.25, m = -1
        let mut b = f16_bits(0.25).to_vec();
        b.extend(f16_bits(-1.0));
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let want: Vec<f32> = (0..16)
            .map(|j| 0.25 * j as f32 - 1.0)
            .chain((0..16).map(|j| 0.25 * (15 - j) as f32 - 1.0))
            .collect();
        assert_eq!(unpack(&rows_affine(GgmlType::Q4_1, &b, 1, 0..32)), want);
        // Q8_0: d = 0.125, q = -128, -127, ..., -97
        let mut b = f16_bits(0.125).to_vec();
        b.extend((0..32).map(|j| (-128 + j) as i8 as u8));
        let want: Vec<f32> = (0..32).map(|j| 0.125 * (-128 + j) as f32).collect();
        assert_eq!(unpack(&rows_affine(GgmlType::Q8_0, &b, 1, 0..32)), want);
    }

    #[test]
    fn q4_k_affine_equals_its_dequantization() {
        for seed in 0..8 {
            let mut b = pseudo(144, seed);
            b[0..2].copy_from_slice(&f16_bits(0.0625));
            b[2..4].copy_from_slice(&f16_bits(0.03125));
            let want = ggml_q4_k(&b);
            assert_eq!(want.len(), 256);
            let got = unpack(&rows_affine(GgmlType::Q4K, &b, 1, 0..256));
            assert_eq!(got, want, "seed {seed}");
            // a column slice of one superblock: groups 3..5
            let part = unpack(&rows_affine(GgmlType::Q4K, &b, 1, 96..160));
            assert_eq!(part, want[96..160]);
        }
    }

    #[test]
    fn row_slices_keep_whole_groups() {
        // two rows of two Q8_0 blocks; keep the second block of each row
        let mut buf = Vec::new();
        for r in 0..2u8 {
            for blk in 0..2u8 {
                buf.extend(f16_bits(1.0 + blk as f32));
                buf.extend((0..32).map(|j| j + r));
            }
        }
        let a = rows_affine(GgmlType::Q8_0, &buf, 2, 32..64);
        assert_eq!(a.scales, vec![2.0, 2.0]);
        let got = unpack(&a);
        let want: Vec<f32> = (0..2)
            .flat_map(|r| (0..32).map(move |j| 2.0 * (j + r) as f32))
            .collect();
        assert_eq!(got, want);
        assert_eq!(rows_float(GgmlType::Q8_0, &buf, 2, 32..64), want);
    }
}
