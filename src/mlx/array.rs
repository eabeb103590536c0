//! The [`Array`] handle: creation from Rust data, shape/dtype queries, reading back.
use std::fmt;
use std::marker::PhantomData;

use cxx::UniquePtr;

use super::ffi::ffi;
use super::{Dtype, MlxError, Result};

/// An MLX array (lazy until evaluated). Cloning is cheap and shares the data,
/// like MLX's own array copies. Not `Send`: see the module docs.
pub struct Array {
    pub(super) ptr: UniquePtr<ffi::Array>,
    _not_send: PhantomData<*const ()>,
}

/// Rust element types that map one-to-one onto an MLX dtype.
pub trait Element: Copy + Default + 'static {
    const DTYPE: Dtype;
}
impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
}
impl Element for i32 {
    const DTYPE: Dtype = Dtype::I32;
}
impl Element for u32 {
    const DTYPE: Dtype = Dtype::U32;
}
impl Element for i64 {
    const DTYPE: Dtype = Dtype::I64;
}
impl Element for u8 {
    const DTYPE: Dtype = Dtype::U8;
}
impl Element for i8 {
    const DTYPE: Dtype = Dtype::I8;
}
impl Element for u16 {
    const DTYPE: Dtype = Dtype::U16;
}
impl Element for bool {
    const DTYPE: Dtype = Dtype::Bool;
}

impl Array {
    pub(super) fn from_ptr(ptr: UniquePtr<ffi::Array>) -> Array {
        Array {
            ptr,
            _not_send: PhantomData,
        }
    }

    pub(super) fn raw(&self) -> &ffi::Array {
        self.ptr.as_ref().expect("Array is never null")
    }

    /// An array with a copy of `data`, laid out row-major with `shape`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[i32]) -> Result<Array> {
        // SAFETY: T is a plain numeric type (or bool, one byte 0/1), so its bytes are initialised.
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data))
        };
        Self::from_bytes(bytes, shape, T::DTYPE)
    }

    /// An array with a copy of raw little-endian element bytes (e.g. bf16 from a safetensors file).
    pub fn from_bytes(bytes: &[u8], shape: &[i32], dtype: Dtype) -> Result<Array> {
        if dtype == Dtype::Unsupported {
            return Err(MlxError::Invalid("from_bytes: unsupported dtype".into()));
        }
        Ok(Array::from_ptr(ffi::from_bytes(bytes, shape, dtype)?))
    }

    /// A 0-d array holding `v` converted to `dtype`.
    pub fn scalar(v: f32, dtype: Dtype) -> Result<Array> {
        Ok(Array::from_ptr(ffi::scalar_f32(v, dtype)?))
    }

    /// A 0-d int32 array.
    pub fn scalar_i32(v: i32) -> Result<Array> {
        Ok(Array::from_ptr(ffi::scalar_i32(v)?))
    }

    /// An array of `shape` filled with `v`.
    pub fn full(shape: &[i32], v: f32, dtype: Dtype) -> Result<Array> {
        Ok(Array::from_ptr(ffi::full(shape, v, dtype)?))
    }

    /// Zeros of `shape`.
    pub fn zeros(shape: &[i32], dtype: Dtype) -> Result<Array> {
        Self::full(shape, 0.0, dtype)
    }

    /// `[start, stop)` in steps of `step`.
    pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
        Ok(Array::from_ptr(ffi::arange(start, stop, step, dtype)?))
    }

    pub fn shape(&self) -> Vec<i32> {
        ffi::shape(self.raw())
    }

    /// Size of dimension `axis` (negative counts from the end).
    pub fn dim(&self, axis: i32) -> i32 {
        let s = self.shape();
        let n = s.len() as i32;
        let a = if axis < 0 { axis + n } else { axis };
        s[a as usize]
    }

    pub fn ndim(&self) -> usize {
        ffi::ndim(self.raw())
    }

    /// Number of elements.
    pub fn size(&self) -> usize {
        ffi::size(self.raw())
    }

    pub fn nbytes(&self) -> usize {
        ffi::nbytes(self.raw())
    }

    pub fn dtype(&self) -> Dtype {
        ffi::dtype(self.raw())
    }

    /// Evaluate this array (runs the graph that produces it).
    pub fn eval(&self) -> Result<()> {
        super::kernel_cache::wait_pending();
        Ok(ffi::eval_one(self.raw())?)
    }

    /// The elements, row-major, as raw bytes (evaluates).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        super::kernel_cache::wait_pending();
        Ok(ffi::to_bytes(self.raw())?)
    }

    /// The elements, row-major (evaluates). The dtype must be `T`'s.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let actual = self.dtype();
        if actual != T::DTYPE {
            return Err(MlxError::DtypeMismatch {
                what: "to_vec",
                expected: T::DTYPE,
                actual,
            });
        }
        let bytes = self.to_bytes()?;
        let n = bytes.len() / std::mem::size_of::<T>();
        let mut out = vec![T::default(); n];
        // SAFETY: out has exactly bytes.len() bytes of plain numeric T.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.as_mut_ptr() as *mut u8, bytes.len())
        };
        Ok(out)
    }

    /// The single element of a one-element array (evaluates).
    pub fn item<T: Element>(&self) -> Result<T> {
        if self.size() != 1 {
            return Err(MlxError::Invalid(format!(
                "item: array has {} elements, not 1",
                self.size()
            )));
        }
        Ok(self.to_vec::<T>()?[0])
    }

    /// MLX's own printout of the array (evaluates).
    pub fn describe(&self) -> Result<String> {
        super::kernel_cache::wait_pending();
        Ok(ffi::describe(self.raw())?)
    }
}

impl Clone for Array {
    fn clone(&self) -> Self {
        Array::from_ptr(ffi::clone_array(self.raw()))
    }
}

impl fmt::Debug for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Array(shape={:?}, dtype={:?})",
            self.shape(),
            self.dtype()
        )
    }
}

/// A list of arrays for the C++ side.
pub(super) struct ArrayList(pub(super) UniquePtr<ffi::ArrayVec>);

impl ArrayList {
    pub(super) fn new<'a>(items: impl IntoIterator<Item = &'a Array>) -> ArrayList {
        let mut v = ffi::array_vec_new();
        for a in items {
            ffi::array_vec_push(v.pin_mut(), a.raw());
        }
        ArrayList(v)
    }

    pub(super) fn raw(&self) -> &ffi::ArrayVec {
        self.0.as_ref().expect("ArrayVec is never null")
    }

    pub(super) fn into_vec(self) -> Result<Vec<Array>> {
        let n = ffi::array_vec_len(self.raw());
        (0..n)
            .map(|i| Ok(Array::from_ptr(ffi::array_vec_get(self.raw(), i)?)))
            .collect()
    }
}
