//! mlxcel's quantized GEMV (`kernels/qgemv.cu`): `x · dequantize(w)ᵀ` for decode
//! (batch ≤ [`MAX_M`] in one launch, up to [`MAX_CHUNKED_M`] in row chunks) on MLX's CUDA backend, where its one-token launches take
//! 2.1–4.2× less time than MLX's own `quantized_matmul` and its tensor-core path
//! 4.8× less at batch 8 (H200, 8B shapes; docs/data/qgemv-ncu-launch-shapes-h200.txt and
//! docs/history/benchmark-log.md). Elsewhere, and
//! for shapes it does not cover, callers keep `quantized_matmul`.
//!
//! The kernel source is embedded; `MLXCEL_QGEMV_SOURCE=path` loads another file
//! at run time (to iterate on the kernel without rebuilding), `MLXCEL_QGEMV=0`
//! turns the kernel off. `scripts/check_qgemv.py` checks and times the same file
//! from Python.
use std::path::Path;
use std::sync::OnceLock;

use super::{gpu, knobs};
use crate::mlx::fast::CudaKernel;
use crate::mlx::{self, Array, Backend, Dtype, MlxError, Result};

/// Largest batch (rows of x) of one launch of the kernel: up to [`DP4A_MAX_M`] on every
/// path, above it on the tensor-core path only (see [`supports`]); larger batches up to
/// [`MAX_CHUNKED_M`] run in row chunks of at most this.
pub const MAX_M: usize = 8;

const EMBEDDED: &str = include_str!("../../kernels/qgemv.cu");
const HEADER_MARK: &str = "// @@header\n";
const BODY_MARK: &str = "// @@body\n";
const ROPE_MARK: &str = "// @@body_rope\n";
const XQ_MARK: &str = "// @@body_xq\n";
const ROPE_KV_MARK: &str = super::gemv::ROPE_KV_MARK;
const MLP_MARK: &str = "// @@body_mlp\n";

/// The kernel file split into the device-code header and the three kernel bodies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub header: String,
    /// `x · Wᵀ` with epilogues 0–2, one output.
    pub body: String,
    /// The q/k/v projection with RoPE (epilogue 3), outputs q and kv.
    pub body_rope: String,
    /// x rounded to int8 per group, the tensor-core path's input (output xq).
    pub body_xq: String,
    /// The q/k/v projection with k and v written into the KV pool (output q); empty in
    /// a file without a `// @@body_rope_kv` part.
    pub body_rope_kv: String,
    /// A SwiGLU MLP's gate/up and down products in one kernel (output y); empty in a file
    /// without a last `// @@body_mlp` part.
    pub body_mlp: String,
}

impl Source {
    /// `mlxcel_qgemv_<FNV-1a of the source, 32 bits>`: MLX caches compiled kernels by
    /// name, in memory and on disk (`MLX_PTX_CACHE_DIR`), so an edited source must not
    /// reuse the old name. `scripts/check_qgemv.py` names it the same way.
    pub fn kernel_name(&self) -> String {
        let h = fnv1a32(&[
            &self.header,
            &self.body,
            ROPE_MARK,
            &self.body_rope,
            XQ_MARK,
            &self.body_xq,
            ROPE_KV_MARK,
            &self.body_rope_kv,
            MLP_MARK,
            &self.body_mlp,
        ]);
        format!("mlxcel_qgemv_{h:08x}")
    }
}

/// The low 32 bits of the 64-bit FNV-1a hash of the concatenated `parts` (kernel names).
pub(crate) fn fnv1a32(parts: &[&str]) -> u32 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in parts.iter().flat_map(|p| p.bytes()) {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h as u32
}

/// Split a kernel file at its `// @@header`, `// @@body`, `// @@body_rope` and
/// `// @@body_xq` marker lines.
pub fn split_source(text: &str) -> std::result::Result<Source, String> {
    let (_, rest) = text
        .split_once(HEADER_MARK)
        .ok_or("no `// @@header` marker line")?;
    let (header, rest) = rest
        .split_once(BODY_MARK)
        .ok_or("no `// @@body` marker line after `// @@header`")?;
    let (body, rest) = rest
        .split_once(ROPE_MARK)
        .ok_or("no `// @@body_rope` marker line after `// @@body`")?;
    let (body_rope, rest) = rest
        .split_once(XQ_MARK)
        .ok_or("no `// @@body_xq` marker line after `// @@body_rope`")?;
    // (the last two parts are each optional: the MLP's, then the KV-writing q/k/v's)
    let (rest, body_mlp) = rest.split_once(MLP_MARK).unwrap_or((rest, ""));
    let (body_xq, body_rope_kv) = rest.split_once(ROPE_KV_MARK).unwrap_or((rest, ""));
    for (text, mark) in [
        (body, "@@body"),
        (body_rope, "@@body_rope"),
        (body_xq, "@@body_xq"),
    ] {
        if text.trim().is_empty() {
            return Err(format!("the kernel body after `// {mark}` is empty"));
        }
    }
    Ok(Source {
        header: header.to_string(),
        body: body.to_string(),
        body_rope: body_rope.to_string(),
        body_xq: body_xq.to_string(),
        body_rope_kv: body_rope_kv.to_string(),
        body_mlp: body_mlp.to_string(),
    })
}

fn load_source() -> std::result::Result<Source, String> {
    match &knobs::get().qgemv_source {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                format!(
                    "MLXCEL_QGEMV_SOURCE={}: cannot read it: {e}",
                    path.display()
                )
            })?;
            split_source(&text).map_err(|e| format!("MLXCEL_QGEMV_SOURCE={}: {e}", path.display()))
        }
        None => split_source(EMBEDDED).map_err(|e| format!("embedded kernels/qgemv.cu: {e}")),
    }
}

/// The plain kernel's name, the RoPE entry point's (`<name>_rope`) and the rounding
/// kernel's (`<name>_xq`).
/// The name of the q/k/v entry point that writes the KV pool (`<name>_rope_kv`).
fn rope_kv_name() -> &'static str {
    static NAME: OnceLock<String> = OnceLock::new();
    NAME.get_or_init(|| kernel_names().0.clone() + "_rope_kv")
}

fn kernel_names() -> &'static (String, String, String) {
    static NAMES: OnceLock<(String, String, String)> = OnceLock::new();
    NAMES.get_or_init(|| {
        let n = source().map(|s| s.kernel_name()).unwrap_or_default();
        (n.clone(), n.clone() + "_rope", n + "_xq")
    })
}

/// The device-code header as MLX gets it: one `#include` line of a file holding it,
/// `<cache>/kernels/<kernel name>.cuh` (nvrtc reads it when MLX compiles a variant).
/// MLX copies the header and body into every op it makes, and hashes the result into
/// the op's kernel name; with the 36 KB header that cost about 7 µs of host time per
/// GEMV, 129–258 times a decode step (`scripts/op_costs.py`). Falls back to the header
/// itself when the file cannot be written, or with `MLXCEL_KERNEL_INCLUDE=0`.
fn mlx_header() -> Result<&'static str> {
    static HEADER: OnceLock<String> = OnceLock::new();
    let src = source()?;
    Ok(HEADER.get_or_init(|| header_for_mlx(&kernel_names().0, &src.header)))
}

/// The header and body of a kernel file with one body (after `// @@header`, split at
/// `// @@body`), or `None` when a marker is missing.
pub(crate) fn header_and_body(source: &str) -> Option<(&str, &str)> {
    source
        .split_once("// @@header\n")?
        .1
        .split_once("// @@body\n")
}

/// The MLX kernel of a one-body kernel file `file` (see [`header_and_body`]): its name
/// (`prefix` and a hash of the header and body, so it changes with them), its header as
/// MLX is given it ([`header_for_mlx`]) and its body.
pub(crate) fn one_body_kernel(prefix: &str, file: &str, source: &str) -> (String, String, String) {
    let (header, body) =
        header_and_body(source).unwrap_or_else(|| panic!("{file}: @@header and @@body markers"));
    let name = format!("{prefix}_{:08x}", fnv1a32(&[header, body]));
    let header = header_for_mlx(&name, header);
    (name, header, body.to_string())
}

/// `header` as a custom kernel named `name` passes it to MLX: an `#include` of it
/// written to `<cache>/kernels/<name>.cuh` (see [`mlx_header`]), or itself.
pub(crate) fn header_for_mlx(name: &str, header: &str) -> String {
    if !knobs::get().kernel_include {
        return header.to_string();
    }
    let dir = crate::cache_root().join("kernels");
    match include_header(&dir, name, header) {
        Ok(line) => line,
        Err(e) => {
            tracing::warn!(
                "cannot write the {name} kernel header to {}: {e}; passing it to MLX inline",
                dir.display()
            );
            header.to_string()
        }
    }
}

/// Write `header` to `dir/<name>.cuh` (unless it already holds exactly that) and return
/// the one-line header that includes it. The file is replaced atomically, so ranks of
/// one model starting together never see a partial file.
pub fn include_header(dir: &Path, name: &str, header: &str) -> std::io::Result<String> {
    std::fs::create_dir_all(dir)?;
    let path = std::fs::canonicalize(dir)?.join(format!("{name}.cuh"));
    let quoted = path
        .to_str()
        .filter(|p| !p.contains(['"', '\\', '\n']))
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{} cannot be named in an #include", path.display()),
            )
        })?
        .to_string();
    if std::fs::read(&path).ok().as_deref() != Some(header.as_bytes()) {
        // unique per process and call, even across hosts sharing the folder
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let tmp = path.with_file_name(format!(".{name}.{}.{nanos}.tmp", std::process::id()));
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .and_then(|mut f| std::io::Write::write_all(&mut f, header.as_bytes()))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    }
    Ok(format!("#include \"{quoted}\"\n"))
}

/// The device-code header of the GEMV file in use (the GEMM's device code builds on it).
pub(super) fn header() -> Result<&'static str> {
    Ok(&source()?.header)
}

fn source() -> Result<&'static Source> {
    static SOURCE: OnceLock<std::result::Result<Source, String>> = OnceLock::new();
    SOURCE
        .get_or_init(load_source)
        .as_ref()
        .map_err(|e| MlxError::Invalid(e.clone()))
}

/// Whether 4-bit weights meet x quantized to int8 (in the kernel: per 32 values on the
/// dp4a path, per group on the tensor-core path) and `dp4a` or int8 MMAs (template
/// constant `XQ`): about 2.4× fewer instructions per weight than dequantizing to float,
/// for a relative error of a few 1e-3 in the product (see `kernels/qgemv.cu`).
/// `MLXCEL_QGEMV_XQ=0` keeps bf16/f16 activations (float math, no tensor cores).
pub fn int8_activations() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| knobs::get().qgemv_xq)
}

/// Whether the kernel is used at all: MLX's CUDA backend and not `MLXCEL_QGEMV=0`.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| mlx::backend() == Backend::Cuda && knobs::get().qgemv)
}

/// Whether the kernel covers `x [m, k] · w [n, k]ᵀ` with these bits, group and dtypes.
/// Batches above [`DP4A_MAX_M`] only on the tensor-core path ([`Launch::mma`]): the
/// other one is slower than MLX's kernel there.
pub fn supports(
    m: usize,
    n: usize,
    k: usize,
    group: usize,
    bits: usize,
    dtypes: [Dtype; 2],
) -> bool {
    let vpc = match bits {
        4 => 32,
        8 => 16,
        _ => return false,
    };
    if m > MAX_M {
        // in row chunks of at most MAX_M (see [`row_chunks`])
        return chunking() && every_chunk(m, |rows| supports(rows, n, k, group, bits, dtypes));
    }
    m >= 1
        && n > 0
        && k > 0
        && k.is_multiple_of(vpc)
        && k.is_multiple_of(8)
        && group.is_multiple_of(vpc)
        && k.is_multiple_of(group)
        && dtypes_supported(dtypes)
        && (m <= DP4A_MAX_M || launch_config(m, n, k, group, bits).mma)
}

/// Activation and scale dtypes the kernel takes: bfloat16, or float16 (the GGUF default on
/// a GPU) unless `MLXCEL_QGEMV_F16=0`; both the same.
fn dtypes_supported(dtypes: [Dtype; 2]) -> bool {
    match dtypes {
        [Dtype::BF16, Dtype::BF16] => true,
        [Dtype::F16, Dtype::F16] => knobs::get().qgemv_f16,
        _ => false,
    }
}

/// Largest batch the kernel takes at all: batches above [`MAX_M`] run it on row chunks
/// ([`row_chunks`]), each reading the weights again. On H200 (Nsight, docs/data/qgemv-stream-h200.txt) MLX's
/// `quantized_matmul` (`qmm_sm80`) took 164 and 187 µs on the 8B down projection at 5 and 8
/// rows where the kernel took 13.9 and 13.8, and a server's 4-bit decode steps at 32
/// streams took 24-32 ms (p50 between tokens) against 4.5-5.6 ms at 8 (not measured since
/// with chunks). At 32 rows four chunks read 4 × 4.5 GB of the 8B model where dequantize +
/// GEMM writes and reads 16 GB of bf16 weights; longer inputs (prefill) keep that GEMM.
/// `MLXCEL_QGEMV_CHUNKS=0` leaves batches above [`MAX_M`] to MLX's kernels again.
pub const MAX_CHUNKED_M: usize = 32;

/// Whether batches above [`MAX_M`] run in row chunks (`MLXCEL_QGEMV_CHUNKS`, default on).
fn chunking() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| knobs::get().qgemv_chunks)
}

/// `m` rows as `(first row, rows)` chunks of at most [`MAX_M`], as few as that allows and
/// as even as possible (9 → 5 + 4, 20 → 7 + 7 + 6), in order.
pub fn row_chunks(m: usize) -> Vec<(usize, usize)> {
    let count = m.div_ceil(MAX_M).max(1);
    let (base, extra) = (m / count, m % count);
    let mut at = 0;
    (0..count)
        .map(|i| {
            let rows = base + usize::from(i < extra);
            at += rows;
            (at - rows, rows)
        })
        .collect()
}

/// Whether a batch of `m` rows (at most [`MAX_CHUNKED_M`]) can run in [`row_chunks`]:
/// `fits(rows)` for every chunk's rows.
fn every_chunk(m: usize, fits: impl Fn(usize) -> bool) -> bool {
    m <= MAX_CHUNKED_M && row_chunks(m).iter().all(|&(_, rows)| fits(rows))
}

/// Runs `f(first row, rows)` on each of [`row_chunks`]`(m)` and joins the outputs: output i
/// of every call concatenated along axis 0.
fn by_row_chunks(
    m: usize,
    mut f: impl FnMut(usize, usize) -> Result<Vec<Array>>,
) -> Result<Vec<Array>> {
    let mut parts: Vec<Vec<Array>> = Vec::new();
    for (lo, rows) in row_chunks(m) {
        for (i, a) in f(lo, rows)?.into_iter().enumerate() {
            if parts.len() <= i {
                parts.push(Vec::new());
            }
            parts[i].push(a);
        }
    }
    parts
        .iter()
        .map(|p| mlx::concatenate(&p.iter().collect::<Vec<_>>(), 0))
        .collect()
}

/// Largest batch the kernel's dp4a/FMA path is used for: at M ≤ 4 it beats MLX's
/// kernel on every 8B shape measured; at M = 8 it is slower per byte (its instructions
/// per weight grow with M). Larger batches up to [`MAX_M`] take the tensor-core path.
pub const DP4A_MAX_M: usize = 4;

/// How the kernel is launched: rows per block, warps per block, whether it runs the
/// tensor-core path (template constant `MMA`), and the streaming path's grid (`PG`
/// blocks looping over the row groups; 0: one block per group of `rows` rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub rows: usize,
    pub wpb: usize,
    pub mma: bool,
    pub pg: usize,
}

/// The launch [`qgemv`] and [`qgemv_rope`] use: the streaming path where
/// [`stream_config`] takes the shape, else [`launch_config`].
fn launch(m: usize, n: usize, k: usize, group: usize, bits: usize, pairs: bool) -> Launch {
    stream_config(m, n, k, group, bits, pairs)
        .unwrap_or_else(|| launch_config(m, n, k, group, bits))
}

/// The streaming path's launch (M = 1, 4-bit with int8 activations, on a GPU with
/// `cp.async`, compute capability ≥ 8.0; `MLXCEL_QGEMV_STREAM=0` turns it off, and
/// `MLXCEL_QGEMV_STREAM_BLOCKS=n` sets its grid, default [`gpu::Gpu::streaming_grid`]). `pairs`: the
/// epilogue takes pairs of rows (SwiGLU, RoPE), so rows per group must be even.
pub fn stream_config(
    m: usize,
    n: usize,
    k: usize,
    group: usize,
    bits: usize,
    pairs: bool,
) -> Option<Launch> {
    // (MLXCEL_QGEMV_MMA=1 asks for the tensor cores at batch 1: that choice stands)
    if m != 1 || bits != 4 || !xq(bits) || mma_min_m() == Some(1) {
        return None;
    }
    let blocks = stream_blocks()?;
    stream_config_for(n, k, group, pairs, blocks)
}

/// Grid of the streaming path, `None` where it does not run (see [`stream_config`]).
fn stream_blocks() -> Option<usize> {
    static BLOCKS: OnceLock<Option<usize>> = OnceLock::new();
    *BLOCKS.get_or_init(|| {
        let gpu = gpu::this_gpu();
        let knobs = knobs::get();
        if !gpu.has_cp_async() || !knobs.qgemv_stream {
            return None;
        }
        Some(
            knobs
                .qgemv_stream_blocks
                .unwrap_or_else(|| gpu.streaming_grid()),
        )
    })
}

/// Shortest row the streaming path takes. At K = 4096 (8B q/k/v, o, gate/up, lm_head) the
/// one-block-per-group launch won on every shape (Nsight, docs/data/qgemv-stream-h200.txt: q/k/v 6.5 against
/// 7.8-12.6 µs, o 5.8 against 6.6-9.7); on the 8B down projection (K = 14336) streaming
/// won (12.1-13.6 against 14.4 µs).
pub const STREAM_MIN_K: usize = 8192;

/// Shared memory the streaming path's stages may take: 48 KB of static shared memory
/// per block, less its reduction buffers (kernels/qgemv.cu checks the same).
pub const STREAM_SMEM: usize = 46 * 1024;

/// [`stream_config`] for a grid of `blocks`, rows longer than [`STREAM_MIN_K`]: the
/// threads of a block cover a row's 16-byte chunks (32 values) in as few rounds as 16
/// warps allow, with as few warps as those rounds need (8B down, 448 chunks: 14 warps,
/// one each; 70B down: 14 warps, two); 2 rows per group where two stages of them fit in
/// [`STREAM_SMEM`] (24 bytes a chunk: 16 of weights, 4 each of the scale and bias words),
/// else 1 (the pairs of SwiGLU and RoPE need 2).
fn stream_config_for(
    n: usize,
    k: usize,
    group: usize,
    pairs: bool,
    blocks: usize,
) -> Option<Launch> {
    if n == 0
        || k <= STREAM_MIN_K
        || !k.is_multiple_of(32)
        || group == 0
        || !k.is_multiple_of(group)
    {
        return None;
    }
    let chunks = k / 32;
    let iters = chunks.div_ceil(32 * 16);
    let wpb = chunks.div_ceil(32 * iters);
    let fits =
        |rows: usize| n.is_multiple_of(rows) && 2 * rows * iters * 32 * wpb * 24 <= STREAM_SMEM;
    let rows = if fits(2) { 2 } else { 1 };
    if (pairs && rows != 2) || !fits(rows) {
        return None;
    }
    Some(Launch {
        rows,
        wpb,
        mma: false,
        pg: (n / rows).min(blocks),
    })
}

/// The launch for `x [m, k] · w [n, k]ᵀ` on this machine (see [`launch_config_for`]).
pub fn launch_config(m: usize, n: usize, k: usize, group: usize, bits: usize) -> Launch {
    launch_config_for(m, n, k, group, bits, xq(bits), mma_min_m())
}

/// The template constant `XQ` for these bits: int8 activations for 4-bit weights.
fn xq(bits: usize) -> bool {
    bits == 4 && int8_activations()
}

/// Smallest batch that takes the tensor-core path, `None` where it cannot run: MLX's
/// CUDA backend on a GPU of compute capability ≥ 8.0 (`mma.sync.m16n8k32` with int8),
/// int8 activations on. `MLXCEL_QGEMV_MMA=0` turns the path off, `MLXCEL_QGEMV_MMA=n`
/// (1–8) uses it from batch n (default [`MMA_MIN_M`]).
fn mma_min_m() -> Option<usize> {
    static MIN: OnceLock<Option<usize>> = OnceLock::new();
    *MIN.get_or_init(|| {
        let capable = int8_activations() && gpu::this_gpu().has_int8_mma();
        mma_choice(capable, knobs::get().qgemv_mma)
    })
}

/// [`mma_min_m`] from whether the GPU can run it and `MLXCEL_QGEMV_MMA` (validated by
/// [`knobs`]: 0 or a batch size 1–[`MAX_M`]).
fn mma_choice(capable: bool, knob: Option<usize>) -> Option<usize> {
    match knob {
        _ if !capable => None,
        Some(0) => None,
        Some(n) => Some(n),
        None => Some(MMA_MIN_M),
    }
}

/// Smallest batch on the tensor-core path by default. On H200 (8B shapes) the path's
/// kernels (with the rounding of x) take 20% less GPU time than dp4a at M = 3 (Nsight,
/// one token's GEMVs), but decode at batches 3 and 4 was faster on dp4a end to end
/// (`mlxcel bench`, alternated: 538–549 vs 295–405 tok/s at batch 3, 602–605 vs 448–505
/// at batch 4): the rounding kernel is one more MLX op per GEMV, 129 per step, and
/// those batches are bound by MLX's host work per op. From batch 5 the dp4a path's
/// instructions grow with M and MLX's kernel is slower still.
pub const MMA_MIN_M: usize = 5;

/// Weight loads (16 bytes each) one thread may keep in flight: ptxas (sm_90) fits 28
/// of them without spilling at every M ≤ 4 with int8 activations and at 8 bits.
pub const MAX_LOADS_PER_THREAD: usize = 28;

/// Whether [`Epilogue::SwiGlu`] fits batch `m` of a merged gate/up weight of `n` rows
/// (besides [`supports`]): pairs of rows in every block of every row chunk.
pub fn supports_swiglu(m: usize, n: usize, group: usize, bits: usize) -> bool {
    if m > MAX_M {
        return every_chunk(m, |rows| supports_swiglu(rows, n, group, bits));
    }
    n.is_multiple_of(2) && rows_per_block(m, n, group, bits).is_multiple_of(2)
}

/// Rows per block (what the epilogues' pairing depends on) as for a short row. The
/// launch for the real K may take other rows (the dp4a path's where K is not a multiple
/// of 128, more or fewer at M = 1, the streaming launch 1 or 2), but always rows dividing
/// n, even wherever the epilogue pairs rows (the streaming launch is asked for pairs then),
/// which is all the pairing needs: checks made with this value stay valid.
pub fn rows_per_block(m: usize, n: usize, group: usize, bits: usize) -> usize {
    launch_config(m, n, 0, group, bits).rows
}

/// Rows per block and warps per block.
///
/// Tensor-core path (4-bit, int8 activations, group 32/64/128, `m ≥ mma_min`, n a
/// multiple of 16, k of 128), from Nsight Compute timings on H200
/// (docs/data/qgemv-nsight-sections-h200.txt): one 16-row tile per block and 8 warps splitting the row's steps of
/// 128 values, 16 warps where a row has more than 64 steps (the 8B down projection: 14.1
/// against 18.9 µs at M = 8); two tiles per block lost on every 8B shape once scales came
/// in chunks. At least two steps per warp where the row has them.
///
/// Otherwise, from Nsight Compute timings on H200 (docs/data/qgemv-nsight-sections-h200.txt): 4-bit M = 1
/// with int8 activations ([`int8_activations`]) takes 8 rows and 4 warps for K ≤ 4096,
/// else 16 rows and 8 warps, with half the rows (down to 4) while a thread would hold
/// more than [`M1_LOADS`] weight loads: the best of 4/8/16 rows × 2/4/8 warps for every
/// 8B and 70B shape but the 8B o projection (5.9 against 5.4 µs; docs/data/qgemv-nsight-sections-h200.txt);
/// with float math 2 rows (4 for the wide gate/up and lm_head) and 2 warps; 8-bit and
/// M > 1 4 rows and 4 warps. A thread holds ROWS × (its chunks of a row) 16-byte weight
/// loads in registers; above [`MAX_LOADS_PER_THREAD`] (a 70B down projection, K = 28672)
/// the block gets more warps, up to 8, then fewer rows, down to 2.
fn launch_config_for(
    m: usize,
    n: usize,
    k: usize,
    group: usize,
    bits: usize,
    xq: bool,
    mma_min: Option<usize>,
) -> Launch {
    if xq
        && bits == 4
        && matches!(group, 32 | 64 | 128)
        && mma_min.is_some_and(|min| (min..=MAX_M).contains(&m))
        && n.is_multiple_of(16)
        && k.is_multiple_of(128)
    {
        let steps = k / 128; // the kernel's steps of 128 values per row
        let mut wpb = if steps > 64 { 16 } else { 8 };
        while wpb > 1 && steps < 2 * wpb {
            wpb /= 2;
        }
        return Launch {
            rows: 16,
            wpb,
            mma: true,
            pg: 0,
        };
    }
    // the largest of r, r/2, …, 1 dividing n
    let fit = |r: usize| {
        (0..=r.trailing_zeros())
            .map(|i| r >> i)
            .find(|&d| n.is_multiple_of(d))
            .unwrap_or(1)
    };
    let chunks = k / (128 / bits.max(1)); // 16-byte chunks per row
    let loads = |rows: usize, wpb: usize| rows * chunks.div_ceil(32 * wpb);
    let (mut rows, mut wpb) = if bits == 4 && m == 1 && xq {
        let (mut rows, wpb) = if k > 4096 { (fit(16), 8) } else { (fit(8), 4) };
        while rows > 4 && loads(rows, wpb) > M1_LOADS {
            rows = fit(rows / 2);
        }
        (rows, wpb)
    } else if bits == 4 && m == 1 {
        (fit(if n >= 16384 { 4 } else { 2 }), 2)
    } else {
        (fit(4), 4)
    };
    while wpb < 8 && loads(rows, wpb) > MAX_LOADS_PER_THREAD {
        wpb *= 2;
    }
    // past that at 8 warps, fewer rows, but never fewer than 2 where n is even (the
    // epilogues' pairs): very long rows may then hold more loads, and spill
    while rows > 2 && loads(rows, wpb) > MAX_LOADS_PER_THREAD {
        rows = fit(rows / 2);
    }
    Launch {
        rows,
        wpb,
        mma: false,
        pg: 0,
    }
}

/// Weight loads per thread the 4-bit M = 1 launch stays within for rows above 4: 8 rows
/// and 4 warps hold 8 at K = 4096, 16 rows and 8 warps 16 at K = 8192; the 8B down
/// projection (K = 14336) gets 8 rows, the 70B one (K = 28672) 4.
pub const M1_LOADS: usize = 16;

/// What the kernel writes besides `x · Wᵀ` (its template constant `EPI`): each fused
/// epilogue saves a decode step one MLX op per layer.
#[derive(Clone, Copy)]
pub enum Epilogue<'a> {
    /// `x · Wᵀ`
    None,
    /// `res + x · Wᵀ`; `res` has the output's size (the residual stream).
    Residual(&'a Array),
    /// `silu(g) · u` where `[g | u] = x · Wᵀ` (a merged gate/up projection): `n / 2` columns.
    SwiGlu,
}

impl Epilogue<'_> {
    /// The kernels' template constant `EPI`.
    pub(super) fn code(&self) -> usize {
        match self {
            Epilogue::None => 0,
            Epilogue::Residual(_) => 1,
            Epilogue::SwiGlu => 2,
        }
    }
}

/// `x · dequantize(w, scales, biases)ᵀ` with the kernel, x read as `m` rows of `k`
/// (any shape of `m · k` elements), the result shaped `out_shape` (`m · n` elements,
/// `m · n / 2` for [`Epilogue::SwiGlu`]). With `norm = Some((weight, eps))` each row of
/// x is RMS-normalised first (`weight` `[k]`), in the same kernel. The caller checks
/// [`enabled`] and [`supports`].
#[allow(clippy::too_many_arguments)]
pub fn qgemv(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group: usize,
    bits: usize,
    out_shape: &[i32],
    epi: Epilogue<'_>,
    norm: Option<(&Array, f32)>,
) -> Result<Array> {
    let n = w.dim(0) as usize;
    let k = w.dim(1) as usize * 32 / bits;
    let m = x.size() / k.max(1);
    let out_n = if matches!(epi, Epilogue::SwiGlu) {
        n / 2
    } else {
        n
    };
    let out_size: i64 = out_shape.iter().map(|&d| d as i64).product();
    if x.size() != m * k || out_size != (m * out_n) as i64 {
        return Err(MlxError::Invalid(format!(
            "qgemv: x of {} elements and output {out_shape:?} do not fit a [{n}, {k}] weight",
            x.size()
        )));
    }
    if m > MAX_M {
        // row chunks, each a run of the kernel (see MAX_CHUNKED_M)
        let (mi, ki, ni, oi) = (m as i32, k as i32, n as i32, out_n as i32);
        let x2 = x.reshape(&[mi, ki])?;
        let res2 = match epi {
            Epilogue::Residual(r) if r.size() != m * n => {
                return Err(MlxError::Invalid(format!(
                    "qgemv: residual {:?} does not match the output [{m}, {n}]",
                    r.shape()
                )))
            }
            Epilogue::Residual(r) => Some(r.reshape(&[mi, ni])?),
            _ => None,
        };
        let mut y = by_row_chunks(m, |lo, rows| {
            let (a, b) = (lo as i32, (lo + rows) as i32);
            let xi = x2.slice_axis(0, a, b)?;
            let ri = res2.as_ref().map(|r| r.slice_axis(0, a, b)).transpose()?;
            let e = match &ri {
                Some(r) => Epilogue::Residual(r),
                None => epi,
            };
            let shape = [rows as i32, oi];
            Ok(vec![qgemv(
                &xi, w, scales, biases, group, bits, &shape, e, norm,
            )?])
        })?;
        return y
            .pop()
            .ok_or_else(|| MlxError::Invalid("qgemv: no rows".into()))?
            .reshape(out_shape);
    }
    let src = source()?;
    let swiglu = matches!(epi, Epilogue::SwiGlu);
    let Launch { rows, wpb, mma, pg } = launch(m, n, k, group, bits, swiglu);
    if swiglu && rows % 2 != 0 {
        return Err(MlxError::Invalid(format!(
            "qgemv: SwiGLU needs an even number of rows per block, got {rows} for n = {n}"
        )));
    }
    let res = match epi {
        Epilogue::Residual(r) => {
            if r.size() != m * n || r.dtype() != x.dtype() {
                return Err(MlxError::Invalid(format!(
                    "qgemv: residual {:?} {:?} does not match the output [{m}, {n}] {:?}",
                    r.shape(),
                    r.dtype(),
                    x.dtype()
                )));
            }
            r
        }
        _ => x, // not read
    };
    let (nw, eps) = norm_input("qgemv", norm, x, k)?;
    // the tensor-core path reads x rounded by its own kernel, which applies the norm
    let xr = mma
        .then(|| round_x(x, m, k, group, norm.map(|_| (nw, eps))))
        .transpose()?;
    // built once: this runs for every quantized linear of every decode step
    static NAMES: OnceLock<([String; 6], [String; 1], [String; 13])> = OnceLock::new();
    let (inputs, outputs, tnames) = NAMES.get_or_init(|| {
        (
            ["x", "w", "scales", "biases", "res", "nw"].map(String::from),
            ["y".to_string()],
            [
                "M", "N", "K", "G", "BITS", "ROWS", "WPB", "EPI", "NORM", "EPS_BITS", "XQ", "MMA",
                "PG",
            ]
            .map(String::from),
        )
    });
    let kernel = CudaKernel {
        name: &kernel_names().0,
        input_names: inputs,
        output_names: outputs,
        header: mlx_header()?,
        body: &src.body,
        shared_memory: 0,
    };
    let tvals = [
        m,
        n,
        k,
        group,
        bits,
        rows,
        wpb,
        epi.code(),
        norm.is_some() as usize,
        eps.to_bits() as usize, // 0 without a norm
        xq(bits) as usize,
        mma as usize, // 1: x rounded by round_x first
        pg,
    ]
    .map(|v| v as i32);
    let blocks = if pg > 0 { pg } else { n / rows };
    let mut out = kernel.call(
        &[xr.as_ref().unwrap_or(x), w, scales, biases, res, nw],
        &[out_shape],
        x.dtype(),
        tnames,
        &tvals,
        x.dtype(),
        [(blocks * 32 * wpb) as i32, 1, 1],
        [(32 * wpb) as i32, 1, 1],
    )?;
    out.pop()
        .ok_or_else(|| MlxError::Invalid("qgemv: the kernel returned no output".into()))
}

/// Most batch rows [`qgemv_mlp`] takes: the dp4a/FMA path's ([`DP4A_MAX_M`]).
pub const MLP_MAX_M: usize = DP4A_MAX_M;

/// A quantized weight in MLX's affine layout: packed values, scales, biases.
#[derive(Clone, Copy)]
pub struct QWeight<'a> {
    pub w: &'a Array,
    pub scales: &'a Array,
    pub biases: &'a Array,
}

/// [`qgemv_mlp`]'s scratch for one MLP: the activations between its two stages
/// (`[MLP_MAX_M, inter]`) and the stages' counts, which start at zero and are left at zero
/// by every call. Evaluated at once, so the kernel gets buffers of their own. `last` is
/// the last call's output, the next call's `prev` input (never read): calls sharing the
/// scratch (a step's decode rows and its prefill chunks go through one layer's MLP twice)
/// run one after another, since MLX orders kernels only by the arrays they read.
pub struct MlpScratch {
    act: Array,
    count: Array,
    inter: usize,
    last: std::cell::RefCell<Option<Array>>,
}

impl MlpScratch {
    pub fn new(inter: usize, dtype: Dtype) -> Result<Self> {
        let act = Array::zeros(&[(MLP_MAX_M * inter) as i32], dtype)?;
        // (the stages' done counts and the tickets)
        let count = crate::mlx::device_inputs::counts_i32(3)?;
        mlx::eval(&[&act, &count])?;
        Ok(MlpScratch {
            act,
            count,
            inter,
            last: std::cell::RefCell::new(None),
        })
    }
}

/// The launch of [`qgemv_mlp`] for `m` rows, intermediate size `inter` (this rank's) and
/// hidden size `hidden`: rows per block of the gate/up stage and of the down stage, and
/// the warps per block both take (the larger of their own launches'); `None` where either
/// stage would take the tensor cores or the gate/up stage an odd number of rows.
pub fn mlp_launch(
    m: usize,
    inter: usize,
    hidden: usize,
    group: usize,
    bits: usize,
) -> Option<(usize, usize, usize)> {
    if m == 0 || m > MLP_MAX_M {
        return None;
    }
    let up = launch_config(m, 2 * inter, hidden, group, bits);
    let down = launch_config(m, hidden, inter, group, bits);
    if up.mma || down.mma || !up.rows.is_multiple_of(2) {
        return None;
    }
    let wpb = up.wpb.max(down.wpb);
    // The down stage runs at the gate/up stage's warps per block and registers (one
    // block per SM at 8 warps on an H100), so it takes as many rows per block as a
    // thread's weight loads allow (M1_LOADS, or its own launch's when that holds more):
    // fewer, longer blocks instead of many short waves of them
    let per_row = (inter / (128 / bits.max(1))).div_ceil(32 * wpb);
    let most = M1_LOADS.max(down.rows * per_row);
    let rows2 = match knobs::get().qgemv_mlp_rows2 {
        Some(r) => r,
        None => [16, 8, 4, 2, 1]
            .into_iter()
            .find(|&r| hidden.is_multiple_of(r) && r * per_row <= most)
            .unwrap_or(down.rows),
    };
    if !hidden.is_multiple_of(rows2) {
        return None;
    }
    Some((up.rows, rows2, wpb))
}

/// Whether [`qgemv_mlp`] runs for these shapes: `MLXCEL_QGEMV_MLP=1`, the kernel on,
/// both products and the SwiGLU pairs within what the GEMV takes, and a launch
/// ([`mlp_launch`]).
pub fn mlp_supported(
    m: usize,
    inter: usize,
    hidden: usize,
    group: usize,
    bits: usize,
    dtypes: [Dtype; 2],
) -> bool {
    knobs::get().qgemv_mlp
        && enabled()
        && source().is_ok_and(|s| !s.body_mlp.trim().is_empty())
        && supports(m, 2 * inter, hidden, group, bits, dtypes)
        && supports(m, hidden, inter, group, bits, dtypes)
        && supports_swiglu(m, 2 * inter, group, bits)
        && mlp_launch(m, inter, hidden, group, bits).is_some()
}

/// `res + down(silu(g) · u)` (or without `res` when `add_res` is false: a
/// tensor-parallel rank that does not add it) where `[g | u] = norm(x) · gate_upᵀ`, for
/// the `m` rows of x (`m` ≤ [`MLP_MAX_M`]), in one kernel of two stages
/// (`mlxcel_qgemv_mlp` in kernels/qgemv.cu): one MLX op where the two GEMVs were two.
/// Shaped like `res` (`m · hidden` elements, x's dtype). Calls sharing `scratch` are
/// ordered by it ([`MlpScratch`]). The caller checks [`mlp_supported`].
#[allow(clippy::too_many_arguments)]
pub fn qgemv_mlp(
    x: &Array,
    gate_up: QWeight<'_>,
    down: QWeight<'_>,
    group: usize,
    bits: usize,
    norm: Option<(&Array, f32)>,
    res: &Array,
    add_res: bool,
    scratch: &MlpScratch,
) -> Result<Array> {
    let inter = gate_up.w.dim(0) as usize / 2;
    let hidden = gate_up.w.dim(1) as usize * 32 / bits.max(1);
    let m = x.size() / hidden.max(1);
    let down_k = down.w.dim(1) as usize * 32 / bits.max(1);
    if x.size() != m * hidden
        || res.size() != m * hidden
        || res.dtype() != x.dtype()
        || down.w.dim(0) as usize != hidden
        || down_k != inter
        || scratch.inter != inter
        || scratch.act.dtype() != x.dtype()
    {
        return Err(MlxError::Invalid(format!(
            "qgemv_mlp: x {:?}, residual {:?} {:?}, gate/up {:?}, down {:?} and a scratch of \
             {} columns {:?} do not make one MLP of {bits}-bit weights",
            x.shape(),
            res.shape(),
            res.dtype(),
            gate_up.w.shape(),
            down.w.shape(),
            scratch.inter,
            scratch.act.dtype()
        )));
    }
    let (r1, r2, wpb) = mlp_launch(m, inter, hidden, group, bits).ok_or_else(|| {
        MlxError::Invalid(format!(
            "qgemv_mlp: no launch for {m} rows of an MLP {hidden} → {inter} ({bits}-bit, group {group})"
        ))
    })?;
    let src = source()?;
    if src.body_mlp.trim().is_empty() {
        return Err(MlxError::Invalid(
            "qgemv_mlp: the kernel file has no `// @@body_mlp` part".into(),
        ));
    }
    let (nw, eps) = norm_input("qgemv_mlp", norm, x, hidden)?;
    // MLXCEL_QGEMV_MLP_BOUNDED: compiled for two blocks per SM (another source, another name)
    let bounded = knobs::get().qgemv_mlp_bounded;
    static NAME: OnceLock<[String; 2]> = OnceLock::new();
    let name = &NAME.get_or_init(|| {
        let n = kernel_names().0.clone();
        [n.clone() + "_mlp", n + "_mlp_bounded"]
    })[bounded as usize];
    let base = mlx_header()?;
    static BOUNDED_HEADER: OnceLock<String> = OnceLock::new();
    let header = match bounded {
        false => base,
        true => BOUNDED_HEADER.get_or_init(|| format!("{}{base}", super::qgemm::BOUNDED_PREFIX)),
    };
    static NAMES: OnceLock<([String; 12], [String; 1], [String; 12])> = OnceLock::new();
    let (inputs, outputs, tnames) = NAMES.get_or_init(|| {
        (
            [
                "x", "w1", "s1", "b1", "nw", "w2", "s2", "b2", "res", "act", "count", "prev",
            ]
            .map(String::from),
            ["y".to_string()],
            [
                "M", "NI", "K", "G", "BITS", "R1", "R2", "WPB", "NORM", "EPS_BITS", "XQ", "EPI2",
            ]
            .map(String::from),
        )
    });
    let kernel = CudaKernel {
        name,
        input_names: inputs,
        output_names: outputs,
        header,
        body: &src.body_mlp,
        shared_memory: 0,
    };
    let tvals = [
        m,
        inter,
        hidden,
        group,
        bits,
        r1,
        r2,
        wpb,
        norm.is_some() as usize,
        eps.to_bits() as usize,
        xq(bits) as usize,
        add_res as usize,
    ]
    .map(|v| v as i32);
    let blocks = 2 * inter / r1 + hidden / r2;
    let prev = scratch.last.borrow().clone();
    let mut out = kernel.call(
        &[
            x,
            gate_up.w,
            gate_up.scales,
            gate_up.biases,
            nw,
            down.w,
            down.scales,
            down.biases,
            res,
            &scratch.act,
            &scratch.count,
            prev.as_ref().unwrap_or(x),
        ],
        &[&res.shape()],
        x.dtype(),
        tnames,
        &tvals,
        x.dtype(),
        [(blocks * 32 * wpb) as i32, 1, 1],
        [(32 * wpb) as i32, 1, 1],
    )?;
    let y = out
        .pop()
        .ok_or_else(|| MlxError::Invalid("qgemv_mlp: the kernel returned no output".into()))?;
    *scratch.last.borrow_mut() = Some(y.clone());
    Ok(y)
}

/// Threads per block of the rounding kernel (`XQ_TPB` in kernels/qgemv.cu).
const XQ_TPB: usize = 256;

/// x (`m` rows of `k`) rounded to int8 per group of `group` values by the kernel file's
/// `@@body_xq`, the tensor-core path's input: uint32 words, the int8 values (`m·k/4`
/// words, a group's `m` rows together) then a (scale, scale·Σ) float pair per group and
/// row, the rows padded to 8 (the MMA's columns); with `norm` the row's RMSNorm is in
/// the scales. Once per GEMV instead of once per block of the GEMV.
fn round_x(
    x: &Array,
    m: usize,
    k: usize,
    group: usize,
    norm: Option<(&Array, f32)>,
) -> Result<Array> {
    let src = source()?;
    static NAMES: OnceLock<([String; 2], [String; 1], [String; 5])> = OnceLock::new();
    let (inputs, outputs, tnames) = NAMES.get_or_init(|| {
        (
            ["x", "nw"].map(String::from),
            ["xq".to_string()],
            ["M", "K", "G", "NORM", "EPS_BITS"].map(String::from),
        )
    });
    let kernel = CudaKernel {
        name: &kernel_names().2,
        input_names: inputs,
        output_names: outputs,
        header: mlx_header()?,
        body: &src.body_xq,
        shared_memory: 0,
    };
    let (nw, eps) = norm.unwrap_or((x, 0.0));
    let tvals = [m, k, group, norm.is_some() as usize, eps.to_bits() as usize].map(|v| v as i32);
    let words = m * k / 4 + 2 * 8 * (k / group);
    let blocks = m * (k / 8).div_ceil(XQ_TPB);
    let mut out = kernel.call(
        &[x, nw],
        &[&[words as i32]],
        Dtype::U32,
        tnames,
        &tvals,
        x.dtype(),
        [(blocks * XQ_TPB) as i32, 1, 1],
        [XQ_TPB as i32, 1, 1],
    )?;
    out.pop()
        .ok_or_else(|| MlxError::Invalid("qgemv: the rounding kernel returned no output".into()))
}

/// The kernel's `nw` input and eps: the norm weight (one value per input feature, x's
/// dtype), or x itself when there is no norm (not read then).
pub(super) fn norm_input<'a>(
    who: &str,
    norm: Option<(&'a Array, f32)>,
    x: &'a Array,
    k: usize,
) -> Result<(&'a Array, f32)> {
    match norm {
        Some((nw, eps)) if nw.size() == k && nw.dtype() == x.dtype() => Ok((nw, eps)),
        Some((nw, _)) => Err(MlxError::Invalid(format!(
            "{who}: norm weight {:?} {:?} does not match k = {k} {:?}",
            nw.shape(),
            nw.dtype(),
            x.dtype()
        ))),
        None => Ok((x, 0.0)),
    }
}

/// Whether [`qgemv_rope`] covers a merged q/k/v weight of `n` rows for `nq` query heads
/// of `head_dim` values at batch `m` (besides [`supports`]): whole heads, as many key
/// as value heads, and pairs of rows (d, d + head_dim/2) dividing evenly into blocks.
pub fn supports_rope(
    m: usize,
    n: usize,
    group: usize,
    bits: usize,
    nq: usize,
    head_dim: usize,
) -> bool {
    if m > MAX_M {
        return every_chunk(m, |rows| supports_rope(rows, n, group, bits, nq, head_dim));
    }
    if head_dim == 0 || !head_dim.is_multiple_of(2) || !n.is_multiple_of(head_dim) {
        return false;
    }
    let heads = n / head_dim;
    let rows = rows_per_block(m, n, group, bits);
    heads > nq
        && (heads - nq).is_multiple_of(2)
        && rows.is_multiple_of(2)
        && (n / 2).is_multiple_of(rows / 2)
}

/// A KV pool and its rows for a q/k/v kernel that writes the pool (`what` names it in
/// errors): `pool` `[1, nkv2, R, head_dim]` of `dtype` (key then value heads), `dst` int32
/// `[m]`: each batch row's pool row.
pub(super) fn check_kv_dst(
    what: &str,
    pool: &Array,
    dst: &Array,
    dtype: crate::mlx::Dtype,
    m: usize,
    nkv2: usize,
    head_dim: usize,
) -> Result<()> {
    let ps = pool.shape();
    if ps.len() != 4
        || ps[0] != 1
        || ps[1] as usize != nkv2
        || ps[3] as usize != head_dim
        || pool.dtype() != dtype
        || dst.dtype() != crate::mlx::Dtype::I32
        || dst.size() != m
    {
        return Err(MlxError::Invalid(format!(
            "{what}: pool {ps:?} {:?} and rows {:?} {:?} do not fit {nkv2} kv heads of \
             {head_dim} in {dtype:?} for {m} rows",
            pool.dtype(),
            dst.shape(),
            dst.dtype()
        )));
    }
    Ok(())
}

/// The q/k/v projection of a decode step in one kernel: `y = norm(x) · Wᵀ` for a merged
/// `[q; k; v]` weight (`nq` query heads, then equally many key and value heads of
/// `head_dim`), with RoPE (half-split, angle `pos[m] · inv_freq[d]`) applied to the
/// q and k heads of row m. Returns q `[m, nq, 1, head_dim]` and kv `[m, 2·nkv, 1,
/// head_dim]` (key heads, then value heads). `pos`: int32, one position per row of x;
/// `inv_freq`: float32 `[head_dim / 2]`. The caller checks [`enabled`], [`supports`]
/// and [`supports_rope`].
///
/// With `into` (a layer's KV pool `[1, 2·nkv, R, head_dim]` of x's dtype, as a view that
/// holds no reference to it, and int32 rows `[m]`: [`check_kv_dst`]) the key and value
/// heads of batch row i go straight into the pool at row `rows[i]` (the decode step's cache
/// write, without a kernel of its own) and kv is `None`; up to [`MAX_M`] rows then (no row
/// chunks). With `bias` (`[n]` of x's dtype: Qwen2's q/k/v biases) it is added before the
/// rotation.
#[allow(clippy::too_many_arguments)]
pub fn qgemv_rope(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group: usize,
    bits: usize,
    norm: Option<(&Array, f32)>,
    pos: &Array,
    inv_freq: &Array,
    nq: usize,
    head_dim: usize,
    into: Option<(&Array, &Array)>,
    bias: Option<&Array>,
) -> Result<(Array, Option<Array>)> {
    let n = w.dim(0) as usize;
    let k = w.dim(1) as usize * 32 / bits;
    let m = x.size() / k.max(1);
    if x.size() != m * k || !supports_rope(m, n, group, bits, nq, head_dim) {
        return Err(MlxError::Invalid(format!(
            "qgemv_rope: x of {} elements, a [{n}, {k}] weight and {nq} query heads of \
             {head_dim} do not fit",
            x.size()
        )));
    }
    check_rope_inputs("qgemv_rope", pos, inv_freq, m, head_dim)?;
    check_qkv_bias("qgemv_rope", bias, n, x.dtype())?;
    if m > MAX_M && into.is_some() {
        return Err(MlxError::Invalid(format!(
            "qgemv_rope: {m} rows into the KV pool, more than the kernel's {MAX_M}"
        )));
    }
    let nkv2 = n / head_dim - nq;
    if let Some((pool, dst)) = into {
        check_kv_dst("qgemv_rope", pool, dst, x.dtype(), m, nkv2, head_dim)?;
    }
    if m > MAX_M {
        // row chunks, each a run of the kernel (see MAX_CHUNKED_M)
        let x2 = x.reshape(&[m as i32, k as i32])?;
        let pos1 = pos.reshape(&[m as i32])?;
        let out = by_row_chunks(m, |lo, rows| {
            let (a, b) = (lo as i32, (lo + rows) as i32);
            let (q, kv) = qgemv_rope(
                &x2.slice_axis(0, a, b)?,
                w,
                scales,
                biases,
                group,
                bits,
                norm,
                &pos1.slice_axis(0, a, b)?,
                inv_freq,
                nq,
                head_dim,
                None,
                bias,
            )?;
            Ok(std::iter::once(q).chain(kv).collect())
        })?;
        return q_and_kv("qgemv_rope", out, false);
    }
    let (nw, eps) = norm_input("qgemv_rope", norm, x, k)?;
    let src = source()?;
    let Launch { rows, wpb, mma, pg } = launch(m, n, k, group, bits, true);
    let xr = mma
        .then(|| round_x(x, m, k, group, norm.map(|_| (nw, eps))))
        .transpose()?;
    if into.is_some() && src.body_rope_kv.trim().is_empty() {
        return Err(MlxError::Invalid(
            "qgemv_rope: the kernel file has no `// @@body_rope_kv` part".into(),
        ));
    }
    type Names = (
        [String; 8],
        [String; 2],
        [String; 10],
        [String; 1],
        [String; 15],
    );
    static NAMES: OnceLock<Names> = OnceLock::new();
    let (inputs, outputs, inputs_kv, outputs_kv, tnames) = NAMES.get_or_init(|| {
        let ins = ["x", "w", "scales", "biases", "nw", "pos", "inv_freq", "qb"];
        let ins_kv = [
            "x", "w", "scales", "biases", "nw", "pos", "inv_freq", "pool", "dst", "qb",
        ];
        (
            ins.map(String::from),
            ["q", "kv"].map(String::from),
            ins_kv.map(String::from),
            ["q".to_string()],
            [
                "M", "N", "K", "G", "BITS", "ROWS", "WPB", "NORM", "EPS_BITS", "HD", "NQ", "XQ",
                "MMA", "PG", "BIAS",
            ]
            .map(String::from),
        )
    });
    let kernel = match into {
        Some(_) => CudaKernel {
            name: rope_kv_name(),
            input_names: inputs_kv,
            output_names: outputs_kv,
            header: mlx_header()?,
            body: &src.body_rope_kv,
            shared_memory: 0,
        },
        None => CudaKernel {
            name: &kernel_names().1,
            input_names: inputs,
            output_names: outputs,
            header: mlx_header()?,
            body: &src.body_rope,
            shared_memory: 0,
        },
    };
    let tvals = [
        m,
        n,
        k,
        group,
        bits,
        rows,
        wpb,
        norm.is_some() as usize,
        eps.to_bits() as usize,
        head_dim,
        nq,
        xq(bits) as usize,
        mma as usize, // 1: x rounded by round_x first
        pg,
        bias.is_some() as usize,
    ]
    .map(|v| v as i32);
    let blocks = if pg > 0 { pg } else { n / rows };
    let (mi, hd) = (m as i32, head_dim as i32);
    let mut ins = vec![
        xr.as_ref().unwrap_or(x),
        w,
        scales,
        biases,
        nw,
        pos,
        inv_freq,
    ];
    let q_shape = [mi, nq as i32, 1, hd];
    let kv_shape = [mi, nkv2 as i32, 1, hd];
    let shapes: Vec<&[i32]> = match into {
        Some((pool, dst)) => {
            ins.extend([pool, dst]);
            vec![&q_shape]
        }
        None => vec![&q_shape, &kv_shape],
    };
    ins.push(bias.unwrap_or(nw)); // qb (not read without a bias)
    let out = kernel.call(
        &ins,
        &shapes,
        x.dtype(),
        tnames,
        &tvals,
        x.dtype(),
        [(blocks * 32 * wpb) as i32, 1, 1],
        [(32 * wpb) as i32, 1, 1],
    )?;
    q_and_kv("qgemv_rope", out, into.is_some())
}

/// A q/k/v projection's bias for the RoPE entry points (`what` names the caller in the
/// error): `[n]` values of the activations' dtype.
pub(super) fn check_qkv_bias(
    what: &str,
    bias: Option<&Array>,
    n: usize,
    dtype: Dtype,
) -> Result<()> {
    match bias {
        Some(b) if b.size() != n || b.dtype() != dtype => Err(MlxError::Invalid(format!(
            "{what}: bias {:?} {:?} does not match the {n} output rows ({dtype:?})",
            b.shape(),
            b.dtype()
        ))),
        _ => Ok(()),
    }
}

/// The outputs of a q/k/v + RoPE kernel (`what` names it in the error): q, and kv unless
/// the kernel wrote the keys and values into the KV pool (`into`).
pub(super) fn q_and_kv(what: &str, out: Vec<Array>, into: bool) -> Result<(Array, Option<Array>)> {
    let mut out = out.into_iter();
    match (out.next(), out.next(), into) {
        (Some(q), None, true) => Ok((q, None)),
        (Some(q), Some(kv), false) => Ok((q, Some(kv))),
        _ => Err(MlxError::Invalid(format!(
            "{what}: the kernel did not return q{}",
            if into { " alone" } else { " and kv" }
        ))),
    }
}

/// The RoPE inputs of a fused q/k/v launch (`what` names it in errors): `m` int32
/// positions and `head_dim / 2` float32 inverse frequencies.
pub(super) fn check_rope_inputs(
    what: &str,
    pos: &Array,
    inv_freq: &Array,
    m: usize,
    head_dim: usize,
) -> Result<()> {
    if pos.size() != m || pos.dtype() != Dtype::I32 {
        return Err(MlxError::Invalid(format!(
            "{what}: positions {:?} {:?}, expected {m} int32",
            pos.shape(),
            pos.dtype()
        )));
    }
    if inv_freq.size() != head_dim / 2 || inv_freq.dtype() != Dtype::F32 {
        return Err(MlxError::Invalid(format!(
            "{what}: inverse frequencies {:?} {:?}, expected {} float32",
            inv_freq.shape(),
            inv_freq.dtype(),
            head_dim / 2
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_source_splits_into_header_and_body() {
        let s = split_source(EMBEDDED).unwrap();
        assert!(s.header.contains("mlxcel_qval"));
        assert!(s.header.contains("res[at]") && s.header.contains("inv_freq[d]"));
        assert!(s.body.contains("WPB") && s.body.contains("EPI") && !s.body.contains("@@"));
        assert!(s.body_rope.contains("HD, NQ") && !s.body_rope.contains("@@"));
        assert!(s.body_xq.contains("mlxcel_round_x") && !s.body_xq.contains("@@"));
        assert!(s.body_rope_kv.contains("pool_shape") && !s.body_rope_kv.contains("@@"));
        assert!(s.body_mlp.contains("mlxcel_qgemv_mlp") && !s.body_mlp.contains("@@"));
        assert!(s
            .header
            .contains(&format!("constexpr int XQ_TPB = {XQ_TPB};")));
    }

    #[test]
    fn the_last_two_parts_are_each_optional() {
        let head =
            "// @@header\nint h;\n// @@body\nf();\n// @@body_rope\nr();\n// @@body_xq\nq();\n";
        let s = split_source(&format!("{head}// @@body_mlp\nm();\n")).unwrap();
        assert_eq!(
            (s.body_xq.trim(), s.body_rope_kv.as_str(), s.body_mlp.trim()),
            ("q();", "", "m();")
        );
        let s = split_source(&format!("{head}// @@body_rope_kv\nk();\n")).unwrap();
        assert_eq!(
            (s.body_xq.trim(), s.body_rope_kv.trim(), s.body_mlp.as_str()),
            ("q();", "k();", "")
        );
        let s = split_source(&format!(
            "{head}// @@body_rope_kv\nk();\n// @@body_mlp\nm();\n"
        ))
        .unwrap();
        assert_eq!((s.body_rope_kv.trim(), s.body_mlp.trim()), ("k();", "m();"));
    }

    #[test]
    fn kernel_name_follows_the_source() {
        let a = split_source(EMBEDDED).unwrap();
        let mut b = a.clone();
        b.body.push_str("\n// edited\n");
        let mut c = a.clone();
        c.body_rope.push_str("\n// edited\n");
        let mut d = a.clone();
        d.body_xq.push_str("\n// edited\n");
        assert!(a.kernel_name().starts_with("mlxcel_qgemv_"));
        assert_eq!(a.kernel_name().len(), "mlxcel_qgemv_".len() + 8);
        assert_eq!(a.kernel_name(), a.clone().kernel_name());
        assert_ne!(a.kernel_name(), b.kernel_name());
        assert_ne!(a.kernel_name(), c.kernel_name());
        assert_ne!(a.kernel_name(), d.kernel_name());
    }

    #[test]
    fn the_header_goes_to_a_file_that_one_include_line_names() {
        let tmp = tempfile::Builder::new()
            .prefix("mlxcel-incl-test-")
            .tempdir()
            .unwrap();
        let dir = tmp.path();
        let header = split_source(EMBEDDED).unwrap().header;
        let line = include_header(&dir.join("kernels"), "mlxcel_qgemv_x", &header).unwrap();
        let path = std::fs::canonicalize(dir.join("kernels/mlxcel_qgemv_x.cuh")).unwrap();
        assert_eq!(line, format!("#include \"{}\"\n", path.display()));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), header);
        // another content under the same name is rewritten; no temp file is left
        let line2 = include_header(&dir.join("kernels"), "mlxcel_qgemv_x", "int y;\n").unwrap();
        assert_eq!(line2, line);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "int y;\n");
        assert_eq!(std::fs::read_dir(dir.join("kernels")).unwrap().count(), 1);
        // a folder that cannot be made is an error (the caller then passes the header inline)
        std::fs::write(dir.join("file"), "").unwrap();
        assert!(include_header(&dir.join("file"), "n", "h").is_err());
        let quote = dir.join("a\"b");
        assert!(include_header(&quote, "n", "h")
            .unwrap_err()
            .to_string()
            .contains("#include"));
    }

    #[test]
    fn bad_sources_are_refused_with_the_reason() {
        assert!(split_source("no markers").unwrap_err().contains("@@header"));
        let e = split_source("// @@header\nint x;\n").unwrap_err();
        assert!(e.contains("@@body"), "{e}");
        let e =
            split_source("// @@header\n// @@body\n  \n// @@body_rope\nf();\n// @@body_xq\ng();\n")
                .unwrap_err();
        assert!(e.contains("empty") && e.contains("`// @@body`"), "{e}");
        let e = split_source("// @@header\n// @@body\nf();\n// @@body_rope\nf();\n// @@body_xq\n")
            .unwrap_err();
        assert!(e.contains("empty") && e.contains("@@body_xq"), "{e}");
        let e = split_source("// @@header\n// @@body\nf();\n// @@body_rope\nf();\n").unwrap_err();
        assert!(e.contains("@@body_xq"), "{e}");
        let e = split_source("// @@header\n// @@body\nf();\n").unwrap_err();
        assert!(e.contains("@@body_rope"), "{e}");
    }

    #[test]
    fn shapes_and_dtypes_the_kernel_covers() {
        let bf = [Dtype::BF16, Dtype::BF16];
        assert!(supports(1, 6144, 4096, 64, 4, bf));
        assert!(supports(4, 4096, 14336, 32, 8, bf));
        assert!(supports(1, 4096, 3584, 128, 4, bf)); // Qwen2-7B hidden size
        if mma_min_m().is_none() {
            // batches above MAX_M run in chunks of 4-8 rows, those of 5-8 on the tensor cores
            assert!(!supports(MAX_M + 1, 4096, 4096, 64, 4, bf));
        }
        assert!(!supports(MAX_CHUNKED_M + 1, 4096, 4096, 64, 4, bf));
        if mma_min_m().is_none() {
            // no tensor-core path here (CPU): batches above the dp4a path's limit are MLX's
            assert!(!supports(DP4A_MAX_M + 1, 4096, 4096, 64, 4, bf));
        }
        assert!(!supports(0, 4096, 4096, 64, 4, bf));
        assert!(!supports(1, 4096, 4096, 64, 3, bf)); // 3-bit: MLX's kernel
        assert!(!supports(1, 4096, 4096, 16, 4, bf)); // group < 32 values per load
        assert!(supports(1, 4096, 4080, 16, 8, bf)); // 8-bit: 16 values per load
        assert!(!supports(1, 4096, 4104, 8, 8, bf)); // K not a multiple of 16
        assert!(supports(1, 4096, 4096, 64, 4, [Dtype::F16, Dtype::F16]));
        assert!(!supports(1, 4096, 4096, 64, 4, [Dtype::BF16, Dtype::F16]));
        assert!(!supports(1, 4096, 4096, 64, 4, [Dtype::BF16, Dtype::F32]));
        assert!(!supports(1, 4096, 4096, 64, 4, [Dtype::F32, Dtype::F32]));
    }

    /// (rows, wpb) of the dp4a/FMA path (no tensor cores), group 64.
    fn dp(m: usize, n: usize, k: usize, bits: usize, xq: bool) -> (usize, usize) {
        let l = launch_config_for(m, n, k, 64, bits, xq, None);
        assert!(!l.mma);
        (l.rows, l.wpb)
    }

    #[test]
    fn row_chunks_cover_the_batch_evenly() {
        assert_eq!(row_chunks(1), vec![(0, 1)]);
        assert_eq!(row_chunks(8), vec![(0, 8)]);
        assert_eq!(row_chunks(9), vec![(0, 5), (5, 4)]);
        assert_eq!(row_chunks(20), vec![(0, 7), (7, 7), (14, 6)]);
        assert_eq!(row_chunks(32), vec![(0, 8), (8, 8), (16, 8), (24, 8)]);
        for m in 1..=MAX_CHUNKED_M {
            let c = row_chunks(m);
            assert_eq!(c.len(), m.div_ceil(MAX_M));
            let mut at = 0;
            for &(lo, rows) in &c {
                assert_eq!(lo, at);
                assert!(
                    (1..=MAX_M).contains(&rows) && rows + 1 >= c[0].1,
                    "{m}: {c:?}"
                );
                at += rows;
            }
            assert_eq!(at, m);
        }
    }

    #[test]
    fn chunked_rows_join_as_one_product() {
        // the row-chunk glue against one product, with a residual and a second output
        // (as the RoPE entry point's q and kv), on MLX's CPU ops
        let (m, k, n) = (20usize, 64usize, 12usize);
        let rnd = |shape: &[i32], seed| {
            let key = mlx::random::key(seed).unwrap();
            mlx::random::normal(shape, Dtype::F32, 0.0, 1.0, &key).unwrap()
        };
        let x = rnd(&[m as i32, k as i32], 1);
        let w = rnd(&[n as i32, k as i32], 2);
        let res = rnd(&[m as i32, n as i32], 3);
        let want = res.add(&x.matmul(&w.t().unwrap()).unwrap()).unwrap();
        let mut calls = Vec::new();
        let got = by_row_chunks(m, |lo, rows| {
            calls.push((lo, rows));
            let (a, b) = (lo as i32, (lo + rows) as i32);
            let xi = x.slice_axis(0, a, b)?;
            let yi = res.slice_axis(0, a, b)?.add(&xi.matmul(&w.t()?)?)?;
            Ok(vec![yi, xi])
        })
        .unwrap();
        assert_eq!(calls, row_chunks(m));
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].shape(), vec![m as i32, n as i32]);
        let err = got[0]
            .sub(&want)
            .unwrap()
            .abs()
            .unwrap()
            .max(&[0, 1], false)
            .unwrap();
        assert!(err.item::<f32>().unwrap() < 1e-4);
        let same = got[1]
            .sub(&x)
            .unwrap()
            .abs()
            .unwrap()
            .max(&[0, 1], false)
            .unwrap();
        assert_eq!(same.item::<f32>().unwrap(), 0.0);
    }

    #[test]
    fn stream_config_fits_shared_memory() {
        let l = |rows, wpb, pg| {
            Some(Launch {
                rows,
                wpb,
                mma: false,
                pg,
            })
        };
        // 8B down: 448 chunks, 14 warps, 2 rows (2 stages of 21 KB)
        assert_eq!(
            stream_config_for(4096, 14336, 64, false, 264),
            l(2, 14, 264)
        );
        assert_eq!(stream_config_for(4096, 14336, 64, true, 264), l(2, 14, 264));
        // 70B down: 896 chunks, 2 per thread of 14 warps, so 1 row (2 stages of 21 KB) ...
        assert_eq!(
            stream_config_for(8192, 28672, 64, false, 264),
            l(1, 14, 264)
        );
        // ... and no pairs
        assert_eq!(stream_config_for(8192, 28672, 64, true, 264), None);
        // rows of K ≤ 8192 keep the one-block-per-group launch
        assert_eq!(stream_config_for(6144, 4096, 64, true, 264), None);
        assert_eq!(stream_config_for(8192, 8192, 64, false, 264), None);
        // fewer groups than blocks: one block per group; odd n: 1 row, and so no pairs
        assert_eq!(stream_config_for(12, 14336, 64, false, 264), l(2, 14, 6));
        assert_eq!(stream_config_for(7, 14336, 64, false, 264), l(1, 14, 7));
        assert_eq!(stream_config_for(7, 14336, 64, true, 264), None);
        // k not a whole number of chunks or groups
        assert_eq!(stream_config_for(4096, 14336 + 16, 64, false, 264), None);
        assert_eq!(stream_config_for(4096, 14336 + 32, 64, false, 264), None);
    }

    #[test]
    fn launch_config_divides_the_rows() {
        for &(m, n, bits) in &[
            (1, 6144, 4),
            (1, 28672, 4),
            (1, 128256, 4),
            (1, 4096, 8),
            (3, 4098, 4),
            (1, 151_936, 4),
            (2, 4097, 8),
            (1, 16386, 4),
            (1, 6146, 4),
            (1, 6148, 4),
        ] {
            for xq in [false, true] {
                let (rows, wpb) = dp(m, n, 4096, bits, xq);
                assert_eq!(n % rows, 0, "m={m} n={n} bits={bits} rows={rows}");
                assert!([1, 2, 4, 8].contains(&rows) && [2, 4].contains(&wpb));
                // every launch pairs the epilogues' rows as the check made with the
                // k-free rows_per_block does: rows dividing n, even where those are
                for k in [4096, 8192, 14336, 28672, 53248, 57360, 131_072] {
                    let (r, _) = dp(m, n, k, bits, xq);
                    let r0 = launch_config_for(m, n, 0, 64, bits, xq, None).rows;
                    assert!(
                        n.is_multiple_of(r) && (!r0.is_multiple_of(2) || r.is_multiple_of(2)),
                        "{m} {n} {k} {r} {r0}"
                    );
                }
            }
        }
        assert_eq!(dp(1, 6144, 4096, 4, false), (2, 2));
        assert_eq!(dp(1, 28672, 4096, 4, false), (4, 2));
        assert_eq!(dp(1, 4096, 4096, 8, false), (4, 4));
        assert_eq!(dp(2, 4097, 4096, 4, true), (1, 4));
        // 4-bit M = 1, int8 x: 8 rows and 4 warps; more warps, then 4 rows, for long rows
        assert_eq!(dp(1, 6144, 4096, 4, true), (8, 4)); // 8B q/k/v: 8 loads a thread
        assert_eq!(dp(1, 6148, 4096, 4, true), (4, 4)); // (n not a multiple of 8)
        assert_eq!(dp(1, 6146, 4096, 4, true), (2, 4));
        assert_eq!(dp(1, 10240, 8192, 4, true), (16, 8)); // 70B q/k/v: 16 × 1
        assert_eq!(dp(1, 4096, 14336, 4, true), (8, 8)); // 8B down: 8 × 2
        assert_eq!(dp(1, 8192, 28672, 4, true), (4, 8)); // 70B down: 4 × 4
        assert_eq!(dp(1, 10248, 8192, 4, true), (8, 8)); // n a multiple of 8, not 16

        // loads per thread (rows × chunks per thread) stay within 28: more warps for long
        // rows, then fewer rows (not below 2 for an even n: the epilogues pair rows)
        assert_eq!(dp(4, 8192, 28672, 8, false), (4, 8));
        assert_eq!(dp(1, 8192, 28672, 4, false), (2, 2)); // float: 2 × 14
        assert_eq!(dp(2, 8192, 65536, 4, true), (2, 8)); // and fewer rows beyond
        assert_eq!(dp(1, 4098, 57360, 8, false), (2, 8)); // 2 rows stay (n even)
        for &(m, n, k, bits) in &[
            (1, 8192, 28672, 4),
            (4, 8192, 28672, 8),
            (3, 4096, 14336, 8),
            (1, 8192, 53248, 4),
            (2, 8192, 65536, 4),
        ] {
            for xq in [false, true] {
                let (rows, wpb) = dp(m, n, k, bits, xq);
                let chunks = k / (128 / bits);
                assert!(rows * chunks.div_ceil(32 * wpb) <= MAX_LOADS_PER_THREAD);
            }
        }
    }

    #[test]
    fn tensor_core_launches() {
        let mma = |m, n, k, group, bits, xq| launch_config_for(m, n, k, group, bits, xq, Some(2));
        let l = |rows, wpb| Launch {
            rows,
            wpb,
            mma: true,
            pg: 0,
        };
        assert_eq!(mma(2, 6144, 4096, 64, 4, true), l(16, 8)); // 8B q/k/v: 32 steps, 4 each
        assert_eq!(mma(8, 28672, 4096, 64, 4, true), l(16, 8)); // gate/up
        assert_eq!(mma(8, 128256, 4096, 64, 4, true), l(16, 8)); // lm_head
        assert_eq!(mma(8, 4096, 14336, 64, 4, true), l(16, 16)); // down: 112 steps, 7 each
        assert_eq!(mma(8, 10240, 8192, 128, 4, true), l(16, 8)); // 70B q/k/v: 64 steps
        assert_eq!(mma(4, 8192, 28672, 32, 4, true), l(16, 16)); // 70B down
        assert_eq!(mma(3, 64, 1024, 64, 4, true), l(16, 4)); // 8 steps: ≥ 2 per warp
        assert_eq!(mma(3, 64, 128, 128, 4, true), l(16, 1));
        // k not a multiple of the kernel's 128-value steps: not the tensor-core path
        assert!(!mma(3, 64, 576, 64, 4, true).mma);
        // batch 1 (below the smallest MMA batch), 8 bits, float x, group 16, n not a
        // multiple of 16: the dp4a/FMA path, and nothing above its batch limit
        for (m, n, group, bits, xq) in [
            (1, 6144, 64, 4, true),
            (2, 6144, 64, 8, true),
            (2, 6144, 64, 4, false),
            (2, 6144, 16, 4, true),
            (2, 6152, 64, 4, true),
        ] {
            assert!(
                !mma(m, n, 4096, group, bits, xq).mma,
                "{m} {n} {group} {bits} {xq}"
            );
        }
        // every launch divides the rows into whole blocks, and SwiGLU/RoPE pairs evenly
        for n in [
            6144, 4096, 28672, 14336, 128256, 10240, 57344, 151_936, 16400,
        ] {
            for m in 2..=MAX_M {
                let x = mma(m, n, 4096, 64, 4, true);
                assert!(x.mma && n % x.rows == 0 && x.rows % 16 == 0, "{n} {x:?}");
            }
        }
    }

    #[test]
    fn tensor_core_path_choice() {
        assert_eq!(mma_choice(true, None), Some(MMA_MIN_M));
        assert_eq!(mma_choice(true, Some(0)), None);
        assert_eq!(mma_choice(true, Some(1)), Some(1));
        assert_eq!(mma_choice(true, Some(8)), Some(8));
        assert_eq!(mma_choice(false, None), None);
        assert_eq!(mma_choice(false, Some(1)), None); // the GPU cannot run it
    }

    #[test]
    fn rope_entry_point_needs_whole_heads_and_row_pairs() {
        assert!(supports_rope(1, 6144, 64, 4, 32, 128)); // Llama-3 8B: 32 q, 8 k, 8 v heads
        assert!(supports_rope(4, 10240, 64, 8, 64, 128)); // 70B
        assert!(supports_rope(1, 5 * 128, 64, 4, 3, 128)); // a TP rank's heads: 3 q, 1 k, 1 v
        assert!(!supports_rope(1, 6144, 64, 4, 33, 128)); // k and v head counts differ
        assert!(!supports_rope(1, 6144, 64, 4, 48, 128)); // no k/v heads left
        assert!(!supports_rope(1, 6144 + 64, 64, 4, 32, 128)); // not whole heads
        assert!(!supports_rope(1, 6144, 64, 4, 32, 0));
        assert!(!supports_rope(1, 3 * 7, 64, 4, 1, 7)); // odd head_dim
    }

    #[test]
    fn not_used_off_cuda() {
        if mlx::backend() != Backend::Cuda {
            assert!(!enabled());
        }
    }
}
