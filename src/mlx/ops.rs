//! Array operations: element-wise math, reductions, shapes, indexing, matmul.
use super::array::ArrayList;
use super::ffi::ffi::{self, BinaryOp, ReduceOp, UnaryOp};
use super::{Array, Dtype, MlxError, Result};

macro_rules! unary_ops {
    ($($name:ident => $op:ident),* $(,)?) => {
        $(pub fn $name(&self) -> Result<Array> { self.unary(UnaryOp::$op) })*
    };
}
macro_rules! binary_ops {
    ($($name:ident => $op:ident),* $(,)?) => {
        $(pub fn $name(&self, other: &Array) -> Result<Array> { self.binary(other, BinaryOp::$op) })*
    };
}
macro_rules! reduce_ops {
    ($($name:ident => $op:ident),* $(,)?) => {
        $(pub fn $name(&self, axes: &[i32], keepdims: bool) -> Result<Array> { self.reduce(ReduceOp::$op, axes, keepdims) })*
    };
}

impl Array {
    fn unary(&self, op: UnaryOp) -> Result<Array> {
        Ok(Array::from_ptr(ffi::unary(self.raw(), op)?))
    }
    fn binary(&self, other: &Array, op: BinaryOp) -> Result<Array> {
        Ok(Array::from_ptr(ffi::binary(self.raw(), other.raw(), op)?))
    }
    fn reduce(&self, op: ReduceOp, axes: &[i32], keepdims: bool) -> Result<Array> {
        Ok(Array::from_ptr(ffi::reduce(
            self.raw(),
            op,
            axes,
            keepdims,
        )?))
    }

    unary_ops! {
        exp => Exp, log => Log, sqrt => Sqrt, rsqrt => Rsqrt, neg => Negative, sigmoid => Sigmoid,
        silu => Silu, abs => Abs, tanh => Tanh, sin => Sin, cos => Cos, floor => Floor,
        square => Square, reciprocal => Reciprocal, logical_not => LogicalNot, isnan => IsNan,
    }
    binary_ops! {
        add => Add, sub => Subtract, mul => Multiply, div => Divide, maximum => Maximum,
        minimum => Minimum, pow => Power, rem => Remainder, eq => Equal, ne => NotEqual,
        gt => Greater, ge => GreaterEqual, lt => Less, le => LessEqual,
        logical_and => LogicalAnd, logical_or => LogicalOr,
        bitwise_xor => BitwiseXor, bitwise_and => BitwiseAnd, shl => LeftShift, shr => RightShift,
    }
    reduce_ops! {
        sum => Sum, mean => Mean, max => Max, min => Min, prod => Prod,
        logsumexp => LogSumExp, all => All, any => Any,
    }

    /// `self + v` with `v` a scalar of this array's dtype.
    pub fn add_scalar(&self, v: f32) -> Result<Array> {
        self.add(&Array::scalar(v, self.dtype())?)
    }

    /// `self * v` with `v` a scalar of this array's dtype.
    pub fn mul_scalar(&self, v: f32) -> Result<Array> {
        self.mul(&Array::scalar(v, self.dtype())?)
    }

    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        if self.dtype() == dtype {
            return Ok(self.clone());
        }
        Ok(Array::from_ptr(ffi::astype(self.raw(), dtype)?))
    }

    /// Reinterpret the bytes as another dtype (last axis rescaled by the size ratio).
    pub fn view_as(&self, dtype: Dtype) -> Result<Array> {
        Ok(Array::from_ptr(ffi::view_as(self.raw(), dtype)?))
    }

    pub fn softmax(&self, axis: i32, precise: bool) -> Result<Array> {
        Ok(Array::from_ptr(ffi::softmax(self.raw(), axis, precise)?))
    }

    pub fn cumsum(&self, axis: i32, reverse: bool, inclusive: bool) -> Result<Array> {
        Ok(Array::from_ptr(ffi::cumsum(
            self.raw(),
            axis,
            reverse,
            inclusive,
        )?))
    }

    /// Index of the maximum along `axis` (uint32).
    pub fn argmax(&self, axis: i32, keepdims: bool) -> Result<Array> {
        Ok(Array::from_ptr(ffi::argmax(self.raw(), axis, keepdims)?))
    }

    /// The `k` largest values along `axis` (unordered).
    pub fn topk(&self, k: i32, axis: i32) -> Result<Array> {
        Ok(Array::from_ptr(ffi::topk(self.raw(), k, axis)?))
    }

    pub fn sort(&self, axis: i32) -> Result<Array> {
        Ok(Array::from_ptr(ffi::sort(self.raw(), axis)?))
    }

    pub fn argsort(&self, axis: i32) -> Result<Array> {
        Ok(Array::from_ptr(ffi::argsort(self.raw(), axis)?))
    }

    pub fn argpartition(&self, kth: i32, axis: i32) -> Result<Array> {
        Ok(Array::from_ptr(ffi::argpartition(self.raw(), kth, axis)?))
    }

    /// Matrix product (batched over leading axes, broadcasting).
    pub fn matmul(&self, other: &Array) -> Result<Array> {
        Ok(Array::from_ptr(ffi::matmul(self.raw(), other.raw())?))
    }

    /// `c + self @ b` in one kernel where the backend has one.
    pub fn addmm(&self, b: &Array, c: &Array) -> Result<Array> {
        Ok(Array::from_ptr(ffi::addmm(c.raw(), self.raw(), b.raw())?))
    }

    /// `self` in `shape` (one axis may be -1: inferred). The same shape builds no op: MLX
    /// skips a reshape to its input's shape, and the -1 is resolved here so that it can.
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        let known: i64 = shape
            .iter()
            .filter(|&&d| d != -1)
            .map(|&d| d as i64)
            .product();
        let size = self.size() as i64;
        let resolved: Vec<i32>;
        let shape = match shape.iter().filter(|&&d| d == -1).count() {
            1 if known > 0 && size % known == 0 => {
                resolved = shape
                    .iter()
                    .map(|&d| if d == -1 { (size / known) as i32 } else { d })
                    .collect();
                &resolved[..]
            }
            _ => shape,
        };
        Ok(Array::from_ptr(ffi::reshape(self.raw(), shape)?))
    }

    pub fn transpose(&self, axes: &[i32]) -> Result<Array> {
        Ok(Array::from_ptr(ffi::transpose(self.raw(), axes)?))
    }

    /// Swap the last two axes.
    pub fn t(&self) -> Result<Array> {
        let n = self.ndim() as i32;
        if n < 2 {
            return Err(MlxError::Invalid(format!(
                "t(): array has {n} dimension(s), needs 2"
            )));
        }
        let mut axes: Vec<i32> = (0..n).collect();
        axes.swap((n - 1) as usize, (n - 2) as usize);
        self.transpose(&axes)
    }

    pub fn expand_dims(&self, axis: i32) -> Result<Array> {
        Ok(Array::from_ptr(ffi::expand_dims(self.raw(), axis)?))
    }

    pub fn squeeze(&self, axis: i32) -> Result<Array> {
        Ok(Array::from_ptr(ffi::squeeze(self.raw(), axis)?))
    }

    pub fn broadcast_to(&self, shape: &[i32]) -> Result<Array> {
        Ok(Array::from_ptr(ffi::broadcast_to(self.raw(), shape)?))
    }

    /// `self[start:stop:strides]` over all axes.
    pub fn slice(&self, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
        Ok(Array::from_ptr(ffi::slice(
            self.raw(),
            start,
            stop,
            strides,
        )?))
    }

    /// `self[start:stop]` over all axes (unit steps) as a view that does not own `self`'s
    /// buffer: a read through it does not keep that buffer referenced while the read is
    /// queued on the device, so an update of `self` built after the read can still reuse
    /// the buffer in place (MLX donates a buffer only while nothing else references it;
    /// otherwise the update copies the whole array). The caller keeps the buffer alive
    /// until the read has run (an owner of it, or a later op that consumes it), and
    /// evaluates the view before anything writes into that buffer again.
    pub fn unowned_slice(&self, start: &[i32], stop: &[i32]) -> Result<Array> {
        Ok(Array::from_ptr(ffi::unowned_slice(
            self.raw(),
            start,
            stop,
        )?))
    }

    /// Several [`Array::unowned_slice`] views of `self` made by one op: one view per
    /// `(start, stop)` pair, so a graph reading several parts of one buffer builds and
    /// runs one op for all of them.
    pub fn unowned_slices(&self, ranges: &[(&[i32], &[i32])]) -> Result<Vec<Array>> {
        let nd = self.ndim();
        if let Some((a, b)) = ranges.iter().find(|r| r.0.len() != nd || r.1.len() != nd) {
            return Err(MlxError::Invalid(format!(
                "unowned_slices: a range of {} starts and {} stops for {nd} axes",
                a.len(),
                b.len()
            )));
        }
        let starts: Vec<i32> = ranges.iter().flat_map(|r| r.0.iter().copied()).collect();
        let stops: Vec<i32> = ranges.iter().flat_map(|r| r.1.iter().copied()).collect();
        ArrayList(ffi::unowned_slices(self.raw(), &starts, &stops)?).into_vec()
    }

    /// The identity of the buffer holding this array's data (0 while it has none, i.e.
    /// not evaluated yet): an update that reused its input's buffer in place has the
    /// input's identity, a copy has a new one.
    pub fn buffer_id(&self) -> u64 {
        ffi::buffer_id(self.raw())
    }

    /// Whether the contents are there: evaluated and, if an asynchronous evaluation queued
    /// it, run by the device (never waits; false for an array not yet evaluated).
    pub fn is_available(&self) -> bool {
        ffi::is_available(self.raw())
    }

    /// Whether an evaluation took it (queued or run; an array made from data counts too):
    /// its graph is no longer held through it.
    pub fn is_scheduled(&self) -> bool {
        ffi::is_scheduled(self.raw())
    }

    /// Whether `self` and `other` are one array (one node of a graph, clones of each other).
    pub fn same_as(&self, other: &Array) -> bool {
        ffi::same_array(self.raw(), other.raw())
    }

    /// `self[..., start:stop, ...]` on one axis (negative axis counts from the end).
    pub fn slice_axis(&self, axis: i32, start: i32, stop: i32) -> Result<Array> {
        let shape = self.shape();
        let n = shape.len() as i32;
        let ax = if axis < 0 { axis + n } else { axis };
        if ax < 0 || ax >= n {
            return Err(MlxError::Invalid(format!(
                "slice_axis: axis {axis} out of range for {n} dims"
            )));
        }
        let mut lo = vec![0; shape.len()];
        let mut hi = shape.clone();
        lo[ax as usize] = start;
        hi[ax as usize] = stop;
        self.slice(&lo, &hi, &vec![1; shape.len()])
    }

    /// Slice of `slice_size` starting at positions held in the array `start` (one per axis in `axes`).
    pub fn slice_dynamic(&self, start: &Array, axes: &[i32], slice_size: &[i32]) -> Result<Array> {
        Ok(Array::from_ptr(ffi::slice_dynamic(
            self.raw(),
            start.raw(),
            axes,
            slice_size,
        )?))
    }

    /// A copy of `self` with `update` written into `[start:stop:strides]`.
    pub fn slice_update(
        &self,
        update: &Array,
        start: &[i32],
        stop: &[i32],
        strides: &[i32],
    ) -> Result<Array> {
        Ok(Array::from_ptr(ffi::slice_update(
            self.raw(),
            update.raw(),
            start,
            stop,
            strides,
        )?))
    }

    /// `slice_update` with start positions held in an array (no re-tracing when they change).
    pub fn slice_update_dynamic(
        &self,
        update: &Array,
        start: &Array,
        axes: &[i32],
    ) -> Result<Array> {
        Ok(Array::from_ptr(ffi::slice_update_dynamic(
            self.raw(),
            update.raw(),
            start.raw(),
            axes,
        )?))
    }

    /// Gather entries of `self` along `axis` at `indices`.
    pub fn take(&self, indices: &Array, axis: i32) -> Result<Array> {
        Ok(Array::from_ptr(ffi::take(self.raw(), indices.raw(), axis)?))
    }

    pub fn take_along_axis(&self, indices: &Array, axis: i32) -> Result<Array> {
        Ok(Array::from_ptr(ffi::take_along_axis(
            self.raw(),
            indices.raw(),
            axis,
        )?))
    }

    pub fn put_along_axis(&self, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
        Ok(Array::from_ptr(ffi::put_along_axis(
            self.raw(),
            indices.raw(),
            values.raw(),
            axis,
        )?))
    }

    /// A copy of `self` with `updates` written at the positions `indices` (one index array per
    /// axis in `axes`, all of the same shape `I`); `updates` has shape `I ++ slice` where `slice`
    /// is `self`'s shape with 1 on the indexed axes.
    pub fn scatter(&self, indices: &[&Array], updates: &Array, axes: &[i32]) -> Result<Array> {
        let list = ArrayList::new(indices.iter().copied());
        Ok(Array::from_ptr(ffi::scatter(
            self.raw(),
            list.raw(),
            updates.raw(),
            axes,
        )?))
    }

    pub fn repeat(&self, repeats: i32, axis: i32) -> Result<Array> {
        Ok(Array::from_ptr(ffi::repeat(self.raw(), repeats, axis)?))
    }

    /// A row-major copy if the array is not already contiguous.
    pub fn contiguous(&self) -> Result<Array> {
        Ok(Array::from_ptr(ffi::contiguous(self.raw())?))
    }

    /// A copy made on `stream` (and so on its device).
    pub fn copy_to_stream(&self, stream: &super::Stream) -> Result<Array> {
        Ok(Array::from_ptr(ffi::copy_to_stream(
            self.raw(),
            &stream.raw,
        )?))
    }

    /// `self + k` (float32) computed by `k` kernels that one op launches on `stream`, each
    /// adding 1: the kernel nodes go straight into MLX's CUDA command encoder, so the host's
    /// cost per kernel launch can be told from its cost per op (`mlxcel _launch-costs`).
    /// CUDA only ([`launch_chain_unavailable`]); evaluating it elsewhere is an error.
    pub fn launch_chain(&self, k: i32, stream: &super::Stream) -> Result<Array> {
        Ok(Array::from_ptr(ffi::launch_chain(
            self.raw(),
            k,
            &stream.raw,
        )?))
    }
}

impl Array {
    /// This array, computed only after `dep` (MLX `depends`). A lazy graph may
    /// otherwise evaluate inputs that do not depend on activations (e.g. every
    /// layer's dequantized weight) long before they are needed, all at once.
    pub fn depends_on(&self, dep: &Array) -> Result<Array> {
        Ok(Array::from_ptr(ffi::depends_on(self.raw(), dep.raw())?))
    }
}

/// `cond ? x : y`, element-wise with broadcasting.
pub fn where_(cond: &Array, x: &Array, y: &Array) -> Result<Array> {
    Ok(Array::from_ptr(ffi::where_(cond.raw(), x.raw(), y.raw())?))
}

pub fn concatenate(arrays: &[&Array], axis: i32) -> Result<Array> {
    let list = ArrayList::new(arrays.iter().copied());
    Ok(Array::from_ptr(ffi::concatenate(list.raw(), axis)?))
}

pub fn stack(arrays: &[&Array], axis: i32) -> Result<Array> {
    let list = ArrayList::new(arrays.iter().copied());
    Ok(Array::from_ptr(ffi::stack(list.raw(), axis)?))
}

/// Split `a` along `axis` at the given indices (`[2, 5]` gives `[:2]`, `[2:5]`, `[5:]`).
pub fn split_sections(a: &Array, indices: &[i32], axis: i32) -> Result<Vec<Array>> {
    ArrayList(ffi::split_sections(a.raw(), indices, axis)?).into_vec()
}

/// Evaluate several arrays together (one graph walk).
pub fn eval(arrays: &[&Array]) -> Result<()> {
    super::kernel_cache::wait_pending();
    let list = ArrayList::new(arrays.iter().copied());
    Ok(ffi::eval_many(list.raw())?)
}

/// Evaluate `arrays` that launch none of mlxcel's custom kernels (fresh zeros, say)
/// without waiting for the compilations pending among the variants this thread launched
/// since its last evaluation: those stay pending for the next evaluation. (A scratch made
/// while a warm-up builds its graphs waited for every variant started so far.)
pub fn eval_fresh(arrays: &[&Array]) -> Result<()> {
    let keys = super::kernel_cache::take_needed();
    let list = ArrayList::new(arrays.iter().copied());
    let r = ffi::eval_many(list.raw());
    super::kernel_cache::set_needed(keys);
    Ok(r?)
}

/// Start evaluating without waiting; a later `eval`/read waits for the result.
pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    super::kernel_cache::wait_pending();
    let list = ArrayList::new(arrays.iter().copied());
    Ok(ffi::async_eval_many(list.raw())?)
}

/// `outputs` computed by one op: every op reached from them that no evaluation has
/// scheduled runs inside it, in order, each encoding its own kernels as it would, so that
/// MLX's evaluation loop (its per-op tape, events, fences and status) runs once for all of
/// them instead of once each. Arrays with data (weights, evaluated arrays) are read as they
/// are (only those of another stream are the fused op's inputs, so that an op may still
/// update a buffer in place that nothing else holds).
/// The results are those of `outputs`; an op an earlier evaluation already ran is skipped,
/// and after the evaluation every op's array is evaluated as MLX's loop leaves it. `outputs`
/// themselves when nothing is left to evaluate. Ops on two streams are an error.
pub fn fuse_graph(outputs: &[&Array]) -> Result<Vec<Array>> {
    let list = ArrayList::new(outputs.iter().copied());
    ArrayList(ffi::fuse_graph(list.raw())?).into_vec()
}

/// Why [`Array::launch_chain`] cannot run in this process (MLX's CUDA command encoder or
/// the CUDA driver's module functions not found), or `None` where it can.
pub fn launch_chain_unavailable() -> Option<String> {
    let why = ffi::launch_chain_unavailable();
    (!why.is_empty()).then_some(why)
}
