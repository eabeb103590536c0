//! The raw `cxx` bridge to `cpp/shim.h`. Nothing outside `src/mlx` uses this
//! module directly: `super::Array` and friends wrap it with safe, typed calls.
#![allow(clippy::too_many_arguments, clippy::module_inception)]

#[cxx::bridge(namespace = "mlxcel")]
pub(crate) mod ffi {
    /// Element types (a subset of MLX's, enough for LLM inference).
    #[repr(u8)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    enum Dtype {
        Bool,
        U8,
        U16,
        U32,
        I8,
        I32,
        I64,
        F16,
        BF16,
        F32,
        /// An MLX dtype this API does not name (complex, f64, ...).
        Unsupported,
    }

    #[repr(u8)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum UnaryOp {
        Exp,
        Log,
        Sqrt,
        Rsqrt,
        Negative,
        Sigmoid,
        Silu,
        Abs,
        Tanh,
        Sin,
        Cos,
        Floor,
        Square,
        Reciprocal,
        LogicalNot,
        IsNan,
    }

    #[repr(u8)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum BinaryOp {
        Add,
        Subtract,
        Multiply,
        Divide,
        Maximum,
        Minimum,
        Power,
        Remainder,
        Equal,
        NotEqual,
        Greater,
        GreaterEqual,
        Less,
        LessEqual,
        LogicalAnd,
        LogicalOr,
        BitwiseXor,
        BitwiseAnd,
        LeftShift,
        RightShift,
    }

    #[repr(u8)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum ReduceOp {
        Sum,
        Mean,
        Max,
        Min,
        Prod,
        LogSumExp,
        All,
        Any,
    }

    /// What MLX reports about one GPU.
    #[derive(Debug, Clone, Default)]
    struct DeviceInfo {
        name: String,
        architecture: String,
        total_memory: u64,
        free_memory: u64,
        pci_bus_id: String,
        uuid: String,
    }

    /// What a custom kernel's op carries (MLX's `CustomKernel::state`): the kernel's
    /// name (`custom_kernel_<name><template constants>`), the full source MLX generated,
    /// and the module name MLX caches it under (`<name>_<std::hash of the source>`).
    #[derive(Debug, Clone, Default)]
    struct KernelIdentity {
        kernel_name: String,
        module_name: String,
        source: String,
    }

    /// One program compiled by NVRTC: the binary (a cubin, or PTX where NVRTC cannot
    /// target the GPU) and the lowered names of the requested name expressions.
    #[derive(Debug, Clone, Default)]
    struct NvrtcOutput {
        binary: Vec<u8>,
        lowered: Vec<String>,
    }

    /// An MLX stream: its index and the device it runs on.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct StreamRef {
        index: i32,
        gpu: bool,
        device_index: i32,
    }

    /// How many ops of one primitive a graph holds (`count_ops`).
    #[derive(Debug, Clone, Default)]
    struct OpTally {
        name: String,
        count: u64,
    }

    unsafe extern "C++" {
        include!("mlxcel/cpp/shim.h");

        #[namespace = "mlx::core"]
        #[cxx_name = "array"]
        type Array;
        type ArrayVec;
        type Group;
        type HostFill;

        fn mlx_version() -> String;
        /// The file of the MLX library this process runs (empty if unknown).
        fn mlx_library_path() -> String;
        fn backend_name() -> String;
        fn gpu_device_count() -> i32;
        fn gpu_device_info(index: i32) -> Result<DeviceInfo>;
        fn default_stream_ref(gpu: bool) -> Result<StreamRef>;
        fn new_stream_on_gpu(index: i32) -> Result<StreamRef>;
        fn new_cpu_stream() -> Result<StreamRef>;
        fn set_default_stream_ref(s: &StreamRef) -> Result<()>;
        fn set_default_device_cpu() -> Result<()>;
        fn synchronize_stream(s: &StreamRef) -> Result<()>;
        fn synchronize_default() -> Result<()>;

        fn active_memory() -> u64;
        fn peak_memory() -> u64;
        fn cache_memory() -> u64;
        fn reset_peak_memory();
        fn set_memory_limit(limit: u64) -> u64;
        fn memory_limit() -> u64;
        fn set_cache_limit(limit: u64) -> u64;
        fn clear_cache();

        fn from_bytes(data: &[u8], shape: &[i32], dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn host_array(shape: &[i32], dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn host_data_address(a: &Array) -> Result<u64>;
        fn scalar_f32(v: f32, dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn scalar_i32(v: i32) -> Result<UniquePtr<Array>>;
        fn full(shape: &[i32], v: f32, dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn clone_array(a: &Array) -> UniquePtr<Array>;
        fn shape(a: &Array) -> Vec<i32>;
        fn dtype(a: &Array) -> Dtype;
        fn ndim(a: &Array) -> usize;
        fn size(a: &Array) -> usize;
        fn nbytes(a: &Array) -> usize;
        fn to_bytes(a: &Array) -> Result<Vec<u8>>;
        fn eval_one(a: &Array) -> Result<()>;
        fn eval_many(v: &ArrayVec) -> Result<()>;
        fn async_eval_many(v: &ArrayVec) -> Result<()>;
        fn describe(a: &Array) -> Result<String>;

        fn array_vec_new() -> UniquePtr<ArrayVec>;
        fn array_vec_push(v: Pin<&mut ArrayVec>, a: &Array);
        fn array_vec_len(v: &ArrayVec) -> usize;
        fn array_vec_get(v: &ArrayVec, i: usize) -> Result<UniquePtr<Array>>;

        fn unary(a: &Array, op: UnaryOp) -> Result<UniquePtr<Array>>;
        fn binary(a: &Array, b: &Array, op: BinaryOp) -> Result<UniquePtr<Array>>;
        fn reduce(
            a: &Array,
            op: ReduceOp,
            axes: &[i32],
            keepdims: bool,
        ) -> Result<UniquePtr<Array>>;
        fn astype(a: &Array, dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn view_as(a: &Array, dtype: Dtype) -> Result<UniquePtr<Array>>;
        fn where_(cond: &Array, x: &Array, y: &Array) -> Result<UniquePtr<Array>>;
        fn depends_on(a: &Array, dep: &Array) -> Result<UniquePtr<Array>>;
        fn softmax(a: &Array, axis: i32, precise: bool) -> Result<UniquePtr<Array>>;
        fn cumsum(a: &Array, axis: i32, reverse: bool, inclusive: bool)
            -> Result<UniquePtr<Array>>;
        fn argmax(a: &Array, axis: i32, keepdims: bool) -> Result<UniquePtr<Array>>;
        fn topk(a: &Array, k: i32, axis: i32) -> Result<UniquePtr<Array>>;
        fn sort(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn argsort(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn argpartition(a: &Array, kth: i32, axis: i32) -> Result<UniquePtr<Array>>;

        fn matmul(a: &Array, b: &Array) -> Result<UniquePtr<Array>>;
        fn addmm(c: &Array, a: &Array, b: &Array) -> Result<UniquePtr<Array>>;
        fn reshape(a: &Array, shape: &[i32]) -> Result<UniquePtr<Array>>;
        fn transpose(a: &Array, axes: &[i32]) -> Result<UniquePtr<Array>>;
        fn expand_dims(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn squeeze(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn broadcast_to(a: &Array, shape: &[i32]) -> Result<UniquePtr<Array>>;
        fn slice(
            a: &Array,
            start: &[i32],
            stop: &[i32],
            strides: &[i32],
        ) -> Result<UniquePtr<Array>>;
        fn slice_dynamic(
            a: &Array,
            start: &Array,
            axes: &[i32],
            slice_size: &[i32],
        ) -> Result<UniquePtr<Array>>;
        fn unowned_slice(a: &Array, start: &[i32], stop: &[i32]) -> Result<UniquePtr<Array>>;
        fn unowned_slices(a: &Array, starts: &[i32], stops: &[i32]) -> Result<UniquePtr<ArrayVec>>;
        fn buffer_id(a: &Array) -> u64;
        fn is_available(a: &Array) -> bool;
        fn is_scheduled(a: &Array) -> bool;
        fn same_array(a: &Array, b: &Array) -> bool;
        fn slice_update(
            src: &Array,
            update: &Array,
            start: &[i32],
            stop: &[i32],
            strides: &[i32],
        ) -> Result<UniquePtr<Array>>;
        fn slice_update_dynamic(
            src: &Array,
            update: &Array,
            start: &Array,
            axes: &[i32],
        ) -> Result<UniquePtr<Array>>;
        fn concatenate(v: &ArrayVec, axis: i32) -> Result<UniquePtr<Array>>;
        fn stack(v: &ArrayVec, axis: i32) -> Result<UniquePtr<Array>>;
        fn split_sections(a: &Array, indices: &[i32], axis: i32) -> Result<UniquePtr<ArrayVec>>;
        fn take(a: &Array, indices: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn take_along_axis(a: &Array, indices: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn put_along_axis(
            a: &Array,
            indices: &Array,
            values: &Array,
            axis: i32,
        ) -> Result<UniquePtr<Array>>;
        fn scatter(
            a: &Array,
            indices: &ArrayVec,
            updates: &Array,
            axes: &[i32],
        ) -> Result<UniquePtr<Array>>;
        fn repeat(a: &Array, repeats: i32, axis: i32) -> Result<UniquePtr<Array>>;
        fn contiguous(a: &Array) -> Result<UniquePtr<Array>>;
        fn copy_to_stream(a: &Array, s: &StreamRef) -> Result<UniquePtr<Array>>;

        fn rms_norm(x: &Array, weight: &Array, eps: f32) -> Result<UniquePtr<Array>>;
        fn rms_norm_no_weight(x: &Array, eps: f32) -> Result<UniquePtr<Array>>;
        fn rope(
            x: &Array,
            dims: i32,
            traditional: bool,
            base: f32,
            scale: f32,
            offset: i32,
        ) -> Result<UniquePtr<Array>>;
        fn rope_array_offset(
            x: &Array,
            dims: i32,
            traditional: bool,
            base: f32,
            scale: f32,
            offset: &Array,
        ) -> Result<UniquePtr<Array>>;
        fn rope_freqs(
            x: &Array,
            dims: i32,
            traditional: bool,
            scale: f32,
            offset: &Array,
            freqs: &Array,
        ) -> Result<UniquePtr<Array>>;
        fn sdpa(
            q: &Array,
            k: &Array,
            v: &Array,
            scale: f32,
            mask_mode: &str,
        ) -> Result<UniquePtr<Array>>;
        fn sdpa_masked(
            q: &Array,
            k: &Array,
            v: &Array,
            scale: f32,
            mask: &Array,
        ) -> Result<UniquePtr<Array>>;

        fn set_fast_ops_as_gpu(on: bool);
        fn fast_ops_as_gpu() -> bool;
        fn count_ops(outputs: &ArrayVec, stop: &ArrayVec) -> Vec<OpTally>;

        fn swiglu(gate: &Array, up: &Array) -> Result<UniquePtr<Array>>;
        fn compile_traces() -> u64;
        /// The identity of the custom kernel that computes `out` (an output of
        /// [`cuda_kernel`]).
        fn kernel_identity(out: &Array) -> Result<KernelIdentity>;
        /// NVRTC's version as major·1000 + minor·10, or an error when the library
        /// (`library`, else the one already loaded or on the loader's path) is absent.
        fn nvrtc_version(library: &str) -> Result<i32>;
        /// The path of the NVRTC library [`nvrtc_version`] found.
        fn nvrtc_library_path(library: &str) -> Result<String>;
        /// Compile `source` (named `file`) with NVRTC, options `options`; the lowered
        /// names of `names` come back in order. An error carries NVRTC's log.
        fn nvrtc_compile(
            library: &str,
            source: &str,
            file: &str,
            names: &[String],
            options: &[String],
            cubin: bool,
        ) -> Result<NvrtcOutput>;
        #[allow(clippy::too_many_arguments)]
        fn cuda_kernel(
            variant: u64,
            reuse: bool,
            name: &str,
            input_names: &[String],
            output_names: &[String],
            source: &str,
            header: &str,
            inputs: &ArrayVec,
            out_shapes: &[i32],
            out_ndims: &[i32],
            out_dtype: Dtype,
            tnames: &[String],
            tvals: &[i32],
            tdtype: Dtype,
            grid: &[i32],
            threadgroup: &[i32],
            shared_memory: i32,
        ) -> Result<UniquePtr<ArrayVec>>;

        fn launch_chain(x: &Array, k: i32, s: &StreamRef) -> Result<UniquePtr<Array>>;
        fn launch_chain_unavailable() -> String;
        fn fuse_graph(outputs: &ArrayVec) -> Result<UniquePtr<ArrayVec>>;

        fn quantized_matmul(
            x: &Array,
            w: &Array,
            scales: &Array,
            biases: &Array,
            transpose: bool,
            group_size: i32,
            bits: i32,
        ) -> Result<UniquePtr<Array>>;
        fn gather_mm(
            a: &Array,
            b: &Array,
            rhs_indices: &Array,
            sorted: bool,
        ) -> Result<UniquePtr<Array>>;
        #[allow(clippy::too_many_arguments)]
        fn gather_qmm(
            x: &Array,
            w: &Array,
            scales: &Array,
            biases: &Array,
            rhs_indices: &Array,
            group_size: i32,
            bits: i32,
            sorted: bool,
        ) -> Result<UniquePtr<Array>>;
        fn dequantize(
            w: &Array,
            scales: &Array,
            biases: &Array,
            group_size: i32,
            bits: i32,
        ) -> Result<UniquePtr<Array>>;
        fn quantize(w: &Array, group_size: i32, bits: i32) -> Result<UniquePtr<ArrayVec>>;

        fn random_key(seed: u64) -> Result<UniquePtr<Array>>;
        fn random_split(key: &Array, num: i32) -> Result<UniquePtr<ArrayVec>>;
        fn random_uniform(shape: &[i32], dtype: Dtype, key: &Array) -> Result<UniquePtr<Array>>;
        fn random_normal(
            shape: &[i32],
            dtype: Dtype,
            loc: f32,
            scale: f32,
            key: &Array,
        ) -> Result<UniquePtr<Array>>;
        fn random_categorical(logits: &Array, axis: i32, key: &Array) -> Result<UniquePtr<Array>>;

        fn distributed_available(backend: &str) -> bool;
        fn distributed_init(backend: &str, strict: bool) -> Result<UniquePtr<Group>>;
        fn group_rank(g: &Group) -> i32;
        fn group_size(g: &Group) -> i32;
        fn all_sum(x: &Array, g: &Group, s: &StreamRef) -> Result<UniquePtr<Array>>;
        fn all_gather(x: &Array, g: &Group, s: &StreamRef) -> Result<UniquePtr<Array>>;

        fn host_fill_new(
            shape: &[i32],
            dtype: Dtype,
            timeout_s: f64,
        ) -> Result<UniquePtr<HostFill>>;
        fn host_fill_array(h: &HostFill) -> UniquePtr<Array>;
        fn host_fill_provide(h: &HostFill, data: &[u8]) -> Result<bool>;
        fn host_fill_cancel(h: &HostFill);
    }
}
