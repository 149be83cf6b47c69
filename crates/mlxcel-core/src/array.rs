//! [`Array`]: the owned, cheaply clonable handle over an MLX array.

use cxx::UniquePtr;

use crate::ffi::bridge::{self, ArrayVec, MlxArray};
use crate::{Dtype, Error, Result};

/// An MLX array: a node of MLX's lazy computation graph. Cloning copies a reference-counted
/// handle, not the data. Ops return new arrays lazily; [`Array::eval`] (or reading the data)
/// computes them.
///
/// `Array` is neither `Send` nor `Sync`: MLX's graph nodes share state between clones without
/// synchronisation, so evaluating clones of one graph from two threads at once is a data race.
/// Move host data (`Vec<T>`) between threads instead.
///
/// ```
/// use mlxcel_core::{Array, Dtype};
///
/// let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
/// let b = a.add_scalar(0.5)?;
/// assert_eq!(b.shape(), vec![2, 2]);
/// assert_eq!(b.dtype()?, Dtype::Float32);
/// assert_eq!(b.to_vec::<f32>()?, vec![1.5, 2.5, 3.5, 4.5]);
/// # Ok::<(), mlxcel_core::Error>(())
/// ```
pub struct Array {
    raw: UniquePtr<MlxArray>,
}

impl Clone for Array {
    fn clone(&self) -> Self {
        // Copying an mlx::core::array copies a shared_ptr; it cannot fail short of allocation
        // failure, which aborts in Rust as well.
        Array {
            raw: bridge::array_clone(self.as_ref()).expect("cloning an MLX array handle"),
        }
    }
}

impl std::fmt::Debug for Array {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Array")
            .field("shape", &self.shape())
            .field("dtype", &self.dtype().ok())
            .finish()
    }
}

/// Host element types an [`Array`] can be created from and copied into.
pub trait HostElement: Copy + Default + 'static {
    /// The MLX dtype with this type's layout.
    const DTYPE: Dtype;
}

macro_rules! host_elements {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(impl HostElement for $t { const DTYPE: Dtype = Dtype::$d; })*
    };
}

host_elements! {
    bool => Bool, u8 => Uint8, u16 => Uint16, u32 => Uint32, u64 => Uint64,
    i8 => Int8, i16 => Int16, i32 => Int32, i64 => Int64,
    half::f16 => Float16, half::bf16 => Bfloat16, f32 => Float32, f64 => Float64,
}

pub(crate) fn check_shape(shape: &[i32]) -> Result<()> {
    if let Some(d) = shape.iter().find(|d| **d < 0) {
        return Err(Error::Invalid(format!(
            "negative dimension {d} in shape {shape:?}"
        )));
    }
    Ok(())
}

impl Array {
    pub(crate) fn from_raw(raw: UniquePtr<MlxArray>) -> Array {
        Array { raw }
    }

    pub(crate) fn as_ref(&self) -> &MlxArray {
        // A live Array always holds a non-null handle: every constructor goes through a bridge
        // function that returns a fresh unique_ptr or an Err.
        self.raw.as_ref().expect("non-null MLX array handle")
    }

    pub(crate) fn as_ptr(&self) -> *const MlxArray {
        self.as_ref() as *const MlxArray
    }

    /// Copies `data` into a new array of the given shape.
    pub fn from_slice<T: HostElement>(data: &[T], shape: &[i32]) -> Result<Array> {
        check_shape(shape)?;
        // SAFETY: `T` is one of the plain-old-data element types above; viewing its slice as
        // bytes is sound (no padding, any bit pattern is read as-is by MLX).
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data))
        };
        Self::from_bytes(bytes, shape, T::DTYPE)
    }

    /// Copies raw little-endian element bytes (as stored in safetensors) into a new array.
    pub fn from_bytes(bytes: &[u8], shape: &[i32], dtype: Dtype) -> Result<Array> {
        check_shape(shape)?;
        Ok(Array::from_raw(bridge::array_from_bytes(
            bytes, shape, dtype,
        )?))
    }

    /// `nbytes` bytes at byte `offset` of `file` as a new array in device memory on MLX's
    /// CUDA backend: read (not mapped) into pinned staging buffers by the policy's
    /// `cuda_load_readers` threads and copied from them by the CUDA driver
    /// (`cpp/cuda_load.cc`). `None` where the CUDA driver is not in the process.
    pub fn from_file_on_device(
        file: &std::fs::File,
        offset: u64,
        nbytes: usize,
        shape: &[i32],
        dtype: Dtype,
    ) -> Result<Option<Array>> {
        use std::os::fd::AsRawFd;
        check_shape(shape)?;
        let (readers, pooled) =
            crate::policy::with(|p| (p.cuda_load_readers as i32, p.cuda_load_pool));
        let raw = bridge::array_from_file_on_device(
            file.as_raw_fd(),
            offset,
            nbytes,
            shape,
            dtype,
            readers,
            pooled,
        )?;
        Ok((!raw.is_null()).then(|| Array::from_raw(raw)))
    }

    /// An array over `bytes` without copying them where MLX's allocator can wrap foreign
    /// memory (the CPU backend), else a copy. `owner` keeps `bytes` alive: it is dropped once
    /// MLX no longer uses them.
    ///
    /// # Safety
    /// `bytes` must stay valid and unmodified for as long as `owner` lives.
    pub unsafe fn borrowing_bytes(
        bytes: &[u8],
        shape: &[i32],
        dtype: Dtype,
        owner: Box<dyn Send + Sync>,
    ) -> Result<Array> {
        check_shape(shape)?;
        let owner = Box::new(crate::ffi::BorrowedBytesOwner(owner));
        // SAFETY: forwarded from the caller.
        Ok(Array::from_raw(unsafe {
            bridge::array_borrowing_bytes(bytes, shape, dtype, owner)?
        }))
    }

    /// Address of the first element (whether two arrays share memory; zero-copy checks).
    pub fn data_address(&self) -> Result<usize> {
        Ok(bridge::array_data_address(self.as_ref())?)
    }

    /// Whether nothing else holds this array or its buffer, so writing into the buffer in place
    /// changes no other array (what MLX checks before donating an input's buffer).
    pub fn is_exclusive(&self) -> Result<bool> {
        Ok(bridge::array_is_donatable(self.as_ref())?)
    }

    /// Copies `bytes` into this array's buffer from byte `offset`, in place, and returns
    /// whether it did. Only where that changes nothing but this array: evaluated (done here),
    /// row-major with no gaps, and held by nothing else ([`Array::is_exclusive`]); otherwise
    /// nothing is written and the caller updates it the functional way (`slice_update`).
    ///
    /// On the CPU backend this is one `memcpy`, where MLX's own copy for such an update goes
    /// element by element (~0.3-0.75 ms per MiB measured on the 2-core machine). On MLX's CUDA
    /// backend it is one driver copy into the device buffer, after the device's queued work:
    /// MLX's way copies the bytes into a new unified-memory array whose pages the GPU then
    /// faults in one by one (2-3 ms per 2.5 MB expert measured on an H200). Elsewhere (a
    /// backend without either) nothing is written.
    pub fn write_bytes_in_place(&mut self, offset: usize, bytes: &[u8]) -> Result<bool> {
        let end = offset.checked_add(bytes.len());
        if end.is_none_or(|end| end > self.nbytes()) {
            return Err(Error::Invalid(format!(
                "in-place write of {} bytes at {offset} past the end of a {}-byte array",
                bytes.len(),
                self.nbytes()
            )));
        }
        self.eval()?;
        if !self.is_exclusive()? || !self.is_row_contiguous()? {
            return Ok(false);
        }
        if crate::default_device()? != crate::Device::Cpu {
            return Ok(bridge::write_device_bytes(self.as_ref(), offset, bytes)?);
        }
        let start = self.data_address()? + offset;
        // SAFETY: the range lies inside this evaluated, row-contiguous array's host buffer
        // (checked above), which no other array, view or pending computation holds
        // (`is_exclusive`: MLX's own test before it donates a buffer), and `&mut self` keeps
        // this handle from being read meanwhile.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), start as *mut u8, bytes.len());
        }
        Ok(true)
    }

    /// Whether the (evaluated) array is laid out row-major with no gaps: not a strided view
    /// such as a slice along an inner axis, so element `i` is at offset `i` from
    /// [`Array::data_address`].
    pub fn is_row_contiguous(&self) -> Result<bool> {
        Ok(bridge::array_is_row_contiguous(self.as_ref())?)
    }

    /// A zero-dimensional array holding `value` converted to `dtype`.
    pub fn scalar(value: f64, dtype: Dtype) -> Result<Array> {
        Ok(Array::from_raw(bridge::array_scalar_f64(value, dtype)?))
    }

    /// A zero-dimensional array of `value` in this array's dtype, so that arithmetic with it
    /// keeps the dtype (MLX promotes `bf16 * f32-scalar` to f32).
    pub fn scalar_like(&self, value: f64) -> Result<Array> {
        Array::scalar(value, self.dtype()?)
    }

    /// The dimensions, outermost first (empty for a scalar).
    pub fn shape(&self) -> Vec<i32> {
        // Reading the shape of a live array does not throw.
        bridge::array_shape(self.as_ref()).unwrap_or_default()
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.shape().len()
    }

    /// The size of `axis` (negative counts from the end).
    pub fn dim(&self, axis: i32) -> Result<i32> {
        let shape = self.shape();
        let n = shape.len() as i32;
        let i = if axis < 0 { axis + n } else { axis };
        if i < 0 || i >= n {
            return Err(Error::Invalid(format!(
                "axis {axis} out of range for shape {shape:?}"
            )));
        }
        Ok(shape[i as usize])
    }

    /// The element type.
    pub fn dtype(&self) -> Result<Dtype> {
        Ok(bridge::array_dtype(self.as_ref())?)
    }

    /// Number of elements.
    pub fn size(&self) -> usize {
        bridge::array_size(self.as_ref()).unwrap_or(0)
    }

    /// Bytes of the elements (`size() * dtype.size_of()`; packed sub-byte data counts its storage).
    pub fn nbytes(&self) -> usize {
        bridge::array_nbytes(self.as_ref()).unwrap_or(0)
    }

    /// Whether the array's data is already computed, so reading it waits for nothing (arrays
    /// made from host data, or evaluated ones); `false` for pending graph nodes.
    pub fn is_available(&self) -> bool {
        bridge::array_is_available(self.as_ref()).unwrap_or(false)
    }

    /// Computes the array (and everything it depends on).
    pub fn eval(&self) -> Result<()> {
        Ok(bridge::array_eval(self.as_ref())?)
    }

    /// Copies the elements out in row-major order; views (transposed, sliced, broadcast) are
    /// made dense first. `T` must match the dtype exactly.
    pub fn to_vec<T: HostElement>(&self) -> Result<Vec<T>> {
        let dtype = self.dtype()?;
        if dtype != T::DTYPE {
            return Err(Error::DtypeMismatch {
                array: dtype,
                requested: T::DTYPE,
            });
        }
        let mut out = vec![T::default(); self.size()];
        // SAFETY: `out` is a live buffer of exactly size * size_of::<T>() bytes of a plain type.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                out.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(out.as_slice()),
            )
        };
        bridge::array_copy_to_host(self.as_ref(), bytes)?;
        Ok(out)
    }

    /// The raw element bytes in row-major order (any dtype), as safetensors stores them.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.nbytes()];
        bridge::array_copy_to_host(self.as_ref(), &mut out)?;
        Ok(out)
    }

    /// The single element of a one-element array as `f64`.
    pub fn item(&self) -> Result<f64> {
        Ok(bridge::array_item_f64(self.as_ref())?)
    }

    pub(crate) fn unary_op(&self, name: &str) -> Result<Array> {
        Ok(Array::from_raw(bridge::unary_op(name, self.as_ref())?))
    }

    pub(crate) fn binary_op(&self, name: &str, other: &Array) -> Result<Array> {
        Ok(Array::from_raw(bridge::binary_op(
            name,
            self.as_ref(),
            other.as_ref(),
        )?))
    }

    pub(crate) fn reduce_op(&self, name: &str, axes: &[i32], keepdims: bool) -> Result<Array> {
        Ok(Array::from_raw(bridge::reduce_op(
            name,
            self.as_ref(),
            axes,
            keepdims,
        )?))
    }
}

// The element-wise and reduction methods generated from `ops.table` by build.rs.
include!(concat!(env!("OUT_DIR"), "/ops_table.rs"));

/// A list of arrays on the C++ side, for ops that take or return several.
pub(crate) struct ArrayList {
    raw: UniquePtr<ArrayVec>,
}

impl ArrayList {
    pub(crate) fn new<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> Result<ArrayList> {
        let mut raw = bridge::new_array_vec()?;
        for a in arrays {
            bridge::array_vec_push(raw.pin_mut(), a.as_ref())?;
        }
        Ok(ArrayList { raw })
    }

    pub(crate) fn from_raw(raw: UniquePtr<ArrayVec>) -> ArrayList {
        ArrayList { raw }
    }

    pub(crate) fn as_ref(&self) -> &ArrayVec {
        self.raw.as_ref().expect("non-null MLX array list")
    }

    pub(crate) fn into_vec(self) -> Result<Vec<Array>> {
        let n = bridge::array_vec_len(self.as_ref())?;
        (0..n)
            .map(|i| Ok(Array::from_raw(bridge::array_vec_get(self.as_ref(), i)?)))
            .collect()
    }
}

/// Evaluates several arrays together (one graph traversal, shared work computed once).
pub fn eval_all<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> Result<()> {
    let list = ArrayList::new(arrays)?;
    Ok(bridge::eval_all(list.as_ref())?)
}

/// Schedules the arrays for evaluation and returns at once; a later read or `eval` waits.
pub fn async_eval_all<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> Result<()> {
    let list = ArrayList::new(arrays)?;
    Ok(bridge::async_eval_all(list.as_ref())?)
}

/// How many arrays of each primitive kind evaluating `arrays` would compute (those not yet
/// evaluated or scheduled), most frequent first. MLX's per-array host cost makes this count the
/// main driver of a GPU decode step's time.
pub fn graph_census<'a>(
    arrays: impl IntoIterator<Item = &'a Array>,
) -> Result<Vec<(String, usize)>> {
    let list = ArrayList::new(arrays)?;
    let text = bridge::graph_census(list.as_ref())?;
    let mut counts: Vec<(String, usize)> = text
        .lines()
        .filter_map(|line| {
            let (name, n) = line.rsplit_once(' ')?;
            Some((name.to_string(), n.parse().ok()?))
        })
        .collect();
    counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(counts)
}
