//! A small tensor type: shape, strides, dtype and storage offset over shared storage.
//!
//! Just enough for symmetric memory and its operators, not a general tensor library. A tensor
//! is a strided view of a [`Storage`]: heap memory, or a symmetric-memory segment that other
//! processes may read and write at the same time. For that reason tensors never hand out
//! `&[T]` or `&mut [T]` to their elements; data moves in and out through copies
//! ([`Tensor::copy_from_slice`], [`Tensor::to_vec`], [`Tensor::copy_from`]), and the raw
//! pointer is available to code that synchronizes with peers itself.

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};

/// A device tensors can live on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// A CUDA device (no backend yet).
    Cuda(usize),
}

impl Device {
    /// Parses `cpu`, `cuda` or `cuda:N`.
    pub fn parse(s: &str) -> Result<Device> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| Error::InvalidArgument(format!("unknown device {s:?} (expected cpu or cuda[:N])"))),
        }
    }

    pub(crate) fn require_cpu(self, what: &str) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(n) => Err(Error::Unsupported {
                what: format!("{what} on cuda:{n}"),
                needs: "a CUDA device and symmem's CUDA backend; this build has the CPU backend only".into(),
            }),
        }
    }
}

/// Element types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 8-bit integer.
    U8,
    /// Boolean, one byte (0 or 1).
    Bool,
    /// Unsigned 32-bit integer (signal pads).
    U32,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 | DType::Bool => 1,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// A stable code for this dtype, used in rendezvous checks.
    pub const fn code(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F64 => 2,
            DType::F16 => 3,
            DType::BF16 => 4,
            DType::I8 => 5,
            DType::I16 => 6,
            DType::I32 => 7,
            DType::I64 => 8,
            DType::U8 => 9,
            DType::Bool => 10,
            DType::U32 => 11,
        }
    }

    /// The dtype with this [`DType::code`].
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.code() == code)
    }

    /// Every dtype.
    pub const ALL: [DType; 11] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::Bool,
        DType::U32,
    ];

    /// Whether this is a floating-point type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::Bool => "bool",
            DType::U32 => "uint32",
        };
        f.write_str(s)
    }
}

/// A Rust type that is the element of some [`DType`]: any bit pattern of its size is a valid
/// value, so bytes from a peer can be read as it.
pub trait Element: bytemuck::Pod + Send + Sync + PartialEq + fmt::Debug + 'static {
    /// Its dtype.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(f32 => F32, f64 => F64, half::f16 => F16, half::bf16 => BF16, i8 => I8, i16 => I16, i32 => I32,
         i64 => I64, u8 => U8, u32 => U32);

fn dtype_matches(t: DType, want: DType) -> bool {
    // Booleans are stored as bytes and copied as u8.
    t == want || (t == DType::U8 && want == DType::Bool)
}

/// Memory a tensor views. Implementations keep `ptr()..ptr()+len()` valid for their lifetime.
///
/// # Safety
///
/// `ptr()` must point to `len()` bytes that stay allocated, readable and writable, and at the
/// same address, for as long as the storage is alive.
pub unsafe trait Storage: Send + Sync + fmt::Debug {
    /// The first byte.
    fn ptr(&self) -> *mut u8;
    /// The number of bytes.
    fn len(&self) -> usize;
    /// Whether it has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// For storage that is a window into a larger object owned by a layer above (a symmetric
    /// allocation): that object, and the byte offset of this storage's first byte in it. Only
    /// the layer that made it knows its type, and downcasts; this layer never looks.
    fn parent(&self) -> Option<(&(dyn std::any::Any + Send + Sync), usize)> {
        None
    }
    /// For memory in a shared-memory file owned by this process: the descriptor number and
    /// the file offset of this storage's first byte, so a peer can map it.
    fn shared_file(&self) -> Option<(i32, u64)> {
        None
    }
    /// For memory whose words other processes sleep on and signal (a symmetric allocation): a
    /// process-shared count, in the same shared memory, of the threads sleeping on any word of
    /// it. A peer's signal stored into it wakes sleepers only when the count is not zero.
    /// `None` (the default): every such store wakes.
    fn sleepers(&self) -> Option<&std::sync::atomic::AtomicU32> {
        None
    }
}

/// Heap memory, 64-byte aligned and zeroed.
struct Heap {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

const HEAP_ALIGN: usize = 64;

impl Heap {
    /// `len` zeroed bytes, or an error naming the size when the system will not give them (a
    /// size from a caller must never abort the process).
    fn zeroed(len: usize) -> Result<Heap> {
        if len == 0 {
            return Ok(Heap { ptr: std::ptr::NonNull::<[u8; HEAP_ALIGN]>::dangling().cast(), len });
        }
        let layout = std::alloc::Layout::from_size_align(len, HEAP_ALIGN)
            .map_err(|_| Error::InvalidArgument(format!("a tensor of {len} bytes is too large")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(ptr).ok_or_else(|| {
            Error::io(format!("allocate {len} bytes for a tensor"), std::io::ErrorKind::OutOfMemory.into())
        })?;
        Ok(Heap { ptr, len })
    }
}

impl Drop for Heap {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `zeroed` with exactly this layout, and freed only here.
            unsafe {
                std::alloc::dealloc(
                    self.ptr.as_ptr(),
                    std::alloc::Layout::from_size_align_unchecked(self.len, HEAP_ALIGN),
                )
            }
        }
    }
}

impl fmt::Debug for Heap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Heap({} bytes)", self.len)
    }
}

// SAFETY: Heap owns its allocation; sharing it across threads is as safe as the raw pointer
// accesses of its users, which go through copies (see the module docs).
unsafe impl Send for Heap {}
// SAFETY: as for Send.
unsafe impl Sync for Heap {}

// SAFETY: the allocation lives until Drop and never moves.
unsafe impl Storage for Heap {
    fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// Memory owned by something else (a NumPy array, a torch tensor), kept alive by `owner`.
struct External {
    ptr: *mut u8,
    len: usize,
    _owner: Box<dyn std::any::Any + Send + Sync>,
}

impl fmt::Debug for External {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "External({} bytes)", self.len)
    }
}

// SAFETY: the memory is valid while `owner` lives (the caller's promise in
// `Tensor::from_raw_parts`); accesses go through copies (see the module docs).
unsafe impl Send for External {}
// SAFETY: as for Send.
unsafe impl Sync for External {}

// SAFETY: `from_raw_parts`'s contract keeps [ptr, ptr+len) valid and fixed while `owner` lives,
// and the storage owns `owner`.
unsafe impl Storage for External {
    fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A strided view of shared storage.
#[derive(Clone)]
pub struct Tensor {
    storage: Arc<dyn Storage>,
    shape: Vec<usize>,
    /// Strides in elements.
    strides: Vec<usize>,
    /// Offset of element [0, 0, ...] in elements.
    offset: usize,
    dtype: DType,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("shape", &self.shape)
            .field("strides", &self.strides)
            .field("offset", &self.offset)
            .field("dtype", &self.dtype)
            .field("storage", &self.storage)
            .finish()
    }
}

/// Row-major strides of `shape`. Saturating: only a shape with a zero dimension can have
/// strides that do not fit (its numel does), and an empty view never uses them.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1]);
    }
    strides
}

/// The bytes a contiguous tensor of `shape` and `dtype` holds: an error naming the shape when
/// that does not fit in memory (at most `isize::MAX`, as Rust's allocations); 0 for a shape
/// with a zero dimension, however large the others.
pub fn nbytes_of(shape: &[usize], dtype: DType) -> Result<usize> {
    numel_of(shape)?
        .checked_mul(dtype.size())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} of {dtype} is too large")))
}

fn numel_of(shape: &[usize]) -> Result<usize> {
    if shape.contains(&0) {
        return Ok(0);
    }
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::InvalidArgument(format!("shape {shape:?} has more elements than fit in memory")))
}

impl Tensor {
    /// A zeroed, contiguous tensor on the heap.
    ///
    /// ```
    /// use symmem::tensor::{DType, Tensor};
    /// let t = Tensor::zeros(&[2, 3], DType::F32)?;
    /// assert_eq!(t.to_vec::<f32>()?, vec![0.0; 6]);
    /// # Ok::<(), symmem::Error>(())
    /// ```
    pub fn zeros(shape: &[usize], dtype: DType) -> Result<Tensor> {
        let bytes = nbytes_of(shape, dtype)?;
        Ok(Tensor::from_storage(Arc::new(Heap::zeroed(bytes)?), shape, dtype))
    }

    /// A 1-D `u8` tensor over `len` bytes at `ptr` that something else owns (a NumPy array, a
    /// torch tensor: the language bindings use this), kept alive by holding `owner`.
    ///
    /// # Safety
    ///
    /// `ptr` must point to `len` bytes that stay allocated, at the same address, for as long as
    /// `owner` is alive.
    pub unsafe fn from_raw_parts(ptr: *mut u8, len: usize, owner: Box<dyn std::any::Any + Send + Sync>) -> Tensor {
        Tensor::from_storage(Arc::new(External { ptr, len, _owner: owner }), &[len], DType::U8)
    }

    /// A view of this tensor's storage with another layout and dtype (PyTorch's `as_strided`
    /// after a `view(dtype)`): `shape` and `strides` (in elements of `dtype`) starting
    /// `byte_offset` bytes into the storage. The language bindings use it to name a part of a
    /// symmetric allocation that a foreign tensor views.
    ///
    /// ```
    /// use symmem::tensor::{DType, Tensor};
    /// let bytes = Tensor::from_slice(&[8], &[1u8, 0, 0, 0, 2, 0, 0, 0])?;
    /// let ints = bytes.reinterpret(DType::I32, &[1], &[1], 4)?;
    /// assert_eq!(ints.to_vec::<i32>()?, vec![2]);
    /// assert!(bytes.reinterpret(DType::I32, &[3], &[1], 0).is_err()); // past the end
    /// # Ok::<(), symmem::Error>(())
    /// ```
    pub fn reinterpret(&self, dtype: DType, shape: &[usize], strides: &[usize], byte_offset: usize) -> Result<Tensor> {
        if shape.len() != strides.len() {
            return Err(Error::InvalidArgument(format!("shape {shape:?} and strides {strides:?} differ in rank")));
        }
        if !byte_offset.is_multiple_of(dtype.size()) {
            return Err(Error::InvalidArgument(format!(
                "byte offset {byte_offset} is not a multiple of the {dtype} element size {}",
                dtype.size()
            )));
        }
        Tensor::view_of(self.storage.clone(), shape, strides, byte_offset / dtype.size(), dtype)
    }

    /// A contiguous tensor on the heap holding `data`.
    pub fn from_slice<T: Element>(shape: &[usize], data: &[T]) -> Result<Tensor> {
        let t = Tensor::zeros(shape, T::DTYPE)?;
        t.copy_from_slice(data)?;
        Ok(t)
    }

    /// A contiguous view of the start of `storage`, which must be large enough.
    pub(crate) fn from_storage(storage: Arc<dyn Storage>, shape: &[usize], dtype: DType) -> Tensor {
        Tensor { storage, strides: contiguous_strides(shape), shape: shape.to_vec(), offset: 0, dtype }
    }

    /// A view of `storage` with explicit layout; checks that every element lies inside it.
    pub(crate) fn view_of(
        storage: Arc<dyn Storage>,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        // Every element count and byte count of a tensor fits isize, as Rust's allocations do:
        // `numel`, `nbytes` and pointer offsets computed from them later never overflow.
        nbytes_of(shape, dtype)?;
        let t = Tensor { storage, shape: shape.to_vec(), strides: strides.to_vec(), offset, dtype };
        let end = t.extent_bytes()?;
        if end > t.storage.len() {
            return Err(Error::InvalidArgument(format!(
                "a view of shape {shape:?} at element offset {offset} of {dtype} needs {end} bytes but the storage has {}",
                t.storage.len()
            )));
        }
        Ok(t)
    }

    /// One past the last byte this view touches, from the start of the storage.
    /// Every step is checked: shapes, strides and offsets come from callers (and, through the
    /// language bindings, from users), and a wrapped extent would pass the bounds check.
    fn extent_bytes(&self) -> Result<usize> {
        let overflow = || {
            Error::InvalidArgument(format!(
                "a view of shape {:?} with strides {:?} at element offset {} of {} overflows the address space",
                self.shape, self.strides, self.offset, self.dtype
            ))
        };
        let es = self.dtype.size();
        if self.shape.contains(&0) {
            return self.offset.checked_mul(es).ok_or_else(overflow);
        }
        self.shape
            .iter()
            .zip(&self.strides)
            .try_fold(self.offset, |acc, (&d, &s)| (d - 1).checked_mul(s).and_then(|x| acc.checked_add(x)))
            .and_then(|last| last.checked_add(1))
            .and_then(|n| n.checked_mul(es))
            .ok_or_else(overflow)
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Strides, in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// The element offset of this view in its storage.
    pub fn storage_offset(&self) -> usize {
        self.offset
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The number of elements. A shape with a zero dimension holds none, whatever its other
    /// dimensions (their product alone may overflow: `[4, 2^62, 0]` is a valid empty view);
    /// otherwise the product was checked when the tensor was made.
    pub fn numel(&self) -> usize {
        if self.shape.contains(&0) { 0 } else { self.shape.iter().product() }
    }

    /// The number of bytes of its elements.
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    /// Whether the elements are laid out contiguously in row-major order.
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1;
        for (&d, &s) in self.shape.iter().zip(&self.strides).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected = expected.saturating_mul(d);
        }
        true
    }

    /// The address of element [0, 0, ...]. Other processes may write this memory at any time;
    /// whoever dereferences it must synchronize with them.
    pub fn data_ptr(&self) -> *mut u8 {
        // The offset is inside the storage (checked when the view was made).
        self.storage.ptr().wrapping_add(self.offset * self.dtype.size())
    }

    /// The storage this tensor views.
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }

    /// Whether two tensors view the same storage.
    pub fn same_storage(&self, other: &Tensor) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.storage), Arc::as_ptr(&other.storage))
    }

    /// The view of `len` entries of dimension `dim` starting at `start`; shares storage.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        let Some(&size) = self.shape.get(dim) else {
            return Err(Error::InvalidArgument(format!(
                "narrow: dim {dim} out of range for {}-d tensor",
                self.shape.len()
            )));
        };
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::InvalidArgument(format!(
                "narrow: [{start}, {start}+{len}) is outside dimension {dim} of size {size}"
            )));
        }
        let mut t = self.clone();
        t.offset += start * self.strides[dim];
        t.shape[dim] = len;
        Ok(t)
    }

    /// The 2-D tile `rows × cols` of a 2-D tensor (a strided view; shares storage).
    pub fn tile(&self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> Result<Tensor> {
        if self.shape.len() != 2 {
            return Err(Error::InvalidArgument(format!("tile of a {}-d tensor; expected 2-d", self.shape.len())));
        }
        self.narrow(0, rows.start, rows.len())?.narrow(1, cols.start, cols.len())
    }

    /// The same elements with another shape; the tensor must be contiguous.
    pub fn view(&self, shape: &[usize]) -> Result<Tensor> {
        if !self.is_contiguous() {
            return Err(Error::InvalidArgument("view of a non-contiguous tensor".into()));
        }
        if numel_of(shape)? != self.numel() {
            return Err(Error::InvalidArgument(format!(
                "view: shape {shape:?} does not have {} elements",
                self.numel()
            )));
        }
        let mut t = self.clone();
        t.shape = shape.to_vec();
        t.strides = contiguous_strides(shape);
        Ok(t)
    }

    /// The byte offsets of every element, in row-major order.
    fn element_offsets(&self) -> impl Iterator<Item = usize> + '_ {
        let n = self.numel();
        let es = self.dtype.size();
        let mut index = vec![0usize; self.shape.len()];
        (0..n).map(move |i| {
            if i > 0 {
                for d in (0..index.len()).rev() {
                    index[d] += 1;
                    if index[d] < self.shape[d] {
                        break;
                    }
                    index[d] = 0;
                }
            }
            let e: usize = index.iter().zip(&self.strides).map(|(i, s)| i * s).sum();
            (self.offset + e) * es
        })
    }

    /// Runs of contiguous bytes covering the view in row-major order: `(byte offset, bytes)`.
    fn runs(&self) -> Vec<(usize, usize)> {
        let es = self.dtype.size();
        if self.is_contiguous() {
            return vec![(self.offset * es, self.nbytes())];
        }
        // The innermost dimension is a run when its stride is 1.
        let inner = self.shape.last().copied().unwrap_or(1);
        if self.strides.last() == Some(&1) && inner > 0 {
            let outer = Tensor {
                storage: self.storage.clone(),
                shape: self.shape[..self.shape.len() - 1].to_vec(),
                strides: self.strides[..self.strides.len() - 1].to_vec(),
                offset: self.offset,
                dtype: self.dtype,
            };
            return outer.element_offsets().map(|o| (o, inner * es)).collect();
        }
        self.element_offsets().map(|o| (o, es)).collect()
    }

    fn check_dtype<T: Element>(&self, what: &str) -> Result<()> {
        if !dtype_matches(T::DTYPE, self.dtype) {
            return Err(Error::InvalidArgument(format!(
                "{what}: tensor is {} but the slice is {}",
                self.dtype,
                T::DTYPE
            )));
        }
        Ok(())
    }

    /// Copies `data` into the tensor's elements in row-major order.
    pub fn copy_from_slice<T: Element>(&self, data: &[T]) -> Result<()> {
        self.check_dtype::<T>("copy_from_slice")?;
        if data.len() != self.numel() {
            return Err(Error::InvalidArgument(format!(
                "copy_from_slice: {} values for a tensor of {} elements",
                data.len(),
                self.numel()
            )));
        }
        let src: &[u8] = bytemuck::cast_slice(data);
        let base = self.storage.ptr();
        let mut at = 0;
        for (off, len) in self.runs() {
            // SAFETY: every run lies inside the storage (checked when the view was made), `src`
            // has exactly nbytes bytes, and a slice we borrow cannot overlap storage we own
            // exclusively through raw pointers.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(at), base.add(off), len) };
            at += len;
        }
        Ok(())
    }

    /// The elements in row-major order.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.check_dtype::<T>("to_vec")?;
        let mut out = vec![T::zeroed(); self.numel()];
        let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
        let base = self.storage.ptr();
        let mut at = 0;
        for (off, len) in self.runs() {
            // SAFETY: as in copy_from_slice, with the roles swapped.
            unsafe { std::ptr::copy_nonoverlapping(base.add(off), dst.as_mut_ptr().add(at), len) };
            at += len;
        }
        Ok(out)
    }

    /// Sets every element to `value`.
    pub fn fill<T: Element>(&self, value: T) -> Result<()> {
        self.copy_from_slice(&vec![value; self.numel()])
    }

    /// Copies `src` (same shape and dtype, any strides) into this tensor.
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        if src.shape != self.shape || src.dtype != self.dtype {
            return Err(Error::InvalidArgument(format!(
                "copy_from: source is {:?} {} but destination is {:?} {}",
                src.shape, src.dtype, self.shape, self.dtype
            )));
        }
        if self.is_contiguous() && src.is_contiguous() {
            // SAFETY: both ranges lie inside their storages; `copy` allows overlap.
            unsafe { std::ptr::copy(src.data_ptr(), self.data_ptr(), self.nbytes()) };
            return Ok(());
        }
        let (dst_base, src_base) = (self.storage.ptr(), src.storage.ptr());
        let es = self.dtype.size();
        for (d, s) in self.element_offsets().zip(src.element_offsets()) {
            // SAFETY: both offsets index elements inside their storages.
            unsafe { std::ptr::copy(src_base.add(s), dst_base.add(d), es) };
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrow_and_tiles_are_strided_views() {
        let t = Tensor::from_slice(&[3, 4], &(0..12).collect::<Vec<i32>>()).unwrap();
        let tile = t.tile(1..3, 1..3).unwrap();
        assert_eq!(tile.shape(), &[2, 2]);
        assert_eq!(tile.strides(), &[4, 1]);
        assert!(!tile.is_contiguous());
        assert_eq!(tile.to_vec::<i32>().unwrap(), vec![5, 6, 9, 10]);
        tile.copy_from_slice(&[-1, -2, -3, -4]).unwrap();
        assert_eq!(t.to_vec::<i32>().unwrap(), vec![0, 1, 2, 3, 4, -1, -2, 7, 8, -3, -4, 11]);
        let col = t.narrow(1, 3, 1).unwrap();
        assert_eq!(col.to_vec::<i32>().unwrap(), vec![3, 7, 11]);
        assert!(t.narrow(1, 3, 2).is_err());
        assert!(t.narrow(2, 0, 1).is_err());
    }

    #[test]
    fn copies_check_dtype_and_size() {
        let t = Tensor::zeros(&[4], DType::BF16).unwrap();
        assert!(t.copy_from_slice(&[1.0f32; 4]).is_err());
        let v = [half::bf16::from_f32(1.5); 4];
        t.copy_from_slice(&v).unwrap();
        assert_eq!(t.to_vec::<half::bf16>().unwrap(), v);
        assert!(t.copy_from_slice(&v[..3]).is_err());
        let b = Tensor::zeros(&[2], DType::Bool).unwrap();
        b.copy_from_slice(&[1u8, 0]).unwrap();
        assert_eq!(b.to_vec::<u8>().unwrap(), vec![1, 0]);
    }

    #[test]
    fn copy_between_strided_views() {
        let a = Tensor::from_slice(&[2, 3], &[1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let b = Tensor::zeros(&[4, 4], DType::F64).unwrap();
        b.tile(1..3, 0..3).unwrap().copy_from(&a).unwrap();
        assert_eq!(b.narrow(0, 2, 1).unwrap().to_vec::<f64>().unwrap(), vec![4.0, 5.0, 6.0, 0.0]);
        let v = b.view(&[16]).unwrap();
        assert_eq!(v.numel(), 16);
        assert!(b.tile(0..2, 0..2).unwrap().view(&[4]).is_err());
        assert_eq!(DType::from_code(DType::BF16.code()), Some(DType::BF16));
    }
}
